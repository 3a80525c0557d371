"""One small masked-diffusion LM that loads and saves the published LLaDA, Dream and SDAR checkpoints.

LLaDA (Nie et al. 2025, "Large Language Diffusion Models", arXiv 2502.09992), Dream 7B (from Qwen2.5) and SDAR (from
Qwen3) are all the same pre-norm transformer run without a causal mask:

    x = embed_tokens(ids)
    every layer:  n = RMSNorm(x);  x = x + o_proj(attention(rope(q_norm?(q_proj(n))), rope(k_norm?(k_proj(n))),
                                                         v_proj(n)))
                  n = RMSNorm(x);  x = x + down_proj(silu(gate_proj(n)) * up_proj(n))
    logits = lm_head(RMSNorm(x))

They differ only in parameter names, config keys, q/k/v biases (Dream), q/k RMSNorm over head_dim (SDAR), whether
logits are read shifted by one (Dream) and the attention pattern (SDAR: block-causal). Those differences live in the
`FAMILIES` table below (style rule 9); the decoder reads `mask_token_id`, `shift_logits` and `block_causal` from the
model and builds every attention mask itself.

Forward contract (shapes: b batch, q queries of this forward, c context positions given as K/V):

    forward(input_ids (b, q), position_ids (b, q) | None = c + arange(q),
            attention_mask bool (b, 1, q, c + q) | None = all True,     keys ordered [context (c) ; own queries (q)]
            past_key_values [(k, v)] * num_layers | None,               each (b, num_key_value_heads, c, head_dim),
                                                                        rotary applied; read, never modified
            return_key_values=False)
      -> DiffusionLMOutput(logits (b, q, vocab) unshifted, key_values: this forward's own (k, v) per layer or None)

Numerics: RMSNorm and rotary run in float32 for 16/32-bit models, as in all three published implementations (rotary
angles always in float32); a float64 model keeps float64 everywhere else, so tiny fp64 tests can demand exact
invariants.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

from .._attention import grouped_query_attention
from .._hub import SAVED_FOLDER, check_folder_or_repo_id, check_tokenizer_folder, find_file, take_dtype
from .decoding import generate_before_enable

OUR_MODEL_TYPE = "hf_specdiff_diffusion_lm"


@strict
class DiffusionLMConfig(PreTrainedConfig):
    r"""Configuration of a `DiffusionLM`.

    Args:
        vocab_size (`int`): rows of `embed_tokens` and `lm_head`. For LLaDA this is the published `embedding_size`,
            the vocabulary padded for throughput (it may exceed the tokenizer's `vocab_size`; the padded rows are never
            produced by the tokenizer, but their logits exist). LLaDA-8B: both 126464.
        hidden_size (`int`), intermediate_size (`int`), num_hidden_layers (`int`), num_attention_heads (`int`):
            the usual transformer sizes (intermediate_size is the SwiGLU width).
        num_key_value_heads (`int`, *optional*): K/V heads (grouped-query attention); None means num_attention_heads.
        head_dim (`int`, *optional*): width of one head; None means hidden_size // num_attention_heads.
        rope_theta (`float`): base of the rotary frequencies (rotate-half layout, explicit position ids).
        rms_norm_eps (`float`): epsilon of every RMSNorm.
        attention_bias (`bool`): q/k/v projections have biases (Dream, as Qwen2). o_proj never has one.
        qk_norm (`bool`): RMSNorm over head_dim on q and k before rotary (SDAR, as Qwen3).
        tie_word_embeddings (`bool`): lm_head shares the embedding matrix (LLaDA `weight_tying`).
        mask_token_id (`int`, *optional*): id of the [MASK] token the decoder fills undecided positions with.
        shift_logits (`bool`): the decoder must read the prediction for position i from row i-1 (Dream). The model
            itself never shifts.
        block_causal (`bool`): the model was trained block-causally (SDAR): a block attends to earlier blocks and to
            itself only. The decoder builds that mask; the model only records the fact.
        family (`str`): which published layout the weights came from and are saved back in: a key of `FAMILIES`
            ("llada", "dream", "sdar", or "llama" for a Llama-layout model turned into a diffusion LM, saved in this
            config's own format).
        published_config (`dict`, *optional*): the config.json the weights were loaded from, written back on save
            with the fields above updated, so that keys this implementation does not use survive a round trip.
        pad_token_id, bos_token_id, eos_token_id (`int` or `list[int]`, *optional*): special token ids.
        initializer_range (`float`): std of the normal init of a freshly built (not loaded) model.
    """

    model_type = OUR_MODEL_TYPE

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float | int = 10000.0
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    mask_token_id: int | None = None
    shift_logits: bool = False
    block_causal: bool = False
    family: str = "llama"
    published_config: dict | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    initializer_range: float = 0.02

    def __post_init__(self, **kwargs):
        if self.family not in FAMILIES:
            raise ValueError(f"DiffusionLMConfig.family must be one of {sorted(FAMILIES)}, got {self.family!r}.")
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads}).")
        super().__post_init__(**kwargs)


# ----------------------------------------------------------------------------------------------------------------
# Family table: one entry per published layout
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """How one published checkpoint layout maps onto `DiffusionLM`. Add an entry to `FAMILIES` for your own model.

    model_types / architectures: config.json values that identify the family (the first ones are written on save).
    config_keys: our field -> published key, or a tuple of keys tried in order (only the first is written on save).
    defaults: published key -> the value to assume when config.json lacks the key (the family's own default).
    requires: published key -> the only value this implementation supports (checked on load, written on save).
    fields: our fields that the family fixes whatever config.json says.
    renames: (published, ours) parameter-name templates, `{i}` = layer index, matched before `.weight`/`.bias`;
        names no template matches are the same in both layouts.
    """

    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    config_keys: dict
    defaults: dict = field(default_factory=dict)
    requires: dict = field(default_factory=dict)
    fields: dict = field(default_factory=dict)
    renames: tuple[tuple[str, str], ...] = ()

    def rename(self, name: str, to_published: bool = False) -> str:
        for published, ours in self.renames:
            source, target = (ours, published) if to_published else (published, ours)
            pattern = re.escape(source).replace(r"\{i\}", r"(?P<i>\d+)")
            match = re.fullmatch(pattern + r"\.(?P<kind>weight|bias)", name)
            if match:
                return target.format(i=match.groupdict().get("i")) + "." + match["kind"]
        return name


_COMMON_KEYS = {key: key for key in (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "rope_theta",
    "rms_norm_eps", "tie_word_embeddings", "mask_token_id", "pad_token_id", "bos_token_id", "eos_token_id")}
_COMMON_KEYS["num_key_value_heads"] = ("num_key_value_heads", "num_attention_heads")
_SILU_PLAIN_ROPE = {"hidden_act": "silu", "rope_scaling": None, "use_sliding_window": False}
_LLADA_BLOCK = "model.transformer.blocks.{i}"

FAMILIES: dict[str, Family] = {
    # Checked against NVlabs/Fast-dLLM llada/model/configuration_llada.py + modeling_llada.py (the GSAI-ML/LLaDA-8B
    # remote code): LLaDALlamaBlock computes ff_out(act(ff_proj(x)) * up_proj(x)) with activation_type "silu", so
    # ff_proj is the gated projection; RMSLayerNorm is weight * x * rsqrt(mean(x^2) + rms_norm_eps), no bias; q/k/v
    # biases iff include_bias | include_qkv_bias; wte and ff_out have embedding_size rows; weight_tying drops ff_out.
    "llada": Family(
        model_types=("llada",),
        architectures=("LLaDAModelLM",),
        config_keys={
            "vocab_size": ("embedding_size", "vocab_size"), "hidden_size": "d_model",
            "intermediate_size": "mlp_hidden_size", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
            "num_key_value_heads": ("n_kv_heads", "n_heads"), "rope_theta": "rope_theta",
            "rms_norm_eps": "rms_norm_eps", "attention_bias": "include_qkv_bias", "tie_word_embeddings": "weight_tying",
            "mask_token_id": "mask_token_id", "pad_token_id": "pad_token_id", "eos_token_id": "eos_token_id",
        },
        # ModelConfig's defaults, except token ids: LLaDA-8B's (the code's own default, 50256, is GPT-2's)
        defaults={"rope_theta": 10000.0, "rms_norm_eps": 1e-5, "include_qkv_bias": False, "weight_tying": True,
                  "block_type": "sequential", "activation_type": "swiglu", "layer_norm_type": "default", "rope": False,
                  "mask_token_id": 126336, "eos_token_id": 126081, "pad_token_id": 126081},
        requires={"block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms", "rope": True,
                  "alibi": False, "include_bias": False, "attention_layer_norm": False, "input_emb_norm": False,
                  "scale_logits": False},
        fields={"qk_norm": False, "shift_logits": False, "block_causal": False},
        renames=(
            ("model.transformer.wte", "model.embed_tokens"),
            (_LLADA_BLOCK + ".attn_norm", "model.layers.{i}.input_layernorm"),
            (_LLADA_BLOCK + ".q_proj", "model.layers.{i}.self_attn.q_proj"),
            (_LLADA_BLOCK + ".k_proj", "model.layers.{i}.self_attn.k_proj"),
            (_LLADA_BLOCK + ".v_proj", "model.layers.{i}.self_attn.v_proj"),
            (_LLADA_BLOCK + ".attn_out", "model.layers.{i}.self_attn.o_proj"),
            (_LLADA_BLOCK + ".ff_norm", "model.layers.{i}.post_attention_layernorm"),
            (_LLADA_BLOCK + ".ff_proj", "model.layers.{i}.mlp.gate_proj"),
            (_LLADA_BLOCK + ".up_proj", "model.layers.{i}.mlp.up_proj"),
            (_LLADA_BLOCK + ".ff_out", "model.layers.{i}.mlp.down_proj"),
            ("model.transformer.ln_f", "model.norm"),
            ("model.transformer.ff_out", "lm_head"),
        ),
    ),
    # Checked against NVlabs/Fast-dLLM dream/model/configuration_dream.py + modeling_dream.py (Dream-org remote code):
    # Qwen2 names; q/k/v bias=True hard-coded (no config key), o_proj and MLP without; is_causal False; generation
    # reads logits shifted right by one. Config defaults from DreamConfig.
    "dream": Family(
        model_types=("Dream",),
        architectures=("DreamModel",),
        config_keys=_COMMON_KEYS,
        defaults={"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                  "mask_token_id": 151666, "pad_token_id": 151643},
        requires=_SILU_PLAIN_ROPE,
        fields={"attention_bias": True, "qk_norm": False, "shift_logits": True, "block_causal": False},
    ),
    # Checked against JetAstra/SDAR training/model/SDAR-{4B,8B}-Chat/{config.json, configuration_sdar.py,
    # modeling_sdar.py, model.safetensors.index.json}: Qwen3 names incl. self_attn.{q,k}_norm over head_dim; biases
    # follow attention_bias (false); block-causal generation. The Hub config has no mask key: the tokenizer's
    # `<|MASK|>` is id 151669 (the repo's training config adds "mask_token_id": 151669).
    "sdar": Family(
        model_types=("sdar",),
        architectures=("SDARForCausalLM",),
        config_keys={**_COMMON_KEYS, "head_dim": "head_dim"},
        defaults={"head_dim": 128, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                  "mask_token_id": 151669},
        requires={**_SILU_PLAIN_ROPE, "attention_bias": False},
        fields={"attention_bias": False, "qk_norm": True, "shift_logits": False, "block_causal": True},
    ),
    # transformers' LlamaForCausalLM names (SmolLM2). Saved in this config's own format (model_type
    # "hf_specdiff_diffusion_lm"), since a Llama config cannot carry the diffusion fields.
    "llama": Family(
        model_types=("llama",),
        architectures=("LlamaForCausalLM",),
        config_keys={**_COMMON_KEYS, "head_dim": "head_dim"},
        defaults={"rms_norm_eps": 1e-6, "tie_word_embeddings": False},
        requires={"hidden_act": "silu", "rope_scaling": None, "attention_bias": False, "mlp_bias": False},
        fields={"attention_bias": False, "qk_norm": False},
    ),
}


def _config_from_published(family_name: str, published: dict, where: str, **overrides) -> DiffusionLMConfig:
    family, raw = FAMILIES[family_name], published
    published = dict(published)
    rope = published.get("rope_parameters")  # transformers >= 5 writes rope_theta / rope_type here
    if rope:
        published["rope_theta"] = rope.get("rope_theta")
        published["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope

    def get(key, absent=None):
        return published.get(key, family.defaults.get(key, absent))

    unsupported = {key: get(key, value) for key, value in family.requires.items() if get(key, value) != value}
    if unsupported:
        raise ValueError(f"{where}: this {family_name} config.json has {unsupported}; DiffusionLM supports only "
                         f"{ {key: family.requires[key] for key in unsupported} }.")
    fields = {}
    for ours, keys in family.config_keys.items():
        values = [get(key) for key in ((keys,) if isinstance(keys, str) else keys) if get(key) is not None]
        if values:
            fields[ours] = values[0]
    missing = [keys for ours, keys in family.config_keys.items() if ours not in fields and ours in
               ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")]
    if missing:
        raise ValueError(f"{where}: this {family_name} config.json lacks {missing}; it is incomplete.")
    keep = raw if family_name != "llama" else None  # "llama" saves in our own format
    return DiffusionLMConfig(**{**fields, **family.fields, "family": family_name, "published_config": keep,
                                **overrides})


def _config_to_published(config: DiffusionLMConfig) -> dict:
    family = FAMILIES[config.family]
    published = {**(config.published_config or {}), **family.requires}
    for ours, keys in family.config_keys.items():
        keys, value = ((keys,) if isinstance(keys, str) else keys), getattr(config, ours)
        if value is not None or keys[0] in published:
            published[keys[0]] = value
            for key in keys[1:]:
                published.setdefault(key, value)
    published.update(model_type=family.model_types[0], architectures=[family.architectures[0]])
    return published


# ----------------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)


def _rotary(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin: (b, q, head_dim), from float32 angles as the published models compute them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=position_ids.device) / head_dim))
    angles = position_ids[..., None].float() * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (b, heads, q, d); rotate-half ("NeoX") pairs dimension j with j + d/2
    y = x.to(cos.dtype)
    y1, y2 = y.chunk(2, dim=-1)
    return (y * cos[:, None] + torch.cat((-y2, y1), dim=-1) * sin[:, None]).to(x.dtype)


class DiffusionAttention(nn.Module):
    def __init__(self, config: DiffusionLMConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x, cos, sin, mask, context):
        b, q, _ = x.shape
        query = self.q_proj(x).view(b, q, self.num_heads, self.head_dim)
        key = self.k_proj(x).view(b, q, self.num_kv_heads, self.head_dim)
        value = self.v_proj(x).view(b, q, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query = _apply_rotary(query.transpose(1, 2), cos, sin)
        key = _apply_rotary(key.transpose(1, 2), cos, sin)  # (b, kv_heads, q, d)
        own = (key, value)
        if context is not None:
            key, value = torch.cat([context[0], key], dim=2), torch.cat([context[1], value], dim=2)
        out = grouped_query_attention(query, key, value, mask, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q, -1)), own


class DiffusionMLP(nn.Module):
    def __init__(self, config: DiffusionLMConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DiffusionLayer(nn.Module):
    def __init__(self, config: DiffusionLMConfig):
        super().__init__()
        self.self_attn = DiffusionAttention(config)
        self.mlp = DiffusionMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, context):
        attended, own = self.self_attn(self.input_layernorm(x), cos, sin, mask, context)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), own


class DiffusionBody(nn.Module):
    def __init__(self, config: DiffusionLMConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DiffusionLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass
class DiffusionLMOutput(ModelOutput):
    """logits: (b, q, vocab), row i = output at query i (never shifted). key_values: per layer (k, v) of this
    forward's q tokens, each (b, num_key_value_heads, q, head_dim) with rotary applied, or None."""

    logits: torch.Tensor | None = None
    key_values: list[tuple[torch.Tensor, torch.Tensor]] | None = None


class DiffusionLM(PreTrainedModel):
    """A masked diffusion LM (LLaDA / Dream / SDAR / a converted Llama); see the module docstring for `forward`."""

    config_class = DiffusionLMConfig
    base_model_prefix = "model"
    _no_split_modules = ["DiffusionLayer"]
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    generate = generate_before_enable  # `hf_specdiff.enable(model)` gives this model its diffusion decoding

    def __init__(self, config: DiffusionLMConfig):
        super().__init__(config)
        self.model = DiffusionBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @property
    def mask_token_id(self) -> int:
        if self.config.mask_token_id is None:
            # what a causal LM's checkpoint loads as (a Llama config has no [MASK]): no diffusion LM until trained
            raise ValueError(
                "This DiffusionLM has no mask_token_id: its checkpoint names no [MASK] token, as a causal LM's (e.g. "
                "SmolLM2 itself) does not, and a causal LM does not decode by unmasking until trained to "
                "(`hf-specdiff train-diffusion`). Load a diffusion LM (LLaDA, Dream, SDAR, or an adapter folder such "
                "as hf_specdiff.default_diffusion_lm_path()), or, if this model was trained with a [MASK] token, set "
                "model.config.mask_token_id to its id."
            )
        return self.config.mask_token_id

    @property
    def shift_logits(self) -> bool:
        return self.config.shift_logits

    @property
    def block_causal(self) -> bool:
        return self.config.block_causal

    @property
    def trained_block_length(self) -> int | None:
        """The block length a block-causal model was trained with (SDAR's config.json names it `block_size`), or None
        where the model is bidirectional or its config does not say."""
        return (self.config.published_config or {}).get("block_size") if self.block_causal else None

    def forward(self, input_ids: torch.LongTensor, position_ids: torch.LongTensor | None = None,
                attention_mask: torch.Tensor | None = None, past_key_values: list | None = None,
                return_key_values: bool = False) -> DiffusionLMOutput:
        """The contract of the module docstring. Every query must be allowed at least one key (a fully masked row
        gives NaN), typically itself."""
        b, q = input_ids.shape
        c = self._check_context(past_key_values, b)
        if position_ids is None:
            position_ids = torch.arange(c, c + q, device=input_ids.device).expand(b, q)
        if position_ids.shape != (b, q):
            raise ValueError(f"position_ids must have shape (batch, queries) = {(b, q)}, got "
                             f"{tuple(position_ids.shape)}.")
        self._check_mask(attention_mask, b, q, c)
        x = self.model.embed_tokens(input_ids)
        cos, sin = _rotary(position_ids, self.config.head_dim, self.config.rope_theta,
                           torch.promote_types(x.dtype, torch.float32))
        key_values = []
        for i, layer in enumerate(self.model.layers):
            x, own = layer(x, cos, sin, attention_mask, None if past_key_values is None else past_key_values[i])
            key_values.append(own)
        logits = self.lm_head(self.model.norm(x))
        return DiffusionLMOutput(logits=logits, key_values=key_values if return_key_values else None)

    def _check_context(self, past_key_values, b: int) -> int:
        if past_key_values is None:
            return 0
        config = self.config
        expected = (b, config.num_key_value_heads, past_key_values[0][0].shape[2], config.head_dim)
        if len(past_key_values) != config.num_hidden_layers or any(
            len(kv) != 2 or kv[0].shape != expected or kv[1].shape != expected for kv in past_key_values
        ):
            raise ValueError(f"past_key_values must be {config.num_hidden_layers} (key, value) pairs, one per layer, "
                             f"each of shape (batch, num_key_value_heads, context, head_dim) = {expected}: the "
                             "key_values of earlier forwards (return_key_values=True), concatenated along dim 2.")
        return expected[2]

    @staticmethod
    def _check_mask(mask, b: int, q: int, c: int) -> None:
        if mask is None:
            return
        expected = (b, 1, q, c + q)
        if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4
                and mask.shape[0] in (1, b) and tuple(mask.shape[1:]) == expected[1:]):
            got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"attention_mask must be a torch.bool tensor of shape (batch, 1, queries, context + "
                             f"queries) = {expected} (True = may attend; keys are the {c} context keys, then this "
                             f"forward's {q}); got {got}. 2D padding masks are not accepted: build the 4D mask.")

    # ------------------------------------------------------------------------------------------------------------
    # Loading and saving in the published layouts
    # ------------------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike, dtype=None, device=None, base=None, **hub_kwargs):
        """Load a published LLaDA / Dream / SDAR / Llama checkpoint, or one saved by `save_pretrained`, from a local
        folder or a Hub repo id (offline, it must already be in the local Hub cache). `dtype` (torch dtype or its
        name) None: the dtype of the stored embedding. `hub_kwargs` go to `transformers.utils.cached_file`
        (revision, cache_dir, token, local_files_only, ...).

        A diffusion adapter folder written by `hf_specdiff.diffusion.training` (LoRA factors + [MASK] row + the name
        of its base causal LM) loads too: the base is loaded, converted and the adapter merged in
        (`adapter_weights.load_adapter_model`). `base` (a folder, Hub id or loaded causal LM) overrides the base it
        names; it is for adapter folders only."""
        from . import adapter_weights

        where = str(path_or_repo_id)
        check_folder_or_repo_id(where, "diffusion LM")
        dtype = _requested_dtype(dtype, hub_kwargs)
        _check_device(device)
        config_file = find_file(where, "config.json", "diffusion LM", SAVED_FOLDER, **hub_kwargs)
        try:
            published = json.loads(Path(config_file).read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{config_file} is not valid JSON ({error}); the checkpoint is corrupt.") from error
        if not isinstance(published, dict):
            raise ValueError(f"{config_file} must hold a JSON object; the checkpoint is corrupt.")
        if adapter_weights.is_adapter_config(published):
            return adapter_weights.load_adapter_model(where, published, dtype, device, base, hub_kwargs)
        if base is not None:
            raise ValueError(f"base= is for diffusion adapter folders only; {where} is a complete checkpoint.")
        family, config = _recognise(published, where)
        state = {family.rename(name) if family else name: t for name, t in _read_safetensors(where, hub_kwargs).items()}
        embedding = state.get("model.embed_tokens.weight")
        dtype = dtype or (embedding.dtype if embedding is not None else torch.get_default_dtype())
        return cls._from_state_dict(config, state, where, dtype, device)

    @classmethod
    def from_causal_lm(cls, model: PreTrainedModel, mask_token_id: int, shift_logits: bool = False,
                       block_causal: bool = False) -> DiffusionLM:
        """A DiffusionLM with a copy of the weights of a transformers `LlamaForCausalLM`-layout model (e.g. SmolLM2),
        for turning it into a masked diffusion LM."""
        published = model.config.to_dict()
        if published.get("model_type") != "llama":
            raise ValueError(f"from_causal_lm needs a Llama-layout model (model_type 'llama'), got "
                             f"{published.get('model_type')!r}; for another layout, add a Family to FAMILIES.")
        if not 0 <= mask_token_id < model.config.vocab_size:
            raise ValueError(f"mask_token_id={mask_token_id} must be a token id of the model (0 <= id < "
                             f"{model.config.vocab_size}).")
        config = _config_from_published("llama", published, type(model).__name__, mask_token_id=mask_token_id,
                                        shift_logits=shift_logits, block_causal=block_causal)
        state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        weight = state["model.embed_tokens.weight"]
        return cls._from_state_dict(config, state, type(model).__name__, weight.dtype, weight.device)

    @classmethod
    def _from_state_dict(cls, config: DiffusionLMConfig, state: dict, where: str, dtype, device) -> DiffusionLM:
        """Build on the meta device and adopt `state` (our names), refusing any mismatch."""
        with torch.device("meta"):
            model = cls(config)
        expected = {name: tensor.shape for name, tensor in model.state_dict().items()}
        if config.tie_word_embeddings:  # lm_head is the embedding; a stored copy is ignored, as transformers does
            expected.pop("lm_head.weight")
            state.pop("lm_head.weight", None)
        family = FAMILIES[config.family]
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        wrong = sorted(f"{family.rename(name, to_published=True)} {tuple(state[name].shape)} != {tuple(shape)}"
                       for name, shape in expected.items() if name in state and state[name].shape != shape)
        if missing or unexpected or wrong:
            def few(names):
                return [family.rename(n, to_published=True) for n in names[:5]] + (["..."] if len(names) > 5 else [])
            raise ValueError(
                f"The {config.family} checkpoint at {where} does not match its config.json: missing weights "
                f"{few(missing)}, unexpected weights {few(unexpected)}, wrong shapes {wrong[:5]} (published names). "
                "Re-download or re-save it, or check that config.json belongs to these weights; for a layout of "
                "your own, add a Family to hf_specdiff.diffusion.modeling.FAMILIES.")
        model.load_state_dict({name: t.to(dtype=dtype, device=device) for name, t in state.items()},
                              strict=False, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.eval()

    def save_pretrained(self, save_directory: str | os.PathLike, max_shard_size=None) -> None:
        """Write config.json and model.safetensors in the family's published layout (for "llama": our own config).
        `max_shard_size` is accepted for transformers' `push_to_hub`; the weights are always one file."""
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        family, config = FAMILIES[self.config.family], self.config
        if config.family == "llama":
            published = json.loads(config.to_json_string(use_diff=True))  # non-default fields, as transformers saves
        else:
            published = _config_to_published(config)
            if "torch_dtype" in published:
                published["torch_dtype"] = str(self.dtype).removeprefix("torch.")
        state = {family.rename(name, to_published=True): tensor.detach().contiguous()
                 for name, tensor in self.state_dict().items()
                 if not (config.tie_word_embeddings and name == "lm_head.weight")}
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(published, indent=2, sort_keys=True) + "\n")


def _recognise(published: dict, where: str) -> tuple[Family | None, DiffusionLMConfig]:
    """The family of a config.json (None for our own format, whose weights use our names) and our config."""
    if published.get("model_type") == OUR_MODEL_TYPE:
        return None, DiffusionLMConfig.from_dict(published)
    model_type = str(published.get("model_type", "")).lower()
    architectures = set(published.get("architectures") or [])
    for name, family in FAMILIES.items():
        if model_type in {t.lower() for t in family.model_types} or architectures & set(family.architectures):
            return family, _config_from_published(name, published, where)
    supported = ", ".join(f"{name} (model_type {family.model_types[0]!r}, {family.architectures[0]})"
                          for name, family in FAMILIES.items())
    raise ValueError(
        f"{where}: model_type {published.get('model_type')!r} (architectures {sorted(architectures)}) is not a "
        f"supported diffusion LM. Supported families: {supported}. For your own model, add a Family to "
        "hf_specdiff.diffusion.modeling.FAMILIES, wrap the loaded transformers model in "
        "hf_specdiff.diffusion.adapter.DiffusionAdapter, or convert a Llama-layout causal LM with "
        "DiffusionLM.from_causal_lm.")


def _read_safetensors(where: str, hub_kwargs: dict) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards listed in model.safetensors.index.json."""
    from transformers.utils import cached_file

    index = cached_file(where, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False,
                        _raise_exceptions_for_connection_errors=False, **hub_kwargs)
    try:
        if index is not None:
            shards = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
            files = [cached_file(where, shard, **hub_kwargs) for shard in shards]
        else:
            files = [cached_file(where, "model.safetensors", **hub_kwargs)]
    except OSError as error:
        raise OSError(f"{where} has a config.json but no readable model.safetensors or sharded "
                      f"model.safetensors.index.json (only safetensors checkpoints are supported). {error}") from error
    state = {}
    for file in files:
        try:
            state.update(load_file(file))
        except Exception as error:  # a truncated or malformed safetensors file surfaces as various errors
            raise ValueError(f"Could not read the weights {file} ({type(error).__name__}: {error}): the file is "
                             "corrupt or incomplete; download or save the model again.") from error
    return state


def _requested_dtype(dtype, hub_kwargs: dict) -> torch.dtype | None:
    """`dtype` (or transformers' older spelling `torch_dtype`, taken out of `hub_kwargs`) as a torch dtype, None for
    the stored one ("auto" too); refuses options `from_pretrained` would otherwise drop without a word."""
    dtype = take_dtype(dtype, hub_kwargs, "diffusion LM", also="dtype, device, base and ")
    if dtype is None or dtype == "auto":
        return None
    requested = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(requested, torch.dtype):  # the value as given: a name torch lacks would print as None
        raise ValueError(f"dtype must be a torch dtype, its name (e.g. 'bfloat16') or 'auto'; got {dtype!r}.")
    if not requested.is_floating_point:  # caught here, it would fail in nn.Module.to, naming no option
        raise ValueError(f"dtype={dtype!r} is not a floating-point dtype: the weights load as float32, bfloat16 or "
                         "float16 (or float64); pass one of those, or 'auto' for the stored one.")
    return requested


def _check_device(device) -> None:
    """Refuse a device torch cannot name or this machine lacks before the weights load: it would fail minutes later
    in the first `.to(device)`, as a RuntimeError or an AssertionError that names no option."""
    if device is None:
        return
    try:
        device_type = torch.device(device).type
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device={device!r} is not a torch device ({error}); pass e.g. 'cpu', 'cuda' or "
                         "'cuda:0'.") from None
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}, but this torch sees no CUDA GPU (torch.cuda.is_available() is False): "
                         "pass device='cpu', or install a CUDA build of torch on a machine with a GPU.")


class AutoDiffusionLM:
    """Entry point: `AutoDiffusionLM.from_pretrained(path_or_repo_id, dtype=None, device=None, base=None,
    **hub_kwargs)`: a published checkpoint, one saved by `save_pretrained`, or a trained diffusion adapter."""

    def __init__(self):
        raise TypeError("Use AutoDiffusionLM.from_pretrained(...) or DiffusionLM.from_causal_lm(...).")

    from_pretrained = staticmethod(DiffusionLM.from_pretrained)


def load_tokenizer(path_or_repo_id: str | os.PathLike, **kwargs):
    """The tokenizer saved beside a diffusion LM. transformers' Auto classes do not know our config.json's
    model_type, so the tokenizer is loaded without consulting it. A local folder without one (a model saved with
    `save_pretrained` alone) raises an OSError that says so."""
    from transformers import AutoTokenizer, PreTrainedConfig

    check_tokenizer_folder(Path(path_or_repo_id, kwargs.get("subfolder") or ""), "diffusion LM")
    return AutoTokenizer.from_pretrained(path_or_repo_id, config=PreTrainedConfig(), **kwargs)
