"""Linear layers applied to a few rows (a verify forward's anchor and drafts, a drafter's block, a few draft read-outs),
in the fastest BLAS layout on the CPU.

A Linear multiplies M rows x by a weight W (N x K). `F.linear` computes x @ W^T. On the CPU, MKL's path for that
product with a few rows streams W from memory much more slowly than its single-row (matrix-vector) path: it re-packs
W into its blocked format on every call. Two remedies, measured side by side:

- **W packed once**, on Intel CPUs (`torch.ops.mkl._mkl_linear`, the path PyTorch's inductor takes for float32 CPU
  Linears of a fixed row count): MKL packs W for one row count M ahead of time, and each product with M rows reads
  the packed copy once. A loop knows the width it will call most (a verify forward's rows: the batch times the anchor
  and drafts; a drafter pass's block), so `FewRowLinears(packed_rows=M)` packs the weights it meets for that M on
  first use and reuses the packs in every later call, across `generate` calls: they live in a cache keyed weakly by
  the weight (freed with the model). Each context checks a weight's pack once against the weight's fingerprint (W @ r,
  one matrix-vector product: about half a plain decoding step per `generate` call, 23 ms on the Intel host) and packs
  it anew if the weight has changed. A pack costs a copy of the weight in memory for each row count kept (at most
  `MAX_PACKED_ROW_COUNTS` per weight, the least recently used dropped), and packing SmolLM2-135M's 211 Linear weights
  takes about 0.7 s on the 2-core hosts, once per row count.
- **(W @ x^T)^T**, for other row counts: one pass over W serves every row.

Ms per call, `python examples/linear_cost.py --rows 1 2 3 4 8 16 32 --threads 2` (MKL 2024.2, float32,
torch 2.13.0+cpu; 2-core Intel Xeon 2.6 GHz, 2026-12-03, `model_cards/results/smollm2-135m-cpu/mkl_packed/`):

    rows                                    1       2       3       4       8      16      32
    30 layers' projections    F.linear    21.8    24.3    26.7    51.0    71.2   102.0   114.8
    (SmolLM2-135M's 210)      (W@x^T)^T   25.7    49.7    51.2    51.1    52.6    49.8    71.6
                              packed W    26.2    26.4    29.7    29.9    29.6    42.6    48.5
    vocabulary read-out       F.linear     5.8     6.1     6.6    12.9    21.0    28.2    27.2
    (49152 x 576)             (W@x^T)^T    5.4    11.5    11.0    11.0    10.9    11.7    13.1
                              packed W     4.2     5.3     6.1     5.5     7.0     7.9    11.8

On a 2-core AMD EPYC the same script measured (W@x^T)^T at 26.8 ms for 4 rows' projections against 57.8 for F.linear
and 41.2 for one row (`model_cards/results/smollm2-135m-cpu/cpu_few_row_layout/linear_cost.txt`), and the packed
path slower than both (below). One weight timed alone stays in the cache and hides the difference: the projections
are timed as a forward meets them, 210 distinct weights in turn.

The speculator's own read-outs over the whole vocabulary call `linear` (the refiner's and the Markov head's); over a
draft vocabulary they multiply a transposed copy of its rows instead (`draft_vocab.DraftReadOut`).
The target's verify forwards and the drafter's passes, whose Linear layers belong to transformers' modules, run inside
`FewRowLinears`, a torch function mode that routes each `F.linear` call made while it is active through `linear`. It
changes nothing on the model and sees each call's own rows, so a model's logit post-processing (scaling, soft-capping)
runs as always. Its Python dispatch of every op in the forward costs about 7-10 ms on SmolLM2-135M. On the Intel host a
verify forward of 4 tokens over 256 cached ones took 62.1 ms with the weights packed, against 78.3 as transformers runs
it, 91.7 in the (W@x^T)^T layout and 42.7 for plain decoding's single token; of 16 tokens 77.7 against 135.5 and 98.9
(`python examples/verify_cost.py --widths 1 2 3 4 8 16 --repeats 10`, eager). Part of what is left is transformers
copying the grouped K/V heads (`repeat_kv`) whenever an attention mask is given, as it is for every forward of several
cached tokens: with transformers' own switch `TRANSFORMERS_SDPA_FORCE_GQA=1` a 4-token forward took about 16 ms less in
one comparison (a recorded A/B later could not separate it from the host's drift: `.../sdpa_force_gqa/`).
Every layout sums the same products in another order, as a forward of one token and one of several already do.
A forward compiled by torch.compile and called inside the mode is traced through it (dynamo guards on the mode stack,
so the same forward called outside the mode, as plain decoding calls it, keeps a graph of its own) and takes the
(W@x^T)^T layout: packs are made and looked up eagerly only. On the AMD host a compiled verify forward of 4 tokens took
44.4 ms that way instead of 92.7, against 60.5 ms for plain compiled decoding's single token
(`python examples/verify_cost.py --compile --widths 1 2 3 4 8 16 --repeats 12`).

**Packs only on Intel CPUs.** MKL's packed products are tuned for Intel's CPUs, not for an instruction set: on a
2-core AMD EPYC with AVX-512 (2026-12-04, same MKL and torch) they were slower than the transposed layout at every row
count from 2 to 32 (30 layers' projections, 4 rows: packed 61.9 ms, (W@x^T)^T 28.2, F.linear 49.9; 16 rows: 69.0,
43.9, 57.3), and a verify forward of 4 tokens took 95.6 ms with the weights packed, 59.1 in the transposed layout and
59.0 for plain decoding's single token (of 2 tokens 81.0 and 42.7; `verify_cost.txt` there). So `few_row_linears`
packs only where the CPU's vendor is GenuineIntel and takes the transposed layout elsewhere
(`model_cards/results/smollm2-135m-cpu/amd_layout/`: xpress with 3 drafts went from 0.90-0.94x to 1.42-1.48x of plain
generate on that host, eager).

Plain decoding's single row takes BLAS's matrix-vector path either way (`generate` without speculation is left as
transformers runs it). On CUDA and other devices, for other dtypes, for quantized weights (tensor subclasses
with kernels of their own), and where gradients are recorded, `linear` is `F.linear`.
"""

from __future__ import annotations

import contextlib
import functools
import platform
import sys
import threading
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

# One row takes BLAS's matrix-vector path, already a single pass over W. Up to 32 rows every run measured the
# transposed layout faster for read-outs and the projections as a whole (about even at 8 rows); beyond, not always.
MIN_ROWS, MAX_ROWS = 2, 32
# Row counts whose packs a weight keeps: a benchmark interleaving xpress, dflash and markov verifies at three widths.
MAX_PACKED_ROW_COUNTS = 4
# weight -> {row count: (the weight's fingerprint when packed, MKL's packed copy)}, least recently used first
_packs: WeakIdKeyDictionary = WeakIdKeyDictionary()
_packs_lock = threading.Lock()  # generate calls in several threads share the packs


def dense(*tensors: torch.Tensor) -> bool:
    """Whether the tensors are plain dense ones: a quantized weight (torchao's int8 or int4 tensors, and the like) is a
    tensor subclass with kernels of its own for `F.linear` only, and no other layout can multiply it."""
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


def packed_layout_pays(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` can multiply by MKL's packed copy of a weight: a float32 CPU parameter (a weight computed in the
    forward would be packed anew each call), in eager inference, with a PyTorch built with MKL."""
    return (
        not torch.compiler.is_compiling()
        and isinstance(weight, torch.nn.Parameter)
        and dense(x, weight)
        and x.dtype is weight.dtype is torch.float32
        and x.is_cpu
        and weight.dim() == 2
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and torch.backends.mkl.is_available()
    )


def fingerprint(weight: torch.Tensor) -> torch.Tensor:
    """W @ r for a fixed random r: changes with any change to W's values (with probability 1), at the cost of one
    matrix-vector product. Version counters would miss changes made through `.data` (as PEFT merges adapters, and as
    `module.half().float()` swaps the storage), which would leave a stale pack computing with the old weights."""
    probe = torch.randn(weight.shape[1], generator=torch.Generator().manual_seed(0), dtype=weight.dtype)
    return weight.detach() @ probe


class PackedWeights:
    """MKL's packed copies of weights for products with `rows` rows, for the life of one `FewRowLinears` context (one
    `generate` call). Packs outlive it in a cache keyed weakly by the weight (freed with the model), and each weight's
    pack is checked against the weight once per context by its fingerprint: re-made if the weight has changed."""

    def __init__(self, rows: int):
        self.rows = rows
        self.checked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (weight, its pack)

    def __getitem__(self, weight: torch.Tensor) -> torch.Tensor:
        weight_and_pack = self.checked.get(id(weight))
        if weight_and_pack is None:
            weight_and_pack = self.checked[id(weight)] = (weight, self._current_pack(weight))
        return weight_and_pack[1]

    def _current_pack(self, weight: torch.Tensor) -> torch.Tensor:
        now = fingerprint(weight)
        with _packs_lock:
            packs = _packs.get(weight)
            if packs is None:
                packs = _packs[weight] = OrderedDict()
            then, packed = packs.get(self.rows, (None, None))
            if then is None or not torch.equal(then, now):
                packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), self.rows)
                packs[self.rows] = (now, packed)
            packs.move_to_end(self.rows)
            while len(packs) > MAX_PACKED_ROW_COUNTS:
                packs.popitem(last=False)
            return packed


def transposed_layout_pays(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` computes x @ W^T as (W @ x^T)^T: a dense float32 CPU weight applied to MIN_ROWS..MAX_ROWS
    rows."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        dense(x, weight)
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.dim() == 2
        and MIN_ROWS <= rows <= MAX_ROWS
    )


def layout(x: torch.Tensor, weight: torch.Tensor, packs: PackedWeights | None = None) -> str:
    """The layout `linear` takes for x @ W^T: "packed" (W packed for x's rows in `packs`), "transposed" ((W @ x^T)^T)
    or "f.linear"."""
    if packs is not None and x.numel() == packs.rows * x.shape[-1] and packed_layout_pays(x, weight):
        return "packed"
    return "transposed" if transposed_layout_pays(x, weight) else "f.linear"


def linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packs: PackedWeights | None = None
) -> torch.Tensor:
    """`F.linear(input, weight, bias)` for input (..., K) and weight (N, K), in the fastest layout where it pays: with
    `packs.rows` rows, through the weight packed for that count."""
    taken = layout(input, weight, packs)
    if taken == "packed":
        return torch.ops.mkl._mkl_linear(input, packs[weight], weight, bias, packs.rows)
    if taken == "f.linear":
        return F.linear(input, weight, bias)
    # (M, N); the copy is M x N, a fraction of W, and measured faster overall than handing the transposed view on
    out = (weight @ input.reshape(-1, input.shape[-1]).T).T.contiguous()
    if bias is not None:
        out += bias
    return out.view(*input.shape[:-1], weight.shape[0])


class FewRowLinears(TorchFunctionMode):
    """While active (a `with` block), every `F.linear` call, `nn.Linear`'s included, runs as `linear`: in the faster
    layout where that pays, through weights packed for `packed_rows` rows where given, unchanged elsewhere. Torch
    function modes are per thread."""

    def __init__(self, packed_rows: int | None = None):
        super().__init__()
        self.packs = PackedWeights(packed_rows) if packed_rows else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            return linear(*args, **(kwargs or {}), packs=self.packs)
        return func(*args, **(kwargs or {}))


def cpuinfo_field(key: str) -> str:
    """The first value of `key` in Linux's /proc/cpuinfo ("model name", "vendor_id"), or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor id ("GenuineIntel", "AuthenticAMD", ...), or "" where it cannot be told. Linux: /proc/cpuinfo's;
    Windows names it in `platform.processor()`; every x86 Mac is an Intel one."""
    if vendor := cpuinfo_field("vendor_id"):
        return vendor
    processor = platform.processor()  # e.g. "Intel64 Family 6 Model 85 Stepping 7, GenuineIntel"
    for vendor in ("GenuineIntel", "AuthenticAMD"):
        if vendor in processor:
            return vendor
    return "GenuineIntel" if sys.platform == "darwin" and platform.machine() == "x86_64" else ""


def packing_pays_on_this_cpu() -> bool:
    """Whether MKL's packed products beat the transposed layout here: on Intel CPUs, where MKL runs its own tuned
    kernels. Elsewhere (an AMD CPU, one that cannot be told) it was measured slower at every row count (module
    docstring)."""
    return cpu_vendor() == "GenuineIntel" and torch.backends.mkl.is_available()


def few_row_linears(*models: torch.nn.Module, packed_rows: int | None = None) -> contextlib.AbstractContextManager:
    """A `FewRowLinears(packed_rows)` context where any of the models has float32 weights on the CPU, else one that
    does nothing (there `linear` is `F.linear`, and the mode would only cost its dispatch). Weights are packed only on
    an Intel CPU (`packing_pays_on_this_cpu`), and never for a model that accelerate dispatches or offloads: its hooks
    may hand each forward new weight tensors, each of which would be packed anew."""
    on_cpu_in_float32 = any(
        (p := next(model.parameters(), None)) is not None and p.device.type == "cpu" and p.dtype == torch.float32
        for model in models
    )
    if not packing_pays_on_this_cpu() or any(
        hasattr(module, "_hf_hook") for model in models for module in model.modules()
    ):
        packed_rows = None
    return FewRowLinears(packed_rows) if on_cpu_in_float32 else contextlib.nullcontext()
