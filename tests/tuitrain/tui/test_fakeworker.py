"""FakeWorker plays a script and answers commands the way the real worker does."""

from __future__ import annotations

import dataclasses

from tests.tuitrain.fakeworker import (
    TENSORS_PER_CHUNK,
    FakeWorker,
    GiB,
    fake_run,
    fake_stats,
    follow_settings,
)
from tuitrain.client import WorkerClient
from tuitrain.events import (
    Applied,
    Checkpoint,
    Failed,
    Finished,
    Log,
    Pause,
    Rejected,
    Resume,
    SetBudget,
    SetMargin,
    SetPolicy,
    Started,
    Step,
    Stop,
)


def steps(events) -> list[int]:
    return [e.stats.step for e in events if isinstance(e, Step)]


def test_it_is_a_worker_client():
    worker: WorkerClient = FakeWorker()
    assert not worker.alive
    worker.start()
    assert worker.alive


def test_nothing_arrives_before_start():
    worker = FakeWorker(fake_run(3))
    assert worker.poll() == []


def test_each_poll_delivers_at_most_steps_per_poll_steps_in_script_order():
    worker = FakeWorker(fake_run(5), steps_per_poll=2)
    worker.start()
    first = worker.poll()
    assert isinstance(first[0], Started) and steps(first) == [1, 2]
    assert steps(worker.poll()) == [3, 4]
    assert steps(worker.poll()) == [5]
    assert worker.poll() == []


def test_a_none_in_a_generator_means_the_rest_comes_at_a_later_poll():
    def script():
        yield Log("one")
        yield None
        yield Log("two")

    worker = FakeWorker(script)
    worker.start()
    assert [e.message for e in worker.poll()] == ["one"]
    assert [e.message for e in worker.poll()] == ["two"]


def test_emitted_events_follow_the_script():
    worker = FakeWorker([Log("scripted")], steps_per_poll=10)
    worker.emit(Log("emitted"))
    worker.start()
    assert [e.message for e in worker.poll()] == ["scripted", "emitted"]


def test_commands_are_recorded_with_increasing_ids():
    worker = FakeWorker(fake_run(2))
    worker.start()
    ids = [worker.send(SetPolicy(policy="cpu")), worker.send(Pause())]
    assert ids == [1, 2]
    assert [c.id for c in worker.commands] == ids
    assert isinstance(worker.commands[0], SetPolicy) and worker.commands[0].policy == "cpu"


def test_a_setting_is_applied_at_the_next_step_and_every_later_step_carries_it():
    worker = FakeWorker(fake_run(4, policy="auto"))
    worker.start()
    worker.poll()  # Started, step 1
    command_id = worker.send(SetPolicy(policy="cpu"))
    events = worker.poll()
    applied = [e for e in events if isinstance(e, Applied)]
    assert applied == [Applied(command_id, 2, "policy cpu")]
    assert events.index(applied[0]) < [isinstance(e, Step) for e in events].index(True)
    step_2 = events[-1].stats
    assert step_2.policy == "cpu" and step_2.applied == ["policy cpu"]
    assert worker.poll()[-1].stats.policy == "cpu"


def test_margin_and_budget_changes_carry_into_the_stats():
    worker = FakeWorker(fake_run(3))
    worker.start()
    worker.poll()
    worker.send(SetMargin(margin_ratio=0.5))
    worker.send(SetBudget(device_budget="4GiB"))
    stats = worker.poll()[-1].stats
    assert stats.margin_ratio == 0.5
    assert stats.device_budget == stats.memory.device_capacity == 4 * GiB


def test_bad_values_are_rejected_at_once_with_the_reason():
    worker = FakeWorker(fake_run(3))
    worker.start()
    worker.poll()
    margin = worker.send(SetMargin(margin_ratio=1.5))
    policy = worker.send(SetPolicy(policy="gpu"))
    budget = worker.send(SetBudget(device_budget="lots"))
    rejected = {e.id: e.reason for e in worker.poll() if isinstance(e, Rejected)}
    assert "within 0..1" in rejected[margin]
    assert "unknown policy" in rejected[policy]
    assert "not a size" in rejected[budget]
    assert worker.poll()[-1].stats.margin_ratio == 0.0


def test_pause_holds_the_steps_until_resume():
    worker = FakeWorker(fake_run(4))
    worker.start()
    worker.poll()
    pause = worker.send(Pause())
    assert worker.poll() == [Applied(pause, 1, "paused")]
    assert worker.poll() == []
    resume = worker.send(Resume())
    events = worker.poll()
    assert events[0] == Applied(resume, 1, "resumed") and steps(events) == [2]


def test_checkpoint_is_applied_at_the_last_step():
    worker = FakeWorker(fake_run(2), steps_per_poll=2)
    worker.start()
    worker.poll()
    command_id = worker.send(Checkpoint())
    assert worker.poll() == [Applied(command_id, 2, "checkpoint at step 2")]


def test_stop_is_answered_and_then_the_run_finishes():
    worker = FakeWorker(fake_run(5))
    worker.start()
    worker.poll()
    command_id = worker.send(Stop())
    events = worker.poll()
    assert events[0] == Applied(command_id, 1, "stop")
    assert isinstance(events[1], Finished) and steps(events) == []
    assert not worker.alive


def test_a_scripted_failure_ends_the_worker():
    worker = FakeWorker([*fake_run(1), Failed("boom"), *fake_run(2)[1:]], steps_per_poll=10)
    worker.start()
    assert isinstance(worker.poll()[-1], Failed)
    assert not worker.alive and worker.poll() == []


def test_stop_from_the_client_side_is_idempotent():
    worker = FakeWorker(fake_run(2))
    worker.start()
    worker.stop()
    worker.stop()
    assert worker.stop_calls == 2 and not worker.alive


# --- plausible telemetry ------------------------------------------------------------------


def test_fake_stats_are_a_pure_function_of_their_arguments():
    assert fake_stats(7, policy="cpu") == fake_stats(7, policy="cpu")


def test_fake_stats_account_for_every_parameter_and_chunk_byte():
    parameters = 1_000_003
    for policy in ("cuda", "cpu", "auto"):
        stats = fake_stats(3, policy=policy, parameters=parameters, n_chunks=10)
        counted = sum(sum(by_state.values()) for by_state in stats.memory.states.values())
        assert counted == 10 * TENSORS_PER_CHUNK
        assert sum(c.nbytes for c in stats.memory.chunks) == 2 * parameters
        assert len(stats.memory.chunks) == 10


def test_fake_stats_place_chunks_by_policy():
    cuda = fake_stats(1, policy="cuda").memory
    cpu = fake_stats(1, policy="cpu").memory
    assert all(c.location == "device" for c in cuda.chunks)
    assert [c.state for c in cpu.chunks if c.location == "device"] == ["COMPUTE"]
    small = fake_stats(1, policy="auto", device_budget=3 * GiB, parameters=1_300_000_000).memory
    locations = {c.location for c in small.chunks}
    assert locations == {"device", "host"}
    assert small.device_peak <= small.device_capacity


def test_the_margin_brings_optimizer_state_onto_the_device():
    without = fake_stats(5, policy="cpu", margin_ratio=0.0).memory
    with_margin = fake_stats(5, policy="cpu", margin_ratio=0.5).memory
    assert with_margin.device_model > without.device_model
    assert with_margin.host_model < without.host_model
    assert with_margin.device_peak <= with_margin.device_capacity


def test_the_time_split_adds_up_and_the_loss_decreases():
    stats = [fake_stats(step) for step in (1, 100)]
    for s in stats:
        assert abs(s.forward + s.backward + s.optimizer + s.transfer - s.seconds) < 1e-12
    assert stats[1].loss < stats[0].loss


def test_follow_settings_redraws_each_step_under_the_settings_in_force():
    run = dict(parameters=1_315_758_080, n_chunks=72, device_budget=3 * GiB)
    worker = FakeWorker(
        [Step(fake_stats(n, **run)) for n in (1, 2, 3)], restep=follow_settings(**run)
    )
    worker.start()
    (first,) = worker.poll()
    worker.send(SetPolicy(policy="cpu"))
    applied, second = worker.poll()
    assert isinstance(applied, Applied)
    assert second.stats == dataclasses.replace(
        fake_stats(2, policy="cpu", **run), applied=["policy cpu"]
    )
    assert second.stats.seconds != first.stats.seconds


# --- the disk tier ------------------------------------------------------------------------

OPT_1_3B = dict(parameters=1_315_758_080, n_chunks=72, device_budget=3 * GiB)


def test_no_host_budget_or_one_that_holds_everything_reports_no_disk():
    for budget in (None, 64 * GiB):
        stats = fake_stats(4, policy="cpu", host_budget=budget, **OPT_1_3B)
        memory = stats.memory
        assert (memory.disk_model, memory.host_io_buffers) == (0, 0)
        assert (stats.bytes_disk_read, stats.bytes_disk_written, stats.disk_wait) == (0, 0, 0)
        assert set(memory.states) == {"device", "host"}
        assert stats == fake_stats(4, policy="cpu", **OPT_1_3B)


def test_a_host_budget_sends_optimizer_state_first_then_the_last_payloads():
    whole = fake_stats(4, policy="cpu", **OPT_1_3B).memory.host_model
    state_only = fake_stats(4, policy="cpu", host_budget=whole * 3 // 4, **OPT_1_3B)
    payloads = fake_stats(4, policy="cpu", host_budget=whole // 10, **OPT_1_3B)
    for stats, budget in ((state_only, whole * 3 // 4), (payloads, whole // 10)):
        memory = stats.memory
        assert memory.host_model + memory.host_io_buffers <= budget
        assert memory.host_model + memory.disk_model == whole  # nothing lost, nothing made up
        assert "disk" in memory.states and stats.bytes_disk_read >= memory.disk_model > 0
        assert stats.bytes_disk_written > 0 and stats.disk_wait > 0
    assert all(c.location != "disk" for c in state_only.memory.chunks)
    on_disk = [c.index for c in payloads.memory.chunks if c.location == "disk"]
    on_host = [c.index for c in payloads.memory.chunks if c.location == "host"]
    assert on_disk and min(on_disk) > max(on_host)  # the last used go first
    disk_states = payloads.memory.states["disk"]
    assert sum(disk_states.values()) == len(on_disk) * TENSORS_PER_CHUNK
    counted = sum(sum(by_state.values()) for by_state in payloads.memory.states.values())
    assert counted == 72 * TENSORS_PER_CHUNK
    stats = payloads
    split = stats.forward + stats.backward + stats.optimizer + stats.transfer
    assert abs(split + stats.disk_wait - stats.seconds) < 1e-12


def test_fake_run_carries_the_host_budget_to_every_step():
    events = fake_run(3, policy="cpu", host_budget=2 * GiB, **OPT_1_3B)
    steps = [e.stats for e in events if isinstance(e, Step)]
    assert len(steps) == 3 and all(s.memory.disk_model > 0 for s in steps)
    assert steps[-1] == fake_stats(3, policy="cpu", host_budget=2 * GiB, **OPT_1_3B)
