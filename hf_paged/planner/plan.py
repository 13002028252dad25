"""How many KV blocks and sequences fit one GPU (`plan`), and which tensor-parallel split fits when
one GPU does not (`tp_options`, `smallest_fit`). Blocks are counted as `PagedCache` allocates them
(`config.kv_layout` over the layers' specs, `config.kv_bytes_per_block`, `config.blocks_held`).
Torch-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import DEFAULT_BLOCK_SIZE, blocks_held, kv_bytes_per_block, kv_layout
from .kv import kv_bytes_per_token, num_state_checkpoints
from .shape import GB, ModelShape, check_positive, dtype_spec, weight_bytes


@dataclass(frozen=True)
class Plan:
    """What fits in one GPU. Blocks follow `PagedCache`'s layout (`config.kv_layout`): a
    block holds `block_size` tokens of one group's layers, bytes_per_block = block_size * (page_k +
    page_v) * bytes_per_element (`config.kv_bytes_per_block`; with one K/V shape, block_size *
    kv_bytes_per_layer_token * num_slots: every layer for a model with full attention only); a
    sequence holds `blocks_held` blocks per KV group, the equation the cache frees by (a layer that
    reuses another's K/V holds none). A model with
    a fixed state per sequence (linear attention, Mamba) spends `state_bytes_per_seq` of the budget on
    each sequence besides its blocks, and as much again on each of `num_state_checkpoints` prefix-cache
    checkpoints of it (by default one per sequence that fits, the engine's default); `num_blocks` is then
    what the budget holds beside the states of `num_seqs_paged` sequences and the checkpoints."""

    model: str
    memory_bytes: int
    utilization: float
    weight_bytes: int
    kv_budget_bytes: int
    block_size: int
    bytes_per_block: int
    num_blocks: int
    seq_len: int
    max_seq_len: int
    blocks_per_seq: int  # every KV group, while the step that brings it to seq_len writes step_tokens
    num_seqs_paged: int  # num_blocks // blocks_per_seq
    num_seqs_contiguous: int  # kv_budget // (max_seq_len * bytes_per_token)
    contiguous_waste_bytes: int  # reserved but never written by those contiguous sequences
    contiguous_waste_fraction: float  # 1 - seq_len / max_seq_len
    paged_waste_bytes: int  # slots of held blocks beyond the tokens each group must keep
    num_kv_groups: int = 1
    step_tokens: int = 1
    num_seqs_without_hybrid: int = 0  # the same with every layer keeping every token (enable_hybrid_kv=False)
    state_bytes_per_seq: int = 0
    num_state_checkpoints: int = 0  # prefix-cache state checkpoints beside the num_seqs_paged sequences
    state_checkpoint_bytes: int = 0  # num_state_checkpoints * state_bytes_per_seq
    freeing_kinds: tuple = ()  # the layer kinds whose groups free blocks (sliding_attention, chunked_attention)

    def to_dict(self) -> dict:
        return asdict(self)


def plan(shape: ModelShape, *, memory_bytes: int | None = None, utilization: float = 0.9, seq_len: int,
         block_size: int = DEFAULT_BLOCK_SIZE, max_seq_len: int | None = None, weight_dtype: str = "bfloat16",
         kv_dtype: str = "bfloat16", kv_budget_bytes: int | None = None, step_tokens: int = 1,
         state_checkpoints: int | None = None) -> Plan:
    """How many KV blocks and sequences fit.

        kv_budget   = floor(memory_bytes * utilization) - weight_bytes     (or `kv_budget_bytes`)
        num_blocks  = kv_budget // (block_size * kv_bytes_per_layer_token * num_slots)
        per seq     = sum over KV groups of blocks_held(seq_len - step_tokens, group spec, block_size,
                                                         new_tokens=step_tokens)
        paged       = the most n with n * (per seq * bytes_per_block + state_bytes_per_seq)
                                      + checkpoints(n) * state_bytes_per_seq <= kv_budget
        contiguous  = the same with max_seq_len * kv_bytes_per_token per sequence
                                                                            every sequence reserves max_seq_len
        checkpoints(n) = `state_checkpoints`, else the engine's default for max_num_seqs = n
                         (`config.default_max_state_checkpoints`; 0 without a per-sequence state)

    `step_tokens`: tokens the step that brings a sequence to `seq_len` writes (1: decoding; a
    prefill chunk while prefilling). A sliding (chunked) group holds its window (chunk) plus that
    step's tokens.
    `max_seq_len` defaults to the config's max_position_embeddings (else `seq_len`).

    Raises:
        WeightsDoNotFit: the weights leave no KV budget (`tp_options` finds the splits that do).
        ValueError: any other bad argument.
    """
    check_positive(block_size=block_size, seq_len=seq_len)
    for name, value in (("block_size", block_size), ("seq_len", seq_len)):
        if not isinstance(value, int):
            raise ValueError(f"{name.replace('_', '-')} must be an integer, got {value!r}")
    max_seq_len = max_seq_len or shape.max_position_embeddings or seq_len
    check_positive(max_seq_len=max_seq_len)
    if seq_len > max_seq_len:
        raise ValueError(f"seq-len {seq_len} is longer than max-seq-len {max_seq_len}")
    weights = weight_bytes(shape, weight_dtype)
    if kv_budget_bytes is None:
        if memory_bytes is None:
            raise ValueError("plan needs a GPU memory size (--gpu or --memory-gb) or a KV budget (--kv-budget)")
        check_positive(memory=memory_bytes)
        if not 0 < utilization <= 1:
            raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
        usable = int(memory_bytes * utilization)
        kv_budget_bytes = usable - weights
        if kv_budget_bytes <= 0:
            raise WeightsDoNotFit(f"the weights ({weights / GB:.1f} GB in {weight_dtype}) do not fit in "
                                  f"{usable / GB:.1f} GB ({utilization:.0%} of {memory_bytes / GB:.1f} GB)")
    else:
        check_positive(kv_budget=kv_budget_bytes)
        memory_bytes = memory_bytes or 0
    if isinstance(step_tokens, bool) or not isinstance(step_tokens, int) or not 1 <= step_tokens <= seq_len:
        raise ValueError(f"step-tokens must be an integer in [1, seq-len], got {step_tokens!r}")
    per_token = kv_bytes_per_token(shape, kv_dtype)
    state = shape.state_bytes_per_seq
    layout = kv_layout(shape.kv_layer_specs)
    per_block = kv_bytes_per_block(layout, block_size, dtype_spec(kv_dtype)) if layout.groups else 0
    before = seq_len - step_tokens
    blocks_per_seq = sum(blocks_held(before, spec, block_size, new_tokens=step_tokens) for spec in layout.group_specs)
    if not blocks_per_seq * per_block + state:
        raise ValueError(f"{shape.name} keeps neither K/V nor a state per sequence: nothing to plan")
    kept_tokens = sum(seq_len - spec.first_readable(before) for spec in layout.group_specs)
    num_state_checkpoints(shape, 1, state_checkpoints)  # checks it
    fit = lambda per_seq: _fit(shape, kv_budget_bytes, per_seq + state, state_checkpoints)  # noqa: E731
    paged, checkpoints = fit(blocks_per_seq * per_block)
    num_blocks = max(0, (kv_budget_bytes - (paged + checkpoints) * state) // per_block) if per_block else 0
    contiguous = fit(max_seq_len * per_token)[0]
    without_hybrid = fit(-(-seq_len // block_size) * block_size * per_token)[0]
    return Plan(
        model=shape.name, memory_bytes=memory_bytes, utilization=utilization, weight_bytes=weights,
        kv_budget_bytes=kv_budget_bytes, block_size=block_size, bytes_per_block=per_block, num_blocks=num_blocks,
        seq_len=seq_len, max_seq_len=max_seq_len, blocks_per_seq=blocks_per_seq, num_seqs_paged=paged,
        num_seqs_contiguous=contiguous,
        contiguous_waste_bytes=contiguous * (max_seq_len - seq_len) * per_token,
        contiguous_waste_fraction=1 - seq_len / max_seq_len,
        paged_waste_bytes=paged * (blocks_per_seq * block_size - kept_tokens) * per_block // block_size,
        num_kv_groups=len(layout.groups), step_tokens=step_tokens, num_seqs_without_hybrid=without_hybrid,
        state_bytes_per_seq=state, num_state_checkpoints=checkpoints, state_checkpoint_bytes=checkpoints * state,
        freeing_kinds=tuple(dict.fromkeys(s.kind for s in layout.group_specs if s.reach is not None)),
    )


def _fit(shape: ModelShape, budget: int, per_seq: int, state_checkpoints: int | None) -> tuple[int, int]:
    """The most sequences of `per_seq` bytes each that fit `budget` beside the state checkpoints counted
    for them (`kv.num_state_checkpoints`), and that checkpoint count."""
    state = shape.state_bytes_per_seq
    if not state:
        return budget // per_seq, 0
    checkpoints = lambda n: num_state_checkpoints(shape, n, state_checkpoints)  # noqa: E731
    lo, hi = 0, budget // per_seq
    while lo < hi:  # the cost rises with n (the default checkpoint count does not fall): bisect
        mid = (lo + hi + 1) // 2
        if mid * per_seq + checkpoints(mid) * state <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo, checkpoints(lo)


class WeightsDoNotFit(ValueError):
    """The weights alone exceed the usable memory of one device."""


@dataclass(frozen=True)
class TPOption:
    """One device's figures under a tensor-parallel split (`tp_options`)."""

    tensor_parallel_size: int
    weight_bytes: int
    kv_budget_bytes: int  # <= 0: the weights do not fit
    num_seqs_paged: int

    def to_dict(self) -> dict:
        return asdict(self)


def tp_sizes(shape: ModelShape, above: int = 1) -> list[int]:
    """The tensor-parallel sizes above `above` a model allows: powers of two dividing its attention
    heads and every layer's KV heads (what `ModelShape.per_rank` requires; a latent-attention layer's
    one row is whole on every rank, so only its query heads count)."""
    sizes, tp = [], 2
    kv_heads = shape.kv_head_counts or (() if shape.is_mla else (shape.num_kv_heads,))
    while tp <= max(shape.num_attention_heads, 1):
        if tp > above and not shape.num_attention_heads % tp and not any(h % tp for h in kv_heads):
            sizes.append(tp)
        tp *= 2
    return sizes


def tp_options(shape: ModelShape, *, memory_bytes: int, utilization: float = 0.9, above: int = 1,
               **plan_kwargs) -> list[TPOption]:
    """One device's weights, KV budget and sequences for every size of `tp_sizes(shape, above)`;
    `plan_kwargs` as `plan`'s (seq_len, block_size, dtypes, ...)."""
    options = []
    for tp in tp_sizes(shape, above):
        rank = shape.per_rank(tp)
        weights = weight_bytes(rank, plan_kwargs.get("weight_dtype", "bfloat16"))
        budget = int(memory_bytes * utilization) - weights
        try:
            seqs = plan(rank, memory_bytes=memory_bytes, utilization=utilization, **plan_kwargs).num_seqs_paged
        except WeightsDoNotFit:
            seqs = 0
        options.append(TPOption(tp, weights, budget, seqs))
    return options


def smallest_fit(options: list[TPOption]) -> TPOption | None:
    """The smallest split of `options` (`tp_options`) at which one device holds the weights and at
    least one sequence; None when none does."""
    return next((o for o in options if o.num_seqs_paged >= 1), None)
