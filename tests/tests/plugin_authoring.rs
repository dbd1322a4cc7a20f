//! Plugin authoring end to end, with the real binary, cargo and the wasm32-wasip2 target:
//! `plugin new` writes a crate outside this repository that builds and passes `plugin
//! test`; `plugin test` passes the default plugins and names the rule a hostile one breaks;
//! and the "Your first plugin" walkthrough of `plugins/README.md` runs as written.
//!
//! The new crates build into one target directory under the workspace's
//! (`target/plugin-authoring`), so a repeat run compiles only the crate itself. Builds try
//! `--offline` first (the registry cache holds every crate the workspace uses) and go to
//! the registry only when that fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use integration_tests::guest_lab::{Finished, run_guarded};
use integration_tests::harness::{self, Need, Registry};
use integration_tests::{plugin_path, target_dir, workspace_root};

/// A hang fails the test instead of blocking CI; never a timing assertion. A cold build of
/// a new crate (serde, schemars, wit-bindgen for wasm32 and the host) takes minutes on two
/// busy cores.
const BUILD_HANG_GUARD: Duration = Duration::from_secs(30 * 60);
const RUN_HANG_GUARD: Duration = Duration::from_secs(120);

fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_operator-under-test"))
}

/// The target directory every new crate of these tests builds into.
fn shared_target() -> PathBuf {
    target_dir().join("plugin-authoring")
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

fn operator(args: &[&str]) -> Finished {
    let mut cmd = Command::new(binary());
    cmd.args(args);
    run_guarded(
        &mut cmd,
        RUN_HANG_GUARD,
        &format!("egress-operator {args:?}"),
    )
    .unwrap()
}

/// A directory outside the repository (in the system's temp dir), so a new crate cannot
/// borrow anything from this workspace; removed when dropped.
///
/// Its path is the same on every run (per target directory and test): cargo keys a path
/// crate's artifacts by its path, so the shared target directory then rebuilds the new
/// crates in place instead of piling up one set per run.
#[derive(Debug)]
struct OutsideDir(PathBuf);

impl OutsideDir {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for OutsideDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
        // The shared parent goes with the last test that used it (not empty before).
        if let Some(parent) = self.0.parent() {
            let _ = std::fs::remove_dir(parent);
        }
    }
}

fn outside_dir(test: &str) -> OutsideDir {
    let key =
        &integration_tests::sha256_hex(shared_target().display().to_string().as_bytes())[..12];
    let dir = std::env::temp_dir()
        .join(format!("egress-plugin-authoring-{key}"))
        .join(test);
    // What a killed earlier run left.
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let root = workspace_root().canonicalize().unwrap();
    assert!(
        !dir.canonicalize().unwrap().starts_with(&root),
        "{} is inside the repository",
        dir.display()
    );
    OutsideDir(dir)
}

/// Runs cargo with `args` in `dir`: offline first (`CARGO_NET_OFFLINE`, which every
/// subcommand reads), then (when that fails) with the registry. Panics with both outputs when neither works.
fn cargo_in(dir: &Path, args: &[&str]) {
    let attempt = |offline: bool| {
        let mut cmd = Command::new(cargo());
        cmd.args(args)
            .current_dir(dir)
            .env("CARGO_TARGET_DIR", shared_target())
            .env("CARGO_NET_OFFLINE", if offline { "true" } else { "false" });
        run_guarded(&mut cmd, BUILD_HANG_GUARD, &format!("cargo {args:?}")).unwrap()
    };
    let offline = attempt(true);
    if offline.code == 0 {
        return;
    }
    let online = attempt(false);
    assert_eq!(
        online.code, 0,
        "cargo {args:?} failed offline:\n{}\nand online:\n{}",
        offline.stderr, online.stderr
    );
}

#[test]
fn a_new_crate_of_each_kind_builds_outside_the_repository_and_passes_plugin_test() {
    let dir = outside_dir("new-crates");
    for (kind, name, file, cases) in [
        ("domain", "site-domain", "site_domain.wasm", 10),
        (
            "vendor-data",
            "site-vendor-data",
            "site_vendor_data.wasm",
            2,
        ),
    ] {
        let crate_dir = dir.path().join(name);
        let new = operator(&[
            "plugin",
            "new",
            "--kind",
            kind,
            name,
            "--dir",
            crate_dir.to_str().unwrap(),
        ]);
        assert_eq!(new.code, 0, "{}", new.stderr);
        assert!(new.stdout.contains(file), "{}", new.stdout);

        cargo_in(
            &crate_dir,
            &["build", "--release", "--target", "wasm32-wasip2"],
        );
        // The crate's own unit tests, on the host; and the code an author starts from
        // passes the checks their CI would run.
        cargo_in(&crate_dir, &["test"]);
        cargo_in(&crate_dir, &["fmt", "--check"]);
        cargo_in(
            &crate_dir,
            &["clippy", "--all-targets", "--", "-D", "warnings"],
        );

        let wasm = shared_target().join("wasm32-wasip2/release").join(file);
        let test = operator(&["plugin", "test", wasm.to_str().unwrap()]);
        assert_eq!(test.code, 0, "{}\n{}", test.stdout, test.stderr);
        assert!(
            test.stdout
                .contains(&format!("{cases} case(s): {cases} passed, 0 failed")),
            "{}",
            test.stdout
        );
        assert!(
            test.stdout.starts_with(&format!("{kind} plugin ")),
            "{}",
            test.stdout
        );
        // The scaffold keeps what the operator relies on (issue 34): no warning, so a
        // domain plugin has the guest agent's channel.
        assert!(!test.stdout.contains("warning:"), "{}", test.stdout);
    }
}

/// A domain plugin without the guest agent's channel passes, with a warning that names
/// what the operator then cannot do (issue 34, item 3). The SDK's example plugin has no
/// channel; the default plugin has one and gets no warning.
#[test]
fn plugin_test_warns_about_a_domain_without_the_agent_channel() {
    let example = plugin_path("sdk-example").unwrap();
    let out = operator(&["plugin", "test", example.to_str().unwrap()]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let warning = out
        .stdout
        .lines()
        .find(|l| l.starts_with("warning: "))
        .unwrap_or_else(|| panic!("no warning:\n{}", out.stdout));
    println!("{warning}");
    for want in [
        "have no guest agent channel",
        "org.qemu.guest_agent.0",
        "reading a DHCP proxy's address through the agent (DHCP cases on sample-host",
        "the check that a guest applied its seed",
    ] {
        assert!(warning.contains(want), "{want}: {warning}");
    }
    let domain = plugin_path("domain-default").unwrap();
    let out = operator(&["plugin", "test", domain.to_str().unwrap()]);
    assert!(!out.stdout.contains("warning:"), "{}", out.stdout);
}

#[test]
fn plugin_new_refuses_a_bad_name_and_a_taken_directory() {
    let dir = outside_dir("refusals");
    let bad = operator(&["plugin", "new", "--kind", "domain", "My.Plugin"]);
    assert_eq!(bad.code, 1);
    assert!(
        bad.stderr
            .contains("NAME \"My.Plugin\" is not a valid crate name"),
        "{}",
        bad.stderr
    );
    let taken = dir.path().join("taken");
    std::fs::create_dir(&taken).unwrap();
    std::fs::write(taken.join("mine"), "x").unwrap();
    let out = operator(&[
        "plugin",
        "new",
        "--kind",
        "domain",
        "ok-name",
        "--dir",
        taken.to_str().unwrap(),
    ]);
    assert_eq!(out.code, 1);
    assert!(
        out.stderr
            .contains("(--dir, ./NAME by default) exists and is not empty"),
        "{}",
        out.stderr
    );
    assert_eq!(std::fs::read_dir(&taken).unwrap().count(), 1);
}

/// The cells of the table row of `case` (columns are separated by two or more spaces).
fn cells(table: &str, case: &str) -> Vec<String> {
    let row = table
        .lines()
        .find(|l| l.starts_with(&format!("{case}  ")))
        .unwrap_or_else(|| panic!("no row {case:?} in\n{table}"));
    row.split("  ")
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(str::to_string)
        .collect()
}

#[test]
fn plugin_test_passes_the_default_plugins() {
    let domain = plugin_path("domain-default").unwrap();
    let snapshots = tempfile::tempdir().unwrap();
    let out = operator(&[
        "plugin",
        "test",
        domain.to_str().unwrap(),
        "--snapshot",
        snapshots.path().to_str().unwrap(),
    ]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("15 case(s): 15 passed, 0 failed"),
        "{}",
        out.stdout
    );
    // The matrix, and each enum value and boolean of the plugin's own settings once
    // (issue 34, item 2), labelled with the setting.
    for case in [
        "sample-host bios 1-nic static",
        "sample-host uefi 3-nic dhcp",
        "sample-host bios 1-nic static cpuMode=host-passthrough",
        "sample-host bios 1-nic static rng=false",
        // An input without a MAC (the WIT gives one only when the operator assigns it).
        "sample-host uefi 1-nic dhcp no-mac",
    ] {
        assert_eq!(cells(&out.stdout, case)[1], "pass", "{}", out.stdout);
    }
    // One reviewable output per case; the three-NIC ones carry three NICs.
    let mut files: Vec<String> = std::fs::read_dir(snapshots.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files.len(), 15, "{files:?}");
    let no_rng = std::fs::read_to_string(
        snapshots
            .path()
            .join("sample-host_bios_1-nic_static_rng=false.xml"),
    )
    .unwrap();
    assert!(!no_rng.contains("<rng"), "{no_rng}");
    let three =
        std::fs::read_to_string(snapshots.path().join("sample-host_uefi_3-nic_dhcp.xml")).unwrap();
    assert_eq!(three.matches("<interface ").count(), 3, "{three}");
    assert!(three.contains("OVMF_CODE_4M.fd"), "{three}");
    // Without a MAC in the input, the plugin writes none: libvirt makes one.
    let bare = std::fs::read_to_string(
        snapshots
            .path()
            .join("sample-host_bios_1-nic_dhcp_no-mac.xml"),
    )
    .unwrap();
    assert!(!bare.contains("<mac "), "{bare}");
    assert_eq!(bare.matches("<interface ").count(), 1, "{bare}");

    let vendor = plugin_path("vendor-data-default").unwrap();
    let out = operator(&[
        "plugin",
        "test",
        vendor.to_str().unwrap(),
        "--kind",
        "vendor-data",
    ]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.stdout.contains("3 case(s): 3 passed, 0 failed"),
        "{}",
        out.stdout
    );

    // The hosts and machine types of a given config.
    let config = workspace_root().join("config/samples/providers-config.yaml");
    let out = operator(&[
        "plugin",
        "test",
        domain.to_str().unwrap(),
        "--config",
        config.to_str().unwrap(),
    ]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(cells(&out.stdout, "kvm-b uefi 3-nic static")[1], "pass");
    assert!(
        out.stdout.contains("25 case(s): 25 passed, 0 failed"),
        "{}",
        out.stdout
    );
}

#[test]
fn plugin_test_names_the_rule_a_hostile_plugin_breaks_and_fails() {
    let hostile = plugin_path("hostile-domain").unwrap();
    let domain = plugin_path("domain-default").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let settings = dir.path().join("settings.yaml");
    // `plugin test PLUGIN --settings FILE` with `text` in FILE.
    let test_with = |plugin: &Path, text: &str| {
        std::fs::write(&settings, text).unwrap();
        operator(&[
            "plugin",
            "test",
            plugin.to_str().unwrap(),
            "--settings",
            settings.to_str().unwrap(),
        ])
    };
    // The rows of the matrix starting with `prefix`, without the cases that set the
    // plugin's own `mode` (issue 34 item 2 labels them with it).
    let rows = |stdout: &str, prefix: &str| -> Vec<String> {
        stdout
            .lines()
            .filter(|l| l.starts_with(prefix) && !l.contains(" mode="))
            .map(String::from)
            .collect()
    };
    // A NIC on another bridge than the host's.
    let out = test_with(&hostile, "mode: second-bridge\n");
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    let row = cells(&out.stdout, "sample-host bios 1-nic dhcp");
    assert_eq!(row[1], "FAIL", "{row:?}");
    assert_eq!(row[2], "interface-bridge-only", "{row:?}");
    assert_eq!(row[3], "/domain/devices/interface[2]/source", "{row:?}");
    // The rule's section of the rules page, once (the page is also in every new crate's
    // SDK copy).
    assert_eq!(
        out.stdout
            .matches("see templates-sdk/src/rules.md#interface-bridge-only\n")
            .count(),
        1,
        "{}",
        out.stdout
    );
    // Every case of the matrix fails; the cases that set the plugin's other modes (its
    // own enum setting, issue 34 item 2) are labelled with them.
    let matrix = rows(&out.stdout, "sample-host ");
    assert!(!matrix.is_empty(), "{}", out.stdout);
    assert!(
        matrix.iter().all(|l| l.contains(" FAIL ")),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("sample-host bios 1-nic static mode="),
        "{}",
        out.stdout
    );

    // A plugin that writes a second NIC of its own (no `extraNics` setting asked for it)
    // passes, and its cases are labelled with the NICs it wrote (issue 34, item 2).
    let out = test_with(&hostile, "mode: second-nic\n");
    // (The cases that set the plugin's other, hostile modes fail, and so do its UEFI ones:
    // it writes no loader.)
    let bios = rows(&out.stdout, "sample-host bios ");
    assert_eq!(bios.len(), 3, "{}", out.stdout);
    assert!(
        bios.iter()
            .all(|l| l.contains(" 2-nic ") && l.contains(" pass ")),
        "{}",
        out.stdout
    );
    assert_eq!(
        cells(&out.stdout, "sample-host bios 2-nic dhcp no-mac")[1],
        "pass",
        "{}",
        out.stdout
    );

    // Settings are checked before anything renders; a refusal names its JSON pointer.
    let out = test_with(&hostile, "{\"mode\": 42}");
    assert_eq!(out.code, 1);
    assert!(out.stderr.contains("\n  /mode: "), "{}", out.stderr);
    assert!(!out.stdout.contains("case(s)"), "{}", out.stdout);

    let out = test_with(&domain, "extraNics: 7\n");
    assert_eq!(out.code, 1);
    assert!(out.stderr.contains("/extraNics: "), "{}", out.stderr);

    // A plugin of the other kind than --kind says is refused as such.
    let out = operator(&[
        "plugin",
        "test",
        domain.to_str().unwrap(),
        "--kind",
        "vendor-data",
    ]);
    assert_eq!(out.code, 1);
    assert!(out.stderr.contains("is a domain plugin"), "{}", out.stderr);
}

/// One fenced block of the walkthrough.
#[derive(Debug)]
struct Block {
    lang: String,
    body: String,
}

/// The fenced blocks of the "Your first plugin" section of `plugins/README.md`, in order.
fn walkthrough() -> Vec<Block> {
    let readme = std::fs::read_to_string(workspace_root().join("plugins/README.md")).unwrap();
    let start = readme
        .find("\n## Your first plugin\n")
        .expect("plugins/README.md has a \"Your first plugin\" section");
    let section = &readme[start + 1..];
    let section = match section[3..].find("\n## ") {
        Some(end) => &section[..end + 3],
        None => section,
    };
    let mut blocks = Vec::new();
    let mut current: Option<Block> = None;
    for line in section.lines() {
        match (&mut current, line.strip_prefix("```")) {
            (None, Some(lang)) => {
                current = Some(Block {
                    lang: lang.trim().to_string(),
                    body: String::new(),
                })
            }
            (Some(_), Some("")) => blocks.extend(current.take()),
            (Some(b), _) => {
                b.body.push_str(line);
                b.body.push('\n');
            }
            (None, None) => {}
        }
    }
    blocks
}

/// The walkthrough from `plugin new` to `plugin push` into a registry of the test's own
/// (TLS with its own CA, htpasswd basic auth) and a `render` that pulls the plugin by
/// digest, with a second NIC from the plugin's own `extraNics` setting. The wall time of
/// each step is printed (never asserted).
#[test]
fn your_first_plugin_walkthrough_runs_as_written() {
    if harness::skip(&[Need::Registry]) {
        return;
    }
    let blocks = walkthrough();
    let langs: Vec<&str> = blocks.iter().map(|b| b.lang.as_str()).collect();
    assert_eq!(
        langs,
        [
            "sh", "sh", "rust", "sh", "sh", "sh", "yaml", "sh", "yaml", "sh"
        ]
    );
    let registry = Registry::start("author", "walkthrough-pw").unwrap();

    let work = outside_dir("walkthrough");
    let bin = work.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::os::unix::fs::symlink(binary(), bin.join("egress-operator")).unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let plugins = target_dir().join("plugins");
    let mut cwd = work.path().to_path_buf();
    let mut last_stdout = String::new();
    let mut timings = Vec::new();
    for (step, block) in blocks.iter().enumerate() {
        let started = std::time::Instant::now();
        match block.lang.as_str() {
            "sh" => {
                // The directory a block ends in is where the next one starts, as in one
                // shell session.
                let state = work.path().join(".cwd");
                let script = format!(
                    "set -euo pipefail\ncd {cwd:?}\n{}\npwd > {state:?}\n",
                    block.body
                );
                let run = |offline: bool| {
                    let mut cmd = Command::new("bash");
                    cmd.arg("-c")
                        .arg(&script)
                        .env("PATH", &path)
                        .env("EGRESS_PLUGINS", &plugins)
                        .env("REGISTRY", registry.host())
                        .env("CARGO", cargo())
                        // As in the reader's shell: cargo's default `target/` (a link to
                        // the shared directory, made below), not the one of this test run.
                        .env_remove("CARGO_TARGET_DIR")
                        .env_remove("CARGO_BUILD_TARGET_DIR")
                        .env("CARGO_NET_OFFLINE", if offline { "true" } else { "false" });
                    run_guarded(&mut cmd, BUILD_HANG_GUARD, "a walkthrough block").unwrap()
                };
                let mut done = run(true);
                if done.code != 0 && block.body.contains("cargo ") {
                    done = run(false);
                }
                assert_eq!(
                    done.code, 0,
                    "walkthrough block failed:\n{}\nstdout:\n{}\nstderr:\n{}",
                    block.body, done.stdout, done.stderr
                );
                last_stdout = done.stdout;
                cwd = PathBuf::from(std::fs::read_to_string(&state).unwrap().trim());
                // Between the steps, what the reader brings: a shared target directory
                // (so repeat runs are fast; the commands still say `target/`), and a
                // providers config and a Proxy manifest (the samples).
                let crate_target = cwd.join("target");
                if cwd.join("Cargo.toml").is_file() && !crate_target.exists() {
                    std::fs::create_dir_all(shared_target()).unwrap();
                    std::os::unix::fs::symlink(shared_target(), &crate_target).unwrap();
                    let samples = workspace_root().join("config/samples");
                    std::fs::copy(
                        samples.join("providers-config.yaml"),
                        cwd.join("providers-config.yaml"),
                    )
                    .unwrap();
                    std::fs::copy(samples.join("proxy_kvm2.yaml"), cwd.join("proxy.yaml")).unwrap();
                    // And the registry's credentials and CA.
                    registry
                        .write_docker_config(&cwd.join("registry-auth.json"))
                        .unwrap();
                    std::fs::copy(registry.ca_file(), cwd.join("registry-ca.pem")).unwrap();
                }
            }
            "rust" => {
                let lib = cwd.join("src/lib.rs");
                let text = std::fs::read_to_string(&lib).unwrap();
                let marker = "// Add devices here.\n";
                let at =
                    text.find(marker).expect("the marker line is in src/lib.rs") + marker.len();
                let indented: String = block
                    .body
                    .lines()
                    .map(|l| format!("        {l}\n"))
                    .collect();
                std::fs::write(&lib, format!("{}{indented}{}", &text[..at], &text[at..])).unwrap();
            }
            "yaml" if block.body.contains("<the url plugin push printed>") => {
                // The reader's edit: the domain entry of their providers config takes the
                // url `plugin push` printed and the block's other keys.
                let url = last_stdout
                    .lines()
                    .find_map(|l| l.strip_prefix("url: "))
                    .unwrap_or_else(|| panic!("plugin push printed no url: line:\n{last_stdout}"))
                    .to_string();
                assert!(
                    url.starts_with(&format!(
                        "oci://{}/plugins/my-domain:v1@sha256:",
                        registry.host()
                    )),
                    "{url}"
                );
                let entry = block.body.replace("<the url plugin push printed>", &url);
                let entry: serde_json::Value = serde_yaml_ng::from_str(&entry).unwrap();
                let path = cwd.join("providers-config.yaml");
                let mut config: serde_json::Value =
                    serde_yaml_ng::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
                let domain = config["kvm2"]["templates"]["domain"]
                    .as_object_mut()
                    .unwrap();
                domain.remove("path");
                for (k, v) in entry["kvm2"]["templates"]["domain"].as_object().unwrap() {
                    domain.insert(k.clone(), v.clone());
                }
                std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
            }
            "yaml" => {
                // The digest `sha256sum` printed goes into the entry, which must then be
                // a valid plugin entry of a providers config.
                let digest = last_stdout.split_whitespace().next().unwrap().to_string();
                let wasm =
                    std::fs::read(cwd.join("target/wasm32-wasip2/release/my_domain.wasm")).unwrap();
                assert_eq!(digest, integration_tests::sha256_hex(&wasm));
                let entry = block
                    .body
                    .replace("<the digest sha256sum printed>", &digest);
                let entry: serde_json::Value = serde_yaml_ng::from_str(&entry).unwrap();
                let sample = std::fs::read_to_string(
                    workspace_root().join("config/samples/providers-config.yaml"),
                )
                .unwrap();
                let mut config: serde_json::Value = serde_yaml_ng::from_str(&sample).unwrap();
                config["kvm2"]["templates"]["domain"] =
                    entry["kvm2"]["templates"]["domain"].clone();
                let text = serde_json::to_string(&config).unwrap();
                egress_operator::config::parse(&text, "walkthrough", Path::new("/"))
                    .unwrap_or_else(|e| panic!("the walkthrough's entry is refused: {e}"));
            }
            other => panic!("unexpected block language {other:?}"),
        }
        let first = block.body.lines().next().unwrap_or_default();
        timings.push((
            step + 1,
            block.lang.clone(),
            first.to_string(),
            started.elapsed(),
        ));
    }
    // Authoring time, step by step (printed for the record; machines differ too much to
    // assert on it).
    let total: Duration = timings.iter().map(|t| t.3).sum();
    for (step, lang, first, took) in &timings {
        eprintln!(
            "walkthrough step {step:2} ({lang:4}) {:>7.1}s  {first}",
            took.as_secs_f64()
        );
    }
    eprintln!("walkthrough total {:>7.1}s", total.as_secs_f64());
    // The edit is in every rendered case and in the Proxy rendered with the config.
    let snapshots: Vec<PathBuf> = std::fs::read_dir(cwd.join("snapshots"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(snapshots.len(), 10, "{snapshots:?}");
    for s in &snapshots {
        assert!(
            std::fs::read_to_string(s)
                .unwrap()
                .contains("<rng model=\"virtio\">")
        );
    }
    let rendered = std::fs::read_to_string(cwd.join("rendered/domain.xml")).unwrap();
    assert!(rendered.contains("<rng model=\"virtio\">"), "{rendered}");
    // The render that pulled the pushed plugin: the edit, and the second NIC its own
    // setting asked for.
    let pulled = std::fs::read_to_string(cwd.join("pulled/domain.xml")).unwrap();
    assert!(pulled.contains("<rng model=\"virtio\">"), "{pulled}");
    assert_eq!(
        pulled.matches("<interface type=\"bridge\">").count(),
        2,
        "{pulled}"
    );
    assert_eq!(last_stdout.lines().last(), Some("2"), "{last_stdout}");
}

/// `plugin push` and an `oci://` pull against a real registry (TLS with its own CA, basic
/// auth): wrong credentials, an untrusted certificate, an unknown digest and tampered
/// content are refused, each saying why; a pull by digest is recorded in the plugin cache,
/// so `validate-config --plugin-cache-dir` checks the plugin with the registry gone.
#[test]
fn an_oci_plugin_is_pushed_pulled_by_digest_verified_and_checked_offline() {
    if harness::skip(&[Need::Registry]) {
        return;
    }
    let registry = Registry::start("pusher", "right-pw").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).display().to_string();
    registry
        .write_docker_config(&dir.path().join("auth.json"))
        .unwrap();
    std::fs::write(
        p("wrong.json"),
        serde_json::json!({"auths": {registry.host(): {"username": "pusher", "password": "wrong"}}})
            .to_string(),
    )
    .unwrap();
    let ca = registry.ca_file().display().to_string();
    let wasm = plugin_path("domain-default").unwrap().display().to_string();
    let target = registry.reference("plugins/domain-default:v1");

    // Wrong password: refused by the registry, nothing published.
    let out = operator(&[
        "plugin",
        "push",
        &wasm,
        &target,
        "--credentials-file",
        &p("wrong.json"),
        "--ca-file",
        &ca,
    ]);
    assert_eq!(out.code, 1, "{}", out.stdout);
    assert!(
        out.stderr
            .contains(&format!("registry {}", registry.host())),
        "{}",
        out.stderr
    );
    assert!(!out.stderr.contains("wrong"), "{}", out.stderr);
    // Not a component: refused before the registry is asked.
    std::fs::write(p("core.wasm"), b"\0asm\x01\0\0\0").unwrap();
    let out = operator(&["plugin", "push", &p("core.wasm"), &target]);
    assert_eq!(out.code, 1);
    assert!(
        out.stderr.contains("core WebAssembly module"),
        "{}",
        out.stderr
    );

    let out = operator(&[
        "plugin",
        "push",
        &wasm,
        &target,
        "--credentials-file",
        &p("auth.json"),
        "--ca-file",
        &ca,
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let url = out
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("url: "))
        .unwrap()
        .to_string();
    let layer = integration_tests::sha256_hex(&std::fs::read(&wasm).unwrap());
    assert!(
        out.stdout.contains(&format!("wasm layer sha256:{layer}")),
        "{}",
        out.stdout
    );
    // The same component again: the same manifest digest.
    let again = operator(&[
        "plugin",
        "push",
        &wasm,
        &target,
        "--credentials-file",
        &p("auth.json"),
        "--ca-file",
        &ca,
    ]);
    assert!(
        again.stdout.contains(&format!("url: {url}")),
        "{}",
        again.stdout
    );

    let test = |reference: &str, extra: &[&str]| {
        let mut args = vec!["plugin", "test", reference];
        args.extend_from_slice(extra);
        operator(&args)
    };
    // No CA: the registry's certificate is not trusted.
    let out = test(&url, &["--credentials-file", &p("auth.json")]);
    assert_eq!(out.code, 1);
    assert!(out.stderr.contains("certificate"), "{}", out.stderr);
    // No credentials: the pull is anonymous, and this registry refuses it.
    let out = test(&url, &["--ca-file", &ca]);
    assert_eq!(out.code, 1);
    assert!(
        out.stderr.contains(&format!("cannot pull {url}")),
        "{}",
        out.stderr
    );
    // A digest the registry does not have.
    let unknown = format!("{}@sha256:{}", target, "0".repeat(64));
    let out = test(
        &unknown,
        &["--credentials-file", &p("auth.json"), "--ca-file", &ca],
    );
    assert_eq!(out.code, 1);
    assert!(out.stderr.contains("manifest unknown"), "{}", out.stderr);
    // Pulled, verified, tested, and recorded in the cache.
    let cache = p("cache");
    let out = test(
        &url,
        &[
            "--credentials-file",
            &p("auth.json"),
            "--ca-file",
            &ca,
            "--cache-dir",
            &cache,
        ],
    );
    assert_eq!(out.code, 0, "{}{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("0 failed"), "{}", out.stdout);

    // Tampered content in the registry's storage: the layer no longer matches the
    // manifest, and the pull says so instead of compiling it.
    let blob = registry.blob_path(&layer);
    let original = std::fs::read(&blob).unwrap();
    let mut tampered = original.clone();
    let last = tampered.len() - 1;
    tampered[last] ^= 0xff;
    std::fs::write(&blob, &tampered).unwrap();
    let out = test(
        &url,
        &["--credentials-file", &p("auth.json"), "--ca-file", &ca],
    );
    assert_eq!(out.code, 1);
    assert!(
        out.stderr.contains(&format!(
            "wasm layer digest mismatch: the manifest names sha256:{layer}"
        )),
        "{}",
        out.stderr
    );
    std::fs::write(&blob, &original).unwrap();

    // The config names the plugin by its oci:// url; the registry is gone.
    let config = p("providers-config.yaml");
    let sample =
        std::fs::read_to_string(workspace_root().join("config/samples/providers-config.yaml"))
            .unwrap();
    let entry = format!("url: {url}\n      credentialsFile: auth.json");
    std::fs::write(
        &config,
        sample.replace(
            "path: /usr/lib/egress-operator/plugins/domain-default.wasm",
            &entry,
        ),
    )
    .unwrap();
    drop(registry);
    let out = operator(&["validate-config", &config, "--plugin-cache-dir", &cache]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        !out.stderr.contains("kvm2.templates.domain: not checked"),
        "{}",
        out.stderr
    );
    let out = operator(&["validate-config", &config]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stderr.contains("cannot be pulled from here")
            && out.stderr.contains("no --plugin-cache-dir was given"),
        "{}",
        out.stderr
    );
}
