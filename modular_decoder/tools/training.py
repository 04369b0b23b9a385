"""Training helpers that are not model code: DeepSeek-V3's auxiliary-loss-free balancing in transformers' `Trainer`."""

from __future__ import annotations

from transformers import TrainerCallback

from ..router_losses import track_expert_load, update_router_bias


class RouterBiasCallback(TrainerCallback):
    """Moves every sigmoid router's correction bias after each optimizer step by ± `step_size` (DeepSeek-V3's
    γ, arXiv 2412.19437 §2.1.2; the paper uses 0.001 for most of pre-training) toward balanced expert load,
    counted over that step's training forwards (all its gradient-accumulation micro-batches).

        trainer = Trainer(model, ..., callbacks=[RouterBiasCallback(step_size=0.001)])
    """

    def __init__(self, step_size: float):
        if isinstance(step_size, bool) or not isinstance(step_size, (int, float)) or not step_size > 0:
            raise ValueError(f"`step_size` must be a positive number, got {step_size!r}.")
        self.step_size = step_size

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not track_expert_load(model):
            raise ValueError("RouterBiasCallback needs routers with a correction bias (`router_type='sigmoid_topk'`).")

    def on_step_end(self, args, state, control, model=None, **kwargs):
        update_router_bias(model, self.step_size)


__all__ = ["RouterBiasCallback"]
