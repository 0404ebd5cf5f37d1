"""The config classes: every option declared once (no twins), one declaration checked the same
way by pydantic (``ServeArgs``) and in plain Python, the shipped serve configs valid."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import types
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ValidationError

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = ("Config", "Args", "Options")  # how the project names a class of options
# One name, two meanings on purpose, each a different value of the same concept:
ALLOWED = {
    # ServeArgs.model names a checkpoint or a built-in tiny model; EngineConfig.model is the
    # directory it resolves to (ServeArgs.model_path), which the builder passes down
    "model": {"ServeArgs", "EngineConfig"},
    # a PD role's engine options are overrides of ServeArgs.engine, key by key
    "engine": {"ServeArgs", "PDRoleConfig"},
}


def _is_config(obj: object) -> bool:
    return isinstance(obj, type) and (
        dataclasses.is_dataclass(obj) or (issubclass(obj, BaseModel) and obj is not BaseModel)
    )


def _declared() -> list[type]:
    """Every config class under app/: the dataclasses and pydantic models named ``*Config``
    / ``*Args`` / ``*Options`` (found in the source, not listed here; the model's own
    ``ModelConfig`` too: a value read from the checkpoint is no option either), and every
    class they hold."""
    seen: dict[str, type] = {}
    todo: list[type] = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        names = [n.name for n in ast.walk(ast.parse(path.read_text())) if
                 isinstance(n, ast.ClassDef) and n.name.endswith(SUFFIXES)]  # fmt: skip
        if not names:
            continue
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
        todo += [getattr(module, n) for n in names]
    while todo:
        cls = todo.pop()
        key = f"{cls.__module__}.{cls.__qualname__}"
        if not _is_config(cls) or key in seen:
            continue
        seen[key] = cls
        todo += [t for hint in _fields(cls).values() for t in _parts(hint) if _is_config(t)]
    return list(seen.values())


def _fields(cls: type) -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    if dataclasses.is_dataclass(cls):
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return {name: hints[name] for name in cls.model_fields}  # type: ignore[attr-defined]


def _parts(hint: object) -> tuple[object, ...]:
    """``A | None`` -> (A, NoneType); ``list[A]`` -> (list, A); ``A`` -> (A,)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(p for a in typing.get_args(hint) for p in _parts(a))
    origin = typing.get_origin(hint)
    if origin is not None and origin is not typing.Literal:
        return (origin, *(p for a in typing.get_args(hint) for p in _parts(a)))
    return (hint,)


def twins(classes: list[type]) -> dict[str, list[str]]:
    """Option names declared in more than one class. A field whose type is a config class
    (``ServeArgs.api: ApiConfig``) embeds that class's options: structure, not an option."""
    where: dict[str, list[str]] = {}
    for cls in classes:
        for name, hint in _fields(cls).items():
            if not any(_is_config(t) for t in _parts(hint)):
                where.setdefault(name, []).append(cls.__qualname__)
    return {
        name: sorted(owners)
        for name, owners in where.items()
        if len(owners) > 1 and set(owners) != ALLOWED.get(name)
    }


def test_the_walk_finds_the_serve_sections_and_the_engine_configs():
    names = {c.__qualname__ for c in _declared()}
    assert {"ServeArgs", "EngineConfig", "CacheConfig", "SchedulerConfig", "ParallelConfig",
            "SpeculativeConfig", "ExperimentalConfig"} <= names  # fmt: skip
    from app.serve_args import ServeArgs

    for name, hint in _fields(ServeArgs).items():  # every section of ServeArgs
        for t in _parts(hint):
            if _is_config(t):
                assert t.__qualname__ in names, name


def test_no_option_is_declared_twice():
    assert twins(_declared()) == {}


def test_plain_construction_checks_the_declared_bounds():
    """The bounds pydantic reads from a section's field metadata are the ones a plain
    construction checks (``app.config.check_fields``); both name the field."""
    from app.api.server import ApiConfig
    from app.deployments.routing import RoutingConfig
    from app.observability import ObservabilityConfig
    from app.serve_args import ServeArgs

    obs = ObservabilityConfig
    for cls, section, bad in [(ApiConfig, "api", {"max_body_bytes": 0}),
                              (ApiConfig, "api", {"request_timeout_s": -1.0}),
                              (RoutingConfig, "routing", {"balance_rel": 0.5}),
                              (RoutingConfig, "routing", {"policy": "random"}),
                              (obs, "observability", {"sample_ratio": 2.0}),
                              (obs, "observability", {"tracing": "jaeger"})]:  # fmt: skip
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name):
            cls(**bad)
        with pytest.raises(ValidationError, match=rf"{section}\.{name}"):
            ServeArgs.model_validate({section: bad})
    with pytest.raises(ValidationError, match=r"parallel\.ep_size"):
        ServeArgs.model_validate({"ep_size": 0})
    with pytest.raises(ValidationError, match="api.extra_key"):
        ServeArgs.model_validate({"api": {"extra_key": 1}})
    assert ServeArgs().api.request_timeout_s == ApiConfig().request_timeout_s == 600.0


def test_experimental_switches_reach_the_engine_config():
    from app.config import EngineConfig
    from app.serve_args import ServeArgs

    sa = ServeArgs.model_validate({"experimental": {"packed_dense": "on", "pd_fault": "export"}})
    cfg = sa.engine_config(Path("/m"))
    assert cfg.experimental == sa.experimental and cfg.packed_dense_flag()
    assert not EngineConfig.from_options("/m").packed_dense_flag()  # off by default
    assert EngineConfig.from_options("/m", experimental={"packed_dense": "on"}).packed_dense_flag()
    with pytest.raises(ValueError, match=r"unknown experimental option\(s\) \['x'\]"):
        EngineConfig.from_options("/m", experimental={"x": 1})
    with pytest.raises(ValidationError, match="top-level experimental block"):
        ServeArgs.model_validate({"engine": {"experimental": {"packed_dense": "on"}}})
    with pytest.raises(ValidationError, match="packed_dense"):
        ServeArgs.model_validate({"engine": {"packed_dense": "on"}})


@pytest.mark.parametrize("path", ["serve_config.yaml", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.yaml"))])  # fmt: skip
def test_shipped_serve_configs_are_valid(path):
    from app.serve_args import ServeArgs

    for app in yaml.safe_load((ROOT / path).read_text())["applications"]:
        assert app["import_path"] == "app.builder:build_app"
        ServeArgs.model_validate(app["args"])
