//! The qcow2 header fields the cache needs: the image's virtual size.
//!
//! A base image is uploaded as the raw bytes of its qcow2 file, so libvirt reports the
//! *file* size as the volume's capacity. The disk the guest sees is the header's virtual
//! size, and the overlay over the base must be at least that large. The header is read
//! from the first bytes of the download (the content is verified by sha256 before the
//! result is used), with every offset checked: a short or foreign header is an error,
//! never a panic or a guess.
//!
//! Layout (big-endian; QEMU's `docs/interop/qcow2.txt`): magic `QFI\xfb` at 0, version at
//! 4 (2 or 3), cluster_bits at 20, size (the virtual size in bytes) at 24. Version 2
//! headers are 72 bytes, version 3 headers at least 104.

/// Bytes of the download kept to read the header: the version 3 header's fixed part.
pub const HEADER_LEN: usize = 104;

const MAGIC: [u8; 4] = *b"QFI\xfb";
const V2_HEADER_LEN: usize = 72;
/// QEMU's cluster size bounds: 512 B to 2 MiB.
const CLUSTER_BITS: std::ops::RangeInclusive<u32> = 9..=21;
/// Far beyond any real disk (64 PiB): refusing more keeps callers' arithmetic clear of
/// overflow.
const MAX_VIRTUAL_SIZE: u64 = 1 << 56;

/// Why a header is not a usable qcow2 header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    /// Fewer bytes than a header needs.
    #[error("the image is {len} bytes, shorter than a qcow2 header ({need} bytes)")]
    Short {
        /// Bytes available.
        len: usize,
        /// Bytes needed.
        need: usize,
    },
    /// The first four bytes are not `QFI\xfb`.
    #[error("the image does not start with the qcow2 magic (it starts with {found})")]
    Magic {
        /// The first bytes, hex.
        found: String,
    },
    /// A version this reader does not know.
    #[error("qcow2 version {0} is not supported (2 or 3)")]
    Version(u32),
    /// A cluster size QEMU would refuse.
    #[error("qcow2 cluster_bits {0} is out of range (9 to 21)")]
    ClusterBits(u32),
    /// A virtual size of zero or beyond any real disk.
    #[error("qcow2 virtual size {0} bytes is out of range")]
    Size(u64),
}

fn be_u32(b: &[u8], at: usize) -> Option<u32> {
    let bytes: [u8; 4] = b.get(at..at.checked_add(4)?)?.try_into().ok()?;
    Some(u32::from_be_bytes(bytes))
}

fn be_u64(b: &[u8], at: usize) -> Option<u64> {
    let bytes: [u8; 8] = b.get(at..at.checked_add(8)?)?.try_into().ok()?;
    Some(u64::from_be_bytes(bytes))
}

/// The virtual size in bytes from the first bytes of a qcow2 file.
pub fn virtual_size(head: &[u8]) -> Result<u64, HeaderError> {
    let short = |need| HeaderError::Short {
        len: head.len(),
        need,
    };
    let magic = head.get(..4).ok_or_else(|| short(V2_HEADER_LEN))?;
    if magic != MAGIC {
        return Err(HeaderError::Magic {
            found: hex::encode(magic),
        });
    }
    let version = be_u32(head, 4).ok_or_else(|| short(V2_HEADER_LEN))?;
    let need = match version {
        2 => V2_HEADER_LEN,
        3 => HEADER_LEN,
        v => return Err(HeaderError::Version(v)),
    };
    if head.len() < need {
        return Err(short(need));
    }
    let cluster_bits = be_u32(head, 20).ok_or_else(|| short(need))?;
    if !CLUSTER_BITS.contains(&cluster_bits) {
        return Err(HeaderError::ClusterBits(cluster_bits));
    }
    let size = be_u64(head, 24).ok_or_else(|| short(need))?;
    if size == 0 || size > MAX_VIRTUAL_SIZE {
        return Err(HeaderError::Size(size));
    }
    Ok(size)
}

/// A minimal qcow2 header (for tests and the demo's images): `version`, 64 KiB clusters,
/// `size` bytes virtual, padded to `len` bytes.
pub fn test_header(version: u32, size: u64, len: usize) -> Vec<u8> {
    let mut h = vec![0u8; len.max(HEADER_LEN)];
    h[..4].copy_from_slice(&MAGIC);
    h[4..8].copy_from_slice(&version.to_be_bytes());
    h[20..24].copy_from_slice(&16u32.to_be_bytes());
    h[24..32].copy_from_slice(&size.to_be_bytes());
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_virtual_size_of_v2_and_v3_headers() {
        assert_eq!(virtual_size(&test_header(3, 3 << 30, 512)), Ok(3 << 30));
        assert_eq!(
            virtual_size(&test_header(2, 12345, V2_HEADER_LEN)[..V2_HEADER_LEN]),
            Ok(12345)
        );
    }

    #[test]
    fn refuses_short_foreign_and_absurd_headers() {
        let h = test_header(3, 1 << 30, 512);
        assert_eq!(
            virtual_size(&h[..3]),
            Err(HeaderError::Short { len: 3, need: 72 })
        );
        assert_eq!(
            virtual_size(&h[..100]),
            Err(HeaderError::Short {
                len: 100,
                need: 104
            })
        );
        assert_eq!(
            virtual_size(&[]),
            Err(HeaderError::Short { len: 0, need: 72 })
        );
        assert!(matches!(
            virtual_size(b"\x7fELF and then some more bytes"),
            Err(HeaderError::Magic { .. })
        ));
        let mut v = h.clone();
        v[4..8].copy_from_slice(&4u32.to_be_bytes());
        assert_eq!(virtual_size(&v), Err(HeaderError::Version(4)));
        let mut c = h.clone();
        c[20..24].copy_from_slice(&30u32.to_be_bytes());
        assert_eq!(virtual_size(&c), Err(HeaderError::ClusterBits(30)));
        assert_eq!(
            virtual_size(&test_header(3, 0, 512)),
            Err(HeaderError::Size(0))
        );
        assert_eq!(
            virtual_size(&test_header(3, u64::MAX, 512)),
            Err(HeaderError::Size(u64::MAX))
        );
    }
}
