"""What the native CPU kernel trusts: its build cache, its compiler, and the metadata of a call.

The cache (`HF_PAGED_KERNEL_CACHE`) holds a library that runs inside the process, under a name anyone
can compute: a folder or file that another user could write is refused, and a library is loaded only
when its bytes match the sha256 recorded at build time. A library that is truncated, garbage or
lacks the kernel's symbol is rebuilt once, then the torch path takes over, with one warning and no
exception. A missing `$CC` is named, not replaced by gcc. And a call whose metadata would make the
kernel read or write outside its tensors is a ValueError naming the field.

One real build per module (into a folder that does not exist yet, so its creation is checked too);
every other "build" is a stand-in compiler that copies a prepared library and logs each call, so the
rebuilds cost nothing and can be counted. A planted library's constructor writes a marker file: the
marker is the proof that it was (or was not) loaded.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import subprocess
from types import SimpleNamespace

import pytest
import torch

from hf_paged.attention import cpu_kernel, interface
from hf_paged.attention.metadata import PAGED, StepMetadata

PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
/* Runs as soon as the library is loaded: what an attacker's library would do. */
__attribute__((constructor)) static void planted(void) {
    const char *path = getenv("HF_PAGED_TEST_MARKER");
    if (path) { FILE *f = fopen(path, "w"); if (f) { fputs("ran\n", f); fclose(f); } }
}
int hf_paged_attention_f32(void) { return 0; }
"""
NO_SYMBOL_C = "int not_the_kernel(void) { return 0; }\n"
# A stand-in compiler: a version for the cache key, one log line per build, and the "build" is a copy
# of $FAKE_CC_OUTPUT to the -o path.
FAKE_CC = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "fake-cc 1.0"; exit 0; fi
echo build >> "$FAKE_CC_LOG"
while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then out="$2"; fi; shift; done
cp "$FAKE_CC_OUTPUT" "$out"
"""
OTHER_UID = 54321  # a user that is neither this one nor root


def _compile(tmp, name, source):
    cc = shutil.which("cc") or shutil.which("gcc")
    src = tmp / f"{name}.c"
    src.write_text(source)
    out = tmp / f"{name}.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One real build into a folder that does not exist yet, the libraries the tests plant, the
    stand-in compiler, and the cache name a library gets under that compiler."""
    root = tmp_path_factory.mktemp("kernel_trust")
    folder = root / "made" / "kernels"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_kernel, "_loaded", {})
        mp.setenv("HF_PAGED_KERNEL_CACHE", str(folder))
        mp.delenv("CC", raising=False)
        fn = cpu_kernel.load()
        if fn is None:
            pytest.skip(f"no CPU kernel: {cpu_kernel.load_error()}")
    (library,) = folder.glob("paged_attention-*.so")
    fake_cc = root / "fake-cc"
    fake_cc.write_text(FAKE_CC)
    fake_cc.chmod(0o755)
    probe = root / "probe"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_kernel, "_loaded", {})
        mp.setenv("HF_PAGED_KERNEL_CACHE", str(probe))
        mp.setenv("CC", str(fake_cc))
        mp.setenv("FAKE_CC_OUTPUT", str(library))
        mp.setenv("FAKE_CC_LOG", str(root / "probe.log"))
        assert cpu_kernel.load() is not None
    (fake_target,) = probe.glob("paged_attention-*.so")
    return SimpleNamespace(folder=folder, library=library, data=library.read_bytes(), fn=fn, fake_cc=fake_cc,
                           fake_name=fake_target.name, planted=_compile(root, "planted", PLANTED_C),
                           no_symbol=_compile(root, "no_symbol", NO_SYMBOL_C))


@pytest.fixture
def cache(built, tmp_path, monkeypatch):
    """A private cache folder of this test's own, the stand-in compiler as $CC, and a fresh load state."""
    monkeypatch.setattr(cpu_kernel, "_loaded", {})
    folder = tmp_path / "kernels"
    folder.mkdir()
    folder.chmod(0o700)
    log, marker = tmp_path / "cc.log", tmp_path / "planted-ran"
    monkeypatch.setenv("HF_PAGED_KERNEL_CACHE", str(folder))
    monkeypatch.setenv("CC", str(built.fake_cc))
    monkeypatch.setenv("FAKE_CC_OUTPUT", str(built.library))
    monkeypatch.setenv("FAKE_CC_LOG", str(log))
    monkeypatch.setenv("HF_PAGED_TEST_MARKER", str(marker))
    target = folder / built.fake_name
    return SimpleNamespace(
        folder=folder, target=target, record=target.with_name(target.name + ".sha256"), marker=marker,
        builds=lambda: len(log.read_text().splitlines()) if log.exists() else 0,
    )


def plant(target, data: bytes, record: bytes | None = None, mode: int = 0o600):
    """Write `data` as the library `target`, and `record` (a hash's bytes) as its sha256 record."""
    target.write_bytes(data)
    target.chmod(mode)
    if record is not None:
        record_path = target.with_name(target.name + ".sha256")
        record_path.write_text(hashlib.sha256(record).hexdigest() + "\n")
        record_path.chmod(0o600)


def warnings_of(caplog):
    return [r for r in caplog.records if r.name == cpu_kernel.__name__ and r.levelno >= logging.WARNING]


def assert_torch_path_with_one_warning(caplog, *reasons):
    with caplog.at_level("WARNING"):
        assert cpu_kernel.load() is None
        assert cpu_kernel.load() is None
    assert len(warnings_of(caplog)) == 1
    for reason in reasons:
        assert reason in cpu_kernel.load_error()


# -- the cache folder and its files ------------------------------------------------------------------

def test_a_new_cache_folder_is_private_and_each_library_has_its_hash_recorded(built):
    assert stat.S_IMODE(built.folder.stat().st_mode) == 0o700
    record = built.library.with_name(built.library.name + ".sha256")
    assert record.read_text().strip() == hashlib.sha256(built.data).hexdigest()
    for path in (built.library, record):
        assert not path.stat().st_mode & 0o022


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770], ids=["world", "world-sticky", "group"])
def test_a_cache_folder_others_can_write_is_refused(cache, built, mode, caplog):
    """A shared folder: whoever can create a name there chooses what this process runs (the sticky
    bit does not help: the name may not exist yet). Nothing in it is loaded, nothing is built."""
    plant(cache.target, built.planted.read_bytes(), record=built.planted.read_bytes())
    cache.folder.chmod(mode)
    assert_torch_path_with_one_warning(caplog, str(cache.folder), "writable by group or others")
    assert not cache.marker.exists()
    assert cache.builds() == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder another user's needs root")
def test_a_cache_folder_of_another_user_is_refused(cache, built, caplog):
    plant(cache.target, built.planted.read_bytes(), record=built.planted.read_bytes())
    os.chown(cache.folder, OTHER_UID, OTHER_UID)
    cache.folder.chmod(0o755)
    assert_torch_path_with_one_warning(caplog, str(cache.folder), f"owned by uid {OTHER_UID}")
    assert not cache.marker.exists()


@pytest.mark.parametrize("case", ["library-group-writable", "library-world-writable", "library-of-another-user",
                                  "record-world-writable", "record-of-another-user"])
def test_a_library_or_record_others_could_write_is_refused(cache, built, case, caplog):
    """In a private folder, a library (or its hash record) that another user owns or may write is
    not loaded, even when the record matches."""
    plant(cache.target, built.planted.read_bytes(), record=built.planted.read_bytes())
    path = cache.target if case.startswith("library") else cache.record
    if case.endswith("of-another-user"):
        if os.geteuid() != 0:
            pytest.skip("making a file another user's needs root")
        os.chown(path, OTHER_UID, OTHER_UID)
        reason = f"owned by uid {OTHER_UID}"
    else:
        path.chmod(0o620 if "group" in case else 0o602)
        reason = "writable by group or others"
    assert_torch_path_with_one_warning(caplog, str(path), reason)
    assert not cache.marker.exists()


@pytest.mark.parametrize("record", ["missing", "wrong"])
def test_a_library_without_its_recorded_hash_is_rebuilt_not_loaded(cache, built, record):
    """A library the build did not record (planted, or left by an older hf_paged) is never loaded:
    it is rebuilt once, and the rebuilt library and its record replace it."""
    plant(cache.target, built.planted.read_bytes(), record=None if record == "missing" else b"other bytes")
    assert cpu_kernel.load() is not None
    assert not cache.marker.exists()
    assert cache.builds() == 1
    assert cache.target.read_bytes() == built.data
    assert cache.record.read_text().strip() == hashlib.sha256(built.data).hexdigest()
    assert sorted(p.name for p in cache.folder.iterdir()) == sorted([cache.target.name, cache.record.name])


# -- broken libraries ---------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_library_is_rebuilt(cache, built, damage):
    """A truncated copy (whose record still names the whole library) is hashed before it is mapped,
    so it never takes the process down with SIGBUS; garbage is rebuilt, not kept forever."""
    data = built.data[:len(built.data) // 2] if damage == "truncated" else b"\x7fELF not a library" * 64
    plant(cache.target, data, record=built.data)
    assert cpu_kernel.load() is not None
    assert cache.builds() == 1
    assert cache.target.read_bytes() == built.data
    cpu_kernel._loaded.clear()  # a later process finds the rebuilt library and builds nothing
    assert cpu_kernel.load() is not None
    assert cache.builds() == 1


def test_a_library_without_the_kernel_symbol_is_rebuilt(cache, built):
    plant(cache.target, built.no_symbol.read_bytes(), record=built.no_symbol.read_bytes())
    assert cpu_kernel.load() is not None
    assert cache.builds() == 1


def test_a_rebuild_that_still_fails_takes_the_torch_path_once(cache, built, monkeypatch, caplog):
    """The rebuild happens once; when it gives no kernel either, one warning names the reason and
    every later call is None: no exception reaches `generate`."""
    plant(cache.target, b"garbage" * 100)
    monkeypatch.setenv("FAKE_CC_OUTPUT", str(built.no_symbol))
    assert_torch_path_with_one_warning(caplog, "hf_paged_attention_f32")
    assert cache.builds() == 1


# -- the compiler --------------------------------------------------------------------------------------

def test_a_missing_CC_is_named_not_replaced_by_gcc(cache, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/hf-paged-cc")
    assert_torch_path_with_one_warning(caplog, "$CC=/nonexistent/hf-paged-cc not found")
    assert not list(cache.folder.glob("*.so"))


# -- the metadata of a call ----------------------------------------------------------------------------

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, NUM_Q_HEADS = 6, 16, 2, 32, 4


@pytest.fixture
def kernel(built, monkeypatch):
    """The module's kernel, loaded, and the "cpu" backend forced: short runs go to the native call."""
    monkeypatch.setattr(cpu_kernel, "_loaded", {"fn": built.fn})
    monkeypatch.setenv("HF_PAGED_BACKEND", "cpu")
    calls = []
    real = cpu_kernel.attend
    monkeypatch.setattr(cpu_kernel, "attend", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def hand_built_step(cu, seq_lens, block_tables, num_tokens):
    """A caller's own StepMetadata (no cache planned it): one packed row of `num_tokens` tokens."""
    q_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    return StepMetadata(
        mode=PAGED, batch_size=1, q_len=num_tokens, num_columns=0,
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(block_tables, dtype=torch.int32),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.long), token_index=None, num_padding=None, copies=[],
        max_seqlen_q=max(q_lens + [1]), max_seqlen_k=max(seq_lens + [1]),
    )


def forward(step, num_tokens, num_q_heads=NUM_Q_HEADS, head_dim=HEAD_DIM, sinks=None):
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, num_q_heads, num_tokens, head_dim, generator=gen)
    key = torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    value = torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    module = torch.nn.Module()
    module.layer_idx = 0
    out, _ = interface.paged_attention_forward(module, query, key, value, None, scaling=0.2, s_aux=sinks,
                                               paged_metadata=step)
    return out


def test_a_well_formed_hand_built_step_runs_on_the_kernel(kernel):
    step = hand_built_step([0, 1, 3], [20, 9], [[0, 1], [2, 0]], num_tokens=3)
    out = forward(step, 3, sinks=torch.zeros(NUM_Q_HEADS))
    assert out.shape == (1, 3, NUM_Q_HEADS, HEAD_DIM) and torch.isfinite(out).all()
    assert len(kernel) == 1


BAD_STEPS = {
    # name: (cu_seqlens_q, seq_lens, block_tables, query tokens, the field the error names)
    "cu-overruns-the-query": ([0, 16], [20], [[0, 1]], 1, "cu_seqlens_q"),
    "cu-overruns-by-one": ([0, 1, 9], [5, 30], [[0, 1], [2, 3]], 8, "cu_seqlens_q"),
    "cu-not-from-zero": ([1, 2], [5], [[0, 1]], 2, "cu_seqlens_q"),
    "cu-decreasing": ([0, 2, 1], [5, 5], [[0, 1], [2, 3]], 2, "cu_seqlens_q"),
    "cu-wrong-length": ([0, 1], [5, 5], [[0, 1], [2, 3]], 1, "cu_seqlens_q"),
    "seq-shorter-than-its-queries": ([0, 4], [2], [[0, 1]], 4, "seq_lens"),
    "seq-past-its-table": ([0, 1], [40], [[0, 1]], 1, "seq_lens"),
}


@pytest.mark.parametrize("name", BAD_STEPS)
def test_metadata_the_kernel_would_overrun_is_a_value_error(kernel, name):
    """Hand-built metadata that would send the kernel past the query, the output or the block table
    is refused before any native call, with the field named, never a crash."""
    cu, seq_lens, block_tables, num_tokens, field = BAD_STEPS[name]
    with pytest.raises(ValueError, match=field):
        forward(hand_built_step(cu, seq_lens, block_tables, num_tokens), num_tokens)
    assert not kernel


@pytest.mark.parametrize("case", ["wider-head-dim", "heads-not-a-multiple", "short-sinks", "long-sinks"])
def test_a_query_or_sinks_shaped_unlike_the_cache_is_a_value_error(kernel, case):
    step = hand_built_step([0, 1, 3], [20, 9], [[0, 1], [2, 0]], num_tokens=3)
    shapes = {"wider-head-dim": (dict(head_dim=2 * HEAD_DIM), "head_dim"),
              "heads-not-a-multiple": (dict(num_q_heads=5), "num_q_heads"),
              "short-sinks": (dict(sinks=torch.zeros(NUM_Q_HEADS - 1)), "sinks"),
              "long-sinks": (dict(sinks=torch.zeros(NUM_Q_HEADS + 1)), "sinks")}
    kwargs, field = shapes[case]
    with pytest.raises(ValueError, match=field):
        forward(step, 3, **kwargs)
    assert not kernel
