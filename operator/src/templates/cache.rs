//! On-disk cache of compiled plugin code.
//!
//! Compiling a component with Cranelift takes far longer than loading its machine code, so
//! compiled code is kept in a directory (an emptyDir in the Deployment). An entry is named
//! by the component's sha256 and the engine's compatibility hash, so a different plugin or
//! an operator built with another wasmtime or other settings never looks at it. Each entry
//! starts with the sha256 of its payload: a truncated or corrupted file is detected before
//! wasmtime ever sees it, and any entry that fails to load is a cache miss (removed and
//! rebuilt), never an error.

use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

/// Length of the digest that prefixes every entry.
const DIGEST_LEN: usize = 32;

/// A directory of compiled components.
#[derive(Debug, Clone)]
pub struct CodeCache {
    dir: PathBuf,
    engine_hash: String,
}

/// Feeds `Hash` output into SHA-256, so the engine's compatibility hash is stable across
/// processes (std's `DefaultHasher` makes no such promise).
struct ShaHasher(Sha256);

impl Hasher for ShaHasher {
    fn finish(&self) -> u64 {
        0
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
}

/// Where a component came from on this load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheOutcome {
    /// Loaded from a verified cache entry.
    Hit,
    /// Compiled (no entry, or a stale or corrupt one) and written back.
    Miss,
    /// Compiled; there is no cache.
    Disabled,
}

impl CodeCache {
    /// A cache in `dir`, created if missing.
    pub fn new(dir: &Path, engine: &Engine) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut h = ShaHasher(Sha256::new());
        engine.precompile_compatibility_hash().hash(&mut h);
        let engine_hash = hex::encode(&h.0.finalize()[..8]);
        Ok(Self {
            dir: dir.to_path_buf(),
            engine_hash,
        })
    }

    /// The entry path for a component with this sha256.
    pub fn entry_path(&self, component_sha256: &str) -> PathBuf {
        self.dir
            .join(format!("{component_sha256}-{}.cwasm", self.engine_hash))
    }

    /// Loads a verified entry, or `None` (removing an unusable entry).
    pub fn load(&self, engine: &Engine, component_sha256: &str) -> Option<Component> {
        let path = self.entry_path(component_sha256);
        let bytes = std::fs::read(&path).ok()?;
        let verified = bytes
            .split_at_checked(DIGEST_LEN)
            .and_then(|(digest, payload)| {
                (Sha256::digest(payload).as_slice() == digest).then_some(payload)
            });
        let Some(payload) = verified else {
            tracing::warn!(path = %path.display(), "compiled-code cache entry is corrupt; recompiling");
            let _ = std::fs::remove_file(&path);
            return None;
        };
        match deserialize(engine, payload) {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "compiled-code cache entry is stale; recompiling");
                let _ = std::fs::remove_file(&path);
                None
            }
        }
    }

    /// Writes an entry atomically (temp file + rename); failures are logged, never fatal.
    pub fn store(&self, component_sha256: &str, component: &Component) {
        let path = self.entry_path(component_sha256);
        let result = component
            .serialize()
            .map_err(|e| std::io::Error::other(e.to_string()))
            .and_then(|payload| {
                let mut tmp = tempfile::NamedTempFile::new_in(&self.dir)?;
                tmp.write_all(&Sha256::digest(&payload))?;
                tmp.write_all(&payload)?;
                tmp.as_file().sync_all()?;
                tmp.persist(&path).map_err(|e| e.error)?;
                Ok(())
            });
        if let Err(e) = result {
            tracing::warn!(path = %path.display(), error = %e, "cannot write compiled-code cache entry");
        }
    }
}

/// Loads precompiled machine code.
///
/// This is the one `unsafe` in the operator. wasmtime cannot check that serialized code
/// is what it produced, so the caller must guarantee it. We do: the bytes are verified
/// against the sha256 we wrote next to them when *we* serialized them with an engine of
/// the same compatibility hash (wasmtime also checks its own header and refuses another
/// version or configuration), and the cache directory is private to the operator.
#[allow(unsafe_code)]
fn deserialize(engine: &Engine, payload: &[u8]) -> wasmtime::Result<Component> {
    // SAFETY: see the function docs: the payload is our own, verified output.
    unsafe { Component::deserialize(engine, payload) }
}
