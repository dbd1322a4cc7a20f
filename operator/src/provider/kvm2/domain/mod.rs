//! The lifecycle of a proxy VM: [`backend`] implements Create/Get/Delete/List over the
//! host operations of [`ops`] (real libvirt, or [`fake`] for tests); [`metadata`] reads
//! the ownership mark back, [`state`] maps libvirt's states, [`addresses`] picks the
//! addresses to publish, [`ippool`] allocates a new instance's MAC and static address,
//! [`volume`] makes the VM's overlay and seed volumes and [`seed`] builds the NoCloud seed
//! ISO. [`streamless`] stands in for volume streams on libvirt's test driver;
//! [`bridgenet`] reads the network a DHCP-mode host's bridge serves.

pub mod addresses;
pub mod backend;
pub mod bridgenet;
pub mod fake;
pub mod index;
pub mod ippool;
pub mod metadata;
pub mod ops;
pub mod seed;
pub mod sharing;
pub mod state;
pub mod streamless;
pub mod volume;
