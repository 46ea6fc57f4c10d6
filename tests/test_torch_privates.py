"""Every private name of torch the library touches, each with its reason (issue 45): a new one fails here until it
is listed, and one no longer used fails until it is removed, so the list stays the truth."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "distoptim"

PRIVATE_NAMES = {
    "_C": "the namespace of _current_graph_task_id and the DisableTorchFunction modes",
    "_current_graph_task_id": "whether a backward is running (DDP's join hook runs comm hooks outside of any)",
    "_execution_engine": "queue_callback: run at the end of the running backward, as DDP's reducer does",
    "_amp_foreach_non_finite_check_and_unscale_": "GradScaler's own unscale-and-check kernel, on the owned shard",
    "_per_optimizer_states": "GradScaler's custom-scaling protocol (_step_supports_amp_scaling) hands over this",
    "_scale": "... and the scale itself, as torch's own optimizers with that protocol read it",
    "_values": "a sparse .grad's values, unscaled in place as torch's GradScaler does (no public in-place view)",
    "_base": "whether a tensor is a view (no public test)",
    "_cdata": "a storage's identity, to tell new storage from reused memory",
    "_use_count": "whether gloo's worker thread still holds a finished collective's tensor",
    "_foreach_copy_": "one kernel for many small copies (torch.optim uses the foreach kernels the same way)",
    "_foreach_mul_": "one kernel to scale many gradients (torch.nn.utils.clip_grad_norm_ uses it too)",
    "_has_rebuilt_buckets": "DDP's warm-up, read as torch's own hook_with_zero_step reads it",
    "_make_wrapper_subclass": "a fragment presented to DCP as a tensor of its parameter's shape",
    "_join_config": "which joinable Join lists first (set on each by Join): ZeRO listed first is refused there",
    "_version": "a tensor's version counter: whether a gradient changed since it was read",
    "DisableTorchFunction": "(torch._C) data pointers read beneath a tensor subclass's __torch_function__",
    "DisableTorchFunctionSubclass": "(torch._C) the .grad marker's own ops run as plain tensor ops",
    "_optimizer_state_dict_pre_hooks": "torch.optim.Optimizer's state-dict hooks (registered through its public "
    "methods), run by ZeRO's own state_dict as torch's runs them",
    "_optimizer_state_dict_post_hooks": "... and the same for state_dict's post hooks",
    "_optimizer_load_state_dict_pre_hooks": "... load_state_dict's pre hooks",
    "_optimizer_load_state_dict_post_hooks": "... load_state_dict's post hooks",
}


def _defined_by_us(trees: list[ast.Module]) -> set[str]:
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[-1])
    return names


def private_names(sources: dict[str, str]) -> dict[str, set[str]]:
    """Attributes whose name starts with one underscore that no module of ours defines (so someone else's: torch's),
    and private names imported from torch, each with the files that use it."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    ours = _defined_by_us(list(trees.values()))
    found: dict[str, set[str]] = {}
    for file, tree in trees.items():
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                names = [node.attr] if node.attr not in ours else []
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "_C":
                names.append(node.attr)  # torch._C's members, public-looking or not
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                names = [a.name for a in node.names if a.name.startswith("_") or "._" in f".{node.module}"]
            for name in names:
                found.setdefault(name, set()).add(file)
    return found


def test_every_private_torch_name_the_library_touches_is_listed_with_its_reason() -> None:
    sources = {str(p.relative_to(SRC)): p.read_text() for p in sorted(SRC.rglob("*.py")) if "demo" not in p.parts}
    found = private_names(sources)
    unlisted = {name: sorted(files) for name, files in found.items() if name not in PRIVATE_NAMES}
    assert not unlisted, f"torch private names used without a reason in PRIVATE_NAMES: {unlisted}"
    stale = sorted(set(PRIVATE_NAMES) - set(found))
    assert not stale, f"PRIVATE_NAMES lists names the library no longer uses: {stale}"


def test_the_scan_sees_a_private_attribute_of_someone_else_and_not_ours() -> None:
    source = "class A:\n    def f(self, ddp):\n        self._mine = 1\n        return ddp._reducer, self._mine\n"
    assert private_names({"a.py": source}) == {"_reducer": {"a.py"}}
