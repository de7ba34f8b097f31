"""Fine-tuning as people run it: gradient accumulation that trains exactly as the whole
batch, a learning-rate schedule that a resumed run continues, and the loss on held-out
text in the metrics, the events and the summary."""

from __future__ import annotations

import io
import json
import math
import multiprocessing
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import EngineConfig
from engine.devices.device import SIMULATE_ENV
from tuitrain.cli import build_parser, main, resolve_settings
from tuitrain.events import Eval, Finished, Step
from tuitrain.headless import run_headless
from tuitrain.metrics import latest_evals, latest_run
from tuitrain.presets import PresetError, load_preset
from tuitrain.settings import Settings
from tuitrain.training_run import TrainingRun

SEQ_LEN = 16


class Sink(list):
    def put(self, event) -> None:
        self.append(event)


def tiny(tmp_path: Path, name: str, *, training: dict, data: dict | None = None,
         checkpoint: dict | None = None) -> Settings:
    """A tiny fp32 run on the built-in corpus, its metrics in tmp_path/NAME.jsonl."""
    return Settings(
        model="tiny",
        engine={"precision": "fp32", "policy": "auto", "device_budget": "64MiB"},
        training={"seq_len": SEQ_LEN, "seed": 3, "lr": 1e-3, **training},
        data=data or {},
        logging={"metrics": str(tmp_path / f"{name}.jsonl")},
        checkpoint=checkpoint or {},
    )


def train(tmp_path: Path, settings: Settings) -> Sink:
    commands, _ = multiprocessing.Pipe(duplex=False)
    sink = Sink()
    run = TrainingRun(settings=settings, log_path=str(tmp_path / "worker.log"),
                      commands=commands, outbox=sink)
    assert run.execute() == 0, [e for e in sink if not isinstance(e, Step)]
    return sink


def steps_of(sink: Sink) -> dict[int, object]:
    return {e.stats.step: e.stats for e in sink if isinstance(e, Step)}


def evals_of(sink: Sink) -> dict[int, Eval]:
    return {e.step: e for e in sink if isinstance(e, Eval)}


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def weights(folder: Path) -> torch.Tensor:
    """Every weight of a checkpoint's model folder as one vector, in name order."""
    state = load_file(folder / "model" / "model.safetensors")
    return torch.cat([state[name].flatten().double() for name in sorted(state)])


# --- gradient accumulation ---------------------------------------------------------------


MICRO_COMMON = {"steps": 4, "eval_every": 2, "eval_batches": 2}
MICRO_HELD_OUT = {"eval_fraction": 0.05}


@pytest.fixture(scope="module")
def whole_batch_of_4(tmp_path_factory) -> tuple[Sink, Path]:
    """The run every split of a batch of 4 sequences is compared with: its events and the
    folder of its checkpoints. Once per module: each split is batch_size x grad_accum = 4.
    On the simulated device, as the splits are: a module's fixture is made before the
    test's own `device_choice` asks for it."""
    folder = tmp_path_factory.mktemp("whole")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SIMULATE_ENV, "1")
        sink = train(folder, tiny(
            folder, "whole", training={**MICRO_COMMON, "batch_size": 4}, data=MICRO_HELD_OUT,
            checkpoint={"dir": str(folder / "whole")}))
    return sink, folder / "whole"


@pytest.mark.parametrize(("batch_size", "grad_accum"), [(1, 4), (2, 2)])
def test_micro_batches_train_exactly_as_the_whole_batch(tmp_path, whole_batch_of_4, batch_size,
                                                        grad_accum):
    assert batch_size * grad_accum == 4
    whole, whole_folder = whole_batch_of_4
    split = train(tmp_path, tiny(
        tmp_path, "split",
        training={**MICRO_COMMON, "batch_size": batch_size, "grad_accum": grad_accum},
        data=MICRO_HELD_OUT, checkpoint={"dir": str(tmp_path / "split")}))

    expected, got = steps_of(whole), steps_of(split)
    assert sorted(got) == [1, 2, 3, 4]
    for step, stats in got.items():
        assert relative(stats.loss, expected[step].loss) <= 1e-5, step
        assert stats.micro_batches == grad_accum and len(stats.micro_losses) == grad_accum
        assert stats.tokens == expected[step].tokens == batch_size * grad_accum * SEQ_LEN
    after = weights(tmp_path / "split" / "step-000004")
    want = weights(whole_folder / "step-000004")
    assert ((after - want).norm() / want.norm()).item() <= 1e-5
    # The held-out sequences do not depend on how a step's batch is split.
    for step, measured in evals_of(split).items():
        assert measured.tokens == evals_of(whole)[step].tokens
        assert relative(measured.loss, evals_of(whole)[step].loss) <= 1e-5

    records = latest_run(tmp_path / "split.jsonl")
    assert [r["micro_batches"] for r in records] == [grad_accum] * 4
    for record in records:
        assert record["loss"] == pytest.approx(sum(record["micro_losses"]) / grad_accum)
    summary = next(e.summary for e in split if isinstance(e, Finished))
    assert summary["tokens"] == 4 * batch_size * grad_accum * SEQ_LEN  # every micro-batch


# --- the learning-rate schedule ------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_a_resumed_run_continues_the_schedule_exactly(tmp_path, schedule):
    training = {"steps": 8, "batch_size": 2, "lr_schedule": schedule, "warmup_steps": 3,
                "eval_every": 2, "eval_batches": 1}
    held_out = {"eval_fraction": 0.05}
    straight = train(tmp_path, tiny(tmp_path, "straight", training=training, data=held_out,
                                    checkpoint={"dir": str(tmp_path / "ck"), "every": 4}))
    stats = steps_of(straight)
    rates = [stats[step].lr for step in range(1, 9)]
    config = EngineConfig(lr=1e-3, lr_schedule=schedule, warmup_steps=3, total_steps=8)
    assert rates == [config.lr_at(step) for step in range(1, 9)]
    assert rates[:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])  # the warm-up
    assert all(a > b for a, b in zip(rates[2:], rates[3:], strict=False))  # then the decay
    assert [r["lr"] for r in latest_run(tmp_path / "straight.jsonl")] == rates

    resumed = train(tmp_path, tiny(
        tmp_path, "resumed", training=training, data=held_out,
        checkpoint={"resume": str(tmp_path / "ck" / "step-000004")}))
    again = steps_of(resumed)
    assert sorted(again) == [5, 6, 7, 8]
    for step, later in again.items():
        assert later.lr == stats[step].lr, step
        assert later.loss == stats[step].loss, step
    assert {s: e.loss for s, e in evals_of(resumed).items()} == {
        s: e.loss for s, e in evals_of(straight).items() if s > 4}


# --- evaluation ------------------------------------------------------------------------------


def test_evaluation_reaches_the_metrics_file_the_events_and_the_summary(tmp_path):
    settings = tiny(tmp_path, "run", training={"steps": 5, "batch_size": 2, "eval_every": 2,
                                               "eval_batches": 3},
                    data={"eval_fraction": 0.05})
    sink = train(tmp_path, settings)

    evals = evals_of(sink)
    assert sorted(evals) == [2, 4, 5]  # every 2 steps, and after the last
    for measured in evals.values():
        assert measured.perplexity == pytest.approx(math.exp(measured.loss))
        assert measured.tokens == 3 * 2 * SEQ_LEN
    lines = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    kinds = [next(iter(r)) if "eval" in r or "settings" in r else r["step"] for r in lines]
    assert kinds == ["settings", 1, 2, "eval", 3, 4, "eval", 5, "eval"]
    assert lines[3] == {"eval": {"step": 2, "loss": evals[2].loss, "perplexity":
                                 evals[2].perplexity, "tokens": 96, "seconds": evals[2].seconds}}
    assert [r["step"] for r in latest_run(tmp_path / "run.jsonl")] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in latest_evals(tmp_path / "run.jsonl")] == [2, 4, 5]
    summary = next(e.summary for e in sink if isinstance(e, Finished))
    assert summary["eval_step"] == 5
    assert summary["eval_loss"] == evals[5].loss
    assert summary["eval_perplexity"] == evals[5].perplexity


def test_without_held_out_text_nothing_is_evaluated(tmp_path):
    sink = train(tmp_path, tiny(tmp_path, "run", training={"steps": 2, "batch_size": 2}))
    assert not evals_of(sink)
    assert "eval_loss" not in next(e.summary for e in sink if isinstance(e, Finished))
    assert latest_evals(tmp_path / "run.jsonl") == []


# --- flags and presets -----------------------------------------------------------------------


def settings_from(argv: list[str]) -> Settings:
    return resolve_settings(build_parser().parse_args(["run", "tiny", *argv]))


def test_the_flags_set_their_keys():
    s = settings_from(["--grad-accum", "4", "--lr-schedule", "cosine", "--warmup-steps", "5",
                       "--eval-fraction", "0.05", "--eval-every", "10", "--eval-batches", "2",
                       "--text-field", "body"])
    assert (s.training.grad_accum, s.training.lr_schedule, s.training.warmup_steps) == (
        4, "cosine", 5)
    assert (s.training.eval_every, s.training.eval_batches) == (10, 2)
    assert (s.data.eval_fraction, s.data.eval_path, s.data.text_field) == (0.05, None, "body")


def test_a_flag_naming_held_out_text_replaces_the_presets_choice(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("version: 1\ndata:\n  eval_fraction: 0.1\ntraining:\n  eval_every: 50\n")
    other = tmp_path / "held.txt"
    other.write_text("held out\n")
    s = settings_from(["--preset", str(preset), "--eval-data", str(other)])
    assert (s.data.eval_path, s.data.eval_fraction, s.training.eval_every) == (
        str(other), None, 50)
    s = settings_from(["--preset", str(preset), "--eval-fraction", "0.2"])
    assert (s.data.eval_path, s.data.eval_fraction) == (None, 0.2)


def test_a_preset_sets_the_new_keys_and_names_the_one_that_is_wrong(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text(
        "version: 1\ntraining:\n  grad_accum: 8\n  lr_schedule: linear\n  warmup_steps: 10\n"
        "  eval_every: 25\n  eval_batches: 2\ndata:\n  eval_fraction: 0.02\n"
        "  text_field: body\n")
    s = load_preset(preset)
    assert (s.training.grad_accum, s.training.lr_schedule, s.training.warmup_steps) == (
        8, "linear", 10)
    assert (s.training.eval_every, s.training.eval_batches) == (25, 2)
    assert (s.data.eval_fraction, s.data.text_field) == (0.02, "body")
    for body, expected in [
        ("data:\n  eval_fraction: 0.7\n", "data.eval_fraction: must be at most 0.5 (got 0.7)"),
        ("training:\n  eval_every: 10\n", "training.eval_every: nothing is held out"),
        ("data:\n  eval_path: a.txt\n  eval_fraction: 0.1\n",
         "data.eval_fraction: give data.eval_path or data.eval_fraction, not both"),
        ("training:\n  lr_schedule: step\n", "training.lr_schedule: must be 'constant', "),
    ]:
        preset.write_text("version: 1\n" + body)
        with pytest.raises(PresetError) as caught:
            load_preset(preset)
        assert str(caught.value).startswith(f"{preset}: {expected}")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--grad-accum", "0"], "--grad-accum: must be greater than 0 (got 0)"),
        (["--lr-schedule", "cos"],
         "--lr-schedule: must be 'constant', 'linear' or 'cosine' (got 'cos')"),
        (["--warmup-steps", "-1"], "--warmup-steps: must be at least 0 (got -1)"),
        (["--eval-fraction", "0"], "--eval-fraction: must be greater than 0.0 (got 0)"),
        (["--eval-fraction", "0.7"], "--eval-fraction: must be at most 0.5 (got 0.7)"),
        (["--eval-every", "10"], "--eval-every: nothing is held out to evaluate on"),
        (["--eval-fraction", "0.1", "--eval-every", "0"],
         "--eval-every: must be greater than 0 (got 0)"),
        (["--eval-batches", "0"], "--eval-batches: must be greater than 0 (got 0)"),
        (["--text-field", ""], "--text-field: "),
    ],
)
def test_bad_training_and_evaluation_flags_are_one_line(capsys, args, expected):
    assert main(["run", "tiny", "--headless", *args]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert len(captured.err.splitlines()) == 1
    assert captured.err.startswith(f"tuitrain: error: {expected}")


def test_held_out_text_from_two_places_at_once_is_refused(capsys, tmp_path):
    other = tmp_path / "held.txt"
    other.write_text("held out\n")
    assert main(["run", "tiny", "--headless", "--eval-data", str(other),
                 "--eval-fraction", "0.1"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("tuitrain: error: --eval-fraction: give data.eval_path or "
                           "data.eval_fraction, not both")


def test_a_missing_eval_data_path_is_one_line(capsys, tmp_path):
    missing = tmp_path / "held.txt"
    assert main(["run", "tiny", "--headless", "--eval-data", str(missing)]) == 2
    assert capsys.readouterr().err == f"tuitrain: error: eval data path not found: {missing}\n"


# --- held-out text the worker cannot use: one line, status 2 ---------------------------------
# The worker finds these (it reads the data): the command in this process, its worker a
# process of its own (tests/tuitrain/forked_workers.py).


def refused_by_the_worker(capsys, args: list[str]) -> str:
    """The one line on stderr of `tuitrain ARGS`, which exits with status 2."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tuitrain: error: ")
    return lines[0]


@pytest.mark.slow
def test_a_corpus_of_one_document_has_nothing_to_hold_out(tmp_path, capsys):
    corpus = tmp_path / "one.txt"
    corpus.write_text("a single text file is a single document\n" * 200)
    line = refused_by_the_worker(capsys, [
        "run", "tiny", "--headless", "--steps", "1", "--seq-len", "16", "--data", str(corpus),
        "--eval-fraction", "0.05"])
    assert "nothing to hold out: the data is one document (a text file is one)" in line


@pytest.mark.slow
def test_a_missing_text_field_names_the_file_and_the_fields_found(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}", "id": i}) + "\n"
                              for i in range(50)))
    line = refused_by_the_worker(capsys, [
        "run", "tiny", "--headless", "--steps", "1", "--seq-len", "16", "--data", str(corpus),
        "--text-field", "body"])
    assert line == (f'tuitrain: error: {corpus}:1: expected an object with a string "body" '
                    f"field (fields: text, id)")


@pytest.mark.slow
def test_the_headless_run_shows_the_settings_each_evaluation_and_the_held_out_loss(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    settings = tiny(tmp_path, "run", training={
        "steps": 4, "batch_size": 1, "grad_accum": 2, "lr_schedule": "cosine",
        "warmup_steps": 1, "eval_every": 2, "eval_batches": 2}, data={"eval_fraction": 0.05})
    assert run_headless(settings, out=out, err=err, log_path=str(tmp_path / "w.log")) == 0
    assert err.getvalue() == ""
    text = out.getvalue()
    assert "4 steps of 2 x 16 tokens in 2 micro-batches, lr 0.001 cosine after 1 warm-up step," \
        in text
    assert "eval     0.05 of the data's documents held out; up to 4 sequences, every 2 steps " \
        "and after the last" in text
    shown = re.findall(r"eval after step (\d): loss (\d+\.\d{4}), perplexity \d+\.\d\d on 64 "
                       r"held-out tokens", text)
    assert [step for step, _ in shown] == ["2", "4"]
    assert re.search(rf"held-out loss {shown[-1][1]}, perplexity \d+\.\d\d after step 4\n", text)
