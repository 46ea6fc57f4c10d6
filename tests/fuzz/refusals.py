"""Every documented refusal a fuzz program can meet: the scenario that predicts it and the message it must match.

A program's verdict (``session.classify``) is *refused* only where this table predicts a refusal from the program's
plain data, decided before it runs (mode, model features, actions, optimizer, options, world size), and the
message every rank raised matches that entry's pattern. Any other error raised on every rank is
``unexpected_error``; a predicted refusal that never comes is ``missing_refusal``. Each scenario follows the
library's documented rule (the guides, the raise sites), walked over the program's actions where the rule depends
on what came before (``_Walk``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tests.fuzz.program import Action, Program

# actions that run a backward through the wrapper (``gan``: the generator's; ``reshard``: one step at 1 rank, one at W)
BACKWARDS = ("backward", "closure_step", "scaler_step", "gan", "reshard", "failed_backward")
STEPPING = ("step", "closure_step", "scaler_step", "gan", "reshard")  # actions that end with a step


@dataclass(frozen=True)
class Refusal:
    kind: str
    scenario: str  # in words, for the README's table
    message: str  # a regex searched in "<type>: <message>" of the error every rank raised
    predicts: Callable[[Program, int], bool]  # (program, world size) -> whether it must be refused
    # where the rule leaves it open (an action between whose effect on it the table does not model): it may come
    allows: Callable[[Program, int], bool] = lambda p, w: False
    # a refusal the library defers by design (only an agreement can raise it on every rank): from this action on,
    # until the refusal comes, the program's values may differ from the oracle's (None: never)
    stale_from: Callable[[Program], int | None] = lambda p: None

    def matches(self, text: str) -> bool:
        return re.search(self.message, text) is not None


def _sparse(program: Program, mode: str) -> bool:
    return "sparse" in program.features and program.mode == mode


def _sparse_zero2(program: Program, _: int) -> bool:
    """reduce_to_owners_hook refuses at its first call: the first backward through DDP."""
    return _sparse(program, "zero2_hook") and any(a.name in BACKWARDS for a in program.actions)


def sparse_at_even_step(program: Program, _: int = 0) -> bool:
    """A sparse gradient at a step (or a clip) under partition="even": a step whose gradient a backward left, not
    set to None since, or a step that runs its own backward. Refused only where the partition cuts the embedding,
    which the placement decides (at 3 ranks it may own it whole: seed 661324): allowed here, and the interpreter's
    end comparison fails a program that stepped it cut without the refusal."""
    if "sparse" not in program.features or program.options.get("partition") != "even":
        return False
    held = False
    for action in program.actions:
        if action.name in ("closure_step", "gan", "reshard") or (action.name in ("step", "clip") and held):
            return True
        if action.name in BACKWARDS:
            held = True
        elif action.name == "zero_grad" and action.args["set_to_none"]:
            held = False
        elif action.name == "resume":
            held = False  # a model built anew: no gradient
    return False


def _lands(action: Action) -> bool:
    """Whether ``action`` lands ShardedDataParallel's parameter sync: a forward (the submodules' pre-hooks), a read
    through the wrapper (``parameters()``, ``state_dict``; a load), the optimizer's checkpoints, the comparisons."""
    if action.name in ("backward", "eval", "hand_grad", "closure_step", "scaler_step", "gan", "failed_backward"):
        return True
    if action.name in ("check", "load_optim", "load_model", "resume", "reshard", "add_group"):
        return True
    return action.name == "zero_grad" and action.args["via"] == "wrapper"


def _compared_each_step(program: Program) -> bool:
    """interpret.Run.do compares (landing the sync) after every step of a program with a bf16 layer or one that
    clips under an adaptive optimizer."""
    clips = any(a.name == "clip" or (a.name == "scaler_step" and a.args.get("clip")) for a in program.actions)
    return "bf16" in program.features or (program.optimizer != "SGD" and clips)


def _in_flight_writes(program: Program) -> Iterator[tuple[int, Action]]:
    """The actions that write parameters while ShardedDataParallel(overlap_param_sync=True)'s sync is in flight."""
    if program.mode != "sdp" or not program.options.get("overlap"):
        return
    in_flight: set[str] = set()  # the layers whose sync the last step launched (trained then)
    trained = {"body", "head"}
    for index, action in enumerate(program.actions):
        if action.name in ("retype", "data_clone", "clamp") and action.args["layer"] in in_flight:
            yield index, action
        if _lands(action):
            in_flight = set()
        if action.name in STEPPING and not (_compared_each_step(program) and action.name != "reshard"):
            in_flight = set(trained)  # (seed 500326: a layer unfrozen after the step is not in its sync)
        if action.name == "unfreeze" and "frozen" in program.features:
            trained.add("frozen")
        if action.name == "add_group" and "extra" in program.features:
            trained.add("extra")


def _new_storage_in_flight(program: Program, _: int) -> bool:
    return any(a.name in ("retype", "data_clone") for _, a in _in_flight_writes(program))


def _first_write_in_flight(program: Program) -> int | None:
    """The first ``clamp`` while the sync is in flight: the landing overwrites it on the ranks not owning those
    elements, and forwards before the next agreement (a step, a checkpoint) run on the ranks' different values (the
    SDP guide: only an agreement can raise it on every rank)."""
    return next((index for index, a in _in_flight_writes(program) if a.name == "clamp"), None)


def _write_in_flight(program: Program, _: int) -> bool:
    return _first_write_in_flight(program) is not None


_REFUSING = ("backward", "closure_step", "scaler_step", "gan", "step", "clip", "eval")


def _poisoned(program: Program) -> str:
    """SDP: "must" where a ``failed_backward`` reached a gradient before it raised (it failed in ``body``, after
    ``head`` and ``out``; or in ``head`` after an untied ``out``) and its clear goes through ``zero``/the wrapper, or a
    forward through the wrapper, a step or a clip follows before a new subject (resume, reshard): each refuses where
    a bucket was launched ("restart from a checkpoint"); "may" where the failing layer may have reached nothing."""
    cleared_elsewhere = ""
    for index, action in enumerate(program.actions):
        if action.name != "failed_backward":
            continue
        sure = action.args["layer"] == "body" or "tied" not in program.features
        refused = action.args["via"] in ("optimizer", "wrapper")
        for later in program.actions[index + 1 :]:
            if refused or later.name in ("resume", "reshard"):
                break
            refused = later.name in _REFUSING or (
                later.name == "zero_grad" and later.args["via"] in ("optimizer", "wrapper")
            )
        if refused:
            return "must" if sure else "may"
        cleared_elsewhere = "may"  # not through zero or the wrapper: the end's consolidation may re-place, and refuse
    return cleared_elsewhere


TABLE: tuple[Refusal, ...] = (
    Refusal(
        "lbfgs",
        "optimizer LBFGS, any mode (at construction)",
        r"^ValueError: torch\.optim\.LBFGS couples every parameter in one step",
        lambda p, w: p.optimizer == "LBFGS",
    ),
    Refusal(
        "sparse_sdp",
        "feature `sparse` under `sdp` (at wrapping)",
        r"^ValueError: ShardedDataParallel reduces dense gradients only",
        lambda p, w: _sparse(p, "sdp"),
    ),
    Refusal(
        "sparse_overlap_hook",
        "feature `sparse` under `overlap_hook` (at the hook's registration)",
        r"^ValueError: the overlap hook reduces dense gradients only",
        lambda p, w: _sparse(p, "overlap_hook"),
    ),
    Refusal(
        "sparse_zero2_hook",
        "feature `sparse` under `zero2_hook`, with any backward (the hook's first call)",
        r"^ValueError: reduce_to_owners_hook reduces dense gradients only",
        _sparse_zero2,
    ),
    Refusal(
        "sparse_even",
        'feature `sparse`, `partition="even"`: a step or clip while the sparse gradient is held, where the partition '
        "cuts the embedding (the step's agreement; the interpreter checks the cut)",
        r"^ValueError: partition='even' cuts parameters into pieces, and a sparse gradient",
        lambda p, w: False,
        allows=sparse_at_even_step,
    ),
    Refusal(
        "sdp_even_state",
        '`sdp`, `partition="even"`, Adagrad (its state exists at construction; the re-cut into buckets moves it)',
        r"^RuntimeError: ShardedDataParallel re-cuts an even partition into buckets",
        lambda p, w: p.mode == "sdp" and p.options.get("partition") == "even" and p.optimizer == "Adagrad",
    ),
    Refusal(
        "sdp_new_storage_in_flight",
        "`sdp`, `overlap_param_sync=True`: `retype`/`data_clone` after a step, before anything lands the sync",
        r"^RuntimeError: ShardedDataParallel\(overlap_param_sync=True\): parameters were given new storage",
        _new_storage_in_flight,
    ),
    Refusal(
        "sdp_write_in_flight",
        "`sdp`, `overlap_param_sync=True`: `clamp` of a trained layer or `load_model` through the module after a "
        "step, before anything lands the sync",
        r"^RuntimeError: ShardedDataParallel\(overlap_param_sync=True\): parameters were written while their sync",
        _write_in_flight,
        stale_from=_first_write_in_flight,
    ),
    Refusal(
        "sdp_failed_backward",
        "`sdp`: `failed_backward` that launched a bucket's reduction, then a clear through `zero`/the wrapper, a "
        "forward, a step or a clip (a restart from a checkpoint is the recovery, as after DDP's); one that launched "
        "none, until `zero.zero_grad()`/`model.zero_grad()` (which one depends on the buckets: allowed, not "
        "predicted); a subject built again (resume, reshard) where the ranks launched different reductions: its "
        "construction",
        r"^(RuntimeError: ShardedDataParallel: (a backward raised after|the last backward raised before it finished)"
        r"|ValueError: ShardedDataParallel construction: rank \d+ and rank \d+ disagree \(reductions and syncs)",
        lambda p, w: False,
        lambda p, w: _poisoned(p) != "",
    ),
    Refusal(
        "adafactor_eps1",
        "Adafactor over a bf16 head and fp32 layers without master weights, `eps` left to torch",
        r"^ValueError: param group \d+ \(torch\.optim\.Adafactor\) steps parameters of dtypes",
        lambda p, w: (
            p.optimizer == "Adafactor"
            and "bf16" in p.features
            and not p.options.get("master")
            and "eps" not in p.kwargs
        ),
    ),
)


def predicted(program: Program, world_size: int) -> list[Refusal]:
    """The refusals ``program`` must meet at ``world_size`` ranks (one of them, whichever comes first)."""
    return [refusal for refusal in TABLE if refusal.predicts(program, world_size)]


def matching(program: Program, world_size: int, text: str) -> Refusal | None:
    """The refusal, predicted or allowed for ``program``, whose pattern ``text`` ("<type>: <message>") matches."""
    return next(
        (r for r in TABLE if (r.predicts(program, world_size) or r.allows(program, world_size)) and r.matches(text)),
        None,
    )
