"""Weight ties for :func:`comera.convert`: tied groups (one Parameter held
by several modules) and the ``tie`` policy.  The fix-ups HF models need
(``transformers`` re-ties weights by parameter *names*) live in
:mod:`comera.integrations.hf.ties`.

The layers handled here are convert's per-layer records: objects with
``name``, ``module`` (the dense layer), ``kind`` (``"linear"`` or
``"embedding"``) and ``reason`` (None while the layer is to be converted).
"""
from typing import Dict, List, Tuple

from torch import nn


# ----------------------------------------------------------------------- ties
def tie_groups(model: nn.Module, layers: list) -> List[Tuple[list, List[str]]]:
    """Groups of candidate layers whose weights are one Parameter, with the
    names of any other (non-candidate) modules that also hold it."""
    by_module = {id(l.module): l for l in layers}
    owners: Dict[int, List[Tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        for pname, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((f"{name}.{pname}" if name else pname, module))
    groups = []
    seen = set()
    for layer in layers:
        key = id(layer.module.weight)
        if key in seen:
            continue
        seen.add(key)
        mods = owners.get(key, [])
        if len({id(m) for _, m in mods}) < 2:
            continue
        members = [by_module[id(m)] for _, m in mods if id(m) in by_module]
        others = [n for n, m in mods if id(m) not in by_module]
        groups.append((members, others))
    return groups


def _tie_partners(members: list, layer: object) -> str:
    return ", ".join(f"'{m.name}'" for m in members if m is not layer)


def resolve_ties(model, layers, tie: str) -> Tuple[List[Tuple[object, list]], List[str]]:
    """Applies the ``tie`` policy.  Returns (tied linear, its group) pairs that
    must become TiedTTLinear / shared modules, and the ties that were broken."""
    keep_plan: List[Tuple[object, list]] = []
    broken: List[str] = []
    for members, others in tie_groups(model, layers):
        live = [m for m in members if m.reason is None]
        if not live:
            continue
        names = [m.name for m in members] + others
        if tie == "skip":
            for m in live:
                m.reason = f"weight tied to {_tie_partners(members, m) or ', '.join(others)} (tie='skip')"
            continue
        if tie == "untie":
            broken.append(" = ".join(names))
            continue
        # tie == "keep": the whole group converts together, or none of it does
        blockers = [m for m in members if m.reason is not None]
        why = None
        if others:
            why = f"weight also held by {', '.join(others)}"
        elif blockers:
            why = f"weight tied to '{blockers[0].name}', which stays dense ({blockers[0].reason})"
        else:
            embs = [m for m in members if m.kind == "embedding"]
            lins = [m for m in members if m.kind == "linear"]
            if len(embs) > 1 and len({_emb_config(e.module) for e in embs}) > 1:
                why = "tied embeddings with different options cannot share one TTEmbedding"
            elif not embs and len({id(l.module.bias) if l.module.bias is not None else None
                                   for l in lins}) > 1:
                why = "tied Linears with different biases cannot share one TTLinear"
        if why is not None:
            for m in live:
                m.reason = (f"{why}; the tie is kept by leaving it dense (tie='keep'; pass "
                            "tie='untie' to convert the tied layers separately)")
            continue
        keep_plan.append((members[0], members))
    return keep_plan, broken


def group_source(members: list) -> object:
    """The layer of a kept tie group whose TT weight the others share (an embedding if any)."""
    embs = [m for m in members if m.kind == "embedding"]
    return embs[0] if embs else members[0]


def _emb_config(m: nn.Embedding):
    return (m.num_embeddings, m.embedding_dim, m.padding_idx)
