"""KV memory: PagedCache against DynamicCache, same inputs, same run.

`padding` (SmolLM2): a padded batch of mixed lengths. For block sizes 1, 16 and 32 it prints the real
tokens stored, the bytes the used blocks take, the bound `(1 + block_size / min_len)` x real bytes,
the pool's reserved bytes, and DynamicCache's bytes (which hold every padding column too).

`hybrid`: sliding-window memory on gemma3-style configs (5 sliding layers per full layer), one
sequence at context 4x the window (prompt 3w, then w new tokens, greedy). After every forward it
records the K/V bytes each cache holds: DynamicCache's tensor storages (its sliding layers keep the
last w - 1 tokens, plus the step's), PagedCache's blocks in use, and the equation the cache and the
planner share (`config.blocks_held` per group, times the bytes of a block). Peak, after
prefill and at the end. Then the same with the engine's chunked prefill, and hf_paged with
`enable_hybrid_kv=False` (every layer keeps every token: the layout before hybrid memory).

`kinds`: the newer layer kinds on tiny random-weight models (block size 4): Llama 4 (chunks of 12 on
its RoPE layers, its NoPE layer full), Gemma 3n (the last 2 of 6 layers reuse layers 2 and 3's K/V) and
Gemma 4 (the same, plus full layers of 1 KV head of 64 beside sliding layers of 2 heads of 16). Stock
generate over a PagedCache on a left-padded batch (prompts 40, 13, 29, then 16 new tokens): the most
blocks any sequence holds per group, after every decode step, against the spec's bound (a chunk or window
plus one block), the tensors of the reusing layers, and the pool's tensor bytes against
`hf-paged kv-size`'s (the planner's) bytes per block times the blocks.

`capacity`: at a fixed `max_kv_bytes`, the most concurrent 4w-token requests (prompt w, 3w new) the
engine runs with no preemption (searched), hybrid against `enable_hybrid_kv=False`, beside the factor
the equation predicts.

    python benchmarks/kv_memory.py [--section padding|hybrid|kinds|capacity|all] [--new-tokens 16]
"""

from __future__ import annotations

import argparse
import inspect
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache, Gemma3TextConfig

import hf_paged
from hf_paged.config import blocks_held
from hf_paged.hf import PagedCache
from hf_paged.defaults.models import load_default
from hf_paged.defaults.prompts import chat_inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--section", choices=["padding", "hybrid", "kinds", "capacity", "all"], default="all")
    args = parser.parse_args()
    if args.section in ("padding", "all"):
        padding(args)
    if args.section in ("hybrid", "all"):
        hybrid()
    if args.section in ("kinds", "all"):
        kinds()
    if args.section in ("capacity", "all"):
        capacity()


def kinds():
    from transformers import Gemma3nTextConfig, Gemma4TextConfig, Llama4TextConfig

    from hf_paged.planner.plan import plan
    from hf_paged.planner.shape import ModelShape

    vocab, block = 128, 4
    gemma = dict(vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size=64, hidden_size_per_layer_input=8,
                 intermediate_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 3, num_kv_shared_layers=2,
                 max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    configs = {
        "llama4 (chunk 12)": Llama4TextConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_chunk_size=12, num_local_experts=2,
            max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_qk_norm=False),
        "gemma3n (2 reuse)": Gemma3nTextConfig(**gemma, activation_sparsity_pattern=[0.0] * 6, laurel_rank=4,
                                               altup_num_inputs=2),
        "gemma4 (2 reuse, 2 shapes)": Gemma4TextConfig(**gemma, global_head_dim=64, num_global_key_value_heads=1,
                                                       attention_k_eq_v=True),
    }
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (40, 13, 29)]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, width - len(row):], mask[r, width - len(row):] = torch.tensor(row), 1
    gen = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False)
    print(f"block_size {block}; prompts {[len(r) for r in rows]}, 16 new tokens")
    print(f"{'model':<28}{'group':<34}{'max held':>9}{'bound':>7}   {'pool bytes':>11}{'kv-size bytes':>14}"
          f"{'reuse tensors':>14}{'identical':>10}")
    for name, config in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="hf_paged").eval()
        stock_model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        stock_model.load_state_dict(model.state_dict())
        expected = stock_model.generate(ids, attention_mask=mask, **gen)
        cache = PagedCache(model.config, block_size=block)
        held = [0] * len(cache.layout.groups)

        def note(module, args, kwargs, output):  # after every decode forward: the most blocks a sequence holds
            ids_in = kwargs.get("input_ids", args[0] if args else None)
            if ids_in is None or ids_in.shape[1] != 1:
                return  # a prefill step holds its own tokens too (the bound counts decode steps)
            for seq in cache.seqs:
                for group in range(len(held)):
                    held[group] = max(held[group], len(seq.block_tables[group]) - seq.num_released[group])

        hook = model.register_forward_hook(note, with_kwargs=True)
        model.hf_paged_use_engine = False
        key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        out = model.generate(ids, attention_mask=mask, **gen, **{key: cache})
        hook.remove()
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # byte pages: views of one buffer
                    for layer in cache.kv.storage_layers for t in (layer.keys, layer.values)}
        pool_bytes = sum(storages.values())
        planned = plan(ModelShape.from_config(model.config.to_dict()), kv_budget_bytes=1 << 30, seq_len=64,
                       block_size=block, kv_dtype="float32")
        reuse = [layer for layer in cache.layers if not getattr(layer, "is_initialized", True) or
                 type(layer).__name__ == "SharedLayer"]
        reuse_tensors = sum(1 for layer in reuse for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                            if isinstance(t, torch.Tensor) and t.numel())
        for group, spec in enumerate(cache.layout.group_specs):
            reach = spec.reach
            bound = "-" if reach is None else str(-(-(reach + 1) // block) + 1)
            label = f"{group}: {type(spec).__name__} {cache.layout.groups[group].layers}"
            first = group == 0
            print(f"{name if first else '':<28}{label:<34}{held[group]:>9}{bound:>7}   "
                  + (f"{pool_bytes:>11}{cache.pool.num_blocks * planned.bytes_per_block:>14}{reuse_tensors:>14}"
                     f"{str(torch.equal(out, expected)):>10}" if first else ""))


def padding(args):
    model, tokenizer = load_default()
    inputs = chat_inputs(tokenizer)
    lengths = inputs["attention_mask"].sum(1).tolist()
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
               return_dict_in_generate=True)
    stock = model.generate(**inputs, **gen)
    cache_key = "cache" if hasattr(stock, "cache") else "past_key_values"
    dense = sum(t.numel() * t.element_size() for layer in getattr(stock, cache_key).layers
                for t in (layer.keys, layer.values))
    stored = [n + args.new_tokens - 1 for n in lengths]
    print(f"batch of {len(lengths)} prompts, lengths {lengths} (padded to {inputs['input_ids'].shape[1]}), "
          f"{args.new_tokens} new tokens")
    print(f"DynamicCache: {dense / 2**20:.2f} MiB")
    print("(prefix caching shares the chat template's common system prompt across rows, so 'used' can be "
          "below 'real')")
    print(f"{'prefix':>7}{'block_size':>11}{'tokens':>8}{'used MiB':>10}{'used/real':>11}{'bound':>8}{'reserved MiB':>14}"
          f"{'used/Dynamic':>14}{'identical':>11}")
    model.set_attn_implementation("hf_paged")
    for prefix_caching, block_size in [(p, b) for p in (False, True) for b in (1, 16, 32)]:
        model.hf_paged_cache_config = hf_paged.PagedCacheConfig(block_size=block_size,
                                                                enable_prefix_caching=prefix_caching)
        out = model.generate(**inputs, **gen)
        stats = getattr(out, cache_key).stats()
        real = stats["num_tokens"] * stats["bytes_per_token"]
        assert stats["num_tokens"] == sum(stored)
        print(f"{'on' if prefix_caching else 'off':>7}{block_size:>11}{stats['num_tokens']:>8}{stats['kv_bytes'] / 2**20:>10.2f}"
              f"{stats['kv_bytes'] / real:>11.3f}{1 + block_size / min(stored):>8.3f}"
              f"{stats['kv_bytes_reserved'] / 2**20:>14.2f}{stats['kv_bytes'] / dense:>14.3f}"
              f"{str(torch.equal(out.sequences, stock.sequences)):>11}")


# ---------------------------------------------------------------------------------------------- hybrid
def gemma3_style(window: int, smollm2_size: bool) -> Gemma3TextConfig:
    """A gemma3-style text config (5 sliding layers per full one); SmolLM2-135M's dimensions
    (30 layers, 576 hidden, 9 heads, 3 KV heads of 64) when `smollm2_size`, else a tiny one."""
    if smollm2_size:
        dims = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    else:
        dims = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    layers = dims["num_hidden_layers"]
    return Gemma3TextConfig(**dims, sliding_window=window, query_pre_attn_scalar=dims["head_dim"],
                            max_position_embeddings=8 * window, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                         for i in range(layers)])


def _model(config, attn: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()


def _stock_bytes(cache) -> int:
    """Bytes of the distinct tensor storages a DynamicCache holds (a sliding layer's kept slice is a
    view that keeps its whole step's tensor alive)."""
    seen = {}
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None and t.numel():
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _paged_equation(cache: PagedCache, num_before: int, num_new: int) -> int:
    """The shared equation: per group, `blocks_held` blocks, each `bytes_per_block`."""
    blocks = sum(blocks_held(num_before, w, cache.block_size, cache.manager.lookback, num_new)
                 for w in cache.manager.windows)
    return blocks * cache.bytes_per_block()


def _greedy(model, cache, prompt: list[int], new: int, sample) -> list[int]:
    """Greedy decoding by hand, calling `sample(num_before, num_new)` after every forward."""
    kw = "cache" if "cache" in inspect.signature(type(model.model).forward).parameters else "past_key_values"
    out, ids, before = [], torch.tensor([prompt]), 0
    with torch.inference_mode():
        for _ in range(new):
            logits = model(input_ids=ids, use_cache=True, **{kw: cache}).logits
            sample(before, ids.shape[1])
            before += ids.shape[1]
            ids = logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(ids))
    return out


def hybrid():
    print("\n== hybrid sliding-window memory: one sequence, prompt 3w + w new tokens, greedy ==")
    for name, window, big in (("tiny gemma3-style", 64, False), ("gemma3-style at SmolLM2-135M size", 512, True)):
        config = gemma3_style(window, big)
        prompt = torch.randint(3, config.vocab_size, (3 * window,), generator=torch.Generator().manual_seed(0)).tolist()
        new = window
        stock_model = _model(config, "eager")
        stock_cache = DynamicCache(config=config)
        stock = []
        t0 = time.perf_counter()
        stock_ids = _greedy(stock_model, stock_cache, prompt, new, lambda b, n: stock.append(_stock_bytes(stock_cache)))
        t_stock = time.perf_counter() - t0
        rows = [("DynamicCache (stock)", stock, None, t_stock, True, None)]
        paged_model = _model(config, "hf_paged")
        hf_paged.attach(paged_model)
        for label, cfg in (("PagedCache hybrid", dict()), ("PagedCache enable_hybrid_kv=False", dict(enable_hybrid_kv=False))):
            cache = PagedCache(config, block_size=16, **cfg)
            used, equation = [], []

            def sample(before, n, cache=cache, used=used, equation=equation):
                used.append(cache.stats()["kv_bytes"])
                equation.append(_paged_equation(cache, before, n))

            t0 = time.perf_counter()
            ids = _greedy(paged_model, cache, prompt, new, sample)
            rows.append((label, used, equation, time.perf_counter() - t0, ids == stock_ids,
                         cache.stats()["kv_bytes_reserved"]))
        print(f"\n{name}: {config.num_hidden_layers} layers ({config.layer_types.count('full_attention')} full), "
              f"window {window}, context {4 * window}, block_size 16")
        print(f"{'cache':<36}{'peak MiB':>10}{'after prefill':>15}{'at end':>10}{'reserved':>10}{'peak/stock':>12}"
              f"{'equation peak':>15}{'identical':>11}{'seconds':>9}")
        for label, series, equation, seconds, same, reserved in rows:
            eq = f"{max(equation) / 2**20:.2f}" if equation else "-"
            res = f"{reserved / 2**20:.2f}" if reserved is not None else "-"
            print(f"{label:<36}{max(series) / 2**20:>10.2f}{series[0] / 2**20:>15.2f}{series[-1] / 2**20:>10.2f}"
                  f"{res:>10}{max(series) / max(stock):>12.3f}{eq:>15}{str(same):>11}{seconds:>9.1f}")
        used, equation = rows[1][1], rows[1][2]
        slack = max(u - e for u, e in zip(used, equation))
        print(f"hybrid PagedCache vs the equation, worst step: {slack} bytes over; "
              f"stock peak {max(stock) / 2**20:.2f} MiB, hybrid peak {max(used) / 2**20:.2f} MiB "
              f"({'<=' if max(used) <= max(stock) else '>'} stock)")
        # The engine: chunked prefill keeps the sliding groups at w - 1 + chunk tokens even while prefilling.
        chunk = window // 2
        for label, cfg in ((f"Engine hybrid, chunk {chunk}", dict()), (f"Engine enable_hybrid_kv=False, chunk {chunk}",
                                                                   dict(enable_hybrid_kv=False))):
            engine = hf_paged.Engine(paged_model, block_size=16, max_num_batched_tokens=chunk, max_model_len=4 * window,
                                     max_num_seqs=1, **cfg)
            out = engine.generate([prompt], hf_paged.SamplingParams(max_new_tokens=new, min_new_tokens=new))
            peak = engine.metrics()["kv_peak_bytes"]
            print(f"{label:<40} peak {peak / 2**20:.2f} MiB = {peak / max(stock):.3f}x stock, "
                  f"identical {out[0].token_ids == stock_ids}")


def _runs_without_preemption(model, n: int, prompt_len: int, new: int, kv_bytes: int, chunk: int, **cfg) -> bool:
    """Whether `n` requests of prompt_len + new tokens all run at once with no preemption."""
    prompts = [torch.randint(3, 500, (prompt_len,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(n)]
    engine = hf_paged.Engine(model, block_size=16, max_kv_bytes=kv_bytes, max_num_seqs=n,
                             max_num_batched_tokens=chunk, enable_prefix_caching=False, **cfg)
    try:
        engine.generate(prompts, hf_paged.SamplingParams(max_new_tokens=new, min_new_tokens=new))
    except ValueError:
        return False  # a request can never fit
    metrics = engine.metrics()
    return metrics["vllm:num_preemptions"] == 0 and engine._metrics.peak_num_running >= n


def capacity():
    print("\n== engine capacity at a fixed max_kv_bytes: concurrent 4w-token requests with no preemption ==")
    window, chunk = 64, 32
    config = gemma3_style(window, smollm2_size=False)
    model = _model(config, "hf_paged")
    # Short prompts, long outputs: every request is admitted long before the first one finishes, so
    # the pool, not the schedule, bounds how many run at once.
    prompt_len, new = window, 3 * window
    probe = {True: PagedCache(config, block_size=16), False: PagedCache(config, block_size=16, enable_hybrid_kv=False)}
    kv_bytes = 6 << 20
    print(f"tiny gemma3-style, window {window}, requests of {prompt_len} + {new} tokens, chunk {chunk}, "
          f"max_kv_bytes {kv_bytes / 2**20:.0f} MiB, block_size 16")
    results = {}
    for hybrid_kv in (False, True):
        cache = probe[hybrid_kv]
        bytes_per_block = cache.bytes_per_block(torch.float32)
        per_request = cache.manager.max_blocks_for(prompt_len + new, chunk) * bytes_per_block
        predicted = kv_bytes // per_request
        lo, hi = 0, 4 * predicted + 4  # largest n that runs without preemption, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _runs_without_preemption(model, mid, prompt_len, new, kv_bytes, chunk, enable_hybrid_kv=hybrid_kv):
                lo = mid
            else:
                hi = mid - 1
        results[hybrid_kv] = (per_request, predicted, lo)
        print(f"  enable_hybrid_kv={hybrid_kv!s:<5}: equation {per_request:,} bytes per request -> predicted "
              f"{predicted} concurrent, measured {lo}")
    (pf, nf, mf), (ph, nh, mh) = results[False], results[True]
    print(f"  factor: predicted {pf / ph:.2f}x (bytes per request), {nh / max(nf, 1):.2f}x (whole requests); "
          f"measured {mh / max(mf, 1):.2f}x")


if __name__ == "__main__":
    main()
