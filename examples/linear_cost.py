"""Time one Linear layer of the embedded SmolLM2-135M's shapes by the number of rows it is applied to.

Why: on a CPU the verify forward of a few tokens costs much more than one token's forward (`verify_cost.py`). This
script shows where that comes from. It times the BLAS call behind each Linear for M = 1, 2, 3, ... rows:
- a decoder projection (576 -> 1536; each of the 30 layers runs 7 projections of this size);
- the vocabulary read-out (576 -> 49152), as transformers calls it (`F.linear`), and with two other layouts of the
  same product;
- a speculator's low-rank read-out (the refiner's and the Markov head's, rank 64 -> 49152) in both layouts that
  `hf_specdiff/_read_out.py` chooses between.

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
    projection = torch.randn(1536, 576)
    read_out = torch.randn(49152, 576)
    read_out_t = read_out.t().contiguous()
    low_rank = torch.randn(49152, 64)
    layouts = {
        "projection F.linear": lambda x: F.linear(x, projection),
        "read-out F.linear": lambda x: F.linear(x, read_out),
        "read-out x @ W^T (W^T stored)": lambda x: x @ read_out_t,
        "read-out (W @ x^T)^T": lambda x: (read_out @ x.t()).t(),
        "low-rank read-out F.linear": lambda x: F.linear(x[:, :64], low_rank),
        "low-rank read-out (W @ x^T)^T": lambda x: (low_rank @ x[:, :64].t()).t(),
    }
    print(f"ms per call, float32, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'':32}" + "".join(f"{'M=' + str(m):>9}" for m in args.rows))
    for name, fn in layouts.items():
        cells = []
        for rows in args.rows:
            x = torch.randn(rows, 576)
            cells.append(milliseconds(lambda: fn(x), args.repeats))
        print(f"{name:32}" + "".join(f"{c:9.2f}" for c in cells))


if __name__ == "__main__":
    main()
