"""The Gluon Hopper forward and backward without a GPU: their modules compile for sm_90 with every
kind of mod, the "gluon" spelling of generated mods, and when a call takes either kernel.

The kernels themselves run only on an H100/H200 (`tests/test_forward_hopper_gpu.py`,
`tests/test_backward_hopper_gpu.py`, ``-m gpu``);
Triton's interpreter cannot run Gluon. Compiling here checks the template against this Triton's
Gluon API (ptxas included) on every CI run.
"""

from __future__ import annotations

import pytest
import torch

from flexattn import tracer
from flexattn.block_mask import create_block_mask
from flexattn.codegen import emit
from flexattn.kernels import arguments, backward as bwd, forward as fwd, hopper, launch, layout, options as opts
from flexattn.kernels.tables import ordered_q_lists, q_direction, regrouped, tables_of
from flexattn.mods import MASK, SCORE

gluon = pytest.importorskip("triton.experimental.gluon")


def _mod(fn, kind):
    return tracer.trace(fn, kind, score_dtype=torch.float32, device=torch.device("cpu"))


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def softcap(score, b, h, q_idx, kv_idx):
    return 30 * torch.tanh(score / 30)


def alibi_with(slopes: torch.Tensor):
    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return alibi


def causal_documents(doc: torch.Tensor):
    def documents(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    return documents


def _compile_gluon(kernel, args: list, launch_: launch.Launch):
    """Compile a Gluon kernel for sm_90 with the argument types of ``args`` (the plan's launch
    arguments, with the descriptors its launch makes of them, unused pointers standing in as empty
    tensors) and the launch's constexprs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    args = [torch.empty(1) if a is arguments.UNUSED else a for a in launch_.describe(tuple(args))]
    constexprs = {n: c for n, c in launch_.constexprs.items() if n not in ("num_warps", "maxnreg", "enable_fp_fusion")}
    names = kernel.arg_names
    assert len(names) == len(args) + len(constexprs), "the launch's arguments do not match the kernel's parameters"
    signature = {n: mangle_type(a) for n, a in zip(names, args)}
    signature.update({n: "constexpr" for n in constexprs})
    compiled = triton.compile(GluonASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": hopper.NUM_WARPS, "maxnreg": launch_.constexprs["maxnreg"],
                                       "enable_fp_fusion": launch_.constexprs["enable_fp_fusion"]})
    assert compiled.metadata.shared <= 227 * 1024
    return compiled


def _compile(query, key, value, score_fn=None, mask_fn=None, block_mask=None, want_max=False, fast_math=True,
             sinks=None):
    """Compile the Hopper plan's kernel for sm_90 with the argument types a launch would pass."""
    score = _mod(score_fn or (lambda s, b, h, q, k: s), SCORE)
    mask = _mod(mask_fn or (lambda b, h, q, k: q >= 0), MASK)
    tables = None if block_mask is None else tables_of(block_mask)
    plan = fwd.hopper_plan(query, key, value, score, mask, tables, {}, want_max, sinks is not None)
    out = torch.empty(plan.out_shape, dtype=plan.out_dtype)
    lse = torch.empty(plan.stat_shape)
    mx = torch.empty(plan.stat_shape) if want_max else None
    args = fwd.launch_args(plan, query, key, value, out, lse, mx, score, score.buffers, mask, mask.buffers, tables,
                           0.125, sinks=sinks)
    # (on the CPU the plan's module has no fast tanh: CUDA inputs would get it unless FAST_TANH=False)
    return _compile_gluon(fwd.hopper_module(score, mask, fast_math).flex_attention_forward, list(args), plan.kernel)


def _qkv(B=1, H=2, Hkv=2, S=300, D=128, dtype=torch.bfloat16, Bkv=None):
    q = torch.randn(B, H, S, D, dtype=dtype)
    k = torch.randn(Bkv or B, Hkv, S, D, dtype=dtype)
    v = torch.randn(Bkv or B, Hkv, S, D, dtype=dtype)
    return q, k, v


# a TMA store: a bulk tensor copy from shared memory to global memory
TMA_STORE = "cp.async.bulk.tensor.4d.global.shared::cta"


def test_compiles_without_mods():
    ptx = _compile(*_qkv()).asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx  # tensor cores fed by TMA


@pytest.mark.parametrize("D", [128, 256])
def test_16_bit_output_leaves_through_tma(D):
    """16-bit inputs: each consumer stages its output rows in its half of the Q tile and the TMA
    unit stores them (one store per consumer; the store's reads of shared memory are waited for);
    float8 output (bfloat16, twice the Q tile's bytes) is stored from the registers."""
    q, k, v = _qkv(S=300, D=D)
    ptx = _compile(q, k, v).asm["ptx"]
    assert ptx.count(TMA_STORE) == 2 and "cp.async.bulk.wait_group.read" in ptx
    assert hopper.Descriptors(torch.bfloat16, D).with_out and hopper.Descriptors(torch.float16, D).with_out
    assert not hopper.Descriptors(torch.float8_e4m3fn, D).with_out
    assert hopper.Descriptors(torch.bfloat16, D, backward=True).with_out
    assert not hopper.Descriptors(torch.bfloat16, D, backward=True, outputs=False).with_out
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    assert TMA_STORE not in _compile(q8, k8, layout.k_major(v8)).asm["ptx"]


def test_compiles_head_dim_64_with_three_consumers():
    """Head dim 64: 192-row query tiles, a consumer warp group per 64 rows (two of them workers
    with 160 registers a thread, none spilled), the Q tile's TMA boxes and the output's 64 rows
    (a box's sides are powers of two); a score_mod and the row max."""
    q, k, v = _qkv(B=2, H=4, Hkv=2, S=500, D=64)
    ptx = _compile(q, k, v, score_fn=softcap, want_max=True).asm["ptx"]
    assert ptx.count("setmaxnreg.inc.sync.aligned.u32 \t160") == 2 and "ld.local" not in ptx
    assert TMA_STORE in ptx and "wgmma.mma_async.sync.aligned.m64n128k16" in ptx
    assert hopper.Descriptors(torch.bfloat16, 64).blocks[0] == [1, 1, 64, 64]
    assert hopper.Descriptors(torch.bfloat16, 128).blocks[0] == [1, 1, 128, 128]


def test_compiles_with_block_mask_and_max_scores():
    q, k, v = _qkv(B=2, H=4, Hkv=2, S=384, D=128, dtype=torch.float16, Bkv=1)
    bm = create_block_mask(causal, None, None, 384, 384, device="cpu")
    _compile(q, k, v, mask_fn=causal, block_mask=bm, want_max=True)


def test_compiles_head_dim_256():
    """64-column KV tiles: two buffers of K and V and the Q tile fit in shared memory."""
    q, k, v = _qkv(S=320, D=256)
    bm = create_block_mask(causal, None, None, 320, 320, device="cpu")
    assert _compile(q, k, v, mask_fn=causal, block_mask=bm).metadata.shared > 192 * 1024


@pytest.mark.parametrize("D", [128, 256])
def test_compiles_float8(D):
    """float8 Q K^T and P V on e4m3 wgmma, V read KV-innermost through its transposed view; a
    length that is not a multiple of 16 (layout.k_major pads V's rows for TMA)."""
    q, k, v = (t.to(torch.float8_e4m3fn) for t in _qkv(S=301, D=D))
    bm = create_block_mask(causal, None, None, 301, 301, device="cpu")
    ptx = _compile(q, k, layout.k_major(v), mask_fn=causal, block_mask=bm).asm["ptx"]
    assert ".f32.e4m3.e4m3" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx


def test_compiles_with_captured_tensors():
    slopes = torch.exp2(-torch.arange(1, 3, dtype=torch.float32))
    doc = torch.arange(300, dtype=torch.int32) // 70

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def documents(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    _compile(*_qkv(), score_fn=alibi, mask_fn=documents)


@pytest.mark.parametrize("score_fn", [None, softcap, alibi_with(torch.ones(2))], ids=["raw", "softcap", "affine"])
def test_compiles_with_sinks(score_fn):
    """Attention sinks in the epilogue, in each of the softmax's units: raw scores in base 2, a
    score_mod's, an affine score_mod's (the rows' own term taken off the sink); bfloat16 sinks."""
    q, k, v = _qkv(S=300)
    _compile(q, k, v, score_fn=score_fn, mask_fn=causal, want_max=True, sinks=torch.randn(2, dtype=torch.bfloat16))


@pytest.mark.parametrize("fast_math", [True, False])
def test_compiles_soft_cap(fast_math):
    ptx = _compile(*_qkv(), score_fn=softcap, fast_math=fast_math).asm["ptx"]
    assert ("tanh.approx.f32" in ptx) == fast_math


def test_gluon_spelling_of_constants():
    def const_score(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx > kv_idx, score, float("-inf")) * 0 + 2.0

    src = emit.emit_mod(_mod(const_score, SCORE).ir, "score", target="gluon").source
    cuda = emit.emit_mod(_mod(const_score, SCORE).ir, "score", target="cuda").source
    assert "tl.full(" not in src and "gl.full" in src
    assert "tl.full(" in cuda and "gl." not in cuda


def test_reason_names_what_keeps_a_call_off_the_kernel():
    q, k, v = _qkv()
    assert "compute capability 9.0" in hopper.reason(q, k, v, None, {})
    assert hopper.reason(q, k, v, None, {"BACKEND": "TRITON"}) == "kernel_options BACKEND='TRITON'"
    with pytest.raises(ValueError, match="BACKEND='FLASH'.*compute capability 9.0"):
        hopper.runnable(q, k, v, None, {"BACKEND": "FLASH"})
    assert not hopper.runnable(q, k, v, None, {})


def test_reason_on_a_hopper(monkeypatch):
    """What the checks after the device say, with the device check passed."""
    monkeypatch.setattr(hopper, "_on_sm90", lambda device: True)
    q, k, v = _qkv()
    assert hopper.reason(q, k, v, None, {}) is None
    assert "float16, bfloat16 or float8_e4m3fn" in hopper.reason(*(t.float() for t in (q, k, v)), None, {})
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in _qkv(D=256))
    assert "KV-innermost" in hopper.reason(q8, k8, v8, None, {})
    assert hopper.reason(q8, k8, layout.k_major(v8), None, {}) is None
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))  # D=128: runnable, timed against the template
    v8 = layout.k_major(v8)
    assert hopper.reason(q8, k8, v8, None, {}) is None
    assert hopper.runnable(q8, k8, v8, None, {}) and hopper.timed_against_triton(q8, {})
    assert not hopper.timed_against_triton(q8, {"BACKEND": "FLASH"})
    assert not hopper.timed_against_triton(q, {})
    assert "head dims" in hopper.reason(*_qkv(D=80), None, {})
    assert "below one 128-row tile" in hopper.reason(*_qkv(S=100), None, {})
    q64, k64, v64 = _qkv(D=64)  # 192-row tiles: no block mask, timed against the Triton template
    assert hopper.reason(q64, k64, v64, None, {}) is None and "below one 192-row tile" in hopper.reason(
        *_qkv(S=150, D=64), None, {})
    assert hopper.timed_against_triton(q64, {}) and not hopper.timed_against_triton(q64, {"BACKEND": "FLASH"})
    causal64 = tables_of(create_block_mask(causal, None, None, 300, 300, device="cpu"))
    assert hopper.reason(q64, k64, v64, causal64, {}) is None and hopper.forward_rows(causal64, 64) == 192
    assert "KV blocks of 64 are not multiples of the kernel's 128-column" in hopper.reason(  # (KV: not regrouped)
        q64, k64, v64, tables_of(create_block_mask(causal, None, None, 300, 300, device="cpu",
                                                   BLOCK_SIZE=(128, 64))), {})
    assert "float8 inputs at head dims" in hopper.reason(
        *(t.to(torch.float8_e4m3fn) for t in (q64, k64, layout.k_major(v64))), None, {})
    padded = torch.randn(1, 2, 300, 132, dtype=torch.bfloat16)[..., :128]  # rows 264 bytes apart
    assert "query is not TMA-readable" in hopper.reason(padded, k, v, None, {})
    assert "Triton template's knobs ['BLOCK_N']" in hopper.reason(q, k, v, None, {"BLOCK_N": 64})
    bm = create_block_mask(causal, None, None, 300, 300, device="cpu", BLOCK_SIZE=64)
    assert "64x64" in hopper.reason(q, k, v, tables_of(bm), {})


@pytest.mark.parametrize("winner", ["hopper", "triton"])
def test_float8_forward_at_head_dim_128_is_chosen_by_timing(monkeypatch, tmp_path, winner):
    """float8 at head dim 128: the tuner times the Hopper kernel beside the Triton template's
    configs under a key of its own and the plan is the winner's; untimed (tuning off), the Triton
    template; BACKEND='FLASH', the Hopper kernel without timing."""
    from flexattn.kernels import plans, tuning

    monkeypatch.setattr(hopper, "_on_sm90", lambda device: True)
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(plans, "TUNE_MIN_WORK", 0)
    tuning.forget()
    asked = []

    def choose(key, candidates, make, run, device, prefer=0.0):  # the fake clock: the winner is the parameter's
        asked.append((key, candidates))
        config = candidates[-1] if winner == "hopper" else candidates[0]
        return make(config), config

    monkeypatch.setattr(tuning, "choose", choose)
    q, k, v = (t.to(torch.float8_e4m3fn) for t in _qkv())
    v = layout.k_major(v)
    score, mask = _mod(lambda s, b, h, q_idx, kv_idx: s, SCORE), _mod(causal, MASK)

    def plan(**options):
        return plans._make_forward_plan(q, k, v, score, (), mask, (), None, False, options, False, None)

    tuned = plan(AUTOTUNE=True)
    (key, candidates), = asked
    assert "or Hopper" in key and candidates[-1] == {"BACKEND": "FLASH"}
    assert candidates[:-1] == tuning.forward_candidates(torch.device("cpu"), q.dtype, 128)
    assert (tuned.descriptors is not None) == (winner == "hopper")  # (only the Hopper plan reads descriptors)
    assert plan(AUTOTUNE=False).descriptors is None
    assert plan(BACKEND="FLASH").descriptors is not None
    assert len(asked) == 1
    bf16 = _qkv()
    plans._make_forward_plan(*bf16, score, (), mask, (), None, False, {"AUTOTUNE": True}, False, None)
    assert len(asked) == 1  # 16-bit: the Hopper kernel, untimed
    tuning.forget()


def test_masked_forward_at_head_dim_64_times_the_hopper_kernel_on_regrouped_lists(monkeypatch, tmp_path):
    """Head dim 64 under a block mask of 128-row blocks: the tuner times the Hopper kernel (192-row
    tiles) on the mask's lists regrouped to 192 rows beside the Triton template's configs, under a
    key of its own; the Hopper plan launches with the regrouped lists, the template's with the mask's."""
    from flexattn.kernels import plans, tuning

    monkeypatch.setattr(hopper, "_on_sm90", lambda device: True)
    monkeypatch.setenv("FLEXATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(plans, "TUNE_MIN_WORK", 0)
    tuning.forget()
    asked = []

    def choose(key, candidates, make, run, device, prefer=0.0):
        asked.append((key, candidates))
        return make(candidates[-1]), candidates[-1]

    monkeypatch.setattr(tuning, "choose", choose)
    q, k, v = _qkv(S=300, D=64)
    score, mask = _mod(lambda s, b, h, q_idx, kv_idx: s, SCORE), _mod(causal, MASK)
    tables = tables_of(create_block_mask(causal, None, None, 300, 300, device="cpu"))
    plan = plans._make_forward_plan(q, k, v, score, (), mask, (), tables, False, {"AUTOTUNE": True}, False, None)
    (key, candidates), = asked
    assert "or Hopper on 192-row lists" in key and candidates[-1] == {"BACKEND": "FLASH"}
    assert plan.rows == 192 and plan.kernel.constexprs["SPARSE_Q_BLOCK_SIZE"] == 192
    out, lse = torch.empty(1, 2, 300, 64, dtype=torch.bfloat16), torch.empty(1, 2, 300)
    args = fwd.launch_args(plan, q, k, v, out, lse, None, score, (), mask, (), tables, 1.0)
    lists = regrouped(tables, 192).kv.args()
    assert sum(a is t for a in args for t in lists) == 4 and not any(a is t for a in args for t in tables.kv.args())
    template = plans._make_forward_plan(q, k, v, score, (), mask, (), tables, False, {"AUTOTUNE": False}, False, None)
    assert template.rows == 0 and template.descriptors is None
    tuning.forget()


def _compile_backward(q, k, v, score_fn=None, mask_fn=None, block_mask=None, dq_pass=False, ordered=False):
    """Compile the Hopper backward plan's kernel for sm_90 with the argument types a launch passes
    (``dq_pass``: the kernel that leaves dQ to the Triton dQ pass; ``ordered``: dQ added in a
    fixed order, deterministic mode's)."""
    score = _mod(score_fn or (lambda s, b, h, q, k: s), SCORE)
    mask = _mod(mask_fn or (lambda b, h, q, k: q >= 0), MASK)
    tables = None if block_mask is None else tables_of(block_mask)
    split = bwd.make_plan(q, k, v, q, q, score, mask, tables, {}, (), (), False) if dq_pass else None
    plan = bwd.hopper_plan(q, k, v, score, mask, tables, {}, False, split, ordered)
    B, Hq, S, D = q.shape
    lse = torch.empty(B, Hq, S)
    delta, dq_acc = torch.empty(B, Hq, S), torch.empty(B, Hq, S, D)
    dk = torch.empty(B, k.shape[1], k.shape[2], D, dtype=plan.dk_dtype)
    if plan.dense is not None:
        lists = plan.dense
    else:
        lists = (ordered_q_lists if ordered else q_direction)(tables, k.shape[2])
    args = bwd.hopper_args(plan, q, k, v, torch.empty_like(q), lse, delta, dq_acc, bwd.dq_counts(plan, q.device), dk,
                           torch.empty_like(dk), lists, score, score.buffers, mask, mask.buffers, 0.125)
    return _compile_gluon(bwd.hopper_module(score, mask, True).flex_attention_backward, list(args),
                          plan.main).asm["ptx"]


@pytest.mark.parametrize("D", [64, 128])
def test_backward_compiles(D):
    """Five wgmma products per step, dQ added by the TMA unit, at both head dims; a length that is
    not a multiple of the tiles. dK and dV leave through the TMA unit too (each consumer's, staged
    in its rows of the V tile and in its dQ buffer)."""
    ptx = _compile_backward(*_qkv(S=300, D=D))
    assert "wgmma.mma_async" in ptx and "cp.reduce.async.bulk.tensor" in ptx and "red.global" not in ptx
    assert ptx.count(TMA_STORE) == 4


@pytest.mark.parametrize("D", [64, 128])
def test_ordered_backward_compiles(D):
    """Deterministic mode's one pass: each dQ add waits for its tile's count (an acquire load)
    and raises it (one release add) once the TMA unit has completed it, not only read it; a
    causal mask whose KV blocks hold two programs' tiles, lengths no tile divides. The kernel
    without DQ_ORDERED has none of this."""
    q, k, v = _qkv(S=300, D=D)
    causal = (lambda b, h, qi, ki: qi >= ki)
    bm = create_block_mask(causal, None, None, 300, 300, device="cpu", BLOCK_SIZE=(128, 256))
    ordered = _compile_backward(q, k, v, mask_fn=causal, block_mask=bm, ordered=True)
    plain = _compile_backward(q, k, v, mask_fn=causal, block_mask=bm)
    assert "ld.global.acquire.gpu" in ordered and "red.release.gpu.global.add" in ordered
    assert "cp.async.bulk.wait_group 0;" in ordered and "cp.reduce.async.bulk.tensor" in ordered
    for marker in ("acquire", "release", "cp.async.bulk.wait_group 0;"):
        assert marker not in plain


def _compile_dq(q, k, v, score_fn=None, mask_fn=None, block_mask=None, has_grad_lse=False):
    """Compile the Gluon dQ pass for sm_90 with the argument types a launch passes."""
    score = _mod(score_fn or (lambda s, b, h, q, k: s), SCORE)
    mask = _mod(mask_fn or (lambda b, h, q, k: q >= 0), MASK)
    tables = None if block_mask is None else tables_of(block_mask)
    plan = bwd.hopper_dq_plan(q, k, v, score, mask, tables, {}, has_grad_lse)
    B, Hq, S, D = q.shape
    lists = plan.dense if plan.dense is not None else tables.kv
    rows = (torch.empty(B, Hq, S) for _ in range(3))
    args = bwd.hopper_dq_args(plan, q, k, v, torch.empty_like(q), torch.empty_like(q), torch.empty_like(q), *rows,
                              lists, score, score.buffers, mask, mask.buffers, 0.125)
    return _compile_gluon(bwd.hopper_dq_module(score, mask, True).flex_attention_backward_dq, list(args), plan.main)


@pytest.mark.parametrize("D", [64, 128])
def test_gluon_dq_pass_compiles(D):
    """The Gluon dQ pass: three products per KV tile (dS as the register operand of the last), no
    atomics, dQ stored once through the TMA unit, Delta written; with a score_mod and a document
    mask, GQA and K/V broadcast over the batch, and a gradient of the LSE."""
    compiled = _compile_dq(*_qkv(S=300, D=D))
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "red.global" not in ptx and "atom.global" not in ptx
    assert "cp.reduce.async.bulk" not in ptx and ptx.count(TMA_STORE) == 2  # (one per consumer)
    alibi = alibi_with(torch.exp2(-torch.arange(1, 5, dtype=torch.float32)))
    documents = causal_documents(torch.arange(384, dtype=torch.int32) // 100)
    bm = create_block_mask(documents, None, None, 384, 384, device="cpu")
    _compile_dq(*_qkv(B=2, H=4, Hkv=2, S=384, Bkv=1, D=D), score_fn=alibi, mask_fn=documents, block_mask=bm)
    _compile_dq(*_qkv(S=256, D=D), score_fn=softcap, has_grad_lse=True)


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_backward_without_dq_compiles(D, persistent, monkeypatch):
    """With dQ left to the dQ pass the kernel runs four products per step and adds nothing: no
    reduce-add, no atomics; dK and dV still leave through the TMA unit. As persistent programs
    (`backward.persistent_programs`) too, whose second K/V buffer fits in the shared memory at head dim 128;
    with a document mask, GQA and K/V broadcast over the batch (dK and dV from the registers)."""
    monkeypatch.setattr(bwd, "persistent_programs", lambda mask: persistent)
    ptx = _compile_backward(*_qkv(S=300, D=D), dq_pass=True)
    assert ptx.count("wgmma.mma_async") < _compile_backward(*_qkv(S=300, D=D)).count("wgmma.mma_async")
    assert "cp.reduce.async.bulk" not in ptx and "red.global" not in ptx and "atom.global" not in ptx
    assert ptx.count(TMA_STORE) == 4
    monkeypatch.setattr(bwd, "persistent_programs", lambda mask: not persistent)
    assert ptx != _compile_backward(*_qkv(S=300, D=D), dq_pass=True)
    monkeypatch.setattr(bwd, "persistent_programs", lambda mask: persistent)
    documents = causal_documents(torch.arange(384, dtype=torch.int32) // 100)
    bm = create_block_mask(documents, None, None, 384, 384, device="cpu")
    ptx = _compile_backward(*_qkv(B=2, H=4, Hkv=2, S=384, Bkv=1, D=D), mask_fn=documents, block_mask=bm, dq_pass=True)
    assert TMA_STORE not in ptx and "cp.reduce.async.bulk" not in ptx


def test_persistent_programs_where_the_mask_reads_memory(monkeypatch):
    """The kernel without dQ and the Gluon dQ pass run as persistent programs (one per SM, at most
    one per tile) under a mask that reads captured tensors (documents: short programs), one
    program per tile under one that does not (causal); the one pass never does."""
    monkeypatch.setattr(launch, "num_sms", lambda device: 7)
    q, k, v = _qkv(B=2, H=4, Hkv=2, S=1000)
    documents = _mod(causal_documents(torch.arange(1000, dtype=torch.int32) // 300), MASK)
    causal_ = _mod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, MASK)
    score = _mod(lambda s, b, h, q_idx, kv_idx: s, SCORE)
    for mask, persistent in ((documents, True), (causal_, False)):
        tables = tables_of(create_block_mask(mask, None, None, 1000, 1000, device="cpu"))
        split = bwd.make_plan(q, k, v, q, q, score, mask, tables, {}, (), (), False)
        plan = bwd.hopper_plan(q, k, v, score, mask, tables, {}, False, split)
        assert plan.main.constexprs["PERSISTENT"] == persistent
        assert plan.main.grid == ((7, 1) if persistent else (8, 4))  # (8 KV tiles of 128 x 2 x 2 heads)
        assert not bwd.hopper_plan(q, k, v, score, mask, tables, {}, False).main.constexprs["PERSISTENT"]
        dq = bwd.hopper_dq_plan(q, k, v, score, mask, tables, {}, False).main
        assert dq.constexprs["PERSISTENT"] == persistent
        assert dq.grid == ((7, 1) if persistent else (8, 8))  # (8 query tiles of 128 x 2 x 4 heads)


@pytest.mark.parametrize("D", [64, 128])
def test_persistent_dq_pass_compiles(D, monkeypatch):
    """The Gluon dQ pass as persistent programs: a second Q/dO buffer fits at head dim 128, dQ
    leaves through the TMA unit, nothing is added; a document mask with GQA and K/V broadcast."""
    monkeypatch.setattr(bwd, "persistent_programs", lambda mask: True)
    documents = causal_documents(torch.arange(384, dtype=torch.int32) // 100)
    bm = create_block_mask(documents, None, None, 384, 384, device="cpu")
    compiled = _compile_dq(*_qkv(B=2, H=4, Hkv=2, S=384, Bkv=1, D=D), mask_fn=documents, block_mask=bm)
    ptx = compiled.asm["ptx"]
    assert ptx.count(TMA_STORE) == 2 and "cp.reduce.async.bulk" not in ptx and "red.global" not in ptx
    monkeypatch.setattr(bwd, "persistent_programs", lambda mask: False)
    single = _compile_dq(*_qkv(B=2, H=4, Hkv=2, S=384, Bkv=1, D=D), mask_fn=documents, block_mask=bm)
    assert compiled.metadata.shared > single.metadata.shared  # (the second Q/dO buffer)


def test_backward_compiles_with_mods_gqa_and_broadcast_batch():
    alibi = alibi_with(torch.exp2(-torch.arange(1, 5, dtype=torch.float32)))
    documents = causal_documents(torch.arange(384, dtype=torch.int32) // 100)
    bm = create_block_mask(documents, None, None, 384, 384, device="cpu")
    # (K/V broadcast over the batch: float32 dK and dV, summed by the host, stored from the registers)
    ptx = _compile_backward(*_qkv(B=2, H=4, Hkv=2, S=384, Bkv=1), score_fn=alibi, mask_fn=documents, block_mask=bm)
    assert TMA_STORE not in ptx
    _compile_backward(*_qkv(S=256), score_fn=softcap)


def test_backward_waits_for_dp_late_only_for_score_mods_of_constant_derivative():
    """P's exp2 runs under dP (LATE_DP_WAIT) where that measured faster: a score_mod whose
    derivative in the score is a constant (ALiBi-like), at both head dims; not where the derivative
    reads the score (soft-cap) nor without a score_mod. Both forms (affine, and a mod evaluated
    per score) compile with a mask at both head dims."""
    alibi = alibi_with(torch.exp2(-torch.arange(1, 3, dtype=torch.float32)))

    def distance(s, b, h, q, k):  # not affine (abs), derivative 0.5
        return 0.5 * s - (q - k).abs()

    def late(score_fn, D=128):
        score, mask = _mod(score_fn, SCORE), _mod(lambda b, h, q, k: q >= 0, MASK)
        return bwd.hopper_plan(*_qkv(D=D), score, mask, None, {}, False).main.constexprs["LATE_DP_WAIT"]

    assert late(alibi) and late(distance) and late(alibi, D=64) and late(distance, D=64)
    assert not late(softcap) and not late(lambda s, b, h, q, k: s) and not late(softcap, D=64)
    assert not late(lambda s, b, h, q, k: s * s)
    bm = create_block_mask(causal, None, None, 300, 300, device="cpu")
    for D in (64, 128):
        for fn in (alibi, distance):
            assert "ex2.approx" in _compile_backward(*_qkv(S=300, D=D), score_fn=fn, mask_fn=causal, block_mask=bm)


def test_backward_defers_dq_where_it_measured_faster(monkeypatch):
    """DEFER_DQ (a step's dQ in the next step) where it measured faster: at head dim 128 unless the
    mask reads captured tensors (documents); at head dim 64 with ALiBi or a documents mask, not
    without mods, causal nor with soft-cap, nor with ordered dQ adds (deterministic mode). Both schedules compile at both head dims (a GQA group,
    a length that is not a multiple of the tiles)."""
    alibi = alibi_with(torch.exp2(-torch.arange(1, 3, dtype=torch.float32)))
    documents = causal_documents(torch.arange(300, dtype=torch.int32) // 70)

    def deferred(D, score_fn=None, mask_fn=None, ordered=False):
        score = _mod(score_fn or (lambda s, b, h, q, k: s), SCORE)
        mask = _mod(mask_fn or (lambda b, h, q, k: q >= 0), MASK)
        plan = bwd.hopper_plan(*_qkv(D=D), score, mask, None, {}, False, ordered=ordered)
        assert plan.main.constexprs["DQ_ORDERED"] == ordered
        return plan.main.constexprs["DEFER_DQ"]

    assert deferred(64, score_fn=alibi) and deferred(64, mask_fn=documents)
    assert not deferred(64, score_fn=alibi, ordered=True) and deferred(128, score_fn=alibi, ordered=True)
    assert not (deferred(64) or deferred(64, score_fn=softcap) or deferred(64, mask_fn=causal))
    assert deferred(128) and deferred(128, mask_fn=causal) and deferred(128, score_fn=alibi)
    assert not deferred(128, mask_fn=documents) and not deferred(128, score_fn=alibi, mask_fn=documents)
    bm = create_block_mask(documents, None, None, 300, 300, device="cpu")
    for D in (64, 128):
        products = {}
        for forced in (False, True):
            monkeypatch.setattr(bwd, "defer_dq", lambda *args, forced=forced: forced)
            ptx = _compile_backward(*_qkv(H=4, Hkv=2, S=300, D=D), score_fn=alibi, mask_fn=documents, block_mask=bm)
            products[forced] = ptx.count("wgmma.mma_async")
        assert products[True] > products[False]  # the last step's dQ product, after the loop


def test_head_group_takes_heads_together_only_for_few_waves_of_a_block_mask(monkeypatch):
    """HEAD_GROUP (program_tile): the grid's order (1) without a block mask or past 16 waves of
    programs; else as many heads as have their tensors in half the L2; kernel_options' value
    wins (at most the heads there are)."""
    monkeypatch.setattr(hopper, "_l2_bytes", lambda device: 50 << 20)
    monkeypatch.setattr(launch, "num_sms", lambda device: 132)
    gpu, mib = torch.device("cuda", 0), 1 << 20
    assert hopper.head_group(gpu, mib, 64, 1024, masked=True) == 25
    assert hopper.head_group(gpu, mib, 16, 1024, masked=True) == 16
    assert hopper.head_group(gpu, 40 * mib, 64, 1024, masked=True) == 1
    assert hopper.head_group(gpu, mib, 64, 1024, masked=False) == 1
    assert hopper.head_group(gpu, mib, 64, 16 * 132 + 1, masked=True) == 1
    assert hopper.head_group(gpu, mib, 64, 16 * 132, masked=True) == 25
    assert hopper.head_group(gpu, mib, 64, 4096, masked=False, explicit=3) == 3
    assert hopper.head_group(gpu, mib, 8, 1024, masked=True, explicit=100) == 8
    assert hopper.head_group(torch.device("cpu"), mib, 64, 1024, masked=True) == 1
    # the plans pass it as the kernels' HEAD_GROUP (the last size), kernel_options' value included
    q, k, v = _qkv(H=4, Hkv=2, S=300)
    score, mask = _mod(lambda s, b, h, q, k: s, SCORE), _mod(lambda b, h, q, k: q >= 0, MASK)
    assert bwd.hopper_plan(q, k, v, score, mask, None, {"HEAD_GROUP": 2}, False).sizes[-1] == 2
    assert fwd.hopper_plan(q, k, v, score, mask, None, {"HEAD_GROUP": 3}, False).sizes[-1] == 3
    assert fwd.hopper_plan(q, k, v, score, mask, None, {}, False).sizes[-1] == 1
    with pytest.raises(ValueError, match="HEAD_GROUP"):
        opts.check({"HEAD_GROUP": 0})


def test_backward_reason(monkeypatch):
    q, k, v = _qkv()
    assert "compute capability 9.0" in hopper.backward_reason(q, k, v, q, None, {})
    monkeypatch.setattr(hopper, "_on_sm90", lambda device: True)
    assert hopper.backward_reason(q, k, v, q, None, {}) is None
    assert hopper.backward_reason(*_qkv(D=64), q, None, {}) is None
    assert hopper.backward_reason(q, k, v, q, None, {"BACKEND": "TRITON"}) == "kernel_options BACKEND='TRITON'"
    assert "head dims" in hopper.backward_reason(*_qkv(D=256), q, None, {})
    assert "float16 or bfloat16" in hopper.backward_reason(*(t.float() for t in (q, k, v)), q, None, {})
    assert "below one 64x128 tile" in hopper.backward_reason(*_qkv(S=100), q, None, {})
    padded = torch.randn(1, 2, 300, 132, dtype=torch.bfloat16)[..., :128]
    assert "grad_out is not TMA-readable" in hopper.backward_reason(q, k, v, padded, None, {})
    assert "Triton backward's knobs ['BLOCK_M1']" in hopper.backward_reason(q, k, v, q, None, {"BLOCK_M1": 32})
    bm = create_block_mask(causal, None, None, 300, 300, device="cpu", BLOCK_SIZE=64)
    assert "64x128" in hopper.backward_reason(q, k, v, q, tables_of(bm), {})


@pytest.mark.parametrize("backward", [False, True])
def test_later_descriptors_are_the_first_ones_with_the_call_tensors(backward):
    """A plan validates its descriptors once (Triton's constructor); later calls copy them with their
    own tensors in place. Each copy must equal what the constructor makes of those tensors, and
    leave the first call's descriptors alone."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    def fields(d):
        return {k: v for k, v in vars(d).items() if k != "base"}

    def call(tensors):  # (a launch's arguments: the tensors in the descriptors' places, others between)
        args = [object()] * (max(descriptors.positions) + 1)
        for i, t in zip(descriptors.positions, tensors):
            args[i] = t
        described = descriptors.describe(tuple(args))
        assert all(d is a for i, (d, a) in enumerate(zip(described, args)) if i not in descriptors.positions)
        return [described[i] for i in descriptors.positions]

    def fresh():  # (strided views, as a call may pass: the query's layout is [B, S, H, D])
        q = torch.randn(2, 300, 3, 128, dtype=torch.bfloat16).transpose(1, 2)
        kv = [torch.randn(2, 3, 300, 128, dtype=torch.bfloat16) for _ in range(2)]
        # (the forward's output; the backward's dO, its float32 dQ accumulator, dK and dV)
        more = ([torch.randn_like(q), torch.randn(2, 3, 300, 128), torch.randn_like(kv[0]), torch.randn_like(kv[0])]
                if backward else [torch.randn_like(q)])
        return [q, *kv, *more]

    descriptors = hopper.Descriptors(torch.bfloat16, 128, backward=backward)
    first_tensors, later_tensors = fresh(), fresh()
    first = call(first_tensors)
    later = call(later_tensors)
    assert len(later) == len(first) == (7 if backward else 4)
    for d, f, t, t0, block, layout in zip(later, first, later_tensors, first_tensors, descriptors.blocks,
                                          descriptors.layouts):
        assert type(d) is TensorDescriptor and d is not f
        assert d.base is t and f.base is t0
        built = TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)
        assert fields(d) == fields(built)
        assert d.strides == list(t.stride()) and d.shape == list(t.shape)
    # the plan keeps no call's tensors alive (a backward's would be its float32 dQ buffer)
    import weakref

    refs = [weakref.ref(t) for t in first_tensors + later_tensors]
    del first, later, first_tensors, later_tensors, d, f, t, t0, built
    assert all(r() is None for r in refs)


def test_descriptors_without_an_instance_dict_are_built_every_call():
    """A Triton whose descriptor class has no instance dict (slots) gets its constructor each call."""
    from dataclasses import dataclass

    @dataclass(slots=True)
    class Slotted:
        base: torch.Tensor
        shape: list
        strides: list
        block_shape: list
        layout: object

    descriptors = hopper.Descriptors(torch.bfloat16, 128)
    descriptors.make = Slotted
    calls = [tuple(torch.randn(1, 2, 256, 128, dtype=torch.bfloat16) for _ in range(4)) for _ in range(2)]
    for tensors in calls:  # (Q, K, V and the output, the forward's first four arguments)
        made = descriptors.describe(tensors)
        assert all(type(d) is Slotted and d.base is t for d, t in zip(made, tensors))
    assert descriptors.first == ()
