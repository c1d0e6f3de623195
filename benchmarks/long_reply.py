"""A tool's long reply in a multi-turn rollout: the time and the peak memory of one rollout whose
environment answers with ``--mb`` megabytes of text, on the tiny random model of the tests.

Each measurement runs in a fresh process (peak RSS is per process): one rollout of 4 rows, 2 turns,
``--tokens`` response tokens, the reply appended raw (cut to the tokens left) or, in the chat
format, dropped (a tool message is never cut). Prints the seconds of the rollout, the process's
peak RSS before and after it, and a digest of the rollout's token ids (the same in every checkout
that appends the same tokens).

    python benchmarks/long_reply.py                     # this checkout
    python benchmarks/long_reply.py --tree /tmp/before  # another checkout's src/
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import hashlib, resource, sys, time
sys.path.insert(0, {repo!r})
import torch
from tests.conftest import make_chat_tokenizer, make_tiny_llama, make_tokenizer
from tether.models.sampling import SamplingSettings
from tether.models.turns import generate_turns

chat = {chat!r}
tok = make_chat_tokenizer() if chat else make_tokenizer()
lm = make_tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
reply = ("the movie was great and the acting was wonderful. " * 40000)[: int({mb} * 2**20)]
prompts = [[{{"role": "user", "content": "the movie"}}]] * 4 if chat else ["the movie was"] * 4

def env(prompt, completion, turn, **columns):
    return reply if turn == 0 else None

settings = SamplingSettings(max_new_tokens={tokens}, temperature=1.0, stop_strings=("e",), max_turns=2)
kw = dict(settings=settings, seeds=list(range(4)))
generate_turns(lm, tok, prompts, lambda **k: None, **kw)  # warm: the model's first forward
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t0 = time.perf_counter()
ro = generate_turns(lm, tok, prompts, env, **kw)
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
called = sum(bool(e) for e in ro.env_texts)
digest = hashlib.sha256(str(ro.response_ids.tolist()).encode()).hexdigest()[:12]
print(
    f"{{dt:.3f}} s, peak RSS {{base:.0f}} -> {{peak:.0f}} MB, rows with the reply appended: {{called}}, "
    f"response ids sha256 {{digest}}"
)
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", default=str(REPO), help="the checkout whose src/ is measured")
    p.add_argument("--mb", type=float, default=1.0, help="the reply's size, MiB of text")
    p.add_argument("--tokens", type=int, default=32, help="rollout.max_new_tokens")
    args = p.parse_args()
    env = dict(os.environ, PYTHONPATH=str(Path(args.tree) / "src"), OMP_NUM_THREADS="1")
    for chat in (False, True):
        code = CHILD.format(repo=str(REPO), chat=chat, mb=args.mb, tokens=args.tokens)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            return 1
        kind = "chat" if chat else "raw "
        print(f"{kind} reply of {args.mb:g} MiB, {args.tokens} tokens: {out.stdout.strip()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
