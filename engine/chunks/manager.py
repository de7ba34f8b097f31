"""ChunkManager: where every chunk's bytes are, and moving them.

Its parts, one idea each: the bytes on the device and the host, counted exactly
(engine.chunks.tiers); the device copies brought in for use and let go (device_copies);
gradients (gradients); which chunks live on the device (residency); the host budget and the
parts on disk (disk_side). This module holds the step's frame and the end.

The decisions (what to evict, what to release, what to prefetch, what stays resident, what
goes to disk under a host budget) are engine.placement.rules'; the manager only carries them
out on tensors, with engine.chunks.spill for the parts on disk. The planner's replay carries
out the same rules on counters.

Data parallel is a layer over it: the manager calls the hook it is given (use_sharding,
engine.chunks.data_parallel), which engine.chunks.sharding supplies.
"""

from __future__ import annotations

import torch

from engine.chunks.chunk import Chunk
from engine.chunks.data_parallel import DataParallel
from engine.chunks.device_copies import DeviceCopies
from engine.chunks.disk_side import DiskSide
from engine.chunks.gradients import Gradients
from engine.chunks.residency import Residency
from engine.distributed.collectives import CollectiveError
from engine.placement import rules
from engine.placement.policy import Policy
from engine.placement.trace import Trace


class ChunkManager(DeviceCopies, Gradients, Residency, DiskSide):
    """Every chunk's bytes, and moving them: the parts above, over one shared state."""

    def use_sharding(self, sharding: DataParallel) -> None:
        """Data parallel: the chunks are sharded (packing.build_chunks with `ranks`), and
        gathers and gradient reductions go through `sharding` (engine.chunks.sharding's
        ShardedChunks over this manager). Under a host budget the disk tier holds parts of
        this rank's shards."""
        self.sharding = sharding

    # --- the step's frame -------------------------------------------------------------

    def set_policy(self, policy: Policy) -> None:
        self.policy = policy
        self.rules = rules.rules_for(policy)

    def reset_counters(self) -> None:
        """Zero the step's copy counters: at the step's start, before any pending change
        moves a byte, so that the step reports every copy made for it."""
        self.bytes_h2d = self.bytes_d2h = 0
        self.transfer_seconds = 0.0

    def begin_step(self, *, tracing: bool) -> None:
        """A traced step has no forecast to trust yet: room that cannot be made is noted as
        an overrun rather than raised."""
        self.rules = rules.rules_for(self.policy, tracing=tracing)
        if tracing:
            self.strict = False
            self.overrun = 0
        if self.sharding is not None:
            self.sharding.begin()

    def end_step(self) -> None:
        self.strict = True
        self.quiet = False
        self.rules = rules.rules_for(self.policy)

    def end_backward(self) -> None:
        """Every gradient of this backward is in. Sharded: reduce what is still waiting."""
        if self.sharding is not None:
            self.sharding.finish()

    def use_trace(self, trace: Trace | None) -> None:
        """Forecast from `trace`. Data parallel: every rank forecasts from the same numbers
        (each point's peaks and the overrun, the largest any rank measured), so that they
        all place alike."""
        if trace is not None and self.sharding is not None:
            self.overrun = self.sharding.agree_trace(trace, self.overrun)
        self.trace = trace

    def whole(self, chunk: Chunk, shard: torch.Tensor) -> torch.Tensor:
        """A sharded chunk's home tensor `shard` (master, a moment) gathered whole on the
        CPU, in fp32; a collective (engine.chunks.sharding.ShardedChunks.whole)."""
        return self.sharding.whole(chunk, shard)

    # --- the end ------------------------------------------------------------------------------

    def close(self, *, keep_weights: bool = True) -> None:
        """Give every parameter its latest weights as a plain CPU tensor of its own (in the
        compute dtype; `keep_weights=False`: empty ones), then drop every chunk tensor and
        the scratch folder: nothing of the engine stays alive. The last update, and its
        writes, end first."""
        self.flight.close()
        self.device.settle_host()
        for chunk in self.chunks:
            self.settle(chunk)
            if keep_weights:
                self._give_weights(chunk)
            else:
                for slot in chunk.slots:
                    slot.param.data = torch.empty(0, dtype=chunk.dtype)
                    slot.param.grad = None
            chunk.payload = chunk.device_payload = chunk.grad = chunk.host_grad = None
            chunk.master = chunk.exp_avg = chunk.exp_avg_sq = None
            chunk.slot_grads.clear()
        if self.spill is not None:
            self.spill.close()  # the scratch folder goes with it
            self.spill = None
        self.device_bytes = self.host_bytes = self.grad_bytes = 0

    def _give_weights(self, chunk: Chunk) -> None:
        """Each parameter of the chunk its latest weights, as a CPU tensor of its own."""
        with self.opened(chunk):
            # A frozen chunk's weights are its payload (bf16/fp16: it has no master).
            master = chunk.payload if chunk.frozen else chunk.master
            if chunk.sharded:
                try:
                    master = self.whole(chunk, master)
                except CollectiveError:
                    master = None  # another rank is gone: no whole weights to give
            for slot in chunk.slots:
                if master is None:
                    slot.param.data = torch.empty(0, dtype=chunk.dtype)
                    continue
                weights = master[slot.offset:slot.offset + slot.numel]
                slot.param.data = weights.to("cpu", chunk.dtype, copy=True).view(slot.shape)
                slot.param.grad = None
