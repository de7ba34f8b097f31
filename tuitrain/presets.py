"""Presets: Settings saved as YAML, validated on load, written atomically.

A preset is what a user found while tuning (in the app or by hand) and wants to reuse on
another run or another machine. Shipped presets live in the repository's `presets/` folder,
one per hardware story; a saved one starts with a comment header saying how to reproduce the
run and what was measured when it was saved.
"""

from __future__ import annotations

import contextlib
import os
import site
import sysconfig
import tempfile
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from engine.config import format_size
from tuitrain.settings import SETTINGS_VERSION, InvalidSettings, Settings, validate_settings

SUFFIX = ".yaml"


def _shipped_dir() -> Path:
    """Where the shipped presets are: the source tree's `presets/` (a checkout or an
    editable install), else the copy a wheel installs under `<data>/share/tuitrain/presets`."""
    candidates = [Path(__file__).resolve().parents[1] / "presets"]
    for data_root in (sysconfig.get_path("data"), site.getuserbase()):
        candidates.append(Path(data_root) / "share" / "tuitrain" / "presets")
    return next((c for c in candidates if c.is_dir()), candidates[0])


SHIPPED_DIR = _shipped_dir()


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
    data = settings.model_dump()
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

    Known keys: `device_peak` (bytes), `step_seconds`, `tokens_per_second`, `step`.
    """
    parts = []
    rest = dict(measured)
    if (peak := rest.pop("device_peak", None)) is not None:
        parts.append(f"device peak {format_size(peak)}")
    if (seconds := rest.pop("step_seconds", None)) is not None:
        parts.append(f"step time {seconds:.3g} s")
    if (rate := rest.pop("tokens_per_second", None)) is not None:
        parts.append(f"{rate:,.0f} tokens/s")
    step = rest.pop("step", None)
    lines = []
    if parts:
        at = f" at step {step}" if step is not None else ""
        lines.append(f"measured{at}: {', '.join(parts)}")
    elif step is not None:
        rest["step"] = step
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


# --- shipped presets ---------------------------------------------------------------------


def list_presets() -> list[tuple[str, str]]:
    """(name, description) of each shipped preset, by name; the description is the text of
    the file's first comment line."""
    entries = []
    for path in sorted(SHIPPED_DIR.glob(f"*{SUFFIX}")):
        entries.append((path.stem, _description(path)))
    return entries


def _description(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def find_preset(name_or_path: str | os.PathLike) -> Path:
    """The preset file for a path, or for the name of a shipped preset (`laptop-6gb`).

    An existing file wins over a shipped name, so a user's own `laptop-6gb.yaml` in the
    working folder is the one used.

    Raises:
        PresetError: neither a file nor a shipped name; the message lists the shipped names.
    """
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    name = str(name_or_path)
    stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name
    shipped = SHIPPED_DIR / f"{stem}{SUFFIX}"
    if os.sep not in name and "/" not in name and shipped.is_file():
        return shipped
    if path.is_dir():
        raise PresetError(f"{path}: is a folder, not a preset file")
    names = ", ".join(n for n, _ in list_presets()) or "none"
    raise PresetError(f"{name}: no such preset file or shipped preset (shipped: {names})")
