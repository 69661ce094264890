"""What a sandbox can and cannot see (issue 2 items 3, 4, 5)."""

from __future__ import annotations

import os
import socket

import pytest

import warren_e2e as W

sh = W.sh


@pytest.fixture
def iso_sandbox(make_sandbox, any_image):
    return make_sandbox(any_image)


def test_root_and_home_hidden(server, host_sandbox):
    server.native_only("the built-in host image")
    code, out, _ = sh(host_sandbox, "find /root /home -mindepth 1 -maxdepth 2 2>/dev/null | head -20; true")
    assert out.strip() == "", f"host /root or /home content visible:\n{out}"


def test_var_and_data_dir_hidden(server, host_sandbox):
    code, out, _ = sh(host_sandbox, f"ls -A /var/lib 2>/dev/null | head -50; test -e {server.data_dir} && echo DATA_DIR_VISIBLE; true")
    assert "DATA_DIR_VISIBLE" not in out
    host_var = set(os.listdir("/var/lib")) if os.path.isdir("/var/lib") else set()
    inside = set(out.split())
    common = (host_var & inside) - {"dpkg", "apt", "misc", "systemd", "ucf", "pam"}
    assert len(common) < max(3, len(host_var) // 2), f"host /var looks visible inside: {sorted(common)[:20]}"


def test_shadow_unreadable(host_sandbox):
    host_shadow = open("/etc/shadow").read()
    code, out, err = sh(host_sandbox, "cat /etc/shadow")
    if code == 0:
        for line in host_shadow.splitlines():
            fields = line.split(":")
            if len(fields) > 1 and len(fields[1]) > 3:
                assert line not in out, "the host's /etc/shadow is readable inside the sandbox"


def test_ssh_keys_hidden(host_sandbox):
    code, out, _ = sh(host_sandbox, "ls /etc/ssh/ssh_host_*_key 2>/dev/null; cat /etc/ssh/ssh_host_*_key 2>/dev/null | head -c 100; true")
    assert "PRIVATE KEY" not in out


def test_host_fs_read_only(server, host_sandbox):
    server.native_only("the built-in host image")
    code, _, _ = sh(host_sandbox, "echo x > /etc/e2e-should-fail")
    assert code != 0
    assert not os.path.exists("/etc/e2e-should-fail")


def test_only_own_processes(iso_sandbox):
    code, out, _ = sh(iso_sandbox, "ps -eo pid,args")
    assert code == 0
    rows = [l for l in out.strip().splitlines()[1:] if l.strip()]
    assert len(rows) < 15, f"too many processes visible:\n{out}"
    assert "warren serve" not in out and "pytest" not in out, f"host processes visible:\n{out}"
    pids = sorted(int(r.split()[0]) for r in rows)
    assert pids[0] == 1, "the sandbox must have its own PID namespace (PID 1 inside)"


def test_hostname_differs(iso_sandbox):
    code, out, _ = sh(iso_sandbox, "cat /proc/sys/kernel/hostname")
    assert code == 0
    assert out.strip() and out.strip() != socket.gethostname()


def test_loopback_only(iso_sandbox):
    code, out, _ = sh(iso_sandbox, "cat /proc/net/dev")
    assert code == 0
    ifaces = [l.split(":")[0].strip() for l in out.splitlines() if ":" in l]
    assert ifaces == ["lo"], f"network interfaces inside the sandbox: {ifaces}"
    # and outbound connections fail fast
    code, out, _ = sh(iso_sandbox, "timeout 5 bash -c 'exec 3<>/dev/tcp/1.1.1.1/80' 2>&1 && echo CONNECTED; true")
    assert "CONNECTED" not in out


def test_loopback_works(iso_sandbox):
    code, out, _ = sh(iso_sandbox, "python3 - <<'EOF'\n"
                                   "import socket\n"
                                   "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
                                   "c = socket.create_connection(s.getsockname()); a, _ = s.accept()\n"
                                   "c.sendall(b'ping'); print(a.recv(4).decode())\n"
                                   "EOF")
    assert code == 0 and out.strip() == "ping"


def test_api_key_not_inside(server, iso_sandbox):
    key = server.api_key
    code, out, _ = sh(iso_sandbox, "env; cat /proc/1/environ 2>/dev/null | tr '\\0' '\\n'; "
                                   "cat /proc/*/cmdline 2>/dev/null | tr '\\0' ' '")
    assert key not in out, "the API key is visible in the sandbox's environment"
    # Cheap recursive grep of the likely places. The pattern matches the key
    # without containing it, so the key itself never enters the sandbox.
    pattern = key[:6] + "[" + key[6] + "]" + key[7:]
    code, out, _ = sh(iso_sandbox,
                      f"timeout 60 grep -rIlE -s '{pattern}' /etc /tmp /workspace /run /opt /root /home "
                      f"/dev/shm /var/tmp /proc/1/environ /proc/1/cmdline 2>/dev/null; echo rc=$?")
    assert out.strip().splitlines()[-1] in ("rc=1", "rc=2"), f"API key found inside the sandbox:\n{out}"


def test_capabilities_are_bounded(iso_sandbox):
    code, out, _ = sh(iso_sandbox, "grep -E '^Cap(Eff|Bnd)' /proc/self/status; "
                                   "grep NoNewPrivs /proc/self/status; grep Seccomp: /proc/self/status")
    assert code == 0
    fields = dict(l.split(":", 1) for l in out.strip().splitlines())
    eff = int(fields["CapEff"].strip(), 16)
    CAP_SYS_ADMIN, CAP_SYS_MODULE, CAP_SYS_PTRACE, CAP_SYS_RAWIO = 21, 16, 19, 17
    for cap in (CAP_SYS_ADMIN, CAP_SYS_MODULE, CAP_SYS_PTRACE, CAP_SYS_RAWIO):
        assert not eff & (1 << cap), f"capability {cap} must not be granted (CapEff={eff:#x})"
    if "NoNewPrivs" in fields:
        assert fields["NoNewPrivs"].strip() == "1"
    if "Seccomp" in fields:
        assert fields["Seccomp"].strip() == "2", "a seccomp filter must be active"


def test_cannot_mount(iso_sandbox):
    code, _, _ = sh(iso_sandbox, "mkdir -p /tmp/m && mount -t tmpfs none /tmp/m")
    assert code != 0, "mount must be denied inside the sandbox"


def test_apt_style_root_works(make_sandbox, test_image):
    """Root inside can still do package-manager things (chown, mknod of
    regular files, setuid to other users) on the writable image."""
    sbx = make_sandbox(test_image)
    code, out, err = sh(sbx, "touch /var/tmp/f && chown 100:100 /var/tmp/f && "
                      "python3 -c 'import os; s = os.stat(\"/var/tmp/f\"); print(f\"{s.st_uid}:{s.st_gid}\")'")
    assert code == 0, err
    assert out.strip() == "100:100"
    code, out, err = sh(sbx, "setpriv --reuid=65534 --regid=65534 --clear-groups id -u")
    assert code == 0, err
    assert out.strip() == "65534"


def test_writable_layer_is_volatile(server, iso_sandbox):
    """The sandbox's root is an overlay mounted `volatile`: its writable layer never outlives the
    host's uptime, so nothing is synced to disk for it — without the option overlay's unmount
    syncs the whole host filesystem under it, once per sandbox."""
    server.native_only("on Docker the engine mounts the container's root")
    if server.gvisor:
        pytest.skip("gVisor shows its own mount table, not the host's overlay")
    code, out, _ = sh(iso_sandbox, "grep ' / / ' /proc/self/mountinfo")
    assert code == 0, out
    # "<fstype> <source> <super options>" after the separator
    fstype, _, options = out.split(" - ", 1)[1].split()
    assert fstype == "overlay", out
    # kernels from 6.6 on show it as fsync=volatile
    assert {"volatile", "fsync=volatile"} & set(options.split(",")), out
