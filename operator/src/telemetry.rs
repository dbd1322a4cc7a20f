//! Log output of the binary: human-readable lines on stderr, filtered by `RUST_LOG`
//! (default: `warn` for one-shot commands, so their own output stays readable).
//!
//! Only the binary calls [`init`]; the library just emits `tracing` events, and tests
//! install nothing, so nothing prints unless asked.

/// Installs the stderr subscriber once; later calls do nothing.
pub fn init(default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}
