"""A wheelhouse of the serving runtime, for a GPU host without a network.

The host brings its own CUDA torch + triton; the wheelhouse carries everything else that
Fathom's runtime dependencies (pyproject.toml) pull in, pinned with sha256 hashes, for one
target Python and platform. Five steps (docs/deployment.md, "Installing on a host without
network"):

    python -m tools.wheelhouse lock                     # pip resolves the pinned closure
    python -m tools.wheelhouse download --dest WH       # the locked wheels + Fathom's own
    python -m tools.wheelhouse split --src WH --dest P  # tar, cut into parts of --part-mib
    python3 P/wheelhouse.py join --parts P --dest WH    # on the host: check, reassemble
    python3 WH/wheelhouse.py install --wheelhouse WH --target /tmp/site

``lock`` and ``download`` run where pip reaches an index. ``join``, ``install`` and
``verify`` use the standard library and the host's pip only: ``split`` copies this file
beside the parts, and ``join`` leaves it in the wheelhouse, so the host needs no checkout.
That is why it is one file, with the standard library's imports only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from collections.abc import Iterable
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LOCK_DIR = ROOT / "deploy" / "wheelhouse"
PYTHON_VERSION = "3.12"
# llguidance 1.9.1 ships manylinux_2_31 wheels only: the oldest glibc that fits every pin.
GLIBC = "2.31"
ARCH = "x86_64"
# The host's own: its CUDA build of torch and what comes with it. A wheel of these in the
# wheelhouse would replace the host's torch.
HOST_NAMES = frozenset({"torch", "triton"})
HOST_PREFIXES = ("nvidia-", "cuda-")
# What ``verify`` imports: the serving runtime and the app.
IMPORTS = ("ray", "ray.serve", "fastapi", "pydantic", "llguidance", "deepseek_recipe", "app")
# Marker variables that describe the target interpreter; the rest (kernel release) is noise.
MARKER_KEYS = (
    "implementation_name", "implementation_version", "os_name", "platform_machine",
    "platform_python_implementation", "platform_system", "python_full_version",
    "python_version", "sys_platform",
)
LEGACY_GLIBC = {"manylinux2014": (2, 17), "manylinux2010": (2, 12), "manylinux1": (2, 5)}
REQUIREMENTS = "requirements.txt"
MANIFEST = "manifest.json"
PARTS = "parts.json"
TAR = "wheelhouse.tar"
MIB = 1 << 20


def normalize(name: str) -> str:
    """PEP 503 name: ``Typing_Extensions`` -> ``typing-extensions``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def host_provided(name: str) -> bool:
    """True for torch, triton and the CUDA wheels: the host has them, the wheelhouse never."""
    n = normalize(name)
    return n in HOST_NAMES or n.startswith(HOST_PREFIXES)


def lock_path(python_version: str = PYTHON_VERSION, arch: str = ARCH) -> Path:
    """The committed lock of one target: ``deploy/wheelhouse/serve-cp312-x86_64.lock.json``."""
    return LOCK_DIR / f"serve-cp{python_version.replace('.', '')}-{arch}.lock.json"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(MIB):
            h.update(block)
    return h.hexdigest()


# ---- target flags and pip commands ---------------------------------------------------------


def platform_tags(glibc: str = GLIBC, arch: str = ARCH) -> list[str]:
    """Every manylinux tag a host with this glibc accepts, newest first (pip matches each tag
    exactly): 2.31 -> manylinux_2_31_x86_64 ... manylinux_2_5_x86_64, manylinux2014_x86_64,
    manylinux2010_x86_64, manylinux1_x86_64 (the legacy names of 2.17, 2.12, 2.5)."""
    major, minor = (int(x) for x in glibc.split("."))
    if major != 2 or minor < 17:
        raise ValueError(f"glibc {glibc}: expected 2.17 or newer")
    tags = [f"manylinux_2_{n}_{arch}" for n in range(minor, 4, -1)]
    return tags + [f"{legacy}_{arch}" for legacy in LEGACY_GLIBC]


def target_flags(python_version: str, platforms: Iterable[str]) -> list[str]:
    """pip's flags for a foreign target: its Python, CPython, its platforms, wheels only."""
    flags = ["--python-version", python_version, "--implementation", "cp"]
    for tag in platforms:
        flags += ["--platform", tag]
    return flags + ["--only-binary=:all:"]


def resolve_command(interpreter: str, roots: Path, report: Path, target: Path,
                    python_version: str, platforms: list[str]) -> list[str]:
    """pip's own resolver, dry-run: the install report (versions, hashes, metadata) of the
    closure of ``roots`` for the target, ignoring what the resolving interpreter has."""
    return [interpreter, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
            "--report", str(report), "--target", str(target),
            *target_flags(python_version, platforms), "-r", str(roots)]


def download_command(requirements: Path, dest: Path, python_version: str,
                     platforms: list[str]) -> list[str]:
    """Download exactly the locked files: no resolution (``--no-deps``), hashes checked."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
            *target_flags(python_version, platforms), "-r", str(requirements), "-d", str(dest)]


def app_wheel_command(source: Path, dest: Path) -> list[str]:
    """Build Fathom's own wheel (pure Python; its dependencies are the lock's)."""
    return [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(dest),
            str(source)]


def install_command(wheelhouse: Path, target: Path | None) -> list[str]:
    """Offline install: no index, no resolution, every file checked against its hash. With a
    target, into that folder (no root needed; put it on PYTHONPATH), else into this Python."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(wheelhouse),
           "--no-deps", "--require-hashes", "--no-compile", "-r", str(wheelhouse / REQUIREMENTS)]
    return cmd + (["--target", str(target), "--upgrade"] if target else [])


def run(cmd: list[str]) -> None:
    """Run a command, echoed; raise on failure."""
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


# ---- lock ----------------------------------------------------------------------------------


def pyproject_roots(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """Fathom's runtime dependencies, as written, less the host's own (torch, triton)."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if not host_provided(re.split(r"[\s\[<>=!~;]", d, maxsplit=1)[0])]


def find_interpreter(python_version: str) -> str:
    """A Python of the target version: pip evaluates the dependencies' markers
    (``python_version < "3.12"``) with the interpreter it runs in, not ``--python-version``."""
    names = [sys.executable, shutil.which(f"python{python_version}") or ""]
    names += sorted(str(p) for p in Path.home().glob(f".pyenv/versions/{python_version}.*/bin/"
                                                     f"python{python_version}"))
    for name in filter(None, names):
        probe = "import sys; print('%d.%d' % sys.version_info[:2])"
        out = subprocess.run([name, "-c", probe], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip() == python_version:
            return name
    raise SystemExit(f"no Python {python_version} found: pass --interpreter")


def wheel_glibc(filename: str) -> tuple[int, int]:
    """The oldest glibc that one of a wheel's platform tags accepts; (0, 0) for pure ones.
    ``x-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl`` -> (2, 17)."""
    floors = []
    for tag in filename[:-4].split("-")[-1].split("."):
        m = re.match(r"manylinux_(\d+)_(\d+)_", tag)
        legacy = LEGACY_GLIBC.get(tag.rsplit("_", 2)[0]) if tag.startswith("manylinux") else None
        floors.append((int(m[1]), int(m[2])) if m else legacy or (0, 0))
    return min(floors)


def lock_from_report(report: dict[str, Any], roots: list[str], python_version: str,
                     glibc: str, arch: str) -> dict[str, Any]:
    """The lock of one pip install report: each package's version, wheel, sha256 and
    requirements, the roots it was resolved from and the target it fits."""
    packages = []
    for item in report["install"]:
        meta, info = item["metadata"], item["download_info"]
        if host_provided(meta["name"]):
            continue
        packages.append({
            "name": normalize(meta["name"]),
            "version": meta["version"],
            "file": info["url"].rsplit("/", 1)[-1],
            "sha256": info["archive_info"]["hashes"]["sha256"],
            "requires_dist": meta.get("requires_dist", []),
        })
    packages.sort(key=lambda p: p["name"])
    floor = max(wheel_glibc(p["file"]) for p in packages)
    env = report["environment"]
    return {
        "generated_by": "python -m tools.wheelhouse lock",
        "pip_version": report["pip_version"],
        "python_version": python_version,
        "glibc": glibc,
        "arch": arch,
        "glibc_floor": f"{floor[0]}.{floor[1]}",
        "environment": {k: env[k] for k in MARKER_KEYS},
        "requirements": roots,
        "packages": packages,
    }


def check_lock(lock: dict[str, Any]) -> list[str]:
    """Problems of a lock, [] when none: every requirement of the roots and of every locked
    package (markers evaluated for the target) met by exactly one locked version, except the
    host's own; no host package; nothing locked that the roots do not reach."""
    # packaging (pip's own parser, in every dev environment) only where a lock is checked
    from packaging.requirements import Requirement

    problems: list[str] = []
    by_name: dict[str, dict[str, Any]] = {}
    for p in lock["packages"]:
        if p["name"] in by_name:
            problems.append(f"{p['name']} locked twice")
        if host_provided(p["name"]):
            problems.append(f"{p['name']} is the host's own")
        by_name[p["name"]] = p
    env = lock["environment"]
    extras: dict[str, set[str]] = {}
    todo = [(Requirement(r), "pyproject.toml") for r in lock["requirements"]]
    while todo:
        req, origin = todo.pop()
        name = normalize(req.name)
        if host_provided(name):
            continue
        pkg = by_name.get(name)
        if pkg is None:
            problems.append(f"{origin} needs {req}: not locked")
            continue
        if not req.specifier.contains(pkg["version"], prereleases=True):
            problems.append(f"{origin} needs {req}: locked {pkg['version']}")
        new = {""} | set(req.extras)
        if name in extras and new <= extras[name]:
            continue
        added = new - extras.get(name, set())
        extras.setdefault(name, set()).update(new)
        for dep in map(Requirement, pkg["requires_dist"]):
            if any(dep.marker is None or dep.marker.evaluate({**env, "extra": e})
                   for e in added):
                todo.append((dep, f"{name} {pkg['version']}"))
    problems += [f"{n} is locked but nothing needs it" for n in by_name if n not in extras]
    return problems


def requirements_text(packages: Iterable[dict[str, Any]]) -> str:
    """A hash-pinned pip requirements file: ``name==version --hash=sha256:...`` a line."""
    return "".join(f"{p['name']}=={p['version']} --hash=sha256:{p['sha256']}\n"
                   for p in packages)


def cmd_lock(args: argparse.Namespace) -> None:
    """Resolve the closure with pip for the target and write the lock."""
    roots = pyproject_roots()
    interpreter = args.interpreter or find_interpreter(args.python_version)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "roots.txt").write_text("".join(r + "\n" for r in roots))
        run(resolve_command(interpreter, work / "roots.txt", work / "report.json",
                            work / "target", args.python_version,
                            platform_tags(args.glibc, args.arch)))
        report = json.loads((work / "report.json").read_text())
    lock = lock_from_report(report, roots, args.python_version, args.glibc, args.arch)
    if problems := check_lock(lock):
        raise SystemExit("lock does not hold:\n  " + "\n  ".join(problems))
    out = Path(args.out) if args.out else lock_path(args.python_version, args.arch)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(lock, indent=1) + "\n")
    print(f"{out}: {len(lock['packages'])} packages, glibc >= {lock['glibc_floor']}")


# ---- download ------------------------------------------------------------------------------


def app_source(dest: Path) -> Path:
    """The files of Fathom's wheel as git sees them (tracked or new, not ignored), copied to
    ``dest``: pyproject.toml, README.md and the packages it includes. A wheel built from the
    copy leaves no build/ in the checkout and takes no stale module from an old one."""
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]["include"]
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        top = name.split("/")[0]
        if (name in ("pyproject.toml", "README.md") or any(fnmatch(top, p) for p in include)) \
                and (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def wheel_entry(path: Path) -> dict[str, Any]:
    """Manifest entry of one wheel: name and version from its file name, sha256, size."""
    name, version = path.name.split("-")[:2]
    return {"name": normalize(name), "version": version, "file": path.name,
            "sha256": sha256_file(path), "size": path.stat().st_size}


def cmd_download(args: argparse.Namespace) -> None:
    """Download the locked wheels and build Fathom's; write requirements and manifest."""
    lock_file = Path(args.lock)
    lock = json.loads(lock_file.read_text())
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        locked = Path(tmp) / "locked.txt"
        locked.write_text(requirements_text(lock["packages"]))
        platforms = platform_tags(lock["glibc"], lock["arch"])
        run(download_command(locked, dest, lock["python_version"], platforms))
        run(app_wheel_command(app_source(Path(tmp) / "src"), Path(tmp) / "app"))
        built = next((Path(tmp) / "app").glob("*.whl"))
        app = dest / built.name
        shutil.move(built, app)
    wanted = {p["file"]: p for p in lock["packages"]}
    for path in sorted(dest.glob("*.whl")):
        if path != app and path.name not in wanted:
            print(f"removing {path.name}: not in {lock_file.name}")
            path.unlink()
    wheels = [wheel_entry(dest / p["file"]) for p in lock["packages"]] + [wheel_entry(app)]
    for w in wheels[:-1]:
        if w["sha256"] != wanted[w["file"]]["sha256"]:
            raise SystemExit(f"{w['file']}: sha256 differs from the lock")
    (dest / REQUIREMENTS).write_text(requirements_text(wheels))
    manifest = {"python_version": lock["python_version"], "glibc_floor": lock["glibc_floor"],
                "lock": lock_file.name, "total_bytes": sum(w["size"] for w in wheels),
                "wheels": wheels}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.copy(__file__, dest / "wheelhouse.py")
    print(f"{dest}: {len(wheels)} wheels, {manifest['total_bytes'] / MIB:.1f} MiB")


# ---- split / join --------------------------------------------------------------------------


def _normalized(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Same bytes for the same wheelhouse: no owners, times or modes of this machine."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    info.mode = 0o755 if info.isdir() else 0o644
    return info


def split(src: Path, dest: Path, part_mib: float) -> dict[str, Any]:
    """Tar the wheelhouse ``src`` (sorted, normalized), cut the tar into parts
    ``wheelhouse.tar.000``, ``.001``, ... of at most ``part_mib`` MiB in ``dest``, and write
    ``parts.json`` (each part's and the whole tar's size and sha256) and a copy of this tool
    beside them: all that ``join`` needs."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob(f"{TAR}*"):
        old.unlink()
    tar_path = dest / TAR
    with tarfile.open(tar_path, "w") as tar:
        for path in sorted(src.iterdir()):
            tar.add(path, arcname=path.name, filter=_normalized)
    size = int(part_mib * MIB)
    parts = []
    with open(tar_path, "rb") as f:
        while chunk := f.read(size):
            name = f"{TAR}.{len(parts):03d}"
            (dest / name).write_bytes(chunk)
            parts.append({"file": name, "size": len(chunk),
                          "sha256": hashlib.sha256(chunk).hexdigest()})
    index = {"tar": TAR, "size": tar_path.stat().st_size, "sha256": sha256_file(tar_path),
             "part_bytes": size, "parts": parts}
    tar_path.unlink()
    (dest / PARTS).write_text(json.dumps(index, indent=1) + "\n")
    shutil.copy(__file__, dest / "wheelhouse.py")
    return index


def check_wheelhouse(wheelhouse: Path) -> dict[str, Any]:
    """Check every wheel of the manifest (size, sha256); return the manifest."""
    manifest = json.loads((wheelhouse / MANIFEST).read_text())
    for w in manifest["wheels"]:
        path = wheelhouse / w["file"]
        if not path.is_file() or path.stat().st_size != w["size"] \
                or sha256_file(path) != w["sha256"]:
            raise SystemExit(f"{path}: missing, or size or sha256 differs from {MANIFEST}")
    return manifest


def join(parts: Path, dest: Path) -> dict[str, Any]:
    """Check every part (present, size, sha256), concatenate them, check the whole tar's
    sha256, unpack it into ``dest`` and check every wheel; return the wheelhouse's manifest."""
    index = json.loads((parts / PARTS).read_text())
    tar_path = parts / index["tar"]
    try:
        with open(tar_path, "wb") as out:
            for part in index["parts"]:
                path = parts / part["file"]
                data = path.read_bytes() if path.is_file() else b""
                if len(data) != part["size"] or hashlib.sha256(data).hexdigest() != part["sha256"]:
                    raise SystemExit(f"{path}: missing, or size or sha256 differs from {PARTS}")
                out.write(data)
        if sha256_file(tar_path) != index["sha256"]:
            raise SystemExit(f"{tar_path}: sha256 differs from {PARTS}")
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tar_path) as tar:
            tar.extractall(dest, filter="data")
    finally:
        tar_path.unlink(missing_ok=True)
    return check_wheelhouse(dest)


# ---- install / verify ----------------------------------------------------------------------


def verify(target: Path | None) -> None:
    """Import the serving runtime and the app in a fresh interpreter (``target`` appended to
    PYTHONPATH, so that a checkout named there comes first) and check that torch is still the
    host's own."""
    code = ("import importlib, torch\n"
            f"for m in {IMPORTS!r}: importlib.import_module(m)\n"
            "import ray\n"
            "print('ok: ray', ray.__version__, '| torch', torch.__version__, torch.__file__)\n")
    env = dict(os.environ)
    if target is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(target)]))
        code += f"assert not torch.__file__.startswith({str(target.resolve())!r}), torch.__file__\n"
    if subprocess.run([sys.executable, "-c", code], env=env).returncode:
        raise SystemExit("verify failed (traceback above): the host needs its CUDA torch + "
                         "triton, the app needs the checkout or Fathom's wheel on the path")


def cmd_install(args: argparse.Namespace) -> None:
    """Check the wheelhouse and the host, install offline, verify the imports."""
    wheelhouse = Path(args.wheelhouse)
    manifest = check_wheelhouse(wheelhouse)
    if f"{sys.version_info[0]}.{sys.version_info[1]}" != manifest["python_version"]:
        raise SystemExit(f"this is Python {platform.python_version()}; the wheelhouse is for "
                         f"{manifest['python_version']}")
    libc, version = platform.libc_ver()
    floor = tuple(map(int, manifest["glibc_floor"].split(".")))
    if libc == "glibc" and tuple(map(int, version.split(".")[:2])) < floor:
        raise SystemExit(f"glibc {version} here; the wheelhouse needs {manifest['glibc_floor']}")
    host = [w["file"] for w in manifest["wheels"] if host_provided(w["name"])]
    if host:
        raise SystemExit(f"the wheelhouse carries the host's own packages: {host}")
    target = Path(args.target) if args.target else None
    run(install_command(wheelhouse, target))
    verify(target)


# ---- command line --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """``python -m tools.wheelhouse {lock,download,split,join,install,verify} ...``"""
    ap = argparse.ArgumentParser(prog="wheelhouse", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("lock", help="resolve the pinned closure for a target into a lock")
    p.add_argument("--python-version", default=PYTHON_VERSION)
    p.add_argument("--glibc", default=GLIBC, help="the hosts' glibc: no wheel may need more")
    p.add_argument("--arch", default=ARCH)
    p.add_argument("--interpreter", help="a Python of the target version (default: found)")
    p.add_argument("--out", help="the lock file (default: deploy/wheelhouse/serve-cpXY-ARCH)")
    p = sub.add_parser("download", help="download the locked wheels and build Fathom's")
    p.add_argument("--lock", default=str(lock_path()))
    p.add_argument("--dest", required=True)
    p = sub.add_parser("split", help="tar a wheelhouse into parts of at most --part-mib MiB")
    p.add_argument("--src", required=True)
    p.add_argument("--dest", required=True)
    p.add_argument("--part-mib", type=float, default=30)
    p = sub.add_parser("join", help="check the parts and unpack the wheelhouse (stdlib only)")
    p.add_argument("--parts", required=True)
    p.add_argument("--dest", required=True)
    p = sub.add_parser("install", help="install the wheelhouse offline, then verify")
    p.add_argument("--wheelhouse", required=True)
    p.add_argument("--target", help="install into this folder (then put it on PYTHONPATH)")
    p = sub.add_parser("verify", help="import the serving runtime and the app")
    p.add_argument("--target")
    args = ap.parse_args(argv)
    if args.command == "lock":
        cmd_lock(args)
    elif args.command == "download":
        cmd_download(args)
    elif args.command == "split":
        index = split(Path(args.src), Path(args.dest), args.part_mib)
        for part in index["parts"]:
            print(f"{part['file']}  {part['size']:>10}  {part['sha256']}")
        print(f"{len(index['parts'])} parts, {index['size'] / MIB:.1f} MiB in {args.dest}")
    elif args.command == "join":
        manifest = join(Path(args.parts), Path(args.dest))
        print(f"{args.dest}: {len(manifest['wheels'])} wheels checked")
    elif args.command == "install":
        cmd_install(args)
    else:
        verify(Path(args.target) if args.target else None)


if __name__ == "__main__":
    main()
