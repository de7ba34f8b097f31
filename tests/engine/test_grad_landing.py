"""Where fp32 gradients land on the host: a buffer per chunk that exists from the landing of
its gradients to their update (engine.placement.rules.grads_land_per_step), so that at the
start of backward, where the activations peak, the host holds none of them, as plain
PyTorch holds no gradient after `zero_grad`. With a disk tier the host budget's placement
keeps them (its parts move as a whole); the math is the same either way."""

from __future__ import annotations

import copy

import pytest

from engine import Engine, EngineConfig
from engine.planning.planner import plan
from tests.engine.conftest import (
    build,
    make_batches,
    max_relative_difference,
    reference_run,
    whole_model_relative_difference,
)

EXACT = 1e-5


def landing_places(eng: Engine) -> list[bool]:
    return [c.host_grad is not None for c in eng.chunks]


@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_gradients_land_in_buffers_that_last_from_their_landing_to_the_update(policy,
                                                                             grad_accum):
    model = build("opt", layers=3)
    batches = make_batches(3, batch_size=2 * grad_accum)
    eng = Engine(copy.deepcopy(model), EngineConfig(
        policy=policy, device_budget="3MiB" if policy == "auto" else "64MiB",
        precision="fp32", grad_accum=grad_accum))
    try:
        assert not any(landing_places(eng))  # none before the first gradient lands
        losses = [eng.step(batches[0]).loss]
        between = eng.manager.host_bytes
        on_host = [c for c in eng.chunks if not c.resident]
        assert on_host
        # What the host holds at the first module of backward (the head's, before any
        # gradient) and at the last (all but the embedding's landed).
        seen: list[tuple[int, list[bool]]] = []

        def look(*_args) -> None:
            seen.append((eng.manager.host_bytes, landing_places(eng)))

        head = eng.model.lm_head.register_full_backward_pre_hook(look)
        first = eng.model.model.decoder.layers[0].register_full_backward_pre_hook(look)
        losses.append(eng.step(batches[1]).loss)
        head.remove()
        first.remove()
        (start, none_yet), (late, landed), *later = seen
        assert start == between and not any(none_yet)
        assert late > between and any(landed)
        assert late - between == 4 * sum(c.numel for c, has in zip(eng.chunks, landed,
                                                                    strict=True) if has)
        if grad_accum > 1:  # the second micro-batch starts backward with every one of them
            (again, all_of_them), _ = later
            assert all_of_them == [not c.resident for c in eng.chunks]
            assert again - between == 4 * sum(c.numel for c in on_host)
        # Gone with the update: the host holds between steps what it held before.
        assert not any(landing_places(eng)) and eng.manager.host_bytes == between
        losses.append(eng.step(batches[2]).loss)
        ref_losses, ref_weights = reference_run(model, batches)
        assert losses == pytest.approx(ref_losses, rel=EXACT)
        # Micro-batches' gradients summed round differently from one backward over the
        # whole batch (tests/engine/test_invariant.py): then the weights as one vector.
        differ = max_relative_difference if grad_accum == 1 else whole_model_relative_difference
        assert differ(eng.model_state_dict(), ref_weights) < EXACT
    finally:
        eng.close()


def test_with_accumulation_the_plan_holds_every_landing_place_beside_a_micro_batch():
    """The engine frees them at the update, so a step's second micro-batch runs with all
    that its first made: the plan's host peak counts them beside its activations."""
    one, two = (plan("tiny", device_mem="64MiB", host_mem="64GiB", precision="fp32",
                     batch_size=2, seq_len=16, simulated=True, grad_accum=n) for n in (1, 2))
    for name in ("cpu", "auto"):
        landed = one.policies[name].landed_grads
        assert landed == two.policies[name].landed_grads > 0
        # One micro-batch: only those landed by backward's peak; two: all of them.
        grown = two.policies[name].host_peak - one.policies[name].host_peak
        assert 0 < grown <= landed


def test_with_a_disk_tier_the_landing_places_stay_with_the_chunks(tmp_path):
    """The host budget places each chunk's parts whole, gradients' landing place included:
    once made, a chunk kept on the host keeps it between steps."""
    model = build("opt", layers=3)
    batches = make_batches(3)
    whole = Engine(copy.deepcopy(model), EngineConfig(policy="cpu", device_budget="64MiB",
                                                      precision="fp32"))
    state = whole.manager.host_bytes + 4 * sum(c.numel for c in whole.chunks)
    whole.close()
    eng = Engine(copy.deepcopy(model), EngineConfig(
        policy="cpu", device_budget="64MiB", precision="fp32", host_budget=int(0.8 * state),
        disk_dir=tmp_path))
    try:
        assert eng.manager.spill is not None
        losses = [eng.step(batch).loss for batch in batches]
        on_host = [c for c in eng.chunks if not c.payload_on_disk]
        assert on_host and all(c.host_grad is not None for c in on_host)
        assert eng.manager.host_bytes + eng.manager.io_buffer_bytes <= eng.config.host_budget
        ref_losses, ref_weights = reference_run(model, batches)
        assert losses == pytest.approx(ref_losses, rel=EXACT)
        assert max_relative_difference(eng.model_state_dict(), ref_weights) < EXACT
    finally:
        eng.close()
