"""Commands and sessions through the official SDK: output (streamed, in order, large, binary),
exit codes, background commands and their logs, interrupts and timeouts, env, cwd and identity,
and bash sessions that keep their state and are isolated from one another."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from opensandbox.exceptions import SandboxException
from opensandbox.models.execd import RunCommandOpts
from opensandbox.models.execd_sync import ExecutionHandlersSync

import warren_e2e as W

sh = W.sh


def test_stdout(host_sandbox):
    ex = host_sandbox.commands.run("echo hello; echo world")
    assert ex.exit_code == 0
    assert ex.error is None
    assert ex.complete is not None
    assert ex.id, "the init event should carry an execution id"
    assert ex.text == "hello\nworld"


def test_stderr(host_sandbox):
    code, out, err = sh(host_sandbox, "echo to-out; echo to-err >&2")
    assert code == 0
    assert out.strip() == "to-out"
    assert err.strip() == "to-err"


@pytest.mark.parametrize("status", [1, 3, 42, 255])
def test_nonzero_exit_code(host_sandbox, status):
    ex = host_sandbox.commands.run(f"echo before; exit {status}")
    assert ex.exit_code == status
    assert ex.error is not None
    assert ex.error.value == str(status)
    assert ex.complete is None
    assert ex.text == "before"


def test_command_not_found(host_sandbox):
    code, _, err = sh(host_sandbox, "definitely-not-a-command-e2e")
    assert code == 127
    assert "not found" in err


def test_large_output(host_sandbox):
    code, out, _ = sh(host_sandbox, "seq 1 200000")
    assert code == 0
    lines = out.split()
    assert len(lines) == 200000 and lines[0] == "1" and lines[-1] == "200000"


def test_binaryish_and_unicode_output(host_sandbox):
    code, out, _ = sh(host_sandbox, "printf 'caf\\xc3\\xa9 \\xe2\\x9c\\x93\\n'")
    assert code == 0
    assert out.strip() == "café ✓"


def test_streaming_in_order_and_early(host_sandbox):
    chunks: list[tuple[float, str]] = []

    def on_stdout(msg):
        chunks.append((time.monotonic(), msg.text))

    t0 = time.monotonic()
    ex = host_sandbox.commands.run(
        "echo first; sleep 2; for i in 1 2 3 4 5; do echo line$i; sleep 0.1; done; echo last",
        handlers=ExecutionHandlersSync(on_stdout=on_stdout))
    t_end = time.monotonic()
    assert ex.exit_code == 0
    text = W.join_chunks([type("M", (), {"text": t})() for _, t in chunks])
    assert text.split() == ["first", "line1", "line2", "line3", "line4", "line5", "last"]
    first_at = next(ts for ts, t in chunks if "first" in t)
    assert t_end - first_at > 1.5, (
        f"'first' arrived {first_at - t0:.2f}s after start but the command ended at "
        f"{t_end - t0:.2f}s: output is not streamed")
    # and the stream closed promptly after the command ended (no ~1 s grace)
    assert t_end - t0 < 2 + 0.5 + 1.2, f"command took {t_end - t0:.2f}s"


def test_streaming_stderr_and_handlers(host_sandbox):
    events = {"init": [], "stdout": [], "stderr": [], "complete": [], "error": []}
    handlers = ExecutionHandlersSync(
        on_init=lambda e: events["init"].append(e.id),
        on_stdout=lambda m: events["stdout"].append(m.text),
        on_stderr=lambda m: events["stderr"].append(m.text),
        on_execution_complete=lambda c: events["complete"].append(c.execution_time_in_millis),
        on_error=lambda e: events["error"].append(e.value),
    )
    ex = host_sandbox.commands.run("echo a; echo b >&2; sleep 0.2; echo c", handlers=handlers)
    assert ex.exit_code == 0
    assert events["init"] == [ex.id]
    assert events["stdout"] == ["a", "c"]
    assert events["stderr"] == ["b"]
    assert len(events["complete"]) == 1 and events["complete"][0] >= 150
    assert events["error"] == []

    events = {"error": []}
    ex = host_sandbox.commands.run("exit 9", handlers=ExecutionHandlersSync(
        on_error=lambda e: events["error"].append(e.value)))
    assert events["error"] == ["9"] and ex.exit_code == 9


def test_background_status_and_logs(host_sandbox):
    t0 = time.monotonic()
    ex = host_sandbox.commands.run("echo start; sleep 1.5; echo done; echo oops >&2",
                                   opts=RunCommandOpts(background=True))
    assert time.monotonic() - t0 < 1.0, "a background run must return immediately"
    assert ex.id
    st = host_sandbox.commands.get_command_status(ex.id)
    assert st.running is True
    assert st.exit_code is None
    assert st.started_at is not None

    st = W.wait_until(lambda: (s := host_sandbox.commands.get_command_status(ex.id)).running is False and s,
                      15, interval=0.2, message="background command to finish")
    assert st.exit_code == 0
    assert st.finished_at is not None and st.finished_at >= st.started_at

    logs = host_sandbox.commands.get_background_command_logs(ex.id)
    assert logs.content.split() == ["start", "done", "oops"], logs.content
    assert logs.cursor is not None
    again = host_sandbox.commands.get_background_command_logs(ex.id, cursor=logs.cursor)
    assert "start" not in again.content, "reading from the tail cursor must not repeat output"


def test_background_logs_incremental(host_sandbox):
    ex = host_sandbox.commands.run("for i in 1 2 3 4 5 6; do echo n$i; sleep 0.3; done",
                                   opts=RunCommandOpts(background=True))
    time.sleep(0.8)
    first = host_sandbox.commands.get_background_command_logs(ex.id)
    assert "n1" in first.content and "n6" not in first.content
    W.wait_until(lambda: not host_sandbox.commands.get_command_status(ex.id).running, 10,
                 message="finish")
    rest = host_sandbox.commands.get_background_command_logs(ex.id, cursor=first.cursor)
    combined = (first.content + rest.content).split()
    assert combined == [f"n{i}" for i in range(1, 7)], combined


def test_background_exit_code(host_sandbox):
    ex = host_sandbox.commands.run("sleep 0.2; exit 7", opts=RunCommandOpts(background=True))
    st = W.wait_until(lambda: (s := host_sandbox.commands.get_command_status(ex.id)).running is False and s,
                      10, message="finish")
    assert st.exit_code == 7


def test_status_of_unknown_command(host_sandbox):
    with pytest.raises(SandboxException):
        host_sandbox.commands.get_command_status("no-such-execution-e2e")


def test_interrupt_background(host_sandbox):
    ex = host_sandbox.commands.run("sh -c 'sleep 5101 & sleep 5102; wait'",
                                   opts=RunCommandOpts(background=True))
    time.sleep(0.3)
    assert host_sandbox.commands.get_command_status(ex.id).running is True
    host_sandbox.commands.interrupt(ex.id)
    st = W.wait_until(lambda: (s := host_sandbox.commands.get_command_status(ex.id)).running is False and s,
                      10, message="interrupted command to stop")
    assert st.exit_code != 0
    # the whole process group went, not just the shell
    code, out, _ = sh(host_sandbox, "pgrep -f 'sleep 510[12]' || true")
    assert out.strip() == "", f"processes survived the interrupt: {out}"


def test_interrupt_foreground(host_sandbox):
    state = {}
    started = threading.Event()

    def on_init(init):
        state["id"] = init.id

    def on_stdout(msg):
        if "ready" in msg.text:
            started.set()

    def run():
        try:
            state["ex"] = host_sandbox.commands.run(
                "echo ready; sleep 5201", handlers=ExecutionHandlersSync(on_init=on_init, on_stdout=on_stdout))
        except Exception as exc:  # noqa: BLE001
            state["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    assert started.wait(15), "foreground command never printed 'ready'"
    host_sandbox.commands.interrupt(state["id"])
    t.join(10)
    assert not t.is_alive(), "foreground stream did not end after interrupt"
    assert time.monotonic() - t0 < 12
    if "ex" in state:
        assert state["ex"].exit_code != 0
    code, out, _ = sh(host_sandbox, "pgrep -f 'sleep 520[1]' || true")
    assert out.strip() == ""


def test_command_timeout(host_sandbox):
    t0 = time.monotonic()
    ex = host_sandbox.commands.run("echo go; sleep 5301", opts=RunCommandOpts(timeout=timedelta(seconds=1)))
    elapsed = time.monotonic() - t0
    assert elapsed < 6, f"timeout not enforced ({elapsed:.1f}s)"
    assert ex.exit_code != 0
    code, out, _ = sh(host_sandbox, "pgrep -f 'sleep 530[1]' || true")
    assert out.strip() == ""


def test_envs(host_sandbox):
    code, out, _ = sh(host_sandbox, 'echo "$FOO|$BAR|$E2E_SANDBOX_ENV"',
                      envs={"FOO": "bar baz", "BAR": "quote'd \"x\""})
    assert code == 0
    assert out.strip() == "bar baz|quote'd \"x\"|from-create"


def test_envs_do_not_leak_between_commands(host_sandbox):
    sh(host_sandbox, "true", envs={"ONLY_ONCE": "1"})
    code, out, _ = sh(host_sandbox, 'echo "[$ONLY_ONCE]"')
    assert out.strip() == "[]"


def test_set_env_persists(make_sandbox):
    sbx = make_sandbox("host")
    sbx.commands.set_env("PERSISTED_E2E", "yes it is")
    code, out, _ = sh(sbx, 'echo "$PERSISTED_E2E"')
    assert out.strip() == "yes it is"


def test_cwd(host_sandbox):
    code, out, _ = sh(host_sandbox, "pwd", working_directory="/tmp")
    assert code == 0 and out.strip() == "/tmp"
    code, out, _ = sh(host_sandbox, "mkdir -p /tmp/e2e-cwd/sub && echo ok")
    code, out, _ = sh(host_sandbox, "pwd", working_directory="/tmp/e2e-cwd/sub")
    assert out.strip() == "/tmp/e2e-cwd/sub"


def test_bad_cwd(host_sandbox):
    try:
        ex = host_sandbox.commands.run("pwd", opts=RunCommandOpts(working_directory="/no/such/dir"))
    except SandboxException:
        return
    assert ex.exit_code != 0, "running in a missing directory must fail"


def test_uid_gid(host_sandbox):
    code, out, _ = sh(host_sandbox, "id -u; id -g", uid=65534, gid=65534)
    assert code == 0
    assert out.split() == ["65534", "65534"]
    code, out, _ = sh(host_sandbox, "id -u")
    assert out.strip() == "0", "default user inside the sandbox is root"


def test_argv_command(host_sandbox):
    ex = host_sandbox.commands.run(["/bin/echo", "a b", "$HOME"])
    assert ex.exit_code == 0
    assert ex.text == "a b $HOME"


def test_stdin_is_not_a_terminal(host_sandbox):
    code, out, _ = sh(host_sandbox, "cat; echo eof")
    assert code == 0 and out.strip() == "eof", "stdin must be /dev/null, not hang"


# -- sessions ------------------------------------------------------------------

def test_session_keeps_state(host_sandbox):
    cmds = host_sandbox.commands
    sid = cmds.create_session()
    try:
        ex = cmds.run_in_session(sid, "cd /tmp && export SESSION_VAR=42 && x=local")
        assert ex.exit_code == 0
        ex = cmds.run_in_session(sid, 'pwd; echo "$SESSION_VAR-$x"')
        assert ex.exit_code == 0
        assert ex.text.split() == ["/tmp", "42-local"]
        ex = cmds.run_in_session(sid, "f() { echo fn-$1; }")
        ex = cmds.run_in_session(sid, "f ok")
        assert ex.text == "fn-ok"
    finally:
        cmds.delete_session(sid)


def test_session_exit_codes_and_survival(host_sandbox):
    cmds = host_sandbox.commands
    sid = cmds.create_session()
    try:
        ex = cmds.run_in_session(sid, "false")
        assert ex.exit_code == 1
        ex = cmds.run_in_session(sid, "echo err >&2; (exit 5)")
        assert ex.exit_code == 5
        assert W.join_chunks(ex.logs.stderr).strip() == "err"
        ex = cmds.run_in_session(sid, "echo alive")
        assert ex.exit_code == 0 and ex.text == "alive"
    finally:
        cmds.delete_session(sid)


def test_session_working_directory(host_sandbox):
    cmds = host_sandbox.commands
    sid = cmds.create_session(working_directory="/usr")
    try:
        assert cmds.run_in_session(sid, "pwd").text == "/usr"
        assert cmds.run_in_session(sid, "pwd", working_directory="/tmp").text == "/tmp"
    finally:
        cmds.delete_session(sid)
    # `$NAME` in a working directory expands from the sandbox's environment, per session and per run.
    home = cmds.run("echo $HOME").logs.stdout[0].text
    sid = cmds.create_session(working_directory="$HOME")
    try:
        assert cmds.run_in_session(sid, "pwd").text == home
        assert cmds.run_in_session(sid, "pwd", working_directory="${HOME}/..").text in ("/", home.rsplit("/", 1)[0] or "/")
    finally:
        cmds.delete_session(sid)


def test_session_streaming_and_timeout(host_sandbox):
    cmds = host_sandbox.commands
    sid = cmds.create_session()
    try:
        seen = []
        ex = cmds.run_in_session(sid, "echo one; sleep 0.5; echo two",
                                 handlers=ExecutionHandlersSync(on_stdout=lambda m: seen.append(m.text)))
        assert seen == ["one", "two"]
        t0 = time.monotonic()
        ex = cmds.run_in_session(sid, "sleep 5401", timeout=timedelta(seconds=1))
        assert time.monotonic() - t0 < 6
        assert ex.exit_code != 0
    finally:
        cmds.delete_session(sid)


def test_sessions_are_isolated(host_sandbox):
    cmds = host_sandbox.commands
    s1, s2 = cmds.create_session(), cmds.create_session()
    try:
        cmds.run_in_session(s1, "export ONLY_S1=1; cd /tmp")
        ex = cmds.run_in_session(s2, 'echo "[$ONLY_S1]"; pwd')
        assert ex.text.split()[0] == "[]"
    finally:
        cmds.delete_session(s1)
        cmds.delete_session(s2)


def test_deleted_session(host_sandbox):
    cmds = host_sandbox.commands
    sid = cmds.create_session()
    cmds.delete_session(sid)
    with pytest.raises(SandboxException):
        cmds.run_in_session(sid, "echo nope")
    with pytest.raises(SandboxException):
        cmds.delete_session(sid)


def test_a_command_after_a_pause_runs_on_the_spare_shell_and_sees_what_bash_c_gives(make_sandbox):
    """After 100 ms without a command execd keeps a bash started ahead; the next command that fits
    runs on it. It must see what a fresh `bash -c` gives: the same `$0`, options, `$_`, a `$SECONDS`
    from zero, its own envs, no extra descriptors, the same exit code, output and error streams. A
    sandbox with WARREN_SPARE_SHELL=0 starts a fresh shell per command, the yardstick."""
    probe = ('echo "$0|$#|$-|$_|$SECONDS|$PPID|$BASH_SUBSHELL|$SHLVL|$PWD|$E2E_V|$WARREN_SPARE_SHELL"; '
             'for fd in 3 4 5 6 7 8 9 10 255; do { : >&$fd; } 2>/dev/null && printf "%s " $fd; done; echo .; '
             'echo err >&2; '
             'tr "\\0" " " </proc/$$/cmdline | grep -q "__warren_[g]o" && echo spare || echo fresh; exit 3')
    spare = make_sandbox("host")
    fresh = make_sandbox("host", env={"WARREN_SPARE_SHELL": "0"})
    time.sleep(1.2)  # past the spare's idle delay, and long enough for its own $SECONDS to reach 1
    results = {}
    for name, sbx in (("spare", spare), ("fresh", fresh)):
        ex = sbx.commands.run(probe, opts=RunCommandOpts(envs={"E2E_V": "a 'b' c"}))
        results[name] = (ex.exit_code, W.join_chunks(ex.logs.stdout), W.join_chunks(ex.logs.stderr))
    (code_s, out_s, err_s), (code_f, out_f, err_f) = results["spare"], results["fresh"]
    assert (code_s, code_f) == (3, 3)
    assert (err_s.strip(), err_f.strip()) == ("err", "err")
    lines_s, lines_f = out_s.strip().splitlines(), out_f.strip().splitlines()
    assert (lines_s[-1], lines_f[-1]) == ("spare", "fresh"), (out_s, out_f)
    assert lines_s[0].rsplit("|", 1)[0] == lines_f[0].rsplit("|", 1)[0], (lines_s, lines_f)
    assert lines_s[0].endswith("|") and lines_f[0].endswith("|0")
    assert lines_s[1] == lines_f[1], f"descriptors differ: {lines_s[1]} vs {lines_f[1]}"
    # a second command right after runs on a fresh shell (no spare yet) and works the same
    code, out, _ = sh(spare, "echo again")
    assert (code, out.strip()) == (0, "again")
