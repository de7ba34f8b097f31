"""A first step that overruns its budget says by how much, truthfully: the budget it names
is below the figure it names, and the batch reads as a shape, not a Python tuple."""

from __future__ import annotations

import re

import pytest
import torch

from engine import Engine, EngineConfig
from engine.config import parse_size
from engine.placement.rules import BudgetTooSmall
from tests.engine.conftest import VOCAB, build


def test_cuda_whose_model_data_fits_but_not_its_activations_names_what_overran() -> None:
    ids = torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(0))
    probe = Engine(build("opt"), EngineConfig(policy="cuda", device_budget="1GiB", simulate=True))
    model_data = sum(probe.manager.resident_cost(c) for c in probe.chunks)
    probe.step({"input_ids": ids, "labels": ids})
    trace = probe.trace
    probe.close()
    # Above the working set and the model data alike, below the two together: the check
    # before the first step (no activations known yet) lets it through, the step overruns.
    budget = max(model_data, trace.working_set) + 64 * 1024
    assert budget < model_data + trace.non_model_peak
    eng = Engine(build("opt"), EngineConfig(policy="cuda", device_budget=budget, simulate=True))
    with pytest.raises(BudgetTooSmall) as err:
        eng.step({"input_ids": ids, "labels": ids})
    eng.close()
    message = str(err.value)
    sizes = re.findall(r"\d+\.\d+ [KMG]iB", message)
    assert len(sizes) == 2, message
    named_budget, needed = (parse_size(s.replace(" ", "")) for s in sizes)
    assert named_budget < needed, message
    assert "policy cuda" in message and "4x64" in message and "(4, 64)" not in message
