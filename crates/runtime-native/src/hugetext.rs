//! The zygote's own code and read-only data, moved onto transparent huge pages.
//!
//! Every sandbox's PID 1 is a fork of the zygote. A fork copies no page-table entries for file-backed
//! memory, so each PID 1 used to fault in the ~2,000 pages of `warren`'s 19 MB of machine code and
//! 6 MB of read-only data that it touches, one fault-around batch at a time, and tear them all down
//! again at exit — about 5 % of the machine's CPU when creating sandboxes back to back. Anonymous
//! memory is different: a fork copies its page-table entries, and a transparent huge page is one entry
//! for 2 MiB. So the zygote copies the 2 MiB-aligned interior of each read-only mapping of its binary
//! into anonymous huge pages and `mremap`s the copy over the original, in place. Addresses do not
//! change (backtraces, unwinding and function pointers stay right); the bytes are the same, so the
//! code doing the swap keeps running across it. Each fork then inherits the whole image through a
//! dozen PMD entries, already present.
//!
//! This kernel cannot put file-backed text on huge pages itself (`CONFIG_READ_ONLY_THP_FOR_FS` is
//! off in many distribution kernels), hence the copy. It costs the zygote ~24 MiB of memory once,
//! shared by every sandbox. Where huge pages are not granted (THP `never`, fragmented memory) the copy
//! is dropped and the file mapping kept: a copy on small pages would make every fork copy thousands
//! of entries, worse than faulting them. Profilers see the moved range as anonymous memory; set
//! `WARREN_HUGE_TEXT=0` to keep the file mapping when symbols matter.

use std::io;

const HUGE: usize = 2 << 20;

/// Environment variable of the server that turns the move off when `0`.
const ENV: &str = warren_env::EnvVars::WARREN_HUGE_TEXT;

/// The zygote's argument that turns the move off. (An argument, not the variable itself: the
/// zygote's environment stays empty, so that no server setting reaches a sandbox's PID 1.)
pub const OFF_FLAG: &str = "--file-backed-text";

/// Whether the server's environment asks to keep the file mapping.
pub fn turned_off() -> bool {
    warren_env::var_os(ENV).is_some_and(|v| v == "0")
}

/// Moves the binary's read-only mappings onto huge pages; the number of bytes moved.
pub fn remap_self() -> io::Result<usize> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    let exe = std::fs::read_link("/proc/self/exe")?;
    let exe = exe.to_string_lossy();
    let mut moved = 0;
    for m in read_only_mappings(&maps, &exe) {
        let (start, end) = (align_up(m.start), align_down(m.end));
        if end > start {
            // SAFETY: [start, end) lies within a read-only mapping of our own binary, as the kernel
            // listed it; `remap` replaces it with a byte-identical copy.
            moved += unsafe { remap(start, end - start, m.executable)? };
        }
    }
    Ok(moved)
}

/// A mapping to move: where it is and whether it holds code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Candidate {
    start: usize,
    end: usize,
    executable: bool,
}

/// The non-writable mappings of the file `exe` in a `/proc/self/maps` text.
fn read_only_mappings(maps: &str, exe: &str) -> Vec<Candidate> {
    maps.lines()
        .filter_map(|line| {
            // "start-end perms offset device inode   path"; the path may hold spaces.
            let (range, rest) = split_field(line);
            let (perms, mut rest) = split_field(rest);
            for _ in 0..3 {
                rest = split_field(rest).1;
            }
            let perms = perms.as_bytes();
            if rest.trim() != exe || perms.get(1) != Some(&b'-') {
                return None;
            }
            let (start, end) = range.split_once('-')?;
            Some(Candidate {
                start: usize::from_str_radix(start, 16).ok()?,
                end: usize::from_str_radix(end, 16).ok()?,
                executable: perms.get(2) == Some(&b'x'),
            })
        })
        .collect()
}

/// The first whitespace-separated field of `s`, and what follows it.
fn split_field(s: &str) -> (&str, &str) {
    let s = s.trim_start();
    s.split_at(s.find(|c: char| c.is_ascii_whitespace()).unwrap_or(s.len()))
}

fn align_up(addr: usize) -> usize {
    (addr + HUGE - 1) & !(HUGE - 1)
}

fn align_down(addr: usize) -> usize {
    addr & !(HUGE - 1)
}

/// Copies `[start, start + len)` into anonymous huge pages and moves the copy over it.
///
/// # Safety
/// The range must be mapped read-only and nothing may write to it meanwhile (no other thread may be
/// unmapping or remapping it).
unsafe fn remap(start: usize, len: usize, executable: bool) -> io::Result<usize> {
    // An aligned scratch range: over-allocate by one huge page and trim both ends.
    // SAFETY: a fresh private anonymous mapping.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len + HUGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let raw = raw as usize;
    let copy = align_up(raw);
    // SAFETY: both slack pieces lie inside the mapping just made, outside [copy, copy + len).
    unsafe {
        if copy > raw {
            libc::munmap(raw as *mut _, copy - raw);
        }
        let tail = raw + len + HUGE - (copy + len);
        if tail > 0 {
            libc::munmap((copy + len) as *mut _, tail);
        }
    }
    let discard = |err: io::Error| {
        // SAFETY: the scratch range is ours and nothing points into it.
        unsafe { libc::munmap(copy as *mut _, len) };
        Err(err)
    };
    // SAFETY: advice and a copy within our own fresh mapping; the source is readable.
    unsafe {
        if libc::madvise(copy as *mut _, len, libc::MADV_HUGEPAGE) != 0 {
            return discard(io::Error::last_os_error());
        }
        std::ptr::copy_nonoverlapping(start as *const u8, copy as *mut u8, len);
    }
    if !all_huge(copy, len)? {
        return discard(io::Error::other(
            "the kernel did not back the copy with huge pages",
        ));
    }
    let prot = if executable {
        libc::PROT_READ | libc::PROT_EXEC
    } else {
        libc::PROT_READ
    };
    // SAFETY: our scratch mapping; then the move onto the original range, which holds the same bytes.
    unsafe {
        if libc::mprotect(copy as *mut _, len, prot) != 0 {
            return discard(io::Error::last_os_error());
        }
        let moved = libc::mremap(
            copy as *mut _,
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            start as *mut libc::c_void,
        );
        if moved == libc::MAP_FAILED {
            return discard(io::Error::last_os_error());
        }
    }
    Ok(len)
}

/// Whether `[addr, addr + len)` is wholly backed by huge pages, from `/proc/self/smaps`.
fn all_huge(addr: usize, len: usize) -> io::Result<bool> {
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    Ok(anon_huge_bytes(&smaps, addr) == Some(len))
}

/// The `AnonHugePages` of the smaps entry starting at `addr`, in bytes.
fn anon_huge_bytes(smaps: &str, addr: usize) -> Option<usize> {
    let header = format!("{addr:x}-");
    let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&header));
    lines.next()?;
    lines
        // Field lines ("AnonHugePages:   2048 kB") start with a capital; the next entry's header
        // with a lowercase hex address.
        .take_while(|l| l.starts_with(|c: char| c.is_ascii_uppercase()))
        .find_map(|l| l.strip_prefix("AnonHugePages:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|kb| kb.trim().parse::<usize>().ok())
        .map(|kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0a0000000-55d0a0640000 r--p 00000000 fd:01 1234                       /opt/my tools/warren
55d0a0641000-55d0a1971000 r-xp 00640000 fd:01 1234                       /opt/my tools/warren
55d0a1972000-55d0a1a07000 r--p 01970000 fd:01 1234                       /opt/my tools/warren
55d0a1a07000-55d0a1a0e000 rw-p 01a04000 fd:01 1234                       /opt/my tools/warren
55d0a2000000-55d0a2100000 r-xp 00000000 fd:01 99                         /usr/lib/other
7ffd1000-7ffd2000 rw-p 00000000 00:00 0                                  [stack]
";

    #[test]
    fn only_the_binary_s_read_only_mappings_are_candidates() {
        let found = read_only_mappings(MAPS, "/opt/my tools/warren");
        assert_eq!(
            found,
            vec![
                Candidate {
                    start: 0x55d0a0000000,
                    end: 0x55d0a0640000,
                    executable: false
                },
                Candidate {
                    start: 0x55d0a0641000,
                    end: 0x55d0a1971000,
                    executable: true
                },
                Candidate {
                    start: 0x55d0a1972000,
                    end: 0x55d0a1a07000,
                    executable: false
                },
            ]
        );
        assert!(read_only_mappings(MAPS, "/opt/my").is_empty());
    }

    #[test]
    fn the_moved_range_is_the_huge_page_aligned_interior() {
        assert_eq!(align_up(0x55d0a0641000), 0x55d0a0800000);
        assert_eq!(align_down(0x55d0a1971000), 0x55d0a1800000);
        assert_eq!(align_up(0x200000), 0x200000);
        assert_eq!(align_down(0x200000), 0x200000);
    }

    #[test]
    fn anon_huge_pages_are_read_from_the_entry_asked_for() {
        let smaps = "\
7f0000000000-7f0000400000 r-xp 00000000 00:00 0
Size:               4096 kB
AnonHugePages:      4096 kB
VmFlags: rd ex mr mw me ac hg
7f0000400000-7f0000600000 rw-p 00000000 00:00 0
Size:               2048 kB
AnonHugePages:         0 kB
";
        assert_eq!(anon_huge_bytes(smaps, 0x7f0000000000), Some(4 << 20));
        assert_eq!(anon_huge_bytes(smaps, 0x7f0000400000), Some(0));
        assert_eq!(anon_huge_bytes(smaps, 0x7f0000200000), None);
    }
}
