"""``ModuleInfo`` entries for comera's layers, in the form of
``torch.testing._internal.common_modules.module_db``: what PyTorch's generic
module tests (class ``TestModule``, tests/layers/test_modules_generic.py)
run over.

Three entries: ``comera.TTLinear``, ``comera.TTEmbedding`` (plain lookups)
and ``comera.TTEmbedding.bag`` (``mode="sum"`` / ``"mean"``, the
nn.EmbeddingBag counterpart; the same class, so the entry carries its own
name).  Each sample builds a layer and calls it; its ``reference_fn``
computes the same output from the dense weight or table built entry by entry
from the cores (tests/reference.py, tests/reference_embedding.py), with
nn.Linear's / nn.Embedding's / nn.EmbeddingBag's functional forms.  The
samples cover inputs of rank 0/1 to 4, zero rows and zero bags, padded modes,
``padding_idx``, both TTLinear kernel paths (``"merge"``, ``"sequential"``) and
every embedding reuse strategy (``"none"``, ``"dedup"``, ``"prefix"``).
Index tensors are passed by position, as in PyTorch's nn.Embedding samples:
the generic gradient check takes every tensor keyword argument for a
differentiable input (TTLinear's first sample passes ``input=`` by keyword).

Skips carry their reason beside them (``EMBEDDING_SKIPS``); each names a
check that cannot apply to a TT layer.
"""
import unittest
from functools import partial

import torch
import torch.nn.functional as F
from torch.testing._internal.opinfo.core import DecorateInfo
from torch.testing._internal.common_modules import (ErrorModuleInput, FunctionInput, ModuleErrorEnum,
                                                    ModuleInfo, ModuleInput)
from torch.testing._internal.common_utils import make_tensor

import comera
from reference import dense_wt_by_entries
from reference_embedding import dense_ttm_by_entries


class NamedModuleInfo(ModuleInfo):
    """A ModuleInfo with its own name: the test names follow ``name`` (with
    dots made underscores), so two entries may test one class."""

    def __init__(self, module_cls, *, name: str, **kwargs):
        super().__init__(module_cls, **kwargs)
        self._name = name

    @property
    def name(self):
        return self._name


# ---------------------------------------------------------------- references
def _linear_ref(m, p, input):
    """``F.linear`` with the dense weight built entry by entry from the cores."""
    wt = dense_wt_by_entries(list(m.cores), list(m.gates), m.num_in_cores, m.in_features,
                             m.out_features)
    return F.linear(input, wt.t(), m.bias)


def _table(m):
    t = dense_ttm_by_entries(list(m.cores), list(m.gates), m.num_embeddings, m.embedding_dim)
    if m.padding_idx is not None:
        keep = torch.ones(m.num_embeddings, 1, dtype=t.dtype, device=t.device)
        keep[m.padding_idx] = 0
        t = t * keep
    return t


def _embedding_ref(m, p, input):
    return F.embedding(input, _table(m), padding_idx=m.padding_idx)


def _bag_ref(m, p, input, offsets=None, per_sample_weights=None):
    return F.embedding_bag(input, _table(m), offsets, mode=m.mode,
                           per_sample_weights=per_sample_weights, padding_idx=m.padding_idx,
                           include_last_offset=m.include_last_offset)


def _indices(shape, high, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, shape, generator=g).to(device)


# -------------------------------------------------------------------- inputs
def module_inputs_tt_linear(module_info, device, dtype, requires_grad, training, **kwargs):
    make_input = partial(make_tensor, device=device, dtype=dtype, requires_grad=requires_grad)
    ref = _linear_ref
    return [
        ModuleInput(constructor_input=FunctionInput(10, 8, rank=3),
                    forward_input=FunctionInput(input=make_input((4, 10))),
                    reference_fn=ref),
        ModuleInput(constructor_input=FunctionInput(10, 8, bias=False, rank=2, path="sequential"),
                    forward_input=FunctionInput(make_input((2, 3, 10))),
                    desc="no_bias_3d_sequential", reference_fn=ref),
        ModuleInput(constructor_input=FunctionInput(3, 5),
                    forward_input=FunctionInput(make_input(3)),
                    desc="no_batch_dim", reference_fn=ref),
        # padded modes on both sides (3 * 4 = 12 > 10, 3 * 3 = 9 > 7)
        ModuleInput(constructor_input=FunctionInput(10, 7, rank=[2, 3, 2], in_shape=[3, 4],
                                                    out_shape=[3, 3], path="merge"),
                    forward_input=FunctionInput(make_input((2, 1, 3, 10))),
                    desc="padded_4d_merge", reference_fn=ref),
        ModuleInput(constructor_input=FunctionInput(10, 7, rank=[2, 3, 2], in_shape=[3, 4],
                                                    out_shape=[3, 3], path="sequential"),
                    forward_input=FunctionInput(make_input((5, 10))),
                    desc="padded_sequential", reference_fn=ref),
        ModuleInput(constructor_input=FunctionInput(12, 6, rank=4, path="merge"),
                    forward_input=FunctionInput(make_input((0, 12))),
                    desc="zero_rows", reference_fn=ref),
        ModuleInput(constructor_input=FunctionInput(12, 6, rank=4, path="sequential"),
                    forward_input=FunctionInput(make_input((3, 0, 12))),
                    desc="zero_rows_3d_sequential", reference_fn=ref),
    ]


def module_inputs_tt_embedding(module_info, device, dtype, requires_grad, training, **kwargs):
    idx = partial(_indices, device=device)
    ref = _embedding_ref
    return [
        ModuleInput(constructor_input=FunctionInput(10, 3),
                    forward_input=FunctionInput(idx((2, 4), 10, seed=0)),
                    reference_fn=ref),
        ModuleInput(constructor_input=FunctionInput(20, 6, rank=3, padding_idx=0, reuse="none"),
                    forward_input=FunctionInput(torch.tensor([[0, 4, 19], [7, 0, 7]],
                                                             device=device)),
                    desc="padding_idx_none", reference_fn=ref),
        ModuleInput(constructor_input=FunctionInput(20, 6, rank=[3, 2], reuse="dedup",
                                                    shape=([3, 2, 4], [2, 1, 3])),
                    forward_input=FunctionInput(idx((2, 2, 3), 20, seed=1)),
                    desc="padded_3d_dedup", reference_fn=ref),
        ModuleInput(constructor_input=FunctionInput(20, 6, rank=[3, 2], reuse="prefix",
                                                    padding_idx=-1),
                    forward_input=FunctionInput(torch.tensor([19, 3, 3, 18, 19], device=device)),
                    desc="prefix_negative_padding_idx", reference_fn=ref),
        ModuleInput(constructor_input=FunctionInput(20, 6, rank=2, shape=2),
                    forward_input=FunctionInput(torch.tensor(5, device=device)),
                    desc="scalar_index_two_cores", reference_fn=ref),
        ModuleInput(constructor_input=FunctionInput(20, 6, rank=2),
                    forward_input=FunctionInput(torch.zeros(2, 0, dtype=torch.int64,
                                                            device=device)),
                    desc="zero_rows", reference_fn=ref),
        ModuleInput(constructor_input=FunctionInput(20, 6, rank=2, reuse="prefix"),
                    forward_input=FunctionInput(idx((1, 2, 2, 2), 20, seed=2).int()),
                    desc="int32_4d", reference_fn=ref),
    ]


def module_inputs_tt_embedding_bag(module_info, device, dtype, requires_grad, training, **kwargs):
    idx = partial(_indices, device=device)
    make_weights = partial(make_tensor, device=device, dtype=dtype, requires_grad=requires_grad)
    ref = _bag_ref

    def tensor(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    return [
        ModuleInput(constructor_input=FunctionInput(10, 3, mode="sum"),
                    forward_input=FunctionInput(idx((3, 4), 10, seed=3)),
                    desc="sum_2d", reference_fn=ref),
        ModuleInput(constructor_input=FunctionInput(20, 6, rank=3, mode="mean", reuse="none"),
                    forward_input=FunctionInput(tensor([1, 2, 19, 7, 7, 0]), tensor([0, 2, 2, 5])),
                    desc="mean_offsets_empty_bag_none", reference_fn=ref),
        ModuleInput(constructor_input=FunctionInput(20, 6, rank=3, mode="sum", reuse="dedup"),
                    forward_input=FunctionInput(tensor([1, 2, 19, 7, 7, 0]), tensor([0, 2, 2]),
                                                per_sample_weights=make_weights(6)),
                    desc="sum_per_sample_weights_dedup", reference_fn=ref),
        ModuleInput(constructor_input=FunctionInput(20, 6, rank=[3, 2], mode="mean", padding_idx=7,
                                                    reuse="prefix", shape=([3, 2, 4], [2, 1, 3])),
                    forward_input=FunctionInput(tensor([7, 2, 7, 7, 4, 0, 1])[None].expand(2, 7)
                                                .contiguous()),
                    desc="mean_padding_idx_prefix_padded", reference_fn=ref),
        ModuleInput(constructor_input=FunctionInput(20, 6, rank=2, mode="sum",
                                                    include_last_offset=True),
                    forward_input=FunctionInput(tensor([3, 4, 5, 3]), tensor([0, 1, 1, 4])),
                    desc="sum_include_last_offset", reference_fn=ref),
        ModuleInput(constructor_input=FunctionInput(20, 6, rank=2, mode="mean"),
                    forward_input=FunctionInput(torch.zeros(0, dtype=torch.int64, device=device),
                                                tensor([0, 0])),
                    desc="zero_indices", reference_fn=ref),
        ModuleInput(constructor_input=FunctionInput(20, 6, rank=2, mode="sum"),
                    forward_input=FunctionInput(torch.zeros(0, 3, dtype=torch.int64,
                                                            device=device)),
                    desc="zero_bags", reference_fn=ref),
    ]


# -------------------------------------------------------------------- errors
def module_error_inputs_tt_linear(module_info, device, dtype, requires_grad, training, **kwargs):
    make_input = partial(make_tensor, device=device, dtype=dtype, requires_grad=requires_grad)
    return [
        ErrorModuleInput(ModuleInput(constructor_input=FunctionInput(10, 8, path="fast")),
                         error_on=ModuleErrorEnum.CONSTRUCTION_ERROR, error_type=ValueError,
                         error_regex="path must be one of"),
        ErrorModuleInput(ModuleInput(constructor_input=FunctionInput(10, 8, in_shape=[2, 2])),
                         error_on=ModuleErrorEnum.CONSTRUCTION_ERROR, error_type=ValueError,
                         error_regex="in_shape"),
        ErrorModuleInput(ModuleInput(constructor_input=FunctionInput(10, 8, dtype=dtype),
                                     forward_input=FunctionInput(make_input((4, 9)))),
                         error_on=ModuleErrorEnum.FORWARD_ERROR, error_type=ValueError,
                         error_regex=r"in_features=10"),
    ]


def module_error_inputs_tt_embedding(module_info, device, dtype, requires_grad, training, **kwargs):
    return [
        ErrorModuleInput(ModuleInput(constructor_input=FunctionInput(10, 3, padding_idx=10)),
                         error_on=ModuleErrorEnum.CONSTRUCTION_ERROR, error_type=ValueError,
                         error_regex="padding_idx must be within num_embeddings"),
        ErrorModuleInput(ModuleInput(constructor_input=FunctionInput(10, 3, mode="max")),
                         error_on=ModuleErrorEnum.CONSTRUCTION_ERROR, error_type=ValueError,
                         error_regex="mode must be"),
        ErrorModuleInput(ModuleInput(constructor_input=FunctionInput(10, 3),
                                     forward_input=FunctionInput(torch.tensor([3, 10],
                                                                              device=device))),
                         error_on=ModuleErrorEnum.FORWARD_ERROR, error_type=IndexError,
                         error_regex="out of range"),
        ErrorModuleInput(ModuleInput(constructor_input=FunctionInput(10, 3),
                                     forward_input=FunctionInput(torch.ones(2, device=device))),
                         error_on=ModuleErrorEnum.FORWARD_ERROR, error_type=TypeError,
                         error_regex="int64 or int32"),
    ]


def module_error_inputs_tt_embedding_bag(module_info, device, dtype, requires_grad, training,
                                         **kwargs):
    def tensor(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    return [
        ErrorModuleInput(ModuleInput(constructor_input=FunctionInput(10, 3, mode="sum"),
                                     forward_input=FunctionInput(tensor([[1, 2]]), tensor([0]))),
                         error_on=ModuleErrorEnum.FORWARD_ERROR, error_type=ValueError,
                         error_regex="offsets must be None when input is 2-D"),
        ErrorModuleInput(ModuleInput(constructor_input=FunctionInput(10, 3, mode="mean"),
                                     forward_input=FunctionInput(
                                         tensor([1, 2]), tensor([0, 1]),
                                         per_sample_weights=torch.ones(2, device=device))),
                         error_on=ModuleErrorEnum.FORWARD_ERROR, error_type=ValueError,
                         error_regex="only supported with mode='sum'"),
        ErrorModuleInput(ModuleInput(constructor_input=FunctionInput(10, 3, mode="sum"),
                                     forward_input=FunctionInput(tensor([1, 2]), tensor([1, 2]))),
                         error_on=ModuleErrorEnum.FORWARD_ERROR, error_type=ValueError,
                         error_regex="offsets"),
    ]


# --------------------------------------------------------------------- skips
# Each skip with its reason: a check that cannot apply to a TT layer.
EMBEDDING_SKIPS = (
    # test_memory_format wants every 4-D gradient in channels_last when a 4-D
    # input is: a rule for image tensors and convolution weights.  The
    # embedding's cores are 4-D, (r_{k-1}, v_k, e_k, r_k), not images; their
    # gradients come row-major whatever the index tensor's layout.  (PyTorch's
    # own nn.Embedding entry skips this test too.)  TTLinear passes it.
    DecorateInfo(unittest.skip("TT embedding cores are 4-D but not images: channels_last does "
                               "not apply to their gradients"),
                 "TestModule", "test_memory_format"),
)

comera_module_db = [
    NamedModuleInfo(comera.TTLinear, name="comera.TTLinear",
                    module_inputs_func=module_inputs_tt_linear,
                    module_error_inputs_func=module_error_inputs_tt_linear),
    NamedModuleInfo(comera.TTEmbedding, name="comera.TTEmbedding",
                    module_inputs_func=module_inputs_tt_embedding,
                    module_error_inputs_func=module_error_inputs_tt_embedding,
                    skips=EMBEDDING_SKIPS),
    NamedModuleInfo(comera.TTEmbedding, name="comera.TTEmbedding.bag",
                    module_inputs_func=module_inputs_tt_embedding_bag,
                    module_error_inputs_func=module_error_inputs_tt_embedding_bag,
                    skips=EMBEDDING_SKIPS),
]
