"""PyTorch's in-wheel tests of model averaging, post-local SGD and ``DistributedOptimizer``, run against distoptim.

``torch_suites`` rebinds the names torch's test modules imported to distoptim's, inside each rank, and runs torch's
test methods unchanged (issue 44): a failure, an error or a skip fails here. The patching is shown real in the
ranks: torch's bodies reach distoptim's objects, a deliberately broken averager makes torch's test fail, and every
``DistributedOptimizer`` torch's RPC tests build is counted as distoptim's.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import tempfile
import unittest
from typing import Any

import pytest

import distoptim
from tests._dist import run_on_ranks
from tests.compat import torch_suites

AT_FOUR = {
    "test_3_level_hierarchical_model_averager",  # torch requires exactly 4 ranks
    "test_post_localSGD_optimizer_parity_with_hierarchical_sgd",  # gated on 4 GPUs: subgroups of 2 within 4
    "test_post_localSGD_optimizer_parity_with_hierarchical_sgd_grad_is_view",
}
AT_TWO = set(torch_suites.selected_distributed_tests()) - AT_FOUR
RPC_TESTS = ["test_dist_optim", "test_dist_optim_exception", "test_dist_optim_exception_on_constructor",
             "test_dist_optim_none_grads"]  # fmt: skip


class _NeverAverages(distoptim.averagers.PeriodicModelAverager):
    """A broken averager: counts steps, averages nothing."""

    def average_parameters(self, params: Any) -> None:
        self.step += 1


def _distributed_body(rank: int, world_size: int, names: list[str], store_dir: str) -> list[str]:
    module = torch_suites.import_distributed_test(world_size, store_dir)
    case = torch_suites.new_case(module.DistributedTest._DistTestBase, rank, world_size)
    for name in names:
        torch_suites.run_in_fresh_group(case, name, torch_suites.runnable_body(type(case), name), store_dir)
    if world_size == 2:  # the patching is real: a broken distoptim averager fails torch's test
        module.averagers = type("broken", (), {"PeriodicModelAverager": _NeverAverages})
        name = "test_periodic_model_averager"
        with pytest.raises(AssertionError):
            torch_suites.run_in_fresh_group(
                case, f"broken-{name}", torch_suites.runnable_body(type(case), name), store_dir
            )
    return names


def _run(body: Any, world_size: int, *args: Any) -> list[Any]:
    store_dir = tempfile.mkdtemp(prefix="distoptim-compat-")
    try:
        return run_on_ranks(body, world_size, *args, store_dir, backend=None, timeout=240)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)


def test_the_selection_covers_torchs_averaging_tests() -> None:
    names = torch_suites.selected_distributed_tests()
    assert len(names) >= 11, names  # torch 2.13 has 11; fewer means the patterns no longer find them
    assert set(names) >= AT_FOUR
    rpc_source = (torch_suites.DISTRIBUTED_TEST.parent / "rpc" / "dist_optimizer_test.py").read_text()
    assert sorted(re.findall(r"^    def (test_\w+)\(", rpc_source, flags=re.MULTILINE)) == RPC_TESTS


def test_torchs_averaging_and_post_local_sgd_tests_pass_at_two_ranks() -> None:
    assert _run(_distributed_body, 2, sorted(AT_TWO)) == [sorted(AT_TWO)] * 2


def test_torchs_averaging_and_post_local_sgd_tests_pass_at_four_ranks() -> None:
    assert _run(_distributed_body, 4, sorted(AT_FOUR)) == [sorted(AT_FOUR)] * 4


# -------------------------------------------------------------------------------------------- DistributedOptimizer


class _Counted(distoptim.DistributedOptimizer):
    """distoptim's DistributedOptimizer, counting how many torch's test built in this rank."""

    built = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        type(self).built += 1
        super().__init__(*args, **kwargs)


def _rpc_body(rank: int, world_size: int, name: str, store_dir: str) -> int:
    """One of torch's tests in fresh processes, as torch runs them (RPC starts once per process); how many
    distoptim DistributedOptimizers it built in this rank (the patching is real where that is not 0)."""
    from torch.testing._internal.distributed.rpc import dist_optimizer_test as module
    from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
        TensorPipeRpcAgentTestFixture,
    )

    module.DistributedOptimizer = _Counted  # type: ignore[attr-defined]
    fixture = type("TensorPipeDistOptimizerTest", (TensorPipeRpcAgentTestFixture, module.DistOptimizerTest), {})
    case = torch_suites.new_case(fixture, rank, world_size)
    assert case.world_size == world_size
    case.file_name = os.path.join(store_dir, "rpc-store")
    torch_suites.runnable_body(fixture, name)(case)  # torch's dist_init: init_rpc, the test, shutdown
    return _Counted.built


@pytest.mark.parametrize("name", RPC_TESTS)
def test_torchs_distributed_optimizer_tests_pass(name: str) -> None:
    built = _run(_rpc_body, 4, name)
    assert sum(built) > 0, f"torch's {name} built no distoptim DistributedOptimizer: {built}"


def test_a_skip_or_an_unknown_decorator_fails_and_only_the_gpu_gate_is_bypassed() -> None:
    """What ``runnable_body`` strips and refuses, on stand-ins built with torch's own decorators."""
    from torch.testing._internal.common_distributed import skip_if_lt_x_gpu, skip_if_odd_worldsize

    def body(case: Any) -> str:
        return "ran"

    def unknown_layer(func: Any) -> Any:
        return functools.wraps(func)(lambda *args: func(*args))

    class Stand:
        gated = skip_if_lt_x_gpu(2)(skip_if_odd_worldsize(body))
        skipped = unittest.skip("needs a GPU")(skip_if_lt_x_gpu(2)(body))
        wrapped = skip_if_lt_x_gpu(2)(unknown_layer(body))

    kept = torch_suites.runnable_body(Stand, "gated")
    assert kept.__code__.co_qualname == "skip_if_odd_worldsize.<locals>.wrapper"
    with pytest.raises(AssertionError, match="torch skips it here"):
        torch_suites.runnable_body(Stand, "skipped")
    with pytest.raises(AssertionError, match="not reviewed"):
        torch_suites.runnable_body(Stand, "wrapped")
