"""The CPU few-row layouts (`_cpu_linear.py`): the same products as `F.linear`, taken only where they were measured to
pay; weights packed once, kept across calls, packed anew when they change (through `.data` too) and freed with them;
with the layouts in the target's verify forwards and the drafter's passes, speculative greedy output is still the
target's own, batched and with a target that post-processes its logits; the mode never outlives the call that entered
it."""

from __future__ import annotations

import contextlib
import gc
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hf_specdiff
from hf_specdiff import _compat, _cpu_linear, candidates
from hf_specdiff._cpu_linear import (
    FewRowLinears,
    PackedWeights,
    few_row_linears,
    layout,
    linear,
    packed_layout_pays,
    transposed_layout_pays,
)

from conftest import make_speculator, make_successor_target, make_target, require_cpu_compiler

VOCAB, HIDDEN = 512, 24


@pytest.mark.parametrize("shape", [(1, HIDDEN), (2, HIDDEN), (1, 5, HIDDEN), (2, 16, HIDDEN), (33, HIDDEN)])
@pytest.mark.parametrize("out_features", [VOCAB, HIDDEN])  # a read-out, a projection
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear(shape, out_features, with_bias):
    torch.manual_seed(0)
    x, weight = torch.randn(shape), torch.randn(out_features, HIDDEN)
    bias = torch.randn(out_features) if with_bias else None
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    out = linear(x, weight, bias)
    assert out.shape == expected.shape and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_transposed_layout_only_for_a_few_rows_of_a_float32_cpu_weight():
    weight = torch.randn(VOCAB, HIDDEN)
    assert not transposed_layout_pays(torch.randn(1, HIDDEN), weight)  # one row: BLAS's matrix-vector path
    assert transposed_layout_pays(torch.randn(1, 2, HIDDEN), weight)
    assert transposed_layout_pays(torch.randn(2, 16, HIDDEN), weight)  # 32 rows
    assert not transposed_layout_pays(torch.randn(33, HIDDEN), weight)
    assert not transposed_layout_pays(torch.randn(4, HIDDEN).double(), weight.double())  # not measured
    assert transposed_layout_pays(torch.randn(4, HIDDEN), torch.randn(HIDDEN, HIDDEN))  # a projection too


needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this PyTorch has no MKL to pack weights")


@needs_mkl
@pytest.mark.parametrize("shape", [(2, HIDDEN), (1, 5, HIDDEN), (2, 16, HIDDEN), (40, HIDDEN)])
@pytest.mark.parametrize("out_features", [VOCAB, HIDDEN])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_through_a_packed_weight_equals_f_linear(shape, out_features, with_bias):
    torch.manual_seed(0)
    x, weight = torch.randn(shape), torch.nn.Parameter(torch.randn(out_features, HIDDEN), requires_grad=False)
    bias = torch.randn(out_features) if with_bias else None
    packs = PackedWeights(rows=x.numel() // HIDDEN)
    assert layout(x, weight, packs) == "packed"
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    out = linear(x, weight, bias, packs)
    assert out.shape == expected.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_packed_only_for_the_packed_row_count_of_a_float32_cpu_parameter_in_inference():
    weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN))
    packs = PackedWeights(rows=4)
    x = torch.randn(1, 4, HIDDEN)
    mkl = torch.backends.mkl.is_available()
    with torch.no_grad():
        assert layout(x, weight, packs) == ("packed" if mkl else "transposed")
        assert layout(torch.randn(5, HIDDEN), weight, packs) == "transposed"  # another row count
        assert layout(torch.randn(1, HIDDEN), weight, PackedWeights(rows=1)) == ("packed" if mkl else "f.linear")
        assert layout(x, weight.detach(), packs) == "transposed"  # a weight computed in the forward: never packed
        assert layout(x.double(), torch.nn.Parameter(weight.double()), packs) == "f.linear"
        assert layout(x, weight, None) == "transposed"
    assert not packed_layout_pays(x, weight)  # gradients recorded
    assert layout(x, weight, packs) == "transposed"


@needs_mkl
def test_a_pack_is_kept_across_contexts_and_made_anew_when_the_weight_changes(monkeypatch):
    """A later context reuses the pack; a change made through `.data`, which no version counter records (as PEFT merges
    adapters), is caught by the fingerprint, and the product uses the new weight. Each context checks once."""
    torch.manual_seed(0)
    weight, x = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN), requires_grad=False), torch.randn(3, HIDDEN)
    checks, original = [], _cpu_linear.fingerprint
    monkeypatch.setattr(_cpu_linear, "fingerprint", lambda w: checks.append(w) or original(w))
    first = PackedWeights(rows=3)
    pack = first[weight]
    assert first[weight] is pack and len(checks) == 1  # checked once per context
    assert PackedWeights(rows=3)[weight] is pack and len(checks) == 2  # kept across contexts
    version = weight._version
    weight.data.mul_(-2.0)
    assert weight._version == version  # invisible to the version counter
    repacked = PackedWeights(rows=3)
    assert repacked[weight] is not pack
    torch.testing.assert_close(linear(x, weight, packs=repacked), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    weight.data = torch.randn(VOCAB, HIDDEN)  # a new storage, as `module.half().float()` gives
    torch.testing.assert_close(linear(x, weight, packs=PackedWeights(rows=3)), F.linear(x, weight), rtol=1e-5,
                               atol=1e-5)


@needs_mkl
def test_negative_control_a_pack_never_checked_again_computes_with_the_old_weight(monkeypatch):
    torch.manual_seed(0)
    weight, x = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN), requires_grad=False), torch.randn(3, HIDDEN)
    monkeypatch.setattr(_cpu_linear, "fingerprint", lambda w: torch.zeros(1))  # blind to every change
    old = F.linear(x, weight)
    PackedWeights(rows=3)[weight]
    weight.data.mul_(-2.0)
    torch.testing.assert_close(linear(x, weight, packs=PackedWeights(rows=3)), old, rtol=1e-5, atol=1e-5)


@needs_mkl
def test_packs_are_freed_with_their_weight_and_a_weight_keeps_a_few_row_counts():
    weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN), requires_grad=False)
    for rows in range(2, 3 + _cpu_linear.MAX_PACKED_ROW_COUNTS):
        PackedWeights(rows)[weight]
    assert list(_cpu_linear._packs[weight]) == list(range(3, 3 + _cpu_linear.MAX_PACKED_ROW_COUNTS))  # 2 dropped
    pack = weakref.ref(PackedWeights(3)[weight])
    assert pack() is not None
    del weight
    gc.collect()
    assert pack() is None  # the cache let go of it with the weight


def recorded_linears(monkeypatch) -> list[tuple[torch.Tensor, str]]:
    """(weight, layout taken) of every call that `FewRowLinears` routes through `linear`."""
    calls, original = [], _cpu_linear.linear

    def recording(input, weight, bias=None, packs=None):
        calls.append((weight, layout(input, weight, packs)))
        return original(input, weight, bias, packs)

    monkeypatch.setattr(_cpu_linear, "linear", recording)
    return calls


def test_the_mode_routes_every_f_linear_through_linear_and_only_while_active(monkeypatch):
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(HIDDEN, VOCAB), torch.randn(1, 4, HIDDEN)
    calls = recorded_linears(monkeypatch)
    layer(x)
    assert not calls  # outside the mode: F.linear as always
    with FewRowLinears():
        out = layer(x)
        F.linear(x[0, :1], layer.weight)  # one row: routed, left to F.linear
    assert [taken for _, taken in calls] == ["transposed", "f.linear"] and all(w is layer.weight for w, _ in calls)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert torch._C._len_torch_function_stack() == 0


def test_the_mode_only_where_a_model_has_float32_cpu_weights():
    assert isinstance(few_row_linears(torch.nn.Linear(2, 2)), FewRowLinears)
    assert isinstance(few_row_linears(torch.nn.Linear(2, 2).double()), contextlib.nullcontext)
    assert isinstance(few_row_linears(torch.nn.Linear(2, 2).double(), torch.nn.Linear(2, 2)), FewRowLinears)
    assert isinstance(few_row_linears(torch.nn.Identity()), contextlib.nullcontext)  # no weights at all


@pytest.fixture
def intel_cpu(monkeypatch):
    """The loop packs weights as it does on an Intel CPU, whatever CPU runs the test."""
    monkeypatch.setattr(_cpu_linear, "cpu_vendor", lambda: "GenuineIntel")


@pytest.fixture(params=["GenuineIntel", "AuthenticAMD"])
def loop_layout(request, monkeypatch) -> str:
    """The layout the loop takes on an Intel CPU, where it packs its weights (where this PyTorch has MKL), and on
    another, where it takes the transposed layout; whatever CPU runs the test."""
    monkeypatch.setattr(_cpu_linear, "cpu_vendor", lambda: request.param)
    return "packed" if request.param == "GenuineIntel" and torch.backends.mkl.is_available() else "transposed"


def test_the_cpu_vendor_is_read_where_the_os_names_it():
    _cpu_linear.cpu_vendor.cache_clear()
    vendor = _cpu_linear.cpu_vendor()
    cpuinfo = Path("/proc/cpuinfo")
    vendors = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
               if line.startswith("vendor_id")] if cpuinfo.exists() else []
    if vendors:  # x86 Linux
        assert vendor == vendors[0] and vendor
    assert _cpu_linear.packing_pays_on_this_cpu() is (vendor == "GenuineIntel" and torch.backends.mkl.is_available())


@needs_mkl
def test_weights_are_packed_on_an_intel_cpu_only(monkeypatch):
    """MKL's packed products were measured slower than the transposed layout on an AMD CPU at every row count."""
    model = torch.nn.Linear(2, 2)
    for vendor, packs in [("GenuineIntel", True), ("AuthenticAMD", False), ("", False)]:  # "": could not be told
        monkeypatch.setattr(_cpu_linear, "cpu_vendor", lambda: vendor)
        assert _cpu_linear.packing_pays_on_this_cpu() is packs
        mode = few_row_linears(model, packed_rows=4)
        assert isinstance(mode, FewRowLinears)  # the transposed layout everywhere
        assert (mode.packs is not None) is packs


@needs_mkl
def test_packs_only_where_asked_and_never_for_a_model_accelerate_hooks(intel_cpu):
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert few_row_linears(model).packs is None
    assert few_row_linears(model, packed_rows=4).packs.rows == 4
    add_hook_to_module(model[1], ModelHook())  # as `device_map` dispatch and offloading attach theirs
    assert isinstance(few_row_linears(model, packed_rows=4), FewRowLinears)
    assert few_row_linears(model, packed_rows=4).packs is None


def target_weights(target) -> set[int]:
    """The Linear weights of its decoder layers, and its read-out."""
    return {id(p) for name, p in target.named_parameters() if "layers" in name and p.dim() == 2} | {
        id(target.lm_head.weight)
    }


@pytest.mark.parametrize("method", ["dflash", "xpress", "markov"])
def test_float32_greedy_output_equals_plain_greedy_with_the_few_row_layout(method, monkeypatch, loop_layout):
    target = make_target(vocab_size=VOCAB, hidden_size=HIDDEN, dtype=torch.float32)
    speculator = make_speculator(target).to(torch.float32)
    prompt = torch.tensor([[1, 5, 9, 13]])
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    hf_specdiff.enable(target)
    calls = recorded_linears(monkeypatch)
    ours = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=speculator, speculation=method)
    assert torch.equal(ours, plain)
    drafter_weights = {id(p) for p in speculator.drafter.parameters()}
    taken = {id(weight) for weight, taken in calls if taken == loop_layout}
    assert target_weights(target) <= taken  # every projection and the read-out of the verify forwards
    assert taken & drafter_weights  # and the drafter's
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("method", ["dflash", "xpress"])
@pytest.mark.parametrize("num_draft_tokens", [None, 3])
def test_batched_greedy_output_equals_plain_batched_greedy_with_the_few_row_layout(method, num_draft_tokens,
                                                                                   monkeypatch, loop_layout):
    target = make_successor_target(dtype=torch.float32, vocab_size=VOCAB)
    speculator = make_speculator(target, oracle=True).to(torch.float32)
    prompts = torch.tensor([[0, 0, 1, 5, 9], [2, 3, 4, 7, 8], [0, 0, 0, 6, 11]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0], [3]])).long()
    plain = target.generate(prompts, attention_mask=mask, max_new_tokens=30, do_sample=False)
    hf_specdiff.enable(target)
    calls = recorded_linears(monkeypatch)
    ours = target.generate(prompts, attention_mask=mask, max_new_tokens=30, do_sample=False, assistant_model=speculator,
                           speculation=method, num_draft_tokens=num_draft_tokens)
    assert torch.equal(ours, plain)
    assert any(weight is target.lm_head.weight and taken == loop_layout for weight, taken in calls)


def offset_target(target):
    """The target post-processing its logits (as soft-capping or logit scaling would): logits + a fixed offset."""
    offset = 50.0 * torch.randn(target.config.vocab_size, generator=torch.Generator().manual_seed(3))

    def add_offset(module, args, outputs):
        outputs.logits = outputs.logits + offset
        return outputs

    target.register_forward_hook(add_offset)
    return target


def test_a_target_that_post_processes_its_logits_keeps_doing_so_in_the_few_row_layout(monkeypatch, loop_layout):
    target = offset_target(make_target(vocab_size=VOCAB, hidden_size=HIDDEN, dtype=torch.float32))
    speculator = make_speculator(target).to(torch.float32)
    prompt = torch.tensor([[1, 5, 9, 13]])
    plain = target.generate(prompt, max_new_tokens=16, do_sample=False)
    hf_specdiff.enable(target)
    calls = recorded_linears(monkeypatch)
    ours = target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=speculator, speculation="dflash")
    assert torch.equal(ours, plain)
    assert any(weight is target.lm_head.weight and taken == loop_layout for weight, taken in calls)


def read_out_rows_rolled(target, monkeypatch) -> None:
    """From now on the layout gives the target's read-out with its rows swapped: logits the target never produces."""
    original = _cpu_linear.linear

    def rows_rolled(input, weight, bias=None, packs=None):
        out = original(input, weight, bias, packs)
        return (out.roll(1, dims=-2) if weight is target.lm_head.weight and transposed_layout_pays(input, weight)
                else out)

    monkeypatch.setattr(_cpu_linear, "linear", rows_rolled)


def test_negative_control_a_wrong_few_row_product_changes_the_output(monkeypatch):
    """The equalities above see the layout's products: the same runs with its rows swapped in the target's read-out
    verify against logits the target never produces, and the output differs."""
    target = make_target(vocab_size=VOCAB, hidden_size=HIDDEN, dtype=torch.float32)
    speculator = make_speculator(target).to(torch.float32)
    prompt = torch.tensor([[1, 5, 9, 13]])
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    hf_specdiff.enable(target)
    read_out_rows_rolled(target, monkeypatch)
    ours = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=speculator, speculation="dflash")
    assert not torch.equal(ours, plain)


@pytest.fixture
def fresh_compiled_graphs():
    """Every graph compiled in the test is traced afresh, and none it traced (with a patched layout) outlives it."""
    torch._dynamo.reset()
    candidates._compiled.cache_clear()
    yield
    torch._dynamo.reset()
    candidates._compiled.cache_clear()


@pytest.mark.slow
def test_compiled_verify_forwards_are_traced_through_the_layout_and_plain_decoding_is_not(monkeypatch,
                                                                                          fresh_compiled_graphs):
    """torch.compile on the CPU traces the verify forward through the mode the loop calls it in, into a graph of its
    own: plain compiled decoding of the same model, before and after, keeps the graph compiled without the mode.
    Seen through the negative control's swapped read-out rows, which only a verify forward traced through the
    layout reads, and which plain decoding's single rows never take."""
    require_cpu_compiler()
    target = hf_specdiff.enable(make_successor_target(dtype=torch.float32, vocab_size=VOCAB))
    speculator = make_speculator(target, oracle=True).to(torch.float32)
    prompt = torch.tensor([[1, 5, 9, 13]])
    static = dict(cache_implementation="static", max_cache_len=64,
                  compile_config=_compat.compile_config_for_all_devices())
    plain = target.generate(prompt, max_new_tokens=30, do_sample=False)
    assert torch.equal(target.generate(prompt, max_new_tokens=30, do_sample=False, **static), plain)
    ours = target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=speculator,
                           speculation="xpress", num_draft_tokens=3, **static)
    assert torch.equal(ours, plain)  # compiled with the layout
    torch._dynamo.reset()  # traced again below, now with the rows swapped
    candidates._compiled.cache_clear()
    read_out_rows_rolled(target, monkeypatch)
    assert torch.equal(target.generate(prompt, max_new_tokens=30, do_sample=False, **static), plain)
    swapped = target.generate(prompt, max_new_tokens=30, do_sample=False, assistant_model=speculator,
                              speculation="xpress", num_draft_tokens=3, **static)
    assert not torch.equal(swapped, plain)
    assert torch.equal(target.generate(prompt, max_new_tokens=30, do_sample=False, **static), plain)
    assert torch._C._len_torch_function_stack() == 0
