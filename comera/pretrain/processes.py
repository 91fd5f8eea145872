"""Several processes for one ``comera pretrain`` run: started by ``torchrun``
(or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT),
they form a torch.distributed group (gloo on CPU, nccl on GPUs) and train one
model with DistributedDataParallel.  Process 0 (the main one) reads the
corpus, builds the tokenizer and writes every file; the others receive what
it prepared and only compute.

Without those variables everything here is a no-op single process.
"""
import datetime
import os
from typing import Any, Callable, Tuple

import torch
import torch.distributed as dist

# The main process reads and tokenizes the corpus while the others wait in a
# collective: a large corpus takes minutes, far beyond a usual timeout.
TIMEOUT = datetime.timedelta(hours=1)
_ERRORS = {"value": ValueError, "import": ImportError}


def launched() -> bool:
    """True when a launcher set the torch.distributed variables RANK and WORLD_SIZE.

    Example:
        >>> import os
        >>> launched() == ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
        True
    """
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _env_int(name: str, default=None) -> int:
    text = os.environ.get(name)
    if text is None:
        if default is None:
            raise ValueError(f"the launcher did not set the environment variable {name}")
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {text!r}") from None


class Context:
    """This process's place in the run: ``rank`` of ``world`` processes, and
    the collectives the training loop needs (all no-ops for one process).

    Example:
        >>> ctx = Context()
        >>> ctx.world, ctx.main, ctx.any(False), ctx.from_main(lambda: 42)
        (1, True, False, 42)
    """

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0,
                 device: torch.device = torch.device("cpu"), backend=None, owns_group: bool = False):
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.device, self.backend, self._owns = device, backend, owns_group

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def from_main(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` in the main process only and hands its result to every
        process.  An error there is raised in every process (the same type for
        ValueError and ImportError), so none is left waiting."""
        if not self.enabled:
            return fn()
        box = [None]
        if self.main:
            try:
                box[0] = ("ok", fn())
            except Exception as e:
                kind = "value" if isinstance(e, ValueError) else "import" if isinstance(e, ImportError) else "other"
                dist.broadcast_object_list([("error", kind, str(e))], src=0)
                raise
        dist.broadcast_object_list(box, src=0)
        if box[0][0] == "error":
            _, kind, message = box[0]
            raise _ERRORS.get(kind, RuntimeError)(f"{message} (in process 0)")
        return box[0][1]

    def any(self, flag: bool) -> bool:
        """True in every process when ``flag`` is true in at least one."""
        return self.max(int(bool(flag))) > 0

    def max(self, value: int) -> int:
        """The largest ``value`` over the processes."""
        if not self.enabled:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``values`` over the processes (a new tensor)."""
        if not self.enabled:
            return values
        t = values.detach().to(self.device).clone()
        dist.all_reduce(t)
        return t

    def agree(self, value, what: str) -> None:
        """Raises RuntimeError unless every process holds the same ``value``."""
        if not self.enabled:
            return
        everyone = [None] * self.world
        dist.all_gather_object(everyone, value)
        if any(v != everyone[0] for v in everyone):
            raise RuntimeError(f"the {self.world} processes disagree on {what}: "
                               + "; ".join(f"process {i}: {v}" for i, v in enumerate(everyone)))

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def close(self) -> None:
        if self.enabled and self._owns and dist.is_initialized():
            dist.destroy_process_group()


def pick_device(name: str, local_rank: int = 0, world: int = 1) -> torch.device:
    """The device of this process: ``auto`` is a GPU when one is present;
    under a launcher, ``auto`` and ``cuda`` mean ``cuda:LOCAL_RANK``.

    Example:
        >>> pick_device("cpu"), pick_device("cpu", local_rank=1, world=2)
        (device(type='cpu'), device(type='cpu'))
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA device is available")
        if dev.index is None and world > 1:
            dev = torch.device("cuda", local_rank)
        elif dev.index is not None and world > 1:
            raise ValueError(f"--device {name} names one GPU for all {world} processes; pass "
                             "--device cuda (each process takes cuda:LOCAL_RANK)")
        index = 0 if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {dev}: this machine has {torch.cuda.device_count()} GPU(s) "
                             f"(LOCAL_RANK {local_rank})")
    return dev


def setup(device_name: str) -> Tuple[Context, torch.device]:
    """The process's :class:`Context` and device; joins the process group
    when launched (gloo on CPU, nccl on CUDA)."""
    if not launched():
        dev = pick_device(device_name)
        return Context(device=dev), dev
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local = _env_int("LOCAL_RANK", 0)
    if not 0 <= rank < world:
        raise ValueError(f"RANK must be in [0, WORLD_SIZE), got RANK={rank}, WORLD_SIZE={world}")
    dev = pick_device(device_name, local, world)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local)  # DDP and nccl need the index
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=TIMEOUT)
    return Context(rank, world, local, dev, backend, owns), dev


def split_batch(batch_size: int, world: int, grad_accum: int) -> int:
    """Rows of one micro-batch: the global ``--batch-size`` shared by
    ``world`` processes, each in ``grad_accum`` micro-batches.

    Example:
        >>> split_batch(32, 4, 2)
        4
        >>> split_batch(6, 4, 1)
        Traceback (most recent call last):
        ...
        ValueError: --batch-size 6 (the global batch) must be divisible by 4 processes x --grad-accum 1 = 4
    """
    share = world * grad_accum
    if batch_size % share:
        raise ValueError(f"--batch-size {batch_size} (the global batch) must be divisible by {world} "
                         f"processes x --grad-accum {grad_accum} = {share}")
    return batch_size // share
