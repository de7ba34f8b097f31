"""Presets: Settings saved as YAML, validated on load, written atomically.

A preset is what a user found while tuning (in the app or by hand) and wants to reuse on
another run or another machine. Each starts with a comment header saying how to reproduce
the run and what was measured when it was saved. Where presets live (the shipped ones, the
user's saved ones) and how a name finds one is tuitrain.preset_folders'.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import tempfile
from collections.abc import Collection, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from tuitrain.formatting import format_rate, format_seconds, format_size
from tuitrain.settings import SETTINGS_VERSION, InvalidSettings, Settings, validate_settings

SUFFIX = ".yaml"


class PresetError(ValueError):
    """A preset that cannot be used. The message is one line naming the file and the key."""


# --- reading -----------------------------------------------------------------------------


class PresetLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice is an error: YAML would keep the last one
    silently and the user would never learn which of their two values was used."""


def _construct_mapping(loader: PresetLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


PresetLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


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
        data = yaml.load(text, Loader=PresetLoader)  # a SafeLoader: plain data, never objects
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


def merge(
    settings: Settings, overrides: Mapping[str, Any], *, typed: Collection[str] = ()
) -> Settings:
    """A copy of `settings` with `overrides` applied; the input is left alone.

    Keys are dotted paths (`{"engine.margin_ratio": 0.5}`) or nested mappings
    (`{"engine": {"margin_ratio": 0.5}}`); a nested mapping updates only the keys it names.
    `typed`: those of the keys the user typed as flags (see validate_settings).

    Raises:
        InvalidSettings: a key that does not exist or a value that does not validate, with
            the dotted key of the first problem.
    """
    # What was never set stays unset (a policy left to the run, Settings.policy_chosen).
    data = settings.model_dump(exclude_unset=True)
    for key, value in overrides.items():
        _set(data, key.split("."), value)
    return validate_settings(data, typed=typed)


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
    still runs exactly what was saved; but the checkpoint a run resumed from (--resume),
    which is where that one run started, not how it trains: the preset's runs start afresh
    (one that should go on names its checkpoint with --resume). The header names the
    command that reproduces the run and what was measured when it was saved (see
    _measured_lines for the keys understood).
    """
    if settings.checkpoint.resume is not None:
        checkpoint = settings.checkpoint.model_copy(update={"resume": None})
        settings = settings.model_copy(update={"checkpoint": checkpoint})
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
