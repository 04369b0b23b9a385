"""Parts on the Llama-3.2-1B-shaped pair: prefill, eager and compiled generate, host syncs, flash backends."""

from __future__ import annotations

import torch

from .bench import Bench, dynamic_cache, generate, no_extra
from .timing import PartTimeout, Skip, agreement, count_syncs, ratio, timed

FLASH_BACKENDS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


@torch.inference_mode()
def llama_prefill(bench: Bench) -> dict:
    theirs, ours = bench.pair("llama")
    ids = bench.ids(1, bench.plan.logits_tokens)
    diff = (ours(ids).logits.float() - theirs(ids).logits.float()).abs().max().item()
    prompt = bench.ids(1, bench.plan.prefill_tokens)
    seconds = timed({"transformers": theirs, "ours": ours},
                    lambda m: m(prompt, use_cache=False, logits_to_keep=1), bench.plan.step_repeats)
    n = bench.plan.prefill_tokens
    return {"logits_tokens": bench.plan.logits_tokens, "logits_max_abs_diff": diff,
            "transformers_ms": 1e3 * seconds["transformers"], "ours_ms": 1e3 * seconds["ours"],
            "ratio": ratio(seconds), "rows": [
                (f"logits, {bench.plan.logits_tokens} tokens, max abs diff", "", f"{diff:.3g}", ""),
                (f"prefill 1 x {n}, `logits_to_keep=1` (ms)", f"{1e3 * seconds['transformers']:.2f}",
                 f"{1e3 * seconds['ours']:.2f}", f"{ratio(seconds):.2f}x")]}



@torch.inference_mode()
def _generate_pair(bench: Bench, label: str, batch: int, prompt_len: int, extra: dict | None = None,
                   **kwargs) -> tuple[dict, tuple]:
    """Greedy `generate` of `plan.new_tokens` on both sides: tokens/s (whole call, prompt included) and agreement.
    `extra` maps a side to a function of its model returning more kwargs for each call (a fresh cache, say)."""
    theirs, ours = bench.pair("llama")
    prompt, new = bench.ids(batch, prompt_len), bench.plan.new_tokens
    tokens, extra = {}, extra or {}

    def run(model):
        more = extra.get("ours" if model is ours else "transformers", no_extra)(model)
        tokens[model] = generate(model, prompt, new, **kwargs, **more)

    seconds = timed({"transformers": theirs, "ours": ours}, run, bench.plan.repeats)
    rates = {side: batch * new / s for side, s in seconds.items()}
    agree = agreement(tokens[theirs], tokens[ours], prompt_len)
    result = {"batch": batch, "prompt": prompt_len, "new_tokens": new, "transformers_tok_s": rates["transformers"],
              "ours_tok_s": rates["ours"], "ratio": ratio(seconds), "greedy_agreement": agree}
    row = (f"{label} b{batch}, {prompt_len}-token prompt{'s' if batch > 1 else ''}, +{new} (tok/s)",
           f"{rates['transformers']:,.1f}", f"{rates['ours']:,.1f}",
           f"{ratio(seconds):.2f}x{'' if agree['equal'] else ' (tokens differ: ' + str(agree['fraction']) + ')'}")
    return result, row


def _generate_batches(bench: Bench, label: str, **kwargs) -> dict:
    """`_generate_pair` at batch 1 and at the plan's big batch; a guard firing at the second keeps the first."""
    plan, result, rows = bench.plan, {}, []
    for batch, prompt_len in ((1, plan.prompt_b1), (plan.big_batch, plan.prompt_big)):
        try:
            result[f"b{batch}"], row = _generate_pair(bench, label, batch, prompt_len, **kwargs)
        except PartTimeout as error:  # keep the batch already measured; the guard fires once, so stop here
            result[f"b{batch}"] = {"timeout": str(error)}
            rows.append((f"{label} b{batch}", "", str(error), ""))
            break
        rows.append(row)
    return result | {"rows": rows}


def llama_generate(bench: Bench) -> dict:
    return _generate_batches(bench, "eager `generate`")


def llama_generate_dynamic_cache(bench: Bench) -> dict:
    """`llama_generate` with ours given transformers' `DynamicCache`: if the eager-generate gap to transformers
    closes, the cache layout (non-contiguous prefix views, pre-allocated storage) is its cause."""
    return {"ours_cache": "transformers DynamicCache"} | _generate_batches(
        bench, "eager `generate`, ours on transformers' `DynamicCache`", extra={"ours": dynamic_cache})


def compiled_decode(bench: Bench) -> dict:
    """`cache_implementation="static"`: transformers compiles the decode step (CUDA graphs) on a GPU, anew for
    each batch size; on the CPU it does not compile by default, so the smoke run times the static cache eagerly
    (same calls)."""
    result = {"compiled": bench.device == "cuda"}
    if bench.device != "cuda":
        result["note"] = "no CUDA: transformers compiles the static-cache decode step only on a GPU; timed eagerly"
    return result | _generate_batches(bench, "compiled decode (static cache)", cache_implementation="static")


def host_syncs(bench: Bench) -> dict:
    """Host syncs (`torch.cuda.set_sync_debug_mode("warn")` warnings) in a left-padded batched `generate` and in
    two training steps (forward + backward)."""
    if bench.device != "cuda":
        raise Skip("no CUDA: torch.cuda.set_sync_debug_mode counts device-to-host syncs, which a CPU does not have")
    theirs, ours = bench.pair("llama")
    plan = bench.plan
    prompt = bench.ids(plan.big_batch, plan.prompt_b1)
    mask = torch.ones_like(prompt)
    mask[1::2, : plan.prompt_b1 // 4] = 0  # every other row left-padded
    batch = bench.ids(2, plan.prompt_b1)
    counts = {}
    for side, model in (("transformers", theirs), ("ours", ours)):
        with torch.inference_mode():
            generate(model, prompt, 2, attention_mask=mask)  # warm-up
            in_generate = count_syncs(lambda: generate(model, prompt, plan.sync_new_tokens, attention_mask=mask))

        def two_steps():
            for _ in range(2):
                model(input_ids=batch, labels=batch, use_cache=False).loss.backward()

        model.train()
        training = count_syncs(two_steps)
        model.eval().zero_grad(set_to_none=True)
        counts[side] = {"generate": in_generate, "two_training_steps": training}
    return {"generate_batch": plan.big_batch, "new_tokens": plan.sync_new_tokens, **counts, "rows": [
        (f"host syncs, generate b{plan.big_batch} +{plan.sync_new_tokens}, left-padded",
         str(counts["transformers"]["generate"]), str(counts["ours"]["generate"]), ""),
        ("host syncs, two training steps", str(counts["transformers"]["two_training_steps"]),
         str(counts["ours"]["two_training_steps"]), "")]}


def flash_available() -> dict[str, bool]:
    """Which flash backends can run here (`Skip` without CUDA: the kernels are CUDA-only)."""
    import transformers.utils as hf_utils

    if not torch.cuda.is_available():
        raise Skip("no CUDA: flash kernels run on a GPU only (their parity tests: tests/test_backends.py)")
    return {name: getattr(hf_utils, f"is_flash_attn_{name[-1]}_available")() for name in FLASH_BACKENDS}


def use_backend(model, name: str) -> None:
    model.set_attn_implementation(name)  # the load-time path: checks the kernel package and the config


def flash_backends(bench: Bench) -> dict:
    """Each flash backend whose package imports: prefill time and greedy b1 tokens, both sides."""
    available = flash_available()
    if not any(available.values()):
        raise Skip("no flash package imports here (flash_attn, flash_attn_interface, flash_attn.cute)")
    result, rows = {"available": available}, []
    theirs, ours = bench.pair("llama")
    for name in (n for n, ok in available.items() if ok):
        try:
            for model in (theirs, ours):
                use_backend(model, name)
            prefill = llama_prefill(bench)
            result[name], row = _generate_pair(bench, f"{name} generate", 1, bench.plan.prompt_b1)
            result[name]["prefill"] = {k: v for k, v in prefill.items() if k != "rows"}
            rows += [(f"{name}: {r[0]}", *r[1:]) for r in prefill["rows"][1:]] + [row]
        except Exception as error:  # one backend failing keeps the others
            result[name] = {"error": f"{type(error).__name__}: {error}"[:400]}
        finally:
            for model in (theirs, ours):
                use_backend(model, "sdpa")
    return result | {"rows": rows}

