"""The package layout is the architecture: imports only go down the layers (README, "Layout").

Walks every module's imports (module level and inside functions, ``TYPE_CHECKING`` blocks too) with
``ast``, so no import can go up a layer or close a cycle unnoticed.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

LAYERS = ["core", "models", "data", "judges", "run", "trainers", "testing", "training", "analysis", "cli"]
"""Bottom to top. A module may import its own layer and the layers below it, never one above."""

CORE_MAY_IMPORT = {"torch", "math", "typing", "dataclasses", "__future__", "collections", "functools", "re"}
"""core/ is torch-only math: these and nothing else (no transformers, no tether outside core);
``re`` splits texts into words for the diversity measures."""


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted((SRC / "tether").rglob("*.py")):
        parts = p.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def imports_of(path: Path, module: str) -> set[str]:
    """Every module ``module`` imports (absolute names), wherever the import statement stands."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}  # `from tether.models import head`
    return found


def layer(module: str) -> str | None:
    """The layer of a tether module: its first name under ``tether`` (``__main__`` sits with cli)."""
    parts = module.split(".")
    if parts[0] != "tether" or len(parts) == 1:
        return None
    top = "cli" if parts[1] == "__main__" else parts[1]
    return top if top in LAYERS else None


def test_every_module_has_a_layer():
    missing = [m for m in modules() if m != "tether" and layer(m) is None]
    assert not missing, f"modules outside the layers {LAYERS}: {missing}; put them in a layer folder"


def test_imports_only_go_down():
    mods = modules()
    up = []
    for name, path in mods.items():
        here = layer(name)
        if here is None:
            continue
        for imp in imports_of(path, name):
            there = layer(imp) if imp in mods else None
            if there is not None and LAYERS.index(there) > LAYERS.index(here):
                up.append(f"{name} ({here}) imports {imp} ({there})")
    assert not up, "imports that go up a layer:\n" + "\n".join(sorted(up))


def test_core_is_torch_only():
    bad = []
    for name, path in modules().items():
        if layer(name) != "core":
            continue
        for imp in imports_of(path, name):
            root = imp.split(".")[0]
            if root == "tether":
                if layer(imp) != "core" and imp != "tether":
                    bad.append(f"{name} imports {imp}")
            elif root not in CORE_MAY_IMPORT:
                bad.append(f"{name} imports {imp}")
    assert not bad, "core/ must import torch and core/ alone:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    mods = modules()
    graph = {
        n: {i for i in imports_of(p, n) if i in mods and i != n and not n.startswith(i + ".")}
        for n, p in mods.items()
    }
    # drop a package's own __init__ edges (importing tether.models.head runs tether.models first)
    state, cycles = {}, []

    def visit(n, stack):
        state[n] = "open"
        for m in sorted(graph[n]):
            if state.get(m) == "open":
                cycles.append(" -> ".join(stack[stack.index(m) :] + [m]))
            elif m not in state:
                visit(m, stack + [m])
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_walker_sees_an_upward_import(tmp_path):
    """The check can fail: a core module importing a trainer is reported."""
    p = tmp_path / "bad.py"
    p.write_text("def f():\n    from tether.trainers.ppo import PPOTrainer\n")
    imps = imports_of(p, "tether.core.bad")
    assert "tether.trainers.ppo" in imps
    assert LAYERS.index(layer("tether.trainers.ppo")) > LAYERS.index(layer("tether.core.bad"))


def test_the_public_api_imports_from_tether():
    import tether

    for name in tether.__all__:
        assert getattr(tether, name) is not None, name
    from tether import AdaptiveKLController, KLLeash, estimate_kl, load_config, train  # noqa: F401

    assert callable(train) and callable(load_config) and callable(estimate_kl)
