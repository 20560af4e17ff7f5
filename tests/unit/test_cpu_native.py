"""The fused C decode kernel for CPU tensors (tree_attn.kernels.cpu_native / cpu_decode.c).

Against the float64 truth, out and lse, with awkward shapes: N not a multiple of the kernel's
256-token chunk, rows of length 0 and partial rows, GQA 1/4/8, head sizes with and without a
specialised instance (64, 128, 256 / 80, 48), B > 1, caches that are slices or transposes of bigger
tensors, paged caches, several query tokens per row (causal or not, rows shorter than Sq), fp32/
bf16/fp16 caches, large logits, NaN, and keys split over threads (merged in C). Then
the build: the cache, the off switch, processes starting together, and a compiler that does not
work.

The kernel needs a C compiler; where none works these tests skip and say why (the torch path,
tested in test_cpu_decode.py, then serves every call).
"""

import contextlib

import pytest
import torch

from tests.fp8_inputs import quantize
from tests.paged_inputs import to_paged
from tests.tolerances import assert_state_close, random_decode_inputs
from tree_attn.kernels import cpu_native
from tree_attn.kernels.cpu_decode import decode_attention_cpu
from tree_attn.kernels.reference import decode_attention_float64

STATUS = cpu_native.native_status()


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to ``n`` inside the block (the kernel splits keys over them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
needs_kernel = pytest.mark.skipif(not STATUS.available, reason=f"the C kernel is not built here: {STATUS.detail}")


def _check(q, k, v, seq_lens=None, dtype=torch.float32, large_logits=False, **kw):
    out, lse = decode_attention_cpu(q, k, v, seq_lens=seq_lens, native=True, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    ref_out, ref_lse = decode_attention_float64(q, k, v, seq_lens=seq_lens, scale=kw.get("scale"))
    assert_state_close(out, lse, ref_out, ref_lse, dtype, large_logits=large_logits)
    return out, lse


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 2), (12, 2), (16, 2)])  # GQA 1, 3, 4, 6, 8
@pytest.mark.parametrize("d", [64, 80, 128])  # 80: the instance without a constant head size
def test_matches_float64(dtype, hq, hkv, d, c_kernel_path):
    n = 600  # 2 x 256 + 88
    q, k, v = random_decode_inputs(3, hq, hkv, d, n, dtype=dtype, seed=hq + hkv + d)
    _check(q, k, v, torch.tensor([n, 0, 257]), dtype)  # full, empty, one past a chunk


@needs_kernel
@pytest.mark.parametrize("n", [1, 255, 256, 257, 513])
def test_lengths_around_the_chunk(n, c_kernel_path):
    q, k, v = random_decode_inputs(2, 8, 8, 256, n, seed=n)
    _check(q, k, v)
    _check(q, k, v, torch.tensor([n, max(0, n - 1)]))


@needs_kernel
def test_strided_caches():
    q, k, v = random_decode_inputs(2, 8, 2, 48, 300, seed=11)
    lens = torch.tensor([300, 129])

    def views(x):
        """Views with x's values: rows, tokens and heads of a bigger cache; head-major storage
        ([B, Hkv, N, D] seen through a transpose); a padded head dimension (row stride 64)."""
        big = torch.randn(4, 310, 3, 48)
        big[::2, 5:305, 1:3] = x
        padded = torch.randn(2, 300, 2, 64)[..., :48]
        padded.copy_(x)
        return big[::2, 5:305, 1:3], x.transpose(1, 2).contiguous().transpose(1, 2), padded

    for ks, vs in zip(views(k), views(v)):
        assert not ks.is_contiguous() and ks.stride(-1) == 1 and torch.equal(ks, k) and torch.equal(vs, v)
        _check(q, ks, v, lens)
        _check(q, k, vs, lens)
        _check(q, ks, vs, lens)


@needs_kernel
def test_query_layouts():
    # [B, 1, Hq, D] queries give [B, 1, Hq, D] / [B, 1, Hq]; a non-contiguous query is read right.
    q, k, v = random_decode_inputs(2, 8, 2, 64, 100, seed=3)
    _check(q.unsqueeze(1), k, v)
    _check(torch.randn(2, 64, 8).transpose(1, 2), k, v)
    _check(q.double().float().bfloat16(), k.bfloat16(), v.bfloat16(), dtype=torch.bfloat16)


@needs_kernel
def test_large_logits_and_custom_scale():
    q, k, v = random_decode_inputs(2, 8, 2, 64, 700, seed=5, q_scale=30.0)
    _, lse = _check(q, k, v, large_logits=True)
    assert lse.abs().max() > 50
    _check(q, k, v, scale=0.01)


@needs_kernel
def test_nan_and_inf_stay_in_their_head():
    q, k, v = random_decode_inputs(2, 4, 2, 16, 600, seed=2)
    k[0, 300, 1, 3] = float("nan")  # KV head 1 of row 0: query heads 2 and 3
    k[1, 10, 0, 0] = float("inf")  # KV head 0 of row 1: an inf score, exp(inf - inf) is NaN
    out, lse = decode_attention_cpu(q, k, v, native=True)
    torch_out, torch_lse = decode_attention_cpu(q, k, v, native=False)
    assert torch.equal(out.isnan(), torch_out.isnan()) and torch.equal(lse.isnan(), torch_lse.isnan())
    assert out[0, 2:].isnan().all() and out[1, :2].isnan().all()
    ok = torch.tensor([[True, True, False, False], [False, False, True, True]])
    ref_out, ref_lse = decode_attention_float64(q, k.nan_to_num(0.0, 0.0, 0.0), v)
    assert_state_close(out[ok], lse[ok], ref_out[ok], ref_lse[ok], torch.float32)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq", [2, 6, 8, 14])  # 1, 3, 4 and 7 query rows per KV head
def test_nan_and_inf_stay_in_their_head_at_64_wide(dtype, hq, c_kernel_path):
    """The same at a head size of 64 (the 512-bit path where the build has it), a NaN value too:
    NaN in a key makes its KV head's rows NaN, +inf in a key makes them NaN (inf - inf), a NaN in
    a value makes that element of its head's rows NaN; every other row and element is exact."""
    q, k, v = random_decode_inputs(2, hq, 2, 64, 600, dtype=dtype, seed=hq)
    g = hq // 2
    k[0, 300, 1, 3] = float("nan")  # KV head 1 of row 0
    k[1, 10, 0, 0] = float("inf")  # KV head 0 of row 1 (its rows' q[0] > 0: a score of +inf)
    q[1, :g, 0] = q[1, :g, 0].abs() + 0.1
    v[1, 599, 1, 17] = float("nan")  # KV head 1 of row 1: element 17 (in the last chunk's tail)
    out, lse = decode_attention_cpu(q, k, v, native=True)
    torch_out, torch_lse = decode_attention_cpu(q, k, v, native=False)
    assert torch.equal(out.isnan(), torch_out.isnan()) and torch.equal(lse.isnan(), torch_lse.isnan())
    assert out[0, g:].isnan().all() and out[1, :g].isnan().all() and out[1, g:, 17].isnan().all()
    assert int(out.isnan().sum()) == 2 * g * 64 + g and int(lse.isnan().sum()) == 2 * g
    ok = torch.zeros(2, hq, dtype=torch.bool)
    ok[0, :g] = True
    ref_out, ref_lse = decode_attention_float64(q, k.nan_to_num(0.0, 0.0, 0.0), v.nan_to_num(0.0))
    assert_state_close(out[ok], lse[ok], ref_out[ok], ref_lse[ok], dtype)
    fin = ~out[1, g:].isnan()
    assert (out[1, g:][fin].double() - ref_out[1, g:][fin]).abs().max() < 1e-2


@needs_kernel
def test_keys_split_over_threads(monkeypatch, c_kernel_path):
    # Each row's keys in contiguous ranges, one per thread, merged exactly: ranges of 200, 134 or
    # 100 tokens (400 keys over 2, 3 and 4 threads), a row of one key (empty states in the later
    # ranges), an empty row, GQA 3.
    monkeypatch.setattr(cpu_native, "MIN_WORK_PER_THREAD", 1)  # every thread takes a range
    q, k, v = random_decode_inputs(3, 15, 5, 64, 400, seed=8)
    lens = torch.tensor([400, 1, 0])
    one = decode_attention_cpu(q, k, v, seq_lens=lens, native=True)
    for threads in (2, 3, 4):
        with torch_threads(threads):
            out, lse = _check(q, k, v, lens)
        torch.testing.assert_close(out, one[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, one[1], rtol=1e-5, atol=1e-6)
        assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()


@needs_kernel
@pytest.mark.parametrize("threads", [2, 3])
def test_threads_merge_nan_inf_and_empty_ranges_in_c(monkeypatch, threads, c_kernel_path):
    # The C side starts the threads and merges their states: a NaN key in the second range (row
    # 0, KV head 1), an inf key in the first (row 1, KV head 0: a NaN row for the query heads whose
    # score is +inf, exp(inf - inf), and an ordinary one where it is -inf), rows
    # whose keys end in the first range (the later ranges' empty states) or are none at all; both
    # through the prepared step's plan (paged) and the one-off call, against one thread.
    monkeypatch.setattr(cpu_native, "MIN_WORK_PER_THREAD", 1)  # every thread takes a range
    from tree_attn.kernels.prepared import DecodeStep

    q, k, v = random_decode_inputs(4, 8, 2, 64, 390, seed=11)
    k[0, 300, 1, 5] = float("nan")
    k[1, 7, 0, 0] = float("inf")
    lens = torch.tensor([390, 390, 100, 0])
    k, v, kp, vp, table = to_paged(k, v, lens.tolist(), 16, seed=3)  # k, v: the truth, unchanged
    with torch_threads(1):
        one_out, one_lse = decode_attention_cpu(q, k, v, seq_lens=lens, native=True)
    assert one_out[0, 4:].isnan().all() and not one_out[0, :4].isnan().any()
    assert one_out[1, :4].isnan().any() and not one_out[1, :4].isnan().all()  # +inf and -inf scores
    with torch_threads(threads):
        out, lse = decode_attention_cpu(q, k, v, seq_lens=lens, native=True)
        step = DecodeStep(q.clone(), kp, vp, lens, block_table=table, cuda_graph=False)
        step_out, step_lse = step()
        step.close()
    for got_out, got_lse in ((out, lse), (step_out, step_lse)):
        assert torch.equal(got_out.isnan(), one_out.isnan()) and torch.equal(got_lse.isnan(), one_lse.isnan())
        ok = ~one_lse.isnan()
        torch.testing.assert_close(got_out[ok], one_out[ok], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_lse[ok], one_lse[ok], rtol=1e-5, atol=1e-6)
        assert (got_out[3] == 0).all() and torch.isneginf(got_lse[3]).all()


def test_thread_parts_stay_within_the_c_limit(monkeypatch):
    # One range per torch thread, each worth at least MIN_WORK_PER_THREAD and at least one key,
    # never more than the C side takes (a 128-thread machine at 1M tokens would otherwise ask for
    # 128 and be refused).
    monkeypatch.setattr(torch, "get_num_threads", lambda: 128)
    unit = cpu_native.MIN_WORK_PER_THREAD
    assert cpu_native.thread_parts(1 << 20, unit) == cpu_native.MAX_PARTS == 64
    assert cpu_native.thread_parts(3, unit) == 3 and cpu_native.thread_parts(12, unit // 4) == 3
    assert cpu_native.thread_parts(0, unit) == 1 and cpu_native.thread_parts(7, unit // 4) == 1
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert cpu_native.thread_parts(1 << 20, unit) == 2


def test_threads_follow_the_work_not_the_key_count():
    # Llama-3.1-8B's heads (32 query / 8 KV x 128, bf16) split at 2,048 keys; a small model's
    # (8 / 2 x 64) only past 4,096, where the second thread stopped paying on the machine the
    # rule was fitted on (RESULTS.md, "Threads per call"); 4 query tokens per row count 4x the rows.
    big = cpu_native.work_per_key(1, 8, 32, 128, 2)
    small = cpu_native.work_per_key(1, 2, 8, 64, 2)
    assert big == 128 * (2 * 8 * 2 + 4 * 32) and small == 64 * (2 * 2 * 2 + 4 * 8)
    limit = cpu_native.MIN_WORK_PER_THREAD
    assert 2048 * big // limit >= 2 and 4096 * small // limit < 2 <= 8192 * small // limit
    assert cpu_native.work_per_key(1, 2, 4 * 8, 64, 2) > 3 * small


@needs_kernel
def test_parts_outside_the_c_limit_are_refused():
    kernel = cpu_native.native_kernel()
    outs, lses = torch.zeros(1), torch.zeros(1)
    with pytest.raises(RuntimeError, match="returned -4 .65 parts"):
        kernel.run((0, *([0] * 21)), 1000, 65, outs, lses)


@needs_kernel
def test_calls_it_does_not_take_say_why():
    q, k, v = random_decode_inputs(2, 8, 2, 64, 50, seed=1)
    with pytest.raises(ValueError, match="stride 1"):
        decode_attention_cpu(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, native=True)
    with pytest.raises(ValueError, match="chunking"):
        decode_attention_cpu(q, k, v, chunk_tokens=16, native=True)
    # With native=None the same calls take the torch path and are right.
    out, lse = decode_attention_cpu(q, k, v, chunk_tokens=16)
    ref_out, ref_lse = decode_attention_float64(q, k, v)
    assert_state_close(out, lse, ref_out, ref_lse, torch.float32)


def test_the_default_path_is_the_kernel_when_built():
    # What decode_attention_cpu runs by default for a plain decode call: the C kernel if this
    # process could build it (bit-identical to native=True), else the torch path.
    q, k, v = random_decode_inputs(2, 8, 2, 64, 300, seed=4)
    out, lse = decode_attention_cpu(q, k, v)
    other = decode_attention_cpu(q, k, v, native=STATUS.available)
    assert torch.equal(out, other[0]) and torch.equal(lse, other[1])


@needs_kernel
def test_the_path_switch_reaches_every_dtypes_part():
    # The library is linked from parts compiled apart (one per dtype, one for the entry points):
    # the switch the tests use to run the other paths must reach each dtype's instances. The two
    # paths sum in different orders, so their states (out or lse) differ in the last bits (fixed
    # inputs: the same bits on every run of a build) while they agree (each path's exactness is
    # the other tests' subject).
    kernel = cpu_native.native_kernel()
    if not kernel.use_wide(True):
        pytest.skip("this build of the C kernel has no 512-bit path (needs AVX-512 F, BW and VBMI)")
    q, k, v = random_decode_inputs(2, 8, 2, 128, 700, seed=5)  # 4 rows per KV head
    for kv_dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        if kv_dtype.itemsize == 1:
            (k_, ks), (v_, vs) = quantize(k, kv_dtype), quantize(v, kv_dtype)
            kw = dict(k_scale=ks, v_scale=vs)
        else:
            k_, v_, kw = k.to(kv_dtype), v.to(kv_dtype), {}
        states = []
        for wide in (False, True):
            kernel.use_wide(wide)
            try:
                states.append(decode_attention_cpu(q, k_, v_, native=True, **kw))
            finally:
                kernel.use_wide(True)
        (out0, lse0), (out1, lse1) = states
        assert_state_close(out1, lse1, out0.double(), lse0.double(), torch.float32)
        assert not (torch.equal(out0, out1) and torch.equal(lse0, lse1)), kv_dtype


@needs_kernel
def test_build_cache_and_switch(tmp_path, monkeypatch, capsys):
    # A fresh cache folder: the library is built there, named by its key, with no temporary left,
    # and the build says so on stderr (once: not when it is loaded from the cache). Built at -O0
    # (the last -O wins; ~3 s, not ~30): the caching is under test here, and the session's real
    # build (tests/conftest.py) is the -O3 one.
    monkeypatch.setenv("TREE_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_native, "BASE_FLAGS", (*cpu_native.BASE_FLAGS, "-O0"))
    kernel = cpu_native._load()
    assert capsys.readouterr().err.count("building the CPU decode kernel") == 1
    built = sorted(p.name for p in (tmp_path / "native").iterdir() if p.name != ".build.lock")
    assert built == [kernel.path.name] and kernel.path.name.startswith("cpu_decode-") and kernel.path.suffix == ".so"
    assert torch.float32 in kernel.dtypes
    again = cpu_native._load()  # loaded from the cache, not rebuilt
    assert again.path == kernel.path and kernel.path.stat().st_mtime_ns == again.path.stat().st_mtime_ns
    assert "building" not in capsys.readouterr().err
    monkeypatch.setenv("TREE_ATTN_CPU_KERNEL", "torch")
    with pytest.raises(cpu_native._Unavailable, match="TREE_ATTN_CPU_KERNEL=torch"):
        cpu_native._load()


def test_a_compiler_that_fails_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("TREE_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_native, "SOURCE", tmp_path / "cpu_decode.c")  # an install without it
    with pytest.raises(cpu_native._Unavailable, match="source is missing"):
        cpu_native._load()
    monkeypatch.undo()
    monkeypatch.setenv("TREE_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # exits 1 for anything
    with pytest.raises(cpu_native._Unavailable, match="failed"):
        cpu_native._load()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PATH", str(tmp_path))  # and no cc either
    with pytest.raises(cpu_native._Unavailable, match="no C compiler"):
        cpu_native._load()
    # A compiler that answers but cannot build: the reason is its error, and no file is left.
    fake = tmp_path / "broken-cc"
    fake.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo broken-cc 1.0; exit 0; fi\n'
                    'echo "error: no" >&2\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.raises(cpu_native._Unavailable, match="compiling cpu_decode.c .*error: no"):
        cpu_native._load()
    assert not list((tmp_path / "native").glob("*.so*"))  # nothing half-written left behind


@needs_kernel
def test_processes_starting_together_build_once(tmp_path):
    # Three processes with an empty cache at once (as ranks start): each loads a whole library, and
    # the cache holds exactly one, with no temporary file left.
    import subprocess
    import sys

    code = ("from tree_attn.kernels import cpu_native as c; c.BASE_FLAGS += ('-O0',); "  # -O0: a quick build
            "s = c.native_status(); print(s.available, s.detail)")
    env = {**__import__("os").environ, "TREE_ATTN_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs) and all(o.startswith("True cpu_decode-") for o in outs), outs
    assert len({o.split()[1] for o in outs}) == 1
    assert [p.name for p in (tmp_path / "native").glob("*.so*")] == [outs[0].split()[1]]


@needs_kernel
@pytest.mark.parametrize("block_size", [1, 16, 48])  # 48: not a power of two, not a chunk divisor
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_caches(block_size, dtype, c_kernel_path):
    # Pages shuffled in the pool, two rows sharing their first page, spare blocks and everything a
    # kernel must not read set to NaN (a wrong page or a read past a row's length gives NaN).
    q, k, v = random_decode_inputs(3, 16, 4, 64, 600, dtype=dtype, seed=block_size)
    lens = torch.tensor([600, 257, 0])
    k, v, k_pool, v_pool, table = to_paged(k, v, lens, block_size, seed=1, share=True)
    out, lse = decode_attention_cpu(q, k_pool, v_pool, seq_lens=lens, block_table=table, native=True)
    ref_out, ref_lse = decode_attention_float64(q, k, v, seq_lens=lens)
    assert_state_close(out, lse, ref_out, ref_lse, dtype)
    torch_out, torch_lse = decode_attention_cpu(q, k_pool, v_pool, seq_lens=lens, block_table=table, native=False)
    assert_state_close(torch_out, torch_lse, ref_out, ref_lse, dtype)


@needs_kernel
def test_paged_cache_split_over_threads(monkeypatch, c_kernel_path):
    monkeypatch.setattr(cpu_native, "MIN_WORK_PER_THREAD", 1)  # every thread takes a range
    q, k, v = random_decode_inputs(2, 8, 2, 128, 500, seed=12)
    lens = torch.tensor([500, 130])
    k, v, k_pool, v_pool, table = to_paged(k, v, lens, 16, seed=3, pad=-1)
    ref_out, ref_lse = decode_attention_float64(q, k, v, seq_lens=lens)
    with torch_threads(3):
        out, lse = decode_attention_cpu(q, k_pool, v_pool, seq_lens=lens, block_table=table, native=True)
    assert_state_close(out, lse, ref_out, ref_lse, torch.float32)


@needs_kernel
@pytest.mark.parametrize("sq", [2, 3, 4, 16])  # 8, 12, 16, 64 query rows per KV head
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_several_query_tokens(sq, causal, paged, c_kernel_path):
    # Rows of 600 (the new tokens across a chunk boundary when 600 - sq < 512), 257, sq - 1 (under
    # causal its first token sees no key: out 0, lse -inf) and 0.
    _, k, v = random_decode_inputs(4, 8, 2, 64, 600, seed=sq)
    q = torch.randn(4, sq, 8, 64, generator=torch.Generator().manual_seed(sq))
    lens = torch.tensor([600, 257, sq - 1, 0])
    kk, vv = k, v
    table = None
    if paged:
        k, v, kk, vv, table = to_paged(k, v, lens, 16, seed=sq)
    out, lse = decode_attention_cpu(q, kk, vv, seq_lens=lens, block_table=table, causal=causal, native=True)
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    ref_out, ref_lse = decode_attention_float64(q, k, v, seq_lens=lens, causal=causal)
    assert_state_close(out, lse, ref_out, ref_lse, torch.float32)
    if causal:
        assert (out[2, 0] == 0).all() and torch.isneginf(lse[2, 0]).all()


@needs_kernel
def test_several_query_tokens_split_over_threads(monkeypatch):
    monkeypatch.setattr(cpu_native, "MIN_WORK_PER_THREAD", 1)  # every thread takes a range
    _, k, v = random_decode_inputs(2, 8, 2, 64, 400, seed=21)
    q = torch.randn(2, 4, 8, 64, generator=torch.Generator().manual_seed(21))
    lens = torch.tensor([400, 130])  # the new tokens all in the last range
    ref_out, ref_lse = decode_attention_float64(q, k, v, seq_lens=lens, causal=True)
    with torch_threads(3):
        out, lse = decode_attention_cpu(q, k, v, seq_lens=lens, causal=True, native=True)
    assert_state_close(out, lse, ref_out, ref_lse, torch.float32)


@needs_kernel
def test_default_path_by_rows_per_kv_head():
    # By default the kernel takes calls of at most NATIVE_MAX_QUERY_ROWS query rows per KV head
    # (Sq x G) and MKL's products the rest: each default result is bit-identical to its path.
    from tree_attn.kernels.cpu_decode import NATIVE_MAX_QUERY_ROWS

    _, k, v = random_decode_inputs(1, 32, 8, 64, 300, seed=5)  # G = 4
    lens = torch.tensor([300])
    for sq in (1, 4, 8):
        q = torch.randn(1, sq, 32, 64, generator=torch.Generator().manual_seed(sq))
        expect_native = sq * 4 <= NATIVE_MAX_QUERY_ROWS
        out, lse = decode_attention_cpu(q, k, v, seq_lens=lens, causal=True)
        other = decode_attention_cpu(q, k, v, seq_lens=lens, causal=True, native=expect_native)
        assert torch.equal(out, other[0]) and torch.equal(lse, other[1]), sq
