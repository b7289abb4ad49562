# The two commands of the README:  `make quickstart`  and  `make test`.
# Each creates .venv (Python 3.11) on first use and installs the locked CPU set into it, then
# byte-compiles it once (both cores, ~60 s). Compiling is not left to first import: where the
# environment sets PYTHONDONTWRITEBYTECODE (this box and CI do), nothing is ever cached and every
# process recompiles torch, Megatron and transformers from source — ~5 s per process, and the suite
# starts hundreds (torchrun workers, engines, launchers): measured 2026-12-01, the suite ran >2× slower.
# For the same reason the recipes unexport that variable: the project's own modules get cached too.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
unexport PYTHONDONTWRITEBYTECODE

.PHONY: quickstart test test-unit test-distributed test-sglang test-compat test-cluster lock clean

$(STAMP): setup.py requirements/cpu-lock.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -r requirements/cpu-lock.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m compileall -q -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') > /dev/null || true  # a few vendored files are not Python 3 (compileall exits 1); the rest are compiled
	touch $(STAMP)

quickstart: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) launch/quickstart_cpu.py

# Two phases: two pytest workers, each taking whole files (a module's fixture is built once), then the
# tests marked `serial` alone (they read /dev/shm, or were calibrated on an idle box). One worker left
# a third of both cores idle (its subprocesses wait on each other, on HTTP, on startup), 2026-12-02.
# Both phases always run; the recipe fails if either did.
TEST_ARGS := tests -q --ignore=tests/compat --ignore=tests/cluster
test: $(STAMP)
	status=0; \
	$(PY) -m pytest $(TEST_ARGS) -n 2 --dist loadfile -m "not serial" --durations=40 || status=$$?; \
	$(PY) -m pytest $(TEST_ARGS) -m serial --durations=5 || { s=$$?; [ $$status -ne 0 ] || status=$$s; }; \
	exit $$status

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit -q

test-distributed: $(STAMP)
	$(PY) -m pytest tests/distributed -q

# Slow tier (CI runs it after `make test`): the contract suite against real SGLang 0.5.23 on CPU,
# installed once into .cache/sglang-venv (~5 min, ~3 GB) by tools/sglang_cpu/install.sh.
test-sglang: $(STAMP)
	bash tools/sglang_cpu/install.sh
	MF_CONTRACT_BACKENDS=sglang $(PY) -m pytest tests/contract -q --durations=10

# Compat tier (CI runs it after `make test`): the product on the newest megatron-core (or
# MCORE_VERSION=X), installed by tools/compat/install.sh into .cache/compat/megatron-core-X/ in front
# of the locked set. Parity, the quickstart, a checkpoint resume and weight sync (tests/compat), plus
# the unit tests of the version checks. ≤ 5 min on the 2-core box.
MCORE_VERSION ?= $(shell sed -n 's/^megatron-core==//p' requirements/compat-newest.txt)
COMPAT_PY := .cache/compat/megatron-core-$(MCORE_VERSION)/bin/python
test-compat: $(STAMP)
	bash tools/compat/install.sh $(MCORE_VERSION)
	MF_COMPAT_MCORE=$(MCORE_VERSION) $(COMPAT_PY) -m pytest tests/compat tests/unit/test_megatron_compat.py \
		tests/unit/test_rope.py tests/unit/test_versions.py -q --durations=10

# Cluster tier (root): a real Slurm cluster of three network-namespace hosts on this machine
# (tools/cluster), the three sbatch templates on it, preemption with requeue, lost engine hosts.
# tools/cluster/install.sh apt-installs slurmctld, slurmd, slurm-client and munge when missing.
test-cluster: $(STAMP)
	bash tools/cluster/install.sh
	MF_CLUSTER_TESTS=1 $(PY) -m pytest tests/cluster -q -s --durations=10

lock: $(STAMP)
	$(PY) -m pip freeze --exclude-editable | sed 's/^torch==\(.*\)+cpu$$/torch==\1/' > requirements/cpu-lock.txt.new
	mv requirements/cpu-lock.txt.new requirements/cpu-lock.txt

clean:
	rm -rf $(VENV) runs
