"""Under load: Python numbers that change, bounded caches, threads and processes (CPU)."""

import gc
import math
import os
import subprocess
import sys
import textwrap
import tracemalloc
import types

import pytest
import torch

import flexattn
from flexattn import call, lru, modcache, mods, scalars
from flexattn.codegen import cache
from flexattn.decode import decode_attention
from flexattn.kernels import decode as dec, launch, plans
from flexattn.reference import attention_reference
from helpers.calls import record_calls, run_in_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _poison_outputs(nan_outputs):
    """Outputs start as NaN, so anything the kernels fail to write shows up (tests/conftest.py)."""


def qkv(Q_LEN, KV_LEN, E=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 1, n, E, generator=g, dtype=dtype) for n in (Q_LEN, KV_LEN, KV_LEN))


def assert_right(out, q, k, v, **kw):
    """float64: to rounding; float32 (the decoding kernel's inputs): within 8x the error of eager
    attention in float32, both against float64."""
    ref = attention_reference(q, k, v, **kw)
    if q.dtype == torch.float64:
        torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-12)
        return
    eager = attention_reference(q, k, v, dtype=None, **kw)
    assert (out.double() - ref).abs().max() <= 8 * (eager.double() - ref).abs().max() + 1e-7


def test_python_int_position_in_a_decoding_loop(monkeypatch):
    """The position of a decoding loop is a plain Python int the score_mod captures: two kernels
    in all (the constant one of the first step, the one that reads it), and from the third step
    on each step is a known call."""
    compiled = record_calls(monkeypatch, launch, "load_kernel_module")
    planned = record_calls(monkeypatch, call, "_plan_call")
    decoded = record_calls(monkeypatch, dec, "run")
    q, k, v = qkv(1, 24, dtype=torch.float32)
    for pos in range(100):
        p = pos % 24
        out = flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx:
                                      torch.where(kv_idx <= p, s, -math.inf))
        assert_right(out, q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= p)
    assert len(compiled) <= 2 and len(decoded) == 100
    assert len(planned) == 3  # the constant, the first dynamic (keyed before it was), its known call


POSITION = 0


def test_module_global_int_and_default_are_dynamic(monkeypatch):
    """A module global and a default argument that change are read per call too."""
    global POSITION
    compiled = record_calls(monkeypatch, launch, "load_kernel_module")
    q, k, v = qkv(1, 20)
    for step in range(6):
        POSITION = 3 * step

        def score(s, b, h, q_idx, kv_idx, width=step + 1):
            return torch.where((kv_idx <= POSITION) & (kv_idx > POSITION - width), s, -math.inf)

        out = flexattn.flex_attention(q, k, v, score_mod=score)
        assert_right(out, q, k, v, mask_mod=lambda b, h, q_idx, kv_idx:
                     (kv_idx <= 3 * step) & (kv_idx > 3 * step - step - 1))
    assert len(compiled) <= 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_python_float_temperature_changed_every_step(monkeypatch, dtype):
    """The call key holds the 0-d tensor a changing float is passed as in the call's own float
    dtype (float64 for float64 inputs): from the third step on each step is a known call (keyed
    with a float32 tensor, a float64 call never hit its known call and planned every step)."""
    compiled = record_calls(monkeypatch, launch, "load_kernel_module")
    planned = record_calls(monkeypatch, call, "_plan_call")
    q, k, v = qkv(8, 20, dtype=dtype)
    for step in range(12):
        temperature = 0.5 + 0.37 * step
        out = flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s / temperature,
                                      kernel_options={"FORCE_USE_FLEX_ATTENTION": True})
        assert_right(out, q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s / temperature)
    assert len(compiled) <= 2
    assert len(planned) <= 3  # at most the constant, the first dynamic and its known call: not one per step


def test_a_number_used_as_a_python_value_stays_a_constant():
    """``math.exp(t)`` needs the number itself: the slot stays a constant of the code (one kernel
    per value), and every answer is right."""
    q, k, v = qkv(4, 12)
    for t in (0.1, 0.2, 0.3):
        out = flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s * math.exp(t))
        assert_right(out, q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s * math.exp(t))
    code = test_a_number_used_as_a_python_value_stays_a_constant.__code__.co_consts
    lam = next(c for c in code if getattr(c, "co_name", "") == "<lambda>")
    assert scalars.dynamic_slots(lam) == ()


def test_an_int_beyond_int64_in_a_dynamic_slot_is_read_as_a_constant():
    """An int that no 0-d tensor holds (past int64) in a slot made dynamic: that call reads it as a
    Python number (here Python folds ``p * 0``), as the first call did, instead of failing to
    make its tensor."""
    q, k, v = qkv(4, 12)
    for p in (1, 2, 2**63, -(2**63) - 1, 2**70, 3):
        out = flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + p * 0 + kv_idx * 0.01)
        assert_right(out, q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + p * 0 + kv_idx * 0.01)


def test_a_captured_nan_is_traced_once(monkeypatch):
    """NaN != NaN, and each closure's NaN is another object: the fingerprint keys NaN by text, so
    a mod made again each call with a NaN in it is a known call, not a trace per call."""
    traced = record_calls(monkeypatch, call, "_trace_score")
    q, k, v = qkv(4, 12)
    for _ in range(3):
        fill = float("nan")
        out = flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx:
                                      torch.where(kv_idx > 100, fill, s))
        assert_right(out, q, k, v)
    assert len(traced) == 1


class Limits:
    POSITION = 0


def test_a_number_read_through_a_module_or_class_attribute_is_never_stale():
    """``limits.POSITION`` of a module global and ``Limits.POSITION`` of a class: the fingerprint
    follows the attribute, so a changed value is not answered by the kernel of the old one."""
    limits = types.ModuleType("limits")
    globals()["limits"] = limits
    try:
        q, k, v = qkv(4, 12)
        for p in (3, 7, 5):
            limits.POSITION = Limits.POSITION = p
            for score in (lambda s, b, h, q_idx, kv_idx: torch.where(kv_idx <= limits.POSITION, s, -math.inf),
                          lambda s, b, h, q_idx, kv_idx: torch.where(kv_idx <= Limits.POSITION, s, -math.inf)):
                out = flexattn.flex_attention(q, k, v, score_mod=score)
                assert_right(out, q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= p)
    finally:
        del globals()["limits"]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dynamic_number_in_a_block_mask_is_never_a_stale_constant(backend):
    """The first limit makes every tile full, later ones make tiles partial or empty: the tables
    follow each value (the interval analysis bounds the value it reads), and attention with them
    is right."""
    q, k, v = qkv(32, 32)
    for limit in (32, 31, 24, 8, 16, 32):
        bm = flexattn.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < limit, None, None, 32, 32,
                                        device="cpu", BLOCK_SIZE=16, backend=backend)
        partial = [int(limit % 16 != 0 and n == limit // 16) for n in range(2)]
        full = sum(16 * (n + 1) <= limit for n in range(2))
        assert bm.full_kv_num_blocks[0, 0].tolist() == [full, full]
        assert bm.kv_num_blocks[0, 0].tolist() == [sum(partial)] * 2
        out = flexattn.flex_attention(q, k, v, block_mask=bm)
        assert_right(out, q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: kv_idx < limit)


# ---------------------------------------------------------------------------------------------
# Bounded caches


def test_lru_drops_the_least_recently_used():
    evicted = []
    c = lru.LRU(2, on_evict=lambda key, value: evicted.append(key))
    c["a"], c["b"] = 1, 2
    assert c.get("a") == 1
    c["c"] = 3
    assert c.keys() == ["a", "c"] and evicted == ["b"]
    assert c.get_or_make("a", lambda: 9) == 1 and c.get_or_make("d", lambda: 4) == 4
    assert c.keys() == ["a", "d"] and len(c) == 2
    with pytest.raises(ValueError, match="limit must be a positive int, got 0"):
        lru.LRU(0)


def test_a_live_mod_is_found_by_key_after_its_template_was_evicted(monkeypatch):
    """A compiled graph names mods by key (`mods.template`): a mod that is alive stays findable
    when its template has left the bounded table and a shorter-lived mod of the same key came
    and went; and a key made again is recent again."""
    monkeypatch.setattr(mods, "_TEMPLATES", lru.LRU(2))

    def band(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 12345

    kept = flexattn.trace(band, "mask")
    passing = flexattn.trace(band, "mask")  # (the same key)
    del passing
    gc.collect()
    for shift in (1, 2, 3):  # three other keys push the kept one out of the table
        flexattn.trace(lambda b, h, q_idx, kv_idx, s=shift: q_idx >= kv_idx + s, "mask")
    assert kept.key() not in mods._TEMPLATES
    assert mods.template(kept.key()).key() == kept.key()
    made_again = flexattn.trace(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx + 1, "mask").key()
    flexattn.trace(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx + 4, "mask")
    assert made_again in mods._TEMPLATES  # (made again after kept's lookup: the newer of the two)


def test_fresh_closures_over_fresh_tensors_keep_memory_flat(monkeypatch):
    """5,000 calls, each with a new lambda over a new tensor, through the whole call path (the
    kernel launch replaced: interpreting 5,000 launches takes minutes): memory stays flat."""
    monkeypatch.setattr(dec, "run", lambda plan, q, *args: (torch.empty_like(q), None))
    q, k, v = (t.float() for t in qkv(1, 16))  # (float32: the decoding kernel's path)

    def step():
        bias = torch.randn(4)
        flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + bias[h])

    for _ in range(200):
        step()
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.take_snapshot()
        for _ in range(4800):
            step()
        gc.collect()
        grown = sum(d.size_diff for d in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert grown < 64 << 10


def test_distinct_constants_keep_memory_and_disk_under_their_bounds(monkeypatch, tmp_path):
    """1,000 distinct constants (in a tuple: numbers inside containers stay constants) through
    create_block_mask, and 40 through flex_attention with the caches' bounds at 16 and the disk
    cap at 0.25 MB: every cache stays within its bound, the directory under its cap."""
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLEXATTN_CACHE_MAX_MB", "0.25")
    for owner, name in ((launch, "_MODULES"), (cache, "_LOADED"), (modcache, "_CACHE"), (call, "_KNOWN"),
                        (mods, "_TEMPLATES")):
        bounded = getattr(owner, name)
        monkeypatch.setattr(bounded, "limit", 16)
    monkeypatch.setattr(plans.DECODE.plans, "limit", 16)
    monkeypatch.setattr(dec, "run", lambda plan, q, *args: (torch.empty_like(q), None))
    q, k, v = (t.float() for t in qkv(1, 16))  # (float32: the decoding kernel's path)

    def mask_step(i):
        cfg = (i,)
        flexattn.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + cfg[0], None, None, 16, 16,
                                   device="cpu", BLOCK_SIZE=16)

    for i in range(100):
        mask_step(i)
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.take_snapshot()
        for i in range(100, 1000):
            mask_step(i)
        gc.collect()
        grown = sum(d.size_diff for d in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert grown < 256 << 10
    for i in range(40):
        cfg = (i * 0.25,)
        flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + cfg[0])
    sizes = [p.stat().st_size for p in tmp_path.glob("*.py")]
    assert 0 < sum(sizes) <= 0.25 * (1 << 20)
    assert len(sizes) < 40
    assert max(len(launch._MODULES), len(cache._LOADED), len(modcache._CACHE), len(call._KNOWN),
               len(mods._TEMPLATES), len(plans.DECODE)) <= 16


def test_an_entry_evicted_by_another_process_is_written_again(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path))
    source = "X = 1\n"
    path = cache.write_source(source, "probe", interpret=True)
    cache.evict(tmp_path, 0)  # (what a process at its cap does to every entry but its own)
    assert not path.exists()
    assert cache.load_source(source, "probe", interpret=True).X == 1
    assert path.exists()


def test_cache_cap_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("FLEXATTN_CACHE_MAX_MB", raising=False)
    assert cache.max_bytes() == cache.DEFAULT_MAX_MB << 20
    monkeypatch.setenv("FLEXATTN_CACHE_MAX_MB", "1.5")
    assert cache.max_bytes() == 3 << 19
    for raw in ("1e308", "1.7e308"):  # finite megabytes, infinite bytes: no cap, not an OverflowError
        monkeypatch.setenv("FLEXATTN_CACHE_MAX_MB", raw)
        assert cache.max_bytes() == 2**63
    for raw in ("lots", "0", "-5", "nan", "inf"):
        monkeypatch.setenv("FLEXATTN_CACHE_MAX_MB", raw)
        with pytest.raises(ValueError, match=f"FLEXATTN_CACHE_MAX_MB must be a positive number of megabytes, got '{raw}'"):
            cache.max_bytes()


# ---------------------------------------------------------------------------------------------
# Threads and processes


def test_threads_call_forward_decoding_and_create_block_mask_at_once():
    """8 threads, each with its own mods, at once: every answer right."""

    def worker(i):
        q, k, v = qkv(1 if i % 2 else 6, 20, seed=i, dtype=torch.float32)
        window = 3 + i
        mask = lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + window  # noqa: E731
        bm = flexattn.create_block_mask(mask, None, None, q.shape[2], 20, device="cpu", BLOCK_SIZE=16)
        score = lambda s, b, h, q_idx, kv_idx: s * (1.0 + 0.1 * i)  # noqa: E731
        out = flexattn.flex_attention(q, k, v, score_mod=score, block_mask=bm)
        assert_right(out, q, k, v, score_mod=score, mask_mod=mask)
        out = decode_attention(q[:, :, :1], k, v, score_mod=score)
        assert_right(out, q[:, :, :1], k, v, score_mod=score)

    assert run_in_threads(worker, 8) == []


_PROCESS = textwrap.dedent("""
    import math, sys, torch, flexattn
    from flexattn.reference import attention_reference
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 5, 16, generator=g, dtype=torch.float64) for _ in range(3))
    mod = lambda s, b, h, q_idx, kv_idx: torch.where(kv_idx <= q_idx, s * 1.25, -math.inf)
    out = flexattn.flex_attention(q, k, v, score_mod=mod)
    torch.testing.assert_close(out, attention_reference(q, k, v, score_mod=mod), rtol=1e-9, atol=1e-12)
    print("right")
""")


def test_processes_compile_the_same_mod_into_one_empty_directory(tmp_path):
    """4 processes compile one new mod into an empty cache directory at once, then a fifth
    reads what they left: all right, and the fifth writes nothing."""
    env = {**os.environ, "FLEXATTN_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}

    def start():
        return subprocess.Popen([sys.executable, "-c", _PROCESS], env=env, cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    procs = [start() for _ in range(4)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0 and out.strip().endswith("right"), out
    entries = {p.name: p.read_bytes() for p in tmp_path.glob("*.py")}
    assert entries
    fifth = start()
    out, _ = fifth.communicate(timeout=300)
    assert fifth.returncode == 0 and out.strip().endswith("right"), out
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.py")} == entries
    assert not list(tmp_path.glob(".*.tmp"))
