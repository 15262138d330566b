"""What kernels/triton_launcher.py relies on in Triton and torch, checked without a GPU: a Triton
that changes it fails here instead of quietly sending every launch down Triton's slower path."""

from __future__ import annotations

import inspect

import pytest
import torch
import triton
from triton.compiler.compiler import ASTSource, CompiledKernel

from flexattn.kernels import triton_launcher

nvidia = pytest.importorskip("triton.backends.nvidia.driver", reason="Triton without its CUDA backend")
TRITON = tuple(int(p) for p in triton.__version__.split(".")[:2])


def test_the_launch_hooks_are_knobs():
    """`no_launch_hooks` reads both hooks off ``triton.knobs.runtime``; a direct launch passes them on."""
    assert triton_launcher.AVAILABLE
    runtime = triton.knobs.runtime
    assert hasattr(runtime, "launch_enter_hook") and hasattr(runtime, "launch_exit_hook")
    assert triton_launcher.no_launch_hooks()


def test_the_compiled_kernel_has_what_capture_reads():
    """`capture` calls ``_init_handles`` and swaps ``run``; `call` and `static_plan` read
    ``function``, ``packed_metadata``, ``launch_metadata(grid, stream, *args)`` and the source's
    ``fn.arg_names``, ``signature`` and ``constants``."""
    assert callable(CompiledKernel._init_handles) and hasattr(CompiledKernel, "run")
    assert list(inspect.signature(CompiledKernel.launch_metadata).parameters) == ["self", "grid", "stream", "args"]
    assert "self.packed_metadata" in inspect.getsource(CompiledKernel)
    assert "self.function" in inspect.getsource(CompiledKernel._init_handles)
    init = inspect.getsource(ASTSource.__init__)
    assert all(f"self.{a}" in init for a in ("fn", "signature", "constants"))


def test_the_launcher_takes_the_recorded_layout():
    """`capture` checks a recorded call against (grid x3, stream, function, packed metadata,
    launch metadata, enter hook, exit hook, *args); `call` calls the launcher that way."""
    params = list(inspect.signature(nvidia.CudaLauncher.__call__).parameters)
    assert params == ["self", "gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata",
                      "launch_metadata", "launch_enter_hook", "launch_exit_hook", "args"]


def test_the_descriptor_launch_is_known_for_the_installed_triton():
    """`descriptor_launch_supported` reads the descriptor wrapper's layout: Triton 3.6's has it
    (`TensorMapLaunch` launches the Hopper kernels), 3.7 and newer have not (they launch through
    Triton's launcher). A Triton that changes this, either way, fails here: update the check, the
    expectation and docs/limits.md together."""
    assert triton_launcher.descriptor_launch_supported() is (TRITON <= (3, 6))


def test_the_descriptor_wrapper_is_read_through_raw_launch_cell():
    """`raw_launch_cell` finds the C function in the wrapper's ``launcher`` cell, on every Triton
    the check above knows (`capture` swaps that cell to record the C function's arguments)."""
    def raw(*args):
        return args

    wrapper = nvidia.wrap_handle_tensordesc(raw, {"a": "tensordesc<bf16[64,16]>", "n": "i32"}, [{"swizzle": 3}])
    cell = triton_launcher.raw_launch_cell(type("Launcher", (), {"launch": staticmethod(wrapper)}))
    assert cell is not None and cell.cell_contents is raw


def test_the_static_launcher_types_cover_the_kernels_arguments():
    """`static_plan` maps every scalar type the kernels take to torch's static launcher's codes."""
    assert {"i1", "i32", "i64", "fp32", "fp64"} <= triton_launcher._STATIC_TYPES.keys()
    if torch.cuda.is_available() and not torch.version.hip:
        assert triton_launcher._static_launcher() is not None
