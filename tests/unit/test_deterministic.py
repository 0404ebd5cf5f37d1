"""The deterministic mode (``EngineConfig.deterministic``): its option and refusals, the
batch-invariant ops of the CPU step (``kernels.invariant``), and the engine giving one
request the same tokens and logprobs bitwise in any company: SGLang's test (one prompt among
varying companions, one unique output) and vLLM's (logprobs at batch 1 == batch N), with
chunked prefill, prefix hits, preemption and speculation in the matrix."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.config import EngineConfig, EngineConfigError
from app.serve_args import ServeArgs

DET = {"deterministic": True, "bounded_replay": "off"}


# ---- the option ------------------------------------------------------------------------
def test_the_option_and_its_refusals():
    cfg = EngineConfig.from_options("/m", **DET)
    assert cfg.deterministic and cfg.deterministic_problem() is None
    assert not EngineConfig.from_options("/m").deterministic  # off by default
    with pytest.raises(EngineConfigError, match="deterministic: true needs bounded_replay 'off'"):
        EngineConfig.from_options("/m", deterministic=True)  # replay is on by default
    with pytest.raises(EngineConfigError, match="bounded_replay 'off', got 'encoder'"):
        EngineConfig.from_options("/m", deterministic=True, bounded_replay="encoder")
    with pytest.raises(EngineConfigError, match="moe_prefill_act 'bf16'"):
        EngineConfig.from_options("/m", **DET, expert_layout="fp8_rows", moe_prefill_act="fp8")
    with pytest.raises(EngineConfigError, match="experimental.packed_dense"):
        EngineConfig.from_options("/m", **DET, experimental={"packed_dense": "on"})
    with pytest.raises(EngineConfigError, match="engine option 'deterministic' must be bool"):
        EngineConfig.from_options("/m", deterministic="yes", bounded_replay="off")


def test_serve_args_take_it_and_refuse_what_cannot_be_invariant():
    sa = ServeArgs.model_validate({"engine": DET})
    assert sa.engine_config(sa.model_path()).deterministic
    with pytest.raises(ValidationError, match="bounded_replay 'off'"):
        ServeArgs.model_validate({"engine": {"deterministic": True}})
    with pytest.raises(ValidationError, match="deterministic: true needs ep_size 1"):
        ServeArgs.model_validate({"engine": DET, "ep_size": 2, "dp_size": 2})
    pd = {"prefill": {"ranks": 1}, "decode": {"ranks": 1, "engine": {"deterministic": False}}}
    with pytest.raises(ValidationError, match="'deterministic' differs between prefill"):
        ServeArgs.model_validate({"engine": DET, "pd": pd})
