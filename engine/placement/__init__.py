"""The placement rules: policies, the warm-up trace, and pure functions over chunk indices and
byte counts that decide which chunk stays, which goes and how much room is left. The chunk
manager carries them out on tensors, the planner's replay on counters."""
