"""One-GPU benchmark of the GPU speed issue: generation, training and weight update of a
random-weight model, each figure against its target, measured in one run on one machine.

Run on a GPU: ``python bench/gpu.py --shape qwen2.5-0.5b --out runs/gpu_bench.json`` (sized for
about 3 minutes on an H100, estimated from the issue's H200 figures; ``--budget-s`` bounds the
wall clock, model build included: a measurement that would start past it is skipped and the
table says so). CPU smoke run: ``python bench/gpu.py --shape tiny`` (well
under 2 minutes on 2 cores; its figures only show that every stage runs).

``--shape qwen2.5-0.5b`` is Qwen2.5-0.5B's config (494M parameters, hidden 896, 24 layers, 14
heads, 2 KV heads, intermediate 4864, vocab 151,936, tied embeddings) with random bf16 weights,
built locally (no hub) with the repo's byte-level tokenizer; ``tiny`` is the tests' 3.2M model.
Stages, each guarded (one that raises records its error in the table, the others still run):

1. probe: device-to-device copy bandwidth (bytes read + written per second) and the matmul
   FLOP/s of the compute dtype (bf16 on GPU, fp32 on CPU), both measured here;
2. gen: our in-process ``Generator``, at each ``--concurrency`` that many random prompts of
   ``--prompt-len`` tokens submitted at once, ``--new-tokens`` new tokens each with EOS
   ignored, sampled (T=1, top-p 1) and greedy: tokens/s and the median time to first token;
   the memory-bandwidth limit = copy bandwidth / (weight bytes + KV bytes read per decode step
   at the mean context length) x concurrency, and ours as a fraction of it;
3. hf: Hugging Face ``generate`` on the same prompts, sampled (top-k off, EOS suppressed by
   ``min_new_tokens``): tokens/s and ours / HF;
4. http: ``areal serve`` as a subprocess on a free loopback port (same device, dtype and
   context; on CPU one thread, as in process), one ``/generate`` request per sample with
   ``return_logprob``, over one client session, sampled and greedy: tokens/s and the ratio to
   in-process;
5. train: the FSDP2 SFT engine on a one-rank group (NCCL on GPU, gloo on CPU), a packed batch
   of ``--train-seqs`` x ``--train-len`` tokens in one micro-batch, fp32 master weights:
   tokens/s, MFU = 6 N tokens/s / the probe's matmul FLOP/s, peak memory
   (``torch.cuda.max_memory_allocated``; not measured on CPU);
6. update: the trainer's HF export (``update_weights``, disk) then the server's
   ``/update_weights_from_disk``, server and trainer on the same device: seconds (best of 2);
7. prefix: the prefix cache's hit case (``bench/prefix_cache.py``): max concurrency / 8 prompts
   of 8x ``--prompt-len`` tokens, 8 samples each sent as separate requests, at most half the
   max concurrency running: tokens/s with the cache on and off in the same run, the ratio, the
   hit rate and whether both generated the same tokens;
8. levers: each trainer lever on and off on the train stage's batch shape
   (``bench/gpu_trainer.py``): tokens/s and its ratio to the all-off baseline, MFU, peak memory;
9. sync: weight sync seconds trainer -> server by ``weight_update_mode`` (``bench/gpu_sync.py``):
   disk, distributed (NCCL, the server on a second GPU) and ipc (the server on the trainer's);
10. engine: the decode step's modes (``bench/gpu_engine.py``): eager, compiled, CUDA graphs and
   both, greedy tokens/s at each concurrency, the ratio to eager and whether tokens agree.

Prints the device name and one Markdown table (metric, measured, target, met) and writes the
same rows as JSON (``--out``). Targets are the issue's and hold for the 0.5B shape on one H100
or H200. Exit code 1 when a stage raised (after the table and the JSON are written).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import signal
import statistics
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tests' server helper: `areal serve` on a free port, reaped

from areal.api.config.base import MicroBatchSpec, OptimizerConfig  # noqa: E402
from areal.api.config.engine import TrainEngineConfig  # noqa: E402
from areal.api.io import WeightUpdateMeta  # noqa: E402
from areal.runtime.dist import close_distributed, init_distributed  # noqa: E402
from areal.serving.generator import Generator  # noqa: E402
from areal.serving.sampling import SamplingParams  # noqa: E402
from areal.utils.batch import PackedBatch  # noqa: E402
from areal.utils.tiny_model import build_tiny_model, build_tokenizer, count_parameters  # noqa: E402
from tests.serving.servers import start_servers, stop_servers  # noqa: E402

QWEN2_5_0_5B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
)  # fmt: skip
PROMPT_VOCAB = 256  # random prompt and training ids are byte tokens: they decode to text


@dataclass(frozen=True)
class Sizes:
    """Workload of one shape (each can be overridden on the command line)."""

    concurrency: tuple[int, ...]  # requests in flight at once (one batch of this many prompts)
    prompt_len: int  # tokens
    new_tokens: int  # tokens generated per request, EOS ignored
    train_seqs: int  # sequences per packed training batch
    train_len: int  # tokens per training sequence
    train_steps: int  # timed optimizer steps (after one warm-up step)


SIZES = {
    "qwen2.5-0.5b": Sizes((64, 256), 64, 256, 32, 512, 3),
    "tiny": Sizes((4, 16), 16, 32, 4, 128, 2),
}
# Targets of the GPU speed issue (0.5B shape, one H100/H200): (">=" or "<=", bound)
GEN_TARGET = {64: 20_000.0, 256: 60_000.0}  # tok/s in process, sampled and greedy
HTTP_RATIO_TARGET = (">=", 0.90)  # HTTP tok/s / in-process tok/s
MFU_TARGET = (">=", 0.35)
PEAK_MEMORY_TARGET = ("<=", 24.0)  # GiB
WEIGHT_UPDATE_TARGET = ("<=", 0.5)  # seconds, trainer -> colocated server


@dataclass
class Bench:
    """One run's settings, what the stages found (``facts``) and the table rows."""

    args: argparse.Namespace
    sizes: Sizes
    device: torch.device
    dtype: torch.dtype  # generation and training compute dtype
    work: Path  # temp dir: the model, exported weights
    deadline: float  # time.monotonic() past which no measurement starts
    model_dir: str = ""
    rows: list[dict] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    stage_s: dict[str, float] = field(default_factory=dict)
    server: list = field(default_factory=list)  # [(process, "host:port")] once started
    engine: Any = None  # the SFT engine of `train`, reused by `update`

    def left(self) -> float:
        """Seconds left of the budget."""
        return self.deadline - time.monotonic()

    def skip(self, metric: str) -> bool:
        """True (and a row saying so) when the budget is spent."""
        if self.left() > 0:
            return False
        self.add(metric, f"skipped: past --budget-s {self.args.budget_s:g}")
        return True

    def add(
        self,
        metric: str,
        value: float | str | None,
        unit: str = "",
        target: tuple[str, float] | None = None,
    ) -> None:
        """One table row; ``met`` is yes/no when there is a target and a number."""
        met = ""
        if target is not None and isinstance(value, (int, float)):
            op, bound = target
            met = "yes" if (value >= bound if op == ">=" else value <= bound) else "no"
        self.rows.append({
            "metric": metric, "value": value, "unit": unit, "measured": _fmt(value, unit),
            "target": f"{target[0]} {_fmt(target[1], unit)}" if target else "", "met": met,
        })  # fmt: skip

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def _fmt(value: float | str | None, unit: str) -> str:
    if value is None or isinstance(value, str):
        return "n/a" if value is None else value
    if unit == "%":
        return f"{100 * value:.1f}%"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "s":
        return f"{value:.3f} s"
    if unit in ("tok/s", "GB/s", "TFLOP/s"):
        return f"{value:,.1f} {unit}" if value < 100 else f"{value:,.0f} {unit}"
    return f"{value:.2f} {unit}".rstrip()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Best wall seconds of ``fn`` over ``reps`` runs after one warm-up, device synchronised."""
    fn()
    _sync(device)
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, PROMPT_VOCAB, (n, length), generator=g).tolist()


# ---------------------------------------------------------------------------------- the model


def build_model(out: Path, shape: str, device: torch.device) -> str:
    """Write a random-weight HF Qwen2 dir of ``shape`` to ``out`` (bf16 for the 0.5B shape)."""
    if shape == "tiny":
        return str(build_tiny_model(out, size="tiny", seed=0, max_position_embeddings=2048))
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = (
        build_tokenizer()
    )  # 259 tokens: text of the ids past it is empty (ids are what count)
    config = Qwen2Config(
        **QWEN2_5_0_5B,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        torch_dtype="bfloat16",
    )
    with torch.random.fork_rng(devices=[]), torch.device(device):  # init on the GPU: seconds
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    return str(out)


def _context(b: Bench) -> int:
    """Context length given to our generator and server: the workload's longest sequence."""
    return b.sizes.prompt_len + b.sizes.new_tokens + 8


def bandwidth_limit(b: Bench, concurrency: int) -> float:
    """Decode tokens/s if each step read the weights and every running request's KV cache (at
    the mean context length) once at the measured copy bandwidth."""
    cfg = json.loads((Path(b.model_dir) / "config.json").read_text())
    elem = torch.finfo(b.dtype).bits // 8  # bytes per weight and per cached value
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_per_token = (
        2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * elem
    )  # K+V
    mean_context = b.sizes.prompt_len + b.sizes.new_tokens / 2  # tokens
    step_bytes = b.facts["n_params"] * elem + concurrency * mean_context * kv_per_token
    return b.facts["copy_bandwidth"] / step_bytes * concurrency


# ---------------------------------------------------------------------------------- stages


def _matmuls(x: torch.Tensor, y: torch.Tensor, k: int) -> list[torch.Tensor]:
    """``k`` products ``x @ y`` (the timed work of the matmul probe)."""
    return [x @ y for _ in range(k)]


def stage_probe(b: Bench) -> None:
    """Copy bandwidth and matmul FLOP/s of this device."""
    n = (1 << 30) if b.cuda else (1 << 27)  # bytes copied
    src = torch.empty(n, dtype=torch.uint8, device=b.device)
    dst = torch.empty_like(src)
    t = _best_time(functools.partial(dst.copy_, src), b.device, reps=5)
    b.facts["copy_bandwidth"] = 2 * n / t  # bytes read + written per second
    del src, dst
    m, k = (8192, 10) if b.cuda else (1024, 1)  # matrix side, matmuls per timed run
    x = torch.randn(m, m, device=b.device, dtype=b.dtype)
    y = torch.randn(m, m, device=b.device, dtype=b.dtype)
    t = _best_time(functools.partial(_matmuls, x, y, k), b.device, reps=5)
    b.facts["matmul_peak"] = 2 * m**3 * k / t  # FLOP/s
    del x, y
    b.add("device-to-device copy bandwidth", b.facts["copy_bandwidth"] / 1e9, "GB/s")
    dtype = str(b.dtype).removeprefix("torch.")
    b.add(f"{dtype} matmul peak ({m}^2)", b.facts["matmul_peak"] / 1e12, "TFLOP/s")


def _gen_run(b: Bench, gen: Generator, concurrency: int, temperature: float) -> None:
    mode = "greedy" if temperature == 0 else "sampled"
    metric = f"gen in-process {mode} @{concurrency}"
    if b.skip(metric):
        return
    prompts = _prompts(concurrency, b.sizes.prompt_len, seed=concurrency)
    params = SamplingParams(
        max_new_tokens=b.sizes.new_tokens, temperature=temperature, top_p=1.0, ignore_eos=True
    )
    t = time.perf_counter()
    results = gen.generate(prompts, params, timeout=max(b.left(), 60.0))
    seconds = time.perf_counter() - t
    tps = sum(len(r.output_ids) for r in results) / seconds
    b.facts[f"gen_{mode}_{concurrency}"] = tps
    target = (">=", GEN_TARGET[concurrency]) if concurrency in GEN_TARGET else None
    b.add(metric, tps, "tok/s", target)
    b.add(
        f"time to first token p50, {mode} @{concurrency}",
        statistics.median(r.ttft for r in results),
        "s",
    )


def stage_gen(b: Bench) -> None:
    """Our generator in this process: tokens/s and TTFT per concurrency and mode."""
    gen = Generator.from_pretrained(
        b.model_dir,
        device=str(b.device),
        dtype=b.dtype,
        max_batch_size=max(b.sizes.concurrency),
        context_length=_context(b),
        num_threads=0 if b.cuda else 1,  # on CPU as the server runs (tests' helper: 1 thread)
    ).start()
    try:
        warm = SamplingParams(max_new_tokens=4, ignore_eos=True)
        for c in b.sizes.concurrency:  # each batch size once (kernels, allocator, any capture)
            gen.generate(_prompts(c, b.sizes.prompt_len, seed=1), warm)
        for c in b.sizes.concurrency:
            for temperature in (1.0, 0.0):
                _gen_run(b, gen, c, temperature)
            if f"gen_sampled_{c}" in b.facts and "copy_bandwidth" in b.facts:
                limit = bandwidth_limit(b, c)
                b.add(f"bandwidth limit @{c}", limit, "tok/s")
                b.add(
                    f"in-process sampled / bandwidth limit @{c}",
                    b.facts[f"gen_sampled_{c}"] / limit,
                    "%",
                )
    finally:
        gen.shutdown()
        del gen
        if b.cuda:
            torch.cuda.empty_cache()


def _hf_generate(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> int:
    """Sampled HF generate of one batch (equal-length prompts, no padding); returns new tokens."""
    ids = torch.tensor(prompts, device=device)  # [B, P]
    pad = model.generation_config.pad_token_id
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad,
        )  # [B, P + new_tokens]; min_new_tokens suppresses EOS
    _sync(device)
    return (out.shape[1] - ids.shape[1]) * out.shape[0]


def stage_hf(b: Bench) -> None:
    """Hugging Face generate at each concurrency, sampled; ours / HF."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(b.model_dir, dtype=b.dtype).to(b.device).eval()
    threads = torch.get_num_threads()
    if not b.cuda:
        torch.set_num_threads(1)  # on CPU with the thread count ours ran with
    try:
        _hf_generate(model, _prompts(max(b.sizes.concurrency), b.sizes.prompt_len, 1), 2, b.device)
        for c in b.sizes.concurrency:
            if b.skip(f"HF generate sampled @{c}"):
                continue
            prompts = _prompts(c, b.sizes.prompt_len, seed=c)
            t = time.perf_counter()
            tps = _hf_generate(model, prompts, b.sizes.new_tokens, b.device) / (
                time.perf_counter() - t
            )
            b.add(f"HF generate sampled @{c}", tps, "tok/s")
            if f"gen_sampled_{c}" in b.facts:
                b.add(f"in-process / HF, sampled @{c}", b.facts[f"gen_sampled_{c}"] / tps, "x")
    finally:
        torch.set_num_threads(threads)
        del model
        if b.cuda:
            torch.cuda.empty_cache()


def _server(b: Bench) -> str:
    """``host:port`` of the one ``areal serve`` of this run, started on first use."""
    if not b.server:
        dtype = str(b.dtype).removeprefix("torch.")
        b.server = start_servers(
            b.model_dir,
            1,
            f"device={b.device}",
            f"dtype={dtype}",
            f"max_batch_size={max(b.sizes.concurrency)}",
            f"context_length={_context(b)}",
        )
    return b.server[0][1]


async def _http_batch(
    session, addr: str, prompts: list[list[int]], sampling: dict
) -> tuple[float, int]:
    """All prompts as concurrent ``/generate`` requests: (wall seconds, tokens generated)."""

    async def one(prompt: list[int]) -> int:
        body = {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}
        async with session.post(f"http://{addr}/generate", json=body) as resp:
            answer = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"/generate answered HTTP {resp.status}: {str(answer)[:300]}")
            return len(answer["output_ids"])

    t = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - t, sum(counts)


async def _http_runs(b: Bench, addr: str) -> None:
    """Warm-up at each concurrency, then the timed runs, over one session: the warm-up opens
    the connections the timed runs reuse (a burst of new ones can overflow the listen backlog,
    whose SYN retries would cost whole seconds)."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=300)
    timeout = aiohttp.ClientTimeout(total=max(b.left(), 60.0) + 60.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for c in b.sizes.concurrency:
            await _http_batch(
                session,
                addr,
                _prompts(c, b.sizes.prompt_len, 1),
                {"max_new_tokens": 4, "ignore_eos": True},
            )
        for c in b.sizes.concurrency:
            for mode, temperature in (("sampled", 1.0), ("greedy", 0.0)):
                if b.skip(f"gen HTTP {mode} @{c}"):
                    continue
                sampling = {
                    "max_new_tokens": b.sizes.new_tokens,
                    "temperature": temperature,
                    "top_p": 1.0,
                    "ignore_eos": True,
                }
                prompts = _prompts(c, b.sizes.prompt_len, seed=c)
                seconds, tokens = await _http_batch(session, addr, prompts, sampling)
                b.add(f"gen HTTP {mode} @{c}", tokens / seconds, "tok/s")
                if f"gen_{mode}_{c}" in b.facts:
                    ratio = tokens / seconds / b.facts[f"gen_{mode}_{c}"]
                    b.add(f"HTTP / in-process, {mode} @{c}", ratio, "%", HTTP_RATIO_TARGET)


def stage_http(b: Bench) -> None:
    """Our HTTP server, one request per sample with logprobs: tokens/s and ratio to in-process."""
    asyncio.run(_http_runs(b, _server(b)))


def _engine(b: Bench):
    """The SFT engine (fp32 master weights, bf16 compute on GPU) on a one-rank group, whole
    training batch in one micro-batch."""
    from areal.engine.sft import SFTEngine

    if b.engine is None:
        tokens = b.sizes.train_seqs * b.sizes.train_len
        cfg = TrainEngineConfig(
            path=b.model_dir,
            mb_spec=MicroBatchSpec(max_tokens_per_mb=tokens),
            optimizer=OptimizerConfig(lr=1e-5),
        )
        b.engine = SFTEngine(cfg, init_distributed("nccl" if b.cuda else "gloo").mesh)
        b.engine.initialize(None)
    return b.engine


def stage_train(b: Bench) -> None:
    """SFT steps on a packed batch: tokens/s, MFU against the probe's peak, peak memory."""
    s = b.sizes
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, PROMPT_VOCAB, (s.train_seqs, s.train_len), generator=g).tolist()
    masks = [[0] + [1] * (s.train_len - 1) for _ in ids]  # every token but the first is a target
    batch = PackedBatch.from_sequences({"input_ids": ids, "loss_mask": masks})
    engine = _engine(b)
    if b.cuda:
        torch.cuda.reset_peak_memory_stats(b.device)
    engine.train_lm(batch)  # warm-up
    _sync(b.device)
    t = time.perf_counter()
    for _ in range(s.train_steps):
        _, stats = engine.train_lm(batch)
    _sync(b.device)
    tps = batch.n_tokens * s.train_steps / (time.perf_counter() - t)
    b.add(f"train tokens/s ({s.train_seqs} x {s.train_len} packed)", tps, "tok/s")
    if "matmul_peak" in b.facts:
        mfu = 6 * b.facts["n_params"] * tps / b.facts["matmul_peak"]
        b.add("train MFU (6 N tokens/s / matmul peak)", mfu, "%", MFU_TARGET)
    peak = torch.cuda.max_memory_allocated(b.device) / 2**30 if b.cuda else None
    b.add("train peak memory allocated", peak, "GiB", PEAK_MEMORY_TARGET)
    if not math.isfinite(stats["loss"]):
        raise RuntimeError(
            f"training loss is {stats['loss']}; the figures above are of a broken step"
        )


def _post(addr: str, path: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(
        f"http://{addr}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:  # the server's answer names the cause
        answer = e.read().decode(errors="replace")[:300]
        raise RuntimeError(f"{path} answered HTTP {e.code}: {answer}") from None


def stage_update(b: Bench) -> None:
    """Trainer HF export to disk + the server's reload, seconds; best of two updates."""
    engine, addr = _engine(b), _server(b)
    best: tuple[float, float] | None = None
    for version in (1, 2):
        if version > 1 and b.left() <= 0:
            break
        path = b.work / "weights" / f"v{version}"
        t = time.perf_counter()
        engine.update_weights(WeightUpdateMeta("disk", path=str(path), version=version))
        export = time.perf_counter() - t
        t = time.perf_counter()
        body = {"model_path": str(path), "weight_version": version}
        answer = _post(addr, "/update_weights_from_disk", body, 600)
        load = time.perf_counter() - t
        if answer.get("weight_version") != version:
            raise RuntimeError(
                f"/update_weights_from_disk answered {answer}; expected version {version}"
            )
        if best is None or export + load < sum(best):
            best = (export, load)
    b.add("weight update: trainer HF export to disk", best[0], "s")
    b.add("weight update: server /update_weights_from_disk", best[1], "s")
    b.add("weight update total, colocated", sum(best), "s", WEIGHT_UPDATE_TARGET)


def stage_engine(b: Bench) -> None:
    """The decode step's modes on this run's model (bench/gpu_engine.py), same run."""
    from bench.gpu_engine import compare

    if b.skip("decode modes"):
        return
    rows = compare(
        b.model_dir, str(b.device), b.dtype, list(b.sizes.concurrency), b.sizes.prompt_len,
        b.sizes.new_tokens, num_threads=0 if b.cuda else 1,
    )  # fmt: skip
    for r in rows:
        at = f"{r['mode']} @{r['concurrency']}"
        b.add(f"gen decode {at}, greedy", r["tok_s"], "tok/s")
        b.add(f"decode {at} / eager", r["ratio"], "x")
        b.add(f"decode {at} tokens == eager", "yes" if r["same_tokens"] else "no")


def stage_prefix(b: Bench) -> None:
    """The prefix cache's hit case (bench/prefix_cache.py): 8 samples per prompt as separate
    requests, prompts 8x --prompt-len, at most half the top concurrency running; on vs off."""
    from bench.prefix_cache import compare, workload

    if b.skip("prefix cache, 8 samples per prompt"):
        return
    n = max(b.sizes.concurrency)
    work = workload(n // 8, 8, 8 * b.sizes.prompt_len, max(b.sizes.new_tokens // 4, 1))
    r = compare(
        b.model_dir, work, device=str(b.device), dtype=b.dtype, max_batch=max(n // 2, 1),
        repeats=2, num_threads=0 if b.cuda else 1,
    )  # fmt: skip
    b.add("gen prefix cache on, 8 samples/prompt", r["on_tok_s"], "tok/s")
    b.add("gen prefix cache off, 8 samples/prompt", r["off_tok_s"], "tok/s")
    b.add("prefix cache on / off, 8 samples/prompt", r["ratio"], "x")
    b.add("prefix cache hit rate, 8 samples/prompt", r["hit_rate"], "%")
    b.add("prefix cache on == off outputs", "yes" if r["same_outputs"] else "no")


def stage_levers(b: Bench) -> None:
    """Each trainer lever on and off (bench/gpu_trainer.py) on the train stage's batch shape."""
    from bench.gpu_trainer import lever_rows, matmul_peak

    peak = b.facts.get("matmul_peak") or matmul_peak(b.device)
    mesh = init_distributed("nccl" if b.cuda else "gloo").mesh
    s = b.sizes
    for metric, value, unit in lever_rows(
        b.model_dir, mesh, peak, s.train_seqs, s.train_len, s.train_steps
    ):
        b.add(metric, value, unit)


def stage_sync(b: Bench) -> None:
    """Weight sync seconds by mode, disk / distributed / ipc (bench/gpu_sync.py), this model."""
    from bench.gpu_sync import TARGETS, measure, rows

    for row in rows(b.args.shape, measure(b.model_dir, b.work)):
        target = TARGETS.get(row["metric"].rsplit(" ", 1)[1])
        b.add(row["metric"], row["value"], "s", ("<=", target) if target else None)


STAGES: dict[str, Callable[[Bench], None]] = {
    "probe": stage_probe, "gen": stage_gen, "hf": stage_hf, "http": stage_http,
    "train": stage_train, "update": stage_update, "prefix": stage_prefix, "levers": stage_levers,
    "sync": stage_sync, "engine": stage_engine,
}  # fmt: skip


def run_stage(b: Bench, name: str) -> None:
    """Run one stage; an exception becomes an error row (traceback on stderr), not a stop."""
    if b.skip(f"stage {name}"):
        return
    t = time.perf_counter()
    print(f"[gpu bench] {name} ... ({b.left():.0f} s of budget left)", flush=True)
    try:
        STAGES[name](b)
    except Exception as e:  # recorded as data: the other stages still run
        traceback.print_exc()
        b.errors[name] = f"{type(e).__name__}: {e}"
        b.add(
            f"stage {name}",
            f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
        )
    b.stage_s[name] = time.perf_counter() - t


# ---------------------------------------------------------------------------------- main


def render(rows: list[dict]) -> str:
    """The rows as one Markdown table."""
    lines = ["| metric | measured | target | met |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['metric']} | {r['measured']} | {r['target']} | {r['met']} |" for r in rows]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SIZES), default="qwen2.5-0.5b")
    p.add_argument("--device", default="auto", help="auto = cuda when available, else cpu")
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        help="concurrent requests per run (default: 64 256 for the 0.5B shape, 4 16 for tiny)",
    )
    p.add_argument("--prompt-len", type=int, help="prompt tokens (default 64; tiny 16)")
    p.add_argument("--new-tokens", type=int, help="new tokens per request (default 256; tiny 32)")
    p.add_argument("--train-seqs", type=int, help="sequences per packed batch (default 32; tiny 4)")
    p.add_argument("--train-len", type=int, help="tokens per sequence (default 512; tiny 128)")
    p.add_argument(
        "--train-steps", type=int, help="timed steps after a warm-up (default 3; tiny 2)"
    )
    p.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES))
    p.add_argument(
        "--budget-s",
        type=float,
        default=240.0,
        help="wall-clock bound: no measurement starts past it (seconds)",
    )
    p.add_argument("--out", help="JSON file for the rows (default: none)")
    return p.parse_args()


def _sizes(args: argparse.Namespace) -> Sizes:
    given = {
        k: getattr(args, k) for k in Sizes.__dataclass_fields__ if getattr(args, k) is not None
    }
    if "concurrency" in given:
        given["concurrency"] = tuple(given["concurrency"])
    return replace(SIZES[args.shape], **given)


def main() -> int:
    """Build the model, run the stages, print the table, write the JSON."""
    args = parse_args()
    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # an outer timeout: still stop the server
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    sizes = _sizes(args)
    print(f"device: {name}; torch {torch.__version__}; shape {args.shape}; {sizes}", flush=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="areal-gpu-bench-") as tmp:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        b = Bench(args, sizes, device, dtype, Path(tmp), t0 + args.budget_s)
        b.model_dir = build_model(Path(tmp) / "model", args.shape, device)
        b.facts["n_params"] = count_parameters(b.model_dir)
        b.add(f"model {args.shape} parameters (random weights)", b.facts["n_params"] / 1e6, "M")
        try:
            for stage in args.stages:
                run_stage(b, stage)
        finally:
            if b.engine is not None:
                b.engine.destroy()
            if b.server:
                stop_servers(b.server)
            close_distributed()
    report = {
        "device": name, "torch": torch.__version__, "shape": args.shape, "sizes": sizes.__dict__,
        "dtype": str(dtype), "wall_s": time.monotonic() - t0, "stage_s": b.stage_s,
        "errors": b.errors, "rows": b.rows,
    }  # fmt: skip
    title = f"## bench/gpu.py on {name} ({args.shape}, {report['wall_s']:.0f} s)"
    print(f"\n{title}\n\n{render(b.rows)}\n", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {args.out}")
    return 1 if b.errors else 0


if __name__ == "__main__":
    sys.exit(main())
