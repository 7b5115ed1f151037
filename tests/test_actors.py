"""The learner and inference server as Ray actors: adapter sync through the object store."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from actors.inference import InferenceServer
from actors.learner import Learner
from multilora.generation import SamplingParams
from multilora.model import LoraSpec
from multilora.trainer import TrainerSettings, TrainSample

ROOT = Path(__file__).resolve().parents[1]
SPEC = LoraSpec(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj", "down_proj"))


def test_update_reaches_the_inference_server_through_the_object_store(ray_session, tiny_model_path):
    members = ["teacher-0", "student-0"]
    learner = Learner.options(num_cpus=0).remote(tiny_model_path, SPEC, 2, TrainerSettings(lr=5e-2))
    server = InferenceServer.options(num_cpus=0).remote("hf", tiny_model_path, SPEC, 2)
    ray.get(learner.init_members.remote(members, seed=0))
    ray.get(server.sync_adapters.remote(learner.export_adapters.remote()))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompts = ["def f(x):", "def f(x):"]
    before = ray.get(server.generate.remote(members, prompts, [greedy] * 2))

    # a rewarded and a punished completion for student-0 only
    completion = before[1].completions[0].token_ids
    samples = [TrainSample("student-0", before[1].prompt_ids, completion, 1.0),
               TrainSample("student-0", before[1].prompt_ids, completion[:4], -1.0)]
    stats = ray.get(learner.update.remote(samples))
    assert set(stats) == {"student-0"} and stats["student-0"]["grad_norm"] > 0
    ray.get(server.sync_adapters.remote(learner.export_adapters.remote()))
    after = ray.get(server.generate.remote(members, prompts, [greedy] * 2))

    assert after[0].completions[0].token_ids == before[0].completions[0].token_ids, "teacher-0 must not change"
    assert after[1].completions[0].token_ids != before[1].completions[0].token_ids, "student-0 should change"
    for handle in (learner, server):
        ray.kill(handle)


def test_actors_check_the_model_where_they_run(ray_session, tmp_path):
    """A cluster config passes the driver's check with a model path the driver's node lacks;
    the actors that load it stop the run with one line naming their node."""
    import socket

    from driver.config import ConfigError, load_config
    from driver.session import create_actors

    cfg = load_config(ROOT / "configs/test.yaml", [f"model.path={tmp_path / 'absent'}", "ray.address=auto",
                                                   f"run.output_dir={tmp_path}"])
    with pytest.raises(ConfigError) as err:
        create_actors(cfg)
    assert str(err.value) == f"model.path: '{tmp_path / 'absent'}' is not a directory on node {socket.gethostname()}"
