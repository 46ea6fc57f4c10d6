"""Library code reimplements torch.distributed.optim and friends; it must not import them."""

from __future__ import annotations

import ast
from pathlib import Path

FORBIDDEN = (
    "torch.distributed.optim",
    "torch.distributed.algorithms.model_averaging",
    "torch.distributed.algorithms.ddp_comm_hooks",
)
SRC = Path(__file__).resolve().parents[1] / "src" / "distoptim"


def _imported_modules(tree: ast.AST) -> list[str]:
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _forbidden_imports(source: str) -> list[str]:
    return [
        name
        for name in _imported_modules(ast.parse(source))
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN)
    ]


def test_rule_catches_every_spelling() -> None:
    assert _forbidden_imports("import torch.distributed.optim")
    assert _forbidden_imports("from torch.distributed.optim import ZeroRedundancyOptimizer")
    assert _forbidden_imports("from torch.distributed.algorithms import model_averaging")
    assert _forbidden_imports("from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook")
    assert not _forbidden_imports("import torch.distributed as dist\nfrom torch.optim import AdamW")


def test_library_does_not_import_torch_implementations() -> None:
    files = sorted(SRC.rglob("*.py"))
    assert files, f"no sources found under {SRC}"
    offenders = {str(path.relative_to(SRC)): bad for path in files if (bad := _forbidden_imports(path.read_text()))}
    assert not offenders, f"library modules import what they must reimplement: {offenders}"


# ------------------------------------------------------------- communication lives in the comm modules only

# comm/: every collective and point-to-point call; rpc/: the RPC framework is its communication
COMM_PACKAGES = ("comm/", "rpc/")
APPLICATION = "demo/"  # the demo is a program using the library, not library code
COLLECTIVES = {
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "scatter", "gather", "send", "recv", "isend",
    "all_gather_single", "reduce_scatter_single",
    "irecv", "barrier", "monitored_barrier", "batch_isend_irecv", "all_gather_object", "broadcast_object_list",
    "send_object_list", "recv_object_list", "gather_object", "scatter_object_list", "new_group", "new_subgroups",
}  # fmt: skip


def _collective_calls(source: str) -> list[str]:
    """Calls of torch.distributed's communication functions, however torch.distributed was imported."""
    tree = ast.parse(source)
    aliases, direct = {"torch.distributed"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update(a.asname or a.name for a in node.names if a.name == "torch.distributed")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases.update(a.asname or a.name for a in node.names if a.name == "distributed")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            direct.update(a.asname or a.name for a in node.names if a.name in COLLECTIVES)
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in direct:
            calls.append(func.id)
        elif isinstance(func, ast.Attribute) and func.attr in COLLECTIVES and ast.unparse(func.value) in aliases:
            calls.append(f"{ast.unparse(func.value)}.{func.attr}")
    return calls


def test_collective_rule_catches_every_spelling() -> None:
    assert _collective_calls("import torch.distributed as dist\ndist.all_reduce(t)")
    assert _collective_calls("import torch\ntorch.distributed.broadcast(t, 0)")
    assert _collective_calls("from torch import distributed as d\nd.send(t, 1)")
    assert _collective_calls("from torch.distributed import reduce as r\nr(t, 0)")
    assert not _collective_calls("import torch.distributed as dist\ndist.get_rank()\nx.all_reduce(t)")


def test_only_comm_modules_call_torch_distributed() -> None:
    offenders = {}
    for path in sorted(SRC.rglob("*.py")):
        name = path.relative_to(SRC).as_posix()
        if name.startswith((*COMM_PACKAGES, APPLICATION)):
            continue
        if calls := _collective_calls(path.read_text()):
            offenders[name] = calls
    assert not offenders, f"only modules under {COMM_PACKAGES} may call torch.distributed's collectives: {offenders}"


# ------------------------------------------------------------------------------------- no import cycles


def _module_name(path: Path) -> str:
    parts = ["distoptim", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """distoptim's modules and the distoptim modules each imports (``TYPE_CHECKING`` imports included; ``from
    package import module`` counts as importing the module, not the package's ``__init__``)."""
    modules = {_module_name(path): path for path in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.module in modules:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    edges.add(submodule if submodule in modules else node.module)
        graph[name] = edges - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among modules, or None. A module importing a package above it (its ``__init__``'s
    re-exports) is no edge: Python has that package initialised first anyway."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for child in sorted(graph.get(node, ())):
            if child in graph and child not in _packages(node):
                if state.get(child) == 1:
                    return [*stack[stack.index(child) :], child]
                if state.get(child) is None and (found := visit(child)):
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if state.get(node) is None and (found := visit(node)):
            return found
    return None


def _packages(module: str) -> list[str]:
    """The packages above ``module``: importing one of them from inside is a package ``__init__`` re-export."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def test_cycle_finder_finds_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    # modules of one package count (an earlier filter skipped every edge inside distoptim, so it found nothing)
    assert _cycle({"p.a": {"p.b"}, "p.b": {"p.a"}, "p": {"p.a"}}) == ["p.a", "p.b", "p.a"]
    assert _cycle({"p": {"p.a"}, "p.a": {"p"}}) is None


def test_no_import_cycles_between_library_modules() -> None:
    cycle = _cycle(_import_graph())
    assert cycle is None, f"import cycle (TYPE_CHECKING imports count): {' -> '.join(cycle)}"


def test_library_uses_public_torch_names_only() -> None:
    """No ``torch._C`` imports: GradBucket, distributed autograd's get_gradients and RRefs have public homes."""
    offenders = {
        str(path.relative_to(SRC)): private
        for path in sorted(SRC.rglob("*.py"))
        if (private := [name for name in _imported_modules(ast.parse(path.read_text())) if name.startswith("torch._C")])
    }
    assert not offenders, f"private torch imports: {offenders}"


def test_docstrings_say_what_in_a_few_lines() -> None:
    """Module docstrings at most 12 lines, class docstrings at most 25 (issue 45): the mechanisms live in
    ``docs/guides/internals.md`` and the guides, where they can be read as a whole."""
    long: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        if "demo" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        owners: list[tuple[str, ast.AST, int]] = [(str(path.relative_to(SRC)), tree, 12)]
        owners += [(f"{path.relative_to(SRC)}:{n.name}", n, 25) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        for where, node, most in owners:
            doc = ast.get_docstring(node, clean=False)  # type: ignore[arg-type]
            if doc and doc.count("\n") + 1 > most:
                long.append(f"{where}: {doc.count(chr(10)) + 1} lines (at most {most})")
    assert not long, f"docstrings too long: {long}"
