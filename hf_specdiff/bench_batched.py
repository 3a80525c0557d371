"""`hf-specdiff bench --batch-size 1 4 16 32 64`: plain batched `generate` against our speculative methods,
by batch size.

Every batch size sees the same prompts, cut into consecutive batches of that size, so that the curve's points differ
by batch size only: the bench's seeded prompts, dealt round-robin over the datasets (any prefix holds every dataset
alike: tau differs a lot between tasks), cut to a multiple of every size (of the largest size where the sizes'
least common multiple exceeds the prompt count; a size that does not divide it leaves its tail out, and the footer
says how many prompts each size used). Every measured call holds a full batch. Prompts are left-padded to the
longest of their batch. Within a batch the methods run back to back, so drift hits them alike; one warm-up call per
batch size and method (which also pays for any compilation) is excluded.

Per batch size and method: tokens/s (each row's tokens up to its first stop token, over the wall time of the calls),
`speedup_vs_ar` over plain batched `generate` at the same size and `speedup_vs_dflash`; for our speculative methods
tau (tokens a row gains per target forward, bonus included), target forwards per batch and draft / refine / verify
time per batched step. Losslessness per row against plain batched `generate`: greedy token by token
(`lossless_mismatches`, `unexplained_mismatches` as in the batch-1 bench), sampled by the paired permutation test on
the target's mean log-probability over rows.

What bounds the curve: a step verifies b rows x (block + 1) tokens in one forward. While that forward is bound by
reading the weights it costs about what a forward of b x 1 tokens costs, and every accepted token is nearly free; as
b grows the forward becomes bound by compute, the rejected draft slots cost real time, and the speedup over plain
decoding falls towards what the extra accepted tokens pay for. A second effect works the other way: plain batched
`generate` keeps computing rows that have stopped until the last one does, while the speculative loop drops them
(except its `_static` runs, which keep them as `ar_static` does, so that every forward keeps its shapes).
`finished_row_share` (for `ar`) is the share of plain decoding's row-steps spent on such rows, so that the part of a
speedup that comes from dropping them can be told from the part speculation earns.
"""

from __future__ import annotations

import math
from collections import Counter
from itertools import chain, zip_longest
from pathlib import Path

import torch

from .batching import left_pad, stop_and_pad_ids, until_stop
from .bench import (
    METHODS,
    PHASES_NOTE,
    TOKENIZER_REMEDY,
    BenchConfig,
    _drafts_per_block,
    _environment,
    _forward_compiled,
    _lossless_check,
    _method_runs,
    _sampling_check,
    check_ar_options,
    check_bench_config,
    check_prompt_vocabulary,
    compile_note,
    data_folder,
    generate_kwargs,
    load_models,
    load_prompts,
    mean_accepted_length,
    mean_target_logprob,
    phase_times,
    prompt_format_note,
    prompt_ids,
    recorded_config,
    sampling_check_cell,
    sampling_note,
    sampling_power_note,
    speed_settings_note,
    timed_generate,
)

BATCH_METHODS = ("ar", "ar_static", "dflash", "xpress", "markov", "dflash_static", "xpress_static")


def _check_batch_config(config: BenchConfig, num_prompts: int | None = None) -> None:
    unsupported = [m for m in config.methods if m not in BATCH_METHODS]
    if unsupported:
        raise ValueError(
            f"Methods {unsupported} decode one sequence at a time (transformers' assisted decoding refuses batches): "
            f"drop them from --methods, or bench them with --batch-size 1. Batched methods: {', '.join(BATCH_METHODS)}."
        )
    if not config.batch_size or any(size < 1 for size in config.batch_size):
        raise ValueError(f"--batch-size takes positive sizes, e.g. 1 4 16; got {config.batch_size}.")
    if num_prompts is not None and max(config.batch_size) > num_prompts:
        raise ValueError(
            f"--batch-size {max(config.batch_size)} needs at least that many prompts and {num_prompts} were loaded: "
            "raise --limit (prompts per dataset), add --datasets, or pass a longer --prompts file."
        )


def curve_prompts(prompts: list, batch_sizes: list[int]) -> list:
    """The prompts every batch size decodes: dealt round-robin over their datasets, then cut to a multiple of every
    size (of the largest one where the sizes' least common multiple exceeds the prompt count)."""
    by_dataset: dict[str, list] = {}
    for prompt in prompts:
        by_dataset.setdefault(prompt[0], []).append(prompt)
    dealt = [p for p in chain.from_iterable(zip_longest(*by_dataset.values())) if p is not None]
    common = math.lcm(*batch_sizes)
    unit = common if common <= len(dealt) else max(batch_sizes)
    return dealt[: len(dealt) - len(dealt) % unit]


def run_batch_bench(config: BenchConfig, target=None, tokenizer=None, speculator=None, progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    # called directly (the Python API) as well as from `run_bench`: options that would be ignored, miscounted (a size
    # given twice is one curve point of both runs' batches) or fail after the models load raise here too
    check_bench_config(config, METHODS)
    check_ar_options(config)
    _check_batch_config(config)
    prompts = load_prompts(config)
    data_dir = data_folder(config)  # recorded: the folder the prompts were read from
    _check_batch_config(config, len(prompts))
    prompts = curve_prompts(prompts, sorted(config.batch_size))
    target, tokenizer, speculator = load_models(config, target, tokenizer, speculator)
    stop_ids, pad = stop_and_pad_ids(target, tokenizer)
    encoded = [(dataset, prompt_ids(tokenizer, messages)) for dataset, messages in prompts]
    check_prompt_vocabulary((ids for _, ids in encoded), target, TOKENIZER_REMEDY)
    runs = _method_runs(config, speculator, max(len(ids) for _, ids in encoded) + config.max_new_tokens)
    common = {**generate_kwargs(config), "pad_token_id": pad}
    sampling = config.temperature > 0

    def batches(size: int) -> list[int]:  # first prompt of each full batch
        return list(range(0, len(encoded) - len(encoded) % size, size))

    def inputs(start: int, size: int) -> dict:
        input_ids, attention_mask = left_pad([ids for _, ids in encoded[start : start + size]], pad, config.device)
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    sizes = sorted(config.batch_size)
    records, compiled = [], {}
    bar = tqdm(total=sum(len(batches(size)) for size in sizes) * len(runs), desc="bench (batched)",
               disable=not progress)
    for size in sizes:
        for name, kwargs in runs:  # warm-up (and compilation for this shape), excluded
            out, _ = timed_generate(target, **inputs(0, size), **common, **kwargs)
            compiled[size, name] = _forward_compiled(target, {**common, **kwargs}, out)
        for start in batches(size):
            batch = inputs(start, size)
            width = batch["input_ids"].shape[1]
            reference = None
            for name, kwargs in runs:  # interleaved: every method decodes this batch back to back
                torch.manual_seed(config.seed + start)
                out, seconds = timed_generate(target, **batch, **common, **kwargs)
                record = {"batch_size": size, "first_prompt": start, "method": name, "seconds": seconds, "rows": []}
                for row in range(size):  # outside the timing
                    dataset, prompt = encoded[start + row]
                    generated = until_stop(out.sequences[row, width:].tolist(), stop_ids)
                    entry = {"prompt": start + row, "dataset": dataset, "new_tokens": len(generated)}
                    if sampling:
                        sequence = torch.tensor([prompt + generated], device=config.device)
                        entry["mean_logprob"] = mean_target_logprob(target, sequence, len(prompt),
                                                                    config.temperature)
                    elif name != "ar":
                        entry.update(_lossless_check(reference, out, width, config.tie_tolerance, row, stop_ids,
                                                     target.dtype))
                    record["rows"].append(entry)
                record["new_tokens"] = sum(entry["new_tokens"] for entry in record["rows"])
                if getattr(out, "speculation", None) is not None:
                    record["stats"] = out.speculation.to_dict()
                if name == "ar":
                    reference = out
                    # plain batched decoding runs every row until the last one stops: one step per generated column
                    record["row_steps"] = size * (out.sequences.shape[1] - width)
                records.append(record)
                bar.update(1)
    bar.close()
    names = [name for name, _ in runs]
    curve = {str(size): summarize_curve([r for r in records if r["batch_size"] == size], names) for size in sizes}
    for size in sizes:
        for name in names:
            curve[str(size)][name]["compiled"] = compiled[size, name]
    return {"kind": "batch_curve", "config": recorded_config(config),
            "environment": _environment(target, config, speculator, tokenizer, data_dir), "runs": names,
            "batch_sizes": sizes, "curve": curve, "records": records}


def summarize_curve(records: list[dict], runs: list[str]) -> dict:
    """Per method, over the batches of one batch size."""
    summary = {}
    for name in runs:
        calls = [r for r in records if r["method"] == name]
        rows = [row for call in calls for row in call["rows"]]
        tokens, seconds = sum(row["new_tokens"] for row in rows), sum(call["seconds"] for call in calls)
        entry = {"batches": len(calls), "prompts": len(rows), "new_tokens": tokens, "seconds": seconds,
                 "tokens_per_s": tokens / seconds if seconds else 0.0}
        if name == "ar" and calls and "row_steps" in calls[0]:
            entry["finished_row_share"] = 1 - tokens / sum(call["row_steps"] for call in calls)
        if rows and "mismatch" in rows[0]:
            entry["lossless_mismatches"] = sum(row["mismatch"] for row in rows)
            entry["unexplained_mismatches"] = sum(row["unexplained_mismatch"] for row in rows)
        if name != "ar" and rows and "mean_logprob" in rows[0]:
            reference = [row for call in records if call["method"] == "ar" for row in call["rows"]]
            entry["sampling_check"] = _sampling_check(rows, reference)
        if calls and "stats" in calls[0]:
            stats = [call["stats"] for call in calls]
            entry["tau"] = mean_accepted_length([s["accepted_lengths"] for s in stats])
            entry["target_forwards"] = sum(s["target_forwards"] for s in stats)
            entry["forwards_per_batch"] = entry["target_forwards"] / len(calls)
            entry.update(phase_times(stats))
        summary[name] = entry
    for reference in ("ar", "dflash"):
        speed = summary.get(reference, {}).get("tokens_per_s")
        for entry in summary.values():
            if speed:
                entry[f"speedup_vs_{reference}"] = entry["tokens_per_s"] / speed
    return summary


def batch_markdown_table(result: dict) -> str:
    """The curve as a Markdown table, one row per batch size and method, with a footer."""
    sampled = result["config"].get("temperature", 0.0) > 0
    check = "logprob diff vs ar (p)" if sampled else "mismatches (unexplained)"
    lines = ["| batch | method | tau | tokens/s | speedup vs ar | vs dflash | forwards per batch | draft ms | "
             f"refine ms | verify ms | {check} |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def number(entry: dict, key: str, digits: int = 1) -> str:
        return f"{entry[key]:.{digits}f}" if entry.get(key) is not None else "-"

    for size, summary in result["curve"].items():
        for name, e in summary.items():
            tau = "1.00" if name in ("ar", "ar_static") else number(e, "tau", 2)
            phases = " | ".join(number(e, f"{p}_ms") for p in ("draft", "refine", "verify"))
            if name == "ar":
                verdict = ""
            elif e.get("sampling_check", {}).get("prompts"):
                verdict = sampling_check_cell(e["sampling_check"])
            else:
                verdict = f"{e.get('lossless_mismatches', '-')} ({e.get('unexplained_mismatches', '-')})"
            lines.append(f"| {size} | {name} | {tau} | {e['tokens_per_s']:.1f} | {number(e, 'speedup_vs_ar', 2)} | "
                         f"{number(e, 'speedup_vs_dflash', 2)} | {number(e, 'forwards_per_batch')} | {phases} | "
                         f"{verdict} |")
    env, config = result["environment"], result["config"]
    used = ", ".join(f"{size}: {summary['ar']['prompts']}" for size, summary in result["curve"].items())
    source = config["prompts"] or f"datasets {config['datasets']}, " + (
        f"at most {config['limit']} each" if config["limit"] else "all prompts")
    smallest = min(result["batch_sizes"])  # it decoded the most prompts
    mix = Counter(row["dataset"] for record in result["records"] if (record["batch_size"], record["method"]) ==
                  (smallest, "ar") for row in record["rows"])
    first = next(iter(result["curve"].values()))
    finished = ", ".join(f"{size}: {summary['ar']['finished_row_share']:.0%}"
                         for size, summary in result["curve"].items()
                         if "finished_row_share" in summary["ar"]) or "not recorded"
    lines += ["", f"{env['device_name']} ({env['device']}), {env['dtype']}, torch {env['torch']}, transformers "
              f"{env['transformers']}; prompts from {source}, left-padded batches, max_new_tokens "
              f"{config['max_new_tokens']}{_drafts_per_block(result)}{speed_settings_note(env)}"
              f"{prompt_format_note(env)}; prompts used per "
              f"batch size (full batches only): {used}; by dataset: {', '.join(f'{d} {n}' for d, n in mix.items())}. "
              "tokens/s counts each row's tokens up to its first stop; tau is tokens per row per target forward; "
              f"draft, refine and verify ms are per batched step{PHASES_NOTE} {compile_note(first, config)} Plain "
              f"batched generate's row-steps spent on rows that had already stopped: {finished}."]
    if sampled:
        checks = [e.get("sampling_check") for summary in result["curve"].values() for e in summary.values()]
        lines.append(sampling_note(config["temperature"], "rows") + sampling_power_note(checks))
    return "\n".join(lines)


def plot_batch_curve(result: dict, folder: str | Path) -> list[Path]:
    """batch_curve.png: tokens/s by batch size (left) and speedup over plain batched generate (right; left out, with a
    warning, when only ar ran, as the batch-1 plots leave out speedup.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sizes = sorted(int(size) for size in result["curve"])  # results written before sizes were sorted too
    compared = [name for name in result["runs"] if name != "ar"]
    if compared:
        fig, (speed, ratio) = plt.subplots(1, 2, figsize=(9, 3.5))
    else:  # an empty panel would only confuse (and matplotlib warns of a legend without entries)
        from ._warnings import warn_at_caller

        warn_at_caller(f"--plots {folder}: batch_curve.png shows tokens/s only, no speedup: only ar ran, add another "
                       "method to --methods.")
        fig, speed = plt.subplots(1, 1, figsize=(4.5, 3.5))
        ratio = None
    for index, name in enumerate(result["runs"]):
        per_size = [result["curve"][str(size)][name] for size in sizes]
        style = dict(marker="o", label=name, color=f"C{index}")  # one colour per method in both panels
        speed.plot(sizes, [e["tokens_per_s"] for e in per_size], **style)
        if name in compared:
            ratio.plot(sizes, [e["speedup_vs_ar"] for e in per_size], **style)
    for ax in (speed, ratio) if ratio is not None else (speed,):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(size) for size in sizes])
        ax.set_xlabel("batch size")
        ax.legend(fontsize=8)
    speed.set_ylabel("tokens/s (all rows)")
    if ratio is not None:
        ratio.axhline(1.0, color="black", linewidth=0.8)
        ratio.set_ylabel("tokens/s vs plain batched generate")
    fig.tight_layout()
    path = folder / "batch_curve.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
