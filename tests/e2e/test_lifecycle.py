"""Lifecycle through the official SDK: create on both images, expiry, renew,
pause/resume, list filters, metadata, kill, and what a sandbox's end leaves behind (nothing)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

import warren_e2e as W

sh = W.sh


def test_create_on_host_image(make_sandbox):
    sbx = make_sandbox("host")
    code, out, _ = sh(sbx, "echo hello-from-host-image")
    assert code == 0
    assert out.strip() == "hello-from-host-image"
    info = sbx.get_info()
    assert info.id == sbx.id
    assert info.status.state == "Running"
    assert info.entrypoint == ["tail", "-f", "/dev/null"]
    assert info.expires_at is not None
    assert info.created_at <= info.expires_at
    # SDK default timeout is 10 minutes (we pass it explicitly too)
    delta = (info.expires_at - info.created_at).total_seconds()
    assert 590 <= delta <= 610, delta


@pytest.mark.needs_test_image
def test_create_on_debootstrap_image(make_sandbox, test_image):
    sbx = make_sandbox(test_image)
    code, out, err = sh(sbx, "python3 -c 'import sys; print(sys.version_info[:2])'; cat /etc/debian_version")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[0] == "(3, 11)"
    assert lines[1].startswith("12"), "expected Debian bookworm"
    info = sbx.get_info()
    assert info.image is not None and info.image.image == test_image


def test_custom_entrypoint_env_and_resources(make_sandbox):
    sbx = make_sandbox("host", entrypoint=["sleep", "infinity"], env={"A_VAR": "a value"},
                       resource={"cpu": "500m", "memory": "256Mi"})
    code, out, _ = sh(sbx, 'echo "$A_VAR"; ps -eo args')
    assert code == 0
    assert out.splitlines()[0] == "a value"
    assert "sleep infinity" in out, f"the entrypoint should run inside the sandbox:\n{out}"
    # memory limit visible from inside (cgroup v1 or v2)
    code, out, _ = sh(sbx, "cat /sys/fs/cgroup/memory.max 2>/dev/null || "
                           "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || echo unknown")
    val = out.strip()
    if val != "unknown":
        assert val == str(256 * 1024 * 1024), f"memory limit inside the sandbox is {val}"
    # and no swap beyond it: cgroup v2's swap.max is 0, v1's memsw (memory + swap) is the limit
    code, out, _ = sh(sbx, "cat /sys/fs/cgroup/memory.swap.max 2>/dev/null || "
                           "cat /sys/fs/cgroup/memory/memory.memsw.limit_in_bytes 2>/dev/null || echo unknown")
    val = out.strip()
    if val != "unknown":
        assert val in ("0", str(256 * 1024 * 1024)), f"swap beyond the memory limit: {val}"


def test_a_sandbox_at_its_memory_limit_loses_a_worker_not_execd(server, test_image, make_sandbox):
    """At its memory limit a sandbox's OOM killer picks among its workload, never execd: what execd
    starts scores 500 higher (`oom_score_adj`). execd counts ~23 MB on the embedded runtime (its code
    in huge pages), so a dozen 10 MB workers used to get execd killed, and with it the sandbox."""
    if server.gvisor:
        pytest.skip("a gVisor sandbox is one host process: at its memory limit the host ends all of it")
    sbx = make_sandbox(test_image, resource={"cpu": "1", "memory": "128Mi"})
    code, out, _ = sh(sbx, "cat /proc/self/oom_score_adj")
    assert (code, out.strip()) == (0, "500"), out
    hog = ("import time; b = bytearray(10 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(8)")
    code, out, err = sh(sbx, f"for i in $(seq 14); do python3 -c \"{hog}\" & done; wait; echo done",
                        timeout=timedelta(seconds=60))
    assert code == 0 and out.strip() == "done", (code, out, err)
    assert "Killed" in err, f"the workload should have met the limit: {err}"
    code, out, _ = sh(sbx, "echo still-here")
    assert (code, out.strip()) == (0, "still-here")
    assert sbx.get_info().status.state == "Running"


def test_ephemeral_storage_bounds_the_root_filesystem(server, test_image, make_sandbox, api):
    """`ephemeral-storage` bounds what a sandbox's root filesystem holds beyond its image: a write
    past it fails inside the sandbox (ENOSPC) and the sandbox carries on; the host's disk is not its
    to fill. Docker bounds a writable layer only on some storage drivers (not on this suite's
    daemon, overlay2 on ext4), and gVisor keeps those writes in its memory (bounded by the memory
    limit) where they cannot be bounded apart: there the create is refused with the reason, and
    nothing is made."""
    bounded = {"cpu": "1", "memory": "512Mi", "ephemeral-storage": "64Mi"}
    if not server.caps.disk_bound:
        before = {s["id"] for s in api.get("/v1/sandboxes", params={"pageSize": 200}).json()["items"]}
        r = api.post("/v1/sandboxes", json=W.create_body(server.sandbox_image(test_image),
                                                         resourceLimits=bounded))
        W.assert_error_body(r, codes=[501])
        assert "ephemeral-storage" in r.json()["message"], r.text
        after = {s["id"] for s in api.get("/v1/sandboxes", params={"pageSize": 200}).json()["items"]}
        assert after == before
        return
    fill = "dd if=/dev/zero of=/root/big bs=1M count=100 2>&1; echo exit=$?"
    sbx = make_sandbox(test_image, resource=bounded)
    code, out, _ = sh(sbx, fill, timeout=timedelta(seconds=60))
    assert "No space left on device" in out and "exit=1" in out, out
    # The bound is on what the sandbox holds: once it frees space, it writes again.
    code, out, err = sh(sbx, "rm /root/big && head -c 16M /dev/zero > /root/again && stat -c %s /root/again")
    assert (code, out.strip()) == (0, str(16 << 20)), (out, err)
    # Without a bound the same write fits: what failed above was the bound.
    other = make_sandbox(test_image, resource={"cpu": "1", "memory": "512Mi"})
    code, out, _ = sh(other, fill, timeout=timedelta(seconds=60))
    assert "exit=0" in out, out


def test_a_create_without_a_disk_bound_gets_the_default_one(server, test_image, make_sandbox):
    """No sandbox can fill the host's disk unless the operator says so: a create that names no
    `ephemeral-storage` gets [limits] default_ephemeral_storage (10Gi), on a sparse disk of its own.
    gVisor holds root writes in the sandbox's memory (bounded by the memory limit); Docker's
    overlay2 on ext4 cannot bound them, so there no default applies."""
    server.require("diskBound", "this runtime does not bound disk writes apart (see the docstring)")
    sbx = make_sandbox(test_image, resource={"cpu": "1", "memory": "512Mi"})
    code, out, err = sh(sbx, "df -B1 --output=size / | tail -1")
    assert code == 0, err
    size = int(out.strip())
    assert 9 << 30 < size <= 10 << 30, f"the root's file system is {size} bytes"


_TRAPS = ("import signal, time\n"
          "def note(n, f): open('/tmp/signals', 'a').write(signal.Signals(n).name + '\\n')\n"
          "for s in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH): signal.signal(s, note)\n"
          "open('/tmp/trapped', 'w').close()\n"
          "while True: time.sleep(1)\n")


def test_pid_1_is_execd_and_passes_signals_to_the_entrypoint(make_sandbox):
    """As the reference's init: PID 1 is named `execd`, and HUP, USR1, USR2 and WINCH sent to it
    reach the entrypoint (a reload signal to a container goes to PID 1). On every runtime: what PID
    1 is differs between them."""
    sbx = make_sandbox("host", entrypoint=["python3", "-c", _TRAPS])
    W.wait_until(lambda: sh(sbx, "test -e /tmp/trapped")[0] == 0, 30, interval=0.1, message="the traps")
    code, out, err = sh(sbx, "cat /proc/1/comm; for s in HUP USR1 USR2 WINCH; do kill -$s 1; sleep 0.2; done")
    assert code == 0 and out.strip() == "execd", (out, err)
    W.wait_until(lambda: sh(sbx, "cat /tmp/signals")[1].split() == ["SIGHUP", "SIGUSR1", "SIGUSR2", "SIGWINCH"],
                 10, interval=0.1, message="the signals to reach the entrypoint")
    assert sh(sbx, "echo alive")[1].strip() == "alive", "execd outlived the signals it passed on"


def _hooked(api, server, lifecycle):
    r = api.post("/v1/sandboxes", json=W.create_body(server.sandbox_image("host"), lifecycle=lifecycle))
    assert r.status_code == 202, r.text
    sid = r.json()["id"]
    W.track_sandbox(sid)

    def settled():
        st = api.get(f"/v1/sandboxes/{sid}").json()["status"]
        return st if st["state"] in ("Running", "Failed", "Terminated") else None
    return sid, W.wait_until(settled, 60, interval=0.1, message="the sandbox to settle")


def test_lifecycle_hooks_run_before_running_and_on_their_schedule(server, api):
    """`lifecycle.preStart` runs before the sandbox is Running (what it leaves is there for the
    first command), as the argument list it is (no shell); `lifecycle.periodic` runs on its
    schedule while the sandbox runs, never past its timeout, and the runs show in
    `diagnostics/logs?scope=lifecycle`. The hooks' runner is the server and execd, the same on every
    runtime: tested once, on the first runtime of the session."""
    server.run_once("hooks run through execd, the same on every runtime")
    sid, st = _hooked(api, server, {
        "preStart": {"command": ["sh", "-c", "echo prepared > /tmp/pre; echo pre-output $0", "x y"]},
        "periodic": [{"name": "tick", "schedule": "@every 1s", "command": ["sh", "-c", "echo . >> /tmp/ticks"]},
                     {"name": "slow", "schedule": "@every 1s", "timeoutSeconds": 1,
                      "command": ["sh", "-c", "echo started >> /tmp/slow; sleep 30; echo never >> /tmp/slow"]}]})
    try:
        assert st["state"] == "Running", st
        from opensandbox import SandboxSync
        sbx = SandboxSync.connect(sid, connection_config=server.sdk_config())
        assert sh(sbx, "cat /tmp/pre")[1] == "prepared\n", "the preStart hook ran before Running"
        W.wait_until(lambda: int(sh(sbx, "wc -l < /tmp/ticks")[1].strip() or 0) >= 3, 15, interval=0.2,
                     message="three periodic runs")
        time.sleep(2.5)
        slow = sh(sbx, "cat /tmp/slow")[1]
        assert "never" not in slow and slow.count("started") >= 1, slow
        # killed at its timeout, one run at a time: at most one `sleep 30` of it, never an old one
        ages = [int(l.split()[0]) for l in sh(sbx, "ps -eo etimes,args")[1].splitlines()
                if l.strip().endswith("sleep 30")]
        assert len(ages) <= 1 and all(a <= 2 for a in ages), ages
        r = api.get(f"/v1/sandboxes/{sid}/diagnostics/logs", params={"scope": "lifecycle"})
        assert r.status_code == 200, r.text
        text = r.json()["content"]
        assert "preStart ran" in text and "exit code 0" in text and "pre-output x y" in text, text
        assert "periodic tick ran" in text and "periodic slow ran" in text, text
        assert "timed out" in text, text
    finally:
        api.delete(f"/v1/sandboxes/{sid}")


def test_periodic_hooks_run_on_after_the_server_restarts(fresh_server):
    """The hooks' runner is the server: one that restarts (killed, even) arms a running sandbox's
    periodic hooks again from its record; preStart, done already, does not run again, and nothing
    runs while no server is up."""
    srv = fresh_server
    srv.run_once("hooks run through execd, the same on every runtime")
    with srv.client() as api:
        sid, st = _hooked(api, srv, {
            "preStart": {"command": ["sh", "-c", "echo . >> /tmp/pre"]},
            "periodic": [{"name": "tick", "schedule": "@every 1s", "command": ["sh", "-c", "echo . >> /tmp/ticks"]}]})
        assert st["state"] == "Running", st
    from opensandbox import SandboxSync

    def count(path: str) -> int:
        sbx = SandboxSync.connect(sid, connection_config=srv.sdk_config())
        return int(sh(sbx, f"cat {path} 2>/dev/null | wc -l")[1].strip() or 0)
    W.wait_until(lambda: count("/tmp/ticks") >= 2, 15, interval=0.2, message="periodic runs")
    srv.kill9()
    time.sleep(2.5)
    srv.start()
    while_down = count("/tmp/ticks")
    W.wait_until(lambda: count("/tmp/ticks") >= while_down + 3, 20, interval=0.2,
                 message="periodic runs after the restart")
    assert count("/tmp/pre") == 1, "preStart ran again after the restart"
    with srv.client() as api:
        api.delete(f"/v1/sandboxes/{sid}")


def test_a_failing_pre_start_ends_the_sandbox_failed_and_says_why(server, api):
    """A preStart that exits non-zero, or outlasts its timeout, ends the sandbox Failed before it
    was ever Running: its status says the hook's exit code and the end of its output, its diagnostics
    keep the run, and nothing of it runs on. Bad hooks are 400s that make nothing."""
    server.run_once("hooks run through execd, the same on every runtime")
    sid, st = _hooked(api, server, {"preStart": {"command": ["sh", "-c", "echo missing-config >&2; exit 7"]}})
    assert st["state"] == "Failed" and st["reason"] == "prestart_hook_failed", st
    assert "exit code 7" in st["message"] and "missing-config" in st["message"], st
    text = api.get(f"/v1/sandboxes/{sid}/diagnostics/logs", params={"scope": "lifecycle"}).json()["content"]
    assert "exit code 7" in text, text
    W.assert_error_body(api.post(f"/v1/sandboxes/{sid}/proxy/44772/command", json={"command": "true"}),
                        codes=[409])
    sid, st = _hooked(api, server, {"preStart": {"command": ["sleep", "30"], "timeoutSeconds": 1}})
    assert st["state"] == "Failed" and "timed out" in st["message"], st
    before = {s["id"] for s in api.get("/v1/sandboxes", params={"pageSize": 1000}).json()["items"]}
    for bad in ({"preStart": {"command": []}}, {"preStart": {"command": ["true"], "timeoutSeconds": 0}},
                {"periodic": [{"name": "x", "schedule": "every minute", "command": ["true"]}]},
                {"periodic": [{"name": "x", "schedule": "@every 1s", "command": ["true"], "timeoutSeconds": 301}]},
                {"preStart": {"command": ["true"], "shell": "bash"}}):
        r = api.post("/v1/sandboxes", json=W.create_body(server.sandbox_image("host"), lifecycle=bad))
        W.assert_error_body(r, codes=[400])
    after = {s["id"] for s in api.get("/v1/sandboxes", params={"pageSize": 1000}).json()["items"]}
    assert after == before


_PROBE_APP = ("import http.server as h\n"
              "class H(h.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        b = b'{\"active\": true}'\n"
              "        self.send_response(200); self.send_header('Content-Length', str(len(b))); self.end_headers()\n"
              "        self.wfile.write(b)\n"
              "    def log_message(self, *a): pass\n"
              "h.HTTPServer(('127.0.0.1', 8099), H).serve_forever()\n")


def test_an_idle_policy_pauses_idle_sandboxes_and_wakes_them_on_access(server, api):
    """`lifecycle.idlePolicy`: with nothing under way for `idleTimeoutSeconds` a sandbox is paused;
    one whose activity probe says it is busy, or that streams a long command, is not; a request
    to a paused one wakes it and is answered as if it had never slept; without `wakeOnAccess` the
    answer is 503 with the gateway's marker (`OpenSandbox-Wake: expired`, `Retry-After`) and
    nothing is relayed. Pause and resume are the runtime's; what decides them is the server's:
    tested once, on the first runtime that pauses."""
    server.run_once("the idle policy's decisions are the server's, the same on every runtime that pauses",
                    pause=True)
    import httpx
    from opensandbox import SandboxSync
    timeout = {"idleTimeoutSeconds": 30, "onIdle": "pause"}
    plain, _ = _hooked(api, server, {"idlePolicy": timeout})
    probed, _ = _hooked(api, server, {"idlePolicy": {**timeout, "activeProbe": {"port": 8099, "path": "/busy"}}})
    streaming, _ = _hooked(api, server, {"idlePolicy": timeout})
    no_wake, _ = _hooked(api, server, {"idlePolicy": {"wakeOnAccess": False}})
    try:
        probe_sbx = SandboxSync.connect(probed, connection_config=server.sdk_config())
        probe_sbx.files.write_file("/tmp/probe.py", _PROBE_APP)
        from opensandbox.models.execd import RunCommandOpts
        probe_sbx.commands.run("python3 /tmp/probe.py", opts=RunCommandOpts(background=True))
        ep = api.get(f"/v1/sandboxes/{streaming}/endpoints/44772").json()
        done = {}

        def stream():
            with httpx.Client(timeout=120) as c:
                r = c.post(f"http://{ep['endpoint']}/command", headers=ep["headers"],
                           json={"command": "sleep 40; echo slept"})
                done["text"] = r.text
        t = threading.Thread(target=stream)
        t.start()
        state = lambda sid: api.get(f"/v1/sandboxes/{sid}").json()["status"]  # noqa: E731
        W.wait_until(lambda: state(plain)["state"] == "Paused", 45, interval=0.5, message="the idle pause")
        assert state(plain)["reason"] == "idle_timeout", state(plain)
        assert state(probed)["state"] == "Running", "the probe said it was busy"
        assert state(streaming)["state"] == "Running", "a command under way is activity"
        # A request to the paused one wakes it: answered as if it had never slept.
        t0 = time.monotonic()
        sbx = SandboxSync.connect(plain, connection_config=server.sdk_config())
        code, out, err = sh(sbx, "echo awake")
        woke = time.monotonic() - t0
        assert code == 0 and out.strip() == "awake", (out, err)
        assert state(plain)["state"] == "Running" and state(plain)["reason"] == "wake_on_access", state(plain)
        print(f"wake on access: {woke * 1000:.0f} ms from paused to a connect and a command's end")
        t.join(60)
        assert "slept" in done.get("text", ""), done
        # Without wakeOnAccess: the marker, and the request never reaches the sandbox.
        assert api.post(f"/v1/sandboxes/{no_wake}/pause").status_code in (200, 202, 204)
        ep = api.get(f"/v1/sandboxes/{no_wake}/endpoints/44772").json()
        r = httpx.post(f"http://{ep['endpoint']}/command", headers=ep["headers"],
                       json={"command": "touch /tmp/reached"}, timeout=30)
        assert r.status_code == 503 and r.headers.get("opensandbox-wake") == "expired", (r.status_code, r.headers)
        assert r.headers.get("retry-after") == "1" and r.json()["code"], r.text
        assert state(no_wake)["state"] == "Paused"
        assert api.post(f"/v1/sandboxes/{no_wake}/resume").status_code in (200, 202, 204)
        nw = SandboxSync.connect(no_wake, connection_config=server.sdk_config())
        assert sh(nw, "test -e /tmp/reached || echo never")[1].strip() == "never"
    finally:
        for sid in (plain, probed, streaming, no_wake):
            api.delete(f"/v1/sandboxes/{sid}")


def test_no_timeout_means_no_expiry(make_sandbox):
    sbx = make_sandbox("host", timeout=None)
    assert sbx.get_info().expires_at is None


def _metrics_events_for(server, sandbox_id: str) -> list[str]:
    """The server's log lines for `POST /v1/metrics/events` reports about `sandbox_id`."""
    return [line for line in server.log_path.read_text(errors="replace").splitlines()
            if "client metrics event" in line and f'"{sandbox_id}"' in line]


def test_metrics_disabled_path(server, make_sandbox, monkeypatch):
    """The SDK reports each create to `POST /v1/metrics/events` (fire and forget), which the server
    logs; with OPENSANDBOX_DISABLE_METRICS=1 it sends nothing, and the sandbox works all the same.
    Control: a create with metrics on is reported, so the log is where a report would show."""
    monkeypatch.setenv("OPENSANDBOX_DISABLE_METRICS", "1")
    quiet = make_sandbox("host")
    assert sh(quiet, "echo ok")[1].strip() == "ok"
    # Made after the quiet one: its report is sent (on a thread) later than any the quiet one
    # could have sent, so once it is logged, the quiet one's would have been too.
    monkeypatch.delenv("OPENSANDBOX_DISABLE_METRICS")
    reported = make_sandbox("host")
    W.wait_until(lambda: _metrics_events_for(server, reported.id), 30,
                 message=f"the server to log the metrics report of sandbox {reported.id}")
    time.sleep(0.5)
    assert _metrics_events_for(server, quiet.id) == [], "a create was reported with metrics disabled"


def test_async_sdk(server):
    """The primary (async) SDK class works too."""
    from opensandbox import Sandbox
    from opensandbox.models.execd import ExecutionHandlers

    async def main():
        sbx = await Sandbox.create(server.sandbox_image("host"), connection_config=server.sdk_async_config(),
                                   timeout=timedelta(minutes=5))
        W.track_sandbox(sbx.id)
        try:
            seen = []

            async def on_stdout(msg):
                seen.append(msg.text)

            ex = await sbx.commands.run("echo async-ok", handlers=ExecutionHandlers(on_stdout=on_stdout))
            assert ex.exit_code == 0
            assert "async-ok" in "".join(seen)
            await sbx.files.write_file("/tmp/a.txt", "async file")
            assert await sbx.files.read_file("/tmp/a.txt") == "async file"
        finally:
            await sbx.kill()
            await sbx.close()

    asyncio.run(main())


def test_renew_moves_expiry(make_sandbox):
    sbx = make_sandbox("host", timeout=timedelta(minutes=5))
    before = sbx.get_info().expires_at
    resp = sbx.renew(timedelta(minutes=45))
    assert resp.expires_at > before + timedelta(minutes=30)
    after = sbx.get_info().expires_at
    assert abs((after - resp.expires_at).total_seconds()) < 2
    # renew may also shorten
    resp2 = sbx.renew(timedelta(minutes=2))
    assert resp2.expires_at < after


def test_expiry_via_renew(server, api, raw_sandbox):
    sid = raw_sandbox()["id"]
    soon = W.utcnow() + timedelta(seconds=2)
    r = api.post(f"/v1/sandboxes/{sid}/renew-expiration", json={"expiresAt": W.rfc3339(soon)})
    assert r.status_code == 200, r.text[:300]
    assert abs((W.parse_time(r.json()["expiresAt"]) - soon).total_seconds()) < 1.5

    def terminated():
        g = api.get(f"/v1/sandboxes/{sid}")
        assert g.status_code == 200, f"expired sandbox should stay visible: {g.status_code} {g.text[:200]}"
        st = g.json()["status"]
        return st if st["state"] == "Terminated" else None

    st = W.wait_until(terminated, 12, interval=0.2, message="ttl expiry")
    assert st.get("reason") == "ttl_expiry", st
    # Ended on its own and still listed: a delete takes it out of the list (204, as the reference
    # answers; it answered 404 "is already Terminated"), and it is gone for good.
    r = api.delete(f"/v1/sandboxes/{sid}")
    assert r.status_code == 204, r.text
    assert api.get(f"/v1/sandboxes/{sid}").status_code == 404
    assert sid not in {s["id"] for s in api.get("/v1/sandboxes", params={"pageSize": 1000}).json()["items"]}
    W.assert_error_body(api.delete(f"/v1/sandboxes/{sid}"), codes=[404])


def test_pause_resume(server, make_sandbox):
    from opensandbox import SandboxSync
    from opensandbox.exceptions import SandboxException

    sbx = make_sandbox("host")
    sbx.files.write_file("/tmp/state.txt", "kept")
    from opensandbox.models.execd import RunCommandOpts
    bg = sbx.commands.run("sleep 4711", opts=RunCommandOpts(background=True))
    assert bg.id
    sbx.pause()
    W.wait_until(lambda: sbx.get_info().status.state == "Paused", 15, message="state Paused")

    # a command on a paused sandbox fails with an error instead of hanging
    result = {}

    def attempt():
        try:
            result["value"] = sbx.commands.run("echo should-not-run")
        except SandboxException as exc:
            result["error"] = exc
        except Exception as exc:  # noqa: BLE001
            result["other"] = exc

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "a command on a paused sandbox hung instead of failing"
    assert "value" not in result, f"command ran on a paused sandbox: {result['value']}"
    assert "error" in result, f"expected a SandboxException, got {result.get('other')!r}"

    resumed = SandboxSync.resume(sbx.id, connection_config=server.sdk_config(),
                                 resume_timeout=timedelta(seconds=30))
    try:
        assert resumed.get_info().status.state == "Running"
        code, out, _ = sh(resumed, "cat /tmp/state.txt; echo; pgrep -f 'sleep 471[1]' >/dev/null && echo proc-kept")
        assert code == 0
        assert out.split() == ["kept", "proc-kept"], out
    finally:
        resumed.close()


def test_list_filters(server, make_sandbox, manager):
    from opensandbox.models.sandboxes import SandboxFilter

    tag = uuid.uuid4().hex[:10]
    a = make_sandbox("host", metadata={"suite": tag, "role": "a"})
    b = make_sandbox("host", metadata={"suite": tag, "role": "b"})
    b.pause()
    W.wait_until(lambda: b.get_info().status.state == "Paused", 15, message="b paused")

    def ids(**kw):
        res = manager.list_sandbox_infos(SandboxFilter(**kw))
        return {i.id for i in res.sandbox_infos}, res

    got, _ = ids(states=["Running"], metadata={"suite": tag})
    assert got == {a.id}
    got, _ = ids(states=["Paused"], metadata={"suite": tag})
    assert got == {b.id}
    got, _ = ids(states=["Running", "Paused"], metadata={"suite": tag})
    assert got == {a.id, b.id}
    got, _ = ids(metadata={"suite": tag, "role": "b"})
    assert got == {b.id}
    got, _ = ids(metadata={"suite": "nope-" + tag})
    assert got == set()
    got, res = ids(metadata={"suite": tag}, page_size=1, page=1)
    assert len(got) == 1
    assert res.pagination.total_items == 2
    assert res.pagination.has_next_page is True
    got2, res2 = ids(metadata={"suite": tag}, page_size=1, page=2)
    assert len(got2) == 1 and got2 != got
    assert res2.pagination.has_next_page is False
    info = next(i for i in manager.list_sandbox_infos(SandboxFilter(metadata={"suite": tag})).sandbox_infos
                if i.id == a.id)
    assert info.metadata.get("role") == "a"


def test_metadata_patch(make_sandbox):
    sbx = make_sandbox("host", metadata={"keep": "1", "drop": "2"})
    info = sbx.patch_metadata({"added": "3", "drop": None})
    assert info.metadata.get("added") == "3"
    assert "drop" not in (info.metadata or {})
    assert info.metadata.get("keep") == "1"
    assert sbx.get_info().metadata == info.metadata


def test_kill(make_sandbox, manager):
    from opensandbox.exceptions import SandboxApiException

    sbx = make_sandbox("host")
    sid = sbx.id
    sbx.kill()

    def gone():
        try:
            info = manager.get_sandbox_info(sid)
        except SandboxApiException as exc:
            assert exc.status_code == 404, exc
            return "404"
        assert info.status.state == "Stopping", info.status
        return None

    W.wait_until(gone, 15, interval=0.2, message="sandbox gone after kill")


def test_deleted_sandboxes_leave_no_zombies(server, make_sandbox):
    """What a runtime leaves to the server when a sandbox ends (gVisor's gofer and helpers, a
    sandbox's init) is reaped: a server that runs for months must not fill the pid table. (Under
    gVisor the server once kept four zombies per sandbox, and each delete waited 5 s for one.)"""
    for _ in range(2):
        sbx = make_sandbox("host")
        code, out, _ = sh(sbx, "echo up")
        assert (code, out.strip()) == (0, "up")
        sbx.kill()
    try:
        W.wait_until(lambda: not W.zombie_children(server.proc.pid), 15, interval=0.2,
                     message="the server's zombie children to be reaped")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still there: {W.zombie_children(server.proc.pid)}") from None


def test_concurrent_creates(make_sandbox):
    lock = threading.Lock()

    def one(i):
        sbx = make_sandbox("host", metadata={"n": str(i)})
        code, out, _ = sh(sbx, f"echo n{i}")
        return code, out.strip()

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    assert results == [(0, f"n{i}") for i in range(6)]
    _ = lock


def test_streams_close_when_the_command_ends(make_sandbox):
    """A command's stream ends when the command does (the reference execd holds it ~1 s longer).
    Measured as a ratio to a command that runs 1 s, so a slow machine cannot make
    it fail; speed itself is measured by bench/, not here."""
    sbx = make_sandbox("host")
    sh(sbx, "true")  # warm
    t0 = time.monotonic()
    sh(sbx, "true")
    quick = time.monotonic() - t0
    t0 = time.monotonic()
    sh(sbx, "sleep 1")
    slow = time.monotonic() - t0
    assert quick < 0.5 * slow, (f"`true` took {quick:.2f}s against {slow:.2f}s for `sleep 1`: the "
                                f"stream must close the moment the command ends")


def _warren_cgroups() -> set[str]:
    """Sandbox cgroups of every Warren server on this host (standby helpers' excluded)."""
    return {str(p) for p in Path("/sys/fs/cgroup").glob("*/warren*/*")
            if p.is_dir() and not p.name.startswith(".")}


def test_a_start_over_its_timeout_fails_cleanly(server, work_root):
    """A sandbox whose setup does not finish within `[runtime] start_timeout_seconds` fails its create
    with a message naming the setting; the setup helper is killed and everything the start made is
    removed, the sandbox's PID 1 (which the killed helper may have forked) reaped (a setup that hangs
    used to hold its create, and a create slot, for ever). A timeout that is not a positive number
    keeps the server from starting."""
    if not server.embedded:
        pytest.skip("the setup helper's answer is awaited with this deadline on the embedded runtime")
    bad = W.WarrenServer(server.runtime, work_root, f"badstart-{uuid.uuid4().hex[:6]}")
    bad.runtime_config = "start_timeout_seconds = 0\n"
    with pytest.raises(AssertionError, match="start_timeout_seconds"):
        bad.start(ready_timeout=10)
    bad.terminate()

    srv = W.WarrenServer(server.runtime, work_root, f"slowstart-{uuid.uuid4().hex[:6]}")
    # Half a millisecond: no setup (mounts, pivot_root, execd listening) is that fast.
    srv.runtime_config = "start_timeout_seconds = 0.0005\n"
    srv.start()
    try:
        before = _warren_cgroups()
        with srv.client() as api:
            for _ in range(3):
                r = api.post("/v1/sandboxes", json=W.create_body())
                W.assert_error_body(r, codes=[500])
                assert "start_timeout_seconds" in r.json()["message"], r.text
            assert api.get("/v1/sandboxes").json()["items"] == []
        sandboxes = srv.data_dir / "sandboxes"
        assert not sandboxes.exists() or not any(sandboxes.iterdir()), list(sandboxes.iterdir())
        assert W.wait_until(lambda: not (_warren_cgroups() - before), 10,
                            message="the failed starts' cgroups to go"), _warren_cgroups() - before
        assert W.wait_until(lambda: not W.zombie_children(srv.proc.pid), 10,
                            message="the killed setups' processes to be reaped"), W.zombie_children(srv.proc.pid)
        assert not W.leaked_mounts([srv.data_dir]), W.leaked_mounts([srv.data_dir])
    finally:
        srv.delete_all_sandboxes()
        srv.stop()


def test_a_server_whose_port_is_taken_leaves_nothing(server, work_root):
    """`warren serve` on a port another process holds exits with an error naming the address, and
    leaves no standby setup helper's cgroup behind: the port is bound before the runtime starts
    anything (they used to stay until the next server started on the host)."""
    if not server.embedded:
        pytest.skip("standby setup helpers belong to the embedded runtime")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        srv = W.WarrenServer(server.runtime, work_root, f"busyport-{uuid.uuid4().hex[:6]}")
        with pytest.raises(AssertionError, match="exited with code"):
            srv.start(port=busy.getsockname()[1], ready_timeout=20)
    assert f"binding 127.0.0.1:{srv.port}" in srv.log_tail(), srv.log_tail()
    assert not W.leaked_cgroups([], [srv.proc.pid]), W.leaked_cgroups([], [srv.proc.pid])
    assert not any(W.state_and_ppid(p) and W.state_and_ppid(p)[1] == srv.proc.pid for p in W.all_pids())


def _sandbox_cgroup_dirs(sandbox_id: str) -> list[Path]:
    """The sandbox's cgroup directory in every hierarchy (one on cgroup v2)."""
    return [p for p in Path("/sys/fs/cgroup").glob(f"*/warren/{sandbox_id}")] + \
        [p for p in [Path("/sys/fs/cgroup/warren") / sandbox_id] if p.is_dir()]


def _hold_frozen(sandbox_id: str, pid: int) -> tuple[Path, callable]:
    """Moves `pid` into a cgroup nested in the sandbox's and freezes it there: it cannot die until
    thawed, like a process in uninterruptible sleep on a hung mount. Returns the nested cgroup and a
    function that thaws it."""
    v1 = Path("/sys/fs/cgroup/freezer/warren") / sandbox_id
    if v1.is_dir():
        hold = v1 / "hold"
        hold.mkdir()
        (hold / "cgroup.procs").write_text(str(pid))
        (hold / "freezer.state").write_text("FROZEN")
        W.wait_until(lambda: (hold / "freezer.state").read_text().strip() == "FROZEN", 10,
                     message="the nested cgroup to freeze")
        return hold, lambda: (hold / "freezer.state").write_text("THAWED")
    hold = Path("/sys/fs/cgroup/warren") / sandbox_id / "hold"
    hold.mkdir()
    (hold / "cgroup.procs").write_text(str(pid))
    (hold / "cgroup.freeze").write_text("1")
    return hold, lambda: (hold / "cgroup.freeze").write_text("0")


def test_a_cgroup_that_outlives_its_delete_is_removed_later(server, work_root):
    """A deleted sandbox's cgroup can only go once its last process has died, and its PID 1 only
    exits then too. With a process that cannot die yet (frozen in a cgroup nested in the sandbox's,
    standing in for one stuck on a hung NFS mount), the delete still answers 204; the cgroup is
    recorded under the data dir and removed once the process can die, with PID 1 reaped — by the
    same server, and by the next one started on that data dir. Before, the cgroup stayed for ever."""
    if not server.embedded:
        pytest.skip("the cgroups and processes of the embedded runtime's sandboxes")
    srv = W.WarrenServer(server.runtime, work_root, f"leftover-{uuid.uuid4().hex[:6]}")
    srv.start()
    leftovers = srv.data_dir / "cgroup-leftovers"
    thaws = []
    try:
        def stuck_delete(api) -> tuple[str, int]:
            r = api.post("/v1/sandboxes", json=W.create_body(entrypoint=["sleep", "600"]))
            assert r.status_code == 202, r.text
            sid = r.json()["id"]
            W.track_sandbox(sid)
            dirs = _sandbox_cgroup_dirs(sid)
            assert dirs, "the sandbox has a cgroup"
            procs = [int(p) for p in (dirs[0] / "cgroup.procs").read_text().split()]
            sleeper = [p for p in procs if W.proc_argv(p)[:1] == ["sleep"]]
            assert len(sleeper) == 1, [(p, W.proc_argv(p)) for p in procs]
            _, thaw = _hold_frozen(sid, sleeper[0])
            thaws.append(thaw)
            assert api.delete(f"/v1/sandboxes/{sid}").status_code == 204
            assert any(d.is_dir() for d in dirs), "the stuck process keeps the cgroup"
            assert (leftovers / sid).exists(), sorted(os.listdir(leftovers)) if leftovers.is_dir() else []
            return sid, sleeper[0]

        def gone(sid: str) -> bool:
            return not _sandbox_cgroup_dirs(sid) and not (leftovers / sid).exists()

        with srv.client() as api:
            # The same server clears it once the process can die, and reaps the sandbox's PID 1.
            sid, _ = stuck_delete(api)
            thaws.pop()()
            assert W.wait_until(lambda: gone(sid), 20, message="the cgroup to go"), \
                (_sandbox_cgroup_dirs(sid), srv.log_tail())
            assert W.wait_until(lambda: not W.zombie_children(srv.proc.pid), 10,
                                message="the sandbox's PID 1 to be reaped"), W.zombie_children(srv.proc.pid)

            # A server stopped meanwhile: the next one on the data dir carries on.
            sid, _ = stuck_delete(api)
        srv.terminate()
        srv.start()
        thaws.pop()()
        assert W.wait_until(lambda: gone(sid), 20, message="the restarted server to remove the cgroup"), \
            (_sandbox_cgroup_dirs(sid), srv.log_tail())
    finally:
        for thaw in thaws:
            thaw()
        srv.stop()


def _memory_cgroups_in_kernel() -> int | None:
    """How many memory cgroups the kernel holds, removed ("dying") ones included: /proc/cgroups on
    cgroup v1, the root's cgroup.stat on v2."""
    stat = Path("/sys/fs/cgroup/cgroup.stat")
    if stat.exists():
        fields = dict(line.split() for line in stat.read_text().splitlines())
        return int(fields["nr_descendants"]) + int(fields["nr_dying_descendants"])
    for line in Path("/proc/cgroups").read_text().splitlines():
        name, hierarchy, count, enabled = (line.split() + ["", "", "", ""])[:4]
        if name == "memory" and enabled == "1" and hierarchy != "0":
            return int(count)
    return None


def test_deleted_sandboxes_leave_no_dying_memory_cgroups(server, api):
    """A removed cgroup stays in the kernel, "dying", for as long as page cache it was charged for
    stays cached: ~78 KiB of kernel memory each here (cgroup v1, 2 CPUs), held for hours on a host
    with memory to spare. Making a sandbox's overlay root writes a few pages of ext4 metadata (the
    work dir's probes); charged to the sandbox, they kept the memory cgroups of 250 of every 300
    deleted sandboxes dying. The server makes the overlay now, outside the sandbox's cgroup."""
    if not server.embedded:
        pytest.skip("the embedded runtime makes its sandboxes' roots itself")
    if _memory_cgroups_in_kernel() is None:
        pytest.skip("no memory controller")

    def cycle():
        r = api.post("/v1/sandboxes", json=W.create_body())
        assert r.status_code == 202, r.text
        sid = r.json()["id"]
        W.track_sandbox(sid)
        assert api.delete(f"/v1/sandboxes/{sid}").status_code == 204

    # The server keeps setup helpers, each in a cgroup of its own, made ahead of need: counted
    # once they are made.
    cycle()
    time.sleep(1)
    before = _memory_cgroups_in_kernel()
    n = 20
    for _ in range(n):
        cycle()
    time.sleep(1)
    grown = _memory_cgroups_in_kernel() - before
    assert grown <= n // 4, f"{grown} of {n} deleted sandboxes left a memory cgroup in the kernel"


def test_a_zygote_that_dies_leaves_no_zombies(server, work_root):
    """When the sandbox zygote dies (OOM killer, an operator's kill), the setup helpers it had forked
    are reparented to the server; the next creates use them and a new zygote, and each helper that
    ends is reaped (they used to stay zombies until the server exited)."""
    if not server.embedded:
        pytest.skip("the zygote and its setup helpers belong to the embedded runtime")
    srv = W.WarrenServer(server.runtime, work_root, f"zygote-{uuid.uuid4().hex[:6]}")
    srv.start()
    try:
        with srv.client() as api:
            def cycle():
                r = api.post("/v1/sandboxes", json=W.create_body())
                assert r.status_code == 202, r.text
                W.track_sandbox(r.json()["id"])
                assert api.delete(f"/v1/sandboxes/{r.json()['id']}").status_code == 204

            cycle()  # the zygote and its standby helpers exist now
            def parent(p):
                return (W.state_and_ppid(p) or ("", 0))[1]

            zygotes = [p for p in W.all_pids() if parent(p) == srv.proc.pid
                       and "__sandbox-zygote" in W.proc_cmdline(p)]
            # The zygote is the server's child; its helpers are the zygote's until it dies.
            zygote = [p for p in zygotes if any(parent(c) == p for c in W.all_pids())]
            assert len(zygote) == 1, f"expected one zygote with helpers among {zygotes}"
            os.kill(zygote[0], signal.SIGKILL)
            for _ in range(6):
                cycle()
        assert W.wait_until(lambda: not W.zombie_children(srv.proc.pid), 10,
                            message="ended setup helpers to be reaped"), W.zombie_children(srv.proc.pid)
    finally:
        srv.stop()
