"""Masked diffusion decoding (LLaDA / Dream / SDAR / Fast-dLLM), with Spiffy self-speculation as an option.

The answer region starts fully masked and is decoded block by block (semi-autoregressive, Nie et al. 2025,
"Large Language Diffusion Models"). Within a block, each step runs the model on the current state X(t) and
unmasks some positions (`unmask_step`):

    tokens     x0 = argmax(logits / T + Gumbel)  (argmax when T = 0; noise seeded by (seed, row, block, step))
    confidence low_confidence p(x0) | margin p1 - p2 | entropy -H(p) | random u   (p = softmax(logits))
    positions  the k most confident masked ones, k from an even split of the block over its steps, or
               (Fast-dLLM threshold unmasking, Wu et al. 2025) every one with confidence >= threshold, and at
               least the most confident one

Caches (`cache=`): "none" recomputes everything each step (exact); "prefix" and "dual" (Fast-dLLM) run one full
forward at the start of a block, then reuse the K/V of the prefix (and, for dual, of the masked suffix) while the
block is refined: approximations of "none" on a bidirectional model, used as decoding modes in their own right;
"block" (SDAR) commits each finished block's K/V on a block-causal model, which is exact.

Block-causal models (SDAR): prompt and answer share one grid of blocks aligned at position 0, as SDAR trains and
decodes, so the first decoded block finishes the prompt's last partial block (its prompt tokens stay fixed) and the
answer's blocks straddle no boundary the model never saw. Rows of a batch whose prompts end at different offsets in
their block are laid out internally with extra left padding (a multiple of block_length) so that the grid lines up
across rows. Where SDAR's reference would unmask more positions in a step than a partial block still has masked
(overwriting prompt tokens with predictions), only the masked ones are unmasked. Bidirectional models (LLaDA, Dream)
start the answer's first block right after the prompt, as their references do.

With `draft_graph=` (Spiffy, Agrawal et al. 2025, see `hf_specdiff.spiffy`), each forward also carries drafts of
future block states; the steps whose real result equals a draft are taken for free. Spiffy's output equals
ordinary decoding's in the same mode, exactly when drafts see nothing that depends on the real block (`exact`).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field, replace

import torch

from .._warnings import warn_at_caller

REMASKING_RULES = ("low_confidence", "margin", "entropy", "random")
# block_length left out: LLaDA's and Dream's; a draft graph's own and a block-causal model's trained one go first
# (`DiffusionGenerationConfig.for_model`)
DEFAULT_BLOCK_LENGTH = 32
CACHE_MODES = ("none", "prefix", "dual", "block")


@dataclass
class DiffusionGenerationConfig:
    """Decoding options for masked diffusion LMs (the reference implementations' knobs); each field's
    `metadata["help"]` says what it does (`hf-specdiff calibrate --help` shows them)."""

    max_new_tokens: int = field(default=128, metadata={"help": (
        "generation length: the answer canvas, a multiple of block_length")})
    block_length: int | None = field(default=None, metadata={"help": (
        "semi-autoregressive block size; None: the draft graph's (Spiffy), else the block size a block-causal model "
        f"was trained with (SDAR's config.json), else {DEFAULT_BLOCK_LENGTH}")})
    steps: int | None = field(default=None, metadata={"help": (
        "denoising steps over the whole answer, split evenly over blocks; None: max_new_tokens")})
    remasking: str = field(default="low_confidence", metadata={
        "help": "which masked positions are unmasked first", "choices": REMASKING_RULES})
    temperature: float = field(default=0.0, metadata={"help": (
        "0: greedy; > 0: Gumbel-max sampling in float64, noise seeded per (row, block, step)")})
    threshold: float | None = field(default=None, metadata={"help": (
        "Fast-dLLM: unmask every position with confidence >= threshold (steps unused); None: a fixed schedule")})
    cache: str = field(default="none", metadata={"help": (
        "key/value cache: none (exact); Fast-dLLM's prefix or dual (also the masked suffix), reused while a block is "
        "refined; block: each finished block committed (block-causal models, exact)"), "choices": CACHE_MODES})
    seed: int = field(default=0, metadata={"help": "seeds the sampling noise (and the random remasking rule)"})
    stop_at_eos: bool = field(default=True, metadata={"help": (
        "stop after the first block in which every row has produced an EOS token")})
    max_drafts: int = field(default=8, metadata={"help": (
        "Spiffy: drafts verified per forward after dynamic pruning (D*)")})

    def validate(self, model=None) -> None:
        """Refuse options that no decoding takes, and with `model`, those this model cannot decode with (model None:
        the options alone, checked before a model loads, block_length None accepted). With `model`, block_length
        must be named: validate `config.for_model(model, draft_graph)`."""
        for name in ("max_new_tokens", "block_length", "steps", "seed", "max_drafts"):
            value = getattr(self, name)
            if not (value is None and name in ("steps", "block_length")) and (isinstance(value, bool) or
                                                                             not isinstance(value, int)):
                raise TypeError(f"{name} must be an integer, got {value!r}.")
        for name in ("temperature", "threshold"):
            value = getattr(self, name)
            if not (value is None and name == "threshold") and (isinstance(value, bool) or
                                                                not isinstance(value, (int, float))):
                raise TypeError(f"{name} must be a number, got {value!r}.")
        if not isinstance(self.stop_at_eos, bool):
            raise TypeError(f"stop_at_eos must be True or False, got {self.stop_at_eos!r}.")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if model is not None and self.block_length is None:
            raise ValueError("block_length=None is the model's own block length: decode with config.for_model(model, "
                             "draft_graph), which names it.")
        # block_length None (checked before a model loads): what depends on it is checked once for_model names it
        if self.block_length is not None:
            self._check_blocks()
        if self.steps is not None and self.steps > self.max_new_tokens:
            raise ValueError(
                f"steps={self.steps} exceeds max_new_tokens={self.max_new_tokens}: every step unmasks at least one "
                "token, so at most max_new_tokens steps run. Use steps <= max_new_tokens (None: one token a step)."
            )
        if self.remasking not in REMASKING_RULES:
            raise ValueError(f"remasking={self.remasking!r} is not supported; choose one of {REMASKING_RULES}.")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}.")
        if self.threshold is not None and not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must lie in (0, 1], got {self.threshold}.")
        if self.threshold is not None and self.remasking in ("entropy", "random"):
            # their scores (-entropy <= 0, uniform noise) are no probability a threshold could be compared with
            raise ValueError(f"threshold={self.threshold} compares a probability; remasking={self.remasking!r} "
                             "scores positions otherwise. Use remasking='low_confidence' or 'margin' with it.")
        if self.cache not in CACHE_MODES:
            raise ValueError(f"cache={self.cache!r} is not supported; choose one of {CACHE_MODES}.")
        if self.max_drafts < 1:
            raise ValueError(f"max_drafts must be >= 1, got {self.max_drafts}.")
        if model is None:
            return
        if self.cache == "block" and not model.block_causal:
            raise ValueError(
                "cache='block' commits finished blocks, which is only valid for a block-causal model (SDAR); "
                "use cache='dual' or 'prefix' for a bidirectional model."
            )
        if model.shift_logits and model.block_causal:
            raise ValueError("A block-causal model with shifted logits is not supported; set one of them off.")
        if (trained := getattr(model, "trained_block_length", None)) and trained != self.block_length:
            # block-causal attention follows block_length: blocks of another size attend as in no training example
            warn_at_caller(
                f"This block-causal model was trained with blocks of {trained} tokens (its config.json's block_size), "
                f"and block_length={self.block_length} decodes it in blocks of another size, attending across "
                f"positions as it never did in training: expect worse answers. Pass block_length={trained} "
                f"(`--block-length {trained}`) unless that is what you mean to measure."
            )
        if self.cache != "none" and not getattr(model, "supports_kv", True):
            raise ValueError(
                f"cache={self.cache!r} needs a model that returns and reuses key/values; this adapter does not. "
                "Use cache='none', or wrap a model that implements the DiffusionLM forward contract."
            )

    def _check_blocks(self, source: str = "", other_block_length: str = " or another block_length") -> None:
        """The answer splits into whole blocks, each given the same number of steps. source: where a block length
        the caller did not give came from; other_block_length: the remedy of choosing another one, from there."""
        if self.block_length < 1:
            raise ValueError(f"block_length must be >= 1, got {self.block_length}.")
        if self.max_new_tokens % self.block_length:
            rounded_up = -(-self.max_new_tokens // self.block_length) * self.block_length
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} must be a positive multiple of block_length="
                f"{self.block_length}{source}: use max_new_tokens={rounded_up} (--max-new-tokens {rounded_up})"
                f"{other_block_length}."
            )
        num_blocks = self.max_new_tokens // self.block_length
        if self.steps is not None and (self.steps < num_blocks or self.steps % num_blocks):
            raise ValueError(
                f"steps={self.steps} must be a positive multiple of the number of blocks ({num_blocks} = "
                f"max_new_tokens / block_length{source}), so that every block gets the same number of steps."
            )

    def for_model(self, model, draft_graph=None) -> DiffusionGenerationConfig:
        """This config with block_length named where it is None: the draft graph's (a graph drafts for the block
        length it was calibrated with), else the block size a block-causal model was trained with (decoding in
        blocks of another size attends as in no training example), else DEFAULT_BLOCK_LENGTH. model None: a
        model that records no trained block size."""
        if self.block_length is not None:
            return self
        self.validate()  # the options alone first: a max_new_tokens of the wrong type is said as such
        trained = getattr(model, "trained_block_length", None)
        if draft_graph is not None:
            named = replace(self, block_length=draft_graph.block_length)
            source = " (the draft graph's, as block_length was left out)"
            # a graph refuses any other block length: the way out is another graph
            other = (", or calibrate a graph for a block length that divides it (`hf-specdiff calibrate "
                     "--block-length N`)")
        elif trained:
            named = replace(self, block_length=trained)
            source = " (the block size the model was trained with, as block_length was left out)"
            other = (", or pass a block_length that divides it (--block-length N), though the model then decodes in "
                     "blocks of a size it was not trained with")
        else:
            named = replace(self, block_length=DEFAULT_BLOCK_LENGTH)
            source = " (the default, as block_length was left out)"
            other = ", or pass a block_length that divides it (--block-length N)"
        named._check_blocks(source, other)
        return named

    @property
    def steps_per_block(self) -> int:
        if self.block_length is None:  # (else a TypeError about None and //)
            raise ValueError("steps_per_block depends on block_length, left out here: take it from "
                             "config.for_model(model, draft_graph), which names the block length decoded with.")
        return (self.steps or self.max_new_tokens) // (self.max_new_tokens // self.block_length)

    def is_exact_for(self, model) -> bool:
        """Whether Spiffy drafts see only K/V that does not depend on the real block: then Spiffy's output is
        ordinary decoding's, up to floating-point rounding (a forward carrying drafts has other matmul shapes, so in
        float32 / bfloat16 a near-tie, or a confidence at the threshold, can rarely flip; in float64 it does not)."""
        return bool(model.block_causal or self.cache == "dual")


@dataclass
class DiffusionGenerateOutput:
    """sequences: prompt + answer canvas; nfe: model forwards; unmasked_per_forward: (forwards, batch) tokens
    unmasked by each forward; accepted_drafts: (forwards, batch) Spiffy drafts taken for free per forward;
    exact: whether Spiffy's output is ordinary decoding's in this mode (up to floating-point rounding, see
    `DiffusionGenerationConfig.is_exact_for`)."""

    sequences: torch.LongTensor | None = None
    nfe: int = 0
    unmasked_per_forward: list = field(default_factory=list)
    accepted_drafts: list = field(default_factory=list)
    drafts_per_forward: int = 0
    exact: bool = True


# ----------------------------------------------------------------------------------------------------------------
# One denoising step
# ----------------------------------------------------------------------------------------------------------------


def transfer_schedule(block_length: int, steps: int) -> list[int]:
    """Tokens unmasked at each step of a block: an even split, the remainder going to the first steps (LLaDA)."""
    base, extra = divmod(block_length, steps)
    return [base + (i < extra) for i in range(steps)]


def confidence(logits: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(top token, confidence) per position from float64 probabilities; the random rule's scores come separately."""
    p = logits.double().softmax(dim=-1)
    top2 = p.topk(2, dim=-1)
    if rule == "margin":
        score = top2.values[..., 0] - top2.values[..., 1]
    elif rule == "entropy":
        score = (p * p.clamp_min(1e-300).log()).sum(dim=-1)  # -H: higher is more confident
    else:
        score = top2.values[..., 0]
    return top2.indices[..., 0], score


def without_mask_token(logits: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """float64 logits in which the mask token can never be chosen (unmasking a position into a mask is no step)."""
    logits = logits.double()
    logits[..., mask_token_id] = -torch.inf
    return logits


class Unmasker:
    """The decoding rule X(t) -> X(t+1) of one block: a pure function of (state, logits, row, block, step), so that
    ordinary decoding, Spiffy and calibration all take exactly the same steps."""

    def __init__(self, config: DiffusionGenerationConfig, mask_token_id: int, block: int):
        self.config, self.mask_token_id, self.block = config, mask_token_id, block
        self.schedule = transfer_schedule(config.block_length, config.steps_per_block)

    def _noise(self, shape, row: int, step: int, device) -> torch.Tensor:
        generator = torch.Generator(device=device)
        # a stable mix of the four: Python's hash of a tuple of ints collides (hash(-1) == hash(-2)), which gave two
        # seeds the same samples and the random rule's steps 0 and 1 (seeded -1 - t) the same noise
        key = f"{self.config.seed},{row},{self.block},{step}".encode()
        generator.manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1)
        return torch.rand(shape, generator=generator, device=device, dtype=torch.float64)

    def __call__(self, state: torch.LongTensor, logits: torch.Tensor, step: torch.LongTensor) -> torch.LongTensor:
        """state (b, L) block tokens, logits (b, L, V) the model's distribution for that state, step (b,) the step
        index of each row within the block. Returns the next state (rows without masks are returned unchanged)."""
        config = self.config
        masked = state == self.mask_token_id
        logits = without_mask_token(logits, self.mask_token_id)
        tokens, score = confidence(logits, config.remasking)
        if config.temperature > 0 or config.remasking == "random":
            for row in range(state.shape[0]):  # per-row noise so that a row's draws do not depend on the batch
                t = int(step[row])
                if config.temperature > 0:
                    u = self._noise(logits.shape[1:], row, t, logits.device)
                    gumbel = -(-u.clamp_min(1e-300).log()).log()
                    tokens[row] = (logits[row].double() / config.temperature + gumbel).argmax(dim=-1)
                    if config.remasking == "low_confidence":
                        score[row] = logits[row].double().softmax(-1).gather(-1, tokens[row, :, None])[:, 0]
                if config.remasking == "random":
                    score[row] = self._noise(state.shape[1:], row, -1 - t, logits.device)
        score = score.masked_fill(~masked, -torch.inf)
        order = score.argsort(dim=-1, descending=True, stable=True)
        rank = order.argsort(dim=-1)  # rank of each position by confidence
        num_masked = masked.sum(dim=-1)
        if config.threshold is not None:
            chosen = masked & ((score >= config.threshold) | (rank == 0))
        else:
            schedule = torch.tensor(self.schedule, device=state.device)
            k = schedule[step.clamp(max=len(self.schedule) - 1)].minimum(num_masked)
            chosen = masked & (rank < k[:, None])
        return torch.where(chosen, tokens, state)


# ----------------------------------------------------------------------------------------------------------------
# The canvas: prompt + answer, masks and caches
# ----------------------------------------------------------------------------------------------------------------


class Canvas:
    """Prompt (left-padded) + answer canvas, and the forward passes of each cache mode.

    Keys are addressed by absolute canvas position; each forward names its query positions and the cached context
    positions it reuses, and the attention mask follows from padding and (for block-causal models) block ids.
    """

    def __init__(self, model, input_ids, attention_mask, config: DiffusionGenerationConfig):
        b, width = input_ids.shape
        device = input_ids.device
        block_length, answer_length = config.block_length, config.max_new_tokens
        self.model, self.config = model, config
        prompt_valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        prompt_lengths = prompt_valid.sum(dim=1)
        if model.block_causal:  # SDAR grid: decoding starts at each row's last partial (or next whole) prompt block
            whole = prompt_lengths // block_length * block_length
            self.start = int(whole.max())
            offset = self.start - whole  # extra left padding per row, a multiple of block_length
            self.num_blocks = answer_length // block_length + int(bool((prompt_lengths % block_length).any()))
        else:
            self.start, offset = width, width - prompt_lengths
            self.num_blocks = answer_length // block_length
        self.length = self.start + self.num_blocks * block_length
        self.answer_start = offset + prompt_lengths  # (b,) column of each row's first answer token
        columns = torch.arange(self.length, device=device)
        self.valid = columns[None, :] >= offset[:, None]
        self.positions = (columns[None, :] - offset[:, None]).clamp(min=0)  # left padding does not shift positions
        self.block_of = self.positions // block_length  # used by block-causal models only
        self.x = torch.full((b, self.length), model.mask_token_id, dtype=input_ids.dtype, device=device)
        rows, prompt_columns = prompt_valid.nonzero(as_tuple=True)
        self.x[rows, prompt_columns - width + self.answer_start[rows]] = input_ids[rows, prompt_columns]
        self.shift = int(model.shift_logits)
        self.kv = None  # per layer (k, v) of the positions in `kv_positions`
        self.kv_positions = torch.arange(0, device=device)

    def block_range(self, block: int) -> tuple[int, int]:
        start = self.start + block * self.config.block_length
        return start, start + self.config.block_length

    def answers(self, end: int) -> torch.LongTensor:
        """(b, n) each row's answer tokens decoded up to canvas column `end` (at most max_new_tokens of them); where a
        row has fewer (its answer starts later in its first block), the rest are mask tokens (undecided)."""
        n = min(self.config.max_new_tokens, end - int(self.answer_start.min()))
        index = self.answer_start[:, None] + torch.arange(n, device=self.x.device)
        return self.x.gather(1, index.clamp(max=self.length - 1)).masked_fill(index >= end, self.model.mask_token_id)

    def attention_mask(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """(b, nq, nk) bool: key valid (not padding) and, on a block-causal model, not in a later block. A padding
        query attends to itself so that its (unused) softmax is defined."""
        allowed = self.valid[:, key_pos][:, None, :].expand(-1, len(query_pos), -1)
        if self.model.block_causal:
            allowed = allowed & (self.block_of[:, key_pos][:, None, :] <= self.block_of[:, query_pos][:, :, None])
        return allowed | (query_pos[:, None] == key_pos[None, :])

    def forward(self, query_pos, drafts=None, span=None, keep_kv=False):
        """One model forward over canvas positions `query_pos` with the cached context, plus Spiffy drafts.

        drafts (b, D, L): block states; each is run as a copy of the positions `span` (the block, plus the token
        before it when logits are shifted) with the draft in place of the block. A draft attends to the context
        and to the real queries outside the span, and to itself; real queries never attend to drafts.
        Returns (logits of the real queries, logits of the draft copies (b, D, m, V) or None, their K/V or None).
        """
        b, n = self.x.shape[0], len(query_pos)
        context_pos = self.kv_positions
        key_pos = torch.cat([context_pos, query_pos])
        mask = self.attention_mask(query_pos, key_pos)
        tokens, positions = self.x[:, query_pos], self.positions[:, query_pos]
        num_drafts = 0 if drafts is None else drafts.shape[1]
        if num_drafts:
            m = len(span)
            copies = self.x[:, span][:, None].repeat(1, num_drafts, 1)
            copies[:, :, self.shift :] = drafts
            outside = ~torch.isin(key_pos, span)
            draft_rows = self.attention_mask(span, key_pos) & outside
            own = self.attention_mask(span, span)
            total_keys = len(key_pos) + num_drafts * m
            full = mask.new_zeros(b, n + num_drafts * m, total_keys)
            full[:, :n, : len(key_pos)] = mask
            for d in range(num_drafts):
                rows = slice(n + d * m, n + (d + 1) * m)
                full[:, rows, : len(key_pos)] = draft_rows
                full[:, rows, len(key_pos) + d * m : len(key_pos) + (d + 1) * m] = own
            mask = full
            tokens = torch.cat([tokens, copies.flatten(1)], dim=1)
            positions = torch.cat([positions, self.positions[:, span].repeat(1, num_drafts)], dim=1)
        out = self.model(
            input_ids=tokens, position_ids=positions, attention_mask=mask[:, None],
            past_key_values=self.kv if len(context_pos) else None, return_key_values=keep_kv,
        )
        logits = out.logits
        draft_logits = logits[:, n:].unflatten(1, (num_drafts, -1)) if num_drafts else None
        kv = [(k[:, :, :n], v[:, :, :n]) for k, v in out.key_values] if keep_kv else None
        return logits[:, :n], draft_logits, kv

    def set_context(self, kv, kv_pos, keep_pos):
        """Cache the K/V of `keep_pos` out of a forward whose K/V covers `kv_pos`."""
        index = torch.searchsorted(kv_pos, keep_pos)
        self.kv = [(k[:, :, index], v[:, :, index]) for k, v in kv]
        self.kv_positions = keep_pos

    def step_forward(self, block: int, first_step: bool, drafts=None):
        """The forward of one denoising step of `block` in this cache mode; returns the block's logits (b, L, V)
        and, with drafts, theirs (b, D, L, V)."""
        start, end = self.block_range(block)
        device = self.x.device
        arange = lambda a, z: torch.arange(a, z, device=device)  # noqa: E731
        live_end = end if self.model.block_causal else self.length  # a block-causal block never sees later blocks
        span = arange(start - self.shift, end)
        mode = self.config.cache
        if mode == "none" or (first_step and mode in ("prefix", "dual")):
            self.kv, self.kv_positions = None, arange(0, 0)
            query = arange(0, live_end)
            logits, draft_logits, kv = self.forward(query, drafts, span, keep_kv=mode != "none")
            if mode == "prefix":
                self.set_context(kv, query, arange(0, start - self.shift))
            elif mode == "dual":
                self.set_context(kv, query, torch.cat([arange(0, start - self.shift), arange(end, live_end)]))
        elif mode == "block":
            committed = len(self.kv_positions)
            query = arange(committed, end)  # finished tokens not yet in the cache, then the block
            logits, draft_logits, kv = self.forward(query, drafts, span, keep_kv=committed < start)
            if committed < start:
                new = [(k[:, :, : start - committed], v[:, :, : start - committed]) for k, v in kv]
                self.kv = new if self.kv is None else [
                    (torch.cat([k0, k1], dim=2), torch.cat([v0, v1], dim=2)) for (k0, v0), (k1, v1) in zip(self.kv, new)
                ]
                self.kv_positions = arange(0, start)
        else:  # prefix / dual after the block's first step: recompute the live positions only
            query = arange(start - self.shift, live_end if mode == "prefix" else end)
            logits, draft_logits, _ = self.forward(query, drafts, span)
        offset = int((query == span[0]).nonzero()[0, 0])
        block_logits = logits[:, offset : offset + self.config.block_length]
        if draft_logits is not None:
            draft_logits = draft_logits[:, :, : self.config.block_length]
        return block_logits, draft_logits


# ----------------------------------------------------------------------------------------------------------------
# The decoding loop
# ----------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def diffusion_generate(
    model,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    config: DiffusionGenerationConfig | None = None,
    draft_graph=None,
    eos_token_id=None,
    recorder=None,
    streamer=None,
    on_forward=None,
) -> DiffusionGenerateOutput:
    """Decode the answer of `model` (a DiffusionLM or DiffusionAdapter) for left-padded prompts.

    draft_graph: a `hf_specdiff.spiffy.DraftGraph` turns Spiffy on. recorder: called after every ordinary step as
    recorder(block, step, state_before, logits, state_after) (calibration records trajectories with it).
    streamer: receives each finished block. on_forward: called after every forward as on_forward(block, answer),
    answer = the answer canvas so far (b, n) with mask tokens where undecided (to watch the blocks fill in).
    """
    from .. import spiffy

    config = (config or DiffusionGenerationConfig()).for_model(model, draft_graph)
    if draft_graph is not None:  # refused before validate warns of a block length other than a model's trained one
        draft_graph.check_block_length(config)
    config.validate(model)
    _check_prompt(input_ids, attention_mask)
    if (token := out_of_vocabulary(input_ids, attention_mask, model)) is not None:
        raise ValueError(
            f"input_ids hold token id {token}, outside the model's vocabulary ({model.config.vocab_size} tokens, ids 0 "
            f"to {model.config.vocab_size - 1}): tokenize the prompt with the model's own tokenizer."
        )
    if draft_graph is not None:
        draft_graph.check_compatible(config, getattr(model.config, "vocab_size", None), model)
        if recorder is not None:  # drafts take steps without an ordinary forward, which the recorder would miss
            raise ValueError("recorder= records ordinary decoding (calibration); drop draft_graph= to record.")
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("A streamer shows one sequence: use batch size 1 with streamer=..., or drop the streamer.")
    eos = _eos_ids(model, eos_token_id, input_ids.device)
    canvas = Canvas(model, input_ids, attention_mask, config)
    drafts_per_forward = min(config.max_drafts, len(draft_graph)) if draft_graph is not None else 0
    output = DiffusionGenerateOutput(drafts_per_forward=drafts_per_forward, exact=config.is_exact_for(model))
    mask_id, b = model.mask_token_id, input_ids.shape[0]
    if streamer is not None:
        streamer.put(input_ids.cpu())
    streamed = 0

    for block in range(canvas.num_blocks):
        start, end = canvas.block_range(block)
        unmask = Unmasker(config, mask_id, block)
        step = torch.zeros(b, dtype=torch.long, device=input_ids.device)
        in_hand = None  # the latest distribution over this block (of the state before the current one)
        first_step = True
        while bool(((state := canvas.x[:, start:end].clone()) == mask_id).any()):
            # 1. Draft (Spiffy): future states of this block from the graph, filled in from the distribution in hand.
            drafts = None
            if draft_graph is not None and in_hand is not None:
                drafts = spiffy.propose_drafts(draft_graph, state, in_hand, mask_id, config)
            # 2. One forward: the block, and every draft in its own attention island.
            logits, draft_logits = canvas.step_forward(block, first_step, None if drafts is None else drafts.tokens)
            output.nfe += 1
            first_step = False
            # 3. The real step; with drafts, then every further step whose state a draft already computed.
            if drafts is None:
                new_state = unmask(state, logits, step)
                if recorder is not None:
                    recorder(block, step.clone(), state, logits, new_state)
                step = step + (state == mask_id).any(dim=-1)
                accepted = torch.zeros_like(step)
                in_hand = logits
            else:
                new_state, in_hand, step, accepted = spiffy.accept_drafts(unmask, state, logits, step, drafts,
                                                                          draft_logits, mask_id)
            output.unmasked_per_forward.append(((state == mask_id) & (new_state != mask_id)).sum(-1).tolist())
            output.accepted_drafts.append(accepted.tolist())
            canvas.x[:, start:end] = new_state
            if on_forward is not None:
                on_forward(block, canvas.answers(end))
        answers = canvas.answers(end)
        if streamer is not None:
            streamer.put(answers[:, streamed:].cpu())
            streamed = answers.shape[1]
        if config.stop_at_eos and eos is not None and bool(torch.isin(answers, eos).any(dim=-1).all()):
            break
    if streamer is not None:
        streamer.end()
    # every row has an EOS when decoding stops early: a row whose answer starts later in its first block is filled
    # with EOS where its last block is still undecided
    fill = eos[0] if eos is not None else mask_id
    output.sequences = torch.cat([input_ids, answers.masked_fill(answers == mask_id, fill)], dim=1)
    return output


def _check_prompt(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    if not torch.is_tensor(input_ids):
        raise TypeError(f"input_ids must be a tensor of token ids (tokenizer(..., return_tensors='pt')), got "
                        f"{type(input_ids).__name__}.")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        # caught here, it would fail in the embedding lookup, deep in the first forward
        raise TypeError(f"input_ids must hold integer token ids, got {input_ids.dtype}: pass the tokenizer's ids "
                        "(torch.long), or .long() of them.")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (batch, prompt length) with at least one token, got "
                         f"{tuple(input_ids.shape)}.")
    if attention_mask is None:
        return
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must have input_ids' shape "
                         f"{tuple(input_ids.shape)}.")
    valid = attention_mask.bool()
    if not valid.any(dim=1).all():
        raise ValueError("A prompt is all padding (an attention_mask row of zeros): give every row at least one token.")
    if not valid[:, -1].all() or bool((valid[:, :-1] & ~valid[:, 1:]).any()):
        # the answer starts right after the last prompt column: a right-padded row would be read through its padding
        raise ValueError("Prompts must be left-padded (each attention_mask row 0...0 1...1, its last column 1): set "
                         "tokenizer.padding_side = 'left'.")


def out_of_vocabulary(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, model) -> int | None:
    """A prompt token id (padding aside: the canvas holds mask tokens there) that the model has no embedding for, or
    None. Caught here, it would fail deep in the forward as "IndexError: index out of range in self"."""
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab_size is None:
        return None
    ids = input_ids if attention_mask is None else input_ids[attention_mask.bool()]
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    return int(outside[0]) if len(outside) else None


def _eos_ids(model, eos_token_id, device):
    ids = eos_token_id if eos_token_id is not None else getattr(model.config, "eos_token_id", None)
    if ids is None:
        return None
    if isinstance(ids, torch.Tensor):
        ids = ids.flatten().tolist()
    ids = [ids] if isinstance(ids, int) else ids
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TypeError(f"eos_token_id must be a token id or a list of them, got {eos_token_id!r}.")
    if not ids:
        raise ValueError("eos_token_id is an empty list: give at least one id, or None (no EOS: decode every block).")
    return torch.tensor(ids, device=device)


# ----------------------------------------------------------------------------------------------------------------
# generate() for diffusion LMs (bound on one model by `hf_specdiff.enable`)
# ----------------------------------------------------------------------------------------------------------------

_OPTION_NAMES = {f for f in DiffusionGenerationConfig.__dataclass_fields__}


def generate_before_enable(model, *args, **kwargs):
    """`generate` of a diffusion LM that was not enabled: decoding is opt-in per model, as for causal LMs."""
    raise AttributeError(
        f"{type(model).__name__}.generate is hf_specdiff's diffusion decoding, which is opt-in per model: call "
        "hf_specdiff.enable(model) first."
    )


def diffusion_lm_generate(model, input_ids=None, attention_mask=None, *, speculation=None, draft_graph=None,
                          generation_config: DiffusionGenerationConfig | None = None, do_sample=None,
                          return_dict_in_generate=False, eos_token_id=None, streamer=None, **options):
    """`model.generate(...)` for a masked diffusion LM: the reference knobs as keyword arguments (see
    `DiffusionGenerationConfig`), `speculation="spiffy"` with `draft_graph=` (a DraftGraph, a folder or Hub id).
    Returns the sequences, or with return_dict_in_generate=True a `DiffusionGenerateOutput` (NFE, unmask counts)."""
    from ..spiffy import DraftGraph

    unknown = sorted(set(options) - _OPTION_NAMES)
    if unknown:
        raise TypeError(
            f"generate() of a diffusion LM got unsupported arguments {unknown}; it takes {sorted(_OPTION_NAMES)} "
            "plus input_ids, attention_mask, speculation, draft_graph, do_sample, eos_token_id, streamer, "
            "generation_config and return_dict_in_generate."
        )
    if input_ids is None:
        raise ValueError("generate() of a diffusion LM needs input_ids (the tokenized prompt).")
    if generation_config is not None and not isinstance(generation_config, DiffusionGenerationConfig):
        raise TypeError(
            f"generation_config of a diffusion LM is a hf_specdiff DiffusionGenerationConfig, got "
            f"{type(generation_config).__name__}; pass that, or the options as keyword arguments (max_new_tokens=..., "
            "temperature=...)."
        )
    config = DiffusionGenerationConfig(**{**(vars(generation_config) if generation_config else {}), **options})
    if do_sample is True and options.get("temperature") == 0:
        raise ValueError("do_sample=True contradicts temperature=0 (greedy); drop one of them.")
    if do_sample is True and config.temperature == 0:
        config.temperature = 1.0  # transformers' default temperature for sampling
    elif do_sample is False and config.temperature > 0:
        raise ValueError(f"do_sample=False contradicts temperature={config.temperature}; drop one of them.")
    if speculation not in (None, "spiffy"):
        raise ValueError(f"speculation={speculation!r} is not supported for diffusion LMs; use None or 'spiffy'.")
    if speculation == "spiffy":
        if draft_graph is None:
            raise ValueError("speculation='spiffy' needs draft_graph= (a DraftGraph, or a folder / Hub id holding "
                             "spiffy_graph.json; make one with `hf-specdiff calibrate`).")
        if not isinstance(draft_graph, (DraftGraph, str, os.PathLike)):
            hint = ""
            if isinstance(draft_graph, dict):
                hint = " (a dict from DraftGraph.to_dict: pass DraftGraph.from_dict(it))"
            raise TypeError(f"draft_graph= takes a DraftGraph or a folder / Hub id, got {type(draft_graph).__name__}"
                            f"{hint}.")
        if not isinstance(draft_graph, DraftGraph):
            draft_graph = DraftGraph.from_pretrained(draft_graph)
        if not config.is_exact_for(model):
            warn_at_caller(
                f"Spiffy with cache={config.cache!r} on a bidirectional model is near-lossless only: its drafts see "
                "keys and values computed with the real block, so its output can differ from ordinary decoding's "
                "(out.exact is False). Use cache='dual' for output identical to ordinary dual-cache decoding."
            )
    elif draft_graph is not None or "max_drafts" in options:
        option = "draft_graph=" if draft_graph is not None else "max_drafts="
        raise ValueError(f"{option} is used by speculation='spiffy' only; add speculation='spiffy' or drop it.")
    output = diffusion_generate(model, input_ids, attention_mask, config, draft_graph, eos_token_id,
                                streamer=streamer)
    return output if return_dict_in_generate else output.sequences
