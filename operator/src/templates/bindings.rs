//! Host bindings generated from `templates-sdk/wit`, the one source of the plugin ABI.
//!
//! Kept private to the templates module: the rest of the operator sees only the input
//! types re-exported from [`super`], never wasmtime's generated plumbing.

/// The `domain` world; it owns the shared `types` interface.
pub(crate) mod domain {
    wasmtime::component::bindgen!({
        path: "../templates-sdk/wit",
        world: "domain",
    });
}

/// The `vendor-data` world, reusing the `types` generated for the domain world so both
/// worlds take the same Rust types.
pub(crate) mod vendor_data {
    wasmtime::component::bindgen!({
        path: "../templates-sdk/wit",
        world: "vendor-data",
        with: {
            "egress:templates/types": super::domain::egress::templates::types,
        },
    });
}

pub use domain::egress::templates::types;

/// Name of the WIT package, without version.
pub const PACKAGE: &str = "egress:templates";
/// Version of the WIT package this operator was built against.
pub const PACKAGE_VERSION: &str = "0.1.0";
