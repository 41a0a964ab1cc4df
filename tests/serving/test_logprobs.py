"""Prompt and top logprobs, as eval harnesses (lm-eval's loglikelihood) and agent frameworks ask
for them: /v1/completions echo + logprobs, /generate logprob_start_len + top_logprobs_num, chat
top_logprobs; every value equals the HF forward's log-softmax."""

from __future__ import annotations

import pytest
import torch

from tests.serving.servers import start_servers, stop_servers
from tests.serving.test_server import PROMPT, call


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    procs = start_servers(tiny_model_dir, 1, "max_batch_size=8")
    yield f"http://{procs[0][1]}"
    stop_servers(procs)


def _hf_logp(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)  # [n, V]


def _model(url: str) -> str:
    return call(f"{url}/v1/models")[1]["data"][0]["id"]


def test_completions_echo_returns_prompt_logprobs_equal_to_the_hf_forward(server, hf_model):
    body = {"model": _model(server), "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2}
    status, out = call(f"{server}/v1/completions", body)
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    ref = _hf_logp(hf_model, PROMPT)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing before it
    expected = [ref[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    for i in range(1, len(PROMPT)):  # the 2 most likely plus the chosen token
        top = lp["top_logprobs"][i]
        best = ref[i - 1].topk(2)
        assert 2 <= len(top) <= 3 and max(top.values()) == pytest.approx(best.values[0].item(), abs=1e-4)
    assert len(lp["tokens"]) == len(PROMPT) and lp["text_offset"][0] == 0
    assert out["choices"][0]["text"].startswith(lp["tokens"][0])


def test_generate_returns_input_and_top_logprobs_in_sglangs_format(server, hf_model):
    body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    status, out = call(f"{server}/generate", body)
    assert status == 200, out
    meta = out["meta_info"]
    ref = _hf_logp(hf_model, PROMPT + out["output_ids"])
    inputs = meta["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == PROMPT and inputs[0][0] is None
    assert [lp for lp, _, _ in inputs[1:]] == pytest.approx(
        [ref[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))], abs=1e-4)
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 3
    for k, (top, (lp, tok, _)) in enumerate(zip(meta["output_top_logprobs"], meta["output_token_logprobs"])):
        assert len(top) == 3 and top[0][1] == tok and top[0][0] == pytest.approx(lp)  # greedy: the best one
        values = [v for v, _, _ in top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(ref[len(PROMPT) - 1 + k].topk(3).values.tolist(), abs=1e-4)


def test_chat_top_logprobs_with_real_bytes_through_the_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    c = client.chat.completions.create(model=_model(server), messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes and all(0 <= b < 256 for b in entry.bytes)
    status, out = call(f"{server}/v1/chat/completions", {"model": _model(server), "top_logprobs": 2,
                                                         "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and out["error"]["param"] == "top_logprobs"  # needs logprobs=true


def test_distinct_tokens_never_share_a_logprobs_key(tiny_model_dir):
    from areal.api.config import from_dict
    from areal.api.config.server import GenerationServerConfig
    from areal.serving.server import GenerationServer

    srv = GenerationServer(from_dict(GenerationServerConfig, {"model_path": str(tiny_model_dir)}))
    ids = range(len(srv.tokenizer))
    keys = [srv.token_str(t) for t in ids]
    assert len(set(keys)) == len(keys)
    assert all(srv.token_bytes(t) for t in ids)
