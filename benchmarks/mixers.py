"""The recurrent mixers of LFM2, OLMo hybrid, Qwen3.5-MoE and Kimi Linear: ours against each transformers class with
the same weights, one decode step of each mixer beside full attention as the cached context grows, and what each
preset caches per sequence against what its attention layers cache per token (CPU, fp32).

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks mixers [--repeats 3] [--prompt 512] [--new-tokens 32]
                                                           [--contexts 1024 4096 16384] [--families ...]
                                                           [--threads N] [--out FILE]

Side by side (`hybrid.side_by_side`): each family's layout at hidden 1,024, 4 layers (its linear layers and one full
layer as its released models interleave them, 8 attention heads of 128 over 2 K/V heads where standard, a dense
SwiGLU of 2,816 or 8 experts of 512, top-2, vocabulary 8,192), made by transformers' class and converted, both
loaded with `from_pretrained`: prefill of 1 x PROMPT tokens and greedy decode of NEW_TOKENS after 16 (batch 1, each
side through its own cache), the sides alternating, their ratio per repeat, the same decodes' ratio by their median step
(transformers' step / ours: a burst of other work on a shared machine stretches a few steps, which moves a mean, the
tokens/s, more than the median), then REPEATS x NEW_TOKENS decode steps of the two models taken in turn, each through
its own cache (`measure.interleaved_decode_steps`: the forward alone, no generate loop; the median and quartiles of the
ratios of adjacent steps), and the prefill's largest logit difference.

Flat in context (`hybrid.flat_in_context`): one-layer models of ours at hidden 1,024, one per mixer (Gated DeltaNet of
8 key / 16 value heads of 128, KDA of 8 heads of 128, the short convolution of 3 taps) and the full-attention layer
(8 heads of 128 over 2 K/V heads): the median time of one decode step at C cached tokens and the bytes its cache
holds, every kind and context alternating in one loop.

State against K/V (the contract's arithmetic, `contract.state_bytes_per_sequence`, `cache_bytes`): for each preset at
its published sizes, in bf16, the bytes its linear layers keep per sequence, its attention layers' bytes per token,
its cache at 4k, 32k and 128k tokens, and the cache the same model would hold with every layer attending.
Drafting (`drafting`): ours from the side-by-side folder, greedy decoding of NEW_TOKENS after an input-grounded prompt
(a random piece of 64 tokens, 16 others, the piece again), plain against prompt lookup (3 tokens a step), the two
alternating: the tokens of both (equal), tokens/s of each, and the share of drafted tokens kept. The weights are
random, so the share kept says what these random models repeat, not what a trained model would.
`--smoke`: tiny widths, a 32-token prompt, 4 new tokens, contexts 64 and 256.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers as tf

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM, preset_config
from modular_decoder.contract import cache_bytes, cache_bytes_per_token, state_bytes_per_sequence

from . import harness, measure
from .families import load_side
from .hybrid import flat_in_context, side_by_side, side_by_side_parser

FULL = dict(hidden_size=1024, vocab_size=8192, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2,
            head_dim=128, max_position_embeddings=32768, pad_token_id=None, bos_token_id=None, eos_token_id=None)
SMOKE = dict(FULL, hidden_size=64, vocab_size=256, intermediate_size=128, num_attention_heads=4, head_dim=16)
THREE_TO_ONE = ["linear_attention"] * 3 + ["full_attention"]
# the presets whose state and K/V bytes the run reports, and the transformers class each family's side is
PRESETS = ("lfm2", "olmo_hybrid", "qwen3_5_moe", "kimi_linear")
CLASSES = {"lfm2": "Lfm2ForCausalLM", "olmo_hybrid": "OlmoHybridForCausalLM",
           "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "kimi_linear": "KimiLinearForCausalLM"}
CONTEXTS = (4096, 32768, 131072)
PROMPT_LOOKUP_TOKENS = 3


def linear_widths(smoke: bool, value_heads: int = 16, value_dim: int = 128) -> dict:
    """Heads of the linear layers: 8 key heads of 128 (2 of 16 in a smoke run)."""
    heads, dim = (2, 16) if smoke else (8, 128)
    return dict(linear_num_key_heads=heads, linear_num_value_heads=heads * value_heads // 8,
                linear_key_head_dim=dim, linear_value_head_dim=dim * value_dim // 128)


def reference_configs(smoke: bool) -> dict:
    """Each family's transformers config at the benchmark's widths (module docstring)."""
    w = SMOKE if smoke else FULL
    sizes = {k: w[k] for k in ("hidden_size", "vocab_size", "intermediate_size", "num_attention_heads",
                               "num_key_value_heads", "max_position_embeddings", "pad_token_id", "bos_token_id",
                               "eos_token_id")}
    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=w["intermediate_size"] // 4)
    gdn = linear_widths(smoke)
    return {
        "lfm2": tf.Lfm2Config(**sizes, num_hidden_layers=4, layer_types=["conv", "conv", "full_attention", "conv"],
                              conv_L_cache=3, block_auto_adjust_ff_dim=False),
        "olmo_hybrid": tf.OlmoHybridConfig(**sizes, num_hidden_layers=4, layer_types=THREE_TO_ONE,
                                           **linear_widths(smoke, value_heads=8, value_dim=256),
                                           rope_parameters={"rope_type": "default", "rope_theta": None}),
        "qwen3_5_moe_text": tf.Qwen3_5MoeTextConfig(
            **{k: v for k, v in sizes.items() if k != "intermediate_size"}, head_dim=w["head_dim"], num_hidden_layers=4,
            layer_types=THREE_TO_ONE, **gdn, **experts, shared_expert_intermediate_size=experts["moe_intermediate_size"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}),
        **({"kimi_linear": getattr(tf, "KimiLinearConfig")(
            **dict(sizes, num_key_value_heads=w["num_attention_heads"]), num_hidden_layers=4, layer_types=THREE_TO_ONE,
            linear_num_heads=gdn["linear_num_key_heads"],
            linear_head_dim=gdn["linear_key_head_dim"], q_lora_rank=None, kv_lora_rank=w["hidden_size"] // 4,
            qk_nope_head_dim=w["head_dim"] // 2, qk_rope_head_dim=w["head_dim"] // 4, v_head_dim=w["head_dim"] // 2,
            n_shared_experts=1, **experts)} if hasattr(tf, "KimiLinearConfig") else {}),
    }


def one_layer_models(smoke: bool) -> dict:
    """Ours, one layer each: the three mixers and the full-attention layer, a small FFN and vocabulary."""
    w = SMOKE if smoke else FULL
    common = dict(hidden_size=w["hidden_size"], num_attention_heads=w["num_attention_heads"],
                  num_key_value_heads=w["num_key_value_heads"], head_dim=w["head_dim"], vocab_size=256,
                  intermediate_size=256, num_hidden_layers=1, max_position_embeddings=65536)
    linear = dict(common, layer_types=["linear_attention"], position_embedding_type="none")
    configs = {"gated_deltanet": ModularDecoderConfig(**linear, **linear_widths(smoke)),
               "kda": ModularDecoderConfig(**linear, linear_attention_type="kda",
                                           **linear_widths(smoke, value_heads=8)),
               "short_conv": ModularDecoderConfig(**linear, linear_attention_type="short_conv"),
               "full_attention": ModularDecoderConfig(**common, layer_types=["full_attention"])}
    torch.manual_seed(0)
    return {kind: ModularDecoderForCausalLM(config).eval() for kind, config in configs.items()}


def drafting(model, new_tokens: int, repeats: int, piece: int = 64) -> dict:
    """Greedy decoding of `new_tokens` after an input-grounded prompt, plain and with prompt lookup, alternating:
    tokens/s of each, whether their tokens are equal, and the share of drafted tokens kept."""
    prompt = grounded_tokens(model.config.vocab_size, torch.Generator().manual_seed(1), piece, 16, 2 * piece + 16)
    # the mask says every prompt token is text: without it `generate` reads the ids equal to `pad_token_id` as padding
    greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(prompt))
    cases = {"plain": {}, "prompt_lookup": {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}}
    tokens, kept = {}, []

    def run_of(name: str):
        def run() -> float:
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(prompt, return_dict_in_generate=True, **cases[name], **greedy)
            seconds = time.perf_counter() - start
            tokens[name] = out.sequences
            return new_tokens / seconds
        return run

    with CountingDrafts() as counts:
        rates = measure.alternating({name: run_of(name) for name in cases}, repeats)
        kept = counts.kept_share()
    return {"prompt_tokens": prompt.shape[1], "new_tokens": new_tokens, "draft_tokens": PROMPT_LOOKUP_TOKENS,
            "same_tokens": bool(torch.equal(tokens["plain"], tokens["prompt_lookup"])),
            "tokens_per_s": rates, "median_tokens_per_s": {n: statistics.median(v) for n, v in rates.items()},
            "median_ratio": statistics.median(d / p for d, p in zip(rates["prompt_lookup"], rates["plain"])),
            "drafted_tokens_kept": kept}


def grounded_tokens(vocab: int, generator: torch.Generator, piece: int, others: int, length: int) -> torch.Tensor:
    """(1, length) random tokens: a piece of `piece` tokens and `others` tokens after it, repeated (text that a model
    which copies continues, and prompt lookup drafts from)."""
    cycle = torch.cat([torch.randint(0, vocab, (1, piece), generator=generator),
                       torch.randint(0, vocab, (1, others), generator=generator)], dim=1)
    return cycle.repeat(1, -(-length // cycle.shape[1]))[:, :length]


class CountingDrafts:
    """Counts, while active, the tokens prompt lookup drafts and those its verification keeps (transformers'
    `PromptLookupCandidateGenerator`: its `get_candidates` / `update_candidate_strategy`)."""

    def __enter__(self):
        from transformers.generation import candidate_generator
        self.owner = candidate_generator.PromptLookupCandidateGenerator
        self.originals = (self.owner.get_candidates, self.owner.update_candidate_strategy)
        self.drafted = self.accepted = 0
        get_candidates, update = self.originals

        def counting_candidates(generator, input_ids, *args, **kwargs):
            out = get_candidates(generator, input_ids, *args, **kwargs)
            self.drafted += out[0].shape[1] - input_ids.shape[1]
            return out

        def counting_update(generator, input_ids, scores, num_matches, *args, **kwargs):
            self.accepted += int(num_matches)
            return update(generator, input_ids, scores, num_matches, *args, **kwargs)

        self.owner.get_candidates, self.owner.update_candidate_strategy = counting_candidates, counting_update
        return self

    def __exit__(self, *exc):
        self.owner.get_candidates, self.owner.update_candidate_strategy = self.originals

    def kept_share(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


def state_against_kv() -> list[dict]:
    """Per preset at its published sizes (bf16): the linear layers' state per sequence, the attention layers' bytes
    per token, the cache at `CONTEXTS` tokens, and the cache with every layer attending."""
    rows = []
    for name in PRESETS:
        config = preset_config(name)
        per_token = cache_bytes_per_token(config, torch.bfloat16)
        all_attention = per_token * config.num_hidden_layers // config.attention_layer_count
        rows.append({"preset": name, "layers": config.num_hidden_layers,
                     "linear_layers": config.num_hidden_layers - config.attention_layer_count,
                     "linear_attention_type": config.linear_attention_type,
                     "state_bytes_per_sequence": state_bytes_per_sequence(config, torch.bfloat16),
                     "kv_bytes_per_token": per_token,
                     "cache_bytes": {str(c): cache_bytes(config, c, dtype=torch.bfloat16) for c in CONTEXTS},
                     "all_attention_cache_bytes": {str(c): all_attention * c for c in CONTEXTS}})
    return rows


def report(result: dict) -> str:
    """The three tables (markdown)."""
    lines = ["| family | transformers class | prefill ours / it (median; range) | decode ours / it (median; range) "
             "| decode by median step | decode steps in turn (median; quartiles) | prefill tok/s ours | decode tok/s ours "
             "| largest logit diff |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for family, side in result["side_by_side"].items():
        cells = []
        for key in ("prefill", "decode", "decode_median_step", "decode_interleaved"):
            part = side.get(key, {"median_ratio": float("nan")})  # (a record from before the column)
            spread = part.get("ratios") or part.get("quartile_ratios") or [float("nan")]
            cells.append(f"{part['median_ratio']:.2f}x ({min(spread):.2f}-{max(spread):.2f})")
        lines.append(f"| {family} | {CLASSES[family]} | {' | '.join(cells)} | "
                     f"{side['prefill']['median_tokens_per_s']['ours']:.1f} | "
                     f"{side['decode']['median_tokens_per_s']['ours']:.1f} | {side['max_logit_diff']:.1e} |")
    kinds = list(result["flat_in_context"][0]["step_ms"])
    lines += ["", "| cached tokens | " + " | ".join(f"{k} step (ms)" for k in kinds) + " | "
              + " | ".join(f"{k} cache bytes" for k in kinds) + " |", "|---:|" + "---:|" * (2 * len(kinds))]
    for row in result["flat_in_context"]:
        lines.append(f"| {row['context']:,} | " + " | ".join(f"{row['step_ms'][k]:.2f}" for k in kinds) + " | "
                     + " | ".join(f"{row['cache_bytes'][k]:,}" for k in kinds) + " |")
    lines += ["", "| family (ours) | plain tok/s | prompt lookup tok/s | ratio (median) | drafted kept | same tokens |",
              "|---|---:|---:|---:|---:|---|"]
    for family, row in result.get("drafting", {}).items():
        kept = row["drafted_tokens_kept"]
        lines.append(f"| {family} | {row['median_tokens_per_s']['plain']:.1f} | "
                     f"{row['median_tokens_per_s']['prompt_lookup']:.1f} | {row['median_ratio']:.2f}x | "
                     f"{'-' if kept is None else f'{kept:.0%}'} | {row['same_tokens']} |")
    lines += ["", "| preset | linear layers | state per sequence | K/V per token | cache at "
              + " / ".join(f"{c // 1024}k" for c in CONTEXTS) + " | every layer attending, at the same |",
              "|---|---|---:|---:|---:|---:|"]
    for row in result["state_against_kv"]:
        mib = [f"{row['cache_bytes'][str(c)] / 2**20:,.0f}" for c in CONTEXTS]
        full = [f"{row['all_attention_cache_bytes'][str(c)] / 2**20:,.0f}" for c in CONTEXTS]
        lines.append(f"| {row['preset']} | {row['linear_layers']} of {row['layers']} ({row['linear_attention_type']}) "
                     f"| {row['state_bytes_per_sequence'] / 2**20:.2f} MiB | {row['kv_bytes_per_token']:,} B | "
                     f"{' / '.join(mib)} MiB | {' / '.join(full)} MiB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = side_by_side_parser("mixers", __doc__, [1024, 4096, 16384], CLASSES)
    args = parser.parse_args(argv)
    run = harness.begin("mixers", argv, args)
    prompt, new_tokens = (32, 4) if args.smoke else (args.prompt, args.new_tokens)
    contexts = [64, 256] if args.smoke else args.contexts
    configs = reference_configs(args.smoke)
    result = {"widths": SMOKE if args.smoke else FULL, "side_by_side": {}, "drafting": {}}
    for family in args.families:
        if family not in configs:  # a transformers release without the class
            continue
        with tempfile.TemporaryDirectory() as tmp:
            result["side_by_side"][family] = side_by_side(Path(tmp), configs[family], prompt, new_tokens,
                                                          args.repeats, reference=CLASSES[family])
            result["drafting"][family] = drafting(load_side(Path(tmp), "ours"), new_tokens, args.repeats)
    result["flat_in_context"] = flat_in_context(one_layer_models(args.smoke), contexts, args.repeats)
    result["state_against_kv"] = state_against_kv()
    print(report(result))
    harness.write_result(args.out, result, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
