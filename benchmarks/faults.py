"""Bad inputs and injected faults, each run through ``tether train`` in a fresh process on a tiny
random model: does tether refuse with the field or file named (or recover exactly)?

Each case is a command, sometimes with a fault injected before it (a flipped byte, a torn line, a
pickle payload, a file-size limit, a second process), and the words its output must hold: the
field or the file and the fix, or the note of a recovery. A case counts as handled when its exit
code is the expected one and every word is there. Prints a markdown table and the count.

    python benchmarks/faults.py                     # this checkout
    python benchmarks/faults.py --tree /tmp/before  # another checkout's src/ (a git worktree)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def tiny_model(folder: Path) -> Path:
    from tests.conftest import make_tiny_llama, make_tokenizer

    tok = make_tokenizer()
    model = make_tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def base_args(model: Path, prompts: Path, out: Path) -> list[str]:
    return [
        f"model.name={model}",
        f"data.prompts={prompts}",
        "data.heldout_fraction=0.2",
        "rollout.batch_size=4",
        "rollout.max_new_tokens=4",
        "optim.minibatch_size=2",
        "train.steps=3",
        "train.checkpoint_every=1",
        "eval.n_prompts=2",
        "eval.every=0",
        "eval.judge=none",
        "eval.fluency_model=none",
        "reward.scorer=tests.conftest:length_judge",
        "train.progress=false",
        "train.save_model=false",
        f"train.output_dir={out}",
    ]


REWARDS = """
import sys
CALLS = [0]
def _exits(code, completions):
    CALLS[0] += 1
    if CALLS[0] == 3:  # the reference's held-out evaluation, step 0, then step 1
        sys.exit(code)
    return [len(c) / 100 for c in completions]
def exits_0(completions, **kw):
    return _exits(0, completions)
def exits_3(completions, **kw):
    return _exits(3, completions)
"""


class Ctx:
    def __init__(self, root: Path, src: Path):
        self.root, self.src = root, src
        self.model = tiny_model(root / "model")
        self.prompts = root / "prompts.txt"
        self.prompts.write_text("".join(f"the movie number {i} was\n" for i in range(40)))
        (root / "fault_rewards.py").write_text(REWARDS)
        self.n = 0

    def env(self) -> dict:
        return dict(
            os.environ,
            PYTHONPATH=f"{self.src}{os.pathsep}{REPO}{os.pathsep}{self.root}",
            OMP_NUM_THREADS="1",
            HOME=str(self.root / "home"),
        )

    def out(self) -> Path:
        self.n += 1
        return self.root / f"run{self.n}"

    def tether(self, args: list[str], limit: int | None = None, timeout: float = 120):
        def cap():
            if limit:
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        try:
            p = subprocess.run(
                [sys.executable, "-m", "tether", "train", *args],
                cwd=self.root,
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=timeout,
                preexec_fn=cap,
            )
            return p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired:
            return "timeout", ""

    def train(self, *extra: str, out: Path | None = None):
        out = out or self.out()
        return out, *self.tether([*base_args(self.model, self.prompts, out), *extra])

    def trained(self) -> Path:
        out, rc, text = self.train()
        assert rc == 0, text
        return out


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _resume(ctx: Ctx, *extra: str, prep=None, steps: int = 4):
    run = ctx.trained()
    if prep:
        prep(run)
    return ctx.tether(["--resume", str(run), f"train.steps={steps}", *extra])


def _data(ctx: Ctx, name: str, content: bytes, *extra: str):
    f = ctx.root / name
    f.write_bytes(content)
    return ctx.train(f"data.prompts={f}", *extra)[1:]


def _upper_jsonl(ctx: Ctx):
    f = ctx.root / "upper.JSONL"
    f.write_text("".join(f'{{"prompt": "a film {i} that"}}\n' for i in range(20)))
    out, rc, text = ctx.train(f"data.prompts={f}")
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()] if rc == 0 else []
    raw = sum(str(r.get("prompt", "")).startswith("{") for r in rows)
    return rc, text + f"\nsample prompts {len(rows)}, raw JSON prompts: {raw}"


def _broken_model(ctx: Ctx, how: str):
    from safetensors.torch import load_file, save_file

    folder = ctx.root / f"model-{how}"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(ctx.model, folder)
    if how == "missing":
        t = load_file(folder / "model.safetensors")
        del t[sorted(t)[3]]
        save_file(t, folder / "model.safetensors", metadata={"format": "pt"})
    else:
        (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return ctx.train(f"model.name={folder}")[1:]


def _payload(run: Path) -> None:
    import torch

    from tether.run.checkpoint import file_digests, latest_checkpoint

    ckpt = latest_checkpoint(run)
    state = torch.load(ckpt / "trainer.pt", weights_only=True)
    torch.save({**state, "trainer": _Payload(str(run.parent / "payload-ran"))}, ckpt / "trainer.pt")
    meta = json.loads((ckpt / "meta.json").read_text())
    if "files" in meta:  # the attacker rewrites the digests too
        meta |= {"files": file_digests(ckpt)}
        if "meta_sha256" in meta:
            from tether.run.checkpoint import meta_digest

            meta["meta_sha256"] = meta_digest(meta)
        (ckpt / "meta.json").write_text(json.dumps(meta))


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _latest(run: Path, text: str) -> None:
    (run / "checkpoints" / "LATEST").write_text(text)


def _newest(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("step-*"))[-1]


def _two_at_once(ctx: Ctx):
    out = ctx.out()
    args = [sys.executable, "-m", "tether", "train", *base_args(ctx.model, ctx.prompts, out), "train.steps=6"]
    procs = [
        subprocess.Popen(
            args, cwd=ctx.root, env=ctx.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    codes = sorted(p.returncode for p in procs)
    # one runs, the other is refused (by the lock, or by the folder the first already filled)
    ok = codes[0] == 0 and codes[1] != 0 and steps == list(range(6))
    return (0 if ok else 1), "\n".join(outs) + f"\nexit codes {codes}, steps {steps}"


def _file_limit(ctx: Ctx):
    size = (ctx.model / "model.safetensors").stat().st_size
    out = ctx.out()
    rc, text = ctx.tether(base_args(ctx.model, ctx.prompts, out), limit=size // 2)
    left = [p.name for p in (out / "checkpoints").glob(".*")] if (out / "checkpoints").exists() else []
    return rc, text + f"\ntemporaries left: {left}"


# name -> (run(ctx) -> (rc, output), expected rc ("nonzero" or an int), words the output must hold)
CASES = {
    "data.prompts=upper.JSONL": (_upper_jsonl, 0, ["raw JSON prompts: 0"]),
    "data.prompts=p.tsv": (
        lambda c: _data(c, "p.tsv", b"prompt\tid\na film\t1\n" * 5),
        "nonzero",
        ["data.prompts", ".tsv"],
    ),
    "data.prompts=p.jsonl.gz": (
        lambda c: _data(c, "p.jsonl.gz", b"\x1f\x8b\x08\0" * 4),
        "nonzero",
        ["data.prompts", ".gz"],
    ),
    "latin-1 prompt file": (
        lambda c: _data(c, "latin.txt", "un caf\xe9 film\n".encode("latin-1") * 9),
        "nonzero",
        ["data.prompts", "latin.txt", "UTF-8"],
    ),
    "binary prompt file": (
        lambda c: _data(c, "bin.txt", bytes(range(256)) * 4),
        "nonzero",
        ["bin.txt", "UTF-8"],
    ),
    "rollout.batch_size=1000000000": (
        lambda c: c.train("rollout.batch_size=1000000000")[1:],
        "nonzero",
        ["rollout.batch_size"],
    ),
    "max_new_tokens past the positions": (
        lambda c: c.train("rollout.max_new_tokens=200")[1:],
        "nonzero",
        ["rollout.max_new_tokens", "max_position_embeddings"],
    ),
    "model folder missing a tensor": (
        lambda c: _broken_model(c, "missing"),
        "nonzero",
        ["model.name", "missing"],
    ),
    "model weights not safetensors": (
        lambda c: _broken_model(c, "garbage"),
        "nonzero",
        ["model.name", "model-garbage"],
    ),
    "model.name=/dev/zero": (
        lambda c: c.train("model.name=/dev/zero")[1:],
        "nonzero",
        ["model.name", "/dev/zero"],
    ),
    "optim.lr=1e30": (lambda c: c.train("optim.lr=1e30")[1:], "nonzero", ["optim.lr"]),
    "rollout.temperature=1e-45": (
        lambda c: c.train("rollout.temperature=1e-45")[1:],
        "nonzero",
        ["rollout.temperature"],
    ),
    "train.seed=1e20": (lambda c: c.train("train.seed=100000000000000000000")[1:], "nonzero", ["train.seed"]),
    "train.keep_checkpoints=0": (
        lambda c: c.train("train.keep_checkpoints=0")[1:],
        "nonzero",
        ["train.keep_checkpoints"],
    ),
    "reward calls sys.exit(0)": (
        lambda c: c.train("reward.scorer=fault_rewards:exits_0")[1:],
        "nonzero",
        ["SystemExit(0)", "--resume"],
    ),
    "reward calls sys.exit(3)": (
        lambda c: c.train("reward.scorer=fault_rewards:exits_3")[1:],
        "nonzero",
        ["SystemExit(3)", "--resume"],
    ),
    "--resume train.algo=grpo": (lambda c: _resume(c, "train.algo=grpo"), 2, ["train.algo"]),
    "--resume model.lora_r=4": (lambda c: _resume(c, "model.lora_r=4"), 2, ["model.lora_r"]),
    "--resume data.prompts=small.txt": (
        lambda c: (
            (c.root / "small.txt").write_text("one film\ntwo films\n")
            and _resume(c, "data.prompts=small.txt")
        ),
        2,
        ["data.prompts"],
    ),
    "--resume train.output_dir=OTHER": (
        lambda c: _resume(c, "train.output_dir=/tmp/other"),
        2,
        ["train.output_dir"],
    ),
    "truncated trainer.pt": (
        lambda c: _resume(c, prep=lambda r: (_newest(r) / "trainer.pt").write_bytes(b"PK\3\4")),
        "any",
        ["trainer.pt"],
    ),
    "corrupt meta.json": (
        lambda c: _resume(c, prep=lambda r: (_newest(r) / "meta.json").write_text('{"step": ')),
        "any",
        ["meta.json"],
    ),
    "flipped byte in policy.safetensors": (
        lambda c: _resume(c, prep=lambda r: _flip(_newest(r) / "policy.safetensors")),
        0,
        ["policy.safetensors", "damaged"],
    ),
    "torn last line of metrics.jsonl": (
        lambda c: _resume(c, prep=lambda r: open(r / "metrics.jsonl", "a").write('{"step": 3, "re')),
        0,
        ["torn last line"],
    ),
    "bad middle line of metrics.jsonl": (
        lambda c: _resume(
            c,
            prep=lambda r: (r / "metrics.jsonl").write_text(
                (r / "metrics.jsonl").read_text().replace('{"step": 1', '{"step" 1', 1)
            ),
        ),
        "nonzero",
        ["metrics.jsonl:2"],
    ),
    "pickle payload in trainer.pt": (
        lambda c: (
            lambda rc, text, c=c: (rc, text + ("\nPAYLOAD RAN" if (c.root / "payload-ran").exists() else ""))
        )(*_resume(c, prep=_payload)),
        "nonzero",
        ["trainer.pt", "not a trainer state"],
    ),
    "LATEST=../../..": (
        lambda c: _resume(c, prep=lambda r: _latest(r, "../../..")),
        "any",
        ["LATEST is damaged"],
    ),
    "one bit of meta.json's step flipped": (
        lambda c: _resume(
            c,
            prep=lambda r: (_newest(r) / "meta.json").write_text(
                (_newest(r) / "meta.json").read_text().replace('"step": 2', '"step": 6')
            ),
        ),
        "any",
        ["meta.json", "damaged"],
    ),
    "prompt file shrunk before --resume": (
        lambda c: _resume(
            c, prep=lambda r: c.prompts.write_text("".join(f"the movie number {i} was\n" for i in range(30)))
        ),
        "nonzero",
        ["the prompts differ", "data.prompts"],
    ),
    "checkpoint past a file-size limit": (
        _file_limit,
        "nonzero",
        ["file-size limit", "checkpoints/step-000000 failed", "temporaries left: []"],
    ),
    "two runs into one folder": (_two_at_once, 0, ["train.output_dir"]),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, default=REPO, help="a checkout whose src/ to run")
    ap.add_argument("--only", default="", help="run the cases whose name holds this text")
    args = ap.parse_args()
    rows, handled = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Ctx(Path(tmp), args.tree.resolve() / "src")
        (Path(tmp) / "home").mkdir()
        for name, (run, want, words) in CASES.items():
            if args.only not in name:
                continue
            t0 = time.perf_counter()
            try:
                rc, text = run(ctx)
            except Exception as e:  # a case whose own setup failed on that tree
                rc, text = "setup failed", f"{type(e).__name__}: {e}"
            ok_rc = (
                (
                    want == "any"
                    and rc != "timeout"
                    or (want == "nonzero" and rc not in (0, "timeout"))
                    or rc == want
                )
                and "PAYLOAD RAN" not in text
                and "Traceback" not in text
            )
            missing = [w for w in words if w not in text]
            good = ok_rc and not missing
            handled += good
            last = next((ln for ln in reversed(text.strip().splitlines()) if ln.strip()), "")[:110]
            rows.append(
                (
                    name,
                    rc,
                    "yes" if good else "NO",
                    ", ".join(missing),
                    f"{time.perf_counter() - t0:.0f}",
                    last,
                )
            )
            print(f"{'ok ' if good else 'BAD'} {name}: rc {rc}; missing {missing}; {last}", flush=True)
    print("\n| case | exit | handled | words missing | s | last line |\n|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(x).replace("|", "/") for x in r) + " |")
    print(f"\n{handled} of {len(rows)} handled (refused naming the field or file, or recovered and said so)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
