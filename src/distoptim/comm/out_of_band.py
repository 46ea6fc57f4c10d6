"""Exchanges that must not ride on a process group: after a backward raised midway, ranks may have launched different
numbers of reductions on the group, so that a collective issued now would pair with another rank's reduction.
These go through the c10d store instead (the rendezvous every process group was built over), whose keys pair by
name, not by order."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["gather_through_store", "max_through_store"]

_ROUNDS: dict[str, int] = {}  # each exchange's name and ranks -> how many times this process ran it


def gather_through_store(values: Sequence[int], ranks: Sequence[int], name: str) -> list[list[int]]:
    """Every rank's ``values``, for each of the global ``ranks`` (sorted; this rank among them) in turn. Collective
    in the program's order (each of ``ranks`` calls it at the same point, as often, with the same ``ranks``), not in
    any group's; waits for the others as long as the store's timeout. Three store requests per rank (a set, a
    delete of its key of the round before last, a multi_get): what the store holds stays bounded."""
    exchange = f"distoptim/{name}/{','.join(map(str, ranks))}"
    round_ = _ROUNDS.get(exchange, 0)
    _ROUNDS[exchange] = round_ + 1
    store = dist.distributed_c10d._get_default_store()
    prefix = f"{exchange}/{round_}/"
    store.set(prefix + str(dist.get_rank()), ",".join(map(str, values)))
    if round_ >= 2:  # every rank wrote the last round, so every rank has read the one before: its keys go
        _delete(store, f"{exchange}/{round_ - 2}/{dist.get_rank()}")
    texts = [text.decode() for text in store.multi_get([prefix + str(rank) for rank in ranks])]  # one request
    return [[int(value) for value in text.split(",") if value] for text in texts]


def _delete(store: dist.Store, key: str) -> None:
    with contextlib.suppress(RuntimeError, NotImplementedError):  # a store that cannot delete keeps two per exchange
        store.delete_key(key)


def max_through_store(values: Sequence[int], groups: Sequence[ProcessGroup], name: str) -> list[int]:
    """The elementwise maxima of ``values`` over the union of ``groups`` (a shard group and its replicas: the
    maxima over each group in turn are the maxima over all of them), through the store."""
    maxima = list(values)
    for group in groups:
        everyone = gather_through_store(maxima, sorted(dist.get_process_group_ranks(group)), name)
        maxima = [max(column) for column in zip(*everyone)]
    return maxima
