"""Model cards for speculators (`model_cards/speculator.md`) and diffusion LM adapters (`model_cards/diffusion_lm.md`),
rendered with the facts of a training run and a benchmark run (never typed by hand)."""

from __future__ import annotations

import json
from pathlib import Path
from string import Template


# A card's Limitations section when the exporter gives none (`hf-specdiff export --limitations`): what holds for every
# artifact of its kind, so that no published card leaves the section empty.
SPECULATOR_LIMITATIONS = (
    "Acceptance and speed {measured} Prompts unlike the training data are drafted less well. It speculates for "
    "{base_model} only: with another target (a fine-tune included) its drafts are rarely accepted, and hf_specdiff "
    "warns when the target's embeddings are not the ones it was trained with. The output never depends on it: a "
    "rejected draft costs time, not correctness."
)
DIFFUSION_LIMITATIONS = (
    "Answer quality, forward passes and speed {measured} A masked diffusion LM adapted from a causal LM is usually "
    "the weaker model of the two: compare its answers with its base's before relying on them. Spiffy's savings depend "
    "on how confident the model is and on the prompts its graph was calibrated on; Spiffy never changes the output of "
    "the decoding it speeds up."
)


def _limitations(facts: dict, default: str) -> str:
    if facts.get("limitations"):
        return facts["limitations"]
    measured = ("were measured only as under Measured." if facts.get("bench_json")
                else "have not been measured yet (see Measured).")
    return default.format(measured=measured, base_model=facts["base_model"])


def load_target_lines(base_model: str, embedded: bool) -> str:
    """The card's usage lines that load the target: the embedded copy for a speculator trained on it (the weights it
    was trained with, offline), else the base model from the Hub."""
    if embedded:
        return "target, tokenizer = hf_specdiff.load_default_target()  # the embedded copy it was trained with"
    return (f"from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'target = AutoModelForCausalLM.from_pretrained("{base_model}")\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{base_model}")')


def _parameters(module) -> str:
    count = sum(p.numel() for p in module.parameters())
    return f"{count / 1e6:.2f}M"


def render_model_card(template: str | Path, speculator, train_config: dict, facts: dict) -> str:
    """Fill the template. `facts` supplies what only the caller knows: title, base_model, load_target (the usage
    lines that load it: `load_target_lines`), license, data_description, train_hardware, train_steps,
    holdout_estimate, measured (Markdown), bench_json (the bench quoted, if any), bench_command, limitations (empty:
    `SPECULATOR_LIMITATIONS`), storage_dtype, and `earlier_training` (what a continued run's starting speculator went
    through; may be empty)."""
    drafter = speculator.drafter.config
    values = {
        "block_size": drafter.block_size,
        "num_draft_layers": drafter.num_hidden_layers,
        "hidden_size": drafter.hidden_size,
        "target_layer_ids": drafter.layer_ids,
        "mask_token_id": drafter.mask_token_id,
        "drafter_params": _parameters(speculator.drafter),
        "rank": speculator.refiner.config.rank if speculator.refiner else "-",
        "num_jacobi_passes": speculator.refiner.config.num_jacobi_passes if speculator.refiner else "-",
        "refiner_params": _parameters(speculator.refiner) if speculator.refiner else "-",
        "markov_params": _parameters(speculator.markov_head) if speculator.markov_head else "-",
        "draft_vocab": "none: drafts are read out over the whole vocabulary" if speculator.draft_vocab is None else
        f"{len(speculator.draft_vocab):,} of the {drafter.vocab_size:,} tokens, those most frequent in the target's "
        "answers: the drafts are read out over them only (`draft_vocab.safetensors`)",
        "batch_size": train_config["batch_size"] * train_config.get("gradient_accumulation_steps", 1),
        "max_seq_len": train_config["max_seq_len"],
        "anchors_per_sequence": train_config["anchors_per_sequence"],
        "learning_rate": train_config["learning_rate"],
        "gamma": train_config["gamma"],
        "ce_weight": train_config["ce_weight"],
        "tv_weight": train_config["tv_weight"],
        "consistency_weight": train_config["consistency_weight"],
        "initialisation": _initialisation(train_config, facts.get("earlier_training", "")),
        **facts,
        "limitations": _limitations(facts, SPECULATOR_LIMITATIONS),
    }
    return Template(Path(template).read_text()).substitute(values)


def _initialisation(train_config: dict, earlier_training: str) -> str:
    if train_config.get("init_speculator"):
        earlier = f": {earlier_training}" if earlier_training else ""
        return f"Training continued from the speculator in `{train_config['init_speculator']}`{earlier}."
    if train_config.get("init_from_target_layer") is None:
        return "Draft layers initialised at random."
    return f"Draft layer initialised from the target's layer {train_config['init_from_target_layer']}."


def render_diffusion_model_card(template: str | Path, adapter_config: dict, weights: dict, train_config: dict,
                                log: list[dict], graph, facts: dict) -> str:
    """Fill the diffusion LM template. adapter_config / weights: the artifact's config.json and tensors; log: the
    training run's JSONL records; graph: its DraftGraph or None. `facts` as for `render_model_card` (title, base_model,
    license, data_description, train_hardware, measured, bench_json, bench_command, limitations (empty:
    `DIFFUSION_LIMITATIONS`), storage_dtype, and for a run that continued an `init_adapter`, `earlier_training`: what
    that adapter went through; may be empty)."""
    lora = adapter_config.get("lora")
    size_mb = sum(t.numel() * t.element_size() for t in weights.values()) / 1e6
    count = sum(t.numel() for t in weights.values()) / 1e6
    if lora:
        adapter = (f"LoRA of rank {lora['rank']} (alpha {lora['alpha']}) on {', '.join(lora['target_modules'])}, "
                   f"{count:.2f}M parameters in {facts['storage_dtype']} ({size_mb:.1f} MB)")
    else:
        adapter = (f"every layer's trained weights, {count:.1f}M parameters in {facts['storage_dtype']} "
                   f"({size_mb:.0f} MB)")
    if "mask_embedding" in weights:
        adapter += ", and the trained [MASK] input embedding row"
    diffusion = adapter_config["diffusion"]
    # step counts from the artifact: a log may run past the last save (a run killed in between), and a resumed run
    # logs the steps after its checkpoint twice
    run_steps = log[-1]["step"] if log else 0
    earlier_steps = adapter_config.get("continued_from_steps")
    if "trained_steps" in adapter_config:
        if earlier_steps is None:  # written before continued_from_steps existed
            earlier_steps = adapter_config["trained_steps"] - run_steps if train_config.get("init_adapter") else 0
        run_steps = adapter_config["trained_steps"] - earlier_steps
    evaluations = [r for r in log_of_saved_weights(log, run_steps) if "eval_accuracy" in r]

    def accuracy(record: dict) -> str:
        return f"{record['eval_accuracy']:.1%} (step {record['step']}, held-out loss {record['eval_loss']:.2f})"

    if graph is None:
        graph_text = "missing: calibrate one with `hf-specdiff calibrate`"
    else:
        calibration = graph.calibration
        graph_text = (f"its Spiffy draft graph: {len(graph)} nodes, calibrated on the model's own decoding of "
                      f"{calibration.get('prompts', '?')} prompts "
                      f"({', '.join(calibration.get('datasets', [])) or calibration.get('prompts_file', '?')})")
        if facts.get("graph_stale"):
            graph_text = (f"a Spiffy draft graph of {len(graph)} nodes calibrated on earlier weights of this folder, "
                          "not these: recalibrate it with `hf-specdiff calibrate` (Spiffy stays lossless with it, but "
                          "saves fewer forwards)")
    continued = train_config.get("init_adapter")
    if continued:
        earlier = f": {facts['earlier_training']}" if facts.get("earlier_training") else ""
        # the earlier adapter's folder was a path on the training machine: the card names its steps, not the path
        initialisation = f"Training continued an earlier adapter, trained for {earlier_steps} steps before{earlier}. "
        start_label = "at the start of this run (the earlier adapter)"
    else:
        initialisation, start_label = "", "before training"
    tags = ["masked-diffusion", "diffusion-llm", "spiffy", "speculative-decoding"] + (["lora"] if lora else [])
    values = {
        "tags": "\n".join(f"- {tag}" for tag in tags),
        "base": adapter_config.get("base"),
        "initialisation": initialisation,
        "shift_description": ("shifted logits: position i is predicted from output i - 1, as in the causal LM"
                              if diffusion["shift_logits"] else "unshifted logits"),
        "adapter_description": adapter,
        "graph_description": graph_text,
        "mask_eps": train_config["mask_eps"],
        "block_share_percent": round(100 * train_config["block_masking_share"]),
        "block_length": train_config["block_length"],
        "batch_size": train_config["batch_size"] * train_config.get("gradient_accumulation_steps", 1),
        "max_seq_len": train_config["max_seq_len"],
        "learning_rate": train_config["learning_rate"],
        "train_steps": run_steps,
        "holdout_start": f"{accuracy(evaluations[0])} {start_label}" if evaluations else "not measured",
        "holdout_end": accuracy(evaluations[-1]) if evaluations else "not measured",
        **facts,
        "limitations": _limitations(facts, DIFFUSION_LIMITATIONS),
    }
    return Template(Path(template).read_text()).substitute(values)


def write_model_card(folder: str | Path, text: str) -> None:
    Path(folder, "README.md").write_text(text)


def load_train_config(run_dir: str | Path) -> dict:
    path = Path(run_dir, "train_config.json")
    if not path.is_file():
        raise SystemExit(f"{run_dir} has no train_config.json: pass the output_dir of a training run.")
    return json.loads(path.read_text())


def default_template(name: str) -> Path:
    """model_cards/<name> of the hf_specdiff repository (the templates live beside the package, not in it)."""
    path = Path(__file__).resolve().parents[1] / "model_cards" / name
    if not path.is_file():
        raise SystemExit(f"No model card template at {path}: this hf_specdiff was installed without its repository's "
                         f"model_cards/; pass --template (e.g. a clone's model_cards/{name}).")
    return path


def load_train_log(run_dir: str | Path) -> list[dict]:
    """The run's log records, in order: its train_config's `log_file`, else <run_dir>/log.jsonl."""
    log_file = load_train_config(run_dir).get("log_file") or Path(run_dir, "log.jsonl")
    if not Path(log_file).is_file():
        raise SystemExit(f"{run_dir}: no training log at {log_file}; pass the output_dir of a training run.")
    lines = Path(log_file).read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def log_of_saved_weights(log: list[dict], saved_step: int | None) -> list[dict]:
    """The records of the steps the saved weights went through, one per step, in order: a log may run past the last
    save (a run killed in between), and a resumed run logs the steps after its checkpoint twice (the later record is
    the one its weights went through). `saved_step` None (a run from before it was recorded): the whole log."""
    records = {r["step"]: r for r in log if saved_step is None or r["step"] <= saved_step}
    return [records[step] for step in sorted(records)]

