"""Model cards for speculators, rendered from `model_cards/speculator.md` with the facts of a training run and a
benchmark run (never typed by hand)."""

from __future__ import annotations

import json
from pathlib import Path
from string import Template


def _parameters(module) -> str:
    count = sum(p.numel() for p in module.parameters())
    return f"{count / 1e6:.2f}M"


def render_model_card(template: str | Path, speculator, train_config: dict, facts: dict) -> str:
    """Fill the template. `facts` supplies what only the caller knows: title, base_model, data_description,
    train_hardware, train_steps, holdout_estimate, measured (Markdown), bench_command, limitations, storage_dtype,
    and `earlier_training` (what a continued run's starting speculator went through; may be empty)."""
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
        "batch_size": train_config["batch_size"],
        "max_seq_len": train_config["max_seq_len"],
        "anchors_per_sequence": train_config["anchors_per_sequence"],
        "learning_rate": train_config["learning_rate"],
        "gamma": train_config["gamma"],
        "ce_weight": train_config["ce_weight"],
        "tv_weight": train_config["tv_weight"],
        "consistency_weight": train_config["consistency_weight"],
        "initialisation": _initialisation(train_config, facts.get("earlier_training", "")),
        **facts,
    }
    return Template(Path(template).read_text()).substitute(values)


def _initialisation(train_config: dict, earlier_training: str) -> str:
    if train_config.get("init_speculator"):
        earlier = f": {earlier_training}" if earlier_training else ""
        return f"Training continued from the speculator in `{train_config['init_speculator']}`{earlier}."
    if train_config.get("init_from_target_layer") is None:
        return "Draft layers initialised at random."
    return f"Draft layer initialised from the target's layer {train_config['init_from_target_layer']}."


def write_model_card(folder: str | Path, text: str) -> None:
    Path(folder, "README.md").write_text(text)


def load_train_config(run_dir: str | Path) -> dict:
    return json.loads(Path(run_dir, "train_config.json").read_text())
