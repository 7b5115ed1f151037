"""Selection bias against newborn children, with random game outcomes.

    python -m bench.selection [--quick]

A child starts with its sigma reset (`population.child_sigma`), so its conservative score
`mu - 3 sigma` sits below the veterans' whatever its skill. With outcomes that carry no
skill at all (every game a fair coin), replacement should pick any member of a role
alike: the previous child is then the one replaced with probability 1 / members (25 % at
4 per role, 50 % at 2). This simulation plays `evolution.population.Population` with
fair-coin games (PFSP matching, one game per proposal, `games` proposals per teacher per
step, as configs/local.yaml and configs/cluster-7b.yaml give them, and with one game per step)
and counts how often the member replaced at an evolution step is the child born at
the previous one, for `population.min_games` = 0 (no protection) and the protected
settings. Reference in the same run: chance, 1 / members. Prints a table, then one JSON
line, also written to ``bench/results/selection.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import yaml

from bench import write_result
from evolution.population import Population

ROOT = Path(__file__).resolve().parents[1]


def config_setting(name: str) -> tuple[int, int, int]:
    """(members per role, evolve every K steps, games per teacher per step) of a config file:
    one game per proposal, `proposals_per_type` of each task type."""
    cfg = yaml.safe_load((ROOT / "configs" / name).read_text())
    p, t = cfg["population"], cfg["tasks"]
    return p["teachers"], p["evolve_every"], len(t["types"]) * t["proposals_per_type"]


def settings() -> dict[str, tuple[int, int, int]]:
    local, cluster = config_setting("local.yaml"), config_setting("cluster-7b.yaml")
    return {"local.yaml": local, "cluster-7b.yaml": cluster,
            "local_1game": (*local[:2], 1), "cluster_1game": (*cluster[:2], 1)}


def previous_child_replaced(members: int, every: int, games: int, min_games: int, steps: int,
                            seed: int) -> tuple[int, int, int]:
    """(evolution steps, replacements, replacements of the child born at the previous one),
    summed over both roles."""
    pop = Population("population", members, members, seed=seed, operators={"gaussian": 1.0},
                     min_games=min_games)
    rng = np.random.default_rng(seed + 1)
    last_child: dict[str, str] = {}
    evolutions = replaced = previous = 0
    for step in range(1, steps + 1):
        matches = pop.match()
        pop.record([(t, s, float(rng.integers(2))) for t, s in matches.items() for _ in range(games)])
        if step % every:
            continue
        evolutions += 2
        for e in pop.plan_replacements(step):
            replaced += 1
            previous += last_child.get(e.role) == e.dead
            last_child[e.role] = e.child
    return evolutions, replaced, previous


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 seeds x 100 steps (default 5 x 400)")
    parser.add_argument("--min-games", type=int, nargs="+", default=[0, 100],
                        help="population.min_games values to compare (0: no protection)")
    parser.add_argument("--smoke", action="store_true", help="1 seed x 20 steps (tests: the bench still works)")
    args = parser.parse_args()
    seeds, steps = (1, 20) if args.smoke else (2, 100) if args.quick else (5, 400)
    result: dict = {"seeds": seeds, "steps": steps, "settings": {}, "smoke": args.smoke}
    print(f"fair-coin games, {seeds} seeds x {steps} steps; 'previous child' = share of replacements that "
          "removed the child born at the previous evolution step")
    print(f"{'setting':>15} {'min_games':>9} {'previous child':>15} {'chance':>7} {'replacements':>13}")
    for name, (members, every, games) in settings().items():
        rows = {}
        for min_games in args.min_games:
            totals = np.sum([previous_child_replaced(members, every, games, min_games, steps, seed)
                             for seed in range(seeds)], axis=0)
            evolutions, replaced, previous = (int(x) for x in totals)
            share = previous / replaced if replaced else None
            rows[str(min_games)] = {"previous_child_share": share, "replacements": replaced,
                                    "evolution_slots": evolutions}
            print(f"{name:>15} {min_games:>9} {share if share is not None else float('nan'):>15.3f} "
                  f"{1 / members:>7.3f} {replaced:>6}/{evolutions:<6}")
        result["settings"][name] = {"members_per_role": members, "evolve_every": every,
                                    "games_per_teacher_step": games, "chance": 1 / members, "min_games": rows}
    write_result("selection", result)


if __name__ == "__main__":
    main()
