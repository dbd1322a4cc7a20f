//! Volume XML and the per-instance volumes: the root disk overlay and the seed ISO.
//!
//! Names come from [`crate::instance::InstanceIdentity`] (derived from a validated UID)
//! and paths from libvirt itself; both are still escaped here, because XML is built from
//! them (invariant 5).

use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;

use super::ops::{Created, HostOps, OpsError};
use crate::config::ImageFormat;

fn esc(s: &str) -> String {
    quick_xml::escape::escape(s).into_owned()
}

fn format_name(f: ImageFormat) -> &'static str {
    match f {
        ImageFormat::Qcow2 => "qcow2",
        ImageFormat::Raw => "raw",
    }
}

/// A raw volume of `capacity` bytes, allocated lazily (the upload fills it).
pub fn raw_volume_xml(name: &str, capacity: u64) -> String {
    format!(
        "<volume><name>{}</name><capacity unit='bytes'>{capacity}</capacity>\
         <allocation unit='bytes'>0</allocation><target><format type='raw'/></target></volume>",
        esc(name)
    )
}

/// A qcow2 overlay of `capacity` bytes over the base at `backing_path`: the VM writes
/// only to its overlay, so every VM on a host shares one copy of the image.
pub fn overlay_volume_xml(
    name: &str,
    capacity: u64,
    backing_path: &str,
    backing_format: ImageFormat,
) -> String {
    format!(
        "<volume><name>{}</name><capacity unit='bytes'>{capacity}</capacity>\
         <allocation unit='bytes'>0</allocation><target><format type='qcow2'/></target>\
         <backingStore><path>{}</path><format type='{}'/></backingStore></volume>",
        esc(name),
        esc(backing_path),
        format_name(backing_format)
    )
}

/// Deadline of a seed upload: a few hundred KB at most.
const SEED_UPLOAD_DEADLINE: Duration = Duration::from_secs(60);

/// Creates the seed volume and writes `iso` into it. A seed volume that already exists is
/// replaced: its content may be from an older render, and it is ours by name. On failure
/// the volume is removed.
pub async fn put_seed(
    ops: &dyn HostOps,
    host: &str,
    pool: &str,
    name: &str,
    iso: Vec<u8>,
) -> Result<(), OpsError> {
    let len = iso.len() as u64;
    if ops
        .create_volume(host, pool, name, raw_volume_xml(name, len))
        .await?
        == Created::Exists
    {
        ops.delete_volume(host, pool, name).await?;
        ops.create_volume(host, pool, name, raw_volume_xml(name, len))
            .await?;
    }
    let (tx, rx) = mpsc::channel(1);
    // The channel has room for the one chunk, so this never waits.
    let _ = tx.try_send(Ok(Bytes::from(iso)));
    drop(tx);
    match ops
        .upload(host, pool, name, len, rx, SEED_UPLOAD_DEADLINE)
        .await
    {
        Ok(()) => Ok(()),
        Err(e) => {
            if let Err(cleanup) = ops.delete_volume(host, pool, name).await {
                tracing::warn!(host, volume = name, error = %cleanup, "could not remove a half-written seed volume");
            }
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_xml_escapes_and_sizes() {
        let x = raw_volume_xml("a<b", 10);
        assert!(x.contains("<name>a&lt;b</name>"), "{x}");
        assert!(x.contains("<capacity unit='bytes'>10</capacity>"), "{x}");
        let o = overlay_volume_xml("r", 1 << 30, "/p/it's", ImageFormat::Qcow2);
        assert!(o.contains("<path>/p/it&apos;s</path>"), "{o}");
        assert!(o.contains("<format type='qcow2'/></backingStore>"), "{o}");
        let r = overlay_volume_xml("r", 1, "/p", ImageFormat::Raw);
        assert!(r.contains("<format type='raw'/></backingStore>"), "{r}");
    }
}
