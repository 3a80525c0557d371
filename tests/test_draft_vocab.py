"""A draft vocabulary restricts what is drafted, never what is generated: the output stays the target's own (greedy:
the same tokens, eager, static, compiled and batched; sampled: the target's distribution), no draft ever falls
outside it, it survives save and load, and a wrong one is a clear error."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from conftest import (
    VOCAB,
    chi_square_p_value,
    exact_distribution,
    make_sampling_pair,
    make_speculator,
    make_successor_target,
    make_target,
    require_cpu_compiler,
)
from test_batched import assert_rows_exact, ragged_batches
from test_greedy import assert_same_as_plain, prompts

import hf_specdiff
from hf_specdiff import AutoSpeculator, BlockDiffusionCandidateGenerator, Speculator, _compat
from hf_specdiff.candidates import DraftPicker
from hf_specdiff.draft_vocab import DraftReadOut, full_width, token_ids_of, top_tokens

METHODS = ["xpress", "dflash", "markov"]
# Every third token left out: on a successor target (t -> t + 1) the accepted runs break at each of them.
EVERY_THIRD_LEFT_OUT = torch.tensor([t for t in range(VOCAB) if t % 3], dtype=torch.long)


def with_vocab(speculator: Speculator, vocab: torch.LongTensor) -> Speculator:
    return Speculator(speculator.drafter, speculator.refiner, speculator.markov_head, draft_vocab=vocab)


@pytest.fixture
def drafts_seen(monkeypatch):
    """Every token drafted (the candidates after each row's end) during the test."""
    seen = set()
    original = BlockDiffusionCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, rows=None, **kwargs):
        candidate_ids, q = original(self, input_ids, *args, rows=rows, **kwargs)
        if q is not None and isinstance(self.read_out, DraftReadOut):
            lengths = rows.lengths if rows is not None else [input_ids.shape[1]] * input_ids.shape[0]
            for row, length in enumerate(lengths):
                seen.update(candidate_ids[row, length : length + q.shape[1]].tolist())
                # q is -inf outside the vocabulary: no probability there, whatever processors ran
                outside = torch.ones(q.shape[-1], dtype=torch.bool)
                outside[self.read_out.token_ids] = False
                assert torch.isneginf(q[row][:, outside]).all()
        return candidate_ids, q

    monkeypatch.setattr(BlockDiffusionCandidateGenerator, "get_candidates", recording)
    return seen


def test_read_out_is_the_full_one_over_the_vocabularys_columns_and_widens_back():
    weight, x = torch.randn(VOCAB, 16, dtype=torch.float64), torch.randn(2, 3, 16, dtype=torch.float64)
    vocab = torch.tensor([5, 0, 63, 17])
    read_out = DraftReadOut(vocab, weight)
    out, full = read_out(x), x @ weight.T
    assert out.shape == (2, 3, len(vocab))
    torch.testing.assert_close(out, full[..., vocab], rtol=0, atol=1e-12)
    assert read_out.weight.shape == (len(vocab), 16) and torch.equal(read_out.weight, weight[vocab])
    assert torch.equal(token_ids_of(out.argmax(-1), vocab), vocab[out.argmax(-1)])
    widened = full_width(out, vocab, VOCAB)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[vocab] = False
    assert torch.equal(widened[..., vocab], out) and torch.isneginf(widened[..., outside]).all()
    assert full_width(full, None, VOCAB) is full and torch.equal(token_ids_of(vocab, None), vocab)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cache", [None, "static"])
def test_greedy_equals_plain_and_drafts_stay_in_the_vocabulary(method, cache, drafts_seen):
    """Oracle add-ons on a successor target: long runs with the whole vocabulary, broken at every left-out token
    with the draft vocabulary, the output the same throughout."""
    target = hf_specdiff.enable(make_successor_target())
    full = make_speculator(target, oracle=True)
    restricted = with_vocab(full, EVERY_THIRD_LEFT_OUT)
    taus = {"full": [], "restricted": []}
    for i, prompt in prompts(count=12, seed=2):
        budget = dict(max_new_tokens=8 + 6 * (i % 5), cache_implementation=cache)
        drafts_seen.clear()
        taus["restricted"].append(assert_same_as_plain(target, restricted, method, prompt, **budget).tau)
        assert drafts_seen and drafts_seen <= set(EVERY_THIRD_LEFT_OUT.tolist())
        taus["full"].append(assert_same_as_plain(target, full, method, prompt, **budget).tau)
    mean = {name: sum(t) / len(t) for name, t in taus.items()}
    if method != "dflash":  # the random drafter alone gets little accepted either way
        assert mean["restricted"] < mean["full"] - 0.5, mean


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("reads_ids", [True, False], ids=["processors-reading-ids", "position-free"])
def test_picking_over_the_columns_is_picking_over_the_widened_logits(do_sample, reads_ids):
    """The picker works over a draft vocabulary's columns; that must be what it does over the whole vocabulary with
    -inf outside: the same token ids and the same q there. Processors that read token ids (repetition penalty, minimum
    length) see the widened logits; position-free ones run on the columns. Sampling: the same noise on each token."""
    vocab = EVERY_THIRD_LEFT_OUT
    eos = int(vocab[3])
    processors = LogitsProcessorList(
        [RepetitionPenaltyLogitsProcessor(1.5), MinLengthLogitsProcessor(12, eos), TemperatureLogitsWarper(0.7)]
        if reads_ids else [TemperatureLogitsWarper(0.7), TopKLogitsWarper(6), TopPLogitsWarper(0.9)]
    )
    generator = torch.Generator().manual_seed(1)
    prefix = vocab[torch.randint(len(vocab), (2, 7), generator=generator)]  # repeated tokens: the penalty matters
    logits = 3 * torch.randn(2, 4, len(vocab), generator=generator)
    logits[..., 3] = logits.amax(-1) + 1  # EOS on top: the minimum length must move the pick
    columns, whole = DraftPicker(processors, do_sample, vocab, VOCAB), DraftPicker(processors, do_sample)
    columns.start_block(prefix, 4, len(vocab))
    whole.start_block(prefix, 4, VOCAB)
    if do_sample:  # the same noise on the same tokens
        whole.gumbel = full_width(columns.gumbel, vocab, VOCAB, fill=0.0)
    widened = full_width(logits, vocab, VOCAB)
    for assumed in (None, vocab[torch.randint(len(vocab), (2, 4), generator=generator)]):
        tokens, q = columns(logits, assumed)
        expected_tokens, expected_q = whole(widened, assumed)
        assert torch.equal(tokens, expected_tokens)
        torch.testing.assert_close(full_width(q, vocab, VOCAB), expected_q)
        assert set(tokens.flatten().tolist()) <= set(vocab.tolist())
        assert not reads_ids or eos not in tokens.flatten().tolist()
    token, q = columns.pick_slot(logits[:, 2], 2, vocab[:2].expand(2, -1))
    expected_token, expected_q = whole.pick_slot(widened[:, 2], 2, vocab[:2].expand(2, -1))
    assert torch.equal(token, expected_token)
    torch.testing.assert_close(full_width(q, vocab, VOCAB), expected_q)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_with_processors_that_read_token_ids_equals_plain(method, drafts_seen):
    target = hf_specdiff.enable(make_successor_target())
    speculator = with_vocab(make_speculator(target, oracle=True), EVERY_THIRD_LEFT_OUT)
    for i, prompt in prompts(count=6, seed=8):
        assert_same_as_plain(target, speculator, method, prompt, max_new_tokens=24, repetition_penalty=1.3,
                             min_new_tokens=4 + i)
    assert drafts_seen and drafts_seen <= set(EVERY_THIRD_LEFT_OUT.tolist())


@pytest.mark.parametrize("method", ["xpress", "markov"])
def test_the_add_ons_read_out_only_the_vocabularys_rows(method, drafts_seen):
    """The rows of the add-on's read-out outside the vocabulary are never multiplied (that is the saving): made NaN,
    they change nothing."""
    target = hf_specdiff.enable(make_successor_target())
    speculator = with_vocab(make_speculator(target, oracle=True), EVERY_THIRD_LEFT_OUT)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[EVERY_THIRD_LEFT_OUT] = False
    for add_on in (speculator.refiner, speculator.markov_head):
        with torch.no_grad():
            add_on.w2.weight[outside] = float("nan")
    for i, prompt in prompts(count=6, seed=3):
        assert_same_as_plain(target, speculator, method, prompt, max_new_tokens=10 + 5 * i)
    assert drafts_seen <= set(EVERY_THIRD_LEFT_OUT.tolist())


def test_a_whole_vocabulary_drafts_exactly_what_none_does():
    target = hf_specdiff.enable(make_successor_target())
    full = make_speculator(target, oracle=True)
    everything = with_vocab(full, torch.arange(VOCAB - 1, -1, -1))  # in another order: the ids matter, not the order
    for _, prompt in prompts(count=6, seed=4):
        a = assert_same_as_plain(target, full, "xpress", prompt, max_new_tokens=30)
        b = assert_same_as_plain(target, everything, "xpress", prompt, max_new_tokens=30)
        assert a.accepted_lengths == b.accepted_lengths and a.refine_passes == b.refine_passes


def test_int32_ids_draft_as_int64_ones_do():
    target = hf_specdiff.enable(make_successor_target())
    full = make_speculator(target, oracle=True)
    for _, prompt in prompts(count=3, seed=6):
        a = assert_same_as_plain(target, with_vocab(full, EVERY_THIRD_LEFT_OUT), "xpress", prompt, max_new_tokens=20)
        b = assert_same_as_plain(target, with_vocab(full, EVERY_THIRD_LEFT_OUT.int()), "xpress", prompt,
                                 max_new_tokens=20)
        assert a.accepted_lengths == b.accepted_lengths


@pytest.mark.parametrize("method", METHODS)
def test_batched_rows_equal_row_by_row(method, drafts_seen):
    target = hf_specdiff.enable(make_successor_target())
    speculator = with_vocab(make_speculator(target, oracle=True), EVERY_THIRD_LEFT_OUT)
    for i, batch in enumerate(ragged_batches(3, 4, seed=7)):
        assert_rows_exact(target, speculator, method, batch, max_new_tokens=10 + 6 * i)
    assert drafts_seen <= set(EVERY_THIRD_LEFT_OUT.tolist())


@pytest.mark.slow
def test_compiled_static_decoding_is_lossless():
    require_cpu_compiler()
    target = hf_specdiff.enable(make_successor_target(dtype=torch.float32))
    speculator = with_vocab(make_speculator(target, oracle=True).float(), EVERY_THIRD_LEFT_OUT)
    compile_kwargs = dict(cache_implementation="static", max_cache_len=96,
                          compile_config=_compat.compile_config_for_all_devices())
    for i, (_, prompt) in enumerate(prompts(count=2, seed=5)):
        eager = assert_same_as_plain(target, speculator, "xpress", prompt, max_new_tokens=40,
                                     cache_implementation="static")
        # each call reads out through read-outs of its own: the second must not recompile for them
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            compiled = assert_same_as_plain(target, speculator, "xpress", prompt, max_new_tokens=40, **compile_kwargs)
        assert compiled.accepted_lengths == eager.accepted_lengths


@pytest.mark.slow
def test_sampling_follows_the_target_and_never_drafts_outside(drafts_seen):
    """Drafts from 4 of the 6 tokens: q is zero on the other two, and verification still gives the target's
    distribution (the sampling tests' negative control shows the chi-square test catches a lossy verifier)."""
    target, speculator = make_sampling_pair(6)
    vocab = torch.tensor([1, 2, 4, 5])
    speculator = with_vocab(speculator, vocab)
    prompt, new_tokens, draws = torch.tensor([[1, 2, 3]]), 4, 3000
    torch.manual_seed(0)
    counts, accepted, drafted = {}, 0, 0
    for _ in range(draws):
        out = target.generate(prompt, do_sample=True, max_new_tokens=new_tokens, assistant_model=speculator,
                              speculation="xpress", return_dict_in_generate=True)
        outcome = tuple(out.sequences[0, prompt.shape[1]:].tolist())
        counts[outcome] = counts.get(outcome, 0) + 1
        accepted += out.speculation.accepted_tokens
        drafted += out.speculation.drafted_tokens
    assert drafts_seen <= set(vocab.tolist())
    assert any({0, 3} & set(outcome) for outcome in counts), "tokens outside the vocabulary must still be generated"
    assert 0.2 < accepted / drafted < 0.95, accepted / drafted
    p_value = chi_square_p_value(counts, exact_distribution(target, prompt, new_tokens), draws)
    assert p_value > 1e-3, f"samples with a draft vocabulary do not follow the target (p={p_value:.2e})"


def test_save_and_load_round_trip(tmp_path):
    target = hf_specdiff.enable(make_successor_target())
    speculator = with_vocab(make_speculator(target, oracle=True), EVERY_THIRD_LEFT_OUT)
    speculator.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "speculator.json").read_text())["draft_vocab"] == "draft_vocab.safetensors"
    loaded = AutoSpeculator.from_pretrained(tmp_path, dtype=torch.float64)
    assert torch.equal(loaded.draft_vocab, EVERY_THIRD_LEFT_OUT)
    prompt = torch.tensor([[4, 9, 1, 33, 7]])
    for method in METHODS:
        kwargs = dict(do_sample=False, max_new_tokens=20, speculation=method, return_dict_in_generate=True)
        a = target.generate(prompt, assistant_model=speculator, **kwargs)
        b = target.generate(prompt, assistant_model=loaded, **kwargs)
        assert torch.equal(a.sequences, b.sequences)
        assert a.speculation.accepted_lengths == b.speculation.accepted_lengths
    # without one, nothing is written and nothing is read
    speculator.draft_vocab = None
    speculator.save_pretrained(tmp_path / "none")
    assert not (tmp_path / "none" / "draft_vocab.safetensors").exists()
    assert "draft_vocab" not in json.loads((tmp_path / "none" / "speculator.json").read_text())
    assert AutoSpeculator.from_pretrained(tmp_path / "none").draft_vocab is None


def test_top_tokens_ranks_by_count_then_id_and_puts_the_given_ones_first():
    answers = [[7, 7, 7, 3, 3, 9], [3, 5, 5, 9, 2]]  # counts: 3 -> 3, 7 -> 3, 5 -> 2, 9 -> 2, 2 -> 1
    with pytest.warns(UserWarning, match="hold 5 distinct tokens .*, fewer than the 10 asked for"):  # (was silent)
        assert top_tokens(answers, 10).tolist() == [3, 7, 5, 9, 2]
    assert top_tokens(answers, 3).tolist() == [3, 7, 5]
    assert top_tokens(answers, 3, always=[11, 9]).tolist() == [11, 9, 3]
    assert top_tokens(answers, 2, always=11).tolist() == [11, 3]  # a generation config's single eos_token_id
    assert top_tokens(answers, 2, always=None).tolist() == [3, 7]
    with pytest.raises(ValueError, match="at least one token"):
        top_tokens(answers, 0)
    with pytest.raises(ValueError, match="no tokens|there are none"):
        top_tokens([[], []], 4)


@pytest.mark.parametrize("vocab,message", [
    (torch.tensor([1, 2, VOCAB]), f"from 1 to {VOCAB}, outside the drafter's vocabulary of {VOCAB} tokens"),
    (torch.tensor([-1, 2]), "outside the drafter.s vocabulary .*its config.s vocab_size.*restore the drafter.s config"),
    (torch.tensor([4, 2, 4]), "more than once"),
    (torch.tensor([], dtype=torch.long), "non-empty 1-D"),
    (torch.tensor([[1, 2]]), "non-empty 1-D"),
    (torch.tensor([1.0, 2.0]), "int64 token ids"),
])
def test_a_wrong_vocabulary_is_a_clear_error(vocab, message):
    speculator = make_speculator(make_target())
    with pytest.raises(ValueError, match=message):
        with_vocab(speculator, vocab)
    # set after building: refused when generate checks the speculator
    target = hf_specdiff.enable(make_target())
    speculator.draft_vocab = vocab
    with pytest.raises(ValueError, match=message):
        target.generate(torch.tensor([[3, 4]]), max_new_tokens=4, assistant_model=speculator, speculation="dflash")


def test_a_corrupt_or_missing_vocabulary_file_is_a_clear_error(tmp_path):
    target = make_target()
    with_vocab(make_speculator(target), torch.tensor([3, 1, 2])).save_pretrained(tmp_path)
    vocab_file = tmp_path / "draft_vocab.safetensors"
    vocab_file.write_bytes(vocab_file.read_bytes()[:20])
    with pytest.raises(ValueError, match="Could not read the draft vocabulary .* corrupt; download or save"):
        AutoSpeculator.from_pretrained(tmp_path)
    vocab_file.unlink()
    with pytest.raises(OSError, match="lists a draft vocabulary, but draft_vocab.safetensors is missing"):
        AutoSpeculator.from_pretrained(tmp_path)
    from safetensors.torch import save_file

    save_file({"ids": torch.tensor([1, 2])}, vocab_file)
    with pytest.raises(ValueError, match="has no `token_ids` tensor"):
        AutoSpeculator.from_pretrained(tmp_path)
    save_file({"token_ids": torch.tensor([1, 2, 500])}, vocab_file)
    with pytest.raises(ValueError, match="outside the drafter.s vocabulary .* another tokenizer"):
        AutoSpeculator.from_pretrained(tmp_path)
    manifest = json.loads((tmp_path / "speculator.json").read_text())
    (tmp_path / "speculator.json").write_text(json.dumps({**manifest, "draft_vocab": 3}))
    with pytest.raises(ValueError, match="not a file name"):
        AutoSpeculator.from_pretrained(tmp_path)


def test_the_vocabulary_moves_with_the_speculator_and_must_be_on_the_targets_device():
    target = hf_specdiff.enable(make_target())
    speculator = with_vocab(make_speculator(target), torch.tensor([3, 1, 2]))
    assert speculator.to(torch.float32).draft_vocab.dtype == torch.long  # a cast leaves the ids alone
    speculator.to(torch.float64)
    speculator.draft_vocab = torch.tensor([3, 1, 2], device="meta")
    with pytest.raises(ValueError, match="draft vocabulary is on meta .* speculator.to"):
        target.generate(torch.tensor([[3, 4]]), max_new_tokens=4, assistant_model=speculator, speculation="dflash")


def test_cli_writes_a_vocabulary_into_a_saved_speculator(tmp_path, capsys):
    from hf_specdiff.cli import main

    target = make_target(eos_token_id=2)
    target.save_pretrained(tmp_path / "target")
    make_speculator(target).save_pretrained(tmp_path / "speculator")
    data = tmp_path / "answers.jsonl"
    answers = ([9, 9, 4, 2], [4, 9, 7, 2], [30])
    data.write_text("".join(json.dumps({"response_ids": answer}) + "\n" for answer in answers))
    main(["draft-vocab", str(tmp_path / "speculator"), "--data", str(data), "--size", "3",
          "--target", str(tmp_path / "target")])
    assert "3 tokens" in capsys.readouterr().out
    loaded = AutoSpeculator.from_pretrained(tmp_path / "speculator")
    assert loaded.draft_vocab.tolist() == [2, 9, 4]  # EOS first, then by count
    assert loaded.refiner is not None and loaded.markov_head is not None  # the add-ons are still listed
    for row in ('{"response_ids": [1, "x"]}', '{"response_ids": [1, 2.7]}', '{"response_ids": [true]}'):  # no ids
        data.write_text(row + "\n")
        with pytest.raises(ValueError, match="answers.jsonl:1 is not a distill row with integer"):
            main(["draft-vocab", str(tmp_path / "speculator"), "--data", str(data), "--size", "3",
                  "--target", str(tmp_path / "target")])
    with pytest.raises(ValueError, match="holds no saved speculator"):
        main(["draft-vocab", str(tmp_path / "target"), "--data", str(data), "--size", "3",
              "--target", str(tmp_path / "target")])
    # a run's folder, a target folder without a model (before: the Hub was asked for it) and a card left stale: said
    (tmp_path / "run" / "speculator").mkdir(parents=True)
    with pytest.raises(SystemExit, match="run is a training run's folder: give its speculator"):
        main(["draft-vocab", str(tmp_path / "run"), "--data", str(data), "--size", "3"])
    data.write_text("".join(json.dumps({"response_ids": answer}) + "\n" for answer in answers))
    # without --target, a speculator of another target than the embedded one (before: given the embedded target's
    # EOS ids, which this target never writes, so its EOS could never be drafted)
    with pytest.raises(SystemExit, match=r"for another target than the embedded .*\(vocab_size 64 vs 49152.*--target"):
        main(["draft-vocab", str(tmp_path / "speculator"), "--data", str(data), "--size", "3"])
    with pytest.raises(OSError, match="No target .*config.json.*Point --target at the target's folder"):
        main(["draft-vocab", str(tmp_path / "speculator"), "--data", str(data), "--size", "3",
              "--target", str(tmp_path / "run")])
    (tmp_path / "speculator" / "README.md").write_text("An 8,192-token draft vocabulary ...")
    capsys.readouterr()
    main(["draft-vocab", str(tmp_path / "speculator"), "--data", str(data), "--size", "3",
          "--target", str(tmp_path / "target")])
    assert "README.md (the model card) still describes the draft vocabulary" in capsys.readouterr().err
    # the command's warnings read as its errors do (before: "hf_specdiff/cli.py:639: UserWarning: ...")
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "hf_specdiff", "draft-vocab", str(tmp_path / "speculator"), "--data",
                          str(data), "--size", "50", "--target", str(tmp_path / "target")], capture_output=True,
                         text=True, check=True)
    warned = [line for line in run.stderr.splitlines() if "UserWarning" in line]
    assert warned and all(line.startswith("hf-specdiff: UserWarning: ") for line in warned), run.stderr
