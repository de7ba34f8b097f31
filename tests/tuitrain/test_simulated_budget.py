"""The default simulated device shrinks to what this machine's memory can hold beside the
host's copies, in whole MiB; a model whose host state cannot fit at all is refused."""

from __future__ import annotations

from types import SimpleNamespace

import psutil
import pytest

from tuitrain.run_build import HOST_RESERVE, simulated_budget

GiB = 2**30
DEFAULT = 6 * GiB


def available(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=nbytes))


def test_the_default_is_kept_where_it_fits(monkeypatch):
    available(monkeypatch, 20 * GiB)
    assert simulated_budget(DEFAULT, parameters=10**6, precision="fp32") == DEFAULT


def test_the_default_shrinks_to_whole_mib_of_what_is_left(monkeypatch):
    parameters = 100 * 10**6
    available(monkeypatch, 3 * GiB + 12345)
    budget = simulated_budget(DEFAULT, parameters=parameters, precision="bf16")
    room = 3 * GiB + 12345 - (14 - 4) * parameters - HOST_RESERVE
    assert budget % 2**20 == 0 and room - 2**20 < budget <= room


def test_a_small_model_on_a_busy_machine_still_gets_a_device(monkeypatch):
    available(monkeypatch, HOST_RESERVE + 300 * 2**20)
    assert simulated_budget(DEFAULT, parameters=10**6, precision="fp32") > 200 * 2**20


def test_a_model_whose_state_cannot_fit_is_refused_with_the_numbers(monkeypatch):
    # Available is read with the fp32 model built (4 B a parameter, freed while packing).
    available(monkeypatch, 12 * GiB)
    with pytest.raises(ValueError, match=r"1\.32B parameters in bf16 need about 17\.\d GiB"
                       r" .* this machine has 16\.9 GiB available"):
        simulated_budget(DEFAULT, parameters=1_315_758_080, precision="bf16")
