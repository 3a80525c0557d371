"""The benchmark harness on the embedded real target: every field the JSON promises, losslessness checked."""

from __future__ import annotations

import json

import pytest

import hf_specdiff
from hf_specdiff.bench import BenchConfig, load_prompts, markdown_table, run_bench, write_outputs


@pytest.fixture(scope="module")
def smollm():
    target, tokenizer = hf_specdiff.load_default_target()
    return target, tokenizer, hf_specdiff.AutoSpeculator.from_target(target, seed=0)


def test_bench_reports_every_method_side_by_side(tmp_path, smollm):
    target, tokenizer, speculator = smollm
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "What is 12 times 7?"}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Name three primary colours."}]}) + "\n"
    )
    config = BenchConfig(prompts=str(prompts), limit=0, max_new_tokens=12, jacobi_passes=[1, 4], device="cpu",
                         methods=["ar", "dflash", "xpress", "markov", "dflash_hf", "prompt_lookup"],
                         json=str(tmp_path / "out.json"), markdown=str(tmp_path / "out.md"), plots=str(tmp_path / "plots"))
    result = run_bench(config, target=target, tokenizer=tokenizer, speculator=speculator, progress=False)
    write_outputs(result, config)
    assert result["runs"] == ["ar", "dflash", "xpress_k1", "xpress_k4", "markov", "dflash_hf", "prompt_lookup"]
    summary = json.loads((tmp_path / "out.json").read_text())["summary"]
    for name in ("dflash", "xpress_k1", "xpress_k4", "markov"):
        entry = summary[name]
        for key in ("tau", "tau_per_sample", "tokens_per_s", "speedup_vs_ar", "accept_rate_by_position",
                    "draft_ms", "refine_ms", "verify_ms", "target_forwards", "lossless_mismatches"):
            assert key in entry, (name, key)
        assert entry["unexplained_mismatches"] == 0
        assert len(entry["tau_per_sample"]) == 2 and entry["tau"] >= 1.0
    assert summary["ar"]["speedup_vs_ar"] == 1.0
    for name in ("dflash_hf", "prompt_lookup"):  # transformers' own methods: speed and losslessness only
        assert summary[name]["unexplained_mismatches"] == 0 and summary[name]["tokens_per_s"] > 0
    assert "| custom | xpress_k4 |" in (tmp_path / "out.md").read_text()
    assert result["environment"]["device"] == "cpu"
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "acceptance_by_position.png", "accepted_lengths.png", "speedup.png"]


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
    bad.write_text('{"text": "hi"}\n')
    with pytest.raises(ValueError, match="needs a `prompt` string or a `messages` list"):
        load_prompts(BenchConfig(prompts=str(bad)))
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        load_prompts(BenchConfig(data_dir=str(tmp_path / "nowhere"), datasets=["gsm8k"]))
