"""bench/run.py keeps working: its --quick smoke run (no peers, no timing asserted: speed
is measured by the benchmark itself, never by a test) prints every target with a verdict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "run.py"


@pytest.mark.timeout(300)
def test_bench_run_quick_prints_every_target(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--quick", "--dir", str(tmp_path),
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for target in ("W1 / LMDB ceiling", "W1 fsync off: CPU per round", "hand-offs per round",
                   "replay / raw scan + decode", "journal pages per round", "recover()",
                   "1,000 in flight: memory per run"):
        line = next(ln for ln in text.splitlines() if target in ln)
        assert line.rstrip().endswith(("| pass |", "| FAIL |")), line
    assert "reproduce: `python bench/run.py --quick" in text
    assert not (tmp_path / "RESULTS.md").exists()  # a smoke run writes no results
