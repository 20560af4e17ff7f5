"""The capacity arithmetic (``cost/capacity.py``), generate's refusals made from it, and
``tree-attn fit``: parameter counts equal the models' own, the bisection finds the boundary, a
prompt that cannot fit and ``--reference on`` that cannot fit are each one line and exit 1, and
``fit`` answers in a table and in JSON. No rank is spawned and no model is loaded (the parameter
counts build the models on torch's meta device)."""

from __future__ import annotations

import json
import random

import pytest

from tree_attn.cli.app import main
from tree_attn.commands.fit import MODEL_CONFIGS, FitOptions, catalogue_key, fit, parse_memory
from tree_attn.commands.generate.memory import Budget, JobShape, check_job_fits, choose_rows, estimate_generate
from tree_attn.cost.capacity import (
    GiB,
    MiB,
    ModelDims,
    decode_activation_bytes,
    largest_prompt,
    prefill_activation_bytes,
    rank_memory,
    reference_memory,
)
from tree_attn.errors import ConfigError

TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=160, max_position_embeddings=4096)


@pytest.mark.parametrize("model_type, extra", [("llama", {}), ("llama", {"tie_word_embeddings": True}),
                                               ("llama", {"head_dim": 32}),  # head_dim != hidden / heads
                                               ("qwen2", {}), ("mistral", {"sliding_window": None})])
def test_params_equal_the_models_own_count(model_type, extra):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **extra})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    counted = sum(p.numel() for p in model.parameters())
    assert ModelDims.from_config(config.to_dict()).params() == counted


def test_llama_3_1_8b_has_its_published_size_and_kv_per_token():
    dims = ModelDims.from_config(MODEL_CONFIGS["llama-3.1-8b"])
    assert dims.params() == 8_030_261_248  # the model card's 8.03B
    assert dims.kv_bytes_per_token("bf16") == 32 * 2 * 8 * 128 * 2 == 128 * 1024
    assert dims.kv_bytes_per_token("float8_e4m3fn") == 64 * 1024  # a 1-byte KV dtype from the dtype table


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 0), ("hidden_size", -64), ("vocab_size", True),
                                        ("num_key_value_heads", 2.0), ("intermediate_size", None)])
def test_config_sizes_must_be_positive_integers(key, value):
    with pytest.raises(ConfigError, match=f"config.json: {key} must be a positive integer"):
        ModelDims.from_config({**TINY, key: value})


def test_largest_prompt_finds_the_boundary():
    for edge in (1, 2, 7, 1000, 99_999):
        assert largest_prompt(lambda n, edge=edge: n <= edge, 100_000) == edge
    assert largest_prompt(lambda n: False, 100) == 0
    assert largest_prompt(lambda n: True, 100) == 100


def test_kv_share_follows_the_zigzag_and_the_new_tokens_go_to_the_last_rank():
    dims = ModelDims.from_config(TINY)
    shares = [3, 3, 2]
    mems = [rank_memory(dims, shares=shares, rank=r, new_tokens=5, dtype="float32", kv_dtype="float32",
                        device_kind="cpu", page_size=1, preset=False, ring_decode=False) for r in range(3)]
    assert [m.tokens for m in mems] == [3, 3, 2 + 5 + 1]
    assert [m.kv for m in mems] == [t * dims.kv_bytes_per_token("float32") for t in (3, 3, 8)]


def _prefill_inventory(d: ModelDims, s: int, e: int, block: int, rows: int, cuda: bool) -> tuple[int, str]:
    """The prefill's activations listed tensor by tensor, as ``prefill_activation_bytes`` documents
    them: (elements, bytes per element) per tensor, summed per phase; the largest phase wins."""
    h, i, hq, dh = d.hidden, d.intermediate, d.q_heads, d.head_dim
    a, k = hq * dh, d.kv_heads * dh
    kept = [(s * h if d.layers > 1 else 0, e), (s * dh, e), (s * dh, e)]  # inputs_embeds, RoPE cos, sin
    phases = {
        "attention": [(s * h, e), (s * h, e), (s * a, e), (s * k, e), (s * k, e),  # input, normed, q, k, v
                      (s * 2 * k, e), (block * 2 * k, e),  # the ring's own packed block, the arriving one
                      (s * a, 4), (s * hq, 4), (s * a, e),  # float32 running out and lse, out in the dtype
                      (6 * min(s, 1024) * a, 4)]  # the merge's float32 temporaries, MERGE_ROWS rows
        + ([(s * a, 4), (block * k, 4), (block * k, 4), (3 * hq * min(s, 64) * block, 4)] if cuda else []),
        "rope": [(s * h, e), (s * h, e), (s * a, e), (s * k, e), (s * k, e), (3 * s * a, e)],
        "mlp": [(3 * s * h, e), (s * h if s > rows else 0, e), (3 * min(s, rows) * i, e)],
        "norm": [(2 * s * h, e), (2 * s * h, 4), (s * h if e != 4 else 0, 4)],
    }
    size = {name: sum(n * b for n, b in ts) for name, ts in phases.items()}
    top = max(size, key=size.get)
    return sum(n * b for n, b in kept) + size[top], top


def test_prefill_activations_equal_their_tensor_inventory():
    """Random model shapes, prompt shares, dtypes, chunk sizes and devices, so that each phase is the
    largest in some cases: every term of every phase is checked against the listed tensors."""
    rng = random.Random(3)
    won = set()
    for _ in range(400):
        kv_heads = rng.choice([1, 2, 4, 8])
        d = ModelDims(layers=rng.choice([1, 2, 32]), hidden=rng.choice([64, 512, 4096]),
                      intermediate=rng.choice([128, 1408, 14336, 30000]), q_heads=kv_heads * rng.choice([1, 2, 4, 8]),
                      kv_heads=kv_heads, head_dim=rng.choice([16, 64, 128]), vocab=1000)
        s = rng.choice([1, 63, 64, 700, 1024, 1500, 4096, 4097, 20000])
        block = rng.choice([None, s, s + rng.randint(1, 5000)])
        rows = rng.choice([512, 4096])
        dtype = rng.choice(["float32", "bfloat16", "float16"])
        kind = rng.choice(["cpu", "cuda"])
        want, top = _prefill_inventory(d, s, 4 if dtype == "float32" else 2, s if block is None else block, rows,
                                       kind == "cuda")
        got = prefill_activation_bytes(d, s, dtype, largest_block=block, mlp_rows=rows, device_kind=kind)
        assert got == want, (d, s, block, rows, dtype, kind, top)
        won.add(top)
    assert won == {"attention", "rope", "mlp", "norm"}  # every phase's terms were decisive somewhere
    assert prefill_activation_bytes(ModelDims.from_config(TINY), 0, "float32", largest_block=500) == 0


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
@pytest.mark.parametrize("preset", [False, True])
@pytest.mark.parametrize("ring", [False, True])
def test_rank_memory_parts(kind, preset, ring):
    """Shares 5, 0, 3 in pages of 4, 6 new tokens: KV in whole pages (an empty share still one page),
    activations the larger of the prefill (its own share against the largest arriving block) and
    ring decode's three layer shards, a preset built in float32 on CPU ranks, the process's part."""
    d = ModelDims.from_config(TINY)
    per_token = d.layers * 2 * d.kv_heads * d.head_dim * 2  # bfloat16 KV
    for r, (tokens, paged) in enumerate([(5, 8), (0, 4), (3 + 6 + 1, 12)]):
        m = rank_memory(d, shares=[5, 0, 3], rank=r, new_tokens=6, dtype="float16", kv_dtype="bfloat16",
                        device_kind=kind, page_size=4, preset=preset, ring_decode=ring)
        assert m.tokens == tokens and m.kv == paged * per_token
        assert m.weights == 2 * d.params()
        decode = 3 * (5 + 6 + 1) * 2 * d.kv_heads * d.head_dim * 2 if ring else 0
        assert decode_activation_bytes(d, 5 + 6 + 1, "bfloat16", ring) == decode
        prefill = _prefill_inventory(d, [5, 0, 3][r], 2, 5, 4096, kind == "cuda")[0] if r != 1 else 0
        assert m.activations == max(prefill, decode)
        assert m.load == (4 * d.params() if preset and kind == "cpu" else m.weights)
        assert m.overhead == (1024 * MiB if kind == "cuda" else 500 * MiB)
        assert m.total == max(m.weights + m.kv + m.activations, m.load) + m.overhead
        if preset and kind == "cpu":
            assert m.load > m.weights + m.kv + m.activations  # the float32 build is the peak here


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
@pytest.mark.parametrize("prompt", [1, 2, 10, 5000])
def test_reference_memory_parts(kind, prompt):
    """transformers alone: the whole KV in the dtype plus one layer's K and V again (the cache grows
    by concatenation), and its largest forward, min(chunk, prompt - 1) tokens (the last prompt token
    goes in with the first decode step), at least one: the MLP and hidden states per token and the
    mask of the forward over the context (float32 scores too on CPU, sdpa's math path)."""
    d = ModelDims.from_config(TINY)
    m = reference_memory(d, prompt_tokens=prompt, new_tokens=3, dtype="bfloat16", device_kind=kind, preset=False)
    total = prompt + 3
    layer_kv = 2 * d.kv_heads * d.head_dim * 2
    assert m.kv == total * d.layers * layer_kv + total * layer_kv and m.tokens == total
    rows = min(4096, max(prompt - 1, 1))
    per_pair = 1 + (4 * d.q_heads if kind == "cpu" else 0)
    assert m.activations == rows * (3 * d.intermediate * 2 + 6 * d.hidden * 2) + rows * total * per_pair
    assert m.weights == m.load == 2 * d.params()
    assert m.overhead == (1024 * MiB if kind == "cuda" else 500 * MiB)


def _shape(device_kind="cuda", dtype="bfloat16"):
    return JobShape(ModelDims.from_config(MODEL_CONFIGS["llama-3.1-8b"]), 32, dtype, dtype, device_kind, 16,
                    preset=False, ring_decode=True)


def test_a_prompt_beyond_capacity_is_refused_naming_what_fits():
    shape, budget = _shape(), Budget("cuda", per_device=24 * GiB, source="test")
    est = estimate_generate(shape, 1_000_000, 4, budget, 1, spawned=True)
    with pytest.raises(ConfigError) as info:
        check_job_fits(shape, est, 1_000_000, 4, limit=10_000_000)
    text = str(info.value)
    assert "\n" not in text and "1,000,000-token prompt does not fit" in text
    import re

    found = {int(w): int(n.replace(",", "")) for n, w in re.findall(r"([\d,]+) tokens on (\d+) ranks", text)}
    assert sorted(found) == [4, 8, 16] and found[4] < found[8] < found[16]
    for world, tokens in found.items():  # each named prompt fits, one more token does not
        ok = estimate_generate(shape, tokens, world, budget, 1, spawned=True)
        over = estimate_generate(shape, tokens + 1, world, budget, 1, spawned=True)
        assert ok.job_bytes() <= 24 * GiB < over.job_bytes()
    small = estimate_generate(shape, found[4], 4, budget, 1, spawned=True)
    check_job_fits(shape, small, found[4], 4, limit=10_000_000)  # no refusal


def test_reference_rows_auto_skip_and_on_refuses():
    shape = _shape()
    budget = Budget("cuda", per_device=24 * GiB, source="test")
    est = estimate_generate(shape, 100_000, 4, budget, 1, spawned=True)  # the job fits, one process does not
    assert est.job_bytes() <= 24 * GiB < est.one_process_bytes(est.reference)
    ref, one = choose_rows("auto", est)
    assert not ref.runs and not one.runs
    assert ref.reason.startswith("skipped: needs ") and "in one process, 24.0 GiB available" in ref.reason
    with pytest.raises(ConfigError, match="--reference on: the reference"):
        choose_rows("on", est)
    assert all(r.runs for r in choose_rows("on", estimate_generate(shape, 100, 4, budget, 1, spawned=True)))
    assert not any(r.runs for r in choose_rows("off", est))


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert captured.out == "" and "Traceback" not in captured.err
    return lines[0]


def _budget_of(monkeypatch, free: int):
    from tree_attn.commands.generate import memory

    monkeypatch.setattr(memory, "read_budget", lambda kind: Budget(kind, shared=free, source="test budget"))


def test_generate_refuses_a_prompt_beyond_capacity_before_loading(monkeypatch, capsys):
    pytest.importorskip("transformers")
    _budget_of(monkeypatch, 2 * GiB)
    argv = ["generate", "--device", "cpu", "-w", "2", "--preset", "llama-3.1-8b", "--layers", "1",
            "--prompt-len", "64K", "--new-tokens", "2"]
    assert main(argv) == 1
    line = _one_error_line(capsys)
    assert "65,536-token prompt does not fit" in line and "test budget" in line and "on 8 ranks" in line


def test_generate_reference_on_that_cannot_fit_is_refused(monkeypatch, capsys):
    pytest.importorskip("transformers")
    # 10 GiB: two CPU ranks of the one-layer preset fit at 32K tokens; the reference's whole context in
    # one process (sdpa's float32 scores of a 4K-token chunk over the context) does not.
    _budget_of(monkeypatch, 10 * GiB)
    argv = ["generate", "--device", "cpu", "-w", "2", "--preset", "llama-3.1-8b", "--layers", "1",
            "--prompt-len", "32K", "--new-tokens", "2", "--reference", "on"]
    assert main(argv) == 1
    line = _one_error_line(capsys)
    assert "--reference on: the reference (transformers alone) needs" in line and "--reference auto" in line


def test_fit_answers_4_rtx_4090_for_llama_3_1_8b(capsys):
    assert main(["fit", "--preset", "llama-3.1-8b", "--gpu", "rtx4090", "-g", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["params"] == 8_030_261_248 and d["layers"] == 32 and d["memory_bytes"] == 24_564 * MiB
    rows = d["rows"]
    assert [r["ranks"] for r in rows] == [4, 8, 16]
    assert 0 < rows[0]["largest_prompt"] < rows[1]["largest_prompt"] < rows[2]["largest_prompt"]
    for r in rows:
        busiest = r["busiest_rank"]
        assert busiest["total"] <= d["memory_bytes"]
        assert busiest["weights"] == 8_030_261_248 * 2
        assert r["capped_by_max_positions"] == (r["largest_prompt"] + 32 > 131072)
    # the same answer as the arithmetic generate checks
    res = fit(FitOptions(preset="llama-3.1-8b", gpu="rtx4090", gpus=4))
    assert res.rows[0].tokens == rows[0]["largest_prompt"]
    assert main(["fit", "--preset", "llama-3.1-8b", "--gpu", "rtx4090", "-g", "4"]) == 0
    table = capsys.readouterr().out
    assert "longest prompt" in table and f"{rows[0]['largest_prompt']:,}" in table and "RTX 4090" in table


def test_fit_says_why_nothing_fits(capsys):
    """The 70B's weights (131 GiB) on 24 GiB GPUs: every row 'none', which said no why."""
    assert main(["fit", "--preset", "llama-3.1-70b", "--gpu", "rtx4090", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["largest_prompt"] for r in d["rows"]] == [0, 0, 0]
    assert any("every rank holds the whole model (131.4 GiB of weights), so more GPUs do not help" in n
               for n in d["notes"]), d["notes"]
    assert main(["fit", "--preset", "llama-3.1-8b", "--gpu", "rtx4090"]) == 0
    assert "none:" not in capsys.readouterr().out  # only where a row is none


def test_fit_on_cpu_ranks_and_a_config_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(TINY, model_type="llama")))
    assert main(["fit", "--config", str(tmp_path), "--device", "cpu", "--memory", "4GiB", "-g", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["device_kind"] == "cpu" and d["rows"][0]["ranks"] == 2 and d["rows"][0]["largest_prompt"] > 0


@pytest.mark.parametrize("argv, text", [
    (["fit", "--gpu", "rtx4090"], "give one of --preset"),
    (["fit", "--preset", "nope", "--gpu", "rtx4090"], "unknown --preset 'nope'"),
    (["fit", "--preset", "llama-3.1-8b", "--gpu", "gtx480"], "unknown --gpu 'gtx480'"),
    (["fit", "--preset", "llama-3.1-8b", "--gpu", "H100"],
     "unknown --gpu 'H100'; did you mean h100-nvl, h100-pcie, h100-sxm?"),
    (["fit", "--preset", "llama-3.1-8b"], "give --gpu NAME"),
    (["fit", "--preset", "llama-3.1-8b", "--memory", "24XB"], "--memory '24XB'"),
    (["fit", "--preset", "llama-3.1-8b", "--memory", "-3GiB"], "expected a size"),
    (["fit", "--preset", "llama-3.1-8b", "--memory", "1e30GiB"], "more than 1,024 TiB"),
    (["fit", "--preset", "llama-3.1-8b", "--gpu", "rtx4090", "-g", "0"], "--gpus/-g must be"),
    (["fit", "--preset", "llama-3.1-8b", "--gpu", "rtx4090", "--dtype", "float8_e4m3fn"], "KV-cache dtype"),
    (["fit", "--preset", "llama-3.1-8b", "--gpu", "rtx4090", "--dtype", "int3"], "dtype must be one of"),
    (["fit", "--preset", "llama-3.1-8b", "--device", "cpu"], "--device cpu needs --memory"),
    (["fit", "--config", "/nonexistent/config.json", "--gpu", "rtx4090"], "not a readable config.json"),
])
def test_fit_bad_input_is_one_line(argv, text, capsys):
    assert main(argv) == 1
    assert text in _one_error_line(capsys)


def test_fit_takes_a_catalogue_name_as_people_write_it(capsys):
    assert catalogue_key("RTX 4090") == catalogue_key("rtx-4090") == catalogue_key(" RTX_4090 ") == "rtx4090"
    assert catalogue_key("H100 SXM") == "h100-sxm" and catalogue_key("MI300X") == "mi300x"
    assert main(["fit", "--preset", "llama-3.1-8b", "--gpu", "RTX-4090", "-g", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_bytes"] == 24_564 * MiB


def test_parse_memory():
    assert parse_memory("24GiB") == 24 * GiB and parse_memory("80GB") == 80 * 10**9
    assert parse_memory("512 MiB") == 512 * MiB and parse_memory("1000") == 1000


def test_fit_imports_no_torch():
    """fit is planning for a machine the user does not have: it must run where torch is absent."""
    import subprocess
    import sys

    code = ("import sys; from tree_attn.cli.app import main; "
            "rc = main(['fit', '--preset', 'llama-3.1-8b', '--gpu', 'h100-sxm', '-g', '8', '--json']); "
            "assert rc == 0 and 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["rows"][0]["ranks"] == 8
