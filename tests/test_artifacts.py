"""Save/load round trips: z-lab's published drafter layout, full speculators, and corrupt artifacts."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, card_limitations, make_speculator, make_target
from safetensors.torch import load_file, save_file

import hf_specdiff
from hf_specdiff import AutoSpeculator, DraftGraph, Speculator
from hf_specdiff.embedded import load_target

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 2, 4, 2, 16, 128


def write_zlab_checkpoint(folder, seed=0):
    """A drafter written the way z-lab publishes one (config.json + model.safetensors), without our classes."""
    config = {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 8,
        "bos_token_id": 0,
        "dflash_config": {"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 2]},
        "dtype": "float32",
        "eos_token_id": 2,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": FFN,
        "layer_types": ["full_attention"] * LAYERS,
        "max_position_embeddings": 1024,
        "max_window_layers": LAYERS,
        "model_type": "qwen3",
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "num_target_layers": 3,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }
    generator = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=generator) * 0.05

    tensors = {"fc.weight": w(HIDDEN, 2 * HIDDEN), "hidden_norm.weight": 1 + w(HIDDEN), "norm.weight": 1 + w(HIDDEN)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": 1 + w(HEAD_DIM),
            p + "self_attn.k_norm.weight": 1 + w(HEAD_DIM),
            p + "mlp.gate_proj.weight": w(FFN, HIDDEN),
            p + "mlp.up_proj.weight": w(FFN, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, FFN),
            p + "input_layernorm.weight": 1 + w(HIDDEN),
            p + "post_attention_layernorm.weight": 1 + w(HIDDEN),
        }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return config, tensors


def test_zlab_layout_loads_generates_and_saves_back_identically(tmp_path):
    config, tensors = write_zlab_checkpoint(tmp_path / "zlab")
    speculator = AutoSpeculator.from_pretrained(tmp_path / "zlab", dtype=torch.float64)
    assert speculator.refiner is None and speculator.markov_head is None
    assert speculator.drafter.config.layer_ids == [0, 2] and speculator.block_size == 8

    target = hf_specdiff.enable(make_target())
    prompt = torch.tensor([[4, 9, 1, 33, 7]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=24)
    out = target.generate(prompt, do_sample=False, max_new_tokens=24, assistant_model=speculator, speculation="dflash")
    assert torch.equal(out, plain)

    speculator.to(torch.float32).save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert sorted(saved) == sorted(tensors), "weight names must stay in z-lab's layout"
    for name, tensor in tensors.items():
        assert torch.equal(saved[name], tensor), name
    saved_config = json.loads((tmp_path / "saved" / "config.json").read_text())
    for key in ("architectures", "auto_map", "block_size", "dflash_config", "model_type", "hidden_size",
                "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_target_layers", "rms_norm_eps", "vocab_size"):
        assert saved_config[key] == config[key], key
    assert saved_config["rope_parameters"]["rope_theta"] == config["rope_theta"]
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == [
        "config.json", "model.safetensors", "speculator.json"
    ]


def test_speculator_round_trip(tmp_path):
    target = hf_specdiff.enable(make_target())
    speculator = make_speculator(target)
    with torch.no_grad():  # non-zero mixer so that it is really saved and loaded
        speculator.refiner.mix.normal_()
    speculator.save_pretrained(tmp_path)
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["config.json", "markov_head/config.json", "markov_head/model.safetensors", "model.safetensors",
                     "refiner/config.json", "refiner/model.safetensors", "speculator.json"]
    loaded = AutoSpeculator.from_pretrained(tmp_path, dtype=torch.float64)
    for name in ("drafter", "refiner", "markov_head"):
        ours, theirs = getattr(speculator, name).state_dict(), getattr(loaded, name).state_dict()
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert torch.equal(ours[key], theirs[key]), f"{name}.{key}"
        # the configs too (mask token, layer ids, block size, passes...): greedy output alone could not tell
        assert getattr(loaded, name).config.to_diff_dict() == getattr(speculator, name).config.to_diff_dict(), name
    prompt = torch.tensor([[4, 9, 1, 33, 7]])
    for method in ("xpress", "markov"):
        a, b = (target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=used, speculation=method,
                                return_dict_in_generate=True) for used in (speculator, loaded))
        assert torch.equal(a.sequences, b.sequences)
        assert a.speculation.accepted_lengths == b.speculation.accepted_lengths  # the same drafts accepted
    # no base-model weights in the artifact: the drafter borrows the target's embedding and lm_head
    assert not any("embed" in k or "lm_head" in k for k in load_file(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("continued", [False, True])
def test_export_casts_saves_and_writes_the_model_card(tmp_path, continued, capsys):
    """`hf-specdiff export`: the run's speculator in the asked dtype, reloadable, with a card rendered from the run's
    config and log (every placeholder filled), which says where a continued run started."""
    from hf_specdiff.cli import main
    from hf_specdiff.training import TrainConfig

    run, output = tmp_path / "run", tmp_path / "out"
    speculator = make_speculator(make_target())
    if continued:  # (either case would do) a draft vocabulary is exported and named on the card
        speculator.draft_vocab = torch.tensor([7, 3, 9])
    speculator.save_pretrained(run / "speculator")
    distill = "../shared/data/distill/smollm2-135m-instruct"
    config = TrainConfig(init_speculator="shipped/earlier" if continued else None, init_from_target_layer=-1,
                         data=[f"{distill}/gsm8k_train.jsonl", f"{distill}/sharegpt.jsonl"])
    (run / "train_config.json").write_text(json.dumps(config.to_dict()))
    (run / "log.jsonl").write_text(json.dumps({"step": 7, "loss": 1.0, "tau_dflash": 1.5, "tau_xpress": 1.75}) + "\n")
    template = Path(__file__).parents[1] / "model_cards" / "speculator.md"
    export = ["export", "--run", str(run), "--output", str(output), "--dtype", "bfloat16", "--template", str(template)]
    earlier = ["--earlier-training", "614 steps from the target's last layer"]
    if not continued:  # nothing to describe: refused rather than ignored
        with pytest.raises(SystemExit, match="did not start from one: drop it"):
            main(export + earlier)
    # (before: into the run's own speculator/, which it then replaced; onto a file, a NotADirectoryError)
    for wrong, message in [(run, "is the run folder or inside"), (run / "speculator", "is the run folder or inside"),
                           (run / "checkpoints" / "x", "is the run folder or inside"), (template, "is a file")]:
        with pytest.raises(SystemExit, match=f"--output .* {message}"):
            main([*export[:3], "--output", str(wrong), *export[5:]])
    main(export + (earlier if continued else []))
    assert "4,500 GSM8K train questions" in (output / "README.md").read_text()  # the distill corpus, described

    loaded = AutoSpeculator.from_pretrained(output)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    umask = os.umask(0)
    os.umask(umask)  # read it back unchanged
    assert (output / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # not safetensors' 0600
    card = (output / "README.md").read_text()
    assert "${" not in card and "7 steps of batch" in card and "dflash 1.50, xpress 1.75 (step 7)" in card
    if continued:
        assert "continued from the speculator in `shipped/earlier`: 614 steps from the target's last layer." in card
        assert loaded.draft_vocab.tolist() == [7, 3, 9] and "| draft vocabulary | 3 of the 64 tokens" in card
    else:
        assert "Draft layer initialised from the target's layer -1." in card
        assert loaded.draft_vocab is None and "| draft vocabulary | none" in card
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card  # the embedded target's Hub id
    # the usage lines load the weights it was trained with: the embedded copy here, the base model from the Hub below
    assert "target, tokenizer = hf_specdiff.load_default_target()" in card and "AutoModelForCausalLM" not in card
    assert "license: apache-2.0" in card and "Licence: apache-2.0 (the base model's)" in card  # SmolLM2's licence
    # no --limitations: the section still says what holds for every speculator, never left empty
    assert card_limitations(card).startswith("Acceptance and speed have not been measured yet (see Measured). Prompts")
    # the command that would measure this speculator (before: a bare `hf-specdiff bench`, the shipped one's run)
    assert "Reproduce: `hf-specdiff bench --speculator path/to/this/model`" in card
    assert "for HuggingFaceTB/SmolLM2-135M-Instruct only" in card_limitations(card)
    # the embedded target trained on other data: the distill corpus's description is not its card's
    (run / "train_config.json").write_text(json.dumps({**config.to_dict(), "data": ["my_answers.jsonl"]}))
    with pytest.raises(SystemExit, match=r"--data-description is required: the run trained on \['my_answers.jsonl'\]"):
        main(export + (earlier if continued else []))
    # another target: its licence is not ours to guess
    (run / "train_config.json").write_text(json.dumps({**config.to_dict(), "target": "my-org/my-llama"}))
    with pytest.raises(SystemExit, match="--license is required.*'my-org/my-llama'") as refused:
        main(export + (earlier if continued else []))
    # every option the card still needs, in one error (before: one per try of the command)
    assert str(refused.value).startswith("The model card needs 3 more options:")
    assert all(f"--{name} is required" in str(refused.value) for name in ("data-description", "train-hardware"))
    # nor are the embedded runs' data and hardware its card's
    with pytest.raises(SystemExit, match="--data-description is required.*my-org/my-llama"):
        main(export + (earlier if continued else []) + ["--license", "llama3.1"])
    own = ["--license", "llama3.1", "--data-description", "my answers", "--train-hardware", "one GPU"]
    main(export + (earlier if continued else []) + own)
    card = (output / "README.md").read_text()
    assert "base_model: my-org/my-llama" in card and "license: llama3.1" in card
    assert "# my-llama dFlash + xPress speculator (block 8)" in card and "(my answers)" in card
    assert "SmolLM2" not in card and "one GPU" in card
    assert 'AutoModelForCausalLM.from_pretrained("my-org/my-llama")' in card and "load_default_target" not in card
    assert "Reproduce: `hf-specdiff bench --target my-org/my-llama --speculator path/to/this/model`" in card
    # a local folder is no Hub base_model; a bench file that is missing or of the other kind is refused before any
    # file is written
    (run / "train_config.json").write_text(json.dumps({**config.to_dict(), "target": str(tmp_path)}))
    with pytest.raises(SystemExit, match="--base-model is required.*local folder"):
        main(export + (earlier if continued else []) + own)
    with pytest.raises(SystemExit, match="--base-model .* is a path; give a Hub id"):
        main(export + (earlier if continued else []) + own + ["--base-model", str(tmp_path)])
    own += ["--base-model", "my-org/my-llama"]
    fresh = export[:4] + [str(tmp_path / "fresh")] + export[5:] + (earlier if continued else []) + own
    with pytest.raises(SystemExit, match="--bench-json .*missing.json: cannot read it"):
        main(fresh + ["--bench-json", str(tmp_path / "missing.json")])
    # real `hf-specdiff bench --json` results, as the project's CPU runs wrote them
    results = Path(__file__).parents[1] / "model_cards" / "results"
    with pytest.raises(SystemExit, match="is a diffusion LM bench; this export is of a speculator"):
        main(fresh + ["--bench-json", str(results / "smollm2-135m-diffusion-cpu" / "bench.json")])
    with pytest.raises(SystemExit, match="is not a `hf-specdiff bench --json` result of one batch size"):
        main(fresh + ["--bench-json", str(results / "smollm2-135m-cpu" / "earlier_weights" / "batch_curve.json")])
    (tmp_path / "cut.json").write_text(json.dumps({"runs": ["ar", "xpress"], "summary": {"xpress": {"tau": 1.5}}}))
    with pytest.raises(SystemExit, match="is not a `hf-specdiff bench --json` result of one batch size"):
        main(fresh + ["--bench-json", str(tmp_path / "cut.json")])
    assert not (tmp_path / "fresh").exists()
    main(fresh + ["--bench-json", str(results / "smollm2-135m-cpu" / "bench.json"), "--bench-command", "bench x"])
    card = (tmp_path / "fresh" / "README.md").read_text()
    assert "| xpress" in card and "bench x" in card
    # without --bench-command the card quotes the options the result recorded (before: a bare `hf-specdiff bench`,
    # the default run, not the one measured), naming this model, not a path on the exporting machine
    benched = json.loads((results / "smollm2-135m-cpu" / "bench.json").read_text())
    benched["environment"]["speculator"] = str(run / "speculator")
    (tmp_path / "ours.json").write_text(json.dumps(benched))
    main(fresh + ["--bench-json", str(tmp_path / "ours.json")])
    assert ("Reproduce: `hf-specdiff bench --datasets gsm8k humaneval mt_bench --limit 6 --max-new-tokens 96 "
            "--speculator path/to/this/model`") in (tmp_path / "fresh" / "README.md").read_text()
    # benched with the target's local folder: the card names the base model the reader loads instead
    benched["config"]["target"] = str(tmp_path)
    (tmp_path / "ours.json").write_text(json.dumps(benched))
    main(fresh + ["--bench-json", str(tmp_path / "ours.json")])
    assert ("--max-new-tokens 96 --target my-org/my-llama --speculator path/to/this/model`"
            in (tmp_path / "fresh" / "README.md").read_text())
    benched["config"]["target"] = None
    capsys.readouterr()
    # benched from an earlier export of this run (another folder, weights stored in bfloat16): this model's
    # figures (before: warned of as another model's)
    benched["environment"]["speculator"] = str(output)
    (tmp_path / "earlier.json").write_text(json.dumps(benched))
    main(fresh + ["--bench-json", str(tmp_path / "earlier.json")])
    assert "not this run's" not in capsys.readouterr().err
    assert "--speculator path/to/this/model`" in (tmp_path / "fresh" / "README.md").read_text()
    other = tmp_path / "other_weights"  # the same layout, one tensor changed: another model's bench, said
    shutil.copytree(output, other)
    drafter = load_file(other / "model.safetensors")
    first = sorted(drafter)[0]
    save_file({**drafter, first: drafter[first] + 1}, other / "model.safetensors")
    for folder in (tmp_path, other):
        benched["environment"]["speculator"] = str(folder)
        (tmp_path / "other.json").write_text(json.dumps(benched))
        main(fresh + ["--bench-json", str(tmp_path / "other.json")])
        assert f"measured the speculator in {folder}, not this run's" in capsys.readouterr().err
    assert card_limitations(card).startswith("Acceptance and speed were measured only as under Measured.")
    assert "for my-org/my-llama only" in card_limitations(card)
    main(fresh + ["--limitations", "Trained for a day only."])  # the exporter's own words replace the default
    assert card_limitations((tmp_path / "fresh" / "README.md").read_text()) == "Trained for a day only."
    (run / "train_config.json").write_text(json.dumps(config.to_dict()))
    with pytest.raises(SystemExit):
        main(export[:-2] + ["--dtype", "bf16"])
    assert "invalid choice: 'bf16'" in capsys.readouterr().err
    (run / "train_config.json").unlink()
    with pytest.raises(SystemExit, match="no train_config.json"):
        main(export)

def test_missing_weight_is_a_clear_error(tmp_path):
    _, tensors = write_zlab_checkpoint(tmp_path)
    del tensors["fc.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="does not match its config.*fc.weight"):
        AutoSpeculator.from_pretrained(tmp_path)


def test_truncated_weights_file_is_a_clear_error(tmp_path):
    write_zlab_checkpoint(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises((ValueError, OSError), match="(?i)could not load|safetensors|corrupt|error"):
        AutoSpeculator.from_pretrained(tmp_path)


def test_not_a_drafter_is_a_clear_error(tmp_path):
    make_target().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a dFlash drafter checkpoint"):
        AutoSpeculator.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "manifest,message",
    [
        ('{"format": "hf_specdiff.speculator", "format_version": 99, "components": []}',
         "format version 99; .*Upgrade hf_specdiff"),
        ('{"format": "hf_specdiff.speculator", "format_version": "1", "components": []}',
         "format version '1'; .*No hf_specdiff wrote that"),
        ('{"format": "hf_specdiff.speculator", "format_version": 1, "components": null}',
         "components as None, not a list"),
        ('{"format": "hf_specdiff.speculator", "format_version": 1, "components": "refiner"}',
         "components as 'refiner'"),
        ('{"format": "something-else", "format_version": 1}', "not an hf_specdiff speculator manifest"),
        ('{"format": "hf_specdiff.speculator", "format_version": 1, "components": ["medusa"]}', "unknown components"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_manifest_is_a_clear_error(tmp_path, manifest, message):
    write_zlab_checkpoint(tmp_path)
    (tmp_path / "speculator.json").write_text(manifest)
    with pytest.raises(ValueError, match=message):
        AutoSpeculator.from_pretrained(tmp_path)


def test_missing_component_folder_is_a_clear_error(tmp_path):
    write_zlab_checkpoint(tmp_path)
    (tmp_path / "speculator.json").write_text(
        '{"format": "hf_specdiff.speculator", "format_version": 1, "components": ["refiner"]}')
    with pytest.raises(OSError, match="lists `refiner`, but refiner/config.json is missing"):
        AutoSpeculator.from_pretrained(tmp_path)
    make_speculator(make_target()).save_pretrained(tmp_path / "full")
    (tmp_path / "full" / "refiner" / "model.safetensors").unlink()
    with pytest.raises(OSError, match="lists `refiner`, but refiner/ is missing or incomplete"):
        AutoSpeculator.from_pretrained(tmp_path / "full")


@pytest.mark.parametrize("file,text,message", [
    ("config.json", '{"architectures": ["DFlashDraftModel"], "hidden_si', "config.json is not valid JSON"),
    ("config.json", "[]", "config.json holds a list, not a JSON object"),
    ("speculator.json", "[]", "speculator.json holds a list, not a JSON object"),
])
def test_corrupt_json_is_a_clear_error(tmp_path, file, text, message):
    make_speculator(make_target()).save_pretrained(tmp_path)
    (tmp_path / file).write_text(text)
    with pytest.raises(ValueError, match=f"{message}.*corrupt; download or save it again"):
        AutoSpeculator.from_pretrained(tmp_path)


def test_weights_of_another_shape_are_a_clear_error(tmp_path):
    make_speculator(make_target()).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "refiner" / "config.json").read_text())
    (tmp_path / "refiner" / "config.json").write_text(json.dumps({**config, "rank": config["rank"] + 1}))
    with pytest.raises(ValueError, match="XPressRefiner weights from .*refiner: the weights' shapes differ from its "
                       "config.json's"):
        AutoSpeculator.from_pretrained(tmp_path)


def test_a_speculator_in_a_subfolder_loads_with_its_add_ons(tmp_path):
    speculator = make_speculator(make_target())
    speculator.save_pretrained(tmp_path / "repo" / "speculators" / "b8")
    loaded = AutoSpeculator.from_pretrained(tmp_path / "repo", subfolder="speculators/b8")
    for name in ("drafter", "refiner", "markov_head"):
        ours, theirs = getattr(speculator, name).state_dict(), getattr(loaded, name).state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), name


def test_save_pretrained_pushes_the_whole_folder_in_one_commit(tmp_path, monkeypatch):
    """`save_pretrained(..., push_to_hub=True)` (the transformers idiom) uploads the folder with its manifest and
    add-ons once, not each part over the others; hub options without push_to_hub are refused."""
    from huggingface_hub import HfApi

    uploads = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kwargs: repo_id)
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, repo_id, folder_path, **kwargs: uploads.append(
        (repo_id, sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file()),
         kwargs.get("commit_message"))))
    speculator = make_speculator(make_target())
    speculator.save_pretrained(tmp_path / "my-spec", push_to_hub=True, repo_id="me/my-spec", commit_message="v1")
    assert len(uploads) == 1 and uploads[0][0] == "me/my-spec" and uploads[0][2] == "v1"
    assert {"speculator.json", "config.json", "refiner/config.json",
            "markov_head/model.safetensors"} <= set(uploads[0][1])
    speculator.save_pretrained(tmp_path / "my-spec2", push_to_hub=True)
    assert uploads[1][0] == "my-spec2"  # transformers' default: the folder's name
    with pytest.raises(TypeError, match="only apply with push_to_hub=True"):
        speculator.save_pretrained(tmp_path / "x", repo_id="me/x")


def test_push_to_hub_commits_where_transformers_would(tmp_path, monkeypatch):
    """transformers' commit options reach the commit (a dropped `revision` or `create_pr` would commit to main), save
    options reach the files, and anything else is refused before the repo is created."""
    from huggingface_hub import HfApi

    calls = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kwargs: calls.append(("create_repo", kwargs)))
    monkeypatch.setattr(HfApi, "create_branch", lambda self, repo_id, branch, **kwargs: calls.append(
        ("create_branch", {"branch": branch})))
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, repo_id, folder_path, **kwargs: calls.append(
        ("upload_folder", {**kwargs, "files": sorted(p.name for p in Path(folder_path).rglob("*.safetensors"))})))
    speculator = make_speculator(make_target())
    speculator.push_to_hub("me/spec", revision="dev", create_pr=True, commit_description="why", private=True,
                           max_shard_size="100KB")
    (_, created), (_, branch), (_, upload) = calls
    assert created["private"] is True and branch == {"branch": "dev"}
    assert upload["revision"] == "dev" and upload["create_pr"] is True and upload["commit_description"] == "why"
    assert any(name.startswith("model-00001-of-") for name in upload["files"])  # sharded as asked
    calls.clear()
    speculator.save_pretrained(tmp_path / "spec", push_to_hub=True, repo_id="me/spec", revision="v2")
    assert [name for name, _ in calls] == ["create_repo", "create_branch", "upload_folder"]
    assert calls[2][1]["revision"] == "v2" and calls[2][1]["commit_message"] == "Upload speculator"
    calls.clear()
    for push in (lambda: speculator.push_to_hub("me/spec", tags=["x"]),
                 lambda: speculator.save_pretrained(tmp_path / "y", push_to_hub=True, tags=["x"])):
        with pytest.raises(TypeError, match=r"unsupported arguments \['tags'\]"):
            push()
    assert not calls  # refused before anything reached the Hub
    graph = DraftGraph(nodes=[((0, 0),)], parents=[[-1]], block_length=8)
    graph.push_to_hub("me/graph", private=True, revision="dev")
    assert [name for name, _ in calls] == ["create_repo", "create_branch", "upload_folder"]
    assert calls[0][1]["private"] is True and calls[2][1]["revision"] == "dev"
    with pytest.raises(TypeError, match=r"unsupported arguments \['dtype'\]"):
        DraftGraph.from_pretrained(tmp_path, dtype=torch.float16)


def test_a_drafter_config_with_top_level_dflash_fields_loads(tmp_path):
    """Some exporters also write mask_token_id / target_layer_ids at the top level: read when they agree with
    dflash_config, refused when they contradict it."""
    config, _ = write_zlab_checkpoint(tmp_path)
    published = json.loads((tmp_path / "config.json").read_text())
    fields = published["dflash_config"]
    (tmp_path / "config.json").write_text(json.dumps({**published, **fields}))
    assert AutoSpeculator.from_pretrained(tmp_path).drafter.config.layer_ids == fields["target_layer_ids"]
    (tmp_path / "config.json").write_text(json.dumps({**published, "mask_token_id": fields["mask_token_id"] + 1}))
    with pytest.raises(ValueError, match="mask_token_id=.* at the top level and .* in dflash_config"):
        AutoSpeculator.from_pretrained(tmp_path)


def test_from_pretrained_takes_torch_dtype_and_refuses_what_it_would_drop(tmp_path):
    """transformers' older `torch_dtype=` works as `dtype=`; both at once, or an option the loader does not use
    (`device_map`, `attn_implementation`: the drafter has its own attention), are refused, not dropped."""
    make_speculator(make_target()).save_pretrained(tmp_path)
    assert AutoSpeculator.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="Pass dtype= or torch_dtype=, not both"):
        AutoSpeculator.from_pretrained(tmp_path, dtype=torch.float16, torch_dtype=torch.float32)
    for option in ("device_map", "attn_implementation"):
        with pytest.raises(TypeError,
                           match=rf"unsupported arguments \['{option}'\]; it takes dtype, device, variant and"):
            AutoSpeculator.from_pretrained(tmp_path, **{option: "cpu" if option == "device_map" else "eager"})


def test_casting_keeps_the_rope_frequencies_it_was_trained_with(tmp_path):
    """`.to(bfloat16)` rounds weights, not RoPE frequencies (as `from_pretrained(dtype=bfloat16)`): both routes give
    the same drafter, whose angles at position 4000 would otherwise be off by a large fraction of a turn."""
    speculator = make_speculator(make_target())
    speculator.save_pretrained(tmp_path)
    cast = AutoSpeculator.from_pretrained(tmp_path).to(torch.bfloat16)
    loaded = AutoSpeculator.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert cast.drafter.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(cast.drafter.rotary_emb.inv_freq, loaded.drafter.rotary_emb.inv_freq)
    assert torch.equal(cast.drafter.rotary_emb.inv_freq, speculator.drafter.rotary_emb.inv_freq.float())
    positions = torch.tensor([[4000, 4001]])
    x = torch.zeros(1, 2, speculator.drafter.config.hidden_size, dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(cast.drafter.rotary_emb(x, positions),
                                                  loaded.drafter.rotary_emb(x, positions)))


def test_unknown_hub_id_offline_is_a_clear_error():
    with pytest.raises(OSError, match="not a local folder"):
        AutoSpeculator.from_pretrained("hf-specdiff-tests/does-not-exist")


@pytest.mark.parametrize("path", ["/no/such/speculator", "./missing", "runs/x/speculator", "missing/"])
def test_a_missing_local_path_says_so_for_every_artifact(path):
    """Not the Hub's "Repo id must be in the form ..." that a path which cannot be a repo id used to get."""
    from hf_specdiff.diffusion import AutoDiffusionLM

    for load, what in ((AutoSpeculator.from_pretrained, "speculator"),
                       (AutoDiffusionLM.from_pretrained, "diffusion LM"),
                       (hf_specdiff.DraftGraph.from_pretrained, "draft graph"), (load_target, "target")):
        with pytest.raises(FileNotFoundError, match=f"No {what} at '{path}': no such folder"):
            load(path)


def test_a_folder_without_the_artifacts_file_says_so(tmp_path):
    """transformers' `cached_file` answers a local folder without config.json with None (it crashed as a TypeError)."""
    from hf_specdiff.diffusion import AutoDiffusionLM

    (tmp_path / "model.safetensors").write_bytes(b"")  # something else is there
    for load, what, file in ((AutoSpeculator.from_pretrained, "speculator", "config.json"),
                             (AutoDiffusionLM.from_pretrained, "diffusion LM", "config.json"),
                             (hf_specdiff.DraftGraph.from_pretrained, "draft graph", "spiffy_graph.json"),
                             (load_target, "target", "config.json")):  # what `--target` of every command loads
        with pytest.raises(OSError, match=f"No {what} at '{tmp_path}': the folder has no {file}. (Point|Calibrate)"):
            load(tmp_path)


def test_a_training_runs_folder_names_the_speculator_it_holds(tmp_path):
    """`hf-specdiff train --output-dir RUN` writes RUN/speculator: loading RUN (as `bench --speculator RUN` does) says
    where the speculator is, not only that RUN has no config.json."""
    make_speculator(make_target()).save_pretrained(tmp_path / "run" / "speculator")
    run = re.escape(str(tmp_path / "run"))
    with pytest.raises(OSError, match=f"training run's folder .*: load the speculator it wrote, {run}/speculator"):
        AutoSpeculator.from_pretrained(tmp_path / "run")
    assert AutoSpeculator.from_pretrained(tmp_path / "run" / "speculator").refiner is not None


def test_components_must_agree():
    target = make_target()
    speculator = make_speculator(target)
    other = make_speculator(target, block_size=4)
    with pytest.raises(ValueError, match="block size 4, the drafter uses 8: a speculator's parts are trained together.*"
                       "check that no config.json .* was edited or copied from another speculator"):
        Speculator(speculator.drafter, refiner=other.refiner)


def test_a_speculator_warns_on_a_target_it_was_not_trained_for(tmp_path):
    """The drafter records a sample of its target's embedding table. The same target (saved and loaded, or in
    another precision) passes quietly; another model of the same shapes gets a warning that drafts will rarely be
    accepted, and generate still gives that model's own greedy output."""
    import warnings

    target = hf_specdiff.enable(make_target(seed=0))
    speculator = AutoSpeculator.from_target(target, block_size=8, seed=0)
    assert len(speculator.drafter.config.target_embedding_sample) == 32
    speculator.save_pretrained(tmp_path / "spec")
    loaded = AutoSpeculator.from_pretrained(tmp_path / "spec").to(torch.float64)
    assert loaded.drafter.config.target_embedding_sample == speculator.drafter.config.target_embedding_sample
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded.check_compatible(target)
        loaded.to(torch.bfloat16).check_compatible(target.to(torch.bfloat16))
    loaded.to(torch.float64)
    target.to(torch.float64)
    other = hf_specdiff.enable(make_target(seed=1))
    prompt = torch.tensor([[3, 4, 5]])
    with pytest.warns(UserWarning, match="trained for a target with other embeddings.*output is unchanged") as caught:
        out = other.generate(prompt, max_new_tokens=8, do_sample=False, assistant_model=loaded, speculation="dflash")
    # attributed to the generate call above, not to a line of the library
    assert {w.filename for w in caught if "other embeddings" in str(w.message)} == {__file__}
    assert torch.equal(out, other.generate(prompt, max_new_tokens=8, do_sample=False))


def test_a_speculator_whose_manifest_cannot_be_read_is_not_loaded_as_a_bare_drafter(tmp_path):
    """Offline, with only the drafter's files in the Hub cache (as transformers' native dFlash path fetches them), or
    a folder copied without it, the manifest that lists the refiner and Markov head is missing: an error, not a bare
    drafter. A z-lab drafter, which has none, still loads as one."""
    saved, cache = tmp_path / "saved", tmp_path / "cache"
    make_speculator(make_target()).save_pretrained(saved)
    repo, sha = cache / "models--me--spec", "b" * 40
    (repo / "snapshots" / sha).mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (repo / "snapshots" / sha / name).write_bytes((saved / name).read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    with pytest.raises(OSError, match="me/spec holds a drafter saved by hf_specdiff but no readable speculator.json.*"
                                      "refiner and Markov head.*hf download me/spec"):
        AutoSpeculator.from_pretrained("me/spec", cache_dir=cache)
    (saved / "speculator.json").unlink()
    with pytest.raises(OSError, match="no readable speculator.json"):
        AutoSpeculator.from_pretrained(saved)
    write_zlab_checkpoint(tmp_path / "zlab")
    bare = AutoSpeculator.from_pretrained(tmp_path / "zlab")
    assert bare.refiner is None and bare.markov_head is None


def test_a_speculator_saved_with_a_variant_loads_with_it(tmp_path):
    """`save_pretrained(..., variant="fp16")` writes model.fp16.safetensors (sharded too) in every part: it loads with
    `variant="fp16"`, and without it the error names the variant to pass (before: "no file named model.safetensors",
    and `variant=` refused)."""
    speculator = make_speculator(make_target())
    speculator.save_pretrained(tmp_path, variant="fp16", max_shard_size="100KB")
    assert (tmp_path / "markov_head" / "model.fp16.safetensors").is_file()
    assert (tmp_path / "model.safetensors.index.fp16.json").is_file() and not (tmp_path / "model.safetensors").exists()
    loaded = AutoSpeculator.from_pretrained(tmp_path, variant="fp16")
    for name in ("drafter", "refiner", "markov_head"):
        ours, theirs = getattr(speculator, name).state_dict(), getattr(loaded, name).state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), name
    with pytest.raises(OSError, match=r"variant 'fp16' only .*\.from_pretrained\(\.\.\., variant='fp16'\)"):
        AutoSpeculator.from_pretrained(tmp_path)


def test_saving_over_a_speculator_removes_the_parts_it_no_longer_has(tmp_path, monkeypatch):
    """The shipped speculator loaded, its refiner and draft vocabulary dropped, saved over a copy of its folder: the
    refiner's folder and draft_vocab.safetensors are gone (nor pushed, and a push deletes them from the repo), the
    Markov head stays, and the model card is kept with a warning at the caller's line that it may no longer describe
    the weights."""
    import shutil
    import warnings

    from huggingface_hub import HfApi

    uploads = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kwargs: repo_id)
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, repo_id, folder_path, **kwargs: uploads.append(
        (sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file()),
         kwargs["delete_patterns"])))
    folder = tmp_path / "speculator"
    shutil.copytree(hf_specdiff.default_speculator_path(), folder)
    assert {"refiner", "markov_head", "draft_vocab.safetensors", "README.md"} <= {p.name for p in folder.iterdir()}
    speculator = AutoSpeculator.from_pretrained(folder)
    speculator.refiner = None
    speculator.draft_vocab = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        speculator.save_pretrained(folder, push_to_hub=True, repo_id="me/speculator")
    [warning] = [w for w in caught if "README.md" in str(w.message)]
    assert "may no longer describe the weights" in str(warning.message) and "hf-specdiff export" in str(warning.message)
    assert warning.filename == __file__
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert files == ["README.md", "config.json", "markov_head/config.json", "markov_head/model.safetensors",
                     "model.safetensors", "speculator.json"]
    # and the push removes them from the repo, where an earlier push of the whole speculator left them
    assert uploads == [(files, ["refiner/*", "draft_vocab.safetensors"])]
    speculator.push_to_hub("me/speculator")
    assert uploads[-1][1] == ["refiner/*", "draft_vocab.safetensors"]
    loaded = AutoSpeculator.from_pretrained(folder)
    assert loaded.refiner is None and loaded.draft_vocab is None and loaded.markov_head is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same parts saved again: the card is no staler than it was
        loaded.save_pretrained(folder)


def test_safe_serialization_false_is_refused(tmp_path):
    """transformers 5 writes safetensors whatever `safe_serialization` says: False is refused rather than ignored,
    True (what is written anyway) is accepted."""
    speculator = make_speculator(make_target())
    for save in (lambda: speculator.save_pretrained(tmp_path / "a", safe_serialization=False),
                 lambda: speculator.push_to_hub("me/spec", safe_serialization=False)):
        with pytest.raises(ValueError, match="safe_serialization=False: speculators are saved as safetensors only"):
            save()
    assert not (tmp_path / "a").exists()
    speculator.save_pretrained(tmp_path / "b", safe_serialization=True)
    assert (tmp_path / "b" / "model.safetensors").is_file()


@pytest.mark.skipif(os.name == "nt", reason="POSIX file modes")
def test_saved_files_get_the_modes_the_umask_gives(tmp_path):
    """safetensors 0.8 writes through a temporary file created 0600: every file `save_pretrained` and
    `write_draft_vocab` write gets the umask's mode like config.json, and a file saved 0600 before is repaired."""
    from hf_specdiff.speculator import write_draft_vocab

    speculator = make_speculator(make_target())
    speculator.draft_vocab = torch.arange(20)
    umask = os.umask(0o027)
    try:
        speculator.save_pretrained(tmp_path)
        modes = {str(p.relative_to(tmp_path)): p.stat().st_mode & 0o777 for p in tmp_path.rglob("*") if p.is_file()}
        assert "refiner/model.safetensors" in modes and set(modes.values()) == {0o640}, modes
        (tmp_path / "model.safetensors").chmod(0o600)
        speculator.save_pretrained(tmp_path)
        write_draft_vocab(tmp_path, torch.arange(30))
        assert {p.stat().st_mode & 0o777 for p in tmp_path.rglob("*") if p.is_file()} == {0o640}
    finally:
        os.umask(umask)


def test_push_to_hub_refuses_a_bad_repo_id_before_saving(tmp_path, monkeypatch):
    """An empty or malformed repo id (or a folder name that is not one, the default) is refused saying what a repo id
    looks like, before anything is saved or sent to the Hub."""
    from huggingface_hub import HfApi

    calls = []
    for method in ("create_repo", "create_branch", "upload_folder"):
        monkeypatch.setattr(HfApi, method, lambda self, *args, method=method, **kwargs: calls.append(method))
    speculator = make_speculator(make_target())
    saves = []
    monkeypatch.setattr(speculator.drafter, "save_pretrained", lambda *args, **kwargs: saves.append(args))
    for push in (lambda: speculator.push_to_hub(""), lambda: speculator.push_to_hub("not a valid id!!"),
                 lambda: speculator.save_pretrained(tmp_path / "spec", push_to_hub=True, repo_id="me/a/b"),
                 lambda: DraftGraph(nodes=[((0, 0),)], parents=[[-1]], block_length=8).push_to_hub("bad id")):
        with pytest.raises(ValueError, match=r"is not a Hub repo id .* reads 'name' or 'namespace/name'"):
            push()
    with pytest.raises(ValueError, match=r"repo_id \(default: the folder's name\)='my spec' is not a Hub repo id"):
        speculator.save_pretrained(tmp_path / "my spec", push_to_hub=True)
    assert not saves and not calls and not any(tmp_path.iterdir())
