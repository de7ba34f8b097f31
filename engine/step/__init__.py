"""The step: the public Engine facade, the hooks that drive chunk movement while the model
runs, and the AdamW update over chunks."""
