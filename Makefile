# The two commands of the README:  `make quickstart`  and  `make test`.
# Each creates .venv (Python 3.11) on first use and installs the locked CPU set into it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: quickstart test test-unit test-distributed test-slow lock clean

$(STAMP): setup.py requirements/cpu-lock.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/cpu-lock.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

quickstart: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) launch/quickstart_cpu.py

test: $(STAMP)
	$(PY) -m pytest tests -q --durations=15

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit -q

test-distributed: $(STAMP)
	$(PY) -m pytest tests/distributed -q

lock: $(STAMP)
	$(PY) -m pip freeze --exclude-editable | sed 's/^torch==\(.*\)+cpu$$/torch==\1/' > requirements/cpu-lock.txt.new
	mv requirements/cpu-lock.txt.new requirements/cpu-lock.txt

clean:
	rm -rf $(VENV) runs
