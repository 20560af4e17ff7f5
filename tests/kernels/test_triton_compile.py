"""The kernels compile for real GPU targets (Hopper, Ampere, Ada, CDNA3), checked without a GPU.

The CPU interpreter runs the kernels' Python, not Triton's compiler: it accepts code the compiler
rejects (a non-constexpr global read inside @jit, say) and says nothing about the generated code.
Triton can compile for targets it does not have (it ships ptxas and the AMDGPU backend), so
``kernel_aot_compile.py`` builds real launches (the launcher's own arguments, hence the
specialisations a launch derives from them) in fresh processes without the interpreter, and these
tests check what matters for bandwidth: no scalar 2-byte (fp8: 1-byte) global loads, no fp8
tile read back from shared memory one byte at a time, K/V pipelined through 16-byte cp.async when
num_stages > 1, shared memory under the estimate that filters tuning candidates, (ptxas -v)
register spills never where the rule that prunes tuning candidates passes a build (nor in a default
config), and exactly where it says for the Triton it was fitted to (the rule keeps bounds per Triton
release, ``kernels.config.SpillProfile``), and on MI300 an fp8 cache widened by the hardware's
conversions where it has them.

These are compile-time facts of the installed Triton; none of these builds runs here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("triton")

from kernel_aot_compile import CASES, Launch, Merge

from tree_attn.kernels.config import (
    DecodeConfig,
    dot_math,
    group_block,
    spill_profile,
    stage1_smem_bytes,
    stage1_spill_free,
)
from tree_attn.kernels.shapes import DecodeShape

_SCRIPT = Path(__file__).resolve().parent / "kernel_aot_compile.py"
# The compile processes run side by side (Triton compiles in one thread): the CI machine has 2 cores.
_PROCESSES = 2
_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp8": "float8_e4m3fn",
          "fp8fnuz": "float8_e4m3fnuz"}
_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp8": 1, "fp8fnuz": 1}
_WARP = {"cuda": 32, "hip": 64}


def _run(ids: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(_SCRIPT), *ids], capture_output=True, text=True, env=env, timeout=900,
                          check=False)
    if proc.returncode != 0:
        pytest.fail(f"AOT compile script failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled():
    ids = list(CASES)
    # Deal the cases round-robin, so each process gets a share of every target and kind.
    with ThreadPoolExecutor(_PROCESSES) as pool:
        parts = list(pool.map(_run, [ids[i::_PROCESSES] for i in range(_PROCESSES)]))
    return {cid: facts for part in parts for cid, facts in part.items()}


def _shape(launch: Launch) -> DecodeShape:
    blocks = -(-launch.n // launch.page) if launch.page else 0
    return DecodeShape(
        batch=launch.b, q_heads=launch.hq, kv_heads=launch.hkv, head_dim=launch.d,
        kv_len=blocks * launch.page if launch.page else launch.n, q_len=max(1, launch.sq),
        block_size=launch.page, num_blocks=launch.b * blocks,
    )


def _ok(facts: dict) -> dict:
    assert "error" not in facts, facts["error"]
    return facts


LAUNCHES = [cid for cid, (_t, what) in CASES.items() if isinstance(what, Launch)]
MERGES = [cid for cid, (_t, what) in CASES.items() if isinstance(what, Merge)]
CUDA_LAUNCHES = [cid for cid in LAUNCHES if CASES[cid][0] != "mi300x"]


@pytest.mark.parametrize("cid", LAUNCHES)
def test_launch_builds(compiled, cid):
    result = _ok(compiled[cid])
    target, launch = CASES[cid]
    cfg = DecodeConfig.from_dict(result["config"])
    if launch.config is not None:
        assert all(result["config"][k] == v for k, v in launch.config), (launch.config, result["config"])
    s1 = _ok(result["stage1"])
    elem, parts = dot_math(_DTYPE[launch.q], _DTYPE[launch.kv])
    rows = group_block(_shape(launch).query_rows)
    kv_bytes = _BYTES[launch.kv]
    smem = stage1_smem_bytes(cfg.block_n, cfg.num_stages, launch.d, elem, rows, parts, kv_bytes)
    assert s1["shared"] <= smem, (s1, cfg)
    if target != "mi300x" and launch.kv != "fp32":
        assert not s1["scalar_b16_loads"], "unvectorised 2-byte global loads"
        assert not s1["scalar_b8_loads"], "unvectorised 1-byte global loads"
        if cfg.num_stages > 1:
            assert s1["cp_async_16"], "K/V loads not pipelined through 16-byte cp.async"
        # An fp8 tile must not be read back from shared memory a byte at a time (before the V tile's
        # widening was kept in place, the sm_90 Llama build had 64 such reads per thread and tile).
        assert s1["b8_shared_loads"] == 0, f"{s1['b8_shared_loads']} one-byte shared-memory reads"
    # One split writes the caller's out (16-bit, or the packed message) directly; several add stage two.
    assert ("stage2" in result) == (cfg.num_splits > 1)
    if "stage2" in result:
        s2 = _ok(result["stage2"])
        assert s2["shared"] <= 16 * 1024
        if target != "mi300x":
            assert s2["spill_store_bytes"] == 0, s2


@pytest.mark.parametrize("cid", CUDA_LAUNCHES)
def test_spills_exactly_where_the_rule_says(compiled, cid):
    """ptxas never spills stage one's registers where :func:`stage1_spill_free` (for the Triton that
    built it) says it does not, nor in a default; and, for the Triton the rule was fitted to
    (``SpillProfile.exact``), spills wherever it says so. A conservative profile (an older Triton's)
    prunes a superset: every build the fitted rule prunes, and more."""
    result = _ok(compiled[cid])
    _target, launch = CASES[cid]
    facts = result["stage1"]
    if "spill_store_bytes" not in facts:
        pytest.fail(f"no ptxas report: {facts.get('ptxas_error')}")
    cfg = DecodeConfig.from_dict(result["config"])
    profile = spill_profile(facts["triton"])
    predicted = stage1_spill_free(
        cfg.block_n, cfg.num_warps, _shape(launch), _DTYPE[launch.kv], _WARP["cuda"], q_dtype=_DTYPE[launch.q],
        profile=profile,
    )
    spilled = facts["spill_store_bytes"] > 0
    why = (f"spill rule ({profile.name}) says {'no spill' if predicted else 'spills'}; ptxas {facts['ptxas']}: "
           f"{facts['registers']} registers, {facts['spill_store_bytes']} B spilled ({cfg.describe()})")
    assert not (predicted and spilled), why
    if profile.exact:
        assert predicted == (not spilled), why
        assert predicted == (not cid.endswith("-spills")), "case name and rule disagree"
    elif cid.endswith("-spills"):
        assert not predicted, "a conservative profile passes a build the fitted rule prunes"
    if launch.config is None:
        assert not spilled, "a default config spills"


def test_amd_fp8_formats(compiled):
    """On gfx942 (MI300) the kernel takes both fp8 formats: its own "fnuz" e4m3 widens with the
    hardware's conversions, OCP e4m3 (torch.float8_e4m3fn) without them: Triton converts it in
    software, several times the vector instructions (a compile fact; neither has run on an MI300)."""
    fnuz = _ok(compiled["mi300x-fp8fnuz-llama-b1-64k"])["stage1"]
    ocp = _ok(compiled["mi300x-fp8-llama-b1-64k"])["stage1"]
    assert fnuz["fp8_hw_cvt"] > 0 and ocp["fp8_hw_cvt"] == 0, (fnuz, ocp)
    assert _ok(compiled["mi300x-fp8fnuz-sq4-paged16-causal"])["stage1"]["fp8_hw_cvt"] > 0
    assert ocp["valu"] > 2 * fnuz["valu"], (fnuz["valu"], ocp["valu"])


@pytest.mark.parametrize("cid", MERGES)
def test_tree_merge_builds_on_its_views(compiled, cid):
    facts = _ok(_ok(compiled[cid])["stage2"])
    assert facts["shared"] <= 16 * 1024
    if CASES[cid][0] != "mi300x":
        assert facts["spill_store_bytes"] == 0, facts


def test_builds_carry_the_launch_specialisations(compiled):
    """Argument values decide the build: the packed message (strides of D + 1, lse at an offset of
    4 D bytes) and a 16-bit out are other builds than the float32 partials of several splits."""
    h = {cid: compiled[cid]["stage1"].get("hash") for cid in (
        "h100-bf16-llama-b1-64k", "h100-bf16-llama-packed-1split", "h100-bf16-llama-b64-1split")}
    assert None not in h.values() and len(set(h.values())) == 3, h
