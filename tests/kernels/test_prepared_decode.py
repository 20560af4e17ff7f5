"""Local decode attention resolved once per signature (kernels/prepared.py): the cache, the packed
layout a reduction sends, the static-buffer DecodeStep, and NaN in the data.

Runs the Triton path on the GPU when there is one, else in Triton's interpreter (``device``
fixture), and the torch path on CPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.tolerances import assert_decode_close, tol_for
from tree_attn import DecodeStep, decode_attention
from tree_attn.errors import ConfigError, ShapeError
from tree_attn.kernels.config import DecodeConfig
from tree_attn.kernels.layout import PACKED
from tree_attn.kernels.prepared import PreparedDecode, clear_cache, prepared_decode
from tree_attn.kernels.reference import decode_attention_float64

pytest.importorskip("triton")

IMPLS = ["torch", "triton"]


def _inputs(device, b=2, hq=8, hkv=2, d=32, n=45, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, d, generator=g).to(dtype).to(device)
    k = torch.randn(b, n, hkv, d, generator=g).to(dtype).to(device)
    v = torch.randn(b, n, hkv, d, generator=g).to(dtype).to(device)
    return q, k, v


def _where(impl, device):
    return device if impl == "triton" else torch.device("cpu")


def test_same_signature_same_prepared_object_new_signature_new_one(device):
    clear_cache()
    q, k, v = _inputs(device)
    lens = torch.tensor([45, 3], dtype=torch.int32, device=device)
    cfg = DecodeConfig(block_n=16, num_splits=3)
    a = prepared_decode(q, k, v, lens, impl="triton", config=cfg)
    assert prepared_decode(q.clone(), k.clone(), v.clone(), lens.clone(), impl="triton", config=cfg) is a
    # anything the resolution read is part of the key: a strided view, seq_lens' dtype, the config
    assert prepared_decode(q, k[:, :40], v[:, :40], lens.clamp(max=40), impl="triton", config=cfg) is not a
    assert prepared_decode(q, k, v, lens.long(), impl="triton", config=cfg) is not a
    assert prepared_decode(q, k, v, lens, impl="triton", config=DecodeConfig(block_n=32, num_splits=2)) is not a
    assert a.config.num_splits == 3 and a.shape.kv_len == 45
    # a scale given as a tensor is keyed by its value, like the float
    b = prepared_decode(q, k, v, lens, impl="triton", config=cfg, scale=0.25)
    assert prepared_decode(q, k, v, lens, impl="triton", config=cfg, scale=torch.tensor(0.25)) is b
    # another thread gets its own (one workspace serves one call at a time)
    import threading

    other = []
    t = threading.Thread(target=lambda: other.append(prepared_decode(q, k, v, lens, impl="triton", config=cfg)))
    t.start()
    t.join()
    assert other[0] is not a and prepared_decode(q, k, v, lens, impl="triton", config=cfg) is a


def test_calls_return_fresh_tensors(device):
    """The cached object reuses its workspace, never the outputs it hands back."""
    q, k, v = _inputs(device)
    out1, lse1 = decode_attention(q, k, v)
    keep = out1.clone(), lse1.clone()
    out2, _ = decode_attention(q * 2, k, v)
    assert out2.data_ptr() != out1.data_ptr()
    assert torch.equal(out1, keep[0]) and torch.equal(lse1, keep[1])


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_layout_is_the_message_a_reduction_sends(impl, device):
    where = _where(impl, device)
    q, k, v = _inputs(where, b=3, hq=4, hkv=1, d=24, n=37, seed=3)
    lens = torch.tensor([37, 0, 20], device=where)
    prep = PreparedDecode(q, k, v, lens, impl=impl, config=DecodeConfig(block_n=16, num_splits=2), out_layout=PACKED)
    msg = torch.full((3, 4, 25), float("nan"), device=where)  # poisoned: every element must be written
    prep(q, k, v, lens, msg[..., :24], msg[..., 24])
    ref_out, ref_lse = decode_attention_float64(q, k, v, seq_lens=lens)
    assert_decode_close(msg[..., :24], msg[..., 24], ref_out, ref_lse, tol_for(torch.float32, device=where), what=impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_step_follows_in_place_updates(impl, dtype, device):
    """A static-buffer loop: the cache has capacity 50, rows grow, q changes in place each step."""
    where = _where(impl, device)
    q, k, v = _inputs(where, b=2, hq=8, hkv=2, d=32, n=50, dtype=dtype, seed=4)
    lens = torch.tensor([10, 0], dtype=torch.int32, device=where)
    step = DecodeStep(q, k, v, lens, impl=impl,
                      config=DecodeConfig(block_n=16, num_splits=2) if impl == "triton" else None)
    assert step.captured == (where.type == "cuda")
    assert step.why_eager is None if step.captured else "nothing to capture" in step.why_eager
    g = torch.Generator().manual_seed(9)
    for s in range(4):
        q.copy_(torch.randn(q.shape, generator=g).to(dtype))
        lens += torch.tensor([7, 3], dtype=torch.int32, device=where)
        out, lse = step()
        assert out.data_ptr() == step.out.data_ptr()  # static outputs
        ref_out, ref_lse = decode_attention_float64(q, k, v, seq_lens=lens)
        assert_decode_close(out, lse, ref_out, ref_lse, tol_for(dtype, device=where), what=f"{impl} step {s}")


def test_a_closed_step_frees_its_graph_and_refuses_to_run(device):
    """close() (or leaving the with-block) frees the CUDA graph, which NCCL's teardown would wait
    for; the step cannot run after it, and closing twice is harmless."""
    q, k, v = _inputs(device, n=20)
    with DecodeStep(q, k, v, impl="torch" if device.type == "cpu" else "auto") as step:
        out, _ = step()
        assert torch.isfinite(out).all()
    assert step.graph.graph is None and step.graph.closed
    with pytest.raises(RuntimeError, match="closed"):
        step()
    step.close()


def test_a_failed_capture_runs_eagerly_unless_the_step_communicates(monkeypatch):
    """A local step whose capture fails falls back to eager calls (same results). A step that
    talks to other ranks does not: the failure may have left an NCCL group half open."""
    from tree_attn import graphs
    from tree_attn.errors import DistributedError

    calls = []

    class FailingGraph:
        def replay(self):
            raise AssertionError("a failed capture is never replayed")

    class FailingCapture:
        def __init__(self, graph, **kw):
            pass

        def __enter__(self):
            raise RuntimeError("operation not permitted when stream is capturing")

        def __exit__(self, *exc):
            return False

    # Stand-ins for the CUDA calls _capture makes, so its failure path runs on any machine.
    cuda = graphs.torch.cuda
    monkeypatch.setattr(cuda, "current_stream",
                        lambda device=None: type("S", (), {"wait_stream": lambda self, o: None})())
    monkeypatch.setattr(cuda, "Stream", lambda device=None: type("S", (), {"wait_stream": lambda self, o: None})())
    monkeypatch.setattr(cuda, "set_stream", lambda s: None)
    monkeypatch.setattr(cuda, "stream", lambda s: __import__("contextlib").nullcontext())
    monkeypatch.setattr(cuda, "CUDAGraph", FailingGraph)
    monkeypatch.setattr(cuda, "graph", FailingCapture)
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        local = graphs.CapturedStep(lambda: calls.append(1) or len(calls), torch.device("cuda", 0))
    assert not local.captured and "operation not permitted" in local.why_eager
    assert local() == len(calls)  # eager: fn itself runs
    with pytest.raises(DistributedError, match="--no-cuda-graph"):
        graphs.CapturedStep(lambda: None, torch.device("cuda", 0), communicates=True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy warns on the NaN it must carry
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("what", ["key", "value", "query"])
def test_nan_in_the_data_is_nan_in_that_row(impl, what, device):
    """As torch SDPA: NaN data gives NaN where it reaches (a NaN key: every head of its KV head
    in that row; a NaN value element: that dim), never a silent answer over the other keys;
    NaN past a row's valid length is never read; an empty row stays out 0, lse -inf."""
    where = _where(impl, device)
    q, k, v = _inputs(where, b=3, hq=4, hkv=2, d=16, n=40, seed=5)
    lens = torch.tensor([40, 30, 0], device=where)
    k[1, 35:] = float("nan")  # past row 1's length: ignored
    v[1, 35:] = float("nan")
    if what == "key":
        k[0, 33, 1, 2] = float("nan")
    elif what == "value":
        v[0, 33, 1, 2] = float("nan")
    else:
        q[0, 1, 0] = float("nan")
    cfg = DecodeConfig(block_n=16, num_splits=3) if impl == "triton" else None
    out, lse = decode_attention(q, k, v, seq_lens=lens, impl=impl, config=cfg)
    out, lse = out.cpu(), lse.cpu()
    if what == "key":
        expect_out = torch.zeros(3, 4, 16, dtype=torch.bool)
        expect_out[0, 2:4] = True  # query heads 2, 3 read KV head 1
        expect_lse = expect_out.any(-1)
    elif what == "value":
        expect_out = torch.zeros(3, 4, 16, dtype=torch.bool)
        expect_out[0, 2:4, 2] = True
        expect_lse = torch.zeros(3, 4, dtype=torch.bool)
    else:
        expect_out = torch.zeros(3, 4, 16, dtype=torch.bool)
        expect_out[0, 1] = True
        expect_lse = expect_out.any(-1)
    assert torch.equal(torch.isnan(out), expect_out), f"{impl}/{what}: NaN where it reaches, nowhere else"
    assert torch.equal(torch.isnan(lse), expect_lse), f"{impl}/{what}"
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()


def test_bad_config_and_scale_are_config_errors(device):
    q, k, v = _inputs(device)
    with pytest.raises(ConfigError, match="DecodeConfig"):
        prepared_decode(q, k, v, impl="triton", config={"block_n": 16})
    with pytest.raises(ConfigError, match="scale"):
        decode_attention(q, k, v, scale=float("nan"))


def test_seq_lens_values_still_checked_on_a_cache_hit():
    q, k, v = _inputs("cpu")
    decode_attention(q, k, v, seq_lens=torch.tensor([45, 3]))
    with pytest.raises(ShapeError, match="0..N=45"):
        decode_attention(q, k, v, seq_lens=torch.tensor([46, 3]))


@pytest.mark.parametrize("impl", IMPLS)
def test_objects_built_in_inference_mode_serve_outside_it_and_back(impl, device):
    """A prepared object first built inside ``torch.inference_mode`` (a server's warm-up) keeps
    normal tensors, so the same signature serves calls outside it, and a DecodeStep built inside
    runs outside; and the reverse. (Its buffers were inference tensors: the next call outside
    raised torch's "Inplace update to inference tensor outside InferenceMode".)"""
    where = _where(impl, device)
    clear_cache()
    q, k, v = _inputs(where, b=2, hq=4, hkv=2, d=24, n=19, seed=11)
    lens = torch.tensor([19, 5], device=where)
    ref_out, ref_lse = decode_attention_float64(q, k, v, seq_lens=lens)
    tol = tol_for(torch.float32, device=where)
    with torch.inference_mode():
        inside = decode_attention(q, k, v, seq_lens=lens, impl=impl)
        step = DecodeStep(q, k, v, lens, impl=impl)
    for what, (out, lse) in {"call in the mode": inside,
                             "call outside": decode_attention(q, k, v, seq_lens=lens, impl=impl),
                             "step outside": step()}.items():
        assert_decode_close(out, lse, ref_out, ref_lse, tol, what=f"{impl}: {what}")
    step = DecodeStep(q, k, v, lens, impl=impl)
    with torch.inference_mode():
        out, lse = step()
    assert_decode_close(out, lse, ref_out, ref_lse, tol, what=f"{impl}: step built outside, run inside")
