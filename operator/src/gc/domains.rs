//! The domain collector: deletes instances that no Proxy owns any more, and duplicates a
//! Proxy no longer names.
//!
//! A sweep lists every provider's instances, then which Proxies exist ([`ProxyIndex`](super::ProxyIndex)),
//! and deletes an instance when
//! - no Proxy has its UID (`no-proxy`), or
//! - its Proxy's `status.instanceId` names a *different* instance (`duplicate`: left by a
//!   replace, or by a placement while a host was unreachable),
//!
//! and, in both cases, it is older than the grace period. Design invariant 6 holds like
//! this:
//! - *Only our mark*: [`Provider::list`](crate::provider::Provider::list) returns, by contract, only instances carrying our
//!   managed mark for this cluster; a domain without it never reaches the collector. That
//!   is a provider property and is tested there (kvm2's listing tests), not faked here.
//!   The collector still ignores any instance with an empty owner UID.
//! - *Never on a failed listing*: a target whose listing failed is skipped for the round,
//!   never read as empty; if the Proxies cannot be listed, nothing is deleted at all
//!   (an empty owner set would make everything look orphaned).
//! - *Grace period*: age comes from the instance's `created_at`; one that cannot be dated
//!   is kept (and logged), so a Create in flight is never collected.
//!
//! The instance a Proxy's status names is never touched, and nothing of a Proxy whose
//! status names no instance yet is touched either: its Create may be about to write it.
//! A Proxy being deleted is treated like any other: its finalizer deletes the named
//! instance, and its duplicates are collected by the same rule.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use jiff::{SignedDuration, Timestamp};

use super::report::{
    Deleted, FailedDelete, GcReport, InstanceRef, KeepReason, Kept, OrphanReason, SkippedTarget,
    Unconfigured,
};
use super::{GarbageCollector, GcError, Owner, SweepControl};
use crate::error::Classified;
use crate::provider::{Instance, SharedProvider};

/// The instances Proxies name on hosts no provider listed (configured hosts are always
/// listed, a failed listing included), sorted for stable reports.
pub(super) fn unconfigured(
    owners: &HashMap<String, Owner>,
    targets: &std::collections::HashSet<String>,
) -> Vec<Unconfigured> {
    let mut out: Vec<Unconfigured> = owners
        .values()
        .filter_map(|o| {
            let id = o.instance_id.as_ref()?;
            (!targets.contains(&id.host)).then(|| Unconfigured {
                instance: id.clone(),
                namespace: o.namespace.clone(),
                name: o.name.clone(),
            })
        })
        .collect();
    out.sort_by(|a, b| {
        let key = |u: &Unconfigured| {
            (
                u.instance.host.clone(),
                u.instance.name.clone(),
                u.namespace.clone(),
                u.name.clone(),
            )
        };
        key(a).cmp(&key(b))
    });
    out
}

/// Decides one instance's fate. Pure, so every rule is tested on its own.
pub(super) fn judge(
    instance: &Instance,
    owners: &HashMap<String, Owner>,
    now: Timestamp,
    grace: SignedDuration,
) -> Result<OrphanReason, KeepReason> {
    if instance.proxy.uid.is_empty() {
        return Err(KeepReason::NoOwnerUid);
    }
    let reason = match owners.get(&instance.proxy.uid) {
        None => OrphanReason::NoProxy,
        Some(owner) => match &owner.instance_id {
            None => return Err(KeepReason::NotYetNamed),
            Some(named) if *named == instance.id => return Err(KeepReason::Named),
            Some(_) if owner.provisioning => return Err(KeepReason::CreateInProgress),
            Some(named) => OrphanReason::Duplicate {
                named: named.clone(),
            },
        },
    };
    let Ok(created) = instance.created_at.parse::<Timestamp>() else {
        return Err(KeepReason::Undatable {
            created_at: instance.created_at.clone(),
        });
    };
    let age = now.duration_since(created);
    if age <= grace {
        return Err(KeepReason::Young {
            age_seconds: age.as_secs(),
        });
    }
    Ok(reason)
}

impl GarbageCollector {
    /// The instance phase of a sweep: lists every provider's instances, then the
    /// Proxies, and deletes the orphans and duplicates past the grace period. Returns the
    /// owners for the volume phase, or `None` when the Proxies could not be listed (then
    /// nothing was deleted).
    pub(super) async fn sweep_domains(
        &self,
        ctl: &SweepControl,
        now: Timestamp,
        report: &mut GcReport,
    ) -> Option<HashMap<String, Owner>> {
        // Instances first, Proxies second: a Proxy that existed when an instance was
        // listed is then always in the owner set, so only the grace period has to cover
        // Proxies created during the sweep.
        let mut candidates: Vec<(&SharedProvider, Instance)> = Vec::new();
        let mut targets = std::collections::HashSet::new();
        for provider in &self.providers {
            for listing in provider.list().await {
                targets.insert(listing.target.clone());
                match listing.result {
                    Ok(instances) => {
                        for instance in instances {
                            report.seen.push(InstanceRef {
                                provider: provider.name().into(),
                                id: instance.id.clone(),
                            });
                            candidates.push((provider, instance));
                        }
                    }
                    Err(e) => {
                        tracing::warn!(provider = provider.name(), target = %listing.target, class = %e.class(), error = %e, "gc: listing failed; target skipped this round");
                        report.skipped_targets.push(SkippedTarget {
                            provider: provider.name().into(),
                            target: listing.target,
                            class: e.class(),
                            message: e.to_string(),
                        });
                    }
                }
            }
        }

        let owners = match self.index.owners().await {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(class = %e.class(), error = %e, "gc: cannot list Proxies; nothing is deleted this round");
                report.owners_error = Some(e);
                return None;
            }
        };
        report.unconfigured = unconfigured(&owners, &targets);
        for u in &report.unconfigured {
            tracing::warn!(instance = %u.instance, proxy = %format_args!("{}/{}", u.namespace, u.name),
                "gc: a Proxy names an instance on a host that is not configured any more; it is neither watched nor collected there");
        }

        for (provider, instance) in candidates {
            let at = InstanceRef {
                provider: provider.name().into(),
                id: instance.id.clone(),
            };
            if let Err(keep) = judge(&instance, &owners, now, self.grace) {
                if let KeepReason::Undatable { created_at } = &keep {
                    tracing::warn!(provider = provider.name(), instance = %instance.id, created_at, "gc: creation time unreadable; instance kept");
                }
                report.kept.push(Kept {
                    instance: at,
                    reason: keep,
                });
                continue;
            }
            if ctl.stop.load(Ordering::SeqCst) {
                report.interrupted = true;
                break;
            }
            // The listing may be minutes old by now (earlier deletes wait for graceful
            // shutdowns): judge again on a fresh read of this one Proxy, so a status
            // written since (a replacement named, a Create started) is honoured.
            let reason = match self.recheck(&instance, now).await {
                Ok(reason) => reason,
                Err(keep) => {
                    tracing::info!(provider = provider.name(), instance = %instance.id, reason = ?keep, "gc: kept after re-reading its Proxy");
                    report.kept.push(Kept {
                        instance: at,
                        reason: keep,
                    });
                    continue;
                }
            };
            ctl.in_delete.store(true, Ordering::SeqCst);
            let outcome = provider.delete(&instance.id).await;
            ctl.in_delete.store(false, Ordering::SeqCst);
            match outcome {
                Ok(()) => {
                    tracing::info!(
                        provider = provider.name(),
                        instance = %instance.id,
                        proxy_uid = %instance.proxy.uid,
                        proxy = %format_args!("{}/{}", instance.proxy.namespace, instance.proxy.name),
                        reason = reason.as_str(),
                        "gc: deleted instance"
                    );
                    report.deleted.push(Deleted {
                        instance: at,
                        proxy_uid: instance.proxy.uid.clone(),
                        reason,
                    });
                }
                Err(source) => {
                    let error = GcError::Delete {
                        provider: provider.name().into(),
                        instance: instance.id.clone(),
                        source,
                    };
                    tracing::warn!(proxy_uid = %instance.proxy.uid, reason = reason.as_str(), class = %error.class(), error = %error, "gc: delete failed");
                    report.failed.push(FailedDelete {
                        instance: at,
                        reason,
                        error,
                    });
                }
            }
        }
        Some(owners)
    }

    /// Judges `instance` again on a fresh read of the Proxy its mark names.
    async fn recheck(
        &self,
        instance: &Instance,
        now: Timestamp,
    ) -> Result<OrphanReason, KeepReason> {
        let p = &instance.proxy;
        let fresh = match self.index.owner(&p.uid, &p.namespace, &p.name).await {
            Ok(o) => o,
            Err(e) => {
                tracing::warn!(instance = %instance.id, class = %e.class(), error = %e, "gc: cannot re-read the Proxy; instance kept this round");
                return Err(KeepReason::Unconfirmed { class: e.class() });
            }
        };
        let owners: HashMap<String, Owner> =
            fresh.map(|o| (p.uid.clone(), o)).into_iter().collect();
        judge(instance, &owners, now, self.grace)
    }
}
