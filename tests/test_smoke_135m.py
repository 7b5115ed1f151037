"""Smoke test on the real embedded SmolLM2-135M-Instruct (marked slow: run by `make test-slow`)."""

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from driver.config import load_config
from driver.loop import train

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_one_step_of_the_default_config_on_the_135m_model(ray_session, tmp_path):
    cfg = load_config(ROOT / "configs/local.yaml", [
        f"run.output_dir={tmp_path}", "run.steps=1", "tasks.proposals_per_type=1",
        "tasks.propose_max_new_tokens=48", "tasks.solve_max_new_tokens=24", "population.evolve_every=1"])
    run = train(cfg)
    tasks = pq.read_table(run / "tasks.parquet").to_pylist()
    assert len(tasks) == 2 * 3  # 2 teachers x 3 task types x 1 proposal
    assert all(t["completion"] for t in tasks), "the model wrote nothing"
    assert pq.read_table(run / "lineage.parquet").num_rows == 2
    assert len(list((run / "adapters").iterdir())) == 4
