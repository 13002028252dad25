"""Per-forward planning: a forward pre-hook that turns a padded batch into one `StepMetadata`.

transformers gives a cache layer only K/V, never the padding mask, so the plan is made where both are
visible: just before the decoder's forward, from its `input_ids`, `attention_mask` and `cache`. The
hook then passes the plan down as the `paged_metadata` kwarg, which transformers forwards to every
attention call (`TransformersKwargs`). `generate` attaches models automatically.

Owns the hook only: the cache adapter plans the step (`PagedCache.plan_step`); this module decides when,
and whether the paged or the dense attention path runs.
"""

from __future__ import annotations

import hashlib
import inspect

import torch

from ..attention.metadata import DENSE, PAGED
from .cache import PagedCache
from .latent import install_latent, latent_refusal
from .latent import is_installed as latent_installed
from .padding import is_left_padded
from .support import check_attention_routed, check_model_supported, decoder_of
from .weights import weights_fingerprint

_HOOK_ATTR = "_hf_paged_plan_hook"


def attach(model: torch.nn.Module) -> torch.nn.Module:
    """Make forwards of `model` with a `PagedCache` plan their step (padding-aware, prefix-cached).

    Idempotent. `generate` calls it for you; call it yourself only to drive forwards by hand with
    `model(input_ids, attention_mask=..., cache=PagedCache(model.config))`. Without it a `PagedCache`
    still gives correct results, but stores padding and uses the dense attention path.

    Raises:
        ValueError: the model type cannot use a paged cache (encoder-decoder, recurrent layers...), or
            its attention does not go through transformers' attention interface.
    """
    check_model_supported(model.config)
    check_attention_routed(model)
    if latent_refusal(model) is None:
        install_latent(model)  # paged steps read latent rows absorbed, indexers select per sequence; else dense
    decoder = decoder_of(model)
    if getattr(decoder, _HOOK_ATTR, None) is None:
        params = list(inspect.signature(decoder.forward).parameters)
        hook = decoder.register_forward_pre_hook(_make_plan_hook(model, params), with_kwargs=True)
        setattr(decoder, _HOOK_ATTR, hook)
    return model


def detach(model: torch.nn.Module) -> None:
    """Remove the hook `attach` installed (no-op if none)."""
    decoder = decoder_of(model)
    hook = getattr(decoder, _HOOK_ATTR, None)
    if hook is not None:
        hook.remove()
        setattr(decoder, _HOOK_ATTR, None)


def _make_plan_hook(model: torch.nn.Module, param_names: list[str]):
    def plan_hook(module, args, kwargs):
        named = dict(zip(param_names, args))
        get = lambda name: kwargs.get(name, named.get(name))  # noqa: E731
        cache = get("cache")
        if cache is None:
            cache = get("past_key_values")
        if not isinstance(cache, PagedCache) or kwargs.get("paged_metadata") is not None:
            return None  # not ours, or already planned (the Engine plans its own steps)
        input_ids, inputs_embeds = get("input_ids"), get("inputs_embeds")
        reference = input_ids if input_ids is not None else inputs_embeds
        if reference is None:
            return None
        attention_mask = get("attention_mask")
        padding_known = attention_mask is None or (torch.is_tensor(attention_mask) and attention_mask.dim() == 2)
        if padding_known and not cache.stores_padding and not cache.seqs and not is_left_padded(
                attention_mask, 0, [False] * reference.shape[0], reference.shape[1]):
            # Right padding (stock warns and generates): store every column, padding included, and
            # let the model's own mask hide it on the dense path. Never hashed: a token's K/V depend on
            # which columns its row attends, not on the ids alone.
            cache.stores_padding = True
        if cache.stores_padding:
            padding_known = False  # every column is stored
        mode = PAGED if model.config._attn_implementation == "hf_paged" and padding_known else DENSE
        if mode == PAGED and cache.has_latent_kv and not (cache.kv.latent_rows and latent_installed(model)
                                                          and latent_refusal(model) is None):
            # latent attention that cannot be absorbed (`hf.latent`; a kv_b_proj replaced since it was
            # installed: a LoRA adapter, a bias), or quantised latents: the module expands them itself
            mode = DENSE
        if not cache.seqs and cache.kv.default_quant is not None:
            cache.kv.use_checkpoint_kv_scales(model)  # layers not yet written take a checkpoint's k/v scales
        if cache.cache_config.enable_prefix_caching and not cache.seqs:
            # New sequences are about to be hashed: make sure no prefix computed under other weights
            # can be hit. (Live sequences keep their salt, which new ones never share.)
            cache.kv.note_weights(weights_fingerprint(model))
        row_keys = None
        if input_ids is not None and inputs_embeds is None and not cache.seqs:
            row_keys = multimodal_row_keys({**named, **kwargs}, input_ids)
            if get("position_ids") is None and torch.is_tensor(attention_mask) and attention_mask.dim() == 2:
                row_keys = padding_row_keys(attention_mask, row_keys)
        meta = cache.plan_step(
            row_keys=row_keys,
            batch_size=reference.shape[0],
            q_len=reference.shape[1],
            mode=mode,
            device=reference.device,
            dtype=model.dtype,
            input_ids=input_ids if inputs_embeds is None and not cache.stores_padding else None,
            attention_mask=attention_mask if padding_known else None,
        )
        if mode == PAGED:
            kwargs["paged_metadata"] = meta
        return args, kwargs

    return plan_hook


# Keyword names of non-text inputs a decoder may take beside its ids (Chameleon's `pixel_values`, a
# precomputed `mm_encoder_outputs`, audio features, grids...).
_MULTIMODAL_NAMES = ("pixel", "image", "video", "audio", "vision", "mm_", "input_features")


def multimodal_row_keys(inputs: dict, input_ids: torch.Tensor) -> list[bytes] | None:
    """Salts for the rows of a decoder call whose ids are not all of its input: None when the call
    carries no non-text input, else one digest per row.

    A decoder that takes image placeholders among its ids and the images beside them (Chameleon)
    computes K/V that depend on the images, which the ids do not name: two rows with the same
    placeholders but different images must never share a block. Which image feeds which row is the
    model's own business, so the salt is conservative: a digest of every non-text input and every id
    of the call, and the row's index. A block is then reused only by the same row of the same call
    made again (its images, and the ids that place them, all equal)."""
    tensors = []
    for name in sorted(inputs):
        if any(part in name for part in _MULTIMODAL_NAMES):
            _collect_tensors(inputs[name], tensors)
    if not tensors:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for t in [input_ids, *tensors]:
        t = t.detach().contiguous()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b"")
    call = digest.digest()
    return [call + row.to_bytes(4, "little") for row in range(input_ids.shape[0])]


def padding_row_keys(attention_mask: torch.Tensor, row_keys: list | None) -> list:
    """`row_keys` (or none) salted with each row's left padding, for a first forward that passes no
    `position_ids`: the model positions its tokens itself (Whisper's and Marian's decoders count from
    the first column, padding included, as stock does), so a token's K/V depend on how much padding
    precedes its row, which its ids do not name. Rows then share a block only at the same offset."""
    pads = (attention_mask.cumsum(-1) == 0).sum(-1).tolist()  # [batch]: padding columns before the first token
    keys = row_keys if row_keys is not None else [b""] * len(pads)
    return [key + b"pad" + int(n).to_bytes(4, "little") for key, n in zip(keys, pads)]


def _collect_tensors(value, out: list) -> None:
    if torch.is_tensor(value):
        out.append(value)
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            _collect_tensors(value[key], out)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect_tensors(item, out)
    elif hasattr(value, "to_tuple"):  # a ModelOutput (precomputed encoder outputs)
        _collect_tensors(value.to_tuple(), out)
