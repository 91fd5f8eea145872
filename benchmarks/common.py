"""Shared helpers for the benchmarks: timing, peak memory in a subprocess,
machine calibration, and writing JSON + Markdown results."""
import ctypes
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch

def keep_freed_memory():
    """Keeps freed memory in glibc's heap instead of unmapping it, so that a
    fresh 50 MB activation does not pay ~12k page faults per step (as with
    jemalloc or tcmalloc, which PyTorch recommends for CPU training).  Applied
    once per benchmark process, so every method measured there gets it."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) and
                libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1))


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def time_fn(fn, *, warmup=2, reps=7, min_seconds=0.0):
    """Median wall time of fn() in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    t_end = time.perf_counter() + min_seconds
    while len(times) < reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 10 * reps:
            break
    return statistics.median(times)


def max_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_memory_subprocess(module, case: dict, timeout=300):
    """Runs `python -m <module> --memory-case JSON` in a fresh process and
    returns the bytes it reports: the growth of the peak RSS during one
    measured step, over the RSS after its inputs were built."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-m", module, "--memory-case", json.dumps(case)],
                         capture_output=True, text=True, timeout=timeout, env=env, cwd=here)
    if out.returncode != 0:
        raise RuntimeError(f"memory subprocess failed: {out.stderr[-2000:]}")
    return int(out.stdout.strip().splitlines()[-1])


def sgemm_flops(n=2048):
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = time_fn(lambda: torch.mm(a, b), warmup=2, reps=5)
    return 2.0 * n ** 3 / t


def copy_bandwidth(nbytes=256 << 20):
    src = torch.empty(nbytes // 4).uniform_()
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), warmup=2, reps=7)
    return 2.0 * nbytes / t  # read + write


def machine_info():
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d"),
    }


def write_results(name, payload, table_md):
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, name + ".json"), "w") as f:
        json.dump(payload, f, indent=2)
    with open(os.path.join(RESULTS, name + ".md"), "w") as f:
        f.write(table_md)
    print(table_md)
