//! `plugin push`: publishes a built plugin to an OCI registry (the artifact layout is in
//! [`crate::templates::oci`]).
//!
//! Only a WebAssembly component is pushed: a core module or any other file is refused
//! before the registry is contacted, so a typo does not publish garbage under a tag.

use std::path::Path;

use super::AuthoringError;
use crate::templates::oci::{self, OciRef};

/// The first eight bytes of a component: the wasm magic, then the component layer's
/// version (`0x0d 0x00`) and layer (`0x01 0x00`); a core module has `0x01 0 0 0` there.
const COMPONENT_HEADER: [u8; 8] = [0x00, 0x61, 0x73, 0x6d, 0x0d, 0x00, 0x01, 0x00];

/// What was pushed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pushed {
    /// Where it was pushed (`oci://REGISTRY/REPOSITORY:TAG`).
    pub target: String,
    /// The reference to configure, pinned by the manifest's digest.
    pub reference: OciRef,
    /// The wasm layer's sha256 (the component's; what `sha256` may also pin).
    pub layer_sha256: String,
    /// The component's size.
    pub size: usize,
}

/// Pushes the component at `plugin` to `reference` (`oci://REGISTRY/REPOSITORY:TAG`).
pub fn push(
    plugin: &Path,
    reference: &str,
    credentials: Option<&Path>,
    ca_file: Option<&Path>,
) -> Result<Pushed, AuthoringError> {
    let target = OciRef::parse(reference)?;
    let bytes =
        crate::templates::source::read_file(plugin).map_err(|e| AuthoringError::NotAComponent {
            path: plugin.display().to_string(),
            reason: e.to_string(),
        })?;
    check_component(&bytes).map_err(|reason| AuthoringError::NotAComponent {
        path: plugin.display().to_string(),
        reason,
    })?;
    let ca = match ca_file {
        Some(p) => Some(std::fs::read(p).map_err(|e| AuthoringError::io(p, e))?),
        None => None,
    };
    let title = plugin
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "plugin.wasm".into());
    let pushed = oci::push(&bytes, &title, &target, credentials, ca.as_deref())?;
    Ok(Pushed {
        target: target.to_string(),
        reference: pushed.reference,
        layer_sha256: pushed.layer_sha256,
        size: bytes.len(),
    })
}

/// Whether `bytes` start like a WebAssembly component, and why not.
fn check_component(bytes: &[u8]) -> Result<(), String> {
    match bytes.get(..8) {
        Some(h) if h == COMPONENT_HEADER => Ok(()),
        Some(h) if h[..4] == COMPONENT_HEADER[..4] => Err(
            "is a core WebAssembly module, not a component: build for wasm32-wasip2 \
             (`cargo build --release --target wasm32-wasip2`)"
                .into(),
        ),
        _ => Err("is not a WebAssembly component (no \\0asm header)".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_components_are_pushed() {
        assert_eq!(check_component(&COMPONENT_HEADER), Ok(()));
        let core = [0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00];
        assert!(
            check_component(&core)
                .unwrap_err()
                .contains("core WebAssembly module")
        );
        assert!(
            check_component(b"#!/bin/sh\n")
                .unwrap_err()
                .contains("no \\0asm")
        );
        assert!(check_component(b"").unwrap_err().contains("no \\0asm"));
    }

    #[test]
    fn a_file_that_is_not_a_component_is_refused_before_the_registry() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("p.wasm");
        std::fs::write(&f, b"not wasm").unwrap();
        // Port 1: a registry contact would fail differently.
        let e = push(&f, "oci://127.0.0.1:1/p:v1", None, None).unwrap_err();
        assert!(
            matches!(&e, AuthoringError::NotAComponent { reason, .. } if reason.contains("no \\0asm")),
            "{e}"
        );
        let e = push(
            &dir.path().join("missing.wasm"),
            "oci://127.0.0.1:1/p:v1",
            None,
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("missing.wasm"), "{e}");
        let e = push(&f, "oci://127.0.0.1:1/P", None, None).unwrap_err();
        assert!(matches!(e, AuthoringError::Oci(_)), "{e}");
    }
}
