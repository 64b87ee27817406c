# The two commands: `make run` (TUI on the built-in demo model) and `make test`.
# Both create .venv when it is missing. A torch that is already installed in the system Python
# (for example a ROCm build) is reused through --system-site-packages; otherwise TORCH_SPEC is installed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
export HF_HUB_OFFLINE := 1

.PHONY: run test test-all venv clean bench format

$(VENV)/.installed: pyproject.toml setup.py $(wildcard kernels/cpu/csrc/*.cpp kernels/cpu/csrc/*.h)
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "reusing the system torch: $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV); \
		$(PY) -m pip install -q --upgrade pip; \
		$(PY) -m pip install -q "$(TORCH_SPEC)"; \
	fi
	$(PY) -m pip install -q "setuptools>=68" wheel "ninja>=1.11"
	# --no-build-isolation: the C++ CPU kernels compile here, against this venv's torch (2-3 min on 2 cores),
	# the variant this CPU runs only (a wheel, `pip wheel .`, carries every variant); without a compiler the
	# install still succeeds and the PyTorch paths run
	KIMITUI_BUILD_CPU_KERNELS=this $(PY) -m pip install -q --no-build-isolation -e ".[test]"
	$(PY) -m kimitui.kernels.cpu.few_rows
	$(PY) -m kimitui.kernels.cpu.quant_moe
	touch $@

venv: $(VENV)/.installed

run: venv
	$(PY) -m kimitui.cli $(ARGS)

# Test files run on TEST_WORKERS processes (pytest-xdist, whole files per worker so module
# fixtures are built once): most tests wait on servers, subprocesses and small kernels rather than
# filling a core, so two workers finish well ahead of one even on two cores. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

# ruff first: formatting and import order (pyproject.toml [tool.ruff]); `make format` fixes both
test: venv
	$(PY) -m ruff format --check --quiet . && $(PY) -m ruff check --quiet .
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

format: venv
	$(PY) -m ruff format --quiet . && $(PY) -m ruff check --quiet --fix .

test-all: venv
	$(PY) -m pytest -q -m "" $(XDIST) $(PYTEST_ARGS)

bench: venv
	$(PY) benchmarks/cpu_vs_transformers.py

clean:
	rm -rf $(VENV) build *.egg-info
