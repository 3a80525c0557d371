"""DiffusionLM against independent references, in float64 on tiny checkpoints written by hand in the published
layouts: LLaDA (GSAI-ML remote code names) against transformers' Llama, Dream against Qwen2, SDAR against Qwen3, a
Llama-layout model against Llama. Also the K/V context contract, save/load round trips and error paths."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from hf_specdiff.diffusion import AutoDiffusionLM, DiffusionLM
from hf_specdiff.diffusion.modeling import _config_from_published

V, H, FF, L, HEADS, KV, D = 64, 32, 48, 2, 4, 2, 8  # vocab, hidden, intermediate, layers, heads, kv heads, head_dim
N = 12  # sequence length in the tests; blocks of 4


# ----------------------------------------------------------------------------------------------------------------
# Published layouts, spelled out: config.json keys and parameter names as the released checkpoints have them
# ----------------------------------------------------------------------------------------------------------------


def llada_checkpoint(tied=False):
    config = {
        "model_type": "llada", "architectures": ["LLaDAModelLM"],
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM"},
        "d_model": H, "n_heads": HEADS, "n_kv_heads": KV, "n_layers": L, "mlp_hidden_size": FF, "mlp_ratio": 4,
        "vocab_size": V - 4, "embedding_size": V,  # padded embedding rows, as LLaDA pads to a multiple of 128
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "weight_tying": tied, "include_bias": False,
        "include_qkv_bias": False, "block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms",
        "rope": True, "rope_full_precision": True, "alibi": False, "attention_layer_norm": False,
        "input_emb_norm": False, "scale_logits": False, "layer_norm_with_affine": True, "bias_for_layer_norm": False,
        "mask_token_id": 59, "eos_token_id": 58, "pad_token_id": 58, "max_sequence_length": 4096, "use_cache": False,
    }
    shapes = {"model.transformer.wte.weight": (V, H), "model.transformer.ln_f.weight": (H,)}
    if not tied:
        shapes["model.transformer.ff_out.weight"] = (V, H)
    for i in range(L):
        b = f"model.transformer.blocks.{i}."
        shapes.update({
            b + "attn_norm.weight": (H,), b + "q_proj.weight": (HEADS * D, H), b + "k_proj.weight": (KV * D, H),
            b + "v_proj.weight": (KV * D, H), b + "attn_out.weight": (H, HEADS * D), b + "ff_norm.weight": (H,),
            b + "ff_proj.weight": (FF, H), b + "up_proj.weight": (FF, H), b + "ff_out.weight": (H, FF),
        })
    return config, shapes


def qwen_like_shapes(qkv_bias=False, qk_norm=False, lm_head=True):
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if lm_head:
        shapes["lm_head.weight"] = (V, H)
    for i in range(L):
        b = f"model.layers.{i}."
        shapes.update({
            b + "input_layernorm.weight": (H,), b + "post_attention_layernorm.weight": (H,),
            b + "self_attn.q_proj.weight": (HEADS * D, H), b + "self_attn.k_proj.weight": (KV * D, H),
            b + "self_attn.v_proj.weight": (KV * D, H), b + "self_attn.o_proj.weight": (H, HEADS * D),
            b + "mlp.gate_proj.weight": (FF, H), b + "mlp.up_proj.weight": (FF, H), b + "mlp.down_proj.weight": (H, FF),
        })
        if qkv_bias:
            shapes.update({b + "self_attn.q_proj.bias": (HEADS * D,), b + "self_attn.k_proj.bias": (KV * D,),
                           b + "self_attn.v_proj.bias": (KV * D,)})
        if qk_norm:
            shapes.update({b + "self_attn.q_norm.weight": (D,), b + "self_attn.k_norm.weight": (D,)})
    return shapes


QWEN_SIZES = {"vocab_size": V, "hidden_size": H, "intermediate_size": FF, "num_hidden_layers": L,
              "num_attention_heads": HEADS, "num_key_value_heads": KV, "hidden_act": "silu", "rms_norm_eps": 1e-6,
              "max_position_embeddings": 4096, "tie_word_embeddings": False}


def dream_checkpoint():
    config = {**QWEN_SIZES, "model_type": "Dream", "architectures": ["DreamModel"], "rope_theta": 1000000.0,
              "rope_scaling": None, "use_sliding_window": False, "sliding_window": None, "mask_token_id": 60,
              "pad_token_id": 61, "bos_token_id": 61, "eos_token_id": 61, "torch_dtype": "bfloat16",
              "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"}}
    return config, qwen_like_shapes(qkv_bias=True)


def sdar_checkpoint():
    config = {**QWEN_SIZES, "model_type": "sdar", "architectures": ["SDARForCausalLM"], "head_dim": D,
              "rope_theta": 1000000, "rope_scaling": None, "attention_bias": False, "use_sliding_window": False,
              "sliding_window": None, "block_size": 4, "mask_token_id": 60, "bos_token_id": 61, "eos_token_id": 61,
              "fuse_cross_entropy": True}
    return config, qwen_like_shapes(qk_norm=True)


def llama_checkpoint():  # SmolLM2-like: tied embeddings, so no lm_head.weight in the file
    config = {**QWEN_SIZES, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "head_dim": D,
              "rope_theta": 100000.0, "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    return config, qwen_like_shapes(lm_head=False)


CHECKPOINTS = {"llada": llada_checkpoint, "dream": dream_checkpoint, "sdar": sdar_checkpoint,
               "llama": llama_checkpoint}


def random_tensors(shapes: dict, seed=0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=generator, dtype=torch.float64)
        tensors[name] = 1 + 0.2 * noise if "norm" in name else 0.3 * noise  # norms (1D *norm.weight) near 1
    return tensors


def write_checkpoint(folder, config: dict, tensors: dict, sharded=False):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if not sharded:
        save_file(tensors, folder / "model.safetensors")
        return folder
    names = sorted(tensors)
    weight_map = {}
    for k, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{k + 1}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.fixture
def published(tmp_path):
    """published(family, **kwargs) -> (folder, config, tensors) of a tiny random checkpoint in that layout."""

    def make(family, sharded=False, seed=0, **kwargs):
        config, shapes = CHECKPOINTS[family](**kwargs)
        tensors = random_tensors(shapes, seed)
        return write_checkpoint(tmp_path / f"{family}-published", config, tensors, sharded), config, tensors

    return make


# ----------------------------------------------------------------------------------------------------------------
# Independent references: transformers' own Llama / Qwen2 / Qwen3 with the same weights under their names
# ----------------------------------------------------------------------------------------------------------------


def llada_as_llama(name: str) -> str:
    """LLaDA's names in transformers' Llama (LLaDALlamaBlock: ff_out(silu(ff_proj(x)) * up_proj(x)))."""
    top = {"model.transformer.wte.weight": "model.embed_tokens.weight", "model.transformer.ln_f.weight":
           "model.norm.weight", "model.transformer.ff_out.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    i, part = name.removeprefix("model.transformer.blocks.").split(".", 1)
    block = {"attn_norm.weight": "input_layernorm.weight", "ff_norm.weight": "post_attention_layernorm.weight",
             "q_proj.weight": "self_attn.q_proj.weight", "k_proj.weight": "self_attn.k_proj.weight",
             "v_proj.weight": "self_attn.v_proj.weight", "attn_out.weight": "self_attn.o_proj.weight",
             "ff_proj.weight": "mlp.gate_proj.weight", "up_proj.weight": "mlp.up_proj.weight",
             "ff_out.weight": "mlp.down_proj.weight"}
    return f"model.layers.{i}.{block[part]}"


def _rms_float64(module, x):
    return module.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon))


def reference(family: str, config: dict, tensors: dict, float64_norms=True):
    sizes = dict(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=L, num_attention_heads=HEADS,
                 num_key_value_heads=KV, head_dim=D, attn_implementation="sdpa")
    if family == "llada":
        ref = LlamaForCausalLM(LlamaConfig(**sizes, rope_theta=500000.0, rms_norm_eps=1e-5,
                                           tie_word_embeddings=config["weight_tying"]))
        tensors = {llada_as_llama(name): t for name, t in tensors.items()}
    elif family == "dream":
        ref = Qwen2ForCausalLM(Qwen2Config(**sizes, rope_theta=1000000.0, rms_norm_eps=1e-6))
    elif family == "sdar":
        ref = Qwen3ForCausalLM(Qwen3Config(**sizes, rope_theta=1000000.0, rms_norm_eps=1e-6))
    else:
        ref = LlamaForCausalLM(LlamaConfig(**sizes, rope_theta=100000.0, rms_norm_eps=1e-6, tie_word_embeddings=True))
    ref = ref.double().eval()  # before loading, so that the float64 weights are not rounded to float32
    missing, unexpected = ref.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if float64_norms:
        # transformers' RMSNorm computes in float32 even for float64 inputs; DiffusionLM keeps float64. Evaluate the
        # reference's norms in float64 too, so that a 1e-10 comparison tests the architecture, not that rounding.
        for module in ref.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.forward = functools.partial(_rms_float64, module)
    return ref


def full_mask(n=N, b=2):
    return torch.ones(b, 1, n, n, dtype=torch.bool)


def block_causal_mask(n=N, block=4, b=2):
    blocks = torch.arange(n) // block
    return (blocks[None, :] <= blocks[:, None]).expand(b, 1, n, n)


def inputs(seed=0, b=2, n=N):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, n), generator=generator)
    positions = torch.arange(n)[None, :] + torch.tensor([[0], [7]])[:b]  # rows start at different positions
    return ids, positions


# ----------------------------------------------------------------------------------------------------------------
# Logits against the references
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "llama"])
@pytest.mark.parametrize("mask_kind", ["full", "block_causal"])
def test_logits_match_reference(published, family, mask_kind):
    folder, config, tensors = published(family)
    model = AutoDiffusionLM.from_pretrained(folder)
    assert model.dtype == torch.float64 and model.config.family == family
    ref = reference(family, config, tensors)
    ids, positions = inputs()
    mask = full_mask() if mask_kind == "full" else block_causal_mask()
    with torch.no_grad():
        ours = model(ids, position_ids=positions, attention_mask=mask).logits
        theirs = ref(input_ids=ids, position_ids=positions, attention_mask=mask).logits
    assert ours.shape == (2, N, V)
    assert (ours - theirs).abs().max() < 1e-10
    if mask_kind == "full":  # None means fully bidirectional
        with torch.no_grad():
            assert torch.equal(model(ids, position_ids=positions).logits, ours)


def test_family_facts(published):
    expected = {"llada": (59, False, False), "dream": (60, True, False), "sdar": (60, False, True)}
    for family, (mask_id, shift, block_causal) in expected.items():
        model = AutoDiffusionLM.from_pretrained(published(family)[0])
        assert (model.mask_token_id, model.shift_logits, model.block_causal) == (mask_id, shift, block_causal)
    llada = AutoDiffusionLM.from_pretrained(published("llada")[0])
    assert llada.config.vocab_size == V and llada.config.eos_token_id == 58  # padded embedding_size kept
    # the Hub's SDAR config.json has no mask key: `<|MASK|>` is 151669 in its tokenizer
    config, _ = sdar_checkpoint()
    del config["mask_token_id"]
    assert _config_from_published("sdar", config, "test").mask_token_id == 151669
    llama = AutoDiffusionLM.from_pretrained(published("llama")[0])
    with pytest.raises(ValueError, match="no mask_token_id"):
        llama.mask_token_id


def test_from_pretrained_refuses_a_device_it_cannot_use_before_loading(published):
    """A misspelt device, or CUDA on a machine without it, is refused by name as a ValueError (which the command
    line reports in one line), not as torch's RuntimeError / AssertionError from deep in `.to(device)`."""
    folder, _, _ = published("llada")
    with pytest.raises(ValueError, match="device='gpu' is not a torch device"):
        AutoDiffusionLM.from_pretrained(folder, device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            AutoDiffusionLM.from_pretrained(folder, device="cuda")
    assert AutoDiffusionLM.from_pretrained(folder, device=torch.device("cpu")).device.type == "cpu"


def test_generate_on_a_causal_lm_checkpoint_says_it_is_no_diffusion_lm(published):
    """A plain Llama causal LM loads (for conversion), but decoding it says that it is no diffusion LM and what to
    load instead, rather than only asking for a [MASK] id that would make a causal LM decode garbage."""
    from hf_specdiff.diffusion import diffusion_generate

    llama = AutoDiffusionLM.from_pretrained(published("llama")[0])
    with pytest.raises(ValueError, match="no mask_token_id") as error:
        diffusion_generate(llama, torch.tensor([[1, 2, 3]]))
    assert "causal LM" in str(error.value) and "train-diffusion" in str(error.value)


def test_llada_weight_tying(published):
    folder, config, tensors = published("llada", tied=True)
    model = AutoDiffusionLM.from_pretrained(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ref = reference("llada", config, tensors)
    ids, positions = inputs()
    with torch.no_grad():
        diff = model(ids, position_ids=positions).logits - ref(input_ids=ids, position_ids=positions,
                                                               attention_mask=full_mask()).logits
    assert diff.abs().max() < 1e-10


def test_float32_matches_unpatched_reference(published):
    """In float32 both sides compute norms in float32: the reference runs exactly as transformers ships it."""
    folder, config, tensors = published("sdar")
    model = AutoDiffusionLM.from_pretrained(folder, dtype="float32")
    ref = reference("sdar", config, tensors, float64_norms=False).float()
    ids, positions = inputs()
    with torch.no_grad():
        ours = model(ids, position_ids=positions, attention_mask=block_causal_mask()).logits
        theirs = ref(input_ids=ids, position_ids=positions, attention_mask=block_causal_mask()).logits
    assert ours.dtype == torch.float32 and (ours - theirs).abs().max() < 1e-4
    bf16 = AutoDiffusionLM.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = bf16(ids, position_ids=positions).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_from_causal_lm():
    torch.manual_seed(0)
    causal = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=L,
                                          num_attention_heads=HEADS, num_key_value_heads=KV, tie_word_embeddings=True,
                                          rope_theta=100000.0, attn_implementation="sdpa")).double().eval()
    model = DiffusionLM.from_causal_lm(causal, mask_token_id=5, block_causal=True)
    assert (model.mask_token_id, model.shift_logits, model.block_causal) == (5, False, True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight.data_ptr() != causal.model.embed_tokens.weight.data_ptr()  # a copy
    for module in causal.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = functools.partial(_rms_float64, module)
    ids, positions = inputs()
    with torch.no_grad():
        diff = model(ids, position_ids=positions).logits - causal(input_ids=ids, position_ids=positions,
                                                                  attention_mask=full_mask()).logits
    assert diff.abs().max() < 1e-10
    with pytest.raises(ValueError, match="mask_token_id"):
        DiffusionLM.from_causal_lm(causal, mask_token_id=V)


# ----------------------------------------------------------------------------------------------------------------
# Context (K/V) contract
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_context_key_values_equal_one_forward(published, family):
    model = AutoDiffusionLM.from_pretrained(published(family)[0])
    ids, positions = inputs()
    c = 8  # two whole blocks of context: under a block-causal mask they never see the rest
    hide = block_causal_mask().clone()
    hide[1, :, c:, 2] = False  # row 1's later queries may not see context key 2 (nor does the split forward)
    hide[:, :, c:, 5] = False
    for mask in (block_causal_mask(), hide):
        with torch.no_grad():
            whole = model(ids, position_ids=positions, attention_mask=mask, return_key_values=True)
            prefix = model(ids[:, :c], position_ids=positions[:, :c], attention_mask=mask[:, :, :c, :c],
                           return_key_values=True)
            context = [(k.clone(), v.clone()) for k, v in prefix.key_values]
            rest = model(ids[:, c:], position_ids=positions[:, c:], attention_mask=mask[:, :, c:, :],
                         past_key_values=prefix.key_values, return_key_values=True)
        assert (rest.logits - whole.logits[:, c:]).abs().max() < 1e-12
        assert (prefix.logits - whole.logits[:, :c]).abs().max() < 1e-12
        assert rest.key_values[0][0].shape == (2, KV, N - c, D)  # only this forward's own tokens
        for (k, v), (k0, v0), (kw, vw) in zip(prefix.key_values, context, whole.key_values):
            assert torch.equal(k, k0) and torch.equal(v, v0)  # context is read, never modified
            assert (k - kw[:, :, :c]).abs().max() < 1e-12
    with torch.no_grad():  # default positions continue after the context
        default = model(ids[:, c:], past_key_values=prefix.key_values).logits
        explicit = model(ids[:, c:], position_ids=torch.arange(c, N).expand(2, -1),
                         past_key_values=prefix.key_values).logits
    assert torch.equal(default, explicit)
    assert model(ids, return_key_values=False).key_values is None


# ----------------------------------------------------------------------------------------------------------------
# Save / load round trips in the published layouts
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "llama"])
def test_round_trip(published, tmp_path, family):
    folder, config, tensors = published(family, sharded=family == "dream")
    model = AutoDiffusionLM.from_pretrained(folder)
    out = tmp_path / "saved"
    model.save_pretrained(out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    saved_tensors = load_file(out / "model.safetensors")
    assert saved_tensors.keys() == tensors.keys()  # the published names
    assert all(torch.equal(saved_tensors[name], tensors[name]) for name in tensors)
    saved_config = json.loads((out / "config.json").read_text())
    if family == "llama":
        assert saved_config["model_type"] == "hf_specdiff_diffusion_lm" and saved_config["family"] == "llama"
    else:
        assert {k: v for k, v in saved_config.items() if k != "torch_dtype"} == {
            k: v for k, v in config.items() if k != "torch_dtype"}
    again = AutoDiffusionLM.from_pretrained(out)
    ids, positions = inputs()
    with torch.no_grad():
        assert torch.equal(again(ids, position_ids=positions).logits, model(ids, position_ids=positions).logits)
    ignored = ("published_config", "dtype", "transformers_version")
    fields = [name for name in again.config.to_dict() if name not in ignored]
    assert all(getattr(again.config, name) == getattr(model.config, name) for name in fields)


def test_fresh_config_saves_published_layout(tmp_path):
    """A DiffusionLM built from scratch for a published family (no config.json to preserve) saves loadable files."""
    from hf_specdiff.diffusion import DiffusionLMConfig

    config = DiffusionLMConfig(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=L,
                               num_attention_heads=HEADS, num_key_value_heads=KV, family="llada", mask_token_id=3)
    model = DiffusionLM(config).double()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "llada" and saved["d_model"] == H and saved["block_type"] == "llama"
    assert "model.transformer.blocks.1.ff_proj.weight" in load_file(tmp_path / "model.safetensors")
    again = AutoDiffusionLM.from_pretrained(tmp_path)
    ids, _ = inputs()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


# ----------------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------------


def test_loading_errors(published, tmp_path):
    folder, config, tensors = published("llada")

    def variant(name, config=config, tensors=tensors):
        return write_checkpoint(tmp_path / name, config, tensors)

    with pytest.raises(ValueError, match="not a supported diffusion LM.*llada.*dream.*sdar.*FAMILIES"):
        AutoDiffusionLM.from_pretrained(variant("gpt2", config={"model_type": "gpt2"}))
    block = "model.transformer.blocks.1."
    less = {k: v for k, v in tensors.items() if k != block + "up_proj.weight"}
    with pytest.raises(ValueError, match=r"llada checkpoint.*missing weights \['model.transformer.blocks.1.up_proj"):
        AutoDiffusionLM.from_pretrained(variant("missing", tensors=less))
    with pytest.raises(ValueError, match=r"unexpected weights \['model.transformer.blocks.0.extra.weight'\]"):
        AutoDiffusionLM.from_pretrained(variant("extra", tensors={**tensors, block[:-2] + "0.extra.weight":
                                                                  torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"wrong shapes \['model.transformer.blocks.1.up_proj.weight \(48, 16\) "):
        AutoDiffusionLM.from_pretrained(variant("shape", tensors={**tensors, block + "up_proj.weight":
                                                                  torch.zeros(FF, H // 2, dtype=torch.float64)}))
    with pytest.raises(ValueError, match=r"scale_logits.*supports only"):
        AutoDiffusionLM.from_pretrained(variant("scaled", config={**config, "scale_logits": True}))
    corrupt = variant("corrupt")
    (corrupt / "config.json").write_text('{"model_type": "llada", ')
    with pytest.raises(ValueError, match="not valid JSON"):
        AutoDiffusionLM.from_pretrained(corrupt)
    with pytest.raises(OSError, match="No diffusion LM"):
        AutoDiffusionLM.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(OSError, match="No diffusion LM.*local Hub cache"):  # offline (conftest) and not cached
        AutoDiffusionLM.from_pretrained("hf-specdiff-tests/no-such-diffusion-lm")
    no_weights = variant("no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(OSError, match="no readable model.safetensors"):
        AutoDiffusionLM.from_pretrained(no_weights)
    with pytest.raises(TypeError, match="from_pretrained"):
        AutoDiffusionLM()


def test_decoding_sdar_in_blocks_of_another_size_than_it_was_trained_with_warns(published, recwarn):
    """SDAR's config.json records the block size it was trained with (4 here) and its attention is block-causal over
    the decoding's blocks: blocks of another size warn, naming the size to pass (before: silently); its own size
    decodes without the warning."""
    from hf_specdiff.diffusion import DiffusionGenerationConfig, diffusion_generate

    model = AutoDiffusionLM.from_pretrained(published("sdar")[0])
    prompt = torch.tensor([[5, 9, 2, 7]])
    with pytest.warns(UserWarning, match=r"trained with blocks of 4 tokens .* Pass block_length=4"):
        diffusion_generate(model, prompt, config=DiffusionGenerationConfig(max_new_tokens=8, block_length=8))
    diffusion_generate(model, prompt, config=DiffusionGenerationConfig(max_new_tokens=8, block_length=4))
    assert not [w for w in recwarn if "trained with blocks" in str(w.message)]
    assert AutoDiffusionLM.from_pretrained(published("llada")[0]).trained_block_length is None


def test_block_length_left_out_is_the_graphs_else_the_trained_one_else_32(published):
    """block_length None (the default of generate, bench, calibrate and demo): SDAR decodes in the blocks it was
    trained with, silently; a Spiffy graph's block length wins, as it drafts for no other; a bidirectional model
    gets 32 (before: 32 everywhere, so SDAR warned and Spiffy refused any graph not calibrated at 32)."""
    import warnings

    from hf_specdiff import enable
    from hf_specdiff.diffusion import DiffusionGenerationConfig, diffusion_generate
    from hf_specdiff.spiffy import calibrate

    sdar = AutoDiffusionLM.from_pretrained(published("sdar")[0])
    prompt = torch.tensor([[5, 9, 2, 7]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "trained with blocks of 4" warning
        left_out = diffusion_generate(sdar, prompt, config=DiffusionGenerationConfig(max_new_tokens=8))
    given = diffusion_generate(sdar, prompt, config=DiffusionGenerationConfig(max_new_tokens=8, block_length=4))
    assert torch.equal(left_out.sequences, given.sequences) and left_out.nfe == given.nfe == 8

    graph = calibrate(sdar, [prompt], DiffusionGenerationConfig(max_new_tokens=8, cache="dual"), num_nodes=4,
                      progress=False)
    assert graph.block_length == 4  # calibrated in the blocks the model decodes with
    llada = enable(AutoDiffusionLM.from_pretrained(published("llada")[0]))
    graph_of_8 = calibrate(llada, [prompt], DiffusionGenerationConfig(max_new_tokens=16, block_length=8,
                                                                      cache="dual"), num_nodes=4, progress=False)
    spiffy = llada.generate(prompt, max_new_tokens=16, cache="dual", speculation="spiffy", draft_graph=graph_of_8,
                            return_dict_in_generate=True)
    ordinary = llada.generate(prompt, max_new_tokens=16, block_length=8, cache="dual", return_dict_in_generate=True)
    assert torch.equal(spiffy.sequences, ordinary.sequences)
    assert DiffusionGenerationConfig(max_new_tokens=64).for_model(llada).block_length == 32
    with pytest.raises(ValueError, match=r"max_new_tokens=20 must be a positive multiple of block_length=32 \(the "
                                         r"default, as block_length was left out\)"):
        llada.generate(prompt, max_new_tokens=20)
    with pytest.raises(ValueError, match=r"multiple of block_length=4 \(the block size the model was trained with"):
        diffusion_generate(sdar, prompt, config=DiffusionGenerationConfig(max_new_tokens=6))
    with pytest.raises(ValueError, match=r"steps=1 .* \(the draft graph's, as block_length was left out\)"):
        llada.generate(prompt, max_new_tokens=16, steps=1, cache="dual", speculation="spiffy", draft_graph=graph_of_8)
    with pytest.raises(TypeError, match=r"max_new_tokens must be an integer, got 16\.0"):  # its type before blocks
        llada.generate(prompt, max_new_tokens=16.0)
    with pytest.raises(ValueError, match=r"config.for_model\(model, draft_graph\)"):
        DiffusionGenerationConfig(max_new_tokens=8).validate(llada)


def test_a_length_no_multiple_of_the_block_length_names_the_next_one_and_where_the_block_length_came_from(published):
    """Before: "...; round it up or change block_length." whatever the block length's source, though a draft graph
    refuses any other block length, and SDAR warns of one it was not trained with."""
    from hf_specdiff import enable
    from hf_specdiff.spiffy import DraftGraph

    sdar = enable(AutoDiffusionLM.from_pretrained(published("sdar")[0]))
    prompt = torch.tensor([[5, 9, 2, 7]])
    graph = DraftGraph(nodes=[((0, 0),)], parents=[[-1]], block_length=8)
    for options, rounded_up, source, other in [
        ({}, 20, r"the block size the model was trained with, as block_length was left out",
         r"or pass a block_length that divides it \(--block-length N\), though the model then decodes in blocks of a "
         r"size it was not trained with"),
        ({"speculation": "spiffy", "draft_graph": graph}, 24, r"the draft graph's, as block_length was left out",
         r"or calibrate a graph for a block length that divides it \(`hf-specdiff calibrate --block-length N`\)")]:
        with pytest.raises(ValueError, match=rf"max_new_tokens=18 must be a positive multiple of block_length=\d+ "
                                             rf"\({source}\): use max_new_tokens={rounded_up} \(--max-new-tokens "
                                             rf"{rounded_up}\), {other}\.$"):
            sdar.generate(prompt, max_new_tokens=18, cache="dual", **options)
    with pytest.raises(ValueError, match=r"block_length=3: use max_new_tokens=9 \(--max-new-tokens 9\) or another "
                                         r"block_length\.$"):
        sdar.generate(prompt, max_new_tokens=8, block_length=3)
    with pytest.raises(ValueError, match=r"^block_length must be >= 1, got 0\.$"):  # before: "a multiple of 0"
        sdar.generate(prompt, max_new_tokens=8, block_length=0)


def test_spiffy_on_sdar_warns_of_no_cache_but_the_calibrated_one_nor_before_refusing_a_block_length(published):
    """Every cache mode decodes a block-causal model exactly, along the same trajectories, so a graph calibrated with
    the dual cache (calibrate's default) drafts as well for generate()'s default cache='none' or for 'block': before,
    that warned "calibrated with other decoding settings (cache: ...)". A block length the graph refuses is refused
    without first warning that it is not the one the model was trained with."""
    import warnings

    from hf_specdiff import enable
    from hf_specdiff.diffusion import DiffusionGenerationConfig
    from hf_specdiff.spiffy import calibrate

    sdar = enable(AutoDiffusionLM.from_pretrained(published("sdar")[0]))
    prompt = torch.tensor([[5, 9, 2, 7, 3, 1]])
    graph = calibrate(sdar, [prompt], DiffusionGenerationConfig(max_new_tokens=8, cache="dual"), num_nodes=4,
                      progress=False)
    ordinary = sdar.generate(prompt, max_new_tokens=8, cache="dual")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for cache in ("none", "prefix", "block"):
            spiffy = sdar.generate(prompt, max_new_tokens=8, cache=cache, speculation="spiffy", draft_graph=graph)
            assert torch.equal(spiffy, ordinary), cache
    assert graph.calibration_differences(DiffusionGenerationConfig(max_new_tokens=8, cache="none")) == [
        "cache: 'dual' (graph) vs 'none' (now)"]  # of no model: compared
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"calibrated for block_length=4, but decoding uses block_length=8"):
            sdar.generate(prompt, max_new_tokens=8, block_length=8, speculation="spiffy", draft_graph=graph)
    assert [str(w.message) for w in caught] == []


def test_forward_errors(published):
    model = AutoDiffusionLM.from_pretrained(published("sdar")[0])
    ids, _ = inputs()
    with pytest.raises(ValueError, match=r"attention_mask must be a torch.bool tensor of shape .* \(2, 1, 12, 12\)"):
        model(ids, attention_mask=torch.ones(2, N, dtype=torch.bool))  # a 2D padding mask
    with pytest.raises(ValueError, match="attention_mask must be a torch.bool"):
        model(ids, attention_mask=torch.ones(2, 1, N, N))  # float
    context = model(ids[:, :4], return_key_values=True).key_values
    with pytest.raises(ValueError, match=r"\(2, 1, 8, 12\)"):
        model(ids[:, 4:], past_key_values=context, attention_mask=torch.ones(2, 1, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="past_key_values must be 2"):
        model(ids[:, 4:], past_key_values=context[:1])
    with pytest.raises(ValueError, match="position_ids must have shape"):
        model(ids, position_ids=torch.arange(N))


def test_from_pretrained_dtype_spellings_and_unknown_options(published):
    """`dtype=` as a torch dtype or its name, transformers' older `torch_dtype=`, and "auto" (the stored dtype) all
    work; an option from_pretrained would drop without a word is refused."""
    folder, _, _ = published("llada")
    assert AutoDiffusionLM.from_pretrained(folder, dtype="auto").dtype == AutoDiffusionLM.from_pretrained(folder).dtype
    assert AutoDiffusionLM.from_pretrained(folder, torch_dtype=torch.bfloat16).dtype == torch.bfloat16
    assert AutoDiffusionLM.from_pretrained(folder, dtype="float16").dtype == torch.float16
    with pytest.raises(TypeError, match=r"unsupported arguments \['device_map'\]"):
        AutoDiffusionLM.from_pretrained(folder, device_map="auto")
    with pytest.raises(ValueError, match="dtype must be a torch dtype"):
        AutoDiffusionLM.from_pretrained(folder, dtype="half-precision")
    with pytest.raises(TypeError, match="not both"):
        AutoDiffusionLM.from_pretrained(folder, dtype=torch.float32, torch_dtype=torch.float16)


@pytest.mark.parametrize("dtype, said", [("fp32", "got 'fp32'"),
                                         (torch.int8, "dtype=torch.int8 is not a floating-point"),
                                         ("long", "dtype='long' is not a floating-point")])
def test_from_pretrained_refuses_a_dtype_it_cannot_load_naming_it(published, dtype, said):
    """A dtype name torch lacks is quoted as given (not as None), and an integer dtype is refused before the weights
    are cast, with the dtypes that work."""
    folder, _, _ = published("llada")
    with pytest.raises(ValueError, match=said) as error:
        AutoDiffusionLM.from_pretrained(folder, dtype=dtype)
    assert "bfloat16" in str(error.value)
