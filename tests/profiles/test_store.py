"""Atomic save, no overwrite without force, the profile folder and its listing."""

from __future__ import annotations

import os

import pytest

from tree_attn.errors import ProfileError
from tree_attn.profiles import (
    default_profile_dir,
    find_saved_profile,
    list_saved_profiles,
    load_profile,
    profile_path_for,
    save_profile,
)

from .conftest import make_profile


def test_save_leaves_no_temp_files(profile, tmp_path):
    path = save_profile(profile, tmp_path / "sub" / "p.yaml")
    assert sorted(os.listdir(tmp_path / "sub")) == ["p.yaml"]
    assert load_profile(path) == profile


def test_refuses_to_overwrite_without_force(profile, tmp_path):
    path = tmp_path / "p.yaml"
    path.write_bytes(b"# someone's hand-made profile\n\x00 not even yaml")
    before = path.read_bytes()
    with pytest.raises(ProfileError, match="--force") as info:
        save_profile(profile, path)
    assert str(path) in str(info.value)
    assert path.read_bytes() == before  # untouched, byte for byte
    assert sorted(os.listdir(tmp_path)) == ["p.yaml"]  # and no temp file left behind


def test_force_overwrites(profile, tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("old\n")
    other = make_profile(name="second")
    save_profile(other, path, force=True)
    assert load_profile(path).name == "second"
    assert sorted(os.listdir(tmp_path)) == ["p.yaml"]


def test_unwritable_folder_is_a_profile_error(profile, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ProfileError, match="cannot write"):
        save_profile(profile, blocker / "p.yaml")


def test_profile_dir_env_and_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("TREE_ATTN_PROFILE_DIR", str(tmp_path / "override"))
    assert default_profile_dir() == tmp_path / "override"
    monkeypatch.delenv("TREE_ATTN_PROFILE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_profile_dir() == tmp_path / "xdg" / "tree-attn" / "profiles"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_profile_dir() == tmp_path / "home" / ".cache" / "tree-attn" / "profiles"


def test_saved_profile_by_fingerprint(profile, profile_dir):
    fp = profile.machine.fingerprint
    assert find_saved_profile(fp) is None
    assert list_saved_profiles() == []
    path = save_profile(profile, profile_path_for(fp))
    assert path == profile_dir / f"{fp}.yaml"
    assert find_saved_profile(fp) == path
    # A broken file in the folder is listed with its error, not fatal.
    (profile_dir / "broken.yaml").write_text("schema_version: 1\nname: [\n")
    entries = list_saved_profiles()
    assert [e.name for e in entries] == ["test-cpu", "broken"] or [e.name for e in entries] == ["broken", "test-cpu"]
    by_name = {e.name: e for e in entries}
    assert by_name["test-cpu"].profile == profile and by_name["test-cpu"].error is None
    assert by_name["broken"].profile is None and "not valid YAML" in by_name["broken"].error


@pytest.mark.parametrize("bad", ["", "../x", "a/b", ".hidden"])
def test_profile_path_rejects_odd_fingerprints(bad):
    with pytest.raises(ProfileError, match="fingerprint"):
        profile_path_for(bad)
