//! Allocator tuning for the long-running `run` process.
//!
//! glibc gives every thread that allocates under contention an arena of its own, up to
//! eight per core, and keeps what those arenas once held: a burst of Creates (seed ISOs,
//! rendered vendor-data, status and event bodies built on tokio's workers and on the
//! blocking threads that call libvirt) leaves each arena as large as its busiest moment.
//! Measured with the scale bench on the real control plane, 200 Proxies: peak RSS
//! 122 MiB with glibc's default, 105 MiB with two arenas, no slower. A process-wide
//! limit of [`ARENAS`] keeps that memory in few arenas, where freed blocks are reused.

/// Arenas the process may use: enough that two threads seldom wait for one another.
pub const ARENAS: i32 = 2;

/// What [`limit_arenas`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arenas {
    /// The limit is set to [`ARENAS`].
    Limited,
    /// `MALLOC_ARENA_MAX` is set: glibc took the operator's own choice, which stands.
    FromEnvironment,
    /// mallopt refused the setting, or this is not glibc; the allocator is as it was.
    Unchanged,
}

/// Limits glibc's malloc arenas. Call it first thing, before threads start: arenas
/// already made stay.
pub fn limit_arenas() -> Arenas {
    if std::env::var_os("MALLOC_ARENA_MAX").is_some() {
        return Arenas::FromEnvironment;
    }
    set_arena_max(ARENAS)
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_arena_max(n: i32) -> Arenas {
    // SAFETY: mallopt takes two integers, touches only the allocator's own parameters and
    // is safe to call at any time; M_ARENA_MAX is a documented glibc parameter.
    #[allow(unsafe_code)]
    let ok = unsafe { libc::mallopt(libc::M_ARENA_MAX, n) };
    if ok == 1 {
        Arenas::Limited
    } else {
        Arenas::Unchanged
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_arena_max(_: i32) -> Arenas {
    Arenas::Unchanged
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_is_set_unless_the_environment_chose() {
        let expected = if std::env::var_os("MALLOC_ARENA_MAX").is_some() {
            Arenas::FromEnvironment
        } else if cfg!(all(target_os = "linux", target_env = "gnu")) {
            Arenas::Limited
        } else {
            Arenas::Unchanged
        };
        assert_eq!(limit_arenas(), expected);
    }
}
