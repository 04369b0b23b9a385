"""GPU checks for the attention backends: each backend against eager, in fp32 and bf16, on plain,
left-padded and packed batches for every attention variant; then prefill timings at 4k and 16k
tokens. Not collected by pytest (no `test_` prefix) and not run in CI: it needs CUDA.

    python tests/gpu/run_gpu_checks.py            # about 5-8 minutes on one H200, no network
    python tests/gpu/run_gpu_checks.py --quick    # parity only, no timings
    python tests/gpu/run_gpu_checks.py --cpu --variants mla_capped_windowed_moe   # parity of one variant, CPU

Flash backends run only where their package is importable (flash-attn 2: `flash_attn`; 3:
`flash_attn_interface`; 4: `flash_attn.cute`, installable offline from carried wheels). Flash
kernels take fp16/bf16 only, so their fp32 rows are skipped. Exit status 1 if any difference is
above its tolerance: fp32 max|Δlogit| <= 1e-3 (TF32 off), bf16 max|Δlogit| <= 0.05·max|logit|
plus agreement of the greedy next token on >= 97% of positions.

Mixture-of-experts variants in bf16: a token whose two best experts score within bf16 rounding of each other
may pick the other expert under another attention kernel (a routing flip), which moves its logits far more
than the tolerance although both kernels compute the same function. Where a bf16 comparison fails, it is run
again with every router's output (expert ids and weights) fixed to the eager reference's (`fixed_routing`).
Fixing the routing hides the routers themselves, so a routing flip is accepted only where that run shows it is one:
the logits then within tolerance, every router's own logits within the bf16 tolerance of the reference's (a
router fed the same hidden states scores the same), and the choices those routers would have made differing from
the reference's in at most `MAX_FLIPPED_SHARE` of (token, slot) choices (near-ties are rare). Then "routing flip"
(ok; the share is printed); otherwise "real difference", naming what failed.

Each model is built after `torch._dynamo.reset()`: flex's block masks are compiled per `mask_mod` closure
(transformers' `masking_utils` builds new ones for every model and mask kind), and dynamo's recompile limit (8
per function) counts across all the models of this one process; past it flex ran unfused. One model's
`generate` compiles a bounded number of times (`tests/test_gpu_checks.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from backend_cases import VARIANTS  # noqa: E402
from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available, is_flash_attn_4_available  # noqa: E402

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM  # noqa: E402
from modular_decoder.backend_features import missing_features  # noqa: E402
from modular_decoder.routers import TopKRouter  # noqa: E402

BACKENDS = {
    "sdpa": True,
    "flex_attention": True,
    "flash_attention_2": is_flash_attn_2_available(),
    "flash_attention_3": is_flash_attn_3_available(),
    "flash_attention_4": is_flash_attn_4_available(),
}
# Parity model: small but with realistic head sizes (d_h 64) and lengths past the flex block size.
PARITY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              head_dim=64, max_position_embeddings=4096, position_embedding_type="rope",
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# MLA in the parity model: 64 + 32 wide q/k, 64 wide v
MLA = dict(attention_type="mla", kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)
# Timing model: a 1B-class layer shape, GQA 16/4, 4 layers (prefill time is per layer anyway).
TIMING = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
              num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=16384,
              position_embedding_type="rope", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def config_for(variant: str, base: dict) -> ModularDecoderConfig:
    fields = dict(base)
    fields.update(MLA if variant == "mla" else VARIANTS[variant])
    if variant == "mla":
        fields.pop("head_dim", None)
    if "sliding_window" in fields:
        fields["sliding_window"] = 64
    if fields.get("rope_parameters") is None:
        fields.pop("rope_parameters")
    return ModularDecoderConfig(**fields)


def build(config, backend: str, dtype, device: str = "cuda") -> ModularDecoderForCausalLM:
    torch._dynamo.reset()  # each model's flex compiles count on their own (see the module docstring)
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM._from_config(config, attn_implementation="eager", dtype=dtype)
    model = model.to(device).eval()
    if backend != "eager":
        model.set_attn_implementation(backend)  # the real load-time path, kernel lookup included
    return model


def batches(vocab: int):
    g = torch.Generator().manual_seed(0)
    plain = dict(input_ids=torch.randint(0, vocab, (2, 300), generator=g))
    ids = torch.randint(1, vocab, (2, 300), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :120] = 0  # left padding
    padded = dict(input_ids=ids, attention_mask=mask)
    lengths = [130, 70, 200]
    packed = dict(input_ids=torch.randint(0, vocab, (1, sum(lengths)), generator=g),
                  position_ids=torch.cat([torch.arange(n) for n in lengths])[None])
    return {"plain": plain, "padded": padded, "packed": packed}


@contextlib.contextmanager
def recorded_routing(model):
    """Record every router's output (logits, weights, expert ids) per call: {module name: [outputs, ...]}."""
    routing: dict[str, list] = {}

    def hook(name):
        return lambda module, args, output: routing.setdefault(name, []).append(
            tuple(t.detach().clone() for t in output))

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, TopKRouter)]
    try:
        yield routing
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def fixed_routing(model, routing: dict, seen: dict | None = None):
    """Replace each router's expert ids and weights with those `recorded_routing` saw on a reference model
    (same module names, same calls in the same order); the model's own router logits are kept. `seen`, if
    given, collects what each router computed itself before the replacement: {name: [(logits, ids), ...]}."""
    calls = {name: iter(outputs) for name, outputs in routing.items()}

    def hook(name):
        def replace(module, args, output):
            _, weights, indices = next(calls[name])
            if indices.shape != output[2].shape:
                raise ValueError(f"{name}: recorded routing for {tuple(indices.shape)}, got {tuple(output[2].shape)}")
            if seen is not None:
                seen.setdefault(name, []).append((output[0].detach().clone(), output[2].detach().clone()))
            return output[0], weights.to(output[1].dtype), indices
        return replace

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n in routing]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# A routing flip is a near-tie broken the other way: rare. More flipped choices than this is not rounding.
MAX_FLIPPED_SHARE = 0.05


def flipped_share(routing: dict, other: dict) -> float:
    """Share of (token, slot) expert choices that differ between two recorded routings of the same inputs (each
    {name: [(logits, ..., ids), ...]}: the ids last)."""
    flipped = total = 0
    for name, outputs in routing.items():
        for mine, theirs in zip(outputs, other[name]):
            flipped += (mine[-1].sort(-1).values != theirs[-1].sort(-1).values).sum().item()
            total += mine[-1].numel()
    return flipped / max(total, 1)


def router_logit_difference(routing: dict, other: dict) -> float:
    """Largest |Δ router logit| between two recordings, relative to the largest router logit of `routing`."""
    diff = scale = 0.0
    for name, outputs in routing.items():
        for mine, theirs in zip(outputs, other[name]):
            diff = max(diff, (mine[0].float() - theirs[0].float()).abs().max().item())
            scale = max(scale, mine[0].float().abs().max().item())
    return diff / max(scale, 1e-30)


def measure(got: torch.Tensor, want: torch.Tensor, keep: torch.Tensor, fp32: bool) -> tuple[float, float, float, bool]:
    """(max|Δlogit|, relative to max|logit|, greedy agreement, within tolerance) over the kept positions."""
    diff = (got - want).abs()[keep].max().item()
    rel = diff / want[keep].abs().max().item()
    agree = (got.argmax(-1) == want.argmax(-1))[keep].float().mean().item()
    return diff, rel, agree, diff <= 1e-3 if fp32 else (rel <= 0.05 and agree >= 0.97)


def compare(model, inputs: dict, want: torch.Tensor, fp32: bool, reference_routing: dict | None = None) -> dict:
    """`model`'s logits on `inputs` against the reference's `want`. If they differ beyond tolerance and the
    reference's routing was recorded, run again with the routing fixed to it: a pass then is a routing flip."""
    keep = inputs["attention_mask"].bool() if "attention_mask" in inputs else torch.ones(
        want.shape[:2], dtype=torch.bool, device=want.device)
    with recorded_routing(model) as routing:
        got = model(**inputs, use_cache=False).logits.float()
    diff, rel, agree, good = measure(got, want, keep, fp32)
    result = dict(diff=diff, rel=rel, agree=agree, good=good, verdict="ok" if good else "FAIL")
    if not good and reference_routing:
        seen: dict = {}
        with fixed_routing(model, reference_routing, seen):
            fixed = model(**inputs, use_cache=False).logits.float()
        fixed_diff, fixed_rel, fixed_agree, fixed_good = measure(fixed, want, keep, fp32)
        share, router_rel = flipped_share(seen, reference_routing), router_logit_difference(reference_routing, seen)
        flip = fixed_good and share <= MAX_FLIPPED_SHARE and router_rel <= 0.05
        result.update(good=flip, fixed_diff=fixed_diff, flipped=share, router_rel=router_rel,
                      verdict=(f"ok: routing flip ({share:.2%} of expert choices; with the reference's routing "
                               f"max|d| {fixed_diff:.2e}, rel {fixed_rel:.1e}; router logits rel {router_rel:.1e})")
                      if flip else
                      f"FAIL: real difference (with the reference's routing: max|d| {fixed_diff:.2e}, rel "
                      f"{fixed_rel:.1e}, argmax {fixed_agree:.3f}; routers' own choices differ in {share:.2%} (at most "
                      f"{MAX_FLIPPED_SHARE:.0%}), their logits by rel {router_rel:.1e} (at most 5.0e-02))")
    return result


@torch.no_grad()
def parity(device: str = "cuda", variants=tuple(VARIANTS)) -> bool:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    ok = True
    print(f"{'variant':18} {'backend':18} {'dtype':9} {'batch':7} {'max|d|':>10} {'rel':>8} {'argmax':>7}  verdict")
    for variant in variants:
        config = config_for(variant, PARITY)
        for dtype in (torch.float32, torch.bfloat16):
            eager = build(config, "eager", dtype, device)
            data = batches(config.vocab_size)
            reference, routing = {}, {}
            for name, inputs in data.items():
                inputs = {k: v.to(device) for k, v in inputs.items()}
                with recorded_routing(eager) as routing[name]:
                    reference[name] = eager(**inputs, use_cache=False).logits.float()
            for backend, available in BACKENDS.items():
                status = None
                if not available:
                    status = "not installed"
                elif missing_features(config, backend):
                    status = "refused at load (declared)"
                elif backend.startswith("flash") and dtype == torch.float32:
                    status = "fp32 not taken by flash kernels"
                if status:
                    print(f"{variant:18} {backend:18} {str(dtype)[6:]:9} {'-':7} {'':>10} {'':>8} {'':>7}  {status}")
                    continue
                model = build(config, backend, dtype, device)
                for name, inputs in data.items():
                    inputs = {k: v.to(device) for k, v in inputs.items()}
                    fp32 = dtype == torch.float32
                    # fp32 routes identically; only bf16 near-ties flip
                    r = compare(model, inputs, reference[name], fp32, None if fp32 else routing[name])
                    ok &= r["good"]
                    print(f"{variant:18} {backend:18} {str(dtype)[6:]:9} {name:7} {r['diff']:10.2e} {r['rel']:8.1e} "
                          f"{r['agree']:7.3f}  {r['verdict']}")
                del model
            del eager
            if device == "cuda":
                torch.cuda.empty_cache()
    return ok


@torch.no_grad()
def timings() -> None:
    config = config_for("gqa", TIMING)
    config.num_key_value_heads = 4
    print("\nprefill, bf16, batch 1, 4 layers of d=2048 H=16/4 d_h=128 (median of 5 after 2 warm-ups)")
    print(f"{'backend':18} {'tokens':>7} {'ms':>9} {'tok/s':>10} {'peak GiB':>9}")
    for backend, available in {"eager": True, **BACKENDS}.items():
        if not available:
            continue
        model = build(config, backend, torch.bfloat16)
        for tokens in (4096, 16384):
            ids = torch.randint(0, config.vocab_size, (1, tokens), device="cuda")
            try:
                for _ in range(2):
                    model(input_ids=ids, use_cache=False, logits_to_keep=1)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                times = []
                for _ in range(5):
                    start = time.perf_counter()
                    model(input_ids=ids, use_cache=False, logits_to_keep=1)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                ms = sorted(times)[2] * 1000
                peak = torch.cuda.max_memory_allocated() / 2**30
                print(f"{backend:18} {tokens:7d} {ms:9.1f} {tokens / ms * 1000:10.0f} {peak:9.1f}")
            except torch.OutOfMemoryError:
                print(f"{backend:18} {tokens:7d}  out of memory")
                torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="parity only")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--cpu", action="store_true", help="parity only, on the CPU (flex compiles slowly there)")
    args = parser.parse_args()
    if args.cpu:
        ok = parity("cpu", args.variants)
    elif not torch.cuda.is_available():
        print("SKIP: no CUDA device; these checks need a GPU (or --cpu).")
        return 0
    else:
        print(torch.cuda.get_device_name(), "torch", torch.__version__, {k: v for k, v in BACKENDS.items()})
        ok = parity("cuda", args.variants)
        if not args.quick:
            timings()
    print("\nALL OK" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
