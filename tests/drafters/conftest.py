"""Drafting runs in the compiled retrieval core or in pure Python; tests that pin drafts run both."""

from __future__ import annotations

import pytest

from reader_spec.drafters.retrieval import native


@pytest.fixture(params=["compiled", "pure"])
def retrieval_path(request, monkeypatch) -> str:
    """Run the test once through the compiled core (which must build here: ``make`` builds it) and
    once through the pure Python functions."""
    if request.param == "compiled":
        if native.core() is None:
            pytest.fail("the compiled retrieval core must build on this machine (make builds it)")
    else:
        monkeypatch.setattr(native, "core", lambda: None)
    return request.param
