"""`drop_layers=N`: remove the N consecutive layers whose input and output are most alike on calibration text
(Gromov et al. 2024, "The Unreasonable Ineffectiveness of the Deeper Layers", eq. 7).

For every block of N layers starting at layer l, the angular distance between the residual stream entering
layer l and the one leaving layer l+N-1,

    d(x^l, x^(l+N)) = arccos(x^l · x^(l+N) / (|x^l| |x^(l+N)|)) / π,

averaged over every calibration token (the paper uses the last token of each sequence; with the few
sequences a calibration here has, every token gives a steadier estimate). The block with the smallest
distance is removed; `layer_types`, `mlp_layer_types` and `no_rope_layers` lose the same entries.
"""

from __future__ import annotations

import math

import torch

from .rebuild import Change, derived_config, model_from_state, require_positive_int

BATCH = 4  # calibration sequences per forward


def check_drop_layers(config, drop_layers: int) -> None:
    require_positive_int("drop_layers", drop_layers)
    if drop_layers >= config.num_hidden_layers:
        raise ValueError(f"`drop_layers`={drop_layers} must leave at least one of the {config.num_hidden_layers} "
                         "layers (`num_hidden_layers`).")


@torch.no_grad()
def residual_streams(model, input_ids: torch.LongTensor) -> list[torch.Tensor]:
    """x^0 ... x^L: the residual stream entering each layer and leaving the last one, (B·T, d) each, fp32."""
    layers = model.model.layers
    streams: list[torch.Tensor | None] = [None] * (len(layers) + 1)

    def entering(index):
        def hook(module, args, kwargs):
            streams[index] = (args[0] if args else kwargs["x"]).detach().flatten(0, 1).float()
        return hook

    def leaving(module, args, kwargs, output):
        streams[-1] = output.detach().flatten(0, 1).float()

    handles = [layer.register_forward_pre_hook(entering(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles.append(layers[-1].register_forward_hook(leaving, with_kwargs=True))
    try:
        model.model(input_ids=input_ids, use_cache=False)  # the base model: no logits needed
    finally:
        for handle in handles:
            handle.remove()
    return streams


@torch.no_grad()
def block_distances(model, calibration_ids: torch.LongTensor, drop_layers: int, progress: bool = True
                    ) -> list[float]:
    """Mean angular distance (in [0, 1]) between the input of layer l and the output of layer l+N-1, for
    every start l in [0, L-N]."""
    from tqdm.auto import tqdm

    count = model.config.num_hidden_layers - drop_layers + 1
    sums, tokens = torch.zeros(count, dtype=torch.float64), 0
    was_training = model.training
    model.eval()
    batches = calibration_ids.split(BATCH)
    for batch in tqdm(batches, desc="layer distances", unit="batch", disable=not progress):
        streams = residual_streams(model, batch)
        for start in range(count):
            cosine = torch.nn.functional.cosine_similarity(streams[start], streams[start + drop_layers], dim=-1)
            sums[start] += (torch.arccos(cosine.clamp(-1, 1)) / math.pi).double().sum()
        tokens += streams[0].shape[0]
    model.train(was_training)
    return (sums / tokens).tolist()


def drop_block(model, calibration_ids: torch.LongTensor, drop_layers: int, progress: bool = True,
               copy: bool = True):
    """A new model without the most redundant block of `drop_layers` layers; returns (model, Change)."""
    config = model.config
    check_drop_layers(config, drop_layers)
    distances = block_distances(model, calibration_ids, drop_layers, progress)
    start = min(range(len(distances)), key=distances.__getitem__)
    removed = set(range(start, start + drop_layers))
    kept = [i for i in range(config.num_hidden_layers) if i not in removed]
    renumber = {old: new for new, old in enumerate(kept)}
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            if int(index) in removed:
                continue
            name = f"model.layers.{renumber[int(index)]}.{rest}"
        state[name] = tensor
    changes = {"num_hidden_layers": len(kept), "layer_types": [config.layer_types[i] for i in kept]}
    if config.mlp_type == "moe":
        changes["mlp_layer_types"] = [config.mlp_layer_types[i] for i in kept]
    if config.no_rope_layers is not None:
        changes["no_rope_layers"] = [config.no_rope_layers[i] for i in kept]
    new = model_from_state(derived_config(config, **changes), state, model, copy=copy)
    # the layers on either side of the cut see a residual stream they were not trained next to
    seams = sorted({i for i in (start - 1, start) if 0 <= i < len(kept)})
    change = Change(
        "drop_layers",
        keeps="every remaining layer's weights unchanged",
        approximates=f"layers {start}..{start + drop_layers - 1} removed (the residual stream skips them)",
        changed=[f"model.layers.{i}" for i in seams],
        details={"drop_layers": drop_layers, "removed": sorted(removed),
                 "candidates": [{"layers": [l, l + drop_layers - 1], "angular_distance": d}
                                for l, d in enumerate(distances)]},
    )
    return new, change
