"""Saving a preset from the screen: the path dialog, the overwrite question, the write.

The dialogs only ask; PresetSaving writes the file, and replaces an existing one only after
the user said yes in ConfirmOverwrite. Presets go by default into the user's own folder
(tuitrain.preset_folders.saved_dir), where `--preset NAME` finds them, never among the shipped ones;
a name typed alone goes there too (saved_preset_path). Like `--save-preset`, the dialog makes
no folder but that one: a path in a folder that does not exist is refused in the dialog.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from tuitrain.events import Started
from tuitrain.preset_folders import (
    default_preset_name,
    in_saved_dir,
    saved_dir,
    saved_preset_path,
)
from tuitrain.presets import SUFFIX, run_command, save_preset
from tuitrain.settings import Settings
from tuitrain.trials import Trial
from tuitrain.tui.field import Field
from tuitrain.tui.trial_preset import save_summary, trial_settings

Measured = Mapping[str, object]  # what presets.save_preset records in the header


def shown_path(path: Path) -> str:
    """`path` as the user reads and types it: under their home folder, with `~`."""
    try:
        return "~/" + path.relative_to(Path.home()).as_posix()
    except ValueError:
        return str(path)


def default_preset_path(model: str, policy: str, margin_ratio: float = 0.0,
                        device_budget: object | None = None, *, batch_size: int = 1,
                        grad_accum: int = 1, checkpointing: bool = False) -> str:
    """preset_folders.default_preset_name in the user's saved presets folder."""
    return shown_path(saved_dir() / default_preset_name(
        model, policy, margin_ratio, device_budget, batch_size=batch_size,
        grad_accum=grad_accum, checkpointing=checkpointing))


def reproducing_command(preset_path: str, nproc: int = 1) -> str:
    """The command line that runs again what the preset at `preset_path` holds (the model
    and every setting are in the file): by its name when it is in the saved folder, on as
    many ranks as the run it was saved from (`nproc`)."""
    path = Path(preset_path).expanduser()
    preset = path.stem if in_saved_dir(path) and path.suffix == SUFFIX else preset_path
    return run_command(preset, headless=False, nproc=nproc)


_DIALOG_CSS = """
{name} {{
    align: center middle;
}}
{name} > Vertical {{
    width: 72;
    height: auto;
    border: round $primary;
    border-title-color: $text-primary;
    background: $surface;
    padding: 1 2;
}}
{name} Horizontal {{
    height: auto;
    margin-top: 1;
    align-horizontal: right;
}}
{name} Button {{
    margin-left: 2;
}}
"""


class SaveDialog(ModalScreen[str | None]):
    """Asks where to save the preset; dismisses with the path, or None when cancelled.

    A name alone is dismissed as its file among the saved presets (saved_preset_path); a
    path whose folder does not exist (and is not the saved presets folder, which the save
    makes) keeps the dialog open, saying so."""

    DEFAULT_CSS = _DIALOG_CSS.format(name="SaveDialog") + """
SaveDialog #preset-error {
    display: none;
    color: $text-error;
}
"""
    AUTO_FOCUS = "#preset-path"
    BINDINGS = [Binding("escape", "cancel", "Cancel", show=False)]

    def __init__(self, path: str, *, summary: str = "") -> None:
        super().__init__()
        self.path = path
        self.summary = summary

    def compose(self) -> ComposeResult:
        with Vertical() as box:
            box.border_title = "Save preset"
            if self.summary:
                yield Static(self.summary, id="preset-summary")
            yield Label("Preset name, or a file path (YAML):")
            yield Field(self.path, id="preset-path", select_on_focus=False)
            yield Static(id="preset-error")
            with Horizontal():
                yield Button("Cancel", id="cancel")
                yield Button("Save", id="save", variant="primary")

    @on(Input.Submitted, "#preset-path")
    @on(Button.Pressed, "#save")
    def _save(self) -> None:
        typed = self.query_one("#preset-path", Input).value.strip()
        if not typed:
            self._refuse("give a preset name or a file path")
            return
        target = saved_preset_path(typed)
        if in_saved_dir(target):
            self.dismiss(shown_path(target))
        elif not target.parent.exists():
            self._refuse(f"folder not found: {shown_path(target.parent)}")
        else:
            self.dismiss(typed)

    def _refuse(self, message: str) -> None:
        error = self.query_one("#preset-error", Static)
        error.update(message)
        error.display = True

    @on(Input.Changed, "#preset-path")
    def _edited(self) -> None:
        self.query_one("#preset-error", Static).display = False

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmOverwrite(ModalScreen[bool]):
    """Asks whether an existing file may be replaced; dismisses with True only on yes."""

    DEFAULT_CSS = _DIALOG_CSS.format(name="ConfirmOverwrite")
    AUTO_FOCUS = "#keep"
    BINDINGS = [
        Binding("y", "overwrite", "Overwrite", show=False),
        Binding("n,escape", "keep", "Keep", show=False),
    ]

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def compose(self) -> ComposeResult:
        with Vertical() as box:
            box.border_title = "File exists"
            yield Static(f"{self.path} already exists. Overwrite it? (y/n)")
            with Horizontal():
                yield Button("Keep it", id="keep", variant="primary")
                yield Button("Overwrite", id="overwrite", variant="error")

    @on(Button.Pressed, "#overwrite")
    def action_overwrite(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#keep")
    def action_keep(self) -> None:
        self.dismiss(False)


class PresetSaving:
    """The save flow: the path dialog, the write, the overwrite question, the outcome.

    What is saved is what the dialog showed: the settings and measurements given when it
    opened.

    Args:
        app: where the dialogs are shown.
        report: told each outcome, e.g. report("saved presets/x.yaml", error=False).
    """

    def __init__(self, app: App, *, report: Callable[..., None]) -> None:
        self.app = app
        self.report = report
        self.nproc = 1

    def start(self, settings: Settings, measured: Measured | None, *, summary: str,
              nproc: int = 1) -> None:
        """Open the dialog with <saved presets>/<model>-<policy>....yaml filled in; `summary`
        tells what will be saved (the setting, what was measured); `nproc`: the ranks the
        run trains on, which the preset's command runs again."""
        self.nproc = nproc
        settings = settings.model_copy(deep=True)
        e = settings.engine
        t = settings.training
        path = default_preset_path(settings.model, e.policy, e.margin_ratio, e.device_budget,
                                   batch_size=t.batch_size, grad_accum=t.grad_accum,
                                   checkpointing=t.activation_checkpointing)
        self.app.push_screen(
            SaveDialog(path, summary=summary), partial(self._chosen, settings, measured)
        )

    def start_trial(self, settings: Settings, trial: Trial | None, *, in_force: bool,
                    started: Started | None) -> None:
        """Open the dialog for `trial` of a run of `settings` (None: those settings, nothing
        measured yet); `in_force`: the setting the run is in now. `started` (None before
        the run said it started) gives the default budget it chose and its ranks."""
        default = started.device_budget if started is not None else None
        if trial is not None:
            settings = trial_settings(settings, trial, default_budget=default)
        summary = save_summary(settings, trial, in_force=in_force, default_budget=default)
        measured = trial.measured() if trial is not None else None
        self.start(settings, measured, summary=summary,
                   nproc=started.ranks if started is not None else 1)

    def write(
        self, settings: Settings, measured: Measured | None, path: str, *, overwrite: bool
    ) -> bool:
        """Write the preset; an existing file makes it ask first. True when written. Of the
        folders, only the saved presets folder is made (SaveDialog refuses a missing other)."""
        target = Path(path).expanduser()
        if in_saved_dir(target):
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                return self._failed(path, exc)
        try:
            save_preset(
                settings,
                target,
                command=reproducing_command(path, self.nproc),
                measured=measured,
                overwrite=overwrite,
            )
        except FileExistsError:
            confirmed = partial(self._confirmed, settings, measured, path)
            self.app.push_screen(ConfirmOverwrite(path), confirmed)
            return False
        except (OSError, ValueError) as exc:
            return self._failed(path, exc)
        self.report(f"saved preset {path}", error=False)
        return True

    def _chosen(self, settings: Settings, measured: Measured | None, path: str | None) -> None:
        if path is not None:
            self.write(settings, measured, path, overwrite=False)

    def _confirmed(
        self, settings: Settings, measured: Measured | None, path: str, overwrite: bool | None
    ) -> None:
        if overwrite:
            self.write(settings, measured, path, overwrite=True)
        else:
            self.report(f"kept the existing {path}", error=False)

    def _failed(self, path: str, error: Exception) -> bool:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        self.report(f"could not save {path}: {reason}", error=True)
        return False
