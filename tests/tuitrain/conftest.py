"""The application's tests start their workers from the fork server (forked_workers.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.tuitrain.forked_workers import ForkedContext
from tuitrain import worker


@pytest.fixture(autouse=True, scope="session")
def forked_workers() -> Iterator[None]:
    """Every worker a test starts in its own process (ProcessWorker, the ranks of
    DataParallelWorker) is forked; `forked_workers.spawned` starts one the product's way."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(worker, "CONTEXT", ForkedContext())
        yield
