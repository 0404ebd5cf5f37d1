"""Random weights in an official checkpoint's layout (``load_format="dummy"``), as vLLM's
``--load-format dummy``: the loader reads them through the same plan, packing and install
as a checkpoint's tensors, so shapes, dtypes and formats are the real loader's.

:class:`RandomCheckpoint` serves the names, stored dtypes and shapes the loader derives from
config.json (``app.model.checkpoint.stored_layout``) and draws each tensor on the target device
when it is read, from a generator seeded by (seed, name): the same seed gives the same
weights whatever the reading order or the expert shard. Magnitudes keep a 40-layer forward
finite:

    fp8 e4m3 weight + e8m0 block scales   codes ~ N(0, 1), scale 2^round(log2(1/sqrt(fan_in)))
    fp4 packed experts + e8m0 scales      uniform codes (rms 2.93), scale as above / 2.93
    rowwise fp8 Engram tables             codes ~ N(0, 1), scale 1
    norms, mHC scales, Engram q/k weights 1 + 0.1 N(0, 1)
    biases, sinks, mHC bases, ape         0.1 N(0, 1)
    embedding                             N(0, 1)
    other matrices (router, heads, ...)   N(0, 1) / sqrt(fan_in)
    tid2eid                               distinct experts per token
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch

from app.model.checkpoint import LoadFormatError, TensorSpec, stored_layout
from app.model.config import ModelConfig
from kernels.quant import E8M0_BIAS, FP4_VALUES

# Name rules of the values (shared with the tiny checkpoint writer, app.model.tiny).
ONE_PLUS = re.compile(r"(?:norm\.weight|hc_\w+_scale|engram\.[qk]_weight)$")
SMALL = re.compile(r"(?:hc_\w+_base|attn_sink|gate\.bias(?:_vl)?|\.ape)$")
TABLE = re.compile(r"(?:^embed\.weight|engram\.embed\.weight)$")

_FLOATS = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_INTS = {"I32": torch.int32, "I64": torch.int64}
_FP4_RMS = math.sqrt(sum(v * v for v in FP4_VALUES) / len(FP4_VALUES))  # uniform codes: 2.93
_SOURCE = "random weights (load_format dummy)"


def refuse_weights(path: str | Path) -> None:
    """Raise a :class:`~app.model.checkpoint.LoadFormatError` when ``path`` holds a
    checkpoint's weights (``*.safetensors`` or its index), which ``load_format="dummy"``
    would ignore."""
    root = Path(path)
    found = sorted(p.name for p in root.iterdir()
                   if p.name.endswith((".safetensors", ".safetensors.index.json")))  # fmt: skip
    if found:
        more = f" and {len(found) - 1} more" if len(found) > 1 else ""
        raise LoadFormatError(
            f"load_format 'dummy' draws random weights, but {root} holds a checkpoint "
            f"({found[0]}{more}): set load_format 'auto' to load it, or point model at a "
            "directory with only config.json and the tokenizer files"
        )


class RandomCheckpoint:
    """A checkpoint source (:class:`~app.model.checkpoint.CheckpointSource`) of random tensors.

    ``layout``: checkpoint name -> (safetensors dtype, stored shape), every quantized
    weight with its ``.scale``; ``root``: the model directory (for messages)."""

    source = _SOURCE

    def __init__(
        self,
        root: Path,
        layout: Mapping[str, tuple[str, tuple[int, ...]]],
        device: torch.device,
        seed: int = 0,
    ) -> None:
        self.root = root
        self.layout = dict(layout)
        self.weight_map = dict.fromkeys(self.layout, _SOURCE)
        self.device = device
        self.seed = seed

    def header(self, name: str) -> tuple[str, tuple[int, ...]]:
        return self.layout[name]

    def where(self, name: str) -> str:
        return f"{self.root} ({_SOURCE})"

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` drawn on the device (its own generator: order-independent)."""
        g = torch.Generator(device=self.device)
        g.manual_seed((self.seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63))
        st, shape = self.layout[name]
        if name.endswith(".scale"):
            return self._scale(name, st, shape)
        if st == "F8_E4M3":  # fp8 block / rowwise codes
            x = torch.empty(shape, dtype=torch.bfloat16, device=self.device).normal_(generator=g)
            return x.to(torch.float8_e4m3fn)
        if st in ("I8", "U8"):  # packed fp4: two uniform E2M1 codes per byte
            t = torch.randint(-128, 128, shape, dtype=torch.int8, device=self.device, generator=g)
            return t if st == "I8" else t.view(torch.uint8)
        if st in _INTS:
            return self._tid2eid(name, shape, g).to(_INTS[st])
        if st not in _FLOATS:
            raise ValueError(f"'{name}': no random values for stored dtype {st}")
        x = torch.empty(shape, dtype=_FLOATS[st], device=self.device).normal_(generator=g)
        if ONE_PLUS.search(name):
            return x.mul_(0.1).add_(1.0)
        if TABLE.search(name):
            return x
        if len(shape) == 2 and not SMALL.search(name):
            return x.mul_(1 / math.sqrt(shape[1]))
        return x.mul_(0.1)

    def _scale(self, name: str, st: str, shape: tuple[int, ...]) -> torch.Tensor:
        """One e8m0 code for every block of the weight: values of rms ~ 1/sqrt(fan_in)
        (Engram tables: 1), given the rms of the weight's codes."""
        weight = name.removesuffix(".scale") + ".weight"
        wst, wshape = self.layout[weight]
        fp4 = wst in ("I8", "U8")
        if TABLE.search(weight):
            exp = 0
        else:
            fan_in = wshape[-1] * (2 if fp4 else 1)
            exp = round(-math.log2((_FP4_RMS if fp4 else 1.0) * math.sqrt(fan_in)))
        code = torch.full(shape, E8M0_BIAS + exp, dtype=torch.uint8, device=self.device)
        return code if st == "U8" else code.view(torch.float8_e8m0fnu)

    def _tid2eid(self, name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
        """[vocab, k] distinct experts per token, out of the gate's experts."""
        n_experts = self.layout[name.removesuffix("tid2eid") + "weight"][1][0]
        vocab, k = shape
        r = torch.rand(vocab, n_experts, generator=g, device=self.device)
        return r.topk(k, dim=1).indices


def random_source(
    root: Path,
    expected: Mapping[str, TensorSpec],
    cfg: ModelConfig,
    device: torch.device,
    seed: int = 0,
) -> RandomCheckpoint:
    """Random tensors in the official layout of every tensor in ``expected``
    (:func:`~app.model.checkpoint.stored_layout`), drawn on ``device`` as they are read."""
    layout = {n: (st, shape) for name, spec in expected.items()
              for n, st, shape in stored_layout(name, tuple(spec.shape), cfg)}  # fmt: skip
    return RandomCheckpoint(root, layout, device, seed)
