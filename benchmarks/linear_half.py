"""bf16/fp16 linears on CPU: torch's own 16-bit kernel against hf_paged's (`hf_paged.hf.linear`).

On a CPU without 16-bit dot-product instructions (no AVX512-BF16, AMX or AVX512-FP16) torch's bf16 and
fp16 GEMMs run at about a third of fp32's rate. hf_paged's forwards then run a linear of
`linear.HALF_ROWS` rows or more as an fp32 GEMM over its weight converted a slice at a time, rounded
once to the 16-bit dtype, where that measures faster on the machine (`linear.half_as_fp32_wins`). This
script times both on SmolLM2-135M's linear shapes (random weights of those shapes: 576 -> 576, 192,
1536; 1536 -> 576; the 576 -> 49152 output embedding) at several row counts, alternating the two,
and prints medians, GFLOP/s and the ratio, with how far each lands from the float64 product (mean
absolute error) and the fraction of outputs where the two differ (a last bit, from summation order).

    python benchmarks/linear_half.py [--threads 2] [--rounds 5] [--rows 1,8,32,64,256,2048]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hf_paged.hf import linear
from throughput import cpu_flags  # noqa: E402  (benchmarks/ is the script's own folder)

SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]  # (in, out) of SmolLM2-135M


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", default="1,8,32,64,256,2048")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; CPU flags: {' '.join(sorted(cpu_flags())) or 'unknown'}")
    if not linear.is_available():
        print("hf_paged's linear kernel is unavailable here (no oneDNN, or HF_PAGED_FAST_LINEAR=0): nothing to compare")
        return
    gen = torch.Generator().manual_seed(0)
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        print(f"\n== {name}: the fp32 route measured {'faster' if linear.half_as_fp32_wins(dtype) else 'not faster'} "
              f"here at {linear.HALF_ROWS} rows; it runs from {linear.HALF_ROWS} rows where faster")
        print(f"{'rows':>6}{'stock ms':>10}{'hf_paged ms':>12}{'ratio':>8}{'stock GF/s':>12}{'hf_paged GF/s':>15}"
              f"{'err stock':>11}{'err ours':>10}{'differ':>9}")
        modules = []
        for fan_in, fan_out in SHAPES:
            module = torch.nn.Linear(fan_in, fan_out, bias=False)
            module.weight.data = (torch.randn(fan_out, fan_in, generator=gen) * fan_in ** -0.5).to(dtype)
            linear.enable(module)
            modules.append(module)
        for rows in [int(r) for r in args.rows.split(",")]:
            xs = [torch.randn(rows, m.in_features, generator=gen).to(dtype) for m in modules]
            flops = sum(2 * rows * m.in_features * m.out_features for m in modules)

            def stock():
                return [F.linear(x, m.weight) for x, m in zip(xs, modules)]

            def ours():
                with linear.fast_linear():
                    return [m(x) for x, m in zip(xs, modules)]

            times = {"stock": [], "ours": []}
            with torch.inference_mode():
                outs = {"stock": stock(), "ours": ours()}
                reps = max(1, 256 // rows)
                for _ in range(args.rounds):
                    for key, fn in (("stock", stock), ("ours", ours)):
                        began = time.perf_counter()
                        for _ in range(reps):
                            fn()
                        times[key].append((time.perf_counter() - began) / reps)
            exact = [x.double() @ m.weight.double().T for x, m in zip(xs, modules)]
            err = {k: statistics.mean((o.double() - e).abs().mean().item() for o, e in zip(v, exact))
                   for k, v in outs.items()}
            differ = sum((a != b).sum().item() for a, b in zip(outs["stock"], outs["ours"])) / sum(
                a.numel() for a in outs["stock"])
            t_stock, t_ours = statistics.median(times["stock"]), statistics.median(times["ours"])
            print(f"{rows:6d}{t_stock * 1e3:10.2f}{t_ours * 1e3:12.2f}{t_ours / t_stock:8.2f}"
                  f"{flops / t_stock / 1e9:12.1f}{flops / t_ours / 1e9:15.1f}{err['stock']:11.2e}{err['ours']:10.2e}"
                  f"{differ:9.1e}")
    print("\nratio = hf_paged's time / stock's (lower is faster); err = mean |output - float64 product|;"
          " differ = fraction of outputs that are not bit-identical")


if __name__ == "__main__":
    main()
