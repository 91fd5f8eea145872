"""transformers' generic model tests (ModelTesterMixin of transformers 5.25.0,
shipped unchanged in test_modeling_common.py) over BERT models converted by
comera.convert.  The tester and the test class are comera's; each test that
cannot apply to a TT model is skipped below with its reason."""
import unittest

from transformers import BertConfig, is_torch_available
from transformers.models.auto import get_values
from transformers.testing_utils import require_torch, torch_device

from .comera_models import converted
from .test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask
from .tt_skips import TTSkips

if is_torch_available():
    import torch
    from transformers import (
        BertForMaskedLM,
        BertForMultipleChoice,
        BertForNextSentencePrediction,
        BertForPreTraining,
        BertForQuestionAnswering,
        BertForSequenceClassification,
        BertForTokenClassification,
        BertLMHeadModel,
        BertModel,
    )
    from transformers.models.auto.modeling_auto import MODEL_FOR_PRETRAINING_MAPPING_NAMES


class BertTTModelTester:
    """Tiny BERT configs and inputs for the mixin (the sizes transformers'
    own BERT tester uses: vocabulary 99, hidden 32, 2 layers, 4 heads)."""

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
        return BertConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                          num_hidden_layers=self.num_hidden_layers,
                          num_attention_heads=self.num_attention_heads,
                          intermediate_size=self.intermediate_size, hidden_act="gelu",
                          hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                          max_position_embeddings=self.max_position_embeddings,
                          type_vocab_size=self.type_vocab_size, is_decoder=False,
                          initializer_range=0.02)

    def prepare_config_and_inputs(self):
        shape = [self.batch_size, self.seq_length]
        input_ids = ids_tensor(shape, self.vocab_size)
        input_mask = random_attention_mask(shape)
        token_type_ids = ids_tensor(shape, self.type_vocab_size)
        return self.get_config(), input_ids, token_type_ids, input_mask

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, token_type_ids, input_mask = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "token_type_ids": token_type_ids,
                        "attention_mask": input_mask}


@require_torch
class BertTTModelTest(TTSkips, ModelTesterMixin, unittest.TestCase):
    all_model_classes = tuple(converted(c) for c in (
        BertModel, BertLMHeadModel, BertForMaskedLM, BertForMultipleChoice,
        BertForNextSentencePrediction, BertForPreTraining, BertForQuestionAnswering,
        BertForSequenceClassification, BertForTokenClassification)) if is_torch_available() else ()
    model_split_percents = [0.5, 0.8, 0.9]

    def setUp(self):
        self.model_tester = BertTTModelTester(self)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
        if return_labels and model_class.__name__ in get_values(MODEL_FOR_PRETRAINING_MAPPING_NAMES):
            inputs_dict["labels"] = torch.zeros(
                (self.model_tester.batch_size, self.model_tester.seq_length), dtype=torch.long,
                device=torch_device)
            inputs_dict["next_sentence_label"] = torch.zeros(
                self.model_tester.batch_size, dtype=torch.long, device=torch_device)
        return inputs_dict
