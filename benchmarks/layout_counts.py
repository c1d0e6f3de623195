"""How options enter the code: the counts issue 51 set goals for, printed for a source tree.

Usage: python benchmarks/layout_counts.py [--tree SRC_DIR]   (default: this checkout's src/)

* controller names (``"fixed"``, ``"adaptive"``, ``"budget"``) tested or looked up outside
  ``core/controllers.py`` (goal 0);
* ``algo ==`` / ``algo in`` / ``algo !=`` tests outside the per-trainer defaults table and
  ``trainers/`` (goal <= 3);
* modules that call ``generate`` or ``generate_turns`` (goal 1);
* modules naming the environment's fields in code (an attribute, a keyword or a parameter:
  ``rollout.env``, ``env_mask``, ``env_texts``, ``env_offsets``, ``env_format``, ``env_timeout``;
  not the text of messages and docstrings; goal <= 6);
* calls with 8 or more arguments (goal <= 25), and how many of them build a record by keyword
  (a class called: what STYLE.md prescribes for many fields) rather than call a function;
* functions in ``models/`` and ``judges/`` over 120 lines or of cyclomatic complexity over 30
  (McCabe: 1 + branches, boolean operators and comprehension conditions; goal none);
* the parameters of ``run/evaluation.py: evaluate`` (goal <= 11) and the lines of
  ``training.py`` (goal < 400).
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONTROLLER_NAMES = ("fixed", "adaptive", "budget")
ENV_FIELDS = {"env_mask", "env_texts", "env_offsets", "env_format", "env_timeout"}
DEFAULTS_TABLE = "TRAINER_DEFAULTS"


def modules(src: Path) -> dict[str, ast.Module]:
    return {str(p.relative_to(src)): ast.parse(p.read_text()) for p in sorted(src.rglob("*.py"))}


def complexity(fn: ast.AST) -> int:
    n = 1
    for node in ast.walk(fn):
        if isinstance(node, (ast.If, ast.For, ast.While, ast.IfExp, ast.ExceptHandler, ast.With, ast.Assert)):
            n += isinstance(node, ast.With) is False
        elif isinstance(node, ast.BoolOp):
            n += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            n += 1 + len(node.ifs)
        elif isinstance(node, ast.match_case):
            n += 1
    return n


def names_env_fields(tree: ast.Module) -> bool:
    """Whether code (not a string) names an environment field: ``x.env_mask``, ``rollout.env``,
    a keyword ``env_format=``, a parameter ``env_timeout``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (
            node.attr in ENV_FIELDS
            or (node.attr == "env" and isinstance(node.value, ast.Attribute) and node.value.attr == "rollout")
        ):
            return True
        if isinstance(node, ast.keyword) and node.arg in ENV_FIELDS:
            return True
        if isinstance(node, ast.arg) and node.arg in ENV_FIELDS:
            return True
    return False


def controller_name_tests(path: str, tree: ast.Module) -> int:
    """Comparisons and dict keys with a controller's name as a string (a lookup by name)."""
    if path.endswith("core/controllers.py"):
        return 0
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            consts = [c for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
            count += any(c.value in CONTROLLER_NAMES for c in consts)
        elif isinstance(node, ast.Dict):
            count += any(isinstance(k, ast.Constant) and k.value in CONTROLLER_NAMES for k in node.keys)
    return count


def algo_tests(path: str, tree: ast.Module) -> int:
    if path.startswith("trainers/"):
        return 0
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == DEFAULTS_TABLE for t in node.targets
        ):
            continue
        if isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
            left = node.left
            name = (
                left.attr
                if isinstance(left, ast.Attribute)
                else left.id
                if isinstance(left, ast.Name)
                else ""
            )
            count += name == "algo"
    return count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, default=REPO / "src", help="the src/ folder to count")
    src = ap.parse_args().tree / "tether"
    mods = modules(src)
    texts = {p: (src / p).read_text() for p in mods}
    ctrl = {p: n for p, t in mods.items() if (n := controller_name_tests(p, t))}
    algo = {p: n for p, t in mods.items() if (n := algo_tests(p, t))}
    gen = sorted(
        p
        for p, t in mods.items()
        if any(
            isinstance(n, ast.Call)  # tether's functions by name (not a model's .generate)
            and getattr(n.func, "id", None) in ("generate", "generate_turns")
            for n in ast.walk(t)
        )
    )
    env = sorted(p for p, t in mods.items() if names_env_fields(t))
    big = [
        n
        for t in mods.values()
        for n in ast.walk(t)
        if isinstance(n, ast.Call) and len(n.args) + len([k for k in n.keywords if k.arg]) >= 8
    ]
    # a record built by keyword (a class: its name capitalized) is the remedy, not the riddle
    records = [
        n for n in big if (getattr(n.func, "id", None) or getattr(n.func, "attr", "") or "")[:1].isupper()
    ]
    long_fns = []
    for p, t in mods.items():
        if not p.startswith(("models/", "judges/")):
            continue
        for n in ast.walk(t):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines, cc = n.end_lineno - n.lineno + 1, complexity(n)
                if lines > 120 or cc > 30:
                    long_fns.append(f"{p}:{n.name} ({lines} lines, complexity {cc})")
    evaluate = next(
        (
            n
            for n in ast.walk(mods.get("run/evaluation.py", ast.Module(body=[], type_ignores=[])))
            if isinstance(n, ast.FunctionDef) and n.name == "evaluate"
        ),
        None,
    )
    params = None if evaluate is None else len(evaluate.args.args) + len(evaluate.args.kwonlyargs)
    print(f"controller names tested outside core/controllers.py: {sum(ctrl.values())} {ctrl}")
    print(f"algo tests outside the defaults table and trainers/: {sum(algo.values())} {algo}")
    print(f"modules calling generate/generate_turns: {len(gen)} {gen}")
    print(f"modules naming the environment's fields: {len(env)} {env}")
    functions = len(big) - len(records)
    print(f"calls with 8 or more arguments: {len(big)} ({functions} of functions, {len(records)} records)")
    print(f"functions in models/, judges/ over 120 lines or complexity 30: {len(long_fns)} {long_fns}")
    print(f"evaluate's parameters: {params}")
    print(f"training.py lines: {len(texts['training.py'].splitlines())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
