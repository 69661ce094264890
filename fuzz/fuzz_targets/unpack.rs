//! The layer unpacker (image import and registry pulls): an uncompressed layer tar, as hostile as
//! an image can be, unpacked as root into a fresh folder. Refusing is fine; panicking, hanging, or
//! writing outside the folder is not (the target runs confined: see `warren_fuzz::confine`).
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

static SCRATCH: OnceLock<PathBuf> = OnceLock::new();

fuzz_target!(
    init: {
        SCRATCH.get_or_init(warren_fuzz::confine);
    },
    |data: &[u8]| {
        let scratch = SCRATCH.get().expect("confined in init");
        let dest = scratch.join("layer");
        std::fs::create_dir(&dest).expect("scratch is writable");
        let _ = warren_image::fuzzing::unpack_layer(data, &dest);
        warren_fuzz::empty(scratch);
    }
);
