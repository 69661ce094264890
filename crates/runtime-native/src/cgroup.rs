//! Per-sandbox cgroups on both layouts Warren meets: cgroup v2 (unified, what most users run) and
//! cgroup v1 with one hierarchy per controller (this project's CI machines). The sandbox's cgroup is
//! also its freezer (pause/resume) and the source of execd's `/metrics`.
//!
//! Why one file: each operation is written once for both layouts, a `match` on `Layout` whose v1
//! and v2 arms sit side by side; ~140 of its lines are tests over fake hierarchies in temporary
//! folders.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use warren_core::ResourceLimits;

/// Controllers Warren uses on cgroup v1; each lives in its own hierarchy (or a co-mounted one).
const V1_CONTROLLERS: [&str; 5] = ["cpu", "cpuacct", "memory", "pids", "freezer"];
const CFS_PERIOD_US: u64 = 100_000;

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no usable cgroup hierarchy under {0}")]
    NoHierarchy(PathBuf),
    #[error("cgroup controller {0} is not available")]
    MissingController(&'static str),
    #[error("the sandbox's processes did not reach {want} within {secs} s")]
    NotSettled { want: &'static str, secs: u64 },
    #[error("cgroup file {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> CgroupError + '_ {
    move |source| CgroupError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    fs::write(path, value).map_err(io_err(path))
}

/// A sandbox's claim on the CPU when the machine is busy, relative to other sandboxes (a weight,
/// not a limit: an idle machine gives either all it has).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuShare {
    /// The kernel's default weight, as every other process has.
    Normal,
    /// The smallest weight there is: made ahead of need (a warm pool's sandbox), so its setup and
    /// whatever it runs while nobody uses it yield to the sandboxes in use.
    Background,
}

/// Which layout the host uses, found once at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// Unified hierarchy at `root` (e.g. `/sys/fs/cgroup`).
    V2 { root: PathBuf },
    /// Controller name → hierarchy mount point (e.g. `memory` → `/sys/fs/cgroup/memory`).
    V1 { hierarchies: Vec<(String, PathBuf)> },
}

impl Layout {
    /// Detects the layout under `base` (normally `/sys/fs/cgroup`). A cgroup2 mount with no controllers
    /// (the hybrid layout) does not count as v2.
    pub fn detect(base: &Path) -> Result<Self, CgroupError> {
        let controllers = base.join("cgroup.controllers");
        if let Ok(list) = fs::read_to_string(&controllers) {
            if list.split_whitespace().any(|c| c == "memory") {
                return Ok(Layout::V2 {
                    root: base.to_path_buf(),
                });
            }
        }
        let mut hierarchies = Vec::new();
        for ctrl in V1_CONTROLLERS {
            let dir = base.join(ctrl);
            if dir.join("cgroup.procs").exists() {
                // Co-mounted controllers (`cpu` and `cpuacct` → `cpu,cpuacct`) share one real directory.
                let real = fs::canonicalize(&dir).unwrap_or(dir);
                hierarchies.push((ctrl.to_string(), real));
            }
        }
        if hierarchies.iter().any(|(c, _)| c == "memory") {
            Ok(Layout::V1 { hierarchies })
        } else {
            Err(CgroupError::NoHierarchy(base.to_path_buf()))
        }
    }

    /// Whether a cgroup can be renamed ([`Cgroup::rename`]): v1 only. The unified hierarchy has no
    /// rename (the kernel answers EPERM), and needs none for standby helpers: there the zygote
    /// starts each setup helper inside its cgroup (`clone3(CLONE_INTO_CGROUP)`), no migration.
    pub fn can_rename(&self) -> bool {
        matches!(self, Layout::V1 { .. })
    }

    /// Makes the `parent` cgroup every sandbox's goes in, in each hierarchy (on v2, with the
    /// controllers delegated down to it), so that a host where that cannot be done — cgroups
    /// mounted read-only, as in a container without `--privileged` — is found at start, not at
    /// every create.
    pub fn prepare(&self, parent: &str) -> Result<(), CgroupError> {
        let parents: Vec<PathBuf> = match self {
            Layout::V2 { root } => {
                enable_v2_controllers(root, &root.join(parent))?;
                vec![root.join(parent)]
            }
            Layout::V1 { hierarchies } => hierarchies.iter().map(|(_, h)| h.join(parent)).collect(),
        };
        // A parent left by an earlier start exists even where nothing can be made any more: a
        // child made and removed again tells.
        for dir in parents {
            fs::create_dir_all(&dir).map_err(io_err(&dir))?;
            let probe = dir.join(format!("warren-probe-{}", std::process::id()));
            fs::create_dir(&probe).map_err(io_err(&probe))?;
            fs::remove_dir(&probe).map_err(io_err(&probe))?;
        }
        Ok(())
    }

    fn v1_dir(&self, ctrl: &'static str) -> Option<&Path> {
        match self {
            Layout::V1 { hierarchies } => hierarchies
                .iter()
                .find(|(c, _)| c == ctrl)
                .map(|(_, p)| p.as_path()),
            Layout::V2 { .. } => None,
        }
    }
}

/// The cgroup(s) of one sandbox: `<hierarchy>/<parent>/<id>` for each hierarchy.
#[derive(Debug, Clone)]
pub struct Cgroup {
    layout: Layout,
    /// One directory per hierarchy (a single one on v2); deduplicated for co-mounted controllers.
    dirs: Vec<PathBuf>,
}

impl Cgroup {
    /// Names the sandbox's cgroup without touching the filesystem.
    pub fn at(layout: &Layout, parent: &str, id: &str) -> Self {
        let mut dirs: Vec<PathBuf> = Vec::new();
        match layout {
            Layout::V2 { root } => dirs.push(root.join(parent).join(id)),
            Layout::V1 { hierarchies } => {
                for (_, h) in hierarchies {
                    let dir = h.join(parent).join(id);
                    if !dirs.contains(&dir) {
                        dirs.push(dir);
                    }
                }
            }
        }
        Self {
            layout: layout.clone(),
            dirs,
        }
    }

    /// Creates the cgroup and applies the limits. On error, whatever was created is removed again.
    pub fn create(
        layout: &Layout,
        parent: &str,
        id: &str,
        limits: &ResourceLimits,
    ) -> Result<Self, CgroupError> {
        let cg = Self::at(layout, parent, id);
        if let Layout::V2 { root } = layout {
            enable_v2_controllers(root, &root.join(parent))?;
        }
        let result = (|| {
            for dir in &cg.dirs {
                fs::create_dir_all(dir).map_err(io_err(dir))?;
            }
            cg.apply(limits)
        })();
        if let Err(e) = result {
            let _ = cg.remove(Duration::from_millis(200));
            return Err(e);
        }
        Ok(cg)
    }

    pub fn apply(&self, limits: &ResourceLimits) -> Result<(), CgroupError> {
        match &self.layout {
            Layout::V2 { .. } => {
                let dir = &self.dirs[0];
                write(&dir.join("pids.max"), &limits.pids.to_string())?;
                if let Some(mem) = limits.memory_bytes {
                    write(&dir.join("memory.max"), &mem.to_string())?;
                    // Without this a sandbox could push the host into swap instead of hitting its limit.
                    let swap = dir.join("memory.swap.max");
                    if swap.exists() {
                        write(&swap, "0")?;
                    }
                }
                if let Some(cpu) = limits.cpu_millis {
                    write(
                        &dir.join("cpu.max"),
                        &format!("{} {}", cpu * CFS_PERIOD_US / 1000, CFS_PERIOD_US),
                    )?;
                }
            }
            Layout::V1 { .. } => {
                let pids = self
                    .v1("pids")
                    .ok_or(CgroupError::MissingController("pids"))?;
                write(&pids.join("pids.max"), &limits.pids.to_string())?;
                if let Some(mem) = limits.memory_bytes {
                    let dir = self
                        .v1("memory")
                        .ok_or(CgroupError::MissingController("memory"))?;
                    // memsw (memory + swap) = memory: without it a sandbox at its limit goes
                    // on in swap, unbounded (v2's `memory.swap.max = 0` above). memsw may never be
                    // below the memory limit, so the order of the two writes depends on which way
                    // they move; the file is absent where the kernel does not account swap.
                    let limit = dir.join("memory.limit_in_bytes");
                    let memsw = dir.join("memory.memsw.limit_in_bytes");
                    let value = mem.to_string();
                    if memsw.exists() {
                        // lowered (or first set): the limit, then memsw; raised: memsw first
                        if fs::write(&limit, &value).is_ok() {
                            write(&memsw, &value)?;
                        } else {
                            write(&memsw, &value)?;
                            write(&limit, &value)?;
                        }
                    } else {
                        write(&limit, &value)?;
                    }
                    let _ = fs::write(dir.join("memory.swappiness"), "0");
                }
                if let Some(cpu) = limits.cpu_millis {
                    let dir = self
                        .v1("cpu")
                        .ok_or(CgroupError::MissingController("cpu"))?;
                    write(&dir.join("cpu.cfs_period_us"), &CFS_PERIOD_US.to_string())?;
                    write(
                        &dir.join("cpu.cfs_quota_us"),
                        &(cpu * CFS_PERIOD_US / 1000).to_string(),
                    )?;
                }
            }
        }
        Ok(())
    }

    /// Sets the cgroup's CPU weight: v2 `cpu.weight` (1–10000, default 100), v1 `cpu.shares` (2–
    /// 262144, default 1024). A cgroup that is not there (an OCI runtime's that is already gone)
    /// is fine.
    pub fn set_cpu_share(&self, share: CpuShare) -> Result<(), CgroupError> {
        let (file, value) = match &self.layout {
            Layout::V2 { .. } => (
                self.dirs[0].join("cpu.weight"),
                if share == CpuShare::Normal {
                    "100"
                } else {
                    "1"
                },
            ),
            Layout::V1 { .. } => (
                self.v1("cpu")
                    .ok_or(CgroupError::MissingController("cpu"))?
                    .join("cpu.shares"),
                if share == CpuShare::Normal {
                    "1024"
                } else {
                    "2"
                },
            ),
        };
        match fs::write(&file, value) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            other => other.map_err(io_err(&file)),
        }
    }

    fn v1(&self, ctrl: &'static str) -> Option<PathBuf> {
        let base = self.layout.v1_dir(ctrl)?;
        self.dirs.iter().find(|d| d.starts_with(base)).cloned()
    }

    /// Renames the cgroup (in every hierarchy) to `id`, processes and all: how a standby helper's
    /// cgroup becomes a sandbox's. On error the directories renamed so far are renamed back.
    pub fn rename(&self, id: &str) -> Result<Cgroup, CgroupError> {
        let mut done: Vec<(PathBuf, PathBuf)> = Vec::new();
        for dir in &self.dirs {
            let to = dir.with_file_name(id);
            if let Err(source) = fs::rename(dir, &to) {
                for (from, to) in done.iter().rev() {
                    let _ = fs::rename(to, from);
                }
                return Err(CgroupError::Io {
                    path: dir.clone(),
                    source,
                });
            }
            done.push((dir.clone(), to));
        }
        Ok(Cgroup {
            layout: self.layout.clone(),
            dirs: done.into_iter().map(|(_, to)| to).collect(),
        })
    }

    /// The files a single-threaded process writes `0` into to join the sandbox's cgroup: on v1
    /// `tasks` (moves the calling thread), on v2 `cgroup.procs`.
    ///
    /// Why `tasks` on v1: a write to `cgroup.procs` moves a whole thread group, so the kernel takes
    /// the global `cgroup_threadgroup_rwsem` for writing, which first waits out an RCU grace period
    /// (milliseconds) — all the while holding `cgroup_mutex`, so every cgroup mkdir, rmdir and rename
    /// on the machine waits too (4–9 ms stalls, in bursts, with sandboxes made back to back). Moving
    /// the calling thread itself needs neither (kernels from 6.0 on). The setup helper is
    /// single-threaded, so that thread is the whole process, and all it forks starts in the cgroup.
    pub fn join_files(&self) -> Vec<PathBuf> {
        let name = match self.layout {
            Layout::V1 { .. } => "tasks",
            Layout::V2 { .. } => "cgroup.procs",
        };
        self.dirs.iter().map(|d| d.join(name)).collect()
    }

    /// On v2, the directory a new process can be created straight into (`CLONE_INTO_CGROUP`, Linux
    /// 5.7+), so it need not join through `cgroup.procs` — that write takes the same global lock,
    /// and waits out the same grace period under `cgroup_mutex`, as described at `join_files`.
    /// `None` on v1, which has no such clone flag.
    pub fn clone_into_dir(&self) -> Option<&Path> {
        match self.layout {
            Layout::V2 { .. } => self.dirs.first().map(PathBuf::as_path),
            Layout::V1 { .. } => None,
        }
    }

    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// Freezes (pause) or thaws (resume) every process of the sandbox, and returns once they all
    /// are: freezing is asynchronous on both versions, and a snapshot taken from a sandbox that is
    /// still running could copy a folder it is swapping at that moment. An error if that takes more
    /// than 5 s.
    pub fn set_frozen(&self, frozen: bool) -> Result<(), CgroupError> {
        const SECS: u64 = 5;
        // The file to write, what to write, and the file and line that say it took effect.
        let (file, value, state_file, want) = match &self.layout {
            Layout::V2 { .. } => (
                self.dirs[0].join("cgroup.freeze"),
                if frozen { "1" } else { "0" },
                self.dirs[0].join("cgroup.events"),
                if frozen { "frozen 1" } else { "frozen 0" },
            ),
            Layout::V1 { .. } => {
                let dir = self
                    .v1("freezer")
                    .ok_or(CgroupError::MissingController("freezer"))?;
                let state = if frozen { "FROZEN" } else { "THAWED" };
                (
                    dir.join("freezer.state"),
                    state,
                    dir.join("freezer.state"),
                    state,
                )
            }
        };
        write(&file, value)?;
        let deadline = Instant::now() + Duration::from_secs(SECS);
        loop {
            let state = fs::read_to_string(&state_file).map_err(io_err(&state_file))?;
            if state.lines().any(|l| l.trim() == want) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(CgroupError::NotSettled {
                    want: if frozen { "frozen" } else { "thawed" },
                    secs: SECS,
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    pub fn is_frozen(&self) -> bool {
        match &self.layout {
            Layout::V2 { .. } => fs::read_to_string(self.dirs[0].join("cgroup.freeze"))
                .map(|s| s.trim() == "1")
                .unwrap_or(false),
            Layout::V1 { .. } => self
                .v1("freezer")
                .and_then(|d| fs::read_to_string(d.join("freezer.state")).ok())
                .map(|s| s.trim() != "THAWED")
                .unwrap_or(false),
        }
    }

    /// Pids currently in the sandbox's cgroup (from the first hierarchy; every process joins all).
    pub fn pids(&self) -> Vec<i32> {
        self.dirs.first().map(|d| procs_in(d)).unwrap_or_default()
    }

    /// Kills whatever is still inside, then removes the directories, retrying while the kernel drains
    /// the cgroup. Cgroups nested inside (an OCI runtime's, an operator's) go first, with their
    /// processes: the kernel refuses to remove a cgroup that has children. Missing directories are
    /// fine (idempotent). An error if something is still there at `within`: a process that cannot
    /// die yet (in uninterruptible sleep on a hung mount, or frozen in a nested cgroup).
    pub fn remove(&self, within: Duration) -> Result<(), CgroupError> {
        let deadline = Instant::now() + within;
        for top in &self.dirs {
            // Almost always empty by now and without children: one rmdir, no walk of the subtree
            // (this runs on every delete).
            match fs::remove_dir(top) {
                Ok(()) => continue,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(_) => {}
            }
            for dir in subtree_deepest_first(top) {
                loop {
                    match fs::remove_dir(&dir) {
                        Ok(()) => break,
                        Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                        Err(e) if Instant::now() < deadline => {
                            tracing::trace!(dir = %dir.display(), error = %e, "cgroup busy, retrying");
                            for pid in procs_in(&dir) {
                                // SAFETY: kill(2) with a pid read from the sandbox's own cgroup.
                                unsafe { libc::kill(pid, libc::SIGKILL) };
                            }
                            std::thread::sleep(Duration::from_millis(5));
                        }
                        Err(e) => {
                            return Err(CgroupError::Io {
                                path: dir,
                                source: e,
                            })
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// The processes in one cgroup directory (not its children), never pid 0 or 1.
fn procs_in(dir: &Path) -> Vec<i32> {
    fs::read_to_string(dir.join("cgroup.procs"))
        .map(|s| {
            s.lines()
                .filter_map(|l| l.trim().parse().ok())
                .filter(|p: &i32| *p > 1)
                .collect()
        })
        .unwrap_or_default()
}

/// `top` and the cgroups nested in it, children before their parents. Only directories count: the
/// control files in a cgroup directory go with it.
fn subtree_deepest_first(top: &Path) -> Vec<PathBuf> {
    let mut order = Vec::new();
    let mut stack = vec![top.to_path_buf()];
    while let Some(dir) = stack.pop() {
        if let Ok(entries) = fs::read_dir(&dir) {
            stack.extend(
                entries
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
        order.push(dir);
    }
    // Pre-order reversed: every directory comes after all of its descendants.
    order.reverse();
    order
}

/// Removes `<hierarchy>/<parent>/<id>` in every hierarchy under `root`, not only the ones Warren uses:
/// OCI runtimes (runsc on cgroup v1) create the sandbox's cgroup in all of them.
pub fn remove_everywhere(root: &Path, parent: &str, id: &str) {
    let Ok(entries) = fs::read_dir(root) else {
        return;
    };
    let mut dirs = vec![root.join(parent).join(id)];
    dirs.extend(entries.flatten().map(|e| e.path().join(parent).join(id)));
    for dir in dirs {
        for _ in 0..100 {
            match fs::remove_dir(&dir) {
                Err(e) if e.kind() != io::ErrorKind::NotFound && dir.exists() => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                _ => break,
            }
        }
    }
}

/// On v2 a child cgroup only gets controllers its parent delegates: turn them on down the path.
fn enable_v2_controllers(root: &Path, parent: &Path) -> Result<(), CgroupError> {
    fs::create_dir_all(parent).map_err(io_err(parent))?;
    let mut dir = root.to_path_buf();
    let rel = parent.strip_prefix(root).unwrap_or(Path::new(""));
    let mut chain = vec![dir.clone()];
    for comp in rel.components() {
        dir.push(comp);
        chain.push(dir.clone());
    }
    for d in chain {
        let available = fs::read_to_string(d.join("cgroup.controllers")).unwrap_or_default();
        let want: Vec<String> = ["cpu", "memory", "pids"]
            .iter()
            .filter(|c| available.split_whitespace().any(|a| a == **c))
            .map(|c| format!("+{c}"))
            .collect();
        if want.is_empty() {
            continue;
        }
        let subtree = d.join("cgroup.subtree_control");
        let delegate = || fs::write(&subtree, want.join(" "));
        match delegate() {
            // A cgroup with processes of its own cannot delegate controllers (v2's "no internal
            // processes" rule). Only the real root is exempt, so this is a cgroup namespace's root:
            // Warren in a container, beside its own processes. They move to a leaf, as
            // docker-in-docker's entrypoint moves them, and the root can delegate.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && d == root => {
                let moved = move_processes_to_leaf(root, |procs, pid| fs::write(procs, pid))?;
                tracing::info!(
                    cgroup = %root.display(),
                    moved,
                    "moved the processes of the cgroup namespace's root into its `init` child, so that it can delegate controllers to sandboxes"
                );
                delegate().map_err(io_err(&subtree))?;
            }
            other => other.map_err(io_err(&subtree))?,
        }
    }
    Ok(())
}

/// The leaf that [`move_processes_to_leaf`] moves a cgroup's own processes into.
const LEAF: &str = "init";

/// Moves every process listed in `dir/cgroup.procs` into `dir/init` (made if missing), with
/// `join(procs file, pid)` (the real one writes the pid there); returns how many moved. Processes
/// that exit meanwhile are skipped, and a few rounds catch what forked during one.
fn move_processes_to_leaf(
    dir: &Path,
    join: impl Fn(&Path, &str) -> io::Result<()>,
) -> Result<usize, CgroupError> {
    let leaf = dir.join(LEAF);
    fs::create_dir_all(&leaf).map_err(io_err(&leaf))?;
    let procs = dir.join("cgroup.procs");
    let into = leaf.join("cgroup.procs");
    let mut moved = 0;
    for _ in 0..5 {
        let listed = fs::read_to_string(&procs).map_err(io_err(&procs))?;
        let pids: Vec<&str> = listed.split_whitespace().collect();
        if pids.is_empty() {
            break;
        }
        for pid in pids {
            match join(&into, pid) {
                Ok(()) => moved += 1,
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => return Err(io_err(&into)(e)),
            }
        }
    }
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_roots_own_processes_move_to_a_leaf() {
        let t = tempfile::tempdir().expect("tempdir");
        // What a container's cgroup namespace root lists: its own processes.
        fs::write(t.path().join("cgroup.procs"), "1\n42\n77\n").expect("procs");
        let joined = std::sync::Mutex::new(Vec::new());
        let moved = move_processes_to_leaf(t.path(), |procs, pid| {
            assert_eq!(procs, t.path().join("init/cgroup.procs"));
            joined.lock().expect("lock").push(pid.to_string());
            // the kernel takes each pid out of the root's list; one exited meanwhile
            let left: Vec<String> = fs::read_to_string(t.path().join("cgroup.procs"))?
                .split_whitespace()
                .filter(|p| *p != pid)
                .map(str::to_string)
                .collect();
            fs::write(t.path().join("cgroup.procs"), left.join("\n"))?;
            if pid == "42" {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        })
        .expect("move");
        assert_eq!(moved, 2);
        assert_eq!(*joined.lock().expect("lock"), ["1", "42", "77"]);
        assert!(t.path().join("init").is_dir());
        // a failure other than an exited process is the caller's
        fs::write(t.path().join("cgroup.procs"), "5\n").expect("procs");
        let e = move_processes_to_leaf(t.path(), |_, _| {
            Err(io::Error::from_raw_os_error(libc::EACCES))
        })
        .expect_err("EACCES");
        assert!(matches!(e, CgroupError::Io { .. }), "{e}");
    }

    #[test]
    fn preparing_makes_the_parent_in_every_hierarchy() {
        let t = tempfile::tempdir().expect("tempdir");
        for c in ["memory", "pids", "cpu"] {
            fs::create_dir_all(t.path().join(c)).expect("mkdir");
            fs::write(t.path().join(c).join("cgroup.procs"), "").expect("write");
        }
        let layout = Layout::detect(t.path()).expect("layout");
        layout.prepare("warren").expect("prepare");
        for c in ["memory", "pids", "cpu"] {
            assert!(t.path().join(c).join("warren").is_dir(), "{c}");
        }
    }

    #[test]
    fn detects_v1_and_ignores_empty_unified() {
        let t = tempfile::tempdir().expect("tempdir");
        fs::create_dir_all(t.path().join("unified")).expect("mkdir");
        fs::write(t.path().join("unified/cgroup.controllers"), "").expect("write");
        for c in ["memory", "pids", "cpu", "freezer"] {
            fs::create_dir_all(t.path().join(c)).expect("mkdir");
            fs::write(t.path().join(c).join("cgroup.procs"), "").expect("write");
        }
        let layout = Layout::detect(t.path()).expect("layout");
        let Layout::V1 { hierarchies } = &layout else {
            panic!("expected v1, got {layout:?}")
        };
        assert_eq!(hierarchies.len(), 4);
        let cg = Cgroup::at(&layout, "warren", "abc");
        assert_eq!(cg.dirs().len(), 4);
        // v1: the helper moves itself (one thread) through `tasks`, not the thread group.
        assert!(cg
            .join_files()
            .iter()
            .all(|p| p.ends_with("warren/abc/tasks")));
        assert_eq!(cg.clone_into_dir(), None);
        fs::create_dir_all(t.path().join("cpu/warren/abc")).expect("mkdir");
        cg.set_cpu_share(CpuShare::Background).expect("share");
        assert_eq!(
            fs::read_to_string(t.path().join("cpu/warren/abc/cpu.shares")).expect("shares"),
            "2"
        );
        // Gone already (an OCI runtime removed it): nothing to do.
        Cgroup::at(&layout, "warren", "gone")
            .set_cpu_share(CpuShare::Normal)
            .expect("a missing cgroup is fine");
    }

    #[test]
    fn detects_v2_and_writes_limits() {
        let t = tempfile::tempdir().expect("tempdir");
        fs::write(
            t.path().join("cgroup.controllers"),
            "cpuset cpu io memory pids",
        )
        .expect("write");
        let layout = Layout::detect(t.path()).expect("layout");
        assert!(matches!(layout, Layout::V2 { .. }));
        let limits = ResourceLimits {
            cpu_millis: Some(500),
            memory_bytes: Some(256 << 20),
            pids: 512,
            disk_bytes: None,
        };
        let cg = Cgroup::create(&layout, "warren", "abc", &limits).expect("create");
        let dir = t.path().join("warren/abc");
        assert_eq!(
            fs::read_to_string(dir.join("cpu.max")).expect("cpu.max"),
            "50000 100000"
        );
        assert_eq!(
            fs::read_to_string(dir.join("memory.max")).expect("memory.max"),
            (256u64 << 20).to_string()
        );
        assert_eq!(
            fs::read_to_string(dir.join("pids.max")).expect("pids.max"),
            "512"
        );
        assert_eq!(
            fs::read_to_string(t.path().join("cgroup.subtree_control")).expect("subtree"),
            "+cpu +memory +pids"
        );
        // What the kernel reports once every process stopped (`set_frozen` waits for it).
        fs::write(dir.join("cgroup.events"), "populated 1\nfrozen 1\n").expect("events");
        cg.set_frozen(true).expect("freeze");
        assert!(cg.is_frozen());
        cg.set_cpu_share(CpuShare::Background).expect("share");
        assert_eq!(
            fs::read_to_string(dir.join("cpu.weight")).expect("weight"),
            "1"
        );
        cg.set_cpu_share(CpuShare::Normal).expect("share");
        assert_eq!(
            fs::read_to_string(dir.join("cpu.weight")).expect("weight"),
            "100"
        );
        // v2 has no per-thread move outside threaded subtrees: a helper is cloned into the cgroup,
        // or (where the kernel cannot) joins by cgroup.procs.
        assert_eq!(cg.join_files(), vec![dir.join("cgroup.procs")]);
        assert_eq!(cg.clone_into_dir(), Some(dir.as_path()));
    }
}
