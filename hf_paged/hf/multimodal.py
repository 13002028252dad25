"""Images through the engine: one request's pixel inputs, split per image, encoded once per content
digest, and placed at the request's image placeholders.

    multi_modal_data {"pixel_values": [num_images, ...], "image_sizes": [num_images, 2], ...}
      -> ImageSupport.split  -> [ImageItem(digest, inputs of one image)]
      -> ImageEncoder.encode -> [features [n_i, hidden]]      (cached by digest; missing ones in one call)
      -> place               -> ImageFeatures(positions, features [sum n_i, hidden])
                                  + the block-hash spans (start, end, digests) of the request's sequence

The model's own encoder does the work: transformers' `get_image_features` (the function stock
`generate` calls before prefill in `_prepare_multimodal_encoder_kwargs_for_generation`), with the
call's keyword arguments its signature names. Its `pooler_output` holds one entry per image, whose
length is that image's placeholder count: the same contract transformers uses to split a batch's
images per row (`_expand_multimodal_outputs`). The runner embeds the chunk's ids and writes the
features at the placeholder positions, as the model's forward does with `masked_scatter`.

Served: decoders whose image placeholders are plain causal positions (LLaVA, LLaVA-NeXT, Mistral 3,
InternVL, ...), and Qwen2-VL / Qwen2.5-VL's 3-D rope positions (M-RoPE): each request's positions come
from the model's own `get_rope_index` when its images are placed, and a generated token at 1-D
position p sits at p + the request's rope delta on every axis, as stock's decode steps compute.
Images given as patches (`pixel_values` of [sum of patches, ...] beside `image_grid_thw`) are split by
each image's grid. Gemma 3's image placeholders attend to each other both ways (the token-type mask its
modelling module builds with `get_block_sequence_ids_for_mask`): each run of placeholders is one
block, which the scheduler never splits across chunks and whose queries see keys up to the block's
end (`ImageFeatures.key_limits`, the step's `StepMetadata.key_limits`). Refused with a reason
(callers fall back to stock `generate`): other token-type masks (PaliGemma's prefix), encoders whose
output is not one entry per image, and extra per-layer features (Qwen3-VL's deepstack).
"""

from __future__ import annotations

import bisect
import hashlib
import inspect
from collections import OrderedDict
from dataclasses import dataclass

import torch

# Forward keywords that mean the decoder's mask or positions depend on the images beyond their ids
# (the M-RoPE ones are served when the model computes its positions with `get_rope_index`).
_MASK_KEYWORDS = ("token_type_ids",)
_MROPE_KEYWORDS = ("mm_token_type_ids", "image_grid_thw", "rope_deltas")
_DEEPSTACK_KEYWORDS = ("visual_pos_masks", "deepstack_visual_embeds")
# Keyword arguments of `get_image_features` that are settings, not per-image inputs.
_SETTING_PREFIXES = ("vision_feature", "return_dict", "output_")


def image_token_id(config) -> int | None:
    """The id of the image placeholder token (`image_token_id`, or `image_token_index` in older configs)."""
    for key in ("image_token_id", "image_token_index"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


@dataclass(frozen=True)
class ImageItem:
    """One image's encoder inputs (each tensor with a leading dimension of 1) and their content digest."""

    digest: str
    inputs: dict


@dataclass
class ImageFeatures:
    """Where a request's image features go: the sorted prompt positions of its placeholders and one
    feature row per position, in that order."""

    positions: list[int]
    features: torch.Tensor  # [len(positions), hidden]
    mrope: torch.Tensor | None = None  # [3, prompt length] M-RoPE positions of the prompt (Qwen-VL)
    mrope_delta: int = 0  # a later token at 1-D position p sits at p + mrope_delta on every axis
    blocks: tuple[tuple[int, int], ...] = ()  # (start, end) of placeholder runs attended both ways (Gemma 3)

    def key_limits(self, start: int, end: int) -> list[int] | None:
        """For positions [start, end): the last key position each may see (itself, or the end of its
        bidirectional image block); None when none of them is in a block."""
        limits, touched = list(range(start, end)), False
        for s, e in self.blocks:
            for p in range(max(s, start), min(e, end)):
                limits[p - start] = e - 1
                touched = True
        return limits if touched else None

    def rope_positions(self, start: int, end: int) -> torch.Tensor:  # [3, end - start]
        """M-RoPE positions of 1-D positions [start, end): the prompt's own, then shifted by the delta."""
        prompt = self.mrope.shape[1]
        parts = []
        if start < prompt:
            parts.append(self.mrope[:, start:min(end, prompt)])
        if end > prompt:
            later = torch.arange(max(start, prompt), end) + self.mrope_delta
            parts.append(later.expand(3, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def rows_in(self, start: int, end: int) -> tuple[list[int], torch.Tensor]:
        """The placeholder positions in [start, end), as offsets from `start`, and their feature rows."""
        lo = bisect.bisect_left(self.positions, start)
        hi = bisect.bisect_left(self.positions, end)
        return [p - start for p in self.positions[lo:hi]], self.features[lo:hi]


class ImageSupport:
    """What the engine needs to serve a model's images, or why it cannot (`reason`)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.token_id = image_token_id(model.config)
        base = getattr(model, "base_model", model)
        self.encoder = getattr(base, "get_image_features", None)
        rope_index = getattr(base, "get_rope_index", None)
        rope_params = set(inspect.signature(rope_index).parameters) if rope_index is not None else set()
        # M-RoPE the engine can place: positions from the ids' modality types and the images' grids.
        self.rope_index = rope_index if {"input_ids", "mm_token_type_ids", "image_grid_thw"} <= rope_params else None
        # Image blocks attended both ways, as the model's own module defines its token-type mask (Gemma 3).
        module = inspect.getmodule(type(base))
        self.is_bidirectional = hasattr(module, "get_block_sequence_ids_for_mask")
        self.reason = self._reason(model)
        params = inspect.signature(self.encoder).parameters if self.encoder is not None else {}
        self.input_names = tuple(name for name in params if name not in ("self", "kwargs")
                                 and not name.startswith(_SETTING_PREFIXES))

    def _reason(self, model) -> str | None:
        if self.encoder is None or "image" not in getattr(model, "input_modalities", ("text",)):
            return f"{type(model).__name__} takes no images"
        if self.token_id is None:
            return "its config names no image placeholder token (image_token_id)"
        base = getattr(model, "base_model", model)
        if self.rope_index is None and hasattr(base, "get_rope_index"):
            return "its 3-D rope positions (get_rope_index) take inputs the engine does not build"
        forward = set(inspect.signature(model.forward).parameters)
        text_model = getattr(base, "language_model", None)
        text_forward = set(inspect.signature(text_model.forward).parameters) if text_model is not None else set()
        if text_forward & set(_DEEPSTACK_KEYWORDS):
            return "its decoder layers take image features of their own (deepstack), which the engine does not place"
        special = sorted(forward & ((set() if self.is_bidirectional else set(_MASK_KEYWORDS))
                                    | (set() if self.rope_index else set(_MROPE_KEYWORDS))))
        if special:
            return f"its forward takes {', '.join(special)}: its attention or positions depend on more than the ids"
        if "pixel_values" not in inspect.signature(self.encoder).parameters:
            return "its image encoder does not take pixel_values"
        return None

    @property
    def is_supported(self) -> bool:
        return self.reason is None

    def check(self) -> None:
        if self.reason is not None:
            raise ValueError(f"hf_paged: the engine cannot serve images for this model: {self.reason}; "
                             "call stock generate with attn_implementation='sdpa' or 'eager' for these inputs")

    def split(self, data: dict) -> list[ImageItem]:
        """One request's image inputs (a processor's output for one prompt: `pixel_values` of
        [num_images, ...] and per-image tensors beside it) as one `ImageItem` per image; a list of
        `ImageItem`s is returned as it is.

        Raises:
            ValueError/TypeError: naming the input that is missing, unknown or mis-shaped."""
        self.check()
        if isinstance(data, list) and data and all(isinstance(item, ImageItem) for item in data):
            return list(data)  # split (and digested) already: drop-in `generate` splits a batch's images per row
        if not isinstance(data, dict):
            raise TypeError(f"multi_modal_data must be a dict of tensors, got {type(data).__name__}")
        unknown = sorted(set(data) - set(self.input_names))
        if unknown:
            raise ValueError(f"multi_modal_data has {unknown}, which this model's image encoder does not take "
                             f"(it takes {list(self.input_names)})")
        pixels = data.get("pixel_values")
        if not torch.is_tensor(pixels) or pixels.dim() < 2:
            raise ValueError("multi_modal_data needs pixel_values, a tensor of [num_images, ...]")
        if not pixels.is_floating_point():
            raise TypeError(f"pixel_values must be floating point, got {pixels.dtype}")
        grid = data.get("image_grid_thw")
        if grid is not None:  # patches of every image in one tensor: image i has prod(grid[i]) rows
            if not torch.is_tensor(grid) or grid.dim() != 2 or grid.shape[1] != 3 or grid.is_floating_point() \
                    or bool((grid <= 0).any()):
                raise ValueError("multi_modal_data['image_grid_thw'] must be positive integers of [num_images, 3]")
            patches = grid.prod(-1).tolist()
            if sum(patches) != pixels.shape[0]:
                raise ValueError(f"pixel_values has {pixels.shape[0]} patches but image_grid_thw describes "
                                 f"{sum(patches)}")
            num = grid.shape[0]
            bounds = [0]
            for n in patches:
                bounds.append(bounds[-1] + n)
        else:
            num = pixels.shape[0]
            bounds = list(range(num + 1))
        for name, value in data.items():
            if value is None or value is pixels:
                continue
            if not torch.is_tensor(value) or value.dim() == 0 or value.shape[0] != num:
                raise ValueError(f"multi_modal_data[{name!r}] must be a tensor with one entry per image "
                                 f"({num}), got {getattr(value, 'shape', type(value).__name__)}")
        items = []
        for i in range(num):
            inputs = {name: value[i:i + 1] for name, value in data.items() if value is not None and value is not pixels}
            inputs["pixel_values"] = pixels[bounds[i]:bounds[i + 1]]
            items.append(ImageItem(_digest(inputs), inputs))
        return items

    def placeholder_positions(self, token_ids: list[int]) -> list[int]:
        """Positions of the image placeholders among `token_ids`."""
        return [i for i, t in enumerate(token_ids) if t == self.token_id]


def merge_items(items: list[ImageItem]) -> dict:
    """The `multi_modal_data` of these images (each input concatenated in order): `split` undoes it."""
    return {name: torch.cat([item.inputs[name] for item in items]) for name in items[0].inputs}


def _digest(inputs: dict) -> str:
    """Content digest of one image's inputs (names, dtypes, shapes and bytes)."""
    h = hashlib.sha256()
    for name in sorted(inputs):
        t = inputs[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class ImageEncoder:
    """Runs the model's image encoder, at most once per distinct image while its features stay cached
    (least recently used ones go first beyond `capacity_bytes`).

    Counters: `num_encoded` (images the encoder ran on), `num_hits` (images served from the cache)."""

    def __init__(self, support: ImageSupport, capacity_bytes: int = 256 << 20):
        self.support = support
        self.capacity_bytes = capacity_bytes
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.num_encoded = 0
        self.num_hits = 0
        self.num_calls = 0

    def __contains__(self, digest: str) -> bool:
        return digest in self._cache

    def encode(self, items: list[ImageItem]) -> list[torch.Tensor]:
        """Features [n_i, hidden] per item. Missing images of the same input shapes go through the
        encoder in one call (duplicates once). Raises what the encoder raises, or ValueError when its
        output is not one entry per image; nothing is cached then for that call."""
        missing: dict[str, ImageItem] = {}
        for item in items:
            if item.digest in self._cache:
                self._cache.move_to_end(item.digest)
            else:
                missing.setdefault(item.digest, item)
        groups: dict[tuple, list[ImageItem]] = {}
        for item in missing.values():
            key = tuple((name, tuple(v.shape[1:]) if name == "pixel_values" and "image_grid_thw" in item.inputs
                         else tuple(v.shape), v.dtype) for name, v in sorted(item.inputs.items()))
            groups.setdefault(key, []).append(item)  # patch images of any size share a call
        fresh: dict[str, torch.Tensor] = {}
        for group in groups.values():
            fresh.update(zip((i.digest for i in group), self._run(group)))
        out = []
        for item in items:
            features = fresh.get(item.digest)
            if features is None:
                features = self._cache[item.digest]
                self.num_hits += 1
            out.append(features)
        for digest, features in fresh.items():
            self._store(digest, features)
        self.num_encoded += len(fresh)
        return out

    def _run(self, group: list[ImageItem]) -> list[torch.Tensor]:
        model = self.support.model
        device = next(model.parameters()).device
        inputs = {name: torch.cat([item.inputs[name] for item in group]).to(device) for name in group[0].inputs}
        pixels = inputs["pixel_values"]
        dtype = next(model.parameters()).dtype
        if pixels.is_floating_point() and pixels.dtype != dtype:
            inputs["pixel_values"] = pixels.to(dtype)  # stock's processors hand the model its own dtype
        with torch.inference_mode():
            out = self.support.encoder(**inputs, return_dict=True)
        self.num_calls += 1
        if getattr(out, "deepstack_features", None) is not None:
            raise ValueError("hf_paged: this model's image encoder returns per-layer (deepstack) features, "
                             "which the engine does not place yet")
        pooled = getattr(out, "pooler_output", out)
        if torch.is_tensor(pooled) and pooled.dim() == 2 and len(group) == 1:
            pooled = [pooled]
        if pooled is None or len(pooled) != len(group):
            raise ValueError(f"hf_paged: the image encoder returned {0 if pooled is None else len(pooled)} "
                             f"entries for {len(group)} images; the engine needs one per image")
        hidden = self.support.model.config.get_text_config(decoder=True).hidden_size
        return [f.reshape(-1, hidden) for f in pooled]

    def _store(self, digest: str, features: torch.Tensor) -> None:
        size = features.numel() * features.element_size()
        if size > self.capacity_bytes:
            return
        self._cache[digest] = features
        self._bytes += size
        while self._bytes > self.capacity_bytes:
            _, old = self._cache.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()

    def clear(self) -> None:
        self._cache.clear()
        self._bytes = 0


def place(support: ImageSupport, token_ids: list[int], items: list[ImageItem],
          features: list[torch.Tensor]) -> tuple[ImageFeatures, tuple]:
    """The request's `ImageFeatures` and its block-hash spans: image i's features fill the next
    `len(features[i])` placeholders, in order (as the model's `masked_scatter` does); its span runs
    from its first placeholder to its last.

    Raises:
        ValueError: the placeholders and the images' features do not match in number."""
    positions = support.placeholder_positions(token_ids)
    counts = [f.shape[0] for f in features]
    if sum(counts) != len(positions):
        raise ValueError(f"the prompt has {len(positions)} image placeholder tokens (id {support.token_id}) but its "
                         f"{len(items)} image(s) give {sum(counts)} feature rows ({counts}); the prompt must hold "
                         "each image's placeholders, as the model's processor writes them")
    spans, at = [], 0
    for item, n in zip(items, counts):
        if n:
            spans.append((positions[at], positions[at + n - 1] + 1, item.digest))
        at += n
    stacked = torch.cat(features) if features else torch.empty(0)
    placed = ImageFeatures(positions, stacked)
    if support.is_bidirectional:
        blocks = []
        for p in positions:
            if blocks and blocks[-1][1] == p:
                blocks[-1][1] = p + 1
            else:
                blocks.append([p, p + 1])
        placed.blocks = tuple((s, e) for s, e in blocks)
    if support.rope_index is not None:
        ids = torch.tensor([token_ids])
        types = (ids == support.token_id).int()
        grid = torch.cat([item.inputs["image_grid_thw"] for item in items])
        with torch.inference_mode():
            rope, delta = support.rope_index(input_ids=ids, mm_token_type_ids=types, image_grid_thw=grid)
        if rope.shape != (3, 1, len(token_ids)):
            raise ValueError(f"hf_paged: get_rope_index returned positions of {tuple(rope.shape)} for a prompt of "
                             f"{len(token_ids)} tokens")
        placed.mrope, placed.mrope_delta = rope[:, 0].cpu(), int(delta.reshape(-1)[0])
    return placed, tuple(spans)
