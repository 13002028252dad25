"""The planner as a newcomer meets it (issue 53): a hybrid model's linear-attention layers counted as a
fixed state per sequence, not K/V per token; a note where hf_paged cannot serve the model yet; the
smallest tensor-parallel split where the weights do not fit one device; no torch or transformers
imported by `kv-size` and `plan`. Only what the planner had before is imported at the top, so each
test fails on the old planner by its own assertion."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import hf_paged
from hf_paged.cli import main
from hf_paged.planner import sizing
from hf_paged.planner.sizing import ModelShape

PACKAGE = Path(hf_paged.__file__).resolve().parent  # the checkout under test (a subprocess imports the same)

# Qwen3.5-27B's published text config (its config.json nests it under "text_config"): 64 layers, every
# fourth one full attention, the rest gated-delta-net linear attention.
QWEN35_TEXT = {
    "model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 48, "linear_value_head_dim": 128, "vocab_size": 248320,
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "dtype": "bfloat16",
}
QWEN35 = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": QWEN35_TEXT}
# Per gated-delta-net layer: a float32 recurrent state of 48 value heads x 128 x 128, and the last 4
# inputs of the 2 * 16 * 128 + 48 * 128 conv channels in bfloat16; 48 such layers.
MAMBA = {"model_type": "mamba", "hidden_size": 768, "num_hidden_layers": 24, "vocab_size": 50280, "state_size": 16,
         "expand": 2, "conv_kernel": 4}
QWEN35_STATE = 48 * (48 * 128 * 128 * 4 + (2 * 16 * 128 + 48 * 128) * 4 * 2)


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_linear_attention_layers_keep_a_fixed_state_not_kv_per_token():
    shape = ModelShape.from_config(QWEN35)
    assert sizing.kv_bytes_per_token(shape, "bfloat16") == 65_536  # 16 full-attention layers; not 262,144
    assert shape.state_bytes_per_seq == QWEN35_STATE == 154_927_104
    assert shape.layer_kind_counts == {"linear_attention": 48, "full_attention": 16}
    assert sizing.kv_bytes(shape, 4096, 3, "bfloat16") == 3 * (4096 * 65_536 + QWEN35_STATE)
    bundled = ModelShape.from_config("qwen3.5-27b")  # the reference config: the published model's shape
    assert sizing.kv_bytes_per_token(bundled, "bfloat16") == 65_536
    assert bundled.state_bytes_per_seq == QWEN35_STATE
    assert bundled.num_params == 26_895_998_464  # the text model (27B with its vision tower)


def test_kv_size_prints_per_token_kv_and_the_fixed_state(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN35))
    rc, out, err = run_cli(capsys, "kv-size", str(tmp_path), "--json")
    assert rc == 0 and not err
    got = json.loads(out)
    assert got["rows"][0]["bytes_per_token"] == 65_536 and got["state_bytes_per_seq"] == QWEN35_STATE
    rc, out, err = run_cli(capsys, "kv-size", str(tmp_path))
    assert "64 layers (48 linear_attention, 16 full_attention)" in out
    assert "fixed state per sequence" in out and "154,927,104 bytes" in out
    row = out.splitlines()[-1].split()
    assert row[:4] == ["GQA-4", "4", "bfloat16", "65,536"] and "154,927,104" in row


def test_a_hybrid_model_is_planned_with_its_state_and_checkpoints(capsys, tmp_path):
    """Qwen 3.5 is served (issue 55): no note; each sequence costs its blocks, its state and one
    prefix-cache state checkpoint (the default: as many checkpoints as sequences)."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN35))
    rc, out, err = run_cli(capsys, "plan", str(tmp_path), "--gpu", "h100-sxm")
    assert rc == 0 and not err and "note:" not in out
    rc, out, _ = run_cli(capsys, "plan", str(tmp_path), "--gpu", "h100-sxm", "--json")
    got = json.loads(out)
    assert got["refusal"] is None and got["state_bytes_per_seq"] == QWEN35_STATE
    # blocks, state and checkpoint
    per_seq = got["blocks_per_seq"] * got["bytes_per_block"] + 2 * got["state_bytes_per_seq"]
    assert got["num_seqs_paged"] == got["kv_budget_bytes"] // per_seq


def test_a_model_hf_paged_refuses_is_planned_with_a_note(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MAMBA))  # every layer recurrent: nothing to page
    rc, out, err = run_cli(capsys, "plan", str(tmp_path), "--gpu", "h100-sxm")
    assert rc == 0 and not err
    assert out.splitlines()[0].startswith("note: hf_paged cannot serve this model yet: no attention layer")
    rc, out, _ = run_cli(capsys, "plan", str(tmp_path), "--gpu", "h100-sxm", "--json")
    assert "no attention layer" in json.loads(out)["refusal"]
    for model in ("llama-3-8b", "gemma-3-4b", "deepseek-v3", "qwen3.5-27b"):  # models hf_paged serves: no note
        rc, out, _ = run_cli(capsys, "kv-size", model)
        assert rc == 0 and "note:" not in out


def test_weights_that_do_not_fit_plan_the_smallest_tensor_parallel_split(capsys):
    rc, out, err = run_cli(capsys, "plan", "llama-3-70b", "--gpu", "h100-sxm")
    assert rc == 0 and not err, err
    assert "do not fit in 72.0 GB" in out and "is --tp 2, planned below" in out
    splits = {line.split()[0]: line.split()[-1] for line in out.splitlines() if line[:2] in ("2 ", "4 ", "8 ")}
    assert splits == {"2": "2", "4": "109", "8": "324"}  # sequences of 4,096 tokens per device
    assert "plan for llama-3-70b (one of 2 TP ranks)" in out
    rc, out, _ = run_cli(capsys, "plan", "llama-3-70b", "--gpu", "h100-sxm", "--json")
    got = json.loads(out)
    assert got["tensor_parallel_size"] == 2 and got["num_seqs_paged"] == 2
    assert [o["num_seqs_paged"] for o in got["tp_options"]] == [2, 109, 324]


_IMPORT_CHECK = textwrap.dedent("""
    import sys
    {prelude}
    import argparse
    from hf_paged.planner import cli
    parser = argparse.ArgumentParser()
    cli.add_subcommands(parser.add_subparsers(dest="command"))
    for argv in (["kv-size", "llama-3-70b"], ["plan", "llama-3-8b", "--gpu", "h100-sxm"], ["roofline", "llama-3-8b"]):
        assert cli.run(parser.parse_args(argv)) == 0
    print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
""")


def test_the_planner_imports_neither_torch_nor_transformers():
    """What `hf-paged kv-size` loads: the planner, and the package above it (lazy since issue 53)."""
    result = subprocess.run([sys.executable, "-c", _IMPORT_CHECK.format(prelude="")], capture_output=True, text=True,
                            timeout=120, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_the_planner_runs_with_torch_and_transformers_blocked():
    """The planner's own modules, under a stub package, with torch and transformers unimportable."""
    prelude = textwrap.dedent(f"""
        import types
        sys.modules["torch"] = sys.modules["transformers"] = None
        package = types.ModuleType("hf_paged")
        package.__path__ = [{str(PACKAGE)!r}]
        sys.modules["hf_paged"] = package
    """)
    result = subprocess.run([sys.executable, "-c", _IMPORT_CHECK.format(prelude=prelude)], capture_output=True,
                            text=True, timeout=120, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr[-2000:]
