//! A small XML builder that escapes everything it writes.
//!
//! Plugins never format XML by hand: element and attribute names are `&'static str`
//! (written by the plugin author, never taken from input), and every value and text is
//! escaped. The one exception, [`Element::trusted_fragment`], exists for the operator's
//! metadata mark, which must be embedded byte for byte.

use std::fmt::Write;

/// One XML element with attributes and children.
///
/// ```
/// use templates_sdk::xml::Element;
///
/// let xml = Element::new("disk")
///     .attr("type", "volume")
///     .child(Element::new("source").attr("pool", "default").attr("volume", "a&b"))
///     .child(Element::new("label").text("<root>"))
///     .to_xml();
/// assert_eq!(
///     xml,
///     "<disk type=\"volume\"><source pool=\"default\" volume=\"a&amp;b\"/>\
///      <label>&lt;root&gt;</label></disk>"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Element {
    name: &'static str,
    attrs: Vec<(&'static str, String)>,
    children: Vec<Node>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Node {
    Element(Element),
    Text(String),
    Trusted(String),
}

impl Element {
    /// A new element. The name is a literal chosen by the plugin author.
    pub fn new(name: &'static str) -> Self {
        Self {
            name,
            attrs: Vec::new(),
            children: Vec::new(),
        }
    }

    /// Adds an attribute; the value is escaped.
    pub fn attr(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.attrs.push((name, value.into()));
        self
    }

    /// Adds an attribute only when `value` is `Some`.
    pub fn attr_opt(self, name: &'static str, value: Option<impl Into<String>>) -> Self {
        match value {
            Some(v) => self.attr(name, v),
            None => self,
        }
    }

    /// Adds a child element.
    pub fn child(mut self, child: Element) -> Self {
        self.children.push(Node::Element(child));
        self
    }

    /// Adds a child element only when `child` is `Some`.
    pub fn child_opt(self, child: Option<Element>) -> Self {
        match child {
            Some(c) => self.child(c),
            None => self,
        }
    }

    /// Adds every element of `children`.
    pub fn children(mut self, children: impl IntoIterator<Item = Element>) -> Self {
        self.children
            .extend(children.into_iter().map(Node::Element));
        self
    }

    /// Adds text content; it is escaped.
    pub fn text(mut self, text: impl Into<String>) -> Self {
        self.children.push(Node::Text(text.into()));
        self
    }

    /// Adds an XML fragment verbatim. Only for the operator's metadata mark, which the
    /// operator built and escaped itself and checks byte for byte in the output; never
    /// pass settings or other input here.
    pub fn trusted_fragment(mut self, xml: impl Into<String>) -> Self {
        self.children.push(Node::Trusted(xml.into()));
        self
    }

    /// Serialises the element and its children, without an XML declaration.
    pub fn to_xml(&self) -> String {
        let mut out = String::new();
        self.write(&mut out, None, 0);
        out
    }

    /// Serialises with two-space indentation, one element per line, for readable output.
    pub fn to_pretty_xml(&self) -> String {
        let mut out = String::new();
        self.write(&mut out, Some(2), 0);
        out.push('\n');
        out
    }

    fn write(&self, out: &mut String, indent: Option<usize>, depth: usize) {
        out.push('<');
        out.push_str(self.name);
        for (name, value) in &self.attrs {
            // Writing to a String cannot fail.
            let _ = write!(out, " {name}=\"{}\"", escape(value, true));
        }
        if self.children.is_empty() {
            out.push_str("/>");
            return;
        }
        out.push('>');
        let only_text = self.children.iter().all(|c| matches!(c, Node::Text(_)));
        for child in &self.children {
            if let (Some(step), false) = (indent, only_text) {
                out.push('\n');
                out.push_str(&" ".repeat(step * (depth + 1)));
            }
            match child {
                Node::Element(e) => e.write(out, indent, depth + 1),
                Node::Text(t) => out.push_str(&escape(t, false)),
                Node::Trusted(x) => out.push_str(x),
            }
        }
        if let (Some(step), false) = (indent, only_text) {
            out.push('\n');
            out.push_str(&" ".repeat(step * depth));
        }
        out.push_str("</");
        out.push_str(self.name);
        out.push('>');
    }
}

/// Escapes text or an attribute value. Control characters other than tab, newline and
/// carriage return are not allowed in XML 1.0 at all, so they are dropped.
pub fn escape(value: &str, attribute: bool) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' if attribute => out.push_str("&quot;"),
            '\'' if attribute => out.push_str("&apos;"),
            '\n' if attribute => out.push_str("&#10;"),
            '\t' if attribute => out.push_str("&#9;"),
            '\r' => out.push_str("&#13;"),
            '\t' | '\n' => out.push(c),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_attributes_and_text() {
        let x = Element::new("a")
            .attr("v", "\"'<>&\n\t")
            .text("<x>&\"'")
            .to_xml();
        assert_eq!(
            x,
            "<a v=\"&quot;&apos;&lt;&gt;&amp;&#10;&#9;\">&lt;x&gt;&amp;\"'</a>"
        );
    }

    #[test]
    fn drops_characters_xml_cannot_carry() {
        assert_eq!(escape("a\0b\u{1b}c", false), "abc");
    }

    #[test]
    fn empty_elements_self_close_and_pretty_indents() {
        let e = Element::new("devices")
            .child(Element::new("rng").attr("model", "virtio"))
            .child(Element::new("name").text("n"));
        assert_eq!(
            e.to_xml(),
            "<devices><rng model=\"virtio\"/><name>n</name></devices>"
        );
        assert_eq!(
            e.to_pretty_xml(),
            "<devices>\n  <rng model=\"virtio\"/>\n  <name>n</name>\n</devices>\n"
        );
    }

    #[test]
    fn trusted_fragment_is_verbatim_and_optional_parts_skip() {
        let e = Element::new("metadata")
            .trusted_fragment("<m:mark xmlns:m=\"urn:x\"/>")
            .attr_opt("a", None::<String>)
            .child_opt(None);
        assert_eq!(
            e.to_xml(),
            "<metadata><m:mark xmlns:m=\"urn:x\"/></metadata>"
        );
    }
}
