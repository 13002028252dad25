"""Families whose attention does not go through transformers' attention interface are refused with
one clear ValueError, as early as possible, instead of crashing deep inside or attending wrongly:

* at load (`from_config` / `from_pretrained` with attn_implementation="hf_paged"): MPT, Bloom, XGLM and
  GPT-NeoX-Japanese used to load and give logits off by ~10 (they compute attention themselves and read
  our sdpa-form mask as eager's additive one); Falcon, GPT-Neo and GIT failed with `KeyError: 'hf_paged'`
  from their attention-class tables; StableLM crashed in its first cached forward. Each loads and runs
  with sdpa, and is refused by the engine too;
* at the first paged forward: Nemotron declares the attention interface, but its decoder layer drops
  the keyword arguments, so attention got raw K/V blocks without the step's metadata ("Number of heads
  in key and value must divide"). Now that is one clear ValueError, and the engine ends the request
  with it instead of retrying without end;
* at load again, read off the attention's source: DiffLlama, Doge and JetMoe compute with the K/V the
  cache returned before (or beside) the attention function (DiffLlama split the values, which the paged
  kernels reading the blocks ignored: its greedy tokens differed from stock's from the first one; Doge
  crashed building its mask from the blocks). A paged forward still refuses an attention the source
  check misses, when it gets other K/V than the step's blocks.
Encoder-decoders (T5, BART) keep their identical dense fallback: they are not refused."""

from __future__ import annotations

import copy

import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

import hf_paged
from hf_paged import Engine, SamplingParams
from hf_paged.attention import UnsupportedModelError

V = 128
REFUSED_AT_LOAD = {
    "mpt": dict(d_model=32, n_heads=2, n_layers=2, max_seq_len=64, expansion_ratio=2),
    "bloom": dict(hidden_size=32, n_head=2, n_layer=2),
    "xglm": dict(d_model=32, attention_heads=2, num_layers=2, ffn_dim=64, max_position_embeddings=64),
    "gpt_neox_japanese": dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_multiple_size=2,
                              max_position_embeddings=64),
    "falcon": dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2),
    "gpt_neo": dict(hidden_size=32, num_heads=2, num_layers=2, attention_types=[[["global", "local"], 1]],
                    max_position_embeddings=64, window_size=16, intermediate_size=64),
    "stablelm": dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2,
                     intermediate_size=64, max_position_embeddings=64),
    "git": dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=64,
                max_position_embeddings=64,
                vision_config=dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64,
                                   image_size=16, patch_size=8)),
}


def _config(model_type: str, **fields):
    return AutoConfig.for_model(model_type, vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2, **fields)


def _ids():
    return torch.tensor([[5, 9, 17, 33, 4, 61, 8]])


@pytest.mark.parametrize("model_type", sorted(REFUSED_AT_LOAD))
def test_a_model_that_computes_its_own_attention_is_refused_at_load(model_type):
    refusal = r"cannot serve \w+ \(model_type='%s'\).*attention interface.*'eager'" % model_type
    with pytest.raises(ValueError, match=refusal):
        AutoModelForCausalLM.from_config(_config(model_type, **REFUSED_AT_LOAD[model_type]),
                                         attn_implementation="hf_paged")
    torch.manual_seed(0)  # the way to load it: transformers' default attention
    model = AutoModelForCausalLM.from_config(_config(model_type, **REFUSED_AT_LOAD[model_type])).eval()
    with torch.no_grad():
        assert torch.isfinite(model(_ids()).logits).all()
    with pytest.raises(ValueError, match="attention interface"):
        Engine(model)  # an sdpa model handed to the engine: it cannot switch such a model to "hf_paged"


def test_nemotron_whose_decoder_layer_drops_the_metadata_is_refused_at_its_first_paged_forward():
    config = _config("nemotron", hidden_size=32, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2,
                     intermediate_size=64, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    # A config each: `from_config` keeps the config object, and the attention choice with it.
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="hf_paged").eval()
    stock = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    stock.load_state_dict(model.state_dict())
    with torch.no_grad():  # a plain forward (no cache) is the dense path: exactly sdpa's
        torch.testing.assert_close(model(_ids()).logits, stock(_ids()).logits, rtol=0, atol=1e-5)
    engine = Engine(model, max_num_seqs=2)
    out = engine.generate([[5, 9, 17, 33], [7, 7, 7]], SamplingParams(max_new_tokens=3))
    assert [o.finish_reason for o in out] == ["error", "error"]
    assert all(isinstance(o.error, UnsupportedModelError) for o in out)
    assert "does not pass its keyword arguments on to its attention" in str(out[0].error)
    assert engine.core.metrics.num_failed_steps == 1  # one failed step, no retries
    assert engine.cache.pool.num_free_blocks == engine.cache.pool.num_blocks  # the failed step left no trace
    with pytest.raises(ValueError, match="does not pass its keyword arguments on"):
        model.generate(_ids(), attention_mask=torch.ones_like(_ids()), max_new_tokens=3, do_sample=False)


@pytest.mark.parametrize("model_type", ["t5", "bart"])
def test_encoder_decoders_keep_their_identical_dense_fallback(model_type):
    fields = dict(d_model=32, num_layers=1, num_heads=2, d_ff=64, decoder_start_token_id=0) if model_type == "t5" else \
        dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
             encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, decoder_start_token_id=2)
    config = _config(model_type, **fields)
    torch.manual_seed(0)
    ours = AutoModelForSeq2SeqLM.from_config(copy.deepcopy(config), attn_implementation="hf_paged").eval()
    stock = AutoModelForSeq2SeqLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    assert ours.config._attn_implementation == "hf_paged" and stock.config._attn_implementation == "sdpa"
    stock.load_state_dict(ours.state_dict())
    kwargs = dict(attention_mask=torch.ones_like(_ids()), max_new_tokens=5, do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(ours.generate(_ids(), **kwargs), stock.generate(_ids(), **kwargs))


def test_the_load_check_is_part_of_the_reversible_patch():
    hf_paged.integrations.uninstall()
    try:
        # Without the check, transformers' own behaviour: a KeyError from Falcon's attention lookup before
        # 5.25, a model that loads from 5.25 on (its attention moved to the interface without declaring it).
        try:
            AutoModelForCausalLM.from_config(_config("falcon", **REFUSED_AT_LOAD["falcon"]),
                                             attn_implementation="hf_paged")
        except KeyError:
            pass
    finally:
        hf_paged.integrations.install()
    with pytest.raises(ValueError, match="attention interface"):
        AutoModelForCausalLM.from_config(_config("falcon", **REFUSED_AT_LOAD["falcon"]), attn_implementation="hf_paged")


def _mllama_config():
    from transformers import MllamaConfig

    return MllamaConfig(
        vision_config=dict(hidden_size=16, num_hidden_layers=1, num_global_layers=1, attention_heads=2,
                           intermediate_size=32, image_size=16, patch_size=8, max_num_tiles=4, vision_output_dim=32,
                           intermediate_layers_indices=[0]),
        text_config=dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=64, cross_attention_layers=[1], pad_token_id=0))


def _idefics_config():
    from transformers import IdeficsConfig

    return IdeficsConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         vision_config=dict(embed_dim=32, image_size=16, patch_size=8, num_hidden_layers=1,
                                            num_attention_heads=2, intermediate_size=64),
                         perceiver_config=dict(use_resampler=False))


@pytest.mark.parametrize("make_config", [_mllama_config, _idefics_config], ids=["mllama", "idefics"])
def test_a_decoder_with_cross_attention_layers_is_refused_at_load_and_by_the_cache(make_config):
    """Mllama wrote its cross-attention (image) K/V into the paged cache, and text-only calls then failed
    with "the previous forward with this PagedCache did not finish"; Idefics' gated cross-attention read
    the paged metadata."""
    from transformers import AutoModelForImageTextToText

    from hf_paged import PagedCache
    from hf_paged.hf import check_model_supported

    with pytest.raises(ValueError, match="cross-attention layers"):
        check_model_supported(make_config())
    with pytest.raises(ValueError, match="cross-attention layers"):
        PagedCache(make_config())
    with pytest.raises(ValueError, match="cross-attention layers"):
        AutoModelForImageTextToText.from_config(make_config(), attn_implementation="hf_paged")
    AutoModelForImageTextToText.from_config(make_config(), attn_implementation="sdpa")  # a valid config: sdpa loads it


def test_the_encoder_decoder_fallback_warns_once_per_model():
    """Each model warns on its first fallback call, then never again; a second model warns too (a
    warning once per process would have left it silent)."""
    fields = dict(d_model=32, num_layers=1, num_heads=2, d_ff=64, decoder_start_token_id=0)
    models = [AutoModelForSeq2SeqLM.from_config(_config("t5", **fields), attn_implementation="hf_paged").eval()
              for _ in range(2)]
    kwargs = dict(attention_mask=torch.ones_like(_ids()), max_new_tokens=2, do_sample=False)
    counts = []
    for model in (models[0], models[0], models[1], models[1]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.generate(_ids(), **kwargs)
        counts.append(sum("not a PagedCache" in str(w.message) for w in caught))
    assert counts == [1, 0, 1, 0]


@pytest.mark.parametrize("model_type, attention", [("diffllama", "DiffLlamaAttention"), ("doge", "DogeAttention"),
                                                   ("jetmoe", "JetMoeAttention")])
def test_an_attention_that_computes_with_the_cached_kv_is_refused_at_load(model_type, attention):
    """DiffLlama splits the values the cache returned, Doge builds its mask from them, JetMoe reshapes
    them: a paged cache returns blocks, so each is refused when loaded (read off its attention's source),
    and loads with sdpa."""
    config = _config(model_type, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                     intermediate_size=64, max_position_embeddings=64)
    with pytest.raises(ValueError, match=f"its {attention} computes with the K/V its cache returns"):
        AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="hf_paged")
    AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")


def test_mla_and_plain_attention_are_not_refused_for_reading_their_cache():
    """DeepSeek's latent attention expands its cached latents on purpose (the dense path serves it);
    Llama hands its K/V straight to the attention function."""
    from hf_paged.hf.support import cached_kv_refusal
    from transformers import DeepseekV3ForCausalLM, LlamaForCausalLM

    assert cached_kv_refusal(DeepseekV3ForCausalLM, _config("deepseek_v3")) is None
    assert cached_kv_refusal(LlamaForCausalLM, _config("llama")) is None


def test_an_attention_the_source_check_misses_is_refused_at_its_first_paged_forward(monkeypatch):
    """The backstop behind the source check: with it blind (its answer patched away, as for an attention
    whose source cannot be read), DiffLlama loads and the engine builds, and its first paged forward
    refuses it, since its attention gets other K/V than the blocks the step handed out; the engine
    ends the requests at once, without retries."""
    from hf_paged.hf import support

    monkeypatch.setattr(support, "cached_kv_refusal", lambda *args: None)
    config = _config("diffllama", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                     intermediate_size=64, max_position_embeddings=64)
    hf_paged.integrations.uninstall()
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="hf_paged").eval()
    finally:
        hf_paged.integrations.install()
    stock = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    stock.load_state_dict(model.state_dict())
    with torch.no_grad():  # the dense path (no cache) is exactly sdpa's
        torch.testing.assert_close(model(_ids()).logits, stock(_ids()).logits, rtol=0, atol=1e-5)
    with pytest.raises(UnsupportedModelError, match="other K/V than the blocks"):
        model.generate(_ids(), attention_mask=torch.ones_like(_ids()), max_new_tokens=3, do_sample=False)
    engine = Engine(model, max_num_seqs=2)
    out = engine.generate([[5, 9, 17, 33], [7, 7, 7]], SamplingParams(max_new_tokens=3))
    assert [o.finish_reason for o in out] == ["error", "error"]
    assert engine.core.metrics.num_failed_steps == 1  # no retries
    assert engine.cache.pool.num_free_blocks == engine.cache.pool.num_blocks


def test_a_submodule_whose_attention_class_table_lacks_our_key_is_refused_at_load():
    """UnlimitedOCR routes its text attention, but its SAM vision encoder picks its attention class from
    a table of its own: `KeyError: 'hf_paged'` deep inside `__init__` before; one ValueError now, from
    both loaders, and transformers' own KeyError again once the patch is uninstalled. (Its text layers'
    own type, "reference_sliding_attention", is refused first, by the config: plain layers here, so
    that the vision encoder's table is what refuses.)"""
    from transformers import AutoModelForImageTextToText

    from family_sweep import tiny_config

    config = tiny_config(type(AutoConfig.for_model("unlimited_ocr")))
    text = config.get_text_config(decoder=True)
    text.layer_types = ["full_attention"] * text.num_hidden_layers
    with pytest.raises(ValueError, match="table of its own, which has no 'hf_paged' entry"):
        AutoModelForImageTextToText.from_config(copy.deepcopy(config), attn_implementation="hf_paged")
    AutoModelForImageTextToText.from_config(copy.deepcopy(config), attn_implementation="sdpa")  # loads with sdpa
    hf_paged.integrations.uninstall()
    try:
        with pytest.raises(KeyError):
            AutoModelForImageTextToText.from_config(copy.deepcopy(config), attn_implementation="hf_paged")
    finally:
        hf_paged.integrations.install()


@pytest.mark.parametrize("model_type, layer_type", [("minimax", "linear_attention")])
def test_layer_types_the_engine_refuses_are_refused_at_load(model_type, layer_type):
    """MiniMax's linear attention routes attention through the interface, and its config's state has a
    formula, but its lightning layers keep their state in a cache class of their own (`MiniMaxCache`), not
    through transformers' linear-attention cache API: the load refuses it, naming that (issue 55)."""
    from family_sweep import family_config
    from hf_paged.hf import check_model_supported

    config = family_config(model_type, AutoModelForCausalLM._model_mapping[type(AutoConfig.for_model(model_type))])
    assert layer_type in config.get_text_config(decoder=True).layer_types
    check_model_supported(config)  # the config alone: a state the formulas size
    refusal = (rf"\(model_type='{model_type}'\): its recurrent layers keep their state outside transformers' "
               "linear-attention")
    with pytest.raises(ValueError, match=refusal):
        AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="hf_paged")
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    with pytest.raises(ValueError, match=refusal):
        model.set_attn_implementation("hf_paged")
