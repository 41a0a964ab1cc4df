"""A fake SGLang server for the broadcast test: SGLang's two weight-sync routes, done as SGLang
does them (``init_weights_update_group``: join the trainer's group; the update: one
``torch.distributed.broadcast`` per announced tensor, allocated from its dtype and shape, from
rank 0), plus ``/health``. Every request body is appended to ``OUT/requests.jsonl`` and the
received tensors saved to ``OUT/received.pt``.

Usage: ``python -m tests.rollout.fake_sglang PORT OUT``.
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
import torch.distributed as dist

from areal.utils.weight_sync import init_weight_update_group

GROUPS: dict[str, dist.ProcessGroup] = {}


class Handler(BaseHTTPRequestHandler):
    out: Path

    def _answer(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._answer({})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(self.out / "requests.jsonl", "a") as f:
            f.write(json.dumps({"path": self.path, "body": body}) + "\n")
        if self.path == "/init_weights_update_group":
            GROUPS[body["group_name"]] = init_weight_update_group(
                body["master_address"], body["master_port"], body["rank_offset"],
                body["world_size"], body["backend"], 60.0, body["group_name"],
            )  # fmt: skip
        elif self.path == "/update_weights_from_distributed":
            received = {}
            for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                dist.broadcast(t, src=0, group=GROUPS[body["group_name"]])
                received[name] = t
            torch.save(received, self.out / "received.pt")
        self._answer({"success": True, "message": "ok"})


def main(port: int, out: str) -> None:
    Handler.out = Path(out)
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
