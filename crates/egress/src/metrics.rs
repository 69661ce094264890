//! The egress metrics (names, labels, meaning), recorded through the `metrics` facade: a no-op
//! unless the program installed a recorder (`warren serve` does, for its `/metrics`).

use metrics::{counter, describe_counter};

/// Names sandboxes asked the DNS filter for, by `action` (`allow`, `deny`).
pub const NAME_DECISIONS: &str = "warren_egress_name_decisions_total";
/// Connections the interception decided on, by `action` (`allow`, `deny`).
pub const CONNECTION_DECISIONS: &str = "warren_egress_connection_decisions_total";
/// Requests a vault binding put its credential into, by `binding` (its name, never a secret).
pub const VAULT_INJECTIONS: &str = "warren_vault_injections_total";

/// Says what each metric is.
pub fn describe() {
    describe_counter!(
        NAME_DECISIONS,
        "Names sandboxes asked the DNS filter for, by action (allow, deny)."
    );
    describe_counter!(
        CONNECTION_DECISIONS,
        "Connections the credential proxy's interception decided on, by action (allow, deny)."
    );
    describe_counter!(
        VAULT_INJECTIONS,
        "Requests a vault binding put its credential into, by binding name."
    );
}

fn action(allowed: bool) -> &'static str {
    if allowed {
        "allow"
    } else {
        "deny"
    }
}

/// The DNS filter answered a name: allowed or denied.
pub fn name_decided(allowed: bool) {
    counter!(NAME_DECISIONS, "action" => action(allowed)).increment(1);
}

/// The interception let a connection through, or refused it.
pub fn connection_decided(allowed: bool) {
    counter!(CONNECTION_DECISIONS, "action" => action(allowed)).increment(1);
}

/// A binding's credential went into a request.
pub fn vault_injection(binding: &str) {
    counter!(VAULT_INJECTIONS, "binding" => binding.to_string()).increment(1);
}
