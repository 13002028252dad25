"""Tensor parallelism (`hf_paged.parallel`): a tiny model split over 2 ranks under torchrun (gloo on CPU)
gives exactly the single-process output through `Engine.generate` and drop-in `generate`, greedy and
seeded-sampled, with and without preemption, on every rank; each rank's pool holds half the K/V bytes
per token, as `hf-paged kv-size --tp 2` says, a recurrent model (Qwen 3.5's gated delta rule) keeps
its whole per-sequence state on every rank, and a latent-attention model (DeepSeek V3: transformers splits
its query heads and up-projection) keeps the whole latent row per token on every rank."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tiny_models import MLA_CONFIGS, tiny_mla_model, tiny_model

WORKER = pathlib.Path(__file__).with_name("tp_worker_all.py")  # tp_worker.py's run, for several models
ARCHS = ["llama", "qwen3", "qwen3_5", "deepseek_v3"]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _launch(pairs, nproc: int = 2) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(WORKER), *[str(p) for pair in pairs for p in pair]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300 * len(pairs), env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every architecture's model folder, and its outputs from one torchrun launch of 2 ranks."""
    folder = tmp_path_factory.mktemp("tp2")
    for arch in ARCHS:
        (tiny_mla_model(arch) if arch in MLA_CONFIGS else tiny_model(arch)).save_pretrained(folder / arch)
    _launch([(folder / arch, folder / f"{arch}.json") for arch in ARCHS])
    return folder


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_matches_the_single_process_engine_on_every_rank(arch, launched):
    model_dir = launched / arch
    latent = arch in MLA_CONFIGS
    single = json.loads((launched / f"{arch}.json").read_text())
    ranks = [json.loads((launched / f"{arch}.json.rank{r}").read_text()) for r in range(2)]
    for key in ("greedy", "sampled", "preempted_greedy", "preempted_sampled", "dropin_greedy", "dropin_sampled"):
        for rank, got in enumerate(ranks):
            assert got[key] == single[key], f"{key} on rank {rank}"
    assert ranks[0]["dropin_greedy"] == single["stock_greedy"]  # and that is stock's
    assert ranks[0]["preemptions"] > 0 and ranks[0]["dropin_steps"] > 0  # the engine preempted; drop-in ran it
    # Each rank's pool holds its half of the KV heads: half the bytes per token, as the planner says; a latent
    # row (one head every query head reads) is whole on every rank.
    share = single["bytes_per_token"] if latent else single["bytes_per_token"] // 2
    assert ranks[0]["bytes_per_token"] == ranks[1]["bytes_per_token"] == share
    # A recurrent layer's state is whole on every rank (transformers gathers the mixer's outputs).
    assert ranks[0]["state_bytes_per_row"] == ranks[1]["state_bytes_per_row"] == single["state_bytes_per_row"]
    assert (single["state_bytes_per_row"] > 0) == (arch == "qwen3_5")
    planned = subprocess.run([sys.executable, "-m", "hf_paged.cli", "kv-size", str(model_dir / "config.json"),
                              "--tp", "2", "--kv-dtype", "float32", "--json"], capture_output=True, text=True,
                             check=True, cwd=ROOT)
    assert json.loads(planned.stdout)["rows"][0]["bytes_per_token"] == ranks[0]["bytes_per_token"]
    # And each rank holds its share of the weights, as `hf-paged plan --tp 2` says.
    planned = subprocess.run([sys.executable, "-m", "hf_paged.cli", "plan", str(model_dir / "config.json"), "--tp", "2",
                              "--weight-dtype", "float32", "--kv-budget", "1000000", "--seq-len", "64", "--json"],
                             capture_output=True, text=True, check=True, cwd=ROOT)
    assert ranks[0]["weight_bytes"] == ranks[1]["weight_bytes"] == json.loads(planned.stdout)["weight_bytes"]
    assert ranks[0]["weight_bytes"] < single["weight_bytes"]


def test_kv_size_refuses_a_tp_that_does_not_divide_the_heads(tmp_path):
    tiny_model("llama").config.save_pretrained(tmp_path)  # 6 heads, 2 KV heads
    proc = subprocess.run([sys.executable, "-m", "hf_paged.cli", "kv-size", str(tmp_path), "--tp", "4"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "tp 4 must divide the 6 attention heads and 2 KV heads" in proc.stderr


def test_a_rank_pool_is_sized_for_its_share_of_the_kv_heads():
    from hf_paged.config import PagedCacheConfig
    from hf_paged.hf.kv_owner import KVOwner

    config = tiny_model("llama").config
    whole = KVOwner(config, PagedCacheConfig(num_blocks=4)).bytes_per_block()
    half = KVOwner(config, PagedCacheConfig(num_blocks=4, tensor_parallel_size=2)).bytes_per_block()
    assert half * 2 == whole
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide"):
        KVOwner(config, PagedCacheConfig(num_blocks=4, tensor_parallel_size=4))
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        PagedCacheConfig(tensor_parallel_size=0)
