"""`split_products`: the few-row products split across cores compute what `F.linear` computes up to fp32
rounding order (the batched product may sum each output in another order: compared with rtol = atol = 1e-5,
never bit for bit), on every preset; they never change how parameters are stored; they step aside for
anything that is not a plain fp32 CPU tensor, for hooks of every kind, under autograd and export, and when
switched off (those paths are `F.linear` itself: compared exactly); under `torch.compile` they are part of
the graph. Most tests run mode "always" (every product that may split does), so that they hold on any machine;
mode "auto" (the default: each shape timed once, the faster kept) is tested with a stand-in timing, never a
speed."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from decoding import prompt, recording_backend, tiny_model
from modular_decoder import compiled_decoding, split_products
from modular_decoder.split_products import (forget_split_decisions, linear, project, set_split_products,
                                            split_decisions, split_products_mode, takes_split_branch,
                                            using_split_products)
from modular_decoder.tuning import Tuning, set_tuning, tuned
from modular_decoder.tools.presets import PRESETS

MLA = dict(attention_type="mla", q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=6)
VARIANTS = {name: (name, {}) for name in PRESETS} | {"mla": ("llama", MLA), "mixtral_eager_experts": ("mixtral", {})}


SHIPPED_MIN_SPLIT_WEIGHT = Tuning.min_split_weight


@pytest.fixture(autouse=True)
def split_every_size():
    """Every product that may split does, the tiny weights here too (`tuning().min_split_weight` keeps small
    products on `F.linear` by default: `test_small_weights_stay_on_f_linear`; mode "auto" times each shape: the
    tests of `auto`)."""
    with tuned(min_split_weight=0), using_split_products("always"):
        yield
    forget_split_decisions()


@contextlib.contextmanager
def threads(count: int):
    """The split product only runs with several threads; the suite's workers use one each."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def counting(target, name: str):
    """`target.name` replaced by a spy for the block; yields the list of its calls' positional arguments."""
    calls = []
    original = getattr(target, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    setattr(target, name, spy)
    try:
        yield calls
    finally:
        setattr(target, name, original)


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("rows", [1, 3, 16, 17])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear(parts, rows, with_bias):
    for out_features, in_features in [(96, 48), (48, 96), (50, 47)]:  # the last does not split
        weight = torch.randn(out_features, in_features)
        bias = torch.randn(out_features) if with_bias else None
        x = torch.randn(1, rows, in_features)
        with threads(parts), counting(torch, "bmm") as bmm_calls:
            y = linear(x, weight, bias)
        torch.testing.assert_close(y, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
        assert y.shape == (1, rows, out_features)
        assert len(bmm_calls) == (1 if out_features % parts == 0 and rows <= 16 else 0)


def test_linear_reads_views_where_they_lie():
    """Weights and inputs that are views into larger storage (a storage offset; an input whose rows are not
    contiguous, a batch of several sequences) give F.linear's result."""
    storage, inputs = torch.randn(300, 48), torch.randn(40, 48)
    weight, bias = storage[100:196], torch.randn(96)
    cases = {
        "offset rows": inputs[3:5].view(1, 2, 48),
        "offset row": inputs[7:8].view(1, 1, 48),
        "strided rows": inputs[::2][:3].unsqueeze(0),
        "batch of two": inputs[:6].view(2, 3, 48),
        "2-D input": inputs[10:12],
    }
    for name, x in cases.items():
        with threads(2), counting(torch, "bmm") as bmm_calls:
            y = linear(x, weight, bias)
        torch.testing.assert_close(y, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5, msg=name)
        assert len(bmm_calls) == 1, name


class _Projection(nn.Module):
    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return project(self.layer, x)


def test_compile_keeps_the_split_and_export_traces_f_linear():
    """`torch.compile(fullgraph=True)` puts the split product in its graph (no break on the thread count) with
    F.linear's result; strict `torch.export` (one of ExecuTorch's paths) traces F.linear, the portable operation
    (non-strict export traces tensors of other types, which step aside already)."""
    module = _Projection(nn.Linear(48, 96).requires_grad_(False))
    x = torch.randn(1, 1, 48)
    graphs = []
    torch._dynamo.reset()
    with threads(2), torch.no_grad():
        y = torch.compile(module, backend=recording_backend(graphs), fullgraph=True)(x)
        exported = torch.export.export(module, (x,), strict=True)
    torch._dynamo.reset()
    torch.testing.assert_close(y, F.linear(x, module.layer.weight, module.layer.bias), rtol=1e-5, atol=1e-5)
    assert torch.bmm in {node.target for node in graphs[0].graph.nodes}
    exported_ops = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert not any("bmm" in op for op in exported_ops), exported_ops
    assert any("linear" in op for op in exported_ops), exported_ops


@pytest.mark.parametrize("name", ["gemma2", "mixtral", "deepseek_v3"])
def test_compiled_decoding_gives_the_eager_tokens(name):
    """transformers' compiled decoding (static cache, `CompileConfig`, inductor) with the split products in the
    graph, on sandwich norms + soft-caps + sliding windows, experts, and MLA with grouped routing: the greedy tokens
    of eager decoding (Llama's layout beside transformers' own class: tests/test_ecosystem.py)."""
    graphs = []
    model = tiny_model(name)
    arguments = dict(max_new_tokens=8, do_sample=False,
                     **compiled_decoding(backend=recording_backend(graphs, inductor=True)))
    torch._dynamo.reset()
    with threads(2), torch.no_grad():
        eager = model.generate(prompt(), **arguments, disable_compile=True)
        compiled = model.generate(prompt(), **arguments)
    torch._dynamo.reset()
    assert torch.equal(compiled, eager)
    assert any(node.target is torch.bmm for graph in graphs for node in graph.graph.nodes)


def test_linear_steps_aside_for_what_it_was_not_measured_for():
    weight, x = torch.randn(64, 32), torch.randn(1, 1, 32)
    cases = {
        "one thread": (1, x, weight),
        "bf16": (2, x.bfloat16(), weight.bfloat16()),
        "non-contiguous weight": (2, x, torch.randn(32, 64).t()),
        "meta weight": (2, x.to("meta"), weight.to("meta")),
    }
    for name, (count, xs, ws) in cases.items():
        with threads(count), counting(torch, "bmm") as bmm_calls:
            linear(xs, ws)
        assert not bmm_calls, name


def _f_linear_outcome(function, *args):
    """(result, None) or (None, (error type, message)) of `function(*args)`."""
    try:
        return function(*args), None
    except Exception as error:  # noqa: BLE001  (the comparison is the point)
        return None, (type(error), str(error))


def _assert_same_as_f_linear(x, weight, bias=None, *, engages: bool):
    """`linear` gives F.linear's dtype and values, or raises F.linear's error; the split runs only if `engages`."""
    with threads(2), counting(torch, "bmm") as bmm_calls:
        ours, our_error = _f_linear_outcome(linear, x, weight, bias)
    theirs, their_error = _f_linear_outcome(F.linear, x, weight, bias)
    assert our_error == their_error
    assert bool(bmm_calls) == engages
    if theirs is not None:
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_shapes_and_dtypes_f_linear_refuses_raise_its_error():
    """An input wider or narrower than the weight, a bias of another width or dtype: F.linear's error, never a
    silently truncated product."""
    weight, bias = torch.randn(64, 32), torch.randn(64)
    refused = {
        "wider input": (torch.randn(1, 1, 40), weight, None),
        "narrower input": (torch.randn(1, 1, 16), weight, None),
        "wider input, 16 rows": (torch.randn(1, 16, 33), weight, bias),
        "short bias": (torch.randn(1, 1, 32), weight, torch.randn(63)),
        "float64 bias": (torch.randn(1, 1, 32), weight, bias.double()),
        "float64 input": (torch.randn(1, 1, 32).double(), weight, None),
        "0-d input": (torch.tensor(1.0), weight, None),
    }
    for name, (x, w, b) in refused.items():
        theirs, their_error = _f_linear_outcome(F.linear, x, w, b)
        assert their_error is not None, name  # the premise: F.linear refuses it
        _assert_same_as_f_linear(x, w, b, engages=False)
    _assert_same_as_f_linear(torch.randn(32), weight, bias, engages=True)  # a 1-D input is F.linear's too
    _assert_same_as_f_linear(torch.randn(1, 1, 32), weight, torch.randn(1), engages=False)  # a broadcast bias


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_autocast_gives_f_linear_dtype_and_values(dtype, with_bias):
    weight, x = torch.randn(64, 32), torch.randn(1, 3, 32)
    bias = torch.randn(64) if with_bias else None
    with torch.autocast("cpu", dtype=dtype):
        _assert_same_as_f_linear(x, weight, bias, engages=False)
        with threads(2):
            assert linear(x, weight, bias).dtype == dtype


def test_frozen_weights_with_an_input_that_needs_gradients_go_through_f_linear():
    """PEFT's frozen base under an adapter, or an input-gradient probe: autograd records F.linear."""
    for requires in ("x", "bias"):
        weight = torch.randn(64, 32)
        x = torch.randn(1, 1, 32, requires_grad=requires == "x")
        bias = torch.randn(64, requires_grad=requires == "bias")
        with threads(2), counting(torch, "bmm") as bmm_calls:
            y = linear(x, weight, bias)
        assert not bmm_calls, requires
        leaf = x if requires == "x" else bias
        (ours,) = torch.autograd.grad(y.square().sum(), leaf)
        (theirs,) = torch.autograd.grad(F.linear(x, weight, bias).square().sum(), leaf)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    with threads(2), counting(torch, "bmm") as bmm_calls, torch.no_grad():
        linear(torch.randn(1, 1, 32, requires_grad=True), torch.randn(64, 32))  # no grad mode: no autograd
    assert bmm_calls


def test_torchscript_sees_f_linear():
    """`torch.jit.trace`, the tracer TorchScript-based ONNX export runs (`torch.jit._get_trace_graph`), and
    `torch.jit.script` record F.linear, not a product split by the tracing machine's thread count."""
    module = _Projection(nn.Linear(48, 96).requires_grad_(False))
    x = torch.randn(1, 1, 48)
    with threads(2), torch.no_grad():
        traced = torch.jit.trace(module, (x,))
        onnx_graph, _ = torch.jit._get_trace_graph(module, (x,))
        scripted = torch.jit.script(linear)
        torch.testing.assert_close(scripted(x, module.layer.weight, module.layer.bias), module(x), rtol=1e-5, atol=1e-5)
    for graph in (traced.inlined_graph, onnx_graph, scripted.graph):
        kinds = {node.kind() for node in graph.nodes()}
        assert "aten::linear" in kinds and "aten::bmm" not in kinds, kinds
    torch.testing.assert_close(traced(x), F.linear(x, module.layer.weight, module.layer.bias), rtol=0, atol=0)


def test_tensor_subclasses_go_to_f_linear():
    class Marked(torch.Tensor):  # stands for DTensor / quantized weights: anything not plain
        pass

    weight = torch.randn(64, 32).as_subclass(Marked)
    with threads(2), counting(torch, "bmm") as bmm_calls:
        linear(torch.randn(1, 1, 32), weight)
    assert not bmm_calls


def test_under_autograd_the_weight_gets_its_gradient_through_f_linear():
    weight = torch.randn(64, 32, requires_grad=True)
    x = torch.randn(1, 1, 32, requires_grad=True)
    with threads(2), counting(torch, "bmm") as bmm_calls:
        linear(x, weight).square().sum().backward()
    assert not bmm_calls
    expected_x, expected_w = torch.autograd.grad(F.linear(x, weight).square().sum(), (x, weight))
    torch.testing.assert_close(x.grad, expected_x)
    torch.testing.assert_close(weight.grad, expected_w)


def test_the_off_switch():
    weight, x = torch.randn(64, 32), torch.randn(1, 1, 32)
    for off in ("off", False, " 0", "no"):
        with using_split_products(off), threads(2), counting(torch, "bmm") as bmm_calls:
            linear(x, weight)
            project(nn.Linear(32, 64), x)
        assert not bmm_calls, off
    with threads(2), counting(torch, "bmm") as bmm_calls:
        linear(x, weight)
    assert bmm_calls


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_decodes_the_same_with_and_without_split_products(variant):
    name, overrides = VARIANTS[variant]
    model = tiny_model(name, **overrides)
    if variant.endswith("_eager_experts"):
        model.set_experts_implementation("eager")  # the package's own experts forward splits its products too
    ids = prompt(batch=2)
    kwargs = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad(), threads(2):
        with counting(torch, "bmm") as bmm_calls:
            split = model.generate(ids, **kwargs)
        assert bmm_calls  # the split ran
        with using_split_products("off"):
            plain = model.generate(ids, **kwargs)
    assert torch.equal(split.sequences, plain.sequences)
    torch.testing.assert_close(torch.stack(split.logits), torch.stack(plain.logits), rtol=1e-5, atol=1e-5)


def test_parameters_stay_plain_on_every_cpu_load(tmp_path):
    """No load path re-lays parameters: each is contiguous with its own storage (the tied head shares
    the embedding's, as the config says), and the state dict has exactly the standard names."""
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    tied = tiny_model("smollm2")
    tied.save_pretrained(tmp_path / "tied")
    for loaded in (
        AutoModelForCausalLM.from_pretrained(tmp_path),
        AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cpu"),
        AutoModelForCausalLM.from_config(model.config),
        AutoModelForCausalLM.from_pretrained(tmp_path / "tied"),
    ):
        storages = {}
        for param_name, param in loaded.named_parameters(remove_duplicate=False):
            assert type(param) is nn.Parameter and param.is_contiguous(), param_name
            storages.setdefault(param.untyped_storage().data_ptr(), []).append(param_name)
        shared = [names for names in storages.values() if len(names) > 1]
        expected = [["model.embed_tokens.weight", "lm_head.weight"]] if loaded.config.tie_word_embeddings else []
        assert shared == expected
        assert set(loaded.state_dict()) == set(model.state_dict() if not loaded.config.tie_word_embeddings
                                               else tied.state_dict())


def test_hooks_of_every_kind_see_every_projection_call():
    """Forward, forward-pre and full backward hooks on a projection fire as on transformers' Llama:
    the split path steps aside for any hooked layer."""
    model = tiny_model("llama")
    layer = model.model.layers[0].self_attn.q_proj
    seen = []
    handles = [
        layer.register_forward_pre_hook(lambda m, a: seen.append("pre")),
        layer.register_forward_hook(lambda m, a, o: seen.append("forward")),
        layer.register_full_backward_hook(lambda m, gi, go: seen.append("backward")),
        model.model.layers[0].mlp.down_proj.register_full_backward_pre_hook(lambda m, go: seen.append("backward-pre")),
    ]
    with threads(2):
        model(prompt(), labels=prompt()).loss.backward()
        with torch.no_grad():
            model.generate(prompt(), max_new_tokens=2, do_sample=False)
    for handle in handles:
        handle.remove()
    assert seen.count("backward") == 1 and seen.count("backward-pre") == 1
    assert seen.count("pre") == seen.count("forward") == 1 + 2  # the training forward, then prompt + 1 step


def test_a_global_hook_sees_every_linear():
    model = tiny_model("llama")
    calls = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda m, a, o: calls.append(m) if isinstance(m, nn.Linear) else None
    )
    try:
        with torch.no_grad(), threads(2):
            model(prompt())
    finally:
        handle.remove()
    assert len(calls) == sum(isinstance(m, nn.Linear) for m in model.modules())


def test_small_weights_stay_on_f_linear():
    """Below `tuning().min_split_weight` elements the product is `F.linear` itself (dispatching the batched product
    costs more there than one core's pass: measured, `tuning.py`); from it on, the product splits."""
    set_tuning(min_split_weight=SHIPPED_MIN_SPLIT_WEIGHT)  # the autouse fixture's 0 undone (it restores its own)
    width = math.isqrt(SHIPPED_MIN_SPLIT_WEIGHT)  # 256 for 2^16
    x = torch.randn(1, 1, width)
    for out_features, splits in ((width - 2, False), (width, True)):  # (width - 2) x width < width²; both even
        layer = nn.Linear(width, out_features, bias=False)
        with threads(2), torch.no_grad(), counting(torch, "bmm") as bmm_calls:
            y, z = linear(x, layer.weight), project(layer, x)
            expected = F.linear(x, layer.weight)
            assert takes_split_branch(layer, x) is splits, out_features  # the branch test skips small ones too
        assert len(bmm_calls) == (2 if splits else 0), out_features
        if splits:
            torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(z, expected, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(y, expected) and torch.equal(z, expected)


@pytest.mark.parametrize("rows", [1, 2, 3, 16])
def test_several_rows_cut_each_weight_into_cache_sized_slices(rows):
    """A product of 2 or more rows is cut into more slices than threads, doubling while each slice keeps at least
    `tuning().split_slice_bytes` and the slices divide the output rows (one row: as many slices as threads; 0: never
    more), and still computes `F.linear`'s result."""
    weight, bias = torch.randn(96, 64), torch.randn(96)  # 256 bytes a row; 96 = 2 * 3 * 16 rows
    x = torch.randn(1, rows, 64)
    for slice_bytes, parts in ((0, 2), (48 * 256, 2), (24 * 256, 4), (12 * 256, 8), (3 * 256, 32), (256, 32)):
        with threads(2), tuned(split_slice_bytes=slice_bytes), torch.no_grad(), counting(torch, "bmm") as bmm_calls:
            y = linear(x, weight, bias)
        assert [slices.shape[0] for _, slices in bmm_calls] == [2 if rows == 1 else parts], slice_bytes
        torch.testing.assert_close(y, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@contextlib.contextmanager
def timed_as(f_linear_s: float, split_s: float):
    """Mode "auto" with a stand-in for the timing: every shape measures (`f_linear_s`, `split_s`); yields the list of
    the timings asked for, each the results of the two products it was given (run once, as the real timing runs
    them), so that a test sees what was timed and on what."""
    calls = []

    def stand_in(f_linear, split):
        calls.append((f_linear(), split()))
        return f_linear_s, split_s

    original = split_products._measure
    split_products._measure = stand_in
    forget_split_decisions()
    try:
        with using_split_products("auto"):
            yield calls
    finally:
        split_products._measure = original
        forget_split_decisions()


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("faster", [False, True])
def test_auto_takes_what_the_timing_found_faster(rows, faster):
    """Where the split measures faster it runs, where slower `F.linear` runs (exactly); either way the result is
    F.linear's. The timing ran both products on the call's own tensors, and the decision is recorded."""
    weight, bias, x = torch.randn(96, 64), torch.randn(96), torch.randn(1, rows, 64)
    with timed_as(1.0, 0.5 if faster else 2.0) as timings, threads(2), torch.no_grad():
        with counting(torch, "bmm") as bmm_calls:
            y = linear(x, weight, bias)
        (timed_f_linear, timed_split), = timings
        decisions = split_decisions()
    expected = F.linear(x, weight, bias)
    assert torch.equal(timed_f_linear, expected)
    torch.testing.assert_close(timed_split, expected, rtol=1e-5, atol=1e-5)
    assert len(bmm_calls) == (2 if faster else 1)  # the timing's split, then the product's own if it pays
    if faster:
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(y, expected)
    ((key, decision),) = decisions.items()
    assert key[:4] == (96, 64, rows, 2) and key[5] is True and decision["split"] is faster
    assert decision["f_linear_s"] == 1.0 and decision["cost_s"] >= 0


def test_auto_times_each_shape_once_per_process():
    """A shape is timed at its first product only; every later product of that shape reuses the decision. The row
    count, the thread count and a bias or none are each part of the shape."""
    weight, x = torch.randn(96, 64), torch.randn(1, 1, 64)
    with timed_as(1.0, 0.5) as timings, torch.no_grad():
        with threads(2):
            for _ in range(3):
                linear(x, weight)
                project(nn.Linear(64, 96), x)  # a bias: another shape
            assert len(timings) == 2
            linear(torch.randn(1, 2, 64), weight)
            assert len(timings) == 3
        with threads(3):
            linear(x, weight)
            linear(x, weight)
        assert len(timings) == 4
        assert [key[2:4] for key in split_decisions()] == [(1, 2), (1, 2), (2, 2), (1, 3)]


def test_auto_times_nothing_that_may_not_split():
    """Products that go to F.linear anyway (one thread, bf16, a weight below `min_split_weight`, under autograd) are
    never timed."""
    weight, x = torch.randn(64, 32), torch.randn(1, 1, 32)
    with timed_as(1.0, 0.5) as timings:
        with threads(1):
            linear(x, weight)
        with threads(2):
            linear(x.bfloat16(), weight.bfloat16())
            linear(x.requires_grad_(), weight)
            with tuned(min_split_weight=64 * 32 + 1):
                linear(x, weight)
    assert not timings and not split_decisions()


def test_auto_with_the_real_timing_records_a_decision_and_f_linear_result():
    """The real timing runs (its speed is not asserted): it records one decision, with both products' fastest
    seconds, and the product equals F.linear's whichever way it went."""
    weight, x = torch.randn(128, 64), torch.randn(1, 1, 64)
    forget_split_decisions()
    with using_split_products("auto"), threads(2), torch.no_grad():
        y = linear(x, weight)
        y_again = linear(x, weight)
    ((key, decision),) = split_decisions().items()
    assert key == (128, 64, 1, 2, 2, False)
    assert decision["f_linear_s"] > 0 and decision["split_s"] > 0 and decision["cost_s"] > 0
    torch.testing.assert_close(y, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert torch.equal(y, y_again)


def test_the_timing_runs_both_products_alike_and_boundedly():
    """`_measure` runs the two products the same number of times, at least two rounds and at most its cap, and
    returns each one's fastest run."""
    runs = {"f_linear": 0, "split": 0}

    def run(name):
        runs[name] += 1

    fastest = split_products._measure(lambda: run("f_linear"), lambda: run("split"))
    low, high = split_products._ROUNDS
    assert runs["f_linear"] == runs["split"] and low <= runs["split"] <= high
    assert all(0 <= seconds < math.inf for seconds in fastest)


@pytest.mark.parametrize("faster", [False, True])
def test_auto_under_compile_decides_at_tracing(faster):
    """`torch.compile` traces with stand-in tensors: a shape of one row is timed at tracing on real tensors of its size
    (or its recorded decision is used), and the graph holds the split only where it paid; more rows (a size the graph
    may keep symbolic) take F.linear untimed. Either way the result is F.linear's."""
    module = _Projection(nn.Linear(48, 96).requires_grad_(False))
    one, three = torch.randn(1, 1, 48), torch.randn(1, 3, 48)
    for recorded in (False, True):
        graphs = []
        torch._dynamo.reset()
        with timed_as(1.0, 0.5 if faster else 2.0) as timings, threads(2), torch.no_grad():
            if recorded:
                linear(one, module.layer.weight, module.layer.bias)
            compiled = torch.compile(module, backend=recording_backend(graphs), fullgraph=True, dynamic=False)
            y = compiled(one)
            z = torch.compile(module, fullgraph=True, dynamic=True, backend="eager")(three)
        torch._dynamo.reset()
        assert len(timings) == 1, recorded  # once: in eager, or at tracing
        assert all(type(value) is torch.Tensor for value in timings[0])  # real values, not the tracer's
        assert (torch.bmm in {node.target for node in graphs[0].graph.nodes}) is faster
        torch.testing.assert_close(y, module(one), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(z, module(three), rtol=1e-5, atol=1e-5)


def test_auto_under_torchscript_times_nothing():
    """TorchScript's tracer records F.linear untimed (`check_trace` would run the module eagerly too, which may time),
    without reading a shape as a value on the way (no `TracerWarning`)."""
    module = _Projection(nn.Linear(48, 96).requires_grad_(False))
    with timed_as(1.0, 0.5) as timings, threads(2), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)
        traced = torch.jit.trace(module, (torch.randn(1, 1, 48),), check_trace=False)
    assert "aten::bmm" not in {node.kind() for node in traced.inlined_graph.nodes()}
    assert not timings


def test_modes_and_their_spellings():
    """`set_split_products` takes the three modes, True (auto) and False (off), returns the previous mode and
    refuses anything else by name."""
    with using_split_products("auto"):
        for value, mode in (("always", "always"), (True, "auto"), (" OFF", "off"), (False, "off"), ("1", "auto"),
                            ("auto", "auto")):
            set_split_products(value)
            assert split_products_mode() == mode, value
        assert set_split_products("always") == "auto"
        assert split_products.split_products_enabled()
        for bad in ("sometimes", 2, None, ""):
            with pytest.raises(ValueError, match="`set_split_products`'s mode must be one of 'auto', 'always'"):
                set_split_products(bad)
        assert split_products_mode() == "always"


def _fresh_split_products(monkeypatch, value: str | None):
    """split_products.py imported anew with `MODULAR_DECODER_SPLIT_PRODUCTS` set to `value` (the module the model
    uses is left as it is)."""
    import importlib.util

    if value is None:
        monkeypatch.delenv("MODULAR_DECODER_SPLIT_PRODUCTS", raising=False)
    else:
        monkeypatch.setenv("MODULAR_DECODER_SPLIT_PRODUCTS", value)
    spec = importlib.util.spec_from_file_location("modular_decoder._split_products_fresh", split_products.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_environment_variable_sets_the_mode_at_import(monkeypatch):
    for value, mode in ((None, "auto"), ("always", "always"), ("0", "off"), ("false", "off"), ("1", "auto")):
        assert _fresh_split_products(monkeypatch, value).split_products_mode() == mode, value
    with pytest.raises(ValueError, match="`MODULAR_DECODER_SPLIT_PRODUCTS` must be one of .*got 'sometimes'"):
        _fresh_split_products(monkeypatch, "sometimes")


@pytest.mark.parametrize("faster", [False, True])
def test_auto_branch_test_follows_the_decision(faster):
    """A forward's branch test sends a layer whose shape was timed slower split to the plain branch (module calls,
    as with the split off), and one timed faster, or not yet timed, through `project`."""
    layer, x = nn.Linear(64, 96).requires_grad_(False), torch.randn(1, 1, 64)
    with timed_as(1.0, 0.5 if faster else 2.0) as timings, threads(2), torch.no_grad():
        assert takes_split_branch(layer, x)  # not timed yet
        y = project(layer, x)
        assert takes_split_branch(layer, x) is faster and len(timings) == 1
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
