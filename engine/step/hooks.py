"""Module and gradient hooks that drive chunk movement during a step.

- forward pre-hook: fetch the module's chunks, its parameters become COMPUTE;
- forward hook: parameters become HOLD_AFTER_FWD, and the outputs are wrapped in an identity
  autograd Function whose backward fetches the chunks again. A full-backward-pre-hook would
  not fire for a module none of whose inputs needs grad (the embedding), this does;
- for a module with frozen parameters, its inputs are wrapped the same way, and that
  backward says the module's backward is done: no gradient will ever arrive to move a frozen
  parameter on, so without it every frozen chunk would stay on the device until backward
  ends. Where no input needs grad (a layer fed by a frozen embedding), nothing fires and the
  end of backward moves them on;
- post-accumulate-grad hook (per parameter): the gradient goes into the chunk's buffer.
  A tied weight's uses each run on an alias with a hook of its own, so each use's gradient
  goes there as soon as it is made (engine.step.tied_uses).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable

import torch


class _PreBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, callback: Callable[[], None], *tensors: torch.Tensor):
        ctx.callback = callback
        # detach() shares storage without making an autograd view, so later in-place ops
        # on the module output stay legal.
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.callback()
        return (None, *grads)


def wrap_outputs(output: object, callback: Callable[[], None]) -> object:
    """`output` with every grad-requiring tensor routed through a _PreBackward node.

    Plain module-level recursion, no nested closures: a closure that calls itself is a
    reference cycle, and this one would hold the module's outputs (the step's activations)
    until Python's cycle collector happened by, measured at ~80 MiB a step on a 35M-parameter
    Llama, resident memory that grew step after step.
    """
    if isinstance(output, torch.Tensor):  # most modules' (Linear, LayerNorm, Embedding)
        return _PreBackward.apply(callback, output)[0] if output.requires_grad else output
    found: list[torch.Tensor] = []
    _collect(output, found)
    if not found:
        return output
    wrapped = dict(zip(map(id, found), _PreBackward.apply(callback, *found), strict=True))
    return _rebuild(output, wrapped)


def _collect(obj: object, found: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            found.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, found)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _collect(v, found)


def _rebuild(obj: object, wrapped: dict[int, torch.Tensor]) -> object:
    if isinstance(obj, torch.Tensor):
        return wrapped.get(id(obj), obj)
    if isinstance(obj, dict):
        for k in list(obj.keys()):
            obj[k] = _rebuild(obj[k], wrapped)
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_rebuild(v, wrapped) for v in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_rebuild(v, wrapped) for v in obj)
    return obj


def weak(method: Callable) -> Callable:
    """`method` (a bound method) held weakly: a hook must not keep its engine alive, so an
    engine dropped without close() is still freed. Once the engine is gone the hook does
    nothing (and a forward hook leaves the output as it is)."""
    if not inspect.ismethod(method):
        return method  # a plain function holds no engine
    # The instance held weakly and its function called with it: what WeakMethod does, less
    # its Python-level __call__ and a bound method made at every hook call.
    ref, func = weakref.ref(method.__self__), method.__func__

    def call(*args: object) -> object:
        target = ref()
        return None if target is None else func(target, *args)

    return call


def _wrap_inputs(params: list[torch.nn.Parameter], after_backward: Callable[[], None],
                 args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The module's inputs routed through a _PreBackward node calling `after_backward`, if
    one of its parameters is frozen; None (the inputs as they are) otherwise."""
    if not torch.is_grad_enabled() or all(p.requires_grad for p in params):
        return None
    found: list[torch.Tensor] = []
    _collect((args, kwargs), found)
    if not found:
        return None
    return wrap_outputs((args, kwargs), after_backward)


def install(model: torch.nn.Module, *, pre_forward: Callable[[int], None],
            post_forward: Callable[[int, object], object],
            after_backward: Callable[[int], None] | None = None,
            borrowed: dict[int, list[torch.nn.Parameter]] | None = None,
            ) -> tuple[list, dict[int, list[torch.nn.Parameter]]]:
    """Hook every module that uses parameters directly: its own, and those its forward
    reads from other modules (`borrowed`, by id(module); see packing.first_uses).
    `after_backward(key)` is called once a module with frozen parameters has computed its
    inputs' gradients. Returns (handles, key -> parameters). The callbacks are held weakly
    (see `weak`)."""
    borrowed = borrowed or {}
    pre_forward, post_forward = weak(pre_forward), weak(post_forward)
    done = weak(after_backward) if after_backward is not None else None
    handles = []
    owned: dict[int, list[torch.nn.Parameter]] = {}
    for key, module in enumerate(model.modules()):
        params = list(module.parameters(recurse=False))
        params += [p for p in borrowed.get(id(module), []) if all(p is not q for q in params)]
        if not params:
            continue
        owned[key] = params
        handles.append(module.register_forward_pre_hook(
            lambda _m, _args, key=key: pre_forward(key), prepend=True))
        handles.append(module.register_forward_hook(
            lambda _m, _args, out, key=key: post_forward(key, out), prepend=True))
        if done is not None:
            handles.append(module.register_forward_pre_hook(
                lambda _m, args, kwargs, key=key, params=params: _wrap_inputs(
                    params, lambda: done(key), args, kwargs), with_kwargs=True))
    return handles, owned


def hook_gradients(params: Iterable[torch.nn.Parameter], on_grad: Callable,
                   hooked: dict[int, object]) -> None:
    """Give every parameter that needs a gradient and has no hook yet a post-accumulate-grad
    hook (held weakly); `hooked` maps id(param) -> handle and grows.

    Called at every step, not once: a parameter unfrozen after the engine was built
    (gradual unfreezing) trains from the next step on. A frozen parameter cannot carry such
    a hook, and would never fire one."""
    callback = weak(on_grad)
    for p in params:
        if p.requires_grad and id(p) not in hooked:
            hooked[id(p)] = p.register_post_accumulate_grad_hook(callback)
