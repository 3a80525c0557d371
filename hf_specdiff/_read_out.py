"""Vocabulary read-outs of a few rows (the speculator's drafts, the target's verified positions), in the faster of
the two BLAS layouts on the CPU.

A read-out multiplies M hidden states by a vocabulary-sized weight W (V x H, V >> H). `F.linear` computes x @ W^T.
On the CPU, MKL's path for that product with a few rows costs about one single-row product per row, while the same
product in the other layout, (W @ x^T)^T, makes one pass over W for all of them. Ms per call,
`python examples/linear_cost.py --rows 1 2 3 4 8 16 32 64 --threads 2` (MKL 2024.2, 2-core AMD EPYC, float32):

    rows                        1      2      3      4      8     16     32     64
    W 49152 x 576  F.linear   8.3   18.0   27.3   18.7   18.9   21.3   26.5   38.7
                   W @ x^T    8.3    4.9    6.2    5.1    8.9   13.9   18.4   28.0
    W 49152 x 64   F.linear  0.48   0.71   1.05   0.93   1.08   1.75   2.86   4.57
                   W @ x^T   0.44   0.49   0.72   0.69   1.25   0.82   1.52   2.94

The drafter reads its draft slots out through the target's lm_head (the first shape; B - 1 rows, or
`num_draft_tokens`), the refiner and the Markov head through their low-rank read-outs (the second), so `read_out`
serves all three. Both layouts sum the same products, in another order.

The target's verify forward reads out its few verified positions the same way, without changing the model: the loop
asks the forward for the logits of no position (`logits_to_keep`, a transformers forward argument) and reads them out
of the last hidden state itself (`reads_out_last_hidden_state` says where that is the model's own computation). A
verify forward over 256 cached tokens of SmolLM2-135M, median ms, the two interleaved
(`python examples/verify_cost.py --widths 1 2 3 4 8 16 --repeats 20`, 2026-12-02):

    width (anchor + drafts)     1      2      3      4      8     16
    model's read-out         79.2  132.5  155.0  128.7  131.4  156.1
    loop's read-out          77.2  109.9  128.1  107.7  120.8  141.8

The target's logits so differ from its own read-out's only in the order the same products are summed, as they
already differ between a forward of one token and of several.

(An earlier try reached the model's read-out through a `TorchFunctionMode` around the forward; its Python dispatch of
every op cost about as much as the layout saved.) The decoder's projections (576 x 1536 and smaller) gain nothing
from the other layout. On CUDA and other devices, and for other dtypes, `F.linear` runs as always.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# One row takes BLAS's matrix-vector path, already a single pass over W. Up to 32 rows every run measured the transposed
# layout faster; at 64 an earlier run found the low-rank read-out slower in it (17.6 against 11.7 ms).
MIN_ROWS, MAX_ROWS = 2, 32
_VOCABULARY_ASPECT = 16  # a weight at least this many times taller than wide is a read-out


def transposed_layout_pays(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `read_out` computes x @ W^T as (W @ x^T)^T: a float32 CPU read-out of MIN_ROWS..MAX_ROWS rows."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and MIN_ROWS <= rows <= MAX_ROWS
        and weight.dim() == 2
        and weight.shape[0] >= _VOCABULARY_ASPECT * weight.shape[1]
    )


def read_out(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x (..., H) and weight (V, H), in the faster layout where it pays."""
    if not transposed_layout_pays(x, weight):
        return F.linear(x, weight, bias)
    logits = (weight @ x.reshape(-1, x.shape[-1]).T).T.contiguous()  # (M, V); the copy is M x V, a fraction of W
    if bias is not None:
        logits += bias
    return logits.view(*x.shape[:-1], weight.shape[0])


def module_read_out(lm_head: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`lm_head(x)` through `read_out` where `lm_head` is a plain `nn.Linear` (anything else is called as is)."""
    if type(lm_head) is torch.nn.Linear:
        return read_out(x, lm_head.weight, lm_head.bias)
    return lm_head(x)


@torch.no_grad()
def reads_out_last_hidden_state(model, outputs) -> bool:
    """Whether the speculative loop may skip `model`'s own read-out in its verify forwards and compute the logits as
    `module_read_out(head, last hidden state)`: only for a float32 CPU model (elsewhere `read_out` is `F.linear`,
    nothing to gain) with a plain `nn.Linear` head, and only where `outputs`, the prefill forward's (with hidden
    states), shows that its logits are exactly that head on the last hidden state. A model that scales, soft-caps or
    otherwise post-processes its logits fails the check and keeps its own read-out."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.weight.device.type != "cpu" or head.weight.dtype != torch.float32:
        return False
    if outputs.logits is None or not outputs.logits.shape[1] or not outputs.hidden_states:
        return False
    last = outputs.hidden_states[-1][:, -1:]  # left padding: every row's last position is a real token
    expected = F.linear(last, head.weight, head.bias)
    return expected.shape == outputs.logits[:, -1:].shape and torch.allclose(
        expected, outputs.logits[:, -1:].float(), rtol=1e-4, atol=1e-4
    )
