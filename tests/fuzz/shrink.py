"""Shrinking a failing program: drop actions, model features and mode options while it still fails the same way.

Each round builds every one-step-simpler candidate, runs them all in one session and keeps the first that still
fails with the same category; it stops when no candidate does (a local minimum: every remaining piece matters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from tests.fuzz.program import Action, Program

SIMPLER_OPTIONS = {"partition": "greedy", "bucket_view": False, "master": False, "overlap": False}


def candidates(program: Program) -> Iterator[Program]:
    for index in range(len(program.actions)):
        yield program.replace(actions=program.actions[:index] + program.actions[index + 1 :])
    for index, action in enumerate(program.actions):
        for simpler in _simpler_actions(action):
            yield program.replace(actions=[*program.actions[:index], simpler, *program.actions[index + 1 :]])
    for feature in program.features:
        features = [f for f in program.features if f != feature]
        options = dict(program.options)
        if feature == "bf16":
            options["master"] = False
        yield program.replace(features=features, options=options)
    for key, value in SIMPLER_OPTIONS.items():
        if key in program.options and program.options[key] != value:
            yield program.replace(options={**program.options, key: value})
    if program.optimizer != "SGD":
        yield program.replace(optimizer="SGD", kwargs={"lr": 0.05})


def _simpler_actions(action: Action) -> Iterator[Action]:
    if action.name == "backward" and action.args["micro"] > 1:
        yield Action("backward", {"micro": 1, "no_sync": False})
    if action.name == "zero_grad" and action.args != {"via": "optimizer", "set_to_none": True}:
        yield Action("zero_grad", {"via": "optimizer", "set_to_none": True})


def shrink(
    program: Program, category: str, run: Callable[[list[Program]], list[dict[str, Any]]], rounds: int = 40
) -> Program:
    """The smallest program found that ``run`` still classifies as ``category``."""
    for _ in range(rounds):
        options = list(candidates(program))
        if not options:
            break
        verdicts = run(options)
        kept = next((p for p, v in zip(options, verdicts) if v["category"] == category), None)
        if kept is None:
            break
        program = kept
    return program
