"""The two-stage argmax kernel against torch.argmax: the same index in every case, ties, NaN,
infinities and signed zeros included.

On CPU the kernels run in Triton's interpreter; on a CUDA machine the cuda-parametrised tests
compile them, at Llama-3.1-8B's vocabulary too.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

from kernels import argmax as argmax_module
from kernels.argmax import argmax

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=needs_cuda)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NAN, INF = float("nan"), float("inf")


@contextlib.contextmanager
def expect_launches(n: int):
    before = argmax_module.triton_launches
    yield
    assert argmax_module.triton_launches - before == n, "the Triton path did not run"


def check(logits: torch.Tensor) -> None:
    with expect_launches(1):
        got = argmax(logits)
    want = torch.argmax(logits.cpu(), dim=-1)
    assert got.dtype == torch.int64 and got.device == logits.device
    assert got.cpu().tolist() == want.tolist()


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 4097), (2, 49152), (5, 12_345)])
@pytest.mark.parametrize("device", DEVICES)
def test_random_rows_match_torch(device, rows, vocab, dtype):
    g = torch.Generator().manual_seed(rows * vocab)
    check((torch.randn(rows, vocab, generator=g) * 4).to(device, dtype))


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_ties_nan_infinities_and_zeros_choose_as_torch(device):
    vocab = 3 * 4096 + 5  # four first-stage blocks, the last one ragged
    rows = torch.full((10, vocab), -1.0)
    rows[0, [7, 4100, 12_290]] = 5.0  # a tie across blocks: the lowest index
    rows[1, [9000, 9001]] = 5.0  # a tie within a block
    rows[2, [6000, 30]] = NAN  # NaN beats everything: the first NaN
    rows[3, 5] = INF
    rows[3, 8000] = NAN  # NaN after +inf still wins
    rows[4] = -INF  # every entry -inf: index 0
    rows[5] = 0.0
    rows[5, :100] = -0.0  # -0.0 == +0.0: index 0
    rows[6, vocab - 1] = 2.0  # the maximum in the ragged tail
    rows[7] = -3.0e38
    rows[7, 4096] = -2.9e38  # negative values order as floats do
    rows[8, 2] = INF
    rows[8, 1] = INF  # equal infinities: the lower index
    rows[9, 4000] = 7.0
    rows[9, 9000] = -torch.tensor(NAN)  # a NaN with the sign bit set is a NaN all the same
    assert rows[9, 9000].view(torch.int32) < 0
    check(rows.to(device))


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_strided_rows_and_out_buffer(device):
    wide = torch.randn(4, 5000, generator=torch.Generator().manual_seed(3)).to(device)
    logits = wide[:, :4500]  # a row stride past the vocabulary
    out = torch.full((4,), -1, dtype=torch.int64, device=device)
    with expect_launches(1):
        result = argmax(logits, out=out)
    assert result is out
    assert out.cpu().tolist() == torch.argmax(logits.cpu(), dim=-1).tolist()
    check(wide.t())  # [5000, 4]: the last dim strided, copied first


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_llama3_vocabulary_on_gpu(device, rows):
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 128_256, generator=g).to(device)
    logits[0, [100, 128_000]] = 50.0
    check(logits)


def test_cpu_without_interpreter_is_torch_argmax(monkeypatch):
    monkeypatch.setenv("PD_SERVE_TRITON_CPU", "0")
    logits = torch.randn(3, 100)
    with expect_launches(0):
        assert argmax(logits).tolist() == torch.argmax(logits, dim=-1).tolist()


@pytest.mark.parametrize("bad, out, match", [
    (torch.zeros(5), None, r"\[B, V\]"),
    (torch.zeros(2, 5, dtype=torch.int32), None, r"\[B, V\]"),
    (torch.zeros(2, 0), None, "vocabulary"),
    (torch.zeros(2, 5), torch.zeros(2, dtype=torch.int32), "int64"),
    (torch.zeros(2, 5), torch.zeros(3, dtype=torch.int64), "int64"),
])
def test_bad_input_is_a_clear_error(bad, out, match):
    with pytest.raises(ValueError, match=match):
        argmax(bad, out=out)
