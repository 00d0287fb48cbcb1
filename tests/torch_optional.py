"""torch for the tests: required in the main run, optional only in the runs that have none.

``./dev test`` also runs the suite on other Python versions where no torch wheel is available
(see the README); it sets ``LEAN_STORE_TESTS_WITHOUT_TORCH=1`` there, and only there do the
tests that need torch skip, with :data:`REASON`. Everywhere else a missing torch is an import
error, never a silent skip. Tests that do not need torch run in every run.
"""

from __future__ import annotations

import os
from types import ModuleType

import pytest

WITHOUT_TORCH_ENV = "LEAN_STORE_TESTS_WITHOUT_TORCH"
REASON = (f"needs torch, which this run does not install ({WITHOUT_TORCH_ENV}=1: "
          "./dev test's run on another Python, where no torch wheel is available)")


def _import_torch() -> ModuleType | None:
    if os.environ.get(WITHOUT_TORCH_ENV) != "1":
        import torch  # the main run: torch must be there

        return torch
    try:
        import torch
    except ImportError:
        return None
    return torch


torch = _import_torch()
"""The torch module, or None in a run without torch."""

needs_torch = pytest.mark.skipif(torch is None, reason=REASON)
"""Mark for a test that needs torch, in a module whose other tests do not."""


def require_torch() -> ModuleType:
    """torch, for a module whose every test needs it: skips the module in a run without it."""
    if torch is None:
        pytest.skip(REASON, allow_module_level=True)
    return torch
