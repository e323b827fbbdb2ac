"""The Triton kernels of a fused DDL site and the autograd.Function that launches them.

One program per token row holds the row's context c, write h, direction kr and each channel x_j in
fp32 registers: every reduction of the formula (|c|, the gate and target heads, |kr|, kr.x_j, |x_j|)
and the write itself happen in that one pass. The backward kernel recomputes the same quantities from
the saved inputs (nothing but the inputs is saved) and writes the inputs' gradients and, per row, the
heads' output gradients; the head parameters' gradients are then a matmul and a sum over the rows.
"""

from __future__ import annotations

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
                    s_xj, s_xr, s_c, s_h, s_kr, s_wt, s_oj, s_or, d, eps2, inv_sqrt_d, neg_two_over_m,
                    CHANNELS: tl.constexpr, LEARNED: tl.constexpr, STRENGTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    cv, hv, rc, unit, wg, sig, raw, k, inv_n = _recompute(
        c_ptr + row * s_c, h_ptr + row * s_h, kr_ptr + row * s_kr, wg_ptr, bg_ptr, cols, mask, eps2, LEARNED)
    if STRENGTH:
        alpha = tl.load(alpha_ptr).to(tl.float32)
    else:
        alpha = 1.0
    scale = sig * inv_n * alpha  # alpha = 0 (a fresh strength gate): every coef is 0 and h' = h exactly
    # channel j's rows: the pointers step by a channel's stride (64-bit pointers: no int32 j * stride)
    x_ptr += row * s_xr
    out_ptr += row * s_or
    for j in tl.static_range(CHANNELS):
        xv = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        wt = tl.load(wt_ptr + j * s_wt + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.sum(unit * wt, axis=0) + tl.load(bt_ptr + j).to(tl.float32)
        miss = tl.sum(k * xv, axis=0) * inv_n - u * tl.sqrt(tl.sum(xv * xv, axis=0)) * inv_sqrt_d
        out = hv + k * (scale * miss * neg_two_over_m)
        tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
        x_ptr += s_xj
        out_ptr += s_oj


@triton.jit
def _backward_kernel(x_ptr, c_ptr, h_ptr, kr_ptr, wg_ptr, bg_ptr, wt_ptr, bt_ptr, alpha_ptr, go_ptr,
                     dx_ptr, dc_ptr, dh_ptr, dkr_ptr, unit_ptr, dgu_ptr,
                     s_xj, s_xr, s_c, s_h, s_kr, s_wt, s_gj, s_gr, s_dxj, d, eps2, inv_sqrt_d, neg_two_over_m,
                     CHANNELS: tl.constexpr, LEARNED: tl.constexpr, STRENGTH: tl.constexpr, BLOCK: tl.constexpr):
    # dx (channels, rows, d), dc, dh, dkr, unit (rows, d) and dgu (rows, channels + 2) are contiguous
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    cv, hv, rc, unit, wg, sig, raw, k, inv_n = _recompute(
        c_ptr + row * s_c, h_ptr + row * s_h, kr_ptr + row * s_kr, wg_ptr, bg_ptr, cols, mask, eps2, LEARNED)
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
    x_ptr += row * s_xr
    go_ptr += row * s_gr
    dx_ptr += row * d
    for j in tl.static_range(CHANNELS):
        xv = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        go = tl.load(go_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        wt = tl.load(wt_ptr + j * s_wt + cols, mask=mask, other=0.0).to(tl.float32)
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
        x_ptr += s_xj
        go_ptr += s_gj
        dx_ptr += s_dxj
    dk += (-dinv * inv_n * inv_n * inv_n) * k  # inv_n = (k.k + eps^2)^-1/2
    dg = dsig * sig * (1.0 - sig)
    dunit += dg * wg
    drc = tl.sum(dunit * cv, axis=0)
    if LEARNED:
        tl.store(dkr_ptr + row * d + cols, (dk * rc).to(dkr_ptr.dtype.element_ty), mask=mask)
        drc += tl.sum(dk * raw, axis=0)
    else:
        dh += dk
    dc = dunit * rc - (drc * rc * rc * rc) * cv  # rc = (c.c + 1e-6)^-1/2
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


def _rows(t: torch.Tensor, *lead: int) -> torch.Tensor:
    # rows of d elements at unit stride: a view wherever the layout allows, a copy elsewhere
    t = t.reshape(*lead, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(n_rows: int, d: int) -> dict:
    block = triton.next_power_of_2(d)
    return dict(grid=(n_rows,), BLOCK=block, num_warps=min(max(block // 256, 1), 16))


def _forward(x, c, h, kr, wg, bg, wt, bt, alpha, consts):
    channels, eps2, inv_sqrt_d, gamma = consts
    d, n = h.shape[-1], h.numel() // h.shape[-1]
    xs, c2, h2 = _rows(x, channels, n), _rows(c, n), _rows(h, n)
    k2 = h2 if kr is None else _rows(kr, n)
    out = torch.empty((channels, n, d), dtype=h.dtype, device=h.device)
    launch = _launch(n, d)
    _forward_kernel[launch.pop("grid")](
        xs, c2, h2, k2, wg, bg, wt, bt, wg if alpha is None else alpha, out,
        xs.stride(0), xs.stride(1), c2.stride(0), h2.stride(0), k2.stride(0), wt.stride(0), out.stride(0),
        out.stride(1), d, eps2, inv_sqrt_d, gamma,
        CHANNELS=channels, LEARNED=kr is not None, STRENGTH=alpha is not None, **launch,
    )  # fmt: skip
    return out.view(x.shape)


class SiteWrite(torch.autograd.Function):
    """h' of a site from the fused kernel; the backward runs one kernel for the inputs' gradients and
    the rows' head gradients, then a matmul and a sum for the head parameters'. Saves only the inputs."""

    @staticmethod
    def forward(ctx, x, c, h, kr, wg, bg, wt, bt, alpha, consts):
        ctx.save_for_backward(x, c, h, kr, wg, bg, wt, bt, alpha)
        ctx.consts = consts
        return _forward(x, c, h, kr, wg, bg, wt, bt, alpha, consts)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, c, h, kr, wg, bg, wt, bt, alpha = ctx.saved_tensors
        channels, eps2, inv_sqrt_d, gamma = ctx.consts
        d, n = h.shape[-1], h.numel() // h.shape[-1]
        xs, c2, h2, g3 = _rows(x, channels, n), _rows(c, n), _rows(h, n), _rows(grad, channels, n)
        k2 = h2 if kr is None else _rows(kr, n)
        dx = torch.empty((channels, n, d), dtype=x.dtype, device=h.device)
        dc = torch.empty((n, d), dtype=c.dtype, device=h.device)
        dh = torch.empty((n, d), dtype=h.dtype, device=h.device)
        dkr = dh if kr is None else torch.empty((n, d), dtype=kr.dtype, device=h.device)
        unit = torch.empty((n, d), dtype=torch.float32, device=h.device)
        dgu = torch.empty((n, channels + 2), dtype=torch.float32, device=h.device)
        launch = _launch(n, d)
        _backward_kernel[launch.pop("grid")](
            xs, c2, h2, k2, wg, bg, wt, bt, wg if alpha is None else alpha, g3,
            dx, dc, dh, dkr, unit, dgu,
            xs.stride(0), xs.stride(1), c2.stride(0), h2.stride(0), k2.stride(0), wt.stride(0), g3.stride(0),
            g3.stride(1), n * d, d, eps2, inv_sqrt_d, gamma,
            CHANNELS=channels, LEARNED=kr is not None, STRENGTH=alpha is not None, **launch,
        )  # fmt: skip
        heads = [None] * 5
        if any(ctx.needs_input_grad[4:9]):
            with torch.autocast(h.device.type, enabled=False):
                weights, biases = dgu.T @ unit, dgu.sum(0)  # rows: the gate, the targets, (alpha)
            heads = [weights[:1], biases[:1], weights[1:-1], biases[1:-1], biases[-1:]]
            heads = [None if p is None else g.to(p.dtype) for g, p in zip(heads, (wg, bg, wt, bt, alpha), strict=True)]
        return (dx.view(x.shape), dc.view(c.shape), dh.view(h.shape), None if kr is None else dkr.view(kr.shape),
                *heads, None)  # fmt: skip


def write(site, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor) -> torch.Tensor | None:
    """site.formula(x, c, h) from the fused kernels, or None for inputs they do not take (the caller then
    runs the formula): another shape than the model's, a dtype outside fp32/bf16/fp16, a direction head
    that is not deltafy's."""
    d, channels, direction = site.hidden_size, site.channels, site.direction
    if (
        h.dtype not in _DTYPES or x.dtype not in _DTYPES or c.dtype not in _DTYPES
        or h.shape[-1] != d or d > MAX_WIDTH or c.shape != h.shape or h.numel() == 0
        or x.shape != (h.shape if channels == 1 else (channels, *h.shape))
        or x.device != h.device or c.device != h.device or site.gate.weight.device != h.device
        or (direction is not None and type(direction).__name__ != "DeltaDirection")
        or not getattr(site, "erase", True)  # the write-only control: the formula
    ):  # fmt: skip
        return None
    if h.is_cuda and h.device.index != torch.cuda.current_device():  # triton launches on the current device
        with torch.cuda.device(h.device):
            return write(site, x, c, h)
    wg, bg, wt, bt, alpha = site.gate.weight, site.gate.bias, site.target.weight, site.target.bias, site.strength
    if wg.stride(-1) != 1 or wt.stride(-1) != 1 or not (bg.is_contiguous() and bt.is_contiguous()):
        wg, wt, bg, bt = wg.contiguous(), wt.contiguous(), bg.contiguous(), bt.contiguous()
    if direction is None:
        kr, eps = None, site.eps / site.scale
    elif torch.is_autocast_enabled(h.device.type):  # the formula's heads run in fp32, as here
        with torch.autocast(h.device.type, enabled=False):
            kr, eps = direction(c.float()), site.eps
    else:
        kr, eps = direction(c if c.dtype == torch.float32 else c.float()), site.eps
    consts = (channels, eps * eps, d**-0.5, -2.0 / site.scale)
    inputs = (x, c, h, kr, wg, bg, wt, bt, alpha)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return SiteWrite.apply(*inputs, consts)
    return _forward(*inputs, consts)
