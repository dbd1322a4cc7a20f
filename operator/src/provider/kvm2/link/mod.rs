//! The link to a host: an SSH session with a verified host key ([`ssh`],
//! [`known_hosts`]), libvirt's unix socket forwarded through it ([`tunnel`]), one shared
//! link per host with single-flight dials and redials ([`hosts`]), every libvirt call on
//! a bounded blocking pool with a deadline ([`libvirt`]), libvirt's and SSH's errors
//! classified ([`virt_error`], [`errors`]), each call observed ([`observe`]), and the
//! report of what a host offers ([`check`]).

pub mod check;
pub mod errors;
pub mod hosts;
pub mod known_hosts;
pub mod libvirt;
pub mod observe;
pub mod pool;
pub mod ssh;
pub mod tunnel;
pub mod virt_error;
