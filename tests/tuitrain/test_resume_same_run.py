"""`--resume` continues the run that saved the checkpoint, or says in one line why not: the
data, how it is read and cut, the global batch and the seed are the saved run's; the
length, the learning rate, the placement and the split of the batch are the user's to
change. A LoRA run of `tiny` on a small text file, checkpointed once, for every test."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tuitrain.cli import main

# The saved run: LoRA adapters on tiny, trained on notes.txt with seed 3, 4 steps.
SAVED = ["--lora", "4", "--data", "notes.txt", "--seed", "3"]
REFUSAL_END = "give the same to continue it, or leave out --resume to start a new run"


def _tuitrain(*args: str) -> int:
    """`tuitrain run tiny --headless ...` in this process, from the working folder."""
    return main(["run", "tiny", "--headless", "--precision", "fp32", "--seq-len", "16",
                 "--batch-size", "2", *args])


def _notes() -> str:
    words = "alpha beta gamma delta notes river stone cloud light paper green".split()
    pick = random.Random(0).choice
    return "\n\n".join(" ".join(pick(words) for _ in range(200)) for _ in range(40))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A folder holding notes.txt and ck/, the checkpoint after step 4 of the saved run."""
    folder = tmp_path_factory.mktemp("resume")
    (folder / "notes.txt").write_text(_notes())
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        assert _tuitrain(*SAVED, "--steps", "4", "--checkpoint-dir", "ck") == 0
    assert (folder / "ck" / "step-000004" / "manifest.json").exists()
    return folder


@pytest.fixture
def there(saved: Path, monkeypatch) -> Path:
    monkeypatch.chdir(saved)
    return saved


def _refused(capsys) -> list[str]:
    """What a refused command said: its stderr lines, once nothing was started (stdout
    says where a started run's worker logs)."""
    said = capsys.readouterr()
    assert said.out == ""
    return said.err.splitlines()


def test_other_data_and_another_seed_are_refused_in_one_line_naming_both(there, capsys):
    assert _tuitrain("--lora", "4", "--seed", "1", "--steps", "8", "--resume", "ck") == 2
    assert _refused(capsys) == [
        "tuitrain: error: ck/step-000004 was saved by a run with --data notes.txt --seed 3; "
        f"this run has --data (built-in corpus) --seed 1: {REFUSAL_END}"]


@pytest.mark.parametrize(("flags", "then", "now"), [
    (["--batch-size", "4"], "--batch-size 2 --grad-accum 1", "--batch-size 4 --grad-accum 1"),
    (["--seq-len", "32"], "--seq-len 16", "--seq-len 32"),
    (["--eval-fraction", "0.25"], "--eval-fraction (none)", "--eval-fraction 0.25"),
    (["--lora-alpha", "16"], "--lora-alpha 8", "--lora-alpha 16"),
])
def test_what_decides_the_data_s_order_and_the_adapters_meaning_is_refused(
        there, capsys, flags, then, now):
    assert _tuitrain(*SAVED, "--steps", "8", "--resume", "ck", *flags) == 2
    assert _refused(capsys) == [
        f"tuitrain: error: ck/step-000004 was saved by a run with {then}; this run has "
        f"{now}: {REFUSAL_END}"]


def test_the_same_text_continues_from_wherever_it_lies(there, capsys, monkeypatch):
    """The text is what the run read, not where it lay: the same words in another folder
    (the project moved, or a copy on another machine) continue the run. Other words are
    refused once read (test_a_data_file_changed_since_the_checkpoint_is_refused_once_read)."""
    elsewhere = there / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    (elsewhere / "notes.txt").write_text(_notes())
    monkeypatch.chdir(elsewhere)
    assert _tuitrain("--lora", "4", "--data", "notes.txt", "--seed", "3", "--steps", "5",
                     "--resume", "../ck") == 0, capsys.readouterr().err
    assert _tuitrain("--lora", "4", "--data", "../notes.txt", "--seed", "3", "--steps", "5",
                     "--resume", "../ck") == 0, capsys.readouterr().err


def test_a_preset_s_settings_are_checked_as_flags_are(there, capsys):
    (there / "other-seed.yaml").write_text(
        "version: 1\nmodel: tiny\ntraining:\n  seed: 5\n  seq_len: 16\n  lora:\n    rank: 4\n"
        "data:\n  path: notes.txt\n")
    status = main(["run", "--preset", "other-seed.yaml", "--headless", "--steps", "8",
                   "--resume", "ck"])
    assert status == 2
    assert _refused(capsys) == [
        "tuitrain: error: ck/step-000004 was saved by a run with --seed 3; this run has "
        f"--seed 5: {REFUSAL_END}"]


def test_a_tune_is_checked_as_a_run_is(there, capsys):
    status = main(["tune", "tiny", "--precision", "fp32", "--seq-len", "16", "--lora", "4",
                   "--seed", "3", "--steps", "20", "--resume", "ck"])
    assert status == 2
    assert _refused(capsys) == [
        "tuitrain: error: ck/step-000004 was saved by a run with --data notes.txt; this run "
        f"has --data (built-in corpus): {REFUSAL_END}"]


def test_another_split_rate_and_length_continue_the_run_and_the_rate_s_change_is_said(
        there, capsys):
    """The global batch of 2 as two micro-batches of 1, a lower rate, two steps more: the
    run goes on from step 5, and says once that its rate is its own."""
    metrics = there / "continued.jsonl"
    status = _tuitrain(*SAVED, "--batch-size", "1", "--grad-accum", "2", "--lr", "0.0001",
                       "--steps", "6", "--policy", "cpu", "--resume", "ck",
                       "--metrics", str(metrics))
    said = capsys.readouterr()
    assert status == 0, said.err
    assert said.err.splitlines() == [
        "warning: ck/step-000004 was saved by a run with --lr 0.0003; this run has --lr "
        "0.0001: the learning rate follows this run's from here"]
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == [5, 6]


@pytest.fixture
def edited_notes(there: Path) -> Iterator[Path]:
    """notes.txt with a line more, as it is when the test ends."""
    notes = there / "notes.txt"
    before = notes.read_text()
    notes.write_text(before + "\n\nmore words about the river and the stone\n")
    yield notes
    notes.write_text(before)


def test_a_data_file_changed_since_the_checkpoint_is_refused_once_read(edited_notes, capsys):
    assert _tuitrain(*SAVED, "--steps", "8", "--resume", "ck") == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("tuitrain: error: ck/step-000004 was saved by a run that read "
                               "--data notes.txt as ")
    assert lines[0].endswith(" tokens with another tokenizer: the text changed since; give "
                             "it as it was to continue the run, or leave out --resume to "
                             "start a new one")


# --- tuning a resumed run ----------------------------------------------------------------


def test_a_tune_of_a_resumed_run_without_its_length_is_refused_saying_what_to_give(
        there, capsys):
    """Sized for the search alone, the run would end at a step of the tune's choosing,
    before the checkpoint's or soon after it, and its checkpoints pass for the saved run's."""
    status = main(["tune", "tiny", "--precision", "fp32", "--seq-len", "16", *SAVED,
                   "--resume", "ck"])
    assert status == 2
    assert _refused(capsys) == [
        "tuitrain: error: --resume: a tune of a resumed run needs the run's length: give "
        "--steps N, at least 9 (ck/step-000004 is after step 4, and a trial takes 5 steps; "
        "the run that saved it had --steps 4)"]


def test_a_tune_of_a_resumed_run_needs_room_for_a_trial_after_the_checkpoint(there, capsys):
    status = main(["tune", "tiny", "--precision", "fp32", "--seq-len", "16", *SAVED,
                   "--resume", "ck", "--steps", "6"])
    assert status == 2
    assert _refused(capsys) == [
        "tuitrain: error: --steps: ck/step-000004 is after step 4, and a tune measures a "
        "setting in 5 steps at the least (--trial-steps 3, the step under way when it is "
        "applied and the one after): give at least 9 (got 6)"]


def test_a_tune_of_a_resumed_run_searches_from_the_checkpoint_to_its_last_step(there, capsys):
    metrics = there / "tuned.jsonl"
    status = main(["tune", "tiny", "--precision", "fp32", "--seq-len", "16", *SAVED,
                   "--resume", "ck", "--steps", "12", "--metrics", str(metrics)])
    said = capsys.readouterr()
    assert status == 0, said.err
    assert "within steps 5 to 12" in said.out
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if "step" in r and "loss" in r] == list(range(5, 13))
    assert any(r["trial"]["status"] == "measured" for r in records if "trial" in r)


def test_a_checkpoint_whose_state_was_changed_since_is_refused_in_one_line(tmp_path):
    """What state.json says decides whether a run may resume: one that no longer matches
    the manifest written with it is damaged, and refused as such before anything starts."""
    import hashlib
    import json

    from tuitrain.checkpoint_folder import CheckpointError, read_state

    folder = tmp_path / "ck" / "step-000002"
    folder.mkdir(parents=True)
    state = folder / "state.json"
    state.write_text('{"format": 1, "step": 2, "settings": {}}')
    (folder / "manifest.json").write_text(json.dumps({"format": 1, "files": {"state.json": {
        "bytes": state.stat().st_size,
        "sha256": hashlib.sha256(state.read_bytes()).hexdigest()}}}))
    assert read_state(folder)["step"] == 2
    state.write_text('{"format": 1, "step": "two", "settings": {"training": "x"}}')
    with pytest.raises(CheckpointError, match=r"state.json is corrupt \(size or checksum"):
        read_state(folder)
