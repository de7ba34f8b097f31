"""The TUI tests are async (Textual's pilot); anyio runs them on asyncio."""

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
