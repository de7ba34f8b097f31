"""The placement rules: pure functions over chunk indices and byte counts.

Which chunks stay resident, which chunk is evicted, what `cpu` releases before a module
runs, how much room the trace's forecast keeps free, what a prefetch may bring in, whether a
budget can run a policy. The chunk manager (engine.chunks.manager) carries these decisions
out on tensors and the planner's replay (engine.planning.replay) on counters, so the two
cannot drift apart: there is no second copy of any rule.

A policy is one class with the rules that differ between policies; a new policy is one new
class (and a name in engine.placement.policy.Policy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from engine.config import format_size
from engine.placement.policy import Policy
from engine.placement.trace import Trace


class BudgetTooSmall(ValueError):
    """The device budget cannot hold the minimum working set; says what it needs."""


# --- per-policy rules --------------------------------------------------------------------


class CudaRules:
    """All model data, optimizer state included, lives on the device."""

    policy = Policy.CUDA

    @staticmethod
    def resident(costs: Sequence[int], room: float) -> set[int]:
        return set(range(len(costs)))

    @staticmethod
    def forecast(trace: Trace | None, pos: int, non_model_now: int) -> int:
        # Nothing is ever evicted, so there is nothing to keep room for.
        return 0

    @staticmethod
    def release_before_use(on_device: Iterable[int], needed: Iterable[int]) -> list[int]:
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
    def release_before_use(on_device: Iterable[int], needed: Iterable[int]) -> list[int]:
        return []


class CpuRules(AutoRules):
    """Chunks are copied in right before use and dropped right after."""

    policy = Policy.CPU

    @staticmethod
    def release_before_use(on_device: Iterable[int], needed: Iterable[int]) -> list[int]:
        """Anything the module about to run does not need goes now."""
        keep = set(needed)
        return [c for c in on_device if c not in keep]


RULES: dict[Policy, type[CudaRules] | type[AutoRules] | type[CpuRules]] = {
    Policy.CUDA: CudaRules, Policy.AUTO: AutoRules, Policy.CPU: CpuRules}


def rules_for(policy: Policy | str) -> type[CudaRules] | type[AutoRules] | type[CpuRules]:
    return RULES[Policy.parse(policy)]


# --- rules every policy shares -----------------------------------------------------------


def resident_cost(numel: int, itemsize: int) -> int:
    """Device bytes a chunk needs to be resident: payload, room for its gradients, fp32
    master and two moments (in fp32 the payload is the master)."""
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


def prefetch_forecast(trace: Trace, pos: int, non_model_now: int, grads_to_open: int) -> int:
    """Room a prefetch leaves free until the next module: the trace's non-model growth and,
    in backward, the gradient buffers the running module may still open."""
    return max(0, trace.non_model_ahead(pos) - non_model_now) + grads_to_open


def prefetches(upcoming: Iterable[int], *, skip: Callable[[int], bool], free: int,
               nbytes: Callable[[int], int]) -> list[int]:
    """The next module's chunks to copy in ahead of use, in order, while each fits in `free`.

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
                 module_bytes: Iterable[int], resident_costs: Sequence[int]) -> None:
    """Raise BudgetTooSmall, with the numbers, when `budget` cannot run `policy`."""
    need = minimum_working_set(trace, module_bytes)
    if budget < need:
        raise BudgetTooSmall(
            f"device budget {format_size(budget)} is below the minimum working set "
            f"{format_size(need)} (largest chunks in use at once"
            f"{', plus activations' if trace else ''})")
    if policy == Policy.CUDA:
        model = sum(resident_costs)
        need = model + (trace.non_model_peak if trace else 0)
        if budget < need:
            raise BudgetTooSmall(
                f"policy cuda needs {format_size(need)} on the device (model data "
                f"{format_size(model)} + activations {format_size(need - model)}) but the "
                f"budget is {format_size(budget)}; use policy auto or cpu")
