"""Carry vLLM 0.26, TRL 1.16 (its vLLM-colocate peer) and primerl's runtime packages to the GPU machine as one
site-packages tree for CPython 3.12 on x86-64, trimmed of what a Hopper GPU running dense models never loads, in
sha256-checked parts that each fit one device call beside the working tree.

Here, in uv's environment (reads the package index):
    uv run python benchmarks/carry_vllm.py resolve       # the dependency closure -> benchmarks/carry_vllm.lock
    uv run python benchmarks/carry_vllm.py pack          # the lock's wheels -> .carry/vllm/part-NN.tar.xz, SHA256SUMS
    uv run python benchmarks/carry_vllm.py pack --smoke  # no download, no packing: checks the lock and plans
There, with the GPU image's python3, one call per part on a machine kept warm between calls, each call carrying
.carry/vllm/part-NN.tar.xz and .carry/vllm/SHA256SUMS (`bash benchmarks/gpu_rl_x1.sh vllm-part OUT` runs this):
    python3 benchmarks/carry_vllm.py unpack [N] --site /tmp/vsite   # check part N's sha256 (default: every part
                                                                    # here), extract it; once all are in, the
                                                                    # import check runs (vllm's engine and worker
                                                                    # modules, trl's GRPOTrainer, the FA version)
    python3 benchmarks/carry_vllm.py check --site /tmp/vsite        # the import check alone

The closure starts from vllm==0.26.0, trl==1.16.0 and the distributions primerl's processes import
(`carry_site.needed_distributions`, pinned at uv's versions), follows each wheel's Requires-Dist for the target
(CPython 3.12.3, Linux x86-64) and stops at what the image has (its package list; where a version is known,
IMAGE_VERSIONS, the requirement is checked against it) and at SKIPPED (vLLM's kernel and media packages that never
load here, each with its reason; flashinfer's sampler also needs VLLM_USE_FLASHINFER_SAMPLER=0 outside
logprobs_mode="processed_logprobs"). Where two requirements disagree, the newest version meeting both is taken.
The lock pins every wheel with its sha256, so `pack` downloads the same bytes every time (pip --require-hashes),
and the parts come out byte for byte the same.

`pack` lays the wheels out as `pip install --target` would (purelib, platlib and scripts; RECORD rewritten for the
files kept), drops TRIMS, compresses each distribution's files in chunks (xz, one stream per chunk, cached under
--cache so a repack compresses only what changed) and packs the chunks into as few parts as the per-call budget
allows: 64 MiB less the working tree that travels with every call (tracked and untracked-not-ignored files) less
--margin-mib. Each part is a .tar.xz of its own, so a part is extracted on the call that brings it.
"""

from __future__ import annotations

import argparse
import base64
import csv
import email.parser
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections import defaultdict, deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from carry_site import ON_IMAGE, PRIMERL_OWN, canonical, needed_distributions  # benchmarks/carry_site.py
from report import add_smoke_flag, emit  # benchmarks/report.py

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LOCK = HERE / "carry_vllm.lock"
MiB = 2**20
CALL_LIMIT = 64 * MiB  # what one device call carries: the working tree plus the carried paths
ROOTS = ("vllm==0.26.0", "trl==1.16.0")
IMPORT_CHECK = """
import vllm, trl
from vllm.v1.engine.async_llm import AsyncLLM
from trl import GRPOTrainer
import vllm.v1.worker.gpu_model_runner, vllm.v1.attention.backends.flash_attn, vllm.model_executor.models.qwen3
try:  # the FlashAttention version vLLM picks on this GPU (needs the driver: not on a CPU machine)
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    fa = get_flash_attn_version()
except ImportError as e:
    fa = f"unavailable ({e})"
print("vllm", vllm.__version__, "trl", trl.__version__, "flash-attention version", fa)
"""

TARGET = {  # the GPU image's interpreter, for the markers of Requires-Dist
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_version": "3.12.3",
    "implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "platform_release": "",
    "platform_version": "",
}
PIP_TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
              "--abi", "abi3", "--abi", "none"] + [
    arg for tag in ["manylinux1_x86_64", "manylinux2014_x86_64", *(f"manylinux_2_{n}_x86_64" for n in range(17, 40))]
    for arg in ("--platform", tag)]

# The image's packages (read on a machine running it, 2026-11-17); carry_site.ON_IMAGE names those primerl needs.
IMAGE_MORE = {
    "absl-py", "botorch", "build", "chex", "cloudpickle", "cmake", "colorama", "contourpy", "coverage", "cuda-core",
    "cupy-cuda13x", "cycler", "cython", "diffrax", "e3nn", "einops", "equinox", "etils", "execnet", "flatbuffers",
    "flax", "fonttools", "formulaic", "gpytorch", "grpcio", "h5py", "humanize", "hypothesis", "imageio", "iniconfig",
    "interface-meta", "jax", "jax-cuda13-pjrt", "jax-cuda13-plugin", "jaxlib", "jaxtyping", "joblib", "kiwisolver",
    "lazy-loader", "lightning", "lightning-utilities", "linear-operator", "lineax", "llvmlite", "lxml", "markdown",
    "matplotlib", "meson", "ml-dtypes", "mpi4py", "msgpack", "multipledispatch", "mypy-extensions", "nanobind",
    "narwhals", "ninja", "numba", "numba-cuda", "numpyro", "nvidia-cublas", "nvidia-cuda-cupti", "nvidia-cuda-nvrtc",
    "nvidia-cuda-runtime", "nvidia-cudnn-cu13", "nvidia-cufft", "nvidia-cufile", "nvidia-curand", "nvidia-cusolver",
    "nvidia-cusparse", "nvidia-cusparselt-cu13", "nvidia-ml-py", "nvidia-nccl-cu13", "nvidia-nvjitlink",
    "nvidia-nvshmem-cu13", "nvidia-nvtx", "onnx", "onnx-ir", "onnxruntime", "onnxscript", "opencv-python-headless",
    "optax", "opt-einsum", "opt-einsum-fx", "optimistix", "orbax-checkpoint", "pandas", "pathspec", "patsy", "peft",
    "pip", "pluggy", "portalocker", "prometheus-client", "pyarrow", "pybind11", "py-cpuinfo", "pyparsing",
    "pyproject-hooks", "pyre-extensions", "pytest", "pytest-benchmark", "pytest-cov", "pytest-mock", "pytest-timeout",
    "pytest-xdist", "python-dateutil", "pytorch-lightning", "sacrebleu", "scikit-build-core", "scikit-image",
    "scikit-learn", "scipy", "seaborn", "sentencepiece", "sentence-transformers", "shellingham", "simplejson", "six",
    "sortedcontainers", "statsmodels", "tabulate", "tensorboard", "tensorboard-data-server", "tensorstore",
    "threadpoolctl", "tifffile", "tiktoken", "timm", "toolz", "torchaudio", "torchdiffeq", "torch-geometric",
    "torchmetrics", "torchvision", "treescope", "typer", "typing-inspect", "uvloop", "wadler-lindig", "werkzeug",
    "wheel", "wrapt", "xarray", "xxhash", "zipp",
}
IMAGE_VERSIONS = {  # versions seen there (python3 -m pip list)
    "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
    "sentencepiece": "0.2.2", "tiktoken": "0.14.0", "tokenizers": "0.23.2", "torch": "2.11.0",
    "torchaudio": "2.11.0", "torchvision": "0.26.0", "transformers": "5.17.0", "triton": "3.6.0",
}
ACCEPTED_CONFLICTS = {  # requirements the image's known versions break, and why the packages still serve here
    "mistral-common": "every version vLLM 0.26 accepts caps numpy<2.4 on Python <= 3.12; vLLM imports it only for "
    "Mistral-format tokenizers and Pixtral/Voxtral models",
}
SKIPPED = {  # vLLM 0.26's hard requirements that a Hopper GPU serving dense text models never imports
    "flashinfer-python": "attention on compute capability 9.x is FlashAttention 3 (platforms/cuda.py's priorities; "
    "get_valid_backends passes over a backend that fails to import); the FlashInfer top-k/top-p sampler is never "
    "built with logprobs_mode='processed_logprobs' (primerl's adapter, TRL's colocate mode) and, for any other "
    "mode, not with VLLM_USE_FLASHINFER_SAMPLER=0, which the GPU stages set; every other use is behind "
    "has_flashinfer(), False without it",
    "nvidia-cudnn-frontend": "only flashinfer loads it",
    "tilelang": "only the sparse-MLA/FP8 kernels of DeepSeek-style models import it, lazily",
    "nvidia-cutlass-dsl": "CuTe DSL kernels: FlashAttention 4 (Blackwell, or heads > 256 on SM90) and quack's",
    "quack-kernels": "CuTe DSL kernels (needs nvidia-cutlass-dsl), imported lazily by Blackwell-only paths",
    "humming-kernels": "quantized MoE/GEMM kernels (humming quantization), imported lazily",
    "tokenspeed-mla": "MLA attention kernels (DeepSeek-style models), imported lazily",
    "torchcodec": "video and audio decoding for multimodal inputs, imported lazily",
    "pynvvideocodec": "NVDEC video decoding for multimodal inputs, imported lazily",
    "fastsafetensors": "the load_format='fastsafetensors' loader only",
}
TRIMS = {  # path pattern inside the site: why a Hopper GPU with dense models never loads it
    r"vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so$": "FlashAttention 2: on compute capability 9.x "
    "fa_utils.get_flash_attn_version picks FA3; FA2 serves ALiBi and sparse attention only (flash_attn_interface.py "
    "imports each extension in its own try)",
    r"vllm/vllm_flash_attn/cute/": "FlashAttention 4 (CuTe DSL, imports cutlass from nvidia-cutlass-dsl, skipped): "
    "without the folder FA4_AVAILABLE is False and SM90 stays on FA3 instead of failing at FA4's first import",
    r"vllm/third_party/tml_fa4/": "FlashAttention 4's Blackwell kernels (CuTe DSL)",
    r"vllm/third_party/fmha_sm100/": "Blackwell FMHA sources, compiled on SM100 for MiniMax-M3's sparse attention",
    r"vllm/third_party/deep_gemm/_C\.cpython-31[0134]-": "DeepGEMM's extension for other Pythons (3.12's stays)",
    r"vllm/vllm-rs$": "the Rust API-server binary: `vllm serve` runs it only with VLLM_USE_RUST_FRONTEND=1",
    r"vllm/_moe_C_stable_libtorch\.abi3\.so$": "MoE kernels: platforms/cuda.py imports them under "
    "suppress(ImportError) and only fused_moe layers (and LoRA on MoE) call torch.ops._moe_C; the models run here "
    "(Llama/SmolLM2, Qwen3 0.6-1.7B) are dense",
    r"vllm/_flashmla(_extension)?_C\.abi3\.so$": "FlashMLA: MLA attention (DeepSeek-style), imported in a try",
    r"vllm/entrypoints/serve/instrumentator/static/": "swagger UI assets of `vllm serve`'s /docs page",
}
_TRIM = {re.compile(pattern): reason for pattern, reason in TRIMS.items()}
CHUNK = 4 * MiB  # uncompressed bytes of small files compressed together in one xz stream
_TAR_END = b"\0" * 1024


def image_packages() -> set[str]:
    return ON_IMAGE | IMAGE_MORE  # ON_IMAGE: the image's packages that primerl itself needs


# ----------------------------------------------------------------------------------------------------- resolving


class Wheel:
    """One downloaded wheel: name, version, path and its Requires-Dist."""

    def __init__(self, path: Path):
        from packaging.requirements import Requirement
        from packaging.utils import parse_wheel_filename

        name, version, _, _ = parse_wheel_filename(path.name)
        self.path, self.name, self.version = path, canonical(name), version
        with zipfile.ZipFile(path) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            message = email.parser.Parser().parsestr(z.read(meta).decode())
        self.requires = [Requirement(r) for r in message.get_all("Requires-Dist") or []]

    def needs(self, extra: str) -> list:
        """The requirements that apply on the target with `extra` ("" for the plain install)."""
        env = {**TARGET, "extra": extra}
        return [r for r in self.requires if (r.marker.evaluate(env) if r.marker else not extra)]


class NoMatch(Exception):
    """No wheel for the target meets the requirement."""


def pip_download(args: list[str], dest: Path) -> list[Path]:
    """Run pip download for the target; the wheels it saved or found."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", *PIP_TARGET,
           "-d", str(dest), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        if "No matching distribution" in proc.stderr:
            raise NoMatch(tail)
        raise SystemExit(f"carry_vllm: pip download {' '.join(args)} failed: {tail}")
    names = re.findall(r"([\w.+-]+\.whl)\b", proc.stdout)
    return sorted({dest / Path(n).name for n in names})


def downloaded(name: str, spec, wheels: Path) -> Wheel | None:
    """The newest wheel of `name` already in `wheels` that meets `spec` (a re-resolve asks the index only for what
    changed)."""
    from packaging.utils import parse_wheel_filename

    found = []
    for path in wheels.glob("*.whl"):
        wname, version, _, _ = parse_wheel_filename(path.name)
        if canonical(wname) == name and spec.contains(version, prereleases=True):
            found.append((version, path))
    return Wheel(max(found)[1]) if found else None


def resolve(roots: list[str], wheels: Path, image: set[str]) -> dict:
    """The closure of `roots` for the target: {name: Wheel}, the image's requirements and what was skipped. Where
    no version meets every requirement on a package, the version of the (not root-pinned) package that asked last
    is ruled out and the walk starts again, so an older release of it whose needs fit is taken."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    pinned = {canonical(Requirement(r).name) for r in roots}
    chosen: dict[str, Wheel] = {}
    ruled_out: dict[str, list[str]] = defaultdict(list)
    while True:  # restarts whenever a later requirement replaces an already chosen version
        wants: dict[str, list[tuple[Requirement, str]]] = defaultdict(list)
        expanded: set[tuple[str, str]] = set()
        queue = deque((Requirement(r), "root") for r in roots)
        restart = False
        while queue and not restart:
            req, via = queue.popleft()
            name = canonical(req.name)
            wants[name].append((req, via))
            if name in image or name in SKIPPED:
                continue
            spec = SpecifierSet(",".join([*(str(r.specifier) for r, _ in wants[name] if str(r.specifier)),
                                          *ruled_out[name]]))
            if name not in chosen or not spec.contains(chosen[name].version, prereleases=True):
                restart = name in chosen
                try:
                    chosen[name] = downloaded(name, spec, wheels) or Wheel(pip_download([f"{name}{spec}"], wheels)[0])
                except NoMatch:
                    askers = [canonical(v.split("[")[0]) for _, v in reversed(wants[name]) if v != "root"]
                    blame = next((a for a in askers if a not in pinned), None)
                    if blame is None:
                        raise SystemExit(f"carry_vllm: no wheel of {name}{spec} for the target") from None
                    ruled_out[blame].append(f"!={chosen[blame].version}")
                    print(f"carry_vllm: no {name}{spec}; ruling out {blame} {chosen[blame].version}", file=sys.stderr)
                    restart = True
                    continue
                print(f"carry_vllm: {name}{spec} -> {chosen[name].path.name}", file=sys.stderr)
            for extra in ("", *sorted(req.extras)):
                if (name, extra) not in expanded:
                    expanded.add((name, extra))
                    queue.extend((dep, name + (f"[{extra}]" if extra else "")) for dep in chosen[name].needs(extra))
        if not restart:
            break
    carried = {n: w for n, w in chosen.items() if n in wants and n not in image and n not in SKIPPED}
    return {"carried": carried, "wants": wants, "image": image}


def image_report(wants: dict, image: set[str]) -> tuple[dict, list[str], list[str]]:
    """The requirements the image must meet ({name: ["requirement (via)"]}), those its known versions break, and
    those of them ACCEPTED_CONFLICTS explains."""
    from packaging.version import Version

    needs, broken, accepted = {}, [], []
    for name in sorted(n for n in wants if n in image):
        needs[name] = sorted({f"{r} ({via})" for r, via in wants[name]})
        known = IMAGE_VERSIONS.get(name)
        for req, via in wants[name]:
            if known and not req.specifier.contains(Version(known), prereleases=True):
                owner = canonical(via.split("[")[0])
                text = f"{owner} needs {req.name}{req.specifier}, the image has {known}"
                if owner in ACCEPTED_CONFLICTS:
                    accepted.append(f"{text}: {ACCEPTED_CONFLICTS[owner]}")
                else:
                    broken.append(text)
    return needs, sorted(set(broken)), sorted(set(accepted))


def primerl_pins(image: set[str]) -> list[str]:
    """What primerl's processes import beyond the image, pinned at the versions installed here (uv's lock)."""
    import importlib.metadata as md

    return [f"{n}=={md.version(n)}" for n in sorted(needed_distributions() - image - PRIMERL_OWN)]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            digest.update(block)
    return digest.hexdigest()


def write_lock(lock: Path, result: dict, roots: list[str]) -> None:
    carried, wants, image = result["carried"], result["wants"], result["image"]
    needs, broken, accepted = image_report(wants, image)
    lines = [
        "# The wheels benchmarks/carry_vllm.py packs for the GPU machine (CPython 3.12, Linux x86-64), written by",
        "# `carry_vllm.py resolve`; `pack` downloads exactly these (pip download --no-deps --require-hashes).",
        f"# roots: {' '.join(ROOTS)} and the {len(roots) - len(ROOTS)} distributions primerl's processes import beyond "
        + "the image, at uv's versions (`via root`)",
    ]
    for name, w in sorted(carried.items()):
        via = ", ".join(sorted({v for _, v in wants[name]}))
        lines.append(f"{name}=={w.version} --hash=sha256:{sha256_file(w.path)}  # {w.path.name} via {via}")
    lines.append("# skipped (never imported on a Hopper GPU serving dense text models):")
    lines += [f"#   {n}: {SKIPPED[n]}" for n in sorted(SKIPPED) if n in wants]
    lines.append("# from the image (the requirements it must meet):")
    lines += [f"#   {n}: {'; '.join(reqs)}" for n, reqs in needs.items()]
    lines += [f"# accepted conflict with the image: {a}" for a in accepted]
    lines += [f"# CONFLICT with the image: {b}" for b in broken]
    lock.write_text("\n".join(lines) + "\n")


def read_lock(lock: Path) -> list[dict]:
    """The lock's pins: name, version, sha256, wheel file name."""
    if not lock.is_file():
        raise SystemExit(f"carry_vllm: no {lock}; run `carry_vllm.py resolve`")
    pins = []
    for line in lock.read_text().splitlines():
        m = re.match(r"([\w.-]+)==(\S+) --hash=sha256:([0-9a-f]{64})  # (\S+\.whl) via ", line)
        if m:
            pins.append({"name": m[1], "version": m[2], "sha256": m[3], "wheel": m[4]})
        elif line and not line.startswith("#"):
            raise SystemExit(f"carry_vllm: {lock}: not a pin line: {line[:80]}")
    if not pins:
        raise SystemExit(f"carry_vllm: {lock} pins nothing; run `carry_vllm.py resolve`")
    return pins


# ------------------------------------------------------------------------------------------------------- packing


def trim_reason(path: str) -> str | None:
    return next((reason for pattern, reason in _TRIM.items() if pattern.search(path)), None)


def site_files(wheel: Path) -> tuple[list[tuple[str, bytes, int]], int]:
    """The files `pip install --target` would lay out (site path, bytes, mode) minus TRIMS, RECORD rewritten; and
    the bytes trimmed."""
    files, trimmed, record_name = [], 0, None
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            if info.is_dir():
                continue
            parts = name.split("/")
            if parts[0].endswith(".data"):
                if parts[1] in ("purelib", "platlib"):
                    name = "/".join(parts[2:])
                elif parts[1] == "scripts":
                    name = "bin/" + "/".join(parts[2:])
                else:  # headers and data files: nothing imports them from a --target site
                    continue
            if trim_reason(name):
                trimmed += info.file_size
                continue
            if parts[0].endswith(".dist-info") and parts[-1] == "RECORD":
                record_name = name
                continue
            mode = 0o755 if (info.external_attr >> 16) & 0o111 or name.endswith(".so") else 0o644
            files.append((name, z.read(info), mode))
    rows = [(n, "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b"=").decode(), len(d))
            for n, d, _ in files]
    record = io.StringIO()
    csv.writer(record, lineterminator="\n").writerows([*rows, (record_name, "", "")])
    files.append((record_name, record.getvalue().encode(), 0o644))
    return sorted(files), trimmed


def tar_entry(name: str, data: bytes, mode: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.uname, info.gname = len(data), mode, 0, "root", "root"
    header = info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape")
    return header + data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)


def chunks(files: list[tuple[str, bytes, int]]) -> list[bytes]:
    """Tar bytes of `files` in groups of about CHUNK uncompressed bytes (a bigger file alone)."""
    out, current = [], b""
    for name, data, mode in files:
        entry = tar_entry(name, data, mode)
        if current and len(current) + len(entry) > CHUNK:
            out.append(current)
            current = b""
        current += entry
    return [*out, current] if current else out


def compress(args: tuple[bytes, int, Path]) -> Path:
    """One xz stream of `data` (cached by its sha256 and the preset)."""
    data, preset, cache = args
    path = cache / f"{hashlib.sha256(data).hexdigest()}-{preset}.xz"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(lzma.compress(data, format=lzma.FORMAT_XZ, preset=preset))
        tmp.replace(path)
    return path


def tree_bytes() -> int:
    """Bytes of the working tree that travels with every device call: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    return sum((ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (ROOT / p).is_file())


def fit(sizes: list[int], budget: int) -> list[list[int]]:
    """Indices of `sizes` per part, each part's sum at most `budget`: as few parts as first-fit decreasing needs,
    then the chunks spread over that many parts largest first, each to the emptiest part (more room left beside
    each part), unless that overfills one."""
    if max(sizes) > budget:
        raise SystemExit(f"carry_vllm: one chunk is {max(sizes) / MiB:.1f} MiB compressed, over the part budget "
                         f"of {budget / MiB:.1f} MiB: lower --margin-mib or shrink the working tree")
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    first_fit: list[list[int]] = []
    room: list[int] = []
    for i in order:
        slot = next((k for k, r in enumerate(room) if sizes[i] <= r), None)
        if slot is None:
            first_fit.append([])
            room.append(budget)
            slot = len(room) - 1
        first_fit[slot].append(i)
        room[slot] -= sizes[i]
    spread: list[list[int]] = [[] for _ in first_fit]
    filled = [0] * len(spread)
    for i in order:
        slot = filled.index(min(filled))
        spread[slot].append(i)
        filled[slot] += sizes[i]
    return spread if max(filled) <= budget else first_fit


def budget_of(args: argparse.Namespace) -> tuple[int, int]:
    tree = tree_bytes()
    budget = int(args.part_mib * MiB) if args.part_mib else CALL_LIMIT - tree - int(args.margin_mib * MiB)
    return tree, budget


def write_parts(wheels: list[Path], parts: Path, cache: Path, budget: int, preset: int, jobs: int) -> dict:
    """Lay the wheels out as a site, drop TRIMS, compress, and write parts of at most `budget` bytes into `parts`
    (its old content removed) with their SHA256SUMS; the sizes."""
    blobs, owners, site_bytes, trimmed = [], [], 0, 0
    for wheel in wheels:
        files, cut = site_files(wheel)
        trimmed += cut
        site_bytes += sum(len(d) for _, d, _ in files)
        for blob in chunks(files):
            blobs.append(blob)
            owners.append(wheel.name.split("-")[0])
    cache.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(jobs) as pool:
        streams = list(pool.map(compress, [(b, preset, cache) for b in blobs]))
    del blobs
    end = lzma.compress(_TAR_END, format=lzma.FORMAT_XZ)
    sizes = [s.stat().st_size for s in streams]
    if parts.exists():
        shutil.rmtree(parts)
    parts.mkdir(parents=True)
    sums, rows = [], []
    for k, members in enumerate(fit(sizes, budget - len(end))):
        part = parts / f"part-{k:02d}.tar.xz"
        with open(part, "wb") as f:
            f.writelines(streams[i].read_bytes() for i in sorted(members))
            f.write(end)
        sums.append(f"{sha256_file(part)}  {part.name}\n")
        rows.append({"part": part.name, "mib": round(part.stat().st_size / MiB, 2),
                     "wheels": sorted({owners[i] for i in members})})
    (parts / "SHA256SUMS").write_text("".join(sums))
    return {"parts": rows, "total_mib": round(sum(sizes) / MiB, 1), "site_mib": round(site_bytes / MiB, 1),
            "trimmed_mib": round(trimmed / MiB, 1), "device_calls": len(rows)}


def smoke_plan(wheels: list[Path]) -> dict:
    """Without downloading or compressing: the site's size from the wheels already here, and any trim that
    matches no file (a trim gone stale with a new vLLM)."""
    site, trimmed, matched = 0, 0, set()
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                hit = [pattern for pattern, regex in zip(TRIMS, _TRIM) if regex.search(info.filename)]
                matched.update(hit)
                trimmed += info.file_size if hit else 0
                site += 0 if hit else info.file_size
    vllm_here = any(w.name.startswith("vllm-") for w in wheels)
    return {"wheels_present": len(wheels), "site_mib": round(site / MiB, 1), "trimmed_mib": round(trimmed / MiB, 1),
            "trims_unmatched": sorted(set(TRIMS) - matched) if vllm_here else None}


def pack(args: argparse.Namespace) -> dict:
    pins = read_lock(args.lock)
    tree, budget = budget_of(args)
    plan = {"pins": len(pins), "tree_mib": round(tree / MiB, 2), "part_budget_mib": round(budget / MiB, 2)}
    wheels = [args.wheels / p["wheel"] for p in pins]
    if args.smoke:
        return {**plan, "smoke": True, **smoke_plan([w for w in wheels if w.is_file()])}
    t0 = time.perf_counter()
    args.wheels.mkdir(parents=True, exist_ok=True)
    reqs = args.wheels / "requirements.txt"
    reqs.write_text("".join(f"{p['name']}=={p['version']} --hash=sha256:{p['sha256']}\n" for p in pins))
    pip_download(["--require-hashes", "-r", str(reqs)], args.wheels)
    t_download = time.perf_counter() - t0
    plan.update(write_parts(wheels, args.parts, args.cache, budget, args.preset, args.jobs))
    plan.update(download_s=round(t_download, 1), pack_s=round(time.perf_counter() - t0 - t_download, 1))
    (args.parts / "MANIFEST.json").write_text(json.dumps(plan, indent=1) + "\n")
    return plan


# --------------------------------------------------------------------------------------- the GPU machine's side


def read_sums(parts: Path) -> list[tuple[str, str]]:
    """(sha256, file name) of every part, in order."""
    sums = parts / "SHA256SUMS"
    if not sums.is_file():
        raise SystemExit(f"carry_vllm: no {sums}: carry it with the part")
    return [tuple(line.split()) for line in sums.read_text().splitlines() if line.strip()]  # type: ignore[misc]


def unpack(args: argparse.Namespace) -> dict:
    """Check and extract part `args.n` (default: every part here not yet in the site); the import check once the
    site holds them all."""
    sums = read_sums(args.parts)
    marks = args.site / ".parts"
    pack_id = hashlib.sha256((args.parts / "SHA256SUMS").read_bytes()).hexdigest()
    if (marks / "pack").is_file() and (marks / "pack").read_text() != pack_id:
        shutil.rmtree(args.site)  # parts of an older pack are here: start the site anew

    def is_in(k: int) -> bool:
        digest, name = sums[k]
        return (marks / name).is_file() and (marks / name).read_text() == digest

    if args.n is not None and not 0 <= args.n < len(sums):
        raise SystemExit(f"carry_vllm: no part {args.n}: the pack has parts 0-{len(sums) - 1}")
    todo = [args.n] if args.n is not None else [k for k in range(len(sums))
                                                   if (args.parts / sums[k][1]).is_file() and not is_in(k)]
    if not todo:
        raise SystemExit(f"carry_vllm: no part of the pack in {args.parts} that the site lacks: carry "
                         f"{args.parts}/part-NN.tar.xz with SHA256SUMS")
    marks.mkdir(parents=True, exist_ok=True)
    (marks / "pack").write_text(pack_id)
    done = []
    for k in todo:
        digest, name = sums[k]
        part = args.parts / name
        if not part.is_file():
            raise SystemExit(f"carry_vllm: {part} is not here: name it in the call's carry list")
        t0 = time.perf_counter()
        if sha256_file(part) != digest:
            raise SystemExit(f"carry_vllm: {part}: sha256 differs from SHA256SUMS (a broken copy, or a part of "
                             "another pack)")
        t_verify = time.perf_counter() - t0
        with tarfile.open(part, "r:xz") as tar:
            tar.extractall(args.site, filter="data")
        (marks / name).write_text(digest)
        done.append({"part": k, "mib": round(part.stat().st_size / MiB, 2), "sha256": "ok",
                     "verify_s": round(t_verify, 2), "extract_s": round(time.perf_counter() - t0 - t_verify, 2)})
    present = [k for k in range(len(sums)) if is_in(k)]
    result = {"unpacked": done, "site": str(args.site), "parts_in": present,
              "parts_missing": [k for k in range(len(sums)) if k not in present]}
    if not result["parts_missing"]:
        result["check"] = check(args.site)
    return result


def unmet_requirements(site: Path) -> list[str]:
    """Requires-Dist of the site's distributions that neither the site nor the interpreter's own packages meet
    (vLLM's SKIPPED requirements excepted), read on the interpreter that runs this."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    paths = [str(site), *sys.path]
    installed = {}
    for dist in md.distributions(path=paths):
        installed.setdefault(canonical(dist.metadata["Name"]), dist.version)
    unmet = []
    for dist in md.distributions(path=[str(site)]):
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            name = canonical(req.name)
            have = installed.get(name)
            if name in SKIPPED and canonical(dist.metadata["Name"]) == "vllm":
                continue
            if have is None or not req.specifier.contains(have, prereleases=True):
                unmet.append(f"{dist.metadata['Name']} needs {req}, found {have or 'none'}")
    return sorted(set(unmet))


def check(site: Path) -> dict:
    """The import check in a fresh interpreter with the site first on the path, and the unmet requirements."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(":")}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True, env=env, check=False)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return {"import_ok": proc.returncode == 0, "import_s": round(time.perf_counter() - t0, 1),
            "output_tail": lines[-12:], "unmet_requirements": unmet_requirements(site)}


# ---------------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_resolve = sub.add_parser("resolve", help="the dependency closure for the target, written to --lock")
    p_pack = sub.add_parser("pack", help="download the lock's wheels, trim, pack the parts")
    for p in (p_resolve, p_pack):
        p.add_argument("--lock", type=Path, default=LOCK)
        p.add_argument("--wheels", type=Path, default=ROOT / ".carry/vllm-wheels", help="where wheels are downloaded")
    p_pack.add_argument("--parts", type=Path, default=ROOT / ".carry/vllm", help="where the parts are written")
    p_pack.add_argument("--cache", type=Path, default=ROOT / ".carry/vllm-xz", help="compressed chunks, reused")
    p_pack.add_argument("--margin-mib", type=float, default=3.0, help="room left in each call beside tree and part")
    p_pack.add_argument("--part-mib", type=float, help="the part budget itself, instead of 64 MiB - tree - margin")
    p_pack.add_argument("--preset", type=int, default=9 | lzma.PRESET_EXTREME, help="xz preset")
    p_pack.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="compressing processes")
    add_smoke_flag(p_pack)
    p_pack.add_argument("--dry-run", dest="smoke", action="store_true", help="the same as --smoke: the plan only")
    for name, helptext in (("unpack", "check and extract one part into --site"), ("check", "the import check")):
        p = sub.add_parser(name, help=helptext)
        if name == "unpack":
            p.add_argument("n", type=int, nargs="?", help="the part's number (default: every part here)")
            p.add_argument("--parts", type=Path, default=ROOT / ".carry/vllm")
        p.add_argument("--site", type=Path, default=Path("/tmp/vsite"))
    for p in sub.choices.values():
        p.add_argument("--out", type=Path, help="also write the JSON result here")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--smoke"]:  # the smoke run of every benchmark (report.py) is the packer's plan
        argv = ["pack", *argv]
    args = parser.parse_args(argv)

    if args.command == "resolve":
        image = image_packages()
        roots = [*ROOTS, *primerl_pins(image)]
        result = resolve(roots, args.wheels, image)
        write_lock(args.lock, result, roots)
        needs, broken, accepted = image_report(result["wants"], image)
        emit({"lock": str(args.lock), "carried": len(result["carried"]), "from_image": len(needs),
              "skipped": sorted(n for n in SKIPPED if n in result["wants"]), "image_conflicts": broken,
              "accepted_conflicts": accepted}, args.out)
        return 1 if broken else 0
    if args.command == "pack":
        emit(pack(args), args.out, smoke=args.smoke)
        return 0
    if args.command == "unpack":
        result = unpack(args)
        emit(result, args.out)
        return 0 if result.get("check", {}).get("import_ok", True) else 1
    result = check(args.site)
    emit(result, args.out)
    return 0 if result["import_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
