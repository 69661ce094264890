//! The OCI / Docker image documents Warren reads (index, manifest, config), shared by imports of
//! archives and layouts and by registry pulls, and the choice of one platform's manifest from an index.

use std::collections::HashMap;

use serde::Deserialize;

use crate::reference::Reference;
use crate::ImageConfig;

pub const MEDIA_OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const MEDIA_OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const MEDIA_DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const MEDIA_DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";

const REF_NAME_ANNOTATION: &str = "org.opencontainers.image.ref.name";
const CONTAINERD_NAME_ANNOTATION: &str = "io.containerd.image.name";

#[derive(Debug, Deserialize, Clone)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    #[serde(default)]
    pub media_type: String,
    pub digest: String,
    #[serde(default)]
    pub size: Option<u64>,
    #[serde(default)]
    pub platform: Option<Platform>,
    #[serde(default)]
    pub annotations: HashMap<String, String>,
}

#[derive(Debug, Deserialize, Clone)]
pub struct Platform {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
}

/// Both an index and a manifest: which one it is shows in which fields are set.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Document {
    #[serde(default)]
    pub schema_version: Option<u32>,
    #[serde(default)]
    pub media_type: Option<String>,
    #[serde(default)]
    pub manifests: Option<Vec<Descriptor>>,
    #[serde(default)]
    pub config: Option<Descriptor>,
    #[serde(default)]
    pub layers: Vec<Descriptor>,
}

impl Document {
    /// The manifest's config descriptor, `None` for an index or something that is neither.
    pub fn manifest_config(&self) -> Option<&Descriptor> {
        let is_manifest = self
            .media_type
            .as_deref()
            .is_none_or(|m| m.contains("manifest") && !m.contains("list"));
        self.config.as_ref().filter(|_| is_manifest)
    }
}

/// The parts of an image config blob Warren uses.
#[derive(Debug, Deserialize, Default)]
pub struct ConfigFile {
    #[serde(default)]
    config: Option<ContainerConfig>,
    #[serde(default)]
    rootfs: Option<RootFs>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(rename_all = "PascalCase")]
struct ContainerConfig {
    #[serde(default)]
    env: Option<Vec<String>>,
    #[serde(default)]
    entrypoint: Option<Vec<String>>,
    #[serde(default)]
    cmd: Option<Vec<String>>,
    #[serde(default)]
    working_dir: Option<String>,
    #[serde(default)]
    user: Option<String>,
}

#[derive(Debug, Deserialize, Default)]
struct RootFs {
    #[serde(default)]
    diff_ids: Vec<String>,
}

impl ConfigFile {
    /// The process configuration (env, entrypoint, cmd, working dir, user).
    pub fn image_config(&self) -> ImageConfig {
        let Some(c) = &self.config else {
            return ImageConfig::default();
        };
        ImageConfig {
            env: c.env.clone().unwrap_or_default(),
            entrypoint: c.entrypoint.clone().unwrap_or_default(),
            cmd: c.cmd.clone().unwrap_or_default(),
            working_dir: c.working_dir.clone().filter(|w| !w.is_empty()),
            user: c.user.clone().filter(|u| !u.is_empty()),
        }
    }

    /// `rootfs.diff_ids` as given (`sha256:<hex>` each), lowest layer first.
    pub fn diff_ids(&self) -> &[String] {
        self.rootfs
            .as_ref()
            .map(|r| r.diff_ids.as_slice())
            .unwrap_or(&[])
    }
}

/// Refuses layer media types Warren cannot unpack (encrypted, foreign/Windows, unknown compression).
/// Compression itself is recognised from the stream (gzip, zstd or none), not from the type.
pub fn check_layer_media_type(media_type: &str) -> Result<(), String> {
    let known = media_type.is_empty()
        || [
            "application/vnd.oci.image.layer.v1.tar",
            "application/vnd.oci.image.layer.v1.tar+gzip",
            "application/vnd.oci.image.layer.v1.tar+zstd",
            "application/vnd.oci.image.layer.nondistributable.v1.tar",
            "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
            "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
            "application/vnd.docker.image.rootfs.diff.tar",
            "application/vnd.docker.image.rootfs.diff.tar.gzip",
            "application/vnd.docker.image.rootfs.diff.tar.zstd",
        ]
        .contains(&media_type);
    if known {
        Ok(())
    } else {
        Err(format!("unsupported layer media type {media_type}"))
    }
}

/// The platform this machine runs images of, as an index names it (`linux`, `amd64`).
pub fn host_platform() -> (&'static str, &'static str) {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        "s390x" => "s390x",
        "riscv64" => "riscv64",
        "arm" => "arm",
        other => other,
    };
    ("linux", arch)
}

/// Picks one manifest from an index: the one named like `wanted` (the top-level index of a layout
/// only), else the host's platform; attestation entries (`unknown/unknown`) never count.
pub fn pick_manifest<'a>(
    manifests: &'a [Descriptor],
    wanted: Option<&Reference>,
) -> Result<&'a Descriptor, String> {
    let mut candidates: Vec<&Descriptor> = manifests
        .iter()
        .filter(|d| {
            d.platform
                .as_ref()
                .is_none_or(|p| p.os != "unknown" && p.architecture != "unknown")
        })
        .collect();
    if let Some(wanted) = wanted {
        let full = wanted.to_string();
        let tag = wanted.tag.as_deref().unwrap_or("latest");
        let named: Vec<&Descriptor> = candidates
            .iter()
            .copied()
            .filter(|d| {
                d.annotations
                    .get(REF_NAME_ANNOTATION)
                    .is_some_and(|n| n == tag || *n == full)
                    || d.annotations
                        .get(CONTAINERD_NAME_ANNOTATION)
                        .is_some_and(|n| *n == full)
            })
            .collect();
        if !named.is_empty() {
            candidates = named;
        }
    }
    let (os, arch) = host_platform();
    if candidates.iter().any(|d| d.platform.is_some()) {
        return candidates
            .into_iter()
            .find(|d| {
                d.platform
                    .as_ref()
                    .is_none_or(|p| p.os == os && p.architecture == arch)
            })
            .ok_or_else(|| format!("no {os}/{arch} image in the index"));
    }
    candidates
        .into_iter()
        .next()
        .ok_or_else(|| "empty image index".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(digest: &str, platform: Option<(&str, &str)>, name: Option<&str>) -> Descriptor {
        Descriptor {
            media_type: MEDIA_OCI_MANIFEST.into(),
            digest: digest.into(),
            size: None,
            platform: platform.map(|(os, architecture)| Platform {
                os: os.into(),
                architecture: architecture.into(),
            }),
            annotations: name
                .map(|n| HashMap::from([(REF_NAME_ANNOTATION.to_owned(), n.to_owned())]))
                .unwrap_or_default(),
        }
    }

    #[test]
    fn picks_host_platform_and_skips_attestations() {
        let (_, arch) = host_platform();
        let other = if arch == "arm64" { "amd64" } else { "arm64" };
        let list = [
            desc("other", Some(("linux", other)), None),
            desc("att", Some(("unknown", "unknown")), None),
            desc("host", Some(("linux", arch)), None),
        ];
        assert_eq!(
            pick_manifest(&list, None).map(|d| d.digest.as_str()),
            Ok("host")
        );
        assert!(pick_manifest(&list[..2], None).is_err());
        let plain = [desc("a", None, None), desc("b", None, None)];
        assert_eq!(
            pick_manifest(&plain, None).map(|d| d.digest.as_str()),
            Ok("a")
        );
    }

    #[test]
    fn picks_by_ref_name_annotation() {
        let list = [
            desc("one", None, Some("1.0")),
            desc("two", None, Some("2.0")),
        ];
        let wanted = Reference::parse("x:2.0").expect("ref");
        assert_eq!(
            pick_manifest(&list, Some(&wanted)).map(|d| d.digest.as_str()),
            Ok("two")
        );
        let other = Reference::parse("x:3.0").expect("ref");
        assert_eq!(
            pick_manifest(&list, Some(&other)).map(|d| d.digest.as_str()),
            Ok("one")
        );
    }

    #[test]
    fn a_manifest_list_is_not_a_manifest() {
        let doc: Document = serde_json::from_str(&format!(
            r#"{{"mediaType":"{MEDIA_DOCKER_LIST}","config":{{"digest":"x"}},"manifests":[]}}"#
        ))
        .expect("json");
        assert!(doc.manifest_config().is_none());
        let doc: Document = serde_json::from_str(
            r#"{"schemaVersion":2,"config":{"digest":"c"},"layers":[{"digest":"l"}]}"#,
        )
        .expect("json");
        assert_eq!(doc.manifest_config().map(|d| d.digest.as_str()), Some("c"));
    }
}
