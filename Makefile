# Every target bootstraps .venv on first use (Python 3.11+, pip).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench bench-peers vmtest vmtest-matrix chroottest realk8s wheelhouse clean

$(STAMP): pyproject.toml
	@echo "make: setting up $(VENV) (once; pip install -e '.[test]')"
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/pip install -q --disable-pip-version-check --upgrade pip
	@$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m tests.sandbox demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check imex_shared guest_agent host_agent tools tests
	$(BIN)/mypy
	$(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/python -m tests.bench

# issue 18: the manual recipe beside ours on the realk8s binaries (root); QUICK=1 is CI's size
bench-peers: $(STAMP)
	$(BIN)/python -m tests.bench.peers $(if $(QUICK),--quick)

vmtest: $(STAMP)
	$(BIN)/python -m pytest -q -m vm -p no:cacheprovider tests/vm --ignore=tests/vm/test_matrix.py \
	  $(VMTEST_ARGS)

# the guest package under Debian 11/12/13's own python3 and cloud-init, arm64 under qemu-user
chroottest: $(STAMP)
	$(BIN)/python -m pytest -q -m chroot -p no:cacheprovider tests/chroot $(CHROOTTEST_ARGS)

# dist/wheelhouse/linux-<arch>-py<ver>/ per target; PLATFORM=linux/arm64 PYTHON=3.12 picks one
wheelhouse: $(STAMP)
	$(BIN)/python -m tools.wheelhouse $(if $(PLATFORM),--platform '$(PLATFORM)') \
	  $(if $(PYTHON),--python '$(PYTHON)')

# every guest OS (install-and-converge with one peer) and the mixed arm64+amd64 ensemble;
# IMEX_VM_GUESTS=debian-12-arm64 picks guests for the smokes
vmtest-matrix: $(STAMP)
	$(BIN)/python -m pytest -q -m vm -p no:cacheprovider tests/vm/test_matrix.py $(VMTEST_ARGS)

realk8s: $(STAMP)
	$(BIN)/python -m pytest -q -m realk8s tests/realk8s

clean:
	rm -rf $(VENV) build dist *.egg-info .mypy_cache .pytest_cache .ruff_cache
