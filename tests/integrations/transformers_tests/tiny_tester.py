"""The model tester both TT suites give transformers' ModelTesterMixin: tiny
encoder configs (the sizes transformers' own BERT tester uses: vocabulary 99,
hidden 32, 2 layers, 4 heads) and their inputs.  A suite names its config
class and any extra config fields; RoBERTa also keeps its padding token out of
the ids."""
from .test_modeling_common import ids_tensor, random_attention_mask


class TinyEncoderTester:
    config_class = None  # BertConfig, RobertaConfig, ...
    extra_config = {}
    avoid_token = None  # an id never drawn (replaced by the next id)

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
        return self.config_class(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                                 num_hidden_layers=self.num_hidden_layers,
                                 num_attention_heads=self.num_attention_heads,
                                 intermediate_size=self.intermediate_size, hidden_act="gelu",
                                 hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                                 max_position_embeddings=self.max_position_embeddings,
                                 type_vocab_size=self.type_vocab_size, initializer_range=0.02,
                                 **self.extra_config)

    def prepare_config_and_inputs(self):
        shape = [self.batch_size, self.seq_length]
        input_ids = ids_tensor(shape, self.vocab_size)
        if self.avoid_token is not None:
            input_ids[input_ids == self.avoid_token] = self.avoid_token + 1
        input_mask = random_attention_mask(shape)
        token_type_ids = ids_tensor(shape, self.type_vocab_size)
        return self.get_config(), input_ids, token_type_ids, input_mask

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, token_type_ids, input_mask = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "token_type_ids": token_type_ids,
                        "attention_mask": input_mask}
