//! Which state a sandbox may move to from which: the one table every transition goes through, so
//! that a bug that would (say) bring a deleted sandbox back to Running is refused where the record
//! changes, not found later in a client's confusion.
//!
//! Besides the verbs' own moves (create → Running, pause, resume, delete), a live sandbox may be
//! found in any live state by recovery or the runtime's word (Running or Paused: what a restarted
//! server finds), and may end at any time (it exited, its create failed, a bug). An ended sandbox
//! does not come back: a Failed one can still be deleted; a Terminated one is gone.

use warren_api::lifecycle::SandboxState::{self, *};

/// Whether a sandbox in state `from` may move to `to`. Staying put is allowed for a live state (a
/// recovery that finds the record right), never for an ended one.
pub fn allowed(from: SandboxState, to: SandboxState) -> bool {
    match from {
        Terminated => false,
        Failed => matches!(to, Stopping | Terminated),
        Stopping => matches!(to, Stopping | Terminated | Failed),
        Pending | Running | Pausing | Paused | Resuming => match to {
            // found so by recovery or by the runtime's records, or the verb's own step
            Running | Paused | Stopping | Terminated | Failed => true,
            Pending => from == Pending,
            Pausing => matches!(from, Running | Pausing),
            Resuming => matches!(from, Paused | Resuming),
        },
    }
}

/// A move the table refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("sandbox {id} cannot go from {} to {}", from.as_str(), to.as_str())]
pub struct IllegalTransition {
    pub id: String,
    pub from: SandboxState,
    pub to: SandboxState,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SandboxRecord;
    use proptest::prelude::*;

    #[test]
    fn the_verbs_moves_are_allowed_and_the_dead_stay_dead() {
        for (from, to) in [
            (Pending, Running),
            (Pending, Failed),
            (Running, Pausing),
            (Pausing, Paused),
            (Pausing, Running),
            (Paused, Resuming),
            (Resuming, Running),
            (Resuming, Paused),
            (Running, Stopping),
            (Paused, Stopping),
            (Stopping, Terminated),
            (Stopping, Failed),
            (Failed, Stopping),
            (Running, Terminated),
            (Paused, Running),
        ] {
            assert!(allowed(from, to), "{from:?} -> {to:?}");
        }
        for (from, to) in [
            (Terminated, Running),
            (Terminated, Stopping),
            (Terminated, Terminated),
            (Failed, Running),
            (Failed, Failed),
            (Stopping, Running),
            (Stopping, Paused),
            (Running, Pending),
            (Pending, Pausing),
            (Paused, Pausing),
            (Running, Resuming),
        ] {
            assert!(!allowed(from, to), "{from:?} -> {to:?}");
        }
    }

    fn state() -> impl Strategy<Value = SandboxState> {
        prop::sample::select(SandboxState::ALL.to_vec())
    }

    proptest! {
        /// Whatever moves are tried, in whatever order: a refused one changes nothing of the record
        /// and says which move it was; an accepted one is in the table; once Terminated, nothing
        /// moves again; and every state a record reaches could be reached from Pending.
        #[test]
        fn records_only_ever_make_moves_the_table_allows(tries in prop::collection::vec(state(), 0..40)) {
            let mut rec = SandboxRecord::for_tests("s");
            rec.state = Pending;
            let mut reached = vec![Pending];
            for to in tries {
                let before = rec.clone();
                match rec.transition(to, Some("r"), None) {
                    Ok(()) => {
                        prop_assert!(allowed(before.state, to));
                        prop_assert_eq!(rec.state, to);
                        prop_assert_ne!(before.state, Terminated);
                        reached.push(to);
                    }
                    Err(e) => {
                        prop_assert!(!allowed(before.state, to));
                        prop_assert_eq!(&rec, &before);
                        prop_assert_eq!((e.from, e.to), (before.state, to));
                    }
                }
            }
            for s in reached {
                prop_assert!(reachable_from_pending(s), "{:?}", s);
            }
        }
    }

    fn reachable_from_pending(target: SandboxState) -> bool {
        let mut seen = vec![Pending];
        let mut i = 0;
        while i < seen.len() {
            for to in SandboxState::ALL {
                if allowed(seen[i], to) && !seen.contains(&to) {
                    seen.push(to);
                }
            }
            i += 1;
        }
        seen.contains(&target)
    }

    #[test]
    fn every_state_is_reachable_and_terminated_is_the_only_dead_end() {
        for s in SandboxState::ALL {
            assert!(reachable_from_pending(s), "{s:?}");
            let exits = SandboxState::ALL.iter().any(|&to| allowed(s, to));
            assert_eq!(exits, s != Terminated, "{s:?}");
        }
    }
}
