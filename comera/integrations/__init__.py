"""Glue between comera and the tools people already train with.

- :mod:`comera.integrations.ddp`: rank pruning under
  ``torch.nn.parallel.DistributedDataParallel`` (keep ranks identical in every
  process, then re-wrap the model, since DDP's gradient buckets are built for
  the old parameter shapes).
- :mod:`comera.integrations.fsdp`: rank pruning and whole-tensor checkpoints
  under FSDP2's ``fully_shard`` (renews FSDP's records of the re-shaped
  sharded parameters; ``RankAdaptive(..., pruner=comera.integrations.fsdp.prune)``).
- :mod:`comera.integrations.hf`: ``RankAdaptiveCallback`` for the Hugging Face
  ``transformers.Trainer`` and ``patch_trainer`` for resuming from / loading the best of
  a converted model's Trainer checkpoints (:mod:`comera.integrations.hf.checkpoints`);
  transformers is imported only when these modules are.

Nothing here is imported by ``import comera``.
"""
