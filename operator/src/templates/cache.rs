//! On-disk cache of compiled plugin code.
//!
//! Compiling a component with Cranelift takes far longer than loading its machine code, so
//! compiled code is kept in a directory (an emptyDir in the Deployment). An entry is named
//! by the component's sha256 and the engine's compatibility hash, so a different plugin or
//! an operator built with another wasmtime or other settings never looks at it. Each entry
//! starts with the sha256 of its payload: a truncated or corrupted file is detected before
//! wasmtime ever sees it, and any entry that fails to load is a cache miss (removed and
//! rebuilt), never an error.
//!
//! The entries are native code that the process maps and runs, so whoever can write the
//! directory can run code as the operator. [`CodeCache::new`] therefore refuses a directory
//! that is not owned by the process's user or that group or others may write (the
//! error names the path and the reason), and creates a missing one private (`0700`). In
//! Kubernetes, an emptyDir is root-owned and world-writable: point the cache at a
//! subdirectory of it, which the operator then creates itself. An entry file that is not
//! ours or is writable by others is a cache miss, like a corrupt one.

use std::hash::{Hash, Hasher};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

/// Length of the digest that prefixes every entry.
const DIGEST_LEN: usize = 32;
/// Mode of a cache directory the operator creates: only its own user may list or write.
const PRIVATE_DIR_MODE: u32 = 0o700;
/// Permission bits that let someone other than the owner put code in the cache (group or
/// others may write); a directory or entry with any of them is refused.
const FOREIGN_WRITE_BITS: u32 = 0o022;

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
    /// A cache in `dir`, created (mode `0700`, parents too) if missing. Refuses, with an
    /// `InvalidInput` error saying why, a directory that is not owned by this process's
    /// user or is writable by group or others (see the module docs). The checked
    /// directory is resolved once (symlinks followed), and entries are kept under that
    /// resolved path, so a symlink changed later cannot redirect the cache.
    pub fn new(dir: &Path, engine: &Engine) -> std::io::Result<Self> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(PRIVATE_DIR_MODE)
            .create(dir)?;
        let resolved = std::fs::canonicalize(dir)?;
        let meta = std::fs::metadata(&resolved)?;
        if !meta.is_dir() {
            return Err(refused("is not a directory".into()));
        }
        let me = current_uid().ok_or_else(|| {
            refused(
                "cannot tell which user this process runs as (/proc/self/status), so \
                 cannot check that the directory is private to it"
                    .into(),
            )
        })?;
        if let Some(why) = dir_problem(meta.mode(), meta.uid(), me) {
            return Err(refused(why));
        }
        let mut h = ShaHasher(Sha256::new());
        engine.precompile_compatibility_hash().hash(&mut h);
        let engine_hash = hex::encode(&h.0.finalize()[..8]);
        Ok(Self {
            dir: resolved,
            engine_hash,
        })
    }

    /// The directory the entries are kept in (resolved).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The entry path for a component with this sha256.
    pub fn entry_path(&self, component_sha256: &str) -> PathBuf {
        self.dir
            .join(format!("{component_sha256}-{}.cwasm", self.engine_hash))
    }

    /// Loads a verified entry, or `None` (removing an unusable entry).
    pub fn load(&self, engine: &Engine, component_sha256: &str) -> Option<Component> {
        let path = self.entry_path(component_sha256);
        let meta = std::fs::symlink_metadata(&path).ok()?;
        let ours = current_uid().is_some_and(|me| meta.uid() == me);
        if !meta.is_file() || !ours || meta.mode() & FOREIGN_WRITE_BITS != 0 {
            tracing::warn!(path = %path.display(), mode = format!("{:04o}", meta.mode() & 0o7777),
                owner = meta.uid(), "compiled-code cache entry is not a private file of ours; recompiling");
            let _ = std::fs::remove_file(&path);
            return None;
        }
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

impl CodeCache {
    fn link_path(&self, manifest_sha256: &str) -> PathBuf {
        self.dir.join(format!("oci-{manifest_sha256}.layer"))
    }

    /// Records that the OCI manifest of that sha256 names the wasm layer of that sha256,
    /// so a later load of the same `oci://` reference finds the compiled code without
    /// asking the registry (a manifest digest pins its layers for good). Failures are
    /// logged, never fatal.
    pub fn link(&self, manifest_sha256: &str, layer_sha256: &str) {
        let path = self.link_path(manifest_sha256);
        let result = tempfile::NamedTempFile::new_in(&self.dir).and_then(|mut tmp| {
            tmp.write_all(layer_sha256.as_bytes())?;
            tmp.as_file().sync_all()?;
            tmp.persist(&path).map_err(|e| e.error)?;
            Ok(())
        });
        if let Err(e) = result {
            tracing::warn!(path = %path.display(), error = %e, "cannot write the OCI manifest link of the compiled-code cache");
        }
    }

    /// The wasm layer's sha256 recorded by [`CodeCache::link`] for that manifest, if a
    /// private file of ours holds one (anything else is ignored and removed).
    pub fn linked(&self, manifest_sha256: &str) -> Option<String> {
        let path = self.link_path(manifest_sha256);
        let meta = std::fs::symlink_metadata(&path).ok()?;
        let ours = current_uid().is_some_and(|me| meta.uid() == me);
        let text = (meta.is_file() && ours && meta.mode() & FOREIGN_WRITE_BITS == 0)
            .then(|| std::fs::read_to_string(&path).ok())
            .flatten()
            .filter(|t| t.len() == 64 && t.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));
        if text.is_none() {
            tracing::warn!(path = %path.display(), "OCI manifest link of the compiled-code cache is unusable; pulling again");
            let _ = std::fs::remove_file(&path);
        }
        text
    }
}

fn refused(why: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, why)
}

/// Why a cache directory with permission bits `mode`, owned by `owner`, must not be used
/// by a process running as `me`; `None` if it may.
fn dir_problem(mode: u32, owner: u32, me: u32) -> Option<String> {
    const WHY: &str = "compiled plugin code is native code the operator runs, so its cache \
                       must be private to the operator's user (point --plugin-cache-dir at a \
                       directory the operator creates, e.g. a subdirectory of an emptyDir)";
    if owner != me {
        return Some(format!(
            "is owned by uid {owner}, not by this process's uid {me}; {WHY}"
        ));
    }
    if mode & FOREIGN_WRITE_BITS != 0 {
        return Some(format!(
            "has mode {:04o}, writable by group or others; {WHY}",
            mode & 0o7777
        ));
    }
    None
}

/// The effective uid of this process, from `/proc/self/status` (std has no `geteuid`).
fn current_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    // Real, effective, saved and filesystem uid.
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Loads precompiled machine code.
///
/// One of the few `unsafe` blocks in the operator (the others are the capped lifts in
/// `templates/bindings.rs`). wasmtime cannot check that serialized code
/// is what it produced, so the caller must guarantee it. We do: the bytes are verified
/// against the sha256 we wrote next to them when *we* serialized them with an engine of
/// the same compatibility hash (wasmtime also checks its own header and refuses another
/// version or configuration), and the cache directory is private to the operator.
#[allow(unsafe_code)]
fn deserialize(engine: &Engine, payload: &[u8]) -> wasmtime::Result<Component> {
    // SAFETY: see the function docs: the payload is our own, verified output.
    unsafe { Component::deserialize(engine, payload) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// The smallest valid component: the preamble of the component binary format.
    const EMPTY_COMPONENT: &[u8] = b"\0asm\x0d\x00\x01\x00";

    fn engine() -> Engine {
        let mut config = wasmtime::Config::new();
        config.wasm_component_model(true);
        Engine::new(&config).unwrap()
    }

    fn chmod(path: &Path, mode: u32) {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    fn mode_of(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().mode() & 0o7777
    }

    #[test]
    fn a_missing_directory_is_created_private_and_used() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a/b/compiled");
        let engine = engine();
        let cache = CodeCache::new(&dir, &engine).unwrap();
        assert_eq!(mode_of(&dir), PRIVATE_DIR_MODE);
        assert_eq!(cache.dir(), std::fs::canonicalize(&dir).unwrap());
        // An existing directory of ours without write bits for others is fine too.
        chmod(&dir, 0o755);
        let cache = CodeCache::new(&dir, &engine).unwrap();
        let component = Component::new(&engine, EMPTY_COMPONENT).unwrap();
        cache.store("ab", &component);
        assert!(cache.load(&engine, "ab").is_some());
    }

    #[test]
    fn a_directory_writable_by_others_or_group_is_refused_naming_path_and_reason() {
        let tmp = tempfile::tempdir().unwrap();
        let engine = engine();
        for mode in [0o777, 0o770, 0o1777, 0o702] {
            let dir = tmp.path().join(format!("cache-{mode:o}"));
            std::fs::create_dir(&dir).unwrap();
            chmod(&dir, mode);
            let e = CodeCache::new(&dir, &engine).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{mode:o}");
            assert!(
                e.to_string()
                    .contains(&format!("has mode {mode:04o}, writable by group or others")),
                "{e}"
            );
        }
        // Through the engine, the error names the directory and why (the run mode's
        // start-up error for --plugin-cache-dir).
        let dir = tmp.path().join("cache-777");
        let e = crate::templates::TemplateEngine::new(Some(&dir)).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains(&dir.display().to_string()) && text.contains("native code"),
            "{text}"
        );
    }

    #[test]
    fn a_directory_owned_by_another_user_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("theirs");
        std::fs::create_dir(&dir).unwrap();
        chmod(&dir, 0o700);
        const OTHER_UID: u32 = 4242;
        if let Err(e) = std::os::unix::fs::chown(&dir, Some(OTHER_UID), None) {
            // Only root can give a file away; the rule itself is covered below.
            eprintln!("skipping the chown case (not root: {e})");
        } else {
            let e = CodeCache::new(&dir, &engine()).unwrap_err();
            assert!(
                e.to_string()
                    .contains(&format!("is owned by uid {OTHER_UID}")),
                "{e}"
            );
        }
        assert!(dir_problem(0o700, OTHER_UID, 1000).is_some());
        assert!(dir_problem(0o700, 1000, 1000).is_none());
        assert!(dir_problem(0o755, 1000, 1000).is_none());
        assert!(dir_problem(0o720, 1000, 1000).is_some());
    }

    #[test]
    fn a_symlink_is_judged_by_its_target_and_resolved_once() {
        let tmp = tempfile::tempdir().unwrap();
        let open = tmp.path().join("open");
        std::fs::create_dir(&open).unwrap();
        chmod(&open, 0o777);
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&open, &link).unwrap();
        assert!(CodeCache::new(&link, &engine()).is_err());
        chmod(&open, 0o700);
        let cache = CodeCache::new(&link, &engine()).unwrap();
        assert_eq!(cache.dir(), std::fs::canonicalize(&open).unwrap());
    }

    #[test]
    fn an_oci_manifest_link_is_kept_private_and_only_a_sha256_is_read_back() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = CodeCache::new(tmp.path(), &engine()).unwrap();
        let (manifest, layer) = ("1".repeat(64), "ab".repeat(32));
        assert_eq!(cache.linked(&manifest), None);
        cache.link(&manifest, &layer);
        assert_eq!(cache.linked(&manifest), Some(layer.clone()));
        let path = cache.link_path(&manifest);
        assert_eq!(mode_of(&path) & FOREIGN_WRITE_BITS, 0);
        // Writable by others: ignored and removed (someone could point it elsewhere).
        chmod(&path, 0o666);
        assert_eq!(cache.linked(&manifest), None);
        assert!(!path.exists());
        // Not a sha256: ignored and removed.
        std::fs::write(&path, "../../etc/passwd").unwrap();
        assert_eq!(cache.linked(&manifest), None);
        assert!(!path.exists());
    }

    #[test]
    fn an_entry_others_may_write_is_a_miss_and_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let engine = engine();
        let cache = CodeCache::new(tmp.path(), &engine).unwrap();
        let component = Component::new(&engine, EMPTY_COMPONENT).unwrap();
        cache.store("cd", &component);
        let entry = cache.entry_path("cd");
        assert_eq!(mode_of(&entry) & FOREIGN_WRITE_BITS, 0);
        assert!(cache.load(&engine, "cd").is_some());
        chmod(&entry, 0o666);
        assert!(cache.load(&engine, "cd").is_none());
        assert!(!entry.exists());
    }
}
