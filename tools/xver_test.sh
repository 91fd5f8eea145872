#!/usr/bin/env bash
# Cross-version test of the stable-ABI wheel (make xver-test, run by .ci/run):
# the wheel that `make wheel` built against torch $BUILD_TORCH (.venv) is
# installed with --no-deps into a second environment holding another torch
# release ($XVER_TORCH_SPEC, default the CUDA build of torch 2.14.1, which runs
# on a CPU machine), and the TTLinear, TTEmbedding and gate-step correctness
# tests run there on the CPU, from outside the source tree, with no compiler
# reachable (CC, CXX and nvcc point at a stub that fails).  The torch.compile
# tests are left out: inductor generates and compiles C++ for the CPU, which
# is exactly what this test forbids (they run in make test).
#
# Where the wheel holds the CUDA kernels (comera._C_cuda, `make wheel` with
# nvcc): they must hold machine code for $XVER_CUDA_ARCHS (default sm_80
# sm_90 sm_100; tools/cuda_archs.sh), load into the CUDA build of torch
# there (no GPU needed) and register a CUDA kernel for every tensor operator;
# and under the CPU-only torch the wheel was built with (.venv, $BUILD_PY)
# the wheel must import without loading them and without a warning.
#
# The second environment is cached outside the repository
# ($COMERA_XVER_ENV, default $HOME/.cache/comera/venv-<torch spec>): the first
# run on a machine builds it (torch 2.14.1 is about 5.5 GB; a few minutes),
# later runs reuse it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
spec="${XVER_TORCH_SPEC:-torch==2.14.1}"
name="$(printf '%s' "$spec" | sed 's/==*/-/; s/[^A-Za-z0-9.-]/-/g')"  # torch-2.14.1
env_dir="${COMERA_XVER_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/comera/venv-$name}"
py="${PY:-python3}"

wheel="$(ls -t dist/comera-*.whl 2>/dev/null | head -n 1 || true)"
[ -n "$wheel" ] || { echo "xver: no wheel in dist/ (make wheel)"; exit 1; }

# the cached environment: created once, complete when its stamp exists
stamp="$env_dir/.comera-xver-ready"
if [ ! -f "$stamp" ]; then
    echo "xver: creating $env_dir with $spec (once per machine)"
    rm -rf "$env_dir"
    mkdir -p "$(dirname "$env_dir")"
    "$py" -m venv "$env_dir"
    "$env_dir/bin/python" -m pip install -q --upgrade pip
    "$env_dir/bin/python" -m pip install -q "$spec" pytest hypothesis numpy
    touch "$stamp"
else
    echo "xver: reusing $env_dir"
fi
xpy="$env_dir/bin/python"

# no compiler: any attempt to build fails loudly
stub="$(mktemp -d)"
for tool in cc gcc c++ g++ nvcc; do
    printf '#!/bin/sh\necho "xver: the cross-version test must not compile ($0 $*)" >&2\nexit 1\n' \
        > "$stub/$tool"
    chmod +x "$stub/$tool"
done

"$xpy" -m pip install -q --no-deps --force-reinstall "$wheel"

# the wheel's CUDA module, if any: its architectures
unpacked="$(mktemp -d)"
trap 'rm -rf "$stub" "$unpacked"' EXIT
"$py" -m zipfile -e "$wheel" "$unpacked"
cuda_lib="$(ls "$unpacked"/comera/_C_cuda*.so 2>/dev/null || true)"
if [ -n "$cuda_lib" ]; then
    want="${XVER_CUDA_ARCHS:-sm_80 sm_90 sm_100}"
    have="$(tools/cuda_archs.sh "$cuda_lib")"
    for a in $want; do
        case " $have " in *" $a "*) ;; *) echo "xver: $(basename "$cuda_lib") has no $a code (has: $have)"; exit 1 ;; esac
    done
    echo "xver: $(basename "$cuda_lib") holds machine code for $have"
else
    echo "xver: the wheel has no CUDA module (built without nvcc): CUDA checks not applicable"
fi

cd "$stub"  # outside the source tree: comera comes from the installed wheel
PATH="$stub:$PATH" CC="$stub/cc" CXX="$stub/c++" TORCH_EXTENSIONS_DIR="$stub/ext" \
"$xpy" -W error::RuntimeWarning - "$wheel" "$cuda_lib" <<'PY'
import os, sys
import torch, comera
import comera._C as ext
site = os.path.dirname(os.path.dirname(comera.__file__))
assert "site-packages" in comera.__file__, f"comera imported from {comera.__file__}, not the wheel"
print(f"xver: {os.path.basename(sys.argv[1])} (built against torch 2.13) loaded into torch "
      f"{torch.__version__} from {os.path.relpath(ext.__file__, site)}")
status = comera.cuda_kernels()
if sys.argv[2] and torch.version.cuda is not None:
    assert status.startswith("loaded:"), status
    ops = ["tt_linear", "tt_linear_backward", "gate_prox_", "gate_step_", "tt_embedding",
           "tt_embedding_backward", "tt_embedding_plan"]
    missing = [op for op in ops
               if not torch._C._dispatch_has_kernel_for_dispatch_key("comera::" + op, "CUDA")]
    assert not missing, f"no CUDA kernel registered for {missing}"
    print(f"xver: CUDA kernels {status}; registered for {', '.join(ops)}")
else:
    print(f"xver: CUDA kernels {status}")
PY
# under the CPU-only torch of the build: the wheel imports, leaves the CUDA
# module alone, warns of nothing, and computes
build_py="${BUILD_PY:-$root/.venv/bin/python}"
if [ -x "$build_py" ]; then
    PYTHONPATH="$unpacked" "$build_py" -W error - <<'PY'
import os, sys
import torch, comera
assert comera.__file__.startswith(os.environ["PYTHONPATH"]), f"comera from {comera.__file__}"
assert torch.version.cuda is None, f"{sys.executable} has torch {torch.__version__} with CUDA"
status = comera.cuda_kernels()
assert status.startswith("not loaded:") and "comera._C_cuda" not in sys.modules, status
assert not torch._C._dispatch_has_kernel_for_dispatch_key("comera::tt_linear", "CUDA")
layer = comera.TTLinear(64, 32, rank=4)
x = torch.randn(3, 64)
assert torch.allclose(layer(x), layer.to_dense()(x), atol=1e-5)
print(f"xver: the wheel under torch {torch.__version__} (no CUDA): CUDA kernels {status}")
PY
else
    echo "xver: no $build_py: the CPU-only torch check did not run"; exit 1
fi
PATH="$stub:$PATH" CC="$stub/cc" CXX="$stub/c++" TORCH_EXTENSIONS_DIR="$stub/ext" PYTHONPATH="$root/tests" \
    "$xpy" -m pytest -q -p no:cacheprovider --rootdir "$stub" -c /dev/null \
    "$root/tests/layers/test_linear.py" "$root/tests/layers/test_embedding.py" \
    "$root/tests/adapt/test_rank_adaptive.py" \
    -k "(not rank_adaptive or gate_prox or prox_step or dead_entries) and not torch_compile"
[ ! -e "$stub/ext" ] || { echo "xver: something was compiled into $stub/ext"; exit 1; }
echo "xver: passed"
