//! A shell started ahead of the next command.
//!
//! Most of a short command's time is the shell starting: `bash -c 'echo hi'` spends ~1.3 ms of a
//! pool claim's ~3.5 ms loading itself and glibc (whose start reads the CPU's cache geometry with
//! dozens of `cpuid`s, each a VM exit on a virtual machine), the locale and the passwd entry. So once
//! execd has had no foreground command running, and started none, for [`IDLE`], it starts a bash
//! that does all that and then waits for a command: `bash -c BOOTSTRAP` with a pipe as descriptor 3
//! (the go signal) and an empty memfd as descriptor 4 (the command's text). A foreground shell command that fits — execd's own user, the
//! spare's working directory, an environment the spare has or can be given with `export` — takes
//! it: execd writes the text into the memfd and a byte into the pipe, and the shell reads the text
//! and `eval`s it, its stdout and stderr already the command's pipes. Any other command starts as
//! before, and the spare stays for the next one. Back-to-back commands never wait for a spare and
//! never pay for one: it is only started in a pause, and only one at a time.
//!
//! What a command run this way sees differently from `bash -c COMMAND`: bash does not `exec` the
//! last command in place of itself (its one-command optimisation applies to `-c`, not to `eval`),
//! so an external program's parent is the shell rather than execd; a syntax error reads `bash:
//! syntax error …` rather than `bash: -c: line 1: syntax error …`; `BASH_EXECUTION_STRING`, and
//! the shell's command line (`/proc/$$/cmdline`, what `ps` shows), hold the bootstrap. Exit codes,
//! output, signals to the process group, `$0`, `$$`, `$PPID`, positional parameters, options,
//! descriptors and variables are those of `bash -c` (an e2e test compares the two).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tokio::sync::{oneshot, Notify};

use crate::process::{self, base_env, kill_group, ProcessSpec, Program, Running};
use crate::reaper::{Exit, Reaper};

/// How long execd must have had no foreground command running, and started none, before it starts
/// a spare shell: long enough that a sandbox made, used once and deleted at once (a benchmark, a
/// one-shot job, however long its command runs) never starts one it throws away, short enough that
/// an agent's next command, or a pool sandbox's first, finds one.
pub const IDLE: Duration = Duration::from_millis(100);

/// `WARREN_SPARE_SHELL=0` in a sandbox's environment: every command starts its own shell.
pub use warren_api::execd::SPARE_SHELL_ENV as OFF_VAR;

/// The longest pause between tries when spare shells fail to start (no bash, workdir gone, …).
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// What the spare runs. It waits for one byte on 3 (EOF, when execd drops it, ends it quietly), reads
/// the command from the memfd on 4 (seekable, so bash's `read` takes it in blocks, not byte by byte)
/// and `eval`s it.
const BOOTSTRAP: &str = "read -r -n 1 -u 3 __warren_go || exit 0; exec 3<&-; \
     IFS= read -r -d '' -u 4 __warren_cmd; exec 4<&-; eval \"$__warren_cmd\"";
/// Before the command, in the text execd writes: the bootstrap's variables go, so the command sees
/// none of this ...
const PREFIX: &str = "unset -v __warren_go __warren_cmd; ";

/// ... and, after the environment's changes, what a fresh `bash -c` starts with: `$SECONDS`
/// counting from now, not from the spare's start (`while [ $SECONDS -lt 10 ]` must wait), and `$_`
/// what bash sets it to as it starts (the environment's `_`, else the path it was run as) — the
/// last argument of the last command before the user's.
fn reset(env: &BTreeMap<String, String>) -> String {
    let underscore = env.get("_").map_or(process::shell(), String::as_str);
    format!("SECONDS=0; : {}; ", quote(underscore))
}

/// `value` as one single-quoted shell word.
fn quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', r"'\''"))
}

/// The shell that waits, and what it was started with.
struct Spare {
    pid: i32,
    exit: oneshot::Receiver<Exit>,
    stdout: OwnedFd,
    stderr: OwnedFd,
    go: File,
    text: File,
    cwd: PathBuf,
    env: BTreeMap<String, String>,
}

impl Spare {
    fn discard(self) {
        kill_group(self.pid, Signal::SIGKILL);
    }
}

/// The slot for one spare shell and what decides when to fill it.
pub struct SpareShell {
    slot: Mutex<Option<Spare>>,
    activity: Arc<Activity>,
    taken: Notify,
    stopped: std::sync::atomic::AtomicBool,
}

/// When a command last started or ended, and how many foreground ones run.
struct Activity {
    last: Mutex<Instant>,
    running: AtomicUsize,
    /// Told when the last running foreground command ends.
    quiet: Notify,
}

impl Activity {
    fn touch(&self) {
        *lock(&self.last) = Instant::now();
    }
}

/// Held while a foreground command runs: no spare is started meanwhile, and the pause that starts
/// one counts from its end.
pub struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.touch();
        if self.0.running.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.quiet.notify_one();
        }
    }
}

impl Default for SpareShell {
    fn default() -> Self {
        Self {
            slot: Mutex::new(None),
            activity: Arc::new(Activity {
                last: Mutex::new(Instant::now()),
                running: AtomicUsize::new(0),
                quiet: Notify::new(),
            }),
            taken: Notify::new(),
            stopped: Default::default(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl SpareShell {
    /// Keeps a spare shell ready in `workdir` whenever execd has been idle for [`IDLE`]; runs for
    /// execd's whole life. Does nothing in an image without bash, or when the sandbox's environment
    /// sets [`OFF_VAR`] to `0`.
    pub async fn keep(&self, reaper: Reaper, workdir: PathBuf) {
        // A spare starts with posix_spawn, which cannot lay the floor (see `hardening`): under
        // the floor every command starts its own shell.
        if process::shell() != "/bin/bash"
            || warren_env::var(OFF_VAR).is_some_and(|v| v == "0")
            || reaper.floor().is_some()
        {
            return;
        }
        let mut backoff = IDLE;
        loop {
            // Registered before looking, so a command ending in between is not missed.
            let quiet = self.activity.quiet.notified();
            tokio::pin!(quiet);
            quiet.as_mut().enable();
            if self.activity.running.load(Ordering::SeqCst) > 0 {
                quiet.await;
                continue;
            }
            let since = lock(&self.activity.last).elapsed();
            if since < IDLE {
                tokio::time::sleep(IDLE - since).await;
                continue;
            }
            if lock(&self.slot).is_some() {
                self.taken.notified().await;
                continue;
            }
            if self.stopped.load(Ordering::SeqCst) {
                return;
            }
            match start(&reaper, &workdir) {
                Ok(spare) => {
                    tracing::debug!(pid = spare.pid, "spare shell started");
                    backoff = IDLE;
                    if let Some(old) = lock(&self.slot).replace(spare) {
                        old.discard();
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "spare shell did not start");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// A foreground command runs until the returned value is dropped.
    pub fn busy(&self) -> Busy {
        self.activity.running.fetch_add(1, Ordering::SeqCst);
        self.activity.touch();
        Busy(self.activity.clone())
    }

    /// Starts `spec` on the spare shell when there is one and the command fits it; `None` means
    /// "start it the usual way". Either way execd counts a command as started now.
    pub fn take(&self, spec: &ProcessSpec) -> Option<Running> {
        self.activity.touch();
        let Program::Shell(script) = &spec.program else {
            return None;
        };
        if spec.uid.is_some() || spec.combine_output || script.contains('\0') {
            return None;
        }
        let mut slot = lock(&self.slot);
        let spare = slot.as_mut()?;
        if !matches!(
            spare.exit.try_recv(),
            Err(oneshot::error::TryRecvError::Empty)
        ) {
            // It ended (someone killed it): the next pause starts another.
            slot.take();
            self.taken.notify_one();
            return None;
        }
        if spare.cwd != spec.cwd || !spec.cwd.is_dir() {
            return None;
        }
        // What `command_env(&spec.envs)` gives, with the base (the env file read once) kept apart.
        let base = base_env();
        let mut env = base.clone();
        env.extend(spec.envs.iter().map(|(k, v)| (k.clone(), v.clone())));
        let Some(exports) = env_change(&spare.env, &env) else {
            // A different environment than the spare's: if the base one changed (the env file did),
            // the spare is of no use to anyone any more.
            if spare.env != base {
                if let Some(stale) = slot.take() {
                    stale.discard();
                }
                self.taken.notify_one();
            }
            return None;
        };
        let spare = slot.take()?;
        drop(slot);
        self.taken.notify_one();
        let text = format!("{PREFIX}{exports}{}{script}", reset(&env));
        let sent = spare
            .text
            .write_all_at(text.as_bytes(), 0)
            .and_then(|()| (&spare.go).write_all(b"x"));
        if let Err(e) = sent {
            tracing::debug!(pid = spare.pid, error = %e, "spare shell gone; starting the command anew");
            spare.discard();
            return None;
        }
        let Spare {
            pid,
            exit,
            stdout,
            stderr,
            ..
        } = spare;
        process::running(pid, exit, Some(stdout), Some(stderr), None).ok()
    }

    /// Kills the spare (execd is stopping) and starts no other.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        if let Some(spare) = lock(&self.slot).take() {
            spare.discard();
        }
        self.taken.notify_one();
    }
}

/// Starts a spare shell in `cwd` with the environment a command without `envs` gets now.
fn start(reaper: &Reaper, cwd: &Path) -> std::io::Result<Spare> {
    let env = base_env();
    let (out_r, out_w) = std::io::pipe()?;
    let (err_r, err_w) = std::io::pipe()?;
    let (go_r, go_w) = std::io::pipe()?;
    let text = memfd()?;
    // Descriptors 3 and 4 of the child come from these; numbered above 4 so no dup2 overwrites the
    // other's source (execd's listeners and tokio's own descriptors sit below them anyway).
    let go_r = above(go_r.into(), 4)?;
    let text_fd = above(text.try_clone()?.into(), 4)?;
    let program = process::shell();
    let argv = [program, "-c", BOOTSTRAP].map(std::ffi::OsStr::new);
    let (pid, exit) = reaper.start(|| {
        crate::spawn::spawn(
            Path::new(program),
            argv,
            env.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            cwd,
            crate::spawn::Stdio {
                stdin: crate::spawn::Stdin::Null,
                stdout: Some(out_w.as_raw_fd()),
                stderr: Some(err_w.as_raw_fd()),
                new_group: true,
                extra: &[go_r.as_raw_fd(), text_fd.as_raw_fd()],
            },
        )
    })?;
    Ok(Spare {
        pid,
        exit,
        stdout: out_r.into(),
        stderr: err_r.into(),
        go: File::from(OwnedFd::from(go_w)),
        text,
        cwd: cwd.to_path_buf(),
        env,
    })
}

/// An anonymous, close-on-exec in-memory file.
fn memfd() -> std::io::Result<File> {
    // SAFETY: a NUL-terminated name and valid flags; the descriptor returned is ours alone.
    let fd = unsafe { libc::memfd_create(c"warren-command".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// `fd`, or a close-on-exec copy of it numbered above `n`.
fn above(fd: OwnedFd, n: i32) -> std::io::Result<OwnedFd> {
    if fd.as_raw_fd() > n {
        return Ok(fd);
    }
    // SAFETY: duplicating a descriptor we own; the copy is owned by the returned value.
    let copy = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, n + 1) };
    if copy < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    Ok(unsafe { OwnedFd::from_raw_fd(copy) })
}

/// Variables bash reads only as it starts, or treats specially (its own, the prompt and history
/// ones, the locale aside): a command whose environment differs from the spare's in one of these
/// starts the usual way.
const SPECIAL: &[&str] = &[
    "CDPATH",
    "CHILD_MAX",
    "COLUMNS",
    "COPROC",
    "DIRSTACK",
    "EMACS",
    "ENV",
    "EPOCHREALTIME",
    "EPOCHSECONDS",
    "EUID",
    "EXECIGNORE",
    "FCEDIT",
    "FIGNORE",
    "FUNCNAME",
    "FUNCNEST",
    "GLOBIGNORE",
    "GROUPS",
    "HISTCMD",
    "HISTCONTROL",
    "HISTFILE",
    "HISTFILESIZE",
    "HISTIGNORE",
    "HISTSIZE",
    "HISTTIMEFORMAT",
    "HOSTFILE",
    "HOSTNAME",
    "HOSTTYPE",
    "IFS",
    "IGNOREEOF",
    "INPUTRC",
    "INSIDE_EMACS",
    "LINENO",
    "LINES",
    "MACHTYPE",
    "MAIL",
    "MAILCHECK",
    "MAILPATH",
    "MAPFILE",
    "OLDPWD",
    "OPTARG",
    "OPTERR",
    "OPTIND",
    "OSTYPE",
    "PIPESTATUS",
    "POSIXLY_CORRECT",
    "PPID",
    "PROMPT_COMMAND",
    "PROMPT_DIRTRIM",
    "PS0",
    "PS1",
    "PS2",
    "PS3",
    "PS4",
    "PWD",
    "RANDOM",
    "REPLY",
    "SECONDS",
    "SHELL",
    "SHELLOPTS",
    "SHLVL",
    "SRANDOM",
    "TIMEFORMAT",
    "TMOUT",
    "UID",
];

/// A plain variable: one that `export` sets exactly as if it had come with the environment.
fn plain(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
        && name != "_"
        && !name.starts_with("BASH")
        && !name.starts_with("COMP_")
        && !name.starts_with("READLINE_")
        && !name.starts_with("__warren_")
        && !SPECIAL.contains(&name)
}

/// The `export`/`unset` statements that turn the environment `from` into `to`, or `None` when a
/// difference is in a variable that is not [`plain`].
fn env_change(from: &BTreeMap<String, String>, to: &BTreeMap<String, String>) -> Option<String> {
    let mut out = String::new();
    for (name, value) in to {
        if from.get(name) != Some(value) {
            if !plain(name) {
                return None;
            }
            out.push_str(&format!("export {name}={}; ", quote(value)));
        }
    }
    for name in from.keys().filter(|name| !to.contains_key(*name)) {
        if !plain(name) {
            return None;
        }
        out.push_str("unset -v ");
        out.push_str(name);
        out.push_str("; ");
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn the_same_environment_needs_nothing() {
        let e = env(&[("PATH", "/bin"), ("HOME", "/root")]);
        assert_eq!(env_change(&e, &e).as_deref(), Some(""));
    }

    #[test]
    fn plain_variables_are_exported_quoted_and_unset() {
        let from = env(&[("PATH", "/bin"), ("GONE", "x")]);
        let to = env(&[("PATH", "/usr/bin:/bin"), ("MSG", "it's $HOME\n`x`")]);
        assert_eq!(
            env_change(&from, &to).as_deref(),
            Some("export MSG='it'\\''s $HOME\n`x`'; export PATH='/usr/bin:/bin'; unset -v GONE; ")
        );
    }

    #[test]
    fn variables_bash_reads_at_start_or_owns_need_a_fresh_shell() {
        let from = env(&[("PATH", "/bin")]);
        for name in [
            "BASH_ENV",
            "SHELLOPTS",
            "IFS",
            "BASH_FUNC_f%%",
            "PS4",
            "UID",
            "a-b",
            "_",
            "9x",
        ] {
            let to = env(&[("PATH", "/bin"), (name, "v")]);
            assert_eq!(env_change(&from, &to), None, "{name}");
        }
        let to = env(&[
            ("PATH", "/bin"),
            ("LANG", "C.UTF-8"),
            ("LC_ALL", "C"),
            ("TZ", "UTC"),
        ]);
        assert!(env_change(&from, &to).is_some());
    }
}
