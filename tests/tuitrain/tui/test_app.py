"""The terminal app on a scripted worker: keys send commands, events reach every panel."""

from __future__ import annotations

import time

import pytest
from textual.widgets import Select, Static

from tests.tuitrain.fakeworker import FakeWorker, GiB, fake_run, fake_started, fake_stats
from tuitrain.events import (
    Applied,
    Checkpoint,
    Failed,
    Log,
    Pause,
    Rejected,
    Resume,
    SetBudget,
    SetMargin,
    SetPolicy,
    Started,
    Step,
)
from tuitrain.settings import Settings
from tuitrain.tui import screenshot
from tuitrain.tui.app import TuitrainApp
from tuitrain.tui.chunk_map import ChunkMap
from tuitrain.tui.controls import Controls
from tuitrain.tui.failure_panel import FailurePanel
from tuitrain.tui.header import RunHeader
from tuitrain.tui.help_screen import HelpScreen
from tuitrain.tui.layout import views_for
from tuitrain.tui.log_panel import LogPanel
from tuitrain.tui.memory_chart import HISTORY, MemoryChart
from tuitrain.tui.states_table import StatesTable
from tuitrain.tui.step_panel import StepPanel

from .helpers import SIZE, make_app, palette_offers, settle

pytestmark = pytest.mark.anyio


def commands_of(fake: FakeWorker, kind: type) -> list:
    return [c for c in fake.commands if isinstance(c, kind)]


# --- keys send the right commands ---------------------------------------------------------


async def test_c_cycles_the_policy_from_the_one_asked_for_last():
    app, fake = make_app(fake_run(3, policy="cuda"), settings=_settings(policy="cuda"))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("c")
        await pilot.press("c")
        await pilot.press("c")
    assert [c.policy for c in commands_of(fake, SetPolicy)] == ["cpu", "auto", "cuda"]


async def test_plus_and_minus_move_the_margin_by_five_hundredths_within_0_and_1():
    app, fake = make_app(fake_run(3, margin_ratio=0.95), settings=_settings(margin_ratio=0.95))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("plus")
        await pilot.press("plus")  # already at 1: nothing to send
        assert "already 1.00" in app.query_one(Controls).message
        await pilot.press("minus", "minus")
    assert [c.margin_ratio for c in commands_of(fake, SetMargin)] == [1.0, 0.95, 0.9]


async def test_minus_stops_at_zero():
    app, fake = make_app(fake_run(2))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("minus")
    assert commands_of(fake, SetMargin) == []


async def test_space_pauses_then_resumes():
    app, fake = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("space")
        await settle(app, pilot)
        assert app.run_state == "paused"
        assert "paused" in app.query_one(RunHeader).plain
        await pilot.press("space")
        await settle(app, pilot)
        assert app.run_state == "running"
    assert [type(c) for c in fake.commands] == [Pause, Resume]


async def test_space_pauses_even_when_the_policy_select_has_focus():
    app, fake = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        app.query_one("#policy").focus()
        await pilot.press("space")
    assert [type(c) for c in fake.commands] == [Pause]


async def test_q_stops_the_worker_and_quits():
    app, fake = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("q")
        await pilot.pause()
        assert fake.stop_calls >= 1
        assert not fake.alive
    assert app.return_code == 0


async def test_checkpoint_is_sent_from_the_command_palette(tmp_path):
    app, fake = make_app(fake_run(3), settings=_checkpointed(tmp_path))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"checkpoint")
        await palette_offers(app, pilot, "checkpoint")
        await pilot.press("enter")
        await settle(app, pilot)
        assert "checkpoint" in app.query_one(LogPanel).messages[-1]
    assert [type(c) for c in fake.commands] == [Checkpoint]


async def test_the_palette_lists_every_key_action_that_can_run_now(tmp_path):
    app, _ = make_app(fake_run(1), settings=_checkpointed(tmp_path))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        titles = [command.title for command in app.get_system_commands(app.screen)]
    assert {
        "Cycle policy",
        "Margin +0.05",
        "Margin -0.05",
        "Pause",
        "Save preset",
        "Tune",
        "Save checkpoint",
        "Help",
        "Quit",
    } <= set(titles)
    assert "Restart run" not in titles  # a live run is steered, not restarted
    assert titles.count("Quit") == 1  # ours, which stops the worker first
    assert "Keys" not in titles  # Textual's key panel: Help lists them all already


async def test_after_a_failure_the_palette_offers_restart_and_not_pause():
    app, _ = make_app([*fake_run(1), Failed("boom")])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        titles = {command.title for command in app.get_system_commands(app.screen)}
    assert "Restart run" in titles
    assert not {"Pause", "Resume", "Save checkpoint"} & titles


async def test_restart_from_the_palette_does_nothing_to_a_live_run():
    app, fake = make_app(fake_run(2))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await app.run_action("restart")  # the palette runs actions without the key check
        await settle(app, pilot)
        assert app.run_state == "running"
    assert fake.stop_calls == 1  # the one of quitting, not of a restart


async def test_question_mark_shows_the_keys_and_escape_closes_them():
    app, _ = make_app(fake_run(1))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_keys_of_the_main_screen_do_nothing_while_help_is_open():
    app, fake = make_app(fake_run(2))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("question_mark", "c", "space", "plus")
    assert fake.commands == []


# --- the controls -------------------------------------------------------------------------


async def test_a_margin_outside_0_to_1_is_refused_on_screen_and_never_sent():
    app, fake = make_app(fake_run(2))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await type_into(pilot, "#margin", "1.5")
        assert app.query_one("#margin").value == "1.5"
        await pilot.press("enter")
        message = app.query_one(Controls).message
    assert "within 0..1" in message and "1.5" in message
    assert fake.commands == []


async def test_a_margin_typed_in_the_field_is_sent():
    app, fake = make_app(fake_run(2))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await type_into(pilot, "#margin", "0.4")
        await pilot.press("enter")
    assert [c.margin_ratio for c in fake.commands] == [0.4]


async def test_choosing_a_policy_in_the_select_sends_it_once():
    app, fake = make_app(fake_run(2))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        app.query_one("#policy").value = "cpu"
        await pilot.pause()
        await pilot.press("c")  # from cpu, the one asked for last, to auto
        await pilot.pause()
    assert [c.policy for c in commands_of(fake, SetPolicy)] == ["cpu", "auto"]


async def test_the_budget_field_sends_a_size_and_refuses_nonsense():
    app, fake = make_app(fake_run(2))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await type_into(pilot, "#budget", "lots")
        await pilot.press("enter")
        assert "not a size" in app.query_one(Controls).message
        await type_into(pilot, "#budget", "4GiB")
        await pilot.press("enter")
    assert [c.device_budget for c in fake.commands] == ["4GiB"]
    assert all(isinstance(c, SetBudget) for c in fake.commands)


async def test_the_budget_field_is_disabled_on_a_real_gpu():
    started = Started("opt-125m", 125_000_000, "NVIDIA GeForce RTX 3060, 6.0 GiB", [], {})
    app, _ = make_app([started])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.query_one("#budget").disabled


# --- events reach the panels --------------------------------------------------------------


async def test_step_events_update_every_panel():
    settings = _settings(policy="cpu")
    app, _ = make_app(fake_run(7, policy="cpu", n_chunks=30), settings=settings)
    last = fake_stats(7, policy="cpu", n_chunks=30)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        header = app.query_one(RunHeader).plain
        states = app.query_one(StatesTable)
        chunk_map = app.query_one(ChunkMap)
        times = app.query_one(StepPanel).times_text
        memory = app.query_one(MemoryChart)
        assert "step 7/200" in header and "policy cpu" in header
        assert "125.2M params" in header and "simulated, 6.0 GiB" in header
        assert "running" in header
        for state, count in last.memory.states["host"].items():
            assert states.cell(state, "host") == f"{count:,}"
        assert states.cell("COMPUTE", "device") == f"{last.memory.states['device']['COMPUTE']:,}"
        assert states.cell("param bytes", "device") == "8.0 MiB"  # the one chunk in use
        assert chunk_map.cell_count == 30
        assert "device 1" in chunk_map.query_one("#chunk-legend").content.plain
        assert "step 7" in times and f"{last.forward * 1e3:.1f} ms" in times
        assert len(memory.samples) == 7
        assert "budget 6.0 GiB" in memory.device_caption().plain


async def test_hundreds_of_chunks_wrap_to_the_width_of_the_map():
    app, _ = make_app(fake_run(2, n_chunks=600, parameters=6_700_000_000))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        chunk_map = app.query_one(ChunkMap)
        lines = chunk_map.cells_text.splitlines()
        assert chunk_map.cell_count == 600
        assert len(lines) > 1
        assert all(len(line) <= chunk_map.scrollable_content_region.width for line in lines)


async def test_a_device_the_worker_cannot_name_reads_n_a():
    started = Started("opt-125m", 125_000_000, "", [], {})
    app, _ = make_app([started])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert "device N/A" in app.query_one(RunHeader).plain


async def test_a_change_is_pending_until_the_worker_applies_it():
    app, fake = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("c")
        await settle(app, pilot)
        controls = app.query_one(Controls)
        assert "policy: auto → cuda (pending)" in controls.changes_text
        assert "policy auto" in app.query_one(RunHeader).plain  # not before it is applied
        fake.emit(Step(fake_stats(4)))
        await settle(app, pilot)
        assert "policy: auto → cuda, applied at step 4" in controls.changes_text
        assert "(pending)" not in controls.changes_text
        assert "policy cuda" in app.query_one(RunHeader).plain
        assert any("applied at step 4" in m for m in app.query_one(LogPanel).messages)
    assert app.settings.engine.policy == "cuda"


async def test_a_rejected_change_shows_the_reason_and_the_control_goes_back():
    app, fake = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        app.request("margin_ratio", 1.5)  # as a buggy client would; the worker refuses
        await settle(app, pilot)
        controls = app.query_one(Controls)
        assert "rejected: margin_ratio must be within 0..1" in controls.changes_text
        assert app.query_one("#margin").value == "0.00"
    assert app.settings.engine.margin_ratio == 0.0


async def test_the_log_step_column_never_runs_backwards():
    app, fake = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("c")  # applied at step 4, logged after step 3
        fake.emit(Step(fake_stats(4, policy="cuda")))
        await settle(app, pilot)
        await pilot.press("space")
        await settle(app, pilot)
        log = app.query_one(LogPanel)
        steps = [int(line.text[1:6]) for line in log.lines if line.text.startswith("[")]
        assert steps == sorted(steps)
        assert "policy: auto → cuda, applied at step 4" in log.messages
        assert log.messages[-1] == "paused after step 4"


async def test_a_change_is_logged_at_the_step_it_applies_at():
    app, fake = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("c")
        (sent,) = commands_of(fake, SetPolicy)
        fake._waiting.clear()  # answered here, before step 4's telemetry comes
        fake.emit(Applied(sent.id, 4, "policy cuda"))
        await settle(app, pilot)
        await pilot.press("plus")  # still before it: the column does not go back to 3
        log = app.query_one(LogPanel)
        stamps = {line.text[8:].strip(): int(line.text[1:6])
                  for line in log.lines if line.text.startswith("[")}
        assert stamps["policy: auto → cuda (pending)"] == 3
        assert stamps["policy: auto → cuda, applied at step 4"] == 4
        assert stamps["margin: 0.00 → 0.05 (pending)"] == 4


async def test_the_default_budget_shows_once_the_worker_has_chosen_it():
    started = fake_started(device_budget=6 * GiB, settings={"engine": {"device_budget": "6GiB"}})
    app, _ = make_app([started])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert "budget 6.0 GiB" in app.query_one(RunHeader).plain  # before the first step
        assert app.query_one("#budget").placeholder == "6.0 GiB"  # the header's words
        assert "first step running" in app.query_one(StepPanel).times_text
    assert app.settings.engine.device_budget is None  # still the default, as a preset saves it


async def test_nothing_is_drawn_once_the_app_has_shut_down():
    app, _ = make_app(fake_run(2))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        app.poll_worker()
    app.panels.mark_stale()
    app.redraw()  # a timer that fires while the panels are taken down must not fail
    assert app.poll_worker() == 0


async def test_log_events_reach_the_log_panel():
    app, _ = make_app([*fake_run(2), Log("data: 1,234 documents", level="info")])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert "data: 1,234 documents" in app.query_one(LogPanel).messages


async def test_a_failure_shows_its_reason_and_log_and_the_app_stays_open():
    failed = Failed("CUDA out of memory", exitcode=1, log_tail=["Traceback …", "OOM at step 3"])
    app, _ = make_app([*fake_run(2), failed])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        panel = app.query_one(FailurePanel)
        assert panel.display
        assert "CUDA out of memory" in panel.plain and "OOM at step 3" in panel.plain
        assert "failed" in app.query_one(RunHeader).plain
        await pilot.press("space")  # nothing to pause
        assert app.is_running


async def test_r_restarts_a_failed_run_with_a_new_worker_and_the_current_settings():
    workers: list[FakeWorker] = []

    def factory(settings: Settings) -> FakeWorker:
        script = [*fake_run(2), Failed("boom")] if not workers else fake_run(1, policy="cpu")
        workers.append(FakeWorker(script, steps_per_poll=100))
        workers[-1].settings = settings
        return workers[-1]

    app = TuitrainApp(_settings(), worker_factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.run_state == "failed"
        await pilot.press("c")  # no worker to ask: it changes what the restart uses
        await pilot.press("r")
        await settle(app, pilot)
        assert app.run_state == "running"
        assert not app.query_one(FailurePanel).display
    assert len(workers) == 2
    assert workers[0].stop_calls >= 1
    assert workers[1].settings.engine.policy == "cuda"
    assert workers[1].commands == []


async def test_a_mistake_in_the_input_reads_as_its_reason_without_the_traceback():
    reason = "device budget 64.0 MiB is below the minimum working set 294.6 MiB"
    tail = ["Traceback (most recent call last):", "engine.step.engine.BudgetTooSmall: …"]
    app, _ = make_app([Failed(reason, exitcode=2, log_tail=tail)])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        text = app.query_one(FailurePanel).plain
        assert reason in text and "r restart" in text and "q quit" in text
        assert "Traceback" not in text
        header = app.query_one(RunHeader).plain
        assert "- params" in header and "…" not in header  # nothing more will come
        await pilot.press("q")
    assert app.return_code == 2  # as the headless runner exits on bad input


async def test_a_budget_too_small_is_fixed_in_the_budget_field_then_restarted():
    workers: list[FakeWorker] = []

    def factory(settings: Settings) -> FakeWorker:
        failed = Failed("device budget 64.0 MiB is below the minimum working set", exitcode=2)
        workers.append(FakeWorker([failed] if not workers else fake_run(1)))
        workers[-1].settings = settings
        return workers[-1]

    app = TuitrainApp(_settings(device_budget="64MiB"), worker_factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.run_state == "failed"
        await type_into(pilot, "#budget", "512MiB")
        await pilot.press("enter", "escape", "r")
        await settle(app, pilot)
        assert app.run_state == "running"
    assert workers[1].settings.engine.device_budget == "512MiB"


async def test_a_long_log_tail_never_hides_the_reason_or_the_keys():
    tail = [f"line {i}" for i in range(40)]
    app, _ = make_app([*fake_run(1), Failed("boom", exitcode=1, log_tail=tail)])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        lines = app.query_one(FailurePanel).plain.splitlines()
        assert "boom" in lines[0] and "r restart" in lines[1]
        assert lines[-1].strip() == "line 39"
        await pilot.press("q")
    assert app.return_code == 1


async def test_a_worker_that_cannot_start_is_a_failure_on_screen():
    def factory(settings: Settings) -> FakeWorker:
        raise RuntimeError("no such model")

    app = TuitrainApp(_settings(), worker_factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert "no such model" in app.query_one(FailurePanel).plain
        assert app.is_running


async def test_a_burst_of_steps_is_drained_at_once_and_drawn_from_the_latest():
    app, fake = make_app([])
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        fake.emit(*fake_run(1500))  # 1500 steps waiting: a fast worker, a slow screen
        # CPU time of this process: other processes sharing the machine do not count.
        start = time.process_time()
        handled = app.poll_worker()
        app.redraw()
        elapsed = time.process_time() - start
        await pilot.pause()
        assert handled == 1501
        assert "step 1500/200" in app.query_one(RunHeader).plain
        assert len(app.query_one(MemoryChart).samples) == HISTORY
    assert elapsed < 1.0  # ~0.1 s here; generous for a shared CPU


async def type_into(pilot, selector: str, text: str) -> None:
    """Click a field, empty it, type `text` (without submitting)."""
    await pilot.click(selector)
    await pilot.press("ctrl+a", "ctrl+k", *text)


def _checkpointed(folder) -> Settings:
    """Settings of a run that writes checkpoints to `folder`."""
    settings = Settings(model="opt-125m")
    settings.checkpoint.dir = str(folder)
    return settings


def _settings(**engine: object) -> Settings:
    settings = Settings(model="opt-125m")
    for key, value in engine.items():
        setattr(settings.engine, key, value)
    return settings


async def test_log_lines_written_before_the_terminal_shrank_are_wrapped_again():
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        long = "policy cuda: the plan's choice for this machine " + "word " * 20 + "END"
        app.add_log(long)
        await pilot.pause()
        await pilot.resize_terminal(80, 24)
        await settle(app, pilot)
        (log_view,) = [view for view in views_for("compact") if view.name == "log"]
        app.panels.show_view(log_view)
        await pilot.pause()
        log = app.query_one(LogPanel)
        width = log.scrollable_content_region.width
        texts = [line.text.rstrip() for line in log.lines]
        assert all(len(text) <= width for text in texts)
        assert " ".join(t.strip() for t in texts).split().count("END") == 1


async def test_the_palettes_screenshot_is_saved_and_the_toast_says_where(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no Downloads folder: the working folder, then
    monkeypatch.setattr(screenshot.platformdirs, "user_downloads_dir",
                        lambda: str(tmp_path / "Downloads"))
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        commands = [c.title for c in app.get_system_commands(app.screen)]
        assert commands.count("Screenshot") == 1
        await app.run_action("screenshot")
        await pilot.pause(0.3)
        (saved,) = tmp_path.glob("*.svg")
        assert "<svg" in saved.read_text()
        said = [n.message for n in app._notifications]
        assert any(saved.name in message for message in said), said


# --- one fact, one value: the header, a change while paused, a restart, the policy -----


async def test_a_simulated_device_is_named_with_the_budget_it_was_resized_to():
    app, fake = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await type_into(pilot, "#budget", "100GiB")
        await pilot.press("enter")
        fake.emit(Step(fake_stats(4, device_budget=100 * GiB)))
        await settle(app, pilot)
        header = app.query_one(RunHeader).plain
        assert "budget 100.0 GiB" in header
        assert "device simulated, 100.0 GiB" in header and "6.0 GiB" not in header


async def test_a_change_while_paused_applies_at_a_step_that_has_not_run():
    app, fake = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("space")
        await settle(app, pilot)
        await pilot.press("c")
        (sent,) = commands_of(fake, SetPolicy)
        fake._waiting.clear()  # the worker answers while paused, for the step after it
        fake._answers.append(Applied(sent.id, 4, "policy cuda"))
        await settle(app, pilot)
        controls = app.query_one(Controls)
        assert "policy: auto → cuda, applies at step 4" in controls.changes_text
        assert "applied" not in controls.changes_text
        assert "policy: auto → cuda, applies at step 4" in app.query_one(LogPanel).messages
        await pilot.press("space")  # resumed: step 4 is under way
        await settle(app, pilot)
        assert "policy: auto → cuda, applied at step 4" in controls.changes_text


async def test_a_restarted_run_shows_none_of_the_last_runs_changes_or_messages():
    workers: list[FakeWorker] = []

    def factory(settings: Settings) -> FakeWorker:
        workers.append(FakeWorker(fake_run(2), steps_per_poll=100))
        return workers[-1]

    app = TuitrainApp(_settings(), worker_factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("space")
        await settle(app, pilot)
        await pilot.press("space")
        await settle(app, pilot)
        workers[0].emit(Failed("boom"))
        await settle(app, pilot)
        controls = app.query_one(Controls)
        assert "resumed after step 2" in controls.changes_text
        await pilot.press("minus")  # a message: margin is already 0.00
        assert controls.message
        await pilot.press("r")
        await settle(app, pilot)
        assert app.run_state == "running"
        assert controls.changes_text == "" and controls.message == ""


@pytest.mark.parametrize("started", [False, True], ids=["failed before", "started"])
async def test_a_policy_left_to_the_plan_shows_only_once_the_run_says_it(started):
    planned = fake_started(settings={"engine": {"policy": "cuda"}})
    script = [planned] if started else [Log("building opt-125m")]
    app, _ = make_app([*script, Failed("boom")])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        header = app.query_one(RunHeader).plain
        assert ("policy cuda" if started else "policy -") in header  # not the default, auto
        assert "policy auto" not in header
        await pilot.press("r")
        await pilot.pause()
        if not started:  # the new worker has said nothing yet: the header waits
            assert "policy …" in app.query_one(RunHeader).plain
        restart = app.query_one(LogPanel).messages[-1]
        assert restart == ("restarting opt-125m with policy cuda" if started
                           else "restarting opt-125m with policy the plan's choice")


def _policy_select(app: TuitrainApp) -> tuple[object, str]:
    """The Controls' policy select: its value (Select.NULL when none is chosen) and what
    it reads on the screen."""
    select = app.query_one(Controls).query_one("#policy", Select)
    return select.value, str(select.query_one("#label", Static).content)


async def test_the_policy_select_chooses_none_until_the_run_says_which_the_plan_chose():
    app, fake = make_app([Log("building opt-125m")])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert "policy …" in app.query_one(RunHeader).plain
        assert _policy_select(app) == (Select.NULL, "…")  # not the default, auto
        fake.emit(fake_started(settings={"engine": {"policy": "cuda"}}))
        await settle(app, pilot)
        assert "policy cuda" in app.query_one(RunHeader).plain
        assert _policy_select(app) == ("cuda", "cuda")


async def test_the_policy_select_of_a_run_that_ended_unsaid_reads_as_the_header_does():
    app, _ = make_app([Log("building opt-125m"), Failed("boom")])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert "policy -" in app.query_one(RunHeader).plain
        assert _policy_select(app) == (Select.NULL, "-")
        await pilot.press("r")  # a new worker: its plan has not said either
        await pilot.pause()
        assert "policy …" in app.query_one(RunHeader).plain
        assert _policy_select(app) == (Select.NULL, "…")


async def test_a_policy_asked_for_before_a_failed_start_is_not_shown_after_a_restart():
    app, fake = make_app([Log("building opt-125m")])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("c")  # asked for before the run said its own: pending
        assert _policy_select(app) == ("cuda", "cuda")
        fake.emit(Failed("boom"))  # never applied: the restart runs the plan's choice again
        await settle(app, pilot)
        await pilot.press("r")
        await pilot.pause()
        assert "policy …" in app.query_one(RunHeader).plain
        assert _policy_select(app) == (Select.NULL, "…")


async def test_the_blank_row_of_the_policy_select_is_no_choice_once_the_policy_is_known():
    app, fake = make_app([fake_started(settings={"engine": {"policy": "cuda"}})])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        app.query_one(Controls).query_one("#policy", Select).value = Select.NULL  # as picked
        await settle(app, pilot)
        assert _policy_select(app) == ("cuda", "cuda")
        assert commands_of(fake, SetPolicy) == []


async def test_a_policy_asked_for_before_the_run_says_its_own_and_rejected_shows_none_again():
    """The select shows what was asked for while it is pending; rejected before the run
    said which policy the plan chose, it goes back to none chosen, as the header reads."""
    app, fake = make_app([Log("building opt-125m")])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("c")
        assert _policy_select(app) == ("cuda", "cuda")
        (asked,) = commands_of(fake, SetPolicy)
        fake.emit(Rejected(asked.id, "policy cuda will not fit"))
        await settle(app, pilot)
        assert "policy …" in app.query_one(RunHeader).plain
        assert _policy_select(app) == (Select.NULL, "…")
        fake.emit(fake_started(settings={"engine": {"policy": "cpu"}}))
        await settle(app, pilot)
        assert _policy_select(app) == ("cpu", "cpu")
