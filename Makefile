# `make run`: set up and train the example DDP flow on a 2-node local pool.
# `make test`: set up and run the test suite. Both create .venv with the pinned install.
VENV ?= .venv
PY := $(VENV)/bin/python
export PREFECT_SERVER_ANALYTICS_ENABLED := false
# With no PREFECT_API_URL, Prefect starts a server of its own for the run and gives it 20 s. With a
# fresh HOME it first creates and migrates its database: on a slow 2-core machine that took longer,
# and `make run` failed before the flow began. Yours, if set, wins (`skytasks run` sets the same).
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 90

.PHONY: setup system-deps run test test-prefect-floor bench clean

setup: $(VENV)/.installed

# The ssh tests start a real OpenSSH server on loopback, and the multi-host tests put one in
# each of two network namespaces (iproute2); the slurm tests start munged, slurmctld and a slurmd
# per namespace (Debian's SLURM 22.05); tests/test_prefect_ui_form.py looks at Prefect's UI in headless
# Chromium. Root, as on the dev and CI machines.
system-deps:
	@(test -x /usr/sbin/sshd && command -v ip && test -x /usr/sbin/slurmctld && test -x /usr/sbin/slurmd && \
		command -v sbatch && test -x /usr/sbin/munged && command -v chromium) >/dev/null || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssh-server iproute2 \
		slurmctld slurmd slurm-client munge chromium >/dev/null)
	@# The k8s tests run a real Kubernetes v1.20.2 (tests/harness/k8s/): its packages, and its
	@# binaries built from Debian's source once per machine (about 5 min; cached in ~/.cache/skytasks).
	@sh scripts/k8s/build.sh

# uv installs what pip would, in seconds: on a fresh 2-core machine 32 s where pip took 2 min 47 s,
# most of CI's set-up. It reads no pip configuration, so it is handed pip's own find-links: the
# folder where this machine keeps its CPU build of torch (without it, a multi-GB CUDA build).
# --compile-bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is set (it is on this machine)
# nothing is cached later, and every process, each rank included, would compile Prefect and torch
# from source at each import (measured: the suite 3 min slower).
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell python3 -m pip config get global.find-links 2>/dev/null))
UV := $(VENV)/bin/uv
UV_INSTALL := $(UV) pip install --python $(PY) -q --compile-bytecode $(if $(FIND_LINKS),--find-links $(FIND_LINKS))

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q uv
	$(UV_INSTALL) -c constraints.txt -e '.[dev]'
	@# The lowest cloudpickle pyproject.toml allows, beside the newest: tests/test_user_frames.py
	@# runs a user's script on each (PYTHONPATH puts this one first).
	$(UV_INSTALL) --no-deps --target $(VENV)/cloudpickle-lowest "cloudpickle==$$(sed -n 's/.*"cloudpickle>=\([0-9.]*\)".*/\1/p' pyproject.toml)"
	@# A cloudpickle of another major version, for the test that a node with it is refused by name.
	$(UV_INSTALL) --no-deps --target $(VENV)/cloudpickle-2 "cloudpickle==2.2.1"
	touch $@

# The Prefect-facing tests again on the oldest Prefect that pyproject.toml allows, in a second
# environment: that Prefect with the libraries of its day (uv's --exclude-newer; Prefect 3.4.0's own
# server fails on today's FastAPI, as a team on 3.4 never sees), torch excepted (the CPU build here).
PREFECT_FLOOR = $(shell sed -n 's/.*"prefect>=\([0-9.]*\),.*/\1/p' pyproject.toml)
PREFECT_FLOOR_DAY ?= 2025-06-01
FLOOR_VENV := $(VENV)/prefect-floor
PREFECT_FACING_TESTS := tests/test_prefect_internals.py tests/test_prefect_native.py tests/test_rank_runs.py \
	tests/test_cli_record.py tests/test_deployment.py tests/test_block_form.py tests/test_block_migration.py \
	tests/test_example_flow.py::test_example_flow_takes_a_saved_pool_as_a_block_parameter

$(FLOOR_VENV)/.installed: $(VENV)/.installed
	rm -rf $(FLOOR_VENV)
	$(UV) venv -q --python $(PY) $(FLOOR_VENV)
	grep -v -E '^(prefect|fastapi)==' constraints.txt > $(FLOOR_VENV)/constraints.txt
	$(UV) pip install --python $(FLOOR_VENV)/bin/python -q --compile-bytecode $(if $(FIND_LINKS),--find-links $(FIND_LINKS)) \
		--exclude-newer $(PREFECT_FLOOR_DAY) --exclude-newer-package torch=2100-01-01 -c $(FLOOR_VENV)/constraints.txt \
		"prefect==$(PREFECT_FLOOR)" -e . pytest pytest-timeout psutil
	touch $@

test-prefect-floor: $(FLOOR_VENV)/.installed system-deps
	$(FLOOR_VENV)/bin/python -m pytest -q $(PREFECT_FACING_TESTS)

run: setup
	$(PY) flows/ddp_train.py

# The suite runs in TEST_WORKERS pytest-xdist workers, and beside them the checks (ruff, mypy) and the
# Prefect floor tier (its environment built first): most tests wait on processes, not on the CPUs.
# What ran beside is printed when the suite ends. tests/conftest.py keeps each test cluster to one
# worker and each module's tests together, and gives every session a cgroup of its own, so that a
# leak check sees only what its own session started.
# Three: on a 2-core machine a clean clone's `.ci/run` took 18.8 min with 3 (the groups handed out
# longest first; 29 with 2, 45 in one process). With 4 it took 16.6, but two runs each had a
# different test fail under the load (each since made robust): not yet the default. Tests whose
# pools end after seconds of silence give them 15 s or more, and tests wait for what they assert.
TEST_WORKERS ?= 3

test: setup system-deps
	@logs=$$(mktemp -d); \
	( $(VENV)/bin/ruff check skytasks blocks && $(VENV)/bin/mypy ) >$$logs/checks 2>&1 & checks=$$!; \
	( $(MAKE) -s $(FLOOR_VENV)/.installed && \
	  $(FLOOR_VENV)/bin/python -m pytest -q -p no:cacheprovider $(PREFECT_FACING_TESTS) ) >$$logs/floor 2>&1 & floor=$$!; \
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup; main=$$?; \
	wait $$checks; lint=$$?; wait $$floor; low=$$?; \
	$(PY) -m tests.harness.session_scope || true; \
	echo "== ruff and mypy =="; cat $$logs/checks; \
	echo "== the Prefect-facing tests on Prefect $(PREFECT_FLOOR) (make test-prefect-floor) =="; cat $$logs/floor; \
	rm -rf $$logs; test $$main = 0 && test $$lint = 0 && test $$low = 0

bench: setup
	$(UV_INSTALL) "matplotlib>=3.8"  # docs/scale.png; not needed by the tests
	$(PY) -m benchmarks.run  # from the repository root: benchmarks/ imports tests.harness

clean:
	rm -rf $(VENV) checkpoints .pytest_cache
