"""Training a speculator by self-distillation: the dFlash drafter, the xPress refiner and the Markov head together.

One step, on a batch of (prompt + the target's own answer) sequences:

    1. the frozen target reads the sequences once: context features (its `target_layer_ids` outputs) and its
       next-token distribution p at every position
    2. draw random anchors a in the answer; block j = [x_a, MASK x (B-1)] at positions a..a+B-1, attending to the
       context features before a and to its own block only (all blocks of a sequence go in one drafter pass)
    3. drafter loss ("anchor"): cross-entropy of slot k against x_{a+k}, weighted exp(-(k-1)/gamma)
    4. xPress losses: teacher-forced pass (prev = the true tokens) with cross-entropy and total variation to p;
       consistency pass with prev = the refiner's own picks (what Jacobi iterates on at inference)
    5. Markov head: the same cross-entropy + total variation, on detached drafter logits (same drafter, fair baseline)

A speculator with a draft vocabulary (`draft_vocab.py`) is trained over it: drafts are read out over those tokens
only, so the logits, their softmax q and the losses are computed over them only (total variation adds p's mass
outside, which no draft can cover). That is the q inference samples from, and on a CPU it is most of a step's time:
with 8,192 of SmolLM2's 49,152 tokens a step (4 sequences of 256 tokens, 16 anchors each) took
2.8 s instead of 7.8 s.

Target embedding and lm_head are frozen (they are the target's). Built on `accelerate`: mixed precision, gradient
accumulation and several GPUs need no code change; checkpoints resume.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .draft_vocab import VocabRows, draft_read_outs, token_ids_of, top_tokens
from .markov import markov_decode
from .speculator import AutoSpeculator, Speculator, target_decoder_layers
from .xpress import jacobi_refine

MIXED_PRECISIONS = ("no", "bf16", "fp16")  # accelerate's

@dataclass
class TrainConfig:
    """Every training option, with its default: `hf-specdiff train` mirrors these fields, and each field's
    `metadata["help"]` is its `--help` text."""

    data: list[str] = field(default_factory=list, metadata={"help": (
        "JSONL files with prompt_ids and response_ids per line (`hf-specdiff distill`'s output)")})
    output_dir: str = field(default="runs/speculator", metadata={"help": (
        "where the run writes checkpoints/ (resumed from when present), train_config.json, the log and the trained "
        "speculator/")})
    target: str | None = field(default=None, metadata={"help": (
        "the target: a local folder or Hub id; None: the embedded SmolLM2-135M-Instruct")})
    # the shape options below then come from it (None), and one given that differs from it is refused
    init_speculator: str | None = field(default=None, metadata={"help": (
        "continue training this saved speculator instead of a fresh one; it brings its own shape (block size, layers, "
        "rank, ...): leave those options out")})
    block_size: int | None = field(default=None, metadata={"help": (
        "B, tokens per drafted block (the anchor and B-1 drafts); None: 16 for a fresh speculator")})
    num_draft_layers: int | None = field(default=None, metadata={"help": (
        "decoder layers of the drafter; None: 1 for a fresh speculator")})
    target_layer_ids: list[int] | None = field(default=None, metadata={"help": (
        "target layers whose hidden states the drafter reads; None: spread over the target's depth")})
    mask_token_id: int | None = field(default=None, metadata={"help": (
        "the token id the drafter fills the block with; None: the target's last embedding row")})
    refiner_rank: int | None = field(default=None, metadata={"help": (
        "r, the low rank of the xPress refiner and of the Markov head; None: 256 for a fresh speculator")})
    init_from_target_layer: int | None = field(default=-1, metadata={"help": (
        "copy this target decoder layer into each fresh draft layer (-1: the last; None: random init); not with "
        "init_speculator")})
    # with one, the losses are computed over the tokens it can draft (see `SpeculatorTrainer.losses`)
    draft_vocab_size: int | None = field(default=None, metadata={"help": (
        "give the speculator a draft vocabulary: the N tokens most frequent in the training answers, the only ones it "
        "drafts (smaller read-out, faster); None: init_speculator's, or the whole vocabulary for a fresh one")})
    max_seq_len: int = field(default=384, metadata={"help": "training sequences are cut to this many tokens"})
    anchors_per_sequence: int = field(default=16, metadata={"help": (
        "random block starts drawn in each sequence's answer; each trains one drafted block")})
    batch_size: int = field(default=4, metadata={"help": "sequences per micro-batch (per process)"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    max_steps: int = field(default=2000, metadata={"help": "optimizer steps (time_budget_minutes may end it sooner)"})
    learning_rate: float = field(default=6e-4, metadata={"help": (
        "peak AdamW learning rate, after a linear warm-up; cosine decay to 10% of it")})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    warmup_steps: int = field(default=50, metadata={"help": "steps of linear learning-rate warm-up"})
    gamma: float = field(default=7.0, metadata={"help": (
        "loss weight of the k-th draft in a block: exp(-(k-1)/gamma), early drafts count most")})
    ce_weight: float = field(default=0.1, metadata={"help": (
        "refiner and Markov head: weight of the cross-entropy to the data's token")})
    tv_weight: float = field(default=0.9, metadata={"help": (
        "refiner and Markov head: weight of the total variation to the target's distribution")})
    consistency_weight: float = field(default=0.5, metadata={"help": (
        "refiner: weight of its losses on a pass that reads its own picks, as the Jacobi passes do at inference")})
    anchor_weight: float = field(default=1.0, metadata={"help": "weight of the drafter's own cross-entropy"})
    mixed_precision: str = field(default="no", metadata={"help": "accelerate's mixed precision",
                                                         "choices": MIXED_PRECISIONS})
    holdout_sequences: int = field(default=16, metadata={"help": (
        "sequences kept out of training, to estimate acceptance (tau) at each evaluation")})
    eval_every: int = field(default=100, metadata={"help": "estimate held-out acceptance every this many steps"})
    save_every: int = field(default=100, metadata={"help": (
        "checkpoint and save the speculator every this many steps (and at the end)")})
    time_budget_minutes: float | None = field(default=None, metadata={"help": (
        "wall-clock budget of this call: the run ends (learning-rate schedule and all) where the budget reaches, at "
        "the pace timed after the first steps and again at each evaluation; None: no budget")})
    seed: int = field(default=0, metadata={"help": "seeds initialisation, batches and anchors"})
    holdout_seed: int | None = field(default=None, metadata={"help": (
        "which sequences are held out (None: seed). To continue an init_speculator, repeat the earlier run's seed "
        "here, keeping its held-out sequences out (comparable estimates), and give a new seed for fresh batches")})
    log_file: str | None = field(default=None, metadata={"help": (
        "JSONL of step, losses and held-out tau, a line per step; None: <output_dir>/log.jsonl")})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# the options that shape the trained parameters: a checkpoint only resumes under the same values
_SHAPING_FIELDS = ("target", "init_speculator", "block_size", "num_draft_layers", "target_layer_ids", "mask_token_id",
                   "refiner_rank", "draft_vocab_size")
# a fresh speculator's shape where the config leaves it None
_FRESH_SHAPE = {"block_size": 16, "num_draft_layers": 1, "refiner_rank": 256}


def build_speculator(config: TrainConfig, target) -> tuple[Speculator, TrainConfig]:
    """The speculator a run trains (fresh, or `init_speculator`), and the config with its shape filled in (what
    train_config.json records and the losses read). An option that contradicts `init_speculator` is refused."""
    if config.init_speculator is None:
        shape = {name: default if getattr(config, name) is None else getattr(config, name)
                 for name, default in _FRESH_SHAPE.items()}
        speculator = AutoSpeculator.from_target(target, mask_token_id=config.mask_token_id,
                                                target_layer_ids=config.target_layer_ids, seed=config.seed, **shape)
        if config.init_from_target_layer is not None:
            init_draft_layers_from_target(speculator, target, config.init_from_target_layer)
    else:
        if config.init_from_target_layer not in (None, -1):
            raise ValueError(f"init_from_target_layer={config.init_from_target_layer} initialises fresh draft layers; "
                             f"init_speculator={config.init_speculator!r} brings trained ones: drop one of the two.")
        speculator = AutoSpeculator.from_pretrained(config.init_speculator)
    drafter, heads = speculator.drafter.config, speculator.refiner or speculator.markov_head
    shape = {"block_size": drafter.block_size, "num_draft_layers": drafter.num_hidden_layers,
             "target_layer_ids": list(drafter.layer_ids), "mask_token_id": drafter.mask_token_id,
             "refiner_rank": heads.config.rank if heads is not None else None}
    given = {name: getattr(config, name) for name in shape if getattr(config, name) is not None}
    differ = {name: (value, shape[name]) for name, value in given.items() if value != shape[name]}
    if differ:
        raise ValueError(f"{config.init_speculator} does not have the shape this run asks for (asked, its own): "
                         f"{differ}. Leave these options out to continue it as it is, or train a fresh speculator.")
    return speculator, dataclasses.replace(config, **shape)


# --------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------


def read_sequences(paths: list[str], max_seq_len: int, min_answer_tokens: int = 2) -> list[dict]:
    """Read distill JSONL files into [{"ids": [...], "answer_start": int, "where": "file:line"}], checking every row;
    the target is not needed, so a bad file fails before the target loads (`check_vocabulary` then checks the ids)."""
    from .bench import text_lines

    if not paths:
        raise ValueError("No training data: pass data files (JSONL with prompt_ids and response_ids).")
    sequences = []
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"Training data file {path} does not exist.")
        for number, line in text_lines(path):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt, answer = list(row["prompt_ids"]), list(row["response_ids"])
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(
                    f"{path}:{number} is not a distill row with `prompt_ids` and `response_ids` ({error!r}): "
                    "training reads the target's own answers, which `hf-specdiff distill --sources YOUR_PROMPTS.jsonl` "
                    "writes from your prompts."
                ) from error
            ids = (prompt + answer)[:max_seq_len]
            if any(type(t) is not int for t in prompt + answer):  # 1.7 would be read as 1, "5" would crash later
                raise ValueError(f"{path}:{number}: `prompt_ids` and `response_ids` must be lists of integer token "
                                 "ids.")
            if len(ids) - len(prompt) >= min_answer_tokens:
                sequences.append({"ids": ids, "answer_start": len(prompt), "where": f"{path}:{number}"})
    if not sequences:
        raise ValueError(f"No usable rows in {paths}: every row is empty or its answer is cut off by max_seq_len.")
    return sequences


def check_vocabulary(sequences: list[dict], vocab_size: int) -> None:
    """Refuse rows of `read_sequences` with token ids the target's embedding does not have (another tokenizer)."""
    for row in sequences:
        if not all(0 <= t < vocab_size for t in row["ids"]):
            raise ValueError(f"{row['where']} has token ids outside the target's vocabulary ({vocab_size}): were the "
                             "answers distilled from this target?")


def collate(rows: list[dict], pad_id: int):
    length = max(len(r["ids"]) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row["ids"])] = torch.tensor(row["ids"])
        mask[i, : len(row["ids"])] = 1
    return ids, mask, torch.tensor([r["answer_start"] for r in rows])


def sample_anchors(lengths, answer_starts, count: int, generator: torch.Generator) -> torch.LongTensor:
    """(b, count) anchor positions in [answer_start - 1, length - 2]: the anchor is the last prompt token or an
    answer token, with at least one answer token after it. Drawn with replacement where a row is short."""
    anchors = []
    for length, start in zip(lengths.tolist(), answer_starts.tolist()):
        low, high = max(start - 1, 0), length - 2
        anchors.append(torch.randint(low, high + 1, (count,), generator=generator))
    return torch.stack(anchors)


def block_windows(ids, mask, anchors, block_size: int):
    """For each anchor a, positions a-1 .. a+B-1 (b, nA, B+1), whether each lies inside its row, and the tokens
    there (clamped reads outside; use `inside` to ignore them)."""
    where = anchors[..., None] + torch.arange(-1, block_size, device=ids.device)
    inside = (where >= 0) & (where < mask.sum(1)[:, None, None])
    tokens = ids.gather(1, where.clamp(0, ids.shape[1] - 1).flatten(1)).view(where.shape)
    return where, inside, tokens


# --------------------------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------------------------


def vocab_index(token_ids: torch.LongTensor, vocab_size: int) -> torch.LongTensor:
    """(vocab_size,) the index of each token in the draft vocabulary `token_ids`, -100 (ignored) for the others."""
    index = torch.full((vocab_size,), -100, dtype=torch.long, device=token_ids.device)
    return index.index_copy_(0, token_ids.long(), torch.arange(len(token_ids), device=token_ids.device))


def position_weights(block_size: int, gamma: float, device) -> torch.Tensor:
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)


def weighted_ce(logits, labels, weights):
    """logits (N, B-1, V), labels (N, B-1) with -100 ignored; weights (B-1,) per slot."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")
    w = (weights[None].expand_as(labels) * (labels != -100)).flatten()
    return (ce * w).sum() / w.sum().clamp(min=1e-6)


def weighted_tv(logits, target_probs, labels, weights):
    """Total variation 0.5 * sum |q - p| per slot; the quantity speculative sampling's acceptance depends on.
    Over a draft vocabulary, logits and p are its columns only: q is 0 outside, where |q - p| sums to p's mass
    there, 1 - sum(p) (about 0 over the whole vocabulary)."""
    p_outside = (1 - target_probs.sum(-1)).clamp(min=0)
    tv = 0.5 * ((logits.float().softmax(-1) - target_probs).abs().sum(-1) + p_outside)  # (N, B-1)
    w = weights[None].expand_as(labels) * (labels != -100)
    return (tv * w).sum() / w.sum().clamp(min=1e-6)


# --------------------------------------------------------------------------------------------------------------
# One step
# --------------------------------------------------------------------------------------------------------------


def _drop_target_weights(state_dict, prefix, *_):
    """Checkpoints written before the target's embedding and lm_head were left out hold them: they resume, those
    weights coming from the target as in any other run."""
    for key in [k for k in state_dict if k.startswith((f"{prefix}embed.", f"{prefix}lm_head."))]:
        del state_dict[key]


class SpeculatorTrainer(nn.Module):
    """The trainable speculator and the frozen target; `forward(batch)` (= `losses`) is one forward of everything.

    A module whose forward runs the speculator, so that `accelerate.prepare` can wrap it: with several processes the
    wrapper's forward is what makes backward average the gradients across them."""

    def __init__(self, target, speculator: Speculator, config: TrainConfig):
        super().__init__()
        self.speculator = speculator
        # Not a submodule: the wrapper would broadcast its weights and checkpoints would copy them; it is not trained.
        object.__setattr__(self, "target", target.eval().requires_grad_(False))
        self.config = config
        # Nor are its embedding and lm_head, which the drafter reads: frozen, they would only add the target's
        # vocabulary matrices to every checkpoint (113 MB for SmolLM2-135M, and accelerate's warning of a tied one).
        object.__setattr__(self, "embed", target.get_input_embeddings())
        object.__setattr__(self, "lm_head", target.get_output_embeddings())
        self._register_load_state_dict_pre_hook(_drop_target_weights)  # as checkpoints of earlier versions hold them

    @torch.no_grad()
    def target_pass(self, ids, mask):
        """Context features (b, T, F) and the target's logits (b, T, V)."""
        drafter = self.speculator.drafter
        layers = drafter.target_hidden_states_request()
        out = self.target(input_ids=ids, attention_mask=mask, output_hidden_states=layers)
        return drafter.context_features(out.hidden_states), out.logits

    @torch.no_grad()
    def target_probs(self, target_logits, positions, vocab):
        """The target's next-token distribution p at `positions` (b, n) -> (b, n, V), or at the draft vocabulary's
        columns only (b, n, N) when `vocab` is given (normalised over all V: the mass outside is 1 - their sum)."""
        V = target_logits.shape[-1]
        p = target_logits.gather(1, positions[..., None].expand(-1, -1, V)).float().softmax(-1)
        return p if vocab is None else p[..., vocab]

    def draft_blocks(self, ids, mask, features, anchors, read_out):
        """All blocks of a row in one drafter pass. Returns hidden (b, nA, B, H) and drafter logits (b, nA, B-1, V)
        read out by `read_out` (the lm_head, or its rows for a draft vocabulary: (..., N))."""
        drafter, B = self.speculator.drafter, self.config.block_size
        b, T = ids.shape
        nA = anchors.shape[1]
        device = ids.device
        slots = torch.arange(B, device=device)
        block_ids = torch.full((b, nA, B), drafter.config.mask_token_id, device=device)
        block_ids[:, :, 0] = ids.gather(1, anchors)
        block_positions = anchors[..., None] + slots  # (b, nA, B)
        positions = torch.cat([torch.arange(T, device=device).expand(b, T), block_positions.flatten(1)], dim=1)
        # Block j sees context strictly before its anchor (those tokens have target features) and its own slots.
        sees_context = torch.arange(T, device=device)[None, None] < anchors[..., None]  # (b, nA, T)
        sees_context = sees_context & mask[:, None].bool()
        own_block = torch.eye(nA, dtype=torch.bool, device=device).repeat_interleave(B, 0).repeat_interleave(B, 1)
        attend = torch.cat([sees_context.repeat_interleave(B, 1), own_block.expand(b, -1, -1)], dim=2)
        hidden = drafter(
            noise_embeds=self.embed(block_ids.flatten(1)),
            context_hidden_states=features,
            position_ids=positions,
            attention_mask=attend[:, None],
        ).last_hidden_state.view(b, nA, B, -1)
        return hidden, read_out(hidden[:, :, 1:].contiguous())  # contiguous: a matmul, not a batched one per block

    def losses(self, ids, mask, answer_starts, generator) -> dict[str, torch.Tensor]:
        c, B = self.config, self.config.block_size
        # With a draft vocabulary every logit below is over its N tokens only, in its order (`VocabRows`).
        vocab = self.speculator.draft_vocab
        read_out = self.lm_head if vocab is None else VocabRows(self.lm_head, vocab)
        features, target_logits = self.target_pass(ids, mask)
        anchors = sample_anchors(mask.sum(1), answer_starts, c.anchors_per_sequence, generator).to(ids.device)
        hidden, drafter_logits = self.draft_blocks(ids, mask, features, anchors, read_out)
        b, nA = anchors.shape

        # Labels x_{a+k}, k = 1..B-1 (-100 past the end), the target's p at a+k-1, and prev tokens x_{a-1..a+B-2}.
        where, inside, tokens = block_windows(ids, mask, anchors, B)
        labels = tokens[..., 2:].masked_fill(~inside[..., 2:], -100).flatten(0, 1)  # (N, B-1)
        prev_true = tokens[..., :B].masked_fill(~inside[..., :B], 0).flatten(0, 1)  # (N, B)
        p_index = where[..., 1:B].clamp(0, ids.shape[1] - 1).flatten(1)  # positions a..a+B-2
        p = self.target_probs(target_logits, p_index, vocab).view(b * nA, B - 1, -1)
        # Cross-entropy's labels index the logits: into the vocabulary, where a token outside it is ignored (it cannot
        # be drafted). Total variation counts every slot inside the row (p's mass outside included): `labels`.
        draft_labels = labels if vocab is None else \
            vocab_index(vocab, self.lm_head.weight.shape[0])[labels.clamp(min=0)].masked_fill(labels < 0, -100)
        weights = position_weights(B, c.gamma, ids.device)
        drafter_logits = drafter_logits.flatten(0, 1)
        hidden = hidden.flatten(0, 1)

        losses = {"drafter_ce": weighted_ce(drafter_logits, draft_labels, weights)}
        total = c.anchor_weight * losses["drafter_ce"]
        refiner = self.speculator.refiner
        if refiner is not None:
            context = refiner.block_context(hidden)
            add_on_read_out = None if vocab is None else VocabRows(refiner.w2, vocab)
            refined = drafter_logits + refiner(context, prev_true, read_out=add_on_read_out)
            losses["xpress_ce"] = weighted_ce(refined, draft_labels, weights)
            losses["xpress_tv"] = weighted_tv(refined, p, labels, weights)
            own = refined.detach().argmax(-1)
            own = own if vocab is None else vocab[own]  # token ids: what the refiner reads back
            prev_own = torch.cat([prev_true[:, :2], own[:, :-1]], dim=1)
            refined_own = drafter_logits + refiner(context, prev_own, read_out=add_on_read_out)
            losses["xpress_consistency"] = c.ce_weight * weighted_ce(refined_own, draft_labels, weights) + \
                c.tv_weight * weighted_tv(refined_own, p, labels, weights)
            total = total + c.ce_weight * losses["xpress_ce"] + c.tv_weight * losses["xpress_tv"] + \
                c.consistency_weight * losses["xpress_consistency"]
        markov = self.speculator.markov_head
        if markov is not None:
            markov_logits = drafter_logits.detach() + \
                markov(prev_true[:, 1:], read_out=None if vocab is None else VocabRows(markov.w2, vocab))
            losses["markov_ce"] = weighted_ce(markov_logits, draft_labels, weights)
            losses["markov_tv"] = weighted_tv(markov_logits, p, labels, weights)
            total = total + c.ce_weight * losses["markov_ce"] + c.tv_weight * losses["markov_tv"]
        losses["loss"] = total
        return losses

    forward = losses

    @torch.no_grad()
    def estimate_tau(self, ids, mask, answer_starts, generator, num_jacobi_passes: int | None = None) -> dict:
        """Expected accepted length per block (bonus included) against the data's own continuation, greedy:
        1 + the number of leading draft tokens equal to the data, averaged over random anchors."""
        B, vocab = self.config.block_size, self.speculator.draft_vocab
        features, _ = self.target_pass(ids, mask)
        anchors = sample_anchors(mask.sum(1), answer_starts, self.config.anchors_per_sequence, generator).to(ids.device)

        refiner, markov = self.speculator.refiner, self.speculator.markov_head
        # as generate reads out and picks: over a draft vocabulary's columns, mapped to token ids
        drafter_read_out, refiner_read_out, markov_read_out = draft_read_outs(vocab, self.lm_head, refiner, markov)
        hidden, drafter_logits = self.draft_blocks(ids, mask, features, anchors, drafter_read_out)
        _, inside, tokens = block_windows(ids, mask, anchors, B)
        tokens = tokens.flatten(0, 1)
        truth, valid = tokens[:, 2:], inside[..., 2:].flatten(0, 1)
        drafter_logits, hidden = drafter_logits.flatten(0, 1).float(), hidden.flatten(0, 1)

        def greedy(logits, assumed=None):
            return token_ids_of(logits.argmax(-1), vocab), logits

        def tau(drafts):
            run = ((drafts == truth) & valid).int().cumprod(dim=1).sum(dim=1)
            return float((1 + run.float()).mean())

        estimates = {"dflash": tau(greedy(drafter_logits)[0])}
        if refiner is not None:
            passes = num_jacobi_passes or refiner.config.num_jacobi_passes
            drafts, _, _ = jacobi_refine(refiner, drafter_logits, hidden, tokens[:, :2], greedy, passes,
                                         refiner_read_out)
            estimates["xpress"] = tau(drafts)
        if markov is not None:
            drafts, _ = markov_decode(markov, drafter_logits, tokens[:, 1],
                                      lambda logits, slot, earlier: greedy(logits), markov_read_out)
            estimates["markov"] = tau(drafts)
        return estimates


def init_draft_layers_from_target(speculator: Speculator, target, layer: int) -> None:
    """Copy a target decoder layer into every draft layer (attention, MLP, norms) and the target's final norm into
    the drafter's: a warm start whose output already reads like the target's last hidden state (with tied
    embeddings, a random start predicts its own input token with huge confidence: initial CE ~85 vs ~14 here).
    q_norm/k_norm are copied where the target has them per head (Qwen 3, Gemma 3), else stay at identity.

    A norm is copied as the scale it applies (`_norm_scale`), not as its stored weight: Gemma's norms store
    1 + weight, and their weights copied as the drafter's would zero its hidden states. The drafter's pre-MLP norm
    (`post_attention_layernorm`, Llama's name) takes the target's pre-MLP norm: Gemma 2/3's
    `pre_feedforward_layernorm`, while their `post_attention_layernorm`, like OLMo 2's, normalises the attention's
    output and is left out."""
    decoder, layers = target.get_decoder(), target_decoder_layers(target)
    if layers is not None and not -len(layers) <= layer < len(layers):
        raise ValueError(f"init_from_target_layer={layer}, but {type(target).__name__} has decoder layers 0 to "
                         f"{len(layers) - 1} (-1: the last). Pass one of those (`--init-from-target-layer -1`), or "
                         "none to start the draft layers at random.")
    own = speculator.drafter.layers[0].state_dict()  # (every draft layer has the same weights)
    source = _layer_weights(layers[layer], own) if layers is not None else {}
    copied = {k: v for k, v in source.items() if k in own and own[k].shape == v.shape}
    if not copied:
        raise ValueError(
            f"init_from_target_layer={layer} copies a target decoder layer into each draft layer, and "
            f"{type(target).__name__}'s layers name their weights unlike the drafter's (Llama's q_proj, gate_proj, "
            "...), so nothing would be copied. Start the draft layers at random: init_from_target_layer=None "
            "(`--init-from-target-layer none`)."
        )
    # (a norm left out starts as the identity, as a target without it has none)
    if left_random := sorted(k for k in own if k not in copied and not k.rsplit(".", 2)[-2].endswith("norm")):
        warnings.warn(
            f"init_from_target_layer={layer}: {type(target).__name__}'s layers have no weights of the drafter's "
            f"names and shapes for {left_random} (a mixture of experts, a layout unlike Llama's): those start at "
            "random, the rest is copied. Pass init_from_target_layer=None (`--init-from-target-layer none`) to "
            "start every draft weight at random.", stacklevel=2)
    if dropped := sorted(k for k in source if k.endswith(".bias") and k not in own):
        warnings.warn(
            f"init_from_target_layer={layer}: {type(target).__name__}'s layers have biases {dropped} that this "
            "speculator's draft layers have no place for: the copy computes without them. A speculator made by "
            "`AutoSpeculator.from_target` (`hf-specdiff train` makes one) takes the target's attention and MLP biases.",
            stacklevel=2)
    for draft_layer in speculator.drafter.layers:
        draft_layer.load_state_dict(copied, strict=False)
    if getattr(getattr(decoder, "norm", None), "weight", None) is not None:
        speculator.drafter.norm.weight.data.copy_(_norm_scale(decoder.norm))


# a target's fused projections (Phi-3's), each the drafter's projections stacked along the output
_FUSED_PROJECTIONS = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                    "self_attn.v_proj.weight"),
                      "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                  "self_attn.v_proj.bias"),
                      "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                      "mlp.gate_up_proj.bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias")}


def _layer_weights(target_layer: nn.Module, draft_weights: dict) -> dict[str, torch.Tensor]:
    """A target layer's state dict under the drafter's names (`draft_weights`: a draft layer's state dict), fused
    projections split, its norms as the scales they apply."""
    weights = target_layer.state_dict()
    for fused, parts in _FUSED_PROJECTIONS.items():
        sizes = [draft_weights[part].shape[0] for part in parts if part in draft_weights]
        if fused in weights and len(sizes) == len(parts) and sum(sizes) == weights[fused].shape[0]:
            weights.update(zip(parts, weights.pop(fused).split(sizes)))
    norms = {name: module for name, module in target_layer.named_modules()
             if name.rsplit(".", 1)[-1].endswith("norm") and f"{name}.weight" in weights
             and weights[f"{name}.weight"].dim() == 1}
    for name, module in norms.items():
        weights[f"{name}.weight"] = _norm_scale(module)
    if "pre_feedforward_layernorm" in norms:  # Gemma 2/3: a norm before the MLP, and one after the attention
        weights["post_attention_layernorm.weight"] = weights.pop("pre_feedforward_layernorm.weight")
    elif "post_feedforward_layernorm" in norms:  # OLMo 2: norms after the attention and the MLP only
        weights.pop("post_attention_layernorm.weight", None)
    return weights


@torch.no_grad()
def _norm_scale(norm: nn.Module) -> torch.Tensor:
    """(width,) the per-channel scale `norm` multiplies its normalised input by, read from what it does: the weight
    for Llama's RMSNorm, 1 + weight for Gemma's. The input is +-1 in turn (zero mean, unit RMS), so an RMSNorm and
    a LayerNorm alike return the scale times it, plus a LayerNorm's bias, which the difference with its negation
    cancels."""
    weight = norm.weight
    signs = torch.ones(weight.shape[0], device=weight.device)
    signs[1::2] = -1
    x = signs.to(weight.dtype)[None]
    return (norm(x) - norm(-x))[0].float() / (2 * signs)


# --------------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------------


def warmup_cosine(warmup_steps: int, max_steps: int):
    """Learning-rate factor per step: linear warm-up, then cosine decay to 10%."""

    def schedule(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        done = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))

    return schedule


class StepPlan:
    """Which optimizer step is the last, which ones evaluate and save, and the learning rate of each (both trainers).

    The last step is `max_steps`, unless a wall-clock budget (`minutes`) would not reach it: then the pace is timed
    over `probe_steps` steps (after the first, which pays for warm-up and any compilation) and the last step becomes
    the one the budget reaches at that pace, keeping `reserve` of what is left for evaluations and saves. Paces drift
    (a shared host slows down or frees up, evaluations and saves take their share), so the pace is timed again at
    every evaluation step, over the steps since the last timing, and the last step moves to where the budget now
    reaches: earlier when the pace slowed, later (never past `max_steps`) when it quickened, so that a slow start does
    not leave the rest of the budget unused. The learning-rate schedule reads the last step when it is asked, so a cut
    run still warms up and decays to its end (the warm-up shrinks to a tenth of a cut run if it was longer, and never
    grows back; a moved cut reshapes the decay from there on). The plan is saved with each checkpoint: a resumed run
    that a budget cut keeps its cut as its end (a run that was not cut may be resumed with a larger max_steps), and with
    a budget times itself again, from the start of that call, and may end sooner.
    The clock starts when the plan is made: at the start of the trainer's call, so loading counts. With several
    processes, `agree` turns each one's cut into one they all keep (the earliest), so they stop together.
    """

    FILE = "step_plan.json"

    def __init__(self, max_steps: int, warmup_steps: int, eval_every: int, save_every: int,
                 minutes: float | None = None, probe_steps: int = 20, reserve: float = 0.1, agree=None):
        if minutes is not None and minutes <= 0:
            raise ValueError(f"time_budget_minutes must be positive (or None for no budget); got {minutes}.")
        self.max_steps = self.last_step = self.latest_end = max_steps  # latest_end: the furthest a re-timing may go
        self.warmup_steps, self.eval_every, self.save_every = warmup_steps, eval_every, save_every
        self.minutes, self.probe_steps, self.reserve = minutes, probe_steps, reserve
        self._started = time.perf_counter()
        self._timed_from: tuple[int, float] | None = None  # (step, time) the next pace is timed from
        self._timed = False  # whether the probe steps have been timed
        self._agree = agree or (lambda last_step: last_step)

    def lr_factor(self, step: int) -> float:
        return warmup_cosine(self.warmup_steps, self.last_step)(step)

    def _end_at(self, last_step: int) -> None:
        self.last_step = last_step
        # A cut run warms up over a tenth of its steps at most. The warm-up never grows back: a cut moved later must
        # not put a run that has finished warming up back into its warm-up.
        if last_step < self.max_steps:
            self.warmup_steps = min(self.warmup_steps, max(1, last_step // 10))

    def after_step(self, step: int) -> None:
        """Call after optimizer step `step` (counted from 1) has finished. Every process calls it at every step, so
        the timings (each one a collective through `agree`) fall on the same steps everywhere."""
        if self.minutes is None or step >= self.last_step:
            return
        now = time.perf_counter()
        if self._timed_from is None:  # the first step is done: time the pace from here
            self._timed_from = (step, now)
            return
        first, start = self._timed_from
        # the first timing once the probe steps are done, then one at each evaluation step
        due = step % self.eval_every == 0 if self._timed else step - first >= self.probe_steps
        if not due:
            return
        seconds_per_step = max((now - start) / (step - first), 1e-9)
        left = (self.minutes * 60 - (now - self._started)) * (1 - self.reserve)
        self._end_at(self._agree(max(step, min(self.latest_end, step + int(left / seconds_per_step)))))
        self._timed, self._timed_from = True, (step, now)

    def evaluates(self, step: int) -> bool:
        return step % self.eval_every == 0 or step == self.last_step

    def saves(self, step: int) -> bool:
        return step % self.save_every == 0 or step == self.last_step

    def resume(self, accelerator, checkpoints: Path, holdout_fingerprint: str, **load_kwargs) -> int:
        """Load the latest checkpoint under `checkpoints`, if any; returns the step it was saved at (0 if none).

        `holdout_fingerprint` names the rows this run holds out; it is saved with each checkpoint, and a checkpoint
        of a run that held out other rows (other seed, data, max_seq_len or held-out count) is refused: it may have
        trained on this run's held-out rows, whose figures would then read too good."""
        self.holdout_fingerprint = holdout_fingerprint
        latest = _latest_checkpoint(checkpoints)
        if latest is None:
            return 0
        if (done := int(latest.name.split("-")[-1])) > self.max_steps:  # (equal: the run is complete, nothing to do)
            raise ValueError(f"{latest} has trained {done} steps, more than max_steps={self.max_steps}: pass a larger "
                             "max_steps to train on, or leave it as it was to keep the run as it is.")
        saved = json.loads((latest / self.FILE).read_text()) if (latest / self.FILE).is_file() else {}
        if saved.get("holdout_fingerprint", holdout_fingerprint) != holdout_fingerprint:
            raise ValueError(f"{latest} held out other rows than this run would (its seed, holdout seed, data, "
                             "max_seq_len or held-out count differ): resume with the settings in its run's "
                             "train_config.json, or use a new output_dir.")
        accelerator.load_state(str(latest), **load_kwargs)
        if saved and saved["last_step"] < saved["max_steps"]:  # a run its budget cut: it keeps the cut
            self.latest_end = min(self.max_steps, saved["last_step"])
            self._end_at(self.latest_end)
        # the warm-up the run had: a cut may have shortened it (checkpoints saved before the plan kept it lack it)
        self.warmup_steps = min(self.warmup_steps, saved.get("warmup_steps", self.warmup_steps))
        return int(latest.name.split("-")[-1])

    def save_checkpoint(self, accelerator, checkpoints: Path, step: int, save_artifact) -> None:
        """Checkpoint (training state and this plan, the latest two kept), then `save_artifact()` on the main
        process."""
        accelerator.wait_for_everyone()
        folder = checkpoints / f"checkpoint-{step}"
        accelerator.save_state(str(folder))
        if accelerator.is_main_process:
            (folder / self.FILE).write_text(json.dumps({"last_step": self.last_step, "max_steps": self.max_steps,
                                                        "warmup_steps": self.warmup_steps,
                                                        "holdout_fingerprint": self.holdout_fingerprint}))
        _prune_checkpoints(checkpoints, keep=2)
        if accelerator.is_main_process:
            save_artifact()


def check_options(config, checks: dict[str, tuple[bool, str]]) -> None:
    """Refuse a config before any work: `checks` maps an option to (whether its value is valid, what it must be);
    the options every run has (batch size, steps, evaluation and save intervals, budget) are checked too."""
    checks = {
        "batch_size": (config.batch_size >= 1, ">= 1"),
        "gradient_accumulation_steps": (config.gradient_accumulation_steps >= 1, ">= 1"),
        "max_steps": (config.max_steps >= 1, ">= 1"),
        "warmup_steps": (config.warmup_steps >= 0, ">= 0"),
        "learning_rate": (0 < config.learning_rate < math.inf, "> 0"),
        "weight_decay": (0 <= config.weight_decay < math.inf, ">= 0"),
        "eval_every": (config.eval_every >= 1, ">= 1"),
        "save_every": (config.save_every >= 1, ">= 1"),
        "mixed_precision": (config.mixed_precision in MIXED_PRECISIONS, f"one of {MIXED_PRECISIONS}"),
        "time_budget_minutes": (config.time_budget_minutes is None or 0 < config.time_budget_minutes < math.inf,
                                "positive and finite, or None for no budget"),
        **checks,
    }
    wrong = [f"{name}={getattr(config, name)!r} (must be {rule})" for name, (valid, rule) in checks.items()
             if not valid]
    if wrong:
        raise ValueError("Invalid training options: " + "; ".join(wrong) + ".")


def start_run(config):
    """What both trainers do first: the step plan (its clock starts here, so the budget covers loading too), the
    accelerator, the seeds."""
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision=config.mixed_precision,
                              gradient_accumulation_steps=config.gradient_accumulation_steps)

    def earliest(last_step: int) -> int:  # every process decides at the same step, so this collective lines up
        return int(accelerator.gather(torch.tensor([last_step], device=accelerator.device)).min())

    plan = StepPlan(config.max_steps, config.warmup_steps, config.eval_every, config.save_every,
                    config.time_budget_minutes, agree=earliest)
    if config.warmup_steps >= config.max_steps and config.time_budget_minutes is None:  # (a budget shortens it)
        reach = ("reaches learning_rate={} only at the last step and never decays" if config.warmup_steps ==
                 config.max_steps else "never reaches learning_rate={}").format(config.learning_rate)
        warnings.warn(f"warmup_steps={config.warmup_steps} is not below max_steps={config.max_steps}: the learning "
                      f"rate rises for the whole run and {reach}. Pass --warmup-steps below --max-steps (e.g. "
                      f"{config.max_steps // 10}; 0 starts at learning_rate).", stacklevel=3)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    return plan, accelerator


def prepare(accelerator, plan: StepPlan, model: nn.Module, optimizer):
    """accelerate's wrapping of the model and optimizer (both trainers), and the learning-rate schedule of `plan`.

    The scheduler is left out of `prepare`, whose wrapper would step it once per process at each optimizer step (the
    schedule would end `num_processes` times too soon); the loop steps it once per optimizer step, and it is registered
    so that checkpoints hold it. Returns (scheduler, prepared model, prepared optimizer)."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, plan.lr_factor)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    return scheduler, prepared, optimizer


def fingerprint(holdout: list[dict]) -> str:
    """Which rows a run holds out, in 16 hex digits."""
    return hashlib.sha256(json.dumps([row["ids"] for row in holdout]).encode()).hexdigest()[:16]


# What a resumed run may set anew: how far it goes and how often it reports, where its files and data are read and
# written, the hardware's precision, and the seed of the batches still to come (the held-out rows are checked apart:
# `holdout_seed` keeps them). Any other setting shaped the checkpoint's parameters, its optimizer state (a new learning
# rate would be ignored, yet recorded as used), or the batches and losses of the steps it has run, which the run's
# train_config.json and model card describe as those of the whole run.
_RESUMABLE_CHANGES = frozenset({"max_steps", "time_budget_minutes", "eval_every", "save_every", "log_file", "data",
                                "output_dir", "mixed_precision", "seed", "holdout_seed"})


def check_resumable(output_dir: Path, config, shaping_fields: tuple[str, ...] = ()) -> None:
    """Checkpoints in `output_dir` resume only under the settings they were trained with (train_config.json), but
    for `_RESUMABLE_CHANGES`; every other change is listed at once. `shaping_fields` are named first."""
    previous_file = output_dir / "train_config.json"
    previous = json.loads(previous_file.read_text()) if previous_file.is_file() else {}
    names = [*shaping_fields, *(name for name in previous if name not in shaping_fields)]
    changed = {name: (previous[name], getattr(config, name)) for name in names
               if name in previous and name not in _RESUMABLE_CHANGES and hasattr(config, name)
               and previous[name] != getattr(config, name)}
    if changed:
        raise ValueError(f"{output_dir}/checkpoints were trained with other settings (before, now): {changed}. Resume "
                         f"with the settings in {previous_file} (only {', '.join(sorted(_RESUMABLE_CHANGES))} may "
                         "change), use a new output_dir, or delete the checkpoints to start over.")


def write_run_config(output_dir: Path, config) -> Path:
    """Record the run's settings in output_dir/train_config.json; returns the log file. A `log_file` given relative
    is recorded resolved: `hf-specdiff export` reads it from wherever it runs."""
    log_path = Path(config.log_file).resolve() if config.log_file else output_dir / "log.jsonl"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    recorded = {**config.to_dict(), "log_file": str(log_path) if config.log_file else None}
    (output_dir / "train_config.json").write_text(json.dumps(recorded, indent=2))
    return log_path


def split_holdout(sequences: list, config: TrainConfig) -> tuple[list, list]:
    """(held-out rows, training rows): a seeded shuffle, then the first `holdout_sequences` rows are kept out."""
    if len(sequences) <= config.holdout_sequences:
        raise ValueError(
            f"Only {len(sequences)} usable rows: need more than holdout_sequences={config.holdout_sequences}. Distill "
            "answers to more prompts (`hf-specdiff distill --limit`), or hold out fewer rows (--holdout-sequences)."
        )
    sequences = list(sequences)
    random.Random(config.seed if config.holdout_seed is None else config.holdout_seed).shuffle(sequences)
    return sequences[: config.holdout_sequences], sequences[config.holdout_sequences :]


def train(config: TrainConfig, target=None, tokenizer=None, progress: bool = True) -> Speculator:
    """Train (or resume) a speculator for `target`; returns it and writes `output_dir/speculator` and checkpoints."""
    from tqdm.auto import tqdm

    check_options(config, {
        "block_size": (config.block_size is None or config.block_size >= 2, ">= 2 (an anchor and a draft)"),
        "num_draft_layers": (config.num_draft_layers is None or config.num_draft_layers >= 1, ">= 1"),
        "refiner_rank": (config.refiner_rank is None or config.refiner_rank >= 1, ">= 1"),
        "anchors_per_sequence": (config.anchors_per_sequence >= 1, ">= 1"),
        "max_seq_len": (config.max_seq_len >= 3, ">= 3 (a prompt token and two answer tokens)"),
        "gamma": (config.gamma > 0, "> 0"),
        "holdout_sequences": (config.holdout_sequences >= 1, ">= 1 (the acceptance estimate reads them)"),
        "draft_vocab_size": (config.draft_vocab_size is None or config.draft_vocab_size >= 1, ">= 1"),
    })
    plan, accelerator = start_run(config)
    output_dir = Path(config.output_dir)

    # Everything that can be wrong is checked before the first step, the data before the target loads.
    sequences = read_sequences(config.data, config.max_seq_len)
    if target is None:
        from .embedded import load_target

        target = load_target(config.target, dtype=torch.float32, with_tokenizer=False)[0]
    check_vocabulary(sequences, target.get_input_embeddings().weight.shape[0])
    holdout, sequences = split_holdout(sequences, config)
    speculator, config = build_speculator(config, target)
    if config.draft_vocab_size is not None:
        answers = (row["ids"][row["answer_start"] :] for row in sequences)
        speculator.draft_vocab = top_tokens(answers, config.draft_vocab_size,
                                            always=target.generation_config.eos_token_id)  # EOS always draftable
    speculator = speculator.to(device=accelerator.device, dtype=torch.float32)
    target = target.to(accelerator.device)
    speculator.check_compatible(target, placement=False)
    pad_id = getattr(target.config.get_text_config(), "pad_token_id", None)  # (a VLM's lives in its text config)
    pad_id = 0 if pad_id is None else pad_id
    checkpoints = output_dir / "checkpoints"
    if _latest_checkpoint(checkpoints) is not None:
        check_resumable(output_dir, config, _SHAPING_FIELDS)

    trainer = SpeculatorTrainer(target, speculator, config)
    optimizer = torch.optim.AdamW(speculator.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    scheduler, prepared, optimizer = prepare(accelerator, plan, trainer, optimizer)
    step = plan.resume(accelerator, checkpoints, fingerprint(holdout))
    output_dir.mkdir(parents=True, exist_ok=True)
    log_path = write_run_config(output_dir, config)

    holdout_batch = collate(holdout, pad_id)
    bar = tqdm(total=plan.last_step, initial=step, desc="train",
               disable=not progress or not accelerator.is_main_process)
    estimate = {}
    while step < plan.last_step:
        trainer.train()
        for micro_step in range(config.gradient_accumulation_steps):
            with accelerator.accumulate(prepared):
                # seeded by (step, micro-step, process): a resumed run draws exactly the batches and anchors an
                # uninterrupted one would, and each GPU draws its own
                draw_seed = ((config.seed * 1_000_003 + step) * 1_009 + micro_step) * 101 + accelerator.process_index
                order = random.Random(draw_seed)
                rows = [sequences[order.randrange(len(sequences))] for _ in range(config.batch_size)]
                ids, mask, starts = (t.to(accelerator.device) for t in collate(rows, pad_id))
                generator = torch.Generator().manual_seed(draw_seed)
                with accelerator.autocast():
                    losses = prepared(ids, mask, starts, generator)
                accelerator.backward(losses["loss"])
                if accelerator.sync_gradients:  # clip the accumulated gradient, not each micro-batch's share
                    accelerator.clip_grad_norm_(speculator.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
        scheduler.step()
        step += 1
        plan.after_step(step)
        bar.total = plan.last_step
        record = {"step": step, "lr": scheduler.get_last_lr()[0], **{k: float(v.detach()) for k, v in losses.items()}}
        if plan.evaluates(step):
            trainer.eval()
            ids, mask, starts = (t.to(accelerator.device) for t in holdout_batch)
            estimate = trainer.estimate_tau(ids, mask, starts, torch.Generator().manual_seed(config.seed))
            record.update({f"tau_{k}": v for k, v in estimate.items()})
        if accelerator.is_main_process:
            with log_path.open("a") as log:
                log.write(json.dumps(record) + "\n")
        bar.set_postfix(loss=f"{record['loss']:.3f}", **{f"tau_{k}": f"{v:.2f}" for k, v in estimate.items()})
        bar.update(1)
        if plan.saves(step):
            plan.save_checkpoint(accelerator, checkpoints, step, lambda: save_speculator(speculator, output_dir, step))
    bar.close()
    return speculator.eval()


SAVED_STEP_FILE = "speculator_step.json"  # in the run folder: the step output_dir/speculator was saved at


def save_speculator(speculator: Speculator, output_dir: Path, step: int) -> None:
    """The artifact, then the step it is of: the log may run past it (a run killed between saves), and the model
    card's step count and held-out figures must be those of the weights it ships."""
    speculator.save_pretrained(output_dir / "speculator")
    (output_dir / SAVED_STEP_FILE).write_text(json.dumps({"step": step}) + "\n")


def _latest_checkpoint(folder: Path) -> Path | None:
    found = sorted(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1])) if folder.is_dir() else []
    return found[-1] if found else None


def _prune_checkpoints(folder: Path, keep: int) -> None:
    import shutil

    found = sorted(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    for old in found[:-keep]:
        shutil.rmtree(old)
