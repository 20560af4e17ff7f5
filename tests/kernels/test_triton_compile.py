"""The kernels compile for real GPU targets (Hopper, Ampere, Ada, CDNA3), checked without a GPU.

The CPU interpreter runs the kernels' Python, not Triton's compiler: it accepts code the compiler
rejects (a non-constexpr global read inside @jit, say) and says nothing about the generated code.
Triton can compile for targets it does not have (it ships ptxas and the AMDGPU backend), so
``kernel_aot_compile.py`` builds both kernels, in a fresh process without the interpreter, and
these tests check what matters for bandwidth: no scalar 2-byte loads, K/V pipelined through 16-byte
cp.async when num_stages > 1, shared memory under the estimate that filters tuning candidates, and
(ptxas -v) register spills exactly where the rule that prunes tuning candidates says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from kernel_aot_compile import STAGE1_CASES, STAGE2_CASES  # noqa: E402
from tree_attn.kernels.config import group_block, spill_free, stage1_smem_bytes  # noqa: E402

_SCRIPT = Path(__file__).resolve().parent / "kernel_aot_compile.py"


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(_SCRIPT)], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"AOT compile script failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cid", list(STAGE1_CASES))
def test_stage1_compiles(compiled, cid):
    facts = compiled[cid]
    if not facts["ok"] and ("ptxas" in facts["error"] or "No such file" in facts["error"]):
        pytest.skip(f"this triton install cannot compile for the target: {facts['error'][:200]}")
    assert facts["ok"], facts["error"]
    target, dtype, d, bn, stages, warps, group, _upcast, _extra = STAGE1_CASES[cid]
    elem = 4 if dtype == "fp32" else 2
    assert facts["shared"] <= stage1_smem_bytes(bn, stages, d, elem, group_block(group)), facts
    if target[0] == "cuda" and dtype != "fp32":
        assert not facts["scalar_b16_loads"], "unvectorised 2-byte global loads"
        if stages > 1:
            assert facts["cp_async_16"], "K/V loads not pipelined through 16-byte cp.async"


@pytest.mark.parametrize("cid", list(STAGE2_CASES))
def test_stage2_compiles(compiled, cid):
    facts = compiled[cid]
    assert facts["ok"], facts["error"]
    assert facts["shared"] <= 16 * 1024


@pytest.mark.parametrize("cid", [c for c, case in STAGE1_CASES.items() if case[0][0] == "cuda"])
def test_stage1_spills_where_the_rule_says(compiled, cid):
    facts = compiled[cid]
    if not facts["ok"] or "spill_store_bytes" not in facts:
        pytest.skip(f"no ptxas report: {facts.get('error') or facts.get('ptxas_error', 'ptxas not shipped')}"[:300])
    _target, dtype, d, bn, _stages, warps, group, _upcast, _extra = STAGE1_CASES[cid]
    elem = 4 if dtype == "fp32" else 2
    predicted = spill_free(bn, warps, d, elem, group_block(group))
    assert predicted == (facts["spill_store_bytes"] == 0), (
        f"spill_free says {predicted}; ptxas: {facts['registers']} registers, {facts['spill_store_bytes']} B spilled"
    )
    assert predicted == (not cid.endswith("-spills")), "case name and rule disagree"
