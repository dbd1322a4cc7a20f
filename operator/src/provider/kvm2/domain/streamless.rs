//! Volume contents on a host whose libvirt runs the test driver (`driver: test`), which
//! has no volume streams (`virStorageVolUpload`/`Download` are not supported there).
//!
//! The test driver is for tests and benchmarks of the operator at scale, where every other
//! call is real (volumes, pools, domains, metadata, over the real SSH link). Only the bytes
//! of a transfer stay in this process: an upload still checks the volume exists and still
//! consumes exactly the announced length from its source (so a download is fetched and
//! hashed as in production). The first [`KEPT`] bytes of a record written in place are
//! kept so the records written and read back (the image cache's upload heartbeat and image
//! announcements) round-trip; of a streamed upload (a base image, a seed ISO: the operator
//! never reads those back) only the first [`UPLOAD_KEPT`], since these stand-in bytes live
//! in the operator's own memory, which the scale bench measures: 64 KiB per seed was
//! 64 MiB at 1000 Proxies that a real host keeps on its disk. A volume never written, and
//! an uploaded one past its kept start, reads as zeros, as a new libvirt volume does. The test driver
//! cannot resize a volume either (`virStorageVolResize`): a resize is recorded here and
//! reported as the volume's capacity. It names every interface at define time
//! (`<target dev='testnetN'/>`, where QEMU names them only when the domain runs): those
//! names are taken out of its domain XML, so the output check reads what QEMU's driver
//! would report of a defined domain.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::ops::UploadChunks;

/// Bytes kept per volume written in place: far above any record the operator writes and
/// reads back.
pub const KEPT: usize = 64 * 1024;

/// Bytes kept of a streamed upload: a header's worth.
pub const UPLOAD_KEPT: usize = 4096;

/// A volume: host, pool, name.
type Key = (String, String, String);

/// What was written to volumes of test-driver hosts, shared by clones.
#[derive(Debug, Clone, Default)]
pub struct Streamless {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Debug, Default)]
struct Inner {
    kept: HashMap<Key, Vec<u8>>,
    capacity: HashMap<Key, u64>,
}

fn key(host: &str, pool: &str, name: &str) -> Key {
    (host.to_string(), pool.to_string(), name.to_string())
}

impl Streamless {
    fn inner(&self) -> MutexGuard<'_, Inner> {
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Records a resize of the volume to `capacity` bytes.
    pub fn resize(&self, volume: (&str, &str, &str), capacity: u64) {
        let (host, pool, name) = volume;
        self.inner()
            .capacity
            .insert(key(host, pool, name), capacity);
    }

    /// The volume's capacity: the last resize, else what libvirt reports.
    pub fn capacity(&self, volume: (&str, &str, &str), reported: u64) -> u64 {
        let (host, pool, name) = volume;
        self.inner()
            .capacity
            .get(&key(host, pool, name))
            .copied()
            .unwrap_or(reported)
    }

    /// Consumes exactly `length` bytes from `chunks` within `deadline` and keeps their
    /// start; the error names why the source fell short (as a real upload would abort).
    pub async fn upload(
        &self,
        volume: (&str, &str, &str),
        length: u64,
        mut chunks: UploadChunks,
        deadline: Duration,
    ) -> Result<(), String> {
        let mut head = Vec::new();
        let mut sent: u64 = 0;
        let receive = async {
            while let Some(chunk) = chunks.recv().await {
                let chunk = chunk?;
                let room = UPLOAD_KEPT.saturating_sub(head.len()).min(chunk.len());
                head.extend_from_slice(chunk.get(..room).unwrap_or_default());
                sent = sent.saturating_add(chunk.len() as u64);
                if sent > length {
                    return Err(format!("the source sent more than {length} bytes"));
                }
            }
            Ok(())
        };
        match tokio::time::timeout(deadline, receive).await {
            Ok(Ok(())) if sent == length => {}
            Ok(Ok(())) => return Err(format!("the source ended after {sent} of {length} bytes")),
            Ok(Err(reason)) => return Err(reason),
            Err(_) => return Err(format!("the upload took longer than {deadline:?}")),
        }
        let (host, pool, name) = volume;
        head.shrink_to_fit();
        self.inner().kept.insert(key(host, pool, name), head);
        Ok(())
    }

    /// Overwrites the start of the volume with `data`.
    pub fn write(&self, volume: (&str, &str, &str), data: &[u8]) {
        let (host, pool, name) = volume;
        let mut inner = self.inner();
        let slot = inner.kept.entry(key(host, pool, name)).or_default();
        let end = data.len().min(KEPT);
        if slot.len() < end {
            slot.resize(end, 0);
        }
        if let (Some(dst), Some(src)) = (slot.get_mut(..end), data.get(..end)) {
            dst.copy_from_slice(src);
        }
    }

    /// Up to `max_len` bytes from the start of a volume of `capacity` bytes.
    pub fn read(&self, volume: (&str, &str, &str), max_len: usize, capacity: u64) -> Vec<u8> {
        let (host, pool, name) = volume;
        let len = usize::try_from(capacity).unwrap_or(usize::MAX).min(max_len);
        let mut out = self
            .inner()
            .kept
            .get(&key(host, pool, name))
            .cloned()
            .unwrap_or_default();
        out.resize(len, 0);
        out
    }

    /// The volume was deleted: its bytes go too.
    pub fn forget(&self, volume: (&str, &str, &str)) {
        let (host, pool, name) = volume;
        let mut inner = self.inner();
        inner.kept.remove(&key(host, pool, name));
        inner.capacity.remove(&key(host, pool, name));
    }
}

/// `xml` without the interface names the test driver assigns (`<target dev='testnetN'/>`
/// on a line of its own, as libvirt formats it); everything else is kept as it is.
pub fn without_test_ifnames(xml: &str) -> String {
    let assigned = |line: &str| {
        line.trim()
            .strip_prefix("<target dev='testnet")
            .and_then(|r| r.strip_suffix("'/>"))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    let mut out = String::with_capacity(xml.len());
    for line in xml.split_inclusive('\n') {
        if !assigned(line) {
            out.push_str(line);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use tokio::sync::mpsc;

    const V: (&str, &str, &str) = ("h", "p", "v");

    fn source(chunks: &[&'static [u8]], fail: Option<&str>) -> UploadChunks {
        let (tx, rx) = mpsc::channel(chunks.len() + 1);
        for c in chunks {
            tx.try_send(Ok(Bytes::from_static(c))).unwrap();
        }
        if let Some(f) = fail {
            tx.try_send(Err(f.to_string())).unwrap();
        }
        rx
    }

    #[tokio::test]
    async fn an_upload_keeps_only_a_header_in_memory_and_reads_zeros_past_it() {
        let s = Streamless::default();
        let big: &'static [u8] = Box::leak(vec![7u8; 3 * UPLOAD_KEPT].into_boxed_slice());
        s.upload(
            V,
            big.len() as u64,
            source(&[big], None),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        let kept = s.inner().kept.get(&key("h", "p", "v")).map(Vec::capacity);
        assert_eq!(kept, Some(UPLOAD_KEPT), "one header's worth, no more");
        let back = s.read(V, 2 * UPLOAD_KEPT, big.len() as u64);
        assert!(back[..UPLOAD_KEPT].iter().all(|b| *b == 7));
        assert!(back[UPLOAD_KEPT..].iter().all(|b| *b == 0));
        // A record written in place keeps up to KEPT.
        s.write(V, &vec![9u8; 2 * UPLOAD_KEPT]);
        assert!(
            s.read(V, 2 * UPLOAD_KEPT, big.len() as u64)
                .iter()
                .all(|b| *b == 9)
        );
    }

    #[tokio::test]
    async fn an_upload_consumes_its_length_and_keeps_its_start_for_reads() {
        let s = Streamless::default();
        s.upload(
            V,
            6,
            source(&[b"abc", b"def"], None),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        assert_eq!(s.read(V, 4, 100), b"abcd");
        assert_eq!(s.read(V, 10, 8), b"abcdef\0\0");
        s.write(V, b"XY");
        assert_eq!(s.read(V, 6, 100), b"XYcdef");
        assert_eq!(s.capacity(V, 100), 100);
        s.resize(V, 4096);
        assert_eq!(s.capacity(V, 100), 4096);
        s.forget(V);
        assert_eq!(s.read(V, 3, 100), b"\0\0\0");
        assert_eq!(s.capacity(V, 100), 100);
    }

    #[test]
    fn only_the_test_drivers_interface_names_are_taken_out() {
        let xml = "<interface type='bridge'>\n  <target dev='testnet0'/>\n  <target dev='vda' bus='virtio'/>\n  <target dev='testnetx'/>\n</interface>\n";
        assert_eq!(
            without_test_ifnames(xml),
            "<interface type='bridge'>\n  <target dev='vda' bus='virtio'/>\n  <target dev='testnetx'/>\n</interface>\n"
        );
    }

    #[tokio::test]
    async fn a_short_long_or_failed_source_is_an_error_and_keeps_nothing() {
        let s = Streamless::default();
        let d = Duration::from_secs(5);
        let short = s.upload(V, 7, source(&[b"abc"], None), d).await;
        assert!(short.unwrap_err().contains("3 of 7"));
        let long = s.upload(V, 2, source(&[b"abc"], None), d).await;
        assert!(long.unwrap_err().contains("more than 2"));
        let failed = s
            .upload(V, 9, source(&[b"abc"], Some("hash mismatch")), d)
            .await;
        assert_eq!(failed.unwrap_err(), "hash mismatch");
        assert_eq!(s.read(V, 2, 100), b"\0\0");
    }
}
