"""The house: the engine stands alone (it never imports the application or a UI), neither
package imports itself round a circle, and no module grows past what one reads at a sitting.

The engine's independence is checked twice, statically by import-linter's contract in
pyproject.toml, and at run time by importing every engine module in a fresh process and
looking at what got loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.forked import run_script

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = ("tuitrain", "textual", "textual_plotext")


@pytest.fixture(scope="module")
def lint_imports() -> subprocess.CompletedProcess:
    """One run of import-linter over every contract, which both contract tests read."""
    command = Path(sys.executable).parent / "lint-imports"
    return subprocess.run(
        [str(command), "--config", str(REPO / "pyproject.toml"), "--no-cache"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_import_linter_contracts_are_kept(lint_imports):
    done = lint_imports
    assert done.returncode == 0, done.stdout + done.stderr
    assert "engine stands alone: no tuitrain, no textual KEPT" in done.stdout
    assert "no import circles in the engine KEPT" in done.stdout
    assert "0 broken" in done.stdout


IMPORT_ALL_OF_ENGINE = """
import importlib, json, pkgutil, sys
import engine
names = [m.name for m in pkgutil.walk_packages(engine.__path__, "engine.")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"imported": names, "loaded": sorted(sys.modules)}))
"""


def test_importing_every_engine_module_loads_no_application_or_ui_module():
    # A process forked from the tests' server (tests/forked.py), which has imported torch
    # and transformers and nothing of the application or of a UI: what the engine's modules
    # load besides is theirs alone, without a fresh interpreter's seconds of those imports.
    out = run_script(IMPORT_ALL_OF_ENGINE, timeout=240)
    report = json.loads(out.splitlines()[-1])
    assert "engine.step.engine" in report["imported"]
    assert "engine.models.zoo" in report["imported"]
    leaked = [m for m in report["loaded"] if m.split(".")[0] in FORBIDDEN]
    assert leaked == []


# --- the application: no import circles, and the contracts that keep it layered ----------

APPLICATION_CONTRACTS = (
    "application layers: commands, UIs, the worker, what they share",
    "the TUI reaches the worker through its client only",
    "the TUI never imports torch or the engine's training code",
    "the app above its panels; panels never reach the app",
    "no import circles in tuitrain",
)


def import_circles(package: str) -> list[tuple[str, ...]]:
    """One circle of imports (a, b, ..., a) per group of modules of `package` that import
    each other round, type-hint-only imports included; empty when there is none."""
    import grimp

    graph = grimp.build_graph(package, exclude_type_checking_imports=False)
    modules = sorted(m for m in graph.modules if m.split(".")[0] == package)
    imports = {
        m: sorted(d for d in graph.find_modules_directly_imported_by(m) if d in modules)
        for m in modules
    }
    circles = []
    for group in _strongly_connected(imports):
        first = min(group)
        nxt = next(m for m in imports[first] if m in group)
        back = graph.find_shortest_chain(importer=nxt, imported=first)
        circles.append((first, *back))
    return circles


def _strongly_connected(imports: dict[str, list[str]]) -> list[set[str]]:
    """Tarjan's algorithm: the groups of more than one module that reach each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in imports[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = set()
            while not group or module not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for module in imports:
        if module not in index:
            visit(module)
    return groups


def test_no_module_of_the_engine_imports_itself_round_a_circle():
    """Data parallel sits over the single-process parts (the sharding takes the manager,
    the manager calls a hook it is given), and a chunk knows the disk tier by a protocol:
    no two modules know each other, not even for type hints."""
    circles = import_circles("engine")
    assert circles == [], "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_no_module_of_tuitrain_imports_itself_round_a_circle():
    circles = import_circles("tuitrain")
    assert circles == [], "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_application_contracts_are_kept(lint_imports):
    done = lint_imports
    for contract in APPLICATION_CONTRACTS:
        assert f"{contract} KEPT" in done.stdout, done.stdout + done.stderr


# --- no module over 500 lines --------------------------------------------------------------

MOST_LINES = 500


def test_no_module_of_the_engine_or_the_application_is_over_500_lines():
    """Past 500 lines a module holds more than one concept: split it where they part."""
    long = {str(path.relative_to(REPO)): lines
            for package in ("engine", "tuitrain")
            for path in sorted((REPO / package).rglob("*.py"))
            if (lines := len(path.read_text().splitlines())) > MOST_LINES}
    assert long == {}, f"modules over {MOST_LINES} lines: {long}"
