"""Fixtures every test shares."""

from __future__ import annotations

import fcntl
import gc
import os
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from engine.devices.device import SIMULATE_ENV
from tests.tuitrain.forked_workers import ForkedContext
from tuitrain import worker
from tuitrain.preset_folders import CONFIG_ENV
from tuitrain.runs import ENV_FOLDER


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cuda: runs on the real GPU (make_device's own choice) against GPU references")
    # pytest-xdist hands out files in the order pytest_collection_modifyitems below leaves
    # them, not sorted by how many tests each holds (its default, which sends the files of
    # one long test last, where nothing runs beside them).
    config.option.loadscopereorder = False
    # Every process the tests start (a fresh interpreter, the fork server and what it forks)
    # computes on one thread, as the tests' own processes do (tests/engine/conftest.py):
    # under `-n 2` the two workers already hold both cores, and a second thread per
    # process only spins waiting for its share. Read by torch as each process imports it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything imported and collected so far (torch, transformers, the test modules:
    some 400 thousand objects) is set aside from the cycle collector. A full collection
    walks every tracked object, 0.2-0.3 s of CPU in such a process, and the engine makes
    one each time it closes (engine.step.engine), hundreds of times in a run; what the
    tests build after this is collected as before."""
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files with a `slow` test first, then those of quick tests, then the files with
    an `alone` test, each in the order collected. Under `-n 2` a worker is not left alone
    with a long test at the end, and an `alone` test, which waits for the other worker's
    test to end, comes when that one is quick: among the slow files it waited up to 30 s
    for a rank launch, 50 s a run in all (measured), an idle core each time. After
    pytest's own reordering (trylast), which keeps a module's tests together."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    alone = {item.path for item in items if item.get_closest_marker("alone") is not None}
    # stable: keeps each file's order
    items.sort(key=lambda item: (item.path in alone, item.path not in slow))


def _lock(path: Path, how: int, stack: ExitStack) -> None:
    file = stack.enter_context(path.open("a"))
    fcntl.flock(file, how)
    stack.callback(fcntl.flock, file, fcntl.LOCK_UN)


# tryfirst: outermost, so the wait for a turn is not counted in the test's own timeout.
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under pytest-xdist (`-n 2`), a test marked `alone` waits until the other worker's
    test is done, and the other worker waits for it: a readers-writer lock over the
    whole protocol, so that a module's fixtures (rank launches) count too. The gate lets
    no new test in while an `alone` test waits, so it is not starved. One process
    running every test needs none of this.

    Only a wall-clock bound on other processes needs it (how soon a death is noticed, a
    collective's timeout): the other worker's processes would take the CPU those wait
    for. Memory is not: a process's resident bytes and peak are its own, whatever runs
    beside it. Nor is time spent in the test's own process: that is measured as its CPU
    time (time.process_time), which a neighbour does not stretch. While an `alone` test
    runs, one of the two workers idles, so the fewer the better."""
    if not hasattr(item.config, "workerinput"):
        return (yield)
    # Each worker's basetemp is a folder of the run's own: the locks live beside them.
    run = Path(item.config.option.basetemp).parent
    with ExitStack() as stack:
        if item.get_closest_marker("alone") is not None:
            _lock(run / "gate.lock", fcntl.LOCK_EX, stack)
            _lock(run / "turn.lock", fcntl.LOCK_EX, stack)
        else:
            with ExitStack() as gate:
                _lock(run / "gate.lock", fcntl.LOCK_SH, gate)
                _lock(run / "turn.lock", fcntl.LOCK_SH, stack)
        return (yield)


@pytest.fixture(autouse=True, scope="session")
def quick_pilot() -> Iterator[None]:
    """Textual's pilot waits for the app to go idle after every key it presses and at every
    pause: it sleeps in windows of 20 ms until one passes with under 1 ms of the process's
    CPU time. Each wait leaves a core idle for at least 20 ms, some 25 s of the two
    workers' time over the app's tests (measured). Windows of 2 ms under the same 5% bound
    judge idleness alike in a tenth of the time. A setting Textual reads at every wait
    (textual._wait); if it is renamed, setattr fails here rather than slowing the tests."""
    from textual import _wait

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_wait, "SLEEP_GRANULARITY", _wait.SLEEP_GRANULARITY / 10)
        patch.setattr(_wait, "SLEEP_IDLE", _wait.SLEEP_IDLE / 10)
        yield


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


SHARED_CACHE = ("tokenizers", "tokens")  # what every worker may fill and read alike


def _worker_cache(shared: Path, own: Path) -> Path:
    """A pytest-xdist worker's own cache folder: its calibration, what a tune taught it
    (which `unlearned` forgets after each test) and its disk scratch are its own, so that
    the other worker's tests neither see nor remove them; the tokenisers and token streams,
    the same for every test, are the shared folder's (links)."""
    for name in SHARED_CACHE:
        (shared / name).mkdir(exist_ok=True)
        link = own / name
        if not link.is_symlink():
            link.symlink_to(shared / name, target_is_directory=True)
    return own


@pytest.fixture(autouse=True, scope="session")
def tuitrain_cache(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[Path]:
    """Trained tokenizers and token streams go under .pytest_cache, never ~/.cache.

    The folder outlives the session, so the built-in corpus is tokenised once per checkout
    rather than once per test run; worker processes inherit it through the environment.
    A test that needs an empty cache sets TUITRAIN_CACHE itself.
    """
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    path = cache.mkdir("tuitrain") if cache is not None else tmp_path_factory.mktemp("tuitrain")
    if (worker := os.environ.get("PYTEST_XDIST_WORKER")) and cache is not None:
        path = _worker_cache(Path(path), Path(cache.mkdir(f"tuitrain-{worker}")))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TUITRAIN_CACHE", str(path))
        yield Path(path)


@pytest.fixture(autouse=True, scope="session")
def calibrated(tuitrain_cache: Path) -> None:
    """This machine's calibration, fixed (tests/calibrations.py): no test waits for the
    measurement (up to 30 s) that a plan's time forecast makes on a new machine, and
    forecasts do not depend on the machine. For the simulated device's fingerprint, which
    every test but those marked `cuda` runs on (asking the GPU's would start CUDA in this
    process). A test of the measurement sets TUITRAIN_CACHE itself."""
    from engine.planning.calibration import fingerprint, learned_path, save_calibration
    from tests.calibrations import fixed_calibration

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SIMULATE_ENV, "1")
        save_calibration(fixed_calibration(*fingerprint()))
        learned_path().unlink(missing_ok=True)  # a killed session's, kept in the cache


@pytest.fixture(autouse=True, scope="session")
def disk_unprobed() -> Iterator[None]:
    """No forecast probes the disk (engine.planning.disk_speed.disk_now, a second or two of
    I/O): the probe finds nothing, so the fixed calibration's disk rates stand and forecasts
    do not depend on the machine. A test of the probe puts the real one back."""
    from engine.planning import disk_speed

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(disk_speed, "probe", lambda scale=1.0, base=None: (0.0, 0.0, 0.0))
        yield


@pytest.fixture(autouse=True)
def unlearned(tuitrain_cache: Path) -> Iterator[None]:
    """What a test's tune taught the fixed calibration (calibration.learn) is forgotten
    after it, so that no forecast depends on the tests that ran before."""
    yield
    for path in (tuitrain_cache / "calibration").glob("*.learned.json"):
        path.unlink(missing_ok=True)


@pytest.fixture(autouse=True, scope="session")
def private_temporary_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """TMPDIR for the whole test run is a folder of pytest's own temporary tree, which
    pytest prunes: what the tests' runs leave there on purpose (the log of a worker that a
    test kills, a rank's log kept after a failure) never piles up in the machine's /tmp.
    An environment variable, so every process the tests start inherits it."""
    folder = tmp_path_factory.mktemp("tmp")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(folder))
        patch.setattr(tempfile, "tempdir", None)  # chosen again from TMPDIR
        yield
    tempfile.tempdir = None


@pytest.fixture(autouse=True, scope="session")
def private_folders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The runtime and configuration folders for the whole test run, so that what runs
    before the per-test ones below are set (module-scoped fixtures that launch runs) never
    lists runs among the user's, nor reads what the user saved."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV_FOLDER, str(tmp_path_factory.mktemp("run")))
        patch.setenv(CONFIG_ENV, str(tmp_path_factory.mktemp("config")))
        yield


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


@pytest.fixture(autouse=True, scope="session")
def forked_workers() -> Iterator[None]:
    """Every worker a test starts in its own process (ProcessWorker, the ranks of
    DataParallelWorker) is forked from the tests' server (tests/tuitrain/forked_workers.py);
    `forked_workers.spawned` starts one the product's way. Here, not in a conftest of
    tests/tuitrain: a second conftest module would shadow the engine tests' own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(worker, "CONTEXT", ForkedContext())
        yield
