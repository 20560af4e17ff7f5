"""TREE_ATTN_FAILURE_LOG (tests/conftest.py): each failing test is written to the file as it
fails, so that a run stopped at a time limit still says what failed and why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PLANTED = '''
def test_passes():
    pass

def test_fails():
    assert 1 + 1 == 3, "planted failure"
'''


def test_failures_are_written_as_they_happen(tmp_path):
    planted = tmp_path / "test_planted.py"
    planted.write_text(PLANTED)
    log = tmp_path / "failures.txt"
    env = dict(os.environ, TREE_ATTN_FAILURE_LOG=str(log))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "--rootdir", str(tmp_path), str(planted)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one test failed, as planted
    text = log.read_text()
    assert text.count("=== ") == 1 and "test_planted.py::test_fails (call) FAILED" in text
    assert "planted failure" in text and "test_passes" not in text
