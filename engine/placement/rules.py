"""The placement rules: pure functions over chunk indices and byte counts.

Which chunks stay resident, which chunk is evicted, what `cpu` releases before a module
runs, how much room the trace's forecast keeps free, what a prefetch may bring in (data
parallel: what a rank offers to gather ahead of use), whether a budget can run a policy.
The chunk manager (engine.chunks.manager) carries these decisions out on tensors and the
planner's replay (engine.planning.replay) on counters, so the two cannot drift apart: there
is no second copy of any rule.

A policy is one class with the rules that differ between policies; a new policy is one new
class (and a name in engine.placement.policy.Policy).

The disk tier's rules (which parts of which chunks go to the scratch folder under a host
budget, and which payloads are read from it ahead of use) live in engine.placement.disk_rules.
This module offers them under its own name too, so the engine asks one module for every
placement rule: rules.disk_placement beside rules.evictions.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

# Not DISK_PIECE: disk_rules reads it where it is defined, so a test that sets smaller
# pieces sets disk_rules.DISK_PIECE, and a second name here would only hold a stale copy.
from engine.placement.disk_rules import (
    ELEMENT_ALIGN,
    MIN_DISK_PIECE,
    STATE_BUFFERS,
    DiskCost,
    DiskPlacement,
    HostBudgetTooSmall,
    disk_cost,
    disk_piece,
    disk_placement,
    disk_read_ahead,
    payload_buffers,
    piece_elements,
    piece_spans,
)
from engine.placement.policy import Policy
from engine.placement.trace import Trace
from engine.sizes import format_size

__all__ = [
    # the rules of each policy
    "CudaRules", "AutoRules", "CpuRules", "RULES", "rules_for",
    # the rules every policy shares
    "BudgetTooSmall", "resident_cost", "margin_room", "resident_chunks", "choose_victim",
    "evictions", "keeps_grad", "grads_land_per_step", "joins_run", "runs_poll",
    "PREFETCH_HORIZON", "prefetch_target", "opening_between", "prefetch_forecast",
    "prefetches", "gathers_ahead", "minimum_working_set", "cuda_need",
    "cuda_peaks_beside_gradients", "check_budget",
    # the disk tier's (engine.placement.disk_rules)
    "HostBudgetTooSmall", "STATE_BUFFERS", "ELEMENT_ALIGN", "MIN_DISK_PIECE", "disk_piece",
    "payload_buffers", "DiskCost", "piece_elements", "piece_spans", "disk_cost",
    "DiskPlacement", "disk_placement", "disk_read_ahead",
]


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


def built_on_device(policy: Policy, costs: Sequence[int], *, capacity: int,
                    sharded: bool) -> set[int]:
    """The chunks a policy places on the device before any trace, which the engine builds
    there under a host budget (ChunkManager.use_host_budget): cuda's, every one, when they
    fit (one that does not is refused with the budget's numbers); the margin's come with a
    trace. Data parallel, none: each rank opens its disk tier as it starts, for a change of
    policy reaches the ranks at a step boundary, where a rank whose folder lacked room could
    only fail the step, not refuse the change."""
    if sharded:
        return set()
    first = resident_chunks(policy, costs, trace=None, capacity=capacity, margin_ratio=0.0)
    return first if sum(costs[i] for i in first) <= capacity else set()


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


def cuda_need(resident_costs: Sequence[int], *, trace: Trace | None, working_set: int,
              sharded: bool) -> tuple[int, int]:
    """(model data, what comes beside it): the device bytes policy cuda holds at once.

    Every chunk resident with room for its gradients, and beside them the traced
    activations (0 before a trace). Sharded (data parallel), the resident costs are shards,
    and beside them the whole `working_set`: the chunks gathered for each use and their
    gradient buffers come on top of the activations.

    Where cuda_peaks_beside_gradients, in one process, the two together are the step's
    peak; otherwise (sharded too) a bound above it."""
    activations = trace.non_model_peak if trace else 0
    return sum(resident_costs), working_set if sharded else activations


def cuda_peaks_beside_gradients(micro_batches: int) -> bool:
    """Whether a cuda step's activations peak beside every chunk's gradients, so that
    cuda_need is the step's peak and not a bound above it.

    With several micro-batches each after the first starts with the gradients of those
    before it on the device (a resident chunk keeps its own until the update), so its
    forward peaks beside all of them: the highest micro-batch's peak. With one, gradients
    arrive as activations go, and only the step itself (or the plan's replay of it) says
    how far below the bound its peak is."""
    return micro_batches > 1


def check_budget(budget: int, policy: Policy, *, trace: Trace | None,
                 module_bytes: Iterable[int], resident_costs: Sequence[int],
                 sharded: bool = False) -> None:
    """Raise BudgetTooSmall, with the numbers, when `budget` cannot run `policy`.

    cuda is held to cuda_need, its model data beside the activations, which are known
    once there is a trace. `sharded` (data parallel): the resident costs are shards, and
    the chunks gathered whole for each use and their gradient buffers (the working set
    beside the activations; before the first step, the largest module's) come on top."""
    working_set = minimum_working_set(trace, module_bytes)
    if budget < working_set:
        raise BudgetTooSmall(
            f"device budget {format_size(budget)} is below the minimum working set "
            f"{format_size(working_set)} (largest chunks in use at once"
            f"{', plus activations' if trace else ''})")
    if policy == Policy.CUDA:
        need = sum(cuda_need(resident_costs, trace=trace, working_set=working_set,
                             sharded=sharded))
        activations = trace.non_model_peak if trace else 0
        if budget < need:  # sharded, the chunks gathered for each use count as model data
            raise BudgetTooSmall(
                f"policy cuda needs {format_size(need)} on the device (model data "
                f"{format_size(need - activations)} + activations {format_size(activations)}) "
                f"but the budget is {format_size(budget)}; use policy auto or cpu")
