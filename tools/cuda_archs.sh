#!/usr/bin/env bash
# Prints the GPU architectures (sm_80 sm_90 ...) whose machine code (cubins)
# a library holds, one line, sorted: `cuobjdump --list-elf` summarised.
# cuobjdump comes from $CUOBJDUMP, PATH, $CUDA_HOME/bin, an earlier
# extraction under build/, or, as a last resort, the nvidia-cuda-cuobjdump
# wheel fetched with pip (no dependencies) and extracted into build/cuobjdump.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[ $# -eq 1 ] || { echo "usage: $0 LIBRARY.so" >&2; exit 2; }
lib="$1"

tool="${CUOBJDUMP:-}"
if [ -z "$tool" ]; then
    for c in "$(command -v cuobjdump || true)" "${CUDA_HOME:-/usr/local/cuda}/bin/cuobjdump" \
             "$root"/build/cuobjdump/nvidia/*/bin/cuobjdump; do
        if [ -n "$c" ] && [ -x "$c" ]; then tool="$c"; break; fi
    done
fi
if [ -z "$tool" ]; then
    mkdir -p "$root/build/cuobjdump"
    python3 -m pip download -q --no-deps "nvidia-cuda-cuobjdump>=13,<14" -d "$root/build/cuobjdump" >&2
    python3 -m zipfile -e "$(ls "$root"/build/cuobjdump/nvidia_cuda_cuobjdump-*.whl | tail -n 1)" \
        "$root/build/cuobjdump"
    tool="$(ls "$root"/build/cuobjdump/nvidia/*/bin/cuobjdump | tail -n 1)"
    chmod +x "$tool"
fi
"$tool" --list-elf "$lib" | grep -o 'sm_[0-9]*[a-z]*' | sort -u -V | tr '\n' ' ' | sed 's/ $/\n/'
