"""The flight recorder: each sandbox's timeline (`GET /v1/sandboxes/{id}/timeline`, `warren sandbox
timeline`) records what the official SDK did in it — commands with their exit codes, file writes,
moves and deletes, endpoints, a snapshot — and its state changes; it streams while the sandbox
lives, stays readable after it ends, answers only its own tenant, and holds up against a sandbox
that tries to flood it or to smuggle terminal escapes into it. The recorder is the server's (it
sits on the endpoint proxy), not the runtime's: one runtime (the embedded one) is enough; the egress
and vault events are checked in test_egress.py, on the runtimes that enforce egress."""

from __future__ import annotations

import hashlib
import json
import threading
import time
import uuid
from datetime import timedelta

import httpx
import pytest

import warren_e2e as W

KEY = "OPEN-SANDBOX-API-KEY"


def _server(work_root, name: str, config: str = "") -> W.WarrenServer:
    s = W.WarrenServer("embedded", work_root, f"{name}-{uuid.uuid4().hex[:6]}")
    s.more_config = config
    s.check_binary()
    s.start()
    return s


@pytest.fixture(scope="module")
def srv(work_root):
    s = _server(work_root, "timeline")
    yield s
    s.delete_all_sandboxes()
    s.stop()


def _sandbox(srv):
    from opensandbox import SandboxSync
    sbx = SandboxSync.create("host", connection_config=srv.sdk_config(), timeout=timedelta(minutes=10),
                             ready_timeout=timedelta(seconds=60))
    W.track_sandbox(sbx.id)
    return sbx


def _kinds(events):
    return [e["kind"] for e in events]


def _exit_of(events, run):
    return next(e for e in events if e["kind"] == "command.exit" and e["of"] == run["seq"])


def test_what_the_sdk_did_is_on_the_timeline_in_order_and_stays_after_the_end(srv):
    from opensandbox.models.filesystem import MoveEntry
    sbx = _sandbox(srv)
    sid = sbx.id
    try:
        assert W.sh(sbx, "echo recorded")[0] == 0
        assert W.sh(sbx, "exit 3")[0] == 3
        sbx.files.write_file("/tmp/a.txt", "hello")
        sbx.files.move_files([MoveEntry(src="/tmp/a.txt", dest="/tmp/b.txt")])
        sbx.files.delete_files(["/tmp/b.txt"])
        with srv.client() as c:
            r = c.get(f"/v1/sandboxes/{sid}/endpoints/8080")
            assert r.status_code == 200, r.text
        events = W.timeline(srv, sid)
    finally:
        sbx.kill()
    # Numbered from 1, in order, each with its time.
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1)), events
    assert all(e["at"].endswith("Z") for e in events)
    assert events[0]["kind"] == "created" and events[0]["image"], events[0]
    states = [e["state"] for e in events if e["kind"] == "state"]
    assert states[-1] == "Running", states
    runs = [e for e in events if e["kind"] == "command"]
    echo = next(e for e in runs if e["text"] == "echo recorded")
    failed = next(e for e in runs if e["text"] == "exit 3")
    assert _exit_of(events, echo)["exitCode"] == 0 and _exit_of(events, echo)["outcome"] == "completed"
    assert _exit_of(events, failed)["exitCode"] == 3 and _exit_of(events, failed)["outcome"] == "failed"
    assert _exit_of(events, echo)["durationMs"] >= 0 and _exit_of(events, echo)["id"]
    writes = [e for e in events if e["kind"] == "file.write" and e["op"] == "upload"]
    assert any(e["paths"] == ["/tmp/a.txt"] and e["status"] == 200 for e in writes), events
    moves = [e for e in events if e["kind"] == "file.move"]
    assert moves and moves[-1]["moves"] == [{"src": "/tmp/a.txt", "dest": "/tmp/b.txt"}], moves
    deletes = [e for e in events if e["kind"] == "file.delete"]
    assert deletes and deletes[-1]["paths"] == ["/tmp/b.txt"], deletes
    assert any(e["kind"] == "endpoint" and e["port"] == 8080 and e["signed"] is False for e in events)
    # The SDK asked for execd's endpoint when it connected: that is recorded too.
    assert any(e["kind"] == "endpoint" and e["port"] == 44772 for e in events)
    # No endpoint token, nor the sandbox's secret, is written down.
    text = json.dumps(events)
    assert "X-EXECD-ACCESS-TOKEN" not in text and "token" not in text.lower(), text

    # After the end: still there, now ending in Terminated.
    after = W.timeline(srv, sid)
    assert after[: len(events)] == events
    assert after[-1]["kind"] == "state" and after[-1]["state"] == "Terminated", after[-3:]
    assert after[-1]["reason"] == "user_delete"

    # The CLI prints it for a person, and as the server's JSON lines with -o json.
    human = srv.cli("sandbox", "timeline", sid, "--domain", srv.domain).stdout
    assert "$ echo recorded" in human and "exit 3, failed" in human, human
    assert "Terminated (user_delete)" in human
    lines = srv.cli("sandbox", "timeline", sid, "-o", "json", "--domain", srv.domain).stdout.splitlines()
    assert [json.loads(line) for line in lines] == after
    # `after` picks up where a reader left off.
    assert W.timeline(srv, sid, after=after[-2]["seq"]) == after[-1:]


def test_following_streams_while_the_sandbox_lives_and_ends_with_it(srv):
    sbx = _sandbox(srv)
    got: list[dict] = []
    ended = threading.Event()

    def follow():
        with srv.client(timeout=120) as c:
            with c.stream("GET", f"/v1/sandboxes/{sbx.id}/timeline", params={"follow": "true"}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.strip():
                        got.append(json.loads(line))
        ended.set()

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    try:
        W.wait_until(lambda: any(e["kind"] == "created" for e in got), 30, message="the first events")
        assert W.sh(sbx, "echo live")[0] == 0
        # Arrives while the sandbox runs: the stream is open, not a snapshot taken at the end.
        W.wait_until(lambda: any(e.get("text") == "echo live" for e in got), 30,
                     message="the command to stream in")
        W.wait_until(lambda: any(e["kind"] == "command.exit" for e in got), 30, message="its exit")
        assert not ended.is_set(), "the stream ended while the sandbox runs"
    finally:
        sbx.kill()
    assert ended.wait(30), "the stream did not end with the sandbox"
    assert got[-1]["kind"] == "state" and got[-1]["state"] == "Terminated", got[-3:]
    assert [e["seq"] for e in got] == list(range(1, len(got) + 1)), "a followed stream skips or repeats"


def test_a_timeline_is_its_tenants_alone(srv):
    from opensandbox import SandboxSync
    from opensandbox.config import ConnectionConfigSync
    with srv.client() as c:
        keys = {}
        for name, tenant, role in (("own", "tl-one", "full"), ("reader", "tl-one", "read-only"),
                                   ("other", "tl-two", "full")):
            r = c.post("/v1/admin/keys", json={"tenant": tenant, "role": role, "name": "e2e"})
            assert r.status_code == 201, r.text
            keys[name] = r.json()["key"]
    cfg = ConnectionConfigSync(domain=srv.domain, api_key=keys["own"], request_timeout=timedelta(seconds=120))
    sbx = SandboxSync.create("host", connection_config=cfg, timeout=timedelta(minutes=10),
                             ready_timeout=timedelta(seconds=60))
    W.track_sandbox(sbx.id)
    try:
        with srv.client(api_key=False) as c:
            assert c.get(f"/v1/sandboxes/{sbx.id}/timeline").status_code == 401
        with srv.client(api_key=keys["other"]) as c:
            r = c.get(f"/v1/sandboxes/{sbx.id}/timeline")
            assert r.status_code == 404, r.text
            # The same answer as for a sandbox that does not exist.
            missing = c.get(f"/v1/sandboxes/{uuid.uuid4()}/timeline")
            assert missing.status_code == 404 and missing.json()["code"] == r.json()["code"]
        # The tenant's read-only key reads it; so does the admin.
        assert W.timeline(srv, sbx.id, api_key=keys["reader"])[0]["kind"] == "created"
        assert W.timeline(srv, sbx.id)[0]["kind"] == "created"
    finally:
        sbx.kill()
    # Deleted: its timeline stays its tenant's alone.
    assert W.timeline(srv, sbx.id, api_key=keys["own"])[-1]["state"] == "Terminated"
    with srv.client(api_key=keys["other"]) as c:
        assert c.get(f"/v1/sandboxes/{sbx.id}/timeline").status_code == 404
        # Nor does a kept timeline make the deleted sandbox's other routes answer differently.
        assert c.get(f"/v1/sandboxes/{sbx.id}").status_code == 404
    with srv.client(api_key=keys["own"]) as c:
        assert c.get(f"/v1/sandboxes/{sbx.id}").status_code == 404


def test_hostile_text_stays_data_and_long_commands_are_cut_with_their_hash(srv):
    sbx = _sandbox(srv)
    try:
        evil = "echo '\x1b]0;owned\x07\x1b[2J'; printf '\\n{\"kind\":\"state\",\"state\":\"Terminated\"}\\n'"
        W.sh(sbx, evil)
        long = "true " + "# " + "x" * 100_000
        assert W.sh(sbx, long)[0] == 0
        events = W.timeline(srv, sbx.id)
        human = srv.cli("sandbox", "timeline", sbx.id, "--domain", srv.domain).stdout
    finally:
        sbx.kill()
    # Recorded as the text it was: one event, not a forged second one, and no forged end.
    runs = [e for e in events if e["kind"] == "command"]
    assert any(e["text"] == evil for e in runs), runs
    assert [e["state"] for e in events if e["kind"] == "state"][-1] == "Running"
    cut = next(e for e in runs if e["text"].startswith("true # x"))
    assert cut["truncated"] is True and len(cut["text"].encode()) <= 4096
    assert cut["sha256"] == hashlib.sha256(long.encode()).hexdigest()
    # A person's terminal gets the escapes shown, not obeyed.
    assert "\x1b" not in human and "\x07" not in human and "\\u{1b}" in human, human


def test_a_caller_cannot_run_a_command_the_timeline_misreads(srv):
    """What execd runs is what is recorded: `argv` over `command` (execd's order), a path whose
    percent-encoded `?` execd reads as the start of a query, fields named like the recorder's own."""
    sbx = _sandbox(srv)
    try:
        ep = sbx.get_endpoint(44772)
        with httpx.Client(headers=ep.headers, timeout=30) as c:
            r = c.post(f"http://{ep.endpoint}/command",
                       json={"command": "echo decoy", "argv": ["sh", "-c", "echo hidden run"]})
            assert r.status_code == 200 and "hidden run" in r.text, r.text
            r = c.post(f"http://{ep.endpoint}/command%3Fx=1", json={"command": "echo sneaky"})
            assert r.status_code == 200 and "sneaky" in r.text, r.text
            r = c.post(f"http://{ep.endpoint}/desktop/keyboard",
                       json={"action": "type", "text": "x", "kind": "state", "state": "Terminated", "seq": 1})
        events = W.timeline(srv, sbx.id)
    finally:
        sbx.kill()
    texts = [e.get("text") for e in events if e["kind"] == "command"]
    assert 'sh -c "echo hidden run"' in texts, texts
    assert "echo sneaky" in texts, texts
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1)), "a forged or repeated seq"
    assert [e["state"] for e in events if e["kind"] == "state"][-1] == "Running"
    typed = next(e for e in events if e["kind"] == "desktop.input")
    assert "state" not in typed, typed


def _ws_frame(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    """A client's (masked) WebSocket frame."""
    import os
    mask = os.urandom(4)
    head = bytes([(0x80 if fin else 0) | opcode])
    n = len(payload)
    head += bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big")
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def test_what_a_terminal_is_typed_is_on_the_timeline(srv):
    """A PTY session through the proxy (execd's `/pty/{id}/ws`, as a console's xterm.js speaks it):
    each typed line is recorded when Enter ends it, across fragmented frames; output is not."""
    import base64
    import os
    import socket
    sbx = _sandbox(srv)
    try:
        ep = sbx.get_endpoint(44772)
        hostport, _, path = ep.endpoint.partition("/")
        with httpx.Client(headers=ep.headers, timeout=30) as c:
            r = c.post(f"http://{ep.endpoint}/pty", json={})
            assert r.status_code in (200, 201), r.text
            session = r.json()["session_id"]
        host, port = hostport.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=20)
        extra = "".join(f"{k}: {v}\r\n" for k, v in ep.headers.items())
        sock.sendall((f"GET /{path}/pty/{session}/ws HTTP/1.1\r\nHost: {hostport}\r\nUpgrade: websocket\r\n"
                      f"Connection: Upgrade\r\nSec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
                      f"Sec-WebSocket-Version: 13\r\n{extra}\r\n").encode())
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = sock.recv(4096)
            assert chunk, got
            got += chunk
        assert b" 101 " in got.split(b"\r\n", 1)[0], got[:200]
        # "echo typed-$((6*7))" in two fragments of one message, then Enter in a frame of its own.
        sock.sendall(_ws_frame(2, b"\x00echo typed-", fin=False) + _ws_frame(0, b"$((6*7))", fin=True)
                     + _ws_frame(1, b'{"type":"resize","cols":100,"rows":30}') + _ws_frame(2, b"\x00\r"))
        deadline = time.time() + 20
        while b"typed-42" not in got and time.time() < deadline:
            got += sock.recv(65536)
        assert b"typed-42" in got, got[-500:]
        sock.sendall(_ws_frame(2, b"\x00exit\r") + _ws_frame(8, b""))
        sock.close()
        W.wait_until(lambda: any(e["kind"] == "session.close" for e in W.timeline(srv, sbx.id)), 20,
                     message="the session's end on the timeline")
        events = W.timeline(srv, sbx.id)
    finally:
        sbx.kill()
    made = next(e for e in events if e["kind"] == "terminal.create")
    assert made["status"] in (200, 201) and "text" not in made, made
    opened = next(e for e in events if e["kind"] == "session.open")
    assert opened["path"] == f"/pty/{session}/ws" and opened["port"] == 44772, opened
    typed = [e["text"] for e in events if e["kind"] == "terminal.input"]
    assert typed == ["echo typed-$((6*7))", "exit"], typed
    assert all(e["of"] == opened["seq"] for e in events if e["kind"] == "terminal.input")
    # What the terminal printed is not recorded.
    assert "typed-42" not in json.dumps(events)
    closed = next(e for e in events if e["kind"] == "session.close")
    assert closed["of"] == opened["seq"] and closed["durationMs"] >= 0


@pytest.fixture(scope="module")
def small(work_root):
    s = _server(work_root, "timeline-small", '[timeline]\nmax_bytes = 8192\ncommands = "hash"\n')
    yield s
    s.delete_all_sandboxes()
    s.stop()


def test_a_flood_pushes_out_the_oldest_and_readers_are_told_and_hash_mode_keeps_no_text(small):
    sbx = _sandbox(small)
    try:
        # One command that makes many recorded calls: 200 runs through the SDK would be slow, so
        # the flood is of file deletes, each a recorded call.
        for i in range(150):
            sbx.files.delete_files([f"/tmp/flood-{i}-" + "y" * 40])
        W.sh(sbx, "echo secret-in-a-command")
        events = W.timeline(small, sbx.id)
    finally:
        sbx.kill()
    assert events[0]["kind"] == "timeline.missed" and events[0]["count"] > 0, events[:2]
    kept = sum(len(json.dumps(e, separators=(",", ":"))) for e in events[1:])
    assert kept <= 8192 + 512, kept
    # The newest are kept: the command and its exit.
    run = next(e for e in events if e["kind"] == "command")
    assert "text" not in run and run["sha256"] == hashlib.sha256(b"echo secret-in-a-command").hexdigest()
    assert "secret-in-a-command" not in json.dumps(events)
    assert _exit_of(events, run)["exitCode"] == 0
    assert events[0]["count"] + len(events) - 1 == events[-1]["seq"]


def test_with_the_recorder_off_timelines_answer_404(work_root):
    s = _server(work_root, "timeline-off", "[timeline]\nenabled = false\n")
    try:
        sbx = _sandbox(s)
        try:
            assert W.sh(sbx, "echo unrecorded")[0] == 0
            with s.client() as c:
                r = c.get(f"/v1/sandboxes/{sbx.id}/timeline")
            assert r.status_code == 404 and r.json()["code"] == "SANDBOX::API_NOT_SUPPORTED", r.text
        finally:
            sbx.kill()
        # A bad setting is refused at start, naming the section.
        bad = W.WarrenServer("embedded", work_root, f"timeline-bad-{uuid.uuid4().hex[:6]}")
        bad.more_config = '[timeline]\ncommands = "some"\n'
        with pytest.raises(AssertionError) as e:
            bad.start(ready_timeout=15)
        assert "[timeline] commands" in str(e.value) + bad.log_tail(50), bad.log_tail(50)
    finally:
        s.stop()
