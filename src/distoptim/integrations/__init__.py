"""Adapters for training frameworks, each in a module that imports its framework; ``import distoptim`` imports none."""
