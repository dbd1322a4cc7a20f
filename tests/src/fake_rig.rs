//! The shared setup of the test binaries that drive the kvm2 provider over the in-memory
//! fake hosts (`FakeOps`): a providers config whose hosts are never dialled, the default
//! plugins compiled once per binary, a provider with short waits, and a small qcow2 image
//! for a loopback `HttpServer` to serve.
//!
//! One copy, so the binaries agree on what "the fake rig" is and a change to the config
//! schema or the plugins is made once. What only one binary needs (an address pool, a
//! longer image wait, a clock) stays in that binary, on top of these.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test rig: failures are test failures

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use egress_operator::config::{self, ValidConfig};
use egress_operator::provider::kvm2::backend::{Kvm2Options, Kvm2Provider};
use egress_operator::provider::kvm2::image::{ImageCacheOptions, ImageMetrics, qcow2};
use egress_operator::provider::kvm2::ops::HostOps;
use egress_operator::templates::TemplateSet;

use crate::plugin_path;

/// The vendor-data plugin's settings unless a test sets others: the proxy port and the
/// clients it admits.
pub const DEFAULT_VENDOR_SETTINGS: &str = "{listenPort: 3128, allowedClientCidrs: [10.0.0.0/8]}";

/// A providers config for the fake hosts: ssh keys at `/nonexistent` (nothing dials), hosts
/// on `127.0.0.1:N` (pool `default`, bridge `br0`), one qcow2 image `base` served from
/// loopback (so `allowHttp` and `allowPrivateAddresses`), one machine type `small`
/// (1 vCPU, 128 MiB, 1 GiB disk unless set), both defaults, and the default plugins built
/// by `make plugins`.
///
/// ```no_run
/// # use integration_tests::fake_rig::FakeConfig;
/// # let sha = "a".repeat(64);
/// let config = FakeConfig::new("http://127.0.0.1:1/img", &sha)
///     .host("h1", "maxDomains: 32")
///     .host("h2", "")
///     .name("provider-logic-config")
///     .build();
/// ```
#[derive(Debug, Clone)]
pub struct FakeConfig {
    url: String,
    sha: String,
    /// (name, extra flow-mapping entries), in order; the N-th host dials `127.0.0.1:N`.
    hosts: Vec<(String, String)>,
    disk_gib: u32,
    vendor_settings: String,
    name: String,
}

impl FakeConfig {
    /// Image `base` at `url` with sha256 `sha`, and one host `h1` with no extras.
    pub fn new(url: &str, sha: &str) -> Self {
        Self {
            url: url.into(),
            sha: sha.into(),
            hosts: vec![("h1".into(), String::new())],
            disk_gib: 1,
            vendor_settings: DEFAULT_VENDOR_SETTINGS.into(),
            name: "fake-config".into(),
        }
    }

    /// Host `name` with `extras` (YAML flow-mapping entries such as `maxDomains: 4` or an
    /// `addressPool: {...}` fragment, empty for none): replaces the extras of a host of
    /// that name, or adds it after the others (at the next `127.0.0.1:N`).
    pub fn host(mut self, name: &str, extras: &str) -> Self {
        match self.hosts.iter_mut().find(|(n, _)| n == name) {
            Some(host) => host.1 = extras.into(),
            None => self.hosts.push((name.into(), extras.into())),
        }
        self
    }

    /// The disk of machine type `small`, in GiB (1 unless set).
    pub fn disk_gib(mut self, gib: u32) -> Self {
        self.disk_gib = gib;
        self
    }

    /// The vendor-data plugin's `settings`, a YAML flow mapping
    /// ([`DEFAULT_VENDOR_SETTINGS`] unless set).
    pub fn vendor_settings(mut self, settings: &str) -> Self {
        self.vendor_settings = settings.into();
        self
    }

    /// The config's name, as parse errors show it.
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.into();
        self
    }

    /// The YAML text [`FakeConfig::build`] parses.
    pub fn yaml(&self) -> String {
        let mut hosts = String::new();
        for (i, (name, extras)) in self.hosts.iter().enumerate() {
            let extras = if extras.is_empty() {
                String::new()
            } else {
                format!(", {extras}")
            };
            hosts.push_str(&format!(
                "    - {{name: {name}, address: \"127.0.0.1:{port}\", storagePool: default, \
                 bridge: br0{extras}}}\n",
                port = i + 1,
            ));
        }
        format!(
            r#"
clusterId: test
kvm2:
  ssh:
    user: egress
    privateKeyFile: /nonexistent/id_ed25519
    knownHostsFile: /nonexistent/known_hosts
  hosts:
{hosts}  images:
    - {{name: base, url: "{url}", sha256: "{sha}", format: qcow2, allowHttp: true, allowPrivateAddresses: true}}
  machineTypes:
    - {{name: small, vcpus: 1, memoryMiB: 128, diskGiB: {disk}}}
  defaults: {{machineType: small, image: base}}
  templates:
    domain: {{path: {domain}}}
    vendorData:
      path: {vendor}
      settings: {settings}
"#,
            url = self.url,
            sha = self.sha,
            disk = self.disk_gib,
            settings = self.vendor_settings,
            domain = plugin_path("domain-default").unwrap().display(),
            vendor = plugin_path("vendor-data-default").unwrap().display(),
        )
    }

    /// The parsed, validated config; panics (fails the test) if it does not validate.
    pub fn build(&self) -> Arc<ValidConfig> {
        let yaml = self.yaml();
        Arc::new(
            config::parse(&yaml, &self.name, std::path::Path::new("/"))
                .unwrap_or_else(|e| panic!("{}: {e}\n{yaml}", self.name)),
        )
    }
}

/// The default plugins [`FakeConfig`] names, compiled and checked healthy once per test
/// binary (compiling them is the slow part of a provider).
pub fn default_templates() -> Arc<TemplateSet> {
    static SET: OnceLock<Arc<TemplateSet>> = OnceLock::new();
    SET.get_or_init(|| {
        let config = FakeConfig::new("http://127.0.0.1:1/img", &"a".repeat(64)).build();
        crate::load_templates(&config.kvm2.templates).unwrap()
    })
    .clone()
}

/// Provider options with short waits, so the fake's instant operations are not slowed by
/// production poll intervals: images polled every 20 ms, domains every 10 ms, a start
/// given 2 s and a shutdown 1 s. Everything else is the default; a binary that needs more
/// (a shorter takeover, a bounded image wait, a health board, a clock) sets it on top.
pub fn fast_options() -> Kvm2Options {
    Kvm2Options {
        images: ImageCacheOptions {
            poll_every: Duration::from_millis(20),
            ..ImageCacheOptions::default()
        },
        start_timeout: Duration::from_secs(2),
        shutdown_timeout: Duration::from_secs(1),
        poll_every: Duration::from_millis(10),
        ..Kvm2Options::default()
    }
}

/// A provider over `ops` with `options` and the [`default_templates`].
pub fn provider_with(
    config: &Arc<ValidConfig>,
    ops: Arc<dyn HostOps>,
    options: Kvm2Options,
) -> Kvm2Provider {
    Kvm2Provider::new(
        config.clone(),
        ops,
        default_templates(),
        options,
        ImageMetrics::default(),
    )
}

/// A provider over `ops` with the [`fast_options`] and the [`default_templates`].
pub fn provider(config: &Arc<ValidConfig>, ops: Arc<dyn HostOps>) -> Kvm2Provider {
    provider_with(config, ops, fast_options())
}

/// An image for the server to send: a qcow2 version 3 header (64 KiB clusters) naming
/// `virtual_size` bytes, padded to 512, then `filler` bytes not all alike (so the sha256
/// and any truncation are real).
pub fn test_image(virtual_size: u64, filler: u32) -> Arc<Vec<u8>> {
    let mut b = qcow2::test_header(3, virtual_size, 512);
    b.extend((0..filler).map(|i| (i * 7 % 251) as u8));
    Arc::new(b)
}
