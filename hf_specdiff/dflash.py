"""dFlash block-diffusion drafter, in the published z-lab checkpoint layout.

Reference: z-lab, "DFlash: Block Diffusion for Flash Speculative Decoding" (arXiv 2602.06036) and its Hub checkpoints
(e.g. `z-lab/Qwen3-8B-DFlash-b16`). The drafter proposes a whole block of B positions in one forward pass:

    context features  c = hidden_norm(fc(concat_l target_hidden[l + 1]))      l in target_layer_ids, shape (b, n, H)
    block input       x = target.embed_tokens([anchor, MASK, ..., MASK])        shape (b, B, H)
    every layer:      queries from the block only; keys/values = [k/v_proj(c) ; k/v_proj(x)]   ("KV injection")
                      attention is non-causal over all context and all B block slots; RoPE at absolute positions
    output            h = norm(x_L); slot k (1..B-1) predicts the token at its own position (z-lab convention)

The drafter has no embedding and no lm_head: it borrows the target's. Context K/V are cached across steps; the
block's K/V are dropped after each call (the caller crops them), so only features of newly accepted tokens are
fed next time.

Checkpoint layout (kept exactly so that z-lab checkpoints load and save back unchanged): weights at top level
(`layers.{i}.self_attn.{q,k,v,o}_proj`, `layers.{i}.self_attn.{q,k}_norm`, `layers.{i}.mlp.{gate,up,down}_proj`,
`layers.{i}.{input,post_attention}_layernorm`, `fc`, `hidden_norm`, `norm`), a Qwen3 `config.json` with
`architectures: ["DFlashDraftModel"]`, `block_size` and `dflash_config: {mask_token_id, target_layer_ids}`.
"""

from __future__ import annotations

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from . import _compat
from ._attention import grouped_query_attention


def embedding_sample(target) -> list[float]:
    """32 entries of `target`'s input embedding table (8 rows x 4 columns spread over it, float32): a fingerprint of
    the target a drafter is trained with."""
    weight = target.get_input_embeddings().weight.detach()
    if _compat.is_sharded(weight):  # across processes (each process checks the same speculator in turn)
        weight = weight.full_tensor()
    rows = torch.linspace(0, weight.shape[0] - 1, 8).long().to(weight.device)
    columns = torch.linspace(0, weight.shape[1] - 1, 4).long().to(weight.device)
    return [round(float(v), 6) for v in weight[rows][:, columns].float().flatten().cpu()]


@strict
class DFlashConfig(Qwen3Config):
    r"""Configuration of a dFlash drafter: a Qwen3 config plus the dFlash fields, stored as z-lab stores them.

    Args:
        block_size (`int`, defaults to 16):
            B, the number of block slots: the anchor (the last token accepted from the target) plus B-1 drafts.
        dflash_config (`dict`):
            `mask_token_id`: id of the token that fills the B-1 draft slots of the block input (an id of the target's
            vocabulary; its embedding row is the target's). `target_layer_ids`: 0-based target decoder layers whose
            outputs (`hidden_states[id + 1]`) form the context features.
        num_target_layers (`int`, *optional*):
            Number of decoder layers of the target the drafter was trained for (checked at generate time).
        target_embedding_sample (`list[float]`, *optional*):
            A few entries of that target's input embedding table (`embedding_sample`): the drafter reads through the
            target's embedding and lm_head, so another target of the same shapes would get drafts it rarely accepts;
            generate warns when they differ.
        qkv_bias (`bool`, defaults to `False`):
            Biases on the query, key and value projections only, as Qwen2's attention has them (Qwen3's
            `attention_bias` puts them on all four projections), so that a draft layer warm-started from such a
            target's layer keeps them.
        mlp_bias (`bool`, defaults to `False`):
            Biases on the MLP's gate, up and down projections, as Llama's config names them (Granite and other Llama
            derivatives set it), for the same reason.
    """

    block_size: int = 16
    dflash_config: dict | None = None
    num_target_layers: int | None = None
    target_embedding_sample: list[float] | None = None
    qkv_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self, **kwargs):
        self.dflash_config = dict(self.dflash_config or {})
        # Some exporters write these two at the top level too; here they are read-only views of dflash_config.
        for name in ("mask_token_id", "target_layer_ids"):
            if name in kwargs:
                value = kwargs.pop(name)
                if self.dflash_config.setdefault(name, value) != value:
                    raise ValueError(f"config.json gives {name}={value!r} at the top level and "
                                     f"{self.dflash_config[name]!r} in dflash_config: the checkpoint contradicts "
                                     "itself; fix one of the two.")
        if self.block_size < 2:
            raise ValueError(f"`block_size` must be at least 2 (an anchor and one draft slot), got {self.block_size}.")
        super().__post_init__(**kwargs)

    @property
    def mask_token_id(self) -> int:
        if "mask_token_id" not in self.dflash_config:
            raise ValueError("This dFlash config has no `dflash_config['mask_token_id']`: "
                             "the checkpoint is incomplete.")
        return self.dflash_config["mask_token_id"]

    @property
    def layer_ids(self) -> list[int]:
        """The target layers read by the drafter, z-lab semantics (layer l is `hidden_states[l + 1]`)."""
        if "target_layer_ids" not in self.dflash_config:
            raise ValueError("This dFlash config has no `dflash_config['target_layer_ids']`: "
                             "the checkpoint is incomplete.")
        return list(self.dflash_config["target_layer_ids"])

    @property
    def target_layer_ids(self) -> list[int]:
        """What transformers' native `speculation_type="dflash"` reads: the same ids (it asks the target for these
        layers' outputs, z-lab's meaning, on 5.17 as on 5.24)."""
        return self.layer_ids


def spread_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Evenly spaced target layers from the second to the third-last, as the published drafters choose them."""
    if num_features < 1 or num_target_layers < 1:
        raise ValueError(f"need at least one layer and one feature, got {num_target_layers=} {num_features=}")
    first, last = min(1, num_target_layers - 1), max(num_target_layers - 3, 0)
    if num_features == 1:
        return [(first + last) // 2]
    return [round(first + i * (last - first) / (num_features - 1)) for i in range(num_features)]


def full_attention_rope_parameters(text_config) -> dict:
    """The target's RoPE settings for the drafter, whose attention is full. Targets that mix sliding and full layers
    keep one set per layer type; the drafter takes the set of the layers that attend to the whole context, the one its
    long contexts need (Gemma 3's "full_attention"; Zaya's "hybrid", beside "hybrid_sliding"), else the one set there
    is (targets whose full-attention layers use no RoPE list None for them)."""
    rope = dict(getattr(text_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    if "rope_type" not in rope:
        per_type = {kind: value for kind, value in rope.items() if isinstance(value, dict)}
        full = [per_type[kind] for kind in ("full_attention", "hybrid") if kind in per_type]
        if full or len(per_type) == 1:
            rope = dict(full[0] if full else next(iter(per_type.values())))
    if "rope_type" not in rope:
        raise ValueError(
            f"The target's rope_parameters {rope} name no `rope_type` (and no `full_attention` or `hybrid` set, or "
            "more than one other): pass a target whose config follows transformers' RoPE layout, or build the "
            "DFlashConfig yourself."
        )
    return rope


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (b, heads, t, d); cos/sin: (b, t, d)
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        qkv_bias = config.attention_bias or config.qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def keys_values(self, x, cos, sin):
        """Keys (rotated to the positions of cos/sin (b, n, d)) and values of x (b, n, H): (b, kv heads, n, d) each.
        A context token's depend on its own features alone."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, -1, self.head_dim).transpose(1, 2)
        return _apply_rope(k, cos, sin), v

    def forward(self, block, context, cos, sin, key_padding_mask=None, cache=None):
        # block: (b, B, H) queries and keys; context: (b, n, H) keys only; cos/sin: (b, n + B, d)
        b, num_slots, _ = block.shape
        q = self.q_norm(self.q_proj(block).view(b, num_slots, -1, self.head_dim)).transpose(1, 2)
        q = _apply_rope(q, cos[:, -num_slots:], sin[:, -num_slots:])
        k, v = self.keys_values(torch.cat([context, block], dim=1), cos, sin)
        if cache is not None:  # prepend the context K/V of earlier steps
            k, v = cache.update(k, v, self.layer_idx)
        # Non-causal: every slot sees all context and the whole block; only padding is masked.
        out = grouped_query_attention(q, k, v, key_padding_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, num_slots, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)  # Qwen3's MLP with `mlp_bias` (Qwen3's own has no biases)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, block, context, cos, sin, key_padding_mask=None, cache=None):
        block = block + self.self_attn(self.input_layernorm(block), context, cos, sin, key_padding_mask, cache)
        return block + self.mlp(self.post_attention_layernorm(block))


class DFlashDraftModel(PreTrainedModel):
    """The dFlash drafter. `forward` follows transformers' native drafter interface (`speculation_type="dflash"`)."""

    config_class = DFlashConfig
    base_model_prefix = ""
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.fc = nn.Linear(len(config.layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def _apply(self, fn, recurse=True):
        # `.to(torch.bfloat16)` would round the RoPE frequencies too (`from_pretrained(dtype=...)` does not): the
        # drafter was trained with float32 ones, and at positions in the thousands the rounded angles drift far.
        super()._apply(fn, recurse)
        rope = self.rotary_emb
        if rope.inv_freq.dtype != torch.float32 and rope.inv_freq.device.type != "meta":
            initialise = rope.compute_default_rope_parameters if rope.rope_type == "default" else \
                ROPE_INIT_FUNCTIONS[rope.rope_type]
            inv_freq = initialise(self.config)[0].to(rope.inv_freq.device)
            rope.inv_freq, rope.original_inv_freq = inv_freq, inv_freq.clone()
        return self

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def target_hidden_states_request(self) -> bool | list[int]:
        """What the target's forward takes as `output_hidden_states` to return the hidden states `context_features`
        reads (layer i's output is at index i + 1 of the tuple), and only those where transformers can select them."""
        return _compat.hidden_states_request([i + 1 for i in self.config.layer_ids])

    def context_features(self, target_hidden_states, num_tokens: int | None = None) -> torch.Tensor:
        """Concatenate the target layers this drafter reads: (b, n, len(layer_ids) * H). `target_hidden_states` is
        the target's `output_hidden_states` tuple (index 0 = embeddings); `num_tokens` keeps the first n positions.
        A target that stacks parallel residual streams in each hidden state (Gemma 3n's AltUp: (streams, b, n, H))
        is read at its first, the active stream of Gemma 3n's configs (`altup_active_idx` 0)."""
        num_layers, found = self.config.num_target_layers, len(target_hidden_states)
        if num_layers is not None and found != num_layers + 1 or found <= max(self.config.layer_ids) + 1:
            expected = f" ({num_layers + 1})" if num_layers is not None else ""
            raise ValueError(
                f"The target returned {found} hidden states, not its embeddings' and one per "
                f"layer{expected}: its forward skips layers (Mllama skips its cross-attention layers on a prompt "
                "without images), so the layers this drafter reads cannot be found. Generate without speculation."
            )
        layers = [target_hidden_states[i + 1] for i in self.config.layer_ids]
        if missing := [i for i, h in zip(self.config.layer_ids, layers) if h is None]:
            raise ValueError(f"The target returned no hidden states for layers {missing}, "
                             "which this drafter reads: its config counts fewer layers than its forward runs. "
                             "Check the drafter's target_layer_ids.")
        return torch.cat([(h[0] if h.dim() == 4 else h)[:, :num_tokens] for h in layers], dim=-1)

    def cache_context(self, context_hidden_states: torch.Tensor, position_ids: torch.LongTensor, cache) -> None:
        """Append the K/V of n new context tokens to `cache` in every layer, drafting nothing: what `forward` would
        prepend for them. `context_hidden_states` (b, n, len(layer_ids) * H) are their raw target features (as
        `context_features` gives them), `position_ids` (b, n) their positions. A context token's K/V depend on its own
        features alone, so a long prompt's can be written chunk by chunk as the target's chunked prefill produces its
        hidden states, and the whole prompt's features are never held at once."""
        context = self.hidden_norm(self.fc(context_hidden_states))
        cos, sin = self.rotary_emb(context, position_ids)
        for layer in self.layers:
            cache.update(*layer.self_attn.keys_values(context, cos, sin), layer.self_attn.layer_idx)

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        past_key_values=None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        r"""
        Args:
            noise_embeds: (b, B, H) target embeddings of `[anchor, MASK, ...]`.
            context_hidden_states: (b, n, len(layer_ids) * H) raw target features of the n new context tokens.
            position_ids: (b, n + B) absolute positions of the new context tokens, then of the block.
            attention_mask: optional (b, kv_len) 2D padding mask over everything attended (cached context, new
                context, block), 0 marking padding; or a boolean (b, 1, q_len, kv_len) mask used as is (training
                packs several blocks per sequence, each seeing only the context before its own anchor).
            cache / past_key_values: a transformers `Cache` holding earlier context K/V (both names are accepted:
                transformers 5.24 passes `cache=`, 5.17 `past_key_values=`). The caller crops the block's K/V.
        Returns:
            `last_hidden_state`: (b, B, H), after the final norm.
        """
        if kwargs:
            raise TypeError(f"DFlashDraftModel.forward got unexpected arguments {sorted(kwargs)}.")
        cache = cache if cache is not None else past_key_values
        context = self.hidden_norm(self.fc(context_hidden_states))
        cos, sin = self.rotary_emb(noise_embeds, position_ids)
        key_padding_mask = None
        if attention_mask is not None and attention_mask.dim() == 4:
            key_padding_mask = attention_mask.bool()
        elif attention_mask is not None and not bool(attention_mask.all()):
            key_padding_mask = attention_mask[:, None, None, :].bool()  # (b, 1, 1, kv_len)
        hidden = noise_embeds
        for layer in self.layers:
            hidden = layer(hidden, context, cos, sin, key_padding_mask, cache)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden))
