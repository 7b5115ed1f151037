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
}


class Telemetry:
    """Gauges set once per step from the step's metrics rows (a no-op without Ray metrics)."""

    def __init__(self) -> None:
        try:
            from ray.util.metrics import Gauge

            self.member = {name: Gauge(name, description=desc, tag_keys=("member", "role"))
                           for name, (_, desc) in MEMBER_GAUGES.items()}
            self.phase = Gauge("populora_phase_seconds", description="seconds spent in each phase of the last step",
                               tag_keys=("phase",))
            self.step = Gauge("populora_step", description="last completed training step")
        except Exception as e:  # observability must never stop training
            log.warning("Ray metrics unavailable (%s): the dashboard will lack training metrics", e)
            self.member = {}
            self.phase = self.step = None

    def publish(self, step: int, rows: list[dict], seconds: dict[str, float]) -> None:
        if self.step is None:
            return
        for row in rows:
            if not row.get("alive", True):
                continue
            tags = {"member": row["member"], "role": row["role"]}
            for name, (column, _) in MEMBER_GAUGES.items():
                if row.get(column) is not None:
                    self.member[name].set(float(row[column]), tags=tags)
        for phase, value in seconds.items():
            self.phase.set(float(value), tags={"phase": phase})
        self.step.set(float(step))
