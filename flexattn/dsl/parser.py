"""DSL text -> IR. A Lark LALR parser (grammar.lark) and a Transformer that calls the IR builders.

The text is never evaluated by Python: every name is looked up in a fixed table (the mod's inputs,
constants, functions, `let` names and keyword bindings), every operator goes through `flexattn.ir`,
so PyTorch's type promotion applies exactly as it does to a traced Python mod.

Literals stay Python numbers until they meet an IR value, so they promote as weak scalars just as
Python constants do in a traced mod (``q_idx - 4`` stays int32, ``score * 0.5`` keeps the score's
dtype). An operator between two literals is computed by Python, as it would be in a Python mod.
"""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from lark import Lark, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken, VisitError
from lark.lark import PostLex
from lark.visitors import Transformer_NonRecursive

from flexattn import ir
from flexattn.ir import Node
from flexattn.mods import Mod
from flexattn.tracer import trace

Value = Any  # an ir.Node or a Python bool/int/float literal

# Limits (docs/limits.md). Deeper texts are refused with a DSLError rather than a RecursionError;
# nothing in the DSL path recurses, so this bounds work, not the Python stack.
MAX_NESTING = 2000  # parse-tree depth: operators and calls nested in one another
MAX_LITERAL_CHARS = 100  # characters in one number literal
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class DSLError(ValueError):
    """A DSL text that does not parse or has no meaning; says where, with a caret under it.

    Attributes: ``message`` (what is wrong), ``line`` and ``column`` (1-based, or None), ``context``
    (the offending line with carets), ``hint`` (what to do, may be empty).
    """

    def __init__(self, message: str, line: int | None = None, column: int | None = None,
                 context: str = "", hint: str = ""):
        self.message, self.line, self.column, self.context, self.hint = message, line, column, context, hint
        text = message
        if line is not None:
            text += f" at line {line}, column {column}:\n\n{context.rstrip()}\n"
        if hint:
            text += ("\n" if line is None else "") + hint
        super().__init__(text)


# ---------------------------------------------------------------------------------------------
# The parser


class _DropNewlinesInBrackets(PostLex):
    """Newlines end statements, except inside () and [] (implicit line joining, as in Python)."""

    always_accept = ("_NL",)

    def process(self, stream):
        depth = 0
        for tok in stream:
            if tok.type in ("LPAR", "LSQB"):
                depth += 1
            elif tok.type in ("RPAR", "RSQB"):
                depth = max(depth - 1, 0)
            elif tok.type == "_NL" and depth:
                continue
            yield tok


_PARSER: Lark | None = None


def _parser() -> Lark:
    global _PARSER
    if _PARSER is None:
        _PARSER = Lark.open_from_package(
            "flexattn.dsl", "grammar.lark", parser="lalr", postlex=_DropNewlinesInBrackets(),
            propagate_positions=True, maybe_placeholders=True,
        )
    return _PARSER


# ---------------------------------------------------------------------------------------------
# Names the text can use

CONSTANTS: dict[str, Value] = {"True": True, "False": False, "inf": math.inf, "nan": math.nan}
KEYWORDS = ("and", "or", "not", "if", "else", "let")


@dataclass(frozen=True)
class Function:
    """A built-in function: ``arity`` is (min, max) argument count (max None: any)."""

    name: str
    arity: tuple[int, int | None]
    build: Callable[..., Value]
    signature: str


def _cast_fn(dtype: torch.dtype) -> Callable[[Value], Value]:
    def build(x):
        # A cast of a literal is a typed constant (``int32(5)``, as the IR printer writes them).
        return ir.const(x, dtype) if not isinstance(x, Node) else ir.cast(x, dtype)
    return build


def _fold_left(op: str) -> Callable[..., Node]:
    def build(*xs):
        out = xs[0]
        for x in xs[1:]:
            out = ir.binary(op, out, x)
        return out
    return build


def _builtin_functions() -> dict[str, Function]:
    fns: dict[str, Function] = {}
    for op in ir.UNARY_OPS:
        if op != "not":  # a keyword; `not x` / `~x`
            fns[op] = Function(op, (1, 1), lambda x, op=op: ir.unary(op, x), f"{op}(x)")
    for op in ("minimum", "maximum"):
        fns[op] = Function(op, (2, 2), lambda a, b, op=op: ir.binary(op, a, b), f"{op}(a, b)")
    fns["min"] = Function("min", (2, None), _fold_left("minimum"), "min(a, b, ...)")
    fns["max"] = Function("max", (2, None), _fold_left("maximum"), "max(a, b, ...)")
    fns["pow"] = Function("pow", (2, 2), lambda a, b: _binary("pow", a, b), "pow(a, b)")
    fns["clamp"] = Function("clamp", (3, 3), ir.clamp, "clamp(x, lo, hi)")
    fns["where"] = Function("where", (3, 3), ir.where, "where(cond, a, b)")
    for name, dtype in ir.DTYPES.items():
        fns[name] = Function(name, (1, 1), _cast_fn(dtype), f"{name}(x)")
    return fns


FUNCTIONS: dict[str, Function] = _builtin_functions()
RESERVED = set(CONSTANTS) | set(KEYWORDS) | set(FUNCTIONS) | set(ir.SCORE_INPUTS)


def _is_literal(x: Value) -> bool:
    return isinstance(x, (bool, int, float))


def _dtype_of(x: Value) -> str:
    if isinstance(x, Node):
        return ir.dtype_name(x.dtype)
    return f"a Python {type(x).__name__} literal"


def _is_bool(x: Value) -> bool:
    return isinstance(x, bool) or (isinstance(x, Node) and x.dtype == torch.bool)


# ---------------------------------------------------------------------------------------------
# Bindings: what keyword arguments mean in the text


@dataclass
class _Scope:
    """Everything a name can mean while one text is parsed, and the tensors it captures."""

    kind: str | None
    score_dtype: torch.dtype
    bindings: dict[str, Any]
    lets: dict[str, tuple[Value, int]] = field(default_factory=dict)  # name -> (value, line)
    tensors: list[torch.Tensor] = field(default_factory=list)
    tensor_names: list[str] = field(default_factory=list)
    mods: dict[str, Any] = field(default_factory=dict)  # binding name -> flexattn Mod (traced lazily)

    @property
    def inputs(self) -> tuple[str, ...]:
        return ir.INDEX_INPUTS if self.kind == "mask" else ir.SCORE_INPUTS

    def known_names(self) -> list[str]:
        return list(self.inputs) + list(self.bindings) + list(self.lets)

    def buffer(self, name: str, tensor: torch.Tensor) -> ir.Buffer:
        """The Buffer for a captured tensor (one per tensor object, indices by first capture)."""
        for i, t in enumerate(self.tensors):
            if t is tensor:
                return ir.Buffer(i, self.tensor_names[i], tensor.dtype, tensor.dim())
        self.tensors.append(tensor)
        self.tensor_names.append(name)
        return ir.Buffer(len(self.tensors) - 1, name, tensor.dtype, tensor.dim())


def _check_bindings(bindings: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, value in bindings.items():
        if not name.isidentifier():
            raise DSLError(f"binding name {name!r} is not an identifier")
        if name in RESERVED:
            what = ("an input of the mod" if name in ir.SCORE_INPUTS else "a keyword" if name in KEYWORDS
                    else "a constant" if name in CONSTANTS else "a built-in function")
            raise DSLError(f"binding {name!r} would hide {what} of the same name; pick another name")
        if isinstance(value, torch.Tensor):
            if value.dtype not in ir.DTYPE_NAMES:
                raise DSLError(
                    f"binding {name!r} is a tensor of dtype {value.dtype}; mods can capture tensors of "
                    f"dtype {', '.join(ir.DTYPES)}"
                )
        elif isinstance(value, numbers.Number) and not isinstance(value, (bool, int, float)):
            if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
                raise DSLError(f"binding {name!r} is the complex number {value!r}; mods use real numbers")
            value = value.item() if hasattr(value, "item") else float(value)  # numpy scalars etc.
        elif not isinstance(value, (bool, int, float)) and not callable(value):
            raise DSLError(
                f"binding {name!r} must be a tensor, a Python number or a mod (a flexattn Mod or a "
                f"Python function), got {type(value).__name__}"
            )
        out[name] = value
    return out


# ---------------------------------------------------------------------------------------------
# Parse tree -> IR


class _Error(Exception):
    """A semantic error at ``pos`` (a Token or a tree Meta); becomes a DSLError with context."""

    def __init__(self, message: str, pos: Any, hint: str = ""):
        super().__init__(message)
        self.message, self.pos, self.hint = message, pos, hint


_PY_BINARY: dict[str, Callable] = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow,
    "and_": operator.and_, "or_": operator.or_, "xor": operator.xor,
    "lshift": operator.lshift, "rshift": operator.rshift,
    "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
    "gt": operator.gt, "ge": operator.ge,
}
_COMPARE = {"==": "eq", "!=": "ne", "<": "lt", "<=": "le", ">": "gt", ">=": "ge"}
_SYMBOL = {op: sym for sym, op in _COMPARE.items()} | {
    "add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%", "pow": "**",
    "and_": "&", "or_": "|", "xor": "^", "lshift": "<<", "rshift": ">>"}


def _fold_literals(op: str, a: Value, b: Value) -> Value:
    """``a op b`` for two literals, computed by Python as in a Python mod, within int64.

    Integer results must stay in int64 (an intermediate may reach 2**63, the magnitude of the
    int64 minimum); a power or shift that would leave it is refused before it is computed, so
    ``9 ** 9 ** 9`` costs nothing. Raises _Error (positioned by the caller) on overflow and on
    division by zero, which Python raises for the same constant in a Python mod.
    """
    ints = isinstance(a, int) and isinstance(b, int)
    if ints and op == "pow" and b > 0 and abs(a) > 1 and (abs(a).bit_length() - 1) * b > 64:
        raise _Error(f"integer constant {a} ** {b} overflows int64", None)
    if ints and op in ("lshift", "rshift") and b < 0:
        raise _Error(f"negative shift count in the constant {a} {'<<' if op == 'lshift' else '>>'} {b}", None)
    if ints and op == "lshift" and a != 0 and b > 64:
        raise _Error(f"integer constant {a} << {b} overflows int64", None)
    try:
        out = _PY_BINARY[op](a, b)
    except ZeroDivisionError:
        raise _Error(f"division by zero in the constant expression {a!r} {_SYMBOL[op]} {b!r}", None) from None
    except OverflowError:
        raise _Error(f"the constant expression {a!r} {_SYMBOL[op]} {b!r} overflows a float", None) from None
    if isinstance(out, int) and not isinstance(out, bool) and not INT64_MIN <= out <= 2**63:
        raise _Error(f"integer constant {a} {_SYMBOL[op]} {b} = {_short(out)} overflows int64", None)
    if isinstance(out, (bool, int, float)):
        return out
    return ir.binary(op, a, b)  # e.g. (-8.0) ** 0.5 is complex in Python: torch's NaN


def _short(n: int) -> str:
    text = str(n) if n.bit_length() < 200 else f"an integer of {n.bit_length()} bits"
    return text if len(text) <= 40 else text[:20] + "..." + text[-8:]


def _binary(op: str, a: Value, b: Value) -> Value:
    if _is_literal(a) and _is_literal(b):
        # Python computes constant subexpressions of a Python mod before torch sees them.
        return _fold_literals(op, a, b)
    return ir.binary(op, a, b)


def _binary_rule(op: str):
    def rule(self, meta, a, b):
        try:
            return _binary(op, a, b)
        except _Error as e:
            e.pos = e.pos or meta
            raise
    rule.__name__ = op
    rule.__doc__ = f"a {op} b"
    return rule


@v_args(inline=True, meta=True)
class _ToIR(Transformer_NonRecursive):
    """Builds IR bottom-up; each method is one grammar rule (aliases are IR op names)."""

    def __init__(self, scope: _Scope):
        super().__init__(visit_tokens=False)
        self.scope = scope

    # -- literals and names
    def int_literal(self, meta, tok):
        digits = str(tok).lstrip("0") or "0"
        if len(tok) > 1 and str(tok)[0] == "0" and digits != "0":
            # Python refuses 010 (not octal 8, not decimal 10): so does the DSL.
            raise _Error(f"integer literal {_clip(tok)} has leading zeros", tok,
                         "write it without them (for hexadecimal use 0x...)")
        if len(digits) > 19 or int(digits) > 2**63:  # 2**63: the magnitude of int64's minimum
            raise _Error(f"integer literal {_clip(tok)} does not fit in int64 (at most {INT64_MAX})", tok)
        return int(digits)

    def hex_literal(self, meta, tok):
        digits = str(tok)[2:].lstrip("0") or "0"
        if len(digits) > 16 or int(digits, 16) > 2**63:
            raise _Error(f"integer literal {_clip(tok)} does not fit in int64 (at most {INT64_MAX:#x})", tok)
        return int(digits, 16)

    def float_literal(self, meta, tok):
        if len(tok) > MAX_LITERAL_CHARS:
            raise _Error(f"number literal {_clip(tok)} is longer than {MAX_LITERAL_CHARS} characters", tok)
        return float(tok)

    def __default__(self, data, children, meta):
        raise _Error(f"unsupported construct '{data}'", meta)

    def name(self, meta, tok):
        scope, name = self.scope, str(tok)
        if name in scope.lets:
            return scope.lets[name][0]
        if name in scope.inputs:
            return ir.input_(name, scope.score_dtype if name == "score" else None)
        if name in CONSTANTS:
            return CONSTANTS[name]
        if name in scope.bindings:
            value = scope.bindings[name]
            if isinstance(value, torch.Tensor):
                if value.dim() != 0:
                    idx = ", ".join("i j k l m n".split()[: value.dim()])
                    raise _Error(f"'{name}' is a {value.dim()}-d tensor and must be indexed", tok,
                                 f"read one element, e.g. {name}[{idx}]")
                return ir.load(scope.buffer(name, value), [])
            if isinstance(value, (bool, int, float)):
                return value
            raise _Error(f"'{name}' is a mod and must be called", tok, self._mod_hint(name))
        if name in FUNCTIONS:
            raise _Error(f"'{name}' is a function and must be called", tok,
                         f"call it like {FUNCTIONS[name].signature}")
        raise self._unknown(tok)

    def _unknown(self, tok) -> _Error:
        scope, name = self.scope, str(tok)
        if name == "score" and scope.kind == "mask":
            return _Error("a mask mod has no 'score'", tok, "mask mods see only b, h, q_idx, kv_idx; "
                          "use a score mod to change scores")
        known = scope.known_names()
        hint = f"known names: {', '.join(known)}\nconstants: {', '.join(CONSTANTS)}\n" \
               f"functions: {', '.join(sorted(FUNCTIONS))}"
        close = difflib.get_close_matches(name, known + list(FUNCTIONS), n=1)
        if close:
            hint = f"did you mean '{close[0]}'?\n" + hint
        return _Error(f"unknown name '{name}'", tok, hint)

    def _mod_hint(self, name: str) -> str:
        value = self.scope.bindings[name]
        args = "score, b, h, q_idx, kv_idx" if getattr(value, "kind", None) == "score" else "b, h, q_idx, kv_idx"
        return f"call it like {name}({args})"

    # -- gathers and calls
    def indices(self, meta, *xs):
        return list(xs)

    def args(self, meta, *xs):
        return list(xs)

    def load(self, meta, tok, *index_lists):
        name = str(tok)
        value = self.scope.bindings.get(name)
        if not isinstance(value, torch.Tensor):
            if name in self.scope.known_names() or name in FUNCTIONS or name in CONSTANTS:
                raise _Error(f"'{name}' cannot be indexed", tok,
                             "only tensors bound by keyword (e.g. bias=torch.randn(H)) can be indexed")
            raise self._unknown(tok)
        indices = [i for idx in index_lists for i in idx]
        return ir.load(self.scope.buffer(name, value), indices)

    def call(self, meta, tok, args):
        name, args = str(tok), args or []
        if name in FUNCTIONS and name not in self.scope.lets:
            fn = FUNCTIONS[name]
            lo, hi = fn.arity
            if len(args) < lo or (hi is not None and len(args) > hi):
                want = f"{lo}" if lo == hi else f"at least {lo}" if hi is None else f"{lo} to {hi}"
                raise _Error(f"{name}() takes {want} argument{'s' if want != '1' else ''}, got {len(args)}",
                             meta, f"call it like {fn.signature}")
            return fn.build(*args)
        if name in self.scope.bindings and callable(self.scope.bindings[name]) \
                and not isinstance(self.scope.bindings[name], torch.Tensor):
            return self._inline(name, args, meta)
        if name in self.scope.known_names() or name in CONSTANTS:
            raise _Error(f"'{name}' is not a function", tok,
                         f"functions are {', '.join(sorted(FUNCTIONS))} and mods bound by keyword")
        raise self._unknown(tok)

    def _inline(self, name: str, args: list[Value], meta) -> Node:
        mod = self._as_mod(name, meta)
        params = ir.SCORE_INPUTS if mod.kind == "score" else ir.INDEX_INPUTS
        if len(args) != len(params):
            raise _Error(f"{mod.kind}_mod '{name}' takes {len(params)} arguments, got {len(args)}", meta,
                         f"call it like {name}({', '.join(params)})")
        inputs: dict[str, Value] = {}
        for i, (param, arg) in enumerate(zip(params, args)):
            dtype = arg.dtype if isinstance(arg, Node) else ir._weak_dtype(arg)
            ok = dtype.is_floating_point or ir.is_int(dtype) if param == "score" else ir.is_int(dtype)
            if not ok:
                want = "a number" if param == "score" else "an integer"
                raise _Error(f"argument {i + 1} ({param}) of '{name}' must be {want}, got {_dtype_of(arg)}",
                             meta)
            inputs[param] = arg
        buffers = {b.index: self.scope.buffer(b.name, mod.buffers[b.index]) for b in ir.buffers_of(mod.ir)}
        return _remap(mod.ir, inputs, buffers)

    def _as_mod(self, name: str, meta):
        mod = self.scope.mods.get(name)
        if mod is None:
            fn = self.scope.bindings[name]
            if isinstance(fn, Mod):
                mod = fn
            else:
                try:
                    mod = trace(fn, score_dtype=self.scope.score_dtype)
                except Exception as e:  # the tracer's own message says what went wrong
                    raise _Error(f"could not trace Python mod '{name}': {e}", meta) from e
            self.scope.mods[name] = mod
        return mod

    # -- operators
    add = _binary_rule("add")
    sub = _binary_rule("sub")
    mul = _binary_rule("mul")
    truediv = _binary_rule("truediv")
    floordiv = _binary_rule("floordiv")
    mod = _binary_rule("mod")
    pow = _binary_rule("pow")
    and_ = _binary_rule("and_")
    or_ = _binary_rule("or_")
    xor = _binary_rule("xor")
    lshift = _binary_rule("lshift")
    rshift = _binary_rule("rshift")

    def comp_op(self, meta, tok):
        return _COMPARE[str(tok)]

    def compare(self, meta, *items):
        # a < b <= c: each adjacent pair compared, the results and-ed (elementwise, no short-circuit).
        out = None
        for i in range(1, len(items), 2):
            pair = _binary(items[i], items[i - 1], items[i + 1])
            out = pair if out is None else _binary("and_", out, pair)
        return out

    def neg(self, meta, x):
        if _is_literal(x) and not isinstance(x, bool):
            return -x  # a negative literal stays a (weak) literal
        return ir.unary("neg", x)

    def pos(self, meta, x):
        if _is_bool(x):
            raise _Error("unary + of a bool is not supported", meta)
        return x

    def invert(self, meta, x):
        if isinstance(x, bool):
            return not x  # ~ on bools is logical not, as for torch bool tensors
        if isinstance(x, int):
            return ~x
        return ir.unary("invert", x)

    def logical_not(self, meta, x):
        self._need_bool("not", meta, x)
        return (not x) if isinstance(x, bool) else ir.unary("not", x)

    def logical_and(self, meta, a, b):
        self._need_bool("and", meta, a, b)
        return _binary("and_", a, b)

    def logical_or(self, meta, a, b):
        self._need_bool("or", meta, a, b)
        return _binary("or_", a, b)

    def _need_bool(self, word: str, meta, *xs):
        bad = [x for x in xs if not _is_bool(x)]
        if bad:
            got = " and ".join(_dtype_of(x) for x in xs)
            raise _Error(f"'{word}' needs bool operands, got {got}", meta,
                         f"'{word}' is elementwise logic on bools (no short-circuit); for integers use "
                         f"{'&, |' if word != 'not' else '~'} (bitwise) or compare first, e.g. x != 0")

    def where(self, meta, a, cond, b):  # a if cond else b
        return ir.where(cond, a, b)


def _clip(tok) -> str:
    text = str(tok)
    return text if len(text) <= 30 else f"{text[:12]}...{text[-6:]} ({len(text)} characters)"


def _check_nesting(tree: Tree) -> None:
    """Raise _Error at the first subtree nested deeper than MAX_NESTING (no recursion)."""
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            raise _Error(f"the expression is nested more than {MAX_NESTING} levels deep", node.meta,
                         "split it with `let` statements (each let starts a new expression)")
        stack.extend((c, depth + 1) for c in node.children if isinstance(c, Tree))


def _remap(root: Node, inputs: dict[str, Value] | None, buffers: dict[int, ir.Buffer]) -> Node:
    """Rebuild ``root`` with inputs replaced by values and loads moved to other buffers."""
    memo: dict[int, Value] = {}
    for n in ir.toposort(root):
        if n.op == "input":
            out = inputs.get(n.arg, n) if inputs else n
        elif n.op == "const":
            out = n
        elif n.op == "load":
            out = ir.load(buffers.get(n.arg.index, n.arg), [memo[id(s)] for s in n.src])
        else:
            out = ir.rebuild(n, tuple(memo[id(s)] for s in n.src))
        memo[id(n)] = out
    out = memo[id(root)]
    return out if isinstance(out, Node) else ir.const(out)


# ---------------------------------------------------------------------------------------------
# Error rendering


_CONTEXT_CHARS = 100  # longest context line an error shows


def _context(text: str, pos: Any) -> tuple[int, int, str]:
    """(line, column, the line with carets under ``pos``'s span)."""
    line, col = pos.line, pos.column
    end_line, end_col = getattr(pos, "end_line", line), getattr(pos, "end_column", col + 1)
    lines = text.splitlines() or [""]
    src = lines[line - 1] if 0 < line <= len(lines) else ""
    width = (end_col - col) if end_line == line and end_col and end_col > col else 1
    start = 0
    if len(src) > _CONTEXT_CHARS:  # a window around the column, not a megabyte of text
        start = max(0, col - 1 - _CONTEXT_CHARS // 2)
        src = ("..." if start else "") + src[start:start + _CONTEXT_CHARS] + \
            ("..." if start + _CONTEXT_CHARS < len(src) else "")
        start -= 3 if start else 0
        width = max(1, min(width, len(src) - (col - 1 - start)))
    return line, col, f"    {src}\n    {' ' * (col - 1 - start)}{'^' * width}"


def _describe_terminal(parser: Lark, name: str) -> str:
    readable = {"NAME": "a name", "DEC_NUMBER": "a number", "HEX_NUMBER": "a number",
                "FLOAT_NUMBER": "a number", "_NL": "a newline", "$END": "the end of the text"}
    if name in readable:
        return readable[name]
    try:
        pattern = parser.get_terminal(name).pattern
    except KeyError:
        return name
    return f"'{pattern.value}'" if pattern.type == "str" else name


def _syntax_error(text: str, e: UnexpectedInput) -> DSLError:
    parser = _parser()
    context = e.get_context(text).rstrip("\n")
    context = "\n".join("    " + ln for ln in context.splitlines())
    if isinstance(e, UnexpectedToken):
        tok = e.token
        got = "end of text" if tok.type == "$END" else "newline" if tok.type == "_NL" else f"'{tok}'"
        expected = sorted({_describe_terminal(parser, t) for t in e.expected})
        hint = f"expected {' or '.join(expected)}" if len(expected) <= 8 else ""
        if tok.type == "$END" or tok.type == "_NL" and text[tok.start_pos:].strip() == "":
            line, col = _end_position(text)
            context = _context(text, _Pos(line, col))[2]
            if not text.strip():
                return DSLError("empty text", line, col, context, "expected an expression, e.g. q_idx >= kv_idx")
            return DSLError("unexpected end of text", line, col, context, hint)
        return DSLError(f"unexpected {got}", e.line, e.column, context, hint)
    if isinstance(e, UnexpectedCharacters):
        return DSLError(f"unexpected character {text[e.pos_in_stream]!r}", e.line, e.column, context)
    line, col = _end_position(text)
    return DSLError("unexpected end of text", line, col, _context(text, _Pos(line, col))[2])


@dataclass
class _Pos:
    line: int
    column: int


def _end_position(text: str) -> tuple[int, int]:
    lines = text.rstrip().splitlines() or [""]
    return len(lines), len(lines[-1]) + 1


def _located(text: str, message: str, pos: Any, hint: str = "") -> DSLError:
    line, col, context = _context(text, pos)
    return DSLError(message, line, col, context, hint)


# ---------------------------------------------------------------------------------------------
# Entry points


def parse_with_buffers(text: str, kind: str | None = None, bindings: dict[str, Any] | None = None,
                       score_dtype: torch.dtype = torch.float32) -> tuple[Node, list[torch.Tensor]]:
    """Like `parse`, also returning the captured tensors in buffer-index order."""
    if not isinstance(text, str):
        raise DSLError(f"the mod text must be a str, got {type(text).__name__}")
    if kind not in (None, "score", "mask"):
        raise DSLError(f"kind must be 'score', 'mask' or None, got {kind!r}")
    if not isinstance(score_dtype, torch.dtype) or not score_dtype.is_floating_point:
        raise DSLError(f"score_dtype must be a floating-point torch.dtype, got {score_dtype!r}")
    scope = _Scope(kind, score_dtype, _check_bindings(dict(bindings or {})))
    # Buffer i is the i-th tensor binding (keyword order), used or not, so that the same bindings
    # always give the same IR; tensors captured by called mods come after them.
    for name, value in scope.bindings.items():
        if isinstance(value, torch.Tensor):
            scope.buffer(name, value)
    try:
        tree = _parser().parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(text, e) from None

    to_ir = _ToIR(scope)
    try:
        _check_nesting(tree)
        *lets, body = tree.children
        for let in lets:  # in order: each `let` sees the ones before it
            tok, expr = let.children
            name = str(tok)
            if name in RESERVED or name in scope.bindings or name in scope.lets:
                where = (f"line {scope.lets[name][1]}" if name in scope.lets else
                         "a keyword binding" if name in scope.bindings else "a built-in name")
                raise _Error(f"'{name}' is already defined ({where})", tok, "pick another name for the let")
            scope.lets[name] = (to_ir.transform(expr), tok.line)
        root = to_ir.transform(body)  # aliased rules always make a Tree
    except VisitError as e:
        orig = e.orig_exc
        if isinstance(orig, _Error):
            raise _located(text, orig.message, orig.pos or e.obj.meta, orig.hint) from None
        if isinstance(orig, ir.IRError):
            raise _located(text, str(orig), e.obj.meta) from None
        # Anything else (a torch error while folding constants, ...) still points at the text.
        raise _located(text, f"cannot build this expression: {type(orig).__name__}: {orig}", e.obj.meta) from orig
    except _Error as e:  # raised here for a let, not inside the Transformer
        raise _located(text, e.message, e.pos, e.hint) from None

    try:
        root = root if isinstance(root, Node) else ir.const(root)
    except ir.IRError as e:
        raise _located(text, str(e), _pos_of(body)) from None
    want = {"mask": "bool", "score": "a floating-point score"}.get(kind)
    if want and (root.dtype != torch.bool if kind == "mask" else not root.dtype.is_floating_point):
        hint = ("compare it to get a bool, e.g. (...) != 0" if kind == "mask" else
                "cast it, e.g. float32(...), or combine it with score")
        raise _located(text, f"{kind} text must produce {want}, but it produces {ir.dtype_name(root.dtype)}",
                       _pos_of(body), hint)
    return root, scope.tensors


def _pos_of(tree: Any) -> Any:
    return tree.meta if isinstance(tree, Tree) else tree


def parse(text: str, kind: str | None = None, bindings: dict[str, Any] | None = None,
          score_dtype: torch.dtype = torch.float32) -> Node:
    """Parse DSL ``text`` into an IR node.

    ``kind`` "mask" (inputs b, h, q_idx, kv_idx; must produce bool), "score" (also ``score``;
    must produce a float) or None (no check). ``bindings`` gives names to tensors (read with
    ``name[i, j]``), Python numbers (constants) and mods (called like functions).

    >>> str(parse("q_idx >= kv_idx and q_idx - kv_idx <= 256", "mask"))
    '((q_idx >= kv_idx) & ((q_idx - kv_idx) <= 256))'
    """
    return parse_with_buffers(text, kind, bindings, score_dtype)[0]


def make_mod(kind: str, text: str, bindings: dict[str, Any] | None = None,
             score_dtype: torch.dtype = torch.float32):
    """The `Mod` of DSL ``text``; `mask_mod` and `score_mod` with the kind and options explicit.

    >>> make_mod("score", "score * scale", {"scale": 0.5}, torch.float16).ir.dtype
    torch.float16
    """
    root, tensors = parse_with_buffers(text, kind, bindings, score_dtype)
    mod = Mod(kind, root, tensors, name=f"dsl_{kind}_mod", source=text)
    # torch's flex_attention tells score from mask mods by counting positional parameters.
    params = ir.SCORE_INPUTS if kind == "score" else ir.INDEX_INPUTS
    mod.__signature__ = inspect.Signature(
        [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params])
    return mod


def mask_mod(text: str, /, **bindings):
    """A mask mod from DSL text; keyword arguments bind tensors, numbers and other mods.

    The result is a `flexattn.mods.Mod`: use it with flexattn, with torch's own flex_attention,
    or call it on tensors.

    >>> doc = torch.tensor([0, 0, 1, 1, 1])
    >>> m = mask_mod("doc[q_idx] == doc[kv_idx] and q_idx >= kv_idx", doc=doc)
    >>> m(0, 0, torch.tensor(3), torch.tensor(2))
    tensor(True)
    """
    return make_mod("mask", text, bindings)


def score_mod(text: str, /, **bindings):
    """A score mod from DSL text; keyword arguments bind tensors, numbers and other mods.

    >>> alibi = score_mod("score - slope[h] * abs(q_idx - kv_idx)", slope=torch.tensor([0.5, 0.25]))
    >>> alibi(torch.tensor(1.0), 0, 1, torch.tensor(4), torch.tensor(0))
    tensor(0.)
    """
    return make_mod("score", text, bindings)
