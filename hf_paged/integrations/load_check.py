"""Refusing at load a model that `attn_implementation="hf_paged"` cannot serve.

transformers resolves a model's attention implementation in `PreTrainedModel.__init__`
(`get_correct_attn_implementation`), before the model builds its layers, and again in
`set_attn_implementation`. This wraps that method: when it resolves to "hf_paged" for a class that
generates and does not route attention through transformers' attention interface
(`hf.support.attention_refusal`), `from_pretrained` / `from_config` raise one ValueError that names
the class and what to use instead. Without it such a model either fails deep inside its own layers
(`KeyError: 'hf_paged'` from Falcon's, GPT-Neo's or GIT's attention-class tables) or, worse, loads and
attends wrongly (MPT, Bloom, XGLM, GPT-NeoX-Japanese compute attention themselves and read our mask
in the wrong form). A decoder with cross-attention layers (Mllama, Idefics), whose image K/V would
land in the paged cache, is refused the same way (`hf.support.cross_attention_refusal`). Sub-models
that do not generate (vision towers, encoder stacks) are left alone: they never read the paged
cache. Reversible (`uninstall`), like the generate patch.
"""

from __future__ import annotations

import functools

from transformers import PreTrainedModel

from ..attention import ATTN_IMPLEMENTATION
from ..hf.support import attention_refusal, cross_attention_refusal

_original = None


def install() -> None:
    """Wrap `PreTrainedModel.get_correct_attn_implementation` (idempotent)."""
    global _original
    if _original is not None:
        return
    original = PreTrainedModel.get_correct_attn_implementation
    _original = original

    @functools.wraps(original)
    def get_correct_attn_implementation(self, requested_attention, is_init_check=False):
        applicable = original(self, requested_attention, is_init_check)
        if applicable == ATTN_IMPLEMENTATION and type(self).can_generate():
            reason = (attention_refusal(type(self), self.config)
                      or cross_attention_refusal(self.config, include_decoder_flag=False))
            if reason is not None:
                raise ValueError(reason)
        return applicable

    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation


def uninstall() -> None:
    global _original
    if _original is not None:
        PreTrainedModel.get_correct_attn_implementation = _original
        _original = None
