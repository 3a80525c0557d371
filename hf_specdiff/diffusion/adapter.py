"""Plug a user's own masked diffusion LM into the library's diffusion decoding and Spiffy.

The decoder needs four facts about a model (its mask token, whether logits are shifted, whether attention is
block-causal, whether it can reuse key/values) and one forward:

    forward(input_ids (b, q), position_ids (b, q), attention_mask bool (b, 1, q, c + q), past_key_values=None
            | per-layer (k, v) of c context positions, return_key_values=False) -> .logits (b, q, V), .key_values

`hf_specdiff.diffusion.DiffusionLM` implements it natively. `DiffusionAdapter` wraps any transformers model with a
standard KV cache and a custom-4D-mask-aware attention (Llama, Qwen2, Qwen3, Mistral, ... in transformers 5.x) so it
follows that contract; a model without a transformers cache can still be decoded with cache="none" by setting
`supports_kv=False`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from .. import _compat
from .decoding import generate_before_enable


@dataclass
class AdapterOutput:
    logits: torch.Tensor
    key_values: list | None = None


class DiffusionAdapter(nn.Module):
    """A transformers model seen as a masked diffusion LM (no weights copied, nothing changed on the model)."""

    generate = generate_before_enable  # `hf_specdiff.enable(adapter)` gives this adapter its diffusion decoding

    def __init__(self, model: nn.Module, mask_token_id: int, shift_logits: bool = False, block_causal: bool = False,
                 supports_kv: bool = True):
        super().__init__()
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if torch.is_tensor(mask_token_id) and mask_token_id.dim() == 0 and not mask_token_id.is_floating_point() \
                and mask_token_id.dtype != torch.bool:  # e.g. tokenizer(...)["input_ids"][0, 0]
            mask_token_id = int(mask_token_id)
        if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int):
            raise TypeError(f"mask_token_id must be a Python int (a token id of the model), got "
                            f"{type(mask_token_id).__name__} {mask_token_id!r}; pass int(...) of it.")
        if mask_token_id < 0 or (vocab is not None and mask_token_id >= vocab):
            raise ValueError(f"mask_token_id={mask_token_id!r} must be a token id of the model (0 <= id < {vocab}).")
        if shift_logits and block_causal:  # what decoding refuses too (DiffusionGenerationConfig.validate)
            raise ValueError("A block-causal model with shifted logits is not supported; set one of them off.")
        self.model = model
        self.mask_token_id, self.shift_logits, self.block_causal = mask_token_id, shift_logits, block_causal
        self.supports_kv = supports_kv

    @property
    def config(self):
        return self.model.config

    def forward(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None,
                return_key_values=False):
        b, q = input_ids.shape
        context = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        if position_ids is None:
            position_ids = torch.arange(context, context + q, device=input_ids.device).expand(b, -1)
        if attention_mask is None:
            attention_mask = torch.ones(b, 1, q, context + q, dtype=torch.bool, device=input_ids.device)
        if attention_mask.dtype != torch.bool or attention_mask.shape != (b, 1, q, context + q):
            raise ValueError(
                f"attention_mask must be a bool tensor of shape (batch, 1, queries, context + queries) = "
                f"{(b, 1, q, context + q)}, got {attention_mask.dtype} {tuple(attention_mask.shape)}."
            )
        dtype = next(self.model.parameters()).dtype
        additive = torch.zeros(attention_mask.shape, dtype=dtype, device=input_ids.device)
        additive.masked_fill_(~attention_mask, torch.finfo(dtype).min)  # works for eager and SDPA attention alike
        cache = None
        if self.supports_kv and (past_key_values is not None or return_key_values):
            cache = DynamicCache()
            for layer, (k, v) in enumerate(past_key_values or []):
                cache.update(k, v, layer)
        elif past_key_values is not None or return_key_values:
            raise ValueError("This adapter was built with supports_kv=False: decode with cache='none'.")
        cache_kwargs = _compat.cache_kwargs(self.model, cache) if cache is not None else {}
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=additive,
                         use_cache=cache is not None, **cache_kwargs)
        key_values = None
        if return_key_values:
            key_values = [(layer.keys[:, :, context:], layer.values[:, :, context:]) for layer in cache.layers]
        return AdapterOutput(logits=out.logits, key_values=key_values)
