"""Fixtures every test shares."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True, scope="session")
def tuitrain_cache(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[Path]:
    """Trained tokenizers and token streams go under .pytest_cache, never ~/.cache.

    The folder outlives the session, so the built-in corpus is tokenised once per checkout
    rather than once per test run; worker processes inherit it through the environment.
    A test that needs an empty cache sets TUITRAIN_CACHE itself.
    """
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    path = cache.mkdir("tuitrain") if cache is not None else tmp_path_factory.mktemp("tuitrain")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TUITRAIN_CACHE", str(path))
        yield Path(path)
