#!/usr/bin/env bash
# Prints a folder holding cublas_v2.h (the CUDA C kernels include it), for
# builds that need no CUDA build of torch: make check-cuda, tests/cuda_emu
# and make wheel (which also links the libcublas.so.N in ../lib when the
# toolkit has none: setup.py, COMERA_CUBLAS_INCLUDE).
# Looks in $CUBLAS_INCLUDE, the CUDA toolkit, the nvidia-cublas wheel of a
# local virtual environment ($CUDA_VENV, .venv-cuda, .venv), then an earlier
# extraction under build/; as a last resort downloads the nvidia-cublas
# wheel with pip (no dependencies) and extracts only its headers and
# libcublas.so.N (not cublasLt) into build/cublas-headers.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
has() { [ -n "$1" ] && [ -f "$1/cublas_v2.h" ]; }

if has "${CUBLAS_INCLUDE:-}"; then echo "$CUBLAS_INCLUDE"; exit 0; fi
cuda_home="${CUDA_HOME:-/usr/local/cuda}"
if has "$cuda_home/include"; then echo "$cuda_home/include"; exit 0; fi
for py in ${CUDA_VENV:+"$CUDA_VENV/bin/python"} "$root/.venv-cuda/bin/python" "$root/.venv/bin/python" python3; do
    command -v "$py" >/dev/null 2>&1 || [ -x "$py" ] || continue
    site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)" || continue
    for sub in nvidia/cu13/include nvidia/cublas/include; do
        if has "$site/$sub"; then echo "$site/$sub"; exit 0; fi
    done
done
for sub in nvidia/cu13/include nvidia/cublas/include; do
    d="$root/build/cublas-headers/$sub"
    if has "$d" && ls "$d"/../lib/libcublas.so.* >/dev/null 2>&1; then echo "$d"; exit 0; fi
done
rm -rf "$root/build/cublas-headers"  # an older extraction without the library
mkdir -p "$root/build/cublas-wheel" "$root/build/cublas-headers"
python3 -m pip download -q --no-deps "nvidia-cublas>=13,<14" -d "$root/build/cublas-wheel" >&2
python3 - "$root/build/cublas-wheel" "$root/build/cublas-headers" <<'PY'
import glob, sys, zipfile
wheel = sorted(glob.glob(sys.argv[1] + "/nvidia_cublas-*.whl"))[-1]
with zipfile.ZipFile(wheel) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist()
                               if "/include/" in n or "/lib/libcublas.so." in n])
PY
rm -rf "$root/build/cublas-wheel"
for sub in nvidia/cu13/include nvidia/cublas/include; do
    if has "$root/build/cublas-headers/$sub"; then echo "$root/build/cublas-headers/$sub"; exit 0; fi
done
echo "cublas_v2.h not found" >&2
exit 1
