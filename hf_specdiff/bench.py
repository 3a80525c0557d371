"""`hf-specdiff bench`: every method side by side on real prompt sets, interleaved so that drift hits all alike.

Per method: tau (mean tokens per target forward after the prefill, bonus included), tokens/s, speedup over plain
`generate` measured in the same run, acceptance by block position, draft/refine/verify time per step, target
forwards, and lossless checks against plain greedy output (raw mismatches, and those not explained by a near-tie
of the target's logits in floating point; the second must be 0).
"""

from __future__ import annotations

import json
import os
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

DATASETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt_bench")
_FILES = {
    "gsm8k": "gsm8k/test.jsonl",
    "math500": "math500/test.jsonl",
    "humaneval": "humaneval/test.jsonl",
    "mbpp": "mbpp/test.jsonl",
    "mt_bench": "mt_bench/question.jsonl",
}


@dataclass
class BenchConfig:
    """Options of `hf-specdiff bench` (the CLI mirrors these fields)."""

    datasets: list[str] = field(default_factory=lambda: ["gsm8k"])
    prompts: str | None = None  # a JSONL file with a `prompt` string or a `messages` list per line
    data_dir: str | None = None  # folder holding the benchmark JSONL files; default: $HF_SPECDIFF_DATA or shared/data
    limit: int = 10  # prompts per dataset
    seed: int = 0  # order in which prompts are drawn
    methods: list[str] = field(default_factory=lambda: ["ar", "dflash", "xpress", "markov"])  # + dflash_hf, prompt_lookup
    jacobi_passes: list[int] = field(default_factory=lambda: [4])  # K values for xpress
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy (losslessness checked per token)
    target: str | None = None  # local folder or Hub id; None: the embedded SmolLM2-135M-Instruct
    speculator: str | None = None  # None: the speculator shipped for the embedded target
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    dtype: str = "float32"
    tie_tolerance: float = 1e-3  # logit gap under which a greedy divergence counts as a floating-point near-tie
    json: str | None = None  # write the full results here
    markdown: str | None = None  # write the table here
    plots: str | None = None  # write PNG plots (speedup, accepted lengths, acceptance by position) to this folder


def find_data_dir(explicit: str | None) -> Path:
    if explicit is not None:
        if not (Path(explicit) / "gsm8k").is_dir():
            raise FileNotFoundError(f"--data-dir {explicit} has no gsm8k/ folder: point it at the benchmark data.")
        return Path(explicit)
    candidates = [os.environ.get("HF_SPECDIFF_DATA"), "shared/data", "../shared/data"]
    for candidate in filter(None, candidates):
        if (Path(candidate) / "gsm8k").is_dir():
            return Path(candidate)
    raise FileNotFoundError(
        "No benchmark data found: pass --data-dir (a folder with gsm8k/test.jsonl, ...) or set HF_SPECDIFF_DATA."
    )


def load_prompts(config: BenchConfig) -> list[tuple[str, list[dict]]]:
    """[(dataset, chat messages)] with `limit` prompts per dataset drawn in a seeded order."""
    if config.prompts:
        rows = [json.loads(line) for line in Path(config.prompts).read_text().splitlines() if line.strip()]
        out = []
        for number, row in enumerate(rows, 1):
            if "messages" in row:
                out.append(("custom", row["messages"]))
            elif "prompt" in row:
                out.append(("custom", [{"role": "user", "content": row["prompt"]}]))
            else:
                raise ValueError(f"{config.prompts}:{number} needs a `prompt` string or a `messages` list.")
        return out[: config.limit] if config.limit else out
    unknown = [d for d in config.datasets if d not in DATASETS]
    if unknown:
        raise ValueError(f"Unknown datasets {unknown}; choose from {DATASETS} or pass --prompts FILE.jsonl.")
    data_dir = find_data_dir(config.data_dir)
    out = []
    for name in config.datasets:
        rows = [json.loads(line) for line in (data_dir / _FILES[name]).read_text().splitlines() if line.strip()]
        random.Random(config.seed).shuffle(rows)
        for row in rows[: config.limit]:
            out.append((name, [{"role": "user", "content": _question(name, row)}]))
    return out


def _question(dataset: str, row: dict) -> str:
    if dataset == "gsm8k":
        return row["question"]
    if dataset == "math500":
        return row["problem"]
    if dataset == "humaneval":
        return "Complete the following Python function.\n\n" + row["prompt"]
    if dataset == "mbpp":
        return row["prompt"] + "\nYour code should pass this test:\n" + row["test_list"][0]
    return row["turns"][0]  # mt_bench


def _method_runs(config: BenchConfig, speculator) -> list[tuple[str, dict]]:
    """(name, extra generate kwargs) per measured method; plain generate ("ar") always comes first."""
    runs = []
    for method in config.methods:
        if method == "xpress":
            runs += [(f"xpress_k{k}" if len(config.jacobi_passes) > 1 else "xpress",
                      dict(assistant_model=speculator, speculation="xpress", num_jacobi_passes=k))
                     for k in config.jacobi_passes]
        elif method in ("dflash", "markov"):
            runs.append((method, dict(assistant_model=speculator, speculation=method)))
        elif method == "dflash_hf":  # transformers' own dFlash candidate generator driving our drafter
            runs.append((method, dict(assistant_model=speculator, speculation_type="dflash")))
        elif method == "prompt_lookup":  # transformers' n-gram lookup in the prompt
            runs.append((method, dict(prompt_lookup_num_tokens=10)))
        elif method == "ar":
            runs.append(("ar", {}))
        else:
            raise ValueError(
                f"Unknown method {method!r}; choose from ar, dflash, xpress, markov, dflash_hf, prompt_lookup."
            )
    return [("ar", {})] + [r for r in runs if r[0] != "ar"]  # every ratio is relative to plain generate


def timed_generate(model, **kwargs):
    """`model.generate(**kwargs)` and its wall time in seconds, device work included."""
    from .candidates import synchronize

    synchronize(model.device)
    start = time.perf_counter()
    out = model.generate(**kwargs)
    synchronize(model.device)
    return out, time.perf_counter() - start


def run_bench(config: BenchConfig, target=None, tokenizer=None, speculator=None, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    import hf_specdiff

    dtype = getattr(torch, config.dtype)
    if target is None:
        if config.target is None:
            target, tokenizer = hf_specdiff.load_default_target(dtype=dtype)
        else:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            target = AutoModelForCausalLM.from_pretrained(config.target, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(config.target)
    target = hf_specdiff.enable(target.to(config.device).eval())
    if speculator is None:
        path = config.speculator or hf_specdiff.default_speculator_path()
        speculator = hf_specdiff.AutoSpeculator.from_pretrained(path)
    speculator = speculator.to(device=config.device, dtype=dtype)
    prompts = load_prompts(config)
    runs = _method_runs(config, speculator)
    sampling = config.temperature > 0
    common = dict(max_new_tokens=config.max_new_tokens, do_sample=sampling, return_dict_in_generate=True)
    if sampling:
        common["temperature"] = config.temperature
    else:
        common.update(output_scores=True)

    def generate(inputs, extra):
        return timed_generate(target, **inputs, **common, **extra)

    encoded = [
        (dataset, tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True).to(config.device))
        for dataset, messages in prompts
    ]
    for _, kwargs in runs:  # warm-up, excluded from every figure
        generate(encoded[0][1], kwargs)

    records = []
    bar = tqdm(total=len(encoded) * len(runs), desc="bench", disable=not progress)
    for index, (dataset, inputs) in enumerate(encoded):
        reference = None
        for name, kwargs in runs:  # interleaved: every method sees each prompt back to back
            torch.manual_seed(config.seed + index)
            out, seconds = generate(inputs, kwargs)
            prompt_length = inputs["input_ids"].shape[1]
            record = {"dataset": dataset, "prompt": index, "method": name, "seconds": seconds,
                      "new_tokens": out.sequences.shape[1] - prompt_length}
            if name == "ar":
                reference = out
                records.append(record)
                bar.update(1)
                continue
            if getattr(out, "speculation", None) is not None:  # transformers' own methods report no statistics
                record["stats"] = out.speculation.to_dict()
                record["accepted_at_position"] = out.speculation.accepted_at_position()
            if not sampling:
                record.update(_lossless_check(reference, out, prompt_length, config.tie_tolerance))
            records.append(record)
            bar.update(1)
    bar.close()
    names = [n for n, _ in runs]
    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    return {"config": asdict(config), "environment": _environment(target, config), "runs": names,
            "summary": summarize(records, names),
            "by_dataset": {d: summarize([r for r in records if r["dataset"] == d], names) for d in datasets},
            "records": records}


def _lossless_check(reference, out, prompt_length, tolerance) -> dict:
    a, b = reference.sequences[0, prompt_length:], out.sequences[0, prompt_length:]
    n = min(len(a), len(b))
    diverged = (a[:n] != b[:n]).nonzero()
    if not len(diverged) and len(a) == len(b):
        return {"mismatch": False, "unexplained_mismatch": False}
    if not len(diverged):  # one stopped earlier with identical tokens up to there: not a near-tie
        return {"mismatch": True, "unexplained_mismatch": True, "logit_gap": None}
    i = int(diverged[0])
    scores = reference.scores[i][0]
    gap = float((scores[a[i]] - scores[b[i]]).abs())
    return {"mismatch": True, "unexplained_mismatch": gap > tolerance, "logit_gap": gap, "first_divergence": i}


def summarize(records: list[dict], runs: list[str]) -> dict:
    summary = {}
    ar_speed = None
    for name in runs:
        rows = [r for r in records if r["method"] == name]
        tokens, seconds = sum(r["new_tokens"] for r in rows), sum(r["seconds"] for r in rows)
        entry = {"prompts": len(rows), "new_tokens": tokens, "seconds": seconds,
                 "tokens_per_s": tokens / seconds if seconds else 0.0}
        if name == "ar":
            ar_speed = entry["tokens_per_s"]
        if rows and "mismatch" in rows[0]:
            entry["lossless_mismatches"] = sum(r["mismatch"] for r in rows)
            entry["unexplained_mismatches"] = sum(r["unexplained_mismatch"] for r in rows)
        if rows and "stats" in rows[0]:
            stats = [r["stats"] for r in rows]
            steps = sum(len(s["accepted_lengths"]) for s in stats)
            entry["tau"] = sum(sum(s["accepted_lengths"]) for s in stats) / max(steps, 1)
            entry["tau_per_sample"] = [sum(s["accepted_lengths"]) / max(len(s["accepted_lengths"]), 1) for s in stats]
            accepted = [sum(c) for c in zip(*[_pad(r["accepted_at_position"][0], 32) for r in rows])]
            offered = [sum(c) for c in zip(*[_pad(r["accepted_at_position"][1], 32) for r in rows])]
            entry["accept_rate_by_position"] = [a / o for a, o in zip(accepted, offered) if o]
            for phase in ("draft", "refine", "verify"):
                entry[f"{phase}_ms"] = 1000 * sum(s[f"{phase}_seconds"] for s in stats) / max(steps, 1)
            entry["target_forwards"] = sum(s["target_forwards"] for s in stats)
        summary[name] = entry
    for entry in summary.values():
        entry["speedup_vs_ar"] = entry["tokens_per_s"] / ar_speed if ar_speed else None
    return summary


def _pad(values, size):
    return list(values) + [0] * (size - len(values))


def _environment(target, config) -> dict:
    import transformers

    device = config.device
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or platform.machine()
    return {"device": device, "device_name": name, "cpu_count": os.cpu_count(), "dtype": config.dtype,
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "target": target.config.name_or_path or type(target).__name__}


def markdown_table(result: dict) -> str:
    lines = ["| dataset | method | tau | tokens/s | speedup vs ar | draft ms | refine ms | verify ms | "
             "mismatches (unexplained) |", "|---|---|---|---|---|---|---|---|---|"]
    sections = dict(result["by_dataset"])
    if len(sections) > 1:
        sections["all"] = result["summary"]
    for dataset, summary in sections.items():
        for name, e in summary.items():
            if name == "ar":
                lines.append(f"| {dataset} | ar | 1.00 | {e['tokens_per_s']:.1f} | 1.00 | | | | |")
                continue
            mism = f"{e.get('lossless_mismatches', '-')} ({e.get('unexplained_mismatches', '-')})"
            tau = f"{e['tau']:.2f}" if "tau" in e else "-"
            phases = " | ".join(f"{e[f'{p}_ms']:.1f}" if f"{p}_ms" in e else "-" for p in ("draft", "refine", "verify"))
            lines.append(f"| {dataset} | {name} | {tau} | {e['tokens_per_s']:.1f} | {e['speedup_vs_ar']:.2f} | "
                         f"{phases} | {mism} |")
    env = result["environment"]
    lines.append("")
    lines.append(f"{env['device_name']} ({env['device']}), {env['dtype']}, torch {env['torch']}, "
                 f"transformers {env['transformers']}; datasets {result['config']['datasets']}, "
                 f"{result['config']['limit']} prompts each, max_new_tokens {result['config']['max_new_tokens']}.")
    return "\n".join(lines)


def write_outputs(result: dict, config: BenchConfig) -> None:
    if config.json:
        Path(config.json).parent.mkdir(parents=True, exist_ok=True)
        Path(config.json).write_text(json.dumps(result, indent=1))
    if config.markdown:
        Path(config.markdown).write_text(markdown_table(result) + "\n")
    if config.plots:
        plot_results(result, config.plots)


def plot_results(result: dict, folder: str | Path) -> list[Path]:
    """speedup.png (tokens/s over plain generate, per dataset), accepted_lengths.png (histogram of tokens per
    verify step), acceptance_by_position.png (P(draft at block position i accepted | offered))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    methods = [m for m in result["runs"] if m != "ar"]
    with_stats = [m for m in methods if "tau" in result["summary"][m]]
    datasets = list(result["by_dataset"])
    written = []

    fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(datasets) * max(len(methods), 1) / 2, 3.5))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        values = [result["by_dataset"][d][method]["speedup_vs_ar"] for d in datasets]
        ax.bar([x + i * width for x in range(len(datasets))], values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(datasets))], datasets)
    ax.set_ylabel("tokens/s vs plain generate")
    ax.legend(fontsize=8)
    written.append(folder / "speedup.png")

    fig2, ax2 = plt.subplots(figsize=(5, 3.5))
    for method in with_stats:
        lengths = [n for r in result["records"] if r["method"] == method for n in r["stats"]["accepted_lengths"]]
        if lengths:
            ax2.hist(lengths, bins=range(1, max(lengths) + 2), alpha=0.5, label=method, density=True, align="left")
    ax2.set_xlabel("tokens per verify step (bonus included)")
    ax2.set_ylabel("fraction of steps")
    ax2.legend(fontsize=8)
    written.append(folder / "accepted_lengths.png")

    fig3, ax3 = plt.subplots(figsize=(5, 3.5))
    for method in with_stats:
        rates = result["summary"][method]["accept_rate_by_position"]
        ax3.plot(range(1, len(rates) + 1), rates, marker="o", markersize=3, label=method)
    ax3.set_xlabel("draft position in block")
    ax3.set_ylabel("accepted | offered")
    ax3.set_ylim(0, 1)
    ax3.legend(fontsize=8)
    written.append(folder / "acceptance_by_position.png")

    for figure, path in zip((fig, fig2, fig3), written):
        figure.tight_layout()
        figure.savefig(path, dpi=120)
        plt.close(figure)
    return written
