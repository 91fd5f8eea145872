"""transformers' generic model tests (ModelTesterMixin of transformers 5.25.0,
shipped unchanged in test_modeling_common.py) over RoBERTa models converted by
comera.convert.  The tester and the test class are comera's; each test that
cannot apply to a TT model is skipped in tt_skips.py with its reason."""
import unittest

from transformers import RobertaConfig, is_torch_available
from transformers.testing_utils import require_torch

from .comera_models import converted
from .test_modeling_common import ModelTesterMixin
from .tiny_tester import TinyEncoderTester
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


class RobertaTTModelTester(TinyEncoderTester):
    """Tiny RoBERTa configs; padding token 1, so position ids start at 2.  No
    padding token in the ids: RoBERTa numbers positions from input_ids
    (skipping padding) but not from inputs_embeds, and the mixin compares the
    two."""
    config_class = RobertaConfig
    extra_config = {"pad_token_id": 1}
    avoid_token = 1


@require_torch
class RobertaTTModelTest(TTSkips, ModelTesterMixin, unittest.TestCase):
    all_model_classes = tuple(converted(c) for c in (
        RobertaModel, RobertaForCausalLM, RobertaForMaskedLM, RobertaForMultipleChoice,
        RobertaForQuestionAnswering, RobertaForSequenceClassification,
        RobertaForTokenClassification)) if is_torch_available() else ()
    model_split_percents = [0.5, 0.8, 0.9]

    def setUp(self):
        self.model_tester = RobertaTTModelTester(self)
