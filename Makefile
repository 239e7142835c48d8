# Entry points for developers and CI. `make test` is the README's test command and works on a fresh clone.
PYTHON ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
SETUP_STAMP := $(VENV)/.setup-done
BUILD_DIR ?= build
TOOLS := PYTHONPATH=tools $(VPY) -m fused_kernels_tools

.PHONY: setup build check test bench demo

# Creates .venv if missing and installs the pinned tools; does nothing while the stamp is newer than
# requirements-dev.txt.
setup: $(SETUP_STAMP)

$(SETUP_STAMP): requirements-dev.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	touch $(SETUP_STAMP)

# All variants into build/, then the full check.
build: setup
	$(TOOLS) build --out $(BUILD_DIR)
	$(TOOLS) check $(BUILD_DIR)

check: setup
	$(TOOLS) check $(BUILD_DIR)

# On a CPU machine tests/conftest.py turns on TRITON_INTERPRET, so the Triton kernels run in the interpreter.
# pytest exits 5 when it collected no test; that is a failure here like any other non-zero status.
# Two pytest-xdist workers: under the interpreter the suite is bound by Python on one core, and CI's machine has two
# (the whole suite on a 2-core machine: 493 s in one process, 347 s on two workers). PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
test: setup
	$(VPY) -m pytest -q -n $(PYTEST_WORKERS) tests; status=$$?; \
	if [ $$status -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$status

# On a GPU machine, with its system python3 (no .venv).
bench:
	python3 benchmarks/run.py

# The README's main command, no GPU needed: build v1 and v2 (releases.toml), start the local Hub, publish both,
# load them back in a fresh process through HF_ENDPOINT and check every op against float64 references.
demo: setup
	$(TOOLS) demo
