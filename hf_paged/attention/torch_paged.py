"""The torch backend of paged attention: the CPU path, fast enough to serve.

Owns the torch implementation of the attention contract (`paged_attention`) and the per-step
`AttentionPlan` that every layer of a KV group shares (its gathers take the cache's
`workspace.Workspace` buffers; re-exported here). The torch write (`store_kv`) and the dense
gather for non-paged attention implementations (`gather_dense`) live in `slots.py` and are
re-exported here. It is vectorised over sequences and tokens and reads K/V through the block
table exactly as the Triton kernels do. It is *not* the test oracle: that is `reference.py`, deliberately naive, which this module must never call. It
knows nothing of requests, caches or transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import MAX_DECODE_QUERY_LEN
from . import cpu_kernel
from .kv_quant import KVScales, dequantize, dynamic_scales
from .slots import gather_dense, is_flat, slots_of, store_kv  # noqa: F401  (re-exported: the torch path's K/V I/O)
from .workspace import Workspace  # noqa: F401  (re-exported: the torch path's scratch)


# Sequences with at most MAX_DECODE_QUERY_LEN queries are batched into padded attention calls (bucketed by
# length); longer ones (prefill chunks) each get their own call, so a mixed engine step never pads a
# 1-token decode out to a 600-token prompt chunk.
# A bucket of short-query sequences is closed when the next one is this much shorter than its
# longest: padded K/V work stays within about this factor of the real work.
_BUCKET_RATIO = 1.5


class _Group:
    """Sequences attended in one padded call: their indices, where their tokens sit in the packed
    query, and the block/position tensors of the padded `[num_seqs, Qmax, Kmax]` problem, where
    `Kmax` is whole blocks (K/V are gathered a block at a time)."""

    def __init__(self, seqs: list[int], q_lens: list[int], seq_lens: list[int], cu: list[int],
                 block_tables: torch.Tensor, block_size: int, key_limits: torch.Tensor | None = None):
        device = block_tables.device
        self.num_seqs = len(seqs)
        self.max_seqlen_q = max(q_lens[i] for i in seqs)
        max_seqlen_k = max(seq_lens[i] for i in seqs)
        num_blocks = -(-max_seqlen_k // block_size)
        self.max_seqlen_k = num_blocks * block_size
        g_q_lens = torch.tensor([q_lens[i] for i in seqs], device=device)
        g_seq_lens = torch.tensor([seq_lens[i] for i in seqs], device=device)
        # A single sequence's tokens are one contiguous slice of the packed query: no scatter needed.
        self.token_slice = slice(cu[seqs[0]], cu[seqs[0]] + q_lens[seqs[0]]) if len(seqs) == 1 else None
        self.token_index = torch.tensor([t for i in seqs for t in range(cu[i], cu[i] + q_lens[i])], device=device)
        self.is_single_query = all(q_lens[i] == 1 for i in seqs)  # packed query is already [Sg, 1, ...]
        self.seq_ids = torch.repeat_interleave(torch.arange(len(seqs), device=device), g_q_lens)  # [Tg]
        starts = torch.tensor([cu[i] for i in seqs], device=device)
        self.q_idx = self.token_index - starts[self.seq_ids]  # [Tg]
        rows = torch.tensor(seqs, device=device)
        self.blocks = block_tables[rows, :num_blocks].long().flatten()  # [Sg * num_blocks]
        # One sequence on consecutive block ids (what a fresh pool hands out, the common case at batch
        # 1): its K/V are read as a view of the cache, exactly its seq_len keys, with no gather.
        self.first_block = None
        if len(seqs) == 1:
            ids = self.blocks.tolist()
            if ids == list(range(ids[0], ids[0] + len(ids))):
                self.first_block = ids[0]
        self.seq_len = seq_lens[seqs[0]]
        # Gathered rows past each sequence's length (its last block's tail, table padding): zeroed
        # after the gather, since a stale NaN/inf there would turn a masked 0 weight into NaN.
        past_end = torch.arange(self.max_seqlen_k, device=device)[None, :] >= g_seq_lens[:, None]  # [Sg, Kmax]
        self.invalid_rows = past_end.flatten().nonzero().flatten()
        self.q_pos = (g_seq_lens - g_q_lens)[:, None] + torch.arange(self.max_seqlen_q, device=device)  # [Sg, Qmax]
        self.k_pos = torch.arange(self.max_seqlen_k, device=device)
        self.is_pad_row = torch.arange(self.max_seqlen_q, device=device)[None, :] >= g_q_lens[:, None]  # [Sg, Qmax]
        # Every row has exactly Kmax keys and single-token queries: no mask at all is needed.
        self.is_uniform_decode = self.max_seqlen_q == 1 and all(seq_lens[i] == self.max_seqlen_k for i in seqs)
        # The last key position each query sees: its own, or further (`key_limits`: Gemma 3's images).
        self.q_limit = self.q_pos
        if key_limits is not None:
            limit = self.q_pos.clone()
            limit[self.seq_ids, self.q_idx] = key_limits[self.token_index]
            if bool((limit > self.q_pos).any()):
                self.q_limit = limit
        is_causal = self.q_limit is self.q_pos
        # One sequence whose queries are all its keys: plain causal attention, no mask tensor.
        self.is_plain_causal = is_causal and len(seqs) == 1 and q_lens[seqs[0]] == seq_lens[seqs[0]]
        self.num_kv = seq_lens[seqs[0]] if self.is_plain_causal else self.max_seqlen_k  # keys it really has
        self._masks: dict[tuple[int | None, int | None], torch.Tensor] = {}

    def mask(self, sliding_window: int | None, chunk_size: int | None = None) -> torch.Tensor:  # [Sg, Qmax, Kmax]
        """bool, True = attend: causal (or up to `key_limits`), after the window's and the chunk's lower
        bounds (key j >= (p // C) * C). Memoised per (window, chunk): every layer of a kind shares it."""
        kind = (sliding_window, chunk_size)
        if kind not in self._masks:
            k_pos, q_pos = self.k_pos[None, None, :], self.q_pos[:, :, None]
            allowed = k_pos <= self.q_limit[:, :, None]
            if sliding_window is not None:
                allowed &= k_pos > q_pos - sliding_window
            if chunk_size is not None:
                allowed &= k_pos >= torch.div(q_pos, chunk_size, rounding_mode="floor") * chunk_size
            # Query rows past a sequence's q_len are padding: let them see key 0 so no row is all -inf.
            allowed[..., 0] |= self.is_pad_row
            self._masks[kind] = allowed
        return self._masks[kind]

    def gather(self, cache: torch.Tensor, dtype: torch.dtype, buffer: torch.Tensor | None,
               length: int | None = None, scales: torch.Tensor | None = None,
               dequantized: torch.Tensor | None = None, nan_scaled: bool = False,
               as_view: bool = False) -> torch.Tensor:
        """[Sg, Hkv, length or Kmax, D] (a strided view) of this group's K or V (D: that cache's own
        head width), gathered block by block, or with `as_view` (`first_block` set, a flat cache)
        read as a view of the cache. A quantised cache (`scales`: its [num_blocks, block_size, G, C]
        scales) is dequantised to `dtype` as it is gathered, into `dequantized` when given (a
        workspace buffer the size of the gathered blocks)."""
        num_kv_heads, head_dim = cache.shape[2:]
        if as_view:  # zero-copy: [1, n * block_size, H, D] -> its first `length` rows
            end = self.first_block + self.blocks.numel()
            blocks = cache[self.first_block:end]
            n = self.seq_len if length is None else length
            out = blocks.view(1, -1, num_kv_heads, head_dim)[:, :n]
            if scales is not None:
                out = dequantize(out, scales[self.first_block:end].view(1, -1, *scales.shape[2:])[:, :n], dtype,
                                 nan_scaled=nan_scaled)
            return out.to(dtype).transpose(1, 2)
        if buffer is None:
            blocks = cache.index_select(0, self.blocks)
        else:
            blocks = torch.index_select(cache, 0, self.blocks, out=buffer)
        if scales is not None:
            blocks = dequantize(blocks, scales.index_select(0, self.blocks), dtype, out=dequantized,
                                nan_scaled=nan_scaled)
        if length is None and self.invalid_rows.numel():
            blocks.view(-1, num_kv_heads, head_dim).index_fill_(0, self.invalid_rows, 0)
        out = blocks.view(self.num_seqs, self.max_seqlen_k, num_kv_heads, head_dim)[:, :length]
        return out.to(dtype).transpose(1, 2)


def _buckets(short: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Split short-query sequences into groups of similar KV length (longest first)."""
    groups: list[list[int]] = []
    for i in sorted(short, key=lambda i: -seq_lens[i]):
        if groups and seq_lens[i] * _BUCKET_RATIO >= seq_lens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _check_metadata(cu: list[int], seq_lens: list[int], block_tables: torch.Tensor, block_size: int) -> None:
    """Raise ValueError, naming the field, where a step's metadata (`cu_seqlens_q` and `seq_lens` as
    host lists) would send attention outside its tensors: the native kernel reads and writes through
    these numbers unchecked. Run once per step and KV group, on the lists the plan reads anyway; each
    call then only compares shapes (`paged_attention`). Block ids are checked per call, against the
    pool the layer passes."""
    num_seqs = len(seq_lens)
    if len(cu) != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"paged_attention: {num_seqs} seq_lens need cu_seqlens_q of {num_seqs + 1} entries and "
                         f"block_tables of {num_seqs} rows; got {len(cu)} and {block_tables.shape[0]}")
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"paged_attention: cu_seqlens_q must start at 0 and never decrease; got {cu[:16]}")
    short = next((i for i, (a, b, n) in enumerate(zip(cu, cu[1:], seq_lens)) if n < b - a), None)
    if short is not None:
        raise ValueError(f"paged_attention: seq_lens[{short}]={seq_lens[short]} is fewer tokens than its "
                         f"{cu[short + 1] - cu[short]} queries (cu_seqlens_q)")
    longest = max(seq_lens, default=0)
    if longest > block_tables.shape[1] * block_size:
        raise ValueError(f"paged_attention: seq_lens holds a sequence of {longest} tokens, which needs "
                         f"{-(-longest // block_size)} blocks; a block_tables row has {block_tables.shape[1]} "
                         "columns")


def _check_shapes(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  sinks: torch.Tensor | None) -> None:
    """Raise ValueError, naming the field, where a layer's tensors disagree: the native kernel takes
    its strides from the caches and its head count from the query. Shapes only: it runs every call,
    so the one comparison of the common case comes first and the message is worked out after."""
    _, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, key_dim = key_cache.shape
    v_blocks, v_block_size, v_heads, _ = value_cache.shape
    if (v_blocks == num_blocks and v_block_size == block_size and v_heads == num_kv_heads and num_kv_heads
            and not num_q_heads % num_kv_heads and head_dim == key_dim
            and (sinks is None or sinks.numel() == num_q_heads)):
        return
    if (v_blocks, v_block_size, v_heads) != (num_blocks, block_size, num_kv_heads):
        raise ValueError(f"paged_attention: value_cache {tuple(value_cache.shape)} and key_cache "
                         f"{tuple(key_cache.shape)} differ in [num_blocks, block_size, num_kv_heads]")
    if not num_kv_heads or num_q_heads % num_kv_heads:
        raise ValueError(f"paged_attention: num_q_heads={num_q_heads} is not a multiple of the cache's "
                         f"num_kv_heads={num_kv_heads}")
    if head_dim != key_dim:
        raise ValueError(f"paged_attention: the query's head_dim={head_dim} differs from the key cache's ({key_dim})")
    raise ValueError(f"paged_attention: sinks has {sinks.numel()} entries; it needs one per query head "
                     f"({num_q_heads})")


class AttentionPlan:
    """Index and mask tensors that depend only on the step's metadata, not on the layer: built once
    per forward and shared by every layer (the masks are memoised per sliding window).

    Sequences are split into groups: those with short queries (decode, speculative verify) are
    bucketed by KV length into a few padded calls, and each longer query (a prefill chunk) gets its
    own call. With `native` (the "cpu" backend, where the kernel builds), the short ones instead go
    to the native CPU kernel together (`short_runs`), whenever a layer's tensors are ones it reads
    (`cpu_kernel.can_run`); their padded groups are built only if a layer needs them."""

    def __init__(
        self,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
        seq_lens: torch.Tensor,  # [num_seqs] int32
        cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
        max_seqlen_q: int,
        max_seqlen_k: int,
        block_size: int,
        workspace: Workspace | None = None,
        key_limits: torch.Tensor | None = None,  # [num_tokens] int64, the last key each query sees (None: causal)
        native: bool = False,
    ):
        cu = cu_seqlens_q.tolist()  # one host sync per step, shared by every layer
        lens = seq_lens.tolist()
        _check_metadata(cu, lens, block_tables, block_size)
        q_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        self.num_tokens = cu[-1] if lens else 0
        self.workspace = workspace
        self._args = (q_lens, lens, cu, block_tables, block_size, key_limits)
        self._short = [i for i, n in enumerate(q_lens) if 0 < n <= MAX_DECODE_QUERY_LEN and lens[i] > 0]
        self.long_groups = [_Group([i], q_lens, lens, cu, block_tables, block_size, key_limits)
                            for i, n in enumerate(q_lens) if n > MAX_DECODE_QUERY_LEN]
        self.short_runs = None
        if native and self._short and key_limits is None and block_tables.device.type == "cpu" \
                and block_size <= cpu_kernel.MAX_BLOCK_SIZE and cpu_kernel.load() is not None:
            self.short_runs = cpu_kernel.ShortRuns(self._short, q_lens, lens, cu, block_tables, block_size,
                                                   self.num_tokens)
        self._short_groups = None

    @property
    def groups(self) -> list[_Group]:
        """Every group of the torch path: the short queries bucketed by KV length, then the long ones."""
        if self._short_groups is None:
            q_lens, lens, cu, block_tables, block_size, key_limits = self._args
            self._short_groups = [_Group(g, q_lens, lens, cu, block_tables, block_size, key_limits)
                                  for g in _buckets(self._short, lens)]
        return self._short_groups + self.long_groups

    def scratch(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """An fp32 buffer for the native kernel: the workspace's, else a fresh one."""
        if self.workspace is None:
            return torch.empty(shape, dtype=torch.float32, device=device)
        return self.workspace.get(name, shape, torch.float32, device)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], packed by cu_seqlens_q
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, tokens in the cache incl. this step's
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_q_heads] learned per-head sink logits
    plan: AttentionPlan | None = None,
    scales: KVScales | None = None,  # a quantised cache's scales (`kv_quant`): K/V dequantised as gathered
    chunk_size: int | None = None,
    native: bool = True,  # let the plan's native CPU kernel take the short runs it reads
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim_v]
    """Causal attention of each sequence's new queries over its cached prefix plus themselves.

    V may be narrower or wider than Q/K (`head_dim_v`, as in multi-head latent attention); the
    output has V's width. K/V are read in any float dtype and cast to the query's, from contiguous
    caches or strided views of byte pages (block stride larger than a block).

    Query `i` of sequence `b` sits at position `seq_lens[b] - q_len[b] + i`. It sees key positions
    `p <= pos` and, with a sliding window `w`, only `p > pos - w` (the transformers convention); with
    a chunk `C` (Llama 4's local attention) only `p >= (pos // C) * C`; with both, both bounds.
    Softcapping (`softcap * tanh(s / softcap)`) is applied to the scaled scores before masking, and
    a sink adds one extra logit per head to the softmax denominator that attends to nothing.
    `plan` (from `AttentionPlan` on the same metadata) skips rebuilding the per-step indices; with
    `native` and a plan made `native=True`, its short runs go to the CPU kernel where it reads the
    tensors (`cpu_kernel.can_run`).
    """
    num_tokens, num_q_heads, head_dim = query.shape
    _check_shapes(query, key_cache, value_cache, sinks)
    if scales is None and key_cache.element_size() == 1:
        raise ValueError(f"paged_attention: a {key_cache.dtype} (quantised) cache needs its scales; got scales=None")
    num_kv_heads = key_cache.shape[2]
    group_size = num_q_heads // num_kv_heads
    if num_tokens == 0 or max_seqlen_k == 0:
        return query.new_zeros(num_tokens, num_q_heads, value_cache.shape[-1])
    if plan is None:
        plan = AttentionPlan(block_tables, seq_lens, cu_seqlens_q, max_seqlen_q, max_seqlen_k, key_cache.shape[1])
    if plan.num_tokens != num_tokens:  # past the query, the kernel would read and write out of bounds
        raise ValueError(f"paged_attention: cu_seqlens_q ends at {plan.num_tokens}, but the query has {num_tokens} "
                         "tokens; every query token belongs to exactly one sequence")
    out = None  # [num_tokens, Hq, Dv], in the dtype attention returns (under autocast, not the query's)
    groups = plan.groups
    runs = plan.short_runs
    if runs is not None and native and cpu_kernel.can_run(query, key_cache, value_cache, scales):
        if runs.block_range[0] < 0 or runs.block_range[1] >= key_cache.shape[0]:
            raise IndexError(f"paged_attention: the block tables name blocks {runs.block_range[0]}.."
                             f"{runs.block_range[1]}, outside the pool of {key_cache.shape[0]} blocks")
        o = cpu_kernel.attend(query if runs.is_whole else query[runs.token_index], key_cache, value_cache,
                              runs.block_tables, runs.seq_lens, runs.cu_seqlens_q, runs.max_q_len * num_q_heads,
                              runs.num_splits, runs.kv_tokens, scale, sliding_window, softcap, sinks,
                              lambda name, shape: plan.scratch(name, shape, query.device),
                              chunk_size, scales)  # [T_short, Hq, Dv]
        if runs.is_whole:  # every query is a short run's: nothing else to attend
            return o
        out = o.new_zeros(num_tokens, num_q_heads, o.shape[-1])
        out[runs.token_index] = o
        if not plan.long_groups:
            return out
        groups = plan.long_groups
    # One group holding every query (batch 1): its output is the whole output, no scatter into zeros.
    is_whole = out is None and len(groups) == 1 and groups[0].token_slice == slice(0, num_tokens)
    # Scratch buffers are reused by the next layer: only where autograd will not keep the K/V.
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key_cache.requires_grad
                                              or value_cache.requires_grad)
    workspace = None if needs_grad else plan.workspace
    k_scales, v_scales = (None, None) if scales is None else (scales.key, scales.value)
    nan_scaled = scales is not None and dynamic_scales(scales.quant)
    # A byte page's slice (block stride > block) cannot be viewed as one run of keys: gathered instead.
    is_flat_pool = is_flat(key_cache) and is_flat(value_cache) and (scales is None or (
        is_flat(scales.key) and is_flat(scales.value)))
    masked = sliding_window is not None or chunk_size is not None
    for group in groups:
        as_view = group.first_block is not None and is_flat_pool
        buffers, dequantized = [None, None], [None, None]
        if workspace is not None and not as_view:
            buffers = [workspace.get(name, (len(group.blocks), *cache.shape[1:]), cache.dtype, cache.device)
                       for name, cache in (("k", key_cache), ("v", value_cache))]
            if scales is not None:
                dequantized = [workspace.get(name, (len(group.blocks), *cache.shape[1:]), query.dtype, cache.device)
                               for name, cache in (("kq", key_cache), ("vq", value_cache))]
        is_causal_sdpa = group.is_plain_causal and not masked and softcap is None and sinks is None
        length = group.num_kv if is_causal_sdpa else None
        k = group.gather(key_cache, query.dtype, buffers[0], length, k_scales, dequantized[0],
                         nan_scaled, as_view)  # [Sg, Hkv, K, D]
        v = group.gather(value_cache, query.dtype, buffers[1], length, v_scales, dequantized[1],
                         nan_scaled, as_view)  # [Sg, Hkv, K, Dv]
        if group.token_slice is not None:
            q = query[group.token_slice][None]  # [1, q_len, Hq, D]
        elif group.is_single_query:
            q = query[group.token_index][:, None]  # [Sg, 1, Hq, D]
        else:
            q = query.new_zeros(group.num_seqs, group.max_seqlen_q, num_q_heads, head_dim)
            q[group.seq_ids, group.q_idx] = query[group.token_index]
        if is_causal_sdpa:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=group.max_seqlen_q > 1, scale=scale,
                                               enable_gqa=group_size > 1).transpose(1, 2)
        else:
            # A view holds exactly the sequence's keys (no padded tail): one query sees them all.
            sees_all = not masked and (group.is_uniform_decode or (as_view and group.max_seqlen_q == 1))
            mask = None
            if not sees_all or softcap is not None or sinks is not None:
                mask = group.mask(sliding_window, chunk_size)[..., :k.shape[2]]  # [Sg, Qmax, K]
            if softcap is not None or sinks is not None:
                o = _attention_math(q.transpose(1, 2), k, v, mask, scale, softcap, sinks).transpose(1, 2)
            elif mask is None and group.max_seqlen_q == 1 and (group_size == 1 or q.is_cuda):
                # decode over every key: sdpa's own GQA (on the CPU it copies K/V per query head, and
                # its math path is slower there than folding the heads into the query rows: 15x at
                # MLA's 1 latent head for 8 query heads, benchmarks/latent.py)
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, scale=scale,
                                                   enable_gqa=group_size > 1).transpose(1, 2)
            else:
                o = _grouped_query_attention(q, k, v, mask, scale)  # [Sg, Qmax, Hq, Dv]
        if is_whole:
            return o[0]
        if out is None:
            out = o.new_zeros(num_tokens, num_q_heads, o.shape[-1])
        if group.token_slice is not None:
            out[group.token_slice] = o[0]
        elif group.is_single_query:
            out[group.token_index] = o[:, 0]
        else:
            out[group.token_index] = o[group.seq_ids, group.q_idx]
    return out


def _grouped_query_attention(
    q: torch.Tensor,  # [S, Qmax, Hq, D]
    k: torch.Tensor,  # [S, Hkv, K, D]
    v: torch.Tensor,  # [S, Hkv, K, Dv]
    allowed: torch.Tensor | None,  # [S, Qmax, K] bool, True = attend; None = attend to all
    scale: float,
) -> torch.Tensor:  # [S, Qmax, Hq, Dv]
    """Attention with the query heads of each KV head folded into the query rows, so K/V are never
    repeated per query head: [S, Hkv, group * Qmax, D] queries against [S, Hkv, K, D] keys."""
    num_seqs, max_q, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    folded = q.view(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    folded = folded.reshape(num_seqs, num_kv_heads, group * max_q, head_dim)
    mask = None if allowed is None else allowed.repeat(1, group, 1)[:, None]  # row g*Qmax+i -> query i
    o = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale)
    o = o.view(num_seqs, num_kv_heads, group, max_q, -1).permute(0, 3, 1, 2, 4)
    return o.reshape(num_seqs, max_q, num_q_heads, -1)


def _attention_math(q, k, v, allowed, scale, softcap, sinks):
    """Explicit softmax attention in fp32, for the features SDPA lacks (softcap, sinks)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)
