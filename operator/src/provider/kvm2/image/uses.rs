//! How clusters that share a host share its base images (issue 19, finding 5).
//!
//! Base volumes are named by content, not by cluster, so two clusters (different
//! `clusterId`) on one host use the same volume for the same image. Each cluster's
//! collector deletes bases of images its own config no longer has, which may be images
//! the other cluster still has configured. Overlays over a base keep it (any cluster's),
//! but a Create of the other cluster that is about to put the first overlay on it cannot
//! be seen in a listing. So each cluster announces which images it uses on a host:
//!
//! - **Announcement** `egress-imguse-<48 hex of the cluster ID's digest>`: a small volume
//!   holding a text record (magic, the cluster ID, a beat that changes on every write,
//!   the digests of the images the cluster's config has, `end`). A Create writes it on
//!   its host right after the image cache made sure of the base, before the overlay
//!   (at most every quarter of the stale window per host, so a burst of Creates writes
//!   it a few times, not once per Create).
//! - **Honoured while fresh**: a collector keeps every retired base that another cluster's
//!   announcement lists, as long as that record changed within the image cache's stale
//!   window (10 min) by the collector's own clock (first sight counts as a change, so a
//!   restarted collector errs on the side of keeping). An announcement it cannot read (a
//!   torn write, a record of a newer format) keeps all retired bases of that host for the
//!   round. A stale one is ignored: that cluster has not made sure of an image there for
//!   the window (its overlays, if any, keep their bases anyway).
//! - The window a collector could still act in: between the other cluster's look at the
//!   base and its announcement, or between the collector's last read of announcements
//!   and its delete (it judges every retired base again on a fresh listing right before
//!   deleting it). A Create that loses that race fails (transient: the overlay's backing
//!   is gone) and its retry uploads the image again.
//!
//! Announcements are never collected; a cluster that leaves a host leaves one small
//! volume behind, which an admin may delete.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::instance::{VolumeName, image_use_name};
use crate::provider::kvm2::ops::{HostOps, OpsError, VolumeEntry};

/// First line of an announcement.
const USE_MAGIC: &str = "egress-operator image use v1";
/// Largest announcement read back: about 18 000 images, far beyond any config.
const MAX_RECORD: u64 = 1024 * 1024;
/// Announcements are written and sized in whole 4 KiB blocks.
const BLOCK: usize = 4096;

/// What another cluster's fresh announcements keep on a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held {
    /// The image digests (as in volume names) listed in fresh announcements.
    Digests(BTreeSet<String>),
    /// A fresh announcement could not be read: keep every retired base this round.
    Unknown,
}

impl Held {
    /// Whether a retired base of this digest must be kept.
    pub fn keeps(&self, digest: &str) -> bool {
        match self {
            Held::Digests(d) => d.contains(digest),
            Held::Unknown => true,
        }
    }
}

/// This cluster's announcements and its view of the other clusters'.
#[derive(Debug)]
pub struct ImageUses {
    cluster_id: String,
    name: String,
    digests: Vec<String>,
    stale_after: Duration,
    beats: AtomicU64,
    /// Per host, when this cluster last wrote its announcement there.
    written: Mutex<BTreeMap<String, Instant>>,
    /// Per host and announcement, the record last seen and since when it is unchanged.
    seen: Mutex<BTreeMap<(String, String), Sighting>>,
}

/// An announcement's record as last seen, and since when it has not changed.
type Sighting = (Vec<u8>, Instant);

/// The announcement's text: magic, cluster, beat, one `image <digest>` per image, `end`.
pub fn record(cluster_id: &str, beat: u64, digests: &[String]) -> Vec<u8> {
    let mut text = format!("{USE_MAGIC}\ncluster {cluster_id}\nbeat {beat}\n");
    for d in digests {
        text.push_str("image ");
        text.push_str(d);
        text.push('\n');
    }
    text.push_str("end\n");
    let mut bytes = text.into_bytes();
    let len = bytes.len().div_ceil(BLOCK).max(1) * BLOCK;
    bytes.resize(len, 0);
    bytes
}

/// The digests an announcement lists; `None` when it is not a whole record of this
/// format (torn, foreign, newer).
pub fn listed(record: &[u8]) -> Option<BTreeSet<String>> {
    let text = record.split(|&b| b == 0).next()?;
    let text = std::str::from_utf8(text).ok()?;
    let mut lines = text.lines();
    if lines.next()? != USE_MAGIC {
        return None;
    }
    let mut out = BTreeSet::new();
    for line in lines {
        if line == "end" {
            return Some(out);
        }
        if let Some(d) = line.strip_prefix("image ") {
            out.insert(d.to_string());
        } else if !(line.starts_with("cluster ") || line.starts_with("beat ")) {
            return None;
        }
    }
    None
}

impl ImageUses {
    /// This cluster's announcements of `digests` (the images its config has), honouring
    /// others' for `stale_after`.
    pub fn new(cluster_id: &str, mut digests: Vec<String>, stale_after: Duration) -> Self {
        digests.sort();
        digests.dedup();
        Self {
            cluster_id: cluster_id.to_string(),
            name: image_use_name(cluster_id),
            digests,
            stale_after,
            beats: AtomicU64::new(0),
            written: Mutex::new(BTreeMap::new()),
            seen: Mutex::new(BTreeMap::new()),
        }
    }

    /// The name of this cluster's announcement volume.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Writes this cluster's announcement on `host` (creating or growing its volume),
    /// unless it was written there within a quarter of the stale window.
    pub async fn announce(
        &self,
        ops: &dyn HostOps,
        host: &str,
        pool: &str,
    ) -> Result<(), OpsError> {
        let now = Instant::now();
        let recent = self
            .written
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(host)
            .is_some_and(|at| now.duration_since(*at) < self.stale_after / 4);
        if recent {
            return Ok(());
        }
        // A beat that differs from every earlier one of this process, and (by the clock)
        // from those of an earlier process: a reader sees a change on every write.
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let beat = wall.max(self.beats.fetch_add(1, Ordering::Relaxed));
        self.beats.fetch_max(beat + 1, Ordering::Relaxed);
        let data = record(&self.cluster_id, beat, &self.digests);
        let size = data.len() as u64;
        match ops.volume(host, pool, &self.name).await? {
            None => {
                let xml = crate::provider::kvm2::volume::raw_volume_xml(&self.name, size);
                ops.create_volume(host, pool, &self.name, xml).await?;
            }
            Some(v) if v.capacity < size => {
                ops.resize_volume(host, pool, &self.name, size).await?;
            }
            Some(_) => {}
        }
        ops.write_volume(host, pool, &self.name, data).await?;
        self.written
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(host.to_string(), now);
        Ok(())
    }

    /// What the other clusters' fresh announcements among `volumes` (a listing of
    /// `host`'s pool) keep. Reads each of them.
    pub async fn held_by_others(
        &self,
        ops: &dyn HostOps,
        host: &str,
        pool: &str,
        volumes: &[VolumeEntry],
    ) -> Result<Held, OpsError> {
        let mut held = BTreeSet::new();
        for v in volumes {
            if v.name == self.name
                || !matches!(
                    VolumeName::parse(&v.name),
                    Some(VolumeName::ImageUse { .. })
                )
            {
                continue;
            }
            let max = v.capacity.clamp(BLOCK as u64, MAX_RECORD) as usize;
            let Some(record) = ops.read_volume(host, pool, &v.name, max).await? else {
                continue; // Deleted since the listing.
            };
            if !self.fresh(host, &v.name, &record) {
                continue;
            }
            match listed(&record) {
                Some(digests) => held.extend(digests),
                None => {
                    tracing::info!(host, volume = %v.name,
                        "another cluster's image announcement cannot be read; keeping every retired image this round");
                    return Ok(Held::Unknown);
                }
            }
        }
        Ok(Held::Digests(held))
    }

    /// Whether `record` changed (or was first seen) within the stale window.
    fn fresh(&self, host: &str, name: &str, record: &[u8]) -> bool {
        let now = Instant::now();
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = (host.to_string(), name.to_string());
        let since = match seen.get_mut(&key) {
            Some((last, since)) if last.as_slice() == record => *since,
            Some(entry) => {
                *entry = (record.to_vec(), now);
                now
            }
            None => {
                seen.insert(key, (record.to_vec(), now));
                now
            }
        };
        now.duration_since(since) < self.stale_after
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_lists_its_digests_and_a_torn_or_foreign_one_lists_nothing() {
        let digests = vec!["a".repeat(48), "b".repeat(48)];
        let r = record("cluster-a", 7, &digests);
        assert_eq!(r.len() % BLOCK, 0);
        assert_eq!(
            listed(&r),
            Some(digests.iter().cloned().collect::<BTreeSet<_>>())
        );
        // Cut before `end`: torn.
        let text_len = r.iter().position(|&b| b == 0).unwrap_or(r.len());
        assert_eq!(listed(&r[..text_len - 4]), None);
        assert_eq!(listed(b"something else\nend\n"), None);
        assert_eq!(
            listed(format!("{USE_MAGIC}\nfuture-field x\nend\n").as_bytes()),
            None
        );
        assert_eq!(listed(&record("c", 1, &[])), Some(BTreeSet::new()));
    }

    #[test]
    fn unknown_keeps_everything() {
        assert!(Held::Unknown.keeps("x"));
        assert!(!Held::Digests(BTreeSet::new()).keeps("x"));
    }
}
