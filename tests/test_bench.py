"""The benchmark harness on the embedded real target: every field the JSON promises, losslessness checked."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
import torch

import hf_specdiff
from hf_specdiff.bench import (
    METHODS,
    BenchConfig,
    _drafts_per_block,
    _environment,
    cpu_name,
    _method_runs,
    check_bench_config,
    load_prompts,
    markdown_table,
    mean_accepted_length,
    paired_permutation_test,
    phase_times,
    run_bench,
    speed_settings_note,
    write_outputs,
)
from hf_specdiff.speculator import write_draft_vocab

SPECULATIVE = ("dflash", "xpress_k1", "xpress_k4", "markov", "dflash_static", "xpress_static_k1", "xpress_static_k4")


@pytest.fixture(scope="module")
def smollm():
    target, tokenizer = hf_specdiff.load_default_target()
    return target, tokenizer, hf_specdiff.AutoSpeculator.from_target(target, seed=0)


def _two_prompts(tmp_path) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "What is 12 times 7?"}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Name three primary colours."}]}) + "\n"
    )
    return prompts


@pytest.mark.parametrize("batch_size", [[1], [1, 2]])
def test_a_wrong_speculator_or_prompt_file_fails_before_the_target_loads(tmp_path, monkeypatch, batch_size):
    monkeypatch.setattr("hf_specdiff.embedded.load_target", lambda *_, **__: pytest.fail("the target loaded first"))
    missing = tmp_path / "no-speculator"
    with pytest.raises(FileNotFoundError, match="No speculator at"):
        run_bench(BenchConfig(prompts=str(_two_prompts(tmp_path)), speculator=str(missing), batch_size=batch_size,
                              methods=["ar", "dflash"]), progress=False)
    (tmp_path / "bad.jsonl").write_text("What is 12 times 7?\n")
    with pytest.raises(ValueError, match="bad.jsonl:1 is not JSON"):
        run_bench(BenchConfig(prompts=str(tmp_path / "bad.jsonl"), batch_size=batch_size, methods=["ar", "dflash"]),
                  progress=False)
    with pytest.raises(ValueError, match="--num-draft-tokens 99: the speculator's blocks of 16 slots offer 1 to 15"):
        run_bench(BenchConfig(prompts=str(_two_prompts(tmp_path)), batch_size=batch_size, methods=["ar", "dflash"],
                              num_draft_tokens=99), progress=False)


def test_bench_reports_every_method_side_by_side(tmp_path, smollm):
    target, tokenizer, speculator = smollm
    config = BenchConfig(prompts=str(_two_prompts(tmp_path)), limit=0, max_new_tokens=12, jacobi_passes=[1, 4],
                         device="cpu", methods=["ar", "ar_static", "dflash", "xpress", "markov", "dflash_static",
                                                "xpress_static", "dflash_hf", "prompt_lookup"],
                         json=str(tmp_path / "out.json"), markdown=str(tmp_path / "out.md"),
                         plots=str(tmp_path / "plots"))
    result = run_bench(config, target=target, tokenizer=tokenizer, speculator=speculator, progress=False)
    write_outputs(result, config)
    assert result["runs"] == ["ar", "ar_static", "dflash", "xpress_k1", "xpress_k4", "markov", "dflash_static",
                              "xpress_static_k1", "xpress_static_k4", "dflash_hf", "prompt_lookup"]
    summary = json.loads((tmp_path / "out.json").read_text())["summary"]
    for name, entry in summary.items():  # prefill and decode rate for every method, ar included
        assert entry["prefill_ms"] > 0 and entry["decode_tokens_per_s"] > 0, name
        assert "sampling_check" not in entry, name
    # transformers compiles only on cuda/xpu/neuron/tpu by default: the static cache alone on the CPU
    assert summary["ar_static"]["compiled"] is False
    assert not any(entry["compiled"] for entry in summary.values())
    assert summary["ar_static"]["unexplained_mismatches"] == 0 and "lossless_mismatches" in summary["ar_static"]
    for name in SPECULATIVE:
        entry = summary[name]
        for key in ("tau", "tau_per_sample", "tokens_per_s", "speedup_vs_ar", "accept_rate_by_position",
                    "draft_ms", "refine_ms", "verify_ms", "target_forwards", "lossless_mismatches"):
            assert key in entry, (name, key)
        assert entry["unexplained_mismatches"] == 0
        assert len(entry["tau_per_sample"]) == 2 and entry["tau"] >= 1.0
    assert summary["ar"]["speedup_vs_ar"] == 1.0
    for name in ("dflash_hf", "prompt_lookup"):  # transformers' own loops: no phase times; forwards counted by a hook
        entry = summary[name]
        assert entry["unexplained_mismatches"] == 0 and entry["tokens_per_s"] > 0
        assert 2 <= entry["target_forwards"] <= summary["ar"]["new_tokens"], name  # plain: one forward per token
        steps = entry["target_forwards"] - 2  # tau: the tokens after each prompt's prefill per forward after it
        assert entry["tau"] == pytest.approx((entry["new_tokens"] - 2) / steps) and len(entry["tau_per_sample"]) == 2
    table = (tmp_path / "out.md").read_text()
    assert "| custom | xpress_k4 |" in table and "| custom | ar_static | 1.00 |" in table
    assert "prefill ms | decode tokens/s" in table
    assert "ar_static, dflash_static, xpress_static_k1, xpress_static_k4: static cache, not compiled" in table
    assert result["environment"]["device"] == "cpu"
    # a speculator made here: no folder, drafts from every token
    assert result["environment"]["speculator"] is None and result["environment"]["draft_vocab_size"] is None
    assert "draft vocabulary" not in table
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "acceptance_by_position.png", "accepted_lengths.png", "speedup.png"]


@pytest.mark.parametrize("batch_size", [["1"], ["1", "2"]])
def test_a_target_saved_without_its_tokenizer_runs_with_the_tokenizer_option(tmp_path, batch_size):
    """bench and distill take --tokenizer (before: only calibrate did), for a target folder saved without one; the
    result records it."""
    from conftest import make_target
    from transformers import AutoTokenizer

    from hf_specdiff.cli import main
    from hf_specdiff.embedded import default_target_path

    tokenizer_folder = str(default_target_path())
    vocab_size = len(AutoTokenizer.from_pretrained(tokenizer_folder))
    target = make_target(vocab_size=vocab_size, hidden_size=32, num_layers=2, dtype=torch.float32)
    target.save_pretrained(tmp_path / "target")
    hf_specdiff.AutoSpeculator.from_target(target, block_size=4, num_draft_layers=1, refiner_rank=8,
                                           seed=0).save_pretrained(tmp_path / "speculator")
    prompts = ["--prompts", str(_two_prompts(tmp_path)), "--limit", "0", "--max-new-tokens", "6"]
    main(["bench", "--target", str(tmp_path / "target"), "--tokenizer", tokenizer_folder, "--speculator",
          str(tmp_path / "speculator"), "--methods", "ar", "dflash", "--batch-size", *batch_size,
          "--json", str(tmp_path / "out.json"), *prompts])
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["config"]["tokenizer"] == tokenizer_folder
    summary = result["summary"] if batch_size == ["1"] else result["curve"]["2"]
    assert summary["dflash"]["unexplained_mismatches"] == 0
    main(["distill", "--target", str(tmp_path / "target"), "--tokenizer", tokenizer_folder, "--sources",
          str(_two_prompts(tmp_path)), "--output", str(tmp_path / "answers.jsonl"), "--max-new-tokens", "4"])
    with pytest.raises(ValueError, match="A target given in memory needs its tokenizer: pass tokenizer="):
        run_bench(BenchConfig(prompts=str(_two_prompts(tmp_path)), speculator=str(tmp_path / "speculator"),
                              methods=["ar"], batch_size=[int(size) for size in batch_size]), target=target)
    row = next(json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()
               if json.loads(line).get("prompt") == "What is 12 times 7?")
    assert row["prompt_ids"] == AutoTokenizer.from_pretrained(tokenizer_folder).apply_chat_template(
        [{"role": "user", "content": "What is 12 times 7?"}], add_generation_prompt=True, return_dict=True)["input_ids"]


@pytest.mark.parametrize("batch_size", [[1], [1, 2]])
def test_a_base_model_without_a_chat_template_is_benched_on_plain_text(tmp_path, smollm, batch_size):
    """A base model's tokenizer has no chat template: each prompt is its plain text (before: transformers' error that
    no chat template is set), said in the environment and under the table; still lossless."""
    import copy

    target, tokenizer, speculator = smollm
    base_tokenizer = copy.deepcopy(tokenizer)
    base_tokenizer.chat_template = None
    fed = []
    hook = target.model.register_forward_pre_hook(lambda _, args, kwargs: fed.append(kwargs["input_ids"][-1].tolist()),
                                                  with_kwargs=True)
    try:
        config = BenchConfig(prompts=str(_two_prompts(tmp_path)), limit=0, max_new_tokens=6, device="cpu",
                             methods=["ar", "xpress"], batch_size=batch_size, markdown=str(tmp_path / "out.md"))
        result = run_bench(config, target=target, tokenizer=base_tokenizer, speculator=speculator, progress=False)
    finally:
        hook.remove()
    assert result["environment"]["prompt_format"] == "plain text (no chat template)"
    assert result["config"]["datasets"] == ["custom"]  # where the prompts came from (before: the unused default)
    assert base_tokenizer("Name three primary colours.")["input_ids"] in fed  # a prefill, the last row of its batch
    write_outputs(result, config)
    assert "prompts as plain text (the tokenizer has no chat template)" in (tmp_path / "out.md").read_text()
    summary = result["summary"] if batch_size == [1] else result["curve"]["2"]
    assert summary["xpress"]["unexplained_mismatches"] == 0
    assert _environment(target, BenchConfig(device="cpu"), tokenizer=tokenizer)["prompt_format"] == "chat template"


def test_environment_names_the_speculator_and_its_draft_vocabulary(tmp_path, smollm):
    target, _, speculator = smollm
    speculator.save_pretrained(tmp_path / "speculator")
    write_draft_vocab(tmp_path / "speculator", torch.arange(1000))
    loaded = hf_specdiff.AutoSpeculator.from_pretrained(tmp_path / "speculator")
    env = _environment(target, BenchConfig(device="cpu"), loaded)
    assert env["speculator"] == str(tmp_path / "speculator") and env["draft_vocab_size"] == 1000
    footer = _drafts_per_block({"config": {"num_draft_tokens": 3}, "environment": env, "runs": ["ar", "xpress"]})
    assert footer == (", 3 drafts per block (--num-draft-tokens), drafts read out over a draft vocabulary of "
                      "1,000 tokens")


def test_environment_names_the_cpu_model(smollm):
    # CPU figures depend on the CPU model (the BLAS paths of a few-row forward differ between vendors)
    env = _environment(smollm[0], BenchConfig(device="cpu"))
    assert env["device_name"] == cpu_name()
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
              if line.startswith("model name")] if cpuinfo.exists() else []
    if models:  # x86 Linux names its model; ARM Linux's cpuinfo often has no such line
        assert env["device_name"] == models[0] and env["device_name"] != platform.machine()
    else:
        assert env["device_name"] == (platform.processor() or platform.machine())


def test_environment_records_the_settings_that_change_speed(monkeypatch, smollm):
    # a figure measured with transformers' GQA switch or a thread cap is not comparable with one without: both say so
    for name in ("TRANSFORMERS_SDPA_FORCE_GQA", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    assert _environment(smollm[0], BenchConfig(device="cpu"))["speed_settings"] == {}
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("UNRELATED_SETTING", "x")
    env = _environment(smollm[0], BenchConfig(device="cpu"))
    assert env["speed_settings"] == {"TRANSFORMERS_SDPA_FORCE_GQA": "1", "OMP_NUM_THREADS": "2"}
    assert speed_settings_note(env) == "; set: TRANSFORMERS_SDPA_FORCE_GQA=1, OMP_NUM_THREADS=2"
    assert speed_settings_note({}) == ""  # results written before the settings were recorded


def test_environment_records_whether_the_cpu_loop_packs_its_weights(monkeypatch, smollm):
    # the same bench is twice as fast on one CPU as on another depending on this choice (`_cpu_linear.py`)
    from hf_specdiff import _cpu_linear

    for vendor in ("GenuineIntel", "AuthenticAMD"):
        monkeypatch.setattr(_cpu_linear, "cpu_vendor", lambda: vendor)
        packed = vendor == "GenuineIntel" and torch.backends.mkl.is_available()
        assert _environment(smollm[0], BenchConfig(device="cpu"))["cpu_weights_packed"] is packed


def test_sampled_bench_checks_losslessness_by_log_probability(tmp_path, smollm):
    target, tokenizer, speculator = smollm
    config = BenchConfig(prompts=str(_two_prompts(tmp_path)), limit=0, max_new_tokens=12, jacobi_passes=[1, 4],
                         device="cpu", temperature=0.8,
                         methods=["ar", "dflash", "xpress", "markov", "dflash_static", "xpress_static"])
    result = run_bench(config, target=target, tokenizer=tokenizer, speculator=speculator, progress=False)
    summary = result["summary"]
    for name in SPECULATIVE:
        check = summary[name]["sampling_check"]
        assert check["prompts"] == 2 and 0.0 <= check["p_value"] <= 1.0, name
        assert check["mean_logprob"] <= 0 and check["ar_mean_logprob"] <= 0
        assert check["mean_difference"] == pytest.approx(check["mean_logprob"] - check["ar_mean_logprob"])
        assert "lossless_mismatches" not in summary[name] and "unexplained_mismatches" not in summary[name]
        assert summary[name]["prefill_ms"] > 0
    assert "sampling_check" not in summary["ar"]
    assert not any("mismatch" in r for r in result["records"])
    table = markdown_table(result)
    assert "logprob diff vs ar (p)" in table and "paired sign-flip permutation test" in table


def test_permutation_test_separates_a_shift_from_noise():
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(30, generator=generator)
    same = base + 0.1 * torch.randn(30, generator=generator)  # two draws of one distribution per pair
    other = base + 0.1 * torch.randn(30, generator=generator)
    assert paired_permutation_test(same, other) > 0.05
    assert paired_permutation_test(base, base) == 1.0  # no difference at all
    shifted = base + 0.1 + 0.1 * torch.randn(30, generator=generator)  # negative control: a consistent shift
    p_shift = paired_permutation_test(shifted, base)
    assert p_shift < 0.01
    assert p_shift == paired_permutation_test(shifted, base)  # seeded
    # few pairs: the exact test over all 2^n sign vectors; 3 pairs all of one sign give p = 2/8
    assert paired_permutation_test([1.0, 2.0, 3.0], [0.0, 1.0, 2.0]) == 0.25
    assert paired_permutation_test([], []) == 1.0


def test_markdown_renders_results_of_the_previous_bench_version():
    shipped = Path(__file__).parents[1] / "model_cards/results/smollm2-135m-cpu/earlier_weights/bench.json"
    if not shipped.is_file():
        pytest.skip("shipped bench results not present")
    result = json.loads(shipped.read_text())
    table = markdown_table(result)
    assert "| all | xpress |" in table and "| - | - |" in table and "; set:" not in table
    result["environment"]["speed_settings"] = {"OMP_NUM_THREADS": "2"}  # the footer names a setting a run had
    assert "max_new_tokens 96; set: OMP_NUM_THREADS=2." in markdown_table(result)
    assert "datasets ['gsm8k', 'humaneval', 'mt_bench'], 4 prompts each, max_new_tokens" in table
    result["config"]["limit"] = 100  # more than a set holds, or 0 (all): the footer says how many each gave
    assert "datasets ['gsm8k', 'humaneval', 'mt_bench'], prompts gsm8k: 4, humaneval: 4, mt_bench: 4, max" in \
        markdown_table(result)
    result["config"]["num_draft_tokens"], result["environment"]["draft_vocab_size"] = 3, 8192
    assert "3 drafts per block (--num-draft-tokens), drafts read out over a draft vocabulary of 8,192" in \
        markdown_table(result)
    result["runs"] = ["ar"]  # no method drafted: no note on drafting
    assert "drafts" not in markdown_table(result)


def test_benchmark_sets_load_in_seeded_order():
    try:
        first = load_prompts(BenchConfig(datasets=["gsm8k", "humaneval", "mbpp", "math500", "mt_bench"], limit=2))
    except FileNotFoundError:
        pytest.skip("benchmark data (shared/data) not available")
    again = load_prompts(BenchConfig(datasets=["gsm8k", "humaneval", "mbpp", "math500", "mt_bench"], limit=2))
    assert first == again and len(first) == 10
    assert {d for d, _ in first} == {"gsm8k", "humaneval", "mbpp", "math500", "mt_bench"}


def test_bad_bench_inputs(tmp_path):
    with pytest.raises(ValueError, match="Unknown datasets"):
        load_prompts(BenchConfig(datasets=["imagenet"]))
    bad = tmp_path / "bad.jsonl"
    lines = {'{"text": "hi"}': "needs exactly one of a `prompt` string or a `messages` list",
             '"just a string"': "needs exactly one of",
             '{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}': "needs exactly one of",
             '{"prompt": 5}': "`prompt` must be a string, got int",
             '{"messages": "hi"}': "`messages` must be a non-empty list",
             '{"messages": []}': "`messages` must be a non-empty list",
             '{"messages": [{"role": "assistant", "content": "b"}]}': '`messages` has no turn with role "user"',
             '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}':
                 r"content has \['image_url'\] parts; these prompts are text",
             '{"prompt": "ok"': "is not JSON"}
    for line, message in lines.items():
        bad.write_text('{"prompt": "fine"}\n' + line + "\n")
        with pytest.raises(ValueError, match=f"bad.jsonl:2.*{message}"):
            load_prompts(BenchConfig(prompts=str(bad)))
    bad.write_text("\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        load_prompts(BenchConfig(prompts=str(bad)))
    good = _two_prompts(tmp_path)
    assert len(load_prompts(BenchConfig(prompts=str(good), limit=0))) == 2  # 0: all of them
    assert len(load_prompts(BenchConfig(prompts=str(good), limit=1))) == 1
    # a chat from a data set, its answer included: benched at its last user turn, as distill answers it
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."}]
    good.write_text(json.dumps({"messages": chat}) + "\n")
    assert load_prompts(BenchConfig(prompts=str(good))) == [("custom", chat[:4])]
    # OpenAI's content parts (before: refused), a line apart as OpenAI-compatible servers join them
    parts = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word."}]
    good.write_text(json.dumps({"messages": [{"role": "user", "content": parts}]}) + "\n")
    assert load_prompts(BenchConfig(prompts=str(good))) == [
        ("custom", [{"role": "user", "content": "Name a colour.\nOne word."}])]
    refused = {  # each before any model loads: run_bench is given no model
        "--limit must be >= 0": dict(limit=-1),
        "--temperature must be >= 0": dict(temperature=-0.5),
        "--dtype 'float33' is not a torch dtype": dict(dtype="float33"),
        r"--methods lists \['dflash'\] more than once": dict(methods=["ar", "dflash", "dflash"]),
        r"--datasets lists \['gsm8k'\] more than once": dict(datasets=["gsm8k", "gsm8k"]),
        r"--batch-size lists \[4\] more than once": dict(batch_size=[1, 4, 4]),
        r"--jacobi-passes \[2, 8\] \(xpress, xpress_static\): no method": dict(methods=["ar", "dflash"],
                                                                                  jacobi_passes=[2, 8]),
        "--num-draft-tokens 3 .*no method in --methods": dict(methods=["ar", "prompt_lookup"], num_draft_tokens=3),
        "--compile True .*no method in --methods": dict(methods=["ar", "xpress"], compile=True),
        "--steps, --cache, --base \\(the diffusion methods: .*\\): no method": dict(methods=["ar", "xpress"], steps=4,
                                                                                    cache="none", base="x"),
        r"Unknown methods \['beam'\]": dict(methods=["ar", "beam"]),
        "--max-new-tokens must be >= 1, got 0": dict(max_new_tokens=0),
        r"--jacobi-passes must each be >= 1, got \[0, 4\]": dict(jacobi_passes=[0, 4]),
        "--device 'gpu' is not a torch device": dict(device="gpu"),
        r"--prompts .*prompts.jsonl replaces --datasets \['humaneval'\]: give one": dict(prompts=str(good),
                                                                                   datasets=["humaneval"]),
        # the run's results would be lost at its end
        f"--json {tmp_path}/bad.jsonl/x.json: cannot write there": dict(json=str(tmp_path / "bad.jsonl" / "x.json")),
        f"--markdown {tmp_path}: a folder is there": dict(markdown=str(tmp_path)),
        f"--plots {tmp_path}/bad.jsonl: a file is there": dict(plots=str(tmp_path / "bad.jsonl")),
    }
    if not torch.cuda.is_available():
        refused["--device cuda: this torch .* sees no cuda device; use --device cpu"] = dict(device="cuda")
    for message, options in refused.items():
        with pytest.raises(ValueError, match=message):
            run_bench(BenchConfig(**options), target="not loaded")
    for options in (dict(json=str(tmp_path / "new" / "deeper" / "x.json")), dict(markdown=str(good))):  # to be
        check_bench_config(BenchConfig(**options), METHODS)  # made, or overwritten
    with pytest.raises(ValueError, match="Unknown method 'beam'; choose from ar, ar_static"):
        _method_runs(BenchConfig(methods=["ar", "beam"]), speculator=None, max_cache_len=64)
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        load_prompts(BenchConfig(data_dir=str(tmp_path / "nowhere"), datasets=["gsm8k"]))


def test_phase_times_leave_the_prefill_out_and_a_run_without_steps_has_no_tau():
    """Per-step figures are steady-state: the prefill forward and the first block's drafter pass over the prompt are
    reported apart; a run whose budget the prefill used up has no tau rather than 0."""
    runs = [{"blocks": 3, "draft_seconds": 0.02, "refine_seconds": 0.03, "verify_seconds": 0.3, "target_forwards": 4,
             "prefill_seconds": 1.0, "draft_prefill_seconds": 0.5},
            {"blocks": 0, "draft_seconds": 0.0, "refine_seconds": 0.0, "verify_seconds": 0.0, "target_forwards": 1,
             "prefill_seconds": 0.8, "draft_prefill_seconds": 0.0}]
    times = phase_times(runs)
    assert times["draft_ms"] == pytest.approx(10.0) and times["refine_ms"] == pytest.approx(10.0)
    assert times["verify_ms"] == pytest.approx(100.0) and times["prefill_forward_ms"] == pytest.approx(900.0)
    assert times["draft_prefill_ms"] == pytest.approx(500.0)
    assert phase_times(runs[1:])["verify_ms"] is None and phase_times(runs[1:])["draft_ms"] is None
    assert mean_accepted_length([[3, 1], []]) == 2.0 and mean_accepted_length([[]]) is None


def test_acceptance_by_position_counts_a_stop_on_an_accepted_draft_as_accepted():
    from hf_specdiff.candidates import SpeculationStats

    stats = SpeculationStats(method="dflash")
    stats.add_step([0], emitted=[3], drafted=[7], accepted=[2])  # 2 accepted, rejected at position 2, bonus
    stats.add_step([0], emitted=[4], drafted=[7], accepted=[7])  # all accepted, EOS drafted at position 3: stop
    accepted, offered = stats.accepted_at_position()
    assert offered == [2, 2, 2, 2, 1, 1, 1]
    assert accepted == [2, 2, 1, 1, 0, 0, 0]


def _prompts(tmp_path, questions) -> Path:
    prompts = tmp_path / "batch_prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in questions))
    return prompts


BATCH_QUESTIONS = ["What is 12 times 7?", "Name three primary colours.", "Write a haiku about the sea.",
                   "Why is the sky blue? Answer in one sentence.", "List the first five prime numbers."]


def test_batch_curve_compares_methods_at_each_batch_size(tmp_path, smollm):
    target, tokenizer, _ = smollm
    shipped = hf_specdiff.AutoSpeculator.from_pretrained(hf_specdiff.default_speculator_path())  # rows accept unalike
    config = BenchConfig(prompts=str(_prompts(tmp_path, BATCH_QUESTIONS)), limit=0, max_new_tokens=12, device="cpu",
                         batch_size=[2, 1], methods=["ar", "ar_static", "dflash", "xpress", "markov", "xpress_static"],
                         json=str(tmp_path / "curve.json"), markdown=str(tmp_path / "curve.md"),
                         plots=str(tmp_path / "plots"))
    result = run_bench(config, target=target, tokenizer=tokenizer, speculator=shipped, progress=False)
    write_outputs(result, config)
    saved = json.loads((tmp_path / "curve.json").read_text())
    assert saved["kind"] == "batch_curve" and saved["batch_sizes"] == [1, 2]  # sorted: the curve runs left to right
    assert saved["runs"] == ["ar", "ar_static", "dflash", "xpress", "markov", "xpress_static"]
    for size, used in (("1", 4), ("2", 4)):  # the same prompts at every size: full batches of 2 leave out the fifth
        summary = saved["curve"][size]
        assert summary["ar"]["speedup_vs_ar"] == 1.0 and summary["dflash"]["speedup_vs_dflash"] == 1.0
        # a lone row never waits for another; in a batch, plain generate runs finished rows until the last stops
        assert (summary["ar"]["finished_row_share"] == 0.0 if size == "1"
                else 0.0 <= summary["ar"]["finished_row_share"] < 1)
        for name, entry in summary.items():
            assert entry["prompts"] == used and entry["tokens_per_s"] > 0, (size, name)
            if name != "ar":  # every row equals plain batched generate's row (bar floating-point near-ties)
                assert entry["unexplained_mismatches"] == 0 and "lossless_mismatches" in entry, (size, name)
        for name in ("dflash", "xpress", "markov", "xpress_static"):
            entry = summary[name]
            assert entry["tau"] >= 1.0 and entry["forwards_per_batch"] > 1
            assert entry["draft_ms"] > 0 and entry["verify_ms"] > 0
    assert all(r["stats"]["batch_size"] == r["batch_size"] for r in saved["records"] if "stats" in r)
    for size, prompts in ((1, [0, 1, 2, 3]), (2, [0, 1, 2, 3])):  # every prompt once per method and size
        for name in saved["runs"]:
            rows = [row["prompt"] for r in saved["records"] if (r["batch_size"], r["method"]) == (size, name)
                    for row in r["rows"]]
            assert rows == prompts, (size, name)
    table = (tmp_path / "curve.md").read_text()
    assert ("| 2 | xpress |" in table and "| batch | method | tau |" in table
            and "1: 4, 2: 4; by dataset: custom 4" in table)
    assert "Forward compiled by torch.compile: none. ar_static, xpress_static: static cache" in table  # a CPU
    assert "row-steps spent on rows that had already stopped: 1: 0%, 2: " in table
    assert [p.name for p in (tmp_path / "plots").iterdir()] == ["batch_curve.png"]


def test_every_batch_size_decodes_the_same_prompts_with_every_dataset_alike():
    from hf_specdiff.bench_batched import curve_prompts

    prompts = [("gsm8k", i) for i in range(5)] + [("mbpp", i) for i in range(3)] + [("mt_bench", 0)]
    assert curve_prompts(prompts, [1, 2, 4]) == [("gsm8k", 0), ("mbpp", 0), ("mt_bench", 0), ("gsm8k", 1),
                                                 ("mbpp", 1), ("gsm8k", 2), ("mbpp", 2), ("gsm8k", 3)]
    assert len(curve_prompts(prompts, [1, 3])) == 9  # lcm 3
    assert len(curve_prompts(prompts, [4, 5])) == 5  # lcm 20 > 9 prompts: a multiple of the largest size


def test_sampled_batch_curve_checks_each_row_by_log_probability(tmp_path, smollm):
    target, tokenizer, speculator = smollm
    config = BenchConfig(prompts=str(_prompts(tmp_path, BATCH_QUESTIONS[:2])), limit=0, max_new_tokens=8,
                         device="cpu", batch_size=[2], temperature=0.8, methods=["ar", "xpress"])
    result = run_bench(config, target=target, tokenizer=tokenizer, speculator=speculator, progress=False)
    check = result["curve"]["2"]["xpress"]["sampling_check"]
    assert check["prompts"] == 2 and 0.0 <= check["p_value"] <= 1.0
    assert "lossless_mismatches" not in result["curve"]["2"]["xpress"]
    from hf_specdiff.bench_batched import batch_markdown_table

    assert ("Sampled at temperature 0.8" in batch_markdown_table(result)
            and "test over rows" in batch_markdown_table(result))
    result["config"].update(prompts=None, datasets=["gsm8k"])  # the footer's source, as a run from the sets shows it
    assert "prompts from datasets ['gsm8k'], all prompts, left-padded" in batch_markdown_table(result)  # --limit 0
    result["config"]["limit"] = 10  # a set may hold fewer
    assert "prompts from datasets ['gsm8k'], at most 10 each, left-padded" in batch_markdown_table(result)


def test_batch_curve_refuses_what_it_cannot_measure(tmp_path, smollm):
    target, tokenizer, speculator = smollm
    prompts = str(_prompts(tmp_path, BATCH_QUESTIONS[:3]))
    models = dict(target=target, tokenizer=tokenizer, speculator=speculator, progress=False)
    with pytest.raises(ValueError, match="drop them from --methods, or bench them with --batch-size 1"):
        run_bench(BenchConfig(prompts=prompts, limit=0, batch_size=[1, 4], methods=["ar", "prompt_lookup"]), **models)
    with pytest.raises(ValueError, match="needs at least that many prompts and 3 were loaded: raise --limit"):
        run_bench(BenchConfig(prompts=prompts, limit=0, batch_size=[1, 4], methods=["ar", "xpress"]), **models)
    with pytest.raises(ValueError, match="positive sizes"):
        run_bench(BenchConfig(prompts=prompts, limit=0, batch_size=[0], methods=["ar"]), **models)
    from hf_specdiff.bench_diffusion import run_diffusion_bench

    with pytest.raises(ValueError, match="drop --batch-size"):
        run_diffusion_bench(BenchConfig(methods=["steps"], batch_size=[4]))


@pytest.mark.parametrize("dtype,second,unexplained", [
    (torch.float32, 20.0005, False),  # within --tie-tolerance
    (torch.float32, 20.0625, True),  # half a bf16 step apart: a real difference in float32
    (torch.bfloat16, 20.0625, False),  # in bf16 a logit of 20 rounds to steps of 0.125: a near-tie
    (torch.bfloat16, 21.0, True),  # eight bf16 steps: not rounding
])
def test_a_greedy_divergence_is_a_near_tie_within_the_dtypes_rounding(dtype, second, unexplained):
    """The bench's lossless check: where plain greedy and a method first part, the target's logits for the two tokens
    (plain generate's scores) decide whether rounding explains it, at the precision the target ran in."""
    from types import SimpleNamespace

    from hf_specdiff.bench import _lossless_check

    scores = torch.zeros(3, 8)
    scores[1, 5], scores[1, 6] = second, 20.0  # plain picked 5 at the second new token, the method 6
    reference = SimpleNamespace(sequences=torch.tensor([[9, 1, 5, 2]]), scores=tuple(scores[:, None]))
    out = SimpleNamespace(sequences=torch.tensor([[9, 1, 6, 3]]))
    check = _lossless_check(reference, out, 1, 1e-3, dtype=dtype)
    assert check["mismatch"] and check["first_divergence"] == 1
    assert check["logit_gap"] == pytest.approx(second - 20.0, abs=1e-6)
    assert check["unexplained_mismatch"] == unexplained
    assert _lossless_check(reference, reference, 1, 1e-3, dtype=dtype) == {"mismatch": False,
                                                                          "unexplained_mismatch": False}
