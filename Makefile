# Two commands do everything on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test check unit test-gpu install bench results clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch pinned in the same command as everything that depends on it (CPU wheel on disk).
	$(VENV)/bin/pip install -q torch==2.13.0 -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/fedsplice run --out runs/demo --overwrite

# every tier but gpu (tests/conftest.py), every benchmark's --quick mode included, with the 25 slowest tests listed
test: $(VENV)/.installed
	$(PY) -m pytest -q --durations=25

# before pushing, in minutes: lint, types (src/, benchmarks/, scripts/: pyproject's [tool.mypy]), the unit tier
check: $(VENV)/.installed
	$(VENV)/bin/ruff check --no-cache src tests benchmarks scripts
	$(VENV)/bin/mypy --no-incremental
	$(PY) -m pytest -q -m unit -n auto --durations=10

unit: $(VENV)/.installed
	$(PY) -m pytest -q -m unit --durations=15

# CUDA parity tests (tests/test_gpu.py) on a machine with a CUDA GPU and a CUDA build of torch
test-gpu: $(VENV)/.installed
	FEDSPLICE_TEST_GPU=1 $(PY) -m pytest -q -m gpu

# Quick versions of the benchmarks (tables in benchmarks/results/*-quick.*); the full ones are
# `python benchmarks/<name>.py` without --quick. Ray (Flower's simulation engine) comes with the test extras.
bench: $(VENV)/.installed
	for b in overheads comm scale round_time clip_prefix precision bf16_width unpad utilisation profile_run candidates purify_ties isa_kernels startup privacy secagg table_iv; do $(PY) benchmarks/$$b.py --quick || exit 1; done

# The papers' tables on the offline zoo (configs/results/suite.toml and its seeds; SEEDS=N forces
# N seeds in every group) -> docs/results.md + docs/results/; resumable (runs/results). Every
# finished run's small files go to docs/results/records (committed) and come back from there, so a
# fresh clone rebuilds the page without running what is recorded; a recorded run is reused only
# while its config and the regression goldens are unchanged (fedsplice.study.provenance). The HTML rendering of the page is checked with a headless-Chromium
# screenshot (docs/results/report.png).
SEEDS ?=
results: $(VENV)/.installed
	$(VENV)/bin/fedsplice results configs/results/suite.toml $(if $(SEEDS),--seeds $(SEEDS)) --out runs/results --doc docs/results.md \
		--records docs/results/records \
		--command "make results$(if $(SEEDS), SEEDS=$(SEEDS))"
	command -v chromium >/dev/null || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)
	$(VENV)/bin/fedsplice report docs/results.md --out runs/results/report.html --screenshot docs/results/report.png

clean:
	rm -rf $(VENV) runs
