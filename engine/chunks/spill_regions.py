"""The regions of a chunk's file in the scratch folder (engine.chunks.spill), and which of
the chunk's tensors each holds."""

from __future__ import annotations

from engine.chunks.chunk import Chunk

STATE = "state"  # the state region, and the pool of buffers that carries its pieces
PAYLOAD = "payload"  # the payload region, and the pool for payload and gradient pieces
GRAD = "grad"  # fp32 only: the gradient region (carried by payload buffers)
POOL = {STATE: STATE, PAYLOAD: PAYLOAD, GRAD: PAYLOAD}


def state_parts(chunk: Chunk) -> tuple[str, ...]:
    """The chunk's tensors (attribute names) that its state region holds, in order (a
    frozen chunk has none: it has no state region, and level 1 leaves it as it is)."""
    if chunk.frozen:
        return ()
    return ("exp_avg", "exp_avg_sq") if chunk.aliased else ("master", "exp_avg", "exp_avg_sq")


def master_region(chunk: Chunk) -> str:
    """The region that holds the chunk's fp32 master: fp32's master is its payload, and a
    frozen chunk's weights are its payload whatever the precision."""
    return PAYLOAD if chunk.aliased or chunk.frozen else STATE


def update_regions(chunk: Chunk) -> tuple[str, ...]:
    """The regions the update of a chunk with state on disk reads, piece by piece, and
    writes back (but fp32's gradients, used up: engine.chunks.update_walk)."""
    if not chunk.payload_on_disk:
        return (STATE,)
    return (STATE, PAYLOAD, GRAD) if chunk.aliased else (STATE, PAYLOAD)


def host_parts(chunk: Chunk, region: str) -> tuple[str, ...]:
    """The chunk's host tensors that `region` holds (fp32's master is its payload)."""
    if region == STATE:
        return state_parts(chunk)
    return ("host_grad",) if region == GRAD else ("payload",)


def file_name(chunk: Chunk, region: str) -> str:
    """The file of the chunk's state, or of its payload (and fp32's gradients)."""
    return f"chunk-{chunk.index:05d}-{STATE if region == STATE else PAYLOAD}"
