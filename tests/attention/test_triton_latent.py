"""The Triton absorbed latent-attention (MLA) kernel against a plain torch reference.

Run under Triton's interpreter on CPU tensors (`TRITON_INTERPRET=1`, set by conftest.py when there
is no GPU), in fp32 and fp16 (the interpreter has no bf16 / fp8 dots). Each batch is a pool of latent
rows `[num_blocks, block_size, 1, W]` (latent | rotary key | W - L - R indexer columns) full of large
garbage wherever no token was written, read through shuffled block tables whose unused entries are
garbage ids too, so any read of the wrong slot, column or block swamps the output. The kernel sees
`rows[..., :L + R]`, a strided view when W > L + R. The oracle gathers each sequence's rows through
its block table and computes softmax(q . K^T * scale) @ V in fp32, with V = K[:, :L].

The interpreter is slow: the cases combine the awkward values instead of taking their product.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="interpreter tests of the Triton kernels: need TRITON_INTERPRET=1 (conftest sets it without CUDA)",
)

triton = pytest.importorskip("triton")

from hf_paged.attention import dispatch  # noqa: E402
from hf_paged.attention.triton import latent  # noqa: E402
from hf_paged.attention.triton.latent import default_num_splits, latent_attention  # noqa: E402

GARBAGE = 1e4  # never-written slots and columns; fits fp16, and any unmasked read swamps the output
# (atol, rtol) against the fp32 reference on the same rounded inputs. fp32: the same sums in another
# order (~1e-6 observed). fp16: softmax weights rounded to fp16 for P @ V, and the output rounded.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2)}

# (seq_len, q_len) rows: decode (q_len 1), verify (3), prefill (20) in one call, sequences of one
# token, around block edges (15/16/17, 33), with q_len 0 rows, and a sequence that is all new tokens.
MIXED = [(17, 1), (40, 3), (20, 20), (1, 1), (0, 0), (54, 20), (16, 3), (33, 0)]
FEW = [(17, 1), (9, 3), (5, 5)]  # L=512: few tokens keep the interpreter quick


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_q_heads, L + R]
    rows: torch.Tensor  # [num_blocks, block_size, 1, W]
    block_tables: torch.Tensor  # [num_seqs, width] int32, garbage past each sequence
    seq_lens: torch.Tensor  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    latent_dim: int
    rope_dim: int

    @property
    def key_cache(self) -> torch.Tensor:  # [num_blocks, block_size, 1, L + R]
        return self.rows[..., :self.latent_dim + self.rope_dim]


def make_batch(rows, block_size, num_q_heads, latent_dim, rope_dim, index_dim, dtype, seed, cache_dtype=None,
               strided_query=False):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [s for s, _ in rows]
    q_lens = [q for _, q in rows]
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    width = max(blocks_per_seq) + 2
    block_tables = torch.randint(-2**31, 2**31 - 1, (len(rows), width), generator=gen, dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = perm[start:start + n]
        start += n

    head_dim = latent_dim + rope_dim
    pool = (torch.rand(num_blocks, block_size, 1, head_dim + index_dim, generator=gen) * 2 - 1) * GARBAGE
    tables = block_tables.tolist()
    for b, s in enumerate(seq_lens):
        for p in range(s):
            pool[tables[b][p // block_size], p % block_size, 0, :head_dim] = torch.randn(head_dim, generator=gen)
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_q_heads + 2, head_dim, generator=gen) * 2.0
    query = query[:, 1:num_q_heads + 1] if strided_query else query[:, :num_q_heads].contiguous()
    return Batch(query.to(dtype), pool.to(cache_dtype or dtype), block_tables,
                 torch.tensor(seq_lens, dtype=torch.int32), torch.tensor([0] + q_lens).cumsum(0).to(torch.int32),
                 max(q_lens), max(seq_lens), latent_dim, rope_dim)


def reference_latent_attention(batch: Batch, scale: float) -> torch.Tensor:
    """fp32: per sequence, gather the rows by block table, then causal softmax(q . K^T * scale) @ K[:, :L]."""
    key_cache = batch.key_cache.float()
    block_size = key_cache.shape[1]
    out = torch.zeros(batch.query.shape[0], batch.query.shape[1], batch.latent_dim)
    cu = batch.cu_seqlens_q.tolist()
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        q_len = cu[b + 1] - cu[b]
        if q_len == 0:
            continue
        pos = torch.arange(seq_len)
        keys = key_cache[batch.block_tables[b, pos // block_size].long(), pos % block_size, 0]  # [seq_len, L + R]
        q = batch.query[cu[b]:cu[b + 1]].float()  # [q_len, H, L + R]
        scores = torch.einsum("qhd,kd->qhk", q, keys) * scale
        q_pos = seq_len - q_len + torch.arange(q_len)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[:, None, None], float("-inf"))
        out[cu[b]:cu[b + 1]] = torch.softmax(scores, dim=-1) @ keys[:, :batch.latent_dim]
    return out


# id: rows, block_size, num_q_heads, (L, R, index columns after), dtype, num_splits, extras.
CASES = {
    "L24R8-idx-bs16-h4-fp32": (MIXED, 16, 4, (24, 8, 5), torch.float32, None, {"strided_query": True}),
    "L32R16-bs32-h16-fp16": (MIXED, 32, 16, (32, 16, 0), torch.float16, None, {}),
    "L24R8-bs1-h1-fp32-3splits": (MIXED, 1, 1, (24, 8, 3), torch.float32, 3, {}),
    "L32R16-bs16-h4-fp32-over-fp16-cache": (MIXED, 16, 4, (32, 16, 8), torch.float32, 2,
                                            {"cache_dtype": torch.float16}),
    "L512R64-idx-bs16-h16-fp16": (FEW, 16, 16, (512, 64, 128), torch.float16, None, {}),
    "L512R64-bs32-h24-fp32-2splits": (FEW[:2], 32, 24, (512, 64, 0), torch.float32, 2, {}),  # 2 head tiles
    "L40R0-bs16-h4-fp32": ([(17, 1), (20, 20)], 16, 4, (40, 0, 4), torch.float32, None, {}),  # no rotary part
}


@pytest.mark.parametrize("case", list(CASES))
def test_latent_attention_matches_reference(case):
    rows, block_size, num_q_heads, (latent_dim, rope_dim, index_dim), dtype, num_splits, extra = CASES[case]
    batch = make_batch(rows, block_size, num_q_heads, latent_dim, rope_dim, index_dim, dtype, seed=len(case),
                       **extra)
    scale = (latent_dim + rope_dim) ** -0.5
    out = latent_attention(batch.query, batch.key_cache, latent_dim, batch.block_tables, batch.seq_lens,
                           batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k, scale, num_splits=num_splits)
    expected = reference_latent_attention(batch, scale)
    assert out is not None and out.dtype == dtype and out.shape == expected.shape
    atol, rtol = TOLERANCES[dtype]  # fp32 1e-5, fp16 1e-2
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


def test_split_counts_agree_and_default_splits_long_decode():
    # 1 split, a few, and more splits than key tiles (most empty); then a 600-key decode that the
    # default splits (8 interpreter "SMs": 3 splits of 256+ keys).
    batch = make_batch([(300, 1), (70, 3), (2, 2)], 16, 4, 24, 8, 4, torch.float32, seed=11)
    expected = reference_latent_attention(batch, 0.2)
    for n in (1, 2, 5, 16):
        out = latent_attention(batch.query, batch.key_cache, 24, batch.block_tables, batch.seq_lens,
                               batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k, 0.2, num_splits=n)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)  # fp32
    cpu = torch.device("cpu")
    assert default_num_splits(1, 1, 600, cpu) == 3
    assert default_num_splits(1, 20, 600, cpu) == 1  # prefill runs are never split
    assert default_num_splits(64, 1, 100_000, cpu) == 1  # plenty of programs already


def test_empty_queries_and_refused_calls():
    batch = make_batch([(17, 0), (5, 0)], 16, 4, 24, 8, 0, torch.float32, seed=3)
    out = latent_attention(batch.query, batch.key_cache, 24, batch.block_tables, batch.seq_lens,
                           batch.cu_seqlens_q, 0, 17, 0.2)
    assert out.shape == (0, 4, 24)
    batch = make_batch([(17, 1)], 16, 4, 24, 8, 0, torch.float32, seed=4)
    args = (batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, 1, 17, 0.2)
    # What the kernel does not take goes to the torch path (None), never a wrong answer.
    assert latent_attention(batch.query.double(), batch.key_cache.double(), 24, *args) is None
    assert latent_attention(batch.query, batch.key_cache.to(torch.int8), 24, *args) is None
    assert latent_attention(batch.query.half(), batch.key_cache, 24, *args) is None  # a wider cache
    # Malformed calls are errors naming the problem.
    with pytest.raises(ValueError, match="latent_dim"):
        latent_attention(batch.query, batch.key_cache, 40, *args)
    with pytest.raises(ValueError, match=r"\[num_blocks, block_size, 1, L \+ R\]"):
        latent_attention(batch.query, batch.key_cache.expand(-1, -1, 2, -1), 24, *args)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        latent_attention(batch.query, batch.key_cache, 24, batch.block_tables.long(), *args[1:])
    with pytest.raises(ValueError, match="num_splits"):
        latent_attention(batch.query, batch.key_cache, 24, *args, num_splits=0)


def test_dispatch_runs_the_triton_latent_kernel(monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    calls = []
    original = latent.latent_attention
    monkeypatch.setattr(latent, "latent_attention", lambda *a, **k: calls.append(a[2]) or original(*a, **k))
    batch = make_batch(MIXED[:4], 16, 4, 24, 8, 5, torch.float32, seed=9)
    out = dispatch.paged_attention(batch.query, batch.key_cache, batch.key_cache[..., :24], batch.block_tables,
                                   batch.seq_lens, batch.cu_seqlens_q, batch.max_seqlen_q, batch.max_seqlen_k, 0.2,
                                   latent_dim=24)
    assert calls == [24]  # the Triton kernel ran, and returned the answer (no fallback after it)
    torch.testing.assert_close(out, reference_latent_attention(batch, 0.2), atol=1e-5, rtol=1e-5)  # fp32
