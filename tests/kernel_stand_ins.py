"""Stand-ins for the GPU kernel libraries (causal-conv1d, fla): PyTorch functions computing what each library
documents for its kernels, so the dispatch to them is tested on machines without CUDA; and a recorder of the
tensors a PyTorch kernel makes."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class TensorShapes(TorchDispatchMode):
    """Records the shape of every tensor an operator returns (`shapes`): what a kernel's memory holds at most."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.shapes.append(tuple(tensor.shape))
        return out


def fake_causal_conv1d_fn(x, weight, bias=None, activation=None):
    """causal-conv1d's `causal_conv1d_fn` as its documentation states it (x (B, C, T), weight (C, K))."""
    width = weight.shape[1]
    out = torch.nn.functional.conv1d(torch.nn.functional.pad(x, (width - 1, 0)), weight.unsqueeze(1), bias,
                                     groups=x.shape[1])
    return torch.nn.functional.silu(out) if activation in ("silu", "swish") else out


def fake_causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
    """causal-conv1d's `causal_conv1d_update`: shifts x into `conv_state` in place and convolves the window."""
    full = torch.cat([conv_state, x], dim=-1)
    conv_state.copy_(full[..., -conv_state.shape[-1]:])
    out = torch.nn.functional.conv1d(full, weight.unsqueeze(1), bias, groups=x.shape[1])[..., -x.shape[-1]:]
    return torch.nn.functional.silu(out) if activation in ("silu", "swish") else out


def fake_fla(torch_rule, calls):
    """An fla gated-delta-rule kernel: equal head counts, L2 norm in the kernel when asked."""

    def kernel(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
               cu_seqlens=None):
        assert q.shape[2] == v.shape[2] and use_qk_l2norm_in_kernel and output_final_state
        assert all(t.is_contiguous() for t in (q, k, v, g, beta))
        calls.append(torch_rule.__name__)
        if cu_seqlens is None:
            return torch_rule(q, k, v, g, beta, initial_state)
        # varlen: batch 1, each sequence of `cu_seqlens` from its own (here zero) state, one final state each
        assert q.shape[0] == 1 and initial_state is None and cu_seqlens.dtype == torch.long
        calls.append("cu_seqlens")
        bounds = cu_seqlens.tolist()
        parts = [torch_rule(*(x[:, a:b] for x in (q, k, v, g, beta))) for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat([o for o, _ in parts], dim=1), torch.cat([s for _, s in parts])

    return kernel


def use_causal_conv1d(monkeypatch, calls: list) -> None:
    """causal-conv1d reported available and this device counted as its own, for every recurrent mixer (the delta
    rules' and Mamba-2's kernel sets), as stand-ins that record their calls in `calls` ("conv", "conv_update");
    the kernel caches cleared (`clear_kernel_caches` again after `monkeypatch.undo()`)."""
    from modular_decoder import compat, delta_rule, mamba2_scan

    monkeypatch.setattr(compat, "causal_conv1d_kernels", lambda: (
        lambda *a, **k: calls.append("conv") or fake_causal_conv1d_fn(*a, **k),
        lambda *a, **k: calls.append("conv_update") or fake_causal_conv1d_update(*a, **k)))
    monkeypatch.setattr(delta_rule, "_CAUSAL_CONV1D_DEVICES", ("cpu",))
    monkeypatch.setattr(mamba2_scan, "_CAUSAL_CONV1D_DEVICES", ("cpu",))
    clear_kernel_caches()


def clear_kernel_caches() -> None:
    """Forget which kernels each device was given (they are looked up once per device type)."""
    from modular_decoder import delta_rule, kda_rule, mamba2_scan

    delta_rule._kernels_for.cache_clear()
    kda_rule._kda_kernels_for.cache_clear()
    mamba2_scan._kernels_for.cache_clear()
