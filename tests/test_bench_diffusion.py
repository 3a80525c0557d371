"""`hf-specdiff bench` for diffusion LMs: NFE, speed, accuracy and Spiffy losslessness, on real prompts with a small
random model; and the accuracy scorers."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import require_bench_data, small_dlm_with_smollm_tokenizer

from hf_specdiff.bench import BenchConfig, load_rows
from hf_specdiff.bench_diffusion import _rows_not_used_for_calibration, first_divergence_gap, score
from hf_specdiff.cli import main
from hf_specdiff.spiffy import DraftGraph


def test_diffusion_bench_end_to_end(tmp_path, recwarn):
    require_bench_data()
    small_dlm_with_smollm_tokenizer(tmp_path / "dlm", base_folder=tmp_path / "base")
    main(["calibrate", "--model", str(tmp_path / "dlm"), "--output", str(tmp_path / "dlm"), "--limit", "2",
          "--max-new-tokens", "16", "--block-length", "8", "--cache", "dual", "--num-nodes", "8"])
    main(["bench", "--target", str(tmp_path / "dlm"), "--datasets", "gsm8k", "mbpp", "--limit", "2",
          # listed after its Spiffy method, or not at all, a baseline still runs before it: the lossless check needs it
          "--methods", "spiffy_threshold", "threshold", "spiffy", "ar_base", "--max-new-tokens", "16",
          "--threshold", "0.05", "--base", str(tmp_path / "base"),
          "--json", str(tmp_path / "out.json"),
          "--markdown", str(tmp_path / "out.md"), "--plots", str(tmp_path / "plots")])
    result = json.loads((tmp_path / "out.json").read_text())
    summary = result["summary"]
    assert result["runs"] == ["threshold", "spiffy_threshold", "steps", "spiffy", "ar_base"]
    assert result["config"]["block_length"] == 8  # no --block-length: the graph's, for every method
    assert "Decoded in blocks of 8 tokens, 16 tokens per answer, cache 'dual'." in (tmp_path / "out.md").read_text()
    assert summary["steps"]["nfe"] == 16 and summary["steps"]["nfe_reduction_vs_steps"] == 1.0
    for name, entry in summary.items():  # coherence measures for every method, the AR base's too
        assert 0 <= entry["finished_rate"] <= 1 and 0 <= entry["repetition"] <= 1, name
        assert entry["base_perplexity"] > 1, name
    # the AR base: one forward per generated token (EOS included), none when it stopped at once
    base_records = [r for r in result["records"] if r["method"] == "ar_base"]
    assert all(r["nfe"] == r["new_tokens"] + r["finished"] for r in base_records)
    for name in ("spiffy", "spiffy_threshold"):
        assert summary[name]["lossless_mismatches"] == 0 and summary[name]["exact"]
        assert summary[name]["unexplained_mismatches"] == 0
        assert summary[name]["nfe"] <= summary[name.replace("spiffy_", "").replace("spiffy", "steps")]["nfe"]
    assert set(result["by_dataset"]) == {"gsm8k", "mbpp"}
    assert all(r["correct"] in (True, False) for r in result["records"])
    assert ("| all | spiffy |" in (tmp_path / "out.md").read_text()
            and "| all | ar_base |" in (tmp_path / "out.md").read_text())
    assert (tmp_path / "plots" / "nfe.png").is_file()
    # the graph (calibrated without a threshold) serves spiffy_threshold too: recorded and noted once, not warned at
    # every prompt as if the command were wrong (before: "calibrate a graph with these settings", every bench run)
    assert result["graph_calibration_differences"] == {"spiffy_threshold": ["threshold: None (graph) vs 0.05 (now)"]}
    assert not [w for w in recwarn if "calibrated with other decoding settings" in str(w.message)]
    assert ("Note: the Spiffy graph was calibrated with other decoding settings than spiffy_threshold "
            "(spiffy_threshold: threshold: None (graph) vs 0.05 (now))") in (tmp_path / "out.md").read_text()

    graph = DraftGraph.from_pretrained(tmp_path / "dlm")
    calibration = {json.dumps(r, sort_keys=True) for _, r in load_rows(BenchConfig(
        datasets=["math500", "mbpp"], limit=2, seed=graph.calibration["prompt_seed"]))}
    measured = _rows_not_used_for_calibration(BenchConfig(datasets=["mbpp", "math500"], limit=30), graph)
    assert len(measured) == 60 and not calibration & {json.dumps(r, sort_keys=True) for _, r in measured}


class PositionLogitsDLM(torch.nn.Module):
    """A diffusion LM whose logits depend on the position only: position p prefers token p % 7 with logit
    4 + 0.6 p (every decision is separated by >= 0.6 logits), except `tie_position`, whose runner-up token trails
    its top token by `delta`."""

    mask_token_id, shift_logits, block_causal, supports_kv = 7, False, False, False
    config = SimpleNamespace(vocab_size=8, eos_token_id=None)

    def __init__(self, tie_position, delta):
        super().__init__()
        self.tie_position, self.delta = tie_position, delta

    def forward(self, input_ids, position_ids, attention_mask, past_key_values=None, return_key_values=False):
        top = position_ids % 7
        top_logit = 4 + 0.6 * position_ids.double()
        logits = torch.zeros(*input_ids.shape, 8, dtype=torch.float64)
        logits.scatter_(-1, top[..., None], top_logit[..., None])
        tie = position_ids == self.tie_position
        logits[tie, (top[tie] + 1) % 7] = top_logit[tie] - self.delta
        return SimpleNamespace(logits=logits, key_values=None)


@pytest.mark.parametrize("threshold", [None, 0.9])
def test_a_diverging_block_is_explained_only_by_a_near_tie(threshold):
    """The gap reported for a Spiffy mismatch is the closest decision of ordinary decoding in the block where the
    outputs diverge: the runner-up's distance at a near-tie (positive control), >= 0.6 logits without one."""
    from hf_specdiff.diffusion import DiffusionGenerationConfig, diffusion_generate

    decoding = DiffusionGenerationConfig(max_new_tokens=16, block_length=8, threshold=threshold, stop_at_eos=False)
    prompt = torch.tensor([[1, 2, 3]])
    for delta, low, high in ((1e-6, 0, 2e-6), (1.0, 0.59, 1.0)):
        model = PositionLogitsDLM(tie_position=3 + 10, delta=delta)  # answer token 10: the second block
        reference = diffusion_generate(model, prompt, config=decoding).sequences
        assert reference[0, 3 + 10] == 13 % 7
        diverged = reference.clone()
        diverged[0, 3 + 12] = 0  # diverges in the second block, two tokens after the near-tie
        assert low <= first_divergence_gap(model, prompt, decoding, reference, diverged, None) <= high, delta
        early = reference.clone()
        early[0, 3 + 5] = 0  # diverges in the first block, which has no near-tie
        assert first_divergence_gap(model, prompt, decoding, reference, early, None) >= 0.59
    sampled = DiffusionGenerationConfig(max_new_tokens=16, block_length=8, temperature=0.7)
    assert first_divergence_gap(model, prompt, sampled, reference, early, None) is None
    # 0.2 logits apart at logits of ~12: a decision in float32, within a bf16 model's rounding (0.0625 per step there)
    model = PositionLogitsDLM(tie_position=3 + 10, delta=0.2)
    reference = diffusion_generate(model, prompt, config=decoding).sequences
    diverged, early = reference.clone(), reference.clone()
    diverged[0, 3 + 12], early[0, 3 + 5] = 0, 0
    bf16 = 4 * torch.finfo(torch.bfloat16).eps
    assert first_divergence_gap(model, prompt, decoding, reference, diverged, None) == pytest.approx(0.2, abs=1e-9)
    assert first_divergence_gap(model, prompt, decoding, reference, diverged, None, rounding=bf16) == 0.0
    assert first_divergence_gap(model, prompt, decoding, reference, early, None, rounding=bf16) > 0.05


def test_diffusion_demo(tmp_path, capsys, monkeypatch):
    small_dlm_with_smollm_tokenizer(tmp_path / "dlm")
    from hf_specdiff.diffusion import AutoDiffusionLM
    from hf_specdiff.diffusion.decoding import DiffusionGenerationConfig
    from hf_specdiff.spiffy import calibrate

    model = AutoDiffusionLM.from_pretrained(tmp_path / "dlm")
    prompts = [torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    calibrate(model, prompts, DiffusionGenerationConfig(max_new_tokens=16, block_length=8, cache="dual"),
              num_nodes=8, progress=False).save_pretrained(tmp_path / "dlm")
    # no --block-length: the graph's 8 (before: 32, which the graph refused)
    main(["demo", "--diffusion", "--model", str(tmp_path / "dlm"), "--max-new-tokens", "16",
          "--threshold", "0.05", "--device", "cpu"])
    printed = capsys.readouterr().out
    # the block fills in over several forwards; blocks of 8 (the graph's), two of them
    assert printed.count("block 0 |") >= 2 and "block 1 |" in printed and "\u2591" in printed
    assert "unmasking in blocks of 8 tokens" in printed
    assert printed.count("  yes") == 2 and "NO" not in printed
    methods = ("steps", "threshold", "spiffy", "spiffy+threshold")

    def table(printed):  # the comparison's rows: method, NFE, tokens, tokens/s, identical
        rows = (line.split() for line in printed.splitlines() if line.strip())
        return {words[0]: words for words in rows if words[0] in methods}

    assert [row[2] for row in table(printed).values()] == ["16"] * 4  # no EOS: the whole answer counted

    # an answer that ends early: its tokens/s count the tokens before the EOS, as the bench does (before: the filler
    # after it too), and the table says how many
    import hf_specdiff.diffusion
    from hf_specdiff.diffusion import load_tokenizer

    eos, decode = load_tokenizer(tmp_path / "dlm").eos_token_id, hf_specdiff.diffusion.diffusion_generate

    def ending_after_five_tokens(model, ids, **kwargs):
        out = decode(model, ids, **kwargs)
        out.sequences[:, ids.shape[1] + 5 :] = eos
        return out

    monkeypatch.setattr(hf_specdiff.diffusion, "diffusion_generate", ending_after_five_tokens)
    main(["demo", "--diffusion", "--model", str(tmp_path / "dlm"), "--max-new-tokens", "16", "--block-length", "8",
          "--threshold", "0.05", "--device", "cpu"])
    rows = table(capsys.readouterr().out)
    assert list(rows) == list(methods) and [row[2] for row in rows.values()] == ["5"] * 4


def test_demo_checks_its_options_and_graph_before_loading_the_model(monkeypatch, capsys):
    """Before: after loading the model and printing the prompt. The shipped graph was calibrated for blocks of 32."""
    from hf_specdiff.diffusion import AutoDiffusionLM

    monkeypatch.setattr(AutoDiffusionLM, "from_pretrained", lambda *a, **k: pytest.fail("the model loaded first"))
    for flags, message in [(["--max-new-tokens", "20"], "max_new_tokens=20 must be a positive multiple of "
                                                         "block_length=32"),
                           (["--threshold", "1.5"], r"threshold must lie in \(0, 1\], got 1.5"),
                           (["--block-length", "16", "--max-new-tokens", "32"],
                            "calibrated for block_length=32.*on the command line: --block-length 32")]:
        with pytest.raises(ValueError, match=message):
            main(["demo", "--diffusion", "--device", "cpu", *flags])
    assert capsys.readouterr().out == ""


def tiny_dlm_without_tokenizer(folder, vocab_size=300):
    """What `DiffusionLM.save_pretrained(folder)` alone writes: config and weights, no tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_specdiff.diffusion import DiffusionLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    DiffusionLM.from_causal_lm(base, mask_token_id=vocab_size - 1, shift_logits=True).save_pretrained(folder)
    return base


def test_a_model_folder_without_a_tokenizer_or_with_another_models_is_refused(tmp_path):
    """Before: transformers' "Couldn't instantiate the backend tokenizer ... sentencepiece or tiktoken" for a folder
    without a tokenizer (bench of a diffusion LM or of a causal LM, calibrate), and "IndexError: index out of range in
    self" deep in the first forward for a tokenizer whose ids the model has no embedding for."""
    import hf_specdiff

    base = tiny_dlm_without_tokenizer(tmp_path / "dlm")
    base.save_pretrained(tmp_path / "causal")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "What is 2 + 3?"}\n')
    prompts = ["--prompts", str(tmp_path / "prompts.jsonl"), "--limit", "1"]
    saved_alone = "holds no tokenizer .* save the model's tokenizer into that folder \\(tokenizer.save_pretrained"
    with pytest.raises(OSError, match=f"dlm {saved_alone}.*, or pass --tokenizer"):
        main(["bench", "--target", str(tmp_path / "dlm"), "--methods", "steps", "--max-new-tokens", "32", *prompts])
    (tmp_path / "empty").mkdir()  # no model at all: said so, not that a tokenizer should be saved there
    with pytest.raises(OSError, match="No diffusion LM at .*empty.: the folder has no config.json. Point --target at"):
        main(["bench", "--target", str(tmp_path / "empty"), "--methods", "steps", "--max-new-tokens", "32", *prompts])
    with pytest.raises(OSError, match=f"causal {saved_alone}.*, or pass --tokenizer"):
        main(["bench", "--target", str(tmp_path / "causal"), "--methods", "ar", *prompts])
    shipped = str(hf_specdiff.default_diffusion_lm_path())  # SmolLM2's tokenizer: 49152 tokens
    with pytest.raises(ValueError, match="writes token id [0-9]+, but the target embeds 300 tokens: pass the target's "
                       "own tokenizer \\(--tokenizer"):
        main(["bench", "--target", str(tmp_path / "causal"), "--tokenizer", shipped, "--methods", "ar", *prompts])
    with pytest.raises(ValueError, match="writes token id [0-9]+, but the diffusion LM has 300 tokens: pass the "
                       "tokenizer the model was trained with \\(--tokenizer"):
        main(["bench", "--target", str(tmp_path / "dlm"), "--tokenizer", shipped, "--methods", "steps",
              "--max-new-tokens", "32", *prompts])
    with pytest.raises(FileNotFoundError, match="No tokenizer at .*nowhere"):
        main(["bench", "--target", str(tmp_path / "dlm"), "--tokenizer", str(tmp_path / "nowhere"), "--methods",
              "steps", *prompts])
    with pytest.raises(OSError, match=f"dlm {saved_alone}.*, or pass --tokenizer"):
        main(["calibrate", "--model", str(tmp_path / "dlm"), *prompts])
    with pytest.raises(ValueError, match="tokenizer of .* writes token id [0-9]+, but the model has 300 tokens: pass "
                       "the tokenizer the model was trained with"):
        main(["calibrate", "--model", str(tmp_path / "dlm"), "--tokenizer", shipped, "--max-new-tokens", "32",
              "--output", str(tmp_path / "graph"), *prompts])
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(shipped).save_pretrained(tmp_path / "dlm")
    with pytest.raises(ValueError, match="tokenizer writes token id [0-9]+, but the diffusion LM has 300 tokens"):
        main(["bench", "--target", str(tmp_path / "dlm"), "--methods", "steps", "--max-new-tokens", "32", *prompts])


def test_a_draft_graph_without_a_spiffy_method_is_refused():
    """As other options no method uses are (--block-length with autoregressive methods): before, ignored. So are
    Spiffy's --max-drafts and the unmasking --threshold."""
    from hf_specdiff.bench_diffusion import run_diffusion_bench

    with pytest.raises(ValueError, match=r"^--draft-graph g \(spiffy, spiffy_threshold\): no method in --methods "
                       r"\['steps', 'threshold'\] uses it. Add such a method or drop the option."):
        run_diffusion_bench(BenchConfig(methods=["steps", "threshold"], draft_graph="g"))
    with pytest.raises(ValueError, match=r"^--max-drafts 4 \(spiffy, spiffy_threshold\): no method"):
        run_diffusion_bench(BenchConfig(methods=["steps", "threshold"], max_drafts=4))
    with pytest.raises(ValueError, match=r"^--threshold 0.5 \(threshold, spiffy_threshold\): no method in --methods "
                       r"\['steps', 'spiffy'\]"):
        run_diffusion_bench(BenchConfig(methods=["steps", "spiffy"], threshold=0.5))


def test_accuracy_scorers():
    assert score("gsm8k", {"answer": "... #### 1,234"}, "So the total is 1234.")
    assert not score("gsm8k", {"answer": "#### 18"}, "She makes 16 dollars, then 2 more: 19")
    assert score("math500", {"answer": "\\frac{1}{2}"}, "Thus $\\boxed{\\dfrac{1}{2}}$.")
    assert not score("math500", {"answer": "3"}, "no boxed answer 3")
    assert score("mbpp", {}, "```python\ndef f(x):\n    return x\n```")
    assert not score("humaneval", {}, "def f(x) return x")
    assert score("mt_bench", {}, "anything") is None


def test_coherence_measures():
    from hf_specdiff.bench_diffusion import answer_nll, repeated_ngram_share

    assert repeated_ngram_share(torch.tensor([1, 2, 3, 4, 5, 6])) == 0.0
    # 9 4-grams: the first 4 are new, the other 5 repeat
    assert repeated_ngram_share(torch.tensor([1, 2, 3, 4] * 3)) == 5 / 9
    assert repeated_ngram_share(torch.tensor([1, 2, 3])) == 0.0
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1)).eval()
    prompt = torch.tensor([[3, 7, 9]])
    greedy = int(base(input_ids=prompt).logits[0, -1].argmax())
    nll = {token: answer_nll(base, prompt, torch.tensor([token]), None) for token in range(50)}
    assert all(count == 1 for _, count in nll.values())
    assert min(nll, key=lambda token: nll[token][0]) == greedy  # the base's own choice is the likeliest to it
    assert answer_nll(base, prompt, torch.tensor([greedy]), eos=2)[1] == 2  # an answer that ended counts its EOS
    assert answer_nll(base, prompt, torch.tensor([], dtype=torch.long), None) == (0.0, 0)


def test_ar_base_needs_a_base(tmp_path):
    small_dlm_with_smollm_tokenizer(tmp_path / "dlm")
    from hf_specdiff.bench_diffusion import run_diffusion_bench

    with pytest.raises(ValueError, match="pass --base"):
        run_diffusion_bench(BenchConfig(target=str(tmp_path / "dlm"), methods=["steps", "ar_base"]))


def test_ar_base_samples_at_the_temperature_the_diffusion_methods_sample_at(tmp_path, monkeypatch):
    require_bench_data()
    from transformers import AutoModelForCausalLM

    from hf_specdiff.bench_diffusion import run_diffusion_bench

    small_dlm_with_smollm_tokenizer(tmp_path / "dlm", base_folder=tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    calls = []
    monkeypatch.setattr(base, "generate", lambda *args, **kwargs: calls.append(kwargs) or type(base).generate(
        base, *args, **kwargs))
    for temperature, sampling in [(0.7, dict(do_sample=True, temperature=0.7)), (0.0, dict(do_sample=False))]:
        calls.clear()
        run_diffusion_bench(BenchConfig(target=str(tmp_path / "dlm"), methods=["steps", "ar_base"], limit=1,
                                        max_new_tokens=8, block_length=8, temperature=temperature),
                            base_model=base, progress=False)
        assert calls and all(sampling.items() <= call.items() for call in calls), calls
        assert all("temperature" not in call for call in calls) or temperature > 0


def test_bad_diffusion_bench_inputs_are_clear_errors(tmp_path):
    """A model given in memory without its tokenizer, or nothing left to measure, fails with what to do; a graph
    calibrated on a dataset the bench does not measure does not need that dataset's file."""
    require_bench_data()
    from hf_specdiff.bench import find_data_dir
    from hf_specdiff.bench_diffusion import run_diffusion_bench
    from hf_specdiff.diffusion import AutoDiffusionLM

    small_dlm_with_smollm_tokenizer(tmp_path / "dlm")
    model = AutoDiffusionLM.from_pretrained(tmp_path / "dlm")
    with pytest.raises(ValueError, match="needs its tokenizer: pass tokenizer="):
        run_diffusion_bench(BenchConfig(methods=["steps"]), model=model)
    with pytest.raises(ValueError, match="--limit must be >= 0"):
        run_diffusion_bench(BenchConfig(target=str(tmp_path / "dlm"), methods=["steps"], limit=-1))
    # the speculative methods' options: no diffusion method reads them, so they are refused rather than ignored
    for options, flags in [(dict(jacobi_passes=[2, 8]), "--jacobi-passes"), (dict(speculator="spec"), "--speculator"),
                           (dict(compile=True, num_draft_tokens=3), "--num-draft-tokens, --compile")]:
        with pytest.raises(ValueError, match=f"^{flags}: the diffusion methods \\['steps'\\] do not use it"):
            run_diffusion_bench(BenchConfig(target=str(tmp_path / "dlm"), methods=["steps"], **options))
    everything = SimpleNamespace(calibration={"datasets": ["gsm8k"], "prompt_seed": 0, "limit": 0})  # all of GSM8K
    with pytest.raises(ValueError, match="No prompts to measure"):
        run_diffusion_bench(BenchConfig(target=str(tmp_path / "dlm"), methods=["steps"], datasets=["gsm8k"], limit=3),
                            graph=everything)

    data = tmp_path / "data"  # gsm8k only: the graph below was calibrated on math500 and mbpp
    data.mkdir()
    (data / "gsm8k").symlink_to((find_data_dir(None) / "gsm8k").resolve())
    graph = SimpleNamespace(calibration={"datasets": ["math500", "mbpp"], "prompt_seed": 1, "limit": 2})
    rows = _rows_not_used_for_calibration(BenchConfig(datasets=["gsm8k"], limit=3, data_dir=str(data)), graph)
    assert [dataset for dataset, _ in rows] == ["gsm8k"] * 3


def test_demo_runs_spiffy_with_and_without_threshold_on_one_graph_without_asking_to_recalibrate(tmp_path, capsys,
                                                                                                 recwarn):
    """calibrate's default cache is the one bench and demo --diffusion decode with (before: none, so its graph warned
    "cache: 'none' (graph) vs 'dual' (now)" wherever it was used), and the demo, which runs Spiffy with and without
    threshold unmasking on one graph, says once which runs differ from its calibration (before: a warning asking to
    recalibrate for the threshold the demo itself chose)."""
    small_dlm_with_smollm_tokenizer(tmp_path / "dlm")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hi", "Add 2 and 3.")))
    main(["calibrate", "--model", str(tmp_path / "dlm"), "--output", str(tmp_path / "dlm"), "--prompts",
          str(tmp_path / "prompts.jsonl"), "--max-new-tokens", "16", "--block-length", "8", "--num-nodes", "8"])
    assert DraftGraph.from_pretrained(tmp_path / "dlm").calibration["cache"] == "dual"
    main(["demo", "--diffusion", "--model", str(tmp_path / "dlm"), "--prompt", "Hi", "--max-new-tokens", "16",
          "--block-length", "8", "--threshold", "0.05"])
    shown = capsys.readouterr().out
    assert not [w for w in recwarn if "calibrated with other decoding settings" in str(w.message)]
    assert "calibrated with other settings than some of these runs (threshold: None (graph) vs 0.05 (now))" in shown
    identical = [line.split()[-1] for line in shown.splitlines() if line.startswith(("spiffy ", "spiffy+threshold"))]
    assert identical == ["yes", "yes"]


def test_a_spiffy_mismatch_of_a_diffusion_adapter_is_measured(tmp_path, monkeypatch):
    """Your own model wrapped in a DiffusionAdapter (an nn.Module without a `dtype` attribute) benches like a
    DiffusionLM: a Spiffy mismatch (possible with cache='prefix' on a bidirectional model) is counted and checked
    for a near-tie, rather than crashing the run after every prompt was decoded."""
    require_bench_data()
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_specdiff.diffusion as diffusion
    from hf_specdiff import DiffusionAdapter
    from hf_specdiff.bench_diffusion import run_diffusion_bench

    tokenizer = small_dlm_with_smollm_tokenizer(tmp_path / "dlm")
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)).eval()
    adapter = DiffusionAdapter(llama, mask_token_id=len(tokenizer) - 1)
    graph = DraftGraph(nodes=[((0, 0),)], parents=[[-1]], block_length=8)
    generate = diffusion.diffusion_generate

    def spiffy_differs(*args, draft_graph=None, **kwargs):  # a Spiffy output one token off ordinary decoding's
        out = generate(*args, draft_graph=draft_graph, **kwargs)
        if draft_graph is not None:
            out.sequences[0, -1] = (out.sequences[0, -1] + 1) % 100
        return out

    monkeypatch.setattr(diffusion, "diffusion_generate", spiffy_differs)
    config = BenchConfig(methods=["spiffy"], limit=1, max_new_tokens=8, block_length=8, cache="prefix")
    result = run_diffusion_bench(config, model=adapter, tokenizer=tokenizer, graph=graph, progress=False)
    assert result["summary"]["spiffy"]["lossless_mismatches"] == 1
    assert [r for r in result["records"] if r["method"] == "spiffy"][0]["decision_gap"] is not None
