use std::path::Path;

use super::*;
use crate::api::proxy::TemplateSettingsOverrides;

const CONFIG: &str = r#"
clusterId: test
kvm2:
  ssh: {user: egress, privateKeyFile: /k/id, knownHostsFile: /k/known_hosts}
  hosts:
    - {name: h1, address: "127.0.0.1:2222", storagePool: default, bridge: br0}
    - {name: h2, address: "h2.example.org", storagePool: default, bridge: br0, maxDomains: 7}
    - {name: h3, address: "h3.example.org", storagePool: default, bridge: br1}
  images:
    - name: debian
      url: https://images.example.org/debian.qcow2
      sha256: "0000000000000000000000000000000000000000000000000000000000000000"
      format: qcow2
  machineTypes:
    - {name: small, vcpus: 1, memoryMiB: 512, diskGiB: 4}
  defaults: {machineType: small, image: debian}
  templates:
    domain: {path: /p/domain.wasm, settings: {a: 1, b: {y: 2, x: 1}}, overridableSettings: [a]}
    vendorData: {path: /p/vendor-data.wasm}
"#;

const DIGESTS: PluginDigests<'static> = PluginDigests {
    domain: "d1",
    vendor_data: "v1",
};

fn config(text: &str) -> ValidConfig {
    crate::config::parse(text, "revision-test.yaml", Path::new("/")).unwrap()
}

fn rev(text: &str, digests: PluginDigests<'_>, spec: &ProxySpec, host: &str) -> Revision {
    Revision::of(
        &config(text),
        digests,
        spec,
        Some(host),
        UserData::Read(None),
    )
    .unwrap()
}

fn spec() -> ProxySpec {
    ProxySpec {
        provider: "kvm2".into(),
        ..Default::default()
    }
}

#[test]
fn every_part_is_kept_and_the_same_inputs_give_the_same_revision() {
    let a = rev(CONFIG, DIGESTS, &spec(), "h1");
    assert_eq!(a.parts.keys().count(), PARTS.len(), "{a:?}");
    for p in PARTS {
        assert_eq!(a.parts[p].len(), DIGEST_HEX, "{p}");
    }
    assert_eq!(a, rev(CONFIG, DIGESTS, &spec(), "h1"));
    assert_eq!(a.hash(), rev(CONFIG, DIGESTS, &spec(), "h1").hash());
}

#[test]
fn each_input_changes_its_own_part_only() {
    let base = rev(CONFIG, DIGESTS, &spec(), "h1");
    let recorded = base.to_status(false);
    let changed = |r: Revision| r.changed_from(&recorded);

    let plugin = PluginDigests {
        domain: "d2",
        ..DIGESTS
    };
    assert_eq!(changed(rev(CONFIG, plugin, &spec(), "h1")), [DOMAIN_PLUGIN]);
    let vendor = PluginDigests {
        vendor_data: "v2",
        ..DIGESTS
    };
    assert_eq!(
        changed(rev(CONFIG, vendor, &spec(), "h1")),
        [VENDOR_DATA_PLUGIN]
    );
    let image = CONFIG.replace(
        "0000000000000000000000000000000000000000000000000000000000000000",
        "1111111111111111111111111111111111111111111111111111111111111111",
    );
    assert_eq!(changed(rev(&image, DIGESTS, &spec(), "h1")), [IMAGE]);
    let memory = CONFIG.replace("memoryMiB: 512", "memoryMiB: 1024");
    assert_eq!(
        changed(rev(&memory, DIGESTS, &spec(), "h1")),
        [MACHINE_TYPE]
    );
    let setting = CONFIG.replace("settings: {a: 1,", "settings: {a: 2,");
    assert_eq!(
        changed(rev(&setting, DIGESTS, &spec(), "h1")),
        [DOMAIN_PLUGIN]
    );
    // Another bridge is another render; another maxDomains or address is not.
    assert_eq!(changed(rev(CONFIG, DIGESTS, &spec(), "h3")), [HOST_POLICY]);
    assert!(changed(rev(CONFIG, DIGESTS, &spec(), "h2")).is_empty());
    // Two changes are both named, in the order of PARTS.
    assert_eq!(
        changed(rev(&image, plugin, &spec(), "h1")),
        [IMAGE, DOMAIN_PLUGIN]
    );
}

#[test]
fn key_order_and_renames_do_not_count_as_changes() {
    let base = rev(CONFIG, DIGESTS, &spec(), "h1").to_status(false);
    let reordered = CONFIG.replace("b: {y: 2, x: 1}", "b: {x: 1, y: 2}");
    assert!(
        rev(&reordered, DIGESTS, &spec(), "h1")
            .changed_from(&base)
            .is_empty()
    );
    // A machine type is its values: renamed (and the default with it), nothing changed.
    let renamed = CONFIG.replace("name: small", "name: tiny").replace(
        "defaults: {machineType: small",
        "defaults: {machineType: tiny",
    );
    assert!(
        rev(&renamed, DIGESTS, &spec(), "h1")
            .changed_from(&base)
            .is_empty()
    );
}

#[test]
fn a_proxy_override_is_part_of_the_plugin_part() {
    let base = rev(CONFIG, DIGESTS, &spec(), "h1").to_status(false);
    let mut s = spec();
    let mut domain = serde_json::Map::new();
    domain.insert("a".into(), 5.into());
    s.template_settings = Some(TemplateSettingsOverrides {
        domain: Some(domain.clone()),
        vendor_data: None,
    });
    assert_eq!(
        rev(CONFIG, DIGESTS, &s, "h1").changed_from(&base),
        [DOMAIN_PLUGIN]
    );
    // The same value as configured: the same effective settings.
    domain.insert("a".into(), 1.into());
    s.template_settings = Some(TemplateSettingsOverrides {
        domain: Some(domain),
        vendor_data: None,
    });
    assert!(
        rev(CONFIG, DIGESTS, &s, "h1")
            .changed_from(&base)
            .is_empty()
    );
}

#[test]
fn user_data_is_hashed_at_create_and_carried_over_after() {
    let c = config(CONFIG);
    let made = |ud| Revision::of(&c, DIGESTS, &spec(), Some("h1"), ud).unwrap();
    let with = made(UserData::Read(Some(b"#cloud-config\n")));
    let without = made(UserData::Read(None));
    assert_ne!(with.parts[USER_DATA], without.parts[USER_DATA]);
    assert!(
        !with.parts[USER_DATA].contains("cloud"),
        "never the content"
    );
    let recorded = with.to_status(false);
    let later = made(UserData::Recorded(
        recorded.parts.get(USER_DATA).map(String::as_str),
    ));
    assert!(later.changed_from(&recorded).is_empty());
    // An adopted revision has no user-data part, and one computed later does not invent
    // one.
    let adopted = made(UserData::Recorded(None)).to_status(true);
    assert!(!adopted.parts.contains_key(USER_DATA));
    assert_eq!(adopted.adopted, Some(true));
    assert!(
        made(UserData::Recorded(None))
            .changed_from(&adopted)
            .is_empty()
    );
}

#[test]
fn the_host_part_waits_for_placement() {
    let c = config(CONFIG);
    let before = Revision::of(&c, DIGESTS, &spec(), None, UserData::Read(None)).unwrap();
    assert!(!before.parts.contains_key(HOST_POLICY));
    let placed = rev(CONFIG, DIGESTS, &spec(), "h3");
    let whole = before.with_host_part(&placed);
    assert_eq!(whole, placed);
}

#[test]
fn a_spec_the_config_cannot_make_names_the_field() {
    let c = config(CONFIG);
    let mut s = spec();
    s.image = Some("ubuntu".into());
    let e = Revision::of(&c, DIGESTS, &s, Some("h1"), UserData::Read(None)).unwrap_err();
    assert!(e.contains("spec.image") && e.contains("ubuntu"), "{e}");
    let e = Revision::of(&c, DIGESTS, &spec(), Some("h9"), UserData::Read(None)).unwrap_err();
    assert!(e.contains("h9"), "{e}");
}
