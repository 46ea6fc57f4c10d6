"""What ``help()`` shows a user: the public classes and hooks document their arguments and show an example."""

from __future__ import annotations

import inspect

import pytest

from distoptim import DistributedOptimizer, PostLocalSGDOptimizer, ZeroRedundancyOptimizer
from distoptim.hooks import hook_with_zero_step, hook_with_zero_step_interleaved, reduce_to_owners_hook


@pytest.mark.parametrize("documented", [ZeroRedundancyOptimizer, DistributedOptimizer, hook_with_zero_step])
def test_public_entry_points_have_args_and_an_example(documented: object) -> None:
    doc = inspect.getdoc(documented) or ""
    assert "Args:" in doc and "Example" in doc, f"{documented}: no Args section or example"
    for name in inspect.signature(documented).parameters:  # type: ignore[arg-type]
        if name not in ("self", "args", "kwargs", "defaults"):
            assert name in doc, f"{documented}: argument {name!r} is not documented"


@pytest.mark.parametrize("hook", [hook_with_zero_step_interleaved, reduce_to_owners_hook, PostLocalSGDOptimizer])
def test_other_public_pieces_say_more_than_one_line(hook: object) -> None:
    doc = inspect.getdoc(hook) or ""
    assert len(doc.splitlines()) > 3, f"{hook}: a one-line docstring"
