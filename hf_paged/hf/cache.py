"""`PagedCache`: a transformers `Cache` whose K/V live in a pool of fixed-size blocks.

KV layout (one pair of tensors per storage slot, one per layer for a model with full attention
only; block ids are shared by every layer):

    key_cache / value_cache: [num_blocks, block_size, num_kv_heads, head_dim]   (V: head_dim_v)

           block 0          block 1          block 2          block 3
        +----------------+----------------+----------------+----------------+
        | a0 a1 ... a15  | b0 b1 .. b9 __ | a16 a17 __ ... |      free      |
        +----------------+----------------+----------------+----------------+

    block_tables (one row per sequence)     slot = block_id * block_size + offset
        seq a: [0, 2]   -> token a17 is slot 2 * 16 + 1 = 33
        seq b: [1]

Nothing is sized for the maximum length: a sequence holds ceil(len / block_size) blocks, so waste
is at most block_size - 1 tokens per sequence, and padding in a batch holds no slot at all.

Models that mix sliding-window and full-attention layers (Gemma 2/3, gpt-oss, Qwen2 with sliding
layers; Mistral slides everywhere) keep one block table per KV group of layers
(`config.kv_layout`): a sliding group releases the blocks that fell out of its window, and
layers of different groups share storage slots, so one block id is the same bytes whichever group
holds it and one pool serves them all.
Sequences that share a prompt share its full blocks (prefix caching, hash-chained) and forks share
everything until one of them writes (copy-on-write). K and V keep the head widths of the states the
model stores: multi-head latent attention (DeepSeek-V2/V3) stores its `kv_lora_rank`-wide latent and
`qk_rope_head_dim`-wide rotary key as one row per token (`layer.LatentLayer`), which paged steps
read in place with the up-projections absorbed (`hf.latent`).

This class is the only transformers `Cache` of hf_paged, and a thin adapter: it implements the Cache
API (update, lengths, crop, beam reordering, reset) over one `KVOwner` (`kv_owner.py`), which owns
the pool, the block tables, the layer tensors and the step being run. The adapter holds only what
transformers sees: the rows of a padded batch (`seqs`), the column count and whether padding is
stored. Which block holds a token is the torch-free `BlockManager`'s answer (`core`), padded batches
are read by `padding.py`, and the dense K/V for other attention implementations is gathered by
`attention.torch_paged`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..attention.interface import UnsupportedModelError
from ..attention.metadata import DENSE, PAGED, StepMetadata, build_step_metadata
from ..attention import dispatch
from ..attention.sparse import write_index_keys
from ..attention.torch_paged import gather_dense
from ..config import PagedCacheConfig
from ..core import KVSequence
from .kv_owner import KVOwner
from .layer import PagedLayer
from .padding import real_columns, real_tokens

__all__ = ["PagedCache", "PagedLayer"]


class PagedCache(Cache):
    """A paged KV cache for transformers models; a drop-in for `DynamicCache`.

    Args:
        config: the model's `PretrainedConfig` (its text config is used).
        cache_config: a `PagedCacheConfig`; keyword overrides build one when omitted, e.g.
            `PagedCache(model.config, block_size=32, num_blocks=256)`.
        kv: the `KVOwner` to adapt (the engine builds its own); a new one by default.

    With `attn_implementation="hf_paged"` attention reads K/V straight from the blocks. With any other
    implementation `update()` returns the gathered, contiguous `[batch, kv_heads, kv_len, head_dim]`
    K/V that implementation expects (correct, slower). Models with multi-head latent attention
    (`support.has_latent_kv`) store one row of latents per token; paged steps attend over the rows
    with the up-projections absorbed (`hf.latent`), dense ones hand the model the latents to expand.

    Padding is never stored when the forward goes through a model attached with `hf_paged.attach`
    (which `generate` does automatically): pad columns get slot -1. Rows must be left-padded, the
    layout `generate` uses for decoder-only models.
    """

    def __init__(self, config, cache_config: PagedCacheConfig | None = None, *, kv: KVOwner | None = None,
                 **overrides):
        if kv is not None and (cache_config is not None or overrides):
            raise TypeError("pass either kv or a cache configuration, not both")
        self.kv = kv if kv is not None else KVOwner(config, cache_config, **overrides)
        self.kv.bind(self)
        super().__init__(layers=self.kv.layers)
        self.seqs: list[KVSequence] = []  # the rows of the padded batch a drop-in forward planned
        self._num_columns = 0  # what transformers sees as the cache length (padding included)
        # A right-padded batch: every column is stored (padding too) and attention runs dense with the
        # model's mask; set by the planning hook on the first step, cleared by reset().
        self.stores_padding = False

    # ------------------------------------------------------------------ the owner's facts, read-only
    @property
    def cache_config(self) -> PagedCacheConfig:
        return self.kv.cache_config

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def layout(self):
        return self.kv.layout

    @property
    def pool(self):
        return self.kv.pool

    @property
    def manager(self):
        return self.kv.manager

    @property
    def weights(self):
        return self.kv.weights

    @property
    def has_latent_kv(self) -> bool:
        return self.kv.has_latent_kv

    def bytes_per_block(self, dtype: torch.dtype | None = None) -> int:
        return self.kv.bytes_per_block(dtype)

    # ------------------------------------------------------------------ transformers' Cache API
    def get_seq_length(self, layer_idx: int = 0) -> int:
        step = self.kv.step
        if step is not None and step.num_columns and step.layers_done and layer_idx not in step.layers_done \
                and layer_idx < len(self.kv.layers) \
                and getattr(self.kv.layers[layer_idx], "spec", None) is not None \
                and self.kv.layers[layer_idx].spec.owns_kv:
            # Mid-forward, before this layer's own update (Llama 4's NoPE layers read it for their query
            # temperature): the columns before this step, as DynamicCache's layer answers then.
            return step.num_columns - step.q_len
        return self._num_columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._num_columns + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._num_columns

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return not self.kv.state_layers  # a recurrent state cannot drop tokens

    @property
    def batch_size(self) -> int:
        return len(self.seqs) if self.seqs else -1

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Store this step's K/V for `layer_idx` and return what the attention needs.

        Args:
            key_states, value_states: [batch, num_kv_heads, q_len, head_dim] new states (V's last
                dimension may differ from K's: each keeps its own width).

        Returns:
            PAGED steps: the layer's `[num_blocks, block_size, num_kv_heads, head_dim]` K and V blocks
                (a latent-attention layer's: its rows `[.., 1, L + R]` and their latent columns).
            DENSE steps: gathered `[batch, num_kv_heads, kv_len, head_dim]` K and V, zero at padding.
        """
        step = self.kv.step
        if step is None or layer_idx in step.layers_done:
            # No pre-forward plan (a model not attached via hf_paged.attach): plan from the shapes.
            # Padding is unknown here, so every column is stored and the dense path masks it.
            step = self.plan_step(batch_size=key_states.shape[0], q_len=key_states.shape[2], mode=DENSE,
                                  device=key_states.device, dtype=key_states.dtype)
        if not step.layers_done:
            self._num_columns = step.num_columns
        layer = self.kv.write(layer_idx, key_states, value_states, step)
        if step.mode == PAGED:
            return layer.paged_kv()
        first_kept = None  # read by gather_dense only when it builds the group's index (once per step)
        index = step.dense_index.get(layer.group)
        layout = self.kv.layout
        if (index is None or index[0].device != layer.device) and layout.group_specs[layer.group].reach is not None:
            # a sliding or chunked group released what no query reads; positions count from each row's
            # first real token, as transformers' sliding and chunked masks count them
            first_kept = [seq.num_released[layer.group] * self.block_size for seq in self.seqs]
        return gather_dense(layer.keys, layer.values, step, key_states.dtype, scales=layer.scales, group=layer.group,
                            first_kept=first_kept)

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Store this step's indexer keys for `layer_idx` (indexed sparse attention: DeepSeek V3.2, GLM-5)
        beside its latents, and return what the indexer scores against. Called after the layer's `update`
        in the same forward (transformers' `Cache.update_indexer`, `DynamicIndexedLayer`).

        Args:
            indexer_key_states: [batch, q_len, index_head_dim] new indexer keys.

        Returns:
            The gathered `[batch, kv_len, index_head_dim]` keys of every column, zero at padding (a dense
            step; in paged steps the installed indexers run per sequence, `hf.indexer`, and keep their keys).

        Raises:
            ValueError: the layer stores no indexer keys, or its `update` has not run in this forward.
            UnsupportedModelError: a paged step (an indexer hf_paged did not install).
        """
        step = self.kv.step
        if step is None or layer_idx not in step.layers_done:
            raise ValueError(f"hf_paged: update_indexer for layer {layer_idx} before its update in this forward; "
                             "PagedCache stores the indexer keys beside the latents cache.update just wrote")
        layer = self.kv.layers[layer_idx]
        index_keys = getattr(layer, "index_keys", None)
        if index_keys is None:
            raise ValueError(f"hf_paged: layer {layer_idx} keeps no indexer keys (its config does not make it an "
                             "indexed_attention layer with index_head_dim), but the model called update_indexer")
        if indexer_key_states.dim() != 3 or indexer_key_states.shape[-1] != index_keys.shape[-1]:
            raise ValueError(f"hf_paged: update_indexer got {tuple(indexer_key_states.shape)} keys; layer {layer_idx} "
                             "takes "
                             f"[batch, q_len, {index_keys.shape[-1]}]")
        if step.mode == PAGED:  # the installed indexers keep their keys themselves (`hf.indexer`)
            raise UnsupportedModelError(
                f"hf_paged: layer {layer_idx}'s indexer called update_indexer in a paged step, but it is not a module "
                "hf_paged runs per sequence (an attention module's `indexer` naming index_topk); load the model "
                "with attn_implementation='sdpa'")
        packed = step.pack(indexer_key_states.unsqueeze(1))[:, 0]  # [num_tokens, I]: the tokens update wrote
        write_index_keys(index_keys, step.slot_mapping_of(layer.group).to(layer.device), packed)
        keys, _ = gather_dense(index_keys, index_keys[..., :0], step, indexer_key_states.dtype, group=layer.group)
        return keys[:, 0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row `i` continues old row `beam_idx[i]`; repeated rows share blocks (CoW)."""
        self._reindex(beam_idx.tolist())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reindex(indices.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._reindex([row for row in range(len(self.seqs)) for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens of every row (assisted/speculative rollback),
        releasing blocks that no longer hold any token."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}) with a positive value is not supported; pass a negative number of "
                "tokens to remove"
            )
        n = -tokens_to_remove
        if n == 0:
            return
        if self.kv.state_layers:
            raise ValueError(f"cannot crop {n} tokens from a cache with recurrent layers (Mamba, linear attention): "
                             "their state cannot drop tokens (stock's needs activate_past_recording first)")
        if n > self._num_columns:
            raise ValueError(f"cannot crop {n} tokens from a cache holding {self._num_columns}")
        short = [i for i, seq in enumerate(self.seqs) if seq.num_tokens < n]
        if short:
            raise ValueError(f"cannot crop {n} tokens: rows {short} hold fewer real (non-padding) tokens")
        manager = self.kv.manager
        for seq in self.seqs:  # every row first: a refused crop changes no row
            manager.check_truncate(seq, n)
        for seq in self.seqs:
            manager.truncate(seq, n)
        self._num_columns -= n
        self.kv.step = None

    def reset(self) -> None:
        """Forget every sequence. Their full blocks stay in the prefix cache for later requests
        (unless the last forward did not finish, which leaves their content suspect)."""
        self.kv.abort(reset_prefix_cache=True)
        for seq in self.seqs:
            self.kv.free_sequence(seq)
        self.seqs = []
        self._num_columns = 0
        self.stores_padding = False
        for layer in self.kv.state_layers:
            layer.reset()

    # ------------------------------------------------------------------ planning a padded batch
    def plan_step(
        self,
        *,
        batch_size: int,
        q_len: int,
        mode: str,
        device: torch.device,
        dtype: torch.dtype,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        row_keys: list | None = None,
    ) -> StepMetadata:
        """Allocate slots for one forward of a padded `[batch_size, q_len]` batch and build its metadata.

        Args:
            mode: PAGED (attention reads blocks) or DENSE (update returns gathered K/V).
            input_ids: [batch_size, q_len] token ids, for prefix caching; None when unknown.
            attention_mask: [batch_size, past + q_len] 2D padding mask (1 = real token), or None.
            row_keys: per row, what its new sequence's block hashes are also salted with (the digest of
                non-text inputs its ids do not name; `planning.multimodal_row_keys`); first forward only.

        Raises:
            ValueError: bad batch shape or padding layout, a sequence that can never fit the pool, or
                a `kv_cache_dtype` the paged kernels cannot read for this `dtype`.
            NoFreeBlocksError: the pool (at its size limit) has too few free blocks right now.
        """
        kv = self.kv
        if kv.step_is_unfinished():
            kv.abort(reset_prefix_cache=True)  # its blocks were hashed before their K/V were written
            raise RuntimeError(
                "the previous forward with this PagedCache did not finish (it raised?), so its K/V are "
                "incomplete; call cache.reset() before reusing the cache"
            )
        if self.seqs and len(self.seqs) != batch_size:
            raise ValueError(
                f"the PagedCache holds {len(self.seqs)} sequences but this forward has batch size {batch_size}; "
                "call cache.reset() before reusing it for another batch"
            )
        if mode == PAGED and kv.kv_dtype is not None:
            dispatch.check_kv_cache_dtype(dtype, kv.kv_dtype, device, kv.cache_config.kv_quant_scheme)
        seqs = self.seqs or [kv.new_sequence(for_paged_steps=False) for _ in range(batch_size)]
        if row_keys is not None and not self.seqs:
            if len(row_keys) != batch_size:
                raise ValueError(f"row_keys has {len(row_keys)} entries for a batch of {batch_size}")
            for seq, key in zip(seqs, row_keys):
                seq.extra_key = (seq.extra_key, key)
        real_cols = real_columns(attention_mask, self._num_columns, [seq.num_tokens > 0 for seq in seqs], q_len)
        new_tokens = real_tokens(input_ids, real_cols)
        kv.ensure_free_blocks(seqs, new_tokens, dtype)  # raises before anything changes

        # Validated and sized: from here on nothing can fail, so the state changes.
        self.seqs = seqs
        self._bind_states(has_previous=self._num_columns > 0)
        if input_ids is None:  # tokens unknown: nothing they hold may be hashed or found
            for seq, cols in zip(seqs, real_cols):
                if len(cols):
                    seq.is_cacheable = False
        slots, copies = kv.append(seqs, new_tokens)
        try:
            step = build_step_metadata(
                mode=mode, q_len=q_len, num_columns=self._num_columns + q_len, real_cols=real_cols,
                seq_lens=[seq.num_tokens for seq in seqs], copies=copies, device=device,
                **kv.group_fields(slots, seqs),
            )
        except BaseException:
            kv.reset_prefix_cache()  # the blocks just filled were hashed but will never be written
            raise
        kv.open(step)
        return step

    def _reindex(self, rows: list[int]) -> None:
        if self.seqs:
            states = self.kv.states
            kept = None
            if states is not None and self.seqs[0].state_row is not None:
                bad = [r for r in rows if not 0 <= r < len(self.seqs)]
                if bad:
                    raise ValueError(f"row indices {bad} are out of range for a cache of {len(self.seqs)} sequences")
                kept = [self.seqs[r].state_row for r in rows]  # read before any row is freed
                kept = [t.index_select(0, torch.tensor(kept, device=t.device)) for t in states.tensors()]
            self.seqs = self.kv.manager.reindex(self.seqs, rows, self.kv.next_seq_id)
            self.kv.step = None
            if kept is not None:  # the new rows as one run again, in the new order
                slots = self.kv.state_slots
                for seq in self.seqs:
                    if seq.state_row is not None:
                        slots.release(seq.state_row)
                        seq.state_row = None
                self._bind_states(has_previous=True)
                start = self.seqs[0].state_row
                for t, rows_kept in zip(states.tensors(), kept):
                    with torch.inference_mode(t.is_inference()):
                        t[start:start + len(self.seqs)] = rows_kept

    def _bind_states(self, has_previous: bool) -> None:
        """Point every recurrent layer at the batch's rows (one contiguous run, taken at the first forward)."""
        if not self.kv.state_layers or not self.seqs:
            return
        if self.seqs[0].state_row is None:
            start = self.kv.state_slots.allocate(len(self.seqs))
            for i, seq in enumerate(self.seqs):
                seq.state_row = start + i
        for layer in self.kv.state_layers:
            layer.bind(self.seqs[0].state_row, len(self.seqs), has_previous)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """Memory accounting.

        Returns a dict with:
            block_size, num_seqs, num_tokens (stored, summed over sequences),
            num_blocks (pool capacity), num_used_blocks (held by live sequences),
            num_shared_blocks (held by more than one sequence), num_cached_blocks (hashed, reusable),
            prefix_cache_hits (blocks taken from the cache instead of recomputed),
            bytes_per_token, kv_bytes (used blocks), kv_bytes_reserved (whole pool),
            waste_tokens (allocated but empty slots, summed over sequences and KV groups),
            max_waste_tokens_per_seq (the most of one sequence in one group's table).
        A block is the K/V of `layout.num_slots` layers (all of them for a one-group model), so
        `bytes_per_token` is per token of one group's table.
        """
        bs, pool = self.block_size, self.kv.pool
        used = {b for seq in self.seqs for b in seq.live_blocks()}
        shared = {b for b in used if pool.ref_count(b) > 1}
        waste = [len(t) * bs - seq.num_tokens for seq in self.seqs for t in seq.block_tables]  # per seq and group
        bpb = self.kv.bytes_per_block() if any(layer.is_initialized for layer in self.kv.storage_layers) else 0
        return {
            "block_size": bs,
            "num_seqs": len(self.seqs),
            "num_tokens": sum(seq.num_tokens for seq in self.seqs),
            "num_blocks": pool.num_blocks,
            "num_used_blocks": len(used),
            "num_shared_blocks": len(shared),
            "num_cached_blocks": pool.num_cached_blocks,
            "prefix_cache_hits": pool.num_prefix_hits,
            "bytes_per_token": bpb // bs,
            "kv_bytes": len(used) * bpb,
            "kv_bytes_reserved": pool.num_blocks * bpb,
            "waste_tokens": sum(waste),
            "max_waste_tokens_per_seq": max(waste, default=0),
        }
