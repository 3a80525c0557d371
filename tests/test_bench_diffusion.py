"""`hf-specdiff bench` for diffusion LMs: NFE, speed, accuracy and Spiffy losslessness, on real prompts with a small
random model; and the accuracy scorers."""

from __future__ import annotations

import json

import torch
from conftest import require_bench_data, small_dlm_with_smollm_tokenizer

from hf_specdiff.bench import BenchConfig, load_rows
from hf_specdiff.bench_diffusion import _rows_not_used_for_calibration, score
from hf_specdiff.cli import main
from hf_specdiff.spiffy import DraftGraph


def test_diffusion_bench_end_to_end(tmp_path):
    require_bench_data()
    small_dlm_with_smollm_tokenizer(tmp_path / "dlm")
    main(["calibrate", "--model", str(tmp_path / "dlm"), "--output", str(tmp_path / "dlm"), "--limit", "2",
          "--max-new-tokens", "16", "--block-length", "8", "--cache", "dual", "--num-nodes", "8"])
    main(["bench", "--target", str(tmp_path / "dlm"), "--datasets", "gsm8k", "mbpp", "--limit", "2",
          "--methods", "steps", "threshold", "spiffy", "spiffy_threshold", "--max-new-tokens", "16",
          "--block-length", "8", "--threshold", "0.05", "--json", str(tmp_path / "out.json"),
          "--markdown", str(tmp_path / "out.md"), "--plots", str(tmp_path / "plots")])
    result = json.loads((tmp_path / "out.json").read_text())
    summary = result["summary"]
    assert result["runs"] == ["steps", "threshold", "spiffy", "spiffy_threshold"]
    assert summary["steps"]["nfe"] == 16 and summary["steps"]["nfe_reduction_vs_steps"] == 1.0
    for name in ("spiffy", "spiffy_threshold"):
        assert summary[name]["lossless_mismatches"] == 0 and summary[name]["exact"]
        assert summary[name]["nfe"] <= summary[name.replace("spiffy_", "").replace("spiffy", "steps")]["nfe"]
    assert set(result["by_dataset"]) == {"gsm8k", "mbpp"}
    assert all(r["correct"] in (True, False) for r in result["records"])
    assert "| all | spiffy |" in (tmp_path / "out.md").read_text()
    assert (tmp_path / "plots" / "nfe.png").is_file()

    graph = DraftGraph.from_pretrained(tmp_path / "dlm")
    calibration = {json.dumps(r, sort_keys=True) for _, r in load_rows(BenchConfig(
        datasets=["math500", "mbpp"], limit=2, seed=graph.calibration["prompt_seed"]))}
    measured = _rows_not_used_for_calibration(BenchConfig(datasets=["mbpp", "math500"], limit=30), graph)
    assert len(measured) == 60 and not calibration & {json.dumps(r, sort_keys=True) for _, r in measured}


def test_diffusion_demo(tmp_path, capsys):
    small_dlm_with_smollm_tokenizer(tmp_path / "dlm")
    from hf_specdiff.diffusion import AutoDiffusionLM
    from hf_specdiff.diffusion.decoding import DiffusionGenerationConfig
    from hf_specdiff.spiffy import calibrate

    model = AutoDiffusionLM.from_pretrained(tmp_path / "dlm")
    prompts = [torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    calibrate(model, prompts, DiffusionGenerationConfig(max_new_tokens=16, block_length=8, cache="dual"),
              num_nodes=8, progress=False).save_pretrained(tmp_path / "dlm")
    main(["demo", "--diffusion", "--model", str(tmp_path / "dlm"), "--max-new-tokens", "16", "--block-length", "8",
          "--threshold", "0.05", "--device", "cpu"])
    printed = capsys.readouterr().out
    assert printed.count("block 0 |") >= 2 and "\u2591" in printed  # the block fills in over several forwards
    assert printed.count("  yes") == 2 and "NO" not in printed


def test_accuracy_scorers():
    assert score("gsm8k", {"answer": "... #### 1,234"}, "So the total is 1234.")
    assert not score("gsm8k", {"answer": "#### 18"}, "She makes 16 dollars, then 2 more: 19")
    assert score("math500", {"answer": "\\frac{1}{2}"}, "Thus $\\boxed{\\dfrac{1}{2}}$.")
    assert not score("math500", {"answer": "3"}, "no boxed answer 3")
    assert score("mbpp", {}, "```python\ndef f(x):\n    return x\n```")
    assert not score("humaneval", {}, "def f(x) return x")
    assert score("mt_bench", {}, "anything") is None
