//! The identity of one proxy instance: its domain and volume names, UUID, MAC address and
//! the ownership mark written into the domain's `<metadata>`.
//!
//! Everything is derived from the Proxy's UID, which Kubernetes makes unique and immutable,
//! so every reconcile (and every operator replica) computes the same names, and a domain or
//! volume can always be traced back to its Proxy.

use sha2::{Digest, Sha256};

use crate::validation::{self as rules};

/// XML namespace of the ownership mark.
pub const METADATA_NS: &str = "https://egress-operator.dev/xmlns/instance/1";
/// Prefix of every domain and volume name we create; GC only ever looks at these.
pub const NAME_PREFIX: &str = "egress-";

/// Names and IDs of one instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceIdentity {
    /// The Proxy's UID (lower-case, hyphenated UUID).
    pub uid: String,
    /// libvirt domain name: `egress-<uid>`.
    pub domain_name: String,
    /// libvirt domain UUID: the Proxy's UID.
    pub domain_uuid: String,
    /// Root disk overlay volume: `egress-<uid>-root`.
    pub root_volume: String,
    /// NoCloud seed ISO volume: `egress-<uid>-seed`.
    pub seed_volume: String,
    /// MAC of the primary NIC, in QEMU's locally administered range (52:54:00).
    pub mac: String,
}

/// Checks a Kubernetes UID: a lower-case, hyphenated UUID.
pub fn check_uid(uid: &str) -> Result<(), String> {
    let groups: Vec<&str> = uid.split('-').collect();
    let ok = groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12])
        && groups.iter().all(|g| {
            g.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{} is not a UID (lower-case hyphenated UUID)",
            rules::show(uid)
        ))
    }
}

impl InstanceIdentity {
    /// The identity of the instance of the Proxy with this UID.
    pub fn for_uid(uid: &str) -> Result<Self, String> {
        check_uid(uid)?;
        let digest = Sha256::digest(uid.as_bytes());
        Ok(Self {
            uid: uid.to_string(),
            domain_name: format!("{NAME_PREFIX}{uid}"),
            domain_uuid: uid.to_string(),
            root_volume: format!("{NAME_PREFIX}{uid}-root"),
            seed_volume: format!("{NAME_PREFIX}{uid}-seed"),
            mac: format!(
                "52:54:00:{:02x}:{:02x}:{:02x}",
                digest[0], digest[1], digest[2]
            ),
        })
    }
}

/// The volume a base image is cached as on a host: named by its content, so every Proxy
/// and every operator replica finds the same one, and a changed image gets a new volume.
/// 48 hex digits (192 bits) keep the name a DNS-1123 label.
pub fn image_volume_name(sha256: &str) -> String {
    format!("{NAME_PREFIX}image-{}", short_digest(sha256))
}

/// The empty marker volume that says "the image volume's content was verified" (see the
/// image cache's commit protocol). Same digest, so it sorts and greps with its image.
pub fn image_marker_name(sha256: &str) -> String {
    format!("{NAME_PREFIX}imgok-{}", short_digest(sha256))
}

/// The empty volume a waiter creates (exclusively) before it takes over a staging image
/// volume whose uploader died: only one waiter can take over, and the old uploader, should
/// it wake up, sees the claim and does not commit.
pub fn image_takeover_name(sha256: &str) -> String {
    format!("{NAME_PREFIX}imgtk-{}", short_digest(sha256))
}

/// The small volume in which the current uploader of an image writes its heartbeat
/// (its token and a beat count): waiters judge a staging image volume dead by this
/// record going unchanged, which works on every pool backend (allocation growth does not:
/// LVM and RBD volumes show none).
pub fn image_heartbeat_name(sha256: &str) -> String {
    format!("{NAME_PREFIX}imghb-{}", short_digest(sha256))
}

/// One of our volume names, read back: the collector touches a volume only when its name
/// parses here, i.e. it is exactly one of the names this module makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VolumeName {
    /// `egress-<uid>-root`: an instance's root overlay.
    Root {
        /// The Proxy UID in the name.
        uid: String,
    },
    /// `egress-<uid>-seed`: an instance's seed ISO.
    Seed {
        /// The Proxy UID in the name.
        uid: String,
    },
    /// `egress-image-<48 hex>`: a base image's data volume (staging until its marker).
    ImageData {
        /// The 48 hex digits of the image's sha256 in the name.
        digest: String,
    },
    /// `egress-imgok-<48 hex>`: the marker that says the data volume was verified.
    ImageMarker {
        /// The digest in the name.
        digest: String,
    },
    /// `egress-imgtk-<48 hex>`: a takeover claim on a staging data volume.
    ImageClaim {
        /// The digest in the name.
        digest: String,
    },
    /// `egress-imghb-<48 hex>`: an uploader's heartbeat record.
    ImageHeartbeat {
        /// The digest in the name.
        digest: String,
    },
}

impl VolumeName {
    /// Reads a volume name; `None` for anything that is not exactly one of ours.
    pub fn parse(name: &str) -> Option<Self> {
        let rest = name.strip_prefix(NAME_PREFIX)?;
        let digest = |s: &str| {
            (s.len() == 48
                && s.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
            .then(|| s.to_string())
        };
        if let Some(d) = rest.strip_prefix("image-") {
            return digest(d).map(|digest| VolumeName::ImageData { digest });
        }
        if let Some(d) = rest.strip_prefix("imgok-") {
            return digest(d).map(|digest| VolumeName::ImageMarker { digest });
        }
        if let Some(d) = rest.strip_prefix("imgtk-") {
            return digest(d).map(|digest| VolumeName::ImageClaim { digest });
        }
        if let Some(d) = rest.strip_prefix("imghb-") {
            return digest(d).map(|digest| VolumeName::ImageHeartbeat { digest });
        }
        let uid = |u: &str| check_uid(u).is_ok().then(|| u.to_string());
        if let Some(u) = rest.strip_suffix("-root") {
            return uid(u).map(|uid| VolumeName::Root { uid });
        }
        if let Some(u) = rest.strip_suffix("-seed") {
            return uid(u).map(|uid| VolumeName::Seed { uid });
        }
        None
    }
}

/// The digest part of the image volume names for an image with this sha256.
pub fn image_digest(sha256: &str) -> String {
    short_digest(sha256)
}

fn short_digest(sha256: &str) -> String {
    sha256
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(48)
        .collect::<String>()
        .to_ascii_lowercase()
}

/// A stable UUID for a Proxy that has no UID yet (a manifest file, not an API object),
/// so `render` gives the same output for the same file.
pub fn name_based_uid(namespace: &str, name: &str) -> String {
    let d = Sha256::digest(format!("egress-operator/{namespace}/{name}").as_bytes());
    let h = hex::encode(&d[..16]);
    // Shape it as a version-8 (custom) RFC 9562 UUID.
    format!(
        "{}-{}-8{}-{:x}{}-{}",
        &h[0..8],
        &h[8..12],
        &h[13..16],
        (u8::from_str_radix(&h[16..17], 16).unwrap_or(0) & 0x3) | 0x8,
        &h[17..20],
        &h[20..32]
    )
}

/// The ownership mark: who made a domain, for which Proxy, when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataMark {
    /// Cluster ID from the providers config.
    pub cluster_id: String,
    /// Proxy namespace.
    pub namespace: String,
    /// Proxy name.
    pub name: String,
    /// Proxy UID.
    pub uid: String,
    /// Creation time, RFC 3339.
    pub created_at: String,
}

impl MetadataMark {
    /// The mark as one XML element in [`METADATA_NS`], every value escaped.
    pub fn to_xml(&self) -> String {
        let e = |v: &str| quick_xml::escape::escape(v).into_owned();
        format!(
            "<eo:instance xmlns:eo=\"{METADATA_NS}\"><eo:managed>true</eo:managed>\
             <eo:cluster>{}</eo:cluster><eo:proxy namespace=\"{}\" name=\"{}\" uid=\"{}\"/>\
             <eo:createdAt>{}</eo:createdAt></eo:instance>",
            e(&self.cluster_id),
            e(&self.namespace),
            e(&self.name),
            e(&self.uid),
            e(&self.created_at)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_from_uid() {
        let id = InstanceIdentity::for_uid("0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887").unwrap();
        assert_eq!(
            id.domain_name,
            "egress-0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887"
        );
        assert_eq!(
            id.root_volume,
            "egress-0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887-root"
        );
        assert!(id.mac.starts_with("52:54:00:"));
        assert_eq!(id.mac.len(), 17);
        assert!(rules::dns1123_label(&id.seed_volume).is_ok());
        for bad in [
            "",
            "../x",
            "0B7C3C1E-9A43-4F5E-A1D2-3C4B5A697887",
            "0b7c3c1e9a434f5ea1d23c4b5a697887",
        ] {
            assert!(InstanceIdentity::for_uid(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn image_volume_names_are_labels() {
        let n = image_volume_name(&"AB".repeat(32));
        assert_eq!(n, format!("egress-image-{}", "ab".repeat(24)));
        assert!(rules::dns1123_label(&n).is_ok());
        let m = image_marker_name(&"AB".repeat(32));
        assert_eq!(m, format!("egress-imgok-{}", "ab".repeat(24)));
        assert!(rules::dns1123_label(&m).is_ok());
    }

    #[test]
    fn volume_names_read_back_exactly() {
        let id = InstanceIdentity::for_uid("0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887").unwrap();
        let uid = id.uid.clone();
        assert_eq!(
            VolumeName::parse(&id.root_volume),
            Some(VolumeName::Root { uid: uid.clone() })
        );
        assert_eq!(
            VolumeName::parse(&id.seed_volume),
            Some(VolumeName::Seed { uid: uid.clone() })
        );
        let sha = "AB".repeat(32);
        let digest = image_digest(&sha);
        assert_eq!(
            VolumeName::parse(&image_volume_name(&sha)),
            Some(VolumeName::ImageData {
                digest: digest.clone()
            })
        );
        assert_eq!(
            VolumeName::parse(&image_marker_name(&sha)),
            Some(VolumeName::ImageMarker {
                digest: digest.clone()
            })
        );
        assert_eq!(
            VolumeName::parse(&image_takeover_name(&sha)),
            Some(VolumeName::ImageClaim {
                digest: digest.clone()
            })
        );
        assert_eq!(
            VolumeName::parse(&image_heartbeat_name(&sha)),
            Some(VolumeName::ImageHeartbeat { digest })
        );
        // Not exactly ours: never read as ours.
        for other in [
            "egress-0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887",
            "egress-0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887-root.bak",
            "egress-0B7C3C1E-9A43-4F5E-A1D2-3C4B5A697887-root",
            "egress-web-root",
            "egress-image-abc",
            &format!("egress-image-{}", "AB".repeat(24)),
            &format!("egress-imgxx-{}", "ab".repeat(24)),
            &format!("other-image-{}", "ab".repeat(24)),
            "vm1-root",
        ] {
            assert_eq!(VolumeName::parse(other), None, "{other}");
        }
    }

    #[test]
    fn name_based_uid_is_a_stable_uid() {
        let a = name_based_uid("default", "office-egress");
        assert_eq!(a, name_based_uid("default", "office-egress"));
        assert_ne!(a, name_based_uid("default", "other"));
        assert_eq!(check_uid(&a), Ok(()), "{a}");
    }

    #[test]
    fn mark_escapes_values() {
        let m = MetadataMark {
            cluster_id: "c".into(),
            namespace: "ns".into(),
            name: "a\"<b>&".into(),
            uid: "u".into(),
            created_at: "2026-01-01T00:00:00Z".into(),
        };
        let xml = m.to_xml();
        assert!(xml.contains("name=\"a&quot;&lt;b&gt;&amp;\""), "{xml}");
    }
}
