"""Autotuning of the Triton attention kernels (`hf_paged.attention.triton.tuning`).

Every pruned candidate config must compute the same attention as `reference.paged_attention`; a
launch must take a recorded winner when one exists for its key and its heuristic otherwise, search
only when asked and never under the interpreter or in a graph capture; pruning must drop what cannot
fit while keeping the heuristic; and the packaged winners file must name only candidates.

Kernel runs here use Triton's interpreter on CPU tensors (`TRITON_INTERPRET=1`, set by conftest
without CUDA). The interpreter ignores num_warps and num_stages, so candidates that differ only in
those are one run here; the `cuda`-marked tests at the end compile and run every candidate on a GPU,
and search and replay in a CUDA graph for real. Pools are NaN wherever a sequence owns nothing
(unused table columns point at an all-NaN block, the tail of each last block is NaN), so a read the
kernel fails to mask turns the output NaN; the reference gets the same pool with the NaNs zeroed.
"""

from __future__ import annotations

import math
import os
import zlib

import pytest
import torch

triton = pytest.importorskip("triton")

from hf_paged.attention import reference  # noqa: E402
from hf_paged.attention.triton import decode, prefill, tune, tuning  # noqa: E402
from hf_paged.attention.triton.tuning import SearchResult, TuningKey, config_id  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="interpreter runs of the Triton kernels: need TRITON_INTERPRET=1 (conftest sets it "
                            "without CUDA)"
)
CPU = torch.device("cpu")

# (atol, rtol) against the fp32 reference on the same rounded inputs. fp32: IEEE dots, only the
# summation order differs (~1e-6 seen). fp16: P is rounded to fp16 before P @ V, and the output.
TOLERANCES = {torch.float32: (2e-5, 1e-5), torch.float16: (1e-2, 1e-2)}


@pytest.fixture(autouse=True)
def fresh_tuning_state(monkeypatch):
    """No winners file, no autotuning and nothing settled, unless a test says otherwise."""
    monkeypatch.delenv(tuning.AUTOTUNE_ENV, raising=False)
    monkeypatch.setenv(tuning.CONFIGS_ENV, "/nonexistent/tuned_configs.json")
    tuning.clear_cache()
    yield
    tuning.clear_cache()


def make_paged(rows, block_size, num_kv_heads, group, head_dim, dtype, seed, device=CPU):
    """(kernel arguments, reference arguments) of one step; `rows` are (seq_len, q_len) pairs."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [s for s, _ in rows]
    q_lens = [q for _, q in rows]
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    poison = int(perm[-1])  # an all-NaN block: what every unused table column points at
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = torch.full(shape, math.nan), torch.full(shape, math.nan)
    block_tables = torch.full((len(rows), max(blocks_per_seq) + 1), poison, dtype=torch.int32)
    start = 0
    for b, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq)):
        owned = perm[start:start + n]
        start += n
        block_tables[b, :n] = owned.int()
        for cache in (key_cache, value_cache):
            filled = torch.randn(n * block_size, num_kv_heads, head_dim, generator=gen)
            filled[seq_len:] = math.nan  # the unwritten tail of the last block
            cache[owned] = filled.view(n, block_size, num_kv_heads, head_dim)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen)
    common = dict(
        block_tables=block_tables.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens), scale=head_dim ** -0.5,
    )
    kernel_args = dict(query=query.to(device, dtype), key_cache=key_cache.to(device, dtype),
                       value_cache=value_cache.to(device, dtype), **common)
    # Same rounded values, NaNs zeroed (the reference gathers every position, then masks), in fp32.
    ref_args = dict(query=kernel_args["query"].float(),
                    key_cache=key_cache.nan_to_num(0.0).to(dtype).float().to(device),
                    value_cache=value_cache.nan_to_num(0.0).to(dtype).float().to(device), **common)
    return kernel_args, ref_args


def assert_matches_reference(out, ref_args, dtype):
    expected = reference.paged_attention(**ref_args)
    assert out.dtype == dtype and out.shape == expected.shape
    assert not out.isnan().any(), "NaN in the output: the kernel read a slot it should have masked"
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


def decode_key(kernel_args, device=CPU):
    query, key_cache = kernel_args["query"], kernel_args["key_cache"]
    num_kv_heads = key_cache.shape[2]
    return decode.tuning_key(device, query.shape[2], kernel_args["value_cache"].shape[3],
                             query.shape[1] // num_kv_heads, key_cache.shape[1], query.dtype, key_cache.dtype,
                             kernel_args["max_seqlen_q"])


def prefill_key(kernel_args, device=CPU):
    query, key_cache = kernel_args["query"], kernel_args["key_cache"]
    return prefill.tuning_key(device, query.shape[2], kernel_args["value_cache"].shape[3],
                              query.shape[1] // key_cache.shape[2], key_cache.shape[1], query.dtype, key_cache.dtype)


def distinct_under_interpreter(configs):
    """One config per distinct set of meta-parameters (the interpreter ignores num_warps / num_stages)."""
    seen = {}
    for config in configs:
        seen.setdefault(tuple(sorted(config.kwargs.items())), config)
    return list(seen.values())


def never(*args):
    pytest.fail("called where nothing may be timed or searched")


class KernelSpy:
    """Stands in for a `@triton.jit` kernel: records each launch's keyword arguments, then launches."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


# ---------------------------------------------------------------------------------------------- #
# Every candidate computes the same attention

# Seq lens 1, 17 and 54 in every batch, block sizes 1 / 16 / 32, GQA 1:1 / 3:1 / 5:1, fp32 and fp16.
# id: rows (seq_len, q_len), block_size, num_kv_heads, group, head_dim, dtype, num_splits
DECODE_CASES = {
    "bs1-1:1-d32-fp32-1split": ([(54, 1), (1, 1), (17, 1)], 1, 2, 1, 32, torch.float32, 1),
    "bs16-3:1-d64-fp16-verify-2splits": ([(17, 4), (54, 1), (1, 1)], 16, 1, 3, 64, torch.float16, 2),
    "bs32-5:1-d32-fp32-3splits": ([(1, 1), (54, 1), (17, 1)], 32, 1, 5, 32, torch.float32, 3),
}


@needs_interpreter
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_every_decode_candidate_matches_reference(case):
    rows, block_size, num_kv_heads, group, head_dim, dtype, num_splits = DECODE_CASES[case]
    kernel_args, ref_args = make_paged(rows, block_size, num_kv_heads, group, head_dim, dtype,
                                       seed=zlib.crc32(case.encode()))
    configs = decode.decode_configs(decode_key(kernel_args))
    block_ns = {c.kwargs["BLOCK_N"] for c in configs}
    assert len(block_ns) >= 3, f"the pruned list should still vary BLOCK_N, got {block_ns}"
    for config in distinct_under_interpreter(configs):
        out = decode.paged_decode(**kernel_args, num_splits=num_splits, config=config)
        assert_matches_reference(out, ref_args, dtype)


# id: rows (seq_len, q_len), block_size, num_kv_heads, group, head_dim, dtype. In the 3:1 and 5:1
# cases the longest query run exceeds 64 // group tokens, so ROWS 64 and 128 give different tiles.
PREFILL_CASES = {
    "bs16-1:1-d32-fp32": ([(54, 54), (1, 1), (17, 0), (17, 17)], 16, 1, 1, 32, torch.float32),
    "bs1-3:1-d64-fp16": ([(17, 17), (54, 30), (1, 1)], 1, 1, 3, 64, torch.float16),
    "bs32-5:1-d32-fp32": ([(1, 1), (54, 20), (17, 17)], 32, 1, 5, 32, torch.float32),
}


@needs_interpreter
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_every_prefill_candidate_matches_reference(case):
    rows, block_size, num_kv_heads, group, head_dim, dtype = PREFILL_CASES[case]
    kernel_args, ref_args = make_paged(rows, block_size, num_kv_heads, group, head_dim, dtype,
                                       seed=zlib.crc32(case.encode()))
    configs = prefill.prefill_configs(prefill_key(kernel_args))
    assert {c.kwargs["ROWS"] for c in configs} == {64, 128}
    for config in distinct_under_interpreter(configs):
        out = prefill.flash_prefill(**kernel_args, config=config)
        assert_matches_reference(out, ref_args, dtype)


# ---------------------------------------------------------------------------------------------- #
# What a launch takes: a recorded winner, else the heuristic; a search only when asked and allowed


def write_file(path, *pairs):
    """A winners file holding (key, config) `pairs`."""
    tuning.write_winners(path, [SearchResult(key, config, 0.01, 0.02) for key, config in pairs])
    return path


@needs_interpreter
def test_launches_take_the_recorded_winner(tmp_path, monkeypatch):
    decode_args, decode_ref = make_paged([(17, 1), (54, 1)], 16, 1, 3, 32, torch.float32, seed=1)
    prefill_args, prefill_ref = make_paged([(54, 30), (17, 17)], 16, 1, 3, 32, torch.float32, seed=2)
    dkey, pkey = decode_key(decode_args), prefill_key(prefill_args)
    # Winners that differ from the heuristics in every knob the candidates vary.
    decode_winner = next(c for c in decode.decode_configs(dkey)
                         if c.kwargs["BLOCK_N"] == 32 and c.num_warps == 2)
    prefill_winner = next(c for c in prefill.prefill_configs(pkey)
                          if c.kwargs["ROWS"] == 128 and c.kwargs["BLOCK_N"] == 32 and c.num_warps == 8)
    for key, winner in ((dkey, decode_winner), (pkey, prefill_winner)):
        heuristic = (decode if key.kernel == "paged_decode" else prefill).heuristic_config(key)
        assert winner.num_warps != heuristic.num_warps and winner.kwargs != heuristic.kwargs
    monkeypatch.setenv(tuning.CONFIGS_ENV, str(write_file(tmp_path / "winners.json", (dkey, decode_winner),
                                                          (pkey, prefill_winner))))
    monkeypatch.setattr(tuning, "benchmark", never)  # a recorded winner is used as is

    decode_spy = KernelSpy(decode._paged_decode_kernel)
    monkeypatch.setattr(decode, "_paged_decode_kernel", decode_spy)
    assert_matches_reference(decode.paged_decode(**decode_args), decode_ref, torch.float32)
    (launch,) = decode_spy.launches
    assert (launch["BLOCK_N"], launch["num_warps"], launch["num_stages"]) == (32, 2, decode_winner.num_stages)

    prefill_spy = KernelSpy(prefill._flash_prefill_kernel)
    monkeypatch.setattr(prefill, "_flash_prefill_kernel", prefill_spy)
    assert_matches_reference(prefill.flash_prefill(**prefill_args), prefill_ref, torch.float32)
    (launch,) = prefill_spy.launches
    # ROWS 128 with a 3:1 group: 42 tokens per tile, capped at this step's longest run of 30.
    assert (launch["BLOCK_Q"], launch["BLOCK_M"], launch["BLOCK_N"], launch["num_warps"]) == (30, 128, 32, 8)
    assert tuning.settled(dkey) and tuning.settled(pkey) and not tuning.search_results()


@needs_interpreter
@pytest.mark.parametrize("autotune", [None, "1", "force"])
def test_launches_without_a_winner_take_the_heuristic(monkeypatch, autotune):
    """No winner (and under the interpreter even with HF_PAGED_AUTOTUNE set): the heuristic, no timing."""
    if autotune is not None:
        monkeypatch.setenv(tuning.AUTOTUNE_ENV, autotune)
    monkeypatch.setattr(tuning, "benchmark", never)
    decode_args, decode_ref = make_paged([(17, 1), (54, 1)], 16, 1, 3, 32, torch.float32, seed=3)
    prefill_args, prefill_ref = make_paged([(54, 30), (17, 17)], 16, 1, 3, 32, torch.float32, seed=4)

    decode_spy = KernelSpy(decode._paged_decode_kernel)
    monkeypatch.setattr(decode, "_paged_decode_kernel", decode_spy)
    assert_matches_reference(decode.paged_decode(**decode_args), decode_ref, torch.float32)
    heuristic = decode.heuristic_config(decode_key(decode_args))
    (launch,) = decode_spy.launches
    assert (launch["BLOCK_N"], launch["num_warps"], launch["num_stages"]) == (64, 4, 3) == (
        heuristic.kwargs["BLOCK_N"], heuristic.num_warps, heuristic.num_stages)

    prefill_spy = KernelSpy(prefill._flash_prefill_kernel)
    monkeypatch.setattr(prefill, "_flash_prefill_kernel", prefill_spy)
    assert_matches_reference(prefill.flash_prefill(**prefill_args), prefill_ref, torch.float32)
    (launch,) = prefill_spy.launches
    assert (launch["BLOCK_Q"], launch["BLOCK_M"], launch["BLOCK_N"], launch["num_warps"]) == (21, 64, 64, 4)
    assert not tuning.search_results()


KEY = TuningKey("paged_decode", "NVIDIA H200", 64, 64, 3, 16, "bfloat16", "bfloat16", 16)


def fake_timings(monkeypatch, ms_by_block_n, failing=()):
    """Let `choose_config` search on the CPU with made-up times (by BLOCK_N, plus 1% a warp). Returns
    the list of launched configs; its `append` is the `launch` to search with."""
    timed = []

    def benchmark(fn):
        fn()
        config = timed[-1]
        if config.kwargs["BLOCK_N"] in failing:
            raise RuntimeError("out of resources")
        return ms_by_block_n[config.kwargs["BLOCK_N"]] * (1 + config.num_warps / 100)

    monkeypatch.setattr(tuning, "can_benchmark", lambda device: True)
    monkeypatch.setattr(tuning, "benchmark", benchmark)
    return timed


def test_a_search_runs_once_per_key_and_can_be_written_back(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    timed = fake_timings(monkeypatch, {16: 3.0, 32: 2.0, 64: 1.5, 128: 1.0})
    candidates = decode.decode_configs(KEY)
    calls = []

    def list_candidates():
        calls.append(1)
        return candidates

    chosen = tuning.choose_config(KEY, list_candidates, timed.append, CPU)
    assert [config_id(c) for c in timed] == [config_id(c) for c in candidates]  # every candidate, once
    fastest = min(c.num_warps for c in candidates if c.kwargs["BLOCK_N"] == 128)
    assert (chosen.kwargs["BLOCK_N"], chosen.num_warps) == (128, fastest)
    # Settled: the next launch of the key is a dict lookup, no candidates, no timing.
    assert tuning.choose_config(KEY, list_candidates, timed.append, CPU) is chosen
    assert len(calls) == 1 and len(timed) == len(candidates)

    (result,) = tuning.search_results()
    assert result.heuristic_ms == pytest.approx(1.5 * 1.04) and result.winner is chosen
    path = tmp_path / "winners.json"
    tuning.write_winners(path, [result])
    assert config_id(tuning.recorded_winners(path)[KEY]) == config_id(chosen)


def test_a_search_keeps_the_heuristic_within_noise_and_skips_failures(monkeypatch):
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    # BLOCK_N 128 would win by far but fails; the best of the rest (BLOCK_N 32 or 64 at 2 warps, 1.53)
    # is under MIN_GAIN faster than the heuristic (BLOCK_N 64 at 4 warps, 1.56).
    timed = fake_timings(monkeypatch, {16: 3.0, 32: 1.5, 64: 1.5, 128: 0.1}, failing=(128,))
    with pytest.warns(UserWarning, match="failed while tuning"):
        chosen = tuning.choose_config(KEY, lambda: decode.decode_configs(KEY), timed.append, CPU)
    assert config_id(chosen) == config_id(decode.heuristic_config(KEY))
    (result,) = tuning.search_results()
    assert math.inf in [ms for _, ms in result.timings]


def test_no_search_in_a_graph_capture_and_the_key_stays_open(monkeypatch):
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(tuning, "benchmark", never)
    cuda = torch.device("cuda", 0)
    assert not tuning.can_benchmark(cuda)
    assert tuning.choose_config(KEY, lambda: decode.decode_configs(KEY), never, cuda) is None
    assert not tuning.settled(KEY)  # the next eager call may still search
    monkeypatch.delenv(tuning.AUTOTUNE_ENV)
    assert tuning.choose_config(KEY, lambda: decode.decode_configs(KEY), never, cuda) is None
    assert tuning.settled(KEY)  # autotuning off: the heuristic, for good


def test_a_stale_recorded_winner_is_ignored(monkeypatch, tmp_path):
    not_a_candidate = triton.Config({"BLOCK_N": 256}, num_warps=4, num_stages=3)
    monkeypatch.setenv(tuning.CONFIGS_ENV, str(write_file(tmp_path / "stale.json", (KEY, not_a_candidate))))
    with pytest.warns(UserWarning, match="not among the kernel's candidates"):
        assert tuning.choose_config(KEY, lambda: decode.decode_configs(KEY), never, CPU) is None


def test_autotune_mode_parsing(monkeypatch):
    for value, mode in [("0", "off"), ("", "off"), ("1", "on"), ("true", "on"), ("FORCE", "force")]:
        monkeypatch.setenv(tuning.AUTOTUNE_ENV, value)
        assert tuning.autotune_mode() == mode
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "sometimes")
    with pytest.raises(ValueError, match="HF_PAGED_AUTOTUNE"):
        tuning.autotune_mode()


def test_launchers_refuse_malformed_configs():
    decode_args, _ = make_paged([(17, 1)], 16, 1, 1, 32, torch.float32, seed=5)
    prefill_args, _ = make_paged([(17, 17)], 16, 1, 1, 32, torch.float32, seed=5)
    with pytest.raises(ValueError, match="power of two"):
        decode.paged_decode(**decode_args, config=triton.Config({"BLOCK_N": 24}, num_warps=4, num_stages=2))
    with pytest.raises(ValueError, match="triton.Config of"):
        decode.paged_decode(**decode_args, config=triton.Config({"BLOCK_N": 32, "ROWS": 64}, num_warps=4))
    with pytest.raises(ValueError, match="triton.Config of"):
        prefill.flash_prefill(**prefill_args, config=triton.Config({"BLOCK_N": 32}, num_warps=4))
    with pytest.raises(ValueError, match="num_warps"):
        prefill.flash_prefill(**prefill_args, config=triton.Config({"BLOCK_N": 32, "ROWS": 64}, num_warps=3))


# ---------------------------------------------------------------------------------------------- #
# Pruning


def key_of(kernel, head_dim, group, dtype="bfloat16", block_m=16, kv_dtype=None):
    return TuningKey(kernel, "NVIDIA H200", head_dim, head_dim, group, 16, dtype, kv_dtype or dtype,
                     block_m if kernel == "paged_decode" else 0)


@pytest.mark.parametrize("kernel", ["paged_decode", "flash_prefill"])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 128, 256])
@pytest.mark.parametrize("group, block_m", [(1, 16), (4, 16), (8, 128), (12, 64)])
@pytest.mark.parametrize("dtype, kv_dtype", [("bfloat16", None), ("float32", None), ("float32", "bfloat16"),
                                             ("float16", "int8")])
def test_the_heuristic_leads_every_pruned_list(kernel, head_dim, group, block_m, dtype, kv_dtype):
    module = decode if kernel == "paged_decode" else prefill
    key = key_of(kernel, head_dim, group, dtype, block_m, kv_dtype)
    configs = (decode.decode_configs if module is decode else prefill.prefill_configs)(key)
    assert config_id(configs[0]) == config_id(module.heuristic_config(key))
    assert len({config_id(c) for c in configs}) == len(configs)


def test_pruning_drops_what_cannot_fit():
    budget = tuning.DEFAULT_SHARED_MEMORY

    def misfit(block_m, block_n, head_dim, num_warps, num_stages, elem_bytes, shared_memory=budget):
        return tuning.tile_misfit(block_m=block_m, block_n=block_n, block_d=head_dim, block_dv=head_dim,
                                  num_warps=num_warps, num_stages=num_stages, elem_bytes=elem_bytes,
                                  shared_memory=shared_memory) or ""

    # Idle warps. Decode at BLOCK_M 16: a 16 x BLOCK_N score block holds BLOCK_N / 8 MMA tiles, so
    # BLOCK_N 16 feeds two warps at most, BLOCK_N 32 four.
    configs = decode.decode_configs(key_of("paged_decode", 64, 3))
    assert all(16 * c.kwargs["BLOCK_N"] >= tuning.MMA_TILE_ELEMENTS * c.num_warps for c in configs)
    assert {(c.kwargs["BLOCK_N"], c.num_warps) for c in configs} >= {(16, 2), (32, 4), (128, 8)}
    assert misfit(16, 16, 64, 4, 3, 2).startswith("idle warps")

    # Shared memory. bf16 head_dim 256: K + V tiles are 1 KiB a key. BLOCK_N 128 (2 stages, 256 KiB)
    # exceeds even Hopper's 227 KiB; with 100 KiB (Ampere-class) BLOCK_N 64 (2 x 64 KiB) goes too.
    key = key_of("paged_decode", 256, 1)
    hopper, smaller = decode.decode_configs(key), decode.decode_configs(key, 100 * 1024)
    assert {c.kwargs["BLOCK_N"] for c in hopper} == {32, 64}
    assert {c.kwargs["BLOCK_N"] for c in smaller} == {32}
    assert misfit(16, 128, 256, 8, 2, 2).startswith("shared memory")
    assert misfit(16, 64, 256, 8, 2, 2, shared_memory=100 * 1024).startswith("shared memory")
    # The heuristic is kept and first even when it does not fit (it is what launches without tuning).
    key = key_of("paged_decode", 256, 1, "float32")
    heuristic = decode.heuristic_config(key)
    assert misfit(16, 32, 256, heuristic.num_warps, heuristic.num_stages, 4, 48 * 1024)
    assert [config_id(c) for c in decode.decode_configs(key, 48 * 1024)] == [config_id(heuristic)]

    # Registers: a 128 x 128 fp32 accumulator alone is 128 words a thread at 4 warps.
    configs = prefill.prefill_configs(key_of("flash_prefill", 128, 4))
    assert not [c for c in configs if c.kwargs["ROWS"] == 128 and c.num_warps == 4]
    assert misfit(128, 64, 128, 4, 3, 2).startswith("registers")
    assert misfit(128, 64, 128, 8, 3, 2).startswith("registers")  # 160 words: ptxas spills it too


def test_tuning_the_listed_models_compiles_few_candidates(capsys):
    """`tune`'s default shapes (SmolLM2-135M and a Llama-8B, bf16, block 16): every key's pruned
    list is short, so tuning them all is about two dozen compiles, not minutes of them."""
    found = tune.list_candidates(list(tune.MODELS), [torch.bfloat16], [16], [1], CPU)
    assert sorted(k.kernel for k in found) == ["flash_prefill"] * 2 + ["paged_decode"] * 2
    assert max(map(len, found.values())) <= 8 and sum(map(len, found.values())) <= 24, found
    assert tune.main(["--list", "--models", "smollm2-135m"]) == 0
    assert "BLOCK_N=64 num_warps=4 num_stages=3" in capsys.readouterr().out


@needs_interpreter
def test_the_tune_command_end_to_end_with_made_up_timings(monkeypatch, tmp_path, capsys):
    """`tune.tune` through the real launchers (each candidate launched by the search, under the
    interpreter), with timings made up since nothing can be timed here; then written back and read."""
    timings = iter([0.5 ** i for i in range(100)])  # each candidate twice as fast: the last of each key wins
    monkeypatch.setattr(tuning, "can_benchmark", lambda device: True)
    monkeypatch.setattr(tuning, "benchmark", lambda fn: (fn(), float(next(timings)))[1])
    results = tune.tune(["smollm2-135m"], [torch.float32], [16], [1], decode_seqs=2, context=40, prefill_seqs=1,
                        prefill_len=24, device=CPU)
    assert os.environ.get(tuning.AUTOTUNE_ENV) is None  # restored
    assert [r.key.kernel for r in results] == ["paged_decode", "flash_prefill"]
    for r in results:
        candidates = (decode.decode_configs if r.key.kernel == "paged_decode" else prefill.prefill_configs)(r.key)
        assert [config_id(c) for c, _ in r.timings] == [config_id(c) for c in candidates]
        assert config_id(r.winner) == config_id(candidates[-1]) and r.winner_ms < r.heuristic_ms
    path = tmp_path / "winners.json"
    tuning.write_winners(path, results)
    assert set(tuning.recorded_winners(path)) == {r.key for r in results}
    if not torch.cuda.is_available():
        assert tune.main(["--out", str(path)]) == 2  # searching for real needs a GPU
        assert "needs a CUDA GPU" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- #
# The winners file


def test_the_packaged_winners_file_names_only_candidates():
    path = tuning.DEFAULT_CONFIGS_PATH
    assert path.exists()
    entries = tuning.load_entries(path)  # also checks the file's version
    for entry in entries:
        key = TuningKey.from_dict(entry)
        assert key.kernel in ("paged_decode", "flash_prefill"), entry
        build = decode.decode_configs if key.kernel == "paged_decode" else prefill.prefill_configs
        # Hopper's limit is the largest: a candidate on any GPU is a candidate here.
        candidates = {config_id(c) for c in build(key, tuning.DEFAULT_SHARED_MEMORY)}
        assert config_id(tuning.config_from_dict(entry["config"])) in candidates, entry
        assert 0 < entry["ms"] <= entry["heuristic_ms"], entry
    assert len({TuningKey.from_dict(e) for e in entries}) == len(entries)


def test_writing_winners_merges_by_key(tmp_path):
    path = tmp_path / "winners.json"
    other = KEY._replace(device="NVIDIA H100 80GB HBM3")
    first, second = decode.decode_configs(KEY)[:2]
    write_file(path, (KEY, first), (other, first))
    write_file(path, (KEY, second))  # replaces KEY's entry, keeps the other GPU's
    recorded = tuning.recorded_winners(path)
    assert set(recorded) == {KEY, other}
    assert config_id(recorded[KEY]) == config_id(second) and config_id(recorded[other]) == config_id(first)


# ---------------------------------------------------------------------------------------------- #
# On a GPU: every candidate compiled, a real search, and a settled launch inside a CUDA graph

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED,
                               reason="needs a CUDA GPU with compiled Triton")
GPU_ROWS = {"paged_decode": [(1, 1), (17, 4), (54, 1), (97, 1)],
            "flash_prefill": [(1, 1), (17, 17), (54, 20), (97, 97)]}


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("model", list(tune.MODELS))
@pytest.mark.parametrize("kernel", ["paged_decode", "flash_prefill"])
def test_every_candidate_compiles_and_matches_on_gpu(kernel, model):
    """bf16 (which the interpreter cannot check), each model shape of `tune`: ~24 compiles in all."""
    shape = tune.MODELS[model]
    group = shape.num_q_heads // shape.num_kv_heads
    rows = GPU_ROWS[kernel]
    device = torch.device("cuda", torch.cuda.current_device())
    kernel_args, ref_args = make_paged(rows, 16, shape.num_kv_heads, group, shape.head_dim, torch.bfloat16, seed=0,
                                       device=device)
    if kernel == "paged_decode":
        fn, configs = decode.paged_decode, decode.decode_configs(decode_key(kernel_args, device),
                                                                 tuning.shared_memory_limit(device))
    else:
        fn, configs = prefill.flash_prefill, prefill.prefill_configs(prefill_key(kernel_args, device),
                                                                     tuning.shared_memory_limit(device))
    expected = reference.paged_attention(**ref_args)
    for config in configs:
        out = fn(**kernel_args, config=config)
        assert not out.isnan().any(), tuning.config_str(config)
        # bf16 inputs, fp32 accumulation: P and the output are rounded to bf16.
        torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2, msg=tuning.config_str(config))


@pytest.mark.cuda
@needs_gpu
def test_search_then_replay_a_settled_launch_in_a_cuda_graph(tmp_path, monkeypatch):
    device = torch.device("cuda", torch.cuda.current_device())
    results = tune.tune(["smollm2-135m"], [torch.bfloat16], [16], [1], decode_seqs=4, context=1024, prefill_seqs=1,
                        prefill_len=64, device=device, kernels=["paged_decode"])
    (result,) = results
    assert result.key.kernel == "paged_decode" and all(math.isfinite(ms) for _, ms in result.timings)
    assert config_id(result.winner) in {config_id(c) for c in decode.decode_configs(result.key)}
    path = tmp_path / "winners.json"
    tuning.write_winners(path, results)
    monkeypatch.setenv(tuning.CONFIGS_ENV, str(path))
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")  # a recorded key must still not be searched
    monkeypatch.setattr(tuning, "benchmark", never)
    tuning.clear_cache()

    args = tune.paged_batch(tune.MODELS["smollm2-135m"], 4, 1024, 1, 16, torch.bfloat16, device, seed=1)
    eager = decode.paged_decode(**args)  # settles the key from the file
    assert tuning.settled(result.key)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode.paged_decode(**args)  # warm-up on the capture stream, as torch.cuda.graph asks
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode.paged_decode(**args)
    args["query"].mul_(-1)  # new inputs, same buffers
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, decode.paged_decode(**args), atol=0, rtol=0)
    assert not torch.equal(captured, eager)
    assert not tuning.search_results()
