"""The command line reads a `--config` file as defaults: every flag given on the command line wins over it, whatever
its spelling, and a bad file fails with a message that says what is wrong."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest

from hf_specdiff.cli import COMMANDS, main, parse_args


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "calibrate.json"
    path.write_text(json.dumps({"limit": 7, "stop_at_eos": True, "datasets": ["gsm8k"], "block_length": 16}))
    return path


def test_config_file_fills_what_the_command_line_leaves_out(config_file):
    args = parse_args(["calibrate", "--config", str(config_file)])
    assert (args.limit, args.stop_at_eos, args.datasets, args.block_length) == (7, True, ["gsm8k"], 16)


@pytest.mark.parametrize("flags,expected", [
    (["--limit", "3"], {"limit": 3}),
    (["--limit=3"], {"limit": 3}),
    (["--no-stop-at-eos"], {"stop_at_eos": False}),
    (["--datasets", "math500", "mbpp"], {"datasets": ["math500", "mbpp"]}),
    (["--block-len", "8"], {"block_length": 8}),  # an abbreviation argparse accepts
    (["--limit", "7"], {"limit": 7}),  # given on purpose with the file's own value
])
def test_flags_win_over_the_config_file(config_file, flags, expected):
    args = parse_args(["calibrate", "--config", str(config_file), *flags])
    assert {name: getattr(args, name) for name in expected} == expected
    untouched = {"limit": 7, "stop_at_eos": True, "datasets": ["gsm8k"], "block_length": 16}
    assert all(getattr(args, name) == value for name, value in untouched.items() if name not in expected)


def test_bad_config_files_are_refused(tmp_path):
    (tmp_path / "unknown.json").write_text(json.dumps({"limt": 3}))
    # what to do, not only what is wrong (before: "unknown options ['limt']")
    with pytest.raises(SystemExit, match=r"unknown options 'limt' \(did you mean 'limit'\?\)\. A file names the "
                       r"options of `hf-specdiff calibrate --help` with _ for -"):
        parse_args(["calibrate", "--config", str(tmp_path / "unknown.json")])
    (tmp_path / "broken.json").write_text("{limit: 3")
    with pytest.raises(SystemExit, match="cannot read it as JSON"):
        parse_args(["bench", "--config", str(tmp_path / "broken.json")])
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(SystemExit, match="expected a JSON object"):
        parse_args(["train", "--config", str(tmp_path / "list.json")])
    with pytest.raises(SystemExit, match="cannot read it as JSON"):
        parse_args(["train", "--config", str(tmp_path / "missing.json")])
    (tmp_path / "string.json").write_text(json.dumps({"data": "answers.jsonl"}))  # would be read letter by letter
    with pytest.raises(SystemExit, match=r"\['data'\] must be JSON lists"):
        parse_args(["train", "--config", str(tmp_path / "string.json")])
    (tmp_path / "sources.json").write_text(json.dumps({"sources": "p.jsonl"}))  # the example names the field given
    with pytest.raises(SystemExit, match=r"\['sources'\] must be JSON lists, e.g. \"sources\": \[\"p.jsonl\"\]\."):
        parse_args(["distill", "--config", str(tmp_path / "sources.json")])
    (tmp_path / "lists.json").write_text(json.dumps({"data": ["a.jsonl"], "target_layer_ids": None}))
    assert parse_args(["train", "--config", str(tmp_path / "lists.json")]).data == ["a.jsonl"]


@pytest.mark.parametrize("values,message", [
    ({"compile": "false"}, "compile must be true or false"),  # a string would be truthy
    ({"limit": 2.5}, "limit must be an integer"),  # would be taken as given
    ({"limit": True}, "limit must be an integer"),
    ({"batch_size": [1, 2.0]}, "batch_size must be an integer"),
    ({"temperature": "0.7"}, "temperature must be a number"),
    ({"num_draft_tokens": 2.5}, "num_draft_tokens must be an integer"),  # an optional field is checked too
    ({"cache": "full"}, r"cache must be one of \['none', 'prefix', 'dual', 'block'\]"),  # argparse's choices skip it
    ({"datasets": ["gsm8k", "gsm9k"]}, "datasets must be one of"),
    ({"json": 5}, "json must be a string, got 5"),  # a path: would fail only when the results are written
    ({"target": ["a", "b"]}, r"target takes one value, got the list \['a', 'b'\]"),
    ({"limit": [1, 2]}, "limit takes one value"),
])
def test_config_values_of_the_wrong_type_are_refused(tmp_path, values, message):
    (tmp_path / "bench.json").write_text(json.dumps(values))
    with pytest.raises(SystemExit, match=message):
        parse_args(["bench", "--config", str(tmp_path / "bench.json")])


def test_config_values_of_the_right_type_pass(tmp_path):
    (tmp_path / "bench.json").write_text(json.dumps({"compile": False, "temperature": 1, "batch_size": [1, 4]}))
    args = parse_args(["bench", "--config", str(tmp_path / "bench.json")])
    assert (args.compile, args.temperature, args.batch_size) == (False, 1, [1, 4])


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_of_every_command_says_what_it_does(command, capsys):
    """`hf-specdiff COMMAND --help` explains each option: a dataclass field's help is its `metadata["help"]`."""
    parser = argparse.ArgumentParser()
    COMMANDS[command][1](parser)
    for action in parser._actions:
        described = re.sub(r"\s*\(default: .*\)$", "", action.help or "", flags=re.S)
        assert described.strip(), f"hf-specdiff {command} {'/'.join(action.option_strings)} has no help text"
    with pytest.raises(SystemExit) as exit:
        main([command, "--help"])  # argparse renders every help text (a stray % would fail here)
    assert exit.value.code == 0
    shown = re.sub(r"\s", "", capsys.readouterr().out)  # argparse wraps lines, also at hyphens
    for action in parser._actions:
        assert re.sub(r"\s", "", action.help.replace("%%", "%")) in shown


def test_the_help_of_a_dataclass_option_gives_its_default_once(capsys):
    """Python 3.10's BooleanOptionalAction appends a default of its own to the help it is given."""
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--stop-at-eos, --no-stop-at-eos stop after the first block" in shown
    assert "produced an EOS token (default: True)" in shown and "(default: True) (default: True)" not in shown


def test_an_optional_option_takes_none_and_others_do_not():
    """`none` stands for the "None: ..." a help text describes, where the field allows None."""
    assert parse_args(["train", "--init-from-target-layer", "none"]).init_from_target_layer is None
    assert parse_args(["train", "--init-from-target-layer", "3"]).init_from_target_layer == 3
    assert parse_args(["bench", "--num-draft-tokens", "None"]).num_draft_tokens is None
    with pytest.raises(SystemExit):
        parse_args(["bench", "--limit", "none"])  # argparse: "invalid int value: 'none'"


def test_choices_are_offered_and_checked(capsys):
    with pytest.raises(SystemExit):
        parse_args(["train", "--mixed-precision", "fp8"])
    assert "invalid choice: 'fp8' (choose from" in capsys.readouterr().err
    assert parse_args(["train-diffusion", "--finetune", "full"]).finetune == "full"
    assert parse_args(["calibrate", "--cache", "dual"]).cache == "dual"


def test_demo_reads_the_speculator_before_loading_the_target(tmp_path, monkeypatch):
    import hf_specdiff

    monkeypatch.setattr(hf_specdiff, "load_default_target", lambda **_: pytest.fail("the target loaded first"))
    with pytest.raises(OSError, match="the folder has no config.json"):
        main(["demo", "--speculator", str(tmp_path), "--device", "cpu"])
    with pytest.raises(SystemExit, match="--num-draft-tokens 20: the speculator's blocks of 16 slots offer 1 to 15"):
        main(["demo", "--num-draft-tokens", "20", "--device", "cpu"])


def test_demo_refuses_the_other_modes_flags():
    from hf_specdiff.cli import main

    with pytest.raises(SystemExit, match="--model, --threshold apply to `hf-specdiff demo --diffusion` only"):
        main(["demo", "--threshold", "0.5", "--model", "x"])
    with pytest.raises(SystemExit, match="--threshold applies to `hf-specdiff demo --diffusion` only: add --diffusion "
                       "or drop it"):
        main(["demo", "--threshold", "0.5"])
    with pytest.raises(SystemExit, match="--speculator and --num-draft-tokens are for the speculative demo"):
        main(["demo", "--diffusion", "--speculator", "x"])
    with pytest.raises(SystemExit, match="--speculator and --num-draft-tokens are for the speculative demo"):
        main(["demo", "--diffusion", "--num-draft-tokens", "3"])


def test_calibrate_reads_its_prompts_before_loading_the_model(tmp_path):
    """A wrong dataset, prompts file or dtype fails in seconds, before the (missing) model would load; --prompts
    exists."""
    from hf_specdiff.cli import main

    missing_model = ["calibrate", "--model", str(tmp_path / "no-model")]
    with pytest.raises(ValueError, match="Unknown datasets \\['bogus'\\].*--prompts FILE.jsonl"):
        main(missing_model + ["--datasets", "bogus"])
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "Hi"}\n{"prompt": 3}\n')
    with pytest.raises(ValueError, match="prompts.jsonl:2"):
        main(missing_model + ["--prompts", str(tmp_path / "prompts.jsonl")])
    with pytest.raises(ValueError, match="--prompts .*prompts.jsonl replaces --datasets \\['gsm8k'\\]: give one"):
        main(missing_model + ["--prompts", str(tmp_path / "prompts.jsonl"), "--datasets", "gsm8k"])
    with pytest.raises(ValueError, match="--dtype 'fp16' is not a torch dtype; use float32, bfloat16 or float16"):
        main(missing_model + ["--dtype", "fp16"])
    with pytest.raises(ValueError, match="num_nodes must be an integer >= 1, got 0"):
        main(missing_model + ["--num-nodes", "0"])
    (tmp_path / "empty").mkdir()  # before: said to hold no tokenizer, and to save one there
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "Hi"}\n')
    with pytest.raises(OSError, match="No diffusion LM at .*empty.: the folder has no config.json. Point --model at"):
        main(["calibrate", "--model", str(tmp_path / "empty"), "--prompts", str(tmp_path / "prompts.jsonl")])


def test_calibrate_defaults_to_the_shipped_diffusion_lm(tmp_path, monkeypatch):
    """As bench and demo --diffusion do; before, "--model is required" (without the usual `hf-specdiff:` form)."""
    import hf_specdiff
    from hf_specdiff.diffusion import AutoDiffusionLM

    class Loaded(Exception):
        pass

    def load(path, **_):
        raise Loaded(str(path))

    assert parse_args(["calibrate"]).model is None
    monkeypatch.setattr(AutoDiffusionLM, "from_pretrained", load)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "Hi"}\n')
    with pytest.raises(Loaded, match=f"^{hf_specdiff.default_diffusion_lm_path()}$"):
        main(["calibrate", "--prompts", str(tmp_path / "prompts.jsonl")])


def test_calibrate_takes_no_option_it_would_ignore(capsys):
    """Calibration records ordinary decoding: Spiffy's --max-drafts belongs to the bench and generate."""
    assert parse_args(["bench", "--max-drafts", "3"]).max_drafts == 3
    with pytest.raises(SystemExit):
        parse_args(["calibrate", "--max-drafts", "3"])
    assert "unrecognized arguments: --max-drafts 3" in capsys.readouterr().err


def test_the_console_entry_point_prints_a_users_mistake_on_one_line(monkeypatch):
    from hf_specdiff.cli import console_main

    monkeypatch.delenv("HF_SPECDIFF_TRACEBACK", raising=False)
    with pytest.raises(SystemExit, match=r"^hf-specdiff: ValueError: Unknown datasets \['bogus'\]"):
        console_main(["calibrate", "--model", "x", "--datasets", "bogus"])
    monkeypatch.setenv("HF_SPECDIFF_TRACEBACK", "1")  # the traceback, for a bug report
    with pytest.raises(ValueError, match="Unknown datasets"):
        console_main(["calibrate", "--model", "x", "--datasets", "bogus"])


def test_help_and_import_do_not_load_torch():
    """`import hf_specdiff` and `hf-specdiff --help` answer at once: torch and transformers load on first use."""
    import subprocess

    script = ("import contextlib, io, sys, hf_specdiff, hf_specdiff.cli\n"
              "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:\n"
              "    hf_specdiff.cli.main(['--help'])\n"
              "assert 'bench' in out.getvalue() and 'calibrate' in out.getvalue(), out.getvalue()\n"
              "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_version_is_the_installed_packages(capsys):
    """`hf-specdiff --version`, `hf_specdiff.__version__` and the installed metadata agree (pyproject reads it)."""
    import importlib.metadata

    import hf_specdiff

    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0 and capsys.readouterr().out.strip() == f"hf-specdiff {hf_specdiff.__version__}"
    assert importlib.metadata.version("hf_specdiff") == hf_specdiff.__version__


def test_python_dash_m_runs_the_command_line():
    import subprocess

    import hf_specdiff

    result = subprocess.run([sys.executable, "-m", "hf_specdiff", "--version"], capture_output=True, text=True,
                            timeout=120)
    assert (result.returncode, result.stdout.strip()) == (0, f"hf-specdiff {hf_specdiff.__version__}")
    result = subprocess.run([sys.executable, "-m", "hf_specdiff", "bench", "--limit", "-1"], capture_output=True,
                            text=True, timeout=300)
    # the user's mistake on one line, the last (libraries may print before it on import: torchao with a CPU torch
    # reports the CUDA kernels it cannot load)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1].startswith("hf-specdiff: ValueError: --limit must be >= 0")


def test_every_public_name_resolves_to_its_module():
    import importlib

    import hf_specdiff

    for name in hf_specdiff.__all__:
        module = importlib.import_module(f"hf_specdiff.{hf_specdiff._MODULE_OF[name]}")
        assert getattr(hf_specdiff, name) is getattr(module, name)
        assert name in dir(hf_specdiff)
    assert set(hf_specdiff.__all__) == set(hf_specdiff._MODULE_OF)
    with pytest.raises(AttributeError, match="has no attribute 'DFlashDrafter'"):
        hf_specdiff.DFlashDrafter


@pytest.mark.parametrize("name", ["smollm2-135m-cpu.json", "smollm2-135m-gpu.json", "smollm2-135m-diffusion-cpu.json",
                                  "smollm2-135m-diffusion-gpu.json"])
def test_example_training_configs_pass_the_command_lines_checks(name):
    """examples/configs/*.json as `hf-specdiff train[-diffusion] --config` reads them: typed, and each value lands."""
    from hf_specdiff.cli import _dataclass_from_args
    from hf_specdiff.diffusion.training import DiffusionTrainConfig
    from hf_specdiff.training import TrainConfig

    path = Path(__file__).parents[1] / "examples" / "configs" / name
    command, config_class = ("train-diffusion", DiffusionTrainConfig) if "diffusion" in name else ("train", TrainConfig)
    config = _dataclass_from_args(config_class, parse_args([command, "--config", str(path)]))
    assert {key: getattr(config, key) for key in json.loads(path.read_text())} == json.loads(path.read_text())


@pytest.mark.slow
def test_demo_streams_the_answer_and_finds_all_three_outputs_identical(capsys):
    """README's first command: the embedded target and the shipped speculator, 3 drafts per block on the CPU."""
    from hf_specdiff.cli import DEMO_PROMPT, main

    main(["demo", "--max-new-tokens", "24", "--device", "cpu"])
    out = capsys.readouterr().out
    table = out[out.index("identical to plain greedy") :].splitlines()[1:4]
    assert [line.split()[0] for line in table] == ["plain", "dflash", "xpress"]
    assert all(line.split()[-1] == "yes" for line in table), out
    assert "(cpu, torch.float32, 3 drafts per block" in out
    answer = out[out.index(DEMO_PROMPT) + len(DEMO_PROMPT) : out.index("method ")]
    assert len(answer.split()) > 10  # the streamed answer (24 tokens), between the prompt and the table


def test_demo_tells_a_floating_point_near_tie_from_a_mismatch():
    """The demo's "identical to plain greedy" cell: yes; a near-tie where plain generate's own top two logits are
    within rounding of each other (a verify forward over several tokens may round to the other one); NO otherwise."""
    from types import SimpleNamespace

    import torch

    from hf_specdiff.bench import _lossless_check
    from hf_specdiff.cli import identical_verdict

    prompt = [7, 8]
    scores = [torch.tensor([[0.0, 16.444538, 16.444536, 3.0]]), torch.tensor([[0.0, 1.0, 9.0, 2.0]])]
    plain = SimpleNamespace(sequences=torch.tensor([prompt + [1, 2]]), scores=scores)

    def check(tokens):
        return _lossless_check(plain, SimpleNamespace(sequences=torch.tensor([prompt + tokens])), len(prompt),
                               tolerance=1e-3)

    assert identical_verdict(check([1, 2])) == "yes"
    assert identical_verdict(check([2, 2])) == "near-tie at token 1 (logits 1.9e-06 apart)"
    assert identical_verdict(check([1, 3])) == "NO"  # 9.0 against 2.0: the target never chose 3
    assert identical_verdict(check([1])) == "NO"  # stopped early with the same tokens: no tie explains it
