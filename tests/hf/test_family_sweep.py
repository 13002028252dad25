"""The standing sweep over every model family the installed transformers can generate with
(`family_sweep.py`): each one identical to stock through hf_paged, refused clearly, or a known and
explained open defect; and docs/models.md's architecture list is the sweep's own result."""

from __future__ import annotations

import pathlib

import pytest
import transformers
from packaging.version import Version

from hf_paged.transformers_api import CHECKED_ON

import family_sweep
from family_configs import NOT_COVERED
from family_sweep import KNOWN, readme_block, run_sweep

README = pathlib.Path(__file__).resolve().parents[2] / "docs" / "models.md"  # the architecture list

# The families the issue (32) names, as they must come out, and those the sweep's own runs turned up.
MUST = {
    "identical": ["llama", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "cohere", "cohere2", "olmo2",
                  "granite", "starcoder2", "gemma", "phi", "gpt2", "gpt_neox", "gptj", "smollm3", "opt",
                  "deepseek_v3", "moshi", "chameleon", "llava", "qwen2_vl", "qwen2_5_vl", "smolvlm", "paligemma", "gemma3",
                  "phi3", "phimoe",  # with longrope, crossing its threshold (issue 51)
                  # chunked attention; shared K/V across layers and per-layer K/V shapes (issue 54)
                  "llama4", "llama4_text", "gemma3n_text", "gemma4", "gemma4_text", "gemma4_unified",
                  "gemma4_unified_text",
                  # recurrent and linear-attention layers beside attention (issue 55)
                  "qwen3_5_text", "qwen3_next", "granitemoehybrid", "nemotron_h", "falcon_h1", "jamba", "bamba",
                  # latent attention through the engine, and indexed sparse attention (issue 56)
                  "deepseek_v2", "minicpm3", "glm4_moe_lite", "kimi_linear",
                  "deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2"],
    "refused": ["mpt", "bloom", "xglm", "gpt_neox_japanese", "stablelm", "mllama", "falcon", "git",
                "diffllama", "unlimited_ocr", "doge", "jetmoe", "idefics", "dory", "blip",
                "phi4_multimodal",  # longrope: stock feeds one token past the threshold (issue 51)
                "mamba", "minimax",  # no attention layer; a state kept outside the cache API (issue 55)
                "deepseek_v4"],  # compressed K/V entries (issue 56)
    "fallback": ["florence2", "udop", "t5gemma2", "vision-encoder-decoder", "pp_formulanet"],
}

# Named families whose outcome above holds from a release on; before it they are refused (their classes
# did not route attention through transformers' attention interface yet).
SINCE = {"gptj": "5.24.0"}

NAMED = {name for names in MUST.values() for name in names}


@pytest.fixture(scope="module")
def named_outcomes():
    """The named families only: the sweep's fast part, which every transformers release checked runs."""
    return run_sweep(only=NAMED)


@pytest.fixture(scope="module")
def outcomes(named_outcomes):
    """Every family, in the sweep's order (the named ones are not run twice)."""
    rest = run_sweep(skip=NAMED, workers=2)
    order = {family: i for i, family in enumerate(family_sweep.families())}
    return sorted(named_outcomes + rest, key=lambda o: order[(o.model_type, o.mapping)])


def test_no_family_differs_or_crashes_unexplained(outcomes):
    surprises = [o for o in outcomes if o.kind in ("different", "crash") and (o.model_type, o.mapping) not in KNOWN]
    assert not surprises, "\n".join(f"{o.kind} {o.model_type} ({o.mapping}): {o.detail}" for o in surprises)
    for (model_type, mapping), (kind, _) in KNOWN.items():  # a known defect fixed (or changed) is noticed
        got = next(o for o in outcomes if (o.model_type, o.mapping) == (model_type, mapping))
        assert got.kind == kind, f"{model_type} ({mapping}) is now {got.kind}: update KNOWN and docs/models.md"


@pytest.mark.parity
def test_the_named_families_come_out_as_they_must(named_outcomes):
    kinds = {}
    for o in named_outcomes:
        kinds.setdefault(o.model_type, set()).add(o.kind)
    installed = Version(transformers.__version__)
    # An older release checked may predate a named family (Dory came in 5.24); the newest has them all.
    absent = set() if installed >= Version(CHECKED_ON[-1]) else NAMED - {t for t, _ in family_sweep.families()}
    for kind, names in MUST.items():
        wrong = [n for n in names if n not in absent
                 and kinds.get(n) != {kind if installed >= Version(SINCE.get(n, "0")) else "refused"}]
        assert not wrong, f"expected {kind}: {[(n, kinds.get(n)) for n in wrong]}"


def test_only_the_documented_families_are_not_covered(outcomes):
    untested = {o.model_type for o in outcomes if o.kind == "untested"}
    assert untested == set(NOT_COVERED), (
        f"not covered without a reason in family_configs.NOT_COVERED: {sorted(untested - set(NOT_COVERED))}; "
        f"covered now (drop from NOT_COVERED): {sorted(set(NOT_COVERED) - untested)}")


def test_refusals_name_hf_paged_and_what_to_use(outcomes):
    for o in outcomes:
        if o.kind == "refused":
            assert "hf_paged" in o.detail and ("'sdpa'" in o.detail or "'eager'" in o.detail), o


def test_the_readme_list_is_the_sweeps_result(outcomes):
    text = README.read_text()
    block = readme_block(outcomes)
    assert block in text, ("docs/models.md's architecture list is stale: run `python tests/hf/family_sweep.py --readme`\n"
                           + block)


def test_tiny_config_shrinks_sub_configs_and_per_layer_lists():
    from transformers import Gemma3Config, Qwen2VLConfig

    gemma = family_sweep.tiny_config(Gemma3Config)
    assert gemma.text_config.hidden_size == 32 and gemma.vision_config.hidden_size == 32
    assert len(gemma.text_config.layer_types) == gemma.text_config.num_hidden_layers == 2
    assert set(gemma.text_config.layer_types) == {"sliding_attention", "full_attention"}
    qwen = family_sweep.tiny_config(Qwen2VLConfig)
    assert sum(qwen.text_config.rope_parameters["mrope_section"]) == 4  # head_dim 8 / 2


def test_vlms_are_checked_with_images(outcomes):
    with_images = {o.model_type for o in outcomes if o.mapping != "causal" and "images" in o.checks}
    assert {"llava", "paligemma", "mistral3", "blip-2", "kosmos-2", "pix2struct"} <= with_images, with_images


def test_the_sweep_sharpens_attention_and_crosses_rope_thresholds():
    """What makes the sweep see position bugs: peaked attention, and thresholds inside its prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    config = family_sweep.family_config("phi3")
    assert config.rope_parameters["rope_type"] == "longrope"
    assert config.rope_parameters["original_max_position_embeddings"] == family_sweep.ROPE_THRESHOLD
    assert config.original_max_position_embeddings == family_sweep.ROPE_THRESHOLD  # Phi-3's cache recompute
    lengths = [len(p) for p in family_sweep.prompts_for(config, config.vocab_size)]
    threshold, fed = family_sweep.ROPE_THRESHOLD, family_sweep.NEW_TOKENS - 1  # the last token is never fed
    assert any(n <= threshold < n + fed for n in lengths) and any(n > threshold for n in lengths)
    model = AutoModelForCausalLM.from_config(family_sweep.family_config("llama"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    family_sweep.sharpen(model)
    for name, param in model.named_parameters():
        scale = family_sweep.QK_SCALE if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
        assert torch.equal(param, before[name] * scale), name
