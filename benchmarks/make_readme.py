"""Rebuild benchmarks/README.md from the results each benchmark wrote.

Every benchmark writes its own Markdown table (with the command that
reproduces it and the machine it ran on) under benchmarks/results/; this
script only gathers them, in a fixed order, with their PNG plots, so the
README can never disagree with the stored results.

    python benchmarks/make_readme.py          # after running the benchmarks

It also rewrites the paper-claims table of the top-level README.md (between
its ``<!-- claims:start -->`` and ``<!-- claims:end -->`` markers) from the
same result files (claims.py).
"""
import glob
import json
import os
import sys

from claims import claims_table

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

HEADER = """# Benchmarks

Every number below was measured by the command printed with its table, on the machine named
there, and is stored with its machine description in `benchmarks/results/` (JSON, Markdown and
PNG). Ratios are always against a baseline measured in the same run. This file is assembled from
those results by `python benchmarks/make_readme.py`.

Setup (the peers are benchmark-only dependencies, in the `bench` extra):

    pip install torch==2.13.0
    pip install --no-build-isolation -e ".[bench]"   # tensorly, tensorly-torch, galore-torch, matplotlib

or simply `make install`. Each script has a `--quick` mode (tiny sizes, seconds) that
`benchmarks/tests/test_bench_smoke.py` and `benchmarks/tests/test_bench_protocol.py` run.

The CPU results come from shared 2-core virtual machines (an AMD EPYC with AVX2, an AMD EPYC
with AVX-512, an Intel Xeon with AVX-512 and AMX); each result names its machine and records
the load average. The GPU script (`benchmarks/gpu_check.sh`) writes `gpu_*` results when it is
run on a GPU machine.

## How we measure

- One timing helper, `benchmarks/timing.py`, for every benchmark. Wall clock is the headline;
  process CPU time is kept as an extra column (in the JSON).
- Methods compared with each other are built in one process and timed **interleaved**: a
  warm-up call of each, then rounds that call every method once in an order shuffled anew each
  round (seeded; a rotating order gave each method a fixed predecessor), so a change
  in machine load hits all of them alike. Every time is a median with its spread (min, max,
  interquartile range) and the number of rounds. Where a ratio of two methods is a target
  (`bench_embedding.py`), the 95% bootstrap interval of the median per-round ratio is given
  beside it (`timing.paired_ratio`): a round's two times share the machine's state.
- Memory is measured apart, in a fresh subprocess per method (peak RSS growth).
- Every subprocess gets the thread count as `--threads N` and `OMP_NUM_THREADS=N` and asserts it
  (`timing.assert_threads`); a case that reports another count is refused. The thread count in a
  table is the one the numbers ran with.
- Every result JSON and table carries the machine record: CPU model, ISA flags, cores, torch and
  its BLAS, sgemm and copy rates measured in the same run, threads, and the load average before
  and after. The command that reproduces a table is printed under it.
- GaLore recomputes its projections (one SVD per projected weight) every `update_proj_gap`
  steps; its step time is the steady step plus the extra cost of an SVD step divided by the gap,
  both timed in the same interleaved rounds.
- Peers are compared at the same rank and, for tensorly-torch, also at the rank that gives
  comera's parameter count.

## How we tune

- Hyperparameters (the learning rate) are chosen on a **validation split** carved from the
  training data by file, never on the test split.
- Every method, dense included, picks from the **same grid** with the **same budget** (steps,
  batches, schedule, optimizer).
- The test split is scored only after the choice, once per seed, at the chosen setting.
- A choice on the edge of the grid means the grid did not bracket that method's best rate: the
  grid is widened for every method and the run repeated. `bench_accuracy.py` and
  `bench_adaptive.py` name any choice still on an edge under their tables; a rate at which
  training diverges is recorded as such and never chosen.
- Wherever accuracy or loss are compared: at least **3 seeds**, mean +- standard deviation.
- Compression is reported for the compressed layers **and** for the whole model; for rank-adaptive
  runs also at the first step (the starting ranks alone) and at the last.
"""

# (result name, what it answers[, what to say while it is missing]).
SECTIONS = [
    ("quality_cpu", "Quality: dense, CoMERA and fixed TT ranks at equal steps and equal wall-clock "
     "(mini preset)"),
    ("quality_cpu_1500steps", "Quality: the same protocol cut to 1,500 steps"),
    ("tt_recipe_cpu", "What makes TT training learn (validation only, one seed per recipe)"),
    ("demo_cpu", "`make demo`: wall time and learning"),
    ("host_cost_cpu", "Host cost of small calls"),
    ("adaptive_cpu", "Adaptive against fixed ranks"),
    ("peers_cpu_linear", "comera against its peers: TT linear layers",
     "Not run yet: `python benchmarks/bench_peers.py --part linear --threads 1` writes it."),
    ("peers_cpu_transformer", "comera against its peers: six-encoder training step",
     "Not run yet: `python benchmarks/bench_peers.py --part transformer --threads 1` writes it."),
    ("transformer_cpu", "The paper's six-encoder transformer"),
    ("accuracy_cpu", "Accuracy against compression",
     "Not run yet: `python benchmarks/bench_accuracy.py` writes it (hours on 2 cores)."),
    ("linear_cpu", "TTLinear against nn.Linear and the matmul merge path"),
    ("linear_cpu_xeon_amx", "TTLinear against nn.Linear and the merge path on an AMX Xeon "
     "(float32 and bfloat16)"),
    ("linear_cpu_xeon_avx2only", "TTLinear on the AMX Xeon with comera, MKL and torch limited "
     "to AVX2"),
    ("linear_cpu_epyc_avx512", "TTLinear against nn.Linear and the merge path on an AVX-512 "
     "EPYC (float32 and bfloat16)"),
    ("linear_cpu_epyc_avx2only", "TTLinear on the AVX-512 EPYC with comera, MKL and torch "
     "limited to AVX2"),
    ("linear_cpu_glibc_hugetlb", "TTLinear with glibc's huge-page malloc"),
    ("bench_embedding", "TTEmbedding against nn.Embedding"),
    ("prune_cpu", "Pruning: time against FLOPs"),
    ("prune_cpu_xeon_amx", "Pruning on an AMX Xeon"),
    ("prune_cpu_epyc_avx512", "Pruning on an AVX-512 EPYC"),
    ("heap_kept/prune_cpu", "Pruning with freed memory kept in the heap (glibc tunables, as "
     "jemalloc or tcmalloc would keep it)",
     "Not run yet: `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=2147483647:"
     "glibc.malloc.trim_threshold=4294967295 python benchmarks/bench_prune.py --rows 4096 1024 "
     "--reps 15 --threads 1 --out benchmarks/results/heap_kept` writes it."),
]


def demote(md: str) -> str:
    """Headings two levels down, so each result sits under its section."""
    out = []
    for line in md.splitlines():
        out.append("##" + line if line.startswith("#") else line)
    return "\n".join(out).strip() + "\n"


# Results whose JSON predates the measuring and tuning rules above carry no
# "interleaved" (timing) or "aggregate"/"per_seed" (tuning) marks.
STALE = {
    "transformer_cpu": ("interleaved", "its case subprocesses ran with 2 threads whatever the label "
                        "says and the step times are process CPU time, not interleaved"),
    "accuracy_cpu": ("aggregate", "one seed, and comera's learning rate was chosen on the test "
                     "split while dense kept an untuned one"),
    "adaptive_cpu": ("protocol", "the learning rate was chosen on the validation split and that "
                     "same validation loss reported, with the selection seed inside the mean; the "
                     "seeds varied only the initialisation; the magnitude rule ran at the adaptive "
                     "rule's learning rate"),
}


def stale_note(name: str) -> str:
    """A warning for a result measured before the rules above, or ''."""
    if name not in STALE:
        return ""
    key, why = STALE[name]
    try:
        with open(os.path.join(RESULTS, name + ".json")) as fh:
            payload = json.load(fh)
    except (OSError, ValueError):
        return ""
    if key in payload:
        return ""
    return (f"**Measured before the rules above; to be regenerated:** {why}. "
            "Treat its ratios as indicative only.\n")


def section(name: str, title: str, missing: str = "") -> str:
    md_path = os.path.join(RESULTS, name + ".md")
    parts = [f"## {title}\n"]
    if not os.path.exists(md_path):
        parts.append((missing or f"Not run yet: `benchmarks/results/{name}.md` is missing.") + "\n")
        return "\n".join(parts)
    note = stale_note(name)
    if note:
        parts.append(note)
    with open(md_path) as fh:
        parts.append(demote(fh.read()))
    # a longer result name that starts with this one owns its own plots
    others = [e[0] for e in SECTIONS if e[0] != name and e[0].startswith(name)]
    pngs = sorted(p for p in glob.glob(os.path.join(RESULTS, name + "*.png"))
                  if not any(os.path.basename(p).startswith(o) for o in others))
    already = set()
    for p in pngs:
        rel = "results/" + os.path.basename(p)
        if rel in parts[-1] or rel in already:
            continue
        already.add(rel)
        parts.append(f"![{os.path.basename(p)}]({rel})\n")
    return "\n".join(parts)


def build() -> str:
    body = [HEADER, "## The CoMERA paper's claims, measured\n", claims_table()]
    for entry in SECTIONS:
        body.append(section(*entry))
    gpu = sorted(glob.glob(os.path.join(RESULTS, "gpu_*.md")))
    for p in gpu:
        body.append(section(os.path.basename(p)[:-3], "GPU: " + os.path.basename(p)[:-3]))
    return "\n".join(body)


START, END = "<!-- claims:start -->", "<!-- claims:end -->"


def update_top_readme(path: str) -> bool:
    """Replaces the claims table between the markers of the README at
    `path`; returns False (and leaves the file alone) without the markers."""
    with open(path) as fh:
        text = fh.read()
    if START not in text or END not in text:
        return False
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    with open(path, "w") as fh:
        fh.write(head + START + "\n" + claims_table() + END + tail)
    return True


def main(argv=None) -> int:
    text = build()
    with open(os.path.join(HERE, "README.md"), "w") as fh:
        fh.write(text)
    print(f"wrote benchmarks/README.md ({len(text.splitlines())} lines)")
    top = os.path.join(os.path.dirname(HERE), "README.md")
    if update_top_readme(top):
        print("updated the claims table in README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
