//! Replicas over one shared in-memory runtime (`FakeRuntime::shared`): what one does, the others
//! see, in the backend's order — without root or a cluster.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use warren_api::lifecycle::SandboxState;
use warren_core::fake::FakeRuntime;

use super::super::tests::{plan, sandboxes};
use super::super::{Sandboxes, REASON_USER_DELETE};
use super::{wire_form, DELETE_GRACE};
use warren_core::SharedRecords;

/// Waits (up to 10 s) until `check` holds.
async fn until(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..1000 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}")
}

struct Replicas {
    _dirs: Vec<tempfile::TempDir>,
    rt: Arc<FakeRuntime>,
    a: Sandboxes,
    b: Sandboxes,
}

async fn replicas() -> Replicas {
    let rt = Arc::new(FakeRuntime::shared());
    let dirs: Vec<_> = (0..2)
        .map(|_| tempfile::tempdir().expect("tempdir"))
        .collect();
    let a = sandboxes(dirs[0].path(), rt.clone());
    let b = sandboxes(dirs[1].path(), rt.clone());
    a.recover().await.expect("recover a");
    b.recover().await.expect("recover b");
    Replicas {
        _dirs: dirs,
        rt,
        a,
        b,
    }
}

fn writes(rt: &FakeRuntime) -> usize {
    rt.records().expect("shared").writes()
}

#[tokio::test]
async fn what_one_replica_does_the_others_see() {
    let r = replicas().await;
    let rec = r.a.create(plan()).await.expect("create");
    let id = rec.id.clone();
    until("b to adopt it", || {
        r.b.get(&id)
            .is_some_and(|x| x.state == SandboxState::Running)
    })
    .await;
    // The same secret on both, derived, and in no journal.
    assert_eq!(r.b.get(&id).map(|x| x.token), Some(rec.token.clone()));
    assert_eq!(rec.token, "fake-secret-".to_string() + &id);
    for dir in &r._dirs {
        let journal = dir.path().join("state").join("sandboxes.jsonl");
        let text = std::fs::read_to_string(journal).unwrap_or_default();
        assert!(!text.contains(&id), "a record in the journal: {text}");
    }
    assert!(r
        .rt
        .records()
        .and_then(|x| x.record(&id))
        .is_some_and(|v| v.get("token").is_none()));

    // A renew and a metadata patch: one write each, the other replica's at once.
    let before = writes(&r.rt);
    let at = Utc::now() + chrono::Duration::hours(1);
    r.b.renew(&id, at).await.expect("renew");
    until("a to take the renewal", || {
        r.a.get(&id).and_then(|x| x.expires_at) == Some(at)
    })
    .await;
    r.a.patch_metadata(&id, vec![("k".into(), Some("v".into()))])
        .await
        .expect("metadata");
    until("b to take the metadata", || {
        r.b.get(&id)
            .is_some_and(|x| x.metadata.get("k").map(String::as_str) == Some("v"))
    })
    .await;
    assert_eq!(writes(&r.rt) - before, 2);

    // A delete through b: gone from a at once, not kept as ended.
    r.b.delete(&id, REASON_USER_DELETE).await.expect("delete");
    until("a to forget it", || r.a.get(&id).is_none()).await;
    assert!(r.b.get(&id).is_none());
    assert!(r.rt.live().is_empty());
}

#[tokio::test]
async fn a_sandbox_that_ends_ends_on_every_replica_with_its_reason() {
    let r = replicas().await;
    let failed = r.a.create(plan()).await.expect("create").id;
    let vanished = r.b.create(plan()).await.expect("create").id;
    until("both adopted", || {
        r.a.get(&vanished).is_some() && r.b.get(&failed).is_some()
    })
    .await;
    r.rt.end(&failed, 3);
    r.rt.vanish(&vanished);
    for s in [&r.a, &r.b] {
        until("the exit to show", || {
            s.get(&failed)
                .is_some_and(|x| x.state == SandboxState::Failed)
        })
        .await;
        let message = s.get(&failed).and_then(|x| x.message).unwrap_or_default();
        assert!(message.contains("exited with code 3"), "{message}");
        until("the removal to show", || {
            s.get(&vanished)
                .is_some_and(|x| x.state == SandboxState::Terminated)
        })
        .await;
        let message = s.get(&vanished).and_then(|x| x.message).unwrap_or_default();
        assert!(message.contains("removed outside Warren"), "{message}");
    }
}

#[tokio::test]
async fn a_warm_sandbox_is_claimed_by_one_replica_only() {
    let r = replicas().await;
    let mut warm = plan();
    warm.warm_pool = Some("p".into());
    warm.timeout_seconds = None;
    for _ in 0..20 {
        let id = r.a.create(warm.clone()).await.expect("create").id;
        until("b to adopt the warm sandbox", || {
            r.b.get(&id).is_some_and(|x| x.warm_pool.is_some())
        })
        .await;
        let meta = |who: &str| BTreeMap::from([("by".to_string(), who.to_string())]);
        let (x, y) = tokio::join!(
            r.a.claim(&id, "p", meta("a"), BTreeMap::new(), Some(60)),
            r.b.claim(&id, "p", meta("b"), BTreeMap::new(), Some(60)),
        );
        assert!(
            x.is_some() != y.is_some(),
            "claimed by both or neither: {x:?} {y:?}"
        );
        let winner = if x.is_some() { "a" } else { "b" };
        // Both come to the winner's record, and neither offers it as warm any more.
        for s in [&r.a, &r.b] {
            until("the claim to show", || {
                s.get(&id).is_some_and(|rec| {
                    rec.warm_pool.is_none()
                        && rec.metadata.get("by").map(String::as_str) == Some(winner)
                })
            })
            .await;
        }
        r.a.delete(&id, REASON_USER_DELETE).await.expect("delete");
    }
}

#[tokio::test]
async fn a_change_kept_for_later_never_brings_back_a_deleted_sandbox() {
    let r = replicas().await;
    let id = r.a.create(plan()).await.expect("create").id;
    until("b to adopt it", || r.b.get(&id).is_some()).await;
    // b is busy with the sandbox while a renews it: b keeps that change for later...
    let entry = r.b.entry(&id).expect("entry");
    let op = entry.op.lock().await;
    r.a.renew(&id, Utc::now() + chrono::Duration::hours(1))
        .await
        .expect("renew");
    tokio::time::sleep(Duration::from_millis(5)).await;
    drop(op);
    // ...and a deletes it before b looks again: the old change must not adopt it anew.
    r.a.delete(&id, REASON_USER_DELETE).await.expect("delete");
    until("b to forget it", || r.b.get(&id).is_none()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(r.b.get(&id).is_none(), "a deleted sandbox came back");
}

/// What a replica that stopped between marking a delete and making it leaves: the record says
/// Stopping, the sandbox is still there.
async fn delete_cut_short(r: &Replicas, id: &str) {
    let mut rec = r.a.get(id).expect("record");
    rec.transition(SandboxState::Stopping, Some(REASON_USER_DELETE), None)
        .expect("a sandbox may be deleted");
    r.rt.records()
        .expect("shared")
        .put(id, &rec.runtime_state, &wire_form(&rec))
        .await
        .expect("put");
}

#[tokio::test(start_paused = true)]
async fn a_delete_cut_short_is_finished_by_the_replicas_that_saw_it_begin() {
    let r = replicas().await;
    let id = r.a.create(plan()).await.expect("create").id;
    until("b to adopt it", || r.b.get(&id).is_some()).await;
    delete_cut_short(&r, &id).await;
    until("both to see the delete begun", || {
        [&r.a, &r.b].iter().all(|s| {
            s.get(&id)
                .is_some_and(|x| x.state == SandboxState::Stopping)
        })
    })
    .await;
    assert_eq!(r.rt.live(), vec![id.clone()]);
    tokio::time::sleep(DELETE_GRACE + Duration::from_secs(1)).await;
    until("the sandbox removed and forgotten", || {
        r.rt.live().is_empty() && r.a.get(&id).is_none() && r.b.get(&id).is_none()
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_replica_that_starts_removes_what_a_delete_cut_short_left() {
    let r = replicas().await;
    let id = r.a.create(plan()).await.expect("create").id;
    until("b to adopt it", || r.b.get(&id).is_some()).await;
    delete_cut_short(&r, &id).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let c = sandboxes(dir.path(), r.rt.clone());
    c.recover().await.expect("recover c");
    // At once, not after the others' grace.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(r.rt.live().is_empty(), "still there: {:?}", r.rt.live());
    assert!(c.get(&id).is_none());
    until("the others to forget it", || {
        r.a.get(&id).is_none() && r.b.get(&id).is_none()
    })
    .await;
}
