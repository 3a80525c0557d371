"""Greedy speculation returns exactly the target's own greedy output (fp64 tiny models: identical tokens)."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import (
    CONV_STATE_FAMILIES,
    STATE_FAMILIES,
    GEMMA3_IMAGE,
    VOCAB,
    char_tokenizer,
    make_speculator,
    make_state_target,
    make_successor_target,
    make_target,
    make_vision_language_target,
    random_images,
    replay_greedy_drafts,
)
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

import hf_specdiff

METHODS = ["xpress", "dflash", "markov"]


def prompts(count=50, seed=0):
    generator = torch.Generator().manual_seed(seed)
    for i in range(count):
        length = int(torch.randint(1, 40, (1,), generator=generator))
        yield i, torch.randint(1, VOCAB, (1, length), generator=generator)


def assert_same_as_plain(target, speculator, method, prompt, spec_kwargs=None, **kwargs):
    plain = target.generate(prompt, do_sample=False, **kwargs)
    out = target.generate(
        prompt, do_sample=False, assistant_model=speculator, speculation=method, return_dict_in_generate=True,
        **kwargs, **(spec_kwargs or {}),
    )
    assert torch.equal(out.sequences, plain), f"{method}: {out.sequences.tolist()} != {plain.tolist()}"
    stats = out.speculation
    generated = out.sequences.shape[1] - prompt.shape[1]
    # Every token but the prefill's comes from a verify step; one target forward per step plus the prefill.
    assert sum(stats.accepted_lengths) == generated - 1
    assert stats.target_forwards == len(stats.accepted_lengths) + 1
    assert stats.accepted_tokens <= stats.drafted_tokens
    return stats


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_plain_random_drafts(method):
    """Random drafter and add-ons: drafts are nearly always rejected (the none-accepted path)."""
    target = hf_specdiff.enable(make_target())
    speculator = make_speculator(target)
    for i, prompt in prompts():
        assert_same_as_plain(target, speculator, method, prompt, max_new_tokens=5 + 7 * (i % 6))


@pytest.mark.parametrize("method", METHODS)
def test_sliding_window_target_past_its_window(method, monkeypatch):
    """A Mistral-style target whose sliding window (8) the prompt and output outgrow: the cache's sliding layers must
    keep what each roll-back needs."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8, bos_token_id=0,
                           pad_token_id=0, tie_word_embeddings=False)
    target = hf_specdiff.enable(MistralForCausalLM(config).double().eval())
    speculator = make_speculator(target)
    accepted = set()
    for i, prompt in prompts(count=6, seed=1):
        plain = target.generate(prompt, do_sample=False, max_new_tokens=12 + 5 * i)
        with monkeypatch.context() as patch:  # drafts right up to a varying slot: roll-backs of every depth
            replay_greedy_drafts(patch, [plain[0]])
            accepted.update(assert_same_as_plain(target, speculator, method, prompt,
                                                 max_new_tokens=12 + 5 * i).accepted_lengths)
    assert len(accepted) >= 5, f"roll-backs of too few depths: accepted lengths {sorted(accepted)}"


# Families users bring, each with what sets it apart from Llama: Qwen3 (q/k norms), Phi3 (fused projections), Gemma 2
# (logit soft-capping, sliding layers), Gemma 3 (RoPE set per layer type), OLMo 2 (post-norms), GPT-NeoX (parallel
# residual, partial rotary, no grouped-query attention), Gemma 3n (an MLP width per layer, hidden states stacking its
# AltUp streams, layers reusing another layer's K/V), Gemma 4 (head_dim set per layer type, which its config refuses
# to read for all layers), Cohere 2 MoE (layer norms whose config holds rms_norm_eps=None; experts run eagerly: grouped
# matmuls take no float64).
TARGET_FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 8}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 8}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM", {  # per-layer MLP widths, AltUp streams, shared K/V
        "head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention", "full_attention"],
        "num_kv_shared_layers": 1, "laurel_rank": 8, "altup_num_inputs": 2, "activation_sparsity_pattern": [0.0] * 3,
        "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB}),
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", {
        "head_dim": 16, "global_head_dim": 32, "sliding_window": 8, "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": VOCAB, "layer_types": ["sliding_attention", "full_attention", "full_attention"]}),
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", {
        "head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention", "full_attention"],
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "experts_implementation": "eager"}),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", {  # chunks of 5 positions, then a layer without RoPE
        "head_dim": 16, "attention_chunk_size": 5, "layer_types": ["chunked_attention"] * 2 + ["full_attention"],
        "intermediate_size_mlp": 128, "num_local_experts": 2, "num_experts_per_tok": 1,
        "experts_implementation": "eager"}),
}


def make_family_target(family):
    """A tiny fp64 target of the family (TARGET_FAMILIES, STATE_FAMILIES, or "llama"), enabled."""
    import transformers

    if family in STATE_FAMILIES:
        return make_state_target(family)
    config_name, model_name, extra = TARGET_FAMILIES.get(family, ("LlamaConfig", "LlamaForCausalLM", {}))
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=0, pad_token_id=0, eos_token_id=None, tie_word_embeddings=False, **extra,
    )
    return hf_specdiff.enable(getattr(transformers, model_name)(config).double().eval())


@pytest.mark.parametrize("family", TARGET_FAMILIES)
def test_greedy_equals_plain_across_target_families(family, monkeypatch):
    """`AutoSpeculator.from_target` builds a drafter for each family, and every method stays lossless on it, with the
    static cache too. The drafts replay plain greedy's tokens up to a varying slot (a random drafter's are nearly all
    rejected), so each family's cache is rolled back by every depth."""
    target = make_family_target(family)
    speculator = make_speculator(target)
    accepted, accepted_static = set(), set()
    for i, prompt in prompts(count=3, seed=2):
        plain = target.generate(prompt, do_sample=False, max_new_tokens=10 + 6 * i)
        with monkeypatch.context() as patch:
            replay_greedy_drafts(patch, [plain[0]])
            for method in METHODS:
                accepted.update(assert_same_as_plain(target, speculator, method, prompt,
                                                     max_new_tokens=10 + 6 * i).accepted_lengths)
            accepted_static.update(assert_same_as_plain(target, speculator, "xpress", prompt,
                                                        {"cache_implementation": "static"},
                                                        max_new_tokens=10 + 6 * i).accepted_lengths)
    assert len(accepted) >= 5 and len(accepted_static) >= 3, f"too few roll-back depths: {accepted}, {accepted_static}"


# Families whose configs name the MLP width otherwise, or leave it implied: {model class: config fields}
OTHER_GEOMETRY_FAMILIES = {
    "GPT2LMHeadModel": {"n_embd": 64, "n_layer": 2, "n_head": 4},  # n_inner None: 4 x n_embd
    "GPTJForCausalLM": {"n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8, "n_inner": 96},
    "GPTBigCodeForCausalLM": {"n_embd": 64, "n_layer": 2, "n_head": 4},
    "OPTForCausalLM": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 96,
                       "word_embed_proj_dim": 64},
    "FalconForCausalLM": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
    "BloomForCausalLM": {"hidden_size": 64, "n_layer": 2, "n_head": 4},
}


@pytest.mark.parametrize("model_class", OTHER_GEOMETRY_FAMILIES)
def test_targets_naming_their_geometry_otherwise_speculate(model_class, monkeypatch):
    """GPT-2, GPT-J, GPTBigCode, OPT, Falcon and BLOOM name their MLP width n_inner, ffn_dim or ffn_hidden_size, or
    leave it implied (4 x the hidden size): `from_target` builds their drafters, and every method is lossless on a
    prompt alone and on a ragged batch, drafts accepted to every depth (greedy replays)."""
    import transformers

    config_class = getattr(transformers, model_class.replace("ForCausalLM", "Config").replace("LMHeadModel", "Config"))
    torch.manual_seed(0)
    config = config_class(vocab_size=VOCAB, initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                          **OTHER_GEOMETRY_FAMILIES[model_class])  # (wider weights: greedy outputs that vary)
    target = getattr(transformers, model_class)(config)
    target = hf_specdiff.enable(target.double().eval())
    speculator = make_speculator(target)
    fields = OTHER_GEOMETRY_FAMILIES[model_class]
    width = fields.get("n_inner") or fields.get("ffn_dim") or 4 * target.config.hidden_size
    assert speculator.drafter.config.intermediate_size == width
    batch, mask = torch.tensor([[0, 0, 7, 3, 9], [4, 8, 1, 6, 2]]), torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    options = dict(max_new_tokens=14, pad_token_id=0)
    plain = target.generate(batch, attention_mask=mask, do_sample=False, **options)
    accepted = set()
    for method in METHODS:
        with monkeypatch.context() as patch:
            replay_greedy_drafts(patch, [plain[0, 2:], plain[1]])
            out = target.generate(batch, attention_mask=mask, assistant_model=speculator, speculation=method,
                                  return_dict_in_generate=True, **options)
            assert torch.equal(out.sequences, plain), method
            accepted.update(out.speculation.accepted_lengths)
        accepted.update(assert_same_as_plain(target, speculator, method, batch[1:], **options).accepted_lengths)
    assert len(accepted) >= 4, accepted


@pytest.mark.parametrize("family", ["llama", *TARGET_FAMILIES, *STATE_FAMILIES])
def test_the_hidden_states_the_drafter_reads_are_the_full_forwards(family):
    """The loop asks the target for the hidden states its drafter reads alone (transformers 5.24 on keep only those:
    a long prompt's prefill no longer holds one per layer). Whichever layers a drafter reads, last one included (which
    transformers replaces by the normed output), they are the ones the full request returns, for every family."""
    from hf_specdiff import _compat

    target = make_family_target(family)
    every = list(range(1, target.config.get_text_config().num_hidden_layers + 1))
    request = _compat.hidden_states_request(every)
    prompt = torch.tensor([[3, 9, 27, 5, 11, 40, 2]])
    full = target(prompt, output_hidden_states=True).hidden_states
    selected = target(prompt, output_hidden_states=request).hidden_states
    assert len(selected) == len(full)
    for index in every:
        assert torch.equal(selected[index], full[index]), index
    if request is not True and family == "llama":  # what a request saves (a family whose forward collects its own
        # hidden states, Mamba's, still returns them all): the first and last layers asked, nothing else kept
        sparse = target(prompt, output_hidden_states=_compat.hidden_states_request([1, every[-1]])).hidden_states
        assert [i for i, h in enumerate(sparse) if h is not None] == [1, every[-1]]
        assert torch.equal(sparse[1], full[1]) and torch.equal(sparse[-1], full[-1])
        # and the loop asks for its drafter's layers alone
        speculator = make_speculator(target)
        asked = []
        target.register_forward_pre_hook(lambda m, args, kwargs: asked.append(kwargs["output_hidden_states"]),
                                         with_kwargs=True)
        target.generate(prompt, do_sample=False, max_new_tokens=6, assistant_model=speculator, speculation="xpress")
        layers = sorted(i + 1 for i in speculator.drafter.config.layer_ids)
        assert len(asked) > 1 and all(request == layers for request in asked)


def test_a_vision_language_target_speculates_on_text_prompts():
    """Gemma 3 from 4B up is a vision-language model: on text prompts it speculates like its text model (batch 1
    dynamic and static, and a padded batch)."""
    target = make_vision_language_target()
    speculator = hf_specdiff.AutoSpeculator.from_target(target, block_size=8, num_draft_layers=2, seed=1)
    generator = torch.Generator().manual_seed(0)
    for i in range(3):
        prompt = torch.randint(3, 290, (1, 6 + 3 * i), generator=generator)
        for method in METHODS:
            assert_same_as_plain(target, speculator, method, prompt, max_new_tokens=15)
        assert_same_as_plain(target, speculator, "xpress", prompt, {"cache_implementation": "static"},
                             max_new_tokens=15)
    batch = torch.randint(3, 290, (2, 8), generator=generator)
    mask = torch.ones_like(batch)
    batch[0, :3], mask[0, :3] = 0, 0
    plain = target.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=15)
    out = target.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=15, assistant_model=speculator,
                          speculation="xpress")
    assert torch.equal(out, plain)


@pytest.mark.parametrize("method", METHODS)
def test_a_prompt_with_an_image_speculates_as_plain_generate(method, monkeypatch):
    """Images (and the token types marking them, for Gemma 3's attention both ways within an image) are read with the
    prompt; the verify forwards read text. A left-padded batch of prompts with an image each, drafts of every accepted
    length, dynamic cache; each row alone, static cache."""
    target = make_vision_language_target()
    speculator = hf_specdiff.AutoSpeculator.from_target(target, block_size=8, num_draft_layers=2, seed=1)
    prompts = torch.tensor([[0, 0, 0, 2, 5, *GEMMA3_IMAGE, 17, 40, 41], [2, 9, 8, 7, 6, 5, *GEMMA3_IMAGE, 3, 3]])
    inputs = dict(input_ids=prompts, attention_mask=(prompts != 0).long(), token_type_ids=(prompts == 299).long(),
                  pixel_values=random_images(2))
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=24)
    # the image and the token types both change the output (else this test could not fail)
    assert not torch.equal(plain, target.generate(**{**inputs, "pixel_values": inputs["pixel_values"].flip(0)},
                                                  do_sample=False, max_new_tokens=24))
    assert not torch.equal(plain, target.generate(**{**inputs, "token_type_ids": None}, do_sample=False,
                                                  max_new_tokens=24))
    replay_greedy_drafts(monkeypatch, [row[int(row.nonzero()[0]):] for row in plain])  # left padding off
    out = target.generate(**inputs, do_sample=False, max_new_tokens=24, assistant_model=speculator,
                          speculation=method, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert len(set(out.speculation.accepted_lengths)) >= 3
    for row in range(2):
        start = 3 * (row == 0)  # its left padding off
        alone = {k: v[row : row + 1, start:] if k != "pixel_values" else v[row : row + 1] for k, v in inputs.items()}
        alone.pop("attention_mask")
        out = target.generate(**alone, do_sample=False, max_new_tokens=24, assistant_model=speculator,
                              speculation=method, cache_implementation="static")
        assert torch.equal(out[0], plain[row, start:])


def test_a_static_batch_of_prompts_with_images(monkeypatch):
    """LLaVA (full attention, so a batch may keep a static cache): a left-padded batch of prompts with an image each,
    drafts of every accepted length, static and dynamic caches."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    text = dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=2, eos_token_id=None)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=299, vision_feature_layer=-1,
                         vision_feature_select_strategy="default")  # 4 image tokens
    target = hf_specdiff.enable(LlavaForConditionalGeneration(config).double().eval())
    speculator = hf_specdiff.AutoSpeculator.from_target(target, block_size=8, num_draft_layers=2, seed=1)
    prompts = torch.tensor([[0, 0, 2, 5, *[299] * 4, 17, 40, 41], [2, 9, 8, 7, *[299] * 4, 6, 5, 3]])
    inputs = dict(input_ids=prompts, attention_mask=(prompts != 0).long(), pixel_values=random_images(2))
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=20)
    assert not torch.equal(plain, target.generate(**{**inputs, "pixel_values": inputs["pixel_values"].flip(0)},
                                                  do_sample=False, max_new_tokens=20))
    replay_greedy_drafts(monkeypatch, [row[int(row.nonzero()[0]):] for row in plain])  # left padding off
    for cache in ("dynamic", "static"):
        out = target.generate(**inputs, do_sample=False, max_new_tokens=20, assistant_model=speculator,
                              speculation="xpress", cache_implementation=cache)
        assert torch.equal(out, plain), cache


def vision_language_target_and_inputs(family: str):
    """A left-padded batch of 2 prompts with an image each, and the input beside the pixels that names it (images per
    prompt, patch grids, crops per image); transformers before 5.24 (Molmo2: 5.25) hands that to the loop as it is."""
    import inspect

    import transformers

    torch.manual_seed(0)
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, pad_token_id=0, bos_token_id=2, eos_token_id=None, tie_word_embeddings=False)
    pixels = torch.randn(3, 16, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    if family == "llava_onevision":  # an image of 2 tiles is 10 tokens
        vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, image_size=28, patch_size=14)
        config = transformers.LlavaOnevisionConfig(text_config={**text, "model_type": "qwen2"}, vision_config=vision,
                                                   image_token_index=299, image_grid_pinpoints=[[28, 28]],
                                                   vision_feature_layer=-1, vision_feature_select_strategy="full")
        model, name, images = transformers.LlavaOnevisionForConditionalGeneration(config), "batch_num_images", [10, 10]
        inputs = dict(pixel_values=random_images(4).view(2, 2, 3, 28, 28), image_sizes=torch.tensor([[28, 28]] * 2),
                      batch_num_images=torch.tensor([1, 1]))
    elif family == "lfm2_vl":  # 4 x 4 and 2 x 4 patches, merged 2 x 2: 4 and 2 tokens
        text.update(model_type="lfm2", layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False)
        vision = dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, patch_size=4, num_patches=16, vision_use_head=False)
        config = transformers.Lfm2VlConfig(text_config=text, vision_config=vision, image_token_id=299,
                                           projector_hidden_size=64, tie_word_embeddings=False)
        model, name, images = transformers.Lfm2VlForConditionalGeneration(config), "spatial_shapes", [4, 2]
        inputs = dict(pixel_values=pixels[:2], spatial_shapes=torch.tensor([[4, 4], [2, 4]]),
                      pixel_attention_mask=torch.arange(16).expand(2, -1) < torch.tensor([[16], [8]]))
    else:  # Molmo2: 2 crops (low and high resolution) and 1 of 4 x 4 patches, each pooled 2 x 2 into 4 tokens
        if not hasattr(transformers, "Molmo2ForConditionalGeneration"):
            pytest.skip("Molmo2 is in transformers 5.24 and later")
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, image_size=[16, 16], patch_size=4)
        adapter = dict(vision_feature_layer=[-1], hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=16, intermediate_size=64, text_hidden_size=64)
        config = transformers.Molmo2Config(text_config={**text, "head_dim": 16}, vision_config=vision,
                                           adapter_config=adapter, image_patch_id=299)
        model, name, images = transformers.Molmo2ForConditionalGeneration(config), "image_num_crops", [8, 4]
        with torch.no_grad():  # its adapter's small random weights pool features of ~1e-9: the image would not count
            for weight in model.model.multi_modal_projector.parameters():
                weight.normal_(0, 0.5)
        # each token pools a 2 x 2 block of patches, of its image's crops (before 5.25: of all crops)
        block = torch.tensor([[0, 1, 4, 5]]) + torch.tensor([0, 2, 8, 10])[:, None]
        offsets_by_model = "image_num_crops" in inspect.signature(model.model.get_image_features).parameters
        inputs = dict(pixel_values=pixels, image_grids=torch.tensor([[2, 2, 2, 2], [2, 2, 0, 0]]),
                      image_num_crops=torch.tensor([2, 1]),
                      image_token_pooling=torch.cat([block, block + 16, block + (0 if offsets_by_model else 32)]))
    rows = [[2, 5, *[299] * images[0], 17], [2, 9, 8, 7, 6, 5, 4, *[299] * images[1], 6, 5, 3]]
    prompts = torch.tensor([[0] * (len(rows[1]) - len(rows[0])) + rows[0], rows[1]])
    inputs.update(input_ids=prompts, attention_mask=(prompts != 0).long())
    if family == "molmo2":  # its processor's, as a batch's, marking the image tokens
        inputs.update(mm_token_type_ids=(prompts == 299).long())
    return hf_specdiff.enable(model.double().eval()), inputs, name


@pytest.mark.parametrize("family", ["llava_onevision", "lfm2_vl", "molmo2"])
def test_what_describes_a_prompts_images_goes_with_the_prompt(family, monkeypatch):
    """LLaVA-OneVision's `batch_num_images`, LFM2-VL's `spatial_shapes`, Molmo2's `image_num_crops`: read with the
    pixels only, so with the prompt's forward, not refused. A left-padded batch, drafts of every accepted length."""
    target, inputs, name = vision_language_target_and_inputs(family)
    assert name in hf_specdiff.generation._prompt_only_inputs(target, inputs)
    speculator = hf_specdiff.AutoSpeculator.from_target(target, block_size=8, num_draft_layers=2, seed=1)
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=20)
    assert not torch.equal(plain, target.generate(**{**inputs, "pixel_values": -inputs["pixel_values"]},
                                                  do_sample=False, max_new_tokens=20))
    replay_greedy_drafts(monkeypatch, [row[int(row.nonzero()[0]):] for row in plain])  # left padding off
    out = target.generate(**inputs, do_sample=False, max_new_tokens=20, assistant_model=speculator,
                          speculation="xpress")
    assert torch.equal(out, plain)


def test_an_image_text_to_text_pipeline_with_a_speculator(monkeypatch):
    """A user's image-text-to-text pipeline (LLaVA with SmolLM2's tokenizer, a processor turning PIL images and chats
    into its inputs) gives plain greedy's answers with the speculator in `generate_kwargs`: that pipeline hands its
    other call keywords to the processor, which ignores them. Passing the speculator to pipeline() says where it
    goes."""
    import numpy as np
    from PIL import Image
    from transformers import (AutoTokenizer, CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaProcessor, pipeline)

    from hf_specdiff.candidates import BlockDiffusionCandidateGenerator
    from hf_specdiff.embedded import default_target_path

    tokenizer = AutoTokenizer.from_pretrained(default_target_path())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.padding_side = "left"  # which this pipeline sets itself from transformers 5.25 on
    torch.manual_seed(0)
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)
    config = LlavaConfig(text_config=text, vision_config=vision, vision_feature_layer=-1,
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default")  # 4 image tokens
    target = hf_specdiff.enable(LlavaForConditionalGeneration(config).eval())
    chat_template = (  # SmolLM2's, with images in a message's content
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{% if c['type'] == 'image' %}"
        "<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
        tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default", image_token="<image>",
        num_additional_image_tokens=1, chat_template=chat_template)
    pipe = pipeline("image-text-to-text", model=target, processor=processor)
    images = [Image.fromarray(np.random.default_rng(i).integers(0, 256, (28, 28, 3), dtype=np.uint8)) for i in (0, 1)]

    def chats(images):
        return [[{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]
                for image, question in zip(images, ["What is this?", "Describe the picture in a few words."])]

    kwargs = dict(max_new_tokens=20, batch_size=2)
    plain = pipe(text=chats(images), generate_kwargs=dict(do_sample=False), **kwargs)
    assert plain != pipe(text=chats(images[::-1]), generate_kwargs=dict(do_sample=False), **kwargs)  # images matter
    drafts = []
    original = BlockDiffusionCandidateGenerator.get_candidates
    monkeypatch.setattr(BlockDiffusionCandidateGenerator, "get_candidates",
                        lambda *args, **kw: drafts.append(original(*args, **kw)) or drafts[-1])
    speculator = hf_specdiff.AutoSpeculator.from_target(target, block_size=8, num_draft_layers=2, seed=1)
    speculative = dict(do_sample=False, assistant_model=speculator, speculation="xpress")
    spec = pipe(text=chats(images), generate_kwargs=speculative, **kwargs)
    assert spec == plain and drafts
    with pytest.raises(TypeError, match="generate_kwargs"):
        pipeline("image-text-to-text", model=target, processor=processor, assistant_model=speculator)


def test_a_prompt_with_audio_speculates_as_plain_generate(monkeypatch):
    """Qwen2-Audio: the audio features and their mask go with the prompt's forward (16 mel frames are 4 audio tokens).
    A left-padded batch, drafts of every accepted length."""
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    torch.manual_seed(0)
    text = dict(model_type="qwen2", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=2, eos_token_id=None)
    audio = dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=16,
                 max_source_positions=8)
    config = Qwen2AudioConfig(text_config=text, audio_config=audio, audio_token_index=299)
    target = hf_specdiff.enable(Qwen2AudioForConditionalGeneration(config).double().eval())
    speculator = hf_specdiff.AutoSpeculator.from_target(target, block_size=8, num_draft_layers=2, seed=1)
    prompts = torch.tensor([[0, 0, 2, 5, 299, 299, 299, 299, 17, 40], [2, 9, 8, 299, 299, 299, 299, 7, 6, 5]])
    features = torch.randn(2, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    inputs = dict(input_ids=prompts, attention_mask=(prompts != 0).long(), input_features=features,
                  feature_attention_mask=torch.ones(2, 16, dtype=torch.long))
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=20)
    assert not torch.equal(plain, target.generate(**{**inputs, "input_features": features.flip(0)}, do_sample=False,
                                                  max_new_tokens=20))
    replay_greedy_drafts(monkeypatch, [row[int(row.nonzero()[0]):] for row in plain])  # left padding off
    out = target.generate(**inputs, do_sample=False, max_new_tokens=20, assistant_model=speculator,
                          speculation="xpress", return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert len(set(out.speculation.accepted_lengths)) >= 3


def make_mrope_vision_language_target(family: str):
    """Qwen2-VL, or Qwen3.5 (its linear-attention layers keep a recurrent state): image tokens at 3D (M-RoPE)
    positions; an image of 4 x 4 patches, merged 2 x 2, is 4 image tokens between 297 and 296."""
    import transformers

    torch.manual_seed(0)
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                head_dim=16, num_key_value_heads=2, rope_parameters=rope, pad_token_id=0, bos_token_id=2,
                eos_token_id=None)
    vision = dict(depth=1, hidden_size=32, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                  in_channels=3)
    image_tokens = dict(image_token_id=299, video_token_id=298, vision_start_token_id=297, vision_end_token_id=296)
    if family == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=64)
        config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **image_tokens)
        model = transformers.Qwen2VLForConditionalGeneration(config)
    else:
        text.update(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                    linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_conv_kernel_dim=4, rope_parameters={**rope, "mrope_interleaved": True,
                                                               "partial_rotary_factor": 1.0})
        vision.update(out_hidden_size=64, intermediate_size=64, num_position_embeddings=16)
        config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, **image_tokens)
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    return hf_specdiff.enable(model.double().eval())


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5"])
def test_a_prompt_with_an_image_at_3d_positions(family, monkeypatch):
    """Qwen2-VL and its kin place a prompt's image tokens at 3D (M-RoPE) positions, which `generate` computes; every
    token after the prompt is text, each of its positions running on from the prompt's last: the loop's text position
    plus a per-row offset (negative here: 4 image tokens span 2 positions). A left-padded batch, drafts of every
    accepted length, static and dynamic caches, each row alone."""
    import inspect

    from hf_specdiff import _compat

    if family == "qwen3_5" and not _compat.recurrent_rollback_supported():
        pytest.skip("a recurrent state rolls back from transformers 5.25 on")
    target = make_mrope_vision_language_target(family)
    speculator = hf_specdiff.AutoSpeculator.from_target(target, block_size=8, num_draft_layers=2, seed=1)
    image = [297, 299, 299, 299, 299, 296]
    prompts = torch.tensor([[0, 0, 0, 2, 5, *image, 17, 40, 41], [2, 7, 6, 5, 9, *image, 3, 3, 4]])
    inputs = dict(input_ids=prompts, attention_mask=(prompts != 0).long(), image_grid_thw=torch.tensor([[1, 4, 4]] * 2),
                  pixel_values=torch.randn(32, 3 * 2 * 14 * 14, dtype=torch.float64,
                                           generator=torch.Generator().manual_seed(0)))
    if "mm_token_type_ids" in inspect.signature(target.model.get_rope_index).parameters:  # (5.25 finds images so)
        inputs["mm_token_type_ids"] = (prompts == 299).int()
    positions = target._prepare_position_ids_for_generation(prompts, dict(inputs))
    assert positions.dim() == 3 and bool((positions[1:, :, -1] != positions[0, :, -1]).all())  # offsets to get right
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=20)
    replay_greedy_drafts(monkeypatch, [row[int(row.nonzero()[0]):] for row in plain])  # left padding off
    for cache in ("dynamic", "static") if family == "qwen2_vl" else ("dynamic",):
        out = target.generate(**inputs, do_sample=False, max_new_tokens=20, assistant_model=speculator,
                              speculation="xpress", cache_implementation=cache, return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain), cache
        assert len(set(out.speculation.accepted_lengths)) >= 3
    for row in range(2):
        real = int(inputs["attention_mask"][row].sum())
        alone = dict(input_ids=prompts[row : row + 1, -real:], image_grid_thw=inputs["image_grid_thw"][row : row + 1],
                     pixel_values=inputs["pixel_values"][16 * row : 16 * (row + 1)])
        if "mm_token_type_ids" in inputs:
            alone["mm_token_type_ids"] = inputs["mm_token_type_ids"][row : row + 1, -real:]
        out = target.generate(**alone, do_sample=False, max_new_tokens=20, assistant_model=speculator,
                              speculation="dflash")
        assert torch.equal(out[0], plain[row, -real - 20 :])


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5"])
def test_a_chat_about_an_image_continues_from_the_cache_handed_back(family, monkeypatch):
    """A chat's next turn on an M-RoPE model, continued from the cache the previous speculative call returned: its
    tokens run on from the positions of that call's last tokens, which the image shifted (4 image tokens at 2
    positions), as plain `generate` continues them (from the model's `rope_deltas`). Exact to the logits: a position
    off by the image's shift changes them by 3e-3 (Qwen2-VL) and 6e-2 (Qwen3.5) here, which the argmax may not show.
    A third turn continues the second's cache; a chat whose first turn had no image continues too. Before: refused."""
    import copy
    import inspect

    from hf_specdiff import _compat

    if family == "qwen3_5" and not _compat.recurrent_rollback_supported():
        pytest.skip("a recurrent state rolls back from transformers 5.25 on")
    target = make_mrope_vision_language_target(family)
    speculator = hf_specdiff.AutoSpeculator.from_target(target, block_size=8, num_draft_layers=2, seed=1)
    returned_cache = _compat.generate_output_cache_field()
    token_types = "mm_token_type_ids" in inspect.signature(target.model.get_rope_index).parameters
    pixels = torch.randn(16, 3 * 2 * 14 * 14, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def text(ids):  # (a mask: a generated token may be the pad token, which `generate` would take as padding)
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids))

    def with_image(ids):  # the whole conversation so far, its image included: what plain generate reads from scratch
        inputs = dict(**text(ids), image_grid_thw=torch.tensor([[1, 4, 4]]), pixel_values=pixels)
        return {**inputs, "mm_token_type_ids": (ids == 299).int()} if token_types else inputs

    options = dict(do_sample=False, max_new_tokens=12, return_dict_in_generate=True, output_logits=True)
    for first_turn in (with_image(torch.tensor([[2, 5, 297, 299, 299, 299, 299, 296, 17, 40, 41]])),
                       text(torch.tensor([[2, 5, 17, 40, 41]]))):
        out = target.generate(**first_turn, **options, assistant_model=speculator, speculation="xpress")
        assert torch.equal(out.sequences, target.generate(**first_turn, **options).sequences)
        for turn in ([50, 51, 52], [60, 7]):
            ids = torch.cat([out.sequences, torch.tensor([turn])], dim=1)
            cache = getattr(out, returned_cache)
            plain = target.generate(**with_image(ids) if "pixel_values" in first_turn else text(ids), **options)
            monkeypatch.undo()  # (the previous turn's drafts)
            replay_greedy_drafts(monkeypatch, [plain.sequences[0]])
            with pytest.raises(ValueError, match="pre-filled cache it did not hand back"):  # a copy lacks the shift
                target.generate(**text(ids), **_compat.cache_kwargs(target, copy.deepcopy(cache)),
                                assistant_model=speculator, speculation="dflash", max_new_tokens=2)
            out = target.generate(**text(ids), **_compat.cache_kwargs(target, cache), **options,
                                  assistant_model=speculator, speculation="xpress")
            assert torch.equal(out.sequences, plain.sequences)
            # (Qwen3.5's linear attention computes in float32 inside: 6e-8 between a prompt read whole and in parts)
            torch.testing.assert_close(torch.stack(out.logits), torch.stack(plain.logits), rtol=0, atol=1e-6)
            assert max(out.speculation.accepted_lengths) >= 3
        monkeypatch.undo()


def make_omni_thinker():
    """Qwen2.5-Omni's thinker: a video of 2 x 4 x 4 patches is 8 tokens between 297 and 296, 16 frames of audio 4
    tokens between 293 and 294; 3D (M-RoPE) positions."""
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    torch.manual_seed(0)
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rope_parameters=rope, pad_token_id=0, bos_token_id=2, eos_token_id=None)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0], window_size=28)
    audio = dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=16,
                 max_source_positions=50, n_window=4, output_dim=64)
    config = Qwen2_5OmniThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio, image_token_index=299, video_token_index=298,
        vision_start_token_id=297, vision_end_token_id=296, audio_token_index=295, audio_start_token_id=293,
        audio_end_token_id=294, user_token_id=10)
    return hf_specdiff.enable(Qwen2_5OmniThinkerForConditionalGeneration(config).double().eval())


@pytest.mark.parametrize("interleaved", [False, True], ids=["video_then_audio", "audio_in_video"])
def test_an_omni_thinker_prompt_with_video_and_audio(interleaved, monkeypatch):
    """Qwen2.5-Omni's thinker: a video's timing (`video_second_per_grid`), the audio lengths and `use_audio_in_video`
    place the prompt's tokens at 3D positions (refused before); later tokens run on from the prompt's last. A video of
    2 x 4 x 4 patches (8 tokens) and 16 frames of audio (4 tokens), apart or interleaved as the processor lays out a
    video's own audio. A left-padded batch, drafts of every accepted length, dynamic and static caches."""
    target = make_omni_thinker()
    speculator = hf_specdiff.AutoSpeculator.from_target(target, block_size=8, num_draft_layers=2, seed=1)
    if interleaved:  # 2 s per frame, 2 s chunks: the first frame's tokens, the audio's, the second frame's
        media = [[297, 293, *[298] * 4, *[295] * 4, *[298] * 4, 294, 296]] * 2
    else:
        video, sound = [297, *[298] * 8, 296], [293, *[295] * 4, 294]
        media = [[*video, 17, *sound], [*sound, 8, *video]]
    rows = [[2, 5, *media[0], 40], [2, 7, 6, 5, 9, *media[1], 3, 3, 4]]
    prompts = torch.tensor([[0] * (len(rows[1]) - len(rows[0])) + rows[0], rows[1]])
    generator = torch.Generator().manual_seed(0)
    inputs = dict(input_ids=prompts, attention_mask=(prompts != 0).long(), use_audio_in_video=interleaved,
                  pixel_values_videos=torch.randn(64, 3 * 2 * 14 * 14, dtype=torch.float64, generator=generator),
                  video_grid_thw=torch.tensor([[2, 4, 4]] * 2), video_second_per_grid=torch.tensor([2.0, 2.0]),
                  input_features=torch.randn(2, 16, 16, dtype=torch.float64, generator=generator),
                  feature_attention_mask=torch.ones(2, 16, dtype=torch.long))
    if not interleaved:
        inputs["video_second_per_grid"] = torch.tensor([2.0, 0.5])
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=20)
    if not interleaved:  # the timing moves the positions, and so the output
        timing = {"video_second_per_grid": torch.tensor([0.5, 2.0])}
        assert not torch.equal(plain, target.generate(**{**inputs, **timing}, do_sample=False, max_new_tokens=20))
    replay_greedy_drafts(monkeypatch, [row[int(row.nonzero()[0]):] for row in plain])  # left padding off
    for cache in ("dynamic", "static"):
        out = target.generate(**inputs, do_sample=False, max_new_tokens=20, assistant_model=speculator,
                              speculation="xpress", cache_implementation=cache, return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain), cache
        assert len(set(out.speculation.accepted_lengths)) >= 3


def test_a_gemma4_prompt_with_an_image_and_its_patch_positions():
    """Gemma 4's images come with their patches' positions (`image_position_ids`), which transformers before 5.24
    hands the loop as they are (later ones encode the image first): read with the prompt, not refused."""
    import transformers

    torch.manual_seed(0)
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8, hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=300, layer_types=["sliding_attention", "full_attention", "full_attention"],
                pad_token_id=0, bos_token_id=2, eos_token_id=None, use_bidirectional_attention="vision")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2, position_embedding_size=16)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None, boi_token_id=297,
                                       eoi_token_id=298, image_token_id=299, video_token_id=296, audio_token_id=295,
                                       boa_token_id=294, eoa_token_index=293)
    target = hf_specdiff.enable(transformers.Gemma4ForConditionalGeneration(config).double().eval())
    speculator = hf_specdiff.AutoSpeculator.from_target(target, block_size=8, num_draft_layers=2, seed=1)
    prompts = torch.tensor([[0, 0, 0, 2, 5, *GEMMA3_IMAGE, 17, 40, 41], [2, 9, 8, 7, 6, 5, *GEMMA3_IMAGE, 3, 3]])
    patches = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1).reshape(1, 16, 2)
    inputs = dict(input_ids=prompts, attention_mask=(prompts != 0).long(), mm_token_type_ids=(prompts == 299).long(),
                  pixel_values=torch.rand(2, 16, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(0)),
                  image_position_ids=patches.expand(2, -1, -1))  # 4 x 4 patches of 4 x 4 pixels, pooled 2 x 2
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=20)
    out = target.generate(**inputs, do_sample=False, max_new_tokens=20, assistant_model=speculator,
                          speculation="xpress")
    assert torch.equal(out, plain)


@pytest.mark.parametrize("family", ["gemma3", "qwen2_vl", "qwen2_5_omni"])
def test_a_text_prompt_with_token_types_prefills_in_chunks(family):
    """A vision-language model's processor hands a text prompt its token types too (all text): a chunked prefill reads
    them up to each chunk's end, as transformers' own (it crashed on them). An omni model's `use_audio_in_video=False`
    goes with every chunk (it crashed as a token type)."""
    makers = dict(gemma3=make_vision_language_target, qwen2_vl=lambda: make_mrope_vision_language_target(family),
                  qwen2_5_omni=make_omni_thinker)
    target = makers[family]()
    speculator = hf_specdiff.AutoSpeculator.from_target(target, block_size=8, num_draft_layers=2, seed=1)
    prompts = torch.tensor([[0, 0, 2, 5, 17, 40, 41, 8, 9, 10, 11], [2, 9, 8, 7, 6, 5, 4, 3, 3, 8, 1]])
    types = dict(gemma3={"token_type_ids": torch.zeros_like(prompts)},
                 qwen2_vl={"mm_token_type_ids": torch.zeros_like(prompts)},
                 qwen2_5_omni={"use_audio_in_video": False})[family]
    inputs = dict(input_ids=prompts, attention_mask=(prompts != 0).long(), **types)
    plain = target.generate(**inputs, do_sample=False, max_new_tokens=16)
    out = target.generate(**inputs, do_sample=False, max_new_tokens=16, prefill_chunk_size=4,
                          assistant_model=speculator, speculation="xpress")
    assert torch.equal(out, plain)


@pytest.mark.parametrize("family", STATE_FAMILIES)
def test_targets_with_recurrent_or_conv_state_roll_it_back(family, monkeypatch):
    """A rejected draft must leave no trace in a layer's recurrent or conv state: transformers 5.25 restores the state
    a roll-back lands on (what the loop asks it to record); older versions cannot for a recurrent state, and such a
    target is refused there, before any work. Static caches are refused for these layers (batches:
    `test_batched.py::test_targets_with_recurrent_or_conv_state_rows_equal_row_by_row`)."""
    from hf_specdiff import _compat

    target = make_state_target(family)
    speculator = make_speculator(target)
    if family not in CONV_STATE_FAMILIES and not _compat.recurrent_rollback_supported():
        with pytest.raises(ValueError, match="rolls back from version 5.25 on .*Upgrade transformers"):
            target.generate(torch.tensor([[5, 9, 2]]), max_new_tokens=5, assistant_model=speculator,
                            speculation="xpress")
        return
    accepted = set()
    for i, prompt in prompts(count=3, seed=3):
        plain = target.generate(prompt, do_sample=False, max_new_tokens=30)
        with monkeypatch.context() as patch:
            replay_greedy_drafts(patch, [plain[0]])
            for method in METHODS:
                stats = assert_same_as_plain(target, speculator, method, prompt, max_new_tokens=30)
                accepted.update(stats.accepted_lengths)
    assert len(accepted) >= 5, f"roll-backs of too few depths: accepted lengths {sorted(accepted)}"
    with pytest.raises(ValueError, match="with cache_implementation='static' handles full, sliding-window and chunked"):
        target.generate(torch.tensor([[4, 7, 1]]), max_new_tokens=5, assistant_model=speculator,
                        speculation="xpress", cache_implementation="static")


def test_a_target_keeping_its_state_outside_the_cache_is_refused():
    """RecurrentGemma keeps its recurrent state on the module, where no roll-back reaches it: refused."""
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM

    config = RecurrentGemmaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, lru_width=64, attention_window_size=16,
                                  block_types=["recurrent", "attention"], pad_token_id=0, bos_token_id=0)
    target = hf_specdiff.enable(RecurrentGemmaForCausalLM(config).eval())
    speculator = make_speculator(target)
    with pytest.raises(ValueError, match="keeps nothing there|rolls back from version 5.25 on"):
        target.generate(torch.tensor([[5, 9, 2]]), max_new_tokens=5, assistant_model=speculator, speculation="xpress")


@pytest.mark.parametrize("method", ["xpress", "markov"])
def test_greedy_equals_plain_when_drafts_are_accepted(method):
    """Oracle add-ons on a successor target: long accepted runs, partial blocks, bonus tokens, cache roll-back."""
    target = hf_specdiff.enable(make_successor_target())
    speculator = make_speculator(target, oracle=True)
    taus = []
    for i, prompt in prompts():
        # max_new_tokens varies so that generation often ends inside a block
        taus.append(assert_same_as_plain(target, speculator, method, prompt, max_new_tokens=5 + 7 * (i % 6)).tau)
    assert sum(taus) / len(taus) > 2.0, "the oracle should get long runs accepted"


def test_all_drafts_accepted_block_after_block():
    """With enough Jacobi passes xPress reaches the fixed point: whole blocks accepted on a pure successor target."""
    target = hf_specdiff.enable(make_successor_target(layer_scale=0.0))
    speculator = make_speculator(target, block_size=8, oracle=True, num_jacobi_passes=8)
    stats = assert_same_as_plain(target, speculator, "xpress", torch.tensor([[5, 6, 7]]), max_new_tokens=33)
    assert stats.accepted_lengths == [8, 8, 8, 8]
    assert stats.refine_passes[0] <= 8


def test_fewer_jacobi_passes_accept_fewer_tokens():
    target = hf_specdiff.enable(make_successor_target(layer_scale=0.0))
    speculator = make_speculator(target, block_size=8, oracle=True)
    prompt = torch.tensor([[5, 6, 7]])
    kwargs = dict(do_sample=False, max_new_tokens=25, assistant_model=speculator, speculation="xpress",
                  return_dict_in_generate=True)
    one = target.generate(prompt, num_jacobi_passes=1, **kwargs).speculation
    three = target.generate(prompt, num_jacobi_passes=3, **kwargs).speculation
    # pass p fixes slot p (each pass propagates the correct prefix by one slot), plus the bonus token
    assert one.accepted_lengths[0] == 2 and three.accepted_lengths[0] == 4


@pytest.mark.parametrize("method", METHODS)
def test_eos_inside_a_drafted_block(method):
    """The target reaches EOS in the middle of a block the drafter continued past it: stop exactly there."""
    target = hf_specdiff.enable(make_successor_target(layer_scale=0.0, eos_token_id=17))
    speculator = make_speculator(target, block_size=8, oracle=True, num_jacobi_passes=8)
    prompt = torch.tensor([[8, 9, 10]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=40)
    assert plain[0, -1].item() == 17 and plain.shape[1] == 3 + 7
    out = target.generate(prompt, do_sample=False, max_new_tokens=40, assistant_model=speculator, speculation=method)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("method", METHODS)
def test_logits_processors_repetition_penalty_and_min_length(method):
    target = hf_specdiff.enable(make_successor_target(eos_token_id=17))
    speculator = make_speculator(target, oracle=True)
    for i, prompt in prompts(count=15, seed=1):
        assert_same_as_plain(
            target, speculator, method, prompt, max_new_tokens=30, repetition_penalty=1.3, min_new_tokens=5 + i % 9
        )


@pytest.mark.parametrize("method", METHODS)
def test_a_subclassed_warper_that_reads_the_prefix_gets_it(method):
    """A user's processor that subclasses a position-free warper (temperature) but also reads input_ids must be
    scored position by position with the real prefix, not with the warpers' one-token stand-in."""
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import TemperatureLogitsWarper

    class NoImmediateRepeat(TemperatureLogitsWarper):
        def __call__(self, input_ids, scores):
            scores = super().__call__(input_ids, scores).clone()
            scores[torch.arange(len(scores)), input_ids[:, -1]] = -float("inf")
            return scores

    target = hf_specdiff.enable(make_successor_target())
    speculator = make_speculator(target, oracle=True)
    for _, prompt in prompts(count=8, seed=3):
        assert_same_as_plain(target, speculator, method, prompt, max_new_tokens=20,
                             logits_processor=LogitsProcessorList([NoImmediateRepeat(1.0)]))


@pytest.mark.parametrize("draft_vocab", [False, True], ids=["whole-vocabulary", "draft-vocabulary"])
def test_processors_reading_neither_prefix_nor_ids_score_a_block_in_one_call(draft_vocab, monkeypatch):
    """`renormalize_logits`, `remove_invalid_values` and `top_h` build processors (LogitNormalization,
    InfNanRemoveLogitsProcessor, TopHLogitsWarper) that read neither the tokens before a position nor which token a
    column is: a block's drafts and its verification are each scored in one call, as with temperature or top-k, and on a
    draft vocabulary's columns as they are. They ran slot by slot before: a call per slot and per Jacobi pass (with
    top_h, xpress's refinement of the shipped speculator took 4x as long under sampling)."""
    from transformers.generation.logits_process import LogitNormalization

    from hf_specdiff import Speculator

    calls = []
    original = LogitNormalization.__call__
    monkeypatch.setattr(LogitNormalization, "__call__", lambda self, *args: calls.append(1) or original(self, *args))
    target = hf_specdiff.enable(make_successor_target())
    speculator = make_speculator(target, oracle=True)
    if draft_vocab:  # every third token left out: the columns are not the token ids
        vocab = torch.tensor([t for t in range(VOCAB) if t % 3])
        speculator = Speculator(speculator.drafter, speculator.refiner, speculator.markov_head, draft_vocab=vocab)
    options = dict(renormalize_logits=True, remove_invalid_values=True, max_new_tokens=16)
    for _, prompt in prompts(count=2, seed=5):
        assert_same_as_plain(target, speculator, "dflash", prompt, **options)
        calls.clear()
        stats = target.generate(prompt, do_sample=False, assistant_model=speculator, speculation="dflash",
                                return_dict_in_generate=True, **options).speculation
        # one call per target forward (the prefill's token, then each verification) and one per block drafted
        assert len(calls) == stats.target_forwards + stats.blocks, (len(calls), stats.target_forwards, stats.blocks)
        plain = target.generate(prompt, do_sample=False, return_dict_in_generate=True, output_scores=True, **options)
        out = target.generate(prompt, do_sample=False, assistant_model=speculator, speculation="xpress",
                              return_dict_in_generate=True, output_scores=True, **options)
        for ours, theirs in zip(out.scores, plain.scores, strict=True):
            torch.testing.assert_close(ours, theirs)
    sampled = dict(do_sample=True, top_h=0.6, renormalize_logits=True, max_new_tokens=8)
    for method in METHODS:  # sampled: a seed gives the same tokens again (the distribution: test_sampling.py)
        torch.manual_seed(0)
        first = target.generate(prompt, assistant_model=speculator, speculation=method, **sampled)
        torch.manual_seed(0)
        assert torch.equal(target.generate(prompt, assistant_model=speculator, speculation=method, **sampled), first)


def test_stateless_watermark_is_lossless():
    """WatermarkingConfig's processor seeds itself from the prefix at every call (no state): allowed and exact."""
    from transformers import WatermarkingConfig

    target = hf_specdiff.enable(make_successor_target())
    speculator = make_speculator(target, oracle=True)
    for _, prompt in prompts(count=6, seed=4):
        assert_same_as_plain(target, speculator, "xpress", prompt, max_new_tokens=20,
                             watermarking_config=WatermarkingConfig(bias=2.5, context_width=1))


def test_user_stopping_criteria_fire_inside_a_block():
    class StopAfter(StoppingCriteria):  # stops when the sequence ends with token 20, like a stop string would
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == 20

    target = hf_specdiff.enable(make_successor_target(layer_scale=0.0))
    speculator = make_speculator(target, block_size=8, oracle=True, num_jacobi_passes=8)
    prompt = torch.tensor([[10, 11]])
    criteria = StoppingCriteriaList([StopAfter()])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=40, stopping_criteria=criteria)
    out = target.generate(prompt, do_sample=False, max_new_tokens=40, stopping_criteria=criteria,
                          assistant_model=speculator, speculation="xpress")
    assert plain[0, -1].item() == 20 and torch.equal(out, plain)


@pytest.mark.parametrize("method", ["xpress", "markov"])
def test_stopping_criteria_are_shown_the_prefixes_plain_generate_shows_them(method):
    """A criterion (one that logs, streams or counts what it is shown) sees every prefix plain decoding shows it, with
    the same scores so far, the last one included: the token at which EOS or the max length stops the run, inside an
    accepted block or not (it was not asked about that one before)."""
    class Record(StoppingCriteria):
        def __init__(self):
            self.seen = []

        def __call__(self, input_ids, scores, **kwargs):
            self.seen.append((input_ids[0].tolist(), None if scores is None else torch.stack(scores)))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    target = hf_specdiff.enable(make_successor_target(eos_token_id=17))
    speculator = make_speculator(target, oracle=True)
    for prompt, max_new_tokens in ((torch.tensor([[3, 4, 5, 6]]), 30), (torch.tensor([[30, 31]]), 9)):
        for with_scores in (False, True):
            seen = []
            for spec in ({}, dict(assistant_model=speculator, speculation=method)):
                criterion = Record()
                target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens, repetition_penalty=1.2,
                                stopping_criteria=StoppingCriteriaList([criterion]),
                                return_dict_in_generate=with_scores, output_scores=with_scores, **spec)
                seen.append(criterion.seen)
            assert [tokens for tokens, _ in seen[1]] == [tokens for tokens, _ in seen[0]], (len(seen[1]), len(seen[0]))
            for (_, ours), (_, theirs) in zip(*seen):
                torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)  # None for both without output_scores


def test_generate_arguments_passed_by_position_act_as_passed_by_keyword():
    """generate(inputs, generation_config, logits_processor, stopping_criteria, ...): an option passed by position is
    honoured (stop strings, which need the tokenizer the loop takes) and refused (assisted decoding's) as by keyword."""
    tokenizer = char_tokenizer()  # "mno" = tokens 22, 23, 24: the successor target writes them after 19, 20, 21
    target = hf_specdiff.enable(make_successor_target(layer_scale=0.0))
    speculator = make_speculator(target, block_size=8, oracle=True)
    spec = dict(assistant_model=speculator, speculation="xpress")
    prompt = torch.tensor([[19, 20, 21]])
    config = GenerationConfig(do_sample=False, max_new_tokens=12, stop_strings=["mno"])
    plain = target.generate(prompt, config, tokenizer=tokenizer)
    assert plain[0, 3:].tolist() == [22, 23, 24]
    assert torch.equal(target.generate(prompt, config, tokenizer=tokenizer, **spec), plain)
    by_keyword = dict(max_new_tokens=12, do_sample=False, stop_strings=["mno"], tokenizer=tokenizer)
    plain = target.generate(prompt, None, None, StoppingCriteriaList(), **by_keyword)
    assert torch.equal(target.generate(prompt, None, None, StoppingCriteriaList(), **by_keyword, **spec), plain)
    with pytest.raises(ValueError, match="remove `prompt_lookup_num_tokens`"):
        target.generate(prompt, GenerationConfig(prompt_lookup_num_tokens=3, max_new_tokens=4), **spec)
    with pytest.raises(TypeError, match="multiple values for argument 'generation_config'"):
        target.generate(prompt, config, generation_config=config, **spec)

    # a config passed in the call leaves what it does not set to the model's own (transformers fills it from there):
    # stop strings set on the model are honoured, assisted decoding's options and token healing set there refused
    target.generation_config.stop_strings = ["mno"]
    passed = GenerationConfig(do_sample=False, max_new_tokens=12)
    plain = target.generate(prompt, generation_config=passed, tokenizer=tokenizer)
    assert plain[0, 3:].tolist() == [22, 23, 24]
    assert torch.equal(target.generate(prompt, generation_config=passed, tokenizer=tokenizer, **spec), plain)
    # both configs set them: the passed config's are the ones (they failed for want of the tokenizer, which the loop
    # had taken, when only the passed config's were cleared and transformers refilled the model's)
    target.generation_config.stop_strings = ["zzz"]
    passed = GenerationConfig(do_sample=False, max_new_tokens=12, stop_strings=["mno"])
    plain = target.generate(prompt, generation_config=passed, tokenizer=tokenizer)
    assert plain[0, 3:].tolist() == [22, 23, 24]
    assert torch.equal(target.generate(prompt, generation_config=passed, tokenizer=tokenizer, **spec), plain)
    target.generation_config.stop_strings = None
    for option, value, message in (("prompt_lookup_num_tokens", 3, "remove `prompt_lookup_num_tokens`"),
                                   ("assistant_confidence_threshold", 0.3, "remove `assistant_confidence_threshold`"),
                                   ("token_healing", True, "does not support token healing")):
        setattr(target.generation_config, option, value)
        with pytest.raises(ValueError, match=message):
            target.generate(prompt, generation_config=passed, tokenizer=tokenizer, **spec)
        setattr(target.generation_config, option, GenerationConfig().to_dict()[option])

    class Forwarding(type(target)):  # a model class overriding generate(self, *args, **kwargs): names unknown
        def generate(self, *args, **kwargs):
            return super().generate(*args, **kwargs)

    target = hf_specdiff.enable(Forwarding(target.config).to(torch.float64).eval())
    speculator = make_speculator(target, block_size=8, oracle=True)
    plain = target.generate(prompt, do_sample=False, max_new_tokens=6)
    out = target.generate(prompt, do_sample=False, max_new_tokens=6, assistant_model=speculator, speculation="xpress")
    assert torch.equal(out, plain)


def test_position_ids_are_the_ones_generate_would_compute_or_refused():
    """The loop numbers each row's tokens from its first real one, as generate does when given no position ids:
    those pass (their padded slots hold anything), others would be dropped and are refused."""
    target = hf_specdiff.enable(make_target(initializer_range=0.2))
    speculator = make_speculator(target)
    prompt, mask = torch.tensor([[0, 4, 9, 1, 33, 7]]), torch.tensor([[0, 1, 1, 1, 1, 1]])
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=8, assistant_model=speculator,
                  speculation="dflash")
    plain = target.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=8)
    assert torch.equal(target.generate(prompt, position_ids=torch.tensor([[7, 0, 1, 2, 3, 4]]), **kwargs), plain)
    with pytest.raises(ValueError, match="these position_ids differ. Remove `position_ids`"):
        target.generate(prompt, position_ids=torch.tensor([[0, 0, 1, 2, 300, 301]]), **kwargs)


def test_streamer_receives_prompt_then_exactly_the_output():
    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    target = hf_specdiff.enable(make_successor_target())
    speculator = make_speculator(target, oracle=True)
    prompt = torch.tensor([[3, 4, 5, 6]])
    streamer = Collect()
    out = target.generate(prompt, do_sample=False, max_new_tokens=30, assistant_model=speculator,
                          speculation="xpress", streamer=streamer)
    assert streamer.ended and streamer.chunks[0] == prompt[0].tolist()
    assert sum(streamer.chunks[1:], []) == out[0, prompt.shape[1]:].tolist()


def test_scores_and_logits_match_plain_generate():
    target = hf_specdiff.enable(make_successor_target())
    speculator = make_speculator(target, oracle=True)
    prompt = torch.tensor([[3, 4, 5, 6]])
    kwargs = dict(do_sample=False, max_new_tokens=20, return_dict_in_generate=True, output_scores=True,
                  output_logits=True, repetition_penalty=1.2)
    plain = target.generate(prompt, **kwargs)
    spec = target.generate(prompt, assistant_model=speculator, speculation="xpress", **kwargs)
    assert len(spec.scores) == len(plain.scores) == 20
    for ours, theirs in zip(spec.scores, plain.scores):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    for ours, theirs in zip(spec.logits, plain.logits):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_native_transformers_dflash_path_with_our_drafter():
    """transformers' own `speculation_type="dflash"` drives our drafter (the speculator or its bare drafter)."""
    target = hf_specdiff.enable(make_target())
    speculator = make_speculator(target)
    for _, prompt in prompts(count=10, seed=2):
        plain = target.generate(prompt, do_sample=False, max_new_tokens=20)
        native = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=speculator,
                                 speculation_type="dflash")
        assert torch.equal(native, plain)
    hf_specdiff.disable(target)
    native = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=speculator.drafter,
                             speculation_type="dflash")
    assert torch.equal(native, plain)


def test_speculation_options_set_in_a_generation_config_are_read_as_those_of_the_call():
    """A GenerationConfig (passed, else the model's) may set `speculation_type` (transformers' option; before: the
    enabled model refused it, asking for the setting it had) and hf_specdiff's `speculation`, `num_draft_tokens` and
    `num_jacobi_passes` (before: the first refused as missing, the others ignored); the call's values win."""
    target = hf_specdiff.enable(make_successor_target())
    speculator = make_speculator(target, oracle=True)
    prompt = torch.tensor([[3, 4, 5]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=12)
    for assistant in (speculator, speculator.drafter):  # transformers' native path
        native = GenerationConfig(do_sample=False, max_new_tokens=12, speculation_type="dflash")
        assert torch.equal(target.generate(prompt, generation_config=native, assistant_model=assistant), plain)
        target.generation_config.speculation_type = "dflash"
        assert torch.equal(target.generate(prompt, do_sample=False, max_new_tokens=12, assistant_model=assistant),
                           plain)
        with pytest.raises(ValueError, match=r"`speculation_type` \(transformers\) \(set in the generation config\), "
                           "not both"):
            target.generate(prompt, do_sample=False, max_new_tokens=12, assistant_model=speculator,
                            speculation="xpress")
        target.generation_config.speculation_type = None
    ours = GenerationConfig(do_sample=False, max_new_tokens=12, speculation="xpress", num_draft_tokens=1,
                            num_jacobi_passes=1)
    out = target.generate(prompt, generation_config=ours, assistant_model=speculator, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert max(out.speculation.drafted_lengths) == 1 and max(out.speculation.refine_passes) == 1
    out = target.generate(prompt, generation_config=ours, assistant_model=speculator, return_dict_in_generate=True,
                          speculation="dflash", num_draft_tokens=3)  # the call's values win
    assert torch.equal(out.sequences, plain)
    assert max(out.speculation.drafted_lengths) == 3 and not any(out.speculation.refine_passes)
    target.generation_config.speculation = "markov"
    out = target.generate(prompt, do_sample=False, max_new_tokens=12, assistant_model=speculator,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain) and out.speculation.method == "markov"


def test_native_path_sees_the_same_drafts_as_ours():
    """Same drafter, same context features: the native generator and ours propose the same first block."""
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    target = make_target()
    speculator = make_speculator(target)
    prompt = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    config = target.generation_config
    config.max_length = 40
    ours = hf_specdiff.BlockDiffusionCandidateGenerator(target, speculator, "dflash", config)
    theirs = DFlashTokenCandidateGenerator(speculator.drafter, target.get_input_embeddings(),
                                           target.get_output_embeddings(), config)
    position_ids = torch.arange(prompt.shape[1])[None]
    # each generator reads the target's outputs as it asks generate to produce them (theirs: only some layers)
    ids_ours, q_ours = ours.get_candidates(
        prompt, model_outputs=target(prompt[:, :-1], output_hidden_states=True), is_first_iteration=False,
        n_last_matches=0)
    ids_theirs, q_theirs = theirs.get_candidates(
        prompt, model_kwargs={"position_ids": position_ids, "attention_mask": torch.ones_like(prompt)},
        model_outputs=target(prompt[:, :-1], **theirs.model_kwargs_overrides), is_first_iteration=False,
        n_last_matches=0)
    assert torch.equal(ids_ours, ids_theirs)
    torch.testing.assert_close(q_ours, q_theirs.to(q_ours.dtype))


def test_native_generate_reads_the_layers_the_drafter_was_trained_on():
    """Inside a real `generate(..., speculation_type="dflash")` (not a hand-built hidden-states tuple), the features
    transformers hands the drafter are the target layers of its config, z-lab's meaning, on every supported version;
    the last target layer included."""
    import inspect

    target = hf_specdiff.enable(make_target())
    last = target.config.num_hidden_layers - 1
    speculator = hf_specdiff.AutoSpeculator.from_target(target, block_size=8, num_draft_layers=2,
                                                        target_layer_ids=[last, 0], seed=1)
    prompt = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(5))
    seen = []
    signature = inspect.signature(speculator.drafter.forward)

    def record(module, args, kwargs):
        seen.append(signature.bind(*args, **kwargs).arguments["context_hidden_states"].clone())

    speculator.drafter.register_forward_pre_hook(record, with_kwargs=True)
    target.generate(prompt, assistant_model=speculator, speculation_type="dflash", do_sample=False, max_new_tokens=4)
    with torch.no_grad():
        expected = speculator.drafter.context_features(target(prompt, output_hidden_states=True).hidden_states)
    assert seen[0].shape[1] == prompt.shape[1]  # the first block's context: the whole prompt
    torch.testing.assert_close(seen[0], expected)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cache", [None, "static"])
def test_fewer_draft_tokens_stay_lossless(method, cache):
    """num_draft_tokens=k offers the first k slots of each block: still plain greedy's output, never more than k + 1
    tokens per step, and whole runs of k drafts accepted with the oracle add-ons."""
    target = hf_specdiff.enable(make_successor_target())
    speculator = make_speculator(target, oracle=True)
    for k in (1, 3):
        lengths = []
        for i, prompt in prompts(12):
            stats = assert_same_as_plain(target, speculator, method, prompt, max_new_tokens=5 + 7 * (i % 6),
                                         spec_kwargs=dict(num_draft_tokens=k, cache_implementation=cache))
            assert max(stats.drafted_lengths, default=0) <= k
            lengths += stats.accepted_lengths
        assert max(lengths) <= k + 1
        if method != "dflash":  # the oracle add-ons get whole blocks of k drafts accepted
            assert max(lengths) == k + 1


def test_refining_fewer_slots_gives_the_same_leading_tokens():
    """The refiner never reads a later slot: refining the first k slots alone gives the whole block's first k tokens."""
    from hf_specdiff.candidates import DraftPicker
    from hf_specdiff.xpress import jacobi_refine

    target = make_successor_target()
    refiner = make_speculator(target, oracle=True).refiner
    block = refiner.config.block_size
    generator = torch.Generator().manual_seed(0)
    for _ in range(10):
        logits = torch.randn(2, block - 1, VOCAB, generator=generator)
        hidden = torch.randn(2, block, refiner.config.hidden_size, generator=generator).to(refiner.dtype)
        anchors = torch.randint(0, VOCAB, (2, 2), generator=generator)
        picker = DraftPicker(None, do_sample=False)
        picker.start_block(anchors, block - 1, VOCAB)
        whole, _, _ = jacobi_refine(refiner, logits, hidden, anchors, picker, num_passes=2 * block)
        for k in (1, 3, block - 2):
            picker.start_block(anchors, k, VOCAB)
            head, _, _ = jacobi_refine(refiner, logits[:, :k], hidden, anchors, picker, num_passes=2 * block)
            assert torch.equal(head, whole[:, :k])


@pytest.mark.parametrize("method", METHODS)
def test_a_cache_passed_in_prefilled_continues_as_plain_generate(method, monkeypatch):
    """transformers' prefix caching (a prompt's prefix computed once into a cache, a copy passed with each prompt) and
    a chat's next turn continued from the cache the previous call handed back: the prefill feeds only the tokens the
    cache lacks, and the output is plain greedy's. The drafter drafts from the slots after a prefix it never saw, and
    continues a turn from its own context of the call that handed the cache back."""
    import copy

    from transformers import DynamicCache

    from hf_specdiff import _compat

    target = hf_specdiff.enable(make_successor_target())
    with_cache = functools.partial(_compat.cache_kwargs, target)  # `cache=` from 5.25 on, else its old name
    returned_cache = _compat.generate_output_cache_field()
    speculator = make_speculator(target, oracle=True)
    prefilled = []  # tokens fed by each prefill
    target.model.register_forward_pre_hook(lambda module, args, kwargs: prefilled.append(kwargs["input_ids"].shape[1]),
                                           with_kwargs=True)
    options = dict(assistant_model=speculator, speculation=method, return_dict_in_generate=True)
    drafter_starts = []  # (target cache slots the drafter lacks, slots of its own context it starts with) per call

    class Recorded(hf_specdiff.generation.BlockDiffusionCandidateGenerator):
        def __init__(self, *args, unseen_prefix=0, context_cache=None, **kwargs):
            carried = 0 if context_cache is None else context_cache.get_seq_length()
            drafter_starts.append((unseen_prefix, carried))
            super().__init__(*args, unseen_prefix=unseen_prefix, context_cache=context_cache, **kwargs)

    monkeypatch.setattr(hf_specdiff.generation, "BlockDiffusionCandidateGenerator", Recorded)
    taus = []
    for i, prompt in prompts(12, seed=3):
        prompt = torch.cat([prompt, torch.randint(1, VOCAB, (1, 3))], dim=1)
        cut, new_tokens = 1 + i % (prompt.shape[1] - 1), 5 + 7 * (i % 4)
        with torch.no_grad():
            prefix = getattr(target(prompt[:, :cut], **with_cache(DynamicCache(config=target.config))), returned_cache)
        plain = target.generate(prompt, do_sample=False, max_new_tokens=new_tokens)
        prefilled.clear()
        out = target.generate(prompt, **with_cache(copy.deepcopy(prefix)), max_new_tokens=new_tokens, **options)
        assert torch.equal(out.sequences, plain), (i, cut)
        assert prefilled[0] == prompt.shape[1] - cut and drafter_starts[-1] == (cut, 0)
        taus.append(out.speculation.tau)
        # the next turn: the output so far and a few new tokens, from the cache this call handed back
        turn = torch.cat([out.sequences, torch.randint(1, VOCAB, (1, 1 + i % 3))], dim=1)
        cache = getattr(out, returned_cache)
        in_cache = cache.get_seq_length()  # all but the last token of `out.sequences`
        branch = copy.deepcopy(cache)  # a branch of the chat
        prefilled.clear()
        next_turn = target.generate(turn, **with_cache(cache), max_new_tokens=new_tokens, **options)
        assert torch.equal(next_turn.sequences, target.generate(turn, do_sample=False, max_new_tokens=new_tokens))
        assert prefilled[0] == turn.shape[1] - in_cache
        # it lacks what it lacked in the previous turn (the prefix) and the tokens verified after its last draft in it:
        # a block's, and the single token a last step a token short of max_length verified with no draft
        unseen, carried = drafter_starts[-1]
        assert unseen + carried == in_cache and cut <= unseen <= cut + speculator.drafter.config.block_size + 1
        assert carried >= prompt.shape[1] - cut  # the turn's first prompt past the prefix at least
        # the branch, a deep copy, starts the drafter without that context, as exact
        branch = target.generate(turn, **with_cache(branch), max_new_tokens=new_tokens, **options)
        assert drafter_starts[-1] == (in_cache, 0) and torch.equal(branch.sequences, next_turn.sequences)
    # a prompt left-padded as in a batch, its cached prefix padding and all
    padded, mask = torch.tensor([[0, 0, 9, 4, 11, 3, 8]]), torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        prefix = target(padded[:, :4], attention_mask=mask[:, :4], **with_cache(DynamicCache(config=target.config)))
    out = target.generate(padded, attention_mask=mask, **with_cache(getattr(prefix, returned_cache)), max_new_tokens=12,
                          **options)
    assert torch.equal(out.sequences, target.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=12))
    assert method == "dflash" or sum(taus) / len(taus) > 1.5  # drafts were accepted without the prefix's features


@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("method", METHODS)
def test_a_prompt_given_as_embeddings(method, cache):
    """`inputs_embeds` as the prompt, alone (a soft prompt of two vectors before each row's tokens, as prompt tuning
    makes: the cache holds more slots than the output has prompt tokens) or beside its `input_ids`, in a left-padded
    batch and row by row: plain generate's tokens, drafts accepted, and a single row's cache handed back as long as
    plain generate's. The embeddings are not the tokens' own (each row's last one is another token's), so an output
    that read the tokens instead would differ."""
    target = hf_specdiff.enable(make_successor_target())
    speculator = make_speculator(target, oracle=True)
    embed = target.get_input_embeddings()
    rows = [[5, 9, 3, 7], [4, 8], [11]]
    ids, mask = hf_specdiff.batching.left_pad(rows, 0, "cpu")
    looks_like = embed(ids).detach()
    looks_like[:, -1] = embed(torch.tensor([20, 40, 60])).detach()
    soft = torch.randn(2, looks_like.shape[-1], generator=torch.Generator().manual_seed(0), dtype=looks_like.dtype)
    soft_prompted = torch.stack([torch.cat([looks_like[i, : 4 - len(r)], soft, looks_like[i, 4 - len(r):]])
                                 for i, r in enumerate(rows)])
    soft_mask = (torch.arange(6) >= 4 - torch.tensor([len(r) for r in rows])[:, None]).long()
    cases = {"ids and embeddings": (dict(input_ids=ids, inputs_embeds=looks_like), mask),
             "embeddings alone": (dict(inputs_embeds=soft_prompted), soft_mask)}
    settings = dict(do_sample=False, max_new_tokens=24, cache_implementation=cache)
    taus = []
    for case, (prompt, prompt_mask) in cases.items():
        for index in (slice(None), *[slice(i, i + 1) for i in range(len(rows))]):
            alone = {k: v[index] for k, v in prompt.items()}
            row_mask = prompt_mask[index]
            if index.stop is not None:  # a row alone, its padding cut
                start = int((row_mask[0] == 0).sum())
                alone, row_mask = {k: v[:, start:] for k, v in alone.items()}, row_mask[:, start:]
            plain = target.generate(**alone, attention_mask=row_mask, return_dict_in_generate=True, **settings)
            if "input_ids" in alone:  # the precondition: the tokens alone would give another output
                from_ids = target.generate(alone["input_ids"], attention_mask=row_mask, **settings)
                assert not torch.equal(from_ids, plain.sequences)
            out = target.generate(**alone, attention_mask=row_mask, assistant_model=speculator, speculation=method,
                                  return_dict_in_generate=True, **settings)
            assert torch.equal(out.sequences, plain.sequences), (case, index, method)
            taus.append(out.speculation.tau)
            if index.stop is not None and cache is None:
                assert out.past_key_values.get_seq_length() == plain.past_key_values.get_seq_length()
    assert method == "dflash" or min(taus) > 1.2  # the oracle add-ons' drafts were accepted in every run
