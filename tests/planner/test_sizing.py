"""KV-cache calculus, roofline and plan (`hf_paged.planner.sizing`) and the `hf-paged` sizing subcommands."""

import json

import pytest
import torch
from transformers import AutoConfig

import hf_paged
from hf_paged import PagedCache
from hf_paged.cli import main
from hf_paged.planner import sizing
from hf_paged.planner.sizing import GB, ModelShape

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def llama70b():
    return ModelShape.from_config("Llama-3-70B")


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("name", ["llama-3-70b", "LLAMA-3-70B", "meta-llama/Meta-Llama-3-70B"])
def test_bundled_names_resolve_case_insensitively(name):
    assert sizing.load_config(name)["num_hidden_layers"] == 80


def test_config_from_directory_and_file(tmp_path):
    config = sizing.load_config("smollm2-135m")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert sizing.load_config(tmp_path) == config
    assert sizing.load_config(str(tmp_path / "config.json")) == config


def test_bundled_configs_load_in_transformers():
    for name in sizing.reference_config_names():
        config = AutoConfig.for_model(**sizing.load_config(name))
        assert ModelShape.from_config(config).num_layers == ModelShape.from_config(name).num_layers


@pytest.mark.parametrize("name, billions", [
    ("llama-3-70b", 70.55), ("llama-3-8b", 8.03), ("mistral-7b", 7.24), ("qwen2.5-7b", 7.62),
    ("deepseek-v3", 671.0), ("smollm2-135m", 0.1345),
])
def test_parameter_counts_match_published_sizes(name, billions):
    assert ModelShape.from_config(name).num_params / 1e9 == pytest.approx(billions, rel=0.005)


def test_parameter_count_matches_transformers_model():
    config = AutoConfig.for_model(**sizing.load_config("smollm2-135m"))
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config)
    assert ModelShape.from_config(config).num_params == sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------ kv-size
def test_acceptance_70b_kv_sizes(llama70b):
    mha = llama70b.with_kv_heads(64)
    assert sizing.kv_bytes_per_token(mha, "float16") == 2_621_440
    assert sizing.kv_bytes(mha, 64_000, 16, "float16") / GB == pytest.approx(2684.35, abs=0.01)
    assert sizing.kv_bytes_per_token(llama70b, "float16") == 327_680
    assert sizing.kv_bytes(llama70b, 64_000, 16, "float16") / GB == pytest.approx(335.54, abs=0.01)
    # the seed's 163,840 bytes/token of FP8 payload, plus one float32 scale per token, KV head and K/V
    scales = 80 * 8 * 2 * 4
    assert sizing.kv_bytes_per_token(llama70b, "fp8") == 163_840 + scales
    assert sizing.kv_scale_bytes_per_token(llama70b, "fp8") == scales == 5_120
    assert sizing.kv_bytes_per_token(llama70b, "int8") == sizing.kv_bytes_per_token(llama70b, "fp8_e5m2") == 168_960
    assert sizing.kv_scale_bytes_per_token(llama70b, "bfloat16") == 0
    assert sizing.kv_bytes(llama70b, 64_000, 16, "fp8") / GB == pytest.approx(173.02, abs=0.01)


def test_dtype_names_are_the_kv_vocabulary():
    from hf_paged.config import KV_CACHE_DTYPE_NAMES
    assert set(sizing.DTYPE_NAMES) == set(KV_CACHE_DTYPE_NAMES) - {"auto"}
    for old in ("bf16", "fp16", "fp32", "auto", "float8_e4m3fn"):
        with pytest.raises(ValueError, match="unknown dtype"):
            sizing.dtype_bytes(old)
    assert sizing.dtype_spec("fp8").name == "fp8_e4m3"
    with pytest.raises(ValueError, match="unknown dtype 'bf16' \\(did you mean 'bfloat16'\\?\\)"):
        sizing.dtype_bytes("bf16")


def test_mla_caches_one_latent_plus_rope_key_per_layer():
    shape = ModelShape.from_config("deepseek-v3")
    assert shape.is_mla
    assert sizing.kv_bytes_per_token(shape, "bfloat16") == 61 * (512 + 64) * 2  # not x2 for K and V


def test_sliding_window_caps_tokens():
    shape = ModelShape.from_config("mistral-7b")
    per_token = sizing.kv_bytes_per_token(shape, "bfloat16")
    assert sizing.kv_bytes(shape, 1000, 1, "bfloat16") == 1000 * per_token
    assert sizing.kv_bytes(shape, 32_768, 1, "bfloat16") == 4096 * per_token
    # Qwen2.5 declares a window but does not use it
    qwen = ModelShape.from_config("qwen2.5-7b")
    assert sizing.kv_bytes(qwen, 32_768, 1, "bfloat16") == 32_768 * sizing.kv_bytes_per_token(qwen, "bfloat16")


def test_layer_types_mix_full_and_sliding():
    config = {**sizing.load_config("llama-3-8b"), "sliding_window": 100,
              "layer_types": ["sliding_attention", "full_attention"] * 16}
    shape = ModelShape.from_config(config)
    per_layer = sizing.kv_bytes_per_layer_token(shape, "bfloat16")
    assert sizing.kv_bytes(shape, 1000, 1, "bfloat16") == 16 * (100 + 1000) * per_layer


def test_kv_size_cli_acceptance_table_and_json(capsys):
    rc, out, err = run_cli(capsys, "kv-size", "llama-3-70b", "--seq-len", "64000", "--batch", "16",
                           "--kv-dtype", "float16", "--compare")
    assert rc == 0 and not err
    cells = [line.split() for line in out.splitlines()[3:]]
    rows = {(c[0] if c[1].isdigit() else f"{c[0]} {c[1]}"): c for c in cells}  # "GQA-8 fp8" has two words
    # columns from the right: ..., bytes/token, payload, scales, per seq GB, per seq GiB, total GB, total GiB, vs
    assert rows["MHA"][-8:-5] == ["2,621,440", "2,621,440", "0"] and rows["MHA"][-3] == "2,684.4"
    assert rows["GQA-8"][-8:-5] == ["327,680", "327,680", "0"] and rows["GQA-8"][-3] == "335.5"
    assert rows["GQA-8 fp8"][-8:-5] == ["168,960", "163,840", "5,120"] and rows["GQA-8 fp8"][-3] == "173.0"

    rc, out, _ = run_cli(capsys, "kv-size", "llama-3-70b", "--seq-len", "64000", "--batch", "16",
                         "--kv-dtype", "fp8", "--json")
    (row,) = json.loads(out)["rows"]
    assert rc == 0 and row["bytes_per_token"] == 168_960 and row["scale_bytes_per_token"] == 5_120
    assert row["kv_dtype"] == "fp8_e4m3" and row["total_gb"] == pytest.approx(168_960 * 64_000 * 16 / 1e9)
    assert row["total_gib"] == pytest.approx(168_960 * 64_000 * 16 / 2**30)

    rc, out, _ = run_cli(capsys, "kv-size", "llama-3-70b", "--kv-heads", "64", "--kv-dtype", "float16", "--json")
    assert json.loads(out)["rows"][0]["bytes_per_token"] == 2_621_440


# ------------------------------------------------------------------------------------------ roofline
def test_acceptance_roofline(llama70b):
    gpu = sizing.get_gpu("h100-sxm")
    assert gpu.ridge_point == pytest.approx(295.2, abs=0.1)
    report = sizing.roofline(llama70b, gpu, seq_len=1, batch_sizes=[1, 2], weight_dtype="float16", kv_dtype="float16")
    assert report.points[0].intensity == pytest.approx(1.0, abs=0.01)
    assert report.points[1].intensity == pytest.approx(2.0, abs=0.02)
    # bandwidth bound: 2 bytes per matmul parameter over 3.35 TB/s
    assert report.min_time_per_token_s == pytest.approx(2 * 69.5e9 / 3.35e12, rel=0.01)
    b = report.compute_bound_batch
    assert sizing.decode_point(llama70b, gpu, b, 1, "float16", "float16").is_compute_bound
    assert not sizing.decode_point(llama70b, gpu, b - 1, 1, "float16", "float16").is_compute_bound


def test_long_context_decode_never_turns_compute_bound(llama70b):
    report = sizing.roofline(llama70b, sizing.get_gpu("h100"), seq_len=128_000)
    assert report.compute_bound_batch is None and report.asymptotic_intensity < report.ridge_point


def test_gpu_presets_and_custom():
    assert sizing.get_gpu("H200").ridge_point == pytest.approx(989 / 4.8)
    assert sizing.get_gpu("a100").ridge_point == pytest.approx(312 / 2.039)
    assert sizing.get_gpu("l4").ridge_point == pytest.approx(121 / 0.3)
    assert sizing.get_gpu(None, 100, 2).ridge_point == 50
    with pytest.raises(ValueError, match="--bandwidth"):
        sizing.get_gpu(None, 100, None)


def test_roofline_cli(capsys):
    rc, out, err = run_cli(capsys, "roofline", "llama-3-70b", "--gpu", "h100-sxm", "--weight-dtype", "float16",
                           "--kv-dtype", "float16", "--seq-len", "1", "--batch", "1", "8")
    assert rc == 0 and not err
    assert "ridge point: 295.2 FLOPs/byte" in out
    rc, out, _ = run_cli(capsys, "roofline", "llama-3-70b", "--weight-dtype", "float16", "--seq-len", "1", "--json")
    report = json.loads(out)
    assert report["ridge_point"] == pytest.approx(295.22, abs=0.01)
    assert report["points"][0]["batch_size"] == 1 and report["points"][0]["intensity"] == pytest.approx(1.0, abs=0.01)
    rc, out, _ = run_cli(capsys, "roofline", "llama-3-8b", "--tflops", "100", "--bandwidth", "1", "--json")
    assert rc == 0 and json.loads(out)["ridge_point"] == pytest.approx(100)


# ------------------------------------------------------------------------------------------ plan
def _smollm2_config():
    return AutoConfig.for_model(**sizing.load_config("smollm2-135m"))


def _fill_one_sequence(cache, block_size):
    """Grow one sequence block by block until the budget stops it; the pool is then at its ceiling."""
    step = 0
    with pytest.raises((hf_paged.NoFreeBlocksError, ValueError)):
        while True:
            ids = torch.arange(step * block_size, (step + 1) * block_size)[None]
            cache.plan_step(batch_size=1, q_len=block_size, mode="paged", device=torch.device("cpu"),
                            dtype=torch.float32, input_ids=ids)
            cache.kv.step.layers_done.update(range(len(cache.layers)))  # as if the forward ran
            step += 1
    return step


def _fits(config, budget, block_size, num_seqs, seq_len):
    cache = PagedCache(config, block_size=block_size, max_kv_bytes=budget)
    ids = torch.arange(num_seqs * seq_len).reshape(num_seqs, seq_len)  # distinct rows: no prefix sharing
    try:
        cache.plan_step(batch_size=num_seqs, q_len=seq_len, mode="paged", device=torch.device("cpu"),
                        dtype=torch.float32, input_ids=ids)
    except (hf_paged.NoFreeBlocksError, ValueError):
        return False
    return True


@pytest.mark.parametrize("budget, seq_len", [(50_000_000, 100), (123_456_789, 17), (20_000_000, 64)])
def test_plan_agrees_with_paged_cache(budget, seq_len):
    config, block_size = _smollm2_config(), 16
    result = sizing.plan(ModelShape.from_config(config), kv_budget_bytes=budget, seq_len=seq_len,
                         block_size=block_size, kv_dtype="float32")
    cache = PagedCache(config, block_size=block_size, max_kv_bytes=budget)
    assert cache.bytes_per_block(torch.float32) == result.bytes_per_block
    steps = _fill_one_sequence(cache, block_size)
    assert cache.pool.num_blocks == result.num_blocks == steps
    n = result.num_seqs_paged
    assert n > 0
    assert _fits(config, budget, block_size, n, seq_len)
    assert not _fits(config, budget, block_size, n + 1, seq_len)


def test_plan_memory_and_contiguous_waste():
    shape = ModelShape.from_config("llama-3-8b")
    result = sizing.plan(shape, memory_bytes=80 * GB, utilization=0.9, seq_len=2048, max_seq_len=8192)
    assert result.weight_bytes == shape.num_params * 2
    assert result.kv_budget_bytes == int(72 * GB) - result.weight_bytes
    per_token = sizing.kv_bytes_per_token(shape, "bfloat16")
    assert result.num_blocks == result.kv_budget_bytes // (16 * per_token)
    assert result.num_seqs_contiguous == result.kv_budget_bytes // (8192 * per_token)
    assert result.num_seqs_paged == result.num_blocks // 128
    assert result.num_seqs_paged >= 4 * result.num_seqs_contiguous  # 2048 of 8192: a quarter of the reservation
    assert result.contiguous_waste_fraction == 0.75
    assert result.contiguous_waste_bytes == result.num_seqs_contiguous * 6144 * per_token


def test_plan_cli(capsys):
    rc, out, err = run_cli(capsys, "plan", "smollm2-135m", "--kv-budget", "50000000", "--seq-len", "100",
                           "--kv-dtype", "float32", "--json")
    assert rc == 0 and not err
    got = json.loads(out)
    assert got["num_blocks"] == 50_000_000 // (16 * 46_080) and got["num_seqs_paged"] == got["num_blocks"] // 7
    rc, out, err = run_cli(capsys, "plan", "llama-3-8b", "--gpu", "h100-sxm", "--seq-len", "4096")
    assert rc == 0 and "sequences of 4,096 tokens, paged" in out


# ------------------------------------------------------------------------------------------ plots
def _check_png(path):
    mpimg = pytest.importorskip("matplotlib.image")
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert mpimg.imread(path).shape[:2] == (500, 800)


def test_plots_render_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    kv_png, roof_png = tmp_path / "kv.png", tmp_path / "roof.png"
    assert main(["kv-size", "deepseek-v3", "--compare", "--plot", str(kv_png)]) == 0
    assert main(["roofline", "llama-3-70b", "--plot", str(roof_png)]) == 0
    _check_png(kv_png)
    _check_png(roof_png)


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("argv, message", [
    (["kv-size", "no-such-model"], "no config file, model directory or bundled config"),
    (["kv-size", "/nonexistent/dir/config.json"], "no config file"),
    (["kv-size", "llama-3-8b", "--kv-dtype", "fp4"], "unknown dtype 'fp4'"),
    (["kv-size", "llama-3-8b", "--seq-len", "-5"], "seq-len must be positive"),
    (["kv-size", "llama-3-8b", "--batch", "0"], "batch must be positive"),
    (["roofline", "llama-3-8b", "--seq-len", "-1"], "seq-len must be non-negative"),
    (["roofline", "llama-3-8b", "--gpu", "tpu"], "unknown GPU 'tpu'"),
    (["roofline", "llama-3-8b", "--weight-dtype", "fp5"], "unknown dtype"),
    (["plan", "llama-3-8b", "--seq-len", "-100"], "seq-len must be positive"),
    (["plan", "llama-3-8b", "--utilization", "1.5", "--memory-gb", "80"], "utilization"),
    (["plan", "llama-3-8b", "--memory-gb", "1"], "do not fit"),  # 8 KV heads: no split as small as 1 GB a device
    (["plan", "llama-3-8b", "--block-size", "0"], "block-size must be positive"),
])
def test_bad_input_is_one_line_and_nonzero(capsys, argv, message):
    rc, out, err = run_cli(capsys, *argv)
    assert rc != 0 and not out
    assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err


def test_bad_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{not json")
    rc, _, err = run_cli(capsys, "kv-size", str(tmp_path))
    assert rc == 2 and "not valid JSON" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    rc, _, err = run_cli(capsys, "kv-size", str(tmp_path))
    assert rc == 2 and "num_hidden_layers" in err


def _gemma3_style_config():
    return AutoConfig.for_model(
        "gemma3_text", vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24, max_position_embeddings=512,
        layer_types=["sliding_attention"] * 5 + ["full_attention"])


@pytest.mark.parametrize("seq_len", [40, 97])
def test_plan_counts_sliding_groups_like_the_cache(seq_len):
    """The planner's blocks per sequence are the cache's: for a prefill in one step (step_tokens =
    seq_len) against PagedCache itself, and for decoding (step_tokens = 1) against the block manager
    growing sequences token by token."""
    config, block_size, budget = _gemma3_style_config(), 4, 400_000
    shape = ModelShape.from_config(config.to_dict())
    prefill = sizing.plan(shape, kv_budget_bytes=budget, seq_len=seq_len, block_size=block_size,
                          kv_dtype="float32", step_tokens=seq_len)
    cache = PagedCache(config, block_size=block_size, max_kv_bytes=budget)
    assert prefill.num_kv_groups == len(cache.layout.groups) == 6
    assert cache.bytes_per_block(torch.float32) == prefill.bytes_per_block
    n = prefill.num_seqs_paged
    assert n > 0 and _fits(config, budget, block_size, n, seq_len) and not _fits(config, budget, block_size, n + 1, seq_len)

    decode = sizing.plan(shape, kv_budget_bytes=budget, seq_len=seq_len, block_size=block_size, kv_dtype="float32")
    assert decode.num_seqs_paged > prefill.num_seqs_paged  # sliding layers keep only their window
    assert decode.num_seqs_without_hybrid == prefill.num_seqs_without_hybrid
    from hf_paged.core import BlockManager, BlockPool, KVSequence, NoFreeBlocksError

    def grows(num_seqs):
        manager = BlockManager(BlockPool(decode.num_blocks), block_size, cache.layout.windows)
        seqs = [KVSequence(i) for i in range(num_seqs)]
        try:
            for i, seq in enumerate(seqs):
                for t in range(seq_len):
                    manager.append_tokens(seq, [1000 * i + t])
        except NoFreeBlocksError:
            return False
        return True

    assert grows(decode.num_seqs_paged) and not grows(decode.num_seqs_paged + 1)
    with pytest.raises(ValueError, match="step-tokens"):
        sizing.plan(shape, kv_budget_bytes=budget, seq_len=seq_len, step_tokens=seq_len + 1)


@pytest.mark.parametrize("model_type, extra", [
    ("llama", {}), ("qwen3", {}), ("gemma2", {}), ("gemma3_text", {}),
    ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
])
def test_parameter_count_equals_the_instantiated_model(model_type, extra):
    from transformers import AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, **extra)
    model = AutoModelForCausalLM.from_config(config)
    assert ModelShape.from_config(config).num_params == sum(p.numel() for p in model.parameters())


def test_plan_tp_gives_one_devices_weights_and_kv(capsys, llama70b):
    rc, out, err = run_cli(capsys, "plan", "llama-3-70b", "--gpu", "h100-sxm", "--tp", "4", "--json")
    got = json.loads(out)
    # Every matmul and the embedding split four ways; the norms whole on each device.
    assert got["weight_bytes"] == 2 * (llama70b.norm_params + (llama70b.num_params - llama70b.norm_params) // 4)
    assert got["bytes_per_block"] == 16 * sizing.kv_bytes_per_token(llama70b, "bfloat16") // 4  # 2 of 8 KV heads
    rc, out, err = run_cli(capsys, "plan", "llama-3-70b", "--gpu", "h100-sxm", "--tp", "4")
    assert rc == 0 and "tensor-parallel ranks (figures per device)" in out
