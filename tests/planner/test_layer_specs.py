"""The planner counts with the cache's one definition of a layer's K/V (`kv_spec.layer_specs`): Llama
4's chunked layers keep at most a chunk, Gemma 3n's reuse layers keep nothing, Gemma 4's full layers
are counted by their own K/V shape, and `plan` sizes blocks as the byte-balanced layout allocates them.
The bundled reference configs of those three families are checked against hand-computed figures."""

import json

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

from hf_paged.cli import main
from hf_paged.kv_spec import ChunkedLocal, KVShape, SharedKV, layer_specs
from hf_paged.planner import refusals, sizing
from hf_paged.planner.sizing import ModelShape

NEW_REFERENCES = ["llama-4-scout", "gemma-3n-e4b", "gemma-4-31b"]


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert rc == 0 and not err, err
    return out


@pytest.mark.parametrize("name", NEW_REFERENCES)
def test_reference_configs_read_as_transformers_reads_them(name):
    """The planner's specs from the config.json are those of the config transformers builds from it (its
    `per_layer_config`, `kv_sharing_modes`, `layer_types`); hf_paged no longer refuses these models."""
    config = sizing.load_config(name)
    text = AutoConfig.for_model(**{k: v for k, v in config.items() if not k.startswith("_")})
    assert ModelShape.from_config(name).kv_specs == layer_specs(text.to_dict())
    assert refusals.refusal(config) is None


def test_llama4_scout_chunked_layers_keep_one_chunk():
    shape = ModelShape.from_config("llama-4-scout")  # 48 layers: every 4th full, the rest chunked (8,192)
    assert shape.layer_kind_counts == {"chunked_attention": 36, "full_attention": 12}
    per_layer = 8 * 128 * 2 * 2  # 8 KV heads x 128, K and V, bfloat16
    assert sizing.kv_bytes_per_token(shape) == 48 * per_layer == 196_608
    assert sizing.kv_bytes(shape, 4096) == 48 * 4096 * per_layer  # shorter than a chunk: every token
    assert sizing.kv_bytes(shape, 32_768) == (12 * 32_768 + 36 * 8192) * per_layer == 2_818_572_288
    plan = sizing.plan(shape, kv_budget_bytes=10**10, seq_len=10_000, block_size=16)
    assert plan.bytes_per_block == 16 * 12 * per_layer  # 4 groups of 12 layers
    # full: ceil(10,000 / 16) = 625 blocks; chunked: the chunk from 8,192 on, blocks 512..624 = 113 each
    assert plan.blocks_per_seq == 625 + 3 * 113 and plan.freeing_kinds == ("chunked_attention",)
    # a 2,048-token prefill step before the first boundary: the chunk is still whole, nothing freed yet
    assert sizing.plan(shape, kv_budget_bytes=10**10, seq_len=10_000, block_size=16,
                       step_tokens=2048).blocks_per_seq == 4 * 625
    # at most one chunk - 1 + step + 1 block per chunked group, whatever the length
    for seq_len in (8191, 8192, 8193, 20_000, 24_576):
        blocks = sizing.plan(shape, kv_budget_bytes=10**10, seq_len=seq_len, block_size=16).blocks_per_seq
        assert blocks - -(-seq_len // 16) <= 3 * (-(-(8192 - 1 + 1) // 16) + 1)
    assert shape.kv_specs[0] == ChunkedLocal(KVShape(8, 128, 128), chunk=8192)


def test_gemma3n_reuse_layers_cost_nothing():
    shape = ModelShape.from_config("gemma-3n-e4b")  # 35 layers, the last 15 reuse; 4 full and 16 sliding own K/V
    assert sum(isinstance(s, SharedKV) for s in shape.kv_specs) == 15
    per_layer = 2 * 256 * 2 * 2
    assert sizing.kv_bytes_per_token(shape) == 20 * per_layer == 40_960  # not 35 layers' 71,680
    assert sizing.kv_bytes(shape, 4096) == (4 * 4096 + 16 * 512) * per_layer == 50_331_648
    plan = sizing.plan(shape, kv_budget_bytes=10**10, seq_len=32_768, block_size=16)
    assert plan.bytes_per_block == 16 * 4 * per_layer  # groups of 4 layers: 1 full, 4 sliding
    assert plan.blocks_per_seq == 2048 + 4 * (512 // 16) == 2176


def test_gemma4_31b_counts_each_layer_by_its_own_shape():
    shape = ModelShape.from_config("gemma-4-31b")  # 50 sliding layers of 16 x 256, 10 full of 4 x 512
    full, sliding = 4 * 512 * 2 * 2, 16 * 256 * 2 * 2
    assert sizing.kv_bytes_per_token(shape) == 10 * full + 50 * sliding == 901_120
    assert sizing.kv_bytes(shape, 32_768) == (10 * 32_768 * full + 50 * 1024 * sliding) == 3_523_215_360
    plan = sizing.plan(shape, kv_budget_bytes=10**10, seq_len=32_768, block_size=16)
    # byte-balanced groups: one of the 10 full layers, ten of 5 sliding, 40,960 elements per token each
    assert plan.num_kv_groups == 11 and plan.bytes_per_block == 16 * 40_960 * 2
    assert plan.blocks_per_seq == 2048 + 10 * 64  # the window is 64 blocks: the layout wastes nothing here
    assert plan.blocks_per_seq * plan.bytes_per_block == sizing.kv_bytes(shape, 32_768)
    assert sizing.tp_sizes(shape) == [2, 4]  # 8 ranks cannot split the 4 global KV heads
    with pytest.raises(ValueError, match="must divide the 32 attention heads and 4 and 16 KV heads"):
        shape.per_rank(8)
    assert sizing.kv_bytes_per_token(shape.per_rank(2)) == 901_120 // 2
    mha = shape.with_kv_heads(32)  # every layer with 32 KV heads, each its own head size
    assert sizing.kv_bytes_per_token(mha) == 10 * 32 * 512 * 4 + 50 * 32 * 256 * 4


@pytest.mark.parametrize("model_type, extra", [
    ("llama4_text", dict(attention_chunk_size=8, num_local_experts=4, intermediate_size_mlp=48,
                         interleave_moe_layer_step=2)),
    ("gemma4_text", dict(num_hidden_layers=12, global_head_dim=32, num_global_key_value_heads=1,
                         attention_k_eq_v=True, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                         vocab_size_per_layer_input=64)),
])
def test_parameter_count_of_the_new_families_equals_the_model(model_type, extra):
    """Llama 4's dense and MoE layers with the shared expert; Gemma 4's per-layer head sizes, K = V on
    full layers, reuse layers without K/V projections and its per-layer inputs."""
    config = AutoConfig.for_model(model_type, **{"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
                                                 "num_hidden_layers": 6, "num_attention_heads": 4,
                                                 "num_key_value_heads": 2, "head_dim": 16, **extra})
    model = AutoModelForCausalLM.from_config(config)
    assert ModelShape.from_config(config).num_params == sum(p.numel() for p in model.parameters())


def test_the_cli_calls_a_chunk_a_chunk_and_counts_reuse_layers(capsys):
    out = run_cli(capsys, "kv-size", "llama-4-scout", "--seq-len", "32768")
    assert "chunked-attention layers keep at most their chunk: 8,192 tokens" in out and "sliding" not in out
    assert "48 layers (36 chunked_attention, 12 full_attention)" in out
    got = json.loads(run_cli(capsys, "kv-size", "llama-4-scout", "--json"))
    assert got["attention_chunks"] == [8192] and got["sliding_windows"] == [] and got["refusal"] is None
    out = run_cli(capsys, "plan", "llama-4-scout", "--kv-budget", "10000000000", "--seq-len", "32768")
    assert "chunked-attention gain" in out and "sliding" not in out
    out = run_cli(capsys, "kv-size", "gemma-3n-e4b")
    assert "15 layers reuse another layer's K/V and keep none of their own" in out
    assert "sliding-window layers keep at most 512 tokens" in out
    out = run_cli(capsys, "kv-size", "gemma-4-31b")
    assert "16 KV heads x head_dim 256 (GQA-16), full_attention layers 4 KV heads x head_dim 512" in out
