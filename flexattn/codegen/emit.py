"""IR -> Triton source. Pure functions: the same IR always gives the same text.

A mod becomes one ``@triton.jit`` function that kernels call from their hooks:

    def score_mod(score, b, h, q_idx, kv_idx, B0, B0_s0, B0_n0, ...)   -> float tile
    def mask_mod(b, h, q_idx, kv_idx, B0, B0_s0, B0_n0, ...)           -> bool (broadcastable)

Inside a kernel, ``b`` and ``h`` are int32 scalars and ``q_idx`` / ``kv_idx`` are int32 tiles that
broadcast against each other (e.g. [BLOCK_M, 1] and [1, BLOCK_N]); mods are elementwise so any
broadcastable layout works (the backward uses the transposed one). A score mod always returns a
tile of ``score``'s shape and dtype. A mask mod returns a bool value that broadcasts to the tile
(it may be a 0-d tensor, e.g. ``noop_mask``).

Each captured tensor ``i`` of rank ``d`` is passed as ``B{i}`` (pointer), strides ``B{i}_s0..``
and sizes ``B{i}_n0..``; `launch_args` builds the matching host values. Gathers wrap negative
indices and never read outside the buffer (masked loads give 0 / False).

``target`` is "cuda" (libdevice math), "interpret" (Triton's CPU interpreter, which has no
libdevice: the same functions are composed from core ops there) or "gluon" (the CUDA source,
called from the Gluon Hopper template: Gluon tensors carry a layout, so a constant is made with
``gl.full([], ...)`` or ``gl.full_like(score, ...)`` where "cuda" writes ``tl.full``).
"""

from __future__ import annotations

import functools
import keyword
import math
import re
from dataclasses import dataclass

import torch

from flexattn import ir
from flexattn.codegen import affine
from flexattn.codegen.render import template_text
from flexattn.ir import Node

TL_DTYPE = {
    torch.bool: "tl.int1",
    torch.int8: "tl.int8",
    torch.int16: "tl.int16",
    torch.int32: "tl.int32",
    torch.int64: "tl.int64",
    torch.uint8: "tl.uint8",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
}

TARGETS = ("cuda", "interpret", "gluon")
# Single-use values are inlined into their user, but never more than this many levels deep: a
# deeper chain (a 1,000-term sum) continues through temporaries, so the source stays readable and
# far from Python's parser limits (about 200 nested brackets).
MAX_INLINE_DEPTH = 8

# The helper functions shared by all mods of one module live in templates/prelude.py, cut into
# sections at these lines (`prelude` joins the ones a target needs).
_PRELUDE_SECTION = re.compile(r"^# == section (\w+)\n", re.MULTILINE)


@functools.lru_cache(maxsize=None)
def _prelude_sections() -> dict[str, str]:
    """templates/prelude.py's sections by name, each framed by one newline before and after."""
    parts = _PRELUDE_SECTION.split(template_text("prelude"))
    return {name: "\n" + body.strip("\n") + "\n" for name, body in zip(parts[1::2], parts[2::2])}


def prelude(target: str, fast_math: bool = False, exact_sums: bool = False) -> str:
    """Imports and helper functions every module with mods needs (emit once per module).
    ``fast_math`` (CUDA only): float32 tanh is the hardware's approximation (16-bit inputs).
    ``exact_sums``: also `_fa_atomic_add_exact` (`emit_score_grad`'s ``exact`` scatters)."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    head = "import triton\nimport triton.language as tl\n"
    gpu = target != "interpret"
    if gpu:
        head += "from triton.language.extra import libdevice\n"
    if target == "gluon":
        head += "from triton.experimental.gluon import language as gl\n"
    sections = _prelude_sections()
    tanh = sections["tanh_f32_fast" if fast_math and gpu else "tanh_f32_precise"]
    exact = sections["exact_sum"] if exact_sums else ""
    return head + sections["common"] + sections["cuda" if gpu else "interpret"] + tanh + exact


# ---------------------------------------------------------------------------------------------
# The op table: op -> template over operand expressions (a, b, c) and the node (for dtypes).


def pyval(value) -> str:
    """A Python literal Triton's frontend accepts (inf/nan spelled as float())."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and not math.isfinite(value):
        return 'float("nan")' if math.isnan(value) else ('float("inf")' if value > 0 else '-float("inf")')
    return repr(value)


def _lit(value, dtype: torch.dtype) -> str:
    """A Triton expression for a typed constant (bare literals where Triton types them right)."""
    if dtype == torch.float32 and math.isfinite(value):
        return repr(float(value))
    if dtype == torch.int32:
        return str(int(value))
    return f"tl.full([], {pyval(value)}, {TL_DTYPE[dtype]})"


def _fconst(value: float, n: Node) -> str:
    return _lit(value, n.dtype)


def _tanh_name(n: Node) -> str:
    """float32 tanh has its own helper: the fast-math prelude makes it the hardware's tanh.approx."""
    return "_fa_tanh_f32" if n.dtype == torch.float32 else "_fa_tanh"


def _int_divisor(n) -> int | None:
    """The divisor of an integer // or % if it is a constant (the helpers skip the zero guard)."""
    d = n.src[1] if isinstance(n, Node) else None
    return d.arg if d is not None and d.op == "const" else None


def _floordiv(n, a, b):
    if not ir.is_int(n.dtype):
        return f"_fa_floordiv_float({a}, {b})"
    d = _int_divisor(n)
    if d == 0:
        return f"({a} * 0)"  # x // 0 == 0 (docs/dsl.md)
    return f"_fa_floordiv_int_nz({a}, {b})" if d is not None else f"_fa_floordiv_int({a}, {b})"


def _mod(n, a, b):
    if not ir.is_int(n.dtype):
        return f"_fa_mod_float({a}, {b})"
    d = _int_divisor(n)
    if d == 0:
        return f"{a}"  # x % 0 == x
    return f"_fa_mod_int_nz({a}, {b})" if d is not None else f"_fa_mod_int({a}, {b})"


def _pow(n, a, b, node: Node):
    exp = node.src[1]
    if exp.op == "const" and float(exp.arg).is_integer() and 0 <= exp.arg <= 8:
        k = int(exp.arg)
        if k == 0:
            return None  # handled by caller as a constant one
        return "(" + " * ".join([a] * k) + ")"
    if ir.is_int(n.dtype):
        raise NotImplementedError(
            "integer ** needs a constant exponent between 0 and 8 in kernels; cast to float first"
        )
    return f"_fa_pow({a}, {b})"


def _minmax(fn):
    def emit(n, a, b):
        if n.dtype.is_floating_point:
            return f"tl.{fn}({a}, {b}, propagate_nan=tl.PropagateNan.ALL)"
        return f"tl.{fn}({a}, {b})"
    return emit


_BINARY = {
    "add": lambda n, a, b: f"({a} + {b})",
    "sub": lambda n, a, b: f"({a} - {b})",
    "mul": lambda n, a, b: f"({a} * {b})",
    "truediv": lambda n, a, b: f"({a} / {b})",
    "floordiv": _floordiv,
    "mod": _mod,
    "minimum": _minmax("minimum"),
    "maximum": _minmax("maximum"),
    "and_": lambda n, a, b: f"_fa_and({a}, {b})" if n.dtype == torch.bool else f"({a} & {b})",
    "or_": lambda n, a, b: f"_fa_or({a}, {b})" if n.dtype == torch.bool else f"({a} | {b})",
    "xor": lambda n, a, b: f"_fa_xor({a}, {b})" if n.dtype == torch.bool else f"({a} ^ {b})",
    "lshift": lambda n, a, b: f"({a} << {b})",
    "rshift": lambda n, a, b: f"({a} >> {b})",
    "eq": lambda n, a, b: f"({a} == {b})",
    "ne": lambda n, a, b: f"({a} != {b})",
    "lt": lambda n, a, b: f"({a} < {b})",
    "le": lambda n, a, b: f"({a} <= {b})",
    "gt": lambda n, a, b: f"({a} > {b})",
    "ge": lambda n, a, b: f"({a} >= {b})",
}

_UNARY = {
    "neg": lambda n, a: f"(-{a})",
    "detach": lambda n, a: a,
    "abs": lambda n, a: f"tl.abs({a})",
    "not": lambda n, a: f"({a} == 0)",
    "invert": lambda n, a: f"(~{a})",
    "sign": lambda n, a: f"_fa_sign({a})",
    # (floats: NaN stays NaN, as in torch.relu; tl.maximum drops it by default)
    "relu": lambda n, a: _minmax("maximum")(n, a, _fconst(0, n)),
    "floor": lambda n, a: f"tl.floor({a})",
    "ceil": lambda n, a: f"tl.ceil({a})",
    "round": lambda n, a: f"_fa_round({a})",
    "trunc": lambda n, a: f"_fa_trunc({a})",
    "exp": lambda n, a: f"tl.exp({a})",
    "exp2": lambda n, a: f"tl.exp2({a})",
    "expm1": lambda n, a: f"_fa_expm1({a})",
    "log": lambda n, a: f"tl.log({a})",
    "log2": lambda n, a: f"tl.log2({a})",
    "log1p": lambda n, a: f"_fa_log1p({a})",
    "sqrt": lambda n, a: f"tl.sqrt({a})",
    "rsqrt": lambda n, a: f"tl.rsqrt({a})",
    "reciprocal": lambda n, a: f"({_fconst(1.0, n)} / {a})",
    "sin": lambda n, a: f"tl.sin({a})",
    "cos": lambda n, a: f"tl.cos({a})",
    "tan": lambda n, a: f"_fa_tan({a})",
    "tanh": lambda n, a: f"{_tanh_name(n)}({a})",
    # 1 / (1 + exp(-x)) is what tl.sigmoid computes; tl.sigmoid itself is a standard-library jit
    # function, which Triton's interpreter cannot call from generated modules.
    "sigmoid": lambda n, a: f"(1.0 / (1.0 + tl.exp(-{a})))",
    "erf": lambda n, a: f"tl.erf({a})",
    "silu": lambda n, a: f"({a} / (1.0 + tl.exp(-{a})))",
    "gelu": lambda n, a: f"(0.5 * {a} * (1.0 + tl.erf({a} * 0.7071067811865476)))",
    "gelu_tanh": lambda n, a: (f"(0.5 * {a} * (1.0 + {_tanh_name(n)}(0.7978845608028654 * "
                               f"({a} + 0.044715 * {a} * {a} * {a}))))"),
    # torch's softplus (beta=1, threshold=20)
    "softplus": lambda n, a: f"tl.where({a} > 20.0, {a}, _fa_log1p(tl.exp({a})))",
}

# Ops whose template repeats an operand: it must be a name, not an inlined expression.
_REPEATS = {"silu", "gelu", "gelu_tanh", "softplus"}
# Low-precision floats: every op on them is computed in float32 and rounded once.
_LOW = (torch.float16, torch.bfloat16)


def _from_f32(e: str, dtype: torch.dtype) -> str:
    """Round a float32 expression to ``dtype`` (nearest even, like torch)."""
    return f"_fa_to_bf16({e})" if dtype == torch.bfloat16 else f"{e}.to({TL_DTYPE[dtype]})"


def _is_number(e: str) -> bool:
    try:
        float(e)
    except ValueError:
        return False
    return True


class _F32:
    """Stands in for a node in the op templates when a half/bfloat16 op is computed in float32."""

    dtype = torch.float32


@dataclass(frozen=True)
class ModSource:
    """A generated mod: its function source and the buffer parameters after the fixed inputs."""

    name: str
    kind: str
    source: str
    params: tuple[str, ...]
    buffers: tuple[ir.Buffer, ...]
    pre_args: tuple[str, ...] = ()  # values computed once per KV tile (``emit_mod(hoist_kv=True)``)
    affine: bool = False  # the source also defines ``{name}_affine`` (a score mod: see codegen/affine.py)

    def param_list(self, prefix: str) -> str:
        """Kernel-level parameter names (``prefix`` + param), each followed by ", "."""
        return "".join(f"{prefix}{p}, " for p in self.params)

    def pre_arg_list(self) -> str:
        """The names `pre_call` binds, each followed by ", " (arguments of the mod after kv_idx)."""
        return "".join(f"{a}, " for a in self.pre_args)

    def pre_call(self, prefix: str) -> str:
        """The statement a kernel runs once per KV tile to bind `pre_args` (``pass`` without them);
        ``prefix`` as in `param_list`."""
        if not self.pre_args:
            return "pass"
        return f"{', '.join(self.pre_args)} = {self.name}_kv(b, h, kv_idx, {self.param_list(prefix)})"


def buffer_params(buffers: list[ir.Buffer]) -> list[str]:
    out = []
    for buf in buffers:
        out.append(f"B{buf.index}")
        out += [f"B{buf.index}_s{d}" for d in range(buf.ndim)]
        out += [f"B{buf.index}_n{d}" for d in range(buf.ndim)]
    return out


def launch_args(buffers: list[ir.Buffer] | tuple, tensors) -> list:
    """Host values for `buffer_params`: pointer, strides, sizes of each captured tensor."""
    out = []
    for buf in buffers:
        t = tensors[buf.index]
        out.append(t)
        out += list(t.stride())
        out += list(t.shape)
    return out


def _axes(order: list[Node]) -> dict[int, frozenset]:
    """Which tile axes each value varies along: 'm' (query rows), 'n' (KV columns)."""
    axes: dict[int, frozenset] = {}
    base = {"score": frozenset("mn"), "q_idx": frozenset("m"), "kv_idx": frozenset("n")}
    for n in order:
        if n.op == "input":
            axes[id(n)] = base.get(n.arg, frozenset())
        else:
            axes[id(n)] = frozenset().union(*(axes[id(s)] for s in n.src)) if n.src else frozenset()
    return axes


def _kv_invariant_values(root: Node) -> list[Node]:
    """The values of a mask that a kernel walking query tiles against one KV tile can compute once
    per KV tile: those that read a captured tensor and vary along no axis but the KV one
    (``doc[kv_idx]``, ``slope[h]``), outermost only (what the rest of the mask reads)."""
    order = ir.toposort(root)
    axes = _axes(order)
    loads: set[int] = set()
    for n in order:
        if n.op == "load" or any(id(s) in loads for s in n.src):
            loads.add(id(n))
    hoist = {id(n) for n in order if id(n) in loads and axes[id(n)] <= frozenset("n")}
    read_by_rest = {id(s) for n in order if id(n) not in hoist for s in n.src}
    return [n for n in order if id(n) in hoist and (id(n) in read_by_rest or n is root)]


def emit_mod(root: Node, kind: str, name: str | None = None, target: str = "cuda",
             hoist_kv: bool = False) -> ModSource:
    """Emit the ``@triton.jit`` function for a score or mask mod.

    ``hoist_kv`` (mask mods): the values `_kv_invariant_values` finds are computed by a second
    function, ``{name}_kv(b, h, kv_idx, <buffers>)``, which a kernel calls once per KV tile; the
    mod takes them as parameters ``ModSource.pre_args`` after kv_idx (the source defines both)."""
    if kind not in ("score", "mask"):
        raise ValueError(f"kind must be 'score' or 'mask', got {kind!r}")
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if kind == "mask" and root.dtype != torch.bool:
        raise TypeError(f"a mask mod must return bool, this one returns {ir.dtype_name(root.dtype)}")
    name = name or f"{kind}_mod"
    _check_name(name)
    buffers = ir.buffers_of(root)
    params = buffer_params(buffers)
    pre_src, pre_args, bound = "", (), {}
    if hoist_kv and kind == "mask":
        hoisted = _kv_invariant_values(root)
        pre_args = tuple(f"{name}_kv{k}" for k in range(len(hoisted)))
        bound = {id(n): a for n, a in zip(hoisted, pre_args)}
        if hoisted:
            pre_src = _emit_function(hoisted, f"{name}_kv", ["b", "h", "kv_idx"] + params)
    lines, expr, _, axes = _emit_values([root], kind, bound)
    form = affine.split(root) if kind == "score" else None
    if form is not None:
        pre_src += _emit_function(list(form.nodes()), f"{name}_affine", ["b", "h"] + params, float32=True)

    result = expr[id(root)]
    if kind == "score":
        # A value that does not vary along both tile axes (a constant, slope[h], q_idx * 0.5) is
        # broadcast to score's shape, keeping the IR's dtype. (tl.full: tl.zeros_like is itself a
        # jit function, which the interpreter cannot call from a nested jit function.)
        if root.op == "const":
            result = f"tl.full(score.shape, {pyval(root.arg)}, {TL_DTYPE[root.dtype]})"
        elif axes[id(root)] != frozenset("mn"):
            result = f"({result} + tl.full(score.shape, 0, {TL_DTYPE[root.dtype]}))"
    elif root.op == "const":
        result = f"tl.full([], {1 if root.arg else 0}, tl.int1)"
    elif target == "interpret" and axes[id(root)] != frozenset("mn"):
        # A mask that does not vary along both axes (b == 0, q_idx < 5) is made a full tile: the
        # interpreter cannot combine a bool scalar or row with the kernel's bool tiles (`& inside`).
        result = f"(({result}).to(tl.int8) + (q_idx * 0 + kv_idx * 0).to(tl.int8) != 0)"

    head = ["score"] if kind == "score" else []
    sig = ", ".join(head + list(ir.INDEX_INPUTS) + list(pre_args) + params)
    body = "\n".join(f"    {line}" for line in lines + [f"return {result}"])
    src = f"{pre_src}@triton.jit\ndef {name}({sig}):\n{body}\n"
    if target == "gluon":
        src = _gluon_constants(src)
    return ModSource(name, kind, src, tuple(params), tuple(buffers), pre_args, form is not None)


def _emit_function(roots: list[Node], name: str, params: list[str], float32: bool = False) -> str:
    """``@triton.jit def {name}(<params>)`` returning the values of ``roots`` (which must not read
    the score), as float32 scalars with ``float32``."""
    lines, expr, _, _ = _emit_values(roots, "mask")  # ("mask": reading the score is an error)
    values = []
    for n in roots:
        e = expr[id(n)]
        if float32 and n.op == "const":
            e = f"tl.full([], {pyval(n.arg)}, tl.float32)"
        elif float32 and n.dtype != torch.float32:
            e = f"{e}.to(tl.float32)"
        values.append(e)
    body = "\n".join(f"    {line}" for line in lines + [f"return {', '.join(values)}"])
    return f"@triton.jit\ndef {name}({', '.join(params)}):\n{body}\n\n\n"


_TILE_FULL = re.compile(r"tl\.full\(score\.shape, ([^,]+), (tl\.\w+)\)")


def _gluon_constants(src: str) -> str:
    """The "gluon" spelling of the two constant forms the emitter writes: a 0-d ``tl.full([], v,
    dt)`` and a score-shaped ``tl.full(score.shape, v, dt)`` (Gluon's full needs a layout, which
    a 0-d constant does not have and full_like takes from the score tile)."""
    src = _TILE_FULL.sub(r"gl.full_like(score, \1, dtype=\2)", src)
    return src.replace("tl.full([], ", "gl.full([], ")


def _check_name(name: str) -> None:
    # The name becomes a `def` in generated source: only plain identifiers get there.
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or not name.isascii():
        raise ValueError(f"a generated function name must be an ASCII Python identifier, got {name!r}")


def _emit_values(roots: list[Node], kind: str, bound: dict[int, str] | None = None):
    """Triton lines computing every node of ``roots`` (shared nodes once): (lines, expr, as_name, axes).

    ``expr[id(node)]`` is each node's expression (a name once it was needed more than once);
    ``as_name(node)`` binds a node's expression to a temporary and returns the name. ``bound``:
    nodes (by id) that are already computed, under these names (their operands are not emitted).
    """
    bound = bound or {}
    order = ir.toposort(roots)
    axes = _axes(order)
    if bound:
        order = ir.toposort(roots, stop=set(bound))
    uses: dict[int, int] = {}
    for n in order:
        if id(n) in bound:
            continue
        for s in n.src:
            uses[id(s)] = uses.get(id(s), 0) + 1

    v = _Values()
    for n in order:
        if id(n) in bound:
            v.expr[id(n)] = bound[id(n)]
            v.depth[id(n)] = 0
            continue
        v.expr[id(n)] = _emit_node(n, kind, v)
        v.depth[id(n)] = 1 + max((v.depth[id(s)] for s in n.src), default=0)
        # Values used more than once get a name; single-use ones stay inline, to a bounded depth.
        if n.op not in ("input", "const") and (uses.get(id(n), 0) > 1 or v.depth[id(n)] >= MAX_INLINE_DEPTH):
            v.as_name(n)
    return v.lines, v.expr, v.as_name, axes


class _Values:
    """What `_emit_values` has written so far: its lines and each node's expression (by id)."""

    def __init__(self):
        self.lines: list[str] = []
        self.expr: dict[int, str] = {}
        self.depth: dict[int, int] = {}  # how deep each node's inline expression nests others' (names: 0)
        self.count = 0

    def fresh(self, prefix: str = "t") -> str:
        self.count += 1
        return f"{prefix}{self.count - 1}"

    def as_name(self, n: Node) -> str:
        """Bind ``n``'s expression to a temporary (once) and return its name."""
        e = self.expr[id(n)]
        if e.isidentifier():
            return e
        name = self.bind(e)
        self.expr[id(n)] = name
        self.depth[id(n)] = 0
        return name

    def bind(self, e: str) -> str:
        """``e`` as a name (for templates that repeat an operand)."""
        if e.isidentifier():
            return e
        name = self.fresh()
        self.lines.append(f"{name} = {e}")
        return name

    def up(self, s: Node) -> str:
        """``s``'s expression, in float32 if it is half/bfloat16 (constants: the exact value)."""
        if s.dtype not in _LOW:
            return self.expr[id(s)]
        if s.op == "const":
            return _lit(float(torch.tensor(s.arg, dtype=s.dtype).item()), torch.float32)
        return f"{self.expr[id(s)]}.to(tl.float32)"


def _emit_node(n: Node, kind: str, v: _Values) -> str:
    """The expression of ``n`` over its operands' (lines it needs first go to ``v.lines``)."""
    op = n.op
    if op == "input":
        if kind == "mask" and n.arg == "score":
            raise TypeError("a mask mod cannot read the score")
        return n.arg
    if op == "const":
        return _lit(n.arg, n.dtype)
    if op == "load":
        idx = [v.as_name(s) if s.op != "const" else v.expr[id(s)] for s in n.src]
        return _emit_load(n, idx, v.lines, v.fresh, [_non_negative(s) for s in n.src])
    if op == "cast":
        return _emit_cast(n, v)
    if op == "where":
        c, a, b = (v.expr[id(s)] for s in n.src)
        return f"tl.where({c}, {a}, {b})"
    if op in _UNARY or op in _BINARY or op == "pow":
        return _emit_arith(n, v)
    raise NotImplementedError(f"no Triton emitter for op {op!r}")


def _emit_cast(n: Node, v: _Values) -> str:
    s = n.src[0]
    if n.dtype == torch.bool:
        return f"({v.up(s)} != 0)"
    if s.dtype in _LOW or n.dtype in _LOW:
        # Via float32, as torch converts to and from half/bfloat16 (and the interpreter has no
        # bfloat16 conversions of its own).
        e = v.up(s)
        if s.dtype not in _LOW and s.dtype != torch.float32:
            e = f"{e}.to(tl.float32)"
        return _from_f32(e, n.dtype) if n.dtype != torch.float32 else e
    return f"{v.expr[id(s)]}.to({TL_DTYPE[n.dtype]})"


def _emit_arith(n: Node, v: _Values) -> str:
    """A unary or binary op from the op table, or pow. Half/bfloat16 operands are computed in
    float32 and the result rounded once, which is what torch does (and the interpreter has no
    bfloat16 arithmetic at all)."""
    op = n.op
    low = n.src[0].dtype in _LOW
    cn = _F32 if low else n
    args = [v.up(s) for s in n.src]
    if op == "pow":  # _fa_pow needs tensors, not Python literals
        args = [f"tl.full([], {a}, {TL_DTYPE[cn.dtype]})" if _is_number(a) else a for a in args]
    if op in _REPEATS or op == "pow":
        args[0] = v.bind(args[0])
    if op == "pow":
        e = _pow(cn, args[0], args[1], n)
        if e is None:
            e = f"tl.full([], 1, {TL_DTYPE[cn.dtype]})"  # x ** 0 == 1, even for nan
    elif op in _UNARY:
        e = _UNARY[op](cn, args[0])
    else:
        e = _BINARY[op](cn, args[0], args[1])
    return _from_f32(e, n.dtype) if low and n.dtype in _LOW else e


def _non_negative(n: Node) -> bool:
    """Whether index ``n`` is never negative: b, h, q_idx and kv_idx are not, in any kernel (padding
    rows and columns included)."""
    return n.op == "input"


def _emit_load(n: Node, idx: list[str], lines: list[str], fresh, non_negative: list[bool]) -> str:
    buf: ir.Buffer = n.arg
    if buf.ndim == 0:
        return f"tl.load(B{buf.index})"
    ptr, m = _emit_address(buf, idx, lines, fresh, non_negative=non_negative)
    return f"tl.load({ptr}, mask={m}, other=0)"


def _emit_address(buf: ir.Buffer, idx: list[str], lines: list[str], fresh, base: str | None = None,
                  non_negative: list[bool] | None = None):
    """(pointer, bounds-mask name) of element ``idx`` of ``buf``: negative indices wrap.

    ``base`` names another tensor of the same shape (its own strides ``{base}_s{d}``), e.g. the
    gradient buffer that the backward scatters into at the address the forward gathered from.
    ``non_negative[d]``: index ``d`` is never negative, so it needs no wrap and only the upper
    bound (a gather of ``doc[kv_idx]``: a compare per element where the wrap takes four).
    """
    p = f"B{buf.index}"
    base = base or p
    offs, masks = [], []
    for d, i in enumerate(idx):
        size = f"{p}_n{d}"
        if non_negative is not None and non_negative[d]:
            v = i
            masks.append(f"({v} < {size})")
        else:
            v = fresh("i")
            lines.append(f"{v} = tl.where({i} < 0, {i} + {size}, {i})")
            masks.append(f"(({v} >= 0) & ({v} < {size}))")
        offs.append(f"{v}.to(tl.int64) * {base}_s{d}")
    m = fresh("m")
    if len(masks) > 1:
        # Dimensions combine as int8 (free on GPU): Triton's interpreter cannot broadcast a bool
        # scalar (an index from b, h or a 0-d load) into a bool tile (one from q_idx).
        lines.append(f"{m} = ({' & '.join(x + '.to(tl.int8)' for x in masks)}) != 0")
    else:
        lines.append(f"{m} = {masks[0]}")
    return f"{base} + {' + '.join(offs)}", m


def emit_score_grad(d_score: Node, scatters=(), name: str = "score_mod_grad", target: str = "cuda",
                    q_axis: int = 0, exact: bool = False) -> ModSource:
    """Emit the backward twin of a score mod from its symbolic derivative (`flexattn.autodiff`):

        def score_mod_grad(score, b, h, q_idx, kv_idx, grad, valid, <buffers>, <grad buffers>)

    ``grad`` is d(loss)/d(mod output) as a tile and ``valid`` a bool mask broadcastable to it. It
    returns ``where(valid, grad * d_score, 0)`` (d_score is the IR of d(out)/d(score)) and, for each
    ``(load, d_load)`` in ``scatters``, atomically adds ``where(valid, grad * d_load, 0)`` into
    ``G{i}`` — the gradient buffer of captured tensor ``i`` (same shape; its strides are passed as
    ``G{i}_s{d}``, its sizes are ``B{i}``'s) — at the element the load read, with the load's
    wrapping and bounds mask (out-of-range reads read 0 and send nothing back). Where the address
    does not vary along a tile axis (``slope[h]``, ``bias[q_idx]``), the tile is summed along that
    axis first: one atomic per distinct address, not one per lane. ``q_axis`` is the tile axis
    q_idx varies along (0 for [BLOCK_M, BLOCK_N] tiles, 1 for the transposed ones). ``exact``: the
    adds are the prelude's ``_fa_atomic_add_exact`` into ``G{i}``'s exact sums (int64 [*shape, 3],
    `prelude(exact_sums=True)`), whose result no order of the adds changes.
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if q_axis not in (0, 1):
        raise ValueError(f"q_axis must be 0 or 1, got {q_axis!r}")
    scatters = list(scatters)
    roots = [d_score] + [d for _, d in scatters] + [i for load, _ in scatters for i in load.src]
    lines, expr, as_name, axes = _emit_values(roots, "score")
    counter = [0]

    def fresh(prefix: str = "g") -> str:
        counter[0] += 1
        return f"g{prefix}{counter[0] - 1}"

    tile_axis = {"m": q_axis, "n": 1 - q_axis}
    for load, d_load in scatters:
        buf: ir.Buffer = load.arg
        g = f"G{buf.index}"
        val = fresh("v")
        dv = expr[id(d_load)]
        scaled = "grad" if d_load.op == "const" and d_load.arg == 1.0 else f"grad * {dv}"
        lines.append(f"{val} = tl.where(valid, {scaled}, 0.0)")
        if buf.ndim == 0:
            total = _sum_all(val)
            lines.append(f"_fa_atomic_add_exact({g}, {total}, True)" if exact
                         else f"tl.atomic_add({g}, {total}.to({g}.dtype.element_ty))")
            continue
        idx = [as_name(s) if s.op != "const" else expr[id(s)] for s in load.src]
        ptr, mask = _emit_address(buf, idx, lines, fresh, base=g, non_negative=[_non_negative(s) for s in load.src])
        varies = frozenset().union(*(axes[id(s)] for s in load.src))
        summed = sorted(tile_axis[a] for a in "mn" if a not in varies)
        if len(summed) == 2:
            total = _sum_all(val)
        elif len(summed) == 1:
            total = f"tl.reduce({val}, {summed[0]}, tl.standard._sum_combine, keep_dims=True)"
        else:
            total = val
            mask = f"{mask} & valid"
        lines.append(f"_fa_atomic_add_exact({ptr}, {total}, {mask})" if exact
                     else f"tl.atomic_add({ptr}, {total}.to({g}.dtype.element_ty), mask={mask})")

    ds = expr[id(d_score)]
    result = "grad" if d_score.op == "const" and d_score.arg == 1.0 else f"grad * {ds}"
    buffers = {b.index: b for b in ir.buffers_of(roots)}
    buffers.update({load.arg.index: load.arg for load, _ in scatters})
    buffers = [buffers[i] for i in sorted(buffers)]
    grads = {load.arg.index: load.arg for load, _ in scatters}
    params = buffer_params(buffers)
    for i in sorted(grads):
        params += [f"G{i}"] + [f"G{i}_s{d}" for d in range(grads[i].ndim)]
    sig = ", ".join(["score", *ir.INDEX_INPUTS, "grad", "valid", *params])
    body = "\n".join(f"    {line}" for line in lines + [f"return tl.where(valid, {result}, 0.0)"])
    src = f"@triton.jit\ndef {name}({sig}):\n{body}\n"
    if target == "gluon":
        src = _gluon_constants(src)
    return ModSource(name, "score", src, tuple(params), tuple(buffers))


def _sum_all(tile: str) -> str:
    # tl.reduce with the standard combine function rather than tl.sum: Triton's interpreter cannot
    # call standard-library jit functions from generated modules (see templates/forward.py).
    return f"tl.reduce(tl.reduce({tile}, 1, tl.standard._sum_combine), 0, tl.standard._sum_combine)"


def grad_launch_args(grads, exact: bool = False) -> list:
    """Host values for the ``G{i}, G{i}_s{d}...`` parameters: ``grads`` maps buffer index -> tensor
    (``exact``: its exact sums, [*shape, 3], whose element strides are the leading ones)."""
    out = []
    for i in sorted(grads):
        strides = grads[i].stride()
        out.append(grads[i])
        out += list(strides[:-1] if exact else strides)
    return out
