"""Markov head: the sequential baseline that xPress must beat.

DSpark's Markov head makes a diffusion drafter's block causal the slow way: slot k's logits are the drafter's plus
a low-rank bias from the token just chosen at slot k-1, and the slots are resolved one after another:

    logits_k = drafter_logits_k + w2(w1(prev_k)),    prev_1 = anchor, prev_k = token chosen at slot k-1

B-1 small sequential steps per block, against xPress's K parallel passes.
"""

from __future__ import annotations

from typing import Callable

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel

from ._cpu_linear import linear


@strict
class MarkovConfig(PreTrainedConfig):
    r"""Configuration of a Markov head.

    Args:
        vocab_size (`int`): V, the target's vocabulary size.
        rank (`int`, defaults to 256): r, the bottleneck of the bias `w2(w1(prev))`.
        block_size (`int`, defaults to 16): B, must equal the drafter's block size.
        initializer_range (`float`, defaults to 0.02): std of the normal init.
    """

    model_type = "markov_head"

    vocab_size: int = 151936
    rank: int = 256
    block_size: int = 16
    initializer_range: float = 0.02

    def __post_init__(self, **kwargs):
        if self.vocab_size < 1 or self.rank < 1:
            raise ValueError(f"MarkovConfig needs positive vocab_size and rank, got {self.vocab_size}, {self.rank}.")
        if self.block_size < 2:
            raise ValueError(f"MarkovConfig.block_size must be at least 2, got {self.block_size}.")
        super().__post_init__(**kwargs)


class MarkovHead(PreTrainedModel):
    config_class = MarkovConfig
    base_model_prefix = "markov"

    def __init__(self, config: MarkovConfig):
        super().__init__(config)
        self.w1 = nn.Embedding(config.vocab_size, config.rank)
        self.w2 = nn.Linear(config.rank, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, prev_tokens: torch.LongTensor, read_out: nn.Module | None = None) -> torch.Tensor:
        """Logit bias given the previous token(s): (..., V). `read_out` replaces w2 by its rows for a draft
        vocabulary (`draft_vocab.py`)."""
        x = self.w1(prev_tokens)
        return linear(x, self.w2.weight) if read_out is None else read_out(x)


PickSlot = Callable[[torch.Tensor, int, torch.LongTensor], "tuple[torch.LongTensor, torch.Tensor]"]


@torch.no_grad()
def markov_decode(
    head: MarkovHead, drafter_logits: torch.Tensor, anchor: torch.LongTensor, pick_slot: PickSlot,
    read_out: nn.Module | None = None,
) -> tuple[torch.LongTensor, torch.Tensor]:
    """Resolve the block left to right. `pick_slot(logits (b, V), slot, earlier tokens (b, slot))` applies the
    target's processors and the block's noise and returns token ids; `read_out` is the head's read-out over a draft
    vocabulary (None: all of w2), whose N columns the drafter's logits (b, B-1, N) are then over too. Returns tokens
    (b, B-1) and the processed logits q (b, B-1, V or N)."""
    tokens, q = [], []
    prev = anchor  # (b,)
    for slot in range(drafter_logits.shape[1]):
        logits = drafter_logits[:, slot] + head(prev, read_out).to(drafter_logits.dtype)
        prev, processed = pick_slot(logits, slot, torch.stack(tokens, dim=1) if tokens else anchor[:, None][:, :0])
        tokens.append(prev)
        q.append(processed)
    return torch.stack(tokens, dim=1), torch.stack(q, dim=1)
