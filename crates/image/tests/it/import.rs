//! Importing each kind of source, and refusing bad ones without leaving anything behind.

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde_json::json;
use tar::EntryType;
use warren_image::{ImageConfig, ImageError, ResolvedImage};

use crate::support::*;

fn layers_of(resolved: &ResolvedImage) -> (Vec<PathBuf>, ImageConfig) {
    match resolved {
        ResolvedImage::Layers { layers, config, .. } => (layers.clone(), config.clone()),
        ResolvedImage::Host => panic!("resolved to host"),
    }
}

fn make_rootfs(root: &Path) {
    fs::create_dir_all(root.join("usr/bin")).expect("mkdir");
    fs::create_dir_all(root.join("etc")).expect("mkdir");
    fs::write(root.join("etc/os-release"), b"ID=warren\n").expect("write");
    fs::write(root.join("usr/bin/tool"), b"#!/bin/sh\necho hi\n").expect("write");
    // chown first: it clears the setuid bit.
    std::os::unix::fs::lchown(root.join("usr/bin/tool"), Some(12), Some(34)).expect("chown");
    fs::set_permissions(
        root.join("usr/bin/tool"),
        fs::Permissions::from_mode(0o4755),
    )
    .expect("chmod");
    std::os::unix::fs::symlink("usr/bin", root.join("bin")).expect("symlink");
    fs::hard_link(
        root.join("etc/os-release"),
        root.join("etc/os-release.link"),
    )
    .expect("link");
}

#[test]
fn imports_a_rootfs_folder() {
    let (data, store) = store();
    let src = tempfile::tempdir().expect("src");
    make_rootfs(src.path());

    let record = store.import("myroot", src.path()).expect("import");
    assert_eq!(record.name, "myroot:latest");
    assert!(record.id.starts_with("sha256:"));
    assert_eq!(record.layers.len(), 1);
    assert!(!record.builtin);
    // Apparent sizes, the hardlink counted once.
    assert_eq!(
        record.size_bytes,
        ("ID=warren\n".len() + "#!/bin/sh\necho hi\n".len()) as u64
    );
    assert!(
        record.created_at.ends_with('Z') && record.created_at.contains('T'),
        "{}",
        record.created_at
    );

    let (layers, config) = layers_of(&store.resolve("myroot").expect("resolve"));
    assert_eq!(config, ImageConfig::default());
    let root = &layers[0];
    assert_eq!(
        root.file_name().map(|n| n.to_string_lossy().into_owned()),
        Some(record.layers[0][7..].to_owned())
    );
    assert_eq!(
        fs::read(root.join("etc/os-release")).expect("read"),
        b"ID=warren\n"
    );
    let tool = fs::metadata(root.join("usr/bin/tool")).expect("tool");
    assert_eq!(tool.mode() & 0o7777, 0o4755);
    assert_eq!((tool.uid(), tool.gid()), (12, 34));
    assert_eq!(
        fs::read_link(root.join("bin")).expect("symlink"),
        Path::new("usr/bin")
    );
    let a = fs::metadata(root.join("etc/os-release")).expect("a");
    let b = fs::metadata(root.join("etc/os-release.link")).expect("b");
    assert_eq!(a.ino(), b.ino(), "hardlink preserved");

    // The same folder again is the same content: same layer, same id, nothing new stored.
    let again = store.import("other:1", src.path()).expect("import again");
    assert_eq!(again.layers, record.layers);
    assert_eq!(again.id, record.id);
    assert_store_counts(data.path(), 1, 1);

    let names: Vec<String> = store
        .list()
        .expect("list")
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(names, ["host", "myroot:latest", "other:1"]);
}

#[test]
fn importing_a_folder_that_contains_the_store_leaves_the_store_out() {
    let outer = tempfile::tempdir().expect("outer");
    make_rootfs(outer.path());
    let data = outer.path().join("var/lib/warren");
    let store = warren_image::ImageStore::open(&data).expect("open");
    let record = store.import("self", outer.path()).expect("import");
    let (layers, _) = layers_of(&store.resolve("self").expect("resolve"));
    assert!(layers[0].join("etc/os-release").is_file());
    assert!(layers[0].join("var/lib/warren").is_dir());
    assert!(
        !layers[0].join("var/lib/warren/images").exists(),
        "store not copied into the image"
    );
    assert_eq!(record.layers.len(), 1);
}

#[test]
fn imports_a_gzipped_rootfs_tarball_by_magic_not_extension() {
    let (data, store) = store();
    let src = tempfile::tempdir().expect("src");
    let tar = layer(&[
        E::Dir("etc"),
        E::File("etc/hostname", b"box\n"),
        E::Raw(EntryType::Regular, "/abs/made/relative", None),
        E::Raw(EntryType::Char, "dev/null", None),
    ]);
    let path = write(src.path(), "rootfs.bin", &gzip(&tar));

    let record = store
        .import("library/debian:bookworm", &path)
        .expect("import");
    assert_eq!(record.name, "debian:bookworm");
    assert_eq!(
        record.layers,
        [format!("sha256:{}", sha256_hex(&tar))],
        "digest of the uncompressed tar"
    );
    let (layers, _) = layers_of(&store.resolve("library/debian:bookworm").expect("resolve"));
    assert_eq!(
        fs::read(layers[0].join("etc/hostname")).expect("read"),
        b"box\n"
    );
    assert!(
        layers[0].join("abs/made/relative").is_file(),
        "absolute paths are made relative"
    );
    assert!(
        !layers[0].join("dev/null").exists(),
        "device nodes are skipped"
    );

    // The same tar uncompressed is the same layer.
    let plain = write(src.path(), "rootfs.tar", &tar);
    let again = store.import("plain", &plain).expect("import plain");
    assert_eq!(again.layers, record.layers);
    assert_store_counts(data.path(), 1, 1);
}

#[test]
fn imports_docker_save_with_whiteouts_and_mounts_it() {
    let (data, store) = store();
    let src = tempfile::tempdir().expect("src");
    let base = layer(&[
        E::Dir("etc"),
        E::File("etc/motd", b"hello\n"),
        E::File("etc/keep", b"kept\n"),
        E::Dir("var/cache"),
        E::File("var/cache/old1", b"1"),
        E::File("var/cache/old2", b"2"),
    ]);
    let top = layer(&[
        E::File("etc/.wh.motd", b""),
        E::File("var/cache/.wh..wh..opq", b""),
        E::File("var/cache/new", b"new"),
        E::File("etc/added", b"added\n"),
    ]);
    let process = json!({
        "Env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"],
        "Entrypoint": ["/entry.sh"],
        "Cmd": ["serve", "--port", "80"],
        "WorkingDir": "/srv",
        "User": "1000:1000",
    });
    let archive = write(
        src.path(),
        "saved.tar",
        &docker_save("app:1.0", &[base.clone(), top.clone()], process),
    );

    let record = store.import("app:1.0", &archive).expect("import");
    assert_eq!(
        record.layers,
        [
            format!("sha256:{}", sha256_hex(&base)),
            format!("sha256:{}", sha256_hex(&top))
        ]
    );
    let resolved = store.resolve("app:1.0").expect("resolve");
    let (layers, config) = layers_of(&resolved);
    assert_eq!(config.env, ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"]);
    assert_eq!(config.entrypoint, ["/entry.sh"]);
    assert_eq!(config.cmd, ["serve", "--port", "80"]);
    assert_eq!(config.working_dir.as_deref(), Some("/srv"));
    assert_eq!(config.user.as_deref(), Some("1000:1000"));

    // The top layer holds overlayfs whiteouts, not .wh. files.
    let wh = fs::symlink_metadata(layers[1].join("etc/motd")).expect("whiteout");
    assert!(wh.file_type().is_char_device() && wh.rdev() == 0);
    assert!(!layers[1].join("etc/.wh.motd").exists());
    let opaque = xattr::get(layers[1].join("var/cache"), "trusted.overlay.opaque").expect("xattr");
    assert_eq!(opaque.as_deref(), Some(&b"y"[..]));

    let seen = with_overlay(layers, |merged| {
        let exists = |p: &str| fs::symlink_metadata(merged.join(p)).is_ok();
        (
            exists("etc/motd"),
            fs::read(merged.join("etc/keep")).ok(),
            fs::read(merged.join("etc/added")).ok(),
            exists("var/cache/old1") || exists("var/cache/old2"),
            fs::read(merged.join("var/cache/new")).ok(),
        )
    });
    assert!(!seen.0, "deleted file is invisible");
    assert_eq!(seen.1.as_deref(), Some(&b"kept\n"[..]));
    assert_eq!(seen.2.as_deref(), Some(&b"added\n"[..]));
    assert!(!seen.3, "opaque dir hides the lower layer's content");
    assert_eq!(seen.4.as_deref(), Some(&b"new"[..]));
    assert_store_counts(data.path(), 2, 1);
}

#[test]
fn imports_an_oci_layout_as_folder_and_as_tar() {
    let (data, store) = store();
    let src = tempfile::tempdir().expect("src");
    let layout = src.path().join("layout");
    let base = layer(&[E::Dir("etc"), E::File("etc/issue", b"oci\n")]);
    let top = layer(&[E::File("app", b"bin"), E::File("etc/.wh.issue", b"")]);
    let id = oci_layout(
        &layout,
        &[base.clone(), top.clone()],
        json!({ "Cmd": ["/app"], "Env": ["A=1"] }),
    );

    let from_dir = store.import("oci/dir", &layout).expect("import dir");
    assert_eq!(from_dir.id, id, "image id is the config digest");
    assert_eq!(
        from_dir.layers,
        [
            format!("sha256:{}", sha256_hex(&base)),
            format!("sha256:{}", sha256_hex(&top))
        ],
        "layers named by the uncompressed digest although stored gzipped"
    );
    let (layers, config) = layers_of(&store.resolve("oci/dir").expect("resolve"));
    assert_eq!(config.cmd, ["/app"]);
    assert_eq!(config.env, ["A=1"]);
    assert_eq!(
        fs::read(layers[0].join("etc/issue")).expect("read"),
        b"oci\n"
    );
    assert!(fs::symlink_metadata(layers[1].join("etc/issue"))
        .expect("wh")
        .file_type()
        .is_char_device());

    let tarball = write(src.path(), "layout.tar", &tar_dir(&layout));
    let from_tar = store.import("oci/tar", &tarball).expect("import tar");
    assert_eq!(from_tar.id, from_dir.id);
    assert_eq!(from_tar.layers, from_dir.layers);
    let gz = write(src.path(), "layout.tgz", &gzip(&tar_dir(&layout)));
    let from_gz = store.import("oci/gz", &gz).expect("import tgz");
    assert_eq!(from_gz.id, from_dir.id);
    assert_store_counts(data.path(), 2, 1);
}

#[test]
fn oci_layout_with_a_tampered_blob_is_refused() {
    let (data, store) = store();
    let src = tempfile::tempdir().expect("src");
    let layout = src.path().join("layout");
    let base = layer(&[E::File("f", b"original")]);
    oci_layout(&layout, std::slice::from_ref(&base), json!({}));
    let blob = layout.join("blobs/sha256").join(sha256_hex(&gzip(&base)));
    fs::write(&blob, gzip(&layer(&[E::File("f", b"tampered")]))).expect("tamper");

    let err = store.import("tampered", &layout).expect_err("must refuse");
    assert!(
        matches!(
            err,
            ImageError::InvalidSource { .. } | ImageError::DigestMismatch { .. }
        ),
        "{err:?}"
    );
    assert_store_counts(data.path(), 0, 0);
}

#[test]
fn images_share_layers() {
    let (data, store) = store();
    let src = tempfile::tempdir().expect("src");
    let base = layer(&[E::Dir("usr"), E::File("usr/base", b"base")]);
    let one = write(
        src.path(),
        "one.tar",
        &docker_save(
            "one",
            &[base.clone(), layer(&[E::File("one", b"1")])],
            json!({}),
        ),
    );
    let two = write(
        src.path(),
        "two.tar",
        &docker_save(
            "two",
            &[base.clone(), layer(&[E::File("two", b"2")])],
            json!({}),
        ),
    );
    let r1 = store.import("one", &one).expect("one");
    // Make the shared layer recognisable: a second import must reuse it, not unpack it again.
    let shared = data.path().join("images/layers").join(sha256_hex(&base));
    let marker_before = fs::metadata(&shared).expect("shared").ino();
    let r2 = store.import("two", &two).expect("two");
    assert_eq!(r1.layers[0], r2.layers[0]);
    assert_ne!(r1.layers[1], r2.layers[1]);
    assert_eq!(
        fs::metadata(&shared).expect("shared").ino(),
        marker_before,
        "not re-extracted"
    );
    let (l1, _) = layers_of(&store.resolve("one").expect("resolve"));
    let (l2, _) = layers_of(&store.resolve("two").expect("resolve"));
    assert_eq!(l1[0], l2[0]);
    assert_store_counts(data.path(), 3, 2);
}

#[test]
fn escaping_entries_are_refused_and_leave_nothing() {
    let (data, store) = store();
    let src = tempfile::tempdir().expect("src");
    let outside = tempfile::tempdir().expect("outside");
    let outside_str = outside.path().display().to_string();
    let good = layer(&[E::File("fine", b"fine")]);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "dotdot",
            layer(&[
                E::File("ok", b"ok"),
                E::Raw(EntryType::Regular, "../x", None),
            ]),
        ),
        (
            "symlink then file",
            layer(&[
                E::Symlink("a", &outside_str),
                E::Raw(EntryType::Regular, "a/passwd", None),
            ]),
        ),
        (
            "symlink then dir",
            layer(&[
                E::Symlink("a", &outside_str),
                E::Raw(EntryType::Directory, "a/sub", None),
            ]),
        ),
        (
            "hardlink out",
            layer(&[E::Raw(EntryType::Link, "h", Some("../../etc/hostname"))]),
        ),
    ];
    for (what, tar) in &cases {
        let path = write(src.path(), "bad.tar", tar);
        let err = store.import("bad", &path).expect_err(what);
        assert!(
            matches!(err, ImageError::UnsafeEntry { .. }),
            "{what}: {err:?}"
        );
        // Also as the second layer of an image whose first layer unpacked fine.
        let path = write(
            src.path(),
            "bad-docker.tar",
            &docker_save("bad", &[good.clone(), tar.clone()], json!({})),
        );
        let err = store.import("bad", &path).expect_err(what);
        assert!(
            matches!(err, ImageError::UnsafeEntry { .. }),
            "{what} (docker): {err:?}"
        );
    }
    assert_eq!(
        ls(outside.path()),
        Vec::<String>::new(),
        "nothing written outside"
    );
    assert!(matches!(
        store.resolve("bad"),
        Err(ImageError::NotFound { .. })
    ));
    assert_eq!(store.list().expect("list").len(), 1, "only host");
    assert_store_counts(data.path(), 0, 0);
}

#[test]
fn broken_sources_are_refused_and_leave_nothing() {
    let (data, store) = store();
    let src = tempfile::tempdir().expect("src");
    let good = layer(&[E::File("a", b"a")]);
    let mut truncated_gz = gzip(&layer(&[E::File("big", &[7u8; 100_000])]));
    truncated_gz.truncate(truncated_gz.len() / 2);
    let mut bad_checksum = good.clone();
    bad_checksum[100] ^= 0xff;
    let mut wrong_diff_id = docker_save("x", std::slice::from_ref(&good), json!({}));
    // Swap the layer for another one of the same size: the config's diff_id no longer matches.
    let needle = sha256_hex(&good);
    let other = layer(&[E::File("b", b"b")]);
    let pos = find(&wrong_diff_id, &good).expect("layer inside archive");
    wrong_diff_id[pos..pos + other.len()].copy_from_slice(&other);
    assert!(find(&wrong_diff_id, needle.as_bytes()).is_some());

    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty file", Vec::new()),
        (
            "not a tar",
            b"hello, this is not a tar archive at all".repeat(20),
        ),
        ("truncated gzip", truncated_gz),
        ("bad checksum", bad_checksum),
        ("diff_id mismatch", wrong_diff_id),
        ("broken zstd", vec![0x28, 0xb5, 0x2f, 0xfd, 0, 0, 0, 0]),
    ];
    for (what, bytes) in cases {
        let path = write(src.path(), "broken", &bytes);
        let err = store.import("broken", &path).expect_err(what);
        assert!(
            matches!(
                err,
                ImageError::InvalidSource { .. } | ImageError::DigestMismatch { .. }
            ),
            "{what}: {err:?}"
        );
    }
    let err = store
        .import("broken", &src.path().join("missing"))
        .expect_err("missing");
    assert!(matches!(err, ImageError::Io { .. }), "{err:?}");
    assert_store_counts(data.path(), 0, 0);
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}
