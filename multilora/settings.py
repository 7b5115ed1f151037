"""The learner's settings (`TrainerSettings`): plain data, no torch, so the job's config
(`driver.config.LearnerConfig`, where each key's reason is written) takes its defaults from
here and the two cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class TrainerSettings:
    lr: float = 1e-5
    weight_decay: float = 0.0
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    micro_batch: int = 8
    epochs: int = 1
    is_cap: float = 2.0  # truncation of the per-token importance weight (stale rows only)

    @classmethod
    def of(cls, config: object) -> TrainerSettings:
        """The settings an object with these attributes names (the job's learner config)."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})


DEFAULTS = TrainerSettings()
