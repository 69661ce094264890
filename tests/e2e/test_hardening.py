"""Hardening: the floor execd lays under user code (the reference's OSEP-0018, switched on by
`[runtime] execd_run_as_init`), tried as a hostile workload would: every path that runs user code
(entrypoint, commands, commands as another user, bash sessions, terminals, kernels) holds no
capability and cannot regain one, has `no_new_privs`, meets the deny list, and does not see execd's
settings; the capabilities endpoint says what is in force. Behaviour depends on how each runtime
starts execd (in-process, an OCI runtime's exec, Docker's) and whose kernel answers (gVisor's Sentry
differs), so it runs on each runtime but the second gVisor one (/health's runtime.name: runsc under
Docker is the same Sentry as native runsc): under gVisor once, on the first gVisor runtime."""

import json
import uuid

import pytest

import warren_e2e as W

STRIPPED = ["EXECD_ENVS", "EXECD_ISOLATION_CONFIG", "JUPYTER_HOST", "JUPYTER_TOKEN", "EXECD_ACCESS_TOKEN"]
NO_CAPS = "0000000000000000"
NET_RAW = "0000000000002000"

# What a process holds: its capability sets and filter mode from /proc, and `no_new_privs` from
# prctl(PR_GET_NO_NEW_PRIVS) (gVisor's /proc/self/status has no such line).
STATUS = ("grep -E '^(Cap|Seccomp)' /proc/self/status; "
          "python3 -c 'import ctypes; print(\"NoNewPrivs:\", ctypes.CDLL(None).prctl(39, 0, 0, 0, 0))'")

# The entrypoint writes what it was started with where the files API can read it, then stays.
DUMP_ENTRYPOINT = [
    "sh", "-c",
    "{ " + STATUS + "; echo '=== env ==='; env; } > /tmp/entrypoint-state 2>&1; exec sleep infinity",
]


def status_fields(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp"):
            out[key] = value.strip()
    return out


def command_status(sbx, **opts) -> dict:
    code, out, err = W.sh(sbx, STATUS, **opts)
    assert code == 0, err
    return status_fields(out)


def assert_floor(fields: dict, kept: str = NO_CAPS):
    assert fields["CapEff"] == kept, fields
    assert fields["CapPrm"] == kept, fields
    assert fields["CapBnd"] == kept, fields
    assert fields["NoNewPrivs"] == "1", fields
    assert fields["Seccomp"] == "2", fields


def hardening_report(sbx) -> dict:
    caps = sbx.isolation.capabilities()
    assert caps.hardening is not None, "the capabilities answer carries no hardening object"
    return caps.hardening.to_dict() if hasattr(caps.hardening, "to_dict") else caps.hardening.model_dump()


def gvisor(srv) -> bool:
    """gVisor's Sentry answers (its own signal rules, /proc and capabilities): by /health's
    runtime.name, as no capability says so."""
    return srv.gvisor


def _gvisor_once(server) -> None:
    if server.gvisor:
        server.run_once("the floor under gVisor is tried once, on the first gVisor runtime", gvisor=True)


def _server(server, work_root, name: str, runtime_lines: str):
    _gvisor_once(server)
    srv = W.WarrenServer(server.runtime, work_root, f"{name}-{uuid.uuid4().hex[:6]}")
    srv.runtime_config = runtime_lines
    srv.start()
    srv.import_image(W.TEST_IMAGE_NAME, W.test_rootfs())
    return srv


@pytest.fixture(scope="module")
def hardened(server, work_root):
    srv = _server(server, work_root, "hardened", "execd_run_as_init = true\n")
    yield srv
    srv.delete_all_sandboxes()
    srv.stop()


@pytest.fixture(scope="module")
def custom(server, work_root):
    srv = _server(
        server, work_root, "hardened-custom",
        'execd_run_as_init = true\nhardening = { keep_capabilities = ["CAP_NET_RAW"], '
        'seccomp_deny = ["chmod", "fchmodat", "fchmodat2"] }\n',
    )
    yield srv
    srv.delete_all_sandboxes()
    srv.stop()


def make(srv, **kw):
    from datetime import timedelta

    from opensandbox import SandboxSync
    kw.setdefault("timeout", timedelta(minutes=10))
    sbx = SandboxSync.create(srv.sandbox_image(W.TEST_IMAGE_NAME), connection_config=srv.sdk_config(), **kw)
    W.track_sandbox(sbx.id)
    return sbx


# Each of execd's settings, set in the sandbox's environment so that their absence means something.
SETTINGS = {"JUPYTER_TOKEN": "kernel-secret", "JUPYTER_HOST": "127.0.0.1:1",
            "EXECD_ACCESS_TOKEN": "not-for-code", "EXECD_ISOLATION_CONFIG": "/nonexistent/isolation.toml"}


@pytest.fixture(scope="module")
def hardened_sbx(hardened):
    sbx = make(hardened, entrypoint=DUMP_ENTRYPOINT, env=SETTINGS)
    yield sbx
    sbx.kill()


def test_the_capabilities_endpoint_reports_the_floor(hardened, hardened_sbx):
    report = hardening_report(hardened_sbx)
    assert report["init_mode"] == "pid1", report
    # gVisor's Sentry lets `kill -9 1` from inside through: said, not claimed.
    assert report["signal_shield"] is (not gvisor(hardened)), report
    assert report["cap_drop"]["state"] == "active", report
    assert report["seccomp"]["state"] == "active", report
    for layer in ("landlock", "ebpf"):
        assert report[layer]["state"] == "disabled" and report[layer].get("message"), report


def test_commands_hold_nothing_and_see_no_execd_setting(hardened_sbx):
    assert_floor(command_status(hardened_sbx))
    code, out, _ = W.sh(hardened_sbx, "env")
    assert code == 0
    for name in STRIPPED:
        assert f"{name}=" not in out, f"a command sees {name}"
    # (set in the sandbox's environment, all of them: the entrypoint has them but the credential)
    # The sandbox's own variables are still there.
    assert "HOME=" in out and "PATH=" in out


def test_the_entrypoint_is_under_the_floor_and_keeps_its_settings(hardened_sbx):
    text = W.wait_until(lambda: _read(hardened_sbx, "/tmp/entrypoint-state"), 30,
                        message="the entrypoint's dump")
    fields = status_fields(text.split("=== env ===")[0])
    assert_floor(fields)
    env = text.split("=== env ===")[1]
    # Only execd's credential leaves the entrypoint's environment.
    assert "EXECD_ACCESS_TOKEN=" not in env
    assert "JUPYTER_TOKEN=kernel-secret" in env and "JUPYTER_HOST=" in env


def test_another_user_a_session_and_a_kernel_are_under_the_floor_too(hardened, hardened_sbx):
    fields = command_status(hardened_sbx, uid=65534)
    assert_floor(fields)
    code, out, _ = W.sh(hardened_sbx, "id -u", uid=65534)
    assert out.strip() == "65534"
    session = hardened_sbx.commands.create_session()
    ex = hardened_sbx.commands.run_in_session(session, STATUS)
    assert_floor(status_fields(W.join_chunks(ex.logs.stdout)))
    hardened_sbx.commands.delete_session(session)


def test_a_kernel_is_under_the_floor(hardened, server):
    server.run_once("kernels start through the same launch as commands on every runtime")
    from opensandbox import SandboxSync
    from code_interpreter import CodeInterpreterSync
    hardened.import_image(W.JUPYTER_IMAGE_NAME, W.jupyter_rootfs())
    sbx = SandboxSync.create(hardened.sandbox_image(W.JUPYTER_IMAGE_NAME),
                             connection_config=hardened.sdk_config())
    W.track_sandbox(sbx.id)
    try:
        ci = CodeInterpreterSync.create(sbx)
        result = ci.codes.run("import ctypes\nprint(open('/proc/self/status').read())\n"
                              "print('NoNewPrivs:', ctypes.CDLL(None).prctl(39, 0, 0, 0, 0))")
        assert_floor(status_fields(W.join_chunks(result.logs.stdout)))
    finally:
        sbx.kill()


def _read(sbx, path: str) -> str | None:
    try:
        text = sbx.files.read_file(path)
    except Exception:  # noqa: BLE001 - not written yet
        return None
    return text if "=== env ===" in text else None


def test_a_hostile_workload_cannot_climb_back(hardened, hardened_sbx):
    # The deny list answers EACCES (the sandbox's own filter and missing capabilities answer
    # EPERM): namespaces, mounts, chroot, tracing, keys, BPF, seccomp itself.
    probe = ("python3 -c \"import ctypes,sys; l=ctypes.CDLL(None,use_errno=True); "
             "n=[int(a) for a in sys.argv[1:]]; rc=l.syscall(*n); print(rc, ctypes.get_errno())\" ")
    for name, call in {"unshare": "272 268435456", "mount": "165 0 0 0 0 0", "chroot": "161 0",
                       "ptrace": "101 16 1 0 0", "keyctl": "250 0 0 0 0", "bpf": "321 0 0 0",
                       "seccomp": "317 0 0 0"}.items():
        code, out, err = W.sh(hardened_sbx, probe + call)
        assert code == 0 and out.split() == ["-1", "13"], f"{name}: {out} {err}"
    # No way back to a capability: the ambient and bounding sets are empty, and no_new_privs keeps
    # a setuid program from granting one (a copy of a root-owned setuid shell gains nothing).
    code, out, err = W.sh(
        hardened_sbx,
        "python3 -c \"import ctypes; l=ctypes.CDLL(None,use_errno=True); "
        "print(l.prctl(47, 2, 21, 0, 0), ctypes.get_errno())\"",  # PR_CAP_AMBIENT_RAISE CAP_SYS_ADMIN
    )
    assert code == 0 and out.split()[0] == "-1", out
    code, out, err = W.sh(
        hardened_sbx,
        "cp /bin/bash /tmp/rootsh && chmod u+s /tmp/rootsh && "
        "su -s /tmp/rootsh nobody -c 'grep -E \"^CapEff\" /proc/self/status' 2>&1; "
        "setpriv --nnp true 2>&1; /tmp/rootsh -p -c 'grep CapEff /proc/self/status'",
    )
    effective = [line.split()[1] for line in out.splitlines() if line.startswith("CapEff")]
    assert effective and set(effective) == {NO_CAPS}, out
    # execd itself is out of reach: PID 1 can be neither killed nor read. gVisor's Sentry shields
    # neither (execd's environment is the sandbox's own there: Warren gives execd no secret, only
    # a hash of its credential on the command line).
    if gvisor(hardened):
        return
    code, out, _ = W.sh(hardened_sbx, "kill -9 1; echo alive; cat /proc/1/environ >/dev/null 2>&1 || echo unreadable")
    assert "alive" in out and "unreadable" in out, out


def test_an_isolated_session_is_under_the_floor(hardened, server):
    """Isolated sessions run what they run through the isolation helper, not execd's launch: the
    floor is laid there too, and execd's settings stay out."""
    hardened.require("isolatedSessions", "runs an isolated session")
    from opensandbox.models.isolated import CreateIsolatedSessionRequest, IsolatedWorkspaceSpec
    sbx = make(hardened, env=SETTINGS, extensions={"bootstrap.execd.isolation": "enable"})
    try:
        with sbx.isolation.session(CreateIsolatedSessionRequest(
                workspace=IsolatedWorkspaceSpec(path="/workspace"))) as s:
            fields = status_fields(s.run(STATUS).text)
            assert_floor(fields)
            env = s.run("env").text
            assert "JUPYTER_TOKEN=" not in env and "EXECD_ENVS=" not in env, env
    finally:
        sbx.kill()


def test_set_env_has_no_file_to_write_under_the_floor(hardened_sbx):
    # The env file's path is one of execd's settings: commands cannot rewrite what later commands
    # start with. The client's set_env says so plainly.
    with pytest.raises(Exception) as err:
        hardened_sbx.commands.set_env("PERSISTED", "x")
    assert "EXECD_ENVS" in str(err.value)


def test_a_custom_policy_keeps_its_capability_and_refuses_its_calls(custom):
    sbx = make(custom, entrypoint=["sh", "-c", "exec sleep infinity"])
    try:
        # gVisor gives no CAP_NET_RAW without --net-raw: execd cannot keep what it lacks, and says so.
        kept = NO_CAPS if gvisor(custom) else NET_RAW
        assert_floor(command_status(sbx), kept=kept)
        fields = command_status(sbx)
        assert fields.get("CapAmb", kept) == kept, fields  # (no such line under gVisor)
        if gvisor(custom):
            assert "CAP_NET_RAW" in hardening_report(sbx)["cap_drop"]["message"]
        code, out, err = W.sh(sbx, "echo x > /tmp/probe && chmod 755 /tmp/probe")
        assert code != 0 and "Permission denied" in err, (out, err)
        code, out, _ = W.sh(sbx, "echo still-fine")
        assert code == 0 and "still-fine" in out
        report = hardening_report(sbx)
        assert report["cap_drop"]["state"] == "active" and report["seccomp"]["state"] == "active"
    finally:
        sbx.kill()


def test_an_image_policy_lays_the_floor_on_a_plain_server(server, test_image, make_sandbox):
    """The reference's way for an image to ask for the floor: an isolation TOML named by
    EXECD_ISOLATION_CONFIG (its other keys are the image's business). A server without hardening
    lays what it asks."""
    server.run_once("the image's TOML is read by execd, the same on every runtime", hostVolumes="server")
    from opensandbox.models.sandboxes import Host, Volume
    folder = server.host_volumes / f"isolation-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    (folder / "isolation.toml").write_text(
        'upper_root = "/var/lib/execd/isolation"\n'
        "[hardening]\nenabled = true\nkeep_capabilities = [\"CAP_NET_RAW\"]\n"
        "[seccomp]\ndeny = [\"chmod\", \"fchmodat\", \"fchmodat2\"]\n"
        "[landlock]\nenabled = true\n")
    sbx = make_sandbox(
        test_image,
        env={"EXECD_ISOLATION_CONFIG": "/etc/opensandbox/isolation.toml"},
        volumes=[Volume(name="policy", host=Host(path=str(folder)), mount_path="/etc/opensandbox",
                        read_only=True)],
    )
    report = hardening_report(sbx)
    assert report["cap_drop"]["state"] == "active" and report["seccomp"]["state"] == "active", report
    # Asked for, not offered: said so, not pretended.
    assert report["landlock"]["state"] == "unsupported" and report["landlock"]["message"], report
    assert_floor(command_status(sbx), kept=NET_RAW)
    code, _, err = W.sh(sbx, "echo x > /tmp/probe && chmod 700 /tmp/probe")
    assert code != 0 and "Permission denied" in err, err
    # A broken policy is a failed create that says why, not a sandbox without its floor.
    (folder / "broken.toml").write_text("[hardening]\nenabled = true\n[seccomp]\ndeny = [\"execve\"]\n")
    with pytest.raises(Exception) as failed:
        make_sandbox(
            test_image,
            env={"EXECD_ISOLATION_CONFIG": "/etc/opensandbox/broken.toml"},
            volumes=[Volume(name="policy", host=Host(path=str(folder)), mount_path="/etc/opensandbox",
                            read_only=True)],
        )
    assert "execve" in str(failed.value), failed.value


def test_a_plain_server_reports_the_floor_off(server, test_image, make_sandbox):
    _gvisor_once(server)
    sbx = make_sandbox(test_image)
    report = hardening_report(sbx)
    assert report["init_mode"] == "pid1" and report["signal_shield"] is (not gvisor(server)), report
    assert report["cap_drop"]["state"] == "disabled" and report["seccomp"]["state"] == "disabled"
    fields = command_status(sbx)
    assert fields["CapEff"] != NO_CAPS and fields["CapBnd"] != NO_CAPS, fields
    code, out, _ = W.sh(sbx, "env")
    assert "EXECD_ENVS=" in out, "set_env's file is where commands can find it"


def test_a_bad_policy_stops_the_server_at_start(server, work_root):
    server.run_once("configuration is read by the server, the same on every runtime")
    for lines, needle in (
        ('execd_run_as_init = true\nhardening = { seccomp_deny = ["execve"] }\n', "execveat"),
        ('execd_run_as_init = true\nhardening = { seccomp_deny = ["frobnicate"] }\n', "frobnicate"),
        ('execd_run_as_init = true\nhardening = { keep_capabilities = ["CAP_GOD"] }\n', "CAP_GOD"),
        ('hardening = { keep_capabilities = ["CAP_NET_RAW"] }\n', "execd_run_as_init"),
    ):
        srv = W.WarrenServer(server.runtime, work_root, f"badfloor-{uuid.uuid4().hex[:6]}")
        srv.runtime_config = lines
        with pytest.raises(Exception):
            srv.start(ready_timeout=10)
        assert needle in srv.log_path.read_text(), srv.log_path.read_text()[-2000:]
        srv.stop()
