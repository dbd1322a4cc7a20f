//! OpenSSH `known_hosts` files: parse once, then verify the key a server offers.
//!
//! Supported, as OpenSSH writes and reads them (`sshd(8)`, "SSH_KNOWN_HOSTS FILE FORMAT"):
//!
//! - plain host patterns and comma lists (`host1,host2,10.0.0.1`), with `*` and `?`
//!   wildcards and `!negation`; names compare case-insensitively;
//! - `[host]:port` for a port other than 22 (a host on port 22 is written bare);
//! - hashed entries `|1|base64(salt)|base64(HMAC-SHA1(salt, name))`, as written by
//!   `ssh-keygen -H` or `HashKnownHosts yes`;
//! - several keys per host (one line each, of the same or different types);
//! - comments and blank lines;
//! - `@revoked` lines: the key on such a line is refused for every host, whatever its
//!   host patterns say (stricter than necessary, never weaker);
//! - `@cert-authority` lines are skipped: the operator does not ask servers for host
//!   certificates, so a CA line can never vouch for a key it sees.
//!
//! A line that cannot be parsed is skipped and remembered (line number and reason), like
//! OpenSSH does, so one bad line does not lock every host out; [`KnownHosts::skipped`]
//! lets a caller report them.
//!
//! [`KnownHosts::verify`] tells *unknown* (no line names the host: someone has to add it)
//! from *changed* (lines name the host but none holds the offered key: a reinstalled host
//! or a man in the middle). Both refuse the connection; the messages differ because the
//! remedies do.

use std::fmt;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, KeyInit as _, Mac as _};
use russh::keys::ssh_key::public::KeyData;
use russh::keys::{Algorithm, HashAlg, PublicKey};
use sha1::Sha1;
use thiserror::Error;

/// The port OpenSSH writes without brackets: every other port uses `[host]:port`.
const DEFAULT_PORT: u16 = 22;

/// Where a host key was looked up and what was offered; shared by every refusal so each
/// message names the host, the offered key's fingerprint and the file to fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offered {
    /// The name looked up: `host` on port 22, `[host]:port` otherwise.
    pub host: String,
    /// The offered key's algorithm name, e.g. `ssh-ed25519`.
    pub algorithm: String,
    /// The offered key's SHA256 fingerprint, `SHA256:...` as `ssh-keygen -l` prints it.
    pub fingerprint: String,
    /// The known_hosts file that was consulted.
    pub known_hosts: PathBuf,
}

impl fmt::Display for Offered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} offered {} key {} (known_hosts: {})",
            self.host,
            self.algorithm,
            self.fingerprint,
            self.known_hosts.display()
        )
    }
}

/// Why a host key was refused, or why the known_hosts file could not be read.
#[derive(Debug, Error)]
pub enum HostKeyError {
    /// No line names this host: the key may be fine, but nobody vouched for it.
    #[error(
        "host key not verified: {offered}; no entry for {} in the known_hosts file: \
         check the key out of band and add it",
        offered.host
    )]
    Unknown {
        /// Host, offered key and file (boxed: it is large and errors travel by value).
        offered: Box<Offered>,
    },
    /// Lines name this host, but none holds the offered key.
    #[error(
        "HOST KEY MISMATCH: {offered}, but the known_hosts file lists other keys for it \
         ({known}, line {lines}): the host was reinstalled or someone is intercepting the \
         connection; refusing to connect"
    )]
    Changed {
        /// Host, offered key and file (boxed: it is large and errors travel by value).
        offered: Box<Offered>,
        /// Algorithms of the keys the file lists for this host, e.g. `ssh-rsa, ssh-ed25519`.
        known: String,
        /// Line numbers of those keys, comma-separated.
        lines: String,
    },
    /// The offered key is marked `@revoked`.
    #[error("host key REVOKED: {offered} is marked @revoked on line {line}; refusing to connect")]
    Revoked {
        /// Host, offered key and file (boxed: it is large and errors travel by value).
        offered: Box<Offered>,
        /// The `@revoked` line.
        line: usize,
    },
    /// The server presented a certificate whose key is not known either (the operator
    /// never asks for certificates, so this only happens with an odd server).
    #[error(
        "host key not verified: {offered}: the server presented a host certificate; certificates are not trusted, and its key is not in the known_hosts file"
    )]
    Certificate {
        /// Host, the certificate's key and file.
        offered: Box<Offered>,
    },
    /// The known_hosts file could not be read.
    #[error("cannot read known_hosts file {}: {source}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Which lines a host matched while verifying; private bookkeeping for the messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Marker {
    /// A plain line: the key is trusted for its hosts.
    None,
    /// `@revoked`: the key is never trusted.
    Revoked,
}

/// One host pattern of a line.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Pattern {
    /// A plain (possibly wildcard) pattern, lower-cased; `negated` for `!pattern`.
    Plain { pattern: String, negated: bool },
    /// A hashed name: HMAC-SHA1 of the name under `salt`.
    Hashed { salt: Vec<u8>, hash: Vec<u8> },
}

/// One usable line of the file.
#[derive(Debug, Clone)]
struct Entry {
    line: usize,
    marker: Marker,
    patterns: Vec<Pattern>,
    key: KeyData,
    algorithm: Algorithm,
}

/// A parsed known_hosts file.
#[derive(Debug, Clone)]
pub struct KnownHosts {
    path: PathBuf,
    entries: Vec<Entry>,
    skipped: Vec<(usize, String)>,
}

impl KnownHosts {
    /// Reads and parses a known_hosts file. A missing or unreadable file is an error (not
    /// an empty file): with host-key checking on, there is nothing to trust without it.
    pub async fn load(path: &Path) -> Result<Self, HostKeyError> {
        let text = tokio::fs::read_to_string(path)
            .await
            .map_err(|source| HostKeyError::File {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(Self::parse(&text, path))
    }

    /// Parses the text of a known_hosts file; `path` is only used in messages.
    pub fn parse(text: &str, path: &Path) -> Self {
        let mut entries = Vec::new();
        let mut skipped = Vec::new();
        for (index, raw) in text.lines().enumerate() {
            let line = index + 1;
            match parse_line(raw) {
                Ok(Some(mut entry)) => {
                    entry.line = line;
                    entries.push(entry);
                }
                Ok(None) => {}
                Err(reason) => {
                    tracing::debug!(
                        known_hosts = %path.display(),
                        line,
                        reason = %reason,
                        "skipping known_hosts line"
                    );
                    skipped.push((line, reason));
                }
            }
        }
        Self {
            path: path.to_path_buf(),
            entries,
            skipped,
        }
    }

    /// The file this was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Lines that were skipped as unparseable, with the reason (no key material).
    pub fn skipped(&self) -> &[(usize, String)] {
        &self.skipped
    }

    /// Checks the key a server at `host:port` offered. `Ok` only when a plain line for
    /// this host holds exactly this key and no `@revoked` line holds it.
    pub fn verify(&self, host: &str, port: u16, offered: &PublicKey) -> Result<(), HostKeyError> {
        let name = lookup_name(host, port);
        let offered_info = || {
            Box::new(Offered {
                host: name.clone(),
                algorithm: offered.algorithm().as_str().to_string(),
                fingerprint: offered.fingerprint(HashAlg::Sha256).to_string(),
                known_hosts: self.path.clone(),
            })
        };
        let offered_key = offered.key_data();
        if let Some(revoked) = self
            .entries
            .iter()
            .find(|e| e.marker == Marker::Revoked && &e.key == offered_key)
        {
            return Err(HostKeyError::Revoked {
                offered: offered_info(),
                line: revoked.line,
            });
        }
        let for_host: Vec<&Entry> = self
            .entries
            .iter()
            .filter(|e| e.marker == Marker::None && host_matches(&e.patterns, &name))
            .collect();
        if for_host.iter().any(|e| &e.key == offered_key) {
            return Ok(());
        }
        if for_host.is_empty() {
            return Err(HostKeyError::Unknown {
                offered: offered_info(),
            });
        }
        let mut known: Vec<&str> = for_host.iter().map(|e| e.algorithm.as_str()).collect();
        known.dedup();
        let lines: Vec<String> = for_host.iter().map(|e| e.line.to_string()).collect();
        Err(HostKeyError::Changed {
            offered: offered_info(),
            known: known.join(", "),
            lines: lines.join(", "),
        })
    }

    /// Key algorithms the file trusts for `host:port`, in file order without repeats.
    /// The SSH client asks the server for these first (as OpenSSH does), so a server with
    /// several host keys offers one we can verify.
    pub fn algorithms_for(&self, host: &str, port: u16) -> Vec<Algorithm> {
        let name = lookup_name(host, port);
        let mut out: Vec<Algorithm> = Vec::new();
        for e in &self.entries {
            if e.marker == Marker::None
                && host_matches(&e.patterns, &name)
                && !out.contains(&e.algorithm)
            {
                out.push(e.algorithm.clone());
            }
        }
        out
    }
}

/// The name a host is recorded under: bare on port 22, `[host]:port` otherwise; lower
/// case, as OpenSSH looks names up.
pub fn lookup_name(host: &str, port: u16) -> String {
    let host = host.to_ascii_lowercase();
    if port == DEFAULT_PORT {
        host
    } else {
        format!("[{host}]:{port}")
    }
}

/// Parses one line; `Ok(None)` for blank lines, comments and lines we deliberately ignore.
fn parse_line(raw: &str) -> Result<Option<Entry>, String> {
    let text = raw.trim();
    if text.is_empty() || text.starts_with('#') {
        return Ok(None);
    }
    let mut fields = text.split_whitespace();
    let mut first = fields.next().unwrap_or_default();
    let marker = match first {
        "@revoked" => Marker::Revoked,
        "@cert-authority" => {
            // Host certificates are never requested (russh only offers certificate
            // algorithms when asked), so a CA line cannot apply; see the module docs.
            return Ok(None);
        }
        m if m.starts_with('@') => return Err(format!("unknown marker {m}")),
        _ => Marker::None,
    };
    if marker != Marker::None {
        first = fields.next().ok_or("a marker with nothing after it")?;
    }
    let key_type = fields.next().ok_or("no key type after the host patterns")?;
    let key_b64 = fields.next().ok_or("no key after the key type")?;
    let patterns = first
        .split(',')
        .map(parse_pattern)
        .collect::<Result<Vec<_>, _>>()?;
    let key = PublicKey::from_openssh(&format!("{key_type} {key_b64}"))
        .map_err(|e| format!("the {key_type} key does not parse: {e}"))?;
    Ok(Some(Entry {
        line: 0,
        marker,
        patterns,
        algorithm: key.algorithm(),
        key: key.key_data().clone(),
    }))
}

/// Parses one comma-separated host pattern.
fn parse_pattern(p: &str) -> Result<Pattern, String> {
    if let Some(rest) = p.strip_prefix("|1|") {
        let (salt, hash) = rest
            .split_once('|')
            .ok_or("a hashed host without '|' between salt and hash")?;
        let salt = BASE64
            .decode(salt)
            .map_err(|e| format!("hashed host salt is not base64: {e}"))?;
        let hash = BASE64
            .decode(hash)
            .map_err(|e| format!("hashed host hash is not base64: {e}"))?;
        return Ok(Pattern::Hashed { salt, hash });
    }
    if p.starts_with('|') {
        return Err("a hashed host of an unknown kind (only |1| exists)".into());
    }
    let (negated, pattern) = match p.strip_prefix('!') {
        Some(rest) => (true, rest),
        None => (false, p),
    };
    if pattern.is_empty() {
        return Err("an empty host pattern".into());
    }
    Ok(Pattern::Plain {
        pattern: pattern.to_ascii_lowercase(),
        negated,
    })
}

/// OpenSSH's rule: a line matches when some pattern matches and no negated one does.
fn host_matches(patterns: &[Pattern], name: &str) -> bool {
    let mut matched = false;
    for p in patterns {
        match p {
            Pattern::Plain { pattern, negated } => {
                if wildcard_match(pattern.as_bytes(), name.as_bytes()) {
                    if *negated {
                        return false;
                    }
                    matched = true;
                }
            }
            Pattern::Hashed { salt, hash } => {
                if hashed_matches(salt, hash, name) {
                    matched = true;
                }
            }
        }
    }
    matched
}

/// HMAC-SHA1(salt, name) compared in constant time with the stored hash.
fn hashed_matches(salt: &[u8], hash: &[u8], name: &str) -> bool {
    match Hmac::<Sha1>::new_from_slice(salt) {
        Ok(mac) => mac.chain_update(name.as_bytes()).verify_slice(hash).is_ok(),
        Err(_) => false,
    }
}

/// `*` matches any run of bytes, `?` exactly one; everything else literally.
fn wildcard_match(pattern: &[u8], name: &[u8]) -> bool {
    // Iterative glob with backtracking to the last `*`: linear in practice, no recursion.
    let (mut p, mut n) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while n < name.len() {
        match pattern.get(p) {
            Some(b'*') => {
                star = Some((p, n));
                p += 1;
            }
            Some(&c) if c == b'?' || c == name.get(n).copied().unwrap_or_default() => {
                p += 1;
                n += 1;
            }
            _ => match star {
                Some((sp, sn)) => {
                    p = sp + 1;
                    n = sn + 1;
                    star = Some((sp, sn + 1));
                }
                None => return false,
            },
        }
    }
    pattern
        .get(p..)
        .is_some_and(|rest| rest.iter().all(|&c| c == b'*'))
}

/// Writes a hashed host pattern for `name` with the given salt; tests and tools use it
/// to produce what `ssh-keygen -H` would.
pub fn hash_host(salt: &[u8], name: &str) -> Option<String> {
    let mac = Hmac::<Sha1>::new_from_slice(salt).ok()?;
    let hash = mac.chain_update(name.as_bytes()).finalize().into_bytes();
    Some(format!(
        "|1|{}|{}",
        BASE64.encode(salt),
        BASE64.encode(hash)
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use russh::keys::ssh_key::private::{Ed25519Keypair, PrivateKey};

    /// A deterministic ed25519 public key per seed byte: tests need distinct keys, not
    /// secret ones.
    fn key(seed: u8) -> PublicKey {
        PrivateKey::from(Ed25519Keypair::from_seed(&[seed; 32]))
            .public_key()
            .clone()
    }

    fn line(hosts: &str, k: &PublicKey) -> String {
        format!("{hosts} {}", k.to_openssh().unwrap())
    }

    const PATH: &str = "/etc/eo/known_hosts";

    #[derive(Debug, PartialEq)]
    enum Want {
        Ok,
        Unknown,
        Changed,
        Revoked,
    }

    fn outcome(r: Result<(), HostKeyError>) -> Want {
        match r {
            Ok(()) => Want::Ok,
            Err(HostKeyError::Unknown { .. }) => Want::Unknown,
            Err(HostKeyError::Changed { .. }) => Want::Changed,
            Err(HostKeyError::Revoked { .. }) => Want::Revoked,
            Err(e) => panic!("unexpected {e}"),
        }
    }

    #[test]
    fn verify_table() {
        let (a, b, c) = (key(1), key(2), key(3));
        let salt = [7u8; 20];
        let hashed_22 = hash_host(&salt, "hashed.example").unwrap();
        let hashed_port = hash_host(&salt, "[hashed.example]:2222").unwrap();
        let cases: Vec<(&str, String, &str, u16, &PublicKey, Want)> = vec![
            ("plain match", line("h1", &a), "h1", 22, &a, Want::Ok),
            (
                "plain case-insensitive",
                line("H1.Example", &a),
                "h1.example",
                22,
                &a,
                Want::Ok,
            ),
            (
                "host in comma list",
                line("x,h1,10.0.0.1", &a),
                "10.0.0.1",
                22,
                &a,
                Want::Ok,
            ),
            (
                "no entry: unknown",
                line("h1", &a),
                "h2",
                22,
                &a,
                Want::Unknown,
            ),
            (
                "other key: changed",
                line("h1", &a),
                "h1",
                22,
                &b,
                Want::Changed,
            ),
            (
                "port 2222 bracketed",
                line("[h1]:2222", &a),
                "h1",
                2222,
                &a,
                Want::Ok,
            ),
            (
                "bare entry does not cover 2222",
                line("h1", &a),
                "h1",
                2222,
                &a,
                Want::Unknown,
            ),
            (
                "bracketed 22 is not bare",
                line("[h1]:2222", &a),
                "h1",
                22,
                &a,
                Want::Unknown,
            ),
            (
                "hashed match",
                line(&hashed_22, &a),
                "hashed.example",
                22,
                &a,
                Want::Ok,
            ),
            (
                "hashed with port",
                line(&hashed_port, &a),
                "hashed.example",
                2222,
                &a,
                Want::Ok,
            ),
            (
                "hashed other host",
                line(&hashed_22, &a),
                "other.example",
                22,
                &a,
                Want::Unknown,
            ),
            (
                "hashed changed",
                line(&hashed_22, &a),
                "hashed.example",
                22,
                &b,
                Want::Changed,
            ),
            (
                "several keys, second matches",
                format!("{}\n{}", line("h1", &a), line("h1", &b)),
                "h1",
                22,
                &b,
                Want::Ok,
            ),
            (
                "several keys, none matches",
                format!("{}\n{}", line("h1", &a), line("h1", &b)),
                "h1",
                22,
                &c,
                Want::Changed,
            ),
            (
                "comments and blanks",
                format!("# comment\n\n   \n{}\n# {}", line("h1", &a), line("h1", &b)),
                "h1",
                22,
                &b,
                Want::Changed,
            ),
            (
                "revoked refuses even a listed key",
                format!("{}\n@revoked * {}", line("h1", &a), a.to_openssh().unwrap()),
                "h1",
                22,
                &a,
                Want::Revoked,
            ),
            (
                "revoked applies to any host",
                format!(
                    "{}\n@revoked other {}",
                    line("h1", &a),
                    a.to_openssh().unwrap()
                ),
                "h1",
                22,
                &a,
                Want::Revoked,
            ),
            (
                "revoked other key does not matter",
                format!(
                    "{}\n@revoked h1 {}",
                    line("h1", &a),
                    b.to_openssh().unwrap()
                ),
                "h1",
                22,
                &a,
                Want::Ok,
            ),
            (
                "cert-authority line ignored",
                format!("@cert-authority h1 {}", a.to_openssh().unwrap()),
                "h1",
                22,
                &a,
                Want::Unknown,
            ),
            (
                "wildcard",
                line("*.example", &a),
                "h1.example",
                22,
                &a,
                Want::Ok,
            ),
            ("question mark", line("h?", &a), "h1", 22, &a, Want::Ok),
            (
                "wildcard no match",
                line("*.example", &a),
                "h1.other",
                22,
                &a,
                Want::Unknown,
            ),
            (
                "negation wins",
                line("*.example,!h1.example", &a),
                "h1.example",
                22,
                &a,
                Want::Unknown,
            ),
            (
                "bad line skipped, good line used",
                format!("h1 ssh-ed25519 !!!notbase64\n{}", line("h1", &a)),
                "h1",
                22,
                &a,
                Want::Ok,
            ),
            (
                "comment after key",
                format!("{} root@somewhere", line("h1", &a)),
                "h1",
                22,
                &a,
                Want::Ok,
            ),
            ("empty file", String::new(), "h1", 22, &a, Want::Unknown),
        ];
        for (name, text, host, port, offered, want) in cases {
            let kh = KnownHosts::parse(&text, Path::new(PATH));
            assert_eq!(
                outcome(kh.verify(host, port, offered)),
                want,
                "case {name:?}"
            );
        }
    }

    #[test]
    fn messages_name_fingerprint_host_and_file() {
        let (a, b) = (key(1), key(2));
        let fp = b.fingerprint(HashAlg::Sha256).to_string();
        assert!(fp.starts_with("SHA256:"));
        let kh = KnownHosts::parse(&line("[h1]:2222", &a), Path::new(PATH));
        let changed = kh.verify("h1", 2222, &b).unwrap_err().to_string();
        for want in [
            fp.as_str(),
            PATH,
            "[h1]:2222",
            "MISMATCH",
            "line 1",
            "ssh-ed25519",
        ] {
            assert!(changed.contains(want), "{want:?} not in {changed:?}");
        }
        let unknown = kh.verify("h2", 22, &b).unwrap_err().to_string();
        for want in [fp.as_str(), PATH, "h2", "no entry"] {
            assert!(unknown.contains(want), "{want:?} not in {unknown:?}");
        }
    }

    #[test]
    fn skipped_lines_are_reported() {
        let a = key(1);
        let text = format!(
            "h1\nh1 ssh-ed25519\n@bogus h1 {k}\nh1 ssh-ed25519 AAAA\n|2|x|y {k}\n|1|nobar {k}\n{}",
            line("h1", &a),
            k = a.to_openssh().unwrap()
        );
        let kh = KnownHosts::parse(&text, Path::new(PATH));
        let lines: Vec<usize> = kh.skipped().iter().map(|(l, _)| *l).collect();
        assert_eq!(lines, vec![1, 2, 3, 4, 5, 6]);
        assert!(kh.verify("h1", 22, &a).is_ok());
    }

    #[test]
    fn hashed_entry_from_ssh_keygen_format() {
        // A line as `ssh-keygen -H` writes it: the hash covers the lower-case name.
        let a = key(9);
        let entry = hash_host(b"0123456789abcdefghij", "[127.0.0.1]:2022").unwrap();
        assert!(entry.starts_with("|1|"));
        let kh = KnownHosts::parse(&line(&entry, &a), Path::new(PATH));
        assert!(kh.verify("127.0.0.1", 2022, &a).is_ok());
    }

    #[test]
    fn algorithms_for_lists_known_types_once() {
        let (a, b) = (key(1), key(2));
        let text = format!("{}\n{}\n{}", line("h1", &a), line("h1", &b), line("h2", &a));
        let kh = KnownHosts::parse(&text, Path::new(PATH));
        assert_eq!(kh.algorithms_for("h1", 22), vec![Algorithm::Ed25519]);
        assert!(kh.algorithms_for("h3", 22).is_empty());
    }

    #[test]
    fn wildcard_table() {
        for (p, n, want) in [
            ("*", "", true),
            ("*", "abc", true),
            ("a*c", "abc", true),
            ("a*c", "abd", false),
            ("a?c", "abc", true),
            ("a?c", "ac", false),
            ("*.x.*", "h.x.y", true),
            ("abc", "abcd", false),
            ("abc*", "abc", true),
            ("[h]:22*", "[h]:2222", true),
        ] {
            assert_eq!(
                wildcard_match(p.as_bytes(), n.as_bytes()),
                want,
                "{p} vs {n}"
            );
        }
    }

    #[tokio::test]
    async fn load_missing_file_is_an_error_naming_it() {
        let e = KnownHosts::load(Path::new("/nonexistent/known_hosts"))
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/known_hosts"), "{e}");
    }
}
