//! Semantic validation of the providers config: every rule, every field, every problem.
//!
//! serde already refused unknown fields and wrong types; this pass checks values (names,
//! paths, URLs, digests, ranges), duplicates and references, and reports each problem with
//! its path. It never stops at the first problem.

use std::collections::HashMap;

use super::types::*;
use crate::templates::check::{CpuSet, MAX_CPU_ID};
use crate::validation::{self as rules, HttpPolicy, Problems};

/// Ranges of the numeric settings, each with why it is where it is.
pub mod limits {
    /// Below 1 s a handshake over any real network fails; above 5 min nobody is waiting.
    pub const CONNECT_TIMEOUT_SECONDS: (u32, u32) = (1, 300);
    /// Keepalives faster than 1 s are noise; slower than 10 min never notice a dead link.
    pub const KEEPALIVE_INTERVAL_SECONDS: (u32, u32) = (1, 600);
    /// At least one miss; more than 100 means a dead link goes unnoticed for hours.
    pub const KEEPALIVE_MAX_MISSED: (u32, u32) = (1, 100);
    /// Per-host domain cap.
    pub const MAX_DOMAINS: (u32, u32) = (1, 1000);
    /// Concurrent Creates per host.
    pub const MAX_CONCURRENT_CREATES: (u32, u32) = (1, 64);
    /// An image cap below 1 MiB cannot hold a bootable image; 1 TiB is far beyond any
    /// proxy image.
    pub const IMAGE_MAX_SIZE_MIB: (u64, u64) = (1, 1 << 20);
    /// vCPUs: QEMU's practical limit for a proxy.
    pub const VCPUS: (u32, u32) = (1, 256);
    /// Memory: a Linux guest needs 128 MiB; 1 TiB is far beyond any proxy.
    pub const MEMORY_MIB: (u64, u64) = (128, 1 << 20);
    /// Root disk: at least 1 GiB; at most 16 TiB (qcow2's practical limit per overlay).
    pub const DISK_GIB: (u64, u64) = (1, 16 << 10);
    /// One render: 1 ms to 10 s.
    pub const TEMPLATE_TIMEOUT_MILLIS: (u32, u32) = (1, 10_000);
    /// One render's linear memory: 1 MiB to 1 GiB.
    pub const TEMPLATE_MAX_MEMORY_MIB: (u32, u32) = (1, 1024);
    /// GC sweep period: 10 s to a day.
    pub const GC_PERIOD_SECONDS: (u32, u32) = (10, 86_400);
    /// GC grace period: up to a week. Zero is allowed for tests of the collector.
    pub const GC_GRACE_PERIOD_SECONDS: (u32, u32) = (0, 7 * 86_400);
    /// Unused retired images kept per host: up to 100.
    pub const RETIRED_IMAGES_KEEP_UNUSED: (u32, u32) = (0, 100);
    /// How long a retired image stays unused before it goes: up to 90 days.
    pub const RETIRED_IMAGES_UNUSED_FOR_SECONDS: (u32, u32) = (0, 90 * 86_400);
    /// Health check period: 5 s to an hour.
    pub const HEALTH_PERIOD_SECONDS: (u32, u32) = (5, 3_600);
    /// Health check timeout: 1 s to 5 min, and below the period.
    pub const HEALTH_TIMEOUT_SECONDS: (u32, u32) = (1, 300);
    /// One proxy probe: 1 s to 2 min.
    pub const SERVING_TIMEOUT_SECONDS: (u32, u32) = (1, 120);
    /// Probe period: 5 s to an hour.
    pub const SERVING_PERIOD_SECONDS: (u32, u32) = (5, 3_600);
    /// Probes in flight: 1 to 1024.
    pub const SERVING_CONCURRENCY: (u32, u32) = (1, 1024);
    /// Replace a non-serving proxy after up to a day; 0 never replaces.
    pub const SERVING_REPLACE_AFTER_SECONDS: (u32, u32) = (0, 86_400);
    /// Largest settings document handed to a plugin, serialised.
    pub const TEMPLATE_SETTINGS_BYTES: usize = 64 * 1024;
    /// Most entries of a plugin's `overridableSettings`: a plugin has a handful of
    /// settings, and each listed key widens what a Proxy author controls.
    pub const OVERRIDABLE_SETTINGS_MAX: usize = 64;
    /// Longest settings key that may be listed as overridable.
    pub const SETTINGS_KEY_MAX: usize = 128;
}

/// A top-level settings key that may be listed in `overridableSettings`: an identifier
/// (letters, digits, `_`, `-`), so it can be named in a field path without quoting and can
/// never be mistaken for a nested path.
pub const SETTINGS_KEY_PATTERN: &str = "^[A-Za-z_][A-Za-z0-9_-]*$";

/// Checks one settings key against [`SETTINGS_KEY_PATTERN`] and
/// [`limits::SETTINGS_KEY_MAX`].
pub fn settings_key(key: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err("is empty: name a top-level key of `settings`".into());
    }
    if key.len() > limits::SETTINGS_KEY_MAX {
        return Err(format!(
            "{} is too long: {} bytes, at most {} allowed",
            rules::show(key),
            key.len(),
            limits::SETTINGS_KEY_MAX
        ));
    }
    let mut bytes = key.bytes();
    let first_ok = bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
    if first_ok && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        Ok(())
    } else {
        Err(format!(
            "{} is not a top-level settings key: use letters, digits, '_' and '-', starting \
             with a letter or '_' (nested paths are not supported)",
            rules::show(key)
        ))
    }
}

/// An absolute host path compared exactly by the output check: no `.`, `..` or empty
/// components, no control characters, within `PATH_MAX`.
fn is_clean_absolute_path(p: &str) -> bool {
    p.len() < 4096
        && p.starts_with('/')
        && !p.chars().any(char::is_control)
        && p[1..]
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

fn range<T: PartialOrd + std::fmt::Display + Copy>(
    value: T,
    bounds: (T, T),
    unit: &str,
) -> Result<(), String> {
    rules::in_range(value, bounds.0, bounds.1, unit)
}

/// Checks the whole config and returns every problem found.
pub fn validate(config: &ProvidersConfig) -> Problems {
    let mut p = Problems::new();
    if let Some(id) = &config.cluster_id {
        p.check("clusterId", rules::dns1123_label(id));
    }
    validate_kvm2(&config.kvm2, &mut p);

    let gc = &config.gc;
    p.check(
        "gc.periodSeconds",
        range(gc.period_seconds, limits::GC_PERIOD_SECONDS, "s"),
    );
    p.check(
        "gc.gracePeriodSeconds",
        range(
            gc.grace_period_seconds,
            limits::GC_GRACE_PERIOD_SECONDS,
            "s",
        ),
    );
    p.check(
        "gc.retiredImages.keepUnused",
        range(
            gc.retired_images.keep_unused,
            limits::RETIRED_IMAGES_KEEP_UNUSED,
            "",
        ),
    );
    p.check(
        "gc.retiredImages.unusedForSeconds",
        range(
            gc.retired_images.unused_for_seconds,
            limits::RETIRED_IMAGES_UNUSED_FOR_SECONDS,
            "s",
        ),
    );

    let sv = &config.serving;
    p.check("serving.port", range(sv.port, (1, u16::MAX), ""));
    if let Some(t) = &sv.target {
        p.check(
            "serving.target",
            rules::host_port(t, 0).and_then(|(_, port)| {
                if port == 0 {
                    Err(format!("{t:?} needs an explicit port (host:port)"))
                } else {
                    Ok(())
                }
            }),
        );
    }
    p.check(
        "serving.timeoutSeconds",
        range(sv.timeout_seconds, limits::SERVING_TIMEOUT_SECONDS, "s"),
    );
    p.check(
        "serving.periodSeconds",
        range(sv.period_seconds, limits::SERVING_PERIOD_SECONDS, "s"),
    );
    p.check(
        "serving.concurrency",
        range(sv.concurrency, limits::SERVING_CONCURRENCY, ""),
    );
    p.check(
        "serving.replaceAfterSeconds",
        range(
            sv.replace_after_seconds,
            limits::SERVING_REPLACE_AFTER_SECONDS,
            "s",
        ),
    );
    if sv.timeout_seconds >= sv.period_seconds {
        p.push(
            "serving.timeoutSeconds",
            format!(
                "{} s must be shorter than serving.periodSeconds ({} s), or probes overlap",
                sv.timeout_seconds, sv.period_seconds
            ),
        );
    }

    let hc = &config.health_check;
    p.check(
        "healthCheck.periodSeconds",
        range(hc.period_seconds, limits::HEALTH_PERIOD_SECONDS, "s"),
    );
    p.check(
        "healthCheck.timeoutSeconds",
        range(hc.timeout_seconds, limits::HEALTH_TIMEOUT_SECONDS, "s"),
    );
    if hc.timeout_seconds >= hc.period_seconds {
        p.push(
            "healthCheck.timeoutSeconds",
            format!(
                "{} s must be shorter than healthCheck.periodSeconds ({} s), or checks overlap",
                hc.timeout_seconds, hc.period_seconds
            ),
        );
    }
    p
}

fn validate_kvm2(k: &Kvm2Config, p: &mut Problems) {
    let ssh = &k.ssh;
    p.check("kvm2.ssh.user", rules::user_name(&ssh.user));
    p.check(
        "kvm2.ssh.privateKeyFile",
        rules::file_path(&ssh.private_key_file),
    );
    p.check(
        "kvm2.ssh.knownHostsFile",
        rules::file_path(&ssh.known_hosts_file),
    );
    p.check(
        "kvm2.ssh.connectTimeoutSeconds",
        range(
            ssh.connect_timeout_seconds,
            limits::CONNECT_TIMEOUT_SECONDS,
            "s",
        ),
    );
    p.check(
        "kvm2.ssh.keepaliveIntervalSeconds",
        range(
            ssh.keepalive_interval_seconds,
            limits::KEEPALIVE_INTERVAL_SECONDS,
            "s",
        ),
    );
    p.check(
        "kvm2.ssh.keepaliveMaxMissed",
        range(ssh.keepalive_max_missed, limits::KEEPALIVE_MAX_MISSED, ""),
    );

    if k.hosts.is_empty() {
        p.push("kvm2.hosts", "at least one host is required");
    }
    let mut addresses: HashMap<(String, u16), usize> = HashMap::new();
    let mut pools: Vec<(usize, crate::config::types::AddressPool)> = Vec::new();
    for (i, h) in k.hosts.iter().enumerate() {
        let at = |f: &str| format!("kvm2.hosts[{i}].{f}");
        p.check(at("name"), rules::dns1123_label(&h.name));
        match rules::host_port(&h.address, DEFAULT_SSH_PORT) {
            Ok((host, port)) => {
                let key = (host.to_ascii_lowercase(), port);
                if let Some(first) = addresses.get(&key) {
                    p.push(
                        at("address"),
                        format!(
                            "{} is already used by kvm2.hosts[{first}]; one host must not be \
                             listed twice (its capacity would be counted twice)",
                            rules::show(&h.address)
                        ),
                    );
                } else {
                    addresses.insert(key, i);
                }
            }
            Err(e) => p.push(at("address"), e),
        }
        p.check(at("libvirtSocket"), rules::socket_path(&h.libvirt_socket));
        p.check(
            at("storagePool"),
            rules::libvirt_object_name(&h.storage_pool),
        );
        p.check(at("bridge"), rules::interface_name(&h.bridge));
        p.check(
            at("maxDomains"),
            range(h.max_domains, limits::MAX_DOMAINS, ""),
        );
        p.check(
            at("maxConcurrentCreates"),
            range(h.max_concurrent_creates, limits::MAX_CONCURRENT_CREATES, ""),
        );
        if let Some(mtu) = h.bridge_mtu {
            p.check(at("bridgeMtu"), range(mtu, (68, 65535), ""));
        }
        if let Some(net) = &h.bridge_network {
            if h.address_pool.is_some() {
                p.push(
                    at("bridgeNetwork"),
                    "is for DHCP hosts; with addressPool the pool's cidr is the bridge's network"
                        .to_string(),
                );
            } else if let Err(why) = super::types::bridge_network(net) {
                p.push(at("bridgeNetwork"), why);
            }
        }
        if let Some(cp) = &h.cpu_placement {
            let sets = std::iter::once(("cpuPlacement.cpus", Some(&cp.cpus)))
                .chain(std::iter::once(("cpuPlacement.nodes", cp.nodes.as_ref())));
            for (field, set) in sets {
                if let Some(set) = set
                    && CpuSet::parse(set).is_none()
                {
                    p.push(
                        at(field),
                        format!(
                            "{set:?} is not a non-empty set in libvirt's syntax (\"4-15,^8\", \
                             numbers up to {MAX_CPU_ID})"
                        ),
                    );
                }
            }
        }
        for (j, t) in h.nvram_templates.iter().enumerate() {
            if !is_clean_absolute_path(t) {
                p.push(
                    at(&format!("nvramTemplates[{j}]")),
                    format!("{t:?} must be an absolute path without '.', '..' or empty components"),
                );
            }
        }
        if let Some(pool) = &h.address_pool {
            match pool.parse() {
                Ok(parsed) => {
                    // Each host allocates on its own; two hosts handing out the same
                    // address onto one network would be a conflict nobody sees.
                    if let Some((j, _)) = pools
                        .iter()
                        .find(|(_, o)| o.first <= parsed.last && parsed.first <= o.last)
                    {
                        p.push(
                            at("addressPool.rangeStart"),
                            format!(
                                "the range {}-{} overlaps kvm2.hosts[{j}]'s pool; hosts whose \
                                 bridges share a network need disjoint ranges",
                                parsed.first, parsed.last
                            ),
                        );
                    }
                    if u64::from(parsed.size()) < u64::from(h.max_domains) {
                        p.push(
                            at("addressPool.rangeEnd"),
                            format!(
                                "the range {}-{} holds {} addresses, fewer than maxDomains ({})",
                                parsed.first,
                                parsed.last,
                                parsed.size(),
                                h.max_domains
                            ),
                        );
                    }
                    pools.push((i, parsed));
                }
                Err((field, why)) => p.push(at(&format!("addressPool.{field}")), why),
            }
        }
    }
    duplicates("kvm2.hosts", k.hosts.iter().map(|h| h.name.as_str()), p);

    if k.images.is_empty() {
        p.push("kvm2.images", "at least one image is required");
    }
    for (i, img) in k.images.iter().enumerate() {
        let at = |f: &str| format!("kvm2.images[{i}].{f}");
        p.check(at("name"), rules::dns1123_label(&img.name));
        let policy = if img.allow_http {
            HttpPolicy::AllowHttp
        } else {
            HttpPolicy::HttpsOnly
        };
        p.check(at("url"), rules::download_url(&img.url, policy).map(drop));
        p.check(at("sha256"), rules::sha256_hex(&img.sha256));
        if let Some(cap) = img.max_size_mib {
            p.check(
                at("maxSizeMiB"),
                range(cap, limits::IMAGE_MAX_SIZE_MIB, "MiB"),
            );
        }
    }
    duplicates("kvm2.images", k.images.iter().map(|i| i.name.as_str()), p);

    if k.machine_types.is_empty() {
        p.push("kvm2.machineTypes", "at least one machine type is required");
    }
    for (i, m) in k.machine_types.iter().enumerate() {
        let at = |f: &str| format!("kvm2.machineTypes[{i}].{f}");
        p.check(at("name"), rules::dns1123_label(&m.name));
        p.check(at("vcpus"), range(m.vcpus, limits::VCPUS, "vCPUs"));
        p.check(
            at("memoryMiB"),
            range(m.memory_mib, limits::MEMORY_MIB, "MiB"),
        );
        p.check(at("diskGiB"), range(m.disk_gib, limits::DISK_GIB, "GiB"));
    }
    duplicates(
        "kvm2.machineTypes",
        k.machine_types.iter().map(|m| m.name.as_str()),
        p,
    );

    if let Some(d) = &k.defaults {
        if let Some(mt) = &d.machine_type {
            reference(
                "kvm2.defaults.machineType",
                mt,
                "kvm2.machineTypes",
                k.machine_types.iter().map(|m| m.name.as_str()),
                p,
            );
        }
        if let Some(img) = &d.image {
            reference(
                "kvm2.defaults.image",
                img,
                "kvm2.images",
                k.images.iter().map(|i| i.name.as_str()),
                p,
            );
        }
    }

    validate_template("kvm2.templates.domain", &k.templates.domain, p);
    validate_template("kvm2.templates.vendorData", &k.templates.vendor_data, p);
}

fn validate_template(path: &str, t: &TemplateConfig, p: &mut Problems) {
    let at = |f: &str| format!("{path}.{f}");
    match (&t.path, &t.url) {
        (Some(_), Some(_)) => p.push(path, "set exactly one of `path` and `url`, not both"),
        (None, None) => p.push(path, "set exactly one of `path` and `url`"),
        (Some(file), None) => p.check(at("path"), rules::file_path(file)),
        (None, Some(url)) if url.starts_with("oci://") => {
            let checked = crate::templates::oci::OciRef::parse(url)
                .map_err(|e| match e {
                    crate::templates::oci::OciError::BadReference { reason, .. } => reason,
                    other => other.to_string(),
                })
                .and_then(|r| match r.digest {
                    Some(_) => Ok(()),
                    None => Err(format!(
                        "{}: needs the manifest digest (oci://REGISTRY/REPOSITORY:TAG@sha256:...); \
                         a plugin is pulled only by digest, as `plugin push` prints it",
                        rules::show(url)
                    )),
                });
            p.check(at("url"), checked);
        }
        (None, Some(url)) => {
            // A plugin's URL is its name in logs, in ProviderHealth's status and in the
            // `plugin` metric label; a query string there (a presigned URL's signature)
            // would hand the credential to everyone who reads those. The sha256 pins the
            // plugin, so nothing needs a signed URL.
            let checked = rules::download_url(url, HttpPolicy::HttpsAlways).and_then(|u| {
                if u.query().is_some() {
                    Err(format!(
                        "{}: must not carry a query string (?...): the URL names the plugin in \
                         logs, ProviderHealth status and metrics, where a presigned signature \
                         would leak; serve the plugin at a plain https URL (sha256 pins it)",
                        rules::show(&format!("{}{}", u.origin().ascii_serialization(), u.path()))
                    ))
                } else {
                    Ok(())
                }
            });
            p.check(at("url"), checked);
            if t.sha256.is_none() {
                p.push(
                    at("sha256"),
                    "is required with `url`: a downloaded plugin is verified before it is compiled",
                );
            }
        }
    }
    if let Some(sum) = &t.sha256 {
        p.check(at("sha256"), rules::sha256_hex(sum));
    }
    if let Some(file) = &t.credentials_file {
        if t.url.as_deref().is_some_and(|u| u.starts_with("oci://")) {
            p.check(at("credentialsFile"), rules::file_path(file));
        } else {
            p.push(
                at("credentialsFile"),
                "is only for an `oci://` url (registry credentials); an https plugin is \
                 served at a plain URL and a `path` plugin is read from disk",
            );
        }
    }
    if !t.settings.is_object() {
        p.push(at("settings"), "must be a mapping (JSON object)");
    } else {
        let size = serde_json::to_vec(&t.settings)
            .map(|v| v.len())
            .unwrap_or(usize::MAX);
        if size > limits::TEMPLATE_SETTINGS_BYTES {
            p.push(
                at("settings"),
                format!(
                    "is {size} bytes serialised, at most {} allowed",
                    limits::TEMPLATE_SETTINGS_BYTES
                ),
            );
        }
    }
    validate_overridable(&at("overridableSettings"), &t.overridable_settings, p);
    p.check(
        at("timeoutMillis"),
        range(t.timeout_millis, limits::TEMPLATE_TIMEOUT_MILLIS, "ms"),
    );
    p.check(
        at("maxMemoryMiB"),
        range(t.max_memory_mib, limits::TEMPLATE_MAX_MEMORY_MIB, "MiB"),
    );
}

/// `overridableSettings`: a short list of unique top-level keys.
fn validate_overridable(path: &str, keys: &[String], p: &mut Problems) {
    if keys.len() > limits::OVERRIDABLE_SETTINGS_MAX {
        p.push(
            path,
            format!(
                "lists {} keys, at most {} allowed",
                keys.len(),
                limits::OVERRIDABLE_SETTINGS_MAX
            ),
        );
        return;
    }
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (i, key) in keys.iter().enumerate() {
        let at = format!("{path}[{i}]");
        if let Err(e) = settings_key(key) {
            p.push(at, e);
        } else if let Some(first) = seen.get(key.as_str()) {
            p.push(
                at,
                format!("{} is a duplicate of {path}[{first}]", rules::show(key)),
            );
        } else {
            seen.insert(key, i);
        }
    }
}

/// Refuses names that appear twice in a list, pointing at the second entry and the first.
fn duplicates<'a>(list: &str, names: impl Iterator<Item = &'a str>, p: &mut Problems) {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (i, name) in names.enumerate() {
        if let Some(first) = seen.get(name) {
            p.push(
                format!("{list}[{i}].name"),
                format!(
                    "{} is a duplicate of {list}[{first}].name",
                    rules::show(name)
                ),
            );
        } else {
            seen.insert(name, i);
        }
    }
}

/// Refuses a reference to a name the list does not have, listing what it does have.
pub(crate) fn reference<'a>(
    path: &str,
    name: &str,
    list: &str,
    names: impl Iterator<Item = &'a str>,
    p: &mut Problems,
) {
    let known: Vec<&str> = names.collect();
    if !known.contains(&name) {
        let mut listed: Vec<String> = known.iter().take(10).map(|n| rules::show(n)).collect();
        if known.len() > 10 {
            listed.push("...".into());
        }
        p.push(
            path,
            format!(
                "{} does not name an entry of {list} (known: {})",
                rules::show(name),
                if listed.is_empty() {
                    "none".into()
                } else {
                    listed.join(", ")
                }
            ),
        );
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A small valid config; each case below breaks one field of it.
    pub(crate) const VALID: &str = r#"
clusterId: test
kvm2:
  ssh: {user: egress, privateKeyFile: /k/id, knownHostsFile: /k/known_hosts}
  hosts:
    - {name: h1, address: "127.0.0.1:2222", storagePool: default, bridge: br0}
    - {name: h2, address: "h2.example.org", storagePool: default, bridge: br0}
  images:
    - name: debian
      url: https://images.example.org/debian.qcow2
      sha256: "0000000000000000000000000000000000000000000000000000000000000000"
      format: qcow2
  machineTypes:
    - {name: small, vcpus: 1, memoryMiB: 512, diskGiB: 4}
  defaults: {machineType: small, image: debian}
  templates:
    domain: {path: /p/domain.wasm}
    vendorData: {url: "https://plugins.example.org/v.wasm", sha256: "1111111111111111111111111111111111111111111111111111111111111111"}
"#;

    fn base() -> ProvidersConfig {
        serde_yaml_ng::from_str(VALID).unwrap()
    }

    fn problems_of(edit: impl FnOnce(&mut ProvidersConfig)) -> Vec<String> {
        let mut c = base();
        edit(&mut c);
        validate(&c)
            .into_vec()
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    /// Asserts the edit yields exactly one problem, at `path`, whose message contains `want`.
    fn refused(name: &str, edit: impl FnOnce(&mut ProvidersConfig), path: &str, want: &str) {
        let got = problems_of(edit);
        assert_eq!(got.len(), 1, "{name}: expected one problem, got {got:#?}");
        let prefix = format!("{path}: ");
        assert!(
            got[0].starts_with(&prefix) && got[0].contains(want),
            "{name}: expected `{path}: …{want}…`, got {:?}",
            got[0]
        );
    }

    /// An address pool on `cidr`; range ends starting with `.` are completed from it.
    fn pool(cidr: &str, start: &str, end: &str) -> crate::config::types::AddressPoolConfig {
        let prefix = cidr.rsplit_once('.').map(|(p, _)| p).unwrap_or(cidr);
        let full = |a: &str| {
            if a.starts_with('.') {
                format!("{prefix}{a}")
            } else {
                a.to_string()
            }
        };
        crate::config::types::AddressPoolConfig {
            cidr: cidr.into(),
            gateway: None,
            dns: Vec::new(),
            range_start: full(start),
            range_end: full(end),
        }
    }

    #[test]
    fn address_pools_of_two_hosts_must_not_overlap() {
        let problems = problems_of(|c| {
            let mut second = c.kvm2.hosts[0].clone();
            second.name = "kvm-b".into();
            second.address = "kvm-b.example:22".into();
            c.kvm2.hosts[0].address_pool = Some(pool("10.9.0.0/24", ".10", ".60"));
            second.address_pool = Some(pool("10.9.0.0/24", ".60", ".99"));
            c.kvm2.hosts.push(second);
        });
        assert!(
            problems.iter().any(|p| p
                .starts_with(&format!("kvm2.hosts[{}].addressPool.rangeStart", 2))
                && p.contains("overlaps kvm2.hosts[0]")),
            "{problems:?}"
        );
        let disjoint = problems_of(|c| {
            let mut second = c.kvm2.hosts[0].clone();
            second.name = "kvm-b".into();
            second.address = "kvm-b.example:22".into();
            c.kvm2.hosts[0].address_pool = Some(pool("10.9.0.0/24", ".10", ".59"));
            second.address_pool = Some(pool("10.9.0.0/24", ".60", ".99"));
            c.kvm2.hosts.push(second);
        });
        assert_eq!(disjoint, Vec::<String>::new());
    }

    #[test]
    fn a_valid_pool_parses_to_what_the_allocator_uses() {
        let mut p = pool("10.9.0.0/24", ".10", ".59");
        p.gateway = Some("10.9.0.1".into());
        p.dns = vec!["10.9.0.1".into()];
        let parsed = p.parse().unwrap();
        assert_eq!(parsed.size(), 50);
        assert!(parsed.contains("10.9.0.10".parse().unwrap()));
        assert!(!parsed.contains("10.9.0.60".parse().unwrap()));
        assert_eq!(parsed.gateway, Some("10.9.0.1".parse().unwrap()));
    }

    #[test]
    fn an_oci_plugin_needs_only_its_digest_and_may_name_credentials() {
        let problems = problems_of(|c| {
            c.kvm2.templates.vendor_data.url = Some(format!(
                "oci://registry.example.org:5000/plugins/v:1@sha256:{}",
                "a".repeat(64)
            ));
            c.kvm2.templates.vendor_data.sha256 = None;
            c.kvm2.templates.vendor_data.credentials_file = Some("/etc/eo/registry.json".into());
        });
        assert!(problems.is_empty(), "{problems:?}");
    }

    #[test]
    fn a_refused_plugin_url_does_not_echo_its_signature() {
        let problems = problems_of(|c| {
            c.kvm2.templates.domain.path = None;
            c.kvm2.templates.domain.url = Some(
                "https://x.example.org/d.wasm?X-Amz-Signature=s3cr3t&X-Amz-Credential=AKIA".into(),
            );
            c.kvm2.templates.domain.sha256 = Some("a".repeat(64));
        });
        let all = problems.join("\n");
        assert!(all.contains("https://x.example.org/d.wasm"), "{all}");
        assert!(!all.contains("s3cr3t") && !all.contains("AKIA"), "{all}");
    }

    #[test]
    fn base_is_valid() {
        assert_eq!(problems_of(|_| {}), Vec::<String>::new());
    }

    #[test]
    fn every_rule_refuses_its_field() {
        type Edit = fn(&mut ProvidersConfig);
        let cases: &[(&str, Edit, &str, &str)] = &[
            (
                "cluster id",
                |c| c.cluster_id = Some("Prod_1".into()),
                "clusterId",
                "DNS-1123",
            ),
            (
                "ssh user",
                |c| c.kvm2.ssh.user = "root;rm".into(),
                "kvm2.ssh.user",
                "user name",
            ),
            (
                "key file",
                |c| c.kvm2.ssh.private_key_file = String::new(),
                "kvm2.ssh.privateKeyFile",
                "empty",
            ),
            (
                "known hosts",
                |c| c.kvm2.ssh.known_hosts_file = "a\0b".into(),
                "kvm2.ssh.knownHostsFile",
                "control",
            ),
            (
                "connect timeout",
                |c| c.kvm2.ssh.connect_timeout_seconds = 0,
                "kvm2.ssh.connectTimeoutSeconds",
                "out of range",
            ),
            (
                "keepalive",
                |c| c.kvm2.ssh.keepalive_interval_seconds = 601,
                "kvm2.ssh.keepaliveIntervalSeconds",
                "out of range",
            ),
            (
                "keepalive misses",
                |c| c.kvm2.ssh.keepalive_max_missed = 0,
                "kvm2.ssh.keepaliveMaxMissed",
                "out of range",
            ),
            (
                "no hosts",
                |c| c.kvm2.hosts.clear(),
                "kvm2.hosts",
                "at least one host",
            ),
            (
                "host name",
                |c| c.kvm2.hosts[1].name = "H2".into(),
                "kvm2.hosts[1].name",
                "DNS-1123",
            ),
            (
                "host address",
                |c| c.kvm2.hosts[1].address = "h2:99999".into(),
                "kvm2.hosts[1].address",
                "1..=65535",
            ),
            (
                "same address twice",
                |c| c.kvm2.hosts[1].address = "127.0.0.1:2222".into(),
                "kvm2.hosts[1].address",
                "already used by kvm2.hosts[0]",
            ),
            (
                "socket",
                |c| c.kvm2.hosts[0].libvirt_socket = "run/sock".into(),
                "kvm2.hosts[0].libvirtSocket",
                "absolute",
            ),
            (
                "pool",
                |c| c.kvm2.hosts[0].storage_pool = "../pool".into(),
                "kvm2.hosts[0].storagePool",
                "libvirt object name",
            ),
            (
                "bridge",
                |c| c.kvm2.hosts[0].bridge = "br 0".into(),
                "kvm2.hosts[0].bridge",
                "is not a valid interface name",
            ),
            (
                "max domains",
                |c| c.kvm2.hosts[0].max_domains = 0,
                "kvm2.hosts[0].maxDomains",
                "out of range",
            ),
            (
                "max creates",
                |c| c.kvm2.hosts[0].max_concurrent_creates = 65,
                "kvm2.hosts[0].maxConcurrentCreates",
                "out of range",
            ),
            (
                "duplicate host",
                |c| c.kvm2.hosts[1].name = "h1".into(),
                "kvm2.hosts[1].name",
                "duplicate of kvm2.hosts[0].name",
            ),
            (
                "no images",
                |c| {
                    c.kvm2.images.clear();
                    c.kvm2.defaults = None;
                },
                "kvm2.images",
                "at least one image",
            ),
            (
                "image name",
                |c| {
                    c.kvm2.images[0].name = "deb ian".into();
                    c.kvm2.defaults = None;
                },
                "kvm2.images[0].name",
                "DNS-1123",
            ),
            (
                "image http",
                |c| c.kvm2.images[0].url = "http://images.example.org/a".into(),
                "kvm2.images[0].url",
                "allowHttp",
            ),
            (
                "image userinfo",
                |c| c.kvm2.images[0].url = "https://u:p@images.example.org/a".into(),
                "kvm2.images[0].url",
                "credentials",
            ),
            (
                "image fragment",
                |c| c.kvm2.images[0].url = "https://images.example.org/a#x".into(),
                "kvm2.images[0].url",
                "fragment",
            ),
            (
                "image sha",
                |c| c.kvm2.images[0].sha256 = "abc".into(),
                "kvm2.images[0].sha256",
                "64 hex digits",
            ),
            (
                "image cap",
                |c| c.kvm2.images[0].max_size_mib = Some(0),
                "kvm2.images[0].maxSizeMiB",
                "out of range",
            ),
            (
                "duplicate image",
                |c| {
                    let i = c.kvm2.images[0].clone();
                    c.kvm2.images.push(i);
                },
                "kvm2.images[1].name",
                "duplicate",
            ),
            (
                "no machine types",
                |c| {
                    c.kvm2.machine_types.clear();
                    c.kvm2.defaults = None;
                },
                "kvm2.machineTypes",
                "at least one",
            ),
            (
                "machine name",
                |c| {
                    c.kvm2.machine_types[0].name = "x.y".into();
                    c.kvm2.defaults = None;
                },
                "kvm2.machineTypes[0].name",
                "DNS-1123",
            ),
            (
                "vcpus",
                |c| c.kvm2.machine_types[0].vcpus = 0,
                "kvm2.machineTypes[0].vcpus",
                "vCPUs is out of range",
            ),
            (
                "memory",
                |c| c.kvm2.machine_types[0].memory_mib = 64,
                "kvm2.machineTypes[0].memoryMiB",
                "out of range",
            ),
            (
                "disk",
                |c| c.kvm2.machine_types[0].disk_gib = 1 << 20,
                "kvm2.machineTypes[0].diskGiB",
                "out of range",
            ),
            (
                "duplicate machine",
                |c| {
                    let m = c.kvm2.machine_types[0].clone();
                    c.kvm2.machine_types.push(m);
                },
                "kvm2.machineTypes[1].name",
                "duplicate",
            ),
            (
                "default machine",
                |c| {
                    c.kvm2.defaults = Some(DefaultsConfig {
                        machine_type: Some("huge".into()),
                        image: None,
                    })
                },
                "kvm2.defaults.machineType",
                "does not name an entry of kvm2.machineTypes",
            ),
            (
                "default image",
                |c| {
                    c.kvm2.defaults = Some(DefaultsConfig {
                        machine_type: None,
                        image: Some("arch".into()),
                    })
                },
                "kvm2.defaults.image",
                "does not name an entry of kvm2.images",
            ),
            (
                "template both",
                |c| c.kvm2.templates.domain.url = Some("https://x.example.org/d.wasm".into()),
                "kvm2.templates.domain",
                "not both",
            ),
            (
                "template neither",
                |c| c.kvm2.templates.domain.path = None,
                "kvm2.templates.domain",
                "exactly one",
            ),
            (
                "template path",
                |c| c.kvm2.templates.domain.path = Some("a\nb".into()),
                "kvm2.templates.domain.path",
                "control",
            ),
            (
                "template http",
                |c| c.kvm2.templates.vendor_data.url = Some("http://x.example.org/v.wasm".into()),
                "kvm2.templates.vendorData.url",
                "uses http",
            ),
            (
                "template url with a query",
                |c| {
                    c.kvm2.templates.vendor_data.url =
                        Some("https://x.example.org/v.wasm?X-Amz-Signature=s3cr3t".into())
                },
                "kvm2.templates.vendorData.url",
                "must not carry a query string",
            ),
            (
                "template url without sha",
                |c| c.kvm2.templates.vendor_data.sha256 = None,
                "kvm2.templates.vendorData.sha256",
                "required",
            ),
            (
                "oci without digest",
                |c| {
                    c.kvm2.templates.vendor_data.url =
                        Some("oci://r.example.org/plugins/v:1".into());
                },
                "kvm2.templates.vendorData.url",
                "needs the manifest digest",
            ),
            (
                "oci with credentials in the host",
                |c| {
                    c.kvm2.templates.vendor_data.url = Some(format!(
                        "oci://u:p@r.example.org/plugins/v:1@sha256:{}",
                        "a".repeat(64)
                    ));
                },
                "kvm2.templates.vendorData.url",
                "give them in `credentialsFile`",
            ),
            (
                "oci with a bad repository",
                |c| {
                    c.kvm2.templates.vendor_data.url = Some(format!(
                        "oci://r.example.org/Plugins@sha256:{}",
                        "a".repeat(64)
                    ));
                },
                "kvm2.templates.vendorData.url",
                "lower-case letters and digits",
            ),
            (
                "credentials without oci",
                |c| c.kvm2.templates.vendor_data.credentials_file = Some("/c.json".into()),
                "kvm2.templates.vendorData.credentialsFile",
                "only for an `oci://` url",
            ),
            (
                "oci credentials path",
                |c| {
                    c.kvm2.templates.vendor_data.url =
                        Some(format!("oci://r.example.org/v@sha256:{}", "a".repeat(64)));
                    c.kvm2.templates.vendor_data.credentials_file = Some("a\nb".into());
                },
                "kvm2.templates.vendorData.credentialsFile",
                "control",
            ),
            (
                "template sha",
                |c| c.kvm2.templates.domain.sha256 = Some("zz".into()),
                "kvm2.templates.domain.sha256",
                "64 hex digits",
            ),
            (
                "template settings",
                |c| c.kvm2.templates.domain.settings = serde_json::json!([1]),
                "kvm2.templates.domain.settings",
                "mapping",
            ),
            (
                "template settings size",
                |c| c.kvm2.templates.domain.settings = serde_json::json!({"x": "a".repeat(70_000)}),
                "kvm2.templates.domain.settings",
                "bytes serialised",
            ),
            (
                "overridable empty key",
                |c| c.kvm2.templates.vendor_data.overridable_settings = vec![String::new()],
                "kvm2.templates.vendorData.overridableSettings[0]",
                "is empty",
            ),
            (
                "overridable nested key",
                |c| {
                    c.kvm2.templates.domain.overridable_settings =
                        vec!["ok".into(), "efi.loader".into()]
                },
                "kvm2.templates.domain.overridableSettings[1]",
                "not a top-level settings key",
            ),
            (
                "overridable duplicate key",
                |c| {
                    c.kvm2.templates.vendor_data.overridable_settings = vec![
                        "listenPort".into(),
                        "maxClients".into(),
                        "listenPort".into(),
                    ]
                },
                "kvm2.templates.vendorData.overridableSettings[2]",
                "\"listenPort\" is a duplicate of kvm2.templates.vendorData.overridableSettings[0]",
            ),
            (
                "overridable long key",
                |c| c.kvm2.templates.vendor_data.overridable_settings = vec!["k".repeat(129)],
                "kvm2.templates.vendorData.overridableSettings[0]",
                "too long",
            ),
            (
                "overridable too many",
                |c| {
                    c.kvm2.templates.vendor_data.overridable_settings =
                        (0..65).map(|i| format!("k{i}")).collect()
                },
                "kvm2.templates.vendorData.overridableSettings",
                "at most 64",
            ),
            (
                "template timeout",
                |c| c.kvm2.templates.domain.timeout_millis = 0,
                "kvm2.templates.domain.timeoutMillis",
                "out of range",
            ),
            (
                "template memory",
                |c| c.kvm2.templates.vendor_data.max_memory_mib = 2048,
                "kvm2.templates.vendorData.maxMemoryMiB",
                "out of range",
            ),
            (
                "gc period",
                |c| c.gc.period_seconds = 1,
                "gc.periodSeconds",
                "out of range",
            ),
            (
                "gc grace",
                |c| c.gc.grace_period_seconds = 8 * 86_400,
                "gc.gracePeriodSeconds",
                "out of range",
            ),
            (
                "bridge mtu",
                |c| c.kvm2.hosts[0].bridge_mtu = Some(u32::MAX),
                "kvm2.hosts[0].bridgeMtu",
                "out of range",
            ),
            (
                "cpu placement cpus",
                |c| {
                    c.kvm2.hosts[0].cpu_placement = Some(CpuPlacementConfig {
                        cpus: "0-4294967295".into(),
                        nodes: None,
                    })
                },
                "kvm2.hosts[0].cpuPlacement.cpus",
                "libvirt's syntax",
            ),
            (
                "cpu placement nodes",
                |c| {
                    c.kvm2.hosts[0].cpu_placement = Some(CpuPlacementConfig {
                        cpus: "4-7".into(),
                        nodes: Some("^0".into()),
                    })
                },
                "kvm2.hosts[0].cpuPlacement.nodes",
                "libvirt's syntax",
            ),
            (
                "nvram template",
                |c| c.kvm2.hosts[0].nvram_templates = vec!["/usr/share/OVMF/../x".into()],
                "kvm2.hosts[0].nvramTemplates[0]",
                "absolute path",
            ),
            (
                "pool cidr",
                |c| c.kvm2.hosts[0].address_pool = Some(pool("10.9.0.1/24", ".10", ".20")),
                "kvm2.hosts[0].addressPool.cidr",
                "host bits set",
            ),
            (
                "bridge network with host bits",
                |c| c.kvm2.hosts[0].bridge_network = Some("10.9.0.1/24".into()),
                "kvm2.hosts[0].bridgeNetwork",
                "host bits set",
            ),
            (
                "bridge network too narrow",
                |c| c.kvm2.hosts[0].bridge_network = Some("10.9.0.0/31".into()),
                "kvm2.hosts[0].bridgeNetwork",
                "not a bridge network",
            ),
            (
                "bridge network beside a pool",
                |c| {
                    c.kvm2.hosts[0].address_pool = Some(pool("10.9.0.0/24", ".10", ".60"));
                    c.kvm2.hosts[0].bridge_network = Some("10.9.0.0/24".into());
                },
                "kvm2.hosts[0].bridgeNetwork",
                "is for DHCP hosts",
            ),
            (
                "pool cidr not v4",
                |c| c.kvm2.hosts[0].address_pool = Some(pool("fd00::/64", ".10", ".20")),
                "kvm2.hosts[0].addressPool.cidr",
                "not an IPv4 network",
            ),
            (
                "pool range outside",
                |c| c.kvm2.hosts[0].address_pool = Some(pool("10.9.0.0/24", ".10", "10.9.1.5")),
                "kvm2.hosts[0].addressPool.rangeEnd",
                "outside 10.9.0.0/24",
            ),
            (
                "pool range broadcast",
                |c| c.kvm2.hosts[0].address_pool = Some(pool("10.9.0.0/24", ".10", ".255")),
                "kvm2.hosts[0].addressPool.rangeEnd",
                "broadcast",
            ),
            (
                "pool range reversed",
                |c| c.kvm2.hosts[0].address_pool = Some(pool("10.9.0.0/24", ".30", ".20")),
                "kvm2.hosts[0].addressPool.rangeEnd",
                "below rangeStart",
            ),
            (
                "pool gateway in range",
                |c| {
                    let mut p = pool("10.9.0.0/24", ".10", ".60");
                    p.gateway = Some("10.9.0.15".into());
                    c.kvm2.hosts[0].address_pool = Some(p);
                },
                "kvm2.hosts[0].addressPool.gateway",
                "inside the range",
            ),
            (
                "pool dns",
                |c| {
                    let mut p = pool("10.9.0.0/24", ".10", ".60");
                    p.dns = vec!["ns1".into()];
                    c.kvm2.hosts[0].address_pool = Some(p);
                },
                "kvm2.hosts[0].addressPool.dns",
                "not an IPv4 address",
            ),
            (
                "pool dns in range",
                |c| {
                    let mut p = pool("10.9.0.0/24", ".10", ".60");
                    p.dns = vec!["10.9.0.53".into()];
                    c.kvm2.hosts[0].address_pool = Some(p);
                },
                "kvm2.hosts[0].addressPool.dns",
                "inside the range",
            ),
            (
                "pool of every address",
                |c| {
                    c.kvm2.hosts[0].address_pool =
                        Some(pool("0.0.0.0/0", "10.9.0.10", "10.9.0.60"));
                },
                "kvm2.hosts[0].addressPool.cidr",
                "not a bridge network",
            ),
            (
                "pool smaller than maxDomains",
                |c| c.kvm2.hosts[0].address_pool = Some(pool("10.9.0.0/24", ".10", ".12")),
                "kvm2.hosts[0].addressPool.rangeEnd",
                "fewer than maxDomains",
            ),
            (
                "serving target without port",
                |c| c.serving.target = Some("probe.example".into()),
                "serving.target",
                "explicit port",
            ),
            (
                "serving timeout",
                |c| c.serving.timeout_seconds = 30,
                "serving.timeoutSeconds",
                "shorter than serving.periodSeconds",
            ),
            (
                "serving concurrency",
                |c| c.serving.concurrency = 0,
                "serving.concurrency",
                "out of range",
            ),
            (
                "health period",
                |c| c.health_check.period_seconds = 4_000,
                "healthCheck.periodSeconds",
                "out of range",
            ),
            (
                "health timeout",
                |c| c.health_check.timeout_seconds = 0,
                "healthCheck.timeoutSeconds",
                "out of range",
            ),
            (
                "health overlap",
                |c| {
                    c.health_check.period_seconds = 10;
                    c.health_check.timeout_seconds = 10;
                },
                "healthCheck.timeoutSeconds",
                "shorter than",
            ),
        ];
        for (name, edit, path, want) in cases {
            refused(name, edit, path, want);
        }
    }

    #[test]
    fn passing_variants_of_each_rule() {
        type Edit = fn(&mut ProvidersConfig);
        let cases: &[(&str, Edit)] = &[
            ("http allowed explicitly", |c| {
                c.kvm2.images[0].url = "http://127.0.0.1:8080/a.qcow2".into();
                c.kvm2.images[0].allow_http = true;
            }),
            ("ipv6 address", |c| {
                c.kvm2.hosts[0].address = "[fd00::1]:22".into()
            }),
            ("upper-case sha", |c| {
                c.kvm2.images[0].sha256 = "AB".repeat(32)
            }),
            ("pool with underscore", |c| {
                c.kvm2.hosts[0].storage_pool = "vm_pool".into()
            }),
            ("bios and efi", |c| {
                c.kvm2.machine_types[0].firmware = Firmware::Efi
            }),
            ("local plugin with sha", |c| {
                c.kvm2.templates.domain.sha256 = Some("a".repeat(64))
            }),
            ("no defaults", |c| c.kvm2.defaults = None),
            ("zero grace", |c| c.gc.grace_period_seconds = 0),
            ("raw image", |c| c.kvm2.images[0].format = ImageFormat::Raw),
            ("overridable keys", |c| {
                c.kvm2.templates.vendor_data.overridable_settings =
                    vec!["listenPort".into(), "max_clients".into(), "_x-1".into()];
                c.kvm2.templates.domain.overridable_settings =
                    (0..64).map(|i| format!("k{i}")).collect();
            }),
        ];
        for (name, edit) in cases {
            assert_eq!(problems_of(edit), Vec::<String>::new(), "{name}");
        }
    }

    #[test]
    fn overridable_settings_is_read_from_yaml_and_defaults_to_empty() {
        assert!(base().kvm2.templates.domain.overridable_settings.is_empty());
        let yaml = VALID.replace(
            "domain: {path: /p/domain.wasm}",
            "domain: {path: /p/domain.wasm, overridableSettings: [cpuModel, extraDevices]}",
        );
        assert_ne!(yaml, VALID);
        let c: ProvidersConfig = serde_yaml_ng::from_str(&yaml).unwrap();
        assert_eq!(
            c.kvm2.templates.domain.overridable_settings,
            ["cpuModel", "extraDevices"]
        );
        assert!(validate(&c).is_empty());
        // Written back under the same name, and left out when empty.
        let back = serde_json::to_value(&c.kvm2.templates).unwrap();
        assert_eq!(
            back["domain"]["overridableSettings"],
            serde_json::json!(["cpuModel", "extraDevices"])
        );
        assert!(back["vendorData"].get("overridableSettings").is_none());
        // The snake_case spelling is an unknown field.
        let wrong = VALID.replace(
            "domain: {path: /p/domain.wasm}",
            "domain: {path: /p/domain.wasm, overridable_settings: [cpuModel]}",
        );
        assert!(serde_yaml_ng::from_str::<ProvidersConfig>(&wrong).is_err());
    }

    #[test]
    fn settings_key_rule() {
        for ok in ["a", "listenPort", "_x", "max-clients", "k9"] {
            assert_eq!(settings_key(ok), Ok(()), "{ok}");
        }
        for bad in ["", "9a", "-a", "a.b", "a/b", "a b", "é", "a\n"] {
            assert!(settings_key(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn collects_every_problem_not_just_the_first() {
        let got = problems_of(|c| {
            c.cluster_id = Some("X".into());
            c.kvm2.hosts[0].bridge = "br 0".into();
            c.kvm2.hosts[1].bridge = "<b>".into();
            c.kvm2.images[0].sha256 = "nope".into();
            c.kvm2.machine_types[0].vcpus = 0;
        });
        let paths: Vec<&str> = got
            .iter()
            .map(|p| p.split(": ").next().unwrap_or(""))
            .collect();
        assert_eq!(
            paths,
            [
                "clusterId",
                "kvm2.hosts[0].bridge",
                "kvm2.hosts[1].bridge",
                "kvm2.images[0].sha256",
                "kvm2.machineTypes[0].vcpus"
            ]
        );
        assert_eq!(
            got[1],
            "kvm2.hosts[0].bridge: \"br 0\" is not a valid interface name: use letters, digits, '_', '.' and '-'"
        );
    }

    /// Hostile values in every field that becomes a name, path or XML attribute are refused
    /// by validation, so nothing downstream ever sees them.
    #[test]
    fn hostile_values_are_refused_everywhere() {
        let hostile = [
            "<domain type='kvm'>".to_string(),
            "a&amp;b".into(),
            "x\"onload=\"y".into(),
            "../../etc/passwd".into(),
            "a\0b".into(),
            "a\nb".into(),
            "x".repeat(10 * 1024),
        ];
        type Set = fn(&mut ProvidersConfig, String);
        let fields: &[(&str, Set)] = &[
            ("clusterId", |c, v| c.cluster_id = Some(v)),
            ("kvm2.ssh.user", |c, v| c.kvm2.ssh.user = v),
            ("kvm2.hosts[0].name", |c, v| c.kvm2.hosts[0].name = v),
            ("kvm2.hosts[0].address", |c, v| c.kvm2.hosts[0].address = v),
            ("kvm2.hosts[0].libvirtSocket", |c, v| {
                c.kvm2.hosts[0].libvirt_socket = v
            }),
            ("kvm2.hosts[0].storagePool", |c, v| {
                c.kvm2.hosts[0].storage_pool = v
            }),
            ("kvm2.hosts[0].bridge", |c, v| c.kvm2.hosts[0].bridge = v),
            ("kvm2.images[0].name", |c, v| {
                c.kvm2.images[0].name = v;
                c.kvm2.defaults = None;
            }),
            ("kvm2.images[0].url", |c, v| {
                c.kvm2.images[0].url = format!("https://e.org/{v}#")
            }),
            ("kvm2.images[0].sha256", |c, v| c.kvm2.images[0].sha256 = v),
            (
                "kvm2.templates.vendorData.overridableSettings[0]",
                |c, v| c.kvm2.templates.vendor_data.overridable_settings = vec![v],
            ),
            ("kvm2.machineTypes[0].name", |c, v| {
                c.kvm2.machine_types[0].name = v;
                c.kvm2.defaults = None;
            }),
        ];
        for (path, set) in fields {
            for value in &hostile {
                let got = problems_of(|c| set(c, value.clone()));
                assert!(
                    got.iter().any(|p| p.starts_with(&format!("{path}: "))),
                    "{path} accepted {value:?}: {got:?}"
                );
                for p in &got {
                    assert!(
                        !p.contains('\n') && !p.contains('\0'),
                        "raw control char in {p:?}"
                    );
                    assert!(p.len() < 400, "message too long: {} bytes", p.len());
                }
            }
        }
    }
}
