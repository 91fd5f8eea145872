"""The sync-free rank-adaptation step (comera.adapt.controller and
comera.adapt.step with sync=False), on the CPU.

References: the plain-number controller of reference_controller.py (the
specification) on random decision sequences, in both modes; the step with
host reads allowed (sync_free=False) over small training runs (same gates,
signs, ranks, controller state); and a detector of host reads that fails
any sync-free step that would wait for a GPU."""
import contextlib
import random

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import comera
import reference_controller as rc
from comera.adapt.controller import RankController, TTSizes
from comera.adapt.state import ControllerState
from reference_controller import Proposal

INF = float("inf")


# ------------------------------------------- the controller against its spec
def _random_sequence(seed: int):
    """A random model shape, gate lengths, target and schedule."""
    rnd = random.Random(seed)
    shapes = [[rnd.choice([2, 3, 4, 6]) for _ in range(rnd.randint(2, 4))]
              for _ in range(rnd.randint(1, 3))]
    where = rc.bonds(shapes)
    lengths = [rnd.randint(2, 7) for _ in where]
    full = rc.tt_size(shapes, [[lengths[b] for b, (li2, _) in enumerate(where) if li2 == li]
                               for li in range(len(shapes))])
    smallest = rc.tt_size(shapes, [[1] * (len(m) - 1) for m in shapes])
    target = rnd.uniform(smallest, 0.8 * full)
    return rnd, shapes, lengths, target


def _step_inputs(rnd, alive, lengths, min_rank, levels):
    """Proposed deaths (a random subset of the live entries, keeping
    min_rank per bond), magnitudes and contributions, rounded to a few
    levels so that ties happen."""
    proposals, contrib = [], []
    for b, entries in enumerate(alive):
        live = sorted(entries)
        rnd.shuffle(live)
        cut = rnd.randint(0, max(0, len(live) - min_rank)) if rnd.random() < 0.5 else 0
        for j in live[:cut]:
            proposals.append(Proposal(b, j, rnd.randint(1, levels) / levels))
        contrib.append({j: rnd.randint(1, levels) / levels for j in range(lengths[b])})
    return proposals, contrib


def _compare_sequence(seed: int, sync: bool):
    """Runs the reference and the tensor controller side by side on one
    random sequence; asserts equal decisions and state; returns (revivals, kills)."""
    rnd, shapes, lengths, target = _random_sequence(seed)
    min_rank = rnd.choice([1, 1, 2])
    args = dict(gamma=rnd.choice([0.0, 1e-3, 0.2]), stage1_steps=rnd.randint(0, 3),
                stage2_steps=rnd.randint(1, 8), target_size=target, min_rank=min_rank)
    host = rc.RankController(**args)
    dev = RankController(shapes, **args)
    state = ControllerState.for_gates([torch.zeros(n) for n in lengths])
    where, nb, width = rc.bonds(shapes), len(lengths), max(lengths)
    alive = [set(range(n)) for n in lengths]
    counts = [0, 0]
    for step in range(args["stage1_steps"] + args["stage2_steps"] + 2):
        proposals, contrib = _step_inputs(rnd, alive, lengths, min_rank, rnd.choice([2, 5, 50]))
        proposed = {(p.bond, p.entry) for p in proposals}
        for p in proposals:
            alive[p.bond].discard(p.entry)
        live = [[len(alive[b]) for b, (l2, _) in enumerate(where) if l2 == li]
                for li in range(len(shapes))]
        scores = [{j: c for j, c in per.items() if j in alive[b] or (b, j) in proposed}
                  for b, per in enumerate(contrib)]
        want = host.decide(step, shapes, live, proposals, lambda: [dict(s) for s in scores])
        died = torch.zeros(nb, width, dtype=torch.bool)
        mag = torch.zeros(nb, width, dtype=torch.float64)
        score = torch.full((nb, width), INF, dtype=torch.float64)
        for p in proposals:
            died[p.bond, p.entry], mag[p.bond, p.entry] = True, p.magnitude
        for b, per in enumerate(scores):
            for j, c in per.items():
                score[b, j] = c
        state.step = step
        state.tick()
        revive, kill = dev.decide(state, torch.tensor([len(a) for a in alive]), died, mag,
                                  lambda: score, torch.tensor(True), lengths, sync=sync)
        where_msg = f"seed {seed} step {step}"
        assert sorted(map(tuple, revive.nonzero().tolist())) == sorted(want.revive), where_msg
        assert sorted(map(tuple, kill.nonzero().tolist())) == sorted(want.kill), where_msg
        assert bool(state.frozen) == host.frozen, where_msg
        assert bool(state.started) == (host.size_start is not None), where_msg
        if host.size_start is not None:
            assert float(state.size_start) == host.size_start, where_msg
            assert float(state.lam) == pytest.approx(host.lam, rel=1e-12), where_msg
            assert float(state.lam0) == host.lam0, where_msg
        counts[0] += len(want.revive)
        counts[1] += len(want.kill)
        for b, j in want.revive:
            alive[b].add(j)
        for b, j in want.kill:
            alive[b].discard(j)
    return counts


@pytest.mark.parametrize("sync", [False, True])
def test_controller_decides_like_the_reference(sync):
    """Random shapes, schedules, targets, proposals and scores (with ties):
    the same revivals, kills, frozen flag, start size and lam at every step,
    with and without host reads; the sequences contain many revivals and
    kills, so the check has teeth."""
    revived = killed = 0
    for seed in range(30):
        r, k = _compare_sequence(seed, sync)
        revived, killed = revived + r, killed + k
    assert revived >= 20 and killed >= 20, (revived, killed)


def test_sizes_and_costs_match_the_formulas():
    shapes = [[4, 4, 4], [8, 2], [3, 5, 2, 7]]
    dev = TTSizes(shapes, torch.device("cpu"))
    gen = random.Random(3)
    for _ in range(20):
        live = [[gen.randint(1, 6) for _ in range(len(m) - 1)] for m in shapes]
        flat = torch.tensor([r for per in live for r in per])
        assert int(dev.size(flat)) == rc.tt_size(shapes, live)
        assert dev.cost(flat).tolist() == [rc.rank_cost(shapes[li], live[li], k)
                                           for li, k in rc.bonds(shapes)]


# ------------------------------------ RankAdaptive: sync-free vs host reads
def _train(sync_free, *, rule="saliency", prune_every=None, target=6.0, steps=36,
           min_rank=1, hooks=None):
    """A small attached AdamW run; returns per step (gates, signs, controller
    state, compression).  ``hooks(ra, step)`` may wrap the step."""
    torch.manual_seed(0)
    model = nn.Sequential(comera.TTLinear(16, 16, rank=4), nn.Tanh(),
                          comera.TTLinear(16, 12, rank=5, in_shape=[2, 2, 4], out_shape=[3, 2, 2]))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    ra = comera.RankAdaptive(model, gamma=0.3, threshold=1e-2, stage1_steps=14, stage2_steps=16,
                             target_compression=target, prune_every=prune_every,
                             stage2_rule=rule, min_rank=min_rank)
    ra.sync_free = sync_free
    ra.attach(opt)
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(steps):
        x = torch.randn(32, 16, generator=gen)
        loss = (model(x)[:, :12] - x[:, :12].flip(1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if hooks is not None:
            with hooks(ra, i):
                opt.step()
        else:
            opt.step()
        if sync_free:
            assert ra.uses_sync_free()  # the sync-free step ran
        state = ra.state_dict()  # reads the device state back (a sync, outside the step)
        out.append(([g.detach().clone() for g in ra._gates()], state["signs"],
                     (state["frozen"], state["lam"], state["lam0"], state["size_start"]),
                     ra.compression()))
    return out


@pytest.mark.parametrize("rule,prune_every,target,min_rank", [
    ("saliency", None, 6.0, 1), ("magnitude", 5, 6.0, 1), ("saliency", 7, 4.0, 2),
    ("saliency", None, None, 1)])
def test_sync_free_steps_train_like_steps_with_host_reads(rule, prune_every, target, min_rank):
    """The sync-free step forced on the CPU against the step allowed to read
    (its early exits: frozen steps skip the review, the kill loop stops at
    the last kill, revivals look at the proposed deaths only): equal gates,
    signs, ranks, compression and controller state after every step, through
    stage 1, the stage-2 controller and pruning."""
    host = _train(False, rule=rule, prune_every=prune_every, target=target, min_rank=min_rank)
    dev = _train(True, rule=rule, prune_every=prune_every, target=target, min_rank=min_rank)
    for step, (h, d) in enumerate(zip(host, dev)):
        assert all(torch.equal(a, b) for a, b in zip(h[0], d[0])), step
        assert all(torch.equal(a, b) for a, b in zip(h[1], d[1])), step
        (hf, hl, hl0, hs), (df, dl, dl0, ds) = h[2], d[2]
        assert (hf, hl0, hs) == (df, dl0, ds) and dl == pytest.approx(hl, rel=1e-12), step
        assert h[3] == d[3], step
    # the runs went somewhere: ranks died and (with a target) the target froze them
    assert host[-1][3] > 1.5
    if target is not None:
        assert host[-1][2][0] and abs(host[-1][3] / target - 1) < 0.05


# ------------------------------------------------------------- no host reads
class HostReadError(AssertionError):
    pass


_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu,
          torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select, torch.masked_select,
          torch.Tensor.unique, torch.unique, torch.Tensor.unique_consecutive, torch.argwhere,
          torch.Tensor.argwhere, torch.Tensor.__array__}
# ops whose output size or value needs the device's data on the host
_ATEN_READS = ("_local_scalar_dense", "nonzero", "masked_select", "_unique", "unique_dim",
               "unique_consecutive", "repeat_interleave", "bincount", "histc")


class _NoHostReadsFunctions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            raise HostReadError(f"host read: {func.__name__}")
        if func in (torch.Tensor.to, torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            for a in list(args[1:]) + list(kwargs.values()):
                for x in (a if isinstance(a, tuple) else (a,)):
                    if isinstance(x, torch.Tensor) and (x.dtype == torch.bool or x.dim() == 0):
                        raise HostReadError(f"host read: {func.__name__} with a tensor index")
                    if func is torch.Tensor.to and str(x).startswith("cpu"):
                        raise HostReadError("host read: .to('cpu')")
        return func(*args, **kwargs)


class _NoHostReadsAten(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if any(name.startswith(r) for r in _ATEN_READS):
            raise HostReadError(f"host read: aten.{name}")
        if name in ("index", "index_put", "index_put_"):
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()):
                raise HostReadError("host read: boolean-mask indexing")
        return func(*args, **kwargs)


class _no_host_reads:
    """Inside: any call that reads a tensor's data on the host (or would on
    a GPU: .item(), bool(), .tolist(), .cpu(), nonzero, boolean masks, ...)
    raises HostReadError."""

    def __enter__(self):
        self._modes = [_NoHostReadsFunctions(), _NoHostReadsAten()]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)
        return False


def _guard_steps(prune_every):
    """Wraps RankAdaptive's step (run by the optimizer hook) in
    _no_host_reads, except on prune steps, the one place allowed to sync."""
    @contextlib.contextmanager
    def hooks(ra, i):
        inner = ra._step_impl

        def guarded(opt):
            prune_now = prune_every is not None and (ra.steps + 1) % prune_every == 0
            if prune_now:
                return inner(opt)
            with _no_host_reads():
                return inner(opt)
        ra._step_impl = guarded
        try:
            yield
        finally:
            del ra._step_impl
    return hooks


def test_the_detector_catches_host_reads():
    x = torch.arange(4.0)
    for read in (lambda: x.sum().item(), lambda: bool(x.any()), lambda: x.tolist(),
                 lambda: x[x > 1], lambda: torch.nonzero(x), lambda: int(x.sum()),
                 lambda: x.cpu(), lambda: x.to("cpu"), lambda: torch.count_nonzero(x).item()):
        with pytest.raises(HostReadError), _no_host_reads():
            read()
    with _no_host_reads():  # what the sync-free step uses passes
        torch.where(x > 1, x, 0.0).topk(2).indices.sort(stable=True)
    # and the step of RankAdaptive with sync_free=False does read the host
    with pytest.raises(HostReadError):
        _train(False, steps=2, hooks=_guard_steps(None))


@pytest.mark.parametrize("rule,prune_every", [("saliency", 6), ("magnitude", None)])
def test_sync_free_steps_never_read_the_host(rule, prune_every):
    """Stage 1, the stage-2 controller (kills) and frozen steps, attached to
    AdamW, sync-free forced on the CPU: no step between prune steps reads a
    tensor on the host, and the result is that of the steps that may read."""
    dev = _train(True, rule=rule, prune_every=prune_every, hooks=_guard_steps(prune_every))
    host = _train(False, rule=rule, prune_every=prune_every)
    assert all(torch.equal(a, b) for a, b in zip(dev[-1][0], host[-1][0]))
    assert dev[-1][3] == host[-1][3] and dev[-1][2][0]


def test_sync_free_step_defers_the_nan_error_and_changes_nothing():
    """A NaN gate: the sync-free step leaves every gate and sign as it was
    (here also an entry inside the dead zone), records the gate, and
    check() / the next prune step raise the error naming the layer."""
    model = nn.Sequential(comera.TTLinear(16, 16, rank=4), nn.ReLU(),
                          nn.Sequential(comera.TTLinear(16, 8, rank=4)))
    ra = comera.RankAdaptive(model, gamma=0.1, threshold=0.5, stage1_steps=5, stage2_steps=5,
                             target_compression=3.0, prune_every=3)
    ra.sync_free = True
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model[2][0].gates[1][2] = float("nan")
        model[0].gates[0][0] = 1e-3  # inside the dead zone, but must survive the failed steps
    gates = [g.detach().clone() for g in ra._gates()]
    signs = [s.clone() for s in ra.state.signs]
    with _no_host_reads():
        ra.step(opt)
        ra.step(opt)
    for g, s, g0, s0 in zip(ra._gates(), ra.state.signs, gates, signs):
        assert torch.equal(g.detach().nan_to_num(7.0), g0.nan_to_num(7.0)) and torch.equal(s, s0)
    with pytest.raises(ValueError, match=r"gate 1 of layer '2\.0' contains NaN \(seen by an "
                                         r"earlier step"):
        ra.check()
    with pytest.raises(ValueError, match=r"gate 1 of layer '2\.0' contains NaN"):
        ra.step(opt)  # step 3: a prune step
    assert model[0].gates[0][0].item() == torch.tensor(1e-3).item()


def test_switching_modes_carries_the_controller_state():
    """Steps with host reads, then sync-free steps, then steps with reads
    again: one state serves both, and the run equals a run that may read
    throughout."""
    @contextlib.contextmanager
    def path(ra, i):
        ra.sync_free = 10 <= i < 24  # sync-free over the stage change
        yield
        assert ra.uses_sync_free() == ra.sync_free  # that mode ran
    mixed = _train(None, hooks=path)
    host = _train(False)
    for h, m in zip(host, mixed):
        assert all(torch.equal(a, b) for a, b in zip(h[0], m[0]))
        assert h[2][0] == m[2][0] and h[2][3] == m[2][3] and h[3] == m[3]


def test_sync_free_argument_selects_the_path():
    """The public ``sync_free`` argument forces the sync-free step (True),
    the step with host reads (False) or picks by device (None: reads on the CPU)."""
    for value, expect_device in ((True, True), (False, False), (None, False)):
        model = nn.Sequential(comera.TTLinear(16, 16, rank=4))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        ra = comera.RankAdaptive(model, gamma=0.3, threshold=1e-2, stage1_steps=2,
                                 stage2_steps=2, sync_free=value).attach(opt)
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        assert ra.uses_sync_free() == expect_device
        assert (ra._dc is not None) == expect_device  # the name tests/ops reads
    with pytest.raises(TypeError, match="sync_free"):
        comera.RankAdaptive(nn.Sequential(comera.TTLinear(16, 16, rank=4)), gamma=0.3,
                            threshold=1e-2, stage1_steps=2, stage2_steps=2, sync_free="yes")
