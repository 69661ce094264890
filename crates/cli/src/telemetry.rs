//! Logs and traces: log lines on stderr (text, or JSON with `WARREN_LOG_FORMAT=json`), filtered by
//! `WARREN_LOG`; and, for `warren serve` with an OTLP endpoint in the environment
//! (`OTEL_EXPORTER_OTLP_ENDPOINT`), every span exported over OTLP/HTTP. The server's spans are
//! `request` (one per HTTP request, its `id` the `X-Request-Id` the answer carries and every log
//! line inside it shows), and within it the create's phases and the proxied calls. Without an
//! endpoint no OpenTelemetry layer exists: spans cost what `tracing` spans cost.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};
use warren_env::EnvVars;

/// Flushes the traces still batched when dropped (at the end of `main`).
pub struct Telemetry(Option<SdkTracerProvider>);

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = p.shutdown();
        }
    }
}

/// Installs the global subscriber; `traces`: export spans when an OTLP endpoint is configured.
pub fn init(traces: bool) -> Telemetry {
    let filter = warren_env::var(EnvVars::WARREN_LOG)
        .unwrap_or_else(|| "warren=info,warren_server=info,warn".into());
    let json = warren_env::var(EnvVars::WARREN_LOG_FORMAT).as_deref() == Some("json");
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = if json {
        fmt.json()
            .with_current_span(true)
            .with_span_list(true)
            .boxed()
    } else {
        fmt.boxed()
    };
    let configured = warren_env::var(EnvVars::OTEL_EXPORTER_OTLP_ENDPOINT).is_some()
        || warren_env::var(EnvVars::OTEL_EXPORTER_OTLP_TRACES_ENDPOINT).is_some();
    let provider = (traces && configured).then(provider).and_then(|p| match p {
        Ok(p) => Some(p),
        Err(e) => {
            eprintln!("warren: traces are off: {e}");
            None
        }
    });
    // The spans' level filter is the logs' own: `WARREN_LOG` decides what is traced too.
    let otel = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("warren"))
            .boxed()
    });
    tracing_subscriber::registry()
        .with(EnvFilter::new(filter))
        .with(fmt)
        .with(otel)
        .init();
    Telemetry(provider)
}

fn provider() -> anyhow::Result<SdkTracerProvider> {
    let protocol = match warren_env::var(EnvVars::OTEL_EXPORTER_OTLP_PROTOCOL).as_deref() {
        None | Some("http/protobuf") => Protocol::HttpBinary,
        Some("http/json") => Protocol::HttpJson,
        Some(other) => anyhow::bail!(
            "{} = {other:?}: http/protobuf or http/json (gRPC is not built in)",
            EnvVars::OTEL_EXPORTER_OTLP_PROTOCOL
        ),
    };
    // The endpoint, the headers and the timeout come from the OTEL_* environment (the SDK's own).
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(protocol)
        .build()?;
    let service = warren_env::var(EnvVars::OTEL_SERVICE_NAME).unwrap_or_else(|| "warren".into());
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service)
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}
