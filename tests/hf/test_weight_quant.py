"""Weight-only quantised models through hf_paged: a model quantised by transformers' own torchao quantizer
(`from_pretrained(..., quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))`) keeps its `nn.Linear`
modules and swaps their weights for torchao tensor subclasses. The drop-in `generate` and the `Engine` must
give the greedy ids stock transformers (sdpa, `DynamicCache`) gives on the same quantised model, and the
engine's fast oneDNN linear (`hf.linear`) must leave such weights to their own `F.linear`.

Greedy ids are compared exactly; nothing here compares logits (the weight-only matmul is torchao's in both
runs, only attention's fp32 summation order differs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchao")
from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_  # noqa: E402
from transformers import AutoModelForCausalLM, TorchAoConfig  # noqa: E402

from hf_paged import Engine, SamplingParams  # noqa: E402
from hf_paged.hf import linear  # noqa: E402
from hf_paged.hf.weights import weights_fingerprint  # noqa: E402
from tiny_models import left_padded_batch, tiny_model  # noqa: E402

LENGTHS = [5, 17, 33, 16]  # cross block boundaries at block_size 16
NEW_TOKENS = 20
# Weight-only configs that run on a CPU: int8 (per row, the brief's), and float8 (per row, e4m3).
QUANT_CONFIGS = {"int8": Int8WeightOnlyConfig, "float8": Float8WeightOnlyConfig}


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny random Llama saved as safetensors: the quantizer runs at `from_pretrained`, as for users."""
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama").save_pretrained(path)
    return path


def load_quantised(path, kind: str = "int8", attn_implementation: str = "sdpa"):
    config = TorchAoConfig(QUANT_CONFIGS[kind]())
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=torch.float32,
                                                 attn_implementation=attn_implementation)
    return model.eval()


@pytest.fixture
def fast_kernel_calls(monkeypatch):
    """The weight types the fast oneDNN linear was called with."""
    if not linear.is_available():
        pytest.skip("torch built without oneDNN")
    calls = []
    kernel = linear._probe()

    def counting(input, weight, *args):
        calls.append(type(weight))
        return kernel(input, weight, *args)

    monkeypatch.setattr(linear, "_kernel", counting)
    return calls


def _stock_greedy(model, input_ids, attention_mask, new_tokens=NEW_TOKENS) -> torch.Tensor:
    """Stock `generate` (sdpa, DynamicCache): the oracle, prompt and new ids."""
    model.set_attn_implementation("sdpa")
    return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False)


def _prompts(input_ids, attention_mask) -> list[list[int]]:
    return [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]


@pytest.mark.parametrize("kind", sorted(QUANT_CONFIGS))
def test_the_quantizer_really_swapped_the_weights(tiny_checkpoint, kind):
    """Not vacuous: the decoder's linears hold subclasses that report float32 (what sent them to oneDNN)."""
    model = load_quantised(tiny_checkpoint, kind)
    weight = model.model.layers[0].self_attn.q_proj.weight
    assert type(weight) is not torch.nn.Parameter and isinstance(weight, torch.Tensor)
    assert weight.dtype == torch.float32
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


@pytest.mark.parametrize("kind", sorted(QUANT_CONFIGS))
def test_dropin_generate_matches_stock(tiny_checkpoint, kind, engine_calls, fast_kernel_calls):
    input_ids, attention_mask = left_padded_batch(LENGTHS)
    model = load_quantised(tiny_checkpoint, kind)
    ref = _stock_greedy(model, input_ids, attention_mask)
    model.set_attn_implementation("hf_paged")
    out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False)
    assert engine_calls == [True]  # served by the engine, not stock's fallback
    assert torch.equal(out, ref)
    model.hf_paged_use_engine = False  # stock's generate loop over a PagedCache
    out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(out, ref)
    # Only the plain lm_head (transformers leaves the output embedding unquantised) took the fast kernel.
    assert set(fast_kernel_calls) <= {torch.nn.Parameter}


@pytest.mark.parametrize("kind", sorted(QUANT_CONFIGS))
def test_engine_matches_stock_and_reuses_its_prefix_cache(tiny_checkpoint, kind):
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=1)
    model = load_quantised(tiny_checkpoint, kind)
    ref = _stock_greedy(model, input_ids, attention_mask)[:, input_ids.shape[1]:].tolist()
    engine = Engine(model, block_size=16, num_blocks=64)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, temperature=0.0)
    prompts = _prompts(input_ids, attention_mask)
    assert [o.token_ids for o in engine.generate(prompts, params)] == ref
    # Again: the weights fingerprint of subclass weights is stable, so full prompt blocks are hits.
    again = engine.generate(prompts, params)
    assert [o.token_ids for o in again] == ref
    # Every full block but one holding the last prompt token (its logits must be computed).
    assert sum(o.metrics.num_cached_tokens for o in again) == 16 * sum((n - 1) // 16 for n in LENGTHS)


def test_fingerprint_is_stable_and_sees_a_requantised_weight(tiny_checkpoint):
    model = load_quantised(tiny_checkpoint)
    first = weights_fingerprint(model)
    assert weights_fingerprint(model) == first
    layer = model.model.layers[0].mlp.up_proj
    layer.weight = torch.nn.Parameter(torch.randn(layer.weight.shape), requires_grad=False)
    quantize_(layer, Int8WeightOnlyConfig())  # a new subclass parameter
    assert weights_fingerprint(model) != first


def _linears():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8, bias=False))


def test_enable_leaves_quantised_linears_alone(fast_kernel_calls):
    model = _linears()
    quantize_(model[0], Int8WeightOnlyConfig())
    assert linear.enable(model) == 1  # only the plain one
    assert "forward" not in model[0].__dict__ and "forward" in model[2].__dict__
    x = torch.randn(5, 24)
    with torch.inference_mode(), linear.fast_linear():
        model(x)
    assert fast_kernel_calls == [torch.nn.Parameter]


@pytest.mark.parametrize("kind", sorted(QUANT_CONFIGS))
def test_a_linear_quantised_after_enable_runs_its_own_f_linear(kind, fast_kernel_calls):
    """oneDNN has no kernel for a subclass weight (NotImplementedError before the guard): the enabled
    forward hands it to the subclass's `F.linear`, bit for bit what stock runs."""
    model = _linears()
    assert linear.enable(model) == 2
    quantize_(model, QUANT_CONFIGS[kind]())
    assert type(model[0].weight) is not torch.nn.Parameter and model[0].weight.dtype == torch.float32
    x = torch.randn(3, 7, 24)  # several rows: the fast path's shape on any thread count
    with torch.inference_mode():
        expected = F.linear(x, model[0].weight, model[0].bias)
        with linear.fast_linear():
            out = model[0](x)
    assert torch.equal(out, expected)
    assert fast_kernel_calls == []


@pytest.mark.slow
def test_smollm2_int8_weight_only_dropin_and_engine_match_stock():
    from hf_paged.defaults.models import load_default
    from hf_paged.defaults.prompts import CHAT_PROMPTS, chat_inputs

    new_tokens = 16
    model, tokenizer = load_default(quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))
    assert type(model.model.layers[0].mlp.down_proj.weight) is not torch.nn.Parameter
    prompts = [CHAT_PROMPTS[i] for i in (0, 3, 7)]  # short to long
    inputs = chat_inputs(tokenizer, prompts)
    ref = _stock_greedy(model, inputs["input_ids"], inputs["attention_mask"], new_tokens)
    model.set_attn_implementation("hf_paged")
    out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    assert torch.equal(out, ref)
    engine = Engine(model, tokenizer)
    params = SamplingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens, temperature=0.0)
    results = engine.generate(_prompts(inputs["input_ids"], inputs["attention_mask"]), params)
    assert [o.token_ids for o in results] == ref[:, inputs["input_ids"].shape[1]:].tolist()
