# `make run`: set up and train the example DDP flow on a 2-node local pool.
# `make test`: set up and run the test suite. Both create .venv with the pinned install.
VENV ?= .venv
PY := $(VENV)/bin/python
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: setup run test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

run: setup
	$(PY) flows/ddp_train.py

test: setup
	$(PY) -m pytest

bench: setup
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) checkpoints .pytest_cache
