"""`kv_heads=N`: MHA / GQA -> GQA / MQA by mean-pooling each group's K and V heads (Ainslie et al. 2023,
"GQA: Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints", section 2.1), or
more K/V heads by repeating them.

Every new K/V head serves a group of H/N query heads; it is the mean of the K/V heads those query heads
used, counted once per query head (`pooling_matrix`). An increase to a multiple of the old count (GQA -> MHA)
repeats heads, and fewer heads whose old heads are equal within each new group average equal heads: both
compute the source's function. Any other count (GQA 2 -> 3 of 6 query heads: new head 1 serves query heads
of old heads 0 and 1) averages different heads. Whether the logits moved is measured, not assumed.
`pool="first"` (keep the first head of each group) and `pool="random"` (fresh K/V weights) are the
baselines the GQA paper compares mean pooling with.
"""

from __future__ import annotations

import torch

from .rebuild import Change, derived_config, model_from_state, require_positive_int

POOLS = ("mean", "first", "random")


def check_kv_heads(config, kv_heads: int, pool: str = "mean") -> None:
    """Refuse what `kv_heads` cannot do on `config`, by option name."""
    require_positive_int("kv_heads", kv_heads)
    if config.attention_type != "standard":
        raise ValueError(f"`kv_heads` reshapes standard attention; this model has attention_type="
                         f"{config.attention_type!r}.")
    heads, old = config.num_attention_heads, config.num_key_value_heads
    if heads % kv_heads:
        raise ValueError(f"`kv_heads`={kv_heads} must divide the {heads} query heads (`num_attention_heads`).")
    if kv_heads == old:
        raise ValueError(f"`kv_heads`={kv_heads} is the model's current number of K/V heads: nothing to do.")
    if pool not in POOLS:
        raise ValueError(f"`kv_pool`={pool!r} is not one of {list(POOLS)}.")


def pooling_matrix(heads: int, old: int, new: int) -> torch.Tensor:
    """(new, old) weights: row j averages the old K/V heads of the query heads new head j serves."""
    matrix = torch.zeros(new, old, dtype=torch.float64)
    for query in range(heads):
        matrix[query // (heads // new), query // (heads // old)] += new / heads
    return matrix


def first_head_matrix(heads: int, old: int, new: int) -> torch.Tensor:
    """(new, old) selection: new head j is the old head of its group's first query head."""
    matrix = torch.zeros(new, old, dtype=torch.float64)
    for j in range(new):
        matrix[j, (j * (heads // new)) // (heads // old)] = 1.0
    return matrix


def _pool_heads(tensor: torch.Tensor, matrix: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Apply (new, old) `matrix` to the head axis of a (old·d_h, ...) tensor -> (new·d_h, ...)."""
    old = matrix.shape[1]
    heads = tensor.reshape(old, head_dim, -1).to(torch.float64)  # (old, d_h, rest)
    pooled = torch.einsum("no,odr->ndr", matrix, heads)
    return pooled.reshape(matrix.shape[0] * head_dim, *tensor.shape[1:]).to(tensor.dtype).contiguous()


def reshape_kv_heads(model, kv_heads: int, pool: str = "mean", seed: int = 0, copy: bool = True):
    """A new model with `kv_heads` K/V heads (see the module docstring); returns (model, Change)."""
    config = model.config
    check_kv_heads(config, kv_heads, pool)
    heads, old, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    matrix = (first_head_matrix if pool == "first" else pooling_matrix)(heads, old, kv_heads)
    generator = torch.Generator().manual_seed(seed)
    state, changed = {}, []
    for name, tensor in model.state_dict().items():
        if _is_kv_tensor(name, config):
            if pool == "random" and not name.endswith("norm.weight") and not name.endswith("norm.bias"):
                shape = (kv_heads * head_dim, *tensor.shape[1:])
                std = config.initializer_range if tensor.dim() > 1 else 0.0
                fresh = torch.randn(shape, generator=generator, dtype=torch.float32) * std
                state[name] = fresh.to(tensor.dtype)
            else:
                state[name] = _pool_heads(tensor, matrix, head_dim)
            changed.append(name.rsplit(".", 1)[0])
        else:
            state[name] = tensor
    new = model_from_state(derived_config(config, num_key_value_heads=kv_heads), state, model, copy=copy)
    change = Change(
        "kv_heads",
        keeps="queries, output projection, FFN, norms, embeddings",
        approximates=_what_it_approximates(pool, old, kv_heads),
        changed=sorted(set(changed)),
        details={"kv_heads": {"from": old, "to": kv_heads}, "pool": pool},
    )
    return new, change


def _what_it_approximates(pool: str, old: int, new: int) -> str:
    """What the new K/V heads are, by design; whether the logits moved is measured (`Change.measured`)."""
    if pool == "random":
        return "fresh random K/V heads (a baseline)"
    if new % old == 0:
        return ""  # every new head repeats the one old head all its query heads used
    if pool == "first":
        return "each new K/V head is the old head of its group's first query head (a baseline)"
    return "each new K/V head is the mean of the old heads its query heads used (exact where those are equal)"


def _is_kv_tensor(name: str, config) -> bool:
    """K/V projections (weights, biases) and, with a norm over the whole K projection
    (`qk_norm="full"`), that norm's weight and bias, which are per K/V head too."""
    if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
        return True
    return config.qk_norm == "full" and ".self_attn.qk_norm.k_norm." in name
