# Quick start: `make demo` runs the demo, `make test` runs the suite. Each sets itself up first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hf_paged-installed

.PHONY: demo test bench setup clean

$(STAMP): pyproject.toml scripts/bootstrap.sh
	VENV=$(VENV) bash scripts/bootstrap.sh
	@touch $@

setup: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# One pytest-xdist worker per core, each test file on one worker (its module fixtures load once).
test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadfile

bench: $(STAMP)
	$(PY) benchmarks/generate_bench.py

clean:
	rm -rf $(VENV) .pytest_cache
