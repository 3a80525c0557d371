"""Sampling with speculation follows the target's distribution exactly.

The reference is exact, not another sample: on a 6-token vocabulary we enumerate every continuation of the
prompt and compute its probability under the target (with the same warpers). Speculative samples are then tested
against it with a chi-square goodness-of-fit test. A deliberately broken verifier (accepting every draft token)
must fail the same test: that negative control shows the test has the power to catch a lossy verifier.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import make_speculator, make_successor_target

import hf_specdiff
import hf_specdiff.generation

VOCAB, NEW_TOKENS, DRAWS = 6, 4, 3000
PROMPT = torch.tensor([[1, 2, 3]])


def exact_distribution(target, temperature: float, top_k: int | None) -> dict[tuple, float]:
    """P(t1..tn | PROMPT) for every continuation, through the warpers generate applies."""
    def warped_probs(sequences: torch.Tensor) -> torch.Tensor:
        logits = target(sequences).logits[:, -1].float() / temperature
        if top_k is not None:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return logits.softmax(-1)

    probabilities = {(): 1.0}
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            prefixes = list(probabilities)
            batch = torch.cat([PROMPT.repeat(len(prefixes), 1), torch.tensor(prefixes, dtype=torch.long).view(len(prefixes), -1)], 1)
            probs = warped_probs(batch)
            probabilities = {
                prefix + (token,): probabilities[prefix] * float(probs[row, token])
                for row, prefix in enumerate(prefixes)
                for token in range(VOCAB)
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
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)))


def draw(target, speculator, method, temperature, top_k, draws=DRAWS):
    counts: dict[tuple, int] = {}
    accepted = drafted = 0
    for _ in range(draws):
        out = target.generate(
            PROMPT, do_sample=True, temperature=temperature, top_k=top_k, max_new_tokens=NEW_TOKENS,
            assistant_model=speculator, speculation=method, return_dict_in_generate=True,
        )
        outcome = tuple(out.sequences[0, PROMPT.shape[1]:].tolist())
        counts[outcome] = counts.get(outcome, 0) + 1
        accepted += out.speculation.accepted_tokens
        drafted += out.speculation.drafted_tokens
    return counts, accepted / max(drafted, 1)


@pytest.fixture(scope="module")
def setup():
    target = hf_specdiff.enable(make_successor_target(vocab_size=VOCAB, layer_scale=3.0, logit_scale=0.6))
    # The oracle add-ons propose t -> t + 1, which the target favours but not always: drafts are accepted often and
    # rejected often, so acceptance, residual resampling and bonus draws are all exercised.
    return target, make_speculator(target, block_size=4, oracle=True, strength=1.2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "method,temperature,top_k", [("xpress", 1.0, None), ("markov", 1.0, None), ("dflash", 1.0, None), ("xpress", 0.7, 4)]
)
def test_speculative_sampling_matches_target_distribution(setup, method, temperature, top_k):
    target, speculator = setup
    torch.manual_seed(0)
    counts, acceptance = draw(target, speculator, method, temperature, top_k)
    if method != "dflash":
        assert 0.2 < acceptance < 0.95, f"the test should exercise both acceptance and rejection, got {acceptance:.2f}"
    p_value = chi_square_p_value(counts, exact_distribution(target, temperature, top_k), DRAWS)
    assert p_value > 1e-3, f"{method}: speculative samples do not follow the target (p={p_value:.2e})"


@pytest.mark.slow
def test_negative_control_broken_verifier_is_caught(setup, monkeypatch):
    def accept_everything(target_scores, draft_scores, candidates):
        bonus = torch.multinomial(target_scores[:, candidates.shape[1]].softmax(-1), 1)
        return torch.cat([candidates, bonus], dim=1), torch.full_like(bonus[:, 0], candidates.shape[1])

    monkeypatch.setattr(hf_specdiff.generation, "verify_sampling", accept_everything)
    target, speculator = setup
    torch.manual_seed(0)
    counts, _ = draw(target, speculator, "xpress", 1.0, None)
    p_value = chi_square_p_value(counts, exact_distribution(target, 1.0, None), DRAWS)
    assert p_value < 1e-6, f"a verifier that accepts every draft must be detected, got p={p_value:.2e}"
