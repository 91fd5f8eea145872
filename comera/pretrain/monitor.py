"""Run-time helpers for the training loop: a progress bar, peak memory, and
a clean stop on Ctrl-C."""
import ctypes
import gc
import os
import signal
import sys
import time
from typing import Optional

import torch


class Progress:
    """A one-line progress bar on a terminal (``\\r`` updates); elsewhere a
    plain line every ``every`` updates, so logs stay readable.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> bar = Progress(total=10, stream=out, every=5)
        >>> bar.update(5, loss=2.0, tokens_per_s=100.0, stage="dense", compression=1.0)
        >>> "5/10" in out.getvalue()
        True
    """

    def __init__(self, total: int, stream=None, every: int = 10, enabled: bool = True, prefix: str = ""):
        self.total, self.every, self.enabled, self.prefix = total, max(1, every), enabled, prefix
        self.stream = sys.stderr if stream is None else stream
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._open = False

    def update(self, step: int, *, loss: float, tokens_per_s: float, stage: str, compression: float,
               extra: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self._last_draw < 0.2 and step < self.total:
                return
        elif step % self.every and step != self.total:
            return
        self._last_draw = now
        frac = step / max(1, self.total)
        width = 20
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        line = (f"{self.prefix}[{bar}] {step}/{self.total} loss {loss:.3f} "
                f"{tokens_per_s:,.0f} tok/s stage {stage} compression {compression:.2f}x{extra}")
        if self.tty:
            self.stream.write("\r" + line.ljust(110))
            self._open = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


class PeakMemory:
    """Peak memory of one phase: ``torch.cuda.max_memory_allocated`` on a
    GPU, the process's peak resident set size on CPU.

    On Linux the kernel's high-water mark (VmHWM) is reset at :meth:`reset`
    (``/proc/self/clear_refs``), so each method is measured on its own even
    when both run in one process; elsewhere the RSS is sampled at each
    :meth:`sample` call.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = "cuda_max_memory_allocated" if device.type == "cuda" else "rss"
        self._sampled = 0
        self._hwm_ok = False
        self.baseline = 0  # memory in use at reset(): what the phase did not allocate

    @staticmethod
    def _rss() -> int:
        try:
            import psutil
            return int(psutil.Process().memory_info().rss)
        except ImportError:  # pragma: no cover - psutil is in the train extra
            import resource
            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    @staticmethod
    def _vm_hwm() -> Optional[int]:
        try:
            with open("/proc/self/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def reset(self) -> None:
        release_memory()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = int(torch.cuda.memory_allocated(self.device))
            return
        self.baseline = self._rss()
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            self._hwm_ok = self._vm_hwm() is not None
        except OSError:
            self._hwm_ok = False
        self._sampled = self._rss()

    def sample(self) -> None:
        if self.device.type != "cuda" and not self._hwm_ok:
            self._sampled = max(self._sampled, self._rss())

    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self._hwm_ok:
            return max(self._vm_hwm() or 0, self._sampled)
        self.sample()
        return self._sampled


def release_memory() -> None:
    """Returns freed memory to the system: garbage, the CUDA cache, and the C
    heap (glibc keeps freed blocks mapped, which would count in the next
    phase's RSS)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class StopFlag:
    """Ctrl-C asks the loop to stop after the current step (a second Ctrl-C
    aborts at once); use as a context manager around the training loop."""

    def __init__(self, log=print):
        self.requested = False
        self.reason = None
        self._log = log
        self._previous = None
        self._first = 0.0

    # Under torchrun a terminal's Ctrl-C reaches each worker twice at once
    # (from the terminal and forwarded by the launcher): a second SIGINT this
    # soon after the first is the same request, not "abort".
    REPEAT_S = 1.0

    def _handler(self, signum, frame):
        if self.requested:
            if time.monotonic() - self._first < self.REPEAT_S:
                return
            raise KeyboardInterrupt
        self.requested, self.reason, self._first = True, "interrupted", time.monotonic()
        self._log("\nCtrl-C: stopping cleanly after this step (press again to abort)")

    def __enter__(self):
        # Signal handlers can only be installed from the main thread.
        try:
            self._previous = signal.signal(signal.SIGINT, self._handler)
        except ValueError:
            self._previous = None
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
