//! The generated vendor-data corpus: YAML 1.1/1.2 edge scalars in every position, YAML
//! structures PyYAML and a YAML 1.2 parser may part on, plain first lines and line ends,
//! and MIME forms (encodings × header cases × folds × preamble/epilogue × line ends).
//! Deterministic: the same documents, in the same order, on every run. Each document
//! carries labels, so the test can show that every accepted class really is accepted.

use base64::Engine as _;

/// One generated document.
pub struct Doc {
    /// What the document exercises (`base64`, `preamble`, `scalar:top`, ...).
    pub labels: Vec<String>,
    pub text: String,
}

impl Doc {
    fn new(labels: &[&str], text: String) -> Self {
        Doc {
            labels: labels.iter().map(|l| l.to_string()).collect(),
            text,
        }
    }
}

/// A file for `make-mime`: name, content and type (`cloud-config`, `x-shellscript`).
pub type MimeFile = (String, String, String);

/// A document for cloud-init's `devel make-mime` to write from files.
pub struct MakeMime {
    pub labels: Vec<String>,
    pub files: Vec<MimeFile>,
}

/// Plain scalars where YAML 1.1 (PyYAML) and YAML 1.2 may part, quoted forms that must
/// stay strings, and text PyYAML's scanner refuses.
pub const SCALARS: &[&str] = &[
    // Booleans and nulls, 1.1 and 1.2 spellings.
    "yes",
    "Yes",
    "YES",
    "no",
    "No",
    "NO",
    "on",
    "On",
    "ON",
    "off",
    "Off",
    "OFF",
    "y",
    "Y",
    "n",
    "N",
    "true",
    "True",
    "TRUE",
    "tRue",
    "false",
    "FALSE",
    "null",
    "Null",
    "NULL",
    "nULL",
    "~",
    "",
    // Integers.
    "0",
    "-0",
    "+0",
    "7",
    "+1",
    "-1",
    "0644",
    "-0644",
    "0o644",
    "0O644",
    "08",
    "09",
    "0_7",
    "0x1F",
    "0X1F",
    "0x_FF",
    "0xff",
    "0b1010",
    "0b_",
    "0x_",
    "0b2",
    "1_000",
    "1_000_000",
    "1:30",
    "1:30:00",
    "-1:30",
    "1:60",
    "1:5",
    "01:30",
    "190:20:30",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775808",
    "-9223372036854775809",
    "99999999999999999999",
    // Floats.
    "1.5",
    "-1.5",
    "+1.5",
    "1.",
    ".5",
    "-.5",
    "1e3",
    "1E3",
    "1e+3",
    "1.0e3",
    "1.0e+3",
    "1.0E-3",
    "1.e+3",
    "6.8523015e+5",
    "1_000.5",
    "1:30.5",
    "190:20:30.15",
    ".inf",
    "-.inf",
    "+.inf",
    ".Inf",
    ".INF",
    ".iNf",
    ".nan",
    ".NaN",
    ".NAN",
    "nan",
    "inf",
    "1e400",
    "1.0e+400",
    "0.1",
    "3.14159265358979",
    "1.7976931348623157e+308",
    "-0.0",
    // Timestamps and specials.
    "2027-01-01",
    "2027-1-1",
    "2027-13-45",
    "2027-01-01 10:00:00",
    "2027-01-01T10:00:00Z",
    "2001-12-14t21:59:43.10-05:00",
    "2001-12-14 21:59:43.10 -5",
    "=",
    "<<",
    // Strings that look like something.
    "192.0.2.1",
    "1.2.3",
    "http://example.org:80/a#b",
    "a#b",
    "a b",
    "-x",
    "?x",
    ":x",
    "x:",
    "a:b",
    "caf\u{e9}",
    "0.0.0.0/0",
    "v1.0",
    "1-2",
    "+",
    "-",
    ".",
    "..",
    "0x",
    // Quoted forms: strings to everyone.
    "'yes'",
    "\"no\"",
    "'0644'",
    "\"1:30\"",
    "'='",
    "'<<'",
    "'~'",
    "''",
    "\"\"",
    "'it''s'",
    "\"a\\tb\"",
    "\"\\x41\"",
    "\"\\u00e9\"",
    "\"\\/\"",
    "\"\\N\"",
    "\"\\_\"",
    "\"\\e\"",
    "\"\\U0001F600\"",
    "'a\tb'",
    "\"a\tb\"",
    // Text PyYAML refuses or reads apart.
    "@x",
    "`x",
    "%x",
    "a\tb",
    "a\t",
    "!x",
    "&a x",
    "*a",
    "|",
    ">",
    "[a, =]",
    "{a: =}",
    "[a, b,]",
    "{a: 1, }",
    "[a:b]",
    "{a:1}",
    "{a: 1, a: 2}",
];

/// Where a scalar goes in a cloud-config document.
const POSITIONS: &[(&str, &str)] = &[
    ("top", "k: {S}\n"),
    ("nested", "k:\n  n: {S}\n"),
    ("item", "k:\n- {S}\n"),
    ("flow-item", "k: [{S}, x]\n"),
    ("flow-value", "k: {n: {S}}\n"),
    ("nested-key", "k:\n  {S}: v\n"),
    ("top-key", "{S}: v\n"),
];

/// YAML structures: tabs, directives, documents, anchors, block and flow forms.
const STRUCTURES: &[&str] = &[
    "a: 1\nb:\n  c: [x, y]\n  d: {e: f}\n",
    "a:\tb\n",
    "a: b\t\n",
    "a:\n\t- b\n",
    "a:\n  - b\n\t- c\n",
    "\ta: 1\n",
    "a: 1 # tab\tin comment\n",
    "# tab\tin comment\na: 1\n",
    "\t# tab before comment\na: 1\n",
    "a: |\n  x\ty\n  z\n",
    "a: |\n\tx\n",
    "a: |\n  x\n\ty\n",
    "a: >\n  folded\n  text\n\n  more\n",
    "a: |-\n  strip\n",
    "a: |+\n  keep\n\n",
    "a: |2\n   indented\n",
    "a: \"multi\n  line\"\n",
    "a: \"multi\n\tline\"\n",
    "a: 'multi\n\n  line'\n",
    "a: plain\n  multi\n  line\n",
    "%YAML 1.1\n---\na: 1\n",
    "%YAML 1.2\n---\na: 1\n",
    "%TAG !e! tag:example.com,2000:\n---\na: 1\n",
    "---\na: 1\n",
    "---\na: 1\n...\n",
    "a: 1\n---\nb: 2\n",
    "a: 1\n...\n---\nb: 2\n",
    "a: &x 1\nb: *x\n",
    "a: &x {c: 1}\nb: *x\n",
    "a: &x [1, 2]\nb: *x\n",
    "a: *x\n",
    "base: &b {x: 1}\nother:\n  <<: *b\n",
    "? a\n: b\n",
    "? [a]\n: b\n",
    "a: []\nb: {}\n",
    "a:\n- - x\n  - y\n- b: 1\n  c: 2\n",
    "a:\n  b:\n  c:\n",
    "a: b: c\n",
    "a: - b\n",
    "a: [b\n",
    "- a\n- b\n",
    "just a string\n",
    "a: 1\na: 2\n",
    "a: !!str 1\n",
    "a: !!binary aGk=\n",
    "a: !!python/object/apply:os.system [id]\n",
    "merge_how: 'dict(recurse_array)+list(append)'\na: [1]\n",
    "a: 'x'  \n",
    "a: \"\\q\"\n",
    "a: \"\\ud800\"\n",
    "a:   \n  b\n",
    "a: b\n c\n",
    "a: -\n",
    "a: - \n",
    "a:\n  - b\n  -\n",
    "a: \"x\\\n  y\"\n",
    "a: \"x\n\n  y\"\n",
    "a: 'x\n\n  y'\n",
    "a: \"\\L\\P\\N\\_\\0\\a\"\n",
    "a: \"x \\\n  \\ y\"\n",
    "a: >-\n  x\n\n   y\n  z\n",
];

/// First lines of the plain form (the body follows).
const FIRST_LINES: &[(&str, &str)] = &[
    ("exact", "#cloud-config"),
    ("space", "#cloud-config "),
    ("tab", "#cloud-config\t"),
    ("spaces", "#cloud-config  \t "),
    ("case", "#Cloud-Config"),
    ("suffix", "#cloud-configx"),
    ("archive", "#cloud-config-archive"),
    ("indented", " #cloud-config"),
    ("comment", "#cloud-config # vendor"),
];

const CONFIG: &str = "#cloud-config\npackages: [curl]\nntp:\n  enabled: true\n  servers: [ntp.example.org]\nwrite_files:\n- path: /etc/x\n  permissions: '0644'\n  content: |\n    a=b c\n";
const CONFIG_UTF8: &str =
    "#cloud-config\nbootcmd:\n- echo caf\u{e9} \u{20ac}\nruncmd: [[sh, -c, 'echo a=b']]\n";
const SECOND: &str = "#cloud-config\npackages: [tinyproxy]\nntp: {enabled: false}\nc: 3\n";
const SCRIPT: &str = "#!/bin/sh\nset -eu\necho 'a=b' \"$1\"\n";

/// The whole corpus, plus the file lists that `make-mime` turns into documents (the test
/// runs cloud-init's own tool on them and adds its output).
pub fn generate() -> (Vec<Doc>, Vec<MakeMime>) {
    let mut docs = Vec::new();
    let mut make_mime = Vec::new();
    for scalar in SCALARS {
        for (position, template) in POSITIONS {
            let yaml = template.replace("{S}", scalar);
            docs.push(Doc::new(
                &["scalar", &format!("scalar:{position}")],
                format!("#cloud-config\n{yaml}"),
            ));
        }
        // The same values in a MIME part, as written and base64-encoded.
        let yaml = format!("k: {scalar}\nm: [{scalar}]\n");
        for encoding in ["7bit", "base64"] {
            docs.push(Doc::new(
                &["scalar", "scalar:mime", encoding],
                multipart(&[Part::config(&yaml, encoding)], &Shape::default()),
            ));
        }
        make_mime.push(MakeMime {
            labels: vec!["make-mime".to_string(), "scalar".to_string()],
            files: vec![(
                "values.yaml".to_string(),
                format!("#cloud-config\nk: {scalar}\nl:\n- {scalar}\n"),
                "cloud-config".to_string(),
            )],
        });
    }
    for yaml in STRUCTURES {
        docs.push(Doc::new(&["structure"], format!("#cloud-config\n{yaml}")));
        docs.push(Doc::new(
            &["structure", "crlf", "crlf-plain"],
            format!("#cloud-config\n{yaml}").replace('\n', "\r\n"),
        ));
        docs.push(Doc::new(
            &["structure", "structure:mime", "base64"],
            multipart(&[Part::config(yaml, "base64")], &Shape::default()),
        ));
    }
    for (label, first) in FIRST_LINES {
        for crlf in [false, true] {
            let mut text = format!("{first}\n{}", &CONFIG["#cloud-config\n".len()..]);
            let mut labels = vec!["first-line".to_string(), format!("first-line:{label}")];
            if crlf {
                text = text.replace('\n', "\r\n");
                labels.push("crlf-plain".into());
            }
            docs.push(Doc { labels, text });
        }
    }
    // `VENDOR_FUZZ_SEED` / `VENDOR_FUZZ_COUNT` explore other documents; the defaults are
    // what the test runs.
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let seed = env("VENDOR_FUZZ_SEED").unwrap_or(FUZZ_SEED);
    let count = env("VENDOR_FUZZ_COUNT").map_or(FUZZ_COUNT, |c| c as usize);
    for (i, text) in fuzz(count, seed).into_iter().enumerate() {
        let labels: &[&str] = if i % 3 == 0 {
            &["fuzz", "fuzz:mime"]
        } else {
            &["fuzz"]
        };
        let text = if i % 3 == 0 {
            let encoding = if i % 2 == 0 { "base64" } else { "7bit" };
            multipart(&[Part::config(&text, encoding)], &Shape::default())
        } else {
            format!("#cloud-config\n{text}")
        };
        docs.push(Doc::new(labels, text));
    }
    mime_forms(&mut docs);
    for text in mime_fuzz(MIME_FUZZ_COUNT, seed) {
        docs.push(Doc::new(&["mime-fuzz"], text));
    }
    make_mime.push(MakeMime {
        labels: vec!["make-mime".to_string()],
        files: vec![
            ("config.yaml".into(), CONFIG.into(), "cloud-config".into()),
            (
                "utf8.yaml".into(),
                CONFIG_UTF8.into(),
                "cloud-config".into(),
            ),
            ("setup.sh".into(), SCRIPT.into(), "x-shellscript".into()),
            ("second.yaml".into(), SECOND.into(), "cloud-config".into()),
        ],
    });
    (docs, make_mime)
}

/// A part of a generated multipart document.
struct Part {
    content_type: &'static str,
    filename: Option<&'static str>,
    payload: String,
    encoding: &'static str,
}

impl Part {
    fn config(yaml: &str, encoding: &'static str) -> Self {
        Part {
            content_type: "text/cloud-config",
            filename: None,
            payload: yaml.to_string(),
            encoding,
        }
    }
}

/// How a multipart document is written: header case, folds, preamble, epilogue, line ends.
#[derive(Default, Clone)]
struct Shape {
    /// `canonical`, `lower`, `upper` or `types` (type names in mixed case).
    case: &'static str,
    /// `none`, `space`, `tab` (after a `;`) or `wrong` (before a `;`).
    fold: &'static str,
    preamble: bool,
    epilogue: bool,
    crlf: bool,
}

fn header(shape: &Shape, name: &str, value: &str) -> String {
    let name = match shape.case {
        "lower" => name.to_ascii_lowercase(),
        "upper" => name.to_ascii_uppercase(),
        _ => name.to_string(),
    };
    let value = match shape.fold {
        "space" => value.replacen("; ", ";\n ", 1),
        "tab" => value.replacen("; ", ";\n\t", 1),
        "wrong" => value.replacen("; ", "\n ; ", 1),
        _ => value.to_string(),
    };
    format!("{name}: {value}\n")
}

fn multipart(parts: &[Part], shape: &Shape) -> String {
    let boundary = "==============36==";
    let types = shape.case == "types";
    let mixed = if types {
        "Multipart/Mixed"
    } else {
        "multipart/mixed"
    };
    let mut out = header(
        shape,
        "Content-Type",
        &format!("{mixed}; boundary=\"{boundary}\""),
    );
    out.push_str(&header(shape, "MIME-Version", "1.0"));
    out.push('\n');
    if shape.preamble {
        out.push_str("This is a multi-part message in MIME format.\n\n");
    }
    for part in parts {
        out.push_str(&format!("--{boundary}\n"));
        let kind = if types {
            part.content_type
                .replace("text/cloud-config", "Text/Cloud-Config")
        } else {
            part.content_type.to_string()
        };
        out.push_str(&header(
            shape,
            "Content-Type",
            &format!("{kind}; charset=\"utf-8\""),
        ));
        if part.encoding != "none" {
            out.push_str(&header(shape, "Content-Transfer-Encoding", part.encoding));
        }
        if let Some(name) = part.filename {
            out.push_str(&header(
                shape,
                "Content-Disposition",
                &format!("attachment; filename=\"{name}\""),
            ));
        }
        out.push('\n');
        out.push_str(&encode(&part.payload, part.encoding));
        out.push('\n');
    }
    out.push_str(&format!("--{boundary}--\n"));
    if shape.epilogue {
        // Python stops at the close delimiter: a part written after it is never read.
        out.push_str(&format!(
            "\nThat was all.\n--{boundary}\nContent-Type: text/x-shellscript\n\n#!/bin/sh\n"
        ));
    }
    if shape.crlf {
        out = out.replace('\n', "\r\n");
    }
    out
}

/// The payload as the encoding writes it (line-wrapped as Python's encoders wrap).
fn encode(payload: &str, encoding: &str) -> String {
    match encoding.to_ascii_lowercase().as_str() {
        "base64" => {
            let text = base64::engine::general_purpose::STANDARD.encode(payload);
            let lines: Vec<&str> = text
                .as_bytes()
                .chunks(76)
                .map(|c| std::str::from_utf8(c).unwrap_or_default())
                .collect();
            lines.join("\n") + "\n"
        }
        "quoted-printable" => quoted_printable(payload, encoding == "quoted-printable"),
        _ => payload.to_string(),
    }
}

/// Quoted-printable with `=XX` escapes (upper- or lower-case hex) and soft breaks at 76.
fn quoted_printable(payload: &str, upper: bool) -> String {
    let mut out = String::new();
    for line in payload.split('\n') {
        let mut width = 0;
        for b in line.bytes() {
            let piece = if b == b'=' || !(0x20..0x7f).contains(&b) {
                if upper {
                    format!("={b:02X}")
                } else {
                    format!("={b:02x}")
                }
            } else {
                char::from(b).to_string()
            };
            if width + piece.len() > 75 {
                out.push_str("=\n");
                width = 0;
            }
            width += piece.len();
            out.push_str(&piece);
        }
        out.push('\n');
    }
    out.pop();
    out
}

/// Every MIME form: part sets × encodings × header cases × folds × preamble/epilogue ×
/// line ends.
fn mime_forms(docs: &mut Vec<Doc>) {
    let encodings = [
        "none",
        "7bit",
        "8bit",
        "base64",
        "Base64",
        "quoted-printable",
        "Quoted-Printable",
    ];
    for set in ["config", "config+script", "utf8"] {
        for encoding in encodings {
            for case in ["canonical", "lower", "upper", "types"] {
                for fold in ["none", "space", "tab", "wrong"] {
                    for (preamble, epilogue) in
                        [(false, false), (true, false), (false, true), (true, true)]
                    {
                        for crlf in [false, true] {
                            let shape = Shape {
                                case,
                                fold,
                                preamble,
                                epilogue,
                                crlf,
                            };
                            let mut parts = vec![Part {
                                content_type: "text/cloud-config",
                                filename: Some("config.yaml"),
                                payload: if set == "utf8" { CONFIG_UTF8 } else { CONFIG }
                                    .to_string(),
                                encoding,
                            }];
                            if set == "config+script" {
                                parts.push(Part {
                                    content_type: "text/x-shellscript",
                                    filename: Some("setup.sh"),
                                    payload: SCRIPT.to_string(),
                                    encoding,
                                });
                                parts.push(Part {
                                    content_type: "text/cloud-config",
                                    filename: None,
                                    payload: SECOND.to_string(),
                                    encoding,
                                });
                            }
                            let mut labels = vec![
                                "mime".to_string(),
                                format!("parts:{set}"),
                                encoding.to_ascii_lowercase(),
                                format!("case:{case}"),
                                format!("fold:{fold}"),
                            ];
                            if preamble {
                                labels.push("preamble".into());
                            }
                            if epilogue {
                                labels.push("epilogue".into());
                            }
                            if crlf {
                                labels.push("crlf".into());
                            }
                            docs.push(Doc {
                                labels,
                                text: multipart(&parts, &shape),
                            });
                        }
                    }
                }
            }
        }
    }
}

/// How many random YAML documents the fuzzer writes, and from which seed.
const FUZZ_COUNT: usize = 1500;
const FUZZ_SEED: u64 = 0x36_5EED;
/// How many perturbed multipart documents the MIME fuzzer writes.
const MIME_FUZZ_COUNT: usize = 1500;

/// A small deterministic generator (SplitMix64): the same documents on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

const EVERYDAY: &[&str] = &[
    "curl",
    "ntp.example.org",
    "true",
    "false",
    "42",
    "1.5",
    "'0644'",
    "/etc/tinyproxy.conf",
    "echo hi",
    "\"a: b\"",
    "192.0.2.10",
    "[sh, -c, 'echo x']",
    "{path: /x, content: y}",
];

const FUZZ_KEYS: &[&str] = &[
    "a",
    "packages",
    "k_1",
    "ntp",
    "runcmd",
    "write_files",
    "n",
    "x y",
    "x:y",
    "'q'",
    "\"d\"",
    "1",
    "yes",
    "-k",
    "k#",
    "caf\u{e9}",
];

/// Random cloud-config bodies: nested block and flow collections of edge scalars, block
/// scalars, comments, then perturbed (a tab for a space, a shifted indent, trailing
/// blanks, a stray indicator, CRLF), so that both parsers meet what plugins might write
/// by mistake.
fn fuzz(count: usize, seed: u64) -> Vec<String> {
    let mut rng = Rng(seed);
    (0..count)
        .map(|_| {
            let mut out = String::new();
            for _ in 0..1 + rng.below(4) {
                let key = rng.pick(FUZZ_KEYS);
                fuzz_value(&mut rng, &mut out, key, 0, 2);
            }
            perturb(&mut rng, out)
        })
        .collect()
}

fn fuzz_value(rng: &mut Rng, out: &mut String, key: &str, indent: usize, depth: usize) {
    let pad = " ".repeat(indent);
    // Half edge cases, half what plugins write every day.
    let scalar = |rng: &mut Rng| {
        if rng.chance(50) {
            rng.pick(SCALARS).to_string()
        } else {
            rng.pick(EVERYDAY).to_string()
        }
    };
    match if depth == 0 { 0 } else { rng.below(7) } {
        0 | 1 => out.push_str(&format!("{pad}{key}: {}\n", scalar(rng))),
        2 => {
            out.push_str(&format!("{pad}{key}:\n"));
            for _ in 0..1 + rng.below(3) {
                out.push_str(&format!("{pad}- {}\n", scalar(rng)));
            }
        }
        3 => {
            out.push_str(&format!("{pad}{key}:\n"));
            for _ in 0..1 + rng.below(3) {
                let inner = rng.pick(FUZZ_KEYS);
                fuzz_value(rng, out, inner, indent + 2, depth - 1);
            }
        }
        4 => {
            let items: Vec<String> = (0..rng.below(4)).map(|_| scalar(rng)).collect();
            out.push_str(&format!("{pad}{key}: [{}]\n", items.join(", ")));
        }
        5 => {
            let inner = rng.pick(FUZZ_KEYS);
            out.push_str(&format!("{pad}{key}: {{{inner}: {}}}\n", scalar(rng)));
        }
        _ => {
            let style = rng.pick(&["|", ">", "|-", "|+", ">-"]);
            out.push_str(&format!("{pad}{key}: {style}\n"));
            for _ in 0..1 + rng.below(3) {
                let line = rng.pick(&["text", "a\tb", "# not a comment", "  more", "", "x: y"]);
                out.push_str(&format!("{pad}  {line}\n"));
            }
        }
    }
    if rng.chance(15) {
        out.push_str(&format!(
            "{pad}# {}\n",
            rng.pick(&["note", "a\ttab", "k: v"])
        ));
    }
}

fn perturb(rng: &mut Rng, text: String) -> String {
    let mut bytes: Vec<char> = text.chars().collect();
    match rng.below(10) {
        0 => {
            // A tab where a space was.
            let spaces: Vec<usize> = (0..bytes.len()).filter(|&i| bytes[i] == ' ').collect();
            if !spaces.is_empty() {
                let at = spaces[rng.below(spaces.len())];
                bytes[at] = '\t';
            }
        }
        1 => {
            // An indent one space deeper or shallower.
            let starts: Vec<usize> = (1..bytes.len()).filter(|&i| bytes[i - 1] == '\n').collect();
            if !starts.is_empty() {
                let at = starts[rng.below(starts.len())];
                if bytes[at] == ' ' && rng.chance(50) {
                    bytes.remove(at);
                } else {
                    bytes.insert(at, ' ');
                }
            }
        }
        2 => {
            // Trailing blanks on a line.
            let ends: Vec<usize> = (0..bytes.len()).filter(|&i| bytes[i] == '\n').collect();
            let at = ends[rng.below(ends.len())];
            let blank = if rng.chance(50) { ' ' } else { '\t' };
            bytes.insert(at, blank);
        }
        3 => {
            // A stray indicator somewhere.
            let at = rng.below(bytes.len());
            let c = rng.pick(&[
                "&", "*", "!", "%", "|", ">", "@", "`", "'", "\"", "{", "]", ",", "#", ":", "-",
                "?", "=",
            ]);
            bytes.insert(at, c.chars().next().unwrap_or('&'));
        }
        4 => {
            // A document marker.
            let marker: Vec<char> = rng
                .pick(&["---\n", "...\n", "--- ", "%YAML 1.1\n---\n"])
                .chars()
                .collect();
            bytes.splice(0..0, marker);
        }
        _ => {}
    }
    let text: String = bytes.into_iter().collect();
    if rng.chance(10) {
        text.replace('\n', "\r\n")
    } else {
        text
    }
}

/// Multipart documents of every encoding and shape, each perturbed once where a plugin's
/// string building might slip (a blank, a `;`, a quote, a line end, a dropped or doubled
/// character, a letter's case, a repeated line), for Python's `email` and our reader to
/// meet.
fn mime_fuzz(count: usize, seed: u64) -> Vec<String> {
    let mut rng = Rng(seed ^ 0x4D49_4D45);
    let encodings = ["none", "7bit", "base64", "quoted-printable"];
    (0..count)
        .map(|_| {
            let shape = Shape {
                case: rng.pick(&["canonical", "lower", "types"]),
                fold: rng.pick(&["none", "space", "tab"]),
                preamble: rng.chance(30),
                epilogue: rng.chance(30),
                crlf: false,
            };
            let encoding = rng.pick(&encodings);
            let mut parts = vec![Part {
                content_type: "text/cloud-config",
                filename: Some("config.yaml"),
                payload: CONFIG.to_string(),
                encoding,
            }];
            if rng.chance(50) {
                parts.insert(
                    0,
                    Part {
                        content_type: "text/x-shellscript",
                        filename: Some("setup.sh"),
                        payload: SCRIPT.to_string(),
                        encoding,
                    },
                );
            }
            let text = multipart(&parts, &shape);
            let mut chars: Vec<char> = text.chars().collect();
            let at = rng.below(chars.len());
            match rng.below(6) {
                0 => {
                    let c = rng.pick(&[" ", "\t", ";", "\"", "=", "-", "\n", ":", "\r", "/"]);
                    chars.insert(at, c.chars().next().unwrap_or(' '));
                }
                1 => {
                    chars.remove(at);
                }
                2 => {
                    let c = chars[at];
                    chars.insert(at, c);
                }
                3 => {
                    let c = chars[at];
                    chars[at] = if c.is_ascii_lowercase() {
                        c.to_ascii_uppercase()
                    } else {
                        c.to_ascii_lowercase()
                    };
                }
                4 => {
                    // A line repeated.
                    let text: String = chars.iter().collect();
                    let lines: Vec<&str> = text.split('\n').collect();
                    let n = rng.below(lines.len());
                    let mut out: Vec<&str> = lines.clone();
                    out.insert(n, lines[n]);
                    chars = out.join("\n").chars().collect();
                }
                _ => {
                    // A line dropped.
                    let text: String = chars.iter().collect();
                    let mut lines: Vec<&str> = text.split('\n').collect();
                    lines.remove(rng.below(lines.len()));
                    chars = lines.join("\n").chars().collect();
                }
            }
            chars.into_iter().collect()
        })
        .collect()
}
