"""The communication device: a pure choice from the backend and the parameters' devices (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from distoptim.comm.groups import choose_comm_device

CPU, CUDA0, CUDA1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


def test_nccl_communicates_on_the_parameters_gpu_whatever_the_current_device() -> None:
    # A rank that only did model.to("cuda:1") still has cuda:0 as its current device: the parameters decide.
    assert choose_comm_device("nccl", [CUDA1, CUDA1, CUDA1]) == CUDA1
    assert choose_comm_device("nccl", [CUDA0]) == CUDA0


def test_other_backends_communicate_on_the_cpu() -> None:
    assert choose_comm_device("gloo", [CPU, CPU]) == CPU
    assert choose_comm_device("gloo", [CUDA1]) == CPU


@pytest.mark.parametrize(
    ("devices", "listed"),
    [([CUDA0, CUDA1, CUDA0], "cuda:0, cuda:1"), ([CPU, CUDA1], "cpu, cuda:1"), ([CPU], "cpu"), ([], "none")],
)
def test_nccl_refuses_parameters_not_on_one_gpu(devices: list[torch.device], listed: str) -> None:
    with pytest.raises(ValueError, match=rf"parameters are on: {listed}; move the whole model to this rank's GPU"):
        choose_comm_device("nccl", devices)
