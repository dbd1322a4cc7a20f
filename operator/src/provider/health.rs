//! The last known health of one provider's targets, shared between the health monitor
//! (which writes it after every round) and the provider's placement (which reads it so a
//! Create does not wait on a host that is known to be down).
//!
//! A target the board has never heard of counts as healthy: the operator must be able to
//! place Proxies before the first round has finished, and a board nobody writes to (a
//! provider built for a one-off command) must change nothing.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::TargetHealth;

/// A cheap-to-clone handle on one provider's health table; every clone sees the same
/// table. Locks are held only for a copy in or out, never across an `.await`.
#[derive(Debug, Clone, Default)]
pub struct HealthBoard {
    table: Arc<RwLock<BTreeMap<String, TargetHealth>>>,
}

impl HealthBoard {
    /// An empty board: every target healthy until a check says otherwise.
    pub fn new() -> Self {
        Self::default()
    }

    // A panic while holding the lock cannot leave the map half-updated (every write is
    // one insert), so a poisoned lock is still a consistent table.
    fn read(&self) -> RwLockReadGuard<'_, BTreeMap<String, TargetHealth>> {
        match self.table.read() {
            Ok(t) => t,
            Err(p) => p.into_inner(),
        }
    }

    fn write(&self) -> RwLockWriteGuard<'_, BTreeMap<String, TargetHealth>> {
        match self.table.write() {
            Ok(t) => t,
            Err(p) => p.into_inner(),
        }
    }

    /// Takes in one round's results; targets not in `results` keep their last entry.
    pub fn record(&self, results: &[TargetHealth]) {
        let mut table = self.write();
        for r in results {
            table.insert(r.target.clone(), r.clone());
        }
    }

    /// Whether the last check of `target` found it unreachable (unknown: no).
    pub fn is_unhealthy(&self, target: &str) -> bool {
        self.read().get(target).is_some_and(|h| !h.reachable)
    }

    /// The last result of `target`, if it was ever checked.
    pub fn get(&self, target: &str) -> Option<TargetHealth> {
        self.read().get(target).cloned()
    }

    /// Every target's last result, by target name.
    pub fn snapshot(&self) -> BTreeMap<String, TargetHealth> {
        self.read().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn health(target: &str, reachable: bool) -> TargetHealth {
        TargetHealth {
            target: target.into(),
            reachable,
            reason: (!reachable).then(|| "connect".to_string()),
            stage: None,
            message: String::new(),
            latency: Duration::from_millis(3),
        }
    }

    #[test]
    fn unknown_targets_are_healthy_and_clones_share_the_table() {
        let board = HealthBoard::new();
        assert!(!board.is_unhealthy("h1"));
        assert!(board.snapshot().is_empty());

        let other = board.clone();
        other.record(&[health("h1", false), health("h2", true)]);
        assert!(board.is_unhealthy("h1"));
        assert!(!board.is_unhealthy("h2"));
        assert!(!board.is_unhealthy("h3"));
        assert_eq!(
            board.get("h1").and_then(|h| h.reason),
            Some("connect".into())
        );
        assert_eq!(
            board.snapshot().keys().collect::<Vec<_>>(),
            vec!["h1", "h2"]
        );
    }

    #[test]
    fn a_later_round_replaces_only_the_targets_it_reports() {
        let board = HealthBoard::new();
        board.record(&[health("h1", false), health("h2", false)]);
        board.record(&[health("h1", true)]);
        assert!(!board.is_unhealthy("h1"), "h1 recovered");
        assert!(board.is_unhealthy("h2"), "h2 was not re-checked");
    }
}
