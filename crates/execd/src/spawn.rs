//! Starting a command with `posix_spawn(3)`. glibc implements it with `clone(CLONE_VM | CLONE_VFORK)`
//! on a small stack of its own, so nothing of execd's address space is copied. `std::process::Command`
//! cannot do that here: when it must change directory it looks `posix_spawn_file_actions_addchdir_np`
//! up with `dlsym`, which fails in a static binary, and falls back to `fork()` — a copy of execd's
//! page tables for every command, and a copy-on-write fault for every page execd writes afterwards.
//! Measured in a sandbox, that fork was a fifth of a short command's cost.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// What the child's stdin is.
#[derive(Debug, Clone, Copy)]
pub enum Stdin {
    Null,
    Fd(RawFd),
    /// execd's own.
    Inherit,
}

/// The child's standard descriptors (the caller keeps its own ends), and its process group.
#[derive(Debug, Clone, Copy)]
pub struct Stdio<'a> {
    pub stdin: Stdin,
    /// `None`: execd's own.
    pub stdout: Option<RawFd>,
    pub stderr: Option<RawFd>,
    /// A process group of its own (pgid = pid), so an interrupt reaches everything it starts.
    pub new_group: bool,
    /// Further descriptors the child gets as 3, 4, …; each must be numbered above the last of those
    /// (else an earlier dup2 would overwrite it before it is copied).
    pub extra: &'a [RawFd],
}

fn cstring(bytes: &[u8]) -> io::Result<CString> {
    CString::new(bytes)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "contains a NUL byte"))
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// Owns the spawn attributes and file actions so every return path destroys them.
struct Plan {
    actions: libc::posix_spawn_file_actions_t,
    attr: libc::posix_spawnattr_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: both were initialised in `Plan::new` and are destroyed once, here.
        unsafe {
            libc::posix_spawn_file_actions_destroy(&mut self.actions);
            libc::posix_spawnattr_destroy(&mut self.attr);
        }
    }
}

impl Plan {
    fn new(stdio: Stdio<'_>, cwd: &CString) -> io::Result<Box<Self>> {
        let first_free = 3 + stdio.extra.len() as RawFd;
        if stdio.extra.iter().any(|fd| *fd < first_free) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "an extra descriptor is numbered among its targets",
            ));
        }
        // SAFETY: zeroed structs are initialised by the *_init calls before any other use; the plan is
        // boxed so the addresses glibc may keep inside them stay put.
        let mut plan: Box<Self> = Box::new(unsafe { std::mem::zeroed() });
        // SAFETY: each posix_spawn_* call gets the plan's own initialised structs and NUL-terminated
        // strings that outlive it; on failure the structs are destroyed before the plan is dropped.
        unsafe {
            check(libc::posix_spawn_file_actions_init(&mut plan.actions))?;
            if let Err(e) = check(libc::posix_spawnattr_init(&mut plan.attr)) {
                libc::posix_spawn_file_actions_destroy(&mut plan.actions);
                std::mem::forget(plan);
                return Err(e);
            }
            let a = &mut plan.actions;
            match stdio.stdin {
                Stdin::Null => check(libc::posix_spawn_file_actions_addopen(
                    a,
                    0,
                    c"/dev/null".as_ptr(),
                    libc::O_RDONLY,
                    0,
                ))?,
                Stdin::Fd(fd) => check(libc::posix_spawn_file_actions_adddup2(a, fd, 0))?,
                Stdin::Inherit => {}
            }
            for (fd, target) in [(stdio.stdout, 1), (stdio.stderr, 2)] {
                if let Some(fd) = fd {
                    check(libc::posix_spawn_file_actions_adddup2(a, fd, target))?;
                }
            }
            for (target, fd) in (3..).zip(stdio.extra) {
                check(libc::posix_spawn_file_actions_adddup2(a, *fd, target))?;
            }
            check(libc::posix_spawn_file_actions_addchdir_np(a, cwd.as_ptr()))?;

            let attr = &mut plan.attr;
            // No blocked signals; every signal at its default (execd ignores SIGPIPE, and an ignored
            // signal would stay ignored across exec).
            let mut flags = libc::POSIX_SPAWN_SETSIGMASK | libc::POSIX_SPAWN_SETSIGDEF;
            if stdio.new_group {
                flags |= libc::POSIX_SPAWN_SETPGROUP;
                check(libc::posix_spawnattr_setpgroup(attr, 0))?;
            }
            check(libc::posix_spawnattr_setflags(attr, flags as libc::c_short))?;
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            check(libc::posix_spawnattr_setsigmask(attr, &set))?;
            libc::sigfillset(&mut set);
            check(libc::posix_spawnattr_setsigdefault(attr, &set))?;
        }
        Ok(plan)
    }
}

/// Where `program` is: itself when it names a path, else the first executable file of that name in
/// the folders of `path` (as `execvp` looks, but with the child's `PATH`, not execd's).
pub fn resolve(program: &str, path: Option<&str>) -> io::Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if program.contains('/') {
        return Ok(program.into());
    }
    let path = path.unwrap_or("/usr/local/bin:/usr/bin:/bin");
    path.split(':')
        .map(|dir| Path::new(if dir.is_empty() { "." } else { dir }).join(program))
        .find(|p| {
            p.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{program}: not found in PATH"),
            )
        })
}

/// Starts `program` (a path: no `PATH` search, see [`resolve`]) with `argv` (argv[0] included) and exactly
/// the environment `env`, in `cwd`. Returns the child's pid; an exec failure (no such program, not
/// executable) is this call's error.
pub fn spawn<'a>(
    program: &Path,
    argv: impl IntoIterator<Item = &'a OsStr>,
    env: impl IntoIterator<Item = (&'a str, &'a str)>,
    cwd: &Path,
    stdio: Stdio<'_>,
) -> io::Result<i32> {
    let program = cstring(program.as_os_str().as_bytes())?;
    let cwd = cstring(cwd.as_os_str().as_bytes())?;
    let argv: Vec<CString> = argv
        .into_iter()
        .map(|a| cstring(a.as_bytes()))
        .collect::<io::Result<_>>()?;
    let env: Vec<CString> = env
        .into_iter()
        .map(|(k, v)| cstring(format!("{k}={v}").as_bytes()))
        .collect::<io::Result<_>>()?;
    let mut argv_ptrs: Vec<*mut libc::c_char> =
        argv.iter().map(|a| a.as_ptr().cast_mut()).collect();
    argv_ptrs.push(std::ptr::null_mut());
    let mut env_ptrs: Vec<*mut libc::c_char> = env.iter().map(|e| e.as_ptr().cast_mut()).collect();
    env_ptrs.push(std::ptr::null_mut());
    let plan = Plan::new(stdio, &cwd)?;
    let mut pid: libc::pid_t = 0;
    // SAFETY: every pointer is to a NUL-terminated string or a NULL-terminated array that outlives the
    // call; `plan` holds initialised attributes and file actions.
    let rc = unsafe {
        libc::posix_spawn(
            &mut pid,
            program.as_ptr(),
            &plan.actions,
            &plan.attr,
            argv_ptrs.as_ptr(),
            env_ptrs.as_ptr(),
        )
    };
    check(rc)?;
    Ok(pid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsRawFd;

    fn run(
        program: &str,
        args: &[&str],
        env: &[(&str, &str)],
        cwd: &str,
    ) -> io::Result<(i32, String)> {
        let (mut r, w) = std::io::pipe()?;
        let mut argv = vec![OsStr::new(program)];
        argv.extend(args.iter().map(OsStr::new));
        let pid = spawn(
            Path::new(program),
            argv,
            env.iter().copied(),
            Path::new(cwd),
            Stdio {
                stdin: Stdin::Null,
                stdout: Some(w.as_raw_fd()),
                stderr: Some(w.as_raw_fd()),
                new_group: true,
                extra: &[],
            },
        )?;
        drop(w);
        let mut out = String::new();
        r.read_to_string(&mut out)?;
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        Ok((libc::WEXITSTATUS(status), out))
    }

    #[test]
    fn runs_with_exactly_the_given_env_cwd_and_own_process_group() {
        let (code, out) = run(
            "/bin/sh",
            &[
                "-c",
                "echo \"$A|$HOME|$(pwd)\"; test $(ps -o pgid= $$) = $$ && exit 7",
            ],
            &[("A", "x y"), ("PATH", "/usr/bin:/bin")],
            "/tmp",
        )
        .expect("spawn");
        assert_eq!(out.trim(), "x y||/tmp");
        assert_eq!(code, 7, "its own process group");
    }

    #[test]
    fn stdin_is_dev_null_and_signals_are_at_their_defaults() {
        // SIGPIPE ignored here must not stay ignored in the child: `yes | head` would then spin. (glibc
        // leaves its two internal signals, 32 and 33, ignored; its own start-up in the child resets them.)
        // SAFETY: setting a signal disposition of this test process.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
        let (code, out) = run(
            "/bin/sh",
            &["-c", "cat; v=$(awk '/^SigIgn/ {print $2}' /proc/self/status); [ $((0x$v & 0x1000)) = 0 ] && echo clean"],
            &[("PATH", "/usr/bin:/bin")],
            "/",
        )
        .expect("spawn");
        assert_eq!((code, out.trim()), (0, "clean"));
    }

    #[test]
    fn programs_are_found_in_the_given_path() {
        assert_eq!(
            resolve("sh", Some("/nonexistent:/bin")).expect("sh"),
            Path::new("/bin/sh")
        );
        assert_eq!(resolve("./x", None).expect("a path"), Path::new("./x"));
        let err = resolve("sh", Some("/nonexistent")).expect_err("not there");
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn extra_descriptors_become_3_and_up() {
        let (mut r, w) = std::io::pipe().expect("pipe");
        let extra = std::fs::File::open("/dev/null").expect("open");
        let above = |fd: RawFd| {
            // SAFETY: duplicating a descriptor this test owns; the copy is closed below.
            unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10) }
        };
        let (a, b) = (above(w.as_raw_fd()), above(extra.as_raw_fd()));
        let pid = spawn(
            Path::new("/bin/sh"),
            [
                "/bin/sh",
                "-c",
                "echo via3 >&3; readlink /proc/self/fd/4 >&3",
            ]
            .map(OsStr::new),
            [("PATH", "/usr/bin:/bin")],
            Path::new("/"),
            Stdio {
                stdin: Stdin::Null,
                stdout: None,
                stderr: None,
                new_group: false,
                extra: &[a, b],
            },
        )
        .expect("spawn");
        // SAFETY: closing the copies made above; waiting for our own child.
        unsafe {
            libc::close(a);
            libc::close(b);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
        drop(w);
        let mut out = String::new();
        r.read_to_string(&mut out).expect("read");
        assert_eq!(out, "via3\n/dev/null\n");

        let clash = Stdio {
            stdin: Stdin::Null,
            stdout: None,
            stderr: None,
            new_group: false,
            extra: &[4, 20],
        };
        let err = spawn(
            Path::new("/bin/true"),
            [OsStr::new("true")],
            [],
            Path::new("/"),
            clash,
        )
        .expect_err("a source among the targets");
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn exec_failures_are_errors() {
        let err = run("/nonexistent/prog", &[], &[], "/").expect_err("no such program");
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        let err = run("/bin/sh", &[], &[], "/nonexistent-dir").expect_err("no such cwd");
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }
}
