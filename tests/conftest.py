"""Fixtures every test shares."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.devices.device import SIMULATE_ENV
from tuitrain.presets import CONFIG_ENV
from tuitrain.runs import ENV_FOLDER


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cuda: runs on the real GPU (make_device's own choice) against GPU references")


@pytest.fixture(autouse=True)
def device_choice(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test not marked `cuda` asks for the simulated device, so that on a GPU machine
    the CPU tests (the engine's and the app's) still compare with CPU references and run at
    their few-MiB budgets. An environment variable, not a patch, because worker processes
    inherit it."""
    if request.node.get_closest_marker("cuda") is None:
        monkeypatch.setenv(SIMULATE_ENV, "1")
    else:
        monkeypatch.delenv(SIMULATE_ENV, raising=False)


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


@pytest.fixture(autouse=True)
def user_config(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test gets an empty configuration folder of its own (TUITRAIN_CONFIG), so what
    the user saved (presets) never changes a result, and no test writes into their folder.
    An environment variable, so worker processes see the same folder."""
    path = tmp_path_factory.mktemp("config")
    monkeypatch.setenv(CONFIG_ENV, str(path))
    return path


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
                   ) -> Path:
    """Each test gets a private runtime folder of its own (TUITRAIN_RUNTIME_DIR), so the
    headless runs of tests neither list among the user's runs nor see each other. Made
    under the base temporary folder, whose short path leaves room for a socket's name."""
    path = tmp_path_factory.mktemp("run")
    monkeypatch.setenv(ENV_FOLDER, str(path))
    return path
