"""Every class that generates for the population satisfies `multilora.sampling.Engine`:
the loop, the probes and the evaluation call any of them the same way."""

from __future__ import annotations

import inspect

import pytest

from multilora.sampling import Engine


def _classes():
    from actors.inference import HFEngine, InferenceServer
    from driver.fleet import Replicas
    from driver.session import Actors
    from evaluation.server import ServerEngine
    from multilora.vllm_engine import VLLMEngine  # vllm itself is imported only when one is built

    return {"HFEngine": HFEngine, "VLLMEngine": VLLMEngine, "InferenceServer": InferenceServer.__ray_actor_class__,
            "Replicas": Replicas, "Actors": Actors, "ServerEngine": ServerEngine}


@pytest.mark.parametrize("name", sorted(_classes()))
def test_every_generator_is_an_engine(name):
    cls = _classes()[name]
    assert issubclass(cls, Engine), name
    want = inspect.signature(Engine.generate)
    got = inspect.signature(cls.generate)
    names = [n for n in got.parameters if n != "_ray_trace_ctx"]  # Ray adds it to an actor's methods
    assert names == list(want.parameters), (name, got)
    assert got.parameters["prefixes"].default is None, name
