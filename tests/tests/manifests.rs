//! The deployment manifests in `config/` and the Dockerfile: the committed CRDs are the
//! generated ones, `kubectl kustomize config/default` renders a least-privilege, hardened
//! install whose pieces fit together, and the shipped providers config is valid.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use egress_operator::config;
use integration_tests::workspace_root;
use serde_json::{Value, json};

const NAMESPACE: &str = "egress-system";
const SERVICE_ACCOUNT: &str = "egress-operator";
const SSH_SECRET: &str = "egress-operator-ssh";
const NON_ROOT_ID: u64 = 65532;

fn config_dir() -> PathBuf {
    workspace_root().join("config")
}

/// The documents of a YAML stream, as JSON values (maps compare regardless of key
/// order). kustomize and `egress-operator crd` put `---` on a line of its own between
/// documents; inside block scalars a line is always indented, so this split is exact.
fn documents(text: &str) -> Vec<Value> {
    let mut docs = Vec::new();
    let mut current = String::new();
    let mut flush = |current: &mut String| {
        let doc: Value =
            serde_yaml_ng::from_str(current).unwrap_or_else(|e| panic!("not YAML: {e}\n{current}"));
        if !doc.is_null() {
            docs.push(doc);
        }
        current.clear();
    };
    for line in text.lines() {
        if line.trim_end() == "---" {
            flush(&mut current);
        } else {
            current.push_str(line);
            current.push('\n');
        }
    }
    flush(&mut current);
    docs
}

fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no string at {pointer} in {v:#}"))
}

fn name_of(v: &Value) -> String {
    str_at(v, "/metadata/name").to_string()
}

/// CRDs by name.
fn by_name(docs: impl IntoIterator<Item = Value>) -> BTreeMap<String, Value> {
    docs.into_iter().map(|d| (name_of(&d), d)).collect()
}

fn generated_crds() -> BTreeMap<String, Value> {
    let crds = by_name(documents(&egress_operator::api::crds_yaml().unwrap()));
    assert_eq!(
        crds.keys().collect::<Vec<_>>(),
        [
            "providerhealths.egress-operator.dev",
            "proxies.egress-operator.dev",
            "proxypools.egress-operator.dev"
        ]
    );
    crds
}

fn committed_crds() -> BTreeMap<String, Value> {
    let dir = config_dir().join("crd/bases");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let mut crds = BTreeMap::new();
    for file in files {
        let docs = documents(&std::fs::read_to_string(&file).unwrap());
        assert_eq!(docs.len(), 1, "{}: one CRD per file", file.display());
        let crd = docs.into_iter().next().unwrap();
        // kubebuilder's layout: GROUP_PLURAL.yaml.
        let want = format!(
            "{}_{}.yaml",
            str_at(&crd, "/spec/group"),
            str_at(&crd, "/spec/names/plural")
        );
        assert_eq!(file.file_name().unwrap().to_str().unwrap(), want);
        crds.insert(name_of(&crd), crd);
    }
    crds
}

/// Fails with the `make generate` hint and the names whose content differs.
fn assert_crds_current(found: &BTreeMap<String, Value>, what: &str) {
    let generated = generated_crds();
    let mut stale: Vec<&String> = generated
        .iter()
        .filter(|(name, crd)| found.get(*name) != Some(crd))
        .map(|(name, _)| name)
        .collect();
    stale.extend(found.keys().filter(|n| !generated.contains_key(*n)));
    assert!(
        stale.is_empty(),
        "config/crd is stale: run `make generate` ({what}: {stale:?} differ from `egress-operator crd`)"
    );
}

#[test]
fn committed_crds_are_the_generated_ones() {
    assert_crds_current(&committed_crds(), "config/crd/bases");
}

#[test]
fn a_changed_crd_is_reported_stale() {
    // The comparison sees a one-value change, a missing CRD and an extra one.
    let mut crds = committed_crds();
    *crds
        .get_mut("proxies.egress-operator.dev")
        .unwrap()
        .pointer_mut("/spec/names/shortNames/0")
        .unwrap() = json!("px");
    for broken in [
        crds,
        {
            let mut c = committed_crds();
            c.remove("providerhealths.egress-operator.dev");
            c
        },
        {
            let mut c = committed_crds();
            c.insert("extra.egress-operator.dev".into(), json!({}));
            c
        },
    ] {
        let panic = std::panic::catch_unwind(|| assert_crds_current(&broken, "test"))
            .expect_err("a stale CRD set must fail");
        let msg = panic.downcast_ref::<String>().unwrap();
        assert!(msg.contains("run `make generate`"), "{msg}");
    }
}

/// `kubectl kustomize config/default`, or `None` (with the reason printed) when kubectl
/// is not installed; `make test` installs it (`make setup`).
fn kustomize_default() -> Option<Vec<Value>> {
    let out = match Command::new("kubectl")
        .arg("kustomize")
        .arg(config_dir().join("default"))
        .output()
    {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            integration_tests::harness::cannot_run(
                "kubectl is not installed (`make setup` installs it)",
            );
            return None;
        }
        Err(e) => panic!("cannot run kubectl: {e}"),
    };
    assert!(
        out.status.success(),
        "kubectl kustomize config/default failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(documents(&String::from_utf8(out.stdout).unwrap()))
}

/// The one rendered object of that kind (and name).
fn object<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let found: Vec<&Value> = docs
        .iter()
        .filter(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .collect();
    assert_eq!(found.len(), 1, "want exactly one {kind} {name}");
    found[0]
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

#[test]
fn kustomize_renders_the_current_crds_and_labels_everything() {
    let Some(docs) = kustomize_default() else {
        return;
    };
    for d in &docs {
        assert_eq!(
            d["metadata"]["labels"]["app.kubernetes.io/name"], "egress-operator",
            "{} {} lacks the common label",
            d["kind"], d["metadata"]["name"]
        );
        // Namespaced objects land in the operator's namespace.
        let cluster_scoped = [
            "Namespace",
            "CustomResourceDefinition",
            "ClusterRole",
            "ClusterRoleBinding",
        ];
        if !cluster_scoped.contains(&d["kind"].as_str().unwrap()) {
            assert_eq!(d["metadata"]["namespace"], NAMESPACE, "{d:#}");
        }
    }
    let crds = by_name(
        of_kind(&docs, "CustomResourceDefinition")
            .into_iter()
            .map(|crd| {
                let mut crd = crd.clone();
                crd["metadata"]
                    .as_object_mut()
                    .unwrap()
                    .remove("labels")
                    .unwrap();
                crd
            }),
    );
    assert_crds_current(&crds, "kubectl kustomize config/default");
    object(&docs, "Namespace", NAMESPACE);
}

/// Every (apiGroup, resource, verb, resourceName) a set of RBAC rules grants; `*` where
/// a rule does not restrict names.
fn grants(rules: &Value) -> BTreeSet<(String, String, String, String)> {
    let mut out = BTreeSet::new();
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| a.iter().map(|s| s.as_str().unwrap().to_string()).collect())
            .unwrap_or_default()
    };
    for rule in rules.as_array().unwrap() {
        let names = match strings(&rule["resourceNames"]) {
            n if n.is_empty() => vec!["*".to_string()],
            n => n,
        };
        for field in ["apiGroups", "resources", "verbs"] {
            let values = strings(&rule[field]);
            assert!(!values.is_empty(), "rule without {field}: {rule}");
            assert!(
                !values.iter().any(|v| v.contains('*')),
                "wildcard in {field}: {rule}"
            );
        }
        assert!(rule.get("nonResourceURLs").is_none(), "{rule}");
        for g in strings(&rule["apiGroups"]) {
            for r in strings(&rule["resources"]) {
                for v in strings(&rule["verbs"]) {
                    for n in &names {
                        out.insert((g.clone(), r.clone(), v.clone(), n.clone()));
                    }
                }
            }
        }
    }
    out
}

fn expand(table: &[(&str, &str, &[&str], &str)]) -> BTreeSet<(String, String, String, String)> {
    let mut out = BTreeSet::new();
    for (group, resource, verbs, name) in table {
        for verb in *verbs {
            out.insert((
                group.to_string(),
                resource.to_string(),
                verb.to_string(),
                name.to_string(),
            ));
        }
    }
    out
}

fn assert_bound_to_service_account(binding: &Value, kind: &str, role: &str) {
    assert_eq!(
        binding["roleRef"],
        json!({"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": role})
    );
    assert_eq!(
        binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}])
    );
}

#[test]
fn rbac_is_least_privilege() {
    let Some(docs) = kustomize_default() else {
        return;
    };
    const G: &str = "egress-operator.dev";
    let want = expand(&[
        (
            G,
            "proxies",
            &["get", "list", "watch", "patch", "update"],
            "*",
        ),
        (G, "proxies/status", &["get", "patch"], "*"),
        (G, "proxies/finalizers", &["update"], "*"),
        (
            G,
            "providerhealths",
            &["get", "list", "watch", "create", "patch"],
            "*",
        ),
        (G, "providerhealths/status", &["get", "patch"], "*"),
        // user-data is read by name at create time: no list, no watch.
        ("", "secrets", &["get"], "*"),
        ("events.k8s.io", "events", &["create", "patch"], "*"),
    ]);
    let cluster_roles = of_kind(&docs, "ClusterRole");
    assert_eq!(cluster_roles.len(), 1);
    assert!(cluster_roles[0].get("aggregationRule").is_none());
    assert_eq!(grants(&cluster_roles[0]["rules"]), want);

    // Leader election: only the Lease `egress-operator`, only in the operator's namespace.
    let roles = of_kind(&docs, "Role");
    assert_eq!(roles.len(), 1);
    let lease = "coordination.k8s.io";
    let want_role = expand(&[
        (lease, "leases", &["create"], "*"),
        (
            lease,
            "leases",
            &["get", "update", "patch"],
            "egress-operator",
        ),
    ]);
    assert_eq!(grants(&roles[0]["rules"]), want_role);
    assert_eq!(roles[0]["metadata"]["namespace"], NAMESPACE);

    let crb = of_kind(&docs, "ClusterRoleBinding");
    assert_eq!(crb.len(), 1);
    assert_bound_to_service_account(crb[0], "ClusterRole", &name_of(cluster_roles[0]));
    let rb = of_kind(&docs, "RoleBinding");
    assert_eq!(rb.len(), 1);
    assert_bound_to_service_account(rb[0], "Role", &name_of(roles[0]));
    object(&docs, "ServiceAccount", SERVICE_ACCOUNT);
}

#[test]
fn grants_sees_wildcards_and_extra_verbs() {
    // The RBAC check itself can fail: a wildcard panics, an extra verb changes the set.
    let rules = json!([{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list"]}]);
    assert_ne!(
        grants(&rules),
        expand(&[("", "secrets", &["get"], "*")]),
        "an extra verb must show"
    );
    let wild = json!([{"apiGroups": [""], "resources": ["*"], "verbs": ["get"]}]);
    assert!(std::panic::catch_unwind(|| grants(&wild)).is_err());
}

/// The value after `flag` in a container's args.
fn arg<'a>(args: &'a [Value], flag: &str) -> &'a str {
    let i = args
        .iter()
        .position(|a| a == flag)
        .unwrap_or_else(|| panic!("no {flag} in {args:?}"));
    args[i + 1].as_str().unwrap()
}

/// The volume mounted at the longest mount path that contains `path`, and that mount.
fn mount_for<'a>(pod: &'a Value, container: &'a Value, path: &str) -> (&'a Value, &'a Value) {
    let mount = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| Path::new(path).starts_with(str_at(m, "/mountPath")))
        .max_by_key(|m| str_at(m, "/mountPath").len())
        .unwrap_or_else(|| panic!("{path} is on no volume mount"));
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap_or_else(|| panic!("no volume for mount {mount}"));
    (mount, volume)
}

#[test]
fn deployment_is_hardened_and_its_pieces_fit() {
    let Some(docs) = kustomize_default() else {
        return;
    };
    let deployment = object(&docs, "Deployment", "egress-operator");
    assert_eq!(
        deployment["spec"]["replicas"], 2,
        "leader election needs a standby"
    );
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], SERVICE_ACCOUNT);
    assert_eq!(pod["automountServiceAccountToken"], true);
    assert_eq!(pod["terminationGracePeriodSeconds"], 120);
    let pod_sc = &pod["securityContext"];
    assert_eq!(pod_sc["runAsNonRoot"], true);
    assert_eq!(pod_sc["runAsUser"], NON_ROOT_ID);
    assert_eq!(pod_sc["runAsGroup"], NON_ROOT_ID);
    assert_eq!(pod_sc["fsGroup"], NON_ROOT_ID);
    assert_eq!(pod_sc["seccompProfile"]["type"], "RuntimeDefault");

    let containers = pod["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 1);
    let c = &containers[0];
    let sc = &c["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    assert!(sc.get("privileged").is_none_or(|p| p == false));
    assert!(sc.get("runAsUser").is_none_or(|u| u == NON_ROOT_ID));
    assert!(sc.get("runAsNonRoot").is_none_or(|u| u == true));
    for kind in ["requests", "limits"] {
        for resource in ["cpu", "memory"] {
            assert!(
                c["resources"][kind][resource].is_string(),
                "{kind}.{resource}"
            );
        }
    }

    let env: BTreeMap<&str, &str> = c["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| {
            Some((
                e["name"].as_str()?,
                e["valueFrom"]["fieldRef"]["fieldPath"].as_str()?,
            ))
        })
        .collect();
    assert_eq!(env.get("POD_NAME"), Some(&"metadata.name"));
    assert_eq!(env.get("POD_NAMESPACE"), Some(&"metadata.namespace"));

    // The HTTP server, its port and the probes agree.
    let args = c["args"].as_array().unwrap();
    assert_eq!(args[0], "run");
    assert_eq!(arg(args, "--log-format"), "json");
    let http_port: u64 = arg(args, "--http-addr")
        .rsplit_once(':')
        .unwrap()
        .1
        .parse()
        .unwrap();
    let ports = c["ports"].as_array().unwrap();
    let http = ports.iter().find(|p| p["name"] == "http").unwrap();
    assert_eq!(http["containerPort"], http_port);
    for (probe, path) in [
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ] {
        let get = &c[probe]["httpGet"];
        assert_eq!(get["path"], path, "{probe}");
        assert!(get["port"] == "http" || get["port"] == http_port, "{probe}");
    }
    // A slow start is not killed by the liveness probe: the startup probe, which holds
    // the liveness probe back until it passes, allows at least this long.
    const MIN_STARTUP_SECONDS: u64 = 60;
    let budget = |probe: &str| {
        c[probe]["periodSeconds"].as_u64().unwrap_or(10)
            * c[probe]["failureThreshold"].as_u64().unwrap_or(3)
    };
    assert!(
        budget("startupProbe") >= MIN_STARTUP_SECONDS,
        "startupProbe allows {}s",
        budget("startupProbe")
    );

    // --config is a key of the rendered ConfigMap, mounted read-only.
    let config_path = arg(args, "--config");
    let (mount, volume) = mount_for(pod, c, config_path);
    let configmap = object(&docs, "ConfigMap", str_at(volume, "/configMap/name"));
    let key = Path::new(config_path)
        .strip_prefix(str_at(mount, "/mountPath"))
        .unwrap()
        .to_str()
        .unwrap();
    let text = str_at(configmap, &format!("/data/{key}"));
    assert_eq!(
        text,
        std::fs::read_to_string(config_dir().join("manager/config.yaml")).unwrap(),
        "the ConfigMap holds config/manager/config.yaml"
    );
    let cfg = config::parse(text, "ConfigMap", Path::new("/")).unwrap();

    // The SSH files the config names are keys of the Secret mount: read-only, 0400.
    let (mount, volume) = mount_for(pod, c, &cfg.kvm2.ssh.private_key_file);
    assert_eq!(mount["readOnly"], true);
    let secret = &volume["secret"];
    assert_eq!(secret["secretName"], SSH_SECRET);
    assert_eq!(secret["defaultMode"], 0o400);
    let items: BTreeMap<&str, &str> = secret["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| (str_at(i, "/key"), str_at(i, "/path")))
        .collect();
    assert_eq!(
        items,
        BTreeMap::from([("id_ed25519", "id_ed25519"), ("known_hosts", "known_hosts")])
    );
    for file in [
        &cfg.kvm2.ssh.private_key_file,
        &cfg.kvm2.ssh.known_hosts_file,
    ] {
        let (m, v) = mount_for(pod, c, file);
        assert_eq!(
            (m, v),
            (mount, volume),
            "{file} is not on the SSH Secret mount"
        );
        let rel = Path::new(file)
            .strip_prefix(str_at(m, "/mountPath"))
            .unwrap();
        assert!(
            items.values().any(|p| Path::new(p) == rel),
            "{file} is not an item of the Secret"
        );
    }

    // Writable places are emptyDirs: the plugin cache and /tmp.
    for path in [arg(args, "--plugin-cache-dir"), "/tmp"] {
        let (mount, volume) = mount_for(pod, c, path);
        assert!(volume["emptyDir"].is_object(), "{path} is not an emptyDir");
        assert!(mount.get("readOnly").is_none_or(|r| r == false));
    }
    // The kubelet makes an emptyDir root-owned and world-writable, which the operator
    // refuses for its cache of native code: the cache is a directory below the mount
    // that the operator creates itself (0700).
    let cache = arg(args, "--plugin-cache-dir");
    let (mount, _) = mount_for(pod, c, cache);
    assert_ne!(
        Path::new(str_at(mount, "/mountPath")),
        Path::new(cache),
        "--plugin-cache-dir must be below its emptyDir mount, not the mount itself"
    );
}

#[test]
fn shipped_config_is_valid_and_the_sample_proxy_fits_it() {
    // Validation needs no files: paths are checked for form (absolute, normalised), not
    // existence, so the key and plugin paths of the image can be checked here as written.
    let path = config_dir().join("manager/config.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let cfg = config::parse(
        &text,
        "config/manager/config.yaml",
        Path::new("/nonexistent"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        cfg.kvm2.ssh.private_key_file,
        "/etc/egress-operator/ssh/id_ed25519"
    );
    assert_eq!(
        cfg.kvm2.ssh.known_hosts_file,
        "/etc/egress-operator/ssh/known_hosts"
    );
    let plugins: Vec<&str> = [&cfg.kvm2.templates.domain, &cfg.kvm2.templates.vendor_data]
        .iter()
        .map(|t| t.path.as_deref().unwrap())
        .collect();
    assert_eq!(
        plugins,
        [
            "/usr/lib/egress-operator/plugins/domain-default.wasm",
            "/usr/lib/egress-operator/plugins/vendor-data-default.wasm"
        ]
    );

    // Editors check it against the committed schema: it must agree.
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(config_dir().join("schema/providers-config.schema.json")).unwrap(),
    )
    .unwrap();
    let doc: Value = serde_yaml_ng::from_str(&text).unwrap();
    let errors: Vec<String> = jsonschema::validator_for(&schema)
        .unwrap()
        .iter_errors(&doc)
        .map(|e| e.to_string())
        .collect();
    assert!(errors.is_empty(), "{errors:#?}");

    // A broken copy is refused, so the check above means something.
    let broken = text.replace("bridge: br-egress", "bridge: \"br egress\"");
    assert_ne!(broken, text);
    assert!(config::parse(&broken, "broken", Path::new("/")).is_err());

    // The sample Proxy fits this config and the CRD's schema, and its user-data Secret
    // is the one it names.
    let sample = config_dir().join("samples/proxy_kvm2.yaml");
    let proxy =
        egress_operator::api::proxy::load_manifest(&sample, &cfg).unwrap_or_else(|e| panic!("{e}"));
    let proxy_doc: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(&sample).unwrap()).unwrap();
    let crd = &generated_crds()["proxies.egress-operator.dev"];
    let version = &crd["spec"]["versions"][0];
    assert_eq!(
        format!(
            "{}/{}",
            crd["spec"]["group"].as_str().unwrap(),
            version["name"].as_str().unwrap()
        ),
        proxy.api_version
    );
    let crd_schema = &version["schema"]["openAPIV3Schema"];
    let validator = jsonschema::validator_for(crd_schema).unwrap();
    let errors: Vec<String> = validator
        .iter_errors(&proxy_doc)
        .map(|e| e.to_string())
        .collect();
    assert!(errors.is_empty(), "{errors:#?}");
    let mut bad = proxy_doc.clone();
    bad["spec"]["provider"] = json!("kvm3");
    assert!(
        !validator.is_valid(&bad),
        "the CRD schema must refuse provider kvm3"
    );

    let secret: Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(config_dir().join("samples/proxy_kvm2_user-data.yaml")).unwrap(),
    )
    .unwrap();
    let reference = &proxy_doc["spec"]["userData"]["secretRef"];
    assert_eq!(secret["kind"], "Secret");
    assert_eq!(secret["metadata"]["name"], reference["name"]);
    assert_eq!(
        secret["metadata"]["namespace"],
        proxy_doc["metadata"]["namespace"]
    );
    let user_data = str_at(
        &secret,
        &format!("/stringData/{}", str_at(reference, "/key")),
    );
    assert!(user_data.starts_with("#cloud-config\n"), "{user_data}");
}

#[test]
fn ssh_secret_example_has_the_mounted_keys_and_no_key_material() {
    let text = std::fs::read_to_string(config_dir().join("samples/ssh-secret.yaml")).unwrap();
    let secret: Value = serde_yaml_ng::from_str(&text).unwrap();
    assert_eq!(secret["kind"], "Secret");
    assert_eq!(secret["metadata"]["name"], SSH_SECRET);
    assert_eq!(secret["metadata"]["namespace"], NAMESPACE);
    let keys: Vec<&String> = secret["stringData"].as_object().unwrap().keys().collect();
    assert_eq!(keys, ["id_ed25519", "known_hosts"]);
    for value in secret["stringData"].as_object().unwrap().values() {
        assert!(value.as_str().unwrap().contains("REPLACE-ME"), "{value}");
    }
    // Not a parseable key: at most the armour lines around a placeholder.
    let key = str_at(&secret, "/stringData/id_ed25519");
    assert!(
        key.lines()
            .all(|l| l.starts_with("-----") || l.contains("REPLACE-ME")),
        "{key}"
    );
}

/// The instruction lines of the Dockerfile (continuations joined).
fn dockerfile() -> Vec<String> {
    let text = std::fs::read_to_string(workspace_root().join("Dockerfile")).unwrap();
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(part) => {
                current.push_str(part);
                current.push(' ');
            }
            None => {
                current.push_str(line);
                out.push(std::mem::take(&mut current));
            }
        }
    }
    out
}

#[test]
fn dockerfile_ships_what_the_manifests_expect() {
    let lines = dockerfile();
    let has = |want: &str| lines.iter().any(|l| l == want);
    let froms: Vec<&String> = lines.iter().filter(|l| l.starts_with("FROM ")).collect();
    assert_eq!(froms.len(), 2, "multi-stage: {froms:?}");
    assert!(froms[1].starts_with("FROM debian:12-slim"), "{froms:?}");
    assert!(has(r#"ENTRYPOINT ["/usr/local/bin/egress-operator"]"#));
    assert!(
        has(&format!("USER {NON_ROOT_ID}:{NON_ROOT_ID}")),
        "runs as the Deployment's user"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("rustup target add wasm32-wasip2"))
    );
    let runtime_install = lines
        .iter()
        .skip_while(|l| !l.starts_with("FROM debian:12-slim"))
        .find(|l| l.contains("apt-get install"))
        .unwrap();
    for pkg in ["libvirt0", "ca-certificates"] {
        assert!(
            runtime_install.split_whitespace().any(|w| w == pkg),
            "{pkg}"
        );
    }

    // Every plugin the shipped config names is built and copied to that path, under the
    // file name `make plugins` uses (the crate name with '-' for '_').
    let cfg = config::parse(
        &std::fs::read_to_string(config_dir().join("manager/config.yaml")).unwrap(),
        "config/manager/config.yaml",
        Path::new("/"),
    )
    .unwrap();
    let build = lines
        .iter()
        .find(|l| l.contains("--target wasm32-wasip2"))
        .unwrap();
    assert!(has(
        "COPY --from=build /out/plugins/ /usr/lib/egress-operator/plugins/"
    ));
    assert!(has(
        "COPY --from=build /out/egress-operator /usr/local/bin/egress-operator"
    ));
    for t in [&cfg.kvm2.templates.domain, &cfg.kvm2.templates.vendor_data] {
        let path = Path::new(t.path.as_deref().unwrap());
        assert_eq!(
            path.parent().unwrap(),
            Path::new("/usr/lib/egress-operator/plugins")
        );
        let file = path.file_name().unwrap().to_str().unwrap();
        let krate = file.strip_suffix(".wasm").unwrap();
        assert!(
            build.contains(&format!("-p {krate}")),
            "{krate} is not built"
        );
        let copy = format!(
            "cp target/wasm32-wasip2/release/{}.wasm /out/plugins/{file}",
            krate.replace('-', "_")
        );
        assert!(build.contains(&copy), "missing: {copy}");
        assert!(
            workspace_root()
                .join("plugins")
                .join(krate)
                .join("Cargo.toml")
                .exists(),
            "no plugin crate {krate}"
        );
    }
    let ignore = std::fs::read_to_string(workspace_root().join(".dockerignore")).unwrap();
    assert!(ignore.lines().any(|l| l.trim() == "target/"));
}
