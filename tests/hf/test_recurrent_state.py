"""Models whose layers carry a per-sequence state (a convolution window and an SSM or gated delta-rule state)
served paged (issue 55), checked against stock transformers (sdpa, its own linear-attention cache).

Seven hybrid families, each a tiny model with one recurrent and one attention layer (Nemotron-H: one of
each of its four kinds), mixer sizes small and pairwise different (so a swapped factor changes a shape),
at least 2 heads and groups where the family has them: drop-in `generate` (through the engine and over a
`PagedCache`), beams, returned caches and `pipeline`; the engine with chunked prefill, preemption, n-gram
speculation and a shared prefix, rollback to every draft's snapshot, seeded sampling; the state pool's
bytes against the formula; checkpoint intervals; and what is refused. Greedy ids are compared exactly.

At transformers' initialisation a tiny model's mixers add ~1e-4 to a residual stream of ~0.1 and forget
within a few tokens, so a lost or leaked state would change no token. `make_state_matter` gives every mixer
a long memory and no skip past its state, and scales every mixer's and attention's output to one size;
q/k projections are sharpened (`family_sweep.sharpen`). Zeroing the state after 32 tokens then changes
most of the next 8 tokens in every family, and so does switching attention off.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from family_configs import FAMILY_CONFIG
from family_sweep import sharpen, tiny_config
from hf_paged import Engine, SamplingParams
from hf_paged.hf import PagedCache
from hf_paged.hf.support import _config_dict
from hf_paged.kv_spec import LinearState, state_specs
from hf_paged.spec_decode.proposal import Proposal
from hf_paged.state_spec import state_shape
from layer_kinds import engine_scenario, greedy_alone, left_padded, random_rows, word_tokenizer
from tiny_models import VOCAB, cache_of, with_cache

NEW = 8
BLOCK = 16
_GATED_DELTA = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                    linear_value_head_dim=12, linear_conv_kernel_dim=4)
# Per family, the mixer sizes on top of the sweep's tiny config (hidden_size 32; Mamba 2 widths are heads x
# head_dim = expand x hidden = 64 where the family derives one from the other).
FAMILIES = {
    "qwen3_5_text": _GATED_DELTA,
    "qwen3_next": _GATED_DELTA,
    "granitemoehybrid": dict(mamba_n_heads=8, mamba_d_head=8, mamba_d_state=12, mamba_n_groups=2,
                             mamba_chunk_size=16, shared_intermediate_size=32),
    "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=12, n_groups=2, chunk_size=16,
                       moe_shared_expert_intermediate_size=32),
    "falcon_h1": dict(mamba_d_ssm=48, mamba_n_heads=4, mamba_d_head=12, mamba_d_state=8, mamba_n_groups=2,
                      mamba_chunk_size=16),
    "jamba": dict(mamba_d_state=12, mamba_dt_rank=4),
    "bamba": dict(mamba_n_heads=8, mamba_d_head=8, mamba_d_state=12, mamba_n_groups=2, mamba_chunk_size=16),
}
IDS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
TWO_FAMILIES = ["qwen3_5_text", "bamba"]  # one gated delta-rule mixer, one Mamba 2


def family_config(model_type: str, **overrides):
    return tiny_config(CONFIG_MAPPING[model_type],
                       overrides={**(FAMILY_CONFIG.get(model_type) or {}), **FAMILIES[model_type], **IDS, **overrides})


def build(config, attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn).eval()
    sharpen(model)
    return model


OUTPUT_NORM = 0.3  # each mixer's and attention's output, per token (the embeddings' is ~0.1)


def make_state_matter(model: torch.nn.Module) -> None:
    """Long memory (every A = 0.01: a state decays by exp(-0.01 dt) a token), no skip term past the state
    (D = 0), and every mixer's and attention's output projection scaled so that its output has norm
    `OUTPUT_NORM` on a probe prompt."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                param.fill_(math.log(0.01))
            elif leaf == "D":
                param.zero_()
    outputs = {m: m.out_proj for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "out_proj")}
    outputs.update({m: m.o_proj for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "o_proj")})
    norms = {}

    def record(module, args, out):
        norms[module] = float((out[0] if isinstance(out, tuple) else out).norm(dim=-1).mean())

    hooks = [m.register_forward_hook(record) for m in outputs]
    try:
        with torch.no_grad():
            model(torch.tensor(random_rows([40], seed=99)), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        for module, proj in outputs.items():
            proj.weight.mul_(OUTPUT_NORM / norms[module])


def build_pair(config) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(stock, paged): sdpa and "hf_paged" models with the same weights, whose states matter."""
    stock = build(config, "sdpa")
    make_state_matter(stock)
    paged = build(config, "hf_paged")
    paged.load_state_dict(stock.state_dict())
    return stock, paged


_BUILT: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def built():
    """Each family's (stock, paged) pair, built once per module the first time a test asks for it."""
    yield _BUILT
    _BUILT.clear()


def models_of(built: dict, model_type: str) -> tuple:
    if model_type not in built:
        built[model_type] = build_pair(family_config(model_type))
    return built[model_type]


@pytest.fixture(params=list(FAMILIES))
def family(request, built):
    return models_of(built, request.param)


def _cache_generate(paged, *args, **kwargs):
    """Stock generate over a `PagedCache` (the drop-in path, not the engine)."""
    paged.hf_paged_use_engine = False
    try:
        return paged.generate(*args, **kwargs)
    finally:
        paged.__dict__.pop("hf_paged_use_engine", None)


def test_the_tiny_models_states_matter(family):
    """The premise of every parity check here: stock's tokens change when its state is zeroed after 32 of
    40 prompt tokens (a lost, stale or leaked state in the paged pool shows)."""
    stock, _ = family
    for prompt in random_rows([40, 44], seed=11):
        ids = torch.tensor([prompt])
        gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        intact = stock.generate(ids, attention_mask=torch.ones_like(ids), **gen)
        cache = DynamicCache(config=stock.config)
        with torch.no_grad():
            stock(ids[:, :32], use_cache=True, **with_cache(cache))
        for layer in cache.layers:
            for states in (getattr(layer, "conv_states", None) or {}, getattr(layer, "recurrent_states", None) or {}):
                for state in states.values():
                    if state is not None:
                        state.zero_()
        zeroed = stock.generate(ids, attention_mask=torch.ones_like(ids), **gen, **with_cache(cache))
        assert not torch.equal(intact, zeroed)


# ------------------------------------------------------------------------------------------ drop-in
@pytest.mark.parametrize("route", ["engine", "cache"])
def test_drop_in_generate_on_a_left_padded_batch_twice_matches_stock(family, route):
    """`generate` routed to the engine (the default) or run by stock generate over a `PagedCache` (rows of
    the state pool as one contiguous run: the stock mixers see a `[batch, ...]` view), twice: the second
    call must not read the first's state."""
    stock, paged = family
    ids, mask = left_padded(random_rows([40, 13, 29]) + random_rows([40]))
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    expected = stock.generate(ids, attention_mask=mask, **gen)
    run = paged.generate if route == "engine" else lambda *a, **k: _cache_generate(paged, *a, **k)
    assert torch.equal(run(ids, attention_mask=mask, **gen), expected)
    assert torch.equal(run(ids, attention_mask=mask, **gen), expected)


# ------------------------------------------------------------------------------------------ engine
def test_engine_chunked_preempting_speculating_and_caching_a_shared_prefix_matches_stock(family):
    """Chunks of 16 tokens resume the state; a tight pool preempts (the state is recomputed); rejected
    n-gram drafts roll the state back to a snapshot; a prompt sharing 48 tokens with an earlier one
    restores the state checkpointed at token 48 and answers as stock does alone."""
    stock, paged = family
    figures = engine_scenario(stock, paged, BLOCK, NEW)
    assert figures["cached_tokens"] >= 48
    assert figures["preemptions"] > 0
    assert figures["drafts"] > 0


class WrongAtProposer:
    """Drafts stock's own greedy continuation with one token wrong, at a position that moves each call
    (0, 1, .., k, where k: none wrong), so verification keeps every number of drafts in turn and the state
    rolls back to each snapshot of the step."""

    def __init__(self, continuations: list[list[int]]):
        self.continuations = continuations
        self.calls = 0

    def propose(self, requests):
        out = []
        for r in requests:
            full = next((c for c in self.continuations if c[: len(r.token_ids)] == r.token_ids), [])
            drafts = full[len(r.token_ids): len(r.token_ids) + r.num_tokens]
            wrong = self.calls % (r.num_tokens + 1)
            self.calls += 1
            if wrong < len(drafts):
                drafts[wrong] = 3 + (drafts[wrong] - 2) % (VOCAB - 3)  # another id, never a special one
            out.append(Proposal(drafts))
        return out

    def free(self, request_id: str) -> None:
        pass


def test_speculative_rollback_lands_on_the_snapshot_of_every_draft(family):
    """Verification keeps 0, 1, 2 or 3 of the 3 drafts in turn: the state goes back to the snapshot after
    the last kept one (or keeps the whole step), and every token is stock's."""
    stock, paged = family
    prompts = random_rows([19, 6], seed=9)
    new = 12
    expected = greedy_alone(stock, prompts, new)
    engine = Engine(paged, block_size=BLOCK, num_blocks=64, speculative_method="ngram", num_speculative_tokens=3)
    engine.core.drafter.proposer = WrongAtProposer([p + e for p, e in zip(prompts, expected)])
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=new, min_new_tokens=new))
    assert [o.token_ids for o in outs] == expected
    metrics = engine.metrics()
    assert 0 < metrics["vllm:spec_decode_num_accepted_tokens"] < metrics["vllm:spec_decode_num_draft_tokens"]
    assert metrics["vllm:num_preemptions"] == 0  # every rollback found its snapshot
    assert engine.kv.state_slots.num_free == engine.kv.state_slots.num_rows - engine.kv.state_slots.num_checkpoints


def test_seeded_sampling_is_reproducible_across_fresh_engines(family):
    """The same seeds on two fresh engines give the same tokens, the second after serving other prompts
    first (a state left in a reused row, or a restored checkpoint of another prompt, would change them)."""
    _, paged = family
    prompts = random_rows([21, 9, 35], seed=5)
    params = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.8, top_p=0.95, seed=1234)
    first = [o.token_ids for o in Engine(paged, block_size=BLOCK, num_blocks=64).generate(prompts, params)]
    engine = Engine(paged, block_size=BLOCK, num_blocks=64, max_num_batched_tokens=16)
    engine.generate(random_rows([30, 50], seed=6), SamplingParams(max_new_tokens=NEW))
    assert [o.token_ids for o in engine.generate(prompts, params)] == first
    greedy = [o.token_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW))]
    assert first != greedy  # it sampled


# ------------------------------------------------------------------------------------------ memory
def test_state_bytes_per_sequence_equal_the_formula_on_the_pools_tensors(family):
    """After a step, every recurrent layer's row of the pool has the formula's shapes (`state_spec`,
    from the config alone) and its bytes (`StateShape.bytes`: a float32 model, a float32 recurrent
    state); layers without a state keep none."""
    stock, paged = family
    engine = Engine(paged, block_size=BLOCK, num_blocks=32)
    engine.generate(random_rows([20]), SamplingParams(max_new_tokens=2))
    kv = engine.kv
    text = paged.config.get_text_config(decoder=True)
    shape = state_shape(_config_dict(text))
    kinds = list(getattr(text, "layer_types", None) or text.layers_block_type)
    recurrent = [i for i, t in enumerate(kinds) if t in ("linear_attention", "hybrid")]
    assert recurrent and set(kv.states.shapes) == set(recurrent) == set(state_specs(kv.layer_specs))
    total = 0
    for i in recurrent:
        spec = kv.layer_specs[i]
        assert spec.state == kv.states.shapes[i] == shape
        assert spec.owns_kv == (kinds[i] == "hybrid") and isinstance(spec, LinearState) == (kinds[i] != "hybrid")
        row_bytes = 0
        for k in range(shape.num_states):
            conv, rec = kv.states.conv[i][k][0], kv.states.recurrent[i][k][0]
            assert tuple(conv.shape) == shape.conv[k] and tuple(rec.shape) == shape.recurrent[k]
            assert conv.dtype == rec.dtype == torch.float32
            row_bytes += conv.numel() * conv.element_size() + rec.numel() * rec.element_size()
        assert row_bytes == shape.bytes(4, 4)
        total += row_bytes
    assert kv.states.bytes_per_row() == total
    # the stock cache of one sequence holds as many bytes in those layers
    cache = DynamicCache(config=stock.config)
    with torch.no_grad():
        stock(torch.tensor(random_rows([20])), use_cache=True, **with_cache(cache))
    stock_bytes = sum(t.numel() * t.element_size() for i in recurrent
                      for states in (cache.layers[i].conv_states, cache.layers[i].recurrent_states)
                      for t in states.values() if t is not None)
    assert stock_bytes == total


# ------------------------------------------------------------------------------------------ beams
@pytest.mark.parametrize("model_type", TWO_FAMILIES)
def test_drop_in_beam_search_matches_stock(built, model_type, monkeypatch):
    """Beams reorder the state rows with the K/V (`PagedCache._reindex`)."""
    stock, paged = models_of(built, model_type)
    reorders = []
    original = PagedCache._reindex
    monkeypatch.setattr(PagedCache, "_reindex", lambda self, rows: (reorders.append(rows), original(self, rows))[1])
    ids, mask = left_padded(random_rows([23, 11], seed=7))
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, num_beams=2, do_sample=False)
    assert torch.equal(paged.generate(ids, attention_mask=mask, **gen), stock.generate(ids, attention_mask=mask, **gen))
    assert reorders  # the paged cache served the beams


# ------------------------------------------------------------------------------------------ returned cache
def _turns(model, ids, mask, news, generate):
    """Generate, then continue from the returned cache once per entry of `news` (new tokens per row)."""
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    outs, cache, forwarded = [], None, []
    for new in [None, *news]:
        if new is not None:
            ids = torch.cat([outs[-1].sequences, new], dim=1)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], ids.shape[1] - mask.shape[1])], dim=1)
        out = generate(ids, attention_mask=mask, **gen, **(with_cache(cache) if cache is not None else {}))
        outs.append(out)
        cache = cache_of(out)
        forwarded.append(getattr(model, "hf_paged_last_metrics", {}).get("num_forward_tokens"))
    return [out.sequences for out in outs], forwarded


@pytest.mark.parametrize("route", ["engine", "cache"])
@pytest.mark.parametrize("model_type", TWO_FAMILIES)
def test_continuing_from_the_returned_cache_matches_stock(built, model_type, route):
    """Two more turns from the cache `generate` returned (the engine's kept rows, or the `PagedCache`):
    each row's state continues where it stopped; the engine computes only the new tokens."""
    stock, paged = models_of(built, model_type)
    rows = random_rows([20, 9], seed=1)
    ids, mask = left_padded(rows)
    g = torch.Generator().manual_seed(0)
    news = [torch.randint(3, VOCAB, (len(rows), 3), generator=g) for _ in range(2)]
    want, _ = _turns(stock, ids, mask, news, stock.generate)
    run = paged.generate if route == "engine" else lambda *a, **k: _cache_generate(paged, *a, **k)
    got, forwarded = _turns(paged, ids, mask, news, run)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    if route == "engine":  # per row: its last token, the 3 new ones, then the decodes
        assert forwarded[1:] == [len(rows) * (1 + 3 + NEW - 1)] * 2


# ------------------------------------------------------------------------------------------ pipeline
def test_text_generation_pipeline_matches_stock(built):
    """`pipeline("text-generation")` over a word-level tokenizer ("w<id>" is id <id>)."""
    from transformers import pipeline

    stock, paged = models_of(built, "bamba")
    tokenizer = word_tokenizer()
    texts = [" ".join(f"w{t}" for t in row) for row in random_rows([19, 6, 33], seed=8)]
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, batch_size=2)
    want = pipeline("text-generation", model=stock, tokenizer=tokenizer)(texts, **gen)
    got = pipeline("text-generation", model=paged, tokenizer=tokenizer)(texts, **gen)
    assert got == want
    assert all(len(r[0]["generated_text"].split()) > len(t.split()) for r, t in zip(got, texts))


# ------------------------------------------------------------------------------------------ checkpoints
def _shared_prefix_run(stock, paged, **engine_kwargs) -> int:
    shared = random_rows([48], seed=2)[0]
    prompts = random_rows([5, 30], seed=3, prefix=shared)
    engine = Engine(paged, block_size=BLOCK, num_blocks=64, **engine_kwargs)
    params = SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW)
    outs = engine.generate(prompts[:1], params) + engine.generate(prompts[1:], params)
    assert [o.token_ids for o in outs] == greedy_alone(stock, prompts, NEW)
    return outs[1].metrics.num_cached_tokens


def test_a_coarser_checkpoint_interval_caches_up_to_its_last_boundary(built):
    """Interval 32: the state is checkpointed at token 32 only, so a prompt sharing 48 tokens gets 32
    from the cache (the attention blocks up to 48 alone cannot restore the state); no checkpoints at
    all, none; the default interval (a block), all 48."""
    stock, paged = models_of(built, "qwen3_5_text")
    assert _shared_prefix_run(stock, paged, state_checkpoint_interval=32) == 32
    assert _shared_prefix_run(stock, paged, max_state_checkpoints=0) == 0
    assert _shared_prefix_run(stock, paged) == 48


@pytest.mark.parametrize("knob, value", [("state_checkpoint_interval", 20), ("state_checkpoint_interval", -1),
                                         ("state_checkpoint_interval", 0), ("max_state_checkpoints", -1),
                                         ("max_state_checkpoints", 1.5)])
def test_bad_checkpoint_knobs_are_refused_by_name(built, knob, value):
    _, paged = models_of(built, "qwen3_5_text")
    with pytest.raises(ValueError, match=knob):
        Engine(paged, block_size=BLOCK, num_blocks=16, **{knob: value})


# ------------------------------------------------------------------------------------------ refusals
def test_a_pure_recurrent_model_is_refused_for_having_no_attention():
    """Mamba keeps no K/V: nothing for paged blocks to hold, nothing to key a state checkpoint by. Refused
    for that reason (not for its layer type) by the engine, the cache and the load."""
    config = tiny_config(CONFIG_MAPPING["mamba"], overrides={**IDS})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    reason = r"model_type='mamba': it has no attention layer"
    with pytest.raises(ValueError, match=reason):
        Engine(model, block_size=BLOCK, num_blocks=16)
    with pytest.raises(ValueError, match=reason):
        PagedCache(config, block_size=BLOCK)
    with pytest.raises(ValueError, match=reason):
        AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="hf_paged")


def test_a_family_without_a_state_formula_is_refused_naming_it(monkeypatch):
    from hf_paged import state_spec

    config = family_config("bamba")
    model = build(config, "sdpa")
    monkeypatch.delitem(state_spec.STATE_FORMULAS, "bamba")
    with pytest.raises(ValueError, match=r"does not know the per-sequence state of model_type='bamba'"):
        Engine(model, block_size=BLOCK, num_blocks=16)
    with pytest.raises(ValueError, match=r"does not know the per-sequence state of model_type='bamba'"):
        PagedCache(config, block_size=BLOCK)


def test_a_state_without_a_convolution_window_does_not_crash_the_cache():
    """MiniMax's lightning attention keeps a recurrent state and no convolution window
    (`StateShape(conv=((),), ...)`): a cache is built for it, or it is refused with a ValueError."""
    config = tiny_config(CONFIG_MAPPING["minimax"], overrides={**(FAMILY_CONFIG.get("minimax") or {}), **IDS})
    try:
        cache = PagedCache(config, block_size=BLOCK)
    except ValueError:
        return
    assert cache.kv.states is not None and cache.kv.states.shapes
