"""The CPU read-out layout (`_read_out.py`): the same logits as `F.linear`, taken only where it was measured to pay,
and drafts made through it still verify to the target's own greedy output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hf_specdiff
from hf_specdiff import _read_out
from hf_specdiff._read_out import module_read_out, read_out, transposed_layout_pays

from conftest import make_speculator, make_target

VOCAB, HIDDEN = 512, 24  # a read-out's shape: far taller than wide


@pytest.mark.parametrize("shape", [(1, HIDDEN), (2, HIDDEN), (1, 5, HIDDEN), (2, 16, HIDDEN), (33, HIDDEN)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_read_out_equals_linear(shape, with_bias):
    torch.manual_seed(0)
    x, weight = torch.randn(shape), torch.randn(VOCAB, HIDDEN)
    bias = torch.randn(VOCAB) if with_bias else None
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    logits = read_out(x, weight, bias)
    assert logits.shape == expected.shape and logits.dtype == torch.float32 and logits.is_contiguous()
    torch.testing.assert_close(logits.double(), expected, rtol=1e-5, atol=1e-5)


def test_transposed_layout_only_for_few_rows_of_a_float32_cpu_read_out():
    weight = torch.randn(VOCAB, HIDDEN)
    assert not transposed_layout_pays(torch.randn(1, HIDDEN), weight)  # one row: BLAS's matrix-vector path
    assert transposed_layout_pays(torch.randn(1, 2, HIDDEN), weight)
    assert transposed_layout_pays(torch.randn(2, 16, HIDDEN), weight)  # 32 rows
    assert not transposed_layout_pays(torch.randn(33, HIDDEN), weight)
    assert not transposed_layout_pays(torch.randn(4, HIDDEN).double(), weight.double())  # not measured
    assert not transposed_layout_pays(torch.randn(4, HIDDEN), torch.randn(HIDDEN, HIDDEN))  # not a read-out


def test_module_read_out_takes_a_plain_linear_and_calls_anything_else():
    torch.manual_seed(0)
    x, head = torch.randn(1, 3, HIDDEN), torch.nn.Linear(HIDDEN, VOCAB)
    torch.testing.assert_close(module_read_out(head, x), head(x), rtol=1e-5, atol=1e-5)
    scaled = torch.nn.Sequential(head, torch.nn.Tanh())  # e.g. a soft-capped head: its own forward must run
    torch.testing.assert_close(module_read_out(scaled, x), scaled(x))


@pytest.mark.parametrize("method", ["dflash", "xpress", "markov"])
def test_float32_greedy_output_equals_plain_greedy_with_drafts_read_out_in_the_cpu_layout(method, monkeypatch):
    target = make_target(vocab_size=VOCAB, hidden_size=HIDDEN, dtype=torch.float32)
    speculator = make_speculator(target).to(torch.float32)
    prompt = torch.tensor([[1, 5, 9, 13]])
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    hf_specdiff.enable(target)
    layouts, original = [], _read_out.read_out

    def recording(x, weight, bias=None):  # the drafter's read-out, through module_read_out
        layouts.append(weight is target.lm_head.weight and transposed_layout_pays(x, weight))
        return original(x, weight, bias)

    monkeypatch.setattr(_read_out, "read_out", recording)
    ours = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=speculator,
                           speculation=method)
    assert torch.equal(ours, plain)
    assert layouts and all(layouts)
