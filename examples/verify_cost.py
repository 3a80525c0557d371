"""What one target forward costs by how many tokens it verifies: the ceiling on any speculative speedup.

A speculative step pays one target forward of k + 1 tokens (the anchor and k drafts) and gains tau tokens from it,
so it beats plain decoding only where tau > t(k + 1) / t(1), and that is before the draft and refinement cost
anything. On a GPU t is nearly flat in the width (an H200 took 17 ms for 1 token and 21 ms for 16, eager,
with this 135M target in bf16 and transformers 5.17), so
acceptance sets the ceiling; on a CPU t grows with the width and sets it itself (`--num-draft-tokens` narrows it).

Times the real target's forward as the speculative loop calls it (hidden states out, a KV cache of `--context`
tokens of a GSM8K prompt in the chat template) for each width, eager with a dynamic cache, and with `--compile` also
with a static cache and the forward compiled as `generate` compiles it (the first calls of each width are excluded).
Prints the median ms per forward, its ratio to plain decoding's forward (eager width 1; for static + compiled, its own
width 1), and so the tau that width - 1 drafts need to break even.
For a float32 CPU target also the forward as the speculative loop runs it there, its Linear layers in the faster BLAS
layouts for a few rows (`hf_specdiff/_cpu_linear.py`): (W @ x^T)^T, eager and (with `--compile`) compiled through it,
and the weights packed by MKL for the width (eager; the packs are made in the warm-up calls), which the loop takes on
an Intel CPU only: elsewhere MKL's packed products were measured slower than the transposed layout.

    python examples/verify_cost.py [--target PATH] [--device cuda] [--dtype bfloat16] [--compile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from hf_specdiff import _compat, _cpu_linear
from hf_specdiff._cpu_linear import FewRowLinears, few_row_linears
from hf_specdiff.bench import BenchConfig, load_prompts
from hf_specdiff.candidates import synchronize


def context_ids(tokenizer, length: int, data_dir: str | None = None) -> torch.LongTensor:
    """`length` tokens of real text: the first GSM8K prompt in the chat template, repeated as often as needed."""
    (_, messages), = load_prompts(BenchConfig(datasets=["gsm8k"], limit=1, data_dir=data_dir))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    return torch.tensor((ids * (length // len(ids) + 1))[:length])[None]


def time_forward(forward, cache, ids, context: int, width: int) -> float:
    """Seconds of one forward of `width` tokens after `context` cached ones; the cache is cropped back after it, as
    the loop crops rejected drafts."""
    fed = ids[:, context : context + width]
    positions = torch.arange(context, context + width, device=ids.device)[None]
    synchronize(ids.device)
    start = time.perf_counter()
    forward(input_ids=fed, position_ids=positions, use_cache=True, output_hidden_states=True, cache=cache)
    synchronize(ids.device)
    seconds = time.perf_counter() - start
    _compat.crop_cache(cache, width)
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="a causal LM folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--context", type=int, default=256, help="cached tokens before the verified ones")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 12, 16])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="also a static cache with the forward compiled")
    parser.add_argument("--data-dir", help="benchmark JSONL folder (default: $HF_SPECDIFF_DATA, ./shared/data or "
                        "../shared/data)")
    args = parser.parse_args()

    if args.target:
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype))
        tokenizer = AutoTokenizer.from_pretrained(args.target)
    else:
        from hf_specdiff import load_default_target

        target, tokenizer = load_default_target(dtype=args.dtype)
    target = target.to(args.device).eval()
    ids = context_ids(tokenizer, args.context + max(args.widths), args.data_dir).to(args.device)

    def prefilled(cache):
        target(input_ids=ids[:, : args.context], use_cache=True, **_compat.cache_kwargs(target, cache))
        return cache

    def forward_with(call):  # the cache under the name this model's forward expects
        return lambda cache, **kwargs: call(**kwargs, **_compat.cache_kwargs(target, cache))

    def prefilled_dynamic_cache():
        return prefilled(DynamicCache(config=target.config))

    setups = {"eager": (forward_with(target), prefilled_dynamic_cache)}
    if isinstance(few_row_linears(target), FewRowLinears):  # as the speculative loop decides

        def few_row_layout(cache, **kwargs):
            with few_row_linears(target):
                return target(**kwargs, **_compat.cache_kwargs(target, cache))

        setups["eager, few-row layout"] = (few_row_layout, prefilled_dynamic_cache)

        # on an Intel CPU the loop packs the weights for its verify width (timed here on any CPU, to compare); one
        # context per width, as one per `generate` call
        packed_modes = {w: FewRowLinears(packed_rows=w) for w in args.widths}

        def packed_for_width(cache, **kwargs):
            with packed_modes[kwargs["input_ids"].numel()]:
                return target(**kwargs, **_compat.cache_kwargs(target, cache))

        if torch.backends.mkl.is_available():
            setups["eager, weights packed for the width"] = (packed_for_width, prefilled_dynamic_cache)
        _cpu_linear.MAX_PACKED_ROW_COUNTS = len(args.widths)  # a pack per width, none dropped between repeats
    if args.compile:
        compiled = target.get_compiled_call(_compat.compile_config_for_all_devices())

        def prefilled_static_cache():
            return prefilled(_compat.new_static_cache(target.config, args.context + max(args.widths)))

        setups["static + compiled"] = (forward_with(compiled), prefilled_static_cache)
        if "eager, few-row layout" in setups:  # the same compiled forward called in the mode: traced through it

            def compiled_few_row_layout(cache, **kwargs):
                with few_row_linears(target):
                    return compiled(**kwargs, **_compat.cache_kwargs(target, cache))

            setups["static + compiled, few-row layout"] = (compiled_few_row_layout, prefilled_static_cache)
        # each width is a graph of its own, and so is each width in the mode: room for all of them
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(args.widths))

    print(f"{args.target or 'SmolLM2-135M-Instruct (embedded)'}, {args.device}, {args.dtype}, "
          f"{args.context} cached tokens; ms per forward (x plain decoding's = tau needed to break even, "
          "drafting free)")
    with torch.inference_mode():
        caches = {name: new_cache() for name, (_, new_cache) in setups.items()}
        seconds = {(name, w): [] for name in setups for w in args.widths}
        for _ in range(args.repeats + 2):  # interleaved, so that drift hits every cell alike
            for name, (forward, _) in setups.items():
                for w in args.widths:
                    seconds[name, w].append(time_forward(forward, caches[name], ids, args.context, w))
    width = max(map(len, setups))
    for name in setups:
        times = {w: statistics.median(seconds[name, w][2:]) for w in args.widths}  # two warm-up calls excluded
        plain_setup = "static + compiled" if name.startswith("static") else "eager"  # what plain decoding runs
        base = statistics.median(seconds[plain_setup, 1][2:]) if 1 in args.widths else None
        cells = "  ".join(f"w{w} {1000 * t:6.1f}" + (f" (x{t / base:.2f})" if base else "") for w, t in times.items())
        print(f"{name:<{width}}  {cells}")
    if "eager, few-row layout" in setups:
        taken = "weights packed for the width" if _cpu_linear.packing_pays_on_this_cpu() else "few-row layout"
        vendor = _cpu_linear.cpu_vendor() or "vendor unknown"
        print(f"the speculative loop's eager verify forwards on this CPU ({vendor}): {taken}")


if __name__ == "__main__":
    main()
