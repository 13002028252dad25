"""Tiny random-weight models of each supported architecture, built from configs (no downloads)."""

from __future__ import annotations

import inspect

import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama import LlamaModel
from transformers.models.deepseek_v2 import DeepseekV2Config
from transformers.models.deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v32 import DeepseekV32Config
from transformers.models.gemma2 import Gemma2Config
from transformers.models.gemma3 import Gemma3TextConfig
from transformers.models.gpt_oss import GptOssConfig
from transformers.models.llama import LlamaConfig, LlamaForCausalLM
from transformers.models.mistral import MistralConfig
from transformers.models.phi3 import Phi3Config
from transformers.models.qwen2 import Qwen2Config
from transformers.models.qwen3 import Qwen3Config
from transformers.models.qwen3_5 import Qwen3_5TextConfig

VOCAB = 256
# Small windows so that sequences of a few dozen tokens really slide.
_COMMON = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=96, num_hidden_layers=3,
               num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0,
               bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=11),
    "qwen2": lambda: Qwen2Config(**{**_COMMON, "num_key_value_heads": 3}, use_sliding_window=True,
                                 sliding_window=9, max_window_layers=1,
                                 layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=16),
    "gemma2": lambda: Gemma2Config(**_COMMON, head_dim=16, sliding_window=7, attn_logit_softcapping=5.0,
                                   final_logit_softcapping=30.0, query_pre_attn_scalar=16),
    "gemma3": lambda: Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=7, query_pre_attn_scalar=16,
                                       layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    "phi3": lambda: Phi3Config(**{**_COMMON, "num_key_value_heads": 6}, sliding_window=13),
    # Gated delta-rule layers (a per-sequence state, `hf.state`) around one full-attention layer.
    "qwen3_5": lambda: Qwen3_5TextConfig(**_COMMON, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                         linear_key_head_dim=16, linear_value_head_dim=16,
                                         layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "gpt_oss": lambda: GptOssConfig(**{**_COMMON, "head_dim": 16}, num_local_experts=4, num_experts_per_tok=2,
                                    sliding_window=8, layer_types=["sliding_attention", "full_attention",
                                                                   "sliding_attention"]),
}

# transformers 5.24 renamed the cache argument from `past_key_values` to `cache`; the supported range
# spans both, so tests pass and read caches through these two helpers.
CACHE_KEY = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def with_cache(cache) -> dict:
    """Keyword arguments passing `cache` to a model forward or to `generate`."""
    return {CACHE_KEY: cache}


def cache_of(output):
    """The cache a model output or a `generate` output (return_dict_in_generate=True) holds."""
    return getattr(output, CACHE_KEY)


# What stock transformers compares against: sdpa, or eager where sdpa lacks a feature.
STOCK_ATTN = {"gemma2": "eager", "gpt_oss": "eager"}


def tiny_model(arch: str, attn_implementation: str = "sdpa", seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    config = CONFIGS[arch]()
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    return model.eval()


def stock_greedy(arch: str, prompts: list[list[int]], **gen_kwargs) -> list[list[int]]:
    """Stock `generate` (sdpa, or eager where sdpa lacks a feature) on each prompt alone: the new
    token ids, the oracle of the engine's parity tests."""
    model = tiny_model(arch, STOCK_ATTN.get(arch, "sdpa"))
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **gen_kwargs)
        outs.append(out[0, len(p):].tolist())
    return outs


def left_padded_batch(lengths: list[int], seed: int = 0):
    """Random prompts of the given lengths, left-padded like a tokenizer with padding_side='left'."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        input_ids[row, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        attention_mask[row, width - n:] = 1
    return input_ids, attention_mask


# Multi-head latent attention (DeepSeek-V2/V3). Kept out of CONFIGS: their attention expands the
# cached latents inside the module, so the paged kernels and the Engine cannot serve them (see
# hf_paged.hf.support.has_latent_kv), and CONFIGS is what the all-architecture paged tests run.
# The cache holds a 16-wide latent as K and an 8-wide rotary key as V (one head each); the
# expanded per-head K is 8 + 8 wide and V 12. One dense layer, then one small MoE layer.
_MLA_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                   qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1,
                   n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=512,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

MLA_CONFIGS = {
    "deepseek_v2": lambda: DeepseekV2Config(**_MLA_COMMON, q_lora_rank=None),
    "deepseek_v3": lambda: DeepseekV3Config(**_MLA_COMMON, q_lora_rank=24, n_group=2, topk_group=1),
    # Indexed sparse attention: each query reads its top 8 keys, fewer than a 20-90-token prompt holds. 16
    # indexer heads: a key scores exactly 0 (a top-k tie) only if all 16 heads' relu scores are 0.
    "deepseek_v32": lambda: DeepseekV32Config(**_MLA_COMMON, q_lora_rank=24, n_group=2, topk_group=1, index_topk=8,
                                              index_n_heads=16, index_head_dim=16),
}


def tiny_mla_model(arch: str, attn_implementation: str = "sdpa", seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(MLA_CONFIGS[arch](), attn_implementation=attn_implementation,
                                             dtype=dtype)
    return model.eval()


class CharTokenizer:
    """Token t decodes to one letter: enough to test stop strings and streamed text without a vocabulary."""

    eos_token_id = 2

    def __call__(self, text):
        return {"input_ids": [3 + (ord(c) - 97) % 26 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + (t - 3) % 26) for t in ids)


def tiny_paged_llama():
    """A picklable model factory (module level): the tiny Llama with the hf_paged attention, for
    engines that build their model in other processes."""
    return tiny_model("llama", "hf_paged")


# ---------------------------------------------------------------------------------- vision-language
IMAGE_TOKEN = VOCAB - 1  # the placeholder id of the tiny VLMs (never drawn for text by the tests)


def _vlm_config(model_type: str):
    from transformers import CLIPVisionConfig, LlavaConfig, Mistral3Config, PixtralVisionConfig

    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    text = dict(_COMMON, num_hidden_layers=2)
    if model_type == "llava":  # 16 placeholders per 32x32 image (CLS dropped)
        return LlavaConfig(vision_config=CLIPVisionConfig(**vision, projection_dim=32), text_config=LlamaConfig(**text),
                           image_token_id=IMAGE_TOKEN, vision_feature_layer=-1,
                           vision_feature_select_strategy="default")
    if model_type == "mistral3":  # (height / 16) * (width / 16) placeholders per image: sizes vary
        return Mistral3Config(vision_config=PixtralVisionConfig(**vision, head_dim=8), text_config=MistralConfig(**text),
                              image_token_index=IMAGE_TOKEN, spatial_merge_size=2, vision_feature_layer=-1)
    raise KeyError(model_type)


def tiny_vlm(model_type: str, attn_implementation: str = "sdpa", seed: int = 0):
    """A tiny vision-language model (`llava`, `mistral3`) with random weights; the same seed gives the
    same weights whatever the attention."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(_vlm_config(model_type),
                                                   attn_implementation=attn_implementation).eval()


def tiny_images(num: int, size: int = 32, seed: int = 0) -> torch.Tensor:
    """`num` different images, [num, 3, size, size]."""
    return torch.randn(num, 3, size, size, generator=torch.Generator().manual_seed(seed))


# A chat template for the tiny processor: each image part becomes "<image>", which the processor expands.
_VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}w4 {% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<image> {% else %}{{ p.text }} {% endif %}{% endfor %}"
    "{% endif %} w3 {% endfor %}{% if add_generation_prompt %}w4 {% endif %}"
)


def tiny_llava_processor():
    """A `LlavaProcessor` for `tiny_vlm("llava")`: a word-level tokenizer ("w<id>" is id <id>, "<image>" the
    placeholder), 32x32 images (16 placeholders each), and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 1)}
    vocab["<image>"] = IMAGE_TOKEN
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="w1", eos_token="w2", pad_token="w0",
                                        unk_token="w3", extra_special_tokens={"image_token": "<image>"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8, num_additional_image_tokens=1,
                          vision_feature_select_strategy="default", chat_template=_VLM_CHAT_TEMPLATE)


def tiny_qwen2_vl(attn_implementation: str = "sdpa", seed: int = 0):
    """A tiny Qwen2-VL (3-D rope positions): images of 14-pixel patches, 2x2 merged (grid [1, h, w]
    gives h * w / 4 placeholders)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(_COMMON, num_hidden_layers=2, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                                "rope_theta": 10000.0})
    config = Qwen2VLConfig(text_config=text, vision_config=dict(depth=2, embed_dim=32, hidden_size=96, num_heads=4,
                                                                mlp_ratio=2, spatial_merge_size=2, patch_size=14,
                                                                temporal_patch_size=2, in_channels=3),
                           image_token_id=IMAGE_TOKEN, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3,
                           vision_end_token_id=VOCAB - 4)
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration._from_config(config, attn_implementation=attn_implementation).eval()


def qwen2_vl_image(grid_h: int, grid_w: int, seed: int = 0) -> dict:
    """One image's processor outputs for `tiny_qwen2_vl`: patches and their grid."""
    pixels = torch.randn(grid_h * grid_w, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(seed))
    return {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, grid_h, grid_w]])}


def tiny_gemma3_vlm(attn_implementation: str = "eager", seed: int = 0):
    """A tiny Gemma 3 vision-language model: 32x32 images (SigLIP, 8-pixel patches): 16 placeholders each,
    which attend to each other both ways (its token-type mask); sliding and full layers."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = Gemma3TextConfig(**dict(_COMMON, num_hidden_layers=2), head_dim=16, sliding_window=7,
                            query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"])
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                image_size=32, patch_size=8)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16, image_token_index=IMAGE_TOKEN,
                          boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 4)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration._from_config(config, attn_implementation=attn_implementation).eval()
    with torch.no_grad():  # its projection starts at zero: every image would look the same
        weight = model.model.multi_modal_projector.mm_input_projection_weight
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed)) * 0.5)
    return model


def save_tiny_llama_folder(path):
    """A tiny random Llama (seeded) over the default model's tokenizer, which has a chat template,
    saved to `path` as a model folder users would pass on the command line. Returns `path`."""
    from hf_paged.defaults.models import load_default_tokenizer

    tokenizer = load_default_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_paged_mla():
    """The tiny DeepSeek V3 (latent attention) on "hf_paged": a picklable factory for engine workers."""
    return tiny_mla_model("deepseek_v3", "hf_paged")


def bias_up_projections(*models, span: float = 0.1) -> None:
    """Give every latent-attention kv_b_proj of `models` the same bias (linspace over +-span): its weight alone
    is then no longer the up-projection, so absorbed attention must refuse it."""
    for model in models:
        for module in model.modules():
            if hasattr(module, "kv_b_proj"):
                proj = module.kv_b_proj
                biased = torch.nn.Linear(proj.in_features, proj.out_features, bias=True)
                with torch.no_grad():
                    biased.weight.copy_(proj.weight)
                    biased.bias.copy_(torch.linspace(-span, span, proj.out_features))
                module.kv_b_proj = biased
