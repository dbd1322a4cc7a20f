//! The cloud-config YAML rules: values read as cloud-init's PyYAML reads them (YAML 1.1),
//! keys, tags, merge keys, anchors, and the documents PyYAML cannot load.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use super::*;

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
            (in_part("a: |\n  x"), &[part, "line 18", "block scalar"]),
            (
                "#cloud-config\na: >\n  x\n  y".into(),
                &[plain, "line 3", "empty line"],
            ),
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
                &[plain, "line 2", "\"merge_how\"", "merges"],
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
                &[plain, "line 2", "\"Packages\"", "identifier"],
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
