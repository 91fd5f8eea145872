"""Concurrent forward: Python threads calling one TTLinear and one
TTEmbedding at the same time (the C kernels share a process-wide workspace
cache and OpenMP teams) give bit-for-bit the results of sequential calls."""
import threading

import pytest
import torch

import comera

ROUNDS = 60


def _run_concurrently(fn, inputs_per_thread):
    """Runs fn over each thread's inputs, all threads started together;
    returns each thread's outputs, re-raising any thread's exception."""
    results = [None] * len(inputs_per_thread)
    errors = []
    barrier = threading.Barrier(len(inputs_per_thread))

    def work(t):
        try:
            barrier.wait()
            results[t] = [fn(x) for x in inputs_per_thread[t]]
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(len(inputs_per_thread))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
        assert not th.is_alive(), "a forward call hung"
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("grad", [False, True])
def test_concurrent_forward_matches_sequential(grad):
    torch.manual_seed(0)
    lin = comera.TTLinear(96, 80, rank=6)
    emb = comera.TTEmbedding(1000, 24, rank=5)
    bag = comera.TTEmbedding(1000, 24, rank=5, mode="mean")
    gen = torch.Generator().manual_seed(1)
    inputs = [[(torch.randn(int(torch.randint(1, 70, (), generator=gen)), 96, generator=gen),
                torch.randint(0, 1000, (int(torch.randint(0, 300, (), generator=gen)),),
                              generator=gen))
               for _ in range(ROUNDS)] for _ in range(2)]

    def forward(item):
        x, idx = item
        with torch.set_grad_enabled(grad):
            y = lin(x)
            e = emb(idx)
            offsets = torch.arange(0, idx.numel(), 7) if idx.numel() else torch.tensor([0])
            b = bag(idx, offsets)
            return y.detach(), e.detach(), b.detach()

    sequential = [[forward(item) for item in thread_inputs] for thread_inputs in inputs]
    concurrent = _run_concurrently(forward, inputs)
    for seq_t, con_t in zip(sequential, concurrent):
        for seq, con in zip(seq_t, con_t):
            for a, b in zip(seq, con):
                assert torch.equal(a, b)
