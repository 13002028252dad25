"""Per-family corrections for the family sweep (`family_sweep.py`), where its generic rule is not enough.

- `FAMILY_CONFIG`: config values a family needs on top of the generic shrink (its validation fails, or
  stock cannot run the shrunk config), as transformers' own model tests for that family set them.
- `FAMILY_INPUTS`: for a family whose generate needs more than token ids (an image-conditioned decoder,
  an encoder-decoder reading a page), the rows and inputs both sides get. Each row gets its own image,
  A, B, C, A, B: rows 0 and 2 share their text, not their image (nor do rows 0 and 1 their first block's).
- `FAMILY_SETUP`: what a model needs after it is built, before it runs.
- `FAMILY_TEXT_KEYS`: encoder-decoders whose encoder reads the image only: the rows are the decoder's prompt.
- `FAMILY_OWN_PAD`: families whose generate passes `pad_token_id` to an inner generate itself.
"""

from __future__ import annotations

import torch

def _images(n_rows, shape):
    """One image per row, A, B, C, A, B (rows 0 and 2 share their text, not their image)."""
    a, b, c = torch.randn(3, *shape, generator=torch.Generator().manual_seed(0))
    return torch.stack([a, b, c, a, b][:n_rows])


def _square(vision):
    size = vision.image_size
    size = size if isinstance(size, int) else size[0]
    return (getattr(vision, "num_channels", 3), size, size)


def _right_padded(rows, pad):
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for k, row in enumerate(rows):
        ids[k, :len(row)] = torch.tensor(row)
        mask[k, :len(row)] = 1
    return ids, mask


def _blip_inputs(config, rows):
    # BLIP's decoder cross-attends to the image; its prompt holds no placeholders.
    return rows, {"pixel_values": _images(len(rows), _square(config.vision_config))}


def _query_inputs(config, rows):
    # BLIP-2: num_query_tokens placeholders before the text, as its processor puts them.
    n = config.num_query_tokens
    rows = [[config.image_token_index] * n + r for r in rows]
    return rows, {"pixel_values": _images(len(rows), _square(config.vision_config))}


def _qformer_text(config, rows):
    # InstructBLIP's Q-Former reads the instruction too (in its own, BERT, vocabulary: the prompt ids
    # all lie below 400), padded on the right as its tokenizer pads.
    ids, mask = _right_padded(rows, config.qformer_config.pad_token_id or 0)
    return {"qformer_input_ids": ids, "qformer_attention_mask": mask}


def _instructblip_inputs(config, rows):
    text = _qformer_text(config, rows)
    rows, images = _query_inputs(config, rows)
    return rows, {**images, **text}


VIDEO_FRAMES = 4  # InstructBLIP-Video's processor samples 4 frames


def _instructblipvideo_inputs(config, rows):
    text = _qformer_text(config, rows)
    n = config.num_query_tokens * VIDEO_FRAMES  # each frame gets num_query_tokens placeholders
    rows = [[config.video_token_index] * n + r for r in rows]
    videos = _images(len(rows), (VIDEO_FRAMES, *_square(config.vision_config)))
    return rows, {"pixel_values": videos, **text}


def _kosmos2_inputs(config, rows):
    # Kosmos-2's processor: <s>, then latent_query_num image ids (first_image_token_id = unk + 1 = 4
    # onwards), then the text; image_embeds_position_mask marks the image ids, left-padded as the rows.
    n, first = config.latent_query_num, 4
    rows = [[config.text_config.bos_token_id, *range(first, first + n), *r] for r in rows]
    width = max(map(len, rows))
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for k, row in enumerate(rows):
        start = width - len(row) + 1
        mask[k, start:start + n] = 1
    return rows, {"pixel_values": _images(len(rows), _square(config.vision_config)),
                  "image_embeds_position_mask": mask}


def _idefics_inputs(config, rows):
    # IDEFICS reads its images through gated cross-attention only: one image per row ([batch, 1, C, H, W])
    # and image_attention_mask [batch, seq, 1] saying which tokens see it (every real token here; the
    # left padding none), as the processor sets it for text after the image.
    width = max(map(len, rows))
    seen = torch.zeros((len(rows), width, 1), dtype=torch.long)
    for k, row in enumerate(rows):
        seen[k, width - len(row):] = 1
    return rows, {"pixel_values": _images(len(rows), (1, *_square(config.vision_config))),
                  "image_attention_mask": seen}


PIX2STRUCT_GRID = 4  # a 4x4 grid of patches per image


def _pix2struct_inputs(config, rows):
    # Pix2Struct's encoder reads the image only, as flattened patches [batch, patches, 2 + patch values]:
    # each patch's row and column (1-based) before its values; the patches' own attention_mask. The rows
    # are the decoder's prompt (run_family passes them as decoder_input_ids / decoder_attention_mask:
    # FAMILY_TEXT_KEYS), each opened with the decoder start token as generate opens it.
    g = PIX2STRUCT_GRID
    rows = [[config.decoder_start_token_id, *r] for r in rows]
    values = _images(len(rows), (g * g, config.vision_config.patch_embed_hidden_size))
    index = torch.arange(g * g)
    where = torch.stack([index // g + 1, index % g + 1], -1).float().expand(len(rows), -1, -1)
    patches = torch.cat([where, values], -1)
    return rows, {"flattened_patches": patches, "attention_mask": torch.ones(patches.shape[:2], dtype=torch.long)}


def _vision_encoder_decoder_inputs(config, rows):
    # The encoder reads the image only; the rows are the decoder's prompt (FAMILY_TEXT_KEYS), each
    # opened with the decoder start token.
    rows = [[config.decoder_start_token_id, *r] for r in rows]
    return rows, {"pixel_values": _images(len(rows), _square(config.encoder))}


def _udop_inputs(config, rows):
    # UDOP's encoder reads the text with each token's box (x0, y0, x1, y1, normalised to [0, 1]; the
    # left padding none) and the page image, whose patches under a token's box add to its embedding.
    # Token k of a row sits in cell k of a 6-wide grid of the page. The decoder starts from its start
    # token: decoder_input_ids go to generate (its own default start) and to the plain forward, which
    # needs them.
    width = max(map(len, rows))
    bbox = torch.zeros((len(rows), width, 4))
    for k, row in enumerate(rows):
        for j in range(len(row)):
            x, y = (j % 6) / 6, (j // 6) / 8
            bbox[k, width - len(row) + j] = torch.tensor([x, y, x + 1 / 6, y + 1 / 8])
    start = torch.full((len(rows), 1), config.decoder_start_token_id, dtype=torch.long)
    return rows, {"bbox": bbox, "pixel_values": _images(len(rows), (config.num_channels, config.image_size,
                                                                    config.image_size)),
                  "decoder_input_ids": start}


def _t5gemma2_inputs(config, rows):
    # T5Gemma 2's encoder reads Gemma 3's image prompt before the text: <start_of_image>, mm_tokens_per_image
    # placeholders, <end_of_image>. The decoder starts from its BOS (its prepare_decoder_input_ids_from_labels
    # start): decoder_input_ids go to generate and to the plain forward, which needs them.
    enc = config.encoder
    image = [enc.boi_token_index, *[config.image_token_index] * enc.mm_tokens_per_image, enc.eoi_token_index]
    rows = [image + r for r in rows]
    start = torch.full((len(rows), 1), config.decoder.bos_token_id, dtype=torch.long)
    return rows, {"pixel_values": _images(len(rows), _square(enc.vision_config)), "decoder_input_ids": start}


# Where the generic shrink breaks a family's own config validation, or leaves a config stock cannot run,
# the values that family needs (as transformers' model tests for it set them). Keys are config fields;
# a dict for a sub-config field (text_config, vision_config, ...) corrects that sub-config the same way.
# BLIP-2 / InstructBLIP(-Video), as their model tests: 10 query tokens, 30px images of 2px patches, and the
# OPT decoder's word_embed_proj_dim (768 by default, which the shrink misses) at the tiny width, so the
# projected query outputs fit the embeddings they replace.
_QUERY = {"num_query_tokens": 10, "vision_config": {"image_size": 30, "patch_size": 2},
          "text_config": {"word_embed_proj_dim": 32}}


# Length-dependent rope as the released checkpoints of these families use it (Phi-3/3.5 128k, Phi-4-mini,
# PhiMoE): longrope with its threshold (`family_sweep.ROPE_THRESHOLD`) inside the sweep's prompts, so that
# generation crosses it. Head dim 8: four rotary pairs.
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0], "long_factor": [2.0, 5.0, 11.0, 23.0],
             "rope_theta": 10000.0}
# Gemma 4 as its releases run it: KV sharing (the last 2 of 6 layers reuse the K/V of layers 2 and 3) and
# per-layer K/V shapes (full layers: head_dim 16 and 1 KV head, keys doubling as values, as
# global_head_dim / num_global_key_value_heads with attention_k_eq_v give them; sliding layers: 8 and 2).
# per_layer_config stands for global_head_dim: the shrink keeps the default's (512 wide) otherwise.
_GEMMA4_TEXT = {"num_hidden_layers": 6, "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 16,
                "layer_types": ["sliding_attention", "full_attention"] * 3, "attention_k_eq_v": True,
                "per_layer_config": {i: {"head_dim": 16, "num_key_value_heads": 1} for i in (1, 3, 5)}}
FAMILY_CONFIG: dict[str, dict] = {
    "phi3": {"rope_parameters": _LONGROPE, "max_position_embeddings": 4096},
    "phimoe": {"rope_parameters": {**_LONGROPE, "short_mscale": 1.0, "long_mscale": 1.2},
               "max_position_embeddings": 4096},
    "phi4_multimodal": {"rope_parameters": _LONGROPE, "max_position_embeddings": 4096},
    # vision-language models: the vision (or adapter) output width is the tiny text width; multimodal rope
    # sections sum to the tiny head_dim / 2 rotary pairs (h and w equal where the rope stacks them)
    "apertus1p5": {"text_config": {"vocab_size": 80, "pad_token_id": 0},
                   "vision_config": {"codebook_size": 20, "base_channels": 32, "channel_multiplier": [1, 2, 1],
                                     "num_res_blocks": 2, "embed_dim": 16, "latent_channels": 16, "resolution": 16},
                   "audio_config": {"num_filters": 8, "upsampling_ratios": [2, 2], "codebook_dim": 32,
                                    "codebook_size": 12},
                   # the image and audio codes' id ranges follow each other inside the vocabulary
                   "image_token_id": 3, "audio_token_id": 4, "image_token_offset": 40, "audio_token_offset": 60},
    "cohere_compass": {"text_config": {"rope_parameters": {"full_attention": {
                           "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}}},
                       "vision_config": {"out_hidden_size": 32, "deepstack_visual_indexes": [0]}},
    "dots3_note": {"text_config": {"head_dim": 16, "per_layer_config": {"1": {
                       "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8}}},
                   "vision_config": {"adapter_in_dim": 32, "adapter_out_dim": 32},
                   "audio_config": {"adapter_input_size": 32, "adapter_out_dim": 32}},
    "granite_docling": {"vision_config": {"out_hidden_size": 32, "deepstack_visual_indexes": [0]}},
    "llava_onevision1_5": {"vision_config": {"out_hidden_size": 32}},
    # Pixtral towers default to 1540px images: 12k patches and a 3k-token prompt per image (17 s a family);
    # 56px (4x4 patches of 14, merged 2x2) keeps every path and takes well under a second.
    "mistral3": {"vision_config": {"image_size": 56}},
    "mistral_large4": {"vision_config": {"image_size": 56}},
    "lighton_ocr": {"vision_config": {"image_size": 56}},
    "inkling2": {"text_config": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 8,
                                 "sliding_window_size": 8},
                 "vision_config": {"text_hidden_size": 32}},
    "inkling2_loop": {"text_config": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 8,
                                      "sliding_window_size": 8, "n_layers_per_attn_res_block": 1,
                                      "loop_layer_index_start": 1, "loop_layer_index_end": 2, "loop_num_passes": 2,
                                      "loop_gate_rank": 8},
                      "vision_config": {"text_hidden_size": 32}},
    "molmo2": {"adapter_config": {"vision_feature_layer": [1], "text_hidden_size": 32}},
    "muse_spark": {"out_hidden_size": 128, "projector_hidden_size": 32, "text_config": {"moe_hidden_size": 32},
                   "audio_config": {"hidden_sizes": [16, 32], "out_hidden_size": 32}},
    # image-token models: a codebook of 8 codes, every code in the vocabulary map
    "chameleon": {"vocabulary_map": {"<image>": 8711, **{f"IMGIMG{c}Z": 4 + i for i, c in enumerate("ABCDEFGH")}},
                  "vq_config": {"num_embeddings": 8, "latent_channels": 32, "base_channels": 32,
                                "channel_multiplier": [1, 2]}},
    "emu3": {"vocabulary_map": {"<image>": 151646, "<|extra_200|>": 151851,
                                **{f"<|visual token {i:06d}|>": 151854 + i for i in range(8)}},
             "vq_config": {"codebook_size": 8, "base_channels": 32, "channel_multiplier": [1, 2, 1]}},
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense", "sparse"]}},
    "ernie4_5_vl_moe": {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0,
                                                            "mrope_section": [1, 1, 2]},
                                        "moe_intermediate_size": [32, 32]}},
    "glm4v_moe": {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5, "mrope_section": [1, 1]}},
                  "vision_config": {"out_hidden_size": 32}},
    # a diffusion decoder: a canvas of 8 positions, a small vocabulary with its image ids inside
    "diffusion_gemma": {"text_config": {"top_k_experts": 2, "vocab_size": 1024, "per_layer_config": {"1": {"head_dim": 16}}},
                        "canvas_length": 8, "image_token_id": 1000, "boi_token_id": 1001, "eoi_token_id": 1002},
    # BLIP's vision tower initialises with initializer_range=1e-10 (its default): every image then embeds
    # alike (row 0 and row 2 logits equal to the last bit); its model tests' 30px images of 2px patches.
    "blip": {"vision_config": {"image_size": 30, "patch_size": 2, "initializer_range": 0.02}},
    "blip-2": {**_QUERY, "image_token_index": 4},
    "instructblip": {**_QUERY, "image_token_index": 4},
    "instructblipvideo": {**_QUERY, "video_token_index": 4},
    # alpha_initializer="ones" (its model test's): the default "zeros" closes every cross-attention gate,
    # so the images would change nothing.
    "idefics": {"alpha_initializer": "ones", "vision_config": {"image_size": 30, "patch_size": 2}},
    # patch_embed_hidden_size: the values of one 2x2 RGB patch (its model test's 12, not 16x16x3).
    "pix2struct": {"vision_config": {"patch_embed_hidden_size": 12}},
    # ViT encoder + BERT decoder (with cross-attention) by default; BERT has no BOS: the decoder starts
    # from its pad id, as the model test's generate check and training test set it.
    "vision-encoder-decoder": {"decoder_start_token_id": 0, "pad_token_id": 0,
                               "encoder": {"image_size": 30, "patch_size": 2}},
    # UDOP: the decoder start token its model test sets (T5's pad id); a 32px page of 8px patches.
    "udop": {"decoder_start_token_id": 0, "image_size": 32, "patch_size": 8},
    # T5Gemma 2: its model test's image ids (image / boi / eoi 4 / 5 / 6), 4 placeholders per image (SigLIP's
    # 14x14 patches of its default 224px image pooled 2x2). No vision_config override: tiny_config's last
    # loop merges an override one level deep only, so a nested {"encoder": {"vision_config": {...}}}
    # would replace the whole shrunk SigLIP config by the override's few keys (a 768-wide, 92M-parameter tower).
    "t5gemma2": {"image_token_index": 4,
                 "encoder": {"mm_tokens_per_image": 4, "boi_token_index": 5, "eoi_token_index": 6}},
    # Kosmos-2's text config names its depth and heads `layers` / `attention_heads` (the shrink misses them).
    "kosmos-2": {"latent_query_num": 3, "text_config": {"layers": 2, "attention_heads": 4},
                 "vision_config": {"image_size": 30, "patch_size": 2}},
    # hybrids: one recurrent (mamba, linear attention, conv) and one attention layer each, with the sizes their
    # configs derived from the full width (passed back by the shrink) made consistent with the tiny one
    "bamba": {"mamba_n_heads": 16, "mamba_d_head": 4, "mamba_d_state": 16, "mamba_chunk_size": 16,
              "attn_layer_indices": [1]},
    "granitemoehybrid": {"mamba_n_heads": 16, "mamba_d_head": 4, "mamba_d_state": 16, "mamba_chunk_size": 16,
                         "layer_types": ["linear_attention", "full_attention"]},
    "jamba": {"attn_layer_offset": 1},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "lru_width": 32},
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
              "attention_hidden_size": 64, "mamba_dt_rank": 2},  # the shared block's tying needs two hybrids
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"], "hybrid_layer_ids": [1],
               "attention_hidden_size": 64, "mamba_headdim": 8},
    "mamba2": {"num_heads": 8},  # num_heads * head_dim = expand * hidden_size
    "rwkv": {"attention_hidden_size": 32},
    "xlstm": {"hidden_size": 128, "embedding_dim": 128, "num_blocks": 2},  # its q/k/v widths round up to 64s
    "bailing_hybrid": {"linear_head_dim": 8, "linear_num_heads": 4},
    "kimi_linear": {"linear_head_dim": 16, "linear_num_heads": 4},
    "lfm2_moe": {"layer_types": ["full_attention", "conv"], "num_dense_layers": 1},
    # LFM2's default config has every layer attend (full_attn_idxs: all): a conv layer too, as its releases have
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "lfm2_vl": {"text_config": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]}},
    # a sliding layer and an indexer (sparse, indexed attention): the index and K/V-source layouts of two layers;
    # head_dim 16 for its NVFP4 rounding of keys and values, an indexer head per query head of a key head (4 / 2)
    "kolibri1_1": {"layer_types": ["sliding_attention", "indexed_attention"], "index_layers": [1], "head_dim": 16, "index_num_heads": 2,
                   "kv_source_layers": [0, 1]},
    # an input, a recurrent (run per loop) and an output layer
    "dory": {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
             "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1},
    "hrm_text": {"num_layers_per_stack": 2, "num_hidden_layers": 16},  # 2 per stack x 2 H-cycles x (3 L-cycles + 1)
    # BLT has no top-level depth (stock's cache is sized by it); its hash vocabulary (500002 x 6) is the model's bulk
    "blt": {"num_hidden_layers": 2, "encoder_hash_byte_group_vocab": 64, "decoder_config": {"hidden_size_global": 32}},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # DbrxAttention reads attn_config.rope_theta, no field of its config; clip_qkv=None fails in stock's clamp
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8}},
    # the sliding layer's own sizes (per_layer_config, renumbered): head_dim = qk_nope + qk_rope
    "dots3_note_text": {"head_dim": 16, "per_layer_config": {"1": {"num_attention_heads": 4, "num_key_value_heads": 4,
                                                                   "kv_lora_rank": 16, "qk_nope_head_dim": 8}}},
    # KV sharing: 6 layers, the last 2 reuse the K/V of the last earlier layer of their type (layers 2 and 3,
    # not the first producers 0 and 1)
    "gemma3n_text": {"num_hidden_layers": 6, "num_kv_shared_layers": 2, "intermediate_size": 64,
                     "layer_types": ["sliding_attention", "full_attention"] * 3,
                     "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0, 0.0, 0.0],
                     "hidden_size_per_layer_input": 16},
    "gemma4_text": _GEMMA4_TEXT,
    "gemma4": {"text_config": _GEMMA4_TEXT},
    "gemma4_unified_text": _GEMMA4_TEXT,
    "gemma4_unified": {"text_config": _GEMMA4_TEXT},
    "musicgen": {"decoder": {"decoder_start_token_id": 2048}},
    "musicgen_melody": {"decoder": {"decoder_start_token_id": 2048}},
    # the indexed-attention layers' indexer sizes have no default
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 4,
                       "indexer_compress_ratio": 2},
    "qwen4_exp": {"text_config": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8,
                                  "indexer_budget": 4, "indexer_compress_ratio": 2, "linear_key_head_dim": 16,
                                  "linear_value_head_dim": 16, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
                                  "hc_count": 2, "hc_lowrank": 8},
                  "vision_config": {"out_hidden_size": 32}},
    # the LM head needs a decoder; the axial position dims sum to the width
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [16, 16]},
    "xlnet": {"d_head": 8},  # d_model // n_head
    "xmod": {"is_decoder": True, "default_language": "en_XX"},
    # the Q-Former has vision width // 64 heads; downsampling and deepstack have no default
    "granite4_vision": {"vision_config": {"hidden_size": 64, "image_size": 8, "patch_size": 2},
                        "downsample_rate": "1/2", "deepstack_layer_map": [[1, 0]], "image_grid_pinpoints": [[8, 8]]},
    "mistral4": {"head_dim": 16},  # qk_nope + qk_rope, as its config derives when head_dim is unset
    # the rotary class's default sections [16, 24, 24], scaled to head_dim 8
    "paddleocr_vl": {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0,
                                                         "mrope_section": [1, 2, 1]}}},
    "pp_formulanet": {"vision_config": {"image_size": 128, "window_size": 4, "mlp_dim": 64, "output_channels": 16,
                                        "post_conv_in_channels": 16, "post_conv_mid_channels": 16,
                                        "post_conv_out_channels": 16, "decoder_hidden_size": 32}},
    # the thinkers' rope index reads vision_start_token_id, which their configs do not declare (release value)
    "qwen2_5_omni_thinker": {"vision_start_token_id": 151652, "vision_config": {"out_hidden_size": 32},
                             "audio_config": {"output_dim": 32}},
    "qwen3_omni_moe_thinker": {"vision_start_token_id": 151652, "audio_config": {"output_dim": 32},
                               "vision_config": {"out_hidden_size": 32, "deepstack_visual_indexes": [1]}},
    # stock always builds a sliding mask; a sliding and a sparse (MoE) layer, as the release has
    "step3p7": {"text_config": {"sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"],
                                "num_sliding_attention_heads": 4, "mlp_layer_types": ["dense", "sparse"],
                                "share_expert_dim": 32}},
    # Mamba-2 mixers under their own size names: 128 heads of a 256- (128-) wide state, padded to 256- (128-)
    # token scan chunks, took 143 s (27 s) a family on the torch path; 8 heads of 16 and 64-token chunks keep
    # every path (groups, the conv window, one chunk holding each row and its new tokens).
    "falcon_h1": {"mamba_d_ssm": 64, "mamba_n_heads": 8, "mamba_d_state": 16, "mamba_chunk_size": 64},
    "nemotron_h": {"mamba_num_heads": 8, "mamba_head_dim": 8, "ssm_state_size": 16, "chunk_size": 64,
                   "moe_shared_expert_intermediate_size": 32},
    # refused at load (attention outside the interface): a 1664-wide output embedding over 250k ids took 22 s
    "rembert": {"input_embedding_size": 32, "output_embedding_size": 32},
}


# Families whose generate needs more than token ids (an image for an image-conditioned decoder): per model
# type, `(config, rows) -> (rows, kwargs)`, the rows (placeholders added) and the inputs both sides get in
# the generate and forward checks. Rows 0 and 2 keep their equal text and get different images, so a
# prefix cache that ignored the images would show.
FAMILY_INPUTS: dict = {
    "blip": _blip_inputs,
    "blip-2": _query_inputs,
    "instructblip": _instructblip_inputs,
    "instructblipvideo": _instructblipvideo_inputs,
    "kosmos-2": _kosmos2_inputs,
    "idefics": _idefics_inputs,
    "pix2struct": _pix2struct_inputs,
    "vision-encoder-decoder": _vision_encoder_decoder_inputs,
    "udop": _udop_inputs,
    "t5gemma2": _t5gemma2_inputs,
    # a MusicGen prompt is one row per codebook, all of one length (cut from the longest row)
    "musicgen": lambda config, rows: ([max(rows, key=len)[i:i + 12] for i in range(config.num_codebooks)], {}),
    "musicgen_melody": lambda config, rows: ([max(rows, key=len)[i:i + 12] for i in range(config.num_codebooks)],
                                             {}),
    "pp_formulanet": lambda config, rows: (rows, {"pixel_values": _images(len(rows), _square(config.vision_config))}),
}

def _t5gemma2_setup(model):
    # T5Gemma 2 initialises its image projection (Gemma 3's mm_input_projection_weight) to zeros: every
    # image would reach the encoder as zeros. A checkpoint's is trained; here it gets the model's own
    # initializer_range, drawn from a fixed seed (both sides get the same: the hf_paged one loads stock's
    # weights anyway).
    g = torch.Generator().manual_seed(0)
    for module in model.modules():
        weight = getattr(module, "mm_input_projection_weight", None)
        if isinstance(weight, torch.nn.Parameter):
            with torch.no_grad():
                weight.copy_(torch.randn(weight.shape, generator=g) * model.config.initializer_range)


# What a family's model needs after it is built, before it runs.
FAMILY_SETUP: dict = {
    "t5gemma2": _t5gemma2_setup,
    # MusicGen's own generate skips the global generation defaults (transformers 5.24), num_return_sequences too
    "musicgen": lambda model: setattr(model.generation_config, "num_return_sequences", 1),
    "musicgen_melody": lambda model: setattr(model.generation_config, "num_return_sequences", 1),
}


FAMILY_TEXT_KEYS: dict[str, tuple[str, str]] = {
    "pix2struct": ("decoder_input_ids", "decoder_attention_mask"),
    "vision-encoder-decoder": ("decoder_input_ids", "decoder_attention_mask"),
}

FAMILY_OWN_PAD: set[str] = {"blip"}

# The families the sweep cannot run, each for a reason outside hf_paged (the test checks that exactly these come
# out "untested", so one that becomes runnable, or a new one that cannot run, is noticed).
_TIMM = ("its vision tower is a timm model (transformers' TimmWrapper): timm needs torchvision, whose CPU wheel "
         "the test install cannot take from the package index here without pulling a CUDA torch")
_DRAFT = ("a draft model of a Gemma 4 target: every layer reads the target's K/V (its forward needs the target's "
          "shared K/V states), so it generates only as the target's `assistant_model=`")
NOT_COVERED: dict[str, str] = {
    "gemma3n": _TIMM + "; its text model (gemma3n_text) is covered",
    "fast_vlm": _TIMM,
    "perception_lm": _TIMM,
    "gemma4_assistant": _DRAFT,
    "gemma4_unified_assistant": _DRAFT,
    "pi0": "an action model: its class does not generate",
    "pi05": "an action model: its class does not generate",
}
