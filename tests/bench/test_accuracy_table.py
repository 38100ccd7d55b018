"""bench/ACCURACY.md is what the planner predicts today for every published result it lists."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_the_published_results_are_complete_records():
    entries = yaml.safe_load((ROOT / "bench" / "published_results.yaml").read_text())
    assert len(entries) >= 20 and len({e["id"] for e in entries}) == len(entries)
    for e in entries:
        assert e["measured"] and e["source"]["url"].startswith("https://") and e["source"]["quote"]
        assert e["num_gpus"] == e["tensor_parallel_size"] * (e.get("pipeline_parallel_size") or 1) * (
            e.get("data_parallel_size") or 1)


@pytest.mark.slow
def test_accuracy_table_is_current():
    """Regenerate with `python bench/accuracy.py` when the speed model changes."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "accuracy.py"), "--check"],
                          capture_output=True, text=True, timeout=300)  # (about 30 s on an idle core: the ShareGPT runs are replayed)
    assert done.returncode == 0, done.stdout + done.stderr
