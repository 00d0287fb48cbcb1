"""Fixtures shared by the whole suite.

``backend``: each test that takes it runs once per storage backend, with ids ``[hdf5]`` and
``[zarr]`` (the ids ``@pytest.mark.parametrize("backend", BACKENDS)`` gave). ``suffix``: the
path suffix that selects that backend (``.h5``, ``.zarr``).

The shared helper modules (helpers, torch_optional, spec_reader, resume_helper) live next to
this file; ``pythonpath = ["tests"]`` in pyproject.toml lets the test files in the
subdirectories import them by name.
"""

from __future__ import annotations

import pytest
from helpers import BACKENDS, SUFFIX


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The storage backend under test: ``"hdf5"`` or ``"zarr"``."""
    return request.param


@pytest.fixture
def suffix(backend: str) -> str:
    """The path suffix that selects ``backend``."""
    return SUFFIX[backend]

