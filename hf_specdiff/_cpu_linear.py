"""Linear layers applied to a few rows (a verify forward's anchor and drafts, a drafter's block, a few draft read-outs),
in the faster of the two BLAS layouts on the CPU.

A Linear multiplies M rows x by a weight W (N x K). `F.linear` computes x @ W^T. On the CPU, MKL's path for that
product with a few rows streams W from memory much more slowly than the same product in the other layout,
(W @ x^T)^T, whose one pass over W serves every row; it is even slower than its own single-row path. Ms per call,
`python examples/linear_cost.py --rows 1 2 3 4 8 16 32 64 --threads 2` (MKL 2024.2, 2-core AMD EPYC, float32,
2026-12-03; `model_cards/results/smollm2-135m-cpu/cpu_few_row_layout/linear_cost.txt`):

    rows                                    1       2       3       4       8      16      32      64
    30 layers' projections    F.linear    44.1    69.0    74.7    57.8    65.3    71.3   105.7   117.8
    (SmolLM2-135M's 210)      (W@x^T)^T   41.2    32.3    30.5    26.8    54.8    50.7    78.0   127.0
    vocabulary read-out       F.linear    10.7    24.1    36.3    18.2    22.3    29.7    33.4    48.1
    (49152 x 576)             (W@x^T)^T   13.0     4.7     7.9     6.2    14.5    18.1    24.9    38.8
    low-rank read-out         F.linear    0.51    0.62    1.08    2.79    3.15    3.45    5.28    8.03
    (49152 x 64)              (W@x^T)^T   0.32    0.72    1.03    0.63    1.12    0.84    1.50    2.75

(One weight timed alone stays in the cache and hides the difference: the projections are timed as a forward meets
them, 210 distinct weights in turn.) The speculator's own read-outs over the whole vocabulary call `linear` (the
refiner's and the Markov head's); over a draft vocabulary they multiply a transposed copy of its rows instead
(`draft_vocab.DraftReadOut`).
The target's verify forwards and the drafter's passes, whose Linear layers belong to transformers' modules, run inside
`FewRowLinears`, a torch function mode that routes each `F.linear` call made while it is active through `linear`. It
changes nothing on the model and sees each call's own rows, so a model's logit post-processing (scaling, soft-capping)
runs as always. Its Python dispatch of every op in the forward costs about 7 ms on SmolLM2-135M; with it, a verify
forward of 4 tokens over 256 cached ones took 88.7 instead of 115.4 ms, against 76.9 ms for plain decoding's single
token (`python examples/verify_cost.py --widths 1 2 3 4 8 16 --repeats 20`; about even at 8 tokens, 137 against 162 ms
at 16). Both layouts sum the same products in another order, as a forward of one token and one of several already do.
A forward compiled by torch.compile and called inside the mode is traced through it (dynamo guards on the mode stack,
so the same forward called outside the mode, as plain decoding calls it, keeps a graph of its own): the compiled
verify forward and draft step of the static loop take the layout too, with no per-op dispatch left to pay. A
compiled verify forward of 4 tokens took 44.4 instead of 92.7 ms, against 60.5 ms for plain compiled decoding's single
token (`python examples/verify_cost.py --compile --widths 1 2 3 4 8 16 --repeats 12`, another day than the figures
above).

Plain decoding's single row takes BLAS's matrix-vector path either way (padded to two rows it would gain too, the
table says; `generate` without speculation is left as transformers runs it, so part of a CPU speedup over it is this
layout rather than speculation). On CUDA and other devices, and for other dtypes, `linear` is `F.linear`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# One row takes BLAS's matrix-vector path, already a single pass over W. Up to 32 rows every run measured the
# transposed layout faster for read-outs and the projections as a whole (about even at 8 rows); beyond, not always.
MIN_ROWS, MAX_ROWS = 2, 32


def transposed_layout_pays(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` computes x @ W^T as (W @ x^T)^T: a float32 CPU weight applied to MIN_ROWS..MAX_ROWS rows."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.dim() == 2
        and MIN_ROWS <= rows <= MAX_ROWS
    )


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(input, weight, bias)` for input (..., K) and weight (N, K), in the faster layout where it pays."""
    if not transposed_layout_pays(input, weight):
        return F.linear(input, weight, bias)
    # (M, N); the copy is M x N, a fraction of W, and measured faster overall than handing the transposed view on
    out = (weight @ input.reshape(-1, input.shape[-1]).T).T.contiguous()
    if bias is not None:
        out += bias
    return out.view(*input.shape[:-1], weight.shape[0])


class FewRowLinears(TorchFunctionMode):
    """While active (a `with` block), every `F.linear` call, `nn.Linear`'s included, runs as `linear`: in the faster
    layout where that pays, unchanged elsewhere. Torch function modes are per thread."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            return linear(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def few_row_linears(*models: torch.nn.Module) -> contextlib.AbstractContextManager:
    """A `FewRowLinears` context where any of the models has float32 weights on the CPU, else one that does nothing
    (there `linear` is `F.linear`, and the mode would only cost its dispatch)."""
    on_cpu_in_float32 = any(
        (p := next(model.parameters(), None)) is not None and p.device.type == "cpu" and p.dtype == torch.float32
        for model in models
    )
    return FewRowLinears() if on_cpu_in_float32 else contextlib.nullcontext()
