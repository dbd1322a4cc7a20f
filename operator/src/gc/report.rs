//! What one sweep saw and did: the [`GcReport`] and the reasons in it.

use super::GcError;
use super::volumes::{VolumeKeep, VolumeRef};
use crate::error::ErrorClass;
use crate::provider::InstanceId;

/// Why an instance is collected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OrphanReason {
    /// No Proxy has its UID.
    NoProxy,
    /// Its Proxy's status names another instance.
    Duplicate {
        /// The instance the status names.
        named: InstanceId,
    },
}

impl OrphanReason {
    /// Stable label for logs and metrics.
    pub fn as_str(&self) -> &'static str {
        match self {
            OrphanReason::NoProxy => "no-proxy",
            OrphanReason::Duplicate { .. } => "duplicate",
        }
    }
}

/// Why an instance is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeepReason {
    /// Its mark has no owner UID (cannot happen through a correct provider).
    NoOwnerUid,
    /// Its Proxy's status names it.
    Named,
    /// Its Proxy names no instance yet: a Create may be about to write this one.
    NotYetNamed,
    /// Its Proxy names another instance but is provisioning: a Create of a replacement
    /// (or an adoption of this very instance) may be in flight and own it.
    CreateInProgress,
    /// The fresh read of its Proxy right before the delete failed: nothing is deleted
    /// on a guess.
    Unconfirmed {
        /// Class of the failed read.
        class: ErrorClass,
    },
    /// It is an orphan, but younger than the grace period.
    Young {
        /// Age in seconds (negative if the host's clock is ahead).
        age_seconds: i64,
    },
    /// Its `created_at` does not parse as RFC 3339: what cannot be dated is not deleted.
    Undatable {
        /// The value found.
        created_at: String,
    },
}

/// An instance of one provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceRef {
    /// Provider name.
    pub provider: String,
    /// The instance.
    pub id: InstanceId,
}

/// A target whose listing failed: nothing on it was judged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedTarget {
    /// Provider name.
    pub provider: String,
    /// Target (host) name.
    pub target: String,
    /// Class of the failure.
    pub class: ErrorClass,
    /// The failure.
    pub message: String,
}

/// An instance kept, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kept {
    /// The instance.
    pub instance: InstanceRef,
    /// Why.
    pub reason: KeepReason,
}

/// An instance deleted, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deleted {
    /// The instance.
    pub instance: InstanceRef,
    /// The UID in its mark.
    pub proxy_uid: String,
    /// Why.
    pub reason: OrphanReason,
}

/// A delete that failed.
#[derive(Debug)]
pub struct FailedDelete {
    /// The instance.
    pub instance: InstanceRef,
    /// Why it was to be deleted.
    pub reason: OrphanReason,
    /// The failure.
    pub error: GcError,
}

/// What one sweep saw and did.
#[derive(Debug, Default)]
pub struct GcReport {
    /// Every instance listed (on targets that answered).
    pub seen: Vec<InstanceRef>,
    /// Targets whose listing failed.
    pub skipped_targets: Vec<SkippedTarget>,
    /// Set when the Proxies could not be listed: then nothing was judged or deleted.
    pub owners_error: Option<GcError>,
    /// Instances judged and kept.
    pub kept: Vec<Kept>,
    /// Instances deleted.
    pub deleted: Vec<Deleted>,
    /// Deletes that failed.
    pub failed: Vec<FailedDelete>,
    /// Set when shutdown stopped the sweep before it judged everything.
    pub interrupted: bool,
    /// Proxies whose status names an instance on a host no provider lists any more (the
    /// host was removed from the config): that VM is abandoned, not collected.
    pub unconfigured: Vec<Unconfigured>,
    /// Leftover volumes deleted.
    pub volumes_deleted: Vec<VolumeRef>,
    /// Leftover volumes kept, and why.
    pub volumes_kept: Vec<(VolumeRef, VolumeKeep)>,
    /// Leftover volumes whose delete failed.
    pub volumes_failed: Vec<(VolumeRef, GcError)>,
    /// Targets whose volume listing failed: nothing on them was judged.
    pub volume_targets_skipped: Vec<SkippedTarget>,
}

/// An instance a Proxy names on a host that is not configured any more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unconfigured {
    /// The instance the Proxy's status names.
    pub instance: InstanceId,
    /// Proxy namespace.
    pub namespace: String,
    /// Proxy name.
    pub name: String,
}

impl GcReport {
    /// IDs of the deleted instances.
    pub fn deleted_ids(&self) -> Vec<&InstanceId> {
        self.deleted.iter().map(|d| &d.instance.id).collect()
    }

    /// Why `id` was kept, if it was.
    pub fn kept_reason(&self, id: &InstanceId) -> Option<&KeepReason> {
        self.kept
            .iter()
            .find(|k| &k.instance.id == id)
            .map(|k| &k.reason)
    }

    pub(super) fn result(&self) -> &'static str {
        if self.owners_error.is_some() {
            "skipped"
        } else if self.interrupted {
            "interrupted"
        } else if !self.skipped_targets.is_empty() || !self.volume_targets_skipped.is_empty() {
            "partial"
        } else {
            "ok"
        }
    }
}
