//! Validation rules shared by everything the operator loads (providers config, Proxy specs).
//!
//! Every name or value that later reaches libvirt XML, a volume name, a path or a URL passes
//! one of these rules first (invariant 5), so the code downstream can rely on a safe charset
//! and escape only as a second line of defence. Rules return the *reason* a value is refused;
//! [`Problems`] attaches the path of the field and collects every problem, so one run shows
//! a config author all of them instead of the first.

use std::fmt;

/// Longest DNS-1123 label (RFC 1123, also the Kubernetes limit for most names).
pub const DNS1123_LABEL_MAX: usize = 63;
/// Longest DNS name (RFC 1035 §2.3.4).
pub const DNS_NAME_MAX: usize = 253;
/// Linux refuses interface names of `IFNAMSIZ` (16) bytes or more, NUL included.
pub const INTERFACE_NAME_MAX: usize = 15;
/// `sun_path` holds 108 bytes including the terminating NUL.
pub const UNIX_SOCKET_PATH_MAX: usize = 107;
/// `PATH_MAX` on Linux, NUL included.
pub const FILE_PATH_MAX: usize = 4095;
/// Longest URL we accept: far above any real image URL, far below a memory problem.
pub const URL_MAX: usize = 2048;
/// Longest POSIX user name that common tools (useradd) accept.
pub const USER_NAME_MAX: usize = 32;
/// JSON Schema pattern of [`dns1123_label`] (the length limit is separate).
pub const DNS1123_LABEL_PATTERN: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";
/// JSON Schema pattern of [`libvirt_object_name`].
pub const LIBVIRT_OBJECT_NAME_PATTERN: &str = "^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$";
/// JSON Schema pattern of [`interface_name`] (`.` and `..` are refused by the rule only).
pub const INTERFACE_NAME_PATTERN: &str = "^[A-Za-z0-9_.-]{1,15}$";
/// JSON Schema pattern of [`user_name`].
pub const USER_NAME_PATTERN: &str = "^[a-z_][a-z0-9_-]{0,31}$";
/// JSON Schema pattern of [`sha256_hex`].
pub const SHA256_PATTERN: &str = "^[0-9a-fA-F]{64}$";
/// JSON Schema pattern of [`socket_path`] (normalisation is checked by the rule only).
pub const SOCKET_PATH_PATTERN: &str = "^/[^\\x00-\\x1f]*$";
/// How much of a refused value an error message shows; a 10 KB value is cut here.
const SHOWN_VALUE_MAX: usize = 64;

/// One refused value: where it is (`kvm2.hosts[2].bridge`) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Dotted path of the field, with `[i]` for list items.
    pub path: String,
    /// Why the value is refused, quoting the value where that helps.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Collects every problem of one document, in the order the fields were checked.
#[derive(Debug, Default)]
pub struct Problems(Vec<Problem>);

impl Problems {
    /// An empty collection.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a problem at `path`.
    pub fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(Problem {
            path: path.into(),
            message: message.into(),
        });
    }

    /// Records the rule's reason, if it refused the value.
    pub fn check(&mut self, path: impl Into<String>, outcome: Result<(), String>) {
        if let Err(message) = outcome {
            self.push(path, message);
        }
    }

    /// Whether nothing was refused.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The problems, in the order they were found.
    pub fn into_vec(self) -> Vec<Problem> {
        self.0
    }
}

/// Quotes a value for an error message: escaped (no raw newlines or NULs reach a log line)
/// and cut to a readable length.
pub fn show(value: &str) -> String {
    let mut cut: String = value.chars().take(SHOWN_VALUE_MAX).collect();
    let total = value.chars().count();
    if total > SHOWN_VALUE_MAX {
        cut = format!("{:?}… ({total} characters)", cut);
        return cut;
    }
    format!("{cut:?}")
}

fn too_long(value: &str, max: usize) -> Option<String> {
    (value.len() > max).then(|| {
        format!(
            "{} is too long: {} bytes, at most {max} allowed",
            show(value),
            value.len()
        )
    })
}

/// A DNS-1123 label: 1–63 of `a-z`, `0-9`, `-`, starting and ending with a letter or digit.
///
/// Used for everything that becomes a libvirt domain or volume name, so those names never
/// need quoting and can never name a path (`/`, `..`).
pub fn dns1123_label(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err("must not be empty".into());
    }
    if let Some(e) = too_long(value, DNS1123_LABEL_MAX) {
        return Err(e);
    }
    let ok_chars = value
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    let ok_ends = value
        .bytes()
        .next()
        .zip(value.bytes().last())
        .is_some_and(|(a, z)| a.is_ascii_alphanumeric() && z.is_ascii_alphanumeric());
    if ok_chars && ok_ends {
        Ok(())
    } else {
        Err(format!(
            "{} is not a valid DNS-1123 label: use lower-case letters, digits and '-', \
             starting and ending with a letter or digit",
            show(value)
        ))
    }
}

/// A DNS-1123 subdomain (Kubernetes object names such as Secrets): dot-separated DNS-1123
/// labels, at most 253 bytes.
pub fn dns1123_subdomain(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err("must not be empty".into());
    }
    if let Some(e) = too_long(value, DNS_NAME_MAX) {
        return Err(e);
    }
    if value.split('.').all(|label| dns1123_label(label).is_ok()) {
        Ok(())
    } else {
        Err(format!(
            "{} is not a valid DNS-1123 subdomain: dot-separated lower-case labels of letters, \
             digits and '-'",
            show(value)
        ))
    }
}

/// A key of a Kubernetes Secret or ConfigMap: 1–253 of `A-Z a-z 0-9 - _ .`, not `.`/`..`.
pub fn secret_key(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err("must not be empty".into());
    }
    if let Some(e) = too_long(value, DNS_NAME_MAX) {
        return Err(e);
    }
    let ok = value != "."
        && value != ".."
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{} is not a valid Secret key: use letters, digits, '-', '_' and '.'",
            show(value)
        ))
    }
}

/// A libvirt object name we did not choose ourselves (a storage pool): 1–63 of
/// `A-Z a-z 0-9 _ . -`, starting with a letter or digit, so it is never a path.
pub fn libvirt_object_name(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err("must not be empty".into());
    }
    if let Some(e) = too_long(value, DNS1123_LABEL_MAX) {
        return Err(e);
    }
    let ok_chars = value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    let ok_start = value
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphanumeric());
    if ok_chars && ok_start {
        Ok(())
    } else {
        Err(format!(
            "{} is not a valid libvirt object name: use letters, digits, '_', '.' and '-', \
             starting with a letter or digit",
            show(value)
        ))
    }
}

/// A Linux network interface name (a bridge): at most 15 bytes of `A-Z a-z 0-9 _ . -`,
/// not `.` or `..`.
///
/// The kernel itself accepts more (anything but `/`, `:` and whitespace); we keep to the
/// charset every distribution's tooling uses, which also keeps XML attributes plain.
pub fn interface_name(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err("must not be empty".into());
    }
    let invalid = |why: &str| {
        Err(format!(
            "{} is not a valid interface name: {why}",
            show(value)
        ))
    };
    if value.len() > INTERFACE_NAME_MAX {
        return invalid(&format!(
            "{} bytes, Linux allows at most {INTERFACE_NAME_MAX}",
            value.len()
        ));
    }
    if value == "." || value == ".." {
        return invalid("'.' and '..' are reserved");
    }
    if !value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    {
        return invalid("use letters, digits, '_', '.' and '-'");
    }
    Ok(())
}

/// A POSIX user name for SSH login: `[a-z_][a-z0-9_-]*`, at most 32 bytes.
pub fn user_name(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err("must not be empty".into());
    }
    if let Some(e) = too_long(value, USER_NAME_MAX) {
        return Err(e);
    }
    let mut bytes = value.bytes();
    let ok_start = bytes
        .next()
        .is_some_and(|b| b.is_ascii_lowercase() || b == b'_');
    let ok_rest =
        bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-'));
    if ok_start && ok_rest {
        Ok(())
    } else {
        Err(format!(
            "{} is not a valid user name: use lower-case letters, digits, '_' and '-', \
             starting with a letter or '_'",
            show(value)
        ))
    }
}

fn has_control(value: &str) -> bool {
    value.chars().any(char::is_control)
}

/// A local file path (key file, known_hosts, plugin): non-empty, no control characters
/// (NUL, newline), within `PATH_MAX`. Relative paths are allowed; the loader resolves them
/// against the config file's directory.
pub fn file_path(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err("must not be empty".into());
    }
    if let Some(e) = too_long(value, FILE_PATH_MAX) {
        return Err(e);
    }
    if has_control(value) {
        return Err(format!(
            "{} contains control characters (NUL, newline, ...)",
            show(value)
        ));
    }
    Ok(())
}

/// A unix socket path on a remote host: absolute, normalised (no `.`/`..`/empty components),
/// no control characters, and short enough for `sun_path`.
pub fn socket_path(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err("must not be empty".into());
    }
    if has_control(value) {
        return Err(format!(
            "{} contains control characters (NUL, newline, ...)",
            show(value)
        ));
    }
    if !value.starts_with('/') {
        return Err(format!("{} must be an absolute path", show(value)));
    }
    if value.len() > UNIX_SOCKET_PATH_MAX {
        return Err(format!(
            "{} is too long for a unix socket: {} bytes, at most {UNIX_SOCKET_PATH_MAX}",
            show(value),
            value.len()
        ));
    }
    if value[1..]
        .split('/')
        .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return Err(format!(
            "{} must be normalised: no empty, '.' or '..' components",
            show(value)
        ));
    }
    Ok(())
}

/// A lower- or upper-case SHA-256 digest in hex: exactly 64 hex digits.
pub fn sha256_hex(value: &str) -> Result<(), String> {
    if value.len() == 64 && value.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(())
    } else {
        Err(format!(
            "{} is not a sha256 digest: expected 64 hex digits",
            show(value)
        ))
    }
}

/// Whether a URL may use plain `http`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpPolicy {
    /// Only `https` is accepted; the entry could opt in to `http` with `allowHttp: true`
    /// (images), and the refusal says so.
    HttpsOnly,
    /// Only `https` is accepted, with no opt-out (template plugins: code is never fetched
    /// over plain http, so the refusal names no key that would then be refused).
    HttpsAlways,
    /// `http` is accepted too, because the config said so explicitly.
    AllowHttp,
}

/// A download URL: https (or http where allowed), a host, no userinfo (credentials in a
/// URL end up in logs), no fragment, at most 2048 bytes.
pub fn download_url(value: &str, policy: HttpPolicy) -> Result<url::Url, String> {
    if let Some(e) = too_long(value, URL_MAX) {
        return Err(e);
    }
    if has_control(value) {
        return Err(format!("{} contains control characters", show(value)));
    }
    let url =
        url::Url::parse(value).map_err(|e| format!("{} is not a valid URL: {e}", show(value)))?;
    match (url.scheme(), policy) {
        ("https", _) | ("http", HttpPolicy::AllowHttp) => {}
        ("http", HttpPolicy::HttpsOnly) => {
            return Err(format!(
                "{} uses http; only https is allowed unless this entry sets allowHttp: true",
                show(value)
            ));
        }
        ("http", HttpPolicy::HttpsAlways) => {
            return Err(format!(
                "{} uses http; only https is allowed here (there is no opt-out: serve it over \
                 https, or use `path` with a local copy)",
                show(value)
            ));
        }
        (other, _) => {
            return Err(format!(
                "{} uses scheme {other:?}; only https is allowed",
                show(value)
            ));
        }
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(format!("{} has no host", show(value)));
    }
    if !url.username().is_empty() || url.password().is_some() {
        // Do not echo the URL: it carries a credential.
        return Err(
            "the URL must not carry credentials (user:password@); they would leak into logs".into(),
        );
    }
    if url.fragment().is_some() {
        return Err(format!("{} must not have a fragment (#...)", show(value)));
    }
    Ok(url)
}

/// A host name or IP literal: an IPv4 address, an IPv6 address (bare, as given inside
/// `[...]`), or a DNS name whose labels are letters, digits and '-'.
pub fn host_name(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err("the host must not be empty".into());
    }
    if value.parse::<std::net::IpAddr>().is_ok() {
        return Ok(());
    }
    if let Some(e) = too_long(value, DNS_NAME_MAX) {
        return Err(e);
    }
    let name = value.strip_suffix('.').unwrap_or(value);
    let ok = !name.is_empty()
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= DNS1123_LABEL_MAX
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{} is not a valid host name or IP address",
            show(value)
        ))
    }
}

/// A `host:port` address (`[v6]:port` for IPv6). The port may be left out, which means
/// `default_port`. Returns the host (without brackets) and the port.
pub fn host_port(value: &str, default_port: u16) -> Result<(String, u16), String> {
    if let Some(e) = too_long(value, DNS_NAME_MAX + 8) {
        return Err(e);
    }
    let (host, port) = if let Some(rest) = value.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("{} has an unclosed '['", show(value)))?;
        if host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!(
                "{} is not a valid IPv6 address in brackets",
                show(value)
            ));
        }
        match after {
            "" => (host, None),
            p => match p.strip_prefix(':') {
                Some(p) => (host, Some(p)),
                None => {
                    return Err(format!(
                        "{} has text after ']' that is not ':port'",
                        show(value)
                    ));
                }
            },
        }
    } else if value.matches(':').count() > 1 {
        return Err(format!(
            "{} looks like a bare IPv6 address; write it as [address]:port",
            show(value)
        ));
    } else {
        match value.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (value, None),
        }
    };
    host_name(host).map_err(|e| format!("{}: {e}", show(value)))?;
    let port = match port {
        None => default_port,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n > 0 => n,
            _ => {
                return Err(format!(
                    "{}: port {} is not in 1..=65535",
                    show(value),
                    show(p)
                ));
            }
        },
    };
    Ok((host.to_string(), port))
}

/// A number within an inclusive range, with its unit in the message.
pub fn in_range<T>(value: T, min: T, max: T, unit: &str) -> Result<(), String>
where
    T: PartialOrd + fmt::Display + Copy,
{
    if value < min || value > max {
        let unit = if unit.is_empty() {
            String::new()
        } else {
            format!(" {unit}")
        };
        Err(format!(
            "{value}{unit} is out of range: must be {min}..={max}{unit}"
        ))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LONG: usize = 10 * 1024;

    /// Values that must never pass any name-like rule.
    fn hostile() -> Vec<String> {
        vec![
            "<domain>".into(),
            "a&b".into(),
            "a\"b".into(),
            "a'b".into(),
            "../etc".into(),
            "a/b".into(),
            "a\0b".into(),
            "a\nb".into(),
            "a b".into(),
            "x".repeat(LONG),
        ]
    }

    #[test]
    fn dns1123_label_table() {
        for ok in ["a", "web-1", "0a", &"a".repeat(63)] {
            assert_eq!(dns1123_label(ok), Ok(()), "{ok:?}");
        }
        for bad in ["", "-a", "a-", "A", "a_b", "a.b", &"a".repeat(64), "é"] {
            assert!(dns1123_label(bad).is_err(), "{bad:?}");
        }
        for bad in hostile() {
            assert!(dns1123_label(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn dns1123_subdomain_table() {
        for ok in ["a", "cloud-init.v1", "a.b.c"] {
            assert_eq!(dns1123_subdomain(ok), Ok(()), "{ok:?}");
        }
        for bad in [
            "",
            ".a",
            "a.",
            "a..b",
            "A.b",
            &format!("{}.a", "a".repeat(64)),
        ] {
            assert!(dns1123_subdomain(bad).is_err(), "{bad:?}");
        }
        for bad in hostile() {
            assert!(dns1123_subdomain(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn secret_key_table() {
        for ok in ["user-data", "cloud_init.yaml", "A1"] {
            assert_eq!(secret_key(ok), Ok(()), "{ok:?}");
        }
        for bad in ["", ".", "..", "a/b", "a b"] {
            assert!(secret_key(bad).is_err(), "{bad:?}");
        }
        for bad in hostile() {
            assert!(secret_key(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn libvirt_object_name_table() {
        for ok in ["default", "vm_pool", "Pool.2", "p-1"] {
            assert_eq!(libvirt_object_name(ok), Ok(()), "{ok:?}");
        }
        for bad in ["", ".hidden", "-x", "_x", "a:b", &"a".repeat(64)] {
            assert!(libvirt_object_name(bad).is_err(), "{bad:?}");
        }
        for bad in hostile() {
            assert!(libvirt_object_name(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn interface_name_table() {
        for ok in ["br0", "virbr-egress", "br.100", "a_b", &"b".repeat(15)] {
            assert_eq!(interface_name(ok), Ok(()), "{ok:?}");
        }
        for bad in ["", ".", "..", "br 0", "br:0", "br/0", &"b".repeat(16)] {
            assert!(interface_name(bad).is_err(), "{bad:?}");
        }
        for bad in hostile() {
            assert!(interface_name(&bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            interface_name("br 0").unwrap_err(),
            "\"br 0\" is not a valid interface name: use letters, digits, '_', '.' and '-'"
        );
    }

    #[test]
    fn user_name_table() {
        for ok in ["egress", "_svc", "a-b_1"] {
            assert_eq!(user_name(ok), Ok(()), "{ok:?}");
        }
        for bad in ["", "Root", "1abc", "a b", "a;b", &"a".repeat(33)] {
            assert!(user_name(bad).is_err(), "{bad:?}");
        }
        for bad in hostile() {
            assert!(user_name(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn file_path_table() {
        for ok in ["/etc/ssh/key", "keys/id_ed25519", "../plugins/a.wasm"] {
            assert_eq!(file_path(ok), Ok(()), "{ok:?}");
        }
        for bad in ["", "a\0b", "a\nb", &"/a".repeat(2048)] {
            assert!(file_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn socket_path_table() {
        for ok in [
            "/var/run/libvirt/libvirt-sock",
            "/run/libvirt/libvirt-sock-ro",
        ] {
            assert_eq!(socket_path(ok), Ok(()), "{ok:?}");
        }
        for bad in [
            "",
            "relative/sock",
            "/var/run/../etc/shadow",
            "/var//run",
            "/var/./run",
            "/var/run/\0",
            "/var/run/a\nb",
            &format!("/{}", "s".repeat(107)),
        ] {
            assert!(socket_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn sha256_table() {
        let good = "a".repeat(64);
        assert_eq!(sha256_hex(&good), Ok(()));
        assert_eq!(sha256_hex(&"AB".repeat(32)), Ok(()));
        for bad in [
            &"a".repeat(63),
            &"a".repeat(65),
            &"g".repeat(64),
            "",
            &format!("{}\n", "a".repeat(63)),
        ] {
            assert!(sha256_hex(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn download_url_table() {
        use HttpPolicy::*;
        assert!(download_url("https://images.example.org/debian.qcow2", HttpsOnly).is_ok());
        assert!(download_url("http://127.0.0.1:8080/img", AllowHttp).is_ok());
        let cases = [
            (
                "http://images.example.org/a",
                HttpsOnly,
                "sets allowHttp: true",
            ),
            ("http://plugins.example.org/a", HttpsAlways, "no opt-out"),
            ("ftp://images.example.org/a", AllowHttp, "scheme \"ftp\""),
            ("file:///etc/passwd", HttpsOnly, "scheme \"file\""),
            (
                "https://user:pw@images.example.org/a",
                HttpsOnly,
                "credentials",
            ),
            ("https://images.example.org/a#frag", HttpsOnly, "fragment"),
            ("not a url", HttpsOnly, "not a valid URL"),
            ("https://exa\nmple.org/", HttpsOnly, "control"),
        ];
        for (value, policy, want) in cases {
            let err = download_url(value, policy).unwrap_err();
            assert!(err.contains(want), "{value:?}: {err}");
        }
        // A plugin URL has no allowHttp key: its refusal must not point at one.
        let err = download_url("http://plugins.example.org/a", HttpsAlways).unwrap_err();
        assert!(!err.contains("allowHttp"), "{err}");
        let err = download_url("https://user:hunter2@example.org/a", HttpsOnly).unwrap_err();
        assert!(!err.contains("hunter2"), "credential leaked into {err}");
        let long = format!("https://example.org/{}", "a".repeat(LONG));
        assert!(
            download_url(&long, HttpsOnly)
                .unwrap_err()
                .contains("too long")
        );
    }

    #[test]
    fn host_port_table() {
        assert_eq!(
            host_port("kvm-a.example.org:2222", 22),
            Ok(("kvm-a.example.org".into(), 2222))
        );
        assert_eq!(host_port("kvm-a", 22), Ok(("kvm-a".into(), 22)));
        assert_eq!(host_port("127.0.0.1:22", 22), Ok(("127.0.0.1".into(), 22)));
        assert_eq!(host_port("[::1]:2022", 22), Ok(("::1".into(), 2022)));
        assert_eq!(host_port("[::1]", 22), Ok(("::1".into(), 22)));
        for bad in [
            "",
            ":22",
            "host:0",
            "host:65536",
            "host:ssh",
            "::1",
            "[::1",
            "[nothex]:22",
            "[::1]x",
            "ho st:22",
            "-host:22",
            "a..b:22",
            "<x>:22",
            "h\n:22",
            &"x".repeat(LONG),
        ] {
            assert!(host_port(bad, 22).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn in_range_table() {
        assert_eq!(in_range(1, 1, 10, "vCPUs"), Ok(()));
        assert_eq!(in_range(10, 1, 10, "vCPUs"), Ok(()));
        assert_eq!(
            in_range(0, 1, 10, "vCPUs").unwrap_err(),
            "0 vCPUs is out of range: must be 1..=10 vCPUs"
        );
        assert!(in_range(11, 1, 10, "").is_err());
    }

    #[test]
    fn show_escapes_and_truncates() {
        assert_eq!(show("a\nb\0"), "\"a\\nb\\0\"");
        let s = show(&"x".repeat(LONG));
        assert!(s.len() < 120, "{s}");
        assert!(s.contains("10240 characters"));
    }

    #[test]
    fn problems_collect_in_order() {
        let mut p = Problems::new();
        p.check("a", Ok(()));
        p.check("b", Err("bad".into()));
        p.push("c", "worse");
        let v = p.into_vec();
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].to_string(), "b: bad");
        assert_eq!(v[1].to_string(), "c: worse");
    }
}
