"""What the screen shows is true in every state: the header after an end, a stop or a
restart; the footer and the palette offer only what works now, named for the state; a
change's answer is listed once, in the value the user can see."""

from __future__ import annotations

import time

import pytest
from textual.widgets._footer import FooterKey

from tests.tuitrain.fakeworker import GiB, fake_run, fake_started
from tuitrain.events import Finished, Log, Pause, Rejected, SetBudget, Step
from tuitrain.formatting import format_size
from tuitrain.settings import Settings
from tuitrain.trials import BEST_MIN_SETTLED
from tuitrain.tui.controls import Controls
from tuitrain.tui.header import RunHeader
from tuitrain.tui.log_panel import LogPanel
from tuitrain.tui.memory_chart import MemoryChart
from tuitrain.tui.step_panel import StepPanel
from tuitrain.tui.trials_table import TrialsTable

from .helpers import SIZE, make_app, settle

pytestmark = pytest.mark.anyio

SUMMARY = {
    "steps": 3, "last_step": 3, "planned_steps": 3, "stopped": False, "tokens": 768,
    "seconds": 113.56255251200037, "first_step_seconds": 0.8202008860002934,
    "final_loss": 3.912345,
    "peak_device_bytes": 2 * GiB, "peak_host_bytes": 3 * GiB, "metrics": None,
    "eval_step": 3, "eval_loss": 3.714, "eval_perplexity": 41.014482761837215,
}


def footer_keys(app) -> list[str]:
    return [key.description for key in app.query(FooterKey)]


async def footer_showing(app, pilot, key: str, timeout: float = 10.0) -> list[str]:
    """The footer's keys once `key` is among them, or as they are after `timeout`: the
    footer recomposes in a later message cycle, which a busy machine delays."""
    deadline = time.monotonic() + timeout
    keys = footer_keys(app)
    while key not in keys and time.monotonic() < deadline:
        await pilot.pause(0.05)
        keys = footer_keys(app)
    return keys


async def test_ctrl_c_stops_the_worker_and_quits():
    app, fake = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert fake.stop_calls >= 1 and not fake.alive
    assert app.return_code == 0


async def test_ctrl_c_quits_from_a_field_too():
    app, fake = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        app.query_one("#budget").focus()
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert fake.stop_calls >= 1
    assert app.return_code == 0


async def test_the_footer_offers_pause_or_resume_as_the_state_has_it_and_restart_once_ended():
    app, fake = make_app([*fake_run(3), None])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        keys = await footer_showing(app, pilot, "Pause")
        assert "Pause" in keys and "Resume" not in keys and "Restart" not in keys
        await pilot.press("space")
        await settle(app, pilot)
        keys = await footer_showing(app, pilot, "Resume")
        assert "Resume" in keys and "Pause" not in keys
        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert "Resume" in titles and "Pause" not in titles
        await pilot.press("space")
        await settle(app, pilot)
        assert "Pause" in await footer_showing(app, pilot, "Pause")
        fake.emit(Finished(SUMMARY))
        await settle(app, pilot)
        keys = await footer_showing(app, pilot, "Restart")
        assert "Restart" in keys and not {"Pause", "Resume"} & set(keys)


async def test_save_checkpoint_is_offered_only_to_a_run_with_a_checkpoint_folder(tmp_path):
    app, _ = make_app(fake_run(2))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert "Save checkpoint" not in {c.title for c in app.get_system_commands(app.screen)}
    settings = Settings(model="opt-125m")
    settings.checkpoint.dir = str(tmp_path)
    app, _ = make_app(fake_run(2), settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert "Save checkpoint" in {c.title for c in app.get_system_commands(app.screen)}


async def test_a_run_ends_with_its_summary_in_words_and_its_evaluation_beside_the_loss():
    run = fake_run(3)
    # The worker's host peak is its steps' highest (TrainingRun), as the trials row has it.
    rss = max(e.stats.memory.process_rss for e in run if isinstance(e, Step))
    app, _ = make_app([*run, Finished({**SUMMARY, "peak_host_bytes": rss})])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        messages = app.query_one(LogPanel).messages
        step = app.query_one(StepPanel)
    text = "\n".join(messages)
    assert "finished: 3 steps, 768 tokens in 113.56 s" in text
    assert "held-out loss 3.7140, perplexity 41.01 after step 3" in text
    assert "113.56255" not in text and "metrics None" not in text
    assert rss == max(t.process_rss for t in app.trial_book.rows())
    assert f"peak host RSS {format_size(rss)}" in text  # as the trials row has it
    assert text.count("host RSS") == 2  # the summary's and its trial's line: one value
    assert step.evals[-1] == (3, 3.714)


async def test_a_run_stopped_early_reads_stopped_not_finished():
    app, _ = make_app([*fake_run(4), Finished({**SUMMARY, "stopped": True, "last_step": 4,
                                                "steps": 4, "planned_steps": 200})])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        header = app.query_one(RunHeader).plain
        messages = app.query_one(LogPanel).messages
    assert "● stopped" in header and "finished" not in header
    assert any(m.startswith("stopped after step 4 of 200") for m in messages)


async def test_the_header_rate_is_the_trials_row_in_force_and_a_restart_clears_it():
    app, fake = make_app([*fake_run(BEST_MIN_SETTLED + 2), Finished(SUMMARY)])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        table = app.query_one(TrialsTable)
        rate = table.cell_text(table.in_force, "rate")
        assert f"{rate} tok/s" in app.query_one(RunHeader).plain
        await pilot.press("r")
        await pilot.pause()
        header = app.query_one(RunHeader).plain
        assert "tok/s" in header and f"{rate} tok/s" not in header
        assert "step 0/" in header
        step = app.query_one(StepPanel)  # nothing of the run before is drawn
        assert not step.losses and "loss 1" not in step.times_text
        assert "waiting for the first step" in app.query_one(MemoryChart).device_caption().plain


async def test_a_rejected_budget_is_listed_once_the_field_goes_back_and_no_default_is_named():
    app, fake = make_app([*fake_run(2), None])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        app.request("device_budget", "1MiB")
        (sent,) = [c for c in fake.commands if isinstance(c, SetBudget)]
        fake._answers.clear()  # the worker's own answer, replaced by a refusal
        fake.emit(Rejected(sent.id, "device budget 1.0 MiB is below the minimum working set"))
        await settle(app, pilot)
        controls = app.query_one(Controls)
        shown = controls.changes_text + "\n" + controls.message
        assert shown.count("rejected") == 1
        assert "budget: 6.0 GiB → 1MiB, rejected" in shown and "default" not in shown
        assert app.query_one("#budget").value == ""  # the placeholder shows 6.0 GiB again


async def test_pausing_before_the_first_step_reads_paused_everywhere():
    app, fake = make_app([fake_started(), None])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("space")
        await settle(app, pilot)
        assert [type(c) for c in fake.commands] == [Pause]
        assert "● paused" in app.query_one(RunHeader).plain
        assert app.query_one(StepPanel).times_text.startswith("paused before the first step")
        assert "paused before the first step" in app.query_one(Controls).changes_text


async def test_start_up_stages_show_on_a_small_screen():
    app, _ = make_app([Log("building tiny"), Log("preparing data"), None])
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        step = app.query_one(StepPanel)
        assert step.display and step.times_text.startswith("preparing data")


async def test_a_policy_the_plan_chose_is_the_one_the_header_and_controls_show():
    """Settings that leave the policy to the plan start with its choice (cuda here): the
    screen shows what the run trains with, not the default the app asked with."""
    started = fake_started(model="opt-125m", settings={"engine": {"policy": "cuda",
                                                                  "margin_ratio": 0.0}})
    app, _ = make_app([started])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert "policy cuda" in app.query_one(RunHeader).plain
        assert app.query_one("#policy").value == "cuda"
        assert app.settings.engine.policy == "cuda"
