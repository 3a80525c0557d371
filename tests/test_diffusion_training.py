"""Turning a causal LM into a masked diffusion LM, on a tiny Llama: the noising process, the loss, training lowers the
held-out loss, checkpoints resume exactly, the artifact holds only the add-on and loads back to the same logits, and
bad inputs fail with a message that says what to do."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import card_limitations, make_target
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_specdiff.diffusion import AutoDiffusionLM, DiffusionGenerationConfig, DiffusionLM, diffusion_generate
from hf_specdiff.diffusion.training import (
    DiffusionTrainConfig,
    collate_answers,
    diffusion_masks,
    masked_diffusion_loss,
    sample_noise,
    train_diffusion,
)

MASK, EOS = 1, 2
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "configs"
# peft 0.2x asks transformers 5 a deprecated question; nothing to do with this code
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def write_data(path, rows=60, seed=0):
    """Prompts of random tokens; answers count up from the prompt's last token (learnable), then EOS."""
    generator = torch.Generator().manual_seed(seed)
    with path.open("w") as out:
        for i in range(rows):
            prompt = torch.randint(3, 64, (int(torch.randint(3, 8, (1,), generator=generator)),), generator=generator)
            n = int(torch.randint(6, 20, (1,), generator=generator))
            answer = [3 + (int(prompt[-1]) - 3 + k + 1) % 61 for k in range(n)] + [EOS]
            out.write(json.dumps({"id": i, "prompt_ids": prompt.tolist(), "response_ids": answer}) + "\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny float32 Llama saved as the base, a data file, and one 30-step run on them."""
    folder = tmp_path_factory.mktemp("diffusion")
    base = make_target(dtype=torch.float32, eos_token_id=EOS)
    base.save_pretrained(folder / "base")
    data = write_data(folder / "data.jsonl")
    config = tiny_config(folder, data)
    model = train_diffusion(config, progress=False)
    return folder, data, config, model


def tiny_config(folder, data, **overrides):
    """Options for a run in folder/run on the base in folder/base (both overridable)."""
    values = dict(data=[str(data)], output_dir=str(folder / "run"), base=str(folder / "base"), mask_token_id=MASK,
                  lora_rank=8, lora_alpha=16.0, max_seq_len=64, block_length=8, batch_size=8, max_steps=30,
                  learning_rate=1e-2, warmup_steps=3, mixed_precision="no", eval_sequences=8, eval_every=10,
                  save_every=10)
    if overrides.get("finetune") == "full":  # the LoRA options would do nothing, and are refused
        del values["lora_rank"], values["lora_alpha"]
    values.update(overrides)
    return DiffusionTrainConfig(**values)


def read_log(run):
    return [json.loads(line) for line in (run / "log.jsonl").open()]


# ---------------------------------------------------------------------------------------------------------------
# The noising process and the loss
# ---------------------------------------------------------------------------------------------------------------


def test_plain_masking_spares_the_prompt_and_follows_t():
    b, T, prompt = 6, 4000, 100
    answer = torch.zeros(b, T, dtype=torch.bool)
    answer[:, prompt:] = True
    t = torch.tensor([0.05, 0.2, 0.4, 0.6, 0.8, 1.0])
    masked, scored = diffusion_masks(answer, t, torch.Generator().manual_seed(0))
    assert not masked[:, :prompt].any()
    assert torch.equal(scored, answer)
    share = masked[:, prompt:].float().mean(dim=1)
    assert torch.allclose(share, t, atol=0.025), share
    again, _ = diffusion_masks(answer, t, torch.Generator().manual_seed(0))
    assert torch.equal(masked, again)  # seeded


def test_block_masking_matches_semi_autoregressive_decoding():
    L, prompt, T = 8, 5, 5 + 8 * 50
    answer = torch.zeros(400, T, dtype=torch.bool)
    answer[:, prompt:] = True
    t = torch.full((400,), 0.5)
    masked, scored = diffusion_masks(answer, t, torch.Generator().manual_seed(1), torch.ones(400, dtype=torch.bool), L)
    blocks = set()
    for row in range(400):
        inside = scored[row].nonzero()[:, 0]
        low, high = int(inside[0]), int(inside[-1]) + 1
        assert high - low == L and (low - prompt) % L == 0  # one whole decoding block, counted from the answer start
        blocks.add((low - prompt) // L)
        assert not masked[row, :low].any()  # prompt and finished blocks clean
        assert masked[row, high:].all()  # later blocks fully masked
    assert len(blocks) > 40  # every block gets drawn
    inside_share = (masked & scored).sum() / scored.sum()
    assert abs(float(inside_share) - 0.5) < 0.03


def test_sample_noise():
    t, block_rows = sample_noise(20000, 1e-3, 0.3, torch.Generator().manual_seed(0))
    assert float(t.min()) > 1e-3 and float(t.max()) <= 1.0
    assert abs(float(t.mean()) - 0.5) < 0.01
    assert abs(float(block_rows.float().mean()) - 0.3) < 0.01


def test_collate_pads_finished_answers_with_eos():
    rows = [{"ids": [5, 6, 7, EOS], "answer_start": 2}, {"ids": [5, 6, 7, 8, 9, 10], "answer_start": 3},
            {"ids": [5, 6, 7], "answer_start": 1}]
    ids, valid, answer = collate_answers(rows, pad_id=0, eos_id=EOS)
    assert ids[0].tolist() == [5, 6, 7, EOS, EOS, EOS] and valid[0].all()  # finished: EOS padding is answer
    assert answer[0].tolist() == [False, False, True, True, True, True]
    assert ids[2].tolist() == [5, 6, 7, 0, 0, 0] and valid[2].tolist() == [True] * 3 + [False] * 3  # cut off
    assert answer[2].tolist() == [False, True, True, False, False, False]
    assert answer[1].tolist() == [False, False, False, True, True, True]


def test_loss_reads_shifted_logits_and_follows_llada():
    torch.manual_seed(0)
    b, T, V = 3, 7, 11
    logits = torch.randn(b, T, V, dtype=torch.float64)
    ids = torch.randint(2, V, (b, T))
    masked = torch.rand(b, T) < 0.5
    masked[:, :2] = False
    scored = torch.ones(b, T, dtype=torch.bool)
    scored[:, :2] = False
    scored[2, 5:] = False  # a row scored on part of its answer (block rows)
    t = torch.tensor([0.3, 0.7, 1.0], dtype=torch.float64)
    for shift in (0, 1):
        loss, n, _ = masked_diffusion_loss(logits, ids, masked, scored, t, MASK, shift)
        expected = 0.0
        for row in range(b):
            for i in range(T):
                if masked[row, i] and scored[row, i]:
                    row_logits = logits[row, i - shift].clone()
                    row_logits[MASK] = -torch.inf  # [MASK] is never a prediction
                    ce = F.cross_entropy(row_logits[None], ids[row, i][None])
                    expected += ce / t[row] / scored[row].sum()
        assert torch.allclose(loss, torch.as_tensor(expected / b)), (shift, loss, expected / b)
        assert n == int((masked & scored).sum())


# ---------------------------------------------------------------------------------------------------------------
# Training, the artifact, resuming
# ---------------------------------------------------------------------------------------------------------------


def test_training_lowers_the_held_out_loss(setup):
    folder, _, _, _ = setup
    log = read_log(folder / "run")
    assert [r["step"] for r in log] == list(range(31))
    before, after = log[0], log[-1]
    assert after["eval_loss"] < 0.93 * before["eval_loss"], (before, after)
    assert after["eval_accuracy"] > before["eval_accuracy"] + 0.2, (before, after)
    assert after["eval_block_accuracy"] > before["eval_block_accuracy"] + 0.2, (before, after)


def test_artifact_holds_only_the_add_on_and_loads_to_the_same_logits(setup):
    folder, _, _, model = setup
    artifact = folder / "run" / "diffusion_lm"
    assert sorted(p.name for p in artifact.iterdir()) == ["adapter_model.safetensors", "config.json"]
    config = json.loads((artifact / "config.json").read_text())
    assert config["base"] == str((folder / "base").resolve()) and config["format_version"] == 1
    assert config["diffusion"] == {"mask_token_id": MASK, "shift_logits": True, "block_causal": False}
    tensors = load_file(artifact / "adapter_model.safetensors")
    assert all(name.endswith((".lora_A.weight", ".lora_B.weight")) for name in tensors if name != "mask_embedding")
    assert len(tensors) == 3 * 7 * 2 + 1  # 3 layers x 7 projections x (A, B) + the [MASK] row
    base_numel = sum(p.numel() for p in model.parameters())
    assert sum(t.numel() for t in tensors.values()) < 0.35 * base_numel

    ids = torch.randint(3, 64, (2, 14), generator=torch.Generator().manual_seed(5))
    ids[:, 8:] = MASK
    with torch.no_grad():
        expected = model(ids).logits
        for loaded in (AutoDiffusionLM.from_pretrained(artifact),
                       AutoDiffusionLM.from_pretrained(artifact, base=str(folder / "base"))):
            assert isinstance(loaded, DiffusionLM) and loaded.shift_logits and loaded.mask_token_id == MASK
            torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-5, atol=1e-5)
    # dtype None keeps the base's dtype (the merge itself runs in float32)
    bf16_base = AutoModelForCausalLM.from_pretrained(folder / "base", dtype=torch.bfloat16)
    assert AutoDiffusionLM.from_pretrained(artifact, base=bf16_base).dtype == torch.bfloat16
    # the trained [MASK] row is in use, and diffusion decoding runs on the loaded model
    untrained = make_target(dtype=torch.float32, eos_token_id=EOS).model.embed_tokens.weight[MASK]
    assert not torch.equal(loaded.model.embed_tokens.weight[MASK], untrained)
    prompt = torch.tensor([[10, 11, 12, 13]])
    decoding = DiffusionGenerationConfig(max_new_tokens=16, block_length=8, stop_at_eos=False)
    out = diffusion_generate(loaded, prompt, config=decoding)
    assert out.sequences.shape == (1, 4 + 16) and not (out.sequences == MASK).any()
    assert torch.equal(out.sequences[:, :4], prompt)


def test_resume_continues_at_the_right_step_and_matches_an_uninterrupted_run(setup, tmp_path):
    folder, data, _, _ = setup
    config = tiny_config(folder, data, output_dir=str(tmp_path / "run"), max_steps=6, eval_every=3, save_every=3)
    train_diffusion(config, progress=False)
    uninterrupted = load_file(tmp_path / "run" / "diffusion_lm" / "adapter_model.safetensors")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "checkpoint-6")  # as if stopped after step 5
    train_diffusion(config, progress=False)
    steps = [r["step"] for r in read_log(tmp_path / "run")]
    assert steps == [0, 1, 2, 3, 4, 5, 6, 4, 5, 6]
    resumed = load_file(tmp_path / "run" / "diffusion_lm" / "adapter_model.safetensors")
    assert resumed.keys() == uninterrupted.keys()
    for name, tensor in uninterrupted.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    # checkpoints hold what is trained and the optimizer, not the frozen base
    checkpoint = load_file(tmp_path / "run" / "checkpoints" / "checkpoint-6" / "model.safetensors")
    assert all("lora_" in name or name == "mask_embedding" for name in checkpoint)
    with pytest.raises(ValueError, match="other settings.*lora_rank"):
        train_diffusion(dataclasses.replace(config, lora_rank=4, max_steps=8), progress=False)


def test_full_finetune_round_trip(setup, tmp_path):
    folder, data, _, _ = setup
    config = tiny_config(folder, data, output_dir=str(tmp_path / "run"), finetune="full", train_mask_embedding=False,
                         learning_rate=1e-3, max_steps=3, block_masking_share=0.0)
    model = train_diffusion(config, progress=False)
    tensors = load_file(tmp_path / "run" / "diffusion_lm" / "adapter_model.safetensors")
    assert not any("embed_tokens" in name or "lm_head" in name for name in tensors)
    assert "mask_embedding" not in tensors and "model.norm.weight" in tensors
    loaded = AutoDiffusionLM.from_pretrained(tmp_path / "run" / "diffusion_lm")
    ids = torch.randint(3, 64, (1, 10))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert "eval_block_loss" not in read_log(tmp_path / "run")[-1]


def test_cli_train_diffusion(setup, tmp_path):
    from hf_specdiff.cli import main

    folder, data, _, _ = setup
    options = dataclasses.asdict(tiny_config(folder, data, max_steps=2, eval_every=2, save_every=2))
    options.pop("output_dir")
    (tmp_path / "config.json").write_text(json.dumps(options))
    assert main(["train-diffusion", "--config", str(tmp_path / "config.json"), "--output-dir",
                 str(tmp_path / "cli")]) == 0
    assert [r["step"] for r in read_log(tmp_path / "cli")] == [0, 1, 2]
    assert (tmp_path / "cli" / "diffusion_lm" / "adapter_model.safetensors").is_file()


def test_export_ships_the_adapter_in_bf16_with_its_graph_and_card(setup, tmp_path, capsys):
    """`hf-specdiff export` on a diffusion run: adapter tensors in the asked dtype, loading to the run's model up to
    that rounding, a card with every placeholder filled from the run's config and log, and a Spiffy graph calibrated
    into the output folder kept (and described) when exporting again."""
    from hf_specdiff.cli import main
    from hf_specdiff.spiffy import DraftGraph, calibrate

    folder, _, _, model = setup
    output = tmp_path / "shipped"
    template = Path(__file__).parents[1] / "model_cards" / "diffusion_lm.md"
    export = ["export", "--run", str(folder / "run"), "--output", str(output), "--template", str(template)]
    with pytest.raises(SystemExit, match="--base-model is required.*local folder"):  # no Hub id for the card
        main(export)
    export += ["--base-model", "my-org/tiny-base"]
    with pytest.raises(SystemExit, match="--license is required"):  # a base of the user's: its licence is theirs
        main(export)
    with pytest.raises(SystemExit, match="--data-description is required"):  # nor are the embedded runs' facts its
        main(export + ["--license", "mit"])
    export += ["--license", "mit", "--data-description", "toy chats", "--train-hardware", "a laptop"]
    results = Path(__file__).parents[1] / "model_cards" / "results"  # real bench results of the project's CPU runs
    with pytest.raises(SystemExit, match="is a speculator bench; this export is of a diffusion LM"):
        main(export + ["--bench-json", str(results / "smollm2-135m-cpu" / "bench.json")])
    assert not output.exists()  # refused before anything was written
    capsys.readouterr()
    main(export)  # default dtype: bfloat16
    # the tiny base was saved without a tokenizer, so the run and its export have none: said (before: silently)
    assert f"warning: {output} holds no tokenizer" in capsys.readouterr().err
    tensors = load_file(output / "adapter_model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    card = (output / "README.md").read_text()
    assert "${" not in card and "30 steps of batch 8 sequences" in card and "LoRA of rank 8" in card
    first, last = read_log(folder / "run")[0], read_log(folder / "run")[-1]
    assert (f"{first['eval_accuracy']:.1%} (step 0, held-out loss {first['eval_loss']:.2f}) before training, "
            f"{last['eval_accuracy']:.1%} (step 30, held-out loss {last['eval_loss']:.2f}) at the end") in card
    assert "missing: calibrate one with `hf-specdiff calibrate`" in card
    # the command that would measure this model (before: a bare `hf-specdiff bench`, the shipped speculator's run)
    assert ("Reproduce: `hf-specdiff bench --target path/to/this/model --methods steps threshold spiffy "
            "spiffy_threshold ar_base`") in card
    assert "license: mit" in card and "- lora\n---" in card
    assert card_limitations(card).startswith("Answer quality, forward passes and speed have not been measured yet "
                                             "(see Measured). A masked diffusion LM")

    loaded = AutoDiffusionLM.from_pretrained(output)
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    ids[:, 6:] = MASK
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0.05)

    decoding = DiffusionGenerationConfig(max_new_tokens=16, block_length=8, stop_at_eos=False)
    graph = calibrate(loaded, [torch.tensor([[10, 11, 12, 13]]), torch.tensor([[20, 21, 22]])], decoding,
                      num_nodes=8, progress=False, description={"datasets": ["math500", "mbpp"]})
    graph.save_pretrained(output)
    main(export)  # the same weights again: the graph is theirs
    assert DraftGraph.from_pretrained(output).nodes == graph.nodes
    card = (output / "README.md").read_text()
    assert f"Spiffy draft graph: {len(graph)} nodes" in card and "2 prompts (math500, mbpp)" in card
    main(export + ["--dtype", "float32"])  # other weights: the graph is kept, and the card says it is stale
    assert {t.dtype for t in load_file(output / "adapter_model.safetensors").values()} == {torch.float32}
    assert DraftGraph.from_pretrained(output).nodes == graph.nodes
    card = (output / "README.md").read_text()
    assert f"{len(graph)} nodes calibrated on earlier weights of this folder, not these: recalibrate" in card
    assert "base_model: my-org/tiny-base" in card and "# tiny-base masked diffusion LM" in card
    assert "SmolLM2" not in card and "toy chats" in card
    with pytest.raises(SystemExit, match="cannot read it as JSON"):  # a typo: nothing replaced, the graph stays theirs
        main(export + ["--dtype", "bfloat16", "--bench-json", str(tmp_path / "typo.json")])
    assert {t.dtype for t in load_file(output / "adapter_model.safetensors").values()} == {torch.float32}
    main(export + ["--dtype", "float32", "--bench-json", str(results / "smollm2-135m-diffusion-cpu" / "bench.json"),
                   "--limitations", "Answers repeat themselves."])
    card = (output / "README.md").read_text()
    assert "| gsm8k | spiffy |" in card and "## Limitations and intended use\n\nAnswers repeat themselves.\n" in card
    with pytest.raises(SystemExit, match="did not start from one: drop it"):
        main(export + ["--earlier-training", "614 steps"])
    with pytest.raises(SystemExit, match="neither speculator/ nor diffusion_lm/"):
        main(["export", "--run", str(tmp_path), "--output", str(tmp_path / "x")])


def test_init_adapter_continues_a_finished_run_and_the_card_says_so(setup, tmp_path):
    """A new run from a saved adapter starts exactly where that adapter ended (same held-out figures at step 0), counts
    its steps on, and its export tells the two stages apart; an adapter of another shape is refused before training."""
    from hf_specdiff.cli import main

    folder, data, config, _ = setup
    earlier = folder / "run" / "diffusion_lm"
    continued = dataclasses.replace(config, output_dir=str(tmp_path / "run2"), init_adapter=str(earlier), max_steps=3,
                                    eval_every=3, save_every=3)
    train_diffusion(continued, progress=False)
    end_of_earlier, log = read_log(folder / "run")[-1], read_log(tmp_path / "run2")
    assert [r["step"] for r in log] == [0, 1, 2, 3]
    for name in ("eval_loss", "eval_accuracy", "eval_block_loss", "eval_block_accuracy"):
        assert log[0][name] == pytest.approx(end_of_earlier[name], rel=1e-5), name
    assert json.loads((tmp_path / "run2" / "diffusion_lm" / "config.json").read_text())["trained_steps"] == 33
    assert AutoDiffusionLM.from_pretrained(tmp_path / "run2" / "diffusion_lm") is not None

    template = Path(__file__).parents[1] / "model_cards" / "diffusion_lm.md"
    main(["export", "--run", str(tmp_path / "run2"), "--output", str(tmp_path / "shipped"), "--template",
          str(template), "--earlier-training", "30 tiny steps", "--license", "other", "--base-model", "my-org/tiny",
          "--data-description", "toy chats", "--train-hardware", "a CPU"])
    card = (tmp_path / "shipped" / "README.md").read_text()
    assert "Training continued an earlier adapter, trained for 30 steps before: 30 tiny steps. 3 steps" in card
    assert str(earlier) not in card  # a path on the training machine
    assert (f"{log[0]['eval_accuracy']:.1%} (step 0, held-out loss {log[0]['eval_loss']:.2f}) at the start of this run "
            "(the earlier adapter)") in card

    with pytest.raises(ValueError, match="does not fit this run.*lora_rank"):
        train_diffusion(dataclasses.replace(continued, output_dir=str(tmp_path / "r4"), lora_rank=4), progress=False)
    with pytest.raises(ValueError, match="not a diffusion adapter folder"):
        train_diffusion(dataclasses.replace(continued, output_dir=str(tmp_path / "r5"), init_adapter=str(tmp_path)),
                        progress=False)
    # continuing into the folder it came from would overwrite it; resuming the continued run with another (or no)
    # init_adapter would mislabel its steps
    with pytest.raises(ValueError, match="lies inside output_dir"):
        train_diffusion(dataclasses.replace(continued, output_dir=str(folder / "run")), progress=False)
    with pytest.raises(ValueError, match="other settings.*init_adapter"):
        train_diffusion(dataclasses.replace(continued, init_adapter=None, max_steps=4), progress=False)
    # other held-out rows than the earlier run's: trained rows may be held out now, and the user is told
    shutil.copytree(tmp_path / "run2" / "diffusion_lm", tmp_path / "earlier2")
    with pytest.warns(UserWarning, match="other held-out rows"):
        train_diffusion(dataclasses.replace(continued, output_dir=str(tmp_path / "r6"), init_adapter=str(
            tmp_path / "earlier2"), eval_sequences=4, max_steps=1), progress=False)


@pytest.mark.parametrize("name", ["smollm2-135m-diffusion-gpu.json", "smollm2-135m-diffusion-cpu.json"])
def test_example_configs_are_valid(name):
    config = DiffusionTrainConfig(**json.loads((EXAMPLES / name).read_text()))
    assert config.mask_token_id == 16 and config.finetune == "lora"
    if "gpu" in name:  # the artifact stays small: ~1.22 MB of float32 LoRA factors per unit of rank + 3.5 MB tokenizer
        assert config.lora_rank * 1.22 + 3.5 <= 30 and config.mixed_precision == "bf16"


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------


def test_bad_training_inputs_fail_before_the_first_step(setup, tmp_path):
    folder, data, _, _ = setup
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    cases = [
        (dict(data=[str(empty)]), ValueError, "No usable rows"),
        (dict(data=[]), ValueError, "No training data"),
        (dict(mask_token_id=64), ValueError, "mask_token_id=64 must be a token id"),
        (dict(mask_token_id=EOS), ValueError, "occurs in the training data"),
        (dict(base="embedded:NotAModel"), ValueError, "Unknown base"),
        (dict(base=str(tmp_path / "no-such-model")), ValueError, "could not be loaded"),
        (dict(finetune="qlora"), ValueError, "finetune='qlora'"),
        (dict(eval_sequences=60), ValueError, "eval_sequences=60"),
        (dict(mask_token_id=None), ValueError, "Set mask_token_id"),
        (dict(finetune="full"), ValueError, r"finetune='full' trains every weight, so \['lora_rank', 'lora_alpha'\]"),
    ]
    for overrides, error, message in cases:
        with pytest.raises(error, match=message):
            config = dataclasses.replace(tiny_config(folder, data, output_dir=str(tmp_path / "run")), **overrides)
            train_diffusion(config, progress=False)
    assert not (tmp_path / "run").exists()  # nothing written


def test_bad_data_fails_before_the_base_loads(setup, tmp_path, monkeypatch):
    import hf_specdiff.diffusion.training as diffusion_training

    folder, _, _, _ = setup
    monkeypatch.setattr(diffusion_training, "load_base", lambda *a, **k: pytest.fail("the base loaded before the data"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train_diffusion(tiny_config(folder, tmp_path / "missing.jsonl", output_dir=str(tmp_path / "run")),
                        progress=False)


def test_too_few_usable_rows_fail_before_the_base_loads_saying_what_to_do(setup, tmp_path, monkeypatch):
    import hf_specdiff.diffusion.training as diffusion_training

    folder, data, _, _ = setup
    monkeypatch.setattr(diffusion_training, "load_base", lambda *a, **k: pytest.fail("the base loaded before the data"))
    # before: "Only 1 usable rows: need more than eval_sequences=...", after the base had loaded
    with pytest.raises(ValueError, match=r"(?s)Only \d+ usable rows.*raise --max-seq-len or lower --eval-sequences"):
        train_diffusion(tiny_config(folder, data, output_dir=str(tmp_path / "run"), eval_sequences=10_000),
                        progress=False)


def corrupt_copy(setup, tmp_path, config_change=None, tensors_change=None, raw=None):
    folder = setup[0]
    target = tmp_path / "bad"
    shutil.copytree(folder / "run" / "diffusion_lm", target)
    if config_change:
        config = json.loads((target / "config.json").read_text())
        config_change(config)
        (target / "config.json").write_text(json.dumps(config))
    if tensors_change:
        tensors = load_file(target / "adapter_model.safetensors")
        tensors_change(tensors)
        save_file(tensors, target / "adapter_model.safetensors")
    if raw is not None:
        (target / "adapter_model.safetensors").write_bytes(raw)
    return target


def test_corrupt_or_mismatched_adapters_fail_clearly(setup, tmp_path):
    folder = setup[0]
    name = "model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = [
        (dict(config_change=lambda c: c.update(format_version=99)), "format_version 99 is not supported"),
        (dict(config_change=lambda c: c.pop("diffusion")), "not a complete diffusion adapter config"),
        (dict(config_change=lambda c: c.update(base=None)), "does not name its base"),
        (dict(config_change=lambda c: c.update(base="embedded:Other")), "Unknown base"),
        (dict(config_change=lambda c: c.update(base=str(tmp_path / "gone"))), "could not be loaded"),
        (dict(tensors_change=lambda t: t.update({name: torch.zeros(8, 65)})), "do not fit"),
        (dict(tensors_change=lambda t: t.pop(name.replace("lora_A", "lora_B"))), "no lora_B"),
        (dict(tensors_change=lambda t: t.update({"model.layers.9.mlp.up_proj.lora_A.weight": torch.zeros(8, 64),
                                                 "model.layers.9.mlp.up_proj.lora_B.weight": torch.zeros(128, 8)})),
         "not a Linear of this model"),
        (dict(tensors_change=lambda t: t.update(extra=torch.zeros(3))), "unexpected tensors"),
        (dict(tensors_change=lambda t: t.update(mask_embedding=torch.zeros(3))), "mask_embedding"),
        (dict(raw=b"not a safetensors file"), "corrupt"),
    ]
    for kwargs, message in cases:
        bad = corrupt_copy(setup, tmp_path, **kwargs)
        with pytest.raises(ValueError, match=message):
            AutoDiffusionLM.from_pretrained(bad)
        shutil.rmtree(bad)
    other_base = make_target(dtype=torch.float32, hidden_size=32)
    with pytest.raises(ValueError, match="different base model"):
        AutoDiffusionLM.from_pretrained(folder / "run" / "diffusion_lm", base=other_base)
    DiffusionLM.from_causal_lm(other_base, mask_token_id=MASK).save_pretrained(tmp_path / "complete")
    with pytest.raises(ValueError, match="adapter folders only"):
        AutoDiffusionLM.from_pretrained(tmp_path / "complete", base=other_base)


# ---------------------------------------------------------------------------------------------------------------
# The real model (slow)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_three_real_steps_on_the_embedded_smollm2(tmp_path):
    from hf_specdiff.bench import find_data_dir

    try:
        data_dir = find_data_dir(None)
    except FileNotFoundError:
        pytest.skip("no shared data folder (set HF_SPECDIFF_DATA)")
    source = data_dir / "distill" / "smollm2-135m-instruct" / "gsm8k_train.jsonl"
    if not source.is_file():
        pytest.skip(f"{source} is missing")
    rows = tmp_path / "rows.jsonl"
    with source.open() as lines:
        rows.write_text("".join(next(lines) for _ in range(8)))
    config = DiffusionTrainConfig(data=[str(rows)], output_dir=str(tmp_path / "run"), max_seq_len=256, batch_size=2,
                                  max_steps=3, warmup_steps=1, mixed_precision="no", eval_sequences=2, eval_every=3,
                                  save_every=3)
    model = train_diffusion(config, progress=False)
    log = read_log(tmp_path / "run")
    assert [r["step"] for r in log] == [0, 1, 2, 3] and all(r.get("loss", 0) < 20 for r in log)
    artifact = tmp_path / "run" / "diffusion_lm"
    config_json = json.loads((artifact / "config.json").read_text())
    assert config_json["base"] == "embedded:SmolLM2-135M-Instruct" and config_json["diffusion"]["mask_token_id"] == 16
    assert (artifact / "adapter_model.safetensors").stat().st_size < 25e6  # r16: ~20 MB, the base is 540 MB
    loaded = AutoDiffusionLM.from_pretrained(artifact)
    ids = torch.tensor([[1, 4093, 198, 16, 16, 16, 16]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)
    from hf_specdiff.diffusion import load_tokenizer

    tokenizer = load_tokenizer(artifact)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
    out = diffusion_generate(loaded, prompt, config=DiffusionGenerationConfig(max_new_tokens=8, block_length=8))
    assert out.sequences.shape == (1, prompt.shape[1] + 8)


def test_the_artifact_names_its_base_portably(tmp_path, monkeypatch):
    """The embedded model's cache folder, given as a path or loaded from it, is named `embedded:...` (a path on this
    machine would not load anywhere else); another local folder by its absolute path; a Hub id as given."""
    from hf_specdiff.diffusion.adapter_weights import EMBEDDED_BASE
    from hf_specdiff.diffusion.training import _base_name

    monkeypatch.setenv("HF_SPECDIFF_CACHE", str(tmp_path / "cache"))
    embedded = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    embedded.mkdir(parents=True)
    (tmp_path / "mine").mkdir()
    monkeypatch.chdir(tmp_path)
    loaded = make_target()
    loaded.name_or_path = str(embedded)
    assert _base_name(DiffusionTrainConfig(base=None), None) == EMBEDDED_BASE
    assert _base_name(DiffusionTrainConfig(base=str(embedded)), None) == EMBEDDED_BASE
    assert _base_name(DiffusionTrainConfig(base="cache/SmolLM2-135M-Instruct"), None) == EMBEDDED_BASE
    assert _base_name(DiffusionTrainConfig(base=None), loaded) == EMBEDDED_BASE
    assert _base_name(DiffusionTrainConfig(base="mine"), None) == str(tmp_path / "mine")
    assert _base_name(DiffusionTrainConfig(base="my-org/my-llama"), None) == "my-org/my-llama"
