"""Data parallel over torch.distributed: shard arithmetic and the collectives the engine
issues, each with a timeout and a failure that names the rank and the chunk.

ZeRO-3 style, as Colossal-AI's Gemini runs its chunks: every chunk is padded to a multiple
of the world size and each rank owns one contiguous shard of it (payload, fp32 master,
moments, gradient). The chunk is gathered before a module uses it and released after;
its gradients are reduce-scattered (SUM, then divided by the world size here: gloo's AVG
is not reliable) and each rank updates its own shard.

This package knows tensors, chunk indices and ranks, never chunks themselves: the chunk
manager (engine.chunks) decides when to gather and when to reduce, and asks for it here.
"""

from engine.distributed.collectives import CollectiveError, Collectives, join
from engine.distributed.shards import Shard, overlap, padded_numel

__all__ = ["CollectiveError", "Collectives", "Shard", "join", "overlap", "padded_numel"]
