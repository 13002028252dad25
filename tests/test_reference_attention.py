"""The torch reference kernels (`hf_paged.kernels.reference`) against a naive dense attention.

Every case builds a paged KV pool by hand: random K/V per sequence, a random non-contiguous block
table per sequence (a permutation of the pool, with spare blocks nobody owns), and a pool that
starts out full of large garbage, so a read outside a sequence's valid range swamps the output. The
K/V rows go in through `store_kv` with a slot mapping that also carries slot -1 tokens, which must
be dropped. The oracle never touches the pool: it attends over each sequence's dense K/V, in fp64,
with the mask written out position by position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from hf_paged import kernels
from hf_paged.kernels import reference

GARBAGE = 1e4  # magnitude of never-written slots; fits fp16, and any unmasked read of one shows up
NUM_SPARE_BLOCKS = 3  # blocks in the pool that no sequence owns

# Tolerances by dtype (atol, rtol). The oracle runs in fp64 on the same (already rounded) inputs, so
# fp32 only sees fp32 accumulation error; fp16 also rounds the output and SDPA's fp16 matmuls.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 2e-2)}

# (seq_len, q_len) rows of one mixed batch. q_len 0: a sequence with no new tokens this step (empty
# cu_seqlens_q segment, also first and last); 1: decode; 4: speculative verify with k=3; q_len ==
# seq_len: full prefill; the rest: chunked prefill. seq_len 16 and 32 fill their last block exactly
# for block_size 16 (and 32), 17 leaves one token in it.
MIXED_BATCH = [
    (54, 0), (17, 4), (1, 1), (16, 16), (97, 1), (15, 15), (54, 4), (97, 97), (32, 1), (17, 17),
    (54, 20), (16, 0),
]

# (num_q_heads, num_kv_heads): 1:1, 3:1, 5:1, MQA.
HEAD_LAYOUTS = [(4, 4), (6, 2), (10, 2), (5, 1)]


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], after store_kv
    value_cache: torch.Tensor
    expected_key_cache: torch.Tensor  # what the pool must hold after store_kv
    expected_value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    keys: list[torch.Tensor]  # per sequence, dense [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]


def make_paged_batch(rows, block_size, num_q_heads, num_kv_heads, head_dim, dtype, seed, query_scale=1.0):
    """Build the pool, write it through `reference.store_kv`, and return everything a test needs."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    def garbage(*shape):
        # Large, finite, of both signs: a leaked key gives a huge score for some heads and a leaked
        # value moves the output by ~GARBAGE.
        return ((torch.rand(*shape, generator=gen) * 2 - 1) * GARBAGE).to(dtype)

    seq_lens = [s for s, _ in rows]
    q_lens = [q for _, q in rows]
    num_blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(num_blocks_per_seq) + NUM_SPARE_BLOCKS
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(num_blocks_per_seq) + 1  # at least one padding column per row
    # Padding entries name arbitrary blocks in the pool (owned or not): readers must mask them.
    block_tables = torch.randint(0, num_blocks, (len(rows), width), generator=gen, dtype=torch.int32)
    start = 0
    for b, n in enumerate(num_blocks_per_seq):
        block_tables[b, :n] = torch.tensor(perm[start:start + n], dtype=torch.int32)
        start += n

    keys = [randn(s, num_kv_heads, head_dim) for s in seq_lens]
    values = [randn(s, num_kv_heads, head_dim) for s in seq_lens]

    key_cache = garbage(num_blocks, block_size, num_kv_heads, head_dim)
    value_cache = garbage(num_blocks, block_size, num_kv_heads, head_dim)
    expected_key_cache = key_cache.clone()
    expected_value_cache = value_cache.clone()

    # Every position of every sequence, plus a few slot -1 tokens whose rows must land nowhere
    # (in particular not in the pool's last row, which is what index -1 would hit).
    tables = block_tables.tolist()
    slots = [tables[b][p // block_size] * block_size + p % block_size for b, s in enumerate(seq_lens)
             for p in range(s)]
    tok_keys, tok_values = list(keys), list(values)
    expected_key_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.cat(keys)
    expected_value_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.cat(values)
    num_skipped = 5
    tok_keys.append(torch.full((num_skipped, num_kv_heads, head_dim), -7.0, dtype=dtype))
    tok_values.append(torch.full((num_skipped, num_kv_heads, head_dim), 7.0, dtype=dtype))
    slots += [-1] * num_skipped
    order = torch.randperm(len(slots), generator=gen)  # slots are unique, so order must not matter
    slot_mapping = torch.tensor(slots, dtype=torch.int64)[order]
    reference.store_kv(torch.cat(tok_keys)[order], torch.cat(tok_values)[order], key_cache, value_cache,
                       slot_mapping)

    query = (torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen) * query_scale).to(dtype)
    cu_seqlens_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return PagedBatch(
        query=query, key_cache=key_cache, value_cache=value_cache,
        expected_key_cache=expected_key_cache, expected_value_cache=expected_value_cache,
        block_tables=block_tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens),
        keys=keys, values=values,
    )


def naive_attention(query, keys, values, scale, sliding_window=None, softcap=None, sinks=None):
    """Dense causal attention of one sequence's `q_len` new queries over its `seq_len` keys, in fp64.

    query: [q_len, num_q_heads, head_dim]; keys, values: [seq_len, num_kv_heads, head_dim].
    """
    q_len, num_q_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    if q_len == 0:  # no new tokens: nothing to attend (and seq_len may be 0 too)
        return query.new_zeros(0, num_q_heads, values.shape[-1], dtype=torch.float64)
    group = num_q_heads // num_kv_heads
    k = keys.double().repeat_interleave(group, dim=1)  # q head h reads kv head h // group
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = (seq_len - q_len + torch.arange(q_len))[:, None]  # query i's position in the sequence
    p = torch.arange(seq_len)[None, :]  # key positions
    allowed = p <= pos
    if sliding_window is not None:
        allowed &= p > pos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)  # [H, q, 1]
    if sinks is not None:
        sink = sinks.double().view(-1, 1, 1)
        row_max = torch.maximum(row_max, sink)
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - row_max)  # the sink's share of the mass goes nowhere
    return torch.einsum("hqk,khd->qhd", weights / denom, v)


def naive_batch(batch, scale, **features):
    """The oracle for a whole packed batch: [num_tokens, num_q_heads, head_dim] fp64."""
    cu = batch.cu_seqlens_q.tolist()
    outs = [naive_attention(batch.query[cu[b]:cu[b + 1]], batch.keys[b], batch.values[b], scale, **features)
            for b in range(len(batch.keys))]
    return torch.cat(outs)


def run_reference(batch, scale, **features):
    return reference.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k, scale, **features,
    )


def assert_matches(out, expected, dtype):
    atol, rtol = TOLERANCES[dtype]  # fp32 1e-5/1e-5, fp16 1e-2/2e-2
    assert out.dtype == dtype
    assert out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------- #
# paged_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEAD_LAYOUTS, ids=["1to1", "3to1", "5to1", "mqa"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_paged_attention_shapes(block_size, num_q_heads, num_kv_heads, dtype):
    head_dim = 64
    batch = make_paged_batch(MIXED_BATCH, block_size, num_q_heads, num_kv_heads, head_dim, dtype,
                             seed=block_size * 100 + num_q_heads * 10 + num_kv_heads)
    scale = head_dim ** -0.5
    assert_matches(run_reference(batch, scale), naive_batch(batch, scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("use_sinks", [False, True], ids=["nosinks", "sinks"])
@pytest.mark.parametrize("softcap", [None, 20.0], ids=["nocap", "cap20"])
@pytest.mark.parametrize("sliding_window", [None, 8], ids=["nowin", "win8"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_attention_features(block_size, sliding_window, softcap, use_sinks, dtype):
    head_dim, num_q_heads, num_kv_heads = 128, 6, 2
    # Queries scaled up so the scaled scores (std ~4, tails past 15) feel a cap of 20. Not more: fp32
    # error grows with the logits, and std ~8 already pushes a few elements past 1e-5.
    batch = make_paged_batch(MIXED_BATCH, block_size, num_q_heads, num_kv_heads, head_dim, dtype,
                             seed=7 + block_size, query_scale=4.0)
    sinks = None
    if use_sinks:
        sinks = (torch.randn(num_q_heads, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    features = dict(sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    scale = head_dim ** -0.5
    expected = naive_batch(batch, scale, **features)

    # Each feature switched on must move the oracle, or ignoring it in the reference would pass.
    atol, _ = TOLERANCES[dtype]
    for name, value in features.items():
        if value is not None:
            without = naive_batch(batch, scale, **{**features, name: None})
            assert (expected - without).abs().max() > 0.1, f"{name} does not change this case"

    assert_matches(run_reference(batch, scale, **features), expected, dtype)


def test_paged_attention_window_wider_than_sequence_is_plain_causal():
    batch = make_paged_batch(MIXED_BATCH, 16, 6, 2, 64, torch.float32, seed=11)
    scale = 64 ** -0.5
    expected = naive_batch(batch, scale)
    assert_matches(run_reference(batch, scale, sliding_window=97), expected, torch.float32)
    # ...and one position narrower is not: position 96 of the 97-token prefill loses key 0.
    narrower = run_reference(batch, scale, sliding_window=96)
    assert not torch.allclose(narrower, expected.float(), atol=1e-3)


def test_paged_attention_window_of_one_sees_only_itself():
    batch = make_paged_batch(MIXED_BATCH, 16, 6, 2, 64, torch.float32, seed=12)
    out = run_reference(batch, 64 ** -0.5, sliding_window=1)
    # Softmax over a single key: every query's output is its own value row, up to fp32 rounding.
    own = torch.cat([batch.values[b][s - q:].repeat_interleave(3, dim=1)
                     for b, (s, q) in enumerate(MIXED_BATCH)])
    torch.testing.assert_close(out, own, atol=1e-5, rtol=1e-5)  # fp32


@pytest.mark.parametrize("with_features", [False, True], ids=["sdpa", "math"])
def test_paged_attention_loose_bounds_and_empty_sequences(with_features):
    # Rows with seq_len 0 (batch padding) around real ones, and max_seqlen_q / max_seqlen_k passed as
    # upper bounds (the table's full width) rather than exact maxima: neither may change the result.
    rows = [(0, 0), (17, 4), (54, 1), (0, 0), (16, 16)]
    batch = make_paged_batch(rows, 16, 6, 2, 64, torch.float32, seed=17)
    scale = 64 ** -0.5
    features = dict(sliding_window=8, softcap=20.0, sinks=torch.randn(6)) if with_features else {}
    out = reference.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        batch.cu_seqlens_q, batch.max_seqlen_q + 3, batch.block_tables.shape[1] * 16, scale, **features,
    )
    assert_matches(out, naive_batch(batch, scale, **features), torch.float32)


def test_paged_attention_only_empty_queries():
    batch = make_paged_batch([(17, 0), (54, 0)], 16, 6, 2, 64, torch.float32, seed=5)
    out = run_reference(batch, 64 ** -0.5)
    assert out.shape == (0, 6, 64)


def test_paged_attention_through_dispatch(monkeypatch):
    monkeypatch.delenv("HF_PAGED_BACKEND", raising=False)
    batch = make_paged_batch(MIXED_BATCH, 16, 10, 2, 64, torch.float32, seed=13)
    scale = 64 ** -0.5
    sinks = torch.randn(10, generator=torch.Generator().manual_seed(1))
    out = kernels.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k, scale, sliding_window=8, softcap=20.0,
        sinks=sinks,
    )
    assert_matches(out, naive_batch(batch, scale, sliding_window=8, softcap=20.0, sinks=sinks), torch.float32)


# ---------------------------------------------------------------------------------------------- #
# store_kv and gather_kv on their own


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_store_kv_writes_valid_slots_and_nothing_else(block_size, dtype):
    batch = make_paged_batch(MIXED_BATCH, block_size, 5, 1, 64, dtype, seed=21 + block_size)
    # Bitwise: store is a copy. The expected pool is the garbage pool with exactly the valid slots
    # replaced, so a write of a slot -1 row anywhere (e.g. the last row) fails this.
    assert torch.equal(batch.key_cache, batch.expected_key_cache)
    assert torch.equal(batch.value_cache, batch.expected_value_cache)


def test_store_kv_all_skipped_and_empty_leave_cache_untouched():
    gen = torch.Generator().manual_seed(0)
    key_cache = torch.randn(4, 16, 2, 8, generator=gen)
    value_cache = torch.randn(4, 16, 2, 8, generator=gen)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    key = torch.full((3, 2, 8), 5.0)
    reference.store_kv(key, -key, key_cache, value_cache, torch.full((3,), -1, dtype=torch.int64))
    reference.store_kv(key[:0], key[:0], key_cache, value_cache, torch.empty(0, dtype=torch.int64))
    assert torch.equal(key_cache, before_k)
    assert torch.equal(value_cache, before_v)


def test_store_kv_casts_to_cache_dtype():
    key_cache = torch.zeros(2, 4, 1, 8, dtype=torch.float16)
    value_cache = torch.zeros(2, 4, 1, 8, dtype=torch.float16)
    key = torch.randn(2, 1, 8, generator=torch.Generator().manual_seed(0))
    reference.store_kv(key, 2 * key, key_cache, value_cache, torch.tensor([5, -1]))
    assert key_cache.dtype == torch.float16
    assert torch.equal(key_cache[1, 1], key[0].half())
    assert torch.equal(value_cache[1, 1], (2 * key[0]).half())
    assert key_cache.count_nonzero() == key[0].count_nonzero()  # the slot -1 row went nowhere


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_gather_kv(block_size):
    batch = make_paged_batch(MIXED_BATCH, block_size, 3, 1, 64, torch.float32, seed=31 + block_size)
    for cache, dense in ((batch.key_cache, batch.keys), (batch.value_cache, batch.values)):
        out = reference.gather_kv(cache, batch.block_tables, batch.max_seqlen_k)
        assert out.shape == (len(dense), batch.max_seqlen_k, *cache.shape[2:])
        for b, rows in enumerate(dense):
            assert torch.equal(out[b, :rows.shape[0]], rows)  # the sequence, in position order
            # Past seq_len: whatever the padded table names (the documented contract), row by row.
            for p in range(rows.shape[0], batch.max_seqlen_k):
                block = int(batch.block_tables[b, p // block_size])
                assert torch.equal(out[b, p], cache[block, p % block_size])


def test_gather_kv_shorter_than_table():
    batch = make_paged_batch([(54, 1), (17, 1)], 16, 3, 1, 64, torch.float32, seed=41)
    out = reference.gather_kv(batch.key_cache, batch.block_tables, 5)
    assert out.shape == (2, 5, 1, 64)
    assert torch.equal(out[0], batch.keys[0][:5])
    assert torch.equal(out[1], batch.keys[1][:5])


# ---------------------------------------------------------------------------------------------- #
# dispatch


def test_bogus_backend_raises(monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", "bogus")
    with pytest.raises(ValueError, match="HF_PAGED_BACKEND"):
        kernels.backend(torch.device("cpu"))
    key_cache = torch.zeros(2, 4, 1, 8)
    value_cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="HF_PAGED_BACKEND"):
        kernels.store_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), key_cache, value_cache, torch.tensor([0]))
    assert key_cache.count_nonzero() == 0  # refused before writing
    with pytest.raises(ValueError, match="HF_PAGED_BACKEND"):
        kernels.paged_attention(
            torch.ones(1, 1, 8), key_cache, value_cache, torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1, 1, 1.0,
        )


@pytest.mark.parametrize("choice", ["auto", "torch", "TORCH"])
def test_known_backends_pick_torch_on_cpu(monkeypatch, choice):
    monkeypatch.setenv("HF_PAGED_BACKEND", choice)
    assert kernels.backend(torch.device("cpu")) == "torch"
