//! The ownership mark read back from a domain.
//!
//! The mark ([`MetadataMark::to_xml`]) is how the operator recognises its own domains:
//! adopting one for a Create, finding one for a Get, sweeping orphans. A domain's metadata
//! is written by anyone with access to the host, so everything here treats it as hostile
//! input: size-capped, no DTD, only the five predefined XML entities, strict structure, and
//! every value checked with the same rules the operator applied when it wrote the mark. A
//! mark that fails any of that is an error, never a panic, and never "probably ours".
//!
//! libvirt stores the element as a DOM and may serialise it back with another prefix, other
//! whitespace or with the namespace declared elsewhere, so elements are matched by
//! namespace URI and local name (quick-xml's `NsReader`), never by prefix.

use quick_xml::NsReader;
use quick_xml::events::{BytesRef, BytesStart, Event};
use quick_xml::name::{Namespace, ResolveResult};
use thiserror::Error;

use crate::error::{Classified, ErrorClass};
use crate::instance::{self, METADATA_NS, MetadataMark};
use crate::validation as rules;

/// Largest mark we read. Ours is under 1 KiB; the cap bounds the work a hostile one causes.
pub const MARK_MAX_BYTES: usize = 64 * 1024;
/// Largest domain XML we search for a mark. Real ones are a few KiB; this is a memory and
/// time bound, not a format limit.
pub const DOMAIN_XML_MAX_BYTES: usize = 4 * 1024 * 1024;
/// Longest reason a [`MarkError`] carries, so a hostile mark cannot flood a log line.
const REASON_MAX_CHARS: usize = 300;
/// Longest `createdAt` we accept: RFC 3339 with nanoseconds is 30 characters.
const CREATED_AT_MAX: usize = 64;
/// Local name of the mark's root element.
const INSTANCE: &[u8] = b"instance";

/// A mark that is not a valid ownership mark of ours.
///
/// Permanent: the metadata will not change by itself, so the caller must treat the domain
/// as someone else's (refuse to adopt it, never delete it), not retry.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invalid ownership mark: {reason}")]
pub struct MarkError {
    /// What is wrong, quoting (escaped, shortened) the offending value.
    pub reason: String,
}

impl MarkError {
    fn new(reason: impl Into<String>) -> Self {
        // quick-xml's messages may quote input: no raw control characters reach a log line.
        let reason: String = reason
            .into()
            .chars()
            .flat_map(|c| {
                let escaped = c.is_control().then(|| c.escape_default());
                let plain = (!c.is_control()).then_some(c);
                escaped.into_iter().flatten().chain(plain)
            })
            .collect();
        let reason = if reason.chars().count() > REASON_MAX_CHARS {
            let mut cut: String = reason.chars().take(REASON_MAX_CHARS).collect();
            cut.push('…');
            cut
        } else {
            reason
        };
        Self { reason }
    }
}

impl Classified for MarkError {
    fn class(&self) -> ErrorClass {
        ErrorClass::Permanent
    }
}

/// Parses the mark as `virDomainGetMetadata(VIR_DOMAIN_METADATA_ELEMENT, METADATA_NS)`
/// returns it: one `instance` element in [`METADATA_NS`], with any prefix.
pub fn parse_mark(xml: &str) -> Result<MetadataMark, MarkError> {
    validate(parse_raw(xml)?)
}

/// Finds our mark among the `<metadata>` children of a full domain XML. Other namespaces'
/// elements there are ignored; `Ok(None)` when ours is absent. A mark that is present but
/// invalid, two marks, or a document that is not well-formed are errors.
pub fn mark_from_domain_xml(domain_xml: &str) -> Result<Option<MetadataMark>, MarkError> {
    find_raw_in_domain(domain_xml)?.map(validate).transpose()
}

/// The mark's values, unescaped but not yet checked.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RawMark {
    managed: String,
    cluster: String,
    cluster_uid: Option<String>,
    namespace: String,
    name: String,
    uid: String,
    created_at: String,
    mac: Option<String>,
    address: Option<String>,
}

/// Applies the rules the operator used when it wrote the mark.
fn validate(raw: RawMark) -> Result<MetadataMark, MarkError> {
    if raw.managed != "true" {
        return Err(MarkError::new(format!(
            "managed is {}, not \"true\"",
            rules::show(&raw.managed)
        )));
    }
    let field = |name: &str, outcome: Result<(), String>| {
        outcome.map_err(|reason| MarkError::new(format!("{name}: {reason}")))
    };
    field("cluster", rules::dns1123_label(&raw.cluster))?;
    if let Some(uid) = &raw.cluster_uid {
        field("clusterUid", instance::check_uid(uid))?;
    }
    field("proxy namespace", rules::dns1123_label(&raw.namespace))?;
    field("proxy name", rules::dns1123_label(&raw.name))?;
    field("proxy uid", instance::check_uid(&raw.uid))?;
    field("createdAt", check_created_at(&raw.created_at))?;
    if let Some(mac) = &raw.mac {
        field("mac", instance::check_mac(mac))?;
    }
    let address = raw
        .address
        .as_deref()
        .map(|a| {
            // Four dotted decimals only: the standard parser refuses leading zeros and
            // other spellings, so what is accepted is what `to_xml` writes.
            a.parse::<std::net::Ipv4Addr>().map_err(|_| {
                MarkError::new(format!(
                    "address: {} is not an IPv4 address",
                    rules::show(a)
                ))
            })
        })
        .transpose()?;
    Ok(MetadataMark {
        cluster_id: raw.cluster,
        cluster_uid: raw.cluster_uid,
        namespace: raw.namespace,
        name: raw.name,
        uid: raw.uid,
        created_at: raw.created_at,
        mac: raw.mac,
        address,
    })
}

fn check_created_at(value: &str) -> Result<(), String> {
    if value.len() <= CREATED_AT_MAX && humantime::parse_rfc3339(value).is_ok() {
        Ok(())
    } else {
        Err(format!(
            "{} is not an RFC 3339 UTC time such as 2026-01-01T00:00:00Z",
            rules::show(value)
        ))
    }
}

type Reader<'i> = NsReader<&'i [u8]>;

/// Whether an event's namespace is ours. Undeclared prefixes are an error: the document is
/// not namespace-well-formed.
fn is_ours(ns: &ResolveResult<'_>) -> Result<bool, MarkError> {
    match ns {
        ResolveResult::Bound(Namespace(uri)) => Ok(*uri == METADATA_NS.as_bytes()),
        ResolveResult::Unbound => Ok(false),
        ResolveResult::Unknown(prefix) => Err(MarkError::new(format!(
            "undeclared namespace prefix {}",
            rules::show(&String::from_utf8_lossy(prefix))
        ))),
    }
}

/// Reads the next event, turning quick-xml's error into ours.
fn next<'i>(reader: &mut Reader<'i>) -> Result<(bool, Event<'i>), MarkError> {
    match reader.read_resolved_event() {
        Ok((ns, event)) => {
            let ours = match &event {
                Event::Start(_) | Event::Empty(_) | Event::End(_) => is_ours(&ns)?,
                _ => false,
            };
            Ok((ours, event))
        }
        Err(e) => Err(MarkError::new(format!(
            "malformed XML at byte {}: {e}",
            reader.error_position()
        ))),
    }
}

/// Whitespace between elements, which libvirt's re-serialisation may add or drop.
fn is_blank(text: &[u8]) -> bool {
    text.iter()
        .all(|b| matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
}

fn element_name(e: &BytesStart<'_>) -> String {
    rules::show(&String::from_utf8_lossy(e.name().as_ref()))
}

/// Parses a document that is exactly one mark element (plus an XML declaration, comments,
/// processing instructions and whitespace around it).
fn parse_raw(xml: &str) -> Result<RawMark, MarkError> {
    if xml.len() > MARK_MAX_BYTES {
        return Err(MarkError::new(format!(
            "{} bytes, more than the {MARK_MAX_BYTES} allowed",
            xml.len()
        )));
    }
    let mut reader = NsReader::from_str(xml);
    let mut found = None;
    loop {
        let (ours, event) = next(&mut reader)?;
        match event {
            Event::Start(e) | Event::Empty(e) if found.is_some() => {
                return Err(MarkError::new(format!(
                    "element {} after the mark element",
                    element_name(&e)
                )));
            }
            Event::Start(e) if ours && e.local_name().as_ref() == INSTANCE => {
                found = Some(read_instance(&mut reader, &e)?);
            }
            Event::Start(e) | Event::Empty(e) => {
                return Err(MarkError::new(format!(
                    "root element {} is not a non-empty `instance` element in {METADATA_NS}",
                    element_name(&e)
                )));
            }
            Event::Eof => break,
            other => outside_elements(&other)?,
        }
    }
    found.ok_or_else(|| MarkError::new("no mark element"))
}

/// What may stand outside the root element: only the prolog's harmless parts.
fn outside_elements(event: &Event<'_>) -> Result<(), MarkError> {
    match event {
        Event::Decl(_) | Event::Comment(_) | Event::PI(_) => Ok(()),
        Event::Text(t) if is_blank(t) => Ok(()),
        Event::DocType(_) => Err(no_dtd()),
        _ => Err(MarkError::new("text outside the root element")),
    }
}

fn no_dtd() -> MarkError {
    MarkError::new("a document type declaration (DTD) is not allowed")
}

/// Searches `/domain/metadata/*` for our element.
fn find_raw_in_domain(xml: &str) -> Result<Option<RawMark>, MarkError> {
    if xml.len() > DOMAIN_XML_MAX_BYTES {
        return Err(MarkError::new(format!(
            "domain XML of {} bytes, more than the {DOMAIN_XML_MAX_BYTES} allowed",
            xml.len()
        )));
    }
    let mut reader = NsReader::from_str(xml);
    // Depth of the current element: 1 inside <domain>, 2 inside <metadata>.
    let mut depth = 0usize;
    let mut in_metadata = false;
    let mut seen_root = false;
    let mut found: Option<RawMark> = None;
    loop {
        let (ours, event) = next(&mut reader)?;
        let empty = matches!(event, Event::Empty(_));
        match event {
            Event::Start(e) | Event::Empty(e) => {
                if depth == 0 {
                    if seen_root {
                        return Err(MarkError::new("more than one root element"));
                    }
                    seen_root = true;
                    // Domain elements are in no namespace, so a prefixed `domain` is not one.
                    if e.name().as_ref() != b"domain" {
                        return Err(MarkError::new(format!(
                            "root element {} is not `domain`",
                            element_name(&e)
                        )));
                    }
                } else if in_metadata && depth == 2 && ours && e.local_name().as_ref() == INSTANCE {
                    if found.is_some() {
                        return Err(MarkError::new("more than one mark element"));
                    }
                    if empty {
                        return Err(MarkError::new("the mark element is empty"));
                    }
                    let start = reader.buffer_position();
                    let raw = read_instance(&mut reader, &e)?;
                    let size = reader.buffer_position().saturating_sub(start);
                    if size > MARK_MAX_BYTES as u64 {
                        return Err(MarkError::new(format!(
                            "mark element of {size} bytes, more than the {MARK_MAX_BYTES} allowed"
                        )));
                    }
                    found = Some(raw);
                    // read_instance consumed the end tag: depth is unchanged.
                    continue;
                } else if depth == 1 && e.name().as_ref() == b"metadata" && !empty {
                    in_metadata = true;
                }
                if !empty {
                    depth += 1;
                }
            }
            Event::End(_) => {
                depth = depth.saturating_sub(1);
                if depth == 1 {
                    in_metadata = false;
                }
            }
            Event::Eof => break,
            Event::DocType(_) => return Err(no_dtd()),
            Event::Decl(_) | Event::Comment(_) | Event::PI(_) => {}
            Event::Text(t) if depth == 0 && !is_blank(&t) => {
                return Err(MarkError::new("text outside the root element"));
            }
            Event::CData(_) if depth == 0 => {
                return Err(MarkError::new("text outside the root element"));
            }
            Event::GeneralRef(r) => {
                // Resolved only to refuse unknown entities; the text itself is not ours.
                resolve_ref(&r)?;
                if depth == 0 {
                    return Err(MarkError::new("text outside the root element"));
                }
            }
            Event::Text(_) | Event::CData(_) => {}
        }
    }
    if depth != 0 {
        return Err(MarkError::new("the document ends inside an element"));
    }
    if !seen_root {
        return Err(MarkError::new("no root element"));
    }
    Ok(found)
}

/// Reads the content of a non-empty `instance` element whose start tag was just read, up to
/// and including its end tag.
fn read_instance(reader: &mut Reader<'_>, start: &BytesStart<'_>) -> Result<RawMark, MarkError> {
    only_namespace_declarations(reader, start)?;
    let mut managed = None;
    let mut cluster = None;
    let mut cluster_uid = None;
    let mut proxy = None;
    let mut created_at = None;
    let mut mac = None;
    let mut address = None;
    loop {
        let (ours, event) = next(reader)?;
        let empty = matches!(event, Event::Empty(_));
        match event {
            Event::Start(e) | Event::Empty(e) => {
                if !ours {
                    return Err(MarkError::new(format!(
                        "unexpected element {} in the mark",
                        element_name(&e)
                    )));
                }
                match e.local_name().as_ref() {
                    b"managed" => set_once(&mut managed, "managed", read_text(reader, empty)?)?,
                    b"cluster" => set_once(&mut cluster, "cluster", read_text(reader, empty)?)?,
                    b"clusterUid" => {
                        set_once(&mut cluster_uid, "clusterUid", read_text(reader, empty)?)?
                    }
                    b"createdAt" => {
                        set_once(&mut created_at, "createdAt", read_text(reader, empty)?)?
                    }
                    b"mac" => set_once(&mut mac, "mac", read_text(reader, empty)?)?,
                    b"address" => set_once(&mut address, "address", read_text(reader, empty)?)?,
                    b"proxy" => {
                        let attrs = proxy_attributes(reader, &e)?;
                        if !empty {
                            expect_end(reader, "proxy")?;
                        }
                        set_once(&mut proxy, "proxy", attrs)?;
                    }
                    _ => {
                        return Err(MarkError::new(format!(
                            "unknown element {} in the mark",
                            element_name(&e)
                        )));
                    }
                }
            }
            // Children are read up to their end tags, and quick-xml checks that end tags
            // match, so this is the end of `instance`.
            Event::End(_) => break,
            Event::Text(t) if is_blank(&t) => {}
            Event::Comment(_) | Event::PI(_) => {}
            Event::Eof => return Err(MarkError::new("the document ends inside the mark")),
            Event::DocType(_) => return Err(no_dtd()),
            _ => return Err(MarkError::new("text directly inside the mark element")),
        }
    }
    let missing = |what: &str| MarkError::new(format!("no {what} element"));
    let (namespace, name, uid) = proxy.ok_or_else(|| missing("proxy"))?;
    Ok(RawMark {
        managed: managed.ok_or_else(|| missing("managed"))?,
        cluster: cluster.ok_or_else(|| missing("cluster"))?,
        cluster_uid,
        namespace,
        name,
        uid,
        created_at: created_at.ok_or_else(|| missing("createdAt"))?,
        mac,
        address,
    })
}

fn set_once<T>(slot: &mut Option<T>, what: &str, value: T) -> Result<(), MarkError> {
    if slot.is_some() {
        return Err(MarkError::new(format!("more than one {what} element")));
    }
    *slot = Some(value);
    Ok(())
}

/// The unescaped text content of a leaf element whose start tag was just read.
fn read_text(reader: &mut Reader<'_>, empty: bool) -> Result<String, MarkError> {
    let mut out = String::new();
    if empty {
        return Ok(out);
    }
    loop {
        let (_, event) = next(reader)?;
        match event {
            Event::Text(t) => out.push_str(&t.decode().map_err(decode_error)?),
            Event::CData(c) => out.push_str(&c.decode().map_err(decode_error)?),
            Event::GeneralRef(r) => out.push_str(&resolve_ref(&r)?),
            Event::Comment(_) | Event::PI(_) => {}
            Event::End(_) => return Ok(out),
            Event::Start(e) | Event::Empty(e) => {
                return Err(MarkError::new(format!(
                    "element {} inside a text field of the mark",
                    element_name(&e)
                )));
            }
            Event::Eof => return Err(MarkError::new("the document ends inside the mark")),
            Event::DocType(_) => return Err(no_dtd()),
            Event::Decl(_) => return Err(MarkError::new("XML declaration inside the mark")),
        }
    }
}

/// Reads up to the end tag of an element that must have no content but whitespace.
fn expect_end(reader: &mut Reader<'_>, what: &str) -> Result<(), MarkError> {
    loop {
        let (_, event) = next(reader)?;
        match event {
            Event::End(_) => return Ok(()),
            Event::Text(t) if is_blank(&t) => {}
            Event::Comment(_) | Event::PI(_) => {}
            Event::Eof => return Err(MarkError::new("the document ends inside the mark")),
            _ => return Err(MarkError::new(format!("content inside the {what} element"))),
        }
    }
}

fn decode_error(e: impl std::fmt::Display) -> MarkError {
    MarkError::new(format!("undecodable text: {e}"))
}

/// A character reference or one of the five predefined entities. There is no DTD, so any
/// other entity is undefined: an error, not an empty string and not an expansion.
fn resolve_ref(r: &BytesRef<'_>) -> Result<String, MarkError> {
    let name = r.decode().map_err(decode_error)?;
    if r.is_char_ref() {
        return match r.resolve_char_ref() {
            Ok(Some(c)) => Ok(c.to_string()),
            _ => Err(MarkError::new(format!(
                "invalid character reference {}",
                rules::show(&format!("&{name};"))
            ))),
        };
    }
    quick_xml::escape::resolve_predefined_entity(&name)
        .map(str::to_string)
        .ok_or_else(|| {
            MarkError::new(format!(
                "unknown entity {} (only the five predefined XML entities are allowed)",
                rules::show(&format!("&{name};"))
            ))
        })
}

/// The `instance` element carries nothing but namespace declarations.
fn only_namespace_declarations(
    reader: &Reader<'_>,
    start: &BytesStart<'_>,
) -> Result<(), MarkError> {
    for attr in start.attributes() {
        let attr = attr.map_err(|e| MarkError::new(format!("malformed attribute: {e}")))?;
        if attr.key.as_namespace_binding().is_none() {
            let (_, local) = reader.resolve_attribute(attr.key);
            return Err(MarkError::new(format!(
                "unexpected attribute {} on the mark element",
                rules::show(&String::from_utf8_lossy(local.as_ref()))
            )));
        }
    }
    Ok(())
}

/// `namespace`, `name` and `uid` of the `proxy` element, unescaped; each exactly once
/// (quick-xml refuses duplicate attributes), nothing else but namespace declarations.
fn proxy_attributes(
    reader: &Reader<'_>,
    start: &BytesStart<'_>,
) -> Result<(String, String, String), MarkError> {
    let mut namespace = None;
    let mut name = None;
    let mut uid = None;
    for attr in start.attributes() {
        let attr = attr.map_err(|e| MarkError::new(format!("malformed attribute: {e}")))?;
        if attr.key.as_namespace_binding().is_some() {
            continue;
        }
        let shown = rules::show(&String::from_utf8_lossy(attr.key.as_ref()));
        // Our attributes are unprefixed, so in no namespace.
        let slot = match attr.key.as_ref() {
            b"namespace" => &mut namespace,
            b"name" => &mut name,
            b"uid" => &mut uid,
            _ => {
                return Err(MarkError::new(format!(
                    "unexpected attribute {shown} on the proxy element"
                )));
            }
        };
        let value = attr
            .decode_and_unescape_value(reader.decoder())
            .map_err(|e| MarkError::new(format!("attribute {shown}: {e}")))?;
        *slot = Some(value.into_owned());
    }
    let missing = |what: &str| MarkError::new(format!("the proxy element has no {what} attribute"));
    Ok((
        namespace.ok_or_else(|| missing("namespace"))?,
        name.ok_or_else(|| missing("name"))?,
        uid.ok_or_else(|| missing("uid"))?,
    ))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const UID: &str = "0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887";

    fn mark() -> MetadataMark {
        MetadataMark {
            cluster_id: "prod-1".into(),
            cluster_uid: None,
            namespace: "default".into(),
            name: "office-egress".into(),
            uid: UID.into(),
            created_at: "2026-01-01T12:34:56Z".into(),
            mac: None,
            address: None,
        }
    }

    /// A domain XML as libvirt returns it, with `metadata` holding `inner`.
    fn domain(inner: &str) -> String {
        format!(
            "<domain type='kvm' id='3'>\n  <name>egress-{UID}</name>\n  <uuid>{UID}</uuid>\n  \
             <metadata>\n    {inner}\n  </metadata>\n  <memory unit='KiB'>524288</memory>\n  \
             <devices><disk type='file'><source file='/x&amp;y'/></disk></devices>\n</domain>\n"
        )
    }

    /// Every rule a mark must satisfy, checked independently of the parser.
    fn assert_valid(m: &MetadataMark) {
        assert_eq!(rules::dns1123_label(&m.cluster_id), Ok(()), "{m:?}");
        assert_eq!(rules::dns1123_label(&m.namespace), Ok(()), "{m:?}");
        assert_eq!(rules::dns1123_label(&m.name), Ok(()), "{m:?}");
        assert_eq!(instance::check_uid(&m.uid), Ok(()), "{m:?}");
        assert!(humantime::parse_rfc3339(&m.created_at).is_ok(), "{m:?}");
        if let Some(mac) = &m.mac {
            assert_eq!(instance::check_mac(mac), Ok(()), "{m:?}");
        }
        // What we accept, we could have written: it round-trips.
        assert_eq!(parse_mark(&m.to_xml()).as_ref(), Ok(m));
    }

    #[test]
    fn round_trip() {
        let m = mark();
        assert_eq!(parse_mark(&m.to_xml()), Ok(m.clone()));
        assert_eq!(
            mark_from_domain_xml(&domain(&m.to_xml())),
            Ok(Some(m.clone()))
        );
        let fractional = MetadataMark {
            created_at: "2026-02-28T23:59:59.123456789Z".into(),
            ..m
        };
        assert_eq!(parse_mark(&fractional.to_xml()), Ok(fractional));
    }

    /// The network identity round-trips; a bad, repeated or empty value is refused with
    /// the field named, and a mark without it (written before MACs were recorded) still
    /// reads, its MAC the legacy derivation.
    #[test]
    fn mac_and_address() {
        let with = MetadataMark {
            mac: Some("02:11:22:33:44:55".into()),
            address: Some(std::net::Ipv4Addr::new(10, 203, 0, 17)),
            ..mark()
        };
        assert_eq!(parse_mark(&with.to_xml()), Ok(with.clone()));
        assert_eq!(
            mark_from_domain_xml(&domain(&with.to_xml())),
            Ok(Some(with.clone()))
        );
        assert_eq!(with.mac_or_legacy(), "02:11:22:33:44:55");
        assert_eq!(mark().mac_or_legacy(), instance::legacy_mac(UID));
        let good = with.to_xml();
        let cases = [
            ("02:11:22:33:44:55", "03:11:22:33:44:55", "mac: "),
            ("02:11:22:33:44:55", "02:11:22:33:44:5G", "mac: "),
            ("02:11:22:33:44:55", "", "mac: "),
            ("10.203.0.17", "10.203.0.017", "address: "),
            ("10.203.0.17", "10.203.0.256", "address: "),
            ("10.203.0.17", "fd00::1", "address: "),
            ("10.203.0.17", " 10.203.0.17", "address: "),
            (
                "<eo:mac>02:11:22:33:44:55</eo:mac>",
                "<eo:mac>02:11:22:33:44:55</eo:mac><eo:mac>02:11:22:33:44:56</eo:mac>",
                "more than one mac",
            ),
            (
                "<eo:address>10.203.0.17</eo:address>",
                "<eo:address>10.203.0.17</eo:address><eo:address>10.203.0.18</eo:address>",
                "more than one address",
            ),
        ];
        for (from, to, reason) in cases {
            let xml = good.replacen(from, to, 1);
            let err = parse_mark(&xml).unwrap_err();
            assert!(err.reason.contains(reason), "{to}: {err}");
        }
    }

    #[test]
    fn escaped_values_are_unescaped() {
        // Values that need escaping fail validation, so check the unescaping itself on the
        // raw values, then that validation refuses them with the field named.
        let m = MetadataMark {
            cluster_id: "c<&>'\"".into(),
            cluster_uid: None,
            namespace: "ns \"q\" & <t>".into(),
            name: "a\"<b>&'".into(),
            uid: "u&amp;".into(),
            created_at: "]]> <![CDATA[".into(),
            mac: None,
            address: None,
        };
        let raw = parse_raw(&m.to_xml()).unwrap();
        assert_eq!(
            raw,
            RawMark {
                managed: "true".into(),
                cluster: m.cluster_id.clone(),
                cluster_uid: None,
                namespace: m.namespace.clone(),
                name: m.name.clone(),
                uid: m.uid.clone(),
                created_at: m.created_at.clone(),
                mac: None,
                address: None,
            }
        );
        let err = parse_mark(&m.to_xml()).unwrap_err();
        assert!(err.reason.starts_with("cluster:"), "{err}");

        // Character references, CDATA and predefined entities that unescape to valid values.
        let xml = format!(
            "<eo:instance xmlns:eo=\"{METADATA_NS}\"><eo:managed>t&#x72;ue</eo:managed>\
             <eo:cluster>&#112;rod-1</eo:cluster>\
             <eo:proxy namespace=\"&#x64;efault\" name=\"office&#45;egress\" uid=\"{UID}\"/>\
             <eo:createdAt><![CDATA[2026-01-01T12:34:56Z]]></eo:createdAt></eo:instance>"
        );
        assert_eq!(parse_mark(&xml), Ok(mark()));
    }

    #[test]
    fn reprefixed_and_reformatted() {
        let ns = METADATA_NS;
        let variants = [
            // libvirt's pretty-printed form with another prefix.
            format!(
                "<instance:instance xmlns:instance=\"{ns}\">\n  \
                 <instance:managed>true</instance:managed>\n  \
                 <instance:cluster>prod-1</instance:cluster>\n  \
                 <instance:proxy namespace=\"default\" name=\"office-egress\" uid=\"{UID}\"/>\n  \
                 <instance:createdAt>2026-01-01T12:34:56Z</instance:createdAt>\n\
                 </instance:instance>\n"
            ),
            // Default namespace, single quotes, reordered children, expanded empty element,
            // comments, a declaration, and attributes in another order.
            format!(
                "<?xml version=\"1.0\"?>\n<!-- mark -->\n<instance xmlns='{ns}'>\r\n\
                 <createdAt>2026-01-01T12:34:56Z</createdAt>\t\
                 <proxy uid='{UID}' name='office-egress' namespace='default'>\n</proxy>\
                 <!-- c --><cluster>prod-1</cluster><managed>true</managed></instance>"
            ),
            // The namespace declared on each element separately.
            format!(
                "<a:instance xmlns:a=\"{ns}\"><b:managed xmlns:b=\"{ns}\">true</b:managed>\
                 <c:cluster xmlns:c=\"{ns}\">prod-1</c:cluster>\
                 <d:proxy xmlns:d=\"{ns}\" namespace=\"default\" name=\"office-egress\" \
                 uid=\"{UID}\"/><a:createdAt>2026-01-01T12:34:56Z</a:createdAt></a:instance>"
            ),
        ];
        for xml in &variants {
            assert_eq!(parse_mark(xml), Ok(mark()), "{xml}");
            assert_eq!(
                mark_from_domain_xml(&domain(xml)),
                Ok(Some(mark())),
                "{xml}"
            );
        }
    }

    #[test]
    fn domain_xml_lookup() {
        let m = mark().to_xml();
        let foreign = "<other:thing xmlns:other=\"https://example.com/x\"><other:instance>\
                       not ours</other:instance></other:thing>";
        let cases: Vec<(String, Result<Option<MetadataMark>, ()>)> = vec![
            (domain(""), Ok(None)),
            (domain(foreign), Ok(None)),
            (domain(&format!("{foreign}{m}")), Ok(Some(mark()))),
            (
                "<domain type='kvm'><name>x</name></domain>".into(),
                Ok(None),
            ),
            ("<domain/>".into(), Ok(None)),
            // Our element outside <metadata> is not a mark.
            (
                format!("<domain><description>{m}</description><metadata/></domain>"),
                Ok(None),
            ),
            (
                format!("<domain><metadata><x>{m}</x></metadata></domain>"),
                Ok(None),
            ),
            (format!("<domain>{m}</domain>"), Ok(None)),
            (domain(&format!("{m}{m}")), Err(())),
            (domain(&m.replace(">true<", ">false<")), Err(())),
            (
                domain(&format!("<eo:instance xmlns:eo=\"{METADATA_NS}\"/>")),
                Err(()),
            ),
            (
                format!("<notdomain><metadata>{m}</metadata></notdomain>"),
                Err(()),
            ),
            (
                format!("<domain><metadata>{m}</metadata></domain><domain/>"),
                Err(()),
            ),
            (format!("<domain><metadata>{m}</metadata>"), Err(())),
            (
                format!("<domain><metadata>{m}</metadata></domain>trailing"),
                Err(()),
            ),
            (
                format!(
                    "<!DOCTYPE domain [<!ENTITY x \"y\">]><domain><metadata>{m}</metadata></domain>"
                ),
                Err(()),
            ),
            (domain("<p:x xmlns:p='u'>&bogus;</p:x>"), Err(())),
            (domain("<undeclared:x/>"), Err(())),
            ("".into(), Err(())),
            ("not xml".into(), Err(())),
            (
                format!("<domain>{}</domain>", " ".repeat(DOMAIN_XML_MAX_BYTES)),
                Err(()),
            ),
        ];
        for (xml, want) in cases {
            let got = mark_from_domain_xml(&xml).map_err(|_| ());
            assert_eq!(got, want, "{}", rules::show(&xml));
        }
    }

    #[test]
    fn broken_marks_are_errors() {
        let ns = METADATA_NS;
        let good = mark().to_xml();
        let with = |from: &str, to: &str| {
            assert!(good.contains(from), "{from}");
            good.replacen(from, to, 1)
        };
        let cases: Vec<(&str, String, &str)> = vec![
            ("empty", String::new(), "no mark element"),
            ("whitespace", " \n ".into(), "no mark element"),
            ("not xml", "true".into(), "text outside"),
            (
                "truncated",
                good[..good.len() - 5].to_string(),
                "malformed XML",
            ),
            (
                "unclosed",
                good.replace("</eo:instance>", ""),
                "ends inside",
            ),
            (
                "wrong namespace",
                good.replace(ns, "https://example.com/other"),
                "is not a non-empty `instance`",
            ),
            (
                "namespace prefix only",
                good.replace(&format!(" xmlns:eo=\"{ns}\""), ""),
                "undeclared namespace prefix",
            ),
            (
                "no namespace",
                good.replace(&format!(" xmlns:eo=\"{ns}\""), "")
                    .replace("eo:", ""),
                "is not a non-empty `instance`",
            ),
            (
                "wrong root",
                good.replace("eo:instance", "eo:instanse"),
                "is not a non-empty `instance`",
            ),
            (
                "empty root",
                format!("<eo:instance xmlns:eo=\"{ns}\"/>"),
                "is not a non-empty `instance`",
            ),
            (
                "two roots",
                format!("{good}{good}"),
                "after the mark element",
            ),
            ("trailing text", format!("{good}x"), "text outside"),
            ("leading text", format!("x{good}"), "text outside"),
            (
                "not managed",
                with(">true<", ">false<"),
                "managed is \"false\"",
            ),
            (
                "managed with spaces",
                with(">true<", "> true <"),
                "managed is",
            ),
            (
                "managed empty",
                with("<eo:managed>true</eo:managed>", "<eo:managed/>"),
                "managed is \"\"",
            ),
            (
                "no managed",
                with("<eo:managed>true</eo:managed>", ""),
                "no managed element",
            ),
            (
                "two managed",
                with(
                    "<eo:managed>true</eo:managed>",
                    "<eo:managed>true</eo:managed><eo:managed>true</eo:managed>",
                ),
                "more than one managed",
            ),
            (
                "no cluster",
                with("<eo:cluster>prod-1</eo:cluster>", ""),
                "no cluster element",
            ),
            (
                "two clusters",
                with(
                    "<eo:cluster>prod-1</eo:cluster>",
                    "<eo:cluster>prod-1</eo:cluster><eo:cluster>prod-2</eo:cluster>",
                ),
                "more than one cluster",
            ),
            ("bad cluster", with(">prod-1<", ">Prod_1<"), "cluster: "),
            (
                "no proxy",
                with(
                    &format!(
                        "<eo:proxy namespace=\"default\" name=\"office-egress\" uid=\"{UID}\"/>"
                    ),
                    "",
                ),
                "no proxy element",
            ),
            (
                "two proxies",
                with(
                    "<eo:createdAt>",
                    &format!(
                        "<eo:proxy namespace=\"default\" name=\"office-egress\" uid=\"{UID}\"/><eo:createdAt>"
                    ),
                ),
                "more than one proxy",
            ),
            (
                "no uid",
                with(&format!(" uid=\"{UID}\""), ""),
                "no uid attribute",
            ),
            (
                "no name",
                with(" name=\"office-egress\"", ""),
                "no name attribute",
            ),
            (
                "no namespace attribute",
                with(" namespace=\"default\"", ""),
                "no namespace attribute",
            ),
            (
                "duplicate attribute",
                with(
                    " name=\"office-egress\"",
                    " name=\"office-egress\" name=\"x\"",
                ),
                "duplicated attribute",
            ),
            (
                "unknown attribute",
                with(
                    " name=\"office-egress\"",
                    " name=\"office-egress\" extra=\"1\"",
                ),
                "unexpected attribute \"extra\"",
            ),
            (
                "prefixed attribute",
                with(" name=\"office-egress\"", " eo:name=\"office-egress\""),
                "unexpected attribute \"eo:name\"",
            ),
            (
                "bad uid",
                with(UID, "0B7C3C1E-9A43-4F5E-A1D2-3C4B5A697887"),
                "proxy uid:",
            ),
            ("path uid", with(UID, "../../etc/passwd"), "proxy uid:"),
            (
                "bad name",
                with("office-egress", "office_egress"),
                "proxy name:",
            ),
            (
                "long name",
                with("office-egress", &"a".repeat(64)),
                "too long",
            ),
            (
                "bad namespace",
                with("\"default\"", "\"a/b\""),
                "proxy namespace:",
            ),
            (
                "text in proxy",
                with(
                    "uid=\"0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887\"/>",
                    &format!("uid=\"{UID}\">x</eo:proxy>"),
                ),
                "content inside the proxy",
            ),
            (
                "no createdAt",
                with("<eo:createdAt>2026-01-01T12:34:56Z</eo:createdAt>", ""),
                "no createdAt element",
            ),
            (
                "bad createdAt",
                with("2026-01-01T12:34:56Z", "yesterday"),
                "createdAt:",
            ),
            (
                "local createdAt",
                with("2026-01-01T12:34:56Z", "2026-01-01T12:34:56+02:00"),
                "createdAt:",
            ),
            (
                "month 13",
                with("2026-01-01T12:34:56Z", "2026-13-01T12:34:56Z"),
                "createdAt:",
            ),
            (
                "long createdAt",
                with(
                    "2026-01-01T12:34:56Z",
                    &format!("2026-01-01T12:34:56.{}Z", "1".repeat(80)),
                ),
                "createdAt:",
            ),
            (
                "unknown element",
                with("<eo:createdAt>", "<eo:extra/><eo:createdAt>"),
                "unknown element",
            ),
            (
                "foreign element",
                with("<eo:createdAt>", "<x:y xmlns:x=\"u\"/><eo:createdAt>"),
                "unexpected element",
            ),
            (
                "unprefixed element",
                with("<eo:createdAt>", "<createdAt/><eo:createdAt>"),
                "unexpected element",
            ),
            (
                "text in instance",
                with("<eo:createdAt>", "junk<eo:createdAt>"),
                "text directly inside",
            ),
            (
                "element in field",
                with(">prod-1<", "><eo:b>prod-1</eo:b><"),
                "inside a text field",
            ),
            (
                "attribute on instance",
                with(
                    &format!("xmlns:eo=\"{ns}\""),
                    &format!("xmlns:eo=\"{ns}\" a=\"b\""),
                ),
                "on the mark element",
            ),
            (
                "undeclared prefix",
                with("<eo:createdAt>", "<zz:q/><eo:createdAt>"),
                "undeclared namespace prefix",
            ),
            (
                "mismatched end",
                with("</eo:cluster>", "</eo:managed>"),
                "malformed XML",
            ),
            (
                "unknown entity in text",
                with(">prod-1<", ">&prod;<"),
                "unknown entity",
            ),
            (
                "unknown entity in attribute",
                with("\"default\"", "\"&ns;\""),
                "unrecognized entity",
            ),
            (
                "external entity",
                format!(
                    "<!DOCTYPE i [<!ENTITY x SYSTEM \"file:///etc/passwd\">]>{}",
                    with(">prod-1<", ">&x;<")
                ),
                "(DTD) is not allowed",
            ),
            (
                "internal entity",
                format!(
                    "<!DOCTYPE i [<!ENTITY c \"prod-1\">]>{}",
                    with(">prod-1<", ">&c;<")
                ),
                "(DTD) is not allowed",
            ),
            (
                "billion laughs",
                format!(
                    "<!DOCTYPE i [<!ENTITY a \"aaaa\"><!ENTITY b \"&a;&a;&a;\">]>{}",
                    with(">prod-1<", ">&b;<")
                ),
                "(DTD) is not allowed",
            ),
            (
                "NUL char ref",
                with(">prod-1<", ">&#0;<"),
                "invalid character reference",
            ),
            (
                "bad char ref",
                with(">prod-1<", ">&#xZZ;<"),
                "invalid character reference",
            ),
            (
                "huge char ref",
                with(">prod-1<", ">&#x110000;<"),
                "invalid character reference",
            ),
            ("dangling amp", with(">prod-1<", ">a&b<"), "malformed XML"),
            (
                "lt in attribute",
                with("\"default\"", "\"a<b\""),
                "proxy namespace:",
            ),
            (
                "oversized",
                with(">prod-1<", &format!(">{}<", "a".repeat(MARK_MAX_BYTES))),
                "more than the 65536 allowed",
            ),
            (
                "oversized comment",
                format!("<!--{}-->{good}", "x".repeat(MARK_MAX_BYTES)),
                "more than the 65536 allowed",
            ),
        ];
        for (what, xml, reason) in cases {
            let got = parse_mark(&xml);
            assert!(got.is_err(), "{what}: {got:?}");
            let err = got.unwrap_err();
            assert!(err.reason.contains(reason), "{what}: {err}");
            assert!(
                err.reason.chars().count() <= REASON_MAX_CHARS + 1,
                "{what}: {err}"
            );
            assert_eq!(err.class(), ErrorClass::Permanent);
            // The same element inside a domain is refused too, or not found when the
            // breakage hides it; text and comments around it are the domain's business.
            let in_domain = mark_from_domain_xml(&domain(&xml));
            if ["leading text", "trailing text", "oversized comment"].contains(&what) {
                assert_eq!(in_domain, Ok(Some(mark())), "{what}");
            } else {
                assert!(
                    matches!(in_domain, Err(_) | Ok(None)),
                    "{what}: {in_domain:?}"
                );
            }
        }
    }

    #[test]
    fn the_cluster_uid_round_trips_and_is_checked() {
        let m = MetadataMark {
            cluster_uid: Some("7f00aa01-0000-4000-8000-000000000001".into()),
            ..mark()
        };
        assert_eq!(parse_mark(&m.to_xml()).unwrap(), m);
        assert_eq!(
            mark_from_domain_xml(&domain(&m.to_xml())).unwrap(),
            Some(m.clone())
        );
        let bad = MetadataMark {
            cluster_uid: Some("not a uid".into()),
            ..mark()
        };
        let err = parse_mark(&bad.to_xml()).unwrap_err();
        assert!(err.reason.starts_with("clusterUid:"), "{err}");
        let twice = m.to_xml().replace(
            "<eo:proxy",
            "<eo:clusterUid>7f00aa01-0000-4000-8000-000000000001</eo:clusterUid><eo:proxy",
        );
        let err = parse_mark(&twice).unwrap_err();
        assert!(err.reason.contains("more than one clusterUid"), "{err}");
    }

    #[test]
    fn error_reasons_are_bounded_and_escaped() {
        let long = format!("{}\n\u{0}", "x".repeat(10_000));
        let m = MetadataMark {
            cluster_id: long.clone(),
            ..mark()
        };
        let err = parse_mark(&m.to_xml()).unwrap_err();
        assert!(err.reason.len() < 1_000, "{}", err.reason.len());
        assert!(!err.reason.contains('\n'), "{err}");
        assert!(
            err.to_string()
                .starts_with("invalid ownership mark: cluster:"),
            "{err}"
        );
        let err = MarkError::new("a\nb\u{0}c");
        assert_eq!(err.reason, "a\\nb\\u{0}c");
    }

    /// Valid marks, for the property tests.
    fn valid_mark() -> impl Strategy<Value = MetadataMark> {
        let label = "[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?";
        (
            label,
            label,
            label,
            "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
            (
                1970u32..2400,
                1u32..13,
                1u32..29,
                0u32..24,
                0u32..60,
                0u32..60,
            ),
            proptest::option::of("[0-9a-f][02468ace](:[0-9a-f]{2}){5}"),
            proptest::option::of(any::<[u8; 4]>()),
            proptest::option::of("[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"),
        )
            .prop_map(
                |(
                    cluster_id,
                    namespace,
                    name,
                    uid,
                    (y, mo, d, h, mi, s),
                    mac,
                    address,
                    cluster_uid,
                )| {
                    MetadataMark {
                        cluster_id,
                        cluster_uid,
                        namespace,
                        name,
                        uid,
                        created_at: format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z"),
                        mac,
                        address: address.map(std::net::Ipv4Addr::from),
                    }
                },
            )
    }

    /// One edit of a byte string.
    #[derive(Debug, Clone)]
    enum Mutation {
        Delete(usize),
        Insert(usize, u8),
        Replace(usize, u8),
    }

    /// Bytes that matter to XML, plus anything at all.
    fn interesting_byte() -> impl Strategy<Value = u8> {
        prop_oneof![
            3 => proptest::sample::select(b"<>/&;#x=\"' :!?[]-eotrue0123456789abcdef\n\t".to_vec()),
            1 => any::<u8>(),
        ]
    }

    fn mutation() -> impl Strategy<Value = Mutation> {
        prop_oneof![
            any::<usize>().prop_map(Mutation::Delete),
            (any::<usize>(), interesting_byte()).prop_map(|(i, b)| Mutation::Insert(i, b)),
            (any::<usize>(), interesting_byte()).prop_map(|(i, b)| Mutation::Replace(i, b)),
        ]
    }

    fn mutate(xml: &str, mutations: &[Mutation]) -> String {
        let mut bytes = xml.as_bytes().to_vec();
        for m in mutations {
            let len = bytes.len();
            match *m {
                Mutation::Delete(i) if len > 0 => {
                    bytes.remove(i % len);
                }
                Mutation::Insert(i, b) => bytes.insert(i % (len + 1), b),
                Mutation::Replace(i, b) if len > 0 => bytes[i % len] = b,
                _ => {}
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn config() -> ProptestConfig {
        ProptestConfig {
            cases: 512,
            // No regression files written into the source tree.
            failure_persistence: None,
            ..ProptestConfig::default()
        }
    }

    /// Whatever the input, no panic; whatever is accepted satisfies every rule.
    fn check_any(xml: &str) {
        if let Ok(m) = parse_mark(xml) {
            assert_valid(&m);
        }
        if let Ok(Some(m)) = mark_from_domain_xml(xml) {
            assert_valid(&m);
        }
    }

    proptest! {
        #![proptest_config(config())]

        #[test]
        fn arbitrary_strings_never_panic(s in any::<String>()) {
            check_any(&s);
        }

        #[test]
        fn xmlish_strings_never_panic(
            s in "(<|>|/|&|;|#|x|=|\"|'| |eo:|instance|managed|true|proxy|cluster|uid|\
                  createdAt|xmlns|https://egress-operator.dev/xmlns/instance/1|&amp;|&#|\
                  <!DOCTYPE|<!\\[CDATA\\[|\\]\\]>|-->|<!--|[a-z0-9]){0,80}"
        ) {
            check_any(&s);
        }

        #[test]
        fn valid_marks_round_trip(m in valid_mark()) {
            prop_assert_eq!(parse_mark(&m.to_xml()), Ok(m.clone()));
            prop_assert_eq!(mark_from_domain_xml(&domain(&m.to_xml())), Ok(Some(m)));
        }

        #[test]
        fn mutated_marks_never_panic(
            m in valid_mark(),
            mutations in proptest::collection::vec(mutation(), 1..6),
        ) {
            let xml = mutate(&m.to_xml(), &mutations);
            check_any(&xml);
            let d = mutate(&domain(&m.to_xml()), &mutations);
            check_any(&d);
            if let Ok(Some(found)) = mark_from_domain_xml(&domain(&xml)) {
                assert_valid(&found);
            }
        }
    }
}
