"""Tier 1 and 2: the Host/Origin guard of our listeners (issue 56, item 4). A page of another
site, or one reaching a loopback listener under its own DNS name (DNS rebinding), is refused 403
with a one-line reason; non-browser clients that name the listener by IP, loopback name, bind
address or this machine's name keep working, and so do configured names."""

from __future__ import annotations

import asyncio
import socket

import pytest

from areal.utils.http_guard import HostPolicy, allowed_host_problems, host_name


def test_host_header_values_parse_to_their_host_or_none():
    assert host_name("LocalHost:8765") == "localhost"
    assert host_name("[::1]:30000") == "::1"
    assert host_name("gpu-3.example.com.") == "gpu-3.example.com"
    assert host_name("10.0.0.7") == "10.0.0.7"
    for bad in ("", "a b", "x:port", "[::1", "[nothost]:1", "::1", "evil.example/x", "a@b"):
        assert host_name(bad) is None, bad


def test_loopback_listener_accepts_ips_and_loopback_names_and_refuses_other_names():
    policy = HostPolicy.build("127.0.0.1", setting="server.allowed_hosts")
    for ok in ("127.0.0.1:30000", "localhost:30000", "[::1]:30000", "10.1.2.3:30000", None):
        assert policy.host_refusal(ok) == "", ok
    why = policy.host_refusal("rebind.evil.example:30000")
    assert "'rebind.evil.example:30000'" in why and "server.allowed_hosts" in why
    assert "\n" not in why
    assert policy.host_refusal("bad host") != ""


def test_cluster_bind_accepts_its_peers_names_for_it():
    # Ray registers the node IP, Slurm the node's NodeAddr (the bind name); peers use those or
    # the machine's own names
    wildcard = HostPolicy.build("0.0.0.0")
    assert wildcard.host_refusal("10.0.0.7:41234") == ""
    assert wildcard.host_refusal(f"{socket.gethostname()}:41234") == ""
    assert wildcard.host_refusal(f"{socket.getfqdn()}:41234") == ""
    assert wildcard.host_refusal("attacker.example:41234") != ""
    assert HostPolicy.build("node12").host_refusal("NODE12:41234") == ""
    configured = HostPolicy.build("0.0.0.0", ["gpu-3.example.com"])
    assert configured.host_refusal("gpu-3.example.com:30000") == ""
    assert HostPolicy.build("127.0.0.1", ["*"]).host_refusal("anything.example") == ""


def test_protected_routes_refuse_pages_of_other_sites_and_accept_non_browsers():
    policy = HostPolicy.build("127.0.0.1", ["ui.example.com"], "server.allowed_hosts")
    host = "127.0.0.1:30000"
    accepted = [
        (None, None),  # curl, the trainer's client
        (None, "same-origin"),
        ("http://127.0.0.1:30000", "same-origin"),
        ("http://localhost:3000", "same-site"),  # a local UI on another port
        ("https://ui.example.com", "cross-site"),  # configured
    ]
    for origin, site in accepted:
        assert policy.origin_refusal(origin, site, host) == "", (origin, site)
    refused = [
        ("http://evil.example", "cross-site"),
        ("http://203.0.113.5", "cross-site"),  # a page served from an IP is another site too
        ("null", "cross-site"),  # sandboxed frame, file://
        (None, "cross-site"),  # a no-cors request that dropped Origin
        ("http://127.0.0.1:30000.evil.example", None),
        ("http://[::1", None),  # not an origin: refused, not a crash
        ("ftp://127.0.0.1", None),
    ]
    for origin, site in refused:
        why = policy.origin_refusal(origin, site, host)
        assert why and "server.allowed_hosts" in why and "\n" not in why, (origin, site)


def test_allowed_host_entries_must_be_bare_names():
    assert allowed_host_problems("server.allowed_hosts", ["gpu-3", "10.0.0.7", "::1", "*"]) == []
    problems = allowed_host_problems("server.allowed_hosts", ["http://x.example:3000", "a b"])
    assert len(problems) == 2 and "'http://x.example:3000' is not a bare host name" in problems[0]


def test_server_config_refuses_an_allowed_host_with_a_scheme(tiny_model_dir):
    from areal.api.config import ConfigError, from_dict
    from areal.api.config.server import GenerationServerConfig

    with pytest.raises(ConfigError, match="allowed_hosts: 'http://gpu-3:30000' is not a bare"):
        from_dict(
            GenerationServerConfig,
            {"model_path": tiny_model_dir, "allowed_hosts": ["http://gpu-3:30000"]},
        )


def _answers(app, requests: list[tuple[str, str, dict]]) -> list[tuple[int, str]]:
    """``(status, body)`` of each ``(method, path, headers)`` sent to ``app`` over loopback."""
    from aiohttp.test_utils import TestClient, TestServer

    async def run():
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            out = []
            for method, path, headers in requests:
                resp = await client.request(method, path, headers=headers)
                out.append((resp.status, await resp.text()))
            return out

    return asyncio.run(run())


def test_viewer_refuses_rebound_names_and_cross_site_pages_on_its_api(tmp_path):
    from areal.utils.viewer import make_app

    (tmp_path / "stats.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    evil = {"Host": "rebind.evil.example:8765"}
    cross = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
    got = _answers(
        make_app([tmp_path]),
        [
            ("GET", "/api/stats/0", {}),
            ("GET", "/api/stats/0", {"Host": "localhost:8765"}),
            ("GET", "/api/stats/0", evil),
            ("GET", "/", evil),
            ("GET", "/api/runs", cross),
            ("GET", "/", {"Sec-Fetch-Site": "cross-site"}),  # a link to the page: allowed
        ],
    )
    assert [s for s, _ in got] == [200, 200, 403, 403, 403, 200]
    assert "Host 'rebind.evil.example:8765' is not a name" in got[2][1]
    assert "--allowed-host" in got[2][1] and "Origin 'http://evil.example'" in got[4][1]
    behind_proxy = make_app([tmp_path], ["viewer.lab.example"])
    assert (
        _answers(behind_proxy, [("GET", "/api/runs", {"Host": "viewer.lab.example"})])[0][0] == 200
    )


def test_generation_server_takes_its_allowed_hosts_from_config(tiny_model_dir):
    from areal.api.config import from_dict
    from areal.api.config.server import GenerationServerConfig
    from areal.serving.server import GenerationServer

    cfg = {"model_path": tiny_model_dir, "allowed_hosts": ["gpu-3.example.com"]}
    srv = GenerationServer(from_dict(GenerationServerConfig, cfg))
    got = _answers(
        srv.build_app(),
        [
            ("GET", "/health", {"Host": "gpu-3.example.com:30000"}),
            ("GET", "/health", {"Host": "rebind.evil.example:30000"}),
            ("POST", "/flush_cache", {"Origin": "https://gpu-3.example.com"}),
            ("POST", "/pause_generation", {"Origin": "http://evil.example"}),
        ],
    )
    # 503 past the guard: /flush_cache asks the generator, which this app never started
    assert [s for s, _ in got] == [200, 403, 503, 403]
    assert "server.allowed_hosts" in got[1][1] and not srv.generator.paused
