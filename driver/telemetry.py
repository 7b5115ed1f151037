"""Training metrics on the Ray dashboard / Prometheus endpoint (`ray.util.metrics`).

Exported as `ray_populora_<name>`; per-member gauges carry `member` and `role` tags.
The names are stable: dashboards and alerts are built on them.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

MEMBER_GAUGES = {
    "populora_trueskill_mu": ("population/trueskill_mu", "TrueSkill mu per member"),
    "populora_trueskill_sigma": ("population/trueskill_sigma", "TrueSkill sigma per member"),
    "populora_student_solve_rate": ("student/solve_rate", "fraction of a student's rollouts judged correct"),
    "populora_teacher_reward": ("teacher/reward", "mean teacher reward of a member's proposals"),
    "populora_teacher_valid_rate": ("teacher/valid_rate", "fraction of a teacher's proposals that were valid"),
    "populora_signal_share": ("learner/signal_share",
                              "fraction of a member's training rows with a non-zero advantage"),
}
# one value per step, the same in every member's row
STEP_GAUGES = {
    "populora_coverage": ("population/coverage", "distinct program ASTs among the valid programs teachers wrote"),
}


PHASE_GAUGE = "populora_phase_seconds"
STEP_GAUGE = "populora_step"


def exported_metrics() -> set[str]:
    """Every Prometheus name a training run exports: Ray adds `ray_` to each gauge name."""
    from actors.verifier import POOL_GAUGES

    return {f"ray_{name}" for name in [*MEMBER_GAUGES, *STEP_GAUGES, PHASE_GAUGE, STEP_GAUGE, *POOL_GAUGES]}


class Telemetry:
    """Gauges set once per step from the step's metrics rows (a no-op without Ray metrics).

    They keep exporting the last step's values until the Telemetry is closed: by the next one
    made in this process (one run at a time exports: an earlier run's values, alive until
    garbage, would otherwise be exported beside this run's under the same tags), or by
    `close` when the run ends.
    """

    _current: Telemetry | None = None

    def __init__(self) -> None:
        if Telemetry._current is not None:
            Telemetry._current.close()
        Telemetry._current = self
        try:
            from actors.metrics import HeldGauge as Gauge  # kept exported between steps

            self.member = {name: Gauge(name, description=desc, tag_keys=("member", "role"))
                           for name, (_, desc) in MEMBER_GAUGES.items()}
            self.phase = Gauge(PHASE_GAUGE, description="seconds spent in each phase of the last step",
                               tag_keys=("phase",))
            self.step = Gauge(STEP_GAUGE, description="last completed training step")
            self.scalar = {name: Gauge(name, description=desc) for name, (_, desc) in STEP_GAUGES.items()}
        except Exception as e:  # observability must never stop training
            log.warning("Ray metrics unavailable (%s): the dashboard will lack training metrics", e)
            self.member, self.scalar = {}, {}
            self.phase = self.step = None

    @classmethod
    def close_current(cls) -> None:
        """`close` the Telemetry this process exports now, if any (a run's end)."""
        if cls._current is not None:
            cls._current.close()
            cls._current = None

    def close(self) -> None:
        """Stop exporting this run's values (its series leave the endpoint ~20 s later)."""
        for gauge in [*self.member.values(), *self.scalar.values(), self.phase, self.step]:
            if gauge is not None:
                gauge.clear()

    def publish(self, step: int, rows: list[dict], seconds: dict[str, float]) -> None:
        if self.step is None:
            return
        for gauge in self.member.values():
            gauge.clear()  # members that left stop being exported
        for row in rows:
            if not row.get("alive", True):
                continue
            tags = {"member": row["member"], "role": row["role"]}
            for name, (column, _) in MEMBER_GAUGES.items():
                if row.get(column) is not None:
                    self.member[name].set(float(row[column]), tags=tags)
        for name, (column, _) in STEP_GAUGES.items():
            value = next((row[column] for row in rows if row.get(column) is not None), None)
            if value is not None:  # a column that this run's rows lack is left unset
                self.scalar[name].set(float(value))
        for phase, value in seconds.items():
            self.phase.set(float(value), tags={"phase": phase})
        self.step.set(float(step))
