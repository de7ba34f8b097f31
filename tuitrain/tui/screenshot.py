"""The palette's Screenshot: an SVG of the screen, saved where the user will find it.

Textual's own command saves into the Downloads folder and fails when there is none (a
server, a container), with no word of where it tried. This saves into Downloads when it
exists, else the folder the app was started in, and says which file it wrote or why not.
"""

from __future__ import annotations

from pathlib import Path

import platformdirs
from textual.app import App

from tuitrain.tui.save_dialog import shown_path


def screenshot_folder() -> Path:
    """The user's Downloads folder when it exists, else the working folder."""
    downloads = Path(platformdirs.user_downloads_dir())
    return downloads if downloads.is_dir() else Path.cwd()


def save_screenshot(app: App, filename: str | None = None, path: str | None = None) -> None:
    """Save the screen as SVG into `path` (default: screenshot_folder()) and tell the user
    where it went, or why it could not be written."""
    folder = Path(path).expanduser() if path else screenshot_folder()
    try:
        saved = app.save_screenshot(filename, str(folder))
    except OSError as error:
        reason = error.strerror or error
        app.notify(f"could not save a screenshot in {shown_path(folder)}: {reason}",
                   title="Screenshot", severity="error")
        return
    app.notify(f"saved {shown_path(Path(saved).resolve())}", title="Screenshot")
