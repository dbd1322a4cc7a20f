//! Leftover volumes: instance volumes (root and seed) with no domain, and (through the
//! same candidates) the image volumes [`super::images`] judges.
//!
//! Volumes outlive their domain when a Create fails and its cleanup fails too (or the
//! process dies), and the Proxy is then deleted: nothing would ever name them again, and
//! the seed holds the Proxy's user-data. Images removed from the config leave their base
//! volumes, markers and half-made staging volumes. A [`VolumeCollector`] (a provider that
//! has volumes) lists such candidates per target, by name only (names it makes itself),
//! and the collector decides here. A volume has no creation time libvirt reports on every
//! pool type, so "older than the grace period" is "seen as a leftover by this process,
//! sweep after sweep, for longer than the grace period": a restart starts counting again,
//! which errs on the side of keeping.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use jiff::Timestamp;

use super::images;
use super::report::{GcReport, SkippedTarget};
use super::{GarbageCollector, GcError, Owner, SweepControl};
use crate::error::Classified;
use crate::provider::{BoxFuture, ProviderError};

/// What kind of leftover a [`VolumeCandidate`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VolumeKind {
    /// An instance's root and seed volumes with no domain of that instance on the host.
    Instance,
    /// Staging leftovers of an image no longer configured: a data volume never verified,
    /// or a marker or takeover claim without its data volume.
    Staging,
    /// The verified base of an image no longer configured, used by no volume.
    UnusedImage,
    /// Another cluster's image announcement, unchanged for so long that the cluster has
    /// left the host.
    Announcement,
}

impl VolumeKind {
    /// Stable label for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            VolumeKind::Instance => "instance",
            VolumeKind::Staging => "staging",
            VolumeKind::UnusedImage => "unused-image",
            VolumeKind::Announcement => "announcement",
        }
    }
}

/// Volumes a [`VolumeCollector`] offers for collection as one group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeCandidate {
    /// Stable key on its target: the instance's domain name, or the image's data volume
    /// name.
    pub key: String,
    /// What it is.
    pub kind: VolumeKind,
    /// For [`VolumeKind::Instance`]: the Proxy UID the volume names carry.
    pub owner_uid: Option<String>,
    /// The volume names, in the order they are deleted.
    pub volumes: Vec<String>,
}

/// One target's candidates, or why it could not be listed.
#[derive(Debug)]
pub struct VolumeListing {
    /// Target (host) name.
    pub target: String,
    /// Candidates; an error means "unknown", never "none".
    pub result: Result<Vec<VolumeCandidate>, ProviderError>,
}

/// What a [`VolumeCollector::delete_volumes`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeDeleteOutcome {
    /// The volumes are gone.
    Deleted,
    /// The provider's own check right before the delete found the candidate no longer a
    /// leftover (a domain of that instance appeared, a volume now uses the image); nothing
    /// was deleted.
    Changed(String),
}

/// A provider whose leftover volumes the collector sweeps.
pub trait VolumeCollector: Send + Sync {
    /// Provider name (for logs and metrics).
    fn name(&self) -> &str;
    /// Every target's leftover candidates. A target whose listing fails is reported as
    /// failed, never as empty.
    fn volume_candidates(&self) -> BoxFuture<'_, Vec<VolumeListing>>;
    /// Deletes a candidate's volumes after checking, under the provider's own locks, that
    /// it is still a leftover.
    fn delete_volumes<'a>(
        &'a self,
        target: &'a str,
        candidate: &'a VolumeCandidate,
    ) -> BoxFuture<'a, Result<VolumeDeleteOutcome, ProviderError>>;
}

/// A volume candidate on a target of a provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeRef {
    /// Provider name.
    pub provider: String,
    /// Target (host).
    pub target: String,
    /// The candidate's key.
    pub key: String,
    /// Its kind.
    pub kind: VolumeKind,
}

/// Why leftover volumes were kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeKeep {
    /// A Proxy with the UID in their names exists: its Create may be making them.
    ProxyExists,
    /// Not yet seen as a leftover for longer than required.
    Young {
        /// Seconds this process has seen it as a leftover.
        seen_for_seconds: i64,
    },
    /// One of the `keepUnused` most recently unused retired images of its host.
    Policy,
    /// The provider's check right before the delete found it in use again.
    Changed(String),
}

impl GarbageCollector {
    /// The leftover volume phase of a sweep: `owners` was listed after the instances,
    /// and so after every volume listing of the previous phase too; each collector lists
    /// its volumes now and the provider checks again under its own locks before a delete.
    pub(super) async fn sweep_volumes(
        &self,
        ctl: &SweepControl,
        owners: &HashMap<String, Owner>,
        now: Timestamp,
        report: &mut GcReport,
    ) {
        for collector in &self.volumes {
            let provider = collector.name().to_string();
            for listing in collector.volume_candidates().await {
                let candidates = match listing.result {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(provider, target = %listing.target, class = %e.class(), error = %e, "gc: volume listing failed; target skipped this round");
                        report.volume_targets_skipped.push(SkippedTarget {
                            provider: provider.clone(),
                            target: listing.target,
                            class: e.class(),
                            message: e.to_string(),
                        });
                        continue;
                    }
                };
                let target = listing.target;
                let verdicts = self.judge_volumes(&provider, &target, &candidates, owners, now);
                for (candidate, verdict) in candidates.iter().zip(verdicts) {
                    let at = VolumeRef {
                        provider: provider.clone(),
                        target: target.clone(),
                        key: candidate.key.clone(),
                        kind: candidate.kind,
                    };
                    if let Err(keep) = verdict {
                        report.volumes_kept.push((at, keep));
                        continue;
                    }
                    if ctl.stop.load(Ordering::SeqCst) {
                        report.interrupted = true;
                        return;
                    }
                    ctl.in_delete.store(true, Ordering::SeqCst);
                    let outcome = collector.delete_volumes(&target, candidate).await;
                    ctl.in_delete.store(false, Ordering::SeqCst);
                    match outcome {
                        Ok(VolumeDeleteOutcome::Deleted) => {
                            tracing::info!(provider, target, key = %candidate.key, kind = candidate.kind.as_str(), volumes = ?candidate.volumes, "gc: deleted leftover volumes");
                            self.forget(&provider, &target, &candidate.key);
                            report.volumes_deleted.push(at);
                        }
                        Ok(VolumeDeleteOutcome::Changed(why)) => {
                            tracing::info!(provider, target, key = %candidate.key, why, "gc: leftover volumes in use again; kept");
                            self.forget(&provider, &target, &candidate.key);
                            report.volumes_kept.push((at, VolumeKeep::Changed(why)));
                        }
                        Err(source) => {
                            let error = GcError::DeleteVolumes {
                                provider: provider.clone(),
                                target: target.clone(),
                                key: candidate.key.clone(),
                                source,
                            };
                            tracing::warn!(class = %error.class(), error = %error, "gc: deleting leftover volumes failed");
                            report.volumes_failed.push((at, error));
                        }
                    }
                }
            }
        }
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String, String), Timestamp>> {
        match self.first_seen.lock() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        }
    }

    fn forget(&self, provider: &str, target: &str, key: &str) {
        self.seen()
            .remove(&(provider.to_string(), target.to_string(), key.to_string()));
    }

    /// Judges one target's candidates (in order) and updates when each was first seen:
    /// a group that is not listed, or whose Proxy exists, starts counting afresh.
    fn judge_volumes(
        &self,
        provider: &str,
        target: &str,
        candidates: &[VolumeCandidate],
        owners: &HashMap<String, Owner>,
        now: Timestamp,
    ) -> Vec<Result<(), VolumeKeep>> {
        let mut seen = self.seen();
        let key = |k: &str| (provider.to_string(), target.to_string(), k.to_string());
        let listed: std::collections::HashSet<&str> =
            candidates.iter().map(|c| c.key.as_str()).collect();
        seen.retain(|(p, t, k), _| p != provider || t != target || listed.contains(k.as_str()));
        let mut since = Vec::with_capacity(candidates.len());
        for c in candidates {
            let proxy_exists = c
                .owner_uid
                .as_ref()
                .is_some_and(|uid| owners.contains_key(uid));
            if c.kind == VolumeKind::Instance && (c.owner_uid.is_none() || proxy_exists) {
                seen.remove(&key(&c.key));
                since.push(None);
            } else {
                since.push(Some(*seen.entry(key(&c.key)).or_insert(now)));
            }
        }
        drop(seen);

        let kept_by_policy = images::kept_by_policy(candidates, &since, &self.retired);

        candidates
            .iter()
            .zip(since)
            .map(|(c, first)| {
                let Some(first) = first else {
                    return Err(VolumeKeep::ProxyExists);
                };
                if c.kind == VolumeKind::UnusedImage && kept_by_policy.contains(c.key.as_str()) {
                    return Err(VolumeKeep::Policy);
                }
                let age = now.duration_since(first);
                let needed = match c.kind {
                    VolumeKind::Instance | VolumeKind::Announcement => self.grace,
                    VolumeKind::Staging | VolumeKind::UnusedImage => {
                        images::required_age(c.kind, self.grace, &self.retired)
                    }
                };
                if age <= needed {
                    return Err(VolumeKeep::Young {
                        seen_for_seconds: age.as_secs(),
                    });
                }
                Ok(())
            })
            .collect()
    }
}
