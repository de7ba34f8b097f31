"""Engine: trains a model whose parameters live in chunks moved between host and device.

    eng = Engine(model, EngineConfig(policy="auto", device_budget="6GiB", precision="bf16"))
    stats = eng.step(batch)          # forward, backward, AdamW; returns StepStats
    eng.set_policy("cpu")            # takes effect at the next step boundary

Placement changes where bytes live, never the math: in fp32 every policy, budget and margin
gives the losses and weights of torch.optim.AdamW(fused=True) on the same batches.

Data parallel: launched by torchrun, after `torch.distributed.init_process_group`, the same
code shards every chunk over the ranks (EngineConfig.data_parallel, on by default then).
Each rank passes its own slice of the global batch to `step`; the step's loss and tokens
are the whole batch's, and the weights those of one process on the global batch.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator

import torch

from engine.chunks import weights
from engine.chunks.packing import build_chunks, fill, first_use_order, first_uses, move_buffers
from engine.chunks.sharding import ShardedChunks
from engine.config import EngineConfig, LiveSettings
from engine.devices.device import ComputeDevice, make_device
from engine.devices.disk import DiskTierError, default_disk_dir, rank_folder
from engine.devices.host_memory import PeakResident, release_free_host_memory
from engine.distributed import join
from engine.models.training import drops_out, prepare_for_training
from engine.models.weight_source import WeightSource
from engine.placement.policy import Policy
from engine.placement.rules import BudgetTooSmall
from engine.placement.trace import Trace
from engine.step import activation_checkpointing as checkpointing
from engine.step import checkpoint_state
from engine.step.dropout import WholeBatchDropout
from engine.step.evaluation import evaluate_loss
from engine.step.micro_batches import split_batch
from engine.step.optimizer import ChunkAdamW
from engine.step.rank_zero import agree_step, follow_rank_zero
from engine.step.runner import StepInterrupted, StepRunner
from engine.step.setting_changes import SettingChanges
from engine.step.snapshot import memory_snapshot
from engine.telemetry import MemorySnapshot, StepStats

__all__ = ["BudgetTooSmall", "Engine", "StepInterrupted", "first_use_order"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Engine(SettingChanges):
    """The offload engine. See the module docstring and DESIGN.md ("The engine").

    The facade: settings, the optimizer, telemetry and state. How the settings change
    between steps is its SettingChanges part's (engine.step.setting_changes). What happens
    inside forward and backward is the StepRunner's (engine.step.runner); which chunk goes
    where is the placement rules' (engine.placement.rules), carried out by the ChunkManager.

    Data parallel (ZeRO-3 style): when torch.distributed is initialized with more than one
    rank (or `data_parallel=True`), each rank keeps one shard of every chunk (payload,
    fp32 master, moments, gradient), gathers a chunk whole for each use and reduce-scatters
    its gradients; policy, margin and budgets apply per rank to its shards and to the
    chunks it gathers, and the settings rank 0 stages (set_policy, set_margin,
    set_budget) are every rank's from the next step. Every rank must then create the
    engine, step, and call model_state_dict/state_dict/load_state_dict/close at the same
    points, with batches of the same shape, and run the same modules in the same order (a
    parameter left unused on some rank is fine: its gradient counts as zeros there, as
    with DDP's find_unused_parameters). Under a host budget each rank spills its own
    shards, to a scratch folder of its own under `disk_dir`/rank-<rank>.
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None, *,
                 device: ComputeDevice | None = None, weights: WeightSource | None = None
                 ) -> None:
        """`weights`: where the values of `model`'s parameters come from, for a model made on
        the meta device (engine.models.zoo.meta_build): each chunk is filled from it and
        placed before the next is made, so the model never exists whole in host memory."""
        self.config = config = config or EngineConfig()
        self.model = model
        self._owns_device = device is None  # a device made here is closed here
        self.device = device or make_device(config.device_budget, config.simulate)
        self.dtype = DTYPES[config.precision]
        self.step_count = 0
        self.settings = LiveSettings(Policy(config.policy), config.margin_ratio,
                                     self.device.budget, config.grad_accum,
                                     checkpointing.is_checkpointing(model))
        self._rows: int | None = None  # sequences in the latest step's batch
        self._pending: LiveSettings | None = None  # replaces settings at the next step
        self._last_non_model_peak = 0
        self._last_peak = 0
        self._counted_allocator_peak = 0  # CUDA: the last counted step's (_check_settled_peak)
        self._resident = PeakResident()  # reset as each step starts, read as it ends
        self._last_rss_peak: int | None = None
        self.closed = False

        prepare_for_training(model)
        uses = first_uses(model)
        self.collectives = join(config.data_parallel, timeout=config.collective_timeout)
        ranks = (self.collectives.rank, self.collectives.world) if self.collectives else None
        # Data parallel: each rank's dropout masks are its rows of the whole batch's.
        self._dropout = (WholeBatchDropout(*ranks) if ranks and drops_out(model)
                         else contextlib.nullcontext())
        # Under a host budget the chunks are filled one at a time and placed (parts on disk)
        # before the next, so that building never needs the whole state in host memory.
        budgeted = config.host_budget is not None
        self.chunk_size, self.chunks = build_chunks(model, dtype=self.dtype, device=self.device,
                                                    chunk_size=config.chunk_size,
                                                    order=uses.order, ranks=ranks,
                                                    filled=not budgeted, weights=weights)
        self.runner = StepRunner(model, self.chunks, self.device, borrowed=uses.borrowed)
        self.manager = self.runner.manager
        if self.collectives is not None:
            self.manager.use_sharding(ShardedChunks(self.manager, self.collectives))
            self.manager.sharding.on_interrupt = self.runner.interrupt
            self.runner.counts.every_step = True
        self.manager.set_policy(self.settings.policy)
        if budgeted:
            disk_dir = config.disk_dir or default_disk_dir()
            if ranks is not None:  # ranks on one machine keep their files apart
                disk_dir = rank_folder(disk_dir, ranks[0])
            self.manager.use_host_budget(config.host_budget, disk_dir,
                                         fill=lambda chunk: fill(chunk, self.device, weights))
        else:
            self.manager.count_host(self.chunks)
        self.optimizer = ChunkAdamW(config, self.manager)
        move_buffers(model, self.device.torch_device)
        self._check_budget(self.settings.device_budget, self.settings.policy)
        self._place()
        self.manager.disk_counters()  # what building moved to disk is no step's
        # Packing freed the model's own storages parameter by parameter: hand the holes
        # back once, or they stay resident for the whole run (~30% of it, measured).
        release_free_host_memory()

    # --- the step ---------------------------------------------------------------------------

    def interrupt(self) -> None:
        """Cut the running step short at the next module boundary (StepInterrupted; in a
        quiet micro-batch's backward, engine.step.counting, at the next gradient to
        arrive); with no step running, the next step stops at its first module. Safe to
        call from a signal handler or another thread: it only sets a flag.

        Data parallel: called on any rank, it stops the step on every rank, at the module
        boundary after the next one (the ranks agree on it at a boundary first)."""
        if self.manager.sharding is not None:
            self.manager.sharding.request_interrupt()
        else:
            self.runner.interrupt()

    def step(self, batch: dict[str, torch.Tensor]) -> StepStats:
        """One optimizer step on `batch` (input_ids, labels, optional attention_mask).

        With `grad_accum` N the batch is split into N micro-batches, in order; each runs
        forward and backward with its loss divided by N, and their gradients add up where
        each chunk's gradients live before the one update.

        With optimizer state on disk (host_budget), the update of the chunks on the host may
        still run when this returns: it overlaps the next step's forward, which waits for
        each chunk's update just before using it (engine.chunks.flight). Anything else that
        needs the weights or the state (state_dict, evaluate, a setting change) waits for it.
        """
        if self.closed:
            raise RuntimeError("this engine is closed")
        t_start = time.perf_counter()
        self._resident.reset()
        if not self.manager.flight.active:
            self.manager.retry_disk()  # what a full disk left held, before anything changes
        self.manager.reset_counters()
        if self.collectives is not None:
            self.collectives.reset_counters()
            self._pending = follow_rank_zero(self.collectives, self._pending, self.settings)
        self.settings = checkpointing.as_the_model_has_it(self.settings, self.model)
        applied = self._apply_pending()
        m = self.manager
        self._rows = int(batch["input_ids"].shape[0])
        parts = split_batch(batch, self.settings.grad_accum)
        dev = self.device.torch_device
        losses: list[float] = []
        traced = False
        forward = fwd_transfer = bwd_transfer = 0.0
        peak = non_model_peak = 0
        earlier_peak = 0  # CUDA: the allocator's peak over the earlier micro-batches
        counted = False
        t0 = time.perf_counter()
        for i, part in enumerate(parts):
            shape = tuple(part["input_ids"].shape)
            if i > 0:  # its start resets the allocator's peak: read the one before's first
                earlier_peak = max(earlier_peak, self.device.allocator_peak() or 0)
            if self.runner.begin(shape, step=self.step_count + 1, accumulate=i > 0,
                                 checkpointing=self.settings.activation_checkpointing):
                if self.settings.margin_ratio > 0:
                    self._place(margin=False)  # a new shape may need that room
            counted = counted or self.runner.counts.counting
            part = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in part.items()}
            with self._dropout:
                loss, fx, bx = self.runner.forward_backward(
                    part, self.optimizer.loss_scale / len(parts))
            traced = self._end_trace() or traced
            losses.append(float(loss.detach()))
            forward += self.runner.forward_seconds
            fwd_transfer, bwd_transfer = fwd_transfer + fx, bwd_transfer + bx
            peak = max(peak, self.runner.peak)
            non_model_peak = max(non_model_peak, self.runner.non_model_peak)
        t2 = time.perf_counter()
        loss_value = sum(losses) / len(losses)
        tokens = int(batch["input_ids"].numel())
        try:
            if self.collectives is not None:
                loss_value, tokens = agree_step(self.collectives, self.chunks, loss_value,
                                                tokens)
            self._settle_update()  # the last step's, if it overlapped this forward
        except BaseException:
            for chunk in self.chunks:
                self.optimizer.discard(chunk)  # this step is not applied
            raise
        self.step_count += 1
        skipped, grad_norm = self.optimizer.step(self.chunks, self.step_count)
        if traced:
            self._place()  # the margin needs the traced peak; grads are consumed by now
        else:
            self.manager.restore_disk_placement()  # payloads gradients brought home
        if not self.manager.flight.active:
            self._raise_disk_errors()  # else once that update is over (_settle_update)
        self.device.synchronize()  # work still queued on a GPU is this step's time
        t3 = time.perf_counter()
        disk_read, disk_written, disk_wait = m.disk_counters()
        # CUDA: since the runner's last reading, and the earlier micro-batches' (None
        # on the simulated device, which counts instead).
        allocator_peak = self.device.allocator_peak()
        if allocator_peak is not None:
            allocator_peak = max(allocator_peak, earlier_peak)
            # A counted step's readings reset the allocator's peak: its own is the highest
            # of what they read (peak) and the rest of the step.
            self._check_settled_peak(max(peak, allocator_peak) if counted else allocator_peak,
                                     counted)
        self._last_peak = (peak if allocator_peak is None
                           else max(peak, self.runner.peak, allocator_peak))
        self._last_non_model_peak = non_model_peak
        self._last_rss_peak = self._resident.read()
        return StepStats(
            step=self.step_count, loss=loss_value, tokens=tokens,
            micro_batches=len(parts), micro_losses=losses,
            activation_checkpointing=self.settings.activation_checkpointing,
            seconds=t3 - t_start, forward=forward - fwd_transfer,
            backward=(t2 - t0 - forward) - bwd_transfer, optimizer=t3 - t2,
            transfer=m.transfer_seconds, bytes_h2d=m.bytes_h2d, bytes_d2h=m.bytes_d2h,
            policy=self.settings.policy.value, margin_ratio=self.settings.margin_ratio,
            device_budget=self.settings.device_budget, memory=self.snapshot(),
            skipped=skipped, loss_scale=self.optimizer.loss_scale, grad_norm=grad_norm,
            lr=self.config.lr_at(self.step_count), applied=applied,
            timeline=self.runner.timeline,
            bytes_disk_read=disk_read, bytes_disk_written=disk_written, disk_wait=disk_wait,
            bytes_gathered=self.collectives.bytes_gathered if self.collectives else 0,
            bytes_reduce_scattered=(self.collectives.bytes_reduce_scattered
                                    if self.collectives else 0))

    def _check_settled_peak(self, allocator_peak: int, counted: bool) -> None:
        """CUDA: a step that did not count reported its counted twin's figures and placed
        its chunks on the trace's forecast; if the allocator saw more than that twin did
        (data-dependent work, say), the next step counts again (engine.step.counting)."""
        if counted:
            self._counted_allocator_peak = allocator_peak
        elif allocator_peak > self._counted_allocator_peak:
            self.runner.counts.forget()

    def finish_update(self) -> tuple[int, int, float]:
        """Wait for the last step's update if it still runs (state on disk: it overlaps the
        next step, engine.chunks.flight) and for every write it issued to land; returns the
        (bytes read, bytes written, seconds waited) of the disk tier that no step reported
        yet: what a run reports after its last step. Raises DiskTierError as a step would."""
        self._settle_update()
        self.manager.flush_disk()
        self._raise_disk_errors()
        return self.manager.disk_counters()

    def _settle_update(self) -> None:
        """Wait for the update still running from the last step, if any (it overlaps the
        next forward: engine.chunks.flight), and raise what went wrong in it."""
        self.manager.flight.wait()
        if self.manager.flight.take_ended():
            self._raise_disk_errors()

    def _raise_disk_errors(self) -> None:
        """A write to the scratch folder failed during this step: the step is applied and
        what could not be written is held in memory; say so, and why."""
        errors = self.manager.disk_errors()
        if errors:
            raise DiskTierError(
                errors[0].errno,
                f"{errors[0].strerror}. Step {self.step_count} is applied and what could not "
                f"be written is kept in host memory: free space there and step again (it is "
                f"written first), or save a checkpoint")

    def evaluate(self, batch: dict[str, torch.Tensor]) -> float:
        """The loss on `batch` (input_ids, labels) with no gradient and no update, the model
        in eval mode; copies are kept while they leave the activations room (evaluation.py),
        so it fits in any budget the step fits in. Pending setting changes stay pending.

        Data parallel: every rank calls it alike (it gathers chunks), each with a batch of
        its own; the loss is this rank's."""
        if self.closed:
            raise RuntimeError("this engine is closed")
        return evaluate_loss(self.model, self.manager, self.device, batch)

    # --- the end ------------------------------------------------------------------------------

    def close(self, *, keep_weights: bool = True) -> None:
        """Remove every hook and free every chunk, on the device and the host; the scratch
        folder goes too, once the last update and its writes are done.

        The model stays usable without the engine: each parameter gets its latest weights
        as a plain CPU tensor in the compute dtype (model_state_dict() before close gives
        the fp32 master). `keep_weights=False`: the model is not used again (a process
        that ends), so none are read back from the disk for it. Closing twice is
        harmless; stepping after close is an error.
        """
        if self.closed:
            return
        self.closed = True
        self.runner.remove_hooks()
        self.manager.close(keep_weights=keep_weights)
        if self._owns_device:
            self.device.close()  # its share of the CUDA cap and its pinned staging ring
        gc.collect()  # the runner and manager reference each other through callbacks
        release_free_host_memory()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- views ------------------------------------------------------------------------------

    @property
    def num_parameters(self) -> int:
        return sum(s.numel for c in self.chunks for s in c.slots)

    @property
    def policy(self) -> str:
        return self.settings.policy.value

    @property
    def trace(self) -> Trace | None:
        return self.runner.trace

    def snapshot(self) -> MemorySnapshot:
        """Where memory is now (mid-step too), and the peaks of the last step."""
        rss = self._resident.read() if self._last_rss_peak is None else self._last_rss_peak
        return memory_snapshot(self.chunks, self.manager, self.device,
                               non_model_peak=self._last_non_model_peak, peak=self._last_peak,
                               rss=rss, rss_exact=self._resident.exact)

    # --- weights and state ----------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Full-precision weights on the CPU under the model's own names (tied names too),
        in the model's order: iter_model_state() collected."""
        out = dict(self.iter_model_state())
        return {name: out[name] for name in self.model.state_dict(keep_vars=True)}

    def iter_model_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """model_state_dict()'s (name, tensor) pairs, buffers first, then chunk by chunk:
        each tensor is a CPU copy of its own, made when asked for, so a caller writing them
        as they come (a sharded checkpoint) never has the whole model in memory. A chunk
        with parts on disk has them read back while its tensors are given (one chunk's
        parts at a time). Don't step until it is exhausted or closed (contextlib.closing:
        an abandoned one keeps its chunk's parts read in until collected); data parallel,
        every rank iterates it alike to the end (each chunk is gathered, a collective)."""
        return checkpoint_state.iter_model_state(self.model, self.chunks, self.manager,
                                                 self.runner.slot_of)

    def state_dict(self) -> dict:
        """Everything to resume exactly: fp32 master, moments and step counts by parameter
        name (plain CPU tensors, safetensors-ready), the loss scale and the settings.

        State on disk is read back one chunk at a time: beyond the result (16 B/param),
        the disk tier's I/O buffers are all the memory this takes."""
        return {"tensors": dict(self.iter_optimizer_state()), "meta": self.state_meta()}

    def iter_optimizer_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """state_dict()["tensors"]'s (name, tensor) pairs chunk by chunk, as
        iter_model_state() gives the weights: a caller writing them as they come never has
        the whole state in memory; the same rules apply (don't step meanwhile, close it if
        left early; every rank iterates alike)."""
        return checkpoint_state.iter_optimizer_state(self.chunks, self.manager)

    def iter_optimizer_shard(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's part of iter_optimizer_state(), with no collective: for each
        parameter with elements in this rank's shard, (`{kind}/{name}`, those elements,
        flat) and its step count, chunk by chunk (optimizer_layout() says which elements
        each rank gives). So that every rank writes its own shard of a checkpoint, and no
        rank receives another's state. Unsharded, the same pairs as iter_optimizer_state().
        The same rules apply: don't step meanwhile, close it if left early."""
        return checkpoint_state.iter_optimizer_shard(self.chunks, self.manager)

    def optimizer_layout(self) -> dict[str, list[tuple[int, int, int]]]:
        """For every name iter_optimizer_shard() gives on some rank: [(rank, lo, hi)], the
        elements of the parameter (flattened) each rank's tensor holds, in rank order."""
        return weights.shard_layout(self.chunks)

    def state_meta(self) -> dict:
        """state_dict()["meta"]: the step, the loss scale and the settings (JSON-ready)."""
        return {"step": self.step_count, "loss_scale": self.optimizer.loss_scale,
                "good_steps": self.optimizer.good_steps, "policy": self.settings.policy.value,
                "margin_ratio": self.settings.margin_ratio,
                "device_budget": self.settings.device_budget,
                "grad_accum": self.settings.grad_accum,
                "activation_checkpointing": self.settings.activation_checkpointing,
                "precision": self.config.precision}

    def load_state_dict(self, state: dict) -> None:
        """Inverse of state_dict(); raises ValueError naming what does not match, before
        anything changes. State on disk is written back one chunk at a time.

        `state["tensors"]` may be any mapping by name: each tensor is read once, as its
        chunk is filled, so a lazy one (reading files tensor by tensor) holds one chunk's
        at a time; give `state["numels"]` (name -> element count) with it and the check
        beforehand reads none of them.

        Or `state["ranges"]` (engine.chunks.weights.Ranges, its numels with it) in place of
        the tensors: each rank then reads only the elements its own shard holds, whatever
        world size wrote them (a checkpoint's files read by slices)."""
        checkpoint_state.load_optimizer_state(self.chunks, self.manager, self.optimizer, state)
        meta = state["meta"]
        self.step_count = int(meta["step"])
        self.optimizer.loss_scale = float(meta.get("loss_scale", self.optimizer.loss_scale))
        self.optimizer.good_steps = int(meta.get("good_steps", 0))
