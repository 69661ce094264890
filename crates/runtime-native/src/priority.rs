//! The server's own share of a warm sandbox's making yields the CPU too.
//!
//! A pool's refill is started by the delete of a claimed sandbox, so it runs beside the next
//! claim. Its sandbox's processes are already at the least CPU weight (`Background`), but the
//! server thread that makes it (folders, the overlay mount, the spec, the setup helper's start)
//! ran at the normal priority. While the create is background work that thread runs at nice 19,
//! and goes back to its priority once the create ends or someone starts waiting for it.

use std::sync::OnceLock;

use warren_core::Background;

/// The calling thread at nice 19 until dropped, which restores its priority.
pub struct Lowered {
    old: i32,
}

impl Lowered {
    /// Lowers the calling thread while `background` is on; `None` when it is off or when this
    /// process could not raise the thread back afterwards (no `CAP_SYS_NICE`, as root in a
    /// container often lacks): a blocking-pool thread left at nice 19 would slow every create it
    /// later runs.
    pub fn while_on(background: &Background) -> Option<Self> {
        if !background.is_on() || !can_raise() {
            return None;
        }
        let old = current()?;
        set(19).then_some(Self { old })
    }

    /// Drops the lowering once `background` went off meanwhile (a client waits for this sandbox).
    pub fn follow(slot: &mut Option<Self>, background: &Background) {
        if slot.is_some() && !background.is_on() {
            slot.take();
        }
    }
}

impl Drop for Lowered {
    fn drop(&mut self) {
        if !set(self.old) {
            tracing::warn!(
                nice = self.old,
                "could not restore a create thread's priority"
            );
        }
    }
}

/// The calling thread's nice value.
fn current() -> Option<i32> {
    // SAFETY: getpriority(2) on the calling thread (who 0); -1 is a valid answer, so errno is
    // cleared first and read after.
    unsafe {
        *libc::__errno_location() = 0;
        let nice = libc::getpriority(libc::PRIO_PROCESS, 0);
        (nice != -1 || *libc::__errno_location() == 0).then_some(nice)
    }
}

/// Sets the calling thread's nice value (PRIO_PROCESS with who 0 is the calling thread on Linux).
pub fn set(nice: i32) -> bool {
    // SAFETY: setpriority(2) on the calling thread.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) == 0 }
}

/// Whether a lowered thread can be raised back, tried once on a thread of its own.
fn can_raise() -> bool {
    static CAN: OnceLock<bool> = OnceLock::new();
    *CAN.get_or_init(|| {
        std::thread::spawn(|| current().is_some_and(|old| set(old + 1) && set(old)))
            .join()
            .unwrap_or(false)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_background_create_runs_lowered_and_is_raised_back() {
        std::thread::spawn(|| {
            let before = current().expect("nice");
            let on = Background::new(true);
            let mut lowered = Lowered::while_on(&on);
            if can_raise() {
                assert_eq!(current(), Some(19));
                Lowered::follow(&mut lowered, &on);
                assert_eq!(current(), Some(19), "still background");
                on.set(false);
                Lowered::follow(&mut lowered, &on);
                assert!(lowered.is_none());
            } else {
                assert!(
                    lowered.is_none(),
                    "never lowered when it could not be raised back"
                );
            }
            assert_eq!(current(), Some(before));
            assert!(Lowered::while_on(&Background::new(false)).is_none());
        })
        .join()
        .expect("thread");
    }
}
