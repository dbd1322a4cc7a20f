//! Assembles the typed template inputs for one Proxy on one host.
//!
//! The `render` command uses this to show a plugin author exactly what the operator would
//! render; the provider uses the same function when it creates a VM, so the two cannot
//! disagree.

use crate::api::proxy::{ProxyManifest, ProxySpec, TemplateSettingsOverrides};
use crate::config::{
    Firmware as ConfigFirmware, HostConfig, ImageConfig, MachineTypeConfig, ValidConfig,
};
use crate::instance::{self, InstanceIdentity, InstanceNet, MetadataMark};
use crate::provider::ProxyRef;
use crate::templates::{
    Disk, DiskBus, DiskRole, DomainInput, Firmware, HostFacts, MachineType, VendorDataInput,
};

/// What the operator knows about a host when it renders (read from libvirt on a real host).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    /// Guest architecture, e.g. `x86_64`.
    pub arch: String,
    /// Whether KVM is available.
    pub kvm: bool,
    /// libvirt version, `major.minor.micro`.
    pub libvirt_version: String,
    /// Host CPUs online.
    pub cpus: u32,
    /// Host NUMA nodes.
    pub numa_nodes: u32,
}

impl Default for Facts {
    /// Facts of a plain Debian 12 host without KVM: the most portable rendering.
    fn default() -> Self {
        Self {
            arch: "x86_64".into(),
            kvm: false,
            libvirt_version: "9.0.0".into(),
            cpus: 2,
            numa_nodes: 1,
        }
    }
}

/// The inputs of both plugins for one instance.
#[derive(Debug, Clone)]
pub struct Inputs {
    /// Names and IDs of the instance.
    pub identity: InstanceIdentity,
    /// Its MAC and static address, as the mark records them.
    pub net: InstanceNet,
    /// The mark the domain input carries (as XML in `domain.metadata_mark`), so a caller
    /// that changes what the input says (`plugin test`'s input without a MAC) can keep the
    /// two alike.
    pub mark: MetadataMark,
    /// The host it is placed on.
    pub host: HostConfig,
    /// The base image.
    pub image: ImageConfig,
    /// The machine type.
    pub machine_type: MachineTypeConfig,
    /// Domain plugin input (settings are filled in by the plugin host).
    pub domain: DomainInput,
    /// Vendor-data plugin input (settings are filled in by the plugin host).
    pub vendor_data: VendorDataInput,
    /// The Proxy's per-Proxy settings (`spec.templateSettings`), which the plugin host
    /// merges over the configured settings (`render_with`); empty when it sets none.
    pub overrides: TemplateSettingsOverrides,
}

/// Builds both inputs. `host` overrides the Proxy's placement; with neither, the first
/// configured host is used. `uid` is the Proxy's UID (a name-based one for files without).
pub fn inputs(
    config: &ValidConfig,
    proxy: &ProxyManifest,
    host: Option<&str>,
    facts: &Facts,
    created_at: &str,
) -> Result<Inputs, String> {
    let meta = &proxy.metadata;
    let uid = match meta.rest.get("uid").and_then(|v| v.as_str()) {
        Some(uid) => uid.to_string(),
        None => instance::name_based_uid(&meta.namespace, &meta.name),
    };
    let owner = ProxyRef {
        namespace: meta.namespace.clone(),
        name: meta.name.clone(),
        uid,
    };
    inputs_for(config, &owner, &proxy.spec, host, facts, created_at)
}

/// Builds both inputs for the Proxy `owner` with `spec`, with the preview network
/// identity ([`InstanceNet::preview`]).
pub fn inputs_for(
    config: &ValidConfig,
    owner: &ProxyRef,
    spec: &ProxySpec,
    host: Option<&str>,
    facts: &Facts,
    created_at: &str,
) -> Result<Inputs, String> {
    let net = InstanceNet::preview(&owner.uid);
    inputs_with(config, owner, spec, host, facts, created_at, &net)
}

/// Builds both inputs for the Proxy `owner` with `spec` and the network identity `net`
/// (what the provider calls: the MAC goes to the domain input and, with the address,
/// into the mark).
pub fn inputs_with(
    config: &ValidConfig,
    owner: &ProxyRef,
    spec: &ProxySpec,
    host: Option<&str>,
    facts: &Facts,
    created_at: &str,
    net: &InstanceNet,
) -> Result<Inputs, String> {
    let host_name = host.or(spec.host.as_deref());
    let host = match host_name {
        Some(h) => config
            .host(h)
            .ok_or_else(|| format!("host {h:?} is not in the providers config"))?,
        None => config
            .kvm2
            .hosts
            .first()
            .ok_or("the providers config has no hosts")?,
    };
    let defaults = config.kvm2.defaults.as_ref();
    let mt_name = spec
        .machine_type
        .as_deref()
        .or(defaults.and_then(|d| d.machine_type.as_deref()))
        .ok_or("the Proxy names no machine type and the config has no default")?;
    let mt = config
        .machine_type(mt_name)
        .ok_or_else(|| format!("machine type {mt_name:?} is not in the providers config"))?;
    let image_name = spec
        .image
        .as_deref()
        .or(defaults.and_then(|d| d.image.as_deref()))
        .ok_or("the Proxy names no image and the config has no default")?;
    let image = config
        .image(image_name)
        .ok_or_else(|| format!("image {image_name:?} is not in the providers config"))?;

    let meta = owner;
    let uid = owner.uid.clone();
    let identity = InstanceIdentity::for_uid(&uid).map_err(|e| format!("metadata.uid: {e}"))?;
    let me = config.identity().get().map_err(|e| e.to_string())?;
    let mark = MetadataMark {
        cluster_id: me.id.clone(),
        cluster_uid: me.uid.clone(),
        namespace: meta.namespace.clone(),
        name: meta.name.clone(),
        uid: uid.clone(),
        created_at: created_at.to_string(),
        mac: Some(net.mac.clone()),
        address: net.address,
    };
    let firmware = match mt.firmware {
        ConfigFirmware::Bios => Firmware::Bios,
        ConfigFirmware::Efi => Firmware::Efi,
    };
    let host_facts = HostFacts {
        name: host.name.clone(),
        arch: facts.arch.clone(),
        kvm: facts.kvm,
        libvirt_version: facts.libvirt_version.clone(),
        cpus: facts.cpus,
        numa_nodes: facts.numa_nodes,
    };
    let domain = DomainInput {
        name: identity.domain_name.clone(),
        uuid: identity.domain_uuid.clone(),
        vcpus: mt.vcpus,
        memory_mib: mt.memory_mib,
        firmware,
        disks: vec![
            Disk {
                pool: host.storage_pool.clone(),
                volume: identity.root_volume.clone(),
                role: DiskRole::Root,
                bus: DiskBus::Virtio,
                // The overlay is qcow2 whatever the base image's format: that is what
                // makes each VM's disk copy-on-write over the shared base.
                format: "qcow2".into(),
            },
            Disk {
                pool: host.storage_pool.clone(),
                volume: identity.seed_volume.clone(),
                role: DiskRole::Seed,
                // virtio, not SATA: cloud kernels (Debian's genericcloud among them) have no
                // AHCI driver, so a SATA seed is invisible and cloud-init never runs.
                bus: DiskBus::Virtio,
                format: "raw".into(),
            },
        ],
        bridge: host.bridge.clone(),
        mac: Some(net.mac.clone()),
        metadata_mark: mark.to_xml(),
        host: host_facts.clone(),
        settings: String::new(),
    };
    let vendor_data = VendorDataInput {
        proxy_name: meta.name.clone(),
        proxy_namespace: meta.namespace.clone(),
        host: host_facts,
        machine_type: MachineType {
            name: mt.name.clone(),
            vcpus: mt.vcpus,
            memory_mib: mt.memory_mib,
            disk_gib: mt.disk_gib,
            firmware,
        },
        settings: String::new(),
    };
    Ok(Inputs {
        identity,
        net: net.clone(),
        mark,
        host: host.clone(),
        image: image.clone(),
        machine_type: mt.clone(),
        domain,
        vendor_data,
        overrides: spec.template_settings.clone().unwrap_or_default(),
    })
}
