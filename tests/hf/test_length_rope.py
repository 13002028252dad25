"""Rope types whose frequencies follow the length (longrope, dynamic NTK): every path gives each
prompt what stock transformers gives it run alone.

The models are tiny, with q/k projections scaled x10 so that attention is peaked (at the default
initialisation attention is nearly uniform and a rotary bug changes nothing), a threshold of 32
tokens, and prompts on both sides of it that cross it while generating.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config, PhimoeConfig

import hf_paged  # noqa: F401 - registers "hf_paged"
from hf_paged import Engine, SamplingParams
from hf_paged.core.rope import LengthRope
from hf_paged.hf import rope as hf_rope
from family_sweep import _left_pad, fresh_rope, sharpen
from tests.tiny_models import cache_of, with_cache

pytestmark = pytest.mark.parity

THRESHOLD = 32
NEW = 12
# Prompt lengths: short (crosses while generating), at the edge, and past the threshold.
LENGTHS = [5, 25, 31, 33, 45]
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
_HALF = 8  # head_dim 16: 8 rotary frequencies
_LONGROPE = dict(short_factor=[1.0 + 0.1 * i for i in range(_HALF)], long_factor=[2.0 + 3.0 * i for i in range(_HALF)],
                 original_max_position_embeddings=THRESHOLD, rope_theta=10000.0)


def _config(name: str):
    if name == "phi3-longrope":
        return Phi3Config(**_COMMON, max_position_embeddings=4 * THRESHOLD, original_max_position_embeddings=THRESHOLD,
                          rope_parameters=dict(rope_type="longrope", **_LONGROPE))
    if name == "phi3-su":
        return Phi3Config(**_COMMON, max_position_embeddings=4 * THRESHOLD, original_max_position_embeddings=THRESHOLD,
                          rope_scaling=dict(type="su", short_factor=_LONGROPE["short_factor"],
                                            long_factor=_LONGROPE["long_factor"],
                                            original_max_position_embeddings=THRESHOLD))  # 5.22 needs it here
    if name == "phimoe":
        return PhimoeConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2,
                            max_position_embeddings=4 * THRESHOLD, original_max_position_embeddings=THRESHOLD,
                            rope_parameters=dict(rope_type="longrope", short_mscale=1.0, long_mscale=1.1, **_LONGROPE))
    if name == "llama-dynamic":
        return LlamaConfig(**_COMMON, max_position_embeddings=THRESHOLD,
                           rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0))
    if name == "llama-longrope":  # longrope in a model that does not recompute at the threshold
        return LlamaConfig(**_COMMON, max_position_embeddings=4 * THRESHOLD,
                           rope_parameters=dict(rope_type="longrope", **_LONGROPE))
    raise KeyError(name)


NAMES = ["phi3-longrope", "phi3-su", "phimoe", "llama-dynamic", "llama-longrope"]


_MODELS: dict = {}


def models(name: str):
    """(stock sdpa model, hf_paged model) with the same sharpened weights; built once per name."""
    if name not in _MODELS:
        torch.manual_seed(0)
        stock = AutoModelForCausalLM.from_config(_config(name), attn_implementation="sdpa").eval()
        sharpen(stock)
        paged = copy.deepcopy(stock)
        paged.set_attn_implementation("hf_paged")
        _MODELS[name] = stock, paged
    return _MODELS[name]


def _prompts(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def stock_alone(stock, prompt: list[int], new: int = NEW, **kwargs) -> list[int]:
    fresh_rope(stock)
    ids = torch.tensor([prompt])
    out = stock.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                         min_new_tokens=new, **kwargs)
    return out[0, len(prompt):].tolist()


def engine_run(paged, prompts, num_blocks: int):
    """Greedy tokens per prompt from an engine that prefills in chunks of 16 tokens, and its metrics."""
    engine = Engine(paged, num_blocks=num_blocks, max_num_seqs=8, max_num_batched_tokens=16)
    try:
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0))
        return [list(o.outputs[0].token_ids) for o in outs], engine.metrics()
    finally:
        engine.shutdown()


# -------------------------------------------------------------------------------- the bookkeeping
def test_length_rope_gives_each_token_the_length_stock_computed_it_for():
    rope = LengthRope("dynamic", threshold=8).fed(0, 5)
    assert [rope.rope_len(p) for p in range(8)] == [5, 5, 5, 5, 5, 6, 7, 8]
    assert rope.block_salt(0, 4) is None and rope.block_salt(8, 12) == ("dynamic", (9, 10, 11, 12))
    cont = rope.fed(10, 14)  # a continuation fed in one forward
    assert [cont.rope_len(p) for p in range(9, 15)] == [10, 14, 14, 14, 14, 15]
    phi = LengthRope("longrope", threshold=8, recompute=True).fed(0, 5)
    assert not phi.long and not phi.needs_restart(8) and phi.needs_restart(9)
    assert phi.restarted().rope_len(0) == 9 and phi.restarted().block_salt(0, 4) == ("longrope", (True,) * 4)
    assert LengthRope("longrope", threshold=8, recompute=True).fed(0, 12).long
    with pytest.raises(ValueError, match="kind"):
        LengthRope("yarn", threshold=8)


def test_every_rope_type_transformers_ships_is_classified():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(ROPE_INIT_FUNCTIONS) | {"default"} <= set(hf_rope.ROPE_TYPES)
    assert {t for t in hf_rope.ROPE_TYPES if hf_rope.rope_kind(t)} == {"dynamic", "longrope"}
    with pytest.raises(ValueError, match="not classified rope type 'dynamic_yarn'"):
        hf_rope.rope_kind("dynamic_yarn")


def test_install_describes_each_model():
    assert hf_rope.install(models("phi3-longrope")[1]) == LengthRope("longrope", THRESHOLD, recompute=True)
    assert hf_rope.install(models("phimoe")[1]) == LengthRope("longrope", THRESHOLD, recompute=True)
    assert hf_rope.install(models("llama-dynamic")[1]) == LengthRope("dynamic", THRESHOLD)
    assert hf_rope.install(models("llama-longrope")[1]) == LengthRope("longrope", THRESHOLD)


def test_the_engine_takes_max_model_len_from_what_the_rope_allows():
    stock, paged = models("llama-dynamic")
    engine = Engine(paged, num_blocks=64, max_num_seqs=4)
    try:
        assert engine.core.max_model_len == 2 * THRESHOLD  # max_position_embeddings x factor
        assert hf_rope.default_max_model_len(models("phi3-longrope")[1].config) == 4 * THRESHOLD
    finally:
        engine.shutdown()


# -------------------------------------------------------------------------------- parity with stock
@pytest.mark.parametrize("name", NAMES)
def test_left_padded_batch_crossing_the_threshold(name):
    stock, paged = models(name)
    prompts = _prompts()
    want = [stock_alone(stock, p) for p in prompts]
    ids, mask = _left_pad(prompts, 0)
    out = paged.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW)
    got = out[:, ids.shape[1]:].tolist()
    assert got == want


@pytest.mark.parametrize("name", NAMES)
def test_engine_chunked_prefill_prompts_on_both_sides_share_steps(name):
    stock, paged = models(name)
    prompts = _prompts(seed=1) + _prompts([20, 40], seed=2)
    want = [stock_alone(stock, p) for p in prompts]
    got, metrics = engine_run(paged, prompts, num_blocks=96)
    assert got == want
    if _config(name).model_type in ("phi3", "phimoe"):
        # a prompt at or under the threshold that feeds past it while generating is recomputed once, as
        # stock drops its cache there (25 and 31 here)
        crossing = sum(1 for p in prompts if len(p) <= THRESHOLD < len(p) + NEW - 1)
        assert crossing == 2 and metrics["num_rope_recomputes"] == crossing
    else:
        assert metrics["num_rope_recomputes"] == 0


@pytest.mark.parametrize("name", ["phi3-longrope", "llama-dynamic"])
def test_engine_preempting_and_sharing_a_prefix(name):
    stock, paged = models(name)
    base = _prompts([20], seed=3)[0]
    prompts = [base + t for t in _prompts([4, 16, 30], seed=4)] + [base]
    want = [stock_alone(stock, p) for p in prompts]
    got, metrics = engine_run(paged, prompts, num_blocks=7)
    assert got == want
    assert metrics["vllm:num_preemptions"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_returned_cache_continued_across_the_threshold(name):
    stock, paged = models(name)
    prompt = _prompts([20], seed=5)[0]
    first = stock_alone(stock, prompt, new=6)
    ids = torch.tensor([prompt])
    out = paged.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                         min_new_tokens=6, return_dict_in_generate=True)
    assert out.sequences[0, len(prompt):].tolist() == first
    more = out.sequences[0].tolist() + _prompts([10], seed=6)[0]  # 36 tokens: past the threshold
    # stock: the same two calls, the second continuing the first's cache
    fresh_rope(stock)
    s1 = stock.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                        min_new_tokens=6, return_dict_in_generate=True)
    s_ids = torch.tensor([more])
    s2 = stock.generate(s_ids, attention_mask=torch.ones_like(s_ids), do_sample=False, max_new_tokens=NEW,
                        min_new_tokens=NEW, **with_cache(cache_of(s1)))
    g_ids = torch.tensor([more])
    g2 = paged.generate(g_ids, attention_mask=torch.ones_like(g_ids), do_sample=False, max_new_tokens=NEW,
                        min_new_tokens=NEW, **with_cache(cache_of(out)))
    assert g2[0, len(more):].tolist() == s2[0, len(more):].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_beams_crossing_the_threshold(name):
    stock, paged = models(name)
    prompt = _prompts([27], seed=7)[0]
    kwargs = dict(num_beams=3, length_penalty=0.7, num_return_sequences=2)
    ids = torch.tensor([prompt])
    fresh_rope(stock)
    want = stock.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                          min_new_tokens=NEW, **kwargs)[:, len(prompt):].tolist()
    fresh_rope(paged)
    out = paged.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                         min_new_tokens=NEW, **kwargs)
    assert out[:, len(prompt):].tolist() == want


def test_an_unclassified_rope_type_is_refused_at_load():
    class Config:  # a config as a newer transformers could write it
        rope_parameters = {"rope_type": "dynamic_yarn", "rope_theta": 10000.0}

    with pytest.raises(ValueError, match="not classified rope type 'dynamic_yarn'"):
        hf_rope.check_rope_supported(Config())
    Config.rope_parameters = {"full_attention": {"rope_type": "longrope"}, "sliding_attention": {"rope_type": "default"}}
    assert hf_rope.rope_types_of(Config()) == {"full_attention": "longrope", "sliding_attention": "default"}


def test_a_long_block_is_never_served_to_a_short_sequence():
    """Prefix-cache keys: the same tokens rotated with other frequencies hash apart."""
    from hf_paged.core import KVSequence

    short = KVSequence(seq_id=0, rope=LengthRope("longrope", 32, recompute=True).fed(0, 20))
    long = KVSequence(seq_id=1, rope=LengthRope("longrope", 32, recompute=True).fed(0, 40))
    plain = KVSequence(seq_id=2)
    assert short.block_key(0, 16) == plain.block_key(0, 16) != long.block_key(0, 16)
    dyn = [KVSequence(seq_id=3, rope=LengthRope("dynamic", 32).fed(0, n)) for n in (40, 41)]
    assert dyn[0].block_key(0, 16) != dyn[1].block_key(0, 16)  # prompts computed for different lengths


def test_a_model_whose_stock_feeds_only_the_newest_token_past_the_threshold_is_refused():
    """Phi-4-multimodal's `prepare_inputs_for_generation` (transformers 5.25) drops the cache past the
    threshold but keeps feeding one token: stock's output there is not a recomputation."""
    from transformers import Phi3ForCausalLM, Phi4MultimodalForCausalLM, LlamaForCausalLM

    assert hf_rope._at_threshold(Phi3ForCausalLM) == "recompute"
    assert hf_rope._at_threshold(Phi4MultimodalForCausalLM) == "last token"
    assert hf_rope._at_threshold(LlamaForCausalLM) is None

    class LastToken(Phi3ForCausalLM):
        def prepare_inputs_for_generation(self, input_ids, cache=None, **kwargs):
            if cache and input_ids.shape[1] >= self.config.original_max_position_embeddings + 1:
                cache = None  # and the newest token alone is fed, as Phi-4-multimodal's does
            return super().prepare_inputs_for_generation(input_ids, cache=cache, **kwargs)

    model = LastToken(_config("phi3-longrope")).eval()
    model.set_attn_implementation("hf_paged")
    with pytest.raises(ValueError, match="hf_paged cannot serve LastToken with longrope"):
        Engine(model, num_blocks=16)


@pytest.mark.parametrize("name", ["phi3-longrope", "llama-dynamic"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_across_the_threshold_stays_lossless(name, method):
    """Verified drafts keep each token's frequencies; a draft never straddles Phi-3's recompute."""
    stock, paged = models(name)
    motif = _prompts([6], seed=8)[0]
    prompts = [motif * 4, (motif * 6)[:33], _prompts([28], seed=9)[0]]  # repeats give n-gram proposals
    want = [stock_alone(stock, p) for p in prompts]
    spec = (dict(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=2) if method == "ngram"
            else dict(draft_model=copy.deepcopy(paged), num_speculative_tokens=3))
    engine = Engine(paged, num_blocks=96, max_num_seqs=4, max_num_batched_tokens=16, **spec)
    try:
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0))
        accepted = engine.metrics().get("vllm:spec_decode_num_accepted_tokens", 0)
    finally:
        engine.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert accepted > 0 or method == "ngram"  # the draft model's drafts were verified and kept


def test_stock_generate_over_a_paged_cache_never_shares_blocks_rotated_for_another_length():
    """Beams run stock generate over a PagedCache: rows sharing a prefix were rotated for different lengths."""
    stock, paged = models("llama-dynamic")
    long = _prompts([45], seed=11)[0]
    rows = [long, long[:20]]
    kwargs = dict(do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, num_beams=2)
    want = []
    for p in rows:
        fresh_rope(stock)
        ids = torch.tensor([p])
        want.append(stock.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)[0, len(p):].tolist())
    ids, mask = _left_pad(rows, 0)
    assert paged.generate(ids, attention_mask=mask, **kwargs)[:, ids.shape[1]:].tolist() == want


def test_imported_kv_is_never_served_to_a_prompt_rotated_for_another_length():
    """Disaggregated decode: K/V computed elsewhere carry no rope history, so they are never hashed."""
    stock, paged = models("llama-dynamic")
    long = _prompts([45], seed=11)[0]
    engine = Engine(paged, num_blocks=64)
    try:
        first = engine.generate([long], SamplingParams(max_new_tokens=1, temperature=0.0), retain_kv=True)[0]
        [seq] = engine.kept_kv(first.request_id)
        exported = engine.export_kv(seq)
        engine.free_kv([seq])
        engine.free_kv([engine.import_kv(long, exported)])
        got = engine.generate([long[:20]], SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0))
    finally:
        engine.shutdown()
    assert list(got[0].outputs[0].token_ids) == stock_alone(stock, long[:20])


def test_a_kept_prefix_cropped_inside_its_prompt_keeps_its_tokens_lengths():
    rope = LengthRope("dynamic", threshold=8).fed(0, 12)
    cropped = rope.fed(5, 14)  # kept 5 tokens of the 12-token prompt, then a continuation fed to 14
    assert [cropped.rope_len(p) for p in range(0, 15)] == [12] * 5 + [14] * 9 + [15]


@pytest.mark.parametrize("name", ["llama-dynamic", "phi3-longrope"])
def test_a_returned_cache_whose_rows_were_lost_continues_with_their_history(name):
    """The engine that kept the rows is dropped before the continuation: the row is recomputed, each token
    rotated as stock rotated it (the first prompt for its length, generated tokens for theirs)."""
    from hf_paged.integrations.batch_generate import release

    stock, paged = models(name)
    prompt = _prompts([40 if name == "llama-dynamic" else 20], seed=5)[0]
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, max_new_tokens=6, min_new_tokens=6, return_dict_in_generate=True)
    fresh_rope(stock)
    s1 = stock.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    more = s1.sequences[0].tolist() + _prompts([10], seed=6)[0]
    m = torch.tensor([more])
    cont = dict(do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW)
    want = stock.generate(m, attention_mask=torch.ones_like(m), **cont, **with_cache(cache_of(s1)))[0, len(more):]
    out = paged.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert release(paged)  # the engine holding the row is gone
    got = paged.generate(m, attention_mask=torch.ones_like(m), **cont, **with_cache(cache_of(out)))[0, len(more):]
    assert got.tolist() == want.tolist()
