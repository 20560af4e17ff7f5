"""Every option that writes a file follows one rule (``tree_attn.files.unwritable``): missing folders
are created; a file where a folder should be, a folder that cannot be written, or a folder given as
the file is refused in one line, exit 1, before any work, and nothing is left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tree_attn.cli.app import main
from tree_attn.commands.tune.setup import check_output_free
from tree_attn.errors import ProfileError

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "topology"
H100 = FIX / "h100_sxm5_8gpu_1nic_vm_nvidia-smi_topo_m.txt"

# (name, argv with {out} for the file written) for every command option that writes a file. tune's
# --output is checked by its library function (a CLI tune would time plans), run's --plot below.
WRITERS = [
    ("probe --output", ["probe", "--from", str(H100), "--output", "{out}"]),
    ("check --junit", ["check", "--expect", str(H100), "--from", str(H100), "--junit", "{out}"]),
    ("probe --plot", ["probe", "--from", str(H100), "--plot", "{out}"]),
    ("simulate --plot", ["simulate", "-w", "8", "-n", "32K", "--plot", "{out}"]),
]


def _argv(argv: list[str], out: Path) -> list[str]:
    return [a.replace("{out}", str(out)) for a in argv]


def _file_name(name: str) -> str:
    return "picture.png" if name.endswith("--plot") else "report.yaml"


@pytest.mark.parametrize("name,argv", WRITERS, ids=[w[0] for w in WRITERS])
def test_missing_folders_are_created(name, argv, tmp_path, capsys):
    if name.endswith("--plot"):
        pytest.importorskip("matplotlib")
    out = tmp_path / "new" / "deeper" / _file_name(name)
    assert main(_argv(argv, out)) == 0, capsys.readouterr().err
    assert out.is_file() and out.stat().st_size > 0
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]  # no temporary file left


def test_tune_output_in_missing_folders_is_accepted(tmp_path):
    check_output_free(str(tmp_path / "new" / "deeper" / "p.yaml"), force=False)
    assert list(tmp_path.iterdir()) == []  # checked, nothing created before the profile is written


@pytest.mark.parametrize("name,argv", WRITERS, ids=[w[0] for w in WRITERS])
def test_a_path_under_a_file_is_refused_before_any_work(name, argv, tmp_path, capsys, monkeypatch):
    """Before any dump is read or any machine probed (``probe --measure`` and ``check --measure``
    would otherwise measure for minutes first), in one line, and nothing written."""
    from tree_attn import topology

    def no_work(*args, **kwargs):
        raise AssertionError("the command started its work although its output cannot be written")

    for fn in ("load_dumps", "load_expected", "probe_topology"):
        monkeypatch.setattr(topology, fn, no_work)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = blocker / _file_name(name)
    assert main(_argv(argv, out)) == 1
    err = capsys.readouterr().err
    assert f"{blocker} is a file, not a folder" in err and "Traceback" not in err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"] and blocker.read_text() == "x"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux procfs, which refuses new files to anyone")
@pytest.mark.parametrize("deeper", [False, True], ids=["folder", "missing-folders"])
@pytest.mark.parametrize("name,argv", WRITERS, ids=[w[0] for w in WRITERS])
def test_a_folder_that_refuses_new_files_is_refused_before_any_work(name, argv, deeper, capsys, monkeypatch):
    """procfs refuses a new file to every user, root included, whose permission bits (os.access)
    say yes: the up-front check asks the file system, so the refusal comes before the work."""
    from tree_attn import topology

    def no_work(*args, **kwargs):
        raise AssertionError("the command started its work although its output cannot be written")

    for fn in ("load_dumps", "load_expected", "probe_topology"):
        monkeypatch.setattr(topology, fn, no_work)
    out = Path("/proc") / ("tree-attn-new" if deeper else "") / _file_name(name)
    assert main(_argv(argv, out)) == 1
    err = capsys.readouterr().err
    assert f"cannot write {name.split()[1]} {out}: the folder /proc cannot be written" in err
    assert err.startswith("error:") and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux procfs, which refuses new files to anyone")
def test_tune_output_in_a_folder_that_refuses_new_files_is_refused():
    with pytest.raises(ProfileError, match="the folder /proc cannot be written"):
        check_output_free("/proc/tree-attn-profile.yaml", force=False)


@pytest.mark.parametrize("name,argv", WRITERS, ids=[w[0] for w in WRITERS])
def test_a_folder_given_as_the_file_is_refused(name, argv, tmp_path, capsys, monkeypatch):
    folder = tmp_path / _file_name(name)
    folder.mkdir()
    assert main(_argv(argv, folder)) == 1
    err = capsys.readouterr().err
    assert "is a folder" in err and "Traceback" not in err
    assert list(folder.iterdir()) == []


def test_run_sweep_plot_follows_the_same_rule(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    argv = ["run", "--device", "cpu", "--sweep", "64,128", "--heads", "4", "--kv-heads", "2", "--head-dim", "8",
            "--steps", "1", "--plot", str(blocker / "sweep.png")]
    assert main(argv) == 1  # refused before any rank is spawned
    assert f"{blocker} is a file, not a folder" in capsys.readouterr().err


def test_tune_output_under_a_file_is_refused(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ProfileError, match="a-file is a file, not a folder"):
        check_output_free(str(tmp_path / "a-file" / "p.yaml"), force=False)
