"""The bugs of issue 32 that other branches are fixing, as triggers the fuzzer can switch off.

Each entry names the actions that trigger it in a program; ``attribute`` reruns a failing program without each
entry's triggers and names the entries whose removal alone makes it pass. A failure no entry explains is new.
"""

from __future__ import annotations

from collections.abc import Callable

from tests.fuzz.program import Action, Program

Trigger = Callable[[Program, Action], bool]

KNOWN: dict[str, tuple[str, Trigger]] = {
    "K1": ("closures under ShardedDataParallel ignored", lambda p, a: p.mode == "sdp" and a.name == "closure_step"),
    "K3": (
        "master weights stale after the model is written (model.load_state_dict, p.data.clamp_)",
        lambda p, a: bool(p.options.get("master")) and a.name in ("load_model", "clamp"),
    ),
    "K4": (
        "hyperparameter edits lost when parameters get new storage (.to(), param.data =, unfreezing)",
        lambda p, a: a.name in ("retype", "data_clone", "unfreeze"),
    ),
    "K5": (
        "model.module.zero_grad() (and p.grad = None, bare submodules) not clearing under ShardedDataParallel",
        lambda p, a: p.mode == "sdp" and a.name == "zero_grad" and a.args["via"] in ("module", "bare", "param_none"),
    ),
    "K6": ("hand-set .grad ignored by ShardedDataParallel", lambda p, a: p.mode == "sdp" and a.name == "hand_grad"),
    "K7": (
        "writes to parameters after step() overwritten under overlap_param_sync",
        lambda p, a: (
            p.mode == "sdp"
            and bool(p.options.get("overlap"))
            and a.name in ("clamp", "load_model", "retype", "data_clone")
        ),
    ),
    # found by this fuzzer (not in issue 32's list): probably K4's cause, reached through add_param_group
    "N1": (
        "hyperparameter edits (by hand or a scheduler) made before zero.add_param_group lost at the next step",
        lambda p, a: a.name == "add_group",
    ),
}
# K2 (forward pre-hooks: the `prehook` feature), K8 (the GAN discriminator cleared in place: `gan`), K9 (sparse
# gradients: `sparse`) and K10 (LBFGS) are exercised by the generator and pass: fixed on main, no trigger to avoid


def without(program: Program, bug: str) -> Program:
    trigger = KNOWN[bug][1]
    return program.replace(actions=[a for a in program.actions if not trigger(program, a)])


def triggered(program: Program) -> list[str]:
    return [bug for bug, (_, trigger) in KNOWN.items() if any(trigger(program, a) for a in program.actions)]


def avoiding_known(program: Program) -> Program:
    for bug in KNOWN:
        program = without(program, bug)
    return program
