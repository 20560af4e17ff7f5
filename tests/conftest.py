"""Session-wide test settings."""

import pytest


@pytest.fixture(autouse=True)
def _private_profile_dir(tmp_path, monkeypatch):
    """Keep tests away from the user's saved profiles: every test gets an empty profile folder."""
    monkeypatch.setenv("TREE_ATTN_PROFILE_DIR", str(tmp_path / "profile-cache"))
