//! Background loops that outlive a panic. A task that panics in tokio ends alone, silently: the
//! reaper (expiry, retention) or a pool's refill would then stop for the rest of the server's life.
//! [`supervised`] logs the panic (the hook installed by [`log_panics`] says where) and starts the
//! loop again after a pause.

use std::future::Future;
use std::time::Duration;

/// How long a loop that panicked waits before it runs again: a loop that panics at once every
/// time costs one log line a second, not a core.
const RESTART_PAUSE: Duration = Duration::from_secs(1);

/// Runs `make()`'s future as a task, again after each panic, until it returns. Aborting the
/// returned handle aborts the current run too.
pub fn supervised<F, Fut>(name: &'static str, make: F) -> tokio::task::JoinHandle<()>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    tokio::spawn(async move {
        loop {
            let mut run = AbortOnDrop(tokio::spawn(make()));
            match (&mut run.0).await {
                Ok(()) => return,
                Err(e) if e.is_panic() => {
                    tracing::error!(task = name, "a background task panicked; it starts again");
                    tokio::time::sleep(RESTART_PAUSE).await;
                }
                Err(_) => return,
            }
        }
    })
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Sends every panic, of any thread or task, to the log with its thread and place, once: a
/// panic the server survives must still be seen.
pub fn log_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let thread = std::thread::current();
            tracing::error!(thread = thread.name().unwrap_or("unnamed"), "panic: {info}");
            if tracing::enabled!(tracing::Level::DEBUG) {
                default(info);
            }
        }));
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    #[tokio::test]
    async fn a_loop_that_panics_runs_again_and_ends_when_it_returns() {
        let runs = Arc::new(AtomicU32::new(0));
        let counted = runs.clone();
        let handle = supervised("test", move || {
            let runs = counted.clone();
            async move {
                if runs.fetch_add(1, Ordering::SeqCst) < 2 {
                    panic!("boom");
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(10), handle)
            .await
            .expect("ends")
            .expect("no panic escapes");
        assert_eq!(runs.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn aborting_the_handle_stops_the_run() {
        let ticks = Arc::new(AtomicU32::new(0));
        let counted = ticks.clone();
        let handle = supervised("test", move || {
            let ticks = counted.clone();
            async move {
                loop {
                    ticks.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        });
        tokio::time::sleep(Duration::from_millis(30)).await;
        handle.abort();
        let _ = handle.await;
        let seen = ticks.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            ticks.load(Ordering::SeqCst),
            seen,
            "the run was aborted with its supervisor"
        );
    }
}
