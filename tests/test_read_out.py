"""The CPU read-out layout (`_read_out.py`): the same logits as `F.linear`, taken only where it was measured to pay;
drafts made through it, and verify logits the loop reads out of the target's last hidden state, still give the target's
own greedy output; a target that post-processes its logits keeps its own read-out."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hf_specdiff
from hf_specdiff import _read_out, generation
from hf_specdiff._read_out import module_read_out, read_out, reads_out_last_hidden_state, transposed_layout_pays

from conftest import make_speculator, make_successor_target, make_target

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
    monkeypatch.setattr(generation, "reads_out_last_hidden_state", lambda model, outputs: False)  # verify's: below
    ours = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=speculator,
                           speculation=method)
    assert torch.equal(ours, plain)
    assert layouts and all(layouts)


# ---- the target's verify read-out: the loop reads the verified positions out of the last hidden state itself ----


def offset_target(target):
    """The target post-processing its logits (as soft-capping or logit scaling would): logits + a fixed offset."""
    offset = 50.0 * torch.randn(target.config.vocab_size, generator=torch.Generator().manual_seed(3))

    def add_offset(module, args, outputs):
        outputs.logits = outputs.logits + offset
        return outputs

    target.register_forward_hook(add_offset)
    return target


def prefill_outputs(target, prompt):
    with torch.no_grad():
        return target(prompt, output_hidden_states=True, logits_to_keep=1)


def test_the_loop_reads_out_only_a_float32_cpu_target_whose_logits_are_its_head_on_the_last_hidden_state():
    target = make_target(vocab_size=VOCAB, hidden_size=HIDDEN, dtype=torch.float32)
    prompt = torch.tensor([[1, 5, 9, 13], [0, 2, 4, 6]])
    assert reads_out_last_hidden_state(target, prefill_outputs(target, prompt))
    as_float64 = make_target(vocab_size=VOCAB, hidden_size=HIDDEN, dtype=torch.float64)
    assert not reads_out_last_hidden_state(as_float64, prefill_outputs(as_float64, prompt))  # F.linear anyway
    outputs = prefill_outputs(target, prompt)
    offset = offset_target(make_target(vocab_size=VOCAB, hidden_size=HIDDEN, dtype=torch.float32))
    assert not reads_out_last_hidden_state(offset, prefill_outputs(offset, prompt))
    target.lm_head = torch.nn.Sequential(target.lm_head)  # not a plain Linear: its own forward must run
    assert not reads_out_last_hidden_state(target, outputs)


def recorded_verify_read_outs(monkeypatch):
    calls, original = [], generation.module_read_out

    def recording(head, hidden):
        calls.append(hidden.shape[:2])
        return original(head, hidden)

    monkeypatch.setattr(generation, "module_read_out", recording)
    return calls


@pytest.mark.parametrize("method", ["dflash", "xpress"])
@pytest.mark.parametrize("num_draft_tokens", [None, 3])
def test_greedy_output_equals_plain_greedy_with_the_verify_read_out_in_the_loop(method, num_draft_tokens, monkeypatch):
    target = make_successor_target(dtype=torch.float32, vocab_size=VOCAB)
    speculator = make_speculator(target, oracle=True).to(torch.float32)
    prompts = torch.tensor([[0, 0, 1, 5, 9], [2, 3, 4, 7, 8], [0, 0, 0, 6, 11]])
    mask = (torch.arange(5) >= torch.tensor([[2], [0], [3]])).long()
    plain = target.generate(prompts, attention_mask=mask, max_new_tokens=30, do_sample=False)
    hf_specdiff.enable(target)
    calls = recorded_verify_read_outs(monkeypatch)
    ours = target.generate(prompts, attention_mask=mask, max_new_tokens=30, do_sample=False, assistant_model=speculator,
                           speculation=method, num_draft_tokens=num_draft_tokens)
    assert torch.equal(ours, plain)
    assert calls and calls[0][1] == (num_draft_tokens or 7) + 1  # first verify: anchor + full block


def test_a_target_that_post_processes_its_logits_keeps_its_own_read_out(monkeypatch):
    target = offset_target(make_target(vocab_size=VOCAB, hidden_size=HIDDEN, dtype=torch.float32))
    speculator = make_speculator(target).to(torch.float32)
    prompt = torch.tensor([[1, 5, 9, 13]])
    plain = target.generate(prompt, max_new_tokens=16, do_sample=False)
    hf_specdiff.enable(target)
    calls = recorded_verify_read_outs(monkeypatch)
    run = lambda: target.generate(prompt, max_new_tokens=16, do_sample=False, assistant_model=speculator,
                                  speculation="dflash")
    assert torch.equal(run(), plain) and not calls
    # Negative control: read out without the check, the loop verifies against logits the model never produces.
    monkeypatch.setattr(generation, "reads_out_last_hidden_state", lambda model, outputs: True)
    assert not torch.equal(run(), plain) and calls
