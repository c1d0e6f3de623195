"""Shared fixtures and helpers: a tiny random Llama and a tiny byte-level tokenizer, built in the
test; the arguments of a tiny run; an offline Hub cache; the tiers, from the folders.

Nothing here downloads anything; a 2-layer Llama with hidden size 32 loads in milliseconds.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one pytest-xdist worker per core (at most 4): each keeps to one thread, as
    # do the runs it starts, since two workers of two threads on two cores make torch's thread
    # pools wait on each other (a step 10-20x slower, not 2x)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))

CORPUS = [
    "the movie was great and the acting was wonderful",
    "a terrible boring film with awful dialogue",
    "i loved this story, a delightful and moving picture",
    "the plot is weak but the music is good",
    "worst movie ever, bad bad bad",
    "an excellent, charming and funny comedy",
] * 4


def make_tokenizer():
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=300, min_frequency=1, special_tokens=["<eos>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<eos>")
    tok.padding_side = "left"
    return tok


def make_tiny_llama(vocab_size: int, seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=None,
    )
    cfg.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.eval()
    return model


CHAT = (
    "{{ bos_token }}{% for m in messages %}[user] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
"""A minimal chat template with a BOS token: the tiny tokenizer has none of its own."""

TINY_RUN = {
    "data.heldout_fraction": 0.2,
    "rollout.batch_size": 4,
    "rollout.max_new_tokens": 4,
    "optim.minibatch_size": 2,
    "optim.epochs": 1,
    "train.steps": 1,
    "eval.n_prompts": 0,
    "eval.judge": "none",
    "reward.scorer": "tests.conftest:length_judge",
    "train.progress": "false",
    "train.save_model": "false",
    "train.checkpoint_every": 0,
}
"""The overrides of a tiny run: seconds on a tiny random model, nothing downloaded or judged."""


def tiny_run_args(
    model_dir, prompts, out, overrides: dict | None = None, *, command: bool = False
) -> list[str]:
    """CLI overrides of a tiny run (:data:`TINY_RUN`) on ``model_dir`` (None: model.name left at
    its default) and the prompt file ``prompts``, writing to ``out``. ``overrides`` change a
    setting, add one, or drop one with None (the default then applies). ``command``: prefixed by
    the ``train`` command, as :func:`tether.cli.main` takes it."""
    settings = {"model.name": model_dir, "data.prompts": prompts, **TINY_RUN, **(overrides or {})}
    settings["train.output_dir"] = out
    args = [f"{k}={v}" for k, v in settings.items() if v is not None]
    return ["train", *args] if command else args


def tiny_cli_args(tiny_model_dir, prompt_file, out):
    """A tiny run with periodic evaluations, samples and a gold judge, as ``tether train`` takes it."""
    overrides = {
        "rollout.max_new_tokens": 6,
        "optim.epochs": 2,
        "train.steps": 3,
        "train.sample_every": 2,
        "eval.n_prompts": 4,
        "eval.judge": "tests.conftest:length_judge",
        "eval.every": 2,
        "eval.periodic_prompts": 4,
        "reward.scorer": None,
        "train.save_model": None,
        "train.checkpoint_every": None,
    }
    return tiny_run_args(tiny_model_dir, prompt_file, out, overrides, command=True)


REPO = Path(__file__).resolve().parents[1]
SHA = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(home: Path, repo_id: str, folder: Path, kind: str = "models") -> Path:
    """``folder``'s files as the snapshot ``SHA`` of ``repo_id`` in an HF cache under ``home``
    (``hub/models--ORG--NAME/snapshots/SHA`` with ``refs/main`` naming it), as a download leaves it."""
    root = home / "hub" / f"{kind}--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, root / "snapshots" / SHA)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(SHA)
    return root


def offline_cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-m", "tether", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


REAL_AUTO_SHARE = 0.25
"""tether.judges.fluency.AUTO_SHARE as tether sets it (checked in :func:`pytest_configure`)."""


def pytest_configure(config):
    """``eval.fluency_model=auto`` keeps the judge on in every run of this process, module-scoped
    fixtures' included: tiny runs are all short, and the tests read its numbers; tests marked
    ``fluency_auto`` get the real share back (:func:`tiny_fluency_judge`)."""
    import tether.judges.fluency as fluency

    assert fluency.AUTO_SHARE == REAL_AUTO_SHARE, "update REAL_AUTO_SHARE"
    fluency.AUTO_SHARE = math.inf


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A saved tiny Llama + tokenizer folder, usable as ``model.name``."""
    out = tmp_path_factory.mktemp("tiny-llama")
    model = make_tiny_llama(
        len(tiny_tokenizer),
        eos_token_id=tiny_tokenizer.eos_token_id,
        pad_token_id=tiny_tokenizer.pad_token_id,
    )
    model.save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session", autouse=True)
def tiny_gemma(tiny_model_dir):
    """The embedded fluency judge (Gemma-3-270M, what eval.fluency_model=auto turns on) is the tiny
    Llama in every run in this process, module-scoped fixtures' included (they are set up before
    any function-scoped fixture), except in tests marked ``real_fluency``
    (:func:`tiny_fluency_judge`): its numbers are then the tiny model's, and no test waits for the
    real one. Yields the real ``embedded_model_folder``."""
    import tether.models.loading as loading

    real = loading.embedded_model_folder
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            loading,
            "embedded_model_folder",
            lambda name: tiny_model_dir if name == "gemma3-270m" else real(name),
        )
        yield real


@pytest.fixture(scope="session", autouse=True)
def quick_plots():
    """Every figure a run draws in this process is built (its artists, from the run's numbers) but
    not laid out and rasterized: :func:`tether.run.plots.save_png` writes one small fixed PNG in its
    place, through the same whole-file writer. Drawing training.png took 1.5-2.5 s of a tiny run's
    3-8 on 2 cores, in some 300 runs. Tests marked ``real_plots`` draw them
    (:func:`real_plots`), and runs in a subprocess always do. Yields the real ``save_png``."""
    import io

    import matplotlib.pyplot as plt

    from tether.run import plots
    from tether.run.files import replace_whole

    real = plots.save_png
    fig = plt.figure(figsize=(0.2, 0.2))
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)

    def stand_in(fig, out, dpi=110):
        plt.close(fig)
        replace_whole(Path(out), png.getvalue())

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plots, "save_png", stand_in)
        yield real


@pytest.fixture(autouse=True)
def real_plots(request, monkeypatch, quick_plots):
    """Tests marked ``real_plots`` lay out and rasterize every figure (:func:`quick_plots`)."""
    from tether.run import plots

    if request.node.get_closest_marker("real_plots"):
        monkeypatch.setattr(plots, "save_png", quick_plots)


@pytest.fixture(autouse=True)
def tiny_fluency_judge(request, monkeypatch, tiny_gemma):
    """Tests marked ``real_fluency`` get the real Gemma back (:func:`tiny_gemma`). ``auto`` keeps
    the judge on in every run (tiny runs are all short), except in tests marked ``fluency_auto``,
    which test its rule."""
    import tether.judges.fluency as fluency
    import tether.models.loading as loading

    if request.node.get_closest_marker("real_fluency"):
        monkeypatch.setattr(loading, "embedded_model_folder", tiny_gemma)
        return
    if request.node.get_closest_marker("fluency_auto"):  # its real rule (pytest_configure lifted it)
        monkeypatch.setattr(fluency, "AUTO_SHARE", REAL_AUTO_SHARE)


@pytest.fixture()
def tiny_lm(tiny_tokenizer):
    return make_tiny_llama(
        len(tiny_tokenizer),
        eos_token_id=tiny_tokenizer.eos_token_id,
        pad_token_id=tiny_tokenizer.pad_token_id,
    )


@pytest.fixture()
def prompt_file(tmp_path) -> Path:
    lines = [f"the movie number {i} was" for i in range(40)] + [f"a film {i} that" for i in range(40)]
    p = tmp_path / "prompts.txt"
    p.write_text("\n".join(lines) + "\n")
    return p


def metric_rows(run_dir: Path, timings: bool = False) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl``; without ``time/*`` keys unless ``timings``."""
    import json

    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return rows if timings else [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def length_judge(texts: list[str]) -> list[float]:
    """A cheap stand-in gold judge for tests: response length in characters / 100."""
    return [len(t) / 100 for t in texts]


def exits_at_step_0(completions, trainer_state, **kwargs) -> list[float]:
    """A reward function that calls ``sys.exit(0)`` at step 0 (length / 100 otherwise)."""
    import sys

    if trainer_state.global_step == 0:
        sys.exit(0)
    return [len(c) / 100 for c in completions]


def exits_once_at_step_2(prompts, completions, trainer_state, **kwargs) -> list[float]:
    """Length / 100 plus a draw from Python's and torch's RNGs (so a resume that did not put the
    RNGs back would differ); at step 2 it calls ``sys.exit(0)`` once, after drawing, while the file
    ``$TETHER_TEST_EXIT_MARKER`` does not exist (it writes it)."""
    import random
    import sys

    noise = [1e-3 * random.random() + 1e-3 * float(torch.rand(())) for _ in completions]
    marker = Path(os.environ["TETHER_TEST_EXIT_MARKER"])
    if trainer_state.global_step == 2 and not marker.exists():
        marker.write_text("exited")
        sys.exit(0)
    return [len(c) / 100 + n for c, n in zip(completions, noise)]


def raises_once_at_step_2(prompts, completions, trainer_state, **kwargs) -> list[float]:
    """:func:`exits_once_at_step_2` with a failure in place of ``sys.exit``: at step 2 it raises
    ``ConnectionError`` once (a reward service down), after drawing from the RNGs."""
    import random

    noise = [1e-3 * random.random() + 1e-3 * float(torch.rand(())) for _ in completions]
    marker = Path(os.environ["TETHER_TEST_EXIT_MARKER"])
    if trainer_state.global_step == 2 and not marker.exists():
        marker.write_text("raised")
        raise ConnectionError("the reward service is down")
    return [len(c) / 100 + n for c, n in zip(completions, noise)]


def one_if_long(texts: list[str]) -> list[float]:
    """A 0/1 reward for tests: 1 when the response has at least 8 characters."""
    return [float(len(t) >= 8) for t in texts]


def slow_length_scorer(texts: list[str]) -> list[float]:
    """A scorer that takes 0.3 s per call, so a test can kill a run between two steps."""
    import time

    time.sleep(0.3)
    return [len(t) / 100 for t in texts]


def length_scorer_held_until_go(texts: list[str]) -> list[float]:
    """Length / 100, each call held until the file ``$TETHER_TEST_GO`` exists (at most 120 s): a
    test keeps a run alive, between two steps, for exactly as long as it needs it."""
    import os
    import time
    from pathlib import Path

    go, deadline = Path(os.environ["TETHER_TEST_GO"]), time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return [len(t) / 100 for t in texts]


def constant_scorer(texts: list[str]) -> list[float]:
    return [0.5 for _ in texts]


def broken_scorer(texts: list[str]) -> list[float]:
    raise KeyError("scorer service down")


def answer_checker(prompts: list, completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """A verifiable-reward function: each row's ``answer`` column must be that of its own prompt
    (``"ans:" + prompt``), whatever groups and shards did to the order; scores the length."""
    for p, a in zip(prompts, answer):
        if a != f"ans:{p}":
            raise AssertionError(f"answer {a!r} came with prompt {p!r}")
    return [len(c) / 10 for c in completions]


def sometimes_none(completions: list[str]) -> list:
    """A reward that applies to even-length completions only (None for the others, as in TRL)."""
    return [1.0 if len(c) % 2 == 0 else None for c in completions]


def never_scores(completions: list, **kwargs) -> list:
    """A reward that applies to no sample: None for every one (each sample is unscored)."""
    return [None] * len(completions)


async def async_length_judge(completions: list, **kwargs) -> list[float]:
    """:func:`length_judge` as an ``async def`` reward function (TRL awaits those): length / 100."""
    import asyncio

    await asyncio.sleep(0)
    return [len(c if isinstance(c, str) else c[-1]["content"]) / 100 for c in completions]


async def async_first_of_four_unscored(completions: list, **kwargs) -> list:
    """An ``async def`` reward that returns None (does not apply) for every fourth sample of its
    call, 0, 4, 8 ... (with groups of 4: one unscored sample per group), length / 100 for the
    others."""
    import asyncio

    await asyncio.sleep(0)
    return [None if i % 4 == 0 else len(c) / 100 for i, c in enumerate(completions)]


def prompt_length_scorer(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """A TRL-style reward function (prompts and completions by name): the prompt's length / 10."""
    assert len(prompts) == len(completions)
    return [len(p) / 10 for p in prompts]


# ---- test tiers -------------------------------------------------------------------------------
TIERS = ("oracle", "e2e", "real")
"""The tiers with a folder of their own: ``tests/oracle`` (exact enumeration on small vocabularies
and tabular optima: equalities, not sampling luck), ``tests/e2e`` (whole runs through the CLI or
accelerate launch, on tiny random models) and ``tests/real`` (the real SmolLM2-135M, ICWSM prompts
and MiniLM judge, also marked `slow`). Every other test is `unit` (hand-worked values, fast path
against slow path, one function at a time), in the folder of the layer it tests
(``tests/core`` ... ``tests/trainers``). Select one with ``pytest -m unit`` (``oracle``, ``e2e``,
``real``)."""


def pytest_generate_tests(metafunc):
    """``device``: each device of ``TETHER_TEST_DEVICES`` (comma-separated, default ``cpu``);
    ``benchmarks/gpu_check.py`` sets ``cuda``."""
    if "device" in metafunc.fixturenames:
        devices = [d.strip() for d in os.environ.get("TETHER_TEST_DEVICES", "cpu").split(",") if d.strip()]
        metafunc.parametrize("device", devices)


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = item.module.__name__.split(".")  # tests.<folder>.test_x, or tests.test_x
        folder = parts[1] if len(parts) > 2 else ""
        item.add_marker(getattr(pytest.mark, folder if folder in TIERS else "unit"))


try:
    from accelerate.tracking import GeneralTracker
except ImportError:  # pragma: no cover
    GeneralTracker = object


class RecordingTracker(GeneralTracker):
    """A fake accelerate tracker (``train.report_to=tests.conftest:RecordingTracker``) that keeps
    what it gets, in class attributes so that a test can read them after the run."""

    name = "recording"
    requires_logging_directory = False
    config: dict = {}
    rows: list = []
    tables: list = []
    finished = False
    project: str | None = None
    run_name: str | None = None

    def __init__(self, project: str | None = None, run_name: str | None = None):
        super().__init__()
        RecordingTracker.project, RecordingTracker.run_name = project, run_name

    @property
    def tracker(self):
        return self

    def store_init_configuration(self, values: dict) -> None:
        RecordingTracker.config = dict(values)

    def log(self, values: dict, step=None, **kwargs) -> None:
        RecordingTracker.rows.append((step, dict(values)))

    def log_table(self, table_name, columns=None, data=None, dataframe=None, step=None, **kwargs) -> None:
        RecordingTracker.tables.append((table_name, step, list(columns), [list(r) for r in data]))

    def finish(self) -> None:
        RecordingTracker.finished = True


def tool_env(prompt, completion, turn, **columns) -> str | None:
    """A tool for multi-turn tests (``rollout.env=tests.conftest:tool_env``): answers the policy's
    first turn with a fixed text, ends the episode after the second."""
    return " [tool: 42]" if turn == 0 else None


def replies_judge(completions, env_replies, **kwargs) -> list[float]:
    """:func:`length_judge` as a TRL-style reward that takes ``env_replies``: it checks that each
    reply is in its transcript, in order, before scoring the transcript's length."""
    assert len(env_replies) == len(completions)
    for text, replies in zip(completions, env_replies):
        at = 0
        for r in replies:
            at = text.index(r, at) + len(r)  # ValueError if the reply is not there
    return length_judge(completions)


def random_tool_env(prompt, completion, turn, **columns) -> str | None:
    """A tool that draws from Python's and NumPy's global generators (a simulator, a sampled
    test case): its reply is the draws, so a run's samples show which numbers it got."""
    import random

    import numpy as np

    return f" r{random.randrange(1000)} n{np.random.randint(1000)}" if turn == 0 else None


RELEASE = __import__("threading").Event()
"""Set by a test to end the calls :func:`faulty_env` left hanging (a call tether abandoned)."""


def faulty_env(prompt, completion, turn, **columns) -> str | None:
    """:func:`random_tool_env`, with one fault injected (issue 50's fault campaign): at its first
    call once the run's metrics.jsonl (``$TETHER_TEST_ENV_METRICS``) holds
    ``$TETHER_TEST_ENV_AFTER`` rows, while the file ``$TETHER_TEST_ENV_MARKER`` does not exist (it
    writes it), it does ``$TETHER_TEST_ENV_FAULT``: ``raise`` (a RuntimeError), ``exit``
    (``sys.exit(0)``), ``interrupt`` (a KeyboardInterrupt) or ``hang`` (it waits for
    :data:`RELEASE`, ten minutes at most). Without ``$TETHER_TEST_ENV_FAULT`` it never faults."""
    import sys

    fault = os.environ.get("TETHER_TEST_ENV_FAULT")
    if fault:
        metrics, marker = (
            Path(os.environ["TETHER_TEST_ENV_METRICS"]),
            Path(os.environ["TETHER_TEST_ENV_MARKER"]),
        )
        rows = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if rows >= int(os.environ.get("TETHER_TEST_ENV_AFTER", "1")) and not marker.exists():
            marker.write_text(fault)
            if fault == "raise":
                raise RuntimeError("the tool's service is down")
            if fault == "exit":
                sys.exit(0)
            if fault == "interrupt":
                raise KeyboardInterrupt
            RELEASE.wait(600)
    return random_tool_env(prompt, completion, turn)


def random_judge(texts: list[str]) -> list[float]:
    """A judge that draws from Python's and NumPy's global generators (a sampled rubric): what a
    run's judging may not take from its training stream."""
    import random

    import numpy as np

    return [random.random() + float(np.random.random()) for _ in texts]


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML (SmolLM2-Instruct's and Qwen's framing) without a default system prompt."""


def make_chat_tokenizer():
    """The tiny tokenizer with ChatML's two special tokens and :data:`CHATML` as its template
    (302 ids: ``<|im_start|>`` 300, ``<|im_end|>`` 301)."""
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> Path:
    """A saved tiny Llama with the ChatML tokenizer, ``<|im_end|>`` an end id beside ``<eos>``."""
    out = tmp_path_factory.mktemp("tiny-chat-llama")
    tok = make_chat_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    model = make_tiny_llama(len(tok), eos_token_id=[tok.eos_token_id, end], pad_token_id=tok.pad_token_id)
    model.generation_config.eos_token_id = [tok.eos_token_id, end]
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture()
def chat_prompt_file(tmp_path) -> Path:
    """80 conversational prompts (one user message each), as jsonl rows ``{"prompt": [...]}``."""
    import json

    lines = [f"the movie number {i} was" for i in range(40)] + [f"a film {i} that" for i in range(40)]
    p = tmp_path / "chat.jsonl"
    p.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": t}]}) + "\n" for t in lines))
    return p


def chat_tool_env(prompt, completion, turn, **columns) -> str | None:
    """A tool for chat-format tests: it gets the conversation's messages (TRL's form) and answers
    the first assistant turn with ``42``, ending the episode after the second."""
    assert isinstance(prompt, list) and prompt[0]["role"] == "user", prompt
    assert isinstance(completion, list) and completion[-1]["role"] == "assistant", completion
    assert [m["role"] for m in completion] == ["assistant", "tool"] * turn + ["assistant"], completion
    return "42" if turn == 0 else None


def messages_judge(prompts, completions, **kwargs) -> list[float]:
    """A TRL-style reward for chat-format tests: the characters of the last assistant message,
    divided by 10, after checking that each completion is messages (assistant, tool, ...)."""
    out = []
    for c in completions:
        assert isinstance(c, list) and c[0]["role"] == "assistant", c
        assert all(m["role"] == ("assistant", "tool")[i % 2] for i, m in enumerate(c)), c
        out.append(len(c[-1]["content"]) / 10)
    return out


@pytest.fixture()
def unprivileged():
    """Runs ``python ARGS`` (this tree's tether importable) as a process that file modes bind: as
    it is for a user other than root; for root, through ``setpriv`` without the capabilities that
    override them (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so a mode-000 file is unreadable and a
    read-only folder unwritable, as for any user. Skips where neither can be had."""
    prefix = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        probe = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "true"] if setpriv else None
        if probe is None or subprocess.run(probe, capture_output=True).returncode != 0:
            pytest.skip("root without setpriv: file modes cannot bind this test's process")
        prefix = probe[:2]

    def run(*args: str) -> subprocess.CompletedProcess:
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]), OMP_NUM_THREADS="1"
        )
        return subprocess.run(
            [*prefix, sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
        )

    return run


@pytest.fixture()
def hang_guard():
    """``with hang_guard(seconds):`` fails with TimeoutError where the code inside blocks longer
    (opening a FIFO no one writes to): SIGALRM's handler raises, which interrupts the call."""
    import contextlib
    import signal

    @contextlib.contextmanager
    def guard(seconds: int = 60):
        def hung(*_):
            raise TimeoutError(f"blocked for {seconds} s (opening a FIFO?)")

        previous = signal.signal(signal.SIGALRM, hung)
        signal.alarm(seconds)
        try:
            yield
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)

    return guard
