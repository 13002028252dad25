"""The torch attention backend (`hf_paged.attention.torch_paged`) against the naive oracle (`reference`).

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
from types import SimpleNamespace

import pytest
import torch

from hf_paged.attention import dispatch, reference, torch_paged

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
    """Build the pool, write it through `torch_paged.store_kv`, and return everything a test needs."""
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
    torch_paged.store_kv(torch.cat(tok_keys)[order], torch.cat(tok_values)[order], key_cache, value_cache,
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


def naive_batch(batch, scale, **features):
    """The oracle for a whole packed batch: [num_tokens, num_q_heads, head_dim] fp64."""
    cu = batch.cu_seqlens_q.tolist()
    outs = [reference.causal_attention(batch.query[cu[b]:cu[b + 1]], batch.keys[b], batch.values[b], scale, **features)
            for b in range(len(batch.keys))]
    return torch.cat(outs)


def run_reference(batch, scale, **features):
    return torch_paged.paged_attention(
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


@pytest.mark.parametrize("sliding_window", [None, 9])
@pytest.mark.parametrize("block_size", [1, 16])
def test_key_limits_let_an_image_block_attend_both_ways(block_size, sliding_window, monkeypatch):
    """Gemma 3's images: the queries of a block see every key of the block (up to its end), the others
    stay causal; through the step plan, which takes the torch path even where Triton is asked for."""
    rows = [(54, 20), (17, 4), (97, 1), (40, 40), (16, 0)]
    batch = make_paged_batch(rows, block_size, 6, 2, 16, torch.float32, seed=3)
    limits, blocks = [], {0: [(36, 45)], 1: [(13, 17)], 3: [(0, 5), (20, 36)]}
    for b, (seq_len, q_len) in enumerate(rows):
        own = list(range(seq_len - q_len, seq_len))
        for s, e in blocks.get(b, []):
            own = [e - 1 if s <= p < e else p for p in own]
        limits.append(torch.tensor(own, dtype=torch.long))
    key_limits = torch.cat(limits)
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    step = SimpleNamespace(key_limits=key_limits, seq_lens=batch.seq_lens)
    plan = dispatch.plan(step)
    assert plan.backend == "torch"
    out = dispatch.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                                   batch.seq_lens, batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k, 0.25,
                                   sliding_window=sliding_window, plan=plan)
    cu = batch.cu_seqlens_q.tolist()
    expected = torch.cat([reference.causal_attention(batch.query[cu[b]:cu[b + 1]], batch.keys[b], batch.values[b],
                                                     0.25, sliding_window, key_limits=limits[b])
                          for b in range(len(rows))])
    assert_matches(out, expected, torch.float32)
    causal = naive_batch(batch, 0.25, sliding_window=sliding_window)
    assert (out.double() - causal).abs().max() > 1e-2  # the blocks really changed the answer


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
    out = torch_paged.paged_attention(
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
    out = dispatch.paged_attention(
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
    torch_paged.store_kv(key, -key, key_cache, value_cache, torch.full((3,), -1, dtype=torch.int64))
    torch_paged.store_kv(key[:0], key[:0], key_cache, value_cache, torch.empty(0, dtype=torch.int64))
    assert torch.equal(key_cache, before_k)
    assert torch.equal(value_cache, before_v)


def test_store_kv_casts_to_cache_dtype():
    key_cache = torch.zeros(2, 4, 1, 8, dtype=torch.float16)
    value_cache = torch.zeros(2, 4, 1, 8, dtype=torch.float16)
    key = torch.randn(2, 1, 8, generator=torch.Generator().manual_seed(0))
    torch_paged.store_kv(key, 2 * key, key_cache, value_cache, torch.tensor([5, -1]))
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
        dispatch.backend(torch.device("cpu"))
    key_cache = torch.zeros(2, 4, 1, 8)
    value_cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="HF_PAGED_BACKEND"):
        dispatch.store_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), key_cache, value_cache, torch.tensor([0]))
    assert key_cache.count_nonzero() == 0  # refused before writing
    with pytest.raises(ValueError, match="HF_PAGED_BACKEND"):
        dispatch.paged_attention(
            torch.ones(1, 1, 8), key_cache, value_cache, torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1, 1, 1.0,
        )


@pytest.mark.parametrize("choice", ["torch", "TORCH"])
def test_known_backends_pick_torch_on_cpu(monkeypatch, choice):
    monkeypatch.setenv("HF_PAGED_BACKEND", choice)
    assert dispatch.backend(torch.device("cpu")) == "torch"
    # auto: the native CPU kernel where it builds (tests/attention/test_cpu_kernel.py), else torch
    monkeypatch.setenv("HF_PAGED_BACKEND", "auto")
    assert dispatch.backend(torch.device("cpu")) in ("cpu", "torch")


# ---------------------------------------------------------------------------------------------- #
# The grouped plan: buckets of short queries, one call per long query, the workspace, autograd,
# and non-finite values in slots that are gathered (whole blocks) but must be masked off.

# (seq_len, q_len) rows of a step that splits into many groups: twelve decodes with KV lengths from
# 1 to 300 (several buckets, some with more than one sequence, so rows get padded to the bucket's
# longest), speculative-verify rows with 4 and 16 queries (16 is the largest "short" query; (16, 16)
# is a short full prefill, q_len == seq_len), and four long queries (17 > 16), each its own call:
# full prefills (17, 17) and (60, 60) and chunks on a cached prefix (77, 17) and (200, 60). A q_len
# 0 row sits in the middle.
BUCKETED_BATCH = [
    (300, 1), (17, 17), (260, 1), (190, 1), (64, 4), (150, 1), (130, 16), (101, 1), (77, 17), (70, 1),
    (45, 1), (0, 0), (40, 4), (30, 1), (60, 60), (17, 1), (16, 16), (9, 1), (200, 60), (3, 1), (1, 1),
]


def make_plan(batch, block_size, workspace=None):
    return torch_paged.AttentionPlan(batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, batch.max_seqlen_q,
                                   batch.max_seqlen_k, block_size, workspace=workspace)


def run_with_plan(batch, scale, plan, **features):
    return torch_paged.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
        batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k, scale, plan=plan, **features,
    )


@pytest.mark.parametrize("feature", ["none", "window", "all"])  # SDPA unmasked/masked, explicit math
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEAD_LAYOUTS[:3], ids=["1to1", "3to1", "5to1"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_paged_attention_bucketed_mixed_step(block_size, num_q_heads, num_kv_heads, feature):
    head_dim = 32
    batch = make_paged_batch(BUCKETED_BATCH, block_size, num_q_heads, num_kv_heads, head_dim, torch.float32,
                             seed=51 + block_size + num_q_heads, query_scale=2.0)
    scale = head_dim ** -0.5
    sinks = torch.randn(num_q_heads, generator=torch.Generator().manual_seed(4)) * 2
    features = {"none": {}, "window": dict(sliding_window=8),
                "all": dict(sliding_window=8, softcap=20.0, sinks=sinks)}[feature]
    expected = naive_batch(batch, scale, **features)

    plan = make_plan(batch, block_size, workspace=torch_paged.Workspace())
    # The split really happens: each long query alone, the short ones in several buckets, at least
    # two of which batch more than one sequence (so rows are padded to a longer KV length).
    q_lens = [q for _, q in BUCKETED_BATCH]
    num_long = sum(q > 16 for q in q_lens)
    assert len(plan.groups) > 2
    assert len(plan.groups) >= num_long + 3
    assert sum(g.num_seqs > 1 for g in plan.groups) >= 2
    # ...and every token is attended by exactly one group.
    covered = torch.cat([g.token_index for g in plan.groups]).sort().values
    assert torch.equal(covered, torch.arange(sum(q_lens)))

    assert_matches(run_with_plan(batch, scale, plan, **features), expected, torch.float32)  # 1e-5
    # The same plan again (a second layer), and no plan at all, give the same answer.
    assert_matches(run_with_plan(batch, scale, plan, **features), expected, torch.float32)
    assert_matches(run_reference(batch, scale, **features), expected, torch.float32)


@pytest.mark.parametrize("feature", ["none", "window", "softcap", "sinks", "all"])
@pytest.mark.parametrize("block_size,seq_len,num_q_heads,num_kv_heads",
                         [(16, 32, 6, 2), (16, 48, 4, 4), (1, 23, 10, 2), (32, 64, 5, 1)],
                         ids=["b16s32", "b16s48", "b1s23", "b32s64"])
def test_paged_attention_uniform_decode(block_size, seq_len, num_q_heads, num_kv_heads, feature):
    # Every sequence decodes one token and has exactly a whole number of blocks: the case where the
    # plan drops the mask. A sliding window (or softcap/sinks) must still be honoured there.
    head_dim = 32
    rows = [(seq_len, 1)] * 6
    batch = make_paged_batch(rows, block_size, num_q_heads, num_kv_heads, head_dim, torch.float32,
                             seed=61 + block_size + seq_len, query_scale=4.0)
    scale = head_dim ** -0.5
    # Sink logits near the largest scores (query_scale 4 puts them around 5-10), so they take real mass.
    sinks = torch.randn(num_q_heads, generator=torch.Generator().manual_seed(6)) * 2 + 6
    features = {
        "none": {}, "window": dict(sliding_window=7), "softcap": dict(softcap=5.0), "sinks": dict(sinks=sinks),
        "all": dict(sliding_window=7, softcap=5.0, sinks=sinks),
    }[feature]
    expected = naive_batch(batch, scale, **features)
    for name in features:  # each feature moves the oracle here, so ignoring it cannot pass
        without = naive_batch(batch, scale, **{**features, name: None})
        assert (expected - without).abs().max() > 0.1, f"{name} does not change this case"

    plan = make_plan(batch, block_size, workspace=torch_paged.Workspace())
    assert len(plan.groups) == 1 and plan.groups[0].is_uniform_decode  # the special case is hit
    assert_matches(run_with_plan(batch, scale, plan, **features), expected, torch.float32)  # 1e-5
    # The memoised mask of one window must not leak into another call on the same plan.
    if "sliding_window" in features:
        plain = {**features, "sliding_window": None}
        assert_matches(run_with_plan(batch, scale, plan, **plain), naive_batch(batch, scale, **plain), torch.float32)
        assert_matches(run_with_plan(batch, scale, plan, **features), expected, torch.float32)


def test_paged_attention_workspace_reuse_across_shapes_and_dtypes():
    ws = torch_paged.Workspace()
    scale = 32 ** -0.5

    def check(rows, block_size, heads, dtype, seed):
        batch = make_paged_batch(rows, block_size, *heads, 32, dtype, seed=seed)
        out = run_with_plan(batch, scale, make_plan(batch, block_size, workspace=ws))
        assert_matches(out, naive_batch(batch, scale), dtype)  # fp32 1e-5, fp16 1e-2
        return batch, out

    # Small first (the buffer is created), then bigger (it must regrow), then smaller again (a view of
    # the front of the big one), then another dtype (its own buffer), then a different head layout.
    small_rows = [(9, 1), (30, 4), (3, 1)]
    _, out_small = check(small_rows, 16, (4, 4), torch.float32, seed=71)
    small_copy = out_small.clone()
    big, out_big = check(BUCKETED_BATCH, 16, (6, 2), torch.float32, seed=72)
    big_copy = out_big.clone()
    assert ws._buffers, "the workspace was never used"
    _, out_small2 = check(small_rows, 32, (4, 4), torch.float32, seed=73)
    _, out_half = check(MIXED_BATCH, 16, (6, 2), torch.float16, seed=74)
    check([(40, 1), (17, 17), (64, 3)], 16, (10, 2), torch.float32, seed=75)

    # Earlier outputs own their memory: later calls through the same buffers did not change them.
    assert torch.equal(out_small, small_copy)
    assert torch.equal(out_big, big_copy)
    buffers = {buf.untyped_storage().data_ptr() for buf in ws._buffers.values()}
    for out in (out_small, out_big, out_small2, out_half):
        assert out.untyped_storage().data_ptr() not in buffers
    # Re-running the big step on the now warm workspace is bitwise the same as the first run.
    again = run_with_plan(big, scale, make_plan(big, 16, workspace=ws))
    assert torch.equal(again, big_copy)


def _paged_batch_with_grad(rows, block_size, num_q_heads, num_kv_heads, head_dim, seed, query_grad=True):
    """A batch whose K/V enter the pool through `store_kv` from leaf tensors that require grad (as
    in training), plus fp64 leaf copies for the oracle."""
    batch = make_paged_batch(rows, block_size, num_q_heads, num_kv_heads, head_dim, torch.float32, seed=seed)
    keys = [k.clone().requires_grad_() for k in batch.keys]
    values = [v.clone().requires_grad_() for v in batch.values]
    tables = batch.block_tables.tolist()
    slots = torch.tensor([tables[b][p // block_size] * block_size + p % block_size
                          for b, (s, _) in enumerate(rows) for p in range(s)], dtype=torch.int64)
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()  # garbage + the rows
    torch_paged.store_kv(torch.cat(keys), torch.cat(values), key_cache, value_cache, slots)
    query = batch.query.clone().requires_grad_(query_grad)
    return batch, query, keys, values, key_cache, value_cache


@pytest.mark.parametrize("with_features", [False, True], ids=["sdpa", "math"])
def test_paged_attention_grad_matches_naive_and_bypasses_workspace(with_features):
    rows = [(54, 1), (17, 4), (9, 1), (40, 20), (16, 16), (33, 1)]
    block_size, num_q_heads, num_kv_heads, head_dim = 16, 6, 2, 32
    batch, query, keys, values, key_cache, value_cache = _paged_batch_with_grad(
        rows, block_size, num_q_heads, num_kv_heads, head_dim, seed=81)
    scale = head_dim ** -0.5
    features = dict(sliding_window=8, softcap=20.0, sinks=torch.randn(num_q_heads)) if with_features else {}
    weights = torch.randn(batch.query.shape, generator=torch.Generator().manual_seed(8))

    plan = make_plan(batch, block_size, workspace=torch_paged.Workspace())  # must be ignored under autograd
    with torch.enable_grad():
        out = torch_paged.paged_attention(query, key_cache, value_cache, batch.block_tables, batch.seq_lens,
                                        batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k, scale,
                                        plan=plan, **features)
        (out * weights).sum().backward()

        q64 = batch.query.double().requires_grad_()
        k64 = [k.detach().double().requires_grad_() for k in keys]
        v64 = [v.detach().double().requires_grad_() for v in values]
        cu = batch.cu_seqlens_q.tolist()
        expected = torch.cat([reference.causal_attention(q64[cu[b]:cu[b + 1]], k64[b], v64[b], scale, **features)
                              for b in range(len(rows))])
        (expected * weights.double()).sum().backward()

    assert_matches(out.detach(), expected.detach(), torch.float32)  # 1e-5
    torch.testing.assert_close(query.grad.double(), q64.grad, atol=1e-5, rtol=1e-5)
    for got, want in zip(keys + values, k64 + v64):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=1e-5, rtol=1e-5)
    # The garbage-filled pool slots never get a gradient path: all K/V grads were accounted above,
    # and the cache tensors themselves are not leaves.
    assert key_cache.grad_fn is not None and value_cache.grad_fn is not None


def test_paged_attention_grad_through_cache_only_with_workspace():
    # K/V require grad (e.g. adapters on k_proj/v_proj only) but the query does not. Autograd still
    # keeps the gathered K/V, so the workspace must not be used for them either.
    rows = [(54, 1), (17, 4), (40, 20)]
    block_size, num_q_heads, num_kv_heads, head_dim = 16, 6, 2, 32
    batch, query, keys, values, key_cache, value_cache = _paged_batch_with_grad(
        rows, block_size, num_q_heads, num_kv_heads, head_dim, seed=82, query_grad=False)
    scale = head_dim ** -0.5
    plan = make_plan(batch, block_size, workspace=torch_paged.Workspace())
    with torch.enable_grad():
        out = torch_paged.paged_attention(query, key_cache, value_cache, batch.block_tables, batch.seq_lens,
                                        batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k, scale,
                                        plan=plan)
        out.sum().backward()
        v64 = [v.detach().double().requires_grad_() for v in values]
        cu = batch.cu_seqlens_q.tolist()
        expected = torch.cat([reference.causal_attention(batch.query[cu[b]:cu[b + 1]], batch.keys[b], v64[b], scale)
                              for b in range(len(rows))])
        expected.sum().backward()
    assert_matches(out.detach(), expected.detach(), torch.float32)  # 1e-5
    for got, want in zip(values, v64):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=1e-5, rtol=1e-5)


def _poison_unused_slots(batch, rows, block_size, pad_block, fill):
    """Fill every pool slot that holds no sequence's token with `fill` (NaN or inf), and point every
    padding entry of the block table at block 0, which is made either the partly filled last block
    of some sequence (its tail is poison, its head another sequence's K/V) or a block nobody owns."""
    seq_lens = [s for s, _ in rows]
    num_blocks = batch.key_cache.shape[0]
    owned = [math.ceil(s / block_size) for s in seq_lens]
    tables = batch.block_tables
    if pad_block == "partial":
        target = next(int(tables[b, n - 1]) for b, (s, n) in enumerate(zip(seq_lens, owned)) if s % block_size)
    else:
        used = {int(tables[b, i]) for b, n in enumerate(owned) for i in range(n)}
        target = next(i for i in range(num_blocks) if i not in used)
    swap = torch.arange(num_blocks)  # relabel block `target` as block 0 and vice versa
    swap[0], swap[target] = target, 0
    tables = swap[tables.long()].to(torch.int32)
    batch.key_cache = batch.key_cache[swap].clone()
    batch.value_cache = batch.value_cache[swap].clone()
    for b, n in enumerate(owned):
        tables[b, n:] = 0
    batch.block_tables = tables
    valid = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for b, s in enumerate(seq_lens):
        pos = torch.arange(s)
        valid[tables[b].long()[pos // block_size] * block_size + pos % block_size] = True
    for cache in (batch.key_cache, batch.value_cache):
        cache.view(-1, *cache.shape[2:])[~valid] = fill
    assert not bool(valid.view(num_blocks, block_size)[0].all())  # block 0 does hold poison
    return batch


@pytest.mark.parametrize("fill", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("with_features", [False, True], ids=["sdpa", "math"])
@pytest.mark.parametrize("block_size,pad_block", [(16, "partial"), (32, "partial"), (16, "unowned"), (1, "unowned")])
def test_paged_attention_poisoned_unused_slots_are_masked(block_size, pad_block, with_features, fill):
    # Block-granular gathers read whole blocks, slots past seq_len and padding entries of the table
    # included; whatever sits there (stale NaN/inf from a freed block's previous owner) must be masked
    # off, not multiplied by a zero probability (0 * NaN = NaN).
    rows = MIXED_BATCH
    batch = make_paged_batch(rows, block_size, 6, 2, 32, torch.float32, seed=91 + block_size)
    batch = _poison_unused_slots(batch, rows, block_size, pad_block, fill)
    scale = 32 ** -0.5
    features = dict(sliding_window=8, softcap=20.0, sinks=torch.randn(6)) if with_features else {}
    out = run_with_plan(batch, scale, make_plan(batch, block_size, workspace=torch_paged.Workspace()), **features)
    assert torch.isfinite(out).all(), f"{int((~torch.isfinite(out)).any(-1).any(-1).sum())} tokens not finite"
    assert_matches(out, naive_batch(batch, scale, **features), torch.float32)  # 1e-5


# ---------------------------------------------------------------------------------------------- #
# K and V of different head widths (multi-head latent attention caches a 512-wide latent as K and a
# 64-wide rotary key as V; an absorbed MLA attends with 576-wide K and 512-wide V)


def make_unequal_kv_batch(rows, block_size, num_q_heads, num_kv_heads, head_dim, head_dim_v, seed):
    """A batch whose V rows are `head_dim_v` wide: K and the query from one `make_paged_batch`, V from
    another with the same seed (the block tables are drawn before anything head_dim-sized)."""
    k_batch = make_paged_batch(rows, block_size, num_q_heads, num_kv_heads, head_dim, torch.float32, seed)
    v_batch = make_paged_batch(rows, block_size, num_q_heads, num_kv_heads, head_dim_v, torch.float32, seed)
    assert torch.equal(k_batch.block_tables, v_batch.block_tables)
    k_batch.value_cache, k_batch.expected_value_cache = v_batch.value_cache, v_batch.expected_value_cache
    k_batch.values = v_batch.values
    return k_batch


UNEQUAL_FEATURES = {"none": {}, "window": dict(sliding_window=8),
                    "all": dict(sliding_window=8, softcap=20.0, sinks=torch.linspace(-1.0, 2.0, 6))}


@pytest.mark.parametrize("feature", list(UNEQUAL_FEATURES))  # SDPA (causal, unmasked, masked), explicit math
@pytest.mark.parametrize("head_dim,head_dim_v", [(24, 40), (48, 16)], ids=["v-wider", "v-narrower"])
@pytest.mark.parametrize("block_size,num_q_heads,num_kv_heads", [(16, 6, 2), (1, 6, 1)], ids=["bs16-3to1", "bs1-mqa"])
def test_paged_attention_unequal_kv_head_dims(block_size, num_q_heads, num_kv_heads, head_dim, head_dim_v, feature):
    batch = make_unequal_kv_batch(MIXED_BATCH, block_size, num_q_heads, num_kv_heads, head_dim, head_dim_v,
                                  seed=101 + block_size + head_dim)
    scale = head_dim ** -0.5
    features = UNEQUAL_FEATURES[feature]
    expected = reference.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                                         batch.seq_lens, batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k,
                                         scale, **features)
    assert expected.shape == (batch.query.shape[0], num_q_heads, head_dim_v)
    for workspace in (None, torch_paged.Workspace()):  # fresh gathers, and reused per-cache scratch buffers
        out = run_with_plan(batch, scale, make_plan(batch, block_size, workspace=workspace), **features)
        assert out.shape == expected.shape and out.dtype == torch.float32
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)  # fp32
    torch.testing.assert_close(expected.double(), naive_batch(batch, scale, **features), atol=1e-5, rtol=1e-5)


def test_store_kv_unequal_kv_head_dims_casts_each_cache():
    gen = torch.Generator().manual_seed(7)
    key_cache = torch.randn(3, 4, 2, 16, generator=gen)
    value_cache = torch.randn(3, 4, 2, 8, generator=gen).half()
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    key, value = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 8, generator=gen)
    slot_mapping = torch.tensor([3, -1, 11, 0, -1])
    torch_paged.store_kv(key, value, key_cache, value_cache, slot_mapping)
    reference.store_kv(key, value, expected_k, expected_v, slot_mapping)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)  # bitwise
    assert torch.equal(value_cache[2, 3], value[2].half())


def test_gather_dense_unequal_kv_head_dims():
    """The dense path (sdpa/eager over a PagedCache) gathers K and V at their own widths."""
    from hf_paged.attention.metadata import DENSE, build_step_metadata

    gen = torch.Generator().manual_seed(8)
    key_cache, value_cache = torch.randn(4, 2, 1, 16, generator=gen), torch.randn(4, 2, 1, 8, generator=gen)
    # Row 0: 3 tokens in blocks [2, 0]; row 1: 1 token in block [3], left-padded by 2 columns.
    step = build_step_metadata(mode=DENSE, q_len=3, num_columns=3, real_cols=[range(0, 3), range(2, 3)],
                               slots=[[4, 5, 0], [6]], block_tables=[[2, 0], [3]], seq_lens=[3, 1], copies=[],
                               device=torch.device("cpu"))
    k, v = torch_paged.gather_dense(key_cache, value_cache, step, torch.float32)
    assert k.shape == (2, 1, 3, 16) and v.shape == (2, 1, 3, 8)
    flat_k, flat_v = key_cache.flatten(0, 1), value_cache.flatten(0, 1)
    assert torch.equal(k[0, 0], flat_k[[4, 5, 0], 0]) and torch.equal(v[0, 0], flat_v[[4, 5, 0], 0])
    assert torch.equal(v[1, 0, 2], flat_v[6, 0]) and not v[1, 0, :2].any() and not k[1, 0, :2].any()


def test_check_kv_cache_dtype_refuses_only_what_triton_cannot_read(monkeypatch):
    """`PagedCacheConfig(kv_cache_dtype=...)` is checked before any forward: the torch backend reads
    any float cache; the Triton kernels read the model's dtype, or a 16-bit cache under fp32."""
    from transformers import LlamaConfig

    from hf_paged.hf.cache import PagedCache

    cpu = torch.device("cpu")
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    dispatch.check_kv_cache_dtype(torch.float16, torch.float32, cpu)
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what makes the triton backend legal on CPU
    for model_dtype, kv_dtype in ((torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                                  (torch.float16, torch.float16)):
        dispatch.check_kv_cache_dtype(model_dtype, kv_dtype, cpu)
    for model_dtype, kv_dtype in ((torch.float16, torch.float32), (torch.bfloat16, torch.float16)):
        with pytest.raises(ValueError, match="kv_cache_dtype=.* use kv_cache_dtype='auto', or HF_PAGED_BACKEND=torch"):
            dispatch.check_kv_cache_dtype(model_dtype, kv_dtype, cpu)

    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    cache = PagedCache(config, kv_cache_dtype="float32")
    with pytest.raises(ValueError, match="kv_cache_dtype='float32' under a torch.float16 model"):
        cache.plan_step(batch_size=1, q_len=3, mode="paged", device=cpu, dtype=torch.float16)
    assert cache.seqs == [] and cache.pool.num_used_blocks == 0  # refused before anything changed
    cache.plan_step(batch_size=1, q_len=3, mode="dense", device=cpu, dtype=torch.float16)  # dense: any dtype


# ---------------------------------------------------------------------------------------------- #
# One sequence on consecutive blocks: K/V are read as a view of the pool, not gathered


def make_consecutive_batch(seq_len, q_len, block_size, first_block, num_q_heads, num_kv_heads, head_dim, fill, seed):
    """One sequence stored on blocks first_block, first_block + 1, ...; every other slot of the pool
    (its last block's tail, the blocks around it) holds `fill`, and the table's padding names a
    poisoned block. Returns the batch fields and the dense K/V the oracle attends over."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = math.ceil(seq_len / block_size)
    pool_blocks = first_block + num_blocks + 2
    key_cache = torch.full((pool_blocks, block_size, num_kv_heads, head_dim), fill)
    value_cache = torch.full_like(key_cache, fill)
    keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
    values = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
    slots = torch.arange(seq_len) + first_block * block_size
    torch_paged.store_kv(keys, values, key_cache, value_cache, slots)
    table = list(range(first_block, first_block + num_blocks)) + [pool_blocks - 1] * 2  # padding: poison
    return dict(
        query=torch.randn(q_len, num_q_heads, head_dim, generator=gen), key_cache=key_cache,
        value_cache=value_cache, block_tables=torch.tensor([table], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32), cu_seqlens_q=torch.tensor([0, q_len], dtype=torch.int32),
        max_seqlen_q=q_len, max_seqlen_k=seq_len), keys, values


CONSECUTIVE_FEATURES = {"none": {}, "window": dict(sliding_window=5),
                        "all": dict(sliding_window=5, softcap=20.0, sinks=torch.linspace(-1.0, 2.0, 6))}


@pytest.mark.parametrize("feature", list(CONSECUTIVE_FEATURES))
@pytest.mark.parametrize("fill", [float("nan"), GARBAGE], ids=["nan", "garbage"])
# decode (tail partly filled, exactly full), speculative verify, chunk after a prefix, whole prefill
@pytest.mark.parametrize("seq_len,q_len", [(37, 1), (32, 1), (1, 1), (37, 4), (40, 9), (23, 23)])
@pytest.mark.parametrize("block_size,first_block", [(16, 0), (16, 3), (1, 2)])
def test_paged_attention_single_sequence_on_consecutive_blocks_reads_a_view(block_size, first_block, seq_len, q_len,
                                                                           fill, feature):
    args, keys, values = make_consecutive_batch(seq_len, q_len, block_size, first_block, 6, 2, 16, fill,
                                                seed=seq_len * 7 + q_len + first_block)
    features = CONSECUTIVE_FEATURES[feature]
    plan = torch_paged.AttentionPlan(args["block_tables"], args["seq_lens"], args["cu_seqlens_q"], q_len, seq_len,
                                     block_size, workspace=torch_paged.Workspace())
    assert [g.first_block for g in plan.groups] == [first_block]  # the view path, not a gather
    out = torch_paged.paged_attention(**args, scale=0.25, plan=plan, **features)
    expected = reference.causal_attention(args["query"], keys, values, 0.25, **features)
    assert torch.isfinite(out).all()
    assert_matches(out, expected, torch.float32)  # 1e-5
    # The same sequence on a shuffled table takes the gather and agrees.
    perm = torch.randperm(args["key_cache"].shape[0], generator=torch.Generator().manual_seed(1))
    inverse = torch.argsort(perm)
    shuffled = dict(args, key_cache=args["key_cache"][perm], value_cache=args["value_cache"][perm],
                    block_tables=inverse[args["block_tables"].long()].to(torch.int32))
    gathered_plan = torch_paged.AttentionPlan(shuffled["block_tables"], shuffled["seq_lens"], shuffled["cu_seqlens_q"],
                                              q_len, seq_len, block_size)
    if math.ceil(seq_len / block_size) > 1:
        assert gathered_plan.groups[0].first_block is None
    torch.testing.assert_close(torch_paged.paged_attention(**shuffled, scale=0.25, plan=gathered_plan, **features),
                               out, atol=1e-5, rtol=1e-5)


def test_step_metadata_knows_on_the_host_whether_any_slot_is_skipped():
    from hf_paged.attention.metadata import build_packed_metadata

    def meta(slots):
        return build_packed_metadata(q_lens=[len(s) for s in slots], slots=slots, block_tables=[[0], [1]],
                                     seq_lens=[len(s) for s in slots], copies=[], device=torch.device("cpu"))

    assert meta([[0, 1], [16]]).has_skipped_slots is False
    assert meta([[-1, 1], [16]]).has_skipped_slots is True
    # The promise skips the check: every row is written.
    key_cache, value_cache = torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 2)
    rows = torch.arange(6.0).view(3, 1, 2)
    torch_paged.store_kv(rows, -rows, key_cache, value_cache, torch.tensor([0, 5, 7]), has_skipped_slots=False)
    assert torch.equal(key_cache.view(-1, 1, 2)[[0, 5, 7]], rows)
    assert torch.equal(value_cache.view(-1, 1, 2)[[0, 5, 7]], -rows)


def test_unpacked_attention_output_is_contiguous_as_stock_attention_returns_it():
    """A model may `view` the attention's output (Dory does): the single-sequence path's result, a view
    over heads-first workspace rows, reaches the model contiguous."""
    from hf_paged.attention.metadata import build_packed_metadata

    meta = build_packed_metadata(q_lens=[5], slots=[[0, 1, 2, 3, 4]], block_tables=[[0]], seq_lens=[5], copies=[],
                                 device=torch.device("cpu"))
    heads_first = torch.randn(4, 5, 8)  # [heads, tokens, dim]
    out = meta.unpack(heads_first.transpose(0, 1))  # [tokens, heads, dim], not contiguous
    assert out.shape == (1, 5, 4, 8) and out.is_contiguous()
    assert torch.equal(out[0], heads_first.transpose(0, 1))
    assert out.view(1, 5, -1).shape == (1, 5, 32)
