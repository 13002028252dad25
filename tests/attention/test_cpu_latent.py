"""Absorbed latent attention (MLA) on the native CPU kernel (`cpu_kernel.latent_attention`) against a
torch reference written here.

The pool holds one row per token, `[latent (L) | rotary key (R) | indexer key (I)]`; attention reads
K = the first L + R columns and V = the first L, in place. The reference gathers each sequence's rows
through its block table and computes softmax(q . K^T * scale) @ V in fp64, causal (query i of a run
of q_len sits at position seq_len - q_len + i). The pool starts full of NaN and only the valid
tokens' latent and rotary columns are written, so a read of an unwritten slot, of the indexer
column or past a row's width turns the output into NaN. Tolerance: fp32, 1e-5 absolute and relative.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_paged.attention import cpu_kernel, dispatch, torch_paged
from hf_paged.attention.backend import LayerCall, mask_rule
from hf_paged.attention.workspace import Workspace

pytestmark = pytest.mark.skipif(cpu_kernel.load() is None, reason=f"no CPU kernel: {cpu_kernel.load_error()}")

NUM_SPARE_BLOCKS = 3
# (seq_len, q_len): decode (1) and verify (3) runs mixed, a run that is the whole sequence, a sequence
# with no query this step, lengths that fill a block of 16 exactly (16, 32) or leave one token (17).
DECODE_BATCH = [(54, 1), (17, 3), (1, 1), (97, 3), (16, 0), (32, 1), (3, 3), (33, 3)]
# (L, R, I): the tiny configs' widths, widths that are no multiple of 16 lanes (a partial chunk of K
# and of V, then a NaN indexer column right after), DeepSeek V3's, and V3.2's with its indexer key.
WIDTHS = [(32, 16, 0), (24, 8, 0), (16, 8, 0), (20, 6, 4), (512, 64, 0), (512, 64, 128)]


def make_latent_batch(rows, block_size, num_heads, latent_dim, rope_dim, index_dim=0, seed=0, garbage=float("nan")):
    """A pool of rows [num_blocks, block_size, 1, L + R + I] behind random non-contiguous block tables,
    and the call's tensors: key_cache the rows' first L + R columns, value_cache their first L."""
    gen = torch.Generator().manual_seed(seed)
    width = latent_dim + rope_dim
    used = [-(-seq_len // block_size) for seq_len, _ in rows]
    num_blocks = sum(used) + NUM_SPARE_BLOCKS
    pool = torch.full((num_blocks, block_size, 1, width + index_dim), garbage)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(rows), max(used) + 1, dtype=torch.int32)  # a spare column nobody reads
    taken = 0
    for s, ((seq_len, _), n) in enumerate(zip(rows, used)):
        tables[s, :n] = order[taken:taken + n]
        taken += n
        dense = pool[tables[s, :n].long()].view(-1, width + index_dim)
        dense[:seq_len, :width] = torch.randn(seq_len, width, generator=gen)
        pool[tables[s, :n].long()] = dense.view(n, block_size, 1, width + index_dim)
    cu = [0]
    for _, q_len in rows:
        cu.append(cu[-1] + q_len)
    key_cache = pool[..., :width]
    return SimpleNamespace(
        query=torch.randn(cu[-1], num_heads, width, generator=gen) * 2, pool=pool, key_cache=key_cache,
        value_cache=key_cache[..., :latent_dim], latent_dim=latent_dim, block_tables=tables,
        seq_lens=torch.tensor([n for n, _ in rows], dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        max_seqlen_q=max(q for _, q in rows), max_seqlen_k=max(n for n, _ in rows), scale=width ** -0.5)


def reference(batch):
    """[num_tokens, num_heads, L] fp64: per sequence, its rows gathered by block table, causal softmax."""
    block_size, width, latent_dim = batch.pool.shape[1], batch.key_cache.shape[-1], batch.latent_dim
    cu, out = batch.cu_seqlens_q.tolist(), []
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        q = batch.query[cu[s]:cu[s + 1]].double()  # [q_len, H, L + R]
        blocks = batch.block_tables[s, :-(-seq_len // block_size)].long()
        rows = batch.pool[blocks].reshape(-1, batch.pool.shape[-1])[:seq_len].double()  # [seq_len, W]
        k, v = rows[:, :width], rows[:, :latent_dim]
        scores = torch.einsum("qhd,kd->qhk", q, k) * batch.scale
        positions = torch.arange(seq_len - q.shape[0], seq_len)
        scores = scores.masked_fill(torch.arange(seq_len)[None, None, :] > positions[:, None, None], float("-inf"))
        out.append(torch.einsum("qhk,kl->qhl", scores.softmax(-1), v))
    return torch.cat(out)


def call_of(batch, **fields):
    return LayerCall(batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens,
                     batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k, batch.scale,
                     latent_dim=batch.latent_dim, **fields)


def assert_matches(out, expected):
    assert out is not None and out.dtype == torch.float32 and out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)  # fp32


def count_calls(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("num_heads", [1, 3, 16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("latent_dim,rope_dim,index_dim", WIDTHS, ids=[f"L{a}R{b}I{c}" for a, b, c in WIDTHS])
def test_decode_and_verify_runs_match_the_reference(latent_dim, rope_dim, index_dim, block_size, num_heads):
    """Decode and verify runs of one step, any width (partial lane chunks read masked), rows wider than
    K (an indexer column after), shuffled block tables: every token matches, nothing unwritten is read."""
    batch = make_latent_batch(DECODE_BATCH, block_size, num_heads, latent_dim, rope_dim, index_dim,
                              seed=latent_dim + block_size + num_heads)
    assert_matches(cpu_kernel.latent_attention(call_of(batch)), reference(batch))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num_splits,heads_per_group", [(1, 6), (3, 6), (7, 4), (2, 1), (19, 5)])
def test_key_splits_and_head_groups_merge(num_splits, heads_per_group, threads):
    """Work cut into key splits (some empty) and head groups (the last one short), on one thread or
    more: the merged partial maxima, denominators and outputs match the reference."""
    batch = make_latent_batch([(300, 1), (130, 3), (5, 2)], 16, 6, 32, 16, 8, seed=num_splits)
    out = cpu_kernel.attend_latent(batch.query, batch.key_cache, 32, batch.block_tables, batch.seq_lens,
                                   batch.cu_seqlens_q, batch.max_seqlen_q, batch.scale, num_splits, heads_per_group,
                                   threads, Workspace())
    assert_matches(out, reference(batch))


def test_partition_spreads_work_over_threads(monkeypatch):
    """Few long sequences are split by keys, then by heads while blocks are too few; one thread takes
    each sequence whole. A call past the threshold runs threaded and still matches."""
    assert cpu_kernel.latent_partition(32, 16, 1, 128, 8) == (1, 16)
    assert cpu_kernel.latent_partition(1, 16, 1, 128, 1) == (1, 16)
    assert cpu_kernel.latent_partition(1, 16, 1, 128, 8) == (32, 16)
    assert cpu_kernel.latent_partition(1, 16, 1, 4, 8) == (1, 4)
    monkeypatch.setattr(cpu_kernel, "LATENT_PARALLEL_MIN_FLOPS", 0)
    batch = make_latent_batch([(700, 1), (90, 3)], 16, 8, 32, 16, seed=3)
    assert_matches(cpu_kernel.latent_attention(call_of(batch)), reference(batch))


def test_scores_that_underflow_and_dominate():
    """Scores far apart: most weights underflow to exactly 0 in the kernel's exp, one key dominates."""
    batch = make_latent_batch([(200, 1), (64, 3)], 16, 4, 32, 16, seed=5)
    batch.query = batch.query * 20
    assert_matches(cpu_kernel.latent_attention(call_of(batch)), reference(batch))


def test_what_it_does_not_take_goes_back_to_the_torch_path():
    """None (the torch path runs it, and names any error) for a prefill run, other dtypes, a mask,
    softcap, sinks, autograd, a V that is not K's prefix, blocks past the kernel's size, and metadata
    that would read outside the tensors; a block id outside the pool is an IndexError."""
    batch = make_latent_batch(DECODE_BATCH, 16, 3, 32, 16, seed=1)
    assert cpu_kernel.latent_attention(call_of(batch)) is not None
    prefill = make_latent_batch([(40, 17), (20, 1)], 16, 3, 32, 16, seed=2)
    assert cpu_kernel.latent_attention(call_of(prefill)) is None
    cu_short = batch.cu_seqlens_q.clone()
    cu_short[-1] -= 1
    declined = [
        dict(mask=mask_rule(window=8)), dict(softcap=5.0), dict(sinks=torch.zeros(3)),
        dict(query=batch.query.double()), dict(value_cache=batch.value_cache.clone()),
        dict(query=batch.query.clone().requires_grad_(True)),
        dict(max_seqlen_q=1),  # runs of 3 past what the caller said: scratch sized for 1
        dict(block_tables=batch.block_tables[:, :2]),  # 97 tokens need 7 blocks
        dict(cu_seqlens_q=cu_short),  # the last token belongs to no sequence
        dict(block_tables=batch.block_tables.long()),
    ]
    for fields in declined:
        call = call_of(batch)
        for name, value in fields.items():
            setattr(call, name, value)
        assert cpu_kernel.latent_attention(call) is None, fields
    big = make_latent_batch([(200, 1)], 128, 3, 32, 16, seed=3)
    assert cpu_kernel.latent_attention(call_of(big)) is None
    for bad in (batch.pool.shape[0], -1):
        batch.block_tables[1, 0] = bad
        with pytest.raises(IndexError, match="outside the pool"):
            cpu_kernel.latent_attention(call_of(batch))


def dispatch_latent(batch):
    return dispatch.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
                                    batch.seq_lens, batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k,
                                    batch.scale, latent_dim=batch.latent_dim)


def test_dispatch_runs_a_decode_step_on_the_native_kernel(monkeypatch):
    """HF_PAGED_BACKEND=cpu: a latent decode/verify step goes to the native kernel, once, and matches."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "cpu")
    native = count_calls(monkeypatch, cpu_kernel, "attend_latent")
    torch_path = count_calls(monkeypatch, torch_paged, "paged_attention")
    batch = make_latent_batch(DECODE_BATCH, 16, 16, 32, 16, 8, seed=4)
    assert_matches(dispatch_latent(batch), reference(batch))
    assert (len(native), len(torch_path)) == (1, 0)


def test_dispatch_sends_a_prefill_step_to_the_torch_path(monkeypatch):
    """A step with a prefill run (q_len past MAX_DECODE_QUERY_LEN) goes to the torch path, and matches."""
    monkeypatch.setenv("HF_PAGED_BACKEND", "cpu")
    native = count_calls(monkeypatch, cpu_kernel, "attend_latent")
    torch_path = count_calls(monkeypatch, torch_paged, "paged_attention")
    batch = make_latent_batch([(60, 20), (33, 1), (17, 3)], 16, 4, 32, 16, 8, seed=6)
    assert_matches(dispatch_latent(batch), reference(batch))
    assert (len(native), len(torch_path)) == (0, 1)
