//! Network policies and their FQDN patterns, as a create or `PATCH /egress/policy` carries them: the
//! input is a JSON policy, a nul byte, then host names one per line. Parsing may refuse; deciding a
//! name must never panic and must agree with itself under case and a trailing dot.
#![no_main]

use libfuzzer_sys::fuzz_target;
use warren_egress::policy::{parse_rules, NetworkPolicy};

fuzz_target!(|data: &[u8]| {
    let (json, names) = match data.iter().position(|b| *b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(json) else {
        return;
    };
    let _ = parse_rules(&value);
    let Ok(Some(policy)) = NetworkPolicy::from_json(&value) else {
        return;
    };
    let _ = policy.cidr_rules();
    let _ = policy.mode();
    for name in String::from_utf8_lossy(names).lines() {
        let decided = policy.decide_name(name);
        let _ = policy.names_exactly(name);
        if name.is_ascii() && !name.ends_with('.') {
            assert_eq!(
                decided,
                policy.decide_name(&name.to_ascii_uppercase()),
                "{name:?}"
            );
        }
    }
});
