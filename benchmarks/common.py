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


def write_results(name, payload, table_md, out_dir=None):
    out_dir = out_dir or RESULTS
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(payload, f, indent=2)
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write(table_md)
    print(table_md)


# --------------------------------------------------------------------------
# Whole-process memory accounting (training steps) and bounded timing.

def rss_bytes():
    """The process's current resident set size."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes():
    """The process's peak RSS since start or since the last reset_peak_rss()
    (VmHWM; falls back to ru_maxrss where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return max_rss_bytes()


def reset_peak_rss():
    """Resets VmHWM to the current RSS (Linux >= 4.0), so that the peak of a
    later phase is not hidden by an earlier one (model construction, say).
    Returns False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_freed_memory():
    """Returns freed heap memory to the OS (glibc malloc_trim), so that memory
    freed after building a model does not count as resident afterwards."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def time_bounded(fn, *, reps=5, budget_s=60.0, min_reps=0):
    """Times fn() without letting a slow method eat the run: the first call is
    the warm-up; then calls are repeated until `reps` are done or `budget_s`
    seconds have passed, but at least `min_reps` of them (and at least one
    unless the warm-up alone took longer than the budget).

    Returns {"median_s", "cpu_median_s", "reps", "first_s", "first_cpu_s"}:
    wall-clock and process CPU time (all threads; on a machine shared with
    other jobs the CPU time of a one-thread run is the stable measure of the
    work done).  reps 0 means only the warm-up was timed, and the medians
    are its times."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
    times, cpu = [], []
    if first <= budget_s or min_reps > 0:
        start = time.perf_counter()
        while len(times) < reps:
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            if time.perf_counter() - start >= budget_s and len(times) >= min_reps:
                break
    return {"median_s": statistics.median(times) if times else first,
            "cpu_median_s": statistics.median(cpu) if cpu else first_cpu,
            "reps": len(times), "first_s": first, "first_cpu_s": first_cpu}


def case_subprocess(module, case: dict, timeout=1800):
    """Runs `python -m <module> --case JSON` in a fresh process (so each
    method's memory is measured on its own) and returns the JSON object that
    the case prints on its last line of output."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-m", module, "--case", json.dumps(case)],
                         capture_output=True, text=True, timeout=timeout, env=env, cwd=here)
    if out.returncode != 0:
        raise RuntimeError(f"case {case} failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
