"""A study's spec and the discovery of its runs: what `populora study` reads and what
the study report reads back (which runs exist, which finished training and evaluation).

The spec's format, and what running a study does, are in `reports/study.py`.
"""


from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from driver.config import Config, ConfigError, load_config, read_yaml_mapping
from driver.run_dir import read_table
from evaluation.held_out import DONE as EVAL_DONE
from evaluation.held_out import EVAL_DIR

ROOT = Path(__file__).resolve().parents[1]
SMOKE_SPEC = ROOT / "studies" / "smoke.yaml"
TRAINED = "study_trained.json"  # in a run directory: training reached the recorded steps
SPEC_KEYS = ("name", "description", "config", "set", "steps", "seeds", "arms", "baseline", "control", "compare",
             "eval", "output_dir", "parallel")
ARM_KEYS = ("config", "set", "description")
EVAL_KEYS = ("benchmarks", "limit", "probe", "probe_limit", "roles", "max_new_tokens", "base")
ROLES = ("teacher", "student", "agent")
# set per run by the study; the spec may not override them
OWNED = ("run.seed", "run.steps", "run.name", "run.output_dir")
# differences between a run's config.yaml and the spec's that do not change what was trained
IGNORED = ("run.steps", "run.output_dir", "run.overwrite", "ray.torch_threads")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class StudyError(ValueError):
    """A bad study spec: one line naming the key."""


@dataclass(frozen=True)
class Arm:
    name: str
    config: str
    overrides: tuple[str, ...]
    description: str = ""


@dataclass(frozen=True)
class EvalSpec:
    benchmarks: tuple[str, ...] = ("codeio", "humaneval")
    limit: int | None = 20  # at most this many problems per benchmark
    probe: bool = True  # the in-distribution probe (evaluation.in_distribution)
    probe_limit: int | None = None  # at most this many probe programs (each one task per type)
    roles: tuple[str, ...] = ("student", "agent")  # members evaluated (teachers are not asked to solve)
    max_new_tokens: int | None = None  # None: each benchmark's own budget
    base: bool = True

    def fingerprint(self) -> dict:
        """The settings as JSON gives them back (lists, not tuples): what done.json records."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


@dataclass(frozen=True)
class Study:
    name: str
    spec: Path
    out: Path
    steps: int
    seeds: tuple[int, ...]
    arms: tuple[Arm, ...]
    baseline: str | None = None
    control: str | None = None
    # more differences the report gives: (arm, reference) pairs, arm minus reference
    compare: tuple[tuple[str, str], ...] = ()
    eval: EvalSpec = field(default_factory=EvalSpec)
    description: str = ""
    parallel: int = 1  # runs at once unless --parallel says otherwise

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms if a.name == name)


@dataclass(frozen=True)
class RunSpec:
    """One (arm, seed): its run directory and the overrides that make its config."""

    arm: str
    seed: int
    name: str
    path: Path
    config: str
    overrides: tuple[str, ...]


# ---- the spec --------------------------------------------------------------------------
def _overrides(value: Any, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and "=" in v for v in value):
        raise StudyError(f"{key}: expected a list of key=value overrides, got {value!r}")
    for v in value:
        if v.split("=", 1)[0].strip() in OWNED:
            raise StudyError(f"{key}: {v.split('=', 1)[0].strip()} is set by the study (use steps:, seeds:)")
    return tuple(value)


def _unknown(data: dict, known: tuple[str, ...], prefix: str) -> None:
    for k in data:
        if k not in known:
            raise StudyError(f"{prefix}{k}: unknown key (known: {', '.join(known)})")


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise StudyError(f"{key}: expected a positive integer, got {value!r}")
    return value


def _eval_spec(data: Any) -> EvalSpec:
    if data is None:
        return EvalSpec()
    if not isinstance(data, dict):
        raise StudyError(f"eval: expected a mapping, got {data!r}")
    _unknown(data, EVAL_KEYS, "eval.")
    spec = EvalSpec()
    benchmarks = data.get("benchmarks", list(spec.benchmarks))
    if not isinstance(benchmarks, list) or not all(isinstance(b, str) for b in benchmarks):
        raise StudyError(f"eval.benchmarks: expected a list of benchmark names, got {benchmarks!r}")
    if benchmarks:
        from evaluation.runner import resolve_benchmarks

        try:
            benchmarks = list(resolve_benchmarks(",".join(benchmarks)))
        except ValueError as e:
            raise StudyError(f"eval.benchmarks: {e}") from None
    roles = data.get("roles", list(spec.roles))
    if not isinstance(roles, list) or not roles or any(r not in ROLES for r in roles):
        raise StudyError(f"eval.roles: expected a non-empty list of {', '.join(ROLES)}, got {roles!r}")
    limits = {}
    for key in ("limit", "probe_limit", "max_new_tokens"):
        value = data.get(key, getattr(spec, key))
        limits[key] = None if value is None else _positive_int(value, f"eval.{key}")
    flags = {}
    for key in ("probe", "base"):
        flags[key] = data.get(key, getattr(spec, key))
        if not isinstance(flags[key], bool):
            raise StudyError(f"eval.{key}: expected true or false, got {flags[key]!r}")
    return EvalSpec(tuple(benchmarks), limits["limit"], flags["probe"], limits["probe_limit"], tuple(roles),
                    limits["max_new_tokens"], flags["base"])


def parse_spec(path: str | Path, out: str | Path | None = None) -> Study:
    """Read and check a study spec (not the arms' configs: see `check_study`)."""
    path = Path(path)
    data = read_yaml_mapping(path, "SPEC", StudyError)
    if data is None:  # an empty file
        raise StudyError(f"SPEC: {path} must hold a mapping at the top level")
    _unknown(data, SPEC_KEYS, "")
    name = data.get("name", path.stem)
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise StudyError(f"name: expected a name of letters, digits, '.', '_' or '-', got {name!r}")
    if "steps" not in data:
        raise StudyError("steps: missing (training steps of every run)")
    steps = _positive_int(data["steps"], "steps")
    seeds = data.get("seeds", [0])
    if (not isinstance(seeds, list) or not seeds or any(isinstance(s, bool) or not isinstance(s, int) for s in seeds)
            or len(set(seeds)) != len(seeds)):
        raise StudyError(f"seeds: expected a non-empty list of distinct integers, got {seeds!r}")
    default_config = data.get("config")
    if default_config is not None and not isinstance(default_config, str):
        raise StudyError(f"config: expected a path, got {default_config!r}")
    common = _overrides(data.get("set"), "set")
    arms_data = data.get("arms")
    if not isinstance(arms_data, dict) or not arms_data:
        raise StudyError("arms: expected a mapping of arm name -> {config, set, description}")
    arms = []
    for arm_name, arm in arms_data.items():
        key = f"arms.{arm_name}"
        if not isinstance(arm_name, str) or not _NAME.fullmatch(arm_name):
            raise StudyError(f"{key}: an arm name is letters, digits, '.', '_' or '-'")
        arm = {} if arm is None else arm
        if not isinstance(arm, dict):
            raise StudyError(f"{key}: expected a mapping with {', '.join(ARM_KEYS)}, got {arm!r}")
        _unknown(arm, ARM_KEYS, f"{key}.")
        config = arm.get("config", default_config)
        if not isinstance(config, str):
            raise StudyError(f"{key}.config: missing (no top-level config: either)")
        description = arm.get("description", "")
        if not isinstance(description, str):
            raise StudyError(f"{key}.description: expected text, got {description!r}")
        arms.append(Arm(arm_name, config, common + _overrides(arm.get("set"), f"{key}.set"), description))
    names = [a.name for a in arms]
    refs = {}
    for key in ("baseline", "control"):
        value = data.get(key)
        if value is not None and value not in names:
            raise StudyError(f"{key}: {value!r} is not an arm (arms: {', '.join(names)})")
        refs[key] = value
    compare = _compare(data.get("compare", []), names)
    root = Path(data["output_dir"]).expanduser() if data.get("output_dir") else path.resolve().parent
    return Study(name=name, spec=path, out=Path(out) if out else root / name, steps=steps, seeds=tuple(seeds),
                 arms=tuple(arms), baseline=refs["baseline"], control=refs["control"], compare=compare,
                 eval=_eval_spec(data.get("eval")), description=str(data.get("description", "")),
                 parallel=_positive_int(data.get("parallel", 1), "parallel"))


def _compare(value: Any, names: list[str]) -> tuple[tuple[str, str], ...]:
    """`compare:`: a list of [arm, reference] pairs of two different arms."""
    if not isinstance(value, list):
        raise StudyError(f"compare: expected a list of [arm, reference] pairs, got {value!r}")
    pairs = []
    for i, pair in enumerate(value):
        if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(x, str) for x in pair):
            raise StudyError(f"compare[{i}]: expected [arm, reference], got {pair!r}")
        for x in pair:
            if x not in names:
                raise StudyError(f"compare[{i}]: {x!r} is not an arm (arms: {', '.join(names)})")
        if pair[0] == pair[1]:
            raise StudyError(f"compare[{i}]: an arm compared with itself ({pair[0]!r})")
        pairs.append((pair[0], pair[1]))
    return tuple(pairs)


def runs_of(study: Study) -> list[RunSpec]:
    """Every (arm, seed), seed by seed: seed 0 of every arm comes first."""
    runs = []
    for seed in study.seeds:
        for arm in study.arms:
            name = f"{arm.name}-s{seed}"
            runs.append(RunSpec(arm.name, seed, name, study.out / "runs" / name, arm.config, (
                *arm.overrides, f"run.seed={seed}", f"run.steps={study.steps}", f"run.name={name}",
                f"run.output_dir={study.out / 'runs'}")))
    return runs


def _flat(data: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in data.items():
        if isinstance(v, dict) and k != "operators":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_study(study: Study) -> dict[str, Config]:
    """Every run's config under its overrides, validated; a run already on disk must have
    been trained under the config the spec gives now. Raises StudyError."""
    configs: dict[str, Config] = {}
    for run in runs_of(study):
        try:
            cfg = load_config(run.config, list(run.overrides))
        except ConfigError as e:
            raise StudyError(f"arms.{run.arm}: {e}") from None
        configs[run.name] = cfg
        on_disk = run.path / "config.yaml"
        if on_disk.is_file():
            old, new = _flat(yaml.safe_load(on_disk.read_text()) or {}), _flat(cfg.to_dict())
            changed = [k for k in sorted(set(old) | set(new)) if k not in IGNORED and old.get(k) != new.get(k)]
            if changed:
                k = changed[0]
                raise StudyError(f"arms.{run.arm}: {run.path} was trained with {k}={old.get(k)!r}, the spec now "
                                 f"gives {new.get(k)!r}; delete that run directory to retrain it")
        step = checkpoint_step(run.path)
        if step is not None and step > study.steps:
            raise StudyError(f"steps: {run.path} has trained {step} steps, more than the spec's {study.steps}; "
                             "raise steps or delete that run directory")
    models = {cfg.model.path for cfg in configs.values()}
    if len(models) > 1:
        raise StudyError(f"arms: every arm must use one model.path (the base model is evaluated once), got "
                         f"{', '.join(sorted(models))}")
    return configs


# ---- the state of a run ----------------------------------------------------------------
def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def trained(run: Path, steps: int) -> bool:
    marker = _read_json(run / TRAINED)
    return bool(marker) and marker.get("steps") == steps


def checkpoint_step(run: Path) -> int | None:
    """The step of the run's newest checkpoint with a manifest (`driver.checkpoint.candidates`,
    the kept ones and a swap cut short included), None without one."""
    from driver.checkpoint import MANIFEST, candidates

    for d in candidates(run):
        manifest = _read_json(d / MANIFEST)
        if manifest and isinstance(manifest.get("step"), int):
            return manifest["step"]
    return None


def has_checkpoint(run: Path) -> bool:
    return checkpoint_step(run) is not None


def evaluated(run: Path, study: Study) -> bool:
    marker = _read_json(run / EVAL_DIR / EVAL_DONE)
    return bool(marker) and marker.get("settings") == study.eval.fingerprint()


def steps_done(run: Path) -> int:
    """The last step in metrics.parquet (0 when there is none yet)."""
    try:
        table = read_table(run, "metrics", columns=["step"])
        return int(max(table.column("step").to_pylist(), default=0))
    except Exception:  # noqa: BLE001 - a table being swapped in or not yet written: no progress to show
        return 0


def status(run: RunSpec, study: Study) -> str:
    """'done', 'evaluate' (trained, not evaluated), 'resume' (a checkpoint, not finished) or 'new'."""
    if trained(run.path, study.steps):
        nothing_to_evaluate = not study.eval.benchmarks and not study.eval.probe
        return "done" if nothing_to_evaluate or evaluated(run.path, study) else "evaluate"
    return "resume" if has_checkpoint(run.path) and (run.path / "config.yaml").is_file() else "new"
