"""Model presets and construction: transformers' RobertaForMaskedLM built
from a config (nothing is downloaded), and the CoMERA conversion of it."""
import copy
from dataclasses import asdict, dataclass, fields
from typing import Optional

import torch
from torch import nn

from comera.layers.base import dense_params, live_ranks, size_from_ranks, tt_layers


@dataclass
class Preset:
    """Every default a preset sets; command-line flags override each one."""
    # model
    layers: int
    hidden: int
    heads: int
    ffn: int
    seq_len: int
    vocab_size: int = 8192
    dropout: float = 0.1
    # optimisation
    batch_size: int = 32
    steps: int = 1000
    lr: float = 5e-4
    lr_comera: Optional[float] = None  # the CoMERA method's peak lr (None: lr)
    warmup: float = 0.06          # fraction of the steps spent warming up
    weight_decay: float = 0.01
    clip: float = 1.0
    # evaluation and checkpoints
    eval_every: int = 100
    valid_blocks: int = 64
    checkpoint_every: int = 200
    log_every: int = 10
    # corpus budget (None = everything): token streams and tokenizer sample
    max_train_tokens: Optional[int] = None
    tokenizer_max_mb: Optional[float] = None
    # CoMERA
    rank: int = 16                # initial TT rank of the linear layers
    vocab_rank: int = 32          # ... of the word embedding and the output decoder
    init: str = "random"
    gamma: float = 0.5            # stage-1 L1 strength: a gate loses lr * gamma per step
    threshold: float = 1e-2
    stage1: float = 0.3           # fraction of the steps in stage 1
    stage2: float = 0.4           # fraction of the steps in stage 2 (then ranks are frozen)
    target_compression: Optional[float] = None
    prune_every: Optional[int] = 50
    stage2_rule: str = "saliency"  # or "magnitude": how stage 2 picks the ranks to remove


PRESETS = {
    # A whole demo (tokenizer, dense and CoMERA) in about 4 minutes on 2 CPU
    # cores.  No dropout: a few hundred steps see each sequence at most once.
    # Randomly initialised TT cores learn slower than dense weights at the
    # same lr, so CoMERA gets a larger one.  The ranks start at 16 / 32
    # (about 10x on the converted layers) and stage 2 takes them to 25x.
    "tiny": Preset(layers=2, hidden=128, heads=2, ffn=512, seq_len=64, dropout=0.0, batch_size=16,
                   steps=200, lr=1e-3, lr_comera=3e-3, eval_every=50, checkpoint_every=100,
                   max_train_tokens=1_000_000, tokenizer_max_mb=4.0, rank=16, vocab_rank=32,
                   gamma=0.5, stage1=0.3, stage2=0.4, target_compression=25.0, prune_every=20),
    # The smallest preset whose dense model learns more than token frequencies,
    # sized by measurement (docs/pretrain.md, "Presets"): dense takes about
    # 10 minutes on 2 idle CPU cores (7,500 steps of 32 x 128 tokens, about
    # 77 ms each: 31M tokens, about 4 passes over the standard library),
    # CoMERA about 7.  Stage 1's L1 strength is 0.1, not 0.5: under AdamW a
    # gate entry survives only where its gradient's signal-to-noise ratio
    # exceeds gamma, and at 0.5 stage 1 killed most ranks that minibatch
    # noise hides (validation loss 6.36 against 6.17 after 1,500 steps at the
    # same final size; docs/pretrain.md, "What makes TT training learn").
    "mini": Preset(layers=2, hidden=128, heads=4, ffn=512, seq_len=128, vocab_size=4096, dropout=0.0,
                   batch_size=32, steps=7500, lr=3e-3, lr_comera=3e-3, eval_every=500,
                   checkpoint_every=1000, log_every=50, max_train_tokens=8_000_000, tokenizer_max_mb=4.0,
                   rank=16, vocab_rank=32, gamma=0.1, stage1=0.3, stage2=0.4, target_compression=25.0,
                   prune_every=50),
    # mini cut short for `make demo`: the tokenizer and both methods in about
    # 3 minutes on 2 idle CPU cores (at most 5 on a loaded one).
    "demo": Preset(layers=2, hidden=128, heads=4, ffn=512, seq_len=128, vocab_size=4096, dropout=0.0,
                   batch_size=32, steps=1000, lr=3e-3, lr_comera=3e-3, eval_every=100,
                   checkpoint_every=500, log_every=20, max_train_tokens=3_000_000, tokenizer_max_mb=4.0,
                   rank=16, vocab_rank=32, gamma=0.1, stage1=0.3, stage2=0.4, target_compression=25.0,
                   prune_every=20),
    "small": Preset(layers=4, hidden=256, heads=4, ffn=1024, seq_len=256, batch_size=32, steps=3000,
                    lr=7e-4, lr_comera=2e-3, eval_every=250, checkpoint_every=500,
                    tokenizer_max_mb=12.0, rank=24, vocab_rank=48, gamma=0.5,
                    target_compression=25.0, prune_every=50),
    # The paper's six-encoder CodeBERT-style model (d 768, FFN 3072, 12 heads).
    "paper": Preset(layers=6, hidden=768, heads=12, ffn=3072, seq_len=256, batch_size=16,
                    steps=20000, lr=3e-4, eval_every=500, valid_blocks=32, checkpoint_every=500,
                    rank=32, vocab_rank=64, prune_every=100),
}


def preset(name: str) -> Preset:
    """A copy of the named preset.

    Example:
        >>> preset("paper").hidden, preset("tiny").layers
        (768, 2)
    """
    if name not in PRESETS:
        raise ValueError(f"--preset must be one of {sorted(PRESETS)}, got {name!r}")
    return copy.deepcopy(PRESETS[name])


def preset_fields():
    return [f.name for f in fields(Preset)]


def _require_transformers():
    try:
        import transformers  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("comera pretrain needs the 'train' extra: pip install 'comera[train]'") from e


def roberta_config(p: Preset, vocab_size: int):
    """The RobertaConfig of a preset for a tokenizer of ``vocab_size`` tokens."""
    _require_transformers()
    from transformers import RobertaConfig
    from comera.pretrain.tokenizer import BOS, EOS, PAD
    if p.hidden % p.heads:
        raise ValueError(f"hidden ({p.hidden}) must be a multiple of heads ({p.heads})")
    return RobertaConfig(
        vocab_size=vocab_size, hidden_size=p.hidden, num_hidden_layers=p.layers,
        num_attention_heads=p.heads, intermediate_size=p.ffn,
        # RoBERTa numbers positions from padding_idx + 1.
        max_position_embeddings=p.seq_len + PAD + 1, type_vocab_size=1,
        hidden_dropout_prob=p.dropout, attention_probs_dropout_prob=p.dropout,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
        # Untied output layer: the word embedding and the decoder are each
        # compressed on their own (a TT embedding cannot share a dense weight).
        tie_word_embeddings=False)


def _share_output_bias(model: nn.Module) -> None:
    """RobertaLMHead keeps a ``bias`` that its forward never reads when the
    decoder is untied; point it at the decoder's bias so that no dead
    parameter is trained or counted."""
    head = model.lm_head
    if getattr(head.decoder, "bias", None) is not None:
        head.bias = head.decoder.bias


def build_dense(p: Preset, vocab_size: int, seed: int) -> nn.Module:
    """A freshly initialised RobertaForMaskedLM (seeded).

    Example:
        >>> m = build_dense(preset("tiny"), vocab_size=1000, seed=0)
        >>> type(m).__name__, m.config.num_hidden_layers
        ('RobertaForMaskedLM', 2)
    """
    _require_transformers()
    from transformers import RobertaForMaskedLM
    torch.manual_seed(seed)
    model = RobertaForMaskedLM(roberta_config(p, vocab_size))
    _share_output_bias(model)
    return model


# Embeddings other than the word embedding are tiny (positions, one token
# type); the CoMERA model converts the linear layers and the word embedding only.
CONVERT_EXCLUDE = ["roberta.embeddings.position_embeddings", "roberta.embeddings.token_type_embeddings"]
# The two vocabulary-sized layers (the biggest) get their own rank.
VOCAB_LAYERS = ["roberta.embeddings.word_embeddings", "lm_head.decoder"]


def convert_ranks(p: Preset) -> dict:
    """The ``rank`` mapping handed to comera.convert (first matching glob wins)."""
    ranks = {name: p.vocab_rank for name in VOCAB_LAYERS}
    ranks["*"] = p.rank
    return ranks


def build_comera(p: Preset, vocab_size: int, seed: int) -> nn.Module:
    """The dense model of :func:`build_dense` with its linear layers and word
    embedding converted to TT layers by :func:`comera.convert`."""
    import comera
    if not hasattr(comera, "convert"):
        raise RuntimeError("--method comera needs comera.convert, which this build of comera lacks")
    model = build_dense(p, vocab_size, seed)
    torch.manual_seed(seed + 1)
    model = comera.convert(model, rank=convert_ranks(p), exclude=CONVERT_EXCLUDE, embeddings=True,
                           init=p.init)
    _share_output_bias(model)
    return model


def tt_size(layer: nn.Module) -> tuple:
    """(dense parameters the layer replaces, live TT core parameters)."""
    return dense_params(layer), size_from_ranks(layer, live_ranks(layer))


def count_parameters(model: nn.Module) -> dict:
    """Parameter counts: everything, and the converted (TT) layers: the dense
    parameters they stand for and their live core parameters."""
    total = sum(p.numel() for p in model.parameters())
    dense_conv, live_conv, stored_tt = 0, 0, 0
    layers = list(tt_layers(model))
    for _, layer in layers:
        d, live = tt_size(layer)
        dense_conv += d
        live_conv += live
        stored_tt += sum(c.numel() for c in layer.cores) + sum(g.numel() for g in layer.gates)
    live_gates = sum(sum(live_ranks(m)) for _, m in layers)
    return {
        "total": total,
        # The same model with every converted layer dense again.
        "dense_equivalent": total - stored_tt + dense_conv,
        # Dead ranks are only physically removed by pruning; count them out.
        "total_live": total - stored_tt + live_conv + live_gates,
        "converted_dense": dense_conv,
        "converted_tt": live_conv,
        "converted_layers": len(layers),
    }


def describe_preset(p: Preset) -> dict:
    return asdict(p)
