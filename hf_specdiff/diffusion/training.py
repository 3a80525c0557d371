"""Turning a causal LM (SmolLM2-135M-Instruct by default) into a masked diffusion LM by supervised fine-tuning.

Model: `DiffusionLM.from_causal_lm(base, shift_logits=True, block_causal=False)`: Dream-style AR adaptation (Ye et al.
2025, "Dream 7B"): attention becomes fully bidirectional and the prediction for position i is read from output i-1,
where the causal LM already predicts token i, so its next-token skill carries over from the first step.

Objective: LLaDA's SFT loss (Nie et al. 2025, "Large Language Diffusion Models", arXiv 2502.09992, eq. 5 and the
reference `forward_process`). Per sequence, a masking ratio t ~ U(eps, 1]; each answer token is replaced by [MASK]
with probability t (prompt tokens never are); the model predicts every masked token at once, and

    loss = 1/b * sum_rows  1/L_row * sum_{masked i in row}  CE(x_i | noisy row) / t_row

with L_row the row's number of answer tokens (EOS padding included, as LLaDA): 1/t makes the sum an unbiased
estimate of the masked diffusion bound, and dividing by L_row gives every sequence the same weight and a loss per
token that is comparable across lengths. The [MASK] token's own logit is excluded from the softmax, as the decoder
excludes it (`decoding.without_mask_token`).

Block-structured masking (`block_masking_share` of the sequences): semi-autoregressive decoding (`diffusion_generate`)
always shows the model one pattern: the answer before the current block finished, the current block partly masked,
everything after it fully masked. Plain LLaDA masking almost never produces a clean prefix followed by a solid run of
masks, so a share of sequences is noised exactly like that: a random block k of `block_length` tokens from the answer
start, answer tokens before it clean, inside it masked with probability t, after it all masked; the loss counts the
block's tokens only (L_row = the block's answer tokens), since decoding reads the model's output there only.

Trained parameters: LoRA (peft) on the attention and MLP projections, or every layer (`finetune="full"`); the
embeddings and lm_head stay frozen. The [MASK] embedding row is trained too (`train_mask_embedding`): [MASK] is the
most frequent input in training, and the base model's row for the reserved token it stands on means something else;
LoRA can only change what the layers do with that row, a free row lets the input itself move (one vector of
`hidden_size` numbers). During training it lives apart from the frozen, tied embedding matrix (a forward hook on
our own copy's `embed_tokens` substitutes it at [MASK] positions), so the optimizer holds `hidden_size` numbers,
not the whole matrix; at the end it is written into the matrix, which (tied embeddings) also changes lm_head's [MASK]
row: the [MASK] logit only, which neither the loss nor the decoder reads. The artifact holds only the LoRA factors,
that row and the base's name (`adapter_weights`).

Built on `accelerate` (mixed precision, gradient accumulation, several GPUs); checkpoints hold the trained
parameters and optimizer state only, and a rerun resumes from the latest one. `init_adapter` continues a finished
run's adapter in a new run (a new schedule, e.g. after a time budget cut the first one short).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..training import (
    MIXED_PRECISIONS,
    _latest_checkpoint,
    check_options,
    check_resumable,
    check_vocabulary,
    collate,
    fingerprint,
    prepare,
    read_sequences,
    start_run,
    write_run_config,
)
from .adapter_weights import EMBEDDED_BASE, MASK_EMBEDDING, base_facts, load_base, save_adapter
from .decoding import DEFAULT_BLOCK_LENGTH
from .modeling import DiffusionLM

SMOLLM2_MASK_TOKEN_ID = 16  # <empty_output>: a reserved special token that never occurs in SmolLM2's chat text
FINETUNE_MODES = ("lora", "full")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# fields that shape the trained parameters: a checkpoint only resumes under the same values
_SHAPING_FIELDS = ("base", "finetune", "lora_rank", "lora_alpha", "lora_target_modules", "train_mask_embedding",
                   "mask_token_id", "shift_logits", "init_adapter")


@dataclass
class DiffusionTrainConfig:
    """Every option of `train_diffusion`, with its default for a real GPU run: `hf-specdiff train-diffusion` mirrors
    these fields, and each field's `metadata["help"]` is its `--help` text."""

    data: list[str] = field(default_factory=list, metadata={"help": (
        "JSONL files with prompt_ids and response_ids per line (`hf-specdiff distill`'s output)")})
    output_dir: str = field(default="runs/diffusion", metadata={"help": (
        "where the run writes checkpoints/ (resumed from when present), log.jsonl, train_config.json and the "
        "artifact diffusion_lm/")})
    base: str | None = field(default=None, metadata={"help": (
        "causal LM to adapt: local folder or Hub id; None: the embedded SmolLM2-135M-Instruct")})
    init_adapter: str | None = field(default=None, metadata={"help": (
        "continue from a saved adapter of the same base and shape (its LoRA factors / weights and [MASK] row) instead "
        "of fresh ones; the optimizer and the learning-rate schedule start afresh")})
    mask_token_id: int | None = field(default=None, metadata={"help": (
        "the [MASK] token id; None: 16 (<empty_output>) for the embedded SmolLM2, else the tokenizer's mask token")})
    shift_logits: bool = field(default=True, metadata={"help": (
        "Dream-style: position i is predicted from output i-1 (--no-shift-logits: LLaDA-style, no shift)")})
    finetune: str = field(default="lora", metadata={"help": (
        "lora (an adapter of a few tens of MB) or full (every layer; embeddings stay frozen)"),
        "choices": FINETUNE_MODES})
    lora_rank: int = field(default=16, metadata={"help": (
        "LoRA rank r; SmolLM2-135M: about 1.2 MB of float32 factors per unit of rank with all 7 target modules")})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA scale alpha / r"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA input"})
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS), metadata={"help": (
        "names of the Linear layers given LoRA")})
    train_mask_embedding: bool = field(default=True, metadata={"help": (
        "train the [MASK] input embedding row (stored as `mask_embedding`)")})
    max_seq_len: int = field(default=512, metadata={"help": (
        "prompt + answer cut to this many tokens (rows without 2 answer tokens are dropped)")})
    eos_token_id: int | None = field(default=None, metadata={"help": (
        "answers ending with it are padded with it (trained as answer); None: the base's")})
    mask_eps: float = field(default=1e-3, metadata={"help": "the masking ratio t is drawn from U(mask_eps, 1]"})
    block_masking_share: float = field(default=0.5, metadata={"help": (
        "share of sequences noised block-wise, as semi-autoregressive decoding sees them")})
    block_length: int = field(default=DEFAULT_BLOCK_LENGTH, metadata={"help": (
        "block size of that block-wise masking: decoding's block_length")})
    batch_size: int = field(default=32, metadata={"help": "sequences per micro-batch (per process)"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    max_steps: int = field(default=3000, metadata={"help": "optimizer steps"})
    learning_rate: float = field(default=5e-4, metadata={"help": (
        "peak AdamW learning rate, after a linear warm-up; cosine decay to 10% of it")})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    warmup_steps: int = field(default=100, metadata={"help": "steps of linear learning-rate warm-up"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradients are clipped to this norm"})
    mixed_precision: str = field(default="bf16", metadata={"help": (
        "accelerate's mixed precision; weights and LoRA factors stay float32"), "choices": MIXED_PRECISIONS})
    eval_sequences: int = field(default=64, metadata={"help": (
        "sequences held out of training; masked-token accuracy on them every eval_every steps")})
    eval_every: int = field(default=100, metadata={"help": "evaluate on the held-out sequences every this many steps"})
    save_every: int = field(default=250, metadata={"help": (
        "checkpoint and save the artifact every this many steps (and at the end)")})
    time_budget_minutes: float | None = field(default=None, metadata={"help": (
        "wall-clock budget of this call: after timing the pace, the run ends (learning-rate schedule and all) where "
        "the budget reaches; None: no budget")})
    seed: int = field(default=0, metadata={"help": "seeds initialisation, batches and noise"})
    log_file: str | None = field(default=None, metadata={"help": (
        "JSONL of step, loss, accuracy and held-out metrics; None: <output_dir>/log.jsonl")})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------------------------
# Data and noise
# --------------------------------------------------------------------------------------------------------------


def collate_answers(rows: list[dict], pad_id: int, eos_id: int | None = None):
    """Rows of `read_sequences` as ids (b, T), valid (b, T) bool (False: padding, attended by nothing) and answer
    (b, T) bool (the positions that may be masked). A row whose answer ends with `eos_id` is padded with `eos_id`
    instead and the padding counts as answer (LLaDA SFT: the decoder fills a fixed-length canvas, so the model must
    learn to fill what follows an answer with EOS); other rows (answers cut off) are padded with `pad_id`."""
    ids, valid, starts = collate(rows, pad_id)
    valid = valid.bool()
    positions = torch.arange(ids.shape[1])
    if eos_id is not None:
        lengths = valid.sum(1)
        ends_with_eos = ids[torch.arange(len(rows)), lengths - 1] == eos_id
        fill = ends_with_eos[:, None] & (positions >= lengths[:, None])
        ids, valid = ids.masked_fill(fill, eos_id), valid | fill
    return ids, valid, valid & (positions >= starts[:, None])


def sample_noise(batch_size: int, mask_eps: float, block_share: float, generator: torch.Generator):
    """t (b,) ~ U(mask_eps, 1] and which rows are masked block-wise (b,) bool."""
    t = mask_eps + (1 - mask_eps) * (1 - torch.rand(batch_size, generator=generator, dtype=torch.float64))
    return t.float(), torch.rand(batch_size, generator=generator) < block_share


def diffusion_masks(answer: torch.Tensor, t: torch.Tensor, generator: torch.Generator,
                    block_rows: torch.Tensor | None = None, block_length: int = DEFAULT_BLOCK_LENGTH):
    """The forward (noising) process of one batch. answer (b, T) bool: maskable positions, contiguous per row; t (b,).

    Returns masked (b, T) bool, the positions replaced by [MASK], and scored (b, T) bool, those whose loss counts.
    Plain rows: each answer token masked with probability t, all scored. Block rows (block_rows (b,) True): a block
    k drawn uniformly among the answer's blocks of `block_length` (counted from the answer start, as decoding
    counts them); answer before it clean, inside it masked with probability t, after it all masked; the block scored.
    """
    b, T = answer.shape
    u = torch.rand(b, T, generator=generator)
    masked = answer & (u < t[:, None])
    scored = answer
    if block_rows is not None:
        positions = torch.arange(T)
        start, count = answer.int().argmax(dim=1), answer.sum(dim=1)
        k = (torch.rand(b, generator=generator) * torch.div(count + block_length - 1, block_length,
                                                           rounding_mode="floor")).long()
        low = (start + k * block_length)[:, None]
        inside = (positions >= low) & (positions < low + block_length)
        block_masked = answer & ((inside & (u < t[:, None])) | (positions >= low + block_length))
        masked = torch.where(block_rows[:, None], block_masked, masked)
        scored = torch.where(block_rows[:, None], answer & inside, answer)
    return masked, scored


def masked_diffusion_loss(logits, ids, masked, scored, t, mask_token_id: int, shift: int):
    """The loss of the module docstring. logits (b, T, V): row i is the model's output at position i, which
    predicts position i + shift. Returns (loss, number of predictions, number of correct argmax predictions)."""
    rows, positions = (masked & scored).nonzero(as_tuple=True)
    predicted = logits[rows, positions - shift].float()
    predicted = predicted.index_fill(1, torch.tensor([mask_token_id], device=predicted.device), -torch.inf)
    targets = ids[rows, positions]
    ce = F.cross_entropy(predicted, targets, reduction="none")
    per_row = scored.sum(dim=1).clamp(min=1)
    loss = (ce / (t[rows] * per_row[rows])).sum() / ids.shape[0]
    return loss, len(targets), int((predicted.detach().argmax(-1) == targets).sum())


def attention_mask(valid: torch.Tensor) -> torch.Tensor | None:
    """(b, 1, T, T) bool: every query sees the valid keys (a padding query sees itself); None without padding."""
    if bool(valid.all()):
        return None
    return (valid[:, None, :] | torch.eye(valid.shape[1], dtype=torch.bool, device=valid.device))[:, None]


# --------------------------------------------------------------------------------------------------------------
# What is trained
# --------------------------------------------------------------------------------------------------------------


class DiffusionTrainee(nn.Module):
    """The diffusion LM with LoRA (or all layers trainable) and, optionally, a trainable [MASK] embedding row.
    `forward(input_ids, attention_mask) -> logits`."""

    def __init__(self, model: DiffusionLM, config: DiffusionTrainConfig):
        super().__init__()
        self.mask_token_id, self.shift = model.mask_token_id, int(model.shift_logits)
        self.finetune = config.finetune
        model.requires_grad_(False)
        if config.finetune == "lora":
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                              target_modules=list(config.lora_target_modules))
            self.model = get_peft_model(model, lora)
        else:
            model.model.layers.requires_grad_(True)
            model.model.norm.requires_grad_(True)
            self.model = model
        self.register_parameter("mask_embedding", None)
        if config.train_mask_embedding:
            self.mask_embedding = nn.Parameter(model.model.embed_tokens.weight[self.mask_token_id].detach().clone())
            self._hook = model.model.embed_tokens.register_forward_hook(self._substitute_mask_row)

    def _substitute_mask_row(self, module, inputs, output):
        return torch.where((inputs[0] == self.mask_token_id)[..., None], self.mask_embedding.to(output.dtype), output)

    @property
    def diffusion_lm(self) -> DiffusionLM:
        return self.model.get_base_model() if self.finetune == "lora" else self.model

    def forward(self, input_ids, attention_mask=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    def added_tensors(self) -> dict[str, torch.Tensor]:
        """What the artifact stores: LoRA factors under the adapted Linear's DiffusionLM name (or the trained
        weights themselves), and the [MASK] row."""
        tensors = {}
        if self.finetune == "lora":
            from peft.tuners.lora import LoraLayer

            for name, module in self.model.named_modules():
                if isinstance(module, LoraLayer):
                    name = name.removeprefix("base_model.model.")
                    tensors[f"{name}.lora_A.weight"] = module.lora_A["default"].weight
                    tensors[f"{name}.lora_B.weight"] = module.lora_B["default"].weight
        else:
            tensors = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
        if self.mask_embedding is not None:
            tensors[MASK_EMBEDDING] = self.mask_embedding
        return {name: t.detach() for name, t in tensors.items()}

    @torch.no_grad()
    def load_adapter(self, folder: str, base_name: str | None, base_config: dict, holdout_fingerprint: str) -> int:
        """Start from a saved adapter (`init_adapter`): its tensors replace the fresh ones, after checking that it was
        trained on this base with this shape. Returns the steps it was trained for. A run whose held-out rows differ
        from the earlier run's (other data, seed, eval_sequences or max_seq_len) is warned: rows the adapter was
        trained on may now be held out, and its held-out figures read too high."""
        from safetensors.torch import load_file

        from .adapter_weights import WEIGHTS_NAME, is_adapter_config

        config_file, weights_file = Path(folder, "config.json"), Path(folder, WEIGHTS_NAME)
        if not (config_file.is_file() and weights_file.is_file()):
            raise ValueError(f"init_adapter={folder!r} is not a diffusion adapter folder (config.json and "
                             f"{WEIGHTS_NAME}, as train-diffusion writes under <output_dir>/diffusion_lm).")
        published = json.loads(config_file.read_text())
        if not is_adapter_config(published):
            raise ValueError(f"init_adapter={folder!r} holds a {published.get('model_type')!r} model, not a diffusion "
                             "adapter: point it at a train-diffusion artifact.")
        ours = self.added_tensors()
        lora = published.get("lora") or {}
        names = (published.get("base"), base_name)
        expected = {
            "base": names if None not in names else (None, None),  # a base without a name: its facts still count
            "base_config": (published.get("base_config"), base_config),
            "finetune": (published.get("finetune"), self.finetune),
            "mask_token_id": (published.get("diffusion", {}).get("mask_token_id"), self.mask_token_id),
            "shift_logits": (published.get("diffusion", {}).get("shift_logits"), bool(self.shift)),
        }
        if self.finetune == "lora":
            config = self.model.peft_config["default"]
            expected.update(lora_rank=(lora.get("rank"), config.r), lora_alpha=(lora.get("alpha"), config.lora_alpha))
        differ = {name: pair for name, pair in expected.items() if pair[0] != pair[1]}
        saved = load_file(weights_file)
        if not differ and set(saved) != set(ours):
            differ["tensors"] = (sorted(set(saved) - set(ours))[:3], sorted(set(ours) - set(saved))[:3])
        if differ:
            raise ValueError(f"init_adapter={folder!r} does not fit this run (adapter, run): {differ}. Train with the "
                             "settings it was trained with (see its config.json), or drop init_adapter.")
        live = {name: p for name, p in self.named_parameters() if p.requires_grad}
        for name, tensor in saved.items():
            target = self.mask_embedding if name == MASK_EMBEDDING else live[_trainee_name(name, self.finetune)]
            if target.shape != tensor.shape:
                raise ValueError(f"init_adapter={folder!r}: {name} has shape {tuple(tensor.shape)}, this run's has "
                                 f"{tuple(target.shape)}; the adapter was trained with other settings.")
            target.copy_(tensor)
        earlier_fingerprint = published.get("holdout_fingerprint")
        if earlier_fingerprint is not None and earlier_fingerprint != holdout_fingerprint:
            warnings.warn(f"init_adapter={folder!r} was trained with other held-out rows than this run holds out "
                          "(other data, seed, eval_sequences or max_seq_len): rows it learned may now be held out, "
                          "so the held-out loss and accuracy read too good. Keep those settings to compare runs.",
                          stacklevel=3)
        return int(published.get("trained_steps", 0))

    @torch.no_grad()
    def merged(self) -> DiffusionLM:
        """The trained DiffusionLM with everything folded in (peft's own merge); this trainee is spent afterwards."""
        model = self.model.merge_and_unload() if self.finetune == "lora" else self.model
        if self.mask_embedding is not None:
            self._hook.remove()
            model.model.embed_tokens.weight[self.mask_token_id] = self.mask_embedding
        return model.requires_grad_(False).eval()


def _trainee_name(artifact_name: str, finetune: str) -> str:
    """The trainee's parameter name for an artifact tensor name (`added_tensors` in reverse)."""
    if finetune != "lora":
        return f"model.{artifact_name}"
    module, factor = artifact_name.rsplit(".lora_", 1)  # "model.layers.0.self_attn.q_proj", "A.weight"
    return f"model.base_model.model.{module}.lora_{factor[0]}.default.weight"


def batch_loss(trainee, batch, config: DiffusionTrainConfig, generator: torch.Generator, block_share: float,
               device) -> tuple[torch.Tensor, int, int]:
    """Noise one collated batch (on the CPU, from `generator`), run the model, return masked_diffusion_loss."""
    ids, valid, answer = batch
    unwrapped = getattr(trainee, "module", trainee)  # DistributedDataParallel keeps the trainee in .module
    answer = answer.clone()
    answer[:, : unwrapped.shift] = False  # with shifted logits, position 0 has no prediction
    t, block_rows = sample_noise(ids.shape[0], config.mask_eps, block_share, generator)
    masked, scored = diffusion_masks(answer, t, generator, block_rows, config.block_length)
    ids, valid, masked, scored, t = (x.to(device) for x in (ids, valid, masked, scored, t))
    logits = trainee(ids.masked_fill(masked, unwrapped.mask_token_id), attention_mask(valid))
    return masked_diffusion_loss(logits, ids, masked, scored, t, unwrapped.mask_token_id, unwrapped.shift)


@torch.no_grad()
def evaluate(trainee, batches: list, config: DiffusionTrainConfig, device, accelerator) -> dict:
    """Held-out loss and masked-token accuracy under the same noise at every evaluation (seeded), with plain and,
    when it is trained, block-structured masking."""
    record = {}
    kinds = [("eval", 0.0)] + ([("eval_block", 1.0)] if config.block_masking_share > 0 else [])
    for name, share in kinds:
        generator = torch.Generator().manual_seed(config.seed + 1)
        loss, total, correct = 0.0, 0, 0
        for batch in batches:
            with accelerator.autocast():
                value, n, right = batch_loss(trainee, batch, config, generator, share, device)
            loss, total, correct = loss + float(value) * batch[0].shape[0], total + n, correct + right
        record[f"{name}_loss"] = loss / sum(batch[0].shape[0] for batch in batches)
        record[f"{name}_accuracy"] = correct / max(total, 1)
    return record


# --------------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------------


def train_diffusion(config: DiffusionTrainConfig, base=None, tokenizer=None, progress: bool = True) -> DiffusionLM:
    """Train (or resume) a masked diffusion LM from a causal LM; returns the merged `DiffusionLM` and writes
    `output_dir/diffusion_lm` (load it with `AutoDiffusionLM.from_pretrained`), checkpoints and a JSONL log.

    base: a loaded Llama-layout causal LM (not modified: its weights are copied), else `config.base` is loaded.
    tokenizer: saved with the artifact (the embedded base's own is used when `base` is None)."""
    from tqdm.auto import tqdm

    _check_config(config)
    plan, accelerator = start_run(config)
    output_dir = Path(config.output_dir)

    # 1. Data, base, [MASK] id: everything that can be wrong is checked before the first step, the data before the
    # base loads.
    sequences = read_sequences(config.data, config.max_seq_len)
    if len(sequences) <= config.eval_sequences:
        raise ValueError(
            f"Only {len(sequences)} usable rows: need more than eval_sequences={config.eval_sequences} (the held-out "
            f"rows) to train on. A row is dropped where its prompt leaves fewer than 2 answer tokens within "
            f"max_seq_len={config.max_seq_len}: add data, raise --max-seq-len or lower --eval-sequences."
        )
    base_name = _base_name(config, base)
    if base is None:
        base, own_tokenizer = load_base(base_name, with_tokenizer=True)
        tokenizer = tokenizer or own_tokenizer
    mask_id = _mask_token_id(config, base_name, tokenizer)
    facts = base_facts(base)
    model = DiffusionLM.from_causal_lm(base, mask_token_id=mask_id, shift_logits=config.shift_logits).float()
    del base  # a copy was taken; the caller's model is never modified
    check_vocabulary(sequences, model.config.vocab_size)
    if any(mask_id in row["ids"] for row in sequences):
        raise ValueError(f"mask_token_id={mask_id} occurs in the training data: [MASK] must be a token the data never "
                         "uses; choose another reserved token id.")
    eos_id = config.eos_token_id if config.eos_token_id is not None else model.config.eos_token_id
    eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    random.Random(config.seed).shuffle(sequences)
    holdout, sequences = sequences[: config.eval_sequences], sequences[config.eval_sequences :]
    holdout_batches = [collate_answers(holdout[i : i + config.batch_size], pad_id, eos_id)
                       for i in range(0, len(holdout), config.batch_size)]
    holdout_fingerprint = fingerprint(holdout)

    # 2. What is trained; checkpoints keep only that (and the optimizer).
    trainee = DiffusionTrainee(model.to(accelerator.device), config)
    earlier_steps = 0
    if config.init_adapter:
        if output_dir.resolve() in Path(config.init_adapter).resolve().parents:
            raise ValueError(f"init_adapter={config.init_adapter!r} lies inside output_dir={config.output_dir!r}, "
                             "where this run writes its own adapter: give the new run a new output_dir.")
        earlier_steps = trainee.load_adapter(config.init_adapter, base_name, facts, holdout_fingerprint)
    trainable = [p for p in trainee.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=config.weight_decay)

    scheduler, trainee, optimizer = prepare(accelerator, plan, trainee, optimizer)
    accelerator.register_save_state_pre_hook(_keep_trainable_only)

    checkpoints = output_dir / "checkpoints"
    if _latest_checkpoint(checkpoints) is not None:
        check_resumable(output_dir, config, _SHAPING_FIELDS)
    # frozen weights are not in checkpoints
    step = plan.resume(accelerator, checkpoints, holdout_fingerprint, strict=False)
    output_dir.mkdir(parents=True, exist_ok=True)
    log_path = write_run_config(output_dir, config)

    def save_artifact():
        unwrapped = accelerator.unwrap_model(trainee)
        lora = {"rank": config.lora_rank, "alpha": config.lora_alpha, "target_modules": config.lora_target_modules}
        save_adapter(output_dir / "diffusion_lm", unwrapped.added_tensors(), base=base_name, base_config=facts,
                     diffusion={"mask_token_id": mask_id, "shift_logits": config.shift_logits, "block_causal": False},
                     finetune=config.finetune, lora=lora if config.finetune == "lora" else None, tokenizer=tokenizer,
                     extra={"trained_steps": earlier_steps + step, "continued_from_steps": earlier_steps,
                            "holdout_fingerprint": holdout_fingerprint})

    def log(record):
        if accelerator.is_main_process:
            with log_path.open("a") as file:
                file.write(json.dumps(record) + "\n")

    if step == 0:  # the converted model before any training: the baseline of the held-out metrics
        trainee.eval()
        log({"step": 0, **evaluate(trainee, holdout_batches, config, accelerator.device, accelerator)})
    bar = tqdm(total=plan.last_step, initial=step, desc="train-diffusion",
               disable=not progress or not accelerator.is_main_process)
    evaluation = {}
    while step < plan.last_step:
        trainee.train()
        started = time.perf_counter()
        total_loss, total, correct = 0.0, 0, 0
        for micro_step in range(config.gradient_accumulation_steps):
            with accelerator.accumulate(trainee):
                # seeded by (step, micro-step, process): a resumed run draws exactly the batches and masks an
                # uninterrupted one would, and each GPU draws its own; a run continuing an init_adapter counts its
                # steps on from the adapter's, so it draws new batches rather than the earlier run's again
                draw_step = earlier_steps + step
                draw_seed = (((config.seed * 1_000_003 + draw_step) * 1_009 + micro_step) * 101
                             + accelerator.process_index)
                order = random.Random(draw_seed)
                rows = [sequences[order.randrange(len(sequences))] for _ in range(config.batch_size)]
                generator = torch.Generator().manual_seed(draw_seed)
                with accelerator.autocast():
                    loss, n, right = batch_loss(trainee, collate_answers(rows, pad_id, eos_id), config, generator,
                                                config.block_masking_share, accelerator.device)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(trainable, config.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            total_loss, total, correct = total_loss + float(loss.detach()), total + n, correct + right
        scheduler.step()
        step += 1
        plan.after_step(step)
        bar.total = plan.last_step
        record = {"step": step, "lr": scheduler.get_last_lr()[0],
                  "loss": total_loss / config.gradient_accumulation_steps, "accuracy": correct / max(total, 1),
                  "masked_tokens": total, "seconds": time.perf_counter() - started}
        if plan.evaluates(step):
            trainee.eval()
            evaluation = evaluate(trainee, holdout_batches, config, accelerator.device, accelerator)
            record.update(evaluation)
        log(record)
        bar.set_postfix(loss=f"{record['loss']:.3f}", **{k: f"{v:.3f}" for k, v in evaluation.items()
                                                         if k.endswith("accuracy")})
        bar.update(1)
        if plan.saves(step):
            plan.save_checkpoint(accelerator, checkpoints, step, save_artifact)
    bar.close()
    if accelerator.is_main_process and not (output_dir / "diffusion_lm" / "config.json").is_file():
        save_artifact()  # resumed at max_steps, or save points never reached the artifact
    return accelerator.unwrap_model(trainee).merged()


def _check_config(config: DiffusionTrainConfig) -> None:
    check_options(config, {
        "finetune": (config.finetune in FINETUNE_MODES, f"one of {FINETUNE_MODES}"),
        "lora_rank": (config.lora_rank >= 1, ">= 1"),
        "lora_target_modules": (bool(config.lora_target_modules) or config.finetune == "full", "not empty"),
        "mask_eps": (0 < config.mask_eps < 1, "in (0, 1)"),
        "block_masking_share": (0 <= config.block_masking_share <= 1, "in [0, 1]"),
        "block_length": (config.block_length >= 1, ">= 1"),
        "eval_sequences": (config.eval_sequences >= 1, ">= 1"),
    })
    if config.finetune == "full":  # every weight trains: the LoRA options would shape nothing
        defaults = DiffusionTrainConfig()
        if changed := [name for name in ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules")
                       if getattr(config, name) != getattr(defaults, name)]:
            raise ValueError(f"finetune='full' trains every weight, so {changed} would do nothing: drop them, or use "
                             "finetune='lora'.")
    if config.finetune == "lora" and importlib.util.find_spec("peft") is None:
        raise ImportError("LoRA training needs peft: `pip install 'hf_specdiff[train]'` (or finetune='full'). Loading "
                          "the trained adapter does not.")


def _base_name(config: DiffusionTrainConfig, base) -> str | None:
    """How the artifact names its base: `config.base` (a local folder made absolute), the embedded model, or the
    loaded model's `name_or_path`; None when a model given in memory has no name (loading then needs base=)."""
    from ..embedded import is_embedded_folder

    name = config.base
    if name is None and base is None:
        return EMBEDDED_BASE
    if name is None:
        name = getattr(base, "name_or_path", "") or None
    if is_embedded_folder(name):
        return EMBEDDED_BASE
    if name is not None and Path(name).is_dir():
        return str(Path(name).resolve())
    return name


def _mask_token_id(config: DiffusionTrainConfig, base_name: str | None, tokenizer) -> int:
    if config.mask_token_id is not None:
        return config.mask_token_id
    if base_name == EMBEDDED_BASE:
        return SMOLLM2_MASK_TOKEN_ID
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return tokenizer.mask_token_id
    raise ValueError("Set mask_token_id: the base's tokenizer has no mask token. Choose a reserved special token the "
                     "training data never contains (for SmolLM2: 16, <empty_output>).")


def _keep_trainable_only(models, weights, output_dir) -> None:
    """accelerate save_state hook: checkpoints hold the trained parameters, not the frozen base."""
    for model, state in zip(models, weights):
        trained = {name for name, p in model.named_parameters() if p.requires_grad}
        for name in [name for name in state if name not in trained]:
            del state[name]
