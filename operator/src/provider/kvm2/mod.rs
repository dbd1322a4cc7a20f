//! The kvm2 provider: proxy VMs on remote KVM/libvirt hosts, reached only over SSH.
//!
//! Grouped by boundary: [`link`] is everything between the operator and one host (SSH,
//! known_hosts, the socket tunnel, the per-host link table, the blocking libvirt pool,
//! error classes, call observation, the host check); [`domain`] is the lifecycle of a
//! proxy VM (Create/Get/Delete/List over host operations, the ownership mark, state,
//! addresses, its volumes and seed ISO); [`image`] is the verified base-image cache and
//! its downloads. The modules are re-exported here under their flat names so callers
//! keep one short path each.
//!
//! A host needs nothing but sshd and libvirtd. The operator opens one SSH session per
//! host ([`ssh`]), verifies the host key against a known_hosts file ([`known_hosts`]),
//! and exposes the host's libvirt unix socket as a private local socket ([`tunnel`]) that
//! the `virt` crate connects to with a `qemu+unix:///system?socket=...` URI. Failures
//! carry a reason code and an error class ([`errors`]).
//!
//! On top of that: [`libvirt`] runs every libvirt call on a bounded blocking pool with a
//! deadline, [`virt_error`] classifies libvirt's errors, [`hosts`] keeps one link per host
//! (single-flight dial, redial with backoff), [`observe`] gives every call a span, a log
//! line and metrics, and [`check`] reports what a host offers.
//!
//! The provider itself: [`backend`] implements Create/Get/Delete/List over the
//! operations of [`ops`] (real: [`ops::LibvirtOps`]; for tests: [`fake`]), [`image`]
//! caches verified base images with a marker-volume commit protocol, [`volume`] makes the
//! overlay and seed volumes, [`index`] keeps what each host holds of ours (so a Create
//! or Delete does not list whole hosts), and [`locks`] serialises work per domain name and
//! image.
//!
//! [`seed`] builds the cloud-init NoCloud seed ISO (`cidata`) of a VM in memory.
//!
//! [`fetch`] downloads base images over HTTP(S): streamed, hashed, size-capped, and with
//! every redirect hop and resolved address checked against the image's policy.
//!
//! Pure pieces with no libvirt connection: [`metadata`] reads our ownership mark back from
//! a domain (hostile input, strictly checked), [`state`] maps libvirt's domain state, and
//! [`addresses`] chooses the guest addresses to publish.

pub mod domain;
pub mod image;
pub mod link;
pub mod locks;

pub use domain::{addresses, backend, fake, index, metadata, ops, seed, state, volume};
pub use image::fetch;
pub use link::{check, errors, hosts, known_hosts, libvirt, observe, ssh, tunnel, virt_error};
