"""Random user programs for the differential fuzzer: plain data, printable as Python-like text, no torch.distributed.

A ``Program`` is a model spec (which features the model zoo's one configurable model has), a mode (how distoptim
is set up: ZeRO-1 under DDP, the ZeRO-2 hook, ShardedDataParallel, the overlap hooks), an optimizer and a list of
actions (``zero_grad``, ``backward``, ``step`` ... see ``ACTIONS``). ``generate(seed)`` is pure: the same seed gives
the same program; ``Program.to_json``/``from_json`` carry a (shrunk) program to the command line.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from typing import Any

# The model zoo's switches (tests/fuzz/models.py says what each adds).
MODEL_FEATURES = (
    "groups3",
    "tied",
    "unused",
    "rank_branch",
    "odd_branch",
    "frozen",
    "extra",
    "bf16",
    "batchnorm",
    "conv",
)
# drawn from a second random stream (``_widen``), so the programs of earlier seeds keep what they had
NEW_FEATURES = ("prehook", "sparse", "transposed", "wide")

MODES = ("zero1", "zero2_hook", "sdp", "overlap_hook")

OPTIMIZERS: dict[str, list[dict[str, Any]]] = {
    "SGD": [{"lr": 0.05}, {"lr": 0.05, "momentum": 0.9}, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}],
    "Adam": [{"lr": 0.01}, {"lr": 0.01, "weight_decay": 0.01}],
    "AdamW": [{"lr": 0.01, "weight_decay": 0.1}],
    "RMSprop": [{"lr": 0.01}],
    "Adagrad": [{"lr": 0.05}],
    "NAdam": [{"lr": 0.01}],
}

# Hyperparameters beyond the step size, one set drawn per program from its own stream (``_hyperparameters``): a
# library that drops, renames or fails to save one of them trains wrong with no error (issue 42's third review)
HYPERPARAMETERS: dict[str, list[dict[str, Any]]] = {
    "SGD": [{"momentum": 0.9, "nesterov": True, "dampening": 0.0}, {"momentum": 0.9, "dampening": 0.5}],
    "Adam": [{"betas": (0.8, 0.95)}, {"amsgrad": True}, {"eps": 1e-6, "maximize": True}],
    "AdamW": [{"betas": (0.8, 0.95), "amsgrad": True}, {"eps": 1e-6}],
    "RMSprop": [{"momentum": 0.5, "centered": True}, {"alpha": 0.9, "maximize": True}],
    "Adagrad": [{"lr_decay": 0.01, "initial_accumulator_value": 0.1}, {"eps": 1e-6, "maximize": True}],
    "NAdam": [{"momentum_decay": 0.002}, {"betas": (0.8, 0.95), "decoupled_weight_decay": True}],
}

# Optimizers that are not elementwise: distoptim owns each of their tensors whole (drawn in ``_widen``); no
# functional counterpart, so not under the overlap hooks (refused at construction, on every rank)
WHOLE_TENSOR_OPTIMIZERS: dict[str, list[dict[str, Any]]] = {
    "Adafactor": [{"lr": 0.01}, {"lr": 0.01, "weight_decay": 0.1}],
    # torch.optim.Muon on the hidden matrices (groups naming it, lr 0.02), AdamW with these on the rest
    "Muon": [{"lr": 0.01, "weight_decay": 0.1}],
}

# Every action the interpreter knows, with the modes it makes sense in (None: all). Steps are built as blocks
# (zero_grad, backward or hand_grad, maybe clip, step); the others are sprinkled between blocks.
ACTIONS: dict[str, tuple[str, ...] | None] = {
    "zero_grad": None,
    "backward": None,
    "hand_grad": ("zero1", "zero2_hook", "sdp"),
    "clip": ("zero1", "zero2_hook", "sdp"),
    "step": None,
    "closure_step": ("zero1", "zero2_hook", "sdp"),
    "scaler_step": ("zero1", "zero2_hook", "sdp"),
    "sched_step": None,
    "edit_lr": None,
    # from a ninth stream (``_hyper_edits``): every other hyperparameter the group holds, edited between steps
    "edit_hyper": None,
    "eval": None,
    # DDP must be wrapped again after these; the overlap hooks refuse a second DDP for their ZeRO (documented)
    "retype": ("zero1", "zero2_hook", "sdp"),
    "data_clone": ("zero1", "zero2_hook", "sdp"),
    "unfreeze": ("zero1", "zero2_hook", "sdp"),
    "add_group": ("zero1", "zero2_hook", "sdp"),
    "load_model": None,
    "load_optim": None,
    "resume": None,
    "clamp": None,
    "check": None,
    # drawn from the second stream: a GAN round with a discriminator cleared in place; a terminal resume at 1 rank
    # and back at the session's world size
    "gan": ("zero1", "zero2_hook", "sdp"),
    "reshard": ("zero1", "zero2_hook", "sdp"),
    # from a third stream: a backward that raises midway (in a layer's backward), then a clear through some object;
    # SDP's documented recovery (DDP itself has none to compare with: its reducer is left mid-iteration)
    "failed_backward": ("sdp",),
}
BETWEEN = (
    "sched_step",
    "edit_lr",
    "eval",
    "retype",
    "data_clone",
    "unfreeze",
    "add_group",
    "load_model",
    "load_optim",
    "resume",
    "clamp",
    "check",
)
LAYERS = ("body", "head", "frozen", "extra")  # layers an action may name (models.py)


@dataclass
class Action:
    name: str
    args: dict[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in self.args.items())})"


@dataclass
class Program:
    seed: int
    features: list[str]
    mode: str
    options: dict[str, Any]  # the mode's settings: partition, bucket_view, master, overlap, stepping
    optimizer: str
    kwargs: dict[str, Any]
    actions: list[Action]

    def text(self) -> str:
        lines = [
            f"# fuzz program, seed {self.seed}",
            f"model = Model({', '.join(self.features) or 'plain'})",
            f"mode = {self.mode}({', '.join(f'{k}={v!r}' for k, v in self.options.items())})",
            f"optimizer = {self.optimizer}({', '.join(f'{k}={v!r}' for k, v in self.kwargs.items())})",
        ]
        return "\n".join(lines + [a.text() for a in self.actions])

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> Program:
        data = json.loads(text)
        data["actions"] = [Action(**a) for a in data["actions"]]
        return Program(**data)

    def replace(self, **changes: Any) -> Program:
        return dataclasses.replace(self, **changes)


def _mode_options(rng: random.Random, mode: str, features: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {"partition": rng.choice(["greedy", "even"]), "bucket_view": rng.random() < 0.5}
    options["master"] = "bf16" in features and rng.random() < 0.7
    if mode == "sdp":
        options["overlap"] = rng.random() < 0.5
    if mode == "overlap_hook":
        options["stepping"] = rng.choice(["hook", "interleaved"])
    return options


def _step_block(rng: random.Random, mode: str, allowed: set[str]) -> list[Action]:
    block = []
    if "zero_grad" in allowed:
        via = rng.choice(["optimizer", "wrapper", "module", "bare", "param_none"])
        block.append(Action("zero_grad", {"via": via, "set_to_none": rng.random() < 0.6}))
    use = {a for a in ("closure_step", "scaler_step") if a in allowed and mode in (ACTIONS[a] or MODES)}
    kind = rng.choice(["step"] * 4 + sorted(use)) if "step" in allowed or use else None
    if kind == "closure_step":
        block.append(Action("closure_step"))
        return block
    if kind == "scaler_step":  # its own scaled backward (scaler.scale(loss).backward())
        block.append(Action("scaler_step", {"clip": rng.random() < 0.5}))
        return block
    if "hand_grad" in allowed and mode in (ACTIONS["hand_grad"] or ()) and rng.random() < 0.15:
        block.append(Action("hand_grad"))
    elif "backward" in allowed:
        micro = rng.choice([1, 1, 2, 3])
        block.append(Action("backward", {"micro": micro, "no_sync": micro > 1 and rng.random() < 0.6}))
    if "clip" in allowed and mode in (ACTIONS["clip"] or ()) and rng.random() < 0.3:
        block.append(
            Action("clip", {"max_norm": rng.choice([0.05, 0.5, 10.0]), "norm_type": rng.choice([2.0, 1.0, "inf"])})
        )
    if kind is not None:
        block.append(Action("step"))
    return block


def _between(rng: random.Random, name: str, features: list[str]) -> Action:
    layers = [layer for layer in LAYERS if layer in ("body", "head") or layer in features]
    if name == "edit_lr":
        return Action(name, {"group": rng.randrange(2), "factor": rng.choice([0.5, 2.0])})
    if name == "eval":
        return Action(name, {"mode_switch": rng.random() < 0.5})
    if name in ("retype", "data_clone", "clamp"):
        return Action(name, {"layer": rng.choice(layers)})
    if name == "load_model":
        return Action(name, {"via": rng.choice(["module", "wrapper"]), "scale": rng.choice([0.5, 0.9])})
    if name == "resume":
        return Action(name, {"kind": rng.choice(["sharded", "consolidated"])})
    return Action(name)


def _hyperparameters(seed: int, optimizer: str) -> dict[str, Any]:
    """Half the programs keep torch's defaults; the others take one of ``HYPERPARAMETERS``'s sets, from a stream of
    their own so that a seed's model, mode and actions stay what they were before these were drawn (under the
    overlap hooks ``_overlap_turn`` decides instead)."""
    sets = HYPERPARAMETERS.get(optimizer, [])
    stream = random.Random(seed * 7919 + 17)
    return dict(stream.choice(sets)) if sets and stream.random() < 0.5 else {}


# under the overlap hooks, every optimizer they take with each of its sets in turn (``_overlap_turn``)
OVERLAP_TURNS = [(o, dict(chosen)) for o, sets in HYPERPARAMETERS.items() if o != "NAdam" for chosen in sets]
OVERLAP_DEFAULTS = 3  # turns of a cycle that keep the drawn optimizer with torch's defaults


def _overlap_turn(seed: int, optimizer: str, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """An ``overlap_hook`` program's optimizer and settings: the overlap hooks step through a functional optimizer
    of their own (``zero/overlap.py``), so each of ``HYPERPARAMETERS``'s sets (but NAdam's, refused there) comes in
    turn over the seeds, with ``OVERLAP_DEFAULTS`` turns in a cycle keeping what was drawn with torch's defaults
    (review r-42d: no CI ``overlap_hook`` program drew nesterov, and an overlap step that dropped it passed)."""
    turn = (seed // len(MODES)) % (len(OVERLAP_TURNS) + OVERLAP_DEFAULTS)
    if turn >= len(OVERLAP_TURNS):
        return optimizer, {k: v for k, v in kwargs.items() if k in OPTIMIZERS[optimizer][-1]}
    chosen, settings = OVERLAP_TURNS[turn]
    return chosen, {**OPTIMIZERS[chosen][-1], **settings}


# what ``edit_hyper`` may change (``edited_hyperparameters``): each only where the group holds it nonzero, scaled,
# so that the group stays valid for its class (nesterov keeps momentum > 0, Adam's L2 decay is never switched on)
EDITED = ("momentum", "betas", "weight_decay", "alpha", "momentum_decay", "eps", "lr_decay", "beta2_decay")


def edited_hyperparameters(group: dict[str, Any], factor: float) -> dict[str, Any]:
    """The settings ``edit_hyper`` writes into a param group (both sides alike): each of ``EDITED`` it holds
    nonzero, times ``factor`` (betas: the first, the second as ``1 - (1 - beta2) / factor``)."""
    edited: dict[str, Any] = {}
    for key in EDITED:
        value = group.get(key)
        if key == "betas" and isinstance(value, (tuple, list)):
            edited[key] = (value[0] * factor, 1 - (1 - value[1]) / factor)
        elif isinstance(value, float) and not isinstance(value, bool) and value != 0:
            edited[key] = value * factor
    return edited


def constructor_defaults(program: Program) -> Program:
    """``program`` with torch's defaults but ``lr`` (and Adafactor's ``eps``, whose default the library refuses over
    mixed dtypes): what a resumed or reloaded optimizer is built with, so that the load itself must restore betas,
    momentum, nesterov... (review r-42d: built with the program's own settings, a load that kept only ``lr`` from
    the checkpoint passed)."""
    kept = {k: v for k, v in program.kwargs.items() if k == "lr" or (program.optimizer == "Adafactor" and k == "eps")}
    return program.replace(kwargs=kept)


def constructor_to_load(program: Program, kind: str) -> Program:
    """What the subject loading a checkpoint of ``kind`` is built with: torch's defaults but ``lr`` for a
    consolidated ``state_dict`` (``constructor_defaults``); for a sharded one (DCP fills only the entries its
    template names, and the template's state entries follow the constructor's settings: momentum 0 names no
    momentum buffer), the program's settings with every nonzero number of ``EDITED`` halved and nesterov off, so
    that a load keeping the constructor's values still differs."""
    if kind != "sharded":
        return constructor_defaults(program)
    kwargs = {**program.kwargs, **edited_hyperparameters(program.kwargs, 0.5)}
    if kwargs.get("nesterov"):
        kwargs["nesterov"] = False
    return program.replace(kwargs=kwargs)


def generate(
    seed: int, actions: set[str] | None = None, modes: tuple[str, ...] = MODES, hybrid: bool = False
) -> Program:
    """A random program (pure: the same arguments give the same program); ``actions``/``modes`` switch off the rest;
    ``hybrid``: ZeRO shards within pairs of ranks and replicates across them (a 4-rank session)."""
    rng = random.Random(seed)
    allowed = set(ACTIONS) if actions is None else set(actions)
    features = sorted(f for f in MODEL_FEATURES if rng.random() < 0.4)
    mode = modes[seed % len(modes)]  # every mode equally often over consecutive seeds
    options = _mode_options(rng, mode, features)
    optimizer = rng.choice(sorted(OPTIMIZERS))
    if mode == "overlap_hook" and optimizer == "NAdam":  # no functional counterpart: refused at construction
        optimizer = "AdamW"
    kwargs = {**rng.choice(OPTIMIZERS[optimizer]), **_hyperparameters(seed, optimizer)}
    if mode == "overlap_hook":
        optimizer, kwargs = _overlap_turn(seed, optimizer, kwargs)
    between = [a for a in BETWEEN if a in allowed and mode in (ACTIONS[a] or MODES)]
    if "frozen" not in features:
        between = [a for a in between if a != "unfreeze"]
    if "extra" not in features:
        between = [a for a in between if a != "add_group"]
    program: list[Action] = []
    for _ in range(rng.randint(2, 5)):
        program += _step_block(rng, mode, allowed)
        for _ in range(rng.choice([0, 0, 1, 2])):
            if between:
                program.append(_between(rng, rng.choice(between), features))
    used = {a.name for a in program}
    for name in ("unfreeze", "add_group"):
        if name in used:  # once is what a user does; a second time is a no-op or a refusal
            first = next(i for i, a in enumerate(program) if a.name == name)
            program = [a for i, a in enumerate(program) if a.name != name or i == first]
    return _widen(Program(seed, features, mode, options, optimizer, kwargs, program), allowed, hybrid)


def _widen(program: Program, allowed: set[str], hybrid: bool) -> Program:
    """What the fuzzer gained later, from a second random stream: a forward pre-hook registered before wrapping
    (``prehook``), a sparse embedding (refused by the modes that reduce to owners), LBFGS (refused), a GAN round
    (``gan``), a resume at another world size (``reshard``, last), hybrid sharding; from a third, a backward that raises
    midway (``failed_backward``); from a fourth, an optimizer distoptim owns whole tensors of (Adafactor, Muon +
    AdamW)."""
    rng = random.Random(f"widen-{program.seed}")
    mode, features, options = program.mode, list(program.features), dict(program.options)
    optimizer, kwargs, actions = program.optimizer, dict(program.kwargs), list(program.actions)
    if rng.random() < 0.25:
        features = sorted([*features, "prehook"])
    if rng.random() < 0.06:
        features = sorted([*features, "sparse"])
        # optimizers that take a sparse gradient (where the mode does not refuse it, the oracle must run it)
        optimizer, kwargs = rng.choice([("SGD", {"lr": 0.05}), ("Adagrad", {"lr": 0.05})])
        actions = [a for a in actions if a.name not in ("clip", "scaler_step", "hand_grad")]  # dense-only in torch
    elif rng.random() < 0.025:
        optimizer, kwargs = "LBFGS", {"lr": 0.5}
    if "gan" in allowed and mode in (ACTIONS["gan"] or ()) and rng.random() < 0.2:
        for _ in range(rng.randint(1, 2)):
            actions.insert(rng.randrange(len(actions) + 1), Action("gan", {"d_lr": rng.choice([0.01, 0.05])}))
    if "reshard" in allowed and mode in (ACTIONS["reshard"] or ()) and rng.random() < 0.15:
        actions.append(Action("reshard", {"kind": rng.choice(["sharded", "consolidated"])}))
    later = random.Random(f"later-{program.seed}")  # a third stream: the draws above stay as they were
    # not with a rank-dependent branch: a rank can wait inside its backward for a bucket the others raised before
    # filling (the SDP guide's stated limit: a timeout, not a wrong result)
    failing = "failed_backward" in allowed and mode in (ACTIONS["failed_backward"] or ()) and later.random() < 0.3
    if failing and "rank_branch" not in features:
        # mostly the documented recoveries; the others are refused (on every rank) at the next forward or step
        via = later.choices(["optimizer", "wrapper", "module", "bare", "param_none"], [4, 4, 1, 1, 1])[0]
        args = {"layer": later.choice(["body", "head"]), "via": via, "set_to_none": later.random() < 0.6}
        actions.insert(later.randrange(len(actions) + 1), Action("failed_backward", args))
    whole = random.Random(f"whole-{program.seed}")  # a fourth stream: optimizers that own each tensor whole
    drawn = whole.random()
    if optimizer not in ("LBFGS",) and "sparse" not in features and mode != "overlap_hook" and drawn < 0.1:
        optimizer, kwargs = "Adafactor", dict(whole.choice(WHOLE_TENSOR_OPTIMIZERS["Adafactor"]))
        if "bf16" in features and whole.random() < 0.7:  # else refused: torch takes eps1 from a group's first dtype
            kwargs["eps"] = [2**-23, 1e-3]  # fp32's epsilon
    elif optimizer not in ("LBFGS",) and "sparse" not in features and mode != "overlap_hook" and drawn < 0.2:
        optimizer, kwargs = "Muon", dict(whole.choice(WHOLE_TENSOR_OPTIMIZERS["Muon"]))  # matrices.py
    if hybrid:  # ShardedDataParallel too: its buckets divide by world_size * replica_count
        options["hybrid"] = True
        actions = [a for a in actions if a.name not in ("load_optim", "resume", "reshard")]
    widened = Program(program.seed, features, mode, options, optimizer, kwargs, actions)
    edited = _hyper_edits(_piece_invariant(_grown_in_no_sync(_faults(_formats(_exact(widened))), allowed)), allowed)
    return _static_graph(edited)


def _hyper_edits(program: Program, allowed: set[str]) -> Program:
    """From a ninth stream, about two in five programs: an ``edit_hyper`` (momentum, betas, weight decay... of one
    group scaled, ``edited_hyperparameters``) before one of their steps (review r-42d: only ``lr`` was ever edited,
    so a library pushing only ``lr`` into its local optimizer after construction passed every CI seed)."""
    rng = random.Random(f"hyper-edits-{program.seed}")
    steps = [i for i, a in enumerate(program.actions) if a.name in ("step", "closure_step", "scaler_step")]
    if "edit_hyper" not in allowed or program.optimizer == "LBFGS" or not steps or rng.random() >= 0.4:
        return program
    # before the block of a step other than the first: the edit lands on state the first step made
    at = rng.choice(steps[1:] or steps)
    while at > 0 and program.actions[at - 1].name not in ("step", "closure_step", "scaler_step"):
        at -= 1
    edit = Action("edit_hyper", {"group": rng.randrange(2), "factor": rng.choice([0.5, 0.8])})
    return program.replace(actions=[*program.actions[:at], edit, *program.actions[at:]])


def _piece_invariant(program: Program) -> Program:
    """No L2 weight decay for Adam over a bf16 layer without master weights under an even partition: torch's own
    CPU Adam then steps a piece of a tensor a whole update otherwise than the whole tensor where the decay cancels
    the gradient within bf16's rounding (3 ranks, seed 311025; the mixed-precision guide), so no unsharded oracle
    exists, and its effect downstream is no rounding any twin measures. The rest of the program is unchanged."""
    options, kwargs = program.options, program.kwargs
    decays = program.optimizer == "Adam" and kwargs.get("weight_decay")
    if not decays or "bf16" not in program.features or options.get("master") or options.get("partition") != "even":
        return program
    return program.replace(kwargs={**kwargs, "weight_decay": 0.0})


def inexact_parts(program: Program) -> list[str]:
    """What makes a program's arithmetic depend on the reduction order even with gradients on the grid (''
    where none): a bf16 layer (bf16 sums round), a clip (its norm's grouping rounds), a sparse embedding (its
    gradient is not rounded to the grid), Adafactor under SDP on a row-major ``.grad`` set by hand onto a transposed
    weight (the store steps the backward's sum in the weight's layout, and a row's mean sums in memory order: seed
    901197, 1 ulp). GradScaler (a power-of-two scale), Muon (Newton-Schulz in bf16 on the same gradient bits),
    Adafactor and every elementwise optimizer are otherwise exact; so are 2 and 4 ranks, not 3."""
    clips = any(a.name == "clip" or (a.name == "scaler_step" and a.args.get("clip")) for a in program.actions)
    by_hand = program.mode == "sdp" and any(a.name == "hand_grad" for a in program.actions)
    return [
        part
        for part, present in (
            ("bf16", "bf16" in program.features),
            ("clip", clips),
            ("sparse", "sparse" in program.features),
            ("layout", by_hand and program.optimizer == "Adafactor" and "transposed" in program.features),
        )
        if present
    ]


def _exact(program: Program) -> Program:
    """From a fifth stream: exact programs (``options["exact"]``: gradients on a dyadic grid, ``models.on_grid``,
    compared bitwise at 2 and 4 ranks). Every program whose features allow it; three in five of the others
    (not the sparse ones: their refusals need them) lose their bf16 layer and clips to become one (92 of CI's 160)."""
    rng = random.Random(f"exact-{program.seed}")
    parts = [part for part in inexact_parts(program) if part != "layout"]  # (drawn as before; compared in the noise)
    if parts and ("sparse" in parts or rng.random() < 0.4):
        return program
    features = [f for f in program.features if f != "bf16"]
    options = {**program.options, "master": False, "exact": True}
    actions = [
        Action("scaler_step", {"clip": False}) if a.name == "scaler_step" else a
        for a in program.actions
        if a.name != "clip"
    ]
    return program.replace(features=features, options=options, actions=actions)


STATE_FORMATS = ("bf16", "int8")
FORMAT_MODES = ("zero1", "zero2_hook", "sdp", "overlap_hook")


def _formats(program: Program) -> Program:
    """From an eighth stream, about a third of the exact programs keep ZeRO's state in bf16 or int8 (issue 43):
    ``state_format`` for every group, or for the last group only (``format_on``), with the ``wide`` layers so that
    some parameters are large enough to take it. Exact programs only: a code one side rounds the other way moves a
    whole quantization step, so the format's oracle (``modes.Oracle``) is compared bitwise, on the grid."""
    rng = random.Random(f"formats-{program.seed}")
    drawn = rng.random()
    if not program.options.get("exact") or program.optimizer == "LBFGS" or program.mode not in FORMAT_MODES:
        return program
    if drawn >= 0.35:
        return program
    options = {**program.options, "state_format": rng.choice(STATE_FORMATS), "format_on": rng.choice(["all", "last"])}
    if options["state_format"] == "int8" and program.kwargs.get("centered"):
        # centered RMSprop's int8 state goes NaN on both sides (642480, review r-42d): what follows is vacuous
        options["state_format"] = "bf16"
    return program.replace(features=sorted([*program.features, "wide"]), options=options)


def _faults(program: Program) -> Program:
    """From a sixth stream (what the mutation score found the programs never did, ``tests/fuzz/mutants``): a layer
    stored column-major, of an odd element count (``transposed``), in about a quarter of the programs; and a
    GradScaler step whose gradient holds an inf in one element of the head's weight (``overflow``: every rank must
    skip the step, though only that element's owner sees it), in about a third of the unclipped ``scaler_step``."""
    rng = random.Random(f"faults-{program.seed}")
    features = sorted([*program.features, "transposed"]) if rng.random() < 0.25 else program.features
    actions = [
        Action(a.name, {**a.args, "overflow": "head"})
        if a.name == "scaler_step" and not a.args.get("clip") and rng.random() < 0.35
        else a
        for a in program.actions
    ]
    return program.replace(features=features, actions=_held_then_unused(program, actions))


def _held_then_unused(program: Program, actions: list[Action]) -> list[Action]:
    """From a seventh stream, half the ``sdp`` programs with ``odd_branch``: after the first step, a clear that
    zeroes (``set_to_none=False``) once the odd branch got a gradient, then a backward that leaves it unused, each
    stepped: torch.optim steps a zeroed parameter (momentum, state, weight decay move it), so the wrapper must
    remember it holds one (mutant ``sdp_clear_forgets_held``: every CI seed passed it)."""
    rng = random.Random(f"held-{program.seed}")
    first = next((i for i, a in enumerate(actions) if a.name == "step"), None)
    if program.mode != "sdp" or "odd_branch" not in program.features or first is None or rng.random() >= 0.5:
        return actions
    block = [
        Action("zero_grad", {"via": "optimizer", "set_to_none": False}),
        Action("backward", {"micro": 1, "no_sync": False}),
        Action("step"),
    ]
    steps = sum(a.name in ("step", "closure_step", "scaler_step") for a in actions[: first + 1])
    used = [] if steps % 2 else block  # the first block's backward at an odd step (the branch used), then an even
    return [*actions[: first + 1], *used, *block, *block, *actions[first + 1 :]]


def _grown_in_no_sync(program: Program, allowed: set[str]) -> Program:
    """From a tenth stream, 3 in 5 ``sdp`` programs with a ``frozen`` or ``extra`` layer their own actions do not
    change (3 in 10 in the other modes that change structure; not under overlap_param_sync, whose refusals read
    those actions by name): the layer unfrozen or added as a group inside ``no_sync()``, after an accumulated
    micro-batch and before another, in a block of its own after a step (``backward``'s ``grow``), then a ``check``.
    The ``sdp`` ones get a BatchNorm: its statistics are what a micro-batch reduced by mistake changes (exact sums do
    not). A re-placement there once reset ShardedDataParallel's ``no_sync``, silently (2ad6c3c, found by a review:
    no program did this)."""
    rng, actions = random.Random(f"grown-{program.seed}"), program.actions
    own = {a.name for a in actions}
    names = [
        name
        for name, layer in (("unfreeze", "frozen"), ("add_group", "extra"))
        if layer in program.features and name in allowed and name not in own
    ]
    steps = [i + 1 for i, a in enumerate(actions) if a.name == "step"]
    eligible = program.mode in (ACTIONS["unfreeze"] or ()) and not program.options.get("overlap")
    if not names or not steps or not eligible or rng.random() >= (0.6 if program.mode == "sdp" else 0.3):
        return program
    at, grow = rng.choice(steps), rng.choice(names)
    micro = rng.choice([3, 4])  # an accumulated micro-batch before the change and one after it, then the reducing one
    grown = Action("backward", {"micro": micro, "no_sync": True, "grow": grow, "at": rng.randrange(micro - 2)})
    block = [Action("zero_grad", {"via": "optimizer", "set_to_none": rng.random() < 0.6}), grown, Action("step")]
    block.append(Action("check"))  # the buffers each rank's forwards left, before a synced forward overwrites them
    features = sorted({*program.features, "batchnorm"}) if program.mode == "sdp" else program.features
    return program.replace(features=features, actions=[*actions[:at], *block, *actions[at:]])


# what changes the parameters a backward uses, or the graph, between backwards (``_static_graph`` draws none); a
# ``rank_branch`` is static: rank 0 uses it in every backward, so the ranks' union stays the same
STATIC_MODES = ("sdp", "zero1", "zero2_hook")  # the wrappers distoptim's modes build: SDP, DDP (not the hooks')
UNSTATIC_FEATURES = ("odd_branch",)  # used on odd steps only
UNSTATIC_ACTIONS = ("unfreeze", "add_group", "retype", "data_clone", "gan", "failed_backward", "hand_grad")
BACKWARDS = ("backward", "closure_step", "scaler_step")  # each a backward through the wrapper, on both sides


def _quiet_first(actions: list[Action]) -> bool:
    """Whether a DDP's first backward (the program's, or the first after a ``resume`` wraps anew) runs under
    ``no_sync()``: DDP(static_graph=True) then fails an internal assert in its reducer (torch's
    ``expect_autograd_hooks_``) at the next synced backward, so the oracle cannot run such a program."""
    fresh = True
    for action in actions:
        if action.name == "resume":
            fresh = True
        elif action.name in BACKWARDS:
            if fresh and action.name == "backward" and action.args.get("no_sync") and action.args.get("micro", 1) > 1:
                return True
            fresh = False
    return False


def _static_graph(program: Program) -> Program:
    """From an eleventh stream, three in four ``sdp``, ``zero1`` and ``zero2_hook`` programs (not the overlap
    hooks', which step inside DDP's backwards) that are static by construction: every backward uses the same
    parameters (no ``odd_branch``; no unfreezing, added group or growth inside ``no_sync()``, no GAN round, no failed
    backward; no re-typed or cloned storage, which SDP re-places), and no ``hand_grad``. Both sides promise it:
    ShardedDataParallel(static_graph=True) agrees on the used parameters at the first backward only and predicts
    them after (``checks.StaticGraph``); the subject's DDP (``zero1``, ``zero2_hook``) and the oracle's are built
    with ``static_graph=True``, so not where a DDP's first backward is under ``no_sync()`` (``_quiet_first``).
    Mutant ``sdp_static_flags_local``: none was drawn. ``hand_grad``, ``retype`` and ``data_clone`` are left out
    since a library bug they met (fixed since, but for a hand-set ``.grad`` no backward reaches: HISTORY.md)."""
    rng = random.Random(f"static-{program.seed}")
    drawn = rng.random()
    grows = any(a.name == "backward" and a.args.get("grow") for a in program.actions)
    changes = grows or any(a.name in UNSTATIC_ACTIONS for a in program.actions) or _quiet_first(program.actions)
    if program.mode not in STATIC_MODES or changes or set(program.features) & set(UNSTATIC_FEATURES) or drawn >= 0.75:
        return program
    return program.replace(options={**program.options, "static_graph": True})
