"""The heavy actors of one run past one engine: R inference replicas, M learner shards.

A population parallelises without a gradient all-reduce: given its samples, an adapter's
update depends on nothing but its own tensors. So the learner is split by adapter
(`learner.shards`: each shard owns a fixed subset of the members and its own frozen base),
and generation by request (`inference.replicas`: each replica is a whole engine holding
every adapter, which is small beside the base).

The routing and sharding rules are plain functions (`route`, `assign_shards`,
`split_by_shard`, `merge_stats`, `gather_states`, `scatter_state`), tested without Ray;
`Replicas` and `Shards` are the driver-side groups the training loop calls as it called
one actor, each a thin loop over Ray handles.

Adapters reach the replicas as one `AdapterBundle` object per shard in the object store:
one put per shard, every replica reads the same objects (never a copy per replica through
the driver). A replica's adapters change only in `sync`, which the driver calls between
generation calls, never during one, so every row of a call samples from one version.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError

from multilora.sampling import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


# ---- routing and sharding rules (no Ray) -----------------------------------------------
def request_load(params: SamplingParams) -> int:
    """What a request costs a replica, roughly: the tokens it may decode (`n` rows of
    `max_new_tokens`); prefill is small beside decoding at these lengths."""
    return max(1, params.n) * max(1, params.max_new_tokens)


def route(adapters: Sequence[str], loads: Sequence[int], replicas: int) -> list[int]:
    """The replica of each request (same order as `adapters`).

    Affinity first: every request of one adapter goes to one replica, so a teacher's
    prompts that share a prefilled head are decoded together. Balance second: while the
    heaviest adapter's requests weigh more than a fair share (total / replicas), they are
    split in two contiguous halves, each still one unit; then units go, heaviest first, to
    the least loaded replica (longest-processing-time rule). Ties break by first request
    index and replica index, so the same requests always take the same routes.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if replicas == 1 or not adapters:
        return [0] * len(adapters)
    units: dict[str, list[int]] = {}
    for i, a in enumerate(adapters):
        units.setdefault(a, []).append(i)
    parts = list(units.values())
    fair = sum(loads) / replicas

    def weight(unit: list[int]) -> int:
        return sum(loads[i] for i in unit)

    while True:
        splittable = [u for u in parts if len(u) > 1 and weight(u) > fair]
        if not splittable:
            break
        heaviest = max(splittable, key=lambda u: (weight(u), -u[0]))
        parts.remove(heaviest)
        half = len(heaviest) // 2
        parts += [heaviest[:half], heaviest[half:]]
    totals = [0] * replicas
    out = [0] * len(adapters)
    for unit in sorted(parts, key=lambda u: (-weight(u), u[0])):
        r = min(range(replicas), key=lambda k: (totals[k], k))
        totals[r] += weight(unit)
        for i in unit:
            out[i] = r
    return out


def assign_shards(members: Sequence[str], shards: int) -> dict[str, int]:
    """The shard of each member: round robin in population order (teachers, then
    students), so each shard holds an even share of both roles. Fixed for the run: a
    child of evolution takes the shard of the member it replaces."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    return {m: i % shards for i, m in enumerate(members)}


def split_by_shard(items: Sequence[Any], adapter_of: Callable[[Any], str], shard_of: dict[str, int],
                   shards: int) -> list[list[Any]]:
    """`items` split per shard by their adapter, each part in the original order (a
    member's samples reach its shard in the order one learner would have seen them)."""
    out: list[list[Any]] = [[] for _ in range(shards)]
    for item in items:
        out[shard_of[adapter_of(item)]].append(item)
    return out


def merge_stats(parts: Sequence[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per-adapter update stats of every shard as one mapping (each adapter lives on one)."""
    out: dict[str, dict[str, float]] = {}
    for part in parts:
        out.update(part)
    return out


def gather_states(states: Sequence[dict], shard_of: dict[str, int]) -> dict:
    """The shards' `LearnerCore.state_dict`s as one learner's: adapters in shard, then slot
    order (one shard: exactly its own), their optimizers, and `shard_of`."""
    versions = {s["version"] for s in states}
    if len(versions) > 1:
        raise RuntimeError(f"learner shards disagree on the version: {sorted(versions)}")
    adapters, optimizers = {}, {}
    for s in states:
        adapters.update(s["adapters"])
        optimizers.update(s["optimizers"])
    return {"version": versions.pop(), "adapters": adapters, "optimizers": optimizers,
            "shard_of": {n: shard_of[n] for n in adapters}}


def scatter_state(state: dict, shards: int) -> tuple[list[dict], dict[str, int]]:
    """One learner's state split into `shards` states, and the member -> shard map. The
    saved `shard_of` is kept when it fits `shards`; otherwise (a checkpoint of another
    shard count, or of a single learner) members go round robin in their saved order."""
    names = list(state["adapters"])
    saved = state.get("shard_of") or {}
    shard_of = ({n: saved[n] for n in names}
                if set(saved) >= set(names) and all(0 <= saved[n] < shards for n in names)
                else assign_shards(names, shards))
    parts = [{"version": state.get("version", 0), "adapters": {}, "optimizers": {}} for _ in range(shards)]
    for n in names:
        part = parts[shard_of[n]]
        part["adapters"][n] = state["adapters"][n]
        if n in state.get("optimizers", {}):
            part["optimizers"][n] = state["optimizers"][n]
    return parts, shard_of


# ---- the groups the loop calls -----------------------------------------------------------
class Replicas:
    """R inference servers behind one `generate`: requests routed by `route`, results in
    request order. A replica that dies during a call is replaced (a new actor, synced to
    the current adapters) and its requests run again on the others, each exactly once;
    with one replica the error goes up to the run's recovery (every actor recreated, the
    last checkpoint restored)."""

    def __init__(self, make: Callable[[int], ray.actor.ActorHandle], count: int) -> None:
        self.make = make  # make(i): a new replica i (its seed, threads and placement bundle)
        self.handles = [make(i) for i in range(count)]
        self.incarnations: list[str] = []
        self.version: int | None = None  # the adapters' version every replica holds
        self.packed: list[ray.ObjectRef] = []  # the objects of the last sync (a replacement reads them)
        self.replaced = 0  # replicas replaced after a failure, over the run

    def ready(self) -> list[str]:
        self.incarnations = ray.get([h.ready.remote() for h in self.handles])
        return self.incarnations

    def sync(self, packed: Sequence[ray.ObjectRef], version: int) -> None:
        """Every replica serves exactly the adapters in `packed` (one object per learner
        shard), version `version`; returns when all hold them."""
        self.packed, self.version = list(packed), version
        refs = [h.sync_bundle.remote(*self.packed) for h in self.handles]
        for r, ref in enumerate(refs):
            try:
                ray.get(ref)
            except RayActorError:
                if len(self.handles) == 1:  # one replica: the run's recovery takes over
                    raise
                log.warning("inference replica %d died during a sync; replacing it", r)
                self.replace(r)

    def generate(self, adapters: list[str], prompts: list[str], params: list[SamplingParams],
                 prefixes: list[str] | None = None) -> list[RequestOutput]:
        prefixes = prefixes if prefixes is not None else [""] * len(prompts)
        live = list(range(len(self.handles)))
        out: list[RequestOutput | None] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        error: RayActorError | None = None
        while todo:
            routes = route([adapters[i] for i in todo], [request_load(params[i]) for i in todo], len(live))
            calls = []
            for slot, r in enumerate(live):
                idx = [i for i, k in zip(todo, routes) if k == slot]
                if idx:
                    calls.append((r, idx, self.handles[r].generate.remote(
                        [adapters[i] for i in idx], [prompts[i] for i in idx], [params[i] for i in idx],
                        [prefixes[i] for i in idx])))
            failed: list[int] = []
            for r, idx, ref in calls:
                try:
                    results = ray.get(ref)
                except RayActorError as e:
                    error = e
                    log.warning("inference replica %d died during a call; its %d requests go to the others",
                                r, len(idx))
                    failed.append(r)
                    continue
                for i, result in zip(idx, results):
                    out[i] = result
            todo = [i for i in todo if out[i] is None]
            if failed:
                live = [r for r in live if r not in failed]
                if not live:  # nothing left to retry on: the run's recovery takes over
                    raise error
                for r in failed:
                    self.replace(r)
        return out  # type: ignore[return-value]

    def replace(self, r: int) -> None:
        """A new replica `r` in place of a dead one, serving the current adapters."""
        try:
            ray.kill(self.handles[r], no_restart=True)
        except Exception:  # already gone
            pass
        handle = self.make(r)
        self.incarnations[r] = ray.get(handle.ready.remote())
        if self.packed:
            ray.get(handle.sync_bundle.remote(*self.packed))
        self.handles[r] = handle
        self.replaced += 1

    def state_dict(self) -> list[dict]:
        """Each replica's sampling RNG, in replica order."""
        return ray.get([h.state_dict.remote() for h in self.handles])

    def load_state_dict(self, states: list[dict] | dict) -> None:
        """Replica i takes state i (a single state, as one server saved it, is replica 0's;
        replicas a checkpoint did not hold keep their fresh seeds)."""
        states = [states] if isinstance(states, dict) else list(states)
        ray.get([h.load_state_dict.remote(s) for h, s in zip(self.handles, states)])

    def kill(self) -> None:
        for h in self.handles:
            ray.kill(h, no_restart=True)


class Shards:
    """M learners, each owning the members `shard_of` gives it (adapter parallel: no
    gradient is exchanged). A step's samples are split by member; every shard updates
    once per step (an empty share too), so the versions stay equal."""

    def __init__(self, handles: list[ray.actor.ActorHandle], shard_of: dict[str, int]) -> None:
        self.handles = handles
        self.shard_of = dict(shard_of)
        self.incarnations: list[str] = []

    def ready(self) -> list[str]:
        self.incarnations = ray.get([h.ready.remote() for h in self.handles])
        return self.incarnations

    def members_of(self, k: int) -> list[str]:
        return [n for n, s in self.shard_of.items() if s == k]

    def init_members(self, names: list[str], seed: int) -> None:
        """Fresh adapters, each seeded by its place in `names` (as one learner seeds them)."""
        place = {n: i for i, n in enumerate(names)}
        ray.get([h.init_members.remote([n for n in names if self.shard_of[n] == k], seed,
                                       [place[n] for n in names if self.shard_of[n] == k])
                 for k, h in enumerate(self.handles)])

    def update(self, samples: list, max_staleness: int) -> list[ray.ObjectRef]:
        """Submit every shard's update (not awaited): `ray.get` the refs, then `merge_stats`."""
        parts = split_by_shard(samples, lambda s: s.adapter, self.shard_of, len(self.handles))
        return [h.update.remote(part, max_staleness) for h, part in zip(self.handles, parts)]

    def export_bundle(self) -> list[ray.ObjectRef]:
        """One packed object per shard, for `Replicas.sync`."""
        return [h.export_bundle.remote() for h in self.handles]

    def export_adapters(self) -> dict:
        merged = {}
        for part in ray.get([h.export_adapters.remote() for h in self.handles]):
            merged.update(part)
        return dict(sorted(merged.items()))

    def spawn_child(self, dead: str, child: str, parents: list[str], operator: str, params: dict,
                    seed: int) -> None:
        """The child lives where `dead` lived; parents on other shards reach it through
        the object store (their tensors exported there, read by the child's shard)."""
        k = self.shard_of[dead]
        remote_parents = {p: self.handles[self.shard_of[p]].export_adapters.remote([p])
                          for p in parents if self.shard_of[p] != k}
        ray.get(self.handles[k].spawn_child.remote(dead, child, parents, operator, params, seed,
                                                   *remote_parents.values()))
        del self.shard_of[dead]
        self.shard_of[child] = k

    def state_dict(self) -> dict:
        return gather_states(ray.get([h.state_dict.remote() for h in self.handles]), self.shard_of)

    def load_state_dict(self, state: dict) -> None:
        parts, self.shard_of = scatter_state(state, len(self.handles))
        ray.get([h.load_state_dict.remote(p) for h, p in zip(self.handles, parts)])

    def kill(self) -> None:
        for h in self.handles:
            ray.kill(h, no_restart=True)


class Population:
    """The driver's side of the PopulationManager actor: its calls, awaited, so the loop
    reads as plain calls (`handle` is the actor, for liveness checks and shutdown)."""

    def __init__(self, handle: ray.actor.ActorHandle) -> None:
        self.handle = handle

    def ready(self) -> str:
        return ray.get(self.handle.ready.remote())

    def members(self) -> dict[str, list[str]]:
        return ray.get(self.handle.members.remote())

    def match(self) -> dict[str, str]:
        return ray.get(self.handle.match.remote())

    def record(self, games: list[tuple[str, str, float | None]]) -> None:
        ray.get(self.handle.record.remote(games))

    def ratings(self) -> dict[str, dict[str, float]]:
        return ray.get(self.handle.ratings.remote())

    def plan_replacements(self, step: int) -> list:
        return ray.get(self.handle.plan_replacements.remote(step))

    def state_dict(self) -> dict:
        return ray.get(self.handle.state_dict.remote())

    def load_state_dict(self, state: dict) -> None:
        ray.get(self.handle.load_state_dict.remote(state))
