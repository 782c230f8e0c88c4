"""The package layering: the record layer, the policies and the hardware never import the
simulator, and no module imports another that imports it back, directly or around a loop.

Imports are read from the source (``ast``), deferred ones inside functions included, so a
cycle hidden behind a lazy import still counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sim", "hardware", "traces", "policies")
LOWER_LAYERS = ("traces", "policies", "hardware")
#: sim's layers, lowest first: a module may import its own layer and those below it
#: (``sim/__init__.py`` draws them); paper and validation are peers that ignore each other
SIM_LAYERS = {"models": 0, "config": 1, "engine": 2, "runs": 3, "paper": 4, "validation": 4,
              "bench": 5, "commands": 6}


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name an import statement in ``path`` mentions (``from a import b``: a, a.b)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    files = module_files()

    def owner(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    return {module: {m for m in map(owner, imported_names(module, path)) if m and m != module}
            for module, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_lower_layers_never_import_the_simulator():
    graph = import_graph()
    upward = sorted(f"{m} imports {d}" for m, deps in graph.items()
                    if m.split(".")[0] in LOWER_LAYERS for d in deps if d.split(".")[0] == "sim")
    assert upward == []


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import from one of sim's layers into the same or a higher other layer."""
    found = []
    for module, deps in graph.items():
        parts = module.split(".")
        if parts[0] != "sim" or len(parts) < 2:
            continue
        for dep in deps:
            other = dep.split(".")
            if other[0] != "sim":
                continue
            if len(other) < 2 or (other[1] != parts[1]
                                  and SIM_LAYERS[other[1]] >= SIM_LAYERS[parts[1]]):
                found.append(f"{module} imports {dep}")
    return sorted(found)


def test_sim_is_in_layers():
    files = module_files()
    outside = sorted(m for m in files if m.startswith("sim.") and m.split(".")[1] not in SIM_LAYERS)
    assert outside == []                                    # every module lives in a layer
    for layer in SIM_LAYERS:                                # each says what it may import
        doc = ast.get_docstring(ast.parse((ROOT / "sim" / layer / "__init__.py").read_text()))
        assert doc and "import" in doc, layer


def test_layers_import_only_downwards():
    assert layer_violations(import_graph()) == []


def test_the_layer_check_finds_upward_imports():
    graph = {"sim.engine.cluster": {"sim.runs.sweep", "sim.models.cost"},
             "sim.paper.report": {"sim.validation.errors"}, "sim.commands.main": {"sim.paper.report"},
             "sim.runs.sweep": {"sim"}}
    assert layer_violations(graph) == ["sim.engine.cluster imports sim.runs.sweep",
                                       "sim.paper.report imports sim.validation.errors",
                                       "sim.runs.sweep imports sim"]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_loops():
    graph = import_graph()
    assert "traces.schema" in graph["traces.metrics"]          # the reader sees real imports
    looped = {**graph, "traces.schema": graph["traces.schema"] | {"traces.metrics"}}
    assert ["traces.metrics", "traces.schema"] in cycles(looped)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_one_table_of_transfer_mechanisms():
    from hardware import mechanism_specs, mechanisms
    from sim.models import transfer

    assert transfer.MECHANISMS is mechanism_specs.MECHANISMS
    assert set(mechanisms.MECHANISMS) == {n for n, m in mechanism_specs.MECHANISMS.items()
                                          if m.real}
    assert "GN-PerPage" not in mechanisms.MECHANISMS            # priced, not run on real bytes


#: where the knee is computed: its definition over a sweep's points, and its search by simulation
KNEE_HOMES = ("traces.metrics", "sim.runs.knee")
#: functions named for the knee that only say or draw it
KNEE_FORMATTERS = ("describe_knee", "_mark_knee")
LOOPS = (ast.For, ast.While, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def knee_computations(module: str, source: str) -> list[str]:
    """Functions named ``*knee*`` in ``source`` that loop (over points or rates: they compute a
    knee rather than call one of ``KNEE_HOMES``), formatters aside."""
    return [f"{module}.{node.name}" for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and "knee" in node.name.lower() and node.name not in KNEE_FORMATTERS
            and any(isinstance(inner, LOOPS) for inner in ast.walk(node))]


def test_the_knee_is_computed_in_one_home():
    found = [name for module, path in module_files().items() if module not in KNEE_HOMES
             for name in knee_computations(module, path.read_text())]
    assert found == []
    assert knee_computations("traces.metrics", (ROOT / "traces" / "metrics.py").read_text()) \
        == ["traces.metrics.knee"]                              # the reader sees the real one


def test_the_knee_check_finds_a_copy():
    copy = ("def find_knee(rates, att):\n    best = None\n    for r, a in zip(rates, att):\n"
            "        best = r if a >= 0.9 else best\n    return best\n"
            "def describe_knee(s):\n    return ', '.join(str(x) for x in s)\n"
            "def knee_rate(config):\n    return knee(config)\n")
    assert knee_computations("m", copy) == ["m.find_knee"]


def test_hawk_calibrate_is_built_in_one_command_module():
    """The fits only fit: the flags and the dispatch are ``sim.commands.calibrate``'s."""
    for module in ("sim.paper.calibrate", "sim.validation.fit_profile"):
        source = module_files()[module].read_text()
        tree = ast.parse(source)
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert not {"register", "add_parser", "cmd_calibrate", "_handler"} & names, module
        assert "argparse" not in imported_names(module, module_files()[module]), module
        assert "add_argument" not in source and "print(" not in source, module
    from sim.commands.main import COMMANDS

    assert [m for name, m, _ in COMMANDS if name == "calibrate"] == ["sim.commands.calibrate"]
    main = module_files()["sim.commands.main"].read_text()
    assert "_add_measured_calibration" not in main and "fit_profile" not in main
