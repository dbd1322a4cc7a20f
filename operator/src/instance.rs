//! The identity of one proxy instance: its domain and volume names, UUID, MAC address and
//! the ownership mark written into the domain's `<metadata>`.
//!
//! Names are derived from the Proxy's UID, which Kubernetes makes unique and immutable,
//! so every reconcile (and every operator replica) computes the same names, and a domain or
//! volume can always be traced back to its Proxy.
//!
//! The MAC is not a function of the UID alone: it is derived per *incarnation* (each
//! domain a Create defines for the Proxy), see [`derive_mac`], and recorded in the mark,
//! which is where every later reader takes it from.

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU64, Ordering};

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
        Ok(Self {
            uid: uid.to_string(),
            domain_name: format!("{NAME_PREFIX}{uid}"),
            domain_uuid: uid.to_string(),
            root_volume: format!("{NAME_PREFIX}{uid}-root"),
            seed_volume: format!("{NAME_PREFIX}{uid}-seed"),
        })
    }
}

/// The network identity of one incarnation of an instance: what its mark records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceNet {
    /// MAC of the primary NIC (lower-case `xx:xx:xx:xx:xx:xx`).
    pub mac: String,
    /// The static address allocated from the host's pool; `None` when the guest uses DHCP.
    pub address: Option<Ipv4Addr>,
}

impl InstanceNet {
    /// What `render` shows for a Proxy: the MAC of incarnation 0, no static address. A
    /// Create derives its own (a fresh incarnation), so this is a preview, not a promise.
    pub fn preview(uid: &str) -> Self {
        Self {
            mac: derive_mac(uid, 0, 0),
            address: None,
        }
    }
}

/// Random-looking bits a MAC carries: 48 less the multicast and locally-administered bits.
pub const MAC_RANDOM_BITS: u32 = 46;

/// The MAC of incarnation `incarnation` of the Proxy with UID `uid`, `attempt` counting
/// the derivations refused because the MAC was already on the host (the next is tried).
///
/// The first six bytes of `sha256("egress-operator/mac/2" ‖ uid ‖ incarnation ‖ attempt)`,
/// with the first octet's two low bits set to `10`: unicast (bit 0 clear) and locally
/// administered (bit 1 set), so it can never clash with a vendor's address, and 46 bits
/// stay random-looking. Birthday bound for `n` VMs on one bridge: `n(n-1)/2 / 2^46`; at
/// n = 10,000 that is 4.9995e7 / 7.04e13 ≈ 7.1e-7 (the former 24-bit `52:54:00:xx:xx:xx`
/// scheme: 1 - e^(-4.9995e7/2^24) ≈ 0.95, a collision near certain). A collision that
/// happens anyway is detected at Create ([`crate::provider::kvm2::domain::ippool`]).
///
/// A new incarnation gets a new MAC, so a replacement VM cannot inherit the lease, ARP
/// entry or switch state of the VM it replaces.
pub fn derive_mac(uid: &str, incarnation: u64, attempt: u32) -> String {
    let mut h = Sha256::new();
    h.update(b"egress-operator/mac/2\0");
    h.update(uid.as_bytes());
    h.update(b"\0");
    h.update(incarnation.to_be_bytes());
    h.update(attempt.to_be_bytes());
    let d = h.finalize();
    let first = (d[0] & 0xfc) | 0x02;
    format!(
        "{first:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        d[1], d[2], d[3], d[4], d[5]
    )
}

/// The MAC the operator gave a domain before MACs were recorded in the mark (QEMU's
/// `52:54:00` range, three bytes of the UID's hash): the MAC of a domain whose mark has
/// none.
pub fn legacy_mac(uid: &str) -> String {
    let d = Sha256::digest(uid.as_bytes());
    format!("52:54:00:{:02x}:{:02x}:{:02x}", d[0], d[1], d[2])
}

/// A fresh incarnation number for a Create: unpredictable across processes (the standard
/// library's randomly keyed hasher) and distinct within one (a counter and the clock).
pub fn fresh_incarnation() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    h.write_u128(now);
    h.write_u32(std::process::id());
    h.finish()
}

/// Checks a MAC as the mark records it: six lower-case hex pairs, unicast.
pub fn check_mac(mac: &str) -> Result<(), String> {
    let parts: Vec<&str> = mac.split(':').collect();
    let ok = parts.len() == 6
        && parts.iter().all(|p| {
            p.len() == 2
                && p.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        })
        && u8::from_str_radix(parts[0], 16).is_ok_and(|b| b & 1 == 0);
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{} is not a unicast MAC (lower-case xx:xx:xx:xx:xx:xx)",
            rules::show(mac)
        ))
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

/// The small volume in which the cluster `cluster_id` (of UID `cluster_uid`, in a
/// cluster) announces, on a host it shares, which images it uses there (see the image
/// cache's `uses`): named by a digest of both, so each cluster has its own, twins under
/// one `clusterId` included, and finds the others'.
pub fn image_use_name(cluster_id: &str, cluster_uid: Option<&str>) -> String {
    let who = match cluster_uid {
        Some(uid) => format!("egress-operator/cluster/{cluster_id}/{uid}"),
        None => format!("egress-operator/cluster/{cluster_id}"),
    };
    let d = Sha256::digest(who.as_bytes());
    format!("{NAME_PREFIX}imguse-{}", &hex::encode(d)[..48])
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
    /// `egress-imguse-<48 hex>`: a cluster's announcement of the images it uses on the
    /// host ([`image_use_name`]). Never a leftover.
    ImageUse {
        /// The digest of the cluster ID in the name.
        cluster: String,
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
        if let Some(d) = rest.strip_prefix("imguse-") {
            return digest(d).map(|cluster| VolumeName::ImageUse { cluster });
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
    /// Cluster ID from the providers config (or derived from the cluster UID).
    pub cluster_id: String,
    /// The cluster's UID (its `kube-system` namespace's): what tells two clusters with one
    /// `clusterId` apart. `None` in marks the CLI wrote, and in marks from before UIDs.
    pub cluster_uid: Option<String>,
    /// Proxy namespace.
    pub namespace: String,
    /// Proxy name.
    pub name: String,
    /// Proxy UID.
    pub uid: String,
    /// Creation time, RFC 3339.
    pub created_at: String,
    /// MAC of the primary NIC (marks written before MACs were recorded have none: see
    /// [`MetadataMark::mac_or_legacy`]). Recorded so a listing of the host's domains sees
    /// every MAC in use without reading each domain's devices.
    pub mac: Option<String>,
    /// The static address allocated from the host's pool, if any: the allocation's record,
    /// recovered from the host after a restart, and the address reported for the instance.
    pub address: Option<Ipv4Addr>,
}

impl MetadataMark {
    /// The mark as one XML element in [`METADATA_NS`], every value escaped.
    pub fn to_xml(&self) -> String {
        let e = |v: &str| quick_xml::escape::escape(v).into_owned();
        let mut net = String::new();
        if let Some(mac) = &self.mac {
            net.push_str(&format!("<eo:mac>{}</eo:mac>", e(mac)));
        }
        if let Some(address) = &self.address {
            net.push_str(&format!("<eo:address>{address}</eo:address>"));
        }
        let cluster_uid = self
            .cluster_uid
            .as_deref()
            .map(|u| format!("<eo:clusterUid>{}</eo:clusterUid>", e(u)))
            .unwrap_or_default();
        format!(
            "<eo:instance xmlns:eo=\"{METADATA_NS}\"><eo:managed>true</eo:managed>\
             <eo:cluster>{}</eo:cluster>{cluster_uid}<eo:proxy namespace=\"{}\" name=\"{}\" uid=\"{}\"/>\
             <eo:createdAt>{}</eo:createdAt>{net}</eo:instance>",
            e(&self.cluster_id),
            e(&self.namespace),
            e(&self.name),
            e(&self.uid),
            e(&self.created_at)
        )
    }

    /// The primary NIC's MAC: the recorded one, else the one the operator derived before it
    /// recorded MACs ([`legacy_mac`]).
    pub fn mac_or_legacy(&self) -> String {
        self.mac.clone().unwrap_or_else(|| legacy_mac(&self.uid))
    }

    /// The network identity the mark records.
    pub fn net(&self) -> InstanceNet {
        InstanceNet {
            mac: self.mac_or_legacy(),
            address: self.address,
        }
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
        // One announcement per cluster, a DNS-1123 label, distinct per cluster ID.
        let (a, b) = (
            image_use_name("prod", None),
            image_use_name("staging", None),
        );
        assert_ne!(a, b);
        let twins = (
            image_use_name("prod", Some("0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887")),
            image_use_name("prod", Some("7f00aa01-0000-4000-8000-000000000001")),
        );
        assert_ne!(twins.0, twins.1, "twins under one clusterId announce apart");
        assert_ne!(twins.0, a);
        assert!(a.len() <= 63, "{a}");
        assert!(matches!(
            VolumeName::parse(&a),
            Some(VolumeName::ImageUse { .. })
        ));
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
            cluster_uid: None,
            namespace: "ns".into(),
            name: "a\"<b>&".into(),
            uid: "u".into(),
            created_at: "2026-01-01T00:00:00Z".into(),
            mac: None,
            address: None,
        };
        let xml = m.to_xml();
        assert!(xml.contains("name=\"a&quot;&lt;b&gt;&amp;\""), "{xml}");
        assert!(
            !xml.contains("eo:mac") && !xml.contains("eo:address"),
            "{xml}"
        );
        let with_net = MetadataMark {
            mac: Some("02:00:00:00:00:01".into()),
            address: Some(Ipv4Addr::new(10, 0, 0, 5)),
            ..m
        };
        let xml = with_net.to_xml();
        assert!(
            xml.ends_with(
                "<eo:mac>02:00:00:00:00:01</eo:mac><eo:address>10.0.0.5</eo:address></eo:instance>"
            ),
            "{xml}"
        );
    }

    const UID: &str = "0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887";

    /// Bit 0 of the first octet clear (unicast), bit 1 set (locally administered), and
    /// the other 46 bits vary: each of them takes both values over a few hundred MACs.
    #[test]
    fn macs_are_local_unicast_with_46_varying_bits() {
        let mut ones = [0u32; 48];
        let mut zeros = [0u32; 48];
        for n in 0..512u64 {
            let mac = derive_mac(UID, n, 0);
            assert_eq!(check_mac(&mac), Ok(()), "{mac}");
            let bytes: Vec<u8> = mac
                .split(':')
                .map(|p| u8::from_str_radix(p, 16).unwrap())
                .collect();
            assert_eq!(bytes[0] & 0b11, 0b10, "{mac}");
            for bit in 0..48 {
                if bytes[bit / 8] >> (7 - bit % 8) & 1 == 1 {
                    ones[bit] += 1;
                } else {
                    zeros[bit] += 1;
                }
            }
        }
        let varying = (0..48).filter(|&b| ones[b] > 0 && zeros[b] > 0).count();
        assert_eq!(varying as u32, MAC_RANDOM_BITS);
    }

    #[test]
    fn mac_derivation_is_stable_and_changes_per_incarnation() {
        // Pinned: a change of the derivation changes every recorded MAC's meaning.
        assert_eq!(derive_mac(UID, 0, 0), derive_mac(UID, 0, 0));
        assert_eq!(derive_mac(UID, 0, 0), "6e:d5:c7:c2:ca:cd");
        assert_ne!(derive_mac(UID, 0, 0), derive_mac(UID, 1, 0));
        assert_ne!(derive_mac(UID, 0, 0), derive_mac(UID, 0, 1));
        let other = "0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697888";
        assert_ne!(derive_mac(UID, 0, 0), derive_mac(other, 0, 0));
        assert_eq!(legacy_mac(UID).len(), 17);
        assert!(legacy_mac(UID).starts_with("52:54:00:"));
        assert_ne!(fresh_incarnation(), fresh_incarnation());
    }

    #[test]
    fn mac_check() {
        for good in [
            "02:00:00:00:00:01",
            "52:54:00:ab:cd:ef",
            "fe:ff:ff:ff:ff:ff",
        ] {
            assert_eq!(check_mac(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "02:00:00:00:00",
            "02:00:00:00:00:01:02",
            "03:00:00:00:00:01",
            "02:00:00:00:00:0G",
            "02:00:00:00:00:AB",
            "02-00-00-00-00-01",
            "2:00:00:00:00:01",
        ] {
            assert!(check_mac(bad).is_err(), "{bad}");
        }
    }
}
