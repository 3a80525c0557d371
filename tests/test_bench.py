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
    from conftest import make_target

    bare = hf_specdiff.AutoSpeculator.from_target(make_target(), block_size=4, num_draft_layers=1, refiner_rank=8)
    bare.refiner = bare.markov_head = None
    bare.save_pretrained(tmp_path / "bare")
    with pytest.raises(ValueError, match=r"--methods \['xpress', 'markov'\] need the speculator's markov_head and "
                       r"refiner, and .*bare has none: drop them \(e.g. --methods ar dflash\)"):  # before: speculation=
        run_bench(BenchConfig(prompts=str(_two_prompts(tmp_path)), speculator=str(tmp_path / "bare"),
                              batch_size=batch_size), progress=False)
    with pytest.raises(ValueError, match="--num-draft-tokens 99: the speculator's blocks of 16 slots offer 1 to 15"):
        run_bench(BenchConfig(prompts=str(_two_prompts(tmp_path)), batch_size=batch_size, methods=["ar", "dflash"],
                              num_draft_tokens=99), progress=False)


@pytest.mark.parametrize("batch_size", [[1], [1, 2]])
def test_a_speculator_for_another_target_without_target_says_to_pass_it(tmp_path, batch_size):
    """--speculator alone benches it on the embedded SmolLM2 (the default --target): a speculator trained for another
    target is refused before any prompt runs, saying to pass --target (before: a bare size mismatch, after the
    warm-up)."""
    from conftest import make_target

    own = hf_specdiff.AutoSpeculator.from_target(make_target(), block_size=4, refiner_rank=8)
    own.save_pretrained(tmp_path / "own")
    config = BenchConfig(prompts=str(_two_prompts(tmp_path)), speculator=str(tmp_path / "own"), batch_size=batch_size,
                         methods=["ar", "dflash"], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"built for hidden size 64, the target has 576.*\n--speculator .*own is not "
                       "for the embedded SmolLM2-135M-Instruct, which runs when no --target is given: pass the target "
                       "it was trained for with --target"):
        run_bench(config, progress=False)


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
    # a config.tokenizer naming a folder without one is said so, for bench and distill alike (before: transformers'
    # "Couldn't instantiate the backend tokenizer", naming neither the folder nor the fix)
    from hf_specdiff.distill import DistillConfig, distill

    with pytest.raises(OSError, match="target.? holds no tokenizer"):
        run_bench(BenchConfig(prompts=str(_two_prompts(tmp_path)), speculator=str(tmp_path / "speculator"),
                              methods=["ar"], tokenizer=str(tmp_path / "target")), target=target)
    with pytest.raises(OSError, match="target.? holds no tokenizer"):
        distill(DistillConfig(sources=[str(_two_prompts(tmp_path))], output=str(tmp_path / "more.jsonl"),
                              tokenizer=str(tmp_path / "target")), target=target, progress=False)
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
             '{"prompt": "ok"': "is not JSON",
             # an answer to nothing (before: benched as if it were one)
             '{"prompt": " \\n"}': "`prompt` is empty, so there is nothing to answer",
             '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, '
             '{"role": "user", "content": ""}]}': "the last user turn is empty"}
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


def _write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_data_dir_needs_only_the_requested_datasets_files(tmp_path):
    """--data-dir with only mt_bench/question.jsonl benches mt_bench (before: refused for having no gsm8k/ folder);
    distill's gsm8k source needs the train split only."""
    from hf_specdiff.distill import DistillConfig, collect_prompts

    data = tmp_path / "dd"
    _write_jsonl(data / "mt_bench" / "question.jsonl", [{"question_id": 81, "turns": ["Write a haiku.", "Again."]}])
    assert load_prompts(BenchConfig(data_dir=str(data), datasets=["mt_bench"])) == [
        ("mt_bench", [{"role": "user", "content": "Write a haiku."}])]
    train = tmp_path / "train_only"
    _write_jsonl(train / "gsm8k" / "train.jsonl", [{"question": "1 + 1?", "answer": "2"}])
    assert collect_prompts(DistillConfig(sources=["gsm8k"], data_dir=str(train))) == [("gsm8k-train-0", "1 + 1?")]


def test_a_set_hf_specdiff_data_without_the_data_is_an_error_not_passed_over(tmp_path, monkeypatch):
    """A $HF_SPECDIFF_DATA that lacks the data used to be skipped for ./shared/data without a word: the results then
    came from data the user had not pointed at."""
    _write_jsonl(tmp_path / "shared" / "data" / "gsm8k" / "test.jsonl", [{"question": "1 + 1?", "answer": "2"}])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("HF_SPECDIFF_DATA", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match=r"\$HF_SPECDIFF_DATA \(.*empty\) has no gsm8k/test\.jsonl: add it "
                                                r"there, or point HF_SPECDIFF_DATA at a folder that has it"):
        load_prompts(BenchConfig(datasets=["gsm8k"]))
    monkeypatch.setenv("HF_SPECDIFF_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"\$HF_SPECDIFF_DATA \(.*nowhere\) is not a folder"):
        load_prompts(BenchConfig(datasets=["gsm8k"]))
    monkeypatch.delenv("HF_SPECDIFF_DATA")  # unset: ./shared/data
    assert load_prompts(BenchConfig(datasets=["gsm8k"])) == [("gsm8k", [{"role": "user", "content": "1 + 1?"}])]


def test_the_result_records_the_data_folder_its_prompts_came_from(tmp_path, smollm):
    target, tokenizer, speculator = smollm
    data = tmp_path / "dd"
    _write_jsonl(data / "mt_bench" / "question.jsonl", [{"question_id": 81, "turns": ["Name a colour."]}])
    config = BenchConfig(data_dir=str(data), datasets=["mt_bench"], limit=1, max_new_tokens=2, methods=["ar"],
                         device="cpu")
    result = run_bench(config, target=target, tokenizer=tokenizer, speculator=speculator, progress=False)
    assert result["environment"]["data_dir"] == str(data.resolve())
    config = BenchConfig(prompts=str(_two_prompts(tmp_path)), limit=1, max_new_tokens=2, methods=["ar"], device="cpu")
    result = run_bench(config, target=target, tokenizer=tokenizer, speculator=speculator, progress=False)
    assert "data_dir" not in result["environment"]  # a --prompts file: the config names it


def test_a_corrupt_or_missing_benchmark_file_is_named(tmp_path):
    """A benchmark file's bad line is named by file:line (before: a bare JSONDecodeError), a missing file by its
    dataset's path with what to do (before: "[Errno 2] No such file or directory")."""
    data = tmp_path / "dd"
    (data / "gsm8k").mkdir(parents=True)
    (data / "gsm8k" / "test.jsonl").write_text('{"question": "1 + 1?"}\n{"question": "2 + 2?",}\n')
    with pytest.raises(ValueError, match=r"gsm8k/test\.jsonl:2 is not JSON \(Expecting property name"):
        load_prompts(BenchConfig(data_dir=str(data), datasets=["gsm8k"]))
    (data / "gsm8k" / "test.jsonl").write_text('{"question": "1 + 1?"}\n{"problem": "2 + 2?"}\n')
    with pytest.raises(ValueError, match=r"gsm8k/test\.jsonl:2 is not a gsm8k row: its prompt's fields are missing; "
                       r'write rows like \{"question": '):  # before: KeyError: 'question', when its turn came
        load_prompts(BenchConfig(data_dir=str(data), datasets=["gsm8k"]))
    (data / "gsm8k" / "test.jsonl").write_text('{"question": "1 + 1?"}\n')
    with pytest.raises(FileNotFoundError, match=r"--data-dir .*dd has no humaneval/test\.jsonl: add it there, or point "
                                                r"--data-dir at a folder that has it\. Or drop that dataset from "
                                                r"--datasets, or pass your own --prompts"):
        load_prompts(BenchConfig(data_dir=str(data), datasets=["gsm8k", "humaneval"]))


def _records(methods, prompts: int, sampled: bool) -> list[dict]:
    """What run_bench records for `prompts` prompts, made up: dflash and xpress with statistics of our loop."""
    records = []
    for index in range(prompts):
        for method in methods:
            record = {"dataset": "custom", "prompt": index, "method": method, "seconds": 0.5, "new_tokens": 8,
                      "compiled": False, "prefill_seconds": 0.1, "first_tokens": 1}
            if sampled:  # each method a little below plain generate on every prompt
                record["mean_logprob"] = -1.0 - 0.1 * index - 0.05 * (method != "ar")
            elif method != "ar":
                record.update(mismatch=False, unexplained_mismatch=False)
            if method in ("dflash", "xpress"):
                record["stats"] = {"accepted_lengths": [3, 2, 2, 1] if method == "dflash" else [4, 3, 1],
                                   "blocks": 4, "draft_seconds": 0.003, "refine_seconds": 0.001,
                                   "verify_seconds": 0.02, "target_forwards": 5, "prefill_seconds": 0.01,
                                   "draft_prefill_seconds": 0.01}
                record["accepted_at_position"] = ([4, 3, 1], [4, 4, 3])
            records.append(record)
    return records


MADE_UP_ENVIRONMENT = {"device": "cpu", "device_name": "a CPU", "dtype": "float32", "torch": "2", "transformers": "5"}


def _made_up_result(methods, prompts: int = 2, temperature: float = 0.0) -> dict:
    from hf_specdiff.bench import recorded_config, summarize

    records = _records(methods, prompts, temperature > 0)
    summary = summarize(records, methods)
    return {"config": recorded_config(BenchConfig(prompts="prompts.jsonl", methods=methods, limit=0,
                                                  temperature=temperature)),
            "environment": MADE_UP_ENVIRONMENT, "runs": methods, "summary": summary, "by_dataset": {"custom": summary},
            "records": records}


def _made_up_curve(methods, prompts: int, temperature: float) -> dict:
    from hf_specdiff.bench import recorded_config
    from hf_specdiff.bench_batched import summarize_curve

    records = [{"batch_size": 1, "first_prompt": index, "method": method, "seconds": 0.5, "new_tokens": 8,
                "rows": [{"prompt": index, "dataset": "custom", "new_tokens": 8,
                          "mean_logprob": -1.0 - 0.1 * index - 0.05 * (method != "ar")}]}
               for index in range(prompts) for method in methods]
    return {"kind": "batch_curve", "config": recorded_config(BenchConfig(prompts="prompts.jsonl", methods=methods,
                                                                         limit=0, temperature=temperature)),
            "environment": MADE_UP_ENVIRONMENT, "runs": methods, "batch_sizes": [1],
            "curve": {"1": summarize_curve(records, methods)},
            "records": records}


def test_a_sampled_run_on_too_few_prompts_says_its_test_cannot_reject():
    """With n prompts the exact permutation test's smallest p-value is 2/2^n (0.25 for 3): below 6 prompts no p can
    fall under 0.05, so a p of 1.00 there is no evidence of losslessness. The JSON and both tables say so."""
    from hf_specdiff.bench_batched import batch_markdown_table

    few = _made_up_result(["ar", "dflash"], prompts=3, temperature=0.8)
    check = few["summary"]["dflash"]["sampling_check"]
    assert check["p_value"] == pytest.approx(0.25) and check["smallest_p_value"] == pytest.approx(0.25)
    assert check["too_few_prompts"].startswith("too few prompts (n=3) for this test to detect a difference")
    assert "use --limit >= 6" in check["too_few_prompts"]
    table = markdown_table(few)
    assert "| -0.050 (p=0.25*) |" in table
    assert "* too few prompts (n=3) for this test to detect a difference" in table and "--limit >= 6" in table
    curve = batch_markdown_table(_made_up_curve(["ar", "dflash"], prompts=2, temperature=0.8))
    assert "(p=0.50*)" in curve and "* too few prompts (n=2)" in curve
    enough = _made_up_result(["ar", "dflash"], prompts=6, temperature=0.8)
    assert enough["summary"]["dflash"]["sampling_check"]["too_few_prompts"] is None
    assert enough["summary"]["dflash"]["sampling_check"]["p_value"] < 0.05
    assert "too few" not in markdown_table(enough) and "*" not in markdown_table(enough)
    assert "too few" not in batch_markdown_table(_made_up_curve(["ar", "dflash"], prompts=6, temperature=0.8))


def test_plots_with_nothing_to_show_are_not_written(tmp_path):
    """--methods ar --plots used to write three empty PNGs (and matplotlib's "No artists with labels" warnings)."""
    import warnings

    from hf_specdiff.bench import plot_results

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert plot_results(_made_up_result(["ar"]), tmp_path / "ar") == []
    assert [str(w.message) for w in caught] == [
        f"--plots {tmp_path / 'ar'}: not written, nothing to show: speedup.png (only ar ran: add another method to "
        "--methods); accepted_lengths.png (no verify step of dflash, xpress, markov or their _static runs: none ran); "
        "acceptance_by_position.png (no draft of dflash, xpress, markov or their _static runs was offered: none ran)."]
    assert not (tmp_path / "ar").exists() or not list((tmp_path / "ar").iterdir())
    with pytest.warns(UserWarning, match=r"not written, nothing to show: accepted_lengths\.png .*none ran\); "
                                         r"acceptance_by_position\.png"):
        written = plot_results(_made_up_result(["ar", "prompt_lookup"]), tmp_path / "lookup")
    assert [p.name for p in written] == ["speedup.png"] and [p.name for p in (tmp_path / "lookup").iterdir()] == [
        "speedup.png"]


def test_plots_have_whole_block_positions_and_histograms_side_by_side(tmp_path, monkeypatch):
    """Block positions are whole numbers (before: ticks at 1.25, 1.5, ...); the histograms of several methods stand
    side by side, opaque (before: overlaid at alpha 0.5, blending into colours no legend entry had)."""
    import matplotlib.figure

    from hf_specdiff.bench import plot_results

    saved = {}
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda figure, path, **kwargs: (saved.__setitem__(Path(path).name, figure),
                                                        save(figure, path, **kwargs)))
    written = plot_results(_made_up_result(["ar", "dflash", "xpress"]), tmp_path)
    assert sorted(p.name for p in written) == ["acceptance_by_position.png", "accepted_lengths.png", "speedup.png"]
    positions = saved["acceptance_by_position.png"].axes[0]
    assert all(float(tick).is_integer() for tick in positions.get_xticks())
    lengths = saved["accepted_lengths.png"].axes[0]
    assert all(float(tick).is_integer() for tick in lengths.get_xticks())
    bars = [(patch.get_x(), patch.get_x() + patch.get_width()) for patch in lengths.patches if patch.get_height() > 0]
    assert len(bars) >= 4 and all(patch.get_alpha() in (None, 1.0) for patch in lengths.patches)
    for i, (left, right) in enumerate(bars):  # no bar drawn over another
        assert all(right <= other_left + 1e-9 or other_right <= left + 1e-9 for other_left, other_right in bars[i + 1:])


def test_the_tables_say_phase_times_are_per_step_and_what_dflash_refines():
    """The batch-1 footer said nothing of the unit of draft / refine / verify ms (the batched one: per batched step),
    nor what dflash, which has no refiner, spends its refine time on."""
    from hf_specdiff.bench_batched import batch_markdown_table

    table = markdown_table(_made_up_result(["ar", "dflash"]))
    assert "Draft, refine and verify ms are per verify step (one drafted block each), in the steady state" in table
    assert "for dflash, which has no refiner, picking each slot's token on its own" in table
    assert "per verify step" not in markdown_table(_made_up_result(["ar", "prompt_lookup"]))  # no phases timed
    curve = batch_markdown_table(_made_up_curve(["ar", "dflash"], prompts=2, temperature=0.8))
    assert "draft, refine and verify ms are per batched step, in the steady state" in curve
    assert "for dflash, which has no refiner, picking" in curve


def test_a_negative_tie_tolerance_or_a_dtype_the_models_do_not_run_in_is_refused_before_any_model_loads(tmp_path):
    from hf_specdiff.bench import torch_dtype
    from hf_specdiff.bench_diffusion import run_diffusion_bench
    from hf_specdiff.distill import DistillConfig, check_distill_config

    with pytest.raises(ValueError, match=r"--tie-tolerance must be >= 0 \(a logit gap; .*\), got -1"):
        run_bench(BenchConfig(tie_tolerance=-1), target="not loaded")
    with pytest.raises(ValueError, match=r"--tie-tolerance must be >= 0"):
        run_diffusion_bench(BenchConfig(methods=["steps"], tie_tolerance=-0.5), model="not loaded")
    refused = r"--dtype 'int8' is not a torch dtype the models run in; use float32, bfloat16 or float16"
    with pytest.raises(ValueError, match=refused):
        run_bench(BenchConfig(dtype="int8", prompts=str(_two_prompts(tmp_path))), target="not loaded")
    with pytest.raises(ValueError, match=refused):
        run_diffusion_bench(BenchConfig(methods=["steps"], dtype="int8"), model="not loaded")
    with pytest.raises(ValueError, match=refused):  # distill and calibrate read --dtype with it too
        check_distill_config(DistillConfig(sources=["gsm8k"], dtype="int8"))
    for name in ("float64", "int8", "float8_e4m3fn"):
        with pytest.raises(ValueError, match=f"--dtype '{name}' is not a torch dtype the models run in"):
            torch_dtype(name)
    assert [torch_dtype(name) for name in ("float32", "bfloat16", "float16")] == [torch.float32, torch.bfloat16,
                                                                                  torch.float16]
