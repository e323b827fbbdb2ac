"""The fused DDL site: each site's correction in one Triton kernel (forward), and one kernel, a matmul
and a sum (backward), in place of the formula's few dozen ops.

    import deltafy.fused
    deltafy.fused.enable(model)    # the sites on CUDA (with triton) take the fused path; returns how many
    deltafy.fused.disable(model)   # back to DeltaSite.formula

The seam is DeltaSite.fused: ``enable`` sets ``fused_write`` on each site once, so a call costs no
selection, and what the site's construction fixed (block size, warps, constants: ``kernel.plan``) is
decided on its first call; on a GPU a decode step is bound by what the host spends issuing each site
(docs/performance.md). ``fused_write`` reads the site's parameters on every call (a copy_, a ``.data =``, a
load_state_dict or an optimizer step is seen at once) and computes what the formula does, in fp32
registers, with the result in h's dtype; alpha = 0 leaves h bitwise. A learned direction's matmuls stay
in torch (their parameters' gradients with them); the sublayer direction is read from h in the kernel.
It runs the formula under torch.compile, which fuses it into the kernels around it (the kernels as
custom ops in the graph were slower on an H200: docs/performance.md), off a device the kernel runs on,
and for inputs the kernel does not take (see kernel.write). Under TRITON_INTERPRET=1, set
before triton is first imported, the kernels run on CPU tensors: that is how the tests check them.
"""

from __future__ import annotations

import os

import torch

__all__ = ["supported", "enable", "enable_where_available", "disable", "fused_write"]

_kernel = None  # deltafy.fused.kernel once imported (it imports triton); False: triton is not installed


def _load():
    global _kernel
    if _kernel is None:
        try:
            from . import kernel
        except ImportError:
            _kernel = False
        else:
            _kernel = kernel
    return _kernel


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def supported(device: torch.device | str) -> bool:
    """Whether the fused kernels run on ``device``: CUDA with triton installed, or the CPU under Triton's
    interpreter (TRITON_INTERPRET=1, read at each call; triton must have been imported under it)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and bool(_load())
    return device.type == "cpu" and _interpret() and bool(_load()) and _kernel.INTERPRETED


def fused_write(site, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """DeltaSite.fused: ``site.formula(x, c, h)`` from the fused kernels wherever they run, else the formula."""
    if not torch.compiler.is_compiling():  # (torch.compile traces the formula)
        kernel = _kernel if _kernel is not None else _load()
        if kernel and (h.is_cuda or (kernel.INTERPRETED and _interpret())):
            out = kernel.write(site, x, c, h)
            if out is not None:
                return out
    return site.formula(x, c, h)


def _sites(model: torch.nn.Module) -> list:
    # by class name: a model loaded with trust_remote_code has its checkpoint's copy of DeltaSite
    return [m for m in model.modules() if type(m).__name__ == "DeltaSite"]


def enable(model: torch.nn.Module, force: bool = False) -> int:
    """Put every DeltaSite of ``model`` whose parameters live on a supported device (every one with
    ``force``) on the fused path; returns how many were switched (0, and nothing changed, where none is
    supported). A forced site still runs the formula wherever the kernels cannot run."""
    switched = 0
    for site in _sites(model):
        param = next(site.parameters(), None)
        if force or (param is not None and supported(param.device)):
            site.fused = fused_write
            switched += 1
    return switched


def enable_where_available(model: torch.nn.Module) -> int:
    """What deltafy.convert and deltafy.load call: on a machine with CUDA and triton every site takes the
    fused path, wherever its tensors are now (the kernels run once they are on the GPU; until then the
    formula does). DELTAFY_FUSED=0 keeps the formula everywhere; elsewhere nothing changes."""
    if os.environ.get("DELTAFY_FUSED", "1") == "0" or not torch.cuda.is_available() or not _load():
        return 0
    return enable(model, force=True)


def disable(model: torch.nn.Module) -> int:
    """Put every DeltaSite of ``model`` back on the formula; returns how many were on the fused path."""
    switched = 0
    for site in _sites(model):
        if "fused" in vars(site):
            del site.fused
            switched += 1
        vars(site).pop("_fused_plan", None)
    return switched
