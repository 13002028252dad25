"""Kernel benchmark: hf_paged's Triton kernels against torch SDPA (and flash-attn if installed),
same shapes, same run. Needs a CUDA GPU; on CPU it says so and exits cleanly.

* paged decode: achieved HBM GB/s (K/V bytes read once / time) and % of the device's peak, for
  batch 1-256 and context 512-32k, beside SDPA decoding from a contiguous cache.
* prefill: causal TFLOP/s (4 * b * h * s^2 * d / 2) beside SDPA's flash backend.

    python benchmarks/kernels.py [--dtype bfloat16] [--heads 32 8] [--head-dim 128] [--quick]

The peak bandwidth is looked up from the device name (H100/H200/A100/L40S...), or taken from
HF_PAGED_PEAK_GBPS.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350,
             "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100": 1555, "L40S": 864, "A10G": 600}


def peak_gbps(name: str) -> float | None:
    if os.environ.get("HF_PAGED_PEAK_GBPS"):
        return float(os.environ["HF_PAGED_PEAK_GBPS"])
    for key, value in PEAK_GBPS.items():
        if key in name:
            return value
    return None


def time_cuda(fn, iters: int = 20, warmup: int = 5) -> float:
    """Median seconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def paged_inputs(batch, ctx, q_len, num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device="cuda", dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    tables = torch.randperm(num_blocks, device="cuda").int().view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    cu = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * q_len
    query = torch.randn(batch * q_len, num_q_heads, head_dim, device="cuda", dtype=dtype)
    return query, key_cache, value_cache, tables, seq_lens, cu


def bench_decode(args, peak):
    from hf_paged.attention.triton.decode import paged_decode

    hq, hkv, d = args.heads[0], args.heads[1], args.head_dim
    itemsize = torch.empty(0, dtype=args.dtype).element_size()
    print(f"\n== paged decode, q_len=1, heads {hq}/{hkv}, head_dim {d}, {args.dtype}, block_size {args.block_size}")
    print(f"{'batch':>6}{'ctx':>7}{'paged GB/s':>12}{'% peak':>8}{'sdpa GB/s':>11}{'paged/sdpa':>11}"
          + (f"{'fa GB/s':>9}" if args.flash_attn else ""))
    for batch in args.batches:
        for ctx in args.contexts:
            kv_bytes = 2 * batch * ctx * hkv * d * itemsize
            if 2.2 * kv_bytes > args.max_gib * 2**30:
                continue
            q, kc, vc, tables, seq_lens, cu = paged_inputs(batch, ctx, 1, hq, hkv, d, args.block_size, args.dtype)
            t_paged = time_cuda(lambda: paged_decode(q, kc, vc, tables, seq_lens, cu, 1, ctx, d ** -0.5))
            del kc, vc
            k = torch.randn(batch, hkv, ctx, d, device="cuda", dtype=args.dtype)
            v = torch.randn_like(k)
            qd = q.view(batch, 1, hq, d).transpose(1, 2)
            t_sdpa = time_cuda(lambda: F.scaled_dot_product_attention(qd, k, v, enable_gqa=hq != hkv))
            line = (f"{batch:>6}{ctx:>7}{kv_bytes / t_paged / 1e9:>12.0f}"
                    f"{(100 * kv_bytes / t_paged / 1e9 / peak) if peak else float('nan'):>8.1f}"
                    f"{kv_bytes / t_sdpa / 1e9:>11.0f}{t_sdpa / t_paged:>11.2f}")
            if args.flash_attn:
                from flash_attn import flash_attn_with_kvcache

                kf, vf = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
                t_fa = time_cuda(lambda: flash_attn_with_kvcache(q.view(batch, 1, hq, d), kf, vf, causal=True))
                line += f"{kv_bytes / t_fa / 1e9:>9.0f}"
            print(line, flush=True)
            del k, v
            torch.cuda.empty_cache()


def bench_prefill(args):
    from hf_paged.attention.triton.prefill import flash_prefill

    hq, hkv, d = args.heads[0], args.heads[1], args.head_dim
    print(f"\n== prefill (causal, no cached prefix), heads {hq}/{hkv}, head_dim {d}, {args.dtype}")
    print(f"{'batch':>6}{'ctx':>7}{'paged TFLOP/s':>15}{'sdpa TFLOP/s':>14}{'paged/sdpa':>11}")
    for batch in (1, 4, 16):
        for ctx in args.prefill_contexts:
            if batch * ctx > 65536:
                continue
            q, kc, vc, tables, seq_lens, cu = paged_inputs(batch, ctx, ctx, hq, hkv, d, args.block_size, args.dtype)
            flops = 4 * batch * hq * ctx * ctx * d / 2
            t_paged = time_cuda(lambda: flash_prefill(q, kc, vc, tables, seq_lens, cu, ctx, ctx, d ** -0.5), iters=10)
            qs = q.view(batch, ctx, hq, d).transpose(1, 2)
            k = torch.randn(batch, hkv, ctx, d, device="cuda", dtype=args.dtype)
            v = torch.randn_like(k)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                kr, vr = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
                t_sdpa = time_cuda(lambda: F.scaled_dot_product_attention(qs, kr, vr, is_causal=True), iters=10)
            print(f"{batch:>6}{ctx:>7}{flops / t_paged / 1e12:>15.1f}{flops / t_sdpa / 1e12:>14.1f}"
                  f"{t_sdpa / t_paged:>11.2f}", flush=True)
            del q, kc, vc, k, v, kr, vr
            torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("Q", "KV"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-gib", type=float, default=60.0, help="skip shapes whose K/V exceed this")
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU (the kernels' speed is a GPU property); none found, "
              "nothing measured.")
        return 0
    args.dtype = getattr(torch, args.dtype)
    args.batches = [1, 32, 256] if args.quick else [1, 8, 32, 64, 128, 256]
    args.contexts = [512, 4096, 32768] if args.quick else [512, 2048, 4096, 8192, 16384, 32768]
    args.prefill_contexts = [1024, 4096] if args.quick else [512, 1024, 2048, 4096, 8192]
    try:
        import flash_attn  # noqa: F401

        args.flash_attn = True
    except ImportError:
        args.flash_attn = False
    name = torch.cuda.get_device_name()
    peak = peak_gbps(name)
    print(f"device: {name}; peak HBM {peak or 'unknown'} GB/s; torch {torch.__version__}; "
          f"flash-attn {'yes' if args.flash_attn else 'not installed'}")
    bench_decode(args, peak)
    bench_prefill(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
