# One image for every redserve tier: engine, coordinator, API, batch worker (the command picks the role;
# see docker-compose.yml). Models are not baked in: mount them (the compose file mounts /models).
#
#   docker build -t redserve .                                   torch from PyPI (CUDA wheels on x86-64 Linux)
#   docker build -t redserve --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .   CPU only
#
# The C++ CPU kernels (worker/kernels, -march=native) are not built here: code for the build host's CPU can
# crash (SIGILL) on another x86-64 CPU that runs the image. The image ships g++ instead, and an engine on
# the CPU builds them at its first start (before it reports READY; a few minutes) into
# REDSERVE_KERNEL_CACHE_DIR, a volume in docker-compose.yml, so later starts load them at once. The cache
# key holds the CPU's flags (worker/kernels/build.py): a cache shared by two kinds of CPU keeps one build
# per kind and never loads the other's. Chosen over run-time dispatch because the kernels choose their SIMD
# paths at compile time (`#if __AVX2__ && __FMA__`) and the compiler vectorises the rest for -march=native:
# dispatch would mean several builds of each kernel and a chooser; built on the very CPU, they get its best
# code unchanged. The price: g++ (some 370 MB of the image) and minutes of compiling at the first start.
FROM python:3.11-slim

RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    REDSERVE_KERNEL_CACHE_DIR=/var/cache/redserve/kernels \
    REDSERVE_CACHE_DIR=/var/cache/redserve/models

RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"

WORKDIR /opt/redserve
COPY pyproject.toml README.md ./
COPY api ./api
COPY broker ./broker
COPY common ./common
COPY coordinator ./coordinator
COPY engine ./engine
COPY protocol ./protocol
COPY worker ./worker
COPY redserve ./redserve
RUN pip install ".[gguf]" && useradd --create-home --uid 1000 redserve \
    && mkdir -p "$REDSERVE_KERNEL_CACHE_DIR" "$REDSERVE_CACHE_DIR" \
    && chown redserve "$REDSERVE_KERNEL_CACHE_DIR" "$REDSERVE_CACHE_DIR"

USER redserve
WORKDIR /home/redserve
EXPOSE 8000
CMD ["redserve", "--help"]
