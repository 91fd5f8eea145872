#!/usr/bin/env bash
# make check-cuda: the CUDA build checks that need no GPU.
#  1. every csrc/*/*.cu compiles with nvcc, warnings as errors, for each
#     architecture in CHECK_CUDA_ARCHS (default sm_80 and sm_90), with the
#     macros torch's CUDA extensions add (no implicit half conversions);
#  2. where a virtual environment with a CUDA build of torch exists
#     ($CUDA_VENV, default .venv-cuda; `make venv-cuda` makes one), the whole
#     extension builds with COMERA_CUDA=1 into build/cuda-ext (comera._C and
#     comera._C_cuda), links, imports, and has CUDA kernels registered for
#     its operators.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
nvcc="${NVCC:-nvcc}"
archs="${CHECK_CUDA_ARCHS:-80 90}"
cublas_inc="$(tools/cublas_include.sh)"
out=build/cuda-check
mkdir -p "$out"
gencode=()
for a in $archs; do gencode+=(-gencode "arch=compute_$a,code=sm_$a"); done
n=0
for cu in csrc/*/*.cu; do
    obj="$out/$(dirname "$cu" | xargs basename)_$(basename "$cu" .cu).o"
    echo "nvcc $cu (sm: $archs)"
    "$nvcc" -std=c++17 -O3 -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror \
        -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
        -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
        "${gencode[@]}" -Icsrc/include -Icsrc -I"$cublas_inc" -c "$cu" -o "$obj"
    n=$((n + 1))
done
echo "check-cuda: $n CUDA sources compiled with nvcc, no warnings"

venv="${CUDA_VENV:-.venv-cuda}"
case "$venv" in /*) ;; *) venv="$root/$venv" ;; esac
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; then
    echo "check-cuda: no CUDA build of torch in $venv: skipped the full extension build (make venv-cuda)"
    exit 0
fi
rm -rf build/cuda-ext
COMERA_CUDA=1 "$venv/bin/python" setup.py -q build --build-base build/cuda-ext
lib="$(ls -d build/cuda-ext/lib*)"
(cd /tmp && PYTHONPATH="$root/$lib" "$venv/bin/python" - <<'PY'
import torch, comera
ops = ["tt_linear", "tt_linear_backward", "gate_prox_", "gate_step_", "tt_embedding",
       "tt_embedding_backward", "tt_embedding_plan"]
missing = [op for op in ops
           if not torch._C._dispatch_has_kernel_for_dispatch_key("comera::" + op, "CUDA")]
assert not missing, f"no CUDA kernel registered for {missing}"
assert comera.cuda_kernels().startswith("loaded:"), comera.cuda_kernels()
print(f"check-cuda: extension built with torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"imported from {comera.__file__}; CUDA kernels registered for {', '.join(ops)}")
PY
)
