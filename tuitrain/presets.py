"""Presets: Settings saved as YAML, validated on load, written atomically.

A preset is what a user found while tuning (in the app or by hand) and wants to reuse on
another run or another machine. Shipped presets live in the repository's `presets/` folder,
one per hardware story; the app saves the user's own in their configuration folder
(saved_dir), apart from the shipped ones, each starting with a comment header saying how to
reproduce the run and what was measured when it was saved.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import site
import sysconfig
import tempfile
import textwrap
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import platformdirs
import yaml

from tuitrain.formatting import format_rate, format_seconds, format_size
from tuitrain.settings import SETTINGS_VERSION, InvalidSettings, Settings, validate_settings

SUFFIX = ".yaml"
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


class PresetError(ValueError):
    """A preset that cannot be used. The message is one line naming the file and the key."""


# --- reading -----------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """safe_load, except that a key given twice is an error: YAML would keep the last one
    silently and the user would never learn which of their two values was used."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_problem(error: yaml.YAMLError) -> str:
    """One line from a YAML error: where, then what (PyYAML's own text spans lines)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    return f"{where}malformed YAML: {problem}"


def load_preset(path: str | os.PathLike) -> Settings:
    """Settings from a preset file.

    Unset keys keep their built-in defaults. `version:` is required so that a preset written
    for a later tuitrain is refused rather than misread.

    Raises:
        PresetError: the file is missing or unreadable, is not YAML, is not a mapping, has an
            unknown key, a value of the wrong type or out of range, or an unsupported version.
            The message is one line: `<file>: <key>: <problem>`.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PresetError(f"{path}: no such preset file") from None
    except IsADirectoryError:
        raise PresetError(f"{path}: is a folder, not a preset file") from None
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise PresetError(f"{path}: cannot read: {reason}") from None
    try:
        data = yaml.load(text, Loader=_Loader)  # a SafeLoader: plain data, never objects
    except yaml.YAMLError as error:
        raise PresetError(f"{path}: {_yaml_problem(error)}") from None
    if data is None:
        raise PresetError(f"{path}: empty preset (start with `version: {SETTINGS_VERSION}`)")
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"a single value ({data!r})"
        raise PresetError(f"{path}: expected a mapping of settings, got {kind}")
    if "version" not in data:
        raise PresetError(f"{path}: version: missing (add `version: {SETTINGS_VERSION}`)")
    try:
        return validate_settings(data)
    except InvalidSettings as error:
        raise PresetError(f"{path}: {error}") from None


def merge(settings: Settings, overrides: Mapping[str, Any]) -> Settings:
    """A copy of `settings` with `overrides` applied; the input is left alone.

    Keys are dotted paths (`{"engine.margin_ratio": 0.5}`) or nested mappings
    (`{"engine": {"margin_ratio": 0.5}}`); a nested mapping updates only the keys it names.

    Raises:
        InvalidSettings: a key that does not exist or a value that does not validate, with
            the dotted key of the first problem.
    """
    # What was never set stays unset (a policy left to the run, Settings.policy_chosen).
    data = settings.model_dump(exclude_unset=True)
    for key, value in overrides.items():
        _set(data, key.split("."), value)
    return validate_settings(data)


def _set(data: dict, path: list[str], value: Any) -> None:
    head, rest = path[0], path[1:]
    if rest:
        child = data.get(head)
        if not isinstance(child, dict):
            child = data[head] = {}
        _set(child, rest, value)
    elif isinstance(value, Mapping) and isinstance(data.get(head), dict):
        for key, inner in value.items():
            _set(data[head], str(key).split("."), inner)
    else:
        data[head] = value


# --- writing -----------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """safe_dump, except that text holding a character YAML reads as a line break (NEL,
    U+2028, U+2029) or a control code is written double-quoted, where it is escaped: PyYAML
    otherwise writes NEL raw inside single quotes and reads it back as a space."""


def _represent_text(dumper: _Dumper, text: str) -> yaml.ScalarNode:
    style = None if all(c.isprintable() for c in text) else '"'
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _represent_text)


def _measured_lines(measured: Mapping[str, Any]) -> list[str]:
    """Human lines for the header; well-known keys are formatted, others shown as given.

    Known keys are those of tuitrain.trials.Trial.measured, read in the trials' words and
    units (tuitrain.trials.describe_measurements), so that a preset's header, the app's save
    dialog and a headless summary give a figure alike: `step_seconds` and
    `tokens_per_second` (medians over `settled_steps`), `device_peak` and `process_rss`
    (bytes, the highest), `bytes_copied_per_step`, `within_budget`, and the steps measured,
    `first_step` to `step`.
    """
    parts = []
    rest = dict(measured)
    if (seconds := rest.pop("step_seconds", None)) is not None:
        parts.append(f"{format_seconds(seconds)}/step")
    if (rate := rest.pop("tokens_per_second", None)) is not None:
        parts.append(f"{format_rate(rate)} tok/s")
    if (peak := rest.pop("device_peak", None)) is not None:
        within = rest.pop("within_budget", None)
        over = " (over budget)" if within is False else ""
        parts.append(f"device peak {format_size(peak)}{over}")
    if (copied := rest.pop("bytes_copied_per_step", None)) is not None:
        parts.append(f"copied {format_size(copied)}/step")
    if (rss := rest.pop("process_rss", None)) is not None:
        parts.append(f"host RSS {format_size(rss)}")
    step = rest.pop("step", None)
    first = rest.pop("first_step", None)
    settled = rest.pop("settled_steps", None)
    lines = []
    if parts:
        if first is not None and step is not None and first != step:
            at = f" over steps {first}-{step}"
        elif step is not None:
            at = f" at step {step}"
        else:
            at = ""
        counted = ""
        if settled is not None and (seconds is not None or rate is not None):
            counted = f" (median of {settled} settled step{'s' if settled != 1 else ''})"
        lines.append(f"measured{at}{counted}: {', '.join(parts)}")
    else:
        rest.update({k: v for k, v in (("step", step), ("first_step", first)) if v is not None})
        if settled is not None:
            rest["settled_steps"] = settled
    lines += [f"{key}: {value}" for key, value in rest.items()]
    return lines


def _comment(text: str) -> str:
    """One comment line, whatever the caller gave: line breaks become spaces, and characters
    YAML refuses anywhere in a file (control codes) are written as escapes."""
    flat = " ".join(str(text).split())
    return "# " + "".join(c if c.isprintable() else ascii(c)[1:-1] for c in flat)


def dump_preset(
    settings: Settings,
    *,
    command: str | None = None,
    measured: Mapping[str, Any] | None = None,
) -> str:
    """YAML text for `settings`, every key written out, after a comment header.

    Every key is written, defaults included, so that a later tuitrain with other defaults
    still runs exactly what was saved. The header names the command that reproduces the run
    and what was measured when it was saved (see _measured_lines for the keys understood).
    """
    header = [f"tuitrain preset, saved {datetime.now().astimezone():%Y-%m-%d %H:%M %Z}"]
    if command:
        header.append(f"reproduce: {command}")
    if measured:
        header += _measured_lines(measured)
    body = yaml.dump(
        settings.model_dump(mode="json"),
        Dumper=_Dumper,
        sort_keys=False,
        allow_unicode=True,
        width=1000,
    )
    return "\n".join(_comment(line) for line in header) + "\n" + body


def run_command(preset: str, *, headless: bool, nproc: int = 1) -> str:
    """The command line that runs the preset at `preset` again, for a preset's header:
    `tuitrain run --preset P [--headless] [--nproc N]`. A data-parallel run (`nproc` ranks,
    started by --nproc or by torchrun) runs again on as many ranks of this machine: the
    batch is global, so the same number of ranks trains alike wherever they run."""
    command = ["tuitrain", "run", "--preset", preset]
    if headless:
        command.append("--headless")
    if nproc > 1:
        command += ["--nproc", str(nproc)]
    return shlex.join(command)


def save_preset(
    settings: Settings,
    path: str | os.PathLike,
    *,
    command: str | None = None,
    measured: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `settings` as a preset file, atomically; returns the path written.

    The text goes to a temporary file in the same folder, is flushed to disk, and only then
    takes the preset's name, so a crash or a full disk leaves either the old file or the new
    one, never half of one.

    Args:
        command: the command line that reproduces the run, for the header.
        measured: what the run measured (`device_peak` bytes, `step_seconds`,
            `tokens_per_second`, `step`), for the header.
        overwrite: replace an existing file. Off by default: a preset is something a user
            found by hand, and it is never lost silently.

    Raises:
        FileExistsError: `path` exists and `overwrite` is False.
        OSError: the folder is missing or the write failed; an existing file is untouched.
    """
    path = Path(path)
    text = dump_preset(settings, command=command, measured=measured)  # fail before any write
    if path.exists() and not overwrite:
        raise FileExistsError(17, "preset exists, not overwriting", str(path))
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        tmp.chmod(mode)
        if overwrite:
            os.replace(tmp, path)
        else:
            _publish_new(tmp, path)
        _fsync_folder(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _publish_new(tmp: Path, path: Path) -> None:
    """Give `tmp` the name `path` unless `path` exists, even if it appeared a moment ago."""
    try:
        os.link(tmp, path)  # atomic and refuses an existing name
    except FileExistsError:
        raise FileExistsError(17, "preset exists, not overwriting", str(path)) from None
    except OSError:  # a filesystem without hard links: check, then rename
        if path.exists():
            raise FileExistsError(17, "preset exists, not overwriting", str(path)) from None
        os.replace(tmp, path)


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable; not every platform can open a folder."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --- shipped and saved presets -----------------------------------------------------------


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
        data = yaml.load(text, Loader=_Loader)
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
        PresetError: neither a file nor a known name; the message lists the names.
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
    shipped = ", ".join(n for n, _ in list_presets()) or "none"
    saved = ", ".join(n for n, _ in list_saved_presets())
    known = f"shipped: {shipped}" + (f"; saved: {saved}" if saved else "")
    raise PresetError(f"{name}: no such preset file or preset name ({known})")
