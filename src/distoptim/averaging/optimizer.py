"""SCAFFOLD: replaced by the post-local-SGD work."""


class PostLocalSGDOptimizer:
    pass
