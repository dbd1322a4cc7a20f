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

pub mod check;
pub mod errors;
pub mod hosts;
pub mod known_hosts;
pub mod libvirt;
pub mod observe;
pub mod ssh;
pub mod tunnel;
pub mod virt_error;
