//! The providers config as typed serde structs.
//!
//! Field names are camelCase so the YAML reads like a Kubernetes object. Every struct
//! refuses unknown fields, so a typo (`bridg:`) is an error with its path rather than a
//! silently ignored setting. Ranges and patterns repeated here as schemars attributes only
//! help editors; the authority is [`super::validate`], which the loader always runs.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::validate::{SETTINGS_KEY_PATTERN, limits};
use crate::validation::{
    DNS1123_LABEL_MAX, DNS1123_LABEL_PATTERN, FILE_PATH_MAX, INTERFACE_NAME_PATTERN,
    LIBVIRT_OBJECT_NAME_PATTERN, SHA256_PATTERN, SOCKET_PATH_PATTERN, UNIX_SOCKET_PATH_MAX,
    URL_MAX, USER_NAME_PATTERN,
};

/// Default libvirt socket on a host (Debian, Fedora and RHEL all use this path).
pub const DEFAULT_LIBVIRT_SOCKET: &str = "/var/run/libvirt/libvirt-sock";
/// Default SSH port.
pub const DEFAULT_SSH_PORT: u16 = 22;

/// The operator's providers config, mounted from a ConfigMap.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[schemars(title = "egress-operator providers config")]
pub struct ProvidersConfig {
    /// Names this operator's cluster in the mark it writes into every domain it owns (a
    /// DNS-1123 label). Optional: when unset, the operator derives it from the
    /// `kube-system` namespace's UID (`k8s-` and 12 hex digits), which is what a config
    /// shipped to many clusters should do. Either way the mark also records that UID, so
    /// two clusters that share a host and a `clusterId` never collect each other's VMs.
    /// The CLI, which runs outside a cluster, needs it set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = DNS1123_LABEL_MAX), pattern(DNS1123_LABEL_PATTERN))]
    pub cluster_id: Option<String>,
    /// The KVM/libvirt-over-SSH provider.
    pub kvm2: Kvm2Config,
    /// Garbage collection of orphaned domains.
    #[serde(default)]
    pub gc: GcConfig,
    /// Periodic provider health checks.
    #[serde(default)]
    pub health_check: HealthCheckConfig,
    /// The proxy probe behind each Proxy's `Serving` condition (and so its `Ready`).
    #[serde(default)]
    pub serving: ServingConfig,
}

/// How the operator checks that a proxy VM actually proxies. `Ready` requires the last
/// probe to have passed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ServingConfig {
    /// The proxy's TCP port on the guest: must match the vendor-data plugin's listen port
    /// (the default plugin's `listenPort`, 3128).
    #[serde(default = "defaults::serving_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: u16,
    /// `host:port` the probe asks the proxy to CONNECT to; a 2xx answer passes. When
    /// unset, any well-formed HTTP answer from the proxy to a CONNECT passes (it proves a
    /// proxy listens, not that it reaches anything).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 3, max = 261))]
    pub target: Option<String>,
    /// Budget of one probe (connect, request and answer).
    #[serde(default = "defaults::serving_timeout_seconds")]
    #[schemars(range(min = limits::SERVING_TIMEOUT_SECONDS.0, max = limits::SERVING_TIMEOUT_SECONDS.1))]
    pub timeout_seconds: u32,
    /// How often a serving proxy is probed again.
    #[serde(default = "defaults::serving_period_seconds")]
    #[schemars(range(min = limits::SERVING_PERIOD_SECONDS.0, max = limits::SERVING_PERIOD_SECONDS.1))]
    pub period_seconds: u32,
    /// Most probes in flight across all Proxies.
    #[serde(default = "defaults::serving_concurrency")]
    #[schemars(range(min = limits::SERVING_CONCURRENCY.0, max = limits::SERVING_CONCURRENCY.1))]
    pub concurrency: u32,
    /// A proxy that has not served for this long (since its instance started, or since it
    /// last served) is replaced; 0 never replaces, it only stays not `Ready`. Shorter
    /// failures (a flap, a slow first boot) never replace the VM.
    #[serde(default = "defaults::serving_replace_after_seconds")]
    #[schemars(range(min = limits::SERVING_REPLACE_AFTER_SECONDS.0, max = limits::SERVING_REPLACE_AFTER_SECONDS.1))]
    pub replace_after_seconds: u32,
}

impl Default for ServingConfig {
    fn default() -> Self {
        Self {
            port: defaults::serving_port(),
            target: None,
            timeout_seconds: defaults::serving_timeout_seconds(),
            period_seconds: defaults::serving_period_seconds(),
            concurrency: defaults::serving_concurrency(),
            replace_after_seconds: defaults::serving_replace_after_seconds(),
        }
    }
}

/// The kvm2 provider: libvirt hosts reached over SSH.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Kvm2Config {
    /// How to log in to every host.
    pub ssh: SshConfig,
    /// The libvirt hosts proxies may run on.
    pub hosts: Vec<HostConfig>,
    /// Base images, cached per host in its storage pool.
    pub images: Vec<ImageConfig>,
    /// Machine types a Proxy may ask for.
    pub machine_types: Vec<MachineTypeConfig>,
    /// What a Proxy gets when it names no machine type or image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub defaults: Option<DefaultsConfig>,
    /// Template plugins that render the domain XML and the cloud-init vendor-data.
    pub templates: TemplatesConfig,
}

/// SSH login shared by all hosts. The key and known_hosts come from a mounted Secret.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SshConfig {
    /// Remote user; it needs access to the libvirt socket (e.g. member of `libvirt`).
    #[schemars(pattern(USER_NAME_PATTERN))]
    pub user: String,
    /// Private key file (OpenSSH format). Relative paths are resolved against the
    /// directory of the config file.
    #[schemars(length(min = 1, max = FILE_PATH_MAX))]
    pub private_key_file: String,
    /// known_hosts file every host key is verified against. Relative paths are resolved
    /// against the directory of the config file.
    #[schemars(length(min = 1, max = FILE_PATH_MAX))]
    pub known_hosts_file: String,
    /// How long a TCP connect plus SSH handshake may take. When the host name resolves
    /// to several addresses, each gets an equal share (at least one second), so a
    /// black-holed address does not use up the whole budget.
    #[serde(default = "defaults::connect_timeout_seconds")]
    #[schemars(range(min = limits::CONNECT_TIMEOUT_SECONDS.0, max = limits::CONNECT_TIMEOUT_SECONDS.1))]
    pub connect_timeout_seconds: u32,
    /// Interval between SSH keepalives. A dead or half-open link (also one with data in
    /// flight) is noticed within `keepaliveIntervalSeconds × (keepaliveMaxMissed + 1)`,
    /// which is also the link's TCP_USER_TIMEOUT; a write blocked on a peer that never
    /// reads is cut one interval later (the SSH inactivity timeout).
    #[serde(default = "defaults::keepalive_interval_seconds")]
    #[schemars(range(min = limits::KEEPALIVE_INTERVAL_SECONDS.0, max = limits::KEEPALIVE_INTERVAL_SECONDS.1))]
    pub keepalive_interval_seconds: u32,
    /// Unanswered keepalives after which the link is declared dead.
    #[serde(default = "defaults::keepalive_max_missed")]
    #[schemars(range(min = limits::KEEPALIVE_MAX_MISSED.0, max = limits::KEEPALIVE_MAX_MISSED.1))]
    pub keepalive_max_missed: u32,
}

/// Which libvirt driver to talk to behind the socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum LibvirtDriver {
    /// QEMU/KVM: real VMs.
    #[default]
    Qemu,
    /// libvirt's in-memory test driver: for tests and dry runs only.
    Test,
}

/// One libvirt host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HostConfig {
    /// Host name used in placement, status and metrics. A DNS-1123 label.
    #[schemars(length(min = 1, max = DNS1123_LABEL_MAX), pattern(DNS1123_LABEL_PATTERN))]
    pub name: String,
    /// SSH address, `host:port` (`[v6]:port` for IPv6); the port defaults to 22.
    pub address: String,
    /// Path of libvirtd's unix socket on the host.
    #[serde(default = "defaults::libvirt_socket")]
    #[schemars(length(min = 1, max = UNIX_SOCKET_PATH_MAX), pattern(SOCKET_PATH_PATTERN))]
    pub libvirt_socket: String,
    /// libvirt driver behind the socket.
    #[serde(default)]
    pub driver: LibvirtDriver,
    /// Storage pool holding base images, overlays and seed ISOs.
    #[schemars(pattern(LIBVIRT_OBJECT_NAME_PATTERN))]
    pub storage_pool: String,
    /// Existing bridge the proxy NICs attach to.
    #[schemars(pattern(INTERFACE_NAME_PATTERN))]
    pub bridge: String,
    /// Most proxy domains this host may carry.
    #[serde(default = "defaults::max_domains")]
    #[schemars(range(min = limits::MAX_DOMAINS.0, max = limits::MAX_DOMAINS.1))]
    pub max_domains: u32,
    /// Most Creates running at once on this host (image uploads are heavy).
    #[serde(default = "defaults::max_concurrent_creates")]
    #[schemars(range(min = limits::MAX_CONCURRENT_CREATES.0, max = limits::MAX_CONCURRENT_CREATES.1))]
    pub max_concurrent_creates: u32,
    /// Skip host-key verification for this host. Unsafe: every dial logs a warning.
    #[serde(default)]
    pub insecure_ignore_host_key: bool,
    /// Render domains for QEMU software emulation even where libvirt reports KVM: for
    /// nested hosts whose KVM is present but unusable, and for test hosts.
    #[serde(default)]
    pub disable_kvm: bool,
    /// Static addressing: when set, the operator allocates each proxy's address from this
    /// pool, writes it into the seed's cloud-init network-config and publishes it without
    /// asking the guest. When unset, guests use DHCP and the address is detected (lease,
    /// guest agent, ARP). Hosts whose bridges share one network need disjoint ranges.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address_pool: Option<AddressPoolConfig>,
    /// The IPv4 network a DHCP server outside libvirt serves on `bridge` (no
    /// `addressPool`): only guest addresses inside it are published. Unset, the network
    /// of the libvirt network that owns the bridge is used, and with none every address
    /// the guest reports is kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 9, max = 18))]
    pub bridge_network: Option<String>,
    /// MTU of `bridge` as the host has it. A domain plugin's NIC `<mtu>` must equal it;
    /// unset, no NIC may set an MTU (libvirt applies it to the tap before enslaving it,
    /// which would change the bridge's MTU for every VM on it and the host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 68, max = 65535))]
    pub bridge_mtu: Option<u32>,
    /// Host CPUs (and NUMA nodes) the operator owns for proxy VMs. Unset, a domain
    /// plugin may not pin vCPUs, the emulator or memory at all; set, every `cpuset` and
    /// `nodeset` it writes must lie inside these sets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_placement: Option<CpuPlacementConfig>,
    /// UEFI variable-store templates a domain plugin may name beyond the stock list
    /// (which excludes test keys such as Debian's snakeoil): a site's own enrolled keys.
    /// Absolute paths on the host.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub nvram_templates: Vec<String>,
}

/// Host CPU and NUMA placement a host lets domain plugins choose.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CpuPlacementConfig {
    /// Host CPUs in libvirt's syntax (`4-15,^8`): keep housekeeping CPUs and other
    /// tenants' CPUs out of it.
    #[schemars(length(min = 1, max = 256), pattern(r"^[0-9,^-]+$"))]
    pub cpus: String,
    /// NUMA nodes for `<numatune>`; unset refuses memory binding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256), pattern(r"^[0-9,^-]+$"))]
    pub nodes: Option<String>,
}

/// An IPv4 address pool on a host's bridge network.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AddressPoolConfig {
    /// The bridge network in CIDR notation, e.g. `10.203.0.0/24`; the guest gets this
    /// prefix length.
    #[schemars(length(min = 9, max = 18))]
    pub cidr: String,
    /// Default gateway handed to guests; none gives the guest no default route.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 7, max = 15))]
    pub gateway: Option<String>,
    /// DNS servers handed to guests.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 3))]
    pub dns: Vec<String>,
    /// First address the operator may hand out (inclusive), inside `cidr`.
    #[schemars(length(min = 7, max = 15))]
    pub range_start: String,
    /// Last address the operator may hand out (inclusive), inside `cidr`.
    #[schemars(length(min = 7, max = 15))]
    pub range_end: String,
}

/// An [`AddressPoolConfig`] parsed and checked: what the allocator works with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressPool {
    /// The bridge network.
    pub net: ipnet::Ipv4Net,
    /// Default gateway, inside `net`, outside the range.
    pub gateway: Option<std::net::Ipv4Addr>,
    /// DNS servers.
    pub dns: Vec<std::net::Ipv4Addr>,
    /// First address to hand out (inclusive).
    pub first: std::net::Ipv4Addr,
    /// Last address to hand out (inclusive).
    pub last: std::net::Ipv4Addr,
}

impl AddressPool {
    /// Whether `addr` is one the pool hands out.
    pub fn contains(&self, addr: std::net::Ipv4Addr) -> bool {
        self.first <= addr && addr <= self.last
    }

    /// Number of addresses in the range.
    pub fn size(&self) -> u32 {
        u32::from(self.last) - u32::from(self.first) + 1
    }
}

/// Parses a host's `bridgeNetwork`: an IPv4 network in CIDR notation without host
/// bits, neither `/0` nor a point-to-point /31 or /32.
pub fn bridge_network(text: &str) -> Result<ipnet::Ipv4Net, String> {
    let net: ipnet::Ipv4Net = text
        .parse()
        .map_err(|_| format!("{text:?} is not an IPv4 network in CIDR notation (a.b.c.d/len)"))?;
    if net.network() != net.addr() {
        return Err(format!(
            "{text:?} has host bits set; the network is {}",
            net.trunc()
        ));
    }
    if !(1..=30).contains(&net.prefix_len()) {
        return Err(format!(
            "{text:?} is not a bridge network (prefix /1 to /30)"
        ));
    }
    Ok(net)
}

impl AddressPoolConfig {
    /// Parses and checks the pool. Errors name the field (camelCase, relative to the
    /// pool) and why; config validation prefixes the host's path.
    pub fn parse(&self) -> Result<AddressPool, (&'static str, String)> {
        use std::net::Ipv4Addr;
        let net: ipnet::Ipv4Net = self.cidr.parse().map_err(|_| {
            (
                "cidr",
                format!(
                    "{:?} is not an IPv4 network in CIDR notation (a.b.c.d/len)",
                    self.cidr
                ),
            )
        })?;
        if net.network() != net.addr() {
            return Err((
                "cidr",
                format!(
                    "{:?} has host bits set; the network is {}",
                    self.cidr,
                    net.trunc()
                ),
            ));
        }
        if net.prefix_len() == 0 {
            // The seed's network-config refuses it too, but only after the image download.
            return Err((
                "cidr",
                format!(
                    "{:?} is every IPv4 address, not a bridge network",
                    self.cidr
                ),
            ));
        }
        if net.prefix_len() > 30 {
            return Err((
                "cidr",
                format!(
                    "/{} leaves no room for guests (at most /30)",
                    net.prefix_len()
                ),
            ));
        }
        // Network and broadcast addresses are never handed out or used as gateway.
        let usable = |field: &'static str, s: &str| -> Result<Ipv4Addr, (&'static str, String)> {
            let a: Ipv4Addr = s
                .parse()
                .map_err(|_| (field, format!("{s:?} is not an IPv4 address")))?;
            if !net.contains(&a) {
                return Err((field, format!("{a} is outside {net}")));
            }
            if a == net.network() || a == net.broadcast() {
                return Err((
                    field,
                    format!("{a} is the network or broadcast address of {net}"),
                ));
            }
            Ok(a)
        };
        let first = usable("rangeStart", &self.range_start)?;
        let last = usable("rangeEnd", &self.range_end)?;
        if first > last {
            return Err(("rangeEnd", format!("{last} is below rangeStart {first}")));
        }
        let gateway = match &self.gateway {
            Some(g) => {
                let g = usable("gateway", g)?;
                if first <= g && g <= last {
                    return Err(("gateway", format!("{g} is inside the range {first}-{last}")));
                }
                Some(g)
            }
            None => None,
        };
        let mut dns = Vec::with_capacity(self.dns.len());
        for d in &self.dns {
            let a: Ipv4Addr = d
                .parse()
                .map_err(|_| ("dns", format!("{d:?} is not an IPv4 address")))?;
            if a.is_unspecified() || a.is_broadcast() || a.is_multicast() {
                return Err(("dns", format!("{a} cannot be a DNS server")));
            }
            if first <= a && a <= last {
                // It would be handed out to a guest, which then answers (or not) its DNS.
                return Err(("dns", format!("{a} is inside the range {first}-{last}")));
            }
            dns.push(a);
        }
        Ok(AddressPool {
            net,
            gateway,
            dns,
            first,
            last,
        })
    }
}

/// Disk image format of a base image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ImageFormat {
    /// QEMU copy-on-write v2.
    Qcow2,
    /// Raw disk image.
    Raw,
}

/// A base image, downloaded once per host and verified by its sha256.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ImageConfig {
    /// Image name a Proxy refers to. A DNS-1123 label.
    #[schemars(length(min = 1, max = DNS1123_LABEL_MAX), pattern(DNS1123_LABEL_PATTERN))]
    pub name: String,
    /// Where to download it: https, or http where `allowHttp` is set.
    #[schemars(length(min = 1, max = URL_MAX), pattern("^https?://"))]
    pub url: String,
    /// Expected sha256 of the image file, 64 hex digits.
    #[schemars(pattern(SHA256_PATTERN))]
    pub sha256: String,
    /// Format of the file at `url`.
    pub format: ImageFormat,
    /// Refuse downloads larger than this many MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "maxSizeMiB")]
    #[schemars(range(min = limits::IMAGE_MAX_SIZE_MIB.0, max = limits::IMAGE_MAX_SIZE_MIB.1))]
    pub max_size_mib: Option<u64>,
    /// Accept a plain-http URL (the sha256 still protects the content).
    #[serde(default)]
    pub allow_http: bool,
    /// Accept URLs that resolve to loopback, link-local, private or metadata addresses.
    #[serde(default)]
    pub allow_private_addresses: bool,
}

/// Guest firmware.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Firmware {
    /// Legacy BIOS (SeaBIOS).
    #[default]
    Bios,
    /// UEFI (OVMF): the domain plugin writes a `<loader>` and `<nvram template>` from the
    /// firmware lists of the plugin rules page (templates-sdk/src/rules.md#firmware), or
    /// `<os firmware="efi">` and libvirt picks the firmware.
    Efi,
}

/// A machine type: the size of a proxy VM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachineTypeConfig {
    /// Machine type name a Proxy refers to. A DNS-1123 label.
    #[schemars(length(min = 1, max = DNS1123_LABEL_MAX), pattern(DNS1123_LABEL_PATTERN))]
    pub name: String,
    /// Virtual CPUs.
    #[schemars(range(min = limits::VCPUS.0, max = limits::VCPUS.1))]
    pub vcpus: u32,
    /// Memory in MiB.
    #[serde(rename = "memoryMiB")]
    #[schemars(range(min = limits::MEMORY_MIB.0, max = limits::MEMORY_MIB.1))]
    pub memory_mib: u64,
    /// Size of the root disk (the overlay over the base image) in GiB.
    #[serde(rename = "diskGiB")]
    #[schemars(range(min = limits::DISK_GIB.0, max = limits::DISK_GIB.1))]
    pub disk_gib: u64,
    /// Guest firmware.
    #[serde(default)]
    pub firmware: Firmware,
}

/// Defaults for a Proxy that leaves a field out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DefaultsConfig {
    /// Machine type name; must be one of `machineTypes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine_type: Option<String>,
    /// Image name; must be one of `images`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
}

/// The two template plugins.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TemplatesConfig {
    /// Renders the libvirt domain XML.
    pub domain: TemplateConfig,
    /// Renders the cloud-init vendor-data.
    pub vendor_data: TemplateConfig,
}

/// One template plugin: where it comes from, its settings and its limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TemplateConfig {
    /// Local component file (e.g. mounted from a volume). Relative paths are resolved
    /// against the directory of the config file. Exactly one of `path` and `url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = FILE_PATH_MAX))]
    pub path: Option<String>,
    /// Where to download the component: an `https://` URL (needs `sha256`), or an OCI
    /// artifact `oci://REGISTRY/REPOSITORY[:TAG]@sha256:<manifest digest>` as
    /// `egress-operator plugin push` publishes it (the digest is mandatory and pins the
    /// manifest, which pins the wasm layer). Exactly one of `path` and `url`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = URL_MAX), pattern("^(https|oci)://"))]
    pub url: Option<String>,
    /// sha256 of the component (the wasm bytes); mandatory with an `https://` URL,
    /// checked before compiling. With `path` or an `oci://` URL it is optional and, when
    /// given, checked too (for OCI: against the wasm layer the manifest names).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(SHA256_PATTERN))]
    pub sha256: Option<String>,
    /// Registry credentials for an `oci://` URL: a Docker config JSON file (the
    /// `.dockerconfigjson` key of a `kubernetes.io/dockerconfigjson` Secret, mounted as a
    /// file), whose `auths` entry for the registry gives a username and password (HTTP
    /// basic auth, or the registry's token flow). Read at every load attempt, so a
    /// rotated Secret is picked up on the next retry. Without it the pull is anonymous.
    /// Relative paths are resolved against the directory of the config file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = FILE_PATH_MAX))]
    pub credentials_file: Option<String>,
    /// Plugin-specific settings, validated against the JSON Schema the plugin exports.
    #[serde(default = "defaults::settings")]
    #[schemars(extend("default" = {}))]
    pub settings: serde_json::Value,
    /// Top-level keys of `settings` that a Proxy may override for itself in
    /// `spec.templateSettings` (each override replaces that key's value; the merged
    /// settings are checked against the plugin's schema before every such render). Empty:
    /// no Proxy may override anything.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = limits::OVERRIDABLE_SETTINGS_MAX),
        inner(length(min = 1, max = limits::SETTINGS_KEY_MAX), pattern(SETTINGS_KEY_PATTERN)),
        extend("uniqueItems" = true)
    )]
    pub overridable_settings: Vec<String>,
    /// Wall-clock budget of one render.
    #[serde(default = "defaults::template_timeout_millis")]
    #[schemars(range(min = limits::TEMPLATE_TIMEOUT_MILLIS.0, max = limits::TEMPLATE_TIMEOUT_MILLIS.1))]
    pub timeout_millis: u32,
    /// Linear memory cap of one render.
    #[serde(default = "defaults::template_max_memory_mib", rename = "maxMemoryMiB")]
    #[schemars(range(min = limits::TEMPLATE_MAX_MEMORY_MIB.0, max = limits::TEMPLATE_MAX_MEMORY_MIB.1))]
    pub max_memory_mib: u32,
}

/// Garbage collection of domains we own that no Proxy owns any more.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GcConfig {
    /// How often to sweep all hosts.
    #[serde(default = "defaults::gc_period_seconds")]
    #[schemars(range(min = limits::GC_PERIOD_SECONDS.0, max = limits::GC_PERIOD_SECONDS.1))]
    pub period_seconds: u32,
    /// A domain younger than this is never collected, so a Create in flight is safe.
    #[serde(default = "defaults::gc_grace_period_seconds")]
    #[schemars(range(min = limits::GC_GRACE_PERIOD_SECONDS.0, max = limits::GC_GRACE_PERIOD_SECONDS.1))]
    pub grace_period_seconds: u32,
    /// What happens to the cached base images of images no longer in `kvm2.images`.
    #[serde(default)]
    pub retired_images: RetiredImagesPolicy,
}

impl Default for GcConfig {
    fn default() -> Self {
        Self {
            period_seconds: defaults::gc_period_seconds(),
            grace_period_seconds: defaults::gc_grace_period_seconds(),
            retired_images: RetiredImagesPolicy::default(),
        }
    }
}

/// Collection of base images whose image was removed from the config. Per host, the
/// retired images no volume uses any more are ordered by when the collector first saw
/// them unused, most recent first: the first `keepUnused` are kept whatever their age
/// (switching back to the previous image needs no download); every other one is deleted
/// once it has been unused for `unusedForSeconds` (and at least the grace period). Images
/// still in the config, and retired images an overlay still uses, are never collected.
/// "Unused for" is as seen by the running operator: a restart starts counting again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RetiredImagesPolicy {
    /// How many unused retired images to keep per host regardless of age.
    #[serde(default = "defaults::retired_images_keep_unused")]
    #[schemars(range(min = limits::RETIRED_IMAGES_KEEP_UNUSED.0, max = limits::RETIRED_IMAGES_KEEP_UNUSED.1))]
    pub keep_unused: u32,
    /// How long a retired image beyond those must have been unused before it is deleted.
    #[serde(default = "defaults::retired_images_unused_for_seconds")]
    #[schemars(range(min = limits::RETIRED_IMAGES_UNUSED_FOR_SECONDS.0, max = limits::RETIRED_IMAGES_UNUSED_FOR_SECONDS.1))]
    pub unused_for_seconds: u32,
}

impl Default for RetiredImagesPolicy {
    fn default() -> Self {
        Self {
            keep_unused: defaults::retired_images_keep_unused(),
            unused_for_seconds: defaults::retired_images_unused_for_seconds(),
        }
    }
}

/// Provider health checks, written to each provider's `ProviderHealth`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HealthCheckConfig {
    /// How often to check every host.
    #[serde(default = "defaults::health_period_seconds")]
    #[schemars(range(min = limits::HEALTH_PERIOD_SECONDS.0, max = limits::HEALTH_PERIOD_SECONDS.1))]
    pub period_seconds: u32,
    /// Budget of one host's check; must be shorter than the period.
    #[serde(default = "defaults::health_timeout_seconds")]
    #[schemars(range(min = limits::HEALTH_TIMEOUT_SECONDS.0, max = limits::HEALTH_TIMEOUT_SECONDS.1))]
    pub timeout_seconds: u32,
}

impl Default for HealthCheckConfig {
    fn default() -> Self {
        Self {
            period_seconds: defaults::health_period_seconds(),
            timeout_seconds: defaults::health_timeout_seconds(),
        }
    }
}

/// Default values, as functions because serde's `default = "..."` needs a path.
pub mod defaults {
    /// Long enough for a TLS-less SSH handshake over a slow WAN link.
    pub fn connect_timeout_seconds() -> u32 {
        10
    }
    /// OpenSSH's ServerAliveInterval in common production configs.
    pub fn keepalive_interval_seconds() -> u32 {
        15
    }
    /// Three misses: a dead link is noticed within 60 s (15 s × (3 + 1)) by default.
    pub fn keepalive_max_missed() -> u32 {
        3
    }
    /// libvirt's default socket path.
    pub fn libvirt_socket() -> String {
        super::DEFAULT_LIBVIRT_SOCKET.to_string()
    }
    /// A conservative per-host cap; sites raise it to fit their hardware.
    pub fn max_domains() -> u32 {
        32
    }
    /// Two Creates at once keep image uploads from saturating a host's disk.
    pub fn max_concurrent_creates() -> u32 {
        2
    }
    /// Settings default to an empty object; the plugin supplies its own defaults.
    pub fn settings() -> serde_json::Value {
        serde_json::Value::Object(serde_json::Map::new())
    }
    /// A render is pure computation over a few KB: a few hundred ms is generous.
    pub fn template_timeout_millis() -> u32 {
        250
    }
    /// Enough for any sane template, small enough that a memory bomb is cheap.
    pub fn template_max_memory_mib() -> u32 {
        64
    }
    /// Sweep every five minutes.
    pub fn gc_period_seconds() -> u32 {
        300
    }
    /// Ten minutes: longer than a slow Create including an image download.
    pub fn gc_grace_period_seconds() -> u32 {
        600
    }
    /// One unused retired image per host stays: a rollback needs no download.
    pub fn retired_images_keep_unused() -> u32 {
        1
    }
    /// A day unused before a retired image is deleted.
    pub fn retired_images_unused_for_seconds() -> u32 {
        86_400
    }
    /// The default vendor-data plugin's listen port.
    pub fn serving_port() -> u16 {
        3128
    }
    /// A proxy on the same network answers a CONNECT within milliseconds; 5 s allows a
    /// loaded guest under software emulation.
    pub fn serving_timeout_seconds() -> u32 {
        5
    }
    /// Probe serving proxies every 30 s: a dead proxy leaves `Ready` within a minute.
    pub fn serving_period_seconds() -> u32 {
        30
    }
    /// Enough to probe a large fleet within a period without a burst of sockets.
    pub fn serving_concurrency() -> u32 {
        32
    }
    /// Fifteen minutes: longer than a first boot under software emulation plus package
    /// installation, much longer than a proxy restart.
    pub fn serving_replace_after_seconds() -> u32 {
        900
    }
    /// Check hosts every minute.
    pub fn health_period_seconds() -> u32 {
        60
    }
    /// A check that takes longer than this counts as a failure.
    pub fn health_timeout_seconds() -> u32 {
        10
    }
}
