"""Counting every op's bytes only in the steps that need it (engine.step.counting): a steady
step like the last counted one runs no op through the counter and reports that one's peaks,
which are its true ones, once two counted steps in a row have placed their chunks alike; a
step whose placement changed reports an upper bound, and the next ones count again."""

from __future__ import annotations

import pytest
import torch

from benchmarks.true_peak import measured_step
from engine import Engine, EngineConfig, TensorState
from engine.step import counting
from engine.step.engine import StepInterrupted
from engine.step.non_model import NonModelCounter
from tests.engine.conftest import build, make_batches

BATCHES = make_batches(8)


class _Entered(NonModelCounter):
    """The engine's counter, remembering how often a step entered it."""

    entered = 0

    def __enter__(self):
        type(self).entered += 1
        return super().__enter__()


def engine(policy: str, budget: str = "64MiB") -> Engine:
    eng = Engine(build("opt", layers=3), EngineConfig(policy=policy, device_budget=budget,
                                                     simulate=True))
    eng.runner.counter.__class__ = _Entered
    _Entered.entered = 0
    return eng


def entered_during(step) -> int:
    before = _Entered.entered
    result = step()
    return _Entered.entered - before, result


@pytest.mark.parametrize("policy", ["cpu", "auto", "cuda"])
def test_a_steady_step_like_the_counted_one_counts_nothing_and_reports_its_true_peak(policy):
    eng = engine(policy, "3MiB" if policy == "auto" else "64MiB")
    traced, _ = entered_during(lambda: eng.step(BATCHES[0]))
    counted, first = entered_during(lambda: eng.step(BATCHES[1]))
    settled, second = entered_during(lambda: eng.step(BATCHES[2]))
    assert (traced, counted, settled) == (1, 1, 1)
    assert second.memory.device_peak == first.memory.device_peak  # placed alike
    for batch in BATCHES[3:6]:
        entered, (stats, true_peak) = entered_during(lambda b=batch: measured_step(eng, b))
        assert entered == 0
        assert stats.memory.device_peak == second.memory.device_peak
        assert stats.memory.device_peak == pytest.approx(true_peak, rel=0.05)
        assert stats.memory.device_non_model_peak == second.memory.device_non_model_peak
        assert [(p.model_bytes, p.non_model_bytes) for p in stats.timeline] == [
            (p.model_bytes, p.non_model_bytes) for p in second.timeline]


def test_a_step_placed_otherwise_reports_an_upper_bound_and_the_next_one_counts(monkeypatch):
    eng = engine("auto")
    for batch in BATCHES[:3]:  # traced, then counted until settled
        eng.step(batch)
    # The counter is not told of the change (a settings change is: see the next test), so
    # the fingerprint alone must catch it.
    monkeypatch.setattr(eng.runner.counts, "forget", lambda: None)
    # Less room: idle chunks leave at other points, so the step's fingerprint differs.
    eng.set_budget(int(1.2 * eng.min_working_set()))
    entered, (stats, true_peak) = entered_during(lambda: measured_step(eng, BATCHES[3]))
    assert entered == 0
    assert stats.memory.device_peak >= true_peak
    # Interval by interval: the most chunk bytes held beside the traced non-model peak,
    # whose highest is the step's.
    assert max(p.model_bytes + p.non_model_bytes for p in stats.timeline) == (
        stats.memory.device_peak)
    assert max(p.non_model_bytes for p in stats.timeline) == (
        stats.memory.device_non_model_peak) == eng.trace.non_model_peak
    entered, (stats, true_peak) = entered_during(lambda: measured_step(eng, BATCHES[4]))
    assert entered == 1
    assert stats.memory.device_peak == pytest.approx(true_peak, rel=0.05)


def test_the_step_after_a_settings_change_counts_and_reports_its_true_peak():
    eng = engine("auto")
    for batch in BATCHES[:3]:  # traced, then counted until settled
        eng.step(batch)
    entered, _ = entered_during(lambda: eng.step(BATCHES[3]))
    assert entered == 0  # steady: not counted
    eng.set_budget(int(1.2 * eng.min_working_set()))
    entered, (stats, true_peak) = entered_during(lambda: measured_step(eng, BATCHES[4]))
    assert entered == 1
    assert stats.memory.device_peak == pytest.approx(true_peak, rel=0.05)
    assert stats.memory.device_peak <= stats.device_budget


def test_every_so_many_steps_one_counts_again(monkeypatch):
    monkeypatch.setattr(counting, "RECOUNT_EVERY", 3)
    eng = engine("cpu")
    counted = [entered_during(lambda b=b: eng.step(b))[0] for b in BATCHES]
    # traced, counted twice (settled: placed alike), then one in three
    assert counted == [1, 1, 1, 0, 0, 1, 0, 0]


def test_each_micro_batch_keeps_its_own_counted_figures():
    eng = Engine(build("opt", layers=3), EngineConfig(policy="cpu", device_budget="64MiB",
                                                      simulate=True, grad_accum=2))
    eng.runner.counter.__class__ = _Entered
    stats = [entered_during(lambda b=b: eng.step(b)) for b in BATCHES[:4]]
    # The second micro-batch of the traced step is already a steady one: it counts there,
    # and settles a step before the first one does.
    assert [n for n, _ in stats] == [2, 2, 1, 0]
    assert stats[3][1].memory.device_peak == stats[2][1].memory.device_peak


def points_during(eng: Engine, step) -> int:
    """How many module boundaries the runner recorded during `step()`."""
    seen = []
    point = eng.runner._point
    eng.runner._point = lambda *args: (seen.append(args), point(*args))[1]
    try:
        step()
    finally:
        del eng.runner._point
    return len(seen)


@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize("arch", ["opt", "llama"])  # OPT ties its head to its embedding
def test_a_quiet_step_trains_exactly_as_a_counted_one_with_its_hooks_idle(arch, grad_accum):
    """All chunks resident and nothing counted: the hooks do nothing (no boundary is
    recorded), and the losses and weights are those of an engine that counts every step.
    Accumulated, a tied weight's uses add up in the same order as in a counted step."""
    config = EngineConfig(policy="cuda", device_budget="64MiB", simulate=True,
                          grad_accum=grad_accum)
    eng, ref = Engine(build(arch, layers=3), config), Engine(build(arch, layers=3), config)
    ref.runner.counts.every_step = True
    points = [points_during(eng, lambda b=b: eng.step(b)) for b in BATCHES[:6]]
    # Traced, counted until settled (accumulated, the second micro-batch settles a step
    # before the first: test_each_micro_batch_keeps_its_own_counted_figures), then quiet.
    settling = points[0] if grad_accum == 1 else points[0] // 2
    assert points[0] > 0 and points == [points[0], points[0], settling, 0, 0, 0]
    ref_stats = [ref.step(b) for b in BATCHES[:6]]
    losses = [eng.step(b).loss for b in BATCHES[6:]]
    assert losses == [ref.step(b).loss for b in BATCHES[6:]]
    weights, ref_weights = eng.model_state_dict(), ref.model_state_dict()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    # It reports the counted step's timeline, module by module.
    quiet = eng.step(BATCHES[0])
    assert [(p.phase, p.module, p.model_bytes, p.non_model_bytes) for p in quiet.timeline] == [
        (p.phase, p.module, p.model_bytes, p.non_model_bytes) for p in ref_stats[-1].timeline]
    assert all(s.state == TensorState.HOLD for c in eng.chunks for s in c.slots)


def test_a_quiet_step_makes_no_room_for_its_gradients():
    """Every chunk is resident in a quiet step, which nothing evicts, and the counted step
    like it made the same room: its gradients are kept without a room check, where a
    counted step checks for each. The manager is quiet only inside that step."""
    eng = engine("cuda")
    made = []
    make_room = eng.manager.make_room
    eng.manager.make_room = lambda *args, **kw: (made.append(args[0]), make_room(*args, **kw))
    per_step = []
    for b in BATCHES[:5]:
        made.clear()
        eng.step(b)
        per_step.append(len(made))
        assert eng.manager.quiet is False
    # Traced and counted until settled (three steps), then quiet.
    assert all(n > 0 for n in per_step[:3]) and per_step[3:] == [0, 0]


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_quiet_step_stops_at_an_interrupt_and_changes_nothing(where):
    config = EngineConfig(policy="cuda", device_budget="64MiB", simulate=True)
    eng, ref = Engine(build("opt", layers=3), config), Engine(build("opt", layers=3), config)
    for b in BATCHES[:3]:
        assert eng.step(b).loss == ref.step(b).loss
    assert points_during(eng, lambda: eng.step(BATCHES[3])) == 0  # quiet, as the next is
    ref.step(BATCHES[3])
    # Asked for in the middle of the forward, or when the first gradient has arrived.
    if where == "forward":
        handle = eng.model.model.decoder.layers[1].register_forward_hook(
            lambda *_: eng.interrupt())
    else:
        handle = eng.model.model.decoder.layers[-1].fc2.weight.register_post_accumulate_grad_hook(
            lambda _: eng.interrupt())
    before = eng.manager.device_bytes
    with pytest.raises(StepInterrupted, match=f"interrupted in the {where}"):
        eng.step(BATCHES[4])
    handle.remove()
    assert eng.step_count == 4 and eng.manager.device_bytes == before
    assert not any(c.slot_grads or c.holds_grads for c in eng.chunks)
    for b in BATCHES[4:]:
        assert eng.step(b).loss == ref.step(b).loss


def test_a_quiet_step_of_a_model_with_a_tied_head_reports_its_true_peak():
    """The head's gradient (vocabulary x hidden) goes to its chunk as soon as it is made,
    in a quiet step as in a counted one, so the counted peak the quiet step reports is its
    own (autograd alone would keep it until the embedding's arrived: 17% more here)."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(
        vocab_size=8000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        ffn_dim=256, max_position_embeddings=128, word_embed_proj_dim=64, dropout=0.0,
        attention_dropout=0.0))
    eng = Engine(model, EngineConfig(policy="cuda", device_budget="256MiB", simulate=True))
    batches = make_batches(6, vocab=8000)
    for batch in batches[:3]:  # traced, counted, settled
        eng.step(batch)
    for batch in batches[3:]:
        assert points_during(eng, lambda b=batch: measured_step(eng, b)) == 0  # quiet
    stats, true_peak = measured_step(eng, batches[0])
    assert stats.memory.device_peak == pytest.approx(true_peak, rel=0.02)
