//! Keyed async locks: one mutex per key (a domain name, a host + image), made on demand
//! and dropped when the last holder lets go, so the table does not grow with every Proxy
//! the operator has ever seen.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

/// A set of locks by key.
#[derive(Debug, Default)]
pub struct KeyedLocks {
    locks: Mutex<HashMap<String, Weak<AsyncMutex<()>>>>,
}

impl KeyedLocks {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Waits for the lock of `key` and holds it until the guard drops.
    pub async fn lock(&self, key: &str) -> OwnedMutexGuard<()> {
        let lock = {
            let mut map = match self.locks.lock() {
                Ok(m) => m,
                Err(poisoned) => poisoned.into_inner(),
            };
            // Forget keys nobody holds any more; cheap, as the map holds only live keys.
            map.retain(|_, w| w.strong_count() > 0);
            match map.get(key).and_then(Weak::upgrade) {
                Some(l) => l,
                None => {
                    let l = Arc::new(AsyncMutex::new(()));
                    map.insert(key.to_string(), Arc::downgrade(&l));
                    l
                }
            }
        };
        lock.lock_owned().await
    }

    /// Keys currently locked or waited for (for tests and metrics).
    pub fn live_keys(&self) -> usize {
        match self.locks.lock() {
            Ok(m) => m.values().filter(|w| w.strong_count() > 0).count(),
            Err(p) => p
                .into_inner()
                .values()
                .filter(|w| w.strong_count() > 0)
                .count(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[tokio::test]
    async fn same_key_is_exclusive_other_keys_are_not() {
        let locks = Arc::new(KeyedLocks::new());
        let inside = Arc::new(AtomicUsize::new(0));
        let max = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let (locks, inside, max) = (locks.clone(), inside.clone(), max.clone());
            tasks.push(tokio::spawn(async move {
                let _g = locks.lock("a").await;
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                max.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(2)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
            }));
        }
        let _other = locks.lock("b").await; // not blocked by "a"
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(max.load(Ordering::SeqCst), 1);
        drop(_other);
        assert_eq!(locks.live_keys(), 0, "released keys are forgotten");
    }
}
