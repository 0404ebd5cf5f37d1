"""Where the Engram tables of a loaded model live (V4.1-Flash: ≈203 GB of its 510 GB).

    replicated   every rank holds every table (tiny models)
    host         one copy per node in shared memory (``shm_dir``, default /dev/shm), mapped by
                 every rank of the node; on CUDA it is registered (pinned) and the lookup
                 kernel reads it over UVA
    sharded      rank r of the gang holds rows [r*per, (r+1)*per) of each table; a lookup
                 sends row ids to their owners and gets the rows back (``ep.sharded_rows``)

All three give the same rows, so the same outputs. The Router deployment decides the mode
and the host copy's name; :func:`place_engram` applies it to one rank's model.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from app.model.engram import Engram
from app.model.ep import EPGroup

logger = logging.getLogger(__name__)

EngramPlacement = Literal["replicated", "host", "sharded"]
ENGRAM_PLACEMENTS: tuple[str, ...] = ("replicated", "host", "sharded")
DEFAULT_SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class EngramBytes:
    """Table bytes one rank holds privately, and bytes it maps from its node's shared copy."""

    private: int
    shared: int

    def report(self) -> dict[str, int]:
        return {"engram_private_bytes": self.private, "engram_shared_bytes": self.shared}


def _engrams(model: nn.Module) -> list[Engram]:
    return [m for m in model.modules() if isinstance(m, Engram)]


def engram_bytes(model: nn.Module) -> EngramBytes:
    """What ``model``'s Engram tables cost this rank (a host table counts as shared)."""
    private = shared = 0
    for m in _engrams(model):
        t = m.embed.weight
        n = t.numel() * t.element_size()
        if getattr(m, "host_path", None) is not None:
            shared += n
        else:
            private += n
    return EngramBytes(private, shared)


def host_table(table: torch.Tensor, path: Path) -> torch.Tensor:
    """``table``'s rows in the shared file ``path`` (written once per node: the first rank
    writes a private temporary and links it in; the others map what is there)."""
    nbytes = table.numel() * table.element_size()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(table.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        try:
            os.link(tmp, path)  # atomic: fails if another rank linked its copy first
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    if path.stat().st_size != nbytes:
        raise RuntimeError(f"{path}: {path.stat().st_size} bytes, the table has {nbytes}")
    mapped = torch.from_file(str(path), shared=True, size=table.numel(), dtype=table.dtype)
    return mapped.view(table.shape)


def _pin(t: torch.Tensor) -> None:
    """Register a mapped host table with CUDA so GPU kernels read it over UVA."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of an Engram host table failed ({err})")


def place_engram(
    model: nn.Module,
    mode: EngramPlacement,
    group: EPGroup | None = None,
    key: str = "fathom-engram",
    shm_dir: str | Path = DEFAULT_SHM_DIR,
) -> EngramBytes:
    """Apply ``mode`` to every Engram table of a loaded ``model`` (``group``: the gang, for
    ``sharded``; ``key``: the node-wide name of the ``host`` copies). -> bytes per rank."""
    if mode not in ENGRAM_PLACEMENTS:
        raise ValueError(f"engram_placement must be one of {ENGRAM_PLACEMENTS}, got {mode!r}")
    if mode == "sharded" and (group is None or group.size < 2):
        raise ValueError("sharded Engram tables need a gang of at least 2 ranks")
    for m in _engrams(model):
        table = m.embed.weight
        if mode == "host":
            path = Path(shm_dir) / f"{key}-layer{m.layer_index}.bin"
            mapped = host_table(table, path)
            if table.is_cuda:
                _pin(mapped)
            m.embed.weight = nn.Parameter(mapped, requires_grad=False)
            m.host_path = path
        elif mode == "sharded":
            assert group is not None
            per = -(-table.shape[0] // group.size)
            start = group.rank * per
            part = table[start : start + per].clone()
            m.embed.weight = nn.Parameter(part, requires_grad=False)
            m.shard(start, per, group)
    used = engram_bytes(model)
    logger.info("Engram tables %s: %.1f MiB private, %.1f MiB shared per rank", mode,
                used.private / 2**20, used.shared / 2**20)  # fmt: skip
    return used


__all__ = [
    "DEFAULT_SHM_DIR",
    "ENGRAM_PLACEMENTS",
    "EngramBytes",
    "EngramPlacement",
    "engram_bytes",
    "host_table",
    "place_engram",
]
