"""Per-row state of batched speculative decoding (`RowBatch`): each row's tokens, the cache layout, finished rows.

The rows of a batch accept different numbers of draft tokens per step, so they drift apart in length. Cache scheme,
chosen because nothing is ever recomputed and every verify forward stays one block wide:

- Every verify forward appends the K/V of all rows' [anchor, drafts] to the target cache. After verification the
  slots that no row kept (past the longest accepted run) are cropped; the other rows' rejected slots stay as holes,
  masked out by a 2D attention mask (`cache_mask`), and each row's position ids count only its own tokens, so a row
  attends to exactly what it would attend to alone. (Cropping to the shortest row and re-feeding the others' extra
  tokens would widen every verify forward and still need a mask for the ragged re-fed runs.)
- The drafter's cache mirrors the target's slot for slot (its context K/V come from the target's hidden states at
  the same slots), so one mask serves both.
- When more than half the slots are holes that every row could lose (`COMPACT_WHEN_WASTED`), both caches are
  compacted: each row's kept slots are gathered to the right, in order, left-padded to the longest row.
- A finished row leaves the batch: its cache rows, hidden states and state are index-selected away, so it costs
  nothing more. Its output is padded as plain batched `generate` pads finished rows.
  With a static cache (`keep_finished_rows`) a finished row stays in the batch, as in plain static `generate`: every
  forward keeps its shapes, so that compiled forwards (CUDA graphs on a GPU) are captured once per call shape rather
  than once per number of rows left. It is fed its last token again, keeps none of its slots (they are holes) and
  emits nothing. A PEFT model's finished rows stay too: its layers may be handed one argument per row for the whole
  `generate` (a mixed-adapter batch's `adapter_names`), and refuse a batch of another size.
- Layers keeping a state instead of K/V (linear attention, state-space mixers, short convolutions: Qwen3.5, Bamba,
  LFM2, ...) have no slots, so nothing to mask: each row's state is put back to what it was after the row's own last
  kept token (`_compat.roll_back_rows`, from the per-token states transformers records).
- Sliding-window layers (Gemma 2 / 3, Mistral) and chunked-attention ones (Llama 4): transformers measures a window
  in cache slots, which holes would stretch, and its sliding cache layers (chunked ones too) drop the slots past one
  window, which a row behind the others still needs.
  So such a target gets a cache that keeps every slot in every attention layer, and verify forwards with holes get
  explicit 4D masks (`windowed_masks`) whose windows and chunks count each row's own tokens, as they would for the
  row alone (its layers keeping a state, if any, get none: every token fed after the prompt is real).
- A target whose attention counts the distance between a query and a key in cache slots rather than by position ids
  (Inkling's relative-position logits) would see a hole as a token: its caches are compacted at every step that
  leaves one (`compact_every_step`), which costs a gather of both caches per such step.

With one row, or rows that always accept alike, there are no holes: no mask is built and the cache is cropped
exactly as in single-sequence speculative decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _compat

# Compact the caches when more than this share of their slots are holes that no row needs (gathering costs about
# one read of the cache; attending over holes costs that on every forward).
COMPACT_WHEN_WASTED = 0.5


def append_ragged(sequence: torch.LongTensor, lengths: list[int] | None, tokens: torch.LongTensor) -> torch.LongTensor:
    """Row i of the result is `sequence[i, :lengths[i]]` followed by `tokens[i]` (b, n); what lies past that is
    filler. `lengths=None`: every row is full, a plain concatenation."""
    joined = torch.cat([sequence, tokens], dim=1)
    if lengths is None or all(length == sequence.shape[1] for length in lengths):
        return joined
    after = torch.arange(tokens.shape[1], device=sequence.device)
    return joined.scatter(1, torch.tensor(lengths, device=sequence.device)[:, None] + after, tokens)


def last_tokens(sequence: torch.LongTensor, lengths: list[int] | None, n: int) -> torch.LongTensor:
    """The last n tokens of each row (b, n); `lengths` as in `append_ragged`."""
    if lengths is None or all(length == sequence.shape[1] for length in lengths):
        return sequence[:, sequence.shape[1] - n :]
    index = torch.tensor(lengths, device=sequence.device)[:, None] - n + torch.arange(n, device=sequence.device)
    return sequence.gather(1, index)


@dataclass(frozen=True)
class AttentionChunks:
    """Chunked attention (Llama 4): a query sees the keys before it in its own chunk of `size` positions."""

    size: int


def windowed_masks(key_mask: torch.Tensor, query_positions: torch.LongTensor,
                   attention_windows: dict[str, int | AttentionChunks | None | bool],
                   dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor | None]:
    """Additive 4D masks (b, 1, n, keys) for a verify forward over a cache with holes: a query at position p sees its
    row's keys at positions q with p - window < q <= p (transformers' sliding window, counted in the row's tokens
    rather than in cache slots; window None: q <= p; chunks of size c: q <= p in the same chunk, q // c == p // c;
    False: a layer keeping a state, which gets no mask). `key_mask`
    (b, keys) marks the row's own keys, the queries' among them; `query_positions` (b, n). One mask per layer type (a
    dict, as transformers' models take them), or the mask alone for a model with one layer type."""
    key_positions = key_mask.cumsum(-1) - 1  # a row's own keys are in order, so the count before one is its position
    offset = query_positions[:, :, None] - key_positions[:, None, :]  # (b, n, keys)
    visible = key_mask.bool()[:, None, :] & (offset >= 0)
    blocked = torch.finfo(dtype).min
    masks = {}
    for layer_type, window in attention_windows.items():
        if window is False:
            masks[layer_type] = None
            continue
        if window is None:
            seen = visible
        elif isinstance(window, AttentionChunks):
            seen = visible & (query_positions[:, :, None] // window.size == key_positions[:, None, :] // window.size)
        else:
            seen = visible & (offset < window)
        additive = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, blocked)
        masks[layer_type] = additive[:, None]  # (b, 1, n, keys): one mask for all heads
    return masks if len(masks) > 1 else next(iter(masks.values()))


class RowBatch:
    """Rows of a speculative decode, from the left-padded prompts to the padded output.

    `tokens` (b, W): row i is its padded prompt followed by its generated tokens, up to `lengths[i]` (filler past
    it), i.e. exactly what plain `generate`'s `input_ids` row would hold after as many tokens. `rows[i]` is the
    original batch row of row i. Finished rows leave (with `keep_finished_rows` they stay, emitting nothing);
    `sequences()` puts them back in order.

    When a row ends follows plain `generate`: with an EOS criterion (`pad_after_stop`), at its own first stop (the
    rest is padding); without one, plain `generate` keeps every row going until all have stopped once, so each row
    ends at the last row's first stop.
    """

    def __init__(self, input_ids: torch.LongTensor, attention_mask, generation_config, pad_after_stop: bool,
                 attention_windows: dict[str, int | AttentionChunks | None | bool] | None = None,
                 mask_dtype: torch.dtype = torch.float32, compact_every_step: bool = False,
                 keep_finished_rows: bool = False, prompt_slots: int | None = None, cached_prompt: int = 0):
        batch, width = input_ids.shape
        # {mask key: its window or chunks, None for full attention, False for none} when the target has windowed layers
        self.attention_windows, self.mask_dtype = attention_windows, mask_dtype
        # a target whose attention counts distances in cache slots rather than position ids needs a cache without holes
        self.compact_every_step = compact_every_step
        self.keep_finished_rows = keep_finished_rows  # static caches, PEFT: finished rows stay, emitting nothing
        self.batch_size, self.prompt_width = batch, width
        # cache slots of the prompt, which `attention_mask` covers: a prompt given as `inputs_embeds` has them without
        # their tokens (`input_ids` then holds none of them), else one per prompt token
        self.prompt_slots = width if prompt_slots is None else prompt_slots
        self.cached_prompt = cached_prompt  # prompt slots a cache passed in pre-filled already holds: not fed again
        self.max_new_tokens = generation_config.max_length - width
        self.pad_after_stop = pad_after_stop
        pad = generation_config._pad_token_tensor
        self.pad_token_id = int(pad.reshape(-1)[0]) if pad is not None else 0
        self.rows = list(range(batch))
        self.tokens = input_ids
        self.lengths = [width] * batch
        if attention_mask is not None:  # any dtype plain `generate` takes (bool, int, float): 0 / 1 longs here
            attention_mask = (attention_mask != 0).long()
        padded = attention_mask is not None and not bool(attention_mask.all())
        self.prompt_mask = attention_mask if padded else None  # (b, prompt slots)
        # Target (and drafter) cache layout: `slots` slots per row; `cache_mask` (b, slots) marks the row's own tokens
        # (None: all of them, no holes); `valid[i]` counts them, which is also the position id of the row's next token.
        self.slots = 0
        self.cache_mask: torch.Tensor | None = None
        self.valid = [0] * batch
        self.stopped_at: dict[int, int] = {}  # original row -> tokens generated when it first stopped
        self.finished: dict[int, torch.LongTensor] = {}  # original row -> its whole sequence
        self.scores: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        self.logits: list[list[torch.Tensor]] = [[] for _ in range(batch)]

    # -- inputs ---------------------------------------------------------------------------------------------------

    def verify_inputs(self, candidates: torch.LongTensor, first: bool):
        """(input_ids, position_ids, attention_mask) of the verify forward: the padded prompts on the first pass
        (their tokens, which a prompt given as `inputs_embeds` need not have; those past `cached_prompt`, the mask over
        them all), then each row's [anchor, candidates] (b, n+1)."""
        device = self.tokens.device
        if first:
            fed = self.tokens[:, self.cached_prompt :]
            if self.prompt_mask is None:
                return fed, torch.arange(self.cached_prompt, self.prompt_slots, device=device)[None], None
            positions = (self.prompt_mask.long().cumsum(-1) - 1).masked_fill(self.prompt_mask == 0, 0)
            return fed, positions[:, self.cached_prompt :], self.prompt_mask
        fed = torch.cat([last_tokens(self.tokens, self.lengths, 1), candidates], dim=1)
        steps = torch.arange(fed.shape[1], device=device)
        if self.cache_mask is None:  # no holes: every row has `slots` tokens
            return fed, (self.slots + steps)[None], None
        positions = torch.tensor(self.valid, device=device)[:, None] + steps
        key_mask = torch.cat([self.cache_mask, self.cache_mask.new_ones(fed.shape)], dim=1)
        if self.attention_windows is None:
            return fed, positions, key_mask
        return fed, positions, windowed_masks(key_mask, positions, self.attention_windows, self.mask_dtype)

    def new_tokens(self, candidate_ids: torch.LongTensor) -> torch.LongTensor:
        """The candidates the drafter appended to each row: (b, n)."""
        num_drafts = candidate_ids.shape[1] - self.tokens.shape[1]
        if num_drafts == 0 or all(length == self.tokens.shape[1] for length in self.lengths):
            return candidate_ids[:, self.tokens.shape[1] :]
        index = torch.tensor(self.lengths, device=candidate_ids.device)[:, None]
        return candidate_ids.gather(1, index + torch.arange(num_drafts, device=candidate_ids.device))

    # -- outcome of a step ------------------------------------------------------------------------------------------

    def append(self, new_tokens: torch.LongTensor, emitted: list[int]) -> None:
        """Row i gains `new_tokens[i, :emitted[i]]`."""
        self.tokens = append_ragged(self.tokens, self.lengths, new_tokens)
        self.lengths = [length + n for length, n in zip(self.lengths, emitted)]
        self.tokens = self.tokens[:, : max(self.lengths)]

    def stop(self, stops: list[int | None], emitted: list[int]) -> list[int]:
        """Apply this step's stops (index of the stopping token among each row's new tokens, or None): cut the rows
        whose output is complete and mark them finished. Returns the tokens each row keeps from this step."""
        kept = list(emitted)
        for i, (row, stop) in enumerate(zip(self.rows, stops)):
            if row in self.finished:  # a finished row kept in the batch (`keep_finished_rows`) emitted nothing
                continue
            generated = self.lengths[i] - self.prompt_width
            if stop is not None and row not in self.stopped_at:
                self.stopped_at[row] = generated - emitted[i] + stop + 1
            end = self._end(row)
            limit = self.max_new_tokens if end is None else min(end, self.max_new_tokens)
            if generated >= limit:
                kept[i] = max(emitted[i] - (generated - limit), 0)
                self.lengths[i] = self.prompt_width + limit
                self.finished[row] = self.tokens[i, : self.lengths[i]]
        end = None if self.pad_after_stop else self._end(0)
        if end is not None and self.all_finished:
            # without EOS padding plain decoding ends every row where the last one stopped; a row that reached
            # max_new_tokens before that step was known ran on past it
            for row, sequence in self.finished.items():
                self.finished[row] = sequence[: self.prompt_width + end]
        return kept

    def _end(self, row: int) -> int | None:
        """Generated tokens in the row's output, once known."""
        if self.pad_after_stop:
            return self.stopped_at.get(row)
        return max(self.stopped_at.values()) if len(self.stopped_at) == self.batch_size else None

    def record(self, scores: torch.Tensor | None, logits: torch.Tensor | None, kept: list[int]) -> None:
        """Keep each row's processed scores / raw logits (b, n+1, V) of the tokens it kept."""
        for i, (row, n) in enumerate(zip(self.rows, kept)):
            if scores is not None:
                self.scores[row].extend(scores[i, :n])
            if logits is not None:
                self.logits[row].extend(logits[i, :n])

    @property
    def all_finished(self) -> bool:
        return len(self.finished) == self.batch_size

    def active(self) -> list[int]:
        """Indices of the rows still decoding (with `keep_finished_rows`, finished rows stay among `rows`)."""
        return [i for i, row in enumerate(self.rows) if row not in self.finished]

    # -- cache layout -----------------------------------------------------------------------------------------------

    def context_mask(self) -> torch.Tensor | None:
        """(b, slots) mask of the cache slots holding each row's tokens, for the drafter. None when slot i holds token
        i of every row (no padding, no holes): the drafter then reads the layout off `tokens` alone."""
        if self.cache_mask is None and any(length != self.slots + 1 for length in self.lengths):
            return torch.ones(len(self.rows), self.slots, dtype=torch.long, device=self.tokens.device)
        return self.cache_mask

    def roll_back(self, cache, drafter, outputs, num_fed: int, kept: list[int] | None):
        """After a verify forward of `num_fed` tokens per row: finished rows leave the batch (both caches, the hidden
        states the drafter reads next, all per-row state; with `keep_finished_rows` they stay and keep no slot); the
        target cache keeps `kept[i]` of row i's fed slots (None: the prompt, all of them). Slots no row kept are
        cropped, the rest of the rejected ones masked.
        Returns `outputs` with its hidden states reduced to the remaining rows."""
        if kept is None:  # the prefill: the prompt is in the cache, its padding masked
            self.slots = num_fed
            self.cache_mask = self.prompt_mask
            self.valid = [num_fed] * len(self.rows) if self.prompt_mask is None else self.prompt_mask.sum(1).tolist()
        if self.keep_finished_rows:  # finished rows stay, and keep none of the slots fed to them from now on
            remaining = list(range(len(self.rows)))
            if kept is not None:
                kept = [0 if row in self.finished else k for row, k in zip(self.rows, kept)]
        else:
            remaining = self.active()
        if len(remaining) < len(self.rows):
            index = torch.tensor(remaining, device=self.tokens.device)
            _compat.select_cache_rows(cache, index)
            drafter.select_rows(index)
            # rows are dimension -3: (b, n, H), or (streams, b, n, H) for Gemma 3n
            outputs.hidden_states = tuple(h if h is None else h.index_select(-3, index.to(h.device))
                                          for h in outputs.hidden_states)
            self.rows = [self.rows[i] for i in remaining]
            self.lengths = [self.lengths[i] for i in remaining]
            self.valid = [self.valid[i] for i in remaining]
            self.tokens = self.tokens[index, : max(self.lengths)]
            if self.prompt_mask is not None:
                self.prompt_mask = self.prompt_mask[index]
            if self.cache_mask is not None:
                self.cache_mask = self.cache_mask[index]
                if min(self.valid) == self.slots:  # the rows left have no holes
                    self.cache_mask = None
            kept = None if kept is None else [kept[i] for i in remaining]
        if kept is None:
            _compat.crop_cache(cache, 0)  # nothing to drop; sliding-window layers go back to their window
            return outputs

        num_kept = max(kept)
        idle = [row in self.finished for row in self.rows] if self.keep_finished_rows else None
        _compat.roll_back_rows(cache, num_fed, kept, idle)  # K/V cropped past the longest run; state layers' rows back
        if self.cache_mask is not None or min(kept) < num_kept:
            if self.cache_mask is None:
                self.cache_mask = torch.ones(len(self.rows), self.slots, dtype=torch.long, device=self.tokens.device)
            device = self.tokens.device
            step = torch.arange(num_kept, device=device) < torch.tensor(kept, device=device)[:, None]  # (b, num_kept)
            self.cache_mask = torch.cat([self.cache_mask, step.long()], dim=1)
        self.slots += num_kept
        self.valid = [v + k for v, k in zip(self.valid, kept)]
        return outputs

    def compact_if_sparse(self, caches, max_slots: int | None = None) -> bool:
        """When more than `COMPACT_WHEN_WASTED` of the slots are holes no row needs, gather each row's slots to the
        right, in order, in every cache (all must hold the same `slots` slots; otherwise wait for the next step).
        With `compact_every_step`, whenever a row has a hole past its first token; with `max_slots` (static caches,
        which cannot grow), whenever the caches hold more slots than that.
        A batch of one is never compacted: its only holes are its prompt's padding, which never grow; they stay, so
        the cache handed back lines up with the sequence as plain `generate`'s does, and a static cache keeps its
        size."""
        if self.cache_mask is None or self.batch_size == 1:
            return False
        width = max(self.valid)
        if self.compact_every_step:  # any hole past a row's first token (its prompt's padding may stay)
            needed = bool((self.cache_mask[:, 1:] < self.cache_mask[:, :-1]).any())
        else:
            needed = self.slots - width > COMPACT_WHEN_WASTED * self.slots
        must = max_slots is not None and self.slots > max_slots
        if not (needed or must):
            return False
        if any(c.get_seq_length() != self.slots for c in caches):
            if self.compact_every_step or must:
                reason = ("this target cannot take holes in its cache" if self.compact_every_step else
                          f"the next verify forward would write past the static caches ({self.slots} slots held, "
                          f"{max_slots} at most)")
                raise RuntimeError(
                    f"hf_specdiff: the target and drafter caches hold different slots, so they cannot be compacted "
                    f"together, and {reason}. Use the default dynamic cache or generate row by row, and please report "
                    "it."
                )
            return False
        order = torch.argsort(self.cache_mask, dim=1, stable=True)[:, self.slots - width :]  # (b, width): holes first
        for c in caches:
            _compat.gather_cache_slots(c, order)
        self.cache_mask, self.slots = self.cache_mask.gather(1, order), width
        if min(self.valid) == width:
            self.cache_mask = None
        return True

    # -- output ---------------------------------------------------------------------------------------------------

    def sequences(self) -> torch.LongTensor:
        """(batch, prompt + longest output): rows in their original order, finished rows padded with pad_token_id."""
        rows = [self.finished[row] for row in range(self.batch_size)]
        out = rows[0].new_full((self.batch_size, max(len(r) for r in rows)), self.pad_token_id)
        for row, sequence in enumerate(rows):
            out[row, : len(sequence)] = sequence
        return out

    def scores_so_far(self, scores: torch.Tensor, asked: list[int], prefix_length: int) -> tuple[torch.Tensor, ...]:
        """What plain `generate` (with output_scores) hands a stopping criterion at `prefix_length`: the processed
        scores of every step so far, (batch, V) each. Rows `asked` (current indices) take their recorded scores, then
        this step's `scores` (b, m, V); every other row of the original batch holds the padding distribution."""
        padding = torch.full_like(scores[0, 0], float("-inf"))
        padding[self.pad_token_id] = 0.0
        steps = []
        for step in range(prefix_length - self.prompt_width):
            values = [padding] * self.batch_size
            for i in asked:
                history = self.scores[self.rows[i]]
                values[self.rows[i]] = history[step] if step < len(history) else scores[i, step - len(history)]
            steps.append(torch.stack(values))
        return tuple(steps)

    def per_token(self, values: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        """Scores or logits as plain `generate` returns them: one (batch, V) tensor per generated position. A row that
        has finished puts all its mass on pad_token_id there (0 for it, -inf elsewhere), the token it is padded with."""
        lengths = [len(self.finished[row]) - self.prompt_width for row in range(self.batch_size)]
        if self.batch_size == 1:
            return tuple(v[None] for v in values[0][: lengths[0]])
        reference = next(v[0] for v in values if v)
        padding = torch.full_like(reference, float("-inf"))
        padding[self.pad_token_id] = 0.0
        return tuple(
            torch.stack([values[row][i] if i < lengths[row] else padding for row in range(self.batch_size)])
            for i in range(max(lengths))
        )


def stop_and_pad_ids(target, tokenizer) -> tuple[set[int], int]:
    """The target's stop tokens (its generation config's EOS ids) and the id to pad batches with: the tokenizer's pad
    token, else the first EOS id, else 0."""
    eos = target.generation_config.eos_token_id
    stop_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(stop_ids), 0)
    return set(stop_ids), pad


def left_pad(prompts: list[list[int]], pad_token_id: int, device) -> tuple[torch.LongTensor, torch.LongTensor]:
    """(input_ids, attention_mask), both (len(prompts), longest): token lists left-padded as decoder-only `generate`
    expects them."""
    width = max(len(ids) for ids in prompts)
    input_ids = torch.tensor([[pad_token_id] * (width - len(ids)) + list(ids) for ids in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts], device=device)
    return input_ids, attention_mask


def until_stop(tokens: list[int], stop_ids: set[int]) -> list[int]:
    """A row's generated tokens up to and including its first stop token (what follows is padding)."""
    stop = next((i for i, token in enumerate(tokens) if token in stop_ids), None)
    return tokens if stop is None else tokens[: stop + 1]
