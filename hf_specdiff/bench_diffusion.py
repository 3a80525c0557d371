"""`hf-specdiff bench` for masked diffusion LMs: forward passes (NFE), speed and accuracy, method by method.

Methods, interleaved prompt by prompt (warm-up excluded):
    steps             ordinary decoding, `steps` denoising steps (default: one token per step)
    threshold         Fast-dLLM threshold unmasking (`--threshold`)
    spiffy            Spiffy over `steps` decoding, with the calibrated draft graph
    spiffy_threshold  Spiffy over threshold unmasking
    ar_base           the causal LM the diffusion LM was adapted from (`--base`, or the base an adapter names),
                      plain greedy `generate`: one forward per token

Per method: mean NFE per prompt, NFE reduction versus `steps`, tokens/s and speedup versus `steps`, accuracy
(GSM8K: the last number against the reference answer; MATH-500: the last \\boxed{} against the reference; code sets:
whether the answer's code parses), and for Spiffy `lossless_mismatches` against the method it speeds up (which is
measured too, before it on each prompt, whether `--methods` lists it or not; 0 in the
exact modes: block-causal models, dual cache) with `unexplained_mismatches`, those not explained by a floating-point
near-tie in the block where they diverge (`first_divergence_gap`, beyond the model dtype's rounding, within
`--tie-tolerance`).

Coherence, for every method: `finished_rate` (answers that end with EOS within the token budget, rather than being
cut off), `repetition` (share of an answer's 4-grams that repeat an earlier one: degenerate loops score high) and,
when the AR base is known, `base_perplexity` (the base's perplexity of the answers given their prompts: how
fluent the base, which wrote fluent text itself, finds them).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
import time
import warnings

import torch

DIFFUSION_METHODS = ("steps", "threshold", "spiffy", "spiffy_threshold", "ar_base")
BASELINE_OF = {"spiffy": "steps", "spiffy_threshold": "threshold"}


def measured_methods(methods) -> list[str]:
    """`methods` in order, each Spiffy method's baseline (`BASELINE_OF`) moved or added before it: its losslessness
    is checked against the baseline's output on the same prompt, which must exist by then."""
    ordered = []
    for method in methods:
        baseline = BASELINE_OF.get(method)
        if baseline is not None and baseline not in ordered:
            ordered.append(baseline)
        if method not in ordered:
            ordered.append(method)
    return ordered


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
    for method in measured_methods(config.methods):
        if method not in DIFFUSION_METHODS:
            raise ValueError(f"Unknown diffusion method {method!r}; choose from {DIFFUSION_METHODS}.")
        if method == "ar_base":
            continue
        threshold = config.threshold if method.endswith("threshold") else None
        configs[method] = DiffusionGenerationConfig(**common, threshold=threshold)
    return configs


# a local folder that holds no model: said as such by the commands that read its tokenizer before its weights
DIFFUSION_FOLDER_REMEDY = ("Point {option} at the folder a diffusion LM's save_pretrained (or `hf-specdiff export`) "
                           "wrote, or leave it out for the shipped one.")


def _load_tokenizer(tokenizer: str | None, model: str | None):
    """The tokenizer --tokenizer names, else the one saved beside the diffusion LM (a folder without one: an error
    that names --tokenizer too; a folder without a model: an error saying so)."""
    from ._hub import check_folder_or_repo_id, check_model_folder, check_tokenizer_folder
    from .diffusion import load_tokenizer

    if tokenizer is None:
        check_model_folder(model, "diffusion LM", DIFFUSION_FOLDER_REMEDY.format(option="--target"))
        check_tokenizer_folder(model, "diffusion LM", ", or pass --tokenizer (a folder or Hub id holding it)")
        return load_tokenizer(model)
    check_folder_or_repo_id(tokenizer, "tokenizer")
    return load_tokenizer(tokenizer)


def run_diffusion_bench(config, model=None, tokenizer=None, graph=None, base_model=None,
                        progress: bool = True) -> dict:
    """Every diffusion method on every prompt of `config` (a BenchConfig); returns summary, by_dataset, records.
    `base_model`: the causal LM the diffusion LM was adapted from, when given in memory."""
    from tqdm.auto import tqdm

    from .bench import NEAR_TIE_ULPS, _environment, data_folder, prompt_ids, prompt_messages, torch_dtype
    from .candidates import synchronize
    from .diffusion import AutoDiffusionLM, DiffusionGenerationConfig, diffusion_generate
    from .diffusion.adapter_weights import load_base, named_base
    from .diffusion.decoding import out_of_vocabulary
    from .spiffy import DraftGraph

    from .bench import check_bench_config, check_diffusion_options

    check_bench_config(config, DIFFUSION_METHODS)
    check_diffusion_options(config)
    if list(config.batch_size) != [1]:
        raise ValueError(f"Diffusion benchmarks decode prompt by prompt; drop --batch-size {config.batch_size} (the "
                         "batch curve measures the autoregressive speculative methods).")
    dtype = torch_dtype(config.dtype)
    if model is None:
        from .embedded import default_diffusion_lm_path

        if config.target is None:  # the one shipped for the embedded SmolLM2, as AR methods default to its speculator
            config = dataclasses.replace(config, target=str(default_diffusion_lm_path()))
        # first: a folder saved without its tokenizer fails at once
        tokenizer = _load_tokenizer(config.tokenizer, config.target)
        model = AutoDiffusionLM.from_pretrained(config.target, dtype=dtype)
    if tokenizer is None:
        if config.target is None and config.tokenizer is None:
            raise ValueError("A diffusion LM given in memory needs its tokenizer: pass tokenizer= (or config.tokenizer "
                             "or config.target, a folder or Hub id the tokenizer can be read from).")
        tokenizer = _load_tokenizer(config.tokenizer, config.target)
    model = model.to(config.device).eval()
    if base_model is None:
        base_name = config.base or (named_base(config.target) if config.target else None)
        if "ar_base" in config.methods and base_name is None:
            raise ValueError("ar_base needs the causal LM the diffusion LM was adapted from: pass --base (a folder or "
                             "Hub id); adapters trained by hf-specdiff name theirs.")
        base_model = load_base(base_name).to(device=config.device, dtype=dtype) if base_name else None
    if base_model is not None:
        base_model = base_model.eval()
        if base_model.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"The AR base has {base_model.config.vocab_size} tokens and the diffusion LM "
                             f"{model.config.vocab_size}: --base must be the model the diffusion LM was adapted from.")
    spiffy_measured = any(m.startswith("spiffy") for m in measured_methods(config.methods))
    if spiffy_measured and graph is None:
        if config.draft_graph is None and config.target is None:
            raise ValueError("Spiffy methods need --draft-graph (a folder holding spiffy_graph.json).")
        graph = DraftGraph.from_pretrained(config.draft_graph or config.target)
    # one block length for every method, so that their NFE compare: --block-length, else the graph's where Spiffy is
    # measured, else the model's own; recorded in the result as the one decoded with
    blocks = DiffusionGenerationConfig(max_new_tokens=config.max_new_tokens, block_length=config.block_length,
                                       steps=config.steps).for_model(model, graph if spiffy_measured else None)
    config = dataclasses.replace(config, block_length=blocks.block_length)
    configs = _decoding_configs(config)
    rows = _rows_not_used_for_calibration(config, graph)
    data_dir = data_folder(config)  # recorded: the folder the prompts were read from
    if not rows:
        raise ValueError(f"No prompts to measure (limit={config.limit}, datasets {list(config.datasets)}, the graph's "
                         "calibration prompts left out): raise --limit or bench other datasets.")
    encoded = [
        (dataset, row, torch.tensor([prompt_ids(tokenizer, prompt_messages(dataset, row))], device=config.device))
        for dataset, row in rows
    ]
    for _, _, ids in encoded:  # another model's tokenizer: said here, not as an IndexError in the first forward
        if (token := out_of_vocabulary(ids, None, model)) is not None:
            raise ValueError(f"The tokenizer writes token id {token}, but the diffusion LM has "
                             f"{model.config.vocab_size} tokens: pass the tokenizer the model was trained with "
                             "(--tokenizer, or tokenizer=).")
    eos = tokenizer.eos_token_id
    methods = measured_methods(config.methods)
    # One graph serves spiffy and spiffy_threshold, so one of the two decodes with other settings than the graph was
    # calibrated with (fewer drafts accepted, output as exact): recorded in the result and said under its table,
    # not warned as if the command were wrong
    graph_differences = {m: d for m in methods if m.startswith("spiffy")
                         if (d := graph.calibration_differences(configs[m], model))}
    # from the weights: a DiffusionAdapter (your own model) is a plain nn.Module, without DiffusionLM's `dtype`
    weights_dtype = next(model.parameters()).dtype

    def generate(ids, method):
        synchronize(ids.device)
        start = time.perf_counter()
        if method == "ar_base":
            # sampled at the diffusion methods' temperature, greedy at 0
            sampling = dict(do_sample=True, temperature=config.temperature) if config.temperature > 0 else dict(
                do_sample=False)
            sequences = base_model.generate(ids, attention_mask=torch.ones_like(ids),
                                            max_new_tokens=config.max_new_tokens, eos_token_id=eos, pad_token_id=eos,
                                            **sampling)
            nfe, exact, accepted = sequences.shape[1] - ids.shape[1], True, 0  # a forward per token, prefill's too
        else:
            spiffy = graph if method.startswith("spiffy") else None
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="This Spiffy graph was calibrated with other decoding")
                out = diffusion_generate(model, ids, config=configs[method], draft_graph=spiffy, eos_token_id=eos)
            sequences, nfe, exact, accepted = out.sequences, out.nfe, out.exact, sum(map(sum, out.accepted_drafts))
        synchronize(ids.device)
        return sequences, nfe, exact, accepted, time.perf_counter() - start

    for method in methods:  # warm-up, excluded
        generate(encoded[0][2], method)
    records = []
    bar = tqdm(total=len(encoded) * len(methods), desc="bench (diffusion)", disable=not progress)
    for index, (dataset, row, ids) in enumerate(encoded):
        outputs = {}
        for method in methods:
            sequences, nfe, exact, accepted, seconds = generate(ids, method)
            answer_ids, finished = answer_until_eos(sequences[0, ids.shape[1] :], eos)
            text = tokenizer.decode(answer_ids, skip_special_tokens=True)
            outputs[method] = sequences
            record = {"dataset": dataset, "prompt": index, "method": method, "seconds": seconds, "nfe": nfe,
                      "new_tokens": len(answer_ids), "correct": score(dataset, row, text), "exact": exact,
                      "accepted_drafts": accepted, "finished": finished, "repetition": repeated_ngram_share(answer_ids),
                      "answer": text}
            if base_model is not None:  # outside the timing
                record["base_nll"] = answer_nll(base_model, ids, answer_ids, eos if finished else None)
            if method in BASELINE_OF and BASELINE_OF[method] in outputs:
                reference = outputs[BASELINE_OF[method]]
                record["mismatch"] = not torch.equal(reference, sequences)
                record["unexplained_mismatch"] = record["mismatch"]
                if record["mismatch"]:  # outside the timing: was the first diverging block decided by a near-tie?
                    gap = first_divergence_gap(model, ids, configs[BASELINE_OF[method]], reference, sequences, eos,
                                               rounding=NEAR_TIE_ULPS * torch.finfo(weights_dtype).eps)
                    record["decision_gap"] = gap
                    record["unexplained_mismatch"] = gap is None or gap > config.tie_tolerance
            records.append(record)
            bar.update(1)
    bar.close()
    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    return {"config": _config_dict(config),
            "environment": _environment(model, config, tokenizer=tokenizer, data_dir=data_dir),
            "runs": methods,
            "graph_calibration_differences": graph_differences,
            "summary": summarize_diffusion(records, methods),
            "by_dataset": {d: summarize_diffusion([r for r in records if r["dataset"] == d], methods)
                           for d in datasets},
            "records": records}


def answer_until_eos(answer_ids: torch.LongTensor, eos: int | None) -> tuple[torch.LongTensor, bool]:
    """(the answer's tokens before its first EOS, whether it has one): what a row's answer is, and what its tokens/s
    count (the canvas after an EOS holds filler a reader never sees)."""
    stop = (answer_ids == eos).nonzero() if eos is not None else answer_ids.new_zeros((0, 1))
    return (answer_ids[: int(stop[0, 0])], True) if len(stop) else (answer_ids, False)


def first_divergence_gap(model, ids, decoding, reference, sequences, eos, rounding: float = 0.0) -> float | None:
    """How close ordinary decoding (`reference`) came to deciding otherwise in the block where `sequences` first
    differs from it: the smallest gap, over that block's steps, between a decision and its runner-up, in logit units
    where the rule allows. Token choice: gap between the top two logits at each position unmasked. Position choice:
    gap between the last position unmasked and the next one, and with a threshold, distance of any masked position to
    it, in log-odds of the confidence for `low_confidence` (a near-certain position's probability is 1 - eps, whose
    rounding is eps-sized) and relative otherwise. A gap within floating-point noise means a wider forward (Spiffy's,
    with drafts) could flip the decision: a near-tie, not a bug. `rounding` (relative: a few units of the model
    dtype's rounding) is what a logit of size x may differ by between forwards, times x; each gap is given beyond
    that much at its step's largest logit (in bf16 a logit of 20 rounds to steps of 0.125). Re-runs ordinary decoding
    with a recorder; None for decoding whose decisions are driven by noise (temperature > 0, random remasking)."""
    from .diffusion import diffusion_generate
    from .diffusion.decoding import Canvas, confidence, without_mask_token

    if decoding.temperature > 0 or decoding.remasking == "random":
        return None
    prompt_length, block_length, mask_id = ids.shape[1], decoding.block_length, model.mask_token_id
    a, b = reference[0, prompt_length:], sequences[0, prompt_length:]
    n = min(len(a), len(b))
    diverged = (a[:n] != b[:n]).nonzero()
    first = int(diverged[0, 0]) if len(diverged) else n
    layout = Canvas(model, ids, None, decoding)  # where decoding puts answer token `first`, block by block
    block = (int(layout.answer_start[0]) + first - layout.start) // block_length
    log_odds = decoding.remasking == "low_confidence"
    if decoding.threshold is not None:
        t = torch.tensor(decoding.threshold, dtype=torch.float64)
        threshold = (t.log() - (-t).log1p()) if log_odds else t
    gaps = []

    def record(step_block, step, before, logits, after):
        if step_block != block:
            return
        masked, unmasked = before[0] == mask_id, (before[0] == mask_id) & (after[0] != mask_id)
        logits = without_mask_token(logits[0], mask_id)
        top2 = logits.topk(2, dim=-1)
        # logit rounding moves logit gaps and log-odds by about this much, and probabilities by this factor
        noise = rounding * float(top2.values[:, 0].abs().max())
        step_gaps = [float((top2.values[unmasked, 0] - top2.values[unmasked, 1]).min())]
        if log_odds:  # log p1 / (1 - p1) = top logit - logsumexp of the others
            others = logits.scatter(-1, top2.indices[:, :1], -torch.inf).logsumexp(dim=-1)
            score, distance = top2.values[:, 0] - others, lambda x, y: float((x - y).abs())
        else:
            score = confidence(logits, decoding.remasking)[1]
            distance = lambda x, y: float((x - y).abs() / torch.maximum(x.abs(), y.abs()).clamp_min(1e-300))  # noqa: E731
        ranked = score[masked].sort(descending=True).values
        k = int(unmasked.sum())
        if k < len(ranked):
            step_gaps.append(distance(ranked[k - 1], ranked[k]))
        if decoding.threshold is not None:
            step_gaps.append(min(distance(c, threshold) for c in ranked))
        gaps.extend(max(0.0, gap - noise) for gap in step_gaps)

    diffusion_generate(model, ids, config=decoding, eos_token_id=eos, recorder=record)
    return min(gaps) if gaps else None


def repeated_ngram_share(tokens: torch.LongTensor, n: int = 4) -> float:
    """Share of the n-grams of `tokens` that already occurred earlier in it (0 for fewer than n + 1 tokens)."""
    grams = [tuple(tokens[i : i + n].tolist()) for i in range(len(tokens) - n + 1)]
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0


@torch.no_grad()
def answer_nll(base_model, prompt_ids: torch.LongTensor, answer_ids: torch.LongTensor, eos: int | None) -> tuple:
    """(summed negative log-likelihood, token count) of the answer (and its EOS, when it ended with one) given the
    prompt, under the causal LM `base_model`."""
    target = answer_ids if eos is None else torch.cat([answer_ids, answer_ids.new_tensor([eos])])
    if not len(target):
        return 0.0, 0
    sequence = torch.cat([prompt_ids[0], target])[None]
    logits = base_model(input_ids=sequence).logits[0, prompt_ids.shape[1] - 1 : -1].float()
    return float(torch.nn.functional.cross_entropy(logits, target, reduction="sum")), len(target)


def _rows_not_used_for_calibration(config, graph) -> list[tuple[str, dict]]:
    """`limit` rows per dataset in the bench's seeded order, skipping the prompts the graph was calibrated on (the
    graph records their datasets, seed and count), so that Spiffy is measured on prompts it has not seen."""
    from dataclasses import replace

    from .bench import BenchConfig, load_rows

    seen = set()
    calibration = graph.calibration if graph is not None else {}
    if config.prompts is None and {"datasets", "prompt_seed", "limit"} <= set(calibration):
        shared = [name for name in calibration["datasets"] if name in config.datasets]  # the others cannot overlap
        used = load_rows(BenchConfig(datasets=shared, limit=calibration["limit"], seed=calibration["prompt_seed"],
                                     data_dir=config.data_dir)) if shared else []
        seen = {json.dumps(row, sort_keys=True) for _, row in used}
    if not seen:
        return load_rows(config)
    rows = load_rows(replace(config, limit=config.limit and config.limit + len(seen)))  # 0: all of them
    kept, count = [], {}
    for dataset, row in rows:
        if json.dumps(row, sort_keys=True) not in seen and count.get(dataset, 0) < (config.limit or len(rows)):
            kept.append((dataset, row))
            count[dataset] = count.get(dataset, 0) + 1
    return kept


def _config_dict(config) -> dict:
    from .bench import recorded_config

    return recorded_config(config)


def summarize_diffusion(records: list[dict], methods: list[str]) -> dict:
    summary = {}
    for method in methods:
        rows = [r for r in records if r["method"] == method]
        tokens, seconds, nfe = (sum(r[k] for r in rows) for k in ("new_tokens", "seconds", "nfe"))
        scored = [r["correct"] for r in rows if r["correct"] is not None]
        entry = {"prompts": len(rows), "nfe": nfe / max(len(rows), 1),
                 "tokens_per_s": tokens / seconds if seconds else 0.0,
                 "seconds": seconds, "new_tokens": tokens,
                 "accuracy": sum(scored) / len(scored) if scored else None, "exact": all(r["exact"] for r in rows),
                 "finished_rate": sum(r["finished"] for r in rows) / max(len(rows), 1),
                 "repetition": sum(r["repetition"] for r in rows) / max(len(rows), 1)}
        nll = [r["base_nll"] for r in rows if "base_nll" in r]
        if nll and sum(n for _, n in nll):
            entry["base_perplexity"] = math.exp(sum(x for x, _ in nll) / sum(n for _, n in nll))
        if method.startswith("spiffy"):
            entry["accepted_drafts_per_prompt"] = sum(r["accepted_drafts"] for r in rows) / max(len(rows), 1)
        if any("mismatch" in r for r in rows):
            entry["lossless_mismatches"] = sum(r.get("mismatch", False) for r in rows)
            entry["unexplained_mismatches"] = sum(r.get("unexplained_mismatch", False) for r in rows)
        summary[method] = entry
    base = summary.get("steps")
    for entry in summary.values():
        entry["nfe_reduction_vs_steps"] = base["nfe"] / entry["nfe"] if base and entry["nfe"] else None
        entry["speedup_vs_steps"] = (entry["tokens_per_s"] / base["tokens_per_s"]
                                     if base and base["tokens_per_s"] else None)
    return summary


def calibration_note(differences: dict[str, list[str]]) -> str:
    """What a result's `graph_calibration_differences` mean, for the table and the terminal."""
    listed = "; ".join(f"{method}: {', '.join(found)}" for method, found in differences.items())
    return (f"the Spiffy graph was calibrated with other decoding settings than {', '.join(differences)} ({listed}): "
            "their output is as exact, though fewer drafts may be accepted than with a graph calibrated for them.")


def diffusion_markdown_table(result: dict) -> str:
    from .bench import prompt_format_note, speed_settings_note

    lines = ["| dataset | method | NFE | NFE reduction | tokens/s | speedup | accuracy | finished | repeated 4-grams | "
             "base ppl | mismatches (unexplained) | exact |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups = list(result["by_dataset"].items()) + [("all", result["summary"])]
    for dataset, summary in groups:
        for method, e in summary.items():
            fmt = lambda v, spec, unit="": "-" if v is None else format(v, spec) + unit  # noqa: E731
            lines.append(f"| {dataset} | {method} | {e['nfe']:.1f} | {fmt(e['nfe_reduction_vs_steps'], '.2f', 'x')} | "
                         f"{e['tokens_per_s']:.1f} | {fmt(e['speedup_vs_steps'], '.2f', 'x')} | "
                         f"{fmt(e['accuracy'], '.2f')} | {fmt(e.get('finished_rate'), '.2f')} | "
                         f"{fmt(e.get('repetition'), '.2f')} | {fmt(e.get('base_perplexity'), '.1f')} | "
                         f"{_mismatches(e)} | {e['exact']} |")
    env = result["environment"]
    lines.append("")
    lines.append(f"{env.get('device')}, {env.get('dtype')}, torch {env.get('torch')}, transformers "
                 f"{env.get('transformers')}{speed_settings_note(env)}{prompt_format_note(env)}; accuracy: GSM8K / "
                 "MATH-500 answer match, "
                 "code sets: code parses; finished: answers ending with EOS within the budget; repeated 4-grams: "
                 "share of an answer's 4-grams seen earlier in it; base ppl: the AR base's perplexity of the answers.")
    decoded = result.get("config") or {}
    if decoded.get("block_length"):  # (left out, it is the graph's or the model's own: said, as it sets the NFE)
        lines[-1] += (f" Decoded in blocks of {decoded['block_length']} tokens, {decoded.get('max_new_tokens')} "
                      f"tokens per answer, cache {decoded.get('cache')!r}.")
    if differences := result.get("graph_calibration_differences"):  # (absent from results of earlier versions)
        lines.append(f"\nNote: {calibration_note(differences)}")
    return "\n".join(lines)


def _mismatches(entry: dict) -> str:
    if "lossless_mismatches" not in entry:
        return ""
    return f"{entry['lossless_mismatches']} ({entry.get('unexplained_mismatches', '-')})"


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
