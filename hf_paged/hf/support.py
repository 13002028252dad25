"""Which transformers models a paged cache can serve, and why not; what K/V shapes they cache; where
their decoder is.

Reads configs and module trees only: it allocates nothing and runs nothing. Every entry point (the
cache, `attach`, the engine) asks `check_model_supported` first, so an unsupported model fails with
one clear `ValueError` before any forward.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import warnings
import weakref

import torch

from ..config import SUPPORTED_LAYER_TYPES
from .rope import check_rope_supported


def check_model_supported(config) -> None:
    """Raise ValueError naming what a model config needs that a paged cache cannot give."""
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"hf_paged does not support encoder-decoder models (model_type={config.model_type!r}); "
            "use a decoder-only causal LM"
        )
    check_decoder_supported(config)


def check_decoder_supported(config, include_decoder_flag: bool = True) -> None:
    """Raise ValueError naming what a decoder's config needs that a paged cache cannot give: layers
    other than plain attention (Mamba, linear attention, Llama 4's chunked attention), cross-attention
    layers, cross-layer KV sharing, a rope type not classified, no attention heads. The config alone
    decides, so the load check (`integrations.load_check`) asks it too: such a model is refused when
    it loads, with the engine's own message. `include_decoder_flag`: as `cross_attention_refusal`'s."""
    text = config.get_text_config(decoder=True)
    unsupported = sorted({t for t in layer_types_of(config) if t not in SUPPORTED_LAYER_TYPES})
    if unsupported:
        raise ValueError(
            f"hf_paged does not support model_type={text.model_type!r}: its layer types {unsupported} are "
            f"not plain attention (supported: {SUPPORTED_LAYER_TYPES}); {_INSTEAD}"
        )
    reason = cross_attention_refusal(config, include_decoder_flag)
    if reason is not None:
        raise ValueError(reason)
    if getattr(text, "kv_sharing_modes", None) or getattr(text, "num_kv_shared_layers", 0):
        raise ValueError(f"hf_paged does not support cross-layer KV sharing (model_type={text.model_type!r}): "
                         f"a layer that reads another layer's K/V has no blocks of its own; {_INSTEAD}")
    check_rope_supported(config)
    if getattr(text, "num_key_value_heads", None) is None and getattr(text, "num_attention_heads", None) is None:
        raise ValueError(f"hf_paged cannot find attention heads in the config of model_type={text.model_type!r}; "
                         f"{_INSTEAD}")


_INSTEAD = "load the model with attn_implementation='sdpa' or 'eager' instead"


def cross_attention_refusal(config, include_decoder_flag: bool = True) -> str | None:
    """Why a decoder with cross-attention layers cannot use a paged cache, or None when it has none.
    A cross-attention layer caches K/V of another input (an image, an encoder's states) in the same
    `Cache` as its self-attention layers (Mllama's `cross_attention_layers`, Idefics' gated
    cross-attention every `cross_layer_interval` layers, a decoder configured with
    `add_cross_attention`); paged blocks hold token positions of one sequence only.
    `include_decoder_flag=False` leaves the last out: such a decoder inside an encoder-decoder keeps
    the dense fallback, so it is not refused at load."""
    text = config.get_text_config(decoder=True)
    layers = getattr(text, "cross_attention_layers", None)
    has_cross = (bool(layers) or getattr(config, "cross_layer_interval", None) is not None
                 or (include_decoder_flag and any(getattr(c, "add_cross_attention", False) for c in (config, text))))
    if not has_cross:
        return None
    return (
        f"hf_paged does not support decoders with cross-attention layers (model_type={config.model_type!r}): they "
        "cache K/V of another input (an image or an encoder) beside the tokens', which paged blocks cannot hold; "
        "load the model with attn_implementation='sdpa' or 'eager'"
    )


def routes_attention(model_class) -> bool:
    """Whether a transformers model class routes its attention through transformers' attention
    interface, passing each layer's keyword arguments on to it: what its authors declare with
    `_supports_attention_backend` (`PreTrainedModel.is_backend_compatible()`, which vLLM's
    transformers backend also asks). Without it the model computes attention in its own modules, so
    a registered attention function (ours) is never called, or called without the step's metadata."""
    return bool(getattr(model_class, "_supports_attention_backend", False))


def attention_refusal(model_class, config) -> str | None:
    """Why `attn_implementation="hf_paged"` cannot serve `model_class` (a `PreTrainedModel` subclass
    built from `config`), or None when it can. Encoder-decoders keep their dense fallback (None)."""
    if getattr(config, "is_encoder_decoder", False) or routes_attention(model_class):
        return None
    model_type = getattr(config, "model_type", "?")
    instead = "'sdpa' or 'eager'" if getattr(model_class, "_supports_sdpa", False) else "'eager'"
    return (
        f"attn_implementation='hf_paged' cannot serve {model_class.__name__} (model_type={model_type!r}): it does "
        "not route attention through transformers' attention interface (the class does not declare "
        "`_supports_attention_backend`), so its layers would compute attention themselves, never read the paged "
        f"cache and apply a mask in the wrong form. Load it with attn_implementation={instead}"
    )


# Reading these off the K/V a cache returned is reading its layout, not its values.
_LAYOUT_ATTRS = frozenset({"shape", "dtype", "device", "ndim"})


@functools.lru_cache(maxsize=None)
def _cached_kv_uses(attention_class) -> tuple[int, str] | None:
    """(line within its `forward`, name) of the first place an attention class uses the K/V its cache's
    `update` returned other than by handing them to an attention function (or reading their shape);
    None when it does not, or its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(attention_class.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    cached, first = set(), None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "update":
            cached |= {n.id for target in node.targets for n in ast.walk(target) if isinstance(n, ast.Name)}
            first = node.lineno if first is None else min(first, node.lineno)
    uses = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in cached
                and node.lineno > first):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Attribute) and parent.attr in _LAYOUT_ATTRS:
            continue
        if isinstance(parent, ast.keyword):
            parent = parents.get(parent)
        if isinstance(parent, ast.Call) and node is not parent.func:
            func = parent.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if "attention" in name.lower() or "attn" in name.lower():
                continue  # handed to the attention function
        uses.append((node.lineno, node.id))
    return min(uses) if uses else None


def cached_kv_refusal(model_class, config) -> str | None:
    """Why `model_class` cannot read a paged cache because an attention class of its modelling module
    computes with the K/V its cache returns before (or beside) its attention function (Doge builds its
    mask from the values, DiffLlama splits them, JetMoe reshapes them): paged blocks are not dense K/V.
    None when no such class is found. Latent-KV models (DeepSeek MLA) expand their latents there on
    purpose and keep the dense path (`has_latent_kv`)."""
    try:
        if has_latent_kv(config) or getattr(config, "is_encoder_decoder", False):
            return None
    except Exception:  # noqa: BLE001 - a config this question cannot read (per-layer ones): no refusal from here
        return None
    module = inspect.getmodule(model_class)
    for name, cls in inspect.getmembers(module, inspect.isclass):
        if (cls.__module__ != getattr(module, "__name__", None) or "Attention" not in name or "Cross" in name
                or not issubclass(cls, torch.nn.Module)):
            continue
        use = _cached_kv_uses(cls)
        if use is not None:
            return (f"attn_implementation='hf_paged' cannot serve {model_class.__name__}: its {name} computes with the "
                    f"K/V its cache returns ({use[1]!r}, line {use[0]} of its forward) besides handing them to the "
                    f"attention function, and a paged cache returns blocks, not dense K/V; {_INSTEAD}")
    return None


def check_attention_routed(model) -> None:
    """Raise ValueError when `model` or its language model (a VLM's) does not route attention through
    transformers' attention interface (see `attention_refusal`): the engine and `attach` need every
    decoder layer to call the "hf_paged" function with the step's metadata. Other sub-models (vision
    towers) never read the paged cache, so their own attention is left alone."""
    from transformers import PreTrainedModel

    text_config = model.config.get_text_config(decoder=True)
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and (module is model or module.config is text_config):
            config = model.config if module is model else module.config
            reason = attention_refusal(type(module), config) or cached_kv_refusal(type(module), config)
            if reason is not None:
                raise ValueError(reason)
    _warn_hub_kernels_once(model)


def hub_kernel_conflicts(model: torch.nn.Module) -> list[str]:
    """The modules of `model` whose `forward` a hub kernel replaced (transformers' `use_kernels`, which
    is on by default from 5.25: the `kernels` package marks such a module with `_kernel_repo`) and
    which read or write the cache: an attention or mixer layer (it carries a `layer_idx`) or a module
    holding one. hf_paged relies on those calling transformers' attention interface with the step's
    metadata, which a replaced forward need not do. Norms, activations and rotary functions (what
    transformers' default mapping replaces) are no conflict."""
    found = []
    for name, module in model.named_modules():
        repo = module.__dict__.get("_kernel_repo")
        if repo is not None and any(getattr(m, "layer_idx", None) is not None for m in module.modules()):
            layer = getattr(type(module), "kernel_layer_name", type(module).__name__)
            found.append(f"{name or type(module).__name__} ({type(module).__name__}: hub kernel {layer!r} from "
                         f"{getattr(repo, 'repo_id', repo)})")
    return found


_warned_hub_kernels: weakref.WeakSet = weakref.WeakSet()


def _warn_hub_kernels_once(model: torch.nn.Module) -> None:
    if model in _warned_hub_kernels:
        return
    conflicts = hub_kernel_conflicts(model)
    if conflicts:
        _warned_hub_kernels.add(model)
        warnings.warn(
            "hf_paged: transformers' hub kernels replaced the forward of layers that read the KV cache: "
            f"{'; '.join(conflicts)}. hf_paged needs them to call the 'hf_paged' attention with each step's "
            "metadata; load the model with use_kernels=False (or USE_HUB_KERNELS=0) if generation fails or differs",
            stacklevel=3,
        )


def has_latent_kv(config) -> bool:
    """Whether the model uses multi-head latent attention (DeepSeek-V2/V3; its config names
    `kv_lora_rank`).

    Such a model caches, per token and layer, the compressed latent (`kv_lora_rank` wide) in the K
    slot and the shared rotary key (`qk_rope_head_dim` wide) in the V slot, each as one head, and
    expands them into per-head K (`qk_nope_head_dim + qk_rope_head_dim`) and V (`v_head_dim`) inside
    its attention module: after `cache.update`, before the attention function runs. A paged cache
    stores the latents (MLA's small footprint); attention over them runs dense.
    """
    return getattr(config.get_text_config(decoder=True), "kv_lora_rank", None) is not None


def kv_head_shapes(config, tensor_parallel_size: int = 1) -> tuple[int, int, int]:
    """(num_kv_heads, head_dim, head_dim_v) of the K and V states a layer passes to `cache.update`,
    from the config alone (the cache allocates from the states themselves once it sees them); with
    `tensor_parallel_size` N, one rank's: its N-th of the KV heads (transformers' tensor parallelism
    splits the K/V projections by head).

    Raises:
        ValueError: N does not divide the KV heads, or the model keeps latent K/V (one shared head).
    """
    text = config.get_text_config(decoder=True)
    if has_latent_kv(config):
        if tensor_parallel_size > 1:
            raise ValueError("hf_paged: latent attention (one shared K/V head) cannot be split over tensor-parallel "
                             f"ranks (tensor_parallel_size={tensor_parallel_size})")
        return 1, text.kv_lora_rank, text.qk_rope_head_dim
    num_attention_heads = getattr(text, "num_attention_heads", 1)
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_attention_heads
    if num_kv_heads % tensor_parallel_size or num_attention_heads % tensor_parallel_size:
        raise ValueError(f"hf_paged: tensor_parallel_size={tensor_parallel_size} must divide the model's "
                         f"{num_attention_heads} attention heads and {num_kv_heads} KV heads")
    return num_kv_heads // tensor_parallel_size, head_dim, head_dim


def check_paged_attention_supported(config) -> None:
    """Raise ValueError when attention cannot read K/V straight from the blocks (what the `Engine`'s
    packed steps need); the cache itself still serves such a model, with dense attention."""
    if has_latent_kv(config):
        text = config.get_text_config(decoder=True)
        raise ValueError(
            f"hf_paged's paged attention cannot serve multi-head latent attention (model_type="
            f"{text.model_type!r}): the model expands its cached latents into per-head K/V inside its attention "
            "module, so no attention kernel ever reads the paged blocks, and the Engine (which also serves "
            "model.generate for attn_implementation='hf_paged') needs one that does. Set "
            "`model.hf_paged_use_engine = False` so that model.generate runs stock generation over a PagedCache "
            "(the latents are stored paged, attention runs dense), or use attn_implementation='sdpa'"
        )


def layer_types_of(config) -> list[str]:
    """The text decoder's per-layer attention types ("full_attention" when the config names none)."""
    text = config.get_text_config(decoder=True)
    return getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers


def layer_windows_of(config) -> list[int | None]:
    """Per decoder layer, the sliding window its attention uses (None: full attention), the way
    transformers' `DynamicCache` reads the config: `layer_types` when given, else every layer slides
    when the config sets `sliding_window` (Mistral, Phi-3)."""
    text = config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if types is None:
        return [window] * text.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in types]


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward takes `input_ids`, `attention_mask` and the cache (the base model of a
    `*ForCausalLM`), or the model itself when it has no separate decoder."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if isinstance(decoder, torch.nn.Module) else model
