//! libvirt's domain state, as the controller's [`InstanceState`].
//!
//! The controller decides on the provider-neutral state only (replace a crashed VM, wait
//! for one being shut down), so the libvirt constants stop here.

use virt::sys;

use crate::provider::InstanceState;

/// Maps `virDomainGetState`'s state. `VIR_DOMAIN_SHUTDOWN` means "being shut down", so it
/// is [`InstanceState::Dying`], not shut off. A value newer than our bindings is
/// [`InstanceState::NoState`]: unknown, which the controller neither trusts as running nor
/// treats as failed.
pub fn instance_state(state: sys::virDomainState) -> InstanceState {
    match state {
        sys::VIR_DOMAIN_RUNNING => InstanceState::Running,
        sys::VIR_DOMAIN_BLOCKED => InstanceState::Blocked,
        sys::VIR_DOMAIN_PAUSED => InstanceState::Paused,
        sys::VIR_DOMAIN_SHUTDOWN => InstanceState::Dying,
        sys::VIR_DOMAIN_SHUTOFF => InstanceState::ShutOff,
        sys::VIR_DOMAIN_CRASHED => InstanceState::Crashed,
        sys::VIR_DOMAIN_PMSUSPENDED => InstanceState::Suspended,
        _ => InstanceState::NoState,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_libvirt_state() {
        let table = [
            (sys::VIR_DOMAIN_NOSTATE, InstanceState::NoState),
            (sys::VIR_DOMAIN_RUNNING, InstanceState::Running),
            (sys::VIR_DOMAIN_BLOCKED, InstanceState::Blocked),
            (sys::VIR_DOMAIN_PAUSED, InstanceState::Paused),
            (sys::VIR_DOMAIN_SHUTDOWN, InstanceState::Dying),
            (sys::VIR_DOMAIN_SHUTOFF, InstanceState::ShutOff),
            (sys::VIR_DOMAIN_CRASHED, InstanceState::Crashed),
            (sys::VIR_DOMAIN_PMSUSPENDED, InstanceState::Suspended),
        ];
        for (state, want) in table {
            assert_eq!(instance_state(state), want, "state {state}");
        }
        // Every constant is in the table, and they are libvirt's 0..=7.
        let mut values: Vec<_> = table.iter().map(|(s, _)| *s).collect();
        values.sort_unstable();
        assert_eq!(values, (0..=7).collect::<Vec<_>>());
    }

    #[test]
    fn unknown_states_are_nostate() {
        for state in [8, 9, 100, sys::virDomainState::MAX] {
            assert_eq!(
                instance_state(state),
                InstanceState::NoState,
                "state {state}"
            );
        }
    }

    #[test]
    fn only_shutoff_and_crashed_are_failed() {
        let failed: Vec<_> = (0..=8)
            .map(instance_state)
            .filter(|s| s.is_failed())
            .collect();
        assert_eq!(failed, [InstanceState::ShutOff, InstanceState::Crashed]);
    }
}
