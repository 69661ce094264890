"""Isolated sessions (`/v1/isolated/…`, the 1.1.1 SDK's `sandbox.isolation`) in a sandbox created
with `extensions={"bootstrap.execd.isolation": "enable"}`, driven by the official Python SDK.

A session is a set of namespaces of its own inside the sandbox (PID, mount, UTS, IPC, cgroup, the
network's unless shared), the sandbox's tree read-only, its workspace rw, ro or an overlay. These
tests try what code in a session would try: to write outside its workspace, to see or signal the
sandbox's processes, to read secrets from the environment, to unshare or mount, to reach another
session's files — and check the reference's observable behaviour (events, exit codes, background
runs, validation). Only the embedded runtime with user namespaces offers sessions (/health's
isolatedSessions, which these tests choose by); elsewhere capabilities say why (checked here and in
test_official_clients)."""

import os
import time
import uuid

import httpx
from pathlib import Path
import pytest

import warren_e2e as W

ISOLATION = {"bootstrap.execd.isolation": "enable"}


@pytest.fixture(scope="module")
def iso(server):
    server.require("isolatedSessions", "isolated sessions are offered by the embedded runtime")
    from opensandbox import SandboxSync
    from datetime import timedelta
    sbx = SandboxSync.create(
        server.sandbox_image("host"),
        connection_config=server.sdk_config(),
        timeout=timedelta(minutes=10),
        ready_timeout=timedelta(seconds=60),
        env={"OPENAI_API_KEY": "sk-secret", "AWS_REGION": "eu", "PLAIN_VAR": "plain"},
        extensions=ISOLATION,
    )
    W.track_sandbox(sbx.id)
    yield sbx
    sbx.kill()
    sbx.close()


def _req(**kw):
    from opensandbox.models.isolated import CreateIsolatedSessionRequest, IsolatedWorkspaceSpec
    ws = kw.pop("workspace", None)
    mode = kw.pop("mode", None)
    if ws is not None:
        kw["workspace"] = IsolatedWorkspaceSpec(path=ws, mode=mode)
    return CreateIsolatedSessionRequest(**kw)


def _sh(sbx, cmd):
    ex = sbx.commands.run(cmd)
    out = "\n".join(m.text for m in ex.logs.stdout)
    return ex, out


def _text(ex):
    return "\n".join(m.text for m in ex.logs.stdout)


def test_capabilities_and_lifecycle(iso):
    caps = iso.isolation.capabilities()
    assert caps.available is True, caps
    assert caps.setpriv_available is True and caps.userns_available is False
    assert caps.commit_supported is False and caps.diff_supported is False
    s = iso.isolation.create(_req(workspace="/workspace"))
    uuid.UUID(s.session_id)  # the SDK's files adapter insists on a UUID
    assert s.info.created_at is not None
    state = s.get()
    assert state.status == "active"
    assert state.profile == "strict" and state.uid_mode == "setpriv"
    assert state.idle_timeout_seconds == 0
    assert state.workspace.path == "/workspace" and state.workspace.mode == "overlay"
    listed = {x.session_id: x for x in iso.isolation.list()}
    assert s.session_id in listed and listed[s.session_id].last_run_at is not None
    attached = iso.isolation.attach(s.session_id)
    assert _text(attached.run("echo attached")) == "attached"
    s.delete()
    from opensandbox.exceptions import SandboxApiException
    with pytest.raises(SandboxApiException) as e:
        s.delete()
    assert e.value.status_code == 404
    with pytest.raises(SandboxApiException):
        s.get()


def test_runs_keep_state_and_report_exit_codes(iso):
    from opensandbox.models.isolated import IsolatedRunOpts
    with iso.isolation.session(_req(workspace="/workspace")) as s:
        ex = s.run("echo one; echo; echo two; echo err >&2")
        # One event per line, empty lines dropped, stderr merged into stdout (the reference's).
        assert [m.text for m in ex.logs.stdout] == ["one", "two", "err"], ex.logs
        assert ex.error is None
        s.run("export KEEP=kept; cd /tmp")
        assert _text(s.run("echo $KEEP; pwd")) == "kept\n/tmp"
        # A run with envs is a subshell: nothing it does stays.
        assert _text(s.run("echo $X; export GONE=1", opts=IsolatedRunOpts(envs={"X": "x1"}))) == "x1"
        assert _text(s.run("echo ${GONE:-unset}")) == "unset"
        ex = s.run("exit 3")
        # `exit` ends the shell: the reference removes the session.
        assert ex.error is not None
        from opensandbox.exceptions import SandboxApiException
        with pytest.raises(SandboxApiException):
            s.run("true")
    with iso.isolation.session(_req(workspace="/workspace")) as s:
        ex = s.run("false")
        assert ex.error.name == "ExitError" and ex.error.value == "1", ex.error
        ex = s.run("(exit 7)")
        assert ex.error.name == "ExitError" and ex.error.value == "7"
        t0 = time.monotonic()
        ex = s.run("sleep 30", opts=IsolatedRunOpts(timeout_seconds=1))
        assert time.monotonic() - t0 < 10
        assert ex.error.name == "RuntimeError", ex.error
        # The session survives its run's timeout.
        assert _text(s.run("echo still")) == "still"
        # Runs in one session take turns; both finish, each with its own output.
        import concurrent.futures
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(s.run, "sleep 0.5; echo first")
            second = pool.submit(s.run, "echo second")
            assert {_text(first.result()), _text(second.result())} == {"first", "second"}


def test_a_session_is_apart_from_the_sandbox(iso):
    with iso.isolation.session(_req(workspace="/workspace")) as s:
        pid = int(_text(s.run("echo $$")))
        assert pid <= 2, pid
        # The sandbox's processes cannot be signalled (nor, with a /proc of its own, seen).
        _, sbx_pid = _sh(iso, "echo $$")
        ex = s.run(f"kill -0 {sbx_pid} 2>&1 || echo refused")
        assert "refused" in _text(ex) or "No such process" in _text(ex)
        # The tree outside the workspace is read-only.
        ex = s.run("touch /etc/x 2>&1; echo rc=$?")
        assert "rc=1" in _text(ex) and "Read-only" in _text(ex), _text(ex)
        # Secrets stay out of the environment by default; plain variables pass.
        env = _text(s.run("env"))
        assert "PLAIN_VAR=plain" in env and "OPENAI_API_KEY" not in env and "AWS_REGION" not in env
        # Nothing of execd's or the helper's is open in a session's processes (0-2, and ls's own).
        assert int(_text(s.run("ls /proc/self/fd | wc -l"))) <= 4
        # Code in a session is under the sandbox's own filter: no namespaces, no mounts.
        ex = s.run("unshare -U true 2>&1; echo rc=$?; mount -t tmpfs none /mnt 2>&1; echo rc=$?")
        assert _text(ex).count("rc=0") == 0, _text(ex)
        # Writes in an overlay workspace stay in the session.
        s.run("echo from-session > /workspace/overlay-file")
        assert _text(s.run("cat /workspace/overlay-file")) == "from-session"
        ex, _ = _sh(iso, "test -e /workspace/overlay-file && echo leaked || echo apart")
        assert _text(ex) == "apart"
        # /tmp is private under the strict profile.
        s.run("echo x > /tmp/strict-private")
        ex, _ = _sh(iso, "test -e /tmp/strict-private && echo leaked || echo apart")
        assert _text(ex) == "apart"


def test_a_workspace_in_tmp_is_the_sandboxs_tmp(iso):
    """Under the strict profile /tmp is the session's own, but not when the workspace is /tmp or
    lies in it: the session sees the sandbox's files there (it saw an empty tmpfs), as the reference
    does; writes to an overlay workspace still stay in the session."""
    iso.commands.run("mkdir -p /tmp/ws-sub && echo from-sandbox > /tmp/ws-sub/seen && echo top > /tmp/seen-top")
    for ws, path in (("/tmp", "/tmp/seen-top"), ("/tmp/ws-sub", "/tmp/ws-sub/seen")):
        with iso.isolation.session(_req(workspace=ws)) as s:
            assert _text(s.run(f"cat {path}")) in ("top", "from-sandbox"), ws
            s.run(f"echo mine > {ws}/session-file")
            assert _text(s.run(f"cat {ws}/session-file")) == "mine"
        ex, _ = _sh(iso, f"test -e {ws}/session-file && echo leaked || echo apart")
        assert _text(ex) == "apart", ws


def test_workspace_modes(iso):
    iso.commands.run("mkdir -p /workspace/modes && echo lower > /workspace/modes/base")
    with iso.isolation.session(_req(workspace="/workspace/modes", mode="rw")) as s:
        s.run("echo written > /workspace/modes/rw-file")
        ex, _ = _sh(iso, "cat /workspace/modes/rw-file")
        assert _text(ex) == "written"
    with iso.isolation.session(_req(workspace="/workspace/modes", mode="ro")) as s:
        ex = s.run("echo no > /workspace/modes/ro-file 2>&1; echo rc=$?")
        assert "rc=1" in _text(ex) or "rc=2" in _text(ex), _text(ex)
        assert _text(s.run("cat /workspace/modes/base")) == "lower"
    with iso.isolation.session(_req(workspace="/workspace/modes")) as s:
        s.run("echo changed > /workspace/modes/base; rm /workspace/modes/rw-file")
        assert _text(s.run("cat /workspace/modes/base; ls /workspace/modes")) == "changed\nbase"
        ex, _ = _sh(iso, "cat /workspace/modes/base; ls /workspace/modes")
        assert _text(ex) == "lower\nbase\nrw-file"


def test_no_network_when_not_shared(iso):
    with iso.isolation.session(_req(workspace="/workspace", share_net=False)) as s:
        assert _text(s.run("ls /sys/class/net")) == "lo"
    with iso.isolation.session(_req(workspace="/workspace", profile="balanced")) as s:
        s.run("echo shared > /tmp/balanced-tmp")
        ex, _ = _sh(iso, "cat /tmp/balanced-tmp")
        assert _text(ex) == "shared"


def test_identity(iso):
    with iso.isolation.session(_req(workspace="/workspace/id", mode="rw", uid=1000, gid=1000)) as s:
        assert _text(s.run("id -u; id -g")) == "1000\n1000"


def test_background_runs(iso):
    from opensandbox.models.isolated import IsolatedRunOpts
    with iso.isolation.session(_req(workspace="/workspace")) as s:
        run = s.run_background("echo bg-out; echo bg-err >&2; echo $BGV; exit 7",
                               opts=IsolatedRunOpts(envs={"BGV": "v"}))
        for _ in range(100):
            st = s.run_status(run.run_id)
            if not st.running:
                break
            time.sleep(0.1)
        assert st.running is False and st.exit_code == 7 and st.finished_at is not None, st
        logs = s.run_logs(run.run_id)
        assert logs.text == "bg-out\nbg-err\nv\n" and logs.cursor == len(logs.text)
        assert s.run_logs(run.run_id, cursor=logs.cursor).text == ""
        # Its output never reaches the next foreground run.
        assert _text(s.run("echo fg")) == "fg"
        from opensandbox.exceptions import SandboxApiException
        with pytest.raises(SandboxApiException) as e:
            s.run_status(str(uuid.uuid4()))
        assert e.value.status_code == 404


def test_files_routes_see_what_the_session_sees(iso):
    from opensandbox.models.filesystem import WriteEntry
    with iso.isolation.session(_req(workspace="/workspace/files")) as s:
        s.files.write_files([WriteEntry(path="/workspace/files/a.txt", data="via-api")])
        # Written into the session's overlay: the session sees it at once, the sandbox never.
        assert _text(s.run("cat /workspace/files/a.txt")) == "via-api"
        ex, _ = _sh(iso, "test -e /workspace/files/a.txt && echo leaked || echo apart")
        assert _text(ex) == "apart"
        s.run("echo from-run > /workspace/files/b.txt")
        assert s.files.read_file("/workspace/files/b.txt") == "from-run\n"
        info = s.files.get_file_info(["/workspace/files/b.txt"])
        assert info["/workspace/files/b.txt"].size == len("from-run\n")


def test_bad_requests(iso, server):
    """Raw HTTP to execd through the sandbox's endpoint: each bad create is a 400 with a code."""
    ep = iso.get_endpoint(44772)
    headers = dict(ep.headers or {})
    base = f"http://{ep.endpoint}"
    bad = [
        {},
        {"workspace": {"path": "relative"}},
        {"workspace": {"path": "/w/"}},
        {"workspace": {"path": "/w", "mode": "bogus"}},
        {"workspace": {"path": "/proc/sys"}},
        {"workspace": {"path": "/w"}, "extra_writable": ["/etc"]},
        {"workspace": {"path": "/w"}, "binds": [{"source": "/etc", "dest": "/x"}]},
        {"workspace": {"path": "/w"}, "overlays": [{"path": "/w"}]},
        {"overlays": [{"path": f"/o{i}"} for i in range(17)]},
        {"overlays": [{"path": "/o", "mode": "rw", "persist": True}]},
        {"workspace": {"path": "/w"}, "uid_mode": "bogus"},
        # -1 would leave setresuid's uid unchanged (root); 70000 is no id of the sandbox's range
        {"workspace": {"path": "/w"}, "uid": 4294967295},
        {"workspace": {"path": "/w"}, "gid": 70000},
    ]
    with httpx.Client(base_url=base, headers=headers, timeout=30) as c:
        for body in bad:
            r = c.post("/v1/isolated/session", json=body)
            assert r.status_code == 400, (body, r.status_code, r.text)
            assert r.json()["code"] == "INVALID_REQUEST_BODY", r.text
        r = c.post("/v1/isolated/session", json={"workspace": {"path": "/w"}, "uid_mode": "userns"})
        assert r.status_code == 503 and r.json()["code"] == "NOT_SUPPORTED"
        r = c.get(f"/v1/isolated/session/{uuid.uuid4()}")
        assert r.status_code == 404 and r.json()["code"] == "SESSION_NOT_FOUND"
        sid = c.post("/v1/isolated/session", json={"workspace": {"path": "/workspace"}}).json()["session_id"]
        try:
            for method, path in (("GET", "diff"), ("POST", "commit")):
                r = c.request(method, f"/v1/isolated/session/{sid}/{path}")
                assert r.status_code == 503 and r.json()["code"] == "NOT_SUPPORTED"
            r = c.post(f"/v1/isolated/session/{sid}/run", json={"code": ""})
            assert r.status_code == 400
            r = c.get(f"/v1/isolated/session/{sid}/runs/{uuid.uuid4()}/logs", params={"cursor": "-1"})
            assert r.status_code == 400
        finally:
            c.delete(f"/v1/isolated/session/{sid}")


def _wait_pid(run, pattern, tries=50):
    for _ in range(tries):
        out = _text(run(f"pgrep -f '{pattern}' || true")).strip()
        if out:
            return out.splitlines()[0]
        time.sleep(0.1)
    raise AssertionError(f"no process matching {pattern}")


def test_a_session_cannot_reach_into_the_sandbox_or_other_sessions(iso):
    """The sandbox's /proc is what a session sees (the kernel refuses it one of its own there), so
    the sandbox's processes are listed; each session process runs in a user namespace of its own,
    so their /proc/<pid>/{environ,root} stay closed — while the sandbox itself can read them."""
    from opensandbox.models.execd import RunCommandOpts
    iso.commands.run("SANDBOX_ONLY_SECRET=s3 sleep 600", opts=RunCommandOpts(background=True))
    sbx_run = lambda c: iso.commands.run(c)  # noqa: E731
    target = _wait_pid(sbx_run, "sleep 600")
    # The test could fail: from the sandbox, the same reads work.
    ex, _ = _sh(iso, f"tr '\\0' '\\n' < /proc/{target}/environ | grep SANDBOX_ONLY_SECRET")
    assert _text(ex) == "SANDBOX_ONLY_SECRET=s3"
    from opensandbox.models.isolated import IsolatedRunOpts
    with iso.isolation.session(_req(workspace="/workspace")) as a, \
            iso.isolation.session(_req(workspace="/workspace")) as b:
        for s in (a, b):
            out = _text(s.run(
                f"cat /proc/{target}/environ 2>&1 >/dev/null; echo rc=$?; "
                f"ls /proc/{target}/root/ 2>&1 >/dev/null; echo rc=$?; "
                f"echo x > /proc/{target}/root/tmp/escaped 2>&1; echo rc=$?; "
                f"kill -9 {target} 2>&1; echo rc=$?"))
            assert "rc=0" not in out, out
        ex, _ = _sh(iso, "test -e /tmp/escaped && echo escaped || echo kept")
        assert _text(ex) == "kept"
        # Session a's own processes are closed to session b the same way.
        a.run_background("A_SESSION_SECRET=a1 sleep 601")
        other = _wait_pid(b.run, "sleep 601")
        out = _text(b.run(f"cat /proc/{other}/environ 2>&1 >/dev/null; echo rc=$?; "
                          f"ls /proc/{other}/root/workspace 2>&1 >/dev/null; echo rc=$?"))
        assert "rc=0" not in out, out
        # And their files are their own.
        a.run("echo a > /workspace/only-a; echo a > /tmp/only-a")
        assert _text(b.run("ls /workspace/only-a /tmp/only-a 2>/dev/null | wc -l")) == "0"
    iso.commands.run(f"kill {target}")


def test_sessions_leave_nothing_behind(iso):
    def session_processes():
        ex = iso.commands.run("ps -eo pid=,comm=,args=")
        return [l for l in _text(ex).splitlines()
                if "session-init" in l or "sleep 602" in l or "--noprofile" in l]
    before = session_processes()
    for _ in range(3):
        s = iso.isolation.create(_req(workspace="/workspace"))
        s.run_background("sleep 602")
        s.run("echo hi")
        s.delete()
    for _ in range(50):
        left = session_processes()
        if left == before:
            break
        time.sleep(0.1)
    assert left == before, left
    # Every ended runner is collected by the helper (no zombies).
    for _ in range(30):
        zombies = [l for l in _text(iso.commands.run("ps -eo stat=,comm=")).splitlines() if l.startswith("Z")]
        if not zombies:
            break
        time.sleep(0.1)
    assert not zombies, zombies


def test_idle_sessions_are_collected(iso):
    s = iso.isolation.create(_req(workspace="/workspace", idle_timeout_seconds=1))
    assert s.get().idle_remaining_seconds is not None
    from opensandbox.exceptions import SandboxApiException
    for _ in range(50):
        try:
            s.get()
        except SandboxApiException as e:
            assert e.status_code == 404
            break
        time.sleep(0.2)
    else:
        raise AssertionError("idle session not collected")


def test_async_sdk(iso, server):
    import asyncio
    from opensandbox import Sandbox
    from opensandbox.models.isolated import CreateIsolatedSessionRequest, IsolatedWorkspaceSpec

    async def go():
        sbx = await Sandbox.connect(iso.id, connection_config=server.sdk_async_config())
        try:
            caps = await sbx.isolation.capabilities()
            assert caps.available
            s = await sbx.isolation.create(CreateIsolatedSessionRequest(
                workspace=IsolatedWorkspaceSpec(path="/workspace")))
            ex = await s.run("echo async")
            assert [m.text for m in ex.logs.stdout] == ["async"]
            run = await s.run_background("echo bg")
            for _ in range(50):
                st = await s.run_status(run.run_id)
                if not st.running:
                    break
                await asyncio.sleep(0.1)
            assert st.exit_code == 0 and (await s.run_logs(run.run_id)).text == "bg\n"
            await s.delete()
        finally:
            await sbx.close()

    asyncio.run(go())


def test_other_runtimes_say_why(server, make_sandbox):
    """Runtimes without the isolation helper (runc, gVisor, Docker) take the extension and answer
    as the reference does without its isolation runner: available false, and why."""
    if server.caps.isolated_sessions:
        pytest.skip("this runtime offers isolated sessions (isolatedSessions)")
    sbx = make_sandbox("host", extensions=ISOLATION)
    caps = sbx.isolation.capabilities()
    assert caps.available is False and "embedded runtime" in caps.message, caps
    from opensandbox.exceptions import SandboxApiException
    with pytest.raises(SandboxApiException) as e:
        sbx.isolation.create(_req(workspace="/workspace"))
    assert e.value.status_code == 503


def test_pools_keep_the_extension_apart(server, api):
    """A pool whose template asks for isolated sessions makes sandboxes that have them; a create
    asking for them is never handed a warm sandbox without (and a poolRef to such a pool is
    refused, not silently served)."""
    server.require("isolatedSessions", "isolated sessions are offered by the embedded runtime")
    server.require_image_store("the pools' template is on the built-in host image")
    marker = uuid.uuid4().hex
    plain, isolated = f"e2e-plain-{marker[:6]}", f"e2e-iso-{marker[:6]}"
    template = W.create_body("host")
    template["env"] = {"E2E_POOL": marker}
    cap = {"bufferMin": 1, "bufferMax": 1, "poolMin": 0, "poolMax": 3}
    for name, ext in ((plain, {}), (isolated, ISOLATION)):
        r = api.post("/v1/pools", json={"name": name, "capacitySpec": cap,
                                        "template": {**template, "extensions": ext}})
        assert r.status_code == 201, r.text
    try:
        for name in (plain, isolated):
            W.wait_until(lambda n=name: api.get(f"/v1/pools/{n}").json()["status"]["available"] >= 1,
                         120, interval=0.1, message=f"pool {name} warm")
        r = api.post("/v1/sandboxes", json={**template, "extensions": {"poolRef": plain, **ISOLATION}})
        W.assert_error_body(r, codes=[400])
        from opensandbox import SandboxSync
        for ext, pool_name, available in (({}, plain, False), (ISOLATION, isolated, True)):
            r = api.post("/v1/sandboxes", json={**template, "extensions": ext})
            assert r.status_code in (200, 202), r.text
            sid = r.json()["id"]
            W.track_sandbox(sid)
            sbx = SandboxSync.connect(sid, connection_config=server.sdk_config())
            try:
                assert sbx.isolation.capabilities().available is available
            finally:
                sbx.kill()
                sbx.close()
    finally:
        for name in (plain, isolated):
            api.delete(f"/v1/pools/{name}")


def _iso_sandbox(server):
    from opensandbox import SandboxSync
    from datetime import timedelta
    sbx = SandboxSync.create(server.sandbox_image("host"), connection_config=server.sdk_config(),
                             timeout=timedelta(minutes=5), extensions=ISOLATION,
                             entrypoint=["sleep", "infinity"])
    W.track_sandbox(sbx.id)
    return sbx


def test_the_helper_is_beyond_the_sandboxs_reach(server):
    """Sandbox root used to see its isolation helper (a process of its own user)
    and could stop or kill it, which hung every session. The helper now lives in the host's PID
    namespace: the sandbox cannot name it; killing every process the sandbox can see ends its
    sessions with an error, never a hang, and new sessions are made as before."""
    server.require("isolatedSessions", "isolated sessions are offered by the embedded runtime")
    from opensandbox.models.isolated import IsolatedRunOpts
    sbx = _iso_sandbox(server)
    try:
        session = sbx.isolation.session(_req(workspace="/workspace"))
        s = session.__enter__()
        assert _text(s.run("echo before")) == "before"
        _, comms = _sh(sbx, "cat /proc/[0-9]*/comm")
        assert "warren-isolate" not in comms.split(), comms
        # Stop, then kill, everything the sandbox's root may signal but PID 1, itself and the
        # entrypoint (whose end is the sandbox's).
        every = ("for p in /proc/[0-9]*; do n=${p#/proc/}; [ $n = 1 ] || [ $n = $$ ] && continue; "
                 "[ \"$(cat $p/comm 2>/dev/null)\" = sleep ] && continue; kill -%s $n 2>/dev/null; done")
        _sh(sbx, f"{every % 'STOP'}; sleep 0.2; {every % 'KILL'}; echo done")
        t0 = time.monotonic()
        try:
            ex = s.run("echo after", opts=IsolatedRunOpts(timeout_seconds=5))
            assert ex.error is not None, "a session whose processes were killed still ran"
        except AssertionError:
            raise
        except Exception:  # noqa: BLE001 - the SDK raises for a session that has gone
            pass
        assert time.monotonic() - t0 < 30, "the session hung"
        with sbx.isolation.session(_req(workspace="/workspace")) as fresh:
            assert _text(fresh.run("echo alive")) == "alive"
        try:
            session.__exit__(None, None, None)
        except Exception:  # noqa: BLE001 - it is gone already
            pass
    finally:
        sbx.kill()


def test_here_documents_run_in_sessions(iso):
    """A run whose code holds a here-document (quoted or not, unterminated,
    larger than a pipe, with envs) finishes, and the shell takes the next run."""
    from opensandbox.models.isolated import IsolatedRunOpts
    big = "a" * 200_000
    cases = [
        ("cat <<EOF\nhello $PLAIN_VAR\nEOF", "hello plain"),
        ("cat <<'EOF'\nit's $PLAIN_VAR\nEOF\n", "it's $PLAIN_VAR"),
        ("cat <<-EOF\n\tindented\n\tEOF", "indented"),
        (f"wc -c <<'EOF'\n{big}\nEOF", str(len(big) + 1)),
        ("python3 - <<'PY'\nprint(6 * 7)\nPY", "42"),
        ("read line; echo \"[$line]\"", "[]"),
    ]
    with iso.isolation.session(_req(workspace="/workspace")) as s:
        for code, want in cases:
            for opts in (IsolatedRunOpts(timeout_seconds=20), IsolatedRunOpts(timeout_seconds=20, envs={"X": "1"})):
                ex = s.run(code, opts=opts)
                assert ex.error is None and _text(ex).splitlines()[-1] == want, (code[:40], ex.logs, ex.error)
        assert _text(s.run("echo next")) == "next"
    sid = iso.commands.create_session()
    try:
        for code, want in cases:
            ex = iso.commands.run_in_session(sid, code)
            assert _text(ex).splitlines()[-1] == want, (code[:40], ex.logs, ex.error)
    finally:
        iso.commands.delete_session(sid)


def test_session_files_workers_hold_nothing_of_the_host(iso, server):
    """A session's files worker (forked by the helper's runner, not an exec of
    the host's binary), kept alive by a slow download, shows neither the sandbox's root nor the
    session's code anything through /proc/<worker>/."""
    from opensandbox.models.filesystem import WriteEntry
    probe = (
        "import os, json\n"
        "out = {}\n"
        "for pid in os.listdir('/proc'):\n"
        "    if not pid.isdigit(): continue\n"
        "    try: comm = open(f'/proc/{pid}/comm').read().strip()\n"
        "    except OSError: continue\n"
        "    if comm != 'files-worker': continue\n"
        "    e = {}\n"
        "    for what in ('exe', 'cwd', 'root'):\n"
        "        try: e[what] = os.readlink(f'/proc/{pid}/{what}')\n"
        "        except OSError as x: e[what] = f'ERR {x.errno}'\n"
        "    for what in ('environ', 'maps'):\n"
        "        try: e[what] = len(open(f'/proc/{pid}/{what}', 'rb').read())\n"
        "        except OSError as x: e[what] = f'ERR {x.errno}'\n"
        "    try: e['fd_links'] = [os.readlink(f'/proc/{pid}/fd/{n}') for n in os.listdir(f'/proc/{pid}/fd')]\n"
        "    except OSError as x: e['fd_links'] = f'ERR {x.errno}'\n"
        "    out[pid] = e\n"
        "print(json.dumps(out))\n"
    )
    import json
    iso.files.write_files([WriteEntry(path="/workspace/worker-probe.py", data=probe, mode=644)])
    with iso.isolation.session(_req(workspace="/workspace")) as s:
        s.run("truncate -s 4G /workspace/big")
        url = (f"/sandboxes/{iso.id}/proxy/44772/v1/isolated/session/{s.session_id}"
               f"/files/download?path=/workspace/big")
        with server.client() as api, httpx.Client(base_url=api.base_url, headers=api.headers, timeout=60) as c:
            with c.stream("GET", url) as r:
                assert r.status_code == 200, r.read()[:300]
                reader = r.iter_raw(1024)
                next(reader)
                seen_by_sandbox = json.loads(_sh(iso, "python3 /workspace/worker-probe.py")[1])
                seen_by_session = json.loads(_text(s.run("python3 /workspace/worker-probe.py")))
        assert seen_by_sandbox, "the worker did not show up"
        for who, seen in (("sandbox", seen_by_sandbox), ("session", seen_by_session)):
            for pid, e in seen.items():
                for what, v in e.items():
                    assert str(v).startswith("ERR"), f"{who}: /proc/{pid}/{what} = {v}"


def _host_descriptors_of(sandbox_id: str) -> dict[int, tuple[str, list[str]]]:
    """From the host: every process in the sandbox's cgroup, its name and where each of its
    descriptors leads, as host root reads them."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cgroup") as f:
                if f"/{sandbox_id}" not in f.read():
                    continue
            fds = os.listdir(f"/proc/{entry}/fd")
            with open(f"/proc/{entry}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue  # ended meanwhile
        links = []
        for n in fds:
            try:
                links.append(os.readlink(f"/proc/{entry}/fd/{n}"))
            except OSError:
                continue  # closed meanwhile (execd's connections come and go): not the process
        out[int(entry)] = (comm, links)
    return out


def test_no_process_of_the_sandbox_holds_a_host_descriptor(server, work_root):
    """Execd, its forker and workers, the isolation
    helper, a session's keeper, init, runner and shell, a background run — none holds a
    descriptor of a host file (the sandbox's log on the host, the data dir, Warren's binary):
    read from the host, while all of them are alive."""
    server.require("isolatedSessions", "isolated sessions are offered by the embedded runtime")
    sbx = _iso_sandbox(server)
    try:
        with sbx.isolation.session(_req(workspace="/workspace")) as s:
            s.run("truncate -s 1G /workspace/big")
            s.run_background("sleep 30")
            url = (f"/sandboxes/{sbx.id}/proxy/44772/v1/isolated/session/{s.session_id}"
                   f"/files/download?path=/workspace/big")
            with server.client() as api, httpx.Client(base_url=api.base_url, headers=api.headers, timeout=60) as c:
                with c.stream("GET", url) as r:
                    assert r.status_code == 200
                    reader = r.iter_raw(1024)
                    next(reader)
                    seen = _host_descriptors_of(sbx.id)
        comms = {pid: comm for pid, (comm, _) in seen.items()}
        assert {"execd", "execd-forker", "warren-isolate", "session-keeper", "session-init",
                "files-worker"} <= set(comms.values()), comms
        host_paths = [str(server.data_dir.resolve()), str(Path(work_root).resolve()), str(server.bin.resolve())]
        for pid, (_, links) in seen.items():
            for link in links:
                assert not any(link.startswith(h) for h in host_paths), \
                    f"{comms.get(pid)} ({pid}) holds {link}"
    finally:
        sbx.kill()
