"""`hf-specdiff` command line: distill, train, train-diffusion, bench, demo, export, calibrate, draft-vocab. Options
mirror the dataclasses they fill (one default each)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import sys
import typing

from . import __version__
from ._hub import can_only_be_a_path, share_like_umask


def _add_dataclass_arguments(parser: argparse.ArgumentParser, cls, exclude: tuple[str, ...] = (),
                             defaults: dict | None = None) -> None:
    """One `--field-name` per dataclass field (but those in `exclude`, which keep their defaults), its help from the
    field's `metadata["help"]` (as transformers' HfArgumentParser reads it) and its choices from
    `metadata["choices"]`; lists take several values; an optional field takes `none`; a JSON `--config` file sets
    defaults. `defaults`: the command's own defaults for some fields, shown in their help."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = bool(args) and type(None) in args
        base = next(a for a in args if a is not type(None)) if optional else hint
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        default = (defaults or {}).get(f.name, default)
        shown = f"{f.metadata['help']} (default: {default})" if default != "" else f.metadata["help"]
        described = shown.replace("%", "%%")  # argparse %-formats help
        if typing.get_origin(base) is list:
            item = typing.get_args(base)[0]
            parser.add_argument(flag, nargs="+", type=item, default=default, choices=f.metadata.get("choices"),
                                help=described)
        elif base is bool:
            action = parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
            action.help = described  # set after: Python 3.10's BooleanOptionalAction appends its own default
        else:
            parser.add_argument(flag, type=_or_none(base) if optional else base, default=default,
                                choices=f.metadata.get("choices"), help=described)


def _or_none(convert):
    """An argparse type for an optional field: `none` gives None (the field's "None: ..." meaning), anything else
    `convert(text)`."""
    def parse(text: str):
        return None if text.lower() == "none" else convert(text)

    parse.__name__ = convert.__name__  # argparse names it in "invalid int value: 'x'"
    parse.__wrapped__ = convert  # what `_check_config_types` checks a config file's value against
    return parse


def _dataclass_from_args(cls, args: argparse.Namespace):
    """`cls` from the parsed options; a field the command has no option for keeps its default."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name in vars(args)})


def _parse(parser: argparse.ArgumentParser, subparsers: dict, argv: list[str] | None) -> argparse.Namespace:
    """Parse twice when a command was given `--config FILE`: the file's values become the command's defaults, so any
    flag on the command line (`--x`, `--no-x`, `--x=v`, an abbreviation) wins over the file."""
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        try:
            with open(args.config) as file:
                from_file = json.load(file)
        except (OSError, json.JSONDecodeError) as error:
            raise SystemExit(f"--config {args.config}: cannot read it as JSON ({error}).") from error
        if not isinstance(from_file, dict):
            raise SystemExit(f"--config {args.config}: expected a JSON object of option names and values.")
        unknown = set(from_file) - set(vars(args))  # a command may fill several dataclasses from one file
        if unknown:
            import difflib

            known = sorted(set(vars(args)) - {"command", "config"})
            hints = [f"{name!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(name, known, 1))
                     else repr(name) for name in sorted(unknown)]
            raise SystemExit(f"{args.config}: unknown options {', '.join(hints)}. A file names the options of "
                             f"`hf-specdiff {args.command} --help` with _ for - (e.g. \"max_new_tokens\").")
        lists = {action.dest for action in subparsers[args.command]._actions if action.nargs in ("*", "+")}
        not_lists = sorted(name for name in lists & set(from_file)
                           if not isinstance(from_file[name], (list, type(None))))
        if not_lists:  # a string would be read one character at a time
            raise SystemExit(f"{args.config}: {not_lists} must be JSON lists, e.g. \"{not_lists[0]}\": "
                             f"{json.dumps([from_file[not_lists[0]]])}.")
        _check_config_types(args.config, subparsers[args.command], from_file)
        subparsers[args.command].set_defaults(**from_file)
        args = parser.parse_args(argv)
    return args


def _check_config_types(path: str, parser: argparse.ArgumentParser, values: dict) -> None:
    """A `--config` value skips argparse's conversion and choices, so check it here: "false" for a boolean would be
    truthy, 8.5 for an integer would be taken as given, and a value outside the choices would fail only later."""
    actions = {action.dest: action for action in parser._actions}
    for name, value in values.items():
        action = actions.get(name)
        if action is None or value is None:
            continue
        if isinstance(value, list) and action.nargs in (None, 0):
            raise SystemExit(f"{path}: {name} takes one value, got the list {value!r}.")
        items = value if isinstance(value, list) else [value]
        kind = inspect.unwrap(action.type) if action.type else None
        if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
            expected, ok = "true or false (JSON, unquoted)", isinstance(value, bool)
        elif kind in (int, float):
            kinds = (int,) if kind is int else (int, float)
            expected = ("an integer" if kind is int else "a number") + " (JSON, unquoted)"
            ok = all(isinstance(item, kinds) and not isinstance(item, bool) for item in items)
        elif action.choices is not None:
            expected, ok = f"one of {list(action.choices)}", all(item in action.choices for item in items)
        elif kind in (None, str):  # paths, names: 5 for an output folder would fail deep in the run
            expected, ok = "a string" + (" or a list of strings" if action.nargs else ""), all(
                isinstance(item, str) for item in items)
        else:
            continue
        if not ok:
            raise SystemExit(f"{path}: {name} must be {expected}, got {value!r}.")


DEMO_PROMPT = (
    "A baker makes 24 muffins in the morning and 18 in the afternoon. She sells 30 of them. "
    "How many muffins are left? Explain step by step."
)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Drafts per block in the demo on a CPU, where a verify forward's cost grows with its width: 3 measured best there
# (xpress 1.19x of plain generate against 0.62x with all 15: `model_cards/results/smollm2-135m-cpu/cpu_few_row_layout`).
# Elsewhere the forward costs about the same for 1 and 16 tokens, and every draft is offered.
CPU_DEMO_DRAFTS = 3


def demo(prompt: str, max_new_tokens: int, speculator_path: str | None, device: str,
         num_draft_tokens: int | None = None) -> None:
    """The embedded target and its shipped speculator: stream an answer, then compare methods (greedy)."""
    import torch
    from transformers import TextStreamer

    import hf_specdiff

    from .bench import BenchConfig, _lossless_check, timed_generate

    speculator = hf_specdiff.AutoSpeculator.from_pretrained(speculator_path or hf_specdiff.default_speculator_path())
    block_size = speculator.drafter.config.block_size
    if num_draft_tokens is not None and not 1 <= num_draft_tokens < block_size:  # before the target loads
        raise SystemExit(f"--num-draft-tokens {num_draft_tokens}: the speculator's blocks of {block_size} slots offer "
                         f"1 to {block_size - 1} drafts.")
    print("Loading SmolLM2-135M-Instruct (embedded; the first run dequantizes it once) ...", flush=True)
    target, tokenizer = hf_specdiff.load_default_target(device=device)
    hf_specdiff.enable(target)
    speculator = speculator.to(device=device, dtype=target.dtype)
    if num_draft_tokens is None and torch.device(device).type == "cpu":
        num_draft_tokens = CPU_DEMO_DRAFTS
    drafts = num_draft_tokens or block_size - 1
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True).to(device)
    print(f"\n> {prompt}\n")
    target.generate(**inputs, assistant_model=speculator, speculation="xpress", num_draft_tokens=num_draft_tokens,
                    max_new_tokens=max_new_tokens, do_sample=False,
                    streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))

    rows, reference, prompt_length = [], None, inputs["input_ids"].shape[1]
    for method in (None, "dflash", "xpress"):
        kwargs = {}
        if method:
            kwargs = dict(assistant_model=speculator, speculation=method, num_draft_tokens=num_draft_tokens)
        target.generate(**inputs, max_new_tokens=8, do_sample=False, **kwargs)  # warm-up
        # plain generate's scores tell a floating-point near-tie from a real mismatch, as in `hf-specdiff bench`
        out, seconds = timed_generate(target, **inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                      return_dict_in_generate=True, output_scores=method is None, **kwargs)
        new = out.sequences.shape[1] - prompt_length
        reference = out if reference is None else reference
        tau = out.speculation.tau if method else 1.0
        check = _lossless_check(reference, out, prompt_length, BenchConfig.tie_tolerance, dtype=target.dtype)
        rows.append((method or "plain", new / seconds, tau, check))
    base = rows[0][1]
    print(f"\n{'method':<8} {'tokens/s':>9} {'tau':>6} {'speedup':>8}  identical to plain greedy")
    for name, speed, tau, check in rows:
        print(f"{name:<8} {speed:>9.1f} {tau:>6.2f} {speed / base:>7.2f}x  {identical_verdict(check)}")
    print(f"({device}, {target.dtype}, {drafts} drafts per block (--num-draft-tokens); tau = tokens per target "
          "forward, bonus token included)")
    if any(check["mismatch"] and not check["unexplained_mismatch"] for *_, check in rows):
        print("near-tie: there the target's top two logits are equal up to floating-point rounding, which a verify "
              "forward\nover several tokens does in another order than plain decoding's one-token forward: either "
              "token is the\ntarget's greedy choice, and what follows is the target's greedy continuation of it.")


def identical_verdict(check: dict) -> str:
    """The demo's "identical to plain greedy" cell for a `bench._lossless_check` result: yes, a floating-point
    near-tie (where, and how close), or NO (a real mismatch: a bug)."""
    if not check["mismatch"]:
        return "yes"
    if check["unexplained_mismatch"]:
        return "NO"
    return f"near-tie at token {check['first_divergence'] + 1} (logits {check['logit_gap']:.1e} apart)"


def demo_diffusion(prompt: str, model_path: str | None, graph_path: str | None, max_new_tokens: int,
                   block_length: int | None, threshold: float, device: str) -> None:
    """A masked diffusion LM: watch one block fill in forward by forward, then compare decoding methods: forward
    passes (NFE), tokens/s, and whether Spiffy's output is identical to the decoding it speeds up."""
    import warnings

    from .diffusion import DiffusionGenerationConfig
    from .spiffy import DraftGraph

    from .embedded import default_diffusion_lm_path

    # the options and the graph first: a wrong one fails before the model loads and anything is printed
    options = dict(max_new_tokens=max_new_tokens, block_length=block_length, cache="dual")
    for thresh in (None, threshold):
        DiffusionGenerationConfig(**options, threshold=thresh).validate()
    model_path = model_path or default_diffusion_lm_path()
    graph = DraftGraph.from_pretrained(graph_path or model_path)
    # every run decodes in the graph's blocks unless --block-length says otherwise (and the graph then refuses it)
    options["block_length"] = DiffusionGenerationConfig(**options).for_model(None, graph).block_length
    # One graph serves Spiffy with and without threshold unmasking, so one of the two always decodes with settings
    # other than those it was calibrated with; said once here, rather than in a warning on every run that asks to
    # calibrate for settings the demo itself chose.
    differences = sorted({difference for thresh in (None, threshold) for difference in
                          graph.calibration_differences(DiffusionGenerationConfig(**options, threshold=thresh))})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This Spiffy graph was calibrated with other decoding settings")
        graph.check_compatible(DiffusionGenerationConfig(**options, threshold=threshold))  # refuses another block
        _demo_diffusion_runs(prompt, model_path, graph, options, threshold, device)
    if differences:
        print(f"\n(The graph was calibrated with other settings than some of these runs ({'; '.join(differences)}): "
              "Spiffy's output is as exact with it there, though fewer of its drafts may be accepted.)")


def _demo_diffusion_runs(prompt, model_path, graph, options: dict, threshold: float, device: str) -> None:
    """demo --diffusion's decoding: the block filling in, then each method's NFE, speed and identity."""
    import time

    import torch
    from .bench_diffusion import answer_until_eos
    from .diffusion import AutoDiffusionLM, DiffusionGenerationConfig, diffusion_generate, load_tokenizer

    block_length = options["block_length"]
    tokenizer = load_tokenizer(model_path)
    model = AutoDiffusionLM.from_pretrained(model_path, device=device)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"].to(device)
    mask_id = model.mask_token_id

    def show(block, answer):  # one line per forward: decided tokens, and a shaded cell per masked one
        cells = answer[0, max(0, answer.shape[1] - block_length) :]  # the block being decoded
        text = "".join("\u2591" if t == mask_id else tokenizer.decode([t]).replace("\n", "\u23ce")
                       for t in cells.tolist())
        print(f"block {block} | {text}", flush=True)

    print(f"\n> {prompt}\n\nSpiffy + threshold unmasking in blocks of {block_length} tokens, one line per forward "
          "pass:")
    diffusion_generate(model, ids, config=DiffusionGenerationConfig(**options, threshold=threshold), draft_graph=graph,
                       eos_token_id=tokenizer.eos_token_id, on_forward=show)
    rows, outputs = [], {}
    for name, thresh, spiffy in (("steps", None, None), ("threshold", threshold, None), ("spiffy", None, graph),
                                 ("spiffy+threshold", threshold, graph)):
        config = DiffusionGenerationConfig(**options, threshold=thresh)
        start = time.perf_counter()
        out = diffusion_generate(model, ids, config=config, draft_graph=spiffy, eos_token_id=tokenizer.eos_token_id)
        seconds = time.perf_counter() - start
        outputs[name] = out.sequences
        base = {"spiffy": "steps", "spiffy+threshold": "threshold"}.get(name)
        same = "" if base is None else ("yes" if torch.equal(outputs[base], out.sequences) else "NO")
        # the answer up to its EOS, as the bench counts it (not the filler decoded after it)
        answer, _ = answer_until_eos(out.sequences[0, ids.shape[1] :], tokenizer.eos_token_id)
        rows.append((name, out.nfe, len(answer), len(answer) / seconds, same))
    print(f"\n{'method':<17} {'NFE':>5} {'tokens':>6} {'tokens/s':>9}  identical to the same decoding without Spiffy")
    for name, nfe, tokens, speed, same in rows:
        print(f"{name:<17} {nfe:>5} {tokens:>6} {speed:>9.1f}  {same}")


EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the Hub model the embedded target is a GGUF of
SPECULATOR_TITLE = "{name} dFlash + xPress speculator (block {block_size})"
DIFFUSION_TITLE = "{name} masked diffusion LM (LoRA adapter) with its Spiffy graph"
# what the project's own runs of the embedded target were; another base model's card must say its own
EMBEDDED_DATA_DESCRIPTION = ("SmolLM2-135M-Instruct's greedy answers to 4,500 GSM8K train questions (MIT) and 4,500 "
                             "ShareGPT first turns (user-shared, no licence declared), `shared/data/distill`")
EMBEDDED_TRAIN_HARDWARE = "a 2-core CPU"


def export(args) -> None:
    """Ship a training run: a speculator run (holds speculator/) or a diffusion LM run (holds diffusion_lm/)."""
    from pathlib import Path

    run, output = Path(args.run).resolve(), Path(args.output).resolve()
    if output.exists() and not output.is_dir():
        raise SystemExit(f"--output {args.output} is a file: give a folder (made if missing).")
    # the run's own artifact (what the export reads, and what a resumed run continues) and checkpoints
    kept = [run / name for name in ("speculator", "diffusion_lm", "checkpoints")]
    if output == run or any(output == folder or folder in output.parents for folder in kept):
        raise SystemExit(f"--output {args.output} is the run folder or inside its speculator/, diffusion_lm/ or "
                         "checkpoints/ (the trained weights the export reads, which a resumed run continues): give a "
                         "folder outside them.")
    if (Path(args.run) / "diffusion_lm").is_dir():
        export_diffusion(args)
    elif (Path(args.run) / "speculator").is_dir():
        export_speculator(args)
    else:
        raise SystemExit(f"{args.run} holds neither speculator/ nor diffusion_lm/: pass the output_dir of "
                         "`hf-specdiff train` or `hf-specdiff train-diffusion`.")


def _quoted_bench(args, kind: str, base_model: str, embedded: bool, measured_folders: tuple = ()) -> tuple[str, str]:
    """(the card's Measured table, the command that reproduces it) from `--bench-json`, read and checked before
    anything is written (a typo must not leave a half export). The command is `--bench-command`, else the one the
    result's recorded config implies, naming this model and its base model (`base_model`; none where `embedded`, the
    bench's default) rather than paths on the exporting machine; with no result, the command that would measure
    them. `measured_folders`: where the exported model may have been benched from; a result that names another
    folder is warned of (the card would quote another model's figures)."""
    from pathlib import Path

    from .bench import markdown_table
    from .bench_diffusion import DIFFUSION_METHODS, diffusion_markdown_table

    path = args.bench_json
    if path is None:  # (a bare `hf-specdiff bench` would measure the embedded target's shipped models, not this one)
        this = ({"target": THIS_MODEL, "methods": list(DIFFUSION_METHODS)} if kind == "diffusion LM" else
                {"speculator": THIS_MODEL} if embedded else {"target": base_model, "speculator": THIS_MODEL})
        return "Not benchmarked yet.", args.bench_command or bench_command_line(this)
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise SystemExit(f"--bench-json {path}: cannot read it as JSON ({error}).") from error
    not_a_bench = SystemExit(f"--bench-json {path} is not a `hf-specdiff bench --json` result of one batch size.")
    summary = result.get("summary") if isinstance(result, dict) else None
    if not isinstance(summary, dict) or result.get("kind") == "batch_curve" or not isinstance(result.get("config"),
                                                                                              dict):
        raise not_a_bench
    diffusion = any("nfe" in run for run in summary.values() if isinstance(run, dict))
    if diffusion != (kind == "diffusion LM"):
        found = "a diffusion LM bench" if diffusion else "a speculator bench"
        raise SystemExit(f"--bench-json {path} is {found}; this export is of a {kind}: pass that run's bench.")
    try:  # the card's table is what the export needs from it
        table = (diffusion_markdown_table if diffusion else markdown_table)(result)
    except (KeyError, TypeError, IndexError, ValueError, AttributeError) as error:
        raise not_a_bench from error
    recorded = dict(result["config"])
    if kind == "speculator" and isinstance(recorded.get("target"), str) and Path(recorded["target"]).is_dir():
        recorded["target"] = None if embedded else base_model  # (the reader loads it by its Hub id)
    option = "speculator" if kind == "speculator" else "target"
    benched = (result.get("environment") or {}).get(option)
    if isinstance(benched, str) and Path(benched).is_dir():
        if (Path(benched).resolve() in {Path(folder).resolve() for folder in measured_folders}
                or _holds_weights_of(Path(benched), Path(measured_folders[0]))):  # (an earlier export of this run)
            recorded[option] = THIS_MODEL  # (a path on the exporting machine: the card's reader has the model)
        else:
            print(f"warning: --bench-json {path} measured the {kind} in {benched}, not this run's: the card quotes "
                  "its figures as this model's. Bench this run's (or the exported folder), or drop --bench-json.",
                  file=sys.stderr)
    return table, args.bench_command or bench_command_line(recorded)


def _holds_weights_of(folder, artifact) -> bool:
    """Whether `folder` stores the tensors of `artifact` (a run's speculator/ or diffusion_lm/), each cast to the dtype
    `folder` stores it in: an export of the run, whichever folder and dtype it was exported to."""
    import torch
    from safetensors import safe_open

    def tensors(root):  # opened lazily: another model's folder (a big one, say) differs by its names first
        handles = {file.relative_to(root): safe_open(file, "pt") for file in sorted(root.rglob("*.safetensors"))}
        return {(file, name): handle for file, handle in handles.items() for name in handle.keys()}

    stored, trained = tensors(folder), tensors(artifact)
    if not trained or stored.keys() != trained.keys():
        return False
    for (file, name), handle in trained.items():
        kept, tensor = stored[file, name].get_tensor(name), handle.get_tensor(name)
        if kept.shape != tensor.shape or not torch.equal(kept, tensor.to(kept.dtype)):
            return False
    return True


# what a card's bench command names the model it describes by
THIS_MODEL = "path/to/this/model"


def bench_command_line(recorded: dict) -> str:
    """The `hf-specdiff bench` command that reproduces a result from the config it recorded: each option it set to
    other than the default (where it wrote its outputs, and the device, aside)."""
    import shlex

    from .bench import _AR_OPTIONS, _DIFFUSION_OPTIONS, BenchConfig
    from .bench_diffusion import DIFFUSION_METHODS

    defaults = dataclasses.asdict(BenchConfig())
    # options only the other kind of run reads are not this run's: an autoregressive result recorded while
    # block_length defaulted to 32 records 32, which `bench` refuses beside autoregressive methods
    diffusion = bool(set(recorded.get("methods", [])) & set(DIFFUSION_METHODS))
    not_read = _AR_OPTIONS if diffusion else _DIFFUSION_OPTIONS
    words = ["hf-specdiff", "bench"]
    for name, value in recorded.items():
        if (name in ("json", "markdown", "plots", "device", *not_read) or name not in defaults
                or value == defaults[name]):
            continue
        if name == "datasets" and recorded.get("prompts"):  # ("custom": the --prompts file's)
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else f"--no-{name.replace('_', '-')}")
        else:
            words += [flag, *map(str, value if isinstance(value, list) else ["none" if value is None else value])]
    return shlex.join(words)


# the distill corpus EMBEDDED_DATA_DESCRIPTION describes, as the run's train_config.json records its files
EMBEDDED_DATA_FILES = {"smollm2-135m-instruct/gsm8k_train.jsonl", "smollm2-135m-instruct/sharegpt.jsonl"}


def _card_facts(args, recorded: str | None, embedded: bool, train_config: dict) -> tuple[str, str, dict]:
    """The card's base model, licence and free-text facts. Every option the card still needs is named in one error
    (rather than one per try of the command)."""
    missing = []
    base_model = _card_base_model(args, recorded, embedded, missing)
    card_license = _card_license(args, base_model, missing)
    text = _card_text(args, base_model, train_config, missing)
    if len(missing) > 1:
        raise SystemExit(f"The model card needs {len(missing)} more options:\n" + "\n".join(f"  {m}" for m in missing))
    if missing:
        raise SystemExit(missing[0])
    return base_model, card_license, text


def _card_text(args, base_model: str, train_config: dict, missing: list[str]) -> dict:
    """The card's free-text facts. The defaults describe the project's runs of the embedded target on its distill
    corpus; a card of another base model, or of a run on other data, must not claim them, so there each is required
    (appended to `missing` where not given)."""
    import os

    facts = {"data_description": args.data_description, "train_hardware": args.train_hardware}
    data_files = {"/".join(os.path.normpath(path).split(os.sep)[-2:]) for path in train_config.get("data") or ()}
    if facts["data_description"] is None and base_model == EMBEDDED_HUB_ID and data_files != EMBEDDED_DATA_FILES:
        missing.append(f"--data-description is required: the run trained on {sorted(data_files)}, not the distill "
                       "corpus the default describes. Say what it was trained on.")
    defaults = {"data_description": EMBEDDED_DATA_DESCRIPTION, "train_hardware": EMBEDDED_TRAIN_HARDWARE}
    for name, value in facts.items():
        if value is None and base_model == EMBEDDED_HUB_ID:
            facts[name] = defaults[name]
        elif value is None:
            missing.append(f"--{name.replace('_', '-')} is required for a base model other than the embedded "
                           f"SmolLM2 ({base_model}): say what the run was trained on / with.")
    return facts


def _card_base_model(args, recorded: str | None, embedded: bool, missing: list[str]) -> str:
    """The card's `base_model`: a Hub id (a local folder means nothing on the Hub). Where it must be given, the
    reason is appended to `missing` and the run's record stands in for it in the other messages."""
    import os

    if args.base_model is not None:  # given: trusted unless it cannot be a Hub id
        if can_only_be_a_path(args.base_model):
            missing.append(f"--base-model {args.base_model!r} is a path; give a Hub id (namespace/name).")
        return args.base_model
    if embedded:
        return EMBEDDED_HUB_ID
    if recorded is None or can_only_be_a_path(recorded) or os.path.exists(recorded):
        missing.append(f"--base-model is required: the run's base model is the local folder {recorded!r}; give "
                       "the Hub id of the model it holds (the card's base_model).")
    return str(recorded)


def _card_license(args, base_model: str, missing: list[str]) -> str:
    """A trained speculator or adapter is a derivative of its base model, so its card carries the base's licence."""
    if args.license:
        return args.license
    if base_model == EMBEDDED_HUB_ID:
        return "apache-2.0"
    missing.append(f"--license is required: the card carries the licence of the base model {base_model!r}, which "
                   "is not the embedded SmolLM2. Give its Hub licence id (apache-2.0, mit, llama3.1, ..., or other).")
    return ""


def export_speculator(args) -> None:
    from pathlib import Path

    import torch

    from .embedded import is_embedded_folder
    from .model_card import (default_template, load_target_lines, load_train_config, load_train_log,
                             log_of_saved_weights, render_model_card, write_model_card)
    from .speculator import AutoSpeculator
    from .training import SAVED_STEP_FILE

    run = Path(args.run)
    train_config = load_train_config(run)
    if args.earlier_training and not train_config.get("init_speculator"):
        raise SystemExit(f"--earlier-training describes the run an init_speculator came from; {args.run} did not "
                         "start from one: drop it.")
    target = train_config.get("target")
    embedded = target is None or is_embedded_folder(target)
    base_model, card_license, text = _card_facts(args, target, embedded, train_config)
    measured, bench_command = _quoted_bench(args, "speculator", base_model, embedded,
                                            (run / "speculator", args.output))
    speculator = AutoSpeculator.from_pretrained(run / "speculator").to(getattr(torch, args.dtype))
    saved = run / SAVED_STEP_FILE
    log = log_of_saved_weights(load_train_log(run), json.loads(saved.read_text())["step"] if saved.is_file() else None)
    last_eval = next((r for r in reversed(log) if any(k.startswith("tau_") for k in r)), {})
    estimate = ", ".join(f"{k[4:]} {v:.2f}" for k, v in last_eval.items() if k.startswith("tau_")) or "not measured"
    (Path(args.output) / "README.md").unlink(missing_ok=True)  # the card written below replaces an earlier export's
    speculator.save_pretrained(args.output)
    title = args.title or SPECULATOR_TITLE.format(name=base_model.split("/")[-1],
                                                  block_size=speculator.drafter.config.block_size)
    card = render_model_card(args.template or default_template("speculator.md"), speculator, train_config, {
        "title": title, "base_model": base_model, "load_target": load_target_lines(base_model, embedded),
        "license": card_license, **text,
        "train_steps": f"{log[-1]['step'] if log else 0:,}",
        "holdout_estimate": f"{estimate} (step {last_eval.get('step', '-')})", "measured": measured,
        "bench_json": args.bench_json, "bench_command": bench_command, "limitations": args.limitations,
        "storage_dtype": args.dtype, "earlier_training": args.earlier_training,
    })
    write_model_card(args.output, card)
    share_like_umask(Path(args.output))  # safetensors writes 0600: readable by whoever publishes or uses it
    print(f"wrote {args.output}")


def export_diffusion(args) -> None:
    """Copy a diffusion run's adapter artifact (tokenizer included), store its tensors in --dtype, keep a Spiffy graph
    already in --output (export again after calibrating to quote the bench), and write the model card."""
    import hashlib
    import shutil
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    from .diffusion.adapter_weights import EMBEDDED_BASE, WEIGHTS_NAME
    from .model_card import (default_template, load_train_config, load_train_log, render_diffusion_model_card,
                             write_model_card)
    from ._hub import TOKENIZER_FILE_PATTERNS
    from .spiffy import GRAPH_FILE, DraftGraph

    def digest(path: Path) -> str | None:
        return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None

    run, output = Path(args.run), Path(args.output)
    train_config = load_train_config(run)
    if args.earlier_training and not train_config.get("init_adapter"):
        raise SystemExit(f"--earlier-training describes the run an init_adapter came from; {args.run} did not start "
                         "from one: drop it.")
    source = run / "diffusion_lm"
    published = json.loads((source / "config.json").read_text())
    base = published.get("base")
    base_model, card_license, text = _card_facts(args, base, base in (None, EMBEDDED_BASE), train_config)
    measured, bench_command = _quoted_bench(args, "diffusion LM", base_model, base in (None, EMBEDDED_BASE),
                                            (run / "diffusion_lm", args.output))
    weights = {name: t.to(getattr(torch, args.dtype)).contiguous()
               for name, t in load_file(source / WEIGHTS_NAME).items()}
    output.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.name != WEIGHTS_NAME and file.is_file():
            shutil.copy2(file, output / file.name)
    if not any(next(output.glob(pattern), None) for pattern in TOKENIZER_FILE_PATTERNS):
        print(f"warning: {output} holds no tokenizer ({source} had none to copy), and the model card's usage, "
              f"`hf-specdiff bench` and `calibrate` read it from there: save it (tokenizer.save_pretrained("
              f"{str(output)!r})) before publishing.", file=sys.stderr)
    before = digest(output / WEIGHTS_NAME)
    save_file(weights, output / WEIGHTS_NAME, metadata={"format": "pt"})
    log = load_train_log(run)
    graph = DraftGraph.from_pretrained(output) if (output / GRAPH_FILE).is_file() else None
    # a graph kept from an export of other weights (another run, another dtype) was calibrated on another model
    graph_stale = graph is not None and before is not None and before != digest(output / WEIGHTS_NAME)
    if graph_stale:
        print(f"warning: {output / GRAPH_FILE} was calibrated on the weights this export replaced; recalibrate it with "
              f"`hf-specdiff calibrate --model {output} --output {output}`", file=sys.stderr)
    card = render_diffusion_model_card(args.template or default_template("diffusion_lm.md"), published, weights,
                                       train_config, log, graph, {
        "title": args.title or DIFFUSION_TITLE.format(name=base_model.split("/")[-1]), "base_model": base_model,
        "license": card_license, "graph_stale": graph_stale, **text, "measured": measured,
        "bench_json": args.bench_json, "bench_command": bench_command, "limitations": args.limitations,
        "storage_dtype": args.dtype, "earlier_training": args.earlier_training,
    })
    write_model_card(output, card)
    share_like_umask(output)  # safetensors writes 0600: readable by whoever publishes or uses it
    print(f"wrote {output}")


@dataclasses.dataclass
class CalibrateConfig:
    """What `hf-specdiff calibrate` reads; the decoding options come from DiffusionGenerationConfig's flags."""

    model: str | None = dataclasses.field(default=None, metadata={"help": (
        "the diffusion LM to calibrate for: a folder or Hub id that AutoDiffusionLM loads; None: the one shipped for "
        "the embedded SmolLM2-135M-Instruct (as bench and demo --diffusion default to)")})
    tokenizer: str | None = dataclasses.field(default=None, metadata={"help": (
        "folder or Hub id of its tokenizer; None: the one saved in the model's folder")})
    output: str = dataclasses.field(default="spiffy_graph", metadata={"help": (
        "folder the calibrated graph is written to (spiffy_graph.json)")})
    datasets: list[str] = dataclasses.field(default_factory=lambda: ["math500", "mbpp"], metadata={"help": (
        "benchmark sets whose prompts calibrate the graph (the paper's: math500 mbpp)")})
    prompts: str | None = dataclasses.field(default=None, metadata={"help": (
        "your own prompts instead of --datasets: a JSONL file with a `prompt` string or a `messages` list per line")})
    limit: int = dataclasses.field(default=25, metadata={"help": "prompts per dataset, or from --prompts (0: all)"})
    prompt_seed: int = dataclasses.field(default=1, metadata={"help": (
        "order in which prompts are drawn (the bench draws with seed 0: keep them apart)")})
    data_dir: str | None = dataclasses.field(default=None, metadata={"help": (
        "folder holding the benchmark JSONL files; None: $HF_SPECDIFF_DATA, else ./shared/data or ../shared/data")})
    num_nodes: int = dataclasses.field(default=64, metadata={"help": (
        "D, nodes in the draft graph (each forward verifies the --max-drafts best of them)")})
    max_depth: int = dataclasses.field(default=6, metadata={"help": "how many steps ahead a node may lie"})
    num_token_ranks: int = dataclasses.field(default=3, metadata={"help": (
        "how many of a position's most probable tokens (ranks j) a node may use")})
    device: str | None = dataclasses.field(default=None, metadata={"help": (
        "torch device; None: cuda where available, else cpu")})
    dtype: str = dataclasses.field(default="float32", metadata={"help": "float32, bfloat16 or float16"})


def calibrate(args) -> None:
    from pathlib import Path

    import torch

    from ._hub import can_only_be_a_path, check_folder_or_repo_id, check_model_folder, check_tokenizer_folder
    from .bench import BenchConfig, load_prompts, prompt_ids, torch_dtype
    from .bench_diffusion import DIFFUSION_FOLDER_REMEDY
    from .diffusion import AutoDiffusionLM, DiffusionGenerationConfig, load_tokenizer
    from .diffusion.decoding import out_of_vocabulary
    from .embedded import default_diffusion_lm_path
    from .spiffy import calibrate as calibrate_graph
    from .spiffy import check_calibration_options

    options = _dataclass_from_args(CalibrateConfig, args)
    decoding = _dataclass_from_args(DiffusionGenerationConfig, args)
    model_path = options.model or str(default_diffusion_lm_path())
    check_calibration_options(options.num_nodes, options.max_depth, options.num_token_ranks)
    if options.prompts and options.datasets != CalibrateConfig().datasets:
        raise ValueError(f"--prompts {options.prompts} replaces --datasets {options.datasets}: give one of them.")
    dtype = torch_dtype(options.dtype)
    # the prompts first: a wrong dataset, file or limit fails before the model loads
    chats = load_prompts(BenchConfig(datasets=options.datasets, prompts=options.prompts, limit=options.limit,
                                     seed=options.prompt_seed, data_dir=options.data_dir))
    # recorded in the graph: the bench leaves a dataset's calibration prompts out of its measurement
    calibration_prompts = ({"prompts_file": options.prompts, "limit": options.limit} if options.prompts else
                           {"datasets": options.datasets, "prompt_seed": options.prompt_seed, "limit": options.limit})
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # before the model loads: a folder saved without its tokenizer has a way out here
    if options.tokenizer:
        check_folder_or_repo_id(options.tokenizer, "tokenizer")
    check_model_folder(model_path, "diffusion LM", DIFFUSION_FOLDER_REMEDY.format(option="--model"))
    check_tokenizer_folder(options.tokenizer or model_path, "diffusion LM",
                           "" if options.tokenizer else ", or pass --tokenizer (a folder or Hub id holding it)")
    model = AutoDiffusionLM.from_pretrained(model_path, dtype=dtype, device=device)
    tokenizer = load_tokenizer(options.tokenizer or model_path)
    prompts = [torch.tensor([prompt_ids(tokenizer, messages)]) for _, messages in chats]
    for prompt in prompts:  # another model's tokenizer: said here, not as an IndexError in the first forward
        if (token := out_of_vocabulary(prompt, None, model)) is not None:
            raise ValueError(
                f"The tokenizer of {options.tokenizer or model_path} writes token id {token}, but the model has "
                f"{model.config.vocab_size} tokens: pass the tokenizer the model was trained with (--tokenizer)."
            )
    # recorded in the graph: a local folder by its name (the path of one machine means nothing on another)
    local = can_only_be_a_path(model_path) or Path(model_path).is_dir()
    recorded_model = Path(model_path).resolve().name if local else model_path
    graph = calibrate_graph(model, prompts, decoding, num_nodes=options.num_nodes, max_depth=options.max_depth,
                            num_token_ranks=options.num_token_ranks,
                            description={"model": recorded_model, **calibration_prompts})
    path = graph.save_pretrained(Path(options.output))
    print(f"{len(graph)} nodes calibrated on {len(prompts)} prompts, for blocks of {graph.block_length} tokens: {path}")


def _check_demo_flags(args: argparse.Namespace) -> None:
    """Each demo mode has its own flags; one given to the other mode would be ignored, so it is refused."""
    diffusion_only = {"--model": args.model, "--draft-graph": args.draft_graph, "--block-length": args.block_length,
                      "--threshold": args.threshold}
    if args.diffusion and (args.speculator is not None or args.num_draft_tokens is not None):
        raise SystemExit("--speculator and --num-draft-tokens are for the speculative demo; `demo --diffusion` uses "
                         "--model and --draft-graph.")
    given = [flag for flag, value in diffusion_only.items() if value is not None]
    if not args.diffusion and given:
        apply, them = ("applies", "it") if len(given) == 1 else ("apply", "them")
        raise SystemExit(f"{', '.join(given)} {apply} to `hf-specdiff demo --diffusion` only: add --diffusion or drop "
                         f"{them}.")


def _dataclass_options(module: str, config_class: str):
    """A command whose options are the fields of `config_class` in `module` (imported only when the command runs),
    plus `--config FILE` for them."""
    def add_options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--config", help=f"JSON file with {config_class} fields")
        _add_dataclass_arguments(parser, getattr(importlib.import_module(module, __package__), config_class))

    return add_options


def _demo_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", default=DEMO_PROMPT, help="the question asked (default: a grade-school maths "
                        "problem)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated (default: 128)")
    parser.add_argument("--speculator", default=None, help="default: the speculator shipped for the embedded target")
    parser.add_argument("--device", default=None, help="default: cuda where available, else cpu")
    parser.add_argument("--num-draft-tokens", type=int, default=None,
                        help=f"drafts offered per block (default: {CPU_DEMO_DRAFTS} on a CPU, where the verify "
                             "forward's cost grows with its width; all of the block elsewhere)")
    parser.add_argument("--diffusion", action="store_true", help="a masked diffusion LM with Spiffy instead")
    parser.add_argument("--model", default=None, help="--diffusion: the diffusion LM folder (default: the shipped one)")
    parser.add_argument("--draft-graph", default=None, help="--diffusion: folder with spiffy_graph.json "
                        "(default: the graph beside the model)")
    parser.add_argument("--block-length", type=int, default=None, help="--diffusion: semi-autoregressive block size "
                        "(default: the draft graph's)")
    parser.add_argument("--threshold", type=float, default=None, help="--diffusion: Fast-dLLM confidence threshold of "
                        "the threshold and Spiffy + threshold runs (default: 0.9)")


def _export_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, help="training output_dir (holds speculator/ or diffusion_lm/, and "
                        "log.jsonl)")
    parser.add_argument("--output", required=True, help="folder written in the layout of a Hub model repo: config, "
                        "weights and model card")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="the stored weights' dtype (default: bfloat16)")
    parser.add_argument("--bench-json", help="a `hf-specdiff bench --json` result to quote in the card")
    parser.add_argument("--bench-command", default=None, help="the command the card quotes for reproducing "
                        "--bench-json (default: the `hf-specdiff bench` options the result recorded)")
    parser.add_argument("--template", default=None, help="the model card's template (default: "
                        "model_cards/speculator.md or model_cards/diffusion_lm.md)")
    parser.add_argument("--base-model", default=None, help="the card's base_model (default: the target or base the run "
                        f"names; {EMBEDDED_HUB_ID} for the embedded one)")
    parser.add_argument("--title", default=None, help=f"the card's title (default: {SPECULATOR_TITLE!r} or "
                        f"{DIFFUSION_TITLE!r}, name: the base model's)")
    parser.add_argument("--license", default=None, help="the card's licence, a Hub licence id (default: apache-2.0, "
                        f"{EMBEDDED_HUB_ID}'s, for the embedded base; required for another base)")
    parser.add_argument("--data-description", default=None, help="what the run trained on (default for the embedded "
                        f"base trained on its distill corpus: {EMBEDDED_DATA_DESCRIPTION!r}; required otherwise)")
    parser.add_argument("--train-hardware", default=None, help="what it trained on (default for the embedded base: "
                        f"{EMBEDDED_TRAIN_HARDWARE!r}; required for another base)")
    parser.add_argument("--limitations", default="", help="the card's Limitations section: what these weights are not "
                        "good for (default: what holds for every artifact of the kind: measured only as the card says, "
                        "for its base model only)")
    parser.add_argument("--earlier-training", default="", help="for a run continued with --init-speculator or "
                        "--init-adapter: how that speculator or adapter was trained")


def _draft_vocab_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("speculator", help="folder of a saved speculator (or bare z-lab drafter); written in place")
    parser.add_argument("--data", nargs="+", required=True,
                        help="JSONL files of the target's own answers (`response_ids`, as `hf-specdiff distill` "
                        "writes)")
    parser.add_argument("--size", type=int, required=True, help="how many tokens (e.g. 8192 of a 49152 vocabulary)")
    parser.add_argument("--target", help="local folder of the target, whose EOS ids are always kept (default: the "
                        "embedded SmolLM2-135M-Instruct's generation config)")


def draft_vocab(args) -> None:
    """Count the answers' tokens, keep the target's EOS ids and the `--size` most frequent, write them beside the
    speculator's weights, and say how much of the answers they cover."""
    from pathlib import Path

    from transformers import AutoConfig, GenerationConfig

    from ._hub import check_folder_or_repo_id, find_file
    from .draft_vocab import top_tokens
    from .embedded import default_target_path
    from .bench import json_lines
    from .speculator import saved_vocab_size, write_draft_vocab

    folder = Path(args.speculator)
    if (folder / "speculator").is_dir() and not (folder / "config.json").is_file():
        raise SystemExit(f"{folder} is a training run's folder: give its speculator ({folder / 'speculator'}) or an "
                         "export of it.")
    saved_vocab_size(args.speculator)  # a folder without a speculator is refused before the data is read
    target = args.target or str(default_target_path())
    check_folder_or_repo_id(target, "target")  # (before: the Hub was asked for a folder that holds no model)
    find_file(target, "config.json", "target", "Point --target at the target's folder (config.json beside its "
              "weights), or leave it out for the embedded SmolLM2-135M-Instruct.")
    if args.target is None:  # the vocabulary keeps the target's EOS ids: the embedded one's fit only its speculators
        trained_for = json.loads((folder / "config.json").read_text())
        embedded = AutoConfig.from_pretrained(target)
        shapes = {"vocab_size": (trained_for.get("vocab_size"), embedded.vocab_size),
                  "layers": (trained_for.get("num_target_layers"), embedded.num_hidden_layers)}
        if differences := [f"{name} {theirs} vs {its}" for name, (theirs, its) in shapes.items()
                           if theirs is not None and theirs != its]:
            raise SystemExit(f"{folder} holds a speculator for another target than the embedded SmolLM2-135M-Instruct "
                             f"({', '.join(differences)}): pass --target, the folder of the target it was trained "
                             "for, whose EOS ids the draft vocabulary keeps.")
    answers = []
    for path in args.data:
        for _, where, row in json_lines(path, '{"response_ids": [1, 2, 3]}'):
            answer = row.get("response_ids") if isinstance(row, dict) else None
            if not isinstance(answer, list) or any(type(t) is not int for t in answer):  # 2.7 is no token id
                raise ValueError(f"{where} is not a distill row with integer `response_ids` (a list of token ids).")
            answers.append(answer)
    try:
        eos = GenerationConfig.from_pretrained(target).eos_token_id
    except OSError:  # no generation_config.json: the model config's
        eos = GenerationConfig.from_model_config(AutoConfig.from_pretrained(target)).eos_token_id
    vocab = top_tokens(answers, args.size, always=eos)
    write_draft_vocab(args.speculator, vocab)
    share_like_umask(folder)  # safetensors writes 0600: readable by whoever publishes or uses it
    if (folder / "README.md").is_file():
        print(f"warning: {folder / 'README.md'} (the model card) still describes the draft vocabulary and the figures "
              "measured before; bench the speculator again and rewrite the card (`hf-specdiff export --bench-json`), "
              "or edit it.", file=sys.stderr)
    kept = set(vocab.tolist())
    covered = sum(token in kept for answer in answers for token in answer) / sum(map(len, answers))
    print(f"wrote a draft vocabulary of {len(vocab)} tokens to {args.speculator}: {covered:.1%} of the "
          f"{sum(map(len, answers)):,} answer tokens it was counted from")


def _calibrate_options(parser: argparse.ArgumentParser) -> None:
    from .bench import BenchConfig
    from .diffusion import DiffusionGenerationConfig

    parser.add_argument("--config", help="JSON file with CalibrateConfig and DiffusionGenerationConfig fields")
    _add_dataclass_arguments(parser, CalibrateConfig)
    # calibration records ordinary decoding: how many drafts Spiffy verifies is chosen where it decodes
    # (bench, generate). Its cache is the one bench and demo --diffusion decode with (dual, where Spiffy is exact): a
    # graph calibrated with another warns wherever they use it.
    _add_dataclass_arguments(parser, DiffusionGenerationConfig, exclude=("max_drafts",),
                             defaults={"cache": BenchConfig.cache})


# Each command, its one-line help and what adds its options. Only the command being run gets its options: most of
# them come from dataclasses whose modules import torch and transformers, which `hf-specdiff --help` need not wait for.
COMMANDS = {
    "train": ("train a speculator (drafter + xPress + Markov) for a target",
              _dataclass_options(".training", "TrainConfig")),
    "train-diffusion": ("turn a causal LM (default: the embedded SmolLM2) into a masked diffusion LM (LoRA)",
                        _dataclass_options(".diffusion.training", "DiffusionTrainConfig")),
    "distill": ("the target answers real prompts: training data (resumable)",
                _dataclass_options(".distill", "DistillConfig")),
    "bench": ("measure every method side by side on real prompt sets", _dataclass_options(".bench", "BenchConfig")),
    "demo": ("stream an answer with xPress, then compare plain / dflash / xpress", _demo_options),
    "export": ("ship a trained speculator or diffusion LM: cast, save, write its model card", _export_options),
    "calibrate": ("calibrate a Spiffy draft graph for a diffusion LM", _calibrate_options),
    "draft-vocab": ("give a saved speculator a draft vocabulary: the tokens the target writes most",
                    _draft_vocab_options),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as `main` reads it (a `--config` file's values under the flags given)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="hf-specdiff", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    # the top-level parser's options (--help, --version) take no value, so the first word that is not an option names
    # the command
    chosen = next((word for word in argv if not word.startswith("-")), None)
    for name, (help_text, add_options) in COMMANDS.items():
        command_parser = commands.add_parser(name, help=help_text)
        if name == chosen:
            add_options(command_parser)
    return _parse(parser, commands.choices, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "calibrate":
        calibrate(args)
    elif args.command == "draft-vocab":
        draft_vocab(args)
    elif args.command == "export":
        export(args)
    elif args.command == "distill":
        from .distill import DistillConfig, distill

        print(f"answers in {distill(_dataclass_from_args(DistillConfig, args))}")
    elif args.command == "bench":
        from .bench import BenchConfig, bench, result_table, write_outputs

        config = _dataclass_from_args(BenchConfig, args)
        result = bench(config)
        print(result_table(result, config))  # first: the run's figures are shown whatever happens to the files
        write_outputs(result, config)
    elif args.command == "demo":
        _check_demo_flags(args)
        device = args.device or ("cuda" if _cuda() else "cpu")
        if args.diffusion:
            demo_diffusion(args.prompt, args.model, args.draft_graph, args.max_new_tokens,
                           args.block_length,
                           0.9 if args.threshold is None else args.threshold, device)
        else:
            demo(args.prompt, args.max_new_tokens, args.speculator, device, args.num_draft_tokens)
    elif args.command == "train":
        from .training import TrainConfig, train

        config = _dataclass_from_args(TrainConfig, args)
        train(config)
        print(f"speculator written to {config.output_dir}/speculator")
    elif args.command == "train-diffusion":
        from .diffusion.training import DiffusionTrainConfig, train_diffusion

        config = _dataclass_from_args(DiffusionTrainConfig, args)
        train_diffusion(config)
        print(f"diffusion LM written to {config.output_dir}/diffusion_lm "
              "(load it with AutoDiffusionLM.from_pretrained)")
    return 0


def console_main(argv: list[str] | None = None) -> int:
    """The `hf-specdiff` entry point: a user's mistake (a bad option value, a missing file or package) ends with its
    message on one line instead of a traceback; HF_SPECDIFF_TRACEBACK=1 shows the traceback too."""
    import os
    import warnings

    # a warning is about the command, as an error is: said on a line of its own, not at a line of the library
    formatwarning = warnings.formatwarning
    if os.environ.get("HF_SPECDIFF_TRACEBACK") != "1":
        warnings.formatwarning = lambda message, category, *_, **__: f"hf-specdiff: {category.__name__}: {message}\n"
    try:
        return main(argv)
    except (ValueError, OSError, ImportError) as error:
        if os.environ.get("HF_SPECDIFF_TRACEBACK") == "1":
            raise
        raise SystemExit(f"hf-specdiff: {type(error).__name__}: {error}") from None
    finally:
        warnings.formatwarning = formatwarning

