"""Post-local SGD: the model averagers (public in ``distoptim.averagers``) and the optimizer wrapper that runs them."""

from distoptim.averaging.optimizer import PostLocalSGDOptimizer

__all__ = ["PostLocalSGDOptimizer"]
