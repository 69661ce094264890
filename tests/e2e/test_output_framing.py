"""Command output reaches the official SDK framed exactly as the reference execd frames it.

One event per line with its terminator (`\\n`, `\\r`, `\\r\\n`) removed, an empty line as `"\\n"`, the
last line without a terminator sent when the command ends, never a piece of a line because the
command paused mid-line; lines longer than 256 KiB arrive in 256 KiB pieces (the reference holds
them whole; Warren bounds what one event can hold). Background logs keep the bytes as written.
Checked for foreground commands (sync and async SDK), sessions and background logs.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from opensandbox.models.execd import RunCommandOpts

import warren_e2e as W

PIECE = 256 * 1024

# (shell producing stdout, the stdout events the reference sends for it)
CASES = [
    ("printf 'a\\nb\\n'", ["a", "b"]),
    ("printf 'a\\n\\n\\nb\\n'", ["a", "\n", "\n", "b"]),
    ("printf '\\n'", ["\n"]),
    ("printf 'a\\rb\\r'", ["a", "b"]),
    ("printf 'a\\r\\nb\\r\\n\\r\\n'", ["a", "b", "\n"]),
    ("printf 'a\\r\\rb\\n'", ["a", "\n", "b"]),
    ("printf 'first\\nlast'", ["first", "last"]),
    ("printf 'no terminator at all'", ["no terminator at all"]),
    # a pause mid-line, and between \r and \n, must not split the line or make an empty one
    ("printf 'par'; sleep 0.4; printf 'tial\\n'", ["partial"]),
    ("printf 'x\\r'; sleep 0.4; printf '\\ny\\n'", ["x", "y"]),
    ("printf 'caf\\303\\251 \\342\\234\\223\\n'", ["café ✓"]),
    # bytes that are not UTF-8 arrive replaced, the rest of the line intact
    ("printf '\\377\\376ok\\n'", ["\ufffd\ufffdok"]),
    ("", []),
]


def texts(messages) -> list[str]:
    return [m.text for m in messages]


@pytest.mark.parametrize("script,events", CASES, ids=[repr(c[0])[:40] for c in CASES])
def test_foreground_lines(host_sandbox, script, events):
    ex = host_sandbox.commands.run(script or "true")
    assert ex.exit_code == 0
    assert texts(ex.logs.stdout) == events
    assert ex.logs.stderr == []


def test_stdout_and_stderr_are_framed_apart(host_sandbox):
    ex = host_sandbox.commands.run("printf 'o1\\ne1' >&2; printf 'o2\\n'; printf 'tail' >&2; exit 3")
    assert ex.exit_code == 3
    assert texts(ex.logs.stdout) == ["o2"]
    assert texts(ex.logs.stderr) == ["o1", "e1tail"]


def test_long_lines_come_in_pieces(host_sandbox):
    n = 2 * PIECE + 1000
    ex = host_sandbox.commands.run(f"head -c {n} /dev/zero | tr '\\0' x; echo; echo after")
    assert ex.exit_code == 0
    got = texts(ex.logs.stdout)
    assert [len(t) for t in got] == [PIECE, PIECE, 1000, 5]
    assert "".join(got[:3]) == "x" * n and got[3] == "after"


def test_long_multibyte_lines_split_on_character_boundaries(host_sandbox):
    # 'é' is two bytes: a cut by bytes alone would leave a replacement character at each seam
    n = PIECE  # characters, so 2 * PIECE bytes
    ex = host_sandbox.commands.run(f"yes é | head -n {n} | tr -d '\\n'; echo")
    assert ex.exit_code == 0
    got = texts(ex.logs.stdout)
    assert "\ufffd" not in "".join(got)
    assert "".join(got) == "é" * n
    assert all(len(t.encode()) <= PIECE for t in got) and len(got) >= 2


def test_many_lines_arrive_in_order(host_sandbox):
    ex = host_sandbox.commands.run("seq 1 20000")
    assert texts(ex.logs.stdout) == [str(i) for i in range(1, 20001)]


def test_session_runs_are_framed_the_same(host_sandbox):
    cmds = host_sandbox.commands
    sid = cmds.create_session()
    try:
        ex = cmds.run_in_session(sid, "printf 'a\\r\\n\\nb\\rc'; printf 'err' >&2")
        assert texts(ex.logs.stdout) == ["a", "\n", "b", "c"]
        assert texts(ex.logs.stderr) == ["err"]
        # a run that ends mid-line must not leak its last line into the next run
        ex = cmds.run_in_session(sid, "printf 'half'")
        assert texts(ex.logs.stdout) == ["half"]
        ex = cmds.run_in_session(sid, "echo next")
        assert texts(ex.logs.stdout) == ["next"]
    finally:
        cmds.delete_session(sid)


def test_background_logs_keep_the_bytes(host_sandbox):
    raw = "a\r\nb\rc\n\n\nlast"
    ex = host_sandbox.commands.run("printf 'a\\r\\nb\\rc\\n\\n\\nlast'", opts=RunCommandOpts(background=True))
    W.wait_until(lambda: not host_sandbox.commands.get_command_status(ex.id).running, 15,
                 interval=0.2, message="background command to finish")
    logs = host_sandbox.commands.get_background_command_logs(ex.id)
    assert logs.content == raw


def test_async_sdk_sees_the_same_lines(server):
    from opensandbox import Sandbox

    async def main():
        sbx = await Sandbox.create(server.sandbox_image("host"), connection_config=server.sdk_async_config(),
                                   timeout=timedelta(minutes=5))
        W.track_sandbox(sbx.id)
        try:
            ex = await sbx.commands.run("printf 'a\\n\\nb\\r\\nlast'")
            assert texts(ex.logs.stdout) == ["a", "\n", "b", "last"]
        finally:
            await sbx.kill()
            await sbx.close()

    asyncio.run(main())
