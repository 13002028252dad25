"""KV bytes of a `ModelShape`: per token and layer, per sequence (with any fixed state), the prefix
cache's state checkpoints, the K/V a decode step reads, and the MHA / GQA / MQA / MLA / fp8 comparison
of `hf-paged kv-size --compare`. The formulas are in `sizing`'s docstring; a layer's bytes per token come
from `config.kv_bytes_per_token_layer` over its own K/V shape (its spec's), the formula the cache itself
allocates by (a latent layer: its row, `kv_spec.LatentAttention.row_width`), and the tokens it holds
from its spec (`kv_spec`): every token, a window, a chunk, or none for a layer reusing another's K/V.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import default_max_state_checkpoints, kv_bytes_per_token_layer, kv_scale_bytes_per_token_layer
from ..kv_spec import LatentAttention, LayerSpec
from .shape import GB, GiB, ModelShape, check_positive, dtype_spec


def kv_bytes_per_layer_token(shape: ModelShape, kv_dtype: str = "bfloat16") -> int:
    """Bytes one token takes in a layer of the config's KV heads and head size: 2 * num_kv_heads *
    head_dim * bpe, or for MLA its first latent layer's row (`spec_bytes_per_token`: (kv_lora_rank +
    qk_rope_head_dim [+ index_head_dim]) * bpe)."""
    if shape.latent_specs:
        return spec_bytes_per_token(shape.latent_specs[0], kv_dtype)
    return kv_bytes_per_token_layer(shape.num_kv_heads, shape.head_dim, shape.v_head_dim, dtype_spec(kv_dtype))


def spec_bytes_per_token(spec: LayerSpec, kv_dtype: str = "bfloat16") -> int:
    """Bytes one token takes in the layer of `spec`, by its own K/V shape (0: it reuses another's); a
    latent layer's row (`kv_spec.LatentAttention.row_width`: latent, rope key, indexer key) is one
    shared head, quantised with the two scales of one head's K and V, as the planner has always
    counted MLA."""
    if not spec.owns_kv:
        return 0
    dtype = dtype_spec(kv_dtype)
    if isinstance(spec, LatentAttention):
        return spec.row_width * dtype.itemsize + kv_scale_bytes_per_token_layer(spec.shape.num_kv_heads, dtype)
    s = spec.shape
    return kv_bytes_per_token_layer(s.num_kv_heads, s.head_dim, s.head_dim_v, dtype)


def tokens_held(spec: LayerSpec, seq_len: int) -> int:
    """Tokens the layer of `spec` stores for a sequence of `seq_len` tokens, at most: every one for
    full attention, min(seq_len, window) for a sliding window, min(seq_len, chunk) for chunked local
    attention (`spec.max_tokens_held` of a one-token step), none for a layer reusing another's K/V."""
    held = spec.max_tokens_held(1)
    return seq_len if held is None else min(seq_len, held)


def kv_scale_bytes_per_token(shape: ModelShape, kv_dtype: str = "bfloat16") -> int:
    """Of `kv_bytes_per_token`, the bytes of a quantised cache's scales (0 unquantised)."""
    return sum(kv_scale_bytes_per_token_layer(s.shape.num_kv_heads, dtype_spec(kv_dtype))
               for s in shape.kv_layer_specs if s.owns_kv)


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str = "bfloat16") -> int:
    """Bytes one token takes across the layers that keep K/V, before any window or chunk cap: the sum
    over those layers of 2 * num_kv_heads * head_dim * bytes_per_element, each by its own shape (MLA:
    see the module docstring). A layer with a fixed state instead (linear attention, Mamba) adds
    nothing per token, nor does one that reuses another layer's K/V (Gemma 3n/4)."""
    return sum(spec_bytes_per_token(s, kv_dtype) for s in shape.kv_layer_specs)


def kv_bytes(shape: ModelShape, seq_len: int, batch_size: int = 1, kv_dtype: str = "bfloat16") -> int:
    """Bytes the KV cache and fixed state of `batch_size` sequences of `seq_len` tokens hold; a
    sliding-window layer stores min(seq_len, window) tokens, a chunked one min(seq_len, chunk)
    (`tokens_held`)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq-len must be a non-negative integer, got {seq_len!r}")
    check_positive(batch=batch_size)
    per_seq = sum(tokens_held(s, seq_len) * spec_bytes_per_token(s, kv_dtype) for s in shape.kv_layer_specs)
    return batch_size * (per_seq + shape.state_bytes_per_seq)


def kv_bytes_read(shape: ModelShape, seq_len: int, batch_size: int = 1, kv_dtype: str = "bfloat16") -> int:
    """Bytes of K/V and fixed state one decode step reads for `batch_size` sequences of `seq_len`
    cached tokens: what `kv_bytes` holds, except in an indexed sparse-attention layer (DeepSeek V3.2),
    whose indexer reads every cached token's indexer key and whose attention reads the latent and
    rope key (and scales) of only min(index_topk, tokens held) of them."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq-len must be a non-negative integer, got {seq_len!r}")
    check_positive(batch=batch_size)
    itemsize = dtype_spec(kv_dtype).itemsize
    per_seq = 0
    for spec in shape.kv_layer_specs:
        held, nbytes = tokens_held(spec, seq_len), spec_bytes_per_token(spec, kv_dtype)
        if isinstance(spec, LatentAttention) and spec.index_topk:
            index = spec.index_dim * itemsize
            per_seq += held * index + min(held, spec.index_topk) * (nbytes - index)
        else:
            per_seq += held * nbytes
    return batch_size * (per_seq + shape.state_bytes_per_seq)


def num_state_checkpoints(shape: ModelShape, max_num_seqs: int, checkpoints: int | None = None) -> int:
    """The state checkpoints prefix caching keeps beside `max_num_seqs` running sequences: `checkpoints`
    (an engine's `max_state_checkpoints`), by default the engine's own default
    (`config.default_max_state_checkpoints`); 0 for a model without a per-sequence state. Each is one
    sequence's whole state (`state_bytes_per_seq`).

    Raises:
        ValueError: `checkpoints` is not a non-negative integer.
    """
    if checkpoints is not None and (isinstance(checkpoints, bool) or not isinstance(checkpoints, int)
                                    or checkpoints < 0):
        raise ValueError(f"state-checkpoints must be a non-negative integer, got {checkpoints!r}")
    if not shape.state_bytes_per_seq:
        return 0
    return default_max_state_checkpoints(max_num_seqs) if checkpoints is None else checkpoints


@dataclass(frozen=True)
class KVSize:
    """One row of `hf-paged kv-size`."""

    variant: str
    num_kv_heads: int
    kv_dtype: str
    seq_len: int
    batch_size: int
    bytes_per_token: int  # payload plus, for a quantised cache, its scales
    bytes_per_seq: int  # K/V plus the fixed state
    total_bytes: int  # batch_size * bytes_per_seq + state_checkpoint_bytes
    scale_bytes_per_token: int = 0  # of bytes_per_token
    state_bytes_per_seq: int = 0  # of bytes_per_seq: linear-attention / Mamba state, whatever the length
    num_state_checkpoints: int = 0  # prefix-cache checkpoints of that state
    state_checkpoint_bytes: int = 0  # num_state_checkpoints * state_bytes_per_seq

    @property
    def total_gb(self) -> float:
        return self.total_bytes / GB

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GiB

    def to_dict(self) -> dict:
        return {**asdict(self), "bytes_per_seq_gb": self.bytes_per_seq / GB,
                "bytes_per_seq_gib": self.bytes_per_seq / GiB, "total_gb": self.total_gb, "total_gib": self.total_gib}


def kv_size(shape: ModelShape, seq_len: int, batch_size: int = 1, kv_dtype: str = "bfloat16",
            variant: str | None = None, state_checkpoints: int | None = None) -> KVSize:
    """Per-token, per-sequence and total KV bytes of `batch_size` sequences of `seq_len` tokens; the
    total counts the prefix cache's state checkpoints too (`num_state_checkpoints`: `state_checkpoints`,
    by default the engine's default for `batch_size` running sequences)."""
    check_positive(batch=batch_size)
    per_seq = kv_bytes(shape, seq_len, 1, kv_dtype)
    checkpoints = num_state_checkpoints(shape, batch_size, state_checkpoints)
    checkpoint_bytes = checkpoints * shape.state_bytes_per_seq
    return KVSize(variant=variant or shape.attention_kind, num_kv_heads=1 if shape.is_mla else shape.num_kv_heads,
                  kv_dtype=dtype_spec(kv_dtype).name, seq_len=seq_len,
                  batch_size=batch_size, bytes_per_token=kv_bytes_per_token(shape, kv_dtype),
                  bytes_per_seq=per_seq, total_bytes=per_seq * batch_size + checkpoint_bytes,
                  scale_bytes_per_token=kv_scale_bytes_per_token(shape, kv_dtype),
                  state_bytes_per_seq=shape.state_bytes_per_seq, num_state_checkpoints=checkpoints,
                  state_checkpoint_bytes=checkpoint_bytes)


def attention_variants(shape: ModelShape, kv_dtype: str = "bfloat16") -> list[tuple[str, ModelShape, str]]:
    """(label, shape, kv_dtype) for the side-by-side comparison: MHA, GQA, MQA, the model's MLA if it
    has one, and the model's own attention quantised to fp8 (int8 has the same size).

    Raises:
        ValueError: the model has no attention layers to compare.
    """
    if not shape.num_kv_layers:
        raise ValueError(f"{shape.name} has no attention layers: no attention variants to compare")
    heads = shape.num_attention_heads
    gqa = shape.num_kv_heads if 1 < shape.num_kv_heads < heads and not shape.is_mla else 8
    rows = [("MHA", shape.with_kv_heads(heads), kv_dtype)]
    if 1 < gqa < heads and heads % gqa == 0:
        rows.append((f"GQA-{gqa}", shape.with_kv_heads(gqa), kv_dtype))
    rows.append(("MQA", shape.with_kv_heads(1), kv_dtype))
    if shape.is_mla:
        rows.append(("MLA", shape, kv_dtype))
    if not dtype_spec(kv_dtype).is_quantized:
        rows.append((f"{shape.attention_kind} fp8", shape, "fp8_e4m3"))
    return rows


def compare_kv(shape: ModelShape, seq_len: int, batch_size: int = 1, kv_dtype: str = "bfloat16",
               state_checkpoints: int | None = None) -> list[KVSize]:
    """`kv_size` for every entry of `attention_variants`."""
    return [kv_size(s, seq_len, batch_size, dt, variant=label, state_checkpoints=state_checkpoints)
            for label, s, dt in attention_variants(shape, kv_dtype)]
