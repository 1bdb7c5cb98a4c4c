# voxgate on the CUDA runtime (docs/DEPLOY.md).
#   docker build -t voxgate .
#   docker run --gpus all -p 8080:8080 -v hf-cache:/home/voxgate/.cache voxgate \
#       serve --config /etc/voxgate/voxgate.toml --model openbmb/VoxCPM2
#   docker run -p 8080:8080 voxgate        # no GPU: the tiny built-in demo model (the audio is noise, not speech)
# Settings come from /etc/voxgate/voxgate.toml (deploy/voxgate.toml; mount your own over it) and flags after
# `serve`. On SIGTERM the server drains for up to its shutdown-timeout: give `docker stop` a longer --time.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# gcc and python3-dev build gateway/_opus_frames.c (Opus frames encoded with the GIL released)
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libopus0 libsndfile1 \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/voxgate
ENV PATH=/opt/voxgate/bin:$PATH
# PyPI's Linux torch wheels carry their own CUDA libraries (and Triton)
RUN pip install "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY engine engine
COPY gateway gateway
RUN pip install .

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 libopus0 libsndfile1 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 voxgate
COPY --from=build /opt/voxgate /opt/voxgate
COPY deploy/voxgate.toml /etc/voxgate/voxgate.toml
# the demo model and Hugging Face downloads are cached under the user's home (mount a volume there to keep them)
ENV PATH=/opt/voxgate/bin:$PATH \
    HF_HOME=/home/voxgate/.cache/huggingface \
    PYTHONUNBUFFERED=1
USER 10001
WORKDIR /home/voxgate
EXPOSE 8080
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]
ENTRYPOINT ["voxgate"]
CMD ["serve", "--config", "/etc/voxgate/voxgate.toml"]
