# phaselens: the CLI, the reference server, the load generator and the schema tool in one image.
#   docker build -t phaselens .                          # CPU torch wheel (default)
#   docker build --build-arg TORCH_INDEX=cu130 -t phaselens:cuda .   # CUDA wheel, for --device cuda
FROM python:3.11-slim

# Which PyTorch wheel index: `cpu`, or a CUDA build such as `cu130` (the wheel bundles the CUDA
# libraries; the host needs only the NVIDIA driver and container toolkit).
ARG TORCH_INDEX=cpu
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from the PyTorch index: a bare `torch` requirement from PyPI would pull the
# multi-GB CUDA build even for the CPU image. Its own layer, so code changes do not refetch it.
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_INDEX}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY . .
# A C compiler only for the build of the collector's decoder (collectors/_otlp_rows.c), then removed.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install . \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 phaselens

USER phaselens
WORKDIR /home/phaselens
ENTRYPOINT ["phaselens"]
CMD ["--help"]
