//! The leases journal: what one store instance writes another sees, a line a crash cut short, old
//! lease files moved in, and the rewrite that keeps the file small.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use warren_image::{ImageStore, ResolvedImage};

use crate::support::*;

/// A store with one imported image `img`; returns its single layer's folder too.
fn store_with_image() -> (tempfile::TempDir, ImageStore, ResolvedImage, PathBuf) {
    let (data, store) = store();
    let src = tempfile::tempdir().expect("src");
    let tar = write(src.path(), "r.tar", &layer(&[E::File("f", b"f")]));
    store.import("img", &tar).expect("import");
    let resolved = store.resolve("img").expect("resolve");
    let ResolvedImage::Layers { layers, .. } = &resolved else {
        panic!("host")
    };
    let layer = layers[0].clone();
    (data, store, resolved, layer)
}

fn journal(data: &Path) -> PathBuf {
    data.join("images/leases.jsonl")
}

#[test]
fn a_lease_written_by_one_store_holds_in_another_and_a_release_there_is_seen_here() {
    let (data, a, resolved, layer) = store_with_image();
    a.lease("sbx-1", &resolved).expect("lease");
    // A second process on the same data dir (the CLI's `image rm` beside a server).
    let b = ImageStore::open(data.path()).expect("reopen");
    b.remove("img").expect("remove the name");
    assert!(
        layer.is_dir(),
        "the lease written by the other store keeps the layer"
    );
    assert!(
        b.leased("sbx-1").expect("leased").is_some(),
        "the lease is read back from the journal"
    );
    b.release("sbx-1").expect("release in b");
    assert!(!layer.exists(), "released and unnamed: collected");
    assert!(
        a.leased("sbx-1").expect("leased").is_none(),
        "a sees the release b appended"
    );
    // And a still appends where the file ends: a new lease there is seen by b.
    let src = tempfile::tempdir().expect("src");
    a.import("img2", &write(src.path(), "2.tar", &layer_of(b"2")))
        .expect("import");
    a.lease("sbx-2", &a.resolve("img2").expect("resolve"))
        .expect("lease");
    assert!(b.leased("sbx-2").expect("leased").is_some());
}

fn layer_of(content: &[u8]) -> Vec<u8> {
    layer(&[E::File("g", content)])
}

#[test]
fn a_line_cut_short_by_a_crash_is_skipped_and_the_next_lease_is_read_whole() {
    let (data, store, resolved, layer) = store_with_image();
    store.lease("sbx-1", &resolved).expect("lease");
    // A writer that died in the middle of its line: no newline at the end.
    fs::OpenOptions::new()
        .append(true)
        .open(journal(data.path()))
        .expect("open journal")
        .write_all(br#"{"lease":{"holder":"sbx-cut","image":"img","lay"#)
        .expect("cut line");
    let fresh = ImageStore::open(data.path()).expect("reopen with a cut line");
    assert!(fresh.leased("sbx-cut").expect("leased").is_none());
    assert!(fresh.leased("sbx-1").expect("leased").is_some());
    fresh
        .lease("sbx-2", &resolved)
        .expect("lease after the cut line");
    let again = ImageStore::open(data.path()).expect("reopen");
    assert!(
        again.leased("sbx-2").expect("leased").is_some(),
        "the lease after the cut line is a line of its own"
    );
    again.remove("img").expect("remove the name");
    again.release("sbx-1").expect("release");
    assert!(layer.is_dir(), "sbx-2 still holds it");
    again.release("sbx-2").expect("release");
    assert!(!layer.exists());
}

#[test]
fn lease_files_of_an_older_store_are_moved_into_the_journal() {
    let (data, store, resolved, layer) = store_with_image();
    let ResolvedImage::Layers { layers, id, .. } = &resolved else {
        panic!("host")
    };
    let hex = layers[0]
        .file_name()
        .and_then(|n| n.to_str())
        .expect("layer folder name");
    let old = data.path().join("images/leases");
    fs::create_dir_all(&old).expect("old leases dir");
    fs::write(
        old.join("sbx-old.json"),
        serde_json::to_vec(&serde_json::json!({
            "image": "img", "layers": [format!("sha256:{hex}")], "id": id, "config": {}
        }))
        .expect("json"),
    )
    .expect("old lease file");
    drop(store);
    let store = ImageStore::open(data.path()).expect("reopen");
    assert!(
        !old.exists(),
        "the old folder is gone once its leases are moved"
    );
    assert!(store.leased("sbx-old").expect("leased").is_some());
    store.remove("img").expect("remove the name");
    assert!(layer.is_dir(), "the moved lease still keeps the layer");
    store.release("sbx-old").expect("release");
    assert!(!layer.exists());
}

#[test]
fn an_unreadable_old_lease_file_keeps_every_layer() {
    let (data, store, _resolved, layer) = store_with_image();
    let old = data.path().join("images/leases");
    fs::create_dir_all(&old).expect("old leases dir");
    fs::write(old.join("sbx-bad.json"), b"{not json").expect("bad lease file");
    drop(store);
    let store = ImageStore::open(data.path()).expect("reopen");
    assert!(old.join("sbx-bad.json").exists(), "left where it was");
    store.remove("img").expect("remove the name");
    assert!(layer.is_dir(), "what the unreadable lease may hold is kept");
}

#[test]
fn the_journal_is_rewritten_when_dead_lines_dominate_it() {
    let (data, store, resolved, layer) = store_with_image();
    store.lease("keeper", &resolved).expect("lease");
    let other = ImageStore::open(data.path()).expect("second store");
    for i in 0..3000 {
        let holder = format!("sbx-{i}");
        store.lease(&holder, &resolved).expect("lease");
        store.release(&holder).expect("release");
    }
    let lines = fs::read_to_string(journal(data.path()))
        .expect("journal")
        .lines()
        .count();
    assert!(lines < 1100, "{lines} lines after 6000 appends");
    // The other store notices the rewrite (another file) and reads it afresh.
    assert!(other.leased("keeper").expect("leased").is_some());
    assert!(other.leased("sbx-2999").expect("leased").is_none());
    other.remove("img").expect("remove the name");
    assert!(layer.is_dir(), "keeper survives the rewrite");
    other.release("keeper").expect("release");
    assert!(!layer.exists());
}
