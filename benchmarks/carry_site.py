"""Pack the Python packages that `rl`'s processes need and the GPU machine's image lacks into one tarball laid out as a
site-packages directory, so they can travel with the working tree to a machine that has torch and transformers but
no uv, no verifiers and no web stack (benchmarks/multi_gpu_x2.sh unpacks it there).

    python benchmarks/carry_site.py --wheels .whl --out .whl/site.tar.gz       # here, in uv's environment
    mkdir -p /tmp/site && tar xzf .whl/site.tar.gz -C /tmp/site                # there
    export PYTHONPATH=/tmp/site:$PWD/src:$PWD/environments/reverse_text

What goes in: every distribution installed here that the processes import — found by importing their modules in a
fresh interpreter, plus RUNTIME_ONLY, the ones first imported while rollouts run (found by recording the modules of
every process of a CPU `rl` run) — except those on the image (ON_IMAGE, read off the image's package list of
2026-11-17). Pure-Python and abi3 distributions are copied from this environment (the files their RECORD lists, the
dist-info included, so version checks still work). A distribution whose extension modules are built for this
interpreter alone cannot travel that way: it comes from a wheel for the target in --wheels (e.g. pydantic-core, jiter,
cffi for CPython 3.12), and a missing one is named together with the `pip download` command that fetches it.

Prints one JSON object (what was packed, from where, and the tarball's size; the table goes to stderr). `--smoke`
probes and sorts every distribution as a real run does, then packs only the three smallest that copy from this
environment (no wheels needed), naming the interpreter-bound ones it would look up under "not_run".
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import io
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from report import add_smoke_flag, emit, not_run

PROBE_MODULES = [
    "primerl.cli", "primerl.launch.local", "primerl.inference.server", "primerl.inference.engines.hf", "uvicorn",
    "primerl.orchestrator.loop", "primerl.orchestrator.verifiers_bridge", "reverse_text", "primerl.trainer.rl",
    "pytest", "pytest_timeout",  # the GPU tests (tests/gpu) run there too
]
RUNTIME_ONLY = {"cffi", "cryptography", "mcp", "mcp-types", "openai-harmony", "sse-starlette"}
ON_IMAGE = {
    "accelerate", "aiofiles", "aiohappyeyeballs", "aiohttp", "aiosignal", "annotated-doc", "anyio", "attrs",
    "certifi", "charset-normalizer", "click", "cuda-bindings", "cuda-pathfinder", "cuda-toolkit", "filelock",
    "frozenlist", "fsspec", "h11", "hf-xet", "httpcore", "httpx", "huggingface-hub", "idna", "jinja2",
    "markdown-it-py", "markupsafe", "mdurl", "mpmath", "multidict", "networkx", "numpy", "packaging", "pillow",
    "propcache", "protobuf", "psutil", "pygments", "pyyaml", "regex", "requests", "rich", "safetensors", "setuptools",
    "sympy", "tokenizers", "torch", "tqdm", "transformers", "triton", "typing-extensions", "urllib3", "yarl",
}
PRIMERL_OWN = {"primerl", "reverse-text"}  # travel as source (src/, environments/)
_EXTENSION = re.compile(r"\.(so|pyd)$")
_ABI3 = re.compile(r"\.abi3\.so$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def needed_distributions() -> set[str]:
    """Distributions whose modules the processes import (probed in a fresh interpreter) plus RUNTIME_ONLY."""
    code = (
        "import importlib, importlib.metadata as md, json, sys\n"
        f"for m in {PROBE_MODULES!r}: importlib.import_module(m)\n"
        "p2d = md.packages_distributions()\n"
        "print(json.dumps(sorted({d for m in list(sys.modules) for d in p2d.get(m.split('.')[0], [])})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return {canonical(d) for d in json.loads(out.splitlines()[-1])} | RUNTIME_ONLY


def _site_files(dist: md.Distribution) -> list[tuple[Path, str]]:
    """(file here, path inside site-packages) for every file of `dist` that lives in site-packages."""
    base = Path(dist.locate_file(""))
    out = []
    for f in dist.files or []:
        if f.parts[0] == ".." or "__pycache__" in f.parts:
            continue
        out.append((base / f, f.as_posix()))
    return out


def interpreter_bound(files: list[tuple[Path, str]]) -> bool:
    """Whether `files` hold an extension module built for one interpreter (not the stable ABI)."""
    return any(_EXTENSION.search(name) and not _ABI3.search(name) for _, name in files)


def find_wheel(wheels: Path | None, name: str, version: str, python_tag: str) -> Path | None:
    if wheels is None:
        return None
    prefix = f"{canonical(name).replace('-', '_')}-{version}-"
    for wheel in sorted(wheels.glob("*.whl")):
        if wheel.name.lower().startswith(prefix) and (f"-{python_tag}-" in wheel.name or "-abi3-" in wheel.name):
            return wheel
    return None


def add_wheel(tar: tarfile.TarFile, wheel: Path) -> int:
    """Unpack a wheel's site-packages content into the tarball; returns bytes added."""
    total = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            top = info.filename.split("/", 1)[0]
            if info.is_dir() or top.endswith(".data"):
                continue
            data = z.read(info)
            entry = tarfile.TarInfo(info.filename)
            entry.size, entry.mode = len(data), 0o755 if _EXTENSION.search(info.filename) else 0o644
            tar.addfile(entry, io.BytesIO(data))
            total += len(data)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".whl/site.tar.gz"), help="the tarball to write")
    parser.add_argument("--wheels", type=Path, help="wheels for the target (interpreter-bound distributions)")
    parser.add_argument("--python-tag", default="cp312", help="the target interpreter's wheel tag")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)

    carry = sorted(needed_distributions() - ON_IMAGE - PRIMERL_OWN)
    result: dict = {"tarball": str(args.out), "python_tag": args.python_tag, "needed": carry}
    if args.smoke:
        carry = smoke_selection(carry, result)
    missing, rows = [], []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(args.out, "w:gz") as tar:
        for name in carry:
            dist = md.distribution(name)
            files = _site_files(dist)
            if interpreter_bound(files):
                wheel = find_wheel(args.wheels, name, dist.version, args.python_tag)
                if wheel is None:
                    missing.append(f"{name}=={dist.version}")
                    continue
                rows.append((name, dist.version, add_wheel(tar, wheel), wheel.name))
                continue
            size = 0
            for path, arcname in files:
                tar.add(path, arcname=arcname)
                size += path.stat().st_size
            rows.append((name, dist.version, size, "this environment"))
    for name, version, size, source in rows:
        print(f"{name:28} {version:12} {size / 2**20:7.2f} MiB  {source}", file=sys.stderr)
    result["packed"] = [{"name": n, "version": v, "bytes": b, "from": src} for n, v, b, src in rows]
    result["missing_wheels"] = missing
    if missing:
        args.out.unlink()
        py = args.python_tag.removeprefix("cp")
        print(f"carry_site: no {args.python_tag} wheel in {args.wheels} for {', '.join(missing)}; fetch with\n"
              f"  python3 -m pip download --no-deps --only-binary=:all: --python-version {py[0]}.{py[1:]} "
              f"--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 "
              f"--platform manylinux2014_x86_64 -d {args.wheels or '.whl'} {' '.join(missing)}", file=sys.stderr)
        emit(result, None, smoke=args.smoke)
        return 1
    result["tarball_mib"] = round(args.out.stat().st_size / 2**20, 2)
    print(f"carry_site: {len(rows)} distributions, {args.out} = {result['tarball_mib']:.1f} MiB", file=sys.stderr)
    emit(result, None, smoke=args.smoke)
    return 0


def smoke_selection(carry: list[str], result: dict) -> list[str]:
    """The three smallest distributions that copy from this environment; the interpreter-bound ones named."""
    copyable, bound = [], []
    for name in carry:
        files = _site_files(md.distribution(name))
        if interpreter_bound(files):
            bound.append(name)
        else:
            copyable.append((sum(path.stat().st_size for path, _ in files if path.is_file()), name))
    if bound:
        not_run(result, "interpreter_bound", f"{', '.join(bound)}: packed from wheels for the target (--wheels), "
                "which a smoke run does not fetch")
    return [name for _, name in sorted(copyable)[:3]]


if __name__ == "__main__":
    sys.exit(main())
