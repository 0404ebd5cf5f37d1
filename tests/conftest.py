"""Shared fixtures: tiny configs, randomly initialized tiny models (no checkpoint I/O)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Triton kernels run under the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from app.model.config import ModelConfig
from app.model.engram_hash import compressed_token_map
from app.model.model import DeepseekModel
from app.model.tiny_config import tiny_config_v4, tiny_config_v41
from app.model.tokenizer import build_tiny_tokenizer


def _cheap_nested_lang_patch() -> None:
    """Under TRITON_INTERPRET=1, each call of a @triton.jit helper from a kernel re-patches
    triton.language (``interpreter._patch_lang``: an ``inspect.getmembers`` scan of tl,
    tl.tensor and tl.math, a new wrapper per builtin), though the launch around it has patched
    the same modules already: the re-patch finds no builtin left to wrap and its scope is
    dropped unrestored, so it changes nothing, yet it was a third to two thirds of a kernel
    test's time. Skip it when the launch (``GridExecutor.__call__``) has patched every
    language module the helper sees; any other call patches as before."""
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return
    orig_patch, orig_call = interp._patch_lang, interp.GridExecutor.__call__
    active: list[set[int]] = []  # the language modules the running launch has patched

    def langs(fn) -> set[int]:  # noqa: ANN001
        mods = (interp.tl, interp.tl.core)
        return {id(v) for v in fn.__globals__.values() if any(v is m for m in mods)}

    def patch_lang(fn):  # noqa: ANN001, ANN202
        seen = langs(fn)
        if active and seen and seen <= active[-1]:
            return interp._LangPatchScope()  # nothing to restore
        scope = orig_patch(fn)
        if active:
            active[-1].update(seen)
        return scope

    def call(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        active.append(set())
        try:
            return orig_call(self, *args, **kwargs)
        finally:
            active.pop()

    interp._patch_lang, interp.GridExecutor.__call__ = patch_lang, call


if os.environ.get("TRITON_INTERPRET") == "1":
    _cheap_nested_lang_patch()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_cfg(tiny_tokenizer):
    def make(arch: str) -> ModelConfig:
        raw = tiny_config_v41(tiny_tokenizer) if arch == "v41" else tiny_config_v4()
        return ModelConfig.from_dict(raw)

    return make


def randomize(model: DeepseekModel, seed: int) -> DeepseekModel:
    """Non-degenerate random weights: matrices ~ N(0, 1/fan_in), norms ~1, biases small."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif "norm" in name or "scale" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                e, k = model.cfg.n_routed_experts, b.shape[1]
                rows = [torch.randperm(e, generator=g)[:k] for _ in range(b.shape[0])]
                b.copy_(torch.stack(rows))
    return model


@pytest.fixture(scope="session")
def tiny_model(tiny_cfg, tiny_tokenizer):
    cache: dict[str, DeepseekModel] = {}

    def make(arch: str) -> DeepseekModel:
        if arch not in cache:
            cfg = tiny_cfg(arch)
            v41 = arch == "v41"
            tmap = compressed_token_map(tiny_tokenizer)[0] if v41 else None
            cache[arch] = randomize(DeepseekModel(cfg, tmap), seed=1).eval()
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Path of a tiny official-layout checkpoint (seed 0), made once per session and options
    (``make_tiny_checkpoint``'s keywords, e.g. ``expert_dtype="fp8", block=32``)."""
    from app.model.tiny import make_tiny_checkpoint

    paths: dict[tuple, str] = {}

    def make(arch: str, **options: object) -> str:
        key = (arch, *sorted(options.items()))
        if key not in paths:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            make_tiny_checkpoint(out, arch=arch, seed=0, **options)
            paths[key] = str(out)
        return paths[key]

    return make


@pytest.fixture
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every float buffer the wrappers allocate starts as NaN: unwritten outputs fail."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: nan(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan(empty_like(*a, **k)))
