#!/usr/bin/env python3
"""Writes the committed seed corpus of every fuzz target into fuzz/seeds/<target>/: small, valid
inputs that reach the interesting branches at once (the fuzzer mutates from there). Rerun after
changing a target's input format: python3 fuzz/make_seeds.py"""
import io
import json
import pathlib
import struct
import tarfile

SEEDS = pathlib.Path(__file__).resolve().parent / "seeds"


def write(target, name, data):
    d = SEEDS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


def tar(members, fmt=tarfile.PAX_FORMAT):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for info, data in members:
            t.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def entry(name, kind=tarfile.REGTYPE, data=b"", **kw):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    for k, v in kw.items():
        setattr(info, k, v)
    return info, (data if kind == tarfile.REGTYPE else None)


# --- unpack: layer tars
write("unpack", "files", tar([
    entry("etc", tarfile.DIRTYPE, mode=0o755),
    entry("etc/hostname", data=b"warren\n", mode=0o644, uid=0, gid=0),
    entry("bin/sh", data=b"#!\n", mode=0o4755, uid=1000, gid=1000),
    entry("bin/ash", tarfile.LNKTYPE, linkname="bin/sh"),
    entry("usr/bin/env", tarfile.SYMTYPE, linkname="../../bin/sh"),
    entry("dev/null", tarfile.CHRTYPE, devmajor=1, devminor=3),
    entry("run/fifo", tarfile.FIFOTYPE),
]))
write("unpack", "whiteouts", tar([
    entry("a/.wh.b"),
    entry("c/.wh..wh..opq"),
    entry("d/e", data=b"x"),
]))
write("unpack", "escapes", tar([
    entry("link", tarfile.SYMTYPE, linkname="/etc"),
    entry("link/passwd", data=b"root::0:0::/:/bin/sh\n"),
    entry("../up", data=b"x"),
    entry("hard", tarfile.LNKTYPE, linkname="../../etc/shadow"),
]))
long = "/".join(["d" * 100] * 12) + "/f"
write("unpack", "long-names-xattrs", tar([
    entry(long, data=b"deep"),
    entry("cap", data=b"x", pax_headers={"SCHILY.xattr.security.capability": "\x01\x00\x00\x02",
                                          "SCHILY.xattr.trusted.overlay.opaque": "y"}),
]))
write("unpack", "gnu-long", tar([entry("g" * 300, data=b"gnu")], fmt=tarfile.GNU_FORMAT))

# --- multipart: execd uploads (boundary B); the first byte is the piece size
def part(name, body, filename=None):
    disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return f"--B\r\nContent-Disposition: {disp}\r\n\r\n".encode() + body + b"\r\n"

meta = lambda **m: json.dumps(m).encode()
write("multipart", "two-files", bytes([7]) + part("metadata", meta(path="a.txt", mode=644))
      + part("file", b"hello\n", "a.txt") + part("metadata", meta(path="sub/dir/b.bin", owner="root", group="root", mode=600))
      + part("file", bytes(range(256)), "b.bin") + b"--B--\r\n")
write("multipart", "no-metadata", bytes([64]) + part("file", b"x", "x") + b"--B--\r\n")
write("multipart", "proc-and-escape", bytes([1]) + part("metadata", meta(path="../../../proc/self/fd/1"))
      + part("file", b"x", "x") + part("metadata", meta(path="/proc/1/mem")) + part("file", b"y", "y") + b"--B--\r\n")

# --- dns: queries and answers
def query(name, qtype=1, ident=0x1234):
    m = struct.pack(">HBBHHHH", ident, 1, 0, 1, 0, 0, 0)
    for label in name.split("."):
        m += bytes([len(label)]) + label.encode()
    return m + b"\0" + struct.pack(">HH", qtype, 1)

write("dns", "a", query("api.example.com"))
write("dns", "aaaa", query("Mixed.Case.test", 28))
write("dns", "txt", query("x.y", 16))
ans = bytearray(query("api.example.com"))
ans[2] |= 0x80
ans[6:8] = struct.pack(">H", 2)
ans += b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + bytes([10, 0, 0, 1])
ans += b"\xc0\x0c" + struct.pack(">HHIH", 5, 1, 60, 2) + b"\xc0\x0c"
write("dns", "answer", bytes(ans))

# --- egress_policy: a JSON policy, a nul byte, then names one per line
policy = {"defaultAction": "deny", "egress": [
    {"action": "allow", "target": "*.example.com"},
    {"action": "allow", "target": "pypi.org"},
    {"action": "deny", "target": "10.0.0.0/8"},
    {"action": "allow", "target": "192.168.1.7"},
]}
write("egress_policy", "mixed", json.dumps(policy).encode() + b"\0api.example.com\nexample.com\nPYPI.ORG\nevil.test\n")
write("egress_policy", "allow", json.dumps({"defaultAction": "allow", "egress": [{"action": "deny", "target": "*.bad"}]}).encode()
      + b"\0x.bad\nbad\n")

# --- create_request: create bodies and bare quantities
write("create_request", "full", json.dumps({
    "image": {"uri": "python:3.11"}, "entrypoint": ["python", "-c", "print(1)"], "timeout": 600,
    "resourceLimits": {"cpu": "500m", "memory": "512Mi", "ephemeral-storage": "1Gi", "pids": "64"},
    "env": {"A": "1"}, "metadata": {"team": "x"}, "extensions": {"k": "v"},
    "networkPolicy": policy,
    "volumes": [{"name": "data", "host": {"path": "/tmp/warren-fuzz-volumes/x"}, "mountPath": "/data", "readOnly": True},
                {"name": "v", "pvc": {"claimName": "shared"}, "mountPath": "/v", "subPath": "a/b"}],
}))
write("create_request", "minimal", json.dumps({"image": {"uri": "busybox"}, "entrypoint": ["sh"]}))
for i, q in enumerate(["1.5", "250m", "2Gi", "1e3", "0.001", "18446744073709551615", "1E", "3Ki"]):
    write("create_request", f"quantity-{i}", q)

# --- session_stream: the first byte picks the piece size
write("session_stream", "rc", b"\x03hello\n__WARREN_END_t_17__\n")
write("session_stream", "utf8-and-partial", "\x05héllo €\n__WARREN_END_t__WARREN_END_t_0__\nafter".encode())
write("session_stream", "no-marker", b"\x01\xff\xe2\x82\xacplain __WARREN_END")
