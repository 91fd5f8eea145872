"""GPU benchmarks (run by benchmarks/gpu_check.sh on the GPU machine).

    python benchmarks/gpu_bench.py --out DIR                   # on a GPU, ~3 minutes
    python benchmarks/gpu_bench.py --out DIR --device cpu --tiny   # dry run of the logic

Measures, each against its baseline in the same run:
  * linear: forward+backward of comera.TTLinear, nn.Linear, and the merge path
    written with torch.matmul (bench_linear.py's MatmulMerge), at bench_linear's
    shapes, 4096 rows, bfloat16 and float32; eager and as a replayed CUDA graph.
  * embedding: comera.TTEmbedding against nn.Embedding, forward+backward of a
    32 x 128 batch of token ids (when comera has TTEmbedding), on comera's
    CUDA kernels; eager with and without capturable=True (the default checks
    the indices with one host sync per call), and capturable as a CUDA graph.
  * transformer: one training step (forward, backward, AdamW) of a six-encoder
    transformer (768 hidden, 3072 FFN, 12 heads, batch 32 x 128, bf16 autocast),
    dense nn.Linear against comera.TTLinear in every encoder projection, eager
    and with the whole step captured in a CUDA graph; also with a TTEmbedding
    for the token table (capturable=True in the graph case).
Writes DIR/gpu_bench.json and DIR/gpu_bench.md (ratios and the speed targets).
Times are medians over repeated loops, in milliseconds per step.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import comera

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_linear import MatmulMerge  # noqa: E402

LINEAR_SHAPES = [(768, 768), (768, 3072), (3072, 768)]  # bench_linear's
RANK = 30
TARGET_LINEAR = {"in": 768, "out": 3072, "rank": 30, "rows": 4096, "dtype": "bfloat16", "x": 5.0}
TARGET_TRANSFORMER_X = 2.0


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


# ------------------------------------------------------------------- linear
def linear_module(method, in_f, out_f, rank, device, dtype):
    torch.manual_seed(0)
    if method == "nn.Linear":
        m = nn.Linear(in_f, out_f)
    else:
        layer = comera.TTLinear(in_f, out_f, rank=rank)
        m = layer if method == "comera.TTLinear" else MatmulMerge(layer)
    return m.to(device=device, dtype=dtype)


def linear_step(module, x, gy):
    params = list(module.parameters())

    def run():
        for p in params:
            p.grad = None
        x.grad = None
        module(x).backward(gy)
    return run


def bench_linear(args, device, budget):
    rows = args.rows
    shapes = [(48, 96)] if args.tiny else LINEAR_SHAPES
    rank = 4 if args.tiny else RANK
    dtypes = [torch.float32] if device.type == "cpu" else [torch.bfloat16, torch.float32]
    modes = ["eager"] + (["graph"] if device.type == "cuda" else [])
    methods = ["nn.Linear", "comera.TTLinear", "matmul merge"]
    out = []
    for dtype in dtypes:
        for in_f, out_f in shapes:
            for mode in modes:
                case = {"in": in_f, "out": out_f, "rank": rank, "rows": rows,
                        "dtype": str(dtype).replace("torch.", ""), "mode": mode, "ms": {}}
                if budget.left() < 5:
                    case["skipped"] = "time budget spent"
                    out.append(case)
                    continue
                for method in methods:
                    m = linear_module(method, in_f, out_f, rank, device, dtype)
                    if method == "comera.TTLinear":
                        case["ranks"] = m.ranks
                        case["plan"] = m.plan(rows)["path"]
                    x = torch.randn(rows, in_f, device=device, dtype=dtype, requires_grad=True)
                    gy = torch.randn(rows, out_f, device=device, dtype=dtype)
                    fn = linear_step(m, x, gy)
                    if mode == "graph":
                        fn = graphed(fn, device)
                    case["ms"][method] = time_ms(fn, device, warmup=args.warmup,
                                                 loops=args.loops, inner=args.inner)
                base = case["ms"]["nn.Linear"]
                case["x_vs_nn_linear"] = {k: base / v for k, v in case["ms"].items()}
                out.append(case)
                print("linear", json.dumps(case), flush=True)
    return out


# ---------------------------------------------------------------- embedding
def bench_embedding(args, device, budget):
    if not hasattr(comera, "TTEmbedding"):
        return [{"skipped": "comera.TTEmbedding is not in this build"}]
    vocab, dim = (1000, 32) if args.tiny else (30522, 768)
    batch, seq = (4, 16) if args.tiny else (32, 128)
    out = []
    for mode in ["eager"] + (["graph"] if device.type == "cuda" else []):
        case = {"num_embeddings": vocab, "embedding_dim": dim, "tokens": batch * seq,
                "mode": mode, "ms": {}, "cuda_kernels": embedding_has_cuda_kernels()}
        if budget.left() < 5:
            case["skipped"] = "time budget spent"
            out.append(case)
            continue
        idx = torch.randint(0, vocab, (batch, seq), device=device)
        gy = torch.randn(batch, seq, dim, device=device)
        # a graph cannot hold the host-side index check: capturable only
        names = (["nn.Embedding", "comera.TTEmbedding"] if mode == "graph" else
                 ["nn.Embedding", "comera.TTEmbedding", "comera.TTEmbedding capturable"])
        for name in names:
            torch.manual_seed(0)
            try:
                m = (nn.Embedding(vocab, dim) if name == "nn.Embedding"
                     else comera.TTEmbedding(vocab, dim, rank=4 if args.tiny else RANK,
                                             capturable=mode == "graph" or "capturable" in name)
                     ).to(device)
                params = list(m.parameters())

                def run():
                    for p in params:
                        p.grad = None
                    m(idx).backward(gy)
                fn = graphed(run, device) if mode == "graph" else run
                case["ms"][name] = time_ms(fn, device, warmup=args.warmup, loops=args.loops,
                                           inner=args.inner)
            except Exception as e:  # e.g. a lookup that cannot be captured
                case.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:300]
        if "nn.Embedding" in case["ms"] and "comera.TTEmbedding" in case["ms"]:
            case["x_vs_nn_embedding"] = case["ms"]["nn.Embedding"] / case["ms"]["comera.TTEmbedding"]
        out.append(case)
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
    if kind == "dense":
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


def bench_transformer(args, device, budget):
    cfg = transformer_config(args)
    kinds = ["dense", "comera"] + (["comera+tt_embedding"] if hasattr(comera, "TTEmbedding") else [])
    modes = ["eager"] + (["graph"] if device.type == "cuda" else [])
    amp = torch.bfloat16 if device.type == "cuda" else None
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), device=device)
    labels = torch.randint(0, 3, (cfg["batch"],), device=device)
    out = []
    for mode in modes:
        case = {"config": cfg, "mode": mode, "autocast": str(amp).replace("torch.", ""),
                "ms": {}, "params": {}, "peak_mb": {}}
        for kind in kinds:
            if budget.left() < 20:
                case.setdefault("skipped", []).append(kind)
                continue
            try:
                model = build_transformer(kind, cfg, device, capturable=mode == "graph")
                case["params"][kind] = sum(p.numel() for p in model.parameters())
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4,
                                        capturable=device.type == "cuda")

                def step():
                    opt.zero_grad(set_to_none=True)
                    with torch.autocast(device.type, dtype=amp, enabled=amp is not None,
                                        cache_enabled=False):  # required for graph capture
                        loss = F.cross_entropy(model(ids), labels)
                    loss.backward()
                    opt.step()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                fn = graphed(step, device) if mode == "graph" else step
                case["ms"][kind] = time_ms(fn, device, warmup=args.warmup,
                                           loops=max(3, args.loops // 2), inner=max(1, args.inner // 5))
                if device.type == "cuda":
                    case["peak_mb"][kind] = torch.cuda.max_memory_allocated(device) / 2 ** 20
                del model, opt, fn
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            except Exception as e:
                case.setdefault("errors", {})[kind] = f"{type(e).__name__}: {e}"[:300]
        if "dense" in case["ms"]:
            case["x_vs_dense"] = {k: case["ms"]["dense"] / v for k, v in case["ms"].items()}
        out.append(case)
        print("transformer", json.dumps(case), flush=True)
    return out


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


def targets(result):
    """The two speed targets (TARGET_LINEAR, the six-encoder step), read off
    the measured cases."""
    t = TARGET_LINEAR
    out = []
    for mode in ("eager", "graph"):
        for c in result["linear"]:
            if (c.get("in"), c.get("out"), c.get("rank"), c.get("rows"), c.get("dtype"),
                    c.get("mode")) == (t["in"], t["out"], t["rank"], t["rows"], t["dtype"], mode) \
                    and "x_vs_nn_linear" in c:
                x = c["x_vs_nn_linear"]["comera.TTLinear"]
                out.append({"target": f"TTLinear {t['in']}->{t['out']} rank {t['rank']}, "
                                      f"{t['rows']} rows, {t['dtype']}, fwd+bwd ({mode})",
                            "want_x": t["x"], "got_x": x, "met": x >= t["x"]})
        for c in result["transformer"]:
            cfg = c.get("config", {"d": 768, "layers": 6})  # the six-encoder model only
            if (c.get("mode") == mode and "comera" in c.get("x_vs_dense", {}) and
                    (cfg["d"], cfg["layers"]) == (768, 6)):
                x = c["x_vs_dense"]["comera"]
                out.append({"target": f"six-encoder training step, comera vs dense ({mode})",
                            "want_x": TARGET_TRANSFORMER_X, "got_x": x,
                            "met": x >= TARGET_TRANSFORMER_X})
    return out


def markdown(result):
    m = result["machine"]
    lines = [f"# comera GPU benchmarks: {m.get('gpu') or m.get('processor')}, {m['date']}", "",
             f"torch {m['torch']} (CUDA {m['cuda']}), Python {m['python']}; "
             "times are ms per forward+backward (linear, embedding) or per training step "
             "(transformer), medians; x = baseline time / this time.", "",
             "## Targets", "", "| target | want | got | met |", "|---|---|---|---|"]
    for t in result["targets"]:
        lines.append(f"| {t['target']} | >= {t['want_x']:.1f}x | {t['got_x']:.2f}x | "
                     f"{'yes' if t['met'] else 'no'} |")
    lines += ["", "## TTLinear (rows x in -> out)", "",
              "| dtype | mode | in -> out | rank | path | nn.Linear ms | TTLinear ms | "
              "matmul merge ms | TTLinear x | matmul merge x |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["linear"]:
        if "skipped" in c:
            lines.append(f"| {c['dtype']} | {c['mode']} | {c['in']} -> {c['out']} | {c['rank']} | "
                         f"skipped: {c['skipped']} | | | | | |")
            continue
        ms, x = c["ms"], c["x_vs_nn_linear"]
        lines.append(f"| {c['dtype']} | {c['mode']} | {c['in']} -> {c['out']} | {c['rank']} | "
                     f"{c.get('plan', '')} | {ms['nn.Linear']:.4f} | {ms['comera.TTLinear']:.4f} | "
                     f"{ms['matmul merge']:.4f} | {x['comera.TTLinear']:.2f} | {x['matmul merge']:.2f} |")
    lines += ["", "## TTEmbedding", ""]
    for c in result["embedding"]:
        if "ms" not in c:
            lines.append(f"- skipped: {c.get('skipped')}")
            continue
        lines.append(f"- {c['mode']}: {c['num_embeddings']} x {c['embedding_dim']}, "
                     f"{c['tokens']} tokens: " +
                     ", ".join(f"{k} {v:.4f} ms" for k, v in c["ms"].items()) +
                     (f"; TTEmbedding {c['x_vs_nn_embedding']:.2f}x" if "x_vs_nn_embedding" in c else "") +
                     (f"; errors {c['errors']}" if "errors" in c else ""))
    lines += ["", "## Transformer training step", ""]
    for c in result["transformer"]:
        cfg = c["config"]
        lines.append(f"- {c['mode']} ({cfg['layers']} encoders, d {cfg['d']}, FFN {cfg['ff']}, "
                     f"{cfg['heads']} heads, batch {cfg['batch']} x {cfg['seq']}, rank {cfg['rank']}, "
                     f"autocast {c['autocast']}): " +
                     ", ".join(f"{k} {v:.3f} ms ({c['params'][k] / 1e6:.1f}M params"
                               + (f", peak {c['peak_mb'][k]:.0f} MB" if k in c["peak_mb"] else "")
                               + f", {c['x_vs_dense'][k]:.2f}x)" for k, v in c["ms"].items()) +
                     (f"; skipped {c['skipped']}" if "skipped" in c else "") +
                     (f"; errors {c['errors']}" if "errors" in c else ""))
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for gpu_bench.json and gpu_bench.md")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes and few repetitions")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--only", default="linear,embedding,transformer")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch.cuda.is_available() is False")
    args.rows = 64 if args.tiny else 4096
    args.warmup, args.loops, args.inner = (1, 3, 2) if args.tiny else (3, 7, 20)
    budget = Budget(args.budget_s)
    only = set(args.only.split(","))
    result = {"machine": machine(device), "args": {k: v for k, v in vars(args).items()}}
    result["linear"] = bench_linear(args, device, budget) if "linear" in only else []
    result["transformer"] = bench_transformer(args, device, budget) if "transformer" in only else []
    # last: a lookup that fails inside a graph capture must not spoil the others
    result["embedding"] = bench_embedding(args, device, budget) if "embedding" in only else []
    result["targets"] = targets(result)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump(result, f, indent=2)
    md = markdown(result)
    with open(os.path.join(args.out, "gpu_bench.md"), "w") as f:
        f.write(md)
    print(md)
    return result


if __name__ == "__main__":
    main()
