"""The repository passes ruff with the configuration in pyproject.toml (line length 120, ruff's
default rules plus E501), so that the test command checks style as well as behaviour."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_check_passes():
    # --no-cache: nothing stale is read and no .ruff_cache is left in the checkout.
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, (
        "ruff check failed (the test extra installs the pinned ruff: pip install -e '.[test]'; "
        f"`ruff check --fix .` applies the safe fixes):\n{proc.stdout}{proc.stderr}")
