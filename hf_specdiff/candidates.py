"""Drafting candidates for verification: a transformers `CandidateGenerator` for dFlash, xPress and the Markov head.

`BlockDiffusionCandidateGenerator` follows transformers' protocol for generators that need the target's outputs
(`requires_model_outputs = True`): it is called with the target's hidden states of its last forward and returns the
candidate ids and q, the processed logits each draft token was picked from. The target's logits processors and
warpers are applied to the draft logits exactly as the verifier applies them to the target's, so that for sampling
q is the true draft distribution; the refiner only ever touches draft logits, never the target's.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from . import _compat
from ._cpu_linear import few_row_linears
from .batching import RowBatch, append_ragged, last_tokens
from .draft_vocab import draft_read_outs, full_width, token_ids_of
from .markov import markov_decode
from .xpress import jacobi_refine, jacobi_refine_unrolled

# Processors whose output at a position does not depend on the tokens before it, nor on which token a column is: these
# run on a whole block at once (and on a draft vocabulary's columns as they are). Anything else (repetition penalty, min
# length, bad words, suppressed tokens, ...) runs position by position, a call per slot and per Jacobi pass: one of
# these left out of the list (top_h measured) made xpress's refinement of the shipped speculator 4x slower.
_POSITION_FREE_PROCESSORS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TopHLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitNormalization,
    InfNanRemoveLogitsProcessor,
)


def position_free(processors: LogitsProcessorList | None) -> bool:
    """Whether every processor scores a position without reading the tokens before it (true with none). Exact
    types only: a subclass may override `__call__` and read the prefix."""
    return all(type(p) in _POSITION_FREE_PROCESSORS for p in processors or [])


def apply_position_free(processors: LogitsProcessorList, logits: torch.Tensor) -> torch.Tensor:
    """Position-free processors on float32 logits (b, n, V), every position in one call. They never read the
    prefix, so a one-token stand-in takes its place (which also keeps a compiled caller's input shapes constant)."""
    b, n, vocab = logits.shape
    stand_in = torch.zeros(b * n, 1, dtype=torch.long, device=logits.device)
    return processors(stand_in, logits.reshape(b * n, vocab)).view(b, n, vocab)


def process_logits(
    processors: LogitsProcessorList | None,
    sequence: torch.LongTensor,
    logits: torch.Tensor,
    first: int | list[int],
    rows: RowBatch | None = None,
) -> torch.Tensor:
    """Apply `processors` to a run of positions: `logits[:, i]` (b, n, V) is scored with the prefix
    `sequence[:, :first + i]`, exactly as plain `generate` would score it there. Returns float32 (b, n, V).

    Batched decoding: `first` holds one int per row when rows differ in length (`sequence` is then right-filled past
    each row's end), and `rows` says which row of the original batch each row is. Processors are always called with
    the whole original batch, every row in its place (some keep per-row state, e.g. the repetition penalty's prompt
    padding); rows with nothing to score at that length are filler, and their output is dropped."""
    logits = logits.float()
    if not processors:
        return logits
    b, n, vocab = logits.shape
    starts = [first] * b if isinstance(first, int) else list(first)
    if position_free(processors):
        return apply_position_free(processors, logits)
    if len(set(starts)) == 1 and (rows is None or len(rows.rows) == rows.batch_size):
        return torch.stack([processors(sequence[:, : starts[0] + i], logits[:, i]) for i in range(n)], dim=1)
    # One call per prefix length, over the (row, position) pairs that share it.
    index, batch_size = (rows.rows, rows.batch_size) if rows is not None else (list(range(b)), b)
    by_length: dict[int, list[tuple[int, int]]] = {}
    for row, start in enumerate(starts):
        for i in range(n):
            by_length.setdefault(start + i, []).append((row, i))
    processed = torch.empty_like(logits)
    for length, pairs in sorted(by_length.items()):
        row, position = torch.tensor(pairs, device=logits.device).T
        place = torch.tensor([index[r] for r, _ in pairs], device=logits.device)  # rows of the original batch
        prefixes = sequence.new_zeros(batch_size, length).index_copy(0, place, sequence[row, :length])
        scores = logits.new_zeros(batch_size, vocab).index_copy(0, place, logits[row, position])
        processed[row, position] = processors(prefixes, scores)[place]
    return processed


class DraftPicker:
    """Picks draft tokens from draft logits the way the target will judge them.

    Greedy: argmax of the processed logits. Sampling: Gumbel-max over the processed logits with one noise draw per
    block, shared by every pick inside the block (the xPress seed and all Jacobi passes), so a token is always an
    exact sample of the processed distribution it was picked from.

    With a draft vocabulary (`token_ids`, N ids of a `vocab_size`-token vocabulary) the logits it is given are over its
    N draft columns (`draft_vocab.DraftReadOut`), and so are the processed logits it returns; the tokens are ids.
    Position-free processors run on the N columns as they are; any other sees them widened to the whole vocabulary
    (-inf outside), since it reads token ids.
    """

    def __init__(self, processors: LogitsProcessorList | None, do_sample: bool,
                 token_ids: torch.LongTensor | None = None, vocab_size: int | None = None):
        self.processors = processors
        self.do_sample = do_sample
        self.token_ids, self.vocab_size = token_ids, vocab_size
        self.prefix: torch.LongTensor | None = None
        self.rows: RowBatch | None = None
        self.gumbel: torch.Tensor | None = None

    def start_block(self, prefix: torch.LongTensor, num_slots: int, num_columns: int, rows: RowBatch | None = None):
        """prefix (b, L): the sequence the block continues; `rows` when its rows end at different places (row i is
        `prefix[i, :rows.lengths[i]]`) or some rows of the batch have finished, None when every row is full."""
        self.prefix, self.rows = prefix, rows
        if self.do_sample:
            exponential = torch.empty(prefix.shape[0], num_slots, num_columns, device=prefix.device).exponential_()
            self.gumbel = -exponential.log()

    @property
    def lengths(self) -> list[int] | None:
        return None if self.rows is None else self.rows.lengths

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """This picker's position-free processors on float32 logits (b, n, V), as `process_logits` applies them."""
        return apply_position_free(self.processors, logits)

    def _first(self, offset: int = 0) -> int | list[int]:
        return self.prefix.shape[1] + offset if self.rows is None else [n + offset for n in self.rows.lengths]

    def _process(self, sequence: torch.LongTensor, logits: torch.Tensor, first: int | list[int]) -> torch.Tensor:
        """`process_logits` over this picker's columns: (b, n, columns) float32."""
        if self.token_ids is None or position_free(self.processors):
            return process_logits(self.processors, sequence, logits, first, self.rows)
        widened = full_width(logits, self.token_ids, self.vocab_size)
        return process_logits(self.processors, sequence, widened, first, self.rows)[..., self.token_ids]

    def _choose(self, processed: torch.Tensor, slots: slice | int) -> torch.LongTensor:
        columns = (processed + self.gumbel[:, slots] if self.do_sample else processed).argmax(dim=-1)
        return token_ids_of(columns, self.token_ids)

    def pick_slot(self, logits: torch.Tensor, slot: int, earlier: torch.LongTensor):
        """One slot: logits (b, columns); `earlier` (b, slot) are the block tokens before it."""
        sequence = append_ragged(self.prefix, self.lengths, earlier)
        processed = self._process(sequence, logits[:, None], self._first(slot))[:, 0]
        return self._choose(processed, slot), processed

    def __call__(self, logits: torch.Tensor, assumed: torch.LongTensor | None):
        """All slots at once: logits (b, n, columns). Earlier slots are taken to hold `assumed` (b, n); with None,
        each slot's prefix holds the tokens just picked for the slots before it."""
        if assumed is not None or position_free(self.processors):
            context = self.prefix if assumed is None else append_ragged(self.prefix, self.lengths, assumed)
            processed = self._process(context, logits, self._first())
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
    """What speculation did during one `generate` call (returned with `return_dict_in_generate=True`).

    One verify step of one row is one entry of `accepted_lengths` / `drafted_lengths`: with a batch, a target forward
    verifies every unfinished row at once and adds one entry per row (step by step, rows in batch order), so `tau` stays
    the mean number of tokens a row gains per target forward. `row_accepted_lengths[r]` / `row_drafted_lengths[r]`
    hold row r's own entries (`row_tau[r]` their mean); `target_forwards` counts batched forwards.
    """

    method: str
    accepted_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify step and row, bonus included
    drafted_lengths: list[int] = field(default_factory=list)  # draft tokens offered per verify step and row
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # draft tokens the target accepted (bonus tokens excluded)
    target_forwards: int = 0  # the prefill (one, chunked or not), then one per verify step, whatever the batch size
    refine_passes: list[int] = field(default_factory=list)  # Jacobi passes per (batched) block (xpress)
    accepted_draft_lengths: list[int] = field(default_factory=list)  # drafts accepted and kept per verify step and row
    blocks: int = 0  # (batched) blocks drafted, the first included
    draft_seconds: float = 0.0  # drafting every block but the first
    refine_seconds: float = 0.0  # resolving every block (xpress / markov / dflash)
    verify_seconds: float = 0.0  # every target forward but the prefill
    prefill_seconds: float = 0.0  # the target's prefill forward
    draft_prefill_seconds: float = 0.0  # drafting the first block and reading the whole prompt's context
    batch_size: int = 1
    compiled: bool = False  # the verify forward ran through torch.compile (a static cache where transformers compiles)
    row_accepted_lengths: list[list[int]] = field(default_factory=list)  # per row of the batch: its accepted_lengths
    row_drafted_lengths: list[list[int]] = field(default_factory=list)  # per row of the batch: its drafted_lengths

    def __post_init__(self):
        self.row_accepted_lengths = self.row_accepted_lengths or [[] for _ in range(self.batch_size)]
        self.row_drafted_lengths = self.row_drafted_lengths or [[] for _ in range(self.batch_size)]

    def add_step(self, rows: list[int], emitted: list[int], drafted: list[int], accepted: list[int]) -> None:
        """One verify step: `rows` are the batch rows it verified; row i emitted `emitted[i]` tokens (after any stop)
        out of `drafted[i]` drafts offered (those that fit before its max length), `accepted[i]` of which the target
        accepted."""
        for row, num_emitted, num_drafted, num_accepted in zip(rows, emitted, drafted, accepted):
            self.accepted_lengths.append(num_emitted)
            self.drafted_lengths.append(num_drafted)
            self.accepted_draft_lengths.append(min(num_accepted, num_emitted))
            self.accepted_tokens += min(num_accepted, num_emitted)
            self.row_accepted_lengths[row].append(num_emitted)
            self.row_drafted_lengths[row].append(num_drafted)

    @property
    def tau(self) -> float:
        """Mean accepted length per verify step and row, bonus token included: tokens per target forward per row."""
        return sum(self.accepted_lengths) / max(len(self.accepted_lengths), 1)

    @property
    def row_tau(self) -> list[float | None]:
        """`tau` of each row of the batch; None for a row that no verify step reached (it finished at the prefill: its
        first token was EOS, or max_new_tokens=1), where a 0 would read as a row that accepted nothing."""
        return [sum(lengths) / len(lengths) if lengths else None for lengths in self.row_accepted_lengths]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / max(self.drafted_tokens, 1)

    def accepted_at_position(self) -> tuple[list[int], list[int]]:
        """(accepted, offered) counts per block position: a draft at position i is offered when the step drafted
        more than i tokens and accepted when more than i were accepted. A step that stopped (EOS, stop string, max
        length) on an accepted draft offered only the drafts up to the stop: those after it were never needed."""
        size = max(self.drafted_lengths, default=0)
        accepted, offered = [0] * size, [0] * size
        for drafted, emitted, kept_drafts in zip(self.drafted_lengths, self.accepted_lengths,
                                                 self.accepted_draft_lengths):
            for i in range(emitted if emitted <= kept_drafts else drafted):
                offered[i] += 1
                accepted[i] += int(i < kept_drafts)
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
            "accepted_draft_lengths": list(self.accepted_draft_lengths),
            "blocks": self.blocks,
            "draft_seconds": self.draft_seconds,
            "refine_seconds": self.refine_seconds,
            "verify_seconds": self.verify_seconds,
            "prefill_seconds": self.prefill_seconds,
            "draft_prefill_seconds": self.draft_prefill_seconds,
            "batch_size": self.batch_size,
            "compiled": self.compiled,
            "row_tau": self.row_tau,
            "row_accepted_lengths": [list(lengths) for lengths in self.row_accepted_lengths],
            "row_drafted_lengths": [list(lengths) for lengths in self.row_drafted_lengths],
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
        static_cache_length: int | None = None,
        compile_config=None,
        num_draft_tokens: int | None = None,
        batch_size: int = 1,
        unseen_prefix: int = 0,
        context_cache: DynamicCache | None = None,
    ):
        self.drafter = speculator.drafter
        self.refiner = speculator.refiner
        self.markov_head = speculator.markov_head
        self.method = method
        self.num_jacobi_passes = num_jacobi_passes or (self.refiner.config.num_jacobi_passes if self.refiner else 0)
        self.embed_tokens = whole(target.get_input_embeddings())
        self.lm_head = whole(target.get_output_embeddings())
        # Read-outs of the drafts: the target's lm_head and the add-on's w2, or their rows for the speculator's draft
        # vocabulary (`draft_vocab.py`), copied once per call: then a block is drafted over the vocabulary's columns,
        # and q is widened to the whole vocabulary when it is handed to verification.
        add_on = self.refiner if method == "xpress" else self.markov_head if method == "markov" else None
        self.read_out, self.add_on_read_out = draft_read_outs(speculator.draft_vocab, self.lm_head, add_on)
        self.draft_token_ids = getattr(self.read_out, "token_ids", None)  # None: the columns are the token ids
        self.vocab_size = self.lm_head.weight.shape[0]
        self.max_length = generation_config.max_length
        self.block_size = self.drafter.config.block_size
        # Drafts offered per block: the first `max_drafts` slots (all B-1 by default). Fewer narrow the verify forward,
        # which pays where it is compute-bound (a CPU, large batches); the drafter still reads the whole block.
        self.max_drafts = num_draft_tokens or self.block_size - 1
        self.mask_token_id = self.drafter.config.mask_token_id
        self.picker = DraftPicker(logits_processor, generation_config.do_sample, self.draft_token_ids, self.vocab_size)
        self.stats = stats if stats is not None else SpeculationStats(method)
        self.device = self.drafter.device
        # The drafter's context K/V; never holds block K/V between calls. Static mode (the target decodes with a
        # static cache, `batch_size` rows that all stay to the end): a preallocated cache, and every call after the
        # first writes exactly B context slots (the new ones, then padding that the mask hides and the crop drops),
        # so that the draft step always sees the same shapes and can be compiled once.
        self.static = static_cache_length is not None
        if self.static:
            self.cache_slots = static_cache_length + 2 * self.block_size  # the target's, plus context padding, a block
            self.cache = _compat.reused_static_cache(self.drafter, self.drafter.config, self.cache_slots, batch_size)
            self.slot_index = torch.arange(self.cache_slots, device=self.device)
        else:
            self.cache = DynamicCache() if context_cache is None else context_cache
        # context slots in the static drafter cache, kept on the host (no sync to read it); the caller sets it when it
        # compacts the cache
        self.cached_context = 0
        # Target cache slots before the first new one that the drafter has no features of (a single prompt's prefix
        # that a cache passed in pre-filled held, past what `context_cache`, the drafter's context of the call that
        # handed that cache back, covers): its dynamic cache holds the others, each key at its token's position. It
        # drafts from what it has, which costs acceptance, never exactness (the target verifies with the whole cache).
        if (unseen_prefix or context_cache is not None) and self.static:
            raise ValueError("A static drafter cache mirrors the target's from its first slot: no unseen prefix.")
        self.unseen_prefix = unseen_prefix
        # With a compile config (the target's decoding forward is compiled too), the draft step after the first and
        # the Jacobi refinement (when every logits processor is position-free) run through torch.compile.
        self.draft_step = compiled(draft_block, compile_config) if compile_config is not None else draft_block
        # Drafter passes on the CPU run their few rows through the faster BLAS layouts (`_cpu_linear.py`; on an Intel
        # CPU weights packed for the batch's blocks of rows), compiled ones included (traced through it). Made by the
        # first pass, which knows the batch.
        self.layout: contextlib.AbstractContextManager | None = None
        self.refine_step = compiled(jacobi_refine_unrolled, compile_config) if compile_config is not None else None

    def _layout(self, batch: int) -> contextlib.AbstractContextManager:
        if self.layout is None:
            self.layout = few_row_linears(self.drafter, self.lm_head, packed_rows=batch * self.block_size)
        return self.layout

    @torch.no_grad()
    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False,
                       n_last_matches=0, rows: RowBatch | None = None, **kwargs):
        """input_ids (b, L) ends with the anchor (the target's last token, not yet in its cache). Returns
        (candidate ids (b, L + n), q (b, n, V)); `(input_ids, None)` when nothing can be drafted.

        Batched decoding passes `rows` (`input_ids` is `rows.tokens`): row i is `input_ids[i, :rows.lengths[i]]`,
        anchor last, filler after it, and its candidates are written right after it. `rows.context_mask()` (b, S)
        marks which of the target cache's S slots hold a token of each row (0: padding or a rejected draft; None: all,
        slot j holding token j). The drafter's cache mirrors the target's slot for slot, so the same mask serves both;
        the features of the slots added since the last call are the first ones of `model_outputs.hidden_states`."""
        # The first call comes before the target's prefill: there are no hidden states to draft from yet.
        if is_first_iteration:
            return input_ids, None
        batch, width = input_ids.shape
        # rows still decoding (a static batch keeps its finished rows: their drafts are computed, never offered)
        lengths = [width] * batch if rows is None else [rows.lengths[i] for i in rows.active()]
        num_drafts = min(self.max_drafts, self.max_length - min(lengths) - 1)  # the row with most room left
        if num_drafts <= 0:
            return input_ids, None
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("BlockDiffusionCandidateGenerator needs the target's hidden states of its last forward.")
        context_mask = rows.context_mask() if rows is not None else None
        sequence_lengths = rows.lengths if rows is not None else None

        # 1. Draft: features of the tokens the target just verified (all but the anchor), then one drafter pass.
        synchronize(self.device)
        start = time.perf_counter()
        context_length = width - 1 if context_mask is None else context_mask.shape[1]  # target cache slots
        # slots whose features are not cached yet (a batch's compaction may have shrunk the dynamic cache)
        num_new = context_length - (self.cached_context if self.static else
                                    self.unseen_prefix + self.cache.get_seq_length())
        block_ids = torch.full((batch, self.block_size), self.mask_token_id, device=input_ids.device)
        block_ids[:, 0] = last_tokens(input_ids, sequence_lengths, 1)[:, 0]
        if self.static:
            features = self.drafter.context_features(model_outputs.hidden_states, num_new).to(self.device)
            hidden, drafter_logits = self._draft_static(block_ids, features, context_length, num_new, context_mask)
        else:
            attention_mask = None
            if context_mask is None:
                positions = torch.arange(context_length - num_new, context_length + self.block_size, device=self.device)
                positions = positions.expand(batch, -1)
            else:
                context_mask = context_mask[:, self.unseen_prefix :]  # the drafter's slots
                new, block = per_row_positions(context_mask.to(self.device), num_new, self.block_size)
                positions = torch.cat([new, block], dim=1)
                attention_mask = torch.cat([context_mask, context_mask.new_ones(batch, self.block_size)], 1)
                attention_mask = attention_mask.to(self.device)
            with self._layout(batch):
                features = self.drafter.context_features(model_outputs.hidden_states, num_new).to(self.device)
                hidden, drafter_logits = draft_block(self.drafter, self.embed_tokens, self.read_out, block_ids,
                                                     features, positions, attention_mask, self.cache, self.max_drafts)
            _compat.crop_cache(self.cache, self.block_size)  # keep context K/V only
        synchronize(self.device)
        if self.stats.blocks == 0:  # the first block: its drafter pass also read the whole prompt (or, after a
            # chunked prefill, followed the passes that wrote it chunk by chunk)
            self.stats.draft_prefill_seconds += time.perf_counter() - start
        else:
            self.stats.draft_seconds += time.perf_counter() - start
        self.stats.blocks += 1

        # 2. Resolve the block: marginals (dflash), Jacobi refinement (xpress) or left to right (markov).
        start = time.perf_counter()
        self.picker.start_block(input_ids, self.max_drafts, drafter_logits.shape[-1], rows)
        if self.method == "xpress":
            # (b, 2): the token before the anchor, the anchor; a fresh copy, as a compiled step guards on strides. A
            # row whose prompt came as embeddings alone has no token before its first anchor: the anchor stands in.
            if min(sequence_lengths or [width]) < 2:
                anchors = last_tokens(torch.cat([input_ids[:, :1], input_ids], dim=1),
                                      [n + 1 for n in sequence_lengths or [width] * batch], 2).contiguous()
            else:
                anchors = last_tokens(input_ids, sequence_lengths, 2).clone(memory_format=torch.contiguous_format)
            # a static batch's finished rows are refined with the others but never offered: the passes follow the rows
            # still decoding (a mask at every step of such a batch, so that a compiled refinement keeps its signature)
            decoding = None
            if rows is not None and rows.keep_finished_rows and batch > 1:
                decoding = torch.tensor([row not in rows.finished for row in rows.rows], device=self.device)
            if self.refine_step is not None and position_free(self.picker.processors):  # compiled: picker spelled out
                tokens, q, passes = self.refine_step(
                    self.refiner, drafter_logits, hidden, anchors, self.num_jacobi_passes, self.picker.gumbel,
                    self.picker.warp if self.picker.processors else None, self.add_on_read_out, self.draft_token_ids,
                    decoding,
                )
            else:
                tokens, q, passes = jacobi_refine(
                    self.refiner, drafter_logits, hidden, anchors, self.picker, self.num_jacobi_passes,
                    self.add_on_read_out, decoding,
                )
            self.stats.refine_passes.append(int(passes))
        elif self.method == "markov":
            anchor = last_tokens(input_ids, sequence_lengths, 1)[:, 0]
            tokens, q = markov_decode(self.markov_head, drafter_logits, anchor, self.picker.pick_slot,
                                      self.add_on_read_out)
        else:
            tokens, q = self.picker(drafter_logits, None)
        synchronize(self.device)
        self.stats.refine_seconds += time.perf_counter() - start

        self.stats.drafted_tokens += sum(min(num_drafts, self.max_length - n - 1) for n in lengths)  # usable drafts
        candidate_ids = append_ragged(input_ids, sequence_lengths, tokens[:, :num_drafts].to(input_ids.device))
        return candidate_ids, full_width(q[:, :num_drafts], self.draft_token_ids, self.vocab_size)

    def cache_prompt_chunk(self, target_hidden_states, start: int, prompt_mask: torch.Tensor | None) -> None:
        """A chunked prefill's step: write the drafter's context K/V of prompt slots [start, start + n) from the
        target's hidden states of that chunk (n positions), so that no buffer holds the whole prompt's hidden states
        or features. The first draft then finds the prompt in the drafter's cache and reads no new context.
        `prompt_mask` (b, P) marks each row's prompt tokens (None: no padding); positions count them, as in
        `per_row_positions`."""
        synchronize(self.device)
        begin = time.perf_counter()
        features = self.drafter.context_features(target_hidden_states).to(self.device)
        batch, n = features.shape[:2]
        if prompt_mask is None:
            positions = torch.arange(start, start + n, device=self.device).expand(batch, -1)
        else:
            positions = (prompt_mask.to(self.device).cumsum(dim=1)[:, start : start + n] - 1).clamp(min=0)
        with self._layout(batch):
            self.drafter.cache_context(features, positions, self.cache)
        self.cached_context = start + n
        synchronize(self.device)
        self.stats.draft_prefill_seconds += time.perf_counter() - begin

    def select_rows(self, index: torch.LongTensor) -> None:
        """Keep only these rows of the batch (finished rows leave it)."""
        self.cache.batch_select_indices(index.to(self.device))

    def _draft_static(self, block_ids, features, context_length: int, num_new: int, context_mask):
        """The draft step with a static drafter cache. The first call writes the whole prompt's context; later calls
        write B context slots, the `num_new` real ones first: the mask hides the padding, and the crop afterwards
        drops it with the block's K/V, so the next call overwrites both. `context_mask` (b, S) marks each row's own
        slots among the S context slots (None: all of them), as in `get_candidates`; positions count a row's own
        tokens. Positions and mask have the same shapes and layout whatever the holes, so a compiled step is reused."""
        batch = block_ids.shape[0]
        width = num_new if self.cached_context == 0 else self.block_size  # context slots written by this call
        features = torch.nn.functional.pad(features, (0, 0, 0, width - num_new))
        start = self.cached_context
        slots, block_start = self.slot_index, start + width
        in_block = (slots >= block_start) & (slots < block_start + self.block_size)
        if context_mask is None:  # slot j holds token j of every row
            positions = torch.cat([start + torch.arange(width, device=self.device),
                                   context_length + torch.arange(self.block_size, device=self.device)])
            positions, visible = positions.repeat(batch, 1), ((slots < context_length) | in_block).repeat(batch, 1)
        else:
            new, block = per_row_positions(context_mask.to(self.device), num_new, self.block_size)
            positions = torch.cat([torch.nn.functional.pad(new, (0, width - num_new)), block], dim=1)
            own = torch.nn.functional.pad(context_mask.to(self.device).bool(), (0, self.cache_slots - context_length))
            visible = own | in_block
        # The first call's context width is the prompt's, a shape seen once: it runs eagerly, like the target's prefill.
        step = draft_block if self.cached_context == 0 else self.draft_step
        with self._layout(batch):
            out = step(self.drafter, self.embed_tokens, self.read_out, block_ids, features, positions,
                       visible[:, None, None, :], self.cache, self.max_drafts)
        _compat.crop_cache(self.cache, width - num_new + self.block_size)  # keep the real context K/V only
        self.cached_context = context_length
        return out


def per_row_positions(context_mask: torch.Tensor, num_new: int, block_size: int):
    """Position ids of a batch with holes: (the last `num_new` context slots (b, num_new), the block (b, B)). A slot's
    position is the number of the row's own tokens before it (`context_mask` (b, S) marks them); the block's anchor
    follows the row's last token."""
    seen = context_mask.cumsum(dim=1)
    block = seen[:, -1:] + torch.arange(block_size, device=context_mask.device)
    return (seen[:, context_mask.shape[1] - num_new :] - 1).clamp(min=0), block


def whole(module: nn.Module) -> nn.Module:
    """The target's token embeddings or lm_head as the drafter reads them, outside the target's forward. Sharded across
    processes (tensor parallelism; FSDP, outside the forward that gathers them), their weights are DTensors that plain
    tensors cannot meet: a copy of the module holding its whole weights, gathered from every process (each calls this
    at the same point of the same `generate`), of its own class (not FSDP's subclass of it) and without the hooks
    that shard its inputs and outputs or gather its weights."""
    if not any(_compat.is_sharded(p) for p in module.parameters(recurse=False)):
        return module
    from torch.distributed import fsdp

    fsdp_module = getattr(fsdp, "FSDPModule", ())  # (torch 2.6 on)
    cls = next(c for c in type(module).__mro__ if not issubclass(c, fsdp_module))
    copied = cls.__new__(cls)
    copied.__dict__.update(module.__dict__)
    copied._parameters = {
        name: nn.Parameter(p.full_tensor(), requires_grad=False) if _compat.is_sharded(p) else p
        for name, p in module._parameters.items()
    }
    for hooks in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                  "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
        setattr(copied, hooks, type(getattr(module, hooks))())
    return copied


def draft_block(drafter, embed_tokens, lm_head, block_ids, features, positions, attention_mask, cache, num_drafts):
    """One drafter pass: its final hidden states (b, B, H) and its logits for the draft slots 1..num_drafts
    (b, num_drafts, V), read out with the target's lm_head (or a `DraftReadOut` of it: (b, num_drafts, N)). The
    block's K/V are left in `cache` for the caller to crop."""
    hidden = drafter(
        noise_embeds=embed_tokens(block_ids).to(drafter.device),
        context_hidden_states=features,
        position_ids=positions,
        attention_mask=attention_mask,
        cache=cache,
    ).last_hidden_state
    return hidden, lm_head(hidden[:, 1 : num_drafts + 1].to(lm_head.weight.dtype)).float()


@functools.cache
def _compiled(function, options: tuple):
    step = torch.compile(function, **{k: dict(v) if k == "options" and v is not None else v for k, v in options})

    @functools.wraps(function)
    def call(*args, **kwargs):
        # With CUDA graphs ("reduce-overhead", transformers' default) every call of a compiled function starts a new
        # cudagraph-tree generation, which may reuse the memory of the previous call's outputs: the draft step's
        # outputs feed the refinement, and q is read after the verify forward. Copies cost a few MB per block.
        return tuple(t.clone() for t in step(*args, **kwargs))

    return call


def compiled(function, compile_config):
    """`torch.compile(function)` with the options of transformers' `CompileConfig` (fullgraph, dynamic, backend, mode,
    options), made once per function and config so that later `generate` calls reuse its compiled graphs. Returns
    copies of its outputs (a tuple of tensors), which stay valid past the next compiled call."""
    options = compile_config.to_dict()
    options = {k: tuple(sorted(v.items())) if isinstance(v, dict) else v for k, v in options.items()}
    return _compiled(function, tuple(sorted(options.items())))
