"""Parity with stock transformers on tiny random-weight models of every supported architecture.

The oracle is stock `generate` (sdpa, or eager where sdpa lacks softcap/sinks) with `DynamicCache`:
greedy token ids must be identical, per-step logits within fp32 tolerance.
"""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged.attention import dispatch
from hf_paged.hf.cache import PagedCache
from tiny_models import with_cache, cache_of, CONFIGS, STOCK_ATTN, left_padded_batch, tiny_model

pytestmark = pytest.mark.parity  # scripts/check_transformers.sh runs it on every release checked

# fp32 end to end: only summation order differs between sdpa and the paged path.
LOGITS_ATOL = 1e-4
LENGTHS = [5, 17, 33, 16]  # cross block boundaries for block_size 1, 16 and 32
NEW_TOKENS = 20


def _generate(model, input_ids, attention_mask, **kwargs):
    kwargs.setdefault("do_sample", False)
    return model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )


def _assert_same(ref, out, atol=LOGITS_ATOL):
    assert torch.equal(ref.sequences, out.sequences)
    for step, (a, b) in enumerate(zip(ref.logits, out.logits)):
        torch.testing.assert_close(b, a, atol=atol, rtol=0, msg=lambda m: f"step {step}: {m}")


@pytest.fixture
def count_paged_calls(monkeypatch):
    calls = []
    original = dispatch.paged_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(dispatch, "paged_attention", spy)
    return calls


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_greedy_parity_across_architectures(arch, count_paged_calls):
    input_ids, attention_mask = left_padded_batch(LENGTHS)
    model = tiny_model(arch, STOCK_ATTN.get(arch, "sdpa"))
    ref = _generate(model, input_ids, attention_mask)
    model.set_attn_implementation("hf_paged")
    model.hf_paged_use_engine = False  # this checks the stock generate path over a PagedCache
    for block_size in (1, 16, 32):
        model.hf_paged_cache_config = hf_paged.PagedCacheConfig(block_size=block_size)
        count_paged_calls.clear()
        out = _generate(model, input_ids, attention_mask)
        _assert_same(ref, out)
        cache = cache_of(out)
        assert isinstance(cache, PagedCache)
        # The paged path ran: one call per attention layer per step (Qwen 3.5's recurrent layers keep a
        # state, no K/V), and the prefill packed only real tokens.
        attention_layers = sum(spec.owns_kv for spec in cache.kv.layer_specs)
        assert attention_layers == model.config.num_hidden_layers - (arch == "qwen3_5") * 2
        assert len(count_paged_calls) == attention_layers * NEW_TOKENS
        assert count_paged_calls[0] == sum(LENGTHS)
        stats = cache.stats()
        # Padding costs nothing: exactly the real tokens are stored (the last token has no K/V yet).
        assert stats["num_tokens"] == sum(LENGTHS) + len(LENGTHS) * (NEW_TOKENS - 1)
        assert stats["max_waste_tokens_per_seq"] <= block_size - 1


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_paged_cache_with_dense_attention(attn):
    """A PagedCache passed to a model using sdpa/eager returns gathered K/V: same output."""
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=1)
    model = tiny_model("llama", attn)
    ref = _generate(model, input_ids, attention_mask)
    cache = PagedCache(model.config, block_size=4)
    out = _generate(model, input_ids, attention_mask, **with_cache(cache))
    _assert_same(ref, out)
    assert cache_of(out) is cache
    assert cache.stats()["num_tokens"] == sum(LENGTHS) + len(LENGTHS) * (NEW_TOKENS - 1)


def test_user_passed_paged_cache_with_hf_paged():
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=2)
    model = tiny_model("qwen2")
    ref = _generate(model, input_ids, attention_mask)
    model.set_attn_implementation("hf_paged")
    cache = PagedCache(model.config, block_size=8, num_blocks=64)
    out = _generate(model, input_ids, attention_mask, **with_cache(cache))
    _assert_same(ref, out)
    assert cache.stats()["num_blocks"] == 64  # a fixed pool never grows


def test_one_at_a_time_matches_batched():
    model = tiny_model("mistral", "hf_paged")
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=3)
    batched = _generate(model, input_ids, attention_mask).sequences
    width = input_ids.shape[1]
    for row, n in enumerate(LENGTHS):
        single = _generate(model, input_ids[row:row + 1, width - n:], attention_mask[row:row + 1, width - n:])
        assert torch.equal(single.sequences[0, n:], batched[row, width:])


def test_sampling_with_seed_matches_stock():
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=4)
    model = tiny_model("llama")
    kwargs = dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.8)
    torch.manual_seed(1234)
    ref = _generate(model, input_ids, attention_mask, **kwargs)
    model.set_attn_implementation("hf_paged")
    model.hf_paged_use_engine = False  # this checks the stock generate path over a PagedCache
    torch.manual_seed(1234)
    out = _generate(model, input_ids, attention_mask, **kwargs)
    _assert_same(ref, out)


def test_beam_search_matches_stock_and_shares_prompt_blocks():
    input_ids, attention_mask = left_padded_batch([37, 20], seed=5)
    model = tiny_model("llama")
    ref = model.generate(input_ids, attention_mask=attention_mask, num_beams=4, max_new_tokens=12,
                         do_sample=False, return_dict_in_generate=True)
    model.set_attn_implementation("hf_paged")
    out = model.generate(input_ids, attention_mask=attention_mask, num_beams=4, max_new_tokens=12,
                         do_sample=False, return_dict_in_generate=True)
    assert torch.equal(ref.sequences, out.sequences)
    stats = cache_of(out).stats()
    assert stats["num_seqs"] == 8
    # 4 beams of a 37-token prompt would hold 4 * 3 = 12 blocks unshared; they hold the 2 full prompt
    # blocks once per prompt (shared), and all beams keep pointing at them.
    assert stats["num_shared_blocks"] >= 2
    assert stats["num_used_blocks"] < stats["num_seqs"] * -(-(37 + 12) // 16)


def test_num_return_sequences_matches_stock_and_shares_prompt_blocks():
    input_ids, attention_mask = left_padded_batch([40, 9], seed=6)
    model = tiny_model("qwen3")
    kwargs = dict(do_sample=True, num_return_sequences=3, max_new_tokens=10, return_dict_in_generate=True)
    torch.manual_seed(7)
    ref = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
    model.set_attn_implementation("hf_paged")
    model.hf_paged_use_engine = False  # this checks the stock generate path over a PagedCache
    torch.manual_seed(7)
    out = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
    assert torch.equal(ref.sequences, out.sequences)
    stats = cache_of(out).stats()
    # The 40-token prompt has 2 full blocks; its 3 copies hold them once (prefix cache hits).
    assert stats["num_shared_blocks"] == 2
    assert stats["prefix_cache_hits"] == 4


def test_assisted_generation():
    input_ids, attention_mask = left_padded_batch([23], seed=8)
    model, assistant = tiny_model("llama"), tiny_model("llama", seed=1)
    ref = model.generate(input_ids, attention_mask=attention_mask, assistant_model=assistant,
                         max_new_tokens=20, do_sample=False)
    greedy = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=20, do_sample=False)
    model.set_attn_implementation("hf_paged")
    assistant.set_attn_implementation("hf_paged")
    model.hf_paged_use_engine = False  # stock assisted generation over a PagedCache (test_speculative: the engine)
    out = model.generate(input_ids, attention_mask=attention_mask, assistant_model=assistant,
                         max_new_tokens=20, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert torch.equal(out.sequences, greedy)  # assisted decoding is lossless
    assert isinstance(cache_of(out), PagedCache)


def test_chunked_prefill_matches_stock():
    input_ids, attention_mask = left_padded_batch([5, 40, 23], seed=9)
    model = tiny_model("gemma2", "eager")
    ref = _generate(model, input_ids, attention_mask)
    model.set_attn_implementation("hf_paged")
    out = _generate(model, input_ids, attention_mask, prefill_chunk_size=8)
    _assert_same(ref, out)


def test_inputs_embeds_generation_matches_stock():
    input_ids, attention_mask = left_padded_batch([12, 20], seed=10)
    model = tiny_model("llama")
    embeds = model.get_input_embeddings()(input_ids)
    ref = model.generate(inputs_embeds=embeds, attention_mask=attention_mask, max_new_tokens=8, do_sample=False)
    model.set_attn_implementation("hf_paged")
    out = model.generate(inputs_embeds=embeds, attention_mask=attention_mask, max_new_tokens=8, do_sample=False,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert cache_of(out).pool.num_cached_blocks == 0  # unknown prompt tokens are never hashed


def test_cache_continuation_across_generate_calls():
    """Reusing a cache continues the sequence, as with DynamicCache."""
    input_ids, attention_mask = left_padded_batch([9, 14], seed=11)
    model = tiny_model("llama", "hf_paged")
    full = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=16, do_sample=False)
    cache = PagedCache(model.config, block_size=4)
    first = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False,
                           **with_cache(cache))
    mask = torch.cat([attention_mask, torch.ones(2, 8, dtype=attention_mask.dtype)], dim=1)
    second = model.generate(first, attention_mask=mask, max_new_tokens=8, do_sample=False, **with_cache(cache))
    assert torch.equal(second, full)


def test_forward_without_attach_is_correct():
    """A hand-driven forward with a PagedCache but no planning hook takes the dense path: padding is
    stored, yet logits equal DynamicCache's."""
    input_ids, attention_mask = left_padded_batch([6, 19], seed=12)
    model = tiny_model("llama", "hf_paged")
    hf_paged.detach(model)
    paged, dynamic = PagedCache(model.config, block_size=4), None
    ids, mask = input_ids, attention_mask
    for _ in range(5):
        a = model(ids, attention_mask=mask, **with_cache(paged))
        b = model(ids, attention_mask=mask, **with_cache(dynamic), use_cache=True)
        dynamic = cache_of(b)
        real = mask[:, -ids.shape[1]:].bool()
        torch.testing.assert_close(a.logits[real], b.logits[real], atol=LOGITS_ATOL, rtol=0)
        ids = b.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    assert paged.stats()["num_tokens"] == 2 * (input_ids.shape[1] + 4)  # padding stored on this path


def test_attached_forward_by_hand_and_crop():
    """attach() + a hand-driven loop; crop(-n) then re-feeding gives the same logits."""
    input_ids, attention_mask = left_padded_batch([6, 19], seed=13)
    model = tiny_model("phi3", "hf_paged")
    hf_paged.attach(model)
    cache = PagedCache(model.config, block_size=4)
    out = model(input_ids, attention_mask=attention_mask, **with_cache(cache))
    nxt = out.logits[:, -1:].argmax(-1)
    mask = torch.cat([attention_mask, torch.ones(2, 3, dtype=torch.long)], dim=1)
    step = model(torch.cat([nxt, nxt, nxt], 1), attention_mask=mask, **with_cache(cache))
    before = cache.stats()
    cache.crop(-2)
    after = cache.stats()
    assert cache.get_seq_length() == input_ids.shape[1] + 1
    assert after["num_tokens"] == before["num_tokens"] - 4
    again = model(torch.cat([nxt, nxt], 1), attention_mask=mask, **with_cache(cache))
    torch.testing.assert_close(again.logits, step.logits[:, 1:], atol=LOGITS_ATOL, rtol=0)


def test_batch_select_and_repeat_interleave():
    input_ids, attention_mask = left_padded_batch([6, 19, 11], seed=14)
    model = tiny_model("llama", "hf_paged")
    hf_paged.attach(model)
    cache = PagedCache(model.config, block_size=4)
    model(input_ids, attention_mask=attention_mask, **with_cache(cache))
    tokens = [seq.num_tokens for seq in cache.seqs]
    cache.batch_select_indices(torch.tensor([2, 0]))
    assert [seq.num_tokens for seq in cache.seqs] == [tokens[2], tokens[0]]
    cache.batch_repeat_interleave(2)
    assert [seq.num_tokens for seq in cache.seqs] == [tokens[2]] * 2 + [tokens[0]] * 2
    assert cache.stats()["num_shared_blocks"] == len(cache.seqs[0].block_table) + len(cache.seqs[2].block_table)
    cache.pool.check_invariants()


def test_mqa_parity():
    """A single KV head shared by every query head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=1, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=15)
    ref = _generate(model, input_ids, attention_mask)
    model.set_attn_implementation("hf_paged")
    _assert_same(ref, _generate(model, input_ids, attention_mask))


def test_no_dense_mask_on_the_paged_path(monkeypatch):
    import transformers.masking_utils as masking_utils

    from hf_paged.attention import interface as attention

    built = []
    for name in ("sdpa_mask", "eager_mask"):
        original = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda *a, _o=original, **k: built.append(1) or _o(*a, **k))
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=16)
    model = tiny_model("llama", "hf_paged")
    _generate(model, input_ids, attention_mask)
    assert built == []
    # ...while the dense path (no cache) still builds exactly the mask sdpa would get.
    model(input_ids, attention_mask=attention_mask, use_cache=False)
    assert len(built) == 1
    assert masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["hf_paged"] is attention.paged_mask


def test_register_is_idempotent():
    from transformers import AttentionInterface

    hf_paged.register()
    hf_paged.register()
    assert AttentionInterface._global_mapping["hf_paged"] is hf_paged.paged_attention_forward
    assert hf_paged.integrations.is_installed()


def test_other_cache_classes_fall_back_visibly_or_error_clearly():
    from transformers import DynamicCache

    input_ids, attention_mask = left_padded_batch([9, 14], seed=17)
    model = tiny_model("llama")
    ref = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
    model.set_attn_implementation("hf_paged")
    # A user's own DynamicCache is respected: dense path, same output.
    out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False,
                         **with_cache(DynamicCache(config=model.config)))
    assert torch.equal(out, ref)
    # A static cache runs the call with transformers' sdpa (warned once): stock's output.
    out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False,
                         cache_implementation="static")
    assert torch.equal(out, ref) and model.config._attn_implementation == "hf_paged"


def test_generate_patch_is_reversible():
    from hf_paged import integrations as patches
    from transformers.generation.utils import GenerationMixin

    patched = GenerationMixin._prepare_cache_for_generation
    patches.uninstall()
    try:
        assert GenerationMixin._prepare_cache_for_generation is not patched
        model = tiny_model("llama", "hf_paged")
        input_ids, attention_mask = left_padded_batch([9])
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False,
                             return_dict_in_generate=True)
        assert not isinstance(cache_of(out), PagedCache)  # stock cache, dense path: still correct
    finally:
        patches.install()
    assert patches.is_installed()


def test_unsupported_transformers_version_is_refused(monkeypatch):
    import sys

    from hf_paged.integrations import generate as patch
    from hf_paged.transformers_api import ALLOW_UNTESTED_ENV

    assert patch.is_supported_version("5.25.0") and patch.is_supported_version("5.22.0")
    assert not patch.is_supported_version("5.26.0") and not patch.is_supported_version("4.57.1")
    patch.uninstall()
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.30.0")
    try:
        with pytest.warns(UserWarning, match="transformers 5.30.0 is outside the tested range"):
            assert patch.install() is False
        assert not patch.is_installed()
        monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")  # trying the next release (scripts/check_transformers.sh)
        with pytest.warns(UserWarning, match="is set, so the drop-in patch is installed anyway"):
            assert patch.install() is True
    finally:
        monkeypatch.undo()
        patch.uninstall()
        patch.install()
    assert patch.is_installed()
