"""transformers.Trainer checkpoints of converted models: resuming (plain and pruned,
with the RankAdaptiveCallback's state) equals the uninterrupted run,
load_best_model_at_end loads the best checkpoint, and without
comera.integrations.hf.patch_trainer nothing is lost silently."""
import os
import shutil

import pytest
import torch

import comera
from comera.layers.base import tt_layers

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
hf = pytest.importorskip("comera.integrations.hf")
from hf_tiny import quiet  # noqa: E402

V, STEPS = 120, 8
RA_KWARGS = dict(gamma=2.0, threshold=2e-2, stage1_steps=2, stage2_steps=5, prune_every=2,
                 target_compression=9.0)     # prunes before step 4 and between steps 4 and 8


@pytest.fixture(autouse=True)
def _quiet_transformers():
    with quiet(transformers):
        yield


def _model(seed):
    """Tiny BERT with dropout on (so the resumed run needs the saved RNG state),
    TT embedding and a head tied to it."""
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, intermediate_size=128,
                                  max_position_embeddings=32)
    return comera.convert(transformers.BertForMaskedLM(cfg), rank=8)


class _Tokens(torch.utils.data.Dataset):
    """64 fixed sequences: 8 batches an epoch, so checkpoint 4 is mid-epoch and the
    resumed Trainer skips batches (a fixed collator: a collator that draws random
    masks does not resume exactly mid-epoch in transformers, even for a dense model)."""

    def __init__(self, n=64, seed=3):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, V, (n, 16), generator=g)
        self.labels = torch.where(torch.rand(n, 16, generator=g) < 0.3, self.ids,
                                  torch.full_like(self.ids, -100))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _trainer(model, out, callbacks=(), patch=True, compute_metrics=None, **kw):
    opts = dict(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=8,
                learning_rate=5e-3, warmup_steps=2, save_strategy="steps", save_steps=4,
                logging_steps=2, report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0)
    opts.update(kw)
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**opts),
                                   train_dataset=_Tokens(), callbacks=list(callbacks),
                                   data_collator=transformers.default_data_collator,
                                   eval_dataset=_Tokens(8, seed=4) if "eval_strategy" in kw else None,
                                   compute_metrics=compute_metrics)
    return hf.patch_trainer(trainer) if patch else trainer


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), (k, (a[k] - b[k]).abs().max())


def _ranks(model):
    return {n: list(layer.ranks) for n, layer in tt_layers(model)}


def test_resume_equals_the_uninterrupted_run(tmp_path):
    full = _model(0)
    _trainer(full, tmp_path / "a").train()
    ckpt = tmp_path / "a" / "checkpoint-4"
    assert os.path.isfile(ckpt / "comera-model.safetensors")

    resumed = _model(1)                     # other initial values: all must come from the folder
    assert not torch.equal(resumed.bert.encoder.layer[0].output.dense.cores[0],
                           full.bert.encoder.layer[0].output.dense.cores[0])
    trainer = _trainer(resumed, tmp_path / "b")
    trainer.train(resume_from_checkpoint=str(ckpt))
    assert trainer.state.global_step == STEPS
    _assert_same(_state(resumed), _state(full))

    # resume_from_checkpoint=True picks the last checkpoint of output_dir
    shutil.copytree(ckpt, tmp_path / "c" / "checkpoint-4")
    again = _model(2)
    _trainer(again, tmp_path / "c").train(resume_from_checkpoint=True)
    _assert_same(_state(again), _state(full))


@pytest.mark.parametrize("own_controller", [False, True])
def test_pruned_resume_restores_ranks_optimizer_and_controller(tmp_path, own_controller):
    full = _model(0)
    cb = hf.RankAdaptiveCallback(**RA_KWARGS)
    _trainer(full, tmp_path / "a", [cb]).train()
    ckpt = tmp_path / "a" / "checkpoint-4"
    saved = comera.from_pretrained(transformers.BertForMaskedLM, str(ckpt))
    assert _ranks(saved) != _ranks(_model(0)), "the run must have pruned before step 4"
    assert _ranks(full) != _ranks(saved), "and pruned again after it"
    assert os.path.isfile(ckpt / hf.RANK_ADAPTIVE_STATE)

    resumed = _model(1)
    # the callback builds the controller on the loaded model, or gets one built (and
    # balanced) on the model before the checkpoint resized and filled it
    cb2 = hf.RankAdaptiveCallback(comera.RankAdaptive(resumed, **RA_KWARGS) if own_controller
                                  else None, **({} if own_controller else RA_KWARGS))
    trainer = _trainer(resumed, tmp_path / "b", [cb2])
    trainer.train(resume_from_checkpoint=str(ckpt))
    assert _ranks(resumed) == _ranks(full)
    _assert_same(_state(resumed), _state(full))
    ra, ra2 = cb.rank_adaptive.state_dict(), cb2.rank_adaptive.state_dict()
    assert ra2["step"] == ra["step"] == STEPS
    assert (ra2["lam"], ra2["frozen"]) == (ra["lam"], ra["frozen"])
    for x, y in zip(ra["signs"] + ra["saliency"], ra2["signs"] + ra2["saliency"]):
        assert torch.equal(x, y)
    assert cb2.history == cb.history      # the steps before the checkpoint come from its file
    # the resumed Trainer restored the optimizer state saved with the pruned shapes
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert all(s["exp_avg"].shape == p.shape for p, s in opt.state.items())


def _best_at_step_4():
    scores = iter([1.0, 5.0, 2.0, 0.0])       # evaluations at steps 2, 4, 6, 8

    def compute_metrics(_):
        return {"score": next(scores)}
    return compute_metrics


@pytest.mark.parametrize("rank_adaptive", [False, True])
def test_load_best_model_at_end_loads_the_best_checkpoint(tmp_path, rank_adaptive):
    model = _model(0)
    cbs = [hf.RankAdaptiveCallback(**RA_KWARGS)] if rank_adaptive else []
    trainer = _trainer(model, tmp_path, cbs, save_steps=2, eval_strategy="steps", eval_steps=2,
                       load_best_model_at_end=True, metric_for_best_model="score",
                       greater_is_better=True, compute_metrics=_best_at_step_4())
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-4")
    best = comera.from_pretrained(transformers.BertForMaskedLM, str(tmp_path / "checkpoint-4"))
    last = comera.from_pretrained(transformers.BertForMaskedLM, str(tmp_path / "checkpoint-8"))
    _assert_same(_state(model), _state(best))
    assert _ranks(model) != _ranks(last) or any(
        not torch.equal(a, b) for a, b in zip(_state(model).values(), _state(last).values())), \
        "the last checkpoint must differ from the best one, or the test shows nothing"
    if rank_adaptive:
        assert _ranks(best) != _ranks(last), "pruning between step 4 and 8 changes the shapes"
        assert cbs[0].rank_adaptive.steps == 4          # the controller state of checkpoint 4


def test_resume_without_patch_raises(tmp_path):
    _trainer(_model(0), tmp_path / "a", max_steps=4).train()
    with pytest.raises(ValueError, match="Can't find a valid checkpoint"):
        _trainer(_model(0), tmp_path / "b", patch=False).train(
            resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))


def test_load_best_without_patch_raises_at_the_first_checkpoint(tmp_path):
    trainer = _trainer(_model(0), tmp_path, patch=False, save_steps=2, eval_strategy="steps",
                       eval_steps=2, load_best_model_at_end=True)
    with pytest.raises(RuntimeError, match="patch_trainer"):
        trainer.train()
    assert trainer.state.global_step == 2
    # the weights of that step are on disk and load with comera.from_pretrained
    comera.from_pretrained(transformers.BertForMaskedLM, str(tmp_path / "checkpoint-2"))


def test_load_best_without_patch_with_callback_raises_before_training(tmp_path):
    trainer = _trainer(_model(0), tmp_path, [hf.RankAdaptiveCallback(**RA_KWARGS)], patch=False,
                       save_steps=2, eval_strategy="steps", eval_steps=2,
                       load_best_model_at_end=True)
    with pytest.raises(RuntimeError, match="patch_trainer"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_unpatched_checkpoints_warn(tmp_path):
    with pytest.warns(UserWarning, match="patch_trainer"):
        _trainer(_model(0), tmp_path, patch=False, max_steps=4).train()


def test_plain_checkpoint_into_a_converted_model_raises(tmp_path):
    dense = comera.to_dense(_model(0))
    _trainer(dense, tmp_path / "a", max_steps=4).train()
    assert os.path.isfile(tmp_path / "a" / "checkpoint-4" / "model.safetensors")
    with pytest.raises(ValueError, match="plain Trainer checkpoint"):
        _trainer(_model(0), tmp_path / "b").train(
            resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))


def test_callback_resume_needs_its_state_file(tmp_path):
    _trainer(_model(0), tmp_path / "a", max_steps=4).train()       # saved without the callback
    trainer = _trainer(_model(0), tmp_path / "b", [hf.RankAdaptiveCallback(**RA_KWARGS)])
    with pytest.raises(FileNotFoundError, match=hf.RANK_ADAPTIVE_STATE):
        trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))


def test_checkpoint_of_another_conversion_raises(tmp_path):
    _trainer(_model(0), tmp_path / "a", max_steps=4).train()
    other = comera.convert(comera.to_dense(_model(0)), rank=8, embeddings=False)
    with pytest.raises(ValueError, match="converted otherwise"):
        _trainer(other, tmp_path / "b").train(
            resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))


def test_patch_trainer_bad_input():
    with pytest.raises(TypeError, match="transformers.Trainer"):
        hf.patch_trainer(object())


def test_patched_trainer_still_resumes_a_dense_model(tmp_path):
    """Folders without a comera record go to the Trainer's own reader."""
    full = comera.to_dense(_model(0))
    _trainer(full, tmp_path / "a").train()
    assert os.path.isfile(tmp_path / "a" / "checkpoint-4" / "model.safetensors")
    resumed = comera.to_dense(_model(1))
    _trainer(resumed, tmp_path / "b").train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    _assert_same(_state(resumed), _state(full))
