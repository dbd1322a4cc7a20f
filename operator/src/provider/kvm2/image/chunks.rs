//! Regroups the download's chunks into the pieces the libvirt stream sends.
//!
//! HTTP hands over whatever one socket read returned (a few KiB to a few hundred KiB,
//! depending on timing), and each piece handed to the upload is one libvirt stream
//! message: one wake-up of the blocking thread, one pass of libvirt's client loop, one
//! message for libvirtd to parse and queue. Regrouping into [`STREAM_PIECE`]-sized pieces
//! makes that per-message cost small and steady whatever the server's chunking, at the
//! price of one copy of the bytes that straddle a boundary (a chunk already that large is
//! split without copying).

use bytes::{Buf as _, Bytes, BytesMut};

/// Bytes per libvirt stream message: libvirt's own `VIR_NET_MESSAGE_LEGACY_PAYLOAD_MAX`,
/// the size `virsh vol-upload` sends and every libvirt daemon accepts.
pub const STREAM_PIECE: usize = 256 * 1024;

/// Collects chunks until a whole piece is there.
#[derive(Debug)]
pub struct Regroup {
    piece: usize,
    pending: BytesMut,
}

impl Regroup {
    /// Pieces of `piece` bytes (at least 1).
    pub fn new(piece: usize) -> Self {
        Self {
            piece: piece.max(1),
            pending: BytesMut::new(),
        }
    }

    /// Takes `chunk` and returns the pieces it completed, each exactly `piece` bytes, in
    /// order; what is left waits for the next chunk or [`Regroup::finish`].
    pub fn push(&mut self, mut chunk: Bytes) -> Vec<Bytes> {
        let mut ready = Vec::new();
        if !self.pending.is_empty() {
            let take = (self.piece - self.pending.len()).min(chunk.len());
            self.pending.extend_from_slice(&chunk[..take]);
            chunk.advance(take);
            if self.pending.len() < self.piece {
                return ready;
            }
            ready.push(self.pending.split().freeze());
        }
        // Nothing pending here: whole pieces of the chunk go as they are.
        while chunk.len() >= self.piece {
            ready.push(chunk.split_to(self.piece));
        }
        if !chunk.is_empty() {
            self.pending.reserve(self.piece);
            self.pending.extend_from_slice(&chunk);
        }
        ready
    }

    /// The last, short piece (`None` when the chunks added up to whole pieces).
    pub fn finish(self) -> Option<Bytes> {
        (!self.pending.is_empty()).then(|| self.pending.freeze())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pushes `sizes`-long chunks of a counting pattern through a regrouper of `piece`
    /// and returns the pieces.
    fn regroup(piece: usize, sizes: &[usize]) -> (Vec<u8>, Vec<Bytes>) {
        let total: usize = sizes.iter().sum();
        let data: Vec<u8> = (0..total).map(|i| (i % 251) as u8).collect();
        let mut r = Regroup::new(piece);
        let mut out = Vec::new();
        let mut at = 0;
        for &n in sizes {
            out.extend(r.push(Bytes::copy_from_slice(&data[at..at + n])));
            at += n;
        }
        out.extend(r.finish());
        (data, out)
    }

    #[test]
    fn small_chunks_become_whole_pieces_in_order() {
        let (data, out) = regroup(10, &[3, 3, 3, 3, 3, 3, 3]);
        let sizes: Vec<usize> = out.iter().map(Bytes::len).collect();
        assert_eq!(sizes, [10, 10, 1]);
        assert_eq!(out.concat(), data);
    }

    #[test]
    fn large_chunks_are_split_into_pieces() {
        let (data, out) = regroup(10, &[25, 4, 31]);
        let sizes: Vec<usize> = out.iter().map(Bytes::len).collect();
        assert_eq!(sizes, [10, 10, 10, 10, 10, 10]);
        assert_eq!(out.concat(), data);
    }

    #[test]
    fn whole_pieces_leave_nothing_behind() {
        let (data, out) = regroup(8, &[8, 4, 4, 16]);
        let sizes: Vec<usize> = out.iter().map(Bytes::len).collect();
        assert_eq!(sizes, [8, 8, 8, 8]);
        assert_eq!(out.concat(), data);
        assert!(Regroup::new(8).finish().is_none());
    }

    #[test]
    fn a_chunk_of_a_whole_piece_is_not_copied() {
        let chunk = Bytes::from(vec![7u8; 2 * STREAM_PIECE]);
        let mut r = Regroup::new(STREAM_PIECE);
        let out = r.push(chunk.clone());
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].as_ptr(), chunk.as_ptr(), "split, not copied");
        assert!(r.finish().is_none());
    }

    #[test]
    fn mixed_sizes_keep_every_byte() {
        let sizes = [1, 4095, 65536, 7, 300_000, 262_144, 12, 100_000, 5];
        let (data, out) = regroup(STREAM_PIECE, &sizes);
        assert_eq!(out.concat(), data);
        let (last, whole) = out.split_last().unwrap();
        assert!(whole.iter().all(|p| p.len() == STREAM_PIECE));
        assert!(!last.is_empty() && last.len() <= STREAM_PIECE);
    }
}
