//! How times are written on the wire.

use chrono::{DateTime, SecondsFormat, Utc};

/// RFC 3339 in UTC with milliseconds, as the protocol's timestamps are.
pub fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}
