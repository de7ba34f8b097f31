"""The `tuitrain` command: what a user types, what they see, and what status they get back.

Mistakes are one line on stderr with status 2 and no traceback, found before anything heavy
starts. A few cases run the real console script and `python -m tuitrain` in a subprocess; the
rest call main(argv) in this process.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from engine.models.zoo import KNOWN_MODELS
from engine.telemetry import MemorySnapshot, StepStats
from tests.tuitrain.test_presets import SHIPPED as SHIPPED_STORIES
from tuitrain import __version__
from tuitrain.cli import RUN_FLAGS, build_parser, main, resolve_settings
from tuitrain.measured import measure_metrics
from tuitrain.preset_folders import SHIPPED_DIR
from tuitrain.presets import load_preset, merge
from tuitrain.settings import LoraSettings, Settings

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "tuitrain"
SHIPPED = sorted(SHIPPED_STORIES)


def one_error_line(err: str) -> str:
    """The single stderr line of a refused command (and proof that it is the only one)."""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tuitrain: error: ")
    return lines[0]


def refused(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return one_error_line(captured.err)


def write(folder: Path, text: str, name: str = "p.yaml") -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


# --- the real command in a subprocess ----------------------------------------------------


def run_cli(args: list[str], cwd: Path, *, module: bool = False) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "tuitrain", *args] if module else [str(SCRIPT), *args]
    return subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=240
    )


def test_python_m_margin_out_of_range(tmp_path):
    done = run_cli(["run", "tiny", "--headless", "--margin", "1.5"], tmp_path, module=True)
    assert done.returncode == 2
    assert one_error_line(done.stderr) == (
        "tuitrain: error: --margin: must be within 0..1 (got 1.5)"
    )


def test_console_script_malformed_preset_names_the_file_and_line(tmp_path):
    preset = write(tmp_path, "version: 1\nengine:\n  policy: [cpu\n")
    done = run_cli(["run", "tiny", "--preset", str(preset), "--headless"], tmp_path)
    assert done.returncode == 2
    line = one_error_line(done.stderr)
    assert str(preset) in line
    assert "malformed YAML" in line


def test_console_script_version_and_help_are_quick_and_complete(tmp_path):
    done = run_cli(["--version"], tmp_path)
    assert done.returncode == 0
    assert done.stdout.strip() == f"tuitrain {__version__}"
    done = run_cli(["run", "--help"], tmp_path, module=True)
    assert done.returncode == 0
    for flag in [*RUN_FLAGS, "--preset", "--headless", "--save-preset", "--force"]:
        assert flag in done.stdout


def test_a_usage_error_from_argparse_is_one_line(tmp_path):
    done = run_cli(["run", "tiny", "--stepz", "3"], tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "tuitrain run: error: unrecognized argument: --stepz (did you mean --steps?)"]


def argparse_refusal(capsys, argv: list[str]) -> list[str]:
    """stderr of a command line argparse refuses, which is one line, status 2."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines


def test_a_mistyped_flag_or_command_gets_what_was_meant(capsys):
    assert argparse_refusal(capsys, ["run", "tiny", "--polcy", "auto"]) == [
        "tuitrain run: error: unrecognized argument: --polcy (did you mean --policy?)"]
    assert argparse_refusal(capsys, ["plan", "tiny", "--device-mem=1GiB", "--jsn"]) == [
        "tuitrain plan: error: unrecognized argument: --jsn (did you mean --json?)"]
    assert argparse_refusal(capsys, ["run", "tiny", "--zzz"]) == [
        "tuitrain run: error: unrecognized argument: --zzz"]  # nothing near: no guess
    assert argparse_refusal(capsys, ["rnu", "tiny"]) == [
        "tuitrain: error: unknown command rnu (did you mean run?)"]
    assert argparse_refusal(capsys, ["xyz"]) == [
        "tuitrain: error: unknown command xyz "
        "(run, plan, tune, calibrate, presets, models, attach, runs, export)"]


def test_bare_tuitrain_prints_the_help_and_exits_0(capsys):
    assert main([]) == 0
    captured = capsys.readouterr()
    assert captured.out == build_parser().format_help() and captured.err == ""


@pytest.mark.parametrize("argv", [["plan", "tiny", "--json"], ["presets"]])
def test_output_into_a_closed_pipe_ends_quietly(tmp_path, argv):
    """`tuitrain plan --json | head`: the reader went away; no traceback, status 141 as
    for a tool SIGPIPE ended."""
    read, write_end = os.pipe()
    os.close(read)  # the reader has gone before the first write
    try:
        done = subprocess.run([sys.executable, "-m", "tuitrain", *argv], cwd=tmp_path,
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=240)
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == 141


# --- bad input, in process ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--steps", "0"], "tuitrain: error: --steps: must be greater than 0 (got 0)"),
        (
            ["--device-mem", "6 gigs"],
            "tuitrain: error: --device-mem: not a size: '6 gigs' (use bytes or e.g. 6GiB, 512MiB)",
        ),
        (
            ["--device-mem", "0"],
            "tuitrain: error: --device-mem: a budget must be more than 0 bytes (got '0')",
        ),
        (
            ["--host-mem", "0GiB"],
            "tuitrain: error: --host-mem: a budget must be more than 0 bytes (got '0GiB')",
        ),
        (["--margin", "-0.1"], "tuitrain: error: --margin: must be within 0..1 (got -0.1)"),
        (
            ["--policy", "gpu"],
            "tuitrain: error: --policy: must be 'cuda', 'cpu' or 'auto' (got 'gpu')",
        ),
        (
            ["--precision", "fp8"],
            "tuitrain: error: --precision: must be 'fp32', 'bf16' or 'fp16' (got 'fp8')",
        ),
        (
            ["--batch-size", "two"],
            "tuitrain: error: --batch-size: must be a whole number (got 'two')",
        ),
        (["--lr", "0"], "tuitrain: error: --lr: must be greater than 0.0 (got 0)"),
        (["--lr", "inf"], "tuitrain: error: --lr: must be a finite number (got inf)"),
        (["--margin", "nan"], "tuitrain: error: --margin: must be a finite number (got nan)"),
        (
            ["--seed", str(2**64)],
            "tuitrain: error: --seed: must be a 64-bit whole number, within -2**63..2**63-1 "
            f"(got {2**64})",
        ),
        (
            ["--collective-timeout", "0"],
            "tuitrain: error: --collective-timeout: must be greater than 0.0 (got 0)",
        ),
        (
            ["--collective-timeout", "soon"],
            "tuitrain: error: --collective-timeout: must be a number (got 'soon')",
        ),
        (
            ["--collective-timeout", "1e9"],
            "tuitrain: error: --collective-timeout: must be at most 604800.0 (got 1000000000.0)",
        ),
        (
            ["--checkpoint-every", "10"],
            "tuitrain: error: --checkpoint-every needs --checkpoint-dir",
        ),
    ],
)
def test_each_bad_flag_is_one_line_naming_the_flag(capsys, args, expected):
    assert refused(capsys, ["run", "tiny", "--headless", *args]) == expected


def test_a_missing_data_path(capsys, tmp_path):
    missing = tmp_path / "corpus.txt"
    line = refused(capsys, ["run", "tiny", "--headless", "--data", str(missing)])
    assert line == f"tuitrain: error: data path not found: {missing}"


def test_an_unknown_model_lists_the_known_ones(capsys):
    # In process. The console script's one line and status 2 are checked above on a
    # malformed preset, and that a subprocess which imports the model zoo (torch,
    # transformers) writes nothing else to stderr, on the closed pipe's `plan --json`.
    line = refused(capsys, ["run", "opt-7b", "--headless"])
    assert "unknown model 'opt-7b'" in line
    assert all(name in line for name in KNOWN_MODELS)


CHECKS_WITHOUT_TORCH = """
import sys
from tuitrain.run_checks import check_model
from tuitrain.cli import main
check_model("opt-1.3b", 2048)
check_model("llama-8b", 8192)
assert main(["run", "opt-7b", "--headless"]) == 2
heavy = sorted({"torch", "transformers"} & set(sys.modules))
assert not heavy, heavy
"""


def test_a_zoo_name_or_a_mistyped_one_is_checked_without_importing_torch(tmp_path):
    """The run's own process checks a zoo name from the zoo's tables, before the worker
    starts: a mistake is answered at once, and the worker alone imports the training
    stack (seconds of CPU)."""
    done = subprocess.run([sys.executable, "-c", CHECKS_WITHOUT_TORCH], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "unknown model 'opt-7b'" in one_error_line(done.stderr)


def test_a_folder_that_is_not_a_model(capsys, tmp_path):
    line = refused(capsys, ["run", str(tmp_path), "--headless"])
    assert str(tmp_path) in line
    assert "config.json" in line


def test_a_sequence_longer_than_the_model_takes(capsys):
    line = refused(capsys, ["run", "tiny", "--headless", "--seq-len", "4096"])
    assert "4096" in line
    assert "512" in line


def test_a_missing_checkpoint_to_resume(capsys, tmp_path):
    line = refused(capsys, ["run", "tiny", "--headless", "--resume", str(tmp_path / "ck")])
    assert "resume" in line
    assert str(tmp_path / "ck") in line


def test_a_metrics_file_in_a_missing_folder(capsys, tmp_path):
    line = refused(capsys, ["run", "tiny", "--headless", "--metrics", str(tmp_path / "a/m.jsonl")])
    assert str(tmp_path / "a") in line


def test_a_metrics_file_is_appended_to_only_if_it_is_one(capsys, tmp_path):
    """Runs append to a metrics file; a file of the user's that is none (a preset named by
    mistake) is refused and left as it was."""
    mine = write(tmp_path, "version: 1\nmodel: tiny\n", "found.yaml")
    line = refused(capsys, ["run", "tiny", "--headless", "--metrics", str(mine)])
    assert f"--metrics: {mine} is not a metrics file" in line
    assert mine.read_text() == "version: 1\nmodel: tiny\n"
    from tuitrain.run_checks import check_runnable

    for name, text in (("earlier.jsonl", '{"settings": {}}\n{"step": 1}\n'), ("empty", "")):
        metrics = write(tmp_path, text, name)
        check_runnable(resolve_settings(build_parser().parse_args(
            ["run", "tiny", "--headless", "--metrics", str(metrics)])))


def test_save_preset_and_metrics_may_not_be_one_file(capsys, tmp_path):
    same = str(tmp_path / "same.out")
    line = refused(capsys, ["run", "tiny", "--headless", "--metrics", same, "--save-preset", same])
    assert line == f"tuitrain: error: --save-preset and --metrics name the same file: {same}"
    assert not (tmp_path / "same.out").exists()


def test_a_checkpoint_folder_with_an_earlier_runs_checkpoints_is_for_continuing_it(
        capsys, tmp_path):
    """A new run would replace the earlier run's checkpoints of its steps and leave the
    rest, which --resume would then pick: refused, unless the run continues that one."""
    ck = tmp_path / "ck"
    (ck / "step-000008").mkdir(parents=True)
    # What --resume reads before a run starts: the step, and the saved run's settings (the
    # defaults, as this run's are), as the manifest vouches for them.
    state = ck / "step-000008" / "state.json"
    state.write_text('{"format": 1, "step": 8, "settings": {}}')
    manifest = json.dumps({"format": 1, "files": {"state.json": {
        "bytes": state.stat().st_size,
        "sha256": hashlib.sha256(state.read_bytes()).hexdigest()}}})
    (ck / "step-000008" / "manifest.json").write_text(manifest)
    line = refused(capsys, ["run", "tiny", "--headless", "--checkpoint-dir", str(ck)])
    assert line == (f"tuitrain: error: --checkpoint-dir: {ck} holds an earlier run's "
                    f"checkpoints (the newest step-000008); continue that run with --resume "
                    f"{ck}, or name another folder")
    assert (ck / "step-000008" / "manifest.json").read_text() == manifest
    from tuitrain.run_checks import check_runnable

    for resume in (ck, ck / "step-000008"):
        check_runnable(resolve_settings(build_parser().parse_args(
            ["run", "tiny", "--headless", "--checkpoint-dir", str(ck), "--resume", str(resume)])))
    (tmp_path / "unfinished" / "step-000003").mkdir(parents=True)  # no manifest: not complete
    check_runnable(resolve_settings(build_parser().parse_args(
        ["run", "tiny", "--headless", "--checkpoint-dir", str(tmp_path / "unfinished")])))


def test_a_preset_that_is_a_device_is_refused_as_one(capsys):
    line = refused(capsys, ["run", "--preset", os.devnull, "--headless", "--steps", "2"])
    assert line == f"tuitrain: error: {os.devnull}: is not a regular file, not a preset file"


def test_no_model_and_no_preset_naming_one(capsys, tmp_path):
    assert "no model given" in refused(capsys, ["run", "--headless"])
    preset = write(tmp_path, "version: 1\nengine:\n  policy: cpu\n")
    assert "no model given" in refused(capsys, ["run", "--preset", str(preset), "--headless"])


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("version: 1\nengine:\n  polcy: cpu\n", ["engine.polcy", "unknown key"]),
        ("version: 1\ntraining:\n  steps: lots\n", ["training.steps", "whole number"]),
        ("version: 1\nengine:\n  policy: [cpu\n", ["malformed YAML", "line"]),
        ("version: 2\nmodel: tiny\n", ["version", "unsupported preset version 2"]),
        ("version: 1\nengine:\n  margin_ratio: 1.5\n", ["engine.margin_ratio", "0..1", "1.5"]),
        ("version: 1\nengine:\n  collective_timeout: -5\n",
         ["engine.collective_timeout", "greater than 0", "-5"]),
        ("- just\n- a list\n", ["expected a mapping"]),
        # YAML's true and false are no numbers (Python would take them for 1 and 0).
        ("version: 1\ntraining:\n  batch_size: true\n",
         ["training.batch_size", "must be a whole number (got true)"]),
        ("version: 1\nengine:\n  margin_ratio: false\n",
         ["engine.margin_ratio", "must be a number (got false)"]),
        ("version: 1\ntraining:\n  lr: .inf\n", ["training.lr", "must be a finite number"]),
    ],
)
def test_each_bad_preset_is_one_line_naming_file_and_key(capsys, tmp_path, text, needles):
    preset = write(tmp_path, text)
    line = refused(capsys, ["run", "tiny", "--preset", str(preset), "--headless"])
    assert str(preset) in line
    for needle in needles:
        assert needle in line


def test_a_missing_preset_lists_the_shipped_ones(capsys):
    line = refused(capsys, ["run", "tiny", "--preset", "gaming-rig", "--headless"])
    assert "gaming-rig" in line
    assert all(name in line for name in SHIPPED)


def test_the_app_needs_a_terminal(capsys):
    # Under pytest stdout is captured, so it is not a terminal, as in a pipe or a cron job.
    line = refused(capsys, ["run", "tiny"])
    assert "terminal" in line
    assert "--headless" in line


def test_save_preset_is_for_headless_runs(capsys, tmp_path):
    line = refused(capsys, ["run", "tiny", "--save-preset", str(tmp_path / "p.yaml")])
    assert "--headless" in line
    assert not (tmp_path / "p.yaml").exists()


def test_save_preset_never_replaces_a_file_without_force(capsys, tmp_path):
    mine = write(tmp_path, "# found by hand\nversion: 1\n", "mine.yaml")
    line = refused(capsys, ["run", "tiny", "--headless", "--save-preset", str(mine)])
    assert "--force" in line
    assert mine.read_text() == "# found by hand\nversion: 1\n"


def test_plan_checks_its_input_before_planning(capsys):
    line = refused(capsys, ["plan", "opt-1.3b", "--device-mem", "six"])
    assert line.startswith("tuitrain: error: --device-mem: not a size")
    line = refused(capsys, ["plan", "opt-1.3b", "--host-mem=-1GiB"])
    assert line.startswith("tuitrain: error: --host-mem: not a size")
    line = refused(capsys, ["plan", "opt-1.3b", "--precision", "fp4"])
    assert line.startswith("tuitrain: error: --precision:")
    assert "unknown model 'opt-9b'" in refused(capsys, ["plan", "opt-9b"])
    # As a run refuses them: the flag named, a folder the run would not make.
    assert refused(capsys, ["plan", "tiny", "--host-mem", "0"]) == (
        "tuitrain: error: --host-mem: a budget must be more than 0 bytes (got '0')")
    assert refused(capsys, ["plan", "tiny", "--host-mem", "4MiB", "--disk",
                            "/nonexistent/scratch"]) == (
        "tuitrain: error: --disk: folder not found: /nonexistent")
    assert "no model given" in refused(capsys, ["plan"])


def test_plan_takes_the_model_a_preset_names(capsys, tmp_path):
    preset = write(tmp_path, "version: 1\nmodel: tiny\n")
    assert main(["plan", "--preset", str(preset), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "tiny"


# --- settings: defaults < preset < flags -------------------------------------------------


def parsed(argv: list[str]):
    return resolve_settings(build_parser().parse_args(argv))


def test_flags_override_the_preset_which_overrides_the_defaults(tmp_path):
    preset = write(
        tmp_path,
        "version: 1\nmodel: opt-350m\nengine:\n  policy: cpu\n  margin_ratio: 0.3\n"
        "training:\n  steps: 7\n  lr: 0.01\n",
    )
    settings = parsed(["run", "tiny", "--preset", str(preset), "--steps", "3", "--margin", "0.6"])
    defaults = Settings()
    assert settings.model == "tiny"  # flag (MODEL) over preset
    assert settings.training.steps == 3  # flag over preset
    assert settings.engine.margin_ratio == 0.6  # flag over preset
    assert settings.engine.policy == "cpu"  # preset over default
    assert settings.training.lr == 0.01  # preset over default
    assert settings.training.batch_size == defaults.training.batch_size  # default
    assert settings.engine.precision == defaults.engine.precision  # default


def test_the_preset_model_is_used_when_no_model_is_given(tmp_path):
    preset = write(tmp_path, "version: 1\nmodel: opt-350m\n")
    assert parsed(["run", "--preset", str(preset)]).model == "opt-350m"


def test_a_shipped_preset_by_name():
    assert parsed(["run", "--preset", "laptop-6gb"]).engine.device_budget == "5.5GiB"


def test_every_flag_reaches_its_setting(tmp_path):
    data = write(tmp_path, "some text", "corpus.txt")
    settings = parsed(
        [
            "run", "tiny", "--policy", "cpu", "--margin", "0.25", "--device-mem", "512MiB",
            "--precision", "fp16", "--steps", "9", "--batch-size", "3", "--seq-len", "64",
            "--lr", "1e-4", "--seed", "5", "--checkpointing", "--data", str(data),
            "--metrics", "m.jsonl", "--checkpoint-dir", "ck", "--checkpoint-every", "4",
            "--resume", "old", "--host-mem", "8GiB", "--disk", str(tmp_path / "scratch"),
            "--collective-timeout", "30",
        ]
    )  # fmt: skip
    assert settings.engine.model_dump() == {
        "policy": "cpu", "margin_ratio": 0.25, "device_budget": "512MiB",
        "host_budget": "8GiB", "disk_dir": str(tmp_path / "scratch"),
        "precision": "fp16", "chunk_size": None, "collective_timeout": 30.0,
    }  # fmt: skip
    assert settings.engine.host_budget.nbytes == 8 * 2**30
    t = settings.training
    assert (t.steps, t.batch_size, t.seq_len, t.lr, t.seed) == (9, 3, 64, 1e-4, 5)
    assert t.activation_checkpointing is True
    assert settings.data.path == str(data)
    assert settings.logging.metrics == "m.jsonl"
    assert settings.checkpoint.model_dump() == {"dir": "ck", "every": 4, "resume": "old"}


def test_checkpointing_and_no_checkpointing_together_are_refused(capsys):
    for command in ("run", "plan", "tune"):
        assert argparse_refusal(capsys, [command, "tiny", "--checkpointing",
                                         "--no-checkpointing"]) == [
            f"tuitrain {command}: error: argument --no-checkpointing: not allowed with "
            "argument --checkpointing"]
    assert argparse_refusal(capsys, ["run", "tiny", "--no-checkpointing", "--checkpointing"]) == [
        "tuitrain run: error: argument --checkpointing: not allowed with argument "
        "--no-checkpointing"]
    # Said twice, it is said once.
    assert parsed(["run", "tiny", "--checkpointing", "--checkpointing"]
                  ).training.activation_checkpointing is True


@pytest.mark.parametrize("command", ["run", "tune"])
def test_force_without_save_preset_is_refused(capsys, command):
    assert refused(capsys, [command, "tiny", "--headless" if command == "run" else "--steps=9",
                            "--force"]) == (
        "tuitrain: error: --force lets --save-preset replace a file; without --save-preset it "
        "has nothing to do")


def test_no_checkpointing_turns_off_what_a_preset_turned_on():
    assert parsed(["run", "--preset", "laptop-6gb"]).training.activation_checkpointing
    off = parsed(["run", "--preset", "laptop-6gb", "--no-checkpointing"])
    assert off.training.activation_checkpointing is False


def test_help_states_the_real_built_in_defaults():
    run = build_parser()._subparsers._group_actions[0].choices["run"]
    defaults = Settings().model_dump()
    checked = 0
    for action in run._actions:
        flag = next((o for o in action.option_strings if o in RUN_FLAGS), None)
        shown = re.search(r"\(default (\S+)\)", action.help or "")
        if flag is None or shown is None:
            continue
        *sections, key = RUN_FLAGS[flag].split(".")
        if len(sections) == 1:
            default = defaults[sections[0]][key]
        else:  # a section unset by default (training.lora): its own defaults
            default = LoraSettings.model_fields[key].default
        assert yaml.safe_load(shown.group(1)) == default, flag
        checked += 1
    assert checked >= 8


# --- listing -----------------------------------------------------------------------------


def test_models_lists_the_zoo_with_sizes(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    for name in KNOWN_MODELS:
        assert name in rows
    assert rows["opt-1.3b"][1:] == ["1.3B", "1,315,758,080", "24", "2048"]
    assert rows["opt-125m"][1:] == ["125M", "125,239,296", "12", "768"]
    assert out.splitlines()[0].split() == ["MODEL", "SIZE", "PARAMETERS", "LAYERS", "HIDDEN"]


def test_presets_lists_the_four_shipped_presets_with_their_description(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines if not line.startswith(" ")] == SHIPPED
    start = next(i for i, line in enumerate(lines) if line.startswith("laptop-6gb"))
    # A description is never cut mid-sentence: a long one goes on, indented, under itself.
    listed = " ".join(lines[start:start + 2]).split()[1:]
    first_comment = (SHIPPED_DIR / "laptop-6gb.yaml").read_text().splitlines()[0]
    assert listed == first_comment.lstrip("# ").split()
    assert listed[-2:] == ["in", "bf16."]


def test_presets_show_prints_the_file(capsys):
    assert main(["presets", "show", "v100-32gb"]) == 0
    assert capsys.readouterr().out == (SHIPPED_DIR / "v100-32gb.yaml").read_text()
    line = refused(capsys, ["presets", "show", "nope"])
    assert "nope" in line


# --- measurements for a saved preset -----------------------------------------------------


def stats_line(step: int, *, seconds: float, peak: int, tokens: int = 256) -> str:
    memory = MemorySnapshot(
        device_capacity=1 << 30, device_model=0, device_non_model_peak=0, device_peak=peak,
        host_model=0, process_rss=0,
    )  # fmt: skip
    stats = StepStats(
        step=step, loss=1.0, tokens=tokens, seconds=seconds, forward=0.0, backward=0.0,
        optimizer=0.0, transfer=0.0, bytes_h2d=0, bytes_d2h=0, policy="auto",
        margin_ratio=0.0, device_budget=1 << 30, memory=memory,
    )  # fmt: skip
    return json.dumps(asdict(stats))


def test_measure_metrics_reads_the_latest_run_as_its_trial_medians_of_settled_steps(tmp_path):
    """What a preset saved after a headless run records is the run's trial, as the summary
    printed it: medians over the settled steps, the warm-up step left out."""
    path = tmp_path / "m.jsonl"
    lines = [
        json.dumps({"settings": {"model": "tiny"}}),
        stats_line(1, seconds=9.0, peak=999 << 20),  # an earlier run appended before
        json.dumps({"settings": {"model": "tiny"}}),
        stats_line(1, seconds=5.0, peak=10 << 20),  # warm-up: traced, slow
        stats_line(2, seconds=1.0, peak=12 << 20),
        stats_line(3, seconds=4.0, peak=11 << 20),
        stats_line(4, seconds=2.0, peak=11 << 20),
    ]
    path.write_text("\n".join(lines) + "\n")
    measured = measure_metrics(path)
    assert measured is not None
    assert {k: measured[k] for k in ("first_step", "step", "settled_steps", "device_peak",
                                     "step_seconds", "tokens_per_second")} == {
        "first_step": 1, "step": 4, "settled_steps": 3, "device_peak": 12 << 20,
        "step_seconds": 2.0,  # the median of 1, 4 and 2 s: not the mean, 2.33 s
        "tokens_per_second": 128.0,
    }
    path.write_text(json.dumps({"settings": {}}) + "\n")
    assert measure_metrics(path) is None


# --- real runs (the worker, the engine and the tiny model) -------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_each_shipped_preset_runs_a_step_of_tiny(capsys, tmp_path, name):
    """Every key of each shipped preset reaches a real step: its policy, margin, precision,
    host budget, micro-batches, activation checkpointing and held-out evaluation. On tiny,
    in a budget tiny fits, and with short sequences: the presets' 512 tokens (for their
    own models) only multiply the step's arithmetic, 8 micro-batches and the evaluation's
    batches over, and take none of those paths that shorter ones do not."""
    argv = ["run", "tiny", "--preset", f"{REPO}/presets/{name}.yaml", "--headless", "--steps",
            "1", "--device-mem", "256MiB", "--seq-len", "64"]  # fmt: skip
    saved = tmp_path / "found.yaml"
    metrics = tmp_path / "m.jsonl"
    if name == "cpu-only":  # one of the runs also saves what it used and measured
        argv += ["--metrics", str(metrics), "--save-preset", str(saved)]
    status = main(argv)
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "Traceback" not in captured.err
    if name == "cpu-only":
        assert f"preset saved to {saved}" in captured.out
        used = parsed(argv)
        assert load_preset(saved) == used
        header = [line for line in saved.read_text().splitlines() if line.startswith("#")]
        assert f"# reproduce: tuitrain run --preset {saved} --headless" in header
        assert any(line.startswith("# measured at step 1: device peak ") for line in header)


def test_nproc_mistakes_are_one_line_before_any_rank_starts(capsys, monkeypatch):
    run = ["run", "tiny", "--headless", "--steps", "1"]
    # Worded as every flag's mistake is (`--steps: must be greater than 0 (got 0)`).
    assert refused(capsys, [*run, "--nproc", "0"]) == (
        "tuitrain: error: --nproc: must be a whole number of ranks, at least 1 (got 0)")
    assert "(got two)" in refused(capsys, [*run, "--nproc", "two"])
    assert refused(capsys, [*run, "--nproc", "2", "--batch-size", "3"]) == (
        "tuitrain: error: batch_size 3 does not split evenly over 2 ranks; use a multiple of 2")
    # The app checks the split too, before it needs a terminal.
    assert refused(capsys, ["run", "tiny", "--nproc", "2", "--batch-size", "3"]) == (
        "tuitrain: error: batch_size 3 does not split evenly over 2 ranks; use a multiple of 2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert refused(capsys, [*run, "--nproc", "2"]) == (
        "tuitrain: error: --nproc starts the ranks itself; under torchrun leave it out")


@pytest.fixture
def unwritable(tmp_path, monkeypatch) -> Path:
    """A folder nobody may write in (mode 0o500). Root is not held back by modes, so for
    root the folder is also reported as not writable, as it would be to anyone else."""
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    if os.geteuid() == 0:
        real = os.access
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: (
            False if Path(path) == folder and mode & os.W_OK else real(path, mode, **kw)))
    yield folder
    folder.chmod(0o700)


@pytest.mark.parametrize("flag", ["--save-preset", "--metrics", "--checkpoint-dir"])
def test_a_place_the_run_cannot_write_is_one_line_before_anything_starts(
    capsys, monkeypatch, unwritable, flag
):
    from tuitrain import headless

    started = []
    monkeypatch.setattr(headless, "run_headless", lambda *a, **kw: started.append(a) or 0)
    target = unwritable / ("ck" if flag == "--checkpoint-dir" else "out")
    line = refused(capsys, ["run", "tiny", "--headless", "--steps", "1", flag, str(target)])
    assert line == f"tuitrain: error: {flag}: cannot write in {unwritable} (permission denied)"
    assert started == []
    assert os.listdir(unwritable) == []
    # A folder under a file cannot be made either.
    a_file = write(unwritable.parent, "not a folder", "f.txt")
    line = refused(capsys, ["run", "tiny", "--headless", "--checkpoint-dir", str(a_file / "ck")])
    assert line == f"tuitrain: error: --checkpoint-dir: {a_file} is a file, not a folder"


def test_a_tune_that_cannot_save_its_preset_is_one_line_before_it_starts(capsys, unwritable):
    line = refused(capsys, ["tune", "tiny", "--save-preset", str(unwritable / "t.yaml")])
    assert line == (
        f"tuitrain: error: --save-preset: cannot write in {unwritable} (permission denied)")


def test_a_disk_folder_that_cannot_be_made_is_one_line_before_anything_runs(capsys, tmp_path):
    a_file = write(tmp_path, "not a folder", "f.txt")
    line = refused(capsys, ["run", "tiny", "--headless", "--disk", str(a_file / "scratch")])
    assert line.startswith("tuitrain: error: --disk: scratch folder ")
    assert "cannot be created" in line
    assert refused(capsys, ["run", "tiny", "--headless", "--host-mem", "lots"]).startswith(
        "tuitrain: error: --host-mem: ")
    assert sorted(os.listdir(tmp_path)) == ["f.txt"]


def test_a_disk_folder_is_made_only_by_a_run_that_puts_something_there(capsys, tmp_path):
    """--disk names where the scratch would go: a run that needs none (no host budget)
    leaves no folder there; a missing folder above it is a mistyped path, refused before
    anything runs as a missing folder of --metrics or --save-preset is, nothing made."""
    line = refused(capsys, ["run", "tiny", "--headless", "--steps", "1",
                            "--disk", str(tmp_path / "nodisk" / "sub")])
    assert line == f"tuitrain: error: --disk: folder not found: {tmp_path / 'nodisk'}"
    assert os.listdir(tmp_path) == []
    assert main(["run", "tiny", "--headless", "--steps", "2", "--policy", "cuda",
                 "--disk", str(tmp_path / "sub")]) == 0
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_folder_is_the_runs_to_make_but_not_the_folders_above_it(
    capsys, monkeypatch, tmp_path
):
    from tuitrain import headless

    started = []
    monkeypatch.setattr(headless, "run_headless", lambda *a, **kw: started.append(a) or 0)
    missing = tmp_path / "no" / "such"
    line = refused(capsys, ["run", "tiny", "--headless", "--checkpoint-dir", str(missing / "ck")])
    assert line == f"tuitrain: error: --checkpoint-dir: folder not found: {missing}"
    assert started == [] and os.listdir(tmp_path) == []
    assert main(["run", "tiny", "--headless", "--checkpoint-dir", str(tmp_path / "ck")]) == 0
    assert len(started) == 1


@pytest.mark.slow
def test_a_run_refused_by_the_engine_saves_no_preset_and_says_one_line(capsys, tmp_path):
    saved = tmp_path / "p.yaml"
    # 1 KiB cannot hold the working set of even the tiny model: the engine refuses it.
    argv = ["run", "tiny", "--headless", "--steps", "1", "--device-mem", "1KiB", "--save-preset",
            str(saved)]  # fmt: skip
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "minimum" in line
    assert os.listdir(tmp_path) == []


def test_a_preset_saved_from_a_data_parallel_run_reproduces_it_on_as_many_ranks(
    capsys, tmp_path, monkeypatch
):
    from tuitrain import headless, launch
    from tuitrain.events import Started

    def chosen_by_the_plan(settings: Settings) -> dict:  # what a worker starts with
        return merge(settings, {"engine.policy": "cpu"}).model_dump(mode="json")

    started = []

    def ranks_started(nproc, argv, **kw):  # rank 0 tells the launcher what it used
        started.append(nproc)
        used = chosen_by_the_plan(parsed(["run", *argv]))
        Path(os.environ[launch.USED_SETTINGS_ENV]).write_text(json.dumps(used))
        return 0

    monkeypatch.setattr(launch, "launch", ranks_started)
    saved = tmp_path / "dp.yaml"
    run = ["run", "tiny", "--headless", "--steps", "1", "--batch-size", "4"]
    assert main([*run, "--nproc", "2", "--save-preset", str(saved)]) == 0, capsys.readouterr()
    assert started == [2]
    header = [line for line in saved.read_text().splitlines() if line.startswith("#")]
    assert f"# reproduce: tuitrain run --preset {saved} --headless --nproc 2" in header
    assert load_preset(saved).engine.policy == "cpu"  # the policy the ranks trained under
    assert launch.USED_SETTINGS_ENV not in os.environ

    def rank_0(settings, *, on_started, **kw):
        on_started(Started(model="tiny", parameters=1, device="simulated", chunks=[],
                           settings=chosen_by_the_plan(settings)))
        return 0

    # Under torchrun rank 0 saves it, with as many ranks as torchrun started.
    monkeypatch.setattr(headless, "run_headless", rank_0)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    under_torchrun = tmp_path / "torchrun.yaml"
    assert main([*run, "--save-preset", str(under_torchrun)]) == 0, capsys.readouterr()
    header = [line for line in under_torchrun.read_text().splitlines() if line.startswith("#")]
    assert f"# reproduce: tuitrain run --preset {under_torchrun} --headless --nproc 4" in header
    assert load_preset(under_torchrun).engine.policy == "cpu"


@pytest.mark.slow
def test_a_saved_preset_holds_the_policy_the_plan_chose_for_the_run(capsys, tmp_path):
    """A run given no --policy trains under the plan's choice (cuda, for tiny): the preset
    saved from it says that policy, as the metrics' settings do, not the `auto` it asked
    with, and the precision and device budget the run resolved."""
    saved, metrics = tmp_path / "found.yaml", tmp_path / "m.jsonl"
    argv = ["run", "tiny", "--headless", "--steps", "1", "--seq-len", "16", "--metrics",
            str(metrics), "--save-preset", str(saved)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    used = json.loads(metrics.read_text().splitlines()[0])["settings"]
    assert used["engine"]["policy"] == "cuda"
    preset = load_preset(saved)
    assert preset.engine.policy == "cuda"
    assert preset.model_dump(mode="json") == used


def test_a_warm_up_longer_than_the_run_says_so_in_one_line(capsys, monkeypatch, tmp_path):
    from tuitrain import headless

    monkeypatch.setattr(headless, "run_headless", lambda settings, **streams: 0)
    preset = write(tmp_path, "version: 1\nmodel: tiny\ntraining:\n  warmup_steps: 10\n")
    assert main(["run", "--preset", str(preset), "--headless", "--steps", "3"]) == 0
    assert capsys.readouterr().err == (
        "tuitrain: warning: the warm-up (10 steps) is longer than the run (3 steps): the "
        "learning rate never reaches --lr 0.0003\n")
    assert main(["run", "--preset", str(preset), "--headless", "--steps", "10"]) == 0
    assert capsys.readouterr().err == ""


# --- a setting given for nothing is refused, named as the user gave it ------------------------

NOTHING_HELD_OUT = ("nothing is held out to evaluate on: set data.eval_fraction or "
                    "data.eval_path (--eval-fraction F or --eval-data PATH)")
NO_FIELDS = ("no fields; a text field names the one that holds the text in a JSONL file, a "
             "folder holding JSONL files, or a `datasets` folder")


@pytest.mark.parametrize("value", ["3", "8"], ids=["another number", "the default, typed"])
def test_eval_batches_without_held_out_text_is_refused_as_eval_every_is(capsys, value):
    line = refused(capsys, ["run", "tiny", "--headless", "--eval-batches", value])
    assert line == f"tuitrain: error: --eval-batches: {NOTHING_HELD_OUT}"


def test_a_preset_choosing_eval_batches_without_held_out_text_is_refused_by_file_and_key(
        capsys, tmp_path):
    preset = write(tmp_path, "version: 1\nmodel: tiny\ntraining:\n  eval_batches: 4\n")
    line = refused(capsys, ["run", "--preset", str(preset), "--headless"])
    assert line == f"tuitrain: error: {preset}: training.eval_batches: {NOTHING_HELD_OUT}"


def test_a_saved_preset_with_every_key_and_no_held_out_text_still_runs(tmp_path):
    """A saved preset writes eval_batches with its default: that is no choice of the
    user's, and the preset runs as saved."""
    from tuitrain.presets import save_preset

    saved = save_preset(Settings(model="tiny"), tmp_path / "saved.yaml")
    assert "eval_batches: 8" in saved.read_text()
    assert parsed(["run", "--preset", str(saved)]) == load_preset(saved)


def given_checked(argv: list[str]) -> None:
    """`tuitrain ARGV`'s settings through every check a run makes before it starts."""
    from tuitrain.flags import RUN
    from tuitrain.given import Given
    from tuitrain.run_checks import check_runnable

    args = build_parser().parse_args(argv)
    check_runnable(resolve_settings(args), Given.of(args, RUN))


def test_a_text_field_for_text_without_fields_is_refused_saying_which_have_them(
        capsys, tmp_path):
    corpus = write(tmp_path, "plain text, read whole\n", "corpus.txt")
    line = refused(capsys, ["run", "tiny", "--headless", "--data", str(corpus),
                            "--text-field", "body"])
    assert line == f"tuitrain: error: --text-field: {corpus} has {NO_FIELDS}"
    line = refused(capsys, ["run", "tiny", "--headless", "--text-field", "body"])
    assert line == f"tuitrain: error: --text-field: the built-in corpus has {NO_FIELDS}"
    preset = write(tmp_path, f"version: 1\nmodel: tiny\ndata:\n  path: {corpus}\n"
                             f"  text_field: body\n")
    line = refused(capsys, ["run", "--preset", str(preset), "--headless"])
    assert line == f"tuitrain: error: {preset}: data.text_field: {corpus} has {NO_FIELDS}"


def test_a_text_field_is_taken_for_any_data_the_run_reads_that_has_fields(tmp_path):
    plain = write(tmp_path, "plain text\n", "corpus.txt")
    records = write(tmp_path, '{"body": "a record"}\n', "records.jsonl")
    folder = tmp_path / "notes"
    (folder / "2026").mkdir(parents=True)
    (folder / "2026" / "day.jsonl").write_text('{"body": "a note"}\n')
    for data in (["--data", str(records)], ["--data", str(folder)],
                 ["--data", str(plain), "--eval-data", str(records)]):
        given_checked(["run", "tiny", *data, "--text-field", "body"])
    # A saved preset's text field is the default, for any data: not the user's choice.
    given_checked(["run", "tiny", "--data", str(plain)])


@pytest.mark.parametrize("command", [["run", "--headless", "--steps", "1"], ["plan"],
                                     ["tune", "--steps", "10"]], ids=lambda c: c[0])
def test_a_presets_lora_targets_that_match_nothing_are_named_by_file_and_key(
        capsys, tmp_path, command):
    preset = write(tmp_path, "version: 1\nmodel: tiny\ntraining:\n  lora:\n    rank: 2\n"
                             "    targets: [q_proj, no_such_proj]\n")
    line = refused(capsys, [*command, "--preset", str(preset)])
    assert line == (f"tuitrain: error: {preset}: training.lora.targets: LoRA targets "
                    f"'no_such_proj' match no module of the model")
    line = refused(capsys, [*command, "--preset", str(preset),
                            "--lora-targets", "nor_this"])  # the flag replaces the preset's
    assert line == ("tuitrain: error: --lora-targets: LoRA targets 'nor_this' match no "
                    "module of the model")


def test_the_start_lines_say_when_activations_are_checkpointed():
    import io

    from tuitrain.events import Started
    from tuitrain.headless import _Report

    def training_line(checkpointing: bool) -> str:
        settings = merge(Settings(model="tiny"),
                         {"training.activation_checkpointing": checkpointing})
        out = io.StringIO()
        report = _Report(settings=settings, out=out, err=io.StringIO(), log_path="w.log")
        report.handle(Started(model="tiny", parameters=657_344, device="simulated, 6.0 GiB",
                              chunks=[], settings=settings.model_dump(mode="json"), pid=7,
                              log_path="w.log"))
        return next(line for line in out.getvalue().splitlines()
                    if line.startswith("  training "))

    assert training_line(True) == ("  training 200 steps of 2 x 128 tokens, lr 0.0003 "
                                   "constant, seed 0, activation checkpointing")
    assert "checkpointing" not in training_line(False)
