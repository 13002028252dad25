"""Model configs as plain dicts: a `config.json`, a model directory or a bundled reference config, read
without transformers, with the defaults transformers' config classes would fill in where the planner
needs them.

`text_config` is the one entry point the planner reads a config through: a multimodal config's text
model (`text_config`, nested as transformers nests it), merged over its outer keys, with the
family's defaults (`FAMILY_DEFAULTS`) under any key the file leaves out.
"""

from __future__ import annotations

import json
from pathlib import Path

REFERENCE_CONFIG_DIR = Path(__file__).parent / "reference_configs"
# Other spellings of the bundled names (compared lower-case, without an "org/" prefix).
_REFERENCE_ALIASES = {
    "meta-llama-3-70b": "llama-3-70b", "llama3-70b": "llama-3-70b",
    "meta-llama-3-8b": "llama-3-8b", "llama3-8b": "llama-3-8b",
    "gemma-3-4b-it": "gemma-3-4b", "mistral-7b-v0.1": "mistral-7b", "qwen2.5-7b-instruct": "qwen2.5-7b",
    "smollm2-135m-instruct": "smollm2-135m", "qwen3.5-27b-instruct": "qwen3.5-27b",
    "deepseek-v3.2-exp": "deepseek-v3.2",
}
# Where a multimodal config nests its language model.
_TEXT_CONFIG_KEYS = ("text_config", "llm_config", "language_config")

# What transformers' config classes (5.x) fill in when a config.json leaves a key out, for the keys the
# planner reads (layer kinds, state sizes, heads): the dataclass defaults of each family's config class.
_GATED_DELTA_NET = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
                    "head_dim": 256, "tie_word_embeddings": False}
_MAMBA2_STYLE = {"mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_n_heads": 128,
                 "mamba_d_head": "auto", "mamba_n_groups": 1, "tie_word_embeddings": False}
FAMILY_DEFAULTS: dict[str, dict] = {
    "qwen3_next": {**_GATED_DELTA_NET, "num_key_value_heads": 2},
    "qwen3_5_text": {**_GATED_DELTA_NET, "num_key_value_heads": 4},
    "qwen3_5_moe_text": {**_GATED_DELTA_NET, "num_key_value_heads": 2},
    "mamba": {"state_size": 16, "expand": 2, "conv_kernel": 4, "time_step_rank": "auto", "tie_word_embeddings": True},
    "falcon_mamba": {"state_size": 16, "expand": 2, "conv_kernel": 4, "time_step_rank": "auto",
                     "tie_word_embeddings": True},
    "mamba2": {"num_heads": 128, "head_dim": 64, "state_size": 128, "n_groups": 8, "expand": 2, "conv_kernel": 4,
               "time_step_rank": "auto", "tie_word_embeddings": False},
    "jamba": {"num_key_value_heads": 8, "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16,
              "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": "auto", "tie_word_embeddings": False},
    "bamba": {**_MAMBA2_STYLE, "num_key_value_heads": 8},
    "granitemoehybrid": {**_MAMBA2_STYLE, "shared_intermediate_size": 1024},
    "falcon_h1": {**_MAMBA2_STYLE, "num_key_value_heads": 8, "mamba_d_ssm": 1024},
    "nemotron_h": {"num_key_value_heads": 8, "head_dim": 128, "mamba_num_heads": 128, "mamba_head_dim": 64,
                   "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4, "expand": 2,
                   "mamba_ssm_cache_dtype": "float32", "tie_word_embeddings": False},
    "zamba": {"num_key_value_heads": 16, "attn_layer_period": 6, "attn_layer_offset": 4, "mamba_d_state": 16,
              "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": "auto", "n_mamba_heads": 2,
              "tie_word_embeddings": True},
    "zamba2": {"mamba_d_state": 64, "mamba_d_conv": 4, "mamba_expand": 2, "n_mamba_heads": 8, "mamba_ngroups": 1,
               "tie_word_embeddings": True},
    "lfm2": {"num_key_value_heads": 8, "conv_L_cache": 3, "block_auto_adjust_ff_dim": True,
             "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256, "tie_word_embeddings": True},
    "lfm2_moe": {"num_key_value_heads": 8, "conv_L_cache": 3, "tie_word_embeddings": True},
    "llama4_text": {"num_key_value_heads": 8, "head_dim": 128, "attention_chunk_size": 8192,
                    "no_rope_layer_interval": 4, "n_shared_experts": 1, "tie_word_embeddings": False},
    "minimax": {"num_key_value_heads": 8, "tie_word_embeddings": False},
    # Gemma 3n / 4: the last `num_kv_shared_layers` reuse K/V; Gemma 4's full layers take `global_head_dim`
    # (and `num_global_key_value_heads` KV heads where `attention_k_eq_v`).
    "gemma3n_text": {"num_key_value_heads": 2, "head_dim": 256, "sliding_window": 512, "num_kv_shared_layers": 15,
                     "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144,
                     "tie_word_embeddings": True},
    "gemma4_text": {"num_key_value_heads": 4, "head_dim": 256, "sliding_window": 512, "num_kv_shared_layers": 0,
                    "global_head_dim": 512, "attention_k_eq_v": False, "hidden_size_per_layer_input": 256,
                    "vocab_size_per_layer_input": 262144, "tie_word_embeddings": True},
    # Indexed sparse attention (DeepSeek V3.2, GLM-5, HY v4, A.X-K2): every layer is `indexed_attention`
    # (`layers.INDEXED_FAMILIES`), its indexer's sizes these.
    "deepseek_v32": {"index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64},
    "glm_moe_dsa": {"index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32},
    "hy_v4": {"index_topk": 2048, "index_head_dim": 128, "index_n_heads": 16},
    "axk2": {"index_topk": 2048, "index_head_dim": 128, "index_n_heads": 16},
}
# A multimodal model type and its text model's (whose family defaults it reads).
_TEXT_MODEL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "llama4": "llama4_text",
                     "gemma3n": "gemma3n_text", "gemma4": "gemma4_text"}


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


def text_config(config: dict) -> dict:
    """The language model's config: a nested text config merged over the outer keys (its own win), the
    outer model_type kept as `outer_model_type`, and the family's defaults under keys the file leaves
    out (a key present as null stays None, as it reaches transformers' `__post_init__`)."""
    c = dict(config)
    for key in _TEXT_CONFIG_KEYS:
        sub = c.get(key)
        if "num_hidden_layers" not in c and isinstance(sub, dict):
            c = {**c, **sub, "outer_model_type": c.get("model_type")}
            break
    for key, value in FAMILY_DEFAULTS.get(family(c.get("model_type")), {}).items():
        c.setdefault(key, value)
    return c


def family(model_type: str | None) -> str | None:
    """The text model type a model type's layers follow: a multimodal type's text model ("qwen3_5" ->
    "qwen3_5_text"), else the type itself."""
    return _TEXT_MODEL_TYPES.get(model_type, model_type)
