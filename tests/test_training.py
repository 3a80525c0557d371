"""Training mechanics on a tiny target: the loss goes down, checkpoints resume, bad inputs fail before any work."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import VOCAB, make_speculator, make_successor_target, make_target

import hf_specdiff
from hf_specdiff import AutoSpeculator
from hf_specdiff.draft_vocab import DraftReadOut, full_width
from hf_specdiff.training import SpeculatorTrainer, TrainConfig, collate, read_sequences, train, weighted_tv


def write_distill(path, target, rows=24, seed=0):
    """The target's own greedy answers to random prompts, in the distill JSONL format."""
    generator = torch.Generator().manual_seed(seed)
    with path.open("w") as out:
        for i in range(rows):
            prompt = torch.randint(1, VOCAB, (1, int(torch.randint(3, 12, (1,), generator=generator))),
                                   generator=generator)
            answer = target.generate(prompt, do_sample=False, max_new_tokens=40)[0, prompt.shape[1]:]
            out.write(json.dumps({"id": i, "prompt_ids": prompt[0].tolist(), "response_ids": answer.tolist()}) + "\n")
    return path


def tiny_config(tmp_path, data, **overrides):
    values = dict(data=[str(data)], output_dir=str(tmp_path / "run"), block_size=8, num_draft_layers=1,
                  refiner_rank=32, max_seq_len=64, anchors_per_sequence=6, batch_size=4, max_steps=80,
                  learning_rate=3e-3, warmup_steps=5, holdout_sequences=4, eval_every=20, save_every=20)
    values.update(overrides)
    return TrainConfig(**values)


@pytest.fixture(scope="module")
def target():
    # structured greedy answers (mostly t -> t + 1, bent by context): learnable, unlike a random model's
    return make_successor_target(dtype=torch.float32, seed=3)


def test_loss_goes_down_and_artifact_loads(tmp_path, target):
    data = write_distill(tmp_path / "distill.jsonl", target)
    config = tiny_config(tmp_path, data)
    speculator = train(config, target=target, progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").open()]
    assert len(log) == 80
    first = sum(r["loss"] for r in log[:5]) / 5
    last = sum(r["loss"] for r in log[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    for key in ("drafter_ce", "xpress_tv", "xpress_consistency", "markov_tv"):
        assert log[-1][key] < log[0][key], key
    assert {"tau_dflash", "tau_xpress", "tau_markov"} <= set(log[-1])
    loaded = AutoSpeculator.from_pretrained(tmp_path / "run" / "speculator")
    for name in ("drafter", "refiner", "markov_head"):
        for key, value in getattr(speculator, name).state_dict().items():
            assert torch.equal(value, getattr(loaded, name).state_dict()[key])


def test_resume_continues_from_the_last_checkpoint(tmp_path, target):
    from safetensors.torch import load_file, save_file

    data = write_distill(tmp_path / "distill.jsonl", target, rows=12)
    train(tiny_config(tmp_path, data, max_steps=20, save_every=20), target=target, progress=False)
    # the frozen target's embedding and lm_head are not checkpointed (before: a copy in each); a checkpoint written
    # with them, as earlier versions did, still resumes
    weights = tmp_path / "run" / "checkpoints" / "checkpoint-20" / "model.safetensors"
    saved = load_file(weights)
    assert all(key.startswith("speculator.") for key in saved), sorted(saved)[:3]
    save_file({**saved, "embed.weight": target.get_input_embeddings().weight.detach().clone(),
               "lm_head.weight": target.get_output_embeddings().weight.detach().clone()}, weights)
    train(tiny_config(tmp_path, data, max_steps=30, eval_every=10, save_every=10), target=target, progress=False)
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "log.jsonl").open()]
    assert steps == list(range(1, 31))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["checkpoint-20", "checkpoint-30"]


def test_bad_data_fails_before_the_target_loads(tmp_path, monkeypatch):
    """A real target takes minutes to load: a missing or broken data file must not wait for it."""
    monkeypatch.setattr("hf_specdiff.embedded.load_target",
                        lambda *_, **__: pytest.fail("the target loaded before the data was read"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train(tiny_config(tmp_path, tmp_path / "missing.jsonl"), progress=False)
    (tmp_path / "broken.jsonl").write_text('{"prompt_ids": [1, 2]}\n')  # (a prompts file: distill it first)
    with pytest.raises(ValueError, match="broken.jsonl:1 is not a distill row .*'response_ids'.*`hf-specdiff distill "):
        train(tiny_config(tmp_path, tmp_path / "broken.jsonl"), progress=False)


def test_a_warm_up_the_run_never_finishes_is_warned_of(tmp_path, target):
    """Before: a short run under the default warm-up (50 steps) never reached its learning rate, without a word."""
    data = write_distill(tmp_path / "distill.jsonl", target, rows=12)
    with pytest.warns(UserWarning, match="warmup_steps=5 is not below max_steps=3: .* never reaches learning_rate"
                      r".* \(e.g. 0; 0 starts at learning_rate\)"):
        train(tiny_config(tmp_path, data, max_steps=3, save_every=3), target=target, progress=False)
    # as long as the run: the rate reaches learning_rate at the last step (before: said never to, and e.g. 1 suggested)
    with pytest.warns(UserWarning, match="warmup_steps=3 is not below max_steps=3: .* reaches learning_rate=0.003 "
                      "only at the last step and never decays"):
        train(tiny_config(tmp_path / "equal", data, max_steps=3, warmup_steps=3, save_every=3), target=target,
              progress=False)


def test_a_warm_start_from_a_layer_the_target_lacks_is_refused(tmp_path, target):
    """Before: an IndexError from the target's layer list, naming neither the option nor its range."""
    data = write_distill(tmp_path / "distill.jsonl", target, rows=8)
    for layer in (3, -4):  # (the target has 3 layers)
        with pytest.raises(ValueError, match=f"init_from_target_layer={layer}, but LlamaForCausalLM has decoder layers "
                           r"0 to 2 \(-1: the last\)"):
            train(tiny_config(tmp_path, data, init_from_target_layer=layer), target=target, progress=False)


def test_bad_inputs_fail_before_training(tmp_path, target):
    with pytest.raises(ValueError, match="No training data"):
        train(dataclasses.replace(tiny_config(tmp_path, "x"), data=[]), target=target, progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train(tiny_config(tmp_path, tmp_path / "missing.jsonl"), target=target, progress=False)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="No usable rows"):
        train(tiny_config(tmp_path, empty), target=target, progress=False)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt_ids": [1, 2]}\n')
    with pytest.raises(ValueError, match="broken.jsonl:1 is not a distill row"):
        train(tiny_config(tmp_path, broken), target=target, progress=False)
    outside = tmp_path / "outside.jsonl"
    outside.write_text("\n" + json.dumps({"prompt_ids": [1, 2], "response_ids": [3, 999, 4]}) + "\n")
    with pytest.raises(ValueError, match="outside.jsonl:2 has token ids outside the target's vocabulary"):
        train(tiny_config(tmp_path, outside), target=target, progress=False)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt_ids": [1], "response_ids": [3, 4]}\n{"note": "caf\xe9"}\n')
    with pytest.raises(ValueError, match="latin.jsonl:2 is not UTF-8 text"):
        train(tiny_config(tmp_path, latin), target=target, progress=False)
    with pytest.raises(IsADirectoryError, match="is a folder: give the path of a JSONL file"):
        train(tiny_config(tmp_path, tmp_path), target=target, progress=False)
    fractional = tmp_path / "fractional.jsonl"
    fractional.write_text(json.dumps({"prompt_ids": [1.7, 2.2], "response_ids": [3, 4, 5]}) + "\n")
    with pytest.raises(ValueError, match="fractional.jsonl:1: .* integer token ids"):
        train(tiny_config(tmp_path, fractional), target=target, progress=False)
    data = write_distill(tmp_path / "distill.jsonl", target, rows=8)
    with pytest.raises(ValueError,
                       match=r"Only 8 usable rows: .*holdout_sequences=8\. Distill answers to more prompts"):
        train(tiny_config(tmp_path, data, holdout_sequences=8), target=target, progress=False)
    for options, message in [(dict(holdout_sequences=0), r"holdout_sequences=0 \(must be >= 1"),
                             (dict(eval_every=0, save_every=-1), "eval_every=0 .*save_every=-1"),
                             (dict(block_size=1), "block_size=1"), (dict(mixed_precision="fp8"), "mixed_precision"),
                             (dict(time_budget_minutes=float("inf")),
                              r"time_budget_minutes=inf \(must be positive and"),
                             (dict(weight_decay=-0.1), r"weight_decay=-0.1 \(must be >= 0")]:
        with pytest.raises(ValueError, match="Invalid training options: .*" + message):
            train(tiny_config(tmp_path, data, **options), target=target, progress=False)
    assert not (tmp_path / "run").exists()  # nothing written


def test_init_speculator_brings_its_shape_and_refuses_another(tmp_path, target):
    """Continuing a speculator trains it at its own block size, rank and layers, and train_config.json records them;
    asking for another shape, or for fresh draft layers on top, is refused before training."""
    data = write_distill(tmp_path / "distill.jsonl", target, rows=12)
    train(tiny_config(tmp_path, data, max_steps=2, save_every=2), target=target, progress=False)
    earlier = str(tmp_path / "run" / "speculator")
    fields = dict(block_size=None, num_draft_layers=None, refiner_rank=None, init_from_target_layer=None)
    config = tiny_config(tmp_path, data, output_dir=str(tmp_path / "run2"), init_speculator=earlier, max_steps=2,
                         **fields)
    train(config, target=target, progress=False)
    recorded = json.loads((tmp_path / "run2" / "train_config.json").read_text())
    assert (recorded["block_size"], recorded["num_draft_layers"], recorded["refiner_rank"]) == (8, 1, 32)
    for options, message in [(dict(block_size=4), r"asks for .*'block_size': \(4, 8\)"),
                             (dict(refiner_rank=64), r"'refiner_rank': \(64, 32\)"),
                             (dict(init_from_target_layer=0), "init_from_target_layer=0 initialises fresh")]:
        with pytest.raises(ValueError, match=message):
            train(dataclasses.replace(config, output_dir=str(tmp_path / "run3"), **options), target=target,
                  progress=False)
    assert not (tmp_path / "run3").exists()


def test_resume_refuses_other_held_out_rows_or_shape(tmp_path, target):
    """A checkpoint resumes only with the held-out rows and the shape it was trained with: another seed could hold out
    rows it trained on (the estimate would read too good), another block size would not fit its weights."""
    data = write_distill(tmp_path / "distill.jsonl", target, rows=12)
    config = tiny_config(tmp_path, data, max_steps=2, save_every=2)
    train(config, target=target, progress=False)
    recorded = (tmp_path / "run" / "train_config.json").read_text()
    for options, message in [(dict(seed=5, max_steps=4), "held out other rows"),
                             (dict(holdout_sequences=3, max_steps=4), r"'holdout_sequences': \(4, 3\)"),
                             (dict(block_size=4, max_steps=4), r"other settings .*'block_size': \(8, 4\)"),
                             (dict(draft_vocab_size=6, max_steps=4), r"'draft_vocab_size': \(None, 6\)"),
                             # restored with the optimizer's state: a new value would be recorded, not used
                             (dict(learning_rate=0.5, weight_decay=0.3, max_steps=4),
                              r"'learning_rate': \(0.003, 0.5\), 'weight_decay': \(0.0, 0.3\)"),
                             # the steps run so far were of other batches and losses than the record would then say;
                             # every change is listed at once (before: one, or none, the record rewritten)
                             (dict(batch_size=2, anchors_per_sequence=3, gamma=2.0, warmup_steps=1, max_steps=4),
                              r"(?=.*'batch_size': \(4, 2\))(?=.*'anchors_per_sequence': \(6, 3\))(?=.*'gamma': "
                              r"\(7.0, 2.0\))(?=.*'warmup_steps': \(5, 1\)).*only .*max_steps.* may change"),
                             (dict(max_steps=1), r"has trained 2 steps, more than max_steps=1")]:
        with pytest.raises(ValueError, match=message):
            train(dataclasses.replace(config, **options), target=target, progress=False)
    assert (tmp_path / "run" / "train_config.json").read_text() == recorded  # as it was
    train(dataclasses.replace(config, seed=5, holdout_seed=0, max_steps=3), target=target, progress=False)


def test_unsupported_target_fails_before_training(tmp_path, target):
    from transformers import RwkvConfig, RwkvForCausalLM

    data = write_distill(tmp_path / "distill.jsonl", target, rows=8)
    rwkv = RwkvForCausalLM(RwkvConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                                      intermediate_size=64))  # (no attention heads to give the drafter)
    with pytest.raises(ValueError, match="RwkvForCausalLM has no `num_attention_heads` in its config"):
        train(tiny_config(tmp_path, data, holdout_sequences=2), target=rwkv, progress=False)


def test_a_target_with_other_layers_than_llamas_trains_from_random_draft_layers(tmp_path):
    """GPT-2's layers name their weights unlike the drafter's: the default warm start (a copy of the target's last
    layer) would copy nothing, and says so before any training; started at random, the speculator trains, loads
    and speculates as plain greedy decodes."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB)).eval()
    data = write_distill(tmp_path / "distill.jsonl", gpt2, rows=8)
    with pytest.raises(ValueError, match="name their weights unlike the drafter's .* init_from_target_layer=None"):
        train(tiny_config(tmp_path, data, holdout_sequences=2), target=gpt2, progress=False)
    train(tiny_config(tmp_path, data, holdout_sequences=2, init_from_target_layer=None, max_steps=4, eval_every=2,
                      save_every=2), target=gpt2, progress=False)
    speculator = AutoSpeculator.from_pretrained(tmp_path / "run" / "speculator")
    hf_specdiff.enable(gpt2)
    prompt = torch.tensor([[5, 9, 2, 7]])
    assert torch.equal(gpt2.generate(prompt, assistant_model=speculator, speculation="xpress", max_new_tokens=10),
                       gpt2.generate(prompt, do_sample=False, max_new_tokens=10))


@pytest.mark.parametrize("family", ["Gemma2", "Olmo2"])
def test_warm_start_gives_draft_layers_the_norm_scales_the_target_applies(family):
    """Gemma's norms store 1 + weight and OLMo 2's follow the attention and the MLP: the warm start copies what each
    norm does into the drafter's pre-norms (before: Gemma's weights as stored, near 0, zeroed the drafter's hidden
    states, and OLMo 2's attention-output norm became the drafter's pre-MLP norm)."""
    import transformers

    from hf_specdiff.training import init_draft_layers_from_target

    extra = dict(head_dim=16) if family == "Gemma2" else {}
    target = make_target(config_class=getattr(transformers, f"{family}Config"),
                         model_class=getattr(transformers, f"{family}ForCausalLM"), **extra)
    with torch.no_grad():  # trained norms: no longer their initial identity
        for name, parameter in target.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.2, 0.6)
    speculator = AutoSpeculator.from_target(target, block_size=4, refiner_rank=8)
    init_draft_layers_from_target(speculator, target, -1)
    hidden = torch.randn(2, 5, target.config.hidden_size, dtype=target.dtype)
    target_layer, draft_layer = target.model.layers[-1], speculator.drafter.layers[0]
    close = dict(rtol=1e-5, atol=1e-5)  # (both norms compute in float32)
    torch.testing.assert_close(speculator.drafter.norm(hidden), target.model.norm(hidden), **close)
    if family == "Gemma2":
        torch.testing.assert_close(draft_layer.input_layernorm(hidden), target_layer.input_layernorm(hidden), **close)
        torch.testing.assert_close(draft_layer.post_attention_layernorm(hidden),
                                   target_layer.pre_feedforward_layernorm(hidden), **close)
    else:  # no norm before OLMo 2's MLP: the drafter's stays the identity's scale
        assert torch.equal(draft_layer.post_attention_layernorm.weight,
                           torch.ones_like(draft_layer.post_attention_layernorm.weight))


def test_warm_started_mlp_computes_as_the_targets_with_its_activation():
    """Gemma's configs name the MLP's activation `hidden_activation` (GELU): the drafter takes it, so that its copy
    of the target's MLP computes the target's MLP (before: SiLU, the default, over weights trained for GELU)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from hf_specdiff.training import init_draft_layers_from_target

    target = make_target(config_class=Gemma2Config, model_class=Gemma2ForCausalLM, head_dim=16)
    speculator = AutoSpeculator.from_target(target, block_size=4, refiner_rank=8)
    init_draft_layers_from_target(speculator, target, -1)
    hidden = torch.randn(2, 5, target.config.hidden_size, dtype=target.dtype)
    torch.testing.assert_close(speculator.drafter.layers[0].mlp(hidden), target.model.layers[-1].mlp(hidden))


def test_warm_start_splits_fused_projections_and_names_the_weights_it_leaves_random(recwarn):
    """Phi-3 fuses q/k/v and gate/up into one projection each: the warm start splits them, so the drafter's copy
    computes the target's MLP, with no warning (before: silently left at random beside the copied o_proj and
    down_proj). A mixture of experts has no MLP of the drafter's shape: its draft MLP starts at random, and a warning
    names those weights."""
    from transformers import Phi3Config, Phi3ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    from hf_specdiff.training import init_draft_layers_from_target

    phi3 = make_target(config_class=Phi3Config, model_class=Phi3ForCausalLM)
    speculator = AutoSpeculator.from_target(phi3, block_size=4, refiner_rank=8)
    init_draft_layers_from_target(speculator, phi3, -1)
    assert not [w for w in recwarn if "start at random" in str(w.message)]
    hidden = torch.randn(2, 5, phi3.config.hidden_size, dtype=phi3.dtype)
    draft_layer, target_layer = speculator.drafter.layers[0], phi3.model.layers[-1]
    torch.testing.assert_close(draft_layer.mlp(hidden), target_layer.mlp(hidden))
    q, k, v = (getattr(draft_layer.self_attn, f"{name}_proj").weight for name in "qkv")
    assert torch.equal(torch.cat([q, k, v]), target_layer.self_attn.qkv_proj.weight)

    moe = make_target(config_class=Qwen2MoeConfig, model_class=Qwen2MoeForCausalLM, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    speculator = AutoSpeculator.from_target(moe, block_size=4, refiner_rank=8)
    with pytest.warns(UserWarning, match=r"'mlp.down_proj.weight', 'mlp.gate_proj.weight', 'mlp.up_proj.weight'\]"
                      r" .* start at random, the rest is copied"):
        init_draft_layers_from_target(speculator, moe, -1)
    copied = speculator.drafter.layers[0].self_attn.o_proj.weight
    assert torch.equal(copied, moe.model.layers[-1].self_attn.o_proj.weight)


def test_warm_start_keeps_the_biases_of_the_target(tmp_path, recwarn):
    """Qwen2's q/k/v projections have biases (its o_proj none), Llama's all four with `attention_bias` and its MLP's
    three with `mlp_bias`: the drafter gets the same and the warm start copies them, so each draft projection
    computes the target's, and the drafter saves and loads with them (before: copied without their biases,
    silently; the MLP's then only named in a warning)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hf_specdiff.training import init_draft_layers_from_target

    qwen2 = make_target(config_class=Qwen2Config, model_class=Qwen2ForCausalLM)
    llama = make_target(attention_bias=True, mlp_bias=True)
    for target, has_o_bias, has_mlp_bias in ((qwen2, False, False), (llama, True, True)):
        with torch.no_grad():  # trained biases: not their initial zeros
            for name, parameter in target.named_parameters():
                if name.endswith(".bias"):
                    parameter.uniform_(-1, 1)
        speculator = AutoSpeculator.from_target(target, block_size=4, refiner_rank=8)
        init_draft_layers_from_target(speculator, target, -1)
        hidden = torch.randn(2, 5, target.config.hidden_size, dtype=target.dtype)
        draft_layer, target_layer = speculator.drafter.layers[0], target.model.layers[-1]
        draft, source = draft_layer.self_attn, target_layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            torch.testing.assert_close(getattr(draft, name)(hidden), getattr(source, name)(hidden))
        torch.testing.assert_close(draft_layer.mlp(hidden), target_layer.mlp(hidden))
        assert (draft.o_proj.bias is not None) == has_o_bias
        assert (draft_layer.mlp.down_proj.bias is not None) == has_mlp_bias
        speculator.save_pretrained(tmp_path / type(target).__name__)
        loaded = AutoSpeculator.from_pretrained(tmp_path / type(target).__name__).drafter.layers[0]
        torch.testing.assert_close(loaded.self_attn.q_proj.bias, draft.q_proj.bias)
        torch.testing.assert_close(loaded.mlp(hidden), draft_layer.mlp(hidden))
    assert not [w for w in recwarn if "init_from_target_layer" in str(w.message)]

    # StableLM's norms are LayerNorms with biases; the drafter's RMSNorms have none: copied as scales, and said
    from transformers import StableLmConfig, StableLmForCausalLM

    stablelm = make_target(config_class=StableLmConfig, model_class=StableLmForCausalLM, use_qkv_bias=True)
    speculator = AutoSpeculator.from_target(stablelm, block_size=4, refiner_rank=8)
    with pytest.warns(UserWarning, match=r"biases \['input_layernorm.bias', 'post_attention_layernorm.bias'\] that "
                      "this speculator's draft layers have no place for"):
        init_draft_layers_from_target(speculator, stablelm, -1)
    assert speculator.drafter.config.qkv_bias and not speculator.drafter.config.mlp_bias


def test_a_vision_language_target_trains_from_its_folder(tmp_path):
    """`--target` a vision-language model's folder (Qwen2-VL has no causal-LM class; its pad id lives in its text
    config): the speculator trains on text and speculates on a prompt with an image as plain generate decodes it. A
    folder holding neither a causal LM nor a vision-language model is refused by name."""
    from test_greedy import make_mrope_vision_language_target
    from transformers import CLIPVisionConfig, CLIPVisionModel

    import hf_specdiff

    target = make_mrope_vision_language_target("qwen2_vl").float()
    target.save_pretrained(tmp_path / "target")
    data = write_distill(tmp_path / "distill.jsonl", target, rows=8)
    speculator = train(tiny_config(tmp_path, data, max_steps=4, target=str(tmp_path / "target")), progress=False)
    prompt = torch.tensor([[2, 5, 297, 299, 299, 299, 299, 296, 17, 40]])
    image = dict(image_grid_thw=torch.tensor([[1, 4, 4]]), pixel_values=torch.randn(16, 3 * 2 * 14 * 14))
    if "mm_token_type_ids" in inspect.signature(target.model.get_rope_index).parameters:
        image["mm_token_type_ids"] = (prompt == 299).int()
    plain = target.generate(prompt, **image, do_sample=False, max_new_tokens=12)
    out = hf_specdiff.enable(target).generate(prompt, **image, do_sample=False, max_new_tokens=12,
                                              assistant_model=speculator, speculation="xpress")
    assert torch.equal(out, plain)

    CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     image_size=28, patch_size=14)).save_pretrained(tmp_path / "vision")
    with pytest.raises(ValueError, match="holds a 'clip_vision_model' model, which transformers loads neither as a "
                                         "causal LM nor as a vision-language model"):
        train(tiny_config(tmp_path, data, max_steps=4, target=str(tmp_path / "vision")), progress=False)


class FakeClock:
    """Stands in for time.perf_counter in hf_specdiff.training; tests move `now`."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_step_plan_fits_the_run_into_its_time_budget(monkeypatch, tmp_path):
    from hf_specdiff import training
    from hf_specdiff.training import StepPlan, warmup_cosine

    clock = FakeClock()
    monkeypatch.setattr(training.time, "perf_counter", clock)
    unbudgeted = StepPlan(max_steps=1000, warmup_steps=50, eval_every=100, save_every=250)
    assert ([unbudgeted.lr_factor(s) for s in (0, 49, 500, 999)]
            == [warmup_cosine(50, 1000)(s) for s in (0, 49, 500, 999)])
    plan = StepPlan(max_steps=1000, warmup_steps=50, eval_every=100, save_every=250, minutes=2, probe_steps=20)
    clock.now = 10.0  # loading took 10 s
    for step in range(1, 22):
        clock.now += 5.0 if step == 1 else 0.5  # the first step compiles; then 0.5 s a step
        plan.after_step(step)
        assert plan.last_step == (1000 if step < 21 else 21 + int((120 - clock.now) * 0.9 / 0.5))
    assert plan.last_step == 21 + 171  # (120 s - 25 s spent) * 90% = 85.5 s at 0.5 s a step
    assert plan.evaluates(plan.last_step) and plan.saves(plan.last_step) and not plan.saves(plan.last_step - 1)
    # the schedule is stretched to the cut: warm-up shrunk to a tenth (19 steps), full decay at the last step
    assert plan.lr_factor(18) == 1.0 and plan.lr_factor(plan.last_step) == pytest.approx(0.1)
    # a steady pace: the timing at the next evaluation step (100) finds the time kept in reserve for evaluations and
    # saves unspent (this clock gives them none) and moves the cut a little later, keeping a tenth of what is left
    for step in range(22, plan.last_step + 1):
        clock.now += 0.5
        plan.after_step(step)
    assert plan.last_step == 100 + int((120 - 64.5) * 0.9 / 0.5) == 199 and clock.now <= 120
    # a host that slows down after the first timing: the timing at step 100 moves the cut earlier, within the budget
    clock.now = 0.0
    slowed = StepPlan(max_steps=1000, warmup_steps=50, eval_every=100, save_every=250, minutes=2, probe_steps=20)
    clock.now, step = 10.0, 0
    while step < slowed.last_step:
        step += 1
        clock.now += 5.0 if step == 1 else 0.5 if step <= 21 else 1.0  # twice as slow once the pace was timed
        slowed.after_step(step)
        if step == 21:
            assert slowed.last_step == 192  # at 1 s a step this cut alone would end at 196 s of 120
    assert slowed.last_step == 100 + int((120 - 104) * 0.9 / 1.0) and clock.now <= 120
    assert slowed.lr_factor(slowed.last_step) == pytest.approx(0.1)  # the decay ends at the new cut
    # a host that was busy while the pace was first timed and then frees up: the timing at step 100 moves the cut
    # later, so the budget is used, and the run still ends within it
    clock.now = 0.0
    freed = StepPlan(max_steps=1000, warmup_steps=50, eval_every=100, save_every=250, minutes=2, probe_steps=20)
    clock.now, step = 10.0, 0
    while step < freed.last_step:
        step += 1
        clock.now += 5.0 if step == 1 else 0.75 if step <= 21 else 0.5  # faster once the pace was timed
        freed.after_step(step)
        if step == 21:
            assert freed.last_step == 21 + int((120 - 30) * 0.9 / 0.75)  # 129: the cut the slow start alone gives
    assert freed.last_step == 100 + int((120 - 69.5) * 0.9 / 0.5) and clock.now <= 120  # 190 steps, not 129
    assert freed.lr_factor(freed.last_step) == pytest.approx(0.1)
    assert freed.warmup_steps == 129 // 10  # the first cut's warm-up: moving the cut later does not lengthen it
    # a run resumed from a checkpoint of a cut run ends at that cut at the latest and keeps its warm-up
    checkpoint = tmp_path / "checkpoint-150"
    checkpoint.mkdir()
    (checkpoint / StepPlan.FILE).write_text(json.dumps({"last_step": 190, "max_steps": 1000, "warmup_steps": 12,
                                                        "holdout_fingerprint": "rows"}))
    resumed = StepPlan(max_steps=1000, warmup_steps=50, eval_every=100, save_every=250, minutes=60)
    assert resumed.resume(SimpleNamespace(load_state=lambda folder: None), tmp_path, "rows") == 150
    assert (resumed.last_step, resumed.latest_end, resumed.warmup_steps) == (190, 190, 12)
    # never past max_steps, however much time is left
    roomy = StepPlan(max_steps=30, warmup_steps=5, eval_every=10, save_every=10, minutes=60, probe_steps=3)
    for step in range(1, 6):
        clock.now += 0.5
        roomy.after_step(step)
    assert roomy.last_step == 30
    with pytest.raises(ValueError, match="time_budget_minutes must be positive"):
        StepPlan(max_steps=10, warmup_steps=1, eval_every=1, save_every=1, minutes=0)


def test_budgeted_run_ends_early_with_a_complete_artifact_and_resumes_to_its_cut(tmp_path, target):
    data = write_distill(tmp_path / "distill.jsonl", target, rows=12)
    # a budget that is spent by the time the pace is known: the run ends right after timing 20 steps
    train(tiny_config(tmp_path, data, max_steps=200, save_every=50, time_budget_minutes=1e-4), target=target,
          progress=False)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").open()]
    assert [r["step"] for r in log] == list(range(1, 22)) and "tau_xpress" in log[-1]
    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint-21"
    plan = json.loads((checkpoint / "step_plan.json").read_text())
    assert (plan["last_step"], plan["max_steps"], len(plan["holdout_fingerprint"])) == (21, 200, 16)
    assert plan["warmup_steps"] == 21 // 10  # the cut's warm-up (5 configured), which a resumed run keeps
    AutoSpeculator.from_pretrained(tmp_path / "run" / "speculator")
    # resuming keeps the cut: nothing left to do
    train(tiny_config(tmp_path, data, max_steps=200, save_every=50), target=target, progress=False)
    assert len((tmp_path / "run" / "log.jsonl").read_text().splitlines()) == 21


def test_holdout_seed_keeps_the_held_out_rows_of_an_earlier_run():
    """A continued run with a new seed (fresh batches) and the earlier seed as holdout_seed holds out exactly the rows
    the earlier run held out, none of which it trains on."""
    from hf_specdiff.training import split_holdout

    rows = list(range(200))
    earlier, _ = split_holdout(rows, TrainConfig(seed=1, holdout_sequences=16))
    kept, training = split_holdout(rows, TrainConfig(seed=2, holdout_seed=1, holdout_sequences=16))
    other, _ = split_holdout(rows, TrainConfig(seed=2, holdout_sequences=16))
    assert kept == earlier and other != earlier
    assert sorted(kept + training) == rows and rows == list(range(200))  # a split, and the caller's list untouched
    with pytest.raises(ValueError, match="need more than holdout_sequences=16"):
        split_holdout(rows[:16], TrainConfig(holdout_sequences=16))


def test_accumulated_gradients_are_clipped_once_per_optimizer_step(tmp_path, target, monkeypatch):
    """With gradient accumulation the sum over micro-batches is clipped, not each micro-batch's share (which would
    let the last one dominate, and with fp16 unscale twice)."""
    from accelerate import Accelerator

    calls = []
    clip = Accelerator.clip_grad_norm_
    monkeypatch.setattr(Accelerator, "clip_grad_norm_",
                        lambda self, *a, **k: calls.append(self.sync_gradients) or clip(self, *a, **k))
    data = write_distill(tmp_path / "distill.jsonl", target, rows=12)
    train(tiny_config(tmp_path, data, max_steps=3, gradient_accumulation_steps=2), target=target, progress=False)
    assert calls == [True, True, True]


TWO_PROCESS_SCRIPT = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from conftest import make_successor_target
from accelerate.state import PartialState
from hf_specdiff.training import TrainConfig, train
config = TrainConfig(**json.loads({config!r}))
speculator = train(config, target=make_successor_target(dtype=torch.float32, seed=3), progress=False)
checksum = sum(float(p.detach().double().sum()) for p in speculator.parameters())
print(f"rank {{PartialState().process_index}} of {{PartialState().num_processes}}: {{checksum:.9f}}", flush=True)
"""


@pytest.mark.slow
def test_two_processes_train_one_speculator(tmp_path, target):
    """`accelerate` with two CPU processes (gloo): both end with the same weights (their gradients were averaged) and
    the learning rate follows the single-process schedule step by step (not num_processes times faster)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from hf_specdiff.training import warmup_cosine

    data = write_distill(tmp_path / "distill.jsonl", target, rows=12)
    config = tiny_config(tmp_path, data, max_steps=3, warmup_steps=2, gradient_accumulation_steps=2)
    script = tmp_path / "two_processes.py"
    script.write_text(TWO_PROCESS_SCRIPT.format(tests=str(Path(__file__).parent), config=json.dumps(config.to_dict())))
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    checksums = {line.split(": ")[0]: line.split(": ")[1] for line in done.stdout.splitlines() if "of 2:" in line}
    assert len(checksums) == 2 and len(set(checksums.values())) == 1, checksums
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "run" / "log.jsonl").open()]
    assert lrs == pytest.approx([3e-3 * warmup_cosine(2, 3)(step) for step in (1, 2, 3)])


def test_the_model_card_describes_the_saved_weights_not_the_log_past_them(tmp_path, target, monkeypatch):
    """A run killed between saves has logged steps its saved speculator never went through: the exported card gives
    the saved step and that step's held-out tau. A resumed run logs the steps after its checkpoint again; the card
    then follows the resumed run. A log_file given relative is found from another working directory, and the card's
    batch counts the accumulated micro-batches."""
    from hf_specdiff.cli import main
    from hf_specdiff.training import StepPlan

    data = write_distill(tmp_path / "distill.jsonl", target, rows=12)
    monkeypatch.chdir(tmp_path)
    config = tiny_config(tmp_path, data, max_steps=20, eval_every=5, save_every=10, log_file="logs/run.jsonl",
                         batch_size=2, gradient_accumulation_steps=2)
    saves = StepPlan.saves

    def killed_at_15(plan, step):
        if step == 15:
            raise KeyboardInterrupt
        return saves(plan, step)

    monkeypatch.setattr(StepPlan, "saves", killed_at_15)
    with pytest.raises(KeyboardInterrupt):
        train(config, target=target, progress=False)
    monkeypatch.setattr(StepPlan, "saves", saves)
    log = [json.loads(line) for line in (tmp_path / "logs" / "run.jsonl").open()]
    assert log[-1]["step"] == 15 and "tau_xpress" in log[-1]
    at_10 = next(r for r in log if r["step"] == 10)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    main(["export", "--run", str(tmp_path / "run"), "--output", str(tmp_path / "out"), "--data-description", "toy"])
    card = (tmp_path / "out" / "README.md").read_text()
    assert "10 steps of batch\n4 sequences" in card
    assert f"xpress {at_10['tau_xpress']:.2f}" in card and "(step 10)" in card and "(step 15)" not in card

    monkeypatch.chdir(tmp_path)
    train(config, target=target, progress=False)  # resumes at 10: steps 11-15 logged twice
    steps = [json.loads(line)["step"] for line in (tmp_path / "logs" / "run.jsonl").open()]
    assert steps == list(range(1, 16)) + list(range(11, 21))
    monkeypatch.chdir(elsewhere)
    main(["export", "--run", str(tmp_path / "run"), "--output", str(tmp_path / "out"), "--data-description", "toy"])
    assert "20 steps of batch" in (tmp_path / "out" / "README.md").read_text()


def test_draft_vocab_size_gives_the_artifact_the_answers_most_frequent_tokens(tmp_path, target):
    data = write_distill(tmp_path / "distill.jsonl", target, rows=12)
    speculator = train(tiny_config(tmp_path, data, max_steps=2, save_every=2, draft_vocab_size=6), target=target,
                       progress=False)
    answers = [json.loads(line)["response_ids"] for line in data.open()]
    counts = {t: sum(a.count(t) for a in answers) for t in {t for a in answers for t in a}}
    vocab = speculator.draft_vocab.tolist()
    assert len(vocab) == 6 == len(set(vocab))
    # the held-out rows are not counted, so compare against the counts loosely: common tokens first
    assert min(counts[t] for t in vocab) >= sorted(counts.values(), reverse=True)[len(counts) // 2]
    loaded = AutoSpeculator.from_pretrained(tmp_path / "run" / "speculator")
    assert loaded.draft_vocab.tolist() == vocab
    # a run continuing it keeps its vocabulary
    continued = train(tiny_config(tmp_path, data, output_dir=str(tmp_path / "run2"), max_steps=1, save_every=1,
                                  init_speculator=str(tmp_path / "run" / "speculator"), block_size=None,
                                  num_draft_layers=None, refiner_rank=None), target=target, progress=False)
    assert continued.draft_vocab.tolist() == vocab
    with pytest.raises(ValueError, match="draft_vocab_size=0"):
        train(tiny_config(tmp_path, data, draft_vocab_size=0), target=target, progress=False)


# -- training over a draft vocabulary -------------------------------------------------------------------------------


def trainer_and_batch(target, rows, tokens=None, seed=0):
    """A fresh speculator's trainer (block 8, 6 anchors) and a batch of random sequences drawn from `tokens`."""
    speculator = AutoSpeculator.from_target(target, block_size=8, num_draft_layers=1, refiner_rank=16, seed=seed)
    trainer = SpeculatorTrainer(target, speculator.float(), TrainConfig(block_size=8, anchors_per_sequence=6))
    tokens = torch.arange(VOCAB) if tokens is None else tokens
    generator = torch.Generator().manual_seed(seed)
    sequences = [{"ids": tokens[torch.randint(len(tokens), (length,), generator=generator)].tolist(), "answer_start": 4}
                 for length in rows]
    return trainer, collate(sequences, pad_id=0)


def losses_and_grads(trainer, batch):
    trainer.speculator.zero_grad()
    losses = trainer.losses(*batch, torch.Generator().manual_seed(1))
    losses["loss"].backward()
    return ({k: float(v.detach()) for k, v in losses.items()},
            {n: p.grad.clone() for n, p in trainer.speculator.named_parameters() if p.grad is not None})


def test_losses_over_a_vocabulary_of_every_token_in_any_order_are_the_full_vocabularys(target):
    # the labels, the target's p, the read-outs and the refiner's own picks all go through the vocabulary's order
    trainer, batch = trainer_and_batch(target, rows=(30, 22, 27))
    full, full_grads = losses_and_grads(trainer, batch)
    trainer.speculator.draft_vocab = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))
    permuted, permuted_grads = losses_and_grads(trainer, batch)
    assert permuted == pytest.approx(full, rel=1e-5)
    assert full_grads.keys() == permuted_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(permuted_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


class FullWidthReadOut(torch.nn.Module):
    """A draft read-out's scores widened to the whole vocabulary, -inf outside: q as verification gets it."""

    def __init__(self, read_out: DraftReadOut, inside: torch.LongTensor):
        super().__init__()
        self.read_out, self.inside = read_out, inside

    def forward(self, hidden):
        return full_width(self.read_out(hidden), self.inside, VOCAB)


@pytest.mark.parametrize("data_outside", [False, True])
def test_losses_over_a_vocabulary_are_those_of_logits_minus_infinity_outside_it(target, data_outside):
    # What generate drafts from: the read-outs' full-width rows, -inf outside the vocabulary. The same losses
    # computed over the vocabulary's 40 columns: all of them where the data stays inside it (cross-entropy is
    # finite); total variation, which counts p's mass outside and every slot, also where the data leaves it.
    inside = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[:40]
    outside = torch.ones(VOCAB, dtype=torch.bool).index_fill_(0, inside, False)
    data = torch.cat([inside[:32], outside.nonzero()[:8, 0]]) if data_outside else inside[:32]
    trainer, batch = trainer_and_batch(target, rows=(30, 22, 27), tokens=data)
    trainer.speculator.draft_vocab = inside
    compact, grads = losses_and_grads(trainer, batch)
    assert all(math.isfinite(v) for v in compact.values())
    for head in (trainer.speculator.refiner, trainer.speculator.markov_head):  # rows no draft reads are not trained
        assert head.w2.weight.grad[outside].abs().max() == 0 and head.w2.weight.grad[inside].abs().max() > 0

    speculator = trainer.speculator
    speculator.draft_vocab = None
    trainer.lm_head = FullWidthReadOut(DraftReadOut(inside, trainer.lm_head.weight), inside)
    for head in (speculator.refiner, speculator.markov_head):  # 0 outside, as generate's add-on read-out
        head.w2.weight.data[outside] = 0
    with torch.no_grad():
        full_width = {k: float(v) for k, v in trainer.losses(*batch, torch.Generator().manual_seed(1)).items()}
    if data_outside:  # full width, a data token outside the vocabulary costs an infinite cross-entropy
        assert math.isinf(full_width["drafter_ce"])
        compact, full_width = ({k: d[k] for k in ("xpress_tv", "markov_tv")} for d in (compact, full_width))
    assert compact == pytest.approx(full_width, rel=1e-5)


def test_weighted_tv_over_vocabulary_columns_counts_the_mass_outside():
    generator = torch.Generator().manual_seed(0)
    logits, p = torch.randn(5, 3, 10, generator=generator), torch.randn(5, 3, 10, generator=generator).softmax(-1)
    labels, weights = torch.randint(10, (5, 3), generator=generator), torch.tensor([1.0, 0.5, 0.25])
    inside = torch.tensor([7, 2, 5, 0])
    full_width = torch.full_like(logits, float("-inf")).index_copy_(-1, inside, logits[..., inside])
    torch.testing.assert_close(weighted_tv(logits[..., inside], p[..., inside], labels, weights),
                               weighted_tv(full_width, p, labels, weights))


def test_held_out_estimate_drafts_only_from_the_vocabulary(target, tmp_path):
    # an oracle speculator drafts the target's own answers; kept from every token the answers hold, it drafts
    # nothing right, so every method's estimate is exactly 1 (the estimate reads out as generate does)
    data = write_distill(tmp_path / "distill.jsonl", target, rows=6)
    rows = read_sequences([str(data)], max_seq_len=64)
    batch = collate(rows, pad_id=0)
    trainer = SpeculatorTrainer(target, make_speculator(target, oracle=True).float(),
                                TrainConfig(block_size=8, anchors_per_sequence=6))
    free = trainer.estimate_tau(*batch, torch.Generator().manual_seed(0))
    assert free["xpress"] > 1.5 and free["markov"] > 1.5, free
    answered = {t for row in rows for t in row["ids"][row["answer_start"]:]}
    trainer.speculator.draft_vocab = torch.tensor(sorted(set(range(VOCAB)) - answered))
    assert trainer.estimate_tau(*batch, torch.Generator().manual_seed(0)) == {"dflash": 1, "xpress": 1, "markov": 1}
