"""`import tree_attn` and the CLI's help stay light: no torch until a tensor function is used."""

import subprocess
import sys


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_import_and_help_do_not_import_torch():
    code = (
        "import sys, tree_attn, tree_attn.cli.app\n"
        "from tree_attn.cli.app import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)"
    )
    assert _run(code).splitlines()[-1] == "False"


def test_public_names_resolve_on_first_use():
    code = (
        "import tree_attn\n"
        "from tree_attn.reduce.state import merge_partials\n"
        "assert tree_attn.merge_partials is merge_partials\n"
        "print(sorted(n for n in tree_attn.__all__ if not hasattr(tree_attn, n)))"
    )
    assert _run(code) == "[]"
