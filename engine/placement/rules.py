"""The placement rules: pure functions over chunk indices and byte counts.

Which chunks stay resident, which chunk is evicted, what `cpu` releases before a module
runs, how much room the trace's forecast keeps free, what a prefetch may bring in (data
parallel: what a rank offers to gather ahead of use), whether a budget can run a policy;
and for the host: which parts of which chunks go to the scratch folder under a host budget,
and which payloads are read from it ahead of use. The chunk manager (engine.chunks.manager)
carries these decisions out on tensors and the planner's replay (engine.planning.replay) on
counters, so the two cannot drift apart: there is no second copy of any rule.

A policy is one class with the rules that differ between policies; a new policy is one new
class (and a name in engine.placement.policy.Policy).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from engine.placement.policy import Policy
from engine.placement.trace import Trace
from engine.sizes import format_size


class BudgetTooSmall(ValueError):
    """The device budget cannot hold the minimum working set; says what it needs."""


# --- per-policy rules --------------------------------------------------------------------


class CudaRules:
    """All model data, optimizer state included, lives on the device.

    Sharded (data parallel) that is each rank's shards; the whole chunks gathered from them
    for each use are device copies like auto's, which come and go: they make room for the
    activations to come as auto's do. Unsharded there is no such copy to evict, and the
    budget check keeps the forecast room free beside the resident chunks."""

    policy = Policy.CUDA

    @staticmethod
    def resident(costs: Sequence[int], room: float) -> set[int]:
        return set(range(len(costs)))

    @staticmethod
    def forecast(trace: Trace | None, pos: int, non_model_now: int) -> int:
        return AutoRules.forecast(trace, pos, non_model_now)

    @staticmethod
    def release_before_use(on_device: Iterable[int], needed: Iterable[int],
                           ahead: Iterable[int] = ()) -> list[int]:
        return []


class AutoRules:
    """Chunks stay on the device while there is room; the margin makes some resident."""

    policy = Policy.AUTO

    @staticmethod
    def resident(costs: Sequence[int], room: float) -> set[int]:
        """Fill `room` with whole chunks, in use order, as long as each fits."""
        chosen: set[int] = set()
        for chunk, cost in enumerate(costs):
            if cost <= room:
                chosen.add(chunk)
                room -= cost
        return chosen

    @staticmethod
    def forecast(trace: Trace | None, pos: int, non_model_now: int) -> int:
        """Non-model bytes the trace says will still come before the next module."""
        if trace is None:
            return 0
        return max(0, trace.non_model_ahead(pos) - non_model_now)

    @staticmethod
    def release_before_use(on_device: Iterable[int], needed: Iterable[int],
                           ahead: Iterable[int] = ()) -> list[int]:
        return []


class CpuRules(AutoRules):
    """Chunks are copied in right before use and dropped right after."""

    policy = Policy.CPU

    @staticmethod
    def release_before_use(on_device: Iterable[int], needed: Iterable[int],
                           ahead: Iterable[int] = ()) -> list[int]:
        """Anything the module about to run does not need goes now, but a copy fetched
        ahead for a module still to come (`ahead`)."""
        keep = {*needed, *ahead}
        return [c for c in on_device if c not in keep]


RULES: dict[Policy, type[CudaRules] | type[AutoRules] | type[CpuRules]] = {
    Policy.CUDA: CudaRules, Policy.AUTO: AutoRules, Policy.CPU: CpuRules}


def rules_for(policy: Policy | str, *, tracing: bool = False
              ) -> type[CudaRules] | type[AutoRules] | type[CpuRules]:
    """The rules of `policy`; `tracing`: those of a step being traced (the first, and the
    first of each new batch shape). With no forecast of the activations to come, auto
    keeps nothing idle on the device then (cpu's rules): an op that found the device full
    of idle chunks would fail on a GPU, and evicting them after it cannot undo that. The
    step is then the minimum working set's, which the budget holds. So does cuda's with
    sharded chunks (its gathered copies are the idle ones; a resident chunk is never
    released, so unsharded nothing changes), beside its resident shards."""
    chosen = RULES[Policy.parse(policy)]
    return CpuRules if tracing and chosen is not CpuRules else chosen


# --- rules every policy shares -----------------------------------------------------------


def resident_cost(numel: int, itemsize: int, *, frozen: bool = False) -> int:
    """Device bytes a chunk needs to be resident: payload, room for its gradients, fp32
    master and two moments (in fp32 the payload is the master); a frozen chunk (no
    gradient, no optimizer state) its payload alone."""
    if frozen:
        return itemsize * numel
    master = 0 if itemsize == 4 else 4
    return (2 * itemsize + master + 8) * numel


def margin_room(capacity: int, working_set: int, margin_ratio: float) -> float:
    """Bytes the margin pays for: `margin_ratio` of what the traced peak leaves spare."""
    return margin_ratio * max(0, capacity - working_set)


def resident_chunks(policy: Policy, costs: Sequence[int], *, trace: Trace | None,
                    capacity: int, margin_ratio: float) -> set[int]:
    """The chunks whose payload and optimizer state live on the device.

    cuda: all of them. Otherwise `margin_ratio` of the margin (capacity minus the traced
    peak of a step that keeps nothing resident), filled in use order. Unlike a one-time
    choice at the first step, the engine asks again whenever the policy, margin or budget
    changes, and after each new trace.
    """
    rules = rules_for(policy)
    if rules is CudaRules:
        return rules.resident(costs, 0)
    if trace is None or margin_ratio <= 0:
        return set()
    return rules.resident(costs, margin_room(capacity, trace.working_set, margin_ratio))


def choose_victim(idle: Iterable[int], *, pos: int, trace: Trace | None,
                  last_use: dict[int, int]) -> int | None:
    """The idle chunk to evict: the one whose next use is farthest away (Belady's choice,
    from the warm-up trace); before there is a trace, the least recently used one."""
    idle = list(idle)
    if not idle:
        return None
    if trace is not None:
        return max(idle, key=lambda c: (trace.next_use(c, pos), c))
    return min(idle, key=lambda c: last_use.get(c, -1))


def evictions(need: int, free: int, idle: Iterable[int], nbytes: Callable[[int], int], *,
              pos: int, trace: Trace | None, last_use: dict[int, int]
              ) -> tuple[list[int], int]:
    """Victims, in eviction order, until `need` bytes fit in `free`; and the bytes still
    short when even every idle chunk is not enough (0 when it fits)."""
    candidates = list(idle)
    victims: list[int] = []
    while free < need:
        victim = choose_victim(candidates, pos=pos, trace=trace, last_use=last_use)
        if victim is None:
            return victims, need - free
        candidates.remove(victim)
        victims.append(victim)
        free += nbytes(victim)
    return victims, 0


def keeps_grad(params: int, *, resident: bool, sharded: bool, payload_on_disk: bool,
               simulated: bool) -> bool:
    """Whether a non-resident chunk keeps autograd's gradients on the device until they go
    home, each copied there as it is, rather than gathering them in a gradient buffer that
    goes home in one copy (a resident chunk keeps its own until the update, always).

    Where the chunk holds `params` == 1, its gradient is the chunk's whole, so a buffer
    would only be a second copy of it beside the first (a tied embedding's: at the head's
    backward, the start of backward's peak). On the `simulated` device, any chunk: a copy
    there is a memcpy at the same speed whatever its size, so the buffer would be a second
    copy of every gradient (a whole model's bytes a step) for nothing; on a GPU one copy of
    the buffer is what its copy engine does best, where a chunk's dozen parameters would
    be as many small copies. Kept gradients never take more device bytes than the buffer
    would (they add up to the chunk's parameters, the buffer is the whole chunk).
    Not sharded (the ranks reduce whole buffers) nor with its payload on disk (gradients
    land in I/O buffers)."""
    return ((params == 1 or simulated) and not resident and not sharded
            and not payload_on_disk)


def grads_land_per_step(*, aliased: bool, sharded: bool, disk_tier: bool) -> bool:
    """Whether a host chunk's fp32 gradient landing place (Chunk.host_grad) exists only from
    its gradients' landing to their update, not across steps: at the start of backward,
    the most activations and no gradient yet home, the host holds none of them (478 MiB on
    opt-125m), which is how its peak stays near plain PyTorch's, which frees its gradients
    at `zero_grad`. Not sharded (the reduction's landing place is the shard's home, placed
    with it) nor with a disk tier (the host budget's placement moves each part as a whole,
    this one included); in bf16/fp16 the gradients land in the payload, which stays."""
    return aliased and not sharded and not disk_tier


def joins_run(needed: Collection, grads_to: Collection, run_needed: Collection,
              run_grads_to: Collection) -> bool:
    """Whether a module joins the point just before it, of its own phase, rather than
    having one of its own (a *run*): it needs the chunks that point brought in
    (`run_needed`), no more and no fewer, and, in backward, those its gradients go to are
    among that point's (`run_grads_to`; a forward module's are empty). So the modules of a
    layer, whose parameters share a chunk, have one forward and one backward point, the
    first of them to run. What a point of its own would do is done already: the chunks are
    in, and the room kept at the point is for the peak of the interval, which the trace
    measured over the whole run. A module that needs fewer has its point: there the cpu
    policy lets the others go (CpuRules.release_before_use), which a run would keep to its
    end. Not where chunks are sharded: the ranks agree on gathers at every point."""
    return (len(needed) == len(run_needed) and all(c in run_needed for c in needed)
            and all(c in run_grads_to for c in grads_to))


def runs_poll(*, simulated: bool, spare_core: bool, payloads_on_disk: bool) -> bool:
    """Whether a module that joins a run still tries the fetches and reads ahead its own
    point would have (and, in backward, keeps its identity node). Where a copy runs beside
    the step (CUDA's copy stream; the simulated device's copy thread, where torch leaves a
    core spare: engine.devices.streams.spare_core; reads from disk), room freed mid-run
    (in backward the activations go as it runs) lets a fetch ahead start sooner. Where
    every copy is in line, a fetch ahead costs the same at the next run's point, and the
    node and its hook are what a module costs: 2 points of a small OPT's step under cpu at
    two threads (benchmarks/README.md)."""
    return not simulated or spare_core or payloads_on_disk


# How many modules ahead a prefetch looks for a chunk to bring in.
PREFETCH_HORIZON = 24


def prefetch_target(trace: Trace, pos: int, present: Callable[[int], bool]) -> int | None:
    """The point a prefetch at point `pos` serves: the first after it, within
    PREFETCH_HORIZON, with a chunk that is not `present` on the device. The modules in
    between bring nothing in, so its copy runs beside all of them: the next module alone
    is too short a cover (a layer's last, small module, where the next layer's chunk is
    needed at its first). None when there is no such point."""
    for target in range(pos + 1, min(len(trace.points), pos + 1 + PREFETCH_HORIZON)):
        if not all(present(c) for c in trace.points[target].chunks):
            return target
    return None


def opening_between(trace: Trace, pos: int, target: int) -> list[int]:
    """Chunks whose gradients may arrive from point `pos` until point `target` (from the
    backward's first point on): gradient buffers that may open meanwhile."""
    return list(dict.fromkeys(c for i in range(max(pos, trace.backward_from), target)
                              for c in trace.points[i].grad_chunks))


def prefetch_forecast(trace: Trace, pos: int, non_model_now: int, grads_to_open: int,
                      target: int | None = None) -> int:
    """Room a prefetch leaves free until point `target` (the next module's: pos + 1): the
    trace's non-model growth until then and, in backward, the gradient buffers that may
    open meanwhile."""
    peak = max([trace.non_model_ahead(pos)]
               + [trace.points[i].non_model_peak for i in range(pos + 1, target or pos + 1)])
    return max(0, peak - non_model_now) + grads_to_open


def prefetches(upcoming: Iterable[int], *, skip: Callable[[int], bool], free: int,
               nbytes: Callable[[int], int]) -> list[int]:
    """The target module's chunks (`prefetch_target`) to copy in ahead of use, in order,
    while each fits in `free`.

    A prefetch never evicts: it moves no byte the step would not move anyway. It stops at
    the first chunk that does not fit, so the order of copies is the order of use.
    """
    chosen = []
    for chunk in upcoming:
        if skip(chunk):
            continue
        if free < nbytes(chunk):
            break
        chosen.append(chunk)
        free -= nbytes(chunk)
    return chosen


def gathers_ahead(upcoming: Iterable[int], *, skip: Callable[[int], bool],
                  on_device: Callable[[int], bool], free: int,
                  nbytes: Callable[[int], int]) -> list[int]:
    """Data parallel: the next module's sharded chunks this rank can have gathered ahead of
    use (engine.chunks.sharding), to offer at the module boundary; the ranks gather those
    that every rank offers and some rank lacks.

    The prefetch rule (`prefetches`), with `free` the room left once the running module's
    own chunks are in: in order, while each fits, never evicting. A chunk this rank has on
    the device needs no room (it takes part in the gather where it is), so it is offered
    wherever it comes in the order.
    """
    upcoming = [c for c in upcoming if not skip(c)]
    fits = set(prefetches(upcoming, skip=on_device, free=free, nbytes=nbytes))
    return [c for c in upcoming if on_device(c) or c in fits]


def minimum_working_set(trace: Trace | None, module_bytes: Iterable[int]) -> int:
    """Least device bytes a step needs under any placement.

    With a trace: its measured peak of chunks in use, gradient buffers and activations.
    Before the first step: the chunks of the largest module (`module_bytes`), with their
    gradient buffers.
    """
    if trace is not None:
        return trace.working_set
    return max((2 * b for b in module_bytes), default=0)


def check_budget(budget: int, policy: Policy, *, trace: Trace | None,
                 module_bytes: Iterable[int], resident_costs: Sequence[int],
                 sharded: bool = False) -> None:
    """Raise BudgetTooSmall, with the numbers, when `budget` cannot run `policy`.

    `sharded` (data parallel): the resident costs are shards, and the chunks gathered whole
    for each use and their gradient buffers (the working set beside the activations; before
    the first step, the largest module's) come on top, under cuda too."""
    working_set = minimum_working_set(trace, module_bytes)
    if budget < working_set:
        raise BudgetTooSmall(
            f"device budget {format_size(budget)} is below the minimum working set "
            f"{format_size(working_set)} (largest chunks in use at once"
            f"{', plus activations' if trace else ''})")
    if policy == Policy.CUDA:
        activations = trace.non_model_peak if trace else 0
        model = sum(resident_costs)
        if sharded:
            model += working_set - activations
        need = model + activations
        if budget < need:
            raise BudgetTooSmall(
                f"policy cuda needs {format_size(need)} on the device (model data "
                f"{format_size(model)} + activations {format_size(need - model)}) but the "
                f"budget is {format_size(budget)}; use policy auto or cpu")


# --- the disk tier -------------------------------------------------------------------------


class HostBudgetTooSmall(ValueError):
    """The host budget cannot hold even what must stay on the host with everything that may
    go to disk on disk; says what it needs."""


STATE_BUFFERS = 3  # the update reads piece k+1's state while updating k and writing k-1
# Elements per piece: the unit of disk I/O. A chunk larger than this is read, updated and
# written a piece at a time (AdamW is elementwise, so that is the same arithmetic), which
# keeps the I/O buffers the size of a piece however large the largest chunk (opt-125m's
# embedding alone is 38.6M elements). 4M elements: 32 MiB of fp32 moments per state piece,
# long enough for a disk to stream at full speed.
DISK_PIECE = 2**22


# Parameters sit in chunks at multiples of this many elements (64 bytes in fp32:
# engine.chunks.chunk), and disk pieces are cut at multiples of it too. A vectorised
# kernel rounds its vector body and its scalar tail differently, so a parameter split
# across two pieces is updated bit for bit as it is whole only where each part starts
# where it would in the whole.
ELEMENT_ALIGN = 32


# The smallest piece the I/O buffers shrink to for a model whose pieces at DISK_PIECE would
# not leave the host budget room (`disk_piece`): 16K elements, 128 KiB of fp32 moments per
# state piece, still 32 of the disk's blocks per read and write.
MIN_DISK_PIECE = 2**14


def disk_piece(numel: Sequence[int], itemsize: int, *, host_budget: int | None,
               block: int, frozen: Sequence[bool] = ()) -> int:
    """Elements per piece of disk I/O for chunks of `numel` elements: DISK_PIECE, or, when
    the I/O buffers of pieces that size would not leave the host budget room for the chunk
    bytes the host must keep (a small model, whose largest chunk's pieces are a large part
    of it), the largest half of it down to MIN_DISK_PIECE that does. With all chunks on the
    host (the most any placement sends to disk). None of them fitting, the smallest: what
    HostBudgetTooSmall then says is the least the host can do with. `frozen`: which chunks
    are frozen (none if empty)."""
    piece = DISK_PIECE
    frozen = list(frozen) or [False] * len(numel)
    while True:
        costs = [disk_cost(n, itemsize, block, piece, frozen=f)
                 for n, f in zip(numel, frozen, strict=True)]
        try:
            disk_placement(costs, on_host=range(len(costs)), host_budget=host_budget,
                           block=block)
            return piece
        except HostBudgetTooSmall:
            if piece // 2 < MIN_DISK_PIECE:
                return piece
            piece //= 2


def payload_buffers(aliased: bool) -> int:
    """Payload-piece-sized I/O buffers when payloads are on disk. An update holds one per
    stage (read, update, write), and in fp32 a second one for the gradients (the payload is
    the master there, so they have their own region); in the forward and backward, reads
    ahead take at most half of them, so that a fetch and gradients landing always find one."""
    return 2 * STATE_BUFFERS if aliased else STATE_BUFFERS + 1


@dataclass(frozen=True)
class DiskCost:
    """A non-resident chunk's bytes by where they can go: what moving them to disk frees
    on the host, and what they take there, piece by piece (each piece of each region
    rounded up to whole disk blocks; a piece is also the size of the I/O buffer that
    carries it)."""

    host_state: int  # optimizer state: bf16/fp16 the fp32 master and two moments; fp32 moments
    host_payload: int  # the rest: the payload (fp32: it is the master) and fp32's gradients
    pieces: int  # how many pieces the chunk's regions are cut into
    state_piece: int
    payload_piece: int
    grad_piece: int  # fp32 only: gradients beside the payload, which is the master

    @property
    def aliased(self) -> bool:
        return self.grad_piece > 0

    @property
    def state_region(self) -> int:
        return self.pieces * self.state_piece

    @property
    def payload_region(self) -> int:
        """The payload's region and, in fp32, the gradients' beside it."""
        return self.pieces * (self.payload_piece + self.grad_piece)


def _blocks(nbytes: int, block: int) -> int:
    return -(-nbytes // block) * block


def piece_elements(numel: int, piece: int | None = None) -> int:
    """Elements of each piece of a chunk of `numel` elements, with pieces of at most
    `piece` (default DISK_PIECE): as few as fit, of one size (the last may be shorter),
    cut at multiples of ELEMENT_ALIGN. A chunk a little over a piece was a whole piece and
    a small tail, which the update's walk overlaps badly: the Llama-shaped model's chunks
    of 4.86M elements at pieces of 4.19M waited 1.5-2.0 s a step for the disk, as two
    pieces of 2.43M 1.07-1.11 s (benchmarks/README.md)."""
    most = min(numel, piece or DISK_PIECE)
    if most >= numel:
        return numel
    even = -(-numel // -(-numel // most))
    size = -(-even // ELEMENT_ALIGN) * ELEMENT_ALIGN
    return min(size, max(ELEMENT_ALIGN, most // ELEMENT_ALIGN * ELEMENT_ALIGN))


def piece_spans(numel: int, piece: int | None = None) -> list[tuple[int, int]]:
    """(lo, hi) of each piece of a chunk of `numel` elements (piece_elements)."""
    step = piece_elements(numel, piece)
    return [(lo, min(lo + step, numel)) for lo in range(0, numel, step)]


def disk_cost(numel: int, itemsize: int, block: int, piece: int | None = None, *,
              frozen: bool = False) -> DiskCost:
    """DiskCost of a chunk of `numel` elements of `itemsize` bytes, for disk blocks of
    `block` bytes and pieces of `piece` elements (default DISK_PIECE). The host side
    matches chunk.host_bytes_per_parameter: 16 B/param in fp32 (payload = master,
    gradients, moments), 14 in bf16/fp16; a frozen chunk its payload alone (no state to
    move: at level 1 nothing of it goes)."""
    elements = piece_elements(numel, piece)
    pieces = -(-numel // elements)
    fp32 = _blocks(4 * elements, block)
    if frozen:
        return DiskCost(host_state=0, host_payload=itemsize * numel, pieces=pieces,
                        state_piece=0, payload_piece=_blocks(itemsize * elements, block),
                        grad_piece=0)
    if itemsize == 4:
        return DiskCost(host_state=8 * numel, host_payload=8 * numel, pieces=pieces,
                        state_piece=2 * fp32, payload_piece=fp32, grad_piece=fp32)
    return DiskCost(host_state=12 * numel, host_payload=itemsize * numel, pieces=pieces,
                    state_piece=3 * fp32, payload_piece=_blocks(itemsize * elements, block),
                    grad_piece=0)


@dataclass(frozen=True)
class DiskPlacement:
    """Which chunks have which parts on disk, and the bytes that leaves where."""

    state: frozenset[int] = frozenset()  # optimizer state on disk
    payload: frozenset[int] = frozenset()  # payload on disk too (always a subset of state)
    host_bytes: int = 0  # chunk bytes the host keeps (non-resident chunks)
    disk_bytes: int = 0  # bytes in the scratch folder
    state_buffer: int = 0  # bytes of one state I/O buffer (the largest state piece on disk)
    payload_buffer: int = 0  # bytes of one payload I/O buffer (0: no payload on disk)
    aliased: bool = False
    block: int = 0  # each buffer is allocated one block larger, to align it

    @property
    def buffers(self) -> dict[str, tuple[int, int]]:
        """I/O buffer pools: name -> (count, bytes each)."""
        pools = {}
        if self.state_buffer:
            pools["state"] = (STATE_BUFFERS, self.state_buffer)
        if self.payload_buffer:
            pools["payload"] = (payload_buffers(self.aliased), self.payload_buffer)
        return pools

    @property
    def buffer_bytes(self) -> int:
        """Host bytes of the I/O buffers, alignment slack included."""
        return sum(count * (nbytes + self.block) for count, nbytes in self.buffers.values())

    @property
    def host_total(self) -> int:
        """What the host budget must hold: chunk bytes and I/O buffers."""
        return self.host_bytes + self.buffer_bytes

    def level(self, chunk: int) -> int:
        """0: all on the host; 1: optimizer state on disk; 2: payload on disk too."""
        return 2 if chunk in self.payload else 1 if chunk in self.state else 0


def disk_placement(costs: Sequence[DiskCost], *, on_host: Iterable[int],
                   host_budget: int | None, block: int) -> DiskPlacement:
    """What of the non-resident chunks (`on_host`) goes to the scratch folder so that the
    host budget holds their remaining bytes plus the I/O buffers: nothing when it holds
    them all (or there is no budget); else, one chunk at a time, first the optimizer state
    of chunks (needed only for their update), and only once every chunk's state is on disk,
    payloads (needed before each use), as few as will do.

    Chunks go in reverse first-use order (chunks are numbered in the order the forward
    first uses them): the last used in the forward first. Its payload is read back latest,
    so the read-ahead has the most forward compute to hide behind; and since the update
    walks chunks in index order, the chunks kept on the host are updated first, while the
    state of the first chunks on disk is read, and the writes of the last ones drain while
    the next forward runs on chunks that never left the host.

    Raises HostBudgetTooSmall, with the numbers, when even every part on disk is not enough.
    """
    chosen = sorted(on_host, reverse=True)
    host = sum(costs[c].host_state + costs[c].host_payload for c in chosen)
    aliased = any(c.aliased for c in costs)  # a frozen chunk has no gradient region
    if host_budget is None or host <= host_budget:
        return DiskPlacement(host_bytes=host, aliased=aliased, block=block)
    state: list[int] = []
    payload: list[int] = []
    state_buffer = payload_buffer = disk = 0

    def placement() -> DiskPlacement:
        return DiskPlacement(frozenset(state), frozenset(payload), host, disk, state_buffer,
                             payload_buffer, aliased, block)

    for c in chosen:
        state.append(c)
        host -= costs[c].host_state
        disk += costs[c].state_region
        state_buffer = max(state_buffer, costs[c].state_piece)
        if placement().host_total <= host_budget:
            return placement()
    for c in chosen:
        payload.append(c)
        host -= costs[c].host_payload
        disk += costs[c].payload_region
        payload_buffer = max(payload_buffer, costs[c].payload_piece)
        if placement().host_total <= host_budget:
            return placement()
    least = placement()
    raise HostBudgetTooSmall(
        f"host budget {format_size(host_budget)} is below the {format_size(least.host_total)} "
        f"the host needs with every non-resident chunk on disk (I/O buffers "
        f"{format_size(least.buffer_bytes)})")


def disk_read_ahead(upcoming: Iterable[int], *, wanted: Callable[[int], bool],
                    pieces: Callable[[int], Iterable[int]], slots: int
                    ) -> list[tuple[int, int]]:
    """Payload pieces to start reading from disk now, as (chunk, piece): those of the
    `wanted` chunks (payload on disk, not on the device), in order of use and each once,
    that `pieces(chunk)` says are not read yet, at most `slots` of them."""
    chosen: list[tuple[int, int]] = []
    seen: set[int] = set()
    for chunk in upcoming:
        if chunk in seen or not wanted(chunk):
            continue
        seen.add(chunk)
        for piece in pieces(chunk):
            if len(chosen) >= slots:
                return chosen
            chosen.append((chunk, piece))
    return chosen
