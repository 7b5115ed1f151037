"""The training job: one function per step, five phases, read top to bottom.

    1. Match    PopulationManager pairs each teacher with a student (TrueSkill + PFSP).
    2. Propose  teachers write code_i / code_o / code_f tasks; the verifier keeps the valid ones.
    3. Solve    each matched student answers every valid task `n` times; the verifier scores.
    4. Update   rewards -> group-normalised advantages -> one policy-gradient step for
                every adapter; new adapters go learner -> object store -> inference server.
    5. Evolve   every K steps the weakest teacher and student are replaced by children.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray
import torch
from ray.exceptions import RayActorError, RayTaskError
from tqdm import tqdm

from driver import checkpoint, collapse, novelty, recovery
from driver.buffer import TaskBuffer
from driver.config import Config
from driver.extraction import extract_answer, parse_proposal
from driver.learning_signal import LowSignalWatch, SignalReport, signal_report
from driver.logs import set_position
from driver.prompts import answer_prefix, reply_format, student_prompt, teacher_prompt
from driver.records import PHASES, SEED_TEACHER, Proposal, Rollout, Task, TrainingRow
from driver.rewards import group_advantages, student_reward, teacher_reward
from driver.run_dir import RunDir
from driver.seeds import SEED_PROGRAMS
from driver.fleet import merge_stats
from driver.session import Actors, create_actors, member_names, start_ray, stop_actors
from driver.telemetry import Telemetry
from driver.trackers import Trackers
from evolution.population import Replacement
from multilora.generation import SamplingParams
from multilora.peft_io import save_adapter
from multilora.trainer import TrainSample
from verifier_sandbox import ast_hash, complexity
from verifier_sandbox.protocol import Request

log = logging.getLogger(__name__)



@dataclass
class StepContext:
    cfg: Config
    actors: Actors
    buffer: TaskBuffer
    rng: np.random.Generator
    run: RunDir
    bar: tqdm
    telemetry: Telemetry = field(default_factory=Telemetry)
    trackers: Trackers = field(default_factory=Trackers)  # logging.tensorboard / logging.wandb
    seconds: dict[str, float] = field(default_factory=dict)
    last: str = "valid=- informative=- distinct=- copies=- solve=- t_reward=- signal=-"  # the previous step's figures, shown beside the phase
    low_signal: LowSignalWatch = field(default_factory=LowSignalWatch)
    collapse_watch: collapse.CollapseWatch = field(default_factory=collapse.CollapseWatch)
    # structures of the recent valid code_i / code_o tasks: what a repeat repeats (tasks.repeat_window)
    repeats: collapse.RepeatRegistry = field(default_factory=lambda: collapse.RepeatRegistry(4))
    summaries: list[dict] = field(default_factory=list)  # record_step's summary of every step this process ran
    coverage: set[str] = field(default_factory=set)  # ast_hash of every novel valid program the teachers wrote
    version: int = 0  # updates the learner has applied: the version of the adapters the server holds

    @contextmanager
    def phase(self, name: str, seconds: dict[str, float] | None = None) -> Iterator[None]:
        """Time the phase into `seconds` (default: this step's `self.seconds`)."""
        self.bar.set_postfix_str(f"phase={name} {self.last}", refresh=True)
        set_position(phase=name)
        start = time.perf_counter()
        try:
            yield
        finally:
            (self.seconds if seconds is None else seconds)[name] = time.perf_counter() - start


# ---- the step --------------------------------------------------------------------------
@dataclass
class Experience:
    """Phases 1-3 of one step: its matches, proposals, valid tasks and rollouts, scored, not
    yet trained on. `version`: the learner version (updates applied) of the adapters that
    sampled them. `seconds`: the time of its match, propose and solve phases."""

    step: int
    version: int
    matches: dict[str, str]
    proposals: list[Proposal]
    tasks: list[Task]
    rollouts: list[Rollout]
    rates: list[float]  # rho(t, s, p) of each valid task, in `tasks` order
    teacher_rewards: list[float]  # with each repeat's cost (driver.collapse)
    seconds: dict[str, float]
    work: list[collapse.WorkFlags] = field(default_factory=list)  # per proposal: structure, size, trivial, repeat

    @property
    def proposal_rates(self) -> list[float | None]:
        """Each proposal's solve rate, in `proposals` order (None: no valid task)."""
        return proposal_rates(self.proposals, self.rates)


def train_step(step: int, ctx: StepContext, pending: Experience | None = None) -> tuple[dict[str, float],
                                                                                     Experience | None]:
    """One step: collect its experience (match, propose, solve) unless `pending` holds it
    already, update, evolve. With `pipeline.max_staleness` >= 1 the next step's collection
    runs while the learner trains on this one's (`overlap`), and is returned for the next
    call; otherwise the second value is None."""
    cfg, actors = ctx.cfg, ctx.actors
    ctx.seconds = {}
    set_position(step=step)
    start = time.perf_counter()
    exp = pending if pending is not None else collect(ctx, step)
    ctx.seconds.update(exp.seconds)
    overlap = cfg.pipeline.max_staleness >= 1 and step < cfg.run.steps
    with ctx.phase("update"):
        update_ref, signal, dropped = submit_update(ctx, exp)
        following = collect(ctx, step + 1) if overlap else None  # samples from the adapters before this update
        stats = merge_stats(ray.get(update_ref))
        ctx.version += 1
        actors.sync(ctx.version)
    learner_seconds = max((s.get("seconds", 0.0) for s in stats.values()), default=0.0)
    if following is not None:  # the learner's own time, not the wait that included the generation
        ctx.seconds["update"] = learner_seconds
        ctx.seconds["overlap"] = min(learner_seconds, sum(following.seconds.values()))

    with ctx.phase("evolve"):
        events = evolve(ctx, step) if cfg.population.evolve_every and step % cfg.population.evolve_every == 0 else []
    wall = time.perf_counter() - start
    summary = record_step(ctx, step, exp, stats, signal, events, dropped, wall if overlap else None)
    return summary, following


def collect(ctx: StepContext, step: int) -> Experience:
    """Match, propose, solve for `step`; its games are recorded (ratings) and its valid tasks
    enter the buffer before the next step's matches and proposals are made."""
    actors, seconds = ctx.actors, {}
    with ctx.phase("match", seconds):
        matches: dict[str, str] = actors.population.match()

    with ctx.phase("propose", seconds):
        proposals = propose(ctx, list(matches), step)
    tasks = [p.task for p in proposals if p.task is not None]

    with ctx.phase("solve", seconds):
        rollouts = solve(ctx, tasks, [matches[t.teacher] for t in tasks])
    rates = task_solve_rates(tasks, rollouts)
    by_proposal = proposal_rates(proposals, rates)
    base_rewards = [teacher_reward(p.valid, rate) for p, rate in zip(proposals, by_proposal)]
    structures = [collapse.structure(p.program) for p in proposals]
    repeats = ctx.repeats.repeats(step, proposals, structures)
    teacher_rewards = ctx.repeats.penalised(base_rewards, structures, repeats, ctx.cfg.tasks.repeat_penalty)
    ctx.repeats.record(step, proposals, structures, base_rewards)
    # one game per proposal; an invalid one (solve rate None) is a forfeit its teacher loses
    actors.population.record(
        [(p.teacher, matches[p.teacher], rate) for p, rate in zip(proposals, by_proposal)])
    for t in tasks:
        ctx.buffer.add(t)
    return Experience(step=step, version=ctx.version, matches=matches, proposals=proposals, tasks=tasks,
                     rollouts=rollouts, rates=rates, teacher_rewards=teacher_rewards, seconds=seconds,
                     work=collapse.flags(proposals, structures, repeats))


# ---- phases ----------------------------------------------------------------------------
def sampling(cfg: Config, role: str, task_type: str, greedy: bool = False) -> tuple[SamplingParams, str]:
    """The sampling settings of one request and the reply prefix that ends its prompt;
    `greedy` for the deterministic probes. With `tasks.constrained_format` the generator
    supplies the reply format (its opening is the prefix)."""
    t = cfg.tasks
    fmt = reply_format(role, task_type, t.induction_inputs, t.reasoning) if t.constrained_format else None
    params = SamplingParams(temperature=0.0 if greedy else t.temperature, top_p=t.top_p, stop=("</answer>",),
                            max_new_tokens=t.propose_max_new_tokens if role == "teacher" else t.solve_max_new_tokens,
                            n=1 if greedy or role == "teacher" else t.rollouts, reply_format=fmt)
    prefix = fmt.opening if fmt is not None else (answer_prefix(role, task_type, t.reasoning) if t.answer_prefix
                                                  else "")
    return params, prefix


def proposal_jobs(ctx: StepContext, teachers: list[str], rng: np.random.Generator) -> list[tuple]:
    """(teacher, task type, reference tasks): `proposals_per_type` of each type per teacher."""
    t = ctx.cfg.tasks
    # code_f: the program comes from a valid code_i / code_o proposal or a seed, as in AZR
    return [(teacher, task_type, ctx.buffer.sample_induction(1, rng) if task_type == "code_f"
             else ctx.buffer.sample(task_type, t.references, rng))
            for teacher in teachers for task_type in t.types for _ in range(t.proposals_per_type)]


def propose(ctx: StepContext, teachers: list[str], step: int) -> list[Proposal]:
    """Every teacher writes `proposals_per_type` tasks of each type; the verifier validates."""
    return propose_jobs(ctx, proposal_jobs(ctx, teachers, ctx.rng), step)


def propose_jobs(ctx: StepContext, jobs: list[tuple], step: int, greedy: bool = False) -> list[Proposal]:
    """One batched generation for all jobs (teachers mixed), parsing, then validation."""
    t = ctx.cfg.tasks
    params, prefixes = zip(*[sampling(ctx.cfg, "teacher", tt, greedy) for _, tt, _ in jobs]) if jobs else ((), ())
    prompts = [teacher_prompt(tt, refs, t.induction_inputs, t.reasoning, t.constrained_format) for _, tt, refs in jobs]
    outputs = ctx.actors.generate([j[0] for j in jobs], prompts, list(params), list(prefixes))
    parsed = [parse_proposal(tt, pre + out.completions[0].text, t.induction_inputs, t.require_answer_close,
                             t.reasoning) for (_, tt, _), pre, out in zip(jobs, prefixes, outputs)]
    copies = [novelty.copy_of(tt, p.program, refs) if p.error is None else None
              for (_, tt, refs), p in zip(jobs, parsed)]
    requests, asked = [], []
    for i, ((_, task_type, refs), p) in enumerate(zip(jobs, parsed)):
        if p.error is not None or (t.reject_copies and copies[i] is not None):  # a copy is not a new task
            continue
        rules = {"reject_trivial": t.reject_trivial, "strip_dead_code": t.strip_dead_code}
        if task_type == "code_f":  # the program is the reference's; the teacher chose inputs
            requests.append(Request("code_f", refs[0].program, inputs=tuple(p.inputs), **rules))
        else:
            requests.append(Request(task_type, p.program, input=p.input, **rules))
        asked.append(i)
    verdicts = dict(zip(asked, ctx.actors.verifier.validate(requests))) if requests else {}
    proposals = []
    for i, ((teacher, task_type, refs), p, pre, out) in enumerate(zip(jobs, parsed, prefixes, outputs)):
        v = verdicts.get(i)
        rejected = t.reject_copies and copies[i] is not None
        valid = bool(v and v.get("valid")) and not rejected
        program = refs[0].program if task_type == "code_f" else p.program
        program = (v or {}).get("program") or program  # what `f` executes, dead code stripped
        task = None
        if valid:
            if task_type == "code_f":
                task = Task(task_type, program, inputs=tuple(p.inputs), outputs=tuple(v["outputs"]),
                            message=p.message, shown=t.induction_shown, teacher=teacher, step=step)
            else:
                task = Task(task_type, program, input=p.input, output=v["output"], teacher=teacher, step=step)
        reason = (p.error if p.error is not None else f"copy of {copies[i]}" if rejected
                  else None if valid else (v or {}).get("reason", "invalid"))
        c = out.completions[0]
        source = ("seed" if refs[0].teacher == SEED_TEACHER else "proposal") if task_type == "code_f" else "proposal"
        proposals.append(Proposal(
            teacher=teacher, task_type=task_type, prompt_ids=out.prompt_ids, completion_ids=c.token_ids,
            text=pre + c.text, program=program, input=p.input, inputs=tuple(p.inputs), message=p.message,
            valid=valid, reason=reason, task=task, source=source, supplied=c.supplied, copy_of=copies[i],
            exact_copy=novelty.exact_copy(task_type, p.program, refs) if p.error is None else False,
            logprobs=c.logprobs, trivial=(v or {}).get("trivial")))
    return proposals


def solve(ctx: StepContext, tasks: list[Task], students: list[str], greedy: bool = False) -> list[Rollout]:
    """students[i] answers tasks[i] `rollouts` times (once if greedy); the verifier scores."""
    if not tasks:
        return []
    t = ctx.cfg.tasks
    params, prefixes = zip(*[sampling(ctx.cfg, "student", task.task_type, greedy) for task in tasks])
    outputs = ctx.actors.generate(students, [student_prompt(task, t.reasoning) for task in tasks], list(params),
                                  list(prefixes))
    attempts, requests = [], []  # (task index, student, prompt ids, completion, answer)
    for i, (task, student, pre, out) in enumerate(zip(tasks, students, prefixes, outputs)):
        for c in out.completions:
            answer = extract_answer(pre + c.text, t.require_answer_close, t.reasoning)
            attempts.append((i, student, out.prompt_ids, c, answer))
            if answer is not None:
                requests.append(check_request(task, answer))
    verdicts = iter(ctx.actors.verifier.check(requests) if requests else [])
    rollouts = []
    for i, student, prompt_ids, c, answer in attempts:
        verdict = next(verdicts) if answer is not None else {"correct": False, "reason": "malformed"}
        correct = bool(verdict.get("correct"))
        malformed = not correct and verdict.get("reason") == "malformed"
        rollouts.append(Rollout(student=student, task_index=i, prompt_ids=prompt_ids, completion_ids=c.token_ids,
                                answer=answer, correct=correct, malformed=malformed,
                                reward=student_reward(correct, malformed), supplied=c.supplied, logprobs=c.logprobs))
    return rollouts


def check_request(task: Task, answer: str) -> Request:
    if task.task_type == "code_f":  # only the held-out pairs decide
        return Request("code_f", task.program, inputs=task.inputs[task.shown:], outputs=task.outputs[task.shown:],
                       answer=answer)
    return Request(task.task_type, task.program, input=task.input, output=task.output, answer=answer)


def task_solve_rates(tasks: list[Task], rollouts: list[Rollout]) -> list[float]:
    """rho(t, s, p) of each task, in `tasks` order (a rollout names its task by index)."""
    correct: dict[int, list[bool]] = defaultdict(list)
    for r in rollouts:
        correct[r.task_index].append(r.correct)
    return [float(np.mean(correct[i])) if correct[i] else 0.0 for i in range(len(tasks))]


def proposal_rates(proposals: list[Proposal], rates: list[float]) -> list[float | None]:
    """The solve rate of each proposal's task, in `proposals` order (None: no valid task).
    The step's tasks are its valid proposals' tasks in order, so the two lists align."""
    valid = iter(rates)
    out = [next(valid) if p.task is not None else None for p in proposals]
    if next(valid, None) is not None:
        raise ValueError("more solve rates than valid proposals")
    return out


def submit_update(ctx: StepContext, exp: Experience) -> tuple[list[ray.ObjectRef], SignalReport, int]:
    """Group-normalised advantages and the learner shards' update, submitted (not awaited).

    Also returns the step's signal shares (the fraction of training rows, per member, per
    role, overall, whose advantage is non-zero: the only rows that move an adapter) and the
    rows dropped because their member was replaced since they were sampled."""
    proposals, rollouts, tasks = exp.proposals, exp.rollouts, exp.tasks
    rows = [TrainingRow(member=p.teacher, role="teacher", task_type=p.task_type, prompt_ids=p.prompt_ids,
                        completion_ids=p.completion_ids, reward=reward, supplied=p.supplied, logprobs=p.logprobs)
            for p, reward in zip(proposals, exp.teacher_rewards)]
    rows += [TrainingRow(member=r.student, role="student", task_type=tasks[r.task_index].task_type,
                         prompt_ids=r.prompt_ids, completion_ids=r.completion_ids, reward=r.reward,
                         supplied=r.supplied, logprobs=r.logprobs) for r in rollouts]
    advantages = group_advantages([row.reward for row in rows], [row.group for row in rows])
    # a repeat is never pushed up, whatever its group's mean (driver.collapse); a step
    # checkpointed before the flags were kept has none
    repeats = [w.repeat_of for w in exp.work] if exp.work else [None] * len(proposals)
    advantages[:len(proposals)] = collapse.never_reinforced(advantages[:len(proposals)], repeats,
                                                            ctx.cfg.tasks.repeat_penalty)
    signal = signal_report([row.member for row in rows], [row.role for row in rows], advantages,
                           valid_proposals=len(tasks), proposals=len(proposals), rollouts=len(rollouts),
                           solved_rollouts=sum(r.correct for r in rollouts),
                           malformed_rollouts=sum(r.malformed for r in rollouts))
    temperature = ctx.cfg.tasks.temperature  # every training row is sampled at it (`sampling`)
    kl = {"teacher": ctx.cfg.learner.teacher_kl_coef, "student": 0.0}
    samples = [TrainSample(row.member, row.prompt_ids, row.completion_ids, adv, row.supplied, exp.version,
                           row.logprobs, temperature, kl_coef=kl[row.role])
               for row, adv in zip(rows, advantages)]
    dropped = 0
    if exp.version < ctx.version:  # sampled before an evolution event: a replaced member's rows go
        members = ctx.actors.population.members()
        alive = set(members["teachers"]) | set(members["students"])
        kept = [s for s in samples if s.adapter in alive]
        dropped, samples = len(samples) - len(kept), kept
    refs = ctx.actors.learner.update(samples, ctx.cfg.pipeline.max_staleness)
    return refs, signal, dropped


def evolve(ctx: StepContext, step: int) -> list[tuple[Replacement, dict]]:
    """Replace the weakest teacher and student by children made in LoRA weight space, and
    measure each child's capability retention against its first parent."""
    actors = ctx.actors
    events = actors.population.plan_replacements(step)
    for e in events:
        actors.learner.spawn_child(e.dead, e.child, list(e.parents), e.operator, e.params, e.seed)
    if events:
        actors.sync(ctx.version)
    return [(e, retention(ctx, e)) for e in events]


def retention(ctx: StepContext, event: Replacement) -> dict:
    """Child vs first parent on the same fixed probe, greedy (so the comparison is exact).

    Student: solve rate on `population.probe_tasks` valid tasks drawn from the buffer.
    Teacher: valid-proposal rate over one proposal batch (and its reward against a fixed
    probe student, the best student by mu - 3 sigma). retention = child / parent, None when
    the parent scores 0 (no capability to retain).
    """
    parent, child = event.parents[0], event.child
    rng = np.random.default_rng([ctx.cfg.run.seed, event.step, event.role == "teacher"])
    if event.role == "student":
        types = ctx.cfg.tasks.types
        tasks = [task for i in range(ctx.cfg.population.probe_tasks)
                 for task in ctx.buffer.sample(types[i % len(types)], 1, rng)]
        # parent and child answer in one mixed batch
        rollouts = solve(ctx, tasks + tasks, [parent] * len(tasks) + [child] * len(tasks), greedy=True)
        scores = {m: float(np.mean([r.correct for r in rollouts if r.student == m])) if rollouts else 0.0
                  for m in (parent, child)}
        extra = {}
    else:
        ratings = ctx.actors.population.ratings()
        students = ctx.actors.population.members()["students"]
        judge = max(students, key=lambda m: (ratings[m]["conservative"], m))
        jobs = proposal_jobs(ctx, [parent], rng)  # the same references for both, one mixed batch
        proposals = propose_jobs(ctx, jobs + [(child, tt, refs) for _, tt, refs in jobs], event.step, greedy=True)
        tasks = [p.task for p in proposals if p.task is not None]
        rates = proposal_rates(proposals, task_solve_rates(tasks, solve(ctx, tasks, [judge] * len(tasks), greedy=True)))
        scores, rewards = {}, {}
        for m in (parent, child):
            mine = [(p, rate) for p, rate in zip(proposals, rates) if p.teacher == m]
            scores[m] = float(np.mean([p.valid for p, _ in mine]))
            rewards[m] = float(np.mean([teacher_reward(p.valid, rate) for p, rate in mine]))
        extra = {"probe_student": judge, "parent_probe_reward": rewards[parent],
                 "child_probe_reward": rewards[child]}
    parent_score, child_score = scores[parent], scores[child]
    return {"probe": "solve_rate" if event.role == "student" else "valid_rate", "parent_probe": parent_score,
            "child_probe": child_score, "retention": child_score / parent_score if parent_score > 0 else None,
            **extra}


# ---- records ---------------------------------------------------------------------------
def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def copy_rate(proposals: list[Proposal]) -> float | None:
    """Copies of a seed or a shown reference among the proposals that write a program
    (code_i, code_o); None when there are none."""
    writes = [p for p in proposals if p.task_type in novelty.WRITES_PROGRAM]
    return float(np.mean([p.copy_of is not None for p in writes])) if writes else None


def record_step(ctx: StepContext, step: int, exp: Experience, stats: dict[str, dict[str, float]],
                signal: SignalReport, events, dropped: int, wall: float | None) -> dict[str, float]:
    """Write the step's rows (metrics, ratings, tasks, lineage) and return its summary.
    `dropped`: rows of replaced members left out of the update; `wall`: the step's wall-clock
    seconds when its phases overlapped another step's (None: the phases' sum)."""
    ratings = ctx.actors.population.ratings()
    members = ctx.actors.population.members()
    times = step_times(ctx.seconds, wall)
    # the learner refuses (and counts) samples older than pipeline.max_staleness versions
    dropped += int(sum(s.get("refused", 0.0) for s in stats.values()))
    hashes = [ast_hash(p.program) if p.program else None for p in exp.proposals]
    # coverage: distinct ASTs among the novel valid programs the teachers wrote (code_f reuses
    # programs; a copy of a seed or a shown reference is not the teachers' work)
    ctx.coverage.update(h for p, h in zip(exp.proposals, hashes)
                        if p.valid and p.copy_of is None and p.task_type in novelty.WRITES_PROGRAM and h)
    metrics = metric_rows(step, exp, stats, signal, ratings, members, ctx.cfg.population.mode == "single",
                          {"pipeline/dropped_samples": dropped, "population/coverage": len(ctx.coverage), **times})
    ctx.run.append("metrics", metrics)
    ctx.telemetry.publish(step, metrics, {**ctx.seconds, "step": times["time/step"]})
    ctx.trackers.log(step, metrics)
    ctx.run.append("ratings", [{"step": step, "member": m, "role": "teacher" if m in members["teachers"] else "student",
                                **r} for m, r in ratings.items()])
    ctx.run.append("tasks", task_rows(step, exp, hashes))
    updates = ctx.cfg.population.recovery_updates
    recovery.track(ctx.run.open_lineage(), metrics, updates)  # earlier children
    ctx.run.append("lineage", lineage_rows(events, metrics))
    ctx.run.flush(step, keep_open=recovery.still_open(updates, set(members["teachers"]) | set(members["students"])))
    summary = step_summary(exp, signal, len(events), dropped, times)
    ctx.summaries.append(summary)
    ctx.low_signal.observe(step, signal)
    ctx.collapse_watch.observe(step, summary)  # its collapse figures: distinct share, program size
    return summary


def step_times(seconds: dict[str, float], wall: float | None) -> dict[str, float]:
    """`time/<phase>`, `time/step` (the wall clock when phases overlapped, else their sum) and
    `time/overlap` (seconds the learner and the generation both ran)."""
    times = {f"time/{k}": seconds.get(k, 0.0) for k in PHASES}
    times["time/step"] = wall if wall is not None else sum(times.values())
    times["time/overlap"] = seconds.get("overlap", 0.0)
    return times


def metric_rows(step: int, exp: Experience, stats: dict[str, dict[str, float]], signal: SignalReport,
                ratings: dict[str, dict[str, float]], members: dict[str, list[str]], single: bool,
                shared: dict[str, float]) -> list[dict]:
    """One metrics row per member that played the step or is alive (docs/design.md §4.4);
    `shared`: the columns every row of the step carries."""
    teachers, students = members["teachers"], members["students"]
    by_teacher, by_student = defaultdict(list), defaultdict(list)
    for p, r, w in zip(exp.proposals, exp.teacher_rewards, exp.work):
        by_teacher[p.teacher].append((p, r, w))
    for r in exp.rollouts:
        by_student[r.student].append(r)
    # members that left this step still get their last row (they played it)
    played = list(dict.fromkeys(list(exp.matches) + list(exp.matches.values()) + teachers + students))
    rows = []
    for m in played:
        rating, learner = ratings.get(m, {}), stats.get(m, {})
        roles = [r for r, group in (("teacher", by_teacher), ("student", by_student)) if m in group]
        tp, sr = by_teacher.get(m, []), by_student.get(m, [])
        rows.append({
            "step": step, "member": m,
            "role": "agent" if single else ("teacher" if m in by_teacher or m in teachers else "student"),
            "alive": m in teachers or m in students, "roles_played": ",".join(roles),
            "teacher/valid_rate": float(np.mean([p.valid for p, _, _ in tp])) if tp else None,
            "teacher/novel_valid_rate": float(np.mean([p.valid and p.copy_of is None for p, _, _ in tp]))
            if tp else None,
            "teacher/copy_rate": copy_rate([p for p, _, _ in tp]),
            "teacher/reward": float(np.mean([r for _, r, _ in tp])) if tp else None,
            **{f"teacher/{k}": (v if tp else None) for k, v in
               collapse.figures([p for p, _, _ in tp], [w for _, _, w in tp]).items()},
            "student/solve_rate": float(np.mean([r.correct for r in sr])) if sr else None,
            "student/malformed_rate": float(np.mean([r.malformed for r in sr])) if sr else None,
            "student/reward": float(np.mean([r.reward for r in sr])) if sr else None,
            "learner/loss": learner.get("loss"), "learner/grad_norm": learner.get("grad_norm"),
            "learner/update_norm": learner.get("update_norm"),
            "learner/signal_share": signal.by_member.get(m),
            "learner/staleness": learner.get("staleness"),
            "learner/is_weight_mean": learner.get("is_weight_mean"),
            "learner/is_truncated_frac": learner.get("is_truncated_frac"),
            "learner/kl_to_base": learner.get("kl_to_base"),
            "pipeline/dropped_samples": shared["pipeline/dropped_samples"],
            "population/trueskill_mu": rating.get("mu"), "population/trueskill_sigma": rating.get("sigma"),
            "population/conservative": rating.get("conservative"),
            **{k: v for k, v in shared.items() if k != "pipeline/dropped_samples"},
        })
    return rows


def task_rows(step: int, exp: Experience, hashes: list[str | None]) -> list[dict]:
    """One tasks row per proposal (docs/design.md §4.7)."""
    rows = []
    for p, r, h, w, rate in zip(exp.proposals, exp.teacher_rewards, hashes, exp.work, exp.proposal_rates):
        cx = complexity(p.task.program) if p.task is not None else {}
        rows.append({
            "step": step, "teacher": p.teacher, "student": exp.matches[p.teacher], "task_type": p.task_type,
            "valid": p.valid, "reason": p.reason, "completion": p.text, "program": p.program, "input": p.input,
            "output": p.task.output if p.task else None, "inputs": list(p.inputs),
            "outputs": list(p.task.outputs) if p.task else [], "message": p.message,
            "solve_rate": rate, "teacher_reward": r,
            **{k: cx.get(k) for k in ("ast_depth", "cyclomatic", "loc", "n_variables", "n_nodes")},
            "ast_hash": h, "program_source": p.source, "copy_of": p.copy_of, "copy_exact": p.exact_copy,
            "structure": w.structure, "structure_nodes": w.nodes, "trivial": w.trivial, "repeat_of": w.repeat_of,
        })
    return rows


def lineage_rows(events: list[tuple[Replacement, dict]], metrics: list[dict]) -> list[dict]:
    """One lineage row per child born this step, with its probe at birth and the start of
    its recovery record (`driver.recovery`)."""
    return [{
        "step": e.step, "role": e.role, "child": e.child, "replaced": e.dead, "parents": list(e.parents),
        "operator": e.operator, "params": json.dumps(e.params), "parent_scores": list(e.parent_scores),
        "replaced_score": e.dead_score, "seed": e.seed, "probe": probe["probe"],
        "parent_probe": probe["parent_probe"], "child_probe": probe["child_probe"], "retention": probe["retention"],
        "probe_student": probe.get("probe_student"), "parent_probe_reward": probe.get("parent_probe_reward"),
        "child_probe_reward": probe.get("child_probe_reward"),
        **recovery.birth_fields(e.role, e.parents[0], metrics),
    } for e, probe in events]


def step_summary(exp: Experience, signal: SignalReport, replaced: int, dropped: int,
                 times: dict[str, float]) -> dict[str, float]:
    """The step line's figures (the progress bar and `train`'s return value)."""
    proposals, rollouts, teacher_rewards = exp.proposals, exp.rollouts, exp.teacher_rewards
    return {
        "valid_rate": float(np.mean([p.valid for p in proposals])) if proposals else 0.0,
        "novel_valid_rate": float(np.mean([p.valid and p.copy_of is None for p in proposals])) if proposals else 0.0,
        "copy_rate": copy_rate(proposals) or 0.0,
        **collapse.figures(proposals, exp.work),
        "solve_rate": float(np.mean([r.correct for r in rollouts])) if rollouts else 0.0,
        "teacher_reward": float(np.mean(teacher_rewards)) if teacher_rewards else 0.0,
        "signal_share": signal.overall, "signal_share_teacher": signal.by_role.get("teacher", 0.0),
        "signal_share_student": signal.by_role.get("student", 0.0),
        **{f"signal_rows_{role}": signal.rows_by_role.get(role, 0) for role in ("teacher", "student")},
        **{f"signal_nonzero_{role}": round(signal.by_role.get(role, 0.0) * signal.rows_by_role.get(role, 0))
           for role in ("teacher", "student")},
        "tasks": len(exp.tasks), "replaced": replaced, "dropped_samples": dropped, **times,
    }


# ---- the job ---------------------------------------------------------------------------
def seed_buffer(cfg: Config, actors: Actors) -> TaskBuffer:
    """Validate the seed programs in the sandbox to get their gold outputs."""
    io_requests = [Request("code_o", s.program, input=inp) for s in SEED_PROGRAMS for inp in s.inputs]
    f_requests = [Request("code_f", s.program, inputs=tuple(s.inputs)) for s in SEED_PROGRAMS]
    results = actors.verifier.validate(io_requests + f_requests)
    io, fs = results[: len(io_requests)], results[len(io_requests):]
    pairs = [(r.program, r.input, v["output"]) for r, v in zip(io_requests, io) if v.get("valid")]
    seeds: dict[str, list[Task]] = {}
    for task_type in cfg.tasks.types:
        if task_type == "code_f":
            seeds[task_type] = [
                Task("code_f", s.program, inputs=tuple(s.inputs), outputs=tuple(v["outputs"]), message=s.message,
                     shown=cfg.tasks.induction_shown)
                for s, v in zip(SEED_PROGRAMS, fs) if v.get("valid")
            ]
        else:
            seeds[task_type] = [Task(task_type, prog, input=inp, output=out) for prog, inp, out in pairs]
    empty = [t for t, v in seeds.items() if not v]
    if empty:
        raise RuntimeError(f"no seed program passed the verifier for {empty}: is the sandbox working?")
    return TaskBuffer(seeds, cfg.tasks.buffer_size)


def save_adapters(ctx: StepContext) -> None:
    """The living members' adapters as PEFT dirs; members replaced since are removed."""
    states = ctx.actors.learner.export_adapters()
    for stale in (ctx.run.path / "adapters").iterdir():
        if stale.name not in states:
            shutil.rmtree(stale)
    for member, state in states.items():
        save_adapter(ctx.run.adapter_dir(member), state, ctx.actors.spec, ctx.cfg.model.path)


def save_checkpoint(ctx: StepContext, step: int, pending: Experience | None = None) -> float:
    """Write checkpoint/ for the state after `step`; returns the seconds it took. `pending`:
    the next step's samples, generated while step `step` trained (pipeline.max_staleness >= 1);
    no call is in flight while this runs, so the checkpoint is a drained boundary."""
    start = time.perf_counter()
    a = ctx.actors
    learner, inference = a.learner.state_dict(), a.inference.state_dict()
    population = a.population.state_dict()
    driver = {
        "buffer": ctx.buffer.state_dict(), "rng": ctx.rng.bit_generator.state, "python_random": random.getstate(),
        "numpy_random": np.random.get_state(), "torch_random": torch.get_rng_state(),
        "coverage": sorted(ctx.coverage), "version": ctx.version, "pending": pending,
        "repeats": ctx.repeats.state_dict(), "collapse_watch": ctx.collapse_watch.state_dict(),
    }
    checkpoint.save(ctx.run.path / checkpoint.NAME, step, {
        "learner": learner, "inference": inference, "population": population, "driver": driver},
        keep=ctx.cfg.run.keep_checkpoints)
    return time.perf_counter() - start


def restore_checkpoint(ctx: StepContext) -> tuple[int, Experience | None]:
    """Bring every actor and the driver back to the last checkpoint; returns its step and the
    next step's samples when they were generated before it was written."""
    step, parts, path = checkpoint.load_latest(ctx.run.path)
    log.info("restoring checkpoint step %d from %s", step, path)
    a = ctx.actors
    a.learner.load_state_dict(parts["learner"])
    a.inference.load_state_dict(parts["inference"])
    a.population.load_state_dict(parts["population"])
    d = parts["driver"]
    ctx.buffer.load_state_dict(d["buffer"])
    ctx.rng.bit_generator.state = d["rng"]
    random.setstate(d["python_random"])
    np.random.set_state(d["numpy_random"])
    torch.set_rng_state(d["torch_random"])
    # the tables as they were after `step`: the run directory holds them, the checkpoint does not
    living = set(member_names(a.population.members()))
    updates = ctx.cfg.population.recovery_updates
    ctx.run.rollback(step, lambda lineage: recovery.replay(lineage, ctx.run.path, step, updates, living),
                     keep_open=recovery.still_open(updates, living))
    ctx.coverage = set(d.get("coverage", []))  # checkpoints from before coverage: counted from here on
    ctx.version = d.get("version", 0)
    if "repeats" in d:  # checkpoints from before the repeat rule: repeats counted from here on
        ctx.repeats.load_state_dict(d["repeats"])
        ctx.collapse_watch.load_state_dict(d["collapse_watch"])
    a.sync(ctx.version)
    return step, d.get("pending")


def start_run(cfg: Config, actors: Actors, ctx_factory) -> StepContext:
    """A fresh run: initial adapters, the seed task buffer, and checkpoint 0."""
    members = actors.population.members()
    actors.learner.init_members(member_names(members), cfg.run.seed)
    actors.sync(0)
    return ctx_factory(seed_buffer(cfg, actors))


class ActorRestarted(RuntimeError):
    """A stateful actor came back from a restart without its state."""


def train(cfg: Config, resume: Path | None = None,
          on_step: Callable[[int, StepContext], None] | None = None) -> Path:
    """Run (or, with `resume`, continue) the configured steps; returns the run directory.

    Checkpoints every `run.checkpoint_every` steps and at the end. When an actor dies,
    every actor is recreated and the whole run goes back to the last checkpoint (at most
    `run.max_recoveries` times), so a step is never half applied. `on_step(step, ctx)`
    runs after each completed step (after its checkpoint, if one is due).
    """
    run = RunDir.open(resume, cfg) if resume else RunDir.create(cfg)
    trackers = Trackers.open(cfg, run.path)  # before Ray starts: a missing tracker package fails first
    owns_ray = not ray.is_initialized()
    start_ray(cfg)
    actors = create_actors(cfg)
    bar = tqdm(total=cfg.run.steps, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr, disable=None)

    def make_ctx(buffer: TaskBuffer) -> StepContext:
        return StepContext(cfg, actors, buffer, np.random.default_rng(cfg.run.seed), run, bar, trackers=trackers,
                           repeats=collapse.RepeatRegistry(cfg.tasks.repeat_window))

    try:
        pending: Experience | None = None  # the next step's samples, generated during the last update
        if resume:
            ctx = make_ctx(TaskBuffer({t: [] for t in cfg.tasks.types}, cfg.tasks.buffer_size))
            step, pending = restore_checkpoint(ctx)
            log.info("resumed %s at step %d", run.path, step)
        else:
            ctx = start_run(cfg, actors, make_ctx)
            step = 0
            save_checkpoint(ctx, step)
        bar.update(step)
        recoveries = 0
        while step < cfg.run.steps:
            try:
                s, following = train_step(step + 1, ctx, pending)
                if actors.restarted():  # a restart between two calls loses state silently
                    raise ActorRestarted("an actor was restarted during the step")
            except (RayActorError, RayTaskError, ActorRestarted) as e:
                # an error inside a live, never-restarted actor is a bug, not a fault
                if isinstance(e, RayTaskError) and not isinstance(e, RayActorError) and not actors.restarted():
                    raise
                recoveries += 1
                if recoveries > cfg.run.max_recoveries:
                    raise
                log.warning("an actor failed during step %d (%s); recreating actors and restoring the last "
                            "checkpoint (recovery %d of %d)", step + 1, type(e).__name__, recoveries,
                            cfg.run.max_recoveries)
                stop_actors(actors)
                actors = ctx.actors = create_actors(cfg)
                step, pending = restore_checkpoint(ctx)
                bar.n = step
                continue
            step, pending = step + 1, following
            bar.update(1)
            ctx.last = (f"valid={s['valid_rate']:.2f} informative={_fmt(s['informative_valid_rate'])} "
                        f"distinct={_fmt(s['distinct_share'])} copies={s['copy_rate']:.2f} "
                        f"solve={s['solve_rate']:.2f} t_reward={s['teacher_reward']:+.2f} "
                        f"signal={s['signal_share']:.2f}")
            bar.set_postfix_str(f"phase=done {ctx.last}")
            log.info("step %d: valid %.2f informative %s distinct %s nodes %s novel valid %.2f copies %.2f "
                     "trivial %s repeats %s solve %.2f teacher reward %+.2f signal %.2f tasks %d replaced %d | %s",
                     step, s["valid_rate"], _fmt(s["informative_valid_rate"]), _fmt(s["distinct_share"]),
                     _fmt(s["program_nodes"], ".1f"), s["novel_valid_rate"], s["copy_rate"],
                     _fmt(s["trivial_rate"]), _fmt(s["repeat_rate"]),
                     s["solve_rate"], s["teacher_reward"], s["signal_share"], s["tasks"],
                     s["replaced"],
                     " ".join(f"{k[5:]}={v:.1f}s" for k, v in s.items() if k.startswith("time/")))
            every = cfg.run.checkpoint_every
            if step == cfg.run.steps or (every and step % every == 0):
                log.info("checkpoint at step %d written in %.2fs", step, save_checkpoint(ctx, step, pending))
            if on_step is not None:
                on_step(step, ctx)
        bar.close()
        save_adapters(ctx)
    finally:
        trackers.close()
        Telemetry.close_current()  # its gauges stop being exported (another run may follow in this process)
        stop_actors(actors)
        if owns_ray:
            ray.shutdown()
    return run.path
