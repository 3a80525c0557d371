"""A speculator: a dFlash drafter plus its optional add-ons (xPress refiner, Markov head), saved as one Hub repo.

Layout (a Hub model repo or a local folder):

    config.json, model.safetensors     the drafter, exactly in z-lab's published layout (loads in z-lab's code and
                                       in transformers' native `speculation_type="dflash"`)
    refiner/config.json, ...           the xPress refiner (optional)
    markov_head/config.json, ...       the Markov head baseline (optional)
    draft_vocab.safetensors            the draft vocabulary (optional, `draft_vocab.py`): `token_ids`, int64
    speculator.json                    {"format": "hf_specdiff.speculator", "format_version": 1, "components": [...],
                                        "draft_vocab": "draft_vocab.safetensors" when there is one}

A folder without `speculator.json` is read as a bare z-lab drafter. Only new weights are stored: the drafter
borrows the target's embedding and lm_head, which are never copied into the artifact.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ._hub import (
    SAVED_FOLDER,
    UPLOAD_OPTIONS,
    check_folder_or_repo_id,
    check_repo_id,
    find_file,
    split_push_options,
    take_dtype,
    upload_folder,
    usual_modes,
)
from ._warnings import warn_at_caller
from .dflash import DFlashConfig, DFlashDraftModel, embedding_sample, full_attention_rope_parameters, spread_layer_ids
from .draft_vocab import check_draft_vocab
from .markov import MarkovConfig, MarkovHead
from .xpress import XPressConfig, XPressRefiner

MANIFEST = "speculator.json"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
FORMAT = "hf_specdiff.speculator"
FORMAT_VERSION = 1
_COMPONENTS = {"refiner": XPressRefiner, "markov_head": MarkovHead}
_SAVE_OPTIONS = ("max_shard_size", "variant", "safe_serialization")  # passed to each part's save_pretrained
# the files a part's save_pretrained writes (weights in shards or not, of a variant or not): removed when a speculator
# saved over another has no such part any more
_PART_FILES = ("config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index*.json")


# what to do when a speculator's parts disagree on a shape their configs give
_PARTS_REMEDY = (": a speculator's parts are trained together, for one drafter. Build it from the parts of one "
                 "training run (or train the add-on for this drafter), and check that no config.json (the drafter's, "
                 "refiner/, markov_head/) was edited or copied from another speculator.")


class Speculator(nn.Module):
    """Drafter + optional refiner + optional Markov head + optional draft vocabulary (token ids the drafts are read
    out over, `draft_vocab.py`; `speculator.draft_vocab = None` drafts over the whole vocabulary again). Pass it as
    `assistant_model` to an enabled target."""

    def __init__(self, drafter: DFlashDraftModel, refiner: XPressRefiner | None = None,
                 markov_head: MarkovHead | None = None, draft_vocab: torch.LongTensor | None = None):
        super().__init__()
        if not isinstance(drafter, DFlashDraftModel):
            raise TypeError(f"`drafter` must be a DFlashDraftModel, got {type(drafter).__name__}.")
        block, vocab, hidden = drafter.config.block_size, drafter.config.vocab_size, drafter.config.hidden_size
        for name, part in (("refiner", refiner), ("markov_head", markov_head)):
            if part is None:
                continue
            if part.config.block_size != block:
                raise ValueError(f"The {name} was built for block size {part.config.block_size}, "
                                 f"the drafter uses {block}{_PARTS_REMEDY}")
            if part.config.vocab_size != vocab:
                raise ValueError(f"The {name} has vocabulary {part.config.vocab_size}, the drafter {vocab}"
                                 f"{_PARTS_REMEDY}")
        if refiner is not None and refiner.config.hidden_size != hidden:
            raise ValueError(f"The refiner reads hidden size {refiner.config.hidden_size}, the drafter has {hidden}"
                             f"{_PARTS_REMEDY}")
        if draft_vocab is not None:
            check_draft_vocab(draft_vocab, vocab)
        self.drafter = drafter
        self.refiner = refiner
        self.markov_head = markov_head
        self.register_buffer("draft_vocab", draft_vocab, persistent=False)  # moves with .to(device); saved apart

    @property
    def config(self):
        # transformers' assisted decoding reads `assistant_model.config`; getting here means the target was not
        # enabled, so say how to use a speculator instead of failing somewhere inside transformers.
        raise TypeError(
            "A Speculator is used through hf_specdiff: call hf_specdiff.enable(model) once, then "
            "model.generate(..., assistant_model=speculator, speculation='xpress' | 'dflash' | 'markov'). With a "
            "pipeline, enable its model and pass both to the call, pipe(..., assistant_model=speculator, "
            "speculation=...), not to pipeline(): transformers' pipeline expects an assistant language model there "
            "(an image-text-to-text pipeline hands its call's keywords to the processor: pass "
            "generate_kwargs=dict(assistant_model=speculator, speculation=...)). "
            "transformers' native dFlash path (speculation_type='dflash') takes speculator.drafter on a model not "
            "enabled."
        )

    @property
    def device(self) -> torch.device:
        return self.drafter.device

    @property
    def dtype(self) -> torch.dtype:
        return self.drafter.dtype

    @property
    def block_size(self) -> int:
        return self.drafter.config.block_size

    def check_compatible(self, target, method: str | None = None, placement: bool = True) -> None:
        """Raise a ValueError naming both values if this speculator cannot draft for `target` (with `method`);
        `placement` also requires the same device and dtype as the target's lm_head."""
        text_config = target.config.get_text_config()
        drafter = self.drafter.config
        check_target_weights(target)
        check_embedding_width(target)
        if placement and self.device.type == "meta":
            where = str(target.get_output_embeddings().weight.device)
            raise ValueError("The speculator has no weights (it is on the meta device, e.g. loaded with "
                             f"device='meta'): load it with AutoSpeculator.from_pretrained(path, device={where!r}).")
        quantized = _quantized_module(self) if placement else None
        if quantized is not None:
            raise ValueError(f"The speculator's {quantized} is a torch.ao quantized module, which hf_specdiff cannot "
                             "run: speculate with the speculator as loaded (bf16 or float32).")
        checks = [
            ("hidden size", drafter.hidden_size, text_config.hidden_size),
            ("vocabulary size", drafter.vocab_size, target.get_output_embeddings().weight.shape[0]),
        ]
        if drafter.num_target_layers is not None:
            checks.append(("number of target layers", drafter.num_target_layers, text_config.num_hidden_layers))
        for what, ours, theirs in checks:
            if ours != theirs:
                raise ValueError(
                    f"Speculator/target mismatch: the drafter was built for {what} {ours}, the target has {theirs}. "
                    "Use a speculator trained for this target, or build one with AutoSpeculator.from_target(target)."
                )
        bad_layers = [i for i in drafter.layer_ids if not 0 <= i < text_config.num_hidden_layers]
        if bad_layers:
            raise ValueError(
                f"The drafter reads target layers {bad_layers}, but the target has layers "
                f"0..{text_config.num_hidden_layers - 1}."
            )
        if self.draft_vocab is not None:  # perhaps set after loading
            where = target.get_output_embeddings().weight.device
            if placement and self.draft_vocab.device != where:
                raise ValueError(f"The speculator's draft vocabulary is on {self.draft_vocab.device} and the target on "
                                 f"{where}: move the speculator with speculator.to({str(where)!r}).")
            check_draft_vocab(self.draft_vocab, drafter.vocab_size, "The speculator's draft vocabulary")
        if not 0 <= drafter.mask_token_id < target.get_input_embeddings().weight.shape[0]:
            raise ValueError(
                f"The drafter's mask token id {drafter.mask_token_id} is outside the target's embedding table "
                f"({target.get_input_embeddings().weight.shape[0]} rows)."
            )
        if drafter.target_embedding_sample is not None:
            trained_for, this_target = (torch.tensor(drafter.target_embedding_sample),
                                        torch.tensor(embedding_sample(target)))
            # loose enough for another precision or quantisation of the same weights, not for another model
            if trained_for.shape != this_target.shape or bool(
                (trained_for - this_target).abs().max() > 0.1 * trained_for.abs().mean()
            ):
                warn_at_caller(
                    "This speculator was trained for a target with other embeddings (its recorded sample of the "
                    "embedding table differs from this target's): its drafts will rarely be accepted, so speculation "
                    "will be slow. The output is unchanged (speculation is lossless). Use a speculator trained for "
                    "this target (`hf-specdiff train`)."
                )
        target_param = target.get_output_embeddings().weight
        placements = {(p.device, p.dtype) for p in self.parameters()}
        if placement and len(placements) > 1:  # e.g. a refiner loaded apart and not moved with the drafter
            raise ValueError(
                f"The speculator's parts are on different devices or dtypes {sorted(map(str, placements))}: move them "
                f"together with speculator.to({str(target_param.device)!r}, {target_param.dtype})."
            )
        if placement and self.device != target_param.device:
            raise ValueError(
                f"The speculator is on {self.device} and the target on {target_param.device}: move it with "
                f"speculator.to({str(target_param.device)!r})."
            )
        if placement and self.dtype != target_param.dtype:
            raise ValueError(
                f"The speculator is in {self.dtype} and the target in {target_param.dtype}: cast it with "
                f"speculator.to({target_param.dtype})."
            )
        if method == "xpress" and self.refiner is None:
            raise ValueError(
                "speculation='xpress' needs an xPress refiner, and this speculator has none. Train one "
                "(hf-specdiff train) or use speculation='dflash'."
            )
        if method == "markov" and self.markov_head is None:
            raise ValueError(
                "speculation='markov' needs a Markov head, and this speculator has none. Train one "
                "(hf-specdiff train) or use speculation='dflash'."
            )

    # ------------------------------------------------------------------------------------------------------------
    # Saving and loading
    # ------------------------------------------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **kwargs) -> None:
        """Write the drafter at the top level (z-lab layout) and each add-on in its own subfolder, removing the add-ons
        and draft vocabulary a speculator saved there before had and this one has not. `push_to_hub=True` then uploads
        the folder as one commit (`repo_id`, default: the folder's name, and the commit options of transformers'
        `push_to_hub`: `commit_message`, `commit_description`, `private`, `token`, `revision`, `create_pr`);
        `max_shard_size` and `variant` go to each part's `save_pretrained` (a speculator saved with a `variant` loads
        with `from_pretrained(..., variant=...)`). The weights are always safetensors: `safe_serialization=False` is
        refused. A README.md already in the folder is kept (with a warning if the parts changed)."""
        hub = {name: kwargs.pop(name) for name in ("repo_id", *UPLOAD_OPTIONS) if name in kwargs}
        if hub and not push_to_hub:
            raise TypeError(f"{sorted(hub)} only apply with push_to_hub=True.")
        if unknown := sorted(set(kwargs) - set(_SAVE_OPTIONS)):
            raise TypeError(f"save_pretrained of a speculator got unsupported arguments {unknown}; it takes "
                            f"push_to_hub, repo_id, {', '.join(UPLOAD_OPTIONS)}, {', '.join(_SAVE_OPTIONS)}.")
        if not kwargs.pop("safe_serialization", True):  # transformers 5 writes safetensors whatever it is told
            raise ValueError("safe_serialization=False: speculators are saved as safetensors only (transformers 5 "
                             "writes no other format, and would ignore the option). Drop the option.")
        save_directory = Path(save_directory)
        if push_to_hub:  # checked before anything is written
            what = "repo_id" if "repo_id" in hub else "repo_id (default: the folder's name)"
            hub.setdefault("repo_id", save_directory.name)
            check_repo_id(hub["repo_id"], what)
        parts_before = _saved_parts(save_directory)
        folders = [save_directory, *(save_directory / name for name in _COMPONENTS)]
        with usual_modes(folders):
            self.drafter.save_pretrained(save_directory, **kwargs)
            components = []
            for name in _COMPONENTS:
                part = getattr(self, name)
                if part is not None:
                    part.save_pretrained(save_directory / name, **kwargs)
                    components.append(name)
        from . import __version__

        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "hf_specdiff_version": __version__,
                    "components": components}
        (save_directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if self.draft_vocab is not None:
            write_draft_vocab(save_directory, self.draft_vocab)
        _remove_stale_parts(save_directory, components, self.draft_vocab is not None)
        parts = _saved_parts(save_directory)
        card = save_directory / "README.md"
        if card.is_file() and parts_before is not None and parts_before != parts:
            warn_at_caller(
                f"{card} was kept, but the speculator saved there before had other parts ({_describe(parts_before)}; "
                f"now {_describe(parts)}): the model card may no longer describe the weights. Rewrite it "
                f"(`hf-specdiff export --run RUN --output {save_directory}` writes the card of a training run's "
                "speculator), edit it, or delete it."
            )
        if push_to_hub:
            hub.setdefault("commit_message", "Upload speculator")
            upload_folder(save_directory, hub.pop("repo_id"), **hub, delete_patterns=self._absent_parts())

    def push_to_hub(self, repo_id: str, commit_message: str = "Upload speculator", **kwargs):
        """Save to a temporary folder and upload it as one commit (the options of `save_pretrained`'s
        `push_to_hub=True`). Returns the commit info. The model card is not generated by pushing: this uploads no
        README.md (a speculator loaded and pushed as is arrives without its card; a card already in the repo stays as
        it is), and `save_pretrained(folder, push_to_hub=True)` uploads only one the folder holds. `hf-specdiff export`
        writes the card (of a training run's speculator); push the folder it writes."""
        check_repo_id(repo_id)  # before the speculator is saved
        upload, save = split_push_options(kwargs, _SAVE_OPTIONS, "speculator")
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, **save)
            return upload_folder(Path(folder), repo_id, commit_message, **upload,
                                 delete_patterns=self._absent_parts())

    def _absent_parts(self) -> list[str]:
        """The files of the parts this speculator has not, as patterns: a push removes them from the repo, where an
        earlier push of a speculator that had them would leave them beside weights that loading no longer reads."""
        return [*(f"{name}/*" for name in _COMPONENTS if getattr(self, name) is None),
                *([DRAFT_VOCAB_FILE] if self.draft_vocab is None else [])]

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike, dtype=None, device=None, variant: str | None = None,
                        **hub_kwargs) -> "Speculator":
        """Load from a local folder or a Hub repo id (offline, a repo id must already be in the local cache). `variant`:
        the one the speculator was saved with (`save_pretrained(..., variant="fp16")` writes model.fp16.safetensors),
        read by each part's loading as transformers does."""
        from transformers.utils import cached_file

        path_or_repo_id = str(path_or_repo_id)
        dtype = take_dtype(dtype, hub_kwargs, "speculator", also="dtype, device, variant and ")
        check_folder_or_repo_id(path_or_repo_id, "speculator")
        subfolder = hub_kwargs.get("subfolder") or ""  # the add-ons' subfolders extend it
        folder = Path(path_or_repo_id, subfolder)
        if not (folder / "config.json").is_file() and (folder / "speculator" / "config.json").is_file():
            raise OSError(f"{folder} is a training run's folder (`hf-specdiff train --output-dir`): load the "
                          f"speculator it wrote, {folder / 'speculator'}, or the folder `hf-specdiff export --run "
                          f"{folder}` writes.")
        config = _read_json_object(find_file(path_or_repo_id, "config.json", "speculator", SAVED_FOLDER, **hub_kwargs))
        if "DFlashDraftModel" not in (config.get("architectures") or []) or "dflash_config" not in config:
            raise ValueError(
                f"{path_or_repo_id} is not a dFlash drafter checkpoint: its config.json needs architectures "
                f"['DFlashDraftModel'] and a `dflash_config` (found architectures={config.get('architectures')})."
            )
        manifest = None
        manifest_file = cached_file(
            path_or_repo_id, MANIFEST, _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False, **hub_kwargs,
        )
        # A z-lab drafter has none. hf_specdiff writes one beside every drafter it saves (their configs carry
        # target_embedding_sample): missing there, it could not be fetched (offline and not in the local Hub cache, a
        # connection error) or was left out of a copy, and the refiner and Markov head it lists would be dropped.
        if manifest_file is None and config.get("target_embedding_sample") is not None:
            raise OSError(
                f"{path_or_repo_id} holds a drafter saved by hf_specdiff but no readable {MANIFEST} (offline and not "
                "in the local Hub cache, the Hub unreachable, or the file left out of a copy). It lists the "
                "speculator's refiner and Markov head, which loading without it would drop: copy the whole folder, or "
                f"download the whole repo (`hf download {path_or_repo_id}`)."
            )
        if manifest_file is not None:
            manifest = _read_manifest(manifest_file)
        try:
            drafter = _load_strict(DFlashDraftModel, path_or_repo_id, dtype, variant=variant, **hub_kwargs)
        except OSError as error:
            folder = Path(path_or_repo_id, subfolder)
            saved_variants = _weight_variants(folder) if variant is None else []
            if saved_variants and not any((folder / name).is_file() for name in ("model.safetensors",
                                                                                   "model.safetensors.index.json")):
                raise OSError(
                    f"{folder} holds the weights of variant "
                    f"{' and '.join(map(repr, saved_variants))} only (saved with save_pretrained(..., variant=...)): "
                    f"load them with AutoSpeculator.from_pretrained(..., variant={saved_variants[0]!r})."
                ) from error
            raise
        parts = {}
        for name in (manifest or {}).get("components", []):
            where = {**hub_kwargs, "subfolder": f"{subfolder}/{name}".lstrip("/")}
            parts[name] = _load_strict(_COMPONENTS[name], path_or_repo_id, dtype, component=name, variant=variant,
                                       **where)
        draft_vocab = None
        if (manifest or {}).get("draft_vocab"):
            draft_vocab = _load_draft_vocab(path_or_repo_id, manifest["draft_vocab"], drafter.config.vocab_size,
                                            **hub_kwargs)
        speculator = cls(drafter, **parts, draft_vocab=draft_vocab)
        return speculator.to(device) if device is not None else speculator


def _mlp_width(text_config) -> int:
    """The drafter's MLP width: the target's (Gemma 3n lists one per layer: the widest), under the names configs give
    it (GPT-2, GPT-J and GPTBigCode call it n_inner, OPT ffn_dim, Falcon ffn_hidden_size); where a config leaves it
    implied (GPT-2's n_inner None, BLOOM), the 4 x hidden size such models use."""
    for name in ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"):
        if (width := getattr(text_config, name, None)) is not None:
            return max(width) if isinstance(width, (list, tuple)) else width
    return 4 * text_config.hidden_size


def target_decoder_layers(target) -> nn.ModuleList | None:
    """The target's decoder layers (GPT-2's family keeps them in `h`), or None where they are not a list by either
    name."""
    decoder = target.get_decoder()
    return getattr(decoder, "layers", None) or getattr(decoder, "h", None)


def _layer_biases(target) -> dict[str, bool]:
    """The drafter's bias settings that give its layers the biases the target's have (read from the target's first
    layer, named as Llama's): `qkv_bias` for biases on q/k/v (Qwen2, fused or not), `attention_bias` for biases on
    all four projections (Llama with `attention_bias`), `mlp_bias` for biases on the MLP's (Llama with `mlp_bias`)."""
    layers = target_decoder_layers(target)
    names = set(layers[0].state_dict()) if layers else set()
    qkv = any(name in names for name in ("self_attn.q_proj.bias", "self_attn.qkv_proj.bias"))
    mlp = any(name in names for name in ("mlp.gate_proj.bias", "mlp.gate_up_proj.bias", "mlp.down_proj.bias"))
    return {"qkv_bias": qkv, "attention_bias": qkv and "self_attn.o_proj.bias" in names, "mlp_bias": mlp}


def _quantized_module(model) -> str | None:
    """The name of the first torch.ao quantized module in `model` (e.g. from `torch.ao.quantization.quantize_dynamic`),
    or None."""
    return next((name or type(model).__name__ for name, module in model.named_modules()
                 if type(module).__module__.startswith("torch.ao.nn.quantized")), None)


def check_target_weights(target) -> None:
    """Refuse a target whose token embeddings or lm_head are not in memory (accelerate's offload keeps them on the
    meta device and loads them inside the module's forward; the drafter reads the weights themselves), or that holds
    torch.ao quantized layers (dynamic quantisation scales a forward's activations over all its tokens, so the
    target's verify forward over a block would not compute what one-token decoding computes: speculation would not
    be lossless)."""
    parts = (("token embeddings", target.get_input_embeddings()), ("lm_head", target.get_output_embeddings()))
    for what, module in parts:
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.device.type == "meta":
            raise ValueError(
                f"The target's {what} are not in memory (on the meta device: offloaded by accelerate, or loaded "
                "without weights). The drafter reads the token embeddings and lm_head weights directly: keep them on "
                "the execution device (offload other layers only, e.g. a device_map that puts "
                "`model.embed_tokens` and `lm_head` on the GPU), or generate without speculation.")
    quantized = _quantized_module(target)
    if quantized is not None:
        raise ValueError(
            f"The target's {quantized} is a torch.ao quantized module: dynamic quantisation scales activations over "
            "all the tokens of a forward, so verifying a block would not compute what one-token decoding computes, "
            "and the output would differ from plain generate. Generate without speculation, or quantise with a "
            "method whose per-token result does not depend on the other tokens (e.g. weight-only quantisation).")


def check_embedding_width(target) -> None:
    """The drafter embeds its block with the target's token table and reads the target's hidden states: both must be
    as wide. A factorised embedding (ELECTRA, RemBERT) is narrower."""
    width, hidden = target.get_input_embeddings().weight.shape[1], target.config.get_text_config().hidden_size
    if width != hidden:
        raise ValueError(
            f"{type(target).__name__}'s token embeddings are {width} wide and its hidden states {hidden} (a factorised "
            "embedding, as in ELECTRA or RemBERT): a drafter needs both the same width. Generate without speculation."
        )


def saved_vocab_size(folder: str | os.PathLike) -> int:
    """The vocabulary size of the speculator (or bare z-lab drafter) saved in `folder`."""
    config_path = Path(folder) / "config.json"
    config = _read_json_object(str(config_path)) if config_path.is_file() else {}
    if "dflash_config" not in config or "vocab_size" not in config:
        raise ValueError(f"{folder} holds no saved speculator (no config.json with a dflash_config and a vocab_size): "
                         "save one there first.")
    return config["vocab_size"]


def write_draft_vocab(folder: str | os.PathLike, token_ids: torch.LongTensor) -> None:
    """Give the speculator (or bare z-lab drafter) saved in `folder` a draft vocabulary, or replace its own: writes
    draft_vocab.safetensors and names it in speculator.json (written for a bare drafter), touching no weights."""
    folder = Path(folder)
    check_draft_vocab(token_ids, saved_vocab_size(folder))
    manifest_path = folder / MANIFEST
    manifest = _read_manifest(str(manifest_path)) if manifest_path.is_file() else {
        "format": FORMAT, "format_version": FORMAT_VERSION, "components": []}
    with usual_modes([folder]):
        save_file({"token_ids": token_ids.detach().cpu().long().contiguous()}, folder / DRAFT_VOCAB_FILE)
    manifest_path.write_text(json.dumps({**manifest, "draft_vocab": DRAFT_VOCAB_FILE}, indent=2) + "\n")


def _weight_variants(folder: Path) -> list[str]:
    """The variants whose weights a local `folder` holds (model.fp16.safetensors, model.fp16-00001-of-00002.safetensors,
    model.safetensors.index.fp16.json: transformers' names); none for a Hub repo id."""
    pattern = re.compile(r"model\.(.+?)(?:-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.(.+)\.json")
    found = (pattern.fullmatch(path.name) for path in folder.glob("model*")) if folder.is_dir() else ()
    return sorted({match[1] or match[2] for match in found if match})


def _saved_parts(folder: Path) -> set[str] | None:
    """The add-ons and draft vocabulary of the speculator saved in `folder`, as on disk; None if no drafter is there."""
    if not (folder / "config.json").is_file():
        return None
    parts = {name for name in _COMPONENTS if (folder / name / "config.json").is_file()}
    return parts | {"draft_vocab"} if (folder / DRAFT_VOCAB_FILE).is_file() else parts


def _describe(parts: set[str]) -> str:
    return ", ".join(["drafter", *sorted(parts)])


def _remove_stale_parts(folder: Path, components: list[str], has_draft_vocab: bool) -> None:
    """Remove what a speculator saved in `folder` before left there and the one just saved has not: the files of an
    add-on it does not have (their folder too, unless someone's other files are in it) and the draft vocabulary.
    Loading would ignore them (speculator.json no longer lists them), but they would be copied and pushed with the
    folder, as transformers avoids for stale weight shards."""
    for name in set(_COMPONENTS) - set(components):
        part_folder = folder / name
        if not part_folder.is_dir():
            continue
        for pattern in _PART_FILES:
            for path in part_folder.glob(pattern):
                path.unlink()
        if not any(part_folder.iterdir()):
            part_folder.rmdir()
    if not has_draft_vocab:
        (folder / DRAFT_VOCAB_FILE).unlink(missing_ok=True)


def _load_draft_vocab(path_or_repo_id: str, filename: str, vocab_size: int, **hub_kwargs) -> torch.LongTensor:
    from safetensors import SafetensorError
    from transformers.utils import cached_file

    where = f"{path_or_repo_id}/{filename}"
    path = cached_file(path_or_repo_id, filename, _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False, **hub_kwargs)
    if path is None:
        raise OSError(f"speculator.json in {path_or_repo_id} lists a draft vocabulary, but {filename} is missing. "
                      "Download or save the speculator again.")
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as error:
        raise ValueError(f"Could not read the draft vocabulary {where} ({error}): the file is corrupt; download or "
                         "save the speculator again.") from error
    if "token_ids" not in tensors:
        raise ValueError(f"{where} has no `token_ids` tensor (found {sorted(tensors)}): the file is corrupt; download "
                         "or save the speculator again.")
    check_draft_vocab(tensors["token_ids"], vocab_size, f"The draft vocabulary in {where}")
    return tensors["token_ids"].long()


def _read_json_object(path: str) -> dict:
    try:
        value = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}): the speculator folder is corrupt; download or save it "
                         "again.") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a {type(value).__name__}, not a JSON object: the speculator folder is corrupt; "
                         "download or save it again.")
    return value


def _read_manifest(path: str) -> dict:
    manifest = _read_json_object(path)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not an hf_specdiff speculator manifest (format={manifest.get('format')!r}).")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION
        raise ValueError(
            f"{path} has speculator format version {version!r}; this hf_specdiff reads version {FORMAT_VERSION}. "
            + ("Upgrade hf_specdiff." if newer else "No hf_specdiff wrote that: the file is corrupt; download or save "
               "the speculator again.")
        )
    if not isinstance(manifest.get("draft_vocab", ""), str):
        raise ValueError(f"{path} names its draft vocabulary file with {manifest['draft_vocab']!r}, not a file name: "
                         "the speculator folder is corrupt; download or save it again.")
    components = manifest.get("components", [])
    if not isinstance(components, list) or not all(isinstance(c, str) for c in components):
        raise ValueError(f"{path} lists its components as {components!r}, not a list of names: the speculator folder "
                         "is corrupt; download or save it again.")
    unknown = [c for c in components if c not in _COMPONENTS]
    if unknown:
        raise ValueError(f"{path} lists unknown components {unknown}; known: {sorted(_COMPONENTS)}.")
    return manifest


def _load_strict(model_class, path_or_repo_id: str, dtype, component: str | None = None, variant: str | None = None,
                 **kwargs):
    """`from_pretrained` that refuses missing or unexpected weights instead of initialising them randomly.
    `component`: the add-on speculator.json lists, whose folder must then be complete; `variant`: of the weights
    files (`cached_file`, which finds the config, takes none)."""
    from transformers.utils import cached_file

    if component is not None and cached_file(path_or_repo_id, "config.json",
                                             _raise_exceptions_for_missing_entries=False, **kwargs) is None:
        raise OSError(f"speculator.json in {path_or_repo_id} lists `{component}`, but "
                      f"{kwargs['subfolder']}/config.json is missing. Download or save the speculator again.")
    try:
        model, info = model_class.from_pretrained(path_or_repo_id, dtype=dtype, output_loading_info=True,
                                                  variant=variant, **kwargs)
    except OSError as error:
        if component is None:
            raise
        raise OSError(f"speculator.json in {path_or_repo_id} lists `{component}`, but {kwargs['subfolder']}/ is "
                      f"missing or incomplete ({error}). Download or save the speculator again.") from error
    except Exception as error:  # a truncated or malformed safetensors file surfaces as various errors
        where = f"{path_or_repo_id}/{kwargs.get('subfolder', '')}".rstrip("/")
        reason = str(error)
        if "ignore_mismatched_sizes" in reason:  # transformers' words for weights of other shapes than the config's
            reason = ("the weights' shapes differ from its config.json's; "
                      "the artifact is corrupt or its config was edited")
        raise ValueError(f"Could not load the {model_class.__name__} weights from {where}: {reason}") from error
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise ValueError(
            f"The {model_class.__name__} checkpoint at {path_or_repo_id} does not match its config: {problems}. "
            "The artifact is corrupt or was written for another configuration."
        )
    return model.eval()


class AutoSpeculator:
    """Entry points: `from_pretrained` (a saved speculator or a bare z-lab drafter) and `from_target` (untrained,
    sized for a target: the start of training)."""

    def __init__(self):
        raise TypeError("Use AutoSpeculator.from_pretrained(...) or AutoSpeculator.from_target(...).")

    from_pretrained = staticmethod(Speculator.from_pretrained)

    @staticmethod
    def from_target(
        target,
        block_size: int = 16,
        num_draft_layers: int = 1,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
        refiner_rank: int = 256,
        with_refiner: bool = True,
        with_markov_head: bool = True,
        seed: int | None = None,
    ) -> Speculator:
        """A randomly initialised speculator whose shapes fit `target`, a decoder-only causal LM whose config names
        its width, heads and depth as transformers' configs do (Llama, Mistral, Qwen, Phi-3, Gemma, OLMo, GPT-NeoX,
        GPT-2, GPT-J, OPT, Falcon, BLOOM, ...).

        The drafter copies the target's attention geometry and RoPE; `target_layer_ids` default to
        `num_draft_layers` layers spread over the target's depth, as in the published drafters. `mask_token_id`
        defaults to the last row of the target's embedding table.
        """
        check_target_weights(target)
        check_embedding_width(target)
        text = target.config.get_text_config()
        if getattr(text, "is_heterogeneous", False) and "full_attention" in (getattr(text, "layer_types", None) or ()):
            # Gemma 4 sets head_dim and K/V heads per layer (and refuses to read one for all): the drafter, whose
            # attention is full, takes its full-attention layers' geometry
            text = text.per_layer_config["full_attention"]
        for field in ("hidden_size", "num_attention_heads", "num_hidden_layers"):
            if getattr(text, field, None) is None:
                raise ValueError(
                    f"{type(target).__name__} has no `{field}` in its config: hf_specdiff drafts for decoder-only "
                    "models whose config names their width, heads and depth as transformers' configs do (Llama, "
                    "Qwen, Gemma, GPT-2, OPT, ...)."
                )
        # the drafts are read out through the target's lm_head; the mask token need only be embeddable (Mllama's
        # embedding table has 8 rows past its lm_head's)
        vocab_size = target.get_output_embeddings().weight.shape[0]
        if target_layer_ids is None:
            target_layer_ids = spread_layer_ids(text.num_hidden_layers, num_draft_layers)
        if mask_token_id is None:
            mask_token_id = target.get_input_embeddings().weight.shape[0] - 1
        if seed is not None:
            torch.manual_seed(seed)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        intermediate_size = _mlp_width(text)
        drafter_config = DFlashConfig(
            hidden_size=text.hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_draft_layers,
            num_attention_heads=text.num_attention_heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            head_dim=head_dim,
            # the target's activation, without which a warm start's copy of its MLP computes another function
            # (Gemma's configs name it hidden_activation; some configs hold None: the default)
            hidden_act=getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None) or "silu",
            rms_norm_eps=getattr(text, "rms_norm_eps", None) or 1e-6,
            rope_parameters=full_attention_rope_parameters(text),
            max_position_embeddings=getattr(text, "max_position_embeddings", 32768),
            vocab_size=vocab_size,
            block_size=block_size,
            num_target_layers=text.num_hidden_layers,
            dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
            target_embedding_sample=embedding_sample(target),
            **_layer_biases(target),  # (for a warm start that copies them; zero, as a random start has them)
            architectures=["DFlashDraftModel"],
            use_cache=False,
        )
        parameter = target.get_output_embeddings().weight
        drafter = DFlashDraftModel(drafter_config)
        refiner = markov_head = None
        if with_refiner:
            refiner = XPressRefiner(XPressConfig(hidden_size=text.hidden_size, vocab_size=vocab_size,
                                                 rank=refiner_rank, block_size=block_size))
        if with_markov_head:
            markov_head = MarkovHead(MarkovConfig(vocab_size=vocab_size, rank=refiner_rank, block_size=block_size))
        return Speculator(drafter, refiner, markov_head).to(device=parameter.device, dtype=parameter.dtype).eval()
