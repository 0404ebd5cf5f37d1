"""Engine configuration: frozen dataclasses validated once, shared by every layer below
the deployments (the GPU machine has no pydantic). ``app.serve_args.ServeArgs`` holds the
same stdlib dataclasses as its sections and pydantic validates them from their declaration;
:func:`check_fields` applies that declaration (``Literal`` choices, bounds written as field
metadata) when one is built in plain Python, so both paths check the one declaration.

Values may be "auto" (0 / None) where the engine resolves them from the model and the
memory budget; resolution makes a new object with :func:`dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # the front-door replicas import this module (check_fields) but no model
    from app.model.config import ModelConfig

ReplayMode = Literal["off", "encoder", "encoder+decoder"]
REPLAY_MODES: tuple[str, ...] = typing.get_args(ReplayMode)
PackedExpertsMode = Literal["auto", "on", "off"]
PACKED_EXPERTS_MODES: tuple[str, ...] = typing.get_args(PackedExpertsMode)
ExpertLayout = Literal["auto", "fp8_rows"]
EXPERT_LAYOUTS: tuple[str, ...] = typing.get_args(ExpertLayout)
MoePrefillAct = Literal["bf16", "fp8"]
MOE_PREFILL_ACTS: tuple[str, ...] = typing.get_args(MoePrefillAct)
ActPrecision = Literal["bf16", "fp8"]  # dense_act / expert_act
ACT_PRECISIONS: tuple[str, ...] = typing.get_args(ActPrecision)
LoadFormat = Literal["auto", "dummy"]  # the loader's choices (app.model.checkpoint.LOAD_FORMATS)
LOAD_FORMATS: tuple[str, ...] = typing.get_args(LoadFormat)
PDFault = Literal["none", "export", "header"]


class EngineConfigError(ValueError):
    """A config option (engine or serve) with an invalid value; the message names it."""


_BOUNDS = {"gt": (operator.gt, ">"), "ge": (operator.ge, ">="), "lt": (operator.lt, "<"),
           "le": (operator.le, "<=")}  # fmt: skip


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _choices(hint: object) -> tuple[object, ...] | None:
    """The values a ``Literal`` (or ``Literal | None``) annotation allows; None otherwise."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    if isinstance(hint, types.UnionType):
        parts = [_choices(t) if t is not type(None) else (None,) for t in typing.get_args(hint)]
        if all(p is not None for p in parts):
            return tuple(v for p in parts for v in p)  # type: ignore[union-attr]
    return None


def _is_int(hint: object) -> bool:
    return hint is int or (isinstance(hint, types.UnionType) and
                           set(typing.get_args(hint)) == {int, type(None)})  # fmt: skip


def check_fields(cfg: object, prefix: str = "") -> None:
    """Check a config dataclass against its own declaration, as pydantic does when the
    dataclass is a ``ServeArgs`` section: ``Literal`` choices, integers for ``int`` fields,
    and the bounds written as field metadata (``field(default=1, metadata={"gt": 0})``;
    also ``ge`` / ``lt`` / ``le``; None passes). Raises :class:`EngineConfigError` naming
    the field (``prefix`` + its name)."""
    hints = _hints(type(cfg))
    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
        value, name, hint = getattr(cfg, f.name), prefix + f.name, hints[f.name]
        choices = _choices(hint)
        if choices is not None and value not in choices:
            raise EngineConfigError(f"{name} must be one of {choices}, got {value!r}")
        if value is None:
            continue
        if _is_int(hint) and (isinstance(value, bool) or not isinstance(value, int)):
            raise EngineConfigError(f"{name} must be an integer, got {value!r}")
        for key, bound in f.metadata.items():
            op, sign = _BOUNDS.get(key, (None, ""))
            if op is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise EngineConfigError(f"{name} must be a number, got {value!r}")
            if not op(value, bound):
                raise EngineConfigError(f"{name} must be {sign} {bound}, got {value!r}")


def parse_section(cls: type, name: str, value: object, example: str) -> Any:
    """A config section given as an instance of ``cls`` or a mapping of its fields (the
    flat options of :meth:`EngineConfig.from_options`; unknown names are refused)."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise EngineConfigError(
            f"{name} must be a mapping like {example}, got {type(value).__name__}"
        )
    valid = sorted(f.name for f in dataclasses.fields(cls))
    unknown = set(value) - set(valid)
    if unknown:
        raise EngineConfigError(f"unknown {name} option(s) {sorted(unknown)}; valid: {valid}")
    return cls(**value)


@dataclass(frozen=True)
class CacheConfig:
    """KV cache options.

    ``block_size``: positions per block; 0 = auto (smallest multiple of every compression
    ratio that is >= 64; resolved against the model by :func:`app.cache.layout.block_size_for`).
    ``kv_cache_bytes``: pool budget in bytes (CPU; on GPU the budget
    is ``gpu_memory_utilization`` of free memory when this is None).
    ``bounded_replay``: after a prefix hit ending at H, prefill restarts at H - window
    ("encoder"); V4.1 decoder layers also run only on the last window rows of a prompt
    ("encoder+decoder"); "off" = exact (a hit then saves memory, not compute).
    ``host_bytes``: host-memory KV tier (``app.cache.host_tier``): blocks evicted from the
    device pool are kept in this many bytes of (pinned, on CUDA) host memory and loaded back
    on a hit; 0 = off (needs prefix caching).
    """

    block_size: int = 0
    enable_prefix_caching: bool = True
    bounded_replay: ReplayMode = "encoder+decoder"
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_quant: bool = False
    host_bytes: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 0:
            raise EngineConfigError(f"block_size must be >= 0 (0 = auto), got {self.block_size}")
        if self.bounded_replay not in REPLAY_MODES:
            raise EngineConfigError(
                f"bounded_replay must be one of {REPLAY_MODES}, got {self.bounded_replay!r}"
            )
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise EngineConfigError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise EngineConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.host_bytes < 0:
            raise EngineConfigError(f"host_bytes must be >= 0 (0 = off), got {self.host_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling options. ``max_model_len`` 0 = the model's limit (further capped by what
    one request can hold in the KV pool). ``long_prefill_share``: while other requests are
    present, prefills with more than ``long_prefill_threshold`` tokens left (0 = one step's
    budget) take at most this share of a step's budget (1.0 = no limit)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0
    long_prefill_share: float = 0.5
    long_prefill_threshold: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise EngineConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.max_model_len < 0:
            raise EngineConfigError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if not 0.0 < self.long_prefill_share <= 1.0:
            raise EngineConfigError(
                f"long_prefill_share must be in (0, 1], got {self.long_prefill_share}"
            )
        if self.long_prefill_threshold < 0:
            raise EngineConfigError(
                f"long_prefill_threshold must be >= 0, got {self.long_prefill_threshold}"
            )


SpecMethod = Literal["dspark", "mtp"]
SPEC_METHODS: tuple[str, ...] = typing.get_args(SpecMethod)
MAX_DRAFT_TOKENS = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: ``method`` "dspark" (V4.1: the checkpoint's DSpark stages draft
    a block) or "mtp" (V4: MTP-1 from ``mtp.0``, one draft token); every step verifies
    ``num_draft_tokens`` (1-5; MTP: 1) drafts per decoding request."""

    method: SpecMethod = "dspark"
    num_draft_tokens: int = 3

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise EngineConfigError(
                f"speculative.method must be one of {SPEC_METHODS}, got {self.method!r}"
            )
        k = self.num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise EngineConfigError(
                f"speculative.num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], "
                f"got {k!r}"
            )
        if self.method == "mtp" and k != 1:
            raise EngineConfigError(
                "speculative.num_draft_tokens must be 1 with method 'mtp' (MTP-1 is trained "
                f"to draft one token), got {k}"
            )

    def check_model(self, cfg: ModelConfig) -> None:
        """Raise :class:`EngineConfigError` naming the option when the model's config.json
        cannot draft this way (checked at config time and again at engine start)."""
        problem = cfg.draft_problem(self.method, self.num_draft_tokens)
        if problem is not None:
            raise EngineConfigError(f"speculative.method {self.method!r}: {problem}")

    @classmethod
    def parse(cls, value: object) -> SpeculativeConfig | None:
        """From None, a SpeculativeConfig or a mapping ``{"method", "num_draft_tokens"}``."""
        if value is None:
            return None
        example = "{'method': 'dspark', 'num_draft_tokens': 3}"
        return parse_section(cls, "speculative", value, example)


@dataclass(frozen=True)
class ExperimentalConfig:
    """Switches under test, not product options (the ``experimental:`` block): off by
    default, they may change or go without notice.

    ``packed_dense``: keep the checkpoint's fp8 dense projections as stored and multiply them
    in the fp8 kernel ("auto": on CUDA); an A/B switch, off because it is faster at batch 1
    and slower at batch 64. ``pd_fault``: fault injection on PD prefill ranks for tests
    ("export": sending a state raises; "header": the sent header names another model).
    """

    __pydantic_config__ = {"extra": "forbid"}

    packed_dense: PackedExpertsMode = "off"
    pd_fault: PDFault = "none"

    def __post_init__(self) -> None:
        check_fields(self, "experimental.")

    @classmethod
    def parse(cls, value: object) -> ExperimentalConfig:
        """From an ExperimentalConfig or a mapping of its fields."""
        return parse_section(cls, "experimental", value, "{'packed_dense': 'on'}")


DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one DP rank's engine needs.

    ``packed_experts``: keep fp8 / fp4 routed experts packed per layer for the MegaMoE
    kernels ("on": required, a checkpoint that cannot be packed fails to load; "off":
    dequantize to ``dtype``; "auto": packed on CUDA when every MoE layer can be).
    ``cuda_graphs``: decode steps replay CUDA graphs (on CUDA; off = eager, same outputs).
    ``experimental``: switches under test (:class:`ExperimentalConfig`; a mapping in
    :meth:`from_options`). ``speculative``: draft-and-verify decoding
    (:class:`SpeculativeConfig`; None = off).
    ``expert_layout``: how packed fp4 experts are held ("auto": the pairs layout on CUDA;
    "fp8_rows": re-encoded exactly as e4m3 with one scale per row, twice the bytes, for
    prefill-heavy ranks). ``moe_prefill_act``: "fp8" multiplies prefill-sized MoE steps with
    fp8 activations (one scale per token row; needs ``fp8_rows``), "bf16" keeps bf16.
    ``dense_act``: "fp8" computes the release's fp8 dense projections as its inference does:
    each input rounded to e4m3 in per-token groups of the weight block's columns (32 on V4.1,
    128 on V4) with power-of-two scales, times the fp8 weights kept as released
    (:meth:`dense_weights_packed`); "bf16" multiplies the unrounded activations (exact).
    ``expert_act``: "fp8" rounds the routed experts' activations the same way (x before W1 /
    W3, the SwiGLU output before W2); both "fp8": the release's whole activation rounding.
    ``load_format``: "auto" loads the checkpoint's safetensors; "dummy" reads no weights
    (``model`` holds config.json and the tokenizer only): random weights of the real shapes
    and formats, drawn on the device from ``seed`` (benchmarks without a checkpoint).
    ``deterministic``: batch-invariant steps (``kernels.invariant``): every token's logits
    are computed in an order that depends on that token's data only, never on the other
    requests of a step, its size, padding or chunking, so a greedy or seeded request gives
    the same tokens and logprobs bitwise in any company. It refuses what computes another
    function by design (:meth:`deterministic_problem`).
    """

    model: str
    device: str = "cpu"
    dtype: str = "float32"
    packed_experts: PackedExpertsMode = "auto"
    expert_layout: ExpertLayout = "auto"
    moe_prefill_act: MoePrefillAct = "bf16"
    dense_act: ActPrecision = "bf16"
    expert_act: ActPrecision = "bf16"
    load_format: LoadFormat = "auto"
    overlap_schedule: bool = True
    cuda_graphs: bool = True
    seed: int = 0
    deterministic: bool = False
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    speculative: SpeculativeConfig | None = None
    experimental: ExperimentalConfig = ExperimentalConfig()

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative", SpeculativeConfig.parse(self.speculative))
        if not self.model:
            raise EngineConfigError("model must name a checkpoint directory")
        if not isinstance(self.experimental, ExperimentalConfig):
            raise EngineConfigError("experimental must be an ExperimentalConfig (from_options "
                                    "takes a mapping)")  # fmt: skip
        if self.dtype not in DTYPES:
            raise EngineConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise EngineConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.packed_experts not in PACKED_EXPERTS_MODES:
            raise EngineConfigError(f"packed_experts must be one of {PACKED_EXPERTS_MODES}, "
                                    f"got {self.packed_experts!r}")  # fmt: skip
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise EngineConfigError(
                f"expert_layout must be one of {EXPERT_LAYOUTS}, got {self.expert_layout!r}"
            )
        if self.moe_prefill_act not in MOE_PREFILL_ACTS:
            raise EngineConfigError(
                f"moe_prefill_act must be one of {MOE_PREFILL_ACTS}, got {self.moe_prefill_act!r}"
            )
        for name in ("dense_act", "expert_act"):
            if getattr(self, name) not in ACT_PRECISIONS:
                raise EngineConfigError(
                    f"{name} must be one of {ACT_PRECISIONS}, got {getattr(self, name)!r}"
                )
        if self.expert_act == "fp8" and self.moe_prefill_act == "fp8":
            raise EngineConfigError("expert_act 'fp8' rounds the experts' activations as the "
                                    "release does; moe_prefill_act 'fp8' rounds them per row: "
                                    "one of them")  # fmt: skip
        if self.load_format not in LOAD_FORMATS:
            raise EngineConfigError(
                f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}"
            )
        if self.moe_prefill_act == "fp8" and self.expert_layout != "fp8_rows":
            raise EngineConfigError("moe_prefill_act 'fp8' needs expert_layout 'fp8_rows'")
        if self.expert_layout == "fp8_rows" and self.packed_experts == "off":
            raise EngineConfigError("expert_layout 'fp8_rows' holds packed experts: "
                                    "packed_experts cannot be 'off'")  # fmt: skip
        problem = self.deterministic_problem()
        if problem is not None:
            raise EngineConfigError(f"deterministic: true {problem}")

    def deterministic_problem(self) -> str | None:
        """What of this config the deterministic mode cannot make batch-invariant (None: all
        of it, or the mode is off). Each is an option whose result depends on what else is
        scheduled: bounded replay (a prefix hit computes another function than a cold
        prefill), fp8 MoE activations (taken above a row count) and the fp8 dense kernels
        (chosen by the row count)."""
        if not self.deterministic:
            return None
        if self.cache.bounded_replay != "off":
            return (
                f"needs bounded_replay 'off', got {self.cache.bounded_replay!r}: after a "
                "prefix hit, replay computes another function than a cold prefill"
            )
        if self.moe_prefill_act != "bf16":
            return (
                f"needs moe_prefill_act 'bf16', got {self.moe_prefill_act!r}: fp8 "
                "activations are taken above a row count, so they depend on the batch"
            )
        if self.packed_dense_flag():
            return (
                "needs experimental.packed_dense off: its fp8 kernels are chosen by the "
                "row count of a step"
            )
        return None

    def packed_experts_flag(self) -> bool | None:
        """``packed_experts`` as :func:`app.model.loader.load_model` takes it (None = auto;
        the fp8 rows expert layout exists only packed, so it makes "auto" mean "on")."""
        if self.expert_layout == "fp8_rows" and self.packed_experts == "auto":
            return True
        return {"auto": None, "on": True, "off": False}[self.packed_experts]

    def packed_dense_flag(self) -> bool:
        """``experimental.packed_dense`` resolved for this device ("auto" = on CUDA)."""
        mode = self.experimental.packed_dense
        if mode == "auto":
            return self.device.startswith("cuda")
        return mode == "on"

    def dense_weights_packed(self) -> bool:
        """Whether the dense fp8 projections keep the checkpoint's bytes (the loader's
        ``packed_dense``): ``experimental.packed_dense``, or ``dense_act`` "fp8" outside the
        deterministic mode. The mode multiplies the rounded activations by dequantized
        weights in its batch-invariant GEMM instead (the same products; the fp8 kernels
        are chosen by a step's row count)."""
        return self.packed_dense_flag() or (self.dense_act == "fp8" and not self.deterministic)

    @classmethod
    def from_options(cls, model: str, **options: object) -> EngineConfig:
        """Build from flat options (``LLM(model, enable_prefix_caching=False, ...)``): each
        name is a field of EngineConfig, CacheConfig or SchedulerConfig (``speculative`` and
        ``experimental`` take a mapping of their fields)."""
        groups: dict[str, dict[str, object]] = {"engine": {}, "cache": {}, "scheduler": {}}
        owners = {
            "engine": {f for f in cls.__dataclass_fields__ if f not in ("cache", "scheduler")},
            "cache": set(CacheConfig.__dataclass_fields__),
            "scheduler": set(SchedulerConfig.__dataclass_fields__),
        }
        hints = {
            "engine": typing.get_type_hints(cls),
            "cache": typing.get_type_hints(CacheConfig),
            "scheduler": typing.get_type_hints(SchedulerConfig),
        }
        for name, value in options.items():
            owner = next((g for g, names in owners.items() if name in names), None)
            if owner is None or name == "model":
                valid = sorted(set().union(*owners.values()) - {"model"})
                raise EngineConfigError(f"unknown engine option {name!r}; valid: {valid}")
            _check_type(name, value, hints[owner][name])
            if name == "experimental":
                value = ExperimentalConfig.parse(value)
            groups[owner][name] = value
        try:
            return cls(
                model=model,
                cache=CacheConfig(**groups["cache"]),
                scheduler=SchedulerConfig(**groups["scheduler"]),
                **groups["engine"],
            )
        except TypeError as e:  # wrong value types reach here as TypeError
            raise EngineConfigError(str(e)) from e


_SECTIONS = {SpeculativeConfig: "{'method': 'dspark', 'num_draft_tokens': 3}",
             ExperimentalConfig: "{'packed_dense': 'on'}"}  # fmt: skip


def _check_type(name: str, value: object, hint: object) -> None:
    """``value`` fits the field's annotation (bool, int, float, str, Literal, ``X | None``,
    or a mapping for a section: :class:`SpeculativeConfig`, :class:`ExperimentalConfig`)."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for t in options:
        if t is type(None) and value is None:
            return
        if typing.get_origin(t) is Literal and value in typing.get_args(t):
            return
        if t is bool and isinstance(value, bool):
            return
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return
        if t is float and isinstance(value, int | float) and not isinstance(value, bool):
            return
        if t is str and isinstance(value, str):
            return
        if t in _SECTIONS and isinstance(value, t | Mapping):
            return  # the fields are checked by the section's parse
    raise EngineConfigError(f"engine option {name!r} must be {_describe(options)}, got {value!r}")


def _describe(options: tuple) -> str:
    words = []
    for t in options:
        if typing.get_origin(t) is Literal:
            words.append("one of " + ", ".join(repr(a) for a in typing.get_args(t)))
        elif t in _SECTIONS:
            words.append(f"a mapping like {_SECTIONS[t]}")
        else:
            words.append("null" if t is type(None) else getattr(t, "__name__", str(t)))
    return " or ".join(words)


EngramPlacementMode = Literal["replicated", "host", "sharded"]


@dataclass(frozen=True)
class ParallelConfig:
    """Expert parallelism of the DP ranks: gangs of ``ep_size`` ranks (DP attention, EP
    MoE) holding ``n_routed_experts + redundant_experts`` expert slots, and where the Engram
    tables live (``app.model.engram_place``). ``ep_size`` 1 = independent ranks. In the serve
    config these three are top-level keys of ``args`` (``ServeArgs.parallel``)."""

    __pydantic_config__ = {"extra": "forbid"}

    ep_size: int = field(default=1, metadata={"ge": 1})
    redundant_experts: int = field(default=0, metadata={"ge": 0})
    engram_placement: EngramPlacementMode = "replicated"

    def __post_init__(self) -> None:
        check_fields(self)
        if self.redundant_experts % self.ep_size or (self.redundant_experts and self.ep_size == 1):
            raise EngineConfigError(f"redundant_experts ({self.redundant_experts}) must be a "
                                    f"multiple of ep_size ({self.ep_size}) > 1")  # fmt: skip
        if self.engram_placement == "sharded" and self.ep_size == 1:
            raise EngineConfigError("engram_placement 'sharded' splits rows over a gang: "
                                    "it needs ep_size > 1")  # fmt: skip

    def check(self, model: ModelConfig, dp_size: int) -> None:
        """Raise :class:`EngineConfigError` when the gangs do not fit ``dp_size`` ranks or
        the model's experts do not split over a gang."""
        self.check_ranks(dp_size)
        e = model.n_routed_experts
        if e % self.ep_size:
            raise EngineConfigError(f"the model's {e} routed experts do not split over "
                                    f"ep_size {self.ep_size} ranks")  # fmt: skip
        if self.redundant_experts > e:
            raise EngineConfigError(f"redundant_experts ({self.redundant_experts}) exceeds "
                                    f"the {e} routed experts")  # fmt: skip

    def check_ranks(self, dp_size: int) -> None:
        """Raise :class:`EngineConfigError` when gangs of ``ep_size`` do not fill
        ``dp_size`` ranks."""
        if dp_size % self.ep_size:
            raise EngineConfigError(f"dp_size ({dp_size}) must be a multiple of ep_size "
                                    f"({self.ep_size})")  # fmt: skip
