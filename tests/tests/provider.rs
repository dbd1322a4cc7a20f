//! The kvm2 provider on real components: OpenSSH's sshd, an isolated libvirtd with QEMU
//! (software emulation) in a network namespace, reached only through our SSH tunnel, and
//! base images served by a local HTTP server.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::sync::Arc;

use egress_operator::Classified as _;
use egress_operator::error::ErrorClass;
use egress_operator::instance::InstanceIdentity;
use egress_operator::provider::kvm2::fake::FaultyOps;
use egress_operator::provider::{InstanceId, InstanceState, Provider};
use integration_tests::provider_rig::{Rig, request, run, uid};

#[test]
fn create_runs_get_reports_delete_leaves_nothing() {
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    run(async {
        let p = rig.provider(rig.ops.clone());
        let req = request(&uid(1), "office-egress");
        let inst = p.create(&req).await.unwrap();
        assert_eq!(inst.state, InstanceState::Running);
        assert_eq!(inst.id.host, "h1");
        assert_eq!(inst.proxy.uid, uid(1));
        let id = InstanceIdentity::for_uid(&uid(1)).unwrap();
        assert_eq!(inst.id.name, id.domain_name);
        assert_eq!(rig.domains(), vec![id.domain_name.clone()]);
        let state = rig.virsh(&["domstate", &id.domain_name]);
        assert_eq!(state.trim(), "running");

        // Get: same instance; a non-booting image has no address, and that is reported
        // as none rather than guessed.
        let got = p.get(&inst.id).await.unwrap();
        assert_eq!(got.state, InstanceState::Running);
        assert_eq!(got.proxy, inst.proxy);
        assert!(got.addresses.is_empty(), "{:?}", got.addresses);

        // Create again: adopted, not duplicated, and the image is not fetched again.
        let again = p.create(&req).await.unwrap();
        assert_eq!(again.id, inst.id);
        assert_eq!(rig.http.hits("/base.qcow2"), 1);

        // Listing shows it with our mark.
        let listing = p.list().await;
        assert_eq!(listing.len(), 1);
        let found = listing[0].result.as_ref().unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].proxy.name, "office-egress");

        let mut expected = rig.base_volumes();
        expected.extend([id.root_volume.clone(), id.seed_volume.clone()]);
        expected.sort();
        assert_eq!(rig.volumes(), expected);

        p.delete(&inst.id).await.unwrap();
        assert!(rig.domains().is_empty(), "{:?}", rig.domains());
        let mut base = rig.base_volumes();
        base.sort();
        assert_eq!(
            rig.volumes(),
            base,
            "only the shared base image stays cached"
        );
        let e = p.get(&inst.id).await.unwrap_err();
        assert_eq!(e.class(), ErrorClass::NotFound, "{e}");
        // Delete is idempotent.
        p.delete(&inst.id).await.unwrap();
        rig.hosts.close().await;
    });
    // The user-data secret never reached the daemons' logs through us.
    assert!(!rig.sshd.log().contains("not-in-any-log"));
    let _ = &rig.pool_dir;
}

#[test]
fn three_concurrent_creates_upload_the_image_once() {
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    run(async {
        let p = Arc::new(rig.provider(rig.ops.clone()));
        let tasks: Vec<_> = (10..13)
            .map(|n| {
                let p = p.clone();
                tokio::spawn(async move { p.create(&request(&uid(n), &format!("p{n}"))).await })
            })
            .collect();
        let mut ids = Vec::new();
        for t in tasks {
            ids.push(t.await.unwrap().unwrap().id);
        }
        assert_eq!(
            rig.http.hits("/base.qcow2"),
            1,
            "one download for three Creates"
        );
        assert_eq!(p.image_cache().metrics().uploads("h1", "base", "ok"), 1);
        assert_eq!(rig.domains().len(), 3);
        for id in &ids {
            p.delete(id).await.unwrap();
        }
        assert!(rig.domains().is_empty());
        rig.hosts.close().await;
    });
}

#[test]
fn a_foreign_domain_with_our_name_is_refused_and_left_alone() {
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    let id = InstanceIdentity::for_uid(&uid(20)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let xml_path = dir.path().join("foreign.xml");
    std::fs::write(&xml_path, rig.libvirtd.minimal_domain_xml(&id.domain_name)).unwrap();
    rig.virsh(&["define", xml_path.to_str().unwrap()]);
    run(async {
        let p = rig.provider(rig.ops.clone());
        let e = p.create(&request(&uid(20), "x")).await.unwrap_err();
        assert_eq!(e.class(), ErrorClass::Permanent, "{e}");
        assert!(e.to_string().contains("not this Proxy's"), "{e}");
        let e = p
            .delete(&InstanceId {
                host: "h1".into(),
                name: id.domain_name.clone(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.class(), ErrorClass::Permanent, "{e}");
        rig.hosts.close().await;
    });
    assert_eq!(
        rig.domains(),
        vec![id.domain_name.clone()],
        "left untouched"
    );
    assert!(rig.volumes().is_empty(), "{:?}", rig.volumes());
    rig.virsh(&["undefine", &id.domain_name]);
}

/// A failure injected at each step of a Create in turn, once as an error (cleanup runs)
/// and once as a crash (nothing after the fault runs): a fresh Create then converges to
/// one running domain and no leaked volume.
#[test]
fn a_failure_after_each_create_step_converges_on_the_next_create() {
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    run(async {
        let points: [(&'static str, usize); 6] = [
            ("volume-create", 0), // the base image's data volume
            ("volume-upload", 0), // the base image upload
            ("volume-create", 2), // the root overlay (after data + marker)
            ("volume-upload", 1), // the seed ISO
            ("domain-define", 0),
            ("domain-start", 0),
        ];
        let mut n = 30u8;
        for (op, nth) in points {
            for crash in [false, true] {
                n += 1;
                // A fresh image each round would need a new server; instead the cache is
                // cleared, so the early steps really run every time.
                for v in rig.base_volumes() {
                    let _ = rig.libvirtd.virsh(
                        &rig.libvirtd.qemu_uri(),
                        &["vol-delete", &v, "--pool", "default"],
                    );
                }
                let faulty = Arc::new(FaultyOps::new(rig.ops.clone(), op, nth, crash));
                let p = rig.provider(faulty.clone());
                let req = request(&uid(n), "f");
                let e = p.create(&req).await.unwrap_err();
                assert!(faulty.tripped(), "{op}#{nth}: the fault did not fire: {e}");
                let healthy = rig.provider(rig.ops.clone());
                let inst = healthy
                    .create(&req)
                    .await
                    .unwrap_or_else(|e| panic!("{op}#{nth} crash={crash}: {e}"));
                assert_eq!(inst.state, InstanceState::Running);
                let id = InstanceIdentity::for_uid(&uid(n)).unwrap();
                assert_eq!(
                    rig.domains(),
                    vec![id.domain_name.clone()],
                    "{op}#{nth} crash={crash}"
                );
                let mut expected = rig.base_volumes();
                expected.extend([id.root_volume.clone(), id.seed_volume.clone()]);
                expected.sort();
                assert_eq!(
                    rig.volumes(),
                    expected,
                    "{op}#{nth} crash={crash}: leaked volumes"
                );
                healthy.delete(&inst.id).await.unwrap();
                assert!(rig.domains().is_empty());
            }
        }
        rig.hosts.close().await;
    });
}

/// The `provision` command end to end on the same rig: create (with user-data from a
/// file), then `--delete`, which reports that nothing is left.
#[test]
fn provision_command_creates_and_deletes() {
    use egress_operator::cli::{Command, ProvisionCliArgs, execute};
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    let yaml = integration_tests::provider_config_yaml(
        &rig.sshd,
        &rig.libvirtd,
        "h1",
        &Rig::base_image(&rig.http, &rig.image_sha),
        &[],
    )
    .unwrap();
    std::fs::write(&config, yaml).unwrap();
    let proxy = dir.path().join("proxy.yaml");
    std::fs::write(
        &proxy,
        format!(
            "apiVersion: egress-operator.dev/v1alpha1\nkind: Proxy\nmetadata:\n  name: cli\n  \
             namespace: default\n  uid: {}\nspec:\n  provider: kvm2\n",
            uid(0x50)
        ),
    )
    .unwrap();
    let user_data = dir.path().join("user-data");
    std::fs::write(&user_data, "#cloud-config\npassword: never-printed\n").unwrap();
    let args = |delete: bool| ProvisionCliArgs {
        config: config.clone(),
        proxy: proxy.clone(),
        user_data: (!delete).then(|| user_data.clone()),
        delete,
        plugin_dir: None,
        cache_dir: None,
        show_xml: !delete,
        wait_address_seconds: 0,
        wait_serving_seconds: 0,
        no_progress: true,
        shutdown_timeout_seconds: 1,
    };
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = execute(Command::Provision(args(false)), &mut out, &mut err);
    let (o, e) = (String::from_utf8_lossy(&out), String::from_utf8_lossy(&err));
    assert_eq!(code, 0, "stdout: {o}\nstderr: {e}");
    assert!(o.contains("state:     running"), "{o}");
    assert!(o.contains("<domain"), "the domain XML is shown: {o}");
    assert!(!o.contains("never-printed") && !e.contains("never-printed"));
    assert_eq!(rig.domains().len(), 1);

    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = execute(Command::Provision(args(true)), &mut out, &mut err);
    let (o, e) = (String::from_utf8_lossy(&out), String::from_utf8_lossy(&err));
    assert_eq!(code, 0, "stdout: {o}\nstderr: {e}");
    assert!(o.contains("nothing left"), "{o}");
    assert!(rig.domains().is_empty());
    let mut base = rig.base_volumes();
    base.sort();
    assert_eq!(rig.volumes(), base);
}

/// What adoption and the volume collector rely on, against libvirt's own semantics: a
/// paused domain is resumed when its Proxy's Create adopts it, and the pool listing reads
/// each overlay's backing store (the base image's path) as libvirt reports it.
#[test]
fn adoption_resumes_a_paused_domain_and_volumes_list_their_backing_store() {
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    run(async {
        let p = rig.provider(rig.ops.clone());
        let req = request(&uid(7), "paused-egress");
        let inst = p.create(&req).await.unwrap();
        let id = InstanceIdentity::for_uid(&uid(7)).unwrap();
        let run_id = rig.virsh(&["domid", &id.domain_name]);
        rig.virsh(&["suspend", &id.domain_name]);
        assert_eq!(rig.virsh(&["domstate", &id.domain_name]).trim(), "paused");

        let adopted = p.create(&req).await.unwrap();
        assert_eq!(adopted.id, inst.id);
        assert_eq!(adopted.state, InstanceState::Running);
        assert_eq!(
            rig.virsh(&["domstate", &id.domain_name]).trim(),
            "running",
            "adoption resumed the paused domain"
        );
        assert_eq!(
            rig.virsh(&["domid", &id.domain_name]),
            run_id,
            "resumed, not replaced (a new start gets a new domain id)"
        );

        let volumes = rig.ops.list_volumes("h1", "default").await.unwrap();
        let by_name = |n: &str| {
            volumes
                .iter()
                .find(|v| v.name == n)
                .unwrap_or_else(|| panic!("{n} not listed: {volumes:?}"))
        };
        let root = by_name(&id.root_volume);
        let seed = by_name(&id.seed_volume);
        let bases = rig.base_volumes();
        let base = bases
            .iter()
            .map(|b| by_name(b))
            .find(|b| root.backing.as_deref() == Some(b.path.as_str()))
            .unwrap_or_else(|| {
                panic!(
                    "the root's backing {:?} is no base: {volumes:?}",
                    root.backing
                )
            });
        assert!(base.backing.is_none(), "{base:?}");
        assert!(seed.backing.is_none(), "{seed:?}");
        assert!(
            root.path.starts_with(&rig.pool_dir.display().to_string()),
            "{root:?}"
        );

        p.delete(&inst.id).await.unwrap();
        assert!(rig.domains().is_empty());
        rig.hosts.close().await;
    });
}

/// A domain plugin pushed with `plugin push` to a registry of the test's own (TLS with its
/// own CA, basic auth from a Docker config JSON) is pulled by digest and renders a Create
/// on the real daemons, its settings (one further NIC) included.
#[test]
fn a_create_renders_with_a_domain_plugin_pulled_from_an_oci_registry() {
    use egress_operator::templates::{EngineOptions, TemplateEngine, TemplateSet};
    use integration_tests::harness::{self, Need, Registry};

    if harness::skip(&[Need::Registry]) {
        return;
    }
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    let registry = Registry::start("operator", "pull-pw").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("dockerconfig.json");
    registry.write_docker_config(&auth).unwrap();
    let wasm = integration_tests::plugin_path("domain-default").unwrap();
    let pushed = egress_operator::authoring::push::push(
        &wasm,
        &registry.reference("plugins/domain-default:create"),
        Some(&auth),
        Some(&registry.ca_file()),
    )
    .unwrap();
    let url = pushed.reference.to_string();

    let mut templates = rig.config.kvm2.templates.clone();
    templates.domain = serde_json::from_value(serde_json::json!({
        "url": url,
        "credentialsFile": auth,
        "settings": { "extraNics": 1 },
    }))
    .unwrap();
    let engine = TemplateEngine::with_options(&EngineOptions {
        cache_dir: Some(dir.path().join("cache")),
        download_ca_pem: Some(std::fs::read(registry.ca_file()).unwrap()),
    })
    .unwrap();
    let set = Arc::new(TemplateSet::load(&engine, &templates));
    assert_eq!(set.health()[0].plugin, format!("domain:{url}"));
    // Pulled once; the registry is not needed after the load.
    drop(registry);
    run(async {
        let p = rig.provider_with(rig.ops.clone(), set);
        let inst = p.create(&request(&uid(7), "oci-egress")).await.unwrap();
        assert_eq!(inst.state, InstanceState::Running);
        let xml = rig.virsh(&["dumpxml", &inst.id.name]);
        assert_eq!(xml.matches("<interface type='bridge'>").count(), 2, "{xml}");
        p.delete(&inst.id).await.unwrap();
        assert!(rig.domains().is_empty(), "{:?}", rig.domains());
        rig.hosts.close().await;
    });
}

/// Issue 32, item 1: the provider's domain index on the real daemons. What another cluster
/// or a person with virsh does to the host is seen by the next names-only check (a new
/// domain read once, a removed one dropped); an edit in place (same UUID) by the next full
/// listing, as every GC sweep makes. A Delete's search finds its instance with a
/// names-only listing, never a full one.
#[test]
fn the_domain_index_follows_what_virsh_does_to_the_host() {
    use egress_operator::instance::MetadataMark;
    use egress_operator::provider::kvm2::index::Fresh;
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    let foreign = InstanceIdentity::for_uid(&uid(41)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let xml_path = dir.path().join("foreign.xml");
    // `uuid`: the domain's own, to define it again in place (as `virsh edit` does).
    let write_foreign = |mac: &str, uuid: Option<&str>| {
        let mark = MetadataMark {
            cluster_id: "another-cluster".into(),
            cluster_uid: None,
            namespace: "default".into(),
            name: "theirs".into(),
            uid: uid(41),
            created_at: "2026-01-01T00:00:00Z".into(),
            mac: Some(mac.into()),
            address: None,
        };
        let xml = rig
            .libvirtd
            .minimal_domain_xml(&foreign.domain_name)
            .replacen(
                "<vcpu>",
                &format!(
                    "{}<metadata>{}</metadata>\n  <vcpu>",
                    uuid.map(|u| format!("<uuid>{u}</uuid>\n  "))
                        .unwrap_or_default(),
                    mark.to_xml()
                ),
                1,
            );
        std::fs::write(&xml_path, xml).unwrap();
        rig.virsh(&["define", xml_path.to_str().unwrap()]);
    };
    let mac_of = |list: &[egress_operator::provider::kvm2::ops::DomainRecord]| {
        list.iter()
            .find(|d| d.name == foreign.domain_name)
            .and_then(|d| d.mark.as_ref())
            .and_then(|m| m.mac.clone())
    };
    run(async {
        let p = rig.provider(rig.ops.clone());
        let inst = p.create(&request(&uid(40), "ours")).await.unwrap();
        let m = p.index().metrics().clone();
        let checks = |via: &str| m.checks("h1", via);
        assert_eq!(
            checks("full"),
            1,
            "the first look at the host is a full listing"
        );
        let (names0, full0, lookups0) = (checks("names"), checks("full"), m.read("h1", "lookup"));
        assert!(
            names0 >= 1,
            "the Create's allocation checked the host by names"
        );

        // Another cluster defines a domain: the next check reads it, and only it.
        write_foreign("52:54:00:aa:00:01", None);
        let seen = p
            .index()
            .domains(rig.ops.as_ref(), "h1", Fresh::Now)
            .await
            .unwrap();
        assert_eq!(mac_of(&seen).as_deref(), Some("52:54:00:aa:00:01"));
        assert_eq!(seen.len(), 2);
        assert_eq!(checks("names"), names0 + 1);
        assert_eq!(checks("full"), full0, "no full listing");
        assert_eq!(m.read("h1", "lookup"), lookups0 + 1, "one domain read");

        // virsh edits it in place (same UUID): a names check cannot tell...
        let uuid = rig.virsh(&["domuuid", &foreign.domain_name]);
        write_foreign("52:54:00:aa:00:02", Some(uuid.trim()));
        let seen = p
            .index()
            .domains(rig.ops.as_ref(), "h1", Fresh::Now)
            .await
            .unwrap();
        assert_eq!(mac_of(&seen).as_deref(), Some("52:54:00:aa:00:01"));
        // ...the full listing of a GC sweep does, and the index keeps it.
        let listing = p.list().await;
        assert_eq!(
            listing[0].result.as_ref().unwrap().len(),
            1,
            "only ours is listed"
        );
        let seen = p
            .index()
            .domains(rig.ops.as_ref(), "h1", Fresh::Now)
            .await
            .unwrap();
        assert_eq!(mac_of(&seen).as_deref(), Some("52:54:00:aa:00:02"));

        // Undefined behind our back: dropped by the next check.
        rig.virsh(&["undefine", &foreign.domain_name]);
        let seen = p
            .index()
            .domains(rig.ops.as_ref(), "h1", Fresh::Now)
            .await
            .unwrap();
        assert_eq!(seen.len(), 1);
        assert!(mac_of(&seen).is_none());

        // A Delete's search for instances its status does not name: names only.
        let full = checks("full");
        let found = p.instances_of(&uid(40)).await;
        assert_eq!(found[0].result.as_ref().unwrap()[0].id, inst.id);
        assert!(
            p.instances_of(&uid(42)).await[0]
                .result
                .as_ref()
                .unwrap()
                .is_empty()
        );
        assert_eq!(checks("full"), full);

        p.delete(&inst.id).await.unwrap();
        let seen = p
            .index()
            .domains(rig.ops.as_ref(), "h1", Fresh::Now)
            .await
            .unwrap();
        assert!(seen.is_empty(), "{seen:?}");
        rig.hosts.close().await;
    });
    assert!(rig.domains().is_empty(), "{:?}", rig.domains());
}
