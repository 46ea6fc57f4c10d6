"""The ``python -m distoptim demo`` program: a small transformer LM trained with DDP + ZeroRedundancyOptimizer.

Modules, one job each: ``config`` (model shapes, plain data) and ``model`` (the GPT-shaped network), ``source``
(finding and checking the text) and ``data`` (tokens and batches), ``launch`` (local gloo ranks with one-line
failures), ``train`` (one rank's loop), ``progress`` and ``report`` (rank 0's bar, the closing table), ``options``
and ``cli`` (the command line). The benchmark (``benchmarks/bench_zero.py``) reuses ``model`` and ``launch``.
"""

from distoptim.demo.cli import main

__all__ = ["main"]
