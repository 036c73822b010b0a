# The two commands of the README: `make demo` (the paper's story on the bundled digits data) and `make test`.
# The paper's experiments, one target each (README, "From the paper to a command"): make table3 SIGMA=0.5 DATA_DIR=..., ...
PYTHON ?= python3
SIGMA ?= 0.5
# make test runs the suite in parallel (pytest-xdist), one worker a core and at most 4 (each worker's torch
# uses one thread; more workers than that mostly add memory)
JOBS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0))))" 2>/dev/null || echo 2)

.PHONY: install test demo fuzz table2 table3 table4 table5 ecdf budget gpu-check

# Install the requirements only when one of them is missing (a no-op on a prepared machine).
install:
	@$(PYTHON) -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('torch', \
		'torchvision', 'numpy', 'scipy', 'matplotlib', 'sklearn', 'pandas', 'pytest', 'hypothesis', 'xdist')))" \
		|| $(PYTHON) -m pip install -r requirements.txt -c constraints.txt

test: install
	$(PYTHON) -m pytest -q -n $(JOBS) --dist worksteal tests

# Train, certify and analyse four small models on 8x8 digits; writes runs/demo/report.md (scripts/demo.sh).
demo: install
	PYTHON=$(PYTHON) bash scripts/demo.sh

# Paper scale, on GPUs with the data in place (scripts/lib.sh lists DATA_DIR, RUNS, GPUS, EXTRA_TRAIN, ...).
table3:
	PYTHON=$(PYTHON) bash scripts/table3.sh $(SIGMA)
table4:
	PYTHON=$(PYTHON) bash scripts/table4.sh $(SIGMA)
table5:
	PYTHON=$(PYTHON) bash scripts/table5.sh $(SIGMA)
table2:
	PYTHON=$(PYTHON) bash scripts/table2.sh $(SIGMA)
ecdf:
	PYTHON=$(PYTHON) bash scripts/ecdf.sh
budget:
	PYTHON=$(PYTHON) bash scripts/budget.sh

# On a machine with a CUDA GPU: the CUDA tests, then each speed figure against its ceiling or baseline, target met or NOT
# met, within 8 minutes (docs/speed.md; parts 4-5 read data/cifar10_small: tools/cifar_subset.py; without CUDA: one line, exit 2).
gpu-check: install
	$(PYTHON) tools/gpu_check.py

# The long campaigns: tests/test_fuzz.py (FUZZ_EXAMPLES per target, default 1000; failing examples are kept
# in .hypothesis/ and replayed first next time; prints the outcomes tried per target), and tests/test_faults.py
# stopping a certification and a training at every one of their file operations (a few minutes).
fuzz: install
	HYPOTHESIS_PROFILE=fuzz FAULT_RUNS=all $(PYTHON) -m pytest -q tests/test_fuzz.py tests/test_faults.py --hypothesis-show-statistics -p no:cacheprovider
