"""A multi-turn chat whose every turn continues from the cache the previous turn handed back (the embedded
SmolLM2-135M-Instruct and its shipped speculator), against the same turns with the whole conversation prefilled again
and against plain greedy decoding. With MT-Bench's two-turn questions by default (`HF_SPECDIFF_DATA` or
`--data-dir` holds `mt_bench/question.jsonl`), or your own turns:

    python examples/continue_a_chat.py [--limit 10] [--max-new-tokens 64]
    python examples/continue_a_chat.py --turns "Name a prime number." "Now a larger one."
"""

import argparse
import json
import time

import torch

import hf_specdiff
from hf_specdiff.bench import find_data_dir

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--turns", nargs="+", help="the user's turns of one chat (default: MT-Bench's questions)")
parser.add_argument("--data-dir", help="folder holding mt_bench/question.jsonl (default: $HF_SPECDIFF_DATA, ...)")
parser.add_argument("--limit", type=int, default=10, help="MT-Bench questions (default: 10)")
parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per answer (default: 64)")
parser.add_argument("--num-draft-tokens", type=int, default=3,
                    help="drafts verified per block (default: 3, what pays on a CPU; 15 on a GPU)")
args = parser.parse_args()

if args.turns:
    chats = [args.turns]
else:
    questions = find_data_dir(args.data_dir) / "mt_bench" / "question.jsonl"
    chats = [json.loads(line)["turns"] for line in questions.read_text().splitlines()[: args.limit]]

target, tokenizer = hf_specdiff.load_default_target()
speculator = hf_specdiff.AutoSpeculator.from_pretrained(hf_specdiff.default_speculator_path(), dtype=target.dtype)
hf_specdiff.enable(target)
speculate = dict(assistant_model=speculator, speculation="xpress", num_draft_tokens=args.num_draft_tokens,
                 max_new_tokens=args.max_new_tokens, return_dict_in_generate=True)
end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")


def next_turn(sequence: torch.LongTensor, question: str) -> torch.LongTensor:
    """The conversation so far followed by the user's next question, in the model's chat format (ChatML). Appended to
    the tokens so far, since the cache holds exactly those: tokenizing the whole chat again could split the answers
    differently."""
    closing = "" if sequence[0, -1] == end_of_turn else "<|im_end|>"  # an answer cut by --max-new-tokens
    text = f"{closing}\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return torch.cat([sequence, tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]], dim=1)


taus, seconds, identical, later_turns = {"continued": [], "prefilled": []}, {"continued": 0.0, "prefilled": 0.0}, 0, 0
for number, turns in enumerate(chats):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": turns[0]}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
    out = target.generate(prompt, **speculate)
    for question in turns[1:]:
        cache_name = "cache" if "cache" in out else "past_key_values"  # what transformers 5.25 renamed it to
        prompt, cache = next_turn(out.sequences, question), {cache_name: out[cache_name]}
        plain = target.generate(prompt, do_sample=False, max_new_tokens=args.max_new_tokens)
        runs = {}
        # alternate which goes first, so that a drift in the machine's speed hits both alike
        for way in ("continued", "prefilled") if number % 2 else ("prefilled", "continued"):
            start = time.perf_counter()
            runs[way] = target.generate(prompt, **(cache if way == "continued" else {}), **speculate)
            seconds[way] += time.perf_counter() - start
            taus[way].append(runs[way].speculation.tau)
        identical += all(torch.equal(run.sequences, plain) for run in runs.values())
        later_turns += 1
        out = runs["continued"]
        print(f"chat {number + 1}, {prompt.shape[1]} tokens before the answer: "
              f"tau continued {taus['continued'][-1]:.2f}, prefilled again {taus['prefilled'][-1]:.2f}")
    if len(chats) == 1:
        print(tokenizer.decode(out.sequences[0], skip_special_tokens=False))

if later_turns:
    mean = {way: sum(values) / len(values) for way, values in taus.items()}
    print(f"\nlater turns: {later_turns}, identical to plain greedy: {identical}/{later_turns}")
    print(f"mean accepted length (tau): continued from the cache {mean['continued']:.3f}, "
          f"prefilled again {mean['prefilled']:.3f}")
    print(f"time, continued / prefilled again: {seconds['continued'] / seconds['prefilled']:.2f}x")
