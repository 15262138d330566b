"""The ``flexattn`` command: look at what a mod becomes, draw masks, run the demo and benchmarks.

    flexattn show "score + 0.5 * tanh(score / 5.0)"            # IR, node listing, Triton source
    flexattn show "q_idx >= kv_idx" --kind mask --target interpret
    flexattn show mymods.py:sliding                            # a Python mod from a file
    flexattn show "-score"                                     # text may start with '-'
    flexattn mask "q_idx >= kv_idx and q_idx - kv_idx < 300" --seq 1000 --block-size 128 --png m.png
    flexattn mask "q_idx - kv_idx < w" --seq 64 --set w=10 --png m.png   # small: token-level picture
    flexattn demo                                              # runs flexattn.demo
    flexattn bench attention decode                            # python -m benchmarks (needs a CUDA GPU)
    flexattn --version

Names used in the text can be bound with ``--set NAME=NUMBER`` and ``--tensor NAME=DTYPE[D0,D1]``
(a zero-filled tensor: enough to see the generated code, which depends only on dtype and rank).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from flexattn import __version__, demo, ir, viz
from flexattn.block_mask import create_block_mask
from flexattn.codegen.emit import TARGETS, emit_mod
from flexattn.dsl import make_mod, parse
from flexattn.tracer import trace


def _number(text: str) -> bool | int | float:
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text, 0)
    except ValueError:
        return float(text)  # "inf", "nan", "1e-3" included


#: Most elements of a ``--tensor`` (a zero-filled tensor, 128 MiB at 8 bytes each).
MAX_TENSOR_ELEMENTS = 1 << 24


def _bindings(args) -> dict:
    out: dict = {}
    for item in args.set or []:
        name, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[name.strip()] = _number(value.strip())
        except ValueError:
            raise ValueError(f"--set expects NAME=NUMBER (e.g. window=256), got {item!r}") from None
    for item in args.tensor or []:
        m = re.fullmatch(r"\s*(\w+)\s*=\s*(\w+)\s*\[([\d,\s]*)\]\s*", item)
        if not m or m.group(2) not in ir.DTYPES:
            raise ValueError(f"--tensor expects NAME=DTYPE[SIZES] with DTYPE one of "
                             f"{', '.join(ir.DTYPES)} (e.g. bias=float32[16] or table=int32[4,8]), got {item!r}")
        sizes = [int(s) for s in m.group(3).split(",") if s.strip()]
        if max([math.prod(sizes), *sizes]) > MAX_TENSOR_ELEMENTS:  # a few characters could ask for terabytes
            raise ValueError(f"--tensor {item!r} is too large; flexattn binds tensors of at most "
                             f"{MAX_TENSOR_ELEMENTS} elements (the code depends only on the dtype and the rank)")
        out[m.group(1)] = torch.zeros(sizes, dtype=ir.DTYPES[m.group(2)])
    return out


def node_listing(root: ir.Node) -> list[str]:
    """One line per IR node, operands first: ``%3 = add %1, %2 : int32``."""
    ids: dict[int, str] = {}
    lines = []
    for i, n in enumerate(ir.toposort(root)):
        ids[id(n)] = f"%{i}"
        operands = [ids[id(s)] for s in n.src]
        if n.op == "const":
            operands = [repr(n.arg)]
        elif n.op == "input":
            operands = [n.arg]
        elif n.op == "load":
            operands = [f"{n.arg.name}(B{n.arg.index})"] + operands
        lines.append(f"{ids[id(n)]} = {n.op} {', '.join(operands)} : {ir.dtype_name(n.dtype)}")
    return lines


_FILE_FUNCTION = re.compile(r"(?s)(?P<file>[^\n]+\.py):(?P<name>[A-Za-z_]\w*)")


def _load_function(path: str, name: str):
    """``name`` from the Python file ``path`` (imported as a module: it is the user's own code)."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}:{name}: no such file {path!r}")
    spec = importlib.util.spec_from_file_location(f"_flexattn_cli_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"{path} defines no {name!r}; callables there: {', '.join(public) or 'none'}")
    return fn


def _mod(text: str, kind: str | None, bindings: dict):
    m = _FILE_FUNCTION.fullmatch(text.strip())
    if m:  # file.py:function -> a traced Python mod
        if bindings:
            raise ValueError("--set / --tensor bind names in DSL text; a Python mod from a file uses its own values")
        return trace(_load_function(m["file"], m["name"]), kind=kind)
    if kind is None:  # a bool result is a mask, anything else a score
        kind = "mask" if parse(text, None, bindings).dtype == torch.bool else "score"
    return make_mod(kind, text, bindings)


def cmd_show(args) -> int:
    mod = _mod(args.text, args.kind, _bindings(args))
    src = emit_mod(mod.ir, mod.kind, target=args.target)
    print(f"kind:   {mod.kind}")
    print(f"source: {args.text}")
    print(f"IR:     {ir.to_text(mod.ir)}")
    print(f"key:    {mod.key()}")
    print("\nnodes:")
    for line in node_listing(mod.ir):
        print(f"    {line}")
    buffers = ir.buffers_of(mod.ir)
    if buffers:
        print("\nbuffers (captured tensors, passed as pointer, strides, sizes):")
        for b in buffers:
            print(f"    B{b.index}: {b.name}  {ir.dtype_name(b.dtype)}, {b.ndim}-d")
    print(f"\nTriton ({args.target}):\n")
    print(src.source)
    return 0


#: Most tiles ``flexattn mask`` builds (its tables are int32 [nQ, nKV]: 64 MiB each at this size).
MAX_MASK_TILES = 1 << 24


def cmd_mask(args) -> int:
    kv_seq = args.kv_seq or args.seq
    n_q, n_kv = -(-args.seq // args.block_size), -(-kv_seq // args.block_size)
    if n_q * n_kv > MAX_MASK_TILES:  # refuse before tracing or allocating anything
        longest = int((MAX_MASK_TILES ** 0.5)) * args.block_size
        raise ValueError(f"--seq {args.seq}{f' --kv-seq {kv_seq}' if args.kv_seq else ''} with --block-size "
                         f"{args.block_size} makes {n_q} x {n_kv} tiles; flexattn mask builds at most "
                         f"{MAX_MASK_TILES} tiles (e.g. --seq {longest} at this block size): use a larger "
                         f"--block-size or shorter lengths")
    if args.png:
        folder = os.path.dirname(os.path.abspath(args.png))
        if not os.path.isdir(folder):
            raise ValueError(f"--png {args.png}: the directory {folder} does not exist")
    mod = _mod(args.text, "mask", _bindings(args))
    block_mask = create_block_mask(mod, 1, 1, args.seq, kv_seq, device="cpu", BLOCK_SIZE=args.block_size)
    print(str(block_mask))
    if args.png:
        _, level = viz.picture(block_mask, level=args.level)  # cheap next to create_block_mask
        viz.to_png(block_mask, args.png, level=level)
        print(f"wrote {args.png} ({level} level)")
    return 0


BENCHMARKS = ("attention", "decode", "fp8", "host", "block_mask")  # the suites of python -m benchmarks


def _benchmark_dir() -> Path | None:
    """benchmarks/ of the source checkout this flexattn runs from (an installed wheel has none)."""
    here = Path(__file__).resolve().parent.parent / "benchmarks"
    return here if (here / "bench_attention.py").is_file() else None


def cmd_bench(args) -> int:
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHMARKS)}")
    if not torch.cuda.is_available():
        print("flexattn bench: needs a CUDA GPU, and torch.cuda.is_available() is False here. The benchmarks "
              "time flexattn's kernels against torch.compile(flex_attention) and cuDNN SDPA on the GPU; on the "
              "CPU, Triton's interpreter makes timings meaningless (for a CPU check run: python -m flexattn.demo)",
              file=sys.stderr)
        return 2
    folder = _benchmark_dir()
    if folder is None:
        print("flexattn bench: the benchmark scripts live in benchmarks/ of a source checkout, which this "
              "installation does not have; clone the repository and pip install -e . from it", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "benchmarks", *args.names, *(["--", *args.extra] if args.extra else [])]
    print(f"== {' '.join(command[1:])}", flush=True)
    return subprocess.call(command, cwd=folder.parent)


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexattn", description="Inspect flexattn mods, draw masks, run the demo and the benchmarks.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--version", action="version", version=f"flexattn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{show,mask,demo,bench}")

    def bindings(p):
        p.add_argument("--set", action="append", metavar="NAME=NUMBER", help="bind a Python number")
        p.add_argument("--tensor", action="append", metavar="NAME=DTYPE[SIZES]",
                       help="bind a zero-filled tensor, e.g. bias=float32[16]")

    text_help = "DSL text (e.g. \"q_idx >= kv_idx\"; may start with '-') or FILE.py:FUNCTION (a Python mod)"
    show = sub.add_parser("show", help="print a mod's IR and its generated Triton function")
    show.add_argument("text", help=text_help)
    show.add_argument("--kind", choices=("score", "mask"), help="default: mask if the text gives a bool")
    show.add_argument("--target", choices=TARGETS, default="cuda",
                      help="cuda (GPU, libdevice math) or interpret (Triton's CPU interpreter)")
    bindings(show)
    show.set_defaults(run=cmd_show)

    mask = sub.add_parser("mask", help="build a mask's BlockMask on the CPU, print its tiles, draw it")
    mask.add_argument("text", help=text_help)
    mask.add_argument("--seq", type=_positive, required=True, help="query length")
    mask.add_argument("--kv-seq", type=_positive, help="KV length (default: --seq)")
    mask.add_argument("--block-size", type=_positive, default=128, help="tile size (default 128)")
    mask.add_argument("--png", metavar="PATH", help="also write a PNG picture (needs Pillow: flexattn[plot])")
    mask.add_argument("--level", choices=("auto", "token", "tile"), default="auto",
                      help="picture of every token pair or of the tiles (auto: tokens up to 1024 x 1024)")
    bindings(mask)
    mask.set_defaults(run=cmd_mask)

    sub.add_parser("demo", help="run the demo (python -m flexattn.demo; options after 'demo')", add_help=False)

    bench = sub.add_parser("bench", help="run the GPU benchmarks in benchmarks/ (needs a CUDA GPU)",
                           description="Run python -m benchmarks from the source checkout: each suite prints its "
                                       "table and writes benchmarks/results/<suite>-<gpu>.json. Arguments after "
                                       "'--' go to every suite.")
    bench.add_argument("names", nargs="*", metavar="NAME",
                       help=f"which benchmarks ({', '.join(BENCHMARKS)}; default: all)")
    bench.set_defaults(run=cmd_bench, extra=[])
    return parser


_TEXT = "\0flexattn-text\0"


def _protect_text(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], str | None]:
    """Let mod text start with '-' (``flexattn show "-score"``): argparse would take it for an option.

    The first argument after the subcommand that starts with '-' but is no option of it (nor an
    option's value) is swapped for a placeholder before parsing and put back after.
    """
    if not argv or argv[0] not in ("show", "mask"):
        return argv, None
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[argv[0]]
    takes_value = {o: a.nargs != 0 for a in sub._actions for o in a.option_strings}
    out, skip = list(argv), False
    for i, a in enumerate(argv[1:], 1):
        if a == "--":
            break
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        known = [o for o in takes_value if o == name or (name.startswith("--") and o.startswith(name))]
        if known:
            skip = takes_value[known[0]] and "=" not in a
        elif a.startswith("-") and len(a) > 1 and not re.fullmatch(r"-\d+(\.\d*)?", a):
            out[i] = _TEXT
            return out, a
    return out, None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:  # the demo has its own options
        return demo.main(argv[1:], prog="flexattn demo")
    extra: list[str] = []
    if argv[:1] == ["bench"] and "--" in argv:  # arguments for the benchmark scripts
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    argv, text = _protect_text(parser, argv)
    args = parser.parse_args(argv)
    if text is not None and getattr(args, "text", None) == _TEXT:
        args.text = text
    if args.command == "bench":
        args.extra = extra
    try:
        return args.run(args)
    except (ValueError, TypeError, OSError, ImportError) as e:  # DSLError is a ValueError; the library's message
        print(f"flexattn {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
