//! `oci://` plugin sources: pull a plugin from an OCI registry by digest, and push one.
//!
//! A plugin is published as an OCI 1.1 artifact (what `egress-operator plugin push`
//! writes):
//!
//! - an image manifest (`application/vnd.oci.image.manifest.v1+json`) whose
//!   `artifactType` is [`ARTIFACT_TYPE`], `application/vnd.egress-operator.plugin.v1+wasm`,
//!   so a registry UI or `oras discover` can tell our plugins from other artifacts;
//! - the empty config (`application/vnd.oci.empty.v1+json`, the two bytes `{}`), as the
//!   image spec asks of artifacts that have no config;
//! - exactly one layer of media type [`WASM_LAYER_MEDIA_TYPE`],
//!   `application/vnd.wasm.content.layer.v1+wasm`: the component itself, the media type
//!   the Wasm tooling (wasm-to-oci, Kubewarden, oci-client's own wasm helpers) gives a
//!   Wasm layer, so other tools can pull it as a Wasm module too. A pull also accepts the
//!   CNCF Wasm OCI layout's `application/wasm` layer.
//!
//! The manifest carries no timestamp: pushing the same component twice gives the same
//! manifest digest.
//!
//! What the digests pin: the reference's `@sha256:` is the **manifest** digest, as
//! everywhere in OCI (it is what `plugin push` prints and what `crane digest` shows). The
//! manifest names its wasm layer by the layer's sha256, which is the sha256 of the
//! component bytes: the value an `https://` plugin's `sha256` holds. A pull checks both
//! links of that chain (manifest bytes against the reference, layer bytes against the
//! manifest) before anything is compiled, and the compiled-code cache is keyed by the
//! layer's sha256 like every other plugin's.
//!
//! The registry is reached over https only, with the roots of the system, or only the
//! certificates of the operator's `--plugin-ca-file` when it is given (the same option
//! `https://` plugins use). Credentials come from a Docker config JSON file
//! (`credentialsFile`), read afresh at each attempt.

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use futures_util::StreamExt;
use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::manifest::{OCI_IMAGE_MEDIA_TYPE, OciImageManifest};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use sha2::{Digest, Sha256};

use super::MAX_COMPONENT_BYTES;
use crate::error::{Classified, ErrorClass};

/// The manifest `artifactType` of a plugin pushed by `plugin push`.
pub const ARTIFACT_TYPE: &str = "application/vnd.egress-operator.plugin.v1+wasm";
/// The media type of the one layer: the component.
pub const WASM_LAYER_MEDIA_TYPE: &str = "application/vnd.wasm.content.layer.v1+wasm";
/// The CNCF Wasm OCI layout's layer media type, accepted on pull.
pub const WASM_LAYER_MEDIA_TYPE_CNCF: &str = "application/wasm";
/// The OCI empty descriptor's media type, used for the config.
pub const EMPTY_CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.empty.v1+json";
/// The empty config's content.
const EMPTY_CONFIG: &[u8] = b"{}";
/// A plugin manifest is a few hundred bytes; anything near this is not one.
pub const MAX_MANIFEST_BYTES: usize = 64 * 1024;
/// A credentials file holds a few entries; a Secret is at most 1 MiB anyway.
const MAX_CREDENTIALS_BYTES: u64 = 1024 * 1024;
/// The whole pull or push (manifest and a component of a few hundred KB), like an
/// `https://` download.
pub const OCI_TIMEOUT: Duration = Duration::from_secs(60);
/// Connecting to a registry; a longer wait is a dead address.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The title annotation of the layer (the file name `oras pull` writes it to).
const TITLE_ANNOTATION: &str = "org.opencontainers.image.title";

/// What went wrong talking to a registry or with what it served.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// The `oci://` reference is malformed.
    #[error("{reference:?} is not a usable OCI reference: {reason}")]
    BadReference {
        /// The reference as given (it never carries credentials: those are refused).
        reference: String,
        /// Why.
        reason: String,
    },
    /// The credentials file cannot be read or has no usable entry for the registry.
    #[error("credentials file {path}: {reason}")]
    Credentials {
        /// The file.
        path: String,
        /// Why (never the secret itself).
        reason: String,
    },
    /// The CA bundle cannot be used.
    #[error("CA bundle: {0}")]
    Ca(String),
    /// The registry could not be reached or refused the request (network, TLS, HTTP
    /// status, authentication).
    #[error("registry {registry}: {reason}")]
    Registry {
        /// The registry host.
        registry: String,
        /// Why.
        reason: String,
    },
    /// The manifest the registry served does not hash to the pinned digest.
    #[error(
        "manifest digest mismatch: the reference pins sha256:{expected}, the registry served sha256:{actual}"
    )]
    ManifestDigest {
        /// Pinned.
        expected: String,
        /// Served.
        actual: String,
    },
    /// The wasm layer the registry served does not hash to the manifest's layer digest.
    #[error(
        "wasm layer digest mismatch: the manifest names sha256:{expected}, the registry served sha256:{actual}"
    )]
    LayerDigest {
        /// Named by the manifest.
        expected: String,
        /// Served.
        actual: String,
    },
    /// The artifact is not a plugin: not an image manifest, not exactly one wasm layer,
    /// or too large.
    #[error("not a plugin artifact: {0}")]
    Artifact(String),
    /// The whole operation took longer than [`OCI_TIMEOUT`].
    #[error("no answer within {}s", OCI_TIMEOUT.as_secs())]
    Timeout,
    /// The I/O thread or runtime of the operation could not be started.
    #[error("cannot run the registry client: {0}")]
    Runtime(String),
}

impl Classified for OciError {
    fn class(&self) -> ErrorClass {
        match self {
            // A registry can come back, a credential be fixed in the Secret (re-read at
            // each attempt), a thread be had next time.
            OciError::Registry { .. } | OciError::Timeout | OciError::Runtime(_) => {
                ErrorClass::Transient
            }
            // A credentials file not mounted yet (a Secret created after the pod).
            OciError::Credentials { .. } => ErrorClass::Transient,
            // The same config and the same content-addressed artifact fail the same way.
            OciError::BadReference { .. }
            | OciError::Ca(_)
            | OciError::ManifestDigest { .. }
            | OciError::LayerDigest { .. }
            | OciError::Artifact(_) => ErrorClass::Permanent,
        }
    }
}

/// A parsed `oci://REGISTRY/REPOSITORY[:TAG][@sha256:HEX]` reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OciRef {
    /// `host[:port]`.
    pub registry: String,
    /// `path/to/repo`.
    pub repository: String,
    /// The tag, if any (informational when a digest is given).
    pub tag: Option<String>,
    /// The manifest's sha256, lower-case hex, if any.
    pub digest: Option<String>,
}

impl std::fmt::Display for OciRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "oci://{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@sha256:{d}")?;
        }
        Ok(())
    }
}

impl OciRef {
    /// Parses an `oci://` reference. The registry must be named (no Docker Hub default),
    /// must not carry credentials, and the repository and tag follow the distribution
    /// spec's grammar; a digest must be `sha256:` and 64 lower-case hex digits.
    pub fn parse(reference: &str) -> Result<Self, OciError> {
        let bad = |reason: &str| OciError::BadReference {
            reference: crate::validation::show(reference),
            reason: reason.to_string(),
        };
        let rest = reference
            .strip_prefix("oci://")
            .ok_or_else(|| bad("must start with oci://"))?;
        if rest.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad("must not contain spaces or control characters"));
        }
        let (registry, path) = rest.split_once('/').ok_or_else(|| {
            bad("must name a registry and a repository: oci://REGISTRY/REPOSITORY:TAG@sha256:DIGEST")
        })?;
        if registry.contains('@') {
            return Err(bad(
                "must not carry credentials (user@host): give them in `credentialsFile`",
            ));
        }
        valid_registry(registry).map_err(|r| bad(&r))?;
        let (name, digest) = match path.rsplit_once('@') {
            Some((name, d)) => {
                let hex = d
                    .strip_prefix("sha256:")
                    .ok_or_else(|| bad("the digest must be sha256:<64 lower-case hex digits>"))?;
                if hex.len() != 64 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
                    return Err(bad("the digest must be sha256:<64 lower-case hex digits>"));
                }
                (name, Some(hex.to_string()))
            }
            None => (path, None),
        };
        let (repository, tag) = match name.rsplit_once(':') {
            Some((repo, tag)) if !tag.contains('/') => (repo, Some(tag.to_string())),
            _ => (name, None),
        };
        valid_repository(repository).map_err(|r| bad(&r))?;
        if let Some(t) = &tag {
            valid_tag(t).map_err(|r| bad(&r))?;
        }
        Ok(Self {
            registry: registry.to_string(),
            repository: repository.to_string(),
            tag,
            digest,
        })
    }

    /// The client's reference: by digest when there is one, else by tag.
    fn client_reference(&self) -> Reference {
        match (&self.digest, &self.tag) {
            (Some(d), _) => Reference::with_digest(
                self.registry.clone(),
                self.repository.clone(),
                format!("sha256:{d}"),
            ),
            (None, t) => Reference::with_tag(
                self.registry.clone(),
                self.repository.clone(),
                t.clone().unwrap_or_else(|| "latest".into()),
            ),
        }
    }
}

fn valid_registry(host: &str) -> Result<(), String> {
    let (name, port) = match host.rsplit_once(':') {
        Some((n, p)) => (n, Some(p)),
        None => (host, None),
    };
    if name.is_empty()
        || name.len() > 253
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
        || name.starts_with(['.', '-'])
    {
        return Err(format!(
            "registry {name:?} must be a host name or IPv4 address (letters, digits, `.`, `-`)"
        ));
    }
    if let Some(p) = port
        && p.parse::<u16>().map_or(true, |p| p == 0)
    {
        return Err(format!(
            "registry port {p:?} must be a number from 1 to 65535"
        ));
    }
    Ok(())
}

/// The distribution spec's `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*(\/[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*)*`.
fn valid_repository(repo: &str) -> Result<(), String> {
    let why = || {
        format!(
            "repository {repo:?} must be path components of lower-case letters and digits, \
             joined inside a component by `.`, `_`, `__` or dashes"
        )
    };
    if repo.is_empty() || repo.len() > 255 {
        return Err(why());
    }
    for part in repo.split('/') {
        let bytes = part.as_bytes();
        let alnum = |b: &u8| b.is_ascii_lowercase() || b.is_ascii_digit();
        if bytes.is_empty() || !alnum(&bytes[0]) || !alnum(&bytes[bytes.len() - 1]) {
            return Err(why());
        }
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            if alnum(&b) {
                i += 1;
                continue;
            }
            // A separator run: `.`, `_`, `__` or one or more `-`.
            let run = bytes[i..].iter().take_while(|c| !alnum(c)).count();
            let sep = &part[i..i + run];
            let ok = sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|c| c == b'-');
            if !ok {
                return Err(why());
            }
            i += run;
        }
    }
    Ok(())
}

/// The distribution spec's `[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}`.
fn valid_tag(tag: &str) -> Result<(), String> {
    let ok = !tag.is_empty()
        && tag.len() <= 128
        && tag
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_')
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "tag {tag:?} must be 1 to 128 letters, digits, `_`, `.` or `-`, not starting with `.` or `-`"
        ))
    }
}

/// Reads the `auths` entry for `registry` from a Docker config JSON file: `auth`
/// (base64 of `user:password`) or `username` and `password`. An entry may be keyed by the
/// bare host or by `https://host`.
pub fn registry_auth(path: Option<&Path>, registry: &str) -> Result<RegistryAuth, OciError> {
    let Some(path) = path else {
        return Ok(RegistryAuth::Anonymous);
    };
    let fail = |reason: String| OciError::Credentials {
        path: path.display().to_string(),
        reason,
    };
    let size = std::fs::metadata(path)
        .map_err(|e| fail(format!("cannot read it: {e}")))?
        .len();
    if size > MAX_CREDENTIALS_BYTES {
        return Err(fail(format!(
            "is {size} bytes; a Docker config JSON of at most {MAX_CREDENTIALS_BYTES} is read"
        )));
    }
    let text = std::fs::read(path).map_err(|e| fail(format!("cannot read it: {e}")))?;
    // serde_json's messages name a line and column, never the content.
    let doc: serde_json::Value = serde_json::from_slice(&text).map_err(|e| {
        fail(format!(
            "is not JSON (a Docker config JSON is expected): {e}"
        ))
    })?;
    let auths = doc
        .get("auths")
        .and_then(|a| a.as_object())
        .ok_or_else(|| fail("has no `auths` object (a Docker config JSON is expected)".into()))?;
    let entry = [
        registry.to_string(),
        format!("https://{registry}"),
        format!("https://{registry}/v2/"),
    ]
    .iter()
    .find_map(|k| auths.get(k))
    .ok_or_else(|| {
        let keys: Vec<&str> = auths.keys().map(String::as_str).collect();
        fail(format!(
            "has no `auths` entry for registry {registry} (it has: {})",
            if keys.is_empty() {
                "none".to_string()
            } else {
                keys.join(", ")
            }
        ))
    })?;
    let field = |name: &str| {
        entry
            .get(name)
            .and_then(|v| v.as_str())
            .filter(|s| !s.is_empty())
    };
    if let (Some(user), Some(password)) = (field("username"), field("password")) {
        return Ok(RegistryAuth::Basic(user.to_string(), password.to_string()));
    }
    let encoded = field("auth").ok_or_else(|| {
        fail(format!(
            "the entry for {registry} has neither `auth` nor `username` and `password`"
        ))
    })?;
    use base64::Engine as _;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or_else(|| {
            fail(format!(
                "the `auth` of {registry} is not base64 of user:password"
            ))
        })?;
    let (user, password) = decoded.split_once(':').ok_or_else(|| {
        fail(format!(
            "the `auth` of {registry} is not base64 of user:password"
        ))
    })?;
    Ok(RegistryAuth::Basic(user.to_string(), password.to_string()))
}

/// The PEM certificates of a CA bundle, each as DER.
fn ca_certificates(pem: &[u8]) -> Result<Vec<Certificate>, OciError> {
    let certs: Vec<Certificate> = ureq::tls::parse_pem(pem)
        .filter_map(|item| match item {
            Ok(ureq::tls::PemItem::Certificate(c)) => Some(Ok(Certificate {
                encoding: CertificateEncoding::Der,
                data: c.der().to_vec(),
            })),
            Ok(_) => None,
            Err(e) => Some(Err(OciError::Ca(e.to_string()))),
        })
        .collect::<Result<_, _>>()?;
    if certs.is_empty() {
        return Err(OciError::Ca("holds no certificate".into()));
    }
    Ok(certs)
}

/// A registry client over https, trusting only `ca_pem` when given.
fn client(ca_pem: Option<&[u8]>) -> Result<Client, OciError> {
    // reqwest is built without a bundled crypto provider (`rustls-no-provider`); the
    // workspace's rustls uses ring. Installing it twice is harmless (the first wins).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config = ClientConfig {
        protocol: ClientProtocol::Https,
        tls_certs_only: ca_pem.map(ca_certificates).transpose()?.unwrap_or_default(),
        connect_timeout: Some(CONNECT_TIMEOUT),
        read_timeout: Some(OCI_TIMEOUT),
        // A plugin reference names one manifest, never an index to choose from.
        platform_resolver: None,
        user_agent: concat!("egress-operator/", env!("CARGO_PKG_VERSION")),
        ..ClientConfig::default()
    };
    Client::try_from(config).map_err(|e| OciError::Runtime(format!("client setup: {e}")))
}

/// Runs `f` to completion on a current-thread runtime of its own thread, bounded by
/// [`OCI_TIMEOUT`]. Callers are blocking code (the plugin loader runs on a blocking
/// thread; the CLI has no runtime), and a runtime per call keeps the HTTP client's
/// connections from outliving the runtime that drives them.
fn run_blocking<T: Send>(
    f: impl Future<Output = Result<T, OciError>> + Send,
) -> Result<T, OciError> {
    std::thread::scope(|s| {
        s.spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| OciError::Runtime(e.to_string()))?;
            rt.block_on(async {
                tokio::time::timeout(OCI_TIMEOUT, f)
                    .await
                    .unwrap_or(Err(OciError::Timeout))
            })
        })
        .join()
        .unwrap_or_else(|_| {
            Err(OciError::Runtime(
                "the registry client thread panicked".into(),
            ))
        })
    })
}

fn registry_err(registry: &str) -> impl Fn(oci_client::errors::OciDistributionError) -> OciError {
    let registry = registry.to_string();
    move |e| OciError::Registry {
        registry: registry.clone(),
        reason: chain(&e),
    }
}

/// An error and its causes, `: `-joined, without repeats (reqwest's top-level message
/// alone says only "error sending request"; the cause says TLS, refused, or a timeout).
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let part = c.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        cause = c.source();
    }
    text
}

/// A failed read of the wasm layer: the client's own digest check (which sees the end of
/// the stream before we do) is a [`OciError::LayerDigest`], like ours; anything else is
/// the registry's or the network's.
fn layer_read_error(registry: &str, e: &std::io::Error) -> OciError {
    use oci_client::errors::DigestError;
    let hex = |d: &str| d.strip_prefix("sha256:").unwrap_or(d).to_string();
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<DigestError>())
    {
        Some(DigestError::VerificationError { expected, actual }) => OciError::LayerDigest {
            expected: hex(expected),
            actual: hex(actual),
        },
        _ => OciError::Registry {
            registry: registry.to_string(),
            reason: format!("reading the wasm layer: {}", chain(e)),
        },
    }
}

/// A verified pull.
#[derive(Debug)]
pub struct Pulled {
    /// The manifest's sha256 (as pinned).
    pub manifest_sha256: String,
    /// The wasm layer's sha256: the component's.
    pub layer_sha256: String,
    /// The component.
    pub bytes: Vec<u8>,
}

/// Pulls the plugin `r` pins (its digest is required), checking the manifest against
/// the digest and the layer against the manifest.
pub fn pull(
    r: &OciRef,
    credentials: Option<&Path>,
    ca_pem: Option<&[u8]>,
) -> Result<Pulled, OciError> {
    let pinned = r.digest.clone().ok_or_else(|| OciError::BadReference {
        reference: r.to_string(),
        reason: "has no @sha256: digest; a plugin is pulled only by digest".into(),
    })?;
    let auth = registry_auth(credentials, &r.registry)?;
    let client = client(ca_pem)?;
    let reference = r.client_reference();
    let reg = r.registry.clone();
    run_blocking(async move {
        let (body, _) = client
            .pull_manifest_raw(&reference, &auth, &[OCI_IMAGE_MEDIA_TYPE])
            .await
            .map_err(registry_err(&reg))?;
        if body.len() > MAX_MANIFEST_BYTES {
            return Err(OciError::Artifact(format!(
                "the manifest is {} bytes; a plugin's is at most {MAX_MANIFEST_BYTES}",
                body.len()
            )));
        }
        let actual = hex::encode(Sha256::digest(&body));
        if actual != pinned {
            return Err(OciError::ManifestDigest {
                expected: pinned,
                actual,
            });
        }
        let manifest: OciImageManifest = serde_json::from_slice(&body).map_err(|e| {
            OciError::Artifact(format!("the manifest is not an OCI image manifest: {e}"))
        })?;
        if manifest
            .media_type
            .as_deref()
            .is_some_and(|m| m != OCI_IMAGE_MEDIA_TYPE)
        {
            return Err(OciError::Artifact(format!(
                "the manifest's mediaType is {:?}, not {OCI_IMAGE_MEDIA_TYPE:?}",
                manifest.media_type.unwrap_or_default()
            )));
        }
        let layer = match manifest.layers.as_slice() {
            [one] => one,
            layers => {
                return Err(OciError::Artifact(format!(
                    "it has {} layers; a plugin has exactly one, of media type {WASM_LAYER_MEDIA_TYPE:?}",
                    layers.len()
                )));
            }
        };
        if layer.media_type != WASM_LAYER_MEDIA_TYPE
            && layer.media_type != WASM_LAYER_MEDIA_TYPE_CNCF
        {
            return Err(OciError::Artifact(format!(
                "its layer's media type is {:?}; expected {WASM_LAYER_MEDIA_TYPE:?} (or {WASM_LAYER_MEDIA_TYPE_CNCF:?})",
                layer.media_type
            )));
        }
        let declared = u64::try_from(layer.size).unwrap_or(u64::MAX);
        if declared > MAX_COMPONENT_BYTES {
            return Err(OciError::Artifact(format!(
                "its wasm layer is {declared} bytes; at most {MAX_COMPONENT_BYTES} are accepted"
            )));
        }
        let expected = layer
            .digest
            .strip_prefix("sha256:")
            .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| {
                OciError::Artifact(format!(
                    "its layer digest {:?} is not sha256:<64 hex digits>",
                    layer.digest
                ))
            })?
            .to_ascii_lowercase();
        let mut stream = client
            .pull_blob_stream(&reference, layer)
            .await
            .map_err(registry_err(&reg))?;
        let mut bytes = Vec::with_capacity(usize::try_from(declared).unwrap_or(0));
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| layer_read_error(&reg, &e))?;
            if (bytes.len() + chunk.len()) as u64 > declared {
                return Err(OciError::Artifact(format!(
                    "the registry sent more than the {declared} bytes the manifest declares"
                )));
            }
            bytes.extend_from_slice(&chunk);
        }
        let actual = hex::encode(Sha256::digest(&bytes));
        if actual != expected {
            return Err(OciError::LayerDigest { expected, actual });
        }
        Ok(Pulled {
            manifest_sha256: pinned,
            layer_sha256: actual,
            bytes,
        })
    })
}

/// A finished push.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pushed {
    /// The reference to configure: `oci://REGISTRY/REPO:TAG@sha256:<manifest digest>`.
    pub reference: OciRef,
    /// The wasm layer's sha256: the component's.
    pub layer_sha256: String,
}

/// The manifest `plugin push` writes for a component of that sha256 and size.
pub fn manifest_bytes(layer_sha256: &str, size: usize, title: &str) -> Vec<u8> {
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_IMAGE_MEDIA_TYPE,
        "artifactType": ARTIFACT_TYPE,
        "config": {
            "mediaType": EMPTY_CONFIG_MEDIA_TYPE,
            "digest": format!("sha256:{}", hex::encode(Sha256::digest(EMPTY_CONFIG))),
            "size": EMPTY_CONFIG.len(),
        },
        "layers": [{
            "mediaType": WASM_LAYER_MEDIA_TYPE,
            "digest": format!("sha256:{layer_sha256}"),
            "size": size,
            "annotations": { TITLE_ANNOTATION: title },
        }],
    });
    // Serialising a JSON value cannot fail.
    serde_json::to_vec(&manifest).unwrap_or_default()
}

/// Pushes `component` (named `title` in the layer's annotation) to `target`, which must
/// name a tag and no digest.
pub fn push(
    component: &[u8],
    title: &str,
    target: &OciRef,
    credentials: Option<&Path>,
    ca_pem: Option<&[u8]>,
) -> Result<Pushed, OciError> {
    let bad = |reason: &str| OciError::BadReference {
        reference: target.to_string(),
        reason: reason.into(),
    };
    if target.digest.is_some() {
        return Err(bad(
            "must not carry a digest: the registry computes it, and push prints it",
        ));
    }
    let tag = target
        .tag
        .clone()
        .ok_or_else(|| bad("must name a tag (oci://REGISTRY/REPOSITORY:TAG)"))?;
    let auth = registry_auth(credentials, &target.registry)?;
    let client = client(ca_pem)?;
    let reference = target.client_reference();
    let layer_sha256 = hex::encode(Sha256::digest(component));
    let manifest = manifest_bytes(&layer_sha256, component.len(), title);
    let manifest_sha256 = hex::encode(Sha256::digest(&manifest));
    let reg = target.registry.clone();
    let data = component.to_vec();
    let layer_digest = format!("sha256:{layer_sha256}");
    run_blocking(async move {
        let err = registry_err(&reg);
        client
            .store_auth_if_needed(reference.resolve_registry(), &auth)
            .await;
        client
            .push_blob(&reference, data, &layer_digest)
            .await
            .map_err(&err)?;
        client
            .push_blob(
                &reference,
                EMPTY_CONFIG.to_vec(),
                &format!("sha256:{}", hex::encode(Sha256::digest(EMPTY_CONFIG))),
            )
            .await
            .map_err(&err)?;
        let content_type = http::HeaderValue::from_static(OCI_IMAGE_MEDIA_TYPE);
        client
            .push_manifest_raw(&reference, manifest, content_type)
            .await
            .map_err(&err)?;
        Ok(())
    })?;
    Ok(Pushed {
        reference: OciRef {
            tag: Some(tag),
            digest: Some(manifest_sha256),
            ..target.clone()
        },
        layer_sha256,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn references_parse_and_print_back() {
        let text = format!("oci://registry.example.org:5000/plugins/domain-nic2:v1@sha256:{D}");
        let r = OciRef::parse(&text).unwrap();
        assert_eq!(r.registry, "registry.example.org:5000");
        assert_eq!(r.repository, "plugins/domain-nic2");
        assert_eq!(r.tag.as_deref(), Some("v1"));
        assert_eq!(r.digest.as_deref(), Some(D));
        assert_eq!(r.to_string(), text);
        let r = OciRef::parse(&format!("oci://127.0.0.1:5000/a__b/c.d-e@sha256:{D}")).unwrap();
        assert_eq!((r.repository.as_str(), r.tag), ("a__b/c.d-e", None));
        let r = OciRef::parse("oci://r.example.org/p:latest").unwrap();
        assert_eq!((r.tag.as_deref(), r.digest), (Some("latest"), None));
    }

    #[test]
    fn bad_references_say_what_is_wrong() {
        for (text, why) in [
            ("https://r.example.org/p", "must start with oci://"),
            (
                "oci://r.example.org",
                "must name a registry and a repository",
            ),
            ("oci://u:p@r.example.org/p:1", "must not carry credentials"),
            ("oci://r.example.org/P:1", "lower-case letters and digits"),
            ("oci://r.example.org/a..b:1", "joined inside a component"),
            ("oci://r.example.org/a/:1", "lower-case letters and digits"),
            ("oci://r.example.org/p:-x", "tag \"-x\""),
            ("oci://r.example.org:0/p:1", "port \"0\""),
            ("oci://r_x.example.org/p:1", "host name"),
            (
                "oci://r.example.org/p@sha512:ab",
                "sha256:<64 lower-case hex",
            ),
            (
                "oci://r.example.org/p@sha256:AB",
                "sha256:<64 lower-case hex",
            ),
            ("oci://r.example.org/p :1", "spaces"),
        ] {
            let e = OciRef::parse(text).unwrap_err().to_string();
            assert!(e.contains(why), "{text}: {e}");
            assert_eq!(
                OciRef::parse(text).unwrap_err().class(),
                ErrorClass::Permanent
            );
        }
    }

    fn creds(json: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), json).unwrap();
        f
    }

    #[test]
    fn credentials_come_from_the_registry_s_auths_entry() {
        use base64::Engine as _;
        let auth = base64::engine::general_purpose::STANDARD.encode("alice:s3cret:x");
        let f = creds(&format!(
            r#"{{"auths":{{"r.example.org:5000":{{"auth":"{auth}"}},"https://other.example.org":{{"username":"bob","password":"pw"}}}}}}"#
        ));
        let got = registry_auth(Some(f.path()), "r.example.org:5000").unwrap();
        assert_eq!(got, RegistryAuth::Basic("alice".into(), "s3cret:x".into()));
        let got = registry_auth(Some(f.path()), "other.example.org").unwrap();
        assert_eq!(got, RegistryAuth::Basic("bob".into(), "pw".into()));
        assert_eq!(
            registry_auth(None, "r.example.org").unwrap(),
            RegistryAuth::Anonymous
        );
        let e = registry_auth(Some(f.path()), "third.example.org").unwrap_err();
        assert!(
            e.to_string().contains(
                "has no `auths` entry for registry third.example.org (it has: \
                 https://other.example.org, r.example.org:5000)"
            ),
            "{e}"
        );
        assert!(!e.to_string().contains(&auth));
    }

    #[test]
    fn unusable_credentials_files_are_named_and_never_echoed() {
        for (json, why) in [
            ("not json", "is not JSON"),
            (r#"{"credsStore":"x"}"#, "has no `auths` object"),
            (r#"{"auths":{"r.example.org":{}}}"#, "neither `auth` nor"),
            (
                r#"{"auths":{"r.example.org":{"auth":"!!secret!!"}}}"#,
                "not base64",
            ),
        ] {
            let f = creds(json);
            let e = registry_auth(Some(f.path()), "r.example.org").unwrap_err();
            let text = e.to_string();
            assert!(text.contains(why), "{json}: {text}");
            assert!(text.contains(&f.path().display().to_string()), "{text}");
            assert!(!text.contains("secret"), "{text}");
        }
        let e = registry_auth(Some(Path::new("/nonexistent/creds.json")), "r").unwrap_err();
        assert!(e.to_string().contains("cannot read it"), "{e}");
        assert_eq!(e.class(), ErrorClass::Transient);
    }

    #[test]
    fn the_manifest_is_deterministic_and_names_its_types() {
        let a = manifest_bytes(D, 10, "p.wasm");
        assert_eq!(a, manifest_bytes(D, 10, "p.wasm"));
        let v: serde_json::Value = serde_json::from_slice(&a).unwrap();
        assert_eq!(v["artifactType"], ARTIFACT_TYPE);
        assert_eq!(v["config"]["mediaType"], EMPTY_CONFIG_MEDIA_TYPE);
        assert_eq!(
            v["config"]["digest"],
            "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
        );
        assert_eq!(v["layers"][0]["mediaType"], WASM_LAYER_MEDIA_TYPE);
        assert_eq!(v["layers"][0]["digest"], format!("sha256:{D}"));
        assert_eq!(v["layers"][0]["size"], 10);
        // What a pull parses it as.
        let m: OciImageManifest = serde_json::from_slice(&a).unwrap();
        assert_eq!(m.artifact_type.as_deref(), Some(ARTIFACT_TYPE));
    }

    #[test]
    fn a_pull_needs_a_digest_and_a_push_a_tag_without_one() {
        let r = OciRef::parse("oci://127.0.0.1:1/p:v1").unwrap();
        let e = pull(&r, None, None).unwrap_err();
        assert!(e.to_string().contains("pulled only by digest"), "{e}");
        let r = OciRef::parse(&format!("oci://127.0.0.1:1/p:v1@sha256:{D}")).unwrap();
        let e = push(b"x", "x.wasm", &r, None, None).unwrap_err();
        assert!(e.to_string().contains("must not carry a digest"), "{e}");
        let r = OciRef::parse("oci://127.0.0.1:1/p").unwrap();
        let e = push(b"x", "x.wasm", &r, None, None).unwrap_err();
        assert!(e.to_string().contains("must name a tag"), "{e}");
    }

    #[test]
    fn an_unreachable_registry_is_a_transient_registry_error() {
        // Port 1 on loopback: nothing listens, the connection is refused at once.
        let r = OciRef::parse(&format!("oci://127.0.0.1:1/p:v1@sha256:{D}")).unwrap();
        let e = pull(&r, None, None).unwrap_err();
        assert!(
            matches!(&e, OciError::Registry { registry, .. } if registry == "127.0.0.1:1"),
            "{e}"
        );
        assert_eq!(e.class(), ErrorClass::Transient);
    }

    #[test]
    fn a_ca_bundle_without_certificates_is_refused() {
        let r = OciRef::parse(&format!("oci://127.0.0.1:1/p:v1@sha256:{D}")).unwrap();
        let e = pull(&r, None, Some(b"not a pem")).unwrap_err();
        assert!(matches!(e, OciError::Ca(_)), "{e}");
    }
}
