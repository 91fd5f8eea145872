"""transformers' generic model tests (ModelTesterMixin of transformers 5.25.0,
shipped unchanged in test_modeling_common.py) over BERT models converted by
comera.convert.  The tester and the test class are comera's; each test that
cannot apply to a TT model is skipped below with its reason."""
import unittest

from transformers import BertConfig, is_torch_available
from transformers.models.auto import get_values
from transformers.testing_utils import require_torch, torch_device

from .comera_models import converted
from .test_modeling_common import ModelTesterMixin
from .tiny_tester import TinyEncoderTester
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


class BertTTModelTester(TinyEncoderTester):
    """Tiny BERT configs (an encoder: not a decoder)."""
    config_class = BertConfig
    extra_config = {"is_decoder": False}


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
