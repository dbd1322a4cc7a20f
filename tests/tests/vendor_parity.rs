//! The vendor-data reader against the consumer's own parser: Python's `email` package and
//! PyYAML, driven the way cloud-init 22.4 drives them (`user_data.py::convert_string` and
//! `_process_msg`, `util.fully_decoded_payload`, `handlers.type_from_starts_with`). Every
//! document the operator accepts must be read the same by both, part for part and byte for
//! byte; for a set of refused documents the test shows that Python reads them differently
//! from what they seem to say, which is why they are refused.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::io::Write;
use std::process::{Command, Stdio};

use egress_operator::api::proxy;
use egress_operator::config::{self, TemplateConfig};
use egress_operator::render::{self, Facts};
use egress_operator::templates::check::{
    VendorDataForm, VendorDataReading, check_vendor_data, read_vendor_data,
};
use egress_operator::templates::{TemplateEngine, TemplateErrorKind};
use integration_tests::harness::cannot_run;
use integration_tests::{plugin_path, workspace_root};
use serde_json::{Value, json};

/// cloud-init's reading, restated in a few lines (its rules, not its code): MIME iff
/// `mime-version:` is in the first 4096 bytes; `walk()` without the multipart containers;
/// the payload through `get_payload(decode=True)` and a UTF-8 decode with surrogate
/// escapes; text/plain, text/x-not-multipart and text/x-shellscript re-guessed from their
/// first line. Prints one JSON object per document (payloads as hex of their bytes, so
/// surrogate escapes survive), with PyYAML's top-level keys when PyYAML is there.
const READER: &str = r###"
import email, json, sys
from email.mime.base import MIMEBase
try:
    import yaml
except ImportError:
    yaml = None

STARTS = {
    "#include": "text/x-include-url",
    "#include-once": "text/x-include-once-url",
    "#!": "text/x-shellscript",
    "#cloud-config": "text/cloud-config",
    "#upstart-job": "text/upstart-job",
    "#part-handler": "text/part-handler",
    "#cloud-boothook": "text/cloud-boothook",
    "#cloud-config-archive": "text/cloud-config-archive",
    "#cloud-config-jsonp": "text/cloud-config-jsonp",
    "## template: jinja": "text/jinja2",
}
LONGEST_FIRST = sorted(STARTS, key=lambda s: -len(s))

def guess(payload):
    low = payload.lower().lstrip()
    for start in LONGEST_FIRST:
        if low.startswith(start):
            return STARTS[start]
    return None

def decoded(part):
    raw = part.get_payload(decode=True)
    if part.get_content_maintype() == "text" and isinstance(raw, bytes):
        charset = part.get_charset()
        codec = charset.input_codec if charset and charset.input_codec else "utf-8"
        return raw.decode(codec, "surrogateescape")
    return raw

def read(text):
    data = text.encode("utf-8")
    if b"mime-version:" in data[0:4096].lower():
        msg = email.message_from_string(data.decode("utf-8"))
        form = "multipart"
    else:
        msg = MIMEBase("text", "x-not-multipart")
        msg.set_payload(data)
        form = "plain"
    parts, defects = [], []
    for part in msg.walk():
        defects += [type(d).__name__ for d in part.defects]
        if (part.get_content_maintype() or "").lower() == "multipart":
            continue
        ctype = part.get_content_type()
        payload = decoded(part)
        if ctype in ("text/plain", "text/x-not-multipart", "text/x-shellscript"):
            ctype = guess(payload) or ctype
        entry = {
            "type": ctype,
            "filename": part.get_filename(),
            "payload_hex": payload.encode("utf-8", "surrogateescape").hex(),
        }
        if yaml is not None and ctype == "text/cloud-config":
            try:
                doc = yaml.safe_load(payload)
                if doc is None:
                    entry["yaml_keys"] = []
                elif isinstance(doc, dict):
                    entry["yaml_keys"] = [str(k) for k in doc]
                else:
                    entry["yaml_error"] = "top level is " + type(doc).__name__
            except Exception as e:
                entry["yaml_error"] = str(e)
        parts.append(entry)
    return {"form": form, "parts": parts, "defects": defects}

docs = json.load(sys.stdin)
json.dump([read(d) for d in docs], sys.stdout)
"###;

/// Debian's own interpreter (with Debian's python3-yaml), the one cloud-init runs on a
/// Debian 12 guest, rather than whatever `python3` comes first on PATH (pyenv's, here).
const PYTHON: &str = "/usr/bin/python3";

/// Whether python3 runs here; a missing one fails under CI (see `cannot_run`).
fn python() -> bool {
    let ok = Command::new(PYTHON)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    ok || !cannot_run("python3 is missing (scripts/setup.sh installs it)")
}

/// Whether PyYAML (Debian's python3-yaml) is importable; a missing one fails under CI.
fn pyyaml() -> bool {
    let ok = Command::new(PYTHON)
        .args(["-c", "import yaml"])
        .output()
        .is_ok_and(|o| o.status.success());
    ok || !cannot_run(
        "PyYAML is missing: cloud-config keys cannot be compared (scripts/setup.sh installs \
         python3-yaml)",
    )
}

/// Python's readings of `docs`, in order.
fn python_readings(docs: &[String]) -> Vec<Value> {
    let mut child = Command::new(PYTHON)
        .args(["-c", READER])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 starts");
    let input = serde_json::to_vec(docs).unwrap();
    child.stdin.take().unwrap().write_all(&input).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "python3 failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let readings: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(readings.len(), docs.len());
    readings
}

/// Asserts that Python reads `doc` exactly as `ours` says.
fn assert_same(doc: &str, ours: &VendorDataReading, theirs: &Value, with_yaml: bool) {
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
        assert_eq!(
            their["filename"].as_str(),
            our.filename.as_deref(),
            "{at}\n{doc}"
        );
        assert_eq!(
            their["payload_hex"].as_str().unwrap(),
            hex::encode(our.payload.as_bytes()),
            "{at}: payloads differ\n{doc}"
        );
        if with_yaml && our.content_type.mime_type() == "text/cloud-config" {
            assert_eq!(their.get("yaml_error"), None, "{at}\n{doc}");
            assert_eq!(
                their["yaml_keys"],
                json!(our.cloud_config_keys),
                "{at}: PyYAML's top-level keys differ\n{doc}"
            );
        }
    }
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
fn python_reads_every_accepted_document_as_we_do() {
    if !python() {
        return;
    }
    let with_yaml = pyyaml();
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
    let theirs = python_readings(&docs);
    for (doc, their) in docs.iter().zip(&theirs) {
        let ours = read_vendor_data(doc).unwrap_or_else(|e| panic!("refused: {e}\n{doc}"));
        assert_same(doc, &ours, their, with_yaml);
    }
}

#[test]
fn refused_documents_mean_something_else_to_python() {
    if !python() {
        return;
    }
    let with_yaml = pyyaml();
    let cfg_part = |yaml: &str| {
        format!(
            "Content-Type: multipart/mixed; boundary=B\nMIME-Version: 1.0\n\n--B\n\
             Content-Type: text/cloud-config\n\n{yaml}\n--B--\n"
        )
    };
    // (document, rule we refuse it by, what Python makes of it)
    type Check = fn(&Value) -> bool;
    let cases: Vec<(String, &str, Check, bool)> = vec![
        (
            // No MIME-Version: one opaque text part, the cloud-config is never applied.
            "Content-Type: multipart/mixed; boundary=B\n\n--B\nContent-Type: text/cloud-config\n\na: 1\n--B--\n".into(),
            "mime-multipart",
            |r| r["form"] == "plain" && r["parts"][0]["type"] == "text/x-not-multipart",
            false,
        ),
        (
            // A #cloud-config document that mentions MIME-Version goes down the MIME path:
            // here the first line is no header, so Python records a defect and takes the
            // whole text as a text/plain body (re-guessed), a reading by accident.
            "#cloud-config\n# MIME-Version: 1.0\npackages: [a]\n".into(),
            "vendor-data-format",
            |r| r["form"] == "multipart" && r["defects"] == json!(["MissingHeaderBodySeparatorDefect"]),
            false,
        ),
        (
            // Non-ASCII in a MIME part reaches cloud-init mangled.
            cfg_part("a: \"caf\u{e9}\""),
            "mime-part-ascii",
            |r| r["parts"][0]["payload_hex"] != hex::encode("a: \"caf\u{e9}\""),
            false,
        ),
        (
            // A shell script part that starts with #include is an include-url part.
            "Content-Type: multipart/mixed; boundary=B\nMIME-Version: 1.0\n\n--B\n\
             Content-Type: text/x-shellscript\nContent-Disposition: attachment; filename=\"x.sh\"\n\n\
             #include http://192.0.2.1/x\n--B--\n".into(),
            "mime-part-type",
            |r| r["parts"][0]["type"] == "text/x-include-url",
            false,
        ),
        (
            // Python uses the first of two Content-Type headers.
            "Content-Type: multipart/mixed; boundary=B\nMIME-Version: 1.0\n\n--B\n\
             Content-Type: text/cloud-config\nContent-Type: text/x-shellscript\n\na: 1\n--B--\n".into(),
            "mime-part-header",
            |r| r["parts"][0]["type"] == "text/cloud-config",
            false,
        ),
        (
            // A delimiter with a trailing space is still a delimiter to Python.
            "Content-Type: multipart/mixed; boundary=B\nMIME-Version: 1.0\n\n--B \n\
             Content-Type: text/cloud-config\n\na: 1\n--B--\n".into(),
            "mime-boundary",
            |r| r["parts"].as_array().is_some_and(|p| p.len() == 1),
            false,
        ),
        (
            // A second delimiter right after the first makes no empty part.
            "Content-Type: multipart/mixed; boundary=B\nMIME-Version: 1.0\n\n--B\n--B\n\
             Content-Type: text/cloud-config\n\na: 1\n--B--\n".into(),
            "mime-part-header",
            |r| r["parts"].as_array().is_some_and(|p| p.len() == 1),
            false,
        ),
        (
            // Duplicate keys: PyYAML keeps the last one without a word.
            cfg_part("a: 1\na: 2"),
            "cloud-config-yaml",
            |r| r["parts"][0]["yaml_keys"] == json!(["a"]),
            true,
        ),
        (
            // `on` is a boolean key to PyYAML.
            "#cloud-config\non: 1\n".into(),
            "cloud-config-key",
            |r| r["parts"][0]["yaml_keys"] == json!(["True"]),
            true,
        ),
        (
            // A python/ tag makes safe_load fail: cloud-init drops the part.
            cfg_part("a: !!python/object/apply:os.system [id]"),
            "cloud-config-tag",
            |r| r["parts"][0].get("yaml_error").is_some(),
            true,
        ),
        (
            // A merge key merges in PyYAML.
            cfg_part("base: &b {x: 1}\nother:\n  <<: *b"),
            "cloud-config-merge-key",
            |r| r["parts"][0]["yaml_keys"] == json!(["base", "other"]),
            true,
        ),
    ];
    let docs: Vec<String> = cases.iter().map(|c| c.0.clone()).collect();
    let theirs = python_readings(&docs);
    for ((doc, rule, check, needs_yaml), their) in cases.iter().zip(&theirs) {
        match check_vendor_data(doc) {
            Err(TemplateErrorKind::InvalidOutput { rule: got, .. }) => {
                assert_eq!(got, *rule, "{doc}")
            }
            other => panic!("not refused: {other:?}\n{doc}"),
        }
        if *needs_yaml && !with_yaml {
            continue;
        }
        assert!(check(their), "Python's reading: {their}\n{doc}");
    }
}
