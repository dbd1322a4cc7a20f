//! The kvm2 provider: proxy VMs on remote KVM/libvirt hosts, reached only over SSH.
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
//! overlay and seed volumes, and [`locks`] serialises work per domain name and image.
//!
//! [`seed`] builds the cloud-init NoCloud seed ISO (`cidata`) of a VM in memory.
//!
//! [`fetch`] downloads base images over HTTP(S): streamed, hashed, size-capped, and with
//! every redirect hop and resolved address checked against the image's policy.
//!
//! Pure pieces with no libvirt connection: [`metadata`] reads our ownership mark back from
//! a domain (hostile input, strictly checked), [`state`] maps libvirt's domain state, and
//! [`addresses`] chooses the guest addresses to publish.

pub mod addresses;
pub mod backend;
pub mod check;
pub mod errors;
pub mod fake;
pub mod fetch;
pub mod hosts;
pub mod image;
pub mod known_hosts;
pub mod libvirt;
pub mod locks;
pub mod metadata;
pub mod observe;
pub mod ops;
pub mod seed;
pub mod ssh;
pub mod state;
pub mod tunnel;
pub mod virt_error;
pub mod volume;
