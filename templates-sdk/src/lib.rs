//! SDK for egress-operator template plugins.
//!
//! Template plugins are WebAssembly components that render a proxy VM's libvirt domain XML
//! and its cloud-init vendor-data. The plugin ABI (WIT), typed inputs, the safe XML builder
//! and the export macro arrive with the template plugin platform; this crate is where
//! plugin authors will find them.
