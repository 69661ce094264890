//! Kubernetes-style resource quantities as the protocol carries them in `resourceLimits`
//! (`cpu: "500m"`, `memory: "512Mi"`). Parsed strictly: a typo must be a 400, not a surprise limit.

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid {resource} quantity {value:?}: {why}")]
pub struct QuantityError {
    pub resource: &'static str,
    pub value: String,
    pub why: &'static str,
}

/// Splits "1.5Gi" into ("1.5", "Gi").
fn split_number(s: &str) -> (&str, &str) {
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    s.split_at(end)
}

fn parse_decimal(num: &str) -> Option<f64> {
    if num.is_empty() || num.starts_with('.') || num.ends_with('.') || num.matches('.').count() > 1
    {
        return None;
    }
    num.parse::<f64>().ok().filter(|v| v.is_finite())
}

/// CPU in millicores: "1" → 1000, "500m" → 500, "0.25" → 250.
pub fn parse_cpu_millis(value: &str) -> Result<u64, QuantityError> {
    let err = |why| QuantityError {
        resource: "cpu",
        value: value.to_string(),
        why,
    };
    let (num, suffix) = split_number(value.trim());
    let n = parse_decimal(num)
        .ok_or_else(|| err("expected a number like \"1\", \"0.5\" or \"500m\""))?;
    let millis = match suffix {
        "" => n * 1000.0,
        "m" => n,
        _ => return Err(err("unknown suffix (use \"m\" for millicores)")),
    };
    // The kernel's smallest CFS quota is 1 ms per (Warren's) 100 ms period; Docker's NanoCPUs
    // floor is the same 0.01 CPU. Below it a create would fail in the runtime with a 500.
    if millis < 10.0 {
        return Err(err("must be at least 10m (0.01 CPU)"));
    }
    if millis > 1024.0 * 1000.0 {
        return Err(err("more than 1024 cores"));
    }
    Ok(millis.round() as u64)
}

/// Memory in bytes: "512Mi", "2Gi", "1G", "1048576".
pub fn parse_memory_bytes(value: &str) -> Result<u64, QuantityError> {
    // Below a few MiB nothing starts (execd alone needs ~2 MiB); refuse rather than create a
    // sandbox that dies at once.
    parse_bytes("memory", value, 8 << 20, "must be at least 8Mi")
}

/// The bound on a sandbox's root filesystem writes (`ephemeral-storage`), in bytes, as memory.
pub fn parse_disk_bytes(value: &str) -> Result<u64, QuantityError> {
    // A file system smaller than this holds little more than its own metadata.
    parse_bytes(
        "ephemeral-storage",
        value,
        32 << 20,
        "must be at least 32Mi",
    )
}

/// A size in bytes in the same notation (`64Gi`, `500M`, `1024`) for a setting named `resource`.
pub fn parse_size_bytes(resource: &'static str, value: &str) -> Result<u64, QuantityError> {
    parse_bytes(resource, value, 1, "must be at least 1 byte")
}

fn parse_bytes(
    resource: &'static str,
    value: &str,
    min: u64,
    too_small: &'static str,
) -> Result<u64, QuantityError> {
    let err = |why| QuantityError {
        resource,
        value: value.to_string(),
        why,
    };
    let (num, suffix) = split_number(value.trim());
    let n = parse_decimal(num)
        .ok_or_else(|| err("expected a number with an optional unit like \"512Mi\""))?;
    let mult: f64 = match suffix {
        "" => 1.0,
        "k" | "K" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "Ki" => 1024.0,
        "Mi" => 1024.0 * 1024.0,
        "Gi" => 1024.0 * 1024.0 * 1024.0,
        "Ti" => 1024.0f64.powi(4),
        _ => return Err(err("unknown unit (use Ki, Mi, Gi, Ti, k, M, G or T)")),
    };
    let bytes = n * mult;
    if bytes < min as f64 {
        return Err(err(too_small));
    }
    if bytes > 16.0 * 1024f64.powi(4) {
        return Err(err("more than 16Ti"));
    }
    Ok(bytes.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_quantities() {
        assert_eq!(parse_cpu_millis("1"), Ok(1000));
        assert_eq!(parse_cpu_millis("500m"), Ok(500));
        assert_eq!(parse_cpu_millis("0.25"), Ok(250));
        assert_eq!(parse_cpu_millis("2.5"), Ok(2500));
        assert_eq!(parse_cpu_millis("10m"), Ok(10));
        assert_eq!(parse_cpu_millis("0.01"), Ok(10));
        for bad in [
            "", "m", "abc", "1x", "-1", "0", "0.0001", "1..2", ".5", "1e3", "1m", "9m", "0.005",
        ] {
            assert!(parse_cpu_millis(bad).is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn memory_quantities() {
        assert_eq!(parse_memory_bytes("512Mi"), Ok(512 << 20));
        assert_eq!(parse_memory_bytes("2Gi"), Ok(2 << 30));
        assert_eq!(parse_memory_bytes("1G"), Ok(1_000_000_000));
        assert_eq!(parse_memory_bytes("1.5Gi"), Ok(3 << 29));
        assert_eq!(parse_memory_bytes("104857600"), Ok(104_857_600));
        for bad in ["lots", "", "1Zi", "1mi", "-5Mi", "1Mi", "Gi"] {
            assert!(parse_memory_bytes(bad).is_err(), "{bad} should be rejected");
        }
    }

    #[test]
    fn disk_quantities() {
        assert_eq!(parse_disk_bytes("64Mi"), Ok(64 << 20));
        assert_eq!(parse_disk_bytes("10Gi"), Ok(10 << 30));
        let small = parse_disk_bytes("16Mi").expect_err("too small");
        assert_eq!(small.resource, "ephemeral-storage");
        for bad in ["banana", "", "1Zi", "20Ti", "Gi"] {
            assert!(parse_disk_bytes(bad).is_err(), "{bad} should be rejected");
        }
    }
}

#[cfg(test)]
mod properties {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever the text, parsing answers (never panics), and what it accepts is in range.
        #[test]
        fn any_text_is_parsed_or_refused_within_bounds(text in "\\PC{0,12}") {
            if let Ok(m) = parse_cpu_millis(&text) {
                prop_assert!((10..=1_024_000).contains(&m));
            }
            if let Ok(b) = parse_memory_bytes(&text) {
                prop_assert!(b >= 8 << 20);
            }
            if let Ok(b) = parse_disk_bytes(&text) {
                prop_assert!(b >= 32 << 20);
            }
        }

        /// Every quantity written the ways clients write them reads back as itself.
        #[test]
        fn written_quantities_read_back(millis in 10u64..=1_024_000, cores in 1u64..=1024, mib in 8u64..=1 << 20, bytes in (8u64 << 20)..=(1 << 40)) {
            prop_assert_eq!(parse_cpu_millis(&format!("{millis}m")), Ok(millis));
            prop_assert_eq!(parse_cpu_millis(&format!("{cores}")), Ok(cores * 1000));
            prop_assert_eq!(parse_memory_bytes(&format!("{mib}Mi")), Ok(mib << 20));
            prop_assert_eq!(parse_memory_bytes(&format!("{bytes}")), Ok(bytes));
            prop_assert_eq!(parse_memory_bytes(&format!(" {mib}Mi ")), Ok(mib << 20));
        }

        /// A unit the parser does not know is refused, never read as some other one.
        #[test]
        fn unknown_units_are_refused(n in 1u64..100_000, unit in "[a-zA-Z]{1,3}") {
            let known = ["k", "K", "M", "G", "T", "Ki", "Mi", "Gi", "Ti", "P", "E", "Pi", "Ei"];
            prop_assume!(!known.contains(&unit.as_str()));
            let text = format!("{n}{unit}");
            prop_assert!(parse_memory_bytes(&text).is_err(), "{}", text);
            prop_assert!(parse_disk_bytes(&text).is_err(), "{}", text);
            if unit != "m" {
                prop_assert!(parse_cpu_millis(&text).is_err(), "{}", text);
            }
        }
    }
}
