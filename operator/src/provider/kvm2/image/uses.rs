//! How clusters that share a host share its base images (issue 19, finding 5).
//!
//! Base volumes are named by content, not by cluster, so two clusters on one host use the
//! same volume for the same image. Each cluster's collector deletes bases of images its
//! own config no longer has, which may be images the other cluster still has configured.
//! Overlays over a base keep it (any cluster's, by the backing-store check), but a Create
//! of the other cluster that is about to put the first overlay on it cannot be seen in a
//! listing. So each cluster announces which images it uses on a host:
//!
//! - **Announcement** `egress-imguse-<48 hex of the cluster's digest>` (its `clusterId`
//!   and, in a cluster, its `kube-system` UID): a small volume holding a text record
//!   (magic, the cluster ID and UID, a beat that changes on every write, the digests of
//!   the images the cluster's config has, `end`). A Create writes it on its host right
//!   after the image cache made sure of the base, before the overlay (at most every
//!   quarter of the stale window per host, so a burst of Creates writes it a few times).
//! - **Honoured while fresh**: a collector keeps every retired base that another
//!   cluster's announcement lists, as long as that record changed within the image
//!   cache's stale window (10 min) by the collector's own clock (first sight counts as a
//!   change, so a restarted collector errs on the side of keeping). A fresh announcement
//!   it cannot read (a torn write, a newer format) keeps all retired bases of that host,
//!   but only for one stale window: a record that keeps being rewritten unreadably is
//!   then ignored, so it cannot hold every retired image for ever. A stale one is
//!   ignored: that cluster has not made sure of an image there for the window.
//! - **Bounded**: at most [`MAX_ANNOUNCEMENTS`] records of [`MAX_RECORD`] bytes are read
//!   per host and sweep (more keeps every retired base, and says so), and the memory of
//!   records is pruned to the announcements still listed.
//! - **Collected**: an announcement unchanged for [`COLLECT_AFTER_WINDOWS`] stale
//!   windows belongs to a cluster that left the host (a live one rewrites its record on
//!   its next Create, and recreates it if it is gone); it is offered to the collector,
//!   which deletes it after the grace period. Our own is never offered.
//! - The window a collector could still act in: between the other cluster's look at the
//!   base and its announcement, or between the collector's last read of announcements
//!   and its delete (it judges every retired base again on a fresh listing right before
//!   deleting it). A Create that loses that race fails (transient: the overlay's backing
//!   is gone) and its retry uploads the image again.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::cluster_identity::Resolved;
use crate::instance::{VolumeName, image_use_name};
use crate::provider::kvm2::ops::{HostOps, OpsError, VolumeEntry};

/// First line of an announcement.
const USE_MAGIC: &str = "egress-operator image use v1";
/// Largest announcement read back: about 1 100 images, far beyond any config (a record
/// lists the images of one cluster's config).
pub const MAX_RECORD: u64 = 64 * 1024;
/// Most announcements read on one host in one sweep: a host shared by more clusters
/// than this keeps every retired base.
pub const MAX_ANNOUNCEMENTS: usize = 64;
/// Stale windows an announcement stays unchanged before it is offered for collection.
pub const COLLECT_AFTER_WINDOWS: u32 = 6;
/// Announcements are written and sized in whole 4 KiB blocks.
const BLOCK: usize = 4096;

/// What other clusters' fresh announcements keep on a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held {
    /// The image digests (as in volume names) listed in fresh announcements.
    Digests(BTreeSet<String>),
    /// A fresh announcement could not be read, or there were too many to read: keep
    /// every retired base this round.
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

/// What a host's announcements say, other than ours.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Others {
    /// What they keep.
    pub held: Held,
    /// Announcements unchanged for [`COLLECT_AFTER_WINDOWS`] stale windows: their
    /// clusters left the host.
    pub abandoned: Vec<String>,
}

/// This cluster's announcements and its view of the other clusters'.
#[derive(Debug)]
pub struct ImageUses {
    digests: Vec<String>,
    stale_after: Duration,
    beats: AtomicU64,
    /// Per host, when this cluster last wrote its announcement there.
    written: Mutex<BTreeMap<String, Instant>>,
    /// Per host and announcement, what was last seen of it.
    seen: Mutex<BTreeMap<(String, String), Sighting>>,
}

/// An announcement as last seen: its record's digest (not the record: memory stays
/// small whatever a host holds), since when it is unchanged, and since when it has been
/// unreadable, if it is.
#[derive(Debug, Clone, Copy)]
struct Sighting {
    record: [u8; 32],
    since: Instant,
    unreadable_since: Option<Instant>,
}

/// The announcement's text: magic, cluster, UID (in a cluster), beat, one
/// `image <digest>` per image, `end`.
pub fn record(me: &Resolved, beat: u64, digests: &[String]) -> Vec<u8> {
    let mut text = format!("{USE_MAGIC}\ncluster {}\n", me.id);
    if let Some(uid) = &me.uid {
        text.push_str(&format!("uid {uid}\n"));
    }
    text.push_str(&format!("beat {beat}\n"));
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
        } else if !["cluster ", "uid ", "beat "]
            .iter()
            .any(|p| line.starts_with(p))
        {
            return None;
        }
    }
    None
}

/// The name of `me`'s announcement.
pub fn name_of(me: &Resolved) -> String {
    image_use_name(&me.id, me.uid.as_deref())
}

impl ImageUses {
    /// This cluster's announcements of `digests` (the images its config has), honouring
    /// others' for `stale_after`.
    pub fn new(mut digests: Vec<String>, stale_after: Duration) -> Self {
        digests.sort();
        digests.dedup();
        Self {
            digests,
            stale_after,
            beats: AtomicU64::new(0),
            written: Mutex::new(BTreeMap::new()),
            seen: Mutex::new(BTreeMap::new()),
        }
    }

    /// Writes `me`'s announcement on `host` unless it did within a quarter of the
    /// stale window.
    pub async fn announce(
        &self,
        me: &Resolved,
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
        // A beat that only grows, also across restarts (the wall clock in ms), so every
        // write changes the record.
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let beat = wall.max(self.beats.fetch_add(1, Ordering::Relaxed));
        self.beats.fetch_max(beat + 1, Ordering::Relaxed);
        let data = record(me, beat, &self.digests);
        let size = data.len() as u64;
        let name = name_of(me);
        match ops.volume(host, pool, &name).await? {
            None => {
                let xml = crate::provider::kvm2::volume::raw_volume_xml(&name, size);
                ops.create_volume(host, pool, &name, xml).await?;
            }
            Some(v) if v.capacity < size => {
                ops.resize_volume(host, pool, &name, size).await?;
            }
            Some(_) => {}
        }
        ops.write_volume(host, pool, &name, data).await?;
        self.written
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(host.to_string(), now);
        Ok(())
    }

    /// Reads the other clusters' announcements among `volumes` (a fresh listing of the
    /// host's pool): what they keep, and which were abandoned.
    pub async fn others(
        &self,
        me: &Resolved,
        ops: &dyn HostOps,
        host: &str,
        pool: &str,
        volumes: &[VolumeEntry],
    ) -> Result<Others, OpsError> {
        let ours = name_of(me);
        let theirs: Vec<&VolumeEntry> = volumes
            .iter()
            .filter(|v| {
                v.name != ours
                    && matches!(
                        VolumeName::parse(&v.name),
                        Some(VolumeName::ImageUse { .. })
                    )
            })
            .collect();
        self.prune(host, &theirs);
        if theirs.len() > MAX_ANNOUNCEMENTS {
            tracing::warn!(
                host,
                announcements = theirs.len(),
                max = MAX_ANNOUNCEMENTS,
                "more image announcements than are read; keeping every retired image this round"
            );
            return Ok(Others {
                held: Held::Unknown,
                abandoned: Vec::new(),
            });
        }
        let mut held = BTreeSet::new();
        let mut unknown = false;
        let mut abandoned = Vec::new();
        for v in theirs {
            let max = v.capacity.clamp(BLOCK as u64, MAX_RECORD) as usize;
            let Some(record) = ops.read_volume(host, pool, &v.name, max).await? else {
                continue; // Deleted since the listing.
            };
            let digests = listed(&record);
            let sighting = self.sight(host, &v.name, &record, digests.is_some());
            let now = Instant::now();
            let unchanged = now.duration_since(sighting.since);
            if unchanged >= self.stale_after * COLLECT_AFTER_WINDOWS {
                abandoned.push(v.name.clone());
            }
            if unchanged >= self.stale_after {
                continue;
            }
            match (digests, sighting.unreadable_since) {
                (Some(d), _) => held.extend(d),
                (None, Some(since)) if now.duration_since(since) < self.stale_after => {
                    tracing::info!(host, volume = %v.name,
                        "another cluster's image announcement cannot be read; keeping every retired image this round");
                    unknown = true;
                }
                (None, _) => {
                    tracing::warn!(host, volume = %v.name,
                        "an image announcement has been unreadable for longer than the stale window; ignored");
                }
            }
        }
        Ok(Others {
            held: if unknown {
                Held::Unknown
            } else {
                Held::Digests(held)
            },
            abandoned,
        })
    }

    /// Records a sighting of the announcement `name` on `host` and returns it.
    fn sight(&self, host: &str, name: &str, record: &[u8], readable: bool) -> Sighting {
        let now = Instant::now();
        let digest: [u8; 32] = Sha256::digest(record).into();
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let entry = seen
            .entry((host.to_string(), name.to_string()))
            .or_insert(Sighting {
                record: digest,
                since: now,
                unreadable_since: None,
            });
        if entry.record != digest {
            entry.record = digest;
            entry.since = now;
        }
        entry.unreadable_since = match (readable, entry.unreadable_since) {
            (true, _) => None,
            (false, Some(since)) => Some(since),
            (false, None) => Some(now),
        };
        *entry
    }

    /// Forgets the announcements of `host` that are no longer listed.
    fn prune(&self, host: &str, listed: &[&VolumeEntry]) {
        let names: BTreeSet<&str> = listed.iter().map(|v| v.name.as_str()).collect();
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .retain(|(h, n), _| h != host || names.contains(n.as_str()));
    }

    /// How many announcements are remembered (tests: the memory is pruned).
    pub fn remembered(&self) -> usize {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_lists_its_digests_and_a_torn_or_foreign_one_lists_nothing() {
        let digests = vec!["a".repeat(48), "b".repeat(48)];
        let me = Resolved {
            id: "cluster-a".into(),
            uid: Some("0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887".into()),
        };
        let r = record(&me, 7, &digests);
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
        let cli = Resolved {
            id: "c".into(),
            uid: None,
        };
        assert_eq!(listed(&record(&cli, 1, &[])), Some(BTreeSet::new()));
    }

    use crate::provider::kvm2::fake::FakeOps;

    const STALE: Duration = Duration::from_millis(200);

    fn me() -> Resolved {
        Resolved {
            id: "ours".into(),
            uid: Some("0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887".into()),
        }
    }

    async fn read(uses: &ImageUses, ops: &FakeOps) -> Others {
        let volumes = ops.list_volumes("h1", "default").await.unwrap();
        uses.others(&me(), ops, "h1", "default", &volumes)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn an_announcement_rewritten_unreadably_holds_for_one_window_only() {
        let ops = FakeOps::new(&["h1"], 1 << 30);
        let uses = ImageUses::new(Vec::new(), STALE);
        let theirs = image_use_name("theirs", None);
        ops.put_volume("h1", &theirs, b"torn 1");
        assert_eq!(read(&uses, &ops).await.held, Held::Unknown);
        tokio::time::sleep(STALE / 2).await;
        ops.put_volume("h1", &theirs, b"torn 2");
        assert_eq!(
            read(&uses, &ops).await.held,
            Held::Unknown,
            "fresh and torn"
        );
        tokio::time::sleep(STALE).await;
        ops.put_volume("h1", &theirs, b"torn 3");
        assert_eq!(
            read(&uses, &ops).await.held,
            Held::Digests(BTreeSet::new()),
            "unreadable for longer than the window: ignored"
        );
        // Readable again: honoured again.
        let other = Resolved {
            id: "theirs".into(),
            uid: None,
        };
        ops.put_volume("h1", &theirs, &record(&other, 9, &["d".repeat(48)]));
        assert_eq!(
            read(&uses, &ops).await.held,
            Held::Digests(["d".repeat(48)].into_iter().collect())
        );
    }

    #[tokio::test]
    async fn abandoned_announcements_are_offered_ours_never_and_memory_is_pruned() {
        let ops = FakeOps::new(&["h1"], 1 << 30);
        let uses = ImageUses::new(vec!["a".repeat(48)], STALE);
        uses.announce(&me(), &ops, "h1", "default").await.unwrap();
        let theirs = image_use_name("theirs", Some("7f00aa01-0000-4000-8000-000000000001"));
        let other = Resolved {
            id: "theirs".into(),
            uid: Some("7f00aa01-0000-4000-8000-000000000001".into()),
        };
        ops.put_volume("h1", &theirs, &record(&other, 1, &["b".repeat(48)]));
        let first = read(&uses, &ops).await;
        assert!(first.held.keeps(&"b".repeat(48)));
        assert!(
            !first.held.keeps(&"a".repeat(48)),
            "our own is not read as theirs"
        );
        assert!(first.abandoned.is_empty());
        tokio::time::sleep(STALE * COLLECT_AFTER_WINDOWS).await;
        let later = read(&uses, &ops).await;
        assert_eq!(later.held, Held::Digests(BTreeSet::new()), "stale");
        assert_eq!(
            later.abandoned,
            vec![theirs.clone()],
            "ours is never offered"
        );
        assert_eq!(uses.remembered(), 1);
        ops.delete_volume("h1", "default", &theirs).await.unwrap();
        read(&uses, &ops).await;
        assert_eq!(uses.remembered(), 0, "gone from the host: forgotten");
    }

    #[tokio::test]
    async fn more_announcements_than_are_read_keep_everything() {
        let ops = FakeOps::new(&["h1"], 1 << 30);
        let uses = ImageUses::new(Vec::new(), STALE);
        for i in 0..=MAX_ANNOUNCEMENTS {
            let other = Resolved {
                id: format!("c{i}"),
                uid: None,
            };
            ops.put_volume("h1", &name_of(&other), &record(&other, 1, &[]));
        }
        let read = read(&uses, &ops).await;
        assert_eq!(read.held, Held::Unknown);
        assert_eq!(uses.remembered(), 0, "none was read");
    }

    #[test]
    fn unknown_keeps_everything() {
        assert!(Held::Unknown.keeps("x"));
        assert!(!Held::Digests(BTreeSet::new()).keeps("x"));
    }
}
