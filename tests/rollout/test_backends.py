"""Tier 1: request building and answer parsing per server kind (documented shapes, no network)."""

from __future__ import annotations

import json

import pytest

from areal.api.config.base import GenerationHyperparameters
from areal.api.io import WeightUpdateMeta
from areal.rollout.backends import (
    BadServerResponse,
    NativeBackend,
    UnsupportedByBackend,
    VLLMBackend,
    make_backend,
)

G = GenerationHyperparameters(
    max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=[2], stop=["\n\n"]
)


def test_native_generate_request_uses_sglang_schema_with_remaining_budget():
    call = NativeBackend("areal").generate(
        [1, 2, 3, 9], G, max_new_tokens=5, min_new_tokens=0, seed=7
    )
    assert (call.method, call.path) == ("POST", "/generate")
    assert call.json == {
        "input_ids": [1, 2, 3, 9],
        "sampling_params": {
            "max_new_tokens": 5,
            "min_new_tokens": 0,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "stop_token_ids": [2],
            "stop": ["\n\n"],
            "ignore_eos": False,
            "no_stop_trim": True,
            "seed": 7,
        },
        "return_logprob": True,
    }
    sglang = NativeBackend("sglang").generate([1], G, 5, 0, seed=7).json["sampling_params"]
    assert sglang["sampling_seed"] == 7 and "seed" not in sglang


def test_greedy_maps_to_temperature_zero():
    g = GenerationHyperparameters(greedy=True, temperature=0.7)
    assert (
        NativeBackend("areal").generate([1], g, 4, 0, None).json["sampling_params"]["temperature"]
        == 0.0
    )
    assert VLLMBackend("m").generate([1], g, 4, 0, None).json["temperature"] == 0.0


def test_native_answer_gives_tokens_logprobs_versions_and_stop_reason():
    body = {
        "text": "..",
        "output_ids": [11, 12, 13],
        "meta_info": {
            "finish_reason": {"type": "abort", "message": "paused"},
            "output_token_logprobs": [[-0.1, 11, None], [-0.2, 12, None], [-0.3, 13, None]],
            "output_token_versions": [0, 0, 1],
            "weight_version": 1,
        },
    }
    chunk = NativeBackend("areal").parse_generate(body)
    assert chunk.output_ids == [11, 12, 13] and chunk.logprobs == [-0.1, -0.2, -0.3]
    assert chunk.versions == [0, 0, 1] and chunk.stop_reason == "abort"


def test_sglang_answer_without_token_versions_uses_its_string_weight_version():
    body = {
        "output_ids": [5],
        "meta_info": {
            "finish_reason": {"type": "length", "length": 1},
            "output_token_logprobs": [[-1.0, 5, None]],
            "weight_version": "4",
        },
    }
    assert NativeBackend("sglang").parse_generate(body).versions == [4]
    del body["meta_info"]["weight_version"]
    assert NativeBackend("sglang").parse_generate(body).versions is None  # client fills in


def test_malformed_answers_name_what_is_missing():
    with pytest.raises(BadServerResponse, match="output_token_logprobs"):
        NativeBackend("areal").parse_generate({"output_ids": [1], "meta_info": {}})
    with pytest.raises(BadServerResponse, match="unknown finish reason 'eos'"):
        NativeBackend("areal").parse_generate(
            {"meta_info": {"finish_reason": {"type": "eos"}, "output_token_logprobs": []}}
        )


def test_native_control_and_weight_calls():
    b = NativeBackend("areal")
    assert (b.pause().path, b.resume().path) == ("/pause_generation", "/continue_generation")
    assert NativeBackend("sglang").pause().json == {"mode": "abort"}
    disk = b.update_from_disk("/ckpt/v3", 3)
    assert disk.path == "/update_weights_from_disk"
    assert disk.json == {"model_path": "/ckpt/v3", "weight_version": 3}
    assert NativeBackend("sglang").update_from_disk("/ckpt", 3).json["weight_version"] == "3"
    meta = WeightUpdateMeta(type="distributed", version=5, master_port=1234, bucket_bytes=1024)
    init = b.init_weight_group(meta, rank_offset=2, world_size=3)
    assert init.json == {
        "master_address": "127.0.0.1",
        "master_port": 1234,
        "rank_offset": 2,
        "world_size": 3,
        "group_name": "areal_weight_update",
        "backend": "gloo",
        "timeout": 300.0,
    }
    ann = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2, 2]]}
    upd = b.update_from_distributed(meta, ann)
    assert upd.json["weight_version"] == 5 and upd.json["bucket_bytes"] == 1024
    with pytest.raises(ValueError, match="weight_announcement"):
        b.update_from_distributed(meta, {"names": []})


def test_sglang_broadcast_calls_carry_sglangs_documented_fields_only():
    # InitWeightsUpdateGroupReqInput / UpdateWeightsFromDistributedReqInput (sglang io_struct)
    sg = NativeBackend("sglang")
    meta = WeightUpdateMeta(type="distributed", version=5, master_port=1234, per_tensor=True)
    init = sg.init_weight_group(meta, rank_offset=1, world_size=2)
    assert set(init.json) == {
        "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"
    }  # fmt: skip
    ann = {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 2]]}
    upd = sg.update_from_distributed(meta, ann)
    assert (upd.path, upd.json) == (
        "/update_weights_from_distributed",
        {**ann, "group_name": "areal_weight_update", "flush_cache": True, "weight_version": "5"},
    )
    with pytest.raises(ValueError, match="per_tensor=True"):  # byte buckets would hang SGLang
        sg.update_from_distributed(WeightUpdateMeta(type="distributed"), ann)


def test_ipc_updates_go_to_our_server_only():
    meta = WeightUpdateMeta(type="ipc", version=4, shared={"handles": "AAA=", "devices": {}})
    call = NativeBackend("areal").update_from_ipc(meta)
    assert (call.path, call.json) == (
        "/update_weights_from_ipc",
        {"handles": "AAA=", "devices": {}, "weight_version": 4},
    )
    with pytest.raises(ValueError, match="meta.shared"):
        NativeBackend("areal").update_from_ipc(WeightUpdateMeta(type="ipc"))
    for other in (NativeBackend("sglang"), VLLMBackend("m")):
        with pytest.raises(UnsupportedByBackend, match="rollout.backend=areal"):
            other.update_from_ipc(meta)


def test_vllm_completions_request_and_answer():
    b = VLLMBackend("qwen")
    call = b.generate([4, 5], G, max_new_tokens=6, min_new_tokens=1, seed=None)
    assert (call.method, call.path) == ("POST", "/v1/completions")
    body = call.json
    assert body["model"] == "qwen" and body["prompt"] == [4, 5] and body["max_tokens"] == 6
    assert body["min_tokens"] == 1 and body["logprobs"] == 0 and body["return_token_ids"] is True
    answer = {
        "choices": [
            {
                "index": 0,
                "text": "ab",
                "finish_reason": "length",
                "logprobs": {
                    "tokens": ["token_id:7", "token_id:8"],
                    "token_logprobs": [-0.5, -0.25],
                },
            }
        ]
    }
    chunk = b.parse_generate(answer)
    assert chunk.output_ids == [7, 8] and chunk.logprobs == [-0.5, -0.25]
    assert chunk.versions is None and chunk.stop_reason == "length"
    answer["choices"][0]["token_ids"] = [70, 80]  # return_token_ids wins when present
    assert b.parse_generate(answer).output_ids == [70, 80]
    assert (b.pause().path, b.pause().params, b.resume().path) == (
        "/pause",
        {"mode": "abort"},
        "/resume",
    )


def test_vllm_weight_updates_run_our_worker_extension_through_collective_rpc():
    call = VLLMBackend("m").update_from_disk("/w/v3", 3)
    assert (call.method, call.path) == ("POST", "/collective_rpc")
    assert call.json == {"method": "areal_reload_weights", "kwargs": {"weights_path": "/w/v3"}}
    meta = WeightUpdateMeta(type="distributed", master_port=99, bucket_bytes=64, timeout=9.0)
    init = VLLMBackend("m").init_weight_group(meta, 1, 2)
    assert init.json["method"] == "areal_init_weight_group"
    assert json.loads(init.json["kwargs"]["spec"]) == {
        "master_address": "127.0.0.1", "master_port": 99, "rank_offset": 1, "world_size": 2,
        "group_name": "areal_weight_update", "backend": "gloo", "timeout": 9.0,
    }  # fmt: skip
    ann = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]]}
    upd = VLLMBackend("m").update_from_distributed(meta, ann)
    assert upd.json["method"] == "areal_update_weights_from_distributed"
    assert json.loads(upd.json["kwargs"]["spec"]) == {**ann, "bucket_bytes": 64}


def test_vllm_answer_aborted_before_its_first_token_has_no_tokens():
    answer = {"choices": [{"finish_reason": "abort", "logprobs": None, "token_ids": None}]}
    chunk = VLLMBackend("m").parse_generate(answer)
    assert (chunk.output_ids, chunk.logprobs, chunk.stop_reason) == ([], [], "abort")


def test_make_backend_checks_its_arguments():
    assert make_backend("sglang").name == "sglang"
    with pytest.raises(ValueError, match="served_model_name"):
        make_backend("vllm")
    with pytest.raises(ValueError, match="got 'tgi'"):
        make_backend("tgi")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field,value,vllm",
    [
        ("json_schema", '{"type": "object"}', {"json": {"type": "object"}}),
        ("regex", "[0-9]+", {"regex": "[0-9]+"}),
        ("ebnf", 'root ::= "a"', {"grammar": 'root ::= "a"'}),
    ],
)
def test_a_grammar_travels_in_each_servers_own_field(field, value, vllm):
    g = GenerationHyperparameters(max_new_tokens=8, **{field: value})
    native = NativeBackend("sglang").generate([1, 2], g, 8, 0, None).json
    assert native["sampling_params"][field] == value
    assert VLLMBackend("m").generate([1, 2], g, 8, 0, None).json["structured_outputs"] == vllm


def test_two_grammars_or_a_grammar_with_min_new_tokens_are_refused():
    problems = list(
        GenerationHyperparameters(regex="a", ebnf="b", min_new_tokens=2, max_new_tokens=4).check()
    )
    assert problems[0].startswith("json_schema: set at most one") and problems[1].startswith(
        "min_new_tokens:"
    )
