"""Whether hf_paged can serve a model yet, from its config alone (torch-free), so the planner says so
instead of planning sequences for a model that would be refused at load.

Two sources, the same ones `integrations.load_check` asks at load:

* the config: layer kinds other than `config.SUPPORTED_LAYER_TYPES` (the one definition `hf.support`
  uses too, `kv_spec.LAYER_KINDS`), recurrent layers without an attention layer beside them or of a
  mixer whose state `state_spec` cannot size, cross-attention layers, a model whose every layer reads another
  model's K/V (an assistant drafter), an encoder-decoder, no attention heads
  (`hf.support.check_decoder_supported`, read here from the dict);
* the model class, which a config cannot show: `NOT_ROUTED` (`hf.support.attention_refusal`: its
  modules compute attention themselves), `CACHED_KV` (`hf.support.cached_kv_refusal`: its attention
  computes with the K/V its cache returns) and `REFUSED_AT_RUN` (refused by the family sweep,
  `tests/hf/family_sweep.py`, at their first forward), recorded on the transformers release checked
  last; `tests/planner/test_layer_kinds.py` checks the first two against `hf.support`.
"""

from __future__ import annotations

from ..config import SUPPORTED_LAYER_TYPES
from ..kv_spec import ATTENTION_KINDS, FULL, HYBRID, INDEXED, STATE_KINDS, kv_sources
from ..state_spec import state_shape
from .configs import family, text_config
from .layers import MIXERLESS_KINDS, layer_kinds

NOT_ROUTED = frozenset({
    "big_bird", "blip", "bloom", "cpmant", "falcon", "falcon_mamba", "git",
    "gpt_neo", "gpt_neox_japanese", "mamba", "mamba2", "megatron-bert", "mpt", "openai-gpt", "reformer", "rembert",
    "roformer", "rwkv", "stablelm", "trocr", "xglm", "xlm", "xlnet", "xlstm",
})
CACHED_KV = frozenset({
    "diffllama", "doge", "hrm_text", "idefics", "jetmoe", "kolibri1_1", "pi05",
})
REFUSED_AT_RUN = {
    "dory": "it runs a layer several times, keeping K/V per pass in copies of the cache's layers",
    "mimo_v2_flash": "its layers differ in K/V shape (a sliding layer's KV heads are not a full layer's)",
    "nemotron": "its decoder layers do not pass the step's metadata on to attention",
    "phi4_multimodal": "its longrope recomputes the cache past original_max_position_embeddings",
    "deepseek_ocr2": "one of its modules picks its attention class from a table of its own",
}
_NOT_ROUTED = "its transformers class computes attention itself instead of calling transformers' attention interface"
_CACHED_KV = "its attention computes with the K/V its cache returns, and paged blocks are not dense K/V"


def refusal(config: dict) -> str | None:
    """Why hf_paged cannot serve the model of `config` (a config.json dict) yet, or None when nothing
    in the config or the recorded classes says so."""
    c = text_config(config)
    reasons = []
    if config.get("is_encoder_decoder") or c.get("is_encoder_decoder"):
        reasons.append("an encoder-decoder (hf_paged serves decoder-only models)")
    try:
        kinds = layer_kinds(c)
    except (KeyError, TypeError, ValueError):
        kinds = ()
    counts: dict[str, int] = {}
    for kind in kinds:
        if kind not in SUPPORTED_LAYER_TYPES:
            counts[kind] = counts.get(kind, 0) + 1
    if set(counts) - MIXERLESS_KINDS:  # Nemotron-H's MLP-only layers come with its Mamba layers: name those
        counts = {kind: n for kind, n in counts.items() if kind not in MIXERLESS_KINDS}
    if counts:
        listed = " and ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
        reasons.append(f"{listed} layers (of {len(kinds)}), and hf_paged serves only "
                       f"{', '.join(SUPPORTED_LAYER_TYPES[:-1])} and {SUPPORTED_LAYER_TYPES[-1]} layers")
    if not counts and any(kind in STATE_KINDS for kind in kinds):
        if not any(kind in ATTENTION_KINDS + (HYBRID,) for kind in kinds):
            reasons.append(f"no attention layer (every layer is {' or '.join(sorted(set(kinds)))}): no K/V for paged "
                           "blocks to hold, nothing for prefix caching to key its state by")
        else:
            try:
                state_shape({**c, "model_type": family(c.get("model_type"))})
            except ValueError as exc:
                reasons.append(str(exc))
    latent = c.get("kv_lora_rank") is not None
    if INDEXED in kinds and not latent:
        reasons.append("indexed_attention layers without multi-head latent attention (hf_paged keeps an indexer's keys "
                       "beside latent rows only)")
    if latent and (set(kinds) - {FULL, INDEXED} - set(STATE_KINDS) - MIXERLESS_KINDS or {FULL, INDEXED} <= set(kinds)):
        reasons.append(f"multi-head latent attention over {sorted(set(kinds))} layers (hf_paged's latent rows are one "
                       "width per model, over causal or indexed layers)")
    if c.get("cross_attention_layers") or config.get("cross_layer_interval") is not None:
        reasons.append("cross-attention layers (K/V of an image or encoder beside the tokens')")
    if kinds:
        try:  # every reuse layer needs an earlier layer of its type that stores the K/V it reads
            kv_sources(c, kinds)
        except (ValueError, TypeError) as exc:
            reasons.append(str(exc))
    if not reasons and c.get("num_attention_heads") is None and c.get("num_key_value_heads") is None:
        reasons.append("no attention heads in its config")
    if not reasons:  # what the config shows comes first; the class's reason only where it shows nothing
        for model_type in dict.fromkeys(t for t in (config.get("model_type"), c.get("model_type")) if t):
            reason = _class_refusal(model_type) or _class_refusal(family(model_type))
            if reason:
                reasons.append(f"model_type {model_type!r}: {reason}")
                break
    return "; ".join(reasons) or None


def _class_refusal(model_type: str) -> str | None:
    if model_type in NOT_ROUTED:
        return _NOT_ROUTED
    if model_type in CACHED_KV:
        return _CACHED_KV
    return REFUSED_AT_RUN.get(model_type)
