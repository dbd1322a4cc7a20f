//! SDK for egress-operator template plugins.
//!
//! A template plugin is a WebAssembly component that renders one part of a proxy VM: its
//! libvirt **domain** XML or its cloud-init **vendor-data**. The operator runs it in a
//! sandbox (no filesystem, network, environment, clock or randomness; fuel, a deadline, a
//! memory cap and an output cap), validates its settings against the JSON Schema the plugin
//! exports, and checks its output before libvirt sees it.
//!
//! Writing a plugin takes four things:
//!
//! 1. a settings type deriving `serde::Deserialize` and `schemars::JsonSchema` (give every
//!    field a default so `{}` is valid; the schema and the parser come from this one type);
//! 2. an implementation of [`DomainPlugin`] or [`VendorDataPlugin`];
//! 3. one [`export_domain_plugin!`] or [`export_vendor_data_plugin!`] line;
//! 4. a `cdylib` crate built with `cargo build --target wasm32-wasip2 --release`, depending
//!    on this SDK with `default-features = false, features = ["domain"]` (or
//!    `"vendor-data"`), so only that world's bindings are linked in.
//!
//! The interface itself is the WIT package `egress:templates@0.2.0` in this crate's `wit/`
//! folder; the operator refuses components built for another version.
//!
//! # What the output may contain
//!
//! The operator reads domain XML exactly as libvirt does, or refuses it: no namespaces
//! outside `<metadata>`, no CDATA, no comments or child elements inside text, no
//! repeated singletons, UTF-8 only. Every element and attribute must be on the
//! [allow-list](rules), and the document must match its input: the given name, UUID,
//! memory and vCPUs, only the prepared volumes (each once, `<driver type>` equal to its
//! format, the seed `<readonly/>`), NICs only on the given bridge with the primary NIC on
//! the given MAC and no MAC on the others, firmware files from [the lists](rules#firmware), the
//! operator's mark unchanged as the one element of its namespace in `<metadata>`. The
//! same checks run again on libvirt's own reading of the defined domain before it starts.
//! Vendor-data is read as the guest's cloud-init reads it, or refused: either a document
//! whose first line is exactly `#cloud-config` (UTF-8 YAML), or a `multipart/mixed`
//! document with `MIME-Version: 1.0`, one-line headers from Content-Type, MIME-Version,
//! Content-Transfer-Encoding (`7bit`/`8bit`) and Content-Disposition
//! (`attachment; filename="..."`), exact `--boundary` lines, nothing before the first or
//! after the close delimiter, and 1 to 16 ASCII parts: `text/x-shellscript` (starting with
//! `#!`, with a unique file name of `A-Z a-z 0-9 . _ -`) or `text/cloud-config`. No CR
//! and no control character but `\n` and `\t`. The YAML: a mapping (or empty), no tags, no `<<`
//! merge keys, no duplicate keys, keys that are strings in YAML 1.1 too, and top-level
//! keys of `[a-z_][a-z0-9_]*`.
//!
//! # Limits a plugin lives within
//!
//! - Output: domain XML at most 256 KiB, vendor-data at most 512 KiB, a refusal message
//!   at most 4 KiB; the operator reads the declared length first and copies nothing
//!   longer.
//! - `validate-settings`: the first 16 issues are read, each pointer and message at most
//!   4 KiB; reports keep 256 bytes of a message and 128 of a pointer.
//! - `settings-schema`: at most 256 KiB and 32 levels deep; only local references
//!   (`#/...`) that exist, no cycles, at most 256 of them and 2,000 nodes with every
//!   reference expanded; at most 64 `pattern`s of at most 1 KiB, each compiled by a
//!   linear-time engine, so no look-around or back-references. A schema outside these is
//!   refused when the plugin loads. A schema derived with `schemars` from a plain settings
//!   type is far inside them.
//! - Per call: fuel, the configured deadline and memory cap, at most 256 WASI resource
//!   handles and 512 component handles alive, 16 KiB of stdout/stderr.
//!
//! # Determinism and the sandbox
//!
//! Plugins are built for `wasm32-wasip2`, whose standard library imports a few WASI
//! interfaces even when nothing uses them. The operator provides exactly those with nothing
//! behind them: empty environment and arguments, empty stdin, stdout and stderr captured
//! (capped) and logged under the plugin's name, and `exit` as a failed render. Any other
//! import (filesystem, sockets, clocks, random, http) makes the operator refuse the
//! component at load, naming the import. So: no `std::fs`, no `SystemTime`, and no
//! `HashMap` with the default hasher (its random seed is an import); use `BTreeMap`.
//! A render is then a pure function of its input, and the same input always gives
//! byte-identical output.
//!
//! # A complete plugin
//!
//! A domain plugin with BIOS or UEFI, the prepared root disk and seed, a NIC with the
//! given MAC on the given bridge, and a setting of its own. It is the crate
//! `plugins/sdk-example` verbatim: `make plugins` builds it into a component and a test
//! renders it through the operator's checks, so this example always passes them. Its
//! `Cargo.toml` depends on `templates-sdk` (feature `domain`), `serde` and `schemars`,
//! with `crate-type = ["cdylib"]`.
//!

#![doc = concat!(
    "```\n",
    include_str!("../../plugins/sdk-example/src/lib.rs"),
    r##"
# fn main() {
# use templates_sdk::domain::{Disk, DiskBus, HostFacts};
# let disk = |volume: &str, role| Disk { pool: "default".into(), volume: volume.into(), role,
#     bus: DiskBus::Virtio, format: if role == DiskRole::Root { "qcow2" } else { "raw" }.into() };
# let input = DomainInput {
#     name: "p-1".into(), uuid: "8d2c0f9e-3b1a-4c55-9e0e-2f3a4b5c6d7e".into(), vcpus: 1,
#     memory_mib: 512, firmware: Firmware::Efi,
#     disks: vec![disk("p-1-seed", DiskRole::Seed), disk("p-1-root", DiskRole::Root)],
#     bridge: "br0".into(), mac: Some("52:54:00:12:34:56".into()), metadata_mark: "<m/>".into(),
#     host: HostFacts { name: "h".into(), arch: "x86_64".into(), kvm: false,
#         libvirt_version: "9.0.0".into(), cpus: 2, numa_nodes: 1 },
#     settings: "{}".into(),
# };
// The operator calls these through the component; here we call them directly.
let xml = templates_sdk::__private::render_domain::<Example>(&input).unwrap();
assert!(xml.starts_with("<domain type=\"qemu\"><name>p-1</name>"));
assert!(xml.contains("<os firmware=\"efi\">"));
assert!(xml.contains("<mac address=\"52:54:00:12:34:56\"/>"));
let bad = templates_sdk::__private::validate::<Settings>(
    r#"{"diskSerial": "x-far-too-long-for-a-serial"}"#,
    Example::validate_settings,
);
assert_eq!(bad.unwrap_err()[0].pointer, "/diskSerial");
# }
"##,
    "```\n"
)]
#![warn(missing_docs)]

// The generated bindings and the export macros name this crate by its public path.
extern crate self as templates_sdk;

pub mod cloud_config;
pub mod settings;
pub mod xml;

pub use settings::SettingsProblem;

/// Every rule plugin output is held to, one section per rule: how domain XML is read, the
/// allow-list of element paths, attributes and values, the values tied to
/// [`domain::DomainInput`], the firmware files, host bounds, vendor-data and the settings
/// schema. A refusal names its rule and points at its section here (`rules.md#<rule>`).
/// Widening a rule is a change to the operator (`operator/src/templates/check/`) with its
/// tests; this page is generated from the checker's tables (`make generate`) and a test
/// keeps them in step.
///
#[doc = include_str!("rules.md")]
pub mod rules {}

/// Bindings of the `domain` world: its input types and the exports a domain plugin makes.
#[cfg(feature = "domain")]
#[allow(missing_docs, unsafe_code, clippy::all)]
pub mod domain {
    wit_bindgen::generate!({
        path: "wit",
        world: "domain",
        pub_export_macro: true,
        export_macro_name: "__export_domain_world",
        default_bindings_module: "templates_sdk::domain",
        runtime_path: "templates_sdk::__private::wit_bindgen::rt",
    });
    pub use self::egress::templates::types::*;
}

/// Bindings of the `vendor-data` world: its input types and the exports a vendor-data
/// plugin makes.
#[cfg(feature = "vendor-data")]
#[allow(missing_docs, unsafe_code, clippy::all)]
pub mod vendor_data {
    wit_bindgen::generate!({
        path: "wit",
        world: "vendor-data",
        pub_export_macro: true,
        export_macro_name: "__export_vendor_data_world",
        default_bindings_module: "templates_sdk::vendor_data",
        runtime_path: "templates_sdk::__private::wit_bindgen::rt",
    });
    pub use self::egress::templates::types::*;
}

/// A plugin that renders libvirt domain XML.
#[cfg(feature = "domain")]
pub trait DomainPlugin {
    /// The plugin's settings; its JSON Schema is what the plugin exports.
    type Settings: serde::de::DeserializeOwned + schemars::JsonSchema;

    /// Checks beyond the schema; returns every problem (none by default).
    fn validate_settings(settings: &Self::Settings) -> Vec<SettingsProblem> {
        let _ = settings;
        Vec::new()
    }

    /// Renders the domain XML. The operator checks it: one `<domain>` with the input's
    /// name and UUID, the metadata mark unchanged, only the disks and bridge it passed.
    fn render(input: &domain::DomainInput, settings: &Self::Settings) -> Result<String, String>;
}

/// A plugin that renders cloud-init vendor-data.
#[cfg(feature = "vendor-data")]
pub trait VendorDataPlugin {
    /// The plugin's settings; its JSON Schema is what the plugin exports.
    type Settings: serde::de::DeserializeOwned + schemars::JsonSchema;

    /// Checks beyond the schema; returns every problem (none by default).
    fn validate_settings(settings: &Self::Settings) -> Vec<SettingsProblem> {
        let _ = settings;
        Vec::new()
    }

    /// Renders vendor-data: `#cloud-config` YAML (see [`cloud_config`]) or MIME multipart.
    fn render(
        input: &vendor_data::VendorDataInput,
        settings: &Self::Settings,
    ) -> Result<String, String>;
}

/// Exports a [`DomainPlugin`] implementation as the component's `domain` world.
#[cfg(feature = "domain")]
#[macro_export]
macro_rules! export_domain_plugin {
    ($plugin:ty) => {
        #[doc(hidden)]
        pub struct __TemplatesSdkDomainExport;

        impl $crate::domain::exports::egress::templates::domain_template::Guest
            for __TemplatesSdkDomainExport
        {
            fn settings_schema() -> ::std::string::String {
                $crate::settings::schema_json::<<$plugin as $crate::DomainPlugin>::Settings>()
            }
            fn validate_settings(
                settings: ::std::string::String,
            ) -> ::std::result::Result<(), ::std::vec::Vec<$crate::domain::SettingsError>> {
                $crate::__private::validate::<<$plugin as $crate::DomainPlugin>::Settings>(
                    &settings,
                    <$plugin as $crate::DomainPlugin>::validate_settings,
                )
                .map_err(|problems| {
                    problems
                        .into_iter()
                        .map(|p| $crate::domain::SettingsError {
                            pointer: p.pointer,
                            message: p.message,
                        })
                        .collect()
                })
            }

            fn render(
                input: $crate::domain::DomainInput,
            ) -> ::std::result::Result<::std::string::String, ::std::string::String> {
                $crate::__private::render_domain::<$plugin>(&input)
            }
        }

        // Component exports only exist in WebAssembly; on the host (tests, clippy) their
        // `pkg:name/iface@ver#fn` symbol names would break the native linker.
        #[cfg(target_arch = "wasm32")]
        $crate::domain::__export_domain_world!(__TemplatesSdkDomainExport with_types_in $crate::domain);
    };
}

/// Exports a [`VendorDataPlugin`] implementation as the component's `vendor-data` world.
#[cfg(feature = "vendor-data")]
#[macro_export]
macro_rules! export_vendor_data_plugin {
    ($plugin:ty) => {
        #[doc(hidden)]
        pub struct __TemplatesSdkVendorDataExport;

        impl $crate::vendor_data::exports::egress::templates::vendor_data_template::Guest
            for __TemplatesSdkVendorDataExport
        {
            fn settings_schema() -> ::std::string::String {
                $crate::settings::schema_json::<<$plugin as $crate::VendorDataPlugin>::Settings>()
            }
            fn validate_settings(
                settings: ::std::string::String,
            ) -> ::std::result::Result<(), ::std::vec::Vec<$crate::vendor_data::SettingsError>>
            {
                $crate::__private::validate::<<$plugin as $crate::VendorDataPlugin>::Settings>(
                    &settings,
                    <$plugin as $crate::VendorDataPlugin>::validate_settings,
                )
                .map_err(|problems| {
                    problems
                        .into_iter()
                        .map(|p| $crate::vendor_data::SettingsError {
                            pointer: p.pointer,
                            message: p.message,
                        })
                        .collect()
                })
            }

            fn render(
                input: $crate::vendor_data::VendorDataInput,
            ) -> ::std::result::Result<::std::string::String, ::std::string::String> {
                $crate::__private::render_vendor_data::<$plugin>(&input)
            }
        }

        #[cfg(target_arch = "wasm32")]
        $crate::vendor_data::__export_vendor_data_world!(
            __TemplatesSdkVendorDataExport with_types_in $crate::vendor_data
        );
    };
}

/// Support code for the export macros. Not a stable API.
#[doc(hidden)]
pub mod __private {
    pub use wit_bindgen;

    use crate::settings::{self, SettingsProblem};

    /// Parses settings, then runs the plugin's checks.
    pub fn validate<S: serde::de::DeserializeOwned>(
        json: &str,
        check: fn(&S) -> Vec<SettingsProblem>,
    ) -> Result<(), Vec<SettingsProblem>> {
        settings::validate_with::<S>(json, check)
    }

    fn parse_for_render<S: serde::de::DeserializeOwned>(json: &str) -> Result<S, String> {
        settings::parse::<S>(json).map_err(|p| format!("settings {p}"))
    }

    /// Parses the input's settings and renders with the plugin.
    #[cfg(feature = "domain")]
    pub fn render_domain<P: crate::DomainPlugin>(
        input: &crate::domain::DomainInput,
    ) -> Result<String, String> {
        let s = parse_for_render::<P::Settings>(&input.settings)?;
        P::render(input, &s)
    }

    /// Parses the input's settings and renders with the plugin.
    #[cfg(feature = "vendor-data")]
    pub fn render_vendor_data<P: crate::VendorDataPlugin>(
        input: &crate::vendor_data::VendorDataInput,
    ) -> Result<String, String> {
        let s = parse_for_render::<P::Settings>(&input.settings)?;
        P::render(input, &s)
    }
}
