"""Prefix caching never shares K/V between rows whose ids are equal but whose non-text inputs differ.

Chameleon's decoder takes the image placeholders among its `input_ids` and the images beside them
(`pixel_values`), so the ids the cache hashes do not name the images. Before the multimodal salt, a
batch of two rows with the same text and placeholders but different images returned row 0's answer
for row 1: row 1 reused row 0's first blocks, image positions included.
"""

from __future__ import annotations

import torch
from transformers import ChameleonConfig, ChameleonForConditionalGeneration

import hf_paged  # noqa: F401 - registers "hf_paged"
from hf_paged import PagedCache

IMAGE_TOKEN = 4
CODES = 16  # the VQ codebook; image code c is BPE id 100 + c


def tiny_chameleon_config() -> ChameleonConfig:
    """A 2-layer Chameleon whose 16x16 images become 64 image tokens (a VQ-VAE downsampling by 2)."""
    digits = "ABCDEFGHIJ"  # Chameleon names image code 12 "IMGIMGBCZ"
    names = {"<image>": IMAGE_TOKEN}
    for code in range(CODES):
        names["IMGIMG" + "".join(digits[int(d)] for d in str(code)) + "Z"] = 100 + code
    vq = dict(embed_dim=8, num_embeddings=CODES, resolution=16, base_channels=32, channel_multiplier=[1, 2],
              num_res_blocks=1, latent_channels=8, attn_resolutions=[], double_latent=False, in_channels=3,
              out_channels=3)
    return ChameleonConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vq_config=vq, vocabulary_map=names,
                           image_token_id=IMAGE_TOKEN, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _models():
    torch.manual_seed(0)  # a config each: `_from_config` keeps the config object, attention choice included
    stock = ChameleonForConditionalGeneration._from_config(tiny_chameleon_config(), attn_implementation="sdpa").eval()
    paged = ChameleonForConditionalGeneration._from_config(tiny_chameleon_config(),
                                                           attn_implementation="hf_paged").eval()
    paged.load_state_dict(stock.state_dict())
    return stock, paged


def test_chameleon_rows_with_the_same_placeholders_and_different_images_match_stock():
    stock, paged = _models()
    row = [1, 5, 6] + [IMAGE_TOKEN] * 64 + [7, 8, 9]  # 70 ids: four full blocks, image positions in each
    ids = torch.tensor([row, row, row])
    first, second = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    pixels = torch.stack([first, second, first])  # rows 0 and 2: the same image
    kwargs = dict(attention_mask=torch.ones_like(ids), pixel_values=pixels, max_new_tokens=6, min_new_tokens=6,
                  do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = stock.generate(ids, **kwargs)
        got = paged.generate(ids, **kwargs)
    assert want[0, -6:].tolist() != want[1, -6:].tolist()  # the images really change the answer
    assert got.tolist() == want.tolist()


def test_a_forward_with_images_salts_each_row_and_shares_no_block():
    stock, paged = _models()
    ids = torch.tensor([[1, 5, 6] + [IMAGE_TOKEN] * 64 + [7, 8, 9]] * 2)
    cache = PagedCache(paged.config)
    hf_paged.attach(paged)
    with torch.no_grad():
        paged(ids, attention_mask=torch.ones_like(ids), pixel_values=torch.randn(2, 3, 16, 16), cache=cache)
    assert cache.stats()["num_shared_blocks"] == 0
    assert cache.stats()["prefix_cache_hits"] == 0


def test_multimodal_row_keys():
    from hf_paged.hf.planning import multimodal_row_keys

    ids = torch.tensor([[1, 2, 3], [1, 2, 3]])
    assert multimodal_row_keys({"attention_mask": torch.ones(2, 3)}, ids) is None  # text only: no salt
    pixels = torch.randn(2, 3, 4, 4)
    keys = multimodal_row_keys({"pixel_values": pixels}, ids)
    assert len(keys) == 2 and keys[0] != keys[1]  # rows of one call never share
    assert keys == multimodal_row_keys({"pixel_values": pixels.clone()}, ids)  # the same call again: the same
    assert keys[0] != multimodal_row_keys({"pixel_values": pixels + 1}, ids)[0]  # other images: other salts
    assert keys[0] != multimodal_row_keys({"pixel_values": pixels}, ids + 1)[0]  # other ids: other salts
    nested = {"mm_encoder_outputs": {"image": (pixels,)}}
    assert multimodal_row_keys(nested, ids) is not None
    half = multimodal_row_keys({"pixel_values": pixels.to(torch.bfloat16)}, ids)
    assert half is not None and half[0] != keys[0]
