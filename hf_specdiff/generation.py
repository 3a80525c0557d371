"""`generate(..., assistant_model=speculator, speculation=...)`: lossless speculative decoding inside `generate()`.

`enable(model)` opts one model in: its `generate` accepts `speculation="xpress" | "dflash" | "markov"`. transformers
still prepares everything (generation config, logits processors, stopping criteria, the cache); only the decoding
loop is ours, passed to `generate` as a `custom_generate` callable. The loop is standard speculative decoding
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"), with candidates from
`BlockDiffusionCandidateGenerator`:

    prefill -> [draft block -> resolve block (xpress / markov / dflash) -> verify in one target forward
                -> accept a prefix + one bonus token -> roll back the target cache] until a stop criterion fires

Greedy output equals the target's own greedy output; sampled output follows the target's distribution.
"""

from __future__ import annotations

import functools
import time
import types
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from . import _compat
from .candidates import BlockDiffusionCandidateGenerator, SpeculationStats, process_logits, synchronize

SPECULATION_METHODS = ("xpress", "dflash", "markov")


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `speculation`: accepted lengths, counts, target forwards and timings."""

    speculation: SpeculationStats | None = None


# ----------------------------------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------------------------------


def verify_greedy(target_scores: torch.Tensor, candidates: torch.LongTensor):
    """target_scores (b, n+1, V) processed; candidates (b, n). Accept the longest prefix the target's argmax agrees
    with, then the target's own token at the first disagreement (or after the last candidate) as the bonus."""
    choice = target_scores.argmax(dim=-1)  # (b, n+1)
    num_accepted = int((candidates == choice[:, :-1]).int().cumprod(dim=1).sum(dim=1)[0])
    return torch.cat([candidates[:, :num_accepted], choice[:, num_accepted : num_accepted + 1]], dim=1), num_accepted


def verify_sampling(target_scores: torch.Tensor, draft_scores: torch.Tensor, candidates: torch.LongTensor):
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

    Draft token x_i ~ q_i is kept with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the token is
    resampled from norm(max(0, p_i - q_i)); if all n are kept, a bonus token is drawn from p_{n+1}. Every emitted
    token is then distributed exactly as p, whatever q is.
    """
    n = candidates.shape[1]
    p = target_scores.softmax(dim=-1)  # (b, n+1, V)
    q = draft_scores.softmax(dim=-1)  # (b, n, V)
    p_x = p[:, :n].gather(-1, candidates[..., None])[..., 0]
    q_x = q.gather(-1, candidates[..., None])[..., 0]
    keep = torch.rand_like(p_x) * q_x < p_x  # u < p/q without dividing by a zero q
    num_accepted = int(keep.int().cumprod(dim=1).sum(dim=1)[0])
    if num_accepted < n:
        residual = (p[:, num_accepted] - q[:, num_accepted]).clamp(min=0)
        residual = residual if bool(residual.sum() > 0) else p[:, num_accepted]
        bonus = torch.multinomial(residual / residual.sum(dim=-1, keepdim=True), 1)
    else:
        bonus = torch.multinomial(p[:, n], 1)
    return torch.cat([candidates[:, :num_accepted], bonus], dim=1), num_accepted


def first_stop(new_tokens, sequence, stopping_criteria, generation_config, scores) -> int | None:
    """Index (into new_tokens) of the token at which plain `generate` would have stopped, or None.

    `sequence` already ends with `new_tokens`. EOS and max length are checked on the whole run at once; any other
    criterion (stop strings, user criteria) is asked for every prefix, as plain decoding would ask it."""
    n, length = new_tokens.shape[1], sequence.shape[1]
    stops = []
    if (eos := generation_config._eos_token_tensor) is not None:
        hits = torch.isin(new_tokens[0], eos.to(new_tokens.device)).nonzero()
        if hits.numel():
            stops.append(int(hits[0, 0]))
    if generation_config.max_length is not None and length >= generation_config.max_length:
        stops.append(n - 1 - (length - generation_config.max_length))
    others = [c for c in stopping_criteria if not isinstance(c, (EosTokenCriteria, MaxLengthCriteria))]
    if others:
        for i in range(min(stops, default=n)):
            prefix = sequence[:, : length - n + i + 1]
            if any(bool(c(prefix, scores).any()) for c in others):
                stops.append(i)
                break
    return min(stops) if stops else None


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
    **model_kwargs,
):
    _check_decoding_inputs(model, input_ids, generation_config, model_kwargs)
    do_sample = generation_config.do_sample
    want_dict = generation_config.return_dict_in_generate
    keep_scores = want_dict and generation_config.output_scores
    keep_logits = want_dict and generation_config.output_logits
    scores, raw_logits = [], []
    stats = SpeculationStats(method)
    drafter = BlockDiffusionCandidateGenerator(
        model, speculator, method, generation_config, logits_processor, num_jacobi_passes, stats
    )
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    cache = DynamicCache() if cache is None else cache
    if streamer is not None:
        streamer.put(input_ids.cpu())

    outputs, num_accepted, first = None, 0, True
    while True:
        length = input_ids.shape[1]
        # 1. Draft and resolve a block (nothing on the first pass: the target has not run yet).
        candidate_ids, draft_scores = drafter.get_candidates(
            input_ids, model_kwargs=model_kwargs, model_outputs=outputs, is_first_iteration=first,
            n_last_matches=num_accepted,
        )
        candidates = candidate_ids[:, length:]
        num_drafts = candidates.shape[1]

        # 2. Verify: one target forward over [anchor, candidates] (the whole prompt on the first pass).
        synchronize(input_ids.device)
        start = time.perf_counter()
        fed = candidate_ids if first else candidate_ids[:, length - 1 :]
        positions = torch.arange(candidate_ids.shape[1] - fed.shape[1], candidate_ids.shape[1], device=fed.device)
        logits_kwargs = {"logits_to_keep": num_drafts + 1} if "logits_to_keep" in model_kwargs else {}
        outputs = model(
            input_ids=fed, position_ids=positions[None], use_cache=True, output_hidden_states=True,
            **logits_kwargs, **_compat.cache_kwargs(model, cache),
        )
        stats.target_forwards += 1
        target_logits = outputs.logits[:, -num_drafts - 1 :].float()  # (b, n+1, V)
        target_scores = process_logits(logits_processor, candidate_ids, target_logits, length)

        # 3. Accept: the longest agreeing prefix plus one token from the target (greedy or speculative sampling).
        if do_sample:
            if num_drafts:
                new_tokens, num_accepted = verify_sampling(target_scores, draft_scores, candidates)
            else:
                new_tokens, num_accepted = torch.multinomial(target_scores[:, 0].softmax(-1), 1), 0
        else:
            new_tokens, num_accepted = verify_greedy(target_scores, candidates)
        synchronize(input_ids.device)
        stats.verify_seconds += time.perf_counter() - start

        # 4. Stop where plain decoding would have stopped, even inside the accepted run.
        input_ids = torch.cat([input_ids, new_tokens], dim=1)
        stop = first_stop(new_tokens, input_ids, stopping_criteria, generation_config, None)
        if stop is not None:
            input_ids = input_ids[:, : length + stop + 1]
            new_tokens = new_tokens[:, : stop + 1]
        if not first:
            stats.accepted_lengths.append(new_tokens.shape[1])
            stats.drafted_lengths.append(num_drafts)
            stats.accepted_tokens += min(num_accepted, new_tokens.shape[1])
        if keep_scores:
            scores.extend(target_scores[:, i] for i in range(new_tokens.shape[1]))
        if keep_logits:
            raw_logits.extend(target_logits[:, i] for i in range(new_tokens.shape[1]))
        if streamer is not None:
            streamer.put(new_tokens.cpu())
        if stop is not None:
            break

        # 5. Roll back: the target cache keeps [.., anchor, accepted]; the bonus token is the next anchor.
        _compat.crop_cache(cache, num_drafts - num_accepted)
        first = False

    if streamer is not None:
        streamer.end()
    if not want_dict:
        return input_ids
    return SpeculativeDecoderOnlyOutput(
        sequences=input_ids,
        scores=tuple(scores) if keep_scores else None,
        logits=tuple(raw_logits) if keep_logits else None,
        speculation=stats,
        **{_compat.generate_output_cache_field(): cache},
    )


# Model inputs `generate` prepares that the loop handles itself (positions and the cache are rebuilt per step).
_HANDLED_MODEL_KWARGS = {"attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "logits_to_keep"}


def _check_decoding_inputs(model, input_ids, generation_config, model_kwargs) -> None:
    """What speculative decoding cannot do raises here, before any work."""
    if (generation_config.num_beams or 1) > 1:
        raise ValueError(
            f"speculation=... cannot be combined with beam search (num_beams={generation_config.num_beams}); "
            "use num_beams=1."
        )
    if (generation_config.num_return_sequences or 1) > 1:
        raise ValueError(
            "speculation=... supports num_return_sequences=1 only for now; got "
            f"{generation_config.num_return_sequences}. Call generate once per sequence."
        )
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"speculation=... supports batch size 1 for now; got a batch of {input_ids.shape[0]}. "
            "Generate row by row, or drop `speculation` to use plain batched generate."
        )
    for name in ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp", "assistant_ensemble_weight"):
        if getattr(generation_config, name, None):
            raise ValueError(f"speculation=... replaces transformers' assisted decoding; remove `{name}`.")
    if generation_config.use_cache is False:
        raise ValueError("speculation=... needs the KV cache; remove use_cache=False.")
    if generation_config.cache_implementation not in (None, "dynamic"):
        raise ValueError(
            f"speculation=... needs a cache that can be rolled back; cache_implementation="
            f"{generation_config.cache_implementation!r} cannot. Use the default dynamic cache."
        )
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError(
            "speculation=... does not return attentions or hidden states; set output_attentions=False and "
            "output_hidden_states=False."
        )
    unsupported = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _HANDLED_MODEL_KWARGS)
    if unsupported:
        raise ValueError(f"speculation=... does not support the model inputs {unsupported}; remove them.")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("speculation=... with batch size 1 expects no padding: remove the padding from the prompt.")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("speculation=... starts from an empty cache; do not pass a pre-filled cache.")


# ----------------------------------------------------------------------------------------------------------------
# Opt-in
# ----------------------------------------------------------------------------------------------------------------


def _speculative_generate(model, *args, speculation=None, assistant_model=None, num_jacobi_passes=None, **kwargs):
    from .speculator import Speculator

    generate = type(model).generate
    if speculation is None:
        if isinstance(assistant_model, Speculator):
            if kwargs.get("speculation_type") != "dflash":
                raise ValueError(
                    "An hf_specdiff speculator was passed as `assistant_model` without `speculation`: add "
                    f"speculation= one of {SPECULATION_METHODS} (or speculation_type='dflash' for transformers' "
                    "native dFlash path)."
                )
            assistant_model = assistant_model.drafter  # transformers' native dFlash path drives the drafter alone
        return generate(model, *args, assistant_model=assistant_model, **kwargs)

    if speculation not in SPECULATION_METHODS:
        raise ValueError(f"speculation={speculation!r} is not supported; choose one of {SPECULATION_METHODS}.")
    if not isinstance(assistant_model, Speculator):
        raise TypeError(
            f"speculation={speculation!r} needs `assistant_model` to be an hf_specdiff Speculator (e.g. "
            "hf_specdiff.AutoSpeculator.from_pretrained(path)), got "
            f"{type(assistant_model).__name__ if assistant_model is not None else None}."
        )
    if kwargs.get("speculation_type") is not None:
        raise ValueError("Pass either `speculation` (hf_specdiff) or `speculation_type` (transformers), not both.")
    if kwargs.get("synced_gpus"):
        raise ValueError("speculation=... does not support synced_gpus (FSDP / ZeRO-3 generation); set it to False.")
    if kwargs.get("custom_generate") is not None:
        raise ValueError("`speculation` already supplies the decoding loop; remove `custom_generate`.")
    if num_jacobi_passes is not None and (speculation != "xpress" or num_jacobi_passes < 1):
        raise ValueError(
            f"num_jacobi_passes={num_jacobi_passes} applies to speculation='xpress' only and must be >= 1."
        )
    assistant_model.check_compatible(model, speculation)

    # Stop strings need the tokenizer, which transformers does not hand to a custom decoding loop: build the
    # criterion here and hand it over with the user's own criteria.
    tokenizer = kwargs.pop("tokenizer", None)
    stop_strings = kwargs.get("stop_strings")
    if stop_strings is None and kwargs.get("generation_config") is not None:
        stop_strings = kwargs["generation_config"].stop_strings
    if stop_strings is None:
        stop_strings = model.generation_config.stop_strings
    if stop_strings is not None:
        if tokenizer is None:
            raise ValueError("`stop_strings` needs the tokenizer: pass tokenizer=... to generate.")
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(StopStringCriteria(tokenizer, stop_strings))
        kwargs.update(stopping_criteria=criteria, stop_strings=None)

    loop = functools.partial(
        speculative_decoding,
        speculator=assistant_model,
        method=speculation,
        streamer=kwargs.pop("streamer", None),
        num_jacobi_passes=num_jacobi_passes,
    )
    return generate(model, *args, custom_generate=loop, **kwargs)


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

        model.generate = types.MethodType(diffusion_lm_generate, model)
        return model
    if not isinstance(model, PreTrainedModel) or not isinstance(model, GenerationMixin):
        raise TypeError(
            f"hf_specdiff.enable expects a transformers causal LM (PreTrainedModel with generate), got "
            f"{type(model).__name__}."
        )
    if model.config.is_encoder_decoder:
        raise ValueError("hf_specdiff speculative decoding supports decoder-only targets; this model is encoder-decoder.")
    if model.get_output_embeddings() is None:
        raise ValueError(f"{type(model).__name__} has no language-model head; load it with AutoModelForCausalLM.")
    model.generate = types.MethodType(_speculative_generate, model)
    return model


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
