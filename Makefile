PYTHON ?= .venv/bin/python

.PHONY: bench

# every bench/*_bench.py at reduced sizes -> bench/RESULTS.md (~10 min on 2 cores)
bench:
	$(PYTHON) bench/run_all.py
