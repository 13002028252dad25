"""Self-speculative drafts by model surgery: the target's first layers, sharing its weights.

Builds a module tree only (on the meta device, then re-pointed at the target's own submodules);
no weights are copied and nothing runs here.
"""

from __future__ import annotations

import torch

from ..hf import decoder_of


def layer_skip_draft(model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A self-speculative draft: the target's first `num_layers` decoder layers, its final norm and
    its LM head, sharing the target's weights (no copy). Use it as `draft_model`.

    The draft shares the target's config object too, so it always runs the same attention
    implementation (transformers' decoders loop over `self.layers[: num_hidden_layers]`, which is
    simply the shorter list here). Its `PagedCache` allocates only the layers that run.

    Raises:
        ValueError: `num_layers` is not in [1, the model's layer count], or the model's decoder has no
            `layers` list to cut.
    """
    decoder = decoder_of(model)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"cannot build a layer-skip draft of {type(model).__name__}: its decoder has no `layers`")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= len(layers):
        raise ValueError(f"num_layers must be an integer in [1, {len(layers)}], got {num_layers!r}")
    with torch.device("meta"):
        draft = type(model)(model.config)
    draft_decoder = decoder_of(draft)
    for name, child in model.named_children():
        if child is not decoder:
            setattr(draft, name, child)
    for name, child in decoder.named_children():
        setattr(draft_decoder, name, torch.nn.ModuleList(list(child[:num_layers])) if name == "layers" else child)
    for name, buf in decoder.named_buffers(recurse=False):
        draft_decoder.register_buffer(name, buf, persistent=False)
    for name, buf in model.named_buffers(recurse=False):
        draft.register_buffer(name, buf, persistent=False)
    left = [n for n, p in list(draft.named_parameters()) + list(draft.named_buffers()) if p.is_meta]
    if left:
        raise ValueError(f"cannot build a layer-skip draft of {type(model).__name__}: unshared tensors {left[:3]}")
    draft.generation_config = model.generation_config
    return draft.eval()
