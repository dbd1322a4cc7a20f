//! The MIME form, read as Python's `email` package (compat32) reads it for cloud-init.
//!
//! `email.message_from_string` parses the document, cloud-init `walk()`s it and takes each
//! non-multipart part's `get_content_type()`, `get_filename()` and
//! `util.fully_decoded_payload` (the payload decoded by its Content-Transfer-Encoding,
//! then as UTF-8). This module accepts the subset on which that reading is unambiguous:
//! allow-listed headers, each once, folded only after a `;` (where Python's parameter
//! parsing strips the fold), one boundary, exact delimiter lines, text before the first
//! delimiter (preamble) and after the close delimiter (epilogue) ignored as Python ignores
//! them, and each part 7bit/8bit ASCII, base64 or quoted-printable.

use super::yaml::Source;
use super::{
    MAX_PARTS, MIME_VERSION_WINDOW, VendorDataForm, VendorDataPart, VendorDataReading,
    VendorPartType, header_name_byte, keys_of, mime_version_in_window, read_cloud_config, refuse,
    show,
};
use crate::templates::errors::TemplateErrorKind;
use base64::Engine as _;

/// Longest boundary RFC 2046 allows.
const BOUNDARY_MAX: usize = 70;
/// Longest part file name: it becomes a file name under `scripts/vendor/`.
const FILENAME_MAX: usize = 64;
/// Headers allowed at the top and in each part (lower case, as compared).
const ALLOWED_HEADERS: [&str; 4] = [
    "content-type",
    "mime-version",
    "content-transfer-encoding",
    "content-disposition",
];
/// Headers that may be folded: those read through Python's parameter parser, which strips
/// the whitespace a fold leaves after a `;`.
const FOLDABLE_HEADERS: [&str; 2] = ["content-type", "content-disposition"];
/// The allow-list of part types, as printed in refusals.
const ALLOWED_TYPES: &str = "text/x-shellscript, text/cloud-config";

/// How a part's payload is encoded (`Content-Transfer-Encoding`, any case, as Python
/// lower-cases it).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Encoding {
    /// `7bit`, `8bit` or none: the payload as written.
    Identity,
    /// `base64`.
    Base64,
    /// `quoted-printable`.
    QuotedPrintable,
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
struct Headers {
    entries: Vec<(String, String, usize)>,
}

impl Headers {
    fn get(&self, name: &str) -> Option<(&str, usize)> {
        self.entries
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, v, l)| (v.as_str(), *l))
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
fn parse_headers(
    lines: &Lines<'_>,
    start: usize,
    end: usize,
    scope: Scope,
) -> Result<(Headers, usize), TemplateErrorKind> {
    let rule = scope.header_rule();
    let mut entries: Vec<(String, String, usize)> = Vec::new();
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
            // Python appends a continuation line to the header before it; its parameter
            // parser strips the fold where it follows a `;`.
            let rest = line.trim_start_matches([' ', '\t']);
            let foldable = entries.last_mut().filter(|(name, value, _)| {
                FOLDABLE_HEADERS.contains(&name.as_str()) && value.ends_with(';')
            });
            match foldable {
                Some((_, value, _)) if !rest.is_empty() && !rest.ends_with([' ', '\t']) => {
                    value.push(' ');
                    value.push_str(rest);
                    index += 1;
                    continue;
                }
                _ => {
                    return Err(refuse(
                        rule,
                        format!(
                            "{}, line {number}: a folded (continuation) header line {}; a \
                             header may be folded only right after a `;` of Content-Type or \
                             Content-Disposition, with no trailing whitespace",
                            scope.name(),
                            show(line)
                        ),
                    ));
                }
            }
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
        entries.push((lower, value.to_string(), number));
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

/// MIME-Version, where present, must be `1.0`; returns the Content-Transfer-Encoding:
/// `7bit`, `8bit`, and in a part also `base64` or `quoted-printable` (any case).
fn check_common_headers(headers: &Headers, scope: Scope) -> Result<Encoding, TemplateErrorKind> {
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
    let Some((value, line)) = headers.get("content-transfer-encoding") else {
        return Ok(Encoding::Identity);
    };
    let encoding = match (value.to_ascii_lowercase().as_str(), scope) {
        ("7bit" | "8bit", _) => Encoding::Identity,
        ("base64", Scope::Part(_)) => Encoding::Base64,
        ("quoted-printable", Scope::Part(_)) => Encoding::QuotedPrintable,
        _ => {
            let allowed = match scope {
                Scope::Top => "7bit, 8bit",
                Scope::Part(_) => "7bit, 8bit, base64, quoted-printable",
            };
            return Err(refuse(
                rule,
                format!(
                    "{}, line {line}: Content-Transfer-Encoding {} is not in the allow-list \
                     ({allowed})",
                    scope.name(),
                    show(value)
                ),
            ));
        }
    };
    Ok(encoding)
}

/// `attachment; filename="NAME"` with NAME a plain file name; returns it.
fn read_disposition(headers: &Headers, scope: Scope) -> Result<Option<String>, TemplateErrorKind> {
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
        Some((name, true))
            if params.kind.eq_ignore_ascii_case("attachment") && params.params.len() == 1 =>
        {
            name
        }
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

/// Reads a MIME document (see the module doc).
pub(super) fn read(text: &str) -> Result<VendorDataReading, TemplateErrorKind> {
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
    if !params.kind.eq_ignore_ascii_case("multipart/mixed") {
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
        }
        // Other lines before the first delimiter are the preamble, which Python keeps
        // apart and cloud-init never reads.
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
    // Lines after the close delimiter are the epilogue: Python stops looking for
    // delimiters there and cloud-init never reads it.
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
    Ok(VendorDataReading::new(VendorDataForm::Multipart, parts))
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
    let encoding = check_common_headers(&headers, scope)?;
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
    // Python lower-cases the type (`get_content_type`).
    let kind = match params.kind.to_ascii_lowercase().as_str() {
        "text/x-shellscript" => VendorPartType::ShellScript,
        "text/cloud-config" => VendorPartType::CloudConfig,
        _ => {
            let other = params.kind;
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
        && !charset.eq_ignore_ascii_case("us-ascii")
        && !charset.eq_ignore_ascii_case("utf-8")
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
    let body_lines = &lines.lines[body.min(end)..end];
    let (payload, decoded) = match encoding {
        Encoding::Identity => (identity_payload(body_lines, body, &name)?, false),
        Encoding::Base64 => (decode_base64(body_lines, body, &name)?, true),
        Encoding::QuotedPrintable => (decode_quoted_printable(body_lines, body, &name)?, true),
    };
    let cloud_config = match kind {
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
            None
        }
        VendorPartType::CloudConfig => {
            let source = Source {
                name: &name,
                first_line: body + 1,
                decoded,
            };
            read_cloud_config(&payload, &source)?
        }
    };
    Ok(VendorDataPart {
        content_type: kind,
        filename,
        cloud_config_keys: keys_of(cloud_config.as_ref()),
        cloud_config,
        payload,
    })
}

/// A 7bit/8bit payload: the body as written, ASCII only. Python's email hands cloud-init a
/// non-ASCII payload as raw-unicode-escape bytes (`é` becomes the byte 0xE9, `€` the text
/// `\u20ac`), which cloud-init then decodes as UTF-8 with surrogate escapes: the guest
/// would read something else.
fn identity_payload(body: &[&str], first: usize, name: &str) -> Result<String, TemplateErrorKind> {
    for (offset, line) in body.iter().enumerate() {
        if let Some(c) = line.chars().find(|c| !c.is_ascii()) {
            return Err(refuse(
                "mime-part-ascii",
                format!(
                    "{name}, line {}: non-ASCII character U+{:04X}; Python's email passes a \
                     non-ASCII 7bit/8bit payload to cloud-init mangled (raw-unicode-escape), \
                     so such parts must be ASCII (encode the part as base64, or use the plain \
                     #cloud-config form)",
                    first + offset + 1,
                    u32::from(c)
                ),
            ));
        }
    }
    Ok(body.join("\n"))
}

fn encoding_error(name: &str, line: usize, why: &str) -> TemplateErrorKind {
    refuse("mime-part-encoding", format!("{name}, line {line}: {why}"))
}

/// A base64 body: lines of the standard alphabet with canonical padding at the very end,
/// which Python's `decode_b` (lines joined, then `b64decode`) and the `base64` crate decode
/// alike; the result must be UTF-8 text.
fn decode_base64(body: &[&str], first: usize, name: &str) -> Result<String, TemplateErrorKind> {
    let alphabet = |b: u8| b.is_ascii_alphanumeric() || b"+/=".contains(&b);
    for (offset, line) in body.iter().enumerate() {
        if !line.bytes().all(alphabet) {
            return Err(encoding_error(
                name,
                first + offset + 1,
                &format!(
                    "{} is not a line of base64 (`A-Z a-z 0-9 + / =`)",
                    show(line)
                ),
            ));
        }
    }
    let joined: String = body.concat();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(&joined)
        .map_err(|e| {
            encoding_error(
                name,
                first + 1,
                &format!("the base64 payload does not decode strictly ({e})"),
            )
        })?;
    decoded_text(bytes, first, name)
}

/// A quoted-printable body in the subset every decoder reads alike: printable ASCII,
/// spaces and tabs, no trailing whitespace, `=` only before two upper-case hex digits or
/// as a soft line break at the end of a line (not the last). Decoded as Python's
/// `quopri.decodestring` does: the line ends kept, soft breaks removed.
fn decode_quoted_printable(
    body: &[&str],
    first: usize,
    name: &str,
) -> Result<String, TemplateErrorKind> {
    let hex = |b: u8| b.is_ascii_digit() || (b'A'..=b'F').contains(&b);
    let mut bytes = Vec::new();
    for (offset, line) in body.iter().enumerate() {
        let number = first + offset + 1;
        let raw = line.as_bytes();
        if line.ends_with([' ', '\t']) {
            return Err(encoding_error(
                name,
                number,
                "trailing whitespace in a quoted-printable line, which decoders treat apart",
            ));
        }
        let last = offset + 1 == body.len();
        let mut i = 0;
        let mut soft = false;
        while i < raw.len() {
            let b = raw[i];
            if b == b'=' {
                if i + 1 == raw.len() && !last {
                    soft = true;
                    i += 1;
                    continue;
                }
                match raw.get(i + 1..i + 3) {
                    Some(&[h, l]) if hex(h) && hex(l) => {
                        let digit = |c: u8| {
                            if c.is_ascii_digit() {
                                c - b'0'
                            } else {
                                c - b'A' + 10
                            }
                        };
                        bytes.push(digit(h) * 16 + digit(l));
                        i += 3;
                        continue;
                    }
                    _ => {
                        return Err(encoding_error(
                            name,
                            number,
                            "an `=` that is neither `=XX` (upper-case hex) nor a soft line \
                             break at the end of a line",
                        ));
                    }
                }
            }
            if !(b == b' ' || b == b'\t' || (0x21..=0x7e).contains(&b)) {
                return Err(encoding_error(
                    name,
                    number,
                    "a character that quoted-printable must encode",
                ));
            }
            bytes.push(b);
            i += 1;
        }
        if !soft && !last {
            bytes.push(b'\n');
        }
    }
    decoded_text(bytes, first, name)
}

/// Decoded bytes as cloud-init reads them: UTF-8 (`fully_decoded_payload`), with no
/// control character but `\n` and `\t`.
fn decoded_text(bytes: Vec<u8>, first: usize, name: &str) -> Result<String, TemplateErrorKind> {
    let text = String::from_utf8(bytes).map_err(|_| {
        encoding_error(
            name,
            first + 1,
            "the decoded payload is not UTF-8, which cloud-init would read with surrogate \
             escapes",
        )
    })?;
    for (index, line) in text.split('\n').enumerate() {
        if let Some(c) = line.chars().find(|&c| {
            (c.is_control() && c != '\t')
                || matches!(
                    c,
                    '\u{2028}' | '\u{2029}' | '\u{FEFF}' | '\u{FFFE}' | '\u{FFFF}'
                )
        }) {
            return Err(refuse(
                "control-character",
                format!(
                    "{name}, line {} of the decoded payload: U+{:04X}; only `\\n` and `\\t` \
                     are allowed",
                    index + 1,
                    u32::from(c)
                ),
            ));
        }
    }
    Ok(text)
}
