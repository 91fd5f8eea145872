"""GPU benchmarks (run by benchmarks/gpu_check.sh on the GPU machine, one
section per process so that each has its own timeout).

    python benchmarks/gpu_bench.py --out DIR --only linear        # on a GPU
    python benchmarks/gpu_bench.py --out DIR --device cpu --tiny  # dry run of the logic
    python benchmarks/gpu_bench.py --out DIR --pretrain dense=RUN/metrics.json ...
    python benchmarks/gpu_bench.py --out DIR --merge-only

Measures, each against nn.Linear / nn.Embedding / dense and against the
same dense model under torch.compile, in the same run:
  * linear: forward+backward of comera.TTLinear 768 -> 3072 at rank 32 on
    4096 rows of bfloat16, eager and as a replayed CUDA graph, beside the GPU
    cost model's prediction (comera.ops.gpu_cost);
  * embedding: forward+backward of comera.TTEmbedding(30522, 768, rank 32) on
    32 x 128 token ids; eager (the default layer checks the indices with one
    host sync per call, capturable=True does not) and capturable as a graph;
  * transformer: one training step (forward, backward, AdamW) of a
    six-encoder transformer (768 hidden, 3072 FFN, 12 heads, batch 32 x 128,
    bf16 autocast), TTLinear in every encoder projection, eager and with the
    whole step captured in a CUDA graph; also with a TTEmbedding token table;
  * pretrain: tokens/s of `comera pretrain` runs, read from their
    metrics.json (overall, and steady: after the first logged step, which
    holds torch.compile's compilation).
Each section writes DIR/gpu_bench_<section>.json after every case; every
call then merges the sections present into DIR/gpu_bench.json and
DIR/gpu_bench.md (ratios and the speed targets).  Times are medians over
repeated loops, in milliseconds per step; x = baseline time / this time.
"""
import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import comera
from comera.ops import gpu_cost

SECTIONS = ("linear", "embedding", "transformer")
RANK = 32
LINEAR = {"in": 768, "out": 3072, "rank": RANK, "rows": 4096, "dtype": "bfloat16"}
LINEAR_TINY = {"in": 48, "out": 96, "rank": 4, "rows": 64, "dtype": "float32"}
# the speed targets, as (section, mode) -> least x against the plain dense baseline
TARGETS = {("linear", "eager"): 1.5, ("linear", "graph"): 2.0,
           ("embedding", "eager"): 1.0, ("embedding", "graph"): 1.0,
           ("transformer", "eager"): 1.3, ("transformer", "graph"): 1.3,
           ("pretrain", "eager"): 1.3, ("pretrain", "graph"): 1.3}
COMPILED = " compiled"  # suffix of the torch.compile'd dense baselines


class Budget:
    """Wall-clock budget: cases past it are recorded as skipped, not run."""

    def __init__(self, seconds):
        self.end = time.monotonic() + seconds

    def left(self):
        return self.end - time.monotonic()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, *, warmup, loops, inner):
    """Median over `loops` of the mean time of `inner` back-to-back calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(loops):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(times)


def graphed(step, device, warmup=3):
    """Captures step() (which must only touch static tensors) in a CUDA graph
    and returns its replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def gpu_name(device):
    """The cost model's entry for this GPU (H200 when it has none, or on the CPU)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    try:
        return gpu_cost.gpu_spec(name).name, name
    except ValueError:
        return gpu_cost.GPUS["H200"].name, name


def ratios(ms, base, compiled):
    """x against the plain and the compiled baseline, for every timed method."""
    out = {"x_vs_dense": {k: ms[base] / v for k, v in ms.items()} if base in ms else {}}
    if compiled in ms:
        out["x_vs_compiled"] = {k: ms[compiled] / v for k, v in ms.items()}
    return out


def run_case(case, name, make_step, device, mode, args):
    """Times make_step() (eager, or replayed as a CUDA graph) into case["ms"][name];
    a failure is recorded under case["errors"] instead."""
    try:
        fn = make_step()
        if mode == "graph":
            fn = graphed(fn, device)
        case["ms"][name] = time_ms(fn, device, warmup=args.warmup, loops=args.loops,
                                   inner=args.inner)
    except Exception as e:  # e.g. a capture that fails: the other methods still run
        case.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:300]


def modes(device):
    return ["eager"] + (["graph"] if device.type == "cuda" else [])


# ------------------------------------------------------------------- linear
def bench_linear(args, device, budget, save):
    spec = LINEAR_TINY if args.tiny else LINEAR
    dtype = getattr(torch, spec["dtype"])
    in_f, out_f, rank, rows = spec["in"], spec["out"], spec["rank"], spec["rows"]
    out = []
    for mode in modes(device):
        case = dict(spec, mode=mode, ms={})
        if budget.left() < 5:
            case["skipped"] = "time budget spent"
            out.append(case)
            save(out)
            continue
        for method in ("nn.Linear", "nn.Linear" + COMPILED, "comera.TTLinear"):
            torch.manual_seed(0)
            m = (comera.TTLinear(in_f, out_f, rank=rank) if method == "comera.TTLinear"
                 else nn.Linear(in_f, out_f)).to(device=device, dtype=dtype)
            if method == "comera.TTLinear":
                case["ranks"] = m.ranks
                plan = gpu_cost.tt_linear_gpu_plan(m.in_shape, m.out_shape, [1] + m.ranks + [1],
                                                   in_f, out_f, rows, dtype, gpu=args.gpu)
                case["predicted_ms"] = {"gpu": plan["gpu"], "comera.TTLinear": plan["seconds"] * 1e3,
                                        "nn.Linear": plan["dense"]["seconds"] * 1e3,
                                        "launches": plan["forward"]["launches"]["kernel"] +
                                        plan["backward"]["launches"]["kernel"]}
            if method.endswith(COMPILED):
                m = torch.compile(m, backend=args.compile_backend)
            x = torch.randn(rows, in_f, device=device, dtype=dtype, requires_grad=True)
            gy = torch.randn(rows, out_f, device=device, dtype=dtype)
            params = list(m.parameters())

            def make_step(m=m, x=x, gy=gy, params=params):
                def step():
                    for p in params:
                        p.grad = None
                    x.grad = None
                    m(x).backward(gy)
                return step
            run_case(case, method, make_step, device, mode, args)
        case.update(ratios(case["ms"], "nn.Linear", "nn.Linear" + COMPILED))
        out.append(case)
        save(out)
        print("linear", json.dumps(case), flush=True)
    return out


# ---------------------------------------------------------------- embedding
def bench_embedding(args, device, budget, save):
    vocab, dim, rank = (1000, 32, 4) if args.tiny else (30522, 768, RANK)
    batch, seq = (4, 16) if args.tiny else (32, 128)
    out = []
    for mode in modes(device):
        case = {"num_embeddings": vocab, "embedding_dim": dim, "rank": rank,
                "tokens": batch * seq, "mode": mode, "ms": {},
                "cuda_kernels": embedding_has_cuda_kernels()}
        if budget.left() < 5:
            case["skipped"] = "time budget spent"
            out.append(case)
            save(out)
            continue
        idx = torch.randint(0, vocab, (batch, seq), device=device)
        gy = torch.randn(batch, seq, dim, device=device)
        # a graph cannot hold the host-side index check: capturable only
        names = ["nn.Embedding", "nn.Embedding" + COMPILED, "comera.TTEmbedding capturable"]
        if mode == "eager":
            names.insert(2, "comera.TTEmbedding")
        for name in names:
            torch.manual_seed(0)
            if name.startswith("nn."):
                m = nn.Embedding(vocab, dim).to(device)
            else:
                m = comera.TTEmbedding(vocab, dim, rank=rank,
                                       capturable="capturable" in name).to(device)
            if name.endswith(COMPILED):
                m = torch.compile(m, backend=args.compile_backend)
            params = list(m.parameters())

            def make_step(m=m, params=params):
                def step():
                    for p in params:
                        p.grad = None
                    m(idx).backward(gy)
                return step
            run_case(case, name, make_step, device, mode, args)
        tt = comera.TTEmbedding(vocab, dim, rank=rank)
        plan = gpu_cost.tt_embedding_gpu_cost(tt.row_shape, tt.dim_shape, [1] + tt.ranks + [1],
                                              vocab, dim, batch * seq, reuse=tt.reuse, gpu=args.gpu)
        case["predicted_ms"] = {"gpu": plan["gpu"], "comera.TTEmbedding": plan["seconds"] * 1e3}
        case.update(ratios(case["ms"], "nn.Embedding", "nn.Embedding" + COMPILED))
        out.append(case)
        save(out)
        print("embedding", json.dumps(case), flush=True)
    return out


def embedding_has_cuda_kernels():
    """Whether this build registers comera's CUDA kernels for the lookup ops."""
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"comera::{op}", "CUDA")
               for op in ("tt_embedding", "tt_embedding_backward"))


# -------------------------------------------------------------- transformer
class Encoder(nn.Module):
    """Pre-LN encoder block; every projection comes from make_linear."""

    def __init__(self, d, ff, heads, make_linear):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (make_linear(d, d) for _ in range(4))
        self.ff1, self.ff2 = make_linear(d, ff), make_linear(ff, d)

    def forward(self, x):
        b, s, d = x.shape
        h = self.ln1(x)
        split = lambda t: t.view(b, s, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)))
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))


class Classifier(nn.Module):
    def __init__(self, vocab, d, ff, heads, layers, seq, make_linear, make_embedding):
        super().__init__()
        self.tok = make_embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Encoder(d, ff, heads, make_linear) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 3)

    def forward(self, ids):
        x = self.tok(ids) + self.pos.weight[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x).mean(dim=1))


def transformer_config(args):
    if args.tiny:
        return dict(vocab=1000, d=64, ff=256, heads=4, layers=2, batch=4, seq=16, rank=4)
    return dict(vocab=30522, d=768, ff=3072, heads=12, layers=6, batch=32, seq=128, rank=RANK)


def build_transformer(kind, cfg, device, capturable=False):
    torch.manual_seed(0)
    if kind.startswith("dense"):
        make_linear = nn.Linear
    else:
        def make_linear(i, o):
            return comera.TTLinear(i, o, rank=cfg["rank"])
    make_embedding = nn.Embedding
    if kind == "comera+tt_embedding":
        def make_embedding(v, d):
            return comera.TTEmbedding(v, d, rank=cfg["rank"], capturable=capturable)
    model = Classifier(cfg["vocab"], cfg["d"], cfg["ff"], cfg["heads"], cfg["layers"], cfg["seq"],
                       make_linear, make_embedding)
    return model.to(device)


def bench_transformer(args, device, budget, save):
    cfg = transformer_config(args)
    kinds = ["dense", "dense" + COMPILED, "comera", "comera+tt_embedding"]
    amp = torch.bfloat16 if device.type == "cuda" else None
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), device=device)
    labels = torch.randint(0, 3, (cfg["batch"],), device=device)
    out = []
    for mode in modes(device):
        case = {"config": cfg, "mode": mode, "autocast": str(amp).replace("torch.", ""),
                "ms": {}, "params": {}, "peak_mb": {}}
        for kind in kinds:
            if budget.left() < 20:
                case.setdefault("skipped", []).append(kind)
                continue
            model = build_transformer(kind, cfg, device, capturable=mode == "graph")
            case["params"][kind] = sum(p.numel() for p in model.parameters())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=device.type == "cuda")
            run_model = (torch.compile(model, backend=args.compile_backend)
                         if kind.endswith(COMPILED) else model)

            def make_step(run_model=run_model, opt=opt):
                def step():
                    opt.zero_grad(set_to_none=True)
                    with torch.autocast(device.type, dtype=amp, enabled=amp is not None,
                                        cache_enabled=False):  # required for graph capture
                        loss = F.cross_entropy(run_model(ids), labels)
                    loss.backward()
                    opt.step()
                return step
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            inner = args
            if not args.tiny:  # a training step is long: fewer repetitions
                inner = argparse.Namespace(warmup=args.warmup, loops=max(3, args.loops // 2),
                                           inner=max(1, args.inner // 5))
            run_case(case, kind, make_step, device, mode, inner)
            if device.type == "cuda":
                case["peak_mb"][kind] = torch.cuda.max_memory_allocated(device) / 2 ** 20
            del model, opt, run_model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            save(out + [case])
        case.update(ratios(case["ms"], "dense", "dense" + COMPILED))
        out.append(case)
        save(out)
        print("transformer", json.dumps(case), flush=True)
    return out


# ----------------------------------------------------------------- pretrain
def steady_tokens_per_s(history):
    """Tokens/s between the first and the last logged step, from the running
    rates the pre-training loop logs (tokens so far / training time so far):
    leaves out what the first logged steps hold (torch.compile's compilation,
    the first CUDA kernels' loading).  None with fewer than two points."""
    points = [(s, r) for s, r in history.get("tokens_per_s", []) if r > 0]
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    (s1, r1), (s2, r2) = points[0], points[-1]
    seconds = s2 / r2 - s1 / r1  # in units of one step's tokens
    return (s2 - s1) / seconds if seconds > 0 else None


def pretrain_part(runs):
    """The pre-training figures from {name: metrics.json path} (name: the
    method, such as "dense", "comera" or "dense compiled")."""
    out = {"runs": {}, "tokens_per_s": {}, "mode": "eager"}  # "graph" once a run captured
    for name, path in runs.items():
        if not os.path.exists(path):
            out["runs"][name] = {"missing": path}
            continue
        with open(path) as f:
            metrics = json.load(f)
        method = name.split()[0]
        m = metrics["methods"][method]
        steady = steady_tokens_per_s(m.get("history", {}))
        out["runs"][name] = {"steps": m["steps_done"], "tokens_per_s": m["tokens_per_s"],
                             "steady_tokens_per_s": steady,
                             "compression_whole": m.get("compression_whole"),
                             "compile": metrics.get("environment", {}).get("compile", False),
                             # captured steps (comera pretrain --graph, the CUDA default)
                             "graph": m.get("graph")}
        out["tokens_per_s"][name] = steady or m["tokens_per_s"]
        if (m.get("graph") or {}).get("captures"):
            out["mode"] = "graph"
    tps = out["tokens_per_s"]
    # ratios of rates: this method's tokens/s over the baseline's
    if "dense" in tps:
        out["x_vs_dense"] = {k: v / tps["dense"] for k, v in tps.items()}
    if "dense" + COMPILED in tps:
        out["x_vs_compiled"] = {k: v / tps["dense" + COMPILED] for k, v in tps.items()}
    return [out]


# ------------------------------------------------------------------ report
def machine(device):
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d"), "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["gpu"] = None
        info["processor"] = platform.processor() or platform.machine()
    return info


SUBJECT = {"linear": "comera.TTLinear", "embedding": "comera.TTEmbedding",
           "transformer": "comera", "pretrain": "comera"}


def targets(result):
    """The speed targets (TARGETS), read off the measured cases: x against
    the plain dense baseline, and beside it x against the compiled one."""
    out = []
    for section in ("linear", "embedding", "transformer", "pretrain"):
        for c in result.get(section, []):
            want = TARGETS.get((section, c.get("mode")))
            subject = SUBJECT[section]
            if section == "embedding" and c.get("mode") == "graph":
                subject = "comera.TTEmbedding capturable"
            if section == "transformer" and c.get("config", {}).get("layers", 6) != 6:
                want = None  # the six-encoder model only
            got = c.get("x_vs_dense", {}).get(subject)
            if want is None or got is None:
                continue
            out.append({"target": f"{section} ({c['mode']}): {subject} vs dense", "want_x": want,
                        "got_x": got, "met": got >= want,
                        "x_vs_compiled": c.get("x_vs_compiled", {}).get(subject)})
    return out


def _fmt_ms(ms):
    return ", ".join(f"{k} {v:.4f} ms" for k, v in ms.items())


def _fmt_x(c):
    parts = []
    for key, label in (("x_vs_dense", "x dense"), ("x_vs_compiled", "x compiled")):
        if c.get(key):
            parts.append(f"{label}: " + ", ".join(f"{k} {v:.2f}" for k, v in c[key].items()))
    return "; ".join(parts)


def markdown(result):
    m = result["machine"]
    lines = [f"# comera GPU benchmarks: {m.get('gpu') or m.get('processor')}, {m['date']}", "",
             f"torch {m['torch']} (CUDA {m['cuda']}), Python {m['python']}; times are ms per "
             "forward+backward (linear, embedding) or per training step (transformer), medians; "
             "x = baseline time / this time (for pre-training: tokens/s over the baseline's); "
             "'compiled': the dense baseline under torch.compile.", "",
             "## Targets", "", "| target | want | got | x compiled dense | met |",
             "|---|---|---|---|---|"]
    for t in result["targets"]:
        xc = t.get("x_vs_compiled")
        lines.append(f"| {t['target']} | >= {t['want_x']:.1f}x | {t['got_x']:.2f}x | "
                     f"{'' if xc is None else f'{xc:.2f}x'} | {'yes' if t['met'] else 'no'} |")
    for section in ("linear", "embedding", "transformer"):
        lines += ["", f"## {section}", ""]
        if section in result.get("missing", []):
            lines.append("- not run, or stopped before its first case (see its log)")
        for c in result.get(section, []):
            head = {k: c[k] for k in ("in", "out", "rank", "rows", "dtype", "num_embeddings",
                                      "embedding_dim", "tokens") if k in c}
            if "config" in c:
                head = dict(c["config"], autocast=c["autocast"])
            text = f"- {c['mode']} {json.dumps(head)}: "
            if "skipped" in c:
                text += f"skipped: {c['skipped']}; "
            text += _fmt_ms(c.get("ms", {}))
            if _fmt_x(c):
                text += f"; {_fmt_x(c)}"
            if "predicted_ms" in c:
                text += f"; cost model ({c['predicted_ms']['gpu']}): " + ", ".join(
                    f"{k} {v:.4f} ms" if isinstance(v, float) else f"{k} {v}"
                    for k, v in c["predicted_ms"].items() if k != "gpu")
            if c.get("errors"):
                text += f"; errors {c['errors']}"
            lines.append(text)
    lines += ["", "## pretrain (comera pretrain, tokens/s)", ""]
    for c in result.get("pretrain", []):
        for name, r in c["runs"].items():
            lines.append(f"- {name}: " + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else
                                                   f"{k} {v}" for k, v in r.items()))
        if _fmt_x(c):
            lines.append(f"- {_fmt_x(c)}")
    if not result.get("pretrain"):
        lines.append("- not run")
    return "\n".join(lines) + "\n"


def merge(out_dir):
    """gpu_bench.json and gpu_bench.md from the section files in out_dir."""
    result = {"missing": []}
    for section in SECTIONS + ("pretrain",):
        path = os.path.join(out_dir, f"gpu_bench_{section}.json")
        if os.path.exists(path):
            with open(path) as f:
                part = json.load(f)
            result.setdefault("machine", part["machine"])
            result[section] = part["cases"]
        else:
            result[section] = []
            result["missing"].append(section)
    result.setdefault("machine", machine(torch.device("cpu")))
    result["targets"] = targets(result)
    with open(os.path.join(out_dir, "gpu_bench.json"), "w") as f:
        json.dump(result, f, indent=2)
    md = markdown(result)
    with open(os.path.join(out_dir, "gpu_bench.md"), "w") as f:
        f.write(md)
    return result, md


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the gpu_bench*.json and .md files")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes and few repetitions")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help="comma-separated sections to run (default: all)")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend of the dense baselines (the dry run: eager)")
    ap.add_argument("--gpu", default=None,
                    help="cost model entry for the predictions (default: this GPU's, else H200)")
    ap.add_argument("--pretrain", nargs="*", default=None, metavar="NAME=METRICS_JSON",
                    help="record comera pretrain runs (names: dense, comera, 'dense compiled') "
                         "instead of running sections")
    ap.add_argument("--merge-only", action="store_true", help="only merge the section files")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)
    if device.type == "cuda" and not torch.cuda.is_available() and not args.merge_only:
        ap.error("--device cuda but torch.cuda.is_available() is False")
    args.gpu = args.gpu or gpu_name(device)[0]
    args.warmup, args.loops, args.inner = (1, 2, 1) if args.tiny else (3, 7, 20)
    info = machine(device)

    def saver(section):
        def save(cases):
            with open(os.path.join(args.out, f"gpu_bench_{section}.json"), "w") as f:
                json.dump({"machine": info, "args": vars(args), "cases": cases}, f, indent=2)
        return save
    if args.pretrain is not None:
        runs = dict(item.split("=", 1) for item in args.pretrain)
        saver("pretrain")(pretrain_part(runs))
    elif not args.merge_only:
        budget = Budget(args.budget_s)
        bench = {"linear": bench_linear, "embedding": bench_embedding,
                 "transformer": bench_transformer}
        for section in args.only.split(","):
            bench[section](args, device, budget, saver(section))
    result, md = merge(args.out)
    print(md)
    return result


if __name__ == "__main__":
    main()
