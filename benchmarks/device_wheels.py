"""Which wheels a device machine (no network, Python 3.12 with numba and friends) needs to run
kvrelay's benchmarks, and their installation there. Standard library only (``packaging`` where
it exists), so it runs before anything is installed.

* ``plan`` (here, in the project's ``.venv``): kvrelay's runtime dependencies, read from
  ``pyproject.toml`` and followed through the installed packages' own requirements (markers
  evaluated for CPython 3.12 on x86-64 Linux), pinned to the versions installed here (the ones
  tested). Each is ``missing`` (the device lacks it: always carried), ``fallback`` (the device
  has it; a small wheel is carried and installed only where the device's version does not
  satisfy, with the build backend, setuptools) or ``device`` (numpy, numba and the other large
  ones: only checked there). Prints ``group name version requirement`` lines.
* ``prepare DIR`` (here, with the package index): ``pip download --no-deps --only-binary`` of
  each carried wheel for cp312 manylinux x86-64 into DIR (a wheel already there is kept),
  removes any other wheel there, writes DIR/manifest.json, then ``verify``.
* ``verify DIR`` (here): every requirement of every carried wheel is carried or on the device;
  one version of each; prints the wheels and their total size.
* ``select DIR`` (there): the wheel files to install, given what the interpreter already has.
* ``unpack SITE WHEEL...`` (there, only without pip): unzip wheels into a site-packages dir.
* ``check`` (there, after the install): every runtime requirement importable at a version that
  satisfies it; a missing one fails, a version outside the range is a warning.

``benchmarks/device_prepare.sh`` and ``benchmarks/device_run.sh`` drive it.
"""

from __future__ import annotations

import json
import re
import sys
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "manifest.json"

#: What the device machines' image already holds of kvrelay's closure (the workplace's package
#: list of the 'cuda' image): numba, llvmlite, numpy, grpcio, protobuf, uvloop, xxhash,
#: prometheus-client, and these small ones.
DEVICE_HAS = {"numba", "llvmlite", "numpy", "grpcio", "protobuf", "uvloop", "xxhash",
              "prometheus-client", "multidict", "python-dateutil", "typing-extensions", "six",
              "setuptools", "wheel", "packaging"}  # fmt: skip
#: Of those, the ones small enough to carry anyway, installed only where the device's version
#: does not satisfy kvrelay's closure.
FALLBACK = {"multidict", "python-dateutil", "typing-extensions", "six", "setuptools"}
#: What a target interpreter's markers evaluate against.
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython"}


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement(text: str):  # packaging: optional on the device, imported late
    from packaging.requirements import Requirement

    return Requirement(text)


def _applies(req, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate(TARGET_ENV | {"extra": e}) for e in (extras or {""}))


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def closure() -> dict[str, dict]:
    """``{name: {"version", "specifiers", "extras"}}`` of kvrelay's runtime closure, from what
    is installed in this interpreter (the project's .venv)."""
    out: dict[str, dict] = {}
    todo = [(_requirement(t), set()) for t in _pyproject()["project"]["dependencies"]]
    while todo:
        req, extras = todo.pop()
        if not _applies(req, extras):
            continue
        name = canon(req.name)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"{req.name} is not installed in {sys.prefix}: install the "
                             "project's .venv first (make venv)") from None
        entry = out.get(name)
        if entry is None:
            entry = out[name] = {"version": dist.version, "specifiers": set(), "extras": set(),
                                 "done": False}  # fmt: skip
        if str(req.specifier):
            entry["specifiers"].add(str(req.specifier))
        if entry["done"] and set(req.extras) <= entry["extras"]:
            continue
        entry["done"] = True
        entry["extras"] |= set(req.extras)
        todo += [(_requirement(r), set(entry["extras"])) for r in dist.requires or []]
    return out


def plan() -> list[dict]:
    """Every package of the closure, and the build backend: name, version, group, requirement
    (the specifiers that lead to it, joined) and the extras kvrelay asks of it."""
    rows = []
    for name, e in sorted(closure().items()):
        group = ("missing" if name not in DEVICE_HAS else
                 "fallback" if name in FALLBACK else "device")  # fmt: skip
        rows.append({"name": name, "version": e["version"], "group": group,
                     "requirement": ",".join(sorted(e["specifiers"])),
                     "extras": sorted(e["extras"])})  # fmt: skip
    for t in _pyproject()["build-system"]["requires"]:
        req = _requirement(t)
        if canon(req.name) == "setuptools":  # the build backend, for a --no-index install
            rows.append({"name": "setuptools", "version": metadata.version("setuptools"),
                         "group": "fallback", "requirement": str(req.specifier), "extras": []})
    return rows


#: manylinux tags pip may take for the device (glibc 2.28 or later: any current image)
PLATFORMS = ["manylinux1_x86_64", "manylinux2014_x86_64",
             *(f"manylinux_2_{n}_x86_64" for n in range(17, 29))]


def _wheel_file(folder: Path, name: str, version: str) -> Path | None:
    for w in folder.glob("*.whl"):
        dist, ver = w.name.split("-")[:2]
        if canon(dist) == name and ver == version:
            return w
    return None


def prepare(folder: Path) -> int:
    import subprocess

    folder.mkdir(parents=True, exist_ok=True)
    rows = [r for r in plan() if r["group"] != "device"]
    for r in rows:
        if _wheel_file(folder, r["name"], r["version"]) is None:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                   "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                   *(f"--platform={p}" for p in PLATFORMS), "-d", str(folder),
                   f"{r['name']}=={r['version']}"]  # fmt: skip
            print(f"device_wheels: downloading {r['name']}=={r['version']}", flush=True)
            if subprocess.call(cmd) != 0:
                print(f"device_wheels: no cp312 manylinux wheel of {r['name']}=={r['version']}",
                      file=sys.stderr)
                return 1
        w = _wheel_file(folder, r["name"], r["version"])
        if w is None:
            print(f"device_wheels: pip saved no wheel named {r['name']} {r['version']}",
                  file=sys.stderr)
            return 1
        r["file"] = w.name
    keep = {r["file"] for r in rows}
    for w in folder.glob("*.whl"):
        if w.name not in keep:
            print(f"device_wheels: removing {w.name} (not in the plan)")
            w.unlink()
    (folder / MANIFEST).write_text(json.dumps({"wheels": rows}, indent=1) + "\n")
    return verify(folder)


def _wheel_meta(path: Path) -> tuple[str, str, list[str]]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    head = text.split("\n\n", 1)[0]
    fields = re.findall(r"^([A-Za-z-]+): (.*)$", head, re.M)
    name = next(v for k, v in fields if k == "Name")
    version = next(v for k, v in fields if k == "Version")
    return canon(name), version, [v for k, v in fields if k == "Requires-Dist"]


def verify(folder: Path) -> int:
    """Every requirement of the carried wheels is carried or on the device; one version each."""
    manifest = json.loads((folder / MANIFEST).read_text())
    wheels = sorted(folder.glob("*.whl"))
    names: dict[str, list[str]] = {}
    reqs = []
    for w in wheels:
        name, version, requires = _wheel_meta(w)
        names.setdefault(name, []).append(version)
        entry = next((e for e in manifest["wheels"] if e["name"] == name), None)
        if entry is None:
            print(f"PROBLEM: {w.name} is not in {MANIFEST}", file=sys.stderr)
            return 1
        reqs += [(name, r, set(entry["extras"])) for r in requires]
    bad = [f"two versions of {n}: {v}" for n, v in names.items() if len(v) > 1]
    for owner, text, extras in reqs:
        req = _requirement(text)
        if not _applies(req, extras):
            continue
        n = canon(req.name)
        if n not in names and n not in DEVICE_HAS:
            bad.append(f"{owner} needs {text}: neither carried nor on the device")
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"  {w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
    print(f"  {total / 2**20:7.2f} MiB  in {len(wheels)} wheels")
    for line in bad:
        print(f"PROBLEM: {line}", file=sys.stderr)
    return 1 if bad else 0


def _satisfied(name: str, spec: str) -> bool:
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    if not spec:
        return True
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:  # no packaging: take what is there
        return True
    return SpecifierSet(spec).contains(have, prereleases=True)


def select(folder: Path) -> list[str]:
    """Wheel files to install: every ``missing`` one, a ``fallback`` one only where this
    interpreter's version does not satisfy."""
    manifest = json.loads((folder / MANIFEST).read_text())
    out = []
    for e in manifest["wheels"]:
        if e["group"] == "missing" or not _satisfied(e["name"], e["requirement"]):
            out.append(str(folder / e["file"]))
            if e["group"] == "fallback":
                print(f"device_wheels: carried {e['name']} {e['version']} replaces the device's "
                      f"(needs {e['requirement'] or 'any'})", file=sys.stderr)
    return out


def unpack(site: Path, wheels: list[str]) -> None:
    """What pip does for these wheels, minus scripts: files to ``site``, ``*.data/purelib`` and
    ``platlib`` contents too."""
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            for n in z.namelist():
                parts = n.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue
                    target = site.joinpath(*parts[2:])
                else:
                    target = site / n
                if n.endswith("/"):
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(n))
        print(f"device_wheels: unpacked {Path(w).name}")


def check() -> int:
    """Every runtime requirement present, at a version that satisfies it (else a warning)."""
    rows = []
    fail = False
    for t in _pyproject()["project"]["dependencies"]:
        try:
            req = _requirement(t)
        except ImportError:
            name, spec = re.split(r"[<>=!~\[; ]", t, maxsplit=1)[0], ""
        else:
            if not _applies(req, set()):
                continue
            name, spec = req.name, str(req.specifier)
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            rows.append(f"  MISSING  {name} {spec}")
            fail = True
            continue
        ok = _satisfied(name, spec)
        rows.append(f"  {'ok     ' if ok else 'WARNING'}  {name} {have} (needs {spec or 'any'})")
    print("\n".join(rows))
    return 1 if fail else 0


def main(argv: list[str]) -> int:
    cmd, args = (argv[0], argv[1:]) if argv else ("", [])
    if cmd == "plan":
        for r in plan():
            print(f"{r['group']:8s} {r['name']} {r['version']} {r['requirement']}".rstrip())
        return 0
    if cmd == "prepare":
        return prepare(Path(args[0]))
    if cmd == "verify":
        return verify(Path(args[0]))
    if cmd == "select":
        print("\n".join(select(Path(args[0]))))
        return 0
    if cmd == "unpack":
        unpack(Path(args[0]), args[1:])
        return 0
    if cmd == "check":
        return check()
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
