"""`hf-specdiff bench` for masked diffusion LMs: forward passes (NFE), speed and accuracy, method by method.

Methods, interleaved prompt by prompt (warm-up excluded):
    steps             ordinary decoding, `steps` denoising steps (default: one token per step)
    threshold         Fast-dLLM threshold unmasking (`--threshold`)
    spiffy            Spiffy over `steps` decoding, with the calibrated draft graph
    spiffy_threshold  Spiffy over threshold unmasking

Per method: mean NFE per prompt, NFE reduction versus `steps`, tokens/s and speedup versus `steps`, accuracy
(GSM8K: the last number against the reference answer; MATH-500: the last \\boxed{} against the reference; code sets:
whether the answer's code parses), and for Spiffy `lossless_mismatches` against the method it speeds up (0 in the
exact modes: block-causal models, dual cache).
"""

from __future__ import annotations

import ast
import json
import re
import time

import torch

DIFFUSION_METHODS = ("steps", "threshold", "spiffy", "spiffy_threshold")
BASELINE_OF = {"spiffy": "steps", "spiffy_threshold": "threshold"}


# ----------------------------------------------------------------------------------------------------------------
# Accuracy
# ----------------------------------------------------------------------------------------------------------------


def _last_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d[\d,]*\.?\d*", text)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _normalise_math(answer: str) -> str:
    return re.sub(r"\s|\$|\\!|\\left|\\right|\\,", "", answer).replace("dfrac", "frac").replace("tfrac", "frac")


def _code_parses(text: str) -> bool:
    blocks = re.findall(r"```(?:python)?\n(.*?)```", text, flags=re.S)
    code = blocks[0] if blocks else text
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return "def " in code


def score(dataset: str, row: dict, answer: str) -> bool | None:
    """Whether `answer` is right (GSM8K, MATH-500) or its code parses (HumanEval, MBPP); None where unscored."""
    if dataset == "gsm8k":
        gold = row["answer"].split("####")[-1].strip().replace(",", "")
        predicted = _last_number(answer)
        try:
            return predicted is not None and abs(float(predicted) - float(gold)) < 1e-6
        except ValueError:
            return predicted == gold
    if dataset == "math500":
        predicted = _last_boxed(answer)
        return predicted is not None and _normalise_math(predicted) == _normalise_math(row["answer"])
    if dataset in ("humaneval", "mbpp"):
        return _code_parses(answer)
    return None


# ----------------------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------------------


def _decoding_configs(config) -> dict:
    from .diffusion import DiffusionGenerationConfig

    common = dict(max_new_tokens=config.max_new_tokens, block_length=config.block_length, steps=config.steps,
                  remasking=config.remasking, temperature=config.temperature, cache=config.cache,
                  max_drafts=config.max_drafts, seed=config.seed)
    configs = {}
    for method in config.methods:
        if method not in DIFFUSION_METHODS:
            raise ValueError(f"Unknown diffusion method {method!r}; choose from {DIFFUSION_METHODS}.")
        threshold = config.threshold if method.endswith("threshold") else None
        configs[method] = DiffusionGenerationConfig(**common, threshold=threshold)
    return configs


def run_diffusion_bench(config, model=None, tokenizer=None, graph=None, progress: bool = True) -> dict:
    """Every diffusion method on every prompt of `config` (a BenchConfig); returns summary, by_dataset, records."""
    from tqdm.auto import tqdm

    from .bench import _environment, prompt_messages
    from .candidates import synchronize
    from .diffusion import AutoDiffusionLM, diffusion_generate, load_tokenizer
    from .spiffy import DraftGraph

    if list(config.batch_size) != [1]:
        raise ValueError(f"Diffusion benchmarks decode prompt by prompt; drop --batch-size {config.batch_size} (the "
                         "batch curve measures the autoregressive speculative methods).")
    dtype = getattr(torch, config.dtype)
    if model is None:
        if config.target is None:
            raise ValueError("Diffusion benchmarks need --target: a diffusion LM folder or Hub id.")
        model = AutoDiffusionLM.from_pretrained(config.target, dtype=dtype)
        tokenizer = load_tokenizer(config.target)
    model = model.to(config.device).eval()
    configs = _decoding_configs(config)
    if any(m.startswith("spiffy") for m in configs) and graph is None:
        if config.draft_graph is None and config.target is None:
            raise ValueError("Spiffy methods need --draft-graph (a folder holding spiffy_graph.json).")
        graph = DraftGraph.from_pretrained(config.draft_graph or config.target)
    rows = _rows_not_used_for_calibration(config, graph)
    encoded = [
        (dataset, row, tokenizer.apply_chat_template(prompt_messages(dataset, row), add_generation_prompt=True,
                                                     return_tensors="pt", return_dict=True)["input_ids"].to(config.device))
        for dataset, row in rows
    ]
    eos = tokenizer.eos_token_id

    def generate(ids, method):
        spiffy = graph if method.startswith("spiffy") else None
        synchronize(ids.device)
        start = time.perf_counter()
        out = diffusion_generate(model, ids, config=configs[method], draft_graph=spiffy, eos_token_id=eos)
        synchronize(ids.device)
        return out, time.perf_counter() - start

    for method in configs:  # warm-up, excluded
        generate(encoded[0][2], method)
    records = []
    bar = tqdm(total=len(encoded) * len(configs), desc="bench (diffusion)", disable=not progress)
    for index, (dataset, row, ids) in enumerate(encoded):
        outputs = {}
        for method in configs:
            out, seconds = generate(ids, method)
            answer_ids = out.sequences[0, ids.shape[1] :]
            stop = (answer_ids == eos).nonzero()
            answer_ids = answer_ids[: int(stop[0, 0]) if len(stop) else len(answer_ids)]
            text = tokenizer.decode(answer_ids, skip_special_tokens=True)
            outputs[method] = out.sequences
            record = {"dataset": dataset, "prompt": index, "method": method, "seconds": seconds, "nfe": out.nfe,
                      "new_tokens": len(answer_ids), "correct": score(dataset, row, text), "exact": out.exact,
                      "accepted_drafts": sum(map(sum, out.accepted_drafts)), "answer": text}
            if method in BASELINE_OF and BASELINE_OF[method] in outputs:
                record["mismatch"] = not torch.equal(outputs[BASELINE_OF[method]], out.sequences)
            records.append(record)
            bar.update(1)
    bar.close()
    methods = list(configs)
    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    return {"config": _config_dict(config), "environment": _environment(model, config), "runs": methods,
            "summary": summarize_diffusion(records, methods),
            "by_dataset": {d: summarize_diffusion([r for r in records if r["dataset"] == d], methods) for d in datasets},
            "records": records}


def _rows_not_used_for_calibration(config, graph) -> list[tuple[str, dict]]:
    """`limit` rows per dataset in the bench's seeded order, skipping the prompts the graph was calibrated on (the
    graph records their datasets, seed and count), so that Spiffy is measured on prompts it has not seen."""
    from dataclasses import replace

    from .bench import BenchConfig, load_rows

    seen = set()
    calibration = graph.calibration if graph is not None else {}
    if config.prompts is None and {"datasets", "prompt_seed", "limit"} <= set(calibration):
        used = load_rows(BenchConfig(datasets=calibration["datasets"], limit=calibration["limit"],
                                     seed=calibration["prompt_seed"], data_dir=config.data_dir))
        seen = {json.dumps(row, sort_keys=True) for _, row in used}
    if not seen:
        return load_rows(config)
    rows = load_rows(replace(config, limit=config.limit + len(seen)))
    kept, count = [], {}
    for dataset, row in rows:
        if json.dumps(row, sort_keys=True) not in seen and count.get(dataset, 0) < config.limit:
            kept.append((dataset, row))
            count[dataset] = count.get(dataset, 0) + 1
    return kept


def _config_dict(config) -> dict:
    from dataclasses import asdict

    return asdict(config)


def summarize_diffusion(records: list[dict], methods: list[str]) -> dict:
    summary = {}
    for method in methods:
        rows = [r for r in records if r["method"] == method]
        tokens, seconds, nfe = (sum(r[k] for r in rows) for k in ("new_tokens", "seconds", "nfe"))
        scored = [r["correct"] for r in rows if r["correct"] is not None]
        entry = {"prompts": len(rows), "nfe": nfe / max(len(rows), 1), "tokens_per_s": tokens / seconds if seconds else 0.0,
                 "seconds": seconds, "new_tokens": tokens,
                 "accuracy": sum(scored) / len(scored) if scored else None, "exact": all(r["exact"] for r in rows)}
        if method.startswith("spiffy"):
            entry["accepted_drafts_per_prompt"] = sum(r["accepted_drafts"] for r in rows) / max(len(rows), 1)
        if any("mismatch" in r for r in rows):
            entry["lossless_mismatches"] = sum(r.get("mismatch", False) for r in rows)
        summary[method] = entry
    base = summary.get("steps")
    for entry in summary.values():
        entry["nfe_reduction_vs_steps"] = base["nfe"] / entry["nfe"] if base and entry["nfe"] else None
        entry["speedup_vs_steps"] = entry["tokens_per_s"] / base["tokens_per_s"] if base and base["tokens_per_s"] else None
    return summary


def diffusion_markdown_table(result: dict) -> str:
    lines = ["| dataset | method | NFE | NFE reduction | tokens/s | speedup | accuracy | mismatches | exact |",
             "|---|---|---|---|---|---|---|---|---|"]
    groups = list(result["by_dataset"].items()) + [("all", result["summary"])]
    for dataset, summary in groups:
        for method, e in summary.items():
            fmt = lambda v, spec: "" if v is None else format(v, spec)  # noqa: E731
            lines.append(f"| {dataset} | {method} | {e['nfe']:.1f} | {fmt(e['nfe_reduction_vs_steps'], '.2f')}x | "
                         f"{e['tokens_per_s']:.1f} | {fmt(e['speedup_vs_steps'], '.2f')}x | "
                         f"{fmt(e['accuracy'], '.2f')} | {e.get('lossless_mismatches', '')} | {e['exact']} |")
    env = result["environment"]
    lines.append("")
    lines.append(f"{env.get('device')}, {env.get('dtype')}, torch {env.get('torch')}, transformers "
                 f"{env.get('transformers')}; accuracy: GSM8K / MATH-500 answer match, code sets: code parses.")
    return "\n".join(lines)


def plot_diffusion(result: dict, folder) -> list:
    """nfe.png: mean forward passes per prompt by method and dataset (log scale)."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    groups = list(result["by_dataset"].items())
    methods = result["runs"]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(groups), 3.6))
    width = 0.8 / len(methods)
    for k, method in enumerate(methods):
        ax.bar([i + k * width for i in range(len(groups))], [s[method]["nfe"] for _, s in groups], width, label=method)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], [d for d, _ in groups])
    ax.set_yscale("log")
    ax.set_ylabel("forward passes per prompt (NFE)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = folder / "nfe.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
