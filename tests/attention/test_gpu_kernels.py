"""The Triton kernels compiled for real on a CUDA GPU, bf16 included (the interpreter cannot check bf16).
Skipped on machines without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from hf_paged.attention import reference

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                       reason="needs a CUDA GPU with compiled Triton"),
]

# Tolerances by dtype: fp32 accumulation everywhere, so the inputs' precision dominates.
ATOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def _paged_batch(rows, block_size, num_q_heads, num_kv_heads, head_dim, dtype, seed=0):
    """Random paged K/V for `rows` of (seq_len, q_len), non-contiguous block tables."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s, _ in rows]
    num_blocks = sum(blocks_per_seq) + 7
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    value_cache = torch.randn_like(key_cache)
    perm = torch.randperm(num_blocks, device="cuda", generator=g)
    tables = torch.zeros(len(rows), max(blocks_per_seq) + 1, dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = perm[start:start + n].int()
        start += n
    q_lens = [q for _, q in rows]
    cu = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    query = torch.randn(int(cu[-1]), num_q_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    seq_lens = torch.tensor([s for s, _ in rows], dtype=torch.int32, device="cuda")
    return query, key_cache, value_cache, tables, seq_lens, cu, max(q_lens), max(s for s, _ in rows)


MIXED = [(1, 1), (15, 1), (16, 4), (17, 17), (54, 1), (97, 4), (97, 40), (33, 0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("heads", [(8, 8), (12, 4), (10, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kernel", ["paged_decode", "flash_prefill"])
def test_kernels_match_reference(kernel, head_dim, heads, block_size, dtype):
    from hf_paged.attention.triton.decode import paged_decode
    from hf_paged.attention.triton.prefill import flash_prefill

    fn = paged_decode if kernel == "paged_decode" else flash_prefill
    rows = [r for r in MIXED if kernel == "flash_prefill" or r[1] <= 4]
    batch = _paged_batch(rows, block_size, heads[0], heads[1], head_dim, dtype)
    for window, softcap in [(None, None), (8, None), (None, 20.0)]:
        args = (*batch, head_dim ** -0.5)
        out = fn(*args, sliding_window=window, softcap=softcap)
        ref = reference.paged_attention(*args, sliding_window=window, softcap=softcap)
        torch.testing.assert_close(out, ref, atol=ATOL[dtype], rtol=ATOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_store_kv_matches_reference(dtype):
    from hf_paged.attention.triton.store_kv import store_kv

    cache = torch.randn(9, 16, 4, 128, device="cuda", dtype=dtype)
    expected_k, expected_v = cache.clone(), cache.clone()
    got_k, got_v = cache.clone(), cache.clone()
    key = torch.randn(20, 4, 128, device="cuda", dtype=dtype)
    slots = torch.randperm(9 * 16, device="cuda")[:20]
    slots[::3] = -1
    reference.store_kv(key, -key, expected_k, expected_v, slots)
    store_kv(key, -key, got_k, got_v, slots)
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_on_gpu_matches_stock(dtype):
    from hf_paged.defaults.models import load_default
    from hf_paged.defaults.prompts import chat_inputs

    model, tokenizer = load_default(dtype=dtype, device="cuda")
    inputs = chat_inputs(tokenizer).to("cuda")
    kwargs = dict(max_new_tokens=32, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = model.generate(**inputs, **kwargs)
    model.set_attn_implementation("hf_paged")
    out = model.generate(**inputs, **kwargs)
    worst = max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits))
    if dtype == torch.float32:
        assert torch.equal(out.sequences, ref.sequences)
        assert worst < 1e-3
    else:
        # bf16: a near-tie may flip a token late; the first 8 tokens and the first step's logits must agree.
        width = inputs["input_ids"].shape[1]
        assert torch.equal(out.sequences[:, : width + 8], ref.sequences[:, : width + 8])
        torch.testing.assert_close(out.logits[0], ref.logits[0], atol=0.5, rtol=0.05)
