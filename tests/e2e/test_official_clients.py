"""Official OpenSandbox clients other than the Python SDK against Warren: the `osb`
CLI (PyPI `opensandbox-cli==1.1.1`), the MCP server (`opensandbox-mcp==1.1.1`) and the TypeScript SDK
(npm `@alibaba-group/opensandbox`, installed by scripts/install-deps) — create, run, files, kill.
Runs on the first runtime of the session only: it tests the client path, not the runtime."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from opensandbox.exceptions import SandboxApiException

import warren_e2e as W


@pytest.fixture
def osb(server, tmp_path):
    server.run_once("client smoke tests: the client path, not the runtime")
    exe = Path(sys.executable).with_name("osb")
    if not exe.exists():
        exe = shutil.which("osb")
        if not exe:
            pytest.fail("osb not found: scripts/install-deps installs opensandbox-cli==1.1.1 into the venv")
    # a private HOME: osb keeps its config there
    env = dict(os.environ, HOME=str(tmp_path), NO_COLOR="1")

    def run(*args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        cmd = [str(exe), "--domain", server.domain, "--api-key", server.api_key, "--no-color", *args]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, input=input)
        if check and res.returncode != 0:
            raise AssertionError(f"{args}: exit {res.returncode}\n{res.stdout}\n{res.stderr}")
        return res

    return run


def test_osb_create_run_files_kill(server, osb, tmp_path):
    created = json.loads(osb("sandbox", "create", "-i", server.sandbox_image("host"), "-t", "10m",
                             "-e", "FROM_OSB=yes", "-o", "json").stdout)
    sid = created["id"]
    W.track_sandbox(sid)
    try:
        info = json.loads(osb("sandbox", "get", sid, "-o", "json").stdout)
        assert info["status"]["state"] == "Running"
        assert sid in osb("sandbox", "list", "-o", "json").stdout

        out = osb("command", "run", sid, "--", "sh", "-c", "echo hello $FROM_OSB").stdout
        assert "hello yes" in out
        failed = osb("command", "run", sid, "--", "sh", "-c", "exit 3", check=False)
        assert failed.returncode != 0 and "3" in failed.stderr

        local = tmp_path / "up.txt"
        local.write_text("uploaded by osb\n")
        osb("file", "upload", sid, str(local), "/tmp/up.txt")
        assert osb("file", "cat", sid, "/tmp/up.txt").stdout == "uploaded by osb\n"
        osb("file", "write", sid, "/tmp/w.txt", "-c", "written")
        assert osb("file", "cat", sid, "/tmp/w.txt").stdout.strip() == "written"
        osb("file", "download", sid, "/tmp/w.txt", str(tmp_path / "down.txt"))
        assert (tmp_path / "down.txt").read_text().strip() == "written"
    finally:
        osb("sandbox", "kill", sid, check=False)
    with server.client() as c:
        assert c.get(f"/v1/sandboxes/{sid}").status_code == 404, "a deleted sandbox is gone at once"


def test_osb_unknown_sandbox_fails_clearly(osb):
    res = osb("sandbox", "get", "no-such-sandbox-e2e", check=False)
    assert res.returncode != 0
    assert "no-such-sandbox-e2e" in (res.stdout + res.stderr)


def test_opensandbox_mcp_over_stdio(server, osb):
    """The official MCP server (PyPI `opensandbox-mcp==1.1.1`) driven by the MCP SDK's own stdio client:
    create, run a command, write and read a file, kill."""
    import asyncio

    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    exe = Path(sys.executable).with_name("opensandbox-mcp")
    params = StdioServerParameters(command=str(exe), args=[
        "--transport", "stdio", "--domain", server.domain, "--api-key", server.api_key])

    async def session():
        async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
            await s.initialize()
            names = {t.name for t in (await s.list_tools()).tools}
            assert {"sandbox_create", "command_run", "file_write", "file_read", "sandbox_kill"} <= names

            async def call(tool, **args):
                res = await s.call_tool(tool, args)
                assert not res.is_error, f"{tool}: {[c.text for c in res.content]}"
                return res.structured_content or {}

            created = await call("sandbox_create", image=server.sandbox_image("host"), timeout_seconds=600)
            sid = created["sandbox_id"]
            W.track_sandbox(sid)
            try:
                ran = await call("command_run", sandbox_id=sid, command="echo from-mcp")
                assert "from-mcp" in json.dumps(ran)
                # framed as the reference frames it: a line per event, a blank line as "\n", the
                # last line without its terminator
                ran = await call("command_run", sandbox_id=sid, command="printf 'a\\nb\\n\\nc'")
                assert [m["text"] for m in ran["logs"]["stdout"]] == ["a", "b", "\n", "c"], ran
                await call("file_write", sandbox_id=sid, path="/tmp/mcp.txt", content="mcp wrote this")
                read = await call("file_read", sandbox_id=sid, path="/tmp/mcp.txt")
                assert "mcp wrote this" in json.dumps(read)
                info = await call("sandbox_get_info", sandbox_id=sid)
                assert "Running" in json.dumps(info)
            finally:
                await call("sandbox_kill", sandbox_id=sid)
            return sid

    sid = asyncio.run(session())
    with server.client() as c:
        assert c.get(f"/v1/sandboxes/{sid}").status_code == 404, "a deleted sandbox is gone at once"


def test_typescript_sdk(server, osb, tmp_path):
    sdk_dir = Path(os.environ.get("WARREN_TS_SDK_DIR", W.REPO_ROOT / ".ci" / "cache" / "ts-sdk"))
    if not (sdk_dir / "node_modules" / "@alibaba-group" / "opensandbox").is_dir() or not shutil.which("node"):
        pytest.fail(f"the TypeScript SDK is not installed in {sdk_dir} (scripts/install-deps installs it)")
    # ESM resolves packages from the script's folder: run a copy placed next to node_modules
    script = sdk_dir / "smoke.mjs"
    shutil.copy(Path(__file__).parent / "ts" / "smoke.mjs", script)
    isolation = ["isolation"] if server.caps.isolated_sessions else []
    res = subprocess.run(["node", str(script), server.domain, server.api_key, server.sandbox_image("host"),
                          *isolation], capture_output=True, text=True, timeout=120, cwd=sdk_dir)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    out = json.loads(res.stdout.strip().splitlines()[-1])
    W.track_sandbox(out["id"])
    assert out["state"] == "Running" and out["stdout"] == "hello-from-ts" and out["content"] == "written by ts"
    if isolation:
        text, pid = out["isolated"]
        assert text == "from-ts" and int(pid) <= 2, out["isolated"]
    with server.client() as c:
        assert c.get(f"/v1/sandboxes/{out['id']}").status_code == 404, "a deleted sandbox is gone at once"


def test_diagnostics_with_the_sdk_and_osb(server, osb, make_sandbox, manager):
    """The diagnostics API the 1.1.1 clients call: logs (`container`: what the entrypoint
    printed) and events (`runtime`: the sandbox's state changes) through the SDK's manager and
    `osb diagnostics`, an unknown scope refused with its code, and the deprecated plain-text forms
    `osb devops` reads (logs, events, inspect without secrets, summary)."""
    from opensandbox.exceptions import SandboxException
    sbx = make_sandbox("host", entrypoint=["sh", "-c", "echo entry-started; echo entry-err >&2; exec tail -f /dev/null"],
                       env={"E2E_DIAG_SECRET": "do-not-show"})
    sid = sbx.id
    logs = W.wait_until(lambda: (c := manager.get_diagnostic_logs(sid, scope="container"))
                        and "entry-started" in (c.content or "") and c, 10, interval=0.2,
                        message="the entrypoint's output in the diagnostic logs")
    assert logs.kind == "logs" and logs.scope == "container" and logs.delivery == "inline"
    assert "entry-err" in logs.content and logs.truncated is False
    events = manager.get_diagnostic_events(sid, scope="runtime")
    assert events.kind == "events" and events.delivery == "inline"
    states = [line.split()[1] for line in events.content.splitlines()]
    assert states[:2] == ["Pending", "Running"], events.content
    everything = manager.get_diagnostic_logs(sid, scope="all")
    assert "entry-started" in everything.content and "Running" in everything.content
    with pytest.raises(SandboxException) as err:
        manager.get_diagnostic_logs(sid, scope="kernel")
    assert "DIAGNOSTICS_SCOPE_UNSUPPORTED" in str(err.value) or "supported scopes" in str(err.value)

    manager.pause_sandbox(sid)
    paused = manager.get_diagnostic_logs(sid, scope="container")
    assert paused.content == "" and any("Paused" in w for w in paused.warnings or []), paused
    assert "Paused" in manager.get_diagnostic_events(sid, scope="runtime").content
    manager.resume_sandbox(sid)

    out = osb("diagnostics", "logs", sid, "--scope", "container").stdout
    assert "entry-started" in out
    out = osb("diagnostics", "events", sid, "--scope", "runtime", "-o", "json").stdout
    assert json.loads(out)["kind"] == "events"
    # the deprecated plain-text forms
    assert "entry-started" in osb("devops", "logs", sid, "--tail", "5").stdout
    assert "Resuming" in osb("devops", "events", sid).stdout
    inspect = osb("devops", "inspect", sid).stdout
    assert sid in inspect and "E2E_DIAG_SECRET" in inspect and "do-not-show" not in inspect
    assert sbx.get_info().status.state == "Running"
    summary = osb("devops", "summary", sid).stdout
    assert "SANDBOX DIAGNOSTICS SUMMARY" in summary and "entry-started" in summary
    missing = osb("diagnostics", "logs", "no-such-sandbox", "--scope", "container", check=False)
    assert missing.returncode != 0


def test_isolation_api_answers_unavailable_as_the_reference_does(make_sandbox):
    """The 1.1.1 SDK's `sandbox.isolation` (the `/v1/isolated/…` routes): Warren's sandboxes refuse
    nested namespaces and mounts to everything in them, so capabilities say isolation is unavailable
    and why, and the session routes answer 503 SERVICE_UNAVAILABLE — as the reference answers in a
    sandbox without its isolation runner — instead of 404s the SDK cannot read."""
    sbx = make_sandbox("host")
    caps = sbx.isolation.capabilities()
    assert caps.available is False and caps.message, caps
    assert caps.commit_supported is False and caps.diff_supported is False, caps
    for attempt in (lambda: sbx.isolation.list(),
                    lambda: sbx.isolation.run_once("echo hi", workspace="/tmp")):
        with pytest.raises(SandboxApiException) as e:
            attempt()
        assert e.value.status_code == 503 and "SERVICE_UNAVAILABLE" in str(e.value), e.value
