"""Runs (engine.placement.rules.joins_run): a module that needs only what the point before it,
of its phase, brought in joins that point. The trace has one forward and one backward point
per run (a layer's modules share a chunk), the planner's replay records the same points, and
once a step has seen the backward runs the next ones wrap no joining module's output (no
identity node, no hook to run in backward), marking its parameters in use at the run's
point instead. Training is the plain reference's either way."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from engine import Engine, EngineConfig
from engine.models.zoo import build_model
from engine.placement import rules
from engine.planning.planner import plan
from engine.planning.replay import StepReplay
from engine.step import hooks
from engine.step import runner as runner_module
from engine.step.runner import StepInterrupted
from tests.engine.conftest import build, make_batches
from tests.engine.references import VOCAB, max_relative_difference, reference_run
from tests.engine.test_adamw_corners import Output

BATCHES = make_batches(6)


def _wraps(monkeypatch) -> list[int]:
    """How many module outputs each step wraps from now on, appended per call."""
    calls = [0]
    apply = hooks._PreBackward.apply

    def counted(*args):
        calls[0] += 1
        return apply(*args)

    monkeypatch.setattr(hooks._PreBackward, "apply", counted)
    return calls


def _points(trace, phase: str) -> list:
    return [p for p in trace.points if p.phase == phase]


@pytest.mark.parametrize("spare", [False, True], ids=["copies-in-line", "copy-thread"])
@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_a_layer_has_one_point_each_way_and_settled_steps_wrap_only_the_runs(
        policy, spare, monkeypatch):
    # Without a core for the copy thread (torch on every core) a fetch ahead is a copy in
    # line anyway: joining modules go unwrapped. With one, they keep trying the fetches
    # ahead their own points did (rules.runs_poll).
    monkeypatch.setattr(runner_module, "spare_core", lambda: spare)
    model = build("opt", layers=3)
    ref_losses, ref_state = reference_run(model, BATCHES)
    eng = Engine(model, EngineConfig(policy=policy, precision="fp32",
                                     device_budget="3MiB" if policy == "auto" else "64MiB",
                                     simulate=True))
    calls = _wraps(monkeypatch)
    per_step, losses = [], []
    for batch in BATCHES:
        before = calls[0]
        losses.append(eng.step(batch).loss)
        per_step.append(calls[0] - before)
    modules = len(eng.runner.module_slots)  # each runs once a forward
    forward, backward = _points(eng.trace, "forward"), _points(eng.trace, "backward")
    # A point per run, not per module: a layer's modules share a chunk.
    assert len(forward) < modules // 2 and len(backward) < modules // 2
    for earlier, later in zip(forward, forward[1:], strict=False):
        assert not rules.joins_run(later.chunks, (), earlier.chunks, ())
    for earlier, later in zip(backward, backward[1:], strict=False):
        assert not rules.joins_run(later.chunks, later.grad_chunks, earlier.chunks,
                                   earlier.grad_chunks)
    # The traced step wraps every module's output; once the runs are seen, only the
    # modules whose backward opens a run are wrapped, where copies are in line.
    assert per_step[0] == modules
    settled = modules if spare else len(backward)
    assert per_step[2:] == [settled] * (len(BATCHES) - 2)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert max_relative_difference(eng.model_state_dict(), ref_state) <= 1e-5


# auto at 15 MiB (the minimum working set is 14.8) evicts and fetches again in the step.
@pytest.mark.parametrize(("policy", "budget"), [("cpu", "6GiB"), ("auto", "15MiB")])
def test_the_planner_records_the_engines_points(policy, budget, monkeypatch):
    """The warm-up step the planner replays records the points the engine's traced step
    does, runs included: the same chunks at the same positions; and its forecast of the
    settled step is the engine's, to the byte."""
    recorded = []
    trace_of = StepReplay.trace_of

    def keep(self):
        trace = trace_of(self)
        recorded.append(trace)
        return trace

    monkeypatch.setattr(StepReplay, "trace_of", keep)
    shape = {"batch_size": 2, "seq_len": 64}
    report = plan("tiny", device_mem=budget, host_mem="64GiB", precision="fp32",
                  simulated=True, **shape)
    eng = Engine(build_model("tiny"), EngineConfig(policy=policy, precision="fp32",
                                                   device_budget=budget, simulate=True))
    ids = torch.randint(0, eng.model.config.vocab_size, (2, 64),
                        generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        stats = eng.step({"input_ids": ids, "labels": ids})
    engine_points = [(p.chunks, p.phase, p.grad_chunks) for p in eng.trace.points]
    points, modules = len(engine_points), len(eng.runner.module_slots)
    assert points < modules
    assert any([(p.chunks, p.phase, p.grad_chunks) for p in trace.points] == engine_points
               for trace in recorded)
    row = report.policies[policy]
    assert row.copied == stats.bytes_h2d + stats.bytes_d2h
    assert row.device_peak == stats.memory.device_peak


class Borrower(nn.Module):
    """Reads `far`'s parameters itself (far's forward never runs): in a model that needs its
    labels, found only on the traced step (engine.step.borrowing)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(32))
        self.far = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x * self.scale, self.far.weight, self.far.bias)


class Between(nn.Module):
    """An embedding, `body` (its modules named as given), and an LM head: a model whose
    forward needs its labels."""

    def __init__(self, width: int, **body: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, width)
        self.body = nn.Sequential(OrderedDict(body))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Output:
        logits = self.head(self.body(self.embed(input_ids)))
        return Output(nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                  labels.reshape(-1)))


def borrows_across_chunks() -> Between:
    """With chunks of 1100 elements, `pre` and `borrower.scale` share one, `far` is in the
    next: `borrower` joins `pre`'s forward run on the traced step, and once `far.weight`
    is its own it needs a chunk that run never brought in."""
    torch.manual_seed(0)
    return Between(32, pre=nn.Linear(32, 32), act=nn.ReLU(), borrower=Borrower())


@pytest.mark.parametrize("interrupted", [False, True], ids=["", "retrace-interrupted"])
@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_a_parameter_found_borrowed_while_tracing_traces_the_next_step_again(
        policy, interrupted):
    """A module found reading another's parameter on the traced step fetches it from then
    on, which changes the runs: the next step traces again (and the one after, if that one
    was interrupted), and every step runs the points of the trace it ends with."""
    model = borrows_across_chunks()
    batches = make_batches(5)
    ref_losses, ref_state = reference_run(model, batches)
    eng = Engine(model, EngineConfig(policy=policy, precision="fp32", chunk_size=1100,
                                     device_budget="64MiB" if policy == "cpu" else "200KiB",
                                     simulate=True))
    losses, traces = [], []
    for i, batch in enumerate(batches):
        if interrupted and i == 1:
            stop = eng.model.head.register_forward_pre_hook(lambda *_: eng.interrupt())
            with pytest.raises(StepInterrupted):
                eng.step(batch)
            stop.remove()
        losses.append(eng.step(batch).loss)
        traces.append(eng.trace)
        ran, points = eng.runner.pos + 1, len(eng.trace.points)
        assert ran == points
    assert traces[1] is not traces[0]
    assert all(t is traces[1] for t in traces[2:])
    forward = _points(traces[1], "forward")
    for earlier, later in zip(forward, forward[1:], strict=False):
        assert not rules.joins_run(later.chunks, (), earlier.chunks, ())
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert max_relative_difference(eng.model_state_dict(), ref_state) <= 1e-5


class Widen(nn.Module):
    """A large temporary in forward, little saved for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.s).unsqueeze(-1).expand(*x.shape, 512).contiguous().sum(-1) / 512


def straddles() -> Between:
    """With chunks of 4096 elements, `m1.weight` fills one and `m1.bias` opens the next,
    which `m2` shares: m1 needs two chunks, m2 one of them."""
    torch.manual_seed(0)
    return Between(64, m1=nn.Linear(64, 64), m2=Widen())


def test_a_module_that_needs_fewer_chunks_than_the_run_has_a_point_of_its_own():
    """cpu lets a chunk go at the next point that does not need it: m2, needing one of
    m1's two chunks, is a point of its own, so m1.weight's chunk is not held through m2's
    large temporary (a run would keep it to its end, and the working set with it)."""
    eng = Engine(straddles(), EngineConfig(policy="cpu", precision="fp32", chunk_size=4096,
                                           device_budget="64MiB", simulate=True))
    for batch in make_batches(3):
        eng.step(batch)
    m1, m2 = (tuple(c.index for c in eng.runner.module_chunks[key])
              for key, name in eng.runner.module_names.items() if name in ("body.m1", "body.m2"))
    assert len(m1) == 2 and m2 == m1[1:]
    forward = [p.chunks for p in _points(eng.trace, "forward")]
    assert forward[forward.index(m1) + 1] == m2
    points = _points(eng.trace, "forward")
    at_m2 = points[forward.index(m2)]
    weight = eng.chunks[m1[0]].nbytes
    # m2's interval holds its own chunk beside its temporary, not m1.weight's.
    assert at_m2.working_set - at_m2.non_model_peak < weight


class Spread(nn.Module):
    """No parameters; in a step where `wide`, a temporary the traced step never had."""

    wide = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.wide:
            return x
        return x.unsqueeze(-1).expand(*x.shape, 24).contiguous().sum(-1) / 24


@pytest.mark.parametrize("spare", [False, True], ids=["copies-in-line", "copy-thread"])
def test_a_run_member_whose_chunk_was_evicted_inside_the_run_fetches_it_again(
        spare, monkeypatch):
    """Between `a` and `b`, which share a chunk (a run), a temporary the trace did not
    forecast takes every idle chunk's room, the run's included: `b` joins the run and
    fetches it again. Training is the reference's."""
    monkeypatch.setattr(runner_module, "spare_core", lambda: spare)
    torch.manual_seed(0)
    model = Between(64, a=nn.Linear(64, 64), spread=Spread(), b=nn.Linear(64, 64))
    batches = make_batches(4)
    ref_losses, ref_state = reference_run(model, batches)
    eng = Engine(model, EngineConfig(policy="auto", precision="fp32", chunk_size=8320,
                                     device_budget="300KiB", simulate=True))
    spread = eng.model.body.spread
    chunks = {eng.runner.module_names[k]: v for k, v in eng.runner.module_chunks.items()}
    assert chunks["body.a"] == chunks["body.b"]
    run = chunks["body.a"][0]
    fetched_again = []
    join = runner_module.StepRunner._join

    def watched(self, needed):
        if run in needed and not run.on_device:
            fetched_again.append(self.pos)
        join(self, needed)

    monkeypatch.setattr(runner_module.StepRunner, "_join", watched)
    losses = []
    for i, batch in enumerate(batches):
        spread.wide = i == 1  # the second step counts every byte (engine.step.counting)
        losses.append(eng.step(batch).loss)
        assert bool(fetched_again) == (i >= 1)
    assert len(fetched_again) == 1
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert max_relative_difference(eng.model_state_dict(), ref_state) <= 1e-5
