//! The cloud-init NoCloud seed: an ISO 9660 image labelled `cidata` holding `meta-data`,
//! `user-data`, `vendor-data` and, when there is one, `network-config`, built in memory.
//!
//! The image is written by `hadris-iso` (pure Rust, MIT) into a `Vec<u8>`: no temp files,
//! no `genisoimage`/`xorriso` on the operator image. It is laid out like `cloud-localds`
//! (`genisoimage -volid cidata -joliet -rock`): a primary tree with Rock Ridge names plus a
//! Joliet tree, so Linux sees `meta-data` rather than `META_DAT.;1` whichever extension it
//! reads, and the volume id is a lower-case `cidata` in the primary and Joliet descriptors.
//! It was chosen over `isobemak` (reads its files from host paths, no Joliet or Rock Ridge),
//! `mkisofs-rs` (a binary, no library target, unmaintained since 2019) and `iso9660`/`cdfs`/
//! `iso9660-rs` (readers only). Its dependency tree is small (bytemuck, bitflags, spin,
//! async-lock, libc), builds without a C toolchain, and it is actively released; it is a
//! 3.0 release candidate, hence the exact version pin in the workspace.
//!
//! The writer reads no clock, so the same files give the same bytes (dates are
//! 1980-01-01): a seed can be compared or checksummed.
//!
//! `user-data` may carry secrets: it never appears in `Debug` output, logs or errors.

use std::fmt;

use hadris_fs::{Content, Node, PathError, Tree};
use hadris_iso::{IsoId, IsoOptions};

use crate::error::{Classified, ErrorClass};

/// The volume label cloud-init's NoCloud source looks for (matched case-insensitively).
pub const VOLUME_ID: &str = "cidata";

/// Largest file, and largest sum of all files, a seed may hold: 4 MiB.
///
/// A seed holds a few text files (metadata, a cloud-config, a network config); a generous
/// cloud-config is tens of KiB. The image is built in memory and uploaded over the host's
/// SSH tunnel once per VM, possibly for several VMs at once, so the cap bounds memory and
/// upload time while leaving two orders of magnitude of headroom. Anything bigger belongs
/// in an image or a download, not in cloud-init data. The ISO structures add a few tens
/// of KiB on top of the files; the cap counts file content only.
pub const MAX_SEED_BYTES: u64 = 4 * 1024 * 1024;

/// What [`SeedError::TooLarge`] names when the files fit one by one but not together.
pub const TOTAL: &str = "total";

/// `user-data` when the caller has none: NoCloud needs the file to exist.
const EMPTY_USER_DATA: &[u8] = b"#cloud-config\n";

/// Files of a NoCloud seed. `user_data` is a secret: never in logs, errors or `Debug`
/// output.
#[derive(Clone, Default)]
pub struct SeedFiles {
    /// The `meta-data` YAML, usually from [`meta_data`].
    pub meta_data: String,
    /// The `user-data`; `None` writes an empty `#cloud-config`.
    pub user_data: Option<Vec<u8>>,
    /// The `vendor-data`, as the vendor-data template rendered it.
    pub vendor_data: Vec<u8>,
    /// The `network-config`, left off the image when `None`.
    pub network_config: Option<Vec<u8>>,
}

impl SeedFiles {
    /// The files of the image, by name, in the order they are checked and written.
    fn entries(&self) -> Vec<(&'static str, &[u8])> {
        let mut entries: Vec<(&'static str, &[u8])> = vec![
            ("meta-data", self.meta_data.as_bytes()),
            (
                "user-data",
                self.user_data.as_deref().unwrap_or(EMPTY_USER_DATA),
            ),
            ("vendor-data", &self.vendor_data),
        ];
        if let Some(network_config) = &self.network_config {
            entries.push(("network-config", network_config));
        }
        entries
    }
}

impl fmt::Debug for SeedFiles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SeedFiles")
            .field("meta_data", &self.meta_data)
            .field(
                "user_data",
                &self.user_data.as_ref().map(|data| Redacted(data.len())),
            )
            .field("vendor_data", &Len(self.vendor_data.len()))
            .field(
                "network_config",
                &self.network_config.as_ref().map(|data| Len(data.len())),
            )
            .finish()
    }
}

/// Debug as `<redacted, N bytes>`.
struct Redacted(usize);

impl fmt::Debug for Redacted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "<redacted, {} bytes>", self.0)
    }
}

/// Debug as `<N bytes>`.
struct Len(usize);

impl fmt::Debug for Len {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "<{} bytes>", self.0)
    }
}

/// Why a seed could not be built.
#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    /// A file, or all files together ([`TOTAL`]), exceed [`MAX_SEED_BYTES`].
    #[error("seed {file} is {size} bytes, over the {max}-byte cap")]
    TooLarge {
        /// `meta-data`, `user-data`, `vendor-data`, `network-config` or [`TOTAL`].
        file: &'static str,
        /// Its size in bytes.
        size: u64,
        /// The cap.
        max: u64,
    },
    /// The ISO writer refused the files.
    #[error("cannot build the seed image: {reason}")]
    Iso {
        /// What the writer said (names and sizes, never file content).
        reason: String,
    },
    /// A value for the network-config is not what the operator writes there.
    #[error("cannot write the seed's network-config: {reason}")]
    NetworkConfig {
        /// Which value and why.
        reason: String,
    },
    /// An image read back ([`read_files`]) is not a seed as [`build`] writes it.
    #[error("cannot read the seed image: {reason}")]
    Unreadable {
        /// What is wrong.
        reason: String,
    },
}

impl Classified for SeedError {
    fn class(&self) -> ErrorClass {
        match self {
            // The same input fails the same way.
            SeedError::TooLarge { .. }
            | SeedError::Iso { .. }
            | SeedError::NetworkConfig { .. }
            | SeedError::Unreadable { .. } => ErrorClass::Permanent,
        }
    }
}

impl From<PathError> for SeedError {
    fn from(err: PathError) -> Self {
        SeedError::Iso {
            reason: err.to_string(),
        }
    }
}

/// The `meta-data` YAML: `instance-id` and `local-hostname`, each a double-quoted YAML
/// scalar, so no value can break out of its line or change its type.
pub fn meta_data(instance_id: &str, local_hostname: &str) -> String {
    format!(
        "instance-id: {}\nlocal-hostname: {}\n",
        yaml_quoted(instance_id),
        yaml_quoted(local_hostname)
    )
}

/// Whether the host name a guest reports (through its agent) says it applied a seed whose
/// `local-hostname` is `local_hostname`: equal, ignoring ASCII case, either whole or as
/// the first label of a fully qualified name (cloud-init may add the domain).
pub fn hostname_applied(reported: &str, local_hostname: &str) -> bool {
    let reported = reported.trim();
    let short = reported.split('.').next().unwrap_or(reported);
    !local_hostname.is_empty()
        && (reported.eq_ignore_ascii_case(local_hostname)
            || short.eq_ignore_ascii_case(local_hostname))
}

/// The static network of one guest NIC, for [`network_config`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticNet {
    /// The NIC's MAC: the network-config matches the interface by it, whatever the
    /// guest's kernel names it.
    pub mac: String,
    /// The guest's address.
    pub address: std::net::Ipv4Addr,
    /// Prefix length of the bridge network.
    pub prefix: u8,
    /// Default gateway; none gives the guest no default route.
    pub gateway: Option<std::net::Ipv4Addr>,
    /// DNS servers.
    pub dns: Vec<std::net::Ipv4Addr>,
}

/// The cloud-init `network-config` (version 2) for `net`: one ethernet matched by MAC,
/// DHCP off, the address with its prefix, a default route via the gateway when there is
/// one (`routes` with `to: 0.0.0.0/0`, which every cloud-init renderer reads; `gateway4`
/// is deprecated), and the nameservers. Every value is typed or checked here and written
/// as a double-quoted YAML scalar, so nothing can change the document's structure.
pub fn network_config(net: &StaticNet) -> Result<String, SeedError> {
    let bad = |reason: String| SeedError::NetworkConfig { reason };
    crate::instance::check_mac(&net.mac).map_err(|e| bad(format!("mac: {e}")))?;
    if net.prefix == 0 || net.prefix > 30 {
        return Err(bad(format!(
            "prefix /{} is not one of /1 to /30",
            net.prefix
        )));
    }
    if net.address.is_unspecified() || net.address.is_broadcast() || net.address.is_multicast() {
        return Err(bad(format!("{} cannot be a guest address", net.address)));
    }
    let mut out = String::from("version: 2\nethernets:\n  primary:\n");
    out.push_str(&format!(
        "    match:\n      macaddress: {}\n",
        yaml_quoted(&net.mac)
    ));
    out.push_str("    dhcp4: false\n    dhcp6: false\n");
    out.push_str(&format!(
        "    addresses:\n      - {}\n",
        yaml_quoted(&format!("{}/{}", net.address, net.prefix))
    ));
    if let Some(gw) = net.gateway {
        out.push_str(&format!(
            "    routes:\n      - to: \"0.0.0.0/0\"\n        via: {}\n",
            yaml_quoted(&gw.to_string())
        ));
    }
    if !net.dns.is_empty() {
        out.push_str("    nameservers:\n      addresses:\n");
        for d in &net.dns {
            out.push_str(&format!("        - {}\n", yaml_quoted(&d.to_string())));
        }
    }
    Ok(out)
}

/// `value` as a YAML double-quoted scalar. Quotes and backslashes are escaped, and so is
/// every character that YAML would read as a line break or does not allow unescaped
/// (controls, NEL, the Unicode line and paragraph separators, the BOM, non-characters).
fn yaml_quoted(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control()
                || matches!(
                    c,
                    '\u{2028}' | '\u{2029}' | '\u{FEFF}' | '\u{FFFE}' | '\u{FFFF}'
                ) =>
            {
                out.push_str(&format!("\\u{:04X}", u32::from(c)));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Checks every file and their sum against [`MAX_SEED_BYTES`].
fn check_sizes(entries: &[(&'static str, &[u8])]) -> Result<(), SeedError> {
    let mut total: u64 = 0;
    for (file, bytes) in entries {
        let size = u64::try_from(bytes.len()).unwrap_or(u64::MAX);
        if size > MAX_SEED_BYTES {
            return Err(SeedError::TooLarge {
                file,
                size,
                max: MAX_SEED_BYTES,
            });
        }
        total = total.saturating_add(size);
    }
    if total > MAX_SEED_BYTES {
        return Err(SeedError::TooLarge {
            file: TOTAL,
            size: total,
            max: MAX_SEED_BYTES,
        });
    }
    Ok(())
}

/// The image options: volume id `cidata`, Rock Ridge and Joliet, no clock.
fn options() -> IsoOptions {
    IsoOptions::new()
        .with_id(IsoId::Volume, VOLUME_ID)
        .with_id(IsoId::Application, "egress-operator")
        .with_rock_ridge()
        .with_joliet()
}

/// Builds the seed ISO in memory. Sizes are checked first ([`SeedError::TooLarge`] names
/// the file); `network-config` is written only when present.
pub fn build(files: &SeedFiles) -> Result<Vec<u8>, SeedError> {
    let entries = files.entries();
    check_sizes(&entries)?;
    let mut tree = Tree::new();
    for (name, bytes) in &entries {
        tree.insert(name, Node::file(Content::bytes(bytes.to_vec())))?;
    }
    let options = options();
    let planned = hadris_iso::plan(&tree, &options)?.size();
    let capacity = usize::try_from(planned).map_err(|_| SeedError::Iso {
        reason: format!("planned image of {planned} bytes does not fit in memory"),
    })?;
    let mut image: Vec<u8> = Vec::with_capacity(capacity);
    let report = hadris_iso::sync::write(&mut image, &tree, &options)?;
    if report.size() != planned || u64::try_from(image.len()).ok() != Some(planned) {
        return Err(SeedError::Iso {
            reason: format!("writer produced {} bytes, planned {planned}", image.len()),
        });
    }
    Ok(image)
}

/// Size of an ISO 9660 logical sector.
const SECTOR: usize = 2048;

/// The files of a seed image, by name, read through its Joliet tree (the tree Linux
/// reads names from when Rock Ridge is absent). For tests and diagnostics: it reads the
/// flat, single-directory images [`build`] writes, and refuses anything else.
pub fn read_files(iso: &[u8]) -> Result<std::collections::BTreeMap<String, Vec<u8>>, SeedError> {
    let bad = |reason: &str| SeedError::Unreadable {
        reason: reason.into(),
    };
    let sector = |n: usize| {
        iso.get(n * SECTOR..(n + 1) * SECTOR)
            .ok_or_else(|| bad("a sector lies beyond the end of the image"))
    };
    let u32_le = |b: &[u8], at: usize| -> Result<usize, SeedError> {
        b.get(at..at + 4)
            .and_then(|x| <[u8; 4]>::try_from(x).ok())
            .map(|x| u32::from_le_bytes(x) as usize)
            .ok_or_else(|| bad("truncated record"))
    };
    // Volume descriptors from sector 16 up to the terminator (type 255).
    let mut root = None;
    for n in 16..64 {
        let d = sector(n)?;
        if &d[1..6] != b"CD001" {
            return Err(bad("no ISO 9660 volume descriptor"));
        }
        match d[0] {
            // Joliet: a supplementary descriptor with a UCS-2 escape sequence.
            2 if [b"%/@", b"%/C", b"%/E"].iter().any(|e| &d[88..91] == *e) => {
                root = Some((u32_le(d, 156 + 2)?, u32_le(d, 156 + 10)?));
                break;
            }
            255 => break,
            _ => {}
        }
    }
    let (extent, size) = root.ok_or_else(|| bad("no Joliet tree"))?;
    let dir = iso
        .get(extent * SECTOR..extent * SECTOR + size)
        .ok_or_else(|| bad("the root directory lies beyond the end of the image"))?;
    let mut files = std::collections::BTreeMap::new();
    let mut at = 0;
    while at < dir.len() {
        let len = usize::from(dir[at]);
        if len == 0 {
            // Records do not cross sectors: the rest of this one is padding.
            at = (at / SECTOR + 1) * SECTOR;
            continue;
        }
        let rec = dir
            .get(at..at + len)
            .ok_or_else(|| bad("truncated directory record"))?;
        at += len;
        let name_len = usize::from(*rec.get(32).ok_or_else(|| bad("short record"))?);
        let name = rec
            .get(33..33 + name_len)
            .ok_or_else(|| bad("truncated name"))?;
        if name == [0] || name == [1] {
            continue; // `.` and `..`
        }
        if rec[25] & 0x02 != 0 {
            return Err(bad("a seed has no subdirectories"));
        }
        let units: Vec<u16> = name
            .chunks_exact(2)
            .map(|c| u16::from_be_bytes([c[0], c[1]]))
            .collect();
        let name = String::from_utf16(&units).map_err(|_| bad("a name is not UCS-2"))?;
        let name = name.strip_suffix(";1").unwrap_or(&name).to_string();
        let (start, length) = (u32_le(rec, 2)?, u32_le(rec, 10)?);
        let data = iso
            .get(start * SECTOR..start * SECTOR + length)
            .ok_or_else(|| bad("a file lies beyond the end of the image"))?;
        files.insert(name, data.to_vec());
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files() -> SeedFiles {
        SeedFiles {
            meta_data: meta_data("i-1", "proxy-1"),
            user_data: Some(b"#cloud-config\npassword: hunter2-secret\n".to_vec()),
            vendor_data: b"#cloud-config\n".to_vec(),
            network_config: None,
        }
    }

    #[test]
    fn meta_data_is_quoted_yaml() {
        assert_eq!(
            meta_data("i-1", "proxy-1"),
            "instance-id: \"i-1\"\nlocal-hostname: \"proxy-1\"\n"
        );
    }

    #[test]
    fn meta_data_escapes_hostile_values() {
        let hostile = "a\"b\\c\nd: e\r\t\u{0}\u{85}\u{2028}\u{FEFF}#x";
        let yaml = meta_data(hostile, "x\ninstance-id: evil");
        assert_eq!(yaml.lines().count(), 2, "{yaml}");
        let parsed: std::collections::BTreeMap<String, String> =
            serde_yaml_ng::from_str(&yaml).unwrap();
        assert_eq!(parsed.len(), 2);
        assert_eq!(parsed["instance-id"], hostile);
        assert_eq!(parsed["local-hostname"], "x\ninstance-id: evil");
    }

    #[test]
    fn meta_data_keeps_types_as_strings() {
        let parsed: std::collections::BTreeMap<String, String> =
            serde_yaml_ng::from_str(&meta_data("123", "null")).unwrap();
        assert_eq!(parsed["instance-id"], "123");
        assert_eq!(parsed["local-hostname"], "null");
    }

    #[test]
    fn too_large_names_the_file() {
        let big = vec![b'x'; usize::try_from(MAX_SEED_BYTES).unwrap() + 1];
        let mut seed = files();
        seed.vendor_data = big.clone();
        match build(&seed) {
            Err(SeedError::TooLarge { file, size, max }) => {
                assert_eq!(file, "vendor-data");
                assert_eq!(size, MAX_SEED_BYTES + 1);
                assert_eq!(max, MAX_SEED_BYTES);
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
        let mut seed = files();
        seed.network_config = Some(big);
        let err = build(&seed).unwrap_err();
        assert!(err.to_string().contains("network-config"), "{err}");
        assert_eq!(err.class(), ErrorClass::Permanent);
    }

    #[test]
    fn too_large_in_total() {
        let half = vec![b'x'; usize::try_from(MAX_SEED_BYTES / 2).unwrap() + 1];
        let seed = SeedFiles {
            user_data: Some(half.clone()),
            vendor_data: half,
            ..files()
        };
        match build(&seed) {
            Err(SeedError::TooLarge { file, size, .. }) => {
                assert_eq!(file, TOTAL);
                assert!(size > MAX_SEED_BYTES);
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
    }

    #[test]
    fn at_the_cap_builds() {
        let seed = SeedFiles {
            meta_data: String::new(),
            user_data: Some(Vec::new()),
            vendor_data: vec![0xA5; usize::try_from(MAX_SEED_BYTES).unwrap()],
            network_config: None,
        };
        let image = build(&seed).unwrap();
        assert!(image.len() as u64 > MAX_SEED_BYTES);
        assert_eq!(image.len() % 2048, 0);
    }

    #[test]
    fn debug_hides_user_data() {
        let seed = files();
        let debug = format!("{seed:?}");
        assert!(!debug.contains("hunter2"), "{debug}");
        assert!(!debug.contains("password"), "{debug}");
        assert!(debug.contains("redacted, 39 bytes"), "{debug}");
        assert!(debug.contains("proxy-1"), "{debug}");
        let pretty = format!("{seed:#?}");
        assert!(!pretty.contains("hunter2"), "{pretty}");
    }

    fn static_net() -> StaticNet {
        StaticNet {
            mac: "02:11:22:33:44:55".into(),
            address: "10.203.0.17".parse().unwrap(),
            prefix: 24,
            gateway: Some("10.203.0.1".parse().unwrap()),
            dns: vec!["10.203.0.1".parse().unwrap(), "192.0.2.53".parse().unwrap()],
        }
    }

    #[test]
    fn network_config_is_v2_matched_by_mac() {
        let yaml = network_config(&static_net()).unwrap();
        let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&yaml).unwrap();
        assert_eq!(doc["version"], 2);
        let nic = &doc["ethernets"]["primary"];
        assert_eq!(nic["match"]["macaddress"], "02:11:22:33:44:55");
        assert_eq!(nic["dhcp4"], false);
        assert_eq!(nic["addresses"][0], "10.203.0.17/24");
        assert_eq!(nic["routes"][0]["to"], "0.0.0.0/0");
        assert_eq!(nic["routes"][0]["via"], "10.203.0.1");
        assert_eq!(nic["nameservers"]["addresses"][1], "192.0.2.53");

        let bare = StaticNet {
            gateway: None,
            dns: vec![],
            ..static_net()
        };
        let doc: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(&network_config(&bare).unwrap()).unwrap();
        let nic = &doc["ethernets"]["primary"];
        assert!(nic.get("routes").is_none(), "{nic:?}");
        assert!(nic.get("nameservers").is_none(), "{nic:?}");

        for bad in [
            StaticNet {
                mac: "02:11:22:33:44:55\nversion: 1".into(),
                ..static_net()
            },
            StaticNet {
                mac: "01:00:5e:00:00:01".into(),
                ..static_net()
            },
            StaticNet {
                prefix: 31,
                ..static_net()
            },
            StaticNet {
                address: std::net::Ipv4Addr::BROADCAST,
                ..static_net()
            },
        ] {
            let err = network_config(&bad).unwrap_err();
            assert_eq!(err.class(), ErrorClass::Permanent, "{err}");
        }
    }

    #[test]
    fn hostname_check() {
        for (reported, want) in [
            ("office-egress", true),
            ("Office-Egress\n", true),
            ("office-egress.example.com", true),
            ("debian", false),
            ("localhost", false),
            ("office-egress-2", false),
            ("", false),
        ] {
            assert_eq!(
                hostname_applied(reported, "office-egress"),
                want,
                "{reported:?}"
            );
        }
        assert!(!hostname_applied("", ""));
    }

    #[test]
    fn files_read_back() {
        let mut seed = files();
        seed.network_config = Some(network_config(&static_net()).unwrap().into_bytes());
        let back = read_files(&build(&seed).unwrap()).unwrap();
        let names: Vec<&str> = back.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            ["meta-data", "network-config", "user-data", "vendor-data"]
        );
        assert_eq!(back["network-config"], seed.network_config.clone().unwrap());
        assert_eq!(back["meta-data"], seed.meta_data.as_bytes());
        assert_eq!(back["user-data"], seed.user_data.clone().unwrap());
        let without = read_files(&build(&files()).unwrap()).unwrap();
        assert!(!without.contains_key("network-config"));
        assert!(read_files(&[0u8; 4096]).is_err());
        assert!(read_files(&build(&files()).unwrap()[..17 * 2048]).is_err());
    }

    #[test]
    fn builds_an_iso_with_the_label_and_is_reproducible() {
        let image = build(&files()).unwrap();
        assert_eq!(image.len() % 2048, 0);
        // Primary volume descriptor at sector 16: type 1, "CD001", volume id at byte 40.
        let pvd = &image[16 * 2048..17 * 2048];
        assert_eq!(&pvd[..6], b"\x01CD001");
        assert_eq!(&pvd[40..46], b"cidata");
        assert!(pvd[46..72].iter().all(|&b| b == b' '));
        assert_eq!(build(&files()).unwrap(), image);
    }
}
