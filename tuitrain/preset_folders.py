"""Where presets live: the shipped ones and the user's own, listed and found by name.

Shipped presets are in the repository's `presets/` folder (a wheel installs a copy under
`<data>/share/tuitrain/presets`), one per hardware story, each described by its first
comment paragraph. The app saves the user's own in their configuration folder (saved_dir),
apart from the shipped ones, under a name that says the setting (default_preset_name). A
bare name is looked up among the saved presets first (find_preset): a preset the user saved
under a shipped name is the one they meant, whatever an update of tuitrain ships.

What a preset file holds, and how it is read and written, is tuitrain.presets'.
"""

from __future__ import annotations

import os
import re
import site
import sysconfig
import textwrap
from pathlib import Path

import platformdirs
import yaml

from tuitrain.presets import SUFFIX, PresetError, PresetLoader

# --- the folders -------------------------------------------------------------------------


# Where the user's configuration lives instead of the platform's folder (tests, sandboxes).
CONFIG_ENV = "TUITRAIN_CONFIG"


def _shipped_dir() -> Path:
    """Where the shipped presets are: the source tree's `presets/` (a checkout or an
    editable install), else the copy a wheel installs under `<data>/share/tuitrain/presets`."""
    candidates = [Path(__file__).resolve().parents[1] / "presets"]
    for data_root in (sysconfig.get_path("data"), site.getuserbase()):
        candidates.append(Path(data_root) / "share" / "tuitrain" / "presets")
    return next((c for c in candidates if c.is_dir()), candidates[0])


SHIPPED_DIR = _shipped_dir()


def config_dir() -> Path:
    """tuitrain's folder in the user's configuration: $TUITRAIN_CONFIG when set, else the
    platform's (~/.config/tuitrain on Linux, ~/Library/Application Support/tuitrain on
    macOS). Read at each call, so a change of the variable takes effect at once."""
    override = os.environ.get(CONFIG_ENV)
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_config_dir("tuitrain", appauthor=False))


def saved_dir() -> Path:
    """Where the app saves the user's presets (it may not exist yet)."""
    return config_dir() / "presets"


def in_saved_dir(path: Path) -> bool:
    """Whether `path` is a file of the user's saved presets folder (saved_dir)."""
    try:
        return path.expanduser().resolve().parent == saved_dir().resolve()
    except OSError:
        return False


def saved_preset_path(typed: str) -> Path:
    """Where the app saves a preset the user named `typed`: a name with no folder part
    (`mine`, `mine.yaml`) is a saved preset's name, the file `mine.yaml` in saved_dir, which
    `tuitrain presets` lists and `--preset mine` finds (find_preset); a path is where it
    says (`~` expanded), with `.yaml` added in saved_dir, where only such files are presets."""
    if os.sep in typed or "/" in typed:
        path = Path(typed).expanduser()
    else:
        path = saved_dir() / typed
    if in_saved_dir(path) and not path.name.endswith(SUFFIX):
        path = path.with_name(path.name + SUFFIX)
    return path


# --- listing and finding presets ---------------------------------------------------------


def list_presets() -> list[tuple[str, str]]:
    """(name, description) of each shipped preset, by name; the description is the file's
    first comment paragraph (its lines up to the first empty comment line), whole."""
    return [(path.stem, _description(path)) for path in sorted(SHIPPED_DIR.glob(f"*{SUFFIX}"))]


def list_saved_presets() -> list[tuple[str, str]]:
    """(name, description) of each preset the user saved (saved_dir), by name; the
    description says the model and settings, when it was saved and what was measured."""
    folder = saved_dir()
    if not folder.is_dir():
        return []
    return [(path.stem, _saved_description(path)) for path in _saved_files(folder)]


def _saved_files(folder: Path) -> list[Path]:
    return sorted(
        p for p in folder.glob(f"*{SUFFIX}") if p.is_file() and not p.name.startswith(".")
    )


def _comments(text: str) -> list[str]:
    """The comment lines at the top of a preset, without their `#`."""
    comments = []
    for line in text.splitlines():
        if line.startswith("#"):
            comments.append(line.lstrip("#").strip())
        elif line.strip():
            break
    return comments


def _description(path: Path) -> str:
    comments = _comments(path.read_text(encoding="utf-8"))
    paragraph = comments[: comments.index("")] if "" in comments else comments
    return " ".join(paragraph)


def _saved_description(path: Path) -> str:
    """ "opt-125m: auto, margin 0.30, budget 3GiB; 1.23 s/step, 208 tok/s, device peak
    2.9 GiB, ...; saved 2025-06-01 14:02 CEST": the setting, what was measured (the figures
    of the header's `measured` line) and when, most telling first."""
    try:
        text = path.read_text(encoding="utf-8")
        data = yaml.load(text, Loader=PresetLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return "(cannot be read)"
    parts = []
    if isinstance(data, dict):
        engine = data.get("engine") if isinstance(data.get("engine"), dict) else {}
        margin = engine.get("margin_ratio", 0.0)
        margin = f"{margin:.2f}" if isinstance(margin, int | float) else margin
        settings = (
            f"{engine.get('policy', 'auto')}, margin {margin}, "
            f"budget {engine.get('device_budget') or 'default'}"
        )
        parts.append(f"{data.get('model', '?')}: {settings}")
    comments = _comments(text)
    measured = [c for c in comments[1:] if c.startswith("measured")][:1]
    parts += [m.partition(": ")[2] or m for m in measured]
    parts += [c.removeprefix("tuitrain preset, ") for c in comments[:1]]
    return "; ".join(parts)


# `tuitrain presets` keeps its lines this wide: a saved preset's figures are cut at a comma
# to fit, a shipped preset's description goes on under itself.
LISTING_WIDTH = 100


def preset_listing(width: int = LISTING_WIDTH) -> list[str]:
    """What `tuitrain presets` prints: the shipped presets, each description whole and
    wrapped to `width`, then the user's saved ones, one line each, under a line naming
    their folder (nothing more when there are none)."""
    shipped, saved = list_presets(), list_saved_presets()
    names = max((len(name) for name, _ in shipped + saved), default=0)
    indent = " " * (names + 2)
    lines = []
    for name, description in shipped:
        lines += textwrap.wrap(description, width, initial_indent=f"{name:<{names}}  ",
                               subsequent_indent=indent, break_on_hyphens=False) or [name]
    if saved:
        hidden = {name for name, _ in saved} & {name for name, _ in shipped}
        lines.append("")
        lines.append(f"saved, in {saved_dir()} (a name finds these first):")
        for name, description in saved:
            note = "  [hides the shipped one]" if name in hidden else ""
            room = width - len(indent) - len(note)
            lines.append(f"{name:<{names}}  {_shortened(description, room)}{note}")
    return lines


def _shortened(text: str, width: int) -> str:
    """`text` within `width` columns, dropping whole items (between "; " or ", ") from its
    end, with "..." where something was left out."""
    if len(text) <= width:
        return text
    pieces = re.split(r"(; |, )", text)  # item, separator, item, ...
    while len(pieces) > 1 and len("".join(pieces[:-2]) + " ...") > width:
        del pieces[-2:]
    return "".join(pieces[:-2]) + " ..." if len(pieces) > 1 else text


def default_preset_name(model: str, policy: str, margin_ratio: float,
                        device_budget: object | None = None, *, batch_size: int = 1,
                        grad_accum: int = 1, checkpointing: bool = False) -> str:
    """The file name a preset saved from a run is offered: model, policy, margin ratio (when
    not 0), budget (when one was given), the step's split into micro-batches (`batch_size`
    sequences x `grad_accum`, when it has several) and activation checkpointing (when on),
    so that two settings of one run, such as auto at two margins or with and without
    checkpointing, get two names, and neither asks to overwrite the other. A model folder
    gives its last name."""
    name = Path(model.rstrip("/\\")).name or "model"
    parts = [name, policy]
    if margin_ratio:
        parts.append(f"margin{margin_ratio:g}")
    if device_budget is not None:
        parts.append(str(device_budget))
    if grad_accum > 1:
        parts.append(f"{batch_size}x{grad_accum}")
    if checkpointing:
        parts.append("checkpointing")
    return "-".join(parts) + SUFFIX


def find_preset(name_or_path: str | os.PathLike) -> Path:
    """The preset file for a path, or for a preset's name (`laptop-6gb`, `opt-125m-auto`).

    An existing file wins; a bare name is then looked up among the user's saved presets
    first and the shipped ones after, so a preset the user saved under a shipped name (or a
    `laptop-6gb.yaml` in the working folder) is the one used: their own choice is never
    overridden by an update of tuitrain.

    Raises:
        PresetError: a folder or another file that is not a regular one (a device, a
            pipe), or neither a file nor a known name; the message lists the names.
    """
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    name = str(name_or_path)
    stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name
    if os.sep not in name and "/" not in name:
        for folder in (saved_dir(), SHIPPED_DIR):
            candidate = folder / f"{stem}{SUFFIX}"
            if candidate.is_file():
                return candidate
    if path.is_dir():
        raise PresetError(f"{path}: is a folder, not a preset file")
    if path.exists():  # a device (/dev/null), a pipe: nothing a preset is read from
        raise PresetError(f"{path}: is not a regular file, not a preset file")
    shipped = ", ".join(n for n, _ in list_presets()) or "none"
    saved = ", ".join(n for n, _ in list_saved_presets())
    known = f"shipped: {shipped}" + (f"; saved: {saved}" if saved else "")
    raise PresetError(f"{name}: no such preset file or preset name ({known})")
