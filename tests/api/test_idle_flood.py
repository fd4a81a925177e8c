"""2,000 connections that send nothing must not lock health probes out (issue 13, item 2): at the cap the server
closes the connection idle longest for each newcomer, so a probe still gets /health 200 (GET and HEAD).
"""
from __future__ import annotations

import socket
import threading
import time

import pytest

from rawserve.config import EngineConfig, ServerConfig
from tests.api.test_openai_server import ServerThread

NUM_IDLE = 2000
CAP = 1024


def raise_fd_limit(needed: int) -> None:
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"the open-files hard limit ({hard}) is under the {needed} this test needs")
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def probe(port: int, method: str = "GET") -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"{method} /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1])


def test_health_probes_get_through_while_2000_idle_connections_hold_the_cap():
    from rawserve.demo_model import ensure_demo_model

    # This process holds both ends: the attacker's sockets and the server's (up to the cap), and a few more.
    raise_fd_limit(NUM_IDLE + CAP + 1500)
    srv = ServerThread(EngineConfig(model_dir=str(ensure_demo_model()), device="cpu", num_kv_blocks=16,
                                    max_model_len=128),
                       # Long idle timeouts: only eviction can make room during the test.
                       ServerConfig(port=0, engine_mode="thread", max_connections=CAP, first_byte_timeout_s=120,
                                    keep_alive_s=120, header_timeout_s=120, log_requests=False))
    port = srv.app.port
    idle: list[socket.socket] = []
    stop = threading.Event()

    def attack() -> None:  # keeps opening silent connections while the probes run
        while not stop.is_set() and len(idle) < NUM_IDLE + 800:
            try:
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            except OSError:
                time.sleep(0.01)

    attacker = threading.Thread(target=attack, daemon=True)
    try:
        for _ in range(NUM_IDLE):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        attacker.start()
        statuses = [probe(port, "HEAD" if i % 2 else "GET") for i in range(20)]
        assert statuses == [200] * 20
        stop.set()
        attacker.join(30)
        http = srv.app.http
        assert http.num_evicted >= NUM_IDLE - CAP  # room was made by closing idle ones, not by refusing
        # An evicted connection leaves the count when its task has run its close, a loop turn or more after the
        # newcomer that evicted it was counted; so the count settles at the cap once the backlog is drained.
        deadline = time.monotonic() + 20
        while http.num_connections > CAP and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http.num_connections <= CAP
    finally:
        stop.set()
        attacker.join(30) if attacker.is_alive() else None
        for sock in idle:
            sock.close()
        srv.stop()
