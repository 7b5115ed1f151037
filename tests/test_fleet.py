"""Replicas and shards (driver/fleet.py): the routing and sharding rules without Ray, a
member's update on a learner shard against one learner, and the groups with real actors
(a replica that dies mid-run, a whole run with two replicas and two shards)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from driver.fleet import (assign_shards, gather_states, merge_stats, request_load, route, scatter_state,
                          split_by_shard)
from multilora.model import LoraSpec
from multilora.sampling import SamplingParams
from multilora.trainer import TrainerSettings, TrainSample

SPEC = LoraSpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))


# ---- routing ---------------------------------------------------------------------------
def test_one_replica_takes_everything():
    assert route(["a", "b", "a"], [1, 1, 1], 1) == [0, 0, 0]
    assert route([], [], 3) == []


def test_balanced_adapters_stay_whole_on_one_replica():
    adapters = ["t0"] * 6 + ["t1"] * 6
    routes = route(adapters, [10] * 12, 2)
    assert len(set(routes[:6])) == 1 and len(set(routes[6:])) == 1 and routes[0] != routes[6]


def test_a_heavy_adapter_is_split_and_loads_even_out():
    adapters = ["a"] * 10 + ["b"] * 2
    routes = route(adapters, [1] * 12, 2)
    per_replica = sorted(routes.count(r) for r in (0, 1))
    assert per_replica == [5, 7]  # a in halves of 5, b beside one of them (whole: 10 against 2)
    # the split is contiguous: each half of a's prompts is decoded together
    assert routes[:10] == sorted(routes[:10]) or routes[:10] == sorted(routes[:10], reverse=True)
    # one adapter, two replicas: split in two
    assert sorted(route(["a"] * 4, [1] * 4, 2)) == [0, 0, 1, 1]


def test_routes_are_deterministic_and_weighted_by_decode_length():
    adapters = ["a", "b", "c", "d", "a", "b"]
    loads = [request_load(SamplingParams(max_new_tokens=m, n=n)) for m, n in
             [(64, 1), (64, 8), (32, 1), (32, 1), (64, 1), (64, 8)]]
    assert route(adapters, loads, 3) == route(adapters, loads, 3)
    routes = route(adapters, loads, 3)
    # b (8 rollouts per request) is the heaviest: it is split, and its halves take replicas of their own
    assert routes[1] != routes[5]
    assert loads[1] == 8 * 64


# ---- shards ----------------------------------------------------------------------------
def test_shards_take_both_roles_round_robin():
    members = ["teacher-0", "teacher-1", "student-0", "student-1"]
    shard_of = assign_shards(members, 2)
    assert shard_of == {"teacher-0": 0, "teacher-1": 1, "student-0": 0, "student-1": 1}
    items = [("student-1", 0), ("teacher-0", 1), ("student-1", 2), ("student-0", 3)]
    parts = split_by_shard(items, lambda x: x[0], shard_of, 2)
    assert parts == [[("teacher-0", 1), ("student-0", 3)], [("student-1", 0), ("student-1", 2)]]
    assert merge_stats([{"a": {"loss": 1.0}}, {"b": {"loss": 2.0}}]) == {"a": {"loss": 1.0}, "b": {"loss": 2.0}}
    with pytest.raises(ValueError):
        assign_shards(members, 0)


def test_states_gather_and_scatter_back():
    shard_of = {"a": 0, "c": 0, "b": 1}
    states = [{"version": 3, "adapters": {"a": 1, "c": 3}, "optimizers": {"a": "oa", "c": "oc"}},
              {"version": 3, "adapters": {"b": 2}, "optimizers": {"b": "ob"}}]
    gathered = gather_states(states, shard_of)
    assert list(gathered["adapters"]) == ["a", "c", "b"] and gathered["shard_of"] == shard_of
    parts, back = scatter_state(gathered, 2)
    assert back == shard_of and parts == states
    # a one-learner checkpoint (no shard map) onto two shards: round robin in its order
    single = {"version": 1, "adapters": {"a": 1, "b": 2, "c": 3}, "optimizers": {}}
    parts, back = scatter_state(single, 2)
    assert back == {"a": 0, "b": 1, "c": 0} and parts[1]["adapters"] == {"b": 2}
    with pytest.raises(RuntimeError, match="version"):
        gather_states([{**states[0], "version": 2}, states[1]], shard_of)


def _samples(names: list[str], rng: np.random.Generator, version: int) -> list[TrainSample]:
    rows = []
    for _ in range(3):
        for name in names:
            prompt = tuple(int(x) for x in rng.integers(5, 200, rng.integers(4, 12)))
            for _ in range(2):  # two rollouts of one prompt (they share its forward)
                completion = tuple(int(x) for x in rng.integers(5, 200, rng.integers(3, 9)))
                rows.append(TrainSample(name, prompt, completion, float(rng.normal()), version=version))
    return rows


def test_a_members_update_on_its_shard_equals_one_learners(tiny_model_path):
    """Two shards of two members each against one learner of four, same samples in the
    same order, two updates and an evolution child whose parents live on both shards.

    Tolerance: the shard's micro-batches hold other rows than one learner's (the rows of
    the members it owns only), so the forward pads to other lengths and sums in another
    order: fp32 rounding, ~1e-7 relative per op. AdamW's first steps move each weight by
    about lr whatever the gradient's size, so a rounding difference in a gradient moves
    the weight by far less than lr; 1e-6 absolute (lr 1e-3: a thousandth of a step)
    catches any real difference (a wrong sample set, a skipped step, a mixed-up member)."""
    from actors.learner import LearnerCore

    names = ["teacher-0", "teacher-1", "student-0", "student-1"]
    settings = TrainerSettings(lr=1e-3, micro_batch=4)
    one = LearnerCore(tiny_model_path, SPEC, 4, settings, dtype="float32")
    one.init_members(names, seed=7)
    shard_of = assign_shards(names, 2)
    shards = []
    for k in range(2):
        core = LearnerCore(tiny_model_path, SPEC, 2, settings, dtype="float32")
        core.init_members([n for n in names if shard_of[n] == k], 7, [i for i, n in enumerate(names) if shard_of[n] == k])
        shards.append(core)
    start = {**shards[0].export_adapters(), **shards[1].export_adapters()}
    for n, state in one.export_adapters().items():  # the same seeds: identical to the bit
        assert all(torch.equal(state[key], start[n][key]) for key in state)
    rng = np.random.default_rng(0)
    for _ in range(2):
        samples = _samples(names, rng, one.version)
        stats_one = one.update(samples)
        stats_sharded = merge_stats([core.update(part) for core, part in
                                     zip(shards, split_by_shard(samples, lambda s: s.adapter, shard_of, 2))])
        assert set(stats_one) == set(stats_sharded)
        for n in names:
            assert stats_sharded[n]["stepped"] == 1.0
            assert stats_sharded[n]["grad_norm"] == pytest.approx(stats_one[n]["grad_norm"], rel=1e-5)
    # a child on shard 0 from a parent there and one on shard 1 (tensors handed over)
    one.spawn_child("teacher-0", "teacher-9", ["student-0", "teacher-1"], "layer_swap", {"p": 0.5}, 11)
    shards[0].spawn_child("teacher-0", "teacher-9", ["student-0", "teacher-1"], "layer_swap", {"p": 0.5}, 11,
                          shards[1].export_adapters(["teacher-1"]))
    ref = one.export_adapters()
    got = {**shards[0].export_adapters(), **shards[1].export_adapters()}
    assert set(ref) == set(got) == {"teacher-9", "teacher-1", "student-0", "student-1"}
    worst = max(float((ref[n][k] - got[n][k]).abs().max()) for n in ref for k in ref[n])
    print(f"largest difference to one learner: {worst:.2e}")  # seen with -s
    assert worst < 1e-6, f"a sharded member's weights differ from one learner's by {worst:.2e}"
    moved = max(float((ref[n][k] - start[n][k]).abs().max()) for n in ref if n in start for k in ref[n])
    assert moved > 1e-4, "the updates moved nothing: the comparison would mean nothing"


# ---- the groups on real actors -----------------------------------------------------------
SCALED = ["inference.replicas=2", "learner.shards=2", "population.evolve_every=2", "run.checkpoint_every=2"]


def _cfg(tmp_path, name: str, steps: int, *extra: str):
    from pathlib import Path

    from driver.config import load_config

    root = Path(__file__).resolve().parents[1]
    return load_config(root / "configs/test.yaml",
                       [f"run.output_dir={tmp_path}", f"run.name={name}", f"run.steps={steps}", *SCALED, *extra])


def _adapters(run) -> dict:
    from multilora.peft_io import load_adapter

    return {p.name: load_adapter(p)[0] for p in sorted((run / "adapters").iterdir())}


@pytest.fixture(scope="module")
def scaled_run(ray_session, tiny_model_path, tmp_path_factory, synthetic_signal):
    from driver.loop import train

    seen = {}

    def look(step, ctx):
        seen[step] = (len(ctx.actors.inference.handles), dict(ctx.actors.learner.shard_of))

    return train(_cfg(tmp_path_factory.mktemp("scaled"), "scaled", 4), on_step=look), seen


def test_two_replicas_and_two_shards_run_evolve_and_resume_bit_exact(scaled_run, tmp_path, synthetic_signal):
    """Four steps with evolution at 2 and 4 (children whose parents may live on the other
    shard); stopped at 2 and resumed, the run lands on the same adapters, bit for bit."""
    import pyarrow.parquet as pq

    from driver.loop import train

    full, seen = scaled_run
    assert all(replicas == 2 for replicas, _ in seen.values())
    shard_of = seen[4][1]
    assert sorted(shard_of.values()) == [0, 0, 1, 1]  # children stayed on their dead member's shard
    lineage = pq.read_table(full / "lineage.parquet").to_pylist()
    assert lineage and all(row["child"] in shard_of or row["step"] < 4 for row in lineage)
    metrics = pq.read_table(full / "metrics.parquet").to_pylist()
    assert any((m["learner/update_norm"] or 0) > 0 for m in metrics), "no adapter moved"
    first = train(_cfg(tmp_path, "split", 2))
    resumed = _adapters(train(_cfg(tmp_path, "split", 4), resume=first))
    expected = _adapters(full)
    assert sorted(resumed) == sorted(expected)
    for member, state in expected.items():
        for key, value in state.items():
            assert torch.equal(value, resumed[member][key]), f"{member} {key} differs after resume"


def test_a_dead_replica_is_replaced_and_its_requests_run_on_the_other(ray_session, tiny_model_path, tmp_path,
                                                                      synthetic_signal):
    import ray

    from driver.loop import train

    events = []

    def kill_replica(step, ctx):
        replicas = ctx.actors.inference
        if step == 1:
            events.append(("before", list(replicas.incarnations)))
            ray.kill(replicas.handles[0], no_restart=True)  # dead for good; the next call finds out
        if step == 2:
            events.append(("after", list(replicas.incarnations), replicas.replaced))

    run = train(_cfg(tmp_path, "replica-dies", 2), on_step=kill_replica)
    (_, before), (_, after, replaced) = events
    assert replaced == 1 and after[0] != before[0] and after[1] == before[1]  # only the dead one is new
    import pyarrow.parquet as pq

    rows = pq.read_table(run / "tasks.parquet").to_pylist()
    metrics = pq.read_table(run / "metrics.parquet").to_pylist()
    # step 2's proposals all came back (none lost, none twice): 4 members' rows, every teacher's proposals
    assert {m["step"] for m in metrics} == {1, 2}
    step2 = [r for r in rows if r["step"] == 2]
    assert len(step2) == len([r for r in rows if r["step"] == 1])
