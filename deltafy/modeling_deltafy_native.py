# A compiled decode step for deltafy's DDL residual (sublayer direction, fp32, CPU, a few tokens).
#
# Decoding on CPU is bound by per-call overhead: between two sites the model's matmuls evict
# everything from cache, so every Python and torch call on a site's path pays for its code anew.
# The math of a decoding site is six dot products and one scaled add per token. As numpy and torch
# calls it costs ~50 us a site (~6% of a SmolLM2-135M token, 60 sites); as one ctypes call into C
# it costs well under half that. The kernel is compiled on first use with the machine's C compiler
# ($CC, else cc) into deltafy's cache folder; without a compiler, after a failed build, or with
# DELTAFY_NATIVE=0, decoding takes the Python path of modeling_deltafy_inference.py instead,
# which computes the same.
#
# Copied verbatim into every checkpoint next to modeling_deltafy.py; imports only the standard library.
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

KERNEL_SOURCE = r"""
#include <math.h>

/* One site's heads: pointers into the gate/target parameters (read at each call, so in-place
   updates show at once) and the site's constants. */
typedef struct {
    const float *w_gate, *w_target, *b_gate, *b_target;
    long d;
    double scale, eps2;
} deltafy_heads;

typedef float f4 __attribute__((vector_size(16))); /* 4 floats: SSE on x86-64, NEON on arm64 */

static inline f4 load4(const float *p) {
    f4 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

/* out = h + gain * h for `rows` tokens of width d, where for each token
   gain = beta (v - m h.x / n) / n,  n = sqrt(m^2 h.h + eps^2),
   beta = 2 sigmoid(w_gate.c / |c| + b_gate),  v = (w_target.c / |c| + b_target) rms(x).
   c, x and h are read once; the six dot products run as two sets of 4-wide fp32 partial sums
   (independent chains the CPU overlaps), added up in double. */
void deltafy_decode(const deltafy_heads *p, const float *c, const float *x, const float *h, float *out,
                    long rows) {
    const long d = p->d;
    const float *w_gate = p->w_gate, *w_target = p->w_target;
    const double m = p->scale;
    for (long r = 0; r < rows; r++, c += d, x += d, h += d, out += d) {
        f4 acc[2][6] = {{{0}}};
        long i = 0;
        for (; i + 8 <= d; i += 8)
            for (int k = 0; k < 2; k++) {
                const f4 ci = load4(c + i + 4 * k), xi = load4(x + i + 4 * k), hi = load4(h + i + 4 * k);
                acc[k][0] += ci * ci;
                acc[k][1] += ci * load4(w_gate + i + 4 * k);
                acc[k][2] += ci * load4(w_target + i + 4 * k);
                acc[k][3] += xi * xi;
                acc[k][4] += hi * hi;
                acc[k][5] += xi * hi;
            }
        double s[6] = {0, 0, 0, 0, 0, 0};
        for (int t = 0; t < 6; t++)
            for (int k = 0; k < 2; k++)
                for (int j = 0; j < 4; j++)
                    s[t] += acc[k][t][j];
        for (; i < d; i++) {
            const double ci = c[i], xi = x[i], hi = h[i];
            s[0] += ci * ci, s[1] += ci * w_gate[i], s[2] += ci * w_target[i];
            s[3] += xi * xi, s[4] += hi * hi, s[5] += xi * hi;
        }
        const double inv_norm_c = 1.0 / sqrt(s[0] + 1e-6);
        const double g = s[1] * inv_norm_c + p->b_gate[0];
        const double beta = g >= 0 ? 2.0 / (1.0 + exp(-g)) : 2.0 * exp(g) / (1.0 + exp(g));
        const double v = (s[2] * inv_norm_c + p->b_target[0]) * sqrt((s[3] > 1e-30 ? s[3] : 1e-30) / d);
        const double n = sqrt(s[4] * m * m + p->eps2);
        const float gain = (float)(beta * (v - m * s[5] / n) / n);
        for (long j = 0; j < d; j++)
            out[j] = h[j] + gain * h[j];
    }
}
"""

logger = logging.getLogger(__name__)
_FLAGS = ["-O3", "-shared", "-fPIC"]


class _Heads(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("w_gate", "w_target", "b_gate", "b_target")]
    _fields_ += [("d", ctypes.c_long), ("scale", ctypes.c_double), ("eps2", ctypes.c_double)]


_lock = threading.Lock()
_kernel: list = []  # [the loaded kernel or None], once tried in this process


def _compile(folder: Path, name: str, compiler: list[str]) -> Path:
    """Build the kernel in a private temporary folder, then move it to ``folder/name`` in one step
    (a concurrent process loads one whole library or builds its own)."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        source, built = Path(tmp) / "decode.c", Path(tmp) / name
        source.write_text(KERNEL_SOURCE)
        done = subprocess.run(
            [*compiler, *_FLAGS, "-o", str(built), str(source), "-lm"], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise OSError(f"{compiler[0]} failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
        os.replace(built, folder / name)
    return folder / name


def _load():
    compiler = shlex.split(os.environ.get("CC") or "cc")  # (CC may carry flags: "ccache gcc -m64")
    if os.environ.get("DELTAFY_NATIVE", "1") == "0" or not compiler or shutil.which(compiler[0]) is None:
        return None
    key = "\0".join((KERNEL_SOURCE, *compiler, *_FLAGS, platform.machine(), sys.platform))
    name = f"decode-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    # (deltafy's cache folder, as deltafy.sources finds it; this file must not import deltafy)
    home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    cached = Path(os.environ.get("DELTAFY_CACHE") or Path(home) / "deltafy") / "kernels" / name
    try:
        library = ctypes.CDLL(str(cached if cached.exists() else _compile(cached.parent, name, compiler)))
    except OSError:  # a cache folder we cannot write, or a library that does not load: build for this process
        library = ctypes.CDLL(str(_compile(Path(tempfile.mkdtemp(prefix="deltafy-")), name, compiler)))
    kernel = library.deltafy_decode
    kernel.argtypes = [ctypes.POINTER(_Heads)] + [ctypes.c_void_p] * 4 + [ctypes.c_long]
    kernel.restype = None
    return kernel


def decode_kernel():
    """The compiled ``deltafy_decode``, or None where it cannot be built here (no C compiler, a
    failed build, DELTAFY_NATIVE=0); tried once per process."""
    if not _kernel:
        with _lock:
            if not _kernel:
                try:
                    _kernel.append(_load())
                except (OSError, subprocess.SubprocessError) as err:
                    logger.warning(
                        "deltafy: no compiled decode kernel (%s); decoding takes the slower Python path", err
                    )
                    _kernel.append(None)
    return _kernel[0]


def site_kernel(w_gate, w_target, b_gate, b_target, d: int, scale: float, eps2: float):
    """The kernel bound to one site's heads (fp32 contiguous CPU tensors), called as
    ``(c, x, h, out, rows)`` with data pointers; None where there is no kernel."""
    kernel = decode_kernel()
    if kernel is None:
        return None
    # Detached aliases keep the storage alive even if a parameter's .data is swapped later.
    tensors = tuple(t.detach() for t in (w_gate, w_target, b_gate, b_target))
    heads = _Heads(*(t.data_ptr() for t in tensors), d, scale, eps2)
    heads.tensors = tensors
    return functools.partial(kernel, ctypes.byref(heads))
