"""Each kernel's parameters are declared once (flexattn/codegen/signatures.py): the rendered
template's ``def`` has exactly the declared parameters, and the host's argument tuple, built with
one named sentinel per parameter, lines up with them name by name."""

from __future__ import annotations

import ast
import dataclasses
import types

import pytest
import torch

import flexattn
from flexattn import interval as summaries, ir
from flexattn.codegen import emit, interval, render, signatures
from flexattn.kernels import backward as bwd, decode as dec, forward as fwd, hopper, launch, mask_tiles
from flexattn.kernels.arguments import PER_CALL, UNUSED
from flexattn.kernels.tables import ordered_q_lists, tables_of
from flexattn.lru import LRU

BIAS = torch.randn(8)
SCORE = flexattn.trace(lambda score, b, h, q_idx, kv_idx: score + BIAS[q_idx], kind="score")
MASK = flexattn.trace(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx + BIAS.to(torch.int64)[kv_idx], kind="mask")


class Named(str):
    """A sentinel argument that says which parameter it stands for; as a captured tensor, its
    strides and sizes are named as the mods' parameters are (``<name>_s<d>``, ``<name>_n<d>``)."""

    def stride(self):
        return (Named(f"{self}_s0"),)

    @property
    def shape(self):
        return (Named(f"{self}_n0"),)


def named(names) -> tuple:
    return tuple(Named(n) for n in names)


def rendered(template: str, make_module, monkeypatch) -> str:
    """The source ``make_module`` renders from ``template`` (not loaded)."""
    seen = {}

    def capture(text, name, interpret):
        seen[name] = text
        return types.SimpleNamespace(flex_attention_forward=None)

    monkeypatch.setattr(render, "load_source", capture)
    monkeypatch.setattr(mask_tiles, "load_kernel_module",
                        lambda name, hooks, provenance, interpret: capture(render.render(name, hooks, provenance),
                                                                           name, interpret))
    monkeypatch.setattr(launch, "_MODULES", LRU(16))  # empty: every module is rendered again
    make_module()
    return seen[template]


def def_params(source: str, kernel: str) -> list[str]:
    """The parameter names of the top-level function ``kernel`` in ``source``."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == kernel:
            return [a.arg for a in node.args.args]
    raise AssertionError(f"no def {kernel} in the rendered source")


def mod_hooks(target: str, hook: str = "{kind}_mod_params", prefix: str = "{kind}_") -> dict[str, str]:
    """The mods' parameter hooks as a template reads them (``hook`` and ``prefix`` per kind)."""
    return {hook.format(kind=kind): emit.emit_mod(mod.ir, kind, f"{kind}_mod", target).param_list(
        prefix.format(kind=kind, K=kind[0].upper())) for kind, mod in (("score", SCORE), ("mask", MASK))}


DECODE_HOOKS = dict(hook="{kind}_params", prefix="{K}M_")


def backward_hooks() -> dict[str, str]:
    """The Triton backward's: the mods' and the gradient buffer of SCORE's captured tensor."""
    return {**mod_hooks("cuda"), "grad_params": "score_G0, score_G0_s0, "}

FAMILIES = {
    "forward": (lambda: fwd.module(SCORE, MASK, "cuda"), lambda: mod_hooks("cuda")),
    "forward_hopper": (lambda: fwd.hopper_module(SCORE, MASK, False), lambda: mod_hooks("gluon")),
    "decode": (lambda: dec.module(SCORE, MASK, "cuda"), lambda: mod_hooks("cuda", **DECODE_HOOKS)),
    "block_mask": (lambda: mask_tiles._render(MASK, "cuda"), lambda: block_mask_hooks()),
    "backward": (lambda: bwd.module(SCORE, MASK, (0,), "cuda"), backward_hooks),
    "backward_hopper": (lambda: bwd.hopper_module(SCORE, MASK, False), lambda: mod_hooks("gluon")),
    "backward_dq_hopper": (lambda: bwd.hopper_dq_module(SCORE, MASK, False), lambda: mod_hooks("gluon")),
}


def block_mask_hooks() -> dict[str, str]:
    src = emit.emit_mod(MASK.ir, "mask", "mask_mod", "cuda")
    return {"mod_params": src.param_list(""),
            "interval_params": "".join(f"{p}, " for p in interval.summary_params(list(src.buffers)))}



def test_every_declared_template_is_checked_here():
    assert FAMILIES.keys() == signatures.TEMPLATES.keys()


@pytest.mark.parametrize("template", list(FAMILIES))
def test_the_rendered_def_is_the_declaration(template, monkeypatch):
    make_module, hooks = FAMILIES[template]
    source = rendered(template, make_module, monkeypatch)
    for sig in signatures.TEMPLATES[template]:
        assert def_params(source, sig.kernel) == sig.names(hooks())


def forward_plan(sig: signatures.Signature, descriptors=None) -> fwd.Plan:
    return fwd.Plan(kernel=None, any_scale=None, out_shape=(), stat_shape=(), out_order=None, out_like_query=False,
                    stat_dtype=torch.float32, out_dtype=torch.float32, strides=named(sig.group("strides")),
                    dense_rows=None, sizes=named(sig.group("sizes")), want_max=True, is_empty=False,
                    descriptors=descriptors)


def sentinel_tables(sig: signatures.Signature):
    kv = types.SimpleNamespace(args=lambda: named(sig.group("tables")),
                               strides=lambda: named(sig.group("table_strides")))
    return types.SimpleNamespace(kv=kv)


def forward_args(sig: signatures.Signature, descriptors=None) -> list[str]:
    tensors = named(sig.group("tensors"))
    args = fwd.launch_args(forward_plan(sig, descriptors), *tensors, SCORE, (Named("score_B0"),), MASK,
                           (Named("mask_B0"),), sentinel_tables(sig), Named("SM_SCALE"),
                           named(sig.group("descale")), Named("SINKS"))
    return [str(a) for a in args]


def runtime_params(sig: signatures.Signature, target: str) -> list[str]:
    return sig.names(mod_hooks(target))[:-len(sig.constexprs)]


def test_the_forward_host_arguments_follow_the_declaration():
    assert forward_args(signatures.FORWARD) == runtime_params(signatures.FORWARD, "cuda")


def test_the_hopper_forward_host_arguments_follow_the_declaration():
    """The Hopper kernel takes the forward's arguments in the same order: its launch turns the
    tensors at Q, K, V (and the output, with O_TMA) into descriptors."""
    sig = signatures.FORWARD_HOPPER
    assert forward_args(sig) == runtime_params(sig, "gluon")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("kind", ["forward", "backward", "backward, float32 dK and dV", "dQ pass"])
def test_the_descriptors_land_at_their_names(kind, dtype):
    """`hopper.Descriptors.describe` replaces the tensors at the descriptor parameters of each
    Gluon kernel, and nothing else."""
    if dtype == torch.float8_e4m3fn and kind != "forward":
        pytest.skip("float8 runs the forward only")
    sig, names, descriptors = {
        "forward": (signatures.FORWARD_HOPPER, ["Q", "K", "V"] + (["Out"] if dtype == torch.bfloat16 else []),
                    hopper.Descriptors(dtype, 128)),
        "backward": (signatures.BACKWARD_HOPPER, ["Q", "K", "V", "DO", "DQ_DESC", "DK", "DV"],
                     hopper.Descriptors(dtype, 128, backward=True)),
        "backward, float32 dK and dV": (signatures.BACKWARD_HOPPER, ["Q", "K", "V", "DO", "DQ_DESC"],
                                        hopper.Descriptors(dtype, 128, backward=True, outputs=False)),
        "dQ pass": (signatures.BACKWARD_DQ_HOPPER, ["Q", "K", "V", "DO", "DQ"],
                    hopper.Descriptors(dtype, 128, dq_pass=True)),
    }[kind]
    params = sig.group("tensors")
    tensors = [torch.randn(1, 2, 256, 128).to(dtype) for _ in params]
    if "DQ_DESC" in params:  # (the float32 dQ accumulator)
        tensors[params.index("DQ_DESC")] = torch.randn(1, 2, 256, 128)
    if dtype == torch.float8_e4m3fn:  # (float8 V is stored KV-innermost)
        tensors[params.index("V")] = torch.randn(1, 2, 128, 256).to(dtype).transpose(2, 3)
    described = descriptors.describe(tuple(tensors))
    assert [p for p, d, t in zip(params, described, tensors) if d is not t] == names
    for p, d, t in zip(params, described, tensors):
        if p in names:  # (float8 V: its [B, H, Ev, L] view)
            assert d.base.data_ptr() == t.data_ptr() and (d.base is t or (p == "V" and dtype != torch.bfloat16))


# -- host arguments of plans made from real tensors: each argument's value is the one its name says

def permuted(shape, order) -> torch.Tensor:
    """A tensor of ``shape`` whose dimensions lie in memory in ``order`` (outermost first), so that
    its strides differ from a contiguous tensor's and from each other."""
    return torch.randn([shape[d] for d in order]).permute(*[order.index(d) for d in range(len(shape))])


def strides_of(prefix: str, t: torch.Tensor, dims: str) -> dict:
    return {f"stride_{prefix}{d}": s for d, s in zip(dims, t.stride())}


def buffer_values(prefix: str, buffers) -> dict:
    """A mod's captured tensors' parameters (``prefix`` + "B<i>", its strides, its sizes) and values."""
    out = {}
    for i, t in enumerate(buffers):
        out[f"{prefix}B{i}"] = t
        out.update({f"{prefix}B{i}_s{d}": s for d, s in enumerate(t.stride())})
        out.update({f"{prefix}B{i}_n{d}": n for d, n in enumerate(t.shape)})
    return out


def table_values(tables, names) -> dict:
    """The four KV tables and their [b, h, row] strides (0 where a table broadcasts), by name."""
    out = dict(zip(names.group("tables"), tables))
    strides = [s for t in tables for s in (t.stride(0) if t.shape[0] > 1 else 0,
                                           t.stride(1) if t.shape[1] > 1 else 0, t.stride(2))]
    return {**out, **dict(zip(names.group("table_strides"), strides))}


class Recorder:
    """Stands for a plan's `launch.Launch`: keeps the whole argument list of the call made through
    it (the fixed arguments with the call's own in their `PER_CALL` places)."""

    def __init__(self, fixed=None):
        self.fixed, self.args = fixed, None

    def __call__(self, *args, stream=None):
        if self.fixed is None:
            self.args = list(args)
            return
        given = iter(args)
        self.args = [next(given) if a is PER_CALL else a for a in self.fixed]
        assert next(given, None) is None, "more per-call arguments than PER_CALL slots"


class Equal:
    """An expected tensor that the host makes anew: compared by value."""

    def __init__(self, tensor):
        self.tensor = tensor


class Descriptor:
    """An expected TMA descriptor: of that very tensor, with that block shape."""

    def __init__(self, tensor, block):
        self.tensor, self.block = tensor, block


def assert_lands(sig: signatures.Signature, hooks: dict, args: list, expected: dict) -> None:
    """Every runtime parameter of ``sig`` got ``expected[name]`` (a tensor: that very object)."""
    names = sig.names(hooks)[:-len(sig.constexprs)]
    assert len(args) == len(names)
    assert set(expected) == set(names)
    for name, arg in zip(names, args):
        want = expected[name]
        if isinstance(want, Equal):
            assert torch.equal(arg, want.tensor), name
        elif isinstance(want, Descriptor):
            assert arg.base is want.tensor and list(arg.block_shape) == want.block, name
        elif isinstance(want, torch.Tensor) and want._base is not None:  # a view: of the same memory
            assert isinstance(arg, torch.Tensor) and (arg.data_ptr(), arg.shape, arg.stride()) == (
                want.data_ptr(), want.shape, want.stride()), name
        elif isinstance(want, torch.Tensor) or want is UNUSED or isinstance(arg, torch.Tensor):
            assert arg is want, name
        else:
            assert arg == want, name


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("block_mask", [False, True])
def test_the_decode_arguments_land_at_their_names(block_mask, sinks):
    B, HQ, HKV, Q_LEN, KV_LEN, E, EV = 2, 4, 2, 3, 32, 16, 8
    query = permuted((B, HQ, Q_LEN, E), (2, 0, 3, 1))
    key = permuted((B, HKV, KV_LEN, E), (1, 2, 0, 3))
    value = permuted((B, HKV, KV_LEN, EV), (0, 2, 1, 3))
    kv_lengths = torch.tensor([5, 32], dtype=torch.int32)
    tables = None
    if block_mask:
        tables = tables_of(flexattn.create_block_mask(lambda b, h, q, kv: kv <= q + 20, B, HKV, Q_LEN, KV_LEN,
                                                      device="cpu", BLOCK_SIZE=16))
    sink_logits = torch.randn(HQ) if sinks else None
    plan = dec.make_plan(query, key, value, SCORE, (BIAS,), MASK, (BIAS,), tables, {"SPLIT_KV": 2}, kv_lengths,
                         sinks)
    recorder = Recorder(plan.split.fixed)
    out, lse = dec.run(dataclasses.replace(plan, split=recorder), query, key, value, (BIAS,), (BIAS,), tables,
                       0.25, kv_lengths, sinks=sink_logits)
    sig = signatures.DECODE_SPLIT
    args = recorder.args
    scratch, done = args[4], args[5]   # the LSE (and partials) buffer and the split counters
    assert lse.data_ptr() == scratch.data_ptr() and done.dtype == torch.int32
    kv_tables = tables.kv.args() if block_mask else [UNUSED] * 4
    expected = {
        "Q": query, "K": key, "V": value, "Out": out, "LSE": scratch, "SPLITS_DONE": done, "KV_LENGTHS": kv_lengths,
        "SINKS": sink_logits if sinks else UNUSED,
        **buffer_values("SM_", (BIAS,)), **buffer_values("MM_", (BIAS,)),
        **strides_of("q", query, "zhmk"), **strides_of("k", key, "zhnk"), **strides_of("v", value, "zhnk"),
        **strides_of("o", out, "zhmk"),
        **(table_values(kv_tables, sig) if block_mask else {**dict(zip(sig.group("tables"), kv_tables)),
                                                             **dict.fromkeys(sig.group("table_strides"), 0)}),
        "Q_LEN": Q_LEN, "KV_LEN": KV_LEN, "QK_HEAD_DIM": E, "V_HEAD_DIM": EV, "N_ROWS": B * HQ * Q_LEN,
        "SM_SCALE": 0.25,
    }
    assert_lands(sig, mod_hooks("cuda", **DECODE_HOOKS), args, expected)


class Grid:
    """Stands for a kernel launched as ``kernel[grid](...)``: records the arguments."""

    def __init__(self):
        self.recorder = Recorder()

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.recorder(*args)


@pytest.mark.parametrize("separate_full", [True, False])
def test_the_block_mask_arguments_land_at_their_names(separate_full, monkeypatch):
    kernels = types.SimpleNamespace(**{sig.kernel: Grid() for sig in signatures.TEMPLATES["block_mask"]})
    monkeypatch.setattr(mask_tiles, "kernel_module", lambda mod, target: kernels)
    BD, HD, Q_LEN, KV_LEN = 2, 3, 40, 72
    tables = mask_tiles.build_tables(MASK, BD, HD, Q_LEN, KV_LEN, 16, 8, torch.device("cpu"), separate_full)
    n_q, n_kv = 3, 9
    calls = {name: grid.recorder.args for name, grid in vars(kernels).items()}
    state = calls["classify_kernel"][0]
    assert state.shape == (BD * HD, n_q, 1)
    used = ir.buffers_of(MASK.ir)
    hooks = block_mask_hooks()
    states = {"State": state, "stride_sbh": state.stride(0), "stride_sm": state.stride(1)}
    made = interval.summary_args(used, {b.index: summaries.Summary.of(MASK.buffers[b.index]) for b in used})
    interval_values = dict(zip(interval.summary_params(used),
                               [Equal(v) if isinstance(v, torch.Tensor) else v for v in made]))
    # (the interpreter lists no undecided tiles: an unused list, and no exact_kernel)
    assert_lands(signatures.CLASSIFY, hooks, calls["classify_kernel"], {
        **states, "Deferred": mask_tiles._unused_list(torch.device("cpu")),
        **buffer_values("", MASK.buffers), **interval_values,
        "HD": HD, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN, "N_KV_TILES": n_kv, "N_WORDS": 1,
        "CAP": mask_tiles.DEFER_CAP})
    assert not calls["exact_kernel"]
    def lands(tables, sizes, rects=UNUSED):
        # (each kernel gets the rows of the buffers its tables are views of, partial and full, the
        # Rects table unread (UNUSED) for one rectangle)
        flat = [None if t is None else t._base[i // 2 % 2] for i, t in enumerate(tables)]
        for sig, lists, full in ((signatures.KV_ORDER, flat[0:2], flat[2:4]), (signatures.Q_ORDER, flat[4:6], flat[6:8])):
            if not separate_full:  # no full lists: each kernel gets its own lists in their (unread) place
                full = lists
            tensors = dict(zip(sig.group("tensors")[1:], [*lists, *full]))
            args = list(vars(kernels)[sig.kernel].recorder.args)
            if rects is UNUSED:
                assert args[5] is state
                args[5] = UNUSED
            else:
                assert torch.equal(args[5], rects), sig.kernel
                args[5] = UNUSED
            assert_lands(sig, hooks, args, {**states, **tensors, "Rects": UNUSED, **sizes})

    lands(tables, {"N_Q_TILES": n_q, "N_KV_TILES": n_kv, "Q0": 0, "KV0": 0})
    # a rectangle of the tiles: query tiles 1..2 against KV tiles 2..8, numbered from its corner
    tiles = mask_tiles.Tiles(kernels, state, BD, HD, n_q, n_kv, True)
    rect = tiles.tables((1, 3), (2, 9), separate_full)
    assert rect[0].shape == (BD, HD, 2) and rect[1].shape == (BD, HD, 2, 7)
    lands(rect, {"N_Q_TILES": 2, "N_KV_TILES": 7, "Q0": 1, "KV0": 2})
    # two rectangles in one launch: the sizes bound the grid, each rectangle's corner, sizes and
    # offsets (KV-order counts, Q-order counts, indices) are a row of Rects, its tables follow
    # the first's in each buffer, from the next 16 bytes (BH * 2, BH * 7 = 42 -> 44, BH * 14)
    two = tiles.tables_of([((1, 3), (2, 9)), ((0, 3), (0, 4))], separate_full)
    BH = BD * HD
    assert [t.shape for t in two[1][:2]] == [(BD, HD, 3), (BD, HD, 3, 4)]
    assert two[1][0].data_ptr() == two[0][0].data_ptr() + 4 * BH * 2
    assert two[1][1].data_ptr() == two[0][1].data_ptr() + 4 * BH * 2 * 7
    lands(two[0], {"N_Q_TILES": 3, "N_KV_TILES": 7, "Q0": 0, "KV0": 0},
          torch.tensor([[1, 2, 2, 7, 0, 0, 0, 0], [0, 3, 0, 4, 12, 44, 84, 0]]))


def test_the_exact_kernel_gets_the_list_classify_kernel_fills(monkeypatch):
    """Where a chunk's undecided tiles are listed (DEFER_MIN), exact_kernel gets the very list
    and state classify_kernel wrote, the mod's arguments and the sizes."""
    kernels = types.SimpleNamespace(**{sig.kernel: Grid() for sig in signatures.TEMPLATES["block_mask"]})
    monkeypatch.setattr(mask_tiles, "kernel_module", lambda mod, target: kernels)
    monkeypatch.setitem(mask_tiles.DEFER_MIN, "interpret", 1)
    BD, HD, Q_LEN, KV_LEN = 2, 3, 40, 72
    mask_tiles.classify(MASK, BD, HD, Q_LEN, KV_LEN, 16, 8, torch.device("cpu"))
    classify, exact = kernels.classify_kernel.recorder.args, kernels.exact_kernel.recorder.args
    state, listed = classify[0], classify[1]
    assert listed.dtype == torch.int64 and listed.shape == (1 + mask_tiles.DEFER_CAP,)
    assert listed[0] == 0  # (the count, zeroed before the launch)
    assert_lands(signatures.EXACT, block_mask_hooks(), exact, {
        "State": state, "Deferred": listed, "stride_sbh": state.stride(0), "stride_sm": state.stride(1),
        **buffer_values("", MASK.buffers), "HD": HD, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN,
        "CAP": mask_tiles.DEFER_CAP})


def test_the_forward_plan_strides_and_sizes_land_at_their_names():
    """`make_plan` builds the strides and sizes the sentinel test above passes through (the output
    takes the query's layout, the LSE is contiguous)."""
    B, HQ, HKV, Q_LEN, KV_LEN, E = 2, 4, 2, 24, 40, 16
    query = permuted((B, HQ, Q_LEN, E), (2, 0, 3, 1))
    key = permuted((B, HKV, KV_LEN, E), (1, 2, 0, 3))
    value = permuted((B, HKV, KV_LEN, E), (0, 2, 1, 3))
    out = permuted((B, HQ, Q_LEN, E), (1, 2, 0, 3))
    lse = permuted((B, HQ, Q_LEN), (2, 1, 0))
    plan = fwd.make_plan(query, key, value, SCORE, MASK, None, {}, False)
    sig = signatures.FORWARD
    args = fwd.launch_args(plan, query, key, value, out, lse, None, SCORE, (BIAS,), MASK, (BIAS,), None, 0.5)
    got = dict(zip(runtime_params(sig, "cuda"), args))
    expected = {**strides_of("q", query, "zhmk"), **strides_of("k", key, "zhnk"), **strides_of("v", value, "zhnk"),
                **strides_of("o", torch.empty_like(query), "zhmk"), "stride_lz": Q_LEN * HQ, "stride_lh": Q_LEN,
                "HQ": HQ, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN}
    assert {name: got[name] for name in expected} == expected


@pytest.mark.parametrize("block_mask", [False, True])
def test_the_backward_arguments_land_at_their_names(block_mask):
    """`run`'s three launches (preprocess, dK/dV, dQ) of a plan made from permuted CPU tensors,
    with a gradient for SCORE's captured tensor."""
    B, HQ, HKV, Q_LEN, KV_LEN, E, EV = 2, 4, 2, 24, 40, 16, 8
    query = permuted((B, HQ, Q_LEN, E), (2, 0, 3, 1))
    key = permuted((B, HKV, KV_LEN, E), (1, 2, 0, 3))
    value = permuted((B, HKV, KV_LEN, EV), (0, 2, 1, 3))
    out = permuted((B, HQ, Q_LEN, EV), (1, 2, 0, 3))
    grad_out = permuted((B, HQ, Q_LEN, EV), (3, 1, 0, 2))
    lse = permuted((B, HQ, Q_LEN), (2, 1, 0))
    grad_lse = permuted((B, HQ, Q_LEN), (1, 0, 2))
    tables = None
    if block_mask:
        tables = tables_of(flexattn.create_block_mask(lambda b, h, q, kv: kv <= q + 20, B, 1, Q_LEN, KV_LEN,
                                                      device="cpu", BLOCK_SIZE=16))
    plan = bwd.make_plan(query, key, value, out, grad_out, SCORE, MASK, tables, {}, (True,), (BIAS,), True)
    assert plan.grad_buffers == (0,)
    launches = {name: Recorder() for name in ("preprocess", "dkdv", "dq")}
    dq, dk, dv, grads, _ = bwd.run(dataclasses.replace(plan, **launches), query, key, value, out, lse, grad_out,
                                grad_lse, SCORE, (BIAS,), MASK, (BIAS,), tables, 0.25)
    pre, dkdv, dqa = (launches[name].args for name in ("preprocess", "dkdv", "dq"))
    delta = pre[3]
    assert delta.shape == (B, HQ, Q_LEN)
    assert_lands(signatures.BACKWARD_PREPROCESS, {}, pre, {
        "Out": out, "DO": grad_out, "DLSE": grad_lse, "DELTA": delta, "DQ_ACC": delta,
        **strides_of("o", out, "zhmk"), **strides_of("do", grad_out, "zhmk"), **strides_of("dl", grad_lse, "zhm"),
        "stride_dqz": 0, "stride_dqh": 0, "stride_dqm": 0, "HQ": HQ, "Q_LEN": Q_LEN})
    if block_mask:
        q_lists, kv_lists = tables.q.args(), tables.kv.args()
    else:
        q_lists, kv_lists = (lists.args() for lists in plan.dense)
    common = {"Q": query, "K": key, "V": value, "DO": grad_out, "LSE": lse, "DELTA": delta,
              **buffer_values("score_", (BIAS,)), **buffer_values("mask_", (BIAS,)),
              **strides_of("q", query, "zhmk"), **strides_of("k", key, "zhnk"), **strides_of("v", value, "zhnk"),
              **strides_of("do", grad_out, "zhmk"), **strides_of("l", lse, "zhm"),
              "HQ": HQ, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN, "SM_SCALE": 0.25}
    sig = signatures.BACKWARD_DKDV
    assert_lands(sig, backward_hooks(), dkdv, {
        **common, "DK": dk, "DV": dv, **strides_of("dk", dk, "zhnk"), **strides_of("dv", dv, "zhnk"),
        **table_values(q_lists, sig), "HKV": HKV})
    sig = signatures.BACKWARD_DQ
    assert_lands(sig, backward_hooks(), dqa, {
        **common, "DQ": dq, **strides_of("dq", dq, "zhmk"), **table_values(kv_lists, sig),
        "score_G0": grads[0], "score_G0_s0": grads[0].stride(0)})


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("kv_batched", [True, False])
@pytest.mark.parametrize("block_mask", [False, True])
def test_the_hopper_backward_arguments_land_at_their_names(kv_batched, block_mask, ordered):
    """The Gluon backward's arguments (`hopper_args`) of a plan made from permuted CPU tensors
    (``ordered``: deterministic mode's, with the adds' zeroed counts and ranked lists):
    Q, K, V, dO and the float32 dQ accumulator as descriptors of those tensors with their tiles'
    shapes; dK and dV too where they are 16-bit (K/V not broadcast over the batch), else the
    float32 tensors themselves."""
    B, HQ, HKV, Q_LEN, KV_LEN, E = 2, 4, 2, 256, 384, 64
    BKV = B if kv_batched else 1
    bf16 = dict(dtype=torch.bfloat16)
    query = permuted((B, HQ, Q_LEN, E), (2, 0, 1, 3)).to(**bf16)
    key = permuted((BKV, HKV, KV_LEN, E), (1, 2, 0, 3)).to(**bf16)
    value = permuted((BKV, HKV, KV_LEN, E), (2, 1, 0, 3)).to(**bf16)
    out = permuted((B, HQ, Q_LEN, E), (1, 2, 0, 3)).to(**bf16)
    grad_out = permuted((B, HQ, Q_LEN, E), (1, 0, 2, 3)).to(**bf16)
    lse = permuted((B, HQ, Q_LEN), (2, 1, 0))
    tables = None
    if block_mask:
        tables = tables_of(flexattn.create_block_mask(lambda b, h, q, kv: kv <= q + 100, B, 1, Q_LEN, KV_LEN,
                                                      device="cpu", BLOCK_SIZE=128))
    plan = bwd.hopper_plan(query, key, value, SCORE, MASK, tables, {}, False, None, ordered)
    launches = {"preprocess": Recorder(), "main": Recorder()}
    _, dk, dv, _, _ = bwd.run(dataclasses.replace(plan, **launches), query, key, value, out, lse, grad_out, None, SCORE,
                           (BIAS,), MASK, (BIAS,), tables, 0.25)
    # (the launch makes the descriptors of the tensors a call passes in their places)
    pre, args = launches["preprocess"].args, list(plan.main.describe(tuple(launches["main"].args)))
    delta, dq_acc = pre[3], pre[4]
    assert dq_acc.dtype == torch.float32 and dq_acc.shape == query.shape
    sig = signatures.BACKWARD_HOPPER
    if not kv_batched:  # (run returns their sums over the batch)
        dk, dv = args[sig.group("tensors").index("DK")], args[sig.group("tensors").index("DV")]
    assert dk.shape == dv.shape == (B, HKV, KV_LEN, E) and dk.dtype == (torch.bfloat16 if kv_batched else torch.float32)
    m, n = hopper.BWD_BLOCK_M, hopper.BWD_BLOCK_N
    q_tile, kv_tile, out_tile = [1, 1, m, E], [1, 1, n, E], [1, 1, n // 2, E]
    if not block_mask:
        lists = plan.dense.args()
    else:
        lists = (ordered_q_lists(tables, KV_LEN) if ordered else tables.q).args()
    counts = args[sig.group("tensors").index("DQ_SEM")]
    assert counts.dtype == torch.int32 and not counts.any()
    assert counts.numel() == (B * HQ * (Q_LEN // m) if ordered else 1)  # (Q_LEN: whole blocks)
    assert_lands(sig, mod_hooks("gluon"), args, {
        "Q": Descriptor(query, q_tile), "K": Descriptor(key, kv_tile), "V": Descriptor(value, kv_tile),
        "DO": Descriptor(grad_out, q_tile), "DQ_DESC": Descriptor(dq_acc, [1, 1, m, E // 2]), "DQ_SEM": counts,
        "LSE": lse, "DELTA": delta,
        "DK": Descriptor(dk, out_tile) if kv_batched else dk, "DV": Descriptor(dv, out_tile) if kv_batched else dv,
        **table_values(lists, sig), **buffer_values("score_", (BIAS,)), **buffer_values("mask_", (BIAS,)),
        **strides_of("l", lse, "zhm"), **strides_of("dk", dk, "zhn"), **strides_of("dv", dv, "zhn"),
        "HQ": HQ, "HKV": HKV, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN, "BATCH": B, "HEAD_GROUP": plan.sizes[-1],
        "SM_SCALE": 0.25})


@pytest.mark.parametrize("block_mask", [False, True])
def test_the_gluon_dq_pass_arguments_land_at_their_names(block_mask):
    """The Gluon dQ pass's arguments (`hopper_dq_args`, through `run` of a Hopper plan that leaves
    dQ to it) of permuted CPU tensors: Q, K, V, dO and the 16-bit dQ as descriptors of those
    tensors with their tiles' shapes, the forward's KV lists, the LSE, the output and the LSE's
    gradient it computes Delta from, and Delta, which the main kernel then reads."""
    B, HQ, HKV, Q_LEN, KV_LEN, E = 2, 4, 2, 256, 384, 64
    bf16 = dict(dtype=torch.bfloat16)
    query = permuted((B, HQ, Q_LEN, E), (2, 0, 1, 3)).to(**bf16)
    key = permuted((B, HKV, KV_LEN, E), (1, 2, 0, 3)).to(**bf16)
    value = permuted((B, HKV, KV_LEN, E), (2, 1, 0, 3)).to(**bf16)
    out = permuted((B, HQ, Q_LEN, E), (1, 2, 0, 3)).to(**bf16)
    grad_out = permuted((B, HQ, Q_LEN, E), (1, 0, 2, 3)).to(**bf16)
    lse = permuted((B, HQ, Q_LEN), (2, 1, 0))
    dlse = permuted((B, HQ, Q_LEN), (1, 2, 0))
    tables = None
    if block_mask:
        tables = tables_of(flexattn.create_block_mask(lambda b, h, q, kv: kv <= q + 100, B, 1, Q_LEN, KV_LEN,
                                                      device="cpu", BLOCK_SIZE=128))
    dq_plan = bwd.hopper_dq_plan(query, key, value, SCORE, MASK, tables, {}, True)
    dq_launch = Recorder()
    plan = dataclasses.replace(bwd.hopper_plan(query, key, value, SCORE, MASK, tables, {}, True, dq_plan),
                               main=Recorder(), dq_pass=dataclasses.replace(dq_plan, main=dq_launch))
    assert plan.preprocess is None
    dq, *_ = bwd.run(plan, query, key, value, out, lse, grad_out, dlse, SCORE, (BIAS,), MASK, (BIAS,), tables, 0.25)
    sig = signatures.BACKWARD_DQ_HOPPER
    delta = dq_launch.args[sig.group("tensors").index("DELTA")]
    assert delta.shape == (B, HQ, Q_LEN) and delta.is_contiguous() and delta.dtype == torch.float32
    assert plan.main.args[signatures.BACKWARD_HOPPER.group("tensors").index("DELTA")] is delta
    assert dq.dtype == torch.bfloat16 and dq.shape == query.shape and dq.stride() == query.stride()
    m, n = hopper.DQ_BLOCK_M, hopper.DQ_BLOCK_N
    lists = tables.kv.args() if block_mask else dq_plan.dense.args()
    assert_lands(sig, mod_hooks("gluon"), list(dq_plan.main.describe(tuple(dq_launch.args))), {
        "Q": Descriptor(query, [1, 1, m, E]), "K": Descriptor(key, [1, 1, n, E]), "V": Descriptor(value, [1, 1, n, E]),
        "DO": Descriptor(grad_out, [1, 1, m, E]), "DQ": Descriptor(dq, [1, 1, m // 2, E]), "LSE": lse, "DELTA": delta,
        "OUT": out, "DLSE": dlse,
        **table_values(lists, sig), **buffer_values("score_", (BIAS,)), **buffer_values("mask_", (BIAS,)),
        **strides_of("l", lse, "zhm"), **strides_of("o", out, "zhmk"), **strides_of("dl", dlse, "zhm"), "HQ": HQ, "Q_LEN": Q_LEN, "KV_LEN": KV_LEN, "BATCH": B,
        "HEAD_GROUP": dq_plan.sizes[-1],
        "SM_SCALE": 0.25})
