"""The registries: the config's allowed values come from them, each entry owns its rules, and
registering a new kind is one entry that works end to end; the model modules import one way."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import modular_decoder
from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM, parameter_count
from modular_decoder.attention import STANDARD_ATTENTION, linear_parameters
from modular_decoder.attention_layer import AttentionLayer
from modular_decoder.backend_features import missing_features
from modular_decoder.eager_attention import eager_attention
from modular_decoder.kinds import AttentionKind
from modular_decoder.positions import apply_rotary
from modular_decoder.registries import ATTENTIONS, MLPS, register_attention

BASE = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64)


class TiedQKAttention(AttentionLayer):
    """A toy kind: queries and keys share one projection (one K/V head per query head)."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx, scaling=config.head_dim**-0.5)
        self.head_dim = config.head_dim
        width = config.num_attention_heads * config.head_dim
        self.qk_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.o_proj = nn.Linear(width, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None, **kwargs):
        batch, seq = hidden_states.shape[:2]
        qk = self.qk_proj(hidden_states).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        qk = apply_rotary(qk, *position_embeddings)
        k, v = (qk, v) if cache is None else cache.update(qk, v, self.layer_idx)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention)
        out, weights = attention_interface(self, qk, k, v, attention_mask, scaling=self.scaling, **self.score_kwargs(kwargs))
        return self.o_proj(out.reshape(batch, seq, -1)), weights


class TiedQKKind(AttentionKind):
    name = "tied_qk"
    module = TiedQKAttention

    def rope_head_dim(self, config):
        return config.head_dim

    def cache_layer(self, config, layer_type, implementation, max_cache_len):
        return STANDARD_ATTENTION.cache_layer(config, layer_type, implementation, max_cache_len)

    def parameters(self, config):
        width = config.num_attention_heads * config.head_dim
        return 2 * linear_parameters(config.hidden_size, width, False) + linear_parameters(width, config.hidden_size, False)

    def bytes_per_token(self, config, element_bytes, quantization=None):
        return 2 * config.num_attention_heads * config.head_dim * element_bytes


@pytest.fixture
def tied_qk():
    kind = register_attention(TiedQKKind())
    yield kind
    del ATTENTIONS[kind.name]


def test_allowed_values_come_from_the_registries():
    assert {"standard", "mla", "dsa"} <= set(ATTENTIONS)
    with pytest.raises(ValueError, match=re.escape(str(sorted(ATTENTIONS)))):
        ModularDecoderConfig(**BASE, attention_type="tied_qk")
    with pytest.raises(ValueError, match=r"\['dense', 'gated', 'moe'\]"):
        ModularDecoderConfig(**BASE, mlp_type="sparse")
    assert set(MLPS) == {"dense", "gated", "moe"}


def test_a_registered_attention_kind_works_end_to_end(tied_qk):
    config = ModularDecoderConfig(**BASE, attention_type="tied_qk")
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(config).eval()
    assert isinstance(model.model.layers[0].self_attn, TiedQKAttention)
    assert parameter_count(config)["total"] == model.num_parameters()
    assert not missing_features(config, "sdpa")
    ids = torch.randint(0, 61, (1, 7))
    with torch.no_grad():
        # cached greedy decoding equals recomputing every step without a cache
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
        loop = ids
        for _ in range(6):
            logits = model(loop, use_cache=False).logits[:, -1]
            loop = torch.cat([loop, logits.argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(tokens, loop)
        model.set_attn_implementation("eager")
        out = model(ids, output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (1, 4, 7, 7)  # recorded like any kind's


def test_another_kinds_fields_are_refused_not_ignored():
    with pytest.raises(ValueError, match="kv_lora_rank.*attention_type='mla'"):
        ModularDecoderConfig(**BASE, kv_lora_rank=16)
    with pytest.raises(ValueError, match="qk_norm.*attention_type='standard'"):
        ModularDecoderConfig(**BASE, attention_type="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                             v_head_dim=8, qk_norm="head")
    with pytest.raises(ValueError, match="learned_position_offset.*'learned'"):
        ModularDecoderConfig(**BASE, learned_position_offset=2)


def _sibling_imports(path: Path, siblings: set[str]) -> set[str]:
    """The modules of the same package `path` imports relatively, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module.split(".")[0]] if node.module else [alias.name for alias in node.names]
            found |= set(names) & siblings
    return found


def test_model_modules_import_one_way():
    """No cycle among the model modules, function-level imports included (a cycle hidden in a function is
    still a cycle: the registries are built from the kinds, the blocks from the registries)."""
    files = {path.stem: path for path in Path(modular_decoder.__file__).parent.glob("*.py")}
    graph = {name: _sibling_imports(path, set(files)) - {name} for name, path in files.items()}
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for imported in sorted(graph[name]):
            assert state.get(imported) != "open", " -> ".join([*trail, name, imported])
            if imported not in state:
                visit(imported, [*trail, name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert {"registries"} <= graph["blocks"] and "blocks" not in graph["registries"]
