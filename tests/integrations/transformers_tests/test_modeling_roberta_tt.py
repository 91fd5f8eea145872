"""transformers' generic model tests (ModelTesterMixin of transformers 5.25.0,
shipped unchanged in test_modeling_common.py) over RoBERTa models converted by
comera.convert.  The tester and the test class are comera's; each test that
cannot apply to a TT model is skipped in tt_skips.py with its reason."""
import unittest

from transformers import RobertaConfig, is_torch_available
from transformers.testing_utils import require_torch

from .comera_models import converted
from .test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask
from .tt_skips import TTSkips

if is_torch_available():
    from transformers import (
        RobertaForCausalLM,
        RobertaForMaskedLM,
        RobertaForMultipleChoice,
        RobertaForQuestionAnswering,
        RobertaForSequenceClassification,
        RobertaForTokenClassification,
        RobertaModel,
    )


class RobertaTTModelTester:
    """Tiny RoBERTa configs and inputs for the mixin (vocabulary 99, hidden 32,
    2 layers, 4 heads; padding token 1, so position ids start at 2)."""

    def __init__(self, parent, batch_size=13, seq_length=7, is_training=True, vocab_size=99,
                 hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                 max_position_embeddings=512, type_vocab_size=16, type_sequence_label_size=2,
                 num_labels=3, num_choices=4):
        self.parent = parent
        self.batch_size, self.seq_length, self.is_training = batch_size, seq_length, is_training
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings, self.type_vocab_size = max_position_embeddings, type_vocab_size
        self.type_sequence_label_size, self.num_labels = type_sequence_label_size, num_labels
        self.num_choices = num_choices

    def get_config(self):
        return RobertaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                             num_hidden_layers=self.num_hidden_layers,
                             num_attention_heads=self.num_attention_heads,
                             intermediate_size=self.intermediate_size, hidden_act="gelu",
                             hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                             max_position_embeddings=self.max_position_embeddings,
                             type_vocab_size=self.type_vocab_size, initializer_range=0.02,
                             pad_token_id=1)

    def prepare_config_and_inputs(self):
        shape = [self.batch_size, self.seq_length]
        # no padding token in the ids: RoBERTa numbers positions from input_ids (skipping
        # padding) but not from inputs_embeds, and the mixin compares the two
        input_ids = ids_tensor(shape, self.vocab_size)
        input_ids[input_ids == 1] = 2
        input_mask = random_attention_mask(shape)
        token_type_ids = ids_tensor(shape, self.type_vocab_size)
        return self.get_config(), input_ids, token_type_ids, input_mask

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, token_type_ids, input_mask = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "token_type_ids": token_type_ids,
                        "attention_mask": input_mask}


@require_torch
class RobertaTTModelTest(TTSkips, ModelTesterMixin, unittest.TestCase):
    all_model_classes = tuple(converted(c) for c in (
        RobertaModel, RobertaForCausalLM, RobertaForMaskedLM, RobertaForMultipleChoice,
        RobertaForQuestionAnswering, RobertaForSequenceClassification,
        RobertaForTokenClassification)) if is_torch_available() else ()
    model_split_percents = [0.5, 0.8, 0.9]

    def setUp(self):
        self.model_tester = RobertaTTModelTester(self)
