"""`StepPlan`: the attention work of one forward step, planned once and run by every layer.

FlashInfer splits attention into `plan()`, host-side and once per batch, and `run()`, once per layer;
vLLM v1 builds its `AttentionMetadata` once per step and each layer's backend impl only runs. Ours:

    dispatch.plan(step, workspace, backend=None)   once per step (`KVOwner.begin` / `PagedCache.plan_step`):
        the backends ("cpu" / "torch" / "flex" / "triton", then their fallbacks; see `backend.py`):
        the caller's choice, else HF_PAGED_BACKEND read here and nowhere per layer (once per step,
        not per engine: a test or a server that switches it between steps is obeyed from the next
        step on), and the cache's scratch `Workspace`
    dispatch.store_kv(..., plan=)    per layer: writes with the plan's backend
    dispatch.paged_attention(..., plan=)   per layer, the `run()`: the first of the plan's backends
        that declares the layer, with its kernel, tiling, split count, tuned config and scratch, as
        planned

What a step's layers share depends on each layer's shapes (head counts, head dims, dtypes, block
size, mask rule), which FlashInfer's `plan()` takes as arguments. Ours reads them off the first
layer of each kind that runs and memoises the result on the plan (`triton_plan`, `torch_plan`):
later layers of the kind, usually all of them, do a dictionary lookup and launch. A model has one to
three kinds (full, sliding and chunked layers).

    per kind, Triton decode   `triton.decode.DecodePlan`: query tiling, split count, config, and the
                              split-K partials [num_splits, num_tokens, num_q_heads, head_dim_v] and
                              log-sum-exps, views of the cache's `Workspace`
    per kind, Triton prefill  `triton.prefill.PrefillPlan`: config and tiles
    per KV group, torch/cpu   `torch_paged.AttentionPlan`: gather indices and masks, whose gathers
                              take the same `Workspace`'s buffers; the native kernel's runs
    per KV group, flex        `flex_paged.FlexPlan`: its calls, block masks and block positions

CUDA graphs: a decode graph's step begins inside the captured forward, so its plan is made by the
eager warm-up on the same shapes (which sizes the workspace) and again at capture, where it only
takes views (a workspace refuses to grow during a capture). The graph's metadata keeps the captured
plan, and with it the scratch its kernels write, for as long as the graph lives.

Owns the per-step derived attention state (nothing else holds it); it knows no request and no
transformers object.
"""

from __future__ import annotations

import torch

from ..config import MAX_DECODE_QUERY_LEN
from .flex_paged import FlexPlan
from .torch_paged import AttentionPlan
from .workspace import Workspace


class StepPlan:
    """The attention plan of one step (see the module docstring). Build it with `dispatch.plan`.

    Attributes:
        backend: the step's backend ("cpu", "torch", "flex", "triton" or a registered one), fixed for
            the step: the one chosen (or the first of auto's that serves the step's device).
        backends: `backend`, then the fallbacks that run the layers it does not declare, in order.
        workspace: the cache's scratch buffers (None: every launch plan allocates its own).
        num_layer_plans: launch plans made so far: one per layer kind (Triton) or KV group (torch),
            never one per layer.
    """

    def __init__(self, backend: str, workspace: Workspace | None = None, key_limits: torch.Tensor | None = None,
                 fallbacks: tuple[str, ...] = ()):
        self.backend = backend
        self.backends = (backend, *fallbacks)
        self.workspace = workspace
        self.key_limits = key_limits  # [num_tokens] the step's `StepMetadata.key_limits` (torch only)
        self._triton: dict[tuple, object] = {}  # layer kind -> DecodePlan / PrefillPlan
        self._torch: list[tuple[torch.Tensor, tuple, AttentionPlan]] = []  # (block_tables, (block_size,), plan)
        self._flex: list[tuple[torch.Tensor, tuple, FlexPlan]] = []  # (block_tables, (block_size, pool), plan)
        self.num_layer_plans = 0

    def for_other_queries(self) -> "StepPlan":
        """A plan for a view of this step with other queries (`StepMetadata.last_columns`): the same
        backends, chosen once for the step, and none of the launch plans made for these queries."""
        return StepPlan(self.backend, None, None, self.backends[1:])

    @property
    def launch_plans(self) -> list:
        """The Triton launch plans made so far, one per layer kind."""
        return list(self._triton.values())

    def triton_plan(self, call):
        """The Triton launch plan (`DecodePlan` up to MAX_DECODE_QUERY_LEN queries per sequence, else
        `PrefillPlan`) of layers shaped like `call`, made by the first of them."""
        query, key_cache = call.query, call.key_cache
        kind = (query.shape, query.dtype, key_cache.shape[1:], call.value_cache.shape[3], key_cache.dtype,
                call.block_tables.shape[0], call.max_seqlen_q, call.max_seqlen_k, call.mask)
        plan = self._triton.get(kind)
        if plan is None:
            plan = self._triton[kind] = self._plan_triton(call)
            self.num_layer_plans += 1
        return plan

    def _plan_triton(self, call):
        query, key_cache = call.query, call.key_cache
        shapes = dict(num_q_heads=query.shape[1], num_kv_heads=key_cache.shape[2], head_dim=query.shape[2],
                      head_dim_v=call.value_cache.shape[3], block_size=key_cache.shape[1], dtype=query.dtype,
                      kv_dtype=key_cache.dtype, max_seqlen_q=call.max_seqlen_q, device=query.device)
        if call.max_seqlen_q <= MAX_DECODE_QUERY_LEN:
            from .triton.decode import plan_decode

            return plan_decode(**shapes, num_tokens=query.shape[0], num_seqs=call.block_tables.shape[0],
                               max_seqlen_k=call.max_seqlen_k, sliding_window=call.mask.window,
                               chunk_size=call.mask.chunk, workspace=self.workspace)
        from .triton.prefill import plan_prefill

        return plan_prefill(**shapes)

    def flex_plan(self, call) -> FlexPlan:
        """The flex backend's calls, masks and block positions over `call.block_tables` (one of the
        step's KV groups'), made by the first layer that reads that table."""
        block_size, num_blocks = call.key_cache.shape[1], call.key_cache.shape[0]
        return self._per_table(self._flex, call.block_tables, (block_size, num_blocks), lambda: FlexPlan(
            call.block_tables, call.seq_lens, call.cu_seqlens_q, block_size, num_blocks))

    def torch_plan(self, call) -> AttentionPlan:
        """The torch path's indices and masks over `call.block_tables` (one of the step's KV groups'),
        made by the first layer that reads that table (one host sync per step and KV group). On a
        "cpu" step it also holds the native kernel's runs."""
        block_size = call.key_cache.shape[1]
        return self._per_table(self._torch, call.block_tables, (block_size,), lambda: AttentionPlan(
            call.block_tables, call.seq_lens, call.cu_seqlens_q, call.max_seqlen_q, call.max_seqlen_k, block_size,
            workspace=self.workspace, key_limits=self.key_limits, native=self.backend == "cpu"))

    def _per_table(self, plans: list, block_tables: torch.Tensor, key: tuple, build):
        """The plan in `plans` made for this very `block_tables` tensor (a KV group's) and `key`, else
        a new one from `build()`."""
        for tables, made_for, plan in plans:
            if tables is block_tables and made_for == key:
                return plan
        plan = build()
        plans.append((block_tables, key, plan))
        self.num_layer_plans += 1
        return plan
