"""Tied weights: the gradient of each use on its own, as soon as that use's backward made it.

Autograd sums every use of a parameter before the parameter's post-accumulate-grad hook
runs. For a tied embedding that keeps the head's gradient (vocabulary x hidden: 491 MiB in
fp32 for opt-2.7b) alive from the first module of backward to the last, where it meets the
embedding's own gradient of the same size and then their sum: three such tensors beside
the chunk and its gradient buffer, at the step's peak.

So each forward use of a parameter that more than one module holds runs on a leaf of its
own that views the parameter's storage (an alias, swapped in for that module's forward
only). Each alias's gradient goes to `on_grad` as soon as autograd has it, to be added where
the chunk gathers its gradients (engine.step.arrivals), and the parameter's gradient is
complete with its last use.
A use in backward (activation checkpointing's recomputation) or without grad gets no alias:
its gradient, if any, comes through the parameter's own hook, as every other one does.

The engine's StepRunner and the planner's recording (engine.planning.recording) both use
this class, so the recording sees the gradients arrive as the engine does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial

import torch

from engine.step.hooks import weak

__all__ = ["TiedUses"]


class TiedUses:
    """The aliases of one model's shared parameters; see the module docstring.

    `on_grad(param, alias)`: `alias.grad` holds one use's gradient of `param`; the callee
    takes it and sets `alias.grad` to None. `pending(param)` then says whether more uses'
    gradients are still to come in this backward. Held weakly, as engine.step.hooks holds
    its callbacks."""

    def __init__(self, model: torch.nn.Module,
                 on_grad: Callable[[torch.nn.Parameter, torch.nn.Parameter], None]) -> None:
        holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        params: dict[int, torch.nn.Parameter] = {}
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    holders.setdefault(id(p), []).append((module, name))
                    params[id(p)] = p
        # id(module) -> (attribute, parameter) for each parameter it shares with another.
        self._shared: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
        for key, held in holders.items():
            if len(held) > 1:
                for module, name in held:
                    self._shared.setdefault(id(module), []).append((name, params[key]))
        self._modules = {id(m): weakref.ref(m) for m in model.modules() if id(m) in self._shared}
        self._on_grad = weak(on_grad)
        self._pending: dict[int, int] = {}  # id(param) -> aliases whose gradient is to come

    @property
    def any(self) -> bool:
        return bool(self._shared)

    def enter(self, module: torch.nn.Module) -> None:
        """`module`'s forward is about to run outside backward: its shared parameters that
        need a gradient are aliases for this use."""
        uses = self._shared.get(id(module))
        if not uses or not torch.is_grad_enabled():
            return
        for name, param in uses:
            if not param.requires_grad:
                continue
            alias = torch.nn.Parameter(param.detach())
            alias.register_post_accumulate_grad_hook(partial(self._arrived, param))
            module._parameters[name] = alias
            self._pending[id(param)] = self._pending.get(id(param), 0) + 1

    def leave(self, module: torch.nn.Module) -> None:
        """`module`'s forward is over (or failed): its own parameters are back."""
        for name, param in self._shared.get(id(module), ()):
            module._parameters[name] = param

    def leave_all(self) -> None:
        for key, ref in self._modules.items():
            module = ref()
            if module is not None and key in self._shared:
                self.leave(module)

    def pending(self, param: torch.nn.Parameter) -> bool:
        return self._pending.get(id(param), 0) > 0

    def reset(self) -> None:
        """A new backward (or a failed one): no use's gradient is awaited."""
        self._pending.clear()

    def _arrived(self, param: torch.nn.Parameter, alias: torch.nn.Parameter) -> None:
        left = self._pending.get(id(param), 0)
        if left:
            self._pending[id(param)] = left - 1
        self._on_grad(param, alias)
