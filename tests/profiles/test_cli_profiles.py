"""`tree-attn profiles`: lists built-in and saved profiles, shows one, bad files exit 1."""

from __future__ import annotations

import json

from tree_attn.cli.app import main
from tree_attn.profiles import profile_path_for, profile_to_yaml, save_profile


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_list_builtin_and_saved(profile, profile_dir, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    save_profile(profile, profile_path_for(profile.machine.fingerprint))
    assert main(["profiles"]) == 0
    out = capsys.readouterr().out
    for name in ("cpu-4-ranks", "h100-8x-nvswitch", "mi300x-8x-xgmi", "rtx4090-8x-pcie", "test-cpu"):
        assert name in out
    assert "builtin-model" in out and "measured" in out
    assert main(["profiles", "list"]) == 0
    assert "test-cpu" in capsys.readouterr().out


def test_list_json(profile, profile_dir, capsys):
    save_profile(profile, profile_dir / "mine.yaml")
    assert main(["profiles", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in d["profiles"]}
    assert rows["test-cpu"]["kind"] == "saved" and rows["test-cpu"]["plan"] == "tree k=2"
    assert rows["h100-8x-nvswitch"]["kind"] == "builtin" and rows["h100-8x-nvswitch"]["world_size"] == 8
    assert rows["rtx4090-8x-pcie"]["origin"] == "builtin-model"
    assert main(["profiles", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["profiles"]


def test_show_builtin(capsys, profile_dir):
    assert main(["profiles", "show", "rtx4090-8x-pcie"]) == 0
    out = _flat(capsys.readouterr().out)
    assert "rtx4090-8x-pcie" in out and "chosen by model" in out and "reduction candidates" in out
    assert main(["profiles", "show", "h100-8x-nvswitch", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["origin"] == "builtin-model" and d["machine"]["device_kind"] == "cuda"


def test_show_file(profile, tmp_path, capsys, profile_dir):
    path = save_profile(profile, tmp_path / "p.yaml")
    assert main(["profiles", "show", str(path)]) == 0
    out = _flat(capsys.readouterr().out)
    assert "test-cpu" in out and "measured" in out


def test_bad_profile_exit_1_names_field(profile, tmp_path, capsys, profile_dir):
    path = tmp_path / "bad.yaml"
    path.write_text(profile_to_yaml(profile).replace("fanout: 2, label: tree k=2}\n  chosen_by",
                                                     "fanout: 1, label: tree k=2}\n  chosen_by", 1))
    assert main(["profiles", "show", str(path)]) == 1
    cap = capsys.readouterr()
    err = _flat(cap.err)
    assert "reduction.plan.fanout" in err and "Traceback" not in cap.err + cap.out
    assert cap.err.count("error:") == 1


def test_yaml_syntax_error_exit_1(tmp_path, capsys, profile_dir):
    path = tmp_path / "broken.yaml"
    path.write_text("schema_version: 1\nname: [oops\n")
    assert main(["profiles", "show", str(path)]) == 1
    cap = capsys.readouterr()
    assert "not valid YAML" in _flat(cap.err) and "Traceback" not in cap.err


def test_unknown_name_exit_1(capsys, profile_dir):
    assert main(["profiles", "show", "no-such-profile"]) == 1
    assert "no-such-profile" in capsys.readouterr().err


def test_listing_survives_a_broken_saved_profile(profile_dir, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    profile_dir.mkdir(parents=True)
    (profile_dir / "junk.yaml").write_text("schema_version: 7\n")
    assert main(["profiles"]) == 0
    cap = capsys.readouterr()
    assert "junk" in cap.out and "schema_version" in _flat(cap.err)


def test_a_profile_name_with_markup_lists_and_shows_as_is(profile_dir, tmp_path, capsys, monkeypatch):
    """Names, descriptions and notes are printed through rich as text, never read as markup."""
    from dataclasses import replace

    from tests.profiles.conftest import make_profile

    monkeypatch.setenv("COLUMNS", "250")
    evil = replace(make_profile(name="evil[/x]"), description="made [bold]by[/] hand [/]", notes=["[red]not red[/red]"])
    path = save_profile(evil, profile_path_for(evil.machine.fingerprint))
    assert main(["profiles"]) == 0
    cap = capsys.readouterr()
    assert "evil[/x]" in cap.out and "Traceback" not in cap.err
    assert main(["profiles", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "evil[/x]" in out and "made [bold]by[/] hand [/]" in out and "[red]not red[/red]" in out
    assert main(["profiles", "show", evil.machine.fingerprint]) == 0  # a saved profile by fingerprint
    assert "evil[/x]" in capsys.readouterr().out
    assert main(["profiles", "--json"]) == 0
    assert "evil[/x]" in {r["name"] for r in json.loads(capsys.readouterr().out)["profiles"]}


def test_an_unknown_profile_with_markup_is_one_error_line(profile_dir, capsys):
    assert main(["profiles", "show", "nope[/bold]"]) == 1
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "nope[/bold]" in lines[0]
