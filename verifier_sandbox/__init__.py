"""Isolated execution and task semantics for the PopuLoRA verifier (standard library only).

Never imports Ray, torch or the driver: actors/verifier.py is the Ray shell around it.
"""

from .complexity import ast_hash, complexity
from .execute import RunResult, run_program
from .protocol import Request, handle
from .screening import screen
from .structure import reads_parameters, strip_dead_code, structure_hash, structure_nodes
from .tasks import TASK_TYPES, Validation, Verdict, check, trivial_reason, validate

__all__ = ["RunResult", "Validation", "Verdict", "TASK_TYPES", "run_program", "validate",
           "check", "screen", "complexity", "ast_hash", "handle", "Request",
           "structure_hash", "structure_nodes", "strip_dead_code", "reads_parameters", "trivial_reason"]
