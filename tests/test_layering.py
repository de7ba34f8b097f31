"""The engine stands alone: it never imports the application or a UI.

Checked twice, statically by import-linter's contract in pyproject.toml, and at run time by
importing every engine module in a fresh interpreter and looking at what got loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = ("tuitrain", "textual", "textual_plotext")


def test_import_linter_contracts_are_kept():
    lint_imports = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run(
        [str(lint_imports), "--config", str(REPO / "pyproject.toml"), "--no-cache"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "engine stands alone: no tuitrain, no textual KEPT" in done.stdout
    assert "0 broken" in done.stdout


IMPORT_ALL_OF_ENGINE = """
import importlib, json, pkgutil, sys
import engine
names = [m.name for m in pkgutil.walk_packages(engine.__path__, "engine.")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"imported": names, "loaded": sorted(sys.modules)}))
"""


def test_importing_every_engine_module_loads_no_application_or_ui_module(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL_OF_ENGINE],
        cwd=tmp_path,  # not the repository: only what is installed is importable
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert "engine.step.engine" in report["imported"]
    assert "engine.models.zoo" in report["imported"]
    leaked = [m for m in report["loaded"] if m.split(".")[0] in FORBIDDEN]
    assert leaked == []
