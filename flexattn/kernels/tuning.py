"""Autotuning: a few tile configs per kernel family, timed, the winner kept on disk.

A plan (`flexattn.kernels.plans`) is made once per plan key. When tuning is on, making a forward or
backward plan times a small candidate set (`forward_candidates`, `backward_candidates`: tiles,
warps and pipelining stages for the GPU, dtype and head dims, and for float8 at head dim 128 the
Gluon Hopper kernel beside them, see `hopper.timed_against_triton`; `hopper_backward_candidates`:
under a block mask, the Gluon Hopper backward with dQ added by its one pass or left to the Gluon
or the Triton dQ pass) on the call's own inputs and keeps the fastest. Winners are keyed by *tuning key*:
GPU name, Triton version, dtype, head dims, the query and KV lengths and the number of (batch,
query head) pairs, each rounded up to a power of two (lengths and B x H set the grid, and a winner
timed on a grid of a few waves is not the winner of many: python -m benchmarks attention), and the
mod features that change the kernel's cost (score mod or not, block mask or not, its block sizes,
the share of all blocks it visits and the share of those that need mask work, max-score output,
GQA group size; for the backward also whether captured tensors get gradients and whether the LSE
has one). They are stored in ``<cache dir>/tuning-v2.json`` (v1's keys had no B x H), so another
process with the same key reuses the winner without timing anything.

Tuning is on by default on CUDA and off on the CPU (Triton's interpreter). It is skipped when
``kernel_options`` sets any of the tuned knobs (the caller's choice wins), when
``kernel_options={"AUTOTUNE": False}`` or ``FLEXATTN_AUTOTUNE=0``, in deterministic mode
(``DETERMINISTIC``), and while a CUDA graph is being captured (defaults then, nothing stored). While it runs, one line on stderr says what is tuned
and how far it is.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Hashable, Iterable

import torch
import triton
from triton.testing import do_bench

from flexattn.codegen.cache import cache_dir

FORWARD_KNOBS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
BACKWARD_KNOBS = ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "bwd_num_warps", "bwd_num_stages")
HOPPER_BACKWARD_KNOBS = ("DQ_PASS",)
_FILE = "tuning-v2.json"
_LOCK = threading.Lock()
_WINNERS: dict[str, dict[str, Any]] | None = None  # the disk file's content, read once per process


def enabled(options: dict, device: torch.device, knobs: Iterable[str]) -> bool:
    """Whether to tune: the caller did not pick any of ``knobs`` nor switch tuning off, and did
    not ask for deterministic results (a timed choice may differ between processes, and with it
    the order of every sum: the defaults then, like torch's ``cudnn.benchmark = False``)."""
    if any(k in options for k in knobs) or options.get("DETERMINISTIC", False):
        return False
    wanted = options.get("AUTOTUNE")
    if wanted is None:
        wanted = device.type == "cuda" and os.environ.get("FLEXATTN_AUTOTUNE", "1") != "0"
    if not wanted:
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def forward_candidates(device: torch.device, dtype: torch.dtype, head_dim: int) -> list[dict[str, int]]:
    """The forward configs worth timing (the default comes first, see options.forward_defaults)."""
    if device.type != "cuda":
        return [dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1),
                dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)]
    if dtype == torch.float8_e4m3fn:
        # The three best of 20 configs at D=128 S=8k on the H100 (V K-major): within 1% of each
        # other without a mask, within 5% causal (python -m benchmarks fp8); other
        # head dims keep the default, not measured in float8.
        if 64 < head_dim <= 128:
            return [dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3),
                    dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
                    dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=4)]
        return []
    if dtype in (torch.float32, torch.float64):
        return []  # one default per dtype (see options.forward_defaults)
    if head_dim <= 64:
        return [dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
                dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
                dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
                dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=3),
                dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4)]
    if head_dim <= 128:
        return [dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
                dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
                dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
                dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)]
    return [dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
            dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
            dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
            dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=2)]


def backward_candidates(device: torch.device, dtype: torch.dtype, head_dim: int) -> list[dict[str, int]]:
    """The backward configs worth timing (the default first, see options.backward_defaults):
    (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, warps, stages), the ones within a few percent of the
    best for some mask on the H100 (python -m benchmarks attention). At D=128, (32, 64, 64, 32,
    4, 4) is 5-6% faster than the default on 16 documents at S=2k, 6% slower causal and 18%
    slower without a mask; at D=64 (32, 128, 128, 32) is level with the default. At D=256 every
    other config is 28% slower or does not fit: no tuning."""
    def config(*values):
        return dict(zip(BACKWARD_KNOBS, values))

    if device.type != "cuda":
        return [config(32, 32, 32, 32, 4, 1), config(16, 32, 32, 16, 4, 1)]
    if dtype not in (torch.float16, torch.bfloat16) or head_dim > 128:
        return []
    if head_dim <= 64:
        return [config(64, 64, 64, 64, 4, 3), config(32, 128, 128, 32, 8, 3), config(32, 128, 128, 32, 4, 3),
                config(64, 128, 128, 64, 8, 4)]
    return [config(64, 128, 128, 64, 8, 3), config(64, 128, 128, 64, 8, 4), config(32, 64, 64, 32, 4, 4),
            config(32, 128, 128, 32, 8, 3)]


def tuning_key(family: str, device: torch.device, *features: Hashable) -> str:
    """The disk key of one tuning problem: family, GPU, Triton version and the given features."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return "|".join([family, gpu, f"triton {triton.__version__}", *map(str, features)])


def length_bucket(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def bench(run: Callable[[], Any], device: torch.device) -> float:
    """Milliseconds per call of ``run``: on the GPU the median of Triton's timed calls (each after
    an L2 flush; the median, as Triton's own autotuner reads them, so that a few slow calls do not
    decide); on the CPU the wall clock of one call."""
    if device.type == "cuda":
        return do_bench(run, warmup=25, rep=100, return_mode="median")
    run()
    t = time.perf_counter()
    run()
    return (time.perf_counter() - t) * 1e3


def host_ms(run: Callable[[], Any], device: torch.device) -> float:
    """Milliseconds of host work per call of ``run`` issued back to back (the median of three
    loops of ten calls, the GPU left to queue them): a call in a loop takes the longer of this and
    its GPU time. 0 on the CPU, where `bench` times the whole call."""
    if device.type != "cuda":
        return 0.0
    loops = []
    for _ in range(3):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(10):
            run()
        loops.append((time.perf_counter() - t) * 1e2)
    torch.cuda.synchronize(device)
    return sorted(loops)[1]


def hopper_backward_candidates(device: torch.device, dtype: torch.dtype, head_dim: int) -> list[dict[str, Any]]:
    """The Gluon Hopper backward's forms under a block mask (kernels/backward.py): dQ by the Gluon
    dQ pass (DQ_PASS alone; first, so that it wins ties: `HOPPER_BACKWARD_PREFER`), dQ added by
    the one pass (the untuned default), and dQ by the Triton dQ pass with 64x32 tiles (a backward
    tile option selects it). On the H100 (B=4 H=16 D=128 bfloat16, python -m benchmarks
    attention) the Gluon dQ pass won on 16 documents at S=2k, 8k and 16k, sliding window 1024 and
    ALiBi + causal, the one pass on causal and at head dim 64 on 16 documents."""
    return [{"DQ_PASS": True}, {"DQ_PASS": False},
            {"DQ_PASS": True, "BLOCK_M2": 64, "BLOCK_N2": 32, "bwd_num_warps": 4, "bwd_num_stages": 4}]


# The Gluon dQ pass (listed first) wins against the one pass unless the one pass is more than this
# share faster. The dQ pass holds no float32 dQ accumulator (B x H x S x D x 4 bytes, zeroed and
# converted per call) and makes no atomics. On sliding window 1024 (H200, B=4 H=16 S=8k D=128) the
# two tie in the tuner's timing, GPU busy without pause (1.79-1.85 against 1.81-1.82 ms), while
# calls after an idle moment, as a benchmark's interleaved rounds issue them, take 1.66-1.76 ms
# by the dQ pass against 1.80 by the one pass.
HOPPER_BACKWARD_PREFER = 0.02


# Candidates timed within this share of the fastest are timed again, in the opposite order.
CLOSE = 0.05


def choose(key: str, candidates: list[dict[str, Any]], make: Callable[[dict], Any], run: Callable[[Any], Any],
           device: torch.device, prefer: float = 0.0) -> tuple[Any, dict[str, Any] | None]:
    """``(plan, config)``: the plan of the stored winner for ``key``, or else of the fastest of
    ``candidates`` (``make(config)`` builds a plan, ``run(plan)`` launches it once), stored.
    Candidates that fail to build or run (too much shared memory, a tile the block mask does not
    allow) are skipped; if all fail, ``(None, None)``.

    Candidates within `CLOSE` of the fastest are timed a second time, in the opposite order, and
    ranked by the mean of their two times: two forms a few percent apart are otherwise ranked by
    the noise of one timing, and by where in the sequence the GPU's clocks drifted. Where a close
    candidate's host work per call (`host_ms`) is longer than that mean, it ranks by its host time
    instead: a short call is as fast as the host issues it (H200, B=4 H=16 S=2k D=128, 16
    documents: the backward's one pass and its dQ pass both 0.196 ms of GPU time, 0.288 and 0.259
    ms per call of the benchmark's loop: the one pass makes one launch more, dQ's conversion from
    its float32 accumulator). A candidate more than `CLOSE` slower on the GPU is never chosen for its
    host time: where the host runs ahead (a model's other layers), the GPU time is the cost.

    ``prefer``: of the candidates that rank within this share of the best, the first in
    ``candidates``' order wins (a family lists first the form that costs least besides time)."""
    # Only a stored winner that is one of ``candidates`` counts, and the candidate is what is used: the
    # file is data anyone with the cache directory can edit, and its other keys would reach the
    # kernels' options unchecked (ROWS_GUARANTEED_SAFE, a tile no GPU compiles).
    stored = _stored().get(key)
    winner = next((c for c in candidates if c == stored), None)
    if winner is not None:
        try:
            return make(winner), winner
        except Exception:  # noqa: BLE001 - a stale entry (other kernel version): tune again
            pass
    timed = []  # [ms, plan, config] of the candidates that ran within CLOSE of the fastest so far
    seen = []  # [ms, config] of every candidate that ran, for the message
    start = time.perf_counter()
    tty = sys.stderr.isatty()
    for i, config in enumerate(candidates):
        if tty:
            print(f"\rflexattn: tuning {key} [{i + 1}/{len(candidates)}]", end="", file=sys.stderr, flush=True)
        try:
            plan = make(config)
            timed.append([bench(lambda: run(plan), device), plan, config])
            seen.append(timed[-1][::2])
        except Exception:  # noqa: BLE001 - e.g. triton.runtime.errors.OutOfResources
            continue
        fastest = min(t[0] for t in timed)
        timed = [t for t in timed if t[0] <= fastest * (1 + CLOSE)]  # (the others' plans go)
    if len(timed) > 1:  # (all close to the fastest: timed again, in the opposite order)
        for t in reversed(timed):
            try:
                t[0] = (t[0] + bench(lambda plan=t[1]: run(plan), device)) / 2
                # a call issued back to back takes the longer of its GPU and host times
                t[0] = max(t[0], host_ms(lambda plan=t[1]: run(plan), device))
            except Exception:  # noqa: BLE001 - (ran once already; out of the running if not again)
                t[0] = float("inf")
    ran = [t for t in timed if t[0] != float("inf")]
    best = min((t[0] for t in ran), default=float("inf"))
    ran = [t for t in ran if t[0] <= best * (1 + prefer)]
    ms, plan, config = min(ran, key=lambda t: candidates.index(t[2])) if ran else (best, None, None)
    took = time.perf_counter() - start
    if config is None:
        print(f"\rflexattn: tuning {key}: no candidate ran ({took:.1f} s)", file=sys.stderr)
        return None, None
    others = "; ".join(f"{c} {t:.3f}" for t, c in seen if c is not config)
    print(f"\rflexattn: tuned {key} in {took:.1f} s: {config} ({ms:.3f} ms)"
          + (f" [first timings of the others, ms: {others}]" if others else ""), file=sys.stderr)
    _store(key, config)
    return plan, config


# ---------------------------------------------------------------------------------------------
# The disk file


def _path():
    return cache_dir() / _FILE


# Far more than any real file (a winner is about 100 bytes); a larger one is not read.
MAX_FILE_BYTES = 64 << 20


def _read_winners(path) -> dict[str, dict[str, Any]]:
    """The winners in the file at ``path``; {} where there is none or it is not a JSON object of
    objects (damaged, edited, a pipe or a device, nested past the parser's recursion limit)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE_BYTES:
            return {}
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


def _stored() -> dict[str, dict[str, Any]]:
    global _WINNERS
    if _WINNERS is None:
        with _LOCK:
            if _WINNERS is None:
                _WINNERS = _read_winners(_path())
    return _WINNERS


def _store(key: str, config: dict[str, Any]) -> None:
    """Add a winner to the file (merged with what other processes wrote meanwhile; atomic)."""
    winners = _stored()
    with _LOCK:
        winners[key] = dict(config)
        path = _path()
        winners.update({k: v for k, v in _read_winners(path).items() if k not in winners})
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # A new file of a fresh name (never one found there, which could be a link to anything).
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tuning_", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps(winners, indent=1, sort_keys=True))
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError:
            pass  # a read-only cache: the winner still holds for this process


def forget() -> None:
    """Drop the in-memory copy of the disk file (tests: act as a new process)."""
    global _WINNERS
    with _LOCK:
        _WINNERS = None
