"""The communication device: a pure choice from the backend and the parameters' devices (no GPU needed)."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from distoptim.comm.collectives import Collectives, choose_collectives
from distoptim.comm.groups import backends_of, choose_comm_device
from tests._dist import run_on_ranks

CPU, CUDA0, CUDA1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
NCCL, GLOO, PAIR = {"cuda": "nccl"}, {"cpu": "gloo", "cuda": "gloo"}, {"cpu": "gloo", "cuda": "nccl"}


def test_nccl_communicates_on_the_parameters_gpu_whatever_the_current_device() -> None:
    # A rank that only did model.to("cuda:1") still has cuda:0 as its current device: the parameters decide.
    assert choose_comm_device(NCCL, [CUDA1, CUDA1, CUDA1]) == CUDA1
    assert choose_comm_device(NCCL, [CUDA0]) == CUDA0


def test_other_backends_communicate_on_the_cpu() -> None:
    assert choose_comm_device(GLOO, [CPU, CPU]) == CPU
    assert choose_comm_device(GLOO, [CUDA1]) == CPU
    assert choose_comm_device(PAIR, [CPU]) == CPU  # "cpu:gloo,cuda:nccl" with the model on the CPU: its gloo


def test_a_gloo_and_nccl_pair_communicates_on_the_gpu_its_nccl_carries() -> None:
    assert choose_comm_device(PAIR, [CUDA1, CUDA1]) == CUDA1  # norms and flags made on the GPU stay there


@pytest.mark.parametrize(
    ("devices", "listed"),
    [([CUDA0, CUDA1, CUDA0], "cuda:0, cuda:1"), ([CPU, CUDA1], "cpu, cuda:1"), ([CPU], "cpu"), ([], "none")],
)
def test_nccl_refuses_parameters_not_on_one_gpu(devices: list[torch.device], listed: str) -> None:
    with pytest.raises(ValueError, match=rf"parameters are on: {listed}; move the whole model to this rank's GPU"):
        choose_comm_device(NCCL, devices)


def _backends_body(rank: int, world_size: int) -> list[Any]:
    dist.init_process_group(rank=rank, world_size=world_size)  # no backend: torch picks one per device type
    try:
        world = dist.group.WORLD
        assert world is not None
        return [str(dist.get_backend(world)), backends_of(world), choose_collectives(world)]
    finally:
        dist.destroy_process_group()


def test_backends_are_read_from_the_config_not_the_backend_name() -> None:
    """``init_process_group()`` without a backend reports "undefined" (on a CUDA machine it makes NCCL alone, which
    takes no CPU tensor): the config says which device types the group carries; on this CPU machine, gloo's."""
    name, world, style = run_on_ranks(_backends_body, 2, backend=None)[0]
    assert (name, world) == ("undefined", {"cpu": "gloo"})
    assert style is Collectives.POINT_TO_POINT  # gloo's style, as for a group made with backend="gloo"


@pytest.mark.parametrize(
    ("config", "backends"),
    [("cuda:nccl", NCCL), ("cpu:gloo,cuda:gloo", GLOO), ("cpu:gloo,cuda:nccl", PAIR)],
)
def test_a_config_names_each_device_types_backend(config: str, backends: dict[str, str]) -> None:
    with mock.patch.object(dist, "get_backend_config", lambda group: config):
        assert backends_of(mock.sentinel.group) == backends
