"""transformers' hub kernels (on by default from 5.25): hf_paged's own loaders ask for none, and a hub
kernel that replaced the forward of a layer reading the KV cache is named once per model."""

from __future__ import annotations

import types
import warnings

import pytest

from hf_paged import transformers_api
from hf_paged.hf import attach, detach
from hf_paged.hf.support import hub_kernel_conflicts
from tiny_models import tiny_model

pytestmark = pytest.mark.parity  # scripts/check_transformers.sh runs it on every release checked


def _mark_replaced(module, repo_id: str) -> None:
    # What the `kernels` package leaves on a module whose forward it replaced (transformers_api.PRIVATE_API
    # checks that it still does): the repository, in the module's own `__dict__`.
    module.__dict__["_kernel_repo"] = types.SimpleNamespace(repo_id=repo_id)


def test_a_hub_kernel_on_a_layer_that_reads_the_cache_is_named_once():
    model = tiny_model("llama", "hf_paged")
    _mark_replaced(model.model.layers[0].input_layernorm, "kernels-community/liger-kernels")  # no conflict
    assert hub_kernel_conflicts(model) == []
    _mark_replaced(model.model.layers[1].self_attn, "kernels-community/some-attention")
    assert hub_kernel_conflicts(model) == [
        "model.layers.1.self_attn (LlamaAttention: hub kernel 'LlamaAttention' from kernels-community/some-attention)"]
    with pytest.warns(UserWarning, match=r"hub kernels replaced .*model\.layers\.1\.self_attn.*use_kernels=False"):
        attach(model)
    detach(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attach(model)  # said once per model
    detach(model)


def test_a_model_without_hub_kernels_is_not_warned_about():
    model = tiny_model("llama", "hf_paged")
    assert hub_kernel_conflicts(model) == []
    with warnings.catch_warnings():  # a warning would raise here
        warnings.simplefilter("error")
        attach(model)
    detach(model)


def test_our_loaders_ask_for_no_hub_kernels_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv(transformers_api.HUB_KERNELS_ENV, raising=False)
    assert transformers_api.local_load_kwargs() == {"local_files_only": True, "use_kernels": False}
    monkeypatch.setenv(transformers_api.HUB_KERNELS_ENV, "YES")
    assert transformers_api.local_load_kwargs() == {"local_files_only": True}
