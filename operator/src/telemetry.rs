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
    use std::io::IsTerminal;
    let ansi = colour(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    );
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
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

/// Whether text logs carry ANSI colour: only on a terminal, and never when `NO_COLOR` is
/// set to anything but the empty string (no-color.org). In a pipe or a log file the escape
/// codes are noise that every reader has to strip.
fn colour(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::colour;
    use std::ffi::OsStr;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(!colour(false, None), "a pipe gets plain text");
        assert!(!colour(true, Some(OsStr::new("1"))));
        assert!(
            colour(true, Some(OsStr::new(""))),
            "an empty NO_COLOR is unset"
        );
    }
}
