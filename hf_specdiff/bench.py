"""`hf-specdiff bench`: every method side by side on real prompt sets, interleaved so that drift hits all alike.

Methods: `ar` (plain `generate`, the reference every ratio is taken against), `ar_static` (plain `generate` with a
static cache, compiled by transformers where it compiles on its own: cuda, xpu, neuron, tpu), `dflash`, `xpress`
(one run per K), `markov` (our speculative loop), `dflash_static` and `xpress_static` (our loop with static caches:
verify forward, draft step and Jacobi refinement compiled wherever ar_static's forward is), `dflash_hf` and
`prompt_lookup` (transformers' own assisted decoding). One warm-up call per method (which also pays for any
compilation) is excluded from every figure.

Per method: tokens/s and speedup over `ar` measured in the same run; prefill (time to the first generated token)
and the decode rate after it; whether transformers compiled the forward; for the speculative methods tau (mean tokens
per target forward after the prefill, bonus included, pooled over the run's steps, so that a prompt weighs by its
steps; `tau_per_sample` gives each prompt's own, None for one that stopped at the prefill) and target forwards
(`prompt_lookup` and `dflash_hf`, transformers' loops, keep no statistics: a hook counts their forwards, and tau comes
from those and the tokens); for ours also acceptance by block position and draft/refine/verify time per verify
step in the steady state (the prefill forward and the first block's drafter pass over the prompt apart:
`prefill_forward_ms`, `draft_prefill_ms`; refine is resolving the drafted block into tokens, which for dflash, with no
refiner, is picking each slot's token from the drafter's logits). Losslessness against `ar`: greedy runs compare
token by token (raw mismatches, and those not explained by a near-tie of the target's logits in floating point; the
second must be 0); sampled runs (`temperature > 0`) compare the target's mean log-probability of the generated tokens
with a paired permutation test over prompts (`sampling_check`, see `paired_permutation_test`; with fewer than 6
prompts it cannot reject at 0.05, and `too_few_prompts` says so).
"""

from __future__ import annotations

import copy
import json
import os
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from . import _cpu_linear
from .batching import until_stop
from .candidates import synchronize
from .diffusion.decoding import CACHE_MODES, REMASKING_RULES

DATASETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt_bench")
_FILES = {
    "gsm8k": "gsm8k/test.jsonl",
    "math500": "math500/test.jsonl",
    "humaneval": "humaneval/test.jsonl",
    "mbpp": "mbpp/test.jsonl",
    "mt_bench": "mt_bench/question.jsonl",
}
# one good line of each set's file, for the message naming a line that is not JSON
_ROW_EXAMPLES = {
    "gsm8k": '{"question": "...", "answer": "..."}',
    "math500": '{"problem": "...", "answer": "..."}',
    "humaneval": '{"task_id": "...", "prompt": "def f(x):\\n"}',
    "mbpp": '{"prompt": "...", "test_list": ["assert ..."]}',
    "mt_bench": '{"question_id": 81, "turns": ["..."]}',
}


@dataclass
class BenchConfig:
    """Options of `hf-specdiff bench`: the CLI mirrors these fields, and each field's `metadata["help"]` is its
    `--help` text."""

    datasets: list[str] = field(default_factory=lambda: ["gsm8k"], metadata={
        "help": "benchmark sets whose prompts are run", "choices": DATASETS})
    prompts: str | None = field(default=None, metadata={"help": (
        "your own prompts instead of --datasets: a JSONL file with a `prompt` string or a `messages` list per line (a "
        "chat, answered at its last user turn)")})
    data_dir: str | None = field(default=None, metadata={"help": (
        "folder holding the benchmark JSONL files; None: $HF_SPECDIFF_DATA, else ./shared/data or ../shared/data")})
    limit: int = field(default=10, metadata={"help": "prompts per dataset, or from --prompts (0: all of them)"})
    seed: int = field(default=0, metadata={"help": (
        "order in which prompts are drawn from --datasets (a --prompts file keeps its order), and sampling's seed")})
    methods: list[str] = field(default_factory=lambda: ["ar", "dflash", "xpress", "markov"], metadata={"help": (
        "any of ar, ar_static, dflash, xpress, markov, dflash_static, xpress_static, dflash_hf, prompt_lookup; ar is "
        "always run (the reference). For a diffusion LM (--target): steps, threshold, spiffy, spiffy_threshold, "
        "ar_base")})
    jacobi_passes: list[int] = field(default_factory=lambda: [4], metadata={"help": (
        "K, xPress's refinement passes per block; several values give one xpress row each")})
    num_draft_tokens: int | None = field(default=None, metadata={"help": (
        "drafts offered per block by dflash / xpress / markov; None: all B-1 (on a CPU 3 can be faster)")})
    max_new_tokens: int = field(default=128, metadata={"help": "tokens generated per prompt"})
    batch_size: list[int] = field(default_factory=lambda: [1], metadata={"help": (
        "1 measures prompt by prompt (prefill split out, every method); several (e.g. 1 4 16 32 64) measure the "
        "batch curve of ar, ar_static, dflash, xpress, markov, dflash_static and xpress_static on left-padded "
        "batches")})
    temperature: float = field(default=0.0, metadata={"help": (
        "0: greedy, losslessness checked per token; > 0: sampled, checked by a permutation test on log-probabilities")})
    compile: bool | None = field(default=None, metadata={"help": (
        "torch.compile of ar_static, dflash_static and xpress_static. Unset: transformers decides (it compiles on "
        "cuda/xpu/neuron/tpu, not on the CPU); --compile compiles on any device (on 2 CPU cores SmolLM2-135M takes "
        "~40-50 s to compile, then decodes ~15% faster); --no-compile never compiles")})
    target: str | None = field(default=None, metadata={"help": (
        "the target: local folder or Hub id; None: the embedded SmolLM2-135M-Instruct (diffusion methods: the "
        "diffusion LM shipped for it)")})
    tokenizer: str | None = field(default=None, metadata={"help": (
        "folder or Hub id of the target's tokenizer; None: the one saved with the target")})
    speculator: str | None = field(default=None, metadata={"help": (
        "a saved speculator's folder or Hub id; None: the speculator shipped for the embedded target")})
    device: str = field(default="cuda" if torch.cuda.is_available() else "cpu", metadata={"help": (
        "torch device the models run on")})
    dtype: str = field(default="float32", metadata={"help": "float32, bfloat16 or float16"})
    # (in bf16 / fp16 at least NEAR_TIE_ULPS units of the dtype's rounding at the logits' size)
    tie_tolerance: float = field(default=1e-3, metadata={"help": (
        "logit gap under which a greedy divergence from plain generate counts as a floating-point near-tie, not a "
        "mismatch")})
    # Diffusion LMs only (methods steps, threshold, spiffy, spiffy_threshold, ar_base; see bench_diffusion)
    block_length: int | None = field(default=None, metadata={"help": (
        "diffusion LMs: semi-autoregressive block size; None: the draft graph's where Spiffy is measured, else the "
        "block size a block-causal model was trained with (SDAR), else 32")})
    steps: int | None = field(default=None, metadata={"help": (
        "diffusion LMs: denoising steps over the answer; None: one token per step")})
    remasking: str = field(default="low_confidence", metadata={
        "help": "diffusion LMs: which masked positions are unmasked first", "choices": REMASKING_RULES})
    threshold: float = field(default=0.9, metadata={"help": (
        "diffusion LMs: Fast-dLLM confidence threshold of the threshold and spiffy_threshold methods")})
    cache: str = field(default="dual", metadata={
        "help": "diffusion LMs: key/value cache (dual and block are exact for Spiffy)", "choices": CACHE_MODES})
    max_drafts: int = field(default=8, metadata={"help": "Spiffy: drafts verified per forward (D*)"})
    draft_graph: str | None = field(default=None, metadata={"help": (
        "Spiffy: folder with spiffy_graph.json; None: the one beside the model")})
    base: str | None = field(default=None, metadata={"help": (
        "diffusion LMs: the causal LM the diffusion LM was adapted from (ar_base method, base perplexity of the "
        "answers); None: the base an adapter artifact names")})
    json: str | None = field(default=None, metadata={"help": "write the full results to this JSON file"})
    markdown: str | None = field(default=None, metadata={"help": "write the table to this Markdown file"})
    plots: str | None = field(default=None, metadata={"help": (
        "write PNG plots (speedup, accepted lengths, acceptance by position; diffusion methods: NFE) to this folder")})


def find_data_dir(explicit: str | None, needs: tuple[str, ...] = ("gsm8k",), remedy: str = "") -> Path:
    """The folder benchmark data is read from: `explicit` (--data-dir), else $HF_SPECDIFF_DATA where it is set, else
    ./shared/data or ../shared/data, the first that holds `needs` (the paths inside it that the caller reads; the
    default, gsm8k/, marks a folder of benchmark data). A folder the user named (--data-dir or the variable) is never
    passed over for another: one that lacks what is needed is an error naming it and what it lacks, since results
    read from elsewhere would say nothing of the data the user pointed at. `remedy` ends every message (the caller's
    other way out, e.g. dropping a dataset)."""
    def lacking(folder: Path) -> list[str]:
        return [need for need in needs if not (folder / need).exists()]

    variable = os.environ.get("HF_SPECDIFF_DATA")
    if explicit is not None or variable:
        folder = Path(explicit if explicit is not None else variable)
        named = f"--data-dir {folder}" if explicit is not None else f"$HF_SPECDIFF_DATA ({folder})"
        if not folder.is_dir():
            raise FileNotFoundError(f"{named} is not a folder: point it at the benchmark data (a folder holding "
                                    f"{', '.join(needs)}).{remedy}")
        if missing := lacking(folder):
            raise FileNotFoundError(f"{named} has no {', '.join(missing)}: add it there, or point "
                                    f"{'--data-dir' if explicit is not None else 'HF_SPECDIFF_DATA'} at a folder "
                                    f"that has it.{remedy}")
        return folder
    for folder in map(Path, ("shared/data", "../shared/data")):
        if folder.is_dir() and not lacking(folder):
            return folder
    raise FileNotFoundError(
        f"No benchmark data found: HF_SPECDIFF_DATA is not set, and neither ./shared/data nor ../shared/data holds "
        f"{', '.join(needs)}: set HF_SPECDIFF_DATA to a folder that does (or pass --data-dir, where the command has "
        f"it).{remedy}"
    )


def data_folder(config: BenchConfig) -> Path | None:
    """The folder `load_rows` reads `config.datasets` from (only their files need be there); None for a --prompts
    run."""
    if config.prompts:
        return None
    return find_data_dir(config.data_dir, tuple(_FILES[name] for name in config.datasets if name in _FILES),
                         remedy=" Or drop that dataset from --datasets, or pass your own --prompts FILE.jsonl.")


# the dtypes the models run in; others (int8, float64, ...) would fail, or run slowly, only after a model loaded
DTYPES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a `--dtype` option names (one of DTYPES), or a ValueError that lists them."""
    if name not in DTYPES:
        kind = "a torch dtype the models run in" if isinstance(getattr(torch, name, None), torch.dtype) else \
            "a torch dtype"
        raise ValueError(f"--dtype {name!r} is not {kind}; use float32, bfloat16 or float16.")
    return getattr(torch, name)


def _check_limit(limit: int) -> None:
    if limit < 0:
        raise ValueError(f"--limit must be >= 0 (prompts per dataset or from --prompts; 0: all), got {limit}.")


def text_lines(path: str | Path):
    """Yield (line number, line) of a UTF-8 text file; a folder, and bytes that are not UTF-8 (named by file:line),
    are refused with what to do."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder: give the path of a JSONL file.")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file.")
    try:
        with path.open(encoding="utf-8") as lines:
            yield from enumerate(lines, 1)
    except UnicodeDecodeError:  # the reader decodes a chunk at a time: find the line in the whole file
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as error:
            line = data[: error.start].count(b"\n") + 1
            raise ValueError(f"{path}:{line} is not UTF-8 text ({error.reason}): save the file as UTF-8.") from None
        raise


def json_lines(path: str | Path, example: str):
    """Yield (line number, "file:line", parsed row) for each non-blank line of a JSONL file; a line that is not JSON
    is named by file:line, with `example` (one good line) in the message."""
    for number, line in text_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            yield number, where, json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where} is not JSON ({error.msg}): write one JSON object per line, e.g. "
                             f"{example}.") from None


def recorded_config(config) -> dict:
    """The options a result records: its `datasets` are those its prompts came from ("custom": a --prompts file, which
    replaces the default datasets the config still holds)."""
    return {**asdict(config), "datasets": ["custom"] if config.prompts else list(config.datasets)}


def chat_prompt(where: str, messages) -> list[dict]:
    """A `messages` field as the prompt it asks: checked to be a non-empty list of {"role", "content"} dicts, and cut
    after its last user turn. Whatever follows that turn (a data set's answer to it) would be read as context before a
    second answer, where the model is to write its own. A content given as OpenAI's list of text parts
    ([{"type": "text", "text": ...}]) becomes their text, a line apart (as OpenAI-compatible servers join them), which
    every chat template reads."""
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
        raise ValueError(f"{where}: `messages` must be a non-empty list of "
                         '{"role": ..., "content": ...} dicts with string values.')
    messages = [{**message, "content": _text_content(where, message.get("content"))} for message in messages]
    users = [i for i, message in enumerate(messages) if message["role"] == "user"]
    if not users:
        raise ValueError(f"{where}: `messages` has no turn with role \"user\": the model answers the last user turn "
                         "(with the messages before it, a system prompt included, as its context).")
    if not messages[users[-1]]["content"].strip():
        raise ValueError(f"{where}: the last user turn is empty, so there is nothing to answer: give it the text the "
                         "model should answer, or delete the line.")
    return messages[: users[-1] + 1]


def _text_content(where: str, content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(isinstance(part, dict) for part in content):
        if other := sorted({str(part.get("type")) for part in content} - {"text"}):
            raise ValueError(f"{where}: a message's content has {other} parts; these prompts are text: give text parts "
                             '({"type": "text", "text": ...}) or a string.')
        if all(isinstance(part.get("text"), str) for part in content):
            return "\n".join(part["text"] for part in content)
    raise ValueError(f"{where}: `messages` must be a non-empty list of {{\"role\": ..., \"content\": ...}} dicts with "
                     f'string values (or lists of {{"type": "text", "text": ...}} parts); got content {content!r:.80}.')


def row_prompt(where: str, row) -> str | list[dict]:
    """What a prompts file's row (line `where`) asks: its `prompt` string, or its `messages` as `chat_prompt` reads
    them; exactly one of the two."""
    if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
        raise ValueError(f"{where} needs exactly one of a `prompt` string or a `messages` list, e.g. "
                         '{"prompt": "Hi"} or {"messages": [{"role": "user", "content": "Hi"}]}.')
    if "messages" in row:
        return chat_prompt(where, row["messages"])
    if not isinstance(row["prompt"], str):
        raise ValueError(f"{where}: `prompt` must be a string, got {type(row['prompt']).__name__}.")
    if not row["prompt"].strip():  # a chat template around nothing: an answer to no question, measured as one
        raise ValueError(f"{where}: `prompt` is empty, so there is nothing to answer: give the text the model should "
                         "answer, or delete the line.")
    return row["prompt"]


def read_prompts_file(path: str) -> list[dict]:
    """The rows of a --prompts file: one JSON object per line with a `prompt` string or a `messages` list of
    {"role", "content"} dicts (`row_prompt`); a bad line is named by file:line."""
    rows = []
    for _, where, row in json_lines(path, '{"prompt": "Hi"}'):
        prompt = row_prompt(where, row)
        rows.append({**row, "messages": prompt} if isinstance(prompt, list) else row)
    if not rows:
        raise ValueError(f"--prompts {path} holds no prompts.")
    return rows


def load_rows(config: BenchConfig) -> list[tuple[str, dict]]:
    """[(dataset, row)] with `limit` rows per dataset drawn in a seeded order ("custom" rows from --prompts, in the
    file's order)."""
    _check_limit(config.limit)
    if config.prompts:
        return [("custom", row) for row in read_prompts_file(config.prompts)[: config.limit or None]]
    unknown = [d for d in config.datasets if d not in DATASETS]
    if unknown:
        raise ValueError(f"Unknown datasets {unknown}; choose from {DATASETS} or pass --prompts FILE.jsonl.")
    data_dir = data_folder(config)
    out = []
    for name in config.datasets:
        rows = []
        for _, where, row in json_lines(data_dir / _FILES[name], _ROW_EXAMPLES[name]):
            try:  # a row without the fields its prompt is made of is named here, not as a KeyError at its turn
                if not isinstance(_question(name, row), str):
                    raise TypeError
            except (KeyError, TypeError, IndexError):
                raise ValueError(f"{where} is not a {name} row: its prompt's fields are missing; write rows like "
                                 f"{_ROW_EXAMPLES[name]}.") from None
            rows.append(row)
        random.Random(config.seed).shuffle(rows)
        out += [(name, row) for row in rows[: config.limit or None]]
    return out


def prompt_messages(dataset: str, row: dict) -> list[dict]:
    """The chat messages a benchmark row asks."""
    if dataset == "custom":
        return row["messages"] if "messages" in row else [{"role": "user", "content": row["prompt"]}]
    return [{"role": "user", "content": _question(dataset, row)}]


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A chat's prompt tokens as the model expects them: through the tokenizer's chat template (the assistant's turn
    opened), or, for a base model, whose tokenizer has none, the messages' text as it reads a document (their contents,
    a blank line between them), with the special tokens the tokenizer adds."""
    if tokenizer.chat_template is not None:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
    if not all(isinstance(message.get("content"), str) for message in messages):
        raise ValueError("A prompt for a model without a chat template must be text: each message's content a string.")
    return list(tokenizer("\n\n".join(message["content"] for message in messages))["input_ids"])


# what a command that tokenizes prompts for a target says when its tokenizer is another model's
TOKENIZER_REMEDY = "pass the target's own tokenizer (--tokenizer, a folder or Hub id holding it)."


def check_prompt_vocabulary(prompts_ids, model, remedy: str) -> None:
    """A prompt token id the model has no embedding for (the tokenizer is another model's) fails here, naming it and
    what to do (`remedy`), not as "IndexError: index out of range in self" in the first forward."""
    vocab_size = model.get_input_embeddings().num_embeddings
    for ids in prompts_ids:
        if outside := [token for token in ids if not 0 <= token < vocab_size]:
            raise ValueError(f"The tokenizer writes token id {outside[0]}, but the target embeds {vocab_size:,} "
                             f"tokens: {remedy}")


def prompt_format(tokenizer) -> str:
    """How `prompt_ids` writes prompts for this tokenizer, for the results' environment."""
    return "chat template" if tokenizer.chat_template is not None else "plain text (no chat template)"


def load_prompts(config: BenchConfig) -> list[tuple[str, list[dict]]]:
    """[(dataset, chat messages)] with `limit` prompts per dataset drawn in a seeded order."""
    return [(dataset, prompt_messages(dataset, row)) for dataset, row in load_rows(config)]


def _question(dataset: str, row: dict) -> str:
    if dataset == "gsm8k":
        return row["question"]
    if dataset == "math500":
        return row["problem"]
    if dataset == "humaneval":
        return "Complete the following Python function.\n\n" + row["prompt"]
    if dataset == "mbpp":
        return row["prompt"] + "\nYour code should pass this test:\n" + row["test_list"][0]
    return row["turns"][0]  # mt_bench


# transformers' own assisted decoding, which reports no statistics: the bench counts its target forwards
_TRANSFORMERS_ASSISTED = ("dflash_hf", "prompt_lookup")
METHODS = ("ar", "ar_static", "dflash", "xpress", "markov", "dflash_static", "xpress_static", "dflash_hf",
           "prompt_lookup")
_WITHOUT_SPECULATOR = ("ar", "ar_static", "prompt_lookup")


def _method_runs(config: BenchConfig, speculator, max_cache_len: int) -> list[tuple[str, dict]]:
    """(name, extra generate kwargs) per measured method; plain generate ("ar") always comes first.

    `max_cache_len` sizes ar_static's cache for the longest prompt, so that every call has the same cache shape and a
    compiled forward is compiled once, in the warm-up."""
    runs = []
    ours = dict(assistant_model=speculator)  # what every run of our speculative loop shares
    if config.num_draft_tokens is not None:
        ours["num_draft_tokens"] = config.num_draft_tokens
    for method in config.methods:
        if method == "xpress":
            runs += [(f"xpress_k{k}" if len(config.jacobi_passes) > 1 else "xpress",
                      dict(ours, speculation="xpress", num_jacobi_passes=k))
                     for k in config.jacobi_passes]
        elif method in ("dflash", "markov"):
            runs.append((method, dict(ours, speculation=method)))
        elif method in ("dflash_static", "xpress_static"):  # our loop with static caches, compiled as ar_static is
            speculation = method.removesuffix("_static")
            static = dict(ours, speculation=speculation, cache_implementation="static",
                          max_cache_len=max_cache_len, **_compile_kwargs(config.compile))
            if speculation == "dflash":
                runs.append((method, static))
            else:
                runs += [(f"xpress_static_k{k}" if len(config.jacobi_passes) > 1 else method,
                          dict(static, num_jacobi_passes=k)) for k in config.jacobi_passes]
        elif method == "dflash_hf":  # transformers' own dFlash candidate generator driving our drafter
            runs.append((method, dict(assistant_model=speculator, speculation_type="dflash")))
        elif method == "prompt_lookup":  # transformers' n-gram lookup in the prompt
            runs.append((method, dict(prompt_lookup_num_tokens=10)))
        elif method == "ar_static":  # plain generate with a static cache, compiled where transformers compiles
            runs.append((method, dict(cache_implementation="static", max_cache_len=max_cache_len,
                                      **_compile_kwargs(config.compile))))
        elif method == "ar":
            pass  # always first, below
        else:
            raise ValueError(f"Unknown method {method!r}; choose from {', '.join(METHODS)}.")
    # every ratio is relative to plain generate, whose scores (greedy runs) tell near-ties from real mismatches
    reference = ("ar", {} if generate_kwargs(config)["do_sample"] else {"output_scores": True})
    return [reference] + [r for r in runs if r[0] != "ar"]


def _compile_kwargs(setting: bool | None) -> dict:
    """generate kwargs for `BenchConfig.compile`."""
    if setting is None:
        return {}
    if not setting:
        return {"disable_compile": True}
    from . import _compat

    return {"compile_config": _compat.compile_config_for_all_devices()}


def _forward_compiled(model, kwargs: dict, out) -> bool:
    """Whether `model.generate(**kwargs)` ran the forward through torch.compile, by transformers' own rule.

    transformers (5.17-5.25, `GenerationMixin._valid_auto_compile_criteria`) compiles the decoding forward of plain
    and assisted decoding when the cache is compileable and not a DynamicCache (a static cache), the device is cuda,
    xpu, neuron, tpu or (from 5.25) mps, or `compile_config._compile_all_devices` is set, `disable_compile` is not
    set, and no quantizer or CPU/disk offload forbids it. We ask that rule with the cache the call returned; our
    speculative loop follows the same rule with a static cache (`dflash_static`, `xpress_static`), never compiles
    with the dynamic one, and says which it did in its statistics (a batch's output carries no cache)."""
    from transformers.generation.configuration_utils import GenerationConfig

    from . import _compat

    if (stats := getattr(out, "speculation", None)) is not None:
        return stats.compiled

    cache = getattr(out, _compat.generate_output_cache_field(), None)
    generation_config = copy.deepcopy(model.generation_config or GenerationConfig())
    generation_config.update(**kwargs)
    return _compat.forward_compiled(model, generation_config, cache)


class FirstTokenTimer(BaseStreamer):
    """A `generate` streamer that notes when the first generated tokens reach the host: prefill vs decode time.

    `generate` calls `put` with the prompt ids, then with each run of new tokens, then `end`. At the first run of new
    tokens (one token for plain decoding; prompt lookup can deliver several at once, all counted as prefill) the
    device is synchronised and the clock read, once; every other call returns at once, so the timer adds no
    measurable cost per step. `start` is set by `timed_generate` from the same clock.
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.start: float | None = None
        self.first_token_time: float | None = None
        self.first_tokens = 0
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.first_token_time is not None:
            return
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        synchronize(self.device)
        self.first_token_time = time.perf_counter()
        self.first_tokens = value.numel()  # batch 1

    def end(self) -> None:
        pass

    @property
    def prefill_seconds(self) -> float | None:
        if self.start is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.start


def timed_generate(model, **kwargs):
    """`model.generate(**kwargs)` and its wall time in seconds, device work included. A `FirstTokenTimer` passed as
    `streamer` is started on the same clock."""
    synchronize(model.device)
    start = time.perf_counter()
    if isinstance(kwargs.get("streamer"), FirstTokenTimer):
        kwargs["streamer"].start = start
    out = model.generate(**kwargs)
    synchronize(model.device)
    return out, time.perf_counter() - start


# the add-on (a Speculator attribute) each method drafts with, beside the drafter
_ADD_ON_OF_METHOD = {"xpress": "refiner", "xpress_static": "refiner", "markov": "markov_head"}


def load_models(config: BenchConfig, target=None, tokenizer=None, speculator=None):
    """(target, tokenizer, speculator) on `config.device`: those given, else `config.target` / `config.speculator`,
    else the embedded SmolLM2-135M-Instruct and its shipped speculator. The target is `enable`d."""
    import hf_specdiff

    dtype = torch_dtype(config.dtype)
    if speculator is None:  # first: a wrong path fails before the target loads, which can take minutes
        path = config.speculator or hf_specdiff.default_speculator_path()
        speculator = hf_specdiff.AutoSpeculator.from_pretrained(path)
    lacking = {method: part for method, part in _ADD_ON_OF_METHOD.items()
               if method in config.methods and getattr(speculator, part) is None}
    if lacking:  # (said here in the command's terms, before the target loads: generate would name `speculation=`)
        parts = " and ".join(sorted(set(lacking.values())))
        raise ValueError(f"--methods {list(lacking)} need the speculator's {parts}, and "
                         f"{config.speculator or 'this speculator'} has none: drop them (e.g. --methods ar dflash), or "
                         "bench a speculator trained with them (hf-specdiff train).")
    block_size = speculator.drafter.config.block_size
    if config.num_draft_tokens is not None and not 1 <= config.num_draft_tokens < block_size:
        raise ValueError(f"--num-draft-tokens {config.num_draft_tokens}: the speculator's blocks of {block_size} slots "
                         f"offer 1 to {block_size - 1} drafts.")
    from .embedded import target_and_tokenizer

    default_target = target is None and config.target is None
    target, tokenizer = target_and_tokenizer(target, tokenizer, config.target, config.tokenizer, dtype)
    try:  # before any prompt runs, where a method speculates: its first generate call would say it after the warm-up
        if not set(config.methods) <= set(_WITHOUT_SPECULATOR):
            speculator.check_compatible(target, placement=False)
    except ValueError as error:
        if not (default_target and config.speculator):
            raise
        raise ValueError(f"{error}\n--speculator {config.speculator} is not for the embedded SmolLM2-135M-Instruct, "
                         "which runs when no --target is given: pass the target it was trained for with --target.") \
            from None
    target = hf_specdiff.enable(target.to(config.device).eval())
    return target, tokenizer, speculator.to(device=config.device, dtype=dtype)


def check_bench_config(config: BenchConfig, methods: tuple[str, ...]) -> None:
    """Options that would be ignored, miscounted or fail late raise here, before any model loads."""
    _check_limit(config.limit)
    if config.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0: greedy), got {config.temperature}.")
    if config.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {config.max_new_tokens}.")
    if config.tie_tolerance < 0:  # a negative gap bound would count every greedy divergence as unexplained
        raise ValueError(f"--tie-tolerance must be >= 0 (a logit gap; 0: only the dtype's rounding explains a "
                         f"divergence), got {config.tie_tolerance}.")
    if any(k < 1 for k in config.jacobi_passes):
        raise ValueError(f"--jacobi-passes must each be >= 1, got {list(config.jacobi_passes)}.")
    torch_dtype(config.dtype)
    _check_device(config.device)
    _check_output_paths(config)
    unknown = [m for m in config.methods if m not in methods]
    if unknown:
        raise ValueError(f"Unknown methods {unknown}; choose from {', '.join(methods)}.")
    if config.prompts and list(config.datasets) != BenchConfig().datasets:
        raise ValueError(f"--prompts {config.prompts} replaces --datasets {list(config.datasets)}: give one of them.")
    for option, values in (("methods", config.methods), ("datasets", config.datasets),
                           ("batch-size", config.batch_size), ("jacobi-passes", config.jacobi_passes)):
        repeated = sorted({v for v in values if list(values).count(v) > 1})
        if repeated:  # two runs of one name would be merged into one row
            raise ValueError(f"--{option} lists {repeated} more than once; give each value once.")


def _check_device(name: str) -> None:
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"--device {name!r} is not a torch device ({error}).") from None
    available = {"cuda": torch.cuda.is_available, "mps": torch.backends.mps.is_available,
                 "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available()}.get(device.type, lambda: True)
    if not available():
        raise ValueError(f"--device {name}: this torch ({torch.__version__}) sees no {device.type} device; use "
                         "--device cpu, or install the torch build for your accelerator.")


def _check_output_paths(config: BenchConfig) -> None:
    """A results file or plots folder that could not be written fails now, not after the whole run."""
    for option, path, folder in (("--json", config.json, False), ("--markdown", config.markdown, False),
                                 ("--plots", config.plots, True)):
        if not path:
            continue
        path = Path(path)
        if path.exists() and path.is_dir() != folder:
            raise ValueError(f"{option} {path}: {'a file' if folder else 'a folder'} is there; give another path.")
        existing = next(p for p in (path, *path.parents) if p.exists())  # what must let it be written or made
        if not os.access(existing, os.W_OK) or (existing != path and not existing.is_dir()):
            raise ValueError(f"{option} {path}: cannot write there ({existing} is not writable, or not a folder).")


# options only the diffusion-LM methods read
_DIFFUSION_OPTIONS = ("block_length", "steps", "remasking", "threshold", "cache", "max_drafts", "draft_graph", "base")


def check_ar_options(config: BenchConfig) -> None:
    """Autoregressive-bench options set without a method that uses them."""
    methods = set(config.methods)
    unused = []
    if list(config.jacobi_passes) != [4] and not methods & {"xpress", "xpress_static"}:
        unused.append(f"--jacobi-passes {config.jacobi_passes} (xpress, xpress_static)")
    if config.num_draft_tokens is not None and not methods & {"dflash", "xpress", "markov", "dflash_static",
                                                              "xpress_static"}:
        unused.append(f"--num-draft-tokens {config.num_draft_tokens} (dflash, xpress, markov and their _static runs)")
    if config.compile is not None and not methods & {"ar_static", "dflash_static", "xpress_static"}:
        unused.append(f"--compile {config.compile} (ar_static, dflash_static, xpress_static)")
    defaults = BenchConfig()
    changed = [name for name in _DIFFUSION_OPTIONS if getattr(config, name) != getattr(defaults, name)]
    if changed:
        unused.append(f"{', '.join('--' + name.replace('_', '-') for name in changed)} (the diffusion methods: "
                      "steps, threshold, spiffy, spiffy_threshold, ar_base)")
    if unused:
        raise ValueError(f"{'; '.join(unused)}: no method in --methods {list(config.methods)} uses it. Add such a "
                         "method or drop the option.")


_AR_OPTIONS = ("jacobi_passes", "num_draft_tokens", "compile", "speculator")


# diffusion options that some methods read only: set for a run of none of them, they would be ignored
_DIFFUSION_METHOD_OPTIONS = {"draft_graph": ("spiffy", "spiffy_threshold"),
                             "max_drafts": ("spiffy", "spiffy_threshold"),
                             "threshold": ("threshold", "spiffy_threshold")}


def check_diffusion_options(config: BenchConfig) -> None:
    """Autoregressive-bench options set for a run of diffusion methods, which none of them uses, and the options of
    some diffusion methods (a draft graph, Spiffy's drafts, the unmasking threshold) set for a run without them."""
    defaults = BenchConfig()
    if changed := [name for name in _AR_OPTIONS if getattr(config, name) != getattr(defaults, name)]:
        raise ValueError(
            f"{', '.join('--' + name.replace('_', '-') for name in changed)}: the diffusion methods "
            f"{list(config.methods)} do not use it (the speculative methods do: ar, dflash, xpress, ...). Drop it."
        )
    for name, readers in _DIFFUSION_METHOD_OPTIONS.items():
        if getattr(config, name) != getattr(defaults, name) and not set(readers) & set(config.methods):
            raise ValueError(f"--{name.replace('_', '-')} {getattr(config, name)} ({', '.join(readers)}): no method in "
                             f"--methods {list(config.methods)} uses it. Add such a method or drop the option.")


def generate_kwargs(config: BenchConfig) -> dict:
    """What every measured `generate` call shares: greedy or sampled, the budget, a dict output."""
    common = dict(max_new_tokens=config.max_new_tokens, do_sample=config.temperature > 0, return_dict_in_generate=True)
    if config.temperature > 0:
        common["temperature"] = config.temperature
    return common


def run_bench(config: BenchConfig, target=None, tokenizer=None, speculator=None, progress: bool = True) -> dict:
    """Batch size 1, prompt by prompt (`config.batch_size` other than [1]: see `bench_batched.run_batch_bench`)."""
    from tqdm.auto import tqdm

    check_bench_config(config, METHODS)
    check_ar_options(config)
    if list(config.batch_size) != [1]:
        from .bench_batched import run_batch_bench

        return run_batch_bench(config, target, tokenizer, speculator, progress)
    prompts = load_prompts(config)  # a bad file or dataset fails before the models load
    data_dir = data_folder(config)  # recorded: the folder the prompts were read from
    target, tokenizer, speculator = load_models(config, target, tokenizer, speculator)
    sampling = config.temperature > 0
    common = generate_kwargs(config)

    def generate(inputs, extra):
        timer = FirstTokenTimer(target.device)
        out, seconds = timed_generate(target, **inputs, **common, **extra, streamer=timer)
        return out, seconds, timer

    forwards = 0  # of the target, in a call of transformers' assisted decoding (which keeps no statistics)

    def count_forward(*_):
        nonlocal forwards
        forwards += 1

    encoded = []
    for dataset, messages in prompts:
        ids = torch.tensor([prompt_ids(tokenizer, messages)], device=config.device)
        encoded.append((dataset, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}))
    check_prompt_vocabulary((inputs["input_ids"][0].tolist() for _, inputs in encoded), target, TOKENIZER_REMEDY)
    longest = max(inputs["input_ids"].shape[1] for _, inputs in encoded)
    runs = _method_runs(config, speculator, max_cache_len=longest + config.max_new_tokens)
    compiled = {}
    for name, kwargs in runs:  # warm-up (and compilation), excluded from every figure
        out, _, _ = generate(encoded[0][1], kwargs)
        compiled[name] = _forward_compiled(target, {**common, **kwargs}, out)

    records = []
    bar = tqdm(total=len(encoded) * len(runs), desc="bench", disable=not progress)
    for index, (dataset, inputs) in enumerate(encoded):
        reference = None
        for name, kwargs in runs:  # interleaved: every method sees each prompt back to back
            torch.manual_seed(config.seed + index)
            forwards, hook = 0, None
            if name in _TRANSFORMERS_ASSISTED:
                hook = target.register_forward_hook(count_forward)
            try:
                out, seconds, timer = generate(inputs, kwargs)
            finally:
                if hook is not None:
                    hook.remove()
            prompt_length = inputs["input_ids"].shape[1]
            record = {"dataset": dataset, "prompt": index, "method": name, "seconds": seconds,
                      "new_tokens": out.sequences.shape[1] - prompt_length, "compiled": compiled[name],
                      "prefill_seconds": timer.prefill_seconds, "first_tokens": timer.first_tokens}
            if sampling:  # outside the timing
                record["mean_logprob"] = mean_target_logprob(target, out.sequences, prompt_length, config.temperature)
            if name == "ar":
                reference = out
                records.append(record)
                bar.update(1)
                continue
            if getattr(out, "speculation", None) is not None:  # transformers' own methods report no statistics
                record["stats"] = out.speculation.to_dict()
                record["accepted_at_position"] = out.speculation.accepted_at_position()
            elif hook is not None:  # theirs: target forwards counted, the prefill's included
                record["target_forwards"] = forwards
            if not sampling:
                record.update(_lossless_check(reference, out, prompt_length, config.tie_tolerance, dtype=target.dtype))
            records.append(record)
            bar.update(1)
    bar.close()
    names = [n for n, _ in runs]
    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    return {"config": recorded_config(config),
            "environment": _environment(target, config, speculator, tokenizer, data_dir),
            "runs": names,
            "summary": summarize(records, names),
            "by_dataset": {d: summarize([r for r in records if r["dataset"] == d], names) for d in datasets},
            "records": records}


NEAR_TIE_ULPS = 4  # in 16-bit, forwards of other widths round the logits differently by a few units of rounding


def _lossless_check(reference, out, prompt_length, tolerance, row: int = 0, stop_ids: set[int] = frozenset(),
                    dtype: torch.dtype = torch.float32) -> dict:
    """Does row `row` of `out` generate what plain `generate`'s (`reference`) did? Compared up to each one's first
    stop token (what follows is padding); a first divergence where the target's logits for the two tokens lie
    within `tolerance`, or within NEAR_TIE_ULPS units of the target dtype's rounding at their size (bf16 rounds a
    logit of 20 to steps of 0.125), is a floating-point near-tie, not a bug."""
    a = torch.tensor(until_stop(reference.sequences[row, prompt_length:].tolist(), stop_ids))
    b = torch.tensor(until_stop(out.sequences[row, prompt_length:].tolist(), stop_ids))
    n = min(len(a), len(b))
    diverged = (a[:n] != b[:n]).nonzero()
    if not len(diverged) and len(a) == len(b):
        return {"mismatch": False, "unexplained_mismatch": False}
    if not len(diverged):  # one stopped earlier with identical tokens up to there: not a near-tie
        return {"mismatch": True, "unexplained_mismatch": True, "logit_gap": None}
    i = int(diverged[0])
    scores = reference.scores[i][row]
    gap = float((scores[a[i]] - scores[b[i]]).abs())
    size = float(torch.maximum(scores[a[i]].abs(), scores[b[i]].abs()))
    bound = max(tolerance, NEAR_TIE_ULPS * torch.finfo(dtype).eps * size)
    return {"mismatch": True, "unexplained_mismatch": gap > bound, "logit_gap": gap, "near_tie_bound": bound,
            "first_divergence": i}


@torch.no_grad()
def mean_target_logprob(target, sequences: torch.LongTensor, prompt_length: int, temperature: float) -> float | None:
    """Mean log p(x_t | x_<t) of the generated tokens under the target at `temperature` (log_softmax(logits / T)),
    from one teacher-forced forward over prompt + output. None when nothing was generated."""
    if sequences.shape[1] <= prompt_length:
        return None
    logits = target(input_ids=sequences, use_cache=False).logits[:, prompt_length - 1 : -1].float()  # (1, n, V)
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return float(logprobs.gather(-1, sequences[:, prompt_length:, None]).mean())


def paired_permutation_test(a, b, permutations: int = 10_000, seed: int = 0) -> float:
    """Two-sided p-value of a paired sign-flip permutation test of mean(a - b) = 0.

    If a_i and b_i are exchangeable within each pair (the null hypothesis), each difference d_i = a_i - b_i is as
    likely to carry either sign, so |mean(d)| is ranked among |mean(s * d)| over sign vectors s: all 2^n of them when
    that is at most `permutations` (the exact test), otherwise `permutations` seeded random ones (p counts the
    observed vector once more, so it is never 0). Pure torch.

    In the bench, a_i and b_i are the target's mean log-probability of a method's and plain generate's sampled
    output for prompt i. A lossless speculative sampler draws from the target's distribution exactly as plain
    sampling does, so the differences only carry sampling noise. A verifier that leaks the draft distribution (it
    accepts draft tokens more often than min(1, p/q), or resamples from the wrong residual) emits tokens partly from
    q, which moves the mean log-probability the target assigns to them: small p-values flag that. It is a coarse
    check: it sees only a shift of that one statistic, with as many pairs as prompts; the exact test of the output
    distribution lives in tests/test_sampling.py.
    """
    d = torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)
    n = d.numel()
    if n == 0:
        return 1.0
    observed = d.mean().abs()
    tolerance = 1e-12 * float(d.abs().max())  # equal statistics summed in another order still count as ties
    if 2**n <= permutations:
        bits = (torch.arange(2**n)[:, None] >> torch.arange(n)) & 1
        flipped = ((1 - 2 * bits).to(torch.float64) * d).mean(dim=1).abs()
        return float((flipped >= observed - tolerance).double().mean())
    generator = torch.Generator().manual_seed(seed)
    signs = 1 - 2 * torch.randint(0, 2, (permutations, n), generator=generator).to(torch.float64)
    flipped = (signs * d).mean(dim=1).abs()
    return float((1 + (flipped >= observed - tolerance).sum()) / (1 + permutations))


SIGNIFICANCE = 0.05  # the level at which a sampled run's p-value is read as flagging a shifted distribution


def smallest_p_value(pairs: int, permutations: int = 10_000) -> float:
    """The smallest p-value `paired_permutation_test` can return for `pairs` pairs: the observed sign vector and its
    mirror image always rank as high as the observed one, so the exact test (2^n <= permutations) never goes below
    2 / 2^n (0.5 for 2 pairs, 0.25 for 3); the sampled one never below 1 / (1 + permutations)."""
    if pairs == 0:
        return 1.0
    return 2 / 2**pairs if 2**pairs <= permutations else 1 / (1 + permutations)


def fewest_pairs_to_reject(level: float = SIGNIFICANCE) -> int:
    """How many pairs the permutation test needs before it can reject at `level` at all (6 at 0.05: p >= 2/64)."""
    pairs = 1
    while smallest_p_value(pairs) >= level:
        pairs += 1
    return pairs


def too_few_pairs_note(pairs: int) -> str | None:
    """Why a sampled run's p-value cannot flag anything with `pairs` prompts, and what to do; None when it can."""
    if pairs == 0 or smallest_p_value(pairs) < SIGNIFICANCE:
        return None
    return (f"too few prompts (n={pairs}) for this test to detect a difference: its smallest possible p-value is "
            f"{smallest_p_value(pairs):.2g}, not below {SIGNIFICANCE}; use --limit >= {fewest_pairs_to_reject()} (or "
            "that many prompts in a --prompts file)")


def _sampling_check(rows: list[dict], reference_rows: list[dict]) -> dict:
    """The sampled run's losslessness check: mean target log-probabilities, their mean difference and its p-value;
    `too_few_prompts` says (or is None) when so few prompts were paired that no p-value could fall below
    SIGNIFICANCE, so that a large p there is no evidence of losslessness."""
    reference = {r["prompt"]: r["mean_logprob"] for r in reference_rows}
    pairs = [(r["mean_logprob"], reference.get(r["prompt"])) for r in rows]
    pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
    if not pairs:
        return {"mean_logprob": None, "ar_mean_logprob": None, "mean_difference": None, "p_value": None, "prompts": 0,
                "smallest_p_value": 1.0, "too_few_prompts": None}
    ours, theirs = [x for x, _ in pairs], [y for _, y in pairs]
    return {"mean_logprob": sum(ours) / len(ours), "ar_mean_logprob": sum(theirs) / len(theirs),
            "mean_difference": (sum(ours) - sum(theirs)) / len(pairs),
            "p_value": paired_permutation_test(ours, theirs), "prompts": len(pairs),
            "smallest_p_value": smallest_p_value(len(pairs)), "too_few_prompts": too_few_pairs_note(len(pairs))}


def sampling_check_cell(check: dict) -> str:
    """A sampled run's table cell: mean log-probability difference and p-value, starred where too few prompts were
    paired for the p-value to flag anything (`sampling_power_note` explains the star)."""
    star = "*" if check.get("too_few_prompts") else ""
    return f"{check['mean_difference']:+.3f} (p={check['p_value']:.2f}{star})"


def sampling_power_note(checks) -> str:
    """A footer sentence for the starred cells of a sampled run's table (`checks`: its sampling_check dicts), or ''.
    Results written before the check recorded this show no star and no note."""
    counts = sorted({check["prompts"] for check in checks if check and check.get("too_few_prompts")})
    if not counts:
        return ""
    pairs = ", ".join(map(str, counts))
    return (f" * too few prompts (n={pairs}) for this test to detect a difference: with n pairs its smallest possible "
            f"p-value is 2/2^n, not below {SIGNIFICANCE} until n = {fewest_pairs_to_reject()}, so these p-values "
            f"cannot flag a shifted distribution; use --limit >= {fewest_pairs_to_reject()} (or that many prompts in "
            "a --prompts file).")


def summarize(records: list[dict], runs: list[str]) -> dict:
    summary = {}
    ar_speed = None
    for name in runs:
        rows = [r for r in records if r["method"] == name]
        tokens, seconds = sum(r["new_tokens"] for r in rows), sum(r["seconds"] for r in rows)
        entry = {"prompts": len(rows), "new_tokens": tokens, "seconds": seconds,
                 "tokens_per_s": tokens / seconds if seconds else 0.0}
        if rows and "prefill_seconds" in rows[0]:
            timed = [r for r in rows if r["prefill_seconds"] is not None]
            prefill = sum(r["prefill_seconds"] for r in timed)
            decode_tokens = sum(r["new_tokens"] - r["first_tokens"] for r in timed)
            decode_seconds = sum(r["seconds"] for r in timed) - prefill
            entry["prefill_ms"] = 1000 * prefill / max(len(timed), 1)
            entry["decode_tokens_per_s"] = decode_tokens / decode_seconds if decode_seconds > 0 else 0.0
            entry["compiled"] = rows[0]["compiled"]
        if name == "ar":
            ar_speed = entry["tokens_per_s"]
        elif rows and "mean_logprob" in rows[0]:
            entry["sampling_check"] = _sampling_check(rows, [r for r in records if r["method"] == "ar"])
        if rows and "mismatch" in rows[0]:
            entry["lossless_mismatches"] = sum(r["mismatch"] for r in rows)
            entry["unexplained_mismatches"] = sum(r["unexplained_mismatch"] for r in rows)
        if rows and "stats" in rows[0]:
            stats = [r["stats"] for r in rows]
            entry["tau"] = mean_accepted_length([s["accepted_lengths"] for s in stats])
            entry["tau_per_sample"] = [mean_accepted_length([s["accepted_lengths"]]) for s in stats]
            positions = max((len(r["accepted_at_position"][1]) for r in rows), default=0)
            accepted = [sum(c) for c in zip(*[_pad(r["accepted_at_position"][0], positions) for r in rows])]
            offered = [sum(c) for c in zip(*[_pad(r["accepted_at_position"][1], positions) for r in rows])]
            entry["accept_rate_by_position"] = [a / o for a, o in zip(accepted, offered) if o]
            entry.update(phase_times(stats))
            entry["target_forwards"] = sum(s["target_forwards"] for s in stats)
        elif rows and "target_forwards" in rows[0]:  # transformers' assisted decoding: tau from forwards and tokens
            entry["target_forwards"] = sum(r["target_forwards"] for r in rows)
            steps = [(r["new_tokens"] - 1, r["target_forwards"] - 1) for r in rows]  # the prefill's token and forward
            entry["tau"] = sum(t for t, _ in steps) / sum(f for _, f in steps) if any(f for _, f in steps) else None
            entry["tau_per_sample"] = [t / f if f else None for t, f in steps]
        summary[name] = entry
    for entry in summary.values():
        entry["speedup_vs_ar"] = entry["tokens_per_s"] / ar_speed if ar_speed else None
    return summary


def mean_accepted_length(lengths: list[list[int]]) -> float | None:
    """tau over the verify steps of several runs (bonus included); None when none took a step (a budget of one token:
    the prefill emits it)."""
    steps = sum(len(run) for run in lengths)
    return sum(map(sum, lengths)) / steps if steps else None


def phase_times(stats: list[dict]) -> dict:
    """Milliseconds per (batched) step of drafting, resolving and verifying a block, steady state: the prefill forward
    and the first block's drafter pass, which reads the whole prompt, are reported per run apart (`prefill_forward_ms`,
    `draft_prefill_ms`). None where no step was taken. `refine_ms` is resolving the drafted block into tokens
    (`PHASES_NOTE`): dflash, which has no refiner, spends it picking each slot's token from the drafter's logits."""
    def per(seconds, count):
        return 1000 * seconds / count if count else None

    blocks = sum(s["blocks"] for s in stats)
    return {
        "draft_ms": per(sum(s["draft_seconds"] for s in stats), sum(max(s["blocks"] - 1, 0) for s in stats)),
        "refine_ms": per(sum(s["refine_seconds"] for s in stats), blocks),
        "verify_ms": per(sum(s["verify_seconds"] for s in stats), sum(s["target_forwards"] - 1 for s in stats)),
        "prefill_forward_ms": per(sum(s["prefill_seconds"] for s in stats), len(stats)),
        "draft_prefill_ms": per(sum(s["draft_prefill_seconds"] for s in stats), sum(s["blocks"] > 0 for s in stats)),
    }


def _pad(values, size):
    return list(values) + [0] * (size - len(values))


def cpu_name() -> str:
    """The CPU's model name: CPU figures depend on it (the BLAS paths a few-row forward takes differ between an AMD
    EPYC and an Intel Xeon host). Linux: /proc/cpuinfo's; elsewhere what `platform` knows (often only the
    architecture)."""
    return _cpu_linear.cpuinfo_field("model name") or platform.processor() or platform.machine()


# Environment variables that change how fast a run goes (not what it generates), recorded with its figures:
# TRANSFORMERS_SDPA_FORCE_GQA lets SDPA read grouped K/V heads in place, where transformers otherwise copies them for
# every masked forward (each verify forward of several cached tokens); the others cap the CPU's threads.
SPEED_SETTINGS = ("TRANSFORMERS_SDPA_FORCE_GQA", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def speed_settings_note(env: dict) -> str:
    """'; set: NAME=value, ...' for a table footer, or '' (results written before they were recorded too)."""
    settings = env.get("speed_settings") or {}
    return "; set: " + ", ".join(f"{name}={value}" for name, value in settings.items()) if settings else ""


def _environment(target, config, speculator=None, tokenizer=None, data_dir: Path | None = None) -> dict:
    import transformers

    device = config.device
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else cpu_name()
    from . import __version__

    env = {"device": device, "device_name": name, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "dtype": config.dtype, "model_dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
           "torch": torch.__version__, "transformers": transformers.__version__, "hf_specdiff": __version__,
           "python": platform.python_version(), "target": target.config.name_or_path or type(target).__name__,
           "speed_settings": {name: os.environ[name] for name in SPEED_SETTINGS if name in os.environ}}
    if device == "cpu":  # the few-row layout the speculative loop takes here (`_cpu_linear.py`)
        env["cpu_weights_packed"] = _cpu_linear.packing_pays_on_this_cpu()
    if tokenizer is not None:  # a base model's prompts are plain text
        env["prompt_format"] = prompt_format(tokenizer)
    if data_dir is not None:  # where the datasets' prompts came from (--data-dir, $HF_SPECDIFF_DATA or shared/data)
        env["data_dir"] = str(Path(data_dir).resolve())
    if speculator is not None:  # which one (the folder it was loaded from), and how many tokens it drafts from
        env["speculator"] = speculator.drafter.config.name_or_path or None
        env["draft_vocab_size"] = None if speculator.draft_vocab is None else len(speculator.draft_vocab)
    return env


def prompt_format_note(env: dict) -> str:
    """A footer's note when the prompts were plain text (a base model's), else nothing."""
    plain = env.get("prompt_format", "chat template") != "chat template"
    return "; prompts as plain text (the tokenizer has no chat template)" if plain else ""


def _prompt_source(result: dict) -> str:
    config = result["config"]
    if config.get("prompts"):
        count = result["summary"][result["runs"][0]]["prompts"]
        return f"{count} prompt{'s' * (count != 1)} from {config['prompts']}"
    limit, first = config["limit"], result["runs"][0]
    counts = {dataset: summary[first]["prompts"] for dataset, summary in result.get("by_dataset", {}).items()}
    if limit and all(count == limit for count in counts.values()):
        return f"datasets {config['datasets']}, {limit} prompt{'s' * (limit != 1)} each"
    # a set holding fewer prompts than --limit (or --limit 0: all of them): say how many each gave
    return f"datasets {config['datasets']}, prompts " + ", ".join(f"{d}: {n}" for d, n in counts.items())


def _drafts_per_block(result: dict) -> str:
    """The footer's note on drafting, where a method that drafts ran."""
    runs = result["runs"]
    if not any(name.startswith(("dflash", "xpress", "markov")) for name in runs):
        return ""
    drafts, vocab = result["config"].get("num_draft_tokens"), result["environment"].get("draft_vocab_size")
    native = "; dflash_hf, transformers' loop, drafts whole blocks" if "dflash_hf" in runs else ""
    return ("" if drafts is None else f", {drafts} drafts per block (--num-draft-tokens{native})") + \
        ("" if vocab is None else f", drafts read out over a draft vocabulary of {vocab:,} tokens")


def markdown_table(result: dict) -> str:
    """The summary as a Markdown table with a footer (device, versions, compilation, how losslessness was checked).
    Renders results of older bench versions too (missing figures show as -)."""
    sampled = result["config"].get("temperature", 0.0) > 0
    check = "logprob diff vs ar (p)" if sampled else "mismatches (unexplained)"
    lines = ["| dataset | method | tau | tokens/s | speedup vs ar | prefill ms | decode tokens/s | draft ms | "
             f"refine ms | verify ms | {check} |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    sections = dict(result["by_dataset"])
    if len(sections) > 1:
        sections["all"] = result["summary"]

    def number(entry: dict, key: str, digits: int = 1) -> str:
        return f"{entry[key]:.{digits}f}" if entry.get(key) is not None else "-"

    for dataset, summary in sections.items():
        for name, e in summary.items():
            tau = "1.00" if name in ("ar", "ar_static") else number(e, "tau", 2)
            phases = " | ".join(number(e, f"{p}_ms") for p in ("draft", "refine", "verify"))
            if name == "ar":
                verdict = ""
            elif "sampling_check" in e and e["sampling_check"]["prompts"]:
                verdict = sampling_check_cell(e["sampling_check"])
            else:
                verdict = f"{e.get('lossless_mismatches', '-')} ({e.get('unexplained_mismatches', '-')})"
            lines.append(f"| {dataset} | {name} | {tau} | {e['tokens_per_s']:.1f} | {number(e, 'speedup_vs_ar', 2)} | "
                         f"{number(e, 'prefill_ms')} | {number(e, 'decode_tokens_per_s')} | {phases} | {verdict} |")
    env = result["environment"]
    lines.append("")
    lines.append(f"{env['device_name']} ({env['device']}), {env['dtype']}, torch {env['torch']}, "
                 f"transformers {env['transformers']}; {_prompt_source(result)}, "
                 f"max_new_tokens {result['config']['max_new_tokens']}{_drafts_per_block(result)}"
                 f"{speed_settings_note(env)}{prompt_format_note(env)}.")
    if any("compiled" in e for e in result["summary"].values()):
        lines.append(f"{compile_note(result['summary'], result['config'])} Prefill = time to the first generated "
                     "token; decode tokens/s = the tokens after it over the time after it.")
    if any(e.get("refine_ms") is not None for e in result["summary"].values()):
        lines.append(f"Draft, refine and verify ms are per verify step (one drafted block each){PHASES_NOTE}")
    if sampled:
        checks = [e.get("sampling_check") for summary in sections.values() for e in summary.values()]
        lines.append(sampling_note(result["config"]["temperature"], "prompts") + sampling_power_note(checks))
    return "\n".join(lines)


# what a table's phase columns hold, after the unit it is in (a table footer); the timed spans: `candidates.py`
PHASES_NOTE = (
    ", in the steady state (the prefill forward and the first block's drafter pass over the prompt are left out). "
    "Refine is turning the drafter's logits into draft tokens: xpress's Jacobi passes, markov's left-to-right head, "
    "and for dflash, which has no refiner, picking each slot's token on its own (argmax, or a sample, of the processed "
    "logits); the drafter's read-out to logits counts as draft."
)


def compile_note(summary: dict, config: dict) -> str:
    """Which methods' forward torch.compile compiled, and why a static-cache method's was not (a table footer)."""
    compiled = [name for name, e in summary.items() if e.get("compiled")]
    note = f"Forward compiled by torch.compile: {', '.join(compiled) or 'none'}."
    eager = [name for name in summary if "_static" in name and name not in compiled]
    if eager:
        why = ("--no-compile" if config.get("compile") is False else
               "transformers compiles on its own on cuda, xpu, neuron and tpu only; --compile forces it")
        note += f" {', '.join(eager)}: static cache, not compiled ({why})."
    return note


def sampling_note(temperature: float, units: str) -> str:
    """What the last column of a sampled run's table means (a table footer); `units`: what the test pairs."""
    return (f"Sampled at temperature {temperature}: per-token losslessness cannot be checked; the last column is the "
            "method's mean target log-probability per generated token minus plain generate's, with the p-value of a "
            f"paired sign-flip permutation test over {units} (a coarse check: small p flags a shifted output "
            "distribution).")


def is_diffusion_bench(config: BenchConfig) -> bool:
    from .bench_diffusion import DIFFUSION_METHODS

    diffusion = [m in DIFFUSION_METHODS for m in config.methods]
    if any(diffusion) and not all(diffusion):
        raise ValueError(f"Methods {config.methods} mix diffusion-LM and autoregressive methods; "
                         "bench one kind per run.")
    return all(diffusion)


def bench(config: BenchConfig) -> dict:
    """What `hf-specdiff bench` runs: diffusion-LM methods, the batch curve (`--batch-size` other than 1), or every
    method prompt by prompt."""
    if is_diffusion_bench(config):
        from .bench_diffusion import run_diffusion_bench

        return run_diffusion_bench(config)
    return run_bench(config)


def _renderers(result: dict, config: BenchConfig):
    """(markdown table, plots) functions for a result of `bench`."""
    if result.get("kind") == "batch_curve":
        from .bench_batched import batch_markdown_table, plot_batch_curve

        return batch_markdown_table, plot_batch_curve
    if is_diffusion_bench(config):
        from .bench_diffusion import diffusion_markdown_table, plot_diffusion

        return diffusion_markdown_table, plot_diffusion
    return markdown_table, plot_results


def result_table(result: dict, config: BenchConfig) -> str:
    return _renderers(result, config)[0](result)


def write_outputs(result: dict, config: BenchConfig) -> None:
    table, plots = _renderers(result, config)
    if config.json:
        Path(config.json).parent.mkdir(parents=True, exist_ok=True)
        Path(config.json).write_text(json.dumps(result, indent=1))
    if config.markdown:
        Path(config.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(config.markdown).write_text(table(result) + "\n")
    if config.plots:
        plots(result, config.plots)


def plot_results(result: dict, folder: str | Path) -> list[Path]:
    """speedup.png (tokens/s over plain generate, per dataset), accepted_lengths.png (histogram of tokens per
    verify step, one bar per method side by side), acceptance_by_position.png (P(draft at block position i accepted |
    offered)). A plot with nothing to show is not written (the speedup needs a method besides ar, the other two one of
    our speculative loop's methods): a warning says which and why. Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    folder = Path(folder)
    methods = [m for m in result["runs"] if m != "ar"]
    with_stats = [m for m in methods if "accept_rate_by_position" in result["summary"][m]]  # our loop's methods
    lengths = {m: [n for r in result["records"] if r["method"] == m for n in r["stats"]["accepted_lengths"]]
               for m in with_stats}
    lengths = {m: values for m, values in lengths.items() if values}  # a run of one-token budgets takes no step
    datasets = list(result["by_dataset"])
    figures, skipped = [], []

    if methods:
        fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(datasets) * len(methods) / 2, 3.5))
        width = 0.8 / len(methods)
        for i, method in enumerate(methods):
            values = [result["by_dataset"][d][method]["speedup_vs_ar"] for d in datasets]
            ax.bar([x + i * width for x in range(len(datasets))], values, width, label=method)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(datasets))], datasets)
        ax.set_ylabel("tokens/s vs plain generate")
        ax.legend(fontsize=8)
        figures.append((fig, "speedup.png"))
    else:
        skipped.append("speedup.png (only ar ran: add another method to --methods)")

    if lengths:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        longest = max(max(values) for values in lengths.values())
        # side by side, opaque: overlaid translucent histograms blend into colours no legend entry has
        ax.hist(list(lengths.values()), bins=range(1, longest + 2), density=True, align="left",
                label=list(lengths), color=[f"C{methods.index(m)}" for m in lengths])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("tokens per verify step (bonus included)")
        ax.set_ylabel("fraction of steps")
        ax.legend(fontsize=8)
        figures.append((fig, "accepted_lengths.png"))
    else:
        skipped.append("accepted_lengths.png (no verify step of dflash, xpress, markov or their _static runs: "
                       f"{'none ran' if not with_stats else 'each prompt ended at its prefill'})")

    rates = {m: result["summary"][m]["accept_rate_by_position"] for m in with_stats}
    if any(rates.values()):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for method, rate in rates.items():
            ax.plot(range(1, len(rate) + 1), rate, marker="o", markersize=3, label=method,
                    color=f"C{methods.index(method)}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # block positions are whole numbers
        ax.set_xlabel("draft position in block")
        ax.set_ylabel("accepted | offered")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
        figures.append((fig, "acceptance_by_position.png"))
    else:
        skipped.append("acceptance_by_position.png (no draft of dflash, xpress, markov or their _static runs was "
                       f"offered: {'none ran' if not with_stats else 'each prompt ended at its prefill'})")

    if skipped:
        from ._warnings import warn_at_caller

        warn_at_caller(f"--plots {folder}: not written, nothing to show: {'; '.join(skipped)}.")
    written = []
    if figures:
        folder.mkdir(parents=True, exist_ok=True)
    for figure, name in figures:
        figure.tight_layout()
        figure.savefig(folder / name, dpi=120)
        plt.close(figure)
        written.append(folder / name)
    return written
