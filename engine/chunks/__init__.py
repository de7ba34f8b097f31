"""Chunks and their layout: flat buffers of parameters, how a model is packed into them, the
states a parameter passes through, and the manager that moves chunk bytes between tiers."""
