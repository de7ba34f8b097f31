"""Planning: a step recorded on the meta device and replayed in bytes on the engine's own
layout and placement rules, to say before anything runs what fits."""
