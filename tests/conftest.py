"""Shared pytest setup: hypothesis profiles and the GPU marker."""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# Kernels run through Triton's CPU interpreter here, so examples are slow: no deadlines.
settings.register_profile(
    "dev", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
# CI: the same examples every run (a red CI must be reproducible), printed on failure.
settings.register_profile(
    "ci", parent=settings.get_profile("dev"), derandomize=True, print_blob=True, database=None
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
