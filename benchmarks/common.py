"""Shared helpers for the benchmarks: peak memory (in this process and in a
subprocess with the thread count asked), case subprocesses and writing JSON +
Markdown results.  Timing and the machine record live in timing.py."""
import ctypes
import json
import os
import resource

from comera.ops import route


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


def with_env(fn, name, value):
    """fn with the environment variable ``name`` set to ``value`` for the
    call (returns fn's result)."""
    def run():
        os.environ[name] = value
        try:
            return fn()
        finally:
            del os.environ[name]
    return run


def pool_off(fn):
    """fn with comera's output pool switched off for the call: its large
    outputs come from torch's allocator (with the huge-page advice), as
    before the pool."""
    return with_env(fn, "COMERA_OUTPUT_POOL", "0")


def routed(fn):
    """fn with comera's routing to torch's BLAS switched on for the call
    (route mode "auto"; off by default, comera.ops.route)."""
    def run():
        previous = route.set_mode("auto")
        try:
            return fn()
        finally:
            route.set_mode(previous)
    return run


def max_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_memory_subprocess(module, case: dict, threads: int = 1, timeout=300):
    """Runs `python -m <module> --memory-case JSON --threads N` in a fresh
    process (OMP_NUM_THREADS=N too; the case asserts it) and returns the
    bytes it reports: the growth of the peak RSS during one measured step,
    over the RSS after its inputs were built."""
    from timing import threaded_subprocess
    out = threaded_subprocess(["-m", module, "--memory-case", json.dumps(case)], threads,
                              timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"memory subprocess failed: {out.stderr[-2000:]}")
    return int(out.stdout.strip().splitlines()[-1])


def write_results(name, payload, table_md, out_dir=None):
    out_dir = out_dir or RESULTS
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(payload, f, indent=2)
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write(table_md)
    print(table_md)


# --------------------------------------------------------------------------
# Whole-process memory accounting (training steps).

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


def case_subprocess(module, case: dict, threads: int, timeout=1800):
    """Runs `python -m <module> --case JSON --threads N` in a fresh process
    (so each method's memory is measured on its own) with OMP_NUM_THREADS=N
    (timing.threaded_subprocess), and returns the JSON object that the case
    prints on its last line of output.  The case asserts its thread count
    itself (timing.assert_threads) and reports it; a result that ran with
    any other count is refused here too."""
    from timing import threaded_subprocess
    out = threaded_subprocess(["-m", module, "--case", json.dumps(case)], threads, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"case {case} failed: {out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    got = {r.get("threads") for r in (res if isinstance(res, list) else [res])}
    if got != {threads}:
        raise RuntimeError(f"case {case} asked for {threads} threads but reported {sorted(map(str, got))}")
    return res



def on_grid_edge(chosen, tried) -> bool:
    """True when ``chosen`` is the smallest or largest of several rates
    ``tried``: the grid did not bracket that method's best rate.

    Example:
        >>> on_grid_edge(1e-2, [1e-3, 3e-3, 1e-2]), on_grid_edge(3e-3, [1e-3, 3e-3, 1e-2])
        (True, False)
    """
    return len(tried) > 1 and chosen in (min(tried), max(tried))


def edge_note(labels) -> str:
    """The line under a table naming the choices on the edge of their grid
    (labels such as ``"dense (0.001)"``), or '' when there is none.

    Example:
        >>> edge_note(["comera (0.01)"])
        'Chosen on the edge of the grid (a wider grid might choose otherwise): comera (0.01).'
    """
    if not labels:
        return ""
    return "Chosen on the edge of the grid (a wider grid might choose otherwise): " + ", ".join(labels) + "."
