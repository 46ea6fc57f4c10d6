"""Adapters for training frameworks. Each lives in a module of its own that imports its framework when it is itself
imported (``import distoptim.integrations.transformers`` needs ``transformers``); ``import distoptim`` imports none.
"""
