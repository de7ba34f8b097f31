"""Running the engine on several gloo ranks inside a test, and the models and references
the data-parallel tests compare with.

Each rank is a process with one thread, joined through a file store (no port to race
for); every collective has the engine's timeout and the whole run a deadline, so a bug
fails the test instead of hanging it. A rank runs a list of scenarios in one process, and
writes what each gave to a file the test reads. Ranks are forked from a server that
imported torch and transformers once per test process (tests/forked.py): a spawned rank
spent seconds of the machine's CPU importing them, every launch.
"""

from __future__ import annotations

import datetime
import os
import traceback
from pathlib import Path

import torch

from tests.engine.references import (  # noqa: F401 - the data-parallel tests import them here
    VOCAB,
    make_batches,
    reference_run,
    whole_model_relative_difference,
)
from tests.forked import adopt, context

TINY_VOCAB = 8192  # the zoo's tiny, which the planner's scenarios run
COLLECTIVE_TIMEOUT = 20.0  # seconds: a rank that is gone is an error within this


def build(arch: str = "opt", *, layers: int = 2, hidden: int = 64, seed: int = 0,
          dropout: float = 0.0) -> torch.nn.Module:
    """A tiny OPT (the zoo's `tiny` shape with a byte vocabulary), dropout off unless
    given."""
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(seed)
    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                    num_attention_heads=4, ffn_dim=4 * hidden, max_position_embeddings=64,
                    word_embed_proj_dim=hidden, dropout=dropout, attention_dropout=0.0)
    return OPTForCausalLM(cfg)


class Output:
    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


class Gated(torch.nn.Module):
    """A block with a parameter its forward uses only when asked (`use_gate`): a branch
    some batches take and others do not."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)
        self.gate = torch.nn.Parameter(torch.randn(hidden) * 0.1)

    def forward(self, x: torch.Tensor, use_gate: bool) -> torch.Tensor:
        y = torch.tanh(self.proj(x))
        return y * torch.sigmoid(self.gate) if use_gate else y


class GatedLM(torch.nn.Module):
    """A small causal LM whose blocks may leave their gate unused: `gates` in the batch
    says which blocks use theirs (all of them by default)."""

    def __init__(self, hidden: int = 64, blocks: int = 3, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.blocks = torch.nn.ModuleList(Gated(hidden) for _ in range(blocks))
        self.head = torch.nn.Linear(hidden, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                gates: tuple[bool, ...] | None = None, skip: int | None = None) -> Output:
        x = self.embed(input_ids)
        for i, block in enumerate(self.blocks):
            if i != skip:  # a whole block left out (not something ranks may differ in)
                x = x + block(x, True if gates is None else gates[i])
        logits = self.head(x)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return Output(loss)


def rank_slice(batch: dict, rank: int, world: int) -> dict:
    """Rank `rank`'s contiguous part of a global batch."""
    size = batch["input_ids"].shape[0] // world
    return {k: v[rank * size:(rank + 1) * size] if isinstance(v, torch.Tensor) else v
            for k, v in batch.items()}


# --- ranks -------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, store: str, out: str, target: str, args: dict,
               environ: dict[str, str]) -> None:
    adopt({**environ, "TUITRAIN_SIMULATE": "1"})
    torch.set_num_threads(1)
    import torch.distributed as dist

    path = Path(out) / f"rank{rank}.pt"
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
        module_name, _, name = target.rpartition(".")
        import importlib

        fn = getattr(importlib.import_module(module_name), name)
        result = fn(rank, world, **args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001 - reported to the test, with the rank
        torch.save({"ok": False, "error": f"rank {rank}:\n{traceback.format_exc()}"}, path)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group cannot be torn down cleanly
                pass
        # Skip interpreter teardown: gloo's threads can hold it up when a peer is gone.
        os._exit(0)


def run_ranks(world: int, target: str, tmp: Path, *, deadline: float = 120.0,
              may_die: tuple[int, ...] = (), **args) -> list[dict | None]:
    """Run `target(rank, world, **args)` (a function named module.name, importable from
    this folder) on `world` gloo ranks; returns each rank's result, in rank order (None
    for a rank in `may_die` that wrote none). Fails with every rank's traceback if any
    rank raised, and kills them all past `deadline` seconds."""
    tmp.mkdir(parents=True, exist_ok=True)
    store = tmp / "store"
    store.unlink(missing_ok=True)
    ctx = context()
    procs = [ctx.Process(target=_rank_main, args=(r, world, str(store), str(tmp), target, args,
                                                  dict(os.environ)))
             for r in range(world)]
    for p in procs:
        p.start()
    start = datetime.datetime.now()
    for p in procs:
        left = deadline - (datetime.datetime.now() - start).total_seconds()
        p.join(max(0.1, left))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if hung:
        raise AssertionError(f"ranks {hung} still running after {deadline:g} s")
    results = []
    errors = []
    for r in range(world):
        path = tmp / f"rank{r}.pt"
        if not path.exists():
            if r in may_die:
                results.append(None)
            else:
                errors.append(f"rank {r} wrote nothing (exit code {procs[r].exitcode})")
            continue
        got = torch.load(path, weights_only=False)
        if got["ok"]:
            results.append(got["result"])
        else:
            errors.append(got["error"])
    if errors:
        raise AssertionError("\n".join(errors))
    return results
