//! The base image cache: one verified volume per image per host.
//!
//! ## Commit protocol (rename-free, marker volume)
//!
//! libvirt cannot rename a volume, but it refuses to create a volume whose name is taken.
//! That exclusive create is the only primitive the protocol needs:
//!
//! - **Data volume** `egress-image-<48 hex of sha256>`: whoever creates it (empty, before
//!   opening the download, so a losing replica never downloads) is the one uploader. It
//!   sizes it from the Content-Length and streams the download into it while hashing.
//! - **Marker volume** `egress-imgok-<48 hex>` (empty): created only after the hash of
//!   everything written matched the config's sha256. *A data volume is used only when its
//!   marker exists* (invariant 4), so a half-written or unverified volume is never a base.
//! - Hash mismatch, truncated or failed download, failed upload: the uploader deletes the
//!   data volume before returning the error.
//!
//! Racing Creates in one process take a keyed lock per host + image first, so one
//! uploads and the others find the marker. Racing *replicas* meet at the exclusive create:
//! the loser sees a data volume without marker and waits, polling, until the marker
//! appears. If the data volume stops growing for [`ImageCacheOptions::stale_after`] its
//! uploader is taken to be dead (a live uploader never stalls that long: its own download
//! idle timeout and upload deadline are far shorter). A waiter takes over only after it
//! created the **takeover claim** `egress-imgtk-<48 hex>` (exclusive, so one taker), then
//! deletes the dead volume and uploads as above, and deletes the claim when done. An
//! uploader that did not take over and finds a claim when it is about to commit has been
//! taken over: it neither commits nor deletes the volume (it is the taker's now). A claim
//! whose taker also went silent for the stale window is removed. A marker whose data
//! volume is gone is deleted and the image cached again.
//!
//! The protocol assumes that no participant pauses for longer than the stale window
//! between two of its own steps (10 minutes by default; every step is one libvirt call
//! with a deadline far shorter). A process frozen longer than that, between taking the
//! claim and deleting, can still delete a later taker's volume; closing that needs a
//! fencing token stored in the claim, which libvirt volumes make costly (a stream read per
//! check).
//!
//! Memory stays flat: chunks go from the HTTP body through a small bounded channel into a
//! libvirt stream on a blocking thread, never into a buffer of the image's size.

pub mod fetch;

use std::sync::Arc;
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
use crate::instance::{image_marker_name, image_takeover_name, image_volume_name};

/// Chunks buffered between the download and the upload: with ~64 KiB chunks, about
/// 1 MiB in flight whatever the image size.
const CHANNEL_CHUNKS: usize = 16;
/// Progress is logged at most this often.
const LOG_EVERY: Duration = Duration::from_secs(5);

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
    /// Our upload was taken over by another replica (we stalled past the stale window).
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

impl Classified for ImageError {
    fn class(&self) -> ErrorClass {
        match self {
            ImageError::Fetch { source, .. } => source.class(),
            ImageError::Ops { source, .. } => source.class(),
            ImageError::NoSpace { .. } => ErrorClass::Quota,
            ImageError::UnknownSize { .. } => ErrorClass::Permanent,
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
    /// Download policy (timeouts, redirects, extra CA for tests).
    pub fetch: FetchPolicy,
    /// A data volume without marker that has not grown for this long is taken over.
    pub stale_after: Duration,
    /// How often a waiter looks for the marker.
    pub poll_every: Duration,
    /// Longest wait for another uploader before a transient error.
    pub max_wait: Duration,
    /// Floor of the upload deadline; large images get more (see [`upload_deadline`]).
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

/// Upload deadline for `size` bytes: the floor, or 1 MiB/s, whichever is longer, so a
/// stuck stream is abandoned but a large image on a slow link is not.
pub fn upload_deadline(floor: Duration, size: u64) -> Duration {
    floor.max(Duration::from_secs(size / (1024 * 1024)))
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
        m
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
    Committed,
    /// Marker without data: a broken cache entry.
    Orphan,
    /// Data without marker: someone uploading, or a dead uploader's leftovers.
    Staging(u64),
    Absent,
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

    fn ops_err(host: &HostConfig, image: &ImageConfig, source: OpsError) -> ImageError {
        ImageError::Ops {
            host: host.name.clone(),
            image: image.name.clone(),
            source,
        }
    }

    async fn look(&self, host: &HostConfig, image: &ImageConfig) -> Result<Seen, ImageError> {
        let (h, pool) = (host.name.as_str(), host.storage_pool.as_str());
        let marker = self
            .ops
            .volume(h, pool, &image_marker_name(&image.sha256))
            .await
            .map_err(|e| Self::ops_err(host, image, e))?;
        let data = self
            .ops
            .volume(h, pool, &image_volume_name(&image.sha256))
            .await
            .map_err(|e| Self::ops_err(host, image, e))?;
        Ok(match (marker, data) {
            (Some(_), Some(_)) => Seen::Committed,
            (Some(_), None) => Seen::Orphan,
            (None, Some(v)) => Seen::Staging(v.allocation),
            (None, None) => Seen::Absent,
        })
    }

    /// Makes sure `image` is cached and verified on `host`, uploading it if needed.
    pub async fn ensure(
        &self,
        host: &HostConfig,
        image: &ImageConfig,
    ) -> Result<BaseVolume, ImageError> {
        let key = format!("{}/{}", host.name, image.sha256);
        let _guard = self.locks.lock(&key).await;
        let labels = ImageLabels {
            host: host.name.clone(),
            image: image.name.clone(),
        };
        let (h, pool) = (host.name.as_str(), host.storage_pool.as_str());
        let data_name = image_volume_name(&image.sha256);
        let started = Instant::now();
        // The staging volume we watch: its allocation and when it last changed.
        let mut watching: Option<(u64, Instant)> = None;
        // Whether we hold the takeover claim, and whether we saw someone else's claim at
        // the last stale verdict (a claim still there one stale window later is dead too).
        let mut claimed = false;
        let mut claim_seen = false;
        let result = loop {
            let seen = match self.look(host, image).await {
                Ok(seen) => seen,
                Err(e) => break Err(e),
            };
            match seen {
                Seen::Committed => {
                    self.metrics.hits.get_or_create(&labels).inc();
                    break Ok(BaseVolume {
                        volume: data_name.clone(),
                        format: image.format,
                        uploaded: false,
                    });
                }
                Seen::Orphan => {
                    tracing::warn!(host = h, image = %image.name, "image marker without its volume; caching again");
                    if let Err(e) = self
                        .ops
                        .delete_volume(h, pool, &image_marker_name(&image.sha256))
                        .await
                    {
                        break Err(Self::ops_err(host, image, e));
                    }
                }
                Seen::Staging(allocation) => {
                    let now = Instant::now();
                    let stale = match watching {
                        Some((seen, since)) if seen == allocation => {
                            now.duration_since(since) >= self.options.stale_after
                        }
                        _ => {
                            watching = Some((allocation, now));
                            false
                        }
                    };
                    if stale {
                        watching = None;
                        let claim = image_takeover_name(&image.sha256);
                        let xml = super::volume::raw_volume_xml(&claim, 0);
                        match self.ops.create_volume(h, pool, &claim, xml).await {
                            Ok(Created::Created) => {
                                claimed = true;
                                tracing::warn!(host = h, image = %image.name, "staging volume stopped growing; taking over");
                                if let Err(e) = self.ops.delete_volume(h, pool, &data_name).await {
                                    break Err(Self::ops_err(host, image, e));
                                }
                            }
                            Ok(Created::Exists) if claim_seen => {
                                // The taker went silent too: drop its claim, try again.
                                claim_seen = false;
                                if let Err(e) = self.ops.delete_volume(h, pool, &claim).await {
                                    break Err(Self::ops_err(host, image, e));
                                }
                            }
                            Ok(Created::Exists) => claim_seen = true,
                            Err(e) => break Err(Self::ops_err(host, image, e)),
                        }
                        continue;
                    }
                    if started.elapsed() >= self.options.max_wait {
                        break Err(ImageError::WaitTimeout {
                            host: h.into(),
                            image: image.name.clone(),
                            waited: started.elapsed(),
                        });
                    }
                    tracing::debug!(host = h, image = %image.name, "another uploader is caching the image; waiting");
                    tokio::time::sleep(self.options.poll_every).await;
                }
                Seen::Absent => match self.upload(host, image, &labels, claimed).await {
                    Ok(Some(done)) => break Ok(done),
                    // Lost the exclusive create to another replica: wait for it.
                    Ok(None) => {}
                    Err(e) => break Err(e),
                },
            }
        };
        if claimed {
            let claim = image_takeover_name(&image.sha256);
            if let Err(e) = self.ops.delete_volume(h, pool, &claim).await {
                tracing::warn!(host = h, image = %image.name, error = %e, "could not remove the takeover claim; it is dropped once stale");
            }
        }
        result
    }

    /// Whether another waiter holds the takeover claim (so our staging volume is theirs).
    async fn taken_over(&self, host: &HostConfig, image: &ImageConfig) -> Result<bool, ImageError> {
        Ok(self
            .ops
            .volume(
                &host.name,
                &host.storage_pool,
                &image_takeover_name(&image.sha256),
            )
            .await
            .map_err(|e| Self::ops_err(host, image, e))?
            .is_some())
    }

    /// Downloads and uploads the image. `Ok(None)` when another uploader claimed the data
    /// volume first.
    async fn upload(
        &self,
        host: &HostConfig,
        image: &ImageConfig,
        labels: &ImageLabels,
        claimed: bool,
    ) -> Result<Option<BaseVolume>, ImageError> {
        let (h, pool) = (host.name.as_str(), host.storage_pool.as_str());
        let data_name = image_volume_name(&image.sha256);
        let fetch_err = |source| ImageError::Fetch {
            host: h.into(),
            image: image.name.clone(),
            source,
        };
        // Claim first (the exclusive create), download second: a replica that loses the
        // claim never opens the download. The volume starts empty and is sized once the
        // server has said how large the image is.
        let xml = super::volume::raw_volume_xml(&data_name, 0);
        match self
            .ops
            .create_volume(h, pool, &data_name, xml)
            .await
            .map_err(|e| Self::ops_err(host, image, e))?
        {
            Created::Created => {}
            Created::Exists => return Ok(None),
        }
        let prepared = async {
            let download = fetch::open(image, &self.options.fetch)
                .await
                .map_err(fetch_err)?;
            let Some(size) = download.content_length() else {
                return Err(ImageError::UnknownSize {
                    image: image.name.clone(),
                });
            };
            let space = self
                .ops
                .pool_space(h, pool)
                .await
                .map_err(|e| Self::ops_err(host, image, e))?;
            if space.available < size {
                return Err(ImageError::NoSpace {
                    host: h.into(),
                    pool: pool.into(),
                    image: image.name.clone(),
                    needed: size,
                    available: space.available,
                });
            }
            self.ops
                .resize_volume(h, pool, &data_name, size)
                .await
                .map_err(|e| Self::ops_err(host, image, e))?;
            Ok((download, size))
        }
        .await;
        let (download, size) = match prepared {
            Ok(p) => p,
            Err(e) => {
                if let Err(cleanup) = self.ops.delete_volume(h, pool, &data_name).await {
                    tracing::warn!(host = h, image = %image.name, error = %cleanup,
                        "could not delete the claimed image volume; the next Create takes it over once stale");
                }
                return Err(e);
            }
        };
        tracing::info!(host = h, image = %image.name, bytes = size, "uploading base image");
        // The upload is finished only when the download verified (length and sha256);
        // otherwise the stream is aborted. Either way, on error the data volume goes.
        let result = self.stream(host, image, labels, download, size).await;
        // Taken over while we stalled: the volume is the taker's now; leave it alone.
        if !claimed && self.taken_over(host, image).await? {
            self.metrics.upload_progress.get_or_create(labels).set(0);
            return Err(ImageError::TakenOver {
                host: h.into(),
                image: image.name.clone(),
            });
        }
        let outcome = match result {
            Ok(()) => {
                let marker = super::volume::raw_volume_xml(&image_marker_name(&image.sha256), 0);
                self.ops
                    .create_volume(h, pool, &image_marker_name(&image.sha256), marker)
                    .await
                    .map(drop)
                    .map_err(|e| Self::ops_err(host, image, e))
            }
            Err(e) => Err(e),
        };
        self.metrics.upload_progress.get_or_create(labels).set(0);
        match outcome {
            Ok(()) => {
                self.metrics
                    .uploads
                    .get_or_create(&OutcomeLabels {
                        host: h.into(),
                        image: image.name.clone(),
                        outcome: "ok".into(),
                    })
                    .inc();
                tracing::info!(host = h, image = %image.name, bytes = size, "base image cached and verified");
                Ok(Some(BaseVolume {
                    volume: data_name,
                    format: image.format,
                    uploaded: true,
                }))
            }
            Err(e) => {
                self.metrics
                    .uploads
                    .get_or_create(&OutcomeLabels {
                        host: h.into(),
                        image: image.name.clone(),
                        outcome: e.class().as_str().into(),
                    })
                    .inc();
                if let Err(cleanup) = self.ops.delete_volume(h, pool, &data_name).await {
                    tracing::warn!(host = h, image = %image.name, error = %cleanup,
                        "could not delete the unverified image volume; the next Create takes it over once stale");
                }
                Err(e)
            }
        }
    }

    /// Pumps the download into the upload. The producer (this task) hashes and checks as
    /// it goes and verifies length and sha256 at the end of the body *before* it lets the
    /// upload finish; on any failure it sends an abort, so an unverified volume is never
    /// finished.
    async fn stream(
        &self,
        host: &HostConfig,
        image: &ImageConfig,
        labels: &ImageLabels,
        mut download: fetch::ImageDownload,
        size: u64,
    ) -> Result<(), ImageError> {
        let (h, pool) = (host.name.as_str(), host.storage_pool.as_str());
        let data_name = image_volume_name(&image.sha256);
        let (tx, rx) = mpsc::channel(CHANNEL_CHUNKS);
        let deadline = upload_deadline(self.options.min_upload_deadline, size);
        let upload = self.ops.upload(h, pool, &data_name, size, rx, deadline);
        let produce = async {
            // Owned here: dropping it when the body ends tells the uploader "complete".
            let tx = tx;
            let mut last_log = Instant::now();
            let mut done: u64 = 0;
            loop {
                match download.next_chunk().await {
                    Ok(Some(chunk)) => {
                        done += chunk.len() as u64;
                        self.metrics
                            .uploaded_bytes
                            .get_or_create(labels)
                            .inc_by(chunk.len() as u64);
                        self.metrics
                            .upload_progress
                            .get_or_create(labels)
                            .set(i64::try_from(done).unwrap_or(i64::MAX));
                        if tx.send(Ok(chunk)).await.is_err() {
                            // The upload side ended early; its error is what we report.
                            return Ok(());
                        }
                        let progress = UploadProgress {
                            host: h.into(),
                            image: image.name.clone(),
                            done,
                            total: size,
                        };
                        if let Some(p) = &self.options.progress {
                            p(&progress);
                        }
                        if last_log.elapsed() >= LOG_EVERY {
                            last_log = Instant::now();
                            tracing::info!(host = h, image = %image.name, done, total = size, "uploading base image");
                        }
                    }
                    Ok(None) => {
                        return match download.finish() {
                            Ok(_) => Ok(()),
                            Err(e) => {
                                let _ = tx.send(Err(e.to_string())).await;
                                Err(e)
                            }
                        };
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e.to_string())).await;
                        return Err(e);
                    }
                }
            }
        };
        let (produced, uploaded) = tokio::join!(produce, upload);
        produced.map_err(|source| ImageError::Fetch {
            host: h.into(),
            image: image.name.clone(),
            source,
        })?;
        uploaded.map_err(|e| Self::ops_err(host, image, e))
    }
}
