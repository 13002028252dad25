"""Multi-head latent attention (DeepSeek V3, and V3.2's indexed sparse attention) through the engine.

The pool keeps one row per token and layer, latent | rotary key (| indexer key), and paged steps read
the rows in place with the up-projections absorbed into the query and the output (`hf.latent`). The
oracle is stock `generate` (sdpa, DynamicCache) on the same weights: greedy tokens identical per
prompt. The tiny models' queries are scaled by 10 (peaked attention: which key a query reads shows).
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_paged import Engine, SamplingParams
from hf_paged.attention import dispatch, interface
from hf_paged.cli import main
from hf_paged.hf import PagedCache
from layer_kinds import engine_scenario, greedy_alone, left_padded, random_rows
from tiny_models import MLA_CONFIGS, bias_up_projections, tiny_mla_model

ARCHS = [arch for arch in ("deepseek_v3", "deepseek_v32") if arch in MLA_CONFIGS]
BLOCK = 16
NEW = 10
PEAK = 10.0


def peaked_pair(arch: str):
    """(stock, paged) models with the same weights, their queries scaled by PEAK."""
    stock = tiny_mla_model(arch)
    with torch.no_grad():
        for module in stock.modules():
            proj = getattr(module, "q_b_proj", None) or getattr(module, "q_proj", None)
            if proj is not None and hasattr(module, "kv_b_proj"):
                proj.weight.mul_(PEAK)
    paged = tiny_mla_model(arch, "hf_paged")
    paged.load_state_dict(stock.state_dict())
    return stock, paged


_PAIRS: dict[str, tuple] = {}


@pytest.fixture(params=ARCHS)
def pair(request):
    if request.param not in _PAIRS:
        _PAIRS[request.param] = peaked_pair(request.param)
    return _PAIRS[request.param]


@pytest.fixture
def latent_calls(monkeypatch):
    """Per paged attention call, its latent width (None: a call over plain K/V), or "sparse" (indexed
    attention over the rows an indexer picked)."""
    calls = []
    original, sparse = dispatch.paged_attention, interface.sparse_latent_attention
    monkeypatch.setattr(dispatch, "paged_attention",
                        lambda *a, **k: calls.append(k.get("latent_dim")) or original(*a, **k))
    monkeypatch.setattr(interface, "sparse_latent_attention", lambda *a, **k: calls.append("sparse") or sparse(*a, **k))
    return calls


def expected_calls(config) -> set:
    """What every attention call of the model is: absorbed over the rows, sparse where its layers are indexed."""
    return {"sparse"} if "indexed_attention" in (getattr(config, "layer_types", None) or []) else {config.kv_lora_rank}


def test_peaked_queries_make_positions_matter(pair):
    """The premise: stock's tokens change when the prompt's earlier half is shuffled."""
    stock, _ = pair
    prompt = random_rows([40], seed=21)[0]
    shuffled = prompt[:20][::-1] + prompt[20:]
    a, b = greedy_alone(stock, [prompt, shuffled], NEW)
    assert a != b


def test_drop_in_generate_on_a_left_padded_batch_matches_stock(pair, latent_calls):
    stock, paged = pair
    ids, mask = left_padded(random_rows([20, 57, 90, 33], seed=5))
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    expected = stock.generate(ids, attention_mask=mask, **gen)
    assert torch.equal(paged.generate(ids, attention_mask=mask, **gen), expected)
    assert latent_calls and set(latent_calls) == expected_calls(paged.config)  # every layer read the rows


def test_engine_chunked_preempting_speculating_and_caching_a_shared_prefix_matches_stock(pair, latent_calls):
    """Prefill in chunks of 16 tokens, a pool 4 blocks above the longest request's need (requests
    preempt one another), n-gram speculation (k = 3), and a prompt sharing a 48-token prefix with an
    earlier one: every request's greedy tokens are stock's alone, and the second is served >= 48
    tokens from the prefix cache."""
    stock, paged = pair
    figures = engine_scenario(stock, paged, BLOCK, NEW, others=(24, 61, 90))  # prompts of 24-90 tokens
    assert figures["cached_tokens"] >= 48
    assert figures["preemptions"] > 0 and figures["drafts"] > 0
    assert set(latent_calls) == expected_calls(paged.config)


def test_pool_bytes_per_token_are_the_latent_rows_and_kv_size_says_so(pair, tmp_path, capsys):
    """Measured on the pool's tensors after a forward: (kv_lora_rank + qk_rope_head_dim [+ index_head_dim
    on indexed layers]) x layers x itemsize, which `hf-paged kv-size` prints for the same config."""
    _, paged = pair
    config = paged.config
    engine = Engine(paged, block_size=BLOCK, num_blocks=8)
    engine.generate([random_rows([20], seed=1)[0]], SamplingParams(max_new_tokens=2))
    kv = engine.cache.kv
    tensors = [t for layer in kv.storage_layers for t in layer.payload()]
    assert len(tensors) == config.num_hidden_layers  # one row tensor per layer, nothing else
    measured = sum(t.numel() * t.element_size() for t in tensors) // (kv.num_blocks * BLOCK)
    index = getattr(config, "index_head_dim", 0) if "indexed_attention" in (getattr(config, "layer_types", None) or []) else 0
    formula = (config.kv_lora_rank + config.qk_rope_head_dim + index) * config.num_hidden_layers * 4
    assert measured == formula == kv.bytes_per_block() // BLOCK
    config.save_pretrained(tmp_path)
    assert main(["kv-size", str(tmp_path), "--kv-dtype", "float32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rows"][0]["bytes_per_token"] == formula


def test_absorbed_attention_matches_the_dense_expansion_in_logits(pair, latent_calls):
    """One paged forward (absorbed) and stock's forward (expanded) agree on every logit within fp32
    rounding (absorption reorders the sums)."""
    stock, paged = pair
    ids, mask = left_padded(random_rows([37, 20], seed=8))
    with torch.no_grad():
        ref = stock(ids, attention_mask=mask).logits
        cache = PagedCache(paged.config, block_size=BLOCK)
        from hf_paged.hf.planning import attach

        attach(paged)
        out = paged(ids, attention_mask=mask, cache=cache).logits
    keep = mask.bool()
    torch.testing.assert_close(out[keep], ref[keep], atol=2e-4, rtol=1e-4)
    assert set(latent_calls) == expected_calls(paged.config)  # the paged step ran absorbed, not dense


# ------------------------------------------------------------------------------ what is refused, and sizes
def test_quantised_latents_run_dense_and_the_engine_says_why(caplog):
    """An int8 cache keeps the latents quantised (with scales), which only dense steps read: the Engine
    refuses, naming kv_cache_dtype; generate falls back to stock generation over the quantised cache,
    whose steps run dense (no paged latent call); DeepSeek V3.2's rows (indexer keys) are refused."""
    from hf_paged import PagedCacheConfig, explain
    from hf_paged.hf.kv_owner import KVOwner

    stock, paged = peaked_pair("deepseek_v3")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' with multi-head latent attention"):
        Engine(paged, block_size=BLOCK, num_blocks=16, kv_cache_dtype="int8")
    paged.hf_paged_cache_config = PagedCacheConfig(block_size=BLOCK, kv_cache_dtype="int8")
    ids, mask = left_padded(random_rows([20, 33], seed=3))
    assert "kept quantised" in explain(paged, input_ids=ids, attention_mask=mask, max_new_tokens=2).reason
    calls = []
    original = dispatch.paged_attention
    dispatch.paged_attention = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        out = paged.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    finally:
        dispatch.paged_attention = original
    assert out.shape == (2, ids.shape[1] + 4) and calls == []
    with pytest.raises(ValueError, match="indexed sparse attention"):
        KVOwner(MLA_CONFIGS["deepseek_v32"](), kv_cache_dtype="int8")


def test_the_pool_is_sized_in_the_cache_dtype_before_the_first_forward():
    from hf_paged.hf.kv_owner import KVOwner

    config = MLA_CONFIGS["deepseek_v3"]()
    row = config.kv_lora_rank + config.qk_rope_head_dim
    owner = KVOwner(config, kv_cache_dtype="float32", block_size=BLOCK)
    assert owner.bytes_per_block(torch.bfloat16) == BLOCK * row * 4 * config.num_hidden_layers
    assert KVOwner(config, block_size=BLOCK).bytes_per_block(torch.bfloat16) == BLOCK * row * 2 * config.num_hidden_layers


def test_mixed_latent_widths_and_tensor_parallel_transfers_are_refused():
    """Plain and indexed latent layers in one model would differ in row width (refused when it loads);
    a tensor-parallel rank holds whole rows, which the per-head transfer cannot split (refused)."""
    from hf_paged.hf import kv_transfer
    from hf_paged.hf.kv_owner import KVOwner
    from hf_paged.hf.support import check_model_supported

    config = MLA_CONFIGS["deepseek_v32"]()
    config.layer_types = ["full_attention", "indexed_attention"]
    with pytest.raises(ValueError, match="mixes full_attention and indexed_attention"):
        check_model_supported(config)
    owner = KVOwner(MLA_CONFIGS["deepseek_v3"](), tensor_parallel_size=2, num_blocks=4)
    with pytest.raises(ValueError, match="tensor-parallel engine of a latent-attention model"):
        kv_transfer.check_transferable_layout(owner)


def test_the_triton_latent_kernel_leaves_what_it_does_not_apply_to_the_torch_path():
    """Sinks, softcap and windows on a latent call: the Triton backend hands it on (None), never drops them."""
    from hf_paged.attention.backend import LayerCall, backends, mask_rule

    rows = torch.zeros(2, BLOCK, 1, 24)
    base = dict(query=torch.zeros(1, 2, 24), key_cache=rows, value_cache=rows[..., :16],
                block_tables=torch.zeros(1, 2, dtype=torch.int32), seq_lens=torch.ones(1, dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), max_seqlen_q=1, max_seqlen_k=1, scale=1.0,
                latent_dim=16)
    triton = backends()["triton"]
    for extra in (dict(softcap=30.0), dict(sinks=torch.zeros(2)), dict(mask=mask_rule(8, None))):
        assert triton.run(LayerCall(**base, **extra), plan=None) is None


def test_a_paged_step_refuses_an_indexer_it_did_not_install():
    """update_indexer in a paged step comes only from an indexer hf_paged did not wrap: refused, naming it."""
    from hf_paged.attention.interface import UnsupportedModelError
    from hf_paged.hf.planning import attach

    _, paged = _PAIRS.get("deepseek_v32") or peaked_pair("deepseek_v32")
    attach(paged)
    cache = PagedCache(paged.config, block_size=BLOCK)
    ids = torch.tensor([random_rows([20], seed=1)[0]])
    with torch.no_grad():
        paged(ids, cache=cache)  # a paged step through the installed indexers
    step = cache.kv.step
    with pytest.raises(UnsupportedModelError, match="not a module hf_paged runs per sequence"):
        cache.update_indexer(torch.zeros(1, 20, paged.config.index_head_dim), 0)
    assert step.mode == "paged"


def test_an_up_projection_replaced_after_serving_is_never_absorbed():
    """A model the engine served once (its modules wrapped), whose kv_b_proj is then replaced (a LoRA
    adapter, a bias): generate() runs it dense, as stock, and the engine built before refuses its steps,
    naming kv_b_proj, rather than absorbing a weight that is no longer the up-projection."""
    stock, paged = peaked_pair("deepseek_v3")
    ids, mask = left_padded(random_rows([20, 33], seed=4))
    gen = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(paged.generate(ids, attention_mask=mask, **gen), stock.generate(ids, attention_mask=mask, **gen))
    engine = Engine(paged, block_size=BLOCK, num_blocks=32)
    bias_up_projections(stock, paged, span=0.5)
    expected = stock.generate(ids, attention_mask=mask, **gen)
    assert torch.equal(paged.generate(ids, attention_mask=mask, **gen), expected)
    paged.hf_paged_use_engine = False  # stock generation over an attached PagedCache: its steps run dense too
    assert torch.equal(paged.generate(ids, attention_mask=mask, **gen), expected)
    out = engine.generate([random_rows([20], seed=1)[0]], SamplingParams(max_new_tokens=2))[0]
    assert out.error is not None and "kv_b_proj is now a Linear (bias=True)" in str(out.error)


def test_an_offloaded_or_meta_up_projection_is_refused():
    from hf_paged.hf.latent import latent_refusal

    _, paged = peaked_pair("deepseek_v3")
    assert latent_refusal(paged) is None
    module = next(m for m in paged.modules() if hasattr(m, "kv_b_proj"))
    module.kv_b_proj.to("meta")
    assert "not offloaded" in latent_refusal(paged)
