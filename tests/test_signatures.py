"""Each kernel's parameters are declared once (flexattn/codegen/signatures.py): the rendered
template's ``def`` has exactly the declared parameters, and the host's argument tuple, built with
one named sentinel per parameter, lines up with them name by name."""

from __future__ import annotations

import ast
import types

import pytest
import torch

import flexattn
from flexattn.codegen import emit, render, signatures
from flexattn.kernels import forward as fwd, launch

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
    monkeypatch.setattr(launch, "_MODULES", {})
    make_module()
    return seen[template]


def def_params(source: str, kernel: str) -> list[str]:
    """The parameter names of the top-level function ``kernel`` in ``source``."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == kernel:
            return [a.arg for a in node.args.args]
    raise AssertionError(f"no def {kernel} in the rendered source")


def mod_hooks(target: str) -> dict[str, str]:
    return {f"{kind}_mod_params": emit.emit_mod(mod.ir, kind, f"{kind}_mod", target).param_list(f"{kind}_")
            for kind, mod in (("score", SCORE), ("mask", MASK))}


FAMILIES = {
    "forward": (lambda: fwd.module(SCORE, MASK, "cuda"), "cuda"),
    "forward_hopper": (lambda: fwd.hopper_module(SCORE, MASK, False), "gluon"),
}


def test_every_declared_template_is_checked_here():
    assert FAMILIES.keys() == signatures.TEMPLATES.keys()


@pytest.mark.parametrize("template", list(FAMILIES))
def test_the_rendered_def_is_the_declaration(template, monkeypatch):
    make_module, target = FAMILIES[template]
    source = rendered(template, make_module, monkeypatch)
    for sig in signatures.TEMPLATES[template]:
        assert def_params(source, sig.kernel) == sig.names(mod_hooks(target))


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
                           named(sig.group("descale")))
    return [str(a) for a in args]


def runtime_params(sig: signatures.Signature, target: str) -> list[str]:
    return sig.names(mod_hooks(target))[:-len(sig.constexprs)]


def test_the_forward_host_arguments_follow_the_declaration():
    assert forward_args(signatures.FORWARD) == runtime_params(signatures.FORWARD, "cuda")


@pytest.mark.parametrize("with_out", [True, False])
def test_the_hopper_forward_host_arguments_follow_the_declaration(with_out):
    """The Hopper kernel takes Q, K, V (and the output, with O_TMA) as descriptors in their places."""
    class Descriptors:  # each tensor stands for its own descriptor
        def __call__(self, *tensors):
            return tensors

    descriptors = Descriptors()
    descriptors.with_out = with_out
    sig = signatures.FORWARD_HOPPER
    assert forward_args(sig, descriptors) == runtime_params(sig, "gluon")
