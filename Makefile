# Every target bootstraps .venv on first use (Python 3.11+, pip).
# Debian's python3 when it is 3.11+ with venv support: the interpreter the host agent image
# and the guests run, built with PGO and LTO. This machine kind's python3 on PATH is a pyenv
# build without them, which costs the tests and benchmarks ~30 % more CPU (docs/benchmarks.md).
PY ?= $(shell /usr/bin/python3 -c 'import sys, ensurepip; sys.exit(sys.version_info < (3, 11))' \
	2>/dev/null && echo /usr/bin/python3 || echo python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test fuzz lint bench bench-peers vmtest vmtest-matrix chroottest realk8s realnode \
	wheelhouse image stress-check clean soak soak-ci soak-realk8s

# constraints.txt pins every test and lint dependency (bumped in commits of their own)
$(STAMP): pyproject.toml constraints.txt
	@echo "make: setting up $(VENV) with $(PY) (once; pip install -c constraints.txt -e '.[test]')"
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt --upgrade pip
	@$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
	@touch $(STAMP)

# Each test tier's selection is tests/tiers.py's (one definition for make and CI).

# DEMO_ARGS="--keep --vms 6" (python -m tests.sandbox demo --help lists them)
demo: $(STAMP)
	$(BIN)/python -m tests.sandbox demo $(DEMO_ARGS)

test: $(STAMP)
	$(BIN)/python -m tests.tiers run test $(TEST_ARGS)

# issue 30: every fuzz property and API operation at 500 examples (CI: 50, in make test)
fuzz: $(STAMP)
	$(BIN)/python -m tests.tiers run fuzz $(FUZZ_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check imex_shared guest_agent host_agent tools tests
	$(BIN)/mypy
	$(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/python -m tests.bench

# issue 18: the manual recipe beside ours on the realk8s binaries (root); QUICK=1 is CI's size
bench-peers: $(STAMP)
	$(BIN)/python -m tests.bench.peers $(if $(QUICK),--quick)

# issue 30: SOAK_ARGS e.g. --duration 600 --seed 7 --vms 6 (default 1 h, 18 VMs; root)
soak: $(STAMP)
	$(BIN)/python -m tests.soak $(SOAK_ARGS)

# the soak on the real kube-apiserver and etcd, which it kills (tests/soak/realk8s.py)
soak-realk8s: $(STAMP)
	$(BIN)/python -m tests.soak.realk8s $(SOAK_ARGS)

soak-ci: $(STAMP)
	$(BIN)/python -m tests.tiers run soak-ci

vmtest: $(STAMP)
	$(BIN)/python -m tests.tiers run vmtest $(VMTEST_ARGS)

# the guest package under Debian 11/12/13's own python3 and cloud-init, arm64 under qemu-user
chroottest: $(STAMP)
	$(BIN)/python -m tests.tiers run chroottest $(CHROOTTEST_ARGS)

# dist/wheelhouse/linux-<arch>-py<ver>/ per target; PLATFORM=linux/arm64 PYTHON=3.12 picks one
wheelhouse: $(STAMP)
	$(BIN)/python -m tools.wheelhouse $(if $(PLATFORM),--platform '$(PLATFORM)') \
	  $(if $(PYTHON),--python '$(PYTHON)')

# the host agent image, localhost/imex-host-agent:<version>, built offline on a Debian base
# made here (docs/install.md step 1); PLATFORM=linux/arm64 builds <version>-arm64 under
# qemu-user and runs its --version; PYTHON_IMAGE=<a python image> builds on that instead
image: $(STAMP)
	$(BIN)/python -m tools.image $(if $(PLATFORM),--platform '$(PLATFORM)') \
	  $(if $(PYTHON_IMAGE),--python-image '$(PYTHON_IMAGE)')

# every guest OS (install-and-converge with one peer) and the mixed arm64+amd64 ensemble;
# IMEX_VM_GUESTS=debian-12-arm64 picks guests for the smokes
vmtest-matrix: $(STAMP)
	$(BIN)/python -m tests.tiers run vmtest-matrix $(VMTEST_ARGS)

realk8s: $(STAMP)
	$(BIN)/python -m tests.tiers run realk8s $(REALK8S_ARGS)

# issue 29: the docs' shell blocks pasted in order on the realk8s control plane
.PHONY: docs-test
docs-test: $(STAMP)
	$(BIN)/python -m tests.tiers run docs-test $(DOCS_TEST_ARGS)

# issue 25: the base Deployment on a real node (root; builds kubelet, containerd, runc on
# first use; needs `make image`); not in CI. tests/realk8s/README.md "A real node"
realnode: $(STAMP)
	$(BIN)/python -m tests.tiers run realnode $(REALNODE_ARGS)

# tests/README.md "Under load": the tiers again beside stress-ng (Debian's), results kept
stress-check: $(STAMP)
	$(BIN)/python -m tests.stress_check $(STRESS_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .mypy_cache .pytest_cache .ruff_cache
