//! The vendor-data reader against the consumer's own code: cloud-init 22.4's Python
//! library (Debian 12's `cloud-init` package), run the way the guest runs it
//! (`user_data.convert_string`, `UserDataProcessor.process`, `util.fully_decoded_payload`,
//! the cloud-config handler's `safeyaml` load and default merge; see
//! `vendor_parity/cloud_init_reader.py`). Every document the operator accepts must be read
//! the same by both: the same parts, types, file names and payloads byte for byte, and the
//! same cloud-config values with the same YAML 1.1 types, part by part and merged. It runs
//! on hand-written documents, the default plugin's renders, `cloud-init devel make-mime`
//! output and a generated corpus (`vendor_parity/corpus.rs`); for refused documents it
//! shows that cloud-init reads them differently from what they seem to say, or drops them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

#[path = "vendor_parity/corpus.rs"]
mod corpus;

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};

use egress_operator::api::proxy;
use egress_operator::config::{self, TemplateConfig};
use egress_operator::render::{self, Facts};
use egress_operator::templates::check::{
    CloudConfigScalar, CloudConfigValue, VendorDataForm, VendorDataReading, check_vendor_data,
    read_vendor_data,
};
use egress_operator::templates::{TemplateEngine, TemplateErrorKind};
use integration_tests::harness::cannot_run;
use integration_tests::{plugin_path, workspace_root};
use serde_json::{Value, json};

/// cloud-init's reading, by cloud-init's own library.
const READER: &str = include_str!("vendor_parity/cloud_init_reader.py");
/// cloud-init's `devel make-mime`, by its own code.
const MAKE_MIME: &str = include_str!("vendor_parity/make_mime.py");

/// Debian's own interpreter, the one cloud-init runs on a Debian 12 guest, with Debian's
/// cloud-init and python3-yaml, rather than whatever `python3` comes first on PATH.
const PYTHON: &str = "/usr/bin/python3";

/// Whether cloud-init's Python library runs here; a missing one fails as root and under
/// CI (see `cannot_run`), where `make setup` must have installed it.
fn cloud_init() -> bool {
    let ok = Command::new(PYTHON)
        .args([
            "-c",
            "import cloudinit.user_data, cloudinit.handlers.cloud_config, yaml",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    ok || !cannot_run(
        "cloud-init's Python library is missing (scripts/setup.sh installs Debian's cloud-init \
         and python3-yaml)",
    )
}

/// Runs a Python script on `input` (JSON on stdin) and returns its JSON output.
fn run_python(script: &str, input: &Value) -> Value {
    let mut child = Command::new(PYTHON)
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 starts");
    let bytes = serde_json::to_vec(input).unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(&bytes));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    assert!(
        out.status.success(),
        "python3 failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// cloud-init's readings of `docs`, in order.
fn cloud_init_readings(docs: &[String]) -> Vec<Value> {
    let mut readings = run_python(READER, &json!(docs));
    exact_floats(&mut readings);
    let readings = readings.as_array().unwrap().clone();
    assert_eq!(readings.len(), docs.len());
    readings
}

/// Python writes finite floats as their `repr`, which Rust's parser reads exactly (serde_json's
/// own float parsing may be off by an ulp): each becomes the JSON number of that `f64`,
/// as [`typed`] writes ours.
fn exact_floats(value: &mut Value) {
    match value {
        Value::Object(map) => {
            if map.get("t").is_some_and(|t| t == "float")
                && let Some(Value::String(text)) = map.get("v")
                && let Ok(f) = text.parse::<f64>()
                && f.is_finite()
            {
                map.insert("v".into(), json!(f));
            }
            map.values_mut().for_each(exact_floats);
        }
        Value::Array(items) => items.iter_mut().for_each(exact_floats),
        _ => {}
    }
}

/// A value typed as the reader script types Python's (`{"t": "int", "v": "420"}`).
fn typed(value: &CloudConfigValue) -> Value {
    match value {
        CloudConfigValue::Scalar(s) => match s {
            CloudConfigScalar::Null => json!({"t": "null"}),
            CloudConfigScalar::Bool(b) => json!({"t": "bool", "v": b}),
            CloudConfigScalar::Int(i) => json!({"t": "int", "v": i.to_string()}),
            CloudConfigScalar::Float(f) if f.is_nan() => json!({"t": "float", "v": "nan"}),
            CloudConfigScalar::Float(f) if f.is_infinite() => {
                json!({"t": "float", "v": if *f > 0.0 { "inf" } else { "-inf" }})
            }
            CloudConfigScalar::Float(f) => json!({"t": "float", "v": f}),
            CloudConfigScalar::Str(s) => json!({"t": "str", "v": s}),
        },
        CloudConfigValue::List(items) => {
            json!({"t": "list", "v": items.iter().map(typed).collect::<Vec<_>>()})
        }
        CloudConfigValue::Map(entries) => json!({"t": "map", "v": entries
            .iter()
            .map(|(k, v)| json!([{"t": "str", "v": k}, typed(v)]))
            .collect::<Vec<_>>()}),
    }
}

fn typed_map(entries: &[(String, CloudConfigValue)]) -> Value {
    typed(&CloudConfigValue::Map(entries.to_vec()))
}

/// Asserts that cloud-init reads `doc` exactly as `ours` says: form, parts (type, file
/// name, payload) and values, per part and merged.
fn assert_same(doc: &str, ours: &VendorDataReading, theirs: &Value) {
    assert_eq!(theirs.get("error"), None, "cloud-init failed on\n{doc}");
    assert_eq!(
        theirs["includes"],
        json!([]),
        "cloud-init would fetch\n{doc}"
    );
    let form = match ours.form {
        VendorDataForm::CloudConfig => "plain",
        VendorDataForm::Multipart => "multipart",
    };
    assert_eq!(theirs["form"], form, "{doc}");
    assert_eq!(theirs["defects"], json!([]), "Python saw defects in\n{doc}");
    let parts = theirs["parts"].as_array().unwrap();
    assert_eq!(parts.len(), ours.parts.len(), "{theirs}\n{doc}");
    for (i, (our, their)) in ours.parts.iter().zip(parts).enumerate() {
        let at = format!("part {}", i + 1);
        assert_eq!(their["type"], our.content_type.mime_type(), "{at}\n{doc}");
        // cloud-init names an unnamed part `part-NNN` (UserDataProcessor._attach_part).
        let their_name = their["filename"].as_str();
        match &our.filename {
            Some(name) => assert_eq!(their_name, Some(name.as_str()), "{at}\n{doc}"),
            None if form == "plain" => {}
            None => assert!(
                their_name.is_some_and(|n| n.starts_with("part-")),
                "{at}: {their_name:?}\n{doc}"
            ),
        }
        assert_eq!(
            their["payload_hex"].as_str().unwrap(),
            hex::encode(our.payload.as_bytes()),
            "{at}: payloads differ\n{doc}"
        );
        if our.content_type.mime_type() == "text/cloud-config" {
            assert_eq!(
                their.get("yaml_error"),
                None,
                "{at}: cloud-init drops it\n{doc}"
            );
            let ours_typed = our.cloud_config.as_deref().map_or(Value::Null, typed_map);
            assert_eq!(their["config"], ours_typed, "{at}: values differ\n{doc}");
        }
    }
    assert_eq!(
        theirs["merged"],
        typed_map(&ours.cloud_config),
        "the merged cloud-config differs\n{doc}"
    );
}

const SCRIPT_PART: &str = "Content-Type: text/x-shellscript; charset=\"us-ascii\"\n\
MIME-Version: 1.0\nContent-Transfer-Encoding: 7bit\n\
Content-Disposition: attachment; filename=\"setup.sh\"\n\n#!/bin/sh\nset -eu\necho 'a!b'\n";

/// Hand-written documents the reader accepts (the same shapes as its unit corpus).
fn accepted_corpus() -> Vec<String> {
    let ntp = "#cloud-config\nntp:\n  enabled: true\n  servers:\n  - ntp.example.org\n";
    vec![
        "#cloud-config\n".into(),
        "#cloud-config\npackages: [a]\n".into(),
        "#cloud-config\nbootcmd: [\"echo caf\u{e9} \u{20ac}!\"]\nwrite_files:\n- path: /x\n  content: |\n    #!/bin/sh\n    echo hi!\n".into(),
        format!("#cloud-config\n#{}\nx: 'MIME-Version: 1'\n", "a".repeat(5000)),
        "Content-Type: multipart/mixed; boundary=\"XYZ\"\nMIME-Version: 1.0\n\n--XYZ\nContent-Type: text/cloud-config\n\npackages: []\n--XYZ--\n".into(),
        format!("Content-Type: multipart/mixed; boundary=B-1.x_y\nMIME-Version: 1.0\n\n--B-1.x_y\n{SCRIPT_PART}--B-1.x_y--\n"),
        format!(
            "Content-Type: multipart/mixed; boundary=\"==a (b) c:d/e?f=g, 'h'\"\nMIME-Version: 1.0\n\n\n\
             --==a (b) c:d/e?f=g, 'h'\n{SCRIPT_PART}\n\
             --==a (b) c:d/e?f=g, 'h'\nContent-Type: text/cloud-config; charset=\"utf-8\"\nMIME-Version: 1.0\n\
             Content-Transfer-Encoding: 8bit\nContent-Disposition: attachment; filename=\"opt.cfg\"\n\n{ntp}\
             --==a (b) c:d/e?f=g, 'h'--\n\n"
        ),
        "content-type:\tmultipart/mixed; boundary=b\nmime-version: 1.0\n\n--b\nCONTENT-TYPE: text/cloud-config; CHARSET=utf-8\n\nruncmd:\n- [sh, -c, 'echo \"a!b\"']\n\n--b--".into(),
        "Content-Type: multipart/mixed; boundary=B\nMIME-Version: 1.0\n\n--B\nContent-Type: text/cloud-config\n\n\n--B--\n".into(),
        // The classes the standard tools write: CRLF and blanks after `#cloud-config`;
        // a preamble, an epilogue, folds after `;`, other letter cases, base64 and
        // quoted-printable parts.
        "#cloud-config \r\npackages:\r\n- curl\r\nntp: {enabled: true}\r\n".into(),
        "Content-Type: Multipart/Mixed;\n boundary=\"B\"\nMIME-Version: 1.0\n\n\
         This is a multi-part message in MIME format.\n\n--B\n\
         Content-Type: Text/Cloud-Config;\n\tcharset=\"utf-8\"\nContent-Transfer-Encoding: base64\n\
         Content-Disposition: attachment;\n filename=\"c.yaml\"\n\n\
         I2Nsb3VkLWNvbmZpZwpib290Y21kOiBbImVjaG8gY2Fmw6kiXQo=\n\n--B\n\
         Content-Type: text/cloud-config\nContent-Transfer-Encoding: quoted-printable\n\n\
         runcmd: [\"echo a=3Db caf=C3=A9 lo=\nng\"]\n--B--\nepilogue\n".into(),
    ]
}

/// The real default plugin rendered for the sample Proxy with a few settings.
fn default_plugin_renders() -> Vec<String> {
    let root = workspace_root().join("config/samples");
    let config = config::load_file(&root.join("providers-config.yaml")).unwrap();
    let proxy = proxy::load_manifest(&root.join("proxy_kvm2.yaml"), &config).unwrap();
    let inputs = render::inputs(
        &config,
        &proxy,
        None,
        &Facts::default(),
        "2026-01-01T00:00:00Z",
    )
    .unwrap();
    let engine = TemplateEngine::new(None).unwrap();
    let settings = [
        json!({}),
        json!({"ntpServers": ["ntp.example.org", "192.0.2.123"]}),
        json!({"listenPort": 8888, "connectPorts": [443, 8443], "extraPackages": ["curl"],
               "deniedDestinationCidrs": ["203.0.113.0/24"], "maxClients": 10}),
        json!({"installPackages": false, "allowedClientCidrs": ["192.0.2.0/24"]}),
    ];
    settings
        .into_iter()
        .map(|settings| {
            let template = TemplateConfig {
                path: Some(
                    plugin_path("vendor-data-default")
                        .unwrap()
                        .display()
                        .to_string(),
                ),
                url: None,
                sha256: None,
                credentials_file: None,
                settings: settings.clone(),
                overridable_settings: Vec::new(),
                timeout_millis: 2000,
                max_memory_mib: 64,
            };
            let plugin = engine.load_vendor_data(&template).unwrap();
            plugin
                .render(&inputs.vendor_data)
                .unwrap_or_else(|e| panic!("{settings}: {e}"))
        })
        .collect()
}

#[test]
fn cloud_init_reads_every_accepted_document_as_we_do() {
    if !cloud_init() {
        return;
    }
    let mut docs = accepted_corpus();
    let renders = default_plugin_renders();
    assert!(
        renders.iter().any(|r| r.contains("text/cloud-config")),
        "a render with a cloud-config part"
    );
    docs.extend(renders);
    docs.push(
        std::fs::read_to_string(workspace_root().join("tests/snapshots/vendor-data-default.mime"))
            .unwrap(),
    );
    let theirs = cloud_init_readings(&docs);
    for (doc, their) in docs.iter().zip(&theirs) {
        let ours = read_vendor_data(doc).unwrap_or_else(|e| panic!("refused: {e}\n{doc}"));
        assert_same(doc, &ours, their);
    }
}

/// Labels whose documents must not all be refused: the classes the reader accepts.
const ACCEPTED_CLASSES: &[&str] = &[
    "scalar:top",
    "scalar:nested",
    "scalar:item",
    "scalar:flow-item",
    "scalar:flow-value",
    "scalar:nested-key",
    "scalar:top-key",
    "scalar:mime",
    "structure",
    "structure:mime",
    "fuzz",
    "fuzz:mime",
    "mime-fuzz",
    "crlf-plain",
    "first-line:space",
    "first-line:tab",
    "first-line:spaces",
    "make-mime",
    "none",
    "7bit",
    "8bit",
    "base64",
    "quoted-printable",
    "case:lower",
    "case:upper",
    "case:types",
    "fold:space",
    "fold:tab",
    "preamble",
    "epilogue",
    "parts:config+script",
    "parts:utf8",
];

#[test]
fn cloud_init_reads_the_generated_corpus_as_we_do_or_we_refuse_it() {
    if !cloud_init() {
        return;
    }
    let (generated, make_mime) = corpus::generate();
    let mut labels: Vec<Vec<String>> = generated.iter().map(|d| d.labels.clone()).collect();
    let mut docs: Vec<String> = generated.into_iter().map(|d| d.text).collect();
    // cloud-init's own `devel make-mime` writes the rest.
    let files: Vec<&Vec<corpus::MimeFile>> = make_mime.iter().map(|m| &m.files).collect();
    let made = run_python(MAKE_MIME, &json!(files));
    for (input, text) in make_mime.iter().zip(made.as_array().unwrap()) {
        labels.push(input.labels.clone());
        docs.push(text.as_str().unwrap().to_string());
    }
    let theirs = cloud_init_readings(&docs);
    let mut accepted_by_label: BTreeMap<&str, usize> = BTreeMap::new();
    let (mut accepted, mut dropped) = (0, 0);
    let mut differ: Vec<String> = Vec::new();
    for ((doc, their), tags) in docs.iter().zip(&theirs).zip(&labels) {
        // A document cloud-init fails on, or a cloud-config part it cannot load (and so
        // drops), must be refused.
        let drops = their.get("error").is_some()
            || their["parts"]
                .as_array()
                .is_some_and(|p| p.iter().any(|part| part.get("yaml_error").is_some()));
        match read_vendor_data(doc) {
            Ok(ours) => {
                let same = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    assert!(
                        !drops,
                        "accepted, but cloud-init drops it: {their}\n{doc:?}"
                    );
                    assert_same(doc, &ours, their);
                }));
                if same.is_err() {
                    differ.push(doc.clone());
                    continue;
                }
                accepted += 1;
                for tag in tags {
                    *accepted_by_label.entry(tag.as_str()).or_default() += 1;
                }
            }
            Err(TemplateErrorKind::InvalidOutput { detail, .. }) => {
                assert!(!detail.is_empty());
                dropped += usize::from(drops);
            }
            Err(other) => panic!("{other}\n{doc:?}"),
        }
    }
    assert!(
        differ.is_empty(),
        "{} accepted documents cloud-init reads differently (see the panics above): {:#?}",
        differ.len(),
        differ
    );
    for class in ACCEPTED_CLASSES {
        assert!(
            accepted_by_label.get(class).is_some_and(|n| *n > 0),
            "no document of class {class} was accepted: {accepted_by_label:?}"
        );
    }
    // Not a test that passes by refusing everything: a quarter of the corpus written to be
    // plausible (all but the fuzzer's output) is accepted.
    let fuzzed = labels
        .iter()
        .filter(|l| l.iter().any(|t| t == "fuzz"))
        .count();
    let plausible = docs.len() - fuzzed;
    let accepted_plausible = accepted - accepted_by_label.get("fuzz").copied().unwrap_or(0);
    assert!(
        accepted_plausible * 4 > plausible,
        "{accepted_plausible} of {plausible}"
    );
    assert!(dropped > 0, "the corpus has documents cloud-init drops");
    println!(
        "{} generated documents, {accepted} accepted and read alike by cloud-init, {} refused \
         ({dropped} of them dropped by cloud-init); accepted by label: {accepted_by_label:?}",
        docs.len(),
        docs.len() - accepted
    );
}

#[test]
fn refused_documents_mean_something_else_to_cloud_init() {
    if !cloud_init() {
        return;
    }
    let cfg_part = |yaml: &str| {
        format!(
            "Content-Type: multipart/mixed; boundary=B\nMIME-Version: 1.0\n\n--B\n\
             Content-Type: text/cloud-config\n\n{yaml}\n--B--\n"
        )
    };
    // (document, rule we refuse it by, what cloud-init makes of it)
    type Check = fn(&Value) -> bool;
    let cases: Vec<(String, &str, Check)> = vec![
        (
            // No MIME-Version: one opaque text part, the cloud-config is never applied.
            "Content-Type: multipart/mixed; boundary=B\n\n--B\nContent-Type: text/cloud-config\n\na: 1\n--B--\n".into(),
            "mime-multipart",
            |r| r["form"] == "plain" && r["parts"][0]["type"] == "text/x-not-multipart",
        ),
        (
            // A #cloud-config document that mentions MIME-Version goes down the MIME path.
            "#cloud-config\n# MIME-Version: 1.0\npackages: [a]\n".into(),
            "vendor-data-format",
            |r| r["form"] == "multipart" && r["defects"] == json!(["MissingHeaderBodySeparatorDefect"]),
        ),
        (
            // Non-ASCII in a 7bit part reaches cloud-init mangled.
            cfg_part("a: \"caf\u{e9}\""),
            "mime-part-ascii",
            |r| r["parts"][0]["payload_hex"] != hex::encode("a: \"caf\u{e9}\""),
        ),
        (
            // A shell script part that starts with #include is an include-url part.
            "Content-Type: multipart/mixed; boundary=B\nMIME-Version: 1.0\n\n--B\n\
             Content-Type: text/x-shellscript\nContent-Disposition: attachment; filename=\"x.sh\"\n\n\
             #include http://192.0.2.1/x\n--B--\n".into(),
            "mime-part-type",
            // cloud-init fetches it (the reader records the URL and fails the fetch).
            |r| r["error"].as_str().is_some_and(|e| e.contains("http://192.0.2.1/x")),
        ),
        (
            // Python uses the first of two Content-Type headers.
            "Content-Type: multipart/mixed; boundary=B\nMIME-Version: 1.0\n\n--B\n\
             Content-Type: text/cloud-config\nContent-Type: text/x-shellscript\n\na: 1\n--B--\n".into(),
            "mime-part-header",
            |r| r["parts"][0]["type"] == "text/cloud-config",
        ),
        (
            // A delimiter with a trailing space is still a delimiter to Python.
            "Content-Type: multipart/mixed; boundary=B\nMIME-Version: 1.0\n\n--B \n\
             Content-Type: text/cloud-config\n\na: 1\n--B--\n".into(),
            "mime-boundary",
            |r| r["parts"].as_array().is_some_and(|p| p.len() == 1),
        ),
        (
            // Duplicate keys: PyYAML keeps the last one without a word.
            cfg_part("a: 1\na: 2"),
            "cloud-config-yaml",
            |r| r["parts"][0]["config"]["v"].as_array().is_some_and(|m| m.len() == 1),
        ),
        (
            // `on` is a boolean key to PyYAML.
            "#cloud-config\non: 1\n".into(),
            "cloud-config-key",
            |r| r["parts"][0]["config"]["v"][0][0] == json!({"t": "bool", "v": true}),
        ),
        (
            // A python/ tag makes safe_load fail: cloud-init drops the part.
            cfg_part("a: !!python/object/apply:os.system [id]"),
            "cloud-config-tag",
            |r| r["parts"][0].get("yaml_error").is_some() && r["merged"]["v"] == json!([]),
        ),
        (
            // A merge key merges in PyYAML.
            cfg_part("base: 1\nother:\n  <<: {x: 1}\n  y: 2"),
            "cloud-config-merge-key",
            |r| r["parts"][0]["config"]["v"][1][1]["v"][0][0]["v"] == "x",
        ),
        (
            // An anchor defined twice: PyYAML fails, cloud-init drops the part.
            cfg_part("a: &x 1\nb: &x 2"),
            "cloud-config-yaml",
            |r| r["parts"][0].get("yaml_error").is_some(),
        ),
        (
            // merge_how changes how cloud-init merges the parts: here lists are appended.
            "Content-Type: multipart/mixed; boundary=B\nMIME-Version: 1.0\n\n--B\n\
             Content-Type: text/cloud-config\n\na: [1]\n--B\nContent-Type: text/cloud-config\n\n\
             merge_how: 'dict(recurse_array)+list(append)'\na: [2]\n--B--\n".into(),
            "cloud-config-merge-key",
            |r| r["merged"]["v"][0][1]["v"].as_array().is_some_and(|l| l.len() == 2),
        ),
        (
            // The classes where YAML 1.1 differs: cloud-init's values, not 1.2's.
            "#cloud-config\na: yes\nb: 0644\nc: 1:30\nd: 1e3\ne: 1_000\nf: 0o644\n".into(),
            "cloud-config-value",
            |r| {
                r["parts"][0]["config"]["v"][0][1] == json!({"t": "bool", "v": true})
                    && r["parts"][0]["config"]["v"][1][1] == json!({"t": "int", "v": "420"})
                    && r["parts"][0]["config"]["v"][2][1] == json!({"t": "int", "v": "90"})
                    && r["parts"][0]["config"]["v"][3][1] == json!({"t": "str", "v": "1e3"})
                    && r["parts"][0]["config"]["v"][4][1] == json!({"t": "int", "v": "1000"})
                    && r["parts"][0]["config"]["v"][5][1] == json!({"t": "str", "v": "0o644"})
            },
        ),
        (
            "#cloud-config\na: 2027-01-01\n".into(),
            "cloud-config-value",
            |r| r["parts"][0]["config"]["v"][0][1]["t"] == "date",
        ),
        (
            // A bare `=`: PyYAML cannot construct it, cloud-init drops the part.
            "#cloud-config\npackages: [a]\nb: =\n".into(),
            "cloud-config-pyyaml",
            |r| r["parts"][0].get("yaml_error").is_some() && r["merged"]["v"] == json!([]),
        ),
        (
            // A tab in an unquoted value: the same.
            "#cloud-config\npackages: [a]\nb: x\ty\n".into(),
            "cloud-config-pyyaml",
            |r| r["parts"][0].get("yaml_error").is_some() && r["merged"]["v"] == json!([]),
        ),
    ];
    let docs: Vec<String> = cases.iter().map(|c| c.0.clone()).collect();
    let theirs = cloud_init_readings(&docs);
    for ((doc, rule, check), their) in cases.iter().zip(&theirs) {
        match check_vendor_data(doc) {
            Err(TemplateErrorKind::InvalidOutput { rule: got, .. }) => {
                assert_eq!(got, *rule, "{doc}")
            }
            other => panic!("not refused: {other:?}\n{doc}"),
        }
        assert!(check(their), "cloud-init's reading: {their}\n{doc}");
    }
}
