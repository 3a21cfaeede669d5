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


@pytest.fixture(params=["pure", "compiled"])
def index_class(request):
    """Each n-gram index implementation: the pure one, and the compiled one (which must build here)."""
    from reader_spec.drafters.retrieval.ngram_index import CompiledNgramIndex, NgramIndex

    if request.param == "compiled" and native.core() is None:
        pytest.fail("the compiled retrieval core must build on this machine (make builds it)")
    return NgramIndex if request.param == "pure" else CompiledNgramIndex
