"""Time the Linear layers of the embedded SmolLM2-135M's shapes by the number of rows they are applied to.

Why: on a CPU the verify forward of a few tokens costs much more than one token's forward (`verify_cost.py`). This
script shows where that comes from. It times the BLAS call behind each Linear for M = 1, 2, 3, ... rows, as
transformers calls it (`F.linear`, x @ W^T) and in the layouts that `hf_specdiff/_cpu_linear.py` chooses between:
(W @ x^T)^T, and W packed by MKL once for that M ("packed W", packed before the timing; NaN where PyTorch has no MKL):
- the decoder's projections: all 210 of the 30 layers (q, k, v, o, gate, up, down), each its own weight, so that
  they stream from memory as in a forward (one weight timed alone stays in the cache and hides that);
- the vocabulary read-out (576 -> 49152), and, as transformers calls it, with W^T stored instead (a copy of W);
- a speculator's low-rank read-out (the refiner's and the Markov head's, rank 64 -> 49152);
- both read-outs over an 8,192-token draft vocabulary (`hf_specdiff/draft_vocab.py`), whose rows are a copy, so that
  storing it transposed costs nothing: `DraftReadOut` computes x @ W^T with W^T stored.

    python examples/linear_cost.py [--rows 1 2 3 4 8 16] [--repeats 20] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def milliseconds(fn, repeats: int) -> float:
    for _ in range(3):  # warm-up
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # per layer
    projections = [torch.randn(out_features, in_features) for _ in range(30) for out_features, in_features in shapes]
    read_out = torch.randn(49152, 576)
    read_out_t = read_out.t().contiguous()
    low_rank = torch.randn(49152, 64)
    draft, draft_low_rank = torch.randn(8192, 576), torch.randn(8192, 64)
    draft_t, draft_low_rank_t = draft.t().contiguous(), draft_low_rank.t().contiguous()
    packs = {}  # MKL's packed copies by weight and row count, made before the timing

    def packed(weight, x):
        key = (id(weight), len(x[576]))
        if key not in packs:
            packs[key] = torch.ops.mkl._mkl_reorder_linear_weight(weight, len(x[576]))
        return packs[key]

    layouts = {
        "30 layers' projections F.linear": lambda x: [F.linear(x[w.shape[1]], w) for w in projections],
        "30 layers' projections (W@x^T)^T": lambda x: [(w @ x[w.shape[1]].t()).t() for w in projections],
        "30 layers' projections packed W": lambda x: [
            torch.ops.mkl._mkl_linear(x[w.shape[1]], packed(w, x), w, None, len(x[576])) for w in projections
        ],
        "read-out F.linear": lambda x: F.linear(x[576], read_out),
        "read-out x @ W^T (W^T stored)": lambda x: x[576] @ read_out_t,
        "read-out (W @ x^T)^T": lambda x: (read_out @ x[576].t()).t(),
        "read-out packed W": lambda x: torch.ops.mkl._mkl_linear(
            x[576], packed(read_out, x), read_out, None, len(x[576])
        ),
        "low-rank read-out F.linear": lambda x: F.linear(x[64], low_rank),
        "low-rank read-out (W @ x^T)^T": lambda x: (low_rank @ x[64].t()).t(),
        "draft read-out F.linear": lambda x: F.linear(x[576], draft),
        "draft read-out x @ W^T (stored)": lambda x: x[576] @ draft_t,
        "draft read-out (W @ x^T)^T": lambda x: (draft @ x[576].t()).t().contiguous(),
        "draft low-rank F.linear": lambda x: F.linear(x[64], draft_low_rank),
        "draft low-rank x @ W^T (stored)": lambda x: x[64] @ draft_low_rank_t,
        "draft low-rank (W @ x^T)^T": lambda x: (draft_low_rank @ x[64].t()).t().contiguous(),
    }  # x: the M input rows by their width
    print(f"ms per call, float32, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'':34}" + "".join(f"{'M=' + str(m):>9}" for m in args.rows))
    for name, fn in layouts.items():
        cells = []
        for rows in args.rows:
            x = {width: torch.randn(rows, width) for width in (64, 576, 1536)}
            if "packed" in name and not torch.backends.mkl.is_available():
                cells.append(float("nan"))
                continue
            fn(x)  # packs, where the layout needs them
            cells.append(milliseconds(lambda: fn(x), args.repeats))
        print(f"{name:34}" + "".join(f"{c:9.2f}" for c in cells))


if __name__ == "__main__":
    main()
