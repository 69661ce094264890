"""What a sandbox can and cannot see of the host: its secrets and private folders, its processes,
its network, its writable file system, and the server's own credentials and data dir."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

import warren_e2e as W

sh = W.sh


@pytest.fixture
def iso_sandbox(make_sandbox, any_image):
    return make_sandbox(any_image)


def test_root_and_home_hidden(server, host_sandbox):
    server.require_image_store("the built-in host image")
    code, out, _ = sh(host_sandbox, "find /root /home -mindepth 1 -maxdepth 2 2>/dev/null | head -20; true")
    assert out.strip() == "", f"host /root or /home content visible:\n{out}"


def test_var_and_data_dir_hidden(server, host_sandbox):
    code, out, _ = sh(host_sandbox, f"ls -A /var/lib 2>/dev/null | head -50; test -e {server.data_dir} && echo DATA_DIR_VISIBLE; true")
    assert "DATA_DIR_VISIBLE" not in out
    host_var = set(os.listdir("/var/lib")) if os.path.isdir("/var/lib") else set()
    inside = set(out.split())
    common = (host_var & inside) - {"dpkg", "apt", "misc", "systemd", "ucf", "pam"}
    assert len(common) < max(3, len(host_var) // 2), f"host /var looks visible inside: {sorted(common)[:20]}"


def test_shadow_unreadable(server, host_sandbox):
    """The `host` image shows the host's own /etc, yet none of /etc/shadow: not a line of the
    host's file can be read inside."""
    server.require_image_store("the built-in host image, which shows the host's /etc")
    host_shadow = Path("/etc/shadow")
    if not host_shadow.is_file():
        pytest.skip("this host has no /etc/shadow, so there is nothing for the sandbox to fail to read")
    host_lines = [line for line in host_shadow.read_text().splitlines() if line.strip()]
    assert host_lines, "the host's /etc/shadow is empty: the test could not tell a leak from a mask"
    # Control: the sandbox's /etc is the host's, so an unmasked /etc/shadow would be the host's
    # file too (its lines, whatever their hashes, would appear below).
    code, passwd, err = sh(host_sandbox, "cat /etc/passwd")
    assert code == 0, err
    assert passwd == Path("/etc/passwd").read_text(), "the sandbox's /etc is not the host's: no control"
    code, out, err = sh(host_sandbox, "cat /etc/shadow")
    leaked = [line.split(":")[0] for line in host_lines if line in out.splitlines()]
    assert not leaked, f"the host's /etc/shadow is readable inside the sandbox (entries of {leaked})"


@pytest.fixture
def host_key_markers():
    """Secret key files planted on the host where SSH keys live, removed afterwards: a host key in
    /etc/ssh and a user key in /root/.ssh (the folder made, and removed again, when missing).
    Each holds a random token, so that a sandbox that can read it is caught whether or not the
    host has keys of its own. Also a world-readable file in /etc beside /etc/ssh with a token of
    its own: the control that a sandbox made now does see files planted there."""
    token = uuid.uuid4().hex
    body = f"-----BEGIN OPENSSH PRIVATE KEY-----\nwarren-e2e-marker-{token}\n-----END OPENSSH PRIVATE KEY-----\n"
    made_dirs: list[Path] = []
    made_files: list[Path] = []

    def plant(path: Path, text: str, mode: int) -> None:
        if not path.parent.is_dir():
            path.parent.mkdir(mode=0o700)
            made_dirs.append(path.parent)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        made_files.append(path)
        with os.fdopen(fd, "w") as f:
            f.write(text)

    keys = [Path(f"/etc/ssh/ssh_host_warren_e2e_{token[:8]}_key"), Path(f"/root/.ssh/id_warren_e2e_{token[:8]}")]
    visible = Path(f"/etc/warren-e2e-visible-{token[:8]}")
    try:
        for key in keys:
            plant(key, body, 0o600)
        plant(visible, f"visible-{token}\n", 0o644)
        yield {"token": token, "keys": keys, "visible": visible}
    finally:
        for f in made_files:
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
        for d in reversed(made_dirs):
            with contextlib.suppress(OSError):
                d.rmdir()


def test_ssh_keys_hidden(server, make_sandbox, host_key_markers):
    """SSH private keys of the host, its host keys in /etc/ssh and root's keys in ~/.ssh, can be
    neither listed nor read in a `host` sandbox, though the rest of the host's /etc is visible."""
    server.require_image_store("the built-in host image, which shows the host's /etc")
    token = host_key_markers["token"]
    # Made after the keys were planted, so that it would see them if they were not hidden.
    sbx = make_sandbox("host")
    # Control: a file planted in the host's /etc at the same time is visible inside, so the probes
    # below would find a key that was not hidden.
    code, out, err = sh(sbx, f"cat {host_key_markers['visible']}")
    assert code == 0 and out.strip() == f"visible-{token}", (code, out, err)
    keys = " ".join(str(k) for k in host_key_markers["keys"])
    code, listing, _ = sh(sbx, f"ls -a /etc/ssh /root/.ssh 2>/dev/null; ls -d {keys} 2>/dev/null; true")
    assert token[:8] not in listing, f"a host key file is visible inside the sandbox:\n{listing}"
    # What a read shows is not printed: it may be a real key of this host.
    code, out, _ = sh(sbx, f"cat /etc/ssh/ssh_host_*_key /root/.ssh/id_* {keys} 2>/dev/null | head -c 4096; true")
    assert token not in out and "PRIVATE KEY" not in out, \
        f"a private key is readable inside the sandbox (it lists:\n{listing})"


def test_host_fs_read_only(server, host_sandbox):
    server.require_image_store("the built-in host image")
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


def test_capabilities_are_bounded(iso_sandbox, server):
    code, out, _ = sh(iso_sandbox, "grep -E '^Cap(Eff|Bnd)' /proc/self/status; "
                                   "grep NoNewPrivs /proc/self/status; grep Seccomp: /proc/self/status")
    assert code == 0
    fields = dict(l.split(":", 1) for l in out.strip().splitlines())
    eff = int(fields["CapEff"].strip(), 16)
    CAP_SYS_ADMIN, CAP_SYS_MODULE, CAP_SYS_PTRACE, CAP_SYS_RAWIO = 21, 16, 19, 17
    for cap in (CAP_SYS_ADMIN, CAP_SYS_MODULE, CAP_SYS_PTRACE, CAP_SYS_RAWIO):
        assert not eff & (1 << cap), f"capability {cap} must not be granted (CapEff={eff:#x})"
    if "NoNewPrivs" in fields:
        # In a user namespace of its own a sandbox goes without it, so setuid programs work: they
        # reach the sandbox's root, an unprivileged id range (test_userns.py).
        assert fields["NoNewPrivs"].strip() == ("0" if server.caps.user_namespaces else "1")
    if "Seccomp" in fields:
        assert fields["Seccomp"].strip() == "2", "a seccomp filter must be active"


SECCOMP_PROBE = r"""
import ctypes, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    if r == 0 and nr == 56:  # a clone that went through: the child leaves at once
        os._exit(0)
    if r > 0 and nr == 56:
        os.waitpid(r, 0)
    return "ok" if r >= 0 else os.strerror(ctypes.get_errno())
print(json.dumps({name: call(nr, *args) for name, nr, args in json.loads(sys.argv[1])}))
"""

SIGCHLD, CLONE_NEWUSER, CLONE_NEWNET = 17, 0x10000000, 0x40000000
ALLOWED, EPERM, ENOSYS = "allowed", os.strerror(1), os.strerror(38)
# (row, syscall number, arguments, what Docker's default profile answers, what Warren answers when
# it differs, and why). "allowed" means the filter let the call through: it may still fail on its
# own (EFAULT, ESRCH, EINVAL), never with the filter's EPERM. Arguments are harmless where allowed.
SYSCALL_TABLE = [
    ("getpid", 39, [], ALLOWED, None),
    ("clone plain", 56, [SIGCHLD, 0, 0, 0, 0], ALLOWED, None),
    ("clone new user ns", 56, [CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0], EPERM, None),
    ("clone new net ns", 56, [CLONE_NEWNET | SIGCHLD, 0, 0, 0, 0], EPERM, None),
    ("clone3", 435, [0, 0], ENOSYS, None),
    ("unshare new user ns", 272, [CLONE_NEWUSER], EPERM, None),
    ("setns", 308, [-1, 0], EPERM, None),
    ("mount", 165, [0, 0, 0, 0, 0], EPERM, None),
    ("modify_ldt read", 154, [0, 0, 0], ALLOWED, None),
    ("personality query", 135, [0xFFFFFFFF], ALLOWED, None),
    ("personality PER_LINUX", 135, [0], ALLOWED, None),
    ("personality ADDR_NO_RANDOMIZE", 135, [0x0040000], EPERM, None),
    ("personality READ_IMPLIES_EXEC", 135, [0x0400000], EPERM, None),
    ("socket AF_INET", 41, [2, 1, 0], ALLOWED, None),
    ("socket AF_VSOCK", 41, [40, 1, 0], EPERM, None),
    ("ptrace peek (no such pid)", 101, [2, 999999, 0, 0], ALLOWED, None),
    ("process_vm_readv (no such pid)", 310, [999999, 0, 0, 0, 0, 0], ALLOWED, None),
    ("chroot (bad pointer)", 161, [0], ALLOWED, None),
    ("keyctl", 250, [0, 0, 0, 0, 0], EPERM, None),
    ("add_key", 248, [0, 0, 0, 0, 0], EPERM, None),
    ("bpf", 321, [0, 0, 0], EPERM, None),
    ("perf_event_open", 298, [0, 0, 0, 0, 0], EPERM, None),
    ("userfaultfd", 323, [0], EPERM, None),
    ("kcmp", 312, [0, 0, 0, 0, 0], EPERM, None),
    ("pidfd_getfd", 438, [0, 0, 0], EPERM, None),
    ("process_madvise", 440, [0, 0, 0, 0, 0], EPERM, None),
    ("get_mempolicy", 239, [0, 0, 0, 0, 0], EPERM, None),
    ("set_mempolicy", 238, [0, 0, 0], EPERM, None),
    ("mbind", 237, [0, 0, 0, 0, 0, 0], EPERM, None),
    ("migrate_pages", 256, [0, 0, 0, 0], EPERM, None),
    ("move_pages", 279, [0, 0, 0, 0, 0, 0], EPERM, None),
    ("open_by_handle_at", 304, [0, 0, 0], EPERM, None),
    ("sethostname", 170, [0, 0], EPERM, None),
    ("fanotify_init", 300, [0, 0], EPERM, None),
    ("syslog", 103, [3, 0, 0], EPERM, None),
    ("acct", 163, [0], EPERM, None),
    ("memfd_secret", 447, [0], ALLOWED, (EPERM, "memory the kernel itself cannot inspect")),
    ("io_uring_setup", 425, [1, 0], ALLOWED, (EPERM, "io_uring's record of escalations")),
    ("name_to_handle_at", 303, [0, 0, 0, 0, 0], ALLOWED, (EPERM, "half of the open_by_handle_at escape")),
]


GVISOR_ROWS = {"getpid", "unshare new user ns", "setns", "mount", "socket AF_INET", "keyctl", "add_key", "bpf",
               "perf_event_open", "userfaultfd", "kcmp", "open_by_handle_at", "syslog", "acct",
               "io_uring_setup", "name_to_handle_at"}


def test_seccomp_matches_dockers_default_profile(make_sandbox, any_image, server):
    """Each call of the table answers as Docker's default profile does (for a container with
    Warren's capabilities), or tighter where the table says why: an allow list with Docker's
    argument rules (personality, socket, clone), clone3 answering ENOSYS so libc falls back to
    clone, whose flags the filter reads; x32 numbers cannot slip past a list of 64-bit numbers, and a
    call newer than the list answers ENOSYS."""
    if server.kind == "docker" and not server.gvisor:
        pytest.skip("Docker with runc keeps the daemon's own default profile: Docker's by definition")
    sbx = make_sandbox(any_image)
    rows = SYSCALL_TABLE
    if server.gvisor:
        # gVisor's Sentry is a kernel of its own and gets Warren's deny list (see
        # warren_core::policy::GVISOR_DENIED_SYSCALLS): the rows that list answers.
        rows = [r for r in SYSCALL_TABLE if r[0] in GVISOR_ROWS]
    calls = [[name, nr, args] for name, nr, args, _, _ in rows]
    # Warren's own filter (embedded runtime) refuses x32 numbers with ENOSYS; libseccomp-made
    # profiles (runc) may kill the caller instead, so only the embedded one is probed.
    if server.embedded:
        calls.append(["x32 getpid", 0x40000000 | 39, []])
    if not server.gvisor:
        calls.append(["a number past every listed call", 600, []])
    code, out, err = sh(sbx, f"python3 -c '{SECCOMP_PROBE}' '{json.dumps(calls)}'")
    assert code == 0, err
    got = json.loads(out.strip().splitlines()[-1])
    wrong = []
    for name, _, _, docker, tighter in rows:
        want = tighter[0] if tighter else docker
        ok = got[name] != EPERM if want == ALLOWED else got[name] == want
        if not ok:
            wrong.append(f"{name}: {got[name]!r}, expected {want!r} (Docker: {docker})")
    for name in ("x32 getpid", "a number past every listed call"):
        if name in got and got[name] != ENOSYS:
            wrong.append(f"{name}: {got[name]!r}, expected ENOSYS")
    assert not wrong, "\n".join(wrong)


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
    # (On Docker the engine mounts the container's root; gVisor shows its own mount table and keeps
    # writes in its own overlay.)
    server.require("snapshots", "the root is the runtime's overlay with its writable layer on this host")
    code, out, _ = sh(iso_sandbox, "grep ' / / ' /proc/self/mountinfo")
    assert code == 0, out
    # "<fstype> <source> <super options>" after the separator
    fstype, _, options = out.split(" - ", 1)[1].split()
    assert fstype == "overlay", out
    # kernels from 6.6 on show it as fsync=volatile
    assert {"volatile", "fsync=volatile"} & set(options.split(",")), out


def test_masked_proc_files_do_not_reach_the_host(server, make_sandbox, any_image):
    """/proc files Docker masks read as empty, and root in the sandbox changing their mode or owner
    changes nothing on the host: what is bound over them is the sandbox's own /dev/null, not the
    host's."""
    if server.kind != "native":
        pytest.skip("on Docker the engine masks /proc")
    if server.gvisor:
        pytest.skip("gVisor serves its own /proc")
    sbx = make_sandbox(any_image)
    before = os.stat("/dev/null")
    try:
        code, out, _ = sh(sbx, "for f in /proc/keys /proc/timer_list /proc/kcore /proc/sched_debug "
                               "/proc/latency_stats /proc/kpageflags /proc/kpagecount /proc/kpagecgroup "
                               "/proc/slabinfo /proc/pagetypeinfo /proc/vmallocinfo /proc/interrupts; "
                               "do [ -e $f ] || continue; "
                               "echo present:$f:$(head -c 64 $f | wc -c); chmod 600 $f; chown 65534 $f; done; "
                               "ls -A /sys/firmware /sys/devices/virtual/powercap /proc/acpi 2>/dev/null | "
                               "grep -v ':$' | grep . | sed 's/^/listed:/'; true")
        assert code == 0, out
        present = [l for l in out.splitlines() if l.startswith("present:")]
        assert present, out
        assert all(l.endswith(":0") for l in present), f"a masked /proc file has content: {out}"
        assert "/proc/kpageflags" in out and "/proc/slabinfo" in out, out
        assert "listed:" not in out, f"a masked folder has entries: {out}"
        after = os.stat("/dev/null")
        assert (after.st_mode, after.st_uid) == (before.st_mode, before.st_uid), \
            "a chmod or chown in the sandbox changed the host's /dev/null"
    finally:
        now = os.stat("/dev/null")
        if (now.st_mode, now.st_uid, now.st_gid) != (before.st_mode, before.st_uid, before.st_gid):
            os.chmod("/dev/null", before.st_mode & 0o7777)
            os.chown("/dev/null", before.st_uid, before.st_gid)


def _init_host_pid(sandbox_id: str) -> int:
    """The host pid of the sandbox's PID 1, found through its cgroup (v1 or v2)."""
    cg = Path("/sys/fs/cgroup")
    for procs in [*cg.glob(f"warren*/{sandbox_id}/cgroup.procs"),
                  *cg.glob(f"*/warren*/{sandbox_id}/cgroup.procs")]:
        for pid in procs.read_text().split():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            nspid = next(l for l in status.splitlines() if l.startswith("NSpid:")).split()[1:]
            if nspid[-1] == "1":
                return int(pid)
    raise AssertionError(f"no PID 1 of sandbox {sandbox_id} in its cgroup")


def _memory_contains(pid: int, needle: bytes) -> list[str]:
    """The mappings of process `pid` whose memory holds `needle` (read from the host, as root)."""
    found = []
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in maps:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if "r" not in fields[1] or (len(fields) > 5 and fields[5] in ("[vvar]", "[vvar_vclock]", "[vsyscall]")):
                continue
            try:
                mem.seek(lo)
                data = mem.read(hi - lo)
            except OSError:
                continue
            if needle in data:
                found.append(line.strip())
    return found


def test_sandbox_init_holds_no_server_secret(server, make_sandbox, any_image):
    """The sandbox's PID 1 (execd) — on the embedded runtime forked from the server's zygote rather
    than exec'd — carries nothing of the server: its memory, read from the host, does not contain
    the API key."""
    if server.kind != "native":
        pytest.skip("on Docker the engine starts the container's first process")
    if server.gvisor:
        pytest.skip("gVisor's processes live inside its sentry, not on the host")
    sbx = make_sandbox(any_image, env={"E2E_MEMORY_PROBE": "visible-in-pid-1"})
    pid = _init_host_pid(sbx.id)
    assert Path(f"/proc/{pid}/comm").read_text().strip() in ("warren-execd", "execd")
    # the scan sees what is there: the environment the sandbox was given
    assert _memory_contains(pid, b"visible-in-pid-1"), "the memory scan found not even the sandbox's env"
    assert _memory_contains(pid, server.api_key.encode()) == [], "the API key is in PID 1's memory"


def test_sandbox_init_is_opaque_to_the_sandbox(server, make_sandbox, any_image):
    """On the embedded runtime PID 1 runs execd inside the forked setup process, whose /proc/1/exe
    is the host's `warren` binary: it is undumpable, so root in the sandbox (no CAP_SYS_PTRACE) can
    neither follow that link nor read PID 1's memory or environment; `ps` shows it as `execd` (as the
    reference's PID 1), with the command line `warren-execd`."""
    if not server.embedded:
        pytest.skip("on Docker the engine starts the container's first process, and an OCI runtime "
                    "execs the execd binary as PID 1")
    sbx = make_sandbox(any_image, env={"E2E_MEMORY_PROBE": "visible-to-its-own-commands"})
    code, out, _ = sh(sbx, "cat /proc/1/comm; tr '\\0' ' ' < /proc/1/cmdline; echo; "
                           "for f in exe cwd root; do readlink /proc/1/$f >/dev/null 2>&1 && echo $f-readable; done; "
                           "cat /proc/1/environ >/dev/null 2>&1 && echo environ-readable; "
                           "head -c1 /proc/1/mem >/dev/null 2>&1 && echo mem-readable; "
                           "echo probe=$E2E_MEMORY_PROBE")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == "execd", out
    assert lines[1].startswith("warren-execd"), out
    assert not [l for l in lines if l.endswith("-readable")], out
    # commands still get the sandbox's environment (set in PID 1 before execd started)
    assert "probe=visible-to-its-own-commands" in lines, out


def test_socket_folder_cannot_point_the_server_at_a_host_socket(server, api, make_sandbox, any_image, tmp_path):
    """Under gVisor and Docker the folder execd's socket appears in is writable from inside (execd
    creates the socket there; the embedded runtime and runc hand execd a socket bound outside and
    mount no such folder). Root in the sandbox replaces the socket with a symlink to a host socket — here one of
    the test's own, standing in for Docker's — and then uses its endpoint: the server must refuse to
    connect through the link (502), and the host socket must see nothing."""
    import threading

    hits: list[bytes] = []
    host_sock = tmp_path / "host.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(host_sock))
    listener.listen(8)
    listener.settimeout(0.2)
    done = threading.Event()

    def serve():
        # Answers like a daemon would, so that a server that does connect gets a reply at once.
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except (socket.timeout, OSError):
                continue
            with conn:
                hits.append(conn.recv(200))
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\nConnection: close\r\n\r\nHOST")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        sbx = make_sandbox(any_image)
        code, out, err = sh(sbx, f"rm -f /.warren/run/execd.sock && ln -s {host_sock} /.warren/run/execd.sock && readlink /.warren/run/execd.sock")
        if server.execd_socket_handed_over:
            # execd's socket is bound outside and handed over: no host folder is mounted there
            # (under runc /.warren/run is an empty folder of the sandbox's own root), so whatever
            # the sandbox puts there the server never sees.
            assert api.get(f"/sandboxes/{sbx.id}/proxy/44772/ping", timeout=20).status_code == 200
            assert hits == []
            return
        assert code == 0 and out.strip() == str(host_sock), (out, err)
        # The proxy keeps connections it made before the swap (to the real execd: harmless). Keep
        # every one it may hold busy, so that the request after needs a new connection, which has
        # to go through the path that is now a link.
        with contextlib.ExitStack() as busy:
            for _ in range(5):
                busy.enter_context(api.stream("POST", f"/sandboxes/{sbx.id}/proxy/44772/command",
                                              json={"command": "sleep 5"}, timeout=20))
            r = api.get(f"/sandboxes/{sbx.id}/proxy/44772/ping", timeout=20)
        assert hits == [], f"the server connected to the host socket through the sandbox's symlink: {hits}"
        assert r.status_code == 502, f"{r.status_code} {r.text[:300]}"
        assert r.json()["code"], r.text
    finally:
        done.set()
        thread.join(timeout=5)
        listener.close()


def test_data_dir_is_private(server, make_sandbox, any_image):
    """Root in a sandbox is root on the host (no user namespace), so a file it makes setuid in its
    writable layer is a setuid-root file in the data dir: only root may reach inside it."""
    sbx = make_sandbox(any_image)
    code, out, err = sh(sbx, "cp /bin/sh /tmp/e2e-setuid && chmod 4755 /tmp/e2e-setuid && echo ok")
    assert code == 0, (out, err)
    assert os.stat(server.data_dir).st_mode & 0o777 == 0o700, oct(os.stat(server.data_dir).st_mode)


def test_a_strict_umask_where_the_server_starts_does_not_shape_sandboxes(fresh_server):
    """A hardened host's root umask (077) is the server's business, not its sandboxes': it made
    each sandbox's `/` (its overlay's upper folder) 0700, so no user but root could run a program
    in it, and every process in it inherited 077. Sandboxes get what Docker gives: `/` 0755 and a
    umask of 022, images and their modes as imported."""
    from opensandbox import SandboxSync

    srv = fresh_server
    srv.stop()
    srv.umask = 0o077
    srv.start()
    images = ["host"]
    if srv.caps.image_source == "store" and (W.test_rootfs() / "usr/bin/python3").exists():
        srv.import_image(W.TEST_IMAGE_NAME, W.test_rootfs())  # under the 077 too
        images.append(W.TEST_IMAGE_NAME)
    for image in images:
        sbx = SandboxSync.create(srv.sandbox_image(image), connection_config=srv.sdk_config(),
                                 timeout=timedelta(minutes=5))
        W.track_sandbox(sbx.id)
        try:
            # (os.stat, not stat(1): the runsc here refuses coreutils' statx flags)
            modes = "python3 -c 'import os,sys; print(*(oct(os.stat(p).st_mode & 0o7777)[2:] for p in sys.argv[1:]))'"
            code, out, err = sh(sbx, f"{modes} / /tmp /workspace /usr/bin; umask; "
                                     f"touch /tmp/f && mkdir /tmp/d && {modes} /tmp/f /tmp/d")
            assert code == 0, (image, out, err)
            assert out.split() == ["755", "1777", "755", "755", "0022", "644", "755"], (image, out)
            code, out, err = sh(sbx, "id -u; python3 -c 'import os; os.listdir(\"/\"); os.listdir(\"/usr/bin\")' && echo ran",
                                uid=65534, gid=65534)
            assert code == 0 and out.split() == ["65534", "ran"], (image, code, out, err)
        finally:
            sbx.kill()
            sbx.close()
