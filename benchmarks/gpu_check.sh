#!/usr/bin/env bash
# The one GPU check of comera, in under 8 minutes on one GPU:
#   1. builds the extension with COMERA_CUDA=1 for this GPU's architecture
#      (pip install --no-build-isolation --no-deps -e .; no network needed);
#   2. runs the tests marked needs_cuda;
#   3. runs the GPU benchmarks (benchmarks/gpu_bench.py);
#   4. runs comera pretrain --preset paper (bf16), dense and CoMERA, 100 steps.
# Everything it writes goes to $OUT:
#   env.txt build.log pytest.log pytest.xml gpu_bench.json gpu_bench.md
#   summary.md                       what passed, what failed, the targets
#   results/gpu_<date>_<gpu>.json|md  ready to commit under benchmarks/results/
#
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh
#
# PYTHON picks the interpreter (default python3, else python).  Without
# pytest, it installs one from the wheels in $WHEELS (default .gpu-wheels)
# if that folder exists (`pip download pytest -d .gpu-wheels` beforehand; the
# folder is git-ignored, so pass it to the device run as a carried path).
# GPU_CHECK_DRY_RUN=1 checks this script's own logic on a machine without a
# GPU: no build (the installed comera is used), tests collected and skipped,
# benchmarks with --device cpu --tiny.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT/results"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
DRY="${GPU_CHECK_DRY_RUN:-0}"
TOTAL_S="${GPU_CHECK_SECONDS:-450}"  # leave margin under 8 minutes
t0=$(date +%s)
left() { echo $(( TOTAL_S - ($(date +%s) - t0) )); }
say() { echo "[gpu_check $(( $(date +%s) - t0 ))s] $*"; }

build_status="not run"
test_status="not run"
bench_status="not run"

# ---- 0. environment -------------------------------------------------------
{
    "$PY" - <<'PY'
import platform, sys
print("python", sys.version.split()[0], platform.platform())
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
PY
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true
    command -v nvcc >/dev/null && nvcc --version | tail -n 2
    nproc
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# ---- 1. build -------------------------------------------------------------
if [ "$DRY" = 1 ]; then
    build_status="skipped (dry run)"
else
    arch="$("$PY" -c 'import torch; c = torch.cuda.get_device_capability(); print(f"{c[0]}.{c[1]}")' 2>/dev/null || echo 9.0)"
    export COMERA_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$arch}"
    export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
    say "building (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)"
    timeout 270 "$PY" -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/build.log" 2>&1
    rc=$?
    if [ $rc -ne 0 ] && [ "$(left)" -gt 330 ]; then
        say "pip install failed ($rc); trying setup.py build_ext --inplace"
        timeout $(( $(left) - 300 )) "$PY" setup.py build_ext --inplace >> "$OUT/build.log" 2>&1
        rc=$?
    fi
    if [ $rc -eq 0 ] && "$PY" -c 'import torch, comera, sys; sys.exit(not torch._C._dispatch_has_kernel_for_dispatch_key("comera::tt_linear", "CUDA"))' >> "$OUT/build.log" 2>&1; then
        build_status="ok"
    else
        build_status="FAILED (exit $rc; see build.log)"
    fi
    grep -i "comera build configuration" "$OUT/build.log" | head -n 1
fi
say "build: $build_status"

# ---- 2. tests marked needs_cuda -------------------------------------------
if [[ "$build_status" == ok* || "$DRY" = 1 ]]; then
    if ! "$PY" -c 'import pytest' 2>/dev/null && [ -d "${WHEELS:-.gpu-wheels}" ]; then
        "$PY" -m pip install -q --no-index --find-links "${WHEELS:-.gpu-wheels}" pytest >> "$OUT/build.log" 2>&1
    fi
    if "$PY" -c 'import pytest' 2>/dev/null; then
        files=$(grep -rl needs_cuda tests --include='test_*.py' | sort)
        tsec=$(( $(left) - 200 ))  # the benchmarks and pre-training keep 200 s
        [ "$tsec" -gt 240 ] && tsec=240
        [ "$tsec" -lt 30 ] && tsec=30
        say "tests (${tsec}s at most): $files"
        # several workers where pytest-xdist is there: the torch.compile
        # tests spend most of their time compiling on the CPU
        workers=()
        "$PY" -c 'import xdist' 2>/dev/null && [ "$DRY" != 1 ] && workers=(-n "${GPU_CHECK_WORKERS:-6}")
        timeout "$tsec" "$PY" -m pytest -m needs_cuda -q -p no:cacheprovider -rfE "${workers[@]}" \
            --junitxml="$OUT/pytest.xml" $files > "$OUT/pytest.log" 2>&1
        rc=$?
        tail_line="$(grep -E '(passed|failed|skipped|error)' "$OUT/pytest.log" | tail -n 1)"
        case $rc in
            0) test_status="ok: $tail_line" ;;
            124) test_status="TIMED OUT after ${tsec}s: $tail_line" ;;
            *) test_status="FAILED (exit $rc): $tail_line" ;;
        esac
    else
        test_status="not run: pytest is not installed (see WHEELS above)"
    fi
else
    test_status="not run: the build failed"
fi
say "tests: $test_status"

# ---- 3. benchmarks --------------------------------------------------------
if [[ "$build_status" == ok* || "$DRY" = 1 ]]; then
    bsec=$(( $(left) - 70 ))  # pre-training keeps 70 s
    [ "$bsec" -lt 60 ] && bsec=60
    extra=()
    [ "$DRY" = 1 ] && extra=(--device cpu --tiny)
    say "benchmarks (${bsec}s at most)"
    timeout "$bsec" "$PY" benchmarks/gpu_bench.py --out "$OUT" --budget-s $(( bsec - 40 )) \
        "${extra[@]}" > "$OUT/bench.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ] && [ -f "$OUT/gpu_bench.json" ]; then
        bench_status="ok"
        name="$("$PY" - "$OUT/gpu_bench.json" <<'PY'
import json, re, sys
m = json.load(open(sys.argv[1]))["machine"]
gpu = m.get("gpu") or m.get("processor") or "cpu"
print(f"gpu_{m['date']}_{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-')}")
PY
)"
        cp "$OUT/gpu_bench.json" "$OUT/results/$name.json"
        cp "$OUT/gpu_bench.md" "$OUT/results/$name.md"
    else
        bench_status="FAILED (exit $rc; see bench.log)"
    fi
else
    bench_status="not run: the build failed"
fi
say "benchmarks: $bench_status"

# ---- 4. comera pretrain --preset paper: tokens/s, CoMERA against dense ----
pretrain_status="not run"
if [[ "$build_status" == ok* || "$DRY" = 1 ]] && [ "$(left)" -gt 40 ]; then
    pt=(--preset paper --method both --precision bf16 --stop-after "${GPU_CHECK_PRETRAIN_STEPS:-100}"
        --max-files 300 --quiet --out "$OUT/pretrain")
    [ "$DRY" = 1 ] && pt=(--preset tiny --method both --stop-after 2 --max-files 40 --quiet
                          --device cpu --out "$OUT/pretrain")
    say "comera pretrain (${pt[*]}, $(( $(left) - 5 ))s at most)"
    timeout $(( $(left) - 5 )) "$PY" -m comera pretrain "${pt[@]}" > "$OUT/pretrain.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ] && [ -f "$OUT/pretrain/metrics.json" ]; then
        pretrain_status="$("$PY" - "$OUT/pretrain/metrics.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))["methods"]
d, c = m["dense"], m["comera"]
print(f"ok: {c['steps_done']} steps, dense {d['tokens_per_s']:.0f} tokens/s, CoMERA "
      f"{c['tokens_per_s']:.0f} tokens/s ({c['tokens_per_s'] / d['tokens_per_s']:.2f}x; "
      f"target 2x), compression {c['compression_whole']:.2f}x")
PY
)"
        cp "$OUT/pretrain/metrics.json" "$OUT/pretrain_metrics.json"
    else
        pretrain_status="FAILED (exit $rc; see pretrain.log)"
    fi
fi
say "pretrain: $pretrain_status"

# ---- summary --------------------------------------------------------------
{
    echo "# comera gpu_check $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo '```'
    cat "$OUT/env.txt"
    echo '```'
    echo
    echo "- build: $build_status"
    echo "- tests (needs_cuda): $test_status"
    echo "- benchmarks: $bench_status"
    echo "- comera pretrain --preset paper (bf16): $pretrain_status"
    echo "- wall time: $(( $(date +%s) - t0 )) s"
    if [ -f "$OUT/pytest.log" ]; then
        echo
        echo "## Test failures"
        echo '```'
        failures="$(grep -E '^(FAILED|ERROR)' "$OUT/pytest.log" | head -n 40)"
        echo "${failures:-none}"
        echo '```'
    fi
    if [ -f "$OUT/gpu_bench.md" ]; then
        echo
        sed 's/^#/##/' "$OUT/gpu_bench.md"
    fi
} > "$OUT/summary.md"
cat "$OUT/summary.md"
# GPU_CHECK_PACK=1: every log in one archive beside summary.md and results/
# (for a transfer that brings back only a few files)
if [ "${GPU_CHECK_PACK:-0}" = 1 ]; then
    tgz="$(mktemp)"
    tar czf "$tgz" -C "$OUT" --exclude=summary.md --exclude=results --exclude=./pretrain . \
        && find "$OUT" -mindepth 1 -maxdepth 1 ! -name summary.md ! -name results -exec rm -rf {} + \
        && mv "$tgz" "$OUT/logs.tgz"
fi
[[ "$build_status" == ok* || "$DRY" = 1 ]] && [[ "$test_status" == ok* ]] && [ "$bench_status" = ok ]
