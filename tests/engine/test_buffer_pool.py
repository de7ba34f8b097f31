"""The simulated device keeps its chunk buffers (engine.devices.buffer_pool): a chunk's copy
and a gradient buffer take the memory a released one of their size gave back, instead of
new memory at every use. The rule is the plan's too, the device budget never sees what is
kept, and with the heap steady a steady step no longer faults in fresh pages for them.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import OPTConfig, OPTForCausalLM

from engine import Engine, EngineConfig
from engine.devices.buffer_pool import BufferPool, HeldBytes
from engine.models.zoo import build_model
from engine.planning.planner import plan
from engine.planning.policy_plans import PolicyPlans
from tests.forked import run_script

KiB, MiB = 2**10, 2**20
SHAPE = {"batch_size": 2, "seq_len": 64}
# tiny under auto: above its working set (about 15.5 MiB), far below the whole model, so
# that copies come and go.
TIGHT = 20 * MiB

# --- the rule, in bytes ----------------------------------------------------------------------


def test_a_buffer_given_back_is_kept_and_the_next_of_its_size_takes_it():
    held = HeldBytes(limit=10 * KiB)
    assert held.take(4 * KiB) == (False, [])
    assert held.take(4 * KiB) == (False, [])
    assert held.give(4 * KiB) and held.kept == {4 * KiB: 1}
    assert held.take(4 * KiB) == (True, [])
    assert (held.in_use, held.kept_bytes, held.peak) == (8 * KiB, 0, 8 * KiB)


def test_a_new_size_past_the_limit_drops_kept_buffers_of_other_sizes_largest_first():
    held = HeldBytes(limit=10 * KiB)
    for n in (4, 2, 2):
        held.take(n * KiB)
    for n in (4, 2, 2):
        held.give(n * KiB)
    assert held.take(6 * KiB) == (False, [4 * KiB])
    assert held.total == 10 * KiB and held.kept == {2 * KiB: 2}


def test_a_lower_limit_keeps_less_and_a_trim_drops_every_kept_buffer():
    held = HeldBytes(limit=6 * KiB)
    held.take(4 * KiB)
    held.take(2 * KiB)
    assert held.trim(4 * KiB) == []  # nothing kept yet
    assert not held.give(4 * KiB)  # 6 KiB would be held: past the new limit
    assert held.give(2 * KiB)
    assert held.trim() == [2 * KiB]
    assert (held.total, held.peak) == (0, 0)


# --- the buffers -----------------------------------------------------------------------------


def test_a_storage_given_back_is_left_empty_and_its_memory_serves_the_next_of_its_size():
    pool = BufferPool(limit=MiB)
    copy = torch.arange(256, dtype=torch.float32)
    param = copy[64:128]  # a parameter views its chunk's copy for the whole run
    storage = copy.untyped_storage()
    memory = storage.data_ptr()
    pool.drain(storage)
    assert storage.nbytes() == 0 and pool.kept_bytes == 1024
    other = torch.empty(0).untyped_storage()
    pool.fill(other, 1024)
    assert other.data_ptr() == memory and pool.kept_bytes == 0
    pool.drain(other)
    pool.fill(storage, 1024)  # the chunk comes back: its parameter views the same memory
    assert param.data_ptr() == memory + 64 * 4
    param.fill_(-1.0)
    assert copy.tolist() == [*range(64), *[-1.0] * 64, *range(128, 256)]


def test_a_new_tensor_handed_a_kept_buffer_gives_up_its_untouched_memory():
    pool = BufferPool(limit=MiB)
    grads = torch.empty(256)
    memory = grads.data_ptr()
    pool.drain(grads.untyped_storage())
    fresh = torch.empty(256)
    pool.fill(fresh.untyped_storage(), fresh.nbytes)
    assert fresh.data_ptr() == memory and pool.kept_bytes == 0


# --- the engine ------------------------------------------------------------------------------


def tiny_steps(policy: str, budget: int | str, steps: int) -> Engine:
    engine = Engine(build_model("tiny"), EngineConfig(policy=policy, device_budget=budget,
                                                      precision="fp32", simulate=True))
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, engine.model.config.vocab_size,
                            (SHAPE["batch_size"], SHAPE["seq_len"]), generator=g)
        engine.step({"input_ids": ids, "labels": ids})
    return engine


@pytest.mark.parametrize(("policy", "budget"), [("cpu", "6GiB"), ("auto", TIGHT)])
def test_a_steady_step_takes_every_chunk_buffer_from_those_the_last_one_gave_back(
        policy, budget, monkeypatch):
    engine = tiny_steps(policy, budget, 2)
    held = engine.device.pool.bytes
    taken: list[bool] = []
    take = held.take

    def spied(nbytes: int) -> tuple[bool, list[int]]:
        reused, dropped = take(nbytes)
        taken.append(reused)
        return reused, dropped

    monkeypatch.setattr(held, "take", spied)
    ids = torch.randint(0, engine.model.config.vocab_size, (SHAPE["batch_size"], SHAPE["seq_len"]))
    stats = engine.step({"input_ids": ids, "labels": ids})
    assert taken and all(taken)
    # What is kept is free device memory: the budget counts only what is in use.
    assert held.kept_bytes > 0
    assert engine.manager.device_bytes == stats.memory.device_model == held.in_use


@pytest.mark.parametrize(("policy", "budget"), [("cpu", "6GiB"), ("auto", TIGHT)])
def test_the_plan_forecasts_the_buffers_a_steady_step_holds(policy, budget):
    """They are host memory for the whole run, so the plan's host peak counts them."""
    forecast = plan("tiny", device_mem=budget, host_mem="64GiB", precision="fp32",
                    simulated=True, **SHAPE).policies[policy]
    engine = tiny_steps(policy, budget, 3)
    assert forecast.device_buffers == engine.device.pool.bytes.peak > 0


def wide_opt() -> torch.nn.Module:
    """A model of 4 MiB chunks (mapped memory with the heap steady), large beside the
    activations of a short batch."""
    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(
        vocab_size=1024, hidden_size=512, ffn_dim=2048, num_hidden_layers=2,
        num_attention_heads=8, word_embed_proj_dim=512, max_position_embeddings=64))


# The pages a steady step faults in, with the heap kept steady as every run keeps it (a
# forked process: the setting is the process's), beside the model's bytes.
STEADY_STEP_FAULTS = """
import json, resource, sys, torch
torch.set_num_threads(1)
from engine.devices.host_memory import steady_heap
assert steady_heap()
from engine import Engine, EngineConfig
from tests.engine.test_buffer_pool import wide_opt
model = wide_opt()
engine = Engine(model, EngineConfig(policy=sys.argv[1], device_budget="1GiB",
                                    precision="fp32", simulate=True))
g = torch.Generator().manual_seed(0)
for _ in range(3):
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=g)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.step({"input_ids": ids, "labels": ids})
faulted = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * resource.getpagesize()
print(json.dumps({"faulted": faulted, "model": sum(c.nbytes for c in engine.chunks)}))
"""


@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_with_the_heap_steady_a_steady_step_faults_in_less_than_three_times_the_model(
        policy):
    """What is left is autograd's own gradients (the model's bytes once, fresh memory in
    plain PyTorch too), the host buffers they land in (once more: they exist from their
    landing to the update, rules.grads_land_per_step, so that the host does not hold them
    beside the activations) and activations. Before the pool every chunk copy and gradient
    buffer was fresh memory at every use as well: two to four times the model's bytes a
    step more."""
    got = json.loads(run_script(STEADY_STEP_FAULTS, policy, timeout=300).splitlines()[-1])
    assert got["faulted"] < 3 * got["model"], got


def test_the_plan_never_puts_more_of_the_device_in_host_memory_than_its_budget(monkeypatch):
    """The pool's peak (chunks fetched in forward beside those resident, under auto) and
    the activations' (in backward) come at different moments: the plan may not add them
    up. An 8B LoRA run under auto was planned at 14.5 GiB of host memory this way and
    peaked at 12.6 GiB."""
    seen = {}
    policy_plan = PolicyPlans.policy_plan

    def spy(self, policy, margin_ratio):
        row, outcome = policy_plan(self, policy, margin_ratio)
        step = outcome.step
        seen[policy.value] = (row.fits, step.host_device_bytes, step.resident_state,
                              self.capacity)
        return row, outcome

    monkeypatch.setattr(PolicyPlans, "policy_plan", spy)
    plan("opt-125m", device_mem="1GiB", host_mem="64GiB", precision="fp32", simulated=True,
         batch_size=4, seq_len=128, margin_ratio=0.0)
    assert seen["auto"][0] and seen["cpu"][0]
    for policy in ("auto", "cpu"):
        _, host, state, capacity = seen[policy]
        assert host <= capacity + state, policy
