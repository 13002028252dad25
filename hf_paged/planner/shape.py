"""`ModelShape`: what sizing needs from a decoder config (heads, layer kinds, fixed state, parameters),
and the dtype vocabulary the sizing figures are counted in. Torch-free.

Units: GB = 10**9 bytes, GiB = 2**30 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import KV_CACHE_DTYPE_NAMES, KVCacheDtype, kv_cache_dtype
from ..kv_spec import FullAttention, KVShape, LatentAttention, LayerSpec, SharedKV, map_shapes
from .configs import family, load_config, text_config
from .layers import (STATE_KINDS, has_attention, has_mixer, has_mlp, kv_layer_specs, layer_kinds, mixer_state,
                     model_dtype)

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
                           "qwen3_5_moe_text", "lfm2", "lfm2_moe", "gemma3n_text", "gemma4_text"})
# Families with a norm before and after both attention and the MLP (four per layer, not two).
SANDWICH_NORM_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text", "gemma3n_text", "gemma4_text"})
# Families whose MLP has no gate (up and down projections only).
UNGATED_MLP_TYPES = frozenset({"nemotron_h"})
# Families with per-layer inputs (`hidden_size_per_layer_input`), counted with the embeddings.
PER_LAYER_INPUT_TYPES = frozenset({"gemma3n_text", "gemma4_text"})
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

    `layer_kinds[i]` is layer i's kind (`layers`); `kv_specs` has one `kv_spec` spec per layer that
    keeps or reads K/V (`layers.kv_layer_specs`, the cache's own definition): its kind, window or
    chunk, K/V shape (per layer: Gemma 4's full layers differ), or the layer whose K/V it reuses
    (`SharedKV`, Gemma 3n/4, costing nothing). A shape built without `layer_kinds` has full attention
    in every layer. `num_kv_heads` / `head_dim` are the config's (what most layers hold). MLA models
    set `kv_lora_rank`: their specs are `kv_spec.LatentAttention` (one row per token: the latent, the
    rope key and, in an indexed layer, the indexer's key; the same on every tensor-parallel rank), and
    `index_n_heads` where an indexer scores the cached keys (DeepSeek V3.2); their `head_dim` /
    `v_head_dim` are the uncompressed per-head K / V widths (qk_nope + qk_rope, v_head_dim), used only
    for the MHA-equivalent comparison. Layers with a fixed
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
    kv_specs: tuple[LayerSpec, ...] = ()
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    index_n_heads: int = 0  # heads of the indexer that scores every cached key (indexed sparse attention)
    num_params: int = 0  # stored parameters (weights in memory)
    num_dense_matmul_params: int = 0  # matmul weights every token uses (excludes the embedding lookup)
    num_moe_layers: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_params: int = 0  # one routed expert of one layer
    norm_params: int = 0  # the norms' weights: whole on every tensor-parallel rank
    whole_mixer_params: int = 0  # state mixers' weights no tensor-parallel plan splits (`MixerState.split_params`)
    whole_attention_params: int = 0  # MLA's down-projections and norms and the indexer: whole on every rank
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
    def kv_layer_specs(self) -> tuple[LayerSpec, ...]:
        """Per layer that keeps or reads K/V, its spec (see the class docstring)."""
        if self.layer_kinds or self.kv_specs:
            return self.kv_specs
        return (FullAttention(KVShape(self.num_kv_heads, self.head_dim, self.v_head_dim)),) * self.num_layers

    @property
    def num_kv_layers(self) -> int:
        """Layers that attend over K/V per token (those reusing another layer's included)."""
        return len(self.kv_layer_specs)

    @property
    def kv_head_counts(self) -> tuple[int, ...]:
        """The distinct KV head counts of the layers that store K/V (one for most models), latent
        layers aside: their one shared row is no head a tensor-parallel split divides."""
        return tuple(sorted({s.shape.num_kv_heads for s in self.kv_layer_specs
                             if s.owns_kv and not isinstance(s, LatentAttention)}))

    @property
    def latent_specs(self) -> tuple[LatentAttention, ...]:
        """The specs of the latent-attention layers (MLA; with an indexer's keys in indexed layers)."""
        return tuple(s for s in self.kv_layer_specs if isinstance(s, LatentAttention))

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
            attends = any(has_attention(k) for k in kinds)
            num_heads = int(c["num_attention_heads"]) if attends else int(c.get("num_attention_heads") or 0)
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
        # MLA: the latent specs (`kv_spec.LatentAttention`, with the indexer's keys in indexed layers)
        specs = kv_layer_specs({**c, "head_dim": head_dim or None, "num_key_value_heads": num_kv_heads}, kinds)

        # Parameters, layer by layer: attention where a layer keeps K/V, its mixer where it keeps a
        # state, its MLP (dense or experts) where it has one.
        latent = [_latent_attention_params(c, hidden, num_heads, head_dim, v_head_dim, s)
                  for s in specs if isinstance(s, LatentAttention)]
        attention = sum(_attention_params(c, mt, hidden, num_heads, spec) for spec in specs
                        if not isinstance(spec, LatentAttention)) + sum(p for p, _ in latent)
        states = [mixer_state(c, k) for k in kinds if k in STATE_KINDS]
        sized = [s for s in states if s is not None]
        gated = 2 if mt in UNGATED_MLP_TYPES else 3  # gate, up, down (SwiGLU), or up and down
        num_experts = int(c.get("n_routed_experts") or c.get("num_local_experts") or c.get("num_experts") or 0)
        top_k = int(c.get("num_experts_per_tok") or 0) if num_experts else 0
        expert_inter = int(c.get("moe_intermediate_size") or _mlp_width(c, None, 0) or 0)
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
        # q and k norms over each layer's own head size (no k norm where a layer reuses another's K/V)
        qk_norms = sum(_own(s).shape.head_dim * (1 + s.owns_kv) for s in specs) if mt in QK_NORM_TYPES else 0
        norms = residual_norms + qk_norms
        router = num_experts * hidden
        dense_mlp = sum(gated * hidden * _mlp_width(c, mt, hidden, i) for i in mlp_layers
                        if not (num_experts and _is_moe_layer(c, mt, i, kinds[i])))
        dense = attention + sum(s.params for s in sized) + norms + dense_mlp + num_moe * (shared + router)
        embed = vocab * hidden
        per_layer_input = int(c.get("hidden_size_per_layer_input") or 0) if mt in PER_LAYER_INPUT_TYPES else 0
        per_layer_embed = 0  # Gemma 3n/4: a second embedding table of per-layer inputs, projected into every layer
        if per_layer_input:
            per_layer_embed = int(c.get("vocab_size_per_layer_input") or vocab) * num_layers * per_layer_input
            dense += (hidden * num_layers * per_layer_input + per_layer_input
                      + num_layers * (2 * hidden * per_layer_input + hidden))
        tied = bool(c.get("tie_word_embeddings", False))
        num_params = dense + num_moe * num_experts * expert + embed + (0 if tied else embed) + hidden + per_layer_embed
        recurrent_dtypes = {s.recurrent_dtype for s in sized if s.recurrent}
        return cls(
            name=name, num_layers=num_layers, num_attention_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, v_head_dim=v_head_dim, hidden_size=hidden, vocab_size=vocab,
            max_position_embeddings=c.get("max_position_embeddings"), kv_specs=specs,
            kv_lora_rank=int(kv_lora_rank) if kv_lora_rank is not None else None, qk_rope_head_dim=rope,
            index_n_heads=int(c.get("index_n_heads") or 0) if any(s.index_dim for s in specs
                                                                   if isinstance(s, LatentAttention)) else 0,
            num_params=num_params, num_dense_matmul_params=dense + embed,  # + lm_head (tied or not)
            num_moe_layers=num_moe, num_experts=num_experts, num_experts_per_tok=top_k, expert_params=expert,
            norm_params=norms + hidden, whole_mixer_params=sum(s.params - s.split_params for s in sized),
            whole_attention_params=sum(w for _, w in latent),
            layer_kinds=kinds,
            recurrent_state_elements=sum(s.recurrent for s in sized), conv_state_elements=sum(s.conv for s in sized),
            recurrent_state_dtype=recurrent_dtypes.pop() if len(recurrent_dtypes) == 1 else None,
            model_dtype=model_dtype(c), num_unsized_state_layers=len(states) - len(sized),
            model_type=c.get("model_type"),
        )

    def per_rank(self, tensor_parallel_size: int) -> "ModelShape":
        """One rank's share under tensor parallelism over `tensor_parallel_size` ranks: its attention and KV
        heads (the rank's KV figures are the model's divided by the ranks) and its weights (every matmul but the routed experts and their router,
        and the embedding split, the norms whole). A fixed state stays whole on every rank (transformers'
        TP plans gather the linear-attention projections), which errs on the safe side.

        Latent attention (MLA) splits its query heads and up-projections (q_b_proj / q_proj and kv_b_proj
        colwise, o_proj rowwise) and keeps the rest whole on every rank: the down-projections (q_a_proj,
        kv_a_proj_with_mqa: "mla_kv_a_proj" replicates it), their norms and an indexer, which
        transformers' plans do not name. Every rank stores the whole latent row per token
        (`kv_spec.latent_shape`), so its KV bytes per token are the model's.

        Raises:
            ValueError: the ranks do not divide the attention heads or some layer's KV heads.
        """
        check_positive(tp=tensor_parallel_size)
        if tensor_parallel_size == 1:
            return self
        kv_heads = self.kv_head_counts or (() if self.is_mla else (self.num_kv_heads,))
        if any(h % tensor_parallel_size for h in kv_heads) or self.num_attention_heads % tensor_parallel_size:
            heads = f" and {' and '.join(map(str, kv_heads))} KV heads" if kv_heads else ""
            raise ValueError(f"tp {tensor_parallel_size} must divide the {self.num_attention_heads} attention "
                             f"heads{heads}")
        tp = tensor_parallel_size
        # transformers' TP plans split every other matmul (attention, MLP, shared experts, lm_head, the gated
        # delta rule's projections) and the embedding (rowwise over the vocabulary); the norms, the rest of a
        # state mixer and MLA's unsplit projections stay whole on every rank.
        # Routed experts and their router stay whole on every rank: transformers 5.25's plans give the
        # experts "grouped_gemm" (expert parallelism's layout), which tensor parallelism leaves unsplit
        # (measured on a rank's DTensors: tests/parallel), and name no router.
        router = self.num_moe_layers * self.num_experts * self.hidden_size
        experts = self.num_moe_layers * self.num_experts * self.expert_params
        whole = self.norm_params + self.whole_mixer_params + self.whole_attention_params + router + experts
        matmul_whole = self.whole_attention_params + router
        split = lambda s: KVShape(s.num_kv_heads // tp, s.head_dim, s.head_dim_v)  # noqa: E731
        return replace(self, name=f"{self.name} (one of {tensor_parallel_size} TP ranks)",
                       num_attention_heads=self.num_attention_heads // tensor_parallel_size,
                       num_kv_heads=self.num_kv_heads // tensor_parallel_size,
                       kv_specs=tuple(s if isinstance(s, LatentAttention) else map_shapes((s,), split)[0]
                                      for s in self.kv_specs),
                       num_params=whole + max(0, self.num_params - whole) // tensor_parallel_size,
                       num_dense_matmul_params=matmul_whole + (self.num_dense_matmul_params - matmul_whole) // tp)

    def with_kv_heads(self, num_kv_heads: int) -> "ModelShape":
        """The same model with standard attention and `num_kv_heads` KV heads in every layer (MHA/GQA/MQA
        what-ifs; each layer keeps its head size, an MLA model gets its uncompressed ones)."""
        check_positive(kv_heads=num_kv_heads)
        if self.is_mla:  # standard attention over the uncompressed heads, without the indexer
            shape = KVShape(num_kv_heads, self.head_dim, self.v_head_dim)
            specs = tuple(FullAttention(shape) if isinstance(s, LatentAttention) else replace(s, shape=shape)
                          for s in self.kv_specs)
        else:
            specs = map_shapes(self.kv_specs, lambda s: KVShape(num_kv_heads, s.head_dim, s.head_dim_v))
        return replace(self, num_kv_heads=num_kv_heads, kv_lora_rank=None, index_n_heads=0, kv_specs=specs,
                       whole_attention_params=0)


def weight_bytes(shape: ModelShape, weight_dtype: str = "bfloat16") -> int:
    """Bytes of all stored parameters."""
    return shape.num_params * dtype_bytes(weight_dtype)


def _own(spec: LayerSpec) -> LayerSpec:
    """A layer's own spec (a layer reusing another's K/V: as if it stored its own): its head size."""
    return spec.reads if isinstance(spec, SharedKV) else spec


def _latent_attention_params(c: dict, hidden: int, num_heads: int, head_dim: int, v_head_dim: int,
                             spec: LatentAttention) -> tuple[int, int]:
    """One MLA layer's parameters, and those of them a tensor-parallel rank keeps whole: the query
    (q_a_proj, its norm, q_b_proj; or q_proj), kv_a_proj_with_mqa (latent and rope key) and its norm,
    kv_b_proj (per head the nope key and the value), o_proj, and in an indexed layer the indexer (wq_b
    from the query's low rank, wk, its key's LayerNorm, weights_proj)."""
    rank, rope = spec.shape.head_dim, spec.shape.head_dim_v
    q_lora = int(c.get("q_lora_rank") or 0)
    q_down = hidden * q_lora + q_lora if q_lora else 0
    q_up = (q_lora or hidden) * num_heads * head_dim
    kv_down = hidden * (rank + rope) + rank
    kv_up = rank * num_heads * (head_dim - rope + v_head_dim)  # kv_b_proj: per head the nope key and the value
    params = q_down + q_up + kv_down + kv_up + num_heads * v_head_dim * hidden
    indexer = 0
    if spec.index_dim:
        heads, dim = int(c.get("index_n_heads") or 0), spec.index_dim
        indexer = (q_lora or hidden) * heads * dim + hidden * dim + 2 * dim + hidden * heads
    return params + indexer, q_down + kv_down + indexer


def _attention_params(c: dict, mt: str | None, hidden: int, num_heads: int, spec: LayerSpec) -> int:
    """One attention layer's projections, by its own K/V shape: q and o over its head size, k and v
    over its KV heads (v left out where Gemma 4's full layers reuse k, both where the layer reuses
    another layer's K/V), an output gate and biases where the family has them."""
    own = _own(spec)
    heads_kv, dim = own.shape.num_kv_heads, own.shape.head_dim
    num_kv_proj = 0 if not spec.owns_kv else 1 if c.get("attention_k_eq_v") and own.kind == "full_attention" else 2
    params = 2 * hidden * num_heads * dim + num_kv_proj * hidden * heads_kv * dim
    if c.get("attn_output_gate", mt in OUTPUT_GATE_TYPES):
        params += hidden * num_heads * dim
    if c.get("attention_bias") or mt == "qwen2":
        params += num_heads * dim + num_kv_proj * heads_kv * dim
    return params


def _mlp_width(c: dict, mt: str | None, hidden: int, layer: int = 0) -> int:
    """Layer `layer`'s dense MLP intermediate width (LFM2 adjusts its configured one; Granite 4's is its
    shared MLP; Llama 4's dense layers have their own; Gemma 3n names one per layer)."""
    if mt == "granitemoehybrid" and not (c.get("num_local_experts") or 0):
        return int(c.get("shared_intermediate_size") or 0)
    width = c.get("intermediate_size_mlp") if mt == "llama4_text" else None
    width = width or c.get("intermediate_size") or 4 * hidden
    width = int(width[layer] if isinstance(width, list) else width)
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
    if mt == "llama4_text":  # `moe_layers`, else every `interleave_moe_layer_step`-th layer
        step = int(c.get("interleave_moe_layer_step") or 1)
        return i in c["moe_layers"] if c.get("moe_layers") is not None else (i + 1) % step == 0
    if c.get("expert_layer_period"):  # Jamba
        return i % int(c["expert_layer_period"]) == int(c.get("expert_layer_offset") or 0)
    if c.get("mlp_only_layers") and i in c["mlp_only_layers"]:
        return False
    first_dense = int(c.get("first_k_dense_replace") or 0)
    freq = int(c.get("moe_layer_freq") or c.get("decoder_sparse_step") or 1)
    return i >= first_dense and i % freq == 0
