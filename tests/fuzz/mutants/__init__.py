"""Planted bugs (mutants) and the fuzzer's score against them: ``python -m tests.fuzz.mutants`` (``__main__.py``)."""
