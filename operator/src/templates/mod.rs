//! The template host: loads template plugins (WebAssembly components) and runs their
//! renders in a sandbox.
//!
//! Design, after wasmtime's plugin examples and Kubewarden's evaluator:
//! - one [`Engine`] and one [`Linker`] for the process; each component is compiled (or
//!   loaded from the [`cache`]) and linked **once** into an `InstancePre`;
//! - every call (schema, settings validation, render) gets a **fresh `Store`**, so no state
//!   leaks from one render into the next and a render is a pure function of its input;
//! - each store has fuel (a deterministic instruction budget), an epoch deadline (a
//!   wall-clock budget driven by one ticker thread), a memory cap, caps on the WASI
//!   resources, component handles and bytes per host call a plugin can make the host hold
//!   (see [`sandbox`]), and captured stdio;
//! - imports are checked against the [`sandbox`] allow-list at load, and outputs are
//!   checked by [`check`] before anyone uses them;
//! - every result (output, refusal message, schema, settings issues) is size-checked
//!   *before* it is copied into host memory (`bindings::capped`), and what a refusal keeps
//!   of settings issues is capped again;
//! - the plugin's settings schema is held to the rules of [`schema`] (size, depth,
//!   self-contained references, bounded expansion, linear-time patterns) before it is
//!   compiled, so checking settings against it is bounded work.
//!
//! Calls are synchronous and CPU-bound: async callers run them with `spawn_blocking`.

mod bindings;
pub mod cache;
pub mod check;
mod errors;
pub mod oci;
pub mod sandbox;
pub mod schema;
mod set;
pub mod settings_doc;
pub mod source;
#[cfg(test)]
mod tests_limits;
#[cfg(test)]
mod tests_overrides;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, ComponentExportIndex, InstancePre, Linker, Lower};
use wasmtime::{Config, Engine, ResourceLimiter, Store, Trap};

pub use bindings::types::{
    Disk, DiskBus, DiskRole, DomainInput, Firmware, HostFacts, MachineType, VendorDataInput,
};
pub use cache::{CacheOutcome, CodeCache};
pub use errors::{Limit, OverrideIssue, SettingsIssue, TemplateError, TemplateErrorKind};
pub use set::{PluginHealth, PluginUnavailable, TemplateSet};

use crate::config::TemplateConfig;
use bindings::capped::{Capped, CappedList};
use bindings::domain::DomainPre;
use bindings::vendor_data::VendorDataPre;
use sandbox::RenderState;

/// How often the epoch ticker advances: the granularity of render deadlines.
pub const EPOCH_TICK: Duration = Duration::from_millis(5);
/// Instruction budget of one call. Real renders use a few million; this stops a runaway
/// plugin deterministically (about two seconds of pure compute here), so a plugin with a
/// long configured timeout still cannot spin for it all. It sits well above what the
/// default timeout allows, so the deadline is what normally fires.
pub const FUEL_PER_CALL: u64 = 10_000_000_000;
/// Largest component file accepted: the default plugins are well under 1 MiB.
pub const MAX_COMPONENT_BYTES: u64 = 32 * 1024 * 1024;
/// Budget of the schema and settings calls at load time, which are tiny.
const LOAD_CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Which kind of plugin a component is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateKind {
    /// Renders libvirt domain XML.
    Domain,
    /// Renders cloud-init vendor-data.
    VendorData,
}

impl TemplateKind {
    /// The exported interface that identifies this kind.
    fn interface(self) -> &'static str {
        match self {
            TemplateKind::Domain => "domain-template",
            TemplateKind::VendorData => "vendor-data-template",
        }
    }
    /// Config key of this kind, used in plugin names.
    pub fn as_str(self) -> &'static str {
        match self {
            TemplateKind::Domain => "domain",
            TemplateKind::VendorData => "vendor-data",
        }
    }
    /// Field of this kind under `kvm2.templates` and `spec.templateSettings`.
    pub fn field(self) -> &'static str {
        match self {
            TemplateKind::Domain => "domain",
            TemplateKind::VendorData => "vendorData",
        }
    }
}

/// Per-Proxy settings overrides: top-level keys merged over the configured settings.
pub type SettingsOverrides = serde_json::Map<String, serde_json::Value>;

/// Longest error message of a render that is read from the plugin; a longer one is
/// refused by its length alone, never copied (and what is kept is cut further, see
/// `truncate`).
pub const REFUSAL_MAX: usize = 4096;
/// Most settings issues lifted from `validate-settings`, or formatted from the schema's
/// verdict, and kept in a refusal; the rest are only counted. A plugin returning a million
/// issues costs the host sixteen.
pub const MAX_SETTINGS_ISSUES: usize = 16;
/// Longest pointer or message of one `validate-settings` issue that is copied out of the
/// plugin; a longer one is replaced by a note of its length.
pub const ISSUE_TEXT_LIFT_MAX: usize = 4096;
/// Longest message of one settings issue kept in a refusal (a condition, an event and a log
/// line carry it).
const ISSUE_MESSAGE_KEPT: usize = 256;
/// Longest JSON pointer of one settings issue kept in a refusal.
const ISSUE_POINTER_KEPT: usize = 128;
/// Most bytes of pointers and messages all kept issues of one refusal carry together.
const ISSUES_TEXT_KEPT: usize = 2048;

/// What `validate-settings` returns, lifted within the caps above.
type PluginIssues = CappedList<bindings::capped::Issue, MAX_SETTINGS_ISSUES>;
/// What `render` returns, with the output capped at `MAX` bytes.
type RenderResult<const MAX: usize> = Result<Capped<MAX>, Capped<REFUSAL_MAX>>;

/// Per-call resource limits of one plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenderLimits {
    /// Wall-clock budget of a render.
    pub timeout: Duration,
    /// Linear memory cap.
    pub memory_bytes: usize,
    /// Instruction budget.
    pub fuel: u64,
}

impl RenderLimits {
    /// The limits a template entry of the providers config asks for.
    pub fn from_config(t: &TemplateConfig) -> Self {
        Self {
            timeout: Duration::from_millis(u64::from(t.timeout_millis)),
            memory_bytes: usize::try_from(t.max_memory_mib)
                .unwrap_or(usize::MAX)
                .saturating_mul(1024 * 1024),
            fuel: FUEL_PER_CALL,
        }
    }
}

/// Advances the engine's epoch every [`EPOCH_TICK`] on one thread, which is joined on drop.
#[derive(Debug)]
struct EpochTicker {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl EpochTicker {
    fn start(engine: &Engine) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, engine) = (stop.clone(), engine.weak());
        let thread = std::thread::Builder::new()
            .name("template-epoch".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    match engine.upgrade() {
                        Some(e) => e.increment_epoch(),
                        None => break,
                    }
                }
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Records that the memory cap was hit, so the failure is reported as such and not as a
/// generic trap.
#[derive(Debug)]
pub(crate) struct MemoryCap {
    pub(crate) max_bytes: usize,
    pub(crate) hit: bool,
}

impl ResourceLimiter for RenderState {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.memory_cap.max_bytes {
            self.memory_cap.hit = true;
            wasmtime::bail!("memory cap of {} bytes reached", self.memory_cap.max_bytes);
        }
        self.limits.memory_growing(current, desired, maximum)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.limits.table_growing(current, desired, maximum)
    }

    fn instances(&self) -> usize {
        self.limits.instances()
    }
    fn tables(&self) -> usize {
        self.limits.tables()
    }
    fn memories(&self) -> usize {
        self.limits.memories()
    }
}

/// How a [`TemplateEngine`] is set up.
#[derive(Debug, Clone, Default)]
pub struct EngineOptions {
    /// Directory of the compiled-code cache; no cache when `None`.
    pub cache_dir: Option<std::path::PathBuf>,
    /// PEM certificates to trust for plugin downloads instead of Mozilla's roots.
    pub download_ca_pem: Option<Vec<u8>>,
}

/// The process-wide template host.
pub struct TemplateEngine {
    engine: Engine,
    linker: Linker<RenderState>,
    cache: Option<CodeCache>,
    downloader: source::Downloader,
    /// PEM certificates trusted for `oci://` pulls instead of the system's roots.
    ca_pem: Option<Vec<u8>>,
    // Dropped after the fields above: the ticker only holds a weak engine reference.
    _ticker: EpochTicker,
}

impl std::fmt::Debug for TemplateEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TemplateEngine")
            .field("cache", &self.cache)
            .finish_non_exhaustive()
    }
}

fn engine_err(e: impl std::fmt::Display) -> TemplateError {
    TemplateError {
        plugin: "<engine>".into(),
        kind: TemplateErrorKind::Engine(e.to_string()),
    }
}

impl TemplateEngine {
    /// A host with compiled code cached in `cache_dir` (no cache when `None`), downloading
    /// over https with Mozilla's roots.
    pub fn new(cache_dir: Option<&Path>) -> Result<Self, TemplateError> {
        Self::with_options(&EngineOptions {
            cache_dir: cache_dir.map(Path::to_path_buf),
            download_ca_pem: None,
        })
    }

    /// A host with explicit options.
    pub fn with_options(options: &EngineOptions) -> Result<Self, TemplateError> {
        let cache_dir = options.cache_dir.as_deref();
        let mut config = Config::new();
        config
            .consume_fuel(true)
            .epoch_interruption(true)
            .wasm_component_model(true);
        let engine = Engine::new(&config).map_err(engine_err)?;
        let linker = sandbox::linker(&engine).map_err(engine_err)?;
        let cache = match cache_dir {
            Some(dir) => Some(
                CodeCache::new(dir, &engine).map_err(|source| TemplateError {
                    plugin: "<engine>".into(),
                    kind: TemplateErrorKind::CacheDir {
                        path: dir.display().to_string(),
                        source,
                    },
                })?,
            ),
            None => None,
        };
        let downloader =
            source::Downloader::new(options.download_ca_pem.as_deref()).map_err(|kind| {
                TemplateError {
                    plugin: "<engine>".into(),
                    kind,
                }
            })?;
        let ticker = EpochTicker::start(&engine).map_err(engine_err)?;
        Ok(Self {
            engine,
            linker,
            cache,
            downloader,
            ca_pem: options.download_ca_pem.clone(),
            _ticker: ticker,
        })
    }

    /// The component an `oci://` entry pins: compiled code from the cache when the cache
    /// knows the manifest's layer (or `sha256` names it), else pulled, verified (manifest
    /// against the reference's digest, layer against the manifest, and against `sha256`
    /// when given) and compiled.
    fn load_oci(
        &self,
        url: &str,
        t: &TemplateConfig,
    ) -> Result<(Component, String, CacheOutcome), TemplateErrorKind> {
        let oci_fail = |source: oci::OciError| TemplateErrorKind::Oci {
            reference: url.to_string(),
            source: Box::new(source),
        };
        let reference = oci::OciRef::parse(url).map_err(oci_fail)?;
        let manifest = reference.digest.clone().ok_or_else(|| {
            oci_fail(oci::OciError::BadReference {
                reference: url.to_string(),
                reason: "has no @sha256: digest; a plugin is pulled only by digest".into(),
            })
        })?;
        let pinned = t.sha256.as_deref().map(str::to_ascii_lowercase);
        let known = pinned
            .clone()
            .or_else(|| self.cache.as_ref().and_then(|c| c.linked(&manifest)));
        if let Some(layer) = known
            && let Some(c) = self
                .cache
                .as_ref()
                .and_then(|cache| cache.load(&self.engine, &layer))
        {
            return Ok((c, layer, CacheOutcome::Hit));
        }
        let pulled = oci::pull(
            &reference,
            t.credentials_file.as_deref().map(Path::new),
            self.ca_pem.as_deref(),
        )
        .map_err(oci_fail)?;
        let sha256 = verified_digest(&pulled.bytes, pinned.as_deref())?;
        let (c, outcome) = self.compile(&pulled.bytes, &sha256)?;
        if let Some(cache) = &self.cache {
            cache.link(&pulled.manifest_sha256, &sha256);
        }
        Ok((c, sha256, outcome))
    }

    /// Loads the domain plugin an entry of the config names and validates its settings.
    pub fn load_domain(&self, t: &TemplateConfig) -> Result<DomainTemplate, TemplateError> {
        let mut loaded = self.load(TemplateKind::Domain, t)?;
        // The generated bindings check the type of every export, once, at load.
        DomainPre::new(loaded.pre.clone()).map_err(|e| loaded.abi_error(e))?;
        loaded.schema = Some(loaded.validate_settings()?);
        Ok(DomainTemplate { loaded })
    }

    /// Loads the vendor-data plugin an entry of the config names and validates its
    /// settings.
    pub fn load_vendor_data(
        &self,
        t: &TemplateConfig,
    ) -> Result<VendorDataTemplate, TemplateError> {
        let mut loaded = self.load(TemplateKind::VendorData, t)?;
        // The generated bindings check the type of every export, once, at load.
        VendorDataPre::new(loaded.pre.clone()).map_err(|e| loaded.abi_error(e))?;
        loaded.schema = Some(loaded.validate_settings()?);
        Ok(VendorDataTemplate { loaded })
    }

    fn load(&self, kind: TemplateKind, t: &TemplateConfig) -> Result<Loaded, TemplateError> {
        let source = t
            .path
            .as_deref()
            .or(t.url.as_deref())
            .unwrap_or("<none>")
            .to_string();
        let name = format!("{}:{source}", kind.as_str());
        let fail = |kind: TemplateErrorKind| TemplateError {
            plugin: name.clone(),
            kind,
        };
        let (component, sha256, outcome) = match (t.path.as_deref(), t.url.as_deref()) {
            (Some(path), _) => {
                let bytes = source::read_file(Path::new(path)).map_err(&fail)?;
                let sha256 = verified_digest(&bytes, t.sha256.as_deref()).map_err(&fail)?;
                let (c, outcome) = self.compile(&bytes, &sha256).map_err(&fail)?;
                (c, sha256, outcome)
            }
            (None, Some(url)) if url.starts_with("oci://") => {
                let (c, sha256, outcome) = self.load_oci(url, t).map_err(&fail)?;
                (c, sha256, outcome)
            }
            (None, Some(url)) => {
                // Config validation makes `sha256` mandatory with `url`; check again.
                let pinned = t
                    .sha256
                    .as_deref()
                    .map(str::to_ascii_lowercase)
                    .ok_or_else(|| {
                        fail(TemplateErrorKind::Abi(
                            "a `url` source needs `sha256`".into(),
                        ))
                    })?;
                // Code compiled from bytes that matched this digest needs no download.
                match self
                    .cache
                    .as_ref()
                    .and_then(|c| c.load(&self.engine, &pinned))
                {
                    Some(c) => (c, pinned, CacheOutcome::Hit),
                    None => {
                        let bytes = self.downloader.fetch(url).map_err(&fail)?;
                        let sha256 = verified_digest(&bytes, Some(&pinned)).map_err(&fail)?;
                        let (c, outcome) = self.compile(&bytes, &sha256).map_err(&fail)?;
                        (c, sha256, outcome)
                    }
                }
            }
            (None, None) => {
                return Err(fail(TemplateErrorKind::Abi(
                    "names neither `path` nor `url`".into(),
                )));
            }
        };
        check_imports(&self.engine, &component).map_err(&fail)?;
        let interface = check_exports(&self.engine, &component, kind).map_err(&fail)?;
        let exports = Exports::find(&component, &interface).map_err(&fail)?;
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| fail(TemplateErrorKind::Abi(format!("cannot be linked: {e}"))))?;
        if outcome == CacheOutcome::Miss
            && let Some(cache) = &self.cache
        {
            cache.store(&sha256, &component);
        }
        tracing::info!(plugin = %name, %sha256, cache = ?outcome, "template plugin loaded");
        Ok(Loaded {
            name,
            kind,
            engine: self.engine.clone(),
            pre,
            exports,
            settings: t.settings.clone(),
            settings_json: serde_json::to_string(&t.settings).unwrap_or_else(|_| "{}".into()),
            overridable: t.overridable_settings.clone(),
            schema: None,
            limits: RenderLimits::from_config(t),
            sha256,
            outcome,
        })
    }

    /// Compiles a component, or loads it from the cache.
    pub fn compile(
        &self,
        bytes: &[u8],
        sha256: &str,
    ) -> Result<(Component, CacheOutcome), TemplateErrorKind> {
        if let Some(cache) = &self.cache {
            if let Some(c) = cache.load(&self.engine, sha256) {
                return Ok((c, CacheOutcome::Hit));
            }
            let c = Component::new(&self.engine, bytes)
                .map_err(|e| TemplateErrorKind::Compile(root_cause(&e)))?;
            return Ok((c, CacheOutcome::Miss));
        }
        let c = Component::new(&self.engine, bytes)
            .map_err(|e| TemplateErrorKind::Compile(root_cause(&e)))?;
        Ok((c, CacheOutcome::Disabled))
    }
}

/// The sha256 of `bytes`, checked against the configured digest when there is one.
fn verified_digest(bytes: &[u8], expected: Option<&str>) -> Result<String, TemplateErrorKind> {
    let actual = hex::encode(Sha256::digest(bytes));
    match expected {
        Some(e) if !e.eq_ignore_ascii_case(&actual) => Err(TemplateErrorKind::Sha256Mismatch {
            expected: e.to_string(),
            actual,
        }),
        _ => Ok(actual),
    }
}

/// Refuses a component with any import outside the sandbox, naming every one of them.
fn check_imports(engine: &Engine, component: &Component) -> Result<(), TemplateErrorKind> {
    let imports: Vec<String> = component
        .component_type()
        .imports(engine)
        .filter_map(|(name, _)| sandbox::check_import(name).err())
        .collect();
    if imports.is_empty() {
        Ok(())
    } else {
        Err(TemplateErrorKind::ForbiddenImport { imports })
    }
}

/// Checks that the component exports this kind's interface in a compatible version;
/// returns the interface's export name.
fn check_exports(
    engine: &Engine,
    component: &Component,
    kind: TemplateKind,
) -> Result<String, TemplateErrorKind> {
    let ours = format!("{}/{}@", bindings::PACKAGE, kind.interface());
    let other_kind = match kind {
        TemplateKind::Domain => TemplateKind::VendorData,
        TemplateKind::VendorData => TemplateKind::Domain,
    };
    let theirs = format!("{}/{}@", bindings::PACKAGE, other_kind.interface());
    let exports: Vec<String> = component
        .component_type()
        .exports(engine)
        .map(|(n, _)| n.to_string())
        .collect();
    if let Some(version) = exports.iter().find_map(|n| n.strip_prefix(&ours)) {
        return if compatible(version, bindings::PACKAGE_VERSION) {
            Ok(format!("{ours}{version}"))
        } else {
            Err(TemplateErrorKind::Abi(format!(
                "built for {}@{version}; this operator speaks {}@{}",
                bindings::PACKAGE,
                bindings::PACKAGE,
                bindings::PACKAGE_VERSION
            )))
        };
    }
    if exports.iter().any(|n| n.starts_with(&theirs)) {
        return Err(TemplateErrorKind::Abi(format!(
            "is a {} plugin but is configured as the {} plugin",
            other_kind.as_str(),
            kind.as_str()
        )));
    }
    Err(TemplateErrorKind::Abi(format!(
        "does not export {}{} (exports: {})",
        ours,
        bindings::PACKAGE_VERSION,
        if exports.is_empty() {
            "nothing".into()
        } else {
            exports.join(", ")
        }
    )))
}

/// The plugin's three functions, found once at load and called through typed functions
/// whose results are lifted by `bindings::capped` (the generated bindings would copy a
/// result of any size into host memory before a cap could refuse it).
#[derive(Debug, Clone)]
struct Exports {
    settings_schema: ComponentExportIndex,
    validate_settings: ComponentExportIndex,
    render: ComponentExportIndex,
}

impl Exports {
    fn find(component: &Component, interface: &str) -> Result<Self, TemplateErrorKind> {
        let missing = |what: &str| TemplateErrorKind::Abi(format!("does not export {what}"));
        let iface = component
            .get_export_index(None, interface)
            .ok_or_else(|| missing(interface))?;
        let func = |name: &str| {
            component
                .get_export_index(Some(&iface), name)
                .ok_or_else(|| missing(&format!("{interface}#{name}")))
        };
        Ok(Self {
            settings_schema: func("settings-schema")?,
            validate_settings: func("validate-settings")?,
            render: func("render")?,
        })
    }
}

/// Semver compatibility: same major, and for 0.x the same minor.
fn compatible(theirs: &str, ours: &str) -> bool {
    let parts = |v: &str| -> Option<(u64, u64)> {
        let mut it = v.split('.');
        Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
    };
    match (parts(theirs), parts(ours)) {
        (Some((0, a)), Some((0, b))) => a == b,
        (Some((a, _)), Some((b, _))) => a == b,
        _ => false,
    }
}

fn root_cause(e: &wasmtime::Error) -> String {
    let mut msg = e.root_cause().to_string();
    msg.truncate(512);
    msg
}

/// A component that passed the load checks, linked once.
struct Loaded {
    name: String,
    kind: TemplateKind,
    engine: Engine,
    pre: InstancePre<RenderState>,
    exports: Exports,
    /// The configured settings, and the same serialised (what renders without overrides
    /// get).
    settings: serde_json::Value,
    settings_json: String,
    /// Top-level keys a Proxy may override.
    overridable: Vec<String>,
    /// The plugin's settings schema, compiled once when the configured settings passed it;
    /// checks merged per-Proxy settings.
    schema: Option<schema::Compiled>,
    limits: RenderLimits,
    sha256: String,
    outcome: CacheOutcome,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("name", &self.name)
            .field("sha256", &self.sha256)
            .field("limits", &self.limits)
            .field("outcome", &self.outcome)
            .finish_non_exhaustive()
    }
}

impl Loaded {
    fn abi_error(&self, e: wasmtime::Error) -> TemplateError {
        self.error(TemplateErrorKind::Abi(format!(
            "does not match the interface: {}",
            root_cause(&e)
        )))
    }

    fn error(&self, kind: TemplateErrorKind) -> TemplateError {
        TemplateError {
            plugin: self.name.clone(),
            kind,
        }
    }

    /// A fresh store with this plugin's limits.
    fn store(&self, timeout: Duration) -> Result<Store<RenderState>, TemplateError> {
        let mut store = Store::new(&self.engine, RenderState::new(self.limits.memory_bytes));
        store.limiter(|s| s);
        store.set_max_component_handles(sandbox::MAX_COMPONENT_HANDLES);
        store.set_hostcall_fuel(sandbox::HOSTCALL_FUEL);
        store
            .set_fuel(self.limits.fuel)
            .map_err(|e| self.error(TemplateErrorKind::Engine(e.to_string())))?;
        let ticks = timeout.as_millis().div_ceil(EPOCH_TICK.as_millis()).max(1);
        store.set_epoch_deadline(u64::try_from(ticks).unwrap_or(u64::MAX));
        store.epoch_deadline_trap();
        Ok(store)
    }

    /// Runs one call in a fresh store, mapping traps and limits to their reasons and
    /// logging what the plugin printed.
    fn call<T>(
        &self,
        timeout: Duration,
        f: impl FnOnce(&mut Store<RenderState>) -> wasmtime::Result<T>,
    ) -> Result<T, TemplateError> {
        let mut store = self.store(timeout)?;
        let result = f(&mut store);
        let log = store.data().log_text();
        if !log.is_empty() {
            tracing::info!(plugin = %self.name, output = %log, "template plugin output");
        }
        result.map_err(|e| self.error(classify_failure(&e, store.data_mut())))
    }

    /// `settings-schema`, in a new instance in `store`; the text is copied only when it is
    /// at most [`schema::SCHEMA_MAX_BYTES`].
    fn call_settings_schema(
        &self,
        store: &mut Store<RenderState>,
    ) -> wasmtime::Result<Capped<{ schema::SCHEMA_MAX_BYTES }>> {
        let inst = self.pre.instantiate(&mut *store)?;
        let f = inst.get_typed_func::<(), (Capped<{ schema::SCHEMA_MAX_BYTES }>,)>(
            &mut *store,
            &self.exports.settings_schema,
        )?;
        Ok(f.call(&mut *store, ())?.0)
    }

    /// `validate-settings`, in a new instance in `store`; at most
    /// [`MAX_SETTINGS_ISSUES`] issues are copied, each text within
    /// [`ISSUE_TEXT_LIFT_MAX`].
    fn call_validate_settings(
        &self,
        store: &mut Store<RenderState>,
        settings: &str,
    ) -> wasmtime::Result<Result<(), PluginIssues>> {
        let inst = self.pre.instantiate(&mut *store)?;
        let f = inst.get_typed_func::<(&str,), (Result<(), PluginIssues>,)>(
            &mut *store,
            &self.exports.validate_settings,
        )?;
        Ok(f.call(&mut *store, (settings,))?.0)
    }

    /// Runs the plugin's `settings-schema` and `validate-settings` (in one fresh store)
    /// and checks the configured settings against both. Returns the compiled schema, kept
    /// for checking per-Proxy settings.
    fn validate_settings(&self) -> Result<schema::Compiled, TemplateError> {
        let (schema, own) = self.call(LOAD_CALL_TIMEOUT, |store| {
            let schema = self.call_settings_schema(store)?;
            if let Capped::Over { .. } = schema {
                return Ok((schema, Ok(())));
            }
            let own = self.call_validate_settings(store, &self.settings_json)?;
            Ok((schema, own))
        })?;
        self.check_settings(schema, own)
    }

    /// Runs a render of `input` (in a fresh store, within the plugin's deadline) and
    /// applies the output `check`. The output is copied out of the plugin only when it is
    /// at most `MAX` bytes, an error message only within [`REFUSAL_MAX`].
    fn render_via<I: Lower, const MAX: usize>(
        &self,
        input: &I,
        check: impl FnOnce(&str) -> Result<(), TemplateErrorKind>,
    ) -> Result<String, TemplateError> {
        let out = self.call(self.limits.timeout, |store| {
            let inst = self.pre.instantiate(&mut *store)?;
            let f = inst
                .get_typed_func::<(&I,), (RenderResult<MAX>,)>(&mut *store, &self.exports.render)?;
            Ok(f.call(&mut *store, (input,))?.0)
        })?;
        let text = match out {
            Ok(Capped::Text(text)) => text,
            Ok(Capped::Over { len }) => {
                return Err(self.error(TemplateErrorKind::OutputTooLarge {
                    size: len,
                    max: MAX,
                }));
            }
            Err(Capped::Text(m)) => {
                return Err(self.error(TemplateErrorKind::Refused(truncate(m))));
            }
            Err(Capped::Over { len }) => {
                return Err(self.error(TemplateErrorKind::RefusalTooLarge {
                    size: len,
                    max: REFUSAL_MAX,
                }));
            }
        };
        check(&text).map_err(|k| self.error(k))?;
        Ok(text)
    }

    /// Checks and compiles the plugin's schema (see [`schema`]) and checks the configured
    /// settings against it and against the plugin's own verdict.
    fn check_settings(
        &self,
        schema: Capped<{ schema::SCHEMA_MAX_BYTES }>,
        own: Result<(), PluginIssues>,
    ) -> Result<schema::Compiled, TemplateError> {
        let schema = schema
            .into_result()
            .map_err(|len| self.error(schema::too_large(len)))?;
        let validator = schema::compile(&schema).map_err(|k| self.error(k))?;
        let settings: serde_json::Value =
            serde_json::from_str(&self.settings_json).unwrap_or(serde_json::Value::Null);
        let (mut issues, mut total, took) =
            schema::evaluate(&validator, &settings, MAX_SETTINGS_ISSUES);
        if took > schema::SCHEMA_EVALUATION_BUDGET {
            return Err(self.error(schema::too_slow(took)));
        }
        // Only a document that fits the schema is held to the plugin's own checks.
        if issues.is_empty()
            && let Err(errors) = own
        {
            total = errors.total;
            issues = plugin_issues(errors.items);
        }
        if issues.is_empty() {
            Ok(validator)
        } else {
            Err(self.error(TemplateErrorKind::Settings {
                issues: keep_issues(issues, total),
            }))
        }
    }

    /// The settings JSON a render with these per-Proxy overrides gets: the configured
    /// settings when there are none (no extra work), else the configured settings with each
    /// override replacing its top-level key, after the merged document passed the compiled
    /// schema and then the plugin's `validate-settings` (through `validate`, in a fresh
    /// store). A refusal names the Proxy fields (`spec.templateSettings.<kind>.<key>`).
    fn settings_for(
        &self,
        overrides: Option<&SettingsOverrides>,
        validate: impl FnOnce(
            &mut Store<RenderState>,
            &str,
        ) -> wasmtime::Result<Result<(), PluginIssues>>,
    ) -> Result<String, TemplateError> {
        let Some(overrides) = overrides.filter(|o| !o.is_empty()) else {
            return Ok(self.settings_json.clone());
        };
        let field = self.kind.field();
        let refuse =
            |issues: Vec<OverrideIssue>| self.error(TemplateErrorKind::Overrides { issues });
        let at = |key: Option<&str>| crate::api::proxy::override_path(field, key);

        // Checked when the Proxy was loaded too; checked again here, so no code path can
        // hand the plugin a key the config does not allow.
        let refused: Vec<OverrideIssue> = overrides
            .keys()
            .filter(|k| !self.overridable.iter().any(|a| a == *k))
            .map(|k| OverrideIssue {
                path: at(Some(k)),
                message: format!(
                    "is not overridable: kvm2.templates.{field}.overridableSettings does not list it"
                ),
            })
            .collect();
        if !refused.is_empty() {
            return Err(refuse(refused));
        }
        let serde_json::Value::Object(configured) = &self.settings else {
            return Err(refuse(vec![OverrideIssue {
                path: at(None),
                message: format!(
                    "cannot be merged: kvm2.templates.{field}.settings is not a mapping"
                ),
            }]));
        };
        let mut merged = configured.clone();
        for (k, v) in overrides {
            merged.insert(k.clone(), v.clone());
        }
        let merged = serde_json::Value::Object(merged);
        let text = serde_json::to_string(&merged)
            .map_err(|e| self.error(TemplateErrorKind::Engine(e.to_string())))?;
        let max = crate::config::validate::limits::TEMPLATE_SETTINGS_BYTES;
        if text.len() > max {
            return Err(refuse(vec![OverrideIssue {
                path: at(None),
                message: format!(
                    "makes the merged settings {} bytes serialised, at most {max} allowed",
                    text.len()
                ),
            }]));
        }
        let schema = self.schema.as_ref().ok_or_else(|| {
            self.error(TemplateErrorKind::Engine(
                "the settings schema was not compiled at load".into(),
            ))
        })?;
        let (mut issues, mut total, _) = schema::evaluate(schema, &merged, MAX_SETTINGS_ISSUES);
        // Only a document that fits the schema is handed to the plugin's own checks.
        if issues.is_empty()
            && let Err(errors) = self.call(self.limits.timeout, |store| validate(store, &text))?
        {
            total = errors.total;
            issues = plugin_issues(errors.items);
        }
        if issues.is_empty() {
            Ok(text)
        } else {
            Err(refuse(override_issues(
                field,
                overrides,
                keep_issues(issues, total),
            )))
        }
    }
}

/// The issues a plugin's `validate-settings` returned, as lifted: a pointer or message
/// over [`ISSUE_TEXT_LIFT_MAX`] was not copied and is replaced by a note of its length.
fn plugin_issues(items: Vec<bindings::capped::Issue>) -> Vec<SettingsIssue> {
    let text = |c: Capped<ISSUE_TEXT_LIFT_MAX>, what: &str| {
        c.into_result().unwrap_or_else(|len| {
            format!("<a {what} of {len} bytes, over the {ISSUE_TEXT_LIFT_MAX}-byte cap, not read>")
        })
    };
    items
        .into_iter()
        .map(|i| SettingsIssue {
            pointer: text(i.pointer, "pointer"),
            message: text(i.message, "message"),
        })
        .collect()
}

/// What a refusal keeps of `total` settings issues (of which `issues` are the first): each
/// pointer and message cut short, as many as fit [`ISSUES_TEXT_KEPT`] (at least one), and
/// how many more there were, noted on the last one.
fn keep_issues(issues: Vec<SettingsIssue>, total: usize) -> Vec<SettingsIssue> {
    let mut kept: Vec<SettingsIssue> = Vec::new();
    let mut bytes = 0usize;
    for issue in issues.into_iter().take(MAX_SETTINGS_ISSUES) {
        let issue = SettingsIssue {
            pointer: cut(issue.pointer, ISSUE_POINTER_KEPT),
            message: cut(issue.message, ISSUE_MESSAGE_KEPT),
        };
        bytes += issue.pointer.len() + issue.message.len();
        if bytes > ISSUES_TEXT_KEPT && !kept.is_empty() {
            break;
        }
        kept.push(issue);
    }
    let more = total.saturating_sub(kept.len());
    if more > 0
        && let Some(last) = kept.last_mut()
    {
        last.message.push_str(&format!(" (and {more} more)"));
    }
    kept
}

/// Maps issues in the merged settings (JSON pointers) to the Proxy's fields: an issue under
/// an overridden key names `spec.templateSettings.<field>.<key>...`; one elsewhere (a rule
/// across keys) names `spec.templateSettings.<field>` and where in the merged settings it
/// is. The issues were already cut short and counted by [`keep_issues`].
fn override_issues(
    field: &str,
    overrides: &SettingsOverrides,
    issues: Vec<SettingsIssue>,
) -> Vec<OverrideIssue> {
    issues
        .into_iter()
        .map(|issue| {
            let segments: Vec<String> = issue
                .pointer
                .split('/')
                .skip(1)
                .map(|s| s.replace("~1", "/").replace("~0", "~"))
                .collect();
            let path = match segments.split_first() {
                Some((key, rest)) if overrides.contains_key(key) => {
                    let mut path = crate::api::proxy::override_path(field, Some(key));
                    for s in rest {
                        if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
                            path.push_str(&format!("[{s}]"));
                        } else if crate::config::validate::settings_key(s).is_ok() {
                            path.push('.');
                            path.push_str(s);
                        } else {
                            path.push_str(&format!("[{}]", crate::validation::show(s)));
                        }
                    }
                    path
                }
                _ => format!(
                    "{} (merged settings at {})",
                    crate::api::proxy::override_path(field, None),
                    crate::validation::show(if issue.pointer.is_empty() {
                        "/"
                    } else {
                        &issue.pointer
                    })
                ),
            };
            OverrideIssue {
                path,
                message: issue.message,
            }
        })
        .collect()
}

fn classify_failure(e: &wasmtime::Error, state: &mut RenderState) -> TemplateErrorKind {
    if state.memory_cap.hit {
        return TemplateErrorKind::Limit {
            limit: Limit::Memory,
        };
    }
    if let Some(exit) = e.downcast_ref::<wasmtime_wasi::I32Exit>() {
        return TemplateErrorKind::Exit(exit.0);
    }
    match e.downcast_ref::<Trap>() {
        Some(Trap::OutOfFuel) => return TemplateErrorKind::Limit { limit: Limit::Fuel },
        Some(Trap::Interrupt) => {
            return TemplateErrorKind::Limit {
                limit: Limit::Timeout,
            };
        }
        _ => {}
    }
    // The WASI resource table refuses entries past `sandbox::MAX_RESOURCES`; wasmtime's
    // component handle table past `sandbox::MAX_COMPONENT_HANDLES` (an error it only
    // describes in text). Either way the plugin held too much at once.
    let table_full = e.chain().any(|c| {
        matches!(
            c.downcast_ref::<wasmtime::component::ResourceTableError>(),
            Some(wasmtime::component::ResourceTableError::Full)
        )
    });
    if table_full || state.resources_full() || root_cause(e).contains("store handle limit exceeded")
    {
        return TemplateErrorKind::Limit {
            limit: Limit::Resources,
        };
    }
    // A full log closes stdout/stderr; Rust's `println!` then panics. Report the cause,
    // not the panic it led to.
    if state.log_is_full() {
        return TemplateErrorKind::Limit { limit: Limit::Log };
    }
    TemplateErrorKind::Trap(root_cause(e))
}

/// A loaded, validated domain plugin.
pub struct DomainTemplate {
    loaded: Loaded,
}

/// A loaded, validated vendor-data plugin.
pub struct VendorDataTemplate {
    loaded: Loaded,
}

impl std::fmt::Debug for DomainTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.loaded.fmt(f)
    }
}

impl std::fmt::Debug for VendorDataTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.loaded.fmt(f)
    }
}

impl Loaded {
    /// The plugin's settings JSON Schema text (at most [`schema::SCHEMA_MAX_BYTES`]).
    fn settings_schema(&self) -> Result<String, TemplateError> {
        self.call(LOAD_CALL_TIMEOUT, |store| self.call_settings_schema(store))?
            .into_result()
            .map_err(|len| self.error(schema::too_large(len)))
    }
}

impl DomainTemplate {
    /// The plugin's name in logs and errors (`domain:<source>`).
    pub fn name(&self) -> &str {
        &self.loaded.name
    }
    /// sha256 of the component.
    pub fn sha256(&self) -> &str {
        &self.loaded.sha256
    }
    /// Whether the compiled code came from the cache.
    pub fn cache_outcome(&self) -> CacheOutcome {
        self.loaded.outcome
    }

    /// The plugin's settings JSON Schema.
    pub fn settings_schema(&self) -> Result<String, TemplateError> {
        self.loaded.settings_schema()
    }

    /// Renders and checks domain XML. `input.settings` is replaced by the configured
    /// settings.
    pub fn render(&self, input: &DomainInput) -> Result<String, TemplateError> {
        self.render_with(input, None)
    }

    /// [`Self::render`] with a Proxy's settings overrides
    /// (`spec.templateSettings.domain`) merged over the configured settings. The merged
    /// settings are checked against the plugin's schema and `validate-settings` first;
    /// without overrides this is exactly [`Self::render`].
    pub fn render_with(
        &self,
        input: &DomainInput,
        overrides: Option<&SettingsOverrides>,
    ) -> Result<String, TemplateError> {
        self.render_on(input, overrides, &check::HostPolicy::default())
    }

    /// [`Self::render_with`], checked against the policy of the host the domain is for
    /// (its bridge MTU, CPU placement and NVRAM templates) instead of the strictest one.
    pub fn render_on(
        &self,
        input: &DomainInput,
        overrides: Option<&SettingsOverrides>,
        policy: &check::HostPolicy,
    ) -> Result<String, TemplateError> {
        let settings = self.merged_settings(overrides)?;
        let mut input = input.clone();
        input.settings = settings;
        self.loaded
            .render_via::<_, { check::DOMAIN_XML_MAX }>(&input, |xml| {
                check::check_domain_xml_on(xml, &input, policy)
            })
    }

    /// Checks a Proxy's overrides the way a render would, without rendering: lets a
    /// Create refuse a bad value before it downloads an image or makes a volume.
    pub fn check_overrides(
        &self,
        overrides: Option<&SettingsOverrides>,
    ) -> Result<(), TemplateError> {
        self.merged_settings(overrides).map(|_| ())
    }

    fn merged_settings(
        &self,
        overrides: Option<&SettingsOverrides>,
    ) -> Result<String, TemplateError> {
        self.loaded.settings_for(overrides, |store, settings| {
            self.loaded.call_validate_settings(store, settings)
        })
    }
}

impl VendorDataTemplate {
    /// The plugin's name in logs and errors (`vendor-data:<source>`).
    pub fn name(&self) -> &str {
        &self.loaded.name
    }
    /// sha256 of the component.
    pub fn sha256(&self) -> &str {
        &self.loaded.sha256
    }
    /// Whether the compiled code came from the cache.
    pub fn cache_outcome(&self) -> CacheOutcome {
        self.loaded.outcome
    }

    /// The plugin's settings JSON Schema.
    pub fn settings_schema(&self) -> Result<String, TemplateError> {
        self.loaded.settings_schema()
    }

    /// Renders and checks vendor-data. `input.settings` is replaced by the configured
    /// settings.
    pub fn render(&self, input: &VendorDataInput) -> Result<String, TemplateError> {
        self.render_with(input, None)
    }

    /// [`Self::render`] with a Proxy's settings overrides
    /// (`spec.templateSettings.vendorData`) merged over the configured settings. The
    /// merged settings are checked against the plugin's schema and `validate-settings`
    /// first; without overrides this is exactly [`Self::render`].
    pub fn render_with(
        &self,
        input: &VendorDataInput,
        overrides: Option<&SettingsOverrides>,
    ) -> Result<String, TemplateError> {
        let settings = self.merged_settings(overrides)?;
        let mut input = input.clone();
        input.settings = settings;
        self.loaded
            .render_via::<_, { check::VENDOR_DATA_MAX }>(&input, check::check_vendor_data)
    }

    /// Checks a Proxy's overrides the way a render would, without rendering (see
    /// [`DomainTemplate::check_overrides`]).
    pub fn check_overrides(
        &self,
        overrides: Option<&SettingsOverrides>,
    ) -> Result<(), TemplateError> {
        self.merged_settings(overrides).map(|_| ())
    }

    fn merged_settings(
        &self,
        overrides: Option<&SettingsOverrides>,
    ) -> Result<String, TemplateError> {
        self.loaded.settings_for(overrides, |store, settings| {
            self.loaded.call_validate_settings(store, settings)
        })
    }
}

/// Cuts a plugin-supplied message to a length that fits a log line and a condition.
fn truncate(s: String) -> String {
    cut(s, 1024)
}

/// Cuts `s` to at most `max` bytes (on a character boundary), marking the cut with `…`.
fn cut(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn semver_compatibility() {
        assert!(compatible("0.1.0", "0.1.0"));
        assert!(compatible("0.1.7", "0.1.0"));
        assert!(!compatible("0.2.0", "0.1.0"));
        assert!(compatible("1.4.0", "1.0.0"));
        assert!(!compatible("2.0.0", "1.0.0"));
        assert!(!compatible("x", "0.1.0"));
    }

    #[test]
    fn truncate_keeps_char_boundaries() {
        let s = "é".repeat(2000);
        let t = truncate(s);
        assert!(t.len() <= 1024 + '…'.len_utf8());
        assert!(t.ends_with('…'));
    }
}
