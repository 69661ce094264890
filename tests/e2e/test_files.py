"""Files and directories through the official SDK: round trips of small, empty, Unicode and large
binary files, ranged reads, directory operations, errors for missing and read-only paths, and
paths and symlinks that try to escape the sandbox (reads never reach the host, writes land inside)."""

from __future__ import annotations

import hashlib
import os
import uuid

import pytest
from opensandbox.exceptions import SandboxException
from opensandbox.models.execd import RunCommandOpts
from opensandbox.models.filesystem import (
    ContentReplaceEntry,
    DirectoryListEntry,
    MoveEntry,
    SearchEntry,
    SetPermissionEntry,
    WriteEntry,
)

import warren_e2e as W

sh = W.sh


def test_tiny_text_file(host_sandbox):
    host_sandbox.files.write_file("/tmp/hello.txt", "hello, warren\n")
    assert host_sandbox.files.read_file("/tmp/hello.txt") == "hello, warren\n"
    code, out, _ = sh(host_sandbox, "cat /tmp/hello.txt")
    assert out == "hello, warren\n" or out.strip() == "hello, warren"
    info = host_sandbox.files.get_file_info(["/tmp/hello.txt"])["/tmp/hello.txt"]
    assert info.size == len("hello, warren\n")
    assert info.mode == 755, "write_file's default mode is 755 (octal digits as a decimal int)"


def test_empty_and_unicode_files(host_sandbox):
    host_sandbox.files.write_files([
        WriteEntry(path="/tmp/empty.txt", data="", mode=644),
        WriteEntry(path="/tmp/uni.txt", data="ünïcødé ✓\n", mode=600),
    ])
    assert host_sandbox.files.read_file("/tmp/empty.txt") == ""
    assert host_sandbox.files.read_file("/tmp/uni.txt") == "ünïcødé ✓\n"
    infos = host_sandbox.files.get_file_info(["/tmp/empty.txt", "/tmp/uni.txt"])
    assert infos["/tmp/empty.txt"].mode == 644
    assert infos["/tmp/uni.txt"].mode == 600
    assert infos["/tmp/uni.txt"].size == len("ünïcødé ✓\n".encode())


@pytest.mark.timeout(300)
def test_50mib_binary_roundtrip(host_sandbox):
    data = os.urandom(50 * 1024 * 1024)
    digest = hashlib.sha256(data).hexdigest()
    # (wc rather than stat: coreutils' statx flags are refused by the gVisor release Debian ships)
    host_sandbox.files.write_file("/tmp/big.bin", data, mode=644)
    code, out, _ = sh(host_sandbox, "sha256sum /tmp/big.bin; wc -c < /tmp/big.bin")
    assert code == 0
    lines = out.split("\n")
    assert lines[0].split()[0] == digest, "bytes inside the sandbox differ from what was uploaded"
    assert lines[1].strip() == str(len(data))
    back = host_sandbox.files.read_bytes("/tmp/big.bin")
    assert len(back) == len(data)
    assert hashlib.sha256(back).hexdigest() == digest
    # streamed read too
    h = hashlib.sha256()
    n = 0
    for chunk in host_sandbox.files.read_bytes_stream("/tmp/big.bin", chunk_size=1 << 20):
        h.update(chunk)
        n += len(chunk)
    assert n == len(data) and h.hexdigest() == digest
    host_sandbox.files.delete_files(["/tmp/big.bin"])


def test_range_and_line_reads(host_sandbox):
    host_sandbox.files.write_file("/tmp/lines.txt", "".join(f"line{i}\n" for i in range(1, 11)))
    assert host_sandbox.files.read_bytes("/tmp/lines.txt", range_header="bytes=0-4") == b"line1"
    assert host_sandbox.files.read_bytes("/tmp/lines.txt", range_header="bytes=6-10") == b"line2"
    text = host_sandbox.files.read_file("/tmp/lines.txt", offset=3, limit=2)
    # joined, with no newline after the last, as the reference answers
    assert text == "line3\nline4", repr(text)
    host_sandbox.files.write_file("/tmp/crlf.txt", "a\r\nb\r\nc")
    assert host_sandbox.files.read_file("/tmp/crlf.txt", offset=1, limit=5) == "a\nb\nc"


def test_directories_and_file_ops(host_sandbox):
    base = f"/tmp/e2e-dir-{uuid.uuid4().hex[:6]}"
    fs = host_sandbox.files
    fs.create_directories([WriteEntry(path=f"{base}/a/b", mode=755)])
    fs.write_files([WriteEntry(path=f"{base}/a/one.txt", data="alpha beta alpha"),
                    WriteEntry(path=f"{base}/a/b/two.py", data="print(1)")])
    listing = fs.list_directory(DirectoryListEntry(path=base, depth=3))
    paths = sorted(e.path for e in listing)
    assert f"{base}/a" in paths and f"{base}/a/one.txt" in paths and f"{base}/a/b/two.py" in paths
    kinds = {e.path: e.entry_type for e in listing}
    assert kinds[f"{base}/a"] == "directory" and kinds[f"{base}/a/one.txt"] == "file"

    found = fs.search(SearchEntry(path=base, pattern="*.py"))
    assert [e.path for e in found] == [f"{base}/a/b/two.py"]

    results = fs.replace_contents_detailed([ContentReplaceEntry(path=f"{base}/a/one.txt",
                                                                old_content="alpha", new_content="gamma")])
    assert results[0].replaced_count == 2
    assert fs.read_file(f"{base}/a/one.txt") == "gamma beta gamma"

    fs.move_files([MoveEntry(src=f"{base}/a/one.txt", dest=f"{base}/moved.txt")])
    assert fs.read_file(f"{base}/moved.txt") == "gamma beta gamma"
    with pytest.raises(SandboxException):
        fs.read_file(f"{base}/a/one.txt")

    # Any non-root account of the sandbox's /etc/passwd (the host image shows the host's, which may
    # have only root); a bare uid otherwise, which execd reports back as the number.
    code, user, _ = sh(host_sandbox, "awk -F: '$3 != 0 { print $1; exit }' /etc/passwd")
    assert code == 0
    user = user.strip() or "4242"
    fs.set_permissions([SetPermissionEntry(path=f"{base}/moved.txt", mode=600, owner=user)])
    info = fs.get_file_info([f"{base}/moved.txt"])[f"{base}/moved.txt"]
    assert info.mode == 600 and info.owner == user

    fs.delete_files([f"{base}/moved.txt"])
    fs.delete_directories([base])
    code, out, _ = sh(host_sandbox, f"test -e {base} && echo exists || echo gone")
    assert out.strip() == "gone"


def test_directories_as_the_reference_counts_them(host_sandbox):
    """The reference's own file test, run unchanged: two directories made through the SDK are two
    lines of `ls | grep` (one stdout event per line) — the check that used to find 1 where 2 were
    expected; search finds files only, by name, with `*`; a listing walks depth first, a folder's
    contents right after it, and depth 0 lists nothing."""
    stamp = uuid.uuid4().hex[:10]
    d1, d2 = f"/tmp/fs_test1_{stamp}", f"/tmp/fs_test2_{stamp}"
    fs = host_sandbox.files
    fs.create_directories([WriteEntry(path=d1, mode=755), WriteEntry(path=d2, mode=644)])
    try:
        info = fs.get_file_info([d1, d2])
        assert info[d1].mode == 755 and info[d2].mode == 644
        ran = host_sandbox.commands.run(f"ls -la | grep fs_test | grep {stamp}",
                                        opts=RunCommandOpts(working_directory="/tmp"))
        assert ran.exit_code == 0
        assert len(ran.logs.stdout) == 2, [m.text for m in ran.logs.stdout]

        fs.write_files([WriteEntry(path=f"{d1}/f{i}.txt", data="x" * i, mode=644) for i in (1, 2, 3)]
                       + [WriteEntry(path=f"{d1}/sub/g.txt", data="g"),
                          WriteEntry(path=f"{d1}/sub.txt", data="s")])
        found = {e.path for e in fs.search(SearchEntry(path=d1, pattern="*"))}
        assert found == {f"{d1}/f1.txt", f"{d1}/f2.txt", f"{d1}/f3.txt", f"{d1}/sub/g.txt", f"{d1}/sub.txt"}, \
            "files only, at any depth"
        listing = [e.path for e in fs.list_directory(DirectoryListEntry(path=d1, depth=2))]
        assert listing == [f"{d1}/f1.txt", f"{d1}/f2.txt", f"{d1}/f3.txt", f"{d1}/sub", f"{d1}/sub/g.txt",
                           f"{d1}/sub.txt"]
        assert fs.list_directory(DirectoryListEntry(path=d1, depth=0)) == []
    finally:
        fs.delete_directories([d1, d2])


def test_missing_file(host_sandbox):
    with pytest.raises(SandboxException):
        host_sandbox.files.read_file("/tmp/definitely-missing-e2e.txt")
    with pytest.raises(SandboxException):
        host_sandbox.files.get_file_info(["/tmp/definitely-missing-e2e.txt"])


def test_relative_paths(host_sandbox):
    name = f"rel-{uuid.uuid4().hex[:6]}.txt"
    host_sandbox.files.write_file(name, "relative")
    assert host_sandbox.files.read_file(name) == "relative"


def test_write_to_readonly_host_path_fails(server, host_sandbox):
    """The host image's system folders are read-only."""
    server.require_image_store("the built-in host image")
    with pytest.raises(SandboxException):
        host_sandbox.files.write_file("/usr/e2e-should-not-exist", "x")
    assert not os.path.exists("/usr/e2e-should-not-exist")
    code, _, _ = sh(host_sandbox, "touch /usr/bin/e2e-nope")
    assert code != 0
    assert not os.path.exists("/usr/bin/e2e-nope")


# -- paths trying to leave the sandbox -------------------------------------------

@pytest.mark.parametrize("path", ["/../../../etc/shadow", "../../../../../../etc/shadow",
                                  "/tmp/../../../etc/shadow", "/proc/1/root/etc/shadow"])
def test_read_escape_does_not_reach_host(host_sandbox, path):
    host_shadow = open("/etc/shadow", "rb").read()
    try:
        got = host_sandbox.files.read_bytes(path)
    except SandboxException:
        return
    assert got != host_shadow, f"reading {path!r} returned the host's /etc/shadow"
    for line in host_shadow.splitlines():
        fields = line.split(b":")
        if len(fields) > 1 and len(fields[1]) > 3:  # a real password hash
            assert line not in got, "host password hash visible inside the sandbox"


def test_write_escape_lands_inside(server, host_sandbox):
    name = f"e2e-escape-{uuid.uuid4().hex[:8]}"
    try:
        host_sandbox.files.write_file(f"../../../../{name}", "inside")
    except SandboxException:
        wrote = False
    else:
        wrote = True
    try:
        host_sandbox.files.write_file(f"/tmp/../../../{name}-abs", "inside")
    except SandboxException:
        pass
    # never on the host
    candidates = [f"/{name}", f"/{name}-abs", f"/tmp/{name}", str(server.data_dir.parent / name),
                  str(server.data_dir / name), os.path.join(os.getcwd(), name)]
    for c in candidates:
        assert not os.path.exists(c), f"a sandbox file write escaped to the host: {c}"
    if wrote:
        code, out, _ = sh(host_sandbox, f"find / -xdev -name '{name}' 2>/dev/null; "
                                        f"ls /{name} /workspace/{name} 2>/dev/null; true")
        assert name in out, "the write succeeded but the file is nowhere inside the sandbox"


def test_symlink_escape(host_sandbox):
    """A symlink created inside the sandbox resolves inside the sandbox."""
    code, _, _ = sh(host_sandbox, "ln -sf / /tmp/rootlink")
    host_shadow = open("/etc/shadow", "rb").read()
    try:
        got = host_sandbox.files.read_bytes("/tmp/rootlink/etc/shadow")
    except SandboxException:
        return
    assert got != host_shadow


def test_files_with_identity(host_sandbox):
    """`files_with_identity(uid, gid)` (the 1.1.1 SDKs): every permission is checked as that user,
    and what it makes is its own."""
    root_fs, base = host_sandbox.files, f"/tmp/e2e-ident-{uuid.uuid4().hex[:6]}"
    root_fs.create_directories([WriteEntry(path=f"{base}/mine", mode=700)])
    root_fs.set_permissions([SetPermissionEntry(path=f"{base}/mine", mode=700, owner="41001", group="41000")])
    root_fs.write_files([WriteEntry(path=f"{base}/root-only.txt", data="root's", mode=600)])
    as_user = host_sandbox.files_with_identity(41001, 41000)
    as_other = host_sandbox.files_with_identity(41002, 41000)

    as_user.write_files([WriteEntry(path=f"{base}/mine/note.txt", data="hello", mode=640)])
    info = root_fs.get_file_info([f"{base}/mine/note.txt"])[f"{base}/mine/note.txt"]
    assert (info.owner, info.group, info.mode) == ("41001", "41000", 640), info
    assert as_user.read_file(f"{base}/mine/note.txt") == "hello"
    assert [e.path for e in as_user.search(SearchEntry(path=f"{base}/mine", pattern="*"))] == [f"{base}/mine/note.txt"]

    for attempt in (lambda: as_other.read_file(f"{base}/mine/note.txt"),
                    lambda: as_user.read_file(f"{base}/root-only.txt"),
                    lambda: as_other.write_files([WriteEntry(path=f"{base}/mine/x.txt", data="x")]),
                    lambda: as_other.list_directory(DirectoryListEntry(path=f"{base}/mine")),
                    lambda: as_user.delete_files([f"{base}/root-only.txt"])):
        with pytest.raises(SandboxException):
            attempt()
    assert root_fs.read_file(f"{base}/root-only.txt") == "root's", "the refused delete left it"
    # (python, not ls: the host's ls asks statx for what gVisor answers EINVAL)
    code, out, err = sh(host_sandbox, f"python3 -c 'import os; print(*os.listdir(\"{base}/mine\"))'")
    assert out.split() == ["note.txt"], (out, err)
    root_fs.delete_directories([base])
