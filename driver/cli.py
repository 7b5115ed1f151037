"""`populora` / `python -m driver`: the command line of the job."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from driver.config import Config, ConfigError, config_sources, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="populora", description="PopuLoRA on Ray: population self-play RL.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a population (or the single-agent baseline)")
    train.add_argument("--config", default="configs/local.yaml", help="YAML config (default: %(default)s)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="dotted override, e.g. --set population.teachers=4 (repeatable)")
    train.add_argument("--resume", default=None, metavar="RUN_DIR",
                       help="continue runs/<name> from its checkpoint (its config.yaml replaces --config)")
    train.add_argument("--log-level", default="INFO")
    check = sub.add_parser("check-config", help="validate a config and print it")
    check.add_argument("--config", default="configs/local.yaml")
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    check.add_argument("--explain", action="store_true",
                       help="print every key, its value and where it came from (default, file, --set)")
    prepare = sub.add_parser("prepare-model", help="convert the embedded GGUF model(s) to safetensors once")
    prepare.add_argument("names", nargs="*")
    report = sub.add_parser("report", help="write the plots and HTML report of a run into runs/<name>/report/")
    report.add_argument("run", help="run directory, e.g. runs/local")
    report.add_argument("--compare", default=None, help="a second run directory to overlay (e.g. the baseline)")
    from evaluation.command import add_arguments as add_eval_arguments

    add_eval_arguments(sub.add_parser("eval", help="score every member, the base and a baseline run on benchmarks"))
    from reports.study import add_arguments as add_study_arguments

    add_study_arguments(sub.add_parser("study", help="train, evaluate and compare the arms of a study spec "
                                                     "(several seeds each) and write one report"))
    return parser


def _explain(cfg: Config, sources: dict[str, str], path: str) -> str:
    """One line per key: its dotted name, its value as `--set` takes it, and its source."""
    from functools import reduce

    import yaml

    values = {key: yaml.safe_dump([reduce(getattr, key.split("."), cfg)], default_flow_style=True,
                                  width=10**9).strip()[1:-1] for key in sources}
    key_w, value_w = max(map(len, values)), min(40, max(map(len, values.values())))
    lines = [f"# every key: its value and where it came from (default, file {path}, --set)",
             f"{'key':<{key_w}}  {'value':<{value_w}}  source"]
    lines += [f"{k:<{key_w}}  {v:<{value_w}}  {sources[k]}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def _report(args: argparse.Namespace) -> int:
    for path in filter(None, (args.run, args.compare)):
        if not Path(path).is_dir():
            print(f"populora: report: no run directory at {path}", file=sys.stderr)
            return 2
        from driver.run_dir import table_path

        if not table_path(Path(path), "metrics").exists():
            print(f"populora: report: {table_path(Path(path), 'metrics')} not found (not a run directory?)",
                  file=sys.stderr)
            return 2
    from reports.run_report import write_report

    print(write_report(Path(args.run), Path(args.compare) if args.compare else None))
    return 0


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    """The command; SIGINT and SIGTERM stop it as Ctrl-C does (a run stops its actors and
    its Ray, a study its runs), also where a shell started it in the background with SIGINT
    ignored (`nohup populora study ... &`) or `ray job stop` sends SIGTERM."""
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _main(argv)
    except KeyboardInterrupt as e:
        print(f"populora: stopped ({e or 'interrupted'})", file=sys.stderr)
        return 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "prepare-model":
        from multilora.embedded import EMBEDDED_MODELS, prepare

        for name in args.names or EMBEDDED_MODELS:
            print(prepare(name))
        return 0
    if args.command == "report":
        return _report(args)
    if args.command == "eval":
        from evaluation.command import main as evaluate

        return evaluate(args)
    if args.command == "study":
        from reports.study import main as study

        return study(args)
    resume = getattr(args, "resume", None)
    if resume and not (Path(resume) / "config.yaml").is_file():
        print(f"populora: --resume: {Path(resume) / 'config.yaml'} not found (not a run directory?)", file=sys.stderr)
        return 2
    try:
        cfg = load_config(Path(resume) / "config.yaml" if resume else args.config, args.overrides)
    except ConfigError as e:
        print(f"populora: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "check-config":
        import yaml

        if args.explain:
            print(_explain(cfg, config_sources(args.config, args.overrides), args.config), end="")
        else:
            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    from driver.logs import configure

    configure(args.log_level)
    from driver.checkpoint import CheckpointError, load_latest

    if resume:  # before Ray starts: a run whose checkpoints cannot be loaded (or are refused) stops here
        try:
            load_latest(Path(resume), quiet=True)
        except CheckpointError as e:
            print(f"populora: checkpoint error: {e}", file=sys.stderr)
            return 2
    from driver.loop import train

    try:
        path = train(cfg, Path(resume) if resume else None)
    except CheckpointError as e:
        print(f"populora: checkpoint error: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:  # found where the actors run (the model directory on their node)
        print(f"populora: config error: {e}", file=sys.stderr)
        return 2
    print(f"run written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
