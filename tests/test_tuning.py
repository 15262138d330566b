"""Autotuning (flexattn.kernels.tuning) on the CPU with a fake clock: the first process times
every candidate (forward and backward) and stores the winner on disk, a second process reuses it
without timing, and the caller's kernel_options or AUTOTUNE=False switch tuning off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import flexattn
from flexattn import call
from flexattn.kernels import plans, tuning
from flexattn.reference import attention_reference
from helpers import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A new kernel cache directory, tuning for every size, no known calls, plans or winners in
    memory."""
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(plans, "TUNE_MIN_WORK", 0)

    def forget():
        tuning.forget()
        call.forget()
        plans.FORWARD.plans.clear()
        plans.BACKWARD.plans.clear()

    forget()
    yield tmp_path
    forget()


@pytest.fixture
def clock(monkeypatch):
    """A fake clock: a candidate's time is set by its query tile, BLOCK_M (forward) or BLOCK_M1
    (backward), the smaller the faster; returns the tile of each candidate timed, in order."""
    timed, current = [], []

    def fake_bench(run, device):
        run()  # the candidate must launch (a broken one is skipped)
        plan = current[-1]
        block_m = plan.kernel.constexprs["BLOCK_M"] if hasattr(plan, "kernel") else plan.dkdv.constexprs["BLOCK_M1"]
        timed.append(block_m)
        return {16: 0.5, 32: 1.0, 64: 2.0}.get(block_m, 3.0)

    real_choose = tuning.choose

    def choose(key, candidates, make, run, device, prefer=0.0):
        def make_and_remember(config):
            current.append(make(config))
            return current[-1]
        return real_choose(key, candidates, make_and_remember, run, device, prefer)

    monkeypatch.setattr(tuning, "bench", fake_bench)
    monkeypatch.setattr(tuning, "choose", choose)
    return timed


def _inputs():
    # 150 query rows: past the decoding kernel's threshold, so the forward kernel (the tuned one) runs.
    torch.manual_seed(0)
    return tuple(torch.randn(1, 2, 150, 32) for _ in range(3))


def _only_plan():
    assert len(plans.FORWARD) == 1
    return next(iter(plans.FORWARD.plans.values()))


def bias(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx) * 0.01


def _second_process(cache_dir, body: str) -> str:
    """Runs ``body`` in a new Python process with this test's cache directory and inputs (q, k, v,
    the bias score mod as ``score``), where timing any candidate fails; returns its stdout (and
    checks that it printed no tuning line)."""
    script = textwrap.dedent("""
        import torch, flexattn
        from flexattn.kernels import plans, tuning
        plans.TUNE_MIN_WORK = 0
        def no_timing(*a, **k):
            raise AssertionError("the second process timed a candidate")
        tuning.bench = no_timing
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, 150, 32) for _ in range(3))
        score = lambda s, b, h, qi, ki: s + (qi - ki) * 0.01
    """) + textwrap.dedent(body)
    env = {**os.environ, "FLEXATTN_CACHE_DIR": str(cache_dir), "PYTHONPATH": ROOT}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "tuning" not in res.stderr
    return res.stdout


def test_tunes_once_and_another_process_reuses_the_winner(fresh, clock, capsys):
    q, k, v = _inputs()
    out = flexattn.flex_attention(q, k, v, score_mod=bias, kernel_options={"AUTOTUNE": True})
    torch.testing.assert_close(out.double(), attention_reference(q, k, v, score_mod=bias), atol=1e-5, rtol=1e-5)
    candidates = tuning.forward_candidates(q.device, q.dtype, 32)
    assert sorted(clock) == sorted(c["BLOCK_M"] for c in candidates)  # each timed once
    assert _only_plan().kernel.constexprs["BLOCK_M"] == 32  # the fake clock's winner
    assert "flexattn: tuned forward|cpu" in capsys.readouterr().err
    stored = json.loads((fresh / tuning._FILE).read_text())
    (key, config), = stored.items()
    assert config["BLOCK_M"] == 32 and "E=32" in key and "score_mod" in key

    # The same call again in this process: a plan lookup, no timing.
    flexattn.flex_attention(q, k, v, score_mod=bias, kernel_options={"AUTOTUNE": True})
    assert len(clock) == len(candidates)

    # A second process: timing anything fails it; it must use the stored winner.
    out = _second_process(fresh, """
        flexattn.flex_attention(q, k, v, score_mod=score, kernel_options={"AUTOTUNE": True})
        (plan,) = plans.FORWARD.plans.values()
        print("BLOCK_M", plan.kernel.constexprs["BLOCK_M"])
    """)
    assert "BLOCK_M 32" in out


def test_close_candidates_are_timed_again_in_the_opposite_order(fresh, monkeypatch):
    """Two forms 1% apart, timed while the GPU's clock drifts by 2% of a call per timing: one
    round ranks them by the drift (the one timed first wins); the close ones timed again in the
    opposite order cancel it. A candidate far behind is not timed again; one that fails its second
    timing is out of the running."""
    true = {"a": 1.00, "b": 0.99, "c": 2.0}
    order, failing = [], set()

    def run(plan):
        order.append(plan["name"])
        if plan["name"] in failing and order.count(plan["name"]) > 1:
            raise RuntimeError("out of resources")

    def fake_bench(fn, device):
        fn()
        return true[order[-1]] + 0.02 * (len(order) - 1)

    monkeypatch.setattr(tuning, "bench", fake_bench)
    cpu = torch.device("cpu")
    plan, config = tuning.choose("test|drift", [{"name": n} for n in "abc"], dict, run, cpu)
    assert order == ["a", "b", "c", "b", "a"]
    assert config == plan == {"name": "b"}
    assert json.loads((fresh / tuning._FILE).read_text())["test|drift"] == {"name": "b"}

    order.clear()
    failing.add("b")
    assert tuning.choose("test|drift again", [{"name": n} for n in "abc"], dict, run, cpu)[1] == {"name": "a"}
    assert order == ["a", "b", "c", "b", "a"]


def test_close_candidates_rank_by_the_longer_of_gpu_and_host_time(fresh, monkeypatch):
    """A short call is as fast as the host issues it: of two forms level on the GPU, the one with
    less host work per call wins; a form more than CLOSE slower on the GPU is not chosen for its
    host time, nor is one whose host work is shorter than its GPU time preferred for it."""
    gpu = {"one pass": 0.196, "dq pass": 0.197, "slow": 0.300, "quick host": 0.198}
    host = {"one pass": 0.288, "dq pass": 0.259, "slow": 0.010, "quick host": 0.020}
    ran = []

    def run(plan):
        ran.append(plan["name"])

    def fake_bench(fn, device):
        fn()
        return gpu[ran[-1]]

    def fake_host_ms(fn, device):
        fn()
        return host[ran[-1]]

    monkeypatch.setattr(tuning, "bench", fake_bench)
    monkeypatch.setattr(tuning, "host_ms", fake_host_ms)
    cpu = torch.device("cpu")
    names = ["one pass", "dq pass", "slow"]
    assert tuning.choose("test|host", [{"name": n} for n in names], dict, run, cpu)[1] == {"name": "dq pass"}
    assert "slow" not in ran[3:]  # (never timed again, nor its host)
    # a candidate whose host keeps ahead of its GPU ranks by its GPU time
    names = ["one pass", "dq pass", "quick host"]
    assert tuning.choose("test|host 2", [{"name": n} for n in names], dict, run, cpu)[1] == {"name": "quick host"}


def test_prefer_keeps_the_first_listed_candidate_within_its_share(fresh, monkeypatch):
    """With ``prefer``, a candidate listed earlier wins against faster ones within that share of
    the best, and loses to one faster by more; without it the fastest wins."""
    gpu = {"dq pass": 1.016, "one pass": 1.000, "triton": 1.5}

    def run(plan):
        ran.append(plan["name"])

    def fake_bench(fn, device):
        fn()
        return gpu[ran[-1]]

    monkeypatch.setattr(tuning, "bench", fake_bench)
    monkeypatch.setattr(tuning, "host_ms", lambda fn, device: 0.0)
    cpu = torch.device("cpu")
    names = [{"name": n} for n in gpu]
    for key, prefer, want in (("a", 0.02, "dq pass"), ("b", 0.0, "one pass"), ("c", 0.01, "one pass")):
        ran = []
        assert tuning.choose(f"test|prefer {key}", names, dict, run, cpu, prefer)[1] == {"name": want}, key
    assert {"DQ_PASS": True} == tuning.hopper_backward_candidates(cpu, torch.bfloat16, 128)[0]
    assert 0 < tuning.HOPPER_BACKWARD_PREFER < tuning.CLOSE


@pytest.mark.parametrize("options", [{"AUTOTUNE": True, "BLOCK_M": 64}, {"AUTOTUNE": True, "num_warps": 4},
                                     {"AUTOTUNE": False}, {}])
def test_explicit_options_or_switch_skip_tuning(fresh, clock, options):
    q, k, v = _inputs()
    flexattn.flex_attention(q, k, v, score_mod=bias, kernel_options=options)
    assert clock == []
    assert not (fresh / tuning._FILE).exists()


def test_environment_switch(fresh, clock, monkeypatch):
    monkeypatch.setenv("FLEXATTN_AUTOTUNE", "0")
    assert not tuning.enabled({}, torch.device("cuda", 0), tuning.FORWARD_KNOBS)
    assert tuning.enabled({"AUTOTUNE": True}, torch.device("cpu"), tuning.FORWARD_KNOBS)
    assert not tuning.enabled({}, torch.device("cpu"), tuning.FORWARD_KNOBS)


def test_a_failing_candidate_is_skipped(fresh, monkeypatch, capsys):
    """A candidate that cannot run (e.g. out of shared memory) is skipped, not fatal."""
    calls = []

    def bench(run, device):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of resource: shared memory")
        run()
        return 1.0

    monkeypatch.setattr(tuning, "bench", bench)
    q, k, v = _inputs()
    out = flexattn.flex_attention(q, k, v, kernel_options={"AUTOTUNE": True})
    torch.testing.assert_close(out.double(), attention_reference(q, k, v), atol=1e-5, rtol=1e-5)
    assert len(calls) == len(tuning.forward_candidates(q.device, q.dtype, 32))
    stored = json.loads((fresh / tuning._FILE).read_text())
    assert [c["BLOCK_M"] for c in stored.values()] == [tuning.forward_candidates(q.device, q.dtype, 32)[1]["BLOCK_M"]]


def test_masks_with_more_mask_work_are_tuned_apart(fresh, clock):
    """Causal and sliding-window masks with the same block sizes differ in the share of blocks that
    need mask work, so each gets its own tuning key (and the same mask again reuses its winner)."""
    q, k, v = _inputs()
    n = len(tuning.forward_candidates(q.device, q.dtype, 32))

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 40)

    masks = [flexattn.create_block_mask(m, None, None, 150, 150, BLOCK_SIZE=64) for m in (causal, window)]
    for i, bm in enumerate(masks + masks[:1]):
        flexattn.flex_attention(q, k, v, block_mask=bm, kernel_options={"AUTOTUNE": True})
        assert len(clock) == n * min(i + 1, 2)
    keys = list(json.loads((fresh / tuning._FILE).read_text()))
    shares = sorted(float(k_.split("|")[-2].removeprefix("partial ")) for k_ in keys)
    assert len(keys) == 2 and shares[0] < shares[1] <= 1.0, keys


def test_masks_that_visit_fewer_blocks_are_tuned_apart(fresh, clock):
    """Masks whose visited blocks all skip mask work (no partial share to tell them apart) but that
    visit a different share of the blocks (their programs run longer or shorter) get keys of
    their own: here every block, and two documents that start on block edges (half of them)."""
    q, k, v = (t[:, :, :128] for t in _inputs())  # (whole blocks: none is partial for its length)
    n = len(tuning.forward_candidates(q.device, q.dtype, 32))
    docs = torch.arange(128) // 64

    def everything(b, h, q_idx, kv_idx):
        return q_idx >= 0

    def documents(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    masks = [flexattn.create_block_mask(m, None, None, 128, 128, BLOCK_SIZE=64) for m in (everything, documents)]
    for i, bm in enumerate(masks + masks[1:]):  # (128 rows would take the decoding kernel unforced)
        flexattn.flex_attention(q, k, v, block_mask=bm, kernel_options={"AUTOTUNE": True,
                                                                        "FORCE_USE_FLEX_ATTENTION": True})
        assert len(clock) == n * min(i + 1, 2)
    keys = list(json.loads((fresh / tuning._FILE).read_text()))
    features = sorted(tuple(k_.split("|")[-3:-1]) for k_ in keys)
    assert features == [("visits 1/1", "partial 0.0"), ("visits 1/2", "partial 0.0")], keys


def test_grids_of_other_sizes_are_tuned_apart(fresh, clock):
    """A winner timed on a few programs is not the winner of many: calls whose batch x heads fall
    in another power-of-two bucket are tuned again; one in a bucket already tuned reuses it."""
    n = len(tuning.forward_candidates(torch.device("cpu"), torch.float32, 32))
    torch.manual_seed(0)
    timed = []
    for B, H in ((1, 2), (2, 2), (1, 2), (1, 3), (4, 2)):  # B x H buckets 2, 4, 2, 4, 8
        q, k, v = (torch.randn(B, H, 150, 32) for _ in range(3))
        out = flexattn.flex_attention(q, k, v, score_mod=bias, kernel_options={"AUTOTUNE": True})
        torch.testing.assert_close(out.double(), attention_reference(q, k, v, score_mod=bias), atol=1e-5, rtol=1e-5)
        timed.append(len(clock))
    assert timed == [n, 2 * n, 2 * n, 2 * n, 3 * n]
    keys = sorted(json.loads((fresh / tuning._FILE).read_text()))
    assert [k_.split("|")[8] for k_ in keys] == ["BH<=2", "BH<=4", "BH<=8"], keys


def test_inputs_of_another_dtype_head_dim_group_or_mod_are_tuned_apart(fresh, clock):
    """Each feature of the tuning key tells problems apart: the dtype, the head dims, the GQA
    group and whether there is a score mod each make a key of their own (a winner of float32 is
    not taken for float16); the first problem again reuses its winner."""
    g = torch.Generator().manual_seed(0)

    def inputs(dtype=torch.float32, E=32, Ev=32, Hkv=2):
        return (torch.randn(1, 2, 150, E, generator=g, dtype=dtype), torch.randn(1, Hkv, 150, E, generator=g, dtype=dtype),
                torch.randn(1, Hkv, 150, Ev, generator=g, dtype=dtype))

    cases = [(inputs(), bias), (inputs(torch.float16), bias), (inputs(E=16, Ev=16), bias), (inputs(Ev=16), bias),
             (inputs(Hkv=1), bias), (inputs(), None), (inputs(), bias)]
    timed = []
    for (q, k, v), mod in cases:
        out = flexattn.flex_attention(q, k, v, score_mod=mod, enable_gqa=True, kernel_options={"AUTOTUNE": True})
        want = attention_reference(q, k, v, score_mod=mod, enable_gqa=True)
        tol = 2e-3 if q.dtype == torch.float16 else 1e-5
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
        timed.append(len(clock))
    grew = [b > a for a, b in zip([0, *timed], timed)]
    assert grew == [True] * 6 + [False], timed
    keys = json.loads((fresh / tuning._FILE).read_text())
    assert len(keys) == 6, list(keys)


def test_the_backward_is_tuned_once_and_another_process_reuses_the_winner(fresh, clock, capsys):
    q, k, v = (t.requires_grad_() for t in _inputs())
    do = torch.randn_like(q)
    out = flexattn.flex_attention(q, k, v, score_mod=bias, kernel_options={"AUTOTUNE": True})
    grads = torch.autograd.grad(out, (q, k, v), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(attention_reference(*leaves, score_mod=bias), leaves, do.double())
    for got, exp in zip(grads, want):
        torch.testing.assert_close(got.double(), exp, atol=1e-4, rtol=1e-4)
    n_fwd = len(tuning.forward_candidates(q.device, q.dtype, 32))
    candidates = tuning.backward_candidates(q.device, q.dtype, 32)
    assert len(candidates) > 1
    assert sorted(clock[n_fwd:]) == sorted(c["BLOCK_M1"] for c in candidates)  # each timed once
    (plan,) = plans.BACKWARD.plans.values()
    assert plan.dkdv.constexprs["BLOCK_M1"] == 16  # the fake clock's winner, not the default (32)
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "flexattn: tuned backward|cpu" in ln]
    # The message names the loser's first time, so a log shows why the winner won.
    assert "'BLOCK_M1': 32" in line.split("first timings of the others")[1], line
    stored = json.loads((fresh / tuning._FILE).read_text())
    (config,) = [c for key, c in stored.items() if key.startswith("backward|")]
    assert config["BLOCK_M1"] == 16

    # Again in this process: a plan lookup, no timing.
    out = flexattn.flex_attention(q, k, v, score_mod=bias, kernel_options={"AUTOTUNE": True})
    torch.autograd.grad(out, (q, k, v), do)
    assert len(clock) == n_fwd + len(candidates)

    # A second process: timing anything fails it; it must use the stored winner.
    out = _second_process(fresh, """
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = flexattn.flex_attention(q, k, v, score_mod=score, kernel_options={"AUTOTUNE": True})
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        (plan,) = plans.BACKWARD.plans.values()
        print("BLOCK_M1", plan.dkdv.constexprs["BLOCK_M1"])
    """)
    assert "BLOCK_M1 16" in out


@pytest.mark.parametrize("options", [{"AUTOTUNE": True, "BLOCK_M1": 32}, {"AUTOTUNE": True, "bwd_num_stages": 1},
                                     {"AUTOTUNE": False}])
def test_explicit_backward_options_or_switch_skip_backward_tuning(fresh, clock, options):
    q, k, v = (t.requires_grad_() for t in _inputs())
    out = flexattn.flex_attention(q, k, v, kernel_options=options)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    # Only the forward may have been tuned (when the options name no forward knob).
    assert len(clock) == (len(tuning.forward_candidates(q.device, q.dtype, 32)) if options.get("AUTOTUNE") else 0)
    stored = json.loads((fresh / tuning._FILE).read_text()) if (fresh / tuning._FILE).exists() else {}
    assert not [key for key in stored if key.startswith("backward|")]


def test_the_hopper_backward_times_its_two_forms_under_a_block_mask(monkeypatch):
    """Where the Gluon Hopper backward runs under a block mask the tuner times the one pass and the
    dQ pass (default tiles and 64x32 ones) and keeps the winner; without a block mask the one pass
    runs untimed. (The Gluon kernels need an sm_90 GPU: here the plans are built, not launched.)"""
    from flexattn import tracer
    from flexattn.block_mask import create_block_mask
    from flexattn.kernels import backward as bwd, hopper
    from flexattn.kernels.tables import tables_of
    from flexattn.mods import MASK, SCORE

    monkeypatch.setattr(hopper, "_machine_reason", lambda query, options: None)
    seen = {}

    def choose(key, candidates, make, run, device, prefer):
        seen["key"], seen["plans"], seen["prefer"] = key, [make(c) for c in candidates], prefer
        return seen["plans"][-1], candidates[-1]

    monkeypatch.setattr(tuning, "choose", choose)
    cpu = torch.device("cpu")
    score = tracer.trace(lambda s, b, h, q_idx, kv_idx: s, SCORE, score_dtype=torch.float32, device=cpu)
    causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx  # noqa: E731
    mask = tracer.trace(causal, MASK, score_dtype=torch.float32, device=cpu)
    S = 4096  # (B x H x S x S reaches plans.TUNE_MIN_WORK)
    q = torch.empty(1, 8, S, 128, dtype=torch.bfloat16)
    tables = tables_of(create_block_mask(causal, None, None, S, S, device="cpu"))

    def plan(tables):
        return plans._make_backward_plan(q, q, q, q, q, score, mask, tables, {"AUTOTUNE": True}, (), (), False,
                                         launch_once=None)

    chosen = plan(tables)
    assert seen["key"].startswith("backward hopper|")
    split, one_pass, small = seen["plans"]  # (the dQ pass first: it wins ties, HOPPER_BACKWARD_PREFER)
    assert seen["prefer"] == tuning.HOPPER_BACKWARD_PREFER
    # (its own key: a winner stored by the plain ranking, often the one pass, is not reused)
    assert seen["key"].endswith(f"|prefer {tuning.HOPPER_BACKWARD_PREFER:g}"), seen["key"]
    assert one_pass.dq_pass is None and one_pass.main.constexprs["COMPUTE_DQ"]
    assert isinstance(split.dq_pass, bwd.HopperDqPlan) and not split.main.constexprs["COMPUTE_DQ"]
    assert (small.dq_pass.dq.constexprs["BLOCK_M2"], small.dq_pass.dq.constexprs["BLOCK_N2"]) == (64, 32)
    assert chosen is small
    seen.clear()
    assert plan(None).dq_pass is None and not seen


def test_untuned_forward_takes_the_tuners_winners_at_head_dim_64(monkeypatch):
    """Where nothing is timed (deterministic mode, AUTOTUNE off) on a call long enough to tune, the
    forward at head dim 64 takes the H100 tuner's winners: the Hopper kernel without a block mask,
    4 warps under masks that visit about an eighth of the blocks or fewer, the defaults under
    denser masks, at other head dims, on short calls, and wherever the caller chose a tile or
    backend. (The Hopper kernel needs an sm_90 GPU: here the plans are built, not launched.)"""
    from flexattn import tracer
    from flexattn.block_mask import create_block_mask
    from flexattn.kernels import forward as fwd, hopper
    from flexattn.kernels.tables import tables_of
    from flexattn.mods import MASK, SCORE

    monkeypatch.setattr(hopper, "_machine_reason", lambda query, options: None)
    S = 4096  # (B x H x S x S reaches plans.TUNE_MIN_WORK)
    q64, q128 = (torch.empty(1, 8, S, D, dtype=torch.bfloat16) for D in (64, 128))
    window = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 512)  # noqa: E731
    causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx  # noqa: E731
    sparse, dense = (tables_of(create_block_mask(m, None, None, S, S, device="cpu")) for m in (window, causal))
    assert plans._untuned_forward(q64, q64, None, {}, True) == {"BACKEND": "FLASH"}
    assert plans._untuned_forward(q64, q64, sparse, {}, True) == {"num_warps": 4}
    assert plans._untuned_forward(q64, q64, dense, {}, True) == {}
    assert plans._untuned_forward(q128, q128, None, {}, True) == {}
    assert plans._untuned_forward(q64, q64, None, {}, False) == {}  # (the Hopper kernel cannot run the call)
    assert plans._untuned_forward(q64.float(), q64.float(), sparse, {}, True) == {}
    short = torch.empty(1, 8, 256, 64, dtype=torch.bfloat16)
    assert plans._untuned_forward(short, short, None, {}, True) == {}
    for chosen in ({"num_warps": 8}, {"BLOCK_M": 64}, {"BACKEND": "TRITON"}):
        assert plans._untuned_forward(q64, q64, sparse, chosen, True) == {}

    cpu = torch.device("cpu")
    score = tracer.trace(lambda s, b, h, q_idx, kv_idx: s, SCORE, score_dtype=torch.float32, device=cpu)
    mask = tracer.trace(window, MASK, score_dtype=torch.float32, device=cpu)

    hopper_plans = testing.record_calls(monkeypatch, fwd, "hopper_plan")
    template_plans = testing.record_calls(monkeypatch, fwd, "make_plan")

    def plan(tables, options):
        return plans._make_forward_plan(q64, q64, q64, score, (), mask, (), tables, False, options, False, None)

    for options in ({"DETERMINISTIC": True}, {"AUTOTUNE": False}):
        hopper_plans.clear()
        template_plans.clear()
        plan(None, options)
        assert len(hopper_plans) == 1 and not template_plans
        plan(sparse, options)
        assert len(hopper_plans) == 1 and template_plans[0][6]["num_warps"] == 4  # (the options it was given)


@pytest.mark.parametrize("stored", [
    {"BLOCK_M": 32, "ROWS_GUARANTEED_SAFE": True},  # a candidate plus an option that changes results
    {"BLOCK_M": 8},                                 # no candidate (a tile the GPU does not compile)
    {"BLOCK_M": "32"},
    [32],
])
def test_a_stored_winner_that_is_no_candidate_is_tuned_again(fresh, monkeypatch, stored):
    """tuning-v2.json is data anyone with the cache directory can edit: a winner read from it is
    used only where it equals a candidate, and then as that candidate (nothing else from the file
    reaches the kernels' options)."""
    candidates = [{"BLOCK_M": 32}, {"BLOCK_M": 64}]
    (fresh / tuning._FILE).write_text(json.dumps({"test|stored": stored, "test|good": {"BLOCK_M": 64}}))
    made = []

    def make(config):
        made.append(config)
        return dict(config)

    monkeypatch.setattr(tuning, "bench", lambda fn, device: (fn(), made[-1]["BLOCK_M"] / 32)[1])
    cpu = torch.device("cpu")
    plan, config = tuning.choose("test|stored", candidates, make, lambda plan: None, cpu)
    assert plan == config == {"BLOCK_M": 32} and made == candidates  # timed, not taken from the file
    made.clear()
    plan, config = tuning.choose("test|good", candidates, make, lambda plan: None, cpu)
    assert config is candidates[1] and made == [candidates[1]]  # a stored candidate: nothing timed


def test_the_winners_file_is_written_through_a_fresh_file(fresh):
    """A file already at a temporary name the writer could guess (a link to another file, in a
    shared cache directory) is never written through."""
    victim = fresh / "victim.txt"
    victim.write_text("keep me")
    for pid in range(os.getpid() - 2, os.getpid() + 3):
        (fresh / f"tuning-v2.{pid}.tmp").symlink_to(victim)
    tuning._store("test|link", {"BLOCK_M": 32})
    assert victim.read_text() == "keep me"
    assert json.loads((fresh / tuning._FILE).read_text()) == {"test|link": {"BLOCK_M": 32}}
    assert not list(fresh.glob(".tuning_*"))


@pytest.mark.parametrize("damage", ["nested", "directory", "not_objects"])
def test_a_damaged_winners_file_means_no_winners(fresh, damage):
    """Whatever is at tuning-v2.json (JSON nested past the parser's recursion limit, no regular file,
    other JSON), the tuner reads no winner from it, and stores its own where it can."""
    path = fresh / tuning._FILE
    if damage == "nested":
        path.write_text("[" * 100_000)
    elif damage == "directory":
        path.mkdir()
    else:
        path.write_text(json.dumps({"test|x": [1], "test|y": 3}))
    assert tuning._stored() == {}
    tuning._store("test|z", {"BLOCK_M": 32})
    assert damage == "directory" or json.loads(path.read_text()) == {"test|z": {"BLOCK_M": 32}}
