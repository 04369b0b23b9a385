"""A reshape run's report as text: the table printed by the command and the section of the model card."""

from __future__ import annotations


def _row(label: str, before, after, healed=None, fmt: str = "{:,}") -> str:
    cells = [fmt.format(before), fmt.format(after)] + ([fmt.format(healed)] if healed is not None else [])
    return f"| {label} | " + " | ".join(cells) + " |"


def _measured(measured: dict | None) -> str:
    """What the logits did, measured: the only ground on which a report says "exact"."""
    if measured is None:
        return "Logits not measured."
    change, tokens = measured["max_logit_change"], measured["tokens"]
    if measured["exact"]:
        return f"Exact: logits within {change:.1e} of the model before it on {tokens:,} calibration tokens (rounding)."
    return f"Logits moved by up to {change:.3g} on {tokens:,} calibration tokens."


def report_markdown(report: dict) -> str:
    """Before / after (/ healed) table, each transformation's claims, the layer distances and a rank sweep."""
    before, after, heal = report["before"], report["after"], report.get("heal")
    head = "| | before | after |" + (" after healing |" if heal else "")
    lines = [head, "|---|---:|---:|" + ("---:|" if heal else ""),
             _row("parameters", before["parameters"], after["parameters"]),
             _row("active parameters / token", before["active_parameters"], after["active_parameters"]),
             _row(f"KV cache bytes / token ({report['measured_in']}, measured)", before["kv_cache_bytes_per_token"],
                  after["kv_cache_bytes_per_token"]),
             _row("held-out perplexity", before["perplexity"], after["perplexity"],
                  heal["perplexity"] if heal else None, fmt="{:.3f}")]
    calib = report["calibration"]
    lines += ["", f"Calibration: {calib['source']}; {calib['calibration_tokens']:,} tokens calibrate"
              + (" and heal" if heal else "") + f", {calib['held_out_tokens']:,} other tokens measure perplexity."]
    if heal:
        share = heal["gap_closed"]
        if share is not None:
            closed = f"closed {share:.0%} of the perplexity gap on the held-out text."
        else:  # older reports have no `no_gap`
            closed = f"had no perplexity gap to close ({heal.get('no_gap', 'none was measured')})."
        lines.append(f"Healing: {heal['steps']} steps of KL distillation from the source (lr {heal['learning_rate']}) "
                     f"into {len(heal['trainable'])} changed module(s) {closed}")
    if report.get("draft_vocab"):
        lines.append(draft_vocab_summary(report["draft_vocab"]))
    if report.get("mtp"):
        lines.append(mtp_summary(report["mtp"]))
    for change in report["transformations"]:
        approx = change["approximates"] or "nothing by design"
        lines.append(f"- `{change['transformation']}`: keeps {change['keeps']}; approximates {approx}. "
                     + _measured(change.get("measured")))
        for candidate in change.get("candidates", ()):
            first, last = candidate["layers"]
            lines.append(f"  - layers {first}-{last}: angular distance {candidate['angular_distance']:.4f}")
    if report.get("sweep"):
        lines += ["", "| kv_lora_rank | KV cache bytes / token | held-out perplexity |", "|---:|---:|---:|"]
        lines += [f"| {row['kv_lora_rank']} | {row['kv_cache_bytes_per_token']:,} | {row['perplexity']:.3f} |"
                  for row in report["sweep"]]
    return "\n".join(lines)


def mtp_summary(mtp: dict) -> str:
    """What the added MTP modules bought, measured on the held-out text."""
    decoding = mtp["decoding"]
    agreement = ", ".join(f"{share:.1%}" for share in mtp["top1_agreement"])
    same = "the same tokens as" if decoding["same_tokens_as_plain_greedy"] else "OTHER TOKENS THAN"
    return (f"MTP: {mtp['modules']} module(s) trained by self-distillation for {mtp['steps']} steps (lr "
            f"{mtp['learning_rate']}, KL {mtp['kl_first']:.3f} -> {mtp['kl_last']:.3f}); top-1 agreement with the "
            f"model on held-out text {agreement} (per module); greedy `generate(use_mtp=True)` from "
            f"{decoding['prompts']} held-out prompts ({decoding['prompt_tokens']} + {decoding['new_tokens']} tokens) "
            f"accepted {decoding['acceptance']:.1%} of drafts, {decoding['tokens_per_forward']:.2f} tokens per "
            f"forward, {same} plain greedy decoding.")


def draft_vocab_summary(draft: dict) -> str:
    """What the draft vocabulary covers, measured on the held-out text."""
    return (f"Draft vocabulary: the MTP modules draft among the {draft['size']:,} of {draft['vocab_size']:,} token ids "
            f"the model predicts most often on {draft['ranked_on_tokens']:,} calibration tokens (FR-Spec); they cover "
            f"{draft['coverage']:.1%} of its argmax predictions on {draft['held_out_tokens']:,} held-out tokens (the "
            "model still verifies every draft: the tokens are plain decoding's).")


def summary(report: dict) -> str:
    """What the command prints."""
    timing = report.get("timing_s", {})
    tail = f"\n\n{timing.get('total', 0):.1f} s, peak resident memory {report.get('peak_rss_mb', 0):,} MB"
    return report_markdown(report) + tail


def render_card(config, report: dict) -> str:
    """The model card of a reshaped checkpoint: the usual card with the report as its description."""
    from ..cards import render_model_card

    names = ", ".join(f"`{c['transformation']}`" for c in report["transformations"])
    description = (f"Reshaped by `modular-decoder reshape` ({names}) from `{report['source']}`.\n\n"
                   "## Reshape report\n\n" + report_markdown(report))
    return render_model_card(config, title="reshaped modular_decoder checkpoint", description=description,
                             tags=["reshaped"])
