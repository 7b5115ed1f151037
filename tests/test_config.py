import os
import subprocess
import sys
from pathlib import Path

import pytest

from driver.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_configs_load():
    for name in ("local.yaml", "test.yaml"):
        cfg = load_config(ROOT / "configs" / name)
        assert cfg.population.teachers == 2 and cfg.lora.rank == 8


def test_dotted_overrides():
    cfg = load_config(ROOT / "configs/test.yaml", ["population.teachers=4", "run.steps=7", "learner.lr=0.5"])
    assert (cfg.population.teachers, cfg.run.steps, cfg.learner.lr) == (4, 7, 0.5)


def test_exponent_without_dot_is_a_float():
    # YAML 1.1 reads 1e-3 as a string: `--set learner.lr=1e-3` failed with "expected float"
    cfg = load_config(ROOT / "configs/test.yaml", ["learner.lr=1e-3", "learner.weight_decay=2E-2"])
    assert (cfg.learner.lr, cfg.learner.weight_decay) == (1e-3, 2e-2)


@pytest.mark.parametrize("override,key", [
    ("learner.lr=fast", "learner.lr: expected float"),
    ("population.teacher=3", "population.teacher: unknown key"),
    ("popul.teachers=3", "popul: unknown key"),
    ("population.teachers=many", "population.teachers: expected int"),
    ("learner.lr=[1]", "learner.lr: expected float"),
    ("model.path=/nonexistent/model", "model.path:"),
    ("inference.backend=tgi", "inference.backend: must be one of"),
    ("tasks.types=[code_x]", "tasks.types: unknown task type"),
    ("population.operators.flip=1.0", "population.operators.flip: unknown operator"),
    ("run.steps=0", "run.steps: must be > 0"),
    ("learner.strategy=fsdp", "learner.strategy: must be one of"),
    ("ray.torch_threads=-1", "ray.torch_threads: must be >= 0"),
    ("ray.allocator=/nonexistent/libmalloc.so", "ray.allocator: must be one of"),
])
def test_bad_config_names_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/test.yaml", [override])
    assert str(err.value).startswith(key), str(err.value)
    assert "\n" not in str(err.value)


def test_cli_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "driver", "train", "--config", str(ROOT / "configs/test.yaml"),
                           "--set", "population.teachers=x"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "population.teachers" in lines[0], proc.stderr


def test_missing_config_file():
    with pytest.raises(ConfigError, match="--config: no such file"):
        load_config("does/not/exist.yaml")


def test_actor_threads():
    from driver.session import actor_threads

    assert actor_threads(load_config(ROOT / "configs/test.yaml", ["ray.torch_threads=1"])) == 1
    assert actor_threads(load_config(ROOT / "configs/test.yaml")) == (os.cpu_count() or 1)  # embedded: every core
    assert actor_threads(load_config(ROOT / "configs/test.yaml", ["ray.address=auto"])) == 0  # the node's default


def test_cluster_config_keys_are_valid(tiny_model_path):
    # its model directory exists only on the GPU nodes; everything else must validate here
    cfg = load_config(ROOT / "configs/cluster-7b.yaml", [f"model.path={tiny_model_path}"])
    assert cfg.ray.address == "auto" and cfg.run.output_dir.startswith("/")


# The keys whose defaults are for a model a user brings (driver/config.py names each one's
# reference) and that the small embedded models need otherwise, or were measured with.
MODEL_DEPENDENT = ("tasks.temperature", "tasks.top_p", "tasks.constrained_format", "tasks.require_answer_close",
                   "tasks.proposals_per_type", "tasks.rollouts", "learner.lr")


def _yaml(name: str) -> dict:
    import yaml

    return yaml.safe_load((ROOT / "configs" / name).read_text())


@pytest.mark.parametrize("name", ["local.yaml", "baseline-local.yaml", "test.yaml"])
def test_embedded_configs_set_every_model_dependent_key(name):
    """A change of the defaults never changes what the embedded configs run: they set each
    of these keys themselves."""
    data = _yaml(name)
    missing = [key for key in MODEL_DEPENDENT if key.split(".")[1] not in data.get(key.split(".")[0], {})]
    assert not missing, f"configs/{name} leaves {missing} to the defaults"


def test_defaults_are_for_a_model_a_user_brings():
    """AZR's sampling (temperature 1.0, top_p 1.0) and group of 8 rollouts, the model's own
    reply format, a LoRA rate of 10x AZR's full fine-tuning 1e-6; cluster-7b.yaml agrees."""
    from driver.config import Config

    cfg, cluster = Config(), _yaml("cluster-7b.yaml")
    want = {"tasks.temperature": 1.0, "tasks.top_p": 1.0, "tasks.constrained_format": False,
            "tasks.require_answer_close": True, "tasks.proposals_per_type": 8, "tasks.rollouts": 8, "learner.lr": 1e-5}
    for key, value in want.items():
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) == value, f"default {key}"
        assert cluster[section].get(name, value) == value, f"configs/cluster-7b.yaml {key}"


def test_config_sources_say_where_each_key_came_from(tmp_path):
    from driver.config import config_sources

    path = tmp_path / "c.yaml"
    path.write_text("model: {path: 'embedded:tiny-llama'}\nrun: {name: a, steps: 3}\n"
                    "population: {operators: {gaussian: 1.0}}\nlearner: {lr: 0.5, epochs: 2}\n")
    sources = config_sources(path, ["learner.lr=0", "population.operators.layer_swap=1", "run={name: b}"])
    assert set(sources) == set(_leaves(load_config(path).to_dict()))
    assert sources["model.path"] == "file" and sources["learner.epochs"] == "file"
    assert sources["learner.lr"] == "--set" and sources["run.name"] == "--set"
    assert sources["population.operators"] == "file + --set"  # the file's entry and one more
    assert sources["run.steps"] == "default"  # `run={...}` replaced the file's whole section
    assert sources["learner.clip_eps"] == "default" and sources["tasks.top_p"] == "default"


def _leaves(data: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in data.items():
        section = isinstance(v, dict) and k != "operators"  # a key whose value is a mapping
        out.update(_leaves(v, f"{prefix}{k}.") if section else {f"{prefix}{k}": v})
    return out


def test_check_config_explain_prints_every_key_value_and_source(capsys):
    from driver.cli import main

    config = str(ROOT / "configs/test.yaml")
    assert main(["check-config", "--config", config, "--set", "learner.lr=0", "--explain"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("#") and lines[1].split() == ["key", "value", "source"], lines[:2]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert set(rows) == set(_leaves(load_config(config).to_dict())), "one line per key"
    assert rows["learner.lr"].split()[1:] == ["0.0", "--set"]
    assert rows["tasks.top_p"].split()[1:] == ["0.95", "file"]
    assert rows["learner.epochs"].split()[1:] == ["1", "default"]
    assert rows["tasks.types"].split(None, 1)[1].rsplit(None, 1) == ["[code_i, code_o, code_f]", "default"]


def test_cluster_model_path_is_checked_where_the_actors_run(tiny_model_path):
    """On a cluster the driver's node (the head) need not hold the model: the config accepts
    a path absent here, and the actors that load it check it on their own node."""
    cfg = load_config(ROOT / "configs/cluster-7b.yaml", ["model.path=/models/only-on-the-gpu-nodes"])
    assert cfg.model.path == "/models/only-on-the-gpu-nodes"
    with pytest.raises(ConfigError, match="model.path: '/models/x' is not a directory"):
        load_config(ROOT / "configs/test.yaml", ["model.path=/models/x"])  # local: checked here
    with pytest.raises(ConfigError, match="model.path: unknown embedded model"):
        load_config(ROOT / "configs/cluster-7b.yaml", ["model.path=embedded:nope"])


def test_model_dir_error_names_the_node(tmp_path):
    import socket

    from driver.session import model_dir_error
    from multilora.model import ModelDirError, check_model_dir

    with pytest.raises(ModelDirError, match=f"is not a directory on node {socket.gethostname()}"):
        check_model_dir(tmp_path / "absent")
    with pytest.raises(ModelDirError, match="has no config.json on node"):
        check_model_dir(tmp_path)
    actor_failure = ("The actor died because of an error raised in its creation task, ...\n"
                     "  File \"actors/learner.py\", line 137, in __init__\n"
                     f"multilora.model.ModelDirError: model.path: '/m' is not a directory on node gpu-1\n")
    assert model_dir_error(actor_failure) == "model.path: '/m' is not a directory on node gpu-1"
    assert model_dir_error("RayActorError: the actor died unexpectedly") is None


def test_the_learner_config_is_the_trainers_settings():
    """The learner's keys take their defaults from `TrainerSettings` and hand all of them on."""
    from driver.session import trainer_settings
    from multilora.settings import TrainerSettings

    cfg = load_config(ROOT / "configs/test.yaml", ["learner.lr=0.003", "learner.is_cap=1.5"])
    assert trainer_settings(cfg) == TrainerSettings(**{**TrainerSettings().__dict__, "lr": 0.003, "is_cap": 1.5,
                                                        "micro_batch": cfg.learner.micro_batch})
    from driver.config import LearnerConfig

    assert TrainerSettings.of(LearnerConfig()) == TrainerSettings()


def test_the_deepspeed_strategy_takes_the_torch_strategys_loss_settings():
    # both strategies run one loss loop (multilora.trainer.policy_passes): epochs and the KL anchor included
    cfg = load_config(ROOT / "configs/test.yaml",
                      ["learner.strategy=deepspeed", "learner.teacher_kl_coef=0.2", "learner.epochs=2"])
    assert cfg.learner.epochs == 2 and cfg.learner.teacher_kl_coef == 0.2
