"""KV-cache calculus, decode roofline and memory planning. Torch-free: plain arithmetic on a config.

Units: GB = 10**9 bytes, GiB = 2**30 bytes; TFLOPS = 10**12 FLOP/s; TB/s = 10**12 bytes/s.

KV bytes per token (every layer that keeps K/V, K and V):

    standard attention:  2 * num_kv_layers * num_kv_heads * head_dim * bytes_per_element
                         (MHA: num_kv_heads = num_heads; GQA: fewer; MQA: 1)
    MLA (DeepSeek-V2/V3): num_kv_layers * (kv_lora_rank + qk_rope_head_dim) * bytes_per_element
                         (one compressed latent plus the shared rope key per layer, not x2)
    indexed sparse attention (DeepSeek V3.2): num_kv_layers * (kv_lora_rank + qk_rope_head_dim
                         + index_head_dim) * bytes_per_element (the indexer's key beside the latent)
    (`kv_spec.LatentAttention.row_width`; every tensor-parallel rank keeps the whole row)

Each layer's spec (`kv_spec`, the cache's own definition) says what it keeps: a sliding-window layer
at most `sliding_window` tokens, a chunked-attention layer (Llama 4) at most its chunk, a layer that
reuses another layer's K/V (Gemma 3n/4) none, each by its own K/V shape (Gemma 4's full layers differ);
a linear-attention, Mamba or short-convolution layer keeps no K/V but a fixed state per sequence
(`layers`), so for a sequence of `seq_len` tokens

    kv_bytes = batch * (sum over K/V layers of min(seq_len, tokens_kept_by_layer) * layer_bytes_per_token
                        + state_bytes_per_seq)

with the state's shapes and dtypes by `state_spec` (the cache's definition). Prefix caching keeps
checkpoints of that state at block boundaries, each one sequence's state: `kv-size`'s total and `plan`'s
fit add num_state_checkpoints * state_bytes_per_seq (`kv.num_state_checkpoints`: by default the
engine's default, one per running sequence).

Decode roofline (one step: every sequence of the batch produces one token):

    FLOPs(B)  = B * (2 * active_params + attention_flops(S))
    bytes(B)  = weight_bytes_read(B) + B * kv_bytes_read(S)   weights are read once per step

kv_bytes_read is kv_bytes but for indexed sparse attention: per layer its indexer reads every cached
token's indexer key (S * index_head_dim) and attention reads k = min(index_topk, S) latent rows
((kv_lora_rank + qk_rope_head_dim) each). MLA is counted in its absorbed decode form: per layer and
query head 2 * (2 * kv_lora_rank + qk_rope_head_dim) FLOPs per key attended (scores over the latent
and rope key, values over the latent), over k keys, plus the indexer's 2 * index_n_heads *
index_head_dim per cached token.
    intensity = FLOPs / bytes;  ridge = peak_flops / bandwidth
    t_step   >= max(FLOPs / peak_flops, bytes / bandwidth)

With fp16 weights and a short context the intensity at B=1 is 2 FLOPs / 2 bytes = 1 FLOP/byte, far
below any GPU's ridge (hundreds): single-stream decode is bandwidth-bound.

The roofline is here; the rest is re-exported from the modules that hold it (`configs`: reading a
config.json; `layers`: layer kinds and fixed states; `shape`: `ModelShape` and the dtype vocabulary;
`kv`: KV bytes; `plan`: blocks and sequences per GPU), so `sizing` is the planner's one public face.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .configs import REFERENCE_CONFIG_DIR, load_config, reference_config_names
from ..kv_spec import LatentAttention
from .kv import (KVSize, attention_variants, compare_kv, kv_bytes, kv_bytes_per_layer_token, kv_bytes_per_token,
                 kv_bytes_read, kv_scale_bytes_per_token, kv_size, num_state_checkpoints, tokens_held)
from .plan import Plan, TPOption, WeightsDoNotFit, plan, smallest_fit, tp_options, tp_sizes
from .shape import DTYPE_NAMES, GB, GiB, ModelShape, check_positive, dtype_bytes, dtype_spec, weight_bytes

__all__ = ["DTYPE_NAMES", "GB", "GiB", "GPU", "GPU_PRESETS", "REFERENCE_CONFIG_DIR", "KVSize", "ModelShape", "Plan",
           "Roofline", "TPOption", "attention_variants", "compare_kv", "decode_point", "dtype_bytes", "dtype_spec",
           "get_gpu", "kv_bytes", "kv_bytes_per_layer_token", "kv_bytes_per_token", "kv_bytes_read",
           "kv_scale_bytes_per_token", "kv_size", "load_config", "num_state_checkpoints", "plan",
           "reference_config_names", "roofline", "smallest_fit", "tp_options", "tp_sizes", "weight_bytes",
           "WeightsDoNotFit"]


# ---------------------------------------------------------------------------------------------- roofline
@dataclass(frozen=True)
class GPU:
    """Peak dense bf16 throughput (TFLOPS, no sparsity), memory bandwidth (TB/s) and memory (GB)."""

    name: str
    tflops: float
    bandwidth_tbs: float
    memory_gb: float | None = None

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte at which the compute roof meets the bandwidth roof."""
        return self.tflops / self.bandwidth_tbs


GPU_PRESETS = {
    "h100-sxm": GPU("H100 SXM", 989.0, 3.35, 80.0),
    "h200": GPU("H200", 989.0, 4.8, 141.0),
    "a100": GPU("A100 80GB SXM", 312.0, 2.039, 80.0),
    "l4": GPU("L4", 121.0, 0.3, 24.0),
}


def get_gpu(name: str | None = None, tflops: float | None = None, bandwidth_tbs: float | None = None,
            memory_gb: float | None = None) -> GPU:
    """A preset (case-insensitive; "h100" means H100 SXM), with any of its numbers overridden. Without
    a preset, both `tflops` and `bandwidth_tbs` are required."""
    if name:
        key = name.lower().replace("_", "-").replace(" ", "-")
        key = {"h100": "h100-sxm", "a100-80gb": "a100"}.get(key, key)
        if key not in GPU_PRESETS:
            raise ValueError(
                f"unknown GPU {name!r}; presets: {', '.join(GPU_PRESETS)} (or pass --tflops and --bandwidth)"
            )
        gpu = GPU_PRESETS[key]
    else:
        if tflops is None or bandwidth_tbs is None:
            raise ValueError("a custom GPU needs both --tflops and --bandwidth (TB/s), or pick a preset with --gpu")
        gpu = GPU("custom", tflops, bandwidth_tbs, memory_gb)
    gpu = replace(gpu, tflops=tflops if tflops is not None else gpu.tflops,
                  bandwidth_tbs=bandwidth_tbs if bandwidth_tbs is not None else gpu.bandwidth_tbs,
                  memory_gb=memory_gb if memory_gb is not None else gpu.memory_gb)
    check_positive(tflops=gpu.tflops, bandwidth=gpu.bandwidth_tbs)
    if gpu.memory_gb is not None:
        check_positive(memory_gb=gpu.memory_gb)
    return gpu


def weight_bytes_read(shape: ModelShape, batch_size: int, weight_dtype: str = "bfloat16") -> float:
    """Weight bytes one decode step reads: the dense matmul weights, plus for MoE the experts the
    batch touches (expected distinct experts under uniform routing: E * (1 - (1 - k/E)^B))."""
    params = shape.num_dense_matmul_params
    if shape.num_moe_layers:
        e, k = shape.num_experts, shape.num_experts_per_tok
        params += shape.num_moe_layers * shape.expert_params * e * (1 - (1 - k / e) ** batch_size)
    return params * dtype_bytes(weight_dtype)


def attention_flops_per_token(shape: ModelShape, seq_len: int) -> int:
    """FLOPs of QK^T and PV for one new token attending to `seq_len` cached tokens, all layers (a
    window or chunk caps a layer's tokens; a layer reusing another's K/V attends all the same), each
    by its own head size. MLA is counted in its absorbed decode form (scores over kv_lora_rank + rope,
    values over kv_lora_rank); an indexed layer attends min(index_topk, tokens) of them, after its
    indexer scores every one (index_n_heads dot products of index_head_dim)."""
    flops = 0
    for spec in shape.kv_layer_specs:
        own = spec.reads if not spec.owns_kv else spec
        held = tokens_held(own, seq_len)
        if isinstance(own, LatentAttention):
            width = 2 * own.shape.head_dim + own.shape.head_dim_v
            if own.index_topk:
                flops += 2 * shape.index_n_heads * own.index_dim * held
                held = min(held, own.index_topk)
        else:
            width = own.shape.head_dim + own.shape.head_dim_v
        flops += 2 * shape.num_attention_heads * width * held
    return flops


@dataclass(frozen=True)
class DecodePoint:
    batch_size: int
    flops: float
    bytes: float
    intensity: float  # FLOPs per byte
    is_compute_bound: bool
    step_time_s: float  # lower bound: max(compute time, memory time)
    tokens_per_s: float  # upper bound, whole batch


def decode_point(shape: ModelShape, gpu: GPU, batch_size: int, seq_len: int, weight_dtype: str = "bfloat16",
                 kv_dtype: str = "bfloat16") -> DecodePoint:
    """Roofline numbers of one decode step of `batch_size` sequences with `seq_len` cached tokens each."""
    check_positive(batch=batch_size)
    flops = batch_size * (2 * shape.num_active_params + attention_flops_per_token(shape, seq_len))
    nbytes = weight_bytes_read(shape, batch_size, weight_dtype) + kv_bytes_read(shape, seq_len, batch_size, kv_dtype)
    intensity = flops / nbytes
    step = max(flops / (gpu.tflops * 1e12), nbytes / (gpu.bandwidth_tbs * 1e12))
    return DecodePoint(batch_size, flops, nbytes, intensity, intensity >= gpu.ridge_point, step, batch_size / step)


@dataclass(frozen=True)
class Roofline:
    gpu: GPU
    model: str
    seq_len: int
    weight_dtype: str
    kv_dtype: str
    ridge_point: float  # FLOPs/byte
    points: list = field(default_factory=list)  # DecodePoint per requested batch size
    compute_bound_batch: int | None = None  # smallest batch whose decode is compute-bound; None: never
    min_time_per_token_s: float = 0.0  # batch 1, bandwidth bound: bytes / bandwidth
    asymptotic_intensity: float | None = None  # intensity as batch -> infinity (KV reads dominate); None: no KV

    def to_dict(self) -> dict:
        return asdict(self)


DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def roofline(shape: ModelShape, gpu: GPU, *, seq_len: int = 1024, batch_sizes=DEFAULT_BATCH_SIZES,
             weight_dtype: str = "bfloat16", kv_dtype: str = "bfloat16", max_batch: int = 1 << 24) -> Roofline:
    """Decode roofline of `shape` on `gpu` at context `seq_len`.

    The compute-bound batch is the smallest B with intensity(B) >= ridge. For a dense model
    intensity(B) = B*F / (W + B*K) (F FLOPs and K KV bytes per sequence, W weight bytes) rises towards
    F/K; if F/K is below the ridge (long contexts, GQA at fp16), decode never turns compute-bound.
    """
    point = lambda b: decode_point(shape, gpu, b, seq_len, weight_dtype, kv_dtype)  # noqa: E731
    points = [point(b) for b in batch_sizes]
    ridge = gpu.ridge_point
    bound = None
    if point(max_batch).intensity >= ridge:  # intensity is non-decreasing in B: bisect
        lo, hi = 1, max_batch
        if point(1).intensity >= ridge:
            hi = 1
        while lo < hi:
            mid = (lo + hi) // 2
            if point(mid).intensity >= ridge:
                hi = mid
            else:
                lo = mid + 1
        bound = hi
    flops_seq = 2 * shape.num_active_params + attention_flops_per_token(shape, seq_len)
    kv_seq = kv_bytes_read(shape, seq_len, 1, kv_dtype)
    one = point(1)
    return Roofline(gpu=gpu, model=shape.name, seq_len=seq_len, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                    ridge_point=ridge, points=points, compute_bound_batch=bound,
                    min_time_per_token_s=one.bytes / (gpu.bandwidth_tbs * 1e12),
                    asymptotic_intensity=flops_seq / kv_seq if kv_seq else None)


