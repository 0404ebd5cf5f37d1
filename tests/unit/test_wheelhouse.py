"""The wheelhouse of the serving runtime (tools/wheelhouse.py): the committed lock against
pyproject.toml, the pip commands' target flags, split / join. No network, no download."""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tools import wheelhouse as wh

LOCK = wh.lock_path()
TARGET = ("3.12", "2.31", "x86_64")


@pytest.fixture(scope="module")
def lock() -> dict:
    return json.loads(LOCK.read_text())


def test_lock_is_for_the_target(lock):
    assert (lock["python_version"], lock["glibc"], lock["arch"]) == TARGET
    # resolved in a Python of the target version: the dependencies' markers were its own
    assert lock["environment"]["python_version"] == lock["python_version"]
    assert lock["environment"]["platform_machine"] == lock["arch"]


def test_lock_roots_are_pyproject_runtime_dependencies(lock):
    """Any change of pyproject.toml's dependencies fails here until the lock is made again
    (``python -m tools.wheelhouse lock``)."""
    assert lock["requirements"] == wh.pyproject_roots()


def test_lock_pins_every_runtime_dependency_at_its_version(lock):
    deps = tomllib.loads((wh.ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    versions = {p["name"]: p["version"] for p in lock["packages"]}
    for dep in map(Requirement, deps):
        name = wh.normalize(dep.name)
        if wh.host_provided(name):
            assert name not in versions
            continue
        assert name in versions, f"{dep} not locked"
        assert dep.specifier.contains(versions[name], prereleases=True), (dep, versions[name])
        pinned = [s.version for s in dep.specifier if s.operator == "=="]
        assert pinned in ([], [versions[name]]), (dep, versions[name])


def test_lock_holds_together(lock):
    """Every requirement of every locked package is met by the lock; nothing is locked twice
    or without a reason."""
    assert wh.check_lock(lock) == []


def test_check_lock_finds_drift(lock):
    def problems(edit) -> list[str]:
        broken = copy.deepcopy(lock)
        edit(broken)
        return wh.check_lock(broken)

    def package(broken: dict, name: str) -> dict:
        return next(p for p in broken["packages"] if p["name"] == name)

    assert any("fastapi" in p for p in problems(
        lambda b: package(b, "fastapi").update(version="0.1.0")))
    assert any("starlette" in p and "not locked" in p for p in problems(
        lambda b: b["packages"].remove(package(b, "starlette"))))
    assert any("locked twice" in p for p in problems(
        lambda b: b["packages"].append(dict(package(b, "ray")))))
    assert any("nothing needs it" in p for p in problems(
        lambda b: b["packages"].append({**package(b, "six"), "name": "left-over"})))
    assert any("host's own" in p for p in problems(
        lambda b: b["packages"].append({**package(b, "six"), "name": "nvidia-nccl-cu13"})))
    assert problems(lambda b: b["requirements"].append("pydantic==1.10.0"))


def test_lock_carries_nothing_of_the_hosts_own(lock):
    for name in ("torch", "triton", "nvidia-cublas", "cuda-bindings", "Triton"):
        assert wh.host_provided(name)
    for name in ("ray", "numpy", "cudf-like", "nvidia"):
        assert not wh.host_provided(name)
    assert not [p["name"] for p in lock["packages"] if wh.host_provided(p["name"])]
    assert not [p["file"] for p in lock["packages"]
                if re.match(r"(torch|triton|nvidia|cuda)[-_]", p["file"])]


def test_lock_wheels_fit_the_target(lock):
    """Each file is a wheel for CPython 3.12 (or abi3 / pure) on one of the target's
    platforms, with a sha256; the recorded glibc floor is the newest that a wheel needs."""
    platforms = set(wh.platform_tags(lock["glibc"], lock["arch"])) | {"any"}
    for p in lock["packages"]:
        assert re.fullmatch(r"[0-9a-f]{64}", p["sha256"]), p
        python, abi, plats = p["file"][:-4].split("-")[-3:]
        assert p["file"].endswith(".whl") and set(plats.split(".")) & platforms, p["file"]
        assert abi in ("cp312", "abi3", "none"), p["file"]
        assert any(t in ("cp312", "py3") or re.fullmatch(r"cp3\d+", t) and abi == "abi3"
                   for t in python.split(".")), p["file"]
    floor = max(wh.wheel_glibc(p["file"]) for p in lock["packages"])
    assert lock["glibc_floor"] == f"{floor[0]}.{floor[1]}"


def test_platform_tags_and_glibc():
    tags = wh.platform_tags("2.31", "x86_64")
    assert tags[0] == "manylinux_2_31_x86_64"
    assert tags[-3:] == ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    assert "manylinux_2_17_x86_64" in tags and "manylinux_2_32_x86_64" not in tags
    with pytest.raises(ValueError):
        wh.platform_tags("2.12")
    assert wh.wheel_glibc("x-1-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl") \
        == (2, 17)
    assert wh.wheel_glibc("x-1-cp39-abi3-manylinux_2_31_x86_64.whl") == (2, 31)
    assert wh.wheel_glibc("x-1-py2.py3-none-manylinux1_x86_64.manylinux_2_5_x86_64.whl") \
        == (2, 5)
    assert wh.wheel_glibc("x-1-py3-none-any.whl") == (0, 0)


def test_lock_from_report_keeps_the_target_and_drops_the_hosts_own():
    def item(name: str, version: str, file: str, requires: list[str]) -> dict:
        return {"metadata": {"name": name, "version": version, "requires_dist": requires},
                "download_info": {"url": f"https://files.example/{file}",
                                  "archive_info": {"hashes": {"sha256": "ab" * 32}}}}

    env = {k: "x" for k in wh.MARKER_KEYS} | {"platform_release": "6.1", "python_version": "3.12"}
    report = {"pip_version": "23.2.1", "environment": env, "install": [
        item("Zeta_Pkg", "1.0", "zeta_pkg-1.0-cp39-abi3-manylinux_2_31_x86_64.whl", ["torch"]),
        item("torch", "2.13.0", "torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl", []),
        item("nvidia-nccl-cu13", "2.0", "nvidia_nccl_cu13-2.0-py3-none-manylinux_2_18_x86_64.whl",
             []),
        item("alpha", "2.0", "alpha-2.0-py3-none-any.whl", []),
    ]}
    lock = wh.lock_from_report(report, ["zeta-pkg==1.0", "alpha"], "3.12", "2.31", "x86_64")
    assert [p["name"] for p in lock["packages"]] == ["alpha", "zeta-pkg"]
    assert lock["glibc_floor"] == "2.31" and lock["requirements"] == ["zeta-pkg==1.0", "alpha"]
    assert "platform_release" not in lock["environment"]
    assert wh.check_lock(lock) == []  # zeta-pkg's torch is the host's: no problem


def _flag_values(cmd: list[str], flag: str) -> list[str]:
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == flag]


def test_pip_commands_carry_the_target():
    plats = wh.platform_tags("2.31")
    tmp = Path("/tmp/x")
    resolve = wh.resolve_command("python3.12", tmp / "roots", tmp / "report", tmp / "t",
                                 "3.12", plats)
    download = wh.download_command(tmp / "req", tmp / "wh", "3.12", plats)
    for cmd in (resolve, download):
        assert _flag_values(cmd, "--python-version") == ["3.12"]
        assert _flag_values(cmd, "--implementation") == ["cp"]
        assert _flag_values(cmd, "--platform") == plats
        assert "--only-binary=:all:" in cmd
    assert resolve[:4] == ["python3.12", "-m", "pip", "install"]
    assert {"--dry-run", "--ignore-installed"} <= set(resolve)
    assert _flag_values(resolve, "--report") == [str(tmp / "report")]
    assert _flag_values(resolve, "--target") == [str(tmp / "t")]
    assert {"--no-deps", "--require-hashes"} <= set(download)
    install = wh.install_command(tmp / "wh", Path("/tmp/site"))
    assert {"--no-index", "--no-deps", "--require-hashes"} <= set(install)
    assert _flag_values(install, "--find-links") == [str(tmp / "wh")]
    assert _flag_values(install, "-r") == [str(tmp / "wh" / wh.REQUIREMENTS)]
    assert _flag_values(install, "--target") == ["/tmp/site"]
    assert "--target" not in wh.install_command(tmp / "wh", None)


def test_requirements_text_pins_hashes(lock):
    text = wh.requirements_text(lock["packages"][:2])
    p = lock["packages"][0]
    assert text.splitlines()[0] == f"{p['name']}=={p['version']} --hash=sha256:{p['sha256']}"
    assert len(text.splitlines()) == 2


def _wheelhouse(path: Path) -> Path:
    """A small synthetic wheelhouse: three 'wheels' of pseudo-random bytes and a manifest."""
    path.mkdir()
    for i, (name, size) in enumerate([("alpha", 150_000), ("beta", 70_000), ("gamma", 9)]):
        data = hashlib.sha256(str(i).encode()).digest() * (size // 32 + 1)
        (path / f"{name}-1.{i}-py3-none-any.whl").write_bytes(data[:size])
    wheels = [wh.wheel_entry(p) for p in sorted(path.glob("*.whl"))]
    manifest = {"python_version": "3.12", "glibc_floor": "2.31", "wheels": wheels}
    (path / wh.MANIFEST).write_text(json.dumps(manifest))
    (path / wh.REQUIREMENTS).write_text(wh.requirements_text(wheels))
    return path


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_split_join_round_trip(tmp_path):
    src = _wheelhouse(tmp_path / "wh")
    index = wh.split(src, tmp_path / "parts", part_mib=0.05)
    assert len(index["parts"]) >= 4
    assert all(p["size"] <= 0.05 * wh.MIB for p in index["parts"])
    assert (tmp_path / "parts" / "wheelhouse.py").read_text() == Path(wh.__file__).read_text()
    again = wh.split(src, tmp_path / "parts2", part_mib=0.05)
    assert again["sha256"] == index["sha256"]  # same wheelhouse, same bytes
    manifest = wh.join(tmp_path / "parts", tmp_path / "joined")
    assert _files(tmp_path / "joined") == _files(src)
    assert [w["name"] for w in manifest["wheels"]] == ["alpha", "beta", "gamma"]
    assert not (tmp_path / "parts" / wh.TAR).exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_join_refuses_a_damaged_part(tmp_path, damage):
    wh.split(_wheelhouse(tmp_path / "wh"), tmp_path / "parts", part_mib=0.05)
    part = tmp_path / "parts" / f"{wh.TAR}.002"
    data = bytearray(part.read_bytes())
    if damage == "flip":
        data[1000] ^= 1
        part.write_bytes(bytes(data))
    elif damage == "truncate":
        part.write_bytes(bytes(data[:-1]))
    else:
        part.unlink()
    with pytest.raises(SystemExit, match=f"{wh.TAR}.002"):
        wh.join(tmp_path / "parts", tmp_path / "joined")
    assert not (tmp_path / "joined").exists()
    assert not (tmp_path / "parts" / wh.TAR).exists()


def test_join_refuses_a_wheel_that_differs_from_the_manifest(tmp_path):
    src = _wheelhouse(tmp_path / "wh")
    (src / "beta-1.1-py3-none-any.whl").write_bytes(b"not the manifest's wheel")
    wh.split(src, tmp_path / "parts", part_mib=1)
    with pytest.raises(SystemExit, match="beta"):
        wh.join(tmp_path / "parts", tmp_path / "joined")


def test_tool_imports_the_standard_library_only():
    """join, install and verify run on the host from a copy of the file, with nothing else:
    its module-level imports are the standard library's."""
    tree = ast.parse(Path(wh.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in top if isinstance(n, ast.ImportFrom)}
    assert {m.split(".")[0] for m in names} - {"__future__"} <= sys.stdlib_module_names
