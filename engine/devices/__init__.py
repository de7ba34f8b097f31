"""Devices and tiers: where chunk bytes live (the simulated device, CUDA) and how the memory
they hold is measured."""
