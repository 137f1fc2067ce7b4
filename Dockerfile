# One image for every redserve tier: engine, coordinator, API, batch worker (the command picks the role;
# see docker-compose.yml). Models are not baked in: mount them (the compose file mounts /models).
#
#   docker build -t redserve .                                   torch from PyPI (CUDA wheels on x86-64 Linux)
#   docker build -t redserve --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .   CPU only
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"

WORKDIR /opt/redserve
COPY pyproject.toml README.md ./
COPY api ./api
COPY broker ./broker
COPY common ./common
COPY engine ./engine
COPY worker ./worker
COPY redserve ./redserve
RUN pip install ".[gguf]" && useradd --create-home --uid 1000 redserve

USER redserve
WORKDIR /home/redserve
EXPOSE 8000
CMD ["redserve", "--help"]
