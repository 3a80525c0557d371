"""Drafting candidates for verification: a transformers `CandidateGenerator` for dFlash, xPress and the Markov head.

`BlockDiffusionCandidateGenerator` follows transformers' protocol for generators that need the target's outputs
(`requires_model_outputs = True`): it is called with the target's hidden states of its last forward and returns the
candidate ids and q, the processed logits each draft token was picked from. The target's logits processors and
warpers are applied to the draft logits exactly as the verifier applies them to the target's, so that for sampling
q is the true draft distribution; the refiner only ever touches draft logits, never the target's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from . import _compat
from .markov import markov_decode
from .xpress import jacobi_refine

# Processors whose output at a position does not depend on the tokens before it: these run on a whole block at
# once. Anything else (repetition penalty, min length, bad words, ...) runs position by position.
_POSITION_FREE_PROCESSORS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)


def process_logits(
    processors: LogitsProcessorList | None, sequence: torch.LongTensor, logits: torch.Tensor, first: int
) -> torch.Tensor:
    """Apply `processors` to a run of positions: `logits[:, i]` (b, n, V) is scored with the prefix
    `sequence[:, :first + i]`, exactly as plain `generate` would score it there. Returns float32 (b, n, V)."""
    logits = logits.float()
    if not processors:
        return logits
    b, n, vocab = logits.shape
    if all(isinstance(p, _POSITION_FREE_PROCESSORS) for p in processors):
        flat_prefix = sequence[:, :first].repeat_interleave(n, dim=0)
        return processors(flat_prefix, logits.reshape(b * n, vocab)).view(b, n, vocab)
    return torch.stack([processors(sequence[:, : first + i], logits[:, i]) for i in range(n)], dim=1)


class DraftPicker:
    """Picks draft tokens from draft logits the way the target will judge them.

    Greedy: argmax of the processed logits. Sampling: Gumbel-max over the processed logits with one noise draw per
    block, shared by every pick inside the block (the xPress seed and all Jacobi passes), so a token is always an
    exact sample of the processed distribution it was picked from.
    """

    def __init__(self, processors: LogitsProcessorList | None, do_sample: bool):
        self.processors = processors
        self.do_sample = do_sample
        self.prefix: torch.LongTensor | None = None
        self.gumbel: torch.Tensor | None = None

    def start_block(self, prefix: torch.LongTensor, num_slots: int, vocab_size: int) -> None:
        self.prefix = prefix
        if self.do_sample:
            exponential = torch.empty(prefix.shape[0], num_slots, vocab_size, device=prefix.device).exponential_()
            self.gumbel = -exponential.log()

    def _choose(self, processed: torch.Tensor, slots: slice | int) -> torch.LongTensor:
        return (processed + self.gumbel[:, slots] if self.do_sample else processed).argmax(dim=-1)

    def pick_slot(self, logits: torch.Tensor, slot: int, earlier: torch.LongTensor):
        """One slot: logits (b, V); `earlier` (b, slot) are the block tokens before it."""
        sequence = torch.cat([self.prefix, earlier], dim=1)
        processed = process_logits(self.processors, sequence, logits[:, None], sequence.shape[1])[:, 0]
        return self._choose(processed, slot), processed

    def __call__(self, logits: torch.Tensor, assumed: torch.LongTensor | None):
        """All slots at once: logits (b, n, V). Earlier slots are taken to hold `assumed` (b, n); with None, each
        slot's prefix holds the tokens just picked for the slots before it."""
        if assumed is not None or not self.processors or all(
            isinstance(p, _POSITION_FREE_PROCESSORS) for p in self.processors
        ):
            context = self.prefix if assumed is None else torch.cat([self.prefix, assumed], dim=1)
            processed = process_logits(self.processors, context, logits, self.prefix.shape[1])
            return self._choose(processed, slice(0, logits.shape[1])), processed
        tokens, processed = [], []
        for slot in range(logits.shape[1]):
            earlier = torch.stack(tokens, dim=1) if tokens else self.prefix[:, :0]
            token, slot_processed = self.pick_slot(logits[:, slot], slot, earlier)
            tokens.append(token)
            processed.append(slot_processed)
        return torch.stack(tokens, dim=1), torch.stack(processed, dim=1)


@dataclass
class SpeculationStats:
    """What speculation did during one `generate` call (returned with `return_dict_in_generate=True`)."""

    method: str
    accepted_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify step, bonus included
    drafted_lengths: list[int] = field(default_factory=list)  # draft tokens offered per verify step
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # draft tokens the target accepted (bonus tokens excluded)
    target_forwards: int = 0  # prefill included
    refine_passes: list[int] = field(default_factory=list)  # Jacobi passes per block (xpress)
    draft_seconds: float = 0.0
    refine_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Mean accepted length per verify step, bonus token included."""
        return sum(self.accepted_lengths) / max(len(self.accepted_lengths), 1)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / max(self.drafted_tokens, 1)

    def accepted_at_position(self) -> tuple[list[int], list[int]]:
        """(accepted, offered) counts per block position: a draft at position i is offered when the step drafted
        more than i tokens and accepted when more than i were accepted."""
        size = max(self.drafted_lengths, default=0)
        accepted, offered = [0] * size, [0] * size
        for drafted, emitted in zip(self.drafted_lengths, self.accepted_lengths):
            for i in range(drafted):
                offered[i] += 1
                accepted[i] += int(emitted - 1 > i)
        return accepted, offered

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "accepted_lengths": list(self.accepted_lengths),
            "drafted_lengths": list(self.drafted_lengths),
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "target_forwards": self.target_forwards,
            "refine_passes": list(self.refine_passes),
            "draft_seconds": self.draft_seconds,
            "refine_seconds": self.refine_seconds,
            "verify_seconds": self.verify_seconds,
        }


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that host timers measure it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class BlockDiffusionCandidateGenerator(CandidateGenerator):
    """Drafts a block with the dFlash drafter and resolves it with the chosen method.

    method: `"dflash"` (drafter marginals), `"xpress"` (Jacobi refinement, K passes) or `"markov"` (sequential head).
    """

    requires_model_outputs = True
    model_kwargs_overrides = {"output_hidden_states": True}

    def __init__(
        self,
        target,
        speculator,
        method: str,
        generation_config,
        logits_processor: LogitsProcessorList | None = None,
        num_jacobi_passes: int | None = None,
        stats: SpeculationStats | None = None,
    ):
        self.drafter = speculator.drafter
        self.refiner = speculator.refiner
        self.markov_head = speculator.markov_head
        self.method = method
        self.num_jacobi_passes = num_jacobi_passes or (self.refiner.config.num_jacobi_passes if self.refiner else 0)
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.max_length = generation_config.max_length
        self.block_size = self.drafter.config.block_size
        self.mask_token_id = self.drafter.config.mask_token_id
        self.picker = DraftPicker(logits_processor, generation_config.do_sample)
        self.cache = DynamicCache()  # the drafter's context K/V; never holds block K/V between calls
        self.stats = stats if stats is not None else SpeculationStats(method)
        self.device = self.drafter.device

    @torch.no_grad()
    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False,
                       n_last_matches=0, **kwargs):
        """input_ids (b, L) ends with the anchor (the target's last token, not yet in its cache). Returns
        (candidate ids (b, L + n), q (b, n, V)); `(input_ids, None)` when nothing can be drafted."""
        # The first call comes before the target's prefill: there are no hidden states to draft from yet.
        if is_first_iteration:
            return input_ids, None
        num_drafts = min(self.block_size - 1, self.max_length - input_ids.shape[1] - 1)
        if num_drafts <= 0:
            return input_ids, None
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("BlockDiffusionCandidateGenerator needs the target's hidden states of its last forward.")

        # 1. Draft: features of the tokens the target just verified (all but the anchor), then one drafter pass.
        synchronize(self.device)
        start = time.perf_counter()
        length = input_ids.shape[1]
        num_new = length - 1 - self.cache.get_seq_length()  # verified tokens whose features are not cached yet
        features = self.drafter.context_features(model_outputs.hidden_states, num_new).to(self.device)
        block_ids = torch.full((input_ids.shape[0], self.block_size), self.mask_token_id, device=input_ids.device)
        block_ids[:, 0] = input_ids[:, -1]
        positions = torch.arange(length - 1 - num_new, length - 1 + self.block_size, device=self.device)
        hidden = self.drafter(
            noise_embeds=self.embed_tokens(block_ids).to(self.device),
            context_hidden_states=features,
            position_ids=positions.expand(input_ids.shape[0], -1),
            cache=self.cache,
        ).last_hidden_state
        _compat.crop_cache(self.cache, self.block_size)  # keep context K/V only
        drafter_logits = self.lm_head(hidden[:, 1:].to(self.lm_head.weight.dtype)).float()  # (b, B-1, V)
        synchronize(self.device)
        self.stats.draft_seconds += time.perf_counter() - start

        # 2. Resolve the block: marginals (dflash), Jacobi refinement (xpress) or left to right (markov).
        start = time.perf_counter()
        self.picker.start_block(input_ids, self.block_size - 1, drafter_logits.shape[-1])
        if self.method == "xpress":
            tokens, q, passes = jacobi_refine(
                self.refiner, drafter_logits, hidden, input_ids[:, -2:], self.picker, self.num_jacobi_passes
            )
            self.stats.refine_passes.append(passes)
        elif self.method == "markov":
            tokens, q = markov_decode(self.markov_head, drafter_logits, input_ids[:, -1], self.picker.pick_slot)
        else:
            tokens, q = self.picker(drafter_logits, None)
        synchronize(self.device)
        self.stats.refine_seconds += time.perf_counter() - start

        self.stats.drafted_tokens += num_drafts
        candidate_ids = torch.cat([input_ids, tokens[:, :num_drafts].to(input_ids.device)], dim=1)
        return candidate_ids, q[:, :num_drafts]
