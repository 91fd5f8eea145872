"""comera.integrations.hf.RankAdaptiveCallback inside transformers.Trainer,
against the plain training loop it stands for, and the runnable example."""
import copy
import os
import subprocess
import sys

import pytest
import torch

import comera
import comera.integrations.ddp  # noqa: F401
import comera.integrations.hf  # noqa: F401

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, intermediate_size=128,
                                  max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return comera.convert(transformers.BertForMaskedLM(cfg), rank=8, embeddings=False)


class _Batches(torch.utils.data.Dataset):
    """8 fixed sequences: with batch size 8 every step sees all of them."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 120, (8, 16), generator=g)
        self.labels = torch.where(torch.rand(8, 16, generator=g) < 0.3, self.ids, torch.full_like(self.ids, -100))

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


RA_KWARGS = dict(gamma=0.5, threshold=5e-3, stage1_steps=4, stage2_steps=4, prune_every=3)


def test_callback_equals_the_manual_two_stage_loop(tmp_path, capsys):
    steps, lr = 8, 5e-3
    model, manual = _model(), None
    manual = copy.deepcopy(model)
    data = _Batches()

    # the loop the callback stands for: loss, optimizer step, RankAdaptive.step (the callback
    # attaches the controller to the Trainer's optimizer instead)
    start = comera.RankAdaptive(manual, balance=False, **RA_KWARGS).compression()
    target = 1.5 * start
    opt = torch.optim.AdamW(manual.parameters(), lr=lr, weight_decay=0.0)
    ra = comera.RankAdaptive(manual, target_compression=target, **RA_KWARGS)
    manual.train()
    for _ in range(steps):
        loss = manual(input_ids=data.ids, labels=data.labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        ra.step(opt)

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=8, learning_rate=lr,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0, weight_decay=0.0,
        logging_steps=2, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        dataloader_num_workers=0)
    cb = comera.integrations.hf.RankAdaptiveCallback(target_compression=target, **RA_KWARGS)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, callbacks=[cb],
        data_collator=transformers.default_data_collator,
        optimizers=(torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0), None))
    trainer.train()

    assert cb.rank_adaptive.stage == ra.stage == 2 and cb.rank_adaptive.steps == steps
    assert cb.rank_adaptive._attached is None                # detached when training ended
    assert comera.integrations.ddp.all_ranks(model) == comera.integrations.ddp.all_ranks(manual)
    assert cb.rank_adaptive.compression() == pytest.approx(ra.compression())
    assert ra.compression() > start                         # ranks were really cut
    for (name, p), q in zip(model.named_parameters(), manual.parameters()):
        if name.endswith("attention.self.key.bias"):
            # softmax ignores a per-query constant: this gradient is 0 up to rounding noise,
            # which Adam's normalisation blows up to lr-sized steps of random sign
            continue
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)
    # at every logging step: (step, stage, compression) in history and in the printed log line
    assert [s for s, _, _ in cb.history][:4] == [2, 4, 6, 8]
    assert cb.history[-1][1:] == (2, pytest.approx(ra.compression()))
    printed = capsys.readouterr().out
    assert "'comera_stage': 2" in printed and "comera_compression" in printed


def test_callback_takes_an_existing_controller_and_checks_arguments():
    model = _model()
    ra = comera.RankAdaptive(model, gamma=1e-3, threshold=1e-3, stage1_steps=1, stage2_steps=1)
    assert comera.integrations.hf.RankAdaptiveCallback(ra).rank_adaptive is ra
    with pytest.raises(TypeError, match="either"):
        comera.integrations.hf.RankAdaptiveCallback(ra, gamma=1.0)
    with pytest.raises(TypeError, match="keyword"):
        comera.integrations.hf.RankAdaptiveCallback()
    with pytest.raises(ValueError, match="gamma"):
        comera.integrations.hf.RankAdaptiveCallback(gamma=-1.0, threshold=0.0, stage1_steps=1,
                                                    stage2_steps=1)


def test_example_runs(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "hf_trainer.py"), "--steps", "12",
         "--batch-size", "4", "--seq-len", "32", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT})   # this checkout's comera, not an installed one
    assert out.returncode == 0, out.stderr[-3000:]
    assert "reloaded model matches: True" in out.stdout
    assert "stage 2" in out.stdout
    assert os.path.isfile(tmp_path / "model.safetensors")
