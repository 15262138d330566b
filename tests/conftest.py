"""Shared pytest setup: hypothesis profiles, the GPU marker, output poisoning."""

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

# Kernels run through Triton's CPU interpreter here, so examples are slow: no deadlines.
settings.register_profile(
    "dev", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
# CI: the same examples every run (a red CI must be reproducible), printed on failure.
settings.register_profile(
    "ci", parent=settings.get_profile("dev"), derandomize=True, print_blob=True, database=None
)
# explore: every distinct failure reported as found, without shrinking (a long GPU fuzz, whose
# shrink steps compile kernels: HYPOTHESIS_PROFILE=explore).
settings.register_profile(
    "explore", parent=settings.get_profile("dev"), print_blob=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def nan_outputs(monkeypatch):
    """Every output and scratch buffer the kernels write starts as NaN (integer ones are left
    alone), so an element a kernel fails to write shows up."""
    from flexattn.kernels import launch

    empty = launch.empty

    def filled(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(math.nan) if t.dtype.is_floating_point else t

    monkeypatch.setattr(launch, "empty", filled)
