"""Behaviour kept across a refactor: tiny runs of every trainer and the main options, digested.

Usage: python benchmarks/same_runs.py --save before.json     (on the old tree)
       python benchmarks/same_runs.py --compare before.json  (on the new tree)

Each case is one ``tether train`` (in this process, through ``tether.cli.main``) on a tiny random
Llama built here (2 layers, hidden size 32; nothing downloads) with a length reward, 3 steps,
evaluations on. A case's digest is the SHA-256 of its ``metrics.jsonl`` rows with the ``time/*``
keys left out, serialized in file order: two trees that compute the same thing give the same
digest bit for bit (same machine, same kernels). ``--compare`` prints each case as same or
different and, for a different one, the first differing row and key; it exits 1 when any differs.
``--ignore KEY`` (repeatable) leaves a metric out of the comparison, for a change meant to move it
(the k3 of ``policy/approx_kl`` moved to ``expm1``), and prints its largest relative change.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FIXED = ["kl.controller=fixed", "kl.kl_coef=0.05"]  # the default budget leash starts at beta 0
G2 = ["rollout.group_size=2"]
CASES: dict[str, list[str]] = {
    "ppo": [],
    "ppo fixed": FIXED,
    "ppo kl_shaping=exact": [*FIXED, "ppo.kl_shaping=exact"],
    "ppo returns scaled": [*FIXED, "reward.weights=[50.0]"],
    "ppo scale_returns=false": [*FIXED, "reward.weights=[50.0]", "ppo.scale_returns=false"],
    "ppo adaptive": ["kl.controller=adaptive"],
    "ppo lora": [*FIXED, "model.lora_r=4"],
    "grpo": ["train.algo=grpo", *G2],
    "grpo fixed": ["train.algo=grpo", *G2, *FIXED],
    "grpo scale_kl_by_std": ["train.algo=grpo", *G2, *FIXED, "grpo.scale_kl_by_std=true"],
    "dr grpo": ["train.algo=grpo", *G2, *FIXED, "grpo.scale_by_std=false"],
    "grpo k1_seq": ["train.algo=grpo", *G2, *FIXED, "kl.loss_estimator=k1_seq"],
    "grpo kl_in_reward": ["train.algo=grpo", *G2, *FIXED, "kl.kl_in_reward=true", "kl.kl_in_loss=false"],
    "grpo 0/1 reward": ["train.algo=grpo", *G2, *FIXED, "reward.scorer=tests.conftest:one_if_long"],
    "rloo": ["train.algo=rloo", *G2, *FIXED],
    "dpo": ["train.algo=dpo", "dpo.n_pairs=6", "dpo.candidates=2", "dpo.kl_eval_prompts=4"],
    "grpo unscored async": [
        "train.algo=grpo",
        *G2,
        *FIXED,
        "reward.scorer=tests.conftest:async_first_of_four_unscored",
    ],
    "ppo tool turns": [
        *FIXED,
        "rollout.env=tests.conftest:tool_env",
        "rollout.max_turns=2",
        "rollout.stop_strings=[e]",
    ],
}
"""name -> the overrides of a case, after :func:`base_args`."""


def compiled_case() -> dict[str, list[str]]:
    """The compiled-decode case, where this machine can compile the decode step
    (:func:`tether.models.sampling.can_compile`); {} elsewhere."""
    from tether.models.sampling import can_compile

    return {} if can_compile("cpu") else {"ppo compiled decode": [*FIXED, "rollout.compile=true"]}


def base_args(model: Path, prompts: Path, out: Path) -> list[str]:
    return [
        "train",
        f"model.name={model}",
        f"data.prompts={prompts}",
        "data.heldout_fraction=0.2",
        "rollout.batch_size=4",
        "rollout.max_new_tokens=6",
        "optim.minibatch_size=2",
        "optim.epochs=2",
        "train.steps=3",
        "train.sample_every=2",
        "train.checkpoint_every=0",
        "train.save_model=false",
        "eval.n_prompts=4",
        "eval.judge=tests.conftest:length_judge",
        "reward.scorer=tests.conftest:length_judge",
        "eval.fluency_model=none",
        "eval.every=2",
        "eval.periodic_prompts=4",
        "train.progress=false",
        f"train.output_dir={out}",
    ]


def rows_without_time(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def run_cases(root: Path) -> dict[str, list[dict]]:
    import contextlib
    import io

    from tests.conftest import make_tiny_llama, make_tokenizer
    from tether.cli import main

    tok = make_tokenizer()
    model = make_tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model_dir = root / "tiny-llama"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    prompts = root / "prompts.txt"
    lines = [f"the movie number {i} was" for i in range(40)] + [f"a film {i} that" for i in range(40)]
    prompts.write_text("\n".join(lines) + "\n")
    out: dict[str, list[dict]] = {}
    for name, extra in (CASES | compiled_case()).items():
        run = root / name.replace(" ", "_").replace("/", "-").replace("=", "-")
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            code = main(base_args(model_dir, prompts, run) + extra)
        if code != 0:
            raise SystemExit(f"case {name!r} exited {code}:\n{err.getvalue()[-2000:]}")
        out[name] = rows_without_time(run)
        print(f"{name:28s} {digest(out[name])[:16]}  ({len(out[name])} rows)", flush=True)
    return out


def drop(rows: list[dict], keys: list[str]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in keys} for r in rows]


def digest(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def first_difference(a: list[dict], b: list[dict]) -> str:
    if len(a) != len(b):
        return f"{len(a)} rows against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x == y and list(x) != list(y):
            return f"row {i}: the same values, the keys in another order"
        for k in sorted(set(x) | set(y)):
            if x.get(k, "<missing>") != y.get(k, "<missing>"):
                return f"row {i} {k}: {x.get(k, '<missing>')!r} against {y.get(k, '<missing>')!r}"
    return "same"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", type=Path, help="write the cases' rows to this JSON file")
    ap.add_argument("--compare", type=Path, help="compare against rows saved by --save")
    ap.add_argument("--ignore", action="append", default=[], metavar="KEY", help="a metric left out")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_cases(Path(tmp))
    if args.save:
        args.save.write_text(json.dumps(rows))
        print(f"wrote {args.save}")
    if args.compare:
        before = json.loads(args.compare.read_text())
        differ, moved = 0, dict.fromkeys(args.ignore, 0.0)
        cases = CASES | compiled_case()
        for name in cases:
            if name not in before:
                print(f"{name:28s} not in {args.compare}")
                continue
            for key in args.ignore:
                for x, y in zip(before[name], rows[name]):
                    if isinstance(x.get(key), float) and isinstance(y.get(key), float):
                        rel = abs(x[key] - y[key]) / max(abs(x[key]), 1e-300)
                        moved[key] = max(moved[key], rel)
            diff = first_difference(drop(before[name], args.ignore), drop(rows[name], args.ignore))
            differ += diff != "same"
            print(f"{name:28s} {'byte-identical' if diff == 'same' else 'DIFFERS: ' + diff}")
        left_out = "".join(f", {k}" for k in args.ignore)
        same = len(cases) - differ
        print(f"{same} of {len(cases)} cases byte-identical (metrics.jsonl without time/*{left_out})")
        for key, rel in moved.items():
            print(f"{key}: largest relative change {rel:.2e}")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
