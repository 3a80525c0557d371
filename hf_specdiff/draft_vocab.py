"""A draft vocabulary: drafts read out over the tokens the target writes most, not over its whole vocabulary.

Every draft is a vocabulary-sized read-out: the drafter's hidden state times the target's lm_head (V x H) for each
drafted slot, and the refiner's bias times its w2 (V x r) for each slot on every Jacobi pass. For a small target that
read-out is most of the speculator's work: SmolLM2-135M's lm_head is 49152 x 576, more weight than the one-layer
drafter that feeds it, and on the CPU it was more than half of the draft step. Yet a target's answers use few of its
tokens: counted in the embedded target's own answers to 8,100 prompts (`shared/data/distill`), its 8,192 most
frequent tokens hold 97.7% of the tokens of 450 other GSM8K answers and 91.9% of 450 other ShareGPT ones, and the
16,384 most frequent 99.1% and 96.7% (`python examples/draft_vocab_ab.py --data ...`).

So a speculator may carry a draft vocabulary (FR-Spec, Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary
Language Models via Frequency-Ranked Speculative Sampling"): token ids, most frequent first in the data it was
built from. The drafter's read-out and the add-on's (refiner or Markov head) then multiply only those rows, and
every other token gets logit -inf: it is never drafted. Verification still reads the target's full vocabulary, so
nothing about the output changes: greedy output is the target's own, and sampled output follows the target's
distribution, since q (zero outside the set) is still exactly the distribution each draft was sampled from. A token
outside the set ends the accepted run where the target writes it, which is the price: a lower tau where the target
writes rare tokens, measured against the cheaper step before a speculator ships with one.

Measured with the shipped speculator on a 2-core CPU (3 drafts per block, static and compiled, 12 GSM8K, HumanEval
and MT-Bench prompts, `model_cards/results/smollm2-135m-cpu/draft_vocab/`): with the 8,192-token vocabulary it ships
with, the draft step took 5.2 instead of 10.6 ms and the refinement 2.0 instead of 5.1 ms per block, tau was the same
(1.31), and xpress ran at 1.38x instead of 1.20x of plain compiled generate.

Drafting works over the set's N columns (`DraftReadOut`): the refiner's passes, the target's position-free logits
processors (temperature, top-k, top-p, ...: a token at -inf changes none of them), the sampling noise and the picks
(mapped to token ids, `token_ids_of`). Processors that read token ids (a repetition penalty) see the scores widened to
the whole vocabulary, -inf outside. Verification gets q over the whole vocabulary, -inf outside (`full_width`).
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Iterable

import torch
from torch import nn


def check_draft_vocab(token_ids: torch.Tensor, vocab_size: int, where: str = "The draft vocabulary") -> None:
    """Raise a ValueError saying what to do unless `token_ids` is a non-empty 1-D integer tensor of distinct ids of a
    vocabulary of `vocab_size` tokens."""
    if not isinstance(token_ids, torch.Tensor) or token_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{where} must be a 1-D tensor of int64 token ids, got "
                         f"{getattr(token_ids, 'dtype', type(token_ids).__name__)}.")
    if token_ids.dim() != 1 or token_ids.numel() == 0:
        raise ValueError(f"{where} must be a non-empty 1-D tensor of token ids, got shape {tuple(token_ids.shape)}.")
    low, high = int(token_ids.min()), int(token_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{where} holds token ids from {low} to {high}, outside the drafter's vocabulary of "
                         f"{vocab_size} tokens (its config's vocab_size): it was built for another tokenizer, or "
                         "that vocab_size was changed. Build it again from this target's data (top_tokens), or "
                         "restore the drafter's config.json.")
    if token_ids.unique().numel() != token_ids.numel():
        raise ValueError(f"{where} lists some token ids more than once: build it again (top_tokens) or deduplicate it.")


def top_tokens(sequences: Iterable[Iterable[int]], size: int, always: int | Iterable[int] | None = None
               ) -> torch.LongTensor:
    """The `size` token ids most frequent in `sequences` (the target's own answers), most frequent first, ties by id;
    `always` come first whatever their count: an id, ids or None, as a generation config's `eos_token_id` gives the
    EOS ids. Fewer when the data holds fewer distinct tokens."""
    if size < 1:
        raise ValueError(f"A draft vocabulary needs at least one token, got size={size}.")
    counts = Counter(token for sequence in sequences for token in sequence)
    if not counts:
        raise ValueError("No tokens to count: the draft vocabulary is built from the target's answers, and there are "
                         "none.")
    always = [] if always is None else [always] if isinstance(always, int) else always
    first = list(dict.fromkeys(int(t) for t in always))
    kept = set(first)
    ranked = [t for t, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])) if t not in kept]
    if len(first) + len(ranked) < size:
        warnings.warn(f"The answers hold {len(first) + len(ranked)} distinct tokens (EOS included), fewer than the "
                      f"{size} asked for: the draft vocabulary has {len(first) + len(ranked)}. Distill answers to "
                      "more prompts for a larger one.", stacklevel=2)
    return torch.tensor((first + ranked)[:size], dtype=torch.long)


class DraftReadOut(nn.Module):
    """`x @ weight.T` over the draft vocabulary only: scores (..., N) in the vocabulary's order, its draft columns.
    Stands in for the target's lm_head (the drafter's read-out) or the add-on's w2 (the refiner's or Markov head's
    bias). Holds a copy of the vocabulary's rows of `weight`, made once per `generate` call (the model's own weight
    stays as it is), and the `weight` attribute of the layer it stands in for.

    Drafting then stays in these N columns: the Jacobi passes add biases, processors run and tokens are picked over
    them (`candidates.DraftPicker`), and only q, the distribution handed to verification, is widened to the target's
    vocabulary, once per block (`full_width`). On the CPU, before that change, the full-width tensors of each pass
    (fill, scatter, add, concatenation, argmax over 49,152 columns per slot) were three quarters of xPress's refinement
    time, the matrix products a tenth."""

    def __init__(self, token_ids: torch.LongTensor, weight: torch.Tensor):
        super().__init__()
        check_draft_vocab(token_ids, weight.shape[0])
        # int64: index_copy_ and indexing take no other index type, and check_draft_vocab lets int32 ids through
        self.register_buffer("token_ids", token_ids.to(weight.device, torch.long), persistent=False)
        # The copy is stored transposed, (K, N): x @ W^T is then a plain product of two row-major matrices. On the
        # 2-core CPU it was the fastest layout or within 0.1 ms of it from 1 to 32 rows, for 8,192 x 576 and 8,192 x 64
        # (at 15 rows 1.37 ms against 2.53 for F.linear and 1.93 for `_cpu_linear`'s other layout, which pays a
        # strided copy of its result; `python examples/linear_cost.py --rows 1 2 3 4 8 15 32 --threads 2`).
        self.register_buffer("weight_t", weight.detach()[self.token_ids].T.contiguous(), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The vocabulary's rows of the weight, (N, K), as the layer it stands in for has them (a view)."""
        return self.weight_t.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight_t.dtype)
        return (x.reshape(-1, x.shape[-1]) @ self.weight_t).view(*x.shape[:-1], self.weight_t.shape[1])  # (..., N)


def token_ids_of(columns: torch.LongTensor, token_ids: torch.LongTensor | None) -> torch.LongTensor:
    """The token ids of draft columns: `token_ids[columns]`, or the columns themselves without a draft vocabulary."""
    return columns if token_ids is None else token_ids[columns]


def full_width(scores: torch.Tensor, token_ids: torch.LongTensor | None, vocab_size: int,
               fill: float = float("-inf")) -> torch.Tensor:
    """Scores over draft columns (..., N) written into rows over the whole vocabulary (..., vocab_size), `fill`
    elsewhere: -inf for logits (no probability outside the vocabulary). Unchanged without a draft vocabulary."""
    if token_ids is None:
        return scores
    out = scores.new_full((*scores.shape[:-1], vocab_size), fill)
    return out.index_copy_(-1, token_ids, scores)


def draft_read_outs(token_ids: torch.LongTensor | None, lm_head: nn.Module, *add_ons: nn.Module | None) -> tuple:
    """The read-outs `generate` drafts with: the drafter's (the target's lm_head, or its rows for the vocabulary
    `token_ids`: scores over its N columns) and one per add-on (refiner or Markov head; None reads all of its w2, as
    does an add-on without a vocabulary; else its rows). The rows are copied once, here."""
    if token_ids is None:
        return (lm_head, *(None for _ in add_ons))
    return (DraftReadOut(token_ids, lm_head.weight),
            *(None if add_on is None else DraftReadOut(token_ids, add_on.w2.weight) for add_on in add_ons))


class VocabRows(nn.Module):
    """`x @ layer.weight[token_ids].T`: scores over the draft vocabulary only, in its order ((..., N), no fill),
    reading the layer's live weight at every call so that a gradient reaches it. Training's counterpart of
    `DraftReadOut`: the losses are computed over the tokens a speculator can draft (`training.py`)."""

    def __init__(self, layer: nn.Module, token_ids: torch.LongTensor):
        super().__init__()
        object.__setattr__(self, "layer", layer)  # not a submodule: its weight belongs to the model that owns it
        self.token_ids = token_ids.to(layer.weight.device, torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.layer.weight[self.token_ids])
