"""A Gemma 4 assistant (`gemma4_assistant`) as the engine's proposer (`SharedKVDrafterProposer`): it reads
the target's stored K/V out of the paged pool and the target's last hidden state, drafts as stock's
`SinglePositionMultiTokenCandidateGenerator` does, and is lossless; and drop-in
`generate(assistant_model=...)` gives stock's tokens.

One tiny Gemma 4 target (6 layers alternating sliding (window 8) and full attention, the last 2 reusing the
K/V of layers 2 and 3, per-layer K/V shapes) and a 2-layer assistant built for it (its backbone width is the
target's); q/k projections and norms sharpened x10 so that attention is peaked. Greedy ids compared exactly.
Run with -s to see the measured acceptance rate (random tiny weights: reported, not targeted).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator
from transformers.models.gemma4 import Gemma4TextConfig
from transformers.models.gemma4_assistant import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

from hf_paged import Engine, SamplingParams
from hf_paged.spec_decode import Proposal, SharedKVDrafterProposer, make_proposer
from layer_kinds import GEMMA4_FULL_LAYERS, GEMMA_TEXT, GEMMA_WINDOW

VOCAB = 96
WINDOW = GEMMA_WINDOW
NEW = 16
K = 3
_TEXT = dict(GEMMA_TEXT, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, **GEMMA4_FULL_LAYERS)
# The assistant: its own (smaller) width, no per-layer inputs, every layer reading the target's K/V.
_ASSISTANT_TEXT = dict(_TEXT, hidden_size=32, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                       num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=2)
PROMPTS = [list(range(5, 17)), [(7 * i) % (VOCAB - 3) + 3 for i in range(37)], [7, 7, 7, 9, 9, 9] * 2 + [7, 7]]


def _sharpen(model: torch.nn.Module, factor: float = 10.0) -> None:
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "q_norm", "k_norm"):
                module.weight.mul_(factor)


def _target(attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Gemma4TextConfig(**copy.deepcopy(_TEXT)), attn_implementation=attn)
    _sharpen(model)
    return model.eval()


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(1)
    config = Gemma4AssistantConfig(text_config=Gemma4TextConfig(**_ASSISTANT_TEXT),
                                   backbone_hidden_size=_TEXT["hidden_size"])
    assistant = Gemma4AssistantForCausalLM(config).eval()
    _sharpen(assistant)
    assistant.generation_config.num_assistant_tokens = K
    return _target("sdpa"), _target("hf_paged"), assistant


@pytest.fixture(scope="module")
def reference(models):
    """The engine's greedy tokens without any proposer."""
    engine = Engine(models[1], block_size=4)
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0))]


def _engine(models, **kwargs) -> Engine:
    return Engine(models[1], block_size=4, draft_model=models[2], num_speculative_tokens=K, **kwargs)


def _greedy(engine: Engine) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0))]


def test_engine_with_assistant_is_lossless(models, reference):
    """Block size 4 and window 8: the sliding group releases blocks, so the drafter reads a table with holes."""
    engine = _engine(models)
    assert isinstance(engine.proposer, SharedKVDrafterProposer)
    assert _greedy(engine) == reference
    metrics = engine.metrics()
    assert metrics["vllm:spec_decode_num_drafts"] > 0 and engine.proposer.num_forwards > 0
    print(f"\ngemma4_assistant proposer (tiny random weights, k={K}): acceptance_rate="
          f"{metrics['acceptance_rate']:.3f} ({metrics['vllm:spec_decode_num_accepted_tokens']}/"
          f"{metrics['vllm:spec_decode_num_draft_tokens']} drafts), per position {metrics['acceptance_rate_per_pos']}")


def test_first_drafts_are_stocks(models):
    """After the prompt, the drafts equal stock's candidate generator's (same hidden state, position,
    K/V and sliding window as stock's `SinglePositionMultiTokenCandidateGenerator`)."""
    stock, _, assistant = models
    engine = _engine(models)
    first: dict[int, list[int]] = {}
    propose = engine.proposer.propose

    def recording(asks):
        proposals = propose(asks)
        for ask, proposal in zip(asks, proposals):
            first.setdefault(len(ask.token_ids), proposal.token_ids)
        return proposals

    engine.proposer.propose = recording
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, temperature=0))
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = stock(ids, output_hidden_states=True, return_shared_kv_states=True, use_cache=True)
        ids = torch.cat([ids, out.logits[:, -1:].argmax(-1)], dim=1)
        generator = SinglePositionMultiTokenCandidateGenerator(assistant, stock.get_input_embeddings(),
                                                               GenerationConfig(max_length=1000))
        candidates, _ = generator.get_candidates(ids, {}, out, is_first_iteration=False, n_last_matches=0)
        assert first[len(prompt) + 1] == candidates[0, ids.shape[1]:].tolist(), prompt


def test_hidden_states_follow_verification(models, reference):
    """With oracle drafts (the reference continuation, its last one wrong), verification accepts several
    tokens, or all and a bonus: the hidden state the drafter gets is always stock's final hidden state at
    the position that produced the request's last committed token."""
    stock, _, _ = models
    engine = _engine(models)
    seen = []

    def oracle(asks):
        out = []
        for ask in asks:
            i = next(j for j, p in enumerate(PROMPTS) if ask.token_ids[: len(p)] == p)
            done = len(ask.token_ids) - len(PROMPTS[i])
            drafts = list(reference[i][done:done + ask.num_tokens])
            if len(seen) % 2 and drafts:
                drafts[-1] = (drafts[-1] + 1) % VOCAB  # every other ask, the last draft is rejected
            seen.append((list(ask.token_ids), ask.hidden_state))
            out.append(Proposal(drafts))
        return out

    engine.proposer.propose = oracle
    assert _greedy(engine) == reference
    metrics = engine.metrics()
    assert metrics["vllm:spec_decode_num_accepted_tokens"] >= len(seen)  # more than one token per forward
    with torch.no_grad():
        for token_ids, hidden in seen:
            if hidden is None:
                continue
            expected = stock(torch.tensor([token_ids[:-1]]), output_hidden_states=True).hidden_states[-1][0, -1]
            torch.testing.assert_close(hidden.float(), expected, atol=1e-4, rtol=1e-4)
    assert sum(hidden is not None for _, hidden in seen) >= len(seen) - len(PROMPTS)


def test_generate_with_assistant_model_is_stocks(models, monkeypatch):
    """Drop-in `generate(assistant_model=...)` runs in the engine with the assistant as its proposer."""
    stock, paged, assistant = models
    calls = []
    propose = SharedKVDrafterProposer.propose
    monkeypatch.setattr(SharedKVDrafterProposer, "propose", lambda self, asks: calls.append(1) or propose(self, asks))
    for prompt in PROMPTS[:2]:
        ids = torch.tensor([prompt])
        expected = stock.generate(ids, do_sample=False, max_new_tokens=NEW, assistant_model=assistant)
        got = paged.generate(ids, do_sample=False, max_new_tokens=NEW, assistant_model=assistant)
        assert got.tolist() == expected.tolist()
    assert calls


def test_generate_fallback_with_assistant_model_is_stocks(models):
    """A call the engine does not serve runs stock's assisted generation, with transformers' attention for
    the call (a PagedCache hands no dense K/V to the assistant), and the model stays paged afterwards."""
    stock, paged, assistant = models
    ids = torch.tensor([PROMPTS[1]])
    expected = stock.generate(ids, do_sample=False, max_new_tokens=NEW, assistant_model=assistant)
    paged.hf_paged_use_engine = False
    try:
        with pytest.warns(UserWarning, match="Gemma 4 assistant"):
            got = paged.generate(ids, do_sample=False, max_new_tokens=NEW, assistant_model=assistant)
    finally:
        del paged.hf_paged_use_engine
    assert got.tolist() == expected.tolist()
    assert paged.config._attn_implementation == "hf_paged"


def test_make_proposer_checks_the_assistant(models):
    stock, paged, assistant = models
    common = dict(method=None, num_tokens=K, lookup_min=1, lookup_max=3, target_num_blocks=8, max_num_seqs=1,
                  block_size=4)
    with pytest.raises(ValueError, match="target_model= and target_kv="):
        make_proposer(draft_model=assistant, **common)
    wide = AutoModelForCausalLM.from_config(Gemma4TextConfig(**dict(_TEXT, hidden_size=32)))
    with pytest.raises(ValueError, match="hidden size 64"):
        make_proposer(draft_model=assistant, target_model=wide, target_kv=object(), **common)
