"""Disaggregated prefill/decode on SmolLM2-135M-Instruct (gloo, CPU): 12 chat prompts of 20-600
tokens, which share the chat template's system prompt, give one `Engine`'s greedy and seeded outputs
token for token, with 2 prefill + 1 decode workers, prefix caching on. The K/V moved per request is
its prompt's, to the byte; one tensor message per request. (Both topologies, 1 + 2 and 2 + 1, run on
tiny models in `test_disagg.py`; this is the real checkpoint's K/V over the same path.) The same
parity runs with NCCL on two GPUs where there are two."""

from __future__ import annotations

import functools

import pytest
import torch

from hf_paged import Engine, SamplingParams
from hf_paged.disagg import DisaggregatedEngine

pytest.importorskip("gguf")
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_new_tokens=8)


def _factory(device: str = "cpu"):
    from hf_paged.defaults.models import load_default

    return functools.partial(load_default, attn_implementation="hf_paged", device=device)


@pytest.fixture(scope="module")
def prompts():
    from hf_paged.defaults.models import DefaultModelNotInstalledError, load_default_tokenizer
    from hf_paged.defaults.prompts import mixed_length_prompts

    try:
        tokenizer = load_default_tokenizer()
    except DefaultModelNotInstalledError as exc:  # a GPU machine the weights did not reach
        pytest.skip(f"SmolLM2's weights are not installed here: {exc}")
    out = mixed_length_prompts(tokenizer, 12, 20, 600, seed=3)
    assert min(map(len, out)) >= 20 and max(map(len, out)) <= 600
    return out


def _seeded(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=8, temperature=0.8, top_k=40, seed=1000 + i) for i in range(n)]


@pytest.fixture(scope="module")
def reference(prompts):
    model, tokenizer = _factory()()
    engine = Engine(model, tokenizer, block_size=16)
    greedy = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    seeded = [o.token_ids for o in engine.generate(prompts[:4], _seeded(4))]
    return greedy, seeded, engine.cache.kv.kv_numel_per_token() * 4  # fp32 bytes per token


@pytest.mark.parametrize("num_prefill, num_decode", [(2, 1)])
def test_smollm2_disaggregated_equals_one_engine(prompts, reference, num_prefill, num_decode):
    greedy, seeded, kv_bytes_per_token = reference
    with DisaggregatedEngine(_factory(), num_prefill=num_prefill, num_decode=num_decode) as engine:
        out = engine.generate(prompts, GREEDY)
        assert [o.token_ids for o in out] == greedy
        m = engine.metrics()
        moved = [len(p) for p, o in zip(prompts, out)]
        assert m["kv_bytes_transferred"] == sum(moved) * kv_bytes_per_token
        assert sum(t["count"] for t in m["transfers"].values()) == len(prompts)
        assert [o.token_ids for o in engine.generate(prompts[:4], _seeded(4))] == seeded


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs two CUDA GPUs: NCCL refuses two ranks of one communicator on one GPU")
def test_smollm2_disaggregated_over_nccl_equals_one_engine(prompts):
    """Two processes (1 prefill + 1 decode), one GPU each; K/V go over NCCL."""
    model, tokenizer = _factory("cuda")()
    expected = [o.token_ids for o in Engine(model, tokenizer, block_size=16).generate(prompts, GREEDY)]
    del model
    with DisaggregatedEngine(_factory("cuda"), num_prefill=1, num_decode=1, device="cuda") as engine:
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected
