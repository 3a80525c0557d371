"""Every unsupported or inconsistent input fails early with a message that says what to do."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import (
    GEMMA3_IMAGE,
    make_speculator,
    make_successor_target,
    make_target,
    make_vision_language_target,
    random_images,
)
from transformers import GenerationConfig, GenerationMixin, LlamaForCausalLM, StaticCache, SynthIDTextWatermarkingConfig
from transformers.generation.streamers import BaseStreamer

import hf_specdiff
from hf_specdiff import AutoSpeculator

PROMPT = torch.tensor([[4, 9, 1, 33, 7]])


@pytest.fixture
def target():
    return hf_specdiff.enable(make_target())


@pytest.fixture
def speculator(target):
    return make_speculator(target)


def generate(target, speculator, **kwargs):
    kwargs.setdefault("max_new_tokens", 5)
    return target.generate(PROMPT, assistant_model=speculator, speculation="xpress", **kwargs)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_beams=2), "beam search"),
        (dict(num_return_sequences=2, do_sample=True, streamer=BaseStreamer()),
         "num_return_sequences=2.*with a streamer"),
        (dict(use_cache=False), "needs the KV cache"),
        (dict(cache_implementation="offloaded"), "rolled back"),
        (dict(output_attentions=True, return_dict_in_generate=True), "attentions or hidden states"),
        (dict(output_hidden_states=True, return_dict_in_generate=True), "attentions or hidden states"),
        (dict(stop_strings=["x"]), "pass tokenizer"),
        (dict(speculation_type="dflash"), "not both"),
        (dict(custom_generate=lambda *a, **k: None), "remove `custom_generate`"),
        (dict(num_jacobi_passes=0), "must be >= 1"),
        (dict(num_draft_tokens=0), "offers 1 to 7 drafts"),
        (dict(num_draft_tokens=8), "offers 1 to 7 drafts"),
        (dict(prompt_lookup_num_tokens=3), "remove `prompt_lookup_num_tokens`"),
        # transformers' assisted-decoding knobs do nothing here: refused, not ignored
        (dict(num_assistant_tokens=5), "remove `num_assistant_tokens` \\(num_draft_tokens= sets"),
        (dict(assistant_confidence_threshold=0.5), "assisted decoding; remove `assistant_confidence_threshold`"),
        (dict(max_matching_ngram_size=3), "remove `max_matching_ngram_size`"),
        (dict(generation_config=GenerationConfig(num_assistant_tokens_schedule="heuristic")),
         "remove `num_assistant_tokens_schedule`"),
        (dict(assistant_tokenizer=object()), "own vocabulary; remove `assistant_tokenizer`"),
        (dict(synced_gpus=True), "synced_gpus=True keeps processes in step.*init_process_group"),
        (dict(penalty_alpha=0.6, top_k=4), "contrastive search; remove `penalty_alpha`"),
        (dict(dola_layers="high"), "DoLa decoding"),
        # constrained beam search, which transformers picks for these whatever num_beams: the words would not be forced
        (dict(force_words_ids=[[30]]), "constrained beam search; remove `force_words_ids`"),
        (dict(generation_config=GenerationConfig(force_words_ids=[[30], [31, 32]], max_new_tokens=5)),
         "constrained beam search; remove `force_words_ids`"),
        (dict(constraints=[object()]), "constrained beam search; remove `constraints`"),
        (dict(guidance_scale=1.5), "ClassifierFreeGuidance.*keeps state.*Remove `guidance_scale`"),
        (dict(watermarking_config=SynthIDTextWatermarkingConfig(keys=[3, 5, 7], ngram_len=2)),
         "SynthIDTextWatermarkLogitsProcessor.*keeps state.*Remove `watermarking_config` \\(SynthID\\)"),
        # plain generate shows these 5 tokens and reads 7 other embeddings; an output of such a pair is no one's prompt
        (dict(inputs_embeds=torch.zeros(1, 7, 64, dtype=torch.float64)),
         r"inputs_embeds \(1, 7, 64\) and input_ids \(1, 5\). Pass input_ids of the same length, or none"),
        # refused before transformers heals tokens (it would ask for a tokenizer, even one that was passed)
        (dict(token_healing=True), "speculation=... does not support token healing; remove `token_healing`"),
        (dict(prefill_chunk_size=0), "prefill_chunk_size=0: give a positive number of tokens per chunk"),
        (dict(token_healing=True, tokenizer=object()), "speculation=... does not support token healing"),
    ],
)
def test_unsupported_generate_arguments(target, speculator, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(target, speculator, **kwargs)


def test_a_bare_drafter_as_assistant_model_needs_transformers_native_path(target, speculator):
    """transformers would take the drafter for an assistant model and fail inside (it has no generation_config)."""
    with pytest.raises(ValueError, match="drafter \\(DFlashDraftModel\\).*without speculation_type='dflash'"):
        target.generate(PROMPT, assistant_model=speculator.drafter, max_new_tokens=5)


def test_stateful_processors_passed_by_the_user_are_refused(target, speculator):
    from transformers import LogitsProcessorList, SynthIDTextWatermarkLogitsProcessor

    synth_id = SynthIDTextWatermarkLogitsProcessor(ngram_len=2, keys=[3, 5, 7], sampling_table_size=256,
                                                   sampling_table_seed=0, context_history_size=64, device="cpu")
    with pytest.raises(ValueError, match="keeps state across calls.*Remove .* or the processor"):
        generate(target, speculator, logits_processor=LogitsProcessorList([synth_id]))


def test_harmless_values_of_refused_options_pass(target, speculator):
    """guidance_scale=1 is no guidance, and penalty_alpha without top_k > 1 is not contrastive search. A generation
    config that transformers already filled with its defaults (num_assistant_tokens=20, ...; a pipeline passes such
    a one) asks for no assisted decoding."""
    plain = target.generate(PROMPT, max_new_tokens=5, do_sample=False)
    prepared, _ = target._prepare_generation_config(GenerationConfig(do_sample=False, max_new_tokens=5))
    assert prepared.num_assistant_tokens is not None
    for kwargs in (dict(guidance_scale=1.0), dict(penalty_alpha=0.6, top_k=1), dict(generation_config=prepared)):
        assert torch.equal(generate(target, speculator, do_sample=False, **kwargs), plain), kwargs


def test_static_cache_limits(target, speculator, monkeypatch):
    batch = torch.cat([PROMPT, PROMPT])
    static_batch = dict(assistant_model=speculator, speculation="xpress", cache_implementation="static",
                        max_new_tokens=5, do_sample=False)
    assert torch.equal(target.generate(batch, **static_batch),  # a full-attention target: batches are fine
                       target.generate(batch, max_new_tokens=5, do_sample=False))
    # a batch's static cache would count windows in slots, not in each row's tokens
    with monkeypatch.context() as patched:
        patched.setattr(hf_specdiff.generation, "_attention_types",
                        lambda config: {"sliding_attention", "full_attention"})
        with pytest.raises(ValueError, match=r"'static' and a batch of 2 handles full-attention models; "
                                             r"this model also has \['sliding_attention'\] layers \(a batch's "
                                             r"static cache would count their windows in cache slots"):
            target.generate(batch, **static_batch)
    cache = StaticCache(config=target.config, max_cache_len=64)
    with pytest.raises(ValueError, match="cache_implementation='static' instead"):
        generate(target, speculator, past_key_values=cache)
    # layer types as a HY v4 declares them: attention over indexed keys is neither full, windowed nor chunked
    monkeypatch.setattr(hf_specdiff.generation, "_attention_types", lambda config: {"indexed_attention"})
    with pytest.raises(ValueError, match=r"chunked attention; this model also has \['indexed_"):
        generate(target, speculator, cache_implementation="static")


def test_a_cache_that_cannot_be_rolled_back_is_refused(target, speculator):
    from transformers import QuantizedCache

    try:
        cache = QuantizedCache(backend="fp8", config=target.config)
    except (ValueError, ImportError, TypeError) as error:  # transformers < 5.24 has no fp8 backend
        pytest.skip(f"no QuantizedCache without a quantization package here: {error}")
    with pytest.raises(ValueError, match="a QuantizedCache cannot be rolled back. Pass no cache"):
        generate(target, speculator, past_key_values=cache)


def test_what_a_prefilled_cache_cannot_continue_is_refused(target, speculator):
    """A cache passed in pre-filled continues a single prompt of token ids that extends what it holds."""
    import copy

    from transformers import DynamicCache

    from hf_specdiff import _compat

    with torch.no_grad():
        prefix = target(PROMPT[:, :3], **_compat.cache_kwargs(target, DynamicCache(config=target.config)))
    prefix = getattr(prefix, _compat.generate_output_cache_field())

    def prefilled(prompt, **kwargs):
        return target.generate(prompt, assistant_model=speculator, speculation="xpress", max_new_tokens=5,
                               **_compat.cache_kwargs(target, copy.deepcopy(prefix)), **kwargs)

    with pytest.raises(ValueError, match="single prompt; got a batch of 2 with a cache holding 3 tokens"):
        prefilled(PROMPT.repeat(2, 1))
    with pytest.raises(ValueError, match="holding 3 tokens and a prompt of 3: pass the whole prompt"):
        prefilled(PROMPT[:, :3])
    with pytest.raises(ValueError, match="prompt of token ids only; remove prefill_chunk_size"):
        prefilled(PROMPT, prefill_chunk_size=2)
    assert torch.equal(prefilled(PROMPT), generate(target, speculator))  # what it continues
    # a model placing tokens at 3D (M-RoPE) positions, which images in a cached prefix the loop did not hand back
    # would have shifted by an amount it cannot know
    from test_greedy import make_mrope_vision_language_target

    vision_language = make_mrope_vision_language_target("qwen2_vl")
    with torch.no_grad():
        prefix = vision_language(PROMPT[:, :3], **_compat.cache_kwargs(vision_language, DynamicCache()))
    with pytest.raises(ValueError, match="pre-filled cache it did not hand back, and Qwen2VLForConditionalGeneration "
                                         "places tokens at 3D .M-RoPE. positions"):
        vision_language.generate(PROMPT, assistant_model=AutoSpeculator.from_target(vision_language, block_size=8),
                                 speculation="xpress", max_new_tokens=4,
                                 **_compat.cache_kwargs(vision_language,
                                                        getattr(prefix, _compat.generate_output_cache_field())))


def test_right_padded_prompt(target, speculator):
    # left padding is fine (tests/test_batched.py); padding after the prompt is refused
    with pytest.raises(ValueError, match="LEFT-padded"):
        generate(target, speculator, attention_mask=torch.tensor([[1, 1, 1, 1, 0]]))


def test_unknown_method(target, speculator):
    with pytest.raises(ValueError, match="choose one of"):
        target.generate(PROMPT, assistant_model=speculator, speculation="medusa")


def test_spiffy_asked_of_a_causal_lm_points_to_the_diffusion_lms(target, speculator):
    with pytest.raises(ValueError, match="Spiffy, for masked diffusion LMs: load one with hf_specdiff.AutoDiffusionLM"):
        target.generate(PROMPT, assistant_model=speculator, speculation="spiffy")


def test_assistant_must_be_a_speculator(target):
    with pytest.raises(TypeError, match="AutoSpeculator.from_pretrained"):
        target.generate(PROMPT, assistant_model=make_target(), speculation="dflash")
    with pytest.raises(TypeError, match="got None"):
        target.generate(PROMPT, speculation="dflash")


def test_speculator_without_speculation_argument(target, speculator):
    with pytest.raises(ValueError, match="without `speculation`"):
        target.generate(PROMPT, assistant_model=speculator)


def test_speculator_on_a_model_that_was_not_enabled(speculator):
    plain_model = make_target()
    with pytest.raises(TypeError, match=r"hf_specdiff.enable\(model\)"):
        plain_model.generate(PROMPT, assistant_model=speculator, max_new_tokens=4)
    # transformers itself rejects the unknown `speculation` argument before any hook of ours can run
    with pytest.raises(ValueError, match="speculation"):
        plain_model.generate(PROMPT, assistant_model=speculator, speculation="xpress", max_new_tokens=4)


def test_missing_add_ons(target):
    bare = hf_specdiff.Speculator(make_speculator(target).drafter)
    with pytest.raises(ValueError, match="needs an xPress refiner"):
        target.generate(PROMPT, assistant_model=bare, speculation="xpress")
    with pytest.raises(ValueError, match="needs a Markov head"):
        target.generate(PROMPT, assistant_model=bare, speculation="markov")


@pytest.mark.parametrize(
    "other,message",
    [
        (dict(hidden_size=32), "hidden size 32"),
        (dict(vocab_size=80), "vocabulary size 80"),
        (dict(num_layers=5), "number of target layers 5"),
    ],
)
def test_speculator_built_for_another_target(target, other, message):
    other_target = make_target(**other)
    speculator = make_speculator(other_target)
    with pytest.raises(ValueError, match=f"built for {message}.*target has"):
        target.generate(PROMPT, assistant_model=speculator, speculation="dflash")
    with pytest.raises(ValueError, match=f"built for {message}.*target has"):  # transformers' native path too
        target.generate(PROMPT, assistant_model=speculator, speculation_type="dflash", max_new_tokens=4)


def test_bad_layer_ids_and_mask_token(target):
    speculator = AutoSpeculator.from_target(target, target_layer_ids=[0, 7], num_draft_layers=1, seed=0)
    speculator.drafter.config.num_target_layers = None
    speculator.to(torch.float64)
    with pytest.raises(ValueError, match=r"reads target layers \[7\]"):
        target.generate(PROMPT, assistant_model=speculator, speculation="dflash")
    speculator = make_speculator(target)
    speculator.drafter.config.dflash_config["mask_token_id"] = 10_000
    with pytest.raises(ValueError, match="mask token id 10000"):
        target.generate(PROMPT, assistant_model=speculator, speculation="dflash")


def test_beam_search_on_the_native_dflash_path_is_refused(target, speculator):
    """transformers' own path would only warn and decode greedily."""
    with pytest.raises(ValueError, match="native dFlash path .* does not do beam search: set num_beams=1"):
        target.generate(PROMPT, assistant_model=speculator, speculation_type="dflash", max_new_tokens=4, num_beams=2)


@pytest.mark.parametrize("family", ["bloom", "mamba"])
def test_native_dflash_path_on_a_target_without_position_ids_is_refused(family):
    """transformers' native dFlash generator reads the target's position ids, which `generate` makes only for a
    forward that takes them: on BLOOM (every version) and on Mamba (transformers 5.25 stopped refusing stateful
    targets there) it failed with KeyError: 'position_ids' inside transformers. Our own loop decodes them."""
    from conftest import make_state_target
    from transformers import BloomConfig, BloomForCausalLM

    from hf_specdiff import _compat

    if family == "bloom":
        target = hf_specdiff.enable(make_target(config_class=BloomConfig, model_class=BloomForCausalLM, n_head=4))
    else:
        target = make_state_target(family)
    speculator = make_speculator(target)
    for assistant in (speculator, speculator.drafter):
        with pytest.raises(ValueError, match="native dFlash path .* forward takes none.*speculation= one of"):
            target.generate(PROMPT, assistant_model=assistant, speculation_type="dflash", max_new_tokens=4)
    if family == "mamba" and not _compat.recurrent_rollback_supported():
        return  # (our loop refuses recurrent targets before 5.25, with its own message)
    plain = target.generate(PROMPT, do_sample=False, max_new_tokens=8)
    ours = target.generate(PROMPT, assistant_model=speculator, speculation="dflash", do_sample=False,
                           max_new_tokens=8)
    assert torch.equal(ours, plain)


UNROLLABLE_STATE_FAMILIES = {  # a recurrent state that no roll-back of the cache reaches
    "recurrent_gemma": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", dict(
        block_types=["recurrent", "attention"], lru_width=64, attention_window_size=16, num_layers=2)),
    "zamba": ("ZambaConfig", "ZambaForCausalLM", dict(
        num_layers=4, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, n_mamba_heads=1)),
    # Zaya keeps one RoPE set per layer type, "hybrid" and "hybrid_sliding": the drafter takes the "hybrid" set
    "zaya": ("ZayaConfig", "ZayaForCausalLM", dict(
        layer_types=["hybrid", "hybrid_sliding", "hybrid"], sliding_window=4, num_layers=3, head_dim=16,
        moe_intermediate_size=32, num_experts=2, router_hidden_size=16, experts_implementation="eager")),
}


@pytest.mark.parametrize("family", sorted(UNROLLABLE_STATE_FAMILIES))
def test_native_dflash_path_on_a_target_whose_state_cannot_roll_back_is_refused(family):
    """transformers 5.25's native dFlash path no longer refuses stateful targets, and failed inside transformers on
    these (RecurrentGemma: AttributeError, its forward returns no cache; Zamba and Zaya: IndexError, their cache holds
    no state per token to roll back to). Refused before `generate` starts, on every version; our own loop refuses them
    after the prompt."""
    import transformers

    config_name, model_name, fields = UNROLLABLE_STATE_FAMILIES[family]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    target = hf_specdiff.enable(make_target(
        initializer_range=0.2, config_class=getattr(transformers, config_name),
        model_class=getattr(transformers, model_name), **fields))
    speculator = make_speculator(target)
    if family == "zaya":
        assert speculator.drafter.config.rope_parameters == target.config.rope_parameters["hybrid"]
    for assistant in (speculator, speculator.drafter):
        with pytest.raises(ValueError, match=r"native dFlash path .* rolls .* back.*Generate without the speculator"):
            target.generate(PROMPT, assistant_model=assistant, speculation_type="dflash", max_new_tokens=4)
    with pytest.raises(ValueError, match="keeps nothing there|per-token history|rolls back from version 5.25 on"):
        target.generate(PROMPT, assistant_model=speculator, speculation="dflash", max_new_tokens=8)


def test_wrong_dtype(target, speculator):
    speculator.to(torch.float32)
    with pytest.raises(ValueError, match="float32 and the target in torch.float64"):
        target.generate(PROMPT, assistant_model=speculator, speculation="dflash")
    with pytest.raises(ValueError, match="float32 and the target in torch.float64"):
        target.generate(PROMPT, assistant_model=speculator, speculation_type="dflash", max_new_tokens=4)


def test_parts_in_different_dtypes(target, speculator):
    """A refiner left behind when the drafter was cast would fail inside a matmul; it is named before any work."""
    speculator.refiner.to(torch.float32)
    with pytest.raises(ValueError, match="parts are on different devices or dtypes.*speculator.to"):
        target.generate(PROMPT, assistant_model=speculator, speculation="xpress")


def test_enable_rejects_what_it_cannot_serve():
    with pytest.raises(TypeError, match="causal LM"):
        hf_specdiff.enable(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="causal LM"):
        hf_specdiff.enable(make_target().model)  # the decoder without its language-model head


def test_a_peft_wrapped_target_is_enabled_through_its_base_model():
    """A LoRA-tuned target: enabling the wrapper says to enable the base model; done so, the wrapper's own generate
    speculates, and its output is the wrapper's plain greedy output (LoRA included)."""
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(make_target(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False)).eval()
    with pytest.raises(TypeError, match=r"hf_specdiff.enable\(model.get_base_model\(\)\)"):
        hf_specdiff.enable(wrapped)
    plain = wrapped.generate(input_ids=PROMPT, max_new_tokens=12, do_sample=False)
    base = hf_specdiff.enable(wrapped.get_base_model())
    out = wrapped.generate(input_ids=PROMPT, max_new_tokens=12, do_sample=False, assistant_model=make_speculator(base),
                           speculation="xpress", return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain) and out.speculation.target_forwards > 1


@pytest.mark.parametrize("config_name", ["PromptTuningConfig", "PrefixTuningConfig"])
def test_peft_prompt_learning_is_refused_not_dropped(config_name):
    """PEFT's prompt learning adds its virtual tokens (or prefix K/V) in prepare_inputs_for_generation, which the loop
    does not call: refused, where it used to return the base model's output without a word."""
    import peft

    base = make_target()
    wrapped = peft.get_peft_model(base, getattr(peft, config_name)(task_type="CAUSAL_LM", num_virtual_tokens=4)).eval()
    hf_specdiff.enable(wrapped.get_base_model())
    with pytest.raises(ValueError, match=r"this PEFT model's (PROMPT|PREFIX)_TUNING adds its virtual tokens .*in "
                                         r"prepare_inputs_for_generation.*output would be the base model's"):
        wrapped.generate(input_ids=PROMPT, max_new_tokens=5, do_sample=False, assistant_model=make_speculator(base),
                         speculation="xpress")


def test_an_activated_lora_in_use_is_refused():
    """aLoRA applies its weights to a fixed number of each forward's last tokens (those after its invocation in the
    prompt): every one-token decoding step gets them, a verify forward's first tokens would not. It gave other tokens
    than plain generate without a word; refused now where it is in use: active, or named for a row of a mixed-adapter
    batch. Loaded beside the active plain LoRA, it changes nothing, and the speculative output is plain generate's."""
    import peft

    base = make_successor_target()
    modules = ["q_proj", "v_proj", "o_proj", "down_proj"]
    wrapped = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=modules,
                                                        init_lora_weights=False), adapter_name="plain")
    wrapped.add_adapter("activated", peft.LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=modules,
                                                     init_lora_weights=False, alora_invocation_tokens=[7, 2]))
    wrapped.eval()
    hf_specdiff.enable(wrapped.get_base_model())
    speculator = make_speculator(base, oracle=True)
    prompts = torch.tensor([[5, 9, 3, 7, 2, 11], [4, 9, 3, 7, 2, 11]])
    options = dict(max_new_tokens=8, do_sample=False, assistant_model=speculator, speculation="xpress")
    refusal = r"activated LoRA adapter 'activated' \(alora_invocation_tokens\)"
    plain = wrapped.generate(input_ids=prompts[:1], max_new_tokens=8, do_sample=False)
    assert torch.equal(wrapped.generate(input_ids=prompts[:1], **options), plain)
    with pytest.raises(ValueError, match=refusal):
        wrapped.generate(input_ids=prompts, adapter_names=["plain", "activated"], **options)
    wrapped.set_adapter("activated")
    with pytest.raises(ValueError, match=refusal):
        wrapped.generate(input_ids=prompts[:1], **options)


def test_a_replaced_prepare_inputs_for_generation_is_refused(target, speculator):
    """Whatever a replacement set on the model adds to the forward's inputs, the loop would drop it."""
    original = target.prepare_inputs_for_generation

    def with_extra_input(*args, **kwargs):
        return {**original(*args, **kwargs), "extra": 1}

    target.prepare_inputs_for_generation = with_extra_input
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.prepare_inputs_for_generation was replaced on this model "
                                         r"\(by '.*with_extra_input'\).*del model.prepare_inputs_for_generation"):
        generate(target, speculator)
    target.prepare_inputs_for_generation = original  # the class's own, bound on the instance (as PEFT leaves it)
    assert torch.equal(generate(target, speculator, do_sample=False),
                       target.generate(PROMPT, max_new_tokens=5, do_sample=False))


def test_enabling_a_torch_compiled_model_says_to_enable_the_model_it_wraps(speculator):
    """`torch.compile(model)` returns a wrapper that is no PreTrainedModel: the error says what to enable instead, and
    done so, the wrapper's generate speculates losslessly."""
    compiled = torch.compile(make_target())
    with pytest.raises(TypeError, match=r"got OptimizedModule\. .*hf_specdiff\.enable\(compiled\._orig_mod\)"):
        hf_specdiff.enable(compiled)
    hf_specdiff.enable(compiled._orig_mod)
    plain = compiled.generate(PROMPT, max_new_tokens=12, do_sample=False)
    out = compiled.generate(PROMPT, max_new_tokens=12, do_sample=False, assistant_model=speculator,
                            speculation="xpress", return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain) and out.speculation.target_forwards > 1


def test_from_target_rejects_unsupported_architectures():
    from transformers import RwkvConfig, RwkvForCausalLM

    target = RwkvForCausalLM(RwkvConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                                        intermediate_size=64))
    with pytest.raises(ValueError, match="has no `num_attention_heads` in its config: .* width, heads and depth"):
        AutoSpeculator.from_target(target)


@pytest.mark.parametrize("family", ["rwkv", "openai-gpt"])
def test_a_target_that_keeps_no_cache_is_refused(family):
    """RWKV keeps its state in an output of its own and GPT-1 keeps nothing: both take a cache and ignore it, so after
    the prompt the loop would feed only the new tokens, read with no context (RWKV's output differed from plain greedy
    on every prompt before this refusal)."""
    import transformers

    torch.manual_seed(0)
    if family == "rwkv":
        target = transformers.RwkvForCausalLM(transformers.RwkvConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64,
            num_attention_heads=4))  # (RWKV has no heads: from_target reads the field for the drafter)
    else:
        target = transformers.OpenAIGPTLMHeadModel(transformers.OpenAIGPTConfig(
            vocab_size=64, n_embd=32, n_layer=2, n_head=2))
    target = hf_specdiff.enable(target.eval())
    speculator = make_speculator(target)
    with pytest.raises(ValueError, match=f"{type(target).__name__} keeps nothing there .* without speculation"):
        target.generate(PROMPT, max_new_tokens=5, assistant_model=speculator, speculation="dflash")


@pytest.mark.parametrize("family", ["xlm-causal", "xlm", "minimax"])
def test_targets_the_loop_cannot_drive_are_refused(family):
    """XLM's forward takes every token so far and drops as many as its cache holds (fed only a verify block, it failed
    inside its attention); MiniMax keeps its lightning-attention state in its own cache, which cannot crop (it failed
    at the first forward, refusing the loop's cache). Both are refused before any work."""
    import transformers

    torch.manual_seed(0)
    if family.startswith("xlm"):
        target = transformers.XLMWithLMHeadModel(transformers.XLMConfig(
            vocab_size=64, emb_dim=32, n_layers=2, n_heads=2, causal=family == "xlm-causal", pad_index=2))
    else:
        target = transformers.MiniMaxForCausalLM(transformers.MiniMaxConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, layer_types=["linear_attention", "full_attention"],
            num_local_experts=2, num_experts_per_tok=1))
    target = hf_specdiff.enable(target.eval())
    speculator = make_speculator(target)
    with pytest.raises(ValueError, match=f"{type(target).__name__} (takes|keeps) .* without speculation"):
        target.generate(PROMPT, max_new_tokens=5, assistant_model=speculator, speculation="dflash")


def test_a_prompt_with_an_image_refuses_a_chunked_prefill():
    """A prompt with an image is read in one forward (the image's soft tokens attend both ways, and its features go
    where its tokens are): prefill_chunk_size is refused with it, not applied to part of the prompt."""
    target = make_vision_language_target()
    speculator = AutoSpeculator.from_target(target, block_size=8, num_draft_layers=2, seed=1)
    prompt = torch.tensor([[2, 5, *GEMMA3_IMAGE, 17]])
    with pytest.raises(ValueError, match="prompt with images .* in one forward: remove prefill_chunk_size"):
        target.generate(prompt, max_new_tokens=4, assistant_model=speculator, speculation="xpress",
                        prefill_chunk_size=4, pixel_values=random_images(1))


def test_mllama_is_refused_with_what_it_skips():
    """Llama 3.2 Vision (Mllama): its embedding table has 8 rows past its lm_head's, and from_target builds a drafter
    reading out over the lm_head's (it built one over the embedding's, which the target then refused). Its forward
    skips its cross-attention layers on a prompt without images, so fewer hidden states than layers come back: refused
    by name (it failed with an IndexError); a prompt with images, whose cross-attention mask every step reads, too."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    torch.manual_seed(0)
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, cross_attention_layers=[1], pad_token_id=0, bos_token_id=2, eos_token_id=None)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                  image_size=28, patch_size=14, max_num_tiles=1, intermediate_layers_indices=[0],
                  vision_output_dim=64, supported_aspect_ratios=[[1, 1]])
    config = MllamaConfig(text_config=text, vision_config=vision, image_token_index=299)
    target = hf_specdiff.enable(MllamaForConditionalGeneration(config).double().eval())
    speculator = AutoSpeculator.from_target(target, block_size=8, num_draft_layers=2, seed=1)
    assert speculator.drafter.config.vocab_size == 300 and speculator.drafter.config.mask_token_id == 307
    prompt = torch.tensor([[2, 299, 5, 17, 40]])
    with pytest.raises(ValueError, match="returned 2 hidden states, not its embeddings' and one per layer \\(3\\)"):
        target.generate(prompt[:, 2:], max_new_tokens=4, assistant_model=speculator, speculation="xpress")
    image = dict(pixel_values=torch.randn(1, 1, 1, 3, 28, 28, dtype=torch.float64),
                 aspect_ratio_ids=torch.tensor([[1]]), aspect_ratio_mask=torch.ones(1, 1, 1, dtype=torch.long),
                 cross_attention_mask=torch.ones(1, 5, 1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="cross_attention_mask.*if the model reads them beside its images, generate "
                                         "without speculation"):
        target.generate(prompt, max_new_tokens=4, assistant_model=speculator, speculation="xpress", **image)


def test_a_bert_lm_head_built_as_an_encoder_is_refused():
    """BertLMHeadModel (and RoBERTa, XLM-R, ... heads) attend both ways unless their config says is_decoder=True: a
    draft changes the logits of the tokens before it (its output differed from plain greedy on every prompt before
    this refusal). Built as a decoder it is an ordinary causal LM and speculates losslessly."""
    from transformers import BertConfig, BertLMHeadModel

    for is_decoder in (False, True):
        torch.manual_seed(0)
        config = BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, is_decoder=is_decoder, pad_token_id=0)
        target = hf_specdiff.enable(BertLMHeadModel(config).eval())
        speculator = make_speculator(target)
        kwargs = dict(max_new_tokens=8, do_sample=False)
        if not is_decoder:
            with pytest.raises(ValueError, match=r"built as an encoder .*from_pretrained\(path, is_decoder=True\)"):
                target.generate(PROMPT, assistant_model=speculator, speculation="xpress", **kwargs)
        else:
            out = target.generate(PROMPT, assistant_model=speculator, speculation="xpress", **kwargs)
            assert torch.equal(out, target.generate(PROMPT, **kwargs))


def test_the_drafter_takes_the_targets_full_attention_rope():
    from types import SimpleNamespace

    from hf_specdiff.dflash import full_attention_rope_parameters

    sliding, full = ({"rope_type": "default", "rope_theta": 1e4},
                     {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0})
    assert full_attention_rope_parameters(SimpleNamespace(rope_parameters=full)) == full
    per_type = SimpleNamespace(rope_parameters={"sliding_attention": sliding, "full_attention": full})  # Gemma 3
    assert full_attention_rope_parameters(per_type) == full
    # full-attention layers without RoPE list None: the one set there is
    no_pe = SimpleNamespace(rope_parameters={"sliding_attention": sliding, "full_attention": None})
    assert full_attention_rope_parameters(no_pe) == sliding
    with pytest.raises(ValueError, match="name no `rope_type`"):
        full_attention_rope_parameters(SimpleNamespace(rope_parameters={"sliding_attention": sliding, "chunked": full}))


def test_a_target_with_a_factorised_embedding_is_refused():
    """ELECTRA's token embeddings are narrower than its hidden states; the drafter needs them as wide (it crashed
    inside its first draft)."""
    from transformers import ElectraConfig, ElectraForCausalLM

    target = ElectraForCausalLM(ElectraConfig(vocab_size=64, embedding_size=16, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=2, is_decoder=True))
    with pytest.raises(ValueError, match="embeddings are 16 wide and its hidden states 32"):
        AutoSpeculator.from_target(target)
    speculator = make_speculator(make_target(vocab_size=64, hidden_size=32, num_layers=2))  # built for another model
    with pytest.raises(ValueError, match="embeddings are 16 wide and its hidden states 32"):
        speculator.check_compatible(hf_specdiff.enable(target))


def test_configs_validate_their_fields():
    with pytest.raises(ValueError, match="block_size"):
        hf_specdiff.XPressConfig(block_size=1)
    with pytest.raises(ValueError, match="rank"):
        hf_specdiff.XPressConfig(rank=0)
    with pytest.raises(ValueError, match="block_size"):
        hf_specdiff.DFlashConfig(block_size=1, dflash_config={"mask_token_id": 0, "target_layer_ids": [0]})


def test_enable_is_per_model_and_reversible():
    enabled, untouched = make_target(), make_target()
    original = LlamaForCausalLM.generate
    hf_specdiff.enable(enabled)
    assert hf_specdiff.is_enabled(enabled) and not hf_specdiff.is_enabled(untouched)
    assert LlamaForCausalLM.generate is original and GenerationMixin.generate is original
    plain = untouched.generate(PROMPT, do_sample=False, max_new_tokens=5)
    assert torch.equal(enabled.generate(PROMPT, do_sample=False, max_new_tokens=5), plain)
    hf_specdiff.disable(enabled)
    assert not hf_specdiff.is_enabled(enabled) and "generate" not in vars(enabled)
    # what README tells a user who forgot enable(): transformers' own generate names the argument it does not take
    with pytest.raises(ValueError, match=r"not used by the model: \['speculation'\]"):
        enabled.generate(PROMPT, assistant_model=make_speculator(enabled), speculation="xpress", max_new_tokens=5)


def test_an_enabled_model_survives_pickling_and_copies_stay_enabled(target, speculator):
    """torch.save of a whole model, multiprocessing and deepcopy pickle or copy its `generate` with it; a copy is
    enabled and its generate runs the copy (before: the file was written, then loading it failed)."""
    import copy
    import inspect
    import io

    hf_specdiff.enable(target)
    plain = target.generate(PROMPT, do_sample=False, max_new_tokens=12)
    buffer = io.BytesIO()
    torch.save(target, buffer)
    buffer.seek(0)
    for twin in (torch.load(buffer, weights_only=False), copy.deepcopy(target)):
        assert hf_specdiff.is_enabled(twin) and twin.generate.__self__ is twin
        assert torch.equal(twin.generate(PROMPT, assistant_model=speculator, speculation="xpress", max_new_tokens=12),
                           plain)
        with torch.no_grad():
            twin.lm_head.weight.zero_()  # a generate bound to the original would not see this
        assert not torch.equal(twin.generate(PROMPT, do_sample=False, max_new_tokens=12), plain)
    # what users read off a bound method: the parameters a call takes (no `self`), the name and docstring
    assert list(inspect.signature(target.generate).parameters)[:2] == ["args", "speculation"]
    assert target.generate.__doc__ and target.generate.__name__ == "_speculative_generate"


def test_speculation_state_is_not_parked_on_the_model(target, speculator):
    before = set(vars(target)) | {k for k in vars(target.config)}
    target.generate(PROMPT, assistant_model=speculator, speculation="xpress", max_new_tokens=12)
    assert set(vars(target)) | {k for k in vars(target.config)} == before


def test_stats_fields_are_documented_in_to_dict():
    stats = hf_specdiff.SpeculationStats("xpress")
    fields = {f.name for f in dataclasses.fields(stats)}
    assert fields <= set(stats.to_dict())


def test_an_offloaded_or_meta_target_is_refused_with_what_to_keep_in_memory(target, speculator):
    """accelerate's offload keeps the token embeddings on the meta device and loads them inside the forward; the
    drafter reads them directly, so speculation (and `from_target`) refuse it and say what to keep in memory. Plain
    `generate` still works on the offloaded target, and offloading only the body stays lossless."""
    import accelerate

    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=12)
    offloaded = hf_specdiff.enable(accelerate.cpu_offload(make_target(), execution_device="cpu"))
    assert torch.equal(offloaded.generate(PROMPT, do_sample=False, max_new_tokens=12), expected)
    with pytest.raises(ValueError, match="token embeddings are not in memory.*embed_tokens.*lm_head"):
        generate(offloaded, speculator)
    with pytest.raises(ValueError, match="token embeddings are not in memory"):
        AutoSpeculator.from_target(offloaded)
    body_offloaded = make_target()
    for layer in body_offloaded.model.layers:
        accelerate.cpu_offload(layer, execution_device="cpu")
    out = hf_specdiff.enable(body_offloaded).generate(PROMPT, do_sample=False, max_new_tokens=12,
                                                       assistant_model=speculator, speculation="xpress")
    assert torch.equal(out, expected)


def test_a_speculator_without_weights_is_refused_with_how_to_load_it(target, speculator):
    """A speculator on the meta device cannot be moved (`.to()` has no data to copy): say how to load it instead."""
    with pytest.raises(ValueError, match=r"no weights .*meta.*from_pretrained\(path, device='cpu'\)"):
        generate(target, speculator.to("meta"))


@pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning")
def test_torch_ao_quantized_layers_are_refused(target):
    """Dynamic quantisation scales activations over a forward's tokens: a verify forward would compute other logits
    than one-token decoding, so a quantised target is refused (not silently inexact), and so is a quantised
    speculator (its layers have no weight tensors)."""
    # deprecated in torch (removal announced) yet users still call it; where it is gone, there is nothing to refuse
    quantize_dynamic = pytest.importorskip("torch.ao.quantization").quantize_dynamic
    speculator = make_speculator(target)
    body_quantized = make_target()
    body_quantized.model = quantize_dynamic(body_quantized.model, {torch.nn.Linear}, dtype=torch.qint8)
    with pytest.raises(ValueError, match=r"target's model\.layers\.0\..* torch\.ao quantized module.*differ"):
        generate(hf_specdiff.enable(body_quantized), speculator)
    quantized_speculator = quantize_dynamic(make_speculator(target), {torch.nn.Linear}, dtype=torch.qint8)
    with pytest.raises(ValueError, match=r"speculator's drafter\..* torch\.ao quantized module"):
        generate(target, quantized_speculator)
