//! cloud-config YAML read the way cloud-init's PyYAML reads it, or refused.
//!
//! cloud-init loads each cloud-config part with PyYAML 6's pure-Python `SafeLoader`
//! (`util.load_yaml`), and a part PyYAML fails on is dropped with a log line: the guest
//! boots without it. So a document is accepted only when PyYAML loads it and reads it as
//! we do. The structure comes from saphyr-parser's events (YAML 1.2, with each scalar's
//! style and position). On top of them this module refuses what PyYAML's scanner and
//! constructor do not accept, or read otherwise, each found by running both on a
//! generated corpus (`tests/tests/vendor_parity.rs`): tabs outside quoted and block
//! scalars, directives, a second document, `...`, an unquoted `=`, unquoted text starting
//! with `@`, a backtick, `?` or `:`, a `?` or final `:` in unquoted text inside a flow
//! collection, anchors, keys PyYAML cannot scan as simple keys, and a block scalar ending
//! the text without a line break. Every plain scalar is read by PyYAML's YAML 1.1 rules
//! ([`yaml11`](super::yaml11)), and refused where a YAML 1.2 reader reads it otherwise, so
//! that an author's intent and the guest's reading cannot part.

use std::collections::HashSet;

use saphyr_parser::{Event, Parser, ScalarStyle, Span};

use super::yaml11::{self, Plain, Scalar};
use super::{refuse, show};
use crate::templates::errors::TemplateErrorKind;

/// Top-level keys by which a cloud-config part changes how cloud-init merges it
/// (`mergers.dict_extract_mergers`).
const MERGE_DIRECTIVES: [&str; 2] = ["merge_how", "merge_type"];
/// Longest simple key PyYAML scans (its scanner gives up on a key after 1024 characters).
const SIMPLE_KEY_MAX: usize = 1024;

/// A cloud-config value as cloud-init's `safe_load` builds it (keys are always strings:
/// other keys are refused).
#[derive(Debug, Clone, PartialEq)]
pub enum CloudConfigValue {
    /// A scalar, typed as PyYAML types it.
    Scalar(Scalar),
    /// A sequence.
    List(Vec<CloudConfigValue>),
    /// A mapping, in document order.
    Map(Vec<(String, CloudConfigValue)>),
}

/// A top-level cloud-config mapping, in document order.
pub type CloudConfig = Vec<(String, CloudConfigValue)>;

/// Where a YAML text sits, so refusals name the document's line.
pub(super) struct Source<'a> {
    /// The part, as refusals name it.
    pub name: &'a str,
    /// The document line of the YAML's first line (1 for the plain form).
    pub first_line: usize,
    /// Whether the YAML was decoded from base64 or quoted-printable (lines are then the
    /// decoded payload's).
    pub decoded: bool,
}

impl Source<'_> {
    fn at(&self, yaml_line: usize) -> String {
        if self.decoded {
            format!("{}, line {yaml_line} of the decoded payload", self.name)
        } else {
            format!("{}, line {}", self.name, self.first_line + yaml_line - 1)
        }
    }
}

/// Reads a cloud-config YAML document; `None` when it holds no value (PyYAML's `None`,
/// which cloud-init skips as an empty cloud-config).
pub(super) fn read(yaml: &str, src: &Source<'_>) -> Result<Option<CloudConfig>, TemplateErrorKind> {
    let mut events = Vec::new();
    for item in Parser::new_from_str(yaml) {
        match item {
            Ok(event) => events.push(event),
            Err(e) => {
                return Err(refuse(
                    "cloud-config-yaml",
                    format!(
                        "{}: does not parse as YAML: {}",
                        src.at(e.marker().line()),
                        e.info()
                    ),
                ));
            }
        }
    }
    let chars: Vec<char> = yaml.chars().collect();
    check_lexical(&chars, &events, src)?;
    let root = Builder::new(src, &chars).build(&events)?;
    match root {
        None | Some((CloudConfigValue::Scalar(Scalar::Null), _)) => Ok(None),
        Some((CloudConfigValue::Map(map), _)) => Ok(Some(map)),
        Some((other, line)) => Err(refuse(
            "cloud-config-yaml",
            format!(
                "{}: the top level is {}; it must be a mapping",
                src.at(line),
                kind_of(&other)
            ),
        )),
    }
}

fn kind_of(value: &CloudConfigValue) -> String {
    match value {
        CloudConfigValue::Scalar(s) => s.describe(),
        CloudConfigValue::List(_) => "a list".to_string(),
        CloudConfigValue::Map(_) => "a mapping".to_string(),
    }
}

/// What PyYAML's scanner refuses or reads otherwise, found on the text and the events:
/// more than one document, a block scalar ending the text, and line by line outside
/// quoted and block scalars a tab (it only skips spaces between tokens, so `a:\tb`,
/// `a b\t` and tab indentation fail), a `%` directive and a misplaced document marker.
fn check_lexical(
    chars: &[char],
    events: &[(Event<'_>, Span)],
    src: &Source<'_>,
) -> Result<(), TemplateErrorKind> {
    let documents = events
        .iter()
        .filter(|(e, _)| matches!(e, Event::DocumentStart(_)))
        .count();
    if documents > 1 {
        let line = events
            .iter()
            .filter(|(e, _)| matches!(e, Event::DocumentStart(_)))
            .nth(1)
            .map_or(1, |(_, s)| s.start.line());
        return Err(refuse(
            "cloud-config-pyyaml",
            format!(
                "{}: a second YAML document; PyYAML's safe_load reads one document and fails \
                 on more, and cloud-init then drops the part",
                src.at(line)
            ),
        ));
    }
    // A block scalar that runs to the end of a text without a final line break: PyYAML
    // keeps no line break there, saphyr-parser adds one. MIME parts end without one (it
    // belongs to the delimiter).
    let last_scalar = events.iter().rev().find_map(|(e, s)| match e {
        Event::Scalar(_, style, _, _) => Some((*style, s.start.line())),
        _ => None,
    });
    if let Some((ScalarStyle::Literal | ScalarStyle::Folded, line)) = last_scalar
        && chars.last().is_some_and(|&c| c != '\n')
    {
        return Err(refuse(
            "cloud-config-yaml",
            format!(
                "{}: a block scalar (`|`, `>`) at the very end, with no line break after its \
                 last line; YAML readers disagree on its last line break: end the text with \
                 an empty line (in a MIME part, an empty line before the delimiter)",
                src.at(line)
            ),
        ));
    }
    // Character ranges of the scalars whose text may hold tabs and `#`. A block scalar's
    // header line (`|`, `>` and indicators) is not text: PyYAML allows no tab there.
    let yaml: String = chars.iter().collect();
    let mut spans: Vec<(usize, usize)> = events
        .iter()
        .filter_map(|(e, s)| match e {
            Event::Scalar(_, ScalarStyle::Plain, _, _) => None,
            Event::Scalar(_, style, _, _) => {
                let mut start = s.start.index();
                let block = matches!(style, ScalarStyle::Literal | ScalarStyle::Folded);
                if block && matches!(chars.get(start), Some('|' | '>')) {
                    while chars.get(start).is_some_and(|&c| c != '\n') {
                        start += 1;
                    }
                    start += 1;
                }
                // A quoted scalar's span may run past its closing quote over trailing
                // blanks, which are not text.
                let mut end = s.end.index();
                let quote = match style {
                    ScalarStyle::SingleQuoted => Some('\''),
                    ScalarStyle::DoubleQuoted => Some('"'),
                    _ => None,
                };
                if let Some(quote) = quote {
                    while end > start && chars.get(end - 1).is_some_and(|&c| c != quote) {
                        end -= 1;
                    }
                }
                Some((start, end))
            }
            _ => None,
        })
        .collect();
    spans.sort_unstable();
    // Scalars do not nest, so the only span that may hold `index` is the last to start
    // at or before it.
    let inside = |index: usize| {
        let after = spans.partition_point(|&(start, _)| start <= index);
        after > 0 && index < spans[after - 1].1
    };
    let mut index = 0;
    for (number, line) in yaml.split('\n').enumerate() {
        let number = number + 1;
        // `...` ends a document (PyYAML fails on one before any content), and either
        // marker inside a quoted scalar is an error to it.
        let marker = ["...", "---"].into_iter().find(|m| {
            line.strip_prefix(m)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t', '\r']))
        });
        if marker == Some("...") || (marker.is_some() && inside(index)) {
            return Err(refuse(
                "cloud-config-pyyaml",
                format!(
                    "{}: a document marker `{}` where PyYAML fails on it (`...` is never \
                     needed in cloud-config; a `---` inside a quoted value ends it)",
                    src.at(number),
                    marker.unwrap_or_default()
                ),
            ));
        }
        let mut previous = None;
        for (column, c) in line.chars().enumerate() {
            let at = index + column;
            if inside(at) {
                previous = None;
                continue;
            }
            if c == '#' && previous.is_none_or(|p: char| p == ' ' || p == '\t') {
                break;
            }
            if c == '\t' {
                return Err(refuse(
                    "cloud-config-pyyaml",
                    format!(
                        "{}, column {}: a tab outside a quoted or block scalar; PyYAML \
                         refuses tabs between tokens, as indentation and in unquoted values \
                         (cloud-init would drop the part): use spaces, or quote the value",
                        src.at(number),
                        column + 1
                    ),
                ));
            }
            if c == '%' && column == 0 {
                return Err(refuse(
                    "cloud-config-pyyaml",
                    format!(
                        "{}: a `%` directive; PyYAML reads only YAML 1.1 directives, so none \
                         is accepted",
                        src.at(number)
                    ),
                ));
            }
            previous = Some(c);
        }
        index += line.chars().count() + 1;
    }
    Ok(())
}

/// A top-level key: a plain identifier, and none of the merge directives that change how
/// cloud-init merges parts.
fn check_top_level_key(key: &str, at: &str) -> Result<(), TemplateErrorKind> {
    if !top_level_key(key) {
        return Err(refuse(
            "cloud-config-key",
            format!(
                "{at}: top-level key {} must be a plain identifier `[a-z_][a-z0-9_]*` and not a \
                 YAML 1.1 boolean or null word (y, n, yes, no, on, off, true, false, null)",
                show(key)
            ),
        ));
    }
    if MERGE_DIRECTIVES.contains(&key) {
        return Err(refuse(
            "cloud-config-merge-key",
            format!(
                "{at}: top-level key {} changes how cloud-init merges this part with the \
                 others; parts are merged by cloud-init's default only",
                show(key)
            ),
        ));
    }
    Ok(())
}

/// `[a-z_][a-z0-9_]*` and no YAML 1.1 boolean or null word (even quoted, such a key reads
/// as a boolean to anyone who forgets the quotes).
fn top_level_key(key: &str) -> bool {
    const WORDS: [&str; 10] = [
        "y", "n", "yes", "no", "on", "off", "true", "false", "null", "~",
    ];
    let mut bytes = key.bytes();
    let first_ok = bytes
        .next()
        .is_some_and(|b| b.is_ascii_lowercase() || b == b'_');
    first_ok
        && bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && !WORDS.iter().any(|w| w.eq_ignore_ascii_case(key))
}

/// Refuses unquoted text that starts with a character PyYAML takes as an indicator: `@`
/// and a backtick are reserved (it fails), and in flow context `?` and `:` start a key or
/// a value even before a non-space, where YAML 1.2 reads a plain scalar (`[?x]` is the
/// mapping `{x: null}` to PyYAML).
fn check_plain_start(text: &str, at: &str) -> Result<(), TemplateErrorKind> {
    if text.starts_with(['@', '`', '?', ':']) {
        return Err(refuse(
            "cloud-config-pyyaml",
            format!(
                "{at}: the unquoted {} starts with `@`, a backtick, `?` or `:`, which PyYAML \
                 refuses or reads as an indicator: quote it",
                show(text)
            ),
        ));
    }
    Ok(())
}

/// Builds the value tree from the events, refusing what PyYAML reads differently.
struct Builder<'s> {
    src: &'s Source<'s>,
    chars: &'s [char],
    stack: Vec<Frame>,
    /// For each open collection, whether it is a flow one (`[...]`, `{...}`).
    flow: Vec<bool>,
}

enum Frame {
    List {
        items: Vec<CloudConfigValue>,
        line: usize,
    },
    Map {
        entries: Vec<(String, CloudConfigValue)>,
        /// The keys so far, to find a duplicate without a scan.
        seen: HashSet<String>,
        key: Option<String>,
        line: usize,
    },
}

impl<'s> Builder<'s> {
    fn new(src: &'s Source<'s>, chars: &'s [char]) -> Self {
        Builder {
            src,
            chars,
            stack: Vec::new(),
            flow: Vec::new(),
        }
    }

    /// The root value and its line.
    fn build(
        mut self,
        events: &[(Event<'_>, Span)],
    ) -> Result<Option<(CloudConfigValue, usize)>, TemplateErrorKind> {
        let mut root = None;
        for (event, span) in events {
            let line = span.start.line();
            let done = match event {
                Event::Scalar(text, style, anchor, tag) => {
                    self.plain_node(*anchor, tag.is_some(), line)?;
                    if self.expects_key() {
                        let key = self.key(text, *style, span)?;
                        self.set_key(key, line)?;
                        continue;
                    }
                    Some((self.scalar(text, *style, line)?, line))
                }
                Event::SequenceStart(anchor, tag) | Event::MappingStart(anchor, tag) => {
                    self.plain_node(*anchor, tag.is_some(), line)?;
                    if self.expects_key() {
                        return Err(self.complex_key(line));
                    }
                    let items = Vec::new();
                    let flow = matches!(self.chars.get(span.start.index()), Some('[' | '{'));
                    self.flow.push(flow);
                    self.stack
                        .push(if matches!(event, Event::SequenceStart(..)) {
                            Frame::List { items, line }
                        } else {
                            Frame::Map {
                                entries: Vec::new(),
                                seen: HashSet::new(),
                                key: None,
                                line,
                            }
                        });
                    None
                }
                Event::SequenceEnd | Event::MappingEnd => {
                    match (self.stack.pop(), self.flow.pop()).0 {
                        Some(Frame::List { items, line }) => {
                            Some((CloudConfigValue::List(items), line))
                        }
                        Some(Frame::Map { entries, line, .. }) => {
                            Some((CloudConfigValue::Map(entries), line))
                        }
                        None => None,
                    }
                }
                Event::Alias(_) => return Err(self.anchor(line)),
                _ => None,
            };
            let Some((value, line)) = done else {
                continue;
            };
            match self.stack.last_mut() {
                None => root = Some((value, line)),
                Some(Frame::List { items, .. }) => items.push(value),
                Some(Frame::Map { entries, key, .. }) => {
                    if let Some(key) = key.take() {
                        entries.push((key, value));
                    }
                }
            }
        }
        Ok(root)
    }

    /// In a flow collection PyYAML ends unquoted text at any `?` and at a `:` before a flow
    /// indicator, where YAML 1.2 reads on (`{a: x?y}`).
    fn check_flow_plain(&self, text: &str, at: &str) -> Result<(), TemplateErrorKind> {
        if self.flow.last() == Some(&true) && (text.contains('?') || text.ends_with(':')) {
            return Err(refuse(
                "cloud-config-pyyaml",
                format!(
                    "{at}: the unquoted {} in a flow collection (`[...]`, `{{...}}`) has a `?` or \
                     ends in `:`, where PyYAML ends it: quote it",
                    show(text)
                ),
            ));
        }
        Ok(())
    }

    /// A node with neither tag nor anchor.
    fn plain_node(
        &self,
        anchor: usize,
        tagged: bool,
        line: usize,
    ) -> Result<(), TemplateErrorKind> {
        if tagged {
            return Err(self.tag(line));
        }
        if anchor != 0 {
            return Err(self.anchor(line));
        }
        Ok(())
    }

    fn anchor(&self, line: usize) -> TemplateErrorKind {
        refuse(
            "cloud-config-yaml",
            format!(
                "{}: an anchor or alias (`&`, `*`); PyYAML fails on an anchor defined twice \
                 and a plugin has no need of them, so none is accepted",
                self.src.at(line)
            ),
        )
    }

    fn expects_key(&self) -> bool {
        matches!(self.stack.last(), Some(Frame::Map { key: None, .. }))
    }

    fn set_key(&mut self, key: String, line: usize) -> Result<(), TemplateErrorKind> {
        let at = self.src.at(line);
        if let Some(Frame::Map {
            seen, key: slot, ..
        }) = self.stack.last_mut()
        {
            if !seen.insert(key.clone()) {
                return Err(refuse(
                    "cloud-config-yaml",
                    format!(
                        "{at}: duplicate key {}; PyYAML keeps the last of duplicate keys \
                         silently, so they are refused",
                        show(&key)
                    ),
                ));
            }
            *slot = Some(key.clone());
        }
        if self.stack.len() == 1 {
            check_top_level_key(&key, &at)?;
        }
        Ok(())
    }

    fn tag(&self, line: usize) -> TemplateErrorKind {
        refuse(
            "cloud-config-tag",
            format!(
                "{}: a YAML tag; PyYAML's safe_load resolves or refuses tags differently, so \
                 none is accepted",
                self.src.at(line)
            ),
        )
    }

    fn complex_key(&self, line: usize) -> TemplateErrorKind {
        refuse(
            "cloud-config-key",
            format!(
                "{}: a key that is a list, mapping or alias; keys must be strings",
                self.src.at(line)
            ),
        )
    }

    /// A mapping key: a string to PyYAML and to a YAML 1.2 reader alike, on one line and
    /// short enough for PyYAML's simple-key scan, and no `<<` (PyYAML's merge key).
    fn key(
        &self,
        text: &str,
        style: ScalarStyle,
        span: &Span,
    ) -> Result<String, TemplateErrorKind> {
        let at = self.src.at(span.start.line());
        if style == ScalarStyle::Plain {
            check_plain_start(text, &at)?;
            self.check_flow_plain(text, &at)?;
            match yaml11::resolve(text) {
                Plain::Merge => {
                    return Err(refuse(
                        "cloud-config-merge-key",
                        format!("{at}: a `<<` merge key, which PyYAML merges and we do not"),
                    ));
                }
                Plain::Value(Scalar::Str(_)) => {}
                other => {
                    let what = match other {
                        Plain::Value(s) => s.describe(),
                        _ => "not a string".to_string(),
                    };
                    return Err(refuse(
                        "cloud-config-key",
                        format!(
                            "{at}: the key {} is {what} to YAML 1.1 (PyYAML) when unquoted; \
                             keys must be strings: quote it",
                            show(text)
                        ),
                    ));
                }
            }
            if yaml11::yaml12(text) != Some(Scalar::Str(text.to_string())) {
                return Err(refuse(
                    "cloud-config-key",
                    format!(
                        "{at}: the key {} is no string to a YAML 1.2 reader when unquoted; \
                         quote it",
                        show(text)
                    ),
                ));
            }
        }
        let one_line = span.start.line() == span.end.line();
        if !one_line || span.end.index() - span.start.index() > SIMPLE_KEY_MAX {
            return Err(refuse(
                "cloud-config-pyyaml",
                format!(
                    "{at}: a key longer than {SIMPLE_KEY_MAX} characters or over several \
                     lines, which PyYAML's scanner does not read as a key"
                ),
            ));
        }
        Ok(text.to_string())
    }

    /// A scalar value: quoted and block scalars are strings; a plain one is read by
    /// YAML 1.1 and must read the same by YAML 1.2.
    fn scalar(
        &self,
        text: &str,
        style: ScalarStyle,
        line: usize,
    ) -> Result<CloudConfigValue, TemplateErrorKind> {
        if style != ScalarStyle::Plain {
            return Ok(CloudConfigValue::Scalar(Scalar::Str(text.to_string())));
        }
        let at = self.src.at(line);
        check_plain_start(text, &at)?;
        self.check_flow_plain(text, &at)?;
        let value = match yaml11::resolve(text) {
            Plain::Value(value) => value,
            Plain::Merge => {
                return Err(refuse(
                    "cloud-config-merge-key",
                    format!("{at}: an unquoted `<<`, PyYAML's merge tag: quote it"),
                ));
            }
            Plain::ValueTag => {
                return Err(refuse(
                    "cloud-config-pyyaml",
                    format!(
                        "{at}: an unquoted `=` is YAML 1.1's value tag, which PyYAML's \
                         safe_load cannot construct (cloud-init would drop the part): quote \
                         it ('=')"
                    ),
                ));
            }
            Plain::BrokenInt => {
                return Err(refuse(
                    "cloud-config-pyyaml",
                    format!(
                        "{at}: {} is an integer without digits to PyYAML, which fails on it \
                         (cloud-init would drop the part): quote it",
                        show(text)
                    ),
                ));
            }
            Plain::Timestamp => {
                return Err(refuse(
                    "cloud-config-value",
                    format!(
                        "{at}: {} is a date or time to YAML 1.1 (PyYAML), a string to YAML \
                         1.2: quote it",
                        show(text)
                    ),
                ));
            }
            Plain::BigInt => {
                return Err(refuse(
                    "cloud-config-value",
                    format!(
                        "{at}: the integer {} is outside the 64-bit range; quote it",
                        show(text)
                    ),
                ));
            }
        };
        match yaml11::yaml12(text) {
            Some(other) if other.same_as(&value) => Ok(CloudConfigValue::Scalar(value)),
            other => {
                let theirs = other.map_or("no plain scalar".to_string(), |s| s.describe());
                Err(refuse(
                    "cloud-config-value",
                    format!(
                        "{at}: the unquoted {} is {} to cloud-init (YAML 1.1, PyYAML) but \
                         {theirs} to YAML 1.2: quote it if you mean the string, or write the \
                         value in a form both read alike (true/false, decimal integers, \
                         floats with a dot)",
                        show(text),
                        value.describe()
                    ),
                ))
            }
        }
    }
}
