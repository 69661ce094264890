//! Integration tests of the image store. They need root (chown, mknod of whiteouts, trusted.* xattrs,
//! overlayfs mounts in a private mount namespace) and use temp dirs only.

mod import;
mod leases;
mod lifecycle;
mod support;
