"""Every model family the installed transformers can generate with, through `attn_implementation="hf_paged"`.

For each model type in transformers' auto mappings for causal LMs and image-text-to-text, the sweep
builds a tiny random-weight model from that family's own default config, shrunk by one generic rule
(`tiny_config`: every size field transformers' configs use, in the config and its sub-configs, set
small; nothing written per family), sharpens it (`sharpen`: query and key projections x10, so that
attention is peaked and a position bug shows; windows and chunked attention at 8 tokens, longrope and
dynamic-NTK thresholds at `ROPE_THRESHOLD`, inside the prompts; a recurrent mixer's output as large as its
input, `amplify_mixers`, so that its state matters) and runs it twice with the same weights:
stock (sdpa, or eager where the class has no sdpa) and hf_paged. A family whose rotary frequencies
follow the length is compared with stock running each row alone. It checks

- greedy `generate` on a left-padded batch whose first and third rows repeat one prompt (the engine runs
  them as one request's two samples, forked after the prompt) and whose second row starts with the first
  row's first full block, token for token;
- a plain forward without a cache (what training and log-likelihood evaluation run), logits close;
- where the drop-in `generate` ran on the engine, the same call on an engine that prefills in chunks of
  `ENGINE_CHUNK` tokens with a pool one block above the longest row's need (rows preempt one another;
  row 1, admitted after row 0's first chunk, takes row 0's first block from the prefix cache: its K/V,
  and a recurrent model's state checkpointed at the block's end, which its last prompt token reads),
  token for token; the tokens served by the prefix cache are listed with the checks;
- for vision-language models whose image inputs it can build (`image_inputs`: one fixed image size,
  features from the model's own `get_image_features`): three rows with the same text and the same
  image placeholders, images A, B, A, token for token.

Each family ends in one class (`Outcome.kind`):

- identical    everything checked equals stock;
- refused      hf_paged raised a ValueError that names hf_paged (at load, at the first forward or
               generate), so the user is told what is unsupported and what to use instead;
- fallback     identical, with a warning that the call took a dense path (encoder-decoders);
- untested     stock itself cannot run the family as the sweep would (the reason is kept, and each such
               family's reason is written down in `family_configs.NOT_COVERED`): nothing to compare;
- different    tokens or logits differ from stock's (a defect);
- crash        hf_paged failed with anything but a clear refusal (a defect).

`python tests/hf/family_sweep.py [TYPE ...] [--workers=N]` prints the table docs/models.md's architecture
list is generated from (`--readme` rewrites that list).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import math
import os
import sys
import time
import warnings
from unittest import mock

import torch

from hf_paged.hf.rope import has_length_rope
from family_configs import FAMILY_CONFIG, FAMILY_INPUTS, FAMILY_OWN_PAD, FAMILY_SETUP, FAMILY_TEXT_KEYS, NOT_COVERED

VOCAB_MAX_ID = 400  # prompt ids are drawn below this and below the vocabulary
NEW_TOKENS = 4  # 3 fed back: the 20-token rows' lengths cross ROPE_THRESHOLD (22) while generating
LOGITS_ATOL = 1e-4
QK_SCALE = 10.0  # query and key projections scaled so that attention is peaked (`sharpen`)
ROPE_THRESHOLD = 22  # longrope / dynamic NTK switch here: the 20-token rows cross it while generating
ENGINE_CHUNK = 16  # the engine check's token budget per step: prompts longer than it are prefilled in chunks
SHARED_BLOCK = 16  # rows 0 and 1 share their first block (hf_paged's default block_size)
# Module names of query/key projections (fused ones too) and of q/k norms.
_QK_NORMS = frozenset({"q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm",
                       "q_ln", "k_ln"})
_QK_MODULES = frozenset({"q_proj", "k_proj", "query", "key", "wq", "wk", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                         "qkv_proj", "query_key_value", "c_attn", "Wqkv", "qkv", "W_pack"}) | _QK_NORMS

# The generic shrink: every field name transformers' configs use for a size, and the tiny value.
_SIZES = {
    # widths
    "hidden_size": 32, "n_embd": 32, "d_model": 32, "n_embed": 32, "embed_dim": 32, "dim": 32,
    "intermediate_size": 64, "ffn_dim": 64, "n_inner": 64, "ffn_hidden_size": 64, "decoder_ffn_dim": 64,
    "encoder_ffn_dim": 64, "d_ff": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32, "intermediate_size_mlp": 64, "projection_dim": 32, "d_kv": 8,
    # depth
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2,
    "encoder_layers": 2, "num_decoder_layers": 2, "depth": 2,
    # heads
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4, "decoder_attention_heads": 4,
    "encoder_attention_heads": 4, "num_key_value_heads": 2, "num_kv_heads": 2, "n_kv_heads": 2,
    "head_dim": 8, "kv_channels": 8, "attention_head_dim": 8,
    # mixtures of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
    # latent attention (DeepSeek)
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "qk_head_dim": 16, "rotary_dim": 4,
    # indexed sparse attention (DeepSeek V3.2): fewer keys than a prompt's, so the indexer's choice decides
    "index_topk": 4, "index_n_heads": 8, "index_head_dim": 16, "index_kpool": 4,
}
_DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")


def _shrunk_value(key, default):
    if key not in _SIZES or key == "num_key_value_heads":
        return None  # the KV heads follow the attention heads (below)
    if default is None:
        return _SIZES[key]  # a size the model derives when unset (head_dim from the width) is set outright
    if not isinstance(default, int) or isinstance(default, bool) or default <= 0:
        return None
    return min(default, _SIZES[key])


def tiny_config(config_class, base=None, overrides: dict | None = None):
    """`config_class`'s defaults (or `base`'s values) with every size field made tiny, sub-configs
    (text, vision, audio, ...) too, and per-layer lists cut to the new depth, keeping one layer of
    each kind the default has (a gemma-3 pattern keeps a sliding and a full layer); then `overrides`
    (a `FAMILY_CONFIG` entry) set."""
    overrides = overrides or {}
    base = config_class() if base is None else base
    values = base.to_dict()
    depth = next((values[k] for k in _DEPTH_KEYS if isinstance(values.get(k), int) and values[k] > 0), None)
    keep = _kept_layers(values.get("layer_types"), depth)
    # A field stored under the family's own name (`moe_k` for `num_experts_per_tok`) shrinks as its alias does.
    aliases = {target: alias for alias, target in getattr(config_class, "attribute_map", {}).items()
               if alias in _SIZES and target not in _SIZES}
    kwargs, nested = {}, set()
    for key, default in values.items():
        try:
            sub = getattr(base, key, None)
        except Exception:  # noqa: BLE001 - a per-layer attribute (Gemma 4's head_dim) refuses global reads
            sub = None
        if hasattr(sub, "to_dict") and hasattr(type(sub), "model_type"):
            kwargs[key] = tiny_config(type(sub), sub, overrides.get(key)).to_dict()
            nested.add(key)  # its overrides are set inside, at every depth
            continue
        if isinstance(default, dict) and default and depth and all(
                str(k).isdigit() and int(k) < depth for k in default):
            # Per-layer overrides keyed by layer index (Gemma 4's `per_layer_config`): the kept layers', renumbered.
            kwargs[key] = {type(k)(keep.index(int(k))): v for k, v in default.items() if int(k) in keep}
            continue
        if isinstance(default, list) and depth and len(default) == depth and depth > 1:
            kept = [default[i] for i in keep]
            if key in _SIZES and all(isinstance(v, int) and v > 0 for v in kept):
                kept = [min(v, _SIZES[key]) for v in kept]
            kwargs[key] = kept
            continue
        small = _shrunk_value(aliases.get(key, key), default)
        if small is not None:
            kwargs[key] = small
    for key in _DEPTH_KEYS:
        if key in kwargs and depth:
            kwargs[key] = len(keep)
    heads, kv = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if isinstance(heads, int) and "num_key_value_heads" in values and "num_attention_heads" in kwargs:
        # Keep the attention's kind: multi-head (or unset) stays multi-head (latent attention needs it),
        # a single KV head stays single, grouped stays grouped.
        tiny_heads = kwargs["num_attention_heads"]
        kwargs["num_key_value_heads"] = tiny_heads if kv in (heads, None) else 1 if kv == 1 else min(2, tiny_heads)
    if isinstance(values.get("sliding_window"), int) and values["sliding_window"] > 8 \
            and "sliding_attention" in (kwargs.get("layer_types") or ()):
        # Prompts of a few dozen tokens really slide where the layer types say a layer slides. A config
        # whose layer types name no sliding layer keeps its window (Moshi's 3000 is its context; its
        # masks never slide, though a DynamicCache would keep only a shrunk window).
        kwargs["sliding_window"] = 8
    kwargs.update(_shrunk_rope(config_class, values, kwargs))
    if isinstance(values.get("attention_chunk_size"), int) and values["attention_chunk_size"] > 8:
        kwargs["attention_chunk_size"] = 8  # chunked attention's chunks end inside the prompts
    for key, value in overrides.items():
        if key in nested:
            continue
        if isinstance(kwargs.get(key), dict) and isinstance(value, dict):
            kwargs[key] = {**kwargs[key], **value}  # a sub-config built above, or a plain dict field
        elif isinstance(value, dict) and isinstance(values.get(key), dict):
            kwargs[key] = {**values[key], **value}
        else:
            kwargs[key] = value
    merged = {**values, **kwargs}
    _shrink_rope_threshold(merged)
    merged.pop("model_type", None)
    merged.pop("transformers_version", None)
    config = config_class(**merged)
    # A default whose image placeholder id lies past its text vocabulary (LLaVA's 32000 of 32000) gets a
    # vocabulary that holds it, as every released checkpoint's does.
    placeholder = _image_token_id(config)
    text = config.get_text_config(decoder=True)
    if placeholder is not None and text is not config and isinstance(getattr(text, "vocab_size", None), int) \
            and placeholder >= text.vocab_size:
        text.vocab_size = placeholder + 64
    return config


def family_config(model_type: str, model_class=None):
    """The tiny config the sweep runs `model_type` with. A causal-LM class whose config is the text part of
    its family's composite config (Emu3, Llama 4, Qwen 3.5) gets that part, as loading such a checkpoint
    for text does."""
    from transformers import AutoConfig

    config = tiny_config(type(AutoConfig.for_model(model_type)), overrides=FAMILY_CONFIG.get(model_type))
    wanted = getattr(model_class, "config_class", None)
    if wanted is not None and not isinstance(config, wanted):
        text = config.get_text_config(decoder=True)
        if isinstance(text, wanted):
            return text
    return config


def _kept_layers(types, depth: int | None) -> list[int]:
    """The layers a tiny config keeps: the first of each kind `layer_types` names (at least two), else
    the first two. Every per-layer list and dict keeps the same layers."""
    if isinstance(types, list) and types and len(types) == depth:
        keep = list(dict.fromkeys(types.index(t) for t in types))
        return keep if len(keep) >= 2 else [0, 1 if depth > 1 else 0]
    return list(range(min(depth or 2, 2)))


def _shrunk_rope(config_class, values: dict, kwargs: dict) -> dict:
    """Multimodal rope splits head_dim / 2 rotary pairs into (t, h, w) sections: scaled to the tiny
    head_dim, and made explicit where the rotary class would default to the full-size sections."""
    out = {}
    for key in ("rope_parameters", "rope_scaling"):
        rope = values.get(key)
        if not isinstance(rope, dict) or not rope or any(isinstance(v, dict) for v in rope.values()):
            continue  # none, or one per layer type: nothing multimodal to scale
        if "mrope_section" not in rope \
                and "mrope_section" in getattr(config_class, "ignore_keys_at_rope_validation", ()):
            rope = {**rope, "mrope_section": [16, 24, 24]}  # the section the rotary class defaults to
        if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
            heads = kwargs.get("num_attention_heads") or values.get("num_attention_heads") or 1
            head_dim = kwargs.get("head_dim") or (kwargs.get("hidden_size") or values.get("hidden_size", 64)) // heads
            sections, pairs = rope["mrope_section"], head_dim // 2
            scaled = [max(1, round(v * pairs / sum(sections))) for v in sections]
            scaled[-1] += pairs - sum(scaled)
            out[key] = {**rope, "mrope_section": scaled}
    return out


def _shrink_rope_threshold(values: dict) -> None:
    """Length-dependent rope (longrope, dynamic NTK) switches at `ROPE_THRESHOLD` tokens, inside the prompts,
    so that the sweep's generation crosses it; so does Phi-3's cache recompute (`original_max_position_embeddings`)."""
    rope = values.get("rope_parameters")
    if not isinstance(rope, dict) or rope.get("rope_type") not in ("longrope", "dynamic"):
        return
    if rope["rope_type"] == "longrope":
        values["rope_parameters"] = {**rope, "original_max_position_embeddings": ROPE_THRESHOLD}
        if "original_max_position_embeddings" in values:
            values["original_max_position_embeddings"] = ROPE_THRESHOLD
    else:
        values["max_position_embeddings"] = ROPE_THRESHOLD


def sharpen(model: torch.nn.Module, factor: float = QK_SCALE) -> None:
    """Scale every query and key projection (a fused q/k/v projection whole) and q/k norm by `factor`, so
    that attention is peaked: at transformers' default initialisation it is nearly uniform, and a
    position bug would change nothing."""
    with torch.no_grad():
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor) or leaf not in _QK_MODULES:
                continue
            weight.mul_(factor)
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor) and leaf not in _QK_NORMS:
                bias.mul_(factor)


def recurrent_mixers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, torch.nn.Linear]]:
    """(name, module, output projection) of every recurrent mixer: a module of one layer (it has a
    `layer_idx`) with a causal convolution (a `Conv1d` child: Mamba, gated delta-rule and short-conv
    mixers keep its window in the cache; or a child of the same layer's with one: ZAYA's attention
    convolves its queries and keys) and an output projection (`out_proj` or `o_proj`)."""
    def convolves(module):
        return any(isinstance(c, torch.nn.Conv1d) for c in module.children())

    found = []
    for name, module in model.named_modules():
        idx = getattr(module, "layer_idx", None)
        if idx is None or not (convolves(module) or any(getattr(c, "layer_idx", None) == idx and convolves(c)
                                                        for c in module.children())):
            continue
        out = next((p for p in (getattr(module, k, None) for k in ("out_proj", "o_proj"))
                    if isinstance(p, torch.nn.Linear)), None)
        if out is not None:
            found.append((name, module, out))
    return found


def amplify_mixers(model: torch.nn.Module, inputs: dict) -> None:
    """Scale each recurrent mixer's output projection so that, on `inputs` (one forward without a cache),
    its output is as large (RMS) as its input. At transformers' default initialisation a mixer adds next to
    nothing to the residual stream (LFM2's gated short convolution about 1e-5 of it), so a state carried
    wrongly, or not at all, from one chunk or step to the next would change no greedy token."""
    found = recurrent_mixers(model)
    if not found:
        return
    ratios, hooks = {}, []
    for name, module, _ in found:
        def hook(mod, args, kwargs, output, name=name):
            given = args[0] if args else kwargs.get("hidden_states")
            got = output[0] if isinstance(output, tuple) else output
            if isinstance(given, torch.Tensor) and isinstance(got, torch.Tensor) and name not in ratios:
                ratios[name] = given.float().pow(2).mean().sqrt() / got.float().pow(2).mean().sqrt().clamp_min(1e-30)
        hooks.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(**inputs, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        for name, _, out in found:
            if name in ratios and math.isfinite(float(ratios[name])):
                out.weight.mul_(ratios[name])
                if out.bias is not None:
                    out.bias.mul_(ratios[name])


def fresh_rope(model: torch.nn.Module) -> None:
    """Stock's dynamic-NTK rotary modules remember the longest length seen: a row run alone starts fresh."""
    for module in model.modules():
        if hasattr(module, "original_inv_freq") and hasattr(module, "max_seq_len_cached"):
            module.inv_freq = module.original_inv_freq.clone()
            module.max_seq_len_cached = module.original_max_seq_len


def _rows_alone(stock, rows, ids, batch_out, gen, id_key, mask_key) -> torch.Tensor:
    """`batch_out` with each row's generated tokens replaced by stock's for that row run alone."""
    out = batch_out.clone()
    width = ids.shape[1]
    for r, row in enumerate(rows):
        fresh_rope(stock)
        alone = torch.tensor([row])
        new = _sequences(stock.generate(**{id_key: alone, mask_key: torch.ones_like(alone)}, **gen))[0, len(row):]
        out[r, width:width + len(new)] = new
    return out


def _engine_check(paged, text: dict, gen: dict, rows: list[list[int]]):
    """The drop-in `generate` on an engine that prefills in chunks of `ENGINE_CHUNK` tokens, with a pool one
    block above the longest row's need (rows preempt one another; row 1 takes row 0's first block from the
    prefix cache: its K/V, and a recurrent model's state checkpointed at the block's end). (sequences,
    whether a row was preempted, prompt tokens served by the prefix cache), or None where the call is not
    the engine's."""
    from hf_paged import Engine
    from hf_paged.config import PagedCacheConfig
    from hf_paged.hf import PagedCache
    from hf_paged.integrations.batch_generate import try_engine_generate

    longest = max(map(len, rows)) + NEW_TOKENS
    tight = PagedCache(paged.config, PagedCacheConfig()).manager.max_blocks_for(longest) + 1
    paged.hf_paged_cache_config = PagedCacheConfig(num_blocks=tight)  # what the drop-in sizes its pool by
    engine = Engine(paged, num_blocks=tight, max_num_seqs=len(rows), max_num_batched_tokens=ENGINE_CHUNK,
                    show_progress=False)
    try:
        with torch.no_grad():
            torch.manual_seed(0)
            out = try_engine_generate(paged, None, None, {**text, **gen}, engine=engine)
        metrics = engine.metrics()
    finally:
        engine.shutdown()
        del paged.hf_paged_cache_config
    if out is None:
        return None
    return _sequences(out), metrics["vllm:num_preemptions"] > 0, metrics["vllm:prefix_cache_hits"]


def _special_ids(config) -> set[int]:
    ids = set()
    for c in (config, *[getattr(config, k) for k in dir(config) if k.endswith("_config")
                        and hasattr(getattr(config, k, None), "to_dict")]):
        for key, value in c.to_dict().items():
            if ("token" in key or key.endswith("_index")) and isinstance(value, int):
                ids.add(value)
            if ("token" in key) and isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
    return ids


def prompts_for(config, vocab: int) -> list[list[int]]:
    """A repeated 20-token prompt (rows 0 and 2); a 17-token one (row 1): the first's first `SHARED_BLOCK`
    tokens (a full block for the prefix cache) and one more, whose logits read a recurrent model's state
    (convolution window too) right at the block's end; a 9-token and a 35-token one. Ordinary ids (no
    special or placeholder ids)."""
    special = _special_ids(config)
    pool = [i for i in range(3, min(vocab, VOCAB_MAX_ID)) if i not in special]
    gen = torch.Generator().manual_seed(0)

    def draw(n):
        return [pool[int(i)] for i in torch.randint(len(pool), (n,), generator=gen)]

    a, b, c = draw(20), draw(35), draw(9)
    return [a, a[:SHARED_BLOCK] + draw(1), a, c, b]


def _left_pad(rows: list[list[int]], pad: int):
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for k, row in enumerate(rows):
        ids[k, width - len(row):] = torch.tensor(row)
        mask[k, width - len(row):] = 1
    return ids, mask


@dataclasses.dataclass
class Outcome:
    model_type: str
    mapping: str  # "causal" or "image-text-to-text"
    class_name: str
    kind: str
    detail: str = ""
    checks: tuple[str, ...] = ()
    seconds: float = 0.0


def _vocab_of(config) -> int:
    text = config.get_text_config(decoder=True)
    return getattr(text, "vocab_size", None) or getattr(config, "vocab_size", 1000)


def _stock_attn(model_class) -> str:
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def _build(model_class, config, attn: str, dtype=torch.float32, setup=None, weights_of=None):
    """A model of its own config copy: `_from_config` keeps the object, and the attention choice with it.
    With `weights_of`, a model of the same class whose parameters and buffers (non-persistent ones
    too: rotary tables) it takes, skipping its own random initialisation (most of a tiny model's
    build time: the full-size vocabulary's embeddings)."""
    from transformers.initialization import no_init_weights

    torch.manual_seed(0)
    with no_init_weights() if weights_of is not None else contextlib.nullcontext():
        model = model_class._from_config(copy.deepcopy(config), attn_implementation=attn, dtype=dtype).eval()
    if setup is not None:
        setup(model)
    if weights_of is not None:
        model.tie_weights()  # what the skipped initialisation would have done last
        model.load_state_dict(weights_of.state_dict())
        theirs = dict(weights_of.named_buffers())
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(theirs[name])
    return model


def _sequences(out):
    """Generated ids, whether `generate` returned them or an output holding them (a diffusion model's)."""
    return getattr(out, "sequences", out)


def _is_refusal(exc: BaseException) -> bool:
    return isinstance(exc, (ValueError, TypeError)) and "hf_paged" in str(exc)


def run_family(model_type: str, mapping: str) -> Outcome:
    """Build, run and classify one family (see the module docstring)."""
    import hf_paged  # noqa: F401 - registers "hf_paged" and installs the drop-in patches
    from transformers.models.auto import modeling_auto

    names = (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if mapping == "causal"
             else modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    class_name = names[model_type]
    began = time.perf_counter()

    def done(kind, detail="", checks=()):
        return Outcome(model_type, mapping, class_name, kind, detail, tuple(checks), time.perf_counter() - began)

    # The stock side: any failure here is the tiny config's or stock's, not ours.
    try:
        import transformers

        model_class = getattr(transformers, class_name)
        config = family_config(model_type, model_class)
        try:
            stock = _build(model_class, config, _stock_attn(model_class), setup=FAMILY_SETUP.get(model_type))
        except ValueError as exc:  # a sub-model without sdpa (Apertus 1.5's image tokenizer): transformers' own pick
            if "scaled_dot_product_attention" not in str(exc):
                raise
            stock = _build(model_class, config, None, setup=FAMILY_SETUP.get(model_type))
        if not stock.can_generate():
            return done("untested", "the class does not generate")
        sharpen(stock)
        vocab = _vocab_of(config)
        pad = getattr(config.get_text_config(decoder=True), "pad_token_id", None) or 0
        rows, extra = prompts_for(config, vocab), {}
        if model_type in FAMILY_INPUTS:
            rows, extra = FAMILY_INPUTS[model_type](config, rows)
        ids, mask = _left_pad(rows, pad)
        id_key, mask_key = FAMILY_TEXT_KEYS.get(model_type, ("input_ids", "attention_mask"))
        text = {id_key: ids, mask_key: mask}
        gen = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad)
        if model_type in FAMILY_OWN_PAD:
            del gen["pad_token_id"]
        amplify_mixers(stock, {**text, **extra})
    except Exception as exc:  # noqa: BLE001 - classified, with its reason
        return done("untested", f"stock fails on the tiny config: {type(exc).__name__}: {str(exc)[:160]}")

    # hf_paged's load, with the same weights: a model refused here needs no stock run to compare with.
    checks = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            paged = _build(model_class, config, "hf_paged", setup=FAMILY_SETUP.get(model_type), weights_of=stock)
        except Exception as exc:  # noqa: BLE001
            return done("refused", str(exc)) if _is_refusal(exc) else done(
                "crash", f"{type(exc).__name__}: {str(exc)[:300]}")

    # The stock run: any failure here is the tiny config's or stock's, not ours.
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(0)  # a generate that draws (a diffusion decoder's canvas) draws alike on both sides
            want = _sequences(stock.generate(**text, **extra, **gen))
            want_logits = stock(**text, use_cache=False, **extra).logits
            if has_length_rope(config) and not extra:
                # frequencies that follow the length: what stock gives each row run alone (hf_paged's promise;
                # stock's batch rotates every row for the longest one's length)
                want = _rows_alone(stock, rows, ids, want, gen, id_key, mask_key)
    except Exception as exc:  # noqa: BLE001 - classified, with its reason
        return done("untested", f"stock fails on the tiny config: {type(exc).__name__}: {str(exc)[:160]}")

    # The hf_paged run.
    try:
        with warnings.catch_warnings(record=True) as ran:
            warnings.simplefilter("always")
            with torch.no_grad():
                torch.manual_seed(0)
                got = _sequences(paged.generate(**text, **extra, **gen))
                checks.append("generate")
                got_logits = paged(**text, use_cache=False, **extra).logits
                checks.append("forward")
        caught += ran
    except Exception as exc:  # noqa: BLE001
        if _is_refusal(exc):
            return done("refused", str(exc), checks)
        return done("crash", f"{type(exc).__name__}: {str(exc)[:300]}", checks)
    if got.shape != want.shape or got_logits.shape != want_logits.shape:
        return done("different", f"shapes: generate {tuple(got.shape)} vs {tuple(want.shape)}, logits "
                                  f"{tuple(got_logits.shape)} vs {tuple(want_logits.shape)}", checks)
    if not torch.equal(got, want):
        row = int((got != want).any(-1).nonzero()[0])
        return done("different", f"generate: row {row} {got[row, ids.shape[1]:].tolist()} vs stock "
                                  f"{want[row, ids.shape[1]:].tolist()}", checks)
    live = mask.bool()[:, -got_logits.shape[1]:]  # a model may return the last positions' logits only
    worst = (got_logits[live] - want_logits[live]).abs().max().item()
    if not math.isfinite(worst) or worst > LOGITS_ATOL:
        return done("different", f"forward: max |logit diff| {worst:.2e} > {LOGITS_ATOL}", checks)
    fallback = [str(w.message) for w in caught if "dense" in str(w.message) or "fallback" in str(w.message)]
    from hf_paged.integrations.batch_generate import release

    if release(paged) and not fallback and not extra:  # the drop-in generate ran on an engine: stress that path
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                served = _engine_check(paged, text, gen, rows)
        except Exception as exc:  # noqa: BLE001
            if _is_refusal(exc):
                return done("refused", "engine: " + str(exc), checks)
            return done("crash", f"engine: {type(exc).__name__}: {str(exc)[:280]}", checks)
        if served is not None:
            got, preempted, hits = served
            if not torch.equal(got, want):
                row = int((got != want).any(-1).nonzero()[0])
                return done("different", f"engine: row {row} {got[row, ids.shape[1]:].tolist()} vs stock "
                                          f"{want[row, ids.shape[1]:].tolist()}", checks)
            checks.append("engine" + (", preempted" if preempted else "")
                          + (f", {hits} prefix-cache tokens" if hits else ""))
    if model_type in FAMILY_INPUTS and any(k in extra for k in ("pixel_values", "flattened_patches")):
        checks.append("images")  # every check above ran with one image per row (A, B, C, A, B)
    elif mapping != "causal":
        try:  # stock runs the image rows first: a failure there is the builder's or stock's, not ours
            image_ids, image_mask, images = image_inputs(stock, config, rows)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.manual_seed(0)
                want = stock.generate(input_ids=image_ids, attention_mask=image_mask, **images, **gen)
        except Exception as exc:  # noqa: BLE001
            checks.append(f"images not built: {type(exc).__name__}")
        else:
            try:
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    torch.manual_seed(0)
                    got = paged.generate(input_ids=image_ids, attention_mask=image_mask, **images, **gen)
            except Exception as exc:  # noqa: BLE001
                if _is_refusal(exc):
                    return done("refused", "with images: " + str(exc), checks)
                return done("crash", f"with images: {type(exc).__name__}: {str(exc)[:280]}", checks)
            if not torch.equal(got, want):
                row = int((got != want).any(-1).nonzero()[0])
                width = image_ids.shape[1]
                return done("different", f"images: row {row} {got[row, width:].tolist()} vs stock "
                                         f"{want[row, width:].tolist()}", checks)
            checks.append("images")
    if fallback:
        return done("fallback", fallback[0][:200], checks)
    return done("identical", "", checks)


# Outcomes the sweep knows and explains, which are not (yet) identical or a clear refusal: each is an open
# defect of hf_paged, listed in docs/models.md as such. The test fails when one changes, either way, so
# a fix (or a new failure) is noticed.
KNOWN = {
}

README_BEGIN = "<!-- family-sweep:begin (generated by `python tests/hf/family_sweep.py --readme`) -->"
README_END = "<!-- family-sweep:end -->"
_KIND_TITLES = [
    ("identical", "Identical to stock"),
    ("refused", "Refused with a ValueError that says what to use instead"),
    ("fallback", "Identical, through a dense fallback that warns once per model"),
    ("crash", "Known to fail (open)"),
    ("different", "Known to differ from stock (open: load these with `sdpa`)"),
    ("untested", "Not covered: stock cannot run them as the sweep would"),
]


def readme_block(outcomes: list[Outcome]) -> str:
    """docs/models.md's architecture list for `outcomes` (the whole sweep), between its markers."""
    import transformers

    counts = {kind: sum(o.kind == kind for o in outcomes) for kind, _ in _KIND_TITLES}
    lines = [README_BEGIN, "",
             f"The family sweep (`tests/hf/test_family_sweep.py`, transformers {transformers.__version__}): "
             f"{len(outcomes)} model types from the causal-LM and image-text-to-text auto mappings, "
             + ", ".join(f"{counts[k]} {k}" for k, _ in _KIND_TITLES) + ".", ""]
    for kind, title in _KIND_TITLES:
        chosen = [o for o in outcomes if o.kind == kind]
        if not chosen:
            continue
        def name(o):
            if o.mapping == "causal":
                return o.model_type
            return o.model_type + (" (VLM, with images)" if "images" in o.checks else " (VLM)")
        if kind == "untested":
            lines.append(f"- **{title}** ({len(chosen)}):")
            lines += [f"  - {name(o)}: {NOT_COVERED.get(o.model_type, o.detail)}" for o in chosen]
            continue
        if kind in ("crash", "different", "fallback"):
            items = [f"{name(o)}: {KNOWN.get((o.model_type, o.mapping), (kind, o.detail))[1]}" for o in chosen]
            lines.append(f"- **{title}** ({len(chosen)}):")
            lines += [f"  - {item}" for item in items]
        else:
            lines.append(f"- **{title}** ({len(chosen)}): " + ", ".join(name(o) for o in chosen) + ".")
    lines += ["", README_END]
    return "\n".join(lines)


def _image_token_id(config) -> int | None:
    for key in ("image_token_id", "image_token_index"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def image_inputs(model, config, rows: list[list[int]]):
    """(ids, attention mask, image kwargs) for `rows` of text, each with one image's placeholders after
    its first 3 ids, images [A, B, A] (A, B different): for a VLM with one fixed image size, whose image
    features the model's own `get_image_features` gives (its placeholder count per image is read from
    them). Images go as `[n, C, H, W]`, or `[n, 1, C, H, W]` where the model wants images per row
    (Idefics3, SmolVLM), with `image_sizes` where its signature asks for them (LLaVA-NeXT, Mistral 3).
    Raises when the family needs more than that (grids, tiles, token types)."""
    vision = getattr(config, "vision_config", None)
    image_token = _image_token_id(config)
    size = getattr(vision, "image_size", None)
    size = size if isinstance(size, int) else size[0] if isinstance(size, (list, tuple)) else None
    if vision is None or image_token is None or size is None:
        raise ValueError("no fixed image size or image token in the config")
    channels = getattr(vision, "num_channels", 3)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, channels, size, size, generator=gen)
    wants_sizes = "image_sizes" in inspect.signature(model.get_image_features).parameters
    error = None
    for pixels in (torch.stack([a, b, a]), torch.stack([a, b, a])[:, None]):
        extra = {"image_sizes": torch.tensor([[size, size]] * 3)} if wants_sizes else {}
        try:
            with torch.no_grad():
                features = model.get_image_features(pixel_values=pixels[:1],
                                                    **{k: v[:1] for k, v in extra.items()})
        except (ValueError, RuntimeError) as exc:
            error = exc
            continue
        break
    else:
        raise error
    features = getattr(features, "pooler_output", features)
    if isinstance(features, (list, tuple)):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    width = config.get_text_config(decoder=True).hidden_size
    if features.numel() % width:
        raise ValueError(f"image features of {features.numel()} values do not divide the text width {width}")
    count = features.numel() // width
    ids = torch.tensor([rows[0][:3] + [image_token] * count + rows[0][3:]] * 3)
    return ids, torch.ones_like(ids), {"pixel_values": pixels, **extra}


def families() -> list[tuple[str, str]]:
    from transformers.models.auto import modeling_auto

    seen = []
    for model_type in sorted(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        seen.append((model_type, "causal"))
    for model_type in sorted(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        seen.append((model_type, "image-text-to-text"))
    return seen


_KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


def run_sweep(only: set[str] | None = None, echo: bool = False, skip: set[str] = frozenset(),
              workers: int = 1) -> list[Outcome]:
    """Every family (or those in `only`, less those in `skip`), quietly: transformers' warnings and logs
    are silenced. With `workers` > 1 the families are shared round-robin among that many fresh
    processes of one torch thread each (tiny models gain nothing from a second thread; a second
    process halves the sweep on two cores); the outcomes come back in the sweep's order."""
    chosen = [(t, m) for t, m in families() if (not only or t in only) and t not in skip]
    if workers <= 1 or len(chosen) < 2 * workers:
        return _run_quietly(chosen, echo)
    import concurrent.futures
    import multiprocessing

    # The workers' malloc keeps freed memory for reuse (glibc reads these at start; other allocators ignore
    # them). A family builds and drops models and pools of up to hundreds of MB; with glibc's defaults each
    # buffer over its mmap threshold was mapped, faulted in zero-filled and unmapped again: 48 s of the
    # sweep's 214 CPU-seconds were the kernel's, 4 s with this (and 37 s at the 32 MiB that mallopt allows).
    with mock.patch.dict(os.environ, _KEEP_FREED_MEMORY), concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=torch.set_num_threads,
            initargs=(1,)) as pool:
        parts = list(pool.map(_run_quietly, [chosen[i::workers] for i in range(workers)], [echo] * workers))
    by_family = {(o.model_type, o.mapping): o for part in parts for o in part}
    return [by_family[family] for family in chosen]


def _run_quietly(chosen: list[tuple[str, str]], echo: bool) -> list[Outcome]:
    import logging

    import transformers

    verbosity, ours = transformers.logging.get_verbosity(), logging.getLogger("hf_paged")
    level = ours.level
    transformers.logging.set_verbosity_error()
    ours.setLevel(logging.ERROR)
    outcomes = []
    try:
        for model_type, mapping in chosen:
            out = run_family(model_type, mapping)
            outcomes.append(out)
            if echo:
                print(f"{out.kind:10s} {out.seconds:5.2f}s {mapping[:6]:6s} {model_type:28s} "
                      f"{(out.detail or '; '.join(out.checks))[:150]}", flush=True)
    finally:  # the rest of a test session logs as before
        transformers.logging.set_verbosity(verbosity)
        ours.setLevel(level)
    return outcomes


def rewrite_readme(path, block: str) -> None:
    text = open(path).read()
    begin, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    with open(path, "w") as f:
        f.write(text[:begin] + block + text[end:])


if __name__ == "__main__":
    readme = "--readme" in sys.argv
    only = {a for a in sys.argv[1:] if not a.startswith("--")}
    workers = next((int(a.removeprefix("--workers=")) for a in sys.argv if a.startswith("--workers=")), 1)
    results = run_sweep(only, echo=True, workers=workers)
    totals = {}
    for o in results:
        totals[o.kind] = totals.get(o.kind, 0) + 1
    print(totals, f"{sum(o.seconds for o in results):.1f} s")
    if readme:
        import pathlib

        rewrite_readme(pathlib.Path(__file__).resolve().parents[2] / "docs" / "models.md", readme_block(results))
