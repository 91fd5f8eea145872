#!/usr/bin/env bash
# A short GPU recheck after a kernel change, inside a fixed wall-clock budget
# (RECHECK_SECONDS, default 160): build, the needs_cuda tests, the kernel
# profile (gpu_profile.py), the linear and transformer GPU benchmarks, and,
# with the time left, a short paper-preset pre-training run.  Everything goes
# to $OUT (at most eight files).   OUT=/tmp/re bash benchmarks/gpu_recheck.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?set OUT}"
PY="${PYTHON:-python3}"
end=$(( $(date +%s) + ${RECHECK_SECONDS:-160} ))
left() { echo $(( end - $(date +%s) )); }
export PYTHONUNBUFFERED=1 COMERA_CUDA=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$("$PY" -c 'import torch; c = torch.cuda.get_device_capability(); print(f"{c[0]}.{c[1]}")')}"
timeout "$(left)" "$PY" -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
    || { echo "build FAILED"; tail -20 "$OUT/build.log"; exit 1; }
echo "build ok, $(left) s left"
workers=()
"$PY" -c 'import xdist' 2>/dev/null && workers=(-n 8)
timeout "$(( $(left) > 70 ? 70 : $(left) ))" "$PY" -m pytest -m needs_cuda -q -p no:cacheprovider -rfE \
    "${workers[@]}" $(grep -l needs_cuda tests/test_*.py) > "$OUT/pytest.log" 2>&1
echo "tests rc=$?: $(tail -n 1 "$OUT/pytest.log"), $(left) s left"
grep -E '^(FAILED|ERROR)' "$OUT/pytest.log" | head -20
timeout "$(( $(left) > 25 ? 25 : $(left) ))" "$PY" benchmarks/gpu_profile.py --out "$OUT" > /dev/null 2>&1
echo "profile rc=$?, $(left) s left"
timeout "$(( $(left) > 40 ? 40 : $(left) ))" "$PY" benchmarks/gpu_bench.py --out "$OUT" --budget-s 25 \
    --only linear,transformer > "$OUT/bench.log" 2>&1
echo "bench rc=$?, $(left) s left"
if [ "$(left)" -gt 25 ]; then
    timeout "$(( $(left) - 3 ))" "$PY" -m comera pretrain --preset paper --method both --precision bf16 \
        --stop-after 60 --max-files 150 --quiet --out /tmp/recheck-pretrain > "$OUT/pretrain.log" 2>&1
    echo "pretrain rc=$?"; cp /tmp/recheck-pretrain/metrics.json "$OUT/pretrain_metrics.json" 2>/dev/null
fi
exit 0
