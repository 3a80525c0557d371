"""Tiny models for the invariants: a random target (drafts almost never accepted), a "successor" target whose
greedy continuation is mostly t -> t + 1 (drafts often accepted), and oracle add-ons that propose t -> t + 1."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the Hub; set before huggingface_hub is imported

import pytest
import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, LlamaConfig, LlamaForCausalLM

import hf_specdiff
from hf_specdiff import AutoSpeculator

VOCAB = 64


def make_target(vocab_size=VOCAB, hidden_size=64, num_layers=3, dtype=torch.float64, seed=0, eos_token_id=None,
                config_class=LlamaConfig, model_class=LlamaForCausalLM, **config_fields):
    """A Llama by default; another family (its module names as Llama's) with `config_class` and `model_class`."""
    torch.manual_seed(seed)
    config = config_class(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=0, eos_token_id=eos_token_id, pad_token_id=0, tie_word_embeddings=False, **config_fields,
    )
    return model_class(config).to(dtype).eval()


def successor(vocab_size: int) -> torch.Tensor:
    """(V, V) matrix with a 1 at [t + 1, t]: maps token t to t + 1 (mod V)."""
    return torch.roll(torch.eye(vocab_size), shifts=1, dims=0)


def make_successor_target(layer_scale=12.0, logit_scale=1.0, vocab_size=VOCAB, **kwargs):
    """Residual stream = one-hot(token) + attention/MLP noise; lm_head reads token t as t + 1. The layers' output
    projections are scaled up so that context sometimes overrides the successor rule."""
    target = make_target(vocab_size=vocab_size, hidden_size=max(vocab_size, 8), **kwargs)
    with torch.no_grad():
        target.model.embed_tokens.weight.copy_(torch.eye(vocab_size, target.config.hidden_size))
        target.lm_head.weight.copy_(logit_scale * torch.eye(vocab_size, target.config.hidden_size).roll(1, dims=0))
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(layer_scale)
            if hasattr(layer, "mlp"):  # (Llama 4's layers have experts instead: their attention's noise serves)
                layer.mlp.down_proj.weight.mul_(layer_scale)
    return target


# Targets whose layers keep a state instead of (or beside) per-token K/V: Qwen3.5's gated-delta-net linear attention,
# Bamba's Mamba 2 mixer (recurrent states), LFM2's short convolutions (a conv state only), Mamba (every layer a state,
# no attention). Weights drawn 10x wider than the default, so that a state left holding rejected drafts changes the
# greedy tokens. {family: (config class, model class, config fields)}
STATE_FAMILIES = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        layer_types=["linear_attention", "full_attention", "linear_attention"], head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)),
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(
        attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1)),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(layer_types=["conv", "full_attention", "conv"])),
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(state_size=8)),
    # Nemotron-H: Mamba 2, attention, and layers that do neither (MoE, MLP: "dummy" cache layers)
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        hybrid_override_pattern="ME*-", num_layers=4, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
        n_groups=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, experts_implementation="eager")),
    # Zamba 2: Mamba 2 layers and hybrid ones (a shared attention block before the Mamba 2 mixer), whose time step is
    # clamped when a forward scans its tokens in chunks (the prompt), not when it scans them one by one
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM", dict(
        num_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], n_mamba_heads=4, mamba_headdim=32,
        mamba_d_state=16, mamba_ngroups=1, use_mamba_kernels=False)),
    # and sliding-window layers (window 5, shorter than a block): LFM3's conv layers, Lara-mini's linear attention,
    # Inkling's layers that keep a state and K/V, and whose attention counts distances in cache slots (their experts
    # run eagerly: grouped matmuls take no float64)
    "lfm3": ("Lfm3Config", "Lfm3ForCausalLM", dict(
        layer_types=["conv", "sliding_attention", "full_attention"], sliding_window=5, head_dim=16)),
    "lara_mini": ("LaraMiniConfig", "LaraMiniForCausalLM", dict(
        layer_types=["linear_attention", "sliding_attention", "full_attention"], sliding_window=5, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        experts_implementation="eager")),
    "inkling": ("InklingTextConfig", "InklingForCausalLM", dict(
        layer_types=["hybrid", "hybrid_sliding", "hybrid"], sliding_window_size=5, head_dim=16, swa_head_dim=16,
        swa_num_attention_heads=4, swa_num_key_value_heads=2, d_rel=4, rel_extent=16, n_routed_experts=2,
        num_experts_per_tok=1, n_shared_experts=1, moe_intermediate_size=32, logits_mup_width_multiplier=1.0,
        experts_implementation="eager")),
}
CONV_STATE_FAMILIES = {"lfm2", "lfm3"}  # a conv state only, which every supported transformers rolls back


def make_state_target(family: str, **kwargs):
    import transformers

    config_name, model_name, fields = STATE_FAMILIES[family]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    return hf_specdiff.enable(make_target(
        initializer_range=0.2, config_class=getattr(transformers, config_name),
        model_class=getattr(transformers, model_name), **fields, **kwargs,
    ))


def replay_greedy_drafts(monkeypatch, sequences: list[torch.Tensor], pad_token_id: int = 0):
    """Drafts that are plain greedy's own next tokens, wrong from a slot on (or not at all) that the row's tokens so far
    pick: every accepted length occurs, so the target is rolled back by every depth from none to a whole block, and a
    row meets the same drafts in a batch as alone. `sequences`: each prompt's plain greedy output (1D, no padding);
    a row's tokens (left padding stripped) pick the one they begin."""
    from hf_specdiff.candidates import BlockDiffusionCandidateGenerator

    original = BlockDiffusionCandidateGenerator.get_candidates

    def replaying(self, input_ids, *args, rows=None, **kwargs):
        candidate_ids, q = original(self, input_ids, *args, rows=rows, **kwargs)
        if q is None:
            return candidate_ids, q
        lengths = rows.lengths if rows is not None else [input_ids.shape[1]] * input_ids.shape[0]
        for row, length in enumerate(lengths):
            tokens = input_ids[row, :length]
            tokens = tokens[int((tokens != pad_token_id).nonzero()[0, 0]):]  # left padding stripped
            continued = [s for s in sequences if len(s) >= len(tokens) and torch.equal(s[: len(tokens)], tokens)]
            assert continued, f"speculation left plain greedy's output: no prompt's continues {tokens.tolist()}"
            sequence = continued[0]
            drafts = sequence[len(tokens) : len(tokens) + q.shape[1]].clone()
            wrong_from = hash(tuple(tokens.tolist())) % (self.max_drafts + 1)
            drafts[wrong_from:] = (drafts[wrong_from:] + 1) % VOCAB
            candidate_ids[row, length : length + len(drafts)] = drafts
        return candidate_ids, q

    monkeypatch.setattr(BlockDiffusionCandidateGenerator, "get_candidates", replaying)


def make_speculator(target, block_size=8, oracle=False, strength=6.0, num_jacobi_passes=4, seed=1):
    vocab = target.config.vocab_size
    spec = AutoSpeculator.from_target(target, block_size=block_size, num_draft_layers=2, refiner_rank=vocab, seed=seed)
    spec.refiner.config.num_jacobi_passes = num_jacobi_passes
    if oracle:  # both add-ons propose prev + 1, overriding the random drafter
        with torch.no_grad():
            eye, succ = torch.eye(vocab), successor(vocab)
            spec.markov_head.w1.weight.copy_(eye * strength)
            spec.markov_head.w2.weight.copy_(succ * strength)
            refiner = spec.refiner
            refiner.down_h.weight.zero_()
            refiner.down_g.weight.zero_()
            refiner.w1.weight.copy_(eye * strength)
            refiner.in_proj.weight.zero_()
            refiner.in_proj.weight[:, 2 * vocab :].copy_(eye)
            refiner.down.weight.zero_()
            refiner.w2.weight.copy_(succ * strength)
    return spec


@pytest.fixture
def random_target():
    return hf_specdiff.enable(make_target())


@pytest.fixture
def successor_target():
    return hf_specdiff.enable(make_successor_target())


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow (minutes on a 2-core CPU)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def require_bench_data():
    from hf_specdiff.bench import find_data_dir

    try:
        find_data_dir(None)
    except FileNotFoundError:
        pytest.skip("benchmark data (shared/data) not available")


def require_cpu_compiler():
    """torch.compile on the CPU (inductor) builds C++: skip where no compiler is installed."""
    import shutil

    if not any(shutil.which(name) for name in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++")):
        pytest.skip("torch.compile on the CPU needs a C++ compiler (g++ / clang++), and none is installed")


def small_dlm_with_smollm_tokenizer(folder, base_folder=None):
    """A small random diffusion LM (Dream-style shifted logits) with SmolLM2's real tokenizer, saved to `folder`
    with the tokenizer (and the causal LM it was made from to `base_folder`); returns the tokenizer. For end-to-end
    runs of the calibrate and bench commands."""
    from transformers import AutoTokenizer

    from hf_specdiff.diffusion import DiffusionLM
    from hf_specdiff.embedded import default_target_path

    tokenizer = AutoTokenizer.from_pretrained(default_target_path())
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    DiffusionLM.from_causal_lm(base, mask_token_id=16, shift_logits=True).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if base_folder is not None:
        base.save_pretrained(base_folder)
    return tokenizer


# -- exact references for the sampling tests ------------------------------------------------------------------------


def char_tokenizer():
    """A tokenizer whose token t is the character chars[t] (64 of them), for stop strings on the tiny targets."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ+-"
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="0")


def make_sampling_pair(vocab_size: int = 6):
    """A target on a tiny vocabulary and an oracle speculator (block 4) for the sampling tests. The oracle add-ons
    propose t -> t + 1, which the target favours but not always: drafts are accepted often and rejected often, so
    acceptance, residual resampling and bonus draws are all exercised."""
    target = hf_specdiff.enable(make_successor_target(vocab_size=vocab_size, layer_scale=3.0, logit_scale=0.6))
    return target, make_speculator(target, block_size=4, oracle=True, strength=1.2)


def accept_every_draft(target_scores, draft_scores, candidates):
    """A broken `verify_sampling` for the negative controls: it keeps every draft token and draws the bonus from the
    target, so the output leans towards the drafter's distribution; the sampling tests must catch it."""
    bonus = torch.multinomial(target_scores[:, candidates.shape[1]].softmax(-1), 1)
    return torch.cat([candidates, bonus], dim=1), torch.full_like(bonus[:, 0], candidates.shape[1])


def exact_distribution(target, prompt: torch.Tensor, new_tokens: int, temperature: float = 1.0,
                       top_k: int | None = None, processors=None) -> dict[tuple, float]:
    """P(t1..tn | prompt) (prompt: (1, L)) for every continuation of `new_tokens` tokens, through what generate applies:
    `processors` (a LogitsProcessorList, each seeing the whole prefix), then temperature and top-k. An exact reference,
    not another sample."""
    def warped_probs(sequences: torch.Tensor) -> torch.Tensor:
        logits = target(sequences).logits[:, -1].float()
        if processors is not None:
            logits = processors(sequences, logits)
        logits = logits / temperature
        if top_k is not None:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return logits.softmax(-1)

    probabilities = {(): 1.0}
    with torch.no_grad():
        for _ in range(new_tokens):
            prefixes = list(probabilities)
            suffix = torch.tensor(prefixes, dtype=torch.long).view(len(prefixes), -1)
            probs = warped_probs(torch.cat([prompt.repeat(len(prefixes), 1), suffix], 1))
            probabilities = {
                prefix + (token,): probabilities[prefix] * float(probs[row, token])
                for row, prefix in enumerate(prefixes)
                for token in range(probs.shape[-1])
                if probs[row, token] > 0
            }
    return probabilities


def chi_square_p_value(counts: dict[tuple, int], expected_probs: dict[tuple, float], draws: int) -> float:
    """Pearson chi-square with cells of expected count < 5 pooled into one."""
    cells, pooled_observed, pooled_expected = [], 0, 0.0
    for outcome, probability in expected_probs.items():
        expected = probability * draws
        if expected < 5:
            pooled_observed += counts.get(outcome, 0)
            pooled_expected += expected
        else:
            cells.append((counts.get(outcome, 0), expected))
    unexpected = sum(n for outcome, n in counts.items() if outcome not in expected_probs)
    pooled_observed += unexpected
    if pooled_expected > 0:
        cells.append((pooled_observed, max(pooled_expected, 1e-12)))
    elif unexpected:
        return 0.0  # an outcome of probability zero was drawn
    statistic = sum((observed - expected) ** 2 / expected for observed, expected in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def card_limitations(card: str) -> str:
    """The paragraph under a model card's "Limitations and intended use" heading."""
    return card.split("## Limitations and intended use\n\n", 1)[1].split("\n\n", 1)[0]


def make_vision_language_target():
    """Gemma 3 with a vision tower: images of 28 x 28 pixels, 4 soft tokens each (`GEMMA3_IMAGE`)."""
    torch.manual_seed(0)
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=5, pad_token_id=0, bos_token_id=2, eos_token_id=None,
                layer_types=["sliding_attention", "full_attention"] * 2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
                          boi_token_index=297, eoi_token_index=298)
    model = Gemma3ForConditionalGeneration(config)
    # Gemma 3 initialises the image projection to zeros: every image would read the same
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.5)
    return hf_specdiff.enable(model.double().eval())


GEMMA3_IMAGE = [297, 299, 299, 299, 299, 298]  # Gemma 3's start of image, its 4 soft tokens, end of image


def random_images(count: int) -> torch.Tensor:
    return torch.randn(count, 3, 28, 28, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
