//! Seccomp filters as classic-BPF programs built here: the sandbox's own (the native runtime's
//! `security` and `warren_core::policy` say what it allows and why), and the deny lists execd lays
//! under user code when hardening is on (see [`deny`]).
//!
//! Why by hand rather than from a filter compiler: every sandbox installs the filter, and what an
//! install costs grows with the program. The kernel converts and JITs the program, then runs it once
//! for every syscall number to find the ones it may answer from a bitmap without running the filter
//! again (the action cache). A compiler that tests each listed number in turn makes that ~450 walks
//! of a chain of ~300 comparisons. Here the verdicts are laid over the number line as runs (the
//! allowed calls cluster: ~300 numbers make a few dozen runs) and one program searches the run
//! boundaries as a binary tree: ~8 instructions a walk, a couple of hundred in all.
//!
//! Layout: arch check (anything but x86-64 is killed, as a filter compiler does), x32 numbers
//! refused (ENOSYS, what a kernel without x32 answers; a list keyed on 64-bit numbers would not
//! see them), then the tree; leaves return the run's verdict. Only `clone`, `personality` and
//! `socket` look at an argument, so every other syscall stays answerable from the cache.

use std::collections::{BTreeMap, BTreeSet};
use std::str::FromStr;

/// What a syscall gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    Errno(u16),
    /// Allowed unless the first argument has any of these flags (`clone` and namespace flags);
    /// EPERM then.
    AllowUnlessFlags(u32),
    /// Allowed when the first argument is one of these (`personality`); EPERM otherwise.
    AllowIfArgIn(&'static [u32]),
    /// Allowed unless the first argument is this (`socket` and one address family); EPERM then.
    AllowUnlessArg(u32),
}

// Classic BPF opcodes (linux/bpf_common.h): BPF_LD (0) | BPF_W (0) | BPF_ABS; BPF_JMP | op | BPF_K
// (0); BPF_RET | BPF_K.
const LD_W_ABS: u16 = 0x20;
/// BPF_JMP | BPF_JA: an unconditional jump, with a 32-bit offset (conditional ones have 8 bits).
const JA: u16 = 0x05;
const JEQ_K: u16 = 0x05 | 0x10;
const JGE_K: u16 = 0x05 | 0x30;
const JSET_K: u16 = 0x05 | 0x40;
const RET_K: u16 = 0x06;

// Offsets in `struct seccomp_data`: nr (u32), arch (u32), instruction_pointer (u64), args[6] (u64).
const NR: u32 = 0;
const ARCH: u32 = 4;
/// Low 32 bits of args[0] (little-endian): `clone`'s namespace flags, and all the kernel reads of
/// `personality`'s and `socket`'s (unsigned) int.
const ARG0_LOW: u32 = 16;

/// `AUDIT_ARCH_X86_64`: EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE.
const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;
/// `__X32_SYSCALL_BIT`: x32 ABI syscall numbers have it set.
const X32_BIT: u32 = 0x4000_0000;

#[derive(Debug, Clone, Copy)]
enum Target {
    Next,
    Label(usize),
}

#[derive(Debug, Clone, Copy)]
struct Insn {
    code: u16,
    k: u32,
    jt: Target,
    jf: Target,
}

impl Insn {
    fn stmt(code: u16, k: u32) -> Self {
        Self {
            code,
            k,
            jt: Target::Next,
            jf: Target::Next,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FilterError {
    #[error("seccomp filter: a jump spans {0} instructions, more than classic BPF's 255")]
    JumpTooFar(usize),
    #[error("seccomp filter: {0} instructions, more than the kernel's 4096")]
    TooLong(usize),
    #[error("installing the seccomp filter: {0}")]
    Install(std::io::Error),
}

/// A compiled filter, ready for [`install`].
#[derive(Debug, Clone)]
pub struct Program(Vec<libc::sock_filter>);

impl Program {
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// What the program answers for `nr` on `arch` with `clone`-style flags `arg0` — the kernel's
    /// evaluation, for tests.
    #[cfg(test)]
    fn run(&self, nr: u32, arch: u32, arg0: u64) -> u32 {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&nr.to_le_bytes());
        data[4..8].copy_from_slice(&arch.to_le_bytes());
        data[16..24].copy_from_slice(&arg0.to_le_bytes());
        let (mut pc, mut acc) = (0usize, 0u32);
        loop {
            let i = self.0[pc];
            pc += 1;
            match i.code {
                LD_W_ABS => {
                    let at = i.k as usize;
                    acc = u32::from_le_bytes(data[at..at + 4].try_into().expect("4 bytes"));
                }
                JEQ_K | JGE_K | JSET_K => {
                    let hit = match i.code {
                        JEQ_K => acc == i.k,
                        JGE_K => acc >= i.k,
                        _ => acc & i.k != 0,
                    };
                    pc += usize::from(if hit { i.jt } else { i.jf });
                }
                JA => pc += i.k as usize,
                RET_K => return i.k,
                other => panic!("unexpected opcode {other:#x}"),
            }
        }
    }
}

/// Builds the filter: numbers in `verdicts` get theirs, other numbers up to the highest listed get
/// `otherwise`, and numbers above it ENOSYS (calls newer than the list: a libc trying one falls
/// back to an older call, as it does on an older kernel).
pub fn build(
    verdicts: &BTreeMap<u32, Verdict>,
    otherwise: Verdict,
) -> Result<Program, FilterError> {
    assemble(verdicts, otherwise, Verdict::Errno(libc::ENOSYS as u16))
}

/// A filter that refuses the calls numbered in `denied` with `errno` and allows every other one,
/// newer calls included. It is meant to sit under a filter that already decides the rest (the
/// sandbox's own): a process's filters all run, and the strictest answer wins.
pub fn deny(denied: &BTreeSet<u32>, errno: u16) -> Result<Program, FilterError> {
    let verdicts = denied
        .iter()
        .map(|nr| (*nr, Verdict::Errno(errno)))
        .collect();
    assemble(&verdicts, Verdict::Allow, Verdict::Allow)
}

/// The x86-64 number of the syscall called `name` (as in `syscall_64.tbl`), if there is one.
pub fn number(name: &str) -> Option<u32> {
    syscalls::Sysno::from_str(name)
        .ok()
        .and_then(|s| u32::try_from(s.id()).ok())
}

/// `verdicts` over the number line: listed numbers get theirs, unlisted ones up to the highest
/// listed get `otherwise`, and higher ones `beyond`.
fn assemble(
    verdicts: &BTreeMap<u32, Verdict>,
    otherwise: Verdict,
    beyond: Verdict,
) -> Result<Program, FilterError> {
    let top = verdicts.keys().next_back().copied().unwrap_or(0);
    // Runs of equal verdicts over 0..=top, then `beyond` from top + 1 on.
    let mut runs: Vec<(u32, Verdict)> = Vec::new();
    for nr in 0..=top {
        let v = verdicts.get(&nr).copied().unwrap_or(otherwise);
        if runs.last().is_none_or(|(_, last)| *last != v) {
            runs.push((nr, v));
        }
    }
    if runs.last().is_none_or(|(_, last)| *last != beyond) {
        runs.push((top + 1, beyond));
    }

    let mut b = Builder::default();
    let (x86_64, native) = (b.label(), b.label());
    b.push(Insn::stmt(LD_W_ABS, ARCH));
    b.jump(
        JEQ_K,
        AUDIT_ARCH_X86_64,
        Target::Label(x86_64),
        Target::Next,
    );
    b.push(Insn::stmt(RET_K, libc::SECCOMP_RET_KILL_PROCESS));
    b.place(x86_64);
    b.push(Insn::stmt(LD_W_ABS, NR));
    b.jump(JGE_K, X32_BIT, Target::Next, Target::Label(native));
    b.push(Insn::stmt(RET_K, errno(libc::ENOSYS as u16)));
    b.place(native);
    b.tree(&runs);
    b.finish()
}

/// Installs `program` on the calling thread; `no_new_privs` must be set already.
pub fn install(program: &Program) -> Result<(), FilterError> {
    let prog = libc::sock_fprog {
        len: program.0.len() as u16,
        filter: program.0.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: seccomp(SECCOMP_SET_MODE_FILTER) reads `prog`, which points at the program's
    // instructions for the length given; both outlive the call, and the kernel copies them.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            0,
            &prog as *const libc::sock_fprog,
        )
    };
    if rc != 0 {
        return Err(FilterError::Install(std::io::Error::last_os_error()));
    }
    Ok(())
}

fn errno(e: u16) -> u32 {
    libc::SECCOMP_RET_ERRNO | u32::from(e)
}

#[derive(Default)]
struct Builder {
    code: Vec<Insn>,
    /// Instruction index of each label once placed.
    at: Vec<Option<usize>>,
}

impl Builder {
    fn label(&mut self) -> usize {
        self.at.push(None);
        self.at.len() - 1
    }

    fn place(&mut self, label: usize) {
        self.at[label] = Some(self.code.len());
    }

    fn push(&mut self, insn: Insn) {
        self.code.push(insn);
    }

    fn jump(&mut self, code: u16, k: u32, jt: Target, jf: Target) {
        self.code.push(Insn { code, k, jt, jf });
    }

    /// A search over `runs` (sorted by first number, the first at 0): `jge` splits on a run's
    /// first number until one run is left, whose verdict the leaf returns. The way to the upper
    /// half is an unconditional jump, whose offset has 32 bits: a lower half longer than a
    /// conditional jump's 255 instructions is then no limit.
    fn tree(&mut self, runs: &[(u32, Verdict)]) {
        if let [(_, verdict)] = runs {
            self.verdict(*verdict);
            return;
        }
        let (low, high) = runs.split_at(runs.len() / 2);
        let (left, right) = (self.label(), self.label());
        self.jump(JGE_K, high[0].0, Target::Next, Target::Label(left));
        self.jump(JA, 0, Target::Label(right), Target::Next);
        self.place(left);
        self.tree(low);
        self.place(right);
        self.tree(high);
    }

    fn verdict(&mut self, verdict: Verdict) {
        let (allow, eperm) = (
            Insn::stmt(RET_K, libc::SECCOMP_RET_ALLOW),
            Insn::stmt(RET_K, errno(libc::EPERM as u16)),
        );
        match verdict {
            Verdict::Allow => self.push(allow),
            Verdict::Errno(e) => self.push(Insn::stmt(RET_K, errno(e))),
            Verdict::AllowUnlessFlags(flags) => self.deny_if(JSET_K, flags),
            Verdict::AllowIfArgIn(values) => {
                let ok = self.label();
                self.push(Insn::stmt(LD_W_ABS, ARG0_LOW));
                for v in values {
                    self.jump(JEQ_K, *v, Target::Label(ok), Target::Next);
                }
                self.push(eperm);
                self.place(ok);
                self.push(allow);
            }
            Verdict::AllowUnlessArg(value) => self.deny_if(JEQ_K, value),
        }
    }

    /// EPERM when the first argument passes the test `op` against `k` (`jset`: has any of these
    /// bits; `jeq`: is this), allowed otherwise.
    fn deny_if(&mut self, op: u16, k: u32) {
        let deny = self.label();
        self.push(Insn::stmt(LD_W_ABS, ARG0_LOW));
        self.jump(op, k, Target::Label(deny), Target::Next);
        self.push(Insn::stmt(RET_K, libc::SECCOMP_RET_ALLOW));
        self.place(deny);
        self.push(Insn::stmt(RET_K, errno(libc::EPERM as u16)));
    }

    fn finish(self) -> Result<Program, FilterError> {
        if self.code.len() > 4096 {
            return Err(FilterError::TooLong(self.code.len()));
        }
        let offset = |from: usize, target: Target| -> Result<u8, FilterError> {
            match target {
                Target::Next => Ok(0),
                Target::Label(l) => {
                    let to = self.at[l].expect("every label is placed");
                    let span = to - from - 1;
                    u8::try_from(span).map_err(|_| FilterError::JumpTooFar(span))
                }
            }
        };
        let mut out = Vec::with_capacity(self.code.len());
        for (i, insn) in self.code.iter().enumerate() {
            out.push(if insn.code == JA {
                // The target rides in `jt` while building; the offset goes in `k`.
                let Target::Label(l) = insn.jt else {
                    unreachable!("an unconditional jump has a target")
                };
                let to = self.at[l].expect("every label is placed");
                libc::sock_filter {
                    code: JA,
                    jt: 0,
                    jf: 0,
                    k: (to - i - 1) as u32,
                }
            } else {
                libc::sock_filter {
                    code: insn.code,
                    jt: offset(i, insn.jt)?,
                    jf: offset(i, insn.jf)?,
                    k: insn.k,
                }
            });
        }
        Ok(Program(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALLOW: u32 = libc::SECCOMP_RET_ALLOW;
    const EPERM: u32 = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
    const ENOSYS: u32 = libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
    const PERSONAS: &[u32] = &[0, 8, 0xffff_ffff];

    fn sample() -> BTreeMap<u32, Verdict> {
        let mut v: BTreeMap<u32, Verdict> =
            [0u32, 1, 2, 3, 5, 9, 10, 11, 40, 41, 200, 300, 301, 433]
                .into_iter()
                .map(|nr| (nr, Verdict::Allow))
                .collect();
        v.insert(56, Verdict::AllowUnlessFlags(0x7E02_0000));
        v.insert(135, Verdict::AllowIfArgIn(PERSONAS));
        v.insert(41, Verdict::AllowUnlessArg(40));
        v.insert(435, Verdict::Errno(libc::ENOSYS as u16));
        v.insert(7, Verdict::Errno(libc::EACCES as u16));
        v
    }

    #[test]
    fn every_number_gets_its_verdict() {
        let verdicts = sample();
        let prog = build(&verdicts, Verdict::Errno(libc::EPERM as u16)).expect("build");
        for nr in 0..600u32 {
            let want = match verdicts.get(&nr) {
                Some(Verdict::Allow) => ALLOW,
                Some(Verdict::Errno(e)) => errno(*e),
                Some(_) => continue, // argument rules: below
                None if nr <= 435 => EPERM,
                None => ENOSYS,
            };
            assert_eq!(prog.run(nr, AUDIT_ARCH_X86_64, 0), want, "syscall {nr}");
        }
    }

    #[test]
    fn argument_rules() {
        let prog = build(&sample(), Verdict::Errno(libc::EPERM as u16)).expect("build");
        let newuser = libc::CLONE_NEWUSER as u64;
        let newnet = libc::CLONE_NEWNET as u64;
        assert_eq!(prog.run(56, AUDIT_ARCH_X86_64, newuser | 0x11), EPERM);
        assert_eq!(prog.run(56, AUDIT_ARCH_X86_64, newnet | 0x11), EPERM);
        assert_eq!(prog.run(56, AUDIT_ARCH_X86_64, libc::SIGCHLD as u64), ALLOW);
        // Flags in the upper half of the word are not namespace flags.
        assert_eq!(prog.run(56, AUDIT_ARCH_X86_64, 1 << 40), ALLOW);
        for p in PERSONAS {
            assert_eq!(
                prog.run(135, AUDIT_ARCH_X86_64, u64::from(*p)),
                ALLOW,
                "{p:#x}"
            );
        }
        // ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC
        assert_eq!(prog.run(135, AUDIT_ARCH_X86_64, 0x0004_0000), EPERM);
        assert_eq!(prog.run(135, AUDIT_ARCH_X86_64, 0x0040_0000), EPERM);
        assert_eq!(prog.run(41, AUDIT_ARCH_X86_64, 40), EPERM);
        assert_eq!(prog.run(41, AUDIT_ARCH_X86_64, 2), ALLOW);
    }

    #[test]
    fn other_architectures_die_and_x32_numbers_are_refused() {
        let prog = build(&sample(), Verdict::Errno(libc::EPERM as u16)).expect("build");
        const AUDIT_ARCH_I386: u32 = 3 | 0x4000_0000;
        assert_eq!(
            prog.run(0, AUDIT_ARCH_I386, 0),
            libc::SECCOMP_RET_KILL_PROCESS
        );
        // 165 is mount, 0 read: x32 numbers must not reach a tree keyed on 64-bit numbers.
        assert_eq!(prog.run(X32_BIT | 165, AUDIT_ARCH_X86_64, 0), ENOSYS);
        assert_eq!(prog.run(X32_BIT, AUDIT_ARCH_X86_64, 0), ENOSYS);
    }

    #[test]
    fn an_empty_list_refuses_everything_but_read() {
        let prog = build(&BTreeMap::new(), Verdict::Errno(libc::EPERM as u16)).expect("build");
        assert_eq!(prog.run(0, AUDIT_ARCH_X86_64, 0), EPERM);
        assert_eq!(prog.run(165, AUDIT_ARCH_X86_64, 0), ENOSYS);
    }

    #[test]
    fn a_deny_list_refuses_its_calls_and_allows_every_other() {
        let denied: BTreeSet<u32> = [90, 268, 452].into_iter().collect();
        let prog = deny(&denied, libc::EACCES as u16).expect("build");
        let eacces = libc::SECCOMP_RET_ERRNO | libc::EACCES as u32;
        for nr in 0..1000u32 {
            let want = if denied.contains(&nr) { eacces } else { ALLOW };
            assert_eq!(prog.run(nr, AUDIT_ARCH_X86_64, 0), want, "syscall {nr}");
        }
        assert_eq!(prog.run(X32_BIT | 90, AUDIT_ARCH_X86_64, 0), ENOSYS);
        let nothing = deny(&BTreeSet::new(), libc::EACCES as u16).expect("build");
        assert_eq!(nothing.run(0, AUDIT_ARCH_X86_64, 0), ALLOW);
        assert_eq!(nothing.run(451, AUDIT_ARCH_X86_64, 0), ALLOW);
    }

    #[test]
    fn names_are_the_x86_64_table() {
        assert_eq!(number("read"), Some(0));
        assert_eq!(number("chmod"), Some(90));
        assert_eq!(number("fchmodat2"), Some(452));
        assert_eq!(number("execve"), Some(libc::SYS_execve as u32));
        assert_eq!(number("no_such_call"), None);
        assert_eq!(number(""), None);
    }

    #[test]
    fn stays_small_however_the_numbers_fall() {
        // Every other number allowed: the worst case for runs (one per number).
        let many: BTreeMap<u32, Verdict> = (0..240u32).map(|i| (i * 2, Verdict::Allow)).collect();
        let prog = build(&many, Verdict::Errno(libc::EPERM as u16)).expect("jumps fit");
        assert!(prog.len() < 3 * 480 + 16, "{} instructions", prog.len());
        for nr in 0..500u32 {
            let want = match nr {
                n if n > 478 => ENOSYS,
                n if n % 2 == 0 => ALLOW,
                _ => EPERM,
            };
            assert_eq!(prog.run(nr, AUDIT_ARCH_X86_64, 0), want, "syscall {nr}");
        }
    }
}
