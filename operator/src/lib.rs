//! egress-operator: keeps a fleet of egress proxy VMs running on remote KVM/libvirt hosts.
//!
//! The binary (`src/main.rs`) only parses the command line and calls [`cli::run`];
//! everything testable lives here.

pub mod allocator;
pub mod api;
pub mod authoring;
pub mod cli;
pub mod cluster_identity;
pub mod config;
pub mod controller;
pub mod error;
pub mod fleet;
pub mod gc;
pub mod instance;
pub mod leader;
pub mod provider;
pub mod providerhealth;
pub mod provision;
pub mod render;
pub mod revision;
pub mod run;
pub mod serving;
pub mod state_metrics;
pub mod status_apply;
pub mod telemetry;
pub mod templates;
pub mod validate_config;
pub mod validation;

pub use error::{Classified, ErrorClass};
