"""``comera pretrain``: CodeBERT-style masked-language-model pre-training on
Python source, dense against CoMERA (needs the ``train`` extra).

Modules: corpus (files and the split), records (.jsonl / .parquet corpora),
tokenizer (byte-level BPE + cache), data (blocks, batch order, masking),
model (presets, RoBERTa, conversion), step (one optimizer step: DDP share,
micro-batches, bf16 autocast, torch.compile), processes (torchrun
processes), loop (the training loop of one method; its checkpoints go through
comera.storage), monitor (progress, memory, Ctrl-C), report, plots, pipeline
(the whole job: corpus -> tokenizer -> training -> report), cli (flags).

Example:
    >>> from comera.__main__ import main
    >>> main(["pretrain", "--help"])  # doctest: +SKIP
"""
