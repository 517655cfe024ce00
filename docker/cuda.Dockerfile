# primerl:cuda13 and primerl:cuda12 — trainer, vLLM and orchestrator in one image: a CUDA base with cuDNN, Python
# 3.12, the environment synced from a lock with the GPU extra (vllm, flash-attn). Built for linux/amd64 and linux/arm64.
#
#   primerl image build --variant cuda [--platform linux/arm64] [--build-arg TORCH_CUDA_ARCH_LIST="9.0;10.0"]
#   primerl image build --variant cuda12      (the build arguments of the CUDA 12 stack, see below)
#   docker run --rm --gpus all -v "$PWD/runs:/opt/primerl/runs" primerl:cuda13 rl recipes/reverse-text.toml
#
# Two stacks, one Dockerfile. PROJECT is the uv project whose lock the image syncs: `.` (uv.lock: torch 2.13, CUDA
# 13, vllm 0.32, transformers 5; the defaults below) or `docker/cuda12` (its own uv.lock: torch 2.10, CUDA 12.8,
# vllm 0.19, transformers 4.57; `primerl image build --variant cuda12` passes CUDA_VERSION, PROJECT and the pins,
# from primerl.launch.images.VARIANTS). docs/containers.md says which image needs which driver.
#
# Why CUDA 13: PyPI's torch 2.13 (the version in uv.lock) is built with CUDA 13.0 and brings its CUDA libraries as
# nvidia-*-cu13 wheels; flash-attn compiles against that torch, and torch refuses an nvcc of another major version.
# The base's CUDA major therefore follows the lock (tests/test_consistency.py checks it). The host driver must support
# CUDA 13 (R580 or newer).
#
# Stages (each can be built alone with --target):
#   python      the base, Python ${PYTHON_VERSION} with headers and a compiler (flash-attn's build and the JIT
#               compilers of triton and flashinfer need them at run time too), uv, and the image's user
#   deps        the locked environment with the GPU extra except flash-attn and the workspace's own packages; the lock
#               is copied before the source, so this layer is rebuilt only when pyproject.toml or uv.lock change (it
#               syncs --frozen: the workspace members' pyproject.toml files arrive with the source, where the last
#               step syncs --locked and so checks the lock against all of them)
#   flash-attn  flash-attn compiled from its source package against the installed torch (see below)
#   runtime     the project itself (configs, recipes, environments), pins checked, the image's labels and entry point
#
# flash-attn. uv.lock holds flash-attn 2.8.3.post2 as a source package only (no-build-isolation-package: it builds
# in the environment, against the torch already installed there). Build arguments:
#   TORCH_CUDA_ARCH_LIST         GPU architectures to compile for, e.g. "9.0" (H100/H200, the default), "8.0;9.0",
#                                "10.0" (B200); passed to flash-attn as FLASH_ATTN_CUDA_ARCHS without the dots.
#                                Every extra architecture roughly doubles the build time.
#   MAX_JOBS                     parallel compiler processes; each peaks at about 8-9 GB of memory with
#                                NVCC_THREADS=4 (flash-attn's own estimate), so MAX_JOBS <= free memory / 9 GB.
#   NVCC_THREADS                 threads per nvcc process.
#   FLASH_ATTENTION_FORCE_BUILD  TRUE (default): always compile. FALSE lets flash-attn's setup.py download its
#                                prebuilt release wheel when one matches torch, CUDA, Python and the architecture;
#                                that wheel is not covered by uv.lock's hashes.
#   WHEEL_VERSION                flash-attn's setup.py imports the `wheel` package, which uv.lock does not contain;
#                                it is installed at this pinned version for the build only (`--inexact` keeps it
#                                during that sync; the last stage's exact sync removes it).
# On arm64 there is no prebuilt flash-attn wheel: it is always compiled (docs/containers.md has the time it takes).
# The compiled wheel survives a later `uv sync`: this stage keeps uv's cache in /opt/uv-cache, pruned with
# `uv cache prune --ci`, which drops downloaded wheels but keeps wheels built from source. A `uv sync --extra gpu`
# in the container (or a rebuilt environment) installs flash-attn from that cache instead of compiling it again.
# (`uv sync` without `--extra gpu` removes vllm and flash-attn, as it removes anything the extras do not ask for.)
#
# Other build arguments: BASE_IMAGE (a local image can stand in; it must provide python${PYTHON_VERSION}-dev and
# -venv through apt), CUDA_VERSION, PYTHON_VERSION, UV_VERSION; the *_VERSION pins the labels carry, which the build
# checks against the synced environment; PRIMERL_VERSION and LOCK_SHA256, filled in by `primerl image build`.

ARG CUDA_VERSION=13.0.1
ARG BASE_IMAGE=nvidia/cuda:${CUDA_VERSION}-cudnn-devel-ubuntu24.04

FROM ${BASE_IMAGE} AS python
ARG PYTHON_VERSION=3.12 \
    UV_VERSION=0.13.9
ENV PATH=/opt/venv/bin:$PATH \
    UV_PROJECT_ENVIRONMENT=/opt/venv \
    UV_PYTHON=${PYTHON_VERSION} \
    UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    UV_CACHE_DIR=/opt/uv-cache \
    PYTHONUNBUFFERED=1 \
    PRIMERL_CACHE=/home/primerl/.cache/primerl \
    PRIMERL_MODEL_DIRS=/opt/primerl/models
# The Python packages come from the base's distribution at whatever version its release carries; uv.lock pins
# everything above them.
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python${PYTHON_VERSION} python${PYTHON_VERSION}-venv python${PYTHON_VERSION}-dev \
        build-essential git ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi \
 && useradd --create-home --uid 1000 --shell /bin/bash primerl \
 && python${PYTHON_VERSION} -m venv /opt/uv \
 && /opt/uv/bin/pip install --no-cache-dir --disable-pip-version-check "uv==${UV_VERSION}" \
 && ln -s /opt/uv/bin/uv /usr/local/bin/uv \
 && install -d -o primerl -g primerl /opt/venv /opt/primerl /opt/uv-cache
USER 1000:1000
WORKDIR /opt/primerl

FROM python AS deps
ARG PROJECT=.
# The CUDA 12 project reaches primerl and the environments by path, not as workspace members: like those, they are
# installed with the source, in the last stage.
ENV UV_PROJECT=${PROJECT} \
    SOURCE_PACKAGES="primerl reverse-text alphabet-sort wordle math-sanity wiki-search"
COPY pyproject.toml uv.lock README.md ./
COPY docker/cuda12/pyproject.toml docker/cuda12/uv.lock docker/cuda12/
RUN set --; for p in ${SOURCE_PACKAGES}; do set -- "$@" --no-install-package "$p"; done \
 && uv sync --frozen --no-dev --no-install-workspace --extra gpu --no-install-package flash-attn --no-cache "$@"

FROM deps AS flash-attn
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG TORCH_CUDA_ARCH_LIST="9.0" \
    MAX_JOBS=4 \
    NVCC_THREADS=2 \
    FLASH_ATTENTION_FORCE_BUILD=TRUE \
    WHEEL_VERSION=0.45.1
RUN set --; for p in ${SOURCE_PACKAGES}; do set -- "$@" --no-install-package "$p"; done \
 && uv pip install --python /opt/venv/bin/python "wheel==${WHEEL_VERSION}" \
 && FLASH_ATTN_CUDA_ARCHS="$(printf %s "${TORCH_CUDA_ARCH_LIST}" | tr -d .)" \
    uv sync --frozen --inexact --no-dev --no-install-workspace --extra gpu "$@" \
 && uv cache prune --ci

FROM flash-attn AS runtime
ARG PYTHON_VERSION=3.12 \
    TORCH_VERSION=2.13.0 \
    TRANSFORMERS_VERSION=5.19.0 \
    VERIFIERS_VERSION=0.4.0 \
    VLLM_VERSION=0.32.0 \
    FLASH_ATTN_VERSION=2.8.3.post2 \
    PRIMERL_VERSION="" \
    LOCK_SHA256="" \
    PREPARE_MODELS="smollm2-135m-instruct tiny"
LABEL org.opencontainers.image.title="primerl" \
      org.opencontainers.image.description="primerl with vLLM and flash-attn: trainer, inference, orchestrator" \
      org.opencontainers.image.version="${PRIMERL_VERSION}" \
      io.primerl.variant="cuda" \
      io.primerl.lock-sha256="${LOCK_SHA256}" \
      io.primerl.python="${PYTHON_VERSION}" \
      io.primerl.torch="${TORCH_VERSION}" \
      io.primerl.transformers="${TRANSFORMERS_VERSION}" \
      io.primerl.verifiers="${VERIFIERS_VERSION}" \
      io.primerl.vllm="${VLLM_VERSION}" \
      io.primerl.flash-attn="${FLASH_ATTN_VERSION}"
ENTRYPOINT ["/opt/primerl/docker/entrypoint.sh"]
COPY . ./
RUN uv sync --locked --no-dev --no-editable --extra gpu \
 && python docker/check_pins.py --python "${PYTHON_VERSION}" --lock "${UV_PROJECT}/uv.lock" \
        --lock-sha256 "${LOCK_SHA256}" --write image-pins.json \
        torch="${TORCH_VERSION}" transformers="${TRANSFORMERS_VERSION}" verifiers="${VERIFIERS_VERSION}" \
        vllm="${VLLM_VERSION}" flash-attn="${FLASH_ATTN_VERSION}" ${PRIMERL_VERSION:+primerl="${PRIMERL_VERSION}"} \
 && for m in ${PREPARE_MODELS}; do primerl models prepare "$m" --into /opt/primerl/models || exit 1; done \
 && uv cache prune --ci \
 && mkdir runs
