"""The planner counts a recurrent model's per-sequence state by `state_spec` (the cache's definition) and
the prefix cache's state checkpoints beside it: `kv-size` in its totals, `plan` in how many sequences
fit (`--state-checkpoints N`; by default the engine's, one per running sequence)."""

import json

import pytest

from hf_paged.cli import main
from hf_paged.planner import sizing
from hf_paged.planner.configs import load_config
from hf_paged.planner.sizing import ModelShape


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def qwen35_state_bytes_by_hand() -> int:
    """Qwen3.5-27B's state per sequence, from the bundled config's numbers."""
    c = load_config("qwen3.5-27b")["text_config"]
    num_linear = c["layer_types"].count("linear_attention")
    assert num_linear == 48
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]  # 16, 48
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]  # 128, 128
    kernel = c["linear_conv_kernel_dim"]  # 4
    conv_channels = 2 * nk * dk + nv * dv  # q and k of every key head, v of every value head: 10,240
    conv = conv_channels * kernel * 2  # the last 4 inputs, bfloat16 (the model's dtype): 81,920 bytes
    recurrent = nv * dk * dv * 4  # one dk x dv state per value head, float32 (as stock keeps it): 3,145,728 bytes
    return num_linear * (conv + recurrent)


QWEN35_STATE = qwen35_state_bytes_by_hand()


def test_the_state_per_sequence_is_the_formula():
    assert QWEN35_STATE == 48 * (10_240 * 4 * 2 + 48 * 128 * 128 * 4) == 154_927_104
    assert ModelShape.from_config("qwen3.5-27b").state_bytes_per_seq == QWEN35_STATE


def test_the_recurrent_state_is_float32_whatever_the_config_says():
    """Nemotron-H's `mamba_ssm_cache_dtype` is vLLM's knob: stock transformers keeps the state in float32
    all the same (`tests/core/test_state_spec.py`), so the planner counts 4 bytes an element."""
    config = dict(model_type="nemotron_h", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  hybrid_override_pattern="M*", mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=16, n_groups=2,
                  conv_kernel=4, vocab_size=128, dtype="bfloat16", mamba_ssm_cache_dtype="bfloat16")
    shape = ModelShape.from_config(config)
    assert shape.state_bytes_per_seq == 4 * 8 * 16 * 4 + (4 * 8 + 2 * 2 * 16) * 4 * 2


def test_a_lightning_state_has_no_conv_window():
    """MiniMax's lightning attention keeps one heads x head_dim x head_dim state in the model's dtype."""
    config = dict(model_type="minimax", hidden_size=64, num_attention_heads=4, head_dim=16, num_key_value_heads=2,
                  num_hidden_layers=4, vocab_size=128, dtype="bfloat16")  # lightning, full, lightning, full
    shape = ModelShape.from_config(config)
    assert (shape.recurrent_state_elements, shape.conv_state_elements) == (2 * 4 * 16 * 16, 0)
    assert shape.state_bytes_per_seq == 2 * 4 * 16 * 16 * 2


def test_kv_size_counts_one_checkpoint_per_sequence_by_default(capsys):
    rc, out, err = run_cli(capsys, "kv-size", "qwen3.5-27b", "--batch", "3", "--json")
    assert rc == 0 and not err
    got = json.loads(out)
    row = got["rows"][0]
    assert got["state_bytes_per_seq"] == row["state_bytes_per_seq"] == QWEN35_STATE
    assert got["num_state_checkpoints"] == row["num_state_checkpoints"] == 3
    assert got["state_checkpoint_bytes"] == row["state_checkpoint_bytes"] == 3 * QWEN35_STATE
    per_seq = 4096 * 65_536 + QWEN35_STATE  # 16 full-attention layers' K/V per token, and the state
    assert row["bytes_per_seq"] == per_seq and row["total_bytes"] == 3 * per_seq + 3 * QWEN35_STATE

    rc, out, _ = run_cli(capsys, "kv-size", "qwen3.5-27b", "--batch", "3", "--state-checkpoints", "5", "--json")
    row = json.loads(out)["rows"][0]
    assert (row["num_state_checkpoints"], row["total_bytes"]) == (5, 3 * per_seq + 5 * QWEN35_STATE)


def test_kv_size_prints_the_state_and_the_checkpoints(capsys):
    rc, out, err = run_cli(capsys, "kv-size", "qwen3.5-27b")
    assert rc == 0 and not err
    assert "154,927,104 bytes" in out
    assert "prefix caching keeps 1 state checkpoint " in out
    header, _, row = out.splitlines()[-3:]
    assert "state/seq" in header and "checkpoints" in header
    assert row.split().count("154,927,104") == 2  # the state, and its one checkpoint
    total_gb = float(row.split()[-3])  # total GB: 4,096 tokens' K/V, the state and its checkpoint
    assert total_gb == round((4096 * 65_536 + 2 * QWEN35_STATE) / 1e9, 1) == 0.6


def test_a_model_without_state_counts_no_checkpoints(capsys):
    rc, out, _ = run_cli(capsys, "kv-size", "llama-3-8b", "--batch", "2", "--state-checkpoints", "7", "--json")
    row = json.loads(out)["rows"][0]
    assert (row["num_state_checkpoints"], row["state_checkpoint_bytes"]) == (0, 0)
    assert row["total_bytes"] == 2 * row["bytes_per_seq"]
    plan = sizing.plan(ModelShape.from_config("llama-3-8b"), memory_bytes=80 * 10**9, seq_len=4096)
    assert plan.num_seqs_paged == plan.kv_budget_bytes // (plan.blocks_per_seq * plan.bytes_per_block)


def test_plan_fits_sequences_beside_their_state_and_the_checkpoints(capsys):
    rc, out, err = run_cli(capsys, "plan", "qwen3.5-27b", "--gpu", "h100-sxm", "--json")
    assert rc == 0 and not err
    got = json.loads(out)
    n, budget = got["num_seqs_paged"], got["kv_budget_bytes"]
    blocks = got["blocks_per_seq"] * got["bytes_per_block"]
    assert got["state_bytes_per_seq"] == QWEN35_STATE
    assert got["num_state_checkpoints"] == n and got["state_checkpoint_bytes"] == n * QWEN35_STATE
    # the most sequences whose blocks, states and (one each) checkpoints fit the budget
    assert n * (blocks + 2 * QWEN35_STATE) <= budget < (n + 1) * (blocks + 2 * QWEN35_STATE)
    assert n == 31  # 43 when the checkpoints were not counted
    assert got["num_blocks"] == (budget - 2 * n * QWEN35_STATE) // got["bytes_per_block"]

    rc, out, _ = run_cli(capsys, "plan", "qwen3.5-27b", "--gpu", "h100-sxm", "--state-checkpoints", "10", "--json")
    got = json.loads(out)
    assert got["num_state_checkpoints"] == 10
    assert got["num_seqs_paged"] == (budget - 10 * QWEN35_STATE) // (blocks + QWEN35_STATE)

    rc, out, _ = run_cli(capsys, "plan", "qwen3.5-27b", "--gpu", "h100-sxm")
    assert "fixed state per sequence (bytes)" in out and "154,927,104" in out
    line = next(line for line in out.splitlines() if line.startswith("prefix-cache state checkpoints"))
    assert line.startswith("prefix-cache state checkpoints (31 x that state)") and "4.80 GB" in line


@pytest.mark.parametrize("command", [["kv-size", "qwen3.5-27b"], ["plan", "qwen3.5-27b", "--gpu", "h100-sxm"]])
def test_a_negative_checkpoint_count_is_refused(capsys, command):
    rc, out, err = run_cli(capsys, *command, "--state-checkpoints", "-1")
    assert rc == 2 and "state-checkpoints must be a non-negative integer, got -1" in err
