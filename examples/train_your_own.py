"""Train a speculator for your own target by self-distillation, then use it.

1. Answers: the target answers real prompts with its own chat template (greedy), one JSON line per prompt with
   `prompt_ids` and `response_ids`. This script does it for a few GSM8K questions; at real size use thousands.
2. Train: drafter + xPress refiner + Markov head together (`hf-specdiff train` is the same with flags).
3. Generate with it.

    python examples/train_your_own.py --steps 20            # a few minutes on a laptop CPU (toy size)
"""

import argparse
import json
from pathlib import Path

import torch

import hf_specdiff
from hf_specdiff.training import TrainConfig, train

HOLDOUT = 4  # answers kept out of training to estimate acceptance

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--questions", default=None,
                    help="JSONL with a `question` field (default: GSM8K train from the benchmark data, found as "
                    "`hf-specdiff bench` finds it: $HF_SPECDIFF_DATA, shared/data or ../shared/data)")
parser.add_argument("--num-prompts", type=int, default=24, help="questions the target answers (default: 24)")
parser.add_argument("--steps", type=int, default=20, help="training steps (default: 20)")
parser.add_argument("--output-dir", default="runs/example", help="answers, run and speculator (default: runs/example)")
args = parser.parse_args()
if args.num_prompts <= HOLDOUT:
    parser.error(f"--num-prompts must exceed the {HOLDOUT} held-out answers, got {args.num_prompts}")
if args.questions is None:
    from hf_specdiff.bench import find_data_dir

    args.questions = str(find_data_dir(None) / "gsm8k" / "train.jsonl")
if not Path(args.questions).is_file():
    parser.error(f"--questions {args.questions}: no such file")
questions = []  # read before the target loads, so that a wrong file fails at once
with open(args.questions) as rows:
    for number, line in zip(range(1, args.num_prompts + 1), rows):
        try:
            question = json.loads(line).get("question")
        except (json.JSONDecodeError, AttributeError):
            question = None
        if not isinstance(question, str):
            parser.error(f"--questions {args.questions}:{number} is not a JSON object with a `question` string: give "
                         'one {"question": "..."} per line (`hf-specdiff distill --sources` takes "prompt" rows)')
        questions.append(question)

target, tokenizer = hf_specdiff.load_default_target()  # or AutoModelForCausalLM.from_pretrained(your_model)

# 1. Self-distillation data
out_dir = Path(args.output_dir)
out_dir.mkdir(parents=True, exist_ok=True)
data = out_dir / "answers.jsonl"
with data.open("w") as answers:
    for question in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        response = target.generate(ids, do_sample=False, max_new_tokens=64)[0, ids.shape[1]:]
        answers.write(json.dumps({"prompt_ids": ids[0].tolist(), "response_ids": response.tolist()}) + "\n")

# 2. Training (toy size: raise max_steps, max_seq_len and the data for a useful speculator)
# (the warm-up is a tenth of the run: the default, 50 steps, is for runs of thousands)
config = TrainConfig(data=[str(data)], output_dir=str(out_dir / "run"), max_steps=args.steps, max_seq_len=160,
                     anchors_per_sequence=4, batch_size=2, refiner_rank=32, mask_token_id=16,
                     warmup_steps=max(args.steps // 10, 1), holdout_sequences=HOLDOUT,
                     eval_every=max(args.steps // 2, 1), save_every=args.steps)
speculator = train(config, target=target)

# 3. Use it: greedy output is the target's own, whatever the speculator's quality
hf_specdiff.enable(target)
ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 15 + 27?"}], add_generation_prompt=True,
                                    return_tensors="pt", return_dict=True)
out = target.generate(**ids, assistant_model=speculator, speculation="xpress", do_sample=False, max_new_tokens=32,
                      return_dict_in_generate=True)
assert torch.equal(out.sequences, target.generate(**ids, do_sample=False, max_new_tokens=32))
print(tokenizer.decode(out.sequences[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
print(f"tau {out.speculation.tau:.2f}; speculator saved in {config.output_dir}/speculator")
