"""The house read from its imports (DESIGN.md "The engine and its two drivers", docs/architecture.md):
the engine imports nothing above it, the drivers import nothing of the app or the commands, no module
imports itself back through another, and recording, replaying and Belady each have one home. Static: every
import statement counts, function-local ones too."""

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "specmd"


def modules() -> dict:
    out = {}
    for p in ROOT.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


MODULES = modules()


def imports_of(name: str) -> set:
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{mod}.{a.name}" for a in node.names] + [mod]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            while t not in MODULES and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in MODULES and t != name and t.startswith("specmd"):
                found.add(t)
                break
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def test_the_engine_imports_nothing_above_it():
    up = {m: sorted(d for d in deps if not (d.startswith("specmd.engine") or d == "specmd.errors"))
          for m, deps in GRAPH.items() if m.startswith("specmd.engine")}
    assert {m: d for m, d in up.items() if d} == {}


def cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert cycles(GRAPH) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check itself


def test_imports_are_resolved():  # the checks above see real edges (a broken resolver would pass them vacuously)
    assert "specmd.engine.store" in GRAPH["specmd.engine.engine"]
    assert "specmd.compose" in GRAPH["specmd.runspec"] and "specmd.runspec" in GRAPH["specmd.app"]
    assert "specmd.replay.driver" in GRAPH["specmd.commands.train_eviction"]
    assert "specmd.replay.driver" in GRAPH["specmd.pool"] and "specmd.app" in GRAPH["specmd.commands.mrc"]


# The floors of the house, bottom first (docs/architecture.md "The map"). A module imports only from its own floor
# or the floors below; a new module is placed on a floor here, or the test names it.
FLOORS = (
    ("foundation", ("specmd", "specmd.native", "specmd.errors", "specmd.signals", "specmd.ending", "specmd.accel", "specmd.readers",
                    "specmd.results", "specmd.liveness", "specmd.registry", "specmd.shipped",
                    "specmd.machine")),
    ("engine", ("specmd.engine",)),
    ("domain", ("specmd.policies", "specmd.quant", "specmd.hardware", "specmd.models", "specmd.eval",
                "specmd.loggers", "specmd.summary", "specmd.provenance", "specmd.executor", "specmd.counting")),
    ("drivers", ("specmd.hook", "specmd.replay")),
    # specmd.sweeps (a sweep on disk: the jobs it was asked for, what each left) sits beside specmd.jobs (a job on
    # disk): it reads what the runs wrote, for the commands (report, status) and the command line (a sweep's exit
    # code). It imports the foundation only, but nothing below the runs has a sweep to read, so not lower
    ("runs", ("specmd.compose", "specmd.app", "specmd.runspec", "specmd.checks", "specmd.recorder", "specmd.pool",
              "specmd.jobs", "specmd.sweeps")),
    ("commands", ("specmd.commands",)),
    ("command line", ("specmd.cli", "specmd.__main__")),
)


def floor_of(module: str) -> int:
    """The floor of ``module``: its longest-prefix package in :data:`FLOORS` (``specmd`` itself is the package's
    ``__init__`` only)."""
    best, at = -1, None
    for i, (_, homes) in enumerate(FLOORS):
        for home in homes:
            if (module == home or (home != "specmd" and module.startswith(home + "."))) and len(home) > best:
                best, at = len(home), i
    return at


def upward(graph: dict) -> dict:
    return {m: sorted(d for d in deps if floor_of(d) > floor_of(m)) for m, deps in graph.items()
            if any(floor_of(d) > floor_of(m) for d in deps)}


def test_every_module_has_a_floor():
    assert sorted(m for m in MODULES if floor_of(m) is None) == []


def test_no_import_points_upward():
    assert upward(GRAPH) == {}
    # the check itself: the arrows this restructuring removed
    assert upward({"specmd.jobs": {"specmd.commands.report.status"}, "specmd": {"specmd.jobs"},
                   "specmd.executor.placement": {"specmd.counting"}, "specmd.commands.report.status": set()}) == \
        {"specmd": ["specmd.jobs"], "specmd.jobs": ["specmd.commands.report.status"]}
    assert upward({"specmd.commands.mrc": {"specmd.cli.outcome"}}) == {"specmd.commands.mrc": ["specmd.cli.outcome"]}


def test_commands_live_in_their_package():
    """Each row of the command table names a module under specmd.commands (its logic); its entry may be the
    command line's own Hydra app."""
    from specmd.cli import COMMANDS

    homes = {c.name: c.module for c in COMMANDS if c.module != "specmd.app"}
    assert {n: m for n, m in homes.items() if not m.startswith("specmd.commands.")} == {}
    # and no command body is left loose on the top floor: a module right under specmd/ defines no main(argv)
    loose = [p for p in ROOT.glob("*.py") if p.name != "__main__.py"]
    assert [p.name for p in loose if re.search(r"(?m)^def main\(", p.read_text())] == []
    assert len(loose) > 10  # (the glob sees the top floor)



def command_of(module: str):
    """The command ``module`` belongs to: ``report`` for ``specmd.commands.report.tables``, ``status`` for
    ``specmd.commands.status``; None outside the commands' package and for the package itself (what the commands
    share)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["specmd", "commands"] else None


def across_commands(graph: dict) -> dict:
    """Module -> the modules of other commands it imports."""
    out = {}
    for m, deps in graph.items():
        other = sorted(d for d in deps if command_of(m) and command_of(d) not in (None, command_of(m)))
        if other:
            out[m] = other
    return out


def test_no_command_imports_another_commands_modules():
    """A command is its own: what two share lives below the commands (specmd.sweeps: the sweeps report and
    status read) or in the commands' package (specmd/commands/__init__.py), never in one of them."""
    assert across_commands(GRAPH) == {}
    assert {"specmd.commands.status", "specmd.commands.report.tables"} <= set(MODULES)  # (the graph is read)
    # the check itself: the import this restructuring removed (status read report's collect.py), beside legal ones
    assert across_commands({"specmd.commands.status": {"specmd.commands.report.collect", "specmd.sweeps"},
                            "specmd.commands.report.tables": {"specmd.commands.report", "specmd.commands"},
                            "specmd.commands": {"specmd.errors"}}) == \
        {"specmd.commands.status": ["specmd.commands.report.collect"]}

# The drivers (DESIGN.md "The engine and its two drivers"): what the app composes and the commands run.
DRIVERS = ("specmd.replay", "specmd.hook")


def inside(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def above_the_drivers() -> set:
    """The app, the composition root, the command line and every command (read from its table: the module of
    each command's logic and of its entry), and the orchestration beside the app (record-then-replay, the
    replay pool)."""
    from specmd.cli import COMMANDS

    homes = {"specmd.app", "specmd.runspec", "specmd.checks", "specmd.compose", "specmd.cli", "specmd.__main__",
             "specmd.recorder", "specmd.pool"}
    for c in COMMANDS:
        homes |= {c.module, (c.entry or c.module).partition(":")[0]}
    return {m for m in MODULES if inside(m, homes)}


def upward_from_drivers(graph: dict, above: set) -> dict:
    return {m: sorted(deps & above) for m, deps in graph.items() if inside(m, DRIVERS) and deps & above}


def test_the_drivers_import_nothing_of_the_app_or_the_commands():
    above = above_the_drivers()
    assert {"specmd.app", "specmd.compose", "specmd.commands.mrc", "specmd.commands.tune", "specmd.commands.status", "specmd.commands.train",
            "specmd.cli.hydra_apps", "specmd.recorder", "specmd.pool"} <= above  # the table is read
    assert upward_from_drivers(GRAPH, above) == {}
    # the check itself: the import this restructuring removed (replay/mrc.py's ``from ..app import Run``)
    assert upward_from_drivers({**GRAPH, "specmd.replay.mrc": {"specmd.app", "specmd.replay.driver"}}, above) == \
        {"specmd.replay.mrc": ["specmd.app"]}


def test_no_import_circle_through_the_command_table():
    """The dispatcher imports each command's module by name (lazily, so ``specmd --help`` loads no torch):
    those edges count too."""
    from specmd.cli import COMMANDS

    graph = {m: set(d) for m, d in GRAPH.items()}
    for c in COMMANDS:
        graph["specmd.cli"].add((c.entry or c.module).partition(":")[0])
    assert cycles(graph) == []


def where(pattern: str) -> list:
    rx = re.compile(pattern)
    return sorted(str(p.relative_to(ROOT.parent)) for p in MODULES.values() if rx.search(p.read_text()))


def test_one_home_for_recording_replaying_and_belady():
    # the live driver is the only code that hooks a model's modules to drive the engine (the GPU-cost proxy
    # hooks the MoE blocks only to know where a layer call starts and ends, the family probe a layer's expert sets
    # only to know which one a text pass calls: they observe)
    assert where(r"register_forward(_pre)?_hook\(") == ["specmd/counting.py", "specmd/hook/stack.py",
                                                        "specmd/models/derive.py"]
    # engines and cache managers are built by the drivers only (no private replay loop)
    assert where(r"(?<!class )\b(Engine|CacheManager)\(") == ["specmd/engine/engine.py", "specmd/hook/stack.py",
                                                    "specmd/replay/driver.py"]
    # one definition each
    for definition in (r"def run_replay\(", r"class Belady\b", r"def record_routing\(", r"class TraceWriter\b",
                       r"def read_trace\(", r"def requested_per_call\(", r"class GateRecord\b"):
        assert len(where(definition)) == 1, definition


def private_engine_reads(source: str) -> list:
    """Attribute reads ``<x>._name`` where ``<x>`` names an engine object (the cache manager, the engine, its
    clock, statistics or view), in ``source``."""
    tree = ast.parse(source)
    engine_names = {"cache", "engine", "clock", "stats", "view", "manager"}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            if name in engine_names:
                out.append(f"{name}.{node.attr}")
    return out


def test_executors_plug_into_the_declared_seam_only():
    """An executor reads no private attribute of the engine (it has the pool layout and the residency events of
    specmd.engine.events), and the composition root names no executor: each owns its config checks."""
    for name, path in MODULES.items():
        if name.startswith("specmd.executor"):
            assert private_engine_reads(path.read_text()) == [], name
    assert private_engine_reads("x = stack.cache._pool_of_layer[0]\ny = self.engine.calls") == \
        ["cache._pool_of_layer"]  # the check itself
    app = "".join((ROOT / name).read_text() for name in ("app.py", "runspec.py", "checks.py"))
    assert not re.search(r"(?i)offload", app)
    assert "def config_errors" in (ROOT / "executor" / "offload.py").read_text()


def test_params_in_the_recipe_style():
    """Every policy, executor and quantization method declares its parameters as docs/architecture.md's recipe
    teaches: a module-level ``<Class>Params`` dataclass, ``Params = <Class>Params`` in the class body (an extension
    type's body may hold no nested class)."""
    def nested(source: str) -> list:
        return [f"{c.name}.{n.name}" for c in ast.walk(ast.parse(source)) if isinstance(c, ast.ClassDef)
                for n in c.body if isinstance(n, ast.ClassDef)]

    assert {m: nested(p.read_text()) for m, p in MODULES.items()
            if m.startswith(("specmd.policies.", "specmd.executor.", "specmd.quant.")) and nested(p.read_text())} == {}
    assert nested("class A:\n    class Params:\n        x = 1\n") == ["A.Params"]  # the check itself


def unmapped(text: str) -> list:
    """The modules under specmd/ that docs/architecture.md's "Where things are" does not name: by their path
    (``engine/cache.py``), or by their file name where the entry names their directory (``executor/`` ...
    ``placement.py``). A package's ``__init__`` is named by its directory; a policy or an import format, one
    module per registered name, by its family's directory (the registries and docs/policies.md list them)."""
    from specmd.engine import GROUPS

    text = text.replace("policies/<family>/", " ".join(f"policies/{g}/" for g in GROUPS))  # (the map's wildcard)
    out = []
    for name, path in MODULES.items():
        rel = path.relative_to(ROOT).as_posix()
        parent = rel.rpartition("/")[0] + "/" if "/" in rel else ""
        if path.name == "__main__.py":
            continue
        if path.name == "__init__.py":
            ok = not parent or parent in text
        elif re.fullmatch(r"policies/(eviction|miss|prefetch|routing)/\w+\.py|replay/formats/\w+\.py", rel):
            ok = parent in text
        else:
            ok = rel in text or (parent != "" and parent in text and re.search(rf"\b{re.escape(path.name)}", text))
        if not ok:
            out.append(rel)
    return sorted(out)


def test_the_map_names_every_module():
    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    where = doc.split("## Where things are", 1)[1].split("\n## ", 1)[0]
    assert unmapped(where) == []
    assert "hardware.py" in unmapped(where.replace("hardware.py", "hw.py"))  # the check itself


WORDS = {"DeepSeek", "MoE", "WikiText"}  # CamelCase words of the map's prose that name no code


def misnamed(text: str) -> list:
    """What docs/architecture.md's "Where things are" names that does not exist: a CamelCase name no module of
    specmd/ defines (a class, a function, a module-level name), a ``.py`` path no file of the repository has."""
    defined = set()
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Assign):
                defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
    files = [p.relative_to(ROOT.parent).as_posix() for d in ("specmd", "tests", "benchmarks", "scripts")
             for p in (ROOT.parent / d).rglob("*.py")]
    out = sorted(set(re.findall(r"\b_?[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+\b", text)) - defined - WORDS)
    return out + sorted(x for x in set(re.findall(r"[\w/]*\w+\.py\b", text))
                        if not any(f == x or f.endswith("/" + x) for f in files))


def test_the_map_names_only_what_exists():
    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    where = doc.split("## Where things are", 1)[1].split("\n## ", 1)[0]
    assert misnamed(where) == []
    assert misnamed("LiveRecord in hook/live.py; engine/batchs.py; LiveRecrd") == ["LiveRecrd", "engine/batchs.py"]


FUNCTION_MAX, CLASS_MAX = 60, 300  # lines, docstrings, comments and decorators included


def too_long(source: str) -> list:
    """``name lines`` of each function longer than :data:`FUNCTION_MAX` and class longer than :data:`CLASS_MAX`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            lines = node.end_lineno - min([node.lineno] + [d.lineno for d in node.decorator_list]) + 1
            if lines > (CLASS_MAX if isinstance(node, ast.ClassDef) else FUNCTION_MAX):
                out.append(f"{node.name} {lines}")
    return out


def test_functions_and_classes_stay_short():
    """No function of the package or the benchmarks longer than 60 lines, no class longer than 300: cut where
    the steps are, each named for what it does."""
    files = [*ROOT.rglob("*.py"), *(ROOT.parent / "benchmarks").glob("*.py")]
    assert {str(p.relative_to(ROOT.parent)): too_long(p.read_text()) for p in files if too_long(p.read_text())} == {}
    assert too_long("def f():\n" + "    x = 1\n" * 60) == ["f 61"]  # the check itself


MODULE_MAX = 500  # lines of a module of the package: past it, cut where its concepts are (docs/architecture.md)


def test_modules_stay_short():
    """No module of the package longer than 500 lines: the cache manager, the clock and the app grew past it
    once, each feature landing in the same file; cut where the concepts are before the next one does."""
    assert {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MODULE_MAX} == {}
