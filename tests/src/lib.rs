//! Shared helpers for the integration tests in `tests/tests/`.
#![forbid(unsafe_code)]

use std::path::PathBuf;

/// The workspace root (where `Cargo.toml`, `config/` and `operator/` live).
pub fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(PathBuf::from).unwrap_or(here)
}
