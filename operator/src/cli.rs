//! The command line: one subcommand per job, each a thin layer over the library.
//!
//! Commands print results on stdout and problems on stderr, and return the process exit
//! code, so they can be tested in-process and scripted in CI.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config;

/// Operator for egress proxy VMs on remote KVM/libvirt hosts.
#[derive(Debug, Parser)]
#[command(name = "egress-operator", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the JSON Schema of the providers config.
    ConfigSchema,
    /// Print the CustomResourceDefinitions (Proxy, ProviderHealth, ProxyPool) as YAML, as
    /// `config/crd/` holds them.
    Crd,
    /// Print every rule plugin output is checked against: the allow-list of domain XML,
    /// the values tied to the input, firmware, host bounds, vendor-data and settings
    /// schema rules (Markdown, as `templates-sdk/src/rules.md` holds it).
    #[command(alias = "allow-list")]
    Rules,
    /// Validate a providers config file and print every problem it has: the config
    /// itself, Proxy manifests against it, and the settings of each template plugin it
    /// can load here (and the manifests' overrides of them), as the plugin checks them.
    ValidateConfig(ValidateConfigArgs),
    /// Render the domain XML and vendor-data of a Proxy with the configured template
    /// plugins, exactly as the operator would, and print them (or write them to --out).
    Render(RenderArgs),
    /// Dial each configured host (a dedicated connection each) and report what a proxy
    /// needs: reachability, host key, libvirt and hypervisor versions, KVM, pool, bridge,
    /// image cache. Exits non-zero if any host fails.
    Check(CheckArgs),
    /// Run the operator in a cluster: the Proxy controller, garbage collector and provider
    /// health monitor (while holding the leader Lease), and /metrics, /healthz, /readyz.
    Run(crate::run::RunArgs),
    /// Create (or with --delete, remove) one Proxy's VM from files, without a cluster,
    /// through the same provider code the operator runs, and print its status.
    Provision(ProvisionCliArgs),
    /// Write and test template plugins: `plugin new` writes a standalone plugin crate,
    /// `plugin test` renders a built plugin for a matrix of inputs through the operator's
    /// checks.
    #[command(subcommand)]
    Plugin(PluginCommand),
}

/// Subcommands of `plugin`.
#[derive(Debug, Subcommand)]
pub enum PluginCommand {
    /// Write a new plugin crate (buildable anywhere with `cargo build --release --target
    /// wasm32-wasip2`): an example that passes the operator's checks, a settings type, a
    /// test, a README, and a copy of the SDK.
    New(PluginNewArgs),
    /// Render a built plugin for BIOS and UEFI machine types, one and three NICs, a static
    /// address and DHCP, on each host of a config (or a sample host), and once more for
    /// each value of its own enum and boolean settings; check every output as the operator
    /// does, and print a table. Exits non-zero when any case fails.
    Test(PluginTestArgs),
    /// Publish a built plugin to an OCI registry as an artifact (artifactType
    /// `application/vnd.egress-operator.plugin.v1+wasm`, one layer
    /// `application/vnd.wasm.content.layer.v1+wasm`) and print the digest-pinned
    /// `oci://` reference to configure.
    Push(PluginPushArgs),
}

/// Arguments of `plugin push`.
#[derive(Debug, clap::Args)]
pub struct PluginPushArgs {
    /// The built component (`target/wasm32-wasip2/release/<crate_name>.wasm`).
    pub plugin: PathBuf,
    /// Where to push it: `oci://REGISTRY/REPOSITORY:TAG` (no digest: the push prints it).
    pub reference: String,
    /// Registry credentials: a Docker config JSON (`~/.docker/config.json`, or the
    /// `.dockerconfigjson` of a Secret) with an `auths` entry for the registry.
    #[arg(long, value_name = "FILE")]
    pub credentials_file: Option<PathBuf>,
    /// Trust only these PEM certificates for the registry (a private CA).
    #[arg(long, value_name = "PEM")]
    pub ca_file: Option<PathBuf>,
}

/// Arguments of `plugin new`.
#[derive(Debug, clap::Args)]
pub struct PluginNewArgs {
    /// What the plugin renders.
    #[arg(long, value_enum)]
    pub kind: crate::authoring::Kind,
    /// The crate name (lower-case letters, digits, `-`, `_`).
    pub name: String,
    /// Write the crate here (must not exist, or be empty); `./NAME` by default.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

/// Arguments of `plugin test`.
#[derive(Debug, clap::Args)]
pub struct PluginTestArgs {
    /// The built component (`target/wasm32-wasip2/release/<crate_name>.wasm`), or an
    /// `oci://REGISTRY/REPOSITORY:TAG@sha256:DIGEST` reference to pull (with --cache-dir,
    /// the pull is recorded so `validate-config --plugin-cache-dir` needs no registry).
    pub plugin: PathBuf,
    /// Registry credentials for an `oci://` plugin (a Docker config JSON).
    #[arg(long, value_name = "FILE")]
    pub credentials_file: Option<PathBuf>,
    /// Trust only these PEM certificates for an `oci://` plugin's registry.
    #[arg(long, value_name = "PEM")]
    pub ca_file: Option<PathBuf>,
    /// What the plugin renders; found from its exports when left out.
    #[arg(long, value_enum)]
    pub kind: Option<crate::authoring::Kind>,
    /// The plugin's settings (YAML or JSON), as `kvm2.templates.<kind>.settings` would hold
    /// them; `{}` when left out.
    #[arg(long, value_name = "FILE")]
    pub settings: Option<PathBuf>,
    /// Render for the hosts and machine types of this providers config instead of a sample.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Write each case's output (or refusal) into this directory for review.
    #[arg(long, value_name = "DIR")]
    pub snapshot: Option<PathBuf>,
    /// Cache compiled plugins here.
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Host fact: KVM is available.
    #[arg(long)]
    pub kvm: bool,
    /// Host fact: CPUs online (a `cpuset` past them is refused).
    #[arg(long, default_value_t = 2)]
    pub host_cpus: u32,
    /// Host fact: NUMA nodes.
    #[arg(long, default_value_t = 1)]
    pub numa_nodes: u32,
}

/// Arguments of `validate-config`.
#[derive(Debug, clap::Args)]
pub struct ValidateConfigArgs {
    /// The providers config (YAML).
    pub file: PathBuf,
    /// Also check Proxy manifests against the config.
    #[arg(long = "proxy", value_name = "FILE")]
    pub proxies: Vec<PathBuf>,
    /// Load plugins configured by `path` from this directory instead (same file names).
    #[arg(long, value_name = "DIR")]
    pub plugin_dir: Option<PathBuf>,
    /// The operator's compiled-plugin cache: a `url` plugin cached there is checked
    /// without a download.
    #[arg(long, value_name = "DIR")]
    pub plugin_cache_dir: Option<PathBuf>,
    /// Trust these PEM certificates for `url` plugin downloads.
    #[arg(long, value_name = "PEM")]
    pub plugin_ca_file: Option<PathBuf>,
    /// Do not load the plugins (check the config and manifests only).
    #[arg(long)]
    pub no_plugins: bool,
}

/// Arguments of `provision`.
#[derive(Debug, clap::Args)]
pub struct ProvisionCliArgs {
    /// The providers config (YAML).
    #[arg(long)]
    pub config: PathBuf,
    /// The Proxy manifest (YAML).
    #[arg(long)]
    pub proxy: PathBuf,
    /// cloud-init user-data file (in a cluster it comes from the Proxy's Secret).
    #[arg(long, value_name = "FILE")]
    pub user_data: Option<PathBuf>,
    /// Delete the Proxy's VM and its volumes, then show that nothing is left.
    #[arg(long)]
    pub delete: bool,
    /// Load plugins configured by `path` from this directory instead (same file names).
    #[arg(long, value_name = "DIR")]
    pub plugin_dir: Option<PathBuf>,
    /// Cache compiled plugins here.
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Print the domain XML of the created VM.
    #[arg(long)]
    pub show_xml: bool,
    /// After the VM runs, wait up to this many seconds for its address.
    #[arg(long, default_value_t = 0)]
    pub wait_address_seconds: u64,
    /// After the VM runs, wait up to this many seconds until its proxy answers the probe
    /// of the config's `serving` section; exit non-zero if it does not.
    #[arg(long, default_value_t = 0)]
    pub wait_serving_seconds: u64,
    /// Do not draw the upload progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// With --delete: how long the guest may take to shut down before it is destroyed.
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout_seconds: u64,
}

/// Arguments of `check`.
#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// The providers config (YAML).
    #[arg(long)]
    pub config: PathBuf,
    /// Check only this host.
    #[arg(long)]
    pub host: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value = "table")]
    pub output: OutputFormat,
    /// Budget of each host's check, in seconds.
    #[arg(long, default_value_t = 30)]
    pub timeout_seconds: u64,
}

/// How to print a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// For people.
    Table,
    /// For machines.
    Json,
}

/// Arguments of `render`.
#[derive(Debug, clap::Args)]
pub struct RenderArgs {
    /// The providers config (YAML).
    #[arg(long)]
    pub config: PathBuf,
    /// The Proxy manifest (YAML).
    #[arg(long)]
    pub proxy: PathBuf,
    /// Render for this host instead of the Proxy's (or the first configured) host.
    #[arg(long)]
    pub host: Option<String>,
    /// Write `domain.xml` and `vendor-data` into this directory instead of printing.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Load plugins configured by `path` from this directory instead (same file names),
    /// e.g. `target/plugins` after `make plugins`.
    #[arg(long, value_name = "DIR")]
    pub plugin_dir: Option<PathBuf>,
    /// Cache compiled plugins here.
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Trust only these PEM certificates for `url` plugin downloads and `oci://` pulls.
    #[arg(long, value_name = "PEM")]
    pub plugin_ca_file: Option<PathBuf>,
    /// Host fact: KVM is available.
    #[arg(long)]
    pub kvm: bool,
    /// Host fact: guest architecture.
    #[arg(long, default_value = "x86_64")]
    pub arch: String,
    /// Host fact: libvirt version.
    #[arg(long, default_value = "9.0.0")]
    pub libvirt_version: String,
    /// Host fact: CPUs online.
    #[arg(long, default_value_t = 2)]
    pub host_cpus: u32,
    /// Host fact: NUMA nodes.
    #[arg(long, default_value_t = 1)]
    pub numa_nodes: u32,
    /// Creation time written into the metadata mark (RFC 3339); now when left out.
    #[arg(long)]
    pub created_at: Option<String>,
}

/// Runs one command, writing to the process's stdout and stderr.
pub fn run(cli: Cli) -> ExitCode {
    if let Command::Run(args) = &cli.command {
        // Before the runtime starts its threads (see `allocator`).
        let arenas = crate::allocator::limit_arenas();
        // The operator logs to stderr from many threads: holding the stderr lock here, as
        // the one-shot commands do, would block every log line.
        crate::telemetry::init_with("info", args.log_format);
        tracing::debug!(?arenas, "malloc arenas");
        return ExitCode::from(crate::run::run(args, &mut std::io::stderr()).unwrap_or(2));
    }
    crate::telemetry::init("warn");
    // Unlocked handles: each write takes the lock for itself. Holding stderr's lock for
    // the whole command would block every log line (and `provision`'s progress bar) from
    // the runtime's other threads, and the command waits on those threads: a deadlock.
    let mut out = std::io::stdout();
    let mut err = std::io::stderr();
    ExitCode::from(execute(cli.command, &mut out, &mut err))
}

/// Runs one command against the given writers and returns the exit code
/// (0 success, 1 the input was refused, 2 an output error).
pub fn execute(command: Command, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let result = match command {
        Command::ConfigSchema => out.write_all(config::json_schema().as_bytes()).map(|_| 0),
        Command::Crd => crd(out, err),
        Command::Rules => out
            .write_all(crate::templates::check::rules_markdown().as_bytes())
            .map(|_| 0),
        Command::ValidateConfig(args) => crate::validate_config::run(
            &args.file,
            &crate::validate_config::ValidateOptions {
                proxies: args.proxies,
                plugin_dir: args.plugin_dir,
                plugin_cache_dir: args.plugin_cache_dir,
                plugin_ca_file: args.plugin_ca_file,
                skip_plugins: args.no_plugins,
            },
            out,
            err,
        ),
        Command::Render(args) => render(&args, out, err),
        Command::Check(args) => check(&args, out, err),
        Command::Provision(args) => provision(&args, out, err),
        Command::Run(args) => crate::run::run(&args, err),
        Command::Plugin(PluginCommand::New(args)) => plugin_new(&args, out, err),
        Command::Plugin(PluginCommand::Test(args)) => plugin_test(&args, out, err),
        Command::Plugin(PluginCommand::Push(args)) => plugin_push(&args, out, err),
    };
    result.unwrap_or(2)
}

fn plugin_new(
    args: &PluginNewArgs,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> std::io::Result<u8> {
    let dir = args
        .dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(&args.name));
    match crate::authoring::scaffold::create(args.kind, &args.name, &dir) {
        Ok(files) => {
            writeln!(
                out,
                "wrote {} ({} files); next:\n  cd {}\n  cargo build --release --target wasm32-wasip2\n  egress-operator plugin test target/wasm32-wasip2/release/{}.wasm",
                dir.display(),
                files.len(),
                dir.display(),
                crate::authoring::scaffold::crate_name(&args.name)
            )?;
            Ok(0)
        }
        Err(e) => {
            writeln!(err, "{e}")?;
            Ok(1)
        }
    }
}

fn plugin_test(
    args: &PluginTestArgs,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> std::io::Result<u8> {
    let opts = crate::authoring::runner::TestOptions {
        plugin: args.plugin.clone(),
        kind: args.kind,
        settings: args.settings.clone(),
        config: args.config.clone(),
        snapshot: args.snapshot.clone(),
        cache_dir: args.cache_dir.clone(),
        credentials_file: args.credentials_file.clone(),
        ca_file: args.ca_file.clone(),
        facts: crate::render::Facts {
            kvm: args.kvm,
            cpus: args.host_cpus,
            numa_nodes: args.numa_nodes,
            ..crate::render::Facts::default()
        },
    };
    match crate::authoring::runner::run(&opts) {
        Ok(report) => {
            out.write_all(crate::authoring::table::render(&report).as_bytes())?;
            Ok(if report.passed() { 0 } else { 1 })
        }
        Err(crate::authoring::AuthoringError::Plugin(e)) => {
            // Settings refusals one per line, each with its JSON pointer.
            match &e.kind {
                crate::templates::TemplateErrorKind::Settings { issues } => {
                    let source = args
                        .settings
                        .as_ref()
                        .map(|p| p.display().to_string())
                        .unwrap_or_else(|| "settings {} (no --settings given)".into());
                    writeln!(err, "{source}: refused by plugin {:?}:", e.plugin)?;
                    for issue in issues {
                        writeln!(err, "  {issue}")?;
                    }
                }
                _ => writeln!(err, "{e}")?,
            }
            Ok(1)
        }
        Err(e) => {
            writeln!(err, "{e}")?;
            Ok(1)
        }
    }
}

fn plugin_push(
    args: &PluginPushArgs,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> std::io::Result<u8> {
    match crate::authoring::push::push(
        &args.plugin,
        &args.reference,
        args.credentials_file.as_deref(),
        args.ca_file.as_deref(),
    ) {
        Ok(pushed) => {
            writeln!(
                out,
                "pushed {} ({} bytes) to {}\n  wasm layer sha256:{} ({})\n\
                 configure it in kvm2.templates.<domain|vendorData> as\nurl: {}",
                args.plugin.display(),
                pushed.size,
                pushed.target,
                pushed.layer_sha256,
                crate::templates::oci::WASM_LAYER_MEDIA_TYPE,
                pushed.reference
            )?;
            Ok(0)
        }
        Err(e) => {
            writeln!(err, "{e}")?;
            Ok(1)
        }
    }
}

fn crd(out: &mut dyn Write, err: &mut dyn Write) -> std::io::Result<u8> {
    match crate::api::crds_yaml() {
        Ok(yaml) => out.write_all(yaml.as_bytes()).map(|_| 0),
        Err(e) => {
            writeln!(err, "cannot write the CRDs as YAML: {e}")?;
            Ok(2)
        }
    }
}

fn render(args: &RenderArgs, out: &mut dyn Write, err: &mut dyn Write) -> std::io::Result<u8> {
    match render_inner(args) {
        Ok((xml, vendor_data)) => match &args.out {
            Some(dir) => {
                std::fs::create_dir_all(dir)?;
                std::fs::write(dir.join("domain.xml"), &xml)?;
                std::fs::write(dir.join("vendor-data"), &vendor_data)?;
                writeln!(
                    out,
                    "wrote {0}/domain.xml and {0}/vendor-data",
                    dir.display()
                )?;
                Ok(0)
            }
            None => {
                writeln!(out, "# ---- domain.xml ----")?;
                out.write_all(xml.as_bytes())?;
                writeln!(out, "# ---- vendor-data ----")?;
                out.write_all(vendor_data.as_bytes())?;
                Ok(0)
            }
        },
        Err(message) => {
            writeln!(err, "{message}")?;
            Ok(1)
        }
    }
}

fn render_inner(args: &RenderArgs) -> Result<(String, String), String> {
    use crate::templates::TemplateEngine;

    let config = config::load_file(&args.config).map_err(|e| e.to_string())?;
    let proxy =
        crate::api::proxy::load_manifest(&args.proxy, &config).map_err(|e| e.to_string())?;
    let facts = crate::render::Facts {
        arch: args.arch.clone(),
        kvm: args.kvm,
        libvirt_version: args.libvirt_version.clone(),
        cpus: args.host_cpus,
        numa_nodes: args.numa_nodes,
    };
    let created_at = match &args.created_at {
        Some(t) => t.clone(),
        None => humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
    };
    let inputs = crate::render::inputs(&config, &proxy, args.host.as_deref(), &facts, &created_at)?;
    let mut templates = config.kvm2.templates.clone();
    for t in [&mut templates.domain, &mut templates.vendor_data] {
        *t = crate::validate_config::entry_in(t, args.plugin_dir.as_deref());
    }
    let download_ca_pem = match &args.plugin_ca_file {
        Some(p) => {
            Some(std::fs::read(p).map_err(|e| format!("--plugin-ca-file {}: {e}", p.display()))?)
        }
        None => None,
    };
    let engine = TemplateEngine::with_options(&crate::templates::EngineOptions {
        cache_dir: args.cache_dir.clone(),
        download_ca_pem,
    })
    .map_err(|e| e.to_string())?;
    let domain = engine
        .load_domain(&templates.domain)
        .map_err(|e| e.to_string())?;
    let vendor = engine
        .load_vendor_data(&templates.vendor_data)
        .map_err(|e| e.to_string())?;
    // The manifest's own settings overrides, as the operator would merge them.
    let xml = domain
        .render_on(
            &inputs.domain,
            inputs.overrides.domain.as_ref(),
            &crate::templates::check::HostPolicy::for_render(&inputs.host, &inputs.domain),
        )
        .map_err(|e| e.to_string())?;
    let vendor_data = vendor
        .render_with(&inputs.vendor_data, inputs.overrides.vendor_data.as_ref())
        .map_err(|e| e.to_string())?;
    Ok((xml, vendor_data))
}

fn check(args: &CheckArgs, out: &mut dyn Write, err: &mut dyn Write) -> std::io::Result<u8> {
    use crate::provider::kvm2::check::{check_host, table};
    use crate::provider::kvm2::libvirt::BlockingPool;

    let config = match config::load_file(&args.config) {
        Ok(c) => c,
        Err(e) => {
            crate::validate_config::report(&e, err)?;
            return Ok(1);
        }
    };
    let hosts: Vec<_> = match &args.host {
        Some(name) => match config.host(name) {
            Some(h) => vec![h.clone()],
            None => {
                writeln!(err, "host {name:?} is not in {}", args.config.display())?;
                return Ok(1);
            }
        },
        None => config.kvm2.hosts.clone(),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            writeln!(err, "cannot start the async runtime: {e}")?;
            return Ok(2);
        }
    };
    let timeout = std::time::Duration::from_secs(args.timeout_seconds.max(1));
    let pool = BlockingPool::default();
    let reports = runtime.block_on(async {
        // All hosts at once, so one dead host costs one timeout, not one per host.
        let handles: Vec<_> = hosts
            .into_iter()
            .map(|h| {
                let (ssh, images, pool) = (
                    config.kvm2.ssh.clone(),
                    config.kvm2.images.clone(),
                    pool.clone(),
                );
                tokio::spawn(async move { check_host(&ssh, &h, &images, &pool, timeout).await })
            })
            .collect();
        let mut reports = Vec::with_capacity(handles.len());
        let mut lost = 0usize;
        for h in handles {
            match h.await {
                Ok(r) => reports.push(r),
                Err(e) => {
                    lost += 1;
                    tracing::error!(error = %e, "a host check task failed");
                }
            }
        }
        (reports, lost)
    });
    let (reports, lost) = reports;
    match args.output {
        OutputFormat::Table => out.write_all(table(&reports).as_bytes())?,
        OutputFormat::Json => {
            let text = serde_json::to_string_pretty(&reports).map_err(std::io::Error::other)?;
            writeln!(out, "{text}")?;
        }
    }
    Ok(if lost == 0 && reports.iter().all(|r| r.ok) {
        0
    } else {
        1
    })
}

fn provision(
    args: &ProvisionCliArgs,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> std::io::Result<u8> {
    let args = crate::provision::ProvisionArgs {
        config: args.config.clone(),
        proxy: args.proxy.clone(),
        user_data: args.user_data.clone(),
        delete: args.delete,
        plugin_dir: args.plugin_dir.clone(),
        cache_dir: args.cache_dir.clone(),
        show_xml: args.show_xml,
        wait_address: std::time::Duration::from_secs(args.wait_address_seconds),
        wait_serving: std::time::Duration::from_secs(args.wait_serving_seconds),
        progress: !args.no_progress,
        shutdown_timeout: std::time::Duration::from_secs(args.shutdown_timeout_seconds),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            writeln!(err, "cannot start the async runtime: {e}")?;
            return Ok(2);
        }
    };
    match runtime.block_on(crate::provision::provision(&args, out)) {
        Ok(()) => Ok(0),
        Err(message) => {
            writeln!(err, "{message}")?;
            Ok(1)
        }
    }
}
