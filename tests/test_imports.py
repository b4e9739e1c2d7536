"""The package's import graph, every `import` counted, those inside functions too (the lazy ones that
switch a wing on): the scripts stand on the files below them and nothing below imports a script back,
so a copied script (`cp prune.py my_prune.py`) runs its own code and no file has a circle to enter."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("prune", "cache_teacher", "evaluate")  # what a user runs and a fork copies
WINGS = ("scale", "architectures", "baselines", "experts")


def package_files():
    """module name -> file: the top-level files and the wings' (tests/ and experiments/ are users)."""
    files = [*ROOT.glob("*.py"), *(p for wing in WINGS for p in (ROOT / wing).glob("*.py"))]
    names = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in files}
    return {name.removesuffix(".__init__"): path for name, path in names.items()}


def imports(path, files):
    """The package modules `path` imports anywhere in its text (a package: its __init__ too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import; the files import by their names"
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              == "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
            names = [node.args[0].value]  # importlib.import_module("experts.cut"): an import too
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and re.fullmatch(r"[a-z_.]+:[A-Za-z_]+", node.value)):
            names = [node.value.split(":")[0]]  # a registry's "module:attribute", imported when named
        else:
            continue
        for name in names:  # `import scale.fsdp` enters `scale` first; `from scale import data`
            parts = name.split(".")
            found |= {m for i in range(len(parts)) if (m := ".".join(parts[:i + 1])) in files}
    return found


def import_graph():
    files = package_files()
    return {name: imports(path, files) - {name} for name, path in files.items()}


def a_cycle(graph):
    """One circle of imports as [a, b, ..., a], or None (depth-first, colouring the path)."""
    state, path = {}, []

    def visit(m):
        state[m] = "on path"
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "on path":
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = "done"
        path.pop()
        return None
    return next((c for m in sorted(graph) if m not in state and (c := visit(m))), None)


def test_the_walk_sees_lazy_imports():
    """The walker itself: prune.py's wings are imported inside functions only, and it finds them."""
    graph = import_graph()
    assert {"scale.fsdp", "scale.plan", "scale.fused_loss", "kd", "surgery"} <= graph["prune"]
    assert "scale.data" in graph["cache_teacher"]
    assert {"experts.search", "baselines.guard", "baselines.evo"} <= graph["prune"]  # by name


def test_the_import_graph_has_no_circle():
    cycle = a_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_no_file_below_the_scripts_imports_one():
    """Nothing imports prune.py (a copy of it then runs its own registries); cache_teacher.py and
    evaluate.py are imported by scripts only: the wings and the libraries stand on the ground floor."""
    graph = import_graph()
    assert [m for m, deps in graph.items() if "prune" in deps] == []
    below = {m: sorted(deps & set(SCRIPTS)) for m, deps in graph.items() if m not in SCRIPTS}
    assert {m: deps for m, deps in below.items() if deps} == {}
