"""The disk tier: under a host budget, training state that does not fit on the host lives in a
scratch folder, and placement still changes where bytes live, never the math.

In fp32 every policy, with the optimizer state on disk or the payloads too, and with live
changes of policy and margin, gives the losses and weights of torch.optim.AdamW; in bf16
and fp16 the same bits as the engine without a disk. The folder is the run's own and goes
with it; a full disk or an unwritable folder is a clear error that loses nothing.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
import torch
from conftest import (
    build,
    make_batches,
    max_relative_difference,
    reference_run,
    sample_host_peak,
)

from engine import Engine, EngineConfig
from engine.devices.device import SIMULATE_ENV
from engine.devices.disk import (
    DiskTier,
    DiskTierError,
    ScratchFolder,
    direct_io_supported,
    files,
    remove_stale,
)
from engine.placement import disk_rules, rules

STEPS = 4
TOL = 1e-5
BATCHES = make_batches(STEPS)
MODEL = build("opt", layers=8, hidden=128)
DEVICE = "64MiB"

# What the tests compare with and size their budgets by is made when a test first asks for
# it, once (functools.cache), not when the module is imported: under pytest-xdist every
# worker imports every test module to collect it, and only one of them runs this one.


@cache
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch with fused AdamW over MODEL and BATCHES."""
    return reference_run(MODEL, BATCHES)


@cache  # the same answer for every test that sizes a budget by it
def host_state(precision: str = "fp32") -> int:
    """Chunk bytes on the host with no budget and nothing resident (policy cpu), with the
    fp32 gradients' landing places, which are there from their landing to the update."""
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(policy="cpu", device_budget=DEVICE,
                                                    precision=precision))
    assert all(c.host_grad is None for c in eng.chunks)  # made as gradients land
    nbytes = eng.manager.host_bytes + sum(4 * c.home_numel for c in eng.chunks
                                          if c.aliased and not c.frozen)
    eng.close()
    return nbytes


def host_budget(host: str) -> int:
    """Optimizer state (moments, in fp32) of some chunks on disk ("state"); and payloads
    too ("payload")."""
    return int(host_state() * {"state": 0.8, "payload": 0.3}[host])


@cache
def plain_run(steps: int = STEPS, **config) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The engine without a disk (fp32 and policy cpu unless `config` says otherwise) over
    the first `steps` batches: its losses and its state's tensors, made once for the tests
    that compare a run with the disk against the same one (nothing changes them)."""
    plain = Engine(copy.deepcopy(MODEL), EngineConfig(
        **{"policy": "cpu", "device_budget": DEVICE, **config}))
    losses = [plain.step(b).loss for b in BATCHES[:steps]]
    tensors = {k: v.clone() for k, v in plain.state_dict()["tensors"].items()}
    plain.close()
    return losses, tensors


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    return tmp_path / "scratch"


@pytest.fixture(scope="module", autouse=True)
def exiting_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen]:
    """A fresh interpreter that builds an engine with state on disk, takes a step and exits
    without close(), printing its scratch folder. Started with the module's first test, so
    that its seconds of imports run beside the tests in this process rather than after
    them; the test of what an exiting process leaves waits for it to end."""
    disk = tmp_path_factory.mktemp("exiting") / "scratch"
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from conftest import build, make_batches
        from engine import Engine, EngineConfig
        eng = Engine(build("opt", layers=8, hidden=128), EngineConfig(
            policy="cpu", device_budget="64MiB", host_budget={host_budget("state")},
            disk_dir={str(disk)!r}))
        eng.step(make_batches(1)[0])
        print(eng.manager.spill.tier.path)
    """)  # exits without close()
    # The simulated device, as every test's processes get it (tests/conftest.py), which sets
    # it for each test: after a module's fixtures.
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               cwd=Path(__file__).parents[2],
                               env={**os.environ, SIMULATE_ENV: "1"})
    yield process
    if process.poll() is None:  # its test failed before waiting for it
        process.kill()
    process.communicate()


def engine(disk_dir: Path, *, policy: str = "cpu", host: str = "state", margin: float = 0.0,
           precision: str = "fp32", model=MODEL, **config) -> Engine:
    budget = config.pop("host_budget", None) or host_budget(host)
    return Engine(copy.deepcopy(model), EngineConfig(
        policy=policy, device_budget=DEVICE, margin_ratio=margin, precision=precision,
        host_budget=budget, disk_dir=disk_dir, **config))


def levels(eng: Engine) -> list[int]:
    return [c.disk_level for c in eng.chunks]


def within_host_budget(eng: Engine) -> bool:
    m = eng.manager
    return m.host_bytes + m.io_buffer_bytes <= eng.config.host_budget


def run(eng: Engine, batches=BATCHES, changes=()) -> list[float]:
    losses = []
    for i, batch in enumerate(batches):
        for kind, value in changes[i] if i < len(changes) else ():
            getattr(eng, f"set_{kind}")(value)
        stats = eng.step(batch)
        assert within_host_budget(eng)
        losses.append(stats.loss)
    return losses


def assert_matches_reference(eng: Engine, losses: list[float]) -> None:
    ref_losses, ref_weights = reference()
    for ours, theirs in zip(losses, ref_losses, strict=True):
        assert abs(ours - theirs) <= TOL * abs(theirs)
    assert max_relative_difference(eng.model_state_dict(), ref_weights) <= TOL


# --- what goes to disk ---------------------------------------------------------------------


def test_the_budgets_force_state_then_payloads_to_disk(disk_dir):
    state = engine(disk_dir, host="state")
    assert 1 in levels(state) and 2 not in levels(state)
    payload = engine(disk_dir, host="payload")
    assert 2 in levels(payload)
    for eng in (state, payload):
        assert within_host_budget(eng)
        eng.close()


def test_no_budget_or_one_that_holds_everything_uses_no_disk(disk_dir):
    eng = engine(disk_dir, host_budget=host_state())
    assert levels(eng) == [0] * len(eng.chunks) and eng.manager.spill is None
    assert not disk_dir.exists() or not any(disk_dir.iterdir())
    eng.close()


def test_the_rule_moves_the_last_used_chunks_state_first_then_their_payloads():
    n = 40
    costs = [rules.disk_cost(4096, 4, 4096) for _ in range(n)]
    whole = sum(c.host_state + c.host_payload for c in costs)

    def place(budget: int, on_host=range(n)) -> rules.DiskPlacement:
        return rules.disk_placement(costs, on_host=on_host, host_budget=budget, block=4096)

    assert place(whole).state == frozenset() and place(whole).buffer_bytes == 0
    some = place(whole - 1)
    assert sorted(some.state) == list(range(n - len(some.state), n)) and not some.payload
    assert some.host_total <= whole - 1 and some.buffers == {"state": (3, 32768)}
    least = place(whole // 4)
    assert least.state == frozenset(range(n))
    assert sorted(least.payload) == list(range(n - len(least.payload), n))
    assert least.host_total <= whole // 4 and least.buffers["payload"] == (6, 16384)
    # As few as will do: one chunk fewer would not fit.
    assert place(whole // 4 + costs[0].host_payload).payload < least.payload
    # Resident chunks are not the host's to place; the same inputs give the same answer.
    assert place(whole // 2, on_host=range(n - 1)).state.isdisjoint({n - 1})
    assert least == place(whole // 4)


def test_a_host_budget_below_the_io_buffers_is_refused_with_the_numbers(disk_dir):
    with pytest.raises(rules.HostBudgetTooSmall, match="host budget .* is below"):
        engine(disk_dir, host_budget=1024)


# --- the invariant ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["cpu", "auto"])
@pytest.mark.parametrize("host", ["state", "payload"])
@pytest.mark.parametrize("margin", [0.0, 0.1])
def test_every_policy_with_state_or_payloads_on_disk_matches_adamw(disk_dir, policy, host,
                                                                   margin):
    # The first step runs with nothing resident (the margin needs its trace); then a margin
    # of 0.1 makes a few chunks resident, which leaves the host, so less goes to disk.
    eng = engine(disk_dir, policy=policy, host=host, margin=margin)
    assert max(levels(eng)) == {"state": 1, "payload": 2}[host]
    losses = run(eng)
    assert any(c.resident for c in eng.chunks) == (margin > 0)
    placement = eng.manager.disk_placement({c.index for c in eng.chunks if c.resident})
    assert levels(eng) == [placement.level(c.index) for c in eng.chunks]
    assert_matches_reference(eng, losses)
    eng.close()


@pytest.mark.parametrize("host", ["state", "payload"])
def test_cuda_and_live_changes_of_policy_and_margin_match_adamw(disk_dir, host):
    # cuda keeps everything on the device (nothing on the host to spill); switching to cpu
    # brings every chunk home, where the budget sends state or payloads on to disk.
    changes = [(), [("policy", "cpu")], [("margin", 0.5), ("policy", "auto")],
               [("policy", "cuda")]]
    eng = engine(disk_dir, policy="cuda", host=host)
    assert levels(eng) == [0] * len(eng.chunks)
    seen = []
    losses = []
    for i, batch in enumerate(BATCHES):
        for kind, value in changes[i]:
            getattr(eng, f"set_{kind}")(value)
        losses.append(eng.step(batch).loss)
        assert within_host_budget(eng)
        seen.append(max(levels(eng)))
    assert seen[0] == 0 and seen[1] == {"state": 1, "payload": 2}[host]
    assert_matches_reference(eng, losses)
    eng.close()


@pytest.mark.parametrize("changes", [
    [(), [("margin", 1.0)], [("margin", 0.0), ("policy", "auto")], [("policy", "cpu")]],
    [[("policy", "auto")], [("margin", 0.25)], [("policy", "cpu"), ("margin", 0.5)], ()],
])
def test_live_changes_with_payloads_on_disk_match_adamw(disk_dir, changes):
    eng = engine(disk_dir, policy="cpu", host="payload")
    losses = run(eng, changes=changes)
    assert_matches_reference(eng, losses)
    eng.close()


def test_the_host_budget_holds_during_the_step_too(disk_dir):
    """Chunk bytes and I/O buffers, sampled at every allocation and free of the step."""
    eng = engine(disk_dir, policy="cpu", host="payload")
    peak = sample_host_peak(eng)
    run(eng, BATCHES[:2])
    assert 0 < peak[0] <= eng.config.host_budget
    eng.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_building_holds_the_host_budget_but_for_the_one_chunk_being_placed(
        disk_dir, monkeypatch, precision):
    """Chunks are filled one at a time and placed before the next: the host never holds
    the whole state at once (before, it held all of it, then spilled), and what was built
    is exactly what a build without a budget gives."""
    from engine.chunks.manager import ChunkManager

    full = host_state(precision)
    peak = [0]
    count_host = ChunkManager.count_host

    def counted(self, chunks):
        count_host(self, chunks)
        peak[0] = max(peak[0], self.host_bytes + self.io_buffer_bytes)

    monkeypatch.setattr(ChunkManager, "count_host", counted)
    eng = engine(disk_dir, policy="cpu", host="payload", precision=precision)
    full_chunk = max(rules.disk_cost(c.numel, c.itemsize, 4096).host_state
                     + rules.disk_cost(c.numel, c.itemsize, 4096).host_payload
                     for c in eng.chunks)
    budget = eng.config.host_budget
    assert full_chunk < budget < full
    assert 0 < peak[0] <= budget + full_chunk
    assert within_host_budget(eng) and any(levels(eng))
    plain = Engine(copy.deepcopy(MODEL), EngineConfig(policy="cpu", device_budget=DEVICE,
                                                      precision=precision))
    for name, weight in plain.model_state_dict().items():
        assert torch.equal(eng.model_state_dict()[name], weight), name
    plain.close()
    eng.close()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("host", ["state", "payload"])
def test_half_precision_with_the_disk_gives_the_same_bits_as_without(disk_dir, precision, host):
    plain_losses, theirs = plain_run(policy="auto", precision=precision, max_grad_norm=0.5)
    budget = int(host_state(precision) * (0.8 if host == "state" else 0.2))
    eng = engine(disk_dir, policy="auto", precision=precision, host_budget=budget,
                 max_grad_norm=0.5)
    assert max(levels(eng)) == (1 if host == "state" else 2)
    assert run(eng) == plain_losses
    ours = eng.state_dict()["tensors"]
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    eng.close()


# Pieces of 5000 elements: every chunk of MODEL (~65k elements) is cut into a dozen or so,
# each piece of each region read, updated and written on its own, parameters straddling
# pieces included.
SMALL_PIECE = 5000


@pytest.mark.parametrize("numel, piece", [(4_860_928, 2**22), (65_920, SMALL_PIECE),
                                          (2**22 + 32, 2**22), (100_000, 2**14)])
def test_a_chunk_over_a_piece_is_cut_into_as_few_pieces_of_one_size_as_fit(numel, piece):
    """Never a whole piece and a small tail, which the update's walk overlaps badly (the
    Llama-shaped model's 4.86M-element chunks at pieces of 4.19M); each cut where a
    parameter may start (rules.ELEMENT_ALIGN), so a parameter split across pieces is
    updated as it is whole."""
    size = rules.piece_elements(numel, piece)
    count = -(-numel // size)
    assert size <= piece and size % rules.ELEMENT_ALIGN == 0
    assert count == -(-numel // piece)
    assert numel - (count - 1) * size > size - count * rules.ELEMENT_ALIGN  # no small tail
    assert rules.disk_cost(numel, 4, 4096, piece).pieces == count
    assert rules.piece_elements(piece, piece) == piece == rules.piece_elements(piece, 2 * piece)


def test_a_placement_with_smaller_pieces_gets_smaller_io_buffers(disk_dir):
    """The pools are made at the size the placement in force counts: when chunks with
    larger pieces leave the disk (resident on the device), their buffers go too, else the
    host would hold more than its budget says."""
    tier = DiskTier(ScratchFolder(disk_dir), probe=4 * 4096)
    try:
        tier.size_pools({"state": (3, 8 * 4096)})
        large = tier.buffer_bytes
        tier.size_pools({"state": (3, 2 * 4096)})
        assert tier.buffer_bytes == 3 * (2 * 4096 + 4096) < large
        tier.size_pools({"state": (4, 2 * 4096)})
        assert tier.buffer_bytes == 4 * (2 * 4096 + 4096)
    finally:
        tier.close()


@pytest.mark.parametrize("policy", ["cpu", "auto"])
@pytest.mark.parametrize("host", ["state", "payload"])
def test_chunks_larger_than_a_piece_go_piece_by_piece_and_match_adamw(disk_dir, monkeypatch,
                                                                      policy, host):
    monkeypatch.setattr(disk_rules, "DISK_PIECE", SMALL_PIECE)
    eng = engine(disk_dir, policy=policy, host=host)
    assert all(len(eng.manager.spill.spans(c)) > 1 for c in eng.chunks if c.disk_level)
    assert eng.manager.spill.placement.state_buffer <= 3 * 4 * SMALL_PIECE + 4096
    losses = run(eng)
    assert_matches_reference(eng, losses)
    state = eng.state_dict()
    eng.load_state_dict(state)
    again = eng.state_dict()["tensors"]
    assert all(torch.equal(v, again[k]) for k, v in state["tensors"].items())
    eng.close()


@pytest.mark.parametrize("host", ["state", "payload"])
def test_bf16_piece_by_piece_gives_the_same_bits_as_without_the_disk(disk_dir, monkeypatch,
                                                                     host):
    monkeypatch.setattr(disk_rules, "DISK_PIECE", SMALL_PIECE)
    plain_losses, theirs = plain_run(precision="bf16", max_grad_norm=0.5)
    budget = int(host_state("bf16") * (0.8 if host == "state" else 0.2))
    eng = engine(disk_dir, precision="bf16", host_budget=budget, max_grad_norm=0.5)
    assert run(eng) == plain_losses
    ours = eng.state_dict()["tensors"]
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    eng.close()


def test_accumulated_micro_batches_with_payloads_on_disk_give_the_same_bits(disk_dir):
    # A later micro-batch's gradients add up where the first ones went: they come home.
    batches = make_batches(2, batch_size=4, seed=7)
    plain = Engine(copy.deepcopy(MODEL), EngineConfig(device_budget=DEVICE, grad_accum=2))
    eng = engine(disk_dir, policy="auto", host="payload", grad_accum=2)
    assert run(eng, batches) == [plain.step(b).loss for b in batches]
    assert levels(eng) == levels(engine(disk_dir, policy="auto", host="payload"))
    ours, theirs = eng.model_state_dict(), plain.model_state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


# --- the update overlapping the next forward --------------------------------------------------


def slow_reads(monkeypatch) -> None:
    """Every read from a scratch file takes 20 ms longer: the update outlasts step()."""
    import time

    read = files.ScratchFile.read

    def slow(self, buffer, offset):
        time.sleep(0.02)
        read(self, buffer, offset)

    monkeypatch.setattr(files.ScratchFile, "read", slow)


def test_the_update_overlaps_the_next_forward_which_sees_its_weights(disk_dir, monkeypatch):
    slow_reads(monkeypatch)
    eng = engine(disk_dir, policy="auto", host="state")
    losses, running = [], []
    for batch in BATCHES:
        losses.append(eng.step(batch).loss)
        running.append(eng.manager.flight.active)
    assert any(running) and eng.manager.overlap_update()
    assert_matches_reference(eng, losses)
    eng.close()


def test_payloads_on_disk_update_within_the_step(disk_dir):
    eng = engine(disk_dir, host="payload")
    eng.step(BATCHES[0])
    assert not eng.manager.overlap_update() and not eng.manager.flight.active
    eng.close()


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_interrupt_while_the_last_update_runs_changes_nothing(disk_dir, monkeypatch, where):
    from engine.step.engine import StepInterrupted

    slow_reads(monkeypatch)
    eng = engine(disk_dir, policy="cpu", host="state")
    losses = [eng.step(b).loss for b in BATCHES[:2]]
    points = len(eng.trace.points)
    boundary = 2 if where == "forward" else points - 1
    point, seen = eng.runner._point, [0]

    def counting(key, phase, *fetch):
        if seen[0] == boundary:
            eng.interrupt()
        seen[0] += 1
        point(key, phase, *fetch)

    eng.runner._point = counting
    with pytest.raises(StepInterrupted):
        eng.step(BATCHES[2])
    del eng.runner._point
    assert eng.step_count == 2 and not any(c.holds_grads for c in eng.chunks)
    losses += [eng.step(b).loss for b in BATCHES[2:]]
    assert_matches_reference(eng, losses)
    eng.close()


# --- checkpoints and telemetry --------------------------------------------------------------


@pytest.mark.parametrize("host", ["state", "payload"])
def test_state_dict_reads_the_disk_back_and_resumes_exactly(disk_dir, host):
    first = engine(disk_dir, host=host)
    run(first, BATCHES[:2])
    state = first.state_dict()
    assert all(torch.equal(state["tensors"][k], v) for k, v in plain_run(2)[1].items())
    first.close()
    resumed = engine(disk_dir, host=host)
    resumed.load_state_dict(state)
    losses = [resumed.step(b).loss for b in BATCHES[2:]]
    ref_losses, ref_weights = reference()
    for ours, theirs in zip(losses, ref_losses[2:], strict=True):
        assert abs(ours - theirs) <= TOL * abs(theirs)
    assert max_relative_difference(resumed.model_state_dict(), ref_weights) <= TOL
    with pytest.raises(ValueError, match="state has no"):
        resumed.load_state_dict({"tensors": {}, "meta": state["meta"]})
    resumed.close()


def test_steps_report_the_disk(disk_dir):
    eng = engine(disk_dir, host="payload")
    stats = [eng.step(b) for b in BATCHES[:2]][-1]
    assert stats.bytes_disk_read > 0 and stats.bytes_disk_written > 0 and stats.disk_wait >= 0
    memory = stats.memory
    assert memory.disk_model == eng.manager.disk_bytes > 0
    assert 0 < memory.host_io_buffers and memory.host_model == eng.manager.host_bytes
    # The disk measured once when the tier opened, for the app to compare the tier with.
    assert memory.disk_read_bandwidth > 0 and memory.disk_write_bandwidth > 0
    assert {c.location for c in memory.chunks} == {"host", "disk"}
    assert sum(memory.states["disk"].values()) > 0
    eng.close()
    plain = Engine(copy.deepcopy(MODEL), EngineConfig(policy="cpu", device_budget=DEVICE))
    stats = plain.step(BATCHES[0])
    assert (stats.bytes_disk_read, stats.bytes_disk_written, stats.memory.disk_model) == (0, 0, 0)
    assert stats.memory.disk_read_bandwidth == stats.memory.disk_write_bandwidth == 0
    assert set(stats.memory.states) == {"device", "host"}


@pytest.mark.parametrize("host", ["state", "payload"])
def test_every_byte_the_disk_moves_is_reported_once_even_when_the_update_overlaps(disk_dir,
                                                                                 host):
    """With only optimizer state on disk the update of step k runs into step k+1's forward;
    its reads and writes are reported with step k, not lost between the two."""
    eng = engine(disk_dir, host=host)
    tier = eng.manager.spill.tier
    start = (tier.bytes_read, tier.bytes_written)
    steps = [eng.step(b) for b in BATCHES]
    eng.manager.flight.wait()  # the last update's I/O, reported by no step yet
    later = eng.manager.disk_counters()
    assert sum(s.bytes_disk_read for s in steps) + later[0] == tier.bytes_read - start[0]
    assert sum(s.bytes_disk_written for s in steps) + later[1] == tier.bytes_written - start[1]
    # A steady step's update reads and writes the state of every chunk it keeps on disk:
    # those of steps 3 on are reported by steps 3 on.
    state = sum(rules.disk_cost(c.numel, c.itemsize, 4096).state_region
                for c in eng.chunks if c.state_on_disk)
    assert state > 0
    settled = len(steps[2:])
    assert sum(s.bytes_disk_written for s in steps[2:]) + later[1] >= settled * state
    assert sum(s.bytes_disk_read for s in steps[2:]) + later[0] >= settled * state
    eng.close()


# --- the scratch folder ------------------------------------------------------------------------


def run_folder(eng: Engine) -> Path:
    return eng.manager.spill.tier.path


def test_the_folder_is_private_and_goes_at_close(disk_dir):
    eng = engine(disk_dir, host="payload")
    eng.step(BATCHES[0])
    folder = run_folder(eng)
    assert folder.parent == disk_dir and folder.name.startswith(f"run-{os.getpid()}-")
    assert folder.stat().st_mode & 0o777 == 0o700
    data = [p for p in folder.iterdir() if p.name != "lock"]
    assert data and all(p.stat().st_mode & 0o777 == 0o600 for p in data)
    eng.close()
    assert not folder.exists() and disk_dir.exists()


def test_a_dropped_engine_and_an_exiting_process_leave_no_folder(disk_dir, exiting_process):
    eng = engine(disk_dir)
    folder = run_folder(eng)
    del eng
    import gc

    gc.collect()
    assert not folder.exists()
    out, err = exiting_process.communicate(timeout=240)
    assert exiting_process.returncode == 0, err
    assert not Path(out.strip()).exists()


def test_a_dead_runs_folder_is_removed_at_the_next_start_and_nothing_else(disk_dir):
    disk_dir.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = disk_dir / f"run-{dead}-0123abcd"
    stale.mkdir()
    (stale / "lock").touch()
    (stale / "chunk-00000").write_bytes(b"x" * 100)
    half_made = disk_dir / f".new-{dead}-89abcdef"  # died before it could lock
    half_made.mkdir()
    # A live run's folder (its lock held), and things that are not run folders at all.
    live = disk_dir / f"run-{os.getpid()}-deadbeef"
    live.mkdir()
    fd = os.open(live / "lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    mine = disk_dir / "run-notes"
    mine.mkdir()
    (disk_dir / "run-1-0123abcd.txt").write_text("a file")
    try:
        eng = engine(disk_dir)
        assert not stale.exists() and not half_made.exists()
        assert live.exists() and mine.exists() and (disk_dir / "run-1-0123abcd.txt").exists()
        eng.close()
    finally:
        os.close(fd)
    assert remove_stale(disk_dir) == [live]  # its owner (the lock) is gone now


def test_a_folder_that_cannot_be_written_is_a_value_error_naming_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match=f"scratch folder {blocker / 'scratch'}"):
        engine(blocker / "scratch")
    if os.geteuid() == 0:
        return  # root writes anywhere: the mode test below needs an ordinary user
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match=f"scratch folder {locked} is not writable"):
        engine(locked)


def test_too_little_free_space_is_refused_before_the_first_step(disk_dir, monkeypatch):
    import shutil

    real = shutil.disk_usage

    def almost_full(path):
        return real(path)._replace(free=1000)

    monkeypatch.setattr(shutil, "disk_usage", almost_full)
    with pytest.raises(ValueError, match=r"needs .* on disk, but the scratch folder .* has "
                                         r"1000 B free"):
        engine(disk_dir, host="payload")
    assert not any(disk_dir.iterdir())  # nothing left behind


@pytest.mark.parametrize("host", ["state", "payload"])
def test_a_full_disk_mid_run_is_a_clean_error_and_loses_nothing(disk_dir, monkeypatch, host):
    eng = engine(disk_dir, host=host)
    eng.step(BATCHES[0])
    eng.manager.flight.wait()  # its update and writes are over before the disk fills up
    eng.manager.spill.tier.flush()
    real = os.pwritev

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(DiskTierError, match="No space left on device.*Step 2 is applied") as e:
        eng.step(BATCHES[1])
        # An update that overlaps the next step's forward (state on disk, payloads not)
        # tells at the end of that step, which is then not applied.
        assert eng.manager.overlap_update()
        eng.step(BATCHES[2])
    assert e.value.errno == errno.ENOSPC and eng.step_count == 2
    # What could not be written is held; a checkpoint now has step 2's state.
    ours, theirs = eng.state_dict()["tensors"], plain_run(2)[1]
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    with pytest.raises(DiskTierError, match="No space left"):
        eng.step(BATCHES[2])  # still full: refused before anything changes
    assert eng.step_count == 2
    monkeypatch.setattr(os, "pwritev", real)  # space was freed
    losses = [eng.step(b).loss for b in BATCHES[2:]]
    ref_losses, ref_weights = reference()
    for ours, theirs in zip(losses, ref_losses[2:], strict=True):
        assert abs(ours - theirs) <= TOL * abs(theirs)
    assert max_relative_difference(eng.model_state_dict(), ref_weights) <= TOL
    assert eng.manager.spill.tier.held_bytes == 0
    eng.close()


# --- O_DIRECT ------------------------------------------------------------------------------


def test_direct_io_is_used_where_the_filesystem_takes_it(disk_dir):
    eng = engine(disk_dir)
    assert eng.manager.spill.tier.direct == direct_io_supported(run_folder(eng))
    eng.close()


def test_a_filesystem_that_refuses_o_direct_gets_buffered_io_that_drops_its_cache(
        disk_dir, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "O_DIRECT refused")
        return real_open(path, flags, *args, **kwargs)

    advised = []
    real_advise = os.posix_fadvise

    def advise(fd, offset, length, advice):
        advised.append(advice)
        return real_advise(fd, offset, length, advice)

    monkeypatch.setattr(os, "open", no_direct)
    monkeypatch.setattr(files.os, "posix_fadvise", advise)
    eng = engine(disk_dir, host="payload")
    assert eng.manager.spill.tier.direct is False
    losses = run(eng)
    assert_matches_reference(eng, losses)
    assert advised and set(advised) == {os.POSIX_FADV_DONTNEED}
    eng.close()
