"""The CUDA path's rules, on a GPU modelled on the CPU (no GPU needed).

`ModelledGpu` is the simulated device with a caching allocator's count instead of the
engine's own: like CudaDevice it is not `simulated`, so the engine measures the step by
reading the allocator (current bytes and the peak since a reset) and never counts op by
op. Its allocator sees every byte: the model data the engine allocates through `empty`
(storages resized in place included) and every op's outputs, counted with the same
storage-lifetime rule as the engine's counter (engine.step.non_model), plus `spike(n)`: a
kernel's workspace, allocated and freed inside one op, which no op-by-op count can see.
Host tensors the engine makes (`host_empty`: gradients landing at home) are not its.
"""

from __future__ import annotations

import copy
import datetime
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from conftest import build, make_batches
from torch.utils.weak import WeakIdKeyDictionary

from engine import Engine, EngineConfig
from engine.devices import cuda
from engine.devices.cuda import CudaDevice
from engine.devices.simulated import SimulatedDevice
from engine.distributed.collectives import Collectives, Pending
from engine.step import counting
from engine.step.non_model import LiveBytes, storage_key

MiB = 2**20


class ModelledGpu(SimulatedDevice):
    """See the module docstring. Steps run inside `with gpu.allocator():`."""

    simulated = False

    def __init__(self, budget: int, *, queued_seconds: float = 0.0) -> None:
        super().__init__(budget)
        self.peak = 0
        self.highest = 0  # the peak since the step began, which no reading resets
        self.queued_seconds = queued_seconds  # kernels still running when the host is done
        self.synchronized = 0
        self._live: LiveBytes | None = None
        self._host_tensors = WeakIdKeyDictionary()

    def own(self, t: torch.Tensor) -> None:
        pass  # as CudaDevice: what the model's ops made stays the allocator's live bytes

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = super().host_empty(numel, dtype)
        self._host_tensors[t] = True
        return t

    def allocator(self) -> LiveBytes:
        self._live = LiveBytes(self._grew, is_model=lambda key: key in self._model_keys()
                               or key in {storage_key(t) for t in self._host_tensors.keys()})
        return self._live

    def _model_keys(self) -> set[int]:
        return {storage_key(t) for t in self._device_tensors.keys()}

    def _model_bytes(self) -> int:
        storages = {storage_key(t): t.untyped_storage() for t in self._device_tensors.keys()}
        return sum(s.nbytes() for s in storages.values())

    def _current(self) -> int:
        return self._model_bytes() + (self._live.current if self._live is not None else 0)

    def _reached(self, nbytes: int) -> None:
        self.peak = max(self.peak, nbytes)
        self.highest = max(self.highest, nbytes)

    def _grew(self, delta: int) -> None:
        self._reached(self._current())

    def spike(self, nbytes: int) -> None:
        self._reached(self._current() + nbytes)

    def begin_step(self, model_bytes: int = 0) -> None:
        super().begin_step(model_bytes)
        self.peak = self.highest = self._current()

    def allocator_bytes(self) -> int:
        return self._current()

    def allocator_reading(self) -> tuple[int, int]:
        self._reached(self._current())
        return self._current(), self.peak

    def reset_peak(self) -> None:
        self.peak = self._current()

    def allocator_peak(self) -> int:
        self._reached(self._current())
        return self.peak

    def synchronize(self) -> None:
        self.synchronized += 1
        time.sleep(self.queued_seconds)


MODEL = build("opt", layers=2, hidden=64)
BATCH = make_batches(1)[0]


def engine(device, policy: str = "cpu") -> Engine:
    return Engine(copy.deepcopy(MODEL), EngineConfig(policy=policy, precision="fp32"),
                  device=device)


def gpu_step(eng: Engine, batch=BATCH):
    with eng.device.allocator():
        return eng.step(batch)


def simulated_trace():
    with engine(SimulatedDevice(2**30)) as eng:
        eng.step(BATCH)
        return eng.trace


def test_on_a_gpu_the_allocator_counts_the_trace_and_no_op_is_intercepted():
    """The same trace as the simulated device's exact count, read from the allocator at
    the trace points and model changes only: the engine's own counter sees no op."""
    expected = simulated_trace()
    with engine(ModelledGpu(2**30)) as eng:
        gpu_step(eng)
        assert not eng.runner.counter._ops  # no op went through its dispatch mode
        got = eng.trace
    assert [p.chunks for p in got.points] == [p.chunks for p in expected.points]
    assert [p.non_model_peak for p in got.points] == [p.non_model_peak
                                                      for p in expected.points]
    assert [p.working_set for p in got.points] == [p.working_set for p in expected.points]


def test_on_a_gpu_memory_allocated_and_freed_inside_one_op_is_in_the_trace():
    gpu = ModelledGpu(2**30)
    with engine(gpu) as eng:
        layer = eng.model.model.decoder.layers[1].fc1
        layer.register_forward_hook(lambda *_: gpu.spike(64 * MiB))
        gpu_step(eng)
        assert eng.trace.non_model_peak >= 64 * MiB
        assert eng.snapshot().device_peak >= 64 * MiB


@pytest.mark.parametrize("factor", [1.0, 1.05])
@pytest.mark.parametrize("policy", ["auto", "cpu"])
def test_on_a_gpu_the_first_step_keeps_room_for_its_activations(policy, factor):
    """Under auto the device must not fill with idle chunks before the step's activations
    come: a GPU would be out of memory there, whatever the engine evicted afterwards."""
    minimum = simulated_trace().working_set
    budget = int(factor * minimum)
    gpu = ModelledGpu(budget)
    with engine(gpu, policy) as eng:
        stats = gpu_step(eng)
        assert gpu.highest <= budget
        assert stats.memory.device_peak == gpu.highest
        # and after a shape change, traced again
        longer = make_batches(1, seq_len=48)[0]
        eng.set_budget(int(factor * max(minimum, _working_set(longer))))
        gpu_step(eng)
        stats = gpu_step(eng, longer)
        assert eng.trace.shape == tuple(longer["input_ids"].shape)
        assert gpu.highest <= eng.settings.device_budget
        assert stats.memory.device_peak == gpu.highest


@pytest.mark.parametrize("policy", ["cuda", "auto", "cpu"])
def test_on_a_gpu_a_settled_step_reads_the_allocator_once_and_reports_its_true_peak(
        policy, monkeypatch):
    """A read of the allocator's statistics costs ~20 us on a GPU and a step samples
    hundreds of times: once the placement has settled (engine.step.counting), a step
    reads none between its trace points, and its peak is still the allocator's own, over
    the whole step, including a workspace no count sees."""
    budget = int(1.2 * simulated_trace().working_set) if policy == "auto" else 2**30
    gpu = ModelledGpu(budget)
    with engine(gpu, policy) as eng:
        counted = [gpu_step(eng) for _ in range(3)]  # the trace, then until settled
        reads = {"n": 0}
        reading = gpu.allocator_reading

        def counting_reads():
            reads["n"] += 1
            return reading()

        monkeypatch.setattr(gpu, "allocator_reading", counting_reads)
        stats = gpu_step(eng)
        assert reads["n"] == 0
        assert stats.loss != counted[-1].loss  # it trained
        assert stats.memory.device_peak == counted[-1].memory.device_peak == gpu.highest
        layer = eng.model.model.decoder.layers[1].fc1
        layer.register_forward_hook(lambda *_: gpu.spike(64 * MiB))
        stats = gpu_step(eng)
        assert reads["n"] == 0
        assert stats.memory.device_peak == gpu.highest > counted[-1].memory.device_peak


def test_on_a_gpu_a_settled_run_never_counts_again(monkeypatch):
    """The simulated device's backstop recount (counting.RECOUNT_EVERY) buys nothing on a
    GPU, where every step's true peak is the allocator's, and costs a counted step's reads
    (0.44 s against 0.20 s a step for opt-1.3b on an H200)."""
    monkeypatch.setattr(counting, "RECOUNT_EVERY", 3)
    gpu = ModelledGpu(2**30)
    with engine(gpu, "cpu") as eng:
        counted = []
        for _ in range(9):
            stats = gpu_step(eng)
            counted.append(eng.runner.counts.counting)
            assert stats.memory.device_peak == gpu.highest
    assert counted == [True, True, True] + [False] * 6  # traced, counted until settled


def test_on_a_gpu_a_settled_step_keeps_every_micro_batchs_peak_and_counts_again_past_it():
    """Each micro-batch's start resets the allocator's peak: with no reading between its
    trace points, a settled step reads it before the next one starts. A peak above the
    counted step's (data-dependent work the trace never saw) makes the next step count."""
    gpu = ModelledGpu(2**30)
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(policy="cpu", precision="fp32",
                                                    grad_accum=2), device=gpu)
    batch = make_batches(1, batch_size=4)[0]
    with eng:
        for _ in range(3):  # the trace, then until settled
            gpu_step(eng, batch)
        calls = {"n": 0}

        def first_micro_batch_only(*_):
            calls["n"] += 1
            if calls["n"] == 1:
                gpu.spike(64 * MiB)

        eng.model.model.decoder.layers[1].fc1.register_forward_hook(first_micro_batch_only)
        stats = gpu_step(eng, batch)
        assert not eng.runner.counts.counting  # settled: no reading between points
        assert stats.memory.device_peak >= 64 * MiB  # micro-batch 0's, not 1's
        gpu_step(eng, batch)
        assert eng.runner.counts.counting  # counted again, after the peak it did not expect


def test_on_a_gpu_a_larger_budget_admits_what_the_old_one_could_not():
    """A change is checked against the capacity the new budget gives, not the old one's."""
    need = simulated_trace().working_set
    with engine(ModelledGpu(2 * need), "auto") as eng:
        gpu_step(eng)
        costs = sum(eng.manager.resident_cost(c) for c in eng.chunks)
        eng.set_budget(4 * (costs + need))
        eng.set_policy("cuda")  # refused before: checked against the old 2 x need
        stats = gpu_step(eng)
        assert stats.policy == "cuda"


def _working_set(batch) -> int:
    with engine(SimulatedDevice(2**30)) as eng:
        eng.step(batch)
        return eng.trace.working_set


def test_a_steps_time_includes_the_work_still_queued_on_the_gpu():
    gpu = ModelledGpu(2**30, queued_seconds=0.2)
    with engine(gpu) as eng:
        stats = gpu_step(eng)
    assert gpu.synchronized >= 1
    assert stats.seconds >= 0.2 and stats.optimizer >= 0.2


# --- what the engine can hold on a real GPU -------------------------------------------------


def bare_cuda_device(monkeypatch, budget: int, allocated: dict[str, int],
                     others: list[CudaDevice]) -> CudaDevice:
    """A CudaDevice of `budget` on an 8 GiB GPU whose allocator holds `allocated["bytes"]`
    (changed by the test as it goes), live beside `others` and no one else."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (8 * 2**30, 8 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda index=None: {
        "allocated_bytes": {"all": {"current": allocated["bytes"], "peak": allocated["bytes"]}},
        "reserved_bytes": {"all": {"current": 0, "peak": 0}}})
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda index=None: None)
    device = CudaDevice.__new__(CudaDevice)
    device.index, device.budget, device._foreign = 0, budget, 0
    device._before_steps, device.unowned, device._room = None, 0, None
    device.reserved_peak = device.allocated_peak = 0
    device.transfers = SimulatedDevice(1).transfers
    monkeypatch.setattr(cuda, "_LIVE", weakref.WeakSet([device, *others]))
    return device


@pytest.mark.parametrize("another_engine", [True, False])
def test_what_the_first_step_left_on_the_gpu_that_is_not_the_engines_is_not_room(
        another_engine, monkeypatch):
    """cuBLAS's workspaces, made by the first step and kept, sit inside the hard cap: the
    engine's room is the budget less those, less the allocator's slack, not the budget.
    What was there before is another live engine's, under its own share of the cap, or
    with none alive a closed one's workspaces, under this one's."""
    allocated = {"bytes": 10 * MiB}  # before this one's steps
    other = CudaDevice.__new__(CudaDevice)
    other.index = 0
    device = bare_cuda_device(monkeypatch, 512 * MiB, allocated,
                              others=[other] if another_engine else [])
    before = 0 if another_engine else 10 * MiB
    slack = int(cuda.ALLOCATOR_SHARE * 512 * MiB)
    device.begin_step(model_bytes=0)
    assert device.capacity() == 512 * MiB - slack - before
    allocated["bytes"] += 100 * MiB + 32 * MiB  # the engine's 100 MiB, a workspace of 32
    device.begin_step(model_bytes=100 * MiB)
    assert device.capacity() == 512 * MiB - slack - before - 32 * MiB


def test_a_small_budgets_cap_holds_what_was_there_before_beside_it(monkeypatch):
    """The GPU tests compare with a plain run that leaves cuBLAS's workspace (32 MiB on
    Hopper) allocated; a budget of a few MiB is capped at MIN_HARD_CAP, which holds it."""
    device = bare_cuda_device(monkeypatch, 10 * MiB, {"bytes": 32 * MiB}, others=[])
    device.begin_step(model_bytes=0)
    assert device.unowned == 32 * MiB
    assert device.capacity() == 10 * MiB


# --- collectives on NCCL --------------------------------------------------------------------


class Work:
    def __init__(self) -> None:
        self.waits: list[dict] = []

    def wait(self, **kwargs) -> bool:
        self.waits.append(kwargs)
        return True


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_wait_on_nccl_never_blocks_the_host_and_on_gloo_carries_the_timeout(
        backend, monkeypatch):
    """NCCL's Work.wait with a timeout blocks the host until the collective ends, so a
    gather started ahead of use would overlap nothing: there the process group's timeout
    and watchdog bound it instead."""
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    collectives = Collectives(None, timeout=5)
    work = Work()
    collectives.wait(Pending(work, "all-gather", 0))
    assert work.waits == ([{}] if backend == "nccl"
                          else [{"timeout": datetime.timedelta(seconds=5)}])


# --- the allocator's own room -------------------------------------------------------------


def test_the_allocator_keeps_a_share_of_the_cap_that_a_small_budgets_cap_already_gives():
    assert cuda.allocator_slack(6 * 2**30, 6 * 2**30) == int(cuda.ALLOCATOR_SHARE * 6 * 2**30)
    assert cuda.allocator_slack(6 * 2**30, 6 * 2**30, unowned=32 * MiB) == int(
        cuda.ALLOCATOR_SHARE * 6 * 2**30) + 32 * MiB
    # capped at MIN_HARD_CAP: 192 MiB beyond the budget already, for the allocator's share
    # and a workspace that is not the engine's
    assert cuda.allocator_slack(64 * MiB, 64 * MiB, unowned=32 * MiB) == 0
    assert cuda.allocator_slack(200 * MiB, 200 * MiB, unowned=64 * MiB) == (
        int(cuda.ALLOCATOR_SHARE * 200 * MiB) + 64 * MiB - 56 * MiB)


@pytest.mark.parametrize("variable", [None, "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_the_allocator_maps_expandable_segments_unless_the_user_chose(variable, monkeypatch):
    chosen = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", chosen.append,
                        raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    if variable:
        monkeypatch.setenv(variable, "expandable_segments:False")
    cuda._expandable_segments()
    assert chosen == ([] if variable else ["expandable_segments:True"])
