"""Finding, while a step runs, the parameters a module's forward reads from other modules.

torch's TransformerEncoderLayer hands `self_attn.out_proj.weight` to a function, so
out_proj's forward never runs and no hook of its own fetches it. The dry forward at build
time (engine.chunks.packing.first_uses) finds such reads only for a model that runs on
`input_ids` alone; a model whose forward needs its labels (or anything else) is watched
on its first real step instead, which is traced anyway: each read reaches the runner
before the function runs, so the parameter is fetched in time, and from then on the
module's hooks fetch it like its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from engine.chunks.packing import Reads


@contextmanager
def watch_borrowing(model: torch.nn.Module,
                    on_read: Callable[[list[torch.nn.Module], torch.nn.Parameter], None]
                    ) -> Iterator[None]:
    """Within the block, `on_read(running, param)` hears every parameter a torch function
    is handed while a module of `model` runs (`running`: the modules running, outermost
    first). A mode on every op: for traced steps only."""
    running: list[torch.nn.Module] = []

    def enter(module: torch.nn.Module, _args: object) -> None:
        running.append(module)

    def leave(module: torch.nn.Module, _args: object, _out: object) -> None:
        running.pop()

    handles = [h for m in model.modules()
               for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with Reads(running, lambda _module, p: on_read(running, p)):
            yield
    finally:
        for h in handles:
            h.remove()
