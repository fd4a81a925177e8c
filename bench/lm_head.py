"""The LM head's matmul on CPU: oneDNN pre-packed (whole, or in vocabulary chunks) vs F.linear on the dense
weight, for float32 and bfloat16 at 1/32/256 rows, interleaved round by round so a busy machine hits all alike.

python -m bench.lm_head [--vocab 151936] [--hidden 256,1024] [--rows 1,32,256] [--rounds 5]
One JSON line per (hidden, dtype, rows): median ms of each form and packed / F.linear.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from bench.checkpoints import rev


def packed_linear(x: torch.Tensor, packed: list[torch.Tensor]) -> torch.Tensor:
    if len(packed) == 1:
        return torch.ops.mkldnn._linear_pointwise(x, packed[0], None, "none", [], "")
    return torch.cat([torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed], dim=-1)


def can_pack(dtype: torch.dtype) -> bool:
    try:
        w = torch.ones(8, 8, dtype=dtype)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype),
                                                 torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
        return bool(torch.allclose(out.float(), torch.full((2, 8), 8.0)))
    except (AttributeError, RuntimeError):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", default="256,1024")
    parser.add_argument("--rows", default="1,32,256")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--chunks", type=int, default=8, help="Vocabulary chunks of the chunk-packed form.")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    for hidden in map(int, args.hidden.split(",")):
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            weight = torch.randn(args.vocab, hidden).to(dtype)
            forms = {"linear": lambda x: F.linear(x, weight)}
            if can_pack(dtype):
                whole = [torch.ops.mkldnn._reorder_linear_weight(weight)]
                chunked = [torch.ops.mkldnn._reorder_linear_weight(c.contiguous())
                           for c in weight.chunk(args.chunks)]
                forms["packed"] = lambda x: packed_linear(x, whole)
                forms["packed_chunks"] = lambda x: packed_linear(x, chunked)
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, hidden).to(dtype)
                ref = forms["linear"](x).float()
                for fn in forms.values():  # warm up, and check each form gives the same logits
                    torch.testing.assert_close(fn(x).float(), ref, atol=1e-2, rtol=1e-2)
                times: dict[str, list[float]] = {k: [] for k in forms}
                for _ in range(args.rounds):
                    for key, fn in forms.items():
                        t0 = time.perf_counter()
                        fn(x)
                        times[key].append((time.perf_counter() - t0) * 1e3)
                out = {"bench": "lm_head", "vocab": args.vocab, "hidden": hidden, "dtype": name, "rows": rows,
                       **{f"{k}_ms": round(statistics.median(v), 2) for k, v in times.items()},
                       "loadavg": round(os.getloadavg()[0], 2), "rev": rev()}
                if "packed" in forms:
                    out["packed_over_linear"] = round(out["packed_ms"] / out["linear_ms"], 2)
                    out["chunks_over_packed"] = round(out["packed_chunks_ms"] / out["packed_ms"], 2)
                print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
