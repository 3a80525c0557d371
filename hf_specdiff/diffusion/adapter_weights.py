"""A diffusion LM stored as what training added to a causal LM: LoRA factors, the [MASK] embedding row, a base name.

`hf_specdiff.diffusion.training` writes such a folder (style rule 8: the base model's weights are never copied):

    config.json                 {"model_type": "hf_specdiff_diffusion_adapter", "format_version": 1,
                                 "base": "embedded:SmolLM2-135M-Instruct" | a local folder | a Hub id | null,
                                 "base_config": {vocab_size, hidden_size, ...}  (checked against the base at load),
                                 "diffusion": {mask_token_id, shift_logits, block_causal}  (DiffusionLMConfig fields),
                                 "finetune": "lora" | "full", "lora": {rank, alpha, target_modules} (lora only),
                                 "trained_steps": N (all runs), "continued_from_steps": N (steps before this run,
                                 from `init_adapter`), "holdout_fingerprint": the held-out rows' hash}
    adapter_model.safetensors   "<module>.lora_A.weight" (r, in) and "<module>.lora_B.weight" (out, r) per adapted
                                Linear ("full": the trained weights themselves, under their DiffusionLM names), and
                                "mask_embedding" (hidden,) when the [MASK] row was trained
    tokenizer files             the base's tokenizer, when training had it (small; lets AutoTokenizer read the folder)

`AutoDiffusionLM.from_pretrained(folder)` calls `load_adapter_model`: load the base, `DiffusionLM.from_causal_lm`, then
merge by hand, W <- W + (alpha / r) * B @ A, which is exactly what peft's `merge_and_unload` computes for a LoRA
Linear. Merging by hand keeps peft a training-only dependency, and the merged model runs at the base model's speed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .modeling import DiffusionLM

ADAPTER_MODEL_TYPE = "hf_specdiff_diffusion_adapter"
FORMAT_VERSION = 1
WEIGHTS_NAME = "adapter_model.safetensors"
EMBEDDED_BASE = "embedded:SmolLM2-135M-Instruct"  # the model `hf_specdiff.load_default_target()` returns
MASK_EMBEDDING = "mask_embedding"
BASE_FACTS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads")


def is_adapter_config(published: dict) -> bool:
    return published.get("model_type") == ADAPTER_MODEL_TYPE


def named_base(where: str | os.PathLike, **hub_kwargs) -> str | None:
    """The base a diffusion LM folder (or Hub repo) was adapted from, when it is an adapter that names one."""
    from transformers.utils import cached_file

    config_file = cached_file(str(where), "config.json", _raise_exceptions_for_missing_entries=False, **hub_kwargs)
    published = json.loads(Path(config_file).read_text()) if config_file else {}
    return published.get("base") if is_adapter_config(published) else None


def base_facts(model: nn.Module) -> dict:
    """The base config values an adapter depends on (stored, then checked when the adapter is applied)."""
    config = model.config.to_dict()
    return {key: config.get(key) for key in BASE_FACTS}


def load_base(base: str | None, with_tokenizer: bool = False, **hub_kwargs):
    """The causal LM named by an adapter's `base` (and its tokenizer, or None when it has none); `hub_kwargs`
    (cache_dir, token, local_files_only, ...) as for the adapter, which may live elsewhere than its base."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if base == EMBEDDED_BASE:
        from ..embedded import load_default_target

        model, tokenizer = load_default_target()
        return (model, tokenizer) if with_tokenizer else model
    if not base or base.startswith("embedded:"):
        raise ValueError(f"Unknown base {base!r}: the only embedded base is {EMBEDDED_BASE!r}; otherwise pass a local "
                         "folder or a Hub id of the causal LM the adapter was trained on (base=... when loading).")
    try:
        model = AutoModelForCausalLM.from_pretrained(base, **hub_kwargs)
    except (OSError, ValueError) as error:  # ValueError: not a valid repo id either
        raise ValueError(f"The base model {base!r} could not be loaded ({error}). Pass base= a local folder or Hub id "
                         "(offline: already in the local Hub cache) holding the causal LM the adapter was trained on."
                         ) from error
    if not with_tokenizer:
        return model
    try:
        tokenizer = AutoTokenizer.from_pretrained(base, **hub_kwargs)
    except (OSError, ValueError):
        tokenizer = None  # a base without a tokenizer still trains; the artifact then holds none
    return model, tokenizer


def save_adapter(folder: str | os.PathLike, tensors: dict[str, torch.Tensor], *, base: str | None, base_config: dict,
                 diffusion: dict, finetune: str, lora: dict | None = None, tokenizer=None, extra: dict | None = None
                 ) -> Path:
    """Write config.json, adapter_model.safetensors (float32) and, if given, the tokenizer into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": ADAPTER_MODEL_TYPE, "format_version": FORMAT_VERSION, "base": base,
              "base_config": base_config, "diffusion": diffusion, "finetune": finetune, **(extra or {})}
    if lora is not None:
        config["lora"] = lora
    state = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in tensors.items()}
    save_file(state, folder / WEIGHTS_NAME, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def load_adapter_model(where: str, published: dict, dtype=None, device=None, base=None,
                       hub_kwargs: dict | None = None) -> DiffusionLM:
    """A `DiffusionLM`: the base named in `published` (or `base`: a folder, Hub id or loaded causal LM, which wins)
    converted with `from_causal_lm`, with the adapter merged in (in float32). `dtype` None: the base's dtype."""
    from transformers.utils import cached_file

    # 1. The folder's config: version, diffusion fields, LoRA scale.
    version = published.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"{where}: diffusion adapter format_version {version!r} is not supported (this hf_specdiff "
                         f"reads version {FORMAT_VERSION}); upgrade hf_specdiff or retrain the adapter.")
    try:
        diffusion = {key: published["diffusion"][key] for key in ("mask_token_id", "shift_logits", "block_causal")}
        finetune = published["finetune"]
        scale = float(published["lora"]["alpha"]) / int(published["lora"]["rank"]) if finetune == "lora" else None
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise ValueError(f"{where}/config.json is not a complete diffusion adapter config ({error!r} missing or "
                         "invalid); the folder is corrupt: retrain or re-download it.") from error
    if finetune not in ("lora", "full"):
        raise ValueError(f"{where}: finetune={finetune!r} is not 'lora' or 'full'; the folder is corrupt.")

    # 2. The base, checked against what the adapter was trained on.
    if base is None:
        base = published.get("base")
        if base is None:
            raise ValueError(f"{where} does not name its base model (it was trained on a model given in memory): "
                             "pass base= the causal LM it was trained on (a folder, Hub id or loaded model).")
    # the adapter's revision / subfolder name its own files, not the base's
    base_options = {k: v for k, v in (hub_kwargs or {}).items() if k not in ("revision", "subfolder")}
    causal = base if isinstance(base, nn.Module) else load_base(str(base), **base_options)
    expected, found = published.get("base_config") or {}, base_facts(causal)
    differ = {key: (value, found.get(key)) for key, value in expected.items() if found.get(key) != value}
    if differ:
        given = f"the given {type(base).__name__}" if isinstance(base, nn.Module) else repr(base)
        raise ValueError(f"{where} was trained on a different base model than {given}: (trained on, given) "
                         f"{differ}. Pass base= the causal LM it was trained on.")
    model = DiffusionLM.from_causal_lm(causal, **diffusion)
    base_dtype = model.dtype
    if model.dtype in (torch.float16, torch.bfloat16):
        model = model.float()  # merge in float32, cast afterwards

    # 3. The add-on tensors, merged.
    try:
        weights = load_file(cached_file(where, WEIGHTS_NAME, **(hub_kwargs or {})))
    except (OSError, SafetensorError) as error:
        raise ValueError(f"{where}/{WEIGHTS_NAME} is missing or unreadable ({error}); the folder is corrupt: retrain "
                         "or re-download it.") from error
    merge_adapter(model, weights, scale, where)
    return model.to(dtype=dtype or base_dtype, device=device).eval()


@torch.no_grad()
def merge_adapter(model: DiffusionLM, weights: dict[str, torch.Tensor], lora_scale: float | None, where: str) -> None:
    """Apply adapter tensors to `model` in place: LoRA pairs (lora_scale not None) or full weights, and the [MASK]
    row. Every name and shape is checked before anything is changed."""
    weights = dict(weights)
    updates, problems = [], []
    mask_row = weights.pop(MASK_EMBEDDING, None)
    embedding = model.model.embed_tokens.weight
    if mask_row is not None and mask_row.shape != embedding.shape[1:]:
        problems.append(f"{MASK_EMBEDDING} {tuple(mask_row.shape)} != {tuple(embedding.shape[1:])}")
    parameters, modules = dict(model.named_parameters()), dict(model.named_modules())
    frozen = {"model.embed_tokens.weight", "lm_head.weight"}
    if lora_scale is not None:
        adapted = {name.removesuffix(".lora_A.weight") for name in weights if name.endswith(".lora_A.weight")}
        for name in sorted(adapted):
            a, b = weights.pop(f"{name}.lora_A.weight"), weights.pop(f"{name}.lora_B.weight", None)
            linear = modules.get(name)
            if b is None or not isinstance(linear, nn.Linear):
                problems.append(f"{name}: " + ("no lora_B" if b is None else "not a Linear of this model"))
            elif a.shape != (a.shape[0], linear.in_features) or b.shape != (linear.out_features, a.shape[0]):
                problems.append(f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit a Linear "
                                f"{linear.in_features} -> {linear.out_features}")
            else:
                updates.append((linear.weight, lambda w, a=a, b=b: w + (b.to(w) @ a.to(w)) * lora_scale))
    else:
        for name in sorted(set(weights) & (set(parameters) - frozen)):
            value = weights.pop(name)
            if value.shape != parameters[name].shape:
                problems.append(f"{name} {tuple(value.shape)} != {tuple(parameters[name].shape)}")
            else:
                updates.append((parameters[name], lambda w, value=value: value.to(w)))
    if weights:
        problems.append(f"unexpected tensors {sorted(weights)[:5]}")
    if problems:
        raise ValueError(f"{where}/{WEIGHTS_NAME} does not fit this base model: {problems[:5]}. The adapter is corrupt "
                         "or was trained on another base: retrain it, or pass base= the model it was trained on.")
    for parameter, update in updates:
        parameter.copy_(update(parameter))
    if mask_row is not None:  # tied embeddings: lm_head's row changes too, i.e. only the [MASK] logit, never used
        embedding[model.mask_token_id] = mask_row.to(embedding)
