//! The one resolver for references to what Warren stores for a tenant: an image reference in the
//! snapshot repository (however it is spelt), an image named by its store id, `snapshotId` (and
//! `templateId`, which becomes its golden image's `snapshotId`), named volumes and pools.
//!
//! Why one place: each reference used to be checked where it was read, and one was not. A create
//! with `image.uri = "warren-snapshot/<another tenant's snapshot id>"` ran that snapshot, though
//! `snapshotId` and `GET /snapshots/{id}` checked the tenant. Every plan — a create's, a
//! pool's template, a template's build — now goes through [`Stored::resolve`] once it is its
//! tenant's ([`crate::validate::CreatePlan::set_tenant`], which names volumes here too), so a new
//! way in cannot skip the check. Another tenant's object answers exactly as a missing one: every
//! answer is made from what the caller gave, never from what was found.
//!
//! The rule for using a stored object in something new is that it belongs to the tenant the new
//! thing will belong to, not merely that the caller sees it: an admin acting for no tenant makes
//! the default tenant's sandboxes, and those restore only the default tenant's snapshots.

use std::sync::Arc;

use warren_api::ErrorCode;
use warren_image::{ImageStore, SNAPSHOT_REPOSITORY};
use warren_store::DEFAULT_TENANT;

use crate::error::{ErrorKind, SandboxError};
use crate::snapshots::Snapshots;
use crate::validate::CreatePlan;

/// Spellings of Docker Hub a reference may start with (the image store drops them when it
/// normalises a name), and `library/`, which it drops from one-component names: a snapshot name
/// behind any of them is still looked at here.
const REGISTRY_PREFIXES: [&str; 4] = [
    "docker.io/",
    "index.docker.io/",
    "registry-1.docker.io/",
    "library/",
];

#[derive(Clone)]
pub struct Stored {
    snapshots: Snapshots,
    images: Arc<ImageStore>,
}

impl Stored {
    pub fn new(snapshots: Snapshots, images: Arc<ImageStore>) -> Self {
        Stored { snapshots, images }
    }

    /// Makes `plan`, already its tenant's, run only what that tenant may: a `snapshotId`, or an
    /// image reference to the snapshot repository, becomes that snapshot's image when the
    /// snapshot is the tenant's and Ready; an image id must name an image outside the snapshot
    /// repository. Anything else is left as it is (a registry name, the `host` image).
    pub fn resolve(&self, plan: &mut CreatePlan) -> Result<(), SandboxError> {
        plan.image = match &plan.snapshot_id {
            Some(id) => self.snapshots.image_for_restore(id, &plan.tenant)?,
            None => self.image(&plan.image, &plan.tenant)?,
        };
        Ok(())
    }

    /// The image `uri` runs for `tenant` (see [`Stored::resolve`]).
    pub fn image(&self, uri: &str, tenant: &str) -> Result<String, SandboxError> {
        let uri = uri.trim();
        if let Some(id) = snapshot_named(uri)? {
            return self.snapshots.image_for_restore(&id, tenant);
        }
        if warren_image::is_image_id(uri) {
            // The store takes an id as well as a name, and a snapshot's image has one: an id is
            // good only for an image some other name holds. Snapshots are named by their own id.
            let names = self
                .images
                .names_of(uri)
                .map_err(|e| SandboxError::internal("looking up an image id", &e))?;
            if !names.iter().any(|n| !n.starts_with(SNAPSHOT_REPOSITORY)) {
                return Err(SandboxError::new(
                    ErrorKind::NotFound,
                    ErrorCode::ImageNotFound,
                    format!(
                        "image {uri:?} is not in the local store (an image id names an image the store holds; a snapshot is named warren-snapshot/<snapshot id>)"
                    ),
                ));
            }
        }
        Ok(uri.to_string())
    }
}

/// The snapshot id an image reference names, in every spelling that reaches an image of the
/// snapshot repository (`warren-snapshot/ID`, `:latest`, behind a Docker Hub prefix, and
/// `warren-snapshot://ID` as a template's `manifestRef` shows it), matched without regard to
/// case so that no spelling slips past as a registry name to pull. `Ok(None)`: not a snapshot
/// reference. A tag other than `latest` or a digest names nothing there: 400, decided from the
/// text alone, so it says nothing about whether the snapshot exists.
pub fn snapshot_named(uri: &str) -> Result<Option<String>, SandboxError> {
    let repository = SNAPSHOT_REPOSITORY.trim_end_matches('/');
    let mut rest = uri.trim();
    for prefix in REGISTRY_PREFIXES {
        if let Some(r) = strip_prefix_ignore_case(rest, prefix) {
            rest = r;
        }
    }
    let Some(rest) = strip_prefix_ignore_case(rest, &format!("{repository}://"))
        .or_else(|| strip_prefix_ignore_case(rest, SNAPSHOT_REPOSITORY))
    else {
        return Ok(None);
    };
    let (name, digest) = match rest.split_once('@') {
        Some((n, d)) => (n, Some(d)),
        None => (rest, None),
    };
    let (id, tag) = match name.rsplit_once(':') {
        Some((id, tag)) => (id, Some(tag)),
        None => (name, None),
    };
    if digest.is_some() || tag.is_some_and(|t| !t.eq_ignore_ascii_case("latest")) || id.is_empty() {
        return Err(SandboxError::invalid(format!(
            "image {uri:?}: a snapshot is named {SNAPSHOT_REPOSITORY}<snapshot id>, with no other tag and no digest (or give snapshotId)"
        )));
    }
    Ok(Some(id.to_string()))
}

fn strip_prefix_ignore_case<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &s[prefix.len()..])
}

/// A pool's key: its name, qualified by its tenant unless that is the default one (whose pools,
/// and their sandboxes' records, keep the names they had before tenants). Pool names and tenant
/// names hold no `/`, so keys of two tenants never meet.
pub fn pool_key(tenant: &str, name: &str) -> String {
    if tenant == DEFAULT_TENANT {
        name.to_string()
    } else {
        format!("{tenant}/{name}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshots::{SnapshotRecord, READY};
    use crate::volumes::volume_name;

    const A: &str = "11111111-2222-4333-8444-555555555555";
    const B: &str = "66666666-7777-4888-8999-aaaaaaaaaaaa";

    #[test]
    fn every_spelling_of_a_snapshot_image_names_its_snapshot() {
        for uri in [
            format!("warren-snapshot/{A}"),
            format!("warren-snapshot/{A}:latest"),
            format!("  warren-snapshot/{A}\n"),
            format!("WARREN-SNAPSHOT/{A}"),
            format!("Warren-Snapshot/{A}:LATEST"),
            format!("docker.io/warren-snapshot/{A}"),
            format!("index.docker.io/warren-snapshot/{A}:latest"),
            format!("registry-1.docker.io/warren-snapshot/{A}"),
            format!("docker.io/library/warren-snapshot/{A}"),
            format!("warren-snapshot://{A}"),
            format!("Warren-Snapshot://{A}"),
        ] {
            assert_eq!(
                snapshot_named(&uri).expect(&uri).as_deref(),
                Some(A),
                "{uri:?}"
            );
        }
        for other in [
            "host",
            "python:3.11",
            "warren-test:bookworm",
            "localhost:5000/warren-snapshot/x",
            "warren-snapshots/x",
            "my/warren-snapshot/x",
        ] {
            assert_eq!(snapshot_named(other).expect(other), None, "{other:?}");
        }
        for bad in [
            format!("warren-snapshot/{A}:v2"),
            format!("warren-snapshot/{A}@sha256:{}", "a".repeat(64)),
            format!("warren-snapshot/{A}:latest@sha256:{}", "a".repeat(64)),
            "warren-snapshot/".to_string(),
            "warren-snapshot://".to_string(),
        ] {
            let e = snapshot_named(&bad).expect_err(&bad);
            assert_eq!(e.kind, ErrorKind::Invalid, "{bad:?}");
        }
    }

    #[test]
    fn a_default_tenant_claim_names_no_other_tenant_s_volume() {
        assert_eq!(volume_name(DEFAULT_TENANT, "data").expect("plain"), "data");
        assert_eq!(volume_name("alpha", "data").expect("alpha"), "alpha.data");
        assert_eq!(volume_name("alpha", "x.y").expect("dotted"), "alpha.x.y");
        let e = volume_name(DEFAULT_TENANT, "alpha.data").expect_err("dotted default");
        assert_eq!(e.kind, ErrorKind::Invalid);
        assert!(e.to_string().contains("alpha.data"), "{}", e.to_string());
        // Every default-tenant name differs from every tenant's: one has a dot, the other none.
        for claim in ["data", "alpha-data", "x_y"] {
            let mine = volume_name(DEFAULT_TENANT, claim).expect("default");
            assert!(!mine.contains('.'));
        }
        assert_eq!(pool_key(DEFAULT_TENANT, "warm"), "warm");
        assert_eq!(pool_key("alpha", "warm"), "alpha/warm");
    }

    /// Two tenants' Ready snapshots (`A` is acme's, `B` globex's), each with an image in the store.
    fn two_tenants() -> (tempfile::TempDir, Stored) {
        let dir = tempfile::tempdir().expect("tempdir");
        let runtime = Arc::new(warren_core::fake::FakeRuntime::default());
        let sandboxes = crate::sandboxes::tests::sandboxes(dir.path(), runtime);
        let rootfs = dir.path().join("rootfs");
        std::fs::create_dir_all(rootfs.join("etc")).expect("rootfs");
        std::fs::write(rootfs.join("etc/who"), "acme").expect("file");
        std::fs::create_dir_all(dir.path().join("snapshots")).expect("dir");
        for (id, tenant) in [(A, "acme"), (B, "globex")] {
            let image = format!("{SNAPSHOT_REPOSITORY}{id}");
            sandboxes.images().import(&image, &rootfs).expect("import");
            let now = chrono::Utc::now();
            let rec = SnapshotRecord {
                id: id.into(),
                sandbox_id: "sbx".into(),
                name: None,
                state: READY.into(),
                reason: None,
                message: None,
                created_at: now,
                last_transition_at: now,
                image,
                tenant: tenant.into(),
                size_bytes: Some(1),
            };
            std::fs::write(
                dir.path().join("snapshots").join(format!("{id}.json")),
                serde_json::to_vec(&rec).expect("json"),
            )
            .expect("record");
        }
        let quotas = Arc::new(crate::quotas::Quotas::new(&Default::default()).expect("quotas"));
        let snapshots = Snapshots::open(dir.path(), sandboxes.clone(), quotas).expect("snapshots");
        let images = sandboxes.images().clone();
        (dir, Stored::new(snapshots, images))
    }

    fn answer(r: Result<String, SandboxError>) -> (ErrorKind, String, String) {
        let e = r.expect_err("refused");
        (e.kind, format!("{:?}", e.code), e.to_string())
    }

    #[tokio::test]
    async fn another_tenant_s_snapshot_answers_as_a_missing_one_by_every_reference() {
        let (dir, stored) = two_tenants();
        let missing = "00000000-0000-4000-8000-000000000000";
        // Its own: the snapshot's image, however it was named.
        for uri in [
            format!("warren-snapshot/{A}"),
            format!("docker.io/warren-snapshot/{A}:latest"),
            format!("warren-snapshot://{A}"),
        ] {
            assert_eq!(
                stored.image(&uri, "acme").expect("own"),
                format!("{SNAPSHOT_REPOSITORY}{A}")
            );
        }
        // Another tenant's (and the default tenant's, an admin acting for none): exactly as missing.
        for tenant in ["globex", DEFAULT_TENANT] {
            let spellings: [fn(&str) -> String; 4] = [
                |id| format!("warren-snapshot/{id}"),
                |id| format!("WARREN-SNAPSHOT/{id}:latest"),
                |id| format!("index.docker.io/warren-snapshot/{id}"),
                |id| format!("warren-snapshot://{id}"),
            ];
            for spell in spellings {
                let theirs = answer(stored.image(&spell(A), tenant));
                let none = answer(stored.image(&spell(missing), tenant));
                assert_eq!(theirs.0, ErrorKind::NotFound);
                assert_eq!(theirs.0, none.0);
                assert_eq!(theirs.1, none.1);
                assert_eq!(theirs.2.replace(A, missing), none.2);
            }
            // snapshotId, through a plan.
            let mut plan = crate::sandboxes::tests::plan();
            plan.set_tenant(tenant).expect("tenant");
            plan.snapshot_id = Some(A.into());
            let theirs = stored.resolve(&mut plan).expect_err("theirs");
            plan.snapshot_id = Some(missing.into());
            let none = stored.resolve(&mut plan).expect_err("missing");
            assert_eq!(
                (theirs.kind, theirs.to_string().replace(A, missing)),
                (none.kind, none.to_string())
            );
        }
        // By the store's image id: no snapshot's image, not even its owner's, as a missing id.
        let id = match stored.images.resolve(&format!("{SNAPSHOT_REPOSITORY}{A}")) {
            Ok(warren_image::ResolvedImage::Layers { id, .. }) => id,
            other => panic!("{other:?}"),
        };
        let missing_id = format!("sha256:{}", "0".repeat(64));
        for tenant in ["acme", "globex"] {
            let theirs = answer(stored.image(&id, tenant));
            let none = answer(stored.image(&missing_id, tenant));
            assert_eq!(theirs.0, ErrorKind::NotFound);
            assert_eq!((theirs.0, theirs.1), (none.0, none.1));
            assert_eq!(theirs.2.replace(&id, &missing_id), none.2);
        }
        // An id another name holds too is that image's.
        let rootfs = dir.path().join("rootfs");
        stored.images.import("plain:1", &rootfs).expect("import");
        assert_eq!(stored.image(&id, "globex").expect("plain"), id);
        // Registry names pass as they are.
        assert_eq!(
            stored.image(" python:3.11 ", "globex").expect("name"),
            "python:3.11"
        );
    }
}
