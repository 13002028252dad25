"""`ModelShape`: what sizing needs from a decoder config (heads, layer kinds, fixed state, parameters),
and the dtype vocabulary the sizing figures are counted in. Torch-free.

Units: GB = 10**9 bytes, GiB = 2**30 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import KV_CACHE_DTYPE_NAMES, KVCacheDtype, kv_cache_dtype
from .configs import family, load_config, text_config
from .layers import STATE_KINDS, has_mixer, has_mlp, layer_kinds, kv_windows, mixer_state, model_dtype

GB = 10**9
GiB = 2**30

# Dtype names are hf_paged's one KV dtype vocabulary (`config.KV_CACHE_DTYPES`, "auto" aside: the
# planner has no model dtype to resolve it to), for weights and KV alike. A quantised KV cache's
# bytes include its scales (`config.kv_bytes_per_token_layer`, the formula the cache itself uses).
DTYPE_NAMES = tuple(n for n in KV_CACHE_DTYPE_NAMES if n != "auto")
_OLD_SPELLINGS = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
                  "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}

# Families whose attention normalises each query and key head (a `head_dim` weight each, per layer).
QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe", "gemma3", "gemma3_text", "qwen3_next", "qwen3_5_text",
                           "qwen3_5_moe_text", "lfm2", "lfm2_moe"})
# Families with a norm before and after both attention and the MLP (four per layer, not two).
SANDWICH_NORM_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text"})
# Families whose MLP has no gate (up and down projections only).
UNGATED_MLP_TYPES = frozenset({"nemotron_h"})
# Families whose attention gates its output by a second query-sized projection (q_proj twice as wide).
OUTPUT_GATE_TYPES = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"})


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


def check_positive(**values) -> None:
    """Raise ValueError naming the first value that is not a positive number."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name.replace('_', '-')} must be positive, got {value!r}")


@dataclass(frozen=True)
class ModelShape:
    """What sizing needs from a decoder config.

    `layer_kinds[i]` is layer i's kind (`layers`); `layer_windows` has one entry per layer that keeps
    K/V: its sliding window (or attention chunk), or None for every token. A shape built without
    `layer_kinds` has attention in every layer (`layer_windows` empty: full attention). MLA models set
    `kv_lora_rank`; their `head_dim` / `v_head_dim` are the uncompressed per-head K / V widths
    (qk_nope + qk_rope, v_head_dim), used only for the MHA-equivalent comparison. Layers with a fixed
    state (linear attention, Mamba, short convolutions) add `recurrent_state_elements` and
    `conv_state_elements` per sequence, whatever its length; `num_unsized_state_layers` of them are of
    a mixer the planner cannot size.
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
    layer_kinds: tuple = ()
    recurrent_state_elements: int = 0  # every state layer's, one sequence
    conv_state_elements: int = 0
    recurrent_state_dtype: str | None = None  # None: `model_dtype`
    model_dtype: str = "bfloat16"  # the checkpoint's: the conv state's dtype
    num_unsized_state_layers: int = 0
    model_type: str | None = None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def kv_layer_windows(self) -> tuple:
        """Per layer that keeps K/V, its window (None: every token)."""
        return self.layer_windows if self.layer_kinds else (self.layer_windows or (None,) * self.num_layers)

    @property
    def num_kv_layers(self) -> int:
        return len(self.kv_layer_windows)

    @property
    def state_bytes_per_seq(self) -> int:
        """Bytes of the fixed state one sequence holds (0 for attention-only models)."""
        recurrent = dtype_bytes(self.recurrent_state_dtype or self.model_dtype)
        return self.recurrent_state_elements * recurrent + self.conv_state_elements * dtype_bytes(self.model_dtype)

    @property
    def layer_kind_counts(self) -> dict[str, int]:
        """Layers per kind, in order of each kind's first layer."""
        counts: dict[str, int] = {}
        for kind in self.layer_kinds or ("full_attention",) * self.num_layers:
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    @property
    def num_active_params(self) -> int:
        """Matmul parameters one token touches: dense part plus its top-k experts per MoE layer."""
        return self.num_dense_matmul_params + self.num_moe_layers * self.num_experts_per_tok * self.expert_params

    @property
    def attention_kind(self) -> str:
        if not self.num_kv_layers:
            return "no attention"
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else f"GQA-{self.num_kv_heads}"

    @classmethod
    def from_config(cls, config, name: str | None = None) -> "ModelShape":
        """Build from a config dict, a `PretrainedConfig`, a `config.json` path, a model directory or
        a bundled reference name (see `configs.load_config`).

        Raises:
            ValueError: the config lacks what a decoder's shape needs.
        """
        if hasattr(config, "get_text_config"):  # a transformers PretrainedConfig
            config = config.get_text_config(decoder=True).to_dict()
        elif not isinstance(config, dict):
            name = name or str(config)
            config = load_config(config)
        c = text_config(config)
        name = name or c.get("_name_or_path") or c.get("model_type") or "model"
        try:
            kinds = layer_kinds(c)
            hidden = int(c["hidden_size"])
            windows = kv_windows(c, kinds)
            num_heads = int(c["num_attention_heads"]) if windows else int(c.get("num_attention_heads") or 0)
        except KeyError as e:
            raise ValueError(f"config of {name!r} has no {e.args[0]!r}; is it a decoder-only LM config?") from None
        mt = family(c.get("model_type"))
        num_layers = len(kinds)
        num_kv_heads = int(c.get("num_key_value_heads") or num_heads)
        vocab = int(c.get("vocab_size") or 0)
        kv_lora_rank = c.get("kv_lora_rank")
        rope = int(c.get("qk_rope_head_dim") or 0)
        if kv_lora_rank is not None:
            head_dim = int(c.get("qk_nope_head_dim") or 0) + rope
            v_head_dim = int(c.get("v_head_dim") or head_dim)
        else:
            head_dim = int(c.get("head_dim") or c.get("attention_head_dim") or 0)
            head_dim = head_dim or (hidden // num_heads if num_heads else 0)
            v_head_dim = head_dim

        # Parameters, layer by layer: attention where a layer keeps K/V, its mixer where it keeps a
        # state, its MLP (dense or experts) where it has one.
        if kv_lora_rank is not None:
            q_lora = c.get("q_lora_rank")
            q = hidden * q_lora + q_lora + q_lora * num_heads * head_dim if q_lora else hidden * num_heads * head_dim
            attn = (q + hidden * (kv_lora_rank + rope) + kv_lora_rank
                    + kv_lora_rank * num_heads * (head_dim - rope + v_head_dim) + num_heads * v_head_dim * hidden)
        else:
            attn = hidden * num_heads * head_dim + 2 * hidden * num_kv_heads * head_dim + num_heads * head_dim * hidden
            if c.get("attn_output_gate", mt in OUTPUT_GATE_TYPES):
                attn += hidden * num_heads * head_dim
            if c.get("attention_bias") or mt == "qwen2":
                attn += num_heads * head_dim + 2 * num_kv_heads * head_dim
        num_attention_layers = len(windows)
        states = [mixer_state(c, k) for k in kinds if k in STATE_KINDS]
        sized = [s for s in states if s is not None]
        gated = 2 if mt in UNGATED_MLP_TYPES else 3  # gate, up, down (SwiGLU), or up and down
        dense_mlp = gated * hidden * _mlp_width(c, mt, hidden)
        num_experts = int(c.get("n_routed_experts") or c.get("num_local_experts") or c.get("num_experts") or 0)
        top_k = int(c.get("num_experts_per_tok") or 0) if num_experts else 0
        expert_inter = int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 0)
        expert = gated * hidden * expert_inter
        shared_inter = int(c.get("shared_expert_intermediate_size") or 0)
        shared = (gated * hidden * (int(c.get("n_shared_experts") or 0) * expert_inter + shared_inter
                                    + int(c.get("shared_intermediate_size") or 0))
                  + (hidden if shared_inter else 0))  # Qwen's shared expert has a one-logit gate
        mlp_layers = [i for i, kind in enumerate(kinds) if has_mlp(c, kind)]
        num_moe = sum(1 for i in mlp_layers if _is_moe_layer(c, mt, i, kinds[i])) if num_experts else 0
        # Per layer: a residual norm before its mixer and one before its MLP (two each in sandwich-norm
        # families); the per-head q/k norms of the families that have them.
        per_norm = (2 if mt in SANDWICH_NORM_TYPES else 1) * hidden
        residual_norms = sum(has_mixer(k) + has_mlp(c, k) for k in kinds) * per_norm
        qk_norms = 2 * head_dim if mt in QK_NORM_TYPES else 0
        norms = residual_norms + num_attention_layers * qk_norms
        router = num_experts * hidden
        dense = (num_attention_layers * attn + sum(s.params for s in sized) + norms
                 + (len(mlp_layers) - num_moe) * dense_mlp + num_moe * (shared + router))
        embed = vocab * hidden
        tied = bool(c.get("tie_word_embeddings", False))
        num_params = dense + num_moe * num_experts * expert + embed + (0 if tied else embed) + hidden
        recurrent_dtypes = {s.recurrent_dtype for s in sized if s.recurrent}
        return cls(
            name=name, num_layers=num_layers, num_attention_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, v_head_dim=v_head_dim, hidden_size=hidden, vocab_size=vocab,
            max_position_embeddings=c.get("max_position_embeddings"), layer_windows=windows,
            kv_lora_rank=int(kv_lora_rank) if kv_lora_rank is not None else None, qk_rope_head_dim=rope,
            num_params=num_params, num_dense_matmul_params=dense + embed,  # + lm_head (tied or not)
            num_moe_layers=num_moe, num_experts=num_experts, num_experts_per_tok=top_k, expert_params=expert,
            norm_params=norms + hidden, layer_kinds=kinds,
            recurrent_state_elements=sum(s.recurrent for s in sized), conv_state_elements=sum(s.conv for s in sized),
            recurrent_state_dtype=recurrent_dtypes.pop() if len(recurrent_dtypes) == 1 else None,
            model_dtype=model_dtype(c), num_unsized_state_layers=len(states) - len(sized),
            model_type=c.get("model_type"),
        )

    def per_rank(self, tensor_parallel_size: int) -> "ModelShape":
        """One rank's share under tensor parallelism over `tensor_parallel_size` ranks: its attention and KV
        heads (the rank's KV figures are the model's divided by the ranks) and its weights (every matmul
        and the embedding split, the norms whole). A fixed state stays whole on every rank (transformers'
        TP plans gather the linear-attention projections), which errs on the safe side.

        Raises:
            ValueError: the ranks do not divide the heads, or latent attention (one shared K/V head).
        """
        check_positive(tp=tensor_parallel_size)
        if tensor_parallel_size == 1:
            return self
        if self.is_mla:
            raise ValueError(f"latent attention (one shared K/V head) cannot be split over {tensor_parallel_size} "
                             "ranks")
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
        check_positive(kv_heads=num_kv_heads)
        return replace(self, num_kv_heads=num_kv_heads, kv_lora_rank=None)


def weight_bytes(shape: ModelShape, weight_dtype: str = "bfloat16") -> int:
    """Bytes of all stored parameters."""
    return shape.num_params * dtype_bytes(weight_dtype)


def _mlp_width(c: dict, mt: str | None, hidden: int) -> int:
    """A dense MLP's intermediate width (LFM2 adjusts its configured one; Granite 4's is its shared MLP)."""
    if mt == "granitemoehybrid" and not (c.get("num_local_experts") or 0):
        return int(c.get("shared_intermediate_size") or 0)
    width = int(c.get("intermediate_size") or 4 * hidden)
    if mt in ("lfm2",) and c.get("block_auto_adjust_ff_dim"):
        width = int(2 * width / 3)
        if c.get("block_ffn_dim_multiplier") is not None:
            multiple = int(c.get("block_multiple_of") or 1)
            width = int(c["block_ffn_dim_multiplier"] * width)
            width = multiple * -(-width // multiple)
    return width


def _is_moe_layer(c: dict, mt: str | None, i: int, kind: str) -> bool:
    """Whether layer i's MLP is a mixture of experts (a layer that has an MLP at all)."""
    if mt == "nemotron_h":
        return kind == "moe"
    if c.get("expert_layer_period"):  # Jamba
        return i % int(c["expert_layer_period"]) == int(c.get("expert_layer_offset") or 0)
    if c.get("mlp_only_layers") and i in c["mlp_only_layers"]:
        return False
    first_dense = int(c.get("first_k_dense_replace") or 0)
    freq = int(c.get("moe_layer_freq") or c.get("decoder_sparse_step") or 1)
    return i >= first_dense and i % freq == 0
