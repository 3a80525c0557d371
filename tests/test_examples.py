"""The examples run: the notebook top to bottom at toy size on the CPU (its code cells, executed in order), and the
GPU reproduction script at smoke size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import require_bench_data, require_cpu_compiler

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_runs_at_toy_size(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_SPECDIFF_NOTEBOOK_SMALL", "1")
    cells = [c for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    namespace: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for cell in cells:
            exec(compile("".join(cell["source"]), f"{NOTEBOOK.name}", "exec"), namespace)
    assert (tmp_path / "runs" / "notebook" / "run" / "speculator" / "config.json").is_file()
    # its toy run warms up over a step (the default 50 would outlast its 6 steps, and warn of it)
    assert not [w for w in caught if "warmup_steps" in str(w.message)]


@pytest.mark.slow
def test_train_your_own_example_runs_without_a_warm_up_longer_than_its_run(tmp_path, monkeypatch, recwarn):
    """`examples/train_your_own.py` (shorter than its 20 steps), with a tiny random target in place of the
    embedded one (its tokenizer kept): distil, train, generate as plain greedy, and no warning that the warm-up
    (before: the default 50 steps) outlasts the run, which told the user to pass a flag the script does not have."""
    import runpy

    from conftest import make_target
    from transformers import AutoTokenizer

    import hf_specdiff
    from hf_specdiff.embedded import default_target_path

    require_bench_data()
    tokenizer = AutoTokenizer.from_pretrained(default_target_path())
    target = make_target(vocab_size=len(tokenizer), hidden_size=16, num_layers=1, dtype=torch.float32,
                         eos_token_id=tokenizer.eos_token_id)
    monkeypatch.setattr(hf_specdiff, "load_default_target", lambda: (target, tokenizer))
    monkeypatch.setattr(sys, "argv", ["train_your_own.py", "--num-prompts", "5", "--steps", "10", "--output-dir",
                                      str(tmp_path)])
    runpy.run_path(str(NOTEBOOK.parent / "train_your_own.py"), run_name="__main__")
    assert (tmp_path / "run" / "speculator" / "config.json").is_file()
    assert not [w for w in recwarn if "warmup_steps" in str(w.message)]



def test_train_your_own_refuses_a_questions_file_without_questions_before_the_target_loads(tmp_path, monkeypatch,
                                                                                            capsys):
    """Before: a --questions file of `prompt` rows (as `hf-specdiff distill` reads) loaded the target, then died with
    a bare KeyError: 'question'."""
    import runpy

    import hf_specdiff

    def load_default_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the questions were read")

    monkeypatch.setattr(hf_specdiff, "load_default_target", load_default_target)
    questions = tmp_path / "prompts.jsonl"
    questions.write_text(json.dumps({"question": "What is 2 + 2?"}) + "\n" + json.dumps({"prompt": "Hi"}) + "\n")
    monkeypatch.setattr(sys, "argv", ["train_your_own.py", "--questions", str(questions), "--output-dir",
                                      str(tmp_path / "out")])
    with pytest.raises(SystemExit):
        runpy.run_path(str(NOTEBOOK.parent / "train_your_own.py"), run_name="__main__")
    assert "prompts.jsonl:2 is not a JSON object with a `question` string" in capsys.readouterr().err


GPU_SCRIPT = NOTEBOOK.parent / "reproduce_on_gpu.sh"


def test_gpu_script_parses():
    subprocess.run(["bash", "-n", str(GPU_SCRIPT)], check=True)


@pytest.mark.parametrize("stage", ["speculator", "speed"])
def test_gpu_script_benches_the_methods_bench_methods_names(tmp_path, stage):
    """BENCH_METHODS replaces the batch-1 bench's methods (a GPU session short of time leaves out the compiled ones);
    unset, the stage benches all of its own. The commands are recorded by stand-ins for `hf-specdiff` and `python`."""
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    for name in ("hf-specdiff", "python"):
        (stand_ins / name).write_text(f'#!/bin/sh\n[ "$1" = -c ] && echo CPU && exit\necho "{name} $*" >> "$LOG"\n')
        (stand_ins / name).chmod(0o755)

    def bench_methods(**env) -> list[list[str]]:
        log = tmp_path / "log.txt"
        log.unlink(missing_ok=True)
        subprocess.run(["bash", str(GPU_SCRIPT), stage, str(tmp_path / "out")], check=True, capture_output=True,
                       env={**os.environ, "PATH": f"{stand_ins}:{os.environ['PATH']}", "LOG": str(log), **env})
        benches = [line.split() for line in log.read_text().splitlines() if line.startswith("hf-specdiff bench")]
        return [words[words.index("--methods") + 1 : words.index("--methods") + 1 + len(words)] for words in benches]

    chosen = bench_methods(BENCH_METHODS="ar dflash xpress")
    assert chosen[0][:4] == ["ar", "dflash", "xpress", "--jacobi-passes" if stage == "speculator" else "--dtype"]
    default = bench_methods()
    assert {"ar_static", "xpress_static", "dflash_hf", "prompt_lookup"} <= set(default[0])
    if stage == "speculator":  # the batch curve keeps its own methods, which CURVE_METHODS replaces
        assert chosen[1][:4] == default[1][:4] == ["ar", "dflash", "xpress", "--dtype"]
        assert bench_methods(CURVE_METHODS="ar ar_static xpress_static")[1][:4] == ["ar", "ar_static", "xpress_static",
                                                                                 "--dtype"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["speculator", "diffusion", "speed"])
def test_gpu_script_runs_end_to_end_at_smoke_size(tmp_path, stage):
    """QUICK=1: every command of the script (train, bench, curve, export / train, export, calibrate, bench, export /
    bench, loop overhead, verify cost) at toy size."""
    require_bench_data()
    if stage == "speed":  # examples/loop_overhead.py compiles on the CPU too
        require_cpu_compiler()
    from hf_specdiff.bench import find_data_dir

    data = find_data_dir(None).resolve()
    if not (data / "distill" / "smollm2-135m-instruct").is_dir():
        pytest.skip("distill corpus (shared/data/distill) not available")
    env = {**os.environ, "QUICK": "1", "HF_SPECDIFF_DATA": str(data)}
    subprocess.run(["bash", str(GPU_SCRIPT), stage, str(tmp_path / "out")], check=True, env=env,
                   capture_output=True)
    out = tmp_path / "out"
    assert (out / "bench.json").is_file() and (out / "commands.txt").is_file()
    if stage == "speculator":
        assert json.loads((out / "curve.json").read_text())["kind"] == "batch_curve"
        assert "| gsm8k | dflash |" in (out / "speculator" / "README.md").read_text()  # the bench's table
    elif stage == "speed":
        assert "xpress_static" in json.loads((out / "bench.json").read_text())["runs"]
        assert "xpress, static + compiled" in (out / "loop_overhead.txt").read_text()
        assert "w2" in (out / "verify_cost.txt").read_text()
    else:
        assert "ar_base" in json.loads((out / "bench.json").read_text())["runs"]
        shipped = out / "diffusion_lm"
        assert (shipped / "spiffy_graph.json").is_file() and "| spiffy |" in (shipped / "README.md").read_text()


def test_linear_cost_prints_one_row_per_layout():
    script = NOTEBOOK.parent / "linear_cost.py"
    out = subprocess.run([sys.executable, str(script), "--rows", "1", "2", "--repeats", "1", "--threads", "1"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].startswith("ms per call, float32, 1 threads") and out[1].split() == ["M=1", "M=2"]
    rows = {line[:34].strip(): [float(v) for v in line[34:].split()] for line in out[2:]}
    assert set(rows) == {"30 layers' projections F.linear", "30 layers' projections (W@x^T)^T",
                         "30 layers' projections packed W", "read-out F.linear", "read-out packed W",
                         "read-out x @ W^T (W^T stored)", "read-out (W @ x^T)^T", "low-rank read-out F.linear",
                         "low-rank read-out (W @ x^T)^T", "draft read-out F.linear", "draft read-out x @ W^T (stored)",
                         "draft read-out (W @ x^T)^T", "draft low-rank F.linear", "draft low-rank x @ W^T (stored)",
                         "draft low-rank (W @ x^T)^T"}
    assert all(len(values) == 2 and (min(values) > 0 or "packed" in name and not torch.backends.mkl.is_available())
               for name, values in rows.items())


@pytest.mark.slow
def test_generate_with_speculator_example_runs():
    """The first example a user runs: the embedded target with the shipped (bf16) speculator, identical to greedy."""
    script = NOTEBOOK.parent / "generate_with_speculator.py"
    out = subprocess.run([sys.executable, str(script), "What is 2+3?", "--max-new-tokens", "12"],
                         capture_output=True, text=True, check=True).stdout
    assert "identical to plain greedy: True" in out and "sampled:" in out


@pytest.mark.slow
def test_continue_a_chat_example_runs():
    """Each later turn continued from the cache the previous one handed back, identical to plain greedy decoding."""
    script = NOTEBOOK.parent / "continue_a_chat.py"
    out = subprocess.run([sys.executable, str(script), "--turns", "Name a prime number.", "Now a larger one.",
                          "And one more?", "--max-new-tokens", "12"], capture_output=True, text=True, check=True).stdout
    assert "later turns: 2, identical to plain greedy: 2/2" in out


@pytest.mark.slow
def test_draft_vocab_ab_reports_coverage_and_every_variant_lossless(tmp_path):
    """The draft vocabulary A/B on the embedded target: coverage of held-out answers, then one row per method and
    vocabulary, each with no output that differs from plain generate's."""
    require_bench_data()
    answers = tmp_path / "answers.jsonl"
    rows = [{"response_ids": [28, 253, 1142, 30, 2] * (1 + i % 3)} for i in range(6)]
    answers.write_text("".join(json.dumps(row) + "\n" for row in rows))
    script = NOTEBOOK.parent / "draft_vocab_ab.py"
    out = subprocess.run([sys.executable, str(script), "--data", str(answers), "--holdout", "2", "--sizes", "3", "64",
                          "--datasets", "gsm8k", "--limit", "1", "--max-new-tokens", "8", "--num-draft-tokens", "3",
                          "--methods", "xpress"],
                         capture_output=True, text=True, check=True).stdout
    assert "answers.jsonl: N=3 0.6000  N=64 1.0000" in out  # 5 tokens, as frequent: the 3 lowest ids, then all
    table = [line.split() for line in out.splitlines() if line.startswith("xpress ")]
    assert [row[1] for row in table] == ["full", "N=3", "N=64"] and all(row[-1] == "0" for row in table)


@pytest.mark.slow
def test_prefill_memory_prints_one_row_per_configuration():
    script = NOTEBOOK.parent / "prefill_memory.py"
    out = subprocess.run([sys.executable, str(script), "--prompt-tokens", "64", "--new-tokens", "2", "--methods", "ar",
                          "xpress", "--caches", "dynamic", "--chunks", "0", "16"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    rows = [line.split() for line in out[2:]]
    assert [row[:3] for row in rows] == [["ar", "dynamic", "-"], ["ar", "dynamic", "16"], ["xpress", "dynamic", "-"],
                                         ["xpress", "dynamic", "16"]]
