"""transformers' ModelTesterMixin (its release's tests/test_modeling_common.py) on LlamaModel / LlamaForCausalLM and on ours,
same tester sizes (the Llama template's). Copied into the sdist's tests/models/ by run.sh; not part of the suite."""
import unittest

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel
from transformers.testing_utils import require_torch

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM, ModularDecoderModel

from ..test_modeling_common import ModelTesterMixin, ids_tensor


class Tester:
    def __init__(self, parent, config_class, extra):
        self.parent, self.config_class, self.extra = parent, config_class, extra
        self.batch_size, self.seq_length, self.is_training = 13, 7, True
        self.vocab_size, self.hidden_size, self.num_hidden_layers = 99, 32, 2
        self.num_attention_heads, self.num_key_value_heads, self.intermediate_size = 2, 2, 37
        self.hidden_act, self.max_position_embeddings, self.initializer_range = "gelu", 512, 0.02
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2
        self.head_dim = 16
        self.num_labels = 3
        self.num_choices = 4
        self.type_sequence_label_size = 2

    def get_config(self):
        return self.config_class(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size, hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings, initializer_range=self.initializer_range,
            pad_token_id=self.pad_token_id, bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id,
            **self.extra)

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        mask = torch.tril(torch.ones_like(input_ids))
        return self.get_config(), {"input_ids": input_ids, "attention_mask": mask}


@require_torch
class LlamaCommonTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (LlamaModel, LlamaForCausalLM)
    config_class, extra = LlamaConfig, {"tie_word_embeddings": False}
    test_headmasking = False
    test_pruning = False

    def setUp(self):
        self.model_tester = Tester(self, self.config_class, self.extra)


class OursCommonTest(LlamaCommonTest):
    all_model_classes = (ModularDecoderModel, ModularDecoderForCausalLM)
    config_class, extra = ModularDecoderConfig, {"tie_word_embeddings": False}

# transformers' tests find base / causal-LM classes by name in its own tables, which list only its families
from transformers.models.auto import modeling_auto  # noqa: E402

modeling_auto.MODEL_MAPPING_NAMES["modular_decoder"] = "ModularDecoderModel"
modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES["modular_decoder"] = "ModularDecoderForCausalLM"


class OursMoeCommonTest(LlamaCommonTest):
    """Ours with routed experts (Mixtral-like), where the experts kernels and router logits apply."""

    all_model_classes = (ModularDecoderModel, ModularDecoderForCausalLM)
    config_class = ModularDecoderConfig
    extra = {"tie_word_embeddings": False, "mlp_type": "moe", "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 16}


class OursSigmoidMoeCommonTest(OursMoeCommonTest):
    """Ours with DeepSeek-V3's sigmoid routers (correction bias, groups)."""

    extra = {**OursMoeCommonTest.extra, "router_type": "sigmoid_topk", "n_group": 2, "topk_group": 1}
