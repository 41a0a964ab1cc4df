"""`areal tinker serve` driven by the real `tinker` SDK (tier 2, CPU, a tiny Llama-family model:
its untied head lets the SDK's default ``train_unembed=True`` adapters export): SFT equal to our
SFT engine, samples equal to our generator's, an importance-sampling RL loop, state across a
restart, and refusals as the SDK's error types while the service keeps serving."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from areal.api.config.base import MicroBatchSpec, OptimizerConfig
from areal.api.config.engine import LoRAConfig, TrainEngineConfig
from areal.engine.sft import SFTEngine
from areal.runtime.dist import init_distributed
from areal.serving.generator import Generator
from areal.serving.sampling import SamplingParams
from areal.tinker.trainer import ATTN, MLP, UNEMBED
from areal.utils.batch import PackedBatch
from areal.utils.network import free_port
from areal.utils.tiny_model import build_tiny_model

pytestmark = pytest.mark.slow
KEY, OTHER_KEY = "tml-alice", "tml-bob"
ROOT = Path(__file__).resolve().parents[2]
ADAM = types.AdamParams(learning_rate=2e-3, beta1=0.9, beta2=0.95, eps=1e-12)


class Service:
    """One `areal tinker serve` process; :meth:`restart` keeps its root (checkpoints)."""

    def __init__(self, model: str, root: Path, *overrides: str):
        self.model, self.root, self.port = model, root, free_port()
        self.overrides = overrides  # `key=value` after this class's own (they win)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = root.parent / "service.log"

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "areal.cli",
            "tinker",
            "serve",
            "--model",
            self.model,
            "--port",
            str(self.port),
            f"root={self.root}",
            "max_batch_tokens=256",
            f'api_keys=["{KEY}","{OTHER_KEY}"]',
            *self.overrides,
        ]
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                urllib.request.urlopen(f"{self.url}/api/v1/healthz", timeout=2).read()
                return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"service did not answer: {self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self, key: str = KEY) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.url, api_key=key)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tinker_llama"), family="llama"))


@pytest.fixture(scope="module")
def service(tmp_path_factory, model_dir):
    s = Service(model_dir, tmp_path_factory.mktemp("tinker_service") / "root")
    s.start()
    yield s
    s.stop()


def sft_sequences(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Random 4-token prompts, then completions counting up by 3 (and their loss masks)."""
    g = np.random.default_rng(seed)
    ids, masks = [], []
    for n in (7, 10, 5, 9):
        prompt = g.integers(0, 200, 4).tolist()
        ids.append(prompt + [(prompt[-1] + 3 * (i + 1)) % 250 for i in range(n)])
        masks.append([0] * 4 + [1] * n)
    return ids, masks


def sft_datums(ids, masks) -> list[types.Datum]:
    """Our SFT batch as Tinker datums: position i predicts token i + 1, weighted by its mask."""
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": np.array(s[1:]), "weights": np.array(m[1:], "f4")},
        )
        for s, m in zip(ids, masks)
    ]


def mean_nll(result: types.ForwardBackwardOutput, data: list[types.Datum]) -> float:
    """The token-mean NLL of the weighted tokens (what our SFT engine reports as its loss)."""
    num = sum(
        -(o["logprobs"].to_numpy() * d.loss_fn_inputs["weights"].to_numpy()).sum()
        for o, d in zip(result.loss_fn_outputs, data)
    )
    return float(num / sum(d.loss_fn_inputs["weights"].to_numpy().sum() for d in data))


def test_sft_through_the_sdk_trains_as_our_sft_engine(service, model_dir):
    ids, masks = sft_sequences(0)
    data = sft_datums(ids, masks)
    tc = service.client().create_lora_training_client(base_model=model_dir, rank=4, seed=3).result()
    theirs = []
    for _ in range(4):
        fb = tc.forward_backward(data, "cross_entropy")
        step = tc.optim_step(ADAM)
        theirs.append(mean_nll(fb.result(), data))
        assert step.result().metrics["update_skipped:sum"] == 0.0

    cfg = TrainEngineConfig(
        path=model_dir,
        init_seed=3,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=8192),
        optimizer=OptimizerConfig(
            lr=2e-3, beta2=0.95, eps=1e-12, weight_decay=0.0, gradient_clipping=0.0
        ),
        lora=LoRAConfig(rank=4, alpha=32.0, target_modules=[*ATTN, *MLP, *UNEMBED]),
    )
    engine = SFTEngine(cfg, init_distributed("gloo").mesh)
    engine.initialize(None)
    batch = PackedBatch.from_sequences({"input_ids": ids, "loss_mask": masks})
    ours = [engine.train_lm(batch)[1]["loss"] for _ in range(4)]
    engine.destroy()
    # step 1: the same model and data; later steps: Tinker's summed loss and our token mean
    # differ by a constant factor, which Adam's update cancels (up to eps = 1e-12)
    assert theirs[0] == pytest.approx(ours[0], abs=1e-5)
    assert theirs == pytest.approx(ours, rel=1e-4)
    assert theirs[-1] < theirs[0] - 0.1, theirs  # it learns (~0.3 nats over 3 updates here)


def test_custom_loss_runs_client_side_as_our_cross_entropy(service, model_dir):
    """forward_backward_custom: the SDK's forward, the loss on the client, then a cross_entropy
    backward weighted by its gradients: the same update as cross_entropy itself."""
    data = sft_datums(*sft_sequences(4))

    def nll(data, logprobs):
        weights = [d.loss_fn_inputs["weights"].to_torch() for d in data]
        loss = sum(-(lp * w).sum() for lp, w in zip(logprobs, weights))
        return loss, {"nll:sum": float(loss)}

    sc = service.client()
    plain, custom = (
        sc.create_lora_training_client(base_model=model_dir, rank=4, seed=2).result()
        for _ in range(2)
    )
    plain.forward_backward(data, "cross_entropy")
    plain.optim_step(ADAM).result()
    custom.forward_backward_custom(data, nll).result()
    custom.optim_step(ADAM).result()
    after = [c.forward(data, "cross_entropy").result().metrics["loss:sum"] for c in (plain, custom)]
    assert after[0] == pytest.approx(after[1], rel=1e-5)


def test_samples_and_logprobs_equal_our_generator(service, model_dir):
    sampler = service.client().create_sampling_client(base_model=model_dir).result()
    prompt = [11, 22, 33, 44]
    params = types.SamplingParams(max_tokens=8, seed=7, temperature=1.0)
    got = sampler.sample(types.ModelInput.from_ints(prompt), 3, params).result()
    lp = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()

    gen = Generator.from_pretrained(model_dir).start()
    try:
        ours = gen.generate(
            [prompt] * 3, [SamplingParams(max_new_tokens=8, seed=7 + i) for i in range(3)]
        )
        ours_lp, _ = gen.prompt_logprobs(prompt)
    finally:
        gen.shutdown()
    assert [s.tokens for s in got.sequences] == [r.output_ids for r in ours]
    for s, r in zip(got.sequences, ours):
        assert s.logprobs == pytest.approx(r.output_logprobs, abs=1e-6)
    assert len({tuple(s.tokens) for s in got.sequences}) > 1  # seeds seed, seed+1, ... differ
    assert lp[0] is None and lp[1:] == pytest.approx(ours_lp[1:], abs=1e-6)


def test_sampling_clients_stay_pinned_to_their_weights(service, model_dir):
    ids, masks = sft_sequences(1)
    data = sft_datums(ids, masks)
    tc = service.client().create_lora_training_client(base_model=model_dir, rank=4, seed=5).result()
    prompt, params = (
        types.ModelInput.from_ints([5, 6, 7]),
        types.SamplingParams(max_tokens=6, seed=1),
    )
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(ADAM).result()
    first = tc.save_weights_and_get_sampling_client().result()
    before = first.sample(prompt, 1, params).result().sequences[0]
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    second = tc.save_weights_and_get_sampling_client().result()
    moved = second.sample(prompt, 1, params).result().sequences[0]
    again = first.sample(prompt, 1, params).result().sequences[0]
    assert (again.tokens, again.logprobs) == (before.tokens, before.logprobs)
    assert moved.logprobs != before.logprobs
    # the sampler's logprobs of its own tokens equal the trainer's (forward) within fp32 noise
    seq = prompt.to_ints() + moved.tokens
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": np.array(seq[1:])},
    )
    fwd = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert fwd[-len(moved.tokens) :] == pytest.approx(moved.logprobs, abs=1e-4)


def rl_datums(prompt: list[int], seqs, advantages) -> list[types.Datum]:
    """One datum per sampled sequence: its tokens scored against the sampler's logprobs, each
    with its sequence's advantage (the prompt positions weigh nothing: advantage 0)."""
    data, n_prompt = [], len(prompt) - 1
    for s, adv in zip(seqs, advantages):
        seq = prompt + s.tokens
        inputs = {
            "target_tokens": np.array(seq[1:]),
            "logprobs": np.array([0.0] * n_prompt + s.logprobs, "f4"),
            "advantages": np.array([0.0] * n_prompt + [adv] * len(s.tokens), "f4"),
        }
        data.append(
            types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs)
        )
    return data


def test_importance_sampling_rl_loop_raises_reward(service, model_dir):
    """Reward: the share of even token ids in 6 sampled tokens; group-mean baseline."""
    tc = service.client().create_lora_training_client(base_model=model_dir, rank=8, seed=0).result()
    prompt = types.ModelInput.from_ints([3, 1, 4, 1, 5])
    sampler = tc.save_weights_and_get_sampling_client().result()
    rewards, first = [], []
    for it in range(10):
        res = sampler.sample(prompt, 16, types.SamplingParams(max_tokens=6, seed=100 * it))
        seqs = res.result().sequences
        r = np.array([np.mean([t % 2 == 0 for t in s.tokens]) for s in seqs])
        rewards.append(float(r.mean()))
        data = rl_datums(prompt.to_ints(), seqs, r - r.mean())
        first = first or data
        fb = tc.forward_backward(data, "importance_sampling")
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        assert np.isfinite(fb.result().metrics["loss:sum"])
        sampler = tc.save_weights_and_get_sampling_client().result()
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.3, rewards  # ~0.45 -> 1.0 seen

    # ppo: on fresh samples (ratio ~1, inside the clip) it is importance sampling's loss; on the
    # first batch (10 updates stale: ratios far from 1) the clip makes it differ
    fresh = sampler.sample(prompt, 8, types.SamplingParams(max_tokens=6, seed=7)).result()
    signs = [1.0, -1.0] * 4
    for data, same in ((rl_datums(prompt.to_ints(), fresh.sequences, signs), True), (first, False)):
        clip = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
        ppo = tc.forward(data, "ppo", clip).result().metrics["loss:sum"]
        plain = tc.forward(data, "importance_sampling").result().metrics["loss:sum"]
        assert (ppo == pytest.approx(plain, rel=1e-5)) is same, (ppo, plain)


def test_save_state_restart_load_state_resumes_exactly(service, model_dir):
    ids, masks = sft_sequences(2)
    data = sft_datums(ids, masks)
    tc = service.client().create_lora_training_client(base_model=model_dir, rank=4, seed=9).result()

    def steps(client, n):
        out = []
        for _ in range(n):
            fb = client.forward_backward(data, "cross_entropy")
            client.optim_step(ADAM)
            out.append(fb.result().metrics["loss:sum"])
        return out

    steps(tc, 2)
    path = tc.save_state("after-2").result().path
    sampler_path = tc.save_weights_for_sampler("after-2-sampler").result().path
    expected = steps(tc, 3)
    service.restart()

    sc = service.client()
    listed = (
        tinker.RestClient(base_url=service.url, api_key=KEY)
        .list_checkpoints(path.split("/")[2])
        .result()
    )
    assert {c.tinker_path for c in listed.checkpoints} == {path, sampler_path}
    resumed = sc.create_training_client_from_state_with_optimizer(path).result()
    assert steps(resumed, 3) == expected  # bit for bit: adapters, AdamW moments and step
    weights_only = sc.create_training_client_from_state(path).result()
    assert steps(weights_only, 1)[0] == expected[0]  # same weights, a fresh optimizer after
    sampler = sc.create_sampling_client(
        model_path=sampler_path
    ).result()  # an export outlives it too
    assert (
        sampler.sample(types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2))
        .result()
        .sequences
    )


def test_bad_requests_get_the_sdk_error_types_and_the_service_goes_on(service, model_dir):
    sc = service.client()
    tc = sc.create_lora_training_client(base_model=model_dir, rank=4, seed=1).result()
    good = sft_datums(*sft_sequences(3))
    tokens = types.ModelInput.from_ints([1, 2, 3])
    cases = [
        (
            [types.Datum(model_input=tokens, loss_fn_inputs={"weights": np.ones(3, "f4")})],
            "cross_entropy",
            "loss_fn_inputs.target_tokens: missing",
        ),
        (
            [
                types.Datum(
                    model_input=tokens,
                    loss_fn_inputs={"target_tokens": np.array([2, 3]), "weights": np.ones(3, "f4")},
                )
            ],
            "cross_entropy",
            "target_tokens: 2 values for 3 model_input tokens",
        ),
        (
            [
                types.Datum(
                    model_input=tokens,
                    loss_fn_inputs={
                        "target_tokens": np.array([2, 3, 4]),
                        "logprobs": np.zeros(3, "f4"),
                        "advantages": np.array([0.5, np.nan, 1.0], "f4"),
                    },
                )
            ],
            "importance_sampling",
            "advantages: nan at position 1",
        ),
        (good * 10, "cross_entropy", "over tinker.max_batch_tokens=256"),
    ]
    for data, loss_fn, message in cases:
        with pytest.raises(tinker.BadRequestError, match=message.replace(".", r"\.")):
            tc.forward_backward(data, loss_fn).result()
        tc.forward_backward(good, "cross_entropy").result()  # the same client goes on

    with pytest.raises(
        tinker.NotFoundError, match="model_id: 'run-nosuchrun' is not a training run"
    ):
        sc.create_training_client_from_state("tinker://run-nosuchrun/weights/x").result()
    with pytest.raises(tinker.BadRequestError, match="base_model: 'Qwen/Nope'"):
        sc.create_lora_training_client(base_model="Qwen/Nope", rank=4).result()

    path = tc.save_weights_for_sampler("mine").result().path
    other = service.client(OTHER_KEY)
    with pytest.raises(tinker.PermissionDeniedError, match="belongs to another API key"):
        other.create_sampling_client(model_path=path).result()
    with pytest.raises(tinker.PermissionDeniedError, match="belongs to another API key"):
        tinker.RestClient(base_url=service.url, api_key=OTHER_KEY).list_checkpoints(
            path.split("/")[2]
        ).result()
    with pytest.raises(tinker.AuthenticationError, match="X-API-Key"):
        tinker.RestClient(
            base_url=service.url, api_key="tml-stranger"
        ).get_server_capabilities().result()
    # and everyone is still served
    assert tc.forward(good, "cross_entropy").result().metrics["loss:sum"] > 0
    assert (
        other.create_lora_training_client(base_model=model_dir, rank=2).result().get_info().model_id
    )


def test_a_model_without_lora_config_is_fully_fine_tuned(service, model_dir):
    """The API allows it (the SDK 0.38 only creates LoRA models, so this is raw HTTP)."""

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(
            f"{service.url}/api/v1/{path}",
            data=json.dumps(body).encode(),
            headers={"X-API-Key": KEY, "Content-Type": "application/json"},
        )
        return json.loads(urllib.request.urlopen(req, timeout=60).read())

    sid = post("create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})
    sid = sid["session_id"]
    rid = post("create_model", {"session_id": sid, "model_seq_id": 0, "base_model": model_dir})
    while (got := post("retrieve_future", {"request_id": rid["request_id"]}))[
        "type"
    ] == "try_again":
        pass
    assert got == {"model_id": f"{sid}:train:0", "type": "create_model"}
    info = post("get_info", {"model_id": got["model_id"]})
    assert (info["is_lora"], info["lora_rank"]) == (False, None)
