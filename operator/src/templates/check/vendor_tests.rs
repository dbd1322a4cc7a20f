//! The vendor-data reader: one refusal table per rule (rule and where), and an accepted
//! corpus with what was understood.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use super::*;
use crate::templates::check::check_vendor_data;

/// The default plugin's output for the sample Proxy.
const DEFAULT_PLUGIN: &str = include_str!("../../../../tests/snapshots/vendor-data-default.mime");

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
            ("#cloud-config \na: 1\n".into(), &["line 1"]),
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
                doc("Content-Type: multipart/mixed;\n boundary=B\nMIME-Version: 1.0"),
                &["line 2", "folded"],
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
            (ok.replace("--B\n", "--C\n").replace("--B--", "--C--"), &["line 4", "\"--C\"", "preamble"]),
            (
                "Content-Type: multipart/mixed; boundary=B\nMIME-Version: 1.0\n\n\n".into(),
                &["no delimiter line `--B`"],
            ),
            (ok.replace("--B--\n", ""), &["no close delimiter `--B--`"]),
            (format!("{ok}trailing text\n"), &["line 9", "epilogue"]),
            (ok.replace("1.0\n\n--B", "1.0\n\npreamble\n--B"), &["line 4", "preamble"]),
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
                with_part("Content-Type: text/cloud-config;\n charset=utf-8\n\na: 1"),
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
                    "Content-Type: text/cloud-config\nContent-Transfer-Encoding: base64\n\nYTogMQ==",
                ),
                &["part 2", "base64", "allow-list"],
            ),
            (
                with_part(
                    "Content-Type: text/cloud-config\nContent-Transfer-Encoding: quoted-printable\n\na: 1",
                ),
                &["part 2", "quoted-printable"],
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
        "Text/Cloud-Config",
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
            ("#cloud-config\nplain words\n".into(), &[plain, "a string"]),
            (in_part("a: 1\na: 2"), &[part, "duplicate"]),
            (in_part("a:\n  b: 1\n  b: 2"), &[part, "duplicate"]),
            (in_part("a:\n- {x: 1, x: 2}"), &[part, "duplicate"]),
            (in_part("a: 1\n---\nb: 2"), &[part, "does not parse"]),
        ],
    );
    table(
        "cloud-config-tag",
        &[
            (
                in_part("a: !!python/object/apply:os.system [id]"),
                &[part, "tag", "line 1"],
            ),
            (in_part("a: !!str 5"), &[part, "tag"]),
            (in_part("a: !!binary aGk="), &[part, "tag"]),
            (in_part("a: !!set {x, y}"), &[part, "tag"]),
            (in_part("a: !local x"), &[part, "a has a YAML tag"]),
            (in_part("a: !<tag:yaml.org,2002:str> x"), &[part, "tag"]),
            (
                in_part("a:\n  b: 1\n  c: !!map\n    d: 2"),
                &[part, "tag", "line 3"],
            ),
            (in_part("a: [x, !!int 1]"), &[part, "tag"]),
            (
                "#cloud-config\n!!str a: 1\n".into(),
                &[plain, "tag", "line 2"],
            ),
            ("#cloud-config\n--- !!map\na: 1\n".into(), &[plain, "tag"]),
            (
                "#cloud-config\n%TAG !e! tag:example.com,2000:\n---\na: !e!x 1\n".into(),
                &[plain],
            ),
        ],
    );
    table(
        "cloud-config-merge-key",
        &[
            (
                in_part("base: &b {x: 1}\nother:\n  <<: *b\n  y: 2"),
                &[part, "other", "`<<`"],
            ),
            (
                "#cloud-config\n'<<': 1\n".into(),
                &[plain, "the top level", "`<<`"],
            ),
        ],
    );
    table(
        "cloud-config-key",
        &[
            ("#cloud-config\non: 1\n".into(), &[plain, "\"on\""]),
            ("#cloud-config\nYes: 1\n".into(), &[plain, "\"Yes\""]),
            ("#cloud-config\ny: 1\n".into(), &[plain, "\"y\""]),
            ("#cloud-config\nn: 1\n".into(), &[plain, "\"n\""]),
            (
                "#cloud-config\nnull: 1\n".into(),
                &[plain, "a key that is null"],
            ),
            (
                "#cloud-config\n'null': 1\n".into(),
                &[plain, "\"null\"", "YAML 1.1"],
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
            ("#cloud-config\n? [a, b]\n: 1\n".into(), &[plain, "a list"]),
            (
                in_part("a:\n  yes: 1\n  true: 2"),
                &[part, "a has the key \"yes\""],
            ),
            (
                in_part("a:\n  1: x"),
                &[part, "a has a key that is a number"],
            ),
            (in_part("a:\n  '010': x"), &[part, "\"010\""]),
            (in_part("a:\n  1_000: x"), &[part, "\"1_000\""]),
            (in_part("a:\n  1:30: x"), &[part, "\"1:30\""]),
            (in_part("a:\n  '.inf': x"), &[part, "\".inf\""]),
            (in_part("a:\n  2001-12-14: x"), &[part, "\"2001-12-14\""]),
            (in_part("a:\n  '~': x"), &[part, "\"~\""]),
            (in_part("a:\n  '=': x"), &[part, "\"=\""]),
            (
                in_part("a:\n- b:\n    OFF: 1"),
                &[part, "a[0].b", "\"OFF\""],
            ),
        ],
    );
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
        assert_eq!(reading, VendorDataReading { form, parts }, "{text}");
    }
}

#[test]
fn tag_detection_has_no_false_positives() {
    // `!` inside scalars, quotes, comments and block scalars is no tag.
    let yaml = "#cloud-config\n# a comment!\na: hello!world\nb: 'single !x'\nc: \"double !!y\"\n\
                d: |\n  !not a tag\n  #!/bin/sh\ne: [a!b, c!]\nf: {k: v!}\ng: &anc 1\nh: *anc\n";
    let reading = read_vendor_data(yaml).unwrap();
    assert_eq!(
        reading.parts[0].cloud_config_keys,
        ["a", "b", "c", "d", "e", "f", "g", "h"]
    );
    // A document that has the stand-in character itself is still read right.
    assert!(read_vendor_data("#cloud-config\na: \"\u{e000}!\"\n").is_ok());
}
