//! The base image cache: one verified volume per image per host.
//!
//! ## Commit protocol (rename-free: exclusive creates, a heartbeat with an owner token)
//!
//! libvirt cannot rename a volume, but it refuses to create a volume whose name is taken.
//! That exclusive create is the only atomic primitive the protocol needs; everything else
//! is judged from a small record the owner of an upload writes.
//!
//! - **Data volume** `egress-image-<48 hex of sha256>`: whoever creates it (empty, before
//!   opening the download, so a losing replica never downloads) is the uploader. It sizes
//!   it from the Content-Length and streams the download into it while hashing.
//! - **Heartbeat** `egress-imghb-<48 hex>`: one 512-byte record, *token + beat count*,
//!   written by the owner of the upload: right after it created the data volume (or took
//!   it over), then every quarter of [`ImageCacheOptions::stale_after`] while bytes move.
//!   The token (random per Create) names the owner; the beat shows it is alive. Waiters
//!   judge an upload dead when this record has not changed for `stale_after`, never by the
//!   data volume's allocation (LVM and RBD pools do not show it grow).
//! - **Marker volume** `egress-imgok-<48 hex>` (empty, sparse): created only after the
//!   hash of everything written matched the config's sha256. *A data volume is used only
//!   when its marker exists* (invariant 4). Its capacity records the image's virtual size
//!   (read from the qcow2 header while downloading), so every later Create sizes its
//!   overlay from it without reading the image; a marker from before this record (capacity
//!   0) falls back to the data volume's size. A pool that rounds sizes up (LVM extents)
//!   records at most one extent more, which errs towards a larger overlay (and refuses a
//!   disk exactly the image's size unless that size is a whole number of extents).
//! - **Takeover claim** `egress-imgtk-<48 hex>` (empty, exclusive): a waiter that judged
//!   the upload dead creates it first, so one taker at a time deletes the dead volume.
//!   It writes its own token into the heartbeat *before* it deletes anything, deletes the
//!   data volume and uploads as above; then removes the claim. A taker that loses the
//!   data volume's create to a fresh uploader releases its claim at once and waits. A
//!   claim whose holder's heartbeat stays unchanged for another stale window is removed.
//!
//! The token is the fence. Every owner re-reads the heartbeat before each beat and before
//! it commits: another token means it was judged dead and taken over, so it stops, and
//! neither commits nor deletes anything (the volume is the new owner's). A failing
//! uploader deletes the data volume only while the heartbeat still carries its token and
//! no marker exists, so a late failing uploader never deletes a committed image. Before
//! committing, the owner also checks that the data volume is still there at its size: a
//! late taker's delete that was already in flight when it was fenced may have removed it,
//! and then the upload is done again instead of committing a marker over nothing.
//!
//! What remains assumed: no participant stays frozen *inside* one step, after its last
//! check and before its libvirt call lands, for longer than the stale window (10 minutes
//! by default; each step is one call with a far shorter deadline). libvirt volumes have no
//! compare-and-swap, so a check and the act it guards cannot be one operation.
//!
//! Racing Creates in one process take a keyed lock per host + image first, so one
//! uploads and the others find the marker. Racing *replicas* meet at the exclusive create
//! and the heartbeat, as above. A marker whose data volume is gone is deleted and the
//! image cached again.
//!
//! ## Deadlines
//!
//! The download has its own deadline ([`fetch::download_deadline`]: a floor, or the image
//! at a minimum rate) besides its idle timeout; a download that misses it fails this
//! Create with a typed, transient [`fetch::FetchError::TooSlow`] and aborts the upload
//! stream, which is not a link failure. The libvirt upload's deadline is the download's
//! plus its own ([`upload_deadline`]), so however long the download takes within its
//! deadline, the upload still has its own whole deadline after the last byte: waiting on
//! the HTTP server never eats into it.
//!
//! Memory stays flat: chunks go from the HTTP body through a small bounded channel into a
//! libvirt stream on a blocking thread, never into a buffer of the image's size.
//!
//! ## Throughput
//!
//! Download, hash and upload overlap: this task reads and hashes the body while the
//! blocking thread sends earlier pieces, `CHANNEL_PIECES` apart. Profiled on a 2-core
//! machine (`make bench`), our own process costs little (sha256 runs in SHA-NI at over
//! 1 GB/s); what limits the rate is the host's side, sshd and libvirtd, per packet and per
//! message. So the bytes reach them in the largest units each accepts: 256 KiB libvirt
//! stream messages ([`chunks`]), which the tunnel reads whole and sends as full 32 KiB
//! SSH packets, encrypted with AES-GCM where the CPU has AES instructions (see
//! `link::ssh`). Nothing is read back after the upload: the hash is taken on the bytes
//! as they pass.

pub mod chunks;
pub mod fetch;
pub mod qcow2;
pub mod uses;

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;

use self::fetch::{FetchError, FetchPolicy};
use super::locks::KeyedLocks;
use super::ops::{Created, HostOps, OpsError};
use crate::config::{HostConfig, ImageConfig, ImageFormat};
use crate::error::{Classified, ErrorClass};
use crate::instance::{
    image_heartbeat_name, image_marker_name, image_takeover_name, image_volume_name,
};

/// Pieces buffered between the download and the upload: with [`chunks::STREAM_PIECE`]
/// (256 KiB) pieces, 2 MiB in flight whatever the image size, enough for the download
/// to run ahead while the upload waits on the link.
const CHANNEL_PIECES: usize = 8;
/// Progress is logged at most this often.
const LOG_EVERY: Duration = Duration::from_secs(5);

/// Size of the heartbeat record: one sector, which every pool backend can write.
pub(crate) const HEARTBEAT_LEN: usize = 512;
/// First line of a heartbeat record.
const HEARTBEAT_MAGIC: &str = "egress-image-heartbeat v1";

/// A failure caching an image.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The download failed or did not verify.
    #[error("image {image:?} for host {host:?}: {source}")]
    Fetch {
        /// Host.
        host: String,
        /// Image name.
        image: String,
        /// What went wrong.
        #[source]
        source: FetchError,
    },
    /// A libvirt operation failed.
    #[error("image {image:?} on host {host:?}: {source}")]
    Ops {
        /// Host.
        host: String,
        /// Image name.
        image: String,
        /// What went wrong.
        #[source]
        source: OpsError,
    },
    /// The pool has no room for the image.
    #[error(
        "image {image:?} ({needed} bytes) does not fit in pool {pool:?} on host {host:?} \
         ({available} bytes free)"
    )]
    NoSpace {
        /// Host.
        host: String,
        /// Pool.
        pool: String,
        /// Image name.
        image: String,
        /// Bytes the image needs.
        needed: u64,
        /// Bytes free.
        available: u64,
    },
    /// The server did not say how large the image is.
    #[error(
        "image {image:?}: the server sent no Content-Length; the cache needs the size up \
         front to check the pool's free space and size the volume"
    )]
    UnknownSize {
        /// Image name.
        image: String,
    },
    /// The image is configured as qcow2 but its verified content has no usable qcow2
    /// header: the config's `format` is wrong for this file.
    #[error("image {image:?} is configured as qcow2, but {source}")]
    NotQcow2 {
        /// Image name.
        image: String,
        /// What is wrong with the header.
        #[source]
        source: qcow2::HeaderError,
    },
    /// The requested root disk is smaller than the disk inside the image.
    #[error(transparent)]
    DiskTooSmall(#[from] DiskTooSmall),
    /// Our upload was taken over by another replica (we were silent past the stale
    /// window). Internal to the cache: the Create goes back to waiting for the new owner.
    #[error("image {image:?} on host {host:?}: another replica took over this upload")]
    TakenOver {
        /// Host.
        host: String,
        /// Image name.
        image: String,
    },
    /// Another uploader neither committed nor went stale in time.
    #[error(
        "image {image:?} on host {host:?}: gave up waiting for another uploader after {waited:?}"
    )]
    WaitTimeout {
        /// Host.
        host: String,
        /// Image name.
        image: String,
        /// How long we waited.
        waited: Duration,
    },
}

/// The requested root disk is smaller than the disk inside the image: the guest would
/// see a disk cut short of its own partitions. Permanent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "machine type {machine_type:?} asks for a {requested}-byte root disk ({}), smaller than \
     image {image:?}'s virtual size of {virtual_size} bytes ({}); use a machine type with \
     diskGiB of at least {}",
    gib(*requested), gib(*virtual_size), virtual_size.div_ceil(1 << 30)
)]
pub struct DiskTooSmall {
    /// Image name.
    pub image: String,
    /// Machine type name.
    pub machine_type: String,
    /// Bytes the machine type asks for.
    pub requested: u64,
    /// The image's virtual size in bytes.
    pub virtual_size: u64,
}

/// `N GiB` with up to two decimals, for messages.
fn gib(bytes: u64) -> String {
    let g = bytes as f64 / f64::from(1u32 << 30);
    format!("{} GiB", (g * 100.0).round() / 100.0)
}

impl ImageError {
    /// The download arrived but is not the configured image: its sha256 or its length
    /// differs. Counted on its own because no retry helps (the source or the config is
    /// wrong), unlike a transfer that broke off.
    pub fn is_verification_failure(&self) -> bool {
        matches!(
            self,
            ImageError::Fetch {
                source: FetchError::DigestMismatch { .. } | FetchError::LengthMismatch { .. },
                ..
            }
        )
    }
}

impl Classified for ImageError {
    fn class(&self) -> ErrorClass {
        match self {
            ImageError::Fetch { source, .. } => source.class(),
            ImageError::Ops { source, .. } => source.class(),
            ImageError::NoSpace { .. } => ErrorClass::Quota,
            ImageError::UnknownSize { .. }
            | ImageError::NotQcow2 { .. }
            | ImageError::DiskTooSmall { .. } => ErrorClass::Permanent,
            ImageError::WaitTimeout { .. } | ImageError::TakenOver { .. } => ErrorClass::Transient,
        }
    }
}

/// A verified base volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseVolume {
    /// Volume name in the host's pool.
    pub volume: String,
    /// Its format, for the overlay's backing store.
    pub format: ImageFormat,
    /// Whether this call uploaded it (false: it was cached).
    pub uploaded: bool,
    /// The disk size the image holds (a qcow2's virtual size, a raw image's length), as
    /// the commit marker records it; `None` for a marker written before that record.
    pub virtual_size: Option<u64>,
}

/// The root overlay's capacity: the requested size, never less than the image's virtual
/// size. A request smaller than the image is refused (permanent) rather than grown in
/// silence: the machine type would promise a disk it does not give. Without a recorded
/// virtual size, the base volume's own size (`base_capacity`) is the floor.
pub fn overlay_capacity(
    image: &ImageConfig,
    machine_type: &str,
    base: &BaseVolume,
    requested: u64,
    base_capacity: u64,
) -> Result<u64, DiskTooSmall> {
    match base.virtual_size {
        Some(virtual_size) if requested < virtual_size => Err(DiskTooSmall {
            image: image.name.clone(),
            machine_type: machine_type.to_string(),
            requested,
            virtual_size,
        }),
        Some(virtual_size) => Ok(requested.max(virtual_size)),
        None => Ok(requested.max(base_capacity)),
    }
}

/// Progress of one upload, for log lines, metrics and the CLI's bar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UploadProgress {
    /// Host.
    pub host: String,
    /// Image name.
    pub image: String,
    /// Bytes uploaded so far.
    pub done: u64,
    /// Total bytes.
    pub total: u64,
}

/// Receives upload progress (the CLI draws a bar with it).
pub type ProgressFn = Arc<dyn Fn(&UploadProgress) + Send + Sync>;

/// Tunables of the cache.
#[derive(Clone)]
pub struct ImageCacheOptions {
    /// Download policy (timeouts, deadline, redirects, extra CA for tests).
    pub fetch: FetchPolicy,
    /// An upload whose heartbeat record has not changed for this long is taken over. Its
    /// owner beats four times per window while bytes move.
    pub stale_after: Duration,
    /// How often a waiter looks for the marker.
    pub poll_every: Duration,
    /// Longest wait for another uploader before a transient error.
    pub max_wait: Duration,
    /// Floor of the upload's own deadline; large images get more (see
    /// [`upload_deadline`]). The libvirt call gets this *plus* the download's deadline.
    pub min_upload_deadline: Duration,
    /// Where progress goes besides logs and metrics.
    pub progress: Option<ProgressFn>,
}

impl std::fmt::Debug for ImageCacheOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageCacheOptions")
            .field("stale_after", &self.stale_after)
            .field("poll_every", &self.poll_every)
            .field("max_wait", &self.max_wait)
            .finish_non_exhaustive()
    }
}

impl Default for ImageCacheOptions {
    fn default() -> Self {
        Self {
            fetch: FetchPolicy::default(),
            stale_after: Duration::from_secs(10 * 60),
            poll_every: Duration::from_secs(2),
            max_wait: Duration::from_secs(60 * 60),
            min_upload_deadline: Duration::from_secs(10 * 60),
            progress: None,
        }
    }
}

/// The upload's own deadline for `size` bytes: the floor, or 1 MiB/s, whichever is
/// longer, so a stuck stream is abandoned but a large image on a slow link is not.
pub fn upload_deadline(floor: Duration, size: u64) -> Duration {
    floor.max(Duration::from_secs(size / (1024 * 1024)))
}

/// A token no other Create (in this process or another replica) will pick: the owner's
/// name in the heartbeat. Hashed from the process's randomly keyed hasher, the process
/// id, the time and a counter.
fn new_token() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut out = String::with_capacity(32);
    for round in 0..2u64 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(round);
        h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        h.write_u32(std::process::id());
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        h.write_u128(nanos);
        out.push_str(&format!("{:016x}", h.finish()));
    }
    out
}

/// The heartbeat record: magic, token and beat count, zero-padded to one sector.
fn heartbeat_record(token: &str, beat: u64) -> Vec<u8> {
    let mut r = format!("{HEARTBEAT_MAGIC}\ntoken {token}\nbeat {beat}\n").into_bytes();
    r.resize(HEARTBEAT_LEN, 0);
    r
}

/// The token of a heartbeat record; `None` for anything else (absent, torn, foreign).
fn heartbeat_token(record: &[u8]) -> Option<&str> {
    let text = record.split(|&b| b == 0).next()?;
    let text = std::str::from_utf8(text).ok()?;
    let mut lines = text.lines();
    if lines.next()? != HEARTBEAT_MAGIC {
        return None;
    }
    lines.next()?.strip_prefix("token ")
}

/// Labels of the image metrics.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ImageLabels {
    /// Host.
    pub host: String,
    /// Image name.
    pub image: String,
}

/// Labels of the upload outcome counter.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// Host.
    pub host: String,
    /// Image name.
    pub image: String,
    /// `ok` or the error class.
    pub outcome: String,
}

/// Metrics of the image cache.
#[derive(Debug, Clone, Default)]
pub struct ImageMetrics {
    uploaded_bytes: Family<ImageLabels, Counter>,
    upload_progress: Family<ImageLabels, Gauge>,
    uploads: Family<OutcomeLabels, Counter>,
    hits: Family<ImageLabels, Counter>,
    verification_failures: Family<ImageLabels, Counter>,
}

impl ImageMetrics {
    /// Metrics registered under `egress_image_*`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "egress_image_uploaded_bytes",
            "bytes of base images uploaded, by host and image",
            m.uploaded_bytes.clone(),
        );
        registry.register(
            "egress_image_upload_progress_bytes",
            "bytes written by the upload in progress, by host and image",
            m.upload_progress.clone(),
        );
        registry.register(
            "egress_image_uploads",
            "finished image uploads by host, image and outcome",
            m.uploads.clone(),
        );
        registry.register(
            "egress_image_cache_hits",
            "Creates that found the image already cached",
            m.hits.clone(),
        );
        registry.register(
            "egress_image_verification_failures",
            "downloads whose content was not the configured image (sha256 or length differ): \
             the source serves something else, or the configured digest is wrong",
            m.verification_failures.clone(),
        );
        m
    }

    /// Downloads that failed verification (for tests).
    pub fn verification_failures(&self, host: &str, image: &str) -> u64 {
        self.verification_failures
            .get_or_create(&ImageLabels {
                host: host.into(),
                image: image.into(),
            })
            .get()
    }

    /// Finished uploads with this outcome (for tests).
    pub fn uploads(&self, host: &str, image: &str, outcome: &str) -> u64 {
        self.uploads
            .get_or_create(&OutcomeLabels {
                host: host.into(),
                image: image.into(),
                outcome: outcome.into(),
            })
            .get()
    }
}

/// The cache over every host.
pub struct ImageCache {
    ops: Arc<dyn HostOps>,
    locks: KeyedLocks,
    options: ImageCacheOptions,
    metrics: ImageMetrics,
}

impl std::fmt::Debug for ImageCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageCache")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

enum Seen {
    /// Marker and data: the marker's capacity is the recorded virtual size (0: none).
    Committed {
        recorded: u64,
    },
    /// Marker without data: a broken cache entry.
    Orphan,
    /// Data without marker: someone uploading, or a dead uploader's leftovers.
    Staging,
    Absent,
}

/// How an upload attempt ended, short of an error.
enum Upload {
    /// Verified and committed.
    Done(BaseVolume),
    /// Another uploader created the data volume first; it owns the upload.
    Lost,
    /// We no longer own the upload (taken over), or our volume vanished under us: look
    /// again and wait for, or redo, the upload.
    Superseded,
}

/// One Create's part in the protocol, for the calls it makes on the way.
struct Attempt<'a> {
    host: &'a HostConfig,
    image: &'a ImageConfig,
    labels: ImageLabels,
    token: String,
}

impl Attempt<'_> {
    fn h(&self) -> &str {
        &self.host.name
    }
    fn pool(&self) -> &str {
        &self.host.storage_pool
    }
    fn data(&self) -> String {
        image_volume_name(&self.image.sha256)
    }
    fn marker(&self) -> String {
        image_marker_name(&self.image.sha256)
    }
    fn heartbeat(&self) -> String {
        image_heartbeat_name(&self.image.sha256)
    }
    fn claim(&self) -> String {
        image_takeover_name(&self.image.sha256)
    }
    fn ops_err(&self, source: OpsError) -> ImageError {
        ImageError::Ops {
            host: self.host.name.clone(),
            image: self.image.name.clone(),
            source,
        }
    }
    fn fetch_err(&self, source: FetchError) -> ImageError {
        ImageError::Fetch {
            host: self.host.name.clone(),
            image: self.image.name.clone(),
            source,
        }
    }
    fn taken_over(&self) -> ImageError {
        ImageError::TakenOver {
            host: self.host.name.clone(),
            image: self.image.name.clone(),
        }
    }
}

impl ImageCache {
    /// A cache using `ops`.
    pub fn new(ops: Arc<dyn HostOps>, options: ImageCacheOptions, metrics: ImageMetrics) -> Self {
        Self {
            ops,
            locks: KeyedLocks::new(),
            options,
            metrics,
        }
    }

    /// The metrics (for tests).
    pub fn metrics(&self) -> &ImageMetrics {
        &self.metrics
    }

    async fn look(&self, a: &Attempt<'_>) -> Result<Seen, ImageError> {
        let marker = self
            .ops
            .volume(a.h(), a.pool(), &a.marker())
            .await
            .map_err(|e| a.ops_err(e))?;
        let data = self
            .ops
            .volume(a.h(), a.pool(), &a.data())
            .await
            .map_err(|e| a.ops_err(e))?;
        Ok(match (marker, data) {
            (Some(m), Some(_)) => Seen::Committed {
                recorded: m.capacity,
            },
            (Some(_), None) => Seen::Orphan,
            (None, Some(_)) => Seen::Staging,
            (None, None) => Seen::Absent,
        })
    }

    /// The heartbeat record as it is now (`None`: absent).
    async fn read_heartbeat(&self, a: &Attempt<'_>) -> Result<Option<Vec<u8>>, ImageError> {
        self.ops
            .read_volume(a.h(), a.pool(), &a.heartbeat(), HEARTBEAT_LEN)
            .await
            .map_err(|e| a.ops_err(e))
    }

    /// Whether the heartbeat names us as the owner of the upload.
    async fn owns(&self, a: &Attempt<'_>) -> Result<bool, ImageError> {
        let record = self.read_heartbeat(a).await?;
        Ok(record.as_deref().and_then(heartbeat_token) == Some(a.token.as_str()))
    }

    /// Writes our token and `beat` into the heartbeat, creating it if needed. Blind: only
    /// right after an exclusive create (data volume or claim) made us the owner.
    async fn write_heartbeat(&self, a: &Attempt<'_>, beat: u64) -> Result<(), ImageError> {
        let name = a.heartbeat();
        let xml = super::volume::raw_volume_xml(&name, HEARTBEAT_LEN as u64);
        self.ops
            .create_volume(a.h(), a.pool(), &name, xml)
            .await
            .map_err(|e| a.ops_err(e))?;
        self.ops
            .write_volume(a.h(), a.pool(), &name, heartbeat_record(&a.token, beat))
            .await
            .map_err(|e| a.ops_err(e))
    }

    /// One beat: `Ok(false)` when the heartbeat names another owner (we were taken over;
    /// it is not overwritten).
    async fn beat(&self, a: &Attempt<'_>, beat: u64) -> Result<bool, ImageError> {
        if !self.owns(a).await? {
            return Ok(false);
        }
        self.ops
            .write_volume(
                a.h(),
                a.pool(),
                &a.heartbeat(),
                heartbeat_record(&a.token, beat),
            )
            .await
            .map_err(|e| a.ops_err(e))?;
        Ok(true)
    }

    /// Removes a volume, logging (not returning) a failure: cleanup that a later Create
    /// or the GC redoes.
    async fn remove(&self, a: &Attempt<'_>, name: &str, what: &str) {
        if let Err(e) = self.ops.delete_volume(a.h(), a.pool(), name).await {
            tracing::warn!(host = a.h(), image = %a.image.name, volume = name, error = %e,
                "could not remove the {what}");
        }
    }

    /// Cleans up after our failed upload, only while it is still ours: the heartbeat
    /// carries our token and no marker exists. A taken-over or committed image is never
    /// touched by a late failing uploader.
    async fn abandon(&self, a: &Attempt<'_>) {
        match self.owns(a).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::info!(host = a.h(), image = %a.image.name,
                    "upload failed after another replica took it over; leaving its volume alone");
                return;
            }
            Err(e) => {
                tracing::warn!(host = a.h(), image = %a.image.name, error = %e,
                    "cannot tell whether the failed upload is still ours; leaving it for a taker");
                return;
            }
        }
        match self.ops.volume(a.h(), a.pool(), &a.marker()).await {
            Ok(None) => {}
            Ok(Some(_)) => return,
            Err(e) => {
                tracing::warn!(host = a.h(), image = %a.image.name, error = %e,
                    "cannot tell whether the image was committed; leaving it for a taker");
                return;
            }
        }
        self.remove(a, &a.data(), "unverified image volume").await;
        self.remove(a, &a.heartbeat(), "image heartbeat").await;
    }

    /// Makes sure `image` is cached and verified on `host`, uploading it if needed.
    pub async fn ensure(
        &self,
        host: &HostConfig,
        image: &ImageConfig,
    ) -> Result<BaseVolume, ImageError> {
        let key = format!("{}/{}", host.name, image.sha256);
        let _guard = self.locks.lock(&key).await;
        let a = Attempt {
            host,
            image,
            labels: ImageLabels {
                host: host.name.clone(),
                image: image.name.clone(),
            },
            token: new_token(),
        };
        let started = Instant::now();
        // The heartbeat record we watch (`None`: absent) and when it last changed.
        let mut watching: Option<(Option<Vec<u8>>, Instant)> = None;
        // Whether we hold the takeover claim, and whether we saw someone else's claim at
        // the last stale verdict (a claim still there one stale window later is dead too).
        let mut claimed = false;
        let mut claim_seen = false;
        let result = loop {
            let seen = match self.look(&a).await {
                Ok(seen) => seen,
                Err(e) => break Err(e),
            };
            match seen {
                Seen::Committed { recorded } => {
                    self.metrics.hits.get_or_create(&a.labels).inc();
                    break Ok(BaseVolume {
                        volume: a.data(),
                        format: image.format,
                        uploaded: false,
                        virtual_size: (recorded > 0).then_some(recorded),
                    });
                }
                Seen::Orphan => {
                    tracing::warn!(host = a.h(), image = %image.name, "image marker without its volume; caching again");
                    if let Err(e) = self.ops.delete_volume(a.h(), a.pool(), &a.marker()).await {
                        break Err(a.ops_err(e));
                    }
                }
                Seen::Staging => {
                    let record = match self.read_heartbeat(&a).await {
                        Ok(r) => r,
                        Err(e) => break Err(e),
                    };
                    let now = Instant::now();
                    let stale = match &watching {
                        Some((seen, since)) if *seen == record => {
                            now.duration_since(*since) >= self.options.stale_after
                        }
                        _ => {
                            watching = Some((record, now));
                            false
                        }
                    };
                    if stale {
                        watching = None;
                        match self.take_over(&a, &mut claimed, &mut claim_seen).await {
                            Ok(()) => continue,
                            Err(e) => break Err(e),
                        }
                    }
                    if started.elapsed() >= self.options.max_wait {
                        break Err(ImageError::WaitTimeout {
                            host: a.h().into(),
                            image: image.name.clone(),
                            waited: started.elapsed(),
                        });
                    }
                    tracing::debug!(host = a.h(), image = %image.name, "another uploader is caching the image; waiting");
                    tokio::time::sleep(self.options.poll_every).await;
                }
                Seen::Absent => match self.upload(&a).await {
                    Ok(Upload::Done(done)) => break Ok(done),
                    Ok(outcome) => {
                        // Lost the create, or superseded: someone else owns the upload
                        // now. A claim we hold would only stand in their way.
                        if claimed {
                            claimed = false;
                            self.remove(&a, &a.claim(), "takeover claim").await;
                        }
                        watching = None;
                        if matches!(outcome, Upload::Superseded) {
                            if started.elapsed() >= self.options.max_wait {
                                break Err(ImageError::WaitTimeout {
                                    host: a.h().into(),
                                    image: image.name.clone(),
                                    waited: started.elapsed(),
                                });
                            }
                            tokio::time::sleep(self.options.poll_every).await;
                        }
                    }
                    Err(e) => break Err(e),
                },
            }
        };
        if claimed {
            self.remove(&a, &a.claim(), "takeover claim").await;
        }
        result
    }

    /// The staging volume's heartbeat stayed unchanged for the stale window: take the
    /// claim, make the heartbeat ours, delete the dead volume. Someone else's claim is
    /// left alone the first time and removed the second (its holder went silent too).
    async fn take_over(
        &self,
        a: &Attempt<'_>,
        claimed: &mut bool,
        claim_seen: &mut bool,
    ) -> Result<(), ImageError> {
        let claim = a.claim();
        if *claimed {
            // Ours already (a volume appeared and went silent after we took the claim).
        } else {
            let xml = super::volume::raw_volume_xml(&claim, 0);
            match self
                .ops
                .create_volume(a.h(), a.pool(), &claim, xml)
                .await
                .map_err(|e| a.ops_err(e))?
            {
                Created::Created => {
                    *claimed = true;
                    *claim_seen = false;
                }
                Created::Exists if *claim_seen => {
                    *claim_seen = false;
                    tracing::warn!(host = a.h(), image = %a.image.name, "the takeover claim's holder went silent too; removing its claim");
                    self.ops
                        .delete_volume(a.h(), a.pool(), &claim)
                        .await
                        .map_err(|e| a.ops_err(e))?;
                    return Ok(());
                }
                Created::Exists => {
                    *claim_seen = true;
                    return Ok(());
                }
            }
        }
        tracing::warn!(host = a.h(), image = %a.image.name, "the image upload's heartbeat stopped; taking over");
        // Owner first, delete second: the old uploader, should it wake, finds another
        // token and neither commits nor deletes.
        self.write_heartbeat(a, 0).await?;
        self.ops
            .delete_volume(a.h(), a.pool(), &a.data())
            .await
            .map_err(|e| a.ops_err(e))?;
        Ok(())
    }

    /// Downloads and uploads the image, and commits it if it verified and is still ours.
    async fn upload(&self, a: &Attempt<'_>) -> Result<Upload, ImageError> {
        let (h, pool) = (a.h(), a.pool());
        let data_name = a.data();
        // Claim first (the exclusive create), download second: a replica that loses the
        // claim never opens the download. The volume starts empty and is sized once the
        // server has said how large the image is.
        let xml = super::volume::raw_volume_xml(&data_name, 0);
        match self
            .ops
            .create_volume(h, pool, &data_name, xml)
            .await
            .map_err(|e| a.ops_err(e))?
        {
            Created::Created => {}
            Created::Exists => return Ok(Upload::Lost),
        }
        // The upload is ours: say so before anything slow.
        if let Err(e) = self.write_heartbeat(a, 0).await {
            self.remove(a, &data_name, "image volume just created")
                .await;
            return Err(e);
        }
        let prepared = async {
            let download = fetch::open(a.image, &self.options.fetch)
                .await
                .map_err(|e| a.fetch_err(e))?;
            let Some(size) = download.content_length() else {
                return Err(ImageError::UnknownSize {
                    image: a.image.name.clone(),
                });
            };
            let space = self
                .ops
                .pool_space(h, pool)
                .await
                .map_err(|e| a.ops_err(e))?;
            if space.available < size {
                return Err(ImageError::NoSpace {
                    host: h.into(),
                    pool: pool.into(),
                    image: a.image.name.clone(),
                    needed: size,
                    available: space.available,
                });
            }
            self.ops
                .resize_volume(h, pool, &data_name, size)
                .await
                .map_err(|e| a.ops_err(e))?;
            Ok((download, size))
        }
        .await;
        let (download, size) = match prepared {
            Ok(p) => p,
            Err(e) => {
                self.abandon(a).await;
                return Err(e);
            }
        };
        tracing::info!(host = h, image = %a.image.name, bytes = size, "uploading base image");
        // The upload is finished only when the download verified (length and sha256);
        // otherwise the stream is aborted.
        let streamed = self.stream(a, download, size).await;
        self.metrics.upload_progress.get_or_create(&a.labels).set(0);
        let committed = match streamed {
            Ok(head) => self.commit(a, &head, size).await,
            Err(e) => Err(e),
        };
        match committed {
            Ok(Upload::Done(base)) => {
                self.count_outcome(a, "ok");
                tracing::info!(host = h, image = %a.image.name, bytes = size, "base image cached and verified");
                Ok(Upload::Done(base))
            }
            Ok(other) => Ok(other),
            Err(ImageError::TakenOver { .. }) => {
                tracing::warn!(host = h, image = %a.image.name,
                    "another replica took over this upload; waiting for it instead");
                Ok(Upload::Superseded)
            }
            Err(e) => {
                self.count_outcome(a, e.class().as_str());
                if e.is_verification_failure() {
                    self.metrics
                        .verification_failures
                        .get_or_create(&a.labels)
                        .inc();
                }
                self.abandon(a).await;
                Err(e)
            }
        }
    }

    fn count_outcome(&self, a: &Attempt<'_>, outcome: &str) {
        self.metrics
            .uploads
            .get_or_create(&OutcomeLabels {
                host: a.h().into(),
                image: a.image.name.clone(),
                outcome: outcome.into(),
            })
            .inc();
    }

    /// Writes the marker for a verified upload whose first bytes are `head`, if the upload
    /// is still ours and its volume still there at its size.
    async fn commit(&self, a: &Attempt<'_>, head: &[u8], size: u64) -> Result<Upload, ImageError> {
        let virtual_size = match a.image.format {
            ImageFormat::Qcow2 => {
                qcow2::virtual_size(head).map_err(|source| ImageError::NotQcow2 {
                    image: a.image.name.clone(),
                    source,
                })?
            }
            ImageFormat::Raw => size,
        };
        if !self.owns(a).await? {
            return Err(a.taken_over());
        }
        // A late taker's delete, in flight when it was fenced, may have removed our
        // volume (and a fresh one of the name may be there, not yet sized): redo. The
        // size test allows for a dir pool's refresh, after which libvirt reports a qcow2
        // file's virtual size as its capacity.
        match self
            .ops
            .volume(a.h(), a.pool(), &a.data())
            .await
            .map_err(|e| a.ops_err(e))?
        {
            Some(v) if v.capacity >= size.min(virtual_size) => {}
            _ => {
                tracing::warn!(host = a.h(), image = %a.image.name,
                    "the image volume was replaced while we uploaded; not committing");
                return Ok(Upload::Superseded);
            }
        }
        // Sparse: the capacity records the virtual size, nothing is allocated.
        let marker = a.marker();
        let xml = super::volume::raw_volume_xml(&marker, virtual_size);
        self.ops
            .create_volume(a.h(), a.pool(), &marker, xml)
            .await
            .map_err(|e| a.ops_err(e))?;
        self.remove(a, &a.heartbeat(), "image heartbeat").await;
        Ok(Upload::Done(BaseVolume {
            volume: a.data(),
            format: a.image.format,
            uploaded: true,
            virtual_size: Some(virtual_size),
        }))
    }

    /// Pumps the download into the upload and returns the image's first bytes (its
    /// header). The producer (this task) hashes and checks as it goes, beats the heartbeat
    /// while bytes move, and verifies length and sha256 at the end of the body *before* it
    /// lets the upload finish; on any failure, or when another replica took the upload
    /// over, it sends an abort, so an unverified volume is never finished.
    async fn stream(
        &self,
        a: &Attempt<'_>,
        mut download: fetch::ImageDownload,
        size: u64,
    ) -> Result<Vec<u8>, ImageError> {
        let h = a.h();
        let data_name = a.data();
        let (tx, rx) = mpsc::channel(CHANNEL_PIECES);
        // The download has its own deadline; the upload gets that plus its own, so waiting
        // on the HTTP server never uses up the upload's time.
        let deadline = fetch::download_deadline(&self.options.fetch, size)
            + upload_deadline(self.options.min_upload_deadline, size);
        let upload = self.ops.upload(h, a.pool(), &data_name, size, rx, deadline);
        let beat_every = self.options.stale_after / 4;
        let produce = async {
            // Owned here: dropping it when the body ends tells the uploader "complete".
            let tx = tx;
            let mut head: Vec<u8> = Vec::with_capacity(qcow2::HEADER_LEN);
            let mut last_log = Instant::now();
            let mut last_beat = Instant::now();
            let mut beats: u64 = 0;
            let mut done: u64 = 0;
            let mut regroup = chunks::Regroup::new(chunks::STREAM_PIECE);
            loop {
                match download.next_chunk().await {
                    Ok(Some(chunk)) => {
                        let want = qcow2::HEADER_LEN.saturating_sub(head.len());
                        head.extend_from_slice(&chunk[..want.min(chunk.len())]);
                        let len = chunk.len() as u64;
                        done += len;
                        self.metrics
                            .uploaded_bytes
                            .get_or_create(&a.labels)
                            .inc_by(len);
                        self.metrics
                            .upload_progress
                            .get_or_create(&a.labels)
                            .set(i64::try_from(done).unwrap_or(i64::MAX));
                        for piece in regroup.push(chunk) {
                            if tx.send(Ok(piece)).await.is_err() {
                                // The upload side ended early; its error is what we report.
                                return Ok(head);
                            }
                        }
                        let progress = UploadProgress {
                            host: h.into(),
                            image: a.image.name.clone(),
                            done,
                            total: size,
                        };
                        if let Some(p) = &self.options.progress {
                            p(&progress);
                        }
                        if last_log.elapsed() >= LOG_EVERY {
                            last_log = Instant::now();
                            tracing::info!(host = h, image = %a.image.name, done, total = size, "uploading base image");
                        }
                        if last_beat.elapsed() >= beat_every {
                            last_beat = Instant::now();
                            beats += 1;
                            match self.beat(a, beats).await {
                                Ok(true) => {}
                                Ok(false) => {
                                    let _ =
                                        tx.send(Err("taken over by another replica".into())).await;
                                    return Err(a.taken_over());
                                }
                                // Not fatal: a waiter takes over only after a whole
                                // window without a beat, and then our commit is fenced.
                                Err(e) => {
                                    tracing::warn!(host = h, image = %a.image.name, error = %e, "could not write the image heartbeat");
                                }
                            }
                        }
                    }
                    Ok(None) => {
                        return match download.finish() {
                            Ok(_) => {
                                // Verified: the last piece completes the length, and
                                // dropping `tx` then lets the upload finish.
                                if let Some(last) = regroup.finish() {
                                    // A closed upload reports its own error.
                                    let _ = tx.send(Ok(last)).await;
                                }
                                Ok(head)
                            }
                            Err(e) => {
                                let _ = tx.send(Err(e.to_string())).await;
                                Err(a.fetch_err(e))
                            }
                        };
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e.to_string())).await;
                        return Err(a.fetch_err(e));
                    }
                }
            }
        };
        let (produced, uploaded) = tokio::join!(produce, upload);
        let head = produced?;
        uploaded.map_err(|e| a.ops_err(e))?;
        Ok(head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeat_records_name_their_owner() {
        let r = heartbeat_record("abc", 7);
        assert_eq!(r.len(), HEARTBEAT_LEN);
        assert_eq!(heartbeat_token(&r), Some("abc"));
        assert_ne!(
            heartbeat_record("abc", 8),
            r,
            "each beat changes the record"
        );
        assert_eq!(heartbeat_token(b""), None);
        assert_eq!(heartbeat_token(&[0u8; 512]), None);
        assert_eq!(heartbeat_token(b"something else\ntoken abc\n"), None);
    }

    #[test]
    fn tokens_differ() {
        let (x, y) = (new_token(), new_token());
        assert_ne!(x, y);
        assert_eq!(x.len(), 32);
    }

    fn image() -> ImageConfig {
        ImageConfig {
            name: "base".into(),
            url: "https://example.invalid/base.qcow2".into(),
            sha256: "a".repeat(64),
            format: ImageFormat::Qcow2,
            max_size_mib: None,
            allow_http: false,
            allow_private_addresses: false,
        }
    }

    fn base(virtual_size: Option<u64>) -> BaseVolume {
        BaseVolume {
            volume: "v".into(),
            format: ImageFormat::Qcow2,
            uploaded: false,
            virtual_size,
        }
    }

    /// Records the size of every piece an upload hands to libvirt.
    #[derive(Debug, Default)]
    struct PieceSizes(Arc<std::sync::Mutex<Vec<usize>>>);

    impl super::super::fake::OpHook for PieceSizes {
        fn upload_chunks<'a>(
            &'a self,
            _host: &'a str,
            _name: &'a str,
            mut chunks: super::super::ops::UploadChunks,
        ) -> crate::provider::BoxFuture<'a, Option<super::super::ops::UploadChunks>> {
            let sizes = Arc::clone(&self.0);
            let (tx, rx) = mpsc::channel(1);
            tokio::spawn(async move {
                while let Some(piece) = chunks.recv().await {
                    if let Ok(p) = &piece {
                        sizes.lock().unwrap().push(p.len());
                    }
                    if tx.send(piece).await.is_err() {
                        break;
                    }
                }
            });
            Box::pin(std::future::ready(Some(rx)))
        }
    }

    /// Serves `body` once over plain HTTP on 127.0.0.1, written in `write`-byte pieces
    /// (each a separate socket write, so the client sees small chunks).
    fn serve_once(body: Arc<Vec<u8>>, write: usize) -> std::net::SocketAddr {
        use std::io::{Read as _, Write as _};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut tcp, _) = listener.accept().unwrap();
            tcp.set_nodelay(true).unwrap();
            let mut req = [0u8; 4096];
            let _ = tcp.read(&mut req).unwrap();
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            tcp.write_all(head.as_bytes()).unwrap();
            for piece in body.chunks(write) {
                if tcp.write_all(piece).is_err() {
                    return;
                }
            }
        });
        addr
    }

    /// The upload hands libvirt whole 256 KiB stream messages (the last one short), not
    /// the HTTP body's small chunks one message each; and the bytes still verify.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_upload_sends_whole_stream_pieces() {
        use sha2::Digest as _;
        let len = 3 * chunks::STREAM_PIECE + 12_345;
        let body: Arc<Vec<u8>> = Arc::new((0..len).map(|i| (i % 251) as u8).collect());
        let addr = serve_once(Arc::clone(&body), 4096);
        let config = ImageConfig {
            name: "raw".into(),
            url: format!("http://{addr}/raw.img"),
            sha256: hex::encode(sha2::Sha256::digest(body.as_slice())),
            format: ImageFormat::Raw,
            max_size_mib: None,
            allow_http: true,
            allow_private_addresses: false,
        };
        let host = HostConfig {
            name: "h1".into(),
            address: "127.0.0.1".into(),
            libvirt_socket: crate::config::DEFAULT_LIBVIRT_SOCKET.into(),
            driver: crate::config::LibvirtDriver::Qemu,
            storage_pool: "default".into(),
            bridge: "br0".into(),
            max_domains: 1,
            max_concurrent_creates: 1,
            insecure_ignore_host_key: false,
            disable_kvm: false,
            address_pool: None,
            bridge_network: None,
            bridge_mtu: None,
            cpu_placement: None,
            nvram_templates: Vec::new(),
        };
        let fake = Arc::new(super::super::fake::FakeOps::new(&["h1"], 1 << 30));
        let sizes = PieceSizes::default();
        let seen = Arc::clone(&sizes.0);
        let ops = Arc::new(super::super::fake::Hooked::wrap(fake.clone(), sizes));
        let mut options = ImageCacheOptions::default();
        options.fetch.exempt_addresses = vec![addr.ip()];
        let cache = ImageCache::new(ops, options, ImageMetrics::default());
        let base = tokio::time::timeout(Duration::from_secs(60), cache.ensure(&host, &config))
            .await
            .expect("hang guard")
            .unwrap();
        assert!(base.uploaded);
        let sizes = seen.lock().unwrap().clone();
        assert_eq!(
            sizes,
            [
                chunks::STREAM_PIECE,
                chunks::STREAM_PIECE,
                chunks::STREAM_PIECE,
                12_345
            ]
        );
        assert_eq!(
            fake.volume_data("h1", &image_volume_name(&config.sha256))
                .as_deref(),
            Some(body.as_slice())
        );
    }

    #[test]
    fn overlay_is_never_smaller_than_the_image() {
        const GIB: u64 = 1 << 30;
        let img = image();
        assert_eq!(
            overlay_capacity(&img, "small", &base(Some(GIB)), 2 * GIB, 300 << 20).unwrap(),
            2 * GIB
        );
        assert_eq!(
            overlay_capacity(&img, "small", &base(Some(GIB)), GIB, 300 << 20).unwrap(),
            GIB
        );
        // No record (an older marker): the base volume's size is the floor.
        assert_eq!(
            overlay_capacity(&img, "small", &base(None), GIB, 3 * GIB).unwrap(),
            3 * GIB
        );
        let err: ImageError = overlay_capacity(&img, "small", &base(Some(3 * GIB)), GIB, 300 << 20)
            .unwrap_err()
            .into();
        assert_eq!(err.class(), ErrorClass::Permanent);
        let text = err.to_string();
        for part in [
            "\"small\"",
            "1073741824",
            "(1 GiB)",
            "3221225472",
            "(3 GiB)",
            "at least 3",
        ] {
            assert!(text.contains(part), "{part}: {text}");
        }
    }
}
