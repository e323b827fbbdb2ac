"""The Triton kernels of a fused DDL site and the autograd.Function that launches them.

One program per token row holds the row's context c, write h, direction kr and each channel x_j in
fp32 registers: every reduction of the formula (|c|, the gate and target heads, |kr|, kr.x_j, |x_j|)
and the write itself happen in that one pass. The backward kernel recomputes the same quantities from
the saved inputs (nothing but the inputs is saved) and writes the inputs' gradients and, per row, the
heads' output gradients; the head parameters' gradients are then a matmul and a sum over the rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


# fmt: off
@triton.jit
def _recompute(c_ptr, h_ptr, kr_ptr, wg_ptr, bg_ptr, cols, mask, eps2, LEARNED: tl.constexpr):
    # the row's quantities that the forward and the backward both need; pointers at the row's start
    cv = tl.load(c_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    hv = tl.load(h_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rc = 1.0 / tl.sqrt(tl.sum(cv * cv, axis=0) + 1e-6)
    unit = cv * rc
    wg = tl.load(wg_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.sum(unit * wg, axis=0) + tl.load(bg_ptr).to(tl.float32)
    if LEARNED:
        # the direction head is linear: direction(unit) = rc direction(c), so the launcher passes
        # direction(c) and the row's 1/|c| is applied here
        raw = tl.load(kr_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        k = raw * rc
    else:
        raw = hv
        k = hv
    inv_n = 1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps2)
    sig = 1.0 / (1.0 + tl.exp(-g))
    return cv, hv, rc, unit, wg, sig, raw, k, inv_n


@triton.jit
def _forward_kernel(x_ptr, c_ptr, h_ptr, kr_ptr, wg_ptr, bg_ptr, wt_ptr, bt_ptr, alpha_ptr, out_ptr,
                    s_j, d, eps2, inv_sqrt_d, neg_two_over_m,
                    CHANNELS: tl.constexpr, LEARNED: tl.constexpr, STRENGTH: tl.constexpr, BLOCK: tl.constexpr):
    # every tensor is contiguous: a row is d elements, a channel (of x and out) s_j = rows * d
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    cv, hv, rc, unit, wg, sig, raw, k, inv_n = _recompute(
        c_ptr + row * d, h_ptr + row * d, kr_ptr + row * d, wg_ptr, bg_ptr, cols, mask, eps2, LEARNED)
    if STRENGTH:
        alpha = tl.load(alpha_ptr).to(tl.float32)
    else:
        alpha = 1.0
    scale = sig * inv_n * alpha  # alpha = 0 (a fresh strength gate): every coef is 0 and h' = h exactly
    # channel j's rows: the pointers step by s_j (64-bit pointers: no int32 j * s_j)
    x_ptr += row * d
    out_ptr += row * d
    for j in tl.static_range(CHANNELS):
        xv = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        wt = tl.load(wt_ptr + j * d + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.sum(unit * wt, axis=0) + tl.load(bt_ptr + j).to(tl.float32)
        miss = tl.sum(k * xv, axis=0) * inv_n - u * tl.sqrt(tl.sum(xv * xv, axis=0)) * inv_sqrt_d
        out = hv + k * (scale * miss * neg_two_over_m)
        tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
        x_ptr += s_j
        out_ptr += s_j


@triton.jit
def _backward_kernel(x_ptr, c_ptr, h_ptr, kr_ptr, wg_ptr, bg_ptr, wt_ptr, bt_ptr, alpha_ptr, go_ptr,
                     dx_ptr, dc_ptr, dh_ptr, dkr_ptr, unit_ptr, dgu_ptr,
                     s_j, d, eps2, inv_sqrt_d, neg_two_over_m,
                     CHANNELS: tl.constexpr, LEARNED: tl.constexpr, STRENGTH: tl.constexpr, BLOCK: tl.constexpr):
    # every tensor is contiguous: x, go and dx (channels, rows, d), a channel s_j = rows * d apart; dc, dh,
    # dkr, unit (rows, d); dgu (rows, channels + 2)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    # At a 13B's width (a block of 8192 over 16 warps) a thread holds 16 values of each row vector in its 128
    # registers: what is live beyond about seven vectors spills to memory. So c, raw kr and w_g are not kept
    # (the gradients are written through unit and k, and w_g is read again at the end).
    _, _, rc, unit, _, sig, _, k, inv_n = _recompute(
        c_ptr + row * d, h_ptr + row * d, kr_ptr + row * d, wg_ptr, bg_ptr, cols, mask, eps2, LEARNED)
    if STRENGTH:
        alpha = tl.load(alpha_ptr).to(tl.float32)
    else:
        alpha = 1.0
    dgu_ptr += row * (CHANNELS + 2)
    dh = tl.zeros([BLOCK], dtype=tl.float32)
    dk = tl.zeros([BLOCK], dtype=tl.float32)
    dunit = tl.zeros([BLOCK], dtype=tl.float32)
    dsig = 0.0
    dinv = 0.0
    dalpha = 0.0
    x_ptr += row * d
    go_ptr += row * d
    dx_ptr += row * d
    for j in range(CHANNELS):  # a loop, not unrolled: unrolled, the channels' rows would be live together
        xv = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        go = tl.load(go_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        wt = tl.load(wt_ptr + j * d + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.sum(unit * wt, axis=0) + tl.load(bt_ptr + j).to(tl.float32)
        dot = tl.sum(k * xv, axis=0)
        nx = tl.sqrt(tl.sum(xv * xv, axis=0))
        miss = dot * inv_n - u * nx * inv_sqrt_d
        # h'_j = h + (-2/m) coef_j k,  coef_j = sig miss_j inv_n alpha,  miss_j = k.x_j inv_n - u_j |x_j| / sqrt(d)
        dh += go
        dk += (neg_two_over_m * sig * miss * inv_n * alpha) * go
        dcoef = neg_two_over_m * tl.sum(go * k, axis=0)
        dsig += dcoef * miss * inv_n * alpha
        dalpha += dcoef * sig * miss * inv_n
        dmiss = dcoef * sig * inv_n * alpha
        dinv += dcoef * sig * miss * alpha + dmiss * dot
        du = -dmiss * nx * inv_sqrt_d
        dnx = -dmiss * u * inv_sqrt_d
        dk += (dmiss * inv_n) * xv
        dx = (dmiss * inv_n) * k + tl.where(nx > 0, dnx / nx, 0.0) * xv  # |x|'s gradient at 0 is 0, as torch's
        tl.store(dx_ptr + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dunit += du * wt
        tl.store(dgu_ptr + 1 + j, du)
        x_ptr += s_j
        go_ptr += s_j
        dx_ptr += s_j
    dk += (-dinv * inv_n * inv_n * inv_n) * k  # inv_n = (k.k + eps^2)^-1/2
    dg = dsig * sig * (1.0 - sig)
    dunit += dg * tl.load(wg_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # the gradient through rc = (c.c + 1e-6)^-1/2 of unit = rc c and (learned) k = rc raw, as rc times
    # (dunit - s unit): s = (dunit.c + dk.raw) rc^2 = dunit.unit + dk.k
    s = tl.sum(dunit * unit, axis=0)
    if LEARNED:
        tl.store(dkr_ptr + row * d + cols, (dk * rc).to(dkr_ptr.dtype.element_ty), mask=mask)
        s += tl.sum(dk * k, axis=0)
    else:
        dh += dk
    dc = (dunit - s * unit) * rc
    tl.store(dc_ptr + row * d + cols, dc.to(dc_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptr + row * d + cols, dh.to(dh_ptr.dtype.element_ty), mask=mask)
    # per row the unit context and [dg, du_j, dalpha]: the heads' gradients are dgu^T @ unit and dgu's sum
    tl.store(unit_ptr + row * d + cols, unit, mask=mask)
    tl.store(dgu_ptr, dg)
    tl.store(dgu_ptr + CHANNELS + 1, dalpha)
# fmt: on


# True when triton was imported under TRITON_INTERPRET=1: the kernels then run as Python on CPU tensors
# (triton decides this for its own library functions at import, so it cannot be switched later)
INTERPRETED = type(_forward_kernel).__name__ == "InterpretedFunction"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_WIDTH = 16384  # a row lives in registers: wider streams take the formula


class Plan(NamedTuple):
    """What a site's launches take that its construction fixed: decided on its first fused call, not per call."""

    d: int
    channels: int
    learned: bool  # a learned direction (deltafy's DeltaDirection); else the sublayer's write is the direction
    eps2: float  # eps^2 (the sublayer direction's eps is eps / m)
    inv_sqrt_d: float
    gamma: float  # -2 / m
    block: int
    num_warps: int


def plan(site) -> Plan | None:
    """The site's Plan, or None where the kernels do not take it: a direction head that is not deltafy's, the
    write-only control (no readout to erase), a stream wider than a row of registers."""
    d, direction = site.hidden_size, site.direction
    if (direction is not None and type(direction).__name__ != "DeltaDirection") or not getattr(site, "erase", True):
        return None
    if d > MAX_WIDTH:
        return None
    eps = site.eps if direction is not None else site.eps / site.scale
    block = triton.next_power_of_2(d)
    warps = min(max(block // 256, 1), 16)
    return Plan(d, site.channels, direction is not None, eps * eps, d**-0.5, -2.0 / site.scale, block, warps)


def _forward(x, c, h, kr, wg, bg, wt, bt, alpha, p: Plan):
    # contiguous inputs (the caller's): rows d apart, channels rows * d apart
    n = h.numel() // p.d
    out = torch.empty_like(x, dtype=h.dtype)
    _forward_kernel[(n,)](
        x, c, h, h if kr is None else kr, wg, bg, wt, bt, wg if alpha is None else alpha, out,
        n * p.d, p.d, p.eps2, p.inv_sqrt_d, p.gamma,
        CHANNELS=p.channels, LEARNED=p.learned, STRENGTH=alpha is not None, BLOCK=p.block, num_warps=p.num_warps,
    )  # fmt: skip
    return out


class SiteWrite(torch.autograd.Function):
    """h' of a site from the fused kernel; the backward runs one kernel for the inputs' gradients and
    the rows' head gradients, then a matmul and a sum for the head parameters'. Saves only the inputs."""

    @staticmethod
    def forward(ctx, x, c, h, kr, wg, bg, wt, bt, alpha, p: Plan):
        ctx.save_for_backward(x, c, h, kr, wg, bg, wt, bt, alpha)
        ctx.plan = p
        return _forward(x, c, h, kr, wg, bg, wt, bt, alpha, p)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, c, h, kr, wg, bg, wt, bt, alpha = ctx.saved_tensors
        p = ctx.plan
        d, n = p.d, h.numel() // p.d
        grad = grad.contiguous()
        dx = torch.empty_like(x)
        dc = torch.empty_like(c)
        dh = torch.empty_like(h)
        dkr = dh if kr is None else torch.empty_like(kr)
        unit = torch.empty((n, d), dtype=torch.float32, device=h.device)
        dgu = torch.empty((n, p.channels + 2), dtype=torch.float32, device=h.device)
        _backward_kernel[(n,)](
            x, c, h, h if kr is None else kr, wg, bg, wt, bt, wg if alpha is None else alpha, grad,
            dx, dc, dh, dkr, unit, dgu,
            n * d, d, p.eps2, p.inv_sqrt_d, p.gamma,
            CHANNELS=p.channels, LEARNED=kr is not None, STRENGTH=alpha is not None, BLOCK=p.block,
            num_warps=p.num_warps,
        )  # fmt: skip
        heads = [None] * 5
        if any(ctx.needs_input_grad[4:9]):
            with torch.autocast(h.device.type, enabled=False):
                weights, biases = dgu.T @ unit, dgu.sum(0)  # rows: the gate, the targets, (alpha)
            heads = [weights[:1], biases[:1], weights[1:-1], biases[1:-1], biases[-1:]]
            heads = [None if p is None else g.to(p.dtype) for g, p in zip(heads, (wg, bg, wt, bt, alpha), strict=True)]
        return dx, dc, dh, None if kr is None else dkr, *heads, None


def write(site, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor) -> torch.Tensor | None:
    """site.formula(x, c, h) from the fused kernels, or None for inputs they do not take (the caller then
    runs the formula): another shape than the model's, a dtype outside fp32/bf16/fp16, a site plan() refuses.
    A decode step runs this once a site: what its construction fixed is looked up, the rest is checked here."""
    p = site.__dict__.get("_fused_plan", False)
    if p is False:
        p = site.__dict__["_fused_plan"] = plan(site)
    if p is None:
        return None
    gate, target = site.gate, site.target
    wg, bg, wt, bt, alpha = gate.weight, gate.bias, target.weight, target.bias, site.strength
    device = h.device
    if (
        h.dtype not in _DTYPES or x.dtype not in _DTYPES or c.dtype not in _DTYPES
        or h.shape[-1] != p.d or c.shape != h.shape or h.numel() == 0
        or x.shape != (h.shape if p.channels == 1 else (p.channels, *h.shape))
        or x.device != device or c.device != device or wg.device != device
    ):  # fmt: skip
        return None
    if device.type == "cuda" and device.index != torch.cuda.current_device():  # triton launches on the current one
        with torch.cuda.device(device):
            return write(site, x, c, h)
    if p.learned:
        if torch.is_autocast_enabled(device.type):  # the formula's heads run in fp32, as here
            with torch.autocast(device.type, enabled=False):
                kr = site.direction(c.float())
        else:
            kr = site.direction(c if c.dtype == torch.float32 else c.float())
        kr = kr.contiguous()
    else:
        kr = None
    # the kernels read rows d apart: contiguous() is the tensor itself where it already is (a decode step's)
    inputs = (x.contiguous(), c.contiguous(), h.contiguous(), kr, wg.contiguous(), bg.contiguous(),
              wt.contiguous(), bt.contiguous(), alpha)  # fmt: skip
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return SiteWrite.apply(*inputs, p)
    return _forward(*inputs, p)
