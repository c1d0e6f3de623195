"""The code in README.md and docs/*.md is true: every block a user would paste is run or checked.

Every fenced block of README.md and docs/*.md is read (```python, ```bash, ```yaml; an untagged
fence is text: output, trees, formulas). Each is checked offline, on the tiny fixtures of
tests/conftest.py:

* python: executed, with the names the prose around it gives (``dataset``, ``accuracy``)
  supplied, ``load_config`` giving the block's own config (checked as written) with the tiny
  Llama, tiny prompts and one step in place of the model, the data and the length;
* bash: each command. ``tether ...`` (also after ``python -m`` or ``accelerate launch ... -m``) is
  parsed by tether's own argument parser and its ``section.field=value`` overrides loaded by the
  config loader; those of :data:`END_TO_END` run on the tiny model. Any other command is either
  checked (a Makefile target exists, a benchmark script takes the flags given) or listed in
  :data:`NOT_RUN` with the reason it does not run here;
* yaml: loaded, as accelerate configs (the keys accelerate knows, the precision and launcher
  tether accepts) or as tether configs.

A block or a command that is neither run nor listed fails, so a new one is never skipped in
silence. Inline code that calls ``train(...)`` or ``load_config(...)`` is bound to the real
signature, and inline ``tether ...`` commands are checked as those of the blocks. Code must be
fenced with its language: an indented code block fails (it would be read by no check here).
"""

from __future__ import annotations

import ast
import inspect
import re
import shlex
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from tests.conftest import REPO, TINY_RUN

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

PASTED = {"python", "bash", "sh", "yaml"}
"""The fenced languages a user pastes; every such block is checked."""
TEXT = {""}
"""Untagged fences: program output, a folder tree, formulas. Nothing to run."""


class Block(NamedTuple):
    where: str  # FILE:LINE of the block's first line of code
    lang: str
    code: str


def _fences(path: Path) -> list[Block]:
    """The fenced code blocks of a markdown file (also indented ones inside list items)."""
    lines, out, i = path.read_text(encoding="utf-8").splitlines(), [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+)\s*(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, lang = len(m[1]), m[2], m[3]
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks)
        body = "\n".join(line[indent:] for line in lines[i + 1 : end])
        out.append(Block(f"{path.relative_to(REPO)}:{i + 2}", lang, body + "\n"))
        i = end + 1
    return out


def _prose(path: Path) -> str:
    """The file with each fenced block's lines blanked (line numbers kept)."""
    lines, inside = path.read_text(encoding="utf-8").splitlines(), None
    for i, line in enumerate(lines):
        m = re.match(r"^\s*(```+)", line)
        if m and (inside is None or line.strip() == inside):
            inside = m[1] if inside is None else None
            lines[i] = ""
        elif inside is not None:
            lines[i] = ""
    return "\n".join(lines)


def _indented_code(path: Path, root: Path = REPO) -> list[str]:
    """FILE:LINE of each indented code block: 4+ spaces after a blank line, outside a list item."""
    lines, out = _prose(path).splitlines(), []
    for i, line in enumerate(lines[1:], 1):
        if line.startswith("    ") and line.strip() and not lines[i - 1].strip():
            before = next((x for x in reversed(lines[: i - 1]) if x.strip()), "")
            if not re.match(r"^\s*([*-]|\d+\.)\s|^\s{2,}", before):  # a list item's own paragraph
                out.append(f"{path.relative_to(root)}:{i + 1}")
    return out


def _inline(path: Path) -> list[tuple[str, str]]:
    """(FILE:LINE, text) of every inline code span outside the fenced blocks."""
    text, out = _prose(path), []
    for m in re.finditer(r"(?<!`)(`+)(?!`)((?:(?!\n\s*\n).)+?)(?<!`)\1(?!`)", text, flags=re.S):
        line = text.count("\n", 0, m.start()) + 1
        out.append((f"{path.relative_to(REPO)}:{line}", " ".join(m[2].split())))
    return out


BLOCKS = [b for p in DOCS for b in _fences(p)]
INLINE = [s for p in DOCS for s in _inline(p)]


def _ids(blocks) -> list[str]:
    return [b.where for b in blocks]


# ---- what does not run here, and why ---------------------------------------------------------
NOT_RUN = {
    "make demo": "sets up .venv, then ~10 min of PPO on the real SmolLM2-135M (its target is checked)",
    "make test": "the whole suite, 21 min on 2 AVX2-only cores (its target is checked)",
    "make lint": "the lint gates, run by CI (its target is checked)",
    "make test-other-kernels": "the numerics tests again under other kernels (its target is checked)",
    "accelerate launch": "starts N processes (N GPUs in docs/usage.md); the `-m tether` part and the "
    "precision flag are checked here, and tests/e2e/test_distributed.py launches 2 CPU processes",
    "pip install": "installs packages over the network",
    "python -m pytest": "the test suite itself",
    "python benchmarks/": "a benchmark on the real model, minutes to an hour (the script and its flags "
    "are checked)",
    "tether push": "uploads to the Hub: the network and a token (its arguments are checked)",
}
"""Commands not run here (by their first words), with the reason. The ``tether`` ones are still
parsed and their overrides loaded; ``tether train`` and ``tether frontier`` commands not in
:data:`END_TO_END` are checked that way only (a Hub model or dataset, a GPU, minutes of training)."""

END_TO_END = (
    "tether train kl.kl_coef=0.1 kl.controller=fixed optim.lr=2e-5 train.steps=40",
    "tether train train.algo=grpo rollout.group_size=4",
    "tether train train.algo=rloo",
    "tether train train.algo=dpo dpo.beta=0.1",
    "tether train data.prompts=arithmetic train.algo=grpo rollout.max_new_tokens=5 optim.lr=5e-5 "
    "kl.budget=0.5 anchor.coef=3 rollout.batch_size=32 optim.minibatch_size=16 train.steps=40",
    "tether config",
    "tether config data",
    "tether train --print-config ...",
)
"""Commands of the docs run end to end: ``tether train`` on the tiny Llama, for one step, on the
tiny prompts unless the command names built-in offline data (:func:`_tiny_train`)."""

PYTHON = {
    "trainer = GRPOTrainer(": dict(
        start="# tether",
        why="the TRL half builds TRL's GRPOTrainer on Qwen2.5-0.5B from the Hub; the tether half runs",
        model="chat_model_dir",  # conversational prompts: think_format_reward reads messages
        names="""
from trl.rewards import think_format_reward


def accuracy(completions, answer, **kwargs):
    return [float(a in c[0]["content"]) for c, a in zip(completions, answer)]


dataset = [{"prompt": [{"role": "user", "content": f"{i} + 1 ="}], "answer": str(i + 1)} for i in range(20)]
""",
    ),
    "reward_func(\n": dict(
        why="TRL's call of a reward function, written with the caller's names; "
        "tests/judges/test_trl_contract.py checks tether's call against TRL's own",
    ),
    "def correct(": dict(
        after='correct(["12 + 35 = 47"], ["47"]) == [1.0] and format(["p"], ["x."]) == [1.0]'
    ),
    "def adder(": dict(after='adder("12 + 35 =", "12 + 35 =", 0) == " 47\\n"'),
    "def calc_tool(": dict(
        after='calc_tool("", [{"role": "assistant", "content": "calc(2 + 3)"}], 0) == "5"'
    ),
}
"""Python blocks by a piece of their text: ``names`` the prose gives them (run first), ``start``
the line the run starts at (the lines before are compiled only) and ``why``, ``model`` the
fixture whose tiny model stands in for ``model.name`` (default ``tiny_model_dir``), ``after`` an
expression that must be true after the block ran (its functions called on a small case), or
``why`` alone: not run (compiled only), and why."""


def _listed(command: str) -> str | None:
    return next((why for first, why in NOT_RUN.items() if command.startswith(first)), None)


# ---- bash: commands -------------------------------------------------------------------------
def _commands(code: str) -> list[list[str]]:
    """The block's commands as argv lists: continuation lines joined, comments dropped, and the
    variable assignments before a command (``PYTHONPATH=src``) dropped."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
            argv = argv[1:]
        if argv:
            out.append(argv)
    return out


OVERRIDE = r"^[a-z_]+\.[a-z_0-9]+="
"""A ``section.field=value`` override."""
PLACEHOLDERS = {"train.algo=ALGO": "train.algo=ppo"}
"""Values the prose leaves for the reader to choose, and the one checked in their place."""


def _synopsis_dropped(argv: list[str]) -> list[str]:
    """argv without a synopsis's optional parts (``[--config FILE.yaml]``, ``[SECTION]``) and
    without ``...`` (more of the same), :data:`PLACEHOLDERS` filled."""
    out, optional = [], False
    for a in map(lambda a: PLACEHOLDERS.get(a, a), argv):
        if a.startswith("[") and not optional:
            optional = True
        if not optional and a != "...":
            out.append(a)
        if optional and a.endswith("]"):
            optional = False
    return out


def _tether_argv(argv: list[str]) -> list[str] | None:
    """The argv tether's own parser gets, or None when the command is not tether's."""
    if argv[0] == "tether":
        return argv[1:]
    if "-m" in argv and argv[argv.index("-m") + 1 : argv.index("-m") + 2] == ["tether"]:
        return argv[argv.index("-m") + 2 :]
    return None


def _check_tether(argv: list[str], where: str) -> list[str]:
    """Parse ``tether ARGV`` as the CLI does and load its overrides; returns the parsed overrides."""
    from tether.cli import _parser
    from tether.run.config import ConfigError, load_config

    argv = _synopsis_dropped(argv)
    try:
        args = _parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `tether {shlex.join(argv)}` is not a command tether's parser takes")
    overrides = list(getattr(args, "overrides", []) or [])
    if args.command in ("train", "frontier"):
        try:
            load_config(None, overrides)
        except ConfigError as e:
            pytest.fail(f"{where}: `tether {shlex.join(argv)}`: {e}")
    return overrides


def _check_other(argv: list[str], where: str) -> None:
    """The checks of a command that is not run: a make target exists, a script takes its flags,
    accelerate is asked for no mixed precision."""
    text = shlex.join(argv)
    assert _listed(text) or _listed(text.replace(".venv/bin/", "")), (
        f"{where}: `{text}` is neither run nor listed in NOT_RUN; run it in this test or list it with why"
    )
    if argv[0] == "make":
        targets = re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), flags=re.M)
        assert argv[1] in targets, f"{where}: `{text}`: the Makefile has no target {argv[1]!r}"
    elif argv[0].endswith("python") and argv[1].startswith(("benchmarks/", "examples/")):
        from tether.run.config import load_config

        script = (REPO / argv[1]).read_text()
        flags = [a.split("=")[0] for a in argv[2:] if a.startswith("--")]
        missing = [f for f in flags if f'"{f}"' not in script]
        assert not missing, f"{where}: `{text}`: {argv[1]} takes no {missing}"
        load_config(None, [a for a in argv[2:] if re.match(OVERRIDE, a)])  # what it passes to tether
    elif argv[:2] == ["accelerate", "launch"] and "--mixed_precision" in argv:
        from tether.run.setup import check_full_precision

        check_full_precision(argv[argv.index("--mixed_precision") + 1])


SHELL = [b for b in BLOCKS if b.lang in ("bash", "sh")]


@pytest.mark.parametrize("block", SHELL, ids=_ids(SHELL))
def test_shell_block(block):
    for argv in _commands(block.code):
        tether_argv = _tether_argv(argv)
        if tether_argv is not None:
            _check_tether(tether_argv, block.where)
        tethers_own = argv[0] == "tether" or argv[:3] == ["python", "-m", "tether"]
        if not tethers_own or _listed(shlex.join(argv)):
            _check_other(argv, block.where)


def _tiny_train(argv: list[str], model_dir: Path, prompts: Path, out: Path) -> list[str]:
    """``tether train ARGV`` as a tiny run: the command's own settings over :data:`TINY_RUN`, then
    the tiny model, one step and ``out``; the tiny prompts unless it names the built-in arithmetic."""
    own = _check_tether(argv, "END_TO_END")[:]
    tiny = {**TINY_RUN, "eval.every": 0, "eval.capability_texts": 0}
    forced = {"model.name": model_dir, "train.steps": 1, "train.output_dir": out}
    if not any(o.startswith("data.prompts=arithmetic") for o in own):
        forced["data.prompts"] = prompts
    return ["train", *(f"{k}={v}" for k, v in tiny.items()), *own, *(f"{k}={v}" for k, v in forced.items())]


@pytest.fixture
def no_plots(monkeypatch):
    """The plots take 2 s a run and are tested elsewhere (tests/e2e/test_cli.py)."""
    import tether.run.session

    monkeypatch.setattr(tether.run.session, "plot_training", lambda *a, **k: None)
    monkeypatch.setattr(tether.run.session, "plot_score_vs_kl", lambda *a, **k: None)


def _doc_commands() -> dict[str, str]:
    """Every command of the shell blocks, as one line, -> where it stands."""
    out = {}
    for b in SHELL:
        for argv in _commands(b.code):
            out.setdefault(shlex.join(argv), b.where)
    return out


@pytest.mark.parametrize("command", END_TO_END)
def test_command_runs_end_to_end(command, tiny_model_dir, prompt_file, tmp_path, no_plots, capsys):
    from tether.cli import main

    assert command in _doc_commands(), f"END_TO_END names {command!r}, which no shell block holds"
    argv = shlex.split(command)[1:]
    if argv[0] == "train":
        argv = _tiny_train(argv, tiny_model_dir, prompt_file, tmp_path / "run")
    assert main(argv) == 0, capsys.readouterr().err[-2000:]
    if argv[0] == "train":
        assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1


def test_not_run_lists_only_what_the_docs_hold():
    commands = list(_doc_commands())
    stale = [
        first for first in NOT_RUN if not any(c.replace(".venv/bin/", "").startswith(first) for c in commands)
    ]
    assert not stale, f"NOT_RUN lists commands no doc holds any more: {stale}"
    stale = [key for key in PYTHON if not any(key in b.code for b in BLOCKS if b.lang == "python")]
    assert not stale, f"PYTHON lists blocks no doc holds any more: {stale}"


# ---- python ---------------------------------------------------------------------------------
PY = [b for b in BLOCKS if b.lang == "python"]


@pytest.mark.parametrize("block", PY, ids=_ids(PY))
def test_python_block(block, request, prompt_file, tmp_path, monkeypatch, no_plots):
    import tether

    compile(block.code, block.where, "exec")
    spec = next((v for k, v in PYTHON.items() if k in block.code), {})
    if "why" in spec and "start" not in spec:
        return  # listed as not run, with the reason
    code = block.code
    if "start" in spec:
        code = "\n" * code[: code.index(spec["start"])].count("\n") + code[code.index(spec["start"]) :]
    real = tether.load_config
    model_dir = request.getfixturevalue(spec.get("model", "tiny_model_dir"))
    runs = iter(range(100))

    def tiny_config(path=None, overrides=None):
        real(path, overrides)  # the block's own config, checked as written
        forced = {
            "model.name": model_dir,
            "data.prompts": prompt_file,
            "train.steps": 1,
            "train.output_dir": tmp_path / f"run{next(runs)}",
        }
        tiny = {k: v for k, v in TINY_RUN.items() if k != "reward.scorer"}  # the block passes its own
        settings = {**tiny, "eval.every": 0, "eval.capability_texts": 0}
        return real(
            path,
            [*(f"{k}={v}" for k, v in settings.items()), *(overrides or [])]
            + [f"{k}={v}" for k, v in forced.items()],
        )

    monkeypatch.setattr(tether, "load_config", tiny_config)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__doc_block__"}
    exec(compile(spec.get("names", ""), f"{block.where} (names)", "exec"), namespace)
    exec(compile(code, block.where, "exec"), namespace)
    if "after" in spec:
        assert eval(spec["after"], namespace), f"{block.where}: {spec['after']} is false"
    if "run_dir" in namespace:  # a block that trains ran its one step
        assert (Path(namespace["run_dir"]) / "metrics.jsonl").read_text().count("\n") == 1


# ---- yaml -----------------------------------------------------------------------------------
YAML = [b for b in BLOCKS if b.lang == "yaml"]


@pytest.mark.parametrize("block", YAML, ids=_ids(YAML))
def test_yaml_block(block, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(block.code)
    if "compute_environment" in yaml.safe_load(block.code):  # an accelerate config
        from accelerate.commands.config.config_args import ClusterConfig

        from tether.run.setup import check_full_precision, check_launcher

        config = ClusterConfig.from_yaml_file(path)  # as accelerate launch reads it
        check_full_precision(config.mixed_precision)
        check_launcher(config.distributed_type.value)
    else:
        from tether.run.config import load_config

        load_config(path)


# ---- every block is of a kind checked here; inline code --------------------------------------
def test_every_block_is_fenced_with_a_known_language():
    unknown = [f"{b.where} ```{b.lang}" for b in BLOCKS if b.lang not in PASTED | TEXT]
    assert not unknown, f"fenced blocks of a language this test does not check: {unknown}"
    indented = [w for p in DOCS for w in _indented_code(p)]
    assert not indented, (
        f"indented code blocks (fence them with their language, ```bash, so this test reads them): {indented}"
    )


CALLS = [(w, t) for w, t in INLINE if re.match(r"^(tether\.)?(train|load_config)\(", t)]
CLI = [(w, t) for w, t in INLINE if re.match(r"^(python -m )?tether [a-z]", t)]


@pytest.mark.parametrize("where, text", CALLS, ids=[f"{w} {t[:40]}" for w, t in CALLS])
def test_inline_call_binds_to_the_signature(where, text):
    import tether

    call = ast.parse(text, mode="eval").body
    assert isinstance(call, ast.Call), f"{where}: `{text}` is not a call"
    func = tether.train if ast.unparse(call.func).endswith("train") else tether.load_config
    try:
        inspect.signature(func).bind(*call.args, **{k.arg: k.value for k in call.keywords})
    except TypeError as e:
        pytest.fail(f"{where}: `{text}`: {func.__module__}.{func.__name__}() {e}")


@pytest.mark.parametrize("where, text", CLI, ids=[f"{w} {t[:40]}" for w, t in CLI])
def test_inline_command(where, text):
    """Prose names commands without their arguments (`tether report`): the command must exist,
    and the overrides it gives must load."""
    from tether.cli import _parser
    from tether.run.config import ConfigError, load_config

    argv = _synopsis_dropped(_tether_argv(shlex.split(text)))
    commands = next(a for a in _parser()._actions if a.dest == "command").choices
    assert argv[0] in commands, f"{where}: `{text}`: tether has no command {argv[0]!r}"
    try:
        load_config(None, [a for a in argv[1:] if re.match(OVERRIDE, a)])
    except ConfigError as e:
        pytest.fail(f"{where}: `{text}`: {e}")


def test_the_checks_see_a_wrong_keyword_and_a_wrong_field(tmp_path):
    """The checks above fail on what they are for: an unknown keyword of train(), a field that does
    not exist, a command neither run nor listed, an indented code block."""
    with pytest.raises(pytest.fail.Exception, match="reward_funcz"):
        test_inline_call_binds_to_the_signature("X:1", "tether.train(config, reward_funcz=...)")
    with pytest.raises(pytest.fail.Exception, match="kl.kl_cof"):
        test_inline_command("X:1", "tether train kl.kl_cof=0.1")
    with pytest.raises(pytest.fail.Exception, match="kl.kl_cof"):
        _check_tether(["train", "--resume", "RUN", "kl.kl_cof=0.1"], "X:1")
    with pytest.raises(AssertionError, match="neither run nor listed"):
        _check_other(["huggingface-cli", "download", "ORG/NAME"], "X:1")
    page = tmp_path / "page.md"
    page.write_text("Run:\n\n    tether train\n\n* a list item\n\n      its indented paragraph\n")
    assert _indented_code(page, tmp_path) == ["page.md:3"]
