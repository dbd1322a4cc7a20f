//! Streaming, hashing, policy-enforcing download of base images (`kvm2.images[]`).
//!
//! Images are hundreds of MB to several GB and go straight into a libvirt storage volume,
//! so the body is never buffered: the caller pulls chunks with
//! [`ImageDownload::next_chunk`] while this module hashes and counts them, and
//! [`ImageDownload::finish`] checks the length and the sha256 at the end.
//!
//! The URL comes from config, but where it leads is decided by whoever runs the server and
//! its DNS, so every hop is checked, not just the configured URL:
//! - https only, unless the image sets `allowHttp`. That also applies to redirect hops: an
//!   https → http downgrade is refused unless `allowHttp` is set (with it, plain http is
//!   acceptable anyway, and the sha256 still protects the content).
//! - No address in loopback, private, link-local, CGNAT, documentation and other special
//!   ranges ([`classify`]), unless the image sets `allowPrivateAddresses`. Host names are
//!   checked in our own resolver, which refuses the whole answer if any address in it is
//!   refused, and the connection then goes only to the addresses that were checked (no
//!   second lookup to rebind). IP literals never reach a resolver, so they are checked
//!   before the request and on every redirect hop.
//! - Cloud metadata endpoints, unspecified, multicast and broadcast addresses are refused
//!   always, even with `allowPrivateAddresses`: no image is ever served from them, and
//!   metadata endpoints hand out credentials.
//! - At most [`FetchPolicy::max_redirects`] redirects; a size cap checked against
//!   Content-Length up front and again as bytes arrive.
//! - No proxy: a proxy would resolve names itself and defeat the address policy.
//!
//! Errors name the image and show URLs only as `scheme://host[:port]/path` ([`redact`]):
//! userinfo and query strings may hold credentials.

use std::error::Error as StdError;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use sha2::{Digest, Sha256};
use thiserror::Error;
use url::{Host, Url};

use crate::config::ImageConfig;
use crate::error::{Classified, ErrorClass};

const MIB: u64 = 1024 * 1024;

/// Limits and timeouts of a download that do not come from the image entry.
#[derive(Debug, Clone)]
pub struct FetchPolicy {
    /// Redirects followed at most; one more is refused.
    pub max_redirects: usize,
    /// Deadline for DNS + TCP connect + TLS handshake, per hop.
    pub connect_timeout: Duration,
    /// No byte for this long (waiting for the response or inside the body) is a
    /// transient error: a stalled server must not hold a download slot forever.
    pub idle_timeout: Duration,
    /// Size cap when the image sets no `maxSizeMiB`.
    pub default_max_bytes: u64,
    /// Floor of the whole download's deadline (request to last byte); large images get
    /// more (see [`download_deadline`]). A server that trickles bytes just often enough
    /// to beat `idle_timeout` fails this Create with [`FetchError::TooSlow`] instead of
    /// holding it (and the upload it feeds) without bound.
    pub min_download_deadline: Duration,
    /// The slowest average rate a download may have once past the floor.
    pub min_bytes_per_sec: u64,
    /// Extra trusted roots (PEM), on top of the built-in Mozilla set. For tests.
    pub extra_root_pem: Option<Vec<u8>>,
    /// Addresses accepted even without `allowPrivateAddresses`, so that a test server on
    /// loopback can be reached while every other address gets the production policy.
    /// The always-refused ranges (metadata, multicast, ...) stay refused. Empty normally.
    pub exempt_addresses: Vec<IpAddr>,
}

impl Default for FetchPolicy {
    fn default() -> Self {
        FetchPolicy {
            max_redirects: 3,
            connect_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            default_max_bytes: 8 * 1024 * MIB,
            min_download_deadline: Duration::from_secs(10 * 60),
            min_bytes_per_sec: MIB,
            extra_root_pem: None,
            exempt_addresses: Vec::new(),
        }
    }
}

/// Deadline of a whole download of `size` bytes under `policy`: the floor, or `size` at
/// the minimum rate, whichever is longer.
pub fn download_deadline(policy: &FetchPolicy, size: u64) -> Duration {
    let secs = size / policy.min_bytes_per_sec.max(1);
    policy.min_download_deadline.max(Duration::from_secs(secs))
}

/// The result of a complete, verified download.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// sha256 of the bytes received, lower-case hex (equal to the configured one).
    pub sha256: String,
    /// Bytes received.
    pub size: u64,
}

// ---------------------------------------------------------------------------------------
// Address classification

/// A range of addresses that is not plain public unicast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressRange {
    /// What the range is: `loopback`, `private`, `link-local`, `cloud metadata`, ...
    pub name: &'static str,
    /// First address of the range.
    pub net: IpAddr,
    /// Prefix length.
    pub prefix: u8,
    /// Refused even when the image sets `allowPrivateAddresses`.
    pub always: bool,
}

impl AddressRange {
    fn contains(&self, ip: IpAddr) -> bool {
        match (self.net, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(ip) & mask == u32::from(net) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(ip) & mask == u128::from(net) & mask
            }
            _ => false,
        }
    }
}

impl fmt::Display for AddressRange {
    /// `NAME range NET/PREFIX`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} range {}/{}", self.name, self.net, self.prefix)
    }
}

/// Why [`classify`] singled out an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecialAddress {
    /// The range the address (or the IPv4 address it embeds) is in.
    pub range: &'static AddressRange,
    /// For IPv6 forms that carry an IPv4 address (IPv4-mapped, NAT64, 6to4, ...): the
    /// form and the embedded address the range applies to.
    pub embedded: Option<(&'static str, Ipv4Addr)>,
}

const ALWAYS: bool = true;
const UNLESS_ALLOWED: bool = false;
const METADATA: &str = "cloud metadata";

const fn v4(o: [u8; 4], prefix: u8, name: &'static str, always: bool) -> AddressRange {
    let net = IpAddr::V4(Ipv4Addr::new(o[0], o[1], o[2], o[3]));
    AddressRange {
        name,
        net,
        prefix,
        always,
    }
}

const fn v6(s: [u16; 8], prefix: u8, name: &'static str, always: bool) -> AddressRange {
    let net = IpAddr::V6(Ipv6Addr::new(
        s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7],
    ));
    AddressRange {
        name,
        net,
        prefix,
        always,
    }
}

/// IPv4 ranges, most specific first (the first match wins).
const V4_RANGES: &[AddressRange] = &[
    v4([169, 254, 169, 254], 32, METADATA, ALWAYS),
    // AWS ECS task metadata and EKS pod identity agent.
    v4([169, 254, 170, 2], 32, METADATA, ALWAYS),
    v4([169, 254, 170, 23], 32, METADATA, ALWAYS),
    // Alibaba Cloud.
    v4([100, 100, 100, 200], 32, METADATA, ALWAYS),
    // Oracle Cloud.
    v4([192, 0, 0, 192], 32, METADATA, ALWAYS),
    v4([255, 255, 255, 255], 32, "broadcast", ALWAYS),
    v4([0, 0, 0, 0], 8, "unspecified", ALWAYS),
    v4([224, 0, 0, 0], 4, "multicast", ALWAYS),
    v4([127, 0, 0, 0], 8, "loopback", UNLESS_ALLOWED),
    v4([10, 0, 0, 0], 8, "private", UNLESS_ALLOWED),
    v4([172, 16, 0, 0], 12, "private", UNLESS_ALLOWED),
    v4([192, 168, 0, 0], 16, "private", UNLESS_ALLOWED),
    v4([100, 64, 0, 0], 10, "CGNAT shared address", UNLESS_ALLOWED),
    v4([169, 254, 0, 0], 16, "link-local", UNLESS_ALLOWED),
    v4(
        [192, 0, 0, 0],
        24,
        "IETF protocol assignment",
        UNLESS_ALLOWED,
    ),
    v4([192, 0, 2, 0], 24, "documentation", UNLESS_ALLOWED),
    v4([198, 51, 100, 0], 24, "documentation", UNLESS_ALLOWED),
    v4([203, 0, 113, 0], 24, "documentation", UNLESS_ALLOWED),
    v4([198, 18, 0, 0], 15, "benchmarking", UNLESS_ALLOWED),
    v4([240, 0, 0, 0], 4, "reserved", UNLESS_ALLOWED),
];

/// IPv6 ranges that carry no IPv4 address, most specific first.
const V6_RANGES: &[AddressRange] = &[
    // AWS (IMDS and EKS pod identity over IPv6).
    v6([0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254], 128, METADATA, ALWAYS),
    v6([0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x23], 128, METADATA, ALWAYS),
    v6([0, 0, 0, 0, 0, 0, 0, 0], 128, "unspecified", ALWAYS),
    v6([0xff00, 0, 0, 0, 0, 0, 0, 0], 8, "multicast", ALWAYS),
    v6([0, 0, 0, 0, 0, 0, 0, 1], 128, "loopback", UNLESS_ALLOWED),
    v6(
        [0x64, 0xff9b, 1, 0, 0, 0, 0, 0],
        48,
        "NAT64 local-use",
        UNLESS_ALLOWED,
    ),
    v6(
        [0x100, 0, 0, 0, 0, 0, 0, 0],
        64,
        "discard-only",
        UNLESS_ALLOWED,
    ),
    v6([0x2001, 0, 0, 0, 0, 0, 0, 0], 32, "Teredo", UNLESS_ALLOWED),
    v6(
        [0x2001, 2, 0, 0, 0, 0, 0, 0],
        48,
        "benchmarking",
        UNLESS_ALLOWED,
    ),
    v6(
        [0x2001, 0xdb8, 0, 0, 0, 0, 0, 0],
        32,
        "documentation",
        UNLESS_ALLOWED,
    ),
    v6(
        [0x3fff, 0, 0, 0, 0, 0, 0, 0],
        20,
        "documentation",
        UNLESS_ALLOWED,
    ),
    v6(
        [0xfc00, 0, 0, 0, 0, 0, 0, 0],
        7,
        "unique local (private)",
        UNLESS_ALLOWED,
    ),
    v6(
        [0xfe80, 0, 0, 0, 0, 0, 0, 0],
        10,
        "link-local",
        UNLESS_ALLOWED,
    ),
    v6(
        [0xfec0, 0, 0, 0, 0, 0, 0, 0],
        10,
        "site-local (deprecated)",
        UNLESS_ALLOWED,
    ),
];

/// `::a.b.c.d`: deprecated and never routed, refused even when the IPv4 part is public.
const V4_COMPATIBLE: AddressRange = v6([0; 8], 96, "IPv4-compatible (deprecated)", UNLESS_ALLOWED);

fn find_range(table: &'static [AddressRange], ip: IpAddr) -> Option<&'static AddressRange> {
    table.iter().find(|r| r.contains(ip))
}

/// The IPv4 address an IPv6 form carries, with the form's name.
fn embedded_v4(ip: Ipv6Addr) -> Option<(&'static str, Ipv4Addr)> {
    let low32 = |hi: u16, lo: u16| Ipv4Addr::from((u32::from(hi) << 16) | u32::from(lo));
    match ip.segments() {
        [0, 0, 0, 0, 0, 0xffff, hi, lo] => Some(("IPv4-mapped", low32(hi, lo))),
        [0, 0, 0, 0, 0xffff, 0, hi, lo] => Some(("IPv4-translated", low32(hi, lo))),
        [0x64, 0xff9b, 0, 0, 0, 0, hi, lo] => Some(("NAT64", low32(hi, lo))),
        [0x2002, hi, lo, ..] => Some(("6to4", low32(hi, lo))),
        // `::` and `::1` are in V6_RANGES, which is consulted first.
        [0, 0, 0, 0, 0, 0, hi, lo] => Some(("IPv4-compatible", low32(hi, lo))),
        _ => None,
    }
}

/// Which special range `ip` is in, or `None` for plain public unicast.
///
/// IPv6 forms that embed an IPv4 address are judged by that address, so that
/// `::ffff:10.0.0.1` is as private as `10.0.0.1`.
pub fn classify(ip: IpAddr) -> Option<SpecialAddress> {
    let plain = |range| SpecialAddress {
        range,
        embedded: None,
    };
    match ip {
        IpAddr::V4(_) => find_range(V4_RANGES, ip).map(plain),
        IpAddr::V6(v6) => {
            if let Some(range) = find_range(V6_RANGES, ip) {
                return Some(plain(range));
            }
            let (form, v4) = embedded_v4(v6)?;
            match find_range(V4_RANGES, IpAddr::V4(v4)) {
                Some(range) => Some(SpecialAddress {
                    range,
                    embedded: Some((form, v4)),
                }),
                None if form == "IPv4-compatible" => Some(plain(&V4_COMPATIBLE)),
                None => None,
            }
        }
    }
}

/// An address the policy refused, and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressRefusal {
    /// The address as seen (in a URL or a DNS answer).
    pub addr: IpAddr,
    /// Its range.
    pub special: SpecialAddress,
}

impl fmt::Display for AddressRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = self.special.range;
        match self.special.embedded {
            Some((form, v4)) => write!(f, "{} is the {form} form of {v4}, in the {r}", self.addr)?,
            None => write!(f, "{} is in the {r}", self.addr)?,
        }
        if r.always {
            f.write_str(" (refused even with allowPrivateAddresses)")
        } else {
            f.write_str(" (set allowPrivateAddresses on the image to accept it)")
        }
    }
}

/// What addresses one download may connect to.
#[derive(Debug, Clone)]
struct AddressPolicy {
    allow_private: bool,
    exempt: Arc<[IpAddr]>,
}

impl AddressPolicy {
    fn check(&self, addr: IpAddr) -> Result<(), AddressRefusal> {
        let Some(special) = classify(addr) else {
            return Ok(());
        };
        let exempt = self
            .exempt
            .iter()
            .any(|e| e.to_canonical() == addr.to_canonical());
        if special.range.always || !(self.allow_private || exempt) {
            return Err(AddressRefusal { addr, special });
        }
        Ok(())
    }
}

/// Resolves host names and refuses the whole answer if any address in it is refused:
/// filtering would let a name that mixes public and private addresses through.
#[derive(Debug)]
struct PolicyResolver {
    policy: AddressPolicy,
}

/// The resolver's refusal, found again in reqwest's error chain by [`find_source`].
#[derive(Debug)]
struct ResolveRefused {
    host: String,
    refusal: AddressRefusal,
}

impl fmt::Display for ResolveRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "host {} refused: {}", self.host, self.refusal)
    }
}

impl StdError for ResolveRefused {}

impl Resolve for PolicyResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let policy = self.policy.clone();
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let addrs: Vec<_> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            if addrs.is_empty() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("{host} has no address"),
                )
                .into());
            }
            for a in &addrs {
                if let Err(refusal) = policy.check(a.ip()) {
                    return Err(Box::new(ResolveRefused { host, refusal }) as _);
                }
            }
            Ok(Box::new(addrs.into_iter()) as Addrs)
        })
    }
}

// ---------------------------------------------------------------------------------------
// URL checks

/// `scheme://host[:port]/path` of `url`: what errors and logs may show of it. Userinfo,
/// query and fragment are dropped, since they may carry credentials or tokens.
pub fn redact(url: &Url) -> String {
    let mut s = format!("{}://{}", url.scheme(), url.host_str().unwrap_or(""));
    if let Some(port) = url.port() {
        s.push_str(&format!(":{port}"));
    }
    s.push_str(url.path());
    s
}

/// Why a URL (the configured one or a redirect hop) was refused before connecting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Not https (and not http with `allowHttp`).
    Scheme {
        /// The URL's scheme.
        scheme: String,
    },
    /// The URL's host is an IP literal in a refused range.
    Address(AddressRefusal),
    /// The URL has no host.
    NoHost,
    /// More redirects than [`FetchPolicy::max_redirects`].
    TooManyRedirects {
        /// The limit.
        max: usize,
    },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Scheme { scheme } if scheme == "http" => {
                f.write_str("plain http (set allowHttp on the image to accept it)")
            }
            Refusal::Scheme { scheme } => {
                write!(
                    f,
                    "scheme {scheme:?} is not supported (https, or http with allowHttp)"
                )
            }
            Refusal::Address(a) => a.fmt(f),
            Refusal::NoHost => f.write_str("the URL has no host"),
            Refusal::TooManyRedirects { max } => write!(f, "more than {max} redirects"),
        }
    }
}

/// The checks that can be made on a URL without a network: scheme and IP literal.
fn check_url(url: &Url, allow_http: bool, addresses: &AddressPolicy) -> Result<(), Refusal> {
    match url.scheme() {
        "https" => {}
        "http" if allow_http => {}
        other => {
            return Err(Refusal::Scheme {
                scheme: other.to_owned(),
            });
        }
    }
    let ip = match url.host() {
        None => return Err(Refusal::NoHost),
        Some(Host::Domain(_)) => return Ok(()),
        Some(Host::Ipv4(v4)) => IpAddr::V4(v4),
        Some(Host::Ipv6(v6)) => IpAddr::V6(v6),
    };
    addresses.check(ip).map_err(Refusal::Address)
}

/// A refused redirect hop, found again in reqwest's error chain by [`find_source`].
#[derive(Debug)]
struct HopRefused {
    hop: usize,
    url: String,
    refusal: Refusal,
}

impl fmt::Display for HopRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "redirect hop {} to {} refused: {}",
            self.hop, self.url, self.refusal
        )
    }
}

impl StdError for HopRefused {}

// ---------------------------------------------------------------------------------------
// Errors

/// Why a download failed. Every message names the image as `kvm2.images[NAME]`.
#[derive(Debug, Error)]
pub enum FetchError {
    /// The configured URL does not parse (config validation normally catches this).
    #[error("kvm2.images[{image}]: url is not a valid URL: {reason}")]
    InvalidUrl {
        /// Image name.
        image: String,
        /// The parser's reason.
        reason: String,
    },
    /// The policy refused the configured URL (hop 0) or a redirect hop, before connecting.
    #[error("kvm2.images[{image}]: {} refused: {reason}", hop_label(*hop, url))]
    Refused {
        /// Image name.
        image: String,
        /// The refused URL, redacted.
        url: String,
        /// 0 for the configured URL, n for the n-th redirect.
        hop: usize,
        /// Why.
        reason: Refusal,
    },
    /// A host name resolved to a refused address (any one refused address refuses the
    /// name).
    #[error("kvm2.images[{image}]: host {host} refused: {refusal}")]
    HostRefused {
        /// Image name.
        image: String,
        /// The host name that was resolved.
        host: String,
        /// The refused address and its range.
        refusal: AddressRefusal,
    },
    /// The server answered with a status other than 200.
    #[error("kvm2.images[{image}]: {url} answered HTTP {status}{}", status_reason(*status))]
    Http {
        /// Image name.
        image: String,
        /// The URL that answered, redacted.
        url: String,
        /// The status code.
        status: u16,
    },
    /// The image is larger than the cap: by its Content-Length, or while streaming.
    #[error("kvm2.images[{image}]: {url} is larger than the limit of {limit} bytes ({})",
        if *declared { format!("Content-Length is {size}") }
        else { format!("stopped after {size} bytes") })]
    TooLarge {
        /// Image name.
        image: String,
        /// The URL, redacted.
        url: String,
        /// The cap in bytes (`maxSizeMiB`, or the policy default).
        limit: u64,
        /// The declared size, or the bytes seen when the download was stopped.
        size: u64,
        /// Whether `size` is the declared Content-Length.
        declared: bool,
    },
    /// The server's certificate was not accepted.
    #[error("kvm2.images[{image}]: TLS with {url} failed: {detail}")]
    Tls {
        /// Image name.
        image: String,
        /// The URL, redacted.
        url: String,
        /// rustls's reason.
        detail: String,
    },
    /// DNS, TCP connect or TLS handshake failed.
    #[error("kvm2.images[{image}]: cannot connect to {url}: {detail}")]
    Connect {
        /// Image name.
        image: String,
        /// The URL, redacted.
        url: String,
        /// The cause chain.
        detail: String,
    },
    /// Connecting took too long, or no byte arrived for the idle timeout.
    #[error("kvm2.images[{image}]: {stage} from {url} stalled for {after:?}")]
    Timeout {
        /// Image name.
        image: String,
        /// The URL, redacted.
        url: String,
        /// `connect`, `response` or `body`.
        stage: &'static str,
        /// The deadline that passed.
        after: Duration,
    },
    /// The download kept going but not fast enough: it did not finish within its
    /// deadline ([`download_deadline`]). Only this download fails; the host and its link
    /// are not at fault.
    #[error("kvm2.images[{image}]: download from {url} too slow: {received} of {} bytes \
        after {}, the deadline for this image",
        expected.map(|e| e.to_string()).unwrap_or_else(|| "?".into()),
        humantime::format_duration(*after))]
    TooSlow {
        /// Image name.
        image: String,
        /// The URL, redacted.
        url: String,
        /// Bytes received when the deadline passed.
        received: u64,
        /// Content-Length, if given.
        expected: Option<u64>,
        /// The deadline that passed.
        after: Duration,
    },
    /// The body ended with an error before it was complete.
    #[error("kvm2.images[{image}]: body from {url} ended after {received} bytes{}: {detail}",
        expected.map(|e| format!(" of {e}")).unwrap_or_default())]
    Truncated {
        /// Image name.
        image: String,
        /// The URL, redacted.
        url: String,
        /// Bytes received.
        received: u64,
        /// Content-Length, if given.
        expected: Option<u64>,
        /// The cause chain.
        detail: String,
    },
    /// The body ended cleanly but not at its Content-Length.
    #[error("kvm2.images[{image}]: {url} sent {received} bytes but Content-Length is {declared}")]
    LengthMismatch {
        /// Image name.
        image: String,
        /// The URL, redacted.
        url: String,
        /// Bytes received.
        received: u64,
        /// Content-Length.
        declared: u64,
    },
    /// The content is not the configured image.
    #[error("kvm2.images[{image}]: sha256 of {url} is {actual}, expected {expected}")]
    DigestMismatch {
        /// Image name.
        image: String,
        /// The URL, redacted.
        url: String,
        /// The configured sha256.
        expected: String,
        /// The sha256 of what was received.
        actual: String,
    },
    /// Some other transport failure.
    #[error("kvm2.images[{image}]: request to {url} failed: {detail}")]
    Transport {
        /// Image name.
        image: String,
        /// The URL, redacted.
        url: String,
        /// The cause chain.
        detail: String,
    },
    /// The HTTP client could not be built (bad extra root PEM).
    #[error("kvm2.images[{image}]: cannot set up the HTTP client: {detail}")]
    Client {
        /// Image name.
        image: String,
        /// What went wrong.
        detail: String,
    },
    /// [`ImageDownload::finish`] before the body ended, or a chunk asked for after an
    /// error: a bug in the caller.
    #[error("kvm2.images[{image}]: download of {url} {what}")]
    Misuse {
        /// Image name.
        image: String,
        /// The URL, redacted.
        url: String,
        /// What was misused.
        what: &'static str,
    },
}

fn status_reason(status: u16) -> String {
    reqwest::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .map(|r| format!(" {r}"))
        .unwrap_or_default()
}

fn hop_label(hop: usize, url: &str) -> String {
    if hop == 0 {
        url.to_owned()
    } else {
        format!("redirect hop {hop} to {url}")
    }
}

impl Classified for FetchError {
    fn class(&self) -> ErrorClass {
        match self {
            FetchError::InvalidUrl { .. }
            | FetchError::Refused { .. }
            | FetchError::HostRefused { .. }
            | FetchError::TooLarge { .. }
            | FetchError::Tls { .. }
            | FetchError::DigestMismatch { .. }
            | FetchError::Client { .. }
            | FetchError::Misuse { .. } => ErrorClass::Permanent,
            FetchError::Http { status, .. } => match status {
                408 | 429 => ErrorClass::Transient,
                500..=599 => ErrorClass::Transient,
                _ => ErrorClass::Permanent,
            },
            FetchError::Connect { .. }
            | FetchError::Timeout { .. }
            | FetchError::TooSlow { .. }
            | FetchError::Truncated { .. }
            | FetchError::LengthMismatch { .. }
            | FetchError::Transport { .. } => ErrorClass::Transient,
        }
    }
}

/// The first error of type `T` in the source chain of `err` (looking inside `io::Error`s,
/// whose `source()` skips the error they wrap).
fn find_source<'a, T: StdError + 'static>(err: &'a (dyn StdError + 'static)) -> Option<&'a T> {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(t) = e.downcast_ref::<T>() {
            return Some(t);
        }
        if let Some(inner) = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            && let Some(t) = find_source::<T>(inner)
        {
            return Some(t);
        }
        cur = e.source();
    }
    None
}

/// The messages of `err`'s source chain, joined; reqwest's own URL is stripped first.
fn chain(err: reqwest::Error) -> String {
    let err = err.without_url();
    let mut parts: Vec<String> = Vec::new();
    let mut cur: Option<&(dyn StdError + 'static)> = Some(&err);
    while let Some(e) = cur {
        let msg = e.to_string();
        if !parts.iter().any(|p| p.contains(&msg)) {
            parts.push(msg);
        }
        cur = e.source();
    }
    parts.join(": ")
}

// ---------------------------------------------------------------------------------------
// Download

/// An open download: the response headers were accepted, the body is pulled with
/// [`next_chunk`](Self::next_chunk).
pub struct ImageDownload {
    image: String,
    expected_sha256: String,
    url: String,
    /// `None` once the body ended or failed; dropping it closes the connection.
    response: Option<reqwest::Response>,
    hasher: Sha256,
    received: u64,
    content_length: Option<u64>,
    max_bytes: u64,
    idle_timeout: Duration,
    /// When the whole download must have ended, and how long that was from its start.
    deadline: (tokio::time::Instant, Duration),
    ended: bool,
}

impl fmt::Debug for ImageDownload {
    // By hand: reqwest's Response prints the full URL.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImageDownload")
            .field("image", &self.image)
            .field("url", &self.url)
            .field("received", &self.received)
            .field("content_length", &self.content_length)
            .field("max_bytes", &self.max_bytes)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

fn tls_config(policy: &FetchPolicy) -> Result<rustls::ClientConfig, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;

    // The built-in Mozilla roots, as for plugin downloads: the result does not depend
    // on what CA files the operator image happens to carry.
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(pem) = &policy.extra_root_pem {
        let mut added = 0;
        for cert in CertificateDer::pem_slice_iter(pem) {
            let cert = cert.map_err(|e| format!("extra root PEM: {e}"))?;
            roots
                .add(cert)
                .map_err(|e| format!("extra root PEM: {e}"))?;
            added += 1;
        }
        if added == 0 {
            return Err("extra root PEM holds no certificate".to_owned());
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// The redacted URL of the hop under way, for errors: reqwest's own errors name the
/// configured URL even when a later hop failed.
type CurrentHop = Arc<std::sync::Mutex<String>>;

fn build_client(
    image: &ImageConfig,
    policy: &FetchPolicy,
    current: CurrentHop,
) -> Result<reqwest::Client, FetchError> {
    let client_error = |detail: String| FetchError::Client {
        image: image.name.clone(),
        detail,
    };
    let tls = tls_config(policy).map_err(client_error)?;
    let addresses = AddressPolicy {
        allow_private: image.allow_private_addresses,
        exempt: policy.exempt_addresses.clone().into(),
    };
    let allow_http = image.allow_http;
    let max_redirects = policy.max_redirects;
    let hop_policy = addresses.clone();
    let redirect = reqwest::redirect::Policy::custom(move |attempt| {
        // `previous` holds every URL requested so far, the configured one first.
        let hop = attempt.previous().len();
        let refusal = if hop > max_redirects {
            Err(Refusal::TooManyRedirects { max: max_redirects })
        } else {
            check_url(attempt.url(), allow_http, &hop_policy)
        };
        match refusal {
            Ok(()) => {
                if let Ok(mut hop) = current.lock() {
                    *hop = redact(attempt.url());
                }
                attempt.follow()
            }
            Err(refusal) => {
                let url = redact(attempt.url());
                attempt.error(HopRefused { hop, url, refusal })
            }
        }
    });
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .dns_resolver(PolicyResolver { policy: addresses })
        .redirect(redirect)
        .no_proxy()
        .http1_only()
        .referer(false)
        .retry(reqwest::retry::never())
        .connect_timeout(policy.connect_timeout)
        .read_timeout(policy.idle_timeout)
        .user_agent(concat!("egress-operator/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| client_error(chain(e)))
}

/// Starts downloading `image`: checks the URL, connects, follows allowed redirects and
/// accepts the response headers (status 200, Content-Length within the cap).
pub async fn open(image: &ImageConfig, policy: &FetchPolicy) -> Result<ImageDownload, FetchError> {
    let started = tokio::time::Instant::now();
    let name = image.name.clone();
    let url = Url::parse(&image.url).map_err(|e| FetchError::InvalidUrl {
        image: name.clone(),
        reason: e.to_string(),
    })?;
    let shown = redact(&url);
    let addresses = AddressPolicy {
        allow_private: image.allow_private_addresses,
        exempt: policy.exempt_addresses.clone().into(),
    };
    check_url(&url, image.allow_http, &addresses).map_err(|reason| FetchError::Refused {
        image: name.clone(),
        url: shown.clone(),
        hop: 0,
        reason,
    })?;
    let max_bytes = match image.max_size_mib {
        Some(mib) => mib.saturating_mul(MIB),
        None => policy.default_max_bytes,
    };
    let current: CurrentHop = Arc::new(std::sync::Mutex::new(shown));
    let client = build_client(image, policy, current.clone())?;
    let sent = client.get(url).send().await;
    let response = sent.map_err(|e| {
        let hop = current.lock().map(|h| h.clone()).unwrap_or_default();
        send_error(&name, hop, policy, e)
    })?;
    let final_url = redact(response.url());
    let status = response.status().as_u16();
    if status != 200 {
        return Err(FetchError::Http {
            image: name,
            url: final_url,
            status,
        });
    }
    let content_length = response.content_length();
    if let Some(declared) = content_length
        && declared > max_bytes
    {
        return Err(FetchError::TooLarge {
            image: name,
            url: final_url,
            limit: max_bytes,
            size: declared,
            declared: true,
        });
    }
    // Counted from the request: connecting and waiting for headers use it up too.
    let allowed = download_deadline(policy, content_length.unwrap_or(max_bytes));
    Ok(ImageDownload {
        deadline: (started + allowed, allowed),
        image: name,
        expected_sha256: image.sha256.clone(),
        url: final_url,
        response: Some(response),
        hasher: Sha256::new(),
        received: 0,
        content_length,
        max_bytes,
        idle_timeout: policy.idle_timeout,
        ended: false,
    })
}

/// Maps a failed request; `url` is the (redacted) hop that was under way.
fn send_error(image: &str, url: String, policy: &FetchPolicy, err: reqwest::Error) -> FetchError {
    let image = image.to_owned();
    if let Some(h) = find_source::<HopRefused>(&err) {
        return FetchError::Refused {
            image,
            url: h.url.clone(),
            hop: h.hop,
            reason: h.refusal.clone(),
        };
    }
    if let Some(r) = find_source::<ResolveRefused>(&err) {
        return FetchError::HostRefused {
            image,
            host: r.host.clone(),
            refusal: r.refusal,
        };
    }
    if let Some(rustls::Error::InvalidCertificate(cert)) = find_source::<rustls::Error>(&err) {
        let detail = format!("invalid certificate: {cert:?}");
        return FetchError::Tls { image, url, detail };
    }
    if err.is_timeout() {
        return if err.is_connect() {
            FetchError::Timeout {
                image,
                url,
                stage: "connect",
                after: policy.connect_timeout,
            }
        } else {
            FetchError::Timeout {
                image,
                url,
                stage: "response",
                after: policy.idle_timeout,
            }
        };
    }
    if err.is_connect() {
        return FetchError::Connect {
            image,
            url,
            detail: chain(err),
        };
    }
    FetchError::Transport {
        image,
        url,
        detail: chain(err),
    }
}

impl ImageDownload {
    /// Content-Length, if the server sent one: for the quota check and progress.
    pub fn content_length(&self) -> Option<u64> {
        self.content_length
    }

    /// The URL after redirects, redacted to `scheme://host[:port]/path`.
    pub fn final_url(&self) -> &str {
        &self.url
    }

    /// Bytes received so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// The next piece of the body, or `None` at its end. Each chunk is hashed and counted;
    /// the download stops (the connection is closed) as soon as the cap is passed, after
    /// any error, and after `idle_timeout` without a byte.
    pub async fn next_chunk(&mut self) -> Result<Option<Bytes>, FetchError> {
        let Some(response) = self.response.as_mut() else {
            return if self.ended {
                Ok(None)
            } else {
                Err(self.misuse("was used after it failed"))
            };
        };
        let (deadline, allowed) = self.deadline;
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let wait = self.idle_timeout.min(left);
        let chunk = match tokio::time::timeout(wait, response.chunk()).await {
            Ok(Ok(Some(chunk))) => chunk,
            Ok(Ok(None)) => {
                self.response = None;
                self.ended = true;
                return Ok(None);
            }
            Ok(Err(e)) => {
                self.response = None;
                return Err(self.body_error(e));
            }
            Err(_elapsed) if left <= self.idle_timeout => {
                self.response = None;
                return Err(FetchError::TooSlow {
                    image: self.image.clone(),
                    url: self.url.clone(),
                    received: self.received,
                    expected: self.content_length,
                    after: allowed,
                });
            }
            Err(_elapsed) => {
                self.response = None;
                return Err(self.timeout());
            }
        };
        let total = self.received.saturating_add(chunk.len() as u64);
        if total > self.max_bytes {
            self.response = None;
            return Err(FetchError::TooLarge {
                image: self.image.clone(),
                url: self.url.clone(),
                limit: self.max_bytes,
                size: total,
                declared: false,
            });
        }
        self.hasher.update(&chunk);
        self.received = total;
        Ok(Some(chunk))
    }

    /// Checks, once the body has ended, that it was as long as declared and has the
    /// configured sha256.
    pub fn finish(self) -> Result<Verified, FetchError> {
        if !self.ended {
            return Err(self.misuse("was finished before its body ended"));
        }
        if let Some(declared) = self.content_length
            && declared != self.received
        {
            return Err(FetchError::LengthMismatch {
                image: self.image,
                url: self.url,
                received: self.received,
                declared,
            });
        }
        let actual = hex::encode(self.hasher.finalize());
        if !actual.eq_ignore_ascii_case(&self.expected_sha256) {
            return Err(FetchError::DigestMismatch {
                image: self.image,
                url: self.url,
                expected: self.expected_sha256,
                actual,
            });
        }
        Ok(Verified {
            sha256: actual,
            size: self.received,
        })
    }

    fn misuse(&self, what: &'static str) -> FetchError {
        FetchError::Misuse {
            image: self.image.clone(),
            url: self.url.clone(),
            what,
        }
    }

    fn timeout(&self) -> FetchError {
        FetchError::Timeout {
            image: self.image.clone(),
            url: self.url.clone(),
            stage: "body",
            after: self.idle_timeout,
        }
    }

    fn body_error(&self, err: reqwest::Error) -> FetchError {
        if err.is_timeout() {
            return self.timeout();
        }
        FetchError::Truncated {
            image: self.image.clone(),
            url: self.url.clone(),
            received: self.received,
            expected: self.content_length,
            detail: chain(err),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ImageFormat;
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpListener, TcpStream};
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    use std::thread::JoinHandle;

    /// Length of the `/ok` body.
    const OK_LEN: usize = 300_000;
    /// Length of the endless-looking `/nolength-big` body.
    const BIG_LEN: u64 = 32 * MIB;

    fn body_byte(i: u64) -> u8 {
        (i.wrapping_mul(31).wrapping_add(7) % 251) as u8
    }

    fn ok_body() -> Vec<u8> {
        (0..OK_LEN as u64).map(body_byte).collect()
    }

    fn ok_sha() -> String {
        hex::encode(Sha256::digest(ok_body()))
    }

    /// What the server saw, shared with the test.
    #[derive(Default)]
    struct Stats {
        /// Connections accepted (not counting the wake-up at drop).
        connections: AtomicUsize,
        /// Bytes of `/nolength-big` body written before the client went away.
        streamed: AtomicU64,
        streaming_done: AtomicBool,
    }

    /// A tiny HTTP/1.1 server on 127.0.0.1, one thread per connection, one request per
    /// connection (`Connection: close`), optionally behind TLS.
    struct Server {
        addr: SocketAddr,
        tls: bool,
        stop: Arc<AtomicBool>,
        stats: Arc<Stats>,
        thread: Option<JoinHandle<()>>,
    }

    impl Server {
        fn start(tls: Option<Arc<rustls::ServerConfig>>) -> Server {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let stop = Arc::new(AtomicBool::new(false));
            let stats = Arc::new(Stats::default());
            let is_tls = tls.is_some();
            let (stop2, stats2) = (stop.clone(), stats.clone());
            let thread = std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(tcp) = conn else { continue };
                    stats2.connections.fetch_add(1, Ordering::SeqCst);
                    let (stats, tls) = (stats2.clone(), tls.clone());
                    std::thread::spawn(move || {
                        let _ = tcp.set_read_timeout(Some(Duration::from_secs(5)));
                        let _ = tcp.set_write_timeout(Some(Duration::from_secs(5)));
                        match tls {
                            None => handle(&mut { tcp }, addr, &stats),
                            Some(cfg) => {
                                let Ok(conn) = rustls::ServerConnection::new(cfg) else {
                                    return;
                                };
                                let mut stream = rustls::StreamOwned::new(conn, tcp);
                                handle(&mut stream, addr, &stats);
                                stream.conn.send_close_notify();
                                let _ = stream.flush();
                            }
                        }
                    });
                }
            });
            Server {
                addr,
                tls: is_tls,
                stop,
                stats,
                thread: Some(thread),
            }
        }

        fn url(&self, path: &str) -> String {
            let scheme = if self.tls { "https" } else { "http" };
            format!("{scheme}://127.0.0.1:{}{path}", self.addr.port())
        }

        fn connections(&self) -> usize {
            self.stats.connections.load(Ordering::SeqCst)
        }
    }

    impl Drop for Server {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::SeqCst);
            let _ = TcpStream::connect(self.addr);
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }

    fn read_head(s: &mut impl Read) -> Option<String> {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if head.len() > 16 * 1024 || s.read(&mut byte).ok()? == 0 {
                return None;
            }
            head.push(byte[0]);
        }
        let head = String::from_utf8(head).ok()?;
        let path = head.split(' ').nth(1)?;
        Some(path.to_owned())
    }

    fn send_body(
        s: &mut impl Write,
        len: u64,
        mut on_written: impl FnMut(u64),
    ) -> std::io::Result<()> {
        let mut sent = 0u64;
        let mut buf = vec![0u8; 64 * 1024];
        while sent < len {
            let n = (len - sent).min(buf.len() as u64) as usize;
            for (k, b) in buf[..n].iter_mut().enumerate() {
                *b = body_byte(sent + k as u64);
            }
            s.write_all(&buf[..n])?;
            sent += n as u64;
            on_written(sent);
        }
        s.flush()
    }

    fn redirect(s: &mut impl Write, location: &str) -> std::io::Result<()> {
        write!(
            s,
            "HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )?;
        s.flush()
    }

    fn status(s: &mut impl Write, code: u16) -> std::io::Result<()> {
        write!(
            s,
            "HTTP/1.1 {code} X\r\nContent-Length: 4\r\nConnection: close\r\n\r\nnope"
        )?;
        s.flush()
    }

    fn ok_head(s: &mut impl Write, len: Option<u64>) -> std::io::Result<()> {
        match len {
            Some(len) => write!(
                s,
                "HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
            )?,
            None => write!(s, "HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")?,
        }
        Ok(())
    }

    fn handle<S: Read + Write>(s: &mut S, addr: SocketAddr, stats: &Stats) {
        let Some(path) = read_head(s) else {
            return;
        };
        let port = addr.port();
        let path = path.split('?').next().unwrap_or("").to_owned();
        let _ = match path.as_str() {
            "/ok" => {
                ok_head(s, Some(OK_LEN as u64)).and_then(|()| send_body(s, OK_LEN as u64, |_| {}))
            }
            "/nolength" => ok_head(s, None).and_then(|()| send_body(s, OK_LEN as u64, |_| {})),
            "/nolength-big" => {
                let r = ok_head(s, None).and_then(|()| {
                    send_body(s, BIG_LEN, |n| stats.streamed.store(n, Ordering::SeqCst))
                });
                stats.streaming_done.store(true, Ordering::SeqCst);
                r
            }
            // Declares more than it sends, then closes.
            "/truncated" => ok_head(s, Some(OK_LEN as u64))
                .and_then(|()| send_body(s, OK_LEN as u64 / 2, |_| {})),
            "/declared-big" => {
                ok_head(s, Some(2 * MIB)).and_then(|()| send_body(s, 2 * MIB, |_| {}))
            }
            // Headers and a little body, then silence.
            "/stall" => ok_head(s, Some(OK_LEN as u64)).and_then(|()| {
                send_body(s, 1000, |_| {})?;
                std::thread::sleep(Duration::from_secs(2));
                Ok(())
            }),
            // Never idle for long, never done soon: 100 bytes every 50 ms.
            "/trickle" => ok_head(s, Some(OK_LEN as u64)).and_then(|()| {
                for _ in 0..100 {
                    s.write_all(&[7u8; 100])?;
                    s.flush()?;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Ok(())
            }),
            "/to-metadata" => redirect(s, "http://169.254.169.254/latest/meta-data/"),
            "/to-private" => redirect(s, "http://10.0.0.1/image.qcow2"),
            "/to-mapped-private" => redirect(s, "http://[::ffff:10.0.0.1]/image.qcow2"),
            "/to-loopback2" => redirect(s, &format!("http://127.0.0.2:{port}/ok")),
            "/to-closed" => {
                // A port that was just free: nothing listens there.
                let closed = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr());
                let port = closed.map(|a| a.port()).unwrap_or(1);
                redirect(s, &format!("http://127.0.0.1:{port}/gone"))
            }
            "/to-http" => redirect(s, &format!("http://127.0.0.1:{port}/ok")),
            "/404" => status(s, 404),
            "/429" => status(s, 429),
            "/500" => status(s, 500),
            p if p.starts_with("/redirect/") => match p["/redirect/".len()..].parse::<u32>() {
                Ok(0) => redirect(s, "/ok"),
                Ok(n) => redirect(s, &format!("/redirect/{}", n - 1)),
                Err(_) => status(s, 400),
            },
            _ => status(s, 404),
        };
    }

    fn image(url: &str) -> ImageConfig {
        ImageConfig {
            name: "test-img".to_owned(),
            url: url.to_owned(),
            sha256: ok_sha(),
            format: ImageFormat::Qcow2,
            max_size_mib: None,
            allow_http: true,
            allow_private_addresses: true,
        }
    }

    fn policy() -> FetchPolicy {
        FetchPolicy {
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(5),
            ..FetchPolicy::default()
        }
    }

    /// Production address policy for everything except the test server's 127.0.0.1.
    fn strict_policy() -> FetchPolicy {
        FetchPolicy {
            exempt_addresses: vec![IpAddr::V4(Ipv4Addr::LOCALHOST)],
            ..policy()
        }
    }

    fn strict(url: &str) -> ImageConfig {
        ImageConfig {
            allow_private_addresses: false,
            ..image(url)
        }
    }

    /// Reads the whole body and verifies it.
    async fn download(image: &ImageConfig, policy: &FetchPolicy) -> Result<Verified, FetchError> {
        let mut d = open(image, policy).await?;
        while d.next_chunk().await?.is_some() {}
        d.finish()
    }

    #[tokio::test]
    async fn happy_path_hash_ok() {
        let srv = Server::start(None);
        let img = image(&srv.url("/ok"));
        let mut d = open(&img, &policy()).await.unwrap();
        assert_eq!(d.content_length(), Some(OK_LEN as u64));
        assert_eq!(d.final_url(), srv.url("/ok"));
        while d.next_chunk().await.unwrap().is_some() {}
        assert_eq!(d.received(), OK_LEN as u64);
        let v = d.finish().unwrap();
        assert_eq!(
            v,
            Verified {
                sha256: ok_sha(),
                size: OK_LEN as u64
            }
        );
    }

    #[tokio::test]
    async fn redirect_to_other_loopback_refused_before_connecting() {
        let srv = Server::start(None);
        let err = download(&strict(&srv.url("/to-loopback2")), &strict_policy())
            .await
            .unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, FetchError::Refused { hop: 1, .. }), "{msg}");
        assert!(
            msg.contains("127.0.0.2") && msg.contains("loopback"),
            "{msg}"
        );
        assert_eq!(srv.connections(), 1);
    }

    /// An https test server with a fresh self-signed certificate for 127.0.0.1, and that
    /// certificate as PEM for [`FetchPolicy::extra_root_pem`].
    fn tls_server() -> (Server, Vec<u8>) {
        use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
        let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()));
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![ck.cert.der().clone()], key)
            .unwrap();
        (
            Server::start(Some(Arc::new(cfg))),
            ck.cert.pem().into_bytes(),
        )
    }

    #[tokio::test]
    async fn happy_path_without_content_length() {
        let srv = Server::start(None);
        let mut d = open(&image(&srv.url("/nolength")), &policy())
            .await
            .unwrap();
        assert_eq!(d.content_length(), None);
        while d.next_chunk().await.unwrap().is_some() {}
        assert_eq!(d.finish().unwrap().size, OK_LEN as u64);
    }

    #[tokio::test]
    async fn https_with_extra_root_and_no_allow_http() {
        let (srv, pem) = tls_server();
        let img = ImageConfig {
            allow_http: false,
            ..image(&srv.url("/ok"))
        };
        let pol = FetchPolicy {
            extra_root_pem: Some(pem),
            ..policy()
        };
        let v = download(&img, &pol).await.unwrap();
        assert_eq!(v.sha256, ok_sha());
    }

    #[tokio::test]
    async fn https_untrusted_certificate_is_permanent() {
        let (srv, _pem) = tls_server();
        let err = download(&image(&srv.url("/ok")), &policy())
            .await
            .unwrap_err();
        assert!(matches!(err, FetchError::Tls { .. }), "{err}");
        assert_eq!(err.class(), ErrorClass::Permanent);
    }

    #[tokio::test]
    async fn loopback_literal_refused_without_allow_private() {
        let srv = Server::start(None);
        let err = download(&strict(&srv.url("/ok")), &policy())
            .await
            .unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, FetchError::Refused { hop: 0, .. }), "{msg}");
        assert!(msg.contains("kvm2.images[test-img]"), "{msg}");
        assert!(
            msg.contains("127.0.0.1") && msg.contains("loopback"),
            "{msg}"
        );
        assert_eq!(err.class(), ErrorClass::Permanent);
        assert_eq!(srv.connections(), 0);
    }

    #[tokio::test]
    async fn loopback_name_refused_by_resolver() {
        let srv = Server::start(None);
        let url = format!("http://localhost:{}/ok", srv.addr.port());
        let err = download(&strict(&url), &policy()).await.unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, FetchError::HostRefused { .. }), "{msg}");
        assert!(
            msg.contains("host localhost") && msg.contains("loopback"),
            "{msg}"
        );
        assert_eq!(err.class(), ErrorClass::Permanent);
        assert_eq!(srv.connections(), 0);
    }

    #[tokio::test]
    async fn loopback_name_allowed_with_allow_private() {
        let srv = Server::start(None);
        let url = format!("http://localhost:{}/ok", srv.addr.port());
        let v = download(&image(&url), &policy()).await.unwrap();
        assert_eq!(v.size, OK_LEN as u64);
    }

    #[tokio::test]
    async fn sha256_mismatch_is_permanent() {
        let srv = Server::start(None);
        let wrong = "0".repeat(64);
        let img = ImageConfig {
            sha256: wrong.clone(),
            ..image(&srv.url("/ok"))
        };
        let err = download(&img, &policy()).await.unwrap_err();
        match &err {
            FetchError::DigestMismatch {
                expected, actual, ..
            } => {
                assert_eq!(expected, &wrong);
                assert_eq!(actual, &ok_sha());
            }
            other => panic!("{other}"),
        }
        assert_eq!(err.class(), ErrorClass::Permanent);
    }

    #[tokio::test]
    async fn truncated_body_is_transient() {
        let srv = Server::start(None);
        let mut d = open(&image(&srv.url("/truncated")), &policy())
            .await
            .unwrap();
        let err = loop {
            match d.next_chunk().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("truncated body ended cleanly after {} bytes", d.received()),
                Err(e) => break e,
            }
        };
        assert!(
            matches!(err, FetchError::Truncated { expected: Some(e), .. } if e == OK_LEN as u64),
            "{err}"
        );
        assert!(d.received() < OK_LEN as u64);
        assert_eq!(err.class(), ErrorClass::Transient);
    }

    #[test]
    fn length_mismatch_at_finish_is_transient() {
        let d = ImageDownload {
            image: "x".to_owned(),
            expected_sha256: String::new(),
            url: "http://h/p".to_owned(),
            response: None,
            hasher: Sha256::new(),
            received: 5,
            content_length: Some(10),
            max_bytes: 100,
            idle_timeout: Duration::from_secs(1),
            deadline: (tokio::time::Instant::now(), Duration::from_secs(1)),
            ended: true,
        };
        let err = d.finish().unwrap_err();
        assert!(
            matches!(
                err,
                FetchError::LengthMismatch {
                    received: 5,
                    declared: 10,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(err.class(), ErrorClass::Transient);
    }

    #[tokio::test]
    async fn finish_before_end_is_refused() {
        let srv = Server::start(None);
        let mut d = open(&image(&srv.url("/ok")), &policy()).await.unwrap();
        assert!(d.next_chunk().await.unwrap().is_some());
        let err = d.finish().unwrap_err();
        assert!(matches!(err, FetchError::Misuse { .. }), "{err}");
    }

    #[tokio::test]
    async fn too_large_by_content_length() {
        let srv = Server::start(None);
        let img = ImageConfig {
            max_size_mib: Some(1),
            ..image(&srv.url("/declared-big"))
        };
        let err = open(&img, &policy()).await.unwrap_err();
        assert!(
            matches!(err, FetchError::TooLarge { limit, size, declared: true, .. } if limit == MIB && size == 2 * MIB),
            "{err}"
        );
        assert_eq!(err.class(), ErrorClass::Permanent);
    }

    #[tokio::test]
    async fn too_large_while_streaming_stops_early() {
        let srv = Server::start(None);
        let img = ImageConfig {
            max_size_mib: Some(1),
            ..image(&srv.url("/nolength-big"))
        };
        let mut d = open(&img, &policy()).await.unwrap();
        let err = loop {
            match d.next_chunk().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("capped body ended cleanly after {} bytes", d.received()),
                Err(e) => break e,
            }
        };
        assert!(
            matches!(err, FetchError::TooLarge { limit, declared: false, .. } if limit == MIB),
            "{err}"
        );
        assert_eq!(err.class(), ErrorClass::Permanent);
        assert!(d.received() <= MIB);
        // The connection was closed: the server's writes fail long before the whole body.
        for _ in 0..200 {
            if srv.stats.streaming_done.load(Ordering::SeqCst) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(srv.stats.streaming_done.load(Ordering::SeqCst));
        let streamed = srv.stats.streamed.load(Ordering::SeqCst);
        assert!(
            streamed < BIG_LEN / 2,
            "server wrote {streamed} of {BIG_LEN} bytes"
        );
    }

    #[tokio::test]
    async fn redirects_within_limit_are_followed() {
        let srv = Server::start(None);
        let mut d = open(&image(&srv.url("/redirect/2")), &policy())
            .await
            .unwrap();
        // /redirect/2 -> /redirect/1 -> /redirect/0 -> /ok: three hops, the limit.
        assert_eq!(d.final_url(), srv.url("/ok"));
        while d.next_chunk().await.unwrap().is_some() {}
        d.finish().unwrap();
    }

    #[tokio::test]
    async fn too_many_redirects() {
        let srv = Server::start(None);
        let err = download(&image(&srv.url("/redirect/3")), &policy())
            .await
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(
                err,
                FetchError::Refused {
                    hop: 4,
                    reason: Refusal::TooManyRedirects { max: 3 },
                    ..
                }
            ),
            "{msg}"
        );
        assert!(msg.contains("redirect hop 4"), "{msg}");
        assert_eq!(err.class(), ErrorClass::Permanent);
        assert_eq!(srv.connections(), 4);
    }

    #[tokio::test]
    async fn redirect_to_metadata_refused_even_with_allow_private() {
        let srv = Server::start(None);
        let err = download(&image(&srv.url("/to-metadata")), &policy())
            .await
            .unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, FetchError::Refused { hop: 1, .. }), "{msg}");
        assert!(
            msg.contains("redirect hop 1 to http://169.254.169.254/latest/meta-data/"),
            "{msg}"
        );
        assert!(
            msg.contains("cloud metadata") && msg.contains("refused even with"),
            "{msg}"
        );
        assert_eq!(err.class(), ErrorClass::Permanent);
        assert_eq!(srv.connections(), 1);
    }

    #[tokio::test]
    async fn redirect_to_private_refused() {
        let srv = Server::start(None);
        for (path, needle) in [
            ("/to-private", "10.0.0.1 is in the private range 10.0.0.0/8"),
            (
                "/to-mapped-private",
                "::ffff:10.0.0.1 is the IPv4-mapped form of 10.0.0.1, in the private range 10.0.0.0/8",
            ),
        ] {
            let err = download(&strict(&srv.url(path)), &strict_policy())
                .await
                .unwrap_err();
            let msg = err.to_string();
            assert!(matches!(err, FetchError::Refused { hop: 1, .. }), "{msg}");
            assert!(msg.contains(needle), "{msg}");
            assert_eq!(err.class(), ErrorClass::Permanent);
        }
        assert_eq!(srv.connections(), 2);
    }

    #[tokio::test]
    async fn http_url_refused_without_allow_http() {
        let srv = Server::start(None);
        let img = ImageConfig {
            allow_http: false,
            ..image(&srv.url("/ok"))
        };
        let err = download(&img, &policy()).await.unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(
                err,
                FetchError::Refused {
                    hop: 0,
                    reason: Refusal::Scheme { .. },
                    ..
                }
            ),
            "{msg}"
        );
        assert!(msg.contains("allowHttp"), "{msg}");
        assert_eq!(srv.connections(), 0);
    }

    #[tokio::test]
    async fn https_to_http_redirect_refused_without_allow_http() {
        let (srv, pem) = tls_server();
        let img = ImageConfig {
            allow_http: false,
            ..image(&srv.url("/to-http"))
        };
        let pol = FetchPolicy {
            extra_root_pem: Some(pem),
            ..policy()
        };
        let err = download(&img, &pol).await.unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(
                err,
                FetchError::Refused {
                    hop: 1,
                    reason: Refusal::Scheme { .. },
                    ..
                }
            ),
            "{msg}"
        );
        assert!(msg.contains("plain http"), "{msg}");
        assert_eq!(srv.connections(), 1);
    }

    #[tokio::test]
    async fn http_status_classes() {
        let srv = Server::start(None);
        for (path, code, class) in [
            ("/404", 404, ErrorClass::Permanent),
            ("/429", 429, ErrorClass::Transient),
            ("/500", 500, ErrorClass::Transient),
        ] {
            let err = download(&image(&srv.url(path)), &policy())
                .await
                .unwrap_err();
            assert!(
                matches!(err, FetchError::Http { status, .. } if status == code),
                "{err}"
            );
            assert_eq!(err.class(), class, "{err}");
        }
    }

    /// A body that keeps arriving, never idle for the idle timeout, but too slowly to end
    /// within the download's deadline: `TooSlow`, transient, naming the bytes received,
    /// not an idle timeout.
    #[tokio::test]
    async fn a_trickling_body_fails_at_the_download_deadline() {
        let srv = Server::start(None);
        let pol = FetchPolicy {
            idle_timeout: Duration::from_secs(5),
            min_download_deadline: Duration::from_millis(400),
            min_bytes_per_sec: u64::MAX,
            ..policy()
        };
        let mut d = open(&image(&srv.url("/trickle")), &pol).await.unwrap();
        let err = loop {
            match d.next_chunk().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("the trickle ended before the deadline"),
                Err(e) => break e,
            }
        };
        assert!(
            matches!(&err, FetchError::TooSlow { received, expected: Some(e), after, .. }
                if *received > 0 && *received < *e && *after == Duration::from_millis(400)),
            "{err:?}"
        );
        assert_eq!(err.class(), ErrorClass::Transient);
        assert!(err.to_string().contains("too slow"), "{err}");
    }

    #[test]
    fn download_deadline_grows_with_size_above_the_floor() {
        let pol = FetchPolicy::default();
        assert_eq!(download_deadline(&pol, 0), Duration::from_secs(600));
        assert_eq!(
            download_deadline(&pol, 4096 * MIB),
            Duration::from_secs(4096)
        );
        let zero_rate = FetchPolicy {
            min_bytes_per_sec: 0,
            ..FetchPolicy::default()
        };
        assert_eq!(download_deadline(&zero_rate, 10), Duration::from_secs(600));
    }

    #[tokio::test]
    async fn stalled_body_times_out_as_transient() {
        let srv = Server::start(None);
        let pol = FetchPolicy {
            idle_timeout: Duration::from_millis(300),
            ..policy()
        };
        let mut d = open(&image(&srv.url("/stall")), &pol).await.unwrap();
        let err = loop {
            match d.next_chunk().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("stalled body ended cleanly"),
                Err(e) => break e,
            }
        };
        assert!(
            matches!(err, FetchError::Timeout { stage: "body", .. }),
            "{err}"
        );
        assert_eq!(err.class(), ErrorClass::Transient);
    }

    #[tokio::test]
    async fn credentials_and_query_never_printed() {
        let srv = Server::start(None);
        let url = format!(
            "http://user:hunter2@127.0.0.1:{}/404?token=SECRETTOKEN",
            srv.addr.port()
        );
        let refused = download(&strict(&url), &policy()).await.unwrap_err();
        let http = download(&image(&url), &policy()).await.unwrap_err();
        for err in [refused, http] {
            for text in [err.to_string(), format!("{err:?}")] {
                assert!(
                    !text.contains("hunter2") && !text.contains("SECRETTOKEN"),
                    "{text}"
                );
                assert!(text.contains("http://127.0.0.1:"), "{text}");
            }
        }
    }

    #[test]
    fn redact_keeps_scheme_host_port_path() {
        let url = Url::parse("https://u:p@Example.COM:8443/a/b.qcow2?sig=x#f").unwrap();
        assert_eq!(redact(&url), "https://example.com:8443/a/b.qcow2");
        let url = Url::parse("http://[::1]:80/x").unwrap();
        assert_eq!(redact(&url), "http://[::1]/x");
    }

    #[test]
    fn url_checks() {
        let lax = AddressPolicy {
            allow_private: true,
            exempt: Arc::new([]),
        };
        let check = |u: &str, allow_http| check_url(&Url::parse(u).unwrap(), allow_http, &lax);
        assert_eq!(check("https://example.com/x", false), Ok(()));
        assert_eq!(check("http://example.com/x", true), Ok(()));
        assert_eq!(
            check("http://example.com/x", false),
            Err(Refusal::Scheme {
                scheme: "http".into()
            })
        );
        assert_eq!(
            check("ftp://example.com/x", true),
            Err(Refusal::Scheme {
                scheme: "ftp".into()
            })
        );
        assert_eq!(
            check("file:///etc/passwd", true),
            Err(Refusal::Scheme {
                scheme: "file".into()
            })
        );
        // WHATWG parsing turns odd IPv4 spellings into literals, which are then checked.
        assert!(matches!(check("http://0x7f.1/x", true), Ok(())));
        assert!(matches!(
            check("http://0xa9.254.169.254/x", true),
            Err(Refusal::Address(_))
        ));
        assert!(matches!(
            check("http://2852039166/x", true),
            Err(Refusal::Address(_))
        ));
    }

    #[test]
    fn address_policy() {
        let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let lax = AddressPolicy {
            allow_private: true,
            exempt: Arc::new([]),
        };
        assert!(lax.check(ip("10.0.0.1")).is_ok());
        assert!(lax.check(ip("::1")).is_ok());
        assert!(lax.check(ip("169.254.169.254")).is_err());
        assert!(lax.check(ip("::ffff:169.254.169.254")).is_err());
        assert!(lax.check(ip("fd00:ec2::254")).is_err());
        assert!(lax.check(ip("224.0.0.1")).is_err());
        let strict = AddressPolicy {
            allow_private: false,
            exempt: Arc::new([lo]),
        };
        assert!(strict.check(lo).is_ok());
        assert!(strict.check(ip("::ffff:127.0.0.1")).is_ok());
        assert!(strict.check(ip("127.0.0.2")).is_err());
        assert!(strict.check(ip("::1")).is_err());
        assert!(strict.check(ip("8.8.8.8")).is_ok());
        let exempt_meta = AddressPolicy {
            allow_private: false,
            exempt: Arc::new([ip("169.254.169.254")]),
        };
        assert!(exempt_meta.check(ip("169.254.169.254")).is_err());
    }

    #[test]
    fn classifier_table() {
        // (address, expected range name or None for public, always refused, embedded form)
        let cases: &[(&str, Option<&str>, bool, Option<&str>)] = &[
            ("8.8.8.8", None, false, None),
            ("1.1.1.1", None, false, None),
            ("151.101.1.69", None, false, None),
            ("127.0.0.1", Some("loopback"), false, None),
            ("127.255.255.254", Some("loopback"), false, None),
            ("10.0.0.1", Some("private"), false, None),
            ("10.255.255.255", Some("private"), false, None),
            ("172.16.0.1", Some("private"), false, None),
            ("172.31.255.255", Some("private"), false, None),
            ("172.15.255.255", None, false, None),
            ("172.32.0.1", None, false, None),
            ("192.168.1.1", Some("private"), false, None),
            ("192.169.0.1", None, false, None),
            ("100.64.0.1", Some("CGNAT shared address"), false, None),
            ("100.127.255.255", Some("CGNAT shared address"), false, None),
            ("100.63.255.255", None, false, None),
            ("100.128.0.1", None, false, None),
            ("169.254.1.1", Some("link-local"), false, None),
            ("169.254.169.254", Some(METADATA), true, None),
            ("169.254.170.2", Some(METADATA), true, None),
            ("100.100.100.200", Some(METADATA), true, None),
            ("192.0.0.192", Some(METADATA), true, None),
            ("0.0.0.0", Some("unspecified"), true, None),
            ("0.1.2.3", Some("unspecified"), true, None),
            ("255.255.255.255", Some("broadcast"), true, None),
            ("224.0.0.1", Some("multicast"), true, None),
            ("239.255.255.250", Some("multicast"), true, None),
            ("240.0.0.1", Some("reserved"), false, None),
            ("192.0.0.8", Some("IETF protocol assignment"), false, None),
            ("192.0.2.1", Some("documentation"), false, None),
            ("198.51.100.7", Some("documentation"), false, None),
            ("203.0.113.9", Some("documentation"), false, None),
            ("198.18.0.1", Some("benchmarking"), false, None),
            ("198.19.255.255", Some("benchmarking"), false, None),
            ("198.20.0.1", None, false, None),
            ("2606:4700::1111", None, false, None),
            ("2a00:1450:4001::1", None, false, None),
            ("::", Some("unspecified"), true, None),
            ("::1", Some("loopback"), false, None),
            ("fe80::1", Some("link-local"), false, None),
            ("febf::1", Some("link-local"), false, None),
            ("fec0::1", Some("site-local (deprecated)"), false, None),
            ("fc00::1", Some("unique local (private)"), false, None),
            ("fd12:3456::1", Some("unique local (private)"), false, None),
            ("fd00:ec2::254", Some(METADATA), true, None),
            ("fd00:ec2::23", Some(METADATA), true, None),
            ("ff02::1", Some("multicast"), true, None),
            ("2001:db8::1", Some("documentation"), false, None),
            ("3fff::1", Some("documentation"), false, None),
            ("2001::1", Some("Teredo"), false, None),
            ("2001:2::1", Some("benchmarking"), false, None),
            ("100::1", Some("discard-only"), false, None),
            ("64:ff9b:1::1", Some("NAT64 local-use"), false, None),
            (
                "::ffff:127.0.0.1",
                Some("loopback"),
                false,
                Some("IPv4-mapped"),
            ),
            (
                "::ffff:10.0.0.1",
                Some("private"),
                false,
                Some("IPv4-mapped"),
            ),
            (
                "::ffff:169.254.169.254",
                Some(METADATA),
                true,
                Some("IPv4-mapped"),
            ),
            (
                "::ffff:100.100.100.200",
                Some(METADATA),
                true,
                Some("IPv4-mapped"),
            ),
            (
                "::ffff:0.0.0.0",
                Some("unspecified"),
                true,
                Some("IPv4-mapped"),
            ),
            ("::ffff:8.8.8.8", None, false, None),
            (
                "::ffff:0:192.168.0.1",
                Some("private"),
                false,
                Some("IPv4-translated"),
            ),
            ("64:ff9b::10.0.0.1", Some("private"), false, Some("NAT64")),
            ("64:ff9b::8.8.8.8", None, false, None),
            ("2002:a00:1::1", Some("private"), false, Some("6to4")),
            ("2002:a9fe:a9fe::", Some(METADATA), true, Some("6to4")),
            ("2002:808:808::1", None, false, None),
            (
                "::127.0.0.1",
                Some("loopback"),
                false,
                Some("IPv4-compatible"),
            ),
            (
                "::8.8.8.8",
                Some("IPv4-compatible (deprecated)"),
                false,
                None,
            ),
        ];
        for &(addr, name, always, form) in cases {
            let ip: IpAddr = addr.parse().unwrap();
            let got = classify(ip);
            assert_eq!(got.map(|s| s.range.name), name, "{addr}");
            if let Some(s) = got {
                assert_eq!(s.range.always, always, "{addr}");
                assert_eq!(s.embedded.map(|(f, _)| f), form, "{addr}");
            }
        }
    }

    #[tokio::test]
    async fn connection_refused_is_transient_and_names_the_hop() {
        let srv = Server::start(None);
        let err = download(&image(&srv.url("/to-closed")), &policy())
            .await
            .unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, FetchError::Connect { .. }), "{msg}");
        assert!(msg.contains("/gone"), "{msg}");
        assert_eq!(err.class(), ErrorClass::Transient);
    }
}
