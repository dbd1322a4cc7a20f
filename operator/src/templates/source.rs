//! Where component bytes come from: a local file, or an https URL with a mandatory sha256.
//!
//! Downloads are https only, every redirect hop included (at most [`MAX_REDIRECTS`]),
//! bounded in size and time, and never compiled before their sha256 matches the config.
//! When the compiled-code cache already holds code for that sha256, the download is
//! skipped entirely: the digest is what the config pins, not the URL.

use std::path::Path;
use std::time::Duration;

use super::MAX_COMPONENT_BYTES;
use super::errors::TemplateErrorKind;

/// A component is a few hundred KB; a minute covers slow links without hanging a load.
pub const DOWNLOAD_TIMEOUT: Duration = Duration::from_secs(60);
/// Enough for a CDN or a moved release URL; more is a loop or a trick.
pub const MAX_REDIRECTS: u32 = 3;

/// Downloads component bytes over https.
pub struct Downloader {
    agent: ureq::Agent,
}

impl std::fmt::Debug for Downloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Downloader").finish_non_exhaustive()
    }
}

impl Downloader {
    /// A downloader trusting Mozilla's roots, or only the PEM certificates given (a
    /// site's internal CA; tests use their own).
    pub fn new(ca_pem: Option<&[u8]>) -> Result<Self, TemplateErrorKind> {
        use ureq::tls::{Certificate, RootCerts, TlsConfig};
        let roots = match ca_pem {
            None => RootCerts::WebPki,
            Some(pem) => {
                let certs: Vec<Certificate<'static>> = ureq::tls::parse_pem(pem)
                    .filter_map(|item| match item {
                        Ok(ureq::tls::PemItem::Certificate(c)) => Some(Ok(c)),
                        Ok(_) => None,
                        Err(e) => Some(Err(e)),
                    })
                    .collect::<Result<_, _>>()
                    .map_err(|e| TemplateErrorKind::Engine(format!("bad CA bundle: {e}")))?;
                if certs.is_empty() {
                    return Err(TemplateErrorKind::Engine(
                        "CA bundle holds no certificate".into(),
                    ));
                }
                RootCerts::new_with_certs(&certs)
            }
        };
        let agent = ureq::Agent::config_builder()
            .https_only(true)
            .max_redirects(MAX_REDIRECTS)
            .timeout_global(Some(DOWNLOAD_TIMEOUT))
            .http_status_as_error(true)
            .tls_config(TlsConfig::builder().root_certs(roots).build())
            .build()
            .new_agent();
        Ok(Self { agent })
    }

    /// Downloads at most [`MAX_COMPONENT_BYTES`] from `url`.
    pub fn fetch(&self, url: &str) -> Result<Vec<u8>, TemplateErrorKind> {
        let fail = |reason: String| TemplateErrorKind::Download {
            url: url.to_string(),
            reason,
        };
        let mut response = self.agent.get(url).call().map_err(|e| fail(describe(&e)))?;
        response
            .body_mut()
            .with_config()
            .limit(MAX_COMPONENT_BYTES)
            .read_to_vec()
            .map_err(|e| match e {
                ureq::Error::BodyExceedsLimit(_) => TemplateErrorKind::TooLarge {
                    size: MAX_COMPONENT_BYTES + 1,
                    max: MAX_COMPONENT_BYTES,
                },
                other => fail(describe(&other)),
            })
    }
}

fn describe(e: &ureq::Error) -> String {
    match e {
        ureq::Error::StatusCode(code) => format!("HTTP status {code}"),
        ureq::Error::RequireHttpsOnly(_) => "a redirect left https".into(),
        ureq::Error::TooManyRedirects => format!("more than {MAX_REDIRECTS} redirects"),
        other => other.to_string(),
    }
}

/// Reads a local component file of at most [`MAX_COMPONENT_BYTES`].
pub fn read_file(path: &Path) -> Result<Vec<u8>, TemplateErrorKind> {
    let read_err = |source| TemplateErrorKind::Read {
        path: path.display().to_string(),
        source,
    };
    let size = std::fs::metadata(path).map_err(read_err)?.len();
    if size > MAX_COMPONENT_BYTES {
        return Err(TemplateErrorKind::TooLarge {
            size,
            max: MAX_COMPONENT_BYTES,
        });
    }
    std::fs::read(path).map_err(read_err)
}
