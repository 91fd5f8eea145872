#!/usr/bin/env bash
# The built extension uses torch only through the LibTorch stable ABI: among
# its undefined dynamic symbols there is no ATen/c10/torch C++ symbol (those
# are bound to one torch version), only the stable C shims (aoti_torch_*,
# torch_*), CPython, the C/C++ runtimes and OpenMP (and CUDA's in a CUDA
# build).  Checks comera/_C*.so, or the libraries given as arguments, and the
# one in the newest wheel in dist/ when there is one.
set -euo pipefail
cd "$(dirname "$0")/.."
libs=("$@")
if [ ${#libs[@]} -eq 0 ]; then
    libs=(comera/_C*.so)
    wheel="$(ls -t dist/comera-*.whl 2>/dev/null | head -n 1 || true)"
    if [ -n "$wheel" ]; then
        tmp="$(mktemp -d)"
        trap 'rm -rf "$tmp"' EXIT
        (cd "$tmp" && python3 -m zipfile -e "$OLDPWD/$wheel" .)
        libs+=("$tmp"/comera/_C*.so)
    fi
fi
status=0
for lib in "${libs[@]}"; do
    bound="$(nm -D --undefined-only "$lib" | c++filt | grep -E '(at|c10|torch|caffe2)::' || true)"
    total="$(nm -D --undefined-only "$lib" | wc -l)"
    n="$(printf '%s' "$bound" | grep -c . || true)"
    echo "check-stable-abi: $(basename "$lib"): $total undefined symbols, $n version-bound ATen/c10 C++ ones"
    if [ "$n" -ne 0 ]; then printf '%s\n' "$bound" | head -20; status=1; fi
    if readelf -d "$lib" | grep -E 'NEEDED.*(libc10|libtorch_python|libtorch_cuda|libc10_cuda)' ; then
        echo "check-stable-abi: $(basename "$lib") links a version-bound torch library"; status=1
    fi
done
exit $status
