"""A fresh model's weights, made a module at a time, as transformers initialises them.

transformers initialises a model in one walk over its modules, drawing from one random
stream: a module's values then depend on every module drawn before it. Filling chunks a
few parameters at a time (last used first under a host budget) walks in another order, so
here each module draws from a stream of its own, seeded from the run's seed and the
module's name: its values are the same whichever module is made first, whatever the
placement, and the whole model built at once (zoo.build_model) is bit for bit the model
the chunks are filled with.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterator, Sequence

import torch

__all__ = ["ModelInit", "module_seed"]


def module_seed(seed: int, module_name: str) -> int:
    """The seed of one module's random stream: the run's seed and the module's name."""
    digest = hashlib.blake2b(f"{seed}/{module_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed takes up to 2**63 - 1 here


class ModelInit:
    """Initial weights of `model` (on the meta device), a module at a time.

    Args:
        model: the model, its parameters on the meta device. Its buffers (RoPE's inverse
            frequencies) are small: they get their values here, now, on the CPU.
        seed: fixes every value (see module_seed); the caller's random state is left as
            it was.
        init: initialises one module in place, as transformers does (default: the
            model's own `_init_weights`). A transform that adds modules to the meta model
            (adapters) may need its own rule for them.

    Parameters are found by identity: a transform that wraps the model after this was made
    keeps the original parameters, and parameters it adds are found in `model` when first
    asked for.
    """

    def __init__(self, model: torch.nn.Module, seed: int = 0,
                 init: Callable[[torch.nn.Module], None] | None = None) -> None:
        self.model, self.seed = model, seed
        self.init = init or model._init_weights
        self._owners: dict[int, tuple[str, torch.nn.Module]] = {}
        self._find_owners()
        for name, module in model.named_modules():
            if any(b is not None and b.is_meta for b in module._buffers.values()):
                self._made(name, module, real_buffers=True)

    def _find_owners(self) -> None:
        # The first module holding a tied parameter initialises it (the embedding, as
        # transformers does: the tied head is skipped there).
        for name, module in self.model.named_modules():
            for param in module._parameters.values():
                if param is not None:
                    self._owners.setdefault(id(param), (name, module))

    def owner(self, param: torch.nn.Parameter) -> tuple[str, torch.nn.Module]:
        """(name, module) of the module that initialises `param`."""
        if id(param) not in self._owners:
            self._find_owners()  # added to the model since (an adapter)
        if id(param) not in self._owners:
            raise KeyError("a parameter that is not in the model")
        return self._owners[id(param)]

    def tensors(self, params: Sequence[torch.nn.Parameter]) -> Iterator[torch.Tensor]:
        """WeightSource.tensors: each module is initialised once for its run of
        neighbouring parameters (a module split over two chunks, twice, alike)."""
        made: tuple[torch.nn.Module | None, dict[int, torch.Tensor]] = (None, {})
        for param in params:
            name, module = self.owner(param)
            if made[0] is not module:
                made = (None, {})  # the last module's values go before the next is made
                made = (module, self._made(name, module))
            yield made[1].pop(id(param))

    @torch.no_grad()
    def _made(self, name: str, module: torch.nn.Module, *,
              real_buffers: bool = False) -> dict[int, torch.Tensor]:
        """The module's own parameters initialised, by id of the meta parameter, on a
        shallow copy of the module (the model is not touched). `real_buffers`: its meta
        buffers get CPU storage in the model and are initialised there."""
        twin = copy.copy(module)
        twin._parameters = {
            key: None if p is None else torch.nn.Parameter(
                torch.empty(p.shape, dtype=torch.float32), requires_grad=p.requires_grad)
            for key, p in module._parameters.items()}
        if real_buffers:
            for key, b in module._buffers.items():
                if b is not None and b.is_meta:
                    module._buffers[key] = torch.empty(b.shape, dtype=b.dtype)
        twin._buffers = dict(module._buffers) if real_buffers else {
            key: None if b is None else torch.empty(b.shape, dtype=b.dtype)
            for key, b in module._buffers.items()}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(module_seed(self.seed, name))
            self.init(twin)
        return {id(p): twin._parameters[key].data
                for key, p in module._parameters.items() if p is not None}
