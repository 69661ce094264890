"""`warren mcp`: Warren's own MCP server, built on rmcp, driven by the official MCP
Python SDK's clients over stdio and over streamable HTTP. Tools work end to end; a failing call is a
tool error (isError) and the server keeps serving. Runs on the first runtime only: it tests the
client path, not the runtime."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import subprocess
import time

import pytest

import warren_e2e as W

TOOLS = {
    "sandbox_create", "sandbox_kill", "sandbox_get_info", "sandbox_list", "sandbox_renew",
    "sandbox_get_metrics", "sandbox_healthcheck", "sandbox_get_endpoint", "command_run",
    "command_status", "command_logs", "command_interrupt", "file_read", "file_write", "file_delete",
    "file_search", "file_create_directories", "file_delete_directories", "file_move",
    "file_replace_contents", "code_run",
}


@pytest.fixture
def mcp_args(server):
    server.run_once("client tests: the client path, not the runtime")
    return ["mcp", "--domain", server.domain, "--api-key", server.api_key]


async def exercise(session, server) -> str:
    """The tool walk-through shared by both transports; returns the sandbox id (deleted)."""
    names = {t.name for t in (await session.list_tools()).tools}
    assert TOOLS <= names, TOOLS - names

    async def call(tool, **args):
        res = await session.call_tool(tool, args)
        assert not res.is_error, f"{tool}: {[c.text for c in res.content]}"
        return res.structured_content if res.structured_content is not None else res.content[0].text

    async def fails(tool, **args) -> str:
        res = await session.call_tool(tool, args)
        assert res.is_error, f"{tool} should have failed: {res}"
        return res.content[0].text

    created = await call("sandbox_create", image=server.sandbox_image("host"), timeout_seconds=600,
                         env={"FROM_MCP": "yes"}, metadata={"via": "warren-mcp"})
    sid = created["sandbox_id"]
    W.track_sandbox(sid)
    assert created["status"]["state"] == "Running"
    try:
        ran = await call("command_run", sandbox_id=sid, command="echo hi $FROM_MCP; echo oops >&2; exit 4")
        assert (ran["stdout"], ran["stderr"], ran["exit_code"]) == ("hi yes\n", "oops\n", 4)
        bg = await call("command_run", sandbox_id=sid, command="echo bg; sleep 600", background=True)
        st = await call("command_status", sandbox_id=sid, execution_id=bg["execution_id"])
        assert st["running"] is True
        await call("command_interrupt", sandbox_id=sid, execution_id=bg["execution_id"])

        await call("file_write", sandbox_id=sid, path="/tmp/m/a.txt", content="one two one\n", mode=600)
        assert await call("file_read", sandbox_id=sid, path="/tmp/m/a.txt") == "one two one\n"
        blob = bytes(range(256))
        await call("file_write", sandbox_id=sid, path="/tmp/m/b.bin",
                   content=base64.b64encode(blob).decode(), encoding="base64")
        got = await call("file_read", sandbox_id=sid, path="/tmp/m/b.bin", encoding="base64")
        assert base64.b64decode(got) == blob
        assert "base64" in await fails("file_read", sandbox_id=sid, path="/tmp/m/b.bin")
        counts = await call("file_replace_contents", sandbox_id=sid,
                            entries=[{"path": "/tmp/m/a.txt", "old": "one", "new": "1"}])
        assert counts == {"/tmp/m/a.txt": 2}
        await call("file_create_directories", sandbox_id=sid, paths=["/tmp/m/d"])
        await call("file_move", sandbox_id=sid, entries=[{"src": "/tmp/m/a.txt", "dest": "/tmp/m/d/a.txt"}])
        found = await call("file_search", sandbox_id=sid, path="/tmp/m", pattern="**/*.txt")
        assert [f["path"] for f in found["files"]] == ["/tmp/m/d/a.txt"]
        await call("file_delete", sandbox_id=sid, paths=["/tmp/m/d/a.txt"])
        await call("file_delete_directories", sandbox_id=sid, paths=["/tmp/m"])

        listed = await call("sandbox_list", metadata={"via": "warren-mcp"}, states=["Running"])
        assert [s["id"] for s in listed["sandboxes"]] == [sid]
        assert (await call("sandbox_healthcheck", sandbox_id=sid))["healthy"] is True
        assert (await call("sandbox_get_metrics", sandbox_id=sid))["cpu_count"] > 0
        ep = await call("sandbox_get_endpoint", sandbox_id=sid, port=8000)
        assert ep["endpoint"].endswith("/proxy/8000")
        assert "expires_at" in await call("sandbox_renew", sandbox_id=sid, timeout_seconds=1200)

        # Failures are tool errors, and the server goes on serving.
        assert "no-such-sandbox" in await fails("sandbox_get_info", sandbox_id="no-such-sandbox")
        assert await fails("code_run", sandbox_id=sid, code="1+1", language="cobol")
        assert await fails("sandbox_list", states=["Sleeping"])
        assert (await call("sandbox_get_info", sandbox_id=sid))["status"]["state"] == "Running"
    finally:
        await call("sandbox_kill", sandbox_id=sid)
    assert "deleting" in await fails("sandbox_kill", sandbox_id=sid)
    return sid


def test_warren_mcp_over_stdio(server, mcp_args):
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(command=str(W.warren_bin()), args=mcp_args)

    async def run():
        async with stdio_client(params) as (r, w), ClientSession(r, w) as s:
            await s.initialize()
            return await exercise(s, server)

    sid = asyncio.run(run())
    with server.client() as c:
        assert c.get(f"/v1/sandboxes/{sid}").status_code == 404, "a deleted sandbox is gone at once"


def test_warren_mcp_over_streamable_http(server, mcp_args):
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(W.warren_bin()), *mcp_args, "--transport", "streamable-http",
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.stderr else ""
                time.sleep(0.05)

        async def run():
            async with streamable_http_client(f"http://127.0.0.1:{port}/mcp") as streams, \
                    ClientSession(streams[0], streams[1]) as s:
                await s.initialize()
                return await exercise(s, server)

        asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_warren_mcp_refuses_non_loopback_http(mcp_args):
    res = subprocess.run([str(W.warren_bin()), *mcp_args, "--transport", "streamable-http",
                          "--host", "0.0.0.0"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 1
    assert "loopback" in res.stderr and len(res.stderr.strip().splitlines()) == 1
