"""Which device the engine gets, and what it reports about the GPU it shares.

On a GPU machine the CPU tests must still run on the simulated device (they compare with
CPU references at 1e-5): the suite asks for it through TUITRAIN_SIMULATE, which worker
processes inherit; only tests marked `cuda` leave the choice to make_device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from engine.devices.device import (
    SIMULATE_ENV,
    SimulatedDevice,
    make_device,
    simulation_requested,
    uses_cuda,
)
from engine.devices.nvml import NvmlProbe, others_from


@pytest.fixture
def gpu_present(monkeypatch):
    """Pretend this machine has a GPU, as far as the choice of device goes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_tests_not_marked_cuda_ask_for_the_simulated_device():
    assert os.environ[SIMULATE_ENV] == "1"


@pytest.mark.cuda
def test_tests_marked_cuda_leave_the_choice_to_make_device():
    assert SIMULATE_ENV not in os.environ


def test_worker_processes_inherit_the_request():
    done = subprocess.run(
        [sys.executable, "-c",
         "from engine.devices.device import uses_cuda, simulation_requested;"
         "print(simulation_requested(), uses_cuda())"],
        capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["True", "False"]


def test_make_device_honours_the_environment_on_a_gpu_machine(gpu_present):
    assert simulation_requested()
    assert not uses_cuda()
    assert isinstance(make_device(2**20), SimulatedDevice)


def test_without_the_request_a_gpu_machine_gets_cuda(gpu_present, monkeypatch):
    monkeypatch.delenv(SIMULATE_ENV)
    assert uses_cuda()
    monkeypatch.setenv(SIMULATE_ENV, "0")
    assert uses_cuda()


def test_the_callers_word_beats_the_environment(gpu_present, monkeypatch):
    assert uses_cuda(simulate=False)
    monkeypatch.delenv(SIMULATE_ENV)
    assert not uses_cuda(simulate=True)
    assert isinstance(make_device(2**20, simulate=True), SimulatedDevice)


def test_a_machine_without_a_gpu_simulates_whatever_the_environment_says(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(SIMULATE_ENV, "0")
    assert isinstance(make_device(2**20), SimulatedDevice)


def test_a_malformed_request_is_an_error_that_names_the_variable(monkeypatch):
    monkeypatch.setenv(SIMULATE_ENV, "yes please")
    with pytest.raises(ValueError, match=SIMULATE_ENV):
        make_device(2**20)


# --- other processes on the GPU (NVML) -------------------------------------------------------


def proc(pid: int, used: int | None) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, usedGpuMemory=used)


def test_other_processes_bytes_leave_this_process_out():
    listed = [proc(10, 500), proc(11, 300), proc(12, 200), proc(11, 300)]  # 11: compute+graphics
    assert others_from(listed, pid=10) == 500


def test_a_process_whose_use_nvml_hides_makes_the_total_unknown():
    assert others_from([proc(10, 500), proc(11, None)], pid=10) is None


def test_when_nvml_lists_host_process_ids_only_a_lone_process_is_known_to_be_us():
    assert others_from([proc(4242, 500)], pid=10) == 0
    assert others_from([proc(4242, 500), proc(4243, 100)], pid=10) is None


def test_without_nvml_other_processes_bytes_are_unknown(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert NvmlProbe("GPU-0000").other_processes_bytes() is None
    assert NvmlProbe(None).other_processes_bytes() is None


def test_an_nvml_without_a_driver_means_unknown(monkeypatch):
    class NVMLError(Exception):
        pass

    def no_driver():
        raise NVMLError("Driver Not Loaded")

    fake = SimpleNamespace(NVMLError=NVMLError, nvmlInit=no_driver)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert NvmlProbe("GPU-0000").other_processes_bytes() is None


def test_nvml_is_asked_by_the_gpus_uuid(monkeypatch):
    asked = []
    fake = SimpleNamespace(
        NVMLError=Exception, nvmlInit=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda uuid: asked.append(uuid) or "handle",
        nvmlDeviceGetComputeRunningProcesses=lambda h: [proc(os.getpid(), 9), proc(1, 700)],
        nvmlDeviceGetGraphicsRunningProcesses=lambda h: [proc(2, 50)])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert NvmlProbe("GPU-abcd").other_processes_bytes() == 750
    assert asked == ["GPU-abcd"]


def test_the_simulated_device_shares_no_gpu_and_pins_nothing():
    device = SimulatedDevice(2**20)
    assert device.other_processes_bytes() is None
    assert device.pinned_bytes() == 0
