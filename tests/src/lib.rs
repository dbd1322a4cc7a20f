//! Shared helpers for the integration tests in `tests/tests/`.
#![forbid(unsafe_code)]

pub mod harness;
pub mod https;

use std::path::PathBuf;

/// The workspace root (where `Cargo.toml`, `config/` and `operator/` live).
pub fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(PathBuf::from).unwrap_or(here)
}

/// Cargo's target directory, as the Makefile sees it.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// A plugin component built by `make plugins` (`target/plugins/NAME.wasm`).
pub fn plugin_path(name: &str) -> anyhow::Result<PathBuf> {
    let path = target_dir().join("plugins").join(format!("{name}.wasm"));
    anyhow::ensure!(
        path.exists(),
        "{} is missing: run `make plugins` first (`make test` does)",
        path.display()
    );
    Ok(path)
}
