# The two commands of the README. Both set up what they need on a fresh machine.
#   make demo   start the embedded Slurm cluster, submit the demo, drain a node, show the migration
#   make test   every test: unit tests and end-to-end tests against the real local Slurm cluster
VENV := .venv
PYTEST_ARGS ?=

.PHONY: demo test unit setup cluster-down clean

$(VENV)/.installed: pyproject.toml constraints.txt scripts/setup.sh
	scripts/setup.sh

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/trainmover demo

# pytest exits 5 when it collects no test: that fails this target (and CI), as it should.
test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest tests -ra $(PYTEST_ARGS)

unit: $(VENV)/.installed
	$(VENV)/bin/python -m pytest tests/unit -q

cluster-down:
	-$(VENV)/bin/trainmover cluster down
	-$(VENV)/bin/trainmover cluster down --dir /var/tmp/trainmover-cluster-e2e
	-$(VENV)/bin/trainmover cluster down --dir /var/tmp/trainmover-cluster-megatron

clean: cluster-down
	rm -rf $(VENV) runs slurm-*.out
