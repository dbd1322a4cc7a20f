//! The image collector's rules: staging volumes of images no longer configured, and
//! retired base images that no volume uses. The volumes themselves come as
//! [`VolumeCandidate`]s of kind [`VolumeKind::Staging`] or [`VolumeKind::UnusedImage`]
//! from the provider (which checks again under its own locks before a delete); this file
//! decides how long each is kept.
//!
//! - **Staging** leftovers (a data volume never verified, or a marker or takeover claim
//!   without its data volume) go after the grace period.
//! - **Retired images** follow `gc.retiredImages`: the `keepUnused` most recently unused
//!   of a host are kept, and the others go once unused for `unusedForSeconds` (and at
//!   least the grace period).

use std::collections::HashSet;

use jiff::{SignedDuration, Timestamp};

use super::volumes::{VolumeCandidate, VolumeKind};
use crate::config::RetiredImagesPolicy;

/// The retired images the policy keeps: the `keepUnused` most recently unused among the
/// candidates (`since[i]` is when candidate `i` was first seen as a leftover, `None` when
/// it is not one).
pub(super) fn kept_by_policy<'a>(
    candidates: &'a [VolumeCandidate],
    since: &[Option<Timestamp>],
    policy: &RetiredImagesPolicy,
) -> HashSet<&'a str> {
    let mut unused: Vec<(Timestamp, &str)> = candidates
        .iter()
        .zip(since)
        .filter(|(c, _)| c.kind == VolumeKind::UnusedImage)
        .filter_map(|(c, s)| Some(((*s)?, c.key.as_str())))
        .collect();
    unused.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
    let keep_n = usize::try_from(policy.keep_unused).unwrap_or(usize::MAX);
    unused.iter().take(keep_n).map(|(_, k)| *k).collect()
}

/// How long an image leftover of `kind` must have been seen before it goes.
pub(super) fn required_age(
    kind: VolumeKind,
    grace: SignedDuration,
    policy: &RetiredImagesPolicy,
) -> SignedDuration {
    match kind {
        VolumeKind::UnusedImage => grace.max(SignedDuration::from_secs(i64::from(
            policy.unused_for_seconds,
        ))),
        VolumeKind::Instance | VolumeKind::Staging | VolumeKind::Announcement => grace,
    }
}
