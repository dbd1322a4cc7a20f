//! The vendor-data reader: one refusal table per rule (rule and where), and an accepted
//! corpus with what was understood.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use super::*;
use crate::templates::check::check_vendor_data;

/// The default plugin's output for the sample Proxy.
const DEFAULT_PLUGIN: &str =
    include_str!("../../../../../tests/snapshots/vendor-data-default.mime");

const SCRIPT: &str = "#!/bin/sh\necho hello\n";

/// A multipart document from raw part texts (headers, empty line, payload).
fn mime(boundary_param: &str, boundary: &str, parts: &[&str]) -> String {
    let mut out =
        format!("Content-Type: multipart/mixed; boundary={boundary_param}\nMIME-Version: 1.0\n\n");
    for p in parts {
        out.push_str(&format!("--{boundary}\n{p}\n"));
    }
    out.push_str(&format!("--{boundary}--\n"));
    out
}

fn script_part(filename: &str, payload: &str) -> String {
    format!(
        "Content-Type: text/x-shellscript; charset=\"us-ascii\"\nMIME-Version: 1.0\n\
         Content-Transfer-Encoding: 7bit\nContent-Disposition: attachment; filename=\"{filename}\"\n\n{payload}"
    )
}

fn config_part(payload: &str) -> String {
    format!("Content-Type: text/cloud-config\n\n{payload}")
}

/// A two-part document with the script first and `extra` as the second part.
fn with_part(extra: &str) -> String {
    mime("\"B\"", "B", &[&script_part("a.sh", SCRIPT), extra])
}

#[track_caller]
fn refused(text: &str) -> (&'static str, String) {
    match read_vendor_data(text) {
        Err(TemplateErrorKind::InvalidOutput { rule, detail }) => (rule, detail),
        other => panic!("accepted or other error: {other:?}\n--- document ---\n{text}"),
    }
}

/// Each case: the document and fragments the detail must contain (where and why).
#[track_caller]
fn table(rule: &str, cases: &[(String, &[&str])]) {
    for (text, wants) in cases {
        let (got, detail) = refused(text);
        assert_eq!(got, rule, "{detail}\n--- document ---\n{text}");
        for want in *wants {
            assert!(
                detail.contains(want),
                "detail {detail:?} lacks {want:?}\n--- document ---\n{text}"
            );
        }
    }
}

#[test]
fn control_characters_are_refused() {
    let ok = with_part(&config_part("a: 1"));
    table(
        "control-character",
        &[
            (
                ok.replace('\n', "\r\n"),
                &["line 1", "U+000D", "carriage return"],
            ),
            (ok.replace("echo hello", "echo\rhello"), &["U+000D"]),
            ("#cloud-config\na: \"x\0\"\n".into(), &["line 2", "U+0000"]),
            (
                "#cloud-config\na: x\u{1b}[0m\n".into(),
                &["line 2", "U+001B"],
            ),
            ("#cloud-config\na: x\u{85}y\n".into(), &["U+0085"]),
            ("#cloud-config\na: x\u{2028}y\n".into(), &["U+2028"]),
            (
                "\u{feff}#cloud-config\na: 1\n".into(),
                &["line 1, column 1", "U+FEFF"],
            ),
            ("#cloud-config\na: 1\u{7f}\n".into(), &["U+007F"]),
        ],
    );
}

#[test]
fn unknown_forms_are_refused() {
    table(
        "vendor-data-format",
        &[
            ("#!/bin/sh\nrm -rf /\n".into(), &["line 1", "#cloud-config"]),
            (String::new(), &["line 1"]),
            ("#cloud-configx\na: 1\n".into(), &["line 1"]),
            ("#cloud-config-archive\n- a: 1\n".into(), &["line 1"]),
            (" #cloud-config\na: 1\n".into(), &["line 1"]),
            ("#include http://example.org/x\n".into(), &["line 1"]),
            // A #cloud-config document cloud-init would parse as MIME.
            (
                "#cloud-config\n# MIME-Version: 1.0\na: 1\n".into(),
                &["line 2", "MIME-Version"],
            ),
            (
                "#cloud-config\nx: \"mime-VERSION: 2\"\n".into(),
                &["line 2", "as MIME"],
            ),
        ],
    );
    // Past the 4096-character window cloud-init does not look.
    let late = format!(
        "#cloud-config\n#{}\nx: 'MIME-Version: 1'\n",
        "a".repeat(5000)
    );
    assert!(read_vendor_data(&late).is_ok());
}

#[test]
fn top_level_mime_headers_are_checked() {
    let body = "\n--B\nContent-Type: text/cloud-config\n\na: 1\n--B--\n";
    let doc = |headers: &str| format!("{headers}\n{body}");
    table(
        "mime-header",
        &[
            (
                doc("Content-Type: multipart/mixed; boundary=B\nMIME-Version: 1.0\nX-Foo: 1"),
                &["top-level headers, line 3", "\"X-Foo\"", "allow-list"],
            ),
            (
                doc("Content-Type: multipart/mixed; boundary=B\nContent-Type: text/plain\nMIME-Version: 1.0"),
                &["line 2", "repeats line 1"],
            ),
            (
                doc("Content-Type: multipart/mixed\n ; boundary=B\nMIME-Version: 1.0"),
                &["line 2", "folded"],
            ),
            (
                doc("MIME-Version:\n 1.0\nContent-Type: multipart/mixed; boundary=B"),
                &["line 1", "empty value"],
            ),
            (
                doc("Content-Type: multipart/mixed; boundary=B\nMIME-Version: 1.0;\n x=1"),
                &["line 3", "folded"],
            ),
            (
                doc("Content-Type: multipart/mixed; boundary=B\nMIME-Version: 2.0"),
                &["line 2", "MIME-Version is \"2.0\""],
            ),
            (
                doc("Content-Type: multipart/alternative; boundary=B\nMIME-Version: 1.0"),
                &["line 1", "multipart/mixed"],
            ),
            (
                doc("Content-Type: multipart/mixed; boundary=B; charset=utf-8\nMIME-Version: 1.0"),
                &["line 1", "\"charset\"", "allow-list"],
            ),
            (
                doc("Content-Type: multipart/mixed; boundary=B; boundary=C\nMIME-Version: 1.0"),
                &["line 1", "twice"],
            ),
            (
                doc("Content-Type: multipart/mixed; boundary*=B\nMIME-Version: 1.0"),
                &["line 1", "allow-list"],
            ),
            (
                doc("Content-Type: multipart/mixed; boundary=B \nMIME-Version: 1.0"),
                &["line 1", "trailing whitespace"],
            ),
            (
                doc("MIME-Version: 1.0\nContent-Transfer-Encoding: base64\nContent-Type: multipart/mixed; boundary=B"),
                &["line 2", "base64"],
            ),
            (
                "MIME-Version: 1.0\nContent-Type: multipart/mixed; boundary=B".into(),
                &["without an empty line"],
            ),
            (
                "Content-Type: multipart/mixed; boundary=a=b\nMIME-Version: 1.0\n\n--a=b--\n".into(),
                &["line 1", "neither a token nor a quoted string"],
            ),
            (
                doc("MIME-Version: 1.0"),
                &["no Content-Type"],
            ),
            (
                "Content-Type: multipart/mixed; boundary=B\nX: mime-version: 1.0\n\n--B--\n".into(),
                &["line 2", "\"X\""],
            ),
            (
                "Content-Type: multipart/mixed; boundary=B\nthis is not a header\nMIME-Version: 1.0\n\n".into(),
                &["line 2", "not a header line"],
            ),
        ],
    );
}

#[test]
fn multipart_structure_is_checked() {
    let part = config_part("a: 1");
    let ok = mime("B", "B", &[&part]);
    let mut seventeen: Vec<String> = Vec::new();
    for i in 0..17 {
        seventeen.push(config_part(&format!("k{i}: 1")));
    }
    let seventeen: Vec<&str> = seventeen.iter().map(String::as_str).collect();
    table(
        "mime-multipart",
        &[
            // No MIME-Version: cloud-init takes it as one text part, not as MIME.
            (
                "Content-Type: multipart/mixed; boundary=B\n\n--B\nContent-Type: text/cloud-config\n\na: 1\n--B--\n".into(),
                &["MIME-Version", "4096 bytes"],
            ),
            (ok.replace("--B\n", "--C\n").replace("--B--", "--C--"), &["no delimiter line `--B`"]),
            (
                "Content-Type: multipart/mixed; boundary=B\nMIME-Version: 1.0\n\n\n".into(),
                &["no delimiter line `--B`"],
            ),
            (ok.replace("--B--\n", ""), &["no close delimiter `--B--`"]),
            (mime("B", "B", &seventeen), &["17 parts", "at most 16"]),
        ],
    );
    // Empty lines around the parts are fine, as is a missing final newline.
    let roomy = ok.replace("1.0\n\n--B", "1.0\n\n\n\n--B") + "\n\n";
    assert!(read_vendor_data(&roomy).is_ok());
    assert!(read_vendor_data(ok.trim_end()).is_ok());
    let sixteen = mime("B", "B", &seventeen[..16]);
    assert_eq!(read_vendor_data(&sixteen).unwrap().parts.len(), 16);
}

#[test]
fn boundaries_are_checked() {
    let part = config_part("a: 1");
    let ok = mime("\"B\"", "B", &[&part]);
    table(
        "mime-boundary",
        &[
            (ok.replace("--B\n", "--B \n"), &["line 4", "\"--B \""]),
            (ok.replace("--B\n", "--B\t\n"), &["line 4"]),
            (ok.replace("--B--", "--B-- "), &["line 8"]),
            (ok.replace("a: 1", "a: 1\n--Bx"), &["line 8", "\"--Bx\""]),
            (
                ok.replace("; boundary=\"B\"", ""),
                &["line 1", "no boundary parameter"],
            ),
            (
                mime("\"a;b\"", "a;b", &[&part]),
                &["not an RFC 2046 boundary character"],
            ),
            (mime("\"a \"", "a ", &[&part]), &["ends in a space"]),
            (
                mime(
                    &format!("\"{}\"", "x".repeat(71)),
                    &"x".repeat(71),
                    &[&part],
                ),
                &["1 to 70"],
            ),
            (
                mime("\"<B>\"", "<B>", &[&part]),
                &["not an RFC 2046 boundary character"],
            ),
        ],
    );
}

#[test]
fn part_headers_are_checked() {
    table(
        "mime-part-header",
        &[
            (
                with_part(
                    "Content-Type: text/cloud-config\nContent-Type: text/x-shellscript\n\na: 1",
                ),
                &["part 2, line", "repeats"],
            ),
            (
                with_part("Content-Type: text/cloud-config; charset=\n utf-8\n\na: 1"),
                &["part 2", "folded"],
            ),
            (
                with_part("Content-Type: text/cloud-config\nMerge-Type: list(append)\n\na: 1"),
                &["part 2", "\"Merge-Type\"", "allow-list"],
            ),
            (
                with_part("Content-Type: text/cloud-config\nLaunch-Index: 1\n\na: 1"),
                &["part 2", "\"Launch-Index\""],
            ),
            (
                with_part("MIME-Version: 1.0\n\na: 1"),
                &["part 2", "no Content-Type"],
            ),
            (with_part("\na: 1"), &["part 2", "no Content-Type"]),
            (
                with_part(
                    "Content-Type: text/cloud-config\nContent-Transfer-Encoding: x-uuencode\n\nYTogMQ==",
                ),
                &["part 2", "\"x-uuencode\"", "allow-list"],
            ),
            (
                with_part("Content-Type: text/cloud-config; charset=latin-1\n\na: 1"),
                &["part 2", "\"latin-1\""],
            ),
            (
                with_part("Content-Type: text/cloud-config; name=x.sh\n\na: 1"),
                &["part 2", "\"name\"", "allow-list"],
            ),
            (
                with_part("Content-Type: text/cloud-config\nContent-Disposition: inline\n\na: 1"),
                &["part 2", "attachment; filename="],
            ),
            (
                with_part(
                    "Content-Type: text/cloud-config\nContent-Disposition: attachment; filename=x.cfg\n\na: 1",
                ),
                &["part 2", "attachment; filename="],
            ),
            (
                with_part("Content-Type: text/cloud-config\nMIME-Version: 1.1\n\na: 1"),
                &["part 2", "MIME-Version"],
            ),
            (
                with_part("Content-Type: text/cloud-config\nnot a header: 1"),
                &["part 2", "not a header line"],
            ),
            // A second delimiter right after the first: Python skips it, we refuse.
            (
                mime("B", "B", &[&format!("--B\n{}", config_part("a: 1"))]),
                &["part 1", "ends without an empty line"],
            ),
        ],
    );
}

#[test]
fn part_types_outside_the_allow_list_are_refused() {
    let refused_types = [
        "text/x-include-url",
        "text/x-include-once-url",
        "text/part-handler",
        "text/cloud-boothook",
        "text/cloud-config-archive",
        "text/cloud-config-jsonp",
        "text/jinja2",
        "text/upstart-job",
        "text/plain",
        "text/x-not-multipart",
        "application/gzip",
        "application/x-gzip",
        "application/octet-stream",
        "Text/Cloud-Config-Archive",
    ];
    let cases: Vec<(String, &[&str])> = refused_types
        .iter()
        .map(|t| {
            (
                with_part(&format!("Content-Type: {t}\n\n#cloud-config\na: 1")),
                &[
                    "part 2, line",
                    "not in the allow-list",
                    "text/x-shellscript, text/cloud-config",
                ][..],
            )
        })
        .collect();
    table("mime-part-type", &cases);
    table(
        "mime-part-type",
        &[
            (
                with_part(
                    "Content-Type: multipart/mixed; boundary=C\n\n--C\nContent-Type: text/cloud-config\n\na: 1\n--C--",
                ),
                &["part 2", "no nested multipart"],
            ),
            (
                with_part(&script_part("b.sh", "echo no shebang")),
                &["part 2 (filename \"b.sh\")", "`#!`"],
            ),
            (
                with_part(&script_part("b.sh", "#include http://example.org/x")),
                &["part 2 (filename \"b.sh\")", "`#!`"],
            ),
            (
                with_part(&script_part("b.sh", " #!/bin/sh")),
                &["part 2 (filename \"b.sh\")"],
            ),
        ],
    );
}

#[test]
fn filenames_are_checked() {
    let named = |f: &str| with_part(&script_part(f, SCRIPT));
    table(
        "mime-filename",
        &[
            (named("a.sh"), &["part 2 (filename \"a.sh\")", "part 1"]),
            (named("A.SH"), &["part 2 (filename \"A.SH\")", "part 1"]),
            (named("../x"), &["part 2", "\"../x\""]),
            (named("x/y"), &["part 2", "\"x/y\""]),
            (named(".hidden"), &["part 2", "`.`"]),
            (named(".."), &["part 2"]),
            (named("part-001"), &["part 2", "`part-`"]),
            (named(""), &["part 2"]),
            (named(&"x".repeat(65)), &["part 2", "1 to 64"]),
            (named("a b"), &["part 2"]),
            (
                with_part("Content-Type: text/x-shellscript\n\n#!/bin/sh\ntrue"),
                &["part 2", "needs `Content-Disposition"],
            ),
        ],
    );
}

#[test]
fn mime_payloads_must_be_ascii() {
    table(
        "mime-part-ascii",
        &[
            (
                with_part(
                    "Content-Type: text/cloud-config; charset=utf-8\nContent-Transfer-Encoding: 8bit\n\na: \"caf\u{e9}\"",
                ),
                &["part 2", "line", "U+00E9"],
            ),
            (
                with_part(&script_part("b.sh", "#!/bin/sh\necho \u{20ac}")),
                &["part 2 (filename \"b.sh\")", "U+20AC"],
            ),
        ],
    );
}

#[test]
fn yaml_rules() {
    let in_part = |yaml: &str| {
        with_part(&format!(
            "Content-Type: text/cloud-config\nContent-Disposition: attachment; filename=\"c.cfg\"\n\n{yaml}"
        ))
    };
    // The part's payload starts on line 17 of `in_part`'s document.
    let part = "part 2 (filename \"c.cfg\")";
    let plain = "the #cloud-config document";
    table(
        "cloud-config-yaml",
        &[
            (
                "#cloud-config\npackages: [a\n".into(),
                &[plain, "does not parse"],
            ),
            ("#cloud-config\n- a\n- b\n".into(), &[plain, "a list"]),
            (
                "#cloud-config\nplain words\n".into(),
                &[plain, "the string"],
            ),
            (in_part("a: 1\na: 2"), &[part, "line 18", "duplicate"]),
            (
                in_part("a:\n  b: 1\n  b: 2"),
                &[part, "line 19", "duplicate"],
            ),
            (in_part("a:\n- {x: 1, x: 2}"), &[part, "duplicate"]),
            (in_part("a: &x 1\nb: *x"), &[part, "line 17", "anchor"]),
            (in_part("a: 1\nb: &x [1]"), &[part, "line 18", "anchor"]),
            (in_part("a: 1\nb:\n  c: *x"), &[part, "line 19"]),
        ],
    );
    table(
        "cloud-config-tag",
        &[
            (
                in_part("a: !!python/object/apply:os.system [id]"),
                &[part, "tag", "line 17"],
            ),
            (in_part("a: !!str 5"), &[part, "tag"]),
            (in_part("a: !!binary aGk="), &[part, "tag"]),
            (in_part("a: !!set {x, y}"), &[part, "tag"]),
            (in_part("a: !local x"), &[part, "tag"]),
            (in_part("a: !<tag:yaml.org,2002:str> x"), &[part, "tag"]),
            (
                in_part("a:\n  b: 1\n  c: !!map\n    d: 2"),
                &[part, "tag", "line 19"],
            ),
            (in_part("a: [x, !!int 1]"), &[part, "tag"]),
            (
                "#cloud-config\n!!str a: 1\n".into(),
                &[plain, "tag", "line 2"],
            ),
            ("#cloud-config\n--- !!map\na: 1\n".into(), &[plain, "tag"]),
        ],
    );
    table(
        "cloud-config-merge-key",
        &[
            (
                in_part("base: 1\nother:\n  <<: {x: 1}\n  y: 2"),
                &[part, "line 19", "`<<`"],
            ),
            ("#cloud-config\na: <<\n".into(), &[plain, "line 2", "`<<`"]),
            (
                "#cloud-config\nmerge_how: 'dict(recurse_array)+list(append)'\n".into(),
                &[plain, "\"merge_how\"", "merges"],
            ),
            (
                in_part("merge_type: list(append)"),
                &[part, "\"merge_type\""],
            ),
        ],
    );
    table(
        "cloud-config-key",
        &[
            (
                "#cloud-config\non: 1\n".into(),
                &[plain, "\"on\"", "boolean"],
            ),
            ("#cloud-config\nYes: 1\n".into(), &[plain, "\"Yes\""]),
            ("#cloud-config\ny: 1\n".into(), &[plain, "\"y\""]),
            ("#cloud-config\nn: 1\n".into(), &[plain, "\"n\""]),
            (
                "#cloud-config\nnull: 1\n".into(),
                &[plain, "line 2", "null"],
            ),
            (
                "#cloud-config\n'null': 1\n".into(),
                &[plain, "\"null\"", "YAML 1.1"],
            ),
            (
                "#cloud-config\n'<<': 1\n".into(),
                &[plain, "\"<<\"", "identifier"],
            ),
            (
                "#cloud-config\ntrue: 1\n".into(),
                &[plain, "keys must be strings"],
            ),
            (
                "#cloud-config\n1: 1\n".into(),
                &[plain, "keys must be strings"],
            ),
            (
                "#cloud-config\nPackages: [a]\n".into(),
                &[plain, "\"Packages\"", "identifier"],
            ),
            (
                "#cloud-config\nlaunch-index: 1\n".into(),
                &[plain, "\"launch-index\""],
            ),
            (
                "#cloud-config\n? [a, b]\n: 1\n".into(),
                &[plain, "line 2", "a list"],
            ),
            (
                in_part("a:\n  yes: 1\n  true: 2"),
                &[part, "line 18", "\"yes\""],
            ),
            (in_part("a:\n  1: x"), &[part, "line 18", "the integer 1"]),
            (in_part("a:\n  010: x"), &[part, "\"010\"", "the integer 8"]),
            (in_part("a:\n  1_000: x"), &[part, "\"1_000\""]),
            (in_part("a:\n  1:30: x"), &[part, "\"1:30\""]),
            (in_part("a:\n  .inf: x"), &[part, "\".inf\""]),
            (in_part("a:\n  2001-12-14: x"), &[part, "\"2001-12-14\""]),
            (in_part("a:\n  ~: x"), &[part, "null"]),
            (in_part("a:\n  0o7: x"), &[part, "\"0o7\"", "YAML 1.2"]),
            (
                in_part("a:\n- b:\n    OFF: 1"),
                &[part, "line 19", "\"OFF\""],
            ),
        ],
    );
    // Quoted keys are strings to every reader.
    let quoted = read_vendor_data(&in_part("a:\n  '010': x\n  \"yes\": y\n  '=': z")).unwrap();
    assert_eq!(quoted.parts[1].cloud_config_keys, ["a"]);
}

/// A cloud-config value as the reader reports it, for the value tables.
fn scalar_of(yaml_value: &str) -> Result<Scalar, (&'static str, String)> {
    let text = format!("#cloud-config\nv: {yaml_value}\n");
    match read_vendor_data(&text) {
        Ok(reading) => match &reading.cloud_config[..] {
            [(key, CloudConfigValue::Scalar(s))] if key == "v" => Ok(s.clone()),
            other => panic!("{other:?}"),
        },
        Err(TemplateErrorKind::InvalidOutput { rule, detail }) => Err((rule, detail)),
        Err(other) => panic!("{other}"),
    }
}

#[test]
fn values_are_cloud_inits_yaml_1_1_reading_or_refused() {
    // Read alike by YAML 1.1 and 1.2: reported as PyYAML types them.
    let same = [
        ("true", Scalar::Bool(true)),
        ("False", Scalar::Bool(false)),
        ("420", Scalar::Int(420)),
        ("-7", Scalar::Int(-7)),
        ("0", Scalar::Int(0)),
        ("0x1F", Scalar::Int(31)),
        ("1.5", Scalar::Float(1.5)),
        ("1.0e+3", Scalar::Float(1000.0)),
        ("-.inf", Scalar::Float(f64::NEG_INFINITY)),
        ("~", Scalar::Null),
        ("", Scalar::Null),
        ("null", Scalar::Null),
        ("'0644'", Scalar::Str("0644".into())),
        ("\"yes\"", Scalar::Str("yes".into())),
        ("'='", Scalar::Str("=".into())),
        ("192.0.2.1", Scalar::Str("192.0.2.1".into())),
        ("a b\n  c", Scalar::Str("a b c".into())),
        ("http://x:80/a#b", Scalar::Str("http://x:80/a#b".into())),
    ];
    for (text, want) in same {
        let got = scalar_of(text).unwrap_or_else(|e| panic!("{text:?}: {e:?}"));
        assert!(got.same_as(&want), "{text:?}: {got:?}, want {want:?}");
    }
    // Read differently: refused, naming the line and the two readings.
    let differ = [
        ("yes", "the boolean true"),
        ("off", "the boolean false"),
        ("0644", "the integer 420"),
        ("0o644", "the string \"0o644\""),
        ("1:30", "the integer 90"),
        ("1e3", "the string \"1e3\""),
        ("1_000_000", "the integer 1000000"),
        ("0x_FF", "the integer 255"),
        ("0b1010", ""),
        ("+1", ""),
        (".NaN", ""),
        ("2027-01-01", "date"),
        ("2027-01-01 10:00:00", "date"),
        ("9223372036854775808", "64-bit"),
    ];
    for (text, says) in differ {
        match scalar_of(text) {
            // `+1` and `.NaN` may read alike to serde_yaml_ng; then they are accepted.
            Ok(s) if says.is_empty() => assert!(!matches!(s, Scalar::Str(_)), "{text}"),
            Ok(s) => panic!("{text:?} accepted as {s:?}"),
            Err((rule, detail)) => {
                assert_eq!(rule, "cloud-config-value", "{text}: {detail}");
                assert!(detail.contains("line 2"), "{detail}");
                assert!(detail.contains(says), "{text}: {detail}");
                assert!(detail.contains("quote it"), "{detail}");
            }
        }
    }
    // The merged configuration: a later part's top-level key replaces an earlier one's.
    let doc = mime(
        "B",
        "B",
        &[
            &config_part("a: 1\nb: [x]"),
            &config_part("c: true\na: {z: 2}"),
        ],
    );
    let reading = read_vendor_data(&doc).unwrap();
    let map = |entries: Vec<(&str, CloudConfigValue)>| {
        entries
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        reading.cloud_config,
        map(vec![
            (
                "a",
                CloudConfigValue::Map(map(vec![("z", CloudConfigValue::Scalar(Scalar::Int(2)))]))
            ),
            (
                "b",
                CloudConfigValue::List(vec![CloudConfigValue::Scalar(Scalar::Str("x".into()))])
            ),
            ("c", CloudConfigValue::Scalar(Scalar::Bool(true))),
        ])
    );
}

#[test]
fn documents_pyyaml_cannot_load_are_refused() {
    const PLAIN: &str = "the #cloud-config document";
    // Either our PyYAML rules refuse them, or the YAML parser already does; both name
    // the line.
    let cases: Vec<(&str, &[&str])> = vec![
        ("#cloud-config\na: =\n", &[PLAIN, "line 2", "`=`"]),
        ("#cloud-config\na: [x, =]\n", &[PLAIN, "line 2", "`=`"]),
        ("#cloud-config\na: b\tc\n", &[PLAIN, "line 2", "tab"]),
        ("#cloud-config\na:\tb\n", &[PLAIN, "line 2"]),
        ("#cloud-config\na: b\t\n", &[PLAIN, "line 2", "tab"]),
        ("#cloud-config\na:\n\t- b\n", &[PLAIN, "line 3"]),
        ("#cloud-config\na: [b,\tc]\n", &[PLAIN, "line 2"]),
        ("#cloud-config\n\t# comment\na: 1\n", &[PLAIN, "line 2"]),
        (
            "#cloud-config\n%YAML 1.1\n---\na: 1\n",
            &[PLAIN, "line 2", "directive"],
        ),
        (
            "#cloud-config\na: 1\n---\nb: 2\n",
            &[PLAIN, "line 3", "second YAML document"],
        ),
        (
            "#cloud-config\na: 0b_\n",
            &[PLAIN, "line 2", "without digits"],
        ),
        ("#cloud-config\na: 0x_\n", &[PLAIN, "line 2"]),
        ("#cloud-config\na: @x\n", &[PLAIN, "line 2"]),
        ("#cloud-config\na: `x\n", &[PLAIN, "line 2"]),
        ("#cloud-config\na: [?x]\n", &[PLAIN, "line 2"]),
        (
            "#cloud-config\na: {b: x?y}\n",
            &[PLAIN, "line 2", "flow collection"],
        ),
        ("#cloud-config\n...\na: 1\n", &[PLAIN, "line 2", "`...`"]),
        (
            // saphyr refuses this one itself, naming the scalar's first line.
            "#cloud-config\na: \"x\n---\n y\"\n",
            &[PLAIN, "line 2"],
        ),
        ("#cloud-config\na:\n- |\t\n", &[PLAIN, "line 3", "tab"]),
        ("#cloud-config\na: 'x'\t\n", &[PLAIN, "line 2", "tab"]),
        ("#cloud-config\na: ''\t\r\n", &[PLAIN, "line 2", "tab"]),
    ];
    let long_key = format!("#cloud-config\n{}: 1\n", "k".repeat(1100));
    let mut cases: Vec<(String, &[&str])> =
        cases.into_iter().map(|(t, n)| (t.to_string(), n)).collect();
    cases.push((long_key, &[PLAIN, "line 2"]));
    for (text, needles) in cases {
        let (rule, detail) = refused(&text);
        assert!(
            rule == "cloud-config-pyyaml" || rule == "cloud-config-yaml",
            "{rule}: {detail}\n{text}"
        );
        for needle in needles {
            assert!(
                detail.contains(needle),
                "{detail:?} lacks {needle:?}\n{text}"
            );
        }
    }
    // `?` in block context and URLs in flow context are fine.
    let reading = read_vendor_data("#cloud-config\na: http://x/?y\nb: [http://x:80/y]\n").unwrap();
    assert_eq!(reading.parts[0].cloud_config_keys, ["a", "b"]);
    // Tabs inside quoted and block scalars and comments are fine to PyYAML.
    let ok = "#cloud-config\t \na: \"x\ty\"\nb: 'x\ty'\nc: |\n  x\ty\n# a\tcomment\nd: e # f\tg\n";
    let reading = read_vendor_data(ok).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reading.parts[0].cloud_config_keys, ["a", "b", "c", "d"]);
}

#[test]
fn the_standard_tools_forms_are_accepted() {
    let yaml = "#cloud-config\npackages: [curl]\n";
    let script = "#!/bin/sh\necho hi\n";
    let b64 = |s: &str| {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD.encode(s)
    };
    // `cloud-init devel make-mime`: every part base64, with charset utf-8.
    let make_mime = format!(
        "Content-Type: multipart/mixed; boundary=\"===============9083877531393719921==\"\n\
         MIME-Version: 1.0\n\n--===============9083877531393719921==\n\
         Content-Type: text/cloud-config; charset=\"utf-8\"\nMIME-Version: 1.0\n\
         Content-Transfer-Encoding: base64\nContent-Disposition: attachment; filename=\"c.yaml\"\n\n\
         {}\n\n--===============9083877531393719921==\n\
         Content-Type: text/x-shellscript; charset=\"utf-8\"\nMIME-Version: 1.0\n\
         Content-Transfer-Encoding: base64\nContent-Disposition: attachment; filename=\"s.sh\"\n\n\
         {}\n\n--===============9083877531393719921==--\n",
        b64(yaml),
        b64(script)
    );
    let reading = read_vendor_data(&make_mime).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reading.parts[0].payload, yaml);
    assert_eq!(reading.parts[0].cloud_config_keys, ["packages"]);
    assert_eq!(reading.parts[1].payload, script);
    // UTF-8 is fine once base64-encoded: cloud-init decodes the bytes as UTF-8.
    let utf8 = "#cloud-config\nbootcmd: [\"echo caf\u{e9}\"]\n";
    let doc = mime(
        "B",
        "B",
        &[&format!(
            "Content-Type: text/cloud-config\nContent-Transfer-Encoding: BASE64\n\n{}",
            b64(utf8)
        )],
    );
    assert_eq!(read_vendor_data(&doc).unwrap().parts[0].payload, utf8);
    // Quoted-printable, with a soft line break and an encoded `=`.
    let qp = mime(
        "B",
        "B",
        &[
            "Content-Type: text/cloud-config\nContent-Transfer-Encoding: quoted-printable\n\n\
             #cloud-config\nruncmd: [\"echo a=3Db caf=C3=A9 lo=\nng\"]",
        ],
    );
    assert_eq!(
        read_vendor_data(&qp).unwrap().parts[0].payload,
        "#cloud-config\nruncmd: [\"echo a=b caf\u{e9} long\"]"
    );
    // A preamble, an epilogue, `Multipart/Mixed`, `Text/Cloud-Config`, folded headers.
    let other = "This is a multi-part message in MIME format.\n\n--B\n\
         Content-Type: Text/Cloud-Config;\n charset=\"UTF-8\"\nContent-Disposition: Attachment;\n\tfilename=\"c.cfg\"\n\n\
         a: 1\n--B--\nepilogue text\n--B\n";
    let doc =
        format!("Content-Type: Multipart/Mixed;\n boundary=\"B\"\nMIME-Version: 1.0\n\n{other}");
    let reading = read_vendor_data(&doc).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reading.parts.len(), 1);
    assert_eq!(reading.parts[0].filename.as_deref(), Some("c.cfg"));
    assert_eq!(reading.parts[0].payload, "a: 1");
    // The plain form with CRLF line ends and `#cloud-config` followed by blanks.
    let crlf = "#cloud-config \t\r\npackages:\r\n- curl\r\n";
    let reading = read_vendor_data(crlf).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reading.parts[0].payload, crlf);
    assert_eq!(reading.parts[0].cloud_config_keys, ["packages"]);
}

#[test]
fn encoded_parts_are_checked() {
    let part = |cte: &str, body: &str| {
        mime(
            "B",
            "B",
            &[&format!(
                "Content-Type: text/cloud-config\nContent-Transfer-Encoding: {cte}\n\n{body}"
            )],
        )
    };
    table(
        "mime-part-encoding",
        &[
            (part("base64", "YTogMQ"), &["part 1, line 8", "decode"]),
            (part("base64", "YTog MQ=="), &["part 1, line 8", "base64"]),
            (part("base64", "YQ==YQ=="), &["part 1", "decode"]),
            (part("base64", "/w=="), &["part 1", "not UTF-8"]),
            (
                part("quoted-printable", "a: =3d"),
                &["part 1, line 8", "`=`"],
            ),
            (
                part("quoted-printable", "a: 1 "),
                &["part 1, line 8", "trailing"],
            ),
            (
                part("quoted-printable", "a: 1="),
                &["part 1, line 8", "`=`"],
            ),
            (
                part("quoted-printable", "a: caf\u{e9}"),
                &["part 1, line 8", "must encode"],
            ),
        ],
    );
    table(
        "control-character",
        &[(
            part("base64", "YToNMQ=="),
            &["part 1", "decoded payload", "U+000D"],
        )],
    );
    // Lines of the decoded YAML are named as such.
    let (rule, detail) = refused(&part("base64", "YTogeWVz"));
    assert_eq!(rule, "cloud-config-value");
    assert!(detail.contains("line 1 of the decoded payload"), "{detail}");
}

#[test]
fn a_large_document_reads_in_linear_time() {
    // 20000 keys with quoted values: the tab scan, the duplicate check and the merge must
    // not be quadratic (a debug build reads this in well under a second).
    let mut text = String::from("#cloud-config\n");
    for i in 0..20_000 {
        text.push_str(&format!("k{i}: 'v {i}' # c\n"));
    }
    assert!(text.len() < VENDOR_DATA_MAX);
    let started = std::time::Instant::now();
    let reading = read_vendor_data(&text).unwrap();
    assert_eq!(reading.cloud_config.len(), 20_000);
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
}

#[test]
fn size_cap_is_kept() {
    let big = format!("#cloud-config\n#{}\n", "x".repeat(VENDOR_DATA_MAX));
    assert!(matches!(
        read_vendor_data(&big),
        Err(TemplateErrorKind::OutputTooLarge { .. })
    ));
}

fn part(
    kind: VendorPartType,
    filename: Option<&str>,
    payload: &str,
    keys: &[&str],
) -> VendorDataPart {
    VendorDataPart {
        content_type: kind,
        filename: filename.map(str::to_string),
        payload: payload.to_string(),
        cloud_config_keys: keys.iter().map(|k| k.to_string()).collect(),
        cloud_config: None,
    }
}

#[test]
fn the_default_plugins_output_is_read_as_cloud_init_reads_it() {
    let reading = read_vendor_data(DEFAULT_PLUGIN).unwrap();
    assert_eq!(reading.form, VendorDataForm::Multipart);
    assert_eq!(reading.parts.len(), 1);
    let script = &reading.parts[0];
    assert_eq!(script.content_type, VendorPartType::ShellScript);
    assert_eq!(script.filename.as_deref(), Some("egress-proxy-setup.sh"));
    assert!(
        script
            .payload
            .starts_with("#!/bin/sh\n# egress-proxy-setup")
    );
    // The newline before the close delimiter belongs to the delimiter (RFC 2046).
    assert!(
        script
            .payload
            .ends_with("log \"done: tinyproxy is listening on port 3128\"\n")
    );
    assert!(check_vendor_data(DEFAULT_PLUGIN).is_ok());
}

#[test]
fn accepted_corpus() {
    let cc = VendorPartType::CloudConfig;
    let sh = VendorPartType::ShellScript;
    let ntp = "#cloud-config\nntp:\n  enabled: true\n  servers:\n  - ntp.example.org\n";
    let cases: Vec<(String, VendorDataForm, Vec<VendorDataPart>)> = vec![
        (
            "#cloud-config\n".into(),
            VendorDataForm::CloudConfig,
            vec![part(cc, None, "#cloud-config\n", &[])],
        ),
        (
            "#cloud-config\npackages: [a]\n".into(),
            VendorDataForm::CloudConfig,
            vec![part(cc, None, "#cloud-config\npackages: [a]\n", &["packages"])],
        ),
        (
            // UTF-8 is fine in the plain form: cloud-init passes it through as is.
            "#cloud-config\nbootcmd: [\"echo caf\u{e9} \u{20ac}!\"]\nwrite_files:\n- path: /x\n  content: |\n    #!/bin/sh\n    echo hi!\n".into(),
            VendorDataForm::CloudConfig,
            vec![part(
                cc,
                None,
                "#cloud-config\nbootcmd: [\"echo caf\u{e9} \u{20ac}!\"]\nwrite_files:\n- path: /x\n  content: |\n    #!/bin/sh\n    echo hi!\n",
                &["bootcmd", "write_files"],
            )],
        ),
        (
            // The existing minimal document: unquoted boundary, unnamed cloud-config part.
            "Content-Type: multipart/mixed; boundary=\"XYZ\"\nMIME-Version: 1.0\n\n--XYZ\nContent-Type: text/cloud-config\n\npackages: []\n--XYZ--\n".into(),
            VendorDataForm::Multipart,
            vec![part(cc, None, "packages: []", &["packages"])],
        ),
        (
            mime("B-1.x_y", "B-1.x_y", &[&script_part("s.sh", "#!/bin/sh\ntrue\n")]),
            VendorDataForm::Multipart,
            vec![part(sh, Some("s.sh"), "#!/bin/sh\ntrue\n", &[])],
        ),
        (
            mime(
                "\"==a (b) c:d/e?f=g, 'h'\"",
                "==a (b) c:d/e?f=g, 'h'",
                &[
                    &script_part("setup.sh", SCRIPT),
                    &format!(
                        "Content-Type: text/cloud-config; charset=\"utf-8\"\nMIME-Version: 1.0\n\
                         Content-Transfer-Encoding: 8bit\nContent-Disposition: attachment; filename=\"opt.cfg\"\n\n{ntp}"
                    ),
                ],
            ),
            VendorDataForm::Multipart,
            vec![
                part(sh, Some("setup.sh"), SCRIPT, &[]),
                part(cc, Some("opt.cfg"), ntp, &["ntp"]),
            ],
        ),
        (
            // Header names in any case, tabs after the colon, charset=utf-8 unquoted.
            "content-type:\tmultipart/mixed; boundary=b\nmime-version: 1.0\n\n--b\nCONTENT-TYPE: text/cloud-config; CHARSET=utf-8\n\nruncmd:\n- [sh, -c, 'echo \"a!b\"']\n\n--b--".into(),
            VendorDataForm::Multipart,
            vec![part(
                cc,
                None,
                "runcmd:\n- [sh, -c, 'echo \"a!b\"']\n",
                &["runcmd"],
            )],
        ),
        (
            mime("B", "B", &[&config_part("")]),
            VendorDataForm::Multipart,
            vec![part(cc, None, "", &[])],
        ),
    ];
    for (text, form, parts) in cases {
        let reading = read_vendor_data(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert_eq!(reading.form, form, "{text}");
        // The values are checked by the value tests; here the parts as cloud-init splits them.
        let without_values: Vec<VendorDataPart> = reading
            .parts
            .into_iter()
            .map(|p| VendorDataPart {
                cloud_config: None,
                ..p
            })
            .collect();
        assert_eq!(without_values, parts, "{text}");
    }
}

#[test]
fn tag_detection_has_no_false_positives() {
    // `!` inside scalars, quotes, comments and block scalars is no tag.
    let yaml = "#cloud-config\n# a comment!\na: hello!world\nb: 'single !x'\nc: \"double !!y\"\n\
                d: |\n  !not a tag\n  #!/bin/sh\ne: [a!b, c!]\nf: {k: v!}\ng: 'x&y*z'\nh: x&y*z\n";
    let reading = read_vendor_data(yaml).unwrap();
    assert_eq!(
        reading.parts[0].cloud_config_keys,
        ["a", "b", "c", "d", "e", "f", "g", "h"]
    );
    // A document that has the stand-in character itself is still read right.
    assert!(read_vendor_data("#cloud-config\na: \"\u{e000}!\"\n").is_ok());
}
