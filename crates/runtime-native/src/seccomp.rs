//! The sandbox's seccomp filter, as one classic-BPF program built here (see `security` for what it
//! denies and why).
//!
//! Why by hand rather than from a filter compiler: every sandbox installs the filter, and what an
//! install costs grows with the program. The kernel converts and JITs the program, then runs it once
//! for every syscall number to find the ones it may answer from a bitmap without running the filter
//! again (the action cache). A compiler that tests the denied numbers one after another makes that
//! ~450 walks of a chain comparing each of the ~46 denied numbers in turn, and it was two filters
//! (deny list and `clone3`); here one program (87 instructions) searches the sorted numbers as a
//! binary tree, ~10 instructions per walk.
//!
//! Layout: arch check (anything but x86-64 is killed, as a filter compiler does), x32 numbers
//! refused (ENOSYS, what a kernel without x32 answers; a deny list keyed on 64-bit numbers would
//! not see them), then the tree; leaves return the syscall's action. Only `clone` looks at an
//! argument (its flags), so every other syscall stays answerable from the cache.

use std::collections::BTreeMap;

/// What a listed syscall gets; unlisted ones are allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Errno(u16),
    /// `clone`: EPERM when its flags ask for a new user namespace, allowed otherwise.
    CloneUnlessNewUser,
}

// Classic BPF opcodes (linux/bpf_common.h): BPF_LD (0) | BPF_W (0) | BPF_ABS; BPF_JMP | op | BPF_K
// (0); BPF_RET | BPF_K.
const LD_W_ABS: u16 = 0x20;
const JEQ_K: u16 = 0x05 | 0x10;
const JGE_K: u16 = 0x05 | 0x30;
const JSET_K: u16 = 0x05 | 0x40;
const RET_K: u16 = 0x06;

// Offsets in `struct seccomp_data`: nr (u32), arch (u32), instruction_pointer (u64), args[6] (u64).
const NR: u32 = 0;
const ARCH: u32 = 4;
/// Low 32 bits of args[0] (little-endian): where `clone` keeps its namespace flags.
const ARG0_LOW: u32 = 16;

/// `AUDIT_ARCH_X86_64`: EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE.
const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;
/// `__X32_SYSCALL_BIT`: x32 ABI syscall numbers have it set.
const X32_BIT: u32 = 0x4000_0000;
/// Leaves hold this many numbers tested one by one; above it the tree splits.
const LEAF: usize = 3;

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
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.0.len()
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
                RET_K => return i.k,
                other => panic!("unexpected opcode {other:#x}"),
            }
        }
    }
}

/// Builds the filter: syscalls in `verdicts` get theirs, all others are allowed.
pub fn build(verdicts: &BTreeMap<u32, Verdict>) -> Result<Program, FilterError> {
    let mut b = Builder::default();
    let allow = b.label();
    let kill = b.label();
    let enosys = b.label();
    let mut returns: BTreeMap<u16, usize> = BTreeMap::new();
    let mut clone_check = None;
    let mut entries = Vec::new();
    for (&nr, &verdict) in verdicts {
        let target = match verdict {
            Verdict::Errno(e) if e == libc::ENOSYS as u16 => enosys,
            Verdict::Errno(e) => *returns.entry(e).or_insert_with(|| b.label()),
            Verdict::CloneUnlessNewUser => *clone_check.get_or_insert_with(|| b.label()),
        };
        entries.push((nr, target));
    }
    let eperm = *returns
        .entry(libc::EPERM as u16)
        .or_insert_with(|| b.label());

    b.push(Insn::stmt(LD_W_ABS, ARCH));
    b.jump(JEQ_K, AUDIT_ARCH_X86_64, Target::Next, Target::Label(kill));
    b.push(Insn::stmt(LD_W_ABS, NR));
    b.jump(JGE_K, X32_BIT, Target::Label(enosys), Target::Next);
    b.tree(&entries);

    if let Some(label) = clone_check {
        b.place(label);
        b.push(Insn::stmt(LD_W_ABS, ARG0_LOW));
        b.jump(
            JSET_K,
            libc::CLONE_NEWUSER as u32,
            Target::Label(eperm),
            Target::Label(allow),
        );
    }
    b.place(allow);
    b.push(Insn::stmt(RET_K, libc::SECCOMP_RET_ALLOW));
    b.place(kill);
    b.push(Insn::stmt(RET_K, libc::SECCOMP_RET_KILL_PROCESS));
    b.place(enosys);
    b.push(Insn::stmt(RET_K, errno(libc::ENOSYS as u16)));
    for (e, label) in returns {
        b.place(label);
        b.push(Insn::stmt(RET_K, errno(e)));
    }
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

    /// A search over `entries` (sorted by number): `jge` splits until a leaf is small enough to
    /// test number by number; a leaf that matches nothing allows the call.
    fn tree(&mut self, entries: &[(u32, usize)]) {
        if entries.len() <= LEAF {
            for &(nr, target) in entries {
                self.jump(JEQ_K, nr, Target::Label(target), Target::Next);
            }
            self.push(Insn::stmt(RET_K, libc::SECCOMP_RET_ALLOW));
            return;
        }
        let (low, high) = entries.split_at(entries.len() / 2);
        let right = self.label();
        self.jump(JGE_K, high[0].0, Target::Label(right), Target::Next);
        self.tree(low);
        self.place(right);
        self.tree(high);
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
            out.push(libc::sock_filter {
                code: insn.code,
                jt: offset(i, insn.jt)?,
                jf: offset(i, insn.jf)?,
                k: insn.k,
            });
        }
        Ok(Program(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EPERM: u32 = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
    const ENOSYS: u32 = libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32;

    fn sample() -> BTreeMap<u32, Verdict> {
        let mut v: BTreeMap<u32, Verdict> = [1u32, 5, 9, 10, 11, 40, 41, 200, 300, 301, 302, 433]
            .into_iter()
            .map(|nr| (nr, Verdict::Errno(libc::EPERM as u16)))
            .collect();
        v.insert(56, Verdict::CloneUnlessNewUser);
        v.insert(435, Verdict::Errno(libc::ENOSYS as u16));
        v.insert(7, Verdict::Errno(libc::EACCES as u16));
        v
    }

    #[test]
    fn every_number_gets_its_verdict() {
        let verdicts = sample();
        let prog = build(&verdicts).expect("build");
        for nr in 0..600u32 {
            let want = match verdicts.get(&nr) {
                None | Some(Verdict::CloneUnlessNewUser) => libc::SECCOMP_RET_ALLOW,
                Some(Verdict::Errno(e)) => errno(*e),
            };
            assert_eq!(prog.run(nr, AUDIT_ARCH_X86_64, 0), want, "syscall {nr}");
        }
    }

    #[test]
    fn clone_is_refused_only_for_a_new_user_namespace() {
        let prog = build(&sample()).expect("build");
        let newuser = libc::CLONE_NEWUSER as u64;
        assert_eq!(prog.run(56, AUDIT_ARCH_X86_64, newuser | 0x11), EPERM);
        assert_eq!(
            prog.run(56, AUDIT_ARCH_X86_64, libc::SIGCHLD as u64),
            libc::SECCOMP_RET_ALLOW
        );
        // Flags in the upper half of the word are not namespace flags.
        assert_eq!(
            prog.run(56, AUDIT_ARCH_X86_64, 1 << 40),
            libc::SECCOMP_RET_ALLOW
        );
    }

    #[test]
    fn other_architectures_die_and_x32_numbers_are_refused() {
        let prog = build(&sample()).expect("build");
        const AUDIT_ARCH_I386: u32 = 3 | 0x4000_0000;
        assert_eq!(
            prog.run(0, AUDIT_ARCH_I386, 0),
            libc::SECCOMP_RET_KILL_PROCESS
        );
        // 165 is mount: its x32 number must not slip past a tree keyed on 64-bit numbers.
        assert_eq!(prog.run(X32_BIT | 165, AUDIT_ARCH_X86_64, 0), ENOSYS);
        assert_eq!(prog.run(X32_BIT | 39, AUDIT_ARCH_X86_64, 0), ENOSYS);
    }

    #[test]
    fn an_empty_list_allows_everything() {
        let prog = build(&BTreeMap::new()).expect("build");
        assert_eq!(prog.run(165, AUDIT_ARCH_X86_64, 0), libc::SECCOMP_RET_ALLOW);
    }

    #[test]
    fn stays_small() {
        // ~450 numbers walk this during install: the point of the tree.
        let many: BTreeMap<u32, Verdict> = (0..64u32)
            .map(|i| (i * 7, Verdict::Errno(libc::EPERM as u16)))
            .collect();
        let prog = build(&many).expect("build");
        assert!(prog.len() < 2 * 64 + 16, "{} instructions", prog.len());
    }
}
