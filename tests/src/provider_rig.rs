//! The rig of the provider tests: daemons, a storage pool, an image server, and a
//! kvm2 provider over them (or over a fault-injecting wrapper), plus the request shapes
//! the tests use.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test rig: failures are test failures

use std::sync::Arc;
use std::time::Duration;

use egress_operator::api::proxy::ProxySpec;
use egress_operator::config::ValidConfig;
use egress_operator::instance::{image_marker_name, image_volume_name};
use egress_operator::provider::kvm2::backend::{Kvm2Options, Kvm2Provider};
use egress_operator::provider::kvm2::hosts::Hosts;
use egress_operator::provider::kvm2::image::{ImageCacheOptions, ImageMetrics};
use egress_operator::provider::kvm2::libvirt::BlockingPool;
use egress_operator::provider::kvm2::observe::CallMetrics;
use egress_operator::provider::kvm2::ops::{HostOps, LibvirtOps};
use egress_operator::provider::{CreateRequest, ProxyRef, UserData};
use egress_operator::templates::{TemplateEngine, TemplateSet};

use crate::harness::{self, Libvirtd, Need, Sshd};
use crate::http::{HttpServer, Route};
use crate::{TestImage, provider_config, small_qcow2};

/// The rig's libvirt call deadline (production: 30 s).
const RIG_CALL_DEADLINE: Duration = Duration::from_secs(120);

/// Everything one test needs: daemons, a pool, an image server, a provider.
pub struct Rig {
    /// OpenSSH's sshd on 127.0.0.1.
    pub sshd: Sshd,
    /// The isolated libvirtd.
    pub libvirtd: Libvirtd,
    /// Directory of the `default` pool.
    pub pool_dir: std::path::PathBuf,
    /// Where the served image files live.
    pub images_dir: tempfile::TempDir,
    /// The image server.
    pub http: HttpServer,
    /// The providers config (host `h1`).
    pub config: Arc<ValidConfig>,
    /// The hosts table (close it at the end of a test).
    pub hosts: Arc<Hosts>,
    /// Real host operations through the tunnel.
    pub ops: Arc<dyn HostOps>,
    /// sha256 of `/base.qcow2`.
    pub image_sha: String,
}

impl std::fmt::Debug for Rig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rig")
            .field("sshd", &self.sshd)
            .field("libvirtd", &self.libvirtd)
            .finish_non_exhaustive()
    }
}

impl Rig {
    /// Starts everything; `None` (after printing why) where the daemons cannot run.
    pub fn start(
        extra_routes: Vec<(String, Route)>,
        images: impl Fn(&HttpServer, &str) -> Vec<TestImage>,
    ) -> Option<Rig> {
        if harness::skip(&[Need::Sshd, Need::Libvirtd]) {
            return None;
        }
        if which("qemu-img").is_none() && harness::cannot_run("qemu-img is missing") {
            return None;
        }
        let sshd = Sshd::start().unwrap();
        let libvirtd = Libvirtd::start().unwrap();
        let pool_dir = libvirtd.define_dir_pool("default").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (path, sha) = small_qcow2(dir.path(), "base").unwrap();
        let mut routes = vec![("/base.qcow2".to_string(), Route::File(path))];
        routes.extend(extra_routes);
        let http = HttpServer::start(routes).unwrap();
        let config =
            Arc::new(provider_config(&sshd, &libvirtd, "h1", &images(&http, &sha), &[]).unwrap());
        let hosts = Arc::new(
            Hosts::new(
                &config.kvm2.ssh,
                &config.kvm2.hosts,
                BlockingPool::default(),
                Arc::new(CallMetrics::unregistered()),
            )
            .unwrap()
            // A hang guard, not the production deadline: six rigs (each a libvirtd
            // pinned to one core, spawning qemu-img) share this machine's two cores,
            // and CI once saw a seed volume-create wait 30 s behind them.
            .with_call_deadline(RIG_CALL_DEADLINE),
        );
        let ops: Arc<dyn HostOps> = Arc::new(LibvirtOps::new(hosts.clone()));
        Some(Rig {
            sshd,
            libvirtd,
            pool_dir,
            images_dir: dir,
            http,
            config,
            hosts,
            ops,
            image_sha: sha,
        })
    }

    /// The one image every rig serves: `/base.qcow2`, named `base`.
    pub fn base_image(http: &HttpServer, sha: &str) -> Vec<TestImage> {
        vec![TestImage {
            name: "base".into(),
            url: http.url("/base.qcow2"),
            sha256: sha.into(),
            max_size_mib: None,
        }]
    }

    /// A provider over `ops` (the rig's own, or a wrapper of it), with short waits.
    pub fn provider(&self, ops: Arc<dyn HostOps>) -> Kvm2Provider {
        let engine = TemplateEngine::new(None).unwrap();
        let templates = Arc::new(TemplateSet::load(&engine, &self.config.kvm2.templates));
        self.provider_with(ops, templates)
    }

    /// [`Rig::provider`] with plugins loaded elsewhere (another source, engine options).
    pub fn provider_with(
        &self,
        ops: Arc<dyn HostOps>,
        templates: Arc<TemplateSet>,
    ) -> Kvm2Provider {
        assert!(templates.is_healthy(), "{:?}", templates.health());
        let images = ImageCacheOptions {
            // A crashed uploader's staging volume is taken over quickly here.
            stale_after: Duration::from_secs(3),
            poll_every: Duration::from_millis(200),
            ..ImageCacheOptions::default()
        };
        let options = Kvm2Options {
            images,
            start_timeout: Duration::from_secs(60),
            shutdown_timeout: Duration::from_secs(2),
            ..Kvm2Options::default()
        };
        Kvm2Provider::new(
            self.config.clone(),
            ops,
            templates,
            options,
            ImageMetrics::default(),
        )
    }

    /// virsh against the rig's libvirtd; panics on failure (tests only).
    pub fn virsh(&self, args: &[&str]) -> String {
        self.libvirtd
            .virsh(&self.libvirtd.qemu_uri(), args)
            .unwrap()
    }

    /// Volume names in the pool.
    pub fn volumes(&self) -> Vec<String> {
        self.virsh(&["pool-refresh", "default"]);
        let mut v: Vec<String> = self
            .virsh(&["vol-list", "default"])
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .map(String::from)
            .collect();
        v.sort();
        v
    }

    /// Domain names (all states).
    pub fn domains(&self) -> Vec<String> {
        self.virsh(&["list", "--all", "--name"])
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect()
    }

    /// The cached base image's data and marker volumes, and this cluster's announcement
    /// that it uses it (written by the first Create that made sure of the base).
    pub fn base_volumes(&self) -> Vec<String> {
        vec![
            image_volume_name(&self.image_sha),
            image_marker_name(&self.image_sha),
            egress_operator::instance::image_use_name("test", None),
        ]
    }
}

/// The full path of a program on PATH.
pub fn which(name: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(name))
            .find(|c| c.exists())
    })
}

/// A Create for Proxy `default/NAME` with this UID, pinned to host `h1`, with user-data.
pub fn request(uid: &str, name: &str) -> CreateRequest {
    CreateRequest {
        proxy: ProxyRef {
            namespace: "default".into(),
            name: name.into(),
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
        user_data: Some(UserData::new(
            b"#cloud-config\npassword: not-in-any-log\n".to_vec(),
        )),
        fence: egress_operator::provider::Fence::unfenced(),
    }
}

/// A valid UID numbered `n`.
pub fn uid(n: u8) -> String {
    format!("0b7c3c1e-9a43-4f5e-a1d2-3c4b5a6978{n:02x}")
}

/// Generous guard: a hang fails the test instead of blocking CI; not a timing assertion.
pub const HANG_GUARD: Duration = Duration::from_secs(300);

/// The provider tests start daemons and QEMU; one at a time keeps a 2-core machine
/// responsive.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs one test body on its own runtime, serialised with the other rig tests of the same
/// binary and under [`HANG_GUARD`].
pub fn run<F: std::future::Future>(f: F) -> F::Output {
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
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
