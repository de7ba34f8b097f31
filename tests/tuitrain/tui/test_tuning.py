"""The app's `a`: the tuner's search on the run, live, through the (fake) worker."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from tests.tuitrain.fakeworker import FakeWorker, fake_run, fake_stats, follow_settings
from tuitrain.events import SetMargin, SetPolicy
from tuitrain.formatting import format_seconds
from tuitrain.preset_folders import saved_dir
from tuitrain.presets import load_preset
from tuitrain.run_preset import PresetPace
from tuitrain.settings import Settings
from tuitrain.tui.app import TuitrainApp
from tuitrain.tui.trials_table import TrialsTable

from .helpers import SIZE, settle

pytestmark = pytest.mark.anyio


def tuning_app(steps: int) -> tuple[TuitrainApp, FakeWorker, list[str]]:
    """An app on a scripted run whose steps take as long as their setting says, and the
    lines it logs."""
    fake = FakeWorker(fake_run(steps), steps_per_poll=1, restep=follow_settings())
    app = TuitrainApp(Settings(model="tiny"), worker_factory=lambda _: fake)
    said: list[str] = []
    log = app.add_log

    def add_log(message: str, **how: object) -> None:
        said.append(message)
        log(message, **how)

    app.add_log = add_log  # type: ignore[method-assign]
    return app, fake, said


async def tune_until_done(app: TuitrainApp, pilot, *,
                          stop_when: Callable[[], bool] = lambda: False) -> None:
    stopped = False
    for _ in range(2000):
        await settle(app, pilot)
        if not stopped and stop_when():
            await pilot.press("a")
            stopped = True
        if app.tuning is not None and not app.tuning.running:
            await settle(app, pilot)
            return
    raise AssertionError("the tune did not end")


async def test_a_measures_settings_on_the_run_applies_the_best_and_s_saves_it():
    app, fake, said = tuning_app(400)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("a")
        await tune_until_done(app, pilot)
        sent = [c for c in fake.commands if isinstance(c, SetPolicy | SetMargin)]
        assert sent, "the search changed no setting"
        log = "\n".join(said)
        assert "tune: best " in log and "s saves it" in log
        assert log.count("tune: trying ") >= 2 and "s/step (forecast" in log
        # In the trials table's units, and said to be the trial's median: the table's row
        # goes on with the run's steps.
        (best_line,) = [line for line in said if line.startswith("tune: best ")]
        (best_trial,) = [t for t in app.query_one(TrialsTable).candidates.values()
                         if f"best {t.candidate.describe()}:" in best_line]
        assert (f"{format_seconds(best_trial.measured)}/step, median of its "
                f"{len(best_trial.steps)} trial steps") in best_line
        assert all(re.search(r"\(forecast [\d.]+ (µs|ms|s)/step\)", line)
                   for line in said if line.startswith("tune: trying "))
        rows = app.trial_book.rows()
        assert len(rows) >= 2  # the trials table holds every setting the search ran
        # The best is the setting in force, starred, and what `s` saves.
        best = min((r for r in rows if r.step_seconds is not None),
                   key=lambda r: r.step_seconds)
        assert app.trial_book.current == best.setting
        await pilot.press("s")
        await pilot.pause()
        await pilot.press("enter")
        await settle(app, pilot)
        saved = load_preset(saved_dir() / f"tiny-{best.setting.policy}.yaml")
        assert saved.engine.policy == best.setting.policy
        assert saved.engine.margin_ratio == best.setting.margin_ratio
        assert saved.training.grad_accum == best.setting.micro_batches
        assert saved.training.activation_checkpointing == best.setting.activation_checkpointing


async def test_the_footer_offers_a_as_what_it_does_now():
    app, fake, said = tuning_app(400)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.screen.active_bindings["a"].binding.description == "Tune"
        await pilot.press("a")
        await settle(app, pilot)
        assert app.screen.active_bindings["a"].binding.description == "Stop tune"
        await tune_until_done(app, pilot)
        assert app.screen.active_bindings["a"].binding.description == "Tune"


async def test_a_again_stops_the_search_and_keeps_the_best_so_far():
    app, fake, said = tuning_app(400)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("a")
        await tune_until_done(app, pilot,
                              stop_when=lambda: "\n".join(said).count("tune: trying ") >= 2)
        log = "\n".join(said)
        assert "tune: stopping after this step" in log
        assert "(stopped)" in log
        tried = log.split("tune: stopping after this step")[0].count("tune: trying ")
        # At most the trial being set up as the key came goes on; none is begun after it,
        # well before the search would have tried every candidate that fits.
        fitting = sum(trial.forecast.fits
                      for trial in app.query_one(TrialsTable).candidates.values())
        assert log.count("tune: trying ") <= tried + 1 < fitting
        assert app.run_state == "running"  # the run goes on


async def test_a_tuned_presets_pace_far_from_the_runs_is_said_once_in_the_log():
    app, fake, said = tuning_app(12)
    seconds = fake_stats(2).seconds
    app.preset_pace = PresetPace("tuned.yaml", seconds / 2)  # the run is twice as slow
    async with app.run_test(size=SIZE) as pilot:
        for _ in range(40):
            await settle(app, pilot)
    lines = [line for line in said if "the preset tuned.yaml measured" in line]
    assert len(lines) == 1 and "100% slower" in lines[0]
