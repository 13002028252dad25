"""Kernel benchmark: hf_paged's Triton kernels against torch SDPA (and flash-attn if installed),
same shapes, same run. Needs a CUDA GPU; on CPU it says so and exits cleanly.

* paged decode: achieved HBM GB/s (K/V bytes read once / time) and % of the device's peak, for
  batch 1-256 and context 512-32k, beside SDPA decoding from a contiguous cache.
* prefill: causal TFLOP/s (4 * b * h * s^2 * d / 2) beside SDPA's flash backend.

    python benchmarks/kernel_bench.py [--dtype bfloat16] [--heads 32 8] [--head-dim 128] [--quick] [--json PATH]

The verdicts it prints (and writes with `--json`) are the GPU issue's targets: decode reaches >= 80%
of peak HBM bandwidth at every measured batch >= 32 with context >= 4k (head_dim 128, bf16), and
prefill reaches >= 90% of SDPA flash's TFLOP/s at 4k tokens. Each timing is the median of 5 runs
of `--reps` back-to-back calls between two CUDA events, so launch latency is amortised as in a real
forward, and every K/V working set is far larger than L2.

The peak bandwidth is looked up from the device name (H100/H200/A100/L40S...), or taken from
HF_PAGED_PEAK_GBPS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

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


# "cuda"; "cpu" only for --dry-run (tiny shapes under Triton's interpreter, wall-clock timers): it
# runs every line of this script before a GPU session spends its minutes on it.
DEVICE = "cuda"
TARGET_DECODE_PEAK = 0.80  # of peak HBM bandwidth, batch >= 32, context >= 4k
TARGET_PREFILL_VS_SDPA = 0.90  # of SDPA flash's TFLOP/s at 4k tokens


def time_cuda(fn, iters: int = 5, warmup: int = 3, reps: int = 10) -> float:
    """Median seconds per call over `iters` runs of `reps` back-to-back calls between two CUDA events."""
    if DEVICE == "cpu":  # --dry-run
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # Keep the GPU busy (~1 ms) while the host queues the event and the calls: otherwise the time
        # between the start event and the first launch (the launcher's Python) would count as kernel time.
        torch.cuda._sleep(2_000_000)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def copy_gbps() -> float:
    """Device-to-device copy bandwidth (bytes read + written), the practical ceiling of a read stream."""
    size = 2 * 2**30 if DEVICE == "cuda" else 2**20
    src = torch.empty(size, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src), reps=5)
    del src, dst
    empty_cache()
    return 2 * size / seconds / 1e9


def empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def paged_inputs(batch, ctx, q_len, num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    tables = torch.randperm(num_blocks, device=DEVICE).int().view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE) * q_len
    query = torch.randn(batch * q_len, num_q_heads, head_dim, device=DEVICE, dtype=dtype)
    return query, key_cache, value_cache, tables, seq_lens, cu


def bench_decode(args, peak) -> list[dict]:
    from hf_paged.attention.triton.decode import paged_decode

    rows = []
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
            k = torch.randn(batch, hkv, ctx, d, device=DEVICE, dtype=args.dtype)
            v = torch.randn_like(k)
            qd = q.view(batch, 1, hq, d).transpose(1, 2)
            t_sdpa = time_cuda(lambda: F.scaled_dot_product_attention(qd, k, v, enable_gqa=hq != hkv))
            rows.append({"batch": batch, "ctx": ctx, "paged_gbps": kv_bytes / t_paged / 1e9,
                         "peak_fraction": kv_bytes / t_paged / 1e9 / peak if peak else None,
                         "sdpa_gbps": kv_bytes / t_sdpa / 1e9, "paged_over_sdpa": t_sdpa / t_paged})
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
            empty_cache()
    return rows


def bench_prefill(args) -> list[dict]:
    from hf_paged.attention.triton.prefill import flash_prefill

    rows = []
    hq, hkv, d = args.heads[0], args.heads[1], args.head_dim
    print(f"\n== prefill (causal, no cached prefix), heads {hq}/{hkv}, head_dim {d}, {args.dtype}")
    print(f"{'batch':>6}{'ctx':>7}{'paged TFLOP/s':>15}{'sdpa TFLOP/s':>14}{'paged/sdpa':>11}")
    for batch in args.prefill_batches:
        for ctx in args.prefill_contexts:
            if batch * ctx > 65536:
                continue
            q, kc, vc, tables, seq_lens, cu = paged_inputs(batch, ctx, ctx, hq, hkv, d, args.block_size, args.dtype)
            flops = 4 * batch * hq * ctx * ctx * d / 2
            t_paged = time_cuda(lambda: flash_prefill(q, kc, vc, tables, seq_lens, cu, ctx, ctx, d ** -0.5), reps=3)
            qs = q.view(batch, ctx, hq, d).transpose(1, 2)
            k = torch.randn(batch, hkv, ctx, d, device=DEVICE, dtype=args.dtype)
            v = torch.randn_like(k)
            from torch.nn.attention import SDPBackend, sdpa_kernel

            backends = [SDPBackend.FLASH_ATTENTION] if DEVICE == "cuda" else [SDPBackend.MATH]
            kr, vr = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
            try:
                with sdpa_kernel(backends):
                    t_sdpa = time_cuda(lambda: F.scaled_dot_product_attention(qs, kr, vr, is_causal=True), reps=3)
            except RuntimeError as exc:  # no flash backend for this dtype/shape on this build: say so, go on
                print(f"{batch:>6}{ctx:>7}{flops / t_paged / 1e12:>15.1f}  SDPA flash unavailable: {exc}", flush=True)
                rows.append({"batch": batch, "ctx": ctx, "paged_tflops": flops / t_paged / 1e12,
                             "sdpa_flash_error": str(exc)[:200]})
                continue
            rows.append({"batch": batch, "ctx": ctx, "paged_tflops": flops / t_paged / 1e12,
                         "sdpa_flash_tflops": flops / t_sdpa / 1e12, "paged_over_sdpa": t_sdpa / t_paged})
            print(f"{batch:>6}{ctx:>7}{flops / t_paged / 1e12:>15.1f}{flops / t_sdpa / 1e12:>14.1f}"
                  f"{t_sdpa / t_paged:>11.2f}", flush=True)
            del q, kc, vc, k, v, kr, vr
            empty_cache()
    return rows


def verdicts(decode: list[dict], prefill: list[dict]) -> dict:
    """The GPU issue's two kernel targets over the measured rows (None where no row qualifies)."""
    region = [r["peak_fraction"] for r in decode if r["batch"] >= 32 and r["ctx"] >= 4096 and r["peak_fraction"]]
    at_4k = [r["paged_over_sdpa"] for r in prefill if r["ctx"] == 4096 and "paged_over_sdpa" in r]
    out = {
        "decode_min_peak_fraction_b32_ctx4k": min(region) if region else None,
        "decode_max_peak_fraction_b32_ctx4k": max(region) if region else None,
        "decode_target": TARGET_DECODE_PEAK,
        "prefill_min_vs_sdpa_flash_4k": min(at_4k) if at_4k else None,
        "prefill_target": TARGET_PREFILL_VS_SDPA,
    }
    out["decode_pass"] = None if not region else min(region) >= TARGET_DECODE_PEAK
    out["prefill_pass"] = None if not at_4k else min(at_4k) >= TARGET_PREFILL_VS_SDPA
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("Q", "KV"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-gib", type=float, default=60.0, help="skip shapes whose K/V exceed this")
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the rows and verdicts here")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: run every part on tiny shapes under Triton's interpreter (checks the script, "
                             "measures nothing)")
    args = parser.parse_args()
    if args.dry_run:
        global DEVICE
        DEVICE = "cpu"
        os.environ["TRITON_INTERPRET"] = "1"  # read when hf_paged's Triton modules are first imported
        if "triton" in sys.modules and not os.environ.get("TRITON_INTERPRET"):
            raise SystemExit("--dry-run: set TRITON_INTERPRET=1 before triton is imported")
    elif not torch.cuda.is_available():
        print("benchmarks/kernel_bench.py needs a CUDA GPU (the kernels' speed is a GPU property); none found, "
              "nothing measured.")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"skipped": "no CUDA GPU"}, f)
        return 0
    args.dtype = getattr(torch, args.dtype)
    args.batches = [1, 32, 64, 256] if args.quick else [1, 8, 32, 64, 128, 256]
    args.contexts = [512, 4096, 16384] if args.quick else [512, 2048, 4096, 8192, 16384, 32768]
    args.prefill_contexts = [1024, 4096] if args.quick else [512, 1024, 2048, 4096, 8192]
    args.prefill_batches = (1, 4, 16)
    if args.dry_run:  # every code path, shapes the interpreter runs in seconds; fp16 (its bf16 dot is wrong)
        args.batches, args.contexts, args.prefill_contexts, args.prefill_batches = [1, 3], [17, 80], [64], (1, 2)
        args.heads, args.head_dim, args.dtype = [4, 2], 32, torch.float16
    try:
        import flash_attn  # noqa: F401

        args.flash_attn = True
    except ImportError:
        args.flash_attn = False
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run: nothing measured)"
    peak = peak_gbps(name) or (1000.0 if DEVICE == "cpu" else None)
    copy = copy_gbps()
    print(f"device: {name}; peak HBM {peak or 'unknown'} GB/s (datasheet); device copy {copy:.0f} GB/s measured; "
          f"torch {torch.__version__}; flash-attn {'yes' if args.flash_attn else 'not installed'}")
    record = {"device": name, "peak_gbps": peak, "copy_gbps": copy, "dtype": str(args.dtype), "heads": args.heads,
              "head_dim": args.head_dim, "block_size": args.block_size}

    def write(**parts):  # after each section: a run stopped at its time limit keeps what it measured
        record.update(parts)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)

    decode = bench_decode(args, peak)
    write(decode=decode, partial=True)
    prefill = bench_prefill(args)
    result = verdicts(decode, prefill)
    fmt = lambda x: "n/a" if x is None else f"{x:.1%}"  # noqa: E731
    word = lambda ok: "n/a" if ok is None else "PASS" if ok else "MISS"  # noqa: E731
    print(f"\nSUMMARY decode at batch >= 32, ctx >= 4k: {fmt(result['decode_min_peak_fraction_b32_ctx4k'])} to "
          f"{fmt(result['decode_max_peak_fraction_b32_ctx4k'])} of peak HBM "
          f"({word(result['decode_pass'])} >= {TARGET_DECODE_PEAK:.0%} everywhere); prefill at 4k: "
          f"{fmt(result['prefill_min_vs_sdpa_flash_4k'])} of SDPA flash's TFLOP/s "
          f"({word(result['prefill_pass'])} >= {TARGET_PREFILL_VS_SDPA:.0%})")
    record.pop("partial")
    write(prefill=prefill, verdicts=result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
