"""The immutable records that flow through a step: tasks, proposals, rollouts."""

from __future__ import annotations

from dataclasses import dataclass

# the phases of a step, in order (`time/<phase>` in metrics.parquet, docs/design.md §4.4)
PHASES = ("match", "propose", "solve", "update", "evolve")
# the `teacher` of a task made from a seed program: no member wrote it (not an RNG seed)
SEED_TEACHER = "seed"


@dataclass(frozen=True)
class Task:
    """A valid task with its gold answers (docs/design.md §4.1 field conventions).

    code_i / code_o use `input` and `output`; code_f uses `inputs` / `outputs`, of which the
    first `shown` pairs are shown to the student and the rest are held out for checking.
    """

    task_type: str
    program: str
    input: str | None = None
    output: str | None = None
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    message: str = ""
    shown: int = 0
    teacher: str = SEED_TEACHER
    step: int = -1


@dataclass(frozen=True)
class Proposal:
    """One teacher generation, parsed; `task` is set only when the verifier accepted it."""

    teacher: str
    task_type: str
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    text: str
    program: str | None
    input: str | None
    inputs: tuple[str, ...]
    message: str
    valid: bool
    reason: str | None
    task: Task | None
    # where the program came from: "proposal" (written by a teacher: this one, or for code_f an
    # earlier valid code_i / code_o proposal) or "seed" (a code_f task on a seed program)
    source: str = "proposal"
    supplied: tuple[bool, ...] = ()  # completion tokens the reply format supplied (not trained on)
    # the seed or shown reference the program copies (`driver.novelty.copy_of`), else None;
    # `exact_copy`: the stricter rule (same source after ast.unparse)
    copy_of: str | None = None
    exact_copy: bool = False
    # log pi_behaviour of each completion token under the adapter version that sampled it
    # (the engine's, at the sampling temperature: `Completion.logprobs`; empty when it did not report them)
    logprobs: tuple[float, ...] = ()
    # why a blind guess answers the task (the verifier's `trivial`, "trivial: ..."), or None;
    # with tasks.reject_trivial such a proposal is invalid and `reason` says the same
    trivial: str | None = None


@dataclass(frozen=True)
class Rollout:
    """One student attempt at a task, with its verdict and reward."""

    student: str
    task_index: int  # index into the step's valid tasks
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    answer: str | None
    correct: bool
    malformed: bool
    reward: float
    supplied: tuple[bool, ...] = ()  # completion tokens the reply format supplied (not trained on)
    logprobs: tuple[float, ...] = ()  # as Proposal.logprobs


@dataclass(frozen=True)
class TrainingRow:
    """One sequence the learner trains on: a teacher's proposal or a student's rollout, with
    its reward (its advantage is normalised within `group`)."""

    member: str
    role: str  # "teacher" or "student"
    task_type: str
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    reward: float
    supplied: tuple[bool, ...] = ()
    logprobs: tuple[float, ...] = ()

    @property
    def group(self) -> tuple[str, str, str]:
        """The rows whose rewards are normalised together: one member, role and task type."""
        return self.member, self.role, self.task_type
