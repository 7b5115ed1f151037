"""`populora study SPEC.yaml`: the paper's experiment as one command.

A study spec names arms (a config plus `--set` overrides each), seeds and steps. Every
(arm, seed) is one ordinary training run, `studies/<name>/runs/<arm>-s<seed>/`, trained by
`python -m driver train` in its own process (its own embedded Ray, its own memory), then
evaluated by `python -m evaluation.held_out` in another process: the held-out
benchmarks of `populora eval` (CodeI/O, HumanEval) and the in-distribution probe
(`evaluation.in_distribution`), greedy, the same problems for every run; the base model once,
under `studies/<name>/base/`. Finally `reports.study_report` writes `report/index.html` and
`report/summary.json` from every run's tables.

Spec (YAML; relative config paths are read from the current directory, as `populora train
--config` does):

    name: local                    # studies/<name>/ (default: the spec file's stem)
    config: configs/local.yaml     # every arm's config unless the arm names its own
    set: [learner.micro_batch=4]   # overrides for every arm
    steps: 15
    seeds: [0, 1, 2]
    arms:
      2T2S: {}
      4T4S: {set: [population.teachers=4, population.students=4]}
      baseline: {set: [population.mode=single], description: single agent (AZR)}
    baseline: baseline             # the arm every other is compared with (optional)
    control: no-learning           # the no-learning arm, compared likewise (optional)
    compare: [[2T2S, 4T4S]]        # more differences the report gives: arm minus reference
    output_dir: /somewhere         # where studies/<name>/ goes (default: beside the spec)
    eval: {benchmarks: [codeio, humaneval], limit: 20, probe_limit: 12, roles: [student, agent],
           max_new_tokens: null, base: true}

A bad spec (unknown key, unknown arm key, an arm whose config fails validation under its
overrides, a run trained under another config than the spec now gives) stops before any
run starts with one line naming the key; `populora study` then exits 2.

Run again, a study resumes: a run is finished when its `study_trained.json` marker (written
when `populora train` exits 0) records the spec's steps; a run with a checkpoint and no
such marker (killed, or the spec's steps raised) continues with `populora train --resume
<run> --set run.steps=<steps>`; a run without a checkpoint starts afresh. Evaluations are
finished when `study_eval/done.json` records the same evaluation settings; retraining a
run drops its evaluation.

One machine: `--parallel N` runs N runs at once, each with one torch thread
(`ray.torch_threads=1`, as `bench.learning` runs seeds side by side; on 2 cores two runs
side by side beat one run with two threads). Runs are scheduled seed by seed (seed 0 of
every arm first), so an interrupted study already covers every arm.

A cluster (an arm config with `ray.address`, e.g. configs/cluster-7b.yaml): each run is
still its own `populora train` process, a separate Ray driver that joins the cluster at
`ray.address`; by default they run one after another, each using the whole cluster (its
actors ask for the GPUs its config names). `--parallel N` runs N drivers at once; Ray then
queues their actors until the GPUs they ask for are free. The torch-thread override applies
only to embedded Ray. Evaluation generates in an InferenceServer actor on the cluster (`populora
eval --ray`). Start it where the runs should live (the head node), e.g. `ray job submit
--working-dir . -- populora study studies/cluster-7b.yaml`, with the spec's `output_dir`
outside the job's working-directory copy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from driver.config import Config
from evaluation.held_out import EVAL_DIR
from reports.study_spec import (ROOT, SMOKE_SPEC, TRAINED, RunSpec, Study, StudyError, check_study, evaluated,
                                 parse_spec, runs_of, status, steps_done)

# ---- the commands each run is made of ----------------------------------------------------
def _threads(cfg: Config, parallel: int) -> list[str]:
    return ["ray.torch_threads=1"] if parallel > 1 and not cfg.ray.address else []


def train_command(run: RunSpec, study: Study, cfg: Config, parallel: int) -> list[str]:
    sets = _threads(cfg, parallel)
    if status(run, study) == "resume":
        args = ["--resume", str(run.path), *_sets([f"run.steps={study.steps}", *sets])]
    else:
        args = ["--config", run.config, *_sets([*run.overrides, *sets])]
    return [sys.executable, "-m", "driver", "train", *args]


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def eval_command(path: Path, study: Study, cfg: Config, parallel: int, base_only: bool = False) -> list[str]:
    e = study.eval
    cmd = [sys.executable, "-m", "evaluation.held_out", str(path), "--benchmarks", ",".join(e.benchmarks),
           "--roles", ",".join(e.roles), "--settings", json.dumps(e.fingerprint())]
    if not e.probe:
        cmd.append("--no-probe")
    for flag, value in (("--limit", e.limit), ("--probe-limit", e.probe_limit),
                        ("--max-new-tokens", e.max_new_tokens)):
        if value is not None:
            cmd += [flag, str(value)]
    if cfg.ray.address:
        cmd += ["--ray", cfg.ray.address]
    elif parallel > 1:
        cmd += ["--threads", "1"]
    if base_only:
        cmd.append("--base-only")
    return cmd


def prepare_base(study: Study, cfg: Config) -> Path:
    """studies/<name>/base/: a run directory without adapters, for the base model's evaluation."""
    base = study.out / "base"
    (base / "adapters").mkdir(parents=True, exist_ok=True)
    data = cfg.to_dict()
    data["run"]["name"] = "base"
    new = yaml.safe_dump(data, sort_keys=False)
    if (base / "config.yaml").is_file() and (base / "config.yaml").read_text() != new:
        shutil.rmtree(base / EVAL_DIR, ignore_errors=True)  # another model or settings: evaluate again
    (base / "config.yaml").write_text(new)
    return base


# ---- the scheduler ---------------------------------------------------------------------
@dataclass
class Job:
    """One run's remaining stages ('train', 'evaluate'), or the base model's evaluation."""

    name: str
    stages: list[str]
    run: RunSpec | None = None
    path: Path | None = None
    proc: subprocess.Popen | None = None
    stage: str = ""
    started: float = 0.0
    log: Path | None = None
    failed: str = ""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for k, v in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_VERBOSITY", "error"), ("TOKENIZERS_PARALLELISM", "false")):
        env.setdefault(k, v)
    return env


class Scheduler:
    """Runs jobs' stages as subprocesses, at most `parallel` at once, and prints progress lines."""

    def __init__(self, study: Study, configs: dict[str, Config], parallel: int, heartbeat_s: float = 60.0,
                 arms: Sequence[str] | None = None) -> None:
        self.study, self.configs, self.parallel, self.heartbeat_s = study, configs, parallel, heartbeat_s
        self.arms = set(arms) if arms else None  # None: every arm
        self.jobs: list[Job] = []
        self.done: list[str] = []

    def plan(self) -> list[Job]:
        study = self.study
        first = self.configs[runs_of(study)[0].name]
        if study.eval.base and (study.eval.benchmarks or study.eval.probe):
            base = prepare_base(study, first)
            if evaluated(base, study):
                self.done.append("base")
            else:
                self.jobs.append(Job("base", ["evaluate"], path=base))
        for run in runs_of(study):
            if self.arms is not None and run.arm not in self.arms:
                continue
            state = status(run, study)
            if state == "done":
                self.done.append(run.name)
                continue
            self.jobs.append(Job(run.name, ["train", "evaluate"] if state in ("new", "resume") else ["evaluate"],
                                 run=run, path=run.path))
        return self.jobs

    def _start(self, job: Job) -> None:
        study, stage = self.study, job.stages.pop(0)
        job.stage, job.started = stage, time.monotonic()
        if job.run is None:
            cfg = self.configs[runs_of(study)[0].name]
            cmd = eval_command(job.path, study, cfg, self.parallel, base_only=True)
        else:
            cfg = self.configs[job.run.name]
            if stage == "train":
                resume = status(job.run, study) == "resume"
                cmd = train_command(job.run, study, cfg, self.parallel)
                if not resume:
                    shutil.rmtree(job.path, ignore_errors=True)  # no checkpoint: nothing to keep
                shutil.rmtree(job.path / EVAL_DIR, ignore_errors=True)  # its adapters change
                (job.path / TRAINED).unlink(missing_ok=True)
                self._line(f"{job.name}: {'resume from step ' + str(steps_done(job.path)) if resume else 'start'}"
                           f" (train {study.steps} steps)")
            else:
                cmd = eval_command(job.path, study, cfg, self.parallel)
        # beside the run, not inside it: `populora train` starts a fresh run by deleting its directory
        job.log = study.out / "logs" / f"{job.name}-{stage}.log"
        job.log.parent.mkdir(parents=True, exist_ok=True)
        with open(job.log, "a") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            job.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                        start_new_session=True)

    def _finish(self, job: Job) -> None:
        rc = job.proc.returncode
        seconds = time.monotonic() - job.started
        job.proc = None
        if rc != 0:
            job.failed = f"{job.stage} exited {rc} (log: {job.log})"
            self._line(f"{job.name}: FAILED, {job.failed}")
            return
        if job.stage == "train":  # the machine too: a study resumed elsewhere mixes machines
            from multilora.machine import machine

            (job.path / TRAINED).write_text(json.dumps({"steps": self.study.steps, "seconds": round(seconds, 1),
                                                        "machine": machine()}))
        self._line(f"{job.name}: {job.stage} finished in {seconds:.0f} s")
        if not job.stages:
            self.done.append(job.name)

    def _line(self, text: str) -> None:
        print(f"[study {self.study.name} {time.strftime('%H:%M:%S')}] {text}", flush=True)

    def progress(self) -> str:
        running = [j for j in self.jobs if j.proc is not None]
        waiting = [j for j in self.jobs if j.proc is None and j.stages and not j.failed]
        failed = [j.name for j in self.jobs if j.failed]
        total = len(self.done) + len([j for j in self.jobs if j.name not in self.done])

        def what(j: Job) -> str:
            if j.stage == "train":
                return f"{j.name} train {steps_done(j.path)}/{self.study.steps}"
            return f"{j.name} {j.stage}"

        return (f"done {len(self.done)}/{total} | running {', '.join(what(j) for j in running) or '-'} | "
                f"waiting {len(waiting)}" + (f" | failed {', '.join(failed)}" if failed else ""))

    def run(self) -> list[Job]:
        """Runs every planned job; returns the ones that failed."""
        last = 0.0
        try:
            while True:
                changed = False
                for job in self.jobs:
                    if job.proc is not None and job.proc.poll() is not None:
                        self._finish(job)
                        changed = True
                running = sum(j.proc is not None for j in self.jobs)
                for job in self.jobs:
                    if running >= self.parallel:
                        break
                    if job.proc is None and job.stages and not job.failed:
                        self._start(job)
                        running += 1
                        changed = True
                if changed or time.monotonic() - last >= self.heartbeat_s:
                    self._line(self.progress())
                    last = time.monotonic()
                if not running:
                    break
                time.sleep(1.0)
        except KeyboardInterrupt:
            self._line("interrupted: stopping the runs (run the study again to resume)")
            self.stop()
            raise
        return [j for j in self.jobs if j.failed]

    def stop(self) -> None:
        """SIGINT to every running stage (it shuts its Ray down), then SIGKILL to what is left."""
        live = [j for j in self.jobs if j.proc is not None and j.proc.poll() is None]
        for job in live:
            os.killpg(job.proc.pid, signal.SIGINT)
        deadline = time.monotonic() + 30
        for job in live:
            try:
                job.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(job.proc.pid, signal.SIGKILL)


# ---- the command -------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", nargs="?", default=None, help="study spec, e.g. studies/local.yaml")
    parser.add_argument("--parallel", type=int, default=None, metavar="N",
                        help="runs at once (default: the spec's parallel, else 1); N > 1 gives each one torch thread")
    parser.add_argument("--smoke", action="store_true",
                        help=f"the smoke study ({SMOKE_SPEC.relative_to(ROOT)}: tiny model, 2 arms, 1 seed, 2 steps)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="the study directory (default: <spec's output_dir or directory>/<name>)")
    parser.add_argument("--dry-run", action="store_true", help="check the spec, print each run's state, run nothing")
    parser.add_argument("--report-only", action="store_true", help="write the report from the runs already there")
    parser.add_argument("--arms", default=None, metavar="A,B",
                        help="train and evaluate only these arms' runs this time (the others wait for a later run "
                             "of the study; the report covers every finished run)")


def main(args: argparse.Namespace) -> int:
    spec = args.spec or (SMOKE_SPEC if args.smoke else None)
    if spec is None:
        print("populora study: SPEC: a study spec is required (or --smoke)", file=sys.stderr)
        return 2
    if args.parallel is not None and args.parallel < 1:
        print(f"populora study: --parallel: must be >= 1, got {args.parallel}", file=sys.stderr)
        return 2
    try:
        study = parse_spec(spec, args.out)
        configs = check_study(study)
    except StudyError as e:
        print(f"populora study: {e}", file=sys.stderr)
        return 2
    names = [a.name for a in study.arms]
    arms = [a for a in (args.arms or "").split(",") if a] or None
    for arm in arms or ():
        if arm not in names:
            print(f"populora study: --arms: {arm!r} is not an arm (arms: {', '.join(names)})", file=sys.stderr)
            return 2
    runs = [r for r in runs_of(study) if arms is None or r.arm in arms]
    print(f"study {study.name}: {len(study.arms)} arms x {len(study.seeds)} seeds, {study.steps} steps each, "
          f"{args.parallel or study.parallel} at a time, in {study.out}", flush=True)
    if args.dry_run:
        for run in runs:
            print(f"  {run.name}: {status(run, study)}")
        return 0
    failed = []
    if not args.report_only:
        study.out.mkdir(parents=True, exist_ok=True)
        (study.out / "spec.yaml").write_text(Path(spec).read_text())
        scheduler = Scheduler(study, configs, args.parallel or study.parallel, arms=arms)
        scheduler.plan()
        try:
            failed = scheduler.run()
        except KeyboardInterrupt:
            return 130
    from reports.study_report import write_study_report

    path = write_study_report(study)
    print(f"report written to {path}")
    if failed:
        print(f"populora study: {len(failed)} stage(s) failed: {', '.join(j.name for j in failed)} "
              "(run the study again to retry them)", file=sys.stderr)
        return 1
    return 0
