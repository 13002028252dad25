"""The planner sizes multi-head latent attention (DeepSeek V3) and indexed sparse attention (DeepSeek
V3.2) by the cache's one definition (`kv_spec.LatentAttention`): one row per token and layer of latent,
rope key and, for V3.2, the indexer's key; the whole row on every tensor-parallel rank, and per-rank
weights by transformers' MLA plan. Figures are computed by hand from the configs."""

import fnmatch
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_paged import kv_spec
from hf_paged.cli import main
from hf_paged.planner import sizing
from hf_paged.planner.configs import text_config
from hf_paged.planner.layers import layer_kinds
from hf_paged.planner.sizing import ModelShape

V3_ROW = 512 + 64  # kv_lora_rank + qk_rope_head_dim
V32_ROW = 512 + 64 + 128  # + index_head_dim


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert rc == 0 and not err, err
    return out


# ------------------------------------------------------------------------------------------ bytes per token
def test_v3_counts_one_latent_row_per_layer_from_the_spec():
    shape = ModelShape.from_config("deepseek-v3")
    assert shape.kv_specs == (kv_spec.LatentAttention(kv_spec.KVShape(1, 512, 64)),) * 61
    assert sizing.kv_bytes_per_token(shape, "bfloat16") == 61 * 576 * 2 == 70_272
    assert sizing.kv_bytes_per_layer_token(shape, "bfloat16") == 576 * 2
    # quantised: a byte per element and, as before, one head's K and V scales (2 x 4 bytes) per layer
    assert sizing.kv_bytes_per_token(shape, "fp8") == 61 * (576 + 8) == 35_624
    assert sizing.kv_bytes(shape, 4096) == 4096 * 70_272


def _v32_config() -> dict:
    """DeepSeek V3's config.json as DeepSeek V3.2's: its model type and the indexer's sizes."""
    return {**sizing.load_config("deepseek-v3"), "model_type": "deepseek_v32", "index_head_dim": 128,
            "index_n_heads": 64, "index_topk": 2048}


def test_v32_counts_the_indexer_keys_beside_the_latent():
    shape = ModelShape.from_config(_v32_config())
    assert shape.layer_kind_counts == {"indexed_attention": 61}
    assert sizing.kv_bytes_per_token(shape, "bfloat16") == 61 * (576 + 128) * 2 == 85_888
    assert sizing.kv_bytes_per_layer_token(shape, "bfloat16") == 704 * 2
    assert sizing.kv_bytes_per_token(shape, "fp8") == 61 * (704 + 8) == 43_432
    assert sizing.kv_scale_bytes_per_token(shape, "fp8") == 61 * 8
    assert sizing.kv_bytes(shape, 4096, 2) == 2 * 4096 * 85_888
    # the planner's specs are the cache's, from the config transformers builds out of the same file
    config = _v32_config()
    text = AutoConfig.for_model(**{k: v for k, v in config.items() if not k.startswith("_")})
    assert shape.kv_specs == kv_spec.layer_specs(text.to_dict())
    assert shape.kv_specs[0] == kv_spec.LatentAttention(kv_spec.KVShape(1, 512, 64), index_dim=128, index_topk=2048)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2"])
def test_indexed_families_index_every_layer_without_layer_types(model_type):
    """A config.json without `layer_types` gets transformers' default (every layer indexed) and the
    indexer's sizes from the family's defaults."""
    config = AutoConfig.for_model(model_type)
    saved = json.loads(config.to_json_string(use_diff=False))
    for key in ("layer_types", "index_head_dim", "index_topk", "index_n_heads"):
        saved.pop(key)
    n = config.num_hidden_layers
    assert layer_kinds(text_config(saved)) == ("indexed_attention",) * n
    shape = ModelShape.from_config(saved)
    row = config.kv_lora_rank + config.qk_rope_head_dim + config.index_head_dim
    assert sizing.kv_bytes_per_token(shape, "bfloat16") == n * row * 2
    assert shape.index_n_heads == config.index_n_heads


def test_indexed_attention_without_a_latent_is_a_clear_error():
    with pytest.raises(ValueError, match="indexed attention needs latent attention"):
        kv_spec.layer_specs({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
                             "layer_types": ["indexed_attention"] * 2})


# ------------------------------------------------------------------------------------------ tensor parallelism
@pytest.mark.parametrize("name, per_token", [("deepseek-v3", 61 * 576 * 2), ("deepseek-v3.2", 61 * 704 * 2)])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_keeps_the_whole_latent_row_on_every_rank(capsys, name, per_token, tp):
    shape = ModelShape.from_config(name)
    rank = shape.per_rank(tp)
    assert rank.num_attention_heads == 128 // tp
    assert sizing.kv_bytes_per_token(rank, "bfloat16") == per_token  # not per_token / tp
    assert rank.kv_specs == shape.kv_specs
    got = json.loads(run_cli(capsys, "kv-size", name, "--tp", str(tp), "--json"))
    assert got["rows"][0]["bytes_per_token"] == per_token
    plan = json.loads(run_cli(capsys, "plan", name, "--kv-budget", "10000000000", "--tp", str(tp), "--json"))
    assert plan["num_seqs_contiguous"] == 10**10 // (163_840 * per_token)
    assert sizing.tp_sizes(shape) == [2, 4, 8, 16, 32, 64, 128]  # powers of two dividing the 128 query heads


def _tiny(model_type):
    extra = dict(index_topk=8, index_head_dim=16, index_n_heads=4) if model_type == "deepseek_v32" else {}
    return AutoConfig.for_model(
        model_type, vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=12, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        q_lora_rank=24, n_group=2, topk_group=1, max_position_embeddings=512, tie_word_embeddings=False, **extra)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v32"])
@pytest.mark.parametrize("tp", [2, 4])
def test_per_rank_weights_follow_transformers_mla_plan(model_type, tp):
    """Per-rank parameters as the model's own TP plan shards them: the attention projections the plan
    splits (`colwise` / `rowwise`: q_b_proj, kv_b_proj, o_proj) divided, the rest of attention whole
    (q_a_proj, kv_a_proj_with_mqa under "mla_kv_a_proj", their norms, the indexer); outside attention
    the planner's rule for every model (the norms, the routed experts and their router whole: transformers
    splits experts under expert parallelism only, as tests/parallel measures on a rank's DTensors; every
    other weight split)."""
    config = _tiny(model_type)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    split_patterns = [f"model.{p}" for p, style in config.base_model_tp_plan.items() if style in ("colwise", "rowwise")]
    total = whole = 0
    for name, param in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        if ".self_attn." in name:
            is_whole = not any(fnmatch.fnmatch(module, p) for p in split_patterns)
        else:
            is_whole = module.endswith("norm") or ".mlp.experts" in name or module.endswith(".mlp.gate")
        total += param.numel()
        whole += param.numel() if is_whole else 0
    shape = ModelShape.from_config(config)
    assert shape.num_params == total  # the indexer's weights counted too
    assert shape.per_rank(tp).num_params == whole + (total - whole) // tp


# ------------------------------------------------------------------------------------------ the CLI
def test_kv_size_labels_the_row_and_prints_its_bytes(capsys):
    out = run_cli(capsys, "kv-size", "deepseek-v3")
    assert "MLA latent 512 + rope 64 (576 per token and layer)" in out and "indexer" not in out
    assert f"{61 * 576 * 2:,}" in out  # 70,272
    out = run_cli(capsys, "kv-size", "deepseek-v3.2")
    assert "MLA latent 512 + rope 64 + indexer 128 (704 per token and layer" in out
    assert "top 2,048 keys per query, 64 indexer heads" in out
    assert f"{61 * 704 * 2:,}" in out  # 85,888 bytes per token
    got = json.loads(run_cli(capsys, "kv-size", "deepseek-v3.2", "--seq-len", "1000", "--json"))
    assert got["rows"][0]["bytes_per_token"] == 85_888 and got["rows"][0]["bytes_per_seq"] == 1000 * 85_888


def test_the_v32_reference_config_loads_and_plans(capsys):
    assert "deepseek-v3.2" in sizing.reference_config_names()
    config = sizing.load_config("deepseek-ai/DeepSeek-V3.2")
    assert config == sizing.load_config("deepseek-v3.2") and config["model_type"] == "deepseek_v32"
    v3 = sizing.load_config("deepseek-v3")
    # DeepSeek V3's sizes, with the indexer's
    assert {k: v for k, v in config.items() if k not in v3} == {"index_head_dim": 128, "index_n_heads": 64,
                                                                "index_topk": 2048}
    assert all(config[k] == v for k, v in v3.items() if k not in ("_name_or_path", "architectures", "model_type"))
    shape = ModelShape.from_config("deepseek-v3.2")
    assert shape.num_params - ModelShape.from_config("deepseek-v3").num_params == 61 * (
        1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64)  # wq_b, wk, k_norm, weights_proj per layer
    plan = sizing.plan(shape, kv_budget_bytes=10**10, seq_len=4096, max_seq_len=8192, block_size=16)
    assert plan.blocks_per_seq == 256 and plan.num_kv_groups == 1
    assert plan.num_seqs_contiguous == 10**10 // (8192 * 85_888) == 14
    # 671B parameters do not fit one H100, nor any tensor-parallel split: its routed experts stay whole
    # on every rank (transformers splits them under expert parallelism), and the refusal says so
    assert main(["plan", "deepseek-v3.2", "--gpu", "h100-sxm"]) == 2
    err = capsys.readouterr().err
    assert "do not fit" in err and "routed experts stay whole on every tensor-parallel rank" in err
    got = json.loads(run_cli(capsys, "plan", "deepseek-v3.2", "--tp", "8", "--memory-gb", "2000", "--json"))
    assert got["tensor_parallel_size"] == 8 and got["num_seqs_paged"] >= 1


def test_v32_blocks_hold_the_indexer_keys():
    """A block of the one 61-layer group holds 16 tokens' rows of latent, rope key and indexer key, as
    the cache sizes its blocks from the same config."""
    from hf_paged import PagedCache

    plan = sizing.plan(ModelShape.from_config("deepseek-v3.2"), kv_budget_bytes=10**10, seq_len=4096, block_size=16)
    cache = PagedCache(AutoConfig.for_model(**sizing.load_config("deepseek-v3.2")), block_size=16)
    assert cache.bytes_per_block(torch.bfloat16) == plan.bytes_per_block == 16 * 61 * 704 * 2 == 1_374_208
    assert plan.num_blocks == 10**10 // 1_374_208


# ------------------------------------------------------------------------------------------ the roofline
def test_decode_reads_topk_latent_rows_and_every_indexer_key():
    v32, v3 = ModelShape.from_config("deepseek-v3.2"), ModelShape.from_config("deepseek-v3")
    for seq_len in (1000, 100_000):
        attended = min(seq_len, 2048)
        # indexer: every cached key (128 wide); attention: the top-k latent rows (576 wide)
        assert sizing.kv_bytes_read(v32, seq_len) == 61 * (seq_len * 128 + attended * 576) * 2
        assert sizing.kv_bytes_read(v3, seq_len) == sizing.kv_bytes(v3, seq_len) == 61 * seq_len * 576 * 2
        # absorbed decode: per query head 2 * (512 + 64 + 512) per key attended; indexer 2 * 64 heads * 128 per key
        flops = 61 * (2 * 128 * (2 * 512 + 64) * attended + 2 * 64 * 128 * seq_len)
        assert sizing.attention_flops_per_token(v32, seq_len) == flops
    assert sizing.kv_bytes_read(v32, 1000) == sizing.kv_bytes(v32, 1000)  # shorter than top-k: a dense read
    gpu = sizing.get_gpu("h100-sxm")
    point = sizing.decode_point(v32, gpu, 4, 100_000)
    assert point.bytes == sizing.weight_bytes_read(v32, 4) + 4 * 61 * (100_000 * 128 + 2048 * 576) * 2


@pytest.mark.parametrize("model_type, reason", [
    ("qwen4_exp", "indexed_attention layers without multi-head latent attention"),
    ("dots3_note", "multi-head latent attention over"),
])
def test_the_planner_refuses_what_the_loader_refuses(model_type, reason):
    """The planner's refusal follows the load-time check (`hf.support`): indexed attention needs latent rows,
    and latent rows are one width per model over causal or indexed layers."""
    from hf_paged.hf.support import check_model_supported
    from hf_paged.planner.refusals import refusal

    config = AutoConfig.for_model(model_type)
    with pytest.raises(ValueError):
        check_model_supported(config)
    assert reason in (refusal(config.to_dict()) or "")
    assert refusal(AutoConfig.for_model("deepseek_v32").to_dict()) is None
