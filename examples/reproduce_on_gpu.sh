#!/usr/bin/env bash
# Rebuild what the project ships for the embedded SmolLM2-135M-Instruct on one GPU, and measure it.
#
#   examples/reproduce_on_gpu.sh speculator OUT   train the dFlash drafter + xPress refiner + Markov head on the
#                                                  distill corpus, export it, bench it (batch 1 and the batch curve)
#   examples/reproduce_on_gpu.sh diffusion OUT    train the diffusion LM adapter, export it, calibrate its Spiffy
#                                                  graph on 25 MATH-500 + 25 MBPP prompts, bench it against its AR
#                                                  base, export again with the bench in its model card
#   examples/reproduce_on_gpu.sh speed OUT        no training: the shipped speculator's speed at batch 1 on GSM8K,
#                                                  eager and compiled (ar_static, dflash_static, xpress_static), and
#                                                  the loop's dispatch overhead per phase (examples/loop_overhead.py)
#                                                  and the target forward's cost by width (examples/verify_cost.py)
#
# Environment (all optional):
#   HF_SPECDIFF_DATA   benchmark sets and distill/ (default: ../shared/data)
#   TRAIN_MINUTES      wall-clock budget of the training run (default: none, the config's max_steps)
#   BENCH_LIMIT        prompts per dataset at batch size 1 (default 20)
#   CURVE_LIMIT        GSM8K prompts of the batch curve (default 64), decoded at every size of
#   CURVE_SIZES        the batch curve's sizes (default "1 4 16 32 64")
#   MAX_NEW_TOKENS     per answer in every bench (default 256)
#   BENCH_METHODS      the methods of the batch-1 bench of `speculator` and `speed` (default: all of the stage's;
#                      e.g. "ar dflash xpress markov" leaves out the compiled ones, which take minutes to compile)
#   CURVE_METHODS      the methods of the `speculator` stage's batch curve (default "ar dflash xpress"; add
#                      "ar_static xpress_static" for the compiled static-cache curve, one compilation per size)
#   QUICK=1            a CPU smoke run of the whole script: a few training steps, 2 prompts, short answers
#
# Everything lands in OUT: the artifact, train logs, bench JSON / Markdown / plots, and the commands that made them.
set -euo pipefail
stage="${1:?usage: $0 speculator|diffusion|speed OUT}"
out="${2:?usage: $0 speculator|diffusion|speed OUT}"
here="$(cd "$(dirname "$0")" && pwd)"
data="${HF_SPECDIFF_DATA:-$here/../../shared/data}"
distill="$data/distill/smollm2-135m-instruct"
limit="${BENCH_LIMIT:-20}"
tokens="${MAX_NEW_TOKENS:-256}"
budget=(); [[ -n "${TRAIN_MINUTES:-}" ]] && budget=(--time-budget-minutes "$TRAIN_MINUTES")
quick=(); quick_speculator=(); quick_diffusion=(); verify=(--compile)
curve_limit=64; curve_sizes=(1 4 16 32 64); calibrate_limit=25; dtype=bfloat16; block=32
if [[ "${QUICK:-0}" == 1 ]]; then
  # fp32: bf16 autocast on a CPU without bf16 instructions (AVX2 only) takes ~50 s per toy step
  quick=(--max-steps 3 --warmup-steps 1 --batch-size 2 --eval-every 3 --save-every 3 --max-seq-len 128
         --mixed-precision no)
  quick_speculator=(--anchors-per-sequence 4 --holdout-sequences 2); quick_diffusion=(--eval-sequences 4)
  verify=(--widths 1 2 --repeats 1 --context 16)
  limit=2; tokens=16; curve_limit=2; curve_sizes=(1 2); calibrate_limit=1; dtype=float32; block=8
fi
curve_limit="${CURVE_LIMIT:-$curve_limit}"
[[ -n "${CURVE_SIZES:-}" ]] && read -r -a curve_sizes <<< "$CURVE_SIZES"
hardware="$(python -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU")')"
mkdir -p "$out"
export HF_SPECDIFF_DATA="$data"
run() { echo "+ $*" | tee -a "$out/commands.txt"; "$@"; }

if [[ "$stage" == speculator ]]; then
  read -r -a methods <<< "${BENCH_METHODS:-ar ar_static dflash xpress markov dflash_static xpress_static dflash_hf prompt_lookup}"
  read -r -a curve_methods <<< "${CURVE_METHODS:-ar dflash xpress}"
  run hf-specdiff train --config "$here/configs/smollm2-135m-gpu.json" --output-dir "$out/train" \
      --data "$distill/gsm8k_train.jsonl" "$distill/sharegpt.jsonl" "${budget[@]}" "${quick[@]}" \
      "${quick_speculator[@]}"
  bench=(hf-specdiff bench --datasets gsm8k humaneval mt_bench --limit "$limit" --max-new-tokens "$tokens"
         --methods "${methods[@]}" --jacobi-passes 1 2 4 --dtype "$dtype")
  run "${bench[@]}" --speculator "$out/train/speculator" --json "$out/bench.json" --markdown "$out/bench.md" \
      --plots "$out"
  run hf-specdiff bench --speculator "$out/train/speculator" --datasets gsm8k --limit "$curve_limit" \
      --batch-size "${curve_sizes[@]}" --max-new-tokens "$tokens" --methods "${curve_methods[@]}" --dtype "$dtype" \
      --json "$out/curve.json" --markdown "$out/curve.md" --plots "$out"
  run hf-specdiff export --run "$out/train" --output "$out/speculator" --dtype bfloat16 \
      --template "$here/../model_cards/speculator.md" --train-hardware "$hardware" --bench-json "$out/bench.json" \
      --bench-command "${bench[*]} --speculator <this folder>"
elif [[ "$stage" == diffusion ]]; then
  run hf-specdiff train-diffusion --config "$here/configs/smollm2-135m-diffusion-gpu.json" --output-dir "$out/train" \
      --data "$distill/gsm8k_train.jsonl" "$distill/sharegpt.jsonl" "${budget[@]}" "${quick[@]}" \
      "${quick_diffusion[@]}"
  # the shipped form first (adapter in bf16), so that the graph is calibrated on, and the bench measures, what ships
  export=(hf-specdiff export --run "$out/train" --output "$out/diffusion_lm" --dtype bfloat16
          --template "$here/../model_cards/diffusion_lm.md" --train-hardware "$hardware")
  run "${export[@]}"
  # on the GPU when there is one, in the precision the bench measures
  run hf-specdiff calibrate --model "$out/diffusion_lm" --output "$out/diffusion_lm" --dtype "$dtype" \
      --limit "$calibrate_limit" --max-new-tokens "$tokens" --block-length "$block" --cache dual
  bench=(hf-specdiff bench --datasets gsm8k humaneval mbpp math500
         --limit "$limit" --max-new-tokens "$tokens" --block-length "$block" --cache dual
         --methods steps threshold spiffy spiffy_threshold ar_base --dtype "$dtype")
  run "${bench[@]}" --target "$out/diffusion_lm" --json "$out/bench.json" --markdown "$out/bench.md" --plots "$out"
  run "${export[@]}" --bench-json "$out/bench.json" --bench-command "${bench[*]} --target <this folder>"
elif [[ "$stage" == speed ]]; then
  read -r -a methods <<< "${BENCH_METHODS:-ar ar_static dflash xpress dflash_static xpress_static prompt_lookup dflash_hf}"
  run hf-specdiff bench --datasets gsm8k --limit "$limit" --max-new-tokens "$tokens" --jacobi-passes 4 \
      --methods "${methods[@]}" --dtype "$dtype" \
      --json "$out/bench.json" --markdown "$out/bench.md" --plots "$out"
  run python "$here/loop_overhead.py" --new-tokens "$tokens" | tee "$out/loop_overhead.txt"
  run python "$here/verify_cost.py" --dtype "$dtype" "${verify[@]}" | tee "$out/verify_cost.txt"
else
  echo "unknown stage $stage: speculator, diffusion or speed" >&2
  exit 2
fi
echo "done: $out"
