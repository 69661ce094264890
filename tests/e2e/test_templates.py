"""Templates (`/v1/templates`, `templateId` on create) through the official SDK: a golden
image built from an image once — started, probed until ready, snapshotted — and sandboxes started
from it with the template's workload. Built on snapshots, so on the runtimes that take them."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from opensandbox import SandboxSync
from opensandbox.exceptions import SandboxException
from opensandbox.models.templates import CreateTemplateRequest, TemplateFilter, TemplateReadiness

import warren_e2e as W

PORT = 18765


def _wait(manager, tid: str, timeout: float = 180):
    return W.wait_until(lambda: (t := manager.get_template(tid)).status.phase in ("Succeeded", "Failed") and t,
                        timeout, interval=0.3, message=f"template {tid} to finish building")


def test_template_build_and_sandboxes_from_it(server, manager, api):
    tag = uuid.uuid4().hex[:10]
    # an image of the store (the built-in host image has no layer of its own to snapshot)
    server.import_image(W.TEST_IMAGE_NAME, W.test_rootfs())
    image = W.TEST_IMAGE_NAME
    # The warmup writes a marker into the file system (kept by the golden image) and serves a port
    # (the readiness probe); the sandboxes made from it run the same entrypoint again, which keeps
    # the marker it finds.
    entry = ["sh", "-c", f"mkdir -p /var/warm && {{ [ -e /var/warm/marker ] || date +%s%N > /var/warm/marker; }} && "
                         f"exec python3 -m http.server {PORT} --bind 127.0.0.1"]
    created = manager.create_template(CreateTemplateRequest(
        image=image, publish="s3://bucket/e2e", entrypoint=entry, env={"E2E_TEMPLATE": tag},
        resource_limits={"cpu": "1", "memory": "512Mi"}, metadata={"e2e-template": tag},
        readiness=TemplateReadiness(probe=f"tcp://127.0.0.1:{PORT}", warmup_seconds=60)))
    tid = created.template_id
    try:
        assert tid.startswith("tpl_") and created.status.phase in ("Pending", "Building")
        assert created.format == "native"
        done = _wait(manager, tid)
        if not server.caps.snapshots:
            # no snapshots there: the build ends Failed and says why
            assert done.status.phase == "Failed" and done.status.message, done.status
            with pytest.raises(SandboxException):
                SandboxSync.create_from_template(tid, timeout=timedelta(minutes=5),
                                                 connection_config=server.sdk_config())
            return
        assert done.status.phase == "Succeeded", done.status
        assert done.status.manifest_ref
        listed = manager.list_templates(TemplateFilter(metadata={"e2e-template": tag}))
        assert [t.template_id for t in listed.template_infos] == [tid]
        # the build's sandbox is gone, and was never listed
        assert not [s for s in api.get("/v1/sandboxes", params={"pageSize": 1000}).json()["items"]
                    if (s.get("metadata") or {}).get("e2e-template") == tag]

        markers = []
        for _ in range(2):
            sbx = SandboxSync.create_from_template(tid, timeout=timedelta(minutes=5), metadata={"from": tag},
                                                   connection_config=server.sdk_config())
            W.track_sandbox(sbx.id)
            try:
                code, out, err = W.sh(sbx, "cat /var/warm/marker; echo $E2E_TEMPLATE")
                assert code == 0, err
                marker, env = out.split()
                assert env == tag
                markers.append(marker)
                # the template's entrypoint runs again in the new sandbox
                probe = f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {PORT}), 2)\""
                W.wait_until(lambda: W.sh(sbx, probe)[0] == 0, 20, interval=0.2,
                             message="the template's entrypoint to listen")
                assert sbx.get_info().metadata.get("from") == tag
            finally:
                sbx.kill()
        # Both sandboxes hold the marker the build's warmup wrote (the entrypoint writes one only
        # where none is): the same golden image, not a warmup of their own.
        assert markers[0] == markers[1], markers

        # The template fixes the workload: a create that shapes it too is refused, each field by
        # name, as the 1.1.2 spec lists them; the timeout is required.
        for extra, field in (({"entrypoint": ["sh"]}, "entrypoint"),
                             ({"secureAccess": True}, "secureAccess"),
                             ({"lifecycle": {"preStart": {"command": ["true"]}}}, "lifecycle.preStart"),
                             ({"lifecycle": {"periodic": [{"name": "p", "schedule": "* * * * *",
                                                           "command": ["true"]}]}}, "lifecycle.periodic")):
            r = api.post("/v1/sandboxes", json={"templateId": tid, "timeout": 300, **extra})
            W.assert_error_body(r, codes=[400])
            assert field in r.json()["message"], r.json()
        r = api.post("/v1/sandboxes", json={"templateId": tid, "image": {"uri": image}, "timeout": 300})
        W.assert_error_body(r, codes=[400])
        r = api.post("/v1/sandboxes", json={"templateId": tid})
        W.assert_error_body(r, codes=[400])
        assert "timeout" in r.json()["message"]
        # credentialProxy is accepted and ignored (the vault's first create starts the proxy), and
        # the idle policy is the request's: control-plane state, not workload shape.
        r = api.post("/v1/sandboxes", json={"templateId": tid, "timeout": 300,
                                            "credentialProxy": {"enabled": True},
                                            "lifecycle": {"idlePolicy": {"idleTimeoutSeconds": 600, "onIdle": "pause"}}})
        assert r.status_code in (200, 202), r.text
        W.track_sandbox(r.json()["id"])
        assert api.delete(f"/v1/sandboxes/{r.json()['id']}").status_code == 204
    finally:
        manager.delete_template(tid)
    with pytest.raises(SandboxException):
        manager.get_template(tid)
    r = api.post("/v1/sandboxes", json={"templateId": tid, "timeout": 300})
    W.assert_error_body(r, codes=[404])


def test_template_whose_probe_never_passes_fails(server, manager, api):
    image = server.sandbox_image("host")
    t = manager.create_template(CreateTemplateRequest(
        image=image, publish="s3://bucket/e2e",
        readiness=TemplateReadiness(probe="cmd://test -e /nonexistent-ready-file", warmup_seconds=2)))
    try:
        done = _wait(manager, t.template_id, 60)
        assert done.status.phase == "Failed" and "readiness probe" in (done.status.message or ""), done.status
        # Not Succeeded: 404, as the spec has it (no existence leak), with the reason in the message.
        r = api.post("/v1/sandboxes", json={"templateId": t.template_id, "timeout": 300})
        W.assert_error_body(r, codes=[404])
    finally:
        manager.delete_template(t.template_id)


def test_template_whose_golden_image_was_deleted_fails(server, manager, api):
    """The golden image is an ordinary snapshot: deleted through /snapshots, the template cannot start
    anything any more and says so (Failed, 404 on create) instead of a restore error."""
    server.require("snapshots", "templates are built on snapshots: embedded and runc")
    server.import_image(W.TEST_IMAGE_NAME, W.test_rootfs())
    t = manager.create_template(CreateTemplateRequest(
        image=W.TEST_IMAGE_NAME, publish="s3://bucket/e2e", entrypoint=["sleep", "infinity"],
        readiness=TemplateReadiness(warmup_seconds=0)))
    try:
        done = _wait(manager, t.template_id)
        assert done.status.phase == "Succeeded", done.status
        snapshot = done.status.manifest_ref.removeprefix("warren-snapshot://")
        assert api.delete(f"/v1/snapshots/{snapshot}").status_code in (200, 204)
        r = api.post("/v1/sandboxes", json={"templateId": t.template_id, "timeout": 300})
        W.assert_error_body(r, codes=[404])
        assert "golden image" in r.json()["message"], r.json()
        after = manager.get_template(t.template_id)
        assert after.status.phase == "Failed" and snapshot in (after.status.message or ""), after.status
    finally:
        manager.delete_template(t.template_id)


@pytest.mark.parametrize("body", [
    {"image": "", "publish": "s3://b/p"},
    {"image": "host", "publish": ""},
    {"image": "host", "publish": "s3://b/p", "readiness": {"probe": "tcp://10.0.0.1:80"}},
    {"image": "host", "publish": "s3://b/p", "readiness": {"probe": "http://x"}},
    {"image": "host", "publish": "s3://b/p", "format": "squashfs"},
])
def test_bad_templates_are_refused(api, body):
    W.assert_error_body(api.post("/v1/templates", json=body), codes=[400])


def test_unknown_template(api):
    W.assert_error_body(api.get("/v1/templates/tpl_nope"), codes=[404])
    W.assert_error_body(api.delete("/v1/templates/tpl_nope"), codes=[404])
