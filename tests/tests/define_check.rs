//! Defence in depth at define time: each layer catches a case the others are not given.
//!
//! - libvirt's schema validation (`VIR_DOMAIN_DEFINE_VALIDATE`): the host operation is
//!   handed XML libvirt's RNG schema refuses (no checker runs before it) and defines
//!   nothing, with a permanent error carrying libvirt's message;
//! - the post-define check on libvirt's own reading (`check_defined_domain_xml` on the
//!   inactive XML): the host operation is handed XML that libvirt's schema accepts but
//!   libvirt reads differently from the plugin-output checker, and the Create path
//!   undefines it, removes its volumes and never starts it;
//! - the positive case: the default plugin's output, defined on libvirt 9.0, passes the
//!   check on libvirt's reading, which is kept as the fixture
//!   `operator/src/templates/testdata/libvirt-inactive-default.xml`.
//!
//! The first tests run against the in-memory fake hosts (no daemons; the fake models
//! libvirt's reading with a hook); the rest run on the harness's sshd and libvirtd with
//! the QEMU driver.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use egress_operator::Classified as _;
use egress_operator::api::proxy::{self, ProxySpec};
use egress_operator::config::{self, ValidConfig};
use egress_operator::error::ErrorClass;
use egress_operator::instance::{InstanceIdentity, image_marker_name, image_volume_name};
use egress_operator::provider::kvm2::backend::{Kvm2Error, Kvm2Options, Kvm2Provider};
use egress_operator::provider::kvm2::fake::{FakeOps, Hooked, OpHook};
use egress_operator::provider::kvm2::image::ImageMetrics;
use egress_operator::provider::kvm2::ops::{HostOps, OpsError};
use egress_operator::provider::{
    BoxFuture, CreateRequest, InstanceState, Provider, ProviderError, ProxyRef, UserData,
};
use egress_operator::render::{self, Facts};
use egress_operator::templates::check::check_defined_domain_xml;
use egress_operator::templates::{DomainInput, TemplateEngine, TemplateErrorKind, TemplateSet};
use integration_tests::fake_rig::{self, FakeConfig};
use integration_tests::http::{HttpServer, Route};
use integration_tests::provider_rig::{self, Rig};
use integration_tests::{plugin_path, sha256_hex, workspace_root};

/// A hang fails the test instead of blocking CI; not a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(60);
/// The creation time of the sample render (as in tests/snapshots/domain-default.xml).
const CREATED_AT: &str = "2026-01-01T00:00:00Z";
/// The NIC the default plugin writes, and how libvirt reads it when a plugin adds a
/// namespaced `x:type="user"` before it (`xmlGetProp` matches the local name and takes
/// the first): user-mode networking, a NIC off the configured bridge.
const BRIDGE_NIC: &str = r#"<interface type="bridge">"#;
const USER_NIC: &str = r#"<interface type="user">"#;
/// A root element that declares libvirt's QEMU passthrough namespace with a character
/// reference in its URI (`1.&#48;` is `1.0`): libvirt's schema accepts the
/// `<q:commandline>` it carries, and libvirt reads it as raw QEMU arguments.
const QEMU_NS_BY_CHARREF: &str =
    r#"<domain type="qemu" xmlns:q="http://libvirt.org/schemas/domain/qemu/1.&#48;">"#;
const PASSTHROUGH: &str = r#"<q:commandline><q:arg value="-no-reboot"/></q:commandline></domain>"#;
/// A NIC whose namespaced `x:type="user"` libvirt would honour: its RNG schema refuses it.
const NAMESPACED_NIC: &str = r#"<interface xmlns:x="urn:x" x:type="user" type="bridge">"#;

fn run<F: std::future::Future>(f: F) -> F::Output {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        tokio::time::timeout(HANG_GUARD, f)
            .await
            .expect("hang guard")
    })
}

fn uid(n: u8) -> String {
    format!("0b7c3c1e-9a43-4f5e-a1d2-3c4b5a6978{n:02x}")
}

fn names<I: IntoIterator<Item = S>, S: Into<String>>(items: I) -> BTreeSet<String> {
    items.into_iter().map(Into::into).collect()
}

/// The Kvm2 error inside a provider error.
fn kvm2(e: &ProviderError) -> &Kvm2Error {
    e.inner()
        .downcast_ref::<Kvm2Error>()
        .unwrap_or_else(|| panic!("not a kvm2 error: {e}"))
}

/// Asserts `e` is the post-define check's refusal: permanent, says libvirt's reading of
/// the defined domain failed, names `origin`, and carries the rule and path of the
/// checker's refusal; returns the refusal's detail.
fn assert_refused_on_libvirts_reading(e: &ProviderError, origin: &str) -> String {
    assert_eq!(e.class(), ErrorClass::Permanent, "{e}");
    let shown = e.to_string();
    assert!(
        shown.contains("libvirt's reading of domain") && shown.contains("post-define check"),
        "{shown}"
    );
    assert!(shown.contains(origin), "{shown}");
    let Kvm2Error::DefinedRefused { kind, .. } = kvm2(e) else {
        panic!("not the post-define check's refusal: {e:?}");
    };
    let TemplateErrorKind::InvalidOutput { rule, detail } = kind else {
        panic!("not a rule's refusal: {kind:?}");
    };
    assert!(
        shown.contains(rule) && shown.contains(detail.as_str()),
        "{shown}"
    );
    assert!(detail.contains('/'), "the detail names a path: {detail}");
    detail.clone()
}

// On the fake hosts. ----------------------------------------------------------------------

/// Fake hosts h1, an image server, and a provider over them.
struct FakeWorld {
    _http: HttpServer,
    fake: Arc<FakeOps>,
    config: Arc<ValidConfig>,
    sha: String,
}

impl FakeWorld {
    fn new() -> Self {
        // A qcow2 header (64 MiB virtual, below the 1 GiB disk), then bytes not all alike.
        let bytes = fake_rig::test_image(64 << 20, 4000);
        let http =
            HttpServer::start(vec![("/img".to_string(), Route::Body(bytes.clone()))]).unwrap();
        let sha = sha256_hex(&bytes);
        let config = FakeConfig::new(&http.url("/img"), &sha)
            .name("define-check-config")
            .build();
        Self {
            _http: http,
            fake: Arc::new(FakeOps::new(&["h1"], 1 << 40)),
            config,
            sha,
        }
    }

    fn provider(&self) -> Kvm2Provider {
        fake_rig::provider(&self.config, self.fake.clone())
    }

    /// The cached base image and this cluster's announcement that it uses it.
    fn base(&self) -> BTreeSet<String> {
        names([
            image_volume_name(&self.sha),
            image_marker_name(&self.sha),
            egress_operator::instance::image_use_name("test", None),
        ])
    }

    fn with_vm(&self, uid: &str) -> BTreeSet<String> {
        let id = InstanceIdentity::for_uid(uid).unwrap();
        let mut v = self.base();
        v.extend([id.root_volume, id.seed_volume]);
        v
    }
}

fn fake_request(uid: &str) -> CreateRequest {
    CreateRequest {
        proxy: ProxyRef {
            namespace: "default".into(),
            name: "office".into(),
            uid: uid.into(),
        },
        spec: ProxySpec {
            provider: "kvm2".into(),
            machine_type: None,
            image: None,
            host: Some("h1".into()),
            user_data: None,
            template_settings: None,
            update_policy: None,
        },
        user_data: Some(UserData::new(b"#cloud-config\n".to_vec())),
        fence: egress_operator::provider::Fence::unfenced(),
    }
}

/// libvirt reads the plugin's bridge NIC as a user-mode NIC (the reading of a namespaced
/// `type` in front of the plain one): the Create defines, checks libvirt's reading,
/// refuses it, undefines the domain and removes the volumes it made, and never starts it.
/// The same Create without the divergent reading runs, so only the reading made the
/// difference.
#[test]
fn post_define_check_refuses_libvirts_reading_undefines_and_removes_what_it_made() {
    let w = FakeWorld::new();
    run(async {
        let p = w.provider();
        w.fake
            .set_reading(|xml| xml.replacen(BRIDGE_NIC, USER_NIC, 1));
        let u = uid(1);
        let e = p.create(&fake_request(&u)).await.unwrap_err();
        let detail = assert_refused_on_libvirts_reading(&e, "just defined by this Create");
        assert!(detail.contains("interface"), "{detail}");
        assert_eq!(w.fake.calls("domain-define"), 1);
        assert_eq!(w.fake.calls("domain-undefine"), 1, "undefined again");
        assert_eq!(w.fake.calls("domain-start"), 0, "never started");
        assert!(
            w.fake.domains("h1").is_empty(),
            "{:?}",
            w.fake.domains("h1")
        );
        assert_eq!(
            w.fake.volumes("h1"),
            w.base(),
            "the VM's root and seed volumes are removed; the shared base image stays"
        );

        // The same Create with libvirt reading the document as written: defined, checked,
        // started.
        w.fake.set_reading(str::to_string);
        let inst = p.create(&fake_request(&u)).await.unwrap();
        assert_eq!(inst.state, InstanceState::Running);
        assert_eq!(w.fake.calls("domain-start"), 1);
        assert_eq!(w.fake.volumes("h1"), w.with_vm(&u));
    });
}

/// While the plugins are still loading, a Create fails at once and transiently with the
/// plugins' reason, before it touches a host: no placement, download, volume or define.
#[test]
fn a_create_while_plugins_load_fails_before_touching_a_host() {
    let w = FakeWorld::new();
    run(async {
        let loading = Arc::new(TemplateSet::loading(&w.config.kvm2.templates));
        let p = Kvm2Provider::new(
            w.config.clone(),
            w.fake.clone(),
            loading,
            Kvm2Options::default(),
            ImageMetrics::default(),
        );
        let e = p.create(&fake_request(&uid(9))).await.unwrap_err();
        assert_eq!(e.class(), ErrorClass::Transient, "{e}");
        assert!(e.to_string().contains("not loaded yet"), "{e}");
        for op in [
            "host-facts",
            "pool-info",
            "domain-list",
            "domain-lookup",
            "volume-info",
            "volume-create",
            "volume-upload",
            "domain-define",
            "domain-start",
        ] {
            assert_eq!(w.fake.calls(op), 0, "{op} was called");
        }
        assert!(
            w.fake.volumes("h1").is_empty(),
            "{:?}",
            w.fake.volumes("h1")
        );
    });
}

/// libvirt defines the document under another name than the operator asked for (it read
/// `<name>` differently from the checker): that domain may be another Proxy's, redefined,
/// so the Create refuses permanently, names both, and neither undefines nor starts it;
/// the volumes it made are still removed.
#[test]
fn a_domain_libvirt_defined_under_another_name_is_left_alone() {
    let w = FakeWorld::new();
    run(async {
        let p = w.provider();
        let u = uid(3);
        let ours = InstanceIdentity::for_uid(&u).unwrap().domain_name;
        let other = InstanceIdentity::for_uid(&uid(4)).unwrap().domain_name;
        let (from, to) = (
            format!("<name>{ours}</name>"),
            format!("<name>{other}</name>"),
        );
        w.fake.set_reading(move |xml| xml.replacen(&from, &to, 1));
        let e = p.create(&fake_request(&u)).await.unwrap_err();
        assert_eq!(e.class(), ErrorClass::Permanent, "{e}");
        let Kvm2Error::DefinedElsewhere {
            expected, defined, ..
        } = kvm2(&e)
        else {
            panic!("not a define under another name: {e:?}");
        };
        assert_eq!((expected, defined), (&ours, &other));
        assert_eq!(w.fake.domains("h1"), names([other.clone()]), "left alone");
        assert_eq!(w.fake.calls("domain-undefine"), 0);
        assert_eq!(w.fake.calls("domain-start"), 0);
        assert_eq!(
            w.fake.volumes("h1"),
            w.base(),
            "the VM's volumes are removed"
        );
    });
}

/// A Create that finds our domain defined but not running checks libvirt's reading of it
/// before starting it: a good one is started; one that fails is refused permanently, left
/// defined (its mark says it is this Proxy's, and this Create did not make it) with its
/// volumes, and not started.
#[test]
fn adoption_rechecks_a_shut_off_domain_before_starting_it() {
    let w = FakeWorld::new();
    run(async {
        let p = w.provider();
        let u = uid(2);
        let id = InstanceIdentity::for_uid(&u).unwrap();
        p.create(&fake_request(&u)).await.unwrap();
        assert_eq!(w.fake.calls("domain-start"), 1);

        // Shut off (a crash between define and start leaves the same): adopted, re-checked
        // on libvirt's inactive XML, started.
        w.fake.destroy("h1", &id.domain_name).await.unwrap();
        let inst = p.create(&fake_request(&u)).await.unwrap();
        assert_eq!(inst.state, InstanceState::Running);
        assert_eq!(w.fake.calls("domain-inactive-xml"), 1);
        assert_eq!(w.fake.calls("domain-start"), 2);
        assert_eq!(w.fake.calls("domain-define"), 1, "adopted, not redefined");

        // Running: adopted as it is, no re-check.
        p.create(&fake_request(&u)).await.unwrap();
        assert_eq!(w.fake.calls("domain-inactive-xml"), 1);

        // Shut off, and libvirt's definition now reads differently: not started, left.
        let xml = w
            .fake
            .inactive_xml("h1", &id.domain_name)
            .await
            .unwrap()
            .unwrap();
        assert!(xml.contains(BRIDGE_NIC), "{xml}");
        let changed = xml.replacen(BRIDGE_NIC, USER_NIC, 1);
        w.fake
            .put_domain("h1", &id.domain_name, &changed, InstanceState::ShutOff);
        let e = p.create(&fake_request(&u)).await.unwrap_err();
        let detail = assert_refused_on_libvirts_reading(&e, "found defined and not running");
        assert!(detail.contains("interface"), "{detail}");
        assert_eq!(w.fake.calls("domain-start"), 2, "not started");
        assert_eq!(w.fake.calls("domain-undefine"), 0, "not undefined");
        assert_eq!(w.fake.domains("h1"), names([id.domain_name.clone()]));
        assert_eq!(
            w.fake.domain_xml("h1", &id.domain_name).await.unwrap(),
            Some(changed)
        );
        assert_eq!(w.fake.volumes("h1"), w.with_vm(&u), "volumes kept");
    });
}

// On the harness's libvirtd (QEMU driver, through sshd). -----------------------------------

/// The sample inputs the snapshot `tests/snapshots/domain-default.xml` renders from.
fn sample_inputs() -> render::Inputs {
    let root = workspace_root().join("config/samples");
    let config = config::load_file(&root.join("providers-config.yaml")).unwrap();
    let proxy = proxy::load_manifest(&root.join("proxy_kvm2.yaml"), &config).unwrap();
    render::inputs(&config, &proxy, None, &Facts::default(), CREATED_AT).unwrap()
}

/// The default domain plugin's render of `input`, through the real template engine.
fn render_default(input: &DomainInput) -> String {
    let root = workspace_root().join("config/samples");
    let config = config::load_file(&root.join("providers-config.yaml")).unwrap();
    let mut t = config.kvm2.templates.domain.clone();
    t.path = Some(plugin_path("domain-default").unwrap().display().to_string());
    let engine = TemplateEngine::new(None).unwrap();
    engine.load_domain(&t).unwrap().render(input).unwrap()
}

/// libvirt's schema refuses a namespaced attribute: the define fails with a permanent
/// error carrying libvirt's message and defines nothing. Without validation libvirt would
/// have defined it and read the NIC as user-mode networking, which is why the flag is on.
/// A NUL byte (which the `virt` crate cannot carry) is refused before libvirt, also
/// permanently, instead of panicking.
#[test]
fn validate_refuses_what_libvirts_schema_does_not_know() {
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    let inputs = sample_inputs();
    let xml = render_default(&inputs.domain);
    assert!(xml.contains(BRIDGE_NIC), "{xml}");
    let hostile = xml.replacen(BRIDGE_NIC, NAMESPACED_NIC, 1);
    let name = inputs.domain.name.clone();
    provider_rig::run(async {
        let e = rig.ops.define("h1", hostile.clone()).await.unwrap_err();
        assert_eq!(e.class(), ErrorClass::Permanent, "{e}");
        let shown = e.to_string();
        assert!(
            shown.contains("failed to validate against schema"),
            "libvirt's message: {shown}"
        );
        assert!(rig.domains().is_empty(), "{:?}", rig.domains());

        let e = rig
            .ops
            .define("h1", xml.replacen("</domain>", "\0</domain>", 1))
            .await
            .unwrap_err();
        assert_eq!(e.class(), ErrorClass::Permanent, "{e}");
        assert!(e.to_string().contains("NUL"), "{e}");
        assert!(rig.domains().is_empty(), "{:?}", rig.domains());
        rig.hosts.close().await;
    });
    // What the flag prevents: libvirt without validation defines it as a user-mode NIC.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("namespaced.xml");
    std::fs::write(&file, &hostile).unwrap();
    rig.virsh(&["define", file.to_str().unwrap()]);
    let reading = rig.virsh(&["dumpxml", "--inactive", &name]);
    rig.virsh(&["undefine", &name]);
    assert!(reading.contains("<interface type='user'>"), "{reading}");
}

/// libvirt's schema accepts a QEMU passthrough namespace written with a character
/// reference, and libvirt reads `<q:commandline>` as raw QEMU arguments. Handed straight
/// to the host operation (no plugin-output check before it), it is defined; the
/// post-define check on libvirt's reading refuses it, naming the passthrough.
#[test]
fn post_define_check_refuses_what_libvirt_reads_as_qemu_passthrough() {
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    let inputs = sample_inputs();
    let hostile = passthrough(&render_default(&inputs.domain));
    provider_rig::run(async {
        let defined = rig.ops.define("h1", hostile).await.unwrap();
        assert_eq!(defined.name, inputs.domain.name);
        assert!(
            defined.inactive_xml.contains("<qemu:commandline>"),
            "libvirt reads it as passthrough: {}",
            defined.inactive_xml
        );
        let refusal = check_defined_domain_xml(&defined.inactive_xml, &inputs.domain);
        assert!(rig.ops.undefine("h1", &defined.name).await.unwrap());
        rig.hosts.close().await;
        let Err(TemplateErrorKind::InvalidOutput { rule, detail }) = refusal else {
            panic!("libvirt's reading passed the post-define check: {refusal:?}");
        };
        assert!(names_passthrough(&detail), "{rule}: {detail}");
    });
    assert!(rig.domains().is_empty());
}

/// The same divergence through the Create path on real libvirt: a host-operations wrapper
/// hands libvirt the passthrough form of the plugin's (checked) output, as if libvirt had
/// read the plugin's document that way. The Create refuses libvirt's reading, undefines
/// the domain, removes the VM's volumes and never starts it.
#[test]
fn create_undefines_a_domain_whose_libvirt_reading_is_refused() {
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    provider_rig::run(async {
        let ops = Arc::new(Rewrite::new(rig.ops.clone(), passthrough));
        let p = rig.provider(ops.clone());
        let u = provider_rig::uid(0x61);
        let e = p
            .create(&provider_rig::request(&u, "office"))
            .await
            .unwrap_err();
        let detail = assert_refused_on_libvirts_reading(&e, "just defined by this Create");
        assert!(names_passthrough(&detail), "{detail}");
        assert_eq!(ops.hook().defines.load(Ordering::SeqCst), 1);
        assert_eq!(ops.hook().starts.load(Ordering::SeqCst), 0, "never started");
        rig.hosts.close().await;
    });
    assert!(rig.domains().is_empty(), "{:?}", rig.domains());
    let mut base = rig.base_volumes();
    base.sort();
    assert_eq!(rig.volumes(), base, "only the shared base image stays");
}

/// The default plugin's output defined on libvirt 9.0 passes the post-define check on
/// libvirt's reading, and that reading is the fixture the checker's unit tests use
/// (`UPDATE_SNAPSHOTS=1` rewrites it when libvirt or QEMU changes what it adds).
#[test]
fn default_plugin_output_passes_the_check_on_libvirts_reading() {
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    let inputs = sample_inputs();
    let xml = render_default(&inputs.domain);
    let defined = provider_rig::run(async {
        let defined = rig.ops.define("h1", xml).await.unwrap();
        assert!(rig.ops.undefine("h1", &defined.name).await.unwrap());
        rig.hosts.close().await;
        defined
    });
    assert!(rig.domains().is_empty());
    let fixture =
        workspace_root().join("operator/src/templates/testdata/libvirt-inactive-default.xml");
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&fixture, &defined.inactive_xml).unwrap();
    }
    let expected = std::fs::read_to_string(&fixture).unwrap_or_default();
    assert!(
        expected == defined.inactive_xml,
        "{} differs from libvirt's reading; if libvirt or QEMU changed, rerun with \
         UPDATE_SNAPSHOTS=1\n--- libvirt's reading ---\n{}",
        fixture.display(),
        defined.inactive_xml
    );
    if let Err(e) = check_defined_domain_xml(&defined.inactive_xml, &inputs.domain) {
        panic!(
            "libvirt's reading of the default plugin's output fails the post-define check: {e}\n{}",
            defined.inactive_xml
        );
    }
}

/// What a plugin leaves out, libvirt fills in: on the harness's libvirtd (QEMU driver) a
/// NIC without `<model>` becomes an rtl8139, a disk `sdX` without a bus lands on SCSI with
/// an lsilogic controller, and `<graphics>` without `<video>` gets Cirrus VGA. Each is
/// refused in the plugin's output as an implied default (`model-implied`), and, handed to
/// libvirt directly (no plugin-output check before it), the post-define check refuses the
/// model libvirt wrote out (`device-model`), naming its path.
#[test]
fn implied_default_models_are_refused_in_libvirts_reading() {
    let Some(rig) = Rig::start(vec![], Rig::base_image) else {
        return;
    };
    let inputs = sample_inputs();
    let xml = render_default(&inputs.domain);
    let nic_model = r#"<model type="virtio"/>"#;
    let seed_target = r#"<target dev="vdb" bus="virtio"/>"#;
    assert!(
        xml.contains(nic_model) && xml.contains(seed_target),
        "{xml}"
    );
    let graphics = r#"<graphics type="vnc" port="-1" autoport="yes"><listen type="none"/></graphics></devices>"#;
    // (document, what libvirt writes out, path of the refusal in libvirt's reading)
    let cases = [
        (
            xml.replacen(nic_model, "", 1),
            "<model type='rtl8139'/>",
            "/domain/devices/interface/model/@type",
        ),
        (
            xml.replacen(seed_target, r#"<target dev="sda"/>"#, 1),
            "model='lsilogic'",
            "/domain/devices/controller",
        ),
        (
            xml.replacen("</devices>", graphics, 1),
            "<model type='cirrus'",
            "/domain/devices/video/model/@type",
        ),
    ];
    provider_rig::run(async {
        for (hostile, filled_in, path) in &cases {
            match egress_operator::templates::check::check_domain_xml(hostile, &inputs.domain) {
                Err(TemplateErrorKind::InvalidOutput { rule, .. }) => {
                    assert_eq!(rule, "model-implied", "{hostile}")
                }
                other => panic!("the plugin check let it through: {other:?}\n{hostile}"),
            }
            let defined = rig.ops.define("h1", hostile.clone()).await.unwrap();
            assert!(rig.ops.undefine("h1", &defined.name).await.unwrap());
            let reading = &defined.inactive_xml;
            assert!(
                reading.contains(filled_in),
                "libvirt filled in {filled_in}: {reading}"
            );
            match check_defined_domain_xml(reading, &inputs.domain) {
                Err(TemplateErrorKind::InvalidOutput { rule, detail }) => {
                    assert_eq!(rule, "device-model", "{detail}");
                    let plain: String = {
                        let mut out = String::new();
                        let mut skip = false;
                        for c in detail.chars() {
                            match c {
                                '[' => skip = true,
                                ']' => skip = false,
                                _ if !skip => out.push(c),
                                _ => {}
                            }
                        }
                        out
                    };
                    assert!(plain.contains(path), "{detail} names {path}");
                }
                other => panic!("libvirt's reading passed: {other:?}\n{reading}"),
            }
        }
        rig.hosts.close().await;
    });
    assert!(rig.domains().is_empty(), "{:?}", rig.domains());
}

/// Whether a refusal names the passthrough libvirt read: its namespace (libvirt declares
/// `xmlns:qemu` on the root of its reading) or its `commandline` element.
fn names_passthrough(detail: &str) -> bool {
    detail.contains("qemu") || detail.contains("commandline")
}

/// The plugin's XML with libvirt's QEMU passthrough namespace declared through a
/// character reference and a `<q:commandline>` in it.
fn passthrough(xml: &str) -> String {
    assert!(xml.starts_with(r#"<domain type="qemu">"#), "{xml}");
    xml.replacen(r#"<domain type="qemu">"#, QEMU_NS_BY_CHARREF, 1)
        .replacen("</domain>", PASSTHROUGH, 1)
}

/// Real host operations, except that a define hands libvirt `rewrite(xml)`; counts
/// defines and starts.
struct Rewrite {
    rewrite: fn(&str) -> String,
    defines: AtomicUsize,
    starts: AtomicUsize,
}

impl Rewrite {
    fn new(inner: Arc<dyn HostOps>, rewrite: fn(&str) -> String) -> Hooked<Self> {
        Hooked::wrap(
            inner,
            Self {
                rewrite,
                defines: AtomicUsize::new(0),
                starts: AtomicUsize::new(0),
            },
        )
    }
}

impl OpHook for Rewrite {
    fn before<'a>(
        &'a self,
        op: &'static str,
        _host: &'a str,
        _target: Option<&'a str>,
    ) -> BoxFuture<'a, Result<(), OpsError>> {
        match op {
            "domain-define" => self.defines.fetch_add(1, Ordering::SeqCst),
            "domain-start" => self.starts.fetch_add(1, Ordering::SeqCst),
            _ => 0,
        };
        Box::pin(std::future::ready(Ok(())))
    }
    fn define_xml(&self, xml: String) -> String {
        (self.rewrite)(&xml)
    }
}
