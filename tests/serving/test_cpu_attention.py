"""The compiled CPU decode-attention kernel: equal to softmax attention, and its build modes."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from areal.serving import cpu_attention
from areal.serving.cpu_attention import DecodeAttentionKernel, compiler, load_decode_attention
from tests.serving.conftest import needs_cc

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel():
    return DecodeAttentionKernel.build()


def reference(q, k, v, lengths):
    """Plain softmax attention per (row, query head) over the row's first ``lengths[b]`` keys."""
    B, (_, H, _, D) = q.shape[0], k.shape  # k [S, H, C, D]
    G = q.shape[1] // (H * D)
    out = torch.empty(B, H, G, D, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        for h in range(H):
            qs = q[b].view(H, G, D)[h].double()
            w = torch.softmax(qs @ k[b, h, :n].double().T, -1)
            out[b, h] = w @ v[b, h, :n].double()
    return out.view(B, -1).float()


@needs_cc
@pytest.mark.parametrize(("H", "G", "D"), [(2, 2, 64), (8, 1, 64), (2, 4, 128), (3, 2, 48)])
def test_kernel_equals_softmax_attention(kernel, H, G, D):
    # Lengths 1, exactly one softmax block (128), one past it, and several blocks; the cache has
    # more slots and capacity than the rows use, and q rows are strided (a slice of a wider qkv).
    gen = torch.Generator().manual_seed(H * 100 + G * 10 + D)
    S, C = 7, 320
    k, v = (torch.randn(S, H, C, D, generator=gen) for _ in range(2))
    lengths = torch.tensor([1, 128, 129, 300, 57])
    qkv = torch.randn(len(lengths), H * G * D + 3 * D, generator=gen) * D**-0.5
    q = qkv[:, : H * G * D]
    assert not q.is_contiguous()
    torch.testing.assert_close(
        kernel(q, k, v, lengths), reference(q, k, v, lengths), atol=2e-6, rtol=1e-5
    )


@needs_cc
def test_kernel_softmax_holds_at_extreme_score_ranges(kernel):
    # Scores spanning ~+-400: most weights underflow to 0 and the later blocks raise the running
    # max (the rescaling path); the result still equals softmax attention.
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 400, 64, generator=gen), torch.randn(2, 2, 400, 64, generator=gen)
    k[:, :, 200:] *= 3  # later keys score higher: the max moves up block by block
    q = torch.randn(2, 2 * 2 * 64, generator=gen) * 8
    lengths = torch.tensor([400, 333])
    torch.testing.assert_close(
        kernel(q, k, v, lengths), reference(q, k, v, lengths), atol=2e-6, rtol=1e-5
    )


@needs_cc
def test_kernel_rejects_operands_it_cannot_read(kernel):
    k = v = torch.zeros(4, 2, 16, 64)
    q, lengths = torch.zeros(3, 256), torch.ones(3, dtype=torch.long)
    with pytest.raises(ValueError, match="decode_attention: bad operands"):
        kernel(q.double(), k, v, lengths)
    with pytest.raises(ValueError, match="decode_attention: bad operands"):
        kernel(q, k, v, lengths.int())
    with pytest.raises(ValueError, match="decode_attention: bad operands"):
        kernel(q, k.transpose(2, 3), v, lengths)  # a non-contiguous cache
    for n in (0, 17):  # no key, or more keys than the cache's 16 positions: nothing is read
        with pytest.raises(ValueError, match=f"row 1 has {n} keys; the cache holds 1..16"):
            kernel(q, k, v, torch.tensor([3, n, 5]))


def test_modes_when_no_compiler_is_found(monkeypatch, caplog):
    monkeypatch.setenv("CC", "no-such-compiler-areal")
    with pytest.raises(
        RuntimeError, match="could not be built.*'no-such-compiler-areal' not found"
    ):
        load_decode_attention("compiled", CPU, torch.float32)
    with caplog.at_level(logging.WARNING, logger="areal.serving.cpu_attention"):
        assert load_decode_attention("auto", CPU, torch.float32) is None
    assert "using batched matmuls" in caplog.text and "no-such-compiler-areal" in caplog.text
    caplog.clear()
    assert load_decode_attention("torch", CPU, torch.float32) is None
    assert load_decode_attention("compiled", CPU, torch.bfloat16) is None  # CPU fp32 only
    assert not caplog.text  # neither tried to build
    with pytest.raises(ValueError, match="cpu_attention: 'fast' is not one of"):
        load_decode_attention("fast", CPU, torch.float32)  # type: ignore[arg-type]


def test_a_compile_error_is_reported_with_the_compiler_output(monkeypatch, tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'omp.h: No such file or directory' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    with pytest.raises(RuntimeError, match="failed: omp.h: No such file or directory"):
        DecodeAttentionKernel.build()


def counting_compiler(tmp_path: Path) -> tuple[str, Path]:
    """A ``cc`` that records each call in a file and runs the real compiler."""
    calls, cc = tmp_path / "calls", tmp_path / "counting-cc"
    cc.write_text(f'#!/bin/sh\necho x >> {calls}\nexec {shutil.which(compiler())} "$@"\n')
    cc.chmod(0o755)
    return str(cc), calls


def n_calls(calls: Path) -> int:
    return len(calls.read_text().splitlines()) if calls.exists() else 0


def small_check(kernel: DecodeAttentionKernel) -> None:
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 2, 16, 64, generator=gen), torch.randn(2, 2, 16, 64, generator=gen)
    q, lengths = torch.randn(2, 256, generator=gen), torch.tensor([16, 5])
    torch.testing.assert_close(
        kernel(q, k, v, lengths), reference(q, k, v, lengths), atol=2e-6, rtol=1e-5
    )


@needs_cc
def test_a_built_kernel_is_kept_and_the_next_build_loads_it_without_compiling(tmp_path, caplog):
    cc, calls = counting_compiler(tmp_path)
    cache = tmp_path / "cache"
    small_check(DecodeAttentionKernel.build(cc, cache))
    [kept] = cache.glob("decode_attention-*.so")
    small_check(DecodeAttentionKernel.build(cc, cache))
    assert n_calls(calls) == 1  # the second build loaded the kept library
    # A damaged file under the key (a full disk, a stray write), in another cache: this process
    # has the first one mapped, and the loader would hand back that mapping for its path.
    other = tmp_path / "other"
    other.mkdir()
    (other / kept.name).write_bytes(b"not a shared library")
    with caplog.at_level(logging.WARNING, logger="areal.serving.cpu_attention"):
        small_check(DecodeAttentionKernel.build(cc, other))
    assert n_calls(calls) == 2 and "rebuilding" in caplog.text
    assert [p.name for p in other.iterdir()] == [kept.name]  # replaced; no partial file left
    assert (other / kept.name).read_bytes()[:4] == b"\x7fELF"  # the rebuilt library


@needs_cc
def test_another_cpu_builds_its_own_and_an_unknown_cpu_keeps_nothing(tmp_path, monkeypatch):
    cc, calls = counting_compiler(tmp_path)
    cache = tmp_path / "cache"
    DecodeAttentionKernel.build(cc, cache)
    monkeypatch.setattr(cpu_attention, "cpu_identity", lambda: "model name : another\nflags : sse2")
    DecodeAttentionKernel.build(cc, cache)
    assert n_calls(calls) == 2 and len(list(cache.glob("*.so"))) == 2  # -march=native differs
    monkeypatch.setattr(cpu_attention, "cpu_identity", lambda: None)
    small_check(DecodeAttentionKernel.build(cc, cache))
    small_check(DecodeAttentionKernel.build(cc, cache))
    assert n_calls(calls) == 4 and len(list(cache.glob("*.so"))) == 2  # built, not kept


@needs_cc
def test_an_unwritable_cache_warns_and_the_kernel_still_runs(tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # the cache directory would have to be created under a file
    with caplog.at_level(logging.WARNING, logger="areal.serving.cpu_attention"):
        small_check(DecodeAttentionKernel.build(None, blocked / "kernels"))
    assert "could not keep the built kernel" in caplog.text and "AREAL_CACHE_DIR" in caplog.text


def test_the_cache_directory_follows_areal_cache_dir_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("AREAL_CACHE_DIR", str(tmp_path / "a"))
    assert cpu_attention.cache_dir() == tmp_path / "a" / "kernels"
    monkeypatch.delenv("AREAL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cpu_attention.cache_dir() == tmp_path / "x" / "areal" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert cpu_attention.cache_dir() == tmp_path / "h" / ".cache" / "areal" / "kernels"
