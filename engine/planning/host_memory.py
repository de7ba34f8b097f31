"""The host's side of a plan: where the chunks' parts live and what the process holds.

Under a host budget (EngineConfig.host_budget) the chunk bytes on the host and the disk
tier's I/O buffers stay within it and the rest goes to the scratch folder, as the engine's
placement rules decide (engine.planning.disk replays them). The training process's
resident bytes are the runtime's, the chunks' while the engine builds them or during a step
and, on the simulated device, the device's own. Data parallel, every figure is one rank's
(its shards, its scratch folder), and the ranks share the machine's memory and disk.
"""

from __future__ import annotations

from pathlib import Path

from engine.config import format_size
from engine.devices.cuda import DEFAULT_STAGING
from engine.devices.disk import space_needed
from engine.placement import rules
from engine.planning import disk
from engine.planning.layout import ChunkBytes, DiskPayloads, Layout

__all__ = ["CUDA_CONTEXT", "PINNED_STAGING", "RUNTIME_BYTES", "HostMemory"]

# Resident bytes of a training process before any model: Python, torch, transformers and the
# autograd engine. Measured (VmHWM) on Linux, torch 2.13: 331 MiB right after the imports,
# about 400 MiB after a few steps of `tiny`, whose model and activations are ~25 MB of that.
RUNTIME_BYTES = 370 * 2**20
# What a process that uses CUDA adds to its host memory (driver, context, kernels). Not
# measured here (no GPU on the machine this was calibrated on); a typical figure.
CUDA_CONTEXT = 500 * 2**20
# Page-locked host memory a CUDA device holds for the whole run: its staging ring, through
# which every copy streams (engine.devices.transfers), whatever the model's size.
PINNED_STAGING = DEFAULT_STAGING.buffers * DEFAULT_STAGING.buffer_bytes


class HostMemory:
    """The host memory and scratch folder of one layout's chunks, for any resident set."""

    def __init__(
        self,
        lay: Layout,
        *,
        cost: ChunkBytes,
        host_mem: int,
        simulated: bool,
        host_budget: int | None = None,
        disk_dir: Path | None = None,
        grad_accum: int = 1,
    ) -> None:
        self.lay, self.cost = lay, cost
        self.host_mem, self.simulated = host_mem, simulated
        self.host_budget, self.disk_dir = host_budget, disk_dir
        self.grad_accum = grad_accum
        self.ranks = cost.world  # sharded: every figure is one rank's, its chunks' shards
        homes = [cost.home(n) for n in lay.numel]
        frozen = [lay.is_frozen(c) for c in range(len(homes))]
        self.disk_piece = disk.piece(homes, cost.itemsize, host_budget, frozen)
        self.disk_costs = disk.chunk_costs(homes, cost.itemsize, self.disk_piece, frozen)
        self._placements: dict[frozenset[int], rules.DiskPlacement] = {}
        # The engine places every chunk on the host first (ChunkManager.use_host_budget):
        # a budget too small for that is refused before anything runs, whatever the policy
        # (rules.HostBudgetTooSmall), and so is a scratch folder without room for it.
        worst = self.placement(set())
        self.disk_needed = worst.disk_bytes if worst.state else 0
        # The engine opens a disk tier where that placement needs one (use_host_budget).
        self.grads_per_step = rules.grads_land_per_step(
            aliased=cost.aliased, sharded=cost.sharded, disk_tier=bool(worst.state))
        # Then a step's first micro-batch starts backward with none of them on the host;
        # a later one starts with all that the first made (the update frees them).
        self.grads_land_in_step = self.grads_per_step and grad_accum == 1
        self.disk_free = (disk.free_space(disk_dir) if self.disk_needed and disk_dir is not None
                          else None)
        self.runtime = RUNTIME_BYTES + (0 if simulated else CUDA_CONTEXT + PINNED_STAGING)

    def placement(self, resident: set[int]) -> rules.DiskPlacement:
        """Where the parts of the chunks not in `resident` are under the host budget."""
        key = frozenset(resident)
        if key not in self._placements:
            self._placements[key] = disk.placement(self.disk_costs, key, self.host_budget)
        return self._placements[key]

    def disk_payloads(self, resident: set[int]) -> DiskPayloads:
        """The payloads on disk when `resident` stay on the device, as the read-ahead sees
        them: half the payload buffers may hold pieces read ahead (Spill.read_ahead)."""
        where = self.placement(resident)
        slots = rules.payload_buffers(where.aliased) // 2 if where.payload else 0
        return DiskPayloads(where.payload, [c.pieces for c in self.disk_costs], slots)

    def host_model(self, resident: set[int]) -> int:
        """Chunk bytes on the host between steps (those on disk not counted)."""
        return self.placement(resident).host_bytes - self.landed(resident)

    def landed(self, resident: set[int]) -> int:
        """Host bytes of the non-resident chunks' gradient landing places where they exist
        only from the gradients' landing to the update (`grads_per_step`), else 0."""
        return sum(self._landed(c) for c in range(len(self.lay.numel)) if c not in resident)

    def _landed(self, chunk: int) -> int:
        """Chunk `chunk`'s share of `landed`."""
        if not self.grads_per_step:
            return 0
        return self.cost.landed(self.lay.numel[chunk], self.lay.is_frozen(chunk))

    def _landed_in_step(self, resident: set[int]) -> int:
        """`landed` where a step's backward starts without them (`grads_land_in_step`)."""
        return self.landed(resident) if self.grads_land_in_step else 0

    def built(self, placed_first: frozenset[int] = frozenset()) -> int:
        """Host bytes while the engine builds, the runtime aside: every chunk's host state
        at once without a host budget, whatever the policy (resident chunks move to the
        device afterwards).

        The model is made on the meta device and each chunk filled from its weights' source
        (engine.models.zoo.meta_build), one tensor read at a time (a fresh module's, in
        fp32): the peak is the chunk state kept so far and the chunk being filled, with one
        tensor beside its home values (a trainable chunk's fp32 master, a frozen chunk's
        payload). Under a host budget the engine fills them last used first and sends each
        one's parts where the placement with nothing resident puts them before the next
        (ChunkManager.use_host_budget): at most the host budget, one chunk and one tensor.
        The chunks the policy places on the device before any trace (`placed_first`: under
        cuda every one) go there as each is filled and keep nothing on the host, nor need
        I/O buffers; on the simulated device the device is this host's memory, so they are
        counted as the rest. Sharded, the same with this rank's shards (the tensor read is
        whole)."""
        lay = self.lay
        # Filling a chunk (engine.chunks.packing.fill): its home values and each tensor read
        # in turn, then the rest of its state once the last tensor is gone.
        filling = [max(self._home_values(c) + 4 * max((lay.sizes[p] for p in ps), default=0),
                       self._host(c))
                   for c, ps in enumerate(lay.params)]
        if self.host_budget is None:  # filled in use order, every chunk kept
            kept = peak = 0
            for index in range(len(lay.numel)):
                peak = max(peak, kept + filling[index])
                kept += self._host(index)
            return max(peak, kept)
        away = set() if self.simulated else placed_first
        where = self.placement(away)
        kept = peak = 0
        for index in reversed(range(len(lay.numel))):
            peak = max(peak, kept + filling[index])
            if index in away:
                continue
            level, cost = where.level(index), self.disk_costs[index]
            kept += (self._host(index), cost.host_payload, 0)[level]
        return max(peak, kept) + where.buffer_bytes

    def _host(self, chunk: int) -> int:
        """Host bytes of chunk `chunk` at home there as the engine builds it (ChunkBytes.host;
        without its gradients' landing place where that is made as they land)."""
        host = self.cost.host(self.lay.numel[chunk], self.lay.is_frozen(chunk))
        return host - self._landed(chunk)

    def _home_values(self, chunk: int) -> int:
        """Bytes of the tensor a chunk is filled into: its fp32 master, or a frozen chunk's
        payload in the run's dtype."""
        itemsize = self.cost.itemsize if self.lay.is_frozen(chunk) else 4
        return itemsize * self.cost.home(self.lay.numel[chunk])

    def during(self, resident: set[int], device: int, between: int = 0) -> int:
        """Host bytes during a steady step, the runtime aside.

        The host holds the non-resident chunks' parts that are not on disk and the disk
        tier's I/O buffers and, when the device is simulated, the device's bytes and the
        allocator's slack too (`device`), of which its kept buffers (engine.devices.
        buffer_pool) and resident chunks' state (`between`) stay through the update. The
        update of a chunk in a 16-bit precision reads its gradients as fp32, one chunk at
        a time. Where the gradients' host landing places are made as they land within the
        step's one micro-batch (`grads_land_in_step`), `device` counts those made by its
        moment, and all of them are there at the update; with several micro-batches, all of
        them are there from the second one's start.
        """
        chunks = self.placement(resident).host_total
        # Only chunks with gradients are updated: a frozen one never is.
        largest = self.cost.home(max((n for c, n in enumerate(self.lay.numel)
                                      if not self.lay.is_frozen(c)), default=0))
        update = 0 if self.cost.aliased else 4 * largest
        during = chunks + update
        if self.simulated:
            during = max(during + between, chunks - self._landed_in_step(resident) + device)
        return during

    def peak(self, resident: set[int], device: int, between: int = 0,
             placed_first: frozenset[int] = frozenset()) -> int:
        """Resident bytes of the training process (sharded: of one rank) at its peak;
        `device` is the simulated device's host bytes at the step's peak with the
        allocator's slack, `between` what of it stays through the update, `placed_first`
        the chunks the policy builds onto the device (`built`)."""
        return self.runtime + max(self.built(placed_first),
                                  self.during(resident, device, between))

    def fits(self, host_peak: int) -> bool:
        """Whether the machine holds the peak of every rank at once (they share it)."""
        return self.ranks * host_peak <= self.host_mem

    def disk_traffic(self, resident: set[int], fetches: list[tuple[int, bool]],
                     updated: set[int], unused: dict[int, int]) -> disk.DiskTraffic:
        """What a step reads and writes in the scratch folder (StepReplay.fetches, .home,
        .unused_reads)."""
        return disk.traffic(self.placement(resident), self.disk_costs,
                            [self.cost.home(n) for n in self.lay.numel],
                            fetches=fetches, updated=updated, unused=unused,
                            piece=self.disk_piece, micro_batches=self.grad_accum)

    def disk_reason(self, placed_first: set[int]) -> str:
        """Why the scratch folder cannot take what the host budget sends it, or "" (also
        where the chunks a policy places on the device before any trace, `placed_first`,
        leave nothing for the disk: under cuda the engine opens no disk tier, as long as
        the policy stays). Sharded, every rank on the machine has a folder of its own
        there."""
        if self.disk_free is None or not self.placement(placed_first).state:
            return ""
        if problem := disk.folder_problem(self.disk_dir):
            return problem
        needed = space_needed(self.disk_needed)  # the engine's check: its probe counted
        if self.ranks * needed <= self.disk_free:
            return ""
        need = format_size(needed)
        if self.cost.sharded:
            need = f"{format_size(self.ranks * needed)} ({need} per rank)"
        return (
            f"the host budget {format_size(self.host_budget)} needs {need} on disk, but "
            f"{self.disk_dir} has {format_size(self.disk_free)} free"
        )

    def parts(self, resident: set[int], device: int, between: int = 0,
              placed_first: frozenset[int] = frozenset()) -> str:
        """The parts of the host peak, with their sizes, for a reason that it is too much
        (`device`, `between`, `placed_first`: as `peak`'s)."""
        built = self.built(placed_first)
        if built > self.during(resident, device, between):
            holds = ("the parts kept so far, one chunk and one tensor read"
                     if self.host_budget is not None else "all of them at once")
            return (f"building the chunks holds {holds}, "
                    f"{format_size(built)} + runtime {format_size(self.runtime)}")
        where = self.placement(resident)
        parts = [f"chunks {format_size(where.host_bytes - self._landed_in_step(resident))}"]
        if where.buffer_bytes:
            parts.append(f"disk I/O buffers {format_size(where.buffer_bytes)}")
        if self.simulated:
            landed = (", with the gradients landed on the host by its peak"
                      if self.grads_land_in_step else "")
            parts.append(f"simulated device {format_size(device)} (its buffers kept for "
                         f"reuse and the allocator's slack included{landed})")
        parts.append(f"runtime {format_size(self.runtime)}")
        return " + ".join(parts)
