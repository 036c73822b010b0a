# The two commands of the README: `make demo` (the paper's story on the bundled digits data) and `make test`.
PYTHON ?= python3

.PHONY: install test

# Install the requirements only when one of them is missing (a no-op on a prepared machine).
install:
	@$(PYTHON) -c "import torch, torchvision, numpy, scipy, matplotlib, sklearn, pandas, pytest" 2>/dev/null \
		|| $(PYTHON) -m pip install -r requirements.txt

test: install
	$(PYTHON) -m pytest -q tests
