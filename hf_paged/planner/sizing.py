"""KV-cache calculus, decode roofline and memory planning. Torch-free: plain arithmetic on a config.

Units: GB = 10**9 bytes, GiB = 2**30 bytes; TFLOPS = 10**12 FLOP/s; TB/s = 10**12 bytes/s.

KV bytes per token (every layer, K and V):

    standard attention:  2 * num_layers * num_kv_heads * head_dim * bytes_per_element
                         (MHA: num_kv_heads = num_heads; GQA: fewer; MQA: 1)
    MLA (DeepSeek-V2/V3): num_layers * (kv_lora_rank + qk_rope_head_dim) * bytes_per_element
                         (one compressed latent plus the shared rope key per layer, not x2)

A sliding-window layer keeps at most `sliding_window` tokens, so for a sequence of `seq_len` tokens

    kv_bytes = batch * sum over layers of min(seq_len, window_of_layer) * layer_bytes_per_token

Decode roofline (one step: every sequence of the batch produces one token):

    FLOPs(B)  = B * (2 * active_params + attention_flops(S))
    bytes(B)  = weight_bytes_read(B) + B * kv_bytes(S)        weights are read once per step
    intensity = FLOPs / bytes;  ridge = peak_flops / bandwidth
    t_step   >= max(FLOPs / peak_flops, bytes / bandwidth)

With fp16 weights and a short context the intensity at B=1 is 2 FLOPs / 2 bytes = 1 FLOP/byte, far
below any GPU's ridge (hundreds): single-stream decode is bandwidth-bound.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..config import (DEFAULT_BLOCK_SIZE, KV_CACHE_DTYPE_NAMES, KVCacheDtype, blocks_held, kv_bytes_per_token_layer,
                      kv_cache_dtype, kv_layout, kv_scale_bytes_per_token_layer)

GB = 10**9
GiB = 2**30

# Dtype names are hf_paged's one KV dtype vocabulary (`config.KV_CACHE_DTYPES`, "auto" aside: the
# planner has no model dtype to resolve it to), for weights and KV alike. A quantised KV cache's
# bytes include its scales (`config.kv_bytes_per_token_layer`, the formula the cache itself uses).
DTYPE_NAMES = tuple(n for n in KV_CACHE_DTYPE_NAMES if n != "auto")
_OLD_SPELLINGS = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
                  "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}

REFERENCE_CONFIG_DIR = Path(__file__).parent / "reference_configs"
# Families whose attention normalises each query and key head (a `head_dim` weight each, per layer).
QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe", "gemma3", "gemma3_text"})
# Families with a norm before and after both attention and the MLP (four per layer, not two).
SANDWICH_NORM_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text"})
# Other spellings of the bundled names (compared lower-case, without an "org/" prefix).
_REFERENCE_ALIASES = {
    "meta-llama-3-70b": "llama-3-70b", "llama3-70b": "llama-3-70b",
    "meta-llama-3-8b": "llama-3-8b", "llama3-8b": "llama-3-8b",
    "gemma-3-4b-it": "gemma-3-4b", "mistral-7b-v0.1": "mistral-7b", "qwen2.5-7b-instruct": "qwen2.5-7b", "smollm2-135m-instruct": "smollm2-135m",
}


def dtype_spec(name: str) -> KVCacheDtype:
    """The vocabulary entry of a dtype name (float32, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2, int8).

    Raises:
        ValueError: not one of `DTYPE_NAMES`.
    """
    if name not in DTYPE_NAMES:
        hint = _OLD_SPELLINGS.get(str(name).lower())
        hint = f" (did you mean {hint!r}?)" if hint else ""
        raise ValueError(f"unknown dtype {name!r}{hint}; expected one of {', '.join(DTYPE_NAMES)}")
    return kv_cache_dtype(name)


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (see `dtype_spec`)."""
    return dtype_spec(name).itemsize


def _check_positive(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name.replace('_', '-')} must be positive, got {value!r}")


# ---------------------------------------------------------------------------------------------- configs
def reference_config_names() -> list[str]:
    """Names of the bundled reference configs (usable wherever a model is asked for)."""
    return sorted(p.stem for p in REFERENCE_CONFIG_DIR.glob("*.json"))


def load_config(name_or_path) -> dict:
    """A transformers config as a dict, from a `config.json` path, a model directory, or a bundled
    reference name (case-insensitive, e.g. "Llama-3-70B", "meta-llama/Meta-Llama-3-70B"). Nothing is
    fetched from a hub. A dict is returned unchanged.

    Raises:
        FileNotFoundError: no such file or directory, and no bundled config of that name.
        ValueError: the file is not a JSON object.
    """
    if isinstance(name_or_path, dict):
        return name_or_path
    path = Path(str(name_or_path)).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in directory {str(path.parent)!r}")
    elif not path.is_file():
        key = str(name_or_path).lower().rstrip("/").rsplit("/", 1)[-1].replace("_", "-")
        key = _REFERENCE_ALIASES.get(key, key)
        path = REFERENCE_CONFIG_DIR / f"{key}.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"no config file, model directory or bundled config named {str(name_or_path)!r} "
                f"(bundled: {', '.join(reference_config_names())})"
            )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r} does not hold a JSON object")
    return config


# ---------------------------------------------------------------------------------------------- shape
@dataclass(frozen=True)
class ModelShape:
    """What sizing needs from a decoder config.

    `layer_windows[i]` is the sliding window of layer i, or None for full attention. MLA models set
    `kv_lora_rank`; their `head_dim` / `v_head_dim` are the uncompressed per-head K / V widths
    (qk_nope + qk_rope, v_head_dim), used only for the MHA-equivalent comparison.
    """

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int | None
    layer_windows: tuple = ()
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    num_params: int = 0  # stored parameters (weights in memory)
    num_dense_matmul_params: int = 0  # matmul weights every token uses (excludes the embedding lookup)
    num_moe_layers: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_params: int = 0  # one routed expert of one layer
    norm_params: int = 0  # the norms' weights: whole on every tensor-parallel rank

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def num_active_params(self) -> int:
        """Matmul parameters one token touches: dense part plus its top-k experts per MoE layer."""
        return self.num_dense_matmul_params + self.num_moe_layers * self.num_experts_per_tok * self.expert_params

    @property
    def attention_kind(self) -> str:
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else f"GQA-{self.num_kv_heads}"

    @classmethod
    def from_config(cls, config, name: str | None = None) -> "ModelShape":
        """Build from a config dict, a `PretrainedConfig`, a `config.json` path, a model directory or
        a bundled reference name (see `load_config`)."""
        if hasattr(config, "get_text_config"):  # a transformers PretrainedConfig
            config = config.get_text_config(decoder=True).to_dict()
        elif not isinstance(config, dict):
            name = name or str(config)
            config = load_config(config)
        c = dict(config)
        if "num_hidden_layers" not in c and isinstance(c.get("text_config"), dict):
            c = {**c, **c["text_config"]}
        name = name or c.get("_name_or_path") or c.get("model_type") or "model"
        try:
            num_layers = int(c["num_hidden_layers"])
            hidden = int(c["hidden_size"])
            num_heads = int(c["num_attention_heads"])
        except KeyError as e:
            raise ValueError(f"config of {name!r} has no {e.args[0]!r}; is it a decoder-only LM config?") from None
        num_kv_heads = int(c.get("num_key_value_heads") or num_heads)
        vocab = int(c.get("vocab_size") or 0)
        kv_lora_rank = c.get("kv_lora_rank")
        rope = int(c.get("qk_rope_head_dim") or 0)
        if kv_lora_rank is not None:
            head_dim = int(c.get("qk_nope_head_dim") or 0) + rope
            v_head_dim = int(c.get("v_head_dim") or head_dim)
        else:
            head_dim = int(c.get("head_dim") or hidden // num_heads)
            v_head_dim = head_dim
        windows = _layer_windows(c, num_layers)

        # Parameters, layer by layer.
        if kv_lora_rank is not None:
            q_lora = c.get("q_lora_rank")
            q = hidden * q_lora + q_lora + q_lora * num_heads * head_dim if q_lora else hidden * num_heads * head_dim
            attn = (q + hidden * (kv_lora_rank + rope) + kv_lora_rank
                    + kv_lora_rank * num_heads * (head_dim - rope + v_head_dim) + num_heads * v_head_dim * hidden)
        else:
            attn = hidden * num_heads * head_dim + 2 * hidden * num_kv_heads * head_dim + num_heads * head_dim * hidden
            if c.get("attention_bias") or c.get("model_type") == "qwen2":
                attn += num_heads * head_dim + 2 * num_kv_heads * head_dim
        gated = 3  # gate, up, down (SwiGLU); all bundled models are gated
        dense_mlp = gated * hidden * int(c.get("intermediate_size") or 4 * hidden)
        num_experts = int(c.get("n_routed_experts") or c.get("num_local_experts") or c.get("num_experts") or 0)
        top_k = int(c.get("num_experts_per_tok") or 0) if num_experts else 0
        expert_inter = int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 0)
        expert = gated * hidden * expert_inter
        shared = gated * hidden * (int(c.get("n_shared_experts") or 0) * expert_inter
                                   + int(c.get("shared_expert_intermediate_size") or 0))
        first_dense = int(c.get("first_k_dense_replace") or 0)
        freq = int(c.get("moe_layer_freq") or 1)
        num_moe = sum(1 for i in range(num_layers) if i >= first_dense and i % freq == 0) if num_experts else 0
        # Per layer: the residual norms, and the per-head q/k norms of the families that have them.
        norms = ((4 if c.get("model_type") in SANDWICH_NORM_TYPES else 2) * hidden
                 + (2 * head_dim if c.get("model_type") in QK_NORM_TYPES else 0))
        layer_common = attn + norms
        router = num_experts * hidden
        dense = num_layers * layer_common + (num_layers - num_moe) * dense_mlp + num_moe * (shared + router)
        embed = vocab * hidden
        tied = bool(c.get("tie_word_embeddings", False))
        num_params = dense + num_moe * num_experts * expert + embed + (0 if tied else embed) + hidden
        return cls(
            name=name, num_layers=num_layers, num_attention_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, v_head_dim=v_head_dim, hidden_size=hidden, vocab_size=vocab,
            max_position_embeddings=c.get("max_position_embeddings"), layer_windows=windows,
            kv_lora_rank=int(kv_lora_rank) if kv_lora_rank is not None else None, qk_rope_head_dim=rope,
            num_params=num_params, num_dense_matmul_params=dense + embed,  # + lm_head (tied or not)
            num_moe_layers=num_moe, num_experts=num_experts, num_experts_per_tok=top_k, expert_params=expert,
            norm_params=num_layers * norms + hidden,
        )

    def per_rank(self, tensor_parallel_size: int) -> "ModelShape":
        """One rank's share under tensor parallelism over `tensor_parallel_size` ranks: its attention and KV
        heads (the rank's KV figures are the model's divided by the ranks) and its weights (every matmul
        and the embedding split, the norms whole).

        Raises:
            ValueError: the ranks do not divide the heads, or latent attention (one shared K/V head).
        """
        _check_positive(tp=tensor_parallel_size)
        if tensor_parallel_size == 1:
            return self
        if self.is_mla:
            raise ValueError(f"latent attention (one shared K/V head) cannot be split over {tensor_parallel_size} ranks")
        if self.num_kv_heads % tensor_parallel_size or self.num_attention_heads % tensor_parallel_size:
            raise ValueError(f"tp {tensor_parallel_size} must divide the {self.num_attention_heads} attention heads "
                             f"and {self.num_kv_heads} KV heads")
        # transformers' TP plans split every matmul (attention, MLP, experts, lm_head) and the embedding
        # (rowwise over the vocabulary); the norms stay whole on every rank.
        whole = self.norm_params
        return replace(self, name=f"{self.name} (one of {tensor_parallel_size} TP ranks)",
                       num_attention_heads=self.num_attention_heads // tensor_parallel_size,
                       num_kv_heads=self.num_kv_heads // tensor_parallel_size,
                       num_params=whole + max(0, self.num_params - whole) // tensor_parallel_size,
                       num_dense_matmul_params=self.num_dense_matmul_params // tensor_parallel_size,
                       expert_params=self.expert_params // tensor_parallel_size)

    def with_kv_heads(self, num_kv_heads: int) -> "ModelShape":
        """The same model with standard attention and `num_kv_heads` KV heads (MHA/GQA/MQA what-ifs)."""
        _check_positive(kv_heads=num_kv_heads)
        return replace(self, num_kv_heads=num_kv_heads, kv_lora_rank=None)


def _layer_windows(c: dict, num_layers: int) -> tuple:
    """Per layer: the sliding window (tokens) or None, following transformers' conventions."""
    window = c.get("sliding_window")
    layer_types = c.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if not window or c.get("use_sliding_window") is False:
        return (None,) * num_layers
    if "max_window_layers" in c and c.get("use_sliding_window"):  # Qwen2: layers from max_window_layers slide
        return tuple(window if i >= c["max_window_layers"] else None for i in range(num_layers))
    return (window,) * num_layers  # Mistral: every layer slides


# ---------------------------------------------------------------------------------------------- KV size
def kv_bytes_per_layer_token(shape: ModelShape, kv_dtype: str = "bfloat16") -> int:
    """Bytes one token takes in one layer: 2 * num_kv_heads * head_dim * bpe, or for MLA
    (kv_lora_rank + qk_rope_head_dim) * bpe."""
    spec = dtype_spec(kv_dtype)
    if shape.is_mla:  # one latent "head" and one rope "head", each with its own scale when quantised
        return kv_bytes_per_token_layer(1, shape.kv_lora_rank, shape.qk_rope_head_dim, spec)
    return kv_bytes_per_token_layer(shape.num_kv_heads, shape.head_dim, shape.v_head_dim, spec)


def kv_scale_bytes_per_token(shape: ModelShape, kv_dtype: str = "bfloat16") -> int:
    """Of `kv_bytes_per_token`, the bytes of a quantised cache's scales (0 unquantised)."""
    return shape.num_layers * kv_scale_bytes_per_token_layer(1 if shape.is_mla else shape.num_kv_heads,
                                                             dtype_spec(kv_dtype))

def kv_bytes_per_token(shape: ModelShape, kv_dtype: str = "bfloat16") -> int:
    """Bytes one token takes across all layers, before any sliding-window cap:
    2 * num_layers * num_kv_heads * head_dim * bytes_per_element (MLA: see the module docstring)."""
    return shape.num_layers * kv_bytes_per_layer_token(shape, kv_dtype)


def kv_bytes(shape: ModelShape, seq_len: int, batch_size: int = 1, kv_dtype: str = "bfloat16") -> int:
    """Bytes the KV cache of `batch_size` sequences of `seq_len` tokens holds; a sliding-window layer
    stores min(seq_len, window) tokens."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq-len must be a non-negative integer, got {seq_len!r}")
    _check_positive(batch=batch_size)
    per_layer = kv_bytes_per_layer_token(shape, kv_dtype)
    windows = shape.layer_windows or (None,) * shape.num_layers
    tokens = sum(seq_len if w is None else min(seq_len, w) for w in windows)
    return batch_size * tokens * per_layer


@dataclass(frozen=True)
class KVSize:
    """One row of `hf-paged kv-size`."""

    variant: str
    num_kv_heads: int
    kv_dtype: str
    seq_len: int
    batch_size: int
    bytes_per_token: int  # payload plus, for a quantised cache, its scales
    bytes_per_seq: int
    total_bytes: int
    scale_bytes_per_token: int = 0  # of bytes_per_token

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
            variant: str | None = None) -> KVSize:
    """Per-token, per-sequence and total KV bytes of `batch_size` sequences of `seq_len` tokens."""
    _check_positive(batch=batch_size)
    per_seq = kv_bytes(shape, seq_len, 1, kv_dtype)
    return KVSize(variant=variant or shape.attention_kind, num_kv_heads=1 if shape.is_mla else shape.num_kv_heads,
                  kv_dtype=dtype_spec(kv_dtype).name, seq_len=seq_len,
                  batch_size=batch_size, bytes_per_token=kv_bytes_per_token(shape, kv_dtype),
                  bytes_per_seq=per_seq, total_bytes=per_seq * batch_size,
                  scale_bytes_per_token=kv_scale_bytes_per_token(shape, kv_dtype))


def attention_variants(shape: ModelShape, kv_dtype: str = "bfloat16") -> list[tuple[str, ModelShape, str]]:
    """(label, shape, kv_dtype) for the side-by-side comparison: MHA, GQA, MQA, the model's MLA if it
    has one, and the model's own attention quantised to fp8 (int8 has the same size)."""
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


def compare_kv(shape: ModelShape, seq_len: int, batch_size: int = 1, kv_dtype: str = "bfloat16") -> list[KVSize]:
    """`kv_size` for every entry of `attention_variants`."""
    return [kv_size(s, seq_len, batch_size, dt, variant=label) for label, s, dt in attention_variants(shape, kv_dtype)]


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
    _check_positive(tflops=gpu.tflops, bandwidth=gpu.bandwidth_tbs)
    if gpu.memory_gb is not None:
        _check_positive(memory_gb=gpu.memory_gb)
    return gpu


def weight_bytes(shape: ModelShape, weight_dtype: str = "bfloat16") -> int:
    """Bytes of all stored parameters."""
    return shape.num_params * dtype_bytes(weight_dtype)


def weight_bytes_read(shape: ModelShape, batch_size: int, weight_dtype: str = "bfloat16") -> float:
    """Weight bytes one decode step reads: the dense matmul weights, plus for MoE the experts the
    batch touches (expected distinct experts under uniform routing: E * (1 - (1 - k/E)^B))."""
    params = shape.num_dense_matmul_params
    if shape.num_moe_layers:
        e, k = shape.num_experts, shape.num_experts_per_tok
        params += shape.num_moe_layers * shape.expert_params * e * (1 - (1 - k / e) ** batch_size)
    return params * dtype_bytes(weight_dtype)


def attention_flops_per_token(shape: ModelShape, seq_len: int) -> int:
    """FLOPs of QK^T and PV for one new token attending to `seq_len` cached tokens, all layers.
    MLA is counted in its absorbed decode form (scores over kv_lora_rank + rope, values over kv_lora_rank)."""
    windows = shape.layer_windows or (None,) * shape.num_layers
    tokens = sum(seq_len if w is None else min(seq_len, w) for w in windows)
    if shape.is_mla:
        width = 2 * shape.kv_lora_rank + shape.qk_rope_head_dim
    else:
        width = shape.head_dim + shape.v_head_dim
    return 2 * shape.num_attention_heads * width * tokens


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
    _check_positive(batch=batch_size)
    flops = batch_size * (2 * shape.num_active_params + attention_flops_per_token(shape, seq_len))
    nbytes = weight_bytes_read(shape, batch_size, weight_dtype) + kv_bytes(shape, seq_len, batch_size, kv_dtype)
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
    kv_seq = kv_bytes(shape, seq_len, 1, kv_dtype)
    one = point(1)
    return Roofline(gpu=gpu, model=shape.name, seq_len=seq_len, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                    ridge_point=ridge, points=points, compute_bound_batch=bound,
                    min_time_per_token_s=one.bytes / (gpu.bandwidth_tbs * 1e12),
                    asymptotic_intensity=flops_seq / kv_seq if kv_seq else None)


# ---------------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class Plan:
    """What fits in one GPU. Blocks follow `PagedCache`'s layout (`config.kv_layout`): a
    block holds `block_size` tokens of one layer per storage slot, bytes_per_block = block_size *
    kv_bytes_per_layer_token * num_slots (every layer for a model with full attention only); a
    sequence holds `blocks_held` blocks per KV group, the equation the cache frees by."""

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

    def to_dict(self) -> dict:
        return asdict(self)


def plan(shape: ModelShape, *, memory_bytes: int | None = None, utilization: float = 0.9, seq_len: int,
         block_size: int = DEFAULT_BLOCK_SIZE, max_seq_len: int | None = None, weight_dtype: str = "bfloat16",
         kv_dtype: str = "bfloat16", kv_budget_bytes: int | None = None, step_tokens: int = 1) -> Plan:
    """How many KV blocks and sequences fit.

        kv_budget   = floor(memory_bytes * utilization) - weight_bytes     (or `kv_budget_bytes`)
        num_blocks  = kv_budget // (block_size * kv_bytes_per_layer_token * num_slots)
        per seq     = sum over KV groups of blocks_held(seq_len - step_tokens, window, block_size,
                                                         new_tokens=step_tokens)
        paged       = num_blocks // per seq
        contiguous  = kv_budget // (max_seq_len * kv_bytes_per_token)      every sequence reserves max_seq_len

    `step_tokens`: tokens the step that brings a sequence to `seq_len` writes (1: decoding; a
    prefill chunk while prefilling). A sliding group holds its window plus that step's tokens.
    `max_seq_len` defaults to the config's max_position_embeddings (else `seq_len`).
    """
    _check_positive(block_size=block_size, seq_len=seq_len)
    for name, value in (("block_size", block_size), ("seq_len", seq_len)):
        if not isinstance(value, int):
            raise ValueError(f"{name.replace('_', '-')} must be an integer, got {value!r}")
    max_seq_len = max_seq_len or shape.max_position_embeddings or seq_len
    _check_positive(max_seq_len=max_seq_len)
    if seq_len > max_seq_len:
        raise ValueError(f"seq-len {seq_len} is longer than max-seq-len {max_seq_len}")
    weights = weight_bytes(shape, weight_dtype)
    if kv_budget_bytes is None:
        if memory_bytes is None:
            raise ValueError("plan needs a GPU memory size (--gpu or --memory-gb) or a KV budget (--kv-budget)")
        _check_positive(memory=memory_bytes)
        if not 0 < utilization <= 1:
            raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
        usable = int(memory_bytes * utilization)
        kv_budget_bytes = usable - weights
        if kv_budget_bytes <= 0:
            raise ValueError(f"the weights ({weights / GB:.1f} GB in {weight_dtype}) do not fit in "
                             f"{usable / GB:.1f} GB ({utilization:.0%} of {memory_bytes / GB:.1f} GB)")
    else:
        _check_positive(kv_budget=kv_budget_bytes)
        memory_bytes = memory_bytes or 0
    if isinstance(step_tokens, bool) or not isinstance(step_tokens, int) or not 1 <= step_tokens <= seq_len:
        raise ValueError(f"step-tokens must be an integer in [1, seq-len], got {step_tokens!r}")
    per_token = kv_bytes_per_token(shape, kv_dtype)
    layout = kv_layout(shape.layer_windows or (None,) * shape.num_layers)
    per_block = block_size * kv_bytes_per_layer_token(shape, kv_dtype) * layout.num_slots
    num_blocks = kv_budget_bytes // per_block
    blocks_per_seq = sum(blocks_held(seq_len - step_tokens, w, block_size, new_tokens=step_tokens)
                         for w in layout.windows)
    kept_tokens = sum(seq_len if w is None else min(seq_len, w - 1 + step_tokens) for w in layout.windows)
    contiguous = kv_budget_bytes // (max_seq_len * per_token)
    paged = num_blocks // blocks_per_seq
    without_hybrid = (kv_budget_bytes // (block_size * per_token)) // -(-seq_len // block_size)
    return Plan(
        model=shape.name, memory_bytes=memory_bytes, utilization=utilization, weight_bytes=weights,
        kv_budget_bytes=kv_budget_bytes, block_size=block_size, bytes_per_block=per_block, num_blocks=num_blocks,
        seq_len=seq_len, max_seq_len=max_seq_len, blocks_per_seq=blocks_per_seq, num_seqs_paged=paged,
        num_seqs_contiguous=contiguous,
        contiguous_waste_bytes=contiguous * (max_seq_len - seq_len) * per_token,
        contiguous_waste_fraction=1 - seq_len / max_seq_len,
        paged_waste_bytes=paged * (blocks_per_seq * block_size - kept_tokens) * per_block // block_size,
        num_kv_groups=len(layout.groups), step_tokens=step_tokens, num_seqs_without_hybrid=without_hybrid,
    )
