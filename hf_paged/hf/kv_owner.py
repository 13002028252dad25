"""`KVOwner`: the one owner of a KV pool: its blocks and their tensors, the sequences that hold them,
the step that writes them, and the sequences kept between requests.

What it owns:
- the block pool and the torch-free `BlockManager` (`core`) that says which block holds a token;
- the layers' specs (`kv_spec`: full, sliding, chunked, or reading another layer's K/V) and the
  layout they give (`config.kv_layout`: groups, slots, byte pages for per-layer K/V shapes);
- every layer's K/V tensors (`PagedLayer`, allocated at its first write; `SharedLayer`s own none) and
  the attention workspace;
- the weights epoch that salts block hashes, and the sequence ids;
- the current step, and the sequences kept for callers.

Every change to the blocks of a step goes through one transaction:

    kv.begin(step)              copy-on-write copies, the step's metadata handed to attention
    ... the forward writes K/V (`write`, from the `PagedCache` adapter's `update`) ...
    kv.commit(new_full_blocks)  the blocks the step filled are published in the prefix cache
    kv.abort()                  or: nothing the step staged is ever found; its requests recompute

so a step either commits or leaves no trace. The runner calls `begin`/`commit`/`abort` around the
forward; the engine calls `abort` when it undoes a step after scheduling. A padded batch from stock
`generate` plans its own step through the adapter (`PagedCache.plan_step`), which makes room with
`ensure_free_blocks`, appends with `append` and opens the step with `open`.

Kept sequences (`keep` ... `evict_kept`) are what a finished `retain_kv` request leaves to its
caller: `ReturnedCache`, disaggregated prefill (`export`/`import_tokens`) and `kv_prefix` hand-overs
use them. A kept sequence is held here until it is taken by a new request (`take`), freed (`free`,
or `release_later` from any thread), or evicted when the pool runs dry (`kept.py`).

`PagedCache` (`cache.py`) is the thin transformers `Cache` adapter over one owner: the model's layers
write through it, and it holds only what transformers sees (rows of a padded batch, the column count).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from ..attention import dispatch
from ..attention.interface import UnsupportedModelError, note_paged_step, note_paged_write
from ..attention.kv_quant import KVQuant
from ..attention.metadata import PAGED, StepMetadata, host_to_device
from ..attention.torch_paged import Workspace
from ..config import PagedCacheConfig, kv_bytes_per_token_layer, kv_layout
from ..core import BlockManager, BlockPool, KVSequence
from ..core.state_slots import StateSlots
from ..kv_spec import FullAttention, LatentAttention, NoCache, state_specs
from ..state_spec import MIXERS
from . import kv_transfer, pool_sizing
from .kept import KeptSequences
from .layer import DummyLayer, LatentLayer, PagedLayer, SharedLayer
from .state import PagedStateLayer, StateLayer, StateStore
from .pages import PageBuffers
from .rope import has_length_rope
from .support import (check_model_supported, has_latent_kv, kv_head_shapes,
                      layer_specs_of)
from .weights import WeightsEpoch

logger = logging.getLogger(__name__)


class KVOwner(KeptSequences):
    """The KV pool of one model: blocks, tensors, sequences, the step transaction and kept sequences.

    Args:
        config: the model's `PretrainedConfig` (its text config is used).
        cache_config: a `PagedCacheConfig`; keyword overrides build one when omitted.
        lookback: tokens a planner may roll back below a sequence's length before its next append
            (a draft model's rejected drafts): sliding groups keep that much more (`BlockManager`).
    """

    def __init__(self, config, cache_config: PagedCacheConfig | None = None, *, lookback: int = 0, **overrides):
        if cache_config is not None and overrides:
            raise TypeError("pass either cache_config or keyword overrides, not both")
        check_model_supported(config)
        # Rotary frequencies that follow the length: a sequence without its rope history (`core.rope`) is never
        # hashed, so that keys rotated for one length are never served to a sequence needing another.
        self._length_rope = has_length_rope(config)
        self.cache_config = cache_config or PagedCacheConfig(**overrides)
        choice = self.cache_config.attention_backend
        if choice is not None and choice.lower() not in dispatch.choices():
            raise ValueError(f"attention_backend must be one of {dispatch.choices()}, got {choice!r}")
        self.block_size = self.cache_config.block_size
        spec = self.cache_config.kv_dtype
        self.kv_dtype = None if spec.storage is None else getattr(torch, spec.storage)
        # How a quantised cache's layers quantise unless a checkpoint gives a layer its own scales.
        self.default_quant = (KVQuant.of(spec, self.cache_config.kv_quant_scheme,
                                         rotate=self.cache_config.kv_quant_rotation) if spec.is_quantized else None)
        self.model_config = config
        self.has_latent_kv = has_latent_kv(config)
        # Whether latent layers keep one row per token (`LatentLayer`) that paged steps read absorbed; a
        # quantised cache keeps their latent and rotary key as a quantised K and V instead, which only
        # dense steps read (the module expands the dequantised latents, as before absorption existed).
        self.latent_rows = self.has_latent_kv and not spec.is_quantized
        self._build_layers(config, lookback)
        # (num_kv_heads, head_dim, head_dim_v) of this rank, when every layer has one (else the pages have theirs)
        self._config_kv_shapes = (kv_head_shapes(config, self.cache_config.tensor_parallel_size)
                                  if self.pages is None else None)
        self.weights = WeightsEpoch(on_change=self.pool.reset_prefix_cache)
        self._seq_ids = itertools.count(1)  # next() is atomic: engines create sequences from any thread
        self._workspace = Workspace()  # attention scratch (gathers, split-K partials), reused across layers and steps
        self.step: StepMetadata | None = None  # the step whose forward runs (or ran last)
        self._cache: Any = None  # the `PagedCache` adapter bound to this owner
        # Kept sequences by seq_id, and those `release_later` queued (from any thread, no lock).
        self._held: dict[int, KVSequence] = {}
        self._to_release: deque[KVSequence] = deque()

    def _build_layers(self, config, lookback: int) -> None:
        """The layout (`config.kv_layout` of the layers' specs), the cache layers, the pool and its manager."""
        cfg = self.cache_config
        # Per layer, its own kind (what its attention masks); with enable_hybrid_kv=False every layer that
        # stores K/V keeps every token (the layout groups them as full attention), its mask unchanged.
        self.layer_specs = layer_specs_of(config, cfg.tensor_parallel_size)
        self.layout = layout = kv_layout(self.layer_specs, enable_hybrid_kv=cfg.enable_hybrid_kv)
        # Per-layer K/V shapes (Gemma 4): one K and one V page buffer, each layer a view at its offset.
        self.pages = None if layout.uniform_shape else PageBuffers(self.block_size, layout.page_k, layout.page_v)
        if self.pages is not None and cfg.kv_dtype.is_quantized:
            raise ValueError(
                f"hf_paged: kv_cache_dtype={cfg.kv_cache_dtype!r} with per-layer K/V shapes (model_type="
                f"{config.get_text_config(decoder=True).model_type!r}: its layers differ in KV heads or head size) is "
                "not supported yet (quantisation scales are kept per storage slot); use kv_cache_dtype='auto'")
        # Per-sequence state of recurrent layers (`hf.state`): rows of a store, grown as sequences come.
        shapes = state_specs(self.layer_specs)
        mixer = MIXERS.get(config.get_text_config(decoder=True).model_type)
        self.states = StateStore(shapes, 1, resumes=mixer != "mamba") if shapes else None
        self.state_slots = None
        self.pending_checkpoints: list[tuple[int, int]] = []  # (block hash, row) the running step writes
        self.layers = [self._layer(i, spec) for i, spec in enumerate(self.layer_specs)]
        self.state_layers = [layer for layer in self.layers if isinstance(layer, StateLayer)]
        # The layers that store K/V (a `SharedLayer` reads its source's and writes nothing).
        self.storage_layers = [layer for layer in self.layers if isinstance(layer, PagedLayer)]
        self._group_layout: dict | None = None
        self.pool = BlockPool(cfg.num_blocks or 0, cfg.enable_prefix_caching)
        self.manager = BlockManager(self.pool, self.block_size, layout.group_specs or (FullAttention(),),
                                    lookback=lookback)
        if self.states is not None:
            self.configure_states(1, 0, self.block_size)

    def _layer(self, i: int, spec):
        layout = self.layout
        where = (spec, layout.layer_group[i], layout.layer_slot[i],
                 *((layout.layer_offset_k[i], layout.layer_offset_v[i]) if self.pages is not None else ()))
        if isinstance(spec, LatentAttention) and self.latent_rows:
            return LatentLayer(self, *where)
        if isinstance(spec, LatentAttention) and spec.index_dim:
            raise ValueError(f"hf_paged: kv_cache_dtype={self.cache_config.kv_cache_dtype!r} with indexed sparse "
                             "attention (DeepSeek V3.2: its indexer keys live in the latent rows, which are not "
                             "quantised) is not supported; use kv_cache_dtype='auto'")
        if spec.owns_kv:
            return PagedLayer(self, *where) if spec.state is None else PagedStateLayer(self, self.states, i, *where)
        if spec.state is not None:
            return StateLayer(self.states, i)
        if isinstance(spec, NoCache):
            return DummyLayer()
        return SharedLayer(spec, layout.layer_group[i], layout.layer_slot[i])

    def configure_states(self, num_rows: int, max_checkpoints: int, interval: int) -> None:
        """Size the state rows of a model with recurrent layers: `num_rows` to start with (they grow
        when more sequences are live), at most `max_checkpoints` of them prefix-cache checkpoints taken
        every `interval` tokens (a multiple of the block size). Only before the first step."""
        if interval % self.block_size:
            raise ValueError(f"state_checkpoint_interval={interval} must be a multiple of block_size={self.block_size}")
        if not self.cache_config.enable_prefix_caching:
            max_checkpoints = 0
        self.state_slots = StateSlots(max(num_rows, max_checkpoints + 1), max_checkpoints, interval)
        self.states.resize(self.state_slots.num_rows)
        self.state_slots.on_grow = self.states.resize
        self.manager.use_state_slots(self.state_slots)

    @property
    def cache(self):
        """The `PagedCache` over this owner, which the model's layers write through."""
        if self._cache is None:
            raise RuntimeError("no PagedCache is bound to this KVOwner: build one with PagedCache(config, kv=owner)")
        return self._cache

    def bind(self, cache) -> None:
        """Called by the `PagedCache` built over this owner (one adapter per owner)."""
        if self._cache is not None and self._cache is not cache:
            raise ValueError("this KVOwner already has its PagedCache")
        self._cache = cache

    # ------------------------------------------------------------------ pool facts
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a registered prefix: in use, or free and reusable (then among `num_free_blocks`
        too: evicted when needed)."""
        return self.pool.num_cached_blocks

    def kv_numel_per_token(self) -> int:
        """Elements of one token's K and V over every storage slot (a transfer buffer's per-token size).

        Raises:
            ValueError: the layers differ in K/V shape (byte pages: a slot is no one shape), which K/V
                transfer does not move.
        """
        kv_transfer.check_transferable_layout(self)
        return sum(t[0, 0].numel() for layer in self.slot_owners() for t in layer.payload())

    def bytes_per_block(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of K and V one block takes across all layers: measured once every layer holds its
        tensors (or the page buffers exist), else from the config's K/V head shapes
        (`support.kv_head_shapes`; with per-layer shapes, the layout's pages)."""
        if self.pages is not None:
            if self.pages.is_allocated:
                return self.pages.bytes_per_block()
            itemsize = self.cache_config.kv_dtype.itemsize or torch.empty(0, dtype=dtype or torch.float32).element_size()
            return self.layout.bytes_per_block(self.block_size, itemsize)
        owners = self.slot_owners()
        if len(owners) == self.layout.num_slots:
            return sum(layer.bytes_per_block() for layer in owners)
        itemsize = torch.empty(0, dtype=dtype or torch.float32).element_size()
        if self.latent_rows:  # one row per token and layer: latent, rotary key (and indexer key)
            itemsize = self.cache_config.kv_dtype.itemsize or itemsize
            widths = {layer.slot: layer.spec.kv_elements_per_token for layer in self.storage_layers}
            return self.block_size * itemsize * sum(widths.values())
        num_kv_heads, head_dim, head_dim_v = self._config_kv_shapes
        per_token = kv_bytes_per_token_layer(num_kv_heads, head_dim, head_dim_v, self.cache_config.kv_dtype,
                                             self.cache_config.kv_quant_scheme, itemsize)
        return self.block_size * per_token * self.layout.num_slots

    @property
    def stored_dtype(self) -> torch.dtype | None:
        """The dtype the blocks are stored in, once a forward allocated them (None before)."""
        owner = self.slot_owner(0)
        return None if owner is None else owner.keys.dtype

    def slot_owner(self, slot: int) -> PagedLayer | None:
        """An initialised layer holding storage slot `slot`'s tensors, if any."""
        for layer in self.storage_layers:
            if layer.slot == slot and layer.is_initialized:
                return layer
        return None

    def slot_owners(self) -> list[PagedLayer]:
        """One initialised layer per storage slot that has tensors (a slot's layers share them), in
        slot order."""
        owners: dict[int, PagedLayer] = {}
        for layer in self.storage_layers:
            if layer.is_initialized:
                owners.setdefault(layer.slot, layer)
        return [owners[slot] for slot in sorted(owners)]

    # ------------------------------------------------------------------ the step transaction
    def begin(self, step: StepMetadata) -> None:
        """Run the next forward with `step`, planned outside the owner (the engine's scheduler owns the
        sequences and their block tables); applies its copy-on-write copies first.

        Raises:
            RuntimeError: the previous step's forward did not finish.
        """
        if self.step_is_unfinished():
            self.step = None
            raise RuntimeError("the previous forward with this PagedCache did not finish (it raised?)")
        self._apply_copies(step.copies)
        state = getattr(step, "state", None)
        if state is not None:
            self.states.resize(state.max_row() + 1)  # a follower rank's rows grow with rank 0's
            self.states.copy_rows([src for src, _ in state.restores], [dst for _, dst in state.restores])
        self.open(step)

    def open(self, step: StepMetadata) -> None:
        """Make `step` the one the layers write (its blocks are allocated and its copies applied)."""
        step.plan = dispatch.plan(step, self._workspace, backend=self.cache_config.attention_backend)  # once per step
        self.step = step
        note_paged_step(step)

    def write(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor,
              step: StepMetadata) -> PagedLayer:
        """Store `step`'s new K/V of layer `layer_idx` (allocating its tensors at first sight) and
        return the layer.

        Args:
            key_states, value_states: [batch, num_kv_heads, q_len, head_dim] (V: head_dim_v).
        """
        step.layers_done.add(layer_idx)
        if len(step.layers_done) == len(self.storage_layers):
            note_paged_step(None)  # masks built after this forward are for someone else
        layer = self.layers[layer_idx]
        if isinstance(layer, SharedLayer):
            raise UnsupportedModelError(
                f"hf_paged: the model wrote K/V to cache layer {layer_idx}, which its config says reads layer "
                f"{layer.source}'s (num_kv_shared_layers) and stores none; load it with attn_implementation='sdpa'")
        if not layer.belongs_to(self):
            raise UnsupportedModelError(
                f"hf_paged: the model wrote K/V to cache layer {layer_idx}, a copy it made of one of the paged "
                "cache's layers (a layer run several times with K/V kept per pass, as Dory's "
                "recurrent block keeps them): the paged pool holds one set of blocks per layer of the config, so "
                "attn_implementation='hf_paged' cannot serve it; load it with attn_implementation='sdpa' or 'eager'")
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
            note_paged_write(*layer.paged_kv(), step, layer_idx)  # the attention checks what reaches it
            if layer.scales is not None:
                step.kv_scales[layer_idx] = layer.scales  # the attention finds a layer's scales by its index
        return layer

    def commit(self, new_full_blocks: Sequence[tuple[int, int]]) -> None:
        """Every layer wrote the step's K/V: publish the blocks it filled in the prefix cache."""
        note_paged_write(None)
        self.manager.commit_full_blocks(new_full_blocks)
        pending, self.pending_checkpoints = self.pending_checkpoints, []
        for key, row in pending:  # a checkpoint is findable only beside the block it ends
            if self.pool.lookup(key) is not None:
                self.state_slots.publish(key, row)
            else:
                self.state_slots.cancel(row)

    def abort(self, reset_prefix_cache: bool = False) -> None:
        """The step failed before its K/V were complete: forget it; nothing it staged is published
        (the engine's steps hash their blocks only at `commit`). Idempotent. A step planned from a
        padded batch hashed its blocks as it allocated them: `reset_prefix_cache=True` drops every
        hash if its forward did not finish."""
        if reset_prefix_cache and self.step_is_unfinished():
            self.pool.reset_prefix_cache()
        self.step = None
        note_paged_step(None)
        note_paged_write(None)
        self.pool.discard_staged()
        pending, self.pending_checkpoints = self.pending_checkpoints, []
        for _, row in pending:
            self.state_slots.cancel(row)

    def step_is_unfinished(self) -> bool:
        return self.step is not None and len(self.step.layers_done) < len(self.storage_layers)

    def append(self, seqs: list[KVSequence],
               new_tokens: list[list[int]]) -> tuple[list[list[list[int]]], list[tuple[int, int]]]:
        """Append `new_tokens[i]` to `seqs[i]` for a forward planned from a padded batch (their full
        blocks are hashed now) and apply the copy-on-write copies; `ensure_free_blocks` made room
        first. Returns each sequence's per-group slots and the copies."""
        slots, copies = [], []
        for seq, tokens in zip(seqs, new_tokens):
            result = self.manager.append_tokens(seq, tokens)
            slots.append(result.group_slots)
            copies.extend(result.copies)
        self._apply_copies(copies)
        return slots, copies

    def group_fields(self, group_slots: list[list[list[int]]], seqs: list[KVSequence]) -> dict:
        """The metadata builders' per-group arguments for sequences `seqs` whose appends returned
        `group_slots` (per sequence, per group)."""
        groups = range(self.manager.num_groups)
        return dict(group_slots=[[row[g] for row in group_slots] for g in groups],
                    group_block_tables=[[seq.block_tables[g] for seq in seqs] for g in groups],
                    **self.group_layout())

    def group_layout(self) -> dict:
        """What every step's metadata says about the KV groups, whatever the sequences: each layer's
        group (`layer_group`, None for one group), what each group keeps (`group_masks`), each layer's
        own mask (`layer_masks`) and, where layers read others' K/V, whose (`layer_source`)."""
        if self._group_layout is None:  # the same for every step: built once
            layout, specs = self.layout, self.layer_specs
            shared = any(not spec.owns_kv for spec in specs)
            self._group_layout = dict(
                layer_group=layout.layer_group or None, group_masks=tuple(s.mask for s in layout.group_specs),
                layer_masks=tuple(s.mask for s in specs),
                layer_source=tuple(getattr(s, "source", i) for i, s in enumerate(specs)) if shared else None)
        return dict(self._group_layout)

    def _apply_copies(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        if self.pages is not None:  # every layer's bytes of a block are one row of the page buffers
            if self.pages.is_allocated:
                device = self.pages.keys.device
                self.pages.copy_blocks(host_to_device([s for s, _ in copies], torch.long, device),
                                       host_to_device([d for _, d in copies], torch.long, device))
            return
        indices: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # one asynchronous copy per device
        for layer in self.slot_owners():  # a block's bytes in every slot, whichever group holds it
            if layer.device not in indices:
                indices[layer.device] = (host_to_device([s for s, _ in copies], torch.long, layer.device),
                                         host_to_device([d for _, d in copies], torch.long, layer.device))
            layer.copy_blocks(*indices[layer.device])

    # ------------------------------------------------------------------ sequences and the pool
    def new_sequence(self, for_paged_steps: bool = True) -> KVSequence:
        """A fresh `KVSequence` salted for this pool (its `cache_salt` and current weights epoch);
        `for_paged_steps`: a sequence the engine plans (hashed even when its rotary frequencies follow
        its length, as its rope history is kept)."""
        # Stock generate's rows and imported prompts carry no rope history: unhashed where it matters.
        return KVSequence(seq_id=self.next_seq_id(), extra_key=self.sequence_salt(),
                          is_cacheable=for_paged_steps or not self._length_rope)

    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    def fork_sequence(self, seq: KVSequence) -> KVSequence:
        """A new sequence sharing every block of `seq` (copy-on-write on its next write): one sample
        of n continuing a prompt computed once."""
        fork = self.manager.fork(seq, self.next_seq_id())
        if self.state_slots is not None and seq.state_row is not None:  # the parent's state as of now
            fork.state_row = self.state_slots.allocate(1)
            self.state_slots.copy_later(seq.state_row, fork.state_row)
        return fork

    def free_sequence(self, seq: KVSequence) -> None:
        self.manager.free(seq)

    def sequence_salt(self) -> tuple:
        """What every block hash of a sequence starting now is salted with: the `cache_salt`, the
        current weights epoch and the KV storage (dtype and quantisation scheme). A sequence that
        stores nothing yet may be re-salted with it."""
        cfg = self.cache_config
        return (cfg.cache_salt, self.weights.epoch, cfg.kv_cache_dtype, cfg.kv_quant_scheme, cfg.kv_quant_rotation)

    def note_weights(self, fingerprint) -> None:
        """Called before each step with `weights_fingerprint(model)`; see `WeightsEpoch.note`."""
        self.weights.note(fingerprint)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def ensure_free_blocks(self, seqs: list[KVSequence], new_tokens: list[list[int]], dtype: torch.dtype) -> None:
        """Grow the pool (and every layer's tensors) until these appends' new blocks are free."""
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
        between steps."""
        if num_blocks <= self.pool.num_blocks:
            return
        self.pool.grow(num_blocks - self.pool.num_blocks)
        if self.pages is not None:
            self.pages.resize(self.pool.num_blocks)
        owners = {layer.slot: layer for layer in self.slot_owners()}
        for layer in owners.values():
            layer.resize(self.pool.num_blocks)
        for layer in self.storage_layers:  # the other layers of each slot share its owner's new tensors
            if layer is not owners.get(layer.slot):
                layer.resize(self.pool.num_blocks, like=owners.get(layer.slot))

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
            if not 0 <= idx < len(self.layers) or not isinstance(self.layers[idx], PagedLayer) \
                    or self.layers[idx].is_initialized:
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
