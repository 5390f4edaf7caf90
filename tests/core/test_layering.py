"""The package's layering holds: read from the source (AST), nothing is imported.

Layers, bottom to top (each module imports only its own layer or lower ones; layer 0 imports
nothing of the package; the module-level import graph has no cycle):

    0 knobs, logs
    1 kernels/         (jit, nvshmem_link, cuda_calls: knows no kernel; only `ops` imports it)
    2 arena, layout, handle, events, validate, fp8/ (formats, dispatch, te_bridge, columnwise)
    3 ops/             (one module per cuda_src/ file, at the same path: ops/internode/ring.py
                       wraps internode/ring.cu; the only caller of kernels.jit)
    4 transport/       (base, local, nvlink, internode, reference, ipc, regions, node_layout, ...)
    5 buffer
    6 autograd, and the package's `__init__` (it re-exports Buffer and autograd)
    7 megatron/        (options, dispatcher, metrics, patching, register, te_experts, ...)
    8 bench/, tools/   (benchmarks; command-line tools)

A new module must be placed in `LAYERS` (the test fails on a module missing from it). Besides
the layers: only `megatron/patching.py` assigns attributes on megatron-core objects, and only
`knobs.py` reads `MDEEP_*` environment variables.

Every check collects all its violations and reports them together.
"""

from __future__ import annotations

import ast
import os
import re
from typing import Dict, Iterator, List, Optional, Set
from tests.helpers import REPO_ROOT


ROOT = REPO_ROOT
PACKAGE = "megatron_deepep"
PACKAGE_DIR = os.path.join(ROOT, PACKAGE)

#: Module -> layer. A key ending in `.*` places every module of that subpackage.
LAYERS: Dict[str, int] = {
    "megatron_deepep.cuda_src": 0,  # the CUDA sources' folder in the wheel (no Python)
    "megatron_deepep.knobs": 0,
    "megatron_deepep.logs": 0,
    "megatron_deepep.kernels": 1,  # the run-time compiler: knows no kernel
    # jit, nvshmem_link (its NVSHMEM linker), cuda_calls, cache_trust (whose cache files are used)
    "megatron_deepep.kernels.*": 1,
    "megatron_deepep.arena": 2,
    "megatron_deepep.layout": 2,
    "megatron_deepep.handle": 2,
    "megatron_deepep.events": 2,
    "megatron_deepep.validate": 2,
    "megatron_deepep.fp8": 2,
    "megatron_deepep.fp8.*": 2,  # formats, dispatch, te_bridge, columnwise
    "megatron_deepep.replicas": 2,  # expert copies as one expert: grad sums, moves, logical order
    "megatron_deepep.placement": 2,  # the expert-placement planner (tools.balance, megatron.replan)
    "megatron_deepep.ops": 3,
    "megatron_deepep.ops.*": 3,  # one module per cuda_src/ file; ops.bench: benchmark kernels
    "megatron_deepep.transport": 4,
    "megatron_deepep.transport.*": 4,
    "megatron_deepep.buffer": 5,
    "megatron_deepep.autograd": 6,
    "megatron_deepep": 6,
    "megatron_deepep.megatron": 7,
    "megatron_deepep.megatron.*": 7,
    "megatron_deepep.bench": 8,
    "megatron_deepep.bench.*": 8,  # run (the op bench), layer, layer_variants, peers, network
    "megatron_deepep.tools": 8,
    "megatron_deepep.tools.*": 8,  # precompile, multinode_check, sweep, internode_model, ...
}

#: The only modules that may import `kernels.jit` (they launch or build the kernels).
JIT_IMPORTERS = ("megatron_deepep.ops", "megatron_deepep.ops.*", "megatron_deepep.kernels.*",
                 "megatron_deepep.tools.precompile")

#: The only module that assigns attributes on megatron-core modules, classes and objects.
PATCHING_MODULE = "megatron_deepep.megatron.patching"

#: The only module that reads the environment for our knobs.
KNOBS_MODULE = "megatron_deepep.knobs"

# ----------------------------------------------------------------------------------------------
def _module_files() -> Dict[str, str]:
    """Every module of the package: dotted name -> file path."""
    modules = {}
    for directory, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = [d for d in dirs if d != "__pycache__"
                   and os.path.exists(os.path.join(directory, d, "__init__.py"))]
        for name in files:
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(directory, name), ROOT)[:-3]
            parts = rel.split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = os.path.join(directory, name)
    return modules


MODULES = _module_files()


def layer_of(module: str) -> Optional[int]:
    if module in LAYERS:
        return LAYERS[module]
    parts = module.split(".")
    for i in range(len(parts) - 1, 0, -1):
        key = ".".join(parts[:i]) + ".*"
        if key in LAYERS:
            return LAYERS[key]
    return None


def _matches(module: str, patterns) -> bool:
    return any(module == p or (p.endswith(".*") and module.startswith(p[:-1]))
               for p in patterns)


def _is_package(module: str) -> bool:
    return MODULES.get(module, "").endswith("__init__.py")


class Import:
    """One import of a package module: where, what, and whether it runs at import time."""

    def __init__(self, target: str, line: int, module_level: bool):
        self.target, self.line, self.module_level = target, line, module_level


def _resolve(importer: str, node: ast.AST) -> Iterator[str]:
    """The package modules an Import / ImportFrom node imports."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                yield alias.name
        return
    if node.level:
        base_parts = importer.split(".")
        if not _is_package(importer):
            base_parts = base_parts[:-1]
        base_parts = base_parts[:len(base_parts) - (node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
        return
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield sub if sub in MODULES else base


def _is_type_checking(test: ast.AST) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str) -> List[Import]:
    """Every import of a package module in `module`, module-level and inside functions."""
    tree = ast.parse(open(MODULES[module], encoding="utf-8").read(), MODULES[module])
    found: List[Import] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend(Import(t, child.lineno, module_level)
                             for t in _resolve(module, child))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                visit(child, False)  # not executed at run time
            else:
                visit(child, module_level)

    visit(tree, True)
    return found


IMPORTS = {module: imports_of(module) for module in MODULES}


# ----------------------------------------------------------------------------------------------
def layering_violations() -> List[str]:
    out = []
    for module in sorted(MODULES):
        if layer_of(module) is None:
            out.append(f"table: {module} is in no layer")
    for module in sorted(MODULES):
        mine = layer_of(module)
        for imp in IMPORTS[module]:
            if imp.target == module:
                continue
            theirs = layer_of(imp.target)
            if theirs is None:
                if mine is not None:
                    out.append(f"table: {module} imports {imp.target} (in no layer)")
                continue
            if mine is None:
                continue
            if theirs > mine or mine == 0:
                out.append(f"layer: {module} ({mine}) imports {imp.target} ({theirs}) "
                           f"[{os.path.relpath(MODULES[module], ROOT)}:{imp.line}]")
            if imp.target == "megatron_deepep.kernels.jit" and not _matches(module, JIT_IMPORTERS):
                out.append(f"jit: {module} imports megatron_deepep.kernels.jit (only ops launches "
                           f"kernels) [{os.path.relpath(MODULES[module], ROOT)}:{imp.line}]")
    return sorted(set(out))


def import_cycles(imports: Dict[str, List[Import]], module_level_only: bool = True) -> List[str]:
    """Cycles of the import graph (Tarjan's strongly connected components): of the module-level
    imports, or of all of them (function-level imports included) when not `module_level_only`."""
    graph = {m: sorted({i.target for i in imports[m] if (i.module_level or not module_level_only)
                        and i.target != m and i.target in imports}) for m in imports}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    cycles = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                kind = "module-level" if module_level_only else "any"
                cycles.append(f"cycle ({kind} imports): " + " <-> ".join(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return cycles


def _megatron_names(tree: ast.AST) -> Set[str]:
    """Names bound to megatron-core modules or objects by the imports of a module."""
    names = set()

    def is_megatron(name: Optional[str]) -> bool:
        return bool(name) and (name == "megatron" or name.startswith("megatron."))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if is_megatron(alias.name):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and is_megatron(node.module):
            for alias in node.names:
                names.add(alias.asname or alias.name)
    # Local aliases: `cls = moe_logging.MoEMetricsTracker` makes `cls` one too.
    changed = bool(names)
    while changed:
        changed = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and _root_name(node.value) in names:
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id not in names:
                        names.add(target.id)
                        changed = True
    return names


def _root_name(node: ast.AST) -> Optional[str]:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def patching_violations() -> List[str]:
    """Attribute assignments (`x.a = ...`, `setattr(x, ...)`, `delattr(x, ...)`,
    `object.__setattr__(x, ...)`) on megatron-core imports outside the patching module."""
    out = []
    for module, path in sorted(MODULES.items()):
        if module == PATCHING_MODULE:
            continue
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        names = _megatron_names(tree)
        if not names:
            continue
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                targets = [t for t in targets if isinstance(t, ast.Attribute)]
            elif isinstance(node, ast.Call) and node.args:
                func = node.func
                called = func.id if isinstance(func, ast.Name) else \
                    func.attr if isinstance(func, ast.Attribute) else None
                if called in ("setattr", "delattr", "__setattr__", "__delattr__"):
                    targets = [node.args[0]]
            for target in targets:
                root = _root_name(target)
                if root in names:
                    out.append(f"patching: {module} assigns an attribute of megatron-core's "
                               f"{root} [{os.path.relpath(path, ROOT)}:{node.lineno}]")
    return out


_ENV_READ = re.compile(r"\benviron\b|\bgetenv\b")
_KNOB_NAME = re.compile(r"MDEEP_|MEGATRON_DEEPEP_|PREFIX")


def environ_violations() -> List[str]:
    """Lines outside knobs.py that read the environment for one of our knobs (grep level)."""
    out = set()
    for module, path in sorted(MODULES.items()):
        if module == KNOBS_MODULE:
            continue
        with open(path, encoding="utf-8") as f:
            for line in f:
                code = line.split("#", 1)[0]
                if _ENV_READ.search(code) and _KNOB_NAME.search(code):
                    out.add(f"environ: {module} reads a knob from os.environ")
    return sorted(out)


def _check(violations: List[str]) -> None:
    assert not violations, "\n" + "\n".join(violations)


# ----------------------------------------------------------------------------------------------
def test_every_module_is_in_a_layer_and_imports_only_lower_layers():
    _check(layering_violations())


def test_no_import_cycles():
    _check(import_cycles(IMPORTS))


def test_no_import_cycles_through_function_level_imports_either():
    # A function-level import may break a cycle at import time, but the modules still depend on
    # each other (dispatcher -> metrics -> dispatcher.resolve_options was one).
    _check(import_cycles(IMPORTS, module_level_only=False))


def test_only_the_patching_module_assigns_on_megatron():
    _check(patching_violations())


def test_only_knobs_reads_knob_variables():
    _check(environ_violations())


#: Kernel sources with no wrapper module: the ABI thunk `kernels.nvshmem_link` links with every
#: NVSHMEM source.
UNWRAPPED_SOURCES = {"internode/nvshmem_abi_thunk.cu"}


def ops_mirror_violations() -> List[str]:
    """`ops` mirrors `cuda_src/`: the wrappers of `cuda_src/<path>.cu` are `ops/<path>.py`."""
    cuda_src = os.path.join(ROOT, "cuda_src")
    out = []
    for folder, _, files in os.walk(cuda_src):
        for name in sorted(files):
            source = os.path.relpath(os.path.join(folder, name), cuda_src).replace(os.sep, "/")
            if not name.endswith(".cu") or source in UNWRAPPED_SOURCES:
                continue
            wrapper = os.path.join(PACKAGE_DIR, "ops", source[:-len(".cu")] + ".py")
            if not os.path.isfile(wrapper):
                out.append(f"cuda_src/{source} has no ops module {os.path.relpath(wrapper, ROOT)}")
    return out


def test_ops_has_a_module_per_kernel_source():
    _check(ops_mirror_violations())


# The checker itself, on small synthetic cases.
def test_checker_resolves_submodules_and_function_level_imports():
    dispatcher = {i.target: i.module_level for i in IMPORTS["megatron_deepep.megatron.dispatcher"]}
    assert dispatcher["megatron_deepep.megatron.metrics"] is True  # `from pkg import module`
    assert dispatcher["megatron_deepep.autograd"] is False  # inside a method
    assert "megatron_deepep.megatron" not in dispatcher
    assert layer_of("megatron_deepep.transport.anything_new") == 4
    assert layer_of("megatron_deepep.not_placed") is None
    cyclic = {"a": [Import("b", 1, True)], "b": [Import("a", 2, False)]}
    assert import_cycles(cyclic) == []
    assert import_cycles(cyclic, module_level_only=False) == ["cycle (any imports): a <-> b"]
    assert _megatron_names(ast.parse("from megatron.core import x as y\nimport megatron.core\n"
                                     "from megatron_deepep.megatron import metrics\n"
                                     "cls = y.Tracker\nother = metrics.X")) \
        == {"y", "megatron", "cls"}
