"""Rebuild benchmarks/README.md from the results each benchmark wrote.

Every benchmark writes its own Markdown table (with the command that
reproduces it and the machine it ran on) under benchmarks/results/; this
script only gathers them, in a fixed order, with their PNG plots, so the
README can never disagree with the stored results.

    python benchmarks/make_readme.py          # after running the benchmarks
"""
import glob
import os
import sys

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
`tests/test_bench_smoke.py` runs.

The CPU results come from a shared 2-core virtual machine; its load average is recorded with
each run. The GPU script (`benchmarks/gpu_check.sh`) writes `gpu_*` results when it is run on a
GPU machine.
"""

# (result name, what it answers[, what to say while it is missing]).
SECTIONS = [
    ("peers_cpu", "comera against its peers (issue 8, part 1)"),
    ("transformer_cpu", "The paper's six-encoder transformer (issue 8, part 2)"),
    ("accuracy_cpu", "Accuracy against compression (issue 8, part 3)",
     "Not run yet: `python benchmarks/bench_accuracy.py` writes it (about 15 minutes on 2 cores)."),
    ("pretrain_cpu", "Pre-training, dense against CoMERA (issue 7)"),
    ("linear_cpu", "TTLinear against nn.Linear and the matmul merge path (issue 2)"),
    ("bench_embedding", "TTEmbedding against nn.Embedding (issue 3)"),
    ("prune_cpu", "Pruning: time against FLOPs (issue 4)"),
]


def demote(md: str) -> str:
    """Headings two levels down, so each result sits under its section."""
    out = []
    for line in md.splitlines():
        out.append("##" + line if line.startswith("#") else line)
    return "\n".join(out).strip() + "\n"


def section(name: str, title: str, missing: str = "") -> str:
    md_path = os.path.join(RESULTS, name + ".md")
    parts = [f"## {title}\n"]
    if not os.path.exists(md_path):
        parts.append((missing or f"Not run yet: `benchmarks/results/{name}.md` is missing.") + "\n")
        return "\n".join(parts)
    with open(md_path) as fh:
        parts.append(demote(fh.read()))
    pngs = sorted(glob.glob(os.path.join(RESULTS, name + "*.png")))
    already = set()
    for p in pngs:
        rel = "results/" + os.path.basename(p)
        if rel in parts[-1] or rel in already:
            continue
        already.add(rel)
        parts.append(f"![{os.path.basename(p)}]({rel})\n")
    return "\n".join(parts)


def build() -> str:
    body = [HEADER]
    for entry in SECTIONS:
        body.append(section(*entry))
    gpu = sorted(glob.glob(os.path.join(RESULTS, "gpu_*.md")))
    for p in gpu:
        body.append(section(os.path.basename(p)[:-3], "GPU: " + os.path.basename(p)[:-3]))
    return "\n".join(body)


def main(argv=None) -> int:
    text = build()
    with open(os.path.join(HERE, "README.md"), "w") as fh:
        fh.write(text)
    print(f"wrote benchmarks/README.md ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
