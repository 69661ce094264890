//! Screenshots through MIT-SHM: the X server writes the image into a System V shared memory
//! segment execd maps, instead of sending it through the socket (4 MB at 1280x800). The segment
//! lives in the sandbox's own IPC namespace, readable by its owner only, and is removed as soon as
//! both sides have it mapped, so nothing outlives the two processes. Where the server has no
//! MIT-SHM or refuses the segment, screenshots use `GetImage`.

use std::ptr;

use x11rb::connection::{Connection, RequestConnection};
use x11rb::protocol::shm::{self, ConnectionExt as _};
use x11rb::protocol::xproto::{self, ImageFormat};
use x11rb::rust_connection::RustConnection;

/// A segment the size of the screen, mapped read-only here, attached read-write by the server.
pub struct Segment {
    seg: shm::Seg,
    addr: *const u8,
    len: usize,
}

// SAFETY: the mapping belongs to this value alone (made in `attach`, unmapped in `drop`); it is
// only copied out of through a raw pointer, by the one thread that holds the desktop's connection
// lock.
unsafe impl Send for Segment {}

impl Segment {
    /// A segment of `len` bytes the server has attached, or `None` (no MIT-SHM, no shared memory).
    pub fn attach(conn: &RustConnection, len: usize) -> Option<Segment> {
        conn.extension_information(shm::X11_EXTENSION_NAME).ok()??;
        // SAFETY: plain System V calls; every failure is checked, and an id or mapping made
        // before a failure is given back before returning.
        let id = unsafe { libc::shmget(libc::IPC_PRIVATE, len, libc::IPC_CREAT | 0o600) };
        if id < 0 {
            return None;
        }
        // SAFETY: `id` is the segment just made; a failed attach is `(void *) -1`.
        let addr = unsafe { libc::shmat(id, ptr::null(), libc::SHM_RDONLY) };
        let remove = || {
            // SAFETY: marks the segment for removal once no process has it mapped.
            unsafe { libc::shmctl(id, libc::IPC_RMID, ptr::null_mut()) };
        };
        if addr as isize == -1 {
            remove();
            return None;
        }
        let unmap = || {
            // SAFETY: `addr` is the mapping `shmat` gave, not yet unmapped.
            unsafe { libc::shmdt(addr) };
        };
        let attached = conn.generate_id().ok().and_then(|seg| {
            conn.shm_attach(seg, id as u32, false)
                .ok()?
                .check()
                .ok()
                .map(|()| seg)
        });
        // Both sides have it (or the server never will): removed when both let go.
        remove();
        let Some(seg) = attached else {
            unmap();
            return None;
        };
        Some(Segment {
            seg,
            addr: addr.cast(),
            len,
        })
    }

    /// `w`x`h` pixels of `root` at (`x`, `y`) in Z format, 32 bits each, copied out of the
    /// segment; `None` if the server would not (the caller then asks with `GetImage`).
    pub fn get_image(
        &self,
        conn: &RustConnection,
        root: xproto::Window,
        (x, y, w, h): (i16, i16, u16, u16),
    ) -> Option<Vec<u8>> {
        let need = usize::from(w) * usize::from(h) * 4;
        if need > self.len {
            return None;
        }
        let reply = conn
            .shm_get_image(
                root,
                x,
                y,
                w,
                h,
                !0,
                ImageFormat::Z_PIXMAP.into(),
                self.seg,
                0,
            )
            .ok()?
            .reply()
            .ok()?;
        if reply.depth != 24 || reply.size as usize != need {
            return None;
        }
        // Copied at once through the raw pointer, never lent as a slice: other processes of the
        // sandbox (its owner, or an X client) could write the segment while it was borrowed.
        let mut out = vec![0u8; need];
        // SAFETY: the mapping is `len` bytes long and `need` fits in it; `out` is a new buffer of
        // `need` bytes that cannot overlap it; the server wrote the image before it answered.
        unsafe { ptr::copy_nonoverlapping(self.addr, out.as_mut_ptr(), need) };
        Some(out)
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `addr` is this value's own mapping, unmapped only here.
        unsafe { libc::shmdt(self.addr.cast()) };
    }
}
