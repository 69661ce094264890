//! `POST /v1/sandboxes` validation (every field a caller sets: image, entrypoint, env, metadata,
//! extensions, volumes, network policy, resource quantities) and the quantity parsers on their own.
//! A refusal is a 4xx (never an internal error); a parsed quantity must read back the same when
//! written in its base unit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use warren_core::{parse_cpu_millis, parse_disk_bytes, parse_memory_bytes};

fuzz_target!(|data: &[u8]| {
    if let Err((status, message)) =
        warren_server::fuzzing::validate_create(data, "/tmp/warren-fuzz-volumes".into())
    {
        assert!((400..500).contains(&status), "{status} {message}");
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(m) = parse_cpu_millis(text) {
        assert_eq!(parse_cpu_millis(&format!("{m}m")).ok(), Some(m), "{text:?}");
    }
    if let Ok(b) = parse_memory_bytes(text) {
        assert_eq!(parse_memory_bytes(&b.to_string()).ok(), Some(b), "{text:?}");
    }
    if let Ok(b) = parse_disk_bytes(text) {
        assert_eq!(parse_disk_bytes(&b.to_string()).ok(), Some(b), "{text:?}");
    }
});
