//! The deployment manifests in `config/` and the Dockerfile: the committed CRDs are the
//! generated ones, `kubectl kustomize config/default` renders a least-privilege, hardened
//! install whose pieces fit together, and the shipped providers config is valid.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

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
            "proxyleases.egress-operator.dev",
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

/// `v` with every integral float written as an integer: the CRD types hold schema bounds
/// as `f64` (`maximum: 3600.0`), and kustomize re-encodes them as `3600`; both mean the
/// same to the API server.
fn normalized(v: &Value) -> Value {
    match v {
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() < 9.0e15 => json!(f as i64),
            _ => v.clone(),
        },
        Value::Array(a) => Value::Array(a.iter().map(normalized).collect()),
        Value::Object(o) => {
            Value::Object(o.iter().map(|(k, v)| (k.clone(), normalized(v))).collect())
        }
        _ => v.clone(),
    }
}

/// Fails with the `make generate` hint and the names whose content differs.
fn assert_crds_current(found: &BTreeMap<String, Value>, what: &str) {
    let generated = generated_crds();
    let mut stale: Vec<&String> = generated
        .iter()
        .filter(|(name, crd)| found.get(*name).map(normalized) != Some(normalized(crd)))
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

/// `kubectl kustomize config/default`, with the kubectl built beside the test control plane
/// (`scripts/controlplane.sh`), so its kustomize is the one that version ships.
fn kustomize_default() -> Option<Vec<Value>> {
    Some(documents(&kustomize(&config_dir().join("default"))))
}

/// `kubectl kustomize DIR`; fails on an error and on any warning (a deprecated field today
/// is a refused one in a later kustomize).
fn kustomize(dir: &std::path::Path) -> String {
    let kubectl = integration_tests::harness::controlplane::binaries_dir()
        .unwrap_or_else(|e| panic!("{e:#}"))
        .join("kubectl");
    let out = Command::new(&kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", kubectl.display()));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "kubectl kustomize {} failed: {stderr}",
        dir.display()
    );
    assert!(
        stderr.trim().is_empty(),
        "kubectl kustomize {} warned:\n{stderr}",
        dir.display()
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn every_kustomization_renders_without_warnings() {
    let mut rendered = Vec::new();
    let mut stack = vec![config_dir()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            }
        }
        let k = dir.join("kustomization.yaml");
        let Ok(text) = std::fs::read_to_string(&k) else {
            continue;
        };
        // A Component renders only inside an overlay (config/monitoring holds this one).
        if text.contains("kind: Component") {
            continue;
        }
        kustomize(&dir);
        rendered.push(
            dir.strip_prefix(config_dir())
                .unwrap()
                .display()
                .to_string(),
        );
    }
    rendered.sort();
    for want in ["default", "monitoring"] {
        assert!(rendered.iter().any(|r| r == want), "{rendered:?}");
    }
}

#[test]
fn the_monitoring_overlay_adds_the_component_in_the_operators_namespace() {
    let docs = documents(&kustomize(&config_dir().join("monitoring")));
    let default = kustomize_default().unwrap();
    assert_eq!(
        docs.len(),
        default.len() + 3,
        "config/default, a PodMonitor, a PrometheusRule and the dashboard ConfigMap"
    );
    let monitor = object(&docs, "PodMonitor", "egress-operator");
    assert_eq!(monitor["metadata"]["namespace"], NAMESPACE);
    assert_eq!(
        monitor["spec"]["podMetricsEndpoints"][0]["honorLabels"],
        true
    );
    // The PodMonitor selects the Deployment's pods.
    let deployment = object(&docs, "Deployment", "egress-operator");
    let pod_labels = &deployment["spec"]["template"]["metadata"]["labels"];
    for (k, v) in monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .unwrap()
    {
        assert_eq!(
            &pod_labels[k], v,
            "the PodMonitor selects {k}={v}, the pods do not carry it"
        );
    }
    let port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
        .as_str()
        .unwrap();
    let ports = deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
        .as_array()
        .unwrap();
    assert!(
        ports.iter().any(|p| p["name"] == port),
        "no container port {port}"
    );
    let rule = object(&docs, "PrometheusRule", "egress-operator");
    assert_eq!(rule["metadata"]["namespace"], NAMESPACE);
    let dashboard = object(&docs, "ConfigMap", "egress-operator-dashboard");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let json = dashboard["data"]["egress-operator.json"].as_str().unwrap();
    let parsed: Value = serde_json::from_str(json).unwrap();
    assert_eq!(parsed["uid"], "egress-operator-fleet");
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
    // Which verbs: `rbac_grants_exactly_the_calls_the_code_makes` derives them from the
    // code. Here: kustomize renders the rules of config/rbac unchanged, one ClusterRole
    // and one Role (the Lease's, in the operator's namespace).
    let shipped = shipped_rules();
    let cluster_roles = of_kind(&docs, "ClusterRole");
    assert_eq!(cluster_roles.len(), 1);
    assert!(cluster_roles[0].get("aggregationRule").is_none());
    let roles = of_kind(&docs, "Role");
    assert_eq!(roles.len(), 1);
    assert_eq!(roles[0]["metadata"]["namespace"], NAMESPACE);
    let mut rendered = vec![
        (None, grants(&cluster_roles[0]["rules"])),
        (Some(NAMESPACE.to_string()), grants(&roles[0]["rules"])),
    ];
    let mut shipped = shipped;
    rendered.sort();
    shipped.sort();
    assert_eq!(rendered, shipped);

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
    // build (compiles), prebuilt (the host's binaries: scripts/operator-image.sh), binaries
    // (the one BINARIES picks, `build` by default) and the runtime stage users get.
    assert_eq!(
        froms.iter().map(|f| f.as_str()).collect::<Vec<_>>(),
        [
            "FROM rust:1.95-bookworm AS build",
            "FROM scratch AS prebuilt",
            "FROM ${BINARIES} AS binaries",
            "FROM debian:12-slim",
        ],
        "stages"
    );
    assert!(
        has("ARG BINARIES=build"),
        "compiled in the image by default"
    );
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
        "COPY --from=binaries /out/plugins/ /usr/lib/egress-operator/plugins/"
    ));
    assert!(has(
        "COPY --from=binaries /out/egress-operator /usr/local/bin/egress-operator"
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

// ---- RBAC against the calls the code makes ----------------------------------------------

/// One API request, as RBAC sees it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Call {
    group: String,
    /// `resource` or `resource/subresource`.
    resource: String,
    verb: String,
    namespace: Option<String>,
    name: Option<String>,
}

/// What the recording API server saw and holds.
#[derive(Default)]
struct Recorded {
    calls: Vec<Call>,
    /// Objects by path (without query), as last written.
    objects: BTreeMap<String, Value>,
    version: u64,
}

/// RBAC's view of a request: group, resource (with subresource), verb, namespace, name.
/// A patch that creates its object (server-side apply) is also a `create`, as the API
/// server authorises it.
fn call_of(method: &str, path: &str, query: &str) -> Call {
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (group, rest) = match segs.as_slice() {
        ["api", _v, rest @ ..] => (String::new(), rest.to_vec()),
        ["apis", g, _v, rest @ ..] => (g.to_string(), rest.to_vec()),
        _ => panic!("not a resource path: {path}"),
    };
    let (namespace, rest) = match rest.as_slice() {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(ns.to_string()), rest.to_vec()),
        _ => (None, rest),
    };
    let (resource, name) = match rest.as_slice() {
        [r] => (r.to_string(), None),
        [r, n] => (r.to_string(), Some(n.to_string())),
        [r, n, sub] => (format!("{r}/{sub}"), Some(n.to_string())),
        _ => panic!("unexpected path {path}"),
    };
    let watch = query
        .split('&')
        .any(|kv| kv == "watch=true" || kv == "watch=1");
    let verb = match (method, name.is_some()) {
        ("GET", true) => "get",
        ("GET", false) if watch => "watch",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", _) => "delete",
        _ => panic!("unexpected method {method} {path}"),
    };
    Call {
        group,
        resource,
        verb: verb.to_string(),
        namespace,
        name,
    }
}

/// A tiny API server on loopback: records every request as a [`Call`] and answers like
/// a real one for the objects the operator touches (a missing object is a 404; a write
/// stores the object; a watch ends at once; a `create` of something present is a 409).
async fn recording_api(seed: Vec<(String, Value)>) -> (kube::Client, Arc<Mutex<Recorded>>) {
    use axum::body::Bytes;
    use axum::http::{Method, StatusCode, Uri};
    use axum::response::IntoResponse;

    let state = Arc::new(Mutex::new(Recorded {
        objects: seed.into_iter().collect(),
        ..Recorded::default()
    }));
    let shared = Arc::clone(&state);
    let app = axum::Router::new().fallback(move |method: Method, uri: Uri, body: Bytes| {
        let state = Arc::clone(&shared);
        async move {
            let path = uri.path().to_string();
            let query = uri.query().unwrap_or_default().to_string();
            let call = call_of(method.as_str(), &path, &query);
            let mut s = state.lock().unwrap();
            s.version += 1;
            let version = s.version.to_string();
            let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let json = |code: StatusCode, v: Value| {
                (code, [("content-type", "application/json")], v.to_string()).into_response()
            };
            let not_found = || {
                json(
                    StatusCode::NOT_FOUND,
                    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                           "reason": "NotFound", "code": 404, "message": "not found"}),
                )
            };
            // The object a request is about (a subresource acts on its parent).
            let object_path = match &call.name {
                Some(_) if call.resource.contains('/') => {
                    path.rsplit_once('/').map(|(p, _)| p.to_string()).unwrap()
                }
                _ => path.clone(),
            };
            let response = match call.verb.as_str() {
                "get" => match s.objects.get(&object_path) {
                    Some(o) => json(StatusCode::OK, o.clone()),
                    None => not_found(),
                },
                "list" => {
                    let prefix = format!("{path}/");
                    let items: Vec<Value> = s
                        .objects
                        .iter()
                        .filter(|(p, _)| {
                            p.starts_with(&prefix) || p.contains(&format!("/{}/", call.resource))
                        })
                        .map(|(_, o)| o.clone())
                        .collect();
                    json(
                        StatusCode::OK,
                        json!({"kind": "List", "apiVersion": "v1",
                               "metadata": {"resourceVersion": version}, "items": items}),
                    )
                }
                // A watch that ends at once, with no event.
                "watch" => (StatusCode::OK, String::new()).into_response(),
                "create" => {
                    let name = body["metadata"]["name"].as_str().unwrap_or("created");
                    let p = format!("{path}/{name}");
                    match s.objects.entry(p) {
                        std::collections::btree_map::Entry::Occupied(_) => json(
                            StatusCode::CONFLICT,
                            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                   "reason": "AlreadyExists", "code": 409, "message": "exists"}),
                        ),
                        std::collections::btree_map::Entry::Vacant(slot) => {
                            let mut o = body.clone();
                            o["metadata"]["resourceVersion"] = json!(version);
                            o["metadata"]["uid"] = json!(format!("uid-{version}"));
                            slot.insert(o.clone());
                            json(StatusCode::CREATED, o)
                        }
                    }
                }
                "update" | "patch" => {
                    let existing = s.objects.get(&object_path).cloned();
                    let apply = query.contains("fieldManager") && body.is_object();
                    let mut o = match (existing, apply) {
                        (Some(o), _) => o,
                        // Server-side apply creates a missing object: RBAC `create` too.
                        (None, true) => {
                            s.calls.push(Call {
                                verb: "create".into(),
                                ..call.clone()
                            });
                            body.clone()
                        }
                        (None, false) => {
                            s.calls.push(call);
                            return not_found();
                        }
                    };
                    if call.verb == "update" {
                        o = body.clone();
                    } else if let (Some(obj), Some(patch)) = (o.as_object_mut(), body.as_object()) {
                        for (k, v) in patch {
                            if k != "metadata" {
                                obj.insert(k.clone(), v.clone());
                            }
                        }
                    }
                    o["metadata"]["resourceVersion"] = json!(version);
                    s.objects.insert(object_path.clone(), o.clone());
                    json(StatusCode::OK, o)
                }
                _ => not_found(),
            };
            s.calls.push(call);
            response
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
    (kube::Client::try_from(config).unwrap(), state)
}

/// Every proxy the controller probes answers `200 Connection established`, in memory.
struct Answers;

impl egress_operator::serving::Dialer for Answers {
    fn dial(
        &self,
        _: std::net::SocketAddr,
    ) -> egress_operator::serving::BoxFuture<
        '_,
        std::io::Result<Box<dyn egress_operator::serving::ProbeStream>>,
    > {
        Box::pin(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let (client, mut proxy) = tokio::io::duplex(4096);
            tokio::spawn(async move {
                let mut head = [0u8; 512];
                let _ = proxy.read(&mut head).await;
                let _ = proxy
                    .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    .await;
                let mut rest = Vec::new();
                let _ = proxy.read_to_end(&mut rest).await;
            });
            Ok(Box::new(client) as Box<dyn egress_operator::serving::ProbeStream>)
        })
    }
}

const RBAC_TEST_CONFIG: &str = r#"
clusterId: test
kvm2:
  ssh: {user: egress, privateKeyFile: /k/id, knownHostsFile: /k/known_hosts}
  hosts:
    - {name: h1, address: "127.0.0.1:2222", storagePool: default, bridge: br0}
  images:
    - name: debian
      url: https://images.example.org/debian.qcow2
      sha256: "0000000000000000000000000000000000000000000000000000000000000000"
      format: qcow2
  machineTypes:
    - {name: small, vcpus: 1, memoryMiB: 512, diskGiB: 4}
  defaults: {machineType: small, image: debian}
  templates:
    domain: {path: /p/domain.wasm}
    vendorData: {path: /p/vendor-data.wasm}
"#;

/// Runs the operator's own Kubernetes code paths (the controller's watch, a Proxy's
/// create and delete with user-data and events, the garbage collector's index, the
/// health sink, the leader elector) against the recording API server; returns every call.
async fn calls_the_code_makes() -> Vec<Call> {
    use egress_operator::api::proxy::{Proxy, ProxySpec, SecretKeyRef, UserDataSource};
    use egress_operator::api::proxy_pool::{POOL_LABEL, TEMPLATE_HASH_LABEL};
    use egress_operator::controller::{self, Context, ControllerMetrics};
    use egress_operator::fleet::liveness::{Liveness, LivenessOptions};
    use egress_operator::fleet::pool::FleetContext;
    use egress_operator::fleet::{FleetMetrics, LivenessBoard};
    use egress_operator::gc::{KubeProxyIndex, ProxyIndex};
    use egress_operator::leader::{LeaderElector, LeaderOptions};
    use egress_operator::providerhealth::{HealthSink, KubeSink};
    use futures_util::StreamExt;
    use kube::runtime::events::{Event, EventType};
    use kube::{Resource, ResourceExt};

    const NS: &str = "team";
    let proxy_path = format!("/apis/egress-operator.dev/v1alpha1/namespaces/{NS}/proxies/p");
    let mut proxy = Proxy::new(
        "p",
        ProxySpec {
            provider: "kvm2".into(),
            user_data: Some(UserDataSource {
                secret_ref: SecretKeyRef {
                    name: "ud".into(),
                    key: "user-data".into(),
                },
            }),
            ..Default::default()
        },
    );
    proxy.metadata.namespace = Some(NS.into());
    proxy.metadata.uid = Some("uid-p".into());
    proxy.metadata.generation = Some(1);
    proxy.metadata.resource_version = Some("1".into());
    let secret = json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "ud", "namespace": NS,
                     "labels": {controller::USER_DATA_LABEL: "true"}},
        "data": {"user-data": "I2Nsb3VkLWNvbmZpZwo="},
    });
    // A pool of one with two Proxies from an older template that do not serve: the pool
    // controller creates a new one and deletes one of the old ones at once.
    let pool_base = format!("/apis/egress-operator.dev/v1alpha1/namespaces/{NS}");
    let pool = json!({
        "apiVersion": "egress-operator.dev/v1alpha1", "kind": "ProxyPool",
        "metadata": {"name": "office", "namespace": NS, "uid": "uid-pool", "generation": 1,
                     "resourceVersion": "1"},
        "spec": {"replicas": 1, "template": {"provider": "kvm2"}},
    });
    let old_member = |name: &str| {
        json!({
            "apiVersion": "egress-operator.dev/v1alpha1", "kind": "Proxy",
            "metadata": {"name": name, "namespace": NS, "uid": format!("uid-{name}"),
                         "resourceVersion": "1", "creationTimestamp": "2026-01-01T00:00:00Z",
                         "labels": {POOL_LABEL: "office", TEMPLATE_HASH_LABEL: "0000000000"},
                         "ownerReferences": [{"apiVersion": "egress-operator.dev/v1alpha1",
                                              "kind": "ProxyPool", "name": "office",
                                              "uid": "uid-pool", "controller": true}]},
            "spec": {"provider": "kvm2", "host": "h1"},
        })
    };
    let (client, recorded) = recording_api(vec![
        (proxy_path.clone(), serde_json::to_value(&proxy).unwrap()),
        (format!("/api/v1/namespaces/{NS}/secrets/ud"), secret),
        (
            "/api/v1/namespaces/kube-system".to_string(),
            json!({"apiVersion": "v1", "kind": "Namespace",
                   "metadata": {"name": "kube-system",
                                "uid": "0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887"}}),
        ),
        (format!("{pool_base}/proxypools/office"), pool),
        (
            format!("{pool_base}/proxies/office-a"),
            old_member("office-a"),
        ),
        (
            format!("{pool_base}/proxies/office-b"),
            old_member("office-b"),
        ),
        // A slice a scale-in left over: discovery deletes it.
        (
            format!("/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices/office-ipv4-1"),
            json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": "office-ipv4-1", "namespace": NS, "uid": "uid-surplus",
                             "resourceVersion": "1",
                             "labels": {"kubernetes.io/service-name": "office",
                                        "endpointslice.kubernetes.io/managed-by":
                                            "discovery.egress-operator.dev"},
                             "ownerReferences": [{"apiVersion": "egress-operator.dev/v1alpha1",
                                                  "kind": "ProxyPool", "name": "office",
                                                  "uid": "uid-pool", "controller": true}]},
                "addressType": "IPv4", "endpoints": [],
            }),
        ),
    ])
    .await;

    // The controller's watch, as `controller::run` opens it: the list, then the watch.
    let metrics = ControllerMetrics::default();
    let events = controller::watch::proxies(
        client.clone(),
        kube::runtime::watcher::Config::default().any_semantic(),
        metrics.watch.clone(),
        controller::watch::Skew::default(),
    );
    tokio::pin!(events);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(3), async {
        let mut done = false;
        while let Some(e) = events.next().await {
            if done {
                break;
            }
            done = matches!(e, Ok(kube::runtime::watcher::Event::InitDone));
        }
    })
    .await;

    // A Proxy's life: finalizer, user-data, create, status, events, delete, finalizer off.
    let config =
        Arc::new(config::parse(RBAC_TEST_CONFIG, "rbac-test.yaml", Path::new("/")).unwrap());
    let fake = Arc::new(egress_operator::provider::fake::FakeProvider::named(
        "kvm2",
        &["h1"],
    ));
    let mut registry = egress_operator::provider::registry::Registry::new();
    registry.insert(fake.clone());
    let mut ctx = Context::new(
        client.clone(),
        config.clone(),
        Arc::new(registry),
        metrics,
        Some("egress-operator-0".into()),
    );
    ctx.prober = egress_operator::serving::Prober::with_dialer(
        &config.serving,
        Arc::new(Answers),
        ctx.metrics.probes.clone(),
    );
    let ctx = Arc::new(ctx);
    let reconcile = |p: &Proxy| controller::reconcile(Arc::new(p.clone()), ctx.clone());
    reconcile(&proxy).await.unwrap();
    proxy.metadata.finalizers = Some(vec![controller::FINALIZER.into()]);
    reconcile(&proxy).await.unwrap();
    // The Recorder patches an event it sent before (a series): publish one twice.
    let ev = Event {
        type_: EventType::Normal,
        reason: "Test".into(),
        note: Some("twice".into()),
        action: "Test".into(),
        secondary: None,
    };
    ctx.recorder
        .publish(&ev, &proxy.object_ref(&()))
        .await
        .unwrap();
    ctx.recorder
        .publish(&ev, &proxy.object_ref(&()))
        .await
        .unwrap();
    proxy.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        jiff::Timestamp::now(),
    ));
    proxy.status = Some(
        serde_json::from_value(recorded.lock().unwrap().objects[&proxy_path]["status"].clone())
            .unwrap(),
    );
    reconcile(&proxy).await.unwrap();
    assert!(fake.instances().is_empty(), "the delete ran");

    // The cluster identity, read once at start: the kube-system namespace's UID.
    let uid = egress_operator::cluster_identity::read_cluster_uid(&client)
        .await
        .unwrap();
    assert_eq!(uid, "0b7c3c1e-9a43-4f5e-a1d2-3c4b5a697887");

    // The garbage collector's index: a paged list and a fresh read before a delete.
    let index = KubeProxyIndex::new(client.clone());
    index.owners().await.unwrap();
    index.owner("uid-p", NS, &proxy.name_any()).await.unwrap();

    // The health monitor's sink: creates its object, then writes the status.
    let status = serde_json::from_value(json!({"healthyTargets": 1, "totalTargets": 1})).unwrap();
    KubeSink::new(client.clone())
        .write("kvm2", &status)
        .await
        .unwrap();

    // The elector: creates the Lease, takes it, releases it.
    let options = LeaderOptions {
        lease_duration: std::time::Duration::from_secs(4),
        renew_before_expiry: std::time::Duration::from_secs(2),
        retry_period: std::time::Duration::from_millis(200),
        ..LeaderOptions::new(NAMESPACE, "replica-a")
    };
    let (mut leadership, elector) = LeaderElector::start(client.clone(), options).await.unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), leadership.acquired())
        .await
        .unwrap()
        .unwrap();
    elector.shutdown().await.unwrap();

    // The fleet: the pool, discovery and liveness controllers for a few seconds, as
    // `run` starts them under the leader.
    let board = Arc::new(LivenessBoard::default());
    let (_leading_tx, leading) = tokio::sync::watch::channel(true);
    let fleet = Arc::new(FleetContext::new(
        client.clone(),
        config.clone(),
        board.clone(),
        FleetMetrics::default(),
        leading,
        Some("egress-operator-0".into()),
    ));
    let stop = || tokio::time::sleep(std::time::Duration::from_secs(4));
    let liveness = Liveness::new(board, LivenessOptions::default(), FleetMetrics::default());
    tokio::join!(
        egress_operator::fleet::pool::run(fleet.clone(), stop()),
        egress_operator::fleet::discovery::run(fleet, stop()),
        liveness.run(client.clone(), stop()),
    );
    let mut calls = recorded.lock().unwrap().calls.clone();
    for (verb, resource) in [("create", "proxies"), ("delete", "proxies")] {
        assert!(
            calls
                .iter()
                .any(|c| c.verb == verb && c.resource == resource),
            "the pool controller did not {verb} {resource}: {calls:#?}"
        );
    }
    calls.extend(lease_calls().await);
    calls
}

/// The lease controller's calls: its watches, a lease bound (finalizer, status, the take,
/// its Service and slices, an event), the orphan sweep, and the lease deleted (status,
/// release, finalizer off).
async fn lease_calls() -> Vec<Call> {
    use egress_operator::api::proxy_lease::{LEASE_FINALIZER, ProxyLease};
    use egress_operator::fleet::lease::{self, LeaseContext, LeaseMetrics};
    use egress_operator::fleet::pool::FleetContext;
    use egress_operator::fleet::{FleetMetrics, LivenessBoard};

    const NS: &str = "team";
    let base = format!("/apis/egress-operator.dev/v1alpha1/namespaces/{NS}");
    let pool = json!({
        "apiVersion": "egress-operator.dev/v1alpha1", "kind": "ProxyPool",
        "metadata": {"name": "office", "namespace": NS, "uid": "uid-pool", "resourceVersion": "1"},
        "spec": {"template": {"provider": "kvm2"}},
    });
    let proxy = json!({
        "apiVersion": "egress-operator.dev/v1alpha1", "kind": "Proxy",
        "metadata": {"name": "office-a", "namespace": NS, "uid": "uid-a", "resourceVersion": "1",
                     "labels": {"egress-operator.dev/pool": "office"},
                     "ownerReferences": [{"apiVersion": "egress-operator.dev/v1alpha1",
                         "kind": "ProxyPool", "name": "office", "uid": "uid-pool",
                         "controller": true}]},
        "spec": {"provider": "kvm2"},
        "status": {"address": "198.51.100.1", "conditions": [{"type": "Ready", "status": "True",
            "reason": "ProbePassed", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]},
    });
    let lease_json = json!({
        "apiVersion": "egress-operator.dev/v1alpha1", "kind": "ProxyLease",
        "metadata": {"name": "feed", "namespace": NS, "uid": "uid-lease", "resourceVersion": "1",
                     "generation": 1, "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"pool": "office", "durationSeconds": 315360000, "holder": "tests"},
    });
    let lease_path = format!("{base}/proxyleases/feed");
    let (client, recorded) = recording_api(vec![
        (format!("{base}/proxypools/office"), pool),
        (format!("{base}/proxies/office-a"), proxy),
        (lease_path.clone(), lease_json.clone()),
    ])
    .await;
    let config =
        Arc::new(config::parse(RBAC_TEST_CONFIG, "rbac-test.yaml", Path::new("/")).unwrap());
    let (_leading, leading_rx) = tokio::sync::watch::channel(true);
    let fleet = Arc::new(FleetContext::new(
        client,
        config,
        Arc::new(LivenessBoard::default()),
        FleetMetrics::default(),
        leading_rx,
        Some("egress-operator-0".into()),
    ));
    let ctx = Arc::new(LeaseContext::new(fleet, LeaseMetrics::default()));

    // The watches, as `lease::run` opens them.
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let running = tokio::spawn(lease::run(ctx.clone(), async move {
        let _ = stop_rx.wait_for(|s| *s).await;
    }));
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(10), running).await;

    let lease: ProxyLease = serde_json::from_value(lease_json).unwrap();
    lease::reconcile(Arc::new(lease), ctx.clone())
        .await
        .unwrap();
    let stored = recorded.lock().unwrap().objects[&lease_path].clone();
    let mut bound: ProxyLease = serde_json::from_value(stored).unwrap();
    assert!(
        bound.status.as_ref().is_some_and(|s| !s.proxies.is_empty()),
        "the lease bound its proxy: {:?}",
        bound.status
    );
    lease::sweep_orphans(&ctx).await.unwrap();
    bound.metadata.finalizers = Some(vec![LEASE_FINALIZER.into()]);
    bound.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        jiff::Timestamp::now(),
    ));
    lease::reconcile(Arc::new(bound), ctx).await.unwrap();
    recorded.lock().unwrap().calls.clone()
}

/// Grants of one Role or ClusterRole: (group, resource, verb, resourceName or `*`).
type Grants = BTreeSet<(String, String, String, String)>;

/// A rule set read from `config/rbac`: its grants, and the namespace it applies in
/// (`None`: cluster-wide).
fn shipped_rules() -> Vec<(Option<String>, Grants)> {
    let dir = config_dir().join("rbac");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        for doc in documents(&std::fs::read_to_string(&path).unwrap()) {
            match doc["kind"].as_str() {
                Some("ClusterRole") => out.push((None, grants(&doc["rules"]))),
                Some("Role") => out.push((
                    Some(str_at(&doc, "/metadata/namespace").to_string()),
                    grants(&doc["rules"]),
                )),
                _ => {}
            }
        }
    }
    out
}

fn allowed(rules: &[(Option<String>, Grants)], c: &Call) -> bool {
    rules.iter().any(|(ns, grants)| {
        (ns.is_none() || *ns == c.namespace)
            && grants.iter().any(|(g, r, v, n)| {
                *g == c.group
                    && *r == c.resource
                    && *v == c.verb
                    && (n == "*" || c.name.as_deref() == Some(n.as_str()))
            })
    })
}

#[tokio::test]
async fn rbac_grants_exactly_the_calls_the_code_makes() {
    let calls = calls_the_code_makes().await;
    let rules = shipped_rules();
    assert!(!rules.is_empty(), "no roles in config/rbac");

    let refused: BTreeSet<&Call> = calls.iter().filter(|c| !allowed(&rules, c)).collect();
    assert!(
        refused.is_empty(),
        "config/rbac does not grant these calls the operator makes: {refused:#?}"
    );
    // Every grant is used by some call: no verb the code does not need.
    for (ns, grants) in &rules {
        for (g, r, v, n) in grants {
            let used = calls.iter().any(|c| {
                c.group == *g
                    && c.resource == *r
                    && c.verb == *v
                    && (n == "*" || c.name.as_deref() == Some(n.as_str()))
                    && (ns.is_none() || *ns == c.namespace)
            });
            assert!(
                used,
                "config/rbac grants {v} on {g}/{r} (name {n}, namespace {ns:?}), which the \
                 operator never calls; calls: {calls:#?}"
            );
        }
    }
    // Secrets are read by name only: never listed or watched.
    assert!(
        calls
            .iter()
            .filter(|c| c.resource == "secrets")
            .all(|c| c.verb == "get" && c.name.is_some()),
        "{calls:#?}"
    );
}

#[test]
fn the_rbac_check_sees_a_missing_and_an_extra_grant() {
    let call = call_of(
        "PATCH",
        "/apis/egress-operator.dev/v1alpha1/namespaces/a/proxies/p/status",
        "fieldManager=x",
    );
    assert_eq!(call.resource, "proxies/status");
    assert_eq!(call.verb, "patch");
    let rules = |verbs: Value| {
        vec![(
            None,
            grants(&json!([{"apiGroups": ["egress-operator.dev"],
                            "resources": ["proxies/status"], "verbs": verbs}])),
        )]
    };
    assert!(allowed(&rules(json!(["patch"])), &call));
    assert!(!allowed(&rules(json!(["get"])), &call));
    let watch = call_of(
        "GET",
        "/apis/egress-operator.dev/v1alpha1/proxies",
        "watch=true&x=1",
    );
    assert_eq!((watch.verb.as_str(), watch.namespace), ("watch", None));
    let lease = call_of(
        "PUT",
        "/apis/coordination.k8s.io/v1/namespaces/egress-system/leases/egress-operator",
        "",
    );
    let lease_rules = vec![(
        Some(NAMESPACE.to_string()),
        grants(
            &json!([{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                        "resourceNames": ["other"], "verbs": ["update"]}]),
        ),
    )];
    assert!(
        !allowed(&lease_rules, &lease),
        "the name restriction counts"
    );
}
