"""Command line: ``tether train [--config FILE.yaml] [section.field=value ...]``."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tether", description="RLHF fine-tuning on a visible KL leash.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a policy (PPO) against a scorer with a KL penalty",
                       description="Override any config field with section.field=value, e.g. "
                                   "kl.kl_coef=0.1 optim.lr=2e-5 train.steps=10")
    t.add_argument("--config", help="YAML config file (see configs/)")
    t.add_argument("overrides", nargs="*", help="section.field=value")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from tether.config import ConfigError, load_config

    try:
        config = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"tether: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "train":
        from tether.train import train

        try:
            train(config)
        except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
            print(f"tether: error: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
