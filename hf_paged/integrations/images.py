"""Images in the drop-in `generate`: which keywords of a call are a vision-language model's image inputs
the engine can place (`hf.multimodal.ImageSupport`), how the batch's images split per row (as
transformers splits them: by each image's placeholder count, which the engine's encoder gives), and
the image inputs a `ReturnedCache` hands back to the model when it turns dense."""

from __future__ import annotations

import torch

from ..hf.multimodal import ImageSupport, merge_items


def row_prompts(support: ImageSupport, engine, rows: list[list[int]], image_data: dict) -> tuple[list, list]:
    """Per row, what the engine is given (its tokens, or the vLLM-style dict whose `multi_modal_data`
    holds that row's images, split and digested once here) and that row's `ImageItem`s (None: text only).

    Raises:
        ValueError: the rows' placeholders and the images' feature rows do not match (stock's message)."""
    items = support.split(image_data)
    counts = engine.image_token_counts(items)
    token_id = engine.image_token_id
    prompts, row_images, at = [], [], 0
    for row in rows:
        need, first = row.count(token_id), at
        while need > 0 and at < len(counts):
            need -= counts[at]
            at += 1
        if need:
            raise ValueError(f"Image features and image tokens do not match: a row has {row.count(token_id)} "
                             f"image tokens, its images give {row.count(token_id) - need} features")
        mine = items[first:at] or None
        prompts.append({"prompt_token_ids": row, "multi_modal_data": mine} if mine else row)
        row_images.append(mine)
    if at != len(counts):
        raise ValueError(f"Image features and image tokens do not match: {len(counts)} images for "
                         f"{at} images' placeholders")
    return prompts, row_images


def image_side_inputs(support: ImageSupport | None, kwargs: dict, input_ids) -> set[str] | str:
    """The keywords beside the images that the engine derives itself from the ids: Qwen-VL's modality
    types (`mm_token_type_ids`), Gemma 3's token types (`token_type_ids`, which turn its images'
    attention bidirectional in stock, and only when given), or why stock must serve the call."""
    if support is None:
        return set()
    if support.rope_index is not None:
        return {"mm_token_type_ids"}
    if support.is_bidirectional:
        types = kwargs.get("token_type_ids")
        if not torch.is_tensor(input_ids) or not torch.is_tensor(types) or types.shape != input_ids.shape \
                or not torch.equal(types.bool(), input_ids == support.token_id):
            # Without them stock attends causally over the images; other types mean something else.
            return "images with token_type_ids absent or not the images'"
        return {"token_type_ids"}
    return set()


def expanded_images(row_images: list, n: int) -> dict | None:
    """The image inputs of stock's expanded batch (each row's n samples, each with the row's images)."""
    items = [item for mine in row_images if mine for _ in range(n) for item in mine]
    return merge_items(items) if items else None


def image_data_of(model, kwargs: dict) -> tuple[dict, ImageSupport] | tuple[None, None] | str:
    """The call's image inputs and the model's `ImageSupport`, when the engine can place its images
    (`hf.multimodal`); (None, None) without images; or why only stock can serve them."""
    if kwargs.get("pixel_values") is None:
        return None, None
    support = ImageSupport(model)
    if not support.is_supported:
        return f"images ({support.reason})"
    data = {k: v for k, v in kwargs.items() if k in support.input_names and v is not None}
    grid = data.get("image_grid_thw")  # patches of all images in one tensor, beside each image's grid
    num = grid.shape[0] if torch.is_tensor(grid) and grid.dim() == 2 else data["pixel_values"].shape[0]
    if not all(torch.is_tensor(v) and v.dim() > 0 and (v.shape[0] == num or k == "pixel_values")
               for k, v in data.items()):
        return "image inputs without one entry per image (stock checks them)"
    return data, support
