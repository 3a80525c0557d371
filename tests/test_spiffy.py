"""Diffusion decoding and Spiffy on tiny float64 models: lossless in exact modes, draft logits equal separate
forwards, batched equals row by row, reference behaviour, graph artifacts and error paths."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from conftest import make_target
from transformers import GenerationConfig

import hf_specdiff
from hf_specdiff.diffusion.adapter import DiffusionAdapter
from hf_specdiff.diffusion.decoding import (
    Canvas,
    DiffusionGenerationConfig,
    Unmasker,
    diffusion_generate,
    transfer_schedule,
)
from hf_specdiff.diffusion.modeling import DiffusionLM, DiffusionLMConfig
from hf_specdiff.spiffy import DraftGraph, TrajectoryRecorder, calibrate, propose_drafts

MASK = 63


def tiny_dlm(shift_logits=False, block_causal=False, seed=0):
    """A random bidirectional (or block-causal) model with peaked predictions, so that steps are predictable."""
    model = make_target(vocab_size=64, hidden_size=64, num_layers=2, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    return DiffusionAdapter(model, mask_token_id=MASK, shift_logits=shift_logits, block_causal=block_causal)


def prompts(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MASK, (1, 4 + i % 5), generator=g) for i in range(n)]


def config(**overrides):
    return DiffusionGenerationConfig(**{"max_new_tokens": 16, "block_length": 8, "stop_at_eos": False, **overrides})


# (model kind, cache) pairs in which a draft sees nothing that depends on the real block
EXACT_MODES = [("bidirectional", "dual"), ("shifted", "dual"), ("block_causal", "none"), ("block_causal", "prefix"),
               ("block_causal", "block")]
KINDS = {"bidirectional": {}, "shifted": {"shift_logits": True}, "block_causal": {"block_causal": True}}


# every exact mode with greedy, sampled and threshold decoding; every remasking rule in two of them
CASES = [(kind, cache, "low_confidence", t, thr) for kind, cache in EXACT_MODES for t, thr in
         [(0.0, None), (0.8, None), (0.0, 0.2)]]
CASES += [(kind, cache, rule, t, None) for kind, cache in [("shifted", "dual"), ("block_causal", "block")]
          for rule in ["margin", "entropy", "random"] for t in (0.0, 0.8)]


@pytest.mark.parametrize("kind,cache,remasking,temperature,threshold", CASES)
def test_spiffy_output_equals_ordinary_decoding_in_exact_modes(kind, cache, remasking, temperature, threshold):
    model = tiny_dlm(**KINDS[kind])
    cfg = config(cache=cache, remasking=remasking, temperature=temperature, threshold=threshold)
    graph = calibrate(model, prompts(3, seed=7), cfg, num_nodes=16, progress=False)
    accepted = saved = 0
    for prompt in prompts(6):
        plain = diffusion_generate(model, prompt, config=cfg)
        spiffy = diffusion_generate(model, prompt, config=cfg, draft_graph=graph)
        assert spiffy.exact
        assert torch.equal(plain.sequences, spiffy.sequences)
        accepted += sum(sum(a) for a in spiffy.accepted_drafts)
        saved += plain.nfe - spiffy.nfe
        assert spiffy.nfe == plain.nfe - sum(sum(a) for a in spiffy.accepted_drafts)  # one forward saved per draft
    assert accepted > 0, "no draft was ever accepted: the equality above would prove nothing"


def _draft_and_separate_logits(model, cache):
    cfg = config(cache=cache)  # two blocks: the first has a masked suffix
    prompt = prompts(1)[0]
    canvas = Canvas(model, prompt, None, cfg)
    start, end = canvas.block_range(0)
    canvas.step_forward(0, first_step=True)  # builds the context of the cache mode
    canvas.x[:, start : start + 3] = torch.tensor([5, 9, 11])  # a mid-block state
    drafts = canvas.x[:, start:end].clone()[:, None].repeat(1, 3, 1)
    drafts[0, 0, 3], drafts[0, 1, 3:5], drafts[0, 2, 7] = 17, torch.tensor([2, 40]), 33
    _, draft_logits = canvas.step_forward(0, first_step=False, drafts=drafts)
    deviations = []
    for d in range(3):
        separate = Canvas(model, prompt, None, cfg)
        separate.step_forward(0, first_step=True)
        separate.x[:, start:end] = drafts[:, d]
        logits, _ = separate.step_forward(0, first_step=False)
        deviations.append(float((logits - draft_logits[:, d]).abs().max()))
    return deviations


@pytest.mark.parametrize("kind,cache", EXACT_MODES)
def test_verification_mask_draft_logits_equal_a_separate_forward(kind, cache):
    with torch.no_grad():
        assert max(_draft_and_separate_logits(tiny_dlm(**KINDS[kind]), cache)) < 1e-12


def test_prefix_cache_on_a_bidirectional_model_is_only_near_lossless():
    """Documented behaviour: with a prefix-only cache the recomputed suffix attends to the real block, so drafts see
    K/V that depends on it; their logits deviate (measured here), and outputs are flagged exact=False."""
    model = tiny_dlm()
    with torch.no_grad():
        deviation = max(_draft_and_separate_logits(model, "prefix"))
    assert 1e-9 < deviation < 1.0, deviation
    out = diffusion_generate(model, prompts(1)[0], config=config(cache="prefix"))
    assert not out.exact


@pytest.mark.parametrize("draft", [False, True])
def test_batched_left_padded_decoding_equals_row_by_row(draft):
    model = tiny_dlm(shift_logits=True)
    cfg = config(cache="dual", threshold=0.3)
    graph = calibrate(model, prompts(3, seed=7), cfg, num_nodes=16, progress=False) if draft else None
    rows = prompts(5)
    width = max(p.shape[1] for p in rows)
    ids = torch.stack([torch.cat([torch.zeros(width - p.shape[1], dtype=torch.long), p[0]]) for p in rows])
    mask = torch.stack([torch.arange(width) >= width - p.shape[1] for p in rows]).long()
    batched = diffusion_generate(model, ids, mask, config=cfg, draft_graph=graph)
    for i, p in enumerate(rows):
        alone = diffusion_generate(model, p, config=cfg, draft_graph=graph)
        assert torch.equal(batched.sequences[i, width:], alone.sequences[0, p.shape[1] :])


def test_ordinary_decoding_matches_the_llada_reference_loop():
    """LLaDA's reference `generate` (low-confidence remasking, no cache, greedy), written out plainly."""
    model = tiny_dlm()
    cfg = config(steps=8)
    prompt = prompts(1)[0]
    x = torch.cat([prompt, torch.full((1, 16), MASK)], dim=1)
    with torch.no_grad():
        for block in range(2):
            hi = prompt.shape[1] + 8 * (block + 1)
            for k in transfer_schedule(8, 4):
                logits = model(x).logits.double()
                logits[..., MASK] = -torch.inf  # the one deviation: never "unmask" into the mask token
                p = logits.softmax(-1)
                x0 = p.argmax(-1)
                confidence = p.gather(-1, x0[..., None])[..., 0]
                confidence[:, hi:] = -torch.inf
                confidence[x != MASK] = -torch.inf
                chosen = confidence.topk(k, dim=-1).indices
                x[0, chosen[0]] = x0[0, chosen[0]]
    ours = diffusion_generate(model, prompt, config=cfg)
    assert torch.equal(ours.sequences, x)
    assert ours.nfe == 8 and all(n == [2] for n in ours.unmasked_per_forward)


def test_threshold_unmasking_takes_every_confident_position_and_at_least_one():
    cfg = config(threshold=0.5)
    state = torch.full((1, 8), MASK)
    state[0, 0] = 3
    logits = torch.zeros(1, 8, 64, dtype=torch.float64)
    logits[0, 1, 7] = logits[0, 4, 9] = 10.0  # confident
    logits[0, 2, 5] = 1.0  # not confident
    new = Unmasker(cfg, MASK, 0)(state, logits, torch.zeros(1, dtype=torch.long))
    assert new[0].tolist() == [3, 7, MASK, MASK, 9, MASK, MASK, MASK]
    flat = torch.zeros(1, 8, 64, dtype=torch.float64)
    flat[0, 6, 1] = 0.5  # nothing reaches the threshold: the most confident position alone
    new = Unmasker(cfg, MASK, 0)(state, flat, torch.zeros(1, dtype=torch.long))
    assert (new != state).sum() == 1 and new[0, 6] == 1


def test_sampling_is_seeded_per_step():
    model = tiny_dlm()
    cfg = config(temperature=1.0, seed=3)
    prompt = prompts(1)[0]
    first, again = (diffusion_generate(model, prompt, config=cfg).sequences for _ in range(2))
    other = diffusion_generate(model, prompt, config=config(temperature=1.0, seed=4)).sequences
    assert torch.equal(first, again) and not torch.equal(first, other)
    # seeds that Python's tuple hash maps alike (hash(-1) == hash(-2), hash(2**61 - 1) == hash(0)) sample apart
    for a, b in ((-1, -2), (0, 2**61 - 1)):
        sampled = [diffusion_generate(model, prompt, config=config(temperature=1.0, seed=seed)).sequences
                   for seed in (a, b)]
        assert not torch.equal(*sampled), (a, b)


def test_calibrated_graph_is_connected_and_round_trips(tmp_path):
    model = tiny_dlm()
    cfg = config(cache="dual")
    graph = calibrate(model, prompts(4), cfg, num_nodes=12, progress=False)
    assert 0 < len(graph) <= 12
    for n, parents in enumerate(graph.parents):
        assert parents and all(p == -1 or (p < n and set(graph.nodes[p]) < set(graph.nodes[n])) for p in parents)
    path = graph.save_pretrained(tmp_path)
    assert path.name == "spiffy_graph.json" and json.loads(path.read_text())["format_version"] == 1
    loaded = DraftGraph.from_pretrained(tmp_path)
    assert loaded.to_dict() == graph.to_dict()
    assert DraftGraph.from_pretrained(path).nodes == graph.nodes


def test_degree_one_accumulation_prefers_nodes_whose_parents_are_frequent():
    recorder = TrajectoryRecorder(MASK, "low_confidence")
    a, b, c = ((0, 0),), ((0, 1),), ((0, 0), (1, 0))
    recorder.counts.update({a: 10, b: 6, c: 5})
    recorder.edges.update({(None, a): 10, (None, b): 6, (a, c): 5})
    nodes, parents, counts = recorder.select(2)
    assert nodes == [a, c] and parents == [[-1], [0]]  # c: 5 + 10 beats b: 6
    nodes, _, _ = recorder.select(1)
    assert nodes == [a]


def test_pruning_keeps_max_drafts_connected_nodes():
    graph = DraftGraph(nodes=[((0, 0),), ((0, 1),), ((0, 0), (1, 0)), ((0, 0), (1, 0), (2, 0))],
                       parents=[[-1], [-1], [0], [2]], block_length=8)
    state = torch.full((2, 8), MASK)
    state[1, :7] = 4  # one masked position left: only single-pair nodes are usable in row 1
    in_hand = torch.randn(2, 8, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    drafts = propose_drafts(graph, state, in_hand, MASK, config(max_drafts=3))
    assert drafts.tokens.shape == (2, 3, 8)
    for row in range(2):
        kept = set(drafts.nodes[row][drafts.valid[row]].tolist())
        assert all(-1 in graph.parents[n] or any(p in kept for p in graph.parents[n]) for n in kept)
    assert drafts.valid[0].all() and drafts.valid[1].sum() == 2
    masked = (drafts.tokens != MASK).sum(-1) - (state != MASK).sum(-1, keepdim=True)
    assert masked[0].tolist() == [len(graph.nodes[n]) for n in drafts.nodes[0].tolist()]


def test_graph_errors(tmp_path):
    with pytest.raises(ValueError, match=r"block_length=8.*block_length=16. Leave block_length out to decode in the "
                       r"graph's blocks.*on the command line: --block-length 8, or no --block-length"):
        DraftGraph(nodes=[((0, 0),)], parents=[[-1]], block_length=8).check_compatible(config(block_length=16))
    data = DraftGraph(nodes=[((0, 0),)], parents=[[-1]], block_length=8).to_dict()
    with pytest.raises(ValueError, match="format_version 99"):
        DraftGraph.from_dict({**data, "format_version": 99})
    with pytest.raises(ValueError, match="does not extend its parent"):
        DraftGraph(nodes=[((0, 0),), ((1, 0),)], parents=[[-1], [0]], block_length=8)
    with pytest.raises(ValueError, match="position rank outside"):
        DraftGraph(nodes=[((8, 0),)], parents=[[-1]], block_length=8)
    with pytest.raises(ValueError, match="malformed.*recalibrate"):
        DraftGraph.from_dict({"format_version": 1, "nodes": []})
    with pytest.raises(ValueError, match="it has no nodes.*Recalibrate"):
        DraftGraph.from_dict({**data, "nodes": []})
    # a pair without its token rank, a rank that is no number, ranks that are not integers
    for broken in ([[0]], [[0, "x"]], [[0.7, 1.9]], [[0, "1"]], [[True, 0]]):
        with pytest.raises(ValueError, match="malformed.*recalibrate"):
            DraftGraph.from_dict({**data, "nodes": [{"pairs": broken, "parents": [-1]}]})
    for node in ({"pairs": [[0, 0]], "parents": [-1], "count": "x"}, {"pairs": [[0, 0]], "parents": [-1.0]}):
        with pytest.raises(ValueError, match="malformed.*is not an integer"):
            DraftGraph.from_dict({**data, "nodes": [node]})
    with pytest.raises(ValueError, match="malformed.*True is not an integer"):
        DraftGraph.from_dict({**data, "block_length": True})
    with pytest.raises(ValueError, match="names a parent twice"):
        DraftGraph(nodes=[((0, 0),), ((0, 0), (1, 0))], parents=[[-1], [0, 0]], block_length=8)
    with pytest.raises(ValueError, match="counts must be integers >= 0"):
        DraftGraph(nodes=[((0, 0),)], parents=[[-1]], counts=[-2], block_length=8)
    with pytest.raises(ValueError, match="a JSON object, got a list"):
        DraftGraph.from_dict([data])
    (tmp_path / "spiffy_graph.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        DraftGraph.from_pretrained(tmp_path)
    (tmp_path / "spiffy_graph.json").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="not valid JSON"):
        DraftGraph.from_pretrained(tmp_path)
    (tmp_path / "spiffy_graph.json").write_text("[" * 100_000)  # nested past Python's stack
    with pytest.raises(ValueError, match="not valid JSON"):
        DraftGraph.from_pretrained(tmp_path)
    with pytest.raises(OSError):
        DraftGraph.from_pretrained(tmp_path / "nowhere")


def test_generate_integration_and_errors(tmp_path):
    model = hf_specdiff.enable(tiny_dlm())
    assert hf_specdiff.is_enabled(model)
    prompt = prompts(1)[0]
    options = dict(max_new_tokens=16, block_length=8, cache="dual", stop_at_eos=False)
    calibrate(model, prompts(3), config(cache="dual"), progress=False).save_pretrained(tmp_path)
    plain = model.generate(prompt, **options)
    out = model.generate(prompt, speculation="spiffy", draft_graph=str(tmp_path), return_dict_in_generate=True,
                         **options)
    assert torch.equal(out.sequences, plain) and out.nfe < 16
    unpickled = pickle.loads(pickle.dumps(model))  # torch.save of the whole model, multiprocessing
    assert hf_specdiff.is_enabled(unpickled) and torch.equal(unpickled.generate(prompt, **options), plain)
    with pytest.raises(TypeError, match="unsupported arguments \\['num_beams'\\]"):
        model.generate(prompt, num_beams=2, **options)
    with pytest.raises(ValueError, match="needs draft_graph"):
        model.generate(prompt, speculation="spiffy", **options)
    with pytest.raises(ValueError, match="add speculation='spiffy'"):
        model.generate(prompt, draft_graph=str(tmp_path), **options)
    with pytest.raises(ValueError, match="max_drafts= is used by speculation='spiffy' only"):  # not silently unused
        model.generate(prompt, **{**options, "max_drafts": 3})
    for graph_argument in (DraftGraph.from_pretrained(tmp_path).to_dict(), 7):
        with pytest.raises(TypeError, match="draft_graph= takes a DraftGraph or a folder / Hub id, got (dict .a|int)"):
            model.generate(prompt, speculation="spiffy", draft_graph=graph_argument, **options)
    with pytest.raises(ValueError, match="do_sample=False contradicts"):
        model.generate(prompt, do_sample=False, temperature=0.5, **options)
    with pytest.raises(ValueError, match="multiple of block_length"):
        model.generate(prompt, max_new_tokens=12, block_length=8)
    with pytest.raises(ValueError, match="block-causal"):
        model.generate(prompt, max_new_tokens=16, block_length=8, cache="block")
    with pytest.raises(ValueError, match="remasking='lowest'"):
        model.generate(prompt, max_new_tokens=16, block_length=8, remasking="lowest")
    with pytest.raises(ValueError, match="mask_token_id=64"):
        DiffusionAdapter(make_target(vocab_size=64), mask_token_id=64)
    with pytest.raises(ValueError, match="do_sample=True contradicts temperature=0"):  # not a silent T = 1
        model.generate(prompt, do_sample=True, temperature=0.0, **options)
    with pytest.raises(TypeError, match="is a hf_specdiff DiffusionGenerationConfig, got GenerationConfig"):
        model.generate(prompt, generation_config=GenerationConfig(max_new_tokens=16))
    with pytest.warns(UserWarning, match="cache='prefix' on a bidirectional model is near-lossless only"):
        model.generate(prompt, speculation="spiffy", draft_graph=str(tmp_path), **{**options, "cache": "prefix"})
    hf_specdiff.disable(model)
    assert not hf_specdiff.is_enabled(model)
    for unenabled in (model, DiffusionLM(DiffusionLMConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                            num_hidden_layers=1, num_attention_heads=2,
                                                            num_key_value_heads=2, mask_token_id=MASK))):
        with pytest.raises(AttributeError, match=f"{type(unenabled).__name__}.generate is .* call hf_specdiff.enable"):
            unenabled.generate(prompt, **options)


def test_a_graph_takes_a_config_that_leaves_block_length_out_as_its_own():
    """block_length None, the default since it follows the graph: before, check_compatible refused it as "decoding uses
    block_length=None" (asking to calibrate a graph for None) and calibration_differences failed with a TypeError."""
    import warnings

    graph = DraftGraph(nodes=[((0, 0),)], parents=[[-1]], block_length=8, calibration={"steps_per_block": 8})
    left_out = DiffusionGenerationConfig(max_new_tokens=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph.check_compatible(left_out)  # blocks of 8, one token a step: the graph's settings
    assert graph.calibration_differences(left_out) == []
    assert graph.calibration_differences(DiffusionGenerationConfig(max_new_tokens=16, steps=4)) == [
        "steps_per_block: 8 (graph) vs 2 (now)"]
    with pytest.raises(ValueError, match=r"steps_per_block depends on block_length, left out here: .*for_model"):
        left_out.steps_per_block  # noqa: B018 (before: TypeError on None)


def test_a_graph_calibrated_for_other_decoding_settings_warns_at_the_callers_line():
    """Spiffy takes a draft only where it equals the real next state, so a graph calibrated under other settings costs
    accepted drafts, never correctness: a warning (not a refusal) naming the settings that differ, attributed to the
    user's call, as is the near-lossless warning of a non-dual cache (not to hf_specdiff's own lines)."""
    import warnings

    model = hf_specdiff.enable(tiny_dlm())
    prompt = prompts(1)[0]
    graph = calibrate(model, prompts(3), config(cache="dual"), progress=False)
    options = dict(max_new_tokens=16, block_length=8, stop_at_eos=False, speculation="spiffy", draft_graph=graph)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the settings it was calibrated with: quiet
        model.generate(prompt, cache="dual", **options)
    with pytest.warns(UserWarning, match=r"calibrated with other decoding settings \(threshold: None \(graph\) vs "
                      r"0.5 \(now\)\).*fewer of them may be accepted") as caught:
        out = model.generate(prompt, cache="dual", threshold=0.5, **options)
    assert torch.equal(out, diffusion_generate(model, prompt, config=config(cache="dual", threshold=0.5)).sequences)
    with warnings.catch_warnings(record=True) as prefix:
        warnings.simplefilter("always")
        model.generate(prompt, cache="prefix", **options)
    assert ["near-lossless only" in str(w.message) for w in prefix] == [True, False]  # and the graph's, for prefix
    with pytest.warns(UserWarning, match=r"cache: 'dual' \(graph\) vs 'none' \(now\), steps_per_block: 8 \(graph\) "
                      r"vs 4 \(now\)") as direct:
        diffusion_generate(model, prompt, config=config(steps=8), draft_graph=graph)
    assert {w.filename for w in [*caught, *prefix, *direct]} == {__file__}


def test_prompt_token_ids_outside_the_vocabulary_are_refused():
    """Before: "IndexError: index out of range in self" deep in the forward. Padding is not read (the canvas holds
    mask tokens there), so its ids are not checked."""
    model = hf_specdiff.enable(tiny_dlm())
    for ids, token in ((torch.tensor([[5, 64]]), 64), (torch.tensor([[-1, 5]]), -1)):
        with pytest.raises(ValueError, match=f"token id {token}, outside the model's vocabulary \\(64 tokens, ids 0 "
                           "to 63\\): tokenize the prompt with the model's own"):
            model.generate(ids, max_new_tokens=16, block_length=8)
    padded = diffusion_generate(model, torch.tensor([[99, 5, 6]]), torch.tensor([[0, 1, 1]]), config=config())
    assert torch.equal(padded.sequences[:, 3:], diffusion_generate(model, torch.tensor([[5, 6]]),
                                                                   config=config()).sequences[:, 2:])


def test_adapter_options_are_checked_when_it_is_built_and_a_graph_prints_short():
    llama = make_target(vocab_size=64)
    adapter = DiffusionAdapter(llama, mask_token_id=torch.tensor(63))  # e.g. read out of a tensor of token ids
    assert type(adapter.mask_token_id) is int and adapter.mask_token_id == 63
    for wrong in (torch.tensor([63]), torch.tensor(63.0), 63.0, True):
        with pytest.raises(TypeError, match="mask_token_id must be a Python int"):
            DiffusionAdapter(llama, mask_token_id=wrong)
    with pytest.raises(ValueError, match="block-causal model with shifted logits is not supported"):
        DiffusionAdapter(llama, mask_token_id=63, shift_logits=True, block_causal=True)
    graph = DraftGraph(nodes=[((0, 0),), ((0, 0), (1, 0)), ((0, 1),)], parents=[[-1], [0], [-1]], block_length=8,
                       calibration={"model": "dlm", "cache": "dual", "threshold": None, "prompts": 50})
    assert repr(graph) == "DraftGraph(3 nodes, depth 2, block_length=8, model='dlm', cache='dual', threshold=None)"


def test_the_shipped_graph_records_the_model_folder_it_ships_in():
    folder = hf_specdiff.default_diffusion_lm_path()
    assert DraftGraph.from_pretrained(folder).calibration["model"] == folder.name == "smollm2-135m-instruct"


def test_spiffy_takes_prompts_of_any_integer_dtype():
    model = tiny_dlm(shift_logits=True)
    graph = calibrate(model, prompts(3, seed=7), config(cache="dual"), num_nodes=16, progress=False)
    prompt = prompts(1)[0]
    plain = diffusion_generate(model, prompt, config=config(cache="dual")).sequences
    out = diffusion_generate(model, prompt.int(), config=config(cache="dual"), draft_graph=graph)
    assert out.sequences.dtype == torch.int32 and torch.equal(out.sequences.long(), plain) and out.nfe < 16


def test_stop_at_eos_ends_after_the_block_with_eos():
    model = tiny_dlm()
    prompt = prompts(1)[0]
    full = diffusion_generate(model, prompt, config=config(max_new_tokens=24))
    eos = int(full.sequences[0, prompt.shape[1] + 2])  # a token the model emits in its first block
    stopped = diffusion_generate(model, prompt, config=config(max_new_tokens=24, stop_at_eos=True), eos_token_id=eos)
    assert stopped.sequences.shape[1] == prompt.shape[1] + 8
    assert torch.equal(stopped.sequences, full.sequences[:, : prompt.shape[1] + 8])


@pytest.mark.parametrize("family", ["dream", "sdar", "llada"])
def test_spiffy_on_the_native_diffusion_lm(family):
    """The library's own DiffusionLM (Dream: shifted logits; SDAR: block-causal; LLaDA: bidirectional) decoded in an
    exact mode: Spiffy equals ordinary decoding, and drafts are accepted."""
    from hf_specdiff.diffusion import DiffusionLM

    dlm = DiffusionLM.from_causal_lm(tiny_dlm().model, mask_token_id=MASK, shift_logits=family == "dream",
                                     block_causal=family == "sdar")
    cache = "block" if family == "sdar" else "dual"
    cfg = config(cache=cache, threshold=0.2)
    graph = calibrate(dlm, prompts(3, seed=7), cfg, num_nodes=16, progress=False)
    accepted = 0
    for prompt in prompts(4):
        plain = diffusion_generate(dlm, prompt, config=cfg)
        spiffy = diffusion_generate(dlm, prompt, config=cfg, draft_graph=graph)
        assert torch.equal(plain.sequences, spiffy.sequences)
        accepted += sum(map(sum, spiffy.accepted_drafts))
    assert accepted > 0


def test_calibrate_command_on_real_prompts(tmp_path):
    """`hf-specdiff calibrate` end to end: MATH-500 + MBPP prompts through the SmolLM2 chat template, a small random
    diffusion LM with SmolLM2's vocabulary, and a graph that loads back and drives Spiffy."""
    from conftest import require_bench_data, small_dlm_with_smollm_tokenizer

    from hf_specdiff.cli import main
    from hf_specdiff.diffusion import AutoDiffusionLM

    require_bench_data()
    tokenizer = small_dlm_with_smollm_tokenizer(tmp_path / "dlm")
    main(["calibrate", "--model", str(tmp_path / "dlm"), "--output", str(tmp_path / "graph"), "--limit", "2",
          "--max-new-tokens", "16", "--block-length", "8", "--cache", "dual", "--num-nodes", "8"])
    graph = DraftGraph.from_pretrained(tmp_path / "graph")
    assert 0 < len(graph) <= 8 and graph.calibration["datasets"] == ["math500", "mbpp"]
    assert graph.calibration["model"] == "dlm"  # a local folder by its name, not by this machine's path
    model = hf_specdiff.enable(AutoDiffusionLM.from_pretrained(tmp_path / "dlm"))
    ids = tokenizer("def add(a, b):", return_tensors="pt")["input_ids"]
    options = dict(max_new_tokens=16, block_length=8, cache="dual")
    assert torch.equal(model.generate(ids, **options),
                       model.generate(ids, speculation="spiffy", draft_graph=tmp_path / "graph", **options))


def sdar_reference(model, prompt, max_new_tokens=16, block=8):
    """SDAR's block diffusion decoding written out plainly (greedy, low confidence, one token per step, no cache), as
    its generate.py lays it out: one grid of blocks aligned at position 0 over prompt and answer, the canvas rounded
    up to whole blocks, decoding from the prompt's last partial block on. Returns prompt + max_new_tokens tokens."""
    prompt_length = prompt.shape[1]
    length = -(-(prompt_length + max_new_tokens) // block) * block
    blocks = torch.arange(length) // block
    allowed = (blocks[None, :] <= blocks[:, None])[None, None]
    x = torch.cat([prompt, torch.full((1, length - prompt_length), MASK)], dim=1)
    with torch.no_grad():
        for b in range(prompt_length // block, length // block):
            lo, hi = b * block, (b + 1) * block
            while bool((x[0, lo:hi] == MASK).any()):
                logits = model(x[:, :hi], position_ids=torch.arange(hi)[None],
                               attention_mask=allowed[..., :hi, :hi]).logits.double()
                logits[..., MASK] = -torch.inf
                confidence, tokens = logits[0, lo:hi].softmax(-1).max(-1)
                confidence[x[0, lo:hi] != MASK] = -torch.inf
                i = int(confidence.argmax())
                x[0, lo + i] = tokens[i]
    return x[:, : prompt_length + max_new_tokens]


def test_block_causal_decoding_matches_sdar():
    """On a block-causal model prompt and answer share SDAR's grid of blocks aligned at position 0: the first block
    finishes the prompt's last partial block. Prompts of whole and partial blocks, alone and left-padded together in
    one batch, give SDAR's output in every cache mode, with Spiffy too; the canvas mask is SDAR's mask."""
    model = tiny_dlm(block_causal=True)
    g = torch.Generator().manual_seed(4)
    lengths = (8, 5, 16, 11, 3)
    rows = [torch.randint(0, MASK, (1, n), generator=g) for n in lengths]
    expected = [sdar_reference(model, p) for p in rows]
    width = max(lengths)
    ids = torch.stack([torch.cat([torch.zeros(width - n, dtype=torch.long), p[0]]) for n, p in zip(lengths, rows)])
    mask = (torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]).long()
    for cache in ("none", "prefix", "block"):
        cfg = config(cache=cache)
        for p, want in zip(rows, expected):
            assert torch.equal(diffusion_generate(model, p, config=cfg).sequences, want), cache
        batched = diffusion_generate(model, ids, mask, config=cfg).sequences
        assert batched.shape == (len(rows), width + 16)
        for i, (n, want) in enumerate(zip(lengths, expected)):
            assert torch.equal(batched[i, width - n :], want[0]), (cache, n)
    graph = calibrate(model, prompts(3, seed=7), config(cache="block"), num_nodes=16, progress=False)
    spiffy = diffusion_generate(model, ids, mask, config=config(cache="block"), draft_graph=graph)
    for i, (n, want) in enumerate(zip(lengths, expected)):
        assert torch.equal(spiffy.sequences[i, width - n :], want[0]), n
    assert sum(map(sum, spiffy.accepted_drafts)) > 0
    canvas = Canvas(model, rows[2], None, config())
    columns = torch.arange(32)
    blocks = columns // 8
    assert torch.equal(canvas.attention_mask(columns, columns)[0], blocks[None, :] <= blocks[:, None])


def test_block_causal_stream_and_early_stop_with_a_partial_first_block():
    """The streamer gets only answer tokens (never the prompt tail that shares the first block), and a batch that
    stops at EOS early returns every row's answer with EOS where a row's last block was left undecided."""
    model = tiny_dlm(block_causal=True)
    prompt = torch.randint(0, MASK, (1, 5), generator=torch.Generator().manual_seed(2))  # the first block: 5 + 3
    full = diffusion_generate(model, prompt, config=config(max_new_tokens=24))

    class Collect:
        def __init__(self):
            self.parts = []

        def put(self, value):
            self.parts.append(value)

        def end(self):
            pass

    streamer = Collect()
    diffusion_generate(model, prompt, config=config(max_new_tokens=24), streamer=streamer)
    assert torch.equal(streamer.parts[0], prompt)
    assert [part.shape[1] for part in streamer.parts[1:]] == [3, 8, 8, 5]
    assert torch.equal(torch.cat(streamer.parts, dim=1), full.sequences)
    eos = int(full.sequences[0, 5 + 1])  # the answer's second token: decided in the first (partial) block
    stopped = diffusion_generate(model, prompt, config=config(max_new_tokens=24, stop_at_eos=True), eos_token_id=eos)
    assert torch.equal(stopped.sequences, full.sequences[:, : 5 + 3])
    other = torch.randint(0, MASK, (1, 8), generator=torch.Generator().manual_seed(3))  # answer starts a block earlier
    ids = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], dim=1), other])
    mask = torch.cat([torch.cat([torch.zeros(1, 3), torch.ones(1, 5)], dim=1), torch.ones(1, 8)]).long()
    unstopped = diffusion_generate(model, ids, mask, config=config(max_new_tokens=24)).sequences[:, 8:]
    common = set(unstopped[0, :8].tolist()) & set(unstopped[1, :8].tolist())  # both rows emit it in their 1st block
    assert common, "pick other prompts: no token is in both rows' first blocks"
    eos = min(common)
    both = diffusion_generate(model, ids, mask, config=config(max_new_tokens=24, stop_at_eos=True), eos_token_id=eos)
    answers = both.sequences[:, 8:]
    assert answers.shape[1] < 24 and not bool((answers == MASK).any())
    for row, reference in zip(answers, unstopped[:, : answers.shape[1]]):
        decided = row.shape[0] if not bool((row != reference).any()) else int((row != reference).nonzero()[0, 0])
        assert eos in reference[:decided].tolist() and bool((row[decided:] == eos).all())


def test_bad_decoding_inputs_are_refused():
    model = tiny_dlm()
    prompt = prompts(1)[0]
    graph = calibrate(model, prompts(2), config(cache="dual"), num_nodes=4, progress=False)
    n = prompt.shape[1]
    right_padded = torch.cat([torch.ones(1, n - 1), torch.zeros(1, 1)], dim=1).long()
    cases = [
        (dict(config=config(max_new_tokens=0)), "max_new_tokens must be >= 1, got 0"),
        (dict(config=config(threshold=0.5, remasking="entropy")), "remasking='entropy' scores positions otherwise"),
        (dict(attention_mask=torch.ones(2, n).long()), r"attention_mask \(2, .*must have input_ids' shape"),
        (dict(attention_mask=right_padded), "must be left-padded"),
        (dict(config=config(cache="dual"), draft_graph=graph, recorder=lambda *a: None), "drop draft_graph= to record"),
        (dict(config=config(cache="dual"), draft_graph=DraftGraph(nodes=[((0, 70),)], parents=[[-1]], block_length=8)),
         "token rank 70, but the model has 64 tokens"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            diffusion_generate(model, prompt, **{"config": config(), **kwargs})
    batch = torch.cat([prompt, prompt])
    with pytest.raises(ValueError, match="A prompt is all padding"):
        diffusion_generate(model, batch, torch.stack([torch.ones(n), torch.zeros(n)]).long(), config())
    refused = [
        (dict(config=config(steps=32)), ValueError, "steps=32 exceeds max_new_tokens=16"),
        (dict(config=config(max_new_tokens=16.0)), TypeError, "max_new_tokens must be an integer, got 16.0"),
        (dict(config=config(seed=1.5)), TypeError, "seed must be an integer"),
        (dict(config=config(temperature=float("nan"))), ValueError, "temperature must be a finite number"),
        (dict(eos_token_id=[]), ValueError, "eos_token_id is an empty list"),
        (dict(eos_token_id="x"), TypeError, "eos_token_id must be a token id or a list of them, got 'x'"),
        (dict(eos_token_id=[3, 2.0]), TypeError, "eos_token_id must be a token id or a list of them"),
        (dict(config=config(temperature="0.5")), TypeError, "temperature must be a number, got '0.5'"),
        (dict(config=config(threshold="0.9")), TypeError, "threshold must be a number, got '0.9'"),
        (dict(config=config(stop_at_eos="no")), TypeError, "stop_at_eos must be True or False, got 'no'"),
        (dict(input_ids=prompt.tolist()), TypeError, "input_ids must be a tensor"),
    ]
    for kwargs, error, message in refused:
        with pytest.raises(error, match=message):
            diffusion_generate(model, **{"input_ids": prompt, "config": config(), **kwargs})
    with pytest.raises(ValueError, match=r"one prompt per tensor.*\(2, 4\)"):
        calibrate(model, [torch.zeros(2, 4, dtype=torch.long)], config(cache="dual"), progress=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_prompt_ids_of_a_non_integer_dtype_are_refused_saying_so(dtype):
    model, prompt = tiny_dlm(), prompts(1)[0]
    graph = calibrate(model, prompts(2), config(cache="dual"), num_nodes=4, progress=False)
    for draft_graph in (None, graph):  # before: the embedding's "Expected tensor for argument #1 'indices' ..."
        with pytest.raises(TypeError, match=f"input_ids must hold integer token ids, got {dtype}"):
            diffusion_generate(model, prompt.to(dtype), config=config(cache="dual"), draft_graph=draft_graph)


@pytest.mark.parametrize("options,message", [
    (dict(num_nodes=0), "num_nodes must be an integer >= 1, got 0"),
    (dict(max_depth=0), "max_depth must be an integer >= 1"),
    (dict(num_token_ranks=65), "num_token_ranks=65 exceeds the model's vocabulary"),
])
def test_bad_calibration_options_fail_before_any_decoding(options, message, monkeypatch):
    import hf_specdiff.diffusion.decoding as decoding

    monkeypatch.setattr(decoding, "diffusion_generate", lambda *a, **k: pytest.fail("decoded before the check"))
    with pytest.raises(ValueError, match=message):
        calibrate(tiny_dlm(), prompts(2), config(cache="dual"), progress=False, **options)
