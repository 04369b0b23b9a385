"""The shapes and sizes of the GPU matrix: the GPU plan and the tiny CPU smoke plan that runs the same code."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers as tf


@dataclass(frozen=True)
class Plan:
    name: str
    dtype: torch.dtype
    llama: dict  # LlamaConfig fields
    deepseek_v3: dict  # DeepseekV3Config fields (dense layers only)
    logits_tokens: int  # tokens of the logits comparison
    prefill_tokens: int  # 1 x N no-cache prefill, logits_to_keep=1
    prompt_b1: int  # prompt of the batch-1 generate
    prompt_big: int  # prompts of the big-batch generate
    big_batch: int
    new_tokens: int  # new tokens per generate (min_new_tokens = max_new_tokens)
    sync_new_tokens: int  # new tokens of the host-sync count
    profile_new_tokens: int  # new tokens of the profiled big-batch generate (generate_profile)
    grid_batches: tuple[int, ...]  # MLA decode-step grid: batches x contexts, then the extra points
    grid_contexts: tuple[int, ...]
    grid_extra: tuple[tuple[int, int], ...]
    crossover_points: tuple[tuple[int, int], ...]  # MLA step crossover: (batch, context) points
    crossover_new_tokens: tuple[int, ...]  # ... and new tokens per step at each point
    chunked: tuple[int, int]  # MLA chunked prefill: (batch, tokens)
    chunks: tuple[int, ...]  # chunk sizes
    train_batch: tuple[int, int]  # (rows, tokens) of the padded batch; the packed row holds rows x tokens
    repeats: int  # timed repeats of each generate / training measurement (after one warm-up)
    step_repeats: int  # timed repeats of the short ones: a prefill, one decode step
    guard_scale: float  # multiplies each part's time guard
    budget_s: float  # the whole run: parts that would start later are recorded as skipped

    def vocab_of(self, family: str) -> int:
        return (self.llama if family == "llama" else self.deepseek_v3)["vocab_size"]


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# meta-llama/Llama-3.2-1B config.json (random weights of that shape)
LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=LLAMA3_ROPE)
# deepseek-ai/DeepSeek-V2-Lite config.json's attention (16 heads at d 2048, kv_lora 512, nope 128, rope 64, v 128)
# with a q_lora_rank of 1536 as DeepSeek-V2 and V3 have (V2-Lite has none; V3 has 128 heads at d 7168), 8 dense
# layers, a small FFN and vocabulary so that the decode step is mostly attention; transformers' DeepseekV3 class
MLA_ATTENTION = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                             num_attention_heads=16, num_key_value_heads=16, q_lora_rank=1536, kv_lora_rank=512,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             max_position_embeddings=40960)
TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=512,
                  rope_parameters=LLAMA3_ROPE)
TINY_DEEPSEEK_V3 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=512)

FULL = Plan(name="gpu", dtype=torch.bfloat16, llama=LLAMA_3_2_1B, deepseek_v3=MLA_ATTENTION,
            logits_tokens=512, prefill_tokens=4096, prompt_b1=128, prompt_big=512, big_batch=32, new_tokens=128,
            sync_new_tokens=16, profile_new_tokens=16, grid_batches=(1, 8, 32), grid_contexts=(1024, 8192, 32768),
            grid_extra=((16, 32768),), crossover_points=((1, 8192), (16, 8192), (16, 32768)),
            crossover_new_tokens=(1, 8, 16, 32, 64, 128, 256), chunked=(16, 32768), chunks=(1024, 4096),
            train_batch=(4, 1024), repeats=2, step_repeats=10, guard_scale=1.0,
            budget_s=420.0)  # 7 minutes: with start-up and install, inside one 10-minute device call
SMOKE = Plan(name="smoke (CPU, tiny shapes, fp32)", dtype=torch.float32, llama=TINY_LLAMA,
             deepseek_v3=TINY_DEEPSEEK_V3, logits_tokens=16, prefill_tokens=32, prompt_b1=8, prompt_big=8, big_batch=2,
             new_tokens=4, sync_new_tokens=2, profile_new_tokens=4, grid_batches=(1, 2), grid_contexts=(16,),
             grid_extra=((2, 64),), crossover_points=((1, 16), (2, 32)), crossover_new_tokens=(1, 4), chunked=(2, 64),
             chunks=(16, 32), train_batch=(2, 16), repeats=1, step_repeats=1,
             guard_scale=3.0, budget_s=900.0)  # a shared 2-core CPU: room for contention


def llama_config(plan: Plan) -> tf.LlamaConfig:
    return tf.LlamaConfig(**plan.llama)


def deepseek_v3_config(plan: Plan) -> tf.DeepseekV3Config:
    layers = plan.deepseek_v3["num_hidden_layers"]
    return tf.DeepseekV3Config(**plan.deepseek_v3, first_k_dense_replace=layers, n_group=1, topk_group=1)
