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
`qk_rope_head_dim`-wide rotary key, one head each, and runs dense attention over them (see
`support.has_latent_kv`).

This class is the only owner of KV tensors, and the only transformers `Cache` of hf_paged. It
implements the Cache API (update, lengths, crop, beam reordering, reset) and nothing else: which
block holds a token is the torch-free `BlockManager`'s answer (`core`), padded batches are read by
`padding.py`, pool growth is sized by `pool_sizing.py`, the weights epoch lives in `weights.py`,
and the dense K/V for other attention implementations is gathered by `attention.torch_paged`.
"""

from __future__ import annotations

import itertools
import logging

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..attention import dispatch
from ..attention.interface import note_paged_step
from ..attention.kv_quant import KVQuant, KVScales
from ..attention.metadata import DENSE, PAGED, StepMetadata, build_step_metadata, host_to_device
from ..attention.torch_paged import Workspace, gather_dense
from ..config import PagedCacheConfig, kv_bytes_per_token_layer
from ..core import BlockManager, BlockPool, KVSequence
from ..config import kv_layout
from . import pool_sizing
from .padding import real_columns, real_tokens
from .support import (check_model_supported, check_paged_attention_supported, has_latent_kv, kv_head_shapes,
                      layer_types_of, layer_windows_of)
from .weights import WeightsEpoch

logger = logging.getLogger(__name__)


class PagedLayer(CacheLayerMixin):
    """One layer's K/V blocks. Allocated on the layer's first `update`, on the device and with the
    head shape of the states it receives; resized only when the shared pool grows."""

    is_compileable = False
    is_croppable = True

    def __init__(self, cache: "PagedCache", is_sliding: bool = False, group: int = 0, slot: int = 0):
        super().__init__()
        self._cache = cache
        self.is_sliding = is_sliding
        self.group = group  # its KV group: which block table of each sequence it reads
        self.slot = slot  # its storage slot: layers of other groups in the same slot share its tensors
        # A quantised layer's scales and scheme (`kv_quant.KVScales`), set with its tensors; None unquantised.
        self.scales: KVScales | None = None
        self.quant: KVQuant | None = None  # set before initialisation (a checkpoint's static scales)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cache = self._cache
        num_blocks, block_size = cache.pool.num_blocks, cache.block_size
        dtype = cache.kv_dtype or key_states.dtype
        self.device = key_states.device
        num_kv_heads = key_states.shape[1]
        owner = cache.slot_owner(self.slot)
        if owner is not None:  # another group's layer already holds this slot's tensors: share them
            shape = (num_blocks, block_size, num_kv_heads, key_states.shape[3])
            if tuple(owner.keys.shape) != shape or owner.values.shape[2:] != value_states.shape[1:4:2] \
                    or owner.keys.dtype != dtype or owner.device != self.device:
                raise ValueError(
                    f"hf_paged: layers sharing KV storage slot {self.slot} differ in K/V shape, dtype or device "
                    f"({tuple(owner.keys.shape)} {owner.keys.dtype} vs {shape} {dtype}); this model's sliding and "
                    "full layers cannot share one block pool"
                )
            self.keys, self.values = owner.keys, owner.values
            if owner.scales is not None:
                self.scales = KVScales(owner.scales.key, owner.scales.value, self.quant or cache.default_quant)
            self.is_initialized = True
            return
        # zeros, not empty: padding columns of the dense path read never-written slots
        self.keys = torch.zeros(num_blocks, block_size, num_kv_heads, key_states.shape[3], dtype=dtype,
                                device=self.device)
        self.values = torch.zeros(num_blocks, block_size, value_states.shape[1], value_states.shape[3],
                                  dtype=dtype, device=self.device)
        if cache.cache_config.kv_dtype.is_quantized:
            quant = self.quant or cache.default_quant
            shape = (num_blocks, block_size, *quant.scales_shape(num_kv_heads))
            self.scales = KVScales(torch.zeros(shape, device=self.device), torch.zeros(shape, device=self.device),
                                   quant)
        self.is_initialized = True

    def _tensors(self) -> list[tuple[object, str]]:
        """(owner, attribute) of every tensor with a block dimension: K, V and a quantised layer's scales."""
        pairs = [(self, "keys"), (self, "values")]
        if self.scales is not None:
            pairs += [(self.scales, "key"), (self.scales, "value")]
        return pairs

    @property
    def key_scales(self) -> torch.Tensor | None:  # [num_blocks, block_size, groups, channels] or None
        return None if self.scales is None else self.scales.key

    @property
    def value_scales(self) -> torch.Tensor | None:
        return None if self.scales is None else self.scales.value

    def resize(self, num_blocks: int, like: "PagedLayer | None" = None) -> None:
        """Grow the block dimension to `num_blocks`, keeping existing blocks and their scales (pool
        growth only); with `like`, a layer of the same slot already resized, share its new tensors."""
        if not self.is_initialized or self.keys.shape[0] == num_blocks:
            return
        if like is not None:
            self.keys, self.values = like.keys, like.values
            if self.scales is not None:
                self.scales.key, self.scales.value = like.scales.key, like.scales.value
            return
        for owner, name in self._tensors():
            old = getattr(owner, name)
            new = old.new_zeros(num_blocks, *old.shape[1:])
            new[: old.shape[0]] = old
            setattr(owner, name, new)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole blocks `src[i]` -> `dst[i]` (copy-on-write), payload and scales alike."""
        if self.is_initialized:
            # Tensors first written inside an engine forward are inference tensors: copy-on-write
            # before the next forward must write them in the same mode.
            with torch.inference_mode(self.keys.is_inference()):
                src, dst = src.to(self.device), dst.to(self.device)
                for owner, name in self._tensors():
                    tensor = getattr(owner, name)
                    if tensor.element_size() == 1:  # float8 has no advanced indexing on some torch builds
                        tensor = tensor.view(torch.uint8)
                    tensor[dst] = tensor[src]

    def bytes_per_block(self) -> int:
        """Bytes one block of this (initialised) layer takes: K and V payload plus their scales."""
        return sum(getattr(o, n)[0].numel() * getattr(o, n).element_size() for o, n in self._tensors())

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("PagedLayer is written through PagedCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._cache.reset()


class PagedCache(Cache):
    """A paged KV cache for transformers models; a drop-in for `DynamicCache`.

    Args:
        config: the model's `PretrainedConfig` (its text config is used).
        cache_config: a `PagedCacheConfig`; keyword overrides build one when omitted, e.g.
            `PagedCache(model.config, block_size=32, num_blocks=256)`.

    With `attn_implementation="hf_paged"` attention reads K/V straight from the blocks. With any other
    implementation `update()` returns the gathered, contiguous `[batch, kv_heads, kv_len, head_dim]`
    K/V that implementation expects (correct, slower). Models with multi-head latent attention
    (`support.has_latent_kv`) always take the dense path: they expand the cached latents inside their
    attention module, so no kernel could read the blocks; the cache still stores only the latents.

    Padding is never stored when the forward goes through a model attached with `hf_paged.attach`
    (which `generate` does automatically): pad columns get slot -1. Rows must be left-padded, the
    layout `generate` uses for decoder-only models.
    """

    def __init__(self, config, cache_config: PagedCacheConfig | None = None, **overrides):
        if cache_config is not None and overrides:
            raise TypeError("pass either cache_config or keyword overrides, not both")
        check_model_supported(config)
        self.cache_config = cache_config or PagedCacheConfig(**overrides)
        windows = layer_windows_of(config)
        self.layout = kv_layout(windows if self.cache_config.enable_hybrid_kv else [None] * len(windows))
        super().__init__(layers=[
            PagedLayer(self, is_sliding=t == "sliding_attention", group=g, slot=slot)
            for t, g, slot in zip(layer_types_of(config), self.layout.layer_group, self.layout.layer_slot)
        ])
        self.block_size = self.cache_config.block_size
        spec = self.cache_config.kv_dtype
        self.kv_dtype = None if spec.storage is None else getattr(torch, spec.storage)
        # How a quantised cache's layers quantise unless a checkpoint gives a layer its own scales.
        self.default_quant = (KVQuant.of(spec, self.cache_config.kv_quant_scheme,
                                         rotate=self.cache_config.kv_quant_rotation) if spec.is_quantized else None)
        self._model_config = config
        self.has_latent_kv = has_latent_kv(config)
        self._config_kv_shapes = kv_head_shapes(config)  # (num_kv_heads, head_dim, head_dim_v)
        self.pool = BlockPool(self.cache_config.num_blocks or 0, self.cache_config.enable_prefix_caching)
        self.manager = BlockManager(self.pool, self.block_size, self.layout.windows or (None,))
        self.seqs: list[KVSequence] = []
        self._num_columns = 0  # what transformers sees as the cache length (padding included)
        # A right-padded batch: every column is stored (padding too) and attention runs dense with the
        # model's mask; set by the planning hook on the first step, cleared by reset().
        self.stores_padding = False
        self._step: StepMetadata | None = None
        self._seq_ids = itertools.count(1)  # next() is atomic: engines create sequences from any thread
        self.weights = WeightsEpoch(on_change=self.pool.reset_prefix_cache)
        self._workspace = Workspace()  # attention scratch (gathers, split-K partials), reused across layers and steps

    # ------------------------------------------------------------------ transformers' Cache API
    def get_seq_length(self, layer_idx: int = 0) -> int:
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
        return True

    @property
    def batch_size(self) -> int:
        return len(self.seqs) if self.seqs else -1

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Store this step's K/V for `layer_idx` and return what the attention needs.

        Args:
            key_states, value_states: [batch, num_kv_heads, q_len, head_dim] new states (V's last
                dimension may differ from K's: each keeps its own width).

        Returns:
            PAGED steps: the layer's `[num_blocks, block_size, num_kv_heads, head_dim]` K and V blocks.
            DENSE steps: gathered `[batch, num_kv_heads, kv_len, head_dim]` K and V, zero at padding.
        """
        step = self._step
        if step is None or layer_idx in step.layers_done:
            # No pre-forward plan (a model not attached via hf_paged.attach): plan from the shapes.
            # Padding is unknown here, so every column is stored and the dense path masks it.
            step = self.plan_step(batch_size=key_states.shape[0], q_len=key_states.shape[2], mode=DENSE,
                                  device=key_states.device, dtype=key_states.dtype)
        if not step.layers_done:
            self._num_columns = step.num_columns
        step.layers_done.add(layer_idx)
        if len(step.layers_done) == len(self.layers):
            note_paged_step(None)  # masks built after this forward are for someone else
        layer = self.layers[layer_idx]
        step.active_layer = layer_idx
        if not layer.is_initialized:
            if step.mode == PAGED and self.kv_dtype is not None:  # an engine step: first sight of the dtype
                dispatch.check_kv_cache_dtype(key_states.dtype, self.kv_dtype, key_states.device,
                                              self.cache_config.kv_quant_scheme, step.plan.backend)
            layer.lazy_initialization(key_states, value_states)
        slot_mapping = step.slot_mapping_of(layer.group).to(layer.device)
        dispatch.store_kv(step.pack(key_states), step.pack(value_states), layer.keys, layer.values, slot_mapping,
                          step.has_skipped_slots, scales=layer.scales, plan=step.plan)
        if step.mode == PAGED:
            if layer.scales is not None:  # the attention finds a quantised layer's scales by its layer index
                step.kv_scales[layer_idx] = layer.scales
            return layer.keys, layer.values
        first_kept = None  # read by gather_dense only when it builds the group's index (once per step)
        index = step.dense_index.get(layer.group)
        if (index is None or index[0].device != layer.device) and self.layout.is_hybrid \
                and self.layout.windows[layer.group] is not None:
            first_kept = [seq.num_released[layer.group] * self.block_size for seq in self.seqs]
        return gather_dense(layer.keys, layer.values, step, key_states.dtype, scales=layer.scales, group=layer.group,
                            first_kept=first_kept)

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
        if n > self._num_columns:
            raise ValueError(f"cannot crop {n} tokens from a cache holding {self._num_columns}")
        short = [i for i, seq in enumerate(self.seqs) if seq.num_tokens < n]
        if short:
            raise ValueError(f"cannot crop {n} tokens: rows {short} hold fewer real (non-padding) tokens")
        for seq in self.seqs:  # every row first: a refused crop changes no row
            self.manager.check_truncate(seq, n)
        for seq in self.seqs:
            self.manager.truncate(seq, n)
        self._num_columns -= n
        self._step = None

    def reset(self) -> None:
        """Forget every sequence. Their full blocks stay in the prefix cache for later requests
        (unless the last forward did not finish, which leaves their content suspect)."""
        if self._step_is_unfinished():
            self.pool.reset_prefix_cache()
        for seq in self.seqs:
            self.manager.free(seq)
        self.seqs = []
        self._num_columns = 0
        self.stores_padding = False
        self._step = None
        note_paged_step(None)

    # ------------------------------------------------------------------ planning
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
    ) -> StepMetadata:
        """Allocate slots for one forward of a padded `[batch_size, q_len]` batch and build its metadata.

        Args:
            mode: PAGED (attention reads blocks) or DENSE (update returns gathered K/V). A model with
                latent attention (`has_latent_kv`) always gets DENSE: it expands the latents itself.
            input_ids: [batch_size, q_len] token ids, for prefix caching; None when unknown.
            attention_mask: [batch_size, past + q_len] 2D padding mask (1 = real token), or None.

        Raises:
            ValueError: bad batch shape or padding layout, a sequence that can never fit the pool, or
                a `kv_cache_dtype` the paged kernels cannot read for this `dtype`.
            NoFreeBlocksError: the pool (at its size limit) has too few free blocks right now.
        """
        if self._step_is_unfinished():
            self.pool.reset_prefix_cache()  # its blocks were hashed before their K/V were written
            self._step = None
            raise RuntimeError(
                "the previous forward with this PagedCache did not finish (it raised?), so its K/V are "
                "incomplete; call cache.reset() before reusing the cache"
            )
        if self.seqs and len(self.seqs) != batch_size:
            raise ValueError(
                f"the PagedCache holds {len(self.seqs)} sequences but this forward has batch size {batch_size}; "
                "call cache.reset() before reusing it for another batch"
            )
        if self.has_latent_kv:
            mode = DENSE
        if mode == PAGED and self.kv_dtype is not None:
            dispatch.check_kv_cache_dtype(dtype, self.kv_dtype, device, self.cache_config.kv_quant_scheme)
        seqs = self.seqs or [self._new_sequence() for _ in range(batch_size)]
        real_cols = real_columns(attention_mask, self._num_columns, [seq.num_tokens > 0 for seq in seqs], q_len)
        new_tokens = real_tokens(input_ids, real_cols)
        self.ensure_free_blocks(seqs, new_tokens, dtype)

        # Validated and sized: from here on nothing can fail, so the cache state changes.
        self.seqs = seqs
        if input_ids is None:
            for seq, cols in zip(seqs, real_cols):
                if len(cols):
                    seq.is_cacheable = False
        slots, copies = [], []
        for seq, tokens in zip(seqs, new_tokens):
            result = self.manager.append_tokens(seq, tokens)
            slots.append(result.group_slots)
            copies.extend(result.copies)
        self._apply_copies(copies)
        try:
            step = build_step_metadata(
                mode=mode, q_len=q_len, num_columns=self._num_columns + q_len, real_cols=real_cols,
                seq_lens=[seq.num_tokens for seq in self.seqs], copies=copies, device=device,
                **self.group_fields(slots, self.seqs),
            )
        except BaseException:
            self.pool.reset_prefix_cache()  # the blocks just filled were hashed but will never be written
            raise
        step.plan = dispatch.plan(step, self._workspace)  # the backend, read once per step
        self._step = step
        note_paged_step(step)
        return step

    def begin_step(self, step: StepMetadata) -> None:
        """Run the next forward with `step`, planned outside the cache (the `Engine`'s scheduler owns
        the sequences and their block tables); applies its copy-on-write copies first.

        Raises:
            ValueError: a PAGED step for a model whose attention cannot read the blocks (latent attention).
        """
        if step.mode == PAGED:
            check_paged_attention_supported(self._model_config)
        if self._step_is_unfinished():
            self._step = None
            raise RuntimeError("the previous forward with this PagedCache did not finish (it raised?)")
        self._apply_copies(step.copies)
        step.plan = dispatch.plan(step, self._workspace)  # the backend, read once per step
        self._step = step
        note_paged_step(step)

    def abandon_step(self, reset_prefix_cache: bool = True) -> None:
        """Forget a step whose forward raised. Blocks hashed for it may hold no K/V, so every hash is
        dropped, unless the caller deferred this step's hashing (`reset_prefix_cache=False`: the
        engine's steps publish their blocks only after the forward)."""
        if reset_prefix_cache and self._step_is_unfinished():
            self.pool.reset_prefix_cache()
        self._step = None
        note_paged_step(None)

    def new_sequence(self, for_paged_steps: bool = True) -> KVSequence:
        """A fresh `KVSequence` salted for this cache (its `cache_salt` and current weights epoch), for
        a caller that plans its own steps (`begin_step`'s packed PAGED steps need paged attention).

        Raises:
            ValueError: the model's attention cannot read the blocks (latent attention); raised here so
                that the `Engine` rejects a request at admission, before any forward.
        """
        if for_paged_steps:
            check_paged_attention_supported(self._model_config)
        return self._new_sequence()

    def fork_sequence(self, seq: KVSequence) -> KVSequence:
        """A new sequence sharing every block of `seq` (copy-on-write on its next write): one sample
        of n continuing a prompt computed once."""
        return self.manager.fork(seq, self._next_id())

    def kv_numel_per_token(self) -> int:
        """Elements of one token's K and V over every storage slot: a K/V transfer buffer
        (`KVOwner.export`) holds this many per token."""
        return sum(layer.keys[0, 0].numel() + layer.values[0, 0].numel() for layer in self.slot_owners())

    def group_fields(self, group_slots: list[list[list[int]]], seqs: list[KVSequence]) -> dict:
        """The metadata builders' per-group arguments for sequences `seqs` whose appends returned
        `group_slots` (per sequence, per group)."""
        groups = range(self.manager.num_groups)
        return dict(group_slots=[[row[g] for row in group_slots] for g in groups],
                    group_block_tables=[[seq.block_tables[g] for seq in seqs] for g in groups],
                    **self.group_layout())

    def group_layout(self) -> dict:
        """What every step's metadata says about the KV groups, whatever the sequences: each layer's
        group (`layer_group`, None for one group) and each group's kept window (`group_windows`)."""
        return dict(layer_group=self.layout.layer_group or None, group_windows=self.manager.windows)

    def slot_owner(self, slot: int) -> "PagedLayer | None":
        """An initialised layer holding storage slot `slot`'s tensors, if any."""
        for layer in self.layers:
            if layer.slot == slot and layer.is_initialized:
                return layer
        return None

    def _step_is_unfinished(self) -> bool:
        return self._step is not None and len(self._step.layers_done) < len(self.layers)

    def ensure_free_blocks(self, seqs: list[KVSequence], new_tokens: list[list[int]], dtype: torch.dtype) -> None:
        """Grow the pool (and every layer's tensors) until this step's new blocks are free."""
        manager = self.manager
        for seq in seqs:  # sliding-window blocks no query reads any more, from every row before any allocates
            manager.release(seq)
        needed = sum(manager.num_blocks_needed(seq, len(t)) for seq, t in zip(seqs, new_tokens))
        free = self.pool.num_free_blocks
        if needed <= free:
            return
        target = pool_sizing.growth_target(
            num_blocks=self.pool.num_blocks, num_free_blocks=free, num_needed=needed,
            seq_blocks=[manager.num_blocks_held(seq, len(t)) for seq, t in zip(seqs, new_tokens)],
            seq_totals=[seq.num_tokens + len(t) for seq, t in zip(seqs, new_tokens)], block_size=self.block_size,
            limit=pool_sizing.max_num_blocks(self.cache_config, self.bytes_per_block(dtype)),
            reason=pool_sizing.limit_reason(self.cache_config),
        )
        self.grow_to(target)

    def grow_to(self, num_blocks: int) -> None:
        """Grow the pool (and every storage slot's tensors) to `num_blocks` blocks; never shrinks. Only
        while no step is planned: an idle engine's owner may call it between calls."""
        if num_blocks <= self.pool.num_blocks:
            return
        self.pool.grow(num_blocks - self.pool.num_blocks)
        owners = {layer.slot: layer for layer in self.slot_owners()}
        for layer in owners.values():
            layer.resize(self.pool.num_blocks)
        for layer in self.layers:  # the other layers of each slot share its owner's new tensors
            if layer is not owners.get(layer.slot):
                layer.resize(self.pool.num_blocks, like=owners.get(layer.slot))

    def bytes_per_block(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of K and V one block takes across all layers: measured once every layer holds its
        tensors, else from the config's K/V head shapes (`support.kv_head_shapes`)."""
        owners = self.slot_owners()
        if len(owners) == self.layout.num_slots:
            return sum(layer.bytes_per_block() for layer in owners)
        itemsize = torch.empty(0, dtype=dtype or torch.float32).element_size()
        num_kv_heads, head_dim, head_dim_v = self._config_kv_shapes
        per_token = kv_bytes_per_token_layer(num_kv_heads, head_dim, head_dim_v, self.cache_config.kv_dtype,
                                             self.cache_config.kv_quant_scheme, itemsize)
        return self.block_size * per_token * self.layout.num_slots

    def slot_owners(self) -> list["PagedLayer"]:
        """One initialised layer per storage slot that has tensors (a slot's layers share them), in
        slot order."""
        owners: dict[int, PagedLayer] = {}
        for layer in self.layers:
            if layer.is_initialized:
                owners.setdefault(layer.slot, layer)
        return [owners[slot] for slot in sorted(owners)]

    def _apply_copies(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        indices: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # one asynchronous copy per device
        for layer in self.slot_owners():  # a block's bytes in every slot, whichever group holds it
            if layer.device not in indices:
                indices[layer.device] = (host_to_device([s for s, _ in copies], torch.long, layer.device),
                                         host_to_device([d for _, d in copies], torch.long, layer.device))
            layer.copy_blocks(*indices[layer.device])

    # ------------------------------------------------------------------ sequences
    def _new_sequence(self) -> KVSequence:
        return KVSequence(seq_id=self._next_id(), extra_key=self.sequence_salt())

    def sequence_salt(self) -> tuple:
        """What every block hash of a sequence starting now is salted with: the cache's `cache_salt`,
        the current weights epoch and the KV storage (dtype and quantisation scheme). A sequence that
        stores nothing yet may be re-salted with it."""
        cfg = self.cache_config
        return (cfg.cache_salt, self.weights.epoch, cfg.kv_cache_dtype, cfg.kv_quant_scheme, cfg.kv_quant_rotation)

    def _reindex(self, rows: list[int]) -> None:
        if self.seqs:
            self.seqs = self.manager.reindex(self.seqs, rows, self._next_id)
            self._step = None

    def _next_id(self) -> int:
        return next(self._seq_ids)

    def use_checkpoint_kv_scales(self, model: torch.nn.Module) -> int:
        """Quantise each layer with its checkpoint's own static `k_scale` / `v_scale` (attention modules
        of compressed-tensors FP8 checkpoints carry them), instead of dynamic scales. Only an fp8 cache
        uses them, and only for layers not yet written. Returns how many layers took static scales."""
        spec = self.cache_config.kv_dtype
        if not spec.is_quantized or spec.name == "int8":
            return 0
        found = 0
        for module in model.modules():
            idx = getattr(module, "layer_idx", None)
            k_scale, v_scale = getattr(module, "k_scale", None), getattr(module, "v_scale", None)
            if not (isinstance(idx, int) and torch.is_tensor(k_scale) and torch.is_tensor(v_scale)):
                continue
            if not 0 <= idx < len(self.layers) or self.layers[idx].is_initialized:
                continue
            if k_scale.numel() != 1 or v_scale.numel() != 1:
                logger.warning("hf_paged: layer %d's checkpoint k_scale/v_scale are not per-tensor (shapes %s, %s); "
                               "it keeps dynamic scales", idx, tuple(k_scale.shape), tuple(v_scale.shape))
                continue
            k, v = float(k_scale), float(v_scale)
            if not (k > 0 and v > 0 and k != float("inf") and v != float("inf")):
                raise ValueError(f"layer {idx}: checkpoint k_scale/v_scale must be positive and finite, got {k}, {v}")
            self.layers[idx].quant = KVQuant.of(spec, self.cache_config.kv_quant_scheme, k, v)
            found += 1
        return found

    def note_weights(self, fingerprint) -> None:
        """Called before each step with `weights_fingerprint(model)`; see `WeightsEpoch.note`."""
        self.weights.note(fingerprint)

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
        bs = self.block_size
        used = {b for seq in self.seqs for b in seq.live_blocks()}
        shared = {b for b in used if self.pool.ref_count(b) > 1}
        waste = [len(t) * bs - seq.num_tokens for seq in self.seqs for t in seq.block_tables]  # per seq and group
        bpb = self.bytes_per_block() if any(layer.is_initialized for layer in self.layers) else 0
        return {
            "block_size": bs,
            "num_seqs": len(self.seqs),
            "num_tokens": sum(seq.num_tokens for seq in self.seqs),
            "num_blocks": self.pool.num_blocks,
            "num_used_blocks": len(used),
            "num_shared_blocks": len(shared),
            "num_cached_blocks": self.pool.num_cached_blocks,
            "prefix_cache_hits": self.pool.num_prefix_hits,
            "bytes_per_token": bpb // bs,
            "kv_bytes": len(used) * bpb,
            "kv_bytes_reserved": self.pool.num_blocks * bpb,
            "waste_tokens": sum(waste),
            "max_waste_tokens_per_seq": max(waste, default=0),
        }
