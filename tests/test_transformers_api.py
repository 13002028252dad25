"""Every transformers internal hf_paged relies on (`hf_paged.transformers_api.PRIVATE_API`) resolves in
the installed release with the parameters hf_paged passes; the declared range is the package's; and
the cache classes still accept what transformers passes to the methods they override."""

from __future__ import annotations

import inspect
import pathlib
import tomllib

import pytest
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_paged import transformers_api as api
from hf_paged.hf.cache import PagedCache
from hf_paged.hf.layer import PagedLayer

pytestmark = pytest.mark.parity

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("entry", api.PRIVATE_API, ids=lambda e: f"{e.name or e.module}:{e.how}")
def test_each_private_api_matches_the_installed_transformers(entry):
    assert api.problem(entry) is None, api.problem(entry)


def test_the_declared_range_is_the_one_checked():
    spec = next(d for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                if d.startswith("transformers"))
    low, high = api.SUPPORTED_TRANSFORMERS
    assert spec.replace(" ", "") == f"transformers>={low.removesuffix('.0')},<{high.removesuffix('.0')}", spec
    assert api.CHECKED_ON[0] == low and all(api.is_supported_version(v) for v in api.CHECKED_ON)


@pytest.mark.skipif(api.untested_allowed(), reason="trying a release outside the range on purpose")
def test_the_installed_release_is_one_the_list_was_checked_on():
    version = api.installed_version()
    assert version in api.CHECKED_ON or not api.is_supported_version(version), (
        f"transformers {version} is in the supported range but not in transformers_api.CHECKED_ON: run "
        f"scripts/check_transformers.sh {version}, then add it")


def test_a_renamed_parameter_or_a_missing_name_is_one_named_problem():
    renamed = api.PrivateAPI("transformers.generation.utils", "GenerationMixin._get_stopping_criteria", "called",
                             "integrations.batch_generate", keywords=("generation_config", "stop_criteria"))
    assert "_get_stopping_criteria (called by hf_paged.integrations.batch_generate) changed its signature: it no " \
        "longer takes stop_criteria (it takes generation_config, stopping_criteria, tokenizer)" in api.problem(renamed)
    reordered = api.PrivateAPI("transformers.generation.utils", "GenerationMixin._prepare_cache_for_generation",
                               "wrapped", "integrations.generate", positional=("model_kwargs", "generation_config"))
    assert "hf_paged passes (model_kwargs, generation_config) first" in api.problem(reordered)
    gone = api.PrivateAPI("transformers.generation.utils", "GenerationMixin._no_such_method", "called", "engine")
    assert f"transformers {api.installed_version()}: transformers.generation.utils.GenerationMixin._no_such_method"\
        in api.problem(gone) and "is gone" in api.problem(gone)
    unmentioned = api.PrivateAPI("transformers.distributed.mixin", "", "read", "engine", mentions="._no_such_attr =")
    assert "no longer mentions" in api.problem(unmentioned)


def test_a_changed_internal_keeps_the_patch_out_with_one_warning_naming_it(monkeypatch):
    from hf_paged.integrations import generate as patch

    broken = api.PrivateAPI("transformers.generation.utils", "GenerationMixin._gone_in_this_release", "called",
                            "integrations.batch_generate")
    patch.uninstall()
    monkeypatch.setattr(api, "PRIVATE_API", api.PRIVATE_API + (broken,))
    try:
        with pytest.warns(UserWarning, match=r"GenerationMixin\._gone_in_this_release \(called by .*\) is gone"):
            assert patch.install() is False
        assert not patch.is_installed()
    finally:
        monkeypatch.undo()
        patch.install()
    assert patch.is_installed()


def _mismatched_overrides(ours: type, base: type) -> list[str]:
    """The methods `ours` overrides from `base` that do not take each of the base method's parameters in
    the same position (or by name, for keyword-only ones)."""
    wrong = []
    for name, method in vars(ours).items():
        if name.startswith("__") or not callable(method) or not callable(getattr(base, name, None)):
            continue
        theirs = [p for p in inspect.signature(getattr(base, name)).parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        mine = inspect.signature(method).parameters
        takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in mine.values())
        for i, p in enumerate(theirs):
            if p.name not in mine and not takes_kwargs or (
                    p.name in mine and p.kind != p.KEYWORD_ONLY and list(mine).index(p.name) != i):
                base_signature = inspect.signature(getattr(base, name))
                wrong.append(f"{ours.__name__}.{name}{inspect.signature(method)} vs transformers "
                             f"{api.installed_version()}'s {base.__name__}.{name}{base_signature}")
                break
    return wrong


@pytest.mark.parametrize("ours,base", [(PagedCache, Cache), (PagedLayer, CacheLayerMixin)])
def test_the_cache_classes_accept_what_transformers_passes_to_the_methods_they_override(ours, base):
    """transformers calls these on any cache (`get_mask_sizes(query_length, layer_idx)`, ...): each
    parameter of the base method is one ours takes, in the same position."""
    wrong = _mismatched_overrides(ours, base)
    assert not wrong, "\n".join(wrong)


def test_an_override_that_reorders_or_drops_a_parameter_is_named():
    class Swapped(Cache):
        def get_mask_sizes(self, layer_idx: int, query_length: int):  # transformers passes (query_length, layer_idx)
            return 0, 0

        def get_seq_length(self) -> int:  # transformers may pass layer_idx
            return 0

    assert [w.split("(")[0] for w in _mismatched_overrides(Swapped, Cache)] == [
        "Swapped.get_mask_sizes", "Swapped.get_seq_length"]
