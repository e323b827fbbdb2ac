# Inference paths of deltafy's DDL residual: the same math as DeltaSite.correct's tensor path,
# for forwards without autograd, written for less work than the differentiable version.
#
# - Decoding on CPU (a few tokens) is bound by per-call overhead, and between two sites the
#   model's matmuls evict everything from cache, so each call pays for its code and data anew.
#   A sublayer direction takes the compiled kernel of modeling_deltafy_native.py where there is
#   one; otherwise these paths keep the per-token scalars in Python floats and touch little: dot
#   products from numpy views (one torch op a site, the write). A learned direction gathers into
#   a reused per-thread buffer for one matmul.
# - Many tokens (prefill, scoring) are bound by memory traffic: every full-width tensor is read as
#   few times as possible and the output is the only full-width allocation.
#
# Copied verbatim into every checkpoint next to modeling_deltafy.py; imports only torch.
from __future__ import annotations

import math
import operator
import threading
import weakref

import torch

from .modeling_deltafy_native import site_kernel

# Up to this many tokens (a decoding batch), a sublayer-direction site takes the decode path.
FEW_ROWS = 8

_BUFFERS = threading.local()


def _buffers() -> weakref.WeakKeyDictionary:
    store = getattr(_BUFFERS, "sites", None)
    if store is None:
        store = _BUFFERS.sites = weakref.WeakKeyDictionary()
    return store


class InferencePaths:
    """Mixed into DeltaSite, whose parameters (gate, target, direction) and settings these read."""

    def _cached(self, params: tuple, slot, build):
        """This thread's ``build(*float32 params)`` for this site and ``slot`` (the path and shape it
        serves), built again whenever one of ``params`` changes (in place, or replaced by
        ``.to()``/``load_state_dict``)."""
        key = []
        for param in params:
            key += (param._version, param.data_ptr())
        slots = _buffers().get(self)
        if slots is None:
            slots = _buffers()[self] = {}
        cached = slots.get(slot)
        if cached is None or cached[0] != key:
            cached = slots[slot] = (key, build(*(param.detach().float() for param in params)))
        return cached[1]

    def _head_params(self, with_direction: bool = False) -> tuple:
        """(gate weight, target weight, [down, up,] gate bias, target bias), read without
        nn.Module's attribute lookups: the order in which the paths' cache builders take them."""
        gate, target = self._modules["gate"]._parameters, self._modules["target"]._parameters
        weights = (gate["weight"], target["weight"])
        if with_direction:
            direction = self._modules["direction"]._modules
            weights += (direction["down"]._parameters["weight"], direction["up"]._parameters["weight"])
        return weights + (gate["bias"], target["bias"])

    def _beta_and_target(self, cc: float, cg: float, cv: float, xx: float, b_g: float, b_v: float):
        """beta, v and 1/|c| of one token from its dot products (c.c, c.w_gate, c.w_target, x.x)."""
        inv_norm_c = 1.0 / math.sqrt(cc + 1e-6)
        if self.force_beta is None:
            g = cg * inv_norm_c + b_g
            beta = 2.0 / (1.0 + math.exp(-g)) if g >= 0 else 2.0 * math.exp(g) / (1.0 + math.exp(g))
        else:
            beta = float(self.force_beta)
        if self.beta_log is not None:
            self.beta_log.append(torch.tensor(beta))
        return beta, (cv * inv_norm_c + b_v) * math.sqrt(max(xx, 1e-30) / self.hidden_size), inv_norm_c

    def _token_rows(self, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor):
        """x, c, h as fp32 (tokens, d) rows for the many-token paths, and d. Those paths return
        fp32 rows, which ``correct`` shapes and casts back like h."""
        d = self.hidden_size
        if h.dtype != torch.float32:
            x, c, h = x.float(), c.float(), h.float()
        return x.reshape(-1, d), c.reshape(-1, d), h.reshape(-1, d), d

    def _token_betas(self, c: torch.Tensor, w_g: torch.Tensor | None, b_g: torch.Tensor, inv_norm_c: torch.Tensor):
        """beta = 2 sigmoid(gate(c / |c|)) per token, logged as the tensor path logs it; ``c`` is
        the rows of c with ``w_g`` the gate weight, or already their gate dot products (w_g None)."""
        if self.force_beta is None:
            c_gate = c if w_g is None else c.mv(w_g)
            beta = torch.addcmul(b_g, c_gate, inv_norm_c).sigmoid_().mul_(2.0)
        else:
            beta = torch.full_like(inv_norm_c, float(self.force_beta))
        if self.beta_log is not None:
            self.beta_log.append(beta.mean())
        return beta

    def _correct_tokens(self, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``correct`` for a sublayer direction without autograd, any number of tokens. Each of c, x
        and h is read by one norm, the heads are matrix-vector products, h*x is summed in the buffer
        that then receives the output, and the per-token arithmetic is folded into few kernels."""
        x, c, h, d = self._token_rows(x, c, h)
        w_g, w_v, b_g, b_v = self._cached(
            self._head_params(), ("tokens",), lambda w_g, w_v, b_g, b_v: (w_g[0], w_v[0], b_g, b_v)
        )
        norm = torch.linalg.vector_norm
        inv_norm_c = norm(c, dim=-1).square_().add_(1e-6).rsqrt_()
        # The target in stream units is head * rms(x) = head * |x| / sqrt(d); this is sqrt(d) times it.
        # (The tensor path clamps |x| away from 0 only to keep a gradient finite.)
        v = torch.addcmul(b_v, c.mv(w_v), inv_norm_c).mul_(norm(x, dim=-1))
        m, root_d = self.scale, math.sqrt(d)
        n = norm(h, dim=-1).square_().mul_(m * m).add_(self.eps**2).sqrt_()
        out = torch.mul(h, x)
        # The gain on h is beta (target - m h.x / n) / n; computed here sqrt(d) times too large,
        # which the write's coefficient 1 / sqrt(d) undoes.
        gain = torch.addcdiv(v, out.sum(-1), n, value=-m * root_d).div_(n)
        gain.mul_(self._token_betas(c, w_g, b_g, inv_norm_c))
        torch.addcmul(h, h, gain.unsqueeze(-1), value=1.0 / root_d, out=out)
        return out

    def _decode_heads(self):
        """What the decode path reads, or False where it does not apply (a learned direction, heads
        that are not fp32 CPU tensors): numpy views of the gate and target weights and biases, d,
        the stream scale, eps^2, and the compiled kernel bound to the same memory (None without
        one). Views and kernel see every in-place update (an optimizer step, load_state_dict) as
        it happens, so decoding reads no version counters; DeltaSite drops this tuple when .to()
        or load_state_dict(assign=True) replaces the tensors (a tensor swapped in by hand after a
        forward, ``param.data = t``, is not seen)."""
        params = self._head_params()
        if self.direction is not None or any(p.dtype != torch.float32 or not p.is_cpu for p in params):
            return False
        w_g, w_v, b_g, b_v = (param.detach().numpy() for param in params)
        d, m, eps2 = self.hidden_size, self.scale, self.eps**2
        native = site_kernel(*params, d, m, eps2) if all(p.is_contiguous() for p in params) else None
        return w_g[0], w_v[0], b_g, b_v, d, m, eps2, native

    def _correct_rows(self, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor, decode: tuple) -> torch.Tensor:
        """``correct`` for 2 to FEW_ROWS fp32 tokens without autograd on CPU (a decoding batch); one
        token takes ``_row_gain`` straight from ``correct``."""
        d = decode[4]
        rows = zip(c.numpy().reshape(-1, d), x.numpy().reshape(-1, d), h.numpy().reshape(-1, d), strict=True)
        gains = torch.tensor([self._row_gain(c_i, x_i, h_i, decode) for c_i, x_i, h_i in rows])
        h_rows = h.reshape(-1, d)
        return torch.addcmul(h_rows, h_rows, gains.unsqueeze(-1)).view(h.shape)

    def _row_gain(self, c, x, h, decode: tuple) -> float:
        """The gain beta (v - k.x) / |m h| of one token (h' = h + gain h), from numpy rows of c, x
        and h: six dot products, the rest on Python floats. At this size a numpy call costs a
        fraction of a torch op, so a decoding site costs one torch op, the write."""
        w_g, w_v, b_g, b_v, d, m, eps2, _ = decode
        cc, cg, cv, xx = float(c.dot(c)), float(c.dot(w_g)), float(c.dot(w_v)), float(x.dot(x))
        beta, v, _ = self._beta_and_target(cc, cg, cv, xx, b_g.item(), b_v.item())
        n_h = math.sqrt(float(h.dot(h)) * m * m + eps2)
        return beta * (v - m * float(x.dot(h)) / n_h) / n_h

    def _learned_rows(self, h: torch.Tensor):
        """The fp32 buffer [c; x; gate w; target w; down (r rows); R down (r rows); up^T (r rows)]
        for decoding one token with a low-rank learned direction, where up = Q R."""

        def build(w_g, w_v, down, up, b_g, b_v):
            # |up u| = |R u|: the direction's squared norm becomes a sum of r squares, not a quadratic form
            r_down = torch.linalg.qr(up).R @ down
            rows = torch.cat((torch.empty(2, self.hidden_size, dtype=torch.float32), w_g, w_v, down, r_down, up.t()))
            r, batch = down.shape[0], (1,) * (h.dim() - 2)
            gram = torch.empty(2, rows.shape[0], dtype=torch.float32)
            # (c/x rows in h's shape, Gram lhs, Gram rhs, Gram output, its c.down entries and up^T,
            # both shaped for (b)addmm against h, rank, gate bias, target bias)
            views = (rows[:2].view((2,) + h.shape[1:]), rows[:2], rows.t(), gram)
            views += (gram[:1, 4 : 4 + r].view(batch + (1, r)), rows[4 + 2 * r :].view(batch + (r, -1)))
            return views + (r, float(b_g), float(b_v))

        return self._cached(self._head_params(with_direction=True), ("learned", h.dim()), build)

    def _correct_learned_token(self, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``correct`` for one token without autograd on CPU, low-rank learned direction. With
        u = down(c/|c|) and k_raw = up u, every scalar the math needs (u, |k_raw|^2, k_raw.x) comes
        from one matmul over a reused buffer, and the write h + up (u s) is one more kernel."""
        cx, lhs, rhs, gram, c_down, up_t, r, b_g, b_v = self._learned_rows(h)
        torch.cat((c, x), out=cx)
        (cc, _, cg, cv, *c_heads), (_, xx, _, _, *x_heads) = torch.mm(lhs, rhs, out=gram).tolist()
        beta, v, inv_norm_c = self._beta_and_target(cc, cg, cv, xx, b_g, b_v)
        kk = sum(value * value for value in c_heads[r : 2 * r]) * inv_norm_c * inv_norm_c
        inv_k = 1.0 / math.sqrt(kk + self.eps**2)
        kx = inv_k * inv_norm_c * sum(map(operator.mul, c_heads[:r], x_heads[2 * r :]))
        # h + k coef / m with k = up u / |up u| and u = down c / |c|: one (b)addmm on the buffer
        alpha = beta * (v - kx) * inv_k * inv_norm_c / self.scale
        h32 = h if h.dtype == torch.float32 else h.float()
        out = (torch.baddbmm if h.dim() == 3 else torch.addmm)(h32, c_down, up_t, alpha=alpha)
        return out if out.dtype == h.dtype else out.to(h.dtype)

    def _correct_learned_tokens(self, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``correct`` for a low-rank learned direction without autograd, any number of tokens.
        With u = down c (k is normalized, so c's scale folds into a per-token factor), one matmul
        gives u and both heads, one gives up^T x, |up u| = |R u| needs only r-wide rows, and the
        write h + up (u s) is one addmm: c and x are each read twice, h once."""
        x, c, h, d = self._token_rows(x, c, h)

        def build(w_g, w_v, down, up, b_g, b_v):
            # (c's right-hand side [down^T | gate w | target w], up, R^T with up = QR, biases)
            return torch.cat((down, w_g, w_v)).t().contiguous(), up, torch.linalg.qr(up).R.t(), b_g, b_v

        heads, up, r_t, b_g, b_v = self._cached(self._head_params(with_direction=True), ("learned tokens",), build)
        r = up.shape[1]
        norm = torch.linalg.vector_norm
        inv_norm_c = norm(c, dim=-1).square_().add_(1e-6).rsqrt_()
        projected = c @ heads
        u, cg, cv = projected[:, :r], projected[:, r], projected[:, r + 1]
        # k = up u s_k with s_k = 1 / sqrt(|up u|^2 + eps^2 |c|^2), the tensor path's k exactly
        s_k = norm(u @ r_t, dim=-1).square_().add_(inv_norm_c.square().reciprocal_().mul_(self.eps**2)).rsqrt_()
        kx = torch.linalg.vecdot(u, x @ up).mul_(s_k)
        # target in stream units: head * rms(x) = head * |x| / sqrt(d) (the clamp only guards a gradient)
        coef = torch.addcmul(b_v, cv, inv_norm_c).mul_(norm(x, dim=-1).mul_(d**-0.5)).sub_(kx)
        coef.mul_(self._token_betas(cg, None, b_g, inv_norm_c)).mul_(s_k).div_(self.scale)
        return torch.addmm(h, u * coef.unsqueeze(-1), up.t())
