"""gems results' table and plot of accuracy against sample size (gems/results/accuracy.py): one row per sample
edge, medians and spread over repeats, single crops beside crop averages, only for studies over sample edges."""
from __future__ import annotations

from pathlib import Path

import pytest

from gems.results import accuracy
from gems.results.table import write_studies


def _rec(edge: int, mae: list[float], avg: list[float] | None, repeat: int = 0, status: str = "ok") -> dict:
    v = {"step": 10, "epoch": 4.0, "loss": 0.1, "mae": sum(mae) / 4, "mae_per_target": mae, "samples": 64}
    if avg is not None:
        v.update(mae_avg_crops=sum(avg) / 4, mae_avg_crops_per_target=avg, groups=8)
    return {"schema": "gems.record/1", "status": status, "sweep": "sizes", "name": f"crop{edge}", "run_id": f"r{edge}-{repeat}",
            "config": {"data": {"crop": edge}, "model": {"size": edge}, "results": {}}, "mesh": {"replicas": 1,
            "pipeline": 1, "spatial": 2 if edge == 128 else 1}, "global_batch": (128 // edge) ** 3, "validation": [v],
            "world_size": 1, "steps": 10, "loss": [0.2], "step_time_s": {"median": 1.0, "min": 1.0, "max": 1.0},
            "throughput_samples_per_s": 1.0, "repeat": repeat, "peak_memory_bytes": {"max": 1, "per_rank": [1]},
            "time_breakdown_s": {}, "env": {}}


def test_rows_per_edge_with_medians_over_repeats_and_crop_averages() -> None:
    recs = [_rec(32, [0.4, 0.2, 0.5, 0.5], [0.3, 0.1, 0.5, 0.5]), _rec(32, [0.6, 0.2, 0.5, 0.5], None, repeat=1),
            _rec(64, [0.3, 0.1, 0.5, 0.4], [0.25, 0.08, 0.5, 0.4]), _rec(128, [0.2, 0.05, 0.4, 0.4], None),
            _rec(64, [9, 9, 9, 9], [9, 9, 9, 9], status="failed")]
    assert accuracy.applies(recs) and not accuracy.applies([r for r in recs if r["name"] == "crop32"])
    rows = accuracy.rows(recs)
    assert [r["edge"] for r in rows] == [32, 64, 128] and [r["runs"] for r in rows] == [2, 1, 1]
    assert rows[0]["Omega_m_crop"] == (0.5, 0.4, 0.6)  # median, min, max of the repeats
    assert "mae_avg" not in rows[0]  # a repeat without crop averages: not mixed with one that has them
    assert rows[1]["mae_avg"] == (pytest.approx(0.3075), pytest.approx(0.3075), pytest.approx(0.3075))
    assert rows[2]["mesh"] == ["1x1x2"] and rows[2]["batch"] == [1]
    text = accuracy.markdown(rows, "sizes")
    assert "| edge |" in text and "0.5000 (0.4000-0.6000)" in text


def test_gems_results_writes_the_accuracy_files_for_a_study_over_sample_edges(tmp_path: Path) -> None:
    import json

    folder = tmp_path / "sizes"
    folder.mkdir()
    for r in (_rec(32, [0.4, 0.2, 0.5, 0.5], [0.3, 0.1, 0.5, 0.5]), _rec(64, [0.3, 0.1, 0.5, 0.4], [0.2, 0.1, 0.5, 0.4])):
        (folder / f"{r['run_id']}.json").write_text(json.dumps(r))
    write_studies(tmp_path)
    assert (folder / "accuracy.md").exists() and (folder / "accuracy.png").stat().st_size > 10_000
    lines = (folder / "accuracy.csv").read_text().splitlines()
    assert lines[0].startswith("edge,voxels") and lines[1].startswith("32,32768") and len(lines) == 3
