//! The server's sandbox state machine against the in-memory runtime (`warren_core::fake`): each
//! transition, a failure at each step, a sandbox that ends or vanishes on its own, expiry, and a
//! restart that re-adopts what lived on — without root or a machine that can run sandboxes.

use std::sync::Arc;
use std::time::Duration;

use warren_api::lifecycle::SandboxState;
use warren_core::fake::{FakeRuntime, Step};

use crate::sandboxes::tests::{plan, sandboxes};
use crate::sandboxes::{Sandboxes, REASON_DELETE_FAILED, REASON_TTL_EXPIRY, REASON_USER_DELETE};

/// Waits (up to 10 s) until `check` has an answer.
async fn until<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    for _ in 0..1000 {
        if let Some(v) = check() {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}")
}

fn setup() -> (tempfile::TempDir, Arc<FakeRuntime>, Sandboxes) {
    let dir = tempfile::tempdir().expect("tempdir");
    let runtime = Arc::new(FakeRuntime::default());
    let sandboxes = sandboxes(dir.path(), runtime.clone());
    (dir, runtime, sandboxes)
}

/// `/metrics`' sandboxes-by-state gauge: each record counted once, under its state.
#[tokio::test]
async fn records_are_counted_by_state() {
    let (_dir, _rt, sb) = setup();
    let state_of = |counts: [usize; 8], state: SandboxState| {
        let i = SandboxState::ALL
            .iter()
            .position(|s| *s == state)
            .expect("a state");
        counts[i]
    };
    let a = sb.create(plan()).await.expect("create");
    sb.create(plan()).await.expect("create");
    sb.pause(&a.id).await.expect("pause");
    let counts = sb.count_by_state();
    assert_eq!(state_of(counts, SandboxState::Running), 1, "{counts:?}");
    assert_eq!(state_of(counts, SandboxState::Paused), 1, "{counts:?}");
    assert_eq!(counts.iter().sum::<usize>(), 2, "{counts:?}");
}

#[tokio::test]
async fn create_pause_resume_delete() {
    let (_dir, rt, sb) = setup();
    let rec = sb.create(plan()).await.expect("create");
    assert_eq!(rec.state, SandboxState::Running);
    assert_eq!(rt.live(), vec![rec.id.clone()]);

    sb.pause(&rec.id).await.expect("pause");
    assert_eq!(sb.state(&rec.id), Some(SandboxState::Paused));
    assert_eq!(rt.paused(&rec.id), Some(true));
    let again = sb
        .pause(&rec.id)
        .await
        .expect_err("pausing a paused sandbox");
    assert_eq!(again.kind, crate::error::ErrorKind::Conflict);

    sb.resume(&rec.id).await.expect("resume");
    assert_eq!(sb.state(&rec.id), Some(SandboxState::Running));
    assert_eq!(rt.paused(&rec.id), Some(false));
    let again = sb
        .resume(&rec.id)
        .await
        .expect_err("resuming a running sandbox");
    assert_eq!(again.kind, crate::error::ErrorKind::Conflict);

    sb.delete(&rec.id, REASON_USER_DELETE)
        .await
        .expect("delete");
    assert!(
        sb.get(&rec.id).is_none(),
        "a deleted sandbox is gone at once"
    );
    assert!(rt.live().is_empty());
    assert_eq!(rt.destroyed(), vec![rec.id.clone()]);
    let again = sb
        .delete(&rec.id, REASON_USER_DELETE)
        .await
        .expect_err("deleting twice");
    assert_eq!(again.kind, crate::error::ErrorKind::NotFound);
}

#[tokio::test]
async fn a_create_that_fails_leaves_nothing_running() {
    let (_dir, rt, sb) = setup();
    rt.fail(Step::Create);
    let err = sb.create(plan()).await.expect_err("create fails");
    assert_eq!(err.kind, crate::error::ErrorKind::Failed, "{err:?}");
    rt.heal(Step::Create);
    rt.fail(Step::Start);
    let err = sb.create(plan()).await.expect_err("start fails");
    // A refusal or a failure, whichever the runtime's makes it: what matters is that nothing runs.
    assert!(
        err.status().is_client_error() || err.status().is_server_error(),
        "{err:?}"
    );
    assert!(rt.live().is_empty(), "{:?}", rt.live());
    // What the failures left is said, not running.
    for r in sb.all() {
        assert!(r.state.is_terminal(), "{r:?}");
    }
    rt.heal(Step::Start);
    let ok = sb
        .create(plan())
        .await
        .expect("a create after the failures");
    assert_eq!(ok.state, SandboxState::Running);
}

#[tokio::test]
async fn a_failed_pause_or_resume_keeps_the_state_it_had() {
    let (_dir, rt, sb) = setup();
    let rec = sb.create(plan()).await.expect("create");
    rt.fail(Step::Pause);
    assert!(sb.pause(&rec.id).await.is_err());
    assert_eq!(sb.state(&rec.id), Some(SandboxState::Running));
    rt.heal(Step::Pause);
    sb.pause(&rec.id).await.expect("pause");
    rt.fail(Step::Resume);
    assert!(sb.resume(&rec.id).await.is_err());
    assert_eq!(sb.state(&rec.id), Some(SandboxState::Paused));
    rt.heal(Step::Resume);
    sb.resume(&rec.id).await.expect("resume");
    assert_eq!(sb.state(&rec.id), Some(SandboxState::Running));
}

#[tokio::test]
async fn a_failed_delete_can_be_retried() {
    let (_dir, rt, sb) = setup();
    let rec = sb.create(plan()).await.expect("create");
    rt.fail(Step::Destroy);
    assert!(sb.delete(&rec.id, REASON_USER_DELETE).await.is_err());
    assert_eq!(rt.live(), vec![rec.id.clone()], "nothing was destroyed");
    let failed = sb.get(&rec.id).expect("kept to say why");
    assert_eq!(failed.state, SandboxState::Failed);
    assert_eq!(failed.reason.as_deref(), Some(REASON_DELETE_FAILED));
    rt.heal(Step::Destroy);
    // The runtime still holds it: a second delete tries again, and then it is gone.
    sb.delete(&rec.id, REASON_USER_DELETE)
        .await
        .expect("the retried delete");
    assert!(rt.live().is_empty());
    assert!(sb.get(&rec.id).is_none());
}

#[tokio::test]
async fn a_sandbox_that_ends_by_itself_is_kept_for_its_retention() {
    let (_dir, rt, sb) = setup();
    for (code, state) in [(0, SandboxState::Terminated), (3, SandboxState::Failed)] {
        let rec = sb.create(plan()).await.expect("create");
        rt.end(&rec.id, code);
        let ended = until("the end seen", || {
            sb.get(&rec.id).filter(|r| r.state.is_terminal())
        })
        .await;
        assert_eq!(ended.state, state, "{ended:?}");
        assert!(
            ended
                .message
                .as_deref()
                .is_some_and(|m| m.contains(&format!("code {code}"))),
            "{ended:?}"
        );
        assert!(rt.destroyed().contains(&rec.id), "what it held is released");
        // Still listed: it ended on its own, not by a delete.
        assert!(sb.all().iter().any(|r| r.id == rec.id));
    }
}

#[tokio::test]
async fn a_sandbox_removed_behind_warrens_back_says_so() {
    let (_dir, rt, sb) = setup();
    let rec = sb.create(plan()).await.expect("create");
    rt.vanish(&rec.id);
    let ended = until("the vanish seen", || {
        sb.get(&rec.id).filter(|r| r.state.is_terminal())
    })
    .await;
    assert!(
        ended
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("outside Warren")
            || ended
                .reason
                .as_deref()
                .unwrap_or_default()
                .contains("vanish"),
        "{ended:?}"
    );
}

#[tokio::test]
async fn expiry_deletes_on_time_and_renew_pushes_it_back() {
    let (_dir, rt, sb) = setup();
    let reaper = sb.spawn_reaper();
    let mut short = plan();
    short.timeout_seconds = Some(1);
    let expiring = sb.create(short.clone()).await.expect("create");
    let renewed = sb.create(short).await.expect("create");
    sb.renew(
        &renewed.id,
        chrono::Utc::now() + chrono::Duration::seconds(60),
    )
    .await
    .expect("renew");
    until("the expiry", || {
        rt.destroyed().contains(&expiring.id).then_some(())
    })
    .await;
    let after = sb.get(&expiring.id);
    assert!(
        after.is_none()
            || after.as_ref().is_some_and(
                |r| r.state.is_terminal() && r.reason.as_deref() == Some(REASON_TTL_EXPIRY)
            ),
        "{after:?}"
    );
    assert_eq!(sb.state(&renewed.id), Some(SandboxState::Running));
    assert!(!rt.destroyed().contains(&renewed.id));
    reaper.abort();
}

#[test]
fn a_restart_re_adopts_what_lived_on_and_says_what_did_not() {
    let dir = tempfile::tempdir().expect("tempdir");
    let rt = Arc::new(FakeRuntime::default());
    // The first server: its own tokio runtime, dropped (with its watchers) to end it, as a crash
    // or a stop would.
    let (running, paused, lost) = {
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let ids = first.block_on(async {
            let sb = sandboxes(dir.path(), rt.clone());
            let a = sb.create(plan()).await.expect("a").id;
            let b = sb.create(plan()).await.expect("b").id;
            let c = sb.create(plan()).await.expect("c").id;
            sb.pause(&b).await.expect("pause b");
            (a, b, c)
        });
        drop(first);
        ids
    };
    // While the server is down, one of them goes.
    rt.vanish(&lost);
    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    second.block_on(async {
        let sb = sandboxes(dir.path(), rt.clone());
        sb.recover().await.expect("recover");
        assert_eq!(sb.state(&running), Some(SandboxState::Running));
        assert_eq!(sb.state(&paused), Some(SandboxState::Paused));
        let gone = sb.get(&lost).expect("the lost one is kept to say why");
        assert_eq!(gone.state, SandboxState::Failed);
        assert_eq!(gone.reason.as_deref(), Some("lost"));
        // The re-adopted ones are watched again: an end is seen.
        rt.end(&running, 0);
        until("the re-adopted sandbox's end", || {
            sb.get(&running).filter(|r| r.state.is_terminal())
        })
        .await;
        sb.resume(&paused).await.expect("resume after the restart");
        assert_eq!(rt.paused(&paused), Some(false));
    });
}
