"""How much memory a long prompt costs plain `generate` and the speculative loop, above the loaded models.

The speculative loop holds more than plain decoding during the prefill: the target's hidden states at the layers the
drafter reads, the drafter's context features and its cache of the prompt. Each configuration runs in a fresh process
(a high-water mark is per process): it loads the embedded target and the shipped speculator (float32), generates once
from a short prompt to warm up, then `--new-tokens` tokens greedily after a prompt of `--prompt-tokens` random tokens,
and reports how far its resident memory rose during that call above what it held before it (Linux: the
high-water mark, reset before the call). glibc is told to return large blocks to the
system at once (`MALLOC_MMAP_THRESHOLD_`, one arena), so that the peak follows what tensors hold rather than what
the allocator kept; without that the figures vary by a hundred MB from run to run.

    python examples/prefill_memory.py [--prompt-tokens 3000] [--methods ar xpress] [--caches dynamic static]
                                      [--chunks 0 512]
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys


def memory_kb(field: str) -> int:
    """VmRSS (resident now) or VmHWM (resident at most, since the last reset) of this process, in kB."""
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith(field + ":")).split()[1])


def measure(method: str, cache: str, prompt_tokens: int, new_tokens: int, chunk: int) -> float:
    """MB of peak resident memory that one generate call adds to what the process held when it started (Linux)."""
    import torch

    import hf_specdiff

    target, _ = hf_specdiff.load_default_target()
    hf_specdiff.enable(target)
    settings = dict(max_new_tokens=new_tokens, do_sample=False, prefill_chunk_size=chunk or None,
                    cache_implementation=None if cache == "dynamic" else "static")
    if method != "ar":
        speculator = hf_specdiff.AutoSpeculator.from_pretrained(hf_specdiff.default_speculator_path())
        settings.update(assistant_model=speculator.to(target.dtype), speculation=method, num_draft_tokens=3)
    prompt = torch.randint(100, 40_000, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        target.generate(prompt[:, :16], **settings)
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # the high-water mark starts again from what is resident now
        before = memory_kb("VmRSS")
        target.generate(prompt, **settings)
    return (memory_kb("VmHWM") - before) / 1024


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--methods", nargs="+", default=["ar", "xpress"], choices=["ar", "dflash", "xpress", "markov"])
    parser.add_argument("--caches", nargs="+", default=["dynamic", "static"], choices=["dynamic", "static"])
    parser.add_argument("--chunks", nargs="+", type=int, default=[0], help="prefill_chunk_size values (0: none)")
    parser.add_argument("--one", nargs=3, metavar=("METHOD", "CACHE", "CHUNK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        method, cache, chunk = args.one
        print(measure(method, cache, args.prompt_tokens, args.new_tokens, int(chunk)))
        return

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "1"}
    print(f"peak memory above the loaded models, MB: {args.new_tokens} new tokens after {args.prompt_tokens} prompt "
          "tokens, embedded SmolLM2-135M, float32")
    print(f"{'method':8} {'cache':8} {'chunk':>6} {'MB':>8}")
    for method, cache, chunk in itertools.product(args.methods, args.caches, args.chunks):
        run = subprocess.run([sys.executable, __file__, "--one", method, cache, str(chunk), "--prompt-tokens",
                              str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)],
                             env=env, capture_output=True, text=True, check=True)
        print(f"{method:8} {cache:8} {chunk or '-':>6} {float(run.stdout.split()[-1]):8.0f}")


if __name__ == "__main__":
    main()
