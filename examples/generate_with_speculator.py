"""Generate with the embedded SmolLM2-135M-Instruct and its shipped speculator; compare with plain generate.

    python examples/generate_with_speculator.py "How many legs do 3 spiders have?" [--max-new-tokens 96]
"""

import argparse

import torch

import hf_specdiff

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("prompt", nargs="?", default="Write a haiku about speculative decoding.",
                    help="what to ask (default: a haiku about speculative decoding)")
parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated (default: 96)")
args = parser.parse_args()
prompt, max_new_tokens = args.prompt, args.max_new_tokens
target, tokenizer = hf_specdiff.load_default_target()
# stored in bf16; the speculator runs in the target's dtype (a mismatch is refused, not cast behind your back)
speculator = hf_specdiff.AutoSpeculator.from_pretrained(hf_specdiff.default_speculator_path(), dtype=target.dtype)
hf_specdiff.enable(target)

inputs = tokenizer.apply_chat_template(
    [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
)
plain = target.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
out = target.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, assistant_model=speculator,
                      speculation="xpress", return_dict_in_generate=True)

print(tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print(f"\nidentical to plain greedy: {torch.equal(out.sequences, plain)}")
print(f"tokens per target forward (tau): {out.speculation.tau:.2f}, target forwards: {out.speculation.target_forwards}")

# Sampling works the same way and keeps the target's distribution:
torch.manual_seed(0)
sampled = target.generate(**inputs, do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=max_new_tokens,
                          assistant_model=speculator, speculation="xpress")
print("\nsampled:", tokenizer.decode(sampled[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
