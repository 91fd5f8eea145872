"""Sizes whose products overflow int64 are refused before anything is
allocated, with an exception naming the argument, from the modules and
from the ops' planners (the C side: tests/fuzz)."""
import math

import pytest
import torch

import comera
from comera.ops import tt_embedding_plan, tt_linear_plan

BIG = 2**32


@pytest.mark.parametrize("kwargs, match", [
    (dict(in_features=2**63, out_features=4), r"in_features must be in \[1, 2\*\*63 - 1\]"),
    (dict(in_features=4, out_features=2**64), r"out_features must be in \[1, 2\*\*63 - 1\]"),
    (dict(in_features=2**62, out_features=4, in_shape=[BIG, BIG], out_shape=[4]),
     r"in_shape \[4294967296, 4294967296\] has product 18446744073709551616, which overflows"),
    (dict(in_features=2**62, out_features=2**62, in_shape=[2**31, 2**31],
          out_shape=[2**31, 2**31], rank=[2**31, 2**31, 2**31]),
     r"core 1 the shape \(2147483648, 2147483648, 2147483648\)"),
    (dict(in_features=2**40, out_features=2**40, in_shape=[2**20, 2**20],
          out_shape=[2**20, 2**20], rank=[2**20, 2**20, 2**20]),
     r"TTLinear: in_shape \[1048576, 1048576\].*cannot index with int64"),
])
def test_ttlinear_refuses_overflowing_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        comera.TTLinear(**kwargs)


@pytest.mark.parametrize("args, kwargs, match", [
    ((2**63, 4), dict(rank=1), r"num_embeddings must be in \[1, 2\*\*63 - 1\]"),
    ((4, 2**63), dict(rank=1), r"embedding_dim must be in \[1, 2\*\*63 - 1\]"),
    ((2**62, 4), dict(rank=1, shape=([BIG, BIG], [2, 2])),
     r"row_modes \[4294967296, 4294967296\] have product .* overflows int64"),
    ((2**40, 2**40), dict(rank=[2**20, 2**20], shape=([2**20, 2**10, 2**10], [2**20, 2**10, 2**10])),
     r"TTEmbedding: shape .* cannot index with int64"),
])
def test_ttembedding_refuses_overflowing_sizes(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        comera.TTEmbedding(*args, **kwargs)


def test_planners_refuse_overflow():
    with pytest.raises(ValueError, match=r"in_modes \[1099511627776, 1099511627776\].*overflow"):
        tt_linear_plan([2**40, 2**40], [2], [1, 1, 1, 1], 1, 1, 1)
    with pytest.raises(ValueError, match=r"batch 4611686018427387904 .*overflow"):
        tt_linear_plan([4], [4], [1, 1, 1], 4, 4, 2**62)       # batch x features
    with pytest.raises(ValueError, match="overflow"):
        tt_embedding_plan(torch.tensor([1]), [2**40, 2**40], [2, 2], [1, 1, 1], 10, 4)


def test_huge_valid_shapes_are_not_refused():
    """The checks refuse only what overflows: a layer with large (valid)
    modes and rank 1 is built."""
    layer = comera.TTLinear(2**20, 4, rank=1, in_shape=[2**10, 2**10], out_shape=[2, 2])
    assert layer.ranks == [1, 1, 1]


@pytest.mark.parametrize("make", [lambda: comera.TTLinear(2**62, 4, rank=2),
                                  lambda: comera.TTLinear(4, 2**40, rank=2),
                                  lambda: comera.TTEmbedding(2**40, 8, rank=2)])
def test_sizes_too_large_to_factorise_automatically_are_refused_at_once(make):
    # trial-division factorisation of such sizes would take minutes; the
    # error says how to give the modes explicitly
    with pytest.raises(ValueError, match="too large to factorise automatically"):
        make()


def test_factorize_still_handles_large_real_sizes():
    from comera.layers.tt import factorize
    f = factorize(2**31 - 1)  # a prime: padded to a balanced neighbour
    assert len(f) == 3 and math.prod(f) >= 2**31 - 1 and max(f) < 2000
