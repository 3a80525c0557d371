"""`generate(..., assistant_model=speculator, speculation=...)`: lossless speculative decoding inside `generate()`.

`enable(model)` opts one model in: its `generate` accepts `speculation="xpress" | "dflash" | "markov"`. transformers
still prepares everything (generation config, logits processors, stopping criteria, the cache); only the decoding
loop is ours, passed to `generate` as a `custom_generate` callable. The loop is standard speculative decoding
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"), with candidates from
`BlockDiffusionCandidateGenerator`:

    prefill -> [draft block -> resolve block (xpress / markov / dflash) -> verify in one target forward
                -> accept a prefix + one bonus token -> roll back the target cache] until a stop criterion fires

Greedy output equals the target's own greedy output; sampled output follows the target's distribution. Batches of any
size with left-padded prompts: each row accepts and finishes on its own, and the output equals plain batched
`generate` (per-row cache bookkeeping in `batching.py`).

With `cache_implementation="static"` every step has the same shapes, so that it can be compiled once: the
target cache is a `StaticCache` with a block of room past `max_length` (rolling back only lowers its length; the next
verify overwrites the rejected slots), every verify forward has the same width (the anchor and `num_draft_tokens`
drafts, B-1 by default; the last blocks are padded), and the
drafter keeps its context in a static cache too (`BlockDiffusionCandidateGenerator._draft_static`). A batch keeps its
finished rows (they emit nothing), passes per-row positions and a mask over the whole static cache at every step,
holes or not, and compacts its caches in place when holes would overflow them. Where transformers
would compile plain decoding's forward, the verify forward, the draft step and the sync-free Jacobi refinement
(`xpress.jacobi_refine_unrolled`) run through `torch.compile`; on a GPU its default mode captures them as CUDA graphs,
which removes the per-kernel launch cost that bounds a small target's eager decoding.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import time
import types
import weakref
from dataclasses import dataclass

import torch
import transformers
from transformers import DynamicCache, GenerationConfig, StaticCache
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.logits_process import (
    PrefixConstrainedLogitsProcessor,
    SynthIDTextWatermarkLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.distributed.fsdp import is_fsdp_managed_module
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

from . import _compat
from ._cpu_linear import few_row_linears
from ._warnings import warn_at_caller
from .batching import AttentionChunks, RowBatch
from .candidates import BlockDiffusionCandidateGenerator, SpeculationStats, process_logits, synchronize

SPECULATION_METHODS = ("xpress", "dflash", "markov")


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `speculation`: accepted lengths, counts, target forwards and timings.

    With a batch, `scores` / `logits` of a row that has finished put all mass on pad_token_id (the token it is padded
    with), and the cache is None: the target cache's per-row layout (holes, dropped rows) is internal to the loop."""

    speculation: SpeculationStats | None = None


# ----------------------------------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------------------------------


def verify_greedy(target_scores: torch.Tensor, candidates: torch.LongTensor):
    """target_scores (b, n+1, V) processed; candidates (b, n). Per row, accept the longest prefix the target's argmax
    agrees with, then the target's own token at the first disagreement (or after the last candidate) as the bonus.

    Returns (tokens (b, n+1), num_accepted (b,)): row r emits `tokens[r, :num_accepted[r] + 1]`."""
    choice = target_scores.argmax(dim=-1)  # (b, n+1)
    num_accepted = (candidates == choice[:, :-1]).int().cumprod(dim=1).sum(dim=1)  # (b,)
    return choice, num_accepted  # accepted candidates equal the target's choice: `choice` is each row's run + bonus


def verify_sampling(target_scores: torch.Tensor, draft_scores: torch.Tensor, candidates: torch.LongTensor):
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023), every row on its own.

    Draft token x_i ~ q_i is kept with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the token is
    resampled from norm(max(0, p_i - q_i)); if all n are kept, a bonus token is drawn from p_{n+1}. Every emitted
    token is then distributed exactly as p, whatever q is. Returns what `verify_greedy` returns.
    """
    n = candidates.shape[1]
    p = target_scores.softmax(dim=-1)  # (b, n+1, V)
    q = draft_scores.softmax(dim=-1)  # (b, n, V)
    p_x = p[:, :n].gather(-1, candidates[..., None])[..., 0]
    q_x = q.gather(-1, candidates[..., None])[..., 0]
    keep = torch.rand_like(p_x) * q_x < p_x  # u < p/q without dividing by a zero q
    num_accepted = keep.int().cumprod(dim=1).sum(dim=1)  # (b,)
    # Row r draws its last token at position k = num_accepted[r] from norm(max(0, p_k - q_k)), with q_{n+1} = 0.
    at = num_accepted[:, None, None].expand(-1, 1, p.shape[-1])
    p_k = p.gather(1, at)[:, 0]  # (b, V)
    q_k = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1).gather(1, at)[:, 0]
    residual = (p_k - q_k).clamp(min=0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_k)
    bonus = torch.multinomial(residual / residual.sum(dim=-1, keepdim=True), 1)  # (b, 1)
    return torch.cat([candidates, bonus], dim=1).scatter(1, num_accepted[:, None], bonus), num_accepted


def first_stop(new_tokens, emitted, rows, stopping_criteria, generation_config, scores):
    """Per row, the index (into its new tokens) of the token at which plain `generate` would have stopped, or None.

    Row i emitted `new_tokens[i, :emitted[i]]`, and `rows.tokens[i, :rows.lengths[i]]` already ends with them;
    `scores` (b, m, V) are the processed scores each was chosen from when the caller keeps scores (output_scores),
    else None. The criteria are the ones `generate` handed over (a user's EosTokenCriteria or MaxLengthCriteria
    replaces the one built from the config): EOS and max length are checked on the whole run at once; any other
    criterion (stop strings, user criteria, subclasses) is asked for every prefix, as plain decoding would ask it: one
    call per prefix length, with the whole original batch, each row in its place (`rows.rows`), rows without a prefix
    of that length as filler, and as `scores` what plain decoding passes (None, or with output_scores every step's
    scores so far). A criterion that counts its calls sees more of them in a ragged batch, one per prefix length."""
    lengths = rows.lengths
    stops: list[list[int]] = [[] for _ in emitted]
    if (eos := generation_config._eos_token_tensor) is not None:  # the criteria's (`_as_criteria_stop`)
        hits = torch.isin(new_tokens, eos.to(new_tokens.device))  # (b, m)
        first_hit = torch.where(hits.any(dim=1), hits.int().argmax(dim=1), new_tokens.shape[1]).tolist()
        for row, (hit, n) in enumerate(zip(first_hit, emitted)):
            if hit < n:
                stops[row].append(hit)
    if (max_length := generation_config.max_length) is not None:
        for row, (length, n) in enumerate(zip(lengths, emitted)):
            if length >= max_length:
                stops[row].append(n - 1 - (length - max_length))
    others = [c for c in stopping_criteria if type(c) not in (EosTokenCriteria, MaxLengthCriteria)]
    if not others:
        return [min(found) if found else None for found in stops]
    starts = [length - n for length, n in zip(lengths, emitted)]  # prefix length before the new tokens
    # the last prefix to ask: the whole run, or up to the token at which EOS or the max length stops it, which plain
    # decoding also asks every criterion about (one that logs or counts the tokens it is shown would miss it)
    ends = [start + (min(found) + 1 if found else n) for start, found, n in zip(starts, stops, emitted)]
    whole = len(rows.rows) == rows.batch_size
    pending = set(range(len(emitted)))
    for prefix_length in range(min(starts) + 1, max(ends) + 1):
        asked = [i for i in sorted(pending) if starts[i] < prefix_length <= ends[i]]
        if not asked:
            continue
        if whole and len(asked) == len(emitted):
            prefix, place = rows.tokens[:, :prefix_length], asked
        else:
            place = [rows.rows[i] for i in asked]  # rows of the original batch
            prefix = rows.tokens.new_zeros(rows.batch_size, prefix_length)
            prefix[place] = rows.tokens[asked, :prefix_length]
        so_far = None if scores is None else rows.scores_so_far(scores, asked, prefix_length)
        fired = torch.zeros(prefix.shape[0], dtype=torch.bool, device=prefix.device)
        for criterion in others:
            fired = fired | torch.as_tensor(criterion(prefix, so_far), dtype=torch.bool, device=prefix.device)
        for i, hit in zip(asked, fired[place].tolist()):
            if hit:
                stops[i].append(prefix_length - starts[i] - 1)
                pending.discard(i)
    return [min(found) if found else None for found in stops]


def prefill_in_chunks(model, prompt: dict, positions, attention_mask, chunk_size: int, mask_covers_cache: bool = True,
                      chunk_done=None, token_types: dict | None = None, **forward_kwargs):
    """The prompt's forward in chunks of `chunk_size` positions, as `generate(..., prefill_chunk_size=...)` runs it
    (each chunk attends to the cache and to itself, the mask cut at its end; a model without keys to mask,
    `mask_covers_cache=False`, reads the mask of the chunk's own tokens), so that a long prompt's activations are held
    a chunk at a time. `prompt`: {"input_ids" or "inputs_embeds": (b, P[, H])}. `chunk_done(hidden_states, start)`
    takes each chunk's hidden states as it comes (the drafter writes its context K/V from them). `token_types`
    ({name: (b, P)}, a multimodal model's token types of a prompt without images): each chunk reads them up to its end,
    as the mask, as transformers' own chunked prefill hands them.

    Returns the last chunk's output."""
    (name, values), = prompt.items()
    for start in range(0, values.shape[1], chunk_size):
        end = min(start + chunk_size, values.shape[1])
        mask = None if attention_mask is None else attention_mask[:, 0 if mask_covers_cache else start : end]
        types_so_far = {key: types[..., :end] for key, types in (token_types or {}).items()}
        outputs = model(**{name: values[:, start:end]}, position_ids=positions[..., start:end], attention_mask=mask,
                        **types_so_far, **forward_kwargs)
        if chunk_done is not None:
            chunk_done(outputs.hidden_states, start)
    return outputs


# ----------------------------------------------------------------------------------------------------------------
# The decoding loop (passed to `generate` as `custom_generate`)
# ----------------------------------------------------------------------------------------------------------------


def speculative_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    *,
    speculator,
    method: str,
    streamer=None,
    num_jacobi_passes: int | None = None,
    num_draft_tokens: int | None = None,
    prefill_chunk_length: int | None = None,
    **model_kwargs,
):
    """Any batch size, prompts left-padded. Each row accepts its own number of tokens per step and finishes on its own.

    Caches (see `batching.py`): every verify forward's K/V stay in the target cache; slots past the longest accepted
    run are cropped, the other rows' rejected slots are masked out by a 2D attention mask, with per-row position ids.
    The drafter's cache mirrors the target's slot for slot. Both are compacted (each row's slots gathered, left-padded)
    when holes fill more than half of them, and finished rows are dropped from the batch (kept with a static cache, so
    that every forward keeps its shapes, and on a PEFT model, whose layers may take one argument per row). A single
    row has no holes but its prompt's padding: an exact crop, as in plain speculative decoding (and no mask without
    padding).
    """
    _check_decoding_inputs(model, input_ids, generation_config, model_kwargs, logits_processor, streamer,
                           prefill_chunk_length)
    generation_config = _as_criteria_stop(generation_config, stopping_criteria)
    do_sample = generation_config.do_sample
    want_dict = generation_config.return_dict_in_generate
    keep_scores = want_dict and generation_config.output_scores
    keep_logits = want_dict and generation_config.output_logits
    stats = SpeculationStats(method, batch_size=input_ids.shape[0])
    block_size = speculator.drafter.config.block_size
    # cache_implementation="static": a static target cache with room for a whole block past the length transformers
    # sizes static caches to, every verify forward equally wide, finished rows kept in the batch (emitting nothing) so
    # that every forward keeps its shapes, and, where transformers would compile
    # plain decoding's forward (by its own rule: cuda / xpu / neuron / tpu, or `compile_config._compile_all_devices`;
    # never with `disable_compile`), the verify forward, the draft step and the Jacobi refinement all compiled.
    static = generation_config.cache_implementation == "static"
    # `inputs_embeds`: the prompt the target reads (b, P, H), fed by the prefill alone; `input_ids` (b, W) are the
    # prompt tokens the output starts with (none, or the same prompt's), as plain `generate` has it. The cache then
    # holds P prompt slots, and the rows' positions and mask count those.
    prompt_embeds = model_kwargs.get("inputs_embeds")
    prompt_only_inputs = _prompt_only_inputs(model, model_kwargs)
    # M-RoPE (Qwen2-VL and kin): `generate` placed the prompt's image tokens at 3D positions, (D, b, P) with the text
    # positions first; every token after the prompt is text, each of its D positions running on from the prompt's last
    # as in plain decoding: the loop's text position plus a per-row offset per dimension (set at the prefill).
    prompt_positions = model_kwargs.get("position_ids")
    multidimensional = _with_media(prompt_only_inputs) and prompt_positions is not None and prompt_positions.dim() == 3
    prompt_slots = input_ids.shape[1] if prompt_embeds is None else prompt_embeds.shape[1]
    # a batch on a target with sliding-window layers: windows counted per row, over a cache keeping every slot
    attention_windows = _attention_windows(model.config.get_text_config()) if input_ids.shape[0] > 1 else None
    # A model whose every layer keeps a state (Mamba) has no keys to mask: it reads a 2D mask as the padding of the
    # tokens fed, which after the prompt are all real (plain `generate` passes it none then either).
    masks_keys = bool(_attention_types(model.config.get_text_config()) - {"linear_attention", "conv"})
    if static:
        room = _compat.static_cache_length(model, generation_config, prompt_slots - input_ids.shape[1]) + block_size
        cache = _compat.reused_static_cache(model, model.config.get_text_config(decoder=True), room, input_ids.shape[0])
    else:
        cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        if attention_windows is not None:  # windows counted per row need every slot kept (the given one is empty)
            cache = _compat.unwindowed_dynamic_cache(model.config.get_text_config(decoder=True))
        elif cache is None:
            cache = DynamicCache()
    # A cache passed in pre-filled (a single prompt's) holds the prompt's first `cached_prompt` slots: the prefill
    # feeds the rest. The drafter lacks their features unless the cache is one this loop handed back (a chat's next
    # turn): then it continues from its own context cache of that call (`_HANDED_BACK`), lacking only the last step's
    # tokens and those added since. It drafts from what it has; the target verifies with the whole cache. On an M-RoPE
    # model the tokens after the cache run on from the positions of that call's last ones (`position_offsets`).
    cached_prompt = 0 if static else int(cache.get_seq_length())
    handed_back = _HANDED_BACK.pop(cache, None) if cached_prompt else None  # this call extends the cache
    drafter_context = _drafter_context(handed_back, speculator, cached_prompt, model_kwargs.get("attention_mask"))
    position_offsets = handed_back.position_offsets if handed_back is not None else None
    compiled = stats.compiled = static and _compat.forward_compiled(model, generation_config, cache)
    verify_forward = model.get_compiled_call(generation_config.compile_config) if compiled else model
    drafter = BlockDiffusionCandidateGenerator(
        model, speculator, method, generation_config, logits_processor, num_jacobi_passes, stats,
        static_cache_length=room if static else None,
        compile_config=_compat.compile_config(model, generation_config) if compiled else None,
        num_draft_tokens=num_draft_tokens, batch_size=input_ids.shape[0], context_cache=drafter_context,
        unseen_prefix=cached_prompt - (drafter_context.get_seq_length() if drafter_context is not None else 0),
    )
    # Keep what rolling back a verify forward needs (sliding, conv, recurrent layers), from the first verify forward on:
    # a recorded prompt's last tokens would be scanned one by one, where plain decoding scans the whole prompt in
    # chunks, and some models compute the two differently (Zamba 2 clamps a Mamba layer's time step in chunks only).
    record_past = not static and hasattr(cache, "activate_past_recording")
    has_eos_criterion = any(hasattr(c, "eos_token_id") for c in stopping_criteria)  # as plain `generate` decides
    rows = RowBatch(input_ids, model_kwargs.get("attention_mask"), generation_config, pad_after_stop=has_eos_criterion,
                    attention_windows=attention_windows, mask_dtype=model.dtype,
                    compact_every_step=model.config.get_text_config().model_type in _SLOT_DISTANCE_MODEL_TYPES,
                    keep_finished_rows=static or _peft_injected(model), prompt_slots=prompt_slots,
                    cached_prompt=cached_prompt)
    if streamer is not None:
        streamer.put(input_ids.cpu())

    # Verify forwards on the CPU run their few rows through the faster BLAS layouts (`_cpu_linear.py`): on an Intel CPU
    # weights packed for the full batch's anchors and drafts, the width of nearly every verify forward; a compiled
    # forward called inside the mode is traced through it (a graph of its own: dynamo guards on the mode stack).
    verify_layout = few_row_linears(model, packed_rows=input_ids.shape[0] * (drafter.max_drafts + 1))
    # the target's hidden states the drafter reads, and only those where transformers can select them
    hidden_states_request = speculator.drafter.target_hidden_states_request()
    outputs, first = None, True
    # Processes in lockstep (`synced_gpus`: the target sharded with FSDP, whose every forward gathers each layer's
    # shards from all processes) run the same number of target forwards: each step, every process says whether it
    # still decodes, and one that is done takes part in the others' forwards with a forward of its own.
    lockstep = synced_gpus and _in_a_process_group()
    if lockstep and prefill_chunk_length:
        raise ValueError(
            "speculation=... in lockstep across processes (synced_gpus) would prefill each process's prompt in its own "
            "number of chunks, each a forward all processes must take part in: remove prefill_chunk_size."
        )
    while True:
        if lockstep:
            _any_process_decoding(True, input_ids.device)
        # 1. Draft and resolve a block per row (nothing on the first pass: the target has not run yet).
        candidate_ids, draft_scores = drafter.get_candidates(
            rows.tokens, model_outputs=outputs, is_first_iteration=first, rows=rows
        )
        candidates = rows.new_tokens(candidate_ids)  # (b, n)
        num_drafts = candidates.shape[1]

        # 2. Compact both caches (which now hold the same slots) once holes fill more than half of them, or, static,
        #    when the next verify forward would not fit. A step without drafts is the last one (every row still
        #    decoding is one token from its max length): the drafter, which then added nothing to its cache and will
        #    not draft again, is left out.
        caches = [cache, drafter.cache] if num_drafts else [cache]
        if rows.compact_if_sparse(caches, room - drafter.max_drafts - 1 if static else None):
            drafter.cached_context = rows.slots

        # 3. Verify: one target forward over each row's [anchor, candidates] (the padded prompts on the first pass).
        synchronize(input_ids.device)
        start = time.perf_counter()
        fed, positions, attention_mask = rows.verify_inputs(candidates, first)
        attention_mask = attention_mask if first or masks_keys else None
        # static: every verify forward has the same width, the anchor and a full set of drafts
        padding = drafter.max_drafts + 1 - fed.shape[1] if static and not first else 0
        if padding:  # the padded slots' logits are ignored and their K/V cropped below, like rejected drafts'
            fed = torch.cat([fed, fed[:, -1:].expand(-1, padding)], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, padding + 1, device=fed.device)], 1)
        if static and not first and (rows.batch_size > 1 or attention_mask is not None):  # one call shape at every
            # step, holes or padding or not: per-row positions, and a mask over the whole static cache (its padded
            # slots, past the tokens fed, masked)
            positions = positions.expand(fed.shape[0], -1).contiguous()
            if attention_mask is None:
                attention_mask = fed.new_ones(fed.shape[0], rows.slots + fed.shape[1] - padding)
            attention_mask = torch.nn.functional.pad(attention_mask, (0, room - attention_mask.shape[1]))
        # logits of the positions verified only, where the model can (`generate` then passes logits_to_keep): the
        # prefill's last one, as plain decoding's prefill (every position of a long prompt would cost prompt x vocab
        # floats); a static verify forward keeps its fixed width's, so that its compiled call keeps one signature
        keep = "logits_to_keep" in model_kwargs and (first or not static)
        logits_kwargs = {"logits_to_keep": num_drafts + 1} if keep else {}
        if multidimensional and first:
            offsets = prompt_positions[..., -1] - positions[..., -1]  # (D, b), for each original row
            positions = prompt_positions
        elif multidimensional:
            positions = positions[None] + offsets[:, rows.rows, None]  # (D, b, n)
        elif position_offsets is not None:  # (a single row)
            positions = positions[None] + position_offsets[:, None, None]
        # the prefill of a prompt given as embeddings reads them (`fed` then holds the prompt's tokens, if any)
        inputs = {"inputs_embeds": prompt_embeds} if first and prompt_embeds is not None else {"input_ids": fed}
        if first:  # images and the like, read with the prompt
            inputs.update(prompt_only_inputs)
        num_fed = prompt_slots if first else fed.shape[1]
        forward_kwargs = dict(use_cache=True, output_hidden_states=hidden_states_request, **logits_kwargs,
                              **_compat.cache_kwargs(model, cache))
        if first and prefill_chunk_length:  # (counted as one target forward, the prefill)
            # the drafter writes its cache of each chunk from the chunk's hidden states as they come
            write_drafter_cache = functools.partial(drafter.cache_prompt_chunk, prompt_mask=rows.prompt_mask)
            # (images are refused with a chunked prefill: what else the prompt has is its token types, cut to each
            # chunk, and flags as `use_audio_in_video=False`, which go with every chunk)
            token_types = {k: v for k, v in prompt_only_inputs.items() if k in _PROMPT_TOKEN_TYPES}
            flags = {k: v for k, v in prompt_only_inputs.items() if k not in token_types}
            prompt = {k: v for k, v in inputs.items() if k not in prompt_only_inputs}
            outputs = prefill_in_chunks(model, prompt, positions, attention_mask, prefill_chunk_length, masks_keys,
                                        chunk_done=write_drafter_cache, token_types=token_types, **flags,
                                        **forward_kwargs)
        else:
            with contextlib.nullcontext() if first else verify_layout:
                outputs = (model if first else verify_forward)(  # the prefill's shape is seen once: never compiled
                    **inputs, position_ids=positions, attention_mask=attention_mask, **forward_kwargs
                )
        stats.target_forwards += 1
        if first and cache.get_seq_length() == 0:  # rolled back and fed only new tokens, it would lose the context
            raise ValueError(
                f"speculation=... verifies drafts against the target's cache, and {type(model).__name__} keeps nothing "
                "there (its forward ignores the cache, or keeps its state on the model). Generate without speculation."
            )
        if first and record_past:
            _compat.record_past(cache, tokens_per_forward=drafter.max_drafts + 1)
        end = outputs.logits.shape[1] - padding
        target_logits = outputs.logits[:, end - num_drafts - 1 : end].float()  # (b, n+1, V)
        if compiled:  # a compiled forward may reuse its output buffers at the next call (CUDA graphs)
            target_logits = target_logits.clone()
        target_scores = process_logits(logits_processor, candidate_ids, target_logits, rows.lengths, rows)

        # 4. Accept, per row: the longest agreeing prefix plus one token from the target (greedy or sampling).
        if do_sample and num_drafts:
            new_tokens, num_accepted = verify_sampling(target_scores, draft_scores, candidates)
        elif do_sample:
            new_tokens = torch.multinomial(target_scores[:, 0].softmax(-1), 1)
            num_accepted = torch.zeros(new_tokens.shape[0], dtype=torch.long, device=new_tokens.device)
        else:
            new_tokens, num_accepted = verify_greedy(target_scores, candidates)
        accepted = num_accepted.tolist()  # (b,) on the host
        synchronize(input_ids.device)
        if first:
            stats.prefill_seconds += time.perf_counter() - start
        else:
            stats.verify_seconds += time.perf_counter() - start

        # 5. Stop each row where plain decoding would have stopped, even inside its accepted run.
        drafted = [min(num_drafts, generation_config.max_length - n - 1) for n in rows.lengths]  # fit before max length
        active = rows.active()  # a static batch's finished rows stay in it and emit nothing
        decoding = set(active)
        emitted = [accepted[i] + 1 if i in decoding else 0 for i in range(len(accepted))]
        rows.append(new_tokens, emitted)
        stops = first_stop(new_tokens, emitted, rows, stopping_criteria, generation_config,
                           target_scores if keep_scores else None)
        kept = rows.stop(stops, emitted)
        if not first:
            stats.add_step(*([values[i] for i in active] for values in (rows.rows, kept, drafted, accepted)))
        rows.record(target_scores if keep_scores else None, target_logits if keep_logits else None, kept)
        if streamer is not None:  # batch size 1
            streamer.put(new_tokens[:, : kept[0]].cpu())
        if rows.all_finished:
            break

        # 6. Roll back: finished rows leave the batch (a static batch keeps them, holding no new slot); each row keeps
        #    [anchor, accepted] in the target cache (the slots no row kept are cropped, the others' rejected ones
        #    masked); its bonus token is its next anchor.
        outputs = rows.roll_back(cache, drafter, outputs, num_fed, None if first else emitted)
        first = False

    if lockstep:
        while _any_process_decoding(False, input_ids.device):
            model(input_ids=input_ids.new_zeros(1, 1), use_cache=False)
    if streamer is not None:
        streamer.end()
    if input_ids.shape[0] == 1:  # the cache handed back holds every token but the last, as plain `generate`'s does
        in_cache = len(rows.finished[0]) - 1 + prompt_slots - input_ids.shape[1]
        _compat.crop_cache(cache, rows.slots + num_fed - in_cache)
        if not static and rows.prompt_mask is None and prompt_embeds is None:
            _HANDED_BACK[cache] = _HandedBack(weakref.ref(speculator.drafter), drafter.cache,
                                              offsets[:, 0] if multidimensional else position_offsets)
    sequences = rows.sequences()
    if not want_dict:
        return sequences
    return SpeculativeDecoderOnlyOutput(
        sequences=sequences,
        scores=rows.per_token(rows.scores) if keep_scores else None,
        logits=rows.per_token(rows.logits) if keep_logits else None,
        speculation=stats,
        # A batch's cache has per-row holes and lacks the rows that finished early: only a single row's is usable.
        **{_compat.generate_output_cache_field(): cache if input_ids.shape[0] == 1 else None},
    )


@dataclass
class _HandedBack:
    """What a single row's target cache handed back by the loop carries into the call that continues it (a chat's
    next turn passes the cache back): the drafter's own context cache of that call, so that it does not draft without
    the conversation so far, and, on an M-RoPE model, each position dimension's shift over the slot numbers of the
    tokens after it, (D,), which images in that conversation set (None: none)."""

    drafter: weakref.ref
    drafter_context: DynamicCache
    position_offsets: torch.Tensor | None


# Weakly keyed by the target cache handed back, so a record lives as long as the user keeps the cache, and nothing is
# set on the user's objects (a deep copy of the cache starts without it).
_HANDED_BACK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _drafter_context(handed_back, speculator, cached_prompt: int, attention_mask) -> DynamicCache | None:
    """The drafter's context cache that came with this target cache, where it still applies: the same drafter, no
    padding (its slots then number as its positions), and no more slots than the target cache holds (not cropped
    below them since). Extending the target cache in between only widens what the drafter lacks."""
    if handed_back is None:
        return None
    context = handed_back.drafter_context
    padded = attention_mask is not None and not bool(attention_mask.all())
    if handed_back.drafter() is not speculator.drafter or padded or context.get_seq_length() > cached_prompt:
        return None
    return context


def _as_criteria_stop(generation_config, stopping_criteria):
    """The generation config with the EOS ids and max length plain decoding stops at: those of the EosTokenCriteria
    and MaxLengthCriteria `generate` handed over, where a user's replaced the one built from the config (the loop
    sizes drafts and caches by the max length, and `first_stop` reads both from here, once per call)."""
    limits = [c.max_length for c in stopping_criteria if type(c) is MaxLengthCriteria]
    eos_ids = [c.eos_token_id.reshape(-1) for c in stopping_criteria if type(c) is EosTokenCriteria]
    generation_config = copy.copy(generation_config)  # the caller's stays as it was
    generation_config.max_length = min(limits) if limits else generation_config.max_length
    generation_config._eos_token_tensor = torch.cat(eos_ids) if eos_ids else None
    return generation_config


def _in_a_process_group() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


def _any_process_decoding(decoding: bool, device) -> bool:
    """Whether any process in lockstep still decodes, this one saying whether it does (one all-reduce)."""
    flag = torch.tensor(float(decoding), device=device)
    torch.distributed.all_reduce(flag)
    return bool(flag.item())


# transformers' logits processors that keep state across calls, and the option that builds each
_STATEFUL_PROCESSORS = {
    SynthIDTextWatermarkLogitsProcessor: "`watermarking_config` (SynthID)",
    UnbatchedClassifierFreeGuidanceLogitsProcessor: "`guidance_scale`",
}


# Model inputs `generate` prepares that the loop handles itself (positions and the cache are rebuilt per step).
_HANDLED_MODEL_KWARGS = {"attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "logits_to_keep",
                         "inputs_embeds"}
# Images, video and audio (and the encoder outputs transformers computes from them): read by the prompt's forward only,
# as plain `generate` feeds them (transformers' own list). Whatever follows the prompt is text.
_PROMPT_ONLY_INPUTS = frozenset(transformers.generation.utils.MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL) | {
    "mm_encoder_outputs",
    "image_grid_thw", "video_grid_thw", "second_per_grid_ts",  # Qwen-VL's image and video sizes (before 5.25)
    "feature_attention_mask",  # Qwen2-Audio's mask over the audio features
    "image_position_ids", "video_position_ids", "num_frames_per_video",  # Gemma 4's patch positions (before 5.24)
    # images per prompt (LLaVA-OneVision), patch grids (LFM2-VL), crops per image (Molmo2): read with the pixels only;
    # transformers before 5.24 (Molmo2's: 5.25) hands them to the loop as they are
    "batch_num_images", "spatial_shapes", "image_num_crops",
    # Qwen2.5-Omni's and Qwen3-Omni's audio lengths and video timing, and whether a video's audio is interleaved with
    # its frames: read for the prompt's 3D positions only
    "audio_feature_lengths", "video_second_per_grid", "use_audio_in_video",
}
# A multimodal prompt's token types mark its image (video, audio) tokens, for attention both ways within an image or
# over a prefix (Gemma 3 and 4, PaliGemma). The tokens generated after the prompt are text and attend causally: what a
# forward given no token types computes (Gemma 3 and 4's own generation hands them none after the prompt for that).
_PROMPT_TOKEN_TYPES = frozenset({"token_type_ids", "mm_token_type_ids"})


def _prompt_only_inputs(model, model_kwargs: dict) -> dict:
    """The inputs given that only the prompt's forward reads: images, video, audio (and the encoder outputs transformers
    computes from them), and, on a multimodal model, the token types marking those in the prompt."""
    names = _PROMPT_ONLY_INPUTS | _PROMPT_TOKEN_TYPES if _multimodal(model) else _PROMPT_ONLY_INPUTS
    return {k: v for k, v in model_kwargs.items() if k in names and _given(v)}


def _multimodal(model) -> bool:
    modalities = model.input_modalities
    return set((modalities,) if isinstance(modalities, str) else modalities) != {"text"}


def _with_media(prompt_only_inputs: dict) -> bool:
    """Whether the prompt has images, video or audio (not just token types, or a flag as `use_audio_in_video=False`)."""
    return bool(set(prompt_only_inputs) - _PROMPT_TOKEN_TYPES - {"use_audio_in_video"})


def _given(value) -> bool:
    # an empty dict is no input: transformers (5.25) hands a vision-language target `mm_encoder_outputs={}` when the
    # prompt has no image
    return value is not None and not (isinstance(value, dict) and not value)


def _check_decoding_inputs(model, input_ids, generation_config, model_kwargs, logits_processor=None, streamer=None,
                           prefill_chunk_length=None):
    """What speculative decoding cannot do raises here, before any work. `input_ids` is already expanded: with
    num_return_sequences=n (sampling) each prompt is n rows of the batch, each decoded on its own."""
    batch_size = input_ids.shape[0]
    copies = generation_config.num_return_sequences or 1
    batch = f"a batch of {batch_size}"
    if copies > 1:
        batch += f" ({batch_size // copies} prompts x num_return_sequences={copies})"
    if (generation_config.num_beams or 1) > 1:
        raise ValueError(
            f"speculation=... cannot be combined with beam search (num_beams={generation_config.num_beams}); "
            "use num_beams=1."
        )
    _check_decoding_mode(generation_config)
    text_config = model.config.get_text_config()
    # A BERT-family LM head (BertLMHeadModel, RobertaForCausalLM, ...; their configs build an encoder or a decoder)
    # attends both ways unless built as a decoder: a draft would change the target's logits for the tokens before it.
    encoder = getattr(text_config, "is_decoder", None) is False
    if encoder and getattr(text_config, "add_cross_attention", None) is not None:
        raise ValueError(
            f"{type(model).__name__} was built as an encoder (is_decoder=False), so its attention is not causal and "
            "cannot verify drafts. Load it as a decoder: from_pretrained(path, is_decoder=True)."
        )
    if reason := _REFUSED_MODEL_TYPES.get(text_config.model_type):
        raise ValueError(
            f"speculation=... feeds the target only the tokens its cache lacks and rolls the cache back past rejected "
            f"drafts, and {type(model).__name__} {reason}. Generate without speculation."
        )
    _check_wrapping(model)
    # The loop scores every draft position, rejected drafts included, and scores a position again after a rejection:
    # a processor must be a function of (input_ids, scores). transformers' processors that keep state across calls
    # would drift from plain decoding's (whether built from the config or passed in `logits_processor`).
    for processor in logits_processor or []:
        for stateful, option in _STATEFUL_PROCESSORS.items():
            if isinstance(processor, stateful):
                raise ValueError(
                    f"speculation=... cannot use {type(processor).__name__}: it keeps state across calls, and "
                    "speculative decoding also scores drafts that are then rejected, so that state would drift. "
                    f"Remove {option} or the processor (plain generate supports it; a WatermarkingConfig watermark "
                    "is stateless and works)."
                )
    if recurrent := sorted(_attention_types(text_config) & _compat.RECURRENT_LAYER_TYPES):
        if not _compat.recurrent_rollback_supported():
            raise ValueError(
                f"speculation=... rolls the target back past rejected drafts, and this model's {recurrent} layers keep "
                "a recurrent state that transformers rolls back from version 5.25 on (you have "
                f"{transformers.__version__}). Upgrade transformers (pip install 'transformers>=5.25'), or generate "
                "without speculation."
            )
    if generation_config.use_cache is False:
        raise ValueError(
            "speculation=... needs the KV cache, and use_cache is False (in the call, or in the model's config or "
            "generation config, as MPT's): pass use_cache=True."
        )
    if generation_config.cache_implementation == "static":
        if batch_size > 1 and (other := sorted(_attention_types(text_config) - {"full_attention"})):
            why = (" (a batch's static cache would count their windows in cache slots, not in each row's tokens)"
                   if set(other) & _WINDOWED_LAYER_TYPES else "")
            alone = "" if set(other) - _STATIC_WINDOWED_LAYER_TYPES else ", or a static cache row by row"
            raise ValueError(
                f"speculation=... with cache_implementation='static' and {batch} handles full-attention models; "
                f"this model also has {other} layers{why}. Use the default dynamic cache for batches{alone}."
            )
        if other := sorted(_attention_types(text_config) - {"full_attention"} - _STATIC_WINDOWED_LAYER_TYPES):
            raise ValueError(
                f"speculation=... with cache_implementation='static' handles full, sliding-window and chunked "
                f"attention; this model also has {other} layers. Use the default dynamic cache."
            )
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "speculation=... does not return attentions or hidden states; set output_attentions=False and "
            "output_hidden_states=False."
        )
    prompt_only = _prompt_only_inputs(model, model_kwargs)
    unsupported = sorted(k for k, v in model_kwargs.items()
                         if _given(v) and k not in _HANDLED_MODEL_KWARGS and k not in prompt_only)
    if unsupported:
        hint = " (or, if the model reads them beside its images, generate without speculation)" if _multimodal(
            model) else ""
        raise ValueError(f"speculation=... does not support the model inputs {unsupported}; remove them{hint}.")
    if _with_media(prompt_only) and prefill_chunk_length:
        raise ValueError(
            "speculation=... reads a prompt with images (video, audio) in one forward: remove prefill_chunk_size (or "
            "generate without speculation)."
        )
    mask = model_kwargs.get("attention_mask")
    if (embeds := model_kwargs.get("inputs_embeds")) is not None:
        if embeds.dim() != 3 or embeds.shape[0] != batch_size or input_ids.shape[1] not in (0, embeds.shape[1]):
            raise ValueError(
                f"speculation=... reads inputs_embeds of shape (batch, prompt length, hidden size) as the prompt, with "
                f"input_ids either absent or the same prompt's tokens; got inputs_embeds {tuple(embeds.shape)} and "
                f"input_ids {tuple(input_ids.shape)}. Pass input_ids of the same length, or none."
            )
        if mask is not None and mask.shape != embeds.shape[:2]:
            raise ValueError(
                f"speculation=... needs the attention_mask of the prompt in inputs_embeds, {tuple(embeds.shape[:2])}; "
                f"got {tuple(mask.shape)}."
            )
    elif mask is not None and tuple(mask.shape) != tuple(input_ids.shape):
        # a mask of another batch or width fails deep inside the first forward (a size error from the rotary
        # embedding, an IndexError from the model's masking), or looks right-padded, naming neither the mask nor the fix
        raise ValueError(
            f"speculation=... got an attention_mask of shape {tuple(mask.shape)} for input_ids of shape "
            f"{tuple(input_ids.shape)}: it needs one entry per prompt token, 1 for a token and 0 for left padding. "
            "Pass the attention_mask the tokenizer returned with these input_ids (after slicing both alike), or none."
        )
    if mask is not None and not bool(mask.all()):
        if bool((mask[:, 1:] < mask[:, :-1]).any()):
            raise ValueError(
                "speculation=... needs LEFT-padded prompts, but the attention_mask has padding after a token (right "
                "padding?). Pad on the left: tokenizer.padding_side = 'left' before tokenizing the batch. (Without "
                "an attention_mask, generate infers one from pad_token_id, and a prompt holding that token inside it "
                "looks padded there: pass the tokenizer's attention_mask.)"
            )
        if not bool(mask.any(dim=1).all()):
            raise ValueError("speculation=... got a prompt that is all padding; give every row at least one token.")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if isinstance(cache, StaticCache) and generation_config.cache_implementation != "static":
        raise ValueError(
            "speculation=... sizes its own static cache (a block past max_length): pass cache_implementation='static' "
            "instead of a StaticCache object."
        )
    if cache is not None and not isinstance(cache, (DynamicCache, StaticCache)):
        raise ValueError(
            f"speculation=... rolls the cache back past rejected drafts, and a {type(cache).__name__} cannot be rolled "
            "back. Pass no cache (the default dynamic one), or cache_implementation='static'."
        )
    if cache is not None and not isinstance(cache, StaticCache) and (cached := int(cache.get_seq_length())) > 0:
        # a prompt's prefix in the cache (computed once for many prompts, or handed back by the previous turn's call)
        if batch_size > 1:
            raise ValueError(
                f"speculation=... continues a pre-filled cache for a single prompt; got {batch} with a cache holding "
                f"{cached} tokens. Generate row by row (each row with its own copy of the cache), or pass no cache."
            )
        if input_ids.shape[1] <= cached:
            raise ValueError(
                f"speculation=... got a pre-filled cache holding {cached} tokens and a prompt of {input_ids.shape[1]}: "
                "pass the whole prompt, the cached tokens followed by at least one new token."
            )
        if (reason := "inputs_embeds" if model_kwargs.get("inputs_embeds") is not None else "prefill_chunk_size"
                if prefill_chunk_length else "images (video, audio)" if _with_media(prompt_only) else None):
            raise ValueError(f"speculation=... continues a pre-filled cache with a prompt of token ids only; remove "
                             f"{reason}, or pass no cache.")
        # M-RoPE models (Qwen2-VL and kin) place an image's tokens at fewer positions than it has tokens, so the
        # positions after a cached prefix depend on images the loop cannot see, unless the loop handed the cache back
        # itself and kept that shift beside it (the model keeps it from its last prefill with images, `rope_deltas`,
        # which need not be this conversation's)
        mrope = any(callable(getattr(part, "get_rope_index", None)) for part in (model, getattr(model, "model", None)))
        if mrope and cache not in _HANDED_BACK:
            raise ValueError(
                f"speculation=... got a pre-filled cache it did not hand back, and {type(model).__name__} places "
                "tokens at 3D (M-RoPE) positions, which images in the cached prefix shift by an amount the cache does "
                "not hold. Pass the cache a speculative generate of one unpadded prompt returned (the previous "
                "turn's, not a copy: it carries that shift), or the whole conversation without the cache."
            )
    if batch_size > 1:
        if streamer is not None:
            raise ValueError(
                f"speculation=... streams a single sequence; got {batch} with a streamer. Drop "
                "`streamer` or generate row by row."
            )
        attention_types = _attention_types(text_config)
        handled = {"full_attention"} | _WINDOWED_LAYER_TYPES | _compat.STATE_LAYER_TYPES
        if other_attention := sorted(attention_types - handled):
            raise ValueError(
                f"speculation=... with a batch handles full, sliding-window and chunked attention and layers keeping "
                f"a recurrent or conv state; this model also has {other_attention} layers. Generate row by row."
            )
        implementation = getattr(text_config, "_attn_implementation", None)
        if attention_types & _WINDOWED_LAYER_TYPES and implementation not in ("eager", "sdpa"):
            raise ValueError(
                f"speculation=... with a batch gives a sliding-window or chunked-attention model's layers their own "
                f"4D masks, which attn_implementation={implementation!r} does not take. Load the model with "
                "attn_implementation='sdpa' (or 'eager'), or generate row by row."
            )
        if text_config.model_type in _SLOT_ROTATED_MODEL_TYPES:
            raise ValueError(
                f"speculation=... with a batch leaves gaps between a row's tokens in the cache, and "
                f"{type(model).__name__} rotates each key by its cache slot, not its position: its rows would drift. "
                "Generate row by row."
            )
        if any(isinstance(p, PrefixConstrainedLogitsProcessor) for p in logits_processor or []):
            raise ValueError(
                "speculation=... with a batch cannot use prefix_allowed_tokens_fn: rows of different lengths are "
                "scored at their own prefix lengths, the other rows of each call being zero filler, which the "
                "function would be asked about as if they were real prefixes. Generate row by row."
            )


def _check_wrapping(model) -> None:
    """What wraps the target (PEFT) must act through its weights, the same for every token of a forward.

    Plain decoding builds every forward's inputs with `model.prepare_inputs_for_generation`; the loop builds its own
    (positions, masks and the cache per row, as the class's would). A replacement set on the model itself could add
    inputs the loop would drop without a word: PEFT's prompt learning puts its virtual tokens (prompt tuning,
    P-tuning) or its prefix keys and values (prefix tuning) there, for the length of the wrapper's `generate`. And an
    activated LoRA (aLoRA) in use (active, or named for a row of a mixed-adapter batch) applies its weights to the
    last tokens of each forward only, as many as followed its invocation in the prompt: one-token decoding steps all
    get them, a verify forward's first tokens would not."""
    activated = {name for name, config in (getattr(model, "peft_config", None) or {}).items()
                 if getattr(config, "alora_invocation_tokens", None)}
    if activated:  # an aLoRA loaded but not in use (another adapter active, no row naming it) changes nothing
        in_use = _adapters_named_per_row(model)
        for module in model.modules():
            if isinstance(getattr(type(module), "active_adapters", None), property):  # a PEFT tuner layer
                in_use.update(module.active_adapters)
        for name in sorted(activated & in_use):
            raise ValueError(
                f"speculation=... verifies several tokens per target forward, and the activated LoRA adapter {name!r} "
                "(alora_invocation_tokens) applies its weights to a fixed number of each forward's last tokens, so it "
                "would miss some of them. Generate without speculation, or use a plain LoRA adapter."
            )
    replacement = model.__dict__.get("prepare_inputs_for_generation")
    if replacement is None:
        return
    owner = getattr(replacement, "__self__", None)
    if owner is model and replacement.__func__ is type(model).prepare_inputs_for_generation:
        return  # the class's own, bound on the instance (PEFT puts it back so after its generate)
    peft_config = getattr(owner, "active_peft_config", None)
    if peft_config is not None and not peft_config.is_prompt_learning:
        return  # LoRA and its kin act through the wrapped layers; their wrapper's replacement calls the model's own
    if peft_config is not None:
        raise ValueError(
            f"speculation=... builds the target's inputs itself, and this PEFT model's {peft_config.peft_type.value} "
            "adds its virtual tokens (or prefix keys and values) in prepare_inputs_for_generation, which the loop does "
            "not call: the output would be the base model's. Generate without speculation (PEFT adapters that change "
            "the weights, such as LoRA, do work)."
        )
    raise ValueError(
        f"speculation=... builds the target's inputs itself, and {type(model).__name__}.prepare_inputs_for_generation "
        f"was replaced on this model (by {getattr(replacement, '__qualname__', replacement)!r}): what the replacement "
        "adds would be dropped. Remove it (del model.prepare_inputs_for_generation) or generate without speculation."
    )


# transformers' assisted decoding and its knobs (prompt lookup, a draft model's schedule, early exit, MTP), none of
# which the loop reads: refused rather than ignored. Checked before `generate` fills its global defaults
# (num_assistant_tokens=20, ...) into the config the loop receives; a config that already holds them (a pipeline's,
# prepared by transformers) passes where it holds only the defaults, while an argument of the call never does.
_ASSISTED_DECODING_OPTIONS = (
    "prompt_lookup_num_tokens", "max_matching_ngram_size", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind", "assistant_early_exit", "use_mtp",
    "assistant_ensemble_weight",
)


def _peft_injected(model) -> bool:
    """Whether PEFT adapters are injected into the target's layers. PEFT can hand them per-row arguments fixed for the
    whole `generate` (a mixed-adapter batch's `adapter_names`, Poly's `task_ids`), and the layers then refuse a batch
    of another size: finished rows stay in the batch, emitting nothing (as with a static cache, and as plain `generate`
    keeps every row), so that row i of every forward is still the row those arguments name."""
    return bool(getattr(model, "peft_config", None))


def _adapters_named_per_row(model) -> set[str]:
    """The adapters a mixed-adapter batch names for its rows (`peft_model.generate(adapter_names=[...])`: PEFT hooks
    every tuner layer with the list for the length of its `generate`)."""
    return {name for module in model.modules() for hook in module._forward_pre_hooks.values()
            for name in (getattr(hook, "keywords", None) or {}).get("adapter_names") or ()}


def _check_not_assisted(generation_config, call_arguments: dict) -> None:
    defaults = _compat.generation_defaults()
    for name in _ASSISTED_DECODING_OPTIONS:
        value = call_arguments[name] if name in call_arguments else getattr(generation_config, name, None)
        if value in (None, False) or (name not in call_arguments and value == defaults.get(name)):
            continue
        hint = " (num_draft_tokens= sets how many drafts a step verifies)" if "assistant_tokens" in name else ""
        raise ValueError(f"speculation=... replaces transformers' assisted decoding; remove `{name}`{hint}.")


# Decoding modes the loop would silently replace by greedy / sampling (stateful processors: `_STATEFUL_PROCESSORS`).
_UNSUPPORTED_MODES = {
    "penalty_alpha": "contrastive search",
    "dola_layers": "DoLa decoding",
    "token_healing": "token healing",
    # constrained beam search (transformers picks it for either, whatever num_beams; plain `generate` loads it from
    # the Hub with trust_remote_code=True): the loop would decode without forcing the words
    "force_words_ids": "constrained beam search",
    "constraints": "constrained beam search",
}


def _check_decoding_mode(generation_config) -> None:
    """Refuse the modes and caches the loop cannot honour. Also called before `generate` starts: transformers heals
    tokens, and builds some caches, before it hands over to the loop."""
    for name, what in _UNSUPPORTED_MODES.items():
        value = getattr(generation_config, name, None)
        if value is None or value is False:
            continue
        if name == "penalty_alpha" and not (value > 0 and (generation_config.top_k or 0) > 1):
            continue  # contrastive search runs only with both
        raise ValueError(f"speculation=... does not support {what}; remove `{name}`.")
    if generation_config.cache_implementation not in (None, "dynamic", "static"):
        raise ValueError(
            "speculation=... needs a cache that can be rolled back; cache_implementation="
            f"{generation_config.cache_implementation!r} cannot. Use the default dynamic cache, or 'static'."
        )


_SLIDING_LAYER_TYPES = {"sliding_attention", "hybrid_sliding"}
_WINDOWED_LAYER_TYPES = _SLIDING_LAYER_TYPES | {"chunked_attention"}  # each row's window or chunk masked per row
_STATIC_WINDOWED_LAYER_TYPES = {"sliding_attention", "chunked_attention"}  # full-length static layers, masks by slot
# Targets whose recurrent state no roll-back of the cache reaches (the modeling files of transformers 5.25 that update a
# recurrent state without `record_past`, and RecurrentGemma). hf_specdiff's loop finds them out after the prompt.
_UNROLLABLE_STATE_MODEL_TYPES = {
    "recurrent_gemma": "keeps its recurrent state on the model, outside the cache",
    **dict.fromkeys(("zamba", "zaya"), "gives its cache the recurrent state after a forward's last token only, none "
                    "for the tokens before it"),
}
# Targets whose attention reads the distance between a query and a key off their cache slots rather than their position
# ids (Inkling's relative-position logits, 5.17 to 5.25): a batch's cache must never hold holes between a row's tokens.
_SLOT_DISTANCE_MODEL_TYPES = {"inkling_text", "inkling2_text", "inkling2_loop_text"}
# Targets whose rotary embedding takes each token's position from its cache slot (RoFormer ignores position ids), baked
# into the cached keys: neither holes nor compaction keep a batch's rows right, so batches are refused.
_SLOT_ROTATED_MODEL_TYPES = {"roformer"}
# Targets the loop cannot drive, by what they do instead (each failed inside the model before this refusal).
_REFUSED_MODEL_TYPES = {
    "xlm": "takes the whole sequence at every step (its forward drops what its cache holds itself)",
    "minimax": "keeps its lightning-attention state in a cache of its own, which cannot be rolled back",
}


def _attention_windows(config) -> dict[str, int | AttentionChunks | None | bool] | None:
    """For a model with sliding-window or chunked-attention layers, what its layers see in a batch's verify forwards,
    by the key its forward looks their mask up by: {key: window, or its chunks (None: full attention, False: no
    mask)}; None for a model without.

    Layers keeping a state read their mask as the padding of the tokens fed ("conv" and "linear_attention" masks, also
    for the state half of a "hybrid" layer), and after the prompt every token fed is real: no mask. A "hybrid" or
    "hybrid_sliding" layer's attention reads the mask of its own type or of the plain attention type, by model."""
    types = _attention_types(config)
    if not types & _WINDOWED_LAYER_TYPES:
        return None
    windows = {}
    for kind in sorted(types):
        window = config.sliding_window if kind in _SLIDING_LAYER_TYPES else None
        if kind == "chunked_attention":
            windows[kind] = AttentionChunks(config.attention_chunk_size)
        elif kind in ("conv", "linear_attention"):
            windows[kind] = False
        elif kind in ("hybrid", "hybrid_sliding"):
            attention = "sliding_attention" if kind == "hybrid_sliding" else "full_attention"
            windows.update({kind: window, attention: window, "linear_attention": False, "conv": False})
        else:
            windows[kind] = window
    return windows


def _attention_types(config) -> set[str]:
    """The kinds of attention layers a model has ("full_attention", "sliding_attention", "linear_attention", ...).
    Layers that neither attend nor keep a state (Nemotron-H's "mlp" and "moe", which transformers caches as "dummy")
    are not among them."""
    if layer_types := getattr(config, "layer_types", None):
        return set(layer_types) - {"mlp", "moe", "dummy"}
    if block_types := getattr(config, "block_types", None):  # RecurrentGemma before 5.25, which names them there
        return {"linear_attention" if kind == "recurrent" else "sliding_attention" for kind in block_types}
    return {"sliding_attention"} if getattr(config, "sliding_window", None) else {"full_attention"}


# ----------------------------------------------------------------------------------------------------------------
# Opt-in
# ----------------------------------------------------------------------------------------------------------------


def _arguments_by_name(generate, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`generate`'s arguments by name: an option passed by position (`generate(ids, config, processors)`) is then
    checked and handled as the same option passed by keyword. Returns the arguments left positional (all of them for
    a `generate(self, *args, **kwargs)` override, whose names are not known) and the keywords."""
    parameters = list(inspect.signature(generate).parameters.values())[1:]  # after self
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return args, kwargs
    named = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    if len(args) > len(named):
        raise TypeError(f"generate() takes at most {len(named)} positional arguments ({len(args)} given).")
    for name, value in zip(named, args):
        if name in kwargs:
            raise TypeError(f"generate() got multiple values for argument '{name}'.")
        kwargs[name] = value
    return (), kwargs


def _check_position_ids(kwargs: dict) -> None:
    """The loop gives each row's tokens the positions its attention mask implies, as `generate` does when none are
    passed: position ids passed with other values would be dropped, so they are refused."""
    if kwargs.get("position_ids") is None:
        return
    position_ids = torch.as_tensor(kwargs["position_ids"]).long()
    mask = kwargs.get("attention_mask")
    mask = torch.ones_like(position_ids) if mask is None else mask.to(position_ids.device)
    real = mask.bool()
    if position_ids.shape != mask.shape or not torch.equal(position_ids[real], (mask.long().cumsum(-1) - 1)[real]):
        raise ValueError(
            "speculation=... numbers each row's tokens from 0 at its first real token (the positions the attention "
            "mask implies, which generate computes when none are passed), and these position_ids differ. Remove "
            "`position_ids`, or generate without speculation."
        )


def _speculative_generate(model, *args, speculation=None, num_jacobi_passes=None, num_draft_tokens=None, **kwargs):
    """transformers' `generate`, which `hf_specdiff.enable` extends with speculative decoding.

    With `assistant_model=` an hf_specdiff speculator and `speculation=` one of "xpress" (the dFlash drafter plus the
    xPress refiner), "dflash" (the drafter alone) or "markov" (the sequential Markov-head baseline), each step drafts a
    block from the target's hidden states and one target forward verifies it. The output is the target's own: its
    greedy output, or under sampling its distribution. `num_jacobi_passes=` overrides the speculator's refinement
    passes (xpress only); `num_draft_tokens=k` verifies only the first k drafts of each block. Every other argument
    is `generate`'s own (see `transformers.GenerationMixin.generate`). Without `speculation=` the call goes to that
    method (an hf_specdiff speculator there needs `speculation_type="dflash"`, transformers' native dFlash path).
    `speculation`, `num_jacobi_passes` and `num_draft_tokens` may also be set in a `GenerationConfig` (the one passed,
    else the model's), as `generate`'s own options may; the call's values win.
    """
    from .speculator import Speculator

    generate = type(model).generate
    args, kwargs = _arguments_by_name(generate, args, kwargs)
    assistant_model = kwargs.pop("assistant_model", None)
    # The call's options, else those set in its GenerationConfig (or the model's), as `generate` reads its own:
    # transformers' `speculation_type`, and hf_specdiff's options kept there as custom entries
    config = _effective_generation_config(model, kwargs)
    speculation_type = kwargs["speculation_type"] if "speculation_type" in kwargs else getattr(
        config, "speculation_type", None)
    speculation = speculation if speculation is not None else getattr(config, "speculation", None)
    # a config's Jacobi passes, like its options for other modes, apply where their method runs
    if num_jacobi_passes is None and speculation == "xpress":
        num_jacobi_passes = getattr(config, "num_jacobi_passes", None)
    if num_draft_tokens is None:
        num_draft_tokens = getattr(config, "num_draft_tokens", None)
    if speculation is None:
        if isinstance(assistant_model, Speculator):
            if speculation_type != "dflash":
                raise ValueError(
                    "An hf_specdiff speculator was passed as `assistant_model` without `speculation`: add "
                    f"speculation= one of {SPECULATION_METHODS} (or speculation_type='dflash' for transformers' "
                    "native dFlash path)."
                )
            assistant_model.check_compatible(model, "dflash")  # transformers would fail deep inside, if at all
            _check_native_dflash_target(model)
            if (kwargs.get("num_beams") or config.num_beams or 1) > 1:  # transformers only warns, and decodes greedily
                raise ValueError("transformers' native dFlash path (speculation_type='dflash') does not do beam "
                                 "search: set num_beams=1, or generate without the speculator.")
            assistant_model = assistant_model.drafter  # transformers' native dFlash path drives the drafter alone
        else:
            from .dflash import DFlashDraftModel

            if isinstance(assistant_model, DFlashDraftModel) and speculation_type != "dflash":
                raise ValueError(
                    "An hf_specdiff drafter (DFlashDraftModel) was passed as `assistant_model` without "
                    "speculation_type='dflash': add speculation_type='dflash' (transformers' native dFlash path), or "
                    f"pass the whole speculator with speculation= one of {SPECULATION_METHODS}."
                )
            if isinstance(assistant_model, DFlashDraftModel):
                _check_native_dflash_target(model)
        return generate(model, *args, assistant_model=assistant_model, **kwargs)

    if speculation == "spiffy":  # the diffusion LMs' method, asked of a causal LM
        raise ValueError(
            f"speculation='spiffy' is Spiffy, for masked diffusion LMs: load one with hf_specdiff.AutoDiffusionLM (or "
            f"wrap yours in hf_specdiff.DiffusionAdapter) and enable that. {type(model).__name__} is a causal LM: "
            f"choose one of {SPECULATION_METHODS}."
        )
    if speculation not in SPECULATION_METHODS:
        raise ValueError(f"speculation={speculation!r} is not supported; choose one of {SPECULATION_METHODS}.")
    if not isinstance(assistant_model, Speculator):
        raise TypeError(
            f"speculation={speculation!r} needs `assistant_model` to be an hf_specdiff Speculator (e.g. "
            "hf_specdiff.AutoSpeculator.from_pretrained(path)), got "
            f"{type(assistant_model).__name__ if assistant_model is not None else None}."
        )
    if speculation_type is not None:
        where = "" if "speculation_type" in kwargs else " (set in the generation config)"
        raise ValueError(f"Pass either `speculation` (hf_specdiff) or `speculation_type` (transformers){where}, not "
                         "both.")
    if is_deepspeed_zero3_enabled():
        raise ValueError(
            "speculation=... drafts with the target's token embeddings and lm_head outside its forward, where "
            "DeepSpeed ZeRO-3 keeps them partitioned: generate without speculation, or shard the target with FSDP "
            "instead (its processes then decode in lockstep), or load it whole."
        )
    # transformers decides synced_gpus (FSDP across processes) but does not hand it to a custom decoding loop
    synced_gpus = kwargs.pop("synced_gpus", None)
    if synced_gpus is None:
        synced_gpus = is_fsdp_managed_module(model) and _in_a_process_group()
    elif synced_gpus and not _in_a_process_group():
        raise ValueError(
            "synced_gpus=True keeps processes in step, and torch.distributed has no group of processes here: call "
            "torch.distributed.init_process_group() first (as FSDP does), or drop synced_gpus."
        )
    if kwargs.get("custom_generate") is not None:
        raise ValueError("`speculation` already supplies the decoding loop; remove `custom_generate`.")
    if kwargs.get("assistant_tokenizer") is not None:
        raise ValueError(
            "speculation=... drafts in the target's own vocabulary; remove `assistant_tokenizer` (it is for "
            "transformers' assisted decoding with a draft model of another tokenizer)."
        )
    if num_jacobi_passes is not None and (speculation != "xpress" or num_jacobi_passes < 1):
        raise ValueError(
            f"num_jacobi_passes={num_jacobi_passes} applies to speculation='xpress' only and must be >= 1."
        )
    if num_draft_tokens is not None and not 1 <= num_draft_tokens < assistant_model.drafter.config.block_size:
        raise ValueError(
            f"num_draft_tokens={num_draft_tokens}: a block of {assistant_model.drafter.config.block_size} slots offers "
            f"1 to {assistant_model.drafter.config.block_size - 1} drafts (the first slot is the anchor)."
        )
    assistant_model.check_compatible(model, speculation)
    _warn_of_shape_dependent_quantization(model)
    _check_position_ids(kwargs)
    # before `generate` starts: it heals tokens (token_healing) and builds the cache (an offloaded one already fails
    # on some machines) before it hands over to the loop
    generation_config = config
    for name in (*_UNSUPPORTED_MODES, "top_k", "cache_implementation"):  # kwargs override the config, as in generate
        if name in kwargs:
            setattr(generation_config, name, kwargs[name])
    _check_not_assisted(generation_config, kwargs)
    _check_decoding_mode(generation_config)

    # Stop strings need the tokenizer, which transformers does not hand to a custom decoding loop: build the
    # criterion here and hand it over with the user's own criteria.
    tokenizer = kwargs.pop("tokenizer", None)
    stop_strings = _taken_from_generate(model, kwargs, generation_config, "stop_strings")
    if stop_strings is not None:
        if tokenizer is None:
            raise ValueError("`stop_strings` needs the tokenizer: pass tokenizer=... to generate.")
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(StopStringCriteria(tokenizer, stop_strings))
        kwargs["stopping_criteria"] = criteria
    # The loop chunks the prefill itself (`prefill_in_chunks`); transformers, told of it, would allocate its own static
    # cache up front for a chunked prefill it does not run here (the loop keeps its own static caches).
    prefill_chunk_size = _taken_from_generate(model, kwargs, generation_config, "prefill_chunk_size")
    if prefill_chunk_size is not None and not (isinstance(prefill_chunk_size, int) and prefill_chunk_size > 0):
        raise ValueError(f"prefill_chunk_size={prefill_chunk_size!r}: give a positive number of tokens per chunk.")

    loop = functools.partial(
        speculative_decoding,
        speculator=assistant_model,
        method=speculation,
        streamer=kwargs.pop("streamer", None),
        synced_gpus=synced_gpus,
        num_jacobi_passes=num_jacobi_passes,
        num_draft_tokens=num_draft_tokens,
        # (a name of its own: `generate` hands the loop the cleared prefill_chunk_size=None among the model inputs)
        prefill_chunk_length=prefill_chunk_size,
    )
    return generate(model, *args, custom_generate=loop, **kwargs)


def _check_native_dflash_target(model) -> None:
    """Refuse the targets on which transformers' native dFlash path (`DFlashTokenCandidateGenerator`, 5.17 to 5.25)
    fails inside transformers. It reads the target's position ids from the model inputs, which `generate` makes only
    for a forward that takes them: a target whose forward takes none (BLOOM, MPT, RWKV; Mamba, Mamba 2, Falcon-Mamba,
    which transformers 5.25 no longer refuses as stateful) fails with `KeyError: 'position_ids'`; hf_specdiff's own
    loop needs none. And under 5.25 it rolls back recurrent states that RecurrentGemma, Zamba and Zaya do not keep in
    the cache per token (AttributeError, IndexError)."""
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise ValueError(
            f"transformers' native dFlash path (speculation_type='dflash') reads the target's position ids, and "
            f"{type(model).__name__}'s forward takes none (transformers would fail with KeyError: 'position_ids'). "
            f"Use hf_specdiff's own loop: assistant_model=speculator, speculation= one of {SPECULATION_METHODS}."
        )
    # transformers 5.25 no longer refuses stateful targets there, and fails inside its loop on these (earlier versions
    # refuse them); hf_specdiff's own loop refuses them too.
    if reason := _UNROLLABLE_STATE_MODEL_TYPES.get(model.config.get_text_config().model_type):
        raise ValueError(
            f"transformers' native dFlash path (speculation_type='dflash') rolls the target's cache back past rejected "
            f"drafts, and {type(model).__name__} {reason}: that path would fail inside transformers. Generate without "
            "the speculator."
        )


def _warn_of_shape_dependent_quantization(model) -> None:
    """Speculation reproduces what the target's forward of several tokens computes. Quantization of the activations
    (quantized afresh in each forward) and bitsandbytes (another kernel for a single token) make that differ from its
    forward of one token, which plain decoding runs: the embedded SmolLM2 so quantized, fed its own greedy answer in
    one forward, picks another token at 2-15% of the positions. Weight-only quantization leaves them equal."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    config = quantizer.quantization_config
    quant_type = getattr(config, "quant_type", None)  # torchao's: a config object, or its name in older releases
    quant_type = quant_type if isinstance(quant_type, str) else type(quant_type).__name__
    what = "bitsandbytes" if config.quant_method == "bitsandbytes" else quant_type
    if what == "bitsandbytes" or "activation" in quant_type.lower():
        warn_at_caller(
            f"This target is quantized with {what}, whose forward of several tokens computes other logits than its "
            "forward of one: its greedy output depends on how it is fed, and speculation, which verifies several "
            "tokens per forward, may leave plain generate's where the two disagree. Quantize the weights alone (e.g. "
            "torchao's Int8WeightOnlyConfig) for output identical to plain generate's."
        )


def _taken_from_generate(model, kwargs: dict, generation_config, name: str):
    """The value of generation option `name` for this call (`generation_config`: the effective one), taken out of what
    `generate` will see: the loop handles it itself. `generate` fills what a passed config leaves unset from the
    model's own config and then applies its keyword arguments: a keyword None clears it whatever the configs hold."""
    value = kwargs.get(name, getattr(generation_config, name))
    if value is None:
        return None
    passed = kwargs.get("generation_config")
    if name in kwargs or passed is None or getattr(passed, name) is None \
            or getattr(model.generation_config, name, None) is not None:
        kwargs[name] = None
    else:  # cleared in a copy of the config: a keyword beside a config draws transformers' deprecation warning
        kwargs["generation_config"] = copy.copy(kwargs["generation_config"])
        setattr(kwargs["generation_config"], name, None)
    return value


def _effective_generation_config(model, kwargs: dict) -> GenerationConfig:
    """The config `generate` will decode with, before its keyword arguments: a config passed in the call, with what
    it leaves unset filled from the model's own (as transformers fills it), else a copy of the model's."""
    passed = kwargs.get("generation_config")
    config = copy.deepcopy(passed or model.generation_config)
    if passed is not None:
        config.update(**model.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    return config


def enable(model):
    """Let `model.generate` take `speculation=...` (this model only; other models and the class are untouched).

    For a masked diffusion LM (`hf_specdiff.diffusion.DiffusionLM` or `DiffusionAdapter`), `generate` becomes the
    library's diffusion decoding, with `speculation=None | "spiffy"`.

    Returns the model. Undo with `disable(model)`.
    """
    from transformers import GenerationMixin, PreTrainedModel

    _compat.check_transformers_version()
    if _is_diffusion_lm(model):
        from .diffusion.decoding import diffusion_lm_generate

        model.generate = _EnabledGenerate(diffusion_lm_generate, model)
        return model
    if not isinstance(model, PreTrainedModel) or not isinstance(model, GenerationMixin):
        # a PEFT wrapper's generate calls its base model's, so enabling that one serves the wrapper too
        hint = ""
        if callable(getattr(model, "get_base_model", None)):
            hint = (" Enable the model it wraps: hf_specdiff.enable(model.get_base_model()), then call the wrapper's "
                    "generate as before.")
        elif isinstance(model, torch._dynamo.eval_frame.OptimizedModule):  # what torch.compile(model) returns
            hint = (" Enable the model it wraps, hf_specdiff.enable(compiled._orig_mod), and call generate as before "
                    "(or enable the model first and compile it in place with model.compile()).")
        raise TypeError(
            f"hf_specdiff.enable expects a transformers causal LM (PreTrainedModel with generate), got "
            f"{type(model).__name__}.{hint}"
        )
    if model.config.is_encoder_decoder:
        raise ValueError("hf_specdiff speculative decoding supports decoder-only targets; "
                         "this model is encoder-decoder.")
    if model.get_output_embeddings() is None:
        raise ValueError(f"{type(model).__name__} has no language-model head; load it with AutoModelForCausalLM.")
    model.generate = _EnabledGenerate(_speculative_generate, model)
    return model


class _EnabledGenerate:
    """What `enable` sets as the model's `generate`: `function` bound to `model`, as a bound method is, but one that
    pickles. A bound method pickles as a lookup of its function's name on the model, which finds nothing here (the
    function is not the class's), so an enabled model saved with `torch.save`, or sent to another process, would be
    written but could not be loaded back. Copies (`copy.deepcopy`, unpickling) are bound to the copied model."""

    def __init__(self, function, model):
        self.__func__ = function
        self.__self__ = model
        self.__name__, self.__qualname__, self.__doc__ = function.__name__, function.__qualname__, function.__doc__

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self):  # what `inspect.signature(model.generate)` answers for a bound method
        return inspect.signature(types.MethodType(self.__func__, self.__self__))

    def __repr__(self):
        return f"<hf_specdiff generate of {type(self.__self__).__name__}>"


def _is_diffusion_lm(model) -> bool:
    from .diffusion.adapter import DiffusionAdapter
    from .diffusion.modeling import DiffusionLM

    return isinstance(model, (DiffusionLM, DiffusionAdapter))


def disable(model):
    """Undo `enable(model)`."""
    if is_enabled(model):
        del model.generate
    return model


def is_enabled(model) -> bool:
    from .diffusion.decoding import diffusion_lm_generate

    bound = model.__dict__.get("generate")
    return getattr(bound, "__func__", None) in (_speculative_generate, diffusion_lm_generate)
