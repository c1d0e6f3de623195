"""Command line: ``tether train [--config FILE.yaml] [section.field=value ...]``, ``tether config``,
``tether kl RUN``, ``tether interpolate RUN``, ``tether report``, ``tether push``, ``tether frontier``,
``tether reward fit``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    from tether.run.convert import TRAINERS as CONVERTED  # no torch: the parser stays quick

    p = argparse.ArgumentParser(prog="tether", description="RLHF fine-tuning on a visible KL leash.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "train",
        help="train a policy (PPO, GRPO, RLOO or DPO: train.algo) against a scorer, on a KL leash",
        description="Override any config field with section.field=value, e.g. "
        "kl.kl_coef=0.1 optim.lr=2e-5 train.steps=10",
    )
    t.add_argument("--config", help="YAML config file")
    t.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue RUN_DIR from its last checkpoint (its config.yaml; overrides may extend train.steps)",
    )
    t.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (YAML, per-trainer defaults filled in) and exit; nothing is loaded",
    )
    t.add_argument("overrides", nargs="*", help="section.field=value")
    cf = sub.add_parser(
        "config",
        help="list every config field: type, default, unit and what it does",
        description="Read from the config dataclasses (src/tether/run/config.py), where each field is "
        "documented once.",
    )
    cf.add_argument("section", nargs="?", help="one section only (model, data, kl, ...)")
    fr = sub.add_parser(
        "frontier",
        help="sweep runs and best-of-N; plot proxy and gold score against KL",
        description="Each sweep entry is ALGO:KL_COEF (a fixed beta). Overrides apply to every run; "
        "a KL placement or group size left unset is each trainer's default.",
    )
    fr.add_argument("--config", help="YAML config file for every run")
    fr.add_argument("--out", default="runs/frontier", help="output folder (default runs/frontier)")
    fr.add_argument(
        "--sweep",
        default="ppo:0.01,ppo:0.05,ppo:0.2,grpo:0.05",
        help="comma-separated ALGO:KL_COEF runs (default ppo:0.01,ppo:0.05,ppo:0.2,grpo:0.05)",
    )
    fr.add_argument("--bon", default="1,2,4,8,16", help="best-of-N values (default 1,2,4,8,16)")
    fr.add_argument(
        "--bon-prompts",
        type=int,
        default=None,
        help="held-out prompts for best-of-N (default eval.periodic_prompts, the RL runs' prompts)",
    )
    fr.add_argument("overrides", nargs="*", help="section.field=value for every run")
    pu = sub.add_parser("push", help="upload a run's saved policy and its model card to the Hugging Face Hub")
    pu.add_argument("run_dir")
    pu.add_argument("repo_id", help="the model repository, ORG/NAME (created if missing)")
    seen = pu.add_mutually_exclusive_group()
    seen.add_argument(
        "--private",
        dest="public",
        action="store_const",
        const=False,
        help="create the repository private (the default; an existing repository keeps its visibility)",
    )
    seen.add_argument("--public", dest="public", action="store_const", const=True, help="create it public")
    pu.set_defaults(public=False)
    cv = sub.add_parser(
        "convert",
        help="translate a TRL GRPO/RLOO/DPO recipe (YAML) into tether's config, key by key",
        description="Every key is mapped, computed (the arithmetic said), moot, or refused with the "
        "reason; a recipe with a refused key is written only with --allow-dropped.",
    )
    cv.add_argument("recipe", help="the TRL recipe (YAML: trl grpo --config's file)")
    cv.add_argument("--trainer", required=True, choices=CONVERTED, help="the TRL trainer it is for")
    cv.add_argument("-o", "--out", default=None, help="tether config to write (default RECIPE.tether.yaml)")
    cv.add_argument("--processes", type=int, default=1, help="processes TRL ran on (per-device sizes x this)")
    cv.add_argument("--allow-dropped", action="store_true", help="write even when keys have no tether field")
    rp = sub.add_parser("report", help="write a self-contained HTML report of a run directory")
    rp.add_argument("run_dir")
    rp.add_argument("--out", help="output file (default RUN_DIR/report.html)")
    ip = sub.add_parser(
        "interpolate",
        help="evaluate the weights (1 - a) theta_ref + a theta of a finished run at each a (--alpha)",
        description="The zero-training-cost baseline against forgetting: the run's saved policy moved back "
        "toward its reference, each point evaluated as the run's final policy was (held-out gain, KL, "
        "fluency, diversity, capability). Writes RUN/interpolate.json and RUN/interpolate.png.",
    )
    ip.add_argument("run_dir")
    ip.add_argument(
        "--alpha", default="0,0.25,0.5,0.75,1", help="values in [0, 1] (default 0,0.25,0.5,0.75,1)"
    )
    kl = sub.add_parser("kl", help="where a run's KL went: the tokens that carried it (kl_tokens.jsonl)")
    kl.add_argument("run_dir")
    kl.add_argument("--step", type=int, help="the step's record (default: the largest rise of the KL)")
    r = sub.add_parser("reward", help="reward models fitted on human preferences")
    rsub = r.add_subparsers(dest="reward_command", required=True)
    f = rsub.add_parser(
        "fit", help="fit a Bradley-Terry head on MiniLM embeddings of ICWSM-2014 human ratings"
    )
    f.add_argument(
        "--out",
        help="output folder (default: the cached default judge, ~/.cache/tether/reward_models/minilm-bt-6k)",
    )
    f.add_argument(
        "--max-sentences",
        type=int,
        default=None,
        help="fit on a random subset of this many rated sentences (default: all 23,699; the judge "
        "fitted on first use takes 6,000)",
    )
    f.add_argument(
        "--min-gap", type=float, default=2.0, help="minimum difference of mean human ratings in a pair"
    )
    f.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    """The ``tether`` command; with several processes (``accelerate launch``) each closes its
    process group before it exits (a group left open can abort a process at exit: "terminate
    called without an active exception", exit code -6, after the run had finished)."""
    try:
        return _main(argv)
    finally:
        _close_process_group()


def _kl_view(run_dir: str, step: int | None) -> int:
    """``tether kl RUN [--step N]``: the step's KL attribution record (the largest rise without
    ``--step``) and, from eval.json, the capability probe's fallen tokens; a run with no record
    (no jump, kl.tokens_every=0) still shows the latter, with a note."""
    from tether.analysis.kl_tokens import chosen, console_view, probe_view, read_records
    from tether.run.files import read_json

    view, missing = "", None
    try:
        view = console_view(chosen(read_records(run_dir), step))
    except FileNotFoundError as e:
        missing = e
    except (ValueError, OSError) as e:
        print(f"tether: error: {_said(e)}", file=sys.stderr)
        return 1
    probe = ""
    evaluation = Path(run_dir) / "eval.json"
    if step is None and evaluation.is_file():
        try:
            probe = probe_view(read_json(evaluation))
        except (ValueError, OSError) as e:
            print(f"tether: warning: {evaluation} not read: {_said(e)}", file=sys.stderr)
    if missing is not None and not probe:
        print(f"tether: error: {_said(missing)}", file=sys.stderr)
        return 1
    try:
        if missing is not None:
            print(f"tether: no KL record: {_said(missing)}", file=sys.stderr)
        print("\n\n".join(part for part in (view, probe) if part))
    except BrokenPipeError:  # `tether kl RUN | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _interpolate(run_dir: str, alphas: str) -> int:
    """``tether interpolate RUN --alpha ...``: the table, and where the JSON and the figure went."""
    from tether.run.config import ConfigError
    from tether.run.folder import RunFolderError, check_no_links
    from tether.run.interpolate import interpolate, parse_alphas, table
    from tether.run.lock import RunLocked

    try:
        check_no_links(Path(run_dir), "tether interpolate")
        rows = interpolate(run_dir, parse_alphas(alphas))
    except RunLocked as e:  # its advice names train.output_dir, a training run's way out
        said = (
            _said(e)
            .replace(", or use another train.output_dir", "")
            .replace(", stop it, or use another train.output_dir", " or stop it")
        )
        print(f"tether: error: {said} (tether interpolate reads the run's folder alone)", file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError, RuntimeError, ConfigError, RunFolderError) as e:
        print(f"tether: error: {_said(e)}", file=sys.stderr)
        return 1
    print(table(rows))
    print(f"tether: written {Path(run_dir) / 'interpolate.json'} and {Path(run_dir) / 'interpolate.png'}")
    return 0


def _trl_recipe(path: str | None) -> str | None:
    """What ``--config`` of a TRL recipe (TRL's keys at the top, not tether's sections) is told:
    to convert it; None for any other file (its own error stands)."""
    from tether.run.config import ConfigError, read_yaml
    from tether.run.convert import looks_like_a_trl_recipe

    try:
        tree = read_yaml(Path(path).read_text(encoding="utf-8"), f"--config {path}") if path else None
    except (OSError, UnicodeDecodeError, ValueError, ConfigError):
        return None
    keys = looks_like_a_trl_recipe(tree) if isinstance(tree, dict) else []
    if not keys:
        return None
    named = ", ".join(keys[:4]) + (" ..." if len(keys) > 4 else "")
    return (
        f"--config {path} is a TRL recipe ({named}), not a tether config; translate it first: "
        f"tether convert {path} --trainer grpo (or rloo, dpo)"
    )


def _convert(args) -> int:
    """``tether convert RECIPE --trainer T``: every key's fate, then the config written."""
    from tether.run.config import ConfigError
    from tether.run.convert import RecipeError, convert_file, fate_table, write_converted

    out = Path(args.out) if args.out else Path(args.recipe).with_suffix(".tether.yaml")
    if out.resolve() == Path(args.recipe).resolve():
        print(
            f"tether: error: -o {out} is the recipe itself; write the tether config elsewhere",
            file=sys.stderr,
        )
        return 1
    try:
        fates, tree = convert_file(args.recipe, args.trainer, processes=args.processes)
        print(fate_table(fates))
        dropped = write_converted(fates, tree, out, allow_dropped=args.allow_dropped)
    except (FileNotFoundError, RecipeError, ConfigError, OSError) as e:
        print(f"tether: error: {_said(e)}", file=sys.stderr)
        return 1
    kinds = [f.kind for f in fates if not f.key.startswith("(")]
    print(
        f"tether: {len(kinds)} keys: "
        + ", ".join(f"{kinds.count(k)} {k}" for k in ("mapped", "computed", "moot", "refused"))
        + f"; written {out}"
        + (f" without {', '.join(f.key for f in dropped)}" if dropped else "")
        + f". Run it: tether train --config {out}"
    )
    return 0


def _close_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.command in ("train", "frontier", "reward", "interpolate"):  # the commands that load models
        _quiet_transformers()
    if args.command == "reward":
        return _reward_fit(args)
    if args.command == "convert":
        return _convert(args)
    if args.command == "push":
        from tether.run.publish import push

        try:
            url = push(args.run_dir, args.repo_id, private=not args.public)
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            print(f"tether: error: {_said(e)}", file=sys.stderr)
            return 1
        seen = "public" if args.public else "private"
        print(
            f"tether: pushed {args.run_dir}/policy to {url} ({seen} if created now; an existing "
            "repository keeps its visibility)"
        )
        return 0
    if args.command == "report":
        from tether.analysis.report import write_report

        try:
            out = write_report(args.run_dir, args.out)
        except (FileNotFoundError, ValueError, OSError) as e:
            print(f"tether: error: {_said(e)}", file=sys.stderr)
            return 1
        print(f"tether: report written to {out}")
        return 0
    if args.command == "kl":
        return _kl_view(args.run_dir, args.step)
    if args.command == "interpolate":
        return _interpolate(args.run_dir, args.alpha)
    from tether.run.config import ConfigError, load_config

    if args.command == "config":
        return _list_config(args.section)
    overrides = list(args.overrides)
    if args.command == "frontier":  # short runs with periodic held-out evaluation, unless overridden
        overrides = [
            "train.steps=8",
            "eval.every=2",
            "eval.n_prompts=0",
            "train.checkpoint_every=0",
            *overrides,
        ]
    resume = getattr(args, "resume", None)
    if resume:
        from pathlib import Path

        from tether.run.folder import RunFolderError, check_no_links

        try:  # before config.yaml is read: it too may be a link
            check_no_links(Path(resume), "--resume")
        except RunFolderError as e:
            print(f"tether: error: {e}", file=sys.stderr)
            return 1
        if args.config:
            print("tether: config error: --resume uses RUN_DIR/config.yaml; drop --config", file=sys.stderr)
            return 2
        args.config = str(Path(resume) / "config.yaml")
        if not Path(args.config).is_file():
            print(
                f"tether: error: --resume {resume}: not a tether run directory (no config.yaml)",
                file=sys.stderr,
            )
            return 1
        moved = [o for o in args.overrides if o.split("=", 1)[0].strip() == "train.output_dir"]
        if moved:
            print(
                f"tether: config error: --resume {resume} with {moved[-1]}: a resumed run stays in its "
                "folder. Drop the override, or copy the folder and resume the copy: "
                f"cp -r {resume} NEW_DIR && tether train --resume NEW_DIR",
                file=sys.stderr,
            )
            return 2
        overrides.append(f"train.output_dir={resume}")
    try:
        config = load_config(args.config, overrides)
        sweep = _parse_sweep(args.sweep) if args.command == "frontier" else []
    except (ConfigError, FileNotFoundError) as e:
        print(f"tether: config error: {_trl_recipe(args.config) or _said(e)}", file=sys.stderr)
        return 2
    if getattr(args, "print_config", False):
        from tether.core.text import shown
        from tether.run.config import dump_yaml

        # config.yaml's form: the defaults the run fills stay null (so the file reloads with
        # another train.algo or data), their values for this config shown as a comment
        filled = {  # max_prompt_tokens is filled from the data, when the tokenizer has read it
            k: v for k, v in config.unresolved.items() if v is None and k != "rollout.max_prompt_tokens"
        }
        resolved = config.to_dict()
        values = ", ".join(f"{k}={shown(resolved[k.split('.')[0]][k.split('.')[1]])}" for k in filled)
        print(f"# left null, filled when the run starts; for this config: {values}")
        print(dump_yaml(config.to_dict(resolved=False)), end="")
        return 0
    try:
        if args.command == "train":
            from tether.training import Interrupted, train

            try:
                train(config, resume=bool(resume))
            except Interrupted:
                return 130
        elif args.command == "frontier":
            from pathlib import Path

            from tether.analysis.frontier import frontier
            from tether.training import Interrupted

            try:
                out = frontier(
                    config, sweep, [int(n) for n in args.bon.split(",")], Path(args.out), args.bon_prompts
                )
            except Interrupted as e:
                print(
                    f"tether: frontier stopped; the interrupted run is resumable: tether train --resume {e}",
                    file=sys.stderr,
                )
                return 130
            print(f"tether: frontier written to {out / 'frontier.png'} and {out / 'frontier.csv'}")
    except ConfigError as e:  # found once the run starts (train.device=cuda without CUDA ...)
        print(f"tether: config error: {_said(e)}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError, FloatingPointError, OSError) as e:
        print(f"tether: error: {_said(e)}", file=sys.stderr)
        return 1
    return 0


def _list_config(section: str | None) -> int:
    """``tether config [SECTION]``: each field, its type and default, its unit, its doc's first sentence."""
    from tether.run.config import ConfigError, config_fields

    try:
        fields = config_fields(section)
    except ConfigError as e:
        print(f"tether: config error: {_said(e)}", file=sys.stderr)
        return 2
    for f in fields:
        unit = f" [{f.unit}]" if f.unit else ""
        print(f"{f.name}: {f.type} = {f.default!r}{unit}\n    {f.doc}")
    return 0


def _quiet_transformers() -> None:
    """No "Loading weights" bar for every model tether loads (tether's own progress bar stays)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # transformers missing: the import error will come from where it is used
        return
    hf_logging.disable_progress_bar()


def _said(e: BaseException) -> str:
    """An error as the command line prints it: the operating system's errors (``OSError`` with a
    file name) with the name cut to a bounded length (a 10 MB ``data.prompts`` is "File name too
    long", and its name is not printed whole); any other error, its message."""
    if isinstance(e, OSError) and e.filename is not None:
        from tether.core.text import shown

        names = [shown(str(f)) for f in (e.filename, e.filename2) if f is not None]
        return f"[Errno {e.errno}] {e.strerror}: {' -> '.join(names)}"
    return str(e)


def _parse_sweep(text: str) -> list[tuple[str, float]]:
    from tether.core.text import shown
    from tether.run.config import TRAINER_DEFAULTS, ConfigError

    on_policy = [name for name, spec in TRAINER_DEFAULTS.items() if spec.samples]  # a KL leash to sweep
    out = []
    for item in text.split(","):
        algo, _, beta = item.strip().partition(":")
        if algo not in on_policy:
            raise ConfigError(f"--sweep entry {shown(item)}: ALGO must be one of {', '.join(on_policy)}")
        try:
            out.append((algo, float(beta)))
        except ValueError:
            raise ConfigError(
                f"--sweep entry {shown(item)}: KL_COEF must be a number, e.g. ppo:0.05"
            ) from None
    return out


def _reward_fit(args) -> int:
    import json

    from tether.judges.reward_model import default_rm_dir, fit_reward_model

    out = args.out or default_rm_dir()
    report = fit_reward_model(out, min_gap=args.min_gap, seed=args.seed, max_sentences=args.max_sentences)
    rm, vd = report["reward_model"], report["vader"]
    print(json.dumps(report, indent=2))
    print(
        f"tether: held-out pairs (human ratings differ >= {args.min_gap}): "
        f"reward model accuracy {rm['pairwise_accuracy']:.3f}, VADER {vd['pairwise_accuracy']:.3f}; "
        f"Pearson r with human ratings: reward model {rm['pearson_with_human']:.3f}, "
        f"VADER {vd['pearson_with_human']:.3f}"
    )
    print(f"tether: saved to {out} (use it as reward.scorer=rm:{out} or eval.judge=rm:{out})")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
