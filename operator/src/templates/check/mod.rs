//! Checks on plugin output, before anything reaches libvirt or cloud-init.
//!
//! A plugin is code a site wrote; its output is untrusted input. Domain XML is checked in
//! three steps, each reading the document exactly as libvirt will or refusing it:
//!
//! 1. `tree`: a strict parse into a tree with libxml2's reading of attributes, text,
//!    entities, namespaces and characters (no namespaces outside `<metadata>`, no CDATA,
//!    no mixed text, no DOCTYPE, UTF-8 only, ...), bounded in size and depth;
//! 2. `allow`: every element path, attribute and value on an allow-list of what a proxy
//!    VM needs; anything else is refused, naming its path and the rule;
//! 3. `domain`: the document tied to its input: name, UUID, the operator's mark (one
//!    element, structurally equal), memory, vCPUs, the prepared volumes and their formats,
//!    the seed read-only, the bridge, the assigned MAC, known firmware files read-only,
//!    of the right kind and with trusted variable stores;
//! 4. `host`: what the domain may cost and share on its host ([`HostPolicy`]): counts and
//!    sizes bounded by the machine type, CPU placement only inside the operator's CPUs, the
//!    accelerator the host has, the bridge's MTU, no nested virtualisation or vPMU;
//! 5. `devices`: device models from the safe list, also where libvirt would fill in a
//!    legacy default, and only the root disk boots.
//!
//! The same checks run again on libvirt's own reading of the defined domain
//! ([`check_defined_domain_xml`]) before it is started, so a document that libvirt
//! understands differently from us is caught there too.

mod allow;
mod devices;
mod domain;
mod host;
mod policy;
pub mod rules;
mod tree;
mod vendor;

pub use allow::Reading;
pub use domain::{FIRMWARE_CODE, FIRMWARE_VARS, FirmwareCode, FirmwareVars, NVRAM_DIR};
pub use host::{
    MAX_CONTROLLER_PORTS, MAX_CONTROLLER_VECTORS, MAX_NIC_RING, MAX_RNG_BYTES_PER_SECOND,
    MAX_VIDEO_KIB, MIN_RNG_PERIOD_MS,
};
pub use policy::{CpuPlacement, CpuSet, HostPolicy, HostSize, MAX_CPU_ID};
pub use rules::render_markdown as rules_markdown;
pub use tree::{MAX_DEPTH, MAX_ELEMENTS};
pub use vendor::{
    CloudConfig, CloudConfigValue, MAX_PARTS as VENDOR_DATA_MAX_PARTS, Scalar as CloudConfigScalar,
    VendorDataForm, VendorDataPart, VendorDataReading, VendorPartType, read_vendor_data,
};

use super::DomainInput;
use super::errors::TemplateErrorKind;

/// Largest domain XML accepted; real ones are a few KB.
pub const DOMAIN_XML_MAX: usize = 256 * 1024;
/// Largest vendor-data accepted; it goes into a seed ISO next to user-data.
pub const VENDOR_DATA_MAX: usize = 512 * 1024;

fn refuse(rule: &'static str, detail: impl Into<String>) -> TemplateErrorKind {
    TemplateErrorKind::InvalidOutput {
        rule,
        detail: detail.into(),
    }
}

/// A value quoted for an error message: escaped and shortened.
fn show(value: &str) -> String {
    crate::validation::show(value)
}

/// Checks rendered domain XML against the input it was rendered from, under the
/// strictest host policy ([`HostPolicy::default`]).
pub fn check_domain_xml(xml: &str, input: &DomainInput) -> Result<(), TemplateErrorKind> {
    check_domain_xml_on(xml, input, &HostPolicy::default())
}

/// Checks rendered domain XML against its input and the policy of the host it is for
/// (bridge MTU, CPU placement, the site's NVRAM templates).
pub fn check_domain_xml_on(
    xml: &str,
    input: &DomainInput,
    policy: &HostPolicy,
) -> Result<(), TemplateErrorKind> {
    check_reading(xml, input, policy, Reading::Plugin)
}

/// Checks libvirt's own reading of a defined domain (its inactive XML,
/// `virDomainGetXMLDesc(VIR_DOMAIN_XML_INACTIVE)`) against the input the plugin rendered
/// from, before the domain is ever started. libvirt fills in defaults (emulator, addresses,
/// controllers, generated MACs of further NICs, the NVRAM path); everything else obeys the
/// same rules as the plugin's output, so a document libvirt reads differently is caught.
///
/// Under the strictest host policy; see [`check_defined_domain_xml_on`].
pub fn check_defined_domain_xml(xml: &str, input: &DomainInput) -> Result<(), TemplateErrorKind> {
    check_defined_domain_xml_on(xml, input, &HostPolicy::default())
}

/// [`check_defined_domain_xml`] with the policy of the host the domain is defined on.
pub fn check_defined_domain_xml_on(
    xml: &str,
    input: &DomainInput,
    policy: &HostPolicy,
) -> Result<(), TemplateErrorKind> {
    check_reading(xml, input, policy, Reading::Libvirt)
}

fn check_reading(
    xml: &str,
    input: &DomainInput,
    policy: &HostPolicy,
    reading: Reading,
) -> Result<(), TemplateErrorKind> {
    if xml.len() > DOMAIN_XML_MAX {
        return Err(TemplateErrorKind::OutputTooLarge {
            size: xml.len(),
            max: DOMAIN_XML_MAX,
        });
    }
    let doc = tree::parse(xml, tree::Opaque::DomainMetadata)?;
    domain::check(&doc, input, policy, reading)
}

/// The QEMU guest agent's channel name, as libvirt and QEMU know it.
pub const AGENT_CHANNEL: &str = "org.qemu.guest_agent.0";

/// Whether a domain XML has the QEMU guest agent's channel. The operator reads a DHCP
/// proxy's address and whether the guest applied its seed through the agent, so
/// `plugin test` warns about a plugin without one.
pub fn has_agent_channel(xml: &str) -> bool {
    tree::parse(xml, tree::Opaque::DomainMetadata).is_ok_and(|doc| {
        doc.root.child("devices").is_some_and(|d| {
            d.children_named("channel").any(|c| {
                c.child("target")
                    .is_some_and(|t| t.attr("name") == Some(AGENT_CHANNEL))
            })
        })
    })
}

/// How many `<interface>` elements a rendered domain's devices have; `None` when the XML
/// does not parse (a refused render says why).
pub fn interface_count(xml: &str) -> Option<usize> {
    tree::parse(xml, tree::Opaque::DomainMetadata)
        .ok()
        .map(|doc| {
            doc.root
                .child("devices")
                .map_or(0, |d| d.children_named("interface").count())
        })
}

/// Checks rendered vendor-data by reading it as the guest's cloud-init will
/// ([`read_vendor_data`]): plain `#cloud-config` YAML or a strict `multipart/mixed`
/// document of shell-script and cloud-config parts; anything cloud-init could read
/// differently from us, or would drop, is refused.
pub fn check_vendor_data(text: &str) -> Result<(), TemplateErrorKind> {
    read_vendor_data(text).map(|_| ())
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod agent_channel_tests {
    #[test]
    fn the_agent_channel_is_found_only_where_it_is() {
        let with =
            |devices: &str| format!("<domain type=\"kvm\"><devices>{devices}</devices></domain>");
        assert!(super::has_agent_channel(&with(
            "<channel type=\"unix\"><target type=\"virtio\" name=\"org.qemu.guest_agent.0\"/></channel>"
        )));
        assert!(!super::has_agent_channel(&with("<serial type=\"pty\"/>")));
        assert!(!super::has_agent_channel(&with(
            "<channel type=\"unix\"><target type=\"virtio\" name=\"org.example.other\"/></channel>"
        )));
        assert!(!super::has_agent_channel("not xml"));
    }

    #[test]
    fn interfaces_are_counted_under_devices_only() {
        let nic = "<interface type=\"bridge\"><source bridge=\"br0\"/></interface>";
        let domain =
            |devices: &str| format!("<domain type=\"kvm\"><devices>{devices}</devices></domain>");
        assert_eq!(super::interface_count(&domain(nic)), Some(1));
        assert_eq!(
            super::interface_count(&domain(&format!("{nic}<serial type=\"pty\"/>{nic}"))),
            Some(2)
        );
        assert_eq!(super::interface_count(&domain("")), Some(0));
        assert_eq!(super::interface_count("<domain type=\"kvm\"/>"), Some(0));
        assert_eq!(super::interface_count("not xml"), None);
    }
}
