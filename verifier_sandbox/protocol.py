"""The JSON request/response contract of the verifier (docs/design.md §4.2), shared by the
CLI and the Ray workers. `handle` never raises: a bad request is an error reply."""

from __future__ import annotations

from dataclasses import dataclass

from .execute import run_program
from .tasks import check, validate

OPS = ("run", "validate", "check")
_FAILED = {"run": {}, "validate": {"valid": False}, "check": {"correct": False}}
_LIMITS = ("timeout_s", "memory_mb")


@dataclass(frozen=True)
class Request:
    """One `validate` or `check` request, typed; `to_dict` is its JSON form (§4.2), the one
    the CLI reads and `handle` serves. code_i / code_o name `input` (and `output` to check);
    code_f names `inputs` (and `outputs`); a check carries the student's `answer`."""

    task_type: str
    program: str
    input: str | None = None
    output: str | None = None
    inputs: tuple[str, ...] | None = None
    outputs: tuple[str, ...] | None = None
    answer: str | None = None
    reject_trivial: bool | None = None  # validate only; None: the verifier's default (on)
    strip_dead_code: bool | None = None
    timeout_s: float | None = None
    memory_mb: int | None = None

    def to_dict(self) -> dict:
        out = {}
        for key, value in self.__dict__.items():
            if value is not None:
                out[key] = list(value) if isinstance(value, tuple) else value
        return out


def as_request(request: Request | dict) -> dict:
    """The JSON form of a request, whichever form it came in."""
    return request.to_dict() if isinstance(request, Request) else request


def _text(request: dict, key: str, default: str | None = None, required: bool = True
          ) -> str | None:
    value = request.get(key, default)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise ValueError(f"'{key}' must be a string, got {type(value).__name__}")
    return value


def _texts(request: dict, key: str) -> list[str] | None:
    value = request.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"'{key}' must be a list of strings")
    return value


def _flag(request: dict, key: str, default: bool = True) -> bool:
    value = request.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"'{key}' must be true or false")
    return value


def _limits(request: dict) -> dict:
    limits = {}
    for key in _LIMITS:
        if key in request:
            value = request[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"'{key}' must be a positive number")
            limits[key] = int(value) if key == "memory_mb" else float(value)
    return limits


def _dispatch(op: str, request: dict) -> dict:
    limits = _limits(request)
    if op == "run":
        return run_program(_text(request, "program"), _text(request, "call", "f()"),
                           **limits).to_dict()
    task_type = _text(request, "task_type")
    if op == "validate":
        return validate(task_type, _text(request, "program"),
                        input=_text(request, "input", required=False),
                        inputs=_texts(request, "inputs"), reject_trivial=_flag(request, "reject_trivial"),
                        strip_dead=_flag(request, "strip_dead_code"), **limits).to_dict()
    return check(task_type, _text(request, "program", "", required=False) or "",
                 _text(request, "answer"),
                 input=_text(request, "input", required=False),
                 output=_text(request, "output", required=False),
                 inputs=_texts(request, "inputs"), outputs=_texts(request, "outputs"),
                 **limits).to_dict()


def handle(op: str, request: dict) -> dict:
    """Serves one request of the CLI JSON contract; never raises.

    A bad request gets {"error": ...}, plus "valid": false for validate and
    "correct": false for check.
    """
    if op not in OPS:
        return {"error": f"unknown op {op!r}; expected one of {OPS}"}
    try:
        if not isinstance(request, dict):
            raise ValueError(f"request must be a JSON object, got {type(request).__name__}")
        return _dispatch(op, request)
    except Exception as exc:  # the contract: a reply for every request, whatever it holds
        return bad_request(op, str(exc))


def bad_request(op: str, why: str) -> dict:
    """The reply to a request that could not be served: an error plus a failed verdict."""
    reason = f"bad request: {why}"
    failed = dict(_FAILED.get(op, {}))
    if failed:
        failed["reason"] = reason
    return {"error": reason, **failed}
