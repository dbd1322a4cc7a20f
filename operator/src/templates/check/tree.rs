//! A strict reading of domain XML into a small tree, with the same result libxml2 (and so
//! libvirt) gets, or a refusal.
//!
//! Where libxml2 and a Rust XML reader could disagree, the document is refused instead of
//! guessing: libvirt looks attributes up by local name and takes the first
//! (`xmlGetProp`), reads an element's text as the concatenation of every text node below
//! it (`string()` in XPath, `xmlNodeGetContent`), honours the encoding the XML declaration
//! names, normalises line ends and attribute whitespace, and stops at a NUL (a C string).
//! So: no namespace declarations, prefixed names or prefixed attributes outside
//! `<metadata>`; no CDATA, processing instructions or DOCTYPE anywhere; comments only
//! between elements outside `<metadata>`; text only in elements without child elements;
//! only the five predefined entities and character references; no NUL, no control
//! characters except tab and line feed, no carriage return, no tab or line feed inside
//! attribute values; UTF-8 only. Namespace URIs are compared after unescaping, because
//! that is what libxml2 compares.

use std::collections::HashMap;

use quick_xml::events::{BytesRef, BytesStart, Event};
use quick_xml::reader::Reader;

use super::refuse;
use crate::templates::errors::TemplateErrorKind;

/// Deepest element nesting accepted. libvirt's deepest paths are about seven levels
/// (`/domain/devices/controller/target`); metadata adds a few. The cap keeps path strings
/// and recursion small whatever a plugin writes.
pub const MAX_DEPTH: usize = 24;
/// Most elements in one document: a proxy VM has well under a hundred, a busy libvirt
/// reading a few hundred. Bounds the work of every later pass.
pub const MAX_ELEMENTS: usize = 4096;
/// Most attributes on one element (libvirt's widest elements have about ten).
pub const MAX_ATTRIBUTES: usize = 32;
/// The namespace bound to the `xml:` prefix by definition.
const XML_NS: &str = "http://www.w3.org/XML/1998/namespace";

/// One attribute, its value resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attr {
    /// Local name (the name itself outside `<metadata>`, where prefixes are refused).
    pub name: String,
    /// Namespace URI for a prefixed attribute (only inside `<metadata>`).
    pub ns: Option<String>,
    /// The value as libxml2 reports it: entities and character references resolved.
    pub value: String,
}

/// One element with its attributes (namespace declarations left out), child elements and
/// whole text content.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Node {
    /// Local name.
    pub name: String,
    /// Namespace URI; always `None` outside `<metadata>`.
    pub ns: Option<String>,
    /// Attributes in document order.
    pub attrs: Vec<Attr>,
    /// Child elements in document order.
    pub children: Vec<Node>,
    /// Every text node directly inside, concatenated (CDATA is refused, so this is all of
    /// it). Only meaningful for elements without children.
    pub text: String,
}

impl Node {
    /// The value of the unprefixed attribute `name`.
    pub fn attr(&self, name: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|a| a.ns.is_none() && a.name == name)
            .map(|a| a.value.as_str())
    }

    /// Child elements named `name`.
    pub fn children_named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Node> + 'a {
        self.children.iter().filter(move |c| c.name == name)
    }

    /// The first child element named `name` (the one libvirt's `./name[1]` reads).
    pub fn child(&self, name: &str) -> Option<&Node> {
        self.children.iter().find(|c| c.name == name)
    }
}

/// A parsed document: its root element.
#[derive(Debug)]
pub struct Document {
    /// The root element.
    pub root: Node,
}

/// An element being read.
struct Open {
    node: Node,
    /// Namespace declarations this element made (prefix, URI); `""` is the default.
    declared: Vec<(String, String)>,
    /// Whether a comment appeared directly inside (refused if the element turns out to hold
    /// text, where libxml2 would split the text around it).
    had_comment: bool,
    /// Whether non-blank text appeared (refused if the element also has children).
    had_text: bool,
    /// Inside `/domain/metadata` (the element itself included).
    in_metadata: bool,
}

/// Where namespaced content is allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opaque {
    /// A domain: only below `/domain/metadata` (its children and their subtrees).
    DomainMetadata,
    /// A metadata fragment (the operator's mark): everywhere.
    Fragment,
}

/// Reads `xml` the strict way described in the module docs.
pub fn parse(xml: &str, opaque: Opaque) -> Result<Document, TemplateErrorKind> {
    check_characters(xml)?;
    let mut reader = Reader::from_str(xml);
    reader.config_mut().trim_text(false);
    reader.config_mut().check_end_names = true;
    reader.config_mut().check_comments = true;
    let mut stack: Vec<Open> = Vec::new();
    let mut root: Option<Node> = None;
    let mut scopes: HashMap<String, Vec<String>> = HashMap::new();
    let mut elements = 0usize;
    let mut first = true;
    loop {
        let at = reader.buffer_position();
        let event = reader
            .read_event()
            .map_err(|e| refuse("well-formed", format!("after byte {at}: {e}")))?;
        let was_first = std::mem::replace(&mut first, false);
        match event {
            Event::Decl(d) => {
                if !was_first {
                    return Err(refuse(
                        "well-formed",
                        "an XML declaration is allowed only at the very start",
                    ));
                }
                check_decl(&d)?;
            }
            Event::Start(_) | Event::Empty(_) if root.is_some() => {
                return Err(refuse("one-domain", "more than one root element"));
            }
            Event::Start(e) => {
                elements += 1;
                let open = open_element(&e, &stack, &mut scopes, opaque, elements)?;
                stack.push(open);
            }
            Event::Empty(e) => {
                elements += 1;
                let open = open_element(&e, &stack, &mut scopes, opaque, elements)?;
                close_element(open, &mut stack, &mut scopes, &mut root)?;
            }
            Event::End(_) => {
                let open = stack
                    .pop()
                    .ok_or_else(|| refuse("well-formed", "an end tag without a start tag"))?;
                close_element(open, &mut stack, &mut scopes, &mut root)?;
            }
            Event::Text(t) => {
                let text = t
                    .decode()
                    .map_err(|e| refuse("well-formed", e.to_string()))?;
                if text.contains('&') {
                    return Err(refuse("well-formed", "a bare '&' in text"));
                }
                push_text(&mut stack, &text, root.is_some())?;
            }
            Event::GeneralRef(r) => {
                let resolved = resolve_ref(&r)?;
                push_text(&mut stack, &resolved, root.is_some())?;
            }
            Event::Comment(c) => {
                if c.windows(2).any(|w| w == b"--") || c.ends_with(b"-") {
                    return Err(refuse("well-formed", "'--' inside a comment"));
                }
                if let Some(top) = stack.last_mut() {
                    if top.in_metadata {
                        return Err(refuse(
                            "metadata-mark",
                            format!(
                                "{} holds a comment; comments are not allowed in <metadata>",
                                path_of(&stack)
                            ),
                        ));
                    }
                    top.had_comment = true;
                }
            }
            Event::CData(_) => {
                return Err(refuse(
                    "no-cdata",
                    format!(
                        "{} holds a CDATA section; write text with entities instead",
                        if stack.is_empty() {
                            "/".to_string()
                        } else {
                            path_of(&stack)
                        }
                    ),
                ));
            }
            Event::PI(_) => {
                return Err(refuse(
                    "well-formed",
                    "processing instructions are not allowed",
                ));
            }
            Event::DocType(_) => {
                return Err(refuse(
                    "no-doctype",
                    "a DOCTYPE could define entities or defaults; none is allowed",
                ));
            }
            Event::Eof => break,
        }
    }
    if !stack.is_empty() {
        return Err(refuse(
            "well-formed",
            format!("the document ends inside {}", path_of(&stack)),
        ));
    }
    root.map(|root| Document { root })
        .ok_or_else(|| refuse("one-domain", "no root element"))
}

/// Refuses characters libxml2 would refuse, normalise or stop at.
fn check_characters(xml: &str) -> Result<(), TemplateErrorKind> {
    for (i, c) in xml.char_indices() {
        let bad = match c {
            '\0' => Some("NUL (libvirt reads the document as a C string and would stop there)"),
            '\r' => Some("a carriage return (XML parsers rewrite it; use a line feed)"),
            '\u{feff}' => Some("a byte-order mark"),
            '\u{fffe}' | '\u{ffff}' => Some("a non-character"),
            '\t' | '\n' => None,
            c if c.is_control() => Some("a control character"),
            _ => None,
        };
        if let Some(what) = bad {
            return Err(refuse(
                "characters",
                format!("byte {i} is {what} ({:?})", c),
            ));
        }
    }
    Ok(())
}

/// The declaration may only say version 1.0 and UTF-8: libxml2 decodes by the declared
/// encoding, which would make it read other characters than we do.
fn check_decl(d: &quick_xml::events::BytesDecl<'_>) -> Result<(), TemplateErrorKind> {
    let version = d
        .version()
        .map_err(|e| refuse("well-formed", e.to_string()))?;
    if version.as_ref() != b"1.0" {
        return Err(refuse(
            "xml-declaration",
            format!(
                "declares version {:?}; only 1.0",
                String::from_utf8_lossy(&version)
            ),
        ));
    }
    if let Some(enc) = d.encoding() {
        let enc = enc.map_err(|e| refuse("well-formed", e.to_string()))?;
        if !enc.eq_ignore_ascii_case(b"utf-8") {
            return Err(refuse(
                "xml-declaration",
                format!(
                    "declares encoding {:?}; only UTF-8 (libvirt would decode the bytes differently)",
                    String::from_utf8_lossy(&enc)
                ),
            ));
        }
    }
    Ok(())
}

/// Resolves `&name;`: the five predefined entities and character references to characters
/// XML allows.
fn resolve_ref(r: &BytesRef<'_>) -> Result<String, TemplateErrorKind> {
    let name = r
        .decode()
        .map_err(|e| refuse("well-formed", e.to_string()))?;
    let c = match name.as_ref() {
        "amp" => '&',
        "lt" => '<',
        "gt" => '>',
        "quot" => '"',
        "apos" => '\'',
        other => match r.resolve_char_ref() {
            Ok(Some(c)) => c,
            _ => {
                return Err(refuse(
                    "well-formed",
                    format!("unknown entity &{};", super::show(other)),
                ));
            }
        },
    };
    check_char_value(c)?;
    Ok(c.to_string())
}

/// A character a reference may produce: what XML 1.0 allows, except carriage return.
fn check_char_value(c: char) -> Result<(), TemplateErrorKind> {
    if c == '\t' || c == '\n' || !(c.is_control() || c == '\u{fffe}' || c == '\u{ffff}') {
        Ok(())
    } else {
        Err(refuse(
            "characters",
            format!("a character reference to {c:?}, which XML does not allow here"),
        ))
    }
}

fn push_text(stack: &mut [Open], text: &str, after_root: bool) -> Result<(), TemplateErrorKind> {
    match stack.last_mut() {
        Some(top) => {
            if !is_blank(text) {
                if let Some(child) = top.node.children.last() {
                    return Err(refuse(
                        "text-only",
                        format!(
                            "<{}> mixes text with the element <{}>",
                            top.node.name, child.name
                        ),
                    ));
                }
                top.had_text = true;
            }
            top.node.text.push_str(text);
            Ok(())
        }
        None if is_blank(text) => Ok(()),
        None => Err(refuse(
            "one-domain",
            if after_root {
                "text after the root element"
            } else {
                "text before the root element"
            },
        )),
    }
}

/// XML white space (carriage return is refused earlier).
pub fn is_blank(s: &str) -> bool {
    s.chars().all(|c| matches!(c, ' ' | '\t' | '\n'))
}

fn path_of(stack: &[Open]) -> String {
    let mut p = String::new();
    for o in stack {
        p.push('/');
        p.push_str(&o.node.name);
    }
    p
}

fn split_qname(q: &[u8]) -> Result<(Option<String>, String), TemplateErrorKind> {
    let q = std::str::from_utf8(q).map_err(|e| refuse("well-formed", e.to_string()))?;
    match q.split_once(':') {
        Some((p, l)) => {
            if p.is_empty() || l.is_empty() || l.contains(':') {
                return Err(refuse(
                    "well-formed",
                    format!("malformed name {}", super::show(q)),
                ));
            }
            Ok((Some(p.to_string()), l.to_string()))
        }
        None => Ok((None, q.to_string())),
    }
}

fn lookup(
    scopes: &HashMap<String, Vec<String>>,
    prefix: &str,
) -> Result<Option<String>, TemplateErrorKind> {
    if prefix == "xml" {
        return Ok(Some(XML_NS.to_string()));
    }
    match scopes.get(prefix).and_then(|v| v.last()) {
        Some(uri) if uri.is_empty() && !prefix.is_empty() => Err(refuse(
            "namespaces",
            format!("prefix {} is unbound", super::show(prefix)),
        )),
        Some(uri) if uri.is_empty() => Ok(None),
        Some(uri) => Ok(Some(uri.clone())),
        None if prefix.is_empty() => Ok(None),
        None => Err(refuse(
            "namespaces",
            format!("prefix {} is not declared", super::show(prefix)),
        )),
    }
}

fn open_element(
    e: &BytesStart<'_>,
    stack: &[Open],
    scopes: &mut HashMap<String, Vec<String>>,
    opaque: Opaque,
    elements: usize,
) -> Result<Open, TemplateErrorKind> {
    let depth = stack.len() + 1;
    let (prefix, name) = split_qname(e.name().as_ref())?;
    let parent_path = path_of(stack);
    let here = format!("{parent_path}/{name}");
    if elements > MAX_ELEMENTS {
        return Err(refuse(
            "size",
            format!("more than {MAX_ELEMENTS} elements (at {here})"),
        ));
    }
    if depth > MAX_DEPTH {
        return Err(refuse(
            "depth",
            format!("{here} is nested deeper than {MAX_DEPTH} elements"),
        ));
    }
    if let Some(parent) = stack.last()
        && parent.had_text
    {
        return Err(refuse(
            "text-only",
            format!("{parent_path} mixes text with the element <{name}>"),
        ));
    }
    let (in_metadata, namespaces_allowed) = match opaque {
        Opaque::Fragment => (true, true),
        Opaque::DomainMetadata => {
            let inside = stack.last().is_some_and(|p| p.in_metadata);
            let is_metadata = depth == 2 && name == "metadata" && prefix.is_none();
            // Namespaces live in metadata's children, not on `<metadata>` itself.
            (inside || is_metadata, inside)
        }
    };

    let mut declared: Vec<(String, String)> = Vec::new();
    let mut raw_attrs: Vec<(Option<String>, String, String)> = Vec::new();
    let mut count = 0usize;
    for a in e.attributes().with_checks(true) {
        let a = a.map_err(|err| refuse("well-formed", format!("{here}: {err}")))?;
        count += 1;
        if count > MAX_ATTRIBUTES {
            return Err(refuse(
                "size",
                format!("{here} has more than {MAX_ATTRIBUTES} attributes"),
            ));
        }
        let raw = std::str::from_utf8(a.value.as_ref())
            .map_err(|err| refuse("well-formed", err.to_string()))?;
        if raw.contains(['\t', '\n', '<']) {
            return Err(refuse(
                "characters",
                format!(
                    "{here} has an attribute value with a raw tab, line feed or '<' (libxml2 rewrites or refuses it)"
                ),
            ));
        }
        let value = a
            .unescape_value()
            .map_err(|err| refuse("well-formed", format!("{here}: {err}")))?
            .into_owned();
        for c in value.chars() {
            check_char_value(c)?;
        }
        let (aprefix, alocal) = split_qname(a.key.as_ref())?;
        let is_decl =
            aprefix.as_deref() == Some("xmlns") || (aprefix.is_none() && alocal == "xmlns");
        if (is_decl || aprefix.is_some()) && !namespaces_allowed {
            return Err(refuse(
                "namespaces",
                format!(
                    "{here} has {} {}: namespaces are allowed only inside /domain/metadata (libvirt matches attributes by local name and takes the first)",
                    if is_decl {
                        "the namespace declaration"
                    } else {
                        "the prefixed attribute"
                    },
                    super::show(&String::from_utf8_lossy(a.key.as_ref()))
                ),
            ));
        }
        if is_decl {
            let p = if aprefix.is_some() {
                alocal
            } else {
                String::new()
            };
            if p == "xml" || p == "xmlns" {
                return Err(refuse(
                    "namespaces",
                    format!("{here} redeclares the reserved prefix {}", super::show(&p)),
                ));
            }
            declared.push((p, value));
        } else {
            raw_attrs.push((aprefix, alocal, value));
        }
    }
    if prefix.is_some() && !namespaces_allowed {
        return Err(refuse(
            "namespaces",
            format!(
                "{here} has a prefixed name; elements outside /domain/metadata are in no namespace"
            ),
        ));
    }
    for (p, uri) in &declared {
        scopes.entry(p.clone()).or_default().push(uri.clone());
    }
    let ns = lookup(scopes, prefix.as_deref().unwrap_or(""))?;
    if !namespaces_allowed && ns.is_some() {
        return Err(refuse(
            "namespaces",
            format!("{here} is in a namespace; elements outside /domain/metadata are in none"),
        ));
    }
    let mut attrs = Vec::with_capacity(raw_attrs.len());
    for (aprefix, alocal, value) in raw_attrs {
        let ans = match aprefix {
            Some(p) => lookup(scopes, &p)?,
            None => None,
        };
        if attrs.iter().any(|x: &Attr| x.name == alocal && x.ns == ans) {
            return Err(refuse(
                "well-formed",
                format!("{here} has the attribute {} twice", super::show(&alocal)),
            ));
        }
        attrs.push(Attr {
            name: alocal,
            ns: ans,
            value,
        });
    }
    Ok(Open {
        node: Node {
            name,
            ns,
            attrs,
            children: Vec::new(),
            text: String::new(),
        },
        declared,
        had_comment: false,
        had_text: false,
        in_metadata,
    })
}

fn close_element(
    open: Open,
    stack: &mut [Open],
    scopes: &mut HashMap<String, Vec<String>>,
    root: &mut Option<Node>,
) -> Result<(), TemplateErrorKind> {
    for (p, _) in &open.declared {
        if let Some(v) = scopes.get_mut(p) {
            v.pop();
        }
    }
    let mut node = open.node;
    if open.had_text && open.had_comment {
        return Err(refuse(
            "text-only",
            format!(
                "{}/{} splits its text with a comment (libvirt would read the text around it as one)",
                path_of(stack),
                node.name
            ),
        ));
    }
    if !node.children.is_empty() {
        // Only white space between child elements, which libvirt ignores.
        node.text.clear();
    }
    match stack.last_mut() {
        Some(parent) => parent.node.children.push(node),
        None => *root = Some(node),
    }
    Ok(())
}
