"""Decode attention on CPU as one compiled C loop, built with the system C compiler at start.

Why: a decode step's attention is, per (row, KV head), ``G`` query vectors against that row's
cached keys and values. torch does it as two batched matmuls per attention run (see
``attention.RunsAttention``), and MKL spends ~1 us of fixed cost per batch entry on such
thin matrices: the tiny model's attention read its cache at ~11 GB/s where a plain read of the
same bytes runs at ~28 GB/s. This kernel reads each row's keys and values once, exactly up to
its own length (so the generator needs no attention runs), with the softmax done blockwise in
L1 (an online softmax over blocks of ``BLOCK`` keys): ~2x faster than the matmuls at 64 rows.

How: the C source below is compiled with ``$CC`` (default ``cc``) into a shared library and
loaded with ``ctypes`` (which drops the GIL for the call); ~0.4 s of CPU for the compiler. The
library is kept in the kernel cache (:func:`cache_dir`: ``$AREAL_CACHE_DIR/kernels``, default
``~/.cache/areal/kernels``) under a key of the source, the flags, the compiler binary and this
machine's CPU (``-march=native`` code runs only on the CPU it was built for, and a home
directory may be shared by machines of several kinds), so a later server on the machine loads
it instead of compiling. Where the CPU cannot be identified (no ``/proc/cpuinfo``) or the cache
cannot be written, each process builds into a temporary directory, as it always may.
OpenMP is linked by soname, so the loader binds it to the ``libgomp`` torch already loaded: the
kernel shares torch's thread team and follows ``torch.set_num_threads`` of the calling thread.
``exp`` is a degree-7 polynomial on ``[-ln2/2, ln2/2]`` times ``2^k`` (relative error < 1e-7,
vectorised by the compiler). Results equal the matmul path to fp32 rounding (tested).

Modes (``GenerationServerConfig.cpu_attention``): ``compiled`` fails loudly when the kernel
cannot be built; ``torch`` never builds it; ``auto`` builds it and, if that fails (no compiler,
no OpenMP), logs a warning with the compiler's message and uses the matmul path. The generator
reports which one runs (``/get_server_info``: ``decode_attention``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Literal

import torch

logger = logging.getLogger(__name__)
Mode = Literal["auto", "compiled", "torch"]
BUILD_TIMEOUT_S = 120.0
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-std=gnu11", "-shared", "-fPIC"]

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>

#define BLOCK 128 /* keys per softmax block: the block's scores stay in L1 */

/* e^x for x <= 0: 2^k * e^r with |r| <= ln2/2 (Cody-Waite split of ln2), degree-7 Taylor. */
static inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float k = floorf(x * 1.44269504f + 0.5f);
  const float r = (x - k * 0.693145751953125f) - k * 1.4286068203094172e-06f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = ((int32_t)k + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

/* One (row, KV head): G query vectors attend over n keys and values (rows of D floats). */
static inline __attribute__((always_inline)) void attend(
    const float *restrict q, const float *restrict k, const float *restrict v, int64_t n,
    int64_t G, int64_t D, float *restrict o) {
  float s[G][BLOCK], m[G], sum[G];
  for (int64_t j = 0; j < G; ++j) {
    m[j] = -INFINITY;
    sum[j] = 0.f;
    for (int64_t d = 0; d < D; ++d) o[j * D + d] = 0.f;
  }
  for (int64_t l0 = 0; l0 < n; l0 += BLOCK) {
    const int64_t nb = n - l0 < BLOCK ? n - l0 : BLOCK;
    for (int64_t l = 0; l < nb; ++l) {
      const float *restrict kl = k + (l0 + l) * D;
      for (int64_t j = 0; j < G; ++j) {
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < D; ++d) acc += q[j * D + d] * kl[d];
        s[j][l] = acc;
      }
    }
    for (int64_t j = 0; j < G; ++j) {
      float mb = m[j];
      for (int64_t l = 0; l < nb; ++l) mb = s[j][l] > mb ? s[j][l] : mb;
      const float rescale = exp_nonpos(m[j] - mb); /* 0 on the first block (m = -inf) */
      float add = 0.f;
#pragma omp simd reduction(+ : add)
      for (int64_t l = 0; l < nb; ++l) {
        s[j][l] = exp_nonpos(s[j][l] - mb);
        add += s[j][l];
      }
      sum[j] = sum[j] * rescale + add;
      m[j] = mb;
      if (rescale != 1.f)
        for (int64_t d = 0; d < D; ++d) o[j * D + d] *= rescale;
    }
    for (int64_t l = 0; l < nb; ++l) {
      const float *restrict vl = v + (l0 + l) * D;
      for (int64_t j = 0; j < G; ++j) {
        const float w = s[j][l];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[j * D + d] += w * vl[d];
      }
    }
  }
  for (int64_t j = 0; j < G; ++j) {
    const float inv = 1.f / sum[j];
    for (int64_t d = 0; d < D; ++d) o[j * D + d] *= inv;
  }
}

/* q: row b's query heads at q + b * q_row_stride, [H, G, D]; k, v: [S, H, C, D] caches whose
   slot b holds row b; lengths[b] keys are valid; out: [B, H, G, D]. The (row, head) items are
   dealt round-robin over the team, so rows of unequal lengths spread evenly. Common head
   sizes get a constant D (fully unrolled loops). Returns -1, or the first row whose length is
   outside 1..C (nothing computed). */
int64_t decode_attention(const float *q, int64_t q_row_stride, const float *k, const float *v,
                         const int64_t *lengths, int64_t B, int64_t H, int64_t G, int64_t D,
                         int64_t C, float *out) {
  for (int64_t b = 0; b < B; ++b)
    if (lengths[b] < 1 || lengths[b] > C) return b;
  const int64_t N = B * H;
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    for (int64_t i = t; i < N; i += T) {
      const int64_t b = i / H, h = i % H, n = lengths[b];
      const float *qi = q + b * q_row_stride + h * G * D, *ki = k + i * C * D, *vi = v + i * C * D;
      float *oi = out + i * G * D;
      if (D == 64) attend(qi, ki, vi, n, G, 64, oi);
      else if (D == 128) attend(qi, ki, vi, n, G, 128, oi);
      else attend(qi, ki, vi, n, G, D, oi);
    }
  }
  return -1;
}
"""


class DecodeAttentionKernel:
    """The compiled kernel: ``kernel(q, k, v, lengths)`` for rows ``0..B-1`` of a slot cache."""

    def __init__(self, library: ctypes.CDLL):
        fn = library.decode_attention
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, i64, p]
        fn.restype = i64
        self._fn = fn

    @classmethod
    def build(cls, cc: str | None = None, cache: Path | None = None) -> DecodeAttentionKernel:
        """The kernel compiled from :data:`SOURCE` with ``cc`` (default :func:`compiler`), loaded
        from ``cache`` (default :func:`cache_dir`) when built there before; raises
        ``RuntimeError`` saying why it cannot be built."""
        cc = cc or compiler()
        found = shutil.which(cc)
        if found is None:
            raise RuntimeError(f"C compiler {cc!r} not found (set CC or install gcc)")
        key = build_key(found)
        kept = (cache or cache_dir()) / f"decode_attention-{key}.so" if key else None
        if kept is not None and kept.is_file():
            try:
                return cls(ctypes.CDLL(str(kept)))
            except (OSError, AttributeError) as e:  # a damaged file: build it again over it
                logger.warning("decode attention: rebuilding %s, which does not load: %s", kept, e)
        with tempfile.TemporaryDirectory(prefix="areal-kernel-") as tmp:
            lib = _compile(cc, Path(tmp))
            try:  # loaded from here: the loader would hand back a damaged file loaded at `kept`
                library = ctypes.CDLL(str(lib))  # mapped: the file may go with the directory
            except OSError as e:
                raise RuntimeError(f"built kernel does not load: {e}") from None
            if kept is not None:
                _keep(lib, kept)
        return cls(library)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """``q [B, H*G*D]`` (rows may be strided, pre-scaled), ``k, v [S, H, C, D]`` with row
        ``b`` in slot ``b``, ``lengths [B]`` int64 in ``1..C`` -> attention output
        ``[B, H*G*D]``."""
        B, width = q.shape
        S, H, C, D = k.shape
        ok = (
            q.dtype == k.dtype == v.dtype == torch.float32
            and q.device.type == k.device.type == v.device.type == "cpu"
            and q.stride(1) == 1 and k.is_contiguous() and v.is_contiguous() and v.shape == k.shape
            and lengths.dtype == torch.int64 and lengths.is_contiguous() and lengths.shape == (B,)
            and B <= S and width % (H * D) == 0
        )  # fmt: skip
        if not ok:
            raise ValueError(
                f"decode_attention: bad operands q {tuple(q.shape)} {q.dtype} stride {q.stride()}, "
                f"k/v {tuple(k.shape)}/{tuple(v.shape)} {k.dtype}, lengths {tuple(lengths.shape)} "
                f"{lengths.dtype}"
            )
        out = torch.empty(B, width, dtype=q.dtype)
        bad = self._fn(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), lengths.data_ptr(),
                       B, H, width // (H * D), D, C, out.data_ptr())  # fmt: skip
        if bad >= 0:
            raise ValueError(
                f"decode_attention: row {bad} has {int(lengths[bad])} keys; the cache holds 1..{C}"
            )
        return out


def compiler() -> str:
    """The C compiler the kernel is built with: ``$CC``, default ``cc``."""
    return os.environ.get("CC", "cc")


def cache_dir() -> Path:
    """Where built kernels are kept: ``$AREAL_CACHE_DIR/kernels``, else
    ``$XDG_CACHE_HOME/areal/kernels``, else ``~/.cache/areal/kernels``."""
    if root := os.environ.get("AREAL_CACHE_DIR"):
        return Path(root) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "areal" / "kernels"


def cpu_identity() -> str | None:
    """This machine's CPU model and instruction-set flags (what ``-march=native`` targets), from
    ``/proc/cpuinfo``; ``None`` where that cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    wanted = ("model name", "flags", "Features", "CPU part")  # x86; Arm names its flags Features
    seen = {line.split(":")[0].strip(): line for line in lines if ":" in line}
    picked = [seen[k] for k in wanted if k in seen]
    return "\n".join(picked) if picked else None


def build_key(compiler_path: str) -> str | None:
    """The cache key of a build: the source, the flags, the compiler binary (path, size, mtime:
    an upgrade changes them) and :func:`cpu_identity`; ``None`` (do not keep the build) when the
    CPU cannot be identified."""
    cpu = cpu_identity()
    if cpu is None:
        return None
    real = os.path.realpath(compiler_path)
    st = os.stat(real)
    parts = [SOURCE, " ".join(FLAGS), real, str(st.st_size), str(st.st_mtime_ns), cpu]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _compile(cc: str, where: Path) -> Path:
    """``SOURCE`` compiled by ``cc`` into ``where/decode_attention.so``; ``RuntimeError`` with
    the compiler's message when it fails."""
    src, lib = where / "decode_attention.c", where / "decode_attention.so"
    src.write_text(SOURCE)
    cmd = [cc, *FLAGS, str(src), "-o", str(lib)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{cc} did not finish within {BUILD_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:-3])} failed: {done.stderr.strip()[-600:]}")
    return lib


def _keep(lib: Path, kept: Path) -> None:
    """Copy the built ``lib`` to ``kept`` for the next process (written under a temporary name,
    then renamed: servers starting together each write a whole file, and a process that mapped
    the old file keeps it); a warning when the cache cannot be written."""
    partial = kept.with_name(f".{kept.name}.{os.getpid()}")
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(lib, partial)
        os.replace(partial, kept)
    except OSError as e:
        with contextlib.suppress(OSError):  # a partial copy, if any: the warning is what matters
            partial.unlink(missing_ok=True)
        logger.warning(
            "decode attention: could not keep the built kernel in %s (%s); every server start "
            "builds it again. Set AREAL_CACHE_DIR to a writable directory.",
            kept.parent,
            e,
        )


@functools.cache
def _built(cc: str) -> DecodeAttentionKernel:
    """One build per compiler per process: the kernel holds no state."""
    return DecodeAttentionKernel.build(cc)


def load_decode_attention(
    mode: Mode, device: torch.device, dtype: torch.dtype
) -> DecodeAttentionKernel | None:
    """The kernel per ``mode`` for a model on ``device``/``dtype``; ``None`` = use the matmuls.

    The kernel covers CPU fp32 only; other devices and dtypes use the matmul path in any mode.
    """
    if mode not in ("auto", "compiled", "torch"):
        raise ValueError(f"cpu_attention: {mode!r} is not one of auto, compiled, torch")
    if mode == "torch" or device.type != "cpu" or dtype != torch.float32:
        return None
    try:
        return _built(compiler())
    except RuntimeError as e:
        if mode == "compiled":
            raise RuntimeError(
                f"cpu_attention=compiled: the decode-attention kernel could not be built: {e}. "
                "Install a C compiler with OpenMP (gcc) or set cpu_attention=torch"
            ) from None
        logger.warning(
            "decode attention: the compiled CPU kernel could not be built (%s); using batched "
            "matmuls (~2x slower attention). Install gcc, or set cpu_attention=torch to "
            "choose that path explicitly.",
            e,
        )
        return None
