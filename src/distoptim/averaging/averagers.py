"""SCAFFOLD: replaced by the post-local-SGD work."""


class ModelAverager:
    pass


class PeriodicModelAverager(ModelAverager):
    pass


class HierarchicalModelAverager(ModelAverager):
    pass
