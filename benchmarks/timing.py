"""The one timing helper of the benchmarks: interleaved wall-clock medians and
the record of the machine they were measured on.

Rules it enforces (benchmarks/README.md, "How we measure"):

* wall clock is the headline; process CPU time is kept as an extra column;
* methods compared with each other are timed in the same process,
  interleaved (round r runs every method once, in an order shuffled by r), after a
  warm-up of each, so a change in machine load hits all of them alike;
* every figure is a median with its spread (min, max, interquartile range)
  and the number of repetitions;
* every result carries the machine record: CPU model, ISA flags, core count,
  torch version and BLAS, measured sgemm and copy rates, threads used, and
  the load average before and after.
"""
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

# ISA flags worth recording: they decide which micro-kernels can run.
_ISA = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
        "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def _spread(values: List[float]) -> Dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "iqr": q[2] - q[0], "reps": len(values)}


def interleaved(methods: Dict[str, Callable[[], object]], *, reps: int = 7, warmup: int = 2,
                budget_s: Optional[float] = None) -> Dict[str, Dict[str, object]]:
    """Times every method of ``methods`` (name -> zero-argument callable) in
    rounds: each round calls every method once, in an order shuffled anew
    each round (seeded by the round, so runs repeat): with a rotating order
    every method kept the same predecessor, and a step right after one that
    churns the caches (a dense layer's large gradients) was measured slower
    every time, whatever it was.  Stops after ``reps`` rounds, or earlier once ``budget_s``
    seconds have passed (at least 3 rounds whenever possible).

    Returns per method ``{"wall": {median, min, max, iqr, reps}, "cpu": {...},
    "samples": [...]}`` in seconds; ``cpu`` is process CPU time over all
    threads, ``samples`` the wall times in round order (for paired_ratio).

    Example:
        >>> r = interleaved({"a": lambda: sum(range(1000)), "b": lambda: None}, reps=3)
        >>> sorted(r), r["a"]["wall"]["reps"]
        (['a', 'b'], 3)
    """
    if not methods:
        raise ValueError("interleaved: methods must name at least one callable")
    names = list(methods)
    for name in names:
        for _ in range(warmup):
            methods[name]()
    wall: Dict[str, List[float]] = {n: [] for n in names}
    cpu: Dict[str, List[float]] = {n: [] for n in names}
    start = time.perf_counter()
    for r in range(reps):
        order = list(names)
        random.Random(r).shuffle(order)
        for name in order:
            c0, t0 = time.process_time(), time.perf_counter()
            methods[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
        if budget_s is not None and r >= 2 and time.perf_counter() - start > budget_s:
            break
    return {n: {"wall": _spread(wall[n]), "cpu": _spread(cpu[n]), "samples": wall[n]}
            for n in names}


def paired_ratio(num: List[float], den: List[float], *, boots: int = 2000,
                 seed: int = 0) -> Dict[str, float]:
    """The ratio of two methods timed in the same rounds of ``interleaved``:
    the median of the per-round ratios num[r] / den[r], and a bootstrap 95%
    interval of that median (``boots`` resamples, seeded).  A round's two
    times share the machine's state, so their ratio moves less than either
    time; the interval says whether a ratio near a target is distinguishable
    from it.

    Example:
        >>> r = paired_ratio([3.0, 3.3, 2.9, 3.1], [1.0, 1.1, 1.0, 1.0])
        >>> r["median"], r["lo"] <= r["median"] <= r["hi"], r["rounds"]
        (3.0, True, 4)
    """
    if len(num) != len(den) or not num:
        raise ValueError(f"paired_ratio: needs two equal, non-empty lists of round times, got "
                         f"{len(num)} and {len(den)}")
    ratios = [a / b for a, b in zip(num, den)]
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(boots))
    return {"median": statistics.median(ratios), "lo": meds[int(0.025 * boots)],
            "hi": meds[min(boots - 1, int(0.975 * boots))], "rounds": len(ratios)}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def isa_flags() -> List[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in _ISA if flag in have]
    except OSError:
        pass
    return []


def torch_blas() -> str:
    """torch's BLAS, as ``torch.__config__.show()`` names it: the library
    lines (MKL, oneDNN, OpenBLAS), the CPU capability in use, and the
    BLAS_INFO / LAPACK_INFO build settings."""
    keep = []
    for line in torch.__config__.show().splitlines():
        line = line.strip(" -")
        if line.startswith("Build settings:"):
            keep += [kv.strip() for kv in line[len("Build settings:"):].split(",")
                     if kv.strip().startswith(("BLAS_INFO=", "LAPACK_INFO="))]
        elif any(k in line for k in ("Math Kernel Library", "MKL-DNN", "OpenBLAS",
                                     "CPU capability")):
            keep.append(line)
    return "; ".join(keep)


def sgemm_rate(n: int = 2048) -> float:
    """Measured float32 GEMM rate of torch's BLAS, FLOP/s (median of 5)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = interleaved({"mm": lambda: torch.mm(a, b)}, reps=5)["mm"]["wall"]["median"]
    return 2.0 * n ** 3 / t


def copy_rate(nbytes: int = 256 << 20) -> float:
    """Measured copy bandwidth, bytes/s read + written (median of 7)."""
    src = torch.empty(nbytes // 4).uniform_()
    dst = torch.empty_like(src)
    t = interleaved({"copy": lambda: dst.copy_(src)}, reps=7)["copy"]["wall"]["median"]
    return 2.0 * nbytes / t


# Environment variables that limit the instruction sets the libraries use:
# comera's kernel variant, MKL's code path, torch's own kernels.
ISA_LIMITS = ("COMERA_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")


def isa_limits() -> Dict[str, str]:
    """The ISA-limiting variables set in this process (empty: none)."""
    return {k: os.environ[k] for k in ISA_LIMITS if os.environ.get(k)}


def machine_record(*, measure: bool = True) -> Dict[str, object]:
    """What a reader needs to judge a figure: CPU, ISA, torch and its BLAS,
    measured sgemm/copy rates (``measure=False`` skips them), threads, load,
    and any ISA limit set through the environment."""
    rec = {
        "cpu_model": cpu_model(), "isa": isa_flags(), "cores": os.cpu_count(),
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "torch_blas": torch_blas(),
        "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
        "load_before": list(os.getloadavg()),
    }
    limits = isa_limits()
    if limits:
        rec["isa_limits"] = limits
    if measure:
        rec["sgemm_flops_per_s"] = sgemm_rate()
        rec["copy_bytes_per_s"] = copy_rate()
    return rec


def finish_record(rec: Dict[str, object]) -> Dict[str, object]:
    """Adds the load average at the end of the run."""
    rec["load_after"] = list(os.getloadavg())
    return rec


def machine_line(rec: Dict[str, object]) -> str:
    """One Markdown line describing the machine record."""
    parts = [f"{rec['cpu_model']} ({rec['cores']} cores; {', '.join(rec['isa']) or 'no ISA flags read'})",
             f"{rec['threads']} threads", f"torch {rec['torch']} ({rec['torch_blas']})"]
    if rec.get("isa_limits"):
        parts.append("instruction sets limited by " + ", ".join(
            f"{k}={v}" for k, v in rec["isa_limits"].items()))
    if "sgemm_flops_per_s" in rec:
        parts.append(f"sgemm {rec['sgemm_flops_per_s'] / 1e9:.0f} GFLOP/s, "
                     f"copy {rec['copy_bytes_per_s'] / 1e9:.1f} GB/s (measured in this run)")
    load = f"load {rec['load_before'][0]:.2f}"
    if "load_after" in rec:
        load += f" -> {rec['load_after'][0]:.2f}"
    parts.append(load)
    return "Machine: " + "; ".join(parts) + "."


def threaded_subprocess(args: List[str], threads: int, *, timeout: float = 1800,
                        cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """Runs ``python <args> --threads N`` with OMP_NUM_THREADS=N too, so a
    case really runs with the thread count asked (the case itself asserts it
    with :func:`assert_threads`)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, *args, "--threads", str(threads)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=cwd or here)


def assert_threads(threads: int) -> None:
    """Sets torch's intra-op threads and fails loudly if they did not take."""
    torch.set_num_threads(threads)
    got = torch.get_num_threads()
    if got != threads:
        raise RuntimeError(f"asked for {threads} threads, torch runs {got}")
