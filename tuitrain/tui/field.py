"""Field: a text input whose editing keys act in the order they were typed.

Textual's Input inserts a printable key as soon as the key reaches it, but runs its own
bindings (backspace, delete, home, end, ctrl+u, enter) only after the key has bubbled up to
the app. When keys come faster than the app's queue drains them (a paste, fast typing, a
step's redraw under way), the characters typed after a backspace land before it: "1234"
typed after clearing the field came out as "12", or as nothing. A Field runs its bindings
when the key reaches it, so every key acts in turn.
"""

from __future__ import annotations

from textual import events
from textual.widgets import Input

# Key names whose character Textual's key_to_character does not find, so that a key the
# field types ("+" in a margin) is not offered in the footer as the app's binding too.
TYPED = {"plus": "+", "minus": "-", "slash": "/", "at": "@", "backslash": "\\",
         "underscore": "_"}


class Field(Input):
    async def _on_key(self, event: events.Key) -> None:
        # Textual calls each class's key handler in turn, this one first: a key bound here
        # acts now and goes no further (not to Input's, which would type it).
        for binding in self._bindings.key_to_bindings.get(event.key, ()):
            if not binding.priority and await self.app.run_action(binding.action, self):
                event.stop()
                event.prevent_default()
                return

    def check_consume_key(self, key: str, character: str | None) -> bool:
        return super().check_consume_key(key, character or TYPED.get(key))
