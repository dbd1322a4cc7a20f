//! Local mode: create or delete one Proxy's VM from files, without a cluster.
//!
//! `egress-operator provision` runs exactly the provider code the controller runs (same
//! image cache, same templates, same Create steps), so it is both the demo and the
//! quickest way for a site to try a host before deploying the operator.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::proxy::{self, ProxyManifest};
use crate::config::{self, ValidConfig};
use crate::instance::{self, InstanceIdentity};
use crate::provider::decorate::{ProviderMetrics, Traced};
use crate::provider::kvm2::backend::{Kvm2Options, Kvm2Provider};
use crate::provider::kvm2::hosts::Hosts;
use crate::provider::kvm2::image::{ImageMetrics, ProgressFn, UploadProgress};
use crate::provider::kvm2::libvirt::BlockingPool;
use crate::provider::kvm2::observe::CallMetrics;
use crate::provider::kvm2::ops::{HostOps, LibvirtOps};
use crate::provider::{CreateRequest, Instance, InstanceId, Provider, ProxyRef, UserData};
use crate::templates::{TemplateEngine, TemplateSet};

/// What to do.
#[derive(Debug, Clone)]
pub struct ProvisionArgs {
    /// Providers config.
    pub config: PathBuf,
    /// Proxy manifest.
    pub proxy: PathBuf,
    /// cloud-init user-data file (stands in for the Proxy's Secret).
    pub user_data: Option<PathBuf>,
    /// Delete instead of create.
    pub delete: bool,
    /// Load `path` plugins from this directory instead (same file names).
    pub plugin_dir: Option<PathBuf>,
    /// Compiled plugin cache.
    pub cache_dir: Option<PathBuf>,
    /// Print the domain XML after creating.
    pub show_xml: bool,
    /// After the VM runs, wait this long for a guest address.
    pub wait_address: Duration,
    /// After the VM runs, wait this long for its proxy to answer the probe (zero: do not
    /// probe).
    pub wait_serving: Duration,
    /// Draw a progress bar for image uploads.
    pub progress: bool,
    /// How long a guest may take to shut down on delete before it is destroyed.
    pub shutdown_timeout: Duration,
}

/// A failure of `provision`, as text for the terminal (the provider's typed errors are
/// already in the message, with their class).
pub type ProvisionError = String;

fn load(args: &ProvisionArgs) -> Result<(ValidConfig, ProxyManifest), ProvisionError> {
    let config = config::load_file(&args.config).map_err(|e| e.to_string())?;
    let manifest = proxy::load_manifest(&args.proxy, &config).map_err(|e| e.to_string())?;
    Ok((config, manifest))
}

fn owner(manifest: &ProxyManifest) -> ProxyRef {
    let meta = &manifest.metadata;
    ProxyRef {
        namespace: meta.namespace.clone(),
        name: meta.name.clone(),
        uid: meta
            .rest
            .get("uid")
            .and_then(|v| v.as_str())
            .map(str::to_string)
            .unwrap_or_else(|| instance::name_based_uid(&meta.namespace, &meta.name)),
    }
}

fn templates(config: &ValidConfig, args: &ProvisionArgs) -> Result<TemplateSet, ProvisionError> {
    let mut t = config.kvm2.templates.clone();
    if let Some(dir) = &args.plugin_dir {
        for c in [&mut t.domain, &mut t.vendor_data] {
            if let Some(file) = c.path.as_deref().and_then(|p| Path::new(p).file_name()) {
                c.path = Some(dir.join(file).display().to_string());
            }
        }
    }
    let engine = TemplateEngine::new(args.cache_dir.as_deref()).map_err(|e| e.to_string())?;
    let set = TemplateSet::load(&engine, &t);
    for h in set.health() {
        if let Some(problem) = h.problem {
            return Err(format!("template plugin {}: {problem}", h.plugin));
        }
    }
    Ok(set)
}

/// A text progress bar on stderr, redrawn at most every 200 ms.
fn progress_bar() -> ProgressFn {
    let last = std::sync::Mutex::new(None::<Instant>);
    Arc::new(move |p: &UploadProgress| {
        let now = Instant::now();
        let Ok(mut last) = last.lock() else { return };
        let finished = p.done >= p.total;
        if !finished && last.is_some_and(|t| now.duration_since(t) < Duration::from_millis(200)) {
            return;
        }
        *last = Some(now);
        let width = 30u64;
        let filled = (p.done.saturating_mul(width))
            .checked_div(p.total)
            .unwrap_or(width);
        let bar: String = (0..width)
            .map(|i| if i < filled { '#' } else { '.' })
            .collect();
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r  uploading {} to {}: [{bar}] {:>5.1}% {}/{} MiB",
            p.image,
            p.host,
            (p.done as f64 / p.total.max(1) as f64) * 100.0,
            p.done >> 20,
            p.total >> 20
        );
        if finished {
            let _ = writeln!(err);
        }
    })
}

/// Runs `provision` and writes what happened to `out`.
pub async fn provision(args: &ProvisionArgs, out: &mut dyn Write) -> Result<(), ProvisionError> {
    let (config, manifest) = load(args)?;
    let config = Arc::new(config);
    let owner = owner(&manifest);
    let io = |e: std::io::Error| e.to_string();
    let hosts = Arc::new(
        Hosts::new(
            &config.kvm2.ssh,
            &config.kvm2.hosts,
            BlockingPool::default(),
            Arc::new(CallMetrics::unregistered()),
        )
        .map_err(|e| e.to_string())?,
    );
    let ops: Arc<dyn HostOps> = Arc::new(LibvirtOps::new(hosts.clone()));
    let templates = if args.delete {
        // Deleting renders nothing; a broken plugin must not stop a cleanup.
        Arc::new(TemplateSet::load(
            &TemplateEngine::new(None).map_err(|e| e.to_string())?,
            &config.kvm2.templates,
        ))
    } else {
        Arc::new(templates(&config, args)?)
    };
    let mut options = Kvm2Options {
        shutdown_timeout: args.shutdown_timeout,
        ..Kvm2Options::default()
    };
    if args.progress {
        options.images.progress = Some(progress_bar());
    }
    let kvm2 = Arc::new(Kvm2Provider::new(
        config.clone(),
        ops.clone(),
        templates,
        options,
        ImageMetrics::default(),
    ));
    let provider = crate::provider::decorate::Metered::new(
        Arc::new(Traced::new(kvm2.clone())),
        ProviderMetrics::default(),
    );
    let result = if args.delete {
        delete(&provider, ops.as_ref(), &config, &owner, out).await
    } else {
        create(
            &provider,
            ops.as_ref(),
            &config,
            &owner,
            &manifest,
            args,
            out,
        )
        .await
    };
    hosts.close().await;
    result
        .map_err(|e| e.to_string())
        .and_then(|r| r.map_err(io))
}

async fn create(
    provider: &dyn Provider,
    ops: &dyn HostOps,
    config: &ValidConfig,
    owner: &ProxyRef,
    manifest: &ProxyManifest,
    args: &ProvisionArgs,
    out: &mut dyn Write,
) -> Result<std::io::Result<()>, ProvisionError> {
    let user_data = match &args.user_data {
        Some(p) => Some(UserData::new(
            std::fs::read(p).map_err(|e| format!("--user-data {}: {e}", p.display()))?,
        )),
        None => None,
    };
    let req = CreateRequest {
        proxy: owner.clone(),
        spec: manifest.spec.clone(),
        user_data,
        fence: crate::provider::Fence::unfenced(),
    };
    // Whether the instance exists already: Create adopts it then, and the user should
    // be told so rather than "created". A failed listing leaves it open.
    let before = existing_on(provider, &owner.uid).await;
    let started = Instant::now();
    let mut instance = provider.create(&req).await.map_err(|e| {
        format!(
            "create failed ({}): {e}",
            crate::error::Classified::class(&e)
        )
    })?;
    let took = started.elapsed();
    let wait_address = args.wait_address.max(args.wait_serving);
    if instance.addresses.is_empty() && !wait_address.is_zero() {
        let until = Instant::now() + wait_address;
        while Instant::now() < until {
            tokio::time::sleep(Duration::from_secs(2)).await;
            match provider.get(&instance.id).await {
                Ok(i) if !i.addresses.is_empty() => {
                    instance = i;
                    break;
                }
                Ok(i) => instance = i,
                Err(e) => return Err(format!("get failed: {e}")),
            }
        }
    }
    let serving = if args.wait_serving.is_zero() {
        None
    } else {
        Some(wait_serving(provider, &config.serving, &mut instance, args.wait_serving).await?)
    };
    let xml = if args.show_xml {
        ops.domain_xml(&instance.id.host, &instance.id.name)
            .await
            .map_err(|e| e.to_string())?
    } else {
        None
    };
    Ok((|| {
        if let Some(xml) = xml {
            writeln!(out, "# ---- domain XML ----")?;
            writeln!(out, "{}", xml.trim_end())?;
        }
        print_instance(
            out,
            &instance,
            serving.as_ref().map(|(o, _)| o.is_serving()),
        )?;
        if let Some((outcome, description)) = &serving {
            let verdict = if outcome.is_serving() { "yes" } else { "no" };
            writeln!(out, "serving:   {verdict} ({description})")?;
        }
        match &before {
            Existing::Found(host) => writeln!(
                out,
                "adopted the existing instance on {host} in {:.1}s (nothing was created)",
                took.as_secs_f64()
            ),
            Existing::None => writeln!(out, "created in {:.1}s", took.as_secs_f64()),
            Existing::Unknown(why) => writeln!(
                out,
                "created or adopted in {:.1}s (whether it existed before is unknown: {why})",
                took.as_secs_f64()
            ),
        }
    })())
    .and_then(|printed| match &serving {
        Some((outcome, description)) if !outcome.is_serving() => Err(format!(
            "the proxy did not serve within {} s: {description}",
            args.wait_serving.as_secs()
        )),
        _ => Ok(printed),
    })
}

/// Probes the instance's proxy (as the controller's `Serving` condition does) until it
/// serves or `wait` is over; refreshes the instance between tries, since the address and
/// whether the guest read its seed may change while it boots. Returns the last outcome
/// and its description.
async fn wait_serving(
    provider: &dyn Provider,
    serving: &crate::config::ServingConfig,
    instance: &mut Instance,
    wait: Duration,
) -> Result<(crate::serving::ProbeOutcome, String), ProvisionError> {
    use crate::serving::{ProbeOutcome, probe};
    let until = Instant::now() + wait;
    let timeout = Duration::from_secs(u64::from(serving.timeout_seconds));
    let target = serving.target.as_deref();
    loop {
        let outcome = match instance.addresses.first() {
            Some(ip) => {
                let addr = std::net::SocketAddr::new(*ip, serving.port);
                let outcome = probe(addr, target, timeout).await;
                let description = outcome.describe(Some(addr), target);
                (outcome, description)
            }
            None => (
                ProbeOutcome::NoAddress,
                ProbeOutcome::NoAddress.describe(None, target),
            ),
        };
        if outcome.0.is_serving() {
            return Ok(outcome);
        }
        if Instant::now() >= until {
            // A hint, as the controller reads it: user-data's hostname also renames a
            // guest that read its seed, so a host name alone proves nothing.
            if instance.seed_applied == Some(false) {
                let why = format!("{}; {}", outcome.1, RENAMED_HINT);
                return Ok((outcome.0, why));
            }
            return Ok(outcome);
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
        match provider.get(&instance.id).await {
            Ok(i) => *instance = i,
            // A transient failure (a busy host, a redial) must not end a long wait; a
            // lasting one shows as the probe's outcome at the end.
            Err(e)
                if crate::error::Classified::class(&e) == crate::error::ErrorClass::Transient =>
            {
                tracing::warn!(instance = %instance.id, error = %e, "refreshing the instance failed; still waiting");
            }
            Err(e) => return Err(format!("get failed: {e}")),
        }
    }
}

/// Whether a Proxy's instance existed before a Create.
enum Existing {
    /// On this host.
    Found(String),
    /// On no host (every listing answered).
    None,
    /// A listing failed, so it may exist there.
    Unknown(String),
}

async fn existing_on(provider: &dyn Provider, uid: &str) -> Existing {
    let mut failed = Vec::new();
    for listing in provider.list().await {
        match listing.result {
            Ok(list) if list.iter().any(|i| i.proxy.uid == uid) => {
                return Existing::Found(listing.target);
            }
            Ok(_) => {}
            Err(e) => failed.push(format!("listing host {} failed: {e}", listing.target)),
        }
    }
    if failed.is_empty() {
        Existing::None
    } else {
        Existing::Unknown(failed.join("; "))
    }
}

/// Why a guest whose host name is not its seed's may not serve.
const RENAMED_HINT: &str = "the guest's host name is not its seed's local-hostname, so it may \
     never have read its cloud-init seed (or its user-data set another host name)";

/// The `seed:` line, by the controller's rule ([`crate::controller::serving::check`]): the
/// guest's host name is the seed's only when user-data does not rename it (its
/// `hostname`, `fqdn` or `preserve_hostname` win over meta-data's `local-hostname`), so a
/// name that differs is a hint and the proxy answering decides. `serving` is the probe's
/// verdict when `provision` waited for one.
fn seed_line(seed_applied: Option<bool>, serving: Option<bool>) -> Option<String> {
    let line = match (seed_applied?, serving) {
        (true, _) => "applied (the guest's host name is the seed's)".to_string(),
        (false, Some(true)) => "read (the proxy serves; the guest's host name is not the \
             seed's local-hostname because user-data set another)"
            .to_string(),
        (false, Some(false)) => {
            format!("maybe not read, since the proxy does not serve: {RENAMED_HINT}")
        }
        (false, None) => {
            format!("unknown: {RENAMED_HINT}; only the proxy answering tells (--wait-serving)")
        }
    };
    Some(format!("seed:      {line}"))
}

fn print_instance(out: &mut dyn Write, i: &Instance, serving: Option<bool>) -> std::io::Result<()> {
    let addresses = if i.addresses.is_empty() {
        "none yet".to_string()
    } else {
        i.addresses
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    writeln!(out, "instance:  {}", i.id)?;
    writeln!(
        out,
        "proxy:     {}/{} (uid {})",
        i.proxy.namespace, i.proxy.name, i.proxy.uid
    )?;
    writeln!(out, "host:      {}", i.id.host)?;
    writeln!(out, "state:     {}", i.state)?;
    writeln!(out, "addresses: {addresses}")?;
    if let Some(source) = i.address_source {
        writeln!(out, "address source: {source}")?;
    }
    if let Some(line) = seed_line(i.seed_applied, serving) {
        writeln!(out, "{line}")?;
    }
    writeln!(out, "created:   {}", i.created_at)
}

async fn delete(
    provider: &dyn Provider,
    ops: &dyn HostOps,
    config: &ValidConfig,
    owner: &ProxyRef,
    out: &mut dyn Write,
) -> Result<std::io::Result<()>, ProvisionError> {
    let identity = InstanceIdentity::for_uid(&owner.uid)?;
    // Find the host: listings say where our domain is; a Proxy pinned to a host is
    // looked up there even if the listing of another host failed.
    let mut hosts: Vec<String> = Vec::new();
    for listing in provider.list().await {
        match listing.result {
            Ok(list) if list.iter().any(|i| i.proxy.uid == owner.uid) => hosts.push(listing.target),
            Ok(_) => {}
            Err(e) => {
                return Err(format!(
                    "listing host {} failed ({e}); not deleting blind",
                    listing.target
                ));
            }
        }
    }
    if hosts.is_empty() {
        // No domain anywhere: volumes may still be left from a half-deleted instance.
        hosts = config.kvm2.hosts.iter().map(|h| h.name.clone()).collect();
    }
    for host in &hosts {
        let id = InstanceId {
            host: host.clone(),
            name: identity.domain_name.clone(),
        };
        provider
            .delete(&id)
            .await
            .map_err(|e| format!("delete on {host} failed: {e}"))?;
    }
    // Show that nothing is left.
    let mut lines = Vec::new();
    for h in &config.kvm2.hosts {
        let domain = ops
            .domain(&h.name, &identity.domain_name)
            .await
            .map_err(|e| e.to_string())?;
        let mut left = Vec::new();
        if domain.is_some() {
            left.push(format!("domain {}", identity.domain_name));
        }
        for v in [&identity.root_volume, &identity.seed_volume] {
            if ops
                .volume(&h.name, &h.storage_pool, v)
                .await
                .map_err(|e| e.to_string())?
                .is_some()
            {
                left.push(format!("volume {v}"));
            }
        }
        if !left.is_empty() {
            return Err(format!(
                "host {}: still there after delete: {}",
                h.name,
                left.join(", ")
            ));
        }
        lines.push(format!(
            "host {}: no domain {}, no volumes {} / {}",
            h.name, identity.domain_name, identity.root_volume, identity.seed_volume
        ));
    }
    Ok((|| {
        writeln!(
            out,
            "deleted {}/{} (uid {})",
            owner.namespace, owner.name, owner.uid
        )?;
        for l in &lines {
            writeln!(out, "{l}")?;
        }
        writeln!(out, "nothing left")
    })())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A guest whose user-data sets `hostname` read its seed and serves: `provision` must
    /// not call its seed "NOT applied" (issue 19, finding 1, as `provision` showed it).
    #[test]
    fn a_renamed_guest_that_serves_read_its_seed() {
        let line = seed_line(Some(false), Some(true)).unwrap_or_default();
        assert!(line.starts_with("seed:      read"), "{line}");
        let lower = line.to_lowercase();
        assert!(
            !lower.contains("not applied") && !lower.contains("not read"),
            "{line}"
        );
    }

    #[test]
    fn the_seed_line_follows_the_controllers_rule() {
        assert_eq!(
            seed_line(Some(true), None).as_deref(),
            Some("seed:      applied (the guest's host name is the seed's)")
        );
        let failing = seed_line(Some(false), Some(false)).unwrap_or_default();
        assert!(failing.contains("maybe not read"), "{failing}");
        assert!(failing.contains("user-data"), "{failing}");
        let unprobed = seed_line(Some(false), None).unwrap_or_default();
        assert!(unprobed.starts_with("seed:      unknown"), "{unprobed}");
        assert!(unprobed.contains("--wait-serving"), "{unprobed}");
        assert_eq!(
            seed_line(None, Some(true)),
            None,
            "no agent: nothing to say"
        );
    }
}
