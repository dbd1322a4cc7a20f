//! Vendor-data read the way the guest's cloud-init 22.4 (Debian 12) reads it, or refused.
//!
//! A check is only as good as its parser parity: a document we accept must mean the same
//! to the consumer. cloud-init decides the form from the bytes, not from what the document
//! claims (`user_data.py::convert_string`): the data is MIME iff `mime-version:` occurs,
//! ASCII case-insensitively, in its first 4096 bytes; then Python's `email` package
//! (compat32) parses it, `walk()` skips the multipart containers and every other part is
//! dispatched by its content type. Otherwise the whole text is one part whose type is
//! guessed from its first line. Cloud-config parts are loaded with PyYAML (YAML 1.1) and
//! merged, later top-level keys replacing earlier ones. This reader accepts only a subset
//! of both forms on which cloud-init's reading and ours agree (`tests/tests/vendor_parity.rs`
//! runs cloud-init's own library on a generated corpus), and refuses everything else with
//! a rule and a detail naming the part, header or line:
//!
//! - **plain**: first line `#cloud-config` (trailing spaces or tabs allowed: cloud-init
//!   matches the start), no `mime-version:` in the first 4096 characters (which cover the
//!   first 4096 bytes), line ends LF or CRLF, YAML as below;
//! - **MIME** ([`mime`]): a `multipart/mixed` document (any letter case) with the
//!   allow-listed headers (a header may be folded after a `;`, as Python's generator
//!   folds), one boundary, exact delimiter lines, any preamble and epilogue, 1 to
//!   [`MAX_PARTS`] parts, each a `text/x-shellscript` (starting with `#!`, named) or a
//!   `text/cloud-config` (YAML as below); parts `7bit`/`8bit` (ASCII only), `base64` or
//!   `quoted-printable` (decoded to UTF-8 first, as `cloud-init devel make-mime` writes);
//! - **YAML** ([`yaml`]): a document PyYAML 6's `safe_load` loads (no tabs outside quoted
//!   and block scalars, no directives, one document), top level a mapping (or empty), no
//!   tags, no `<<` merge keys or `merge_how`/`merge_type`, no duplicate keys, every key a
//!   string, top-level keys plain identifiers, and every unquoted value read the same by
//!   YAML 1.1 (cloud-init, [`yaml11`]) and YAML 1.2; the values we report are YAML 1.1's.

mod mime;
mod yaml;
mod yaml11;

pub use yaml::{CloudConfig, CloudConfigValue};

use std::collections::HashMap;
pub use yaml11::Scalar;

use super::{VENDOR_DATA_MAX, refuse, show};
use crate::templates::errors::TemplateErrorKind;

/// Most parts a MIME vendor-data may have; the default plugin writes one or two.
pub const MAX_PARTS: usize = 16;
/// How far cloud-init looks for `mime-version:` to decide that the data is MIME.
pub const MIME_VERSION_WINDOW: usize = 4096;
/// What cloud-init looks for (in lower case) to take the data as MIME.
const MIME_VERSION_MARK: &[u8] = b"mime-version:";
/// The first line of the plain form, and what cloud-init's `type_from_starts_with` looks
/// for at the start of a part.
const CLOUD_CONFIG_MARK: &str = "#cloud-config";

/// Which form the vendor-data has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VendorDataForm {
    /// One `#cloud-config` YAML document.
    CloudConfig,
    /// A `multipart/mixed` MIME document.
    Multipart,
}

/// The content type of an accepted part, as cloud-init dispatches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VendorPartType {
    /// `text/cloud-config`: YAML merged into the instance's configuration.
    CloudConfig,
    /// `text/x-shellscript`: written to `scripts/vendor/<filename>` and run once.
    ShellScript,
}

impl VendorPartType {
    /// The MIME type cloud-init ends up with for the part.
    pub fn mime_type(self) -> &'static str {
        match self {
            VendorPartType::CloudConfig => "text/cloud-config",
            VendorPartType::ShellScript => "text/x-shellscript",
        }
    }
}

/// One part as cloud-init will see it.
#[derive(Debug, Clone, PartialEq)]
pub struct VendorDataPart {
    /// The content type cloud-init dispatches on.
    pub content_type: VendorPartType,
    /// The file name from `Content-Disposition`; `None` in the plain form and for an unnamed
    /// cloud-config part (cloud-init then names it `part-NNN`).
    pub filename: Option<String>,
    /// The payload exactly as cloud-init's `fully_decoded_payload` returns it (base64 and
    /// quoted-printable parts decoded).
    pub payload: String,
    /// The top-level keys of a cloud-config part, in document order; empty for a script.
    pub cloud_config_keys: Vec<String>,
    /// A cloud-config part's top-level mapping as cloud-init's PyYAML reads it (YAML 1.1
    /// values); `None` for a script and for an empty document, which cloud-init skips.
    pub cloud_config: Option<CloudConfig>,
}

/// What the reader understood of an accepted vendor-data: the form and its parts in order.
#[derive(Debug, Clone, PartialEq)]
pub struct VendorDataReading {
    /// Plain `#cloud-config` or MIME multipart.
    pub form: VendorDataForm,
    /// The parts cloud-init dispatches, in order (one for the plain form).
    pub parts: Vec<VendorDataPart>,
    /// The cloud-config cloud-init ends up with: the parts' mappings merged in order by
    /// its default merger (`dict(replace)+list()+str()`), where a later top-level key
    /// replaces an earlier one in the earlier one's place.
    pub cloud_config: CloudConfig,
}

impl VendorDataReading {
    fn new(form: VendorDataForm, parts: Vec<VendorDataPart>) -> Self {
        let mut merged: CloudConfig = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        for map in parts.iter().filter_map(|p| p.cloud_config.as_ref()) {
            for (key, value) in map {
                match index.get(key) {
                    Some(&at) => merged[at].1 = value.clone(),
                    None => {
                        index.insert(key.clone(), merged.len());
                        merged.push((key.clone(), value.clone()));
                    }
                }
            }
        }
        VendorDataReading {
            form,
            parts,
            cloud_config: merged,
        }
    }
}

/// Reads rendered vendor-data as cloud-init will, or refuses it (see the module doc).
pub fn read_vendor_data(text: &str) -> Result<VendorDataReading, TemplateErrorKind> {
    if text.len() > VENDOR_DATA_MAX {
        return Err(TemplateErrorKind::OutputTooLarge {
            size: text.len(),
            max: VENDOR_DATA_MAX,
        });
    }
    let first = text.split('\n').next().unwrap_or_default();
    if plain_first_line(first) {
        check_characters(text, LineEnds::LfOrCrlf)?;
        return read_plain(text);
    }
    check_characters(text, LineEnds::Lf)?;
    if mime_version_in_window(text) || header_like(first) {
        return mime::read(text);
    }
    Err(refuse(
        "vendor-data-format",
        format!(
            "line 1 is {}: the document must start with a `#cloud-config` line, or be a \
             MIME multipart document starting with its headers",
            show(first)
        ),
    ))
}

/// `#cloud-config`, then nothing but spaces and tabs (and the CR of a CRLF): cloud-init
/// takes any text starting with it as cloud-config, and to PyYAML the line is a comment.
fn plain_first_line(line: &str) -> bool {
    line.strip_prefix(CLOUD_CONFIG_MARK).is_some_and(|rest| {
        let rest = rest.strip_suffix('\r').unwrap_or(rest);
        rest.bytes().all(|b| b == b' ' || b == b'\t')
    })
}

/// Which line ends a form allows.
#[derive(Clone, Copy, PartialEq, Eq)]
enum LineEnds {
    /// LF only: Python's email parser ends a line at a bare CR and keeps CRs in payloads.
    Lf,
    /// LF or CRLF: the plain form goes to PyYAML whole, which reads CRLF as one line end.
    LfOrCrlf,
}

/// Refuses NUL, CR (but in a CRLF where allowed) and every other control character but
/// `\n` and `\t`, and the characters some readers take as line ends or markers (NEL,
/// U+2028, U+2029, BOM, U+FFFE, U+FFFF): PyYAML breaks lines at NEL, LS and PS.
fn check_characters(text: &str, ends: LineEnds) -> Result<(), TemplateErrorKind> {
    for (index, line) in text.split('\n').enumerate() {
        let line = match ends {
            LineEnds::LfOrCrlf => line.strip_suffix('\r').unwrap_or(line),
            LineEnds::Lf => line,
        };
        for (column, c) in line.chars().enumerate() {
            let bad = (c.is_control() && c != '\t')
                || matches!(
                    c,
                    '\u{2028}' | '\u{2029}' | '\u{FEFF}' | '\u{FFFE}' | '\u{FFFF}'
                );
            if bad {
                let why = match c {
                    '\r' => " (carriage return: a line end of its own to Python's email parser)",
                    '\0' => " (NUL)",
                    '\u{85}' | '\u{2028}' | '\u{2029}' => " (a line break to YAML 1.1)",
                    _ => "",
                };
                let allowed = match ends {
                    LineEnds::Lf => "only `\\n` and `\\t` are allowed",
                    LineEnds::LfOrCrlf => "only `\\n`, `\\r\\n` and `\\t` are allowed",
                };
                return Err(refuse(
                    "control-character",
                    format!(
                        "line {}, column {}: U+{:04X}{why}; {allowed}",
                        index + 1,
                        column + 1,
                        u32::from(c)
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Whether cloud-init takes the data as MIME: `mime-version:` in its first 4096 bytes.
fn mime_version_in_window(text: &str) -> bool {
    let window = &text.as_bytes()[..text.len().min(MIME_VERSION_WINDOW)];
    contains_mark(window)
}

fn contains_mark(bytes: &[u8]) -> bool {
    bytes
        .windows(MIME_VERSION_MARK.len())
        .any(|w| w.eq_ignore_ascii_case(MIME_VERSION_MARK))
}

/// Whether a line is a header line to Python's email parser (`Name:` with printable
/// non-space name characters), so that a header block missing MIME-Version is refused as
/// such rather than as an unknown format.
fn header_like(line: &str) -> bool {
    line.split_once(':')
        .is_some_and(|(name, _)| !name.is_empty() && name.bytes().all(header_name_byte))
}

/// A byte of a header name as Python's feedparser accepts it (`[\041-\071\073-\176]`).
fn header_name_byte(b: u8) -> bool {
    (0x21..=0x7e).contains(&b) && b != b':'
}

fn read_plain(text: &str) -> Result<VendorDataReading, TemplateErrorKind> {
    // The first 4096 characters cover the first 4096 bytes cloud-init looks at.
    let end = text
        .char_indices()
        .nth(MIME_VERSION_WINDOW)
        .map_or(text.len(), |(i, _)| i);
    if let Some(line) = text[..end]
        .split('\n')
        .position(|l| contains_mark(l.as_bytes()))
    {
        return Err(refuse(
            "vendor-data-format",
            format!(
                "line {}: `MIME-Version:` within the first {MIME_VERSION_WINDOW} characters \
                 makes cloud-init parse this `#cloud-config` document as MIME",
                line + 1
            ),
        ));
    }
    let source = yaml::Source {
        name: "the #cloud-config document",
        first_line: 1,
        decoded: false,
    };
    let cloud_config = read_cloud_config(text, &source)?;
    Ok(VendorDataReading::new(
        VendorDataForm::CloudConfig,
        vec![VendorDataPart {
            content_type: VendorPartType::CloudConfig,
            filename: None,
            payload: text.to_string(),
            cloud_config_keys: keys_of(cloud_config.as_ref()),
            cloud_config,
        }],
    ))
}

fn keys_of(config: Option<&CloudConfig>) -> Vec<String> {
    config.map_or_else(Vec::new, |c| c.iter().map(|(k, _)| k.clone()).collect())
}

/// Reads a cloud-config YAML document ([`yaml::read`]).
fn read_cloud_config(
    text: &str,
    source: &yaml::Source<'_>,
) -> Result<Option<CloudConfig>, TemplateErrorKind> {
    yaml::read(text, source)
}

#[cfg(test)]
mod tests;
