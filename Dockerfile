# shardserve on NVIDIA GPUs: torch's CUDA wheel, then shardserve with the extras a GPU server needs,
# as `make install-gpu` installs them (tests/launch/test_install_gpu.py keeps the two in step).
#   docker build -t shardserve .
#   docker run --gpus all --ipc=host -p 8000:8000 -v ~/.cache/huggingface:/home/shardserve/.cache/huggingface \
#     shardserve launch --model Qwen/Qwen3-8B --host 0.0.0.0
# The server listens on 127.0.0.1 unless --host says otherwise: in a container, pass --host 0.0.0.0.
# --ipc=host: NCCL and the ranks keep buffers in /dev/shm (Docker's default is 64 MiB).
# For a cluster, tag it where the cluster pulls from and push it; `shardserve deploy --image` names that tag:
#   docker build -t registry.example.com/shardserve:0.1.0 . && docker push registry.example.com/shardserve:0.1.0

# The base image's CUDA is TORCH_INDEX's (cu130: CUDA 13.0; the host needs driver 580 or later).
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04
ARG PYTHON_VERSION=3.11

# The wheel, built from the source as `pip wheel` builds it anywhere (tests/launch/test_installed_package.py
# installs the same wheel and serves from it); the image holds the installed wheel, not the source.
FROM python:${PYTHON_VERSION}-slim AS wheel
COPY . /src
RUN pip wheel --no-deps --wheel-dir /wheels /src

FROM ${CUDA_IMAGE}

ARG PYTHON_VERSION
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ARG EXTRAS=gpu,ray

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/shardserve \
    PATH=/opt/shardserve/bin:$PATH

# NOTE: Ubuntu 24.04 ships Python 3.12; 3.11 comes from the deadsnakes archive. gcc and the Python
# headers stay: Triton compiles its kernel launcher with them the first time a kernel runs.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates gpg-agent software-properties-common \
 && add-apt-repository -y ppa:deadsnakes/ppa \
 && apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
    python${PYTHON_VERSION} python${PYTHON_VERSION}-dev python${PYTHON_VERSION}-venv \
 && apt-get purge -y --auto-remove software-properties-common gpg-agent \
 && rm -rf /var/lib/apt/lists/*

RUN python${PYTHON_VERSION} -m venv ${VIRTUAL_ENV} \
 && pip install --upgrade pip \
 && pip install "${TORCH_SPEC}" --index-url ${TORCH_INDEX}

COPY --from=wheel /wheels /opt/wheels
RUN pip install "$(echo /opt/wheels/shardserve-*.whl)[${EXTRAS}]"

RUN useradd --create-home --shell /bin/bash shardserve
USER shardserve
WORKDIR /home/shardserve

EXPOSE 8000
ENTRYPOINT ["shardserve"]
CMD ["launch", "--help"]
