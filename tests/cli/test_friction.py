"""The rough edges a new user hit (issue "Hardening", friction list): help texts, --version, exit
codes, profiles at 80 columns, dumps without names, one default CPU rank count, the saved profile
for another rank count, files readable under the umask, no NumPy warning without numpy."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tree_attn.cli.app import main

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "topology"
A100 = FIX / "a100_dgx_8gpu_12nic_nvidia-smi_topo_m.txt"
COMMANDS = (["run"], ["probe"], ["check"], ["tune"], ["profiles"], ["profiles", "show"])


@pytest.mark.parametrize("cmd", [[]] + list(COMMANDS), ids=lambda c: " ".join(c) or "tree-attn")
def test_help_has_no_value_placeholder_on_flags(cmd, capsys):
    assert main([*cmd, "--help"]) == 0
    out = capsys.readouterr().out
    assert "<bool>" not in out and "--help" in out
    assert "<list[" not in out  # a Python type, not a value a user types (--from DUMP)


def test_help_texts_have_no_hard_line_breaks_inside_paragraphs():
    from tree_attn.cli import run, tune

    for text in (run.HELP, tune.HELP):
        for paragraph in text.split("\n\n"):
            assert "\n" not in paragraph.strip(), paragraph


def test_version_and_exit_codes(capsys):
    from tree_attn import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tree-attn {__version__}"
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("0 success", "1 an error", "2 a usage error", "130 interrupted", "143 terminated"):
        assert text in out


def test_profiles_fit_80_columns_and_show_whole_configs(capsys):
    assert main(["profiles"]) == 0
    listing = capsys.readouterr().out
    assert "h100-8x-nvswitch" in listing and "cpu-4-ranks" in listing
    assert main(["profiles", "show", "h100-8x-nvswitch"]) == 0
    shown = capsys.readouterr().out
    assert "bn32 w2 s3 splits=8" in shown and "…" not in shown  # configs whole, not cut
    # Every line fits 80 columns but a path, printed whole on a line of its own: the saved-profile
    # folder (each test's own, under pytest's tmp folder, longer under pytest-xdist's workers).
    folder = os.environ["TREE_ATTN_PROFILE_DIR"]
    for text in (listing, shown):
        assert max(len(ln) for ln in text.splitlines() if ln.strip() != folder) <= 80


def test_probe_of_a_dump_without_names_prints_no_unknown_device_lines(capsys):
    assert main(["probe", "--from", str(A100)]) == 0
    out = capsys.readouterr().out
    assert "unknown" not in out.replace("UNKNOWN", "")


def test_probe_and_run_default_to_the_same_cpu_rank_count(capsys):
    from tree_attn.commands.run.setup import RunOptions, plan_run

    assert main(["probe", "--backend", "host", "--json"]) == 0
    probed = json.loads(capsys.readouterr().out)
    setup = plan_run(RunOptions(device="cpu"))
    assert len(probed["devices"]) == setup.spec.world_size == 4
    # same topology, same fingerprint: the built-in 4-rank profile serves both
    assert setup.profile.name == "cpu-4-ranks"


def test_run_names_the_profile_saved_for_another_rank_count():
    from tree_attn.commands.run.setup import RunOptions, plan_run
    from tree_attn.profiles import load_builtin, profile_path_for, save_profile

    four = load_builtin("cpu-4-ranks")  # as `tune --device cpu` (4 ranks) saves it
    save_profile(four, profile_path_for(four.machine.fingerprint))
    text = plan_run(RunOptions(device="cpu", world_size=2)).profile.text
    assert "cpu-4-ranks is for 4 ranks, not 2" in text and "`tree-attn tune --device cpu -w 2`" in text


def test_written_files_honour_the_umask(tmp_path, capsys):
    old = os.umask(0o022)
    try:
        assert main(["probe", "--backend", "host", "--cpu-ranks", "2", "--output", str(tmp_path / "t.yaml")]) == 0
        assert main(["check", "--expect", str(A100), "--from", str(A100), "--junit", str(tmp_path / "r.xml")]) == 0
    finally:
        os.umask(old)
    for name in ("t.yaml", "r.xml"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name
    # and probe --output refuses to overwrite without --force, accepts with it
    before = (tmp_path / "t.yaml").read_text()
    assert main(["probe", "--backend", "host", "--cpu-ranks", "3", "--output", str(tmp_path / "t.yaml")]) == 1
    assert (tmp_path / "t.yaml").read_text() == before
    assert main(["probe", "--backend", "host", "--cpu-ranks", "3", "--output", str(tmp_path / "t.yaml"),
                 "--force"]) == 0
    assert (tmp_path / "t.yaml").read_text() != before


def test_no_numpy_warning_without_numpy(tmp_path):
    """numpy is only in the test extra: without it, torch's warning must not reach the user, from
    the CLI or from any rank (a sitecustomize hides numpy from every process of the run)."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['numpy'] = None\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
               CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "tree_attn", "run", "--device", "cpu", "-w", "2", "-n", "256", "--heads", "4",
           "--kv-heads", "2", "--head-dim", "8", "--steps", "1", "--strategy", "tree", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "NumPy" not in proc.stderr
