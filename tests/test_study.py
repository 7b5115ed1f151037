"""`populora study`: the spec and its errors, the intervals, the probe set, and the smoke study
end to end with an interrupted run that resumes and a finished study that is skipped."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from reports import intervals
from driver.cli import main as cli
from driver.config import load_config
from reports.study import train_command
from reports.study_spec import StudyError, check_study, parse_spec, runs_of

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "studies" / "smoke.yaml"


def _spec(tmp_path: Path, **changes) -> Path:
    data = yaml.safe_load(SMOKE.read_text())
    data["config"] = str(ROOT / "configs" / "test.yaml")
    if "arms" in changes:
        data.pop("baseline")  # the smoke spec's baseline arm is gone
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# ---- the spec ----------------------------------------------------------------------------
def test_local_spec_is_the_papers_comparison(tmp_path):
    # the spec, not its record: a record trained under other rules is refused by check_study
    study = dataclasses.replace(parse_spec(ROOT / "studies" / "local.yaml"), out=tmp_path)
    configs = check_study(study)
    assert [a.name for a in study.arms] == ["1T1S", "2T2S", "4T4S", "baseline", "no-learning", "no-evolution",
                                            "overlapped", "no-repeat-penalty"]
    assert len(study.seeds) == 3 and (study.baseline, study.control) == ("baseline", "no-learning")
    cfg = configs["2T2S-s0"]
    k = cfg.population.evolve_every
    # the last third of the steps comes after two evolution events
    assert study.steps - study.steps // 3 >= 2 * k, (study.steps, k)
    assert configs["no-learning-s0"].learner.lr == 0 and configs["no-evolution-s0"].population.evolve_every == 0
    # the controls differ from 2T2S in one thing each
    assert configs["overlapped-s0"].pipeline.max_staleness == 1 and cfg.pipeline.max_staleness == 0
    # the report also gives the differences each control and the overlap are about
    assert study.compare == (("2T2S", "no-evolution"), ("overlapped", "2T2S"), ("no-repeat-penalty", "2T2S"))
    assert configs["no-repeat-penalty-s0"].tasks.repeat_penalty == 0 and cfg.tasks.repeat_penalty > 0
    assert configs["baseline-s1"].population.mode == "single" and configs["baseline-s1"].run.seed == 1
    assert (configs["4T4S-s2"].population.teachers, configs["4T4S-s2"].population.students) == (4, 4)
    # compute-matched per adapter: every arm proposes and solves as much per adapter
    tasks = {(c.tasks.proposals_per_type, c.tasks.rollouts, c.run.steps) for c in configs.values()}
    assert len(tasks) == 1, tasks


def test_cluster_spec_is_valid_where_its_model_exists(tiny_model_path):
    study = parse_spec(ROOT / "studies" / "cluster-7b.yaml")
    assert [a.name for a in study.arms] == ["1T1S", "4T4S", "8T8S", "baseline", "no-learning", "no-evolution",
                                            "lockstep", "no-repeat-penalty"]
    assert (study.baseline, study.control) == ("baseline", "no-learning")
    # the model directory exists only on the GPU nodes; everything else must validate here
    arms = tuple(dataclasses.replace(a, overrides=(*a.overrides, f"model.path={tiny_model_path}")) for a in study.arms)
    configs = check_study(dataclasses.replace(study, arms=arms))
    assert configs["8T8S-s0"].population.teachers == 8 and configs["8T8S-s0"].ray.address == "auto"


@pytest.mark.parametrize("changes,expected", [
    ({"stepz": 3}, "stepz: unknown key"),
    ({"steps": None}, "steps: missing"),
    ({"seeds": [0, 0]}, "seeds: expected a non-empty list of distinct integers"),
    ({"arms": {"a": {"sett": ["learner.lr=0"]}}}, "arms.a.sett: unknown key"),
    ({"arms": {"a": {"set": ["population.teachers=x"]}}}, "arms.a: population.teachers: expected int"),
    ({"arms": {"a": {"set": ["population.teacherz=3"]}}}, "arms.a: population.teacherz: unknown key"),
    ({"arms": {"a": {"config": "configs/nope.yaml"}}}, "arms.a: --config: no such file"),
    ({"arms": {"a/b": {}}}, "arms.a/b: an arm name"),
    ({"set": ["run.seed=3"]}, "set: run.seed is set by the study"),
    ({"baseline": "nope"}, "baseline: 'nope' is not an arm"),
    ({"compare": [["2T2S", "nope"]]}, "compare[0]: 'nope' is not an arm"),
    ({"compare": [["2T2S"]]}, "compare[0]: expected [arm, reference]"),
    ({"compare": [["2T2S", "2T2S"]]}, "compare[0]: an arm compared with itself"),
    ({"eval": {"limt": 3}}, "eval.limt: unknown key"),
    ({"eval": {"benchmarks": ["humaneval", "nope"]}}, "eval.benchmarks: unknown benchmark 'nope'"),
    ({"eval": {"roles": ["judge"]}}, "eval.roles:"),
])
def test_bad_spec_stops_before_any_run_with_one_line(tmp_path, capsys, changes, expected):
    spec = _spec(tmp_path, **changes)
    assert cli(["study", str(spec), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"populora study: {expected}"), err
    assert not (tmp_path / "out").exists(), "a run started before the spec was checked"


def test_arms_picks_the_runs_of_this_time(tmp_path, capsys):
    spec = str(_spec(tmp_path))
    assert cli(["study", spec, "--out", str(tmp_path / "out"), "--arms", "baseline", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [x.strip() for x in lines[1:]] == ["baseline-s0: new"], lines
    assert cli(["study", spec, "--out", str(tmp_path / "out"), "--arms", "baseline,nope"]) == 2
    assert capsys.readouterr().err.strip() == "populora study: --arms: 'nope' is not an arm (arms: 2T2S, baseline)"


def test_bad_spec_exits_2_from_the_command_line(tmp_path):
    spec = _spec(tmp_path, arms={"a": {"sett": []}})
    proc = subprocess.run([sys.executable, "-m", "driver", "study", str(spec)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "populora study: arms.a.sett: unknown key (known: config, set, description)"), proc.stderr


def test_a_run_trained_under_another_config_is_refused(tmp_path):
    study = parse_spec(_spec(tmp_path), tmp_path / "out")
    run = runs_of(study)[0]
    old = load_config(run.config, [*run.overrides, "learner.lr=0.5"])
    run.path.mkdir(parents=True)
    (run.path / "config.yaml").write_text(yaml.safe_dump(old.to_dict()))
    with pytest.raises(StudyError, match=r"^arms\.2T2S: .* was trained with learner\.lr=0\.5"):
        check_study(study)


# ---- intervals ---------------------------------------------------------------------------
def test_equal_seeds_give_a_zero_width_interval():
    e = intervals.bootstrap_mean([0.25, 0.25, 0.25])
    assert (e.value, e.low, e.high, e.n) == (0.25, 0.25, 0.25, 3)
    assert not intervals.bootstrap_difference([0.25, 0.25], [0.25, 0.25]).detected


def test_difference_and_its_interval_by_hand():
    # mean([1, 2, 3]) - mean([0, 0, 0]) = 2. A resample of the first arm has mean 1 only when it
    # draws 1 three times (1/27 = 3.7% of draws, more than the 2.5% tail) and mean 3 likewise:
    # the 95% interval is exactly [1, 3], and it excludes 0.
    d = intervals.bootstrap_difference([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    assert (d.value, d.low, d.high) == (2.0, 1.0, 3.0) and d.detected
    # two seeds 0 and 1: resampled means 0 (1/4), 0.5 (1/2), 1 (1/4): the interval spans [0, 1]
    e = intervals.bootstrap_mean([0.0, 1.0])
    assert (e.value, e.low, e.high) == (0.5, 0.0, 1.0)


def test_a_compared_pair_gets_its_difference_by_hand(tmp_path):
    """`compare: [[a, b]]`: each training table gives a − b with its interval (the case of
    `test_difference_and_its_interval_by_hand`), and the findings name it."""
    from reports.study_report import RunTables, findings, train_table

    study = parse_spec(_spec(tmp_path, arms={"a": {}, "b": {}}, compare=[["a", "b"]]), tmp_path / "out")
    runs = [RunTables(arm, seed, f"{arm}-s{seed}", 2, scalars={"valid_rate": v})
            for arm, values in (("a", [1.0, 2.0, 3.0]), ("b", [0.0, 0.0, 0.0])) for seed, v in enumerate(values)]
    table = train_table(study, runs, "valid_rate")
    d = table["pairs"]["a − b"]
    assert (d["value"], d["low"], d["high"], d["verdict"]) == (2.0, 1.0, 3.0, "larger than its interval")
    assert any(line.endswith("a − b = +2.000 [+1.000, +3.000]: larger than its interval")
               for line in findings(study, {"valid_rate": table}))


# ---- the report on fake runs --------------------------------------------------------------
NEW_COLUMNS = ("teacher/distinct_share", "teacher/informative_valid_rate", "teacher/program_nodes")


def _fake_study(tmp_path: Path, steps: int = 6, new_columns: bool = True, seeds_programs: bool = True):
    """Arms `pop` (2 teachers) and `single` (the baseline), seeds 0-2, `steps` steps each, marked
    trained. The valid teacher-written programs of seed s have n_nodes 10 + slope * step, slope
    +(1 + s) in `pop` and -(1 + s) in `single`; every other measure is constant. Each run also
    has an invalid proposal with a huge n_nodes and, unless `seeds_programs` is false, code_f tasks
    on seed programs whose n_nodes fall with the step: neither may count in the trend."""
    from reports.study_spec import TRAINED

    tmp_path.mkdir(parents=True, exist_ok=True)
    study = parse_spec(_spec(tmp_path, arms={"pop": {}, "single": {}}, baseline="single", seeds=[0, 1, 2],
                             steps=steps), tmp_path / "out")
    for run in runs_of(study):
        sign = 1 if run.arm == "pop" else -1
        members = ["teacher-0", "teacher-1"] if run.arm == "pop" else ["agent-0"]
        metrics, tasks = [], []
        for step in range(1, steps + 1):
            for i, m in enumerate(members):
                row = {"step": step, "member": m, "alive": True, "teacher/valid_rate": 0.5,
                       "teacher/reward": 0.0, "student/solve_rate": 0.5, "population/coverage": step,
                       "time/step": 1.0}
                if new_columns:  # the members' mean per step: 0.5 + 0.05 step, 0.4, 20 + step
                    row.update({"teacher/distinct_share": 0.5 + 0.05 * step + (0.1 if i else -0.1) * (len(members) > 1),
                                "teacher/informative_valid_rate": 0.4, "teacher/program_nodes": 20.0 + step})
                metrics.append(row)
            for tt in ("code_i", "code_o", "code_f"):
                tasks.append({"step": step, "task_type": tt, "valid": True, "program_source": "proposal",
                              "ast_depth": 3, "cyclomatic": 2, "loc": 4, "n_variables": 1,
                              "n_nodes": 10 + sign * (1 + run.seed) * step, "structure_nodes": 9})
            tasks.append({"step": step, "task_type": "code_o", "valid": False, "program_source": "proposal",
                          "ast_depth": 30, "cyclomatic": 20, "loc": 40, "n_variables": 10, "n_nodes": 1000})
            if seeds_programs:
                tasks.append({"step": step, "task_type": "code_f", "valid": True, "program_source": "seed",
                              "ast_depth": 5, "cyclomatic": 3, "loc": 6, "n_variables": 2,
                              "n_nodes": 105 - 10 * step + run.seed,  # the whole program
                              "structure_nodes": 100 - 10 * step + run.seed})  # what f executes
        run.path.mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(metrics), run.path / "metrics.parquet")
        pq.write_table(pa.Table.from_pylist(tasks), run.path / "tasks.parquet")
        (run.path / TRAINED).write_text(json.dumps({"steps": steps}))
    return study


def _report(study) -> dict:
    from reports.study_report import write_study_report

    assert write_study_report(study).is_file()
    return json.loads((study.out / "report" / "summary.json").read_text())


def test_complexity_trend_rises_in_one_arm_and_falls_in_the_other(tmp_path):
    summary = _report(_fake_study(tmp_path))
    nodes = summary["complexity_trend"]["n_nodes"]
    # 6 steps: thirds of 2 steps; per seed (mean at steps 5, 6) - (mean at steps 1, 2) = ±4 (1 + seed).
    # As in test_difference_and_its_interval_by_hand, [4, 8, 12] resampled gives exactly [4, 12].
    pop, single = nodes["pop"], nodes["single"]
    assert pop["per_seed"] == [4.0, 8.0, 12.0] and pop["seeds"] == [0, 1, 2]
    assert (pop["value"], pop["low"], pop["high"], pop["n"], pop["verdict"]) == (8.0, 4.0, 12.0, 3, "rises")
    assert (single["value"], single["low"], single["high"], single["verdict"]) == (-8.0, -12.0, -4.0, "falls")
    d = pop["vs_baseline"]
    assert d["value"] == 16.0 and 8.0 <= d["low"] <= d["high"] <= 24.0 and d["low"] > 0, d
    assert d["verdict"] == "larger than its interval"
    assert "vs_baseline" not in single  # the baseline is not compared with itself
    # a constant measure neither rises nor falls
    loc = summary["complexity_trend"]["loc"]["pop"]
    assert (loc["value"], loc["low"], loc["high"], loc["verdict"]) == (0.0, 0.0, 0.0, "not separable")
    assert set(summary["complexity_trend"]) == {"ast_depth", "cyclomatic", "loc", "n_variables", "n_nodes"}
    title = "Trend of the AST node count of valid teacher-written programs (last − first third)"
    assert f"{title}: pop = +8.000 [+4.000, +12.000]: rises" in summary["findings"]
    assert f"{title}: single = -8.000 [-12.000, -4.000]: falls" in summary["findings"]
    assert f"{title}: pop − single = +16.000 [{d['low']:+.3f}, {d['high']:+.3f}]: larger than its interval" in (
        summary["findings"])
    report = tmp_path / "out" / "report"
    html = (report / "index.html").read_text()
    assert "Complexity trend over training" in html and "pop = +8.000 [+4.000, +12.000]: rises" in html
    md = (report / "summary.md").read_text()
    assert "| AST node count | +8.000 [+4.000, +12.000] rises | -8.000 [-12.000, -4.000] falls |" in md, md


def test_complexity_trend_of_a_single_seed_is_not_judged(tmp_path):
    from reports.study_report import RunTables, trend_table

    study = parse_spec(_spec(tmp_path, arms={"pop": {}, "single": {}}, baseline="single"), tmp_path / "out")
    runs = [RunTables("pop", 0, "pop-s0", 6, scalars={"trend/n_nodes": 3.0}),
            RunTables("single", 0, "single-s0", 6, scalars={"trend/n_nodes": -1.0}),
            RunTables("single", 1, "single-s1", 6)]  # a third without programs
    table = trend_table(study, runs, "n_nodes")
    assert table["pop"]["verdict"] == "not judged (fewer than 2 seeds)"
    assert table["pop"]["vs_baseline"]["value"] == 4.0
    assert table["single"]["missing_seeds"] == [1] and table["single"]["per_seed"] == [-1.0]


def test_training_figures_have_the_collapse_curves_where_the_columns_exist(tmp_path):
    from reports.study_report import curve_figures, load_runs

    study = _fake_study(tmp_path / "new")
    summary = _report(study)
    report = study.out / "report"
    metrics = summary["metrics"]
    # last third = steps 5 and 6: the members' mean per step is 0.5 + 0.05 step and 20 + step
    assert metrics["distinct_share"]["arms"]["pop"]["estimate"]["value"] == pytest.approx(0.775)
    assert metrics["informative_valid_rate"]["arms"]["single"]["estimate"]["value"] == pytest.approx(0.4)
    program = metrics["program_nodes"]["arms"]["pop"]
    assert program["estimate"]["value"] == pytest.approx(25.5) and program["vs_baseline"]["value"] == 0.0
    assert metrics["program_nodes"]["title"] == "Program size (last third)"
    figures = curve_figures(study, load_runs(study), summary["seed_program_nodes"])
    for name in ("distinct_share.png", "informative_valid_rate.png", "program_nodes.png"):
        assert (report / name).is_file() and name in figures
        ax = figures[name][0].axes[0]
        arms = sorted(line.get_label().split(" ")[0] for line in ax.get_lines() if "seeds)" in line.get_label())
        assert arms == ["pop", "single"], [line.get_label() for line in ax.get_lines()]
    distinct = next(x for x in figures["distinct_share.png"][0].axes[0].get_lines() if x.get_label().startswith("pop"))
    assert list(distinct.get_xdata()) == [1, 2, 3, 4, 5, 6]
    assert distinct.get_ydata() == pytest.approx([0.5 + 0.05 * s for s in range(1, 7)])
    html = (report / "index.html").read_text()
    assert "Distinct share (last third)" in html and "Program size (last third)" in html

    old = _fake_study(tmp_path / "old", new_columns=False, seeds_programs=False)
    summary = _report(old)
    report = old.out / "report"
    assert (report / "index.html").is_file() and (report / "valid_rate.png").is_file()
    for key in ("distinct_share", "informative_valid_rate", "program_nodes"):
        assert key not in summary["metrics"] and not (report / f"{key}.png").exists()
    assert summary["seed_program_nodes"] is None
    assert summary["complexity_trend"]["n_nodes"]["pop"]["verdict"] == "rises"


def test_program_size_figure_marks_the_seed_programs_mean(tmp_path):
    from reports.study_report import curve_figures, load_runs

    study = _fake_study(tmp_path, steps=6)
    summary = _report(study)
    # seed-program tasks: structure_nodes 100 - 10 step + seed, steps 1-6, seeds 0-2, two arms
    expected = np.mean([100 - 10 * step + seed for _ in range(2) for seed in range(3) for step in range(1, 7)])
    assert expected == 66.0 and summary["seed_program_nodes"] == pytest.approx(66.0)
    ax = curve_figures(study, load_runs(study), summary["seed_program_nodes"])["program_nodes.png"][0].axes[0]
    line = next(x for x in ax.get_lines() if x.get_label() == "seed programs")
    assert list(line.get_ydata()) == [pytest.approx(66.0)] * 2
    # no line on the other figures
    other = curve_figures(study, load_runs(study), 66.0)["distinct_share.png"][0].axes[0]
    assert all(x.get_label() != "seed programs" for x in other.get_lines())


def test_evaluation_scores_are_paired_over_problems():
    rng = np.random.default_rng(0)
    w = intervals.problem_weights(4, rng, draws=500)
    assert w.shape == (500, 4) and np.allclose(w.sum(axis=1), 1.0)
    run = np.array([[1, 0, 1, 0], [1, 1, 1, 1]])  # two members: accuracies 0.5 and 1.0
    assert intervals.eval_point([run], np.mean) == 0.75
    assert (intervals.eval_point([run], np.min), intervals.eval_point([run], np.max)) == (0.5, 1.0)
    a, b = intervals.eval_draws([run], w, np.mean, rng), intervals.eval_draws([run], w, np.mean, rng)
    # each score varies with the problems drawn, but two identical arms differ by 0 in every draw
    assert a.std() > 0 and np.array_equal(a, b)


# ---- the probe ---------------------------------------------------------------------------
def test_probe_programs_are_held_out_and_valid():
    from evaluation.in_distribution import HOLDOUT_PROGRAMS, in_distribution_tasks
    from driver.seeds import SEED_PROGRAMS
    from verifier_sandbox import ast_hash

    seeds = {ast_hash(s.program) for s in SEED_PROGRAMS}
    assert not [p for p, _, _ in HOLDOUT_PROGRAMS if ast_hash(p) in seeds]
    assert len({ast_hash(p) for p, _, _ in HOLDOUT_PROGRAMS}) == len(HOLDOUT_PROGRAMS)
    tasks = in_distribution_tasks(load_config(ROOT / "configs" / "local.yaml"), limit=3)
    assert [pid for pid, _ in tasks] == [f"probe/{i}/{t}" for t in ("code_i", "code_o", "code_f") for i in range(3)]
    code_f = [t for _, t in tasks if t.task_type == "code_f"]
    assert all(len(t.inputs) == 4 and len(t.outputs) == 4 and t.shown == 2 for t in code_f)


# ---- end to end --------------------------------------------------------------------------
def _run(cmd: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _rows(path: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in pq.read_table(path).to_pylist()]


@pytest.fixture(scope="module")
def smoke(tiny_model_path, tmp_path_factory):
    """The smoke study, with its baseline run interrupted after step 1 beforehand (trained by
    the study's own command to 1 step: a checkpoint at step 1, no completion marker)."""
    out = tmp_path_factory.mktemp("study") / "smoke"
    study = parse_spec(SMOKE, out)
    short = dataclasses.replace(study, steps=1)
    baseline = next(r for r in runs_of(short) if r.arm == "baseline")
    first = _run(train_command(baseline, short, check_study(short)[baseline.name], parallel=1))
    assert first.returncode == 0, first.stderr[-3000:]
    before = _rows(baseline.path / "metrics.parquet")
    proc = _run([sys.executable, "-m", "driver", "study", "--smoke", "--out", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout, before


def test_smoke_study_writes_the_report(smoke):
    out, stdout, _ = smoke
    html = (out / "report" / "index.html").read_text()
    summary = json.loads((out / "report" / "summary.json").read_text())
    assert "Findings" in html and "no detectable difference" in html or "not judged" in html
    assert all(r["finished"] and r["evaluated"] for r in summary["runs"]), summary["runs"]
    assert all(r["train_seconds"] > 0 and r["machine"]["cpu_count"] for r in summary["runs"]), summary["runs"]
    metrics = summary["metrics"]
    for key in ("valid_rate", "teacher_reward", "coverage", "eval/probe all/mean",
                "eval/probe all/weakest", "eval/probe all/best", "eval/humaneval/mean"):
        assert key in metrics, f"{key} not in {sorted(metrics)}"
    probe = metrics["eval/probe all/mean"]
    assert set(probe["arms"]) == {"2T2S", "baseline"} and "base" in probe
    assert probe["arms"]["2T2S"]["vs_baseline"]["verdict"] == "not judged (fewer than 2 seeds)"
    assert (out / "report" / "valid_rate.png").is_file() and (out / "report" / "evaluation.png").is_file()
    md = (out / "report" / "summary.md").read_text()
    assert md.startswith("2 of 2 runs finished") and "| metric | 2T2S | baseline | base model |" in md, md
    assert "| Valid-task rate (last third) | " in md and "Differences larger than their 95% interval" in md


def test_interrupted_run_resumes_from_its_checkpoint(smoke):
    out, stdout, before = smoke
    assert "baseline-s0: resume from step 1" in stdout and "2T2S-s0: start" in stdout, stdout
    after = _rows(out / "runs" / "baseline-s0" / "metrics.parquet")
    assert sorted({r["step"] for r in after}) == [1, 2]
    assert [r for r in after if r["step"] == 1] == before  # step 1 was not trained again


def test_finished_study_is_skipped(smoke):
    out, _, _ = smoke
    metrics = out / "runs" / "2T2S-s0" / "metrics.parquet"
    mtime = metrics.stat().st_mtime_ns
    proc = _run([sys.executable, "-m", "driver", "study", "--smoke", "--out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done 3/3" in proc.stdout and "start" not in proc.stdout and "resume" not in proc.stdout, proc.stdout
    assert metrics.stat().st_mtime_ns == mtime


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_study_in_the_background_stops_its_runs_on_sigint(tiny_model_path, tmp_path):
    """`nohup populora study ... &` starts the study with SIGINT ignored (a non-interactive
    shell does that to background jobs): SIGINT (and SIGTERM) must still stop the study, its
    runs and their Ray, and the study resumes afterwards."""
    out = tmp_path / "smoke"
    runs: list[int] = []
    proc = subprocess.Popen([sys.executable, "-m", "driver", "study", "--smoke", "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 300
        # a run is training once its first checkpoint is written
        while not list(out.glob("runs/*/checkpoint/manifest.json")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.5)
        runs = _children(proc.pid)
        assert runs
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=120)
        assert proc.returncode == 130, stdout
        assert "interrupted: stopping the runs" in stdout, stdout
        deadline = time.monotonic() + 30
        while not all(_gone(pgid) for pgid in runs):  # each run was its own process group, Ray included
            assert time.monotonic() < deadline, f"left running: {[p for p in runs if not _gone(p)]}"
            time.sleep(0.5)
    finally:
        for pgid in [proc.pid, *runs]:  # nothing outlives a failed test
            if not _gone(pgid):
                os.killpg(pgid, signal.SIGKILL)
        proc.wait()
    dry = _run([sys.executable, "-m", "driver", "study", "--smoke", "--out", str(out), "--dry-run"], timeout=300)
    assert "resume" in dry.stdout, dry.stdout
