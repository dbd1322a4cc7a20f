//! The sandbox every render runs in: what a plugin may import, and the per-render store.
//!
//! Plugins are `wasm32-wasip2` components. Rust's standard library for that target imports
//! `wasi:cli/{environment,exit,stdin,stdout,stderr,terminal-*}` and
//! `wasi:io/{error,poll,streams}` even when the plugin uses none of them, so the sandbox
//! provides exactly those with nothing behind them: no environment variables or arguments,
//! an empty stdin, stdout/stderr captured into a capped buffer that the operator logs
//! under the plugin's name, and `exit` as a failed render. Every other import
//! (filesystem, sockets, clocks, random, http, ...) is refused when the component loads,
//! naming the import, so a render has no source of nondeterminism and no way out.

use wasmtime::component::{HasData, Linker, ResourceTable};
use wasmtime::{Engine, StoreLimits, StoreLimitsBuilder};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::bindings::PACKAGE;

/// WASI interfaces the sandbox provides, by name without version. Any 0.2.x version
/// links (wasmtime matches semver-compatible imports).
pub const ALLOWED_WASI: &[&str] = &[
    "wasi:cli/environment",
    "wasi:cli/exit",
    "wasi:cli/stdin",
    "wasi:cli/stdout",
    "wasi:cli/stderr",
    "wasi:cli/terminal-input",
    "wasi:cli/terminal-output",
    "wasi:cli/terminal-stdin",
    "wasi:cli/terminal-stdout",
    "wasi:cli/terminal-stderr",
    "wasi:io/error",
    "wasi:io/poll",
    "wasi:io/streams",
];

/// Captured stdout plus stderr per render: enough for a debug message, small enough that
/// a chatty plugin cannot use the operator's memory. Once full, the streams are closed and
/// the render fails with a clear reason (plugin authors are told to keep logs short).
pub const LOG_CAPACITY: usize = 16 * 1024;
/// A plugin is one component instance with a handful of tables; these caps stop a
/// component from allocating its way around the memory cap with tables or instances.
const MAX_INSTANCES: usize = 16;
const MAX_TABLES: usize = 16;
const MAX_TABLE_ELEMENTS: usize = 100_000;
const MAX_MEMORIES: usize = 4;
/// Most entries the store's WASI resource table holds at once (streams, pollables, errors).
/// Every `get-stdout` or `subscribe` a plugin makes is a host-side entry until the plugin
/// drops it; without a cap a plugin that never drops them grows the operator's memory
/// (wasmtime's default is a million entries) within its time budget. Rust's standard
/// library holds a handful at a time; a call that needs more fails with a `Limit` reason.
/// wasmtime's `ResourceTable::set_max_capacity` enforces it in the table itself, so every
/// WASI host function (ours are wasmtime-wasi's) is covered without wrapping them.
pub const MAX_RESOURCES: usize = 256;
/// Most component-model handles live in one store at once. Each WASI resource a plugin
/// holds is also a handle; resources a component defines itself (`resource.new`) are only
/// handles, with no host function in the loop, so this is their cap (wasmtime's default is
/// 100,000). Above [`MAX_RESOURCES`], so WASI resources hit their own, clearer cap first.
pub const MAX_COMPONENT_HANDLES: usize = 2 * MAX_RESOURCES;
/// Most bytes wasmtime copies from a plugin into host memory in one lift: the arguments of
/// one WASI call (a `write` carries at most 4 KiB by the WASI contract), or one call's
/// result (which the host keeps within the output caps before copying, see `bindings`).
/// wasmtime's default is 128 MiB; this must stay above the largest accepted output
/// ([`super::check::VENDOR_DATA_MAX`]) and schema ([`super::schema::SCHEMA_MAX_BYTES`]).
pub const HOSTCALL_FUEL: usize = 1024 * 1024;
// The largest lift of one call must fit the hostcall fuel: an output, a refusal, a schema,
// or the kept `validate-settings` issues (16-byte records plus both texts).
const _: () = assert!(HOSTCALL_FUEL >= super::check::VENDOR_DATA_MAX);
const _: () = assert!(HOSTCALL_FUEL >= super::check::DOMAIN_XML_MAX);
const _: () = assert!(HOSTCALL_FUEL >= super::REFUSAL_MAX);
const _: () = assert!(HOSTCALL_FUEL >= super::schema::SCHEMA_MAX_BYTES);
const _: () =
    assert!(HOSTCALL_FUEL >= super::MAX_SETTINGS_ISSUES * (16 + 2 * super::ISSUE_TEXT_LIFT_MAX));

/// Whether a component import is allowed; returns it back when it is not.
pub fn check_import(name: &str) -> Result<(), String> {
    let (base, version) = match name.split_once('@') {
        Some((b, v)) => (b, Some(v)),
        None => (name, None),
    };
    if ALLOWED_WASI.contains(&base) && version.is_some_and(|v| v.starts_with("0.2.")) {
        return Ok(());
    }
    // Our own package's type-only interface is imported by components that use its types.
    if base == format!("{PACKAGE}/types") {
        return Ok(());
    }
    Err(name.to_string())
}

/// Data of one render's store: the stub WASI context, its resource table, and limits.
pub struct RenderState {
    wasi: WasiCtx,
    table: ResourceTable,
    pub(crate) limits: StoreLimits,
    pub(crate) memory_cap: super::MemoryCap,
    pub(crate) log: MemoryOutputPipe,
}

impl std::fmt::Debug for RenderState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RenderState").finish_non_exhaustive()
    }
}

impl RenderState {
    /// A fresh state: nothing inherited from the host process.
    pub fn new(memory_bytes: usize) -> Self {
        let log = MemoryOutputPipe::new(LOG_CAPACITY);
        let wasi = WasiCtx::builder()
            .stdin(wasmtime_wasi::p2::pipe::ClosedInputStream)
            .stdout(log.clone())
            .stderr(log.clone())
            .build();
        // Memory is capped by our own limiter (see `MemoryCap`), which records the hit;
        // these cover everything else.
        let limits = StoreLimitsBuilder::new()
            .instances(MAX_INSTANCES)
            .tables(MAX_TABLES)
            .table_elements(MAX_TABLE_ELEMENTS)
            .memories(MAX_MEMORIES)
            .trap_on_grow_failure(true)
            .build();
        let mut table = ResourceTable::new();
        table.set_max_capacity(MAX_RESOURCES);
        Self {
            wasi,
            table,
            limits,
            memory_cap: super::MemoryCap {
                max_bytes: memory_bytes,
                hit: false,
            },
            log,
        }
    }

    /// Whether the WASI resource table is at [`MAX_RESOURCES`] with no free entry, so the
    /// next resource would be refused.
    pub fn resources_full(&mut self) -> bool {
        match self.table.push(()) {
            Ok(probe) => {
                let _ = self.table.delete(probe);
                false
            }
            Err(_) => true,
        }
    }

    /// Whether stdout/stderr reached [`LOG_CAPACITY`] (further writes were refused).
    pub fn log_is_full(&self) -> bool {
        self.log.contents().len() >= LOG_CAPACITY
    }

    /// What the plugin wrote to stdout and stderr, lossily decoded.
    pub fn log_text(&self) -> String {
        String::from_utf8_lossy(&self.log.contents()).into_owned()
    }
}

impl WasiView for RenderState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

struct HasIo;

impl HasData for HasIo {
    type Data<'a> = &'a mut ResourceTable;
}

/// A linker with exactly the allowed WASI interfaces and nothing else.
pub fn linker(engine: &Engine) -> wasmtime::Result<Linker<RenderState>> {
    use wasmtime_wasi::cli::{WasiCli, WasiCliView};
    use wasmtime_wasi::p2::bindings::{cli, sync};

    let mut l = Linker::<RenderState>::new(engine);
    wasmtime_wasi_io::bindings::wasi::io::error::add_to_linker::<RenderState, HasIo>(
        &mut l,
        |t| &mut t.table,
    )?;
    sync::io::poll::add_to_linker::<RenderState, HasIo>(&mut l, |t| &mut t.table)?;
    sync::io::streams::add_to_linker::<RenderState, HasIo>(&mut l, |t| &mut t.table)?;
    cli::exit::add_to_linker::<RenderState, WasiCli>(&mut l, RenderState::cli)?;
    cli::environment::add_to_linker::<RenderState, WasiCli>(&mut l, RenderState::cli)?;
    cli::stdin::add_to_linker::<RenderState, WasiCli>(&mut l, RenderState::cli)?;
    cli::stdout::add_to_linker::<RenderState, WasiCli>(&mut l, RenderState::cli)?;
    cli::stderr::add_to_linker::<RenderState, WasiCli>(&mut l, RenderState::cli)?;
    cli::terminal_input::add_to_linker::<RenderState, WasiCli>(&mut l, RenderState::cli)?;
    cli::terminal_output::add_to_linker::<RenderState, WasiCli>(&mut l, RenderState::cli)?;
    cli::terminal_stdin::add_to_linker::<RenderState, WasiCli>(&mut l, RenderState::cli)?;
    cli::terminal_stdout::add_to_linker::<RenderState, WasiCli>(&mut l, RenderState::cli)?;
    cli::terminal_stderr::add_to_linker::<RenderState, WasiCli>(&mut l, RenderState::cli)?;
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn import_allowlist() {
        for ok in [
            "wasi:cli/environment@0.2.0",
            "wasi:io/streams@0.2.6",
            "wasi:cli/terminal-stderr@0.2.3",
            "egress:templates/types@0.2.0",
        ] {
            assert_eq!(check_import(ok), Ok(()), "{ok}");
        }
        for bad in [
            "wasi:filesystem/types@0.2.0",
            "wasi:filesystem/preopens@0.2.6",
            "wasi:sockets/tcp@0.2.0",
            "wasi:clocks/wall-clock@0.2.0",
            "wasi:random/random@0.2.0",
            "wasi:random/insecure-seed@0.2.0",
            "wasi:http/outgoing-handler@0.2.0",
            "wasi:cli/environment@0.3.0",
            "wasi:cli/environment",
            "host:evil/spawn",
        ] {
            assert_eq!(check_import(bad), Err(bad.to_string()), "{bad}");
        }
    }
}
