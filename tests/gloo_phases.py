"""Running a test module's phases in WORLD gloo processes, once per module:
each phase leaves one marker file per rank when every rank has passed it,
so each test checks its own phase and a failure names the phase.

A test module defines its phases (functions of the rank) and

    @pytest.fixture(scope="module")
    def run(tmp_path_factory):
        return gloo_phases.spawn(tmp_path_factory, "ddp", PHASES)

    def test_x(run):
        gloo_phases.check(run, _x_phase)
"""
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def init(rank: int, init_file: str) -> None:
    """One thread, a gloo group over a file, and a timeout, so a worker left
    alone in a collective fails instead of hanging."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))


def _worker(rank, phases, init_file, out_dir):
    init(rank, init_file)
    try:
        for phase in phases:
            phase(rank)
            dist.barrier()
            open(os.path.join(out_dir, f"{phase.__name__}.{rank}.ok"), "w").close()
    finally:
        dist.destroy_process_group()


def spawn(tmp_path_factory, name: str, phases):
    """Runs every phase in WORLD gloo processes; returns (out_dir, error text or None)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    out = tmp_path_factory.mktemp(name)
    try:
        mp.spawn(_worker, args=(list(phases), str(out / "init"), str(out)), nprocs=WORLD, join=True)
        return out, None
    except Exception as err:                  # a worker failed: the phases after it did not run
        return out, f"{type(err).__name__}: {err}"


def check(run, phase) -> None:
    """Asserts that every rank passed ``phase``."""
    out, error = run
    done = all(os.path.exists(out / f"{phase.__name__}.{r}.ok") for r in range(WORLD))
    assert done, f"{phase.__name__} failed or did not run:\n{error}"
