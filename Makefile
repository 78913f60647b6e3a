# Everything a fresh machine needs: `make run` and `make test` set up the virtual environment first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch that this environment keeps on disk; the package itself accepts a range.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup run test bench bench-frameworks bench-heterogeneous bench-quality bench-compression bench-runtime bench-gpu proto clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_PIN)"
	$(BIN)/pip install --quiet -e ".[dev,jax]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/diloco run $(ARGS)

# The status page is tested in a real headless browser: Debian's Chromium.
CHROMIUM := /usr/bin/chromium

$(CHROMIUM):
	apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium

test: $(STAMP) $(CHROMIUM)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/strategies.py

bench-heterogeneous: $(STAMP)
	$(BIN)/python benchmarks/heterogeneous.py

# ~45 min on 2 cores: the simulator at 10M tokens, one process per hardware mix side by side (one
# thread each: their figures are in virtual time), then the real runs alone on a quiet machine.
QUALITY := benchmarks/results/quality
bench-quality: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/quality.py --parts sim --hardware equal --out $(QUALITY)-sim-equal $(ARGS) & \
	equal=$$!; \
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/quality.py --parts sim --hardware mixed --out $(QUALITY)-sim-mixed $(ARGS) & \
	mixed=$$!; \
	wait $$equal && wait $$mixed
	$(BIN)/python benchmarks/quality.py --parts real --out $(QUALITY)-real $(ARGS)

bench-frameworks: $(STAMP)
	$(BIN)/python benchmarks/frameworks.py

bench-compression: $(STAMP)
	$(BIN)/python benchmarks/compression.py

bench-runtime: $(STAMP)
	$(BIN)/python benchmarks/runtime.py

bench-gpu: $(STAMP)
	$(BIN)/python benchmarks/gpu.py

# Regenerate the committed protocol modules after editing src/diloco/v1/diloco.proto.
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I src --python_out=src --pyi_out=src --grpc_python_out=src \
		src/diloco/v1/diloco.proto

clean:
	rm -rf $(VENV) runs
