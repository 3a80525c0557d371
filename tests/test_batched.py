"""Batched speculation: every row of a left-padded batch gets exactly what it gets alone, and what plain batched
`generate` gives it (fp64 tiny models: identical tokens); sampled rows each follow the target's distribution."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import (
    CONV_STATE_FAMILIES,
    STATE_FAMILIES,
    VOCAB,
    accept_every_draft,
    char_tokenizer,
    chi_square_p_value,
    exact_distribution,
    make_sampling_pair,
    make_speculator,
    make_state_target,
    make_successor_target,
    make_target,
    replay_greedy_drafts,
)
from transformers import StaticCache
from transformers.generation.streamers import BaseStreamer

import hf_specdiff
import hf_specdiff.batching
import hf_specdiff.generation
from hf_specdiff import BlockDiffusionCandidateGenerator, _compat

METHODS = ["xpress", "dflash", "markov"]
PAD = 0  # conftest's pad_token_id; prompts below never contain it


def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def ragged_batches(count: int, size: int, seed: int, max_length: int = 20):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        lengths = torch.randint(1, max_length, (size,), generator=generator).tolist()
        yield [torch.randint(1, VOCAB, (n,), generator=generator) for n in lengths]


def speculate(target, speculator, method, ids, mask, **kwargs):
    kwargs.setdefault("return_dict_in_generate", True)
    return target.generate(ids, attention_mask=mask, assistant_model=speculator, speculation=method, **kwargs)


def count_compactions(monkeypatch, check=None) -> list[tuple[bool, int]]:
    """Records (compacted, number of caches handed) for every compaction check the loop makes; `check(rows, caches)`
    runs after each compaction that happened."""
    calls = []
    original = hf_specdiff.batching.RowBatch.compact_if_sparse

    def counting(self, caches, max_slots=None):
        done = original(self, caches, max_slots)
        calls.append((done, len(caches)))
        if done and check is not None:
            check(self, caches)
        return done

    monkeypatch.setattr(hf_specdiff.batching.RowBatch, "compact_if_sparse", counting)
    return calls


def assert_rows_exact(target, speculator, method, prompts, check_row_stats=True, **kwargs):
    """Batched speculation == plain batched generate on the same padded batch, and each row == that row alone
    (plain and speculative: same tokens, same accepted lengths). Returns the batched output."""
    kwargs.setdefault("do_sample", False)
    ids, mask = left_pad(prompts)
    plain = target.generate(ids, attention_mask=mask, **kwargs)
    out = speculate(target, speculator, method, ids, mask, **kwargs)
    assert torch.equal(out.sequences, plain), f"{method}:\n{out.sequences.tolist()}\n!=\n{plain.tolist()}"
    stats = out.speculation
    assert stats.batch_size == len(prompts) and len(stats.row_accepted_lengths) == len(prompts)
    assert len(stats.accepted_lengths) == sum(len(r) for r in stats.row_accepted_lengths)
    assert stats.target_forwards == max(len(r) for r in stats.row_accepted_lengths) + 1
    assert stats.drafted_tokens == sum(stats.drafted_lengths)  # drafts offered to rows still decoding only
    assert stats.accepted_tokens == sum(stats.accepted_draft_lengths)
    for row, prompt in enumerate(prompts):
        alone = speculate(target, speculator, method, prompt[None], None, **kwargs)
        assert torch.equal(alone.sequences, target.generate(prompt[None], **kwargs))
        start = ids.shape[1] - len(prompt)
        assert torch.equal(out.sequences[row, start : start + alone.sequences.shape[1]], alone.sequences[0])
        if check_row_stats:  # the row met the same drafts and verdicts as alone: both caches are right per row
            assert stats.row_accepted_lengths[row] == alone.speculation.accepted_lengths, row
            assert stats.row_drafted_lengths[row] == alone.speculation.drafted_lengths, row
    return out


# Sliding-window families: Mistral (every layer windowed: one mask) and Gemma 3 (sliding and full layers: a mask per
# layer type; RoPE per layer type). The window (5) is shorter than a block, so holes fall inside windows. Llama 4's
# chunked attention (chunks of 5 positions, then a full-attention layer without RoPE): holes fall inside chunks.
SLIDING_TARGETS = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 5}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"sliding_window": 5, "head_dim": 16, "layer_types": ["sliding_attention", "full_attention"] * 2}),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               {"attention_chunk_size": 5, "head_dim": 16,
                "layer_types": ["chunked_attention"] * 3 + ["full_attention"], "intermediate_size_mlp": 128,
                "num_local_experts": 2, "num_experts_per_tok": 1, "experts_implementation": "eager",
                "layer_scale": 8.0}),  # (its experts stay unscaled)
}


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", SLIDING_TARGETS)
def test_sliding_window_rows_equal_row_by_row(family, attention, record_drafts, monkeypatch):
    """Rows accept different runs, so the cache holds holes inside the rows' windows; each row still sees exactly its
    last `sliding_window` tokens (or those of its chunk), as alone and as in plain batched generate. (Eager in float32:
    transformers' eager attention turns a float64 left-padded row into NaNs, in plain generate too.)"""
    import transformers

    config_name, model_name, fields = SLIDING_TARGETS[family]
    fields = dict(fields)
    layer_scale = fields.pop("layer_scale", 12.0)
    target = hf_specdiff.enable(make_successor_target(
        layer_scale, eos_token_id=17, config_class=getattr(transformers, config_name),
        model_class=getattr(transformers, model_name), num_layers=len(fields.get("layer_types", [None] * 3)),
        attn_implementation=attention, dtype=torch.float64 if attention == "sdpa" else torch.float32, **fields,
    ))
    speculator = make_speculator(target, oracle=True)
    windowed = []
    original = hf_specdiff.batching.windowed_masks
    monkeypatch.setattr(hf_specdiff.batching, "windowed_masks", lambda *a: windowed.append(1) or original(*a))
    taus = []
    for i, prompts in enumerate(ragged_batches(count=3, size=4, seed=3)):
        taus.append(assert_rows_exact(target, speculator, "xpress", prompts, max_new_tokens=14 + 6 * i).speculation.tau)
    assert windowed, "no verify forward had holes: the windowed masks went untested"
    assert sum(taus) / len(taus) > 1.5, "the oracle should get runs of different lengths accepted"


@pytest.mark.parametrize("family", STATE_FAMILIES)
def test_targets_with_recurrent_or_conv_state_rows_equal_row_by_row(family, monkeypatch):
    """A layer keeping a state (recurrent, conv) has no slots to mask: after each verify forward every row's state goes
    back to what it was after the row's own last kept token, while the other rows keep more; rows that finish take
    their state out of the batch. Drafts replay plain greedy's tokens wrong from a slot the row's tokens pick, so the
    rows of a step keep different numbers of tokens. (Recurrent states need transformers 5.25, as for one row.) With
    sliding-window layers beside, the cache keeps every slot for them and their windows come from the loop's masks,
    while the state layers get none; Inkling's attention, which counts distances in cache slots, gets a cache
    compacted at every step that leaves a hole."""
    target = make_state_target(family)
    speculator = make_speculator(target)
    if family not in CONV_STATE_FAMILIES and not _compat.recurrent_rollback_supported():
        pytest.skip("a recurrent state rolls back from transformers 5.25 on (refusal: test_greedy.py)")
    per_row, windowed = [], []
    original = _compat.roll_back_rows
    monkeypatch.setattr(_compat, "roll_back_rows",
                        lambda c, n, kept, idle=None: per_row.append(kept) or original(c, n, kept, idle))
    original_masks = hf_specdiff.batching.windowed_masks
    monkeypatch.setattr(hf_specdiff.batching, "windowed_masks", lambda *a: windowed.append(1) or original_masks(*a))
    finished_early = 0
    # the last batch's prompts are one token, shorter than a conv kernel (3 or 4): its conv states start short
    short = [torch.tensor([3]), torch.tensor([5]), torch.tensor([9])]
    for i, prompts in enumerate([*ragged_batches(count=3, size=4, seed=3), short]):
        # EOS (after a batch without): the token the rows generate most, so that rows meet it at different steps
        target.generation_config.eos_token_id = None
        sequences = [target.generate(p[None], do_sample=False, max_new_tokens=24)[0] for p in prompts]
        if i > 0:
            generated = torch.cat([s[len(p) :] for s, p in zip(sequences, prompts)])
            target.generation_config.eos_token_id = int(generated.mode().values)
            sequences = [target.generate(p[None], do_sample=False, max_new_tokens=24)[0] for p in prompts]
            finished_early += sum(len(s) < len(p) + 24 for s, p in zip(sequences, prompts))
        with monkeypatch.context() as patch:
            replay_greedy_drafts(patch, sequences)
            for method in ("xpress", "dflash"):
                assert_rows_exact(target, speculator, method, prompts, max_new_tokens=24)
    assert sum(min(kept) < max(kept) for kept in per_row) >= 10, "rows never kept different numbers of tokens"
    assert finished_early >= 2, "no row left the batch early"
    sliding = {"sliding_attention", "hybrid_sliding"} & set(getattr(target.config, "layer_types", None) or ())
    assert bool(windowed) == bool(sliding), "the loop's windowed masks are for sliding-window layers, and only for them"


@pytest.fixture
def record_drafts(monkeypatch):
    """Checks that a row drafts the same block, from the same draft logits q, in a batch as alone: collects
    {row's tokens so far (left padding stripped): (drafts, q)} from every drafter call and compares repeats."""
    seen: dict[tuple, tuple] = {}
    original = BlockDiffusionCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, rows=None, **kwargs):
        candidate_ids, q = original(self, input_ids, *args, rows=rows, **kwargs)
        if q is not None:
            lengths = rows.lengths if rows is not None else [input_ids.shape[1]] * input_ids.shape[0]
            for row in rows.active() if rows is not None else range(len(lengths)):  # (a static batch keeps the others)
                length = lengths[row]
                tokens = input_ids[row, :length].tolist()
                while tokens and tokens[0] == PAD:
                    tokens.pop(0)
                drafts = candidate_ids[row, length : length + q.shape[1]].tolist()
                earlier_drafts, earlier_q = seen.setdefault(tuple(tokens), (drafts, q[row]))
                common = min(len(earlier_drafts), len(drafts))  # a batch drafts as far as its row with most room
                assert earlier_drafts[:common] == drafts[:common], f"two different drafts after {tokens}"
                tolerance = 1e-9 if q.dtype == torch.float64 else 1e-5  # float32: rounding differs with the batch
                torch.testing.assert_close(earlier_q[:common], q[row, :common], rtol=tolerance, atol=tolerance)
        return candidate_ids, q

    monkeypatch.setattr(BlockDiffusionCandidateGenerator, "get_candidates", recording)
    return seen


@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("method", METHODS)
def test_random_drafts_rows_equal_row_by_row(method, cache, record_drafts):
    """Drafts nearly always rejected. The recorder also asserts that a row drafts the same block in the batch as
    alone: the drafter's own cache and context are right per row (ragged contexts, holes, left padding). With
    cache_implementation="static" too: static target and drafter caches, finished rows kept in the batch."""
    target = hf_specdiff.enable(make_target())
    speculator = make_speculator(target)
    for i, prompts in enumerate(ragged_batches(count=2, size=4, seed=0)):
        assert_rows_exact(target, speculator, method, prompts, max_new_tokens=8 + 5 * i, cache_implementation=cache)
    assert len(record_drafts) > 20


@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("method", METHODS)
def test_accepted_drafts_rows_equal_row_by_row(method, cache, record_drafts):
    """Oracle add-ons on a successor target with an EOS: rows accept runs of different lengths (holes in the cache,
    compaction), some stop at EOS inside a block, others at max_new_tokens. Static too, as above."""
    target = hf_specdiff.enable(make_successor_target(eos_token_id=17))
    speculator = make_speculator(target, oracle=True)
    taus = []
    for i, prompts in enumerate(ragged_batches(count=3, size=5, seed=1)):
        out = assert_rows_exact(target, speculator, method, prompts, max_new_tokens=12 + 7 * i,
                                cache_implementation=cache)
        taus.append(out.speculation.tau)
    if method != "dflash":
        assert sum(taus) / len(taus) > 1.5, "the oracle should get runs of several tokens accepted"


@pytest.mark.parametrize("method", ["xpress", "markov"])
def test_fewer_draft_tokens_rows_equal_plain_batched(method):
    """num_draft_tokens with a batch: every row still gets plain batched generate's tokens, with at most k drafts."""
    target = hf_specdiff.enable(make_successor_target(eos_token_id=17))
    speculator = make_speculator(target, oracle=True)
    for i, prompts in enumerate(ragged_batches(count=3, size=4, seed=2)):
        ids, mask = left_pad(prompts)
        plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10 + 5 * i)
        out = speculate(target, speculator, method, ids, mask, do_sample=False, max_new_tokens=10 + 5 * i,
                        num_draft_tokens=2)
        assert torch.equal(out.sequences, plain)
        assert max(out.speculation.drafted_lengths) <= 2 and max(out.speculation.accepted_lengths) <= 3


@pytest.mark.parametrize("method", METHODS)
def test_rows_finish_at_different_steps_and_leave_the_batch(method, record_drafts):
    """Pure successor target, EOS = 17: rows reach EOS inside a drafted block at different steps, or never (they stop
    at max_new_tokens). Finished rows are padded like plain generate pads them, and leave the batch: the target and
    the drafter see fewer rows, and the rows left draft what they draft alone."""
    target = hf_specdiff.enable(make_successor_target(layer_scale=0.0, eos_token_id=17))
    speculator = make_speculator(target, block_size=8, oracle=True, num_jacobi_passes=8)
    prompts = [torch.tensor(p) for p in ([8, 9, 10], [30, 31], [14], [50, 51, 52], list(range(2, 13)))]
    target_rows, drafter_rows = [], []
    target.register_forward_pre_hook(lambda m, a, kw: target_rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
    speculator.drafter.register_forward_pre_hook(
        lambda m, a, kw: drafter_rows.append(kw["noise_embeds"].shape[0]), with_kwargs=True
    )
    out = assert_rows_exact(target, speculator, method, prompts, max_new_tokens=25)
    ids, mask = left_pad(prompts)
    target_rows.clear()
    drafter_rows.clear()
    speculate(target, speculator, method, ids, mask, do_sample=False, max_new_tokens=25)
    assert target_rows[0] == 5 and target_rows == sorted(target_rows, reverse=True) and target_rows[-1] <= 2
    assert drafter_rows == sorted(drafter_rows, reverse=True) and drafter_rows[-1] <= 2
    # rows 0, 2 and 4 end with EOS (then padding); rows 1 and 3 run to max_new_tokens
    generated = out.sequences[:, ids.shape[1] :]
    eos_at = [int((row == 17).nonzero()[0, 0]) if (row == 17).any() else None for row in generated]
    assert eos_at == [6, None, 2, None, 4]
    assert (generated[0, 7:] == PAD).all() and (generated[2, 3:] == PAD).all()
    if method != "dflash":  # EOS came inside an accepted run, not at a block boundary
        assert out.speculation.row_accepted_lengths[0] == [6]


def test_a_row_finished_at_the_prefill_has_no_tau():
    """A row whose first token is EOS finishes at the prefill, before any verify step: its `row_tau` is None, not a 0
    that reads as a row that accepted nothing, while the other rows' tau and the batch's are their steps' means."""
    target = hf_specdiff.enable(make_successor_target(layer_scale=0.0, eos_token_id=17))
    speculator = make_speculator(target, block_size=4, oracle=True)
    ids, mask = left_pad([torch.tensor([15, 16]), torch.tensor([3, 4, 5])])  # row 0's first token: 17, EOS
    stats = speculate(target, speculator, "xpress", ids, mask, do_sample=False, max_new_tokens=9).speculation
    assert stats.row_accepted_lengths[0] == [] and stats.row_tau[0] is None
    assert stats.row_tau[1] == stats.tau == sum(stats.row_accepted_lengths[1]) / len(stats.row_accepted_lengths[1]) > 1


@pytest.mark.parametrize("method", METHODS)
def test_a_peft_mixed_adapter_batch_keeps_each_row_on_its_adapter(method):
    """`peft_model.generate(adapter_names=[...])` runs each row through its own LoRA adapter: a hook hands the list to
    every LoRA layer's forward, which refuses a batch of another size. Rows that finish stay in the batch (the loop
    crashed when one left), and each row gets what plain generate gives it with the same list, and what it gets alone
    with its adapter."""
    import peft

    base = make_successor_target(eos_token_id=5)
    lora = dict(r=4, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], init_lora_weights=False)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(**lora), adapter_name="a")
    wrapped.add_adapter("b", peft.LoraConfig(**lora))
    wrapped.eval()
    hf_specdiff.enable(base)
    speculator = make_speculator(base, oracle=True)
    prompts = [torch.tensor([5, 9, 3, 7, 2]), torch.tensor([4, 9, 1, 33, 7, 12, 15])]
    ids, mask = left_pad(prompts)
    names = ["a", "b"]
    options = dict(do_sample=False, max_new_tokens=20, adapter_names=names)
    plain = wrapped.generate(input_ids=ids, attention_mask=mask, **options)
    generated = plain[:, ids.shape[1]:]
    assert not (generated[0] == 5).any() and generated[1, 1] == 5  # row "b" finishes on its second token
    out = wrapped.generate(input_ids=ids, attention_mask=mask, assistant_model=speculator, speculation=method,
                           **options)
    assert torch.equal(out, plain), f"{out.tolist()}\n!=\n{plain.tolist()}"
    for row, (prompt, name) in enumerate(zip(prompts, names)):
        options.update(adapter_names=[name])
        alone = wrapped.generate(input_ids=prompt[None], assistant_model=speculator, speculation=method, **options)
        other = wrapped.generate(input_ids=prompt[None], **{**options, "adapter_names": [names[1 - row]]})
        assert torch.equal(plain[row, ids.shape[1] - len(prompt):][: alone.shape[1]], alone[0])
        assert not torch.equal(alone, other)  # the adapters differ: a row on the wrong one would be caught


def peft_batch_exact(wrapped, base, prompts, methods=METHODS, **per_row):
    """Plain and speculative `generate` of a PEFT model over a padded batch whose first row ends on its third token
    (its EOS), with `per_row` arguments (adapter_names, task_ids): the same tokens."""
    ids, mask = left_pad(prompts)
    options = dict(do_sample=False, max_new_tokens=12, pad_token_id=PAD, **per_row)
    options["eos_token_id"] = int(wrapped.generate(input_ids=ids, attention_mask=mask, **options)[0, ids.shape[1] + 2])
    plain = wrapped.generate(input_ids=ids, attention_mask=mask, **options)
    assert (plain[1:, -1] != PAD).all(), "the other rows should outlive the first"
    speculator = make_speculator(base)
    for method in methods:
        out = wrapped.generate(input_ids=ids, attention_mask=mask, assistant_model=speculator, speculation=method,
                               **options)
        assert torch.equal(out, plain), f"{method}:\n{out.tolist()}\n!=\n{plain.tolist()}"


@pytest.mark.parametrize("family", ["qwen3_5", "mamba", "lfm2"])
def test_a_peft_mixed_adapter_batch_on_layers_keeping_a_state(family):
    """A finished row kept in the batch keeps no slot, and no state anyone reads: on layers that keep one (linear
    attention, Mamba, convolutions) its state is left as the longest run's. It asked for the state from before the
    whole verify forward, further back than the recorded history, and was refused."""
    import peft

    if family not in CONV_STATE_FAMILIES and not _compat.recurrent_rollback_supported():
        pytest.skip("a recurrent state rolls back from transformers 5.25 on (refusal: test_greedy.py)")
    base = make_state_target(family)
    modules = {"qwen3_5": ["q_proj", "v_proj", "down_proj"], "mamba": ["in_proj", "x_proj"]}.get(family,
                                                                                               ["q_proj", "v_proj"])
    lora = dict(r=4, target_modules=modules, init_lora_weights=False)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(**lora), adapter_name="a")
    wrapped.add_adapter("b", peft.LoraConfig(**lora))
    wrapped.eval()
    prompts = [torch.tensor([5, 9, 3, 7, 2]), torch.tensor([4, 9, 1, 33, 7, 12, 15])]
    peft_batch_exact(wrapped, base, prompts, methods=["xpress"], adapter_names=["a", "b"])


def test_a_peft_poly_batch_keeps_each_row_on_its_task():
    """PEFT's Poly routes each row by its task (`generate(task_ids=...)`, handed to every Poly layer by a hook, for the
    whole batch): finished rows stay in the batch, as with mixed adapters. The loop crashed when a row left it."""
    import peft

    base = make_successor_target()
    config = peft.PolyConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                             n_tasks=2, n_skills=2, n_splits=1)
    wrapped = peft.get_peft_model(base, config).eval()
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if "poly" in name:
                parameter.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    wrapped.double()
    hf_specdiff.enable(base)
    prompts = [torch.tensor([5, 9, 3, 7, 2]), torch.tensor([4, 9, 1, 33, 7, 12, 15]), torch.tensor([40, 41, 2, 3])]
    ids, mask = left_pad(prompts)
    routed = [wrapped.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                               task_ids=torch.tensor(tasks)) for tasks in ([0, 1, 0], [1, 0, 1])]
    assert not torch.equal(*routed)  # the tasks matter
    peft_batch_exact(wrapped, base, prompts, task_ids=torch.tensor([0, 1, 0]))


def test_a_static_batch_keeps_its_rows_and_its_shapes(monkeypatch):
    """cache_implementation="static" with a batch: rows finish at different steps (EOS inside a block, or
    max_new_tokens) and stay in the batch, so that every verify forward after the prefill has the same inputs' shapes
    (rows, width, positions, a mask over the whole static cache) and so has every draft step after the first: a
    compiled forward is captured once. Outputs equal plain static batched generate and each row alone (same accepted
    runs); a second call reuses both static caches at the same addresses. When holes would overflow the static
    cache, the caches are compacted whatever their share of holes."""
    target = hf_specdiff.enable(make_successor_target(layer_scale=0.0, eos_token_id=17))
    speculator = make_speculator(target, block_size=8, oracle=True, num_jacobi_passes=8)
    prompts = [torch.tensor(p) for p in ([8, 9, 10], [30, 31], [14], [50, 51, 52], list(range(2, 13)))]
    ids, mask = left_pad(prompts)
    options = dict(do_sample=False, max_new_tokens=25, cache_implementation="static")
    plain = target.generate(ids, attention_mask=mask, **options)
    assert torch.equal(plain, target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=25))
    out = assert_rows_exact(target, speculator, "xpress", prompts, **options)
    generated = out.sequences[:, ids.shape[1] :]
    assert [int((row == 17).nonzero()[0, 0]) if (row == 17).any() else None
            for row in generated] == [6, None, 2, None, 4]
    # finished rows were kept but counted nowhere: the same statistics as the dynamic loop, which drops them (the
    # refinement's passes follow the rows still decoding)
    dynamic = speculate(target, speculator, "xpress", ids, mask, do_sample=False, max_new_tokens=25).speculation
    for name in ("accepted_lengths", "drafted_lengths", "drafted_tokens", "accepted_tokens", "refine_passes",
                 "row_accepted_lengths", "target_forwards"):
        assert getattr(out.speculation, name) == getattr(dynamic, name), name

    verify_shapes, draft_shapes = [], []
    hooks = [target.register_forward_pre_hook(lambda m, a, kw: verify_shapes.append(
        (tuple(kw["input_ids"].shape), tuple(kw["position_ids"].shape), tuple(kw["attention_mask"].shape))
    ), with_kwargs=True), speculator.drafter.register_forward_pre_hook(lambda m, a, kw: draft_shapes.append(
        (tuple(kw["noise_embeds"].shape), tuple(kw["position_ids"].shape), tuple(kw["attention_mask"].shape))
    ), with_kwargs=True)]
    again = speculate(target, speculator, "xpress", ids, mask, **options)
    for hook in hooks:
        hook.remove()
    assert torch.equal(again.sequences, plain)
    assert len(set(verify_shapes[1:])) == 1 and verify_shapes[1][0] == (5, 8), verify_shapes
    assert len(set(draft_shapes[1:])) == 1 and draft_shapes[1][0][0] == 5, draft_shapes
    target_cache = _compat._reused_static_caches.by_owner[target][1]
    drafter_cache = _compat._reused_static_caches.by_owner[speculator.drafter][1]
    pointers = [target_cache.layers[0].keys.data_ptr(), drafter_cache.layers[0].keys.data_ptr()]
    speculate(target, speculator, "xpress", ids, mask, **options)
    assert _compat._reused_static_caches.by_owner[target][1] is target_cache
    assert [target_cache.layers[0].keys.data_ptr(), drafter_cache.layers[0].keys.data_ptr()] == pointers

    # rows accepting runs of different lengths, holes never worth compacting for their share: compaction only when
    # the static cache would overflow
    target = hf_specdiff.enable(make_successor_target(eos_token_id=17))
    speculator = make_speculator(target, oracle=True)
    monkeypatch.setattr(hf_specdiff.batching, "COMPACT_WHEN_WASTED", 1.0)
    compactions = count_compactions(monkeypatch)

    def fits(module, args, kwargs):  # every write lands inside the static cache
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, StaticCache):
            assert int(cache.get_seq_length()) + kwargs["input_ids"].shape[1] <= cache.layers[0].max_cache_len

    hook = target.register_forward_pre_hook(fits, with_kwargs=True)
    for i, batch in enumerate(ragged_batches(count=2, size=5, seed=1)):
        assert_rows_exact(target, speculator, "xpress", batch, **dict(options, max_new_tokens=30 + 7 * i))
    hook.remove()
    assert any(done for done, _ in compactions), "no compaction: the overflow guard went untested"
    # num_return_sequences with sampling: each prompt's copies are rows of the static batch
    sampled = speculate(target, speculator, "xpress", ids[:2], mask[:2], do_sample=True, num_return_sequences=3,
                        max_new_tokens=8, cache_implementation="static")
    assert sampled.sequences.shape == (6, ids.shape[1] + 8) and sampled.speculation.batch_size == 6


def test_a_static_batch_compacts_on_its_last_step_without_drafts(monkeypatch):
    """The last step drafts nothing (every row still decoding is one token from max_length), so the drafter's cache
    holds fewer slots than the target's; when that step's holes would overflow the static cache, the target's alone
    is compacted (the drafter never drafts again). This batch raised "caches hold different slots" before."""
    target = hf_specdiff.enable(make_successor_target(eos_token_id=17))
    speculator = make_speculator(target, oracle=True)
    prompts = [torch.tensor([54, 10, 54]), torch.tensor([22, 28, 41, 54])]
    compactions = count_compactions(monkeypatch)
    assert_rows_exact(target, speculator, "xpress", prompts, max_new_tokens=10, cache_implementation="static")
    assert (True, 1) in compactions, "the target's cache was never compacted alone: the case went untested"


@pytest.mark.parametrize("eos_token_id", [None, 63])
def test_stop_strings_per_row(eos_token_id):
    """Stop strings fire for each row at its own step. With an EOS token plain generate pads a stopped row; without
    one it keeps generating it until every row has stopped, and so must we."""
    tokenizer = char_tokenizer()  # token t is a character
    target = hf_specdiff.enable(make_successor_target(layer_scale=0.0, eos_token_id=eos_token_id))
    speculator = make_speculator(target, block_size=8, oracle=True, num_jacobi_passes=8)
    # "mno" = tokens 22, 23, 24: reached after 3, 7 and 13 tokens, or never (rows 3 and 4)
    prompts = [torch.tensor(p) for p in ([19, 20, 21], [15, 16, 17], [4, 5, 6, 7, 8, 9, 10, 11], [40], [30, 31])]
    out = assert_rows_exact(target, speculator, "xpress", prompts, check_row_stats=False, max_new_tokens=18,
                            stop_strings=["mno"], tokenizer=tokenizer)
    texts = tokenizer.batch_decode(out.sequences[:, left_pad(prompts)[0].shape[1] :])
    assert [t.find("mno") for t in texts] == [0, 4, 10, -1, -1]
    if eos_token_id is None:
        # rows accepting at different paces: the row that stops first reaches max_new_tokens before the last row's
        # stop is known, and must still end where plain decoding ends every row
        target = hf_specdiff.enable(make_successor_target(eos_token_id=None))
        speculator = make_speculator(target, block_size=8, oracle=True, num_jacobi_passes=8)
        prompts = [torch.tensor(p) for p in ([6, 40, 5, 20], [60], [6, 53, 49, 3, 2])]
        assert_rows_exact(target, speculator, "xpress", prompts, check_row_stats=False, max_new_tokens=27,
                          stop_strings=["m"], tokenizer=tokenizer)


def test_criteria_the_user_passes_are_the_ones_that_stop():
    """A user's EosTokenCriteria or MaxLengthCriteria replaces the one `generate` builds from the config, and a
    subclass of one is asked as any other criterion; a criterion may read the scores of the token it judges; a float
    attention mask is a mask like any other. Each as plain batched `generate` does it."""
    from transformers.generation.stopping_criteria import (
        EosTokenCriteria,
        MaxLengthCriteria,
        StoppingCriteria,
        StoppingCriteriaList,
    )

    class ExtraStopTokens(EosTokenCriteria):
        pass

    class ConfidentStop(StoppingCriteria):  # reads the scores plain generate passes (output_scores: every step's)
        def __call__(self, input_ids, scores, **kwargs):
            return scores[-1].softmax(dim=-1).max(dim=-1).values > 0.2

    target = hf_specdiff.enable(make_successor_target(layer_scale=0.0, eos_token_id=40))
    speculator = make_speculator(target, block_size=8, oracle=True)
    prompts = [torch.tensor([10, 11]), torch.tensor([3, 4, 5])]
    ids, mask = left_pad(prompts)
    unstopped = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12)
    options = dict(do_sample=False, max_new_tokens=12, output_scores=True, return_dict_in_generate=True)
    for criterion in (EosTokenCriteria(17), ExtraStopTokens(17), MaxLengthCriteria(max_length=7), ConfidentStop()):
        criteria = StoppingCriteriaList([criterion])
        plain = target.generate(ids, attention_mask=mask, stopping_criteria=criteria, **options).sequences
        out = speculate(target, speculator, "xpress", ids, mask, stopping_criteria=criteria, **options).sequences
        assert torch.equal(out, plain), f"{type(criterion).__name__}: {out.tolist()} != {plain.tolist()}"
        assert not torch.equal(out, unstopped), type(criterion).__name__  # it did stop something
    ids, mask = left_pad([torch.tensor([3, 4, 5, 6, 7, 8, 9, 10, 11]), torch.tensor([30])])
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30)
    for dtype in (torch.float32, torch.bool, torch.int32):
        out = speculate(target, speculator, "xpress", ids, mask.to(dtype), do_sample=False, max_new_tokens=30)
        assert torch.equal(out.sequences, plain), dtype


@pytest.mark.parametrize("method", METHODS)
def test_position_dependent_processors_on_ragged_rows(method):
    """Repetition penalty and min_new_tokens score each row's drafts against its own prefix and length."""
    target = hf_specdiff.enable(make_successor_target(eos_token_id=17))
    speculator = make_speculator(target, oracle=True)
    for i, prompts in enumerate(ragged_batches(count=2, size=4, seed=2)):
        assert_rows_exact(target, speculator, method, prompts, check_row_stats=False, max_new_tokens=16,
                          repetition_penalty=1.3, min_new_tokens=3 + 4 * i)


def test_scores_and_logits_match_plain_batched_generate():
    target = hf_specdiff.enable(make_successor_target(eos_token_id=17))
    speculator = make_speculator(target, oracle=True)
    prompts = [torch.tensor(p) for p in ([3, 4, 5, 6], [12, 13], [40, 41, 42])]
    ids, mask = left_pad(prompts)
    kwargs = dict(do_sample=False, max_new_tokens=14, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, repetition_penalty=1.2)
    plain = target.generate(ids, attention_mask=mask, **kwargs)
    spec = speculate(target, speculator, "xpress", ids, mask, **kwargs)
    assert torch.equal(spec.sequences, plain.sequences)
    assert len(spec.scores) == len(plain.scores) and len(spec.logits) == len(plain.logits)
    generated = plain.sequences[:, ids.shape[1] :]
    finished_after = [int((r == 17).nonzero()[0, 0]) if (r == 17).any() else len(r) for r in generated]
    for i, (ours, theirs, ours_raw, theirs_raw) in enumerate(zip(spec.scores, plain.scores, spec.logits, plain.logits)):
        for row, end in enumerate(finished_after):
            if i <= end:  # the row is still running: the target's own scores
                torch.testing.assert_close(ours[row], theirs[row], rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(ours_raw[row], theirs_raw[row], rtol=1e-6, atol=1e-6)
            else:  # a finished row: certain of its padding
                assert ours[row].argmax() == PAD and ours[row].softmax(-1)[PAD] == 1


def test_compaction_keeps_every_row_exact(monkeypatch):
    """Force compaction whenever a slot can be saved: outputs stay exact, and the caches stay short."""
    monkeypatch.setattr(hf_specdiff.batching, "COMPACT_WHEN_WASTED", 0.0)

    def as_short_as_the_longest_row(rows, caches):
        assert all(c.get_seq_length() == max(rows.valid) for c in caches)

    compactions = count_compactions(monkeypatch, check=as_short_as_the_longest_row)
    target = hf_specdiff.enable(make_successor_target(eos_token_id=17))
    speculator = make_speculator(target, oracle=True)
    for prompts in ragged_batches(count=2, size=5, seed=3):
        assert_rows_exact(target, speculator, "xpress", prompts, max_new_tokens=24)
    assert sum(done for done, _ in compactions) >= 3


def test_gather_cache_slots_per_row():
    from transformers import DynamicCache

    cache = DynamicCache()
    keys = torch.arange(2 * 3 * 5 * 4, dtype=torch.float64).view(2, 3, 5, 4)
    cache.update(keys, -keys, 0)
    index = torch.tensor([[4, 0], [1, 2]])
    _compat.gather_cache_slots(cache, index)
    layer = cache.layers[0]
    assert torch.equal(layer.keys[0], keys[0][:, [4, 0]]) and torch.equal(layer.keys[1], keys[1][:, [1, 2]])
    assert torch.equal(layer.values, -layer.keys) and cache.get_seq_length() == 2


def test_batch_of_one_is_unchanged():
    """A single unpadded row: no attention mask, an exactly cropped cache (returned), the statistics as before."""
    target = hf_specdiff.enable(make_successor_target())
    speculator = make_speculator(target, oracle=True)
    masks = []
    target.register_forward_pre_hook(lambda m, a, kw: masks.append(kw.get("attention_mask")), with_kwargs=True)
    prompt = torch.tensor([[3, 4, 5, 6, 7]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=30)
    masks.clear()
    out = speculate(target, speculator, "xpress", prompt, None, do_sample=False, max_new_tokens=30)
    assert torch.equal(out.sequences, plain)
    stats = out.speculation
    assert len(masks) == stats.target_forwards and set(masks) == {None}
    assert stats.target_forwards == len(stats.accepted_lengths) + 1
    assert stats.row_accepted_lengths == [stats.accepted_lengths] and stats.row_tau == [stats.tau]
    assert {"accepted_lengths", "drafted_lengths", "target_forwards", "draft_seconds", "tau"} <= set(stats.to_dict())
    assert _compat.generate_output_cache_field() and getattr(out, _compat.generate_output_cache_field()) is not None
    # the same prompt left-padded in a batch of one: same tokens after the padding
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(prompt)], dim=1)
    again = speculate(target, speculator, "xpress", padded, mask, do_sample=False, max_new_tokens=30)
    assert torch.equal(again.sequences[:, 3:], out.sequences)
    # more padding than prompt (a short row taken out of a batch), dynamic and static: plain generate's tokens, and
    # a cache that holds every slot but the last, padding included, as plain generate's does
    padded = torch.cat([torch.zeros(1, 9, dtype=torch.long), prompt[:, :2]], dim=1)
    mask = (padded != 0).long()
    plain = target.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=30)
    for cache_implementation in (None, "static"):
        again = speculate(target, speculator, "xpress", padded, mask, do_sample=False, max_new_tokens=30,
                          cache_implementation=cache_implementation)
        assert torch.equal(again.sequences, plain), cache_implementation
        cache = getattr(again, _compat.generate_output_cache_field())
        assert int(cache.get_seq_length()) == plain.shape[1] - 1, cache_implementation


# -- sampling ------------------------------------------------------------------------------------------------------

SAMPLING_VOCAB, NEW_TOKENS, DRAWS = 6, 4, 3000
SAMPLING_PROMPTS = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]  # different lengths: the second is left-padded


def batched_p_values(target, speculator, **options):
    ids, mask = left_pad(SAMPLING_PROMPTS)
    counts = [{} for _ in SAMPLING_PROMPTS]
    accepted = drafted = 0
    torch.manual_seed(0)
    for _ in range(DRAWS):
        out = speculate(target, speculator, "xpress", ids, mask, do_sample=True, max_new_tokens=NEW_TOKENS, **options)
        for row, row_counts in enumerate(counts):
            outcome = tuple(out.sequences[row, ids.shape[1] :].tolist())
            row_counts[outcome] = row_counts.get(outcome, 0) + 1
        accepted += out.speculation.accepted_tokens
        drafted += out.speculation.drafted_tokens
    p_values = [
        chi_square_p_value(c, exact_distribution(target, p[None], NEW_TOKENS), DRAWS)
        for c, p in zip(counts, SAMPLING_PROMPTS)
    ]
    return p_values, accepted / max(drafted, 1)


@pytest.fixture(scope="module")
def sampling_setup():
    return make_sampling_pair(SAMPLING_VOCAB)


@pytest.mark.slow
@pytest.mark.parametrize("cache", [None, "static"])  # static: a finished row stays in the batch, emitting nothing
def test_batched_sampling_matches_target_distribution_per_row(sampling_setup, cache):
    p_values, acceptance = batched_p_values(*sampling_setup, cache_implementation=cache)
    assert 0.2 < acceptance < 0.95, f"the test should exercise both acceptance and rejection, got {acceptance:.2f}"
    assert min(p_values) > 1e-3, f"a row's speculative samples do not follow the target (p={p_values})"


@pytest.mark.slow
@pytest.mark.parametrize("cache", [None, "static"])
def test_batched_negative_control_broken_verifier_is_caught(sampling_setup, monkeypatch, cache):
    monkeypatch.setattr(hf_specdiff.generation, "verify_sampling", accept_every_draft)
    p_values, _ = batched_p_values(*sampling_setup, cache_implementation=cache)
    assert max(p_values) < 1e-6, f"a verifier that accepts every draft must be detected in every row, got p={p_values}"


@pytest.mark.slow
def test_num_return_sequences_draws_independent_samples_from_the_target(sampling_setup):
    """num_return_sequences=3 on a ragged batch of two prompts: generate expands each prompt into 3 rows. Every
    sample follows the target (chi-square against the exact distribution), and the copies of one prompt are
    independent draws: copies 0 and 1 coincide as often as two independent samples do (sum of p(x)^2), not always
    as copies that shared their randomness would."""
    target, speculator = sampling_setup
    copies, draws = 3, 1000
    ids, mask = left_pad(SAMPLING_PROMPTS)
    counts = [{} for _ in SAMPLING_PROMPTS]
    collisions = [0 for _ in SAMPLING_PROMPTS]
    torch.manual_seed(0)
    for _ in range(draws):
        out = speculate(target, speculator, "xpress", ids, mask, do_sample=True, max_new_tokens=NEW_TOKENS,
                        num_return_sequences=copies)
        assert out.sequences.shape[0] == len(SAMPLING_PROMPTS) * copies and out.speculation.batch_size == 6
        samples = out.sequences[:, ids.shape[1] :].view(len(SAMPLING_PROMPTS), copies, NEW_TOKENS).tolist()
        for prompt, prompt_samples in enumerate(samples):  # generate orders rows prompt by prompt
            for sample in prompt_samples:
                counts[prompt][tuple(sample)] = counts[prompt].get(tuple(sample), 0) + 1
            collisions[prompt] += prompt_samples[0] == prompt_samples[1]
    for prompt, row_counts, row_collisions in zip(SAMPLING_PROMPTS, counts, collisions):
        expected = exact_distribution(target, prompt[None], NEW_TOKENS)
        p_value = chi_square_p_value(row_counts, expected, draws * copies)
        assert p_value > 1e-3, f"prompt {prompt.tolist()}: samples do not follow the target (p={p_value:.2e})"
        collision_rate = sum(p * p for p in expected.values())
        spread = (draws * collision_rate * (1 - collision_rate)) ** 0.5
        assert abs(row_collisions - draws * collision_rate) < 5 * spread + 3, (
            f"prompt {prompt.tolist()}: copies coincided {row_collisions} times in {draws}, independent draws would "
            f"about {draws * collision_rate:.0f} times"
        )


# -- errors ----------------------------------------------------------------------------------------------------------


@pytest.fixture
def small():
    target = hf_specdiff.enable(make_target())
    return target, make_speculator(target)


def test_right_padding_is_refused(small):
    target, speculator = small
    ids = torch.tensor([[4, 9, 1, 33], [5, 6, 0, 0]])
    with pytest.raises(ValueError, match="LEFT-padded.*padding_side = 'left'"):
        speculate(target, speculator, "dflash", ids, torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="all padding"):
        speculate(target, speculator, "dflash", ids, torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]]), max_new_tokens=4)


def test_an_attention_mask_of_another_shape_is_refused(small):
    """A mask for another batch or prompt width than input_ids (one of them sliced, the other not) failed inside the
    first forward, with a size error from the rotary embedding or an IndexError from the model's masking, or was called
    right padding (a wider one)."""
    target, speculator = small
    ids, mask = left_pad([torch.tensor([4, 9, 1]), torch.tensor([5, 6]), torch.tensor([7])])
    wider = torch.cat([mask, torch.zeros(3, 1, dtype=mask.dtype)], dim=1)
    for wrong in (mask[:, 1:], mask[:2], wider):  # only their shapes are wrong
        with pytest.raises(ValueError, match=rf"attention_mask of shape \({wrong.shape[0]}, {wrong.shape[1]}\) for "
                                             r"input_ids of shape \(3, 3\).*Pass the attention_mask the tokenizer"):
            speculate(target, speculator, "xpress", ids, wrong, max_new_tokens=4)


def test_the_batch_bench_checks_its_options_when_called_directly(tmp_path, monkeypatch):
    """`bench_batched.run_batch_bench` is the batch curve's Python API: called without `run_bench` it loaded the models
    and ran with options `hf-specdiff bench` refuses (a size given twice merged two runs into one curve point, an
    unused --jacobi-passes was ignored, max_new_tokens=0 failed in generate), and named an unknown method as one that
    decodes a sequence at a time."""
    from hf_specdiff.bench import BenchConfig
    from hf_specdiff.bench_batched import run_batch_bench

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "What is {n} times 7?"}}\n' for n in range(4)))
    monkeypatch.setattr("hf_specdiff.bench_batched.load_models", lambda *_, **__: pytest.fail("the models loaded"))
    refused = {r"Unknown methods \['bogus'\]": dict(methods=["ar", "bogus"]),
               "--max-new-tokens must be >= 1": dict(max_new_tokens=0),
               r"--batch-size lists \[2\] more than once": dict(batch_size=[2, 2]),
               r"--jacobi-passes \[2\] \(xpress, xpress_static\): no method": dict(jacobi_passes=[2]),
               "--temperature must be >= 0": dict(temperature=-1.0)}
    for message, options in refused.items():
        config = BenchConfig(**{"prompts": str(prompts), "limit": 0, "methods": ["ar", "dflash"], "batch_size": [2],
                                **options})
        with pytest.raises(ValueError, match=message):
            run_batch_bench(config, progress=False)


def test_a_batch_curve_of_plain_generate_alone_plots_tokens_per_second_and_says_why_no_speedup(tmp_path):
    """`--methods ar --batch-size ... --plots DIR` drew an empty speedup panel, with matplotlib's "No artists with
    labels found" as its only warning; the batch-1 plots leave such a plot out and say why."""
    pytest.importorskip("matplotlib")
    from test_bench import _made_up_curve

    from hf_specdiff.bench_batched import plot_batch_curve

    with pytest.warns(UserWarning) as caught:
        paths = plot_batch_curve(_made_up_curve(["ar"], prompts=2, temperature=0.0), tmp_path / "ar")
    messages = [str(warning.message) for warning in caught]
    assert any("batch_curve.png shows tokens/s only, no speedup: only ar ran" in m for m in messages), messages
    assert not any("No artists" in m for m in messages), messages
    assert [path.name for path in paths] == ["batch_curve.png"] and paths[0].stat().st_size > 0
    with warnings.catch_warnings():  # beside another method both panels are drawn, without a warning
        warnings.simplefilter("error")
        plot_batch_curve(_made_up_curve(["ar", "dflash"], prompts=2, temperature=0.0), tmp_path / "both")


def test_a_target_rotating_keys_by_cache_slot_is_refused_in_batches():
    """RoFormer takes its rotary positions from the cache length, not from position ids: a batch's holes would shift
    them (rows left plain batched generate's output before this refusal)."""
    from transformers import RoFormerConfig, RoFormerForCausalLM

    torch.manual_seed(0)
    config = RoFormerConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, is_decoder=True, pad_token_id=0)
    target = hf_specdiff.enable(RoFormerForCausalLM(config).eval())
    speculator = make_speculator(target)
    ids, mask = left_pad([torch.tensor([4, 9, 1]), torch.tensor([5, 6])])
    with pytest.raises(ValueError, match="rotates each key by its cache slot.*Generate row by row"):
        speculate(target, speculator, "xpress", ids, mask, max_new_tokens=4)
    alone = speculate(target, speculator, "xpress", ids[:1], None, max_new_tokens=6, do_sample=False)  # batch 1: fine
    assert torch.equal(alone.sequences, target.generate(ids[:1], max_new_tokens=6, do_sample=False))


def test_what_batches_cannot_do_is_refused(small, monkeypatch):
    target, speculator = small
    ids, mask = left_pad([torch.tensor([4, 9, 1]), torch.tensor([5, 6])])
    with pytest.raises(ValueError, match="streams a single sequence"):
        speculate(target, speculator, "xpress", ids, mask, max_new_tokens=4, streamer=BaseStreamer())
    with pytest.raises(ValueError, match="prefix_allowed_tokens_fn"):
        speculate(target, speculator, "xpress", ids, mask, max_new_tokens=4,
                  prefix_allowed_tokens_fn=lambda batch_id, sequence: list(range(VOCAB)))
    # layer types as a HY v4 declares them (attention over indexed keys), then a sliding-window model under flash
    # attention
    layer_types = {"indexed_attention", "full_attention"}
    monkeypatch.setattr(hf_specdiff.generation, "_attention_types", lambda config: layer_types)
    with pytest.raises(ValueError, match=r"recurrent or conv state; this model also has \['indexed_"):
        speculate(target, speculator, "xpress", ids, mask, max_new_tokens=4)
    layer_types = {"sliding_attention", "conv", "full_attention"}  # windows and states in one model (LFM3)
    target.config._attn_implementation = "flash_attention_2"  # checked before any forward
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        speculate(target, speculator, "xpress", ids, mask, max_new_tokens=4)


@pytest.mark.parametrize("cache", [None, "static"])
def test_a_chunked_prefill_drafts_from_the_whole_prompt(cache, record_drafts, monkeypatch):
    """`prefill_chunk_size=c` (a long prompt's activations held a chunk at a time): plain chunked generate's tokens,
    in a ragged batch and row by row; no target forward wider than a chunk or a block; and the drafter reads the
    whole prompt, its context written into the drafter's cache chunk by chunk (the recorder asserts the same drafts
    and q after the same tokens as without chunks, which a context of the last chunk alone, or at other positions,
    would change), never holding the whole prompt's features."""
    target = hf_specdiff.enable(make_target())
    speculator = make_speculator(target)
    widths, feature_widths = [], []
    target.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                     with_kwargs=True)
    features = speculator.drafter.context_features

    def recorded_features(*args):
        built = features(*args)
        feature_widths.append(built.shape[1])
        return built

    monkeypatch.setattr(speculator.drafter, "context_features", recorded_features)
    prompts = next(ragged_batches(count=1, size=3, seed=4, max_length=30))
    settings = dict(do_sample=False, max_new_tokens=12, cache_implementation=cache)
    for batch in (prompts, *[[p] for p in prompts]):
        ids, mask = left_pad(batch)
        speculate(target, speculator, "xpress", ids, mask, **settings)  # unchunked: the recorder's reference
        for chunk in (1, 4, 7):
            plain = target.generate(ids, attention_mask=mask, prefill_chunk_size=chunk, **settings)
            widths.clear()
            feature_widths.clear()
            out = speculate(target, speculator, "xpress", ids, mask, prefill_chunk_size=chunk, **settings)
            assert torch.equal(out.sequences, plain)
            assert max(feature_widths) <= max(chunk, speculator.drafter.config.block_size)
            chunks = -(-ids.shape[1] // chunk)
            assert widths[:chunks] == [min(chunk, ids.shape[1] - start) for start in range(0, ids.shape[1], chunk)]
            assert max(widths[chunks:]) <= speculator.drafter.config.block_size
            assert out.speculation.target_forwards == len(widths) - chunks + 1  # the prefill counts once
    assert len(record_drafts) > 10
    # the drafter's passes over the prompt's chunks and its first block count as its prefill, as one pass over both
    # does without chunks (`bench` divides the draft time by the blocks after the first)
    one_block = speculate(target, speculator, "xpress", ids, mask, prefill_chunk_size=4, **{**settings,
                                                                                         "max_new_tokens": 3})
    stats = one_block.speculation
    assert stats.blocks == 1 and stats.draft_seconds == 0 < stats.draft_prefill_seconds


@pytest.mark.parametrize("family", ["gemma3n", "mamba", "qwen3_5", "gemma3"])
def test_a_chunked_prefill_on_other_layer_kinds(family):
    """Chunks over a padded batch: Gemma 3n's stacked streams (hidden states (streams, b, n, H)), a model of state
    layers alone (Mamba: its mask covers the chunk's tokens, not the cache), a hybrid, sliding windows. Plain
    generate's batched tokens, without chunks (plain chunked generate fails on Mamba's batch), also when a row leaves
    the batch early."""
    from test_greedy import make_family_target

    if family in STATE_FAMILIES and family not in CONV_STATE_FAMILIES and not _compat.recurrent_rollback_supported():
        pytest.skip("a recurrent state rolls back from transformers 5.25 on (refusal: test_greedy.py)")
    target = make_family_target(family)
    speculator = make_speculator(target)
    ids, mask = left_pad(next(ragged_batches(count=1, size=3, seed=5, max_length=14)))
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10)
    out = speculate(target, speculator, "xpress", ids, mask, do_sample=False, max_new_tokens=10, prefill_chunk_size=3)
    assert torch.equal(out.sequences, plain)
    # the first row ends early at an EOS (its third token) and leaves the batch: the others' hidden states stay theirs
    stop = dict(eos_token_id=int(plain[0, ids.shape[1] + 2]), pad_token_id=PAD, do_sample=False, max_new_tokens=10)
    plain = target.generate(ids, attention_mask=mask, **stop)
    assert (plain[1:, ids.shape[1] + 3 :] != PAD).any(), "another row should outlive the first"
    out = speculate(target, speculator, "xpress", ids, mask, prefill_chunk_size=3, **stop)
    assert torch.equal(out.sequences, plain)
