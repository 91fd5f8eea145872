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
trap 'rm -rf "$stub"' EXIT
for tool in cc gcc c++ g++ nvcc; do
    printf '#!/bin/sh\necho "xver: the cross-version test must not compile ($0 $*)" >&2\nexit 1\n' \
        > "$stub/$tool"
    chmod +x "$stub/$tool"
done

"$xpy" -m pip install -q --no-deps --force-reinstall "$wheel"

cd "$stub"  # outside the source tree: comera comes from the installed wheel
PATH="$stub:$PATH" CC="$stub/cc" CXX="$stub/c++" TORCH_EXTENSIONS_DIR="$stub/ext" \
"$xpy" - "$wheel" <<'PY'
import os, sys
import torch, comera
import comera._C as ext
site = os.path.dirname(os.path.dirname(comera.__file__))
assert "site-packages" in comera.__file__, f"comera imported from {comera.__file__}, not the wheel"
print(f"xver: {os.path.basename(sys.argv[1])} (built against torch 2.13) loaded into torch "
      f"{torch.__version__} from {os.path.relpath(ext.__file__, site)}")
PY
PATH="$stub:$PATH" CC="$stub/cc" CXX="$stub/c++" TORCH_EXTENSIONS_DIR="$stub/ext" \
    "$xpy" -m pytest -q -p no:cacheprovider --rootdir "$stub" -c /dev/null \
    "$root/tests/test_linear.py" "$root/tests/test_embedding.py" \
    "$root/tests/test_rank_adaptive.py" \
    -k "(not rank_adaptive or gate_prox or prox_step or dead_entries) and not torch_compile"
[ ! -e "$stub/ext" ] || { echo "xver: something was compiled into $stub/ext"; exit 1; }
echo "xver: passed"
