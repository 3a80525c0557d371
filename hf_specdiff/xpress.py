"""xPress refiner: parallel (Jacobi) refinement of a diffusion drafter's block.

Paper: Wang et al. 2026, "xPress: Parallel Refinement for Diffusion Drafters in Speculative Decoding".

A block-diffusion drafter picks each slot k of the block from a marginal that does not know slots 1..k-1, so its
blocks are locally plausible but jointly incoherent. xPress adds to the drafter's logits at slot k a bias that
depends on the token guessed at slot k-1 (and, through a causal mixer, on all earlier guesses):

    fuse:   x_k = in_proj([down_h(h_k) ; down_g(g) ; w1(prev_k)])        h_k drafter hidden, g = mean_k h_k, r = rank
    mix:    x_k = x_k + sum_{j<=k} L[:, k, j] * x_j                       channel-wise, lower triangular, L = 0 at init
    trans:  x_k = x_k + down(silu(gate(x_k)) * up(x_k))                  SwiGLU, r -> mlp_ratio * r -> r
    read:   logits_k = drafter_logits_k + w2(x_k)                         w2: r -> V

prev_k is the token at slot k-1 (prev_1 = the anchor, prev_0 = the token before it). Causality comes from that
shift, so the mixer may include its diagonal. No norms, no biases.

Decoding (`jacobi_refine`): seed the block with the drafter's own picks, then K passes that each recompute every
prev from the current block and re-pick all slots at once; stop at a fixed point. Slot k's bias reads only the guesses
at slots 1..k-1, so pass p settles slot p (slot 1 reads only the anchor): n drafted slots are final after n passes,
and K is capped there, where a further pass could only confirm them.
When sampling, one Gumbel noise draw per block is reused by the seed and every pass, so the last pass's tokens
are exactly samples of the last pass's distribution, which is returned as q for verification.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers import initialization as init

from ._cpu_linear import linear
from .draft_vocab import token_ids_of


@strict
class XPressConfig(PreTrainedConfig):
    r"""Configuration of an xPress refiner.

    Args:
        hidden_size (`int`): H, the drafter's hidden size.
        vocab_size (`int`): V, the target's vocabulary size.
        rank (`int`, defaults to 256): r, width of the refiner.
        mlp_ratio (`int`, defaults to 2): SwiGLU hidden width is `mlp_ratio * rank`.
        block_size (`int`, defaults to 16): B, must equal the drafter's block size.
        num_jacobi_passes (`int`, defaults to 4): K, default number of parallel refinement passes at inference.
        initializer_range (`float`, defaults to 0.02): std of the normal init of every weight except the mixer.
        ce_weight, tv_weight, consistency_weight, anchor_weight (`float`): training loss weights: teacher-forced
            cross-entropy, total variation to the target distribution, consistency on a self-conditioned pass,
            and cross-entropy of the bare drafter logits.
    """

    model_type = "xpress"

    hidden_size: int = 4096
    vocab_size: int = 151936
    rank: int = 256
    mlp_ratio: int = 2
    block_size: int = 16
    num_jacobi_passes: int = 4
    initializer_range: float = 0.02
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    consistency_weight: float = 0.5
    anchor_weight: float = 0.1

    def __post_init__(self, **kwargs):
        for name in ("hidden_size", "vocab_size", "rank", "mlp_ratio", "num_jacobi_passes"):
            if getattr(self, name) < 1:
                raise ValueError(f"XPressConfig.{name} must be positive, got {getattr(self, name)}.")
        if self.block_size < 2:
            raise ValueError(f"XPressConfig.block_size must be at least 2, got {self.block_size}.")
        super().__post_init__(**kwargs)


class XPressRefiner(PreTrainedModel):
    config_class = XPressConfig
    base_model_prefix = "xpress"

    def __init__(self, config: XPressConfig):
        super().__init__(config)
        r, B = config.rank, config.block_size
        # fuse
        self.down_h = nn.Linear(config.hidden_size, r, bias=False)
        self.down_g = nn.Linear(config.hidden_size, r, bias=False)
        self.w1 = nn.Embedding(config.vocab_size, r)
        self.in_proj = nn.Linear(3 * r, r, bias=False)
        # mix: L[c, k, j], used only for j <= k
        self.mix = nn.Parameter(torch.zeros(r, B, B))
        # trans
        self.gate = nn.Linear(r, config.mlp_ratio * r, bias=False)
        self.up = nn.Linear(r, config.mlp_ratio * r, bias=False)
        self.down = nn.Linear(config.mlp_ratio * r, r, bias=False)
        # read
        self.w2 = nn.Linear(r, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)  # normal(0, initializer_range) for Linear and Embedding
        if module is self:
            init.zeros_(module.mix)  # the mixer starts as the identity (residual only)

    def block_context(self, h: torch.Tensor) -> torch.Tensor:
        """The part of the fused input that does not change across Jacobi passes: (b, B, 2r)."""
        g = h.mean(dim=1, keepdim=True)
        return torch.cat([self.down_h(h), self.down_g(g).expand(-1, h.shape[1], -1)], dim=-1)

    def forward(self, context: torch.Tensor, prev_tokens: torch.LongTensor, skip: int = 0,
                read_out: nn.Module | None = None) -> torch.Tensor:
        """Logit bias for slots 1+skip..n-1: (b, n-1-skip, V). `context` (b, n, 2r): the first n slots of
        `block_context`; `prev_tokens` (b, n). n = B for a whole block; fewer slots give the same bias for those
        slots, since nothing reads a later slot (the mixer is lower triangular), so a caller drafting fewer tokens
        skips the rest. `skip` leaves out the first read-outs (the vocabulary-sized part of the cost) where the
        caller already has them. `read_out` replaces w2 by its rows for a draft vocabulary (`draft_vocab.py`)."""
        n = prev_tokens.shape[1]
        x = self.in_proj(torch.cat([context, self.w1(prev_tokens)], dim=-1))  # (b, n, r)
        L = self.mix[:, :n, :n].tril()  # (r, n, n): keep j <= k
        x = x + torch.einsum("ckj,bjc->bkc", L, x)
        x = x + self.down(F.silu(self.gate(x)) * self.up(x))
        x = x[:, 1 + skip :]
        return linear(x, self.w2.weight) if read_out is None else read_out(x)


Picker = Callable[[torch.Tensor, "torch.LongTensor | None"], "tuple[torch.LongTensor, torch.Tensor]"]


@torch.no_grad()
def jacobi_refine(
    refiner: XPressRefiner,
    drafter_logits: torch.Tensor,
    drafter_hidden: torch.Tensor,
    anchor_tokens: torch.LongTensor,
    pick: Picker,
    num_passes: int,
    read_out: nn.Module | None = None,
    decoding: torch.Tensor | None = None,
) -> tuple[torch.LongTensor, torch.Tensor, int]:
    """Resolve a drafted block with K parallel refinement passes.

    Args:
        drafter_logits: (b, n, V) the drafter's logits for slots 1..n (n = B-1 for a whole block; fewer when the caller
            drafts fewer tokens: the refiner never reads a later slot); (b, n, N) over a draft vocabulary's columns,
            which `read_out` and `pick` then read out and pick over.
        drafter_hidden: (b, B, H) the drafter's final hidden states for all B slots.
        anchor_tokens: (b, 2) the token before the anchor and the anchor: prev of slots 0 and 1.
        pick: `pick(logits, assumed)` -> (tokens, processed logits); `assumed` are the block tokens that earlier
            slots are taken to hold (None: the picker's own picks). It applies the target's logits processors and
            the block's shared Gumbel noise, so the same noise is reused by every pass.
        num_passes: K; at most n are run (see the module docstring).
        read_out: the refiner's read-out over a draft vocabulary (`draft_vocab.DraftReadOut`); None: all of w2.
        decoding: (b,) bool, the rows whose blocks count (None: all): a static batch's finished rows are drafted and
            refined with the others but never offered, so their blocks neither keep the passes going nor count.
    Returns:
        tokens (b, n) (token ids), q (b, n, V or N): the processed logits the tokens were picked from, passes run.
    """
    tokens, q = pick(drafter_logits, None)  # seed: the drafter alone
    context = refiner.block_context(drafter_hidden)[:, : drafter_logits.shape[1] + 1]  # the drafted slots' prefix
    num_passes = min(num_passes, drafter_logits.shape[1])  # pass p settles slot p: n passes settle them all
    refined, passes, settled = drafter_logits, 0, 0
    while passes < num_passes:
        passes += 1
        prev = torch.cat([anchor_tokens, tokens[:, :-1]], dim=1)  # slot k sees the guess at slot k-1
        # A draft's logits depend only on the guesses before it, so those up to the first guess the last pass
        # changed come out as before: keep them and read out the rest only.
        bias = refiner(context, prev, skip=settled, read_out=read_out).to(drafter_logits.dtype)
        refined = torch.cat([refined[:, :settled], drafter_logits[:, settled:] + bias], dim=1)
        new_tokens, q = pick(refined, tokens)
        changed = new_tokens != tokens if decoding is None else (new_tokens != tokens) & decoding[:, None]
        changed = changed.any(dim=0).nonzero()  # slots changed in any row that counts (one host sync)
        tokens = new_tokens
        if not len(changed):  # fixed point: another pass would change nothing
            break
        settled = int(changed[0]) + 1
    return tokens, q, passes


@torch.no_grad()
def jacobi_refine_unrolled(
    refiner: XPressRefiner,
    drafter_logits: torch.Tensor,
    drafter_hidden: torch.Tensor,
    anchor_tokens: torch.LongTensor,
    num_passes: int,
    gumbel: torch.Tensor | None = None,
    warp: Callable[[torch.Tensor], torch.Tensor] | None = None,
    read_out: nn.Module | None = None,
    token_ids: torch.LongTensor | None = None,
    decoding: torch.Tensor | None = None,
) -> tuple[torch.LongTensor, torch.Tensor, torch.Tensor]:
    """`jacobi_refine` with the picker spelled out, written for torch.compile: no host sync and no data-dependent
    branch. `warp` maps float32 logits (b, n, V) to processed ones (the target's processors whose output does not
    depend on earlier tokens: temperature, top-k, top-p, ...; None: none); `gumbel` (b, n, V) is the block's noise
    when sampling, None for greedy; `read_out` and `decoding` as in `jacobi_refine`, with `token_ids` the ids of
    `read_out`'s columns (None: the columns are the ids). It always runs min(K, n) passes: a fixed point
    stays fixed (the same block gives the same logits), so the extra passes change nothing and the tokens and q are
    `jacobi_refine`'s. The number of passes `jacobi_refine` would have run is counted on the device.

    Returns tokens (b, n), q (b, n, V) float32, passes (0-d tensor)."""
    def pick(logits):
        q = logits.float() if warp is None else warp(logits.float())  # what `DraftPicker` returns
        return token_ids_of((q if gumbel is None else q + gumbel).argmax(dim=-1), token_ids), q

    tokens, q = pick(drafter_logits)
    context = refiner.block_context(drafter_hidden)[:, : drafter_logits.shape[1] + 1]
    num_passes = min(num_passes, drafter_logits.shape[1])  # as in `jacobi_refine`
    passes = torch.full((), num_passes, device=tokens.device)
    converged = torch.zeros((), dtype=torch.bool, device=tokens.device)
    for number in range(1, num_passes + 1):
        prev = torch.cat([anchor_tokens, tokens[:, :-1]], dim=1)
        new_tokens, q = pick(drafter_logits + refiner(context, prev, read_out=read_out).to(drafter_logits.dtype))
        same = new_tokens == tokens
        same = (same if decoding is None else same | ~decoding[:, None]).all()
        passes = torch.where(same & ~converged, number, passes)  # the pass at which `jacobi_refine` stops
        converged = converged | same
        tokens = new_tokens
    return tokens, q, passes
