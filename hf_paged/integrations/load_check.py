"""Refusing at load a model that `attn_implementation="hf_paged"` cannot serve.

transformers resolves a model's attention implementation in `PreTrainedModel.__init__`
(`get_correct_attn_implementation`), before the model builds its layers, and again in
`set_attn_implementation`. This wraps that method: when it resolves to "hf_paged" for a class that
generates, it first asks what the engine asks of the config alone (`hf.support.check_decoder_supported`:
linear-attention and Mamba layers, layers that all reuse another model's K/V), with the engine's
message, which names the layer kind; such a model used to load and be refused only by its first
`generate`. Then a class that does not route attention through transformers' attention interface
(`hf.support.attention_refusal`: read off its modules' source where the class does not declare it)
makes `from_pretrained` / `from_config` raise one ValueError that names the class and what to use
instead. A module whose attention-class table has no "hf_paged" key (a vision encoder's, inside a
model that otherwise routes its attention) is refused the same way, by the loaders. Without these,
such a model either fails deep inside its own layers (`KeyError: 'hf_paged'` from GPT-Neo's or GIT's
attention-class tables, Falcon's before 5.25) or, worse, loads and attends wrongly (MPT, Bloom, XGLM,
GPT-NeoX-Japanese compute attention themselves and read our mask in the wrong form). A decoder with
cross-attention layers (Mllama, Idefics), whose image K/V would land in the paged cache, is refused
the same way (`hf.support.cross_attention_refusal`), and so is one whose attention computes with the
K/V its cache returns before its attention function (`hf.support.cached_kv_refusal`: Doge's
values-made mask, DiffLlama's split values, JetMoe). Sub-models that do not generate (vision towers,
encoder stacks) are left alone: they never read the paged cache. Reversible (`uninstall`), like the
generate patch.
"""

from __future__ import annotations

import functools

from transformers import PreTrainedModel

from ..attention import ATTN_IMPLEMENTATION
from ..hf.mixers import state_refusal
from ..hf.support import attention_refusal, cached_kv_refusal, check_decoder_supported, cross_attention_refusal

_original = None
_original_loaders: dict[str, classmethod] = {}
_LOADERS = ("_from_config", "from_pretrained")


def install() -> None:
    """Wrap `PreTrainedModel.get_correct_attn_implementation` and the two loaders (idempotent)."""
    global _original
    if _original is not None:
        return
    original = PreTrainedModel.get_correct_attn_implementation
    _original = original
    for name in _LOADERS:
        _original_loaders[name] = PreTrainedModel.__dict__[name]
        setattr(PreTrainedModel, name, classmethod(_refusing_class_tables(_original_loaders[name].__func__)))

    @functools.wraps(original)
    def get_correct_attn_implementation(self, requested_attention, is_init_check=False):
        applicable = original(self, requested_attention, is_init_check)
        if applicable == ATTN_IMPLEMENTATION and type(self).can_generate():
            # The config first, as the engine asks: a Mamba or linear-attention layer is refused for its
            # kind, whatever its attention modules do.
            if not getattr(self.config, "is_encoder_decoder", False):  # an encoder-decoder keeps the dense fallback
                reason = state_refusal(type(self), self.config)  # before the config's: the exact reason
                if reason is not None:
                    raise ValueError(reason)
                _check_decoder(self.config)
            reason = (attention_refusal(type(self), self.config)
                      or cross_attention_refusal(self.config, include_decoder_flag=False)
                      or cached_kv_refusal(type(self), self.config))
            if reason is not None:
                raise ValueError(reason)
        return applicable

    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation


def _check_decoder(config) -> None:
    """`check_decoder_supported` at load: its ValueError, and nothing else. A decoder inside an
    encoder-decoder (which keeps the dense fallback, and its own `add_cross_attention`) may have a
    config these questions cannot read; the engine asks them again, and says why, if it ever serves it."""
    try:
        check_decoder_supported(config, include_decoder_flag=False)
    except ValueError:
        raise
    except Exception:  # noqa: BLE001 - a config this check cannot read: no refusal from here
        pass


def _refusing_class_tables(load):
    """`load` (a loader's function), turning the `KeyError: 'hf_paged'` of a module that looks its
    attention class up in its own table (Falcon's, GPT-Neo's, a SAM vision encoder's) into one
    ValueError that names the class and what to use instead."""

    @functools.wraps(load)
    def loader(cls, *args, **kwargs):
        try:
            return load(cls, *args, **kwargs)
        except KeyError as exc:
            if exc.args != (ATTN_IMPLEMENTATION,):
                raise
            raise ValueError(
                f"attn_implementation='hf_paged' cannot serve {cls.__name__}: one of its modules picks its attention "
                "class from a table of its own, which has no 'hf_paged' entry (it does not use transformers' "
                "attention interface); load it with attn_implementation='sdpa' or 'eager'"
            ) from exc

    return loader


def uninstall() -> None:
    global _original
    if _original is not None:
        PreTrainedModel.get_correct_attn_implementation = _original
        _original = None
    for name, loader in _original_loaders.items():
        setattr(PreTrainedModel, name, loader)
    _original_loaders.clear()
