//! Providers: the code that creates, finds and deletes proxy VMs somewhere.
//!
//! Only one exists so far, [`kvm2`]: libvirt hosts reached over SSH. The controller will
//! see providers only through a trait, so nothing here knows about Kubernetes.

pub mod kvm2;
