"""What a draft vocabulary buys and costs: one speculator drafting over N tokens and over all of them, side by side.

A draft vocabulary (`hf_specdiff/draft_vocab.py`) makes the drafter's and the add-on's read-outs cheaper and makes
the tokens outside it undraftable. This script measures both sides for vocabularies of several sizes, built from the
target's own answers (distill JSONL files):

1. coverage: the share of the tokens of held-out answers (the last `--holdout` rows of each file, in a seeded order)
   that a vocabulary built from the other rows holds;
2. speed: `generate` on benchmark prompts with each method, the speculator with each vocabulary and without one,
   interleaved prompt by prompt with plain `generate` (same cache) so that drift hits all alike: tau, ms per block of
   draft, refine and verify, tokens/s against the whole vocabulary's and plain generate's, and whether every output
   is plain generate's (it must be: verification is unchanged).

    python examples/draft_vocab_ab.py --data DISTILL.jsonl ... [--sizes 4096 8192 16384] [--datasets gsm8k mt_bench]
        [--limit 8] [--methods dflash xpress] [--num-draft-tokens 3] [--static] [--speculator PATH]

`--static` runs the static-cache loop compiled as `generate` compiles it (with `--static`, on any device).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict

import torch
from tqdm.auto import tqdm

import hf_specdiff
from hf_specdiff import AutoSpeculator, Speculator, _compat
from hf_specdiff.bench import BenchConfig, load_prompts
from hf_specdiff.draft_vocab import top_tokens
from hf_specdiff.embedded import default_speculator_path, load_default_target


def read_answers(paths: list[str], holdout: int, seed: int) -> tuple[list[list[int]], dict[str, list[list[int]]]]:
    """Answer token ids of every distill row: (those to build from, {file: its held-out ones})."""
    build, held = [], {}
    for path in paths:
        with open(path) as rows:
            answers = [json.loads(line)["response_ids"] for line in rows if line.strip()]
        random.Random(seed).shuffle(answers)
        held[path], build = answers[:holdout], build + answers[holdout:]
    return build, held


def coverage(vocab: torch.LongTensor, answers: list[list[int]]) -> float:
    kept = set(vocab.tolist())
    return sum(token in kept for answer in answers for token in answer) / max(sum(map(len, answers)), 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", nargs="+", required=True, help="distill JSONL files (the target's own answers)")
    parser.add_argument("--sizes", nargs="+", type=int, default=[4096, 8192, 16384])
    parser.add_argument("--holdout", type=int, default=450, help="answers per file kept out of the vocabulary")
    parser.add_argument("--datasets", nargs="+", default=["gsm8k", "mt_bench"])
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--data-dir")
    parser.add_argument("--methods", nargs="+", default=["dflash", "xpress"])
    parser.add_argument("--num-draft-tokens", type=int)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--static", action="store_true", help="static caches, compiled on any device")
    parser.add_argument("--speculator", default=None, help="default: the one shipped for the embedded target")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    build, held = read_answers(args.data, args.holdout, args.seed)
    vocabs = {size: top_tokens(build, size) for size in args.sizes}
    print(f"coverage of held-out answers ({args.holdout} per file) by the N tokens most frequent in the other "
          f"{len(build)}:")
    for path, answers in held.items():
        print(f"  {path}: " + "  ".join(f"N={size} {coverage(v, answers):.4f}" for size, v in vocabs.items()))

    target, tokenizer = load_default_target()
    hf_specdiff.enable(target)
    full = AutoSpeculator.from_pretrained(args.speculator or default_speculator_path()).to(target.dtype)
    full.draft_vocab = None
    speculators = {"full": full}
    for size in args.sizes:  # the same weights; only the vocabulary differs
        speculators[f"N={size}"] = Speculator(full.drafter, full.refiner, full.markov_head, draft_vocab=vocabs[size])
    prompts = load_prompts(BenchConfig(datasets=args.datasets, limit=args.limit, data_dir=args.data_dir))
    extra = {} if args.num_draft_tokens is None else {"num_draft_tokens": args.num_draft_tokens}
    if args.static:
        longest = max(len(tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=True)["input_ids"])
                      for _, m in prompts)  # one cache size for every call: nothing recompiles after the warm-up
        extra.update(cache_implementation="static", max_cache_len=longest + args.max_new_tokens + 64,
                     compile_config=_compat.compile_config_for_all_devices())
    totals = defaultdict(lambda: defaultdict(float))
    mismatches = defaultdict(int)
    runs = enumerate([prompts[0]] + prompts)  # the first pass warms up (and compiles)
    for number, (_, messages) in tqdm(runs, total=len(prompts) + 1, desc="prompts"):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        # plain generate with the same cache (and compilation): the reference output and the baseline speed
        plain_kwargs = {k: v for k, v in extra.items() if k != "num_draft_tokens"}
        start = time.perf_counter()
        reference = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, **plain_kwargs)
        if number:
            totals["plain", ""]["tokens"] += reference.shape[1] - ids.shape[1]
            totals["plain", ""]["seconds"] += time.perf_counter() - start
        for method in args.methods:
            for name, speculator in speculators.items():
                start = time.perf_counter()
                out = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                      assistant_model=speculator, speculation=method, return_dict_in_generate=True,
                                      **extra)
                seconds = time.perf_counter() - start
                if number == 0:
                    continue
                stats, row = out.speculation, totals[method, name]
                mismatches[method, name] += not torch.equal(out.sequences, reference)
                row["accepted"] += sum(stats.accepted_lengths)
                row["steps"] += len(stats.accepted_lengths)
                row["blocks"] += stats.blocks - 1  # draft_seconds leaves out the first block
                row["resolved"] += stats.blocks
                row["draft"] += stats.draft_seconds
                row["refine"] += stats.refine_seconds
                row["verify"] += stats.verify_seconds
                row["tokens"] += out.sequences.shape[1] - ids.shape[1]
                row["seconds"] += seconds

    print(f"\n{len(prompts)} prompts ({', '.join(args.datasets)}), {args.max_new_tokens} new tokens, greedy, "
          f"{'static + compiled' if args.static else 'eager'}, drafts per block: {args.num_draft_tokens or 'all'}")
    plain = totals["plain", ""]["tokens"] / totals["plain", ""]["seconds"]
    print(f"plain generate (same cache): {plain:.2f} tokens/s")
    print(f"{'method':8} {'vocabulary':>11} {'tau':>6} {'draft ms':>9} {'refine ms':>10} {'verify ms':>10} "
          f"{'tokens/s':>9} {'vs full':>8} {'vs plain':>9} {'mismatches':>10}")
    for method in args.methods:
        base = totals[method, "full"]["tokens"] / totals[method, "full"]["seconds"]
        for name in speculators:
            row = totals[method, name]
            speed = row["tokens"] / row["seconds"]
            print(f"{method:8} {name:>11} {row['accepted'] / row['steps']:6.3f} "
                  f"{1000 * row['draft'] / max(row['blocks'], 1):9.2f} {1000 * row['refine'] / row['resolved']:10.2f} "
                  f"{1000 * row['verify'] / row['steps']:10.2f} {speed:9.2f} {speed / base:8.3f} {speed / plain:9.3f} "
                  f"{mismatches[method, name]:10d}")


if __name__ == "__main__":
    main()
