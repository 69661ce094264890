"""Durable state across `kill -9` of the server (issue 2 item 7). Each test
uses its own server so the shared one is never disturbed."""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from datetime import timedelta

import pytest
from opensandbox.models.execd import RunCommandOpts

import warren_e2e as W


@pytest.mark.timeout(240)
def test_restart_keeps_running_sandboxes(fresh_server):
    from opensandbox import SandboxSync

    srv = fresh_server
    sbx = SandboxSync.create(srv.sandbox_image("host"), connection_config=srv.sdk_config(), timeout=None,
                             metadata={"restart": "keep"})
    W.track_sandbox(sbx.id)
    sbx.files.write_file("/tmp/before.txt", "before restart")
    bg = sbx.commands.run("sleep 100000", opts=RunCommandOpts(background=True))
    # one that must still expire on time after the restart
    exp = SandboxSync.create(srv.sandbox_image("host"), connection_config=srv.sdk_config(), timeout=timedelta(minutes=10))
    W.track_sandbox(exp.id)
    sbx.close()
    exp.close()

    srv.kill9()
    srv.start()  # same data dir, new port

    with srv.client() as c:
        deadline_at = W.utcnow() + timedelta(seconds=3)
        r = c.post(f"/v1/sandboxes/{exp.id}/renew-expiration", json={"expiresAt": W.rfc3339(deadline_at)})
        assert r.status_code == 200, f"renew after restart failed: {r.status_code} {r.text[:300]}"

        r = c.get("/v1/sandboxes", params={"metadata": "restart=keep"})
        assert r.status_code == 200
        items = {i["id"]: i for i in r.json()["items"]}
        assert sbx.id in items, "a running sandbox vanished after the server was killed"
        assert items[sbx.id]["status"]["state"] == "Running"
        assert "expiresAt" not in items[sbx.id] or items[sbx.id]["expiresAt"] is None

    again = SandboxSync.connect(sbx.id, connection_config=srv.sdk_config())
    try:
        code, out, _ = W.sh(again, "cat /tmp/before.txt; echo; echo after")
        assert code == 0
        assert out.split("\n")[0] == "before restart"
        assert "after" in out
        st = again.commands.get_command_status(bg.id)
        assert st.running is True, "a background command started before the restart should still run"
    finally:
        again.close()

    def expired():
        with srv.client() as c:
            st = c.get(f"/v1/sandboxes/{exp.id}").json()["status"]
        return st if st["state"] == "Terminated" else None

    st = W.wait_until(expired, 15, interval=0.2, message="expiry after restart")
    assert st.get("reason") == "ttl_expiry"


@pytest.mark.timeout(240)
def test_sandbox_killed_while_server_down(fresh_server):
    from opensandbox import SandboxSync

    srv = fresh_server
    marker = f"e2emark{uuid.uuid4().hex[:10]}"
    victim = SandboxSync.create(srv.sandbox_image("host"), connection_config=srv.sdk_config(), timeout=None)
    W.track_sandbox(victim.id)
    survivor = SandboxSync.create(srv.sandbox_image("host"), connection_config=srv.sdk_config(), timeout=None)
    W.track_sandbox(survivor.id)
    victim.commands.run(f"bash -c 'exec -a {marker} sleep 100000'", opts=RunCommandOpts(background=True))
    W.wait_until(lambda: W.pids_with_cmdline(marker) or (srv.gvisor), 10,
                 message=f"marker process {marker} visible on the host")
    victim.close()
    survivor.close()

    srv.kill9()
    if srv.is_docker:
        # the daemon owns the container's processes: kill them through it
        res = subprocess.run(["docker", "kill", f"warren-{victim.id}"], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        pids = []
    else:
        pids = W.sandbox_host_pids(marker, victim.id)
    assert pids or srv.is_docker, (f"could not find the host processes of sandbox {victim.id} (runtime {srv.runtime}); "
                  f"the test looks for a PID namespace shared with a process named {marker} and for "
                  f"command lines mentioning the sandbox id")
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    W.wait_until(lambda: not any(W.proc_state(p) not in (None, "Z") for p in pids), 10,
                 message="sandbox processes to die")

    srv.start()
    with srv.client() as c:
        def settled():
            r = c.get(f"/v1/sandboxes/{victim.id}")
            assert r.status_code == 200, f"a sandbox whose processes died must not vanish: {r.status_code}"
            st = r.json()["status"]
            return st if st["state"] in ("Failed", "Terminated") else None

        st = W.wait_until(settled, 15, interval=0.2, message="dead sandbox to show Failed/Terminated")
        assert st["state"] in ("Failed", "Terminated")
        r = c.get(f"/v1/sandboxes/{survivor.id}")
        assert r.json()["status"]["state"] == "Running"
    s2 = SandboxSync.connect(survivor.id, connection_config=srv.sdk_config())
    try:
        assert W.sh(s2, "echo ok")[1].strip() == "ok"
    finally:
        s2.close()
