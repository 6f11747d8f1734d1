# The two commands of the README. Both set up what they need on a fresh machine.
#   make demo   start the embedded Slurm cluster, submit the demo, drain a node, show the migration
#   make test   every test: unit tests and end-to-end tests against the real local Slurm cluster,
#               then the Slurm matrix (below) on every other supported Slurm release
VENV := .venv
PYTEST_ARGS ?=
# The Slurm matrix: on each supported release the host does not have (its cluster runs from a
# Debian root filesystem, built once into /var/cache/trainmover/rootfs/<release>; 25.11's from
# source: $TM_SLURM_SOURCE or ../shared/vendor): the Slurm contract (nodes, drain/resume, a job
# grown, stepped on and shrunk, errors, per backend), the drain migration compared bit for bit
# with an uninterrupted run, and the SPANK plugin. The embedded cluster's own tests
# (tests/e2e/test_cluster.py: up/down, repeated grow/shrink) run on the host's release only, for
# CI's time: in the matrix they stopped and restarted each release's cluster, and what in them
# depends on the release is in the contract. On 25.11 pyslurm is built (make pyslurm), the
# contract's pyslurm cases run inside its root and the jobs' controllers use it
# (TM_SLURM_BACKEND=pyslurm).
SLURM_MATRIX_TESTS := tests/e2e/test_slurm_contract.py \
	tests/e2e/test_migration.py::test_drain_moves_the_rank_to_a_standby_bit_exactly tests/e2e/test_spank.py

# The Slurm release pyslurm is built against (PyPI's pyslurm 25.11.2 needs Slurm 25.11, which
# no Debian suite ships: its root filesystem builds it from source, see docs/admin.md).
PYSLURM_SLURM := 25.11

.PHONY: demo test unit typecheck setup slurm-matrix pyslurm cluster-down clean

$(VENV)/.installed: pyproject.toml constraints.txt scripts/setup.sh
	scripts/setup.sh

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/trainmover demo

# pytest exits 5 when it collects no test: that fails this target (and CI), as it should.
# --durations: CI's output names the slowest tests (of the end-to-end phase every test, setup or
# teardown of 15 s or more: most of its time, not only the 15 slowest), and each phase prints its seconds
# (`== type check (mypy): …s`, `== unit tests: …s`, `== end-to-end tests …: …s`, `== Slurm V: …s`,
# then the total): where CI's ~45 minutes on 2 cores go. A phase that fails still prints its time,
# then stops make. The type check comes first (~25 s on 2 cores from a cold cache): mypy as
# pyproject.toml's [tool.mypy] says, strict on the contracts.
# The unit tests run on UNIT_WORKERS processes (pytest-xdist), each test file whole on one of
# them (--dist loadfile): a file's module fixtures run once, and tests of one file that share
# a resource never overlap (plain load scheduling split files and gave errors). The
# end-to-end tests stay serial: they share one Slurm cluster.
UNIT_WORKERS ?= 2
TEST_START := $(shell date +%s)
test: $(VENV)/.installed
	@start=$$(date +%s); rc=0; \
	$(VENV)/bin/python -m mypy || rc=$$?; \
	echo "== type check (mypy): $$(( $$(date +%s) - start ))s"; exit $$rc
	@start=$$(date +%s); rc=0; \
	$(VENV)/bin/python -m pytest tests/unit -n $(UNIT_WORKERS) --dist loadfile -ra --durations=15 $(PYTEST_ARGS) || rc=$$?; \
	echo "== unit tests ($(UNIT_WORKERS) workers): $$(( $$(date +%s) - start ))s"; exit $$rc
	@start=$$(date +%s); rc=0; \
	$(VENV)/bin/python -m pytest tests/e2e -ra --durations=0 --durations-min=15 $(PYTEST_ARGS) || rc=$$?; \
	echo "== end-to-end tests (the host's Slurm): $$(( $$(date +%s) - start ))s"; exit $$rc
	@# The GPU tests in a session of their own (tests/conftest.py says why), where there is a GPU.
	@# tests/unit only (every GPU test is there): `pytest tests` stops at collection, since
	@# tests/unit and tests/e2e share module names (test_trainers.py, ...; seen in issue 36).
	@if ls /dev/nvidia[0-9]* >/dev/null 2>&1; then \
	  start=$$(date +%s); rc=0; \
	  TM_TEST_GPU=1 $(VENV)/bin/python -m pytest tests/unit -m gpu -ra $(PYTEST_ARGS) || rc=$$?; \
	  echo "== GPU tests: $$(( $$(date +%s) - start ))s"; exit $$rc; \
	else echo "make test: no GPU on this machine (/dev/nvidia*): no GPU session"; fi
	$(MAKE) --no-print-directory slurm-matrix
	@echo "== make test: $$(( $$(date +%s) - $(TEST_START) ))s in all"

# SLURM_RELEASES: the releases to run the matrix on (default: every supported one but the host's).
slurm-matrix: $(VENV)/.installed
	@set -e; releases="$${SLURM_RELEASES:-$$($(VENV)/bin/python -m trainmover.cluster releases --besides-host)}"; \
	test -n "$$releases" || { echo "slurm-matrix: no Slurm release to run" >&2; exit 1; }; \
	for v in $$releases; do \
	  start=$$(date +%s); $(VENV)/bin/python -m trainmover.cluster build --slurm $$v >/dev/null; \
	  backend=cli; if [ "$$v" = "$(PYSLURM_SLURM)" ]; then $(MAKE) --no-print-directory pyslurm; backend=pyslurm; fi; \
	  echo "== Slurm $$v: ready in $$(( $$(date +%s) - start ))s; $(SLURM_MATRIX_TESTS) (TM_SLURM_BACKEND=$$backend)"; \
	  start=$$(date +%s); \
	  TM_E2E_SLURM=$$v TM_SLURM_BACKEND=$$backend $(VENV)/bin/python -m pytest $(SLURM_MATRIX_TESTS) -ra $(PYTEST_ARGS); \
	  echo "== Slurm $$v: $$(( $$(date +%s) - start ))s"; \
	done

# pyslurm (the extra trainmover[pyslurm]) built against Slurm $(PYSLURM_SLURM)'s headers and library in
# its root filesystem (built first when missing: from source, see docs/admin.md). The library
# loads inside that root, where the cluster's jobs and their controllers run. Only the root's
# slurm/ headers are put on the include path (a directory of its own: the root's C library
# headers would clash with the host compiler's).
pyslurm: $(VENV)/.installed
	@set -e; root=$$($(VENV)/bin/python -m trainmover.cluster build --slurm $(PYSLURM_SLURM)); \
	if $(VENV)/bin/python -c 'import sys, importlib.metadata as m; sys.exit(m.version("pyslurm") != "25.11.2")' 2>/dev/null; then \
	  echo "pyslurm: pyslurm 25.11.2 already installed in $(VENV)"; \
	else start=$$(date +%s); inc=$$(mktemp -d); trap 'rm -rf "$$inc"' EXIT; \
	  ln -s "$$root/usr/include/slurm" "$$inc/slurm"; \
	  SLURM_INCLUDE_DIR=$$inc SLURM_LIB_DIR=$$root/usr/lib PYSLURM_BUILD_JOBS=2 \
	    nice -n 19 $(VENV)/bin/pip install -q --disable-pip-version-check -c constraints.txt -e ".[pyslurm]"; \
	  echo "pyslurm: pyslurm 25.11.2 built against $$root in $$(( $$(date +%s) - start ))s"; fi

unit: $(VENV)/.installed
	$(VENV)/bin/python -m pytest tests/unit -q -n $(UNIT_WORKERS) --dist loadfile

typecheck: $(VENV)/.installed
	$(VENV)/bin/python -m mypy

cluster-down:
	-$(VENV)/bin/trainmover cluster down
	-$(VENV)/bin/trainmover cluster down --dir /var/tmp/trainmover-cluster-e2e
	-$(VENV)/bin/trainmover cluster down --dir /var/tmp/trainmover-cluster-megatron
	-$(VENV)/bin/trainmover cluster down --dir /var/tmp/trainmover-cluster-wholenode
	-for v in $$($(VENV)/bin/python -m trainmover.cluster releases); do \
	  $(VENV)/bin/trainmover cluster down --slurm $$v; \
	  $(VENV)/bin/trainmover cluster down --dir /var/tmp/trainmover-cluster-e2e-$$v; \
	done

clean: cluster-down
	rm -rf $(VENV) runs slurm-*.out
