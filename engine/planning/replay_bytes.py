"""ReplayBytes: the state every part of a replayed step shares, and its bytes, sampled.

A StepReplay (engine.planning.replay) is built as the engine's ChunkManager is: its parts,
one idea each, over one shared state, as engine.chunks.tiers is the manager's. This holds
that state (which chunks are on the device, which parameter is in which TensorState, the
chunks whose gradients are coming in or gone home) and counts the device's bytes: model
data, the non-model bytes the recording reports, and the simulated device's kept buffers
(engine.devices.buffer_pool), which every chunk copy and gradient buffer comes from.

A sample (StepRunner._sample) takes the peaks from those counts: the device's, the host
bytes of a simulated device, and, per interval of the trace the step records, the chunk
bytes held beside the non-model peak, part by part between gradient arrivals
(TracePoint.close): what the rules will keep room for at that point in later steps.
"""

from __future__ import annotations

from engine.chunks.state import TensorState
from engine.devices.buffer_pool import HeldBytes
from engine.devices.streams import spare_core
from engine.placement import rules
from engine.placement.policy import Policy
from engine.placement.trace import Trace
from engine.planning.data_parallel import DataParallel
from engine.planning.layout import ChunkBytes, DiskPayloads, Layout

__all__ = ["ReplayBytes"]

S = TensorState


class ReplayBytes:
    """The state every part of a StepReplay shares, and the counting of its bytes."""

    def __init__(
        self,
        lay: Layout,
        *,
        cost: ChunkBytes,
        policy: Policy,
        capacity: float,
        resident: set[int],
        trace: Trace | None = None,
        disk: DiskPayloads | None = None,
        grads_land_in_step: bool = False,
        simulated: bool = True,
    ) -> None:
        self.lay, self.policy, self.capacity, self.trace = lay, policy, capacity, trace
        self.disk = disk or DiskPayloads()
        self.ahead: dict[int, int] = {}  # chunk -> payload pieces read ahead, not yet used
        # Pieces read ahead and then not used (ChunkManager.release_all, land_grads): the
        # tier read them all the same. Chunk -> pieces.
        self.unused_reads: dict[int, int] = {}
        self.rules = rules.rules_for(policy, tracing=trace is None)
        self.cost = cost
        self.itemsize = cost.itemsize
        self.nbytes = [n * cost.itemsize for n in lay.numel]
        self.resident = resident
        # Sharded, only the shards are resident: the whole chunk is gathered for each use.
        self.on_device = set() if cost.sharded else set(resident)
        self.device_bytes = sum(cost.resident(lay.numel[c], lay.is_frozen(c)) for c in resident)
        self.peak = self.device_bytes
        # The simulated device's kept buffers (engine.devices.buffer_pool): every chunk
        # copy and gradient buffer comes from them, a resident chunk's copy for good,
        # within the room the activations' peak leaves (ChunkManager.apply_residency).
        self.pool = HeldBytes(max(0, capacity - (0 if trace is None else trace.non_model_peak)))
        for chunk in sorted(self.on_device):
            self.pool.take(self.nbytes[chunk])
        self.resident_buffers = self.pool.in_use
        self.buffer_moves: list[int] = []  # +bytes taken, -bytes given back, in order
        # Resident chunks' optimizer state: device bytes from outside the pool, for good.
        self.resident_state = self.device_bytes - self.pool.in_use
        self.beside_pool = self.resident_state  # the most device bytes beside the pool
        self.footprint = 0  # the most host bytes of the device at one moment (_note_footprint)
        # Host gradient landing places made as gradients land, freed by the update
        # (rules.grads_land_per_step), where the step is one micro-batch: bytes of those
        # made so far this step, and the two figures above with them.
        self.grads_land_in_step = grads_land_in_step
        self.simulated = simulated  # the device the step runs on (rules.keeps_grad)
        # Whether a module joining a run tries the fetches and reads ahead
        # (StepRunner._polling).
        self.runs_poll = rules.runs_poll(simulated=simulated, spare_core=spare_core(),
                                         payloads_on_disk=bool(self.disk.chunks))
        self.landed = self.beside_landed = self.footprint_landed = 0
        self.grads: set[int] = set()
        self.grad_bytes = 0
        # Chunks keeping autograd's gradients until they go home (rules.keeps_grad): bytes.
        self.kept_grads: dict[int, int] = {}
        # Kept gradients whose free the recording has yet to report (`non_model`): bytes.
        self.adopted = 0
        # Chunks whose gradients are coming in, resident or not, and their bytes: the
        # working set counts a gradient buffer for each (engine.placement.trace).
        self.opened: set[int] = set()
        self.opening_bytes = 0
        self.pending = [lay.trainable(c) for c in range(len(lay.params))]
        self.state: dict[str, TensorState] = {}  # parameter -> state past HOLD; absent: idle
        self.computing = [0] * len(lay.numel)  # parameters in COMPUTE per chunk
        self.busy: set[int] = set()  # chunks with a parameter in COMPUTE (Chunk.in_use)
        self.last_use: dict[int, int] = {}
        self.nm = 0
        self.pos = -1
        self.pinned = 0
        self.held = 0  # most chunk bytes held in this part of the interval (pinned, opening)
        self.part_peak = 0  # the non-model peak in it
        # The interval's parts before the latest gradient arrival, as (held, non-model peak)
        # each (TracePoint.close), and how many gradients arrived in it.
        self.parts: list[tuple[int, int]] = []
        self.arrived = 0
        self.evicting = False
        self.overrun = 0
        self.copied = 0  # payload bytes copied between host and device (fetches, gradients)
        # Of those, fetches ahead of use from host memory: on the simulated device its copy
        # thread runs them beside the step (engine.devices.streams.CopyingHostStreams).
        self.prefetched = 0
        self.fetched_ahead: set[int] = set()  # ChunkManager.fetched_ahead
        # Every payload copied to the device, as (chunk, from the master: its gradients are
        # home, so the weights are in the fp32 master): what the disk tier reads for them.
        self.fetches: list[tuple[int, bool]] = []
        self.stale: set[int] = set()  # on the device, but its gradients have gone home
        self.home: set[int] = set()  # gradients gone home (Chunk.holds_grads)
        self.got: set[str] = set()  # parameters whose gradient arrived
        # Tied parameters whose first uses' gradients arrived, not their last (the engine's
        # StepRunner._partial; engine.step.tied_uses).
        self.partial: set[str] = set()
        self.in_backward = False
        # A later micro-batch of the step (StepReplay.later_micro_batch): the gradients of
        # the first are home, or kept on the device by the resident chunks (`kept_resident`
        # bytes, there until the update), and later ones add up where they are.
        self.later = False
        self.kept_resident = 0
        # The latest point's phase, chunks and chunks its gradients go to (none in forward),
        # which a module of that phase may join (rules.joins_run); None after a recomputing
        # forward's point (StepRunner._run).
        self.joining: tuple[str, tuple[int, ...], tuple[int, ...]] | None = None
        self.recorded = Trace()  # what the engine's warm-up would record from this step
        # Sharded, the data-parallel side (engine.planning.sharded), built over the whole
        # replay once the rest is (StepReplay).
        self.sharding: DataParallel | None = None

    # bookkeeping

    def _set(self, param: str, state: TensorState | None) -> None:
        before = self.state.get(param)
        if (before == S.COMPUTE) != (state == S.COMPUTE):
            chunk = self.lay.chunk_of[param]
            self.computing[chunk] += 1 if state == S.COMPUTE else -1
            if self.computing[chunk]:
                self.busy.add(chunk)
            else:
                self.busy.discard(chunk)
        if state is None:
            self.state.pop(param, None)
        else:
            self.state[param] = state

    def _in_use(self, chunk: int) -> bool:
        return chunk in self.busy

    def _sample(self) -> None:
        if self.evicting:
            return
        if self.recorded.points:
            # What the rules keep room for (StepRunner._sample): the most chunk bytes held
            # beside the non-model peak to come, part by part (TracePoint.close).
            held = self.sharding.held_bytes if self.sharding is not None else 0
            self.held = max(self.held, self.pinned + self.opening_bytes + held)
            self.part_peak = max(self.part_peak, self.nm)
        self.peak = max(self.peak, self.device_bytes + self.nm)
        beside = self.device_bytes - self.pool.in_use + self.nm
        self.beside_pool = max(self.beside_pool, beside)
        self.beside_landed = max(self.beside_landed, beside + self.landed)
        self._note_footprint()

    def _note_footprint(self) -> None:
        """The pool keeps buffers only within its limit (HeldBytes: it holds at most the limit
        or what is in use, if more), so at any moment the device's host bytes are at most
        that beside the rest; the pool's peak and the most beside it come at other moments
        (the pool's at a full forward, the activations' in backward) and do not add up.
        `footprint_landed`: the same with the gradients landed on the host so far."""
        footprint = (max(self.pool.limit, self.pool.in_use) + self.device_bytes
                     - self.pool.in_use + self.nm)
        self.footprint = max(self.footprint, footprint)
        self.footprint_landed = max(self.footprint_landed, footprint + self.landed)

    @property
    def host_device_bytes(self) -> int:
        """The simulated device's host memory at its peak, once a step like this one has
        run before it: then the pool holds every buffer this step takes from the start, and
        the peak is the pool beside the most of everything else (on CUDA: no such bytes)."""
        return min(self.pool.peak + self.beside_pool, self.footprint)

    @property
    def host_step_bytes(self) -> int:
        """`host_device_bytes` with the host gradient landing places made by its moment,
        where they are made within the step (`grads_land_in_step`): what it adds to the
        chunks' host bytes between steps, at its peak."""
        return min(self.pool.peak + self.beside_landed, self.footprint_landed)

    @property
    def host_device_between_steps(self) -> int:
        """The simulated device's host memory between steps and through the update: its
        buffers, all kept by then, and the resident chunks' optimizer state."""
        return self.pool.peak + self.resident_state

    def take_buffer(self, chunk: int) -> None:
        """A chunk's device copy or gradient buffer comes in (from the pool)."""
        self.device_bytes += self.nbytes[chunk]
        self.pool.take(self.nbytes[chunk])
        self.buffer_moves.append(self.nbytes[chunk])
        self._note_footprint()

    def give_buffer(self, chunk: int) -> None:
        self.device_bytes -= self.nbytes[chunk]
        self.pool.give(self.nbytes[chunk])
        self.buffer_moves.append(-self.nbytes[chunk])

    # the intervals of the recorded trace (TracePoint.close)

    def _close_point(self) -> None:
        """The interval that ends here, as its samples left it (closed once, not per sample)."""
        if self.recorded.points:
            self.recorded.points[-1].close([*self.parts, (self.held, self.part_peak)])

    def _arrival(self) -> None:
        """StepRunner._on_arrival: the interval's next part begins."""
        self._sample()
        self.parts.append((self.held, self.part_peak))
        self.held = self.part_peak = 0
        self.arrived += 1
        if self.trace is not None:
            self.trace.arrived_at(self.pos, self.arrived)
        self._sample()
