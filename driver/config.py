"""One validated config tree for a run: YAML file plus dotted overrides.

Every hyperparameter lives here (CleanRL habit). `load_config` checks keys, types and
paths before any work starts and raises `ConfigError` with one line naming the key.

The defaults are what a user should get for a model they bring (a capable instruct
model, as the paper's Qwen2.5-Coder-7B); the sampling, group-size and learning-rate ones
name their reference beside them (AZR: Absolute Zero Reasoner; the PopuLoRA paper;
PEFT/TRL practice for LoRA). The embedded configs (configs/local.yaml, baseline-local.yaml,
test.yaml) override what their small models need, each override with its reason.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from multilora import allocator
from multilora.settings import DEFAULTS as TRAINER
from verifier_sandbox.tasks import TASK_TYPES


class ConfigError(ValueError):
    """A bad config: the message is one line that names the offending key."""


@dataclass
class RunConfig:
    name: str = "local"
    output_dir: str = "runs"
    seed: int = 0
    steps: int = 8
    overwrite: bool = True
    checkpoint_every: int = 2  # C: write checkpoint/ every C steps (and at the end); 0: only at the end
    max_recoveries: int = 3  # actor failures survived by restoring the last checkpoint
    # checkpoints kept (the newest N): a resume takes the newest intact one, so one corrupt
    # file does not lose the run
    keep_checkpoints: int = 2


@dataclass
class ModelConfig:
    # "embedded:smollm2-135m-instruct", "embedded:tiny-llama", or a local HF model directory
    path: str = "embedded:smollm2-135m-instruct"
    # "auto": bf16 base where the actor's CPU (AMX/AVX512-BF16) or GPU has hardware bf16,
    # else fp32 (multilora.model.resolve_dtype); LoRA factors are fp32 either way
    dtype: str = "auto"
    max_model_len: int = 2048


@dataclass
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class PopulationConfig:
    mode: str = "population"  # "population" or "single" (AZR baseline: one adapter, both roles)
    teachers: int = 2
    students: int = 2
    evolve_every: int = 2  # K: replace the weakest teacher and student every K steps (0: never)
    operators: dict[str, float] = field(
        default_factory=lambda: {"gaussian": 0.25, "singular_value": 0.25, "layer_swap": 0.25, "svd_merge": 0.25}
    )
    tournament_k: int = 2
    child_sigma: float = 25.0 / 3.0
    pfsp_weighting: str = "variance"  # f(x) = x(1-x); "hard": (1-x)^p
    pfsp_p: float = 1.0
    probe_tasks: int = 6  # fixed probe per replacement: capability retention of child vs parent
    # A child cannot be replaced before it has played this many games (one per proposal): its
    # reset sigma would make it the next one culled. TrueSkill sigma over fair games: 8.3 at
    # birth, 1.4 after 40, 0.9 after 100, floor 0.8, so after 100 games a child's mu - 3 sigma is
    # within ~0.3 of a veteran's with the same mu. Cost: with 2 per role and 60 games between
    # evolution steps (configs/local.yaml) the role waits while the child rates lowest. Effect
    # (python -m bench.selection, fair-coin games, local.yaml: 2 per role, K=5, 12 games per
    # step): the replaced member was the previous child 70% of the time without protection,
    # 48% with 100 (chance 50%), at the price of 465 replacements instead of 800. At
    # cluster-7b.yaml's 4 per role, 24 games per step: no bias (26%, chance 25%), never binds.
    min_games: int = 100
    # lineage rows follow each child's reward over this many updates against its parent's at
    # birth (the paper: a child recovers its parent's reward within about 10-20 updates)
    recovery_updates: int = 20


@dataclass
class TasksConfig:
    types: list[str] = field(default_factory=lambda: list(TASK_TYPES))
    # per teacher per step; also the rows of each (teacher, task type) group the advantages
    # are normalised over. 8: configs/cluster-7b.yaml, the paper's 7B setting (AZR proposes
    # 64 per type per step for its one model); groups of 2 give every row +-1 or 0
    proposals_per_type: int = 8
    # n: student samples per valid task, the solve rate's Monte-Carlo estimate and the rows
    # of a student's group for that task. 8: AZR's n_samples, as configs/cluster-7b.yaml
    rollouts: int = 8
    references: int = 2  # reference programs shown in a teacher prompt
    induction_inputs: int = 4  # inputs a teacher writes for a code_f task
    induction_shown: int = 2  # of which the student sees this many; the rest are held out
    propose_max_new_tokens: int = 192
    solve_max_new_tokens: int = 128
    # AZR samples proposals and rollouts at temperature 1.0, top_p 1.0: the policy the
    # policy gradient assumes, no truncated tail
    temperature: float = 1.0
    top_p: float = 1.0
    buffer_size: int = 256
    answer_prefix: bool = True  # start each reply inside its <answer> block (see prompts.answer_prefix)
    # false: an unclosed last <answer> block ends with the reply. True: AZR's format check
    # needs the closed block; a model that keeps the format loses nothing by it
    require_answer_close: bool = True
    # a <think> section before every answer, as in AZR (prompts ask for it, its tokens are
    # trained, the answer is read after </think>); off where the token budget is tight
    reasoning: bool = False
    # the generator supplies the reply format's tags and fences and the model writes only the
    # contents (multilora.reply_format; both backends); supplied tokens are never trained on.
    # Implies the answer prefix. Off by default: a capable model writes AZR's format itself
    # (AZR's setting, configs/cluster-7b.yaml); on in the embedded configs: a 135M model
    # seldom keeps the format
    constrained_format: bool = False
    # a proposal whose program copies a seed program or a reference its prompt showed (same
    # ast_hash: names and constants abstracted) is not a new task: it gets the invalid
    # proposal's reward, is a forfeit, and never enters the task buffer. Copies are always
    # valid and often unsolved, so without this rule self-play teaches teachers to copy.
    # Not in the PopuLoRA paper (AZR only asks its proposer to differ from the references)
    reject_copies: bool = True
    # a task that a blind guess answers tests nothing (verifier_sandbox.tasks.trivial_reason:
    # code_i/code_o: f reads none of its parameters; code_i: the output given back as the
    # input reproduces it; code_o: the output is one of the input's arguments; code_f: a
    # constant or one argument unchanged reproduces every output). Such a proposal is invalid
    # (reason "trivial: ..."), a forfeit, and never enters the task buffer
    reject_trivial: bool = True
    # the program a student sees is what `f` executes: top-level expression statements (the
    # `print(f(1))` a model appends) and functions `f` never calls are dropped before
    # validation (verifier_sandbox.structure.strip_dead_code); what is left is validated
    strip_dead_code: bool = True
    # a valid code_i / code_o proposal whose structure (verifier_sandbox.structure_hash: what
    # `f` executes, names and constants abstracted) was valid in the last `repeat_window`
    # steps, or appears more than once among the step's proposals, is a repeat: its reward is
    # min(its reward, the structure's reward when it was new) - repeat_penalty, so a repeat
    # always earns less than the same program did when new, and its advantage is capped at 0
    # (never pushed up: driver.collapse.never_reinforced). 0: off (the paper's rewards)
    repeat_penalty: float = 0.5
    repeat_window: int = 4


@dataclass
class VerifierConfig:
    min_workers: int = 2
    max_workers: int = 2
    timeout_s: float = 5.0
    memory_mb: int = 512
    chunk_size: int = 8


@dataclass
class LearnerConfig:
    # AdamW rate of the LoRA factors. 1e-5: AZR's 1e-6 is a full fine-tuning rate, and LoRA's
    # best rate is about 10x full fine-tuning's (Schulman et al. 2025, "LoRA Without Regret",
    # policy-gradient RL included; PEFT/TRL LoRA practice runs 1e-5..1e-4), as in
    # configs/cluster-7b.yaml. 0: the no-learning control (no adapter moves)
    lr: float = TRAINER.lr
    weight_decay: float = TRAINER.weight_decay
    # the ratio to pi_old is clipped to [1 - clip_eps, 1 + clip_eps] (PPO) only from an
    # update's second pass (`epochs`): with one epoch the ratio is exactly 1 and the update
    # is REINFORCE with group-normalised advantages (multilora.trainer; stat clip_frac)
    clip_eps: float = TRAINER.clip_eps
    max_grad_norm: float = TRAINER.max_grad_norm
    micro_batch: int = TRAINER.micro_batch
    epochs: int = TRAINER.epochs  # passes over one update's samples, one optimizer step per adapter each
    strategy: str = "torch"  # "deepspeed": ZeRO over the adapter parameters (GPU, optional extra)
    zero_stage: int = 2
    offload_optimizer: bool = False  # deepspeed only: fp32 master weights and moments on the CPU
    # truncated importance sampling (pipeline.max_staleness >= 1): the per-token weight
    # pi_learner / pi_behaviour is capped here (veRL's and slime's TIS use 2)
    is_cap: float = TRAINER.is_cap
    # KL anchor of the teachers' proposal rows to the base policy (the adapter switched off:
    # multilora.trainer.kl_to_base), weight per row's mean token KL. 0: none (the paper's
    # loss). It keeps a teacher's programs near what the base model writes while the
    # validity reward pulls toward the shortest valid program (docs/learning.md)
    teacher_kl_coef: float = 0.0
    # learner actors, each owning a fixed share of the members (adapter parallel, no
    # all-reduce; driver/fleet.py). A member's update is the one a single learner makes
    shards: int = 1


@dataclass
class PipelineConfig:
    # k: how many policy versions the samples a learner trains on may lag behind it. 0: each
    # step generates, then trains (lockstep). k >= 1: the generation of step t+1 runs while the
    # learner trains on step t, sampling from the adapters after update t-1 (one step off
    # policy, importance-corrected: learner.is_cap); the schedule is fixed, so a seed gives
    # the same run every time. The overlap needs only one step of lag; k > 1 allows no more
    max_staleness: int = 0


@dataclass
class InferenceConfig:
    backend: str = "hf"  # "hf" or "vllm"
    # rows decoded together. Decoding is bound by reading the weights once per step, so more
    # rows cost little more per step: a solve phase's 28-68 rollouts (configs/local.yaml) run
    # in one wave. Student prompts, 6 x 8 rollouts x 96 tokens, SmolLM2-135M, 1 thread:
    # 18.0 / 18.6 s at 32 rows, 13.0 / 13.5 s at 64 (83 vs 114 ms per step at 32 vs 48 rows)
    max_batch: int = 64
    # inference engines, each holding every adapter; requests are routed by adapter
    # (driver/fleet.py route) and a replica that dies is replaced, its requests retried
    replicas: int = 1


@dataclass
class RayConfig:
    address: str = ""  # empty: start an embedded Ray; "auto": join a running cluster
    num_cpus: int = 0  # 0: Ray's own count (embedded only)
    dashboard: bool = False
    actor_cpus: float = 0.0  # logical CPUs reserved by the inference server and the learner
    inference_gpus: float = 0.0  # GPUs of the inference server (cluster: 1 or more)
    learner_gpus: float = 0.0  # GPUs of the learner
    torch_threads: int = 0  # torch threads of the inference server and the learner; 0: every core
    #                         of this machine (embedded Ray) or the node's default (cluster)
    metrics_export_port: int = 0  # Prometheus endpoint of an embedded Ray (0: Ray picks one)
    allocator: str = "auto"  # malloc of the inference server and the learner (multilora.allocator):
    #                          "auto" TCMalloc where installed, "system", or a library's path


@dataclass
class LoggingConfig:
    tensorboard: bool = False  # event files under runs/<name>/tensorboard/, the metrics.parquet scalars
    wandb: bool = False  # Weights & Biases (optional extra `populora[wandb]`), files under runs/<name>/wandb/
    wandb_project: str = "populora"
    wandb_mode: str = "offline"  # "online" sends the run to the W&B server the user is logged in to


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    population: PopulationConfig = field(default_factory=PopulationConfig)
    tasks: TasksConfig = field(default_factory=TasksConfig)
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_CHOICES = {
    "population.mode": ("population", "single"),
    "population.pfsp_weighting": ("variance", "hard"),
    "inference.backend": ("hf", "vllm"),
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "learner.strategy": ("torch", "deepspeed"),
    "logging.wandb_mode": ("offline", "online"),
}


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check `value` against a type hint; ints are accepted where floats are expected."""
    origin = typing.get_origin(hint)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(hint)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        k_hint, v_hint = typing.get_args(hint)
        return {_coerce(k, k_hint, key): _coerce(v, v_hint, f"{key}.{k}") for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        # YAML 1.1 reads `1e-3` (no dot) as a string; it is a number to anyone writing it
        return float(value)
    if hint is bool and not isinstance(value, bool) or (hint in (int, float) and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {hint.__name__}, got {type(value).__name__} {value!r}")
    if not isinstance(value, hint):
        raise ConfigError(f"{key}: expected {hint.__name__}, got {type(value).__name__} {value!r}")
    return value


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"{dotted}: unknown key (known: {', '.join(sorted(names))})")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{dotted}: expected a mapping, got {type(value).__name__} {value!r}")
            kwargs[key] = _build(hint, value, f"{dotted}.")
        else:
            kwargs[key] = _coerce(value, hint, dotted)
    return cls(**kwargs)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"{text}: an override must look like key.sub=value")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=value` overrides (values parsed as YAML) to a nested dict, in order."""
    for text in overrides:
        path, value = _parse_override(text)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{'.'.join(path)}: {part} is not a section")
        node[path[-1]] = value
    return data


def _validate(cfg: Config) -> None:
    def positive(key: str, value: float) -> None:
        if value <= 0:
            raise ConfigError(f"{key}: must be > 0, got {value!r}")

    for key, choices in _CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in choices:
            raise ConfigError(f"{key}: must be one of {', '.join(choices)}, got {value!r}")
    for key in ("run.steps", "lora.rank", "tasks.proposals_per_type", "tasks.rollouts", "tasks.induction_inputs",
                "tasks.propose_max_new_tokens", "tasks.solve_max_new_tokens", "verifier.min_workers",
                "verifier.max_workers", "verifier.timeout_s", "verifier.memory_mb",
                "learner.micro_batch", "learner.epochs", "learner.is_cap", "inference.max_batch", "tasks.buffer_size",
                "population.recovery_updates", "run.keep_checkpoints", "tasks.repeat_window"):
        section, name = key.split(".")
        positive(key, getattr(getattr(cfg, section), name))
    if cfg.verifier.max_workers < cfg.verifier.min_workers:
        raise ConfigError(f"verifier.max_workers: must be >= verifier.min_workers ({cfg.verifier.min_workers})")
    if not cfg.tasks.types:
        raise ConfigError("tasks.types: at least one task type is needed")
    for t in cfg.tasks.types:
        if t not in TASK_TYPES:
            raise ConfigError(f"tasks.types: unknown task type {t!r} (known: {', '.join(TASK_TYPES)})")
    if not 1 <= cfg.tasks.induction_shown < cfg.tasks.induction_inputs:
        raise ConfigError("tasks.induction_shown: must be >= 1 and < tasks.induction_inputs")
    if not 0 < cfg.tasks.top_p <= 1:
        raise ConfigError(f"tasks.top_p: must be in (0, 1], got {cfg.tasks.top_p!r}")
    if cfg.learner.lr < 0:  # 0 is the no-learning control: the update leaves every adapter unchanged
        raise ConfigError(f"learner.lr: must be >= 0, got {cfg.learner.lr!r}")
    if cfg.tasks.temperature < 0:
        raise ConfigError(f"tasks.temperature: must be >= 0, got {cfg.tasks.temperature!r}")
    if cfg.population.mode == "population":
        positive("population.teachers", cfg.population.teachers)
        positive("population.students", cfg.population.students)
    positive("inference.replicas", cfg.inference.replicas)
    positive("learner.shards", cfg.learner.shards)
    members = cfg.population.teachers + cfg.population.students if cfg.population.mode == "population" else 1
    if cfg.learner.shards > members:
        raise ConfigError(f"learner.shards: {cfg.learner.shards} shards for {members} members would leave a shard "
                          f"without an adapter (at most {members})")
    for key in ("run.checkpoint_every", "run.max_recoveries", "ray.torch_threads", "population.min_games",
                "pipeline.max_staleness", "tasks.repeat_penalty", "learner.teacher_kl_coef"):
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) < 0:
            raise ConfigError(f"{key}: must be >= 0, got {getattr(getattr(cfg, section), name)!r}")
    if cfg.ray.allocator not in allocator.SETTINGS and not Path(cfg.ray.allocator).is_file():
        raise ConfigError(f"ray.allocator: must be one of {', '.join(allocator.SETTINGS)} or the path of a "
                          f"shared library, got {cfg.ray.allocator!r}")
    if cfg.population.evolve_every < 0:
        raise ConfigError(f"population.evolve_every: must be >= 0, got {cfg.population.evolve_every!r}")
    if not cfg.population.operators:
        raise ConfigError("population.operators: at least one operator is needed")
    from evolution.operators import OPERATORS  # torch: only once a config is checked

    for name, weight in cfg.population.operators.items():
        if name not in OPERATORS:
            raise ConfigError(f"population.operators.{name}: unknown operator (known: {', '.join(OPERATORS)})")
        if weight < 0:
            raise ConfigError(f"population.operators.{name}: weight must be >= 0, got {weight!r}")
    if not cfg.run.name or "/" in cfg.run.name:
        raise ConfigError(f"run.name: must be a non-empty name without '/', got {cfg.run.name!r}")
    if cfg.logging.wandb and not cfg.logging.wandb_project.strip():
        raise ConfigError("logging.wandb_project: must be a non-empty name")
    _validate_model_path(cfg.model.path, local=not cfg.ray.address)


def _validate_model_path(path: str, local: bool = True) -> None:
    """An embedded model's name, or a model directory. Checked here only when the run is
    local (`local`): on a cluster the driver's node (the head, under `ray job submit`) need
    not hold the model; the inference server and the learner check it where they run."""
    from multilora.embedded import EMBEDDED_MODELS

    if path.startswith("embedded:"):
        name = path.split(":", 1)[1]
        if name not in EMBEDDED_MODELS:
            raise ConfigError(f"model.path: unknown embedded model {name!r} (known: {', '.join(EMBEDDED_MODELS)})")
        return
    if not local:
        return
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ConfigError(f"model.path: {path!r} is not a directory")
    if not (p / "config.json").is_file():
        raise ConfigError(f"model.path: {path!r} has no config.json (a Hugging Face model directory is expected)")


def read_yaml_mapping(path: str | Path, what: str, error: type[Exception] = ConfigError) -> dict[str, Any] | None:
    """The mapping at the top of a YAML file (None when the file is empty); a missing file,
    invalid YAML or another top-level value raise `error`, the message led by `what`."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what}: no such file {str(p)!r}")
    try:
        loaded = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise error(f"{what}: {p} is not valid YAML ({str(e).splitlines()[0]})") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise error(f"{what}: {p} must hold a mapping at the top level")
    return loaded


def _read_file(path: str | Path | None) -> dict[str, Any]:
    """The YAML config file's mapping ({} without a file)."""
    if path is None:
        return {}
    loaded = read_yaml_mapping(path, "--config")
    return loaded or {}


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply dotted overrides, validate. Raises ConfigError."""
    data = apply_overrides(_read_file(path), overrides or [])
    cfg = _build(Config, data, "")
    _validate(cfg)
    return cfg


def _leaf_keys(cls: type, prefix: str) -> list[str]:
    """Dotted names of the fields of `cls` that hold values (sections recursed into)."""
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += _leaf_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def config_sources(path: str | Path | None, overrides: list[str] | None = None) -> dict[str, str]:
    """Where each key of `load_config(path, overrides)` got its value, in `Config` order:
    "default", "file", "--set", or "file + --set" (a mapping such as population.operators
    that the file gives and an override adds an entry to). An override of a whole section
    (`--set learner={lr: 0}`) replaces the file's section: its other keys are defaults."""
    file_data = _read_file(path)
    merged = apply_overrides(copy.deepcopy(file_data), overrides or [])
    set_paths = [_parse_override(text)[0] for text in overrides or []]

    def present(data: dict[str, Any], parts: list[str]) -> bool:
        for part in parts:
            if not isinstance(data, dict) or part not in data:
                return False
            data = data[part]
        return True

    sources = {}
    for key in _leaf_keys(Config, ""):
        parts = key.split(".")
        if not present(merged, parts):
            sources[key] = "default"
        elif any(parts[:len(p)] == p for p in set_paths):  # set itself, or a section above it
            sources[key] = "--set"
        elif any(p[:len(parts)] == parts for p in set_paths):  # an entry of it set
            sources[key] = "file + --set" if present(file_data, parts) else "--set"
        else:
            sources[key] = "file"
    return sources


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a validated Config from `Config.to_dict()` output (checkpoints, run dirs)."""
    cfg = _build(Config, data, "")
    _validate(cfg)
    return cfg

