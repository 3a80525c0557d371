"""Where a speculative step's time goes when the models cost next to nothing: the loop's own overhead.

A tiny random Llama target (4 layers, width 64) and an untrained speculator built for it make every forward so cheap
that each phase's time is dispatch overhead (Python, module calls, kernel launches): the regime a small target sits
in on a GPU, where plain eager decoding is launch-bound. Prints ms per step of plain decoding and of dflash / xpress,
eager (dynamic cache) and with `cache_implementation="static"` compiled, with the draft / refine / verify split.

    python examples/loop_overhead.py [--device cuda] [--new-tokens 200]

On the CPU the compiled runs force torch.compile (`compile_config._compile_all_devices`); the first call of each
compiles and is excluded.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

import hf_specdiff
from hf_specdiff.candidates import synchronize


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=None)
    target = hf_specdiff.enable(LlamaForCausalLM(config).to(args.device).eval())
    speculator = hf_specdiff.AutoSpeculator.from_target(target, block_size=16, seed=0).to(args.device)
    prompt = torch.randint(1, 256, (1, 20), device=args.device)
    compiled = CompileConfig()
    compiled._compile_all_devices = True  # compile on any device, as transformers does on cuda by default
    static = dict(cache_implementation="static", max_cache_len=prompt.shape[1] + args.new_tokens,
                  compile_config=compiled)
    runs = {
        "plain": {},
        "plain, static + compiled": static,
        "dflash": dict(assistant_model=speculator, speculation="dflash"),
        "dflash, static + compiled": dict(assistant_model=speculator, speculation="dflash", **static),
        "xpress": dict(assistant_model=speculator, speculation="xpress"),
        "xpress, static + compiled": dict(assistant_model=speculator, speculation="xpress", **static),
    }
    print(f"{'method':<28} {'ms/step':>8} {'draft':>7} {'refine':>7} {'verify':>7}   (ms per target forward)")
    for name, kwargs in runs.items():
        def generate():
            return target.generate(prompt, do_sample=False, max_new_tokens=args.new_tokens,
                                   return_dict_in_generate=True, **kwargs)

        generate()  # warm-up and compilation
        synchronize(target.device)
        start = time.perf_counter()
        for _ in range(args.repeats):
            out = generate()
        synchronize(target.device)
        seconds = (time.perf_counter() - start) / args.repeats
        stats = getattr(out, "speculation", None)
        steps = stats.target_forwards if stats else out.sequences.shape[1] - prompt.shape[1]
        phases = ("" if stats is None else " ".join(
            f"{1000 * getattr(stats, f'{phase}_seconds') / steps:7.2f}" for phase in ("draft", "refine", "verify")))
        print(f"{name:<28} {1000 * seconds / steps:8.2f} {phases}")


if __name__ == "__main__":
    main()
