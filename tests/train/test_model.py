"""lowvram.train.build.model: what loading the model leaves on the user's terminal."""

from __future__ import annotations

import logging

import pytest


def test_int8_on_cuda_does_not_log_at_every_linear_call(caplog):
    """issue 41 item 10: bitsandbytes' MatMul8bitLt (the int8 path on CUDA: autograd/_functions.py
    ``matmul`` takes MatMul8bitFp in training on the CPU only) logs "inputs will be cast ... to
    float16" at every call with bf16 inputs; the filter on the parent logger "bitsandbytes" never
    saw it (a logger's filters act on its own records only). Run here on the CPU, the same code."""
    bnb = pytest.importorskip("bitsandbytes")
    import torch
    from bitsandbytes.autograd._functions import MatMul8bitLt, MatmulLtState

    from lowvram.train.build.model import quiet_libraries

    quiet_libraries()
    a = torch.randn(4, 16, dtype=torch.bfloat16)
    weight = torch.randn(8, 16, dtype=torch.float16)
    source = "bitsandbytes.autograd._functions"
    with caplog.at_level(logging.WARNING, logger=source):
        for _ in range(3):
            out = MatMul8bitLt.apply(a, weight, None, None, MatmulLtState())
        assert out.shape == (4, 8)
        assert [r.getMessage() for r in caplog.records if r.name == source] == []
        # precise: another warning of the same logger still reaches the user
        logging.getLogger(source).warning("something else")
    assert [r.getMessage() for r in caplog.records if r.name == source] == ["something else"]
    assert bnb.__version__
