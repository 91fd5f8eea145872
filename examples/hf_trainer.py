"""Rank-adaptive masked-LM pre-training with the Hugging Face Trainer.

A small BERT (built from a config, nothing downloaded) learns masked-byte
prediction on Python source code from the standard library that ships with
the interpreter.  Compared with a plain Trainer script, three lines are added
(marked "comera"): convert the model, pass RankAdaptiveCallback, and
patch_trainer so that the Trainer reads its comera checkpoints back.

    python examples/hf_trainer.py                  # 200 steps, under a minute on 2 cores
    python examples/hf_trainer.py --steps 40       # a quick smoke run
    python examples/hf_trainer.py --out run --resume   # continue from run/checkpoint-*

Stage 1 (the first half) discovers ranks under an L1 pull on the gates;
stage 2 drives the live TT size to --target compression, then the ranks
freeze.  The Trainer checkpoints every --save-every steps (comera folders,
with the controller state); --resume continues the run from the last one
(its masks are drawn in the collator, so a mid-epoch resume is close to, not
exactly, the uninterrupted run, as for any model in transformers).  At the
end the model is saved with comera.save (live ranks in the metadata) and
reloaded into a freshly converted model.
"""
import argparse
import glob
import os
import sysconfig
import tempfile

import torch
from transformers import BertConfig, BertForMaskedLM, Trainer, TrainingArguments

import comera
from comera.integrations.hf import RankAdaptiveCallback, patch_trainer

PAD, MASK, CLS, SEP, OFFSET = 0, 1, 2, 3, 4          # byte b -> token b + OFFSET
VOCAB = 256 + OFFSET


class SourceBytes(torch.utils.data.Dataset):
    """Fixed-length windows of bytes from the standard library's .py files."""

    def __init__(self, seq_len: int, max_windows: int):
        files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
        data = b"".join(open(f, "rb").read() for f in files[:40])
        n = min(max_windows, len(data) // seq_len)
        self.windows = torch.tensor(list(data[: n * seq_len]), dtype=torch.long).view(n, seq_len)

    def __len__(self):
        return self.windows.shape[0]

    def __getitem__(self, i):
        return {"input_ids": self.windows[i] + OFFSET}


def mask_tokens(batch, p=0.15):
    """BERT-style masking: 15% of positions are predicted (80% [MASK], 10% random, 10% kept)."""
    ids = torch.stack([b["input_ids"] for b in batch])
    labels = ids.clone()
    chosen = torch.rand(ids.shape) < p
    labels[~chosen] = -100
    roll = torch.rand(ids.shape)
    ids = ids.clone()
    ids[chosen & (roll < 0.8)] = MASK
    rnd = chosen & (roll >= 0.8) & (roll < 0.9)
    ids[rnd] = torch.randint(OFFSET, VOCAB, (int(rnd.sum()),))
    return {"input_ids": ids, "labels": labels}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--target", type=float, default=30.0, help="target compression of the TT layers")
    ap.add_argument("--out", default=None, help="output folder (default: a temporary one)")
    ap.add_argument("--save-every", type=int, default=None,
                    help="checkpoint every this many steps (default: half the run)")
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    args = ap.parse_args()
    torch.manual_seed(0)
    out = args.out or tempfile.mkdtemp(prefix="comera_hf_")

    config = BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=512, max_position_embeddings=128, pad_token_id=PAD)
    model = BertForMaskedLM(config)
    model = comera.convert(model, rank=args.rank)                                  # comera (1/3)
    print(comera.summary(model) if hasattr(comera, "summary") else model)

    train_args = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
                                   learning_rate=2e-3, warmup_steps=args.steps // 20, logging_steps=20,
                                   save_strategy="steps", report_to=[], use_cpu=True,
                                   save_steps=args.save_every or max(1, args.steps // 2),
                                   dataloader_num_workers=0)
    callback = RankAdaptiveCallback(gamma=0.5, threshold=1e-2, stage1_steps=args.steps // 2,  # comera (2/3)
                                    stage2_steps=args.steps - args.steps // 2,
                                    target_compression=args.target)
    trainer = Trainer(model=model, args=train_args, train_dataset=SourceBytes(args.seq_len, 4096),
                      data_collator=mask_tokens, callbacks=[callback])
    patch_trainer(trainer)                       # comera (3/3): resume from / load comera checkpoints
    trainer.train(resume_from_checkpoint=True if args.resume else None)

    ra = callback.rank_adaptive
    print(f"stage {ra.stage}, ranks frozen: {ra.frozen}, compression of the TT layers: "
          f"{ra.compression():.1f}x (target {args.target}x)")
    comera.prune(model)                          # cut the dead ranks for real
    path = os.path.join(out, "model.safetensors")
    comera.save(model, path)
    fresh = comera.convert(BertForMaskedLM(config), rank=args.rank)
    comera.load(fresh, path)                     # takes the pruned ranks from the file
    ids = SourceBytes(args.seq_len, 4)[0]["input_ids"][None]
    model.eval()
    fresh.eval()
    same = torch.allclose(fresh(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)
    print(f"saved {path} ({os.path.getsize(path) / 1e6:.2f} MB); reloaded model matches: {same}")


if __name__ == "__main__":
    main()
