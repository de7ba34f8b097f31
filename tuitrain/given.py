"""How the user gave a command's settings: the flags typed, and the preset file read.

The settings themselves hold only values. A check that finds one wrong after they were
made (one that needs the model or the files: tuitrain.run_checks) names it as the user gave
it, the flag, else the preset file and the key, as the preset's own mistakes are named
(`presets/x.yaml: training.lora.targets: ...`, tuitrain.presets.load_preset).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tuitrain.flags import Flag
    from tuitrain.settings import Settings


@dataclass(frozen=True)
class Given:
    """The settings keys the user typed flags for, the flag of each key the command takes,
    and the preset file that gave the rest (None: no preset)."""

    typed: frozenset[str] = frozenset()
    flags: Mapping[str, str] = field(default_factory=dict)  # settings key -> its flag
    preset: str | None = None

    @classmethod
    def of(cls, args: argparse.Namespace, flags: tuple[Flag, ...]) -> Given:
        """What the user gave on the command line `args`, whose settings flags are `flags`
        (its preset, if any, already read: so found)."""
        from tuitrain.preset_folders import find_preset

        typed = frozenset(f.key for f in flags if f.value(args) is not None)
        preset = getattr(args, "preset", None)
        return cls(typed, {f.key: f.name for f in flags},
                   str(find_preset(preset)) if preset is not None else None)

    def name(self, key: str) -> str:
        """What a mistake in the settings `key` starts with: the flag that set it, else the
        preset file and the key, else the flag that would have set it."""
        if key in self.typed or self.preset is None:
            return self.flags.get(key, key)
        return f"{self.preset}: {key}"

    def gave(self, settings: Settings, key: str) -> bool:
        """Whether the user chose the settings `key`: a flag set it, or it holds other than
        its default. A preset saved by tuitrain writes every key, defaults included, so a
        default there is not taken for the user's choice."""
        return key in self.typed or settings.changed(key)
