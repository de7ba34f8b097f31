"""Engine: trains a model whose parameters live in chunks moved between host and device.

    eng = Engine(model, EngineConfig(policy="auto", device_budget="6GiB", precision="bf16"))
    stats = eng.step(batch)          # forward, backward, AdamW; returns StepStats
    eng.set_policy("cpu")            # takes effect at the next step boundary

Placement changes where bytes live, never the math: in fp32 every policy, budget and margin
gives the losses and weights of torch.optim.AdamW(fused=True) on the same batches.
"""

from __future__ import annotations

import time

import psutil
import torch

from engine.chunks import weights
from engine.chunks.chunk import Chunk
from engine.chunks.manager import ChunkManager
from engine.chunks.packing import build_chunks, first_use_order  # noqa: F401 (re-exported)
from engine.chunks.state import TensorState
from engine.config import EngineConfig, LiveSettings, describe_setting, format_size
from engine.devices.device import ComputeDevice, make_device
from engine.placement.policy import Policy
from engine.placement.residency import (
    BudgetTooSmall,
    apply_residency,
    check_budget,
    minimum_working_set,
    resident_set,
)
from engine.placement.trace import NonModelCounter, Trace, TracePoint, tensor_bytes
from engine.step.hooks import install, wrap_outputs
from engine.step.optimizer import ChunkAdamW, restore_params
from engine.telemetry import ChunkInfo, MemorySnapshot, StepStats

S = TensorState
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class StepInterrupted(Exception):
    """`Engine.interrupt()` cut a step short. The engine is as it was before that step:
    weights, optimizer state and step count untouched, so the step can simply run again."""


class Engine:
    """The offload engine. See the module docstring and DESIGN.md ("The engine")."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None, *,
                 device: ComputeDevice | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.model = model
        self.device = device or make_device(config.device_budget, config.simulate)
        self.dtype = DTYPES[config.precision]
        self.step_count = 0
        self._pending: LiveSettings | None = None  # replaces settings at the next step
        self._pos = -1
        self._trace: Trace | None = None
        self._tracing: Trace | None = None
        self._interval_peak = 0
        self._interval_ws = 0
        self._pinned = 0
        self._peak = 0
        self._last_non_model_peak = 0
        self._last_peak = 0
        self._in_step = False
        self._in_backward = False
        self._evicting = False
        self._interrupted = False

        self.counter = NonModelCounter(self._is_model_storage, self._on_non_model_change)
        self.chunks = self._build_chunks(model)
        self.manager = ChunkManager(self.chunks, self.device, non_model_now=self._non_model_now,
                                    on_change=self._on_model_change)
        self.settings = LiveSettings(Policy(config.policy), config.margin_ratio,
                                     self.device.budget)
        self.manager.policy = self.settings.policy
        self.optimizer = ChunkAdamW(config, self.manager)
        self._account_initial()
        self._model_ptrs: set[int] = set()
        self._slot_of = {id(s.param): (c, s) for c in self.chunks for s in c.slots}
        self._handles, owned = install(model, pre_forward=self._pre_forward,
                                       post_forward=self._post_forward, on_grad=self._on_grad)
        self._module_slots = {k: [self._slot_of[id(p)] for p in ps] for k, ps in owned.items()}
        self._module_chunks = {
            k: tuple(dict.fromkeys(c for c, _ in pairs)) for k, pairs in self._module_slots.items()}
        self._move_buffers()
        self._check_budget(self.settings.device_budget, self.settings.policy)
        self._place()

    # --- construction --------------------------------------------------------------------

    def _build_chunks(self, model: torch.nn.Module) -> list[Chunk]:
        self.chunk_size, chunks = build_chunks(model, dtype=self.dtype, device=self.device,
                                               chunk_size=self.config.chunk_size)
        return chunks

    def _account_initial(self) -> None:
        tensors = {id(t): t for c in self.chunks
                   for t in (c.payload, c.master, c.exp_avg, c.exp_avg_sq, c.host_grad)
                   if t is not None}
        self.manager.host_bytes = sum(t.nbytes for t in tensors.values())

    def _move_buffers(self) -> None:
        dev = self.device.torch_device
        for module in self.model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.device != dev:
                    module._buffers[name] = buf.to(dev)

    # --- settings (applied at the next step boundary) -----------------------------------------

    def set_policy(self, policy: str | Policy) -> str:
        """Switch placement at the next step. Raises ValueError if it cannot fit.

        Returns the change as the engine words it when it applies it ("policy cpu")."""
        return self._stage("policy", policy)

    def set_margin(self, ratio: float) -> str:
        """Share (0..1) of the spare device memory that keeps optimizer state there."""
        return self._stage("margin_ratio", ratio)

    def set_budget(self, budget: int | str) -> str:
        """Change the device budget at the next step. Raises ValueError if it is too small."""
        return self._stage("device_budget", budget)

    def _stage(self, field: str, value: object) -> str:
        base = self._pending or self.settings
        wanted = base.replace(**{field: value})
        self._check_budget(wanted.device_budget, wanted.policy)
        self._pending = wanted
        return describe_setting(field, getattr(wanted, field))

    def _check_budget(self, budget: int, policy: Policy) -> None:
        if not self.device.simulated:
            budget = min(budget, self.device.capacity())
        check_budget(budget, policy, chunks=self.chunks, manager=self.manager,
                     trace=self._trace, module_chunks=self._module_chunks.values())

    def min_working_set(self) -> int:
        """Least device bytes a step needs under any placement."""
        return minimum_working_set(self._trace, self._module_chunks.values())

    def _apply_pending(self) -> list[str]:
        if self._pending is None:
            return []
        wanted, self._pending = self._pending, None
        applied = wanted.changes_from(self.settings)
        self.settings = wanted
        self.device.set_budget(wanted.device_budget)
        self.manager.policy = wanted.policy
        if applied:
            self._place()
        return applied

    def _place(self, *, margin: bool = True) -> None:
        """Make resident what the policy and the margin ask for (see engine.placement.residency)."""
        ratio = self.settings.margin_ratio if margin else 0.0
        want = resident_set(self.chunks, self.manager, trace=self._trace,
                            capacity=self.device.capacity(), margin_ratio=ratio)
        apply_residency(self.chunks, self.manager, want)

    # --- accounting callbacks -------------------------------------------------------------

    def _is_model_storage(self, ptr: int) -> bool:
        return ptr in self._model_ptrs

    def _non_model_now(self) -> int:
        allocated = self.device.allocator_bytes()
        if allocated is None:
            return self.counter.current
        return max(0, allocated - self.manager.device_bytes)

    def _on_model_change(self) -> None:
        self._model_ptrs = {c.device_payload.untyped_storage().data_ptr()
                            for c in self.chunks if c.on_device}
        self._sample()

    def _on_non_model_change(self) -> None:
        if self._in_step and self.device.simulated:
            over = self.manager.device_bytes + self.counter.current - self.device.capacity()
            if over > 0:
                # A real device would fail the allocation; evict idle chunks first, and
                # sample only once they are gone.
                self._evicting = True
                try:
                    self.manager.make_room(0, self._pos, self._chunks_in_use())
                finally:
                    self._evicting = False
        self._sample()

    def _sample(self) -> None:
        if self._evicting or not hasattr(self, "manager"):
            return
        non_model = self._non_model_now()
        self._interval_peak = max(self._interval_peak, non_model)
        self._interval_ws = max(self._interval_ws,
                                self._pinned + self.manager.grad_bytes + non_model)
        self._peak = max(self._peak, self.manager.device_bytes + non_model)

    def _chunks_in_use(self) -> tuple[Chunk, ...]:
        return tuple(c for c in self.chunks if c.in_use() or c.grad is not None)

    # --- hook callbacks --------------------------------------------------------------------

    def interrupt(self) -> None:
        """Cut the running step short at the next module boundary (StepInterrupted); with
        no step running, the next step stops at its first module. Safe to call from a
        signal handler or another thread: it only sets a flag."""
        self._interrupted = True

    def _point(self, key: int, phase: str) -> None:
        """A module is about to run: close the trace interval and open the next."""
        if self._interrupted:
            self._interrupted = False
            raise StepInterrupted(f"step {self.step_count + 1} was interrupted in the {phase}")
        self._pos += 1
        chunks = self._module_chunks[key]
        if self._tracing is not None:
            points = self._tracing.points
            if points:
                points[-1].non_model_peak = self._interval_peak
                points[-1].working_set = self._interval_ws
            points.append(TracePoint(tuple(c.index for c in chunks), phase))
        # Bytes no placement could evict until the next point: chunks in use or about to be.
        self._pinned = sum(c.nbytes for c in self.chunks if c.in_use() or c in chunks)
        self._interval_peak = self._interval_ws = 0
        self._sample()

    def _pre_forward(self, key: int) -> None:
        if not self._in_step:
            self._outside_step(key)
            return
        self._point(key, "forward")
        # A forward inside backward is activation checkpointing's recompute: gradients may
        # arrive before the next module, and prefetching must leave them room.
        phase = "backward" if self._in_backward else "forward"
        self.manager.prepare(self._module_chunks[key], self._pos, phase)
        for chunk, slot in self._module_slots[key]:
            chunk.set_state(slot, S.COMPUTE)

    def _post_forward(self, key: int, output: object) -> object:
        if not self._in_step:
            return output
        for chunk, slot in self._module_slots[key]:
            chunk.set_state(slot, S.HOLD_AFTER_FWD)
        self.counter.set_output(tensor_bytes(output))
        if torch.is_grad_enabled():
            return wrap_outputs(output, lambda: self._pre_backward(key))
        return output

    def _pre_backward(self, key: int) -> None:
        self._point(key, "backward")
        self.manager.prepare(self._module_chunks[key], self._pos, "backward")
        for chunk, slot in self._module_slots[key]:
            if slot.state != S.HOLD_AFTER_BWD:
                chunk.set_state(slot, S.COMPUTE)

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        """A parameter's gradient is complete, usually once a backward. A parameter that
        autograd accumulates more than once (a module shared by two reentrant-checkpointed
        segments) adds up where its gradient already is, even once it has gone home."""
        chunk, slot = self._slot_of[id(param)]
        first = not slot.got_grad
        grad = param.grad.reshape(-1)
        if chunk.resident:
            self.manager.keep_slot_grad(chunk, slot, grad, self._pos)
        elif chunk.holds_grads:
            home = self.manager.grad_home(chunk)[slot.offset:slot.offset + slot.numel]
            home.add_(grad.to(home.device))
        else:
            buf = self.manager.grad_buffer(chunk, self._pos)[slot.offset:slot.offset + slot.numel]
            buf.copy_(grad) if first else buf.add_(grad)
        param.grad = None
        slot.got_grad = True
        if slot.state != S.HOLD_AFTER_BWD:
            chunk.set_state(slot, S.HOLD_AFTER_BWD)
        if not first:
            return
        chunk.grads_pending -= 1
        if chunk.grads_pending == 0:
            if chunk.resident:
                chunk.holds_grads = True
            else:
                self.manager.finish_grads(chunk)

    def _outside_step(self, key: int) -> None:
        """A forward outside step() (evaluation, generation): fetch like the cpu policy."""
        chunks = self._module_chunks[key]
        self.manager.prepare(chunks, self._pos)

    # --- the step ---------------------------------------------------------------------------

    def step(self, batch: dict[str, torch.Tensor]) -> StepStats:
        """One optimizer step on `batch` (input_ids, labels, optional attention_mask)."""
        t_start = time.perf_counter()
        applied = self._apply_pending()
        m = self.manager
        shape = tuple(batch["input_ids"].shape)
        if self._trace is None or self._trace.shape != shape:
            self._tracing = Trace(shape)
            m.strict = False
            m.overrun = 0
            if self.settings.margin_ratio > 0 and m.policy != Policy.CUDA:
                self._place(margin=False)  # a new shape may need that room for activations
        m.bytes_h2d = m.bytes_d2h = 0
        m.transfer_seconds = 0.0
        self._pos = -1
        self._peak = m.device_bytes
        self.device.reset_peak()
        self.counter.reset()
        for chunk in self.chunks:
            chunk.grads_pending = sum(s.param.requires_grad for s in chunk.slots)
            for slot in chunk.slots:
                slot.got_grad = False
        dev = self.device.torch_device
        batch = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

        self.model.train()
        self._in_step = True
        try:
            with self.counter.hooks():
                t0, x0 = time.perf_counter(), m.transfer_seconds
                loss = self.model(**batch).loss
                self.counter.set_output(0)
                t1, x1 = time.perf_counter(), m.transfer_seconds
                scale = self.optimizer.loss_scale
                self._in_backward = True
                (loss * scale if scale != 1.0 else loss).backward()
            self._finish_backward()
            t2, x2 = time.perf_counter(), m.transfer_seconds
        except BaseException:
            self._abort_step()
            raise
        finally:
            self._in_step = self._in_backward = False
            m.strict = True
        traced = self._tracing is not None
        if traced:
            self._end_trace()
        loss_value = float(loss.detach())
        self.step_count += 1
        skipped, grad_norm = self.optimizer.step(self.chunks, self.step_count)
        if traced:
            self._place()  # the margin needs the traced peak; grads are consumed by now
        t3 = time.perf_counter()
        return self._stats(loss_value, batch, t_start, (t0, t1, t2, t3), (x0, x1, x2),
                           skipped, grad_norm, applied)

    def _finish_backward(self) -> None:
        m = self.manager
        for chunk in self.chunks:
            # Parameters that got no gradient leave no chunk waiting.
            if chunk.slot_grads:
                chunk.holds_grads = True
            m.finish_grads(chunk)
            for slot in chunk.slots:
                if slot.state in (S.COMPUTE, S.HOLD_AFTER_FWD, S.HOLD_AFTER_BWD):
                    chunk.set_state(slot, S.HOLD)
        m.release_all()  # device copies are outdated by the update that follows

    def _abort_step(self) -> None:
        """Leave the engine consistent after a failed forward/backward: no grads, no copies."""
        for chunk in self.chunks:
            if chunk.grad is not None:
                self.manager.grad_bytes -= chunk.nbytes
                self.manager._free("device", chunk.grad)
                chunk.grad = None
            self.manager.drop_slot_grads(chunk)
            if chunk.holds_grads:
                restore_params(chunk)
                chunk.stale = chunk.on_device and not chunk.resident
            for slot in chunk.slots:
                if slot.state not in (S.FREE, S.HOLD):
                    slot.state = S.HOLD  # reset after a failure; not a transition
                slot.param.grad = None
            chunk.computing = 0
        self.manager.release_all()
        self._tracing = None
        self.counter.reset()

    def _end_trace(self) -> None:
        trace, self._tracing = self._tracing, None
        if trace.points:
            trace.points[-1].non_model_peak = self._interval_peak
            trace.points[-1].working_set = self._interval_ws
        trace.finish()
        overrun = self.manager.overrun
        self._trace = self.manager.trace = trace
        if overrun > 0 or trace.working_set > self.device.capacity():
            for chunk in self.chunks:
                self.optimizer.discard(chunk)
            self._place()
            raise BudgetTooSmall(
                f"device budget {format_size(self.device.capacity())} is below the minimum "
                f"working set {format_size(trace.working_set)} for batch shape "
                f"{tuple(trace.shape)} (chunks in use plus activations)")

    def _stats(self, loss: float, batch: dict, t_start: float, t: tuple, x: tuple,
               skipped: bool, grad_norm: float | None, applied: list[str]) -> StepStats:
        t0, t1, t2, t3 = t
        x0, x1, x2 = x
        m = self.manager
        allocator_peak = self.device.allocator_peak()
        self._last_peak = allocator_peak if allocator_peak is not None else self._peak
        self._last_non_model_peak = (self._trace.non_model_peak if self._trace else 0)
        fwd_transfer, bwd_transfer = x1 - x0, x2 - x1
        return StepStats(
            step=self.step_count, loss=loss, tokens=int(batch["input_ids"].numel()),
            seconds=t3 - t_start, forward=(t1 - t0) - fwd_transfer,
            backward=(t2 - t1) - bwd_transfer, optimizer=t3 - t2,
            transfer=m.transfer_seconds, bytes_h2d=m.bytes_h2d, bytes_d2h=m.bytes_d2h,
            policy=m.policy.value, margin_ratio=self.settings.margin_ratio,
            device_budget=self.settings.device_budget, memory=self.snapshot(), skipped=skipped,
            loss_scale=self.optimizer.loss_scale, grad_norm=grad_norm,
            lr=self.config.lr_at(self.step_count), applied=applied)

    # --- views ------------------------------------------------------------------------------

    @property
    def num_parameters(self) -> int:
        return sum(s.numel for c in self.chunks for s in c.slots)

    @property
    def policy(self) -> str:
        return self.manager.policy.value

    @property
    def trace(self) -> Trace | None:
        return self._trace

    def describe_device(self) -> str:
        return self.device.describe()

    def snapshot(self) -> MemorySnapshot:
        """Where memory is now (mid-step too), and the peaks of the last step."""
        states = {loc: {s.value: 0 for s in TensorState} for loc in ("device", "host")}
        chunks = []
        for c in self.chunks:
            loc = "device" if c.on_device else "host"
            for slot in c.slots:
                states[loc][slot.state.value] += 1
            chunks.append(ChunkInfo(c.index, loc, c.most_active().value, c.nbytes))
        return MemorySnapshot(
            device_capacity=self.device.capacity(), device_model=self.manager.device_bytes,
            device_non_model_peak=self._last_non_model_peak, device_peak=self._last_peak,
            host_model=self.manager.host_bytes, process_rss=psutil.Process().memory_info().rss,
            states=states, chunks=chunks)

    # --- weights and state ----------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Full-precision weights on the CPU under the model's own names (tied names too)."""
        return weights.model_state_dict(self.model, self._slot_of)

    def state_dict(self) -> dict:
        """Everything to resume exactly: fp32 master, moments and step counts by parameter
        name (plain CPU tensors, safetensors-ready), the loss scale and the settings."""
        meta = {"step": self.step_count, "loss_scale": self.optimizer.loss_scale,
                "good_steps": self.optimizer.good_steps, "policy": self.settings.policy.value,
                "margin_ratio": self.settings.margin_ratio,
                "device_budget": self.settings.device_budget,
                "precision": self.config.precision}
        return {"tensors": weights.optimizer_tensors(self.chunks), "meta": meta}

    def load_state_dict(self, state: dict) -> None:
        """Inverse of state_dict(); raises ValueError naming what does not match."""
        weights.load_optimizer_tensors(self.chunks, state["tensors"])
        for c in self.chunks:
            self.optimizer.discard(c)
            if not c.aliased:
                c.payload.copy_(c.master)
            c.stale = c.on_device and not c.resident
        self.manager.release_all()
        meta = state["meta"]
        self.step_count = int(meta["step"])
        self.optimizer.loss_scale = float(meta.get("loss_scale", self.optimizer.loss_scale))
        self.optimizer.good_steps = int(meta.get("good_steps", 0))
