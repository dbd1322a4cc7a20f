//! Vendor-data read the way the guest's cloud-init 22.4 (Debian 12) reads it, or refused.
//!
//! A check is only as good as its parser parity: a document we accept must mean the same
//! to the consumer. cloud-init decides the form from the bytes, not from what the document
//! claims (`user_data.py::convert_string`): the data is MIME iff `mime-version:` occurs,
//! ASCII case-insensitively, in its first 4096 bytes; then Python's `email` package
//! (compat32) parses it, `walk()` skips the multipart containers and every other part is
//! dispatched by its content type. Otherwise the whole text is one part whose type is
//! guessed from its first line. This reader accepts only a small, unambiguous subset of
//! both forms, on which Python's reading and ours agree byte for byte
//! (`tests/tests/vendor_parity.rs` runs Python on them), and refuses everything else with
//! a rule and a detail naming the part, header or line:
//!
//! - **plain**: first line exactly `#cloud-config`, no `mime-version:` in the first 4096
//!   characters (which cover the first 4096 bytes), YAML as below;
//! - **MIME**: a `multipart/mixed` document with the allow-listed headers, one boundary,
//!   exact delimiter lines, 1 to [`MAX_PARTS`] parts, each a `text/x-shellscript` (starting
//!   with `#!`, named) or a `text/cloud-config` (YAML as below), ASCII only;
//! - **YAML**: parses with serde_yaml_ng, top level a mapping (or empty), no tags, no `<<`
//!   merge keys, no duplicate keys, every key a string that YAML 1.1 (PyYAML's
//!   `safe_load`) reads as a string too, top-level keys plain identifiers.

use serde_yaml_ng::Value;

use super::{VENDOR_DATA_MAX, refuse, show};
use crate::templates::errors::TemplateErrorKind;

/// Most parts a MIME vendor-data may have; the default plugin writes one or two.
pub const MAX_PARTS: usize = 16;
/// How far cloud-init looks for `mime-version:` to decide that the data is MIME.
pub const MIME_VERSION_WINDOW: usize = 4096;
/// Longest boundary RFC 2046 allows.
const BOUNDARY_MAX: usize = 70;
/// Longest part file name: it becomes a file name under `scripts/vendor/`.
const FILENAME_MAX: usize = 64;
/// What cloud-init looks for (in lower case) to take the data as MIME.
const MIME_VERSION_MARK: &[u8] = b"mime-version:";
/// Headers allowed at the top and in each part (lower case, as compared).
const ALLOWED_HEADERS: [&str; 4] = [
    "content-type",
    "mime-version",
    "content-transfer-encoding",
    "content-disposition",
];
/// The allow-list of part types, as printed in refusals.
const ALLOWED_TYPES: &str = "text/x-shellscript, text/cloud-config";
/// Stands in for `!` when looking for YAML tags (see [`check_no_tags`]): a private-use
/// character, which is never syntax in YAML and never makes a scalar a number or bool.
const BANG_STAND_IN: char = '\u{E000}';

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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VendorDataPart {
    /// The content type cloud-init dispatches on.
    pub content_type: VendorPartType,
    /// The file name from `Content-Disposition`; `None` in the plain form and for an unnamed
    /// cloud-config part (cloud-init then names it `part-NNN`).
    pub filename: Option<String>,
    /// The payload exactly as cloud-init's `fully_decoded_payload` returns it.
    pub payload: String,
    /// The top-level keys of a cloud-config part, in document order; empty for a script.
    pub cloud_config_keys: Vec<String>,
}

/// What the reader understood of an accepted vendor-data: the form and its parts in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VendorDataReading {
    /// Plain `#cloud-config` or MIME multipart.
    pub form: VendorDataForm,
    /// The parts cloud-init dispatches, in order (one for the plain form).
    pub parts: Vec<VendorDataPart>,
}

/// Reads rendered vendor-data as cloud-init will, or refuses it (see the module doc).
pub fn read_vendor_data(text: &str) -> Result<VendorDataReading, TemplateErrorKind> {
    if text.len() > VENDOR_DATA_MAX {
        return Err(TemplateErrorKind::OutputTooLarge {
            size: text.len(),
            max: VENDOR_DATA_MAX,
        });
    }
    check_characters(text)?;
    let first = text.split('\n').next().unwrap_or_default();
    if first == "#cloud-config" {
        return read_plain(text);
    }
    if mime_version_in_window(text) || header_like(first) {
        return read_mime(text);
    }
    Err(refuse(
        "vendor-data-format",
        format!(
            "line 1 is {}: the document must start with a line that is exactly \
             `#cloud-config`, or be a MIME multipart document starting with its headers",
            show(first)
        ),
    ))
}

/// Refuses NUL, CR and every other control character but `\n` and `\t`, and the characters
/// some readers take as line ends or markers (NEL, U+2028, U+2029, BOM, U+FFFE, U+FFFF).
/// Python's email parser ends a line at a bare CR; PyYAML breaks lines at NEL, LS and PS.
fn check_characters(text: &str) -> Result<(), TemplateErrorKind> {
    for (index, line) in text.split('\n').enumerate() {
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
                return Err(refuse(
                    "control-character",
                    format!(
                        "line {}, column {}: U+{:04X}{why}; only `\\n` and `\\t` are allowed",
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
    let keys = check_cloud_config(text, "the #cloud-config document")?;
    Ok(VendorDataReading {
        form: VendorDataForm::CloudConfig,
        parts: vec![VendorDataPart {
            content_type: VendorPartType::CloudConfig,
            filename: None,
            payload: text.to_string(),
            cloud_config_keys: keys,
        }],
    })
}

/// The lines of the document, numbered from 1, split at `\n` only (no CR is left).
struct Lines<'a> {
    lines: Vec<&'a str>,
}

impl<'a> Lines<'a> {
    fn get(&self, index: usize) -> Option<&'a str> {
        self.lines.get(index).copied()
    }
}

/// A header block: the lower-case names with their values and line numbers.
struct Headers<'a> {
    entries: Vec<(String, &'a str, usize)>,
}

impl<'a> Headers<'a> {
    fn get(&self, name: &str) -> Option<(&'a str, usize)> {
        self.entries
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, v, l)| (*v, *l))
    }
}

/// Where a header block sits, for refusals: the top level or part N.
#[derive(Clone, Copy)]
enum Scope {
    Top,
    Part(usize),
}

impl Scope {
    fn header_rule(self) -> &'static str {
        match self {
            Scope::Top => "mime-header",
            Scope::Part(_) => "mime-part-header",
        }
    }

    fn name(self) -> String {
        match self {
            Scope::Top => "top-level headers".to_string(),
            Scope::Part(n) => format!("part {n}"),
        }
    }
}

/// Parses a header block from `start` (0-based line index) up to its empty line, within
/// `end`. Returns the headers and the index of the line after the empty one.
fn parse_headers<'a>(
    lines: &Lines<'a>,
    start: usize,
    end: usize,
    scope: Scope,
) -> Result<(Headers<'a>, usize), TemplateErrorKind> {
    let rule = scope.header_rule();
    let mut entries: Vec<(String, &'a str, usize)> = Vec::new();
    let mut index = start;
    loop {
        let number = index + 1;
        let Some(line) = lines.get(index).filter(|_| index < end) else {
            return Err(refuse(
                rule,
                format!(
                    "{}: the header block starting at line {} ends without an empty line",
                    scope.name(),
                    start + 1
                ),
            ));
        };
        if line.is_empty() {
            return Ok((Headers { entries }, index + 1));
        }
        if line.starts_with([' ', '\t']) {
            return Err(refuse(
                rule,
                format!(
                    "{}, line {number}: a folded (continuation) header line {}; headers must \
                     fit on one line",
                    scope.name(),
                    show(line)
                ),
            ));
        }
        let Some((name, value)) = line
            .split_once(':')
            .filter(|(n, _)| !n.is_empty() && n.bytes().all(header_name_byte))
        else {
            return Err(refuse(
                rule,
                format!(
                    "{}, line {number}: {} is not a header line, and the header block must end \
                     with an empty line",
                    scope.name(),
                    show(line)
                ),
            ));
        };
        let lower = name.to_ascii_lowercase();
        if !ALLOWED_HEADERS.contains(&lower.as_str()) {
            return Err(refuse(
                rule,
                format!(
                    "{}, line {number}: header {} is not in the allow-list (Content-Type, \
                     MIME-Version, Content-Transfer-Encoding, Content-Disposition)",
                    scope.name(),
                    show(name)
                ),
            ));
        }
        if let Some((_, _, first)) = entries.iter().find(|(n, _, _)| *n == lower) {
            return Err(refuse(
                rule,
                format!(
                    "{}, line {number}: header {} repeats line {first}; Python's email reads \
                     only the first",
                    scope.name(),
                    show(name)
                ),
            ));
        }
        // Python strips spaces and tabs after the colon and keeps trailing ones.
        let value = value.trim_start_matches([' ', '\t']);
        if value.is_empty() || value.ends_with([' ', '\t']) {
            return Err(refuse(
                rule,
                format!(
                    "{}, line {number}: header {} has an empty value or trailing whitespace",
                    scope.name(),
                    show(name)
                ),
            ));
        }
        entries.push((lower, value, number));
        index += 1;
    }
}

/// A header value `type[; name=value]*` split as Python's `_splitparam`/`_parseparam` do,
/// restricted to what reads the same everywhere: no whitespace but after `;`, names once,
/// values a token or a quoted string without backslash.
struct Params<'a> {
    kind: &'a str,
    /// Lower-case name, value (unquoted), whether it was quoted.
    params: Vec<(String, &'a str, bool)>,
}

impl<'a> Params<'a> {
    fn get(&self, name: &str) -> Option<(&'a str, bool)> {
        self.params
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, v, q)| (*v, *q))
    }
}

/// RFC 2045 token characters: printable ASCII but space and tspecials.
fn token_byte(b: u8) -> bool {
    (0x21..=0x7e).contains(&b) && !b"()<>@,;:\\\"/[]?=".contains(&b)
}

fn parse_params(value: &str) -> Result<Params<'_>, String> {
    let (kind, mut rest) = match value.find(';') {
        Some(i) => (&value[..i], &value[i..]),
        None => (value, ""),
    };
    let mut params: Vec<(String, &str, bool)> = Vec::new();
    while let Some(after) = rest.strip_prefix(';') {
        let after = after.trim_start_matches(' ');
        let Some((name, tail)) = after.split_once('=') else {
            return Err(format!("parameter {} has no `=`", show(after)));
        };
        if name.is_empty() || !name.bytes().all(token_byte) {
            return Err(format!("parameter name {} is not a token", show(name)));
        }
        let (val, next, was_quoted) = if let Some(quoted) = tail.strip_prefix('"') {
            let Some(close) = quoted.find('"') else {
                return Err(format!("parameter {} has no closing quote", show(name)));
            };
            let inner = &quoted[..close];
            if inner.contains('\\') {
                return Err(format!(
                    "parameter {} has a backslash in its quoted value",
                    show(name)
                ));
            }
            (inner, &quoted[close + 1..], true)
        } else {
            let end = tail.find(';').unwrap_or(tail.len());
            let token = &tail[..end];
            if token.is_empty() || !token.bytes().all(token_byte) {
                return Err(format!(
                    "parameter {} has the value {}, which is neither a token nor a quoted string",
                    show(name),
                    show(token)
                ));
            }
            (token, &tail[end..], false)
        };
        if !(next.is_empty() || next.starts_with(';')) || next == ";" {
            return Err(format!(
                "unexpected {} after parameter {}",
                show(next),
                show(name)
            ));
        }
        let lower = name.to_ascii_lowercase();
        if params.iter().any(|(n, _, _)| *n == lower) {
            return Err(format!(
                "parameter {} appears twice; Python's email reads only the first",
                show(name)
            ));
        }
        params.push((lower, val, was_quoted));
        rest = next;
    }
    Ok(Params { kind, params })
}

/// Refuses parameters other than `allowed`.
fn only_params(params: &Params<'_>, allowed: &[&str]) -> Result<(), String> {
    match params
        .params
        .iter()
        .find(|(n, _, _)| !allowed.contains(&n.as_str()))
    {
        Some((name, _, _)) => Err(format!(
            "parameter {} is not in the allow-list ({})",
            show(name),
            if allowed.is_empty() {
                "none".to_string()
            } else {
                allowed.join(", ")
            }
        )),
        None => Ok(()),
    }
}

/// RFC 2046 `bchars` (digits, letters, `'()+_,-./:=?` and space), 1–70 of them, not ending
/// in a space. Unquoted, only those that are also token characters.
fn check_boundary(boundary: &str, quoted: bool) -> Result<(), String> {
    let bchar = |b: u8| b.is_ascii_alphanumeric() || b"'()+_,-./:=? ".contains(&b);
    if boundary.is_empty() || boundary.len() > BOUNDARY_MAX {
        return Err(format!(
            "boundary {} must have 1 to {BOUNDARY_MAX} characters",
            show(boundary)
        ));
    }
    if let Some(b) = boundary.bytes().find(|&b| !bchar(b)) {
        return Err(format!(
            "boundary {} has {:?}, which is not an RFC 2046 boundary character",
            show(boundary),
            char::from(b)
        ));
    }
    if boundary.ends_with(' ') {
        return Err(format!(
            "boundary {} ends in a space, which Python strips",
            show(boundary)
        ));
    }
    if !quoted && !boundary.bytes().all(token_byte) {
        return Err(format!(
            "boundary {} must be quoted: it has characters a token may not have",
            show(boundary)
        ));
    }
    Ok(())
}

/// MIME-Version, where present, must be `1.0`; Content-Transfer-Encoding `7bit` or `8bit`.
fn check_common_headers(headers: &Headers<'_>, scope: Scope) -> Result<(), TemplateErrorKind> {
    let rule = scope.header_rule();
    if let Some((value, line)) = headers.get("mime-version")
        && value != "1.0"
    {
        return Err(refuse(
            rule,
            format!(
                "{}, line {line}: MIME-Version is {}; only `1.0` is accepted",
                scope.name(),
                show(value)
            ),
        ));
    }
    if let Some((value, line)) = headers.get("content-transfer-encoding")
        && value != "7bit"
        && value != "8bit"
    {
        return Err(refuse(
            rule,
            format!(
                "{}, line {line}: Content-Transfer-Encoding {} is not in the allow-list \
                     (7bit, 8bit); encoded payloads (base64, quoted-printable) are refused",
                scope.name(),
                show(value)
            ),
        ));
    }
    Ok(())
}

/// `attachment; filename="NAME"` with NAME a plain file name; returns it.
fn read_disposition(
    headers: &Headers<'_>,
    scope: Scope,
) -> Result<Option<String>, TemplateErrorKind> {
    let Some((value, line)) = headers.get("content-disposition") else {
        return Ok(None);
    };
    let at = format!("{}, line {line}", scope.name());
    let params = parse_params(value).map_err(|e| {
        refuse(
            scope.header_rule(),
            format!("{at}: Content-Disposition: {e}"),
        )
    })?;
    let filename = match params.get("filename") {
        Some((name, true)) if params.kind == "attachment" && params.params.len() == 1 => name,
        _ => {
            return Err(refuse(
                scope.header_rule(),
                format!(
                    "{at}: Content-Disposition {} must be exactly `attachment; filename=\"...\"`",
                    show(value)
                ),
            ));
        }
    };
    let valid_chars = filename
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    let why = if filename.is_empty() || filename.len() > FILENAME_MAX || !valid_chars {
        Some(format!(
            "must be 1 to {FILENAME_MAX} of `A-Z a-z 0-9 . _ -`"
        ))
    } else if filename.starts_with('.') {
        Some("must not start with `.`".to_string())
    } else if filename.to_ascii_lowercase().starts_with("part-") {
        Some("must not start with `part-`, the names cloud-init gives unnamed parts".to_string())
    } else {
        None
    };
    if let Some(why) = why {
        return Err(refuse(
            "mime-filename",
            format!("{at}: filename {} {why}", show(filename)),
        ));
    }
    Ok(Some(filename.to_string()))
}

fn read_mime(text: &str) -> Result<VendorDataReading, TemplateErrorKind> {
    if !mime_version_in_window(text) {
        return Err(refuse(
            "mime-multipart",
            format!(
                "no `MIME-Version:` in the first {MIME_VERSION_WINDOW} bytes: cloud-init \
                 would read the document as one plain text part (and ignore it), not as MIME"
            ),
        ));
    }
    let lines = Lines {
        lines: text.split('\n').collect(),
    };
    let total = lines.lines.len();
    let (headers, body) = parse_headers(&lines, 0, total, Scope::Top)?;
    if headers.get("mime-version").is_none() {
        return Err(refuse(
            "mime-header",
            "top-level headers: no MIME-Version header (`mime-version:` occurs elsewhere)",
        ));
    }
    check_common_headers(&headers, Scope::Top)?;
    read_disposition(&headers, Scope::Top)?;
    let Some((content_type, ct_line)) = headers.get("content-type") else {
        return Err(refuse(
            "mime-header",
            "top-level headers: no Content-Type header",
        ));
    };
    let params = parse_params(content_type).map_err(|e| {
        refuse(
            "mime-header",
            format!("top-level headers, line {ct_line}: Content-Type: {e}"),
        )
    })?;
    if params.kind != "multipart/mixed" {
        return Err(refuse(
            "mime-header",
            format!(
                "top-level headers, line {ct_line}: Content-Type {} must be `multipart/mixed`",
                show(params.kind)
            ),
        ));
    }
    only_params(&params, &["boundary"]).map_err(|e| {
        refuse(
            "mime-header",
            format!("top-level headers, line {ct_line}: Content-Type: {e}"),
        )
    })?;
    let Some((boundary, quoted)) = params.get("boundary") else {
        return Err(refuse(
            "mime-boundary",
            format!("top-level headers, line {ct_line}: Content-Type has no boundary parameter"),
        ));
    };
    check_boundary(boundary, quoted).map_err(|e| {
        refuse(
            "mime-boundary",
            format!("top-level headers, line {ct_line}: {e}"),
        )
    })?;

    let delimiter = format!("--{boundary}");
    let close = format!("--{boundary}--");
    // Indices of delimiter lines; the close delimiter ends the scan.
    let mut delimiters: Vec<usize> = Vec::new();
    let mut close_at = None;
    for (index, line) in lines.lines.iter().enumerate().skip(body) {
        let number = index + 1;
        if *line == delimiter {
            delimiters.push(index);
        } else if *line == close {
            close_at = Some(index);
            break;
        } else if line.starts_with(&delimiter) {
            return Err(refuse(
                "mime-boundary",
                format!(
                    "line {number}: {} starts with the delimiter `{delimiter}` but is not \
                     exactly it or the close delimiter; Python's email takes such lines as \
                     delimiters when only spaces or tabs follow, as text otherwise",
                    show(line)
                ),
            ));
        } else if delimiters.is_empty() && !line.is_empty() {
            return Err(refuse(
                "mime-multipart",
                format!(
                    "line {number}: {} before the first delimiter `{delimiter}`: the preamble \
                     must be empty",
                    show(line)
                ),
            ));
        }
    }
    if delimiters.is_empty() {
        return Err(refuse(
            "mime-multipart",
            format!("the body has no delimiter line `{delimiter}` before any close delimiter"),
        ));
    }
    let Some(close_at) = close_at else {
        return Err(refuse(
            "mime-multipart",
            format!(
                "no close delimiter `{close}`: Python's email would run the last part to the \
                 end of the document"
            ),
        ));
    };
    if let Some(offset) = lines.lines[close_at + 1..]
        .iter()
        .position(|l| !l.is_empty())
    {
        let number = close_at + 2 + offset;
        return Err(refuse(
            "mime-multipart",
            format!(
                "line {number}: text after the close delimiter `{close}` (epilogue), which \
                 cloud-init ignores"
            ),
        ));
    }
    if delimiters.len() > MAX_PARTS {
        return Err(refuse(
            "mime-multipart",
            format!(
                "{} parts; at most {MAX_PARTS} are accepted",
                delimiters.len()
            ),
        ));
    }
    let mut parts: Vec<VendorDataPart> = Vec::new();
    for (i, &start) in delimiters.iter().enumerate() {
        let end = delimiters.get(i + 1).copied().unwrap_or(close_at);
        let part = read_part(&lines, start + 1, end, i + 1)?;
        if let Some(name) = &part.filename
            && let Some(other) = parts.iter().position(|p| {
                p.filename
                    .as_deref()
                    .is_some_and(|n| n.eq_ignore_ascii_case(name))
            })
        {
            return Err(refuse(
                "mime-filename",
                format!(
                    "part {} (filename {}): part {} has the same file name; one would \
                         overwrite the other under scripts/vendor/",
                    i + 1,
                    show(name),
                    other + 1
                ),
            ));
        }
        parts.push(part);
    }
    Ok(VendorDataReading {
        form: VendorDataForm::Multipart,
        parts,
    })
}

/// Reads part `number` from its lines `[start, end)` (between two delimiter lines).
fn read_part(
    lines: &Lines<'_>,
    start: usize,
    end: usize,
    number: usize,
) -> Result<VendorDataPart, TemplateErrorKind> {
    let scope = Scope::Part(number);
    let (headers, body) = parse_headers(lines, start, end, scope)?;
    check_common_headers(&headers, scope)?;
    let filename = read_disposition(&headers, scope)?;
    let name = match &filename {
        Some(f) => format!("part {number} (filename {})", show(f)),
        None => format!("part {number}"),
    };
    let Some((content_type, ct_line)) = headers.get("content-type") else {
        return Err(refuse(
            "mime-part-header",
            format!(
                "{name}: no Content-Type header (Python's email would take it as text/plain \
                 and cloud-init would guess its type from its first line)"
            ),
        ));
    };
    let params = parse_params(content_type).map_err(|e| {
        refuse(
            "mime-part-header",
            format!("{name}, line {ct_line}: Content-Type: {e}"),
        )
    })?;
    let kind = match params.kind {
        "text/x-shellscript" => VendorPartType::ShellScript,
        "text/cloud-config" => VendorPartType::CloudConfig,
        other => {
            let hint = if other.to_ascii_lowercase().starts_with("multipart/") {
                " (no nested multipart)"
            } else {
                ""
            };
            return Err(refuse(
                "mime-part-type",
                format!(
                    "{name}, line {ct_line}: content type {}{hint} is not in the allow-list \
                     ({ALLOWED_TYPES})",
                    show(other)
                ),
            ));
        }
    };
    only_params(&params, &["charset"]).map_err(|e| {
        refuse(
            "mime-part-header",
            format!("{name}, line {ct_line}: Content-Type: {e}"),
        )
    })?;
    if let Some((charset, _)) = params.get("charset")
        && charset != "us-ascii"
        && charset != "utf-8"
    {
        return Err(refuse(
            "mime-part-header",
            format!(
                "{name}, line {ct_line}: charset {} is not in the allow-list (us-ascii, \
                     utf-8)",
                show(charset)
            ),
        ));
    }
    let payload = lines.lines[body.min(end)..end].join("\n");
    // Python's email hands cloud-init a non-ASCII payload as raw-unicode-escape bytes
    // (`é` becomes the byte 0xE9, `€` the text `\u20ac`), which cloud-init then decodes as
    // UTF-8 with surrogate escapes: the guest would read something else, so ASCII only.
    for (offset, line) in lines.lines[body.min(end)..end].iter().enumerate() {
        if let Some(c) = line.chars().find(|c| !c.is_ascii()) {
            return Err(refuse(
                "mime-part-ascii",
                format!(
                    "{name}, line {}: non-ASCII character U+{:04X}; Python's email passes a \
                     non-ASCII MIME payload to cloud-init mangled (raw-unicode-escape), so \
                     MIME parts must be ASCII (the plain #cloud-config form may be UTF-8)",
                    body + offset + 1,
                    u32::from(c)
                ),
            ));
        }
    }
    let cloud_config_keys = match kind {
        VendorPartType::ShellScript => {
            if filename.is_none() {
                return Err(refuse(
                    "mime-filename",
                    format!(
                        "{name}: a text/x-shellscript part needs `Content-Disposition: \
                         attachment; filename=\"...\"`: cloud-init would name it part-NNN"
                    ),
                ));
            }
            if !payload.starts_with("#!") {
                return Err(refuse(
                    "mime-part-type",
                    format!(
                        "{name}: a text/x-shellscript part must start with `#!`; cloud-init \
                         re-guesses its type from the first line (`#include` fetches URLs)"
                    ),
                ));
            }
            Vec::new()
        }
        VendorPartType::CloudConfig => check_cloud_config(&payload, &name)?,
    };
    Ok(VendorDataPart {
        content_type: kind,
        filename,
        payload,
        cloud_config_keys,
    })
}

/// Checks a cloud-config YAML document (see the module doc) and returns its top-level keys.
fn check_cloud_config(yaml: &str, name: &str) -> Result<Vec<String>, TemplateErrorKind> {
    let doc: Value = serde_yaml_ng::from_str(yaml).map_err(|e| {
        let msg = e.to_string();
        if msg.contains("duplicate entry") {
            refuse(
                "cloud-config-yaml",
                format!(
                    "{name}: {msg}: PyYAML keeps the last of duplicate keys silently, so \
                     they are refused"
                ),
            )
        } else {
            refuse(
                "cloud-config-yaml",
                format!("{name}: does not parse as YAML: {msg}"),
            )
        }
    })?;
    check_no_tags(yaml, &doc, name)?;
    let map = match &doc {
        Value::Null => return Ok(Vec::new()),
        Value::Mapping(map) => map,
        other => {
            return Err(refuse(
                "cloud-config-yaml",
                format!(
                    "{name}: the top level is {}; it must be a mapping",
                    kind_of(other)
                ),
            ));
        }
    };
    let mut keys = Vec::new();
    for (key, value) in map {
        let key = check_key(key, "", name)?;
        if !top_level_key(&key) {
            return Err(refuse(
                "cloud-config-key",
                format!(
                    "{name}: top-level key {} must be a plain identifier `[a-z_][a-z0-9_]*` and \
                     not a YAML 1.1 boolean or null word (y, n, yes, no, on, off, true, false, \
                     null)",
                    show(&key)
                ),
            ));
        }
        check_value(value, &key, name)?;
        keys.push(key);
    }
    Ok(keys)
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a mapping",
        Value::Tagged(_) => "a tagged value",
    }
}

/// Walks a value: every mapping key checked by [`check_key`].
fn check_value(value: &Value, path: &str, name: &str) -> Result<(), TemplateErrorKind> {
    match value {
        Value::Mapping(map) => {
            for (key, value) in map {
                let key = check_key(key, path, name)?;
                check_value(value, &format!("{path}.{key}"), name)?;
            }
            Ok(())
        }
        Value::Sequence(items) => {
            for (i, item) in items.iter().enumerate() {
                check_value(item, &format!("{path}[{i}]"), name)?;
            }
            Ok(())
        }
        Value::Tagged(tagged) => Err(refuse(
            "cloud-config-tag",
            format!("{name}: {path} has the YAML tag {}", tagged.tag),
        )),
        _ => Ok(()),
    }
}

/// A mapping key must be a string that YAML 1.1 reads as a string as well, so that PyYAML
/// and we see the same keys and the same duplicates (PyYAML would take `yes` and `true`, or
/// `1` and `0x1`, as one key); `<<` is PyYAML's merge key.
fn check_key(key: &Value, path: &str, name: &str) -> Result<String, TemplateErrorKind> {
    let at = if path.is_empty() {
        "the top level".to_string()
    } else {
        path.to_string()
    };
    let Value::String(key) = key else {
        return Err(refuse(
            "cloud-config-key",
            format!(
                "{name}: {at} has a key that is {}; keys must be strings",
                kind_of(key)
            ),
        ));
    };
    if key == "<<" {
        return Err(refuse(
            "cloud-config-merge-key",
            format!("{name}: {at} has a `<<` merge key, which PyYAML merges and we do not"),
        ));
    }
    if yaml11_not_a_string(key) {
        return Err(refuse(
            "cloud-config-key",
            format!(
                "{name}: {at} has the key {}, which YAML 1.1 (PyYAML) reads as a boolean, \
                 number, null, timestamp or special value when unquoted",
                show(key)
            ),
        ));
    }
    Ok(key.clone())
}

/// `[a-z_][a-z0-9_]*` and no YAML 1.1 boolean or null word.
fn top_level_key(key: &str) -> bool {
    let mut bytes = key.bytes();
    let first_ok = bytes
        .next()
        .is_some_and(|b| b.is_ascii_lowercase() || b == b'_');
    first_ok
        && bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && !is_bool_or_null_word(key)
}

fn is_bool_or_null_word(word: &str) -> bool {
    const WORDS: [&str; 11] = [
        "y", "n", "yes", "no", "on", "off", "true", "false", "null", "~", "",
    ];
    WORDS.iter().any(|w| w.eq_ignore_ascii_case(word))
}

/// Whether PyYAML's implicit resolvers may read this plain scalar as something other than a
/// string. A superset of its bool, null, int, float, timestamp, merge and value patterns:
/// anything that starts like a number (after an optional sign, a digit or a dot) and
/// consists of number characters only, or starts with a date.
fn yaml11_not_a_string(key: &str) -> bool {
    if is_bool_or_null_word(key) || key == "=" || key == "<<" {
        return true;
    }
    let unsigned = key.strip_prefix(['+', '-']).unwrap_or(key);
    let starts_numeric = unsigned
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_digit() || b == b'.');
    let number_chars = unsigned
        .bytes()
        .all(|b| b.is_ascii_hexdigit() || b"xXoO_.:+-iInN".contains(&b));
    let date = key.len() >= 5
        && key.as_bytes()[..4].iter().all(u8::is_ascii_digit)
        && key.as_bytes()[4] == b'-';
    (starts_numeric && number_chars) || date
}

/// Refuses YAML tags. serde_yaml_ng drops `!!`-tags (`!!str`, `!!python/object`, `!<...>`)
/// silently, while PyYAML's `safe_load` resolves or refuses them, so tags are found by
/// their effect instead: every `!` is replaced by a character that is never YAML syntax
/// and the document parsed again. If no `!` was a tag, the two readings are the same (with
/// the stand-in mapped onto `!`); a tag changes the structure or the values.
fn check_no_tags(yaml: &str, doc: &Value, name: &str) -> Result<(), TemplateErrorKind> {
    if let Some(path) = tagged_path(doc, "") {
        return Err(refuse(
            "cloud-config-tag",
            format!("{name}: {path} has a YAML tag; none is accepted"),
        ));
    }
    if !yaml.contains('!') {
        return Ok(());
    }
    let replaced = yaml.replace('!', &BANG_STAND_IN.to_string());
    let same = serde_yaml_ng::from_str::<Value>(&replaced)
        .is_ok_and(|other| other == stand_in_for_bang(doc));
    if same {
        return Ok(());
    }
    let line = tag_line(yaml, doc)
        .map(|l| format!(" (line {l})"))
        .unwrap_or_default();
    Err(refuse(
        "cloud-config-tag",
        format!(
            "{name}: uses a YAML tag{line}; PyYAML's safe_load resolves or refuses tags \
             differently, so none is accepted"
        ),
    ))
}

/// Where the first value with a local tag (`!thing`, kept by serde_yaml_ng) sits.
fn tagged_path(value: &Value, path: &str) -> Option<String> {
    match value {
        Value::Tagged(_) => Some(if path.is_empty() {
            "the top level".to_string()
        } else {
            path.to_string()
        }),
        Value::Sequence(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, item)| tagged_path(item, &format!("{path}[{i}]"))),
        Value::Mapping(map) => map.iter().find_map(|(k, v)| {
            let key = match k {
                Value::String(s) => s.clone(),
                _ => "?".to_string(),
            };
            let at = if path.is_empty() {
                key
            } else {
                format!("{path}.{key}")
            };
            tagged_path(k, &at).or_else(|| tagged_path(v, &at))
        }),
        _ => None,
    }
}

/// The value with `!` replaced by the stand-in in every string (tagged values are refused
/// before, so there are none).
fn stand_in_for_bang(value: &Value) -> Value {
    let swap = |s: &str| s.replace('!', &BANG_STAND_IN.to_string());
    match value {
        Value::String(s) => Value::String(swap(s)),
        Value::Sequence(items) => Value::Sequence(items.iter().map(stand_in_for_bang).collect()),
        Value::Mapping(map) => Value::Mapping(
            map.iter()
                .map(|(k, v)| (stand_in_for_bang(k), stand_in_for_bang(v)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// The line of the first `!` that is a tag, found by replacing one `!` at a time (the
/// first 64 only: enough to point at it in a plugin's output).
fn tag_line(yaml: &str, doc: &Value) -> Option<usize> {
    if yaml.contains(BANG_STAND_IN) {
        return None;
    }
    for (at, _) in yaml.match_indices('!').take(64) {
        let mut one = String::with_capacity(yaml.len() + 2);
        one.push_str(&yaml[..at]);
        one.push(BANG_STAND_IN);
        one.push_str(&yaml[at + 1..]);
        let same = serde_yaml_ng::from_str::<Value>(&one)
            .is_ok_and(|other| bang_for_stand_in(&other) == *doc);
        if !same {
            return Some(yaml[..at].matches('\n').count() + 1);
        }
    }
    None
}

/// The inverse of [`stand_in_for_bang`], for a text without stand-ins of its own; a tagged
/// value stays as it is (and then differs).
fn bang_for_stand_in(value: &Value) -> Value {
    let swap = |s: &str| s.replace(BANG_STAND_IN, "!");
    match value {
        Value::String(s) => Value::String(swap(s)),
        Value::Sequence(items) => Value::Sequence(items.iter().map(bang_for_stand_in).collect()),
        Value::Mapping(map) => Value::Mapping(
            map.iter()
                .map(|(k, v)| (bang_for_stand_in(k), bang_for_stand_in(v)))
                .collect(),
        ),
        other => other.clone(),
    }
}

#[cfg(test)]
#[path = "vendor_tests.rs"]
mod tests;
