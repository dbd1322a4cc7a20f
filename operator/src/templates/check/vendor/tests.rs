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

/// The cloud-config YAML rules: values, keys, tags and what PyYAML cannot load.
mod yaml;
