#!/usr/bin/env bash
# The built extension uses torch only through the LibTorch stable ABI: among
# its undefined dynamic symbols there is no ATen/c10/torch C++ symbol (those
# are bound to one torch version), only the stable C shims (aoti_torch_*,
# torch_*), CPython, the C/C++ runtimes and OpenMP (and CUDA's in a CUDA
# build); and no glibc/libstdc++ symbol version newer than manylinux_2_28
# allows.  Checks comera/_C*.so, or the libraries given as arguments, and
# those in the newest wheel in dist/ when there is one.
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
    # manylinux_2_28 (torch's own wheels): glibc <= 2.28, libstdc++ of GCC 8
    # (GLIBCXX <= 3.4.24, CXXABI <= 1.3.11); csrc/common/manylinux.cpp says
    # which newer references the build avoids
    newer="$(objdump -T "$lib" | grep -oE '\((GLIBC_2\.(29|[3-9][0-9])|GLIBCXX_3\.4\.(2[5-9]|[3-9][0-9])|CXXABI_1\.3\.(1[2-9]))[^)]*\).*' || true)"
    if [ -n "$newer" ]; then
        echo "check-stable-abi: $(basename "$lib") needs symbols newer than manylinux_2_28:"
        printf '%s\n' "$newer" | c++filt | head -20; status=1
    fi
done
exit $status
