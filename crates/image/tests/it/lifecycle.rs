//! Names, removal and garbage collection, leases, and concurrent use of one store.

use std::path::Path;
use std::sync::{Arc, Barrier};

use serde_json::json;
use warren_image::{ImageError, ImageStore, ResolvedImage};

use crate::support::*;

fn docker_image(dir: &Path, file: &str, layers: &[Vec<u8>]) -> std::path::PathBuf {
    write(dir, file, &docker_save("x", layers, json!({})))
}

#[test]
fn host_is_builtin_and_reserved() {
    let (data, store) = store();
    let list = store.list().expect("list");
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].name, "host");
    assert!(list[0].builtin);
    assert_eq!(store.resolve("host").expect("resolve"), ResolvedImage::Host);
    assert_eq!(
        store.resolve("host:latest").expect("resolve"),
        ResolvedImage::Host
    );

    let src = tempfile::tempdir().expect("src");
    let tar = write(src.path(), "r.tar", &layer(&[E::File("f", b"f")]));
    for name in ["host", "host:latest", "host:v2"] {
        let err = store.import(name, &tar).expect_err(name);
        assert!(
            matches!(err, ImageError::InvalidName { .. }),
            "{name}: {err:?}"
        );
    }
    assert!(matches!(
        store.remove("host"),
        Err(ImageError::InvalidName { .. })
    ));
    for bad in ["../etc", "a//b", "x:", "with space", &"a".repeat(256)] {
        assert!(
            matches!(store.import(bad, &tar), Err(ImageError::InvalidName { .. })),
            "{bad}"
        );
    }
    assert_store_counts(data.path(), 0, 0);
}

#[test]
fn unknown_names_are_not_found() {
    let (_data, store) = store();
    assert!(matches!(
        store.resolve("nope"),
        Err(ImageError::NotFound { .. })
    ));
    assert!(matches!(
        store.remove("nope:1"),
        Err(ImageError::NotFound { .. })
    ));
    let id = format!("sha256:{}", "a".repeat(64));
    assert!(matches!(
        store.resolve(&id),
        Err(ImageError::NotFound { .. })
    ));
}

#[test]
fn remove_collects_only_unreferenced_layers() {
    let (data, store) = store();
    let src = tempfile::tempdir().expect("src");
    let base = layer(&[E::File("base", b"base")]);
    let a = docker_image(
        src.path(),
        "a.tar",
        &[base.clone(), layer(&[E::File("a", b"a")])],
    );
    let b = docker_image(
        src.path(),
        "b.tar",
        &[base.clone(), layer(&[E::File("b", b"b")])],
    );
    let ra = store.import("a", &a).expect("a");
    store.import("b", &b).expect("b");
    store.import("a-again:v1", &a).expect("second name for a");
    assert_store_counts(data.path(), 3, 2);

    // Resolving by id works too.
    assert!(matches!(
        store.resolve(&ra.id),
        Ok(ResolvedImage::Layers { .. })
    ));

    store.remove("a").expect("remove a");
    assert_store_counts(data.path(), 3, 2); // a-again still names image a
    store.remove("a-again:v1").expect("remove a-again");
    assert_store_counts(data.path(), 2, 1); // a's own layer and json gone, base kept for b
    assert!(matches!(
        store.resolve("a"),
        Err(ImageError::NotFound { .. })
    ));
    assert!(matches!(
        store.resolve("b"),
        Ok(ResolvedImage::Layers { .. })
    ));
    store.remove("b").expect("remove b");
    assert_store_counts(data.path(), 0, 0);
    let names: Vec<String> = store
        .list()
        .expect("list")
        .into_iter()
        .map(|r| r.name)
        .collect();
    assert_eq!(names, ["host"]);
}

#[test]
fn retagging_collects_the_old_image() {
    let (data, store) = store();
    let src = tempfile::tempdir().expect("src");
    let v1 = write(src.path(), "v1.tar", &layer(&[E::File("v", b"1")]));
    let v2 = write(src.path(), "v2.tar", &layer(&[E::File("v", b"2")]));
    let r1 = store.import("app", &v1).expect("v1");
    let r2 = store.import("app", &v2).expect("v2");
    assert_ne!(r1.id, r2.id);
    assert_store_counts(data.path(), 1, 1);
    let listed = store.list().expect("list");
    assert_eq!(listed.len(), 2);
    assert_eq!(listed[1].id, r2.id);
}

#[test]
fn a_lease_keeps_layers_until_released() {
    let (data, store) = store();
    let src = tempfile::tempdir().expect("src");
    let tar = write(src.path(), "r.tar", &layer(&[E::File("f", b"f")]));
    store.import("leased", &tar).expect("import");
    let resolved = store.resolve("leased").expect("resolve");
    store.lease("sbx-1", &resolved).expect("lease");
    store
        .lease("sbx-1", &resolved)
        .expect("lease again is a no-op");
    store.lease("sbx-2", &resolved).expect("second holder");

    store.remove("leased").expect("remove");
    assert!(matches!(
        store.resolve("leased"),
        Err(ImageError::NotFound { .. })
    ));
    let ResolvedImage::Layers { layers, .. } = &resolved else {
        panic!("host")
    };
    assert!(
        layers[0].join("f").is_file(),
        "leased layer survives removal"
    );
    assert_store_counts(data.path(), 1, 0);

    store.release("sbx-1").expect("release 1");
    assert!(layers[0].is_dir(), "still held by sbx-2");
    store.release("sbx-2").expect("release 2");
    store.release("sbx-2").expect("release is idempotent");
    store.release("never-held").expect("unknown holder is fine");
    assert!(!layers[0].exists());
    assert_store_counts(data.path(), 0, 0);

    // The image is gone: leasing what was resolved before is refused rather than resurrected.
    assert!(matches!(
        store.lease("sbx-3", &resolved),
        Err(ImageError::NotFound { .. })
    ));
    assert!(matches!(
        store.lease("../evil", &resolved),
        Err(ImageError::InvalidHolder { .. })
    ));
    store
        .lease("sbx-host", &ResolvedImage::Host)
        .expect("host lease is a no-op");
}

#[test]
fn a_holder_holds_one_image() {
    let (_data, store) = store();
    let src = tempfile::tempdir().expect("src");
    store
        .import(
            "one",
            &write(src.path(), "1.tar", &layer(&[E::File("1", b"1")])),
        )
        .expect("one");
    store
        .import(
            "two",
            &write(src.path(), "2.tar", &layer(&[E::File("2", b"2")])),
        )
        .expect("two");
    store
        .lease("sbx", &store.resolve("one").expect("resolve"))
        .expect("lease");
    let err = store
        .lease("sbx", &store.resolve("two").expect("resolve"))
        .expect_err("second image");
    assert!(matches!(err, ImageError::InUse { .. }), "{err:?}");
}

#[test]
fn concurrent_imports_of_one_name_do_not_corrupt_the_store() {
    let (data, _store) = store();
    let src = tempfile::tempdir().expect("src");
    let shared = layer(&[E::Dir("usr"), E::File("usr/shared", &[1u8; 4096])]);
    let sources: Vec<_> = (0..2)
        .map(|i| {
            let own = layer(&[E::File(if i == 0 { "zero" } else { "one" }, b"x")]);
            docker_image(src.path(), &format!("{i}.tar"), &[shared.clone(), own])
        })
        .collect();
    let rounds = 5;
    let barrier = Arc::new(Barrier::new(2));
    let handles: Vec<_> = sources
        .into_iter()
        .map(|source| {
            let root = data.path().to_path_buf();
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                // A store of its own, as a second process would have.
                let store = ImageStore::open(&root).expect("open");
                let mut ids = Vec::new();
                for _ in 0..rounds {
                    barrier.wait();
                    ids.push(store.import("race", &source).expect("import").id);
                    // Read while the other thread may be writing.
                    assert!(matches!(
                        store.resolve("race"),
                        Ok(ResolvedImage::Layers { .. })
                    ));
                }
                ids
            })
        })
        .collect();
    let ids: Vec<Vec<String>> = handles
        .into_iter()
        .map(|h| h.join().expect("thread"))
        .collect();

    let store = ImageStore::open(data.path()).expect("reopen");
    let ResolvedImage::Layers { id, layers, .. } = store.resolve("race").expect("resolve") else {
        panic!("host")
    };
    assert!(ids.iter().any(|v| v.contains(&id)));
    assert!(layers.iter().all(|l| l.is_dir()));
    assert_eq!(store.list().expect("list").len(), 2);
    // Exactly the winner's two layers and one image remain.
    assert_store_counts(data.path(), 2, 1);
}

#[test]
fn open_cleans_up_after_a_crashed_import() {
    let (data, store) = store();
    let src = tempfile::tempdir().expect("src");
    store
        .import(
            "kept",
            &write(src.path(), "k.tar", &layer(&[E::File("k", b"k")])),
        )
        .expect("import");
    let root = data.path().join("images");
    // A process that died mid-import (its staging dir) and mid-commit (a layer moved in, no image).
    let mut child = std::process::Command::new("true").spawn().expect("spawn");
    let dead = child.id();
    child.wait().expect("wait");
    let staging = root.join(format!("tmp/import-{dead}-abc123"));
    std::fs::create_dir_all(staging.join("0/usr")).expect("staging");
    let orphan = root.join("layers").join("f".repeat(64));
    std::fs::create_dir_all(orphan.join("etc")).expect("orphan");
    // Staging of a live process (this one) is left alone.
    let live = root.join(format!("tmp/import-{}-live", std::process::id()));
    std::fs::create_dir_all(&live).expect("live");

    let reopened = ImageStore::open(data.path()).expect("reopen");
    assert!(!staging.exists(), "dead process staging removed");
    assert!(!orphan.exists(), "unreferenced layer collected");
    assert!(live.exists(), "live process staging kept");
    std::fs::remove_dir(&live).expect("cleanup");
    assert!(matches!(
        reopened.resolve("kept"),
        Ok(ResolvedImage::Layers { .. })
    ));
    assert_store_counts(data.path(), 1, 1);
}
