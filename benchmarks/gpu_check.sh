#!/usr/bin/env bash
# The one GPU check of comera, in under 8 minutes on one H100 or H200.  Each
# stage has a timeout of its own (at most its cap, and never more than the
# time left less what the later stages need), so one hang cannot eat the
# budget; a stage that times out is reported as such and the next one runs.
#   build        the extension with COMERA_CUDA=1 for this GPU's architecture
#                (pip install --no-build-isolation --no-deps -e .; no network)
#   tests        the tests marked needs_cuda
#   linear       TTLinear 768->3072 r32 bf16, 4096 rows, fwd+bwd, eager and graphed
#   embedding    TTEmbedding 30522x768, 4096 tokens, fwd+bwd, eager and graphed
#   transformer  six-encoder bf16 training step, eager and graphed
#   pretrain     comera pretrain --preset paper --precision bf16: dense and
#                CoMERA, then dense with --compile, tokens/s
# The benchmarks measure nn.Linear / nn.Embedding / the dense model both as
# they are and under torch.compile (benchmarks/gpu_bench.py).
#
#   bash benchmarks/gpu_check.sh                  # on the GPU machine
#   GPU_CHECK_DRY_RUN=1 OUT=/tmp/dry bash benchmarks/gpu_check.sh   # on a CPU
#
# Logs go to $OUT (default: a new temporary folder): env.txt, build.log,
# pytest.log, pytest.xml, bench_<stage>.log, pretrain*.log, gpu_bench*.json,
# gpu_bench.md, summary.md.  The results go to $RESULTS (default
# benchmarks/results; in a dry run $OUT/results):
#   gpu_<date>_<gpu>.json|md    the benchmark figures and targets
#   gpu_check_<date>_<gpu>.md   the summary: stages, tests, figures
# The script commits nothing: review and commit the results yourself.  Where
# only $OUT comes back from the GPU machine, run it with RESULTS=$OUT/results
# and GPU_CHECK_PACK=1 (the logs in one archive, $OUT/logs.tgz).
#
# PYTHON picks the interpreter (default python3, else python).  Without
# pytest, it installs one from the wheels in $WHEELS (default .gpu-wheels)
# if that folder exists (`pip download pytest -d .gpu-wheels` beforehand; the
# folder is git-ignored, so pass it to the device run as a carried path).
# GPU_CHECK_SECONDS (default 450) is the whole budget.
# GPU_CHECK_DRY_RUN=1 checks this script's own logic on a machine without a
# GPU: no build (the installed comera is used), the needs_cuda tests
# collected and skipped, tiny benchmarks on the CPU with torch.compile's
# eager backend, a two-step tiny pre-training; the GPU-only parts (CUDA
# graphs, the build) are reported as skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}"
DRY="${GPU_CHECK_DRY_RUN:-0}"
if [ "$DRY" = 1 ]; then RESULTS="${RESULTS:-$OUT/results}"; else RESULTS="${RESULTS:-benchmarks/results}"; fi
mkdir -p "$OUT" "$RESULTS"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
TOTAL_S="${GPU_CHECK_SECONDS:-450}"  # margin under 8 minutes
export PYTHONUNBUFFERED=1
t0=$(date +%s)
left() { echo $(( TOTAL_S - ($(date +%s) - t0) )); }
say() { echo "[gpu_check $(( $(date +%s) - t0 ))s] $*"; }

# stage_s CAP LATER: this stage's timeout: CAP, but leaving 20 s for each of
# the LATER stages; 0 when less than 10 s would be left
stage_s() {
    local t=$(( $(left) - 20 * $2 ))
    [ "$t" -gt "$1" ] && t=$1
    [ "$t" -lt 10 ] && t=0
    echo "$t"
}
# status RC SECONDS: a stage's outcome in words
status() {
    case $1 in
        0) echo "ok" ;;
        124|137) echo "TIMED OUT after ${2}s" ;;
        *) echo "FAILED (exit $1)" ;;
    esac
}
declare -A STAGE
ORDER=(build tests linear embedding transformer pretrain)
for s in "${ORDER[@]}"; do STAGE[$s]="not run"; done

# ---- environment ----------------------------------------------------------
{
    timeout 30 "$PY" - <<'PY'
import platform, sys
print("python", sys.version.split()[0], platform.platform())
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
PY
    timeout 10 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true
    command -v nvcc >/dev/null && timeout 10 nvcc --version | tail -n 2
    nproc
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# ---- build ----------------------------------------------------------------
if [ "$DRY" = 1 ]; then
    STAGE[build]="skipped (dry run: the installed comera is used)"
else
    arch="$(timeout 30 "$PY" -c 'import torch; c = torch.cuda.get_device_capability(); print(f"{c[0]}.{c[1]}")' 2>/dev/null || echo 9.0)"
    export COMERA_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$arch}"
    export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
    t=$(stage_s 170 5)
    say "build (${t}s at most; TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)"
    timeout "$t" "$PY" -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/build.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ] && timeout 60 "$PY" -c 'import torch, comera, sys; sys.exit(not torch._C._dispatch_has_kernel_for_dispatch_key("comera::tt_linear", "CUDA"))' >> "$OUT/build.log" 2>&1; then
        STAGE[build]="ok"
    else
        STAGE[build]="$(status $rc "$t") (see build.log)"
        [ $rc -eq 0 ] && STAGE[build]="FAILED: no CUDA kernel for comera::tt_linear (see build.log)"
    fi
    grep -i "comera build configuration" "$OUT/build.log" | head -n 1
fi
say "build: ${STAGE[build]}"
built() { [[ "${STAGE[build]}" == ok* || "$DRY" = 1 ]]; }

# ---- tests marked needs_cuda ----------------------------------------------
if built; then
    if ! "$PY" -c 'import pytest' 2>/dev/null && [ -d "${WHEELS:-.gpu-wheels}" ]; then
        "$PY" -m pip install -q --no-index --find-links "${WHEELS:-.gpu-wheels}" pytest >> "$OUT/build.log" 2>&1
    fi
    t=$(stage_s 100 4)
    if ! "$PY" -c 'import pytest' 2>/dev/null; then
        STAGE[tests]="not run: pytest is not installed (see WHEELS above)"
    elif [ "$t" = 0 ]; then
        STAGE[tests]="not run: no time left"
    else
        files=$(grep -rl needs_cuda tests --include='test_*.py' | sort)
        say "tests (${t}s at most): $(echo $files | wc -w) files"
        # several workers where pytest-xdist is there: the torch.compile
        # tests spend most of their time compiling on the CPU
        workers=()
        "$PY" -c 'import xdist' 2>/dev/null && [ "$DRY" != 1 ] && workers=(-n "${GPU_CHECK_WORKERS:-6}")
        timeout "$t" "$PY" -m pytest -m needs_cuda -q -p no:cacheprovider -rfE "${workers[@]}" \
            --junitxml="$OUT/pytest.xml" $files > "$OUT/pytest.log" 2>&1
        rc=$?
        tail_line="$(grep -E '(passed|failed|skipped|error)' "$OUT/pytest.log" | tail -n 1)"
        [ $rc -eq 5 ] && rc=0  # nothing collected is not a failure of the GPU
        STAGE[tests]="$(status $rc "$t"): $tail_line"
    fi
else
    STAGE[tests]="not run: the build failed"
fi
say "tests: ${STAGE[tests]}"

# ---- benchmarks, one process per section ------------------------------------
bench_args=()
[ "$DRY" = 1 ] && bench_args=(--device cpu --tiny --compile-backend eager)
later=3
for section in linear embedding transformer; do
    later=$(( later - 1 ))
    cap=75; [ "$section" = transformer ] && cap=110
    t=$(stage_s $cap $(( later + 1 )))
    if ! built; then
        STAGE[$section]="not run: the build failed"
    elif [ "$t" = 0 ]; then
        STAGE[$section]="not run: no time left"
    else
        say "$section (${t}s at most)"
        timeout "$t" "$PY" benchmarks/gpu_bench.py --out "$OUT" --only "$section" \
            --budget-s $(( t - 15 )) "${bench_args[@]}" > "$OUT/bench_$section.log" 2>&1
        rc=$?
        STAGE[$section]="$(status $rc "$t")"
        [ "$DRY" = 1 ] && STAGE[$section]="${STAGE[$section]} (dry run: tiny sizes on the CPU, no CUDA graphs)"
        [ -f "$OUT/gpu_bench_$section.json" ] || STAGE[$section]="${STAGE[$section]}, no figures"
    fi
    say "$section: ${STAGE[$section]}"
done

# ---- comera pretrain: tokens/s, CoMERA against dense and compiled dense ---
if built; then
    pt=(--preset paper --precision bf16 --stop-after "${GPU_CHECK_PRETRAIN_STEPS:-100}"
        --max-files 300 --quiet)
    [ "$DRY" = 1 ] && pt=(--preset tiny --stop-after 2 --max-files 40 --quiet --device cpu)
    runs=()
    t=$(stage_s 90 1)
    if [ "$t" = 0 ]; then
        STAGE[pretrain]="not run: no time left"
    else
        say "pretrain dense and CoMERA (${t}s at most)"
        timeout "$t" "$PY" -m comera pretrain "${pt[@]}" --method both --out "$OUT/pretrain" \
            > "$OUT/pretrain.log" 2>&1
        rc=$?
        STAGE[pretrain]="both: $(status $rc "$t")"
        runs+=("dense=$OUT/pretrain/metrics.json" "comera=$OUT/pretrain/metrics.json")
        t=$(stage_s 70 0)
        if [ "$t" = 0 ]; then
            STAGE[pretrain]="${STAGE[pretrain]}; dense --compile: not run, no time left"
        else
            say "pretrain dense --compile (${t}s at most)"
            # the same tokenized corpus: no second tokenizer training
            mkdir -p "$OUT/pretrain_compiled"
            cp "$OUT"/pretrain/tokenizer*.json "$OUT"/pretrain/tokens.pt "$OUT/pretrain_compiled/" 2>/dev/null
            # dry run: the --compile path with torch.compile switched off
            # (inductor takes minutes on a small CPU)
            nocompile=0; [ "$DRY" = 1 ] && nocompile=1
            TORCH_COMPILE_DISABLE=$nocompile timeout "$t" "$PY" -m comera pretrain "${pt[@]}" \
                --method dense --compile --out "$OUT/pretrain_compiled" > "$OUT/pretrain_compiled.log" 2>&1
            rc=$?
            STAGE[pretrain]="${STAGE[pretrain]}; dense --compile: $(status $rc "$t")"
            [ "$DRY" = 1 ] && STAGE[pretrain]="${STAGE[pretrain]} (dry run: TORCH_COMPILE_DISABLE=1)"
            runs+=("dense compiled=$OUT/pretrain_compiled/metrics.json")
        fi
        timeout 60 "$PY" benchmarks/gpu_bench.py --out "$OUT" --pretrain "${runs[@]}" "${bench_args[@]}" \
            > "$OUT/bench_pretrain.log" 2>&1 || STAGE[pretrain]="${STAGE[pretrain]}; reading the metrics FAILED"
    fi
else
    STAGE[pretrain]="not run: the build failed"
fi
say "pretrain: ${STAGE[pretrain]}"

# ---- results and summary ----------------------------------------------------
timeout 60 "$PY" benchmarks/gpu_bench.py --out "$OUT" --merge-only "${bench_args[@]}" > "$OUT/merge.log" 2>&1
name="$(timeout 30 "$PY" - "$OUT/gpu_bench.json" <<'PY' 2>/dev/null
import json, re, sys
m = json.load(open(sys.argv[1]))["machine"]
gpu = m.get("gpu") or m.get("processor") or "cpu"
print(f"{m['date']}_{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-')}")
PY
)"
name="${name:-$(date -u +%Y-%m-%d)_unknown}"
{
    echo "# comera gpu_check $(date -u +%Y-%m-%dT%H:%MZ)$([ "$DRY" = 1 ] && echo ' (dry run)')"
    echo
    echo '```'
    cat "$OUT/env.txt"
    echo '```'
    echo
    for s in "${ORDER[@]}"; do echo "- $s: ${STAGE[$s]}"; done
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
if [ -f "$OUT/gpu_bench.json" ]; then
    cp "$OUT/gpu_bench.json" "$RESULTS/gpu_$name.json"
    cp "$OUT/gpu_bench.md" "$RESULTS/gpu_$name.md"
fi
cp "$OUT/summary.md" "$RESULTS/gpu_check_$name.md"
cat "$OUT/summary.md"
say "logs in $OUT, results in $RESULTS (gpu_$name.*, gpu_check_$name.md); nothing committed"
# GPU_CHECK_PACK=1: every log in one archive, $OUT/logs.tgz, beside summary.md
# and results/ (for a transfer that brings back only a few files)
if [ "${GPU_CHECK_PACK:-0}" = 1 ]; then
    tgz="$(mktemp)"
    tar czf "$tgz" -C "$OUT" --exclude=./summary.md --exclude=./results --exclude=./pretrain \
        --exclude=./pretrain_compiled . \
        && find "$OUT" -mindepth 1 -maxdepth 1 ! -name summary.md ! -name results -exec rm -rf {} + \
        && mv "$tgz" "$OUT/logs.tgz"
fi
# success: every stage ran to its end (figures may still miss their targets)
for s in "${ORDER[@]}"; do
    case "${STAGE[$s]}" in ok*|skipped*|"both: ok; dense --compile: ok"*) ;; *) exit 1 ;; esac
done
exit 0
