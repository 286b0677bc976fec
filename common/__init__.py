"""Shared pieces of the tutorial: model, data, the one training loop, distributed helpers, checkpoints, config."""
