"""The plan's host peak is the peak resident memory of a real training process.

Each check builds a model in a process of its own and reads the kernel's high-water mark
(VmHWM) after a few steps. Where the runtime's own memory is part of what is checked (the
absolute peak), the process is a fresh interpreter, as the worker is; where a difference
between two processes is checked, they are forked (tests/forked.py). Processes that are
measured run side by side while the parent makes the plan: a process's peak is its own,
whatever runs beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from transformers import LlamaConfig, OPTConfig

from engine.placement import disk_rules
from engine.planning.planner import plan
from tests.forked import start_script

SHAPE = {"batch_size": 2, "seq_len": 64}

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/self/status; glibc's allocator")


# The scripts below end with four steps, then the process's peak resident memory. The engine
# resets the high-water mark as each step starts (engine.step.engine), so the figure is the
# last step's peak. The first step is traced (every chunk at its first use) and peaks lower;
# the second, the first settled one, still peaks some tens of MB below the later steps, which
# move by a few MB from then on. Measured, MiB per step 1-7, against the forecast:
# opt-125m auto 2913, 3222, 3274, 3298, 3323, 3323, 3323 against 3302; cpu 2923, 2936,
# 3010, 3010, 3034, 3059, 3059 against 3013; tiny 383, 394, 399, 403, 402, 403, 403 against
# 399; with the heap steady, the tied Llama below 2964, 3003, 3027, 3029, 3048, 3052, 3046
# (3048-3059 up to step 16) against 3150: at the second step it sat 4.6-5.1% below its
# forecast, at the fourth 3.2-3.8%. Since fp32 gradients land in host buffers made at every
# step (rules.grads_land_per_step), at the fourth step: opt-125m auto 3083 against 3066,
# cpu 2800 against 2778; the tied Llama 2921 against 2855. A difference between two
# processes (the host budget's test) is read at the second step: what the later steps add,
# both add.
def steps_then_peak(steps: int) -> str:
    """A script's end: `steps` steps, then the process's peak resident memory."""
    return f"""
g = torch.Generator().manual_seed(0)
for _ in range({steps}):
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=g)
    engine.step({{"input_ids": ids, "labels": ids}})
for line in open("/proc/self/status"):
    if line.startswith("VmHWM"):
        print(json.dumps({{"peak_rss": int(line.split()[1]) * 1024}}))
"""


# A zoo model (argv 1) under a policy (argv 2) in a precision (argv 3), built on the meta
# device and filled a chunk at a time, as the worker runs it.
PEAK_RSS_SCRIPT = """
import json, sys, torch
from engine import Engine, EngineConfig
from engine.models.zoo import meta_build
built = meta_build(sys.argv[1])
model = built.model
engine = Engine(model, EngineConfig(policy=sys.argv[2], device_budget="6GiB",
                                    precision=sys.argv[3], simulate=True),
                weights=built.weights)
""" + steps_then_peak(4)


def peak_of(output: str) -> int:
    return json.loads(output.splitlines()[-1])["peak_rss"]


class Fresh:
    """A script in a fresh interpreter (`python -c`), started at once; `peak` waits.

    On one thread: the peak is the same as on torch's default two (opt-125m under cpu,
    twice each: 3153 and 3172 MB on one, 3145 and 3161 MB on two), and processes side by
    side with the other tests' do not spend CPU spinning in each other's way (15-17 CPU s
    each alone on one thread, 19-22 on two)."""

    def __init__(self, script: str, *argv: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", script, *argv],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def peak(self, timeout: float) -> int:
        out, err = self.process.communicate(timeout=timeout)
        assert self.process.returncode == 0, err[-3000:]
        return peak_of(out)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate()


def test_the_host_peak_is_the_peak_resident_memory_of_a_fresh_training_process():
    """A fresh process, as the worker is: the runtime dominates tiny's host peak."""
    process = Fresh(PEAK_RSS_SCRIPT, "tiny", "auto", "bf16")
    forecast = plan(
        "tiny", device_mem="6GiB", host_mem="64GiB", precision="bf16", simulated=True, **SHAPE
    )
    assert forecast.auto.host_peak == pytest.approx(process.peak(timeout=240), rel=0.10)


@pytest.fixture(scope="module")
def opt_125m_processes() -> Iterator[dict[str, Fresh]]:
    """opt-125m under each policy, in two fresh processes side by side (2.5 GB each)."""
    processes = {policy: Fresh(PEAK_RSS_SCRIPT, "opt-125m", policy, "fp32")
                 for policy in ("auto", "cpu")}
    yield processes
    for process in processes.values():
        process.kill()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["auto", "cpu"])
def test_the_host_peak_of_opt_125m_is_within_5_percent_of_a_fresh_process(
        opt_125m_processes, policy):
    """Where the chunks, not the runtime, make the peak: opt-125m in fp32 (2 GiB of
    state), built from its config as the worker builds it."""
    forecast = plan("opt-125m", device_mem="6GiB", host_mem="64GiB", precision="fp32",
                    simulated=True, **SHAPE).policies[policy]
    peak = opt_125m_processes[policy].peak(timeout=600)
    assert forecast.host_peak == pytest.approx(peak, rel=0.05)


# A model folder's config (argv 1) built as a model of its own, under policy cpu in fp32,
# with the heap kept steady (engine.devices.host_memory) as a run where host memory is
# tight keeps it.
STEADY_PEAK_RSS_SCRIPT = """
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
from engine import Engine, EngineConfig
from engine.devices.host_memory import steady_heap
assert steady_heap()
from engine.models.initial_weights import ModelInit
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]))
engine = Engine(model, EngineConfig(policy="cpu", device_budget="6GiB", precision="fp32",
                                    simulate=True), weights=ModelInit(model))
""" + steps_then_peak(4)


@pytest.mark.slow
def test_the_host_peak_of_a_tied_llama_is_within_5_percent_with_the_heap_steady(tmp_path):
    """A 135M Llama with a 49k vocabulary and tied embeddings: left to itself glibc's heap
    put this process's peak 12-20% above the plan, differently each run; kept steady, the
    peak is the plan's."""
    LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                tie_word_embeddings=True, max_position_embeddings=256
                ).save_pretrained(tmp_path)
    process = Fresh(STEADY_PEAK_RSS_SCRIPT, str(tmp_path))
    forecast = plan(str(tmp_path), device_mem="6GiB", host_mem="64GiB", precision="fp32",
                    simulated=True, **SHAPE).cpu
    assert forecast.host_peak == pytest.approx(process.peak(timeout=600), rel=0.05)


# A training process under a host budget (`folder`'s OPT config, fp32 weights made a chunk
# at a time as the zoo makes them, pieces of 2**18 elements), with the heap steady as every
# run keeps it; prints its peak resident memory. (Left to glibc, a process forked from a
# worker whose earlier tests raised glibc's mmap threshold keeps the gradient buffers each
# step frees, this model's a few MiB each, in its heap: measured, 974 MiB against 941 MiB
# forked from a fresh worker, which put the difference 23% over the plan's.)
BUDGET_RSS_SCRIPT = """
import json, sys, torch
torch.set_num_threads(1)  # four side by side: see Fresh
from engine.devices.host_memory import steady_heap
assert steady_heap()
from transformers import OPTConfig, OPTForCausalLM
from engine.placement import disk_rules
disk_rules.DISK_PIECE = 2**18
from engine import Engine, EngineConfig
folder, budget, scratch = sys.argv[1], sys.argv[2], sys.argv[3]
from engine.models.initial_weights import ModelInit
with torch.device("meta"):
    model = OPTForCausalLM(OPTConfig.from_pretrained(folder))
engine = Engine(model, EngineConfig(policy="cpu", device_budget="1GiB", precision="fp32",
                                    simulate=True, disk_dir=scratch,
                                    host_budget=None if budget == "none" else int(budget)),
                weights=ModelInit(model))
""" + steps_then_peak(2)


def test_a_host_budget_lowers_the_peak_resident_memory_by_what_the_plan_says(tmp_path,
                                                                              monkeypatch):
    """Chunk by chunk filling, the parts kept on the host and the I/O buffers: what the disk
    tier takes off a real process's peak is what the plan takes off its forecast. (The
    runtime beside them is the other tests'.)"""
    monkeypatch.setattr(disk_rules, "DISK_PIECE", 2**18)
    folder = tmp_path / "opt-30m"  # ~450 MiB of fp32 training state
    OPTConfig(vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
              ffn_dim=2048, max_position_embeddings=128, word_embed_proj_dim=512,
              dropout=0.0, attention_dropout=0.0).save_pretrained(folder)
    shape = {"device_mem": "1GiB", "host_mem": "64GiB", "precision": "fp32",
             "simulated": True, "batch_size": 2, "seq_len": 64}
    plain = plan(str(folder), **shape)
    budget = int(0.3 * plain.model_bytes)

    # Forked processes (tests/forked.py): the imports they start with are the same in
    # each, and the difference takes them out. A process's peak moves by some MB from run
    # to run, upwards only (a transient the heap happened to hold at the wrong moment,
    # shared libraries' pages; the second step's peak measured over five runs each: 979-998
    # MB without the budget, 646-659 MB with it, so that one pair alone came within 9% of
    # the forecast): the lowest of two runs each, the four side by side from the start
    # (about 3.3 GB together), each with a scratch folder of its own.
    scratch = [tmp_path / f"run-{i}" for i in range(4)]
    for path in scratch:
        path.mkdir()
    runs = [(b, start_script(BUDGET_RSS_SCRIPT, str(folder), b, str(path)))
            for b, path in zip(["none", str(budget)] * 2, scratch, strict=True)]
    peaks: dict[str, list[int]] = {"none": [], str(budget): []}
    try:
        budgeted = plan(str(folder), host_budget=budget, disk_dir=tmp_path, **shape)
        assert budgeted.cpu.fits and budgeted.cpu.disk_bytes > 0
        for b, run in runs:
            peaks[b].append(peak_of(run.output(timeout=240)))
    finally:
        for _, run in runs:
            run.kill()
    measured = min(peaks["none"]) - min(peaks[str(budget)])
    forecast = plain.cpu.host_peak - budgeted.cpu.host_peak
    assert forecast > plain.model_bytes / 2  # the tier takes off most of the state
    # Measured at the second step: 320-352 MiB against 325 MiB forecast with one run each;
    # since gradients land in buffers made at every step (rules.grads_land_per_step) and
    # with the heap steady, 307 MiB against 285 MiB, twice (916-918 MiB without the
    # budget, 594-597 MiB with it).
    assert measured == pytest.approx(forecast, rel=0.15), (measured, forecast)
