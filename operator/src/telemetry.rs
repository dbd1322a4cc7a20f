//! Log output of the binary: lines on stderr, filtered by `RUST_LOG`; human-readable by
//! default (`warn` for one-shot commands, so their own output stays readable), one JSON
//! object per line for the operator in a cluster, where a log pipeline parses them.
//!
//! Only the binary calls [`init`]; the library just emits `tracing` events, and tests
//! install nothing, so nothing prints unless asked.

/// How log lines look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (timestamp, level, message, fields, span).
    Json,
}

/// Installs the stderr subscriber once (text); later calls do nothing.
pub fn init(default_level: &str) {
    init_with(default_level, LogFormat::Text);
}

/// Installs the stderr subscriber once in the given format; later calls do nothing.
pub fn init_with(default_level: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
    };
}
