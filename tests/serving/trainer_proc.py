"""Plays the trainer in the gloo weight-update test: joins the group as rank 0 and broadcasts.

Usage: ``python -m tests.serving.trainer_proc URL WEIGHTS_DIR MASTER_PORT API_KEY [interrupt]``.
Every HTTP call and collective has a deadline; exit 0 only when the server reports success.
With ``interrupt`` it joins (group deadline 5 s), prints ``joined``, and once stdin gives a line
(the test has announced an update) broadcasts the first bucket only and dies, as a trainer
that crashes mid-update.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import urllib.request

from areal.serving.model import read_hf_dir
from areal.utils.weight_sync import (
    announcement,
    broadcast_weights,
    init_weight_update_group,
    plan_buckets,
    specs_from_announcement,
)

DEADLINE_S = 60.0
BUCKET_BYTES = 64 << 10  # small buckets: the tiny model's weights travel in many of them


def _post_in_thread(url: str, body: dict, out: dict, key: str) -> threading.Thread:
    def run() -> None:
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        req = urllib.request.Request(url, json.dumps(body).encode(), headers)
        with urllib.request.urlopen(req, timeout=DEADLINE_S) as resp:
            out["body"] = json.loads(resp.read())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def main(url: str, weights_dir: str, master_port: int, key: str, mode: str = "") -> int:
    """Join, announce + broadcast the weights of ``weights_dir`` in small buckets, check replies."""
    joined: dict = {}
    deadline = 5.0 if mode == "interrupt" else DEADLINE_S
    t = _post_in_thread(
        f"{url}/init_weights_update_group",
        dict(master_address="127.0.0.1", master_port=master_port, rank_offset=1, world_size=2,
             group_name="areal_weight_update", backend="gloo", timeout=deadline),
        joined,
        key,
    )  # fmt: skip
    group = init_weight_update_group("127.0.0.1", master_port, 0, 2, "gloo", deadline)
    t.join(DEADLINE_S)
    assert joined.get("body", {}).get("success"), joined
    _, params = read_hf_dir(weights_dir)
    named = sorted(params.items())
    bucket_bytes = BUCKET_BYTES
    if mode == "interrupt":
        print("joined", flush=True)
        sys.stdin.readline()  # the test has posted the announcement
        specs = specs_from_announcement(**announcement(named))
        first = [named[i] for i in plan_buckets(specs, bucket_bytes)[0]]
        broadcast_weights(first, group, bucket_bytes, timeout=deadline)
        os._exit(0)  # dies mid-update: the other buckets never come
    updated: dict = {}
    body = {
        **announcement(named),
        "group_name": "areal_weight_update",
        "bucket_bytes": bucket_bytes,
        "weight_version": 7,
    }
    t = _post_in_thread(f"{url}/update_weights_from_distributed", body, updated, key)
    broadcast_weights(named, group, bucket_bytes, timeout=DEADLINE_S)
    t.join(DEADLINE_S)
    assert updated.get("body", {}).get("weight_version") == 7, updated
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], *sys.argv[5:]))
