"""Models: the zoo of configs built without a network hub, and local checkpoint folders."""
