"""Issue #23's acceptance test: EleutherAI's lm-evaluation-harness (``local-completions``) runs a
local multiple-choice task and a generate_until task against a live ``areal serve``; every
loglikelihood it logs equals the same model's HF forward (fp32) to 1e-4, and every generation
equals HF's greedy one. lm-eval lives in its own test-only venv (see lm_eval_venv.py); the test
skips only when pip cannot install it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.serving.conftest import hf_greedy
from tests.serving.lm_eval_venv import LmEvalUnavailable, ensure_lm_eval
from tests.serving.servers import start_servers, stop_servers

pytestmark = pytest.mark.slow
LM_EVAL_DEADLINE_S = 300
MAX_GEN_TOKS = 12
UNTIL = "\n\n"
MC_DOCS = [  # lm-eval puts its target delimiter (a space) between question and choice
    {"question": "2 + 2 =", "choices": ["4", "5", "22"], "answer": 0},
    {"question": "The sky is", "choices": ["blue", "green"], "answer": 0},
    {"question": "Paris is in", "choices": ["France", "Peru", "the sea"], "answer": 0},
]
GEN_DOCS = [
    {"question": "Q: 1 + 1?\nA:", "answer": " 2"},
    {"question": "Count: a b", "answer": " c"},
]
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {kind}
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
"""
MC_TASK = TASK + 'doc_to_choice: "{{{{choices}}}}"\nmetric_list:\n  - metric: acc\n'
GEN_TASK = (
    TASK
    + f"""generation_kwargs:
  until: [{json.dumps(UNTIL)}]
  max_gen_toks: {MAX_GEN_TOKS}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""
)


def _write_tasks(root: Path) -> Path:
    for name, docs, template, kind in [
        ("areal_mc", MC_DOCS, MC_TASK, "multiple_choice"),
        ("areal_gen", GEN_DOCS, GEN_TASK, "generate_until"),
    ]:
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (root / f"{name}.yaml").write_text(template.format(name=name, data=data, kind=kind))
    return root


def _samples(out: Path, task: str) -> list[dict]:
    files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    assert len(files) == 1, f"expected one samples file for {task} under {out}, found {files}"
    return [json.loads(line) for line in files[0].read_text().splitlines()]


def _hf_loglikelihood(model, tok, context: str, continuation: str) -> tuple[float, bool]:
    """Sum of log p(continuation | context) and whether it is the greedy continuation, with
    lm-eval's split (trailing context spaces move to the continuation)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    n_ctx = len(tok(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
    rows, targets = logp[n_ctx - 1 : len(whole) - 1], torch.tensor(whole[n_ctx:])
    ll = rows.gather(1, targets[:, None]).sum().item()
    return ll, bool((rows.argmax(-1) == targets).all())


@pytest.fixture(scope="module")
def lm_eval_python():
    try:
        python, spent = ensure_lm_eval()
    except LmEvalUnavailable as e:
        pytest.skip(str(e))
    print(f"lm-eval venv: {f'installed in {spent:.0f} s' if spent else 'reused'}")
    return python


def test_lm_eval_local_completions_matches_the_hf_forward(
    lm_eval_python, tiny_model_dir, tiny_tokenizer, hf_model, tmp_path
):
    procs = start_servers(tiny_model_dir, 1, "served_model_name=tiny", "max_batch_size=8")
    try:
        base = f"http://{procs[0][1]}/v1/completions"
        args = (
            f"base_url={base},model=tiny,tokenizer={tiny_model_dir},tokenizer_backend=huggingface,"
            "tokenized_requests=True,max_retries=1"
        )
        cmd = [
            str(lm_eval_python),
            "-m",
            "lm_eval",
            "--model",
            "local-completions",
            "--model_args",
            args,
            "--tasks",
            "areal_mc,areal_gen",
            "--include_path",
            str(_write_tasks(tmp_path)),
            "--batch_size",
            "4",
            "--log_samples",
            "--output_path",
            str(tmp_path / "out"),
        ]
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "OPENAI_API_KEY": "unused",
            "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"),
        }
        run = subprocess.run(
            cmd, capture_output=True, text=True, timeout=LM_EVAL_DEADLINE_S, env=env, cwd=tmp_path
        )
    finally:
        stop_servers(procs)
    assert run.returncode == 0, run.stderr[-3000:]
    mc = _samples(tmp_path / "out", "areal_mc")
    assert len(mc) == len(MC_DOCS)
    for sample in mc:
        args = sorted(sample["arguments"].items(), key=lambda kv: int(kv[0].rsplit("_", 1)[1]))
        assert len(args) == len(sample["doc"]["choices"])
        for (_, pair), (ll, greedy) in zip(args, sample["filtered_resps"]):
            ref_ll, ref_greedy = _hf_loglikelihood(
                hf_model, tiny_tokenizer, pair["arg_0"], pair["arg_1"]
            )
            assert float(ll) == pytest.approx(ref_ll, abs=1e-4), (pair, ll, ref_ll)
            assert str(greedy) == str(ref_greedy)
    gen = _samples(tmp_path / "out", "areal_gen")
    assert len(gen) == len(GEN_DOCS)
    for sample in gen:
        prompt = tiny_tokenizer(sample["doc"]["question"], add_special_tokens=False).input_ids
        ref = tiny_tokenizer.decode(
            hf_greedy(hf_model, prompt, MAX_GEN_TOKS), skip_special_tokens=True
        )
        assert sample["filtered_resps"][0] == ref.split(UNTIL)[0], sample
