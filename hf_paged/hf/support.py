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

from ..kv_spec import ATTENTION_KINDS, FULL, HYBRID, INDEXED, LAYER_KINDS, NO_CACHE, STATE_KINDS, kv_sources
from ..state_spec import state_shape
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
    of a kind no `kv_spec` spec describes (Mamba, linear attention, convolutions: per-sequence state),
    cross-attention layers, layers that all reuse K/V no layer of the model stores (Gemma 4's
    assistants, which read their target's), a rope type not classified, no attention heads. Full,
    sliding and chunked attention (`kv_spec.LAYER_KINDS`) and Gemma 3n/4's cross-layer K/V sharing are
    served. The config alone decides, so the load check (`integrations.load_check`) asks it too, first:
    such a model is refused when it loads, with the engine's own message. `include_decoder_flag`: as
    `cross_attention_refusal`'s."""
    text = config.get_text_config(decoder=True)
    types = layer_types_of(config)
    unsupported = sorted({t for t in types if t not in LAYER_KINDS})
    if INDEXED in types and not _declares(text, "kv_lora_rank"):
        unsupported.append(INDEXED)  # the indexer's keys are kept beside latent rows only
    if _declares(text, "kv_lora_rank"):
        windowed = sorted({t for t in types if t not in (FULL, INDEXED) + STATE_KINDS + NO_CACHE})
        try:
            getattr(text, "kv_lora_rank", None)
            per_layer = False
        except Exception:  # noqa: BLE001 - a heterogeneous config refuses a global read of a per-layer value
            per_layer = True
        if FULL in types and INDEXED in types and not windowed and not per_layer:
            raise ValueError(
                f"hf_paged does not support model_type={text.model_type!r}: its multi-head latent attention mixes "
                "full_attention and indexed_attention layers, whose rows differ in width (the indexer's key), and "
                "hf_paged's latent rows are one width per model; " + _INSTEAD)
        if windowed or per_layer:
            raise ValueError(
                f"hf_paged does not support model_type={text.model_type!r}: its multi-head latent attention "
                + (f"has {windowed} layers" if windowed else "has latent shapes that differ per layer")
                + " (hf_paged's latent rows are one shape per model, over causal or indexed layers); " + _INSTEAD)
    if unsupported:
        why = "; ".join(f"its {kind} layers {_KIND_REASONS[kind]}" for kind in unsupported if kind in _KIND_REASONS)
        raise ValueError(
            f"hf_paged does not support model_type={text.model_type!r}: "
            + (why if why else f"its layer types {unsupported} are not plain attention (supported: {LAYER_KINDS})")
            + f"; {_INSTEAD}"
        )
    if any(t in STATE_KINDS for t in types):
        if not any(t in ATTENTION_KINDS + (HYBRID,) for t in types):
            raise ValueError(
                f"hf_paged does not support model_type={text.model_type!r}: it has no attention layer (every layer "
                f"is {sorted(set(types))}), so it keeps no K/V for paged blocks to hold and nothing for prefix "
                f"caching to key its state by; {_INSTEAD}")
        try:
            state_shape(_config_dict(text))
        except ValueError as exc:
            raise ValueError(f"{exc}; {_INSTEAD}") from None
    reason = cross_attention_refusal(config, include_decoder_flag)
    if reason is not None:
        raise ValueError(reason)
    try:  # every reuse layer needs an earlier layer of its type that stores the K/V it reads
        kv_sources({"num_kv_shared_layers": getattr(text, "num_kv_shared_layers", 0)}, types)
    except ValueError as exc:
        raise ValueError(f"hf_paged cannot serve model_type={text.model_type!r}: {exc}; {_INSTEAD}") from None
    check_rope_supported(config)
    if not any(_declares(text, name) for name in ("num_key_value_heads", "num_attention_heads")):
        raise ValueError(f"hf_paged does not support model_type={text.model_type!r}: its config names no attention "
                         "heads (num_attention_heads / num_key_value_heads), so it has no attention layer whose K/V "
                         f"paged blocks could hold (a recurrent model, as RWKV and xLSTM are); {_INSTEAD}")


_INSTEAD = "load the model with attn_implementation='sdpa' or 'eager' instead"

# Why a layer kind no `kv_spec` spec describes cannot be served: the refusal names the reason, not only the kind.
_KIND_REASONS = {
    "indexed_attention": "attend only to the earlier tokens a learned indexer picks for each query (sparse attention, "
                         "as DeepSeek-V3.2's) over multi-head attention without latent rows (hf_paged keeps the "
                         "indexer's keys beside an MLA layer's latent only)",
    "compressed_sparse_attention": "keep, beside a sliding window of raw K/V, compressed K/V entries (one per "
                                   "`compress_rates` tokens, 4 for these layers, 128 for heavily compressed ones) "
                                   "that a learned compressor writes from a buffer of the latest tokens, and an "
                                   "indexer over those entries (DeepSeek V4): hf_paged's specs store one row per "
                                   "token, so these need a compressed-entry spec and a buffer state per sequence",
    "heavily_compressed_attention": "keep compressed K/V entries (one per `compress_rates` tokens) written by a "
                                    "learned compressor (DeepSeek V4), which hf_paged's per-token specs do not hold",
    "hybrid_sliding": "run short convolutions over their queries, keys and values beside sliding-window attention, "
                      "keeping convolution windows whose widths differ from its other layers' (hf_paged's state spec "
                      "gives every recurrent layer of a model one shape)",
}


def _declares(config, name: str) -> bool:
    try:
        return getattr(config, name, None) is not None
    except Exception:  # noqa: BLE001 - a per-layer value (Gemma 4's KV heads) refuses a global read: it is set
        return True


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


def routes_attention(model_class, config=None) -> bool:
    """Whether a transformers model class routes its attention through transformers' attention
    interface, passing each layer's keyword arguments on to it (the step's metadata travels in them):
    what its authors declare with `_supports_attention_backend` (`PreTrainedModel.is_backend_compatible()`,
    the contract of vLLM's transformers backend, which also needs things hf_paged does not), or else
    what its modelling module's source shows (`_module_routing`: Qwen 3.5, Qwen3-Next, Jamba, Bamba,
    Falcon-H1, Nemotron-H do route without declaring it), or, for a wrapper whose module holds no
    attention, its language model's (with `config`). Otherwise the model computes attention in its
    own modules, so a registered attention function (ours) is never called, or called without the
    step's metadata."""
    if getattr(model_class, "_supports_attention_backend", False):
        return True
    routing = _module_routing(inspect.getmodule(model_class))
    if routing is None and config is not None:
        routing = _language_model_routing(config)
    return routing is not None and routing[0]


def _language_model_routing(config) -> tuple[bool, str] | None:
    """`_module_routing` of the modelling module of `config`'s language model, for a composite model whose
    own module holds no attention (MiniCPM-V 4.6 around Qwen 3.5, Nemotron-H Omni around Nemotron-H: the
    wrapper calls a language model of another family, which does the attention); None when the config has
    no separate text part or its model class is not found."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    text = config.get_text_config(decoder=True)
    name = MODEL_MAPPING_NAMES.get(getattr(text, "model_type", None)) if text is not config else None
    model_class = getattr(transformers, name, None) if isinstance(name, str) else None
    if model_class is None:
        return None
    if getattr(model_class, "_supports_attention_backend", False):
        return True, ""
    return _module_routing(inspect.getmodule(model_class))


def attention_refusal(model_class, config) -> str | None:
    """Why `attn_implementation="hf_paged"` cannot serve `model_class` (a `PreTrainedModel` subclass
    built from `config`), or None when it can. Encoder-decoders keep their dense fallback (None)."""
    if getattr(config, "is_encoder_decoder", False) or routes_attention(model_class, config):
        return None
    model_type = getattr(config, "model_type", "?")
    instead = "'sdpa' or 'eager'" if getattr(model_class, "_supports_sdpa", False) else "'eager'"
    routing = _module_routing(inspect.getmodule(model_class))
    why = routing[1] if routing is not None else (
        "the class does not declare `_supports_attention_backend`, and its module has no attention that does")
    return (
        f"attn_implementation='hf_paged' cannot serve {model_class.__name__} (model_type={model_type!r}): it does "
        f"not route attention through transformers' attention interface ({why}), so its layers would compute "
        "attention themselves, never read the paged cache and apply a mask in the wrong form, or get the paged "
        f"blocks without the step's metadata. Load it with attn_implementation={instead}"
    )


# The table transformers' attention modules look their attention function up in.
_INTERFACE = "ALL_ATTENTION_FUNCTIONS"


@functools.lru_cache(maxsize=None)
def _function_tree(function) -> ast.FunctionDef | None:
    """The parsed definition of `function` (decorators unwrapped), or None when its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _passes_on(call: ast.Call, function: ast.FunctionDef) -> bool:
    """Whether `call` hands on the `**kwargs` of `function`, the one it is made in."""
    kwarg = function.args.kwarg
    return kwarg is not None and any(k.arg is None and isinstance(k.value, ast.Name) and k.value.id == kwarg.arg
                                     for k in call.keywords)


def _mentions(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def _stores_kv(forward: ast.FunctionDef) -> bool:
    """Whether a forward stores K/V in a cache and takes back what it holds: `k, v = <cache>.update(k, v, ...)`."""
    return any(isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Attribute)
               and n.value.func.attr == "update" and len(n.value.args) >= 2
               and any(isinstance(t, ast.Tuple) and len(t.elts) >= 2 for t in n.targets) for n in ast.walk(forward))


def _interface_problem(forward: ast.FunctionDef) -> str | None:
    """Why an attention forward does not hand its work to transformers' attention interface with its
    keyword arguments, or None when it does: it calls what `ALL_ATTENTION_FUNCTIONS` gives for
    `config._attn_implementation` (directly, or through a name bound to it), passing its `**kwargs` on."""
    bound = {t.id for n in ast.walk(forward) if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None
             and _mentions(n.value, _INTERFACE)
             for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    calls = [n for n in ast.walk(forward) if isinstance(n, ast.Call)
             and ((isinstance(n.func, ast.Name) and n.func.id in bound) or _mentions(n.func, _INTERFACE))]
    if not calls:
        return "computes attention itself, never calling the interface"
    if not any(_passes_on(call, forward) for call in calls):
        return "calls the interface without passing its keyword arguments on"
    return None


@functools.lru_cache(maxsize=None)
def _module_routing(module) -> tuple[bool, str] | None:
    """Whether the modelling `module` routes every attention that reads a cache through transformers'
    attention interface, read off its source: (True, "") or (False, why); None when no class of it
    reads a cache (its decoder lives in another module, or it has no attention) or its source cannot be read.

    An attention class (its `forward` does `k, v = cache.update(k, v, ...)`) must call the interface
    function with its own `**kwargs`, and every class of the module that holds one as an attribute
    (its decoder layer) must call that attribute with its own `**kwargs`: the step's metadata reaches
    the "hf_paged" function that way. Cross-attention attributes are left out (such decoders are refused
    for their config), and so are attention layers built through a table (Nemotron-H's
    `MIXER_TYPES[kind](...)`): a paged forward still refuses blocks that arrive without the metadata."""
    name = getattr(module, "__name__", None)
    classes = {n: c for n, c in inspect.getmembers(module, inspect.isclass)
               if c.__module__ == name and issubclass(c, torch.nn.Module)}
    attention = set()
    for cls_name, cls in classes.items():
        forward = _function_tree(cls.forward)
        if forward is not None and _stores_kv(forward):
            problem = _interface_problem(forward)
            if problem is not None:
                return False, f"its {cls_name} reads the cache but {problem}"
            attention.add(cls_name)
    if not attention:
        return None
    for cls_name, cls in classes.items():
        init, forward = _function_tree(cls.__init__), _function_tree(cls.forward)
        if init is None or forward is None:
            continue
        held = {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign)
                and any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in attention
                        for c in ast.walk(n.value))
                for t in n.targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                and t.value.id == "self" and "cross" not in t.attr}
        for call in ast.walk(forward):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in held \
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == "self" \
                    and not _passes_on(call, forward):
                return False, f"its {cls_name} does not pass its keyword arguments on to its {call.func.attr}"
    return True, ""


# Reading these off the K/V a cache returned is reading its layout, not its values.
_LAYOUT_ATTRS = frozenset({"shape", "dtype", "device", "ndim"})


@functools.lru_cache(maxsize=None)
def _cached_kv_uses(attention_class) -> tuple[int, str] | None:
    """(line within its `forward`, name) of the first place an attention class uses the K/V its cache's
    `update` returned other than by handing them to an attention function, reading their shape, or
    storing them whole for a later attention call (`_kept_for_attention`: Gemma 3n/4's store layers);
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
        if isinstance(parent, ast.Call) and node is not parent.func and _calls_attention(parent):
            continue  # handed to the attention function
        if _kept_for_attention(node, parents, tree):
            continue
        uses.append((node.lineno, node.id))
    return min(uses) if uses else None


def _calls_attention(call: ast.Call) -> bool:
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return "attention" in name.lower() or "attn" in name.lower()


def _kept_for_attention(name: ast.Name, parents: dict, tree: ast.AST) -> bool:
    """Whether the K/V `name` is only stored whole into a container (`shared[key] = k, v`, or an
    attribute) that the forward reads back into names it hands to an attention function: Gemma 3n/4's
    store layers keep what `cache.update` returned for the layers that reuse it, which then attend over
    it like any other K/V. No arithmetic, no reshape, no slicing on the way."""
    holder = parents.get(name)
    if isinstance(holder, ast.Tuple):
        holder = parents.get(holder)
    if not (isinstance(holder, ast.Assign) and all(isinstance(t, (ast.Subscript, ast.Attribute))
                                                   for t in holder.targets)):
        return False
    containers = {ast.unparse(t.value if isinstance(t, ast.Subscript) else t) for t in holder.targets}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or node is holder:
            continue
        read = node.value.value if isinstance(node.value, ast.Subscript) else node.value
        if isinstance(read, (ast.Name, ast.Attribute)) and ast.unparse(read) in containers:
            names = {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if any(isinstance(c, ast.Call) and _calls_attention(c) and any(
                    isinstance(a, ast.Name) and a.id in names for a in [*c.args, *(k.value for k in c.keywords)])
                   for c in ast.walk(tree)):
                return True
    return False


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
            reason = (attention_refusal(type(module), config)
                      or cached_kv_refusal(type(module), config))
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
    """Whether the model uses multi-head latent attention (DeepSeek V2/V3/V3.2, Kimi K2, MiniCPM3; its
    config names `kv_lora_rank`).

    Such a model passes `cache.update` the compressed latent (`kv_lora_rank` wide) as K and the shared
    rotary key (`qk_rope_head_dim` wide) as V, one head each, and expands them into per-head K/V in its
    attention module (`expand_kv`). The cache keeps them as one row per token (`layer.LatentLayer`);
    paged steps attend over the rows with the up-projections absorbed (`hf.latent`), dense ones hand the
    model the gathered latents to expand as stock does.
    """
    return _declares(config.get_text_config(decoder=True), "kv_lora_rank")


def kv_head_shapes(config, tensor_parallel_size: int = 1) -> tuple[int, int, int]:
    """(num_kv_heads, head_dim, head_dim_v) of the K and V states a layer passes to `cache.update`,
    from the config alone (the cache allocates from the states themselves once it sees them); with
    `tensor_parallel_size` N, one rank's: its N-th of the KV heads (transformers' tensor parallelism
    splits the K/V projections by head).

    Raises:
        ValueError: N does not divide a layer's KV heads (`layer_specs_of`), or its layers differ in
            K/V shape (per-layer shapes: read `layer_specs_of`).
    """
    text = config.get_text_config(decoder=True)
    # (a latent-attention layer's: one shared head, latent and rotary key, whole on every rank: `kv_spec.latent_shape`)
    shapes = {spec.shape for spec in layer_specs_of(config, tensor_parallel_size) if spec.owns_kv}
    if not shapes:
        raise ValueError(f"hf_paged: no layer of model_type={text.model_type!r} stores K/V")
    if len(shapes) > 1:
        raise ValueError(f"hf_paged: the layers of model_type={text.model_type!r} differ in K/V shape "
                         f"({sorted((s.num_kv_heads, s.head_dim) for s in shapes)}); read each layer's from "
                         "layer_specs_of")
    shape = shapes.pop()
    return shape.num_kv_heads, shape.head_dim, shape.head_dim_v


def layer_specs_of(config, tensor_parallel_size: int = 1) -> tuple:
    """The text decoder's per-layer `kv_spec.LayerSpec`s (one rank's K/V shapes under
    `tensor_parallel_size`), read from the config as `kv_spec.layer_specs` reads a config.json."""
    from ..kv_spec import layer_specs

    text = config.get_text_config(decoder=True)
    return layer_specs(_config_dict(text), tensor_parallel_size)


# What `kv_spec.layer_specs` reads, by the names transformers' attributes answer to (a config's
# `attribute_map` serialises GPT-2's `n_head` as such, and `__post_init__` derives some of them).
_SPEC_FIELDS = ("layer_types", "sliding_window", "attention_chunk_size", "num_kv_shared_layers", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")


def _config_dict(text) -> dict:
    """A text config as the dict `kv_spec` reads: its serialised fields, plus what transformers only
    derives or maps (`layer_types` set in `__post_init__`, `attribute_map` names); `per_layer_config`
    is serialised as is."""
    out = text.to_dict()
    for name in _SPEC_FIELDS:
        try:
            value = getattr(text, name, None)
        except (ValueError, RuntimeError):  # a per-layer attribute of a heterogeneous config: per layer in to_dict()
            continue
        if value is not None:
            out[name] = list(value) if name == "layer_types" else value
    return out


def layer_types_of(config) -> list[str]:
    """The text decoder's per-layer attention types, as `kv_spec.layer_types` reads a config (the one
    reader: "full_attention" when the config names none, every layer sliding under a legacy
    `sliding_window`)."""
    from ..kv_spec import layer_types

    return layer_types(_config_dict(config.get_text_config(decoder=True)))


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose forward takes `input_ids`, `attention_mask` and the cache (the base model of a
    `*ForCausalLM`), or the model itself when it has no separate decoder."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if isinstance(decoder, torch.nn.Module) else model
