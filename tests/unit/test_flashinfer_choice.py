"""The flashinfer backend's tensor-core decode choice (importable without flashinfer or a GPU)."""

from __future__ import annotations

import pytest

from pd_serve.engine.attention.flashinfer_backend import TENSOR_CORES_ENV, decode_uses_tensor_cores


def test_by_gqa_group_size_unless_overridden(monkeypatch):
    monkeypatch.delenv(TENSOR_CORES_ENV, raising=False)
    assert decode_uses_tensor_cores(32, 8)  # Llama-3-8B: group 4
    assert not decode_uses_tensor_cores(16, 8) and not decode_uses_tensor_cores(8, 8)
    for value, want in (("0", False), ("off", False), ("FALSE", False), ("1", True), ("true", True)):
        monkeypatch.setenv(TENSOR_CORES_ENV, value)
        assert decode_uses_tensor_cores(32, 8) is want and decode_uses_tensor_cores(8, 8) is want
    monkeypatch.setenv(TENSOR_CORES_ENV, "maybe")
    with pytest.raises(ValueError, match=f"{TENSOR_CORES_ENV}='maybe': use 1/true/on or 0/false/off"):
        decode_uses_tensor_cores(32, 8)
