"""ReplayGradients: the replayed step's gradients, where they gather and where they go.

The counterpart of engine.chunks.gradients.Gradients, in bytes. Each arrival begins the
interval's next part. A non-resident chunk's gradients gather in a device gradient buffer
(from the pool) and go home once its last is in; where a buffer would only be a second copy
(rules.keeps_grad) autograd's own tensors are kept instead, taken from the non-model count
into model data, and go home together; a resident chunk keeps them until the update. A tied
parameter's later uses add up where its first gradient is. Going home is a copy and makes
the chunk's device copy stale; where the host's landing places are made within the step,
they are counted as gradients land. Sharded, a chunk's gradients all go to a buffer, handed
to the data-parallel side once complete (engine.planning.sharded).
"""

from __future__ import annotations

from engine.chunks.state import TensorState
from engine.placement import rules
from engine.planning.replay_bytes import ReplayBytes

__all__ = ["ReplayGradients"]

S = TensorState


class ReplayGradients(ReplayBytes):
    """The replay's gradients (room is made by ReplayCopies, as the manager's DeviceCopies
    makes it for its Gradients)."""

    def grad(self, param: str, last: bool = True) -> None:
        """A gradient of `param` arrives: its own, or one use's of a tied one (complete
        with the `last`)."""
        self._arrival()
        chunk = self.lay.chunk_of[param]
        if self.later and self.sharding is None:
            self._add_later(param, chunk, last)
            return
        if param in self.got:
            # A later use's, or a second gradient: it adds up where the first is, no bytes.
            if last and param in self.partial:
                self.partial.discard(param)
                self._complete(param, chunk)
            return
        self.got.add(param)
        if chunk not in self.opened:
            self.opened.add(chunk)
            self.opening_bytes += self.nbytes[chunk]
        if self.sharding is not None:
            # A whole gradient buffer, resident or not (ChunkManager.add_shard_grad).
            if chunk not in self.grads:
                self.open_grads(chunk, (chunk,))
        elif chunk in self.resident or self._keeps_grad(chunk):
            # Autograd's own gradient tensor is kept (keep_slot_grad): until the update, or
            # until it goes home (rules.keeps_grad).
            nbytes = self.lay.sizes[param] * self.itemsize
            self._make_room(nbytes, (chunk,))
            self.device_bytes += nbytes
            # It is model data from now on, not non-model (the engine's count disowns it,
            # StepRunner._adopt_kept_grads); the recording frees it right after this event,
            # a drop taken here already.
            self.nm -= nbytes
            self.adopted += nbytes
            if chunk in self.resident:
                self.kept_resident += nbytes
            else:
                self.kept_grads[chunk] = self.kept_grads.get(chunk, 0) + nbytes
            self._sample()
        elif chunk not in self.grads:
            self.open_grads(chunk, (chunk,))
        if not last:
            self.partial.add(param)
            self._taken(param)
            return
        self._complete(param, chunk)

    def _add_later(self, param: str, chunk: int, last: bool) -> None:
        """A later micro-batch's gradient, added where the step's first ones are
        (Gradients.add_late_grad; a resident chunk's to those it keeps): on the host, each
        coming over from the device as it arrives. Where the payload is on disk they gather
        in a device gradient buffer again, added to what the disk holds once every
        parameter of the chunk has one."""
        self._taken(param)
        if chunk in self.resident or chunk not in self.home:
            return
        if chunk not in self.disk.chunks:
            self.copied += self.lay.sizes[param] * self.itemsize
            return
        if chunk not in self.grads:
            self.open_grads(chunk, (chunk,))
        if last and param not in self.got:
            self.got.add(param)
            self.pending[chunk] -= 1
            if self.pending[chunk] == 0:
                self.add_to_disk(chunk)

    def add_to_disk(self, chunk: int) -> None:
        """Spill.add_grads: a later micro-batch's gradients out to the host beside those on
        disk, and their sum back into the buffer (its norm is taken there), let go then."""
        self.copied += 2 * self.nbytes[chunk]
        self._grads_gone(chunk)

    def _taken(self, param: str) -> None:
        """GradientArrivals: a parameter on the device whose gradient is taken."""
        if self.state.get(param) in (S.COMPUTE, S.HOLD_AFTER_FWD):
            self._set(param, S.HOLD_AFTER_BWD)

    def _complete(self, param: str, chunk: int) -> None:
        self._taken(param)
        self.pending[chunk] -= 1
        if self.pending[chunk] == 0:
            self._close(chunk)

    def open_grads(self, chunk: int, protect: tuple[int, ...]) -> None:
        """ChunkManager.grad_buffer: a device gradient buffer for `chunk`."""
        self._make_room(self.nbytes[chunk], protect)
        self.grads.add(chunk)
        self.grad_bytes += self.nbytes[chunk]
        self.take_buffer(chunk)
        self._sample()

    def _close(self, chunk: int) -> None:
        """Every gradient of `chunk` is in, or backward is over."""
        self.opened.discard(chunk)
        self.opening_bytes -= self.nbytes[chunk]
        if self.sharding is not None:
            self.sharding.ready(chunk)
        elif chunk in self.kept_grads:
            self._send_kept_grad(chunk)
        elif chunk in self.grads:
            self._finish_grads(chunk)

    def _land(self, chunk: int) -> None:
        """A non-resident chunk's gradients land on the host (Gradients.grad_home)."""
        if self.grads_land_in_step and chunk not in self.home:
            self.landed += self.cost.landed(self.lay.numel[chunk])
        self.home.add(chunk)

    def _finish_grads(self, chunk: int) -> None:
        self._drop_ahead(chunk)  # Spill.land_grads: the payload's region gets gradients
        self.copied += self.nbytes[chunk]
        self._land(chunk)
        self._grads_gone(chunk)

    def _grads_gone(self, chunk: int) -> None:
        """The chunk's gradient buffer is let go, its gradients now with its host copy,
        which the device copy (if any) is stale against."""
        if chunk in self.on_device:
            self.stale.add(chunk)
        self.grads.discard(chunk)
        self.grad_bytes -= self.nbytes[chunk]
        self.give_buffer(chunk)
        self._sample()

    def _keeps_grad(self, chunk: int) -> bool:
        """Gradients.keeps_grad."""
        return rules.keeps_grad(len(self.lay.params[chunk]), resident=chunk in self.resident,
                                sharded=self.sharding is not None,
                                payload_on_disk=chunk in self.disk.chunks,
                                simulated=self.simulated)

    def _send_kept_grad(self, chunk: int) -> None:
        """ChunkManager._send_kept_grad: the kept gradients go home."""
        nbytes = self.kept_grads.pop(chunk)
        self.copied += nbytes
        self.device_bytes -= nbytes
        self._land(chunk)
        if chunk in self.on_device:
            self.stale.add(chunk)
        self._sample()
