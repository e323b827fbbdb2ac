"""The fused kernels run under Triton's interpreter here, on CPU tensors. Triton builds its own library
functions (tl.sum, ...) for the interpreter only if TRITON_INTERPRET=1 is set when it is first imported,
so it is set as pytest loads this file (collection imports nothing that imports triton) and triton is
imported now; each test of this folder then runs with the variable set (supported() reads it per call)."""

from __future__ import annotations

import os

import pytest

_before = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
import deltafy.fused.kernel  # noqa: E402, F401  (imports triton under the interpreter)

# the rest of the session (and its child processes) sees the environment it started with
if _before is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _before


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
