"""The ``flexattn`` command: look at what a DSL mod becomes.

    flexattn show "score + 0.5 * tanh(score / 5.0)"            # IR, node listing, Triton source
    flexattn show "q_idx >= kv_idx" --kind mask --target interpret
    flexattn mask "q_idx >= kv_idx and q_idx - kv_idx < 300" --seq 1000 --block-size 128 --png m.png
    flexattn mask "q_idx - kv_idx < w" --seq 512 --set w=100 # bind a number
    flexattn demo                                              # runs flexattn.demo

Names used in the text can be bound with ``--set NAME=NUMBER`` and ``--tensor NAME=DTYPE[D0,D1]``
(a zero-filled tensor: enough to see the generated code, which depends only on dtype and rank).
"""

from __future__ import annotations

import argparse
import re
import sys

import torch

from flexattn import ir
from flexattn.codegen.emit import TARGETS
from flexattn.dsl import make_mod, parse


def _number(text: str) -> bool | int | float:
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text, 0)
    except ValueError:
        return float(text)  # "inf", "nan", "1e-3" included


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


def _mod(text: str, kind: str | None, bindings: dict):
    if kind is None:  # a bool result is a mask, anything else a score
        kind = "mask" if parse(text, None, bindings).dtype == torch.bool else "score"
    return make_mod(kind, text, bindings)


def cmd_show(args) -> int:
    mod = _mod(args.text, args.kind, _bindings(args))
    src = mod.emit(args.target)
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


def cmd_mask(args) -> int:
    from flexattn.block_mask import create_block_mask

    mod = _mod(args.text, "mask", _bindings(args))
    kv_seq = args.kv_seq or args.seq
    block_mask = create_block_mask(mod, 1, 1, args.seq, kv_seq, device="cpu", BLOCK_SIZE=args.block_size)
    print(str(block_mask))
    if args.png:
        block_mask.to_png(args.png)
        print(f"wrote {args.png}")
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexattn", description="Inspect flexattn mods written in the DSL (see docs/dsl.md).",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1],
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{show,mask,demo}")

    def bindings(p):
        p.add_argument("--set", action="append", metavar="NAME=NUMBER", help="bind a Python number")
        p.add_argument("--tensor", action="append", metavar="NAME=DTYPE[SIZES]",
                       help="bind a zero-filled tensor, e.g. bias=float32[16]")

    show = sub.add_parser("show", help="print a mod's IR and its generated Triton function")
    show.add_argument("text", help="DSL text, e.g. \"q_idx >= kv_idx\"")
    show.add_argument("--kind", choices=("score", "mask"), help="default: mask if the text gives a bool")
    show.add_argument("--target", choices=TARGETS, default="cuda",
                      help="cuda (GPU, libdevice math) or interpret (Triton's CPU interpreter)")
    bindings(show)
    show.set_defaults(run=cmd_show)

    mask = sub.add_parser("mask", help="build a mask's BlockMask on the CPU and print its tiles")
    mask.add_argument("text", help="DSL text of a mask mod")
    mask.add_argument("--seq", type=_positive, required=True, help="query length")
    mask.add_argument("--kv-seq", type=_positive, help="KV length (default: --seq)")
    mask.add_argument("--block-size", type=_positive, default=128, help="tile size (default 128)")
    mask.add_argument("--png", metavar="PATH", help="also write a picture of the tiles")
    bindings(mask)
    mask.set_defaults(run=cmd_mask)

    sub.add_parser("demo", help="run the demo (python -m flexattn.demo; options after 'demo')", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:  # the demo has its own options
        from flexattn import demo

        return demo.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError) as e:  # DSLError is a ValueError; the library's own message
        print(f"flexattn {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
