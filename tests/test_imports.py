"""The package's import graph has no cycle: no module imports one that imports it back, directly
or through others (function-level imports included: a cycle hidden inside a function is still a
cycle). `from grpokit.x import y` where y is a module counts as importing y, not grpokit.x."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "grpokit"


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    mods = {}
    for f in root.rglob("*.py"):
        parts = f.relative_to(root.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                graph[m].update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
                graph[m].update(subs)
                if len(subs) < len(node.names):
                    graph[m].add(node.module)
        graph[m] = {d for d in graph[m] if d in mods and d != m}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_cycle_finder_finds_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycle():
    graph = import_graph(ROOT)
    assert "grpokit.train.step" in graph and graph["grpokit.train.step"]   # the graph was read
    assert cycles(graph) == []


def test_model_loading_is_a_leaf():
    graph = import_graph(ROOT)
    assert not {d for d in graph["grpokit.models.hf"] if d.startswith("grpokit.train")}
    assert "grpokit.models.hf" not in graph["grpokit.train.reference"]


def _under(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def test_the_layers():
    """rollout, monitor, rewards, algo and models import nothing under grpokit.train; models imports
    nothing under grpokit.rollout (function-level imports included)."""
    graph = import_graph(ROOT)
    assert any(_under(m, "grpokit.models") for m in graph)      # the models package was read
    rules = [(low, "grpokit.train") for low in ("grpokit.rollout", "grpokit.monitor", "grpokit.rewards",
                                                 "grpokit.algo", "grpokit.models")]
    rules.append(("grpokit.models", "grpokit.rollout"))
    bad = sorted((m, d) for low, high in rules for m, deps in graph.items() if _under(m, low)
                 for d in deps if _under(d, high))
    assert not bad, f"imports against the layers: {bad}"


def test_algo_and_rewards_read_no_config():
    """The pure math and the rewards take plain values: nothing under grpokit.algo or grpokit.rewards
    imports grpokit.config (the builder turns config into their arguments)."""
    graph = import_graph(ROOT)
    bad = sorted((m, d) for m, deps in graph.items() if _under(m, "grpokit.algo") or _under(m, "grpokit.rewards")
                 for d in deps if _under(d, "grpokit.config"))
    assert not bad, bad
