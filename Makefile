# Two commands do everything on a fresh Debian/Ubuntu machine:
#   make run    set up (venv, requirements, offline FashionMNIST) and train single_gpu.py
#   make test   set up and check it works: every chapter through its launcher, and the fast tests (minutes)
#   make test-all    the whole proof: every test, SLURM and two machines included, then make test's set on the
#                    oldest torch requirements.txt allows (make test-floor; what CI runs)
#   make mutations   plant each known bug in a copy of the project and check its tests turn red (tests/bugs/planted.py)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DATA_PKG := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup data tools run test test-all test-floor mutations clean

setup: $(VENV)/.installed data

# torchft (chapter 12) where the venv's torch can run it (2.7 or later); elsewhere ddp_ft.py says what to install.
TORCH_2_7 = $(PY) -c 'import sys, torch; sys.exit(torch.torch_version.TorchVersion(torch.__version__) < (2, 7))'

$(VENV)/.installed: requirements.txt requirements-dev.txt requirements-ft.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	! $(TORCH_2_7) || $(PY) -m pip install -q -r requirements-ft.txt || echo "note: could not install torchft; ddp_ft.py will say how"
	touch $@

# Debian's dataset-fashion-mnist package holds the real files, so no internet is needed: unpacked into ./data, where
# torchvision's FashionMNIST reads them. Without apt-get, the scripts' first run downloads them there.
data: $(VENV)/.installed
	@if [ -f $(DATA_PKG) ]; then :; \
	elif command -v apt-get >/dev/null; then \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends dataset-fashion-mnist) \
		|| echo "note: could not install dataset-fashion-mnist; the scripts will download FashionMNIST"; \
	else echo "note: no apt-get; the scripts will download FashionMNIST"; fi
	@[ ! -f $(DATA_PKG) ] || $(PY) -m common.data

# The two-machine tests build network namespaces with iproute2's `ip`; --compile on the CPU builds its kernels with
# g++ and Python's headers; the SLURM tests install SLURM themselves.
PY_HEADER = $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h
tools:
	@command -v ip >/dev/null || ! command -v apt-get >/dev/null || \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends iproute2) || \
		echo "note: could not install iproute2; the two-machine tests will say why they cannot run"
	@(command -v g++ >/dev/null && [ -f $(PY_HEADER) ]) || ! command -v apt-get >/dev/null || \
		($(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends g++ python3-dev) || \
		echo "note: could not install g++ and python3-dev; --compile on the CPU will say it needs a compiler"

run: setup
	$(PY) single_gpu.py

test: setup tools
	$(PY) -m pytest -q -m quick

test-all: setup tools
	$(PY) -m pytest -q -n 2 --dist loadgroup
	$(MAKE) test-floor

# The floor of requirements.txt's range (torch>=2.6 and torchvision>=0.21 become torch==2.6.* and torchvision==0.21.*)
# in a venv of its own: `make test`'s quick set must pass there too, each chapter training or refusing in one line.
FLOOR_VENV ?= .venv-floor
FLOOR := $(shell sed -n 's/^\(torch\|torchvision\)>=\([0-9.]*\).*/"\1==\2.*"/p' requirements.txt)

$(FLOOR_VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q $(FLOOR) -r requirements-dev.txt
	touch $@

test-floor: $(FLOOR_VENV)/.installed data tools
	$(FLOOR_VENV)/bin/python -c 'import torch, torchvision; print("the floor: torch", torch.__version__, "torchvision", torchvision.__version__)'
	$(FLOOR_VENV)/bin/python -m pytest -q -m quick -n 2 --dist loadgroup

mutations: setup tools
	$(PY) tests/bugs/planted.py

clean:
	rm -rf runs .pytest_cache
