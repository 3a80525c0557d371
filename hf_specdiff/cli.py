"""`hf-specdiff` command line: distill, train, train-diffusion, bench, demo, export, calibrate. Options mirror the dataclasses they fill (one default each)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing


def _add_dataclass_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One `--field-name` per dataclass field; lists take several values; a JSON `--config` file sets defaults."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint)
        base = next((a for a in args if a is not type(None)), hint) if args and type(None) in args else hint
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if typing.get_origin(base) is list:
            item = typing.get_args(base)[0]
            parser.add_argument(flag, nargs="+", type=item, default=default, help=f"(default: {default})")
        elif base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            parser.add_argument(flag, type=base, default=default, help=f"(default: {default})")


def _dataclass_from_args(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


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
            raise SystemExit(f"{args.config}: unknown options {sorted(unknown)}")
        lists = {action.dest for action in subparsers[args.command]._actions if action.nargs in ("*", "+")}
        not_lists = sorted(name for name in lists & set(from_file) if not isinstance(from_file[name], (list, type(None))))
        if not_lists:  # a string would be read one character at a time
            raise SystemExit(f"{args.config}: {not_lists} must be JSON lists, e.g. \"data\": [\"answers.jsonl\"].")
        subparsers[args.command].set_defaults(**from_file)
        args = parser.parse_args(argv)
    return args


DEMO_PROMPT = (
    "A baker makes 24 muffins in the morning and 18 in the afternoon. She sells 30 of them. "
    "How many muffins are left? Explain step by step."
)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def demo(prompt: str, max_new_tokens: int, speculator_path: str | None, device: str) -> None:
    """The embedded target and its shipped speculator: stream an answer, then compare methods (greedy)."""
    import torch
    from transformers import TextStreamer

    import hf_specdiff

    from .bench import timed_generate

    print("Loading SmolLM2-135M-Instruct (embedded; the first run dequantizes it once) ...", flush=True)
    target, tokenizer = hf_specdiff.load_default_target(device=device)
    hf_specdiff.enable(target)
    path = speculator_path or hf_specdiff.default_speculator_path()
    speculator = hf_specdiff.AutoSpeculator.from_pretrained(path).to(device=device, dtype=target.dtype)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True).to(device)
    print(f"\n> {prompt}\n")
    target.generate(**inputs, assistant_model=speculator, speculation="xpress", max_new_tokens=max_new_tokens,
                    do_sample=False, streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))

    rows, reference = [], None
    for method in (None, "dflash", "xpress"):
        kwargs = dict(assistant_model=speculator, speculation=method) if method else {}
        target.generate(**inputs, max_new_tokens=8, do_sample=False, **kwargs)  # warm-up
        out, seconds = timed_generate(target, **inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                      return_dict_in_generate=True, **kwargs)
        new = out.sequences.shape[1] - inputs["input_ids"].shape[1]
        reference = out.sequences if reference is None else reference
        tau = out.speculation.tau if method else 1.0
        rows.append((method or "plain", new / seconds, tau, torch.equal(out.sequences, reference)))
    base = rows[0][1]
    print(f"\n{'method':<8} {'tokens/s':>9} {'tau':>6} {'speedup':>8}  identical to plain greedy")
    for name, speed, tau, same in rows:
        print(f"{name:<8} {speed:>9.1f} {tau:>6.2f} {speed / base:>7.2f}x  {'yes' if same else 'NO'}")
    print(f"({device}, {target.dtype}; tau = tokens per target forward, bonus token included)")


def demo_diffusion(prompt: str, model_path: str | None, graph_path: str | None, max_new_tokens: int,
                   block_length: int, threshold: float, device: str) -> None:
    """A masked diffusion LM: watch one block fill in forward by forward, then compare decoding methods: forward
    passes (NFE), tokens/s, and whether Spiffy's output is identical to the decoding it speeds up."""
    import time

    import torch
    from .diffusion import AutoDiffusionLM, DiffusionGenerationConfig, diffusion_generate, load_tokenizer
    from .spiffy import DraftGraph

    from .embedded import default_diffusion_lm_path

    model_path = model_path or default_diffusion_lm_path()
    model = AutoDiffusionLM.from_pretrained(model_path, device=device)
    tokenizer = load_tokenizer(model_path)
    graph = DraftGraph.from_pretrained(graph_path or model_path)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"].to(device)
    mask_id = model.mask_token_id

    def show(block, answer):  # one line per forward: decided tokens, and a shaded cell per masked one
        cells = answer[0, max(0, answer.shape[1] - block_length) :]  # the block being decoded
        text = "".join("\u2591" if t == mask_id else tokenizer.decode([t]).replace("\n", "\u23ce") for t in cells.tolist())
        print(f"block {block} | {text}", flush=True)

    print(f"\n> {prompt}\n\nSpiffy + threshold unmasking, one line per forward pass:")
    options = dict(max_new_tokens=max_new_tokens, block_length=block_length, cache="dual")
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
        rows.append((name, out.nfe, (out.sequences.shape[1] - ids.shape[1]) / seconds, same))
    print(f"\n{'method':<17} {'NFE':>5} {'tokens/s':>9}  identical to the same decoding without Spiffy")
    for name, nfe, speed, same in rows:
        print(f"{name:<17} {nfe:>5} {speed:>9.1f}  {same}")


EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the Hub model the embedded target is a GGUF of
SPECULATOR_TITLE = "SmolLM2-135M-Instruct dFlash + xPress speculator (block 16)"
DIFFUSION_TITLE = "SmolLM2-135M-Instruct masked diffusion LM (LoRA adapter) with its Spiffy graph"


def export(args) -> None:
    """Ship a training run: a speculator run (holds speculator/) or a diffusion LM run (holds diffusion_lm/)."""
    from pathlib import Path

    if (Path(args.run) / "diffusion_lm").is_dir():
        export_diffusion(args)
    elif (Path(args.run) / "speculator").is_dir():
        export_speculator(args)
    else:
        raise SystemExit(f"{args.run} holds neither speculator/ nor diffusion_lm/: pass the output_dir of "
                         "`hf-specdiff train` or `hf-specdiff train-diffusion`.")


def _card_license(args, base_model: str) -> str:
    """A trained speculator or adapter is a derivative of its base model, so its card carries the base's licence."""
    if args.license:
        return args.license
    if base_model == EMBEDDED_HUB_ID:
        return "apache-2.0"
    raise SystemExit(f"--license is required: the card carries the licence of the base model {base_model!r}, which "
                     "is not the embedded SmolLM2. Give its Hub licence id (apache-2.0, mit, llama3.1, ..., or other).")


def export_speculator(args) -> None:
    from pathlib import Path

    import torch

    from .bench import markdown_table
    from .embedded import is_embedded_folder
    from .model_card import default_template, load_train_config, load_train_log, render_model_card, write_model_card
    from .speculator import AutoSpeculator

    run = Path(args.run)
    train_config = load_train_config(run)
    if args.earlier_training and not train_config.get("init_speculator"):
        raise SystemExit(f"--earlier-training describes the run an init_speculator came from; {args.run} did not "
                         "start from one: drop it.")
    target = train_config.get("target")
    base_model = args.base_model or (EMBEDDED_HUB_ID if target is None or is_embedded_folder(target) else target)
    card_license = _card_license(args, base_model)
    speculator = AutoSpeculator.from_pretrained(run / "speculator").to(getattr(torch, args.dtype))
    log = load_train_log(run)
    last_eval = next((r for r in reversed(log) if any(k.startswith("tau_") for k in r)), {})
    estimate = ", ".join(f"{k[4:]} {v:.2f}" for k, v in last_eval.items() if k.startswith("tau_")) or "not measured"
    measured = "Not benchmarked yet."
    if args.bench_json:
        measured = markdown_table(json.loads(Path(args.bench_json).read_text()))
    speculator.save_pretrained(args.output)
    card = render_model_card(args.template or default_template("speculator.md"), speculator, train_config, {
        "title": args.title or SPECULATOR_TITLE, "base_model": base_model, "license": card_license,
        "data_description": args.data_description,
        "train_hardware": args.train_hardware, "train_steps": log[-1]["step"] if log else 0,
        "holdout_estimate": f"{estimate} (step {last_eval.get('step', '-')})", "measured": measured,
        "bench_command": args.bench_command, "limitations": args.limitations, "storage_dtype": args.dtype,
        "earlier_training": args.earlier_training,
    })
    write_model_card(args.output, card)
    print(f"wrote {args.output}")


def export_diffusion(args) -> None:
    """Copy a diffusion run's adapter artifact (tokenizer included), store its tensors in --dtype, keep a Spiffy graph
    already in --output (export again after calibrating to quote the bench), and write the model card."""
    import hashlib
    import shutil
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    from .bench_diffusion import diffusion_markdown_table
    from .diffusion.adapter_weights import EMBEDDED_BASE, WEIGHTS_NAME
    from .model_card import (default_template, load_train_config, load_train_log, render_diffusion_model_card,
                             write_model_card)
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
    base_model = args.base_model or (EMBEDDED_HUB_ID if base in (None, EMBEDDED_BASE) else base)
    card_license = _card_license(args, base_model)
    weights = {name: t.to(getattr(torch, args.dtype)).contiguous() for name, t in load_file(source / WEIGHTS_NAME).items()}
    output.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.name != WEIGHTS_NAME and file.is_file():
            shutil.copy2(file, output / file.name)
    before = digest(output / WEIGHTS_NAME)
    save_file(weights, output / WEIGHTS_NAME, metadata={"format": "pt"})
    log = load_train_log(run)
    graph = DraftGraph.from_pretrained(output) if (output / GRAPH_FILE).is_file() else None
    # a graph kept from an export of other weights (another run, another dtype) was calibrated on another model
    graph_stale = graph is not None and before is not None and before != digest(output / WEIGHTS_NAME)
    if graph_stale:
        print(f"warning: {output / GRAPH_FILE} was calibrated on the weights this export replaced; recalibrate it with "
              f"`hf-specdiff calibrate --model {output} --output {output}`", file=sys.stderr)
    measured = "Not benchmarked yet."
    if args.bench_json:
        measured = diffusion_markdown_table(json.loads(Path(args.bench_json).read_text()))
    card = render_diffusion_model_card(args.template or default_template("diffusion_lm.md"), published, weights,
                                       train_config, log, graph, {
        "title": args.title or DIFFUSION_TITLE, "base_model": base_model, "license": card_license, "graph_stale": graph_stale,
        "data_description": args.data_description, "train_hardware": args.train_hardware, "measured": measured,
        "bench_command": args.bench_command, "limitations": args.limitations, "storage_dtype": args.dtype,
        "earlier_training": args.earlier_training,
    })
    write_model_card(output, card)
    print(f"wrote {output}")


@dataclasses.dataclass
class CalibrateConfig:
    """What `hf-specdiff calibrate` reads; the decoding options come from DiffusionGenerationConfig's flags."""

    model: str = ""  # a diffusion LM folder or Hub id (AutoDiffusionLM)
    tokenizer: str | None = None  # default: the model's own folder
    output: str = "spiffy_graph"  # folder for spiffy_graph.json
    datasets: list[str] = dataclasses.field(default_factory=lambda: ["math500", "mbpp"])  # as in the paper
    limit: int = 25  # prompts per dataset
    prompt_seed: int = 1  # order in which prompts are drawn (bench uses seed 0: keep them apart)
    data_dir: str | None = None
    num_nodes: int = 64  # D
    max_depth: int = 6  # steps ahead a node may lie
    num_token_ranks: int = 3  # token ranks j a node may use
    device: str = "cpu"
    dtype: str = "float32"


def calibrate(args) -> None:
    from pathlib import Path

    import torch

    from .bench import BenchConfig, load_prompts
    from .diffusion import AutoDiffusionLM, DiffusionGenerationConfig, load_tokenizer
    from .spiffy import calibrate as calibrate_graph

    options = _dataclass_from_args(CalibrateConfig, args)
    decoding = _dataclass_from_args(DiffusionGenerationConfig, args)
    if not options.model:
        raise SystemExit("--model is required: a diffusion LM folder or Hub id.")
    if not isinstance(getattr(torch, options.dtype, None), torch.dtype):
        raise SystemExit(f"--dtype {options.dtype!r} is not a torch dtype: use float32, bfloat16 or float16.")
    model = AutoDiffusionLM.from_pretrained(options.model, dtype=getattr(torch, options.dtype), device=options.device)
    tokenizer = load_tokenizer(options.tokenizer or options.model)
    chats = load_prompts(BenchConfig(datasets=options.datasets, limit=options.limit, seed=options.prompt_seed,
                                     data_dir=options.data_dir))
    prompts = [tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"] for _, messages in chats]
    graph = calibrate_graph(model, prompts, decoding, num_nodes=options.num_nodes, max_depth=options.max_depth,
                            num_token_ranks=options.num_token_ranks,
                            description={"model": options.model, "datasets": options.datasets,
                                         "prompt_seed": options.prompt_seed, "limit": options.limit})
    path = graph.save_pretrained(Path(options.output))
    print(f"{len(graph)} nodes calibrated on {len(prompts)} prompts: {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as `main` reads it (a `--config` file's values under the flags given)."""
    parser = argparse.ArgumentParser(prog="hf-specdiff", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    from .training import TrainConfig

    train_parser = commands.add_parser("train", help="train a speculator (drafter + xPress + Markov) for a target")
    train_parser.add_argument("--config", help="JSON file with TrainConfig fields")
    _add_dataclass_arguments(train_parser, TrainConfig)

    from .diffusion.training import DiffusionTrainConfig

    train_diffusion_parser = commands.add_parser(
        "train-diffusion", help="turn a causal LM (default: the embedded SmolLM2) into a masked diffusion LM (LoRA)")
    train_diffusion_parser.add_argument("--config", help="JSON file with DiffusionTrainConfig fields")
    _add_dataclass_arguments(train_diffusion_parser, DiffusionTrainConfig)

    from .distill import DistillConfig

    distill_parser = commands.add_parser("distill", help="the target answers real prompts: training data (resumable)")
    distill_parser.add_argument("--config", help="JSON file with DistillConfig fields")
    _add_dataclass_arguments(distill_parser, DistillConfig)

    from .bench import BenchConfig

    bench_parser = commands.add_parser("bench", help="measure every method side by side on real prompt sets")
    bench_parser.add_argument("--config", help="JSON file with BenchConfig fields")
    _add_dataclass_arguments(bench_parser, BenchConfig)

    demo_parser = commands.add_parser("demo", help="stream an answer with xPress, then compare plain / dflash / xpress")
    demo_parser.add_argument("--prompt", default=DEMO_PROMPT)
    demo_parser.add_argument("--max-new-tokens", type=int, default=128)
    demo_parser.add_argument("--speculator", default=None, help="default: the speculator shipped for the embedded target")
    demo_parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    demo_parser.add_argument("--diffusion", action="store_true", help="a masked diffusion LM with Spiffy instead")
    demo_parser.add_argument("--model", default=None, help="--diffusion: the diffusion LM folder (default: the shipped one)")
    demo_parser.add_argument("--draft-graph", default=None, help="--diffusion: default: the graph beside the model")
    demo_parser.add_argument("--block-length", type=int, default=32)
    demo_parser.add_argument("--threshold", type=float, default=0.9)

    export_parser = commands.add_parser("export", help="ship a trained speculator or diffusion LM: cast, save, write "
                                        "its model card")
    export_parser.add_argument("--run", required=True, help="training output_dir (holds speculator/ or diffusion_lm/, "
                               "and log.jsonl)")
    export_parser.add_argument("--output", required=True)
    export_parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    export_parser.add_argument("--bench-json", help="a `hf-specdiff bench --json` result to quote in the card")
    export_parser.add_argument("--bench-command", default="hf-specdiff bench")
    export_parser.add_argument("--template", default=None,
                               help="default: model_cards/speculator.md or model_cards/diffusion_lm.md")
    export_parser.add_argument("--base-model", default=None, help="the card's base_model (default: the target or "
                               f"base the run names; {EMBEDDED_HUB_ID} for the embedded one)")
    export_parser.add_argument("--title", default=None, help=f"default: {SPECULATOR_TITLE!r} or {DIFFUSION_TITLE!r}")
    export_parser.add_argument("--license", default=None, help="the card's licence, a Hub licence id (default: "
                               f"apache-2.0, {EMBEDDED_HUB_ID}'s, for the embedded base; required for another base)")
    export_parser.add_argument("--data-description", default="SmolLM2-135M-Instruct's greedy answers to 4,500 GSM8K "
                               "train questions (MIT) and 4,500 ShareGPT first turns (user-shared, no licence "
                               "declared), `shared/data/distill`")
    export_parser.add_argument("--train-hardware", default="a 2-core CPU")
    export_parser.add_argument("--limitations", default="")
    export_parser.add_argument("--earlier-training", default="",
                               help="for a run continued with --init-speculator or --init-adapter: how that speculator or "
                               "adapter was trained")

    from .diffusion import DiffusionGenerationConfig

    calibrate_parser = commands.add_parser("calibrate", help="calibrate a Spiffy draft graph for a diffusion LM")
    calibrate_parser.add_argument("--config", help="JSON file with CalibrateConfig and DiffusionGenerationConfig fields")
    _add_dataclass_arguments(calibrate_parser, CalibrateConfig)
    _add_dataclass_arguments(calibrate_parser, DiffusionGenerationConfig)

    return _parse(parser, commands.choices, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "calibrate":
        calibrate(args)
    elif args.command == "export":
        export(args)
    elif args.command == "distill":
        from .distill import DistillConfig, distill

        print(f"answers in {distill(_dataclass_from_args(DistillConfig, args))}")
    elif args.command == "bench":
        from .bench import BenchConfig, bench, result_table, write_outputs

        config = _dataclass_from_args(BenchConfig, args)
        result = bench(config)
        write_outputs(result, config)
        print(result_table(result, config))
    elif args.command == "demo" and args.diffusion:
        demo_diffusion(args.prompt, args.model, args.draft_graph, args.max_new_tokens, args.block_length,
                       args.threshold, args.device)
    elif args.command == "demo":
        demo(args.prompt, args.max_new_tokens, args.speculator, args.device)
    elif args.command == "train":
        from .training import TrainConfig, train

        config = _dataclass_from_args(TrainConfig, args)
        train(config)
        print(f"speculator written to {config.output_dir}/speculator")
    elif args.command == "train-diffusion":
        from .diffusion.training import DiffusionTrainConfig, train_diffusion

        config = _dataclass_from_args(DiffusionTrainConfig, args)
        train_diffusion(config)
        print(f"diffusion LM written to {config.output_dir}/diffusion_lm (load it with AutoDiffusionLM.from_pretrained)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
