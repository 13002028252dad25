"""Bad input gets a clear error that names the problem, before any state changes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, MambaConfig, T5Config

import hf_paged
from hf_paged import NoFreeBlocksError, PagedCache, PagedCacheConfig
from hf_paged.attention import dispatch
from hf_paged.attention.metadata import PAGED
from tiny_models import with_cache, left_padded_batch, tiny_model


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_size=0), "block_size must be a positive integer"),
        (dict(block_size=-16), "block_size must be a positive integer"),
        (dict(block_size=2.5), "block_size must be a positive integer"),
        (dict(num_blocks=0), "num_blocks must be a positive integer"),
        (dict(max_kv_bytes=0), "max_kv_bytes must be a positive integer"),
        (dict(num_blocks=8, max_kv_bytes=1 << 20), "either num_blocks"),
        (dict(kv_cache_dtype="float12"), "unknown kv_cache_dtype 'float12'"),
        (dict(kv_cache_dtype="fp8 "), "unknown kv_cache_dtype 'fp8 '; expected one of auto, float32"),
        (dict(kv_cache_dtype="float8_e4m3fn"), "unknown kv_cache_dtype"),
        (dict(kv_quant_scheme="per_block"), "unknown kv_quant_scheme 'per_block'"),
        (dict(kv_cache_dtype="fp8", kv_quant_scheme="asymmetric"), "'asymmetric' is for kv_cache_dtype='int8'"),
        (dict(kv_cache_dtype="int8", kv_quant_scheme="unit"), "'unit' .* is for fp8 caches"),
    ],
)
def test_bad_config_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PagedCacheConfig(**kwargs)


def test_cache_rejects_config_and_overrides_together():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="either cache_config or keyword overrides"):
        PagedCache(model.config, PagedCacheConfig(), block_size=8)


def test_num_blocks_too_small_for_one_sequence():
    model = tiny_model("llama", "hf_paged")
    model.hf_paged_cache_config = PagedCacheConfig(block_size=4, num_blocks=3)  # 12 tokens
    input_ids, attention_mask = left_padded_batch([8])
    with pytest.raises(ValueError, match=r"num_blocks=3 with block_size=4 holds 12 tokens.*max_length=18"):
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False)


def test_prompt_that_cannot_fit_the_pool():
    model = tiny_model("llama", "hf_paged")
    hf_paged.attach(model)
    cache = PagedCache(model.config, block_size=4, num_blocks=5)
    input_ids, attention_mask = left_padded_batch([30])
    with pytest.raises(ValueError, match="a sequence of 30 tokens needs 8 blocks.*at most 5"):
        model(input_ids, attention_mask=attention_mask, **with_cache(cache))
    assert cache.pool.num_used_blocks == 0 and not cache.seqs  # nothing was allocated


def test_prompt_that_exceeds_the_memory_budget():
    model = tiny_model("llama", "hf_paged")
    hf_paged.attach(model)
    cache = PagedCache(model.config, block_size=4, max_kv_bytes=4 * PagedCache(model.config, block_size=4)
                       .bytes_per_block(torch.float32))
    input_ids, attention_mask = left_padded_batch([30])
    with pytest.raises(ValueError, match="max_kv_bytes"):
        model(input_ids, attention_mask=attention_mask, **with_cache(cache))


def test_full_pool_raises_no_free_blocks_and_keeps_state():
    """Each sequence fits alone but the batch does not: the engine's preemption signal."""
    model = tiny_model("llama", "hf_paged")
    hf_paged.attach(model)
    cache = PagedCache(model.config, block_size=4, num_blocks=6)
    input_ids, attention_mask = left_padded_batch([12, 13])
    with pytest.raises(NoFreeBlocksError, match="KV pool is full: this step needs 7 free blocks"):
        model(input_ids, attention_mask=attention_mask, **with_cache(cache))
    assert cache.pool.num_used_blocks == 0 and not cache.seqs
    cache.pool.check_invariants()


def test_unsupported_model_types():
    t5 = AutoModelForSeq2SeqLM.from_config(T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1,
                                                    num_heads=2, d_kv=16))
    with pytest.raises(ValueError, match="encoder-decoder"):
        hf_paged.attach(t5)
    with pytest.raises(ValueError, match="model_type='mamba'.*linear_attention"):
        PagedCache(MambaConfig(num_hidden_layers=2))


def test_padding_after_stored_tokens_is_rejected():
    """A right-padded first step is stored whole (see test_dropin_stock_cases); a row that pads
    after it stored only real tokens cannot be told apart from its padding any more."""
    model = tiny_model("llama", "hf_paged")
    hf_paged.attach(model)
    cache = PagedCache(model.config)
    input_ids, attention_mask = left_padded_batch([5, 9])
    model(input_ids, attention_mask=attention_mask, **with_cache(cache))
    step = torch.tensor([[7], [8]])
    mask = torch.cat([attention_mask, torch.tensor([[0], [1]])], dim=1)
    with pytest.raises(ValueError, match=r"needs left padding.*rows \[0\]"):
        model(step, attention_mask=mask, **with_cache(cache))


def test_mask_of_wrong_width_is_rejected():
    model = tiny_model("llama", "hf_paged")
    cache = PagedCache(model.config)
    with pytest.raises(ValueError, match=r"attention_mask must be 2D with shape \(1, 4\)"):
        cache.plan_step(batch_size=1, q_len=4, mode=PAGED, device=torch.device("cpu"), dtype=torch.float32,
                        attention_mask=torch.ones(1, 6))


def test_batch_size_change_needs_reset():
    model = tiny_model("llama", "hf_paged")
    hf_paged.attach(model)
    cache = PagedCache(model.config)
    ids, mask = left_padded_batch([5, 9])
    model(ids, attention_mask=mask, **with_cache(cache))
    with pytest.raises(ValueError, match="holds 2 sequences but this forward has batch size 1"):
        model(ids[:1], attention_mask=mask[:1], **with_cache(cache))
    cache.reset()
    model(ids[:1], attention_mask=mask[:1], **with_cache(cache))  # fine after reset
    assert cache.batch_size == 1


def test_crop_errors():
    model = tiny_model("llama", "hf_paged")
    hf_paged.attach(model)
    cache = PagedCache(model.config)
    ids, mask = left_padded_batch([3, 9])
    model(ids, attention_mask=mask, **with_cache(cache))
    with pytest.raises(ValueError, match="positive value"):
        cache.crop(2)
    with pytest.raises(ValueError, match=r"rows \[0\] hold fewer real"):
        cache.crop(-5)
    with pytest.raises(ValueError, match="cannot crop 20 tokens"):
        cache.crop(-20)


def test_unfinished_forward_is_detected(monkeypatch):
    model = tiny_model("llama", "hf_paged")
    hf_paged.attach(model)
    cache = PagedCache(model.config)
    ids, mask = left_padded_batch([33])

    def boom(*args, **kwargs):
        raise MemoryError("simulated failure inside the forward")

    monkeypatch.setattr(dispatch, "paged_attention", boom)
    with pytest.raises(MemoryError):
        model(ids, attention_mask=mask, **with_cache(cache))
    monkeypatch.undo()
    assert cache.pool.num_cached_blocks == 2  # hashed at plan time, never written
    with pytest.raises(RuntimeError, match="did not finish"):
        model(ids[:, -1:], attention_mask=mask, **with_cache(cache))
    assert cache.pool.num_cached_blocks == 0  # suspect blocks can no longer be hit
    cache.reset()
    model(ids, attention_mask=mask, **with_cache(cache))


def test_dropout_and_attention_weights_are_refused_on_the_paged_path():
    model = tiny_model("llama", "hf_paged")
    hf_paged.attach(model)
    ids, mask = left_padded_batch([5])
    with pytest.raises(ValueError, match="cannot return attention weights"):
        model(ids, attention_mask=mask, **with_cache(PagedCache(model.config)), output_attentions=True)


def test_bad_backend_env(monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="HF_PAGED_BACKEND must be one of"):
        dispatch.backend(torch.device("cpu"))


def test_custom_mask_functions_are_refused_on_the_paged_path():
    """A model overlaying its own mask (e.g. bidirectional image tokens) must not be silently run causally."""
    from transformers.masking_utils import create_causal_mask

    model = tiny_model("llama", "hf_paged")
    hf_paged.attach(model)
    cache = PagedCache(model.config)
    ids, mask = left_padded_batch([6])
    embeds = model.get_input_embeddings()(ids)
    bidirectional = lambda batch_idx, head_idx, q_idx, kv_idx: True  # noqa: E731
    meta = cache.plan_step(batch_size=1, q_len=6, mode=PAGED, device=torch.device("cpu"), dtype=torch.float32,
                           input_ids=ids, attention_mask=mask)  # masks built from here on are the paged step's
    lazy = create_causal_mask(model.config, embeds, mask, cache, or_mask_function=bidirectional)
    assert not lazy.is_plain_causal
    assert create_causal_mask(model.config, embeds, mask, cache).is_plain_causal
    layer = model.model.layers[0].self_attn
    q = torch.zeros(1, 6, 6, 16)
    with pytest.raises(ValueError, match="causal and sliding-window masks only"):
        hf_paged.paged_attention_forward(layer, q, torch.zeros(1, 16, 2, 16), torch.zeros(1, 16, 2, 16), lazy,
                                         paged_metadata=meta)
