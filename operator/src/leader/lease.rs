//! The Lease API as the elector uses it: read, create, and update guarded by the
//! `resourceVersion` of the read; and the holder record a follower times.
//!
//! A conflict (409) on an update means only that someone wrote the Lease since our read:
//! another replica taking it, or anyone touching it (`kubectl annotate`, a label, a no-op
//! apply). So the writer re-reads at once and judges again from the fresh read: a holder
//! still us carries on (the renewal is written over the new version), another holder wins.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Client;
use kube::api::{Api, PostParams};

use super::{FIELD_MANAGER_PREFIX, LeaderOptions};

/// Re-reads after a conflict within one round before the round gives up as contended: a
/// touch of the Lease costs one, another replica's write one more; more than a few in a
/// row is a Lease written continuously, and the round is then retried like any failure.
const CONFLICT_REREADS: usize = 4;

/// What one round of [`LeaseApi::acquire_or_renew`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Round {
    /// We hold the lease: taken or renewed by a write the API server accepted.
    Held,
    /// Another replica holds it, and its hold is live (or we must wait to judge it).
    HeldByOther,
    /// Every write conflicted with another write ([`CONFLICT_REREADS`] times): nothing is
    /// known; a holder retries this round as it retries an error.
    Contended,
}

/// The fields of a lease that say who holds it and since when, as written by its holder.
/// A follower times this record, not the object's `resourceVersion`: metadata changes
/// (annotations, labels, managed fields) and writes that leave the record as it was say
/// nothing about whether the holder is alive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct HolderRecord {
    holder: Option<String>,
    acquire_time: Option<MicroTime>,
    renew_time: Option<MicroTime>,
    lease_duration_seconds: Option<i32>,
    lease_transitions: Option<i32>,
}

impl HolderRecord {
    /// The record of `spec`; an empty holder counts as none.
    pub(super) fn of(spec: &LeaseSpec) -> Self {
        HolderRecord {
            holder: holder_of(spec).map(str::to_string),
            acquire_time: spec.acquire_time.clone(),
            renew_time: spec.renew_time.clone(),
            lease_duration_seconds: spec.lease_duration_seconds,
            lease_transitions: spec.lease_transitions,
        }
    }
}

/// What a replica last read of the lease's holder record and when it first saw that
/// record, by its own clock: a held lease counts as expired once the same record has been
/// seen for its duration, whatever the holder's clock wrote in `renewTime`.
#[derive(Debug, Default)]
pub(super) struct Observed {
    record: Option<HolderRecord>,
    since: Option<Instant>,
}

impl Observed {
    pub(super) fn saw(&mut self, lease: &Lease) {
        let record = HolderRecord::of(&lease.spec.clone().unwrap_or_default());
        if self.record.as_ref() != Some(&record) || self.since.is_none() {
            self.record = Some(record);
            self.since = Some(Instant::now());
        }
    }

    pub(super) fn expired(&self, spec: &LeaseSpec) -> bool {
        let duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .unwrap_or(0);
        self.since
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(duration))
    }
}

/// The holder, unless the lease names none.
fn holder_of(spec: &LeaseSpec) -> Option<&str> {
    spec.holder_identity.as_deref().filter(|h| !h.is_empty())
}

/// The API server refused who we are or what we asked (401, 403).
pub(super) fn is_refusal(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 401 || s.code == 403)
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// What [`LeaseApi::take`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Take {
    Taken,
    /// Held by someone else, live.
    NotFree,
    /// The write was based on a stale read: re-read and judge again.
    Stale,
}

/// The Lease API as the elector uses it: read, create, and update guarded by the
/// `resourceVersion` of the read.
pub(super) struct LeaseApi {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration_secs: i32,
    params: PostParams,
}

impl LeaseApi {
    pub(super) fn new(client: Client, options: &LeaderOptions, duration_secs: u64) -> Self {
        let params = PostParams {
            field_manager: Some(format!("{FIELD_MANAGER_PREFIX}{}", options.identity)),
            ..PostParams::default()
        };
        Self {
            api: Api::namespaced(client, &options.namespace),
            name: options.lease_name.clone(),
            identity: options.identity.clone(),
            duration_secs: i32::try_from(duration_secs).unwrap_or(i32::MAX),
            params,
        }
    }

    /// Reads the lease, creating it free when missing (another replica creating it first
    /// is fine).
    pub(super) async fn read_or_create(&self) -> Result<Lease, kube::Error> {
        if let Some(lease) = self.api.get_opt(&self.name).await? {
            return Ok(lease);
        }
        let empty = Lease {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec::default()),
        };
        match self.api.create(&self.params, &empty).await {
            Ok(lease) => Ok(lease),
            Err(e) if is_conflict(&e) => self.api.get(&self.name).await,
            Err(e) => Err(e),
        }
    }

    /// Writes `spec` over `read`, only if nobody wrote the lease since; `None` if someone
    /// did (a conflict).
    async fn write(&self, read: &Lease, spec: LeaseSpec) -> Result<Option<Lease>, kube::Error> {
        let mut next = read.clone();
        next.metadata.managed_fields = None;
        next.spec = Some(spec);
        match self.api.replace(&self.name, &self.params, &next).await {
            Ok(lease) => Ok(Some(lease)),
            Err(e) if is_conflict(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// One round: read, then take the lease if it is free, expired or ours (renewing it).
    /// A write that conflicts is judged again from a fresh read at once, so someone
    /// touching the Lease between our read and our write costs one more read, not the
    /// round.
    pub(super) async fn acquire_or_renew(
        &self,
        observed: &mut Observed,
    ) -> Result<Round, kube::Error> {
        for _ in 0..CONFLICT_REREADS {
            let lease = self.read_or_create().await?;
            observed.saw(&lease);
            match self.take(&lease, observed).await? {
                Take::Taken => return Ok(Round::Held),
                Take::NotFree => return Ok(Round::HeldByOther),
                Take::Stale => {}
            }
        }
        Ok(Round::Contended)
    }

    /// The write half of [`LeaseApi::acquire_or_renew`], based on `lease` as read.
    pub(super) async fn take(
        &self,
        lease: &Lease,
        observed: &mut Observed,
    ) -> Result<Take, kube::Error> {
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = holder_of(&spec);
        let ours = holder == Some(self.identity.as_str());
        if holder.is_some() && !ours && !observed.expired(&spec) {
            return Ok(Take::NotFree);
        }
        let now = MicroTime(jiff::Timestamp::now());
        let next = LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(self.duration_secs),
            renew_time: Some(now.clone()),
            acquire_time: if ours {
                spec.acquire_time.clone()
            } else {
                Some(now)
            },
            lease_transitions: if ours || holder.is_none() && spec.lease_transitions.is_none() {
                spec.lease_transitions
            } else {
                Some(spec.lease_transitions.unwrap_or(0).saturating_add(1))
            },
            ..spec
        };
        match self.write(lease, next).await? {
            Some(written) => {
                observed.saw(&written);
                Ok(Take::Taken)
            }
            None => Ok(Take::Stale),
        }
    }

    /// Clears the holder if it is us; someone else's lease is left alone. A conflict means
    /// someone wrote since our read: read again and judge again (a touch of the Lease must
    /// not leave our hold to expire instead of handing it over).
    pub(super) async fn release(&self) -> Result<(), kube::Error> {
        for _ in 0..CONFLICT_REREADS {
            let Some(lease) = self.api.get_opt(&self.name).await? else {
                return Ok(());
            };
            let spec = lease.spec.clone().unwrap_or_default();
            if holder_of(&spec) != Some(self.identity.as_str()) {
                return Ok(());
            }
            let cleared = LeaseSpec {
                holder_identity: None,
                acquire_time: None,
                renew_time: None,
                lease_duration_seconds: None,
                ..spec
            };
            if self.write(&lease, cleared).await?.is_some() {
                return Ok(());
            }
        }
        // Still contended: the lease expires instead, as after a crash.
        Ok(())
    }
}
