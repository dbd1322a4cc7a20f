//! Addresses the operator knows (issue 13, deliverable 3).
//!
//! Against the in-memory fake hosts ([`FakeOps`]) with the real template plugins: static
//! addresses from a host's pool (distinct under 50 racing Creates, recovered from the
//! marks by a new provider, kept on adoption, freed by a delete, quota when exhausted),
//! the seed's network-config read back, the static address reported with no address
//! source asked; per-incarnation MACs recorded in the mark; a MAC two domains share
//! publishes nothing; stale lease and ARP entries are dropped; `seed_applied` from the
//! guest agent's host name.
//!
//! Against the harness's real sshd and libvirtd (skipped where they cannot run): a Create
//! on a host with a pool defines a domain whose libvirt-stored mark, NIC and seed volume
//! agree on the MAC and the address, a restarted provider allocates around it, and a
//! delete frees it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::collections::BTreeSet;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use egress_operator::Classified as _;
use egress_operator::api::proxy::ProxySpec;
use egress_operator::config::{self, ValidConfig};
use egress_operator::error::ErrorClass;
use egress_operator::instance::{InstanceIdentity, MetadataMark, check_mac};
use egress_operator::provider::kvm2::addresses::{AddressSource, NicAddrs};
use egress_operator::provider::kvm2::backend::Kvm2Provider;
use egress_operator::provider::kvm2::domain::ippool::preferred_offset;
use egress_operator::provider::kvm2::fake::FakeOps;
use egress_operator::provider::kvm2::metadata::mark_from_domain_xml;
use egress_operator::provider::kvm2::ops::HostOps;
use egress_operator::provider::kvm2::seed;
use egress_operator::provider::{
    AddressOrigin, CreateRequest, Instance, InstanceId, InstanceState, Provider, ProxyRef,
};
use integration_tests::fake_rig::{self, FakeConfig};
use integration_tests::http::{HttpServer, Route};
use integration_tests::sha256_hex;

/// A hang fails the test instead of blocking CI; not a timing assertion.
const HANG_GUARD: Duration = Duration::from_secs(120);

fn run<F: Future>(f: F) -> F::Output {
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

/// h1's pool: `10.203.0.0/24`, gateway `.1`, range `.10` to `.10 + size - 1`.
fn pool_yaml(size: u32) -> String {
    let last = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 203, 0, 10)) + size - 1);
    format!(
        "addressPool: {{cidr: 10.203.0.0/24, gateway: 10.203.0.1, dns: [10.203.0.1], \
         rangeStart: 10.203.0.10, rangeEnd: {last}}}"
    )
}

/// h1 with a pool of `size` addresses and `maxDomains: size`; h2 without a pool.
fn test_config(url: &str, sha: &str, size: u32) -> Arc<ValidConfig> {
    let h1 = format!(
        "maxDomains: {size}, maxConcurrentCreates: 8, {}",
        pool_yaml(size)
    );
    FakeConfig::new(url, sha)
        .host("h1", &h1)
        .host("h2", "")
        .name("static-addresses-config")
        .build()
}

/// An image server, fake hosts h1 and h2, and the config over them.
struct Env {
    _http: HttpServer,
    fake: Arc<FakeOps>,
    config: Arc<ValidConfig>,
}

impl Env {
    fn new(pool_size: u32) -> Self {
        let bytes = fake_rig::test_image(512 << 20, 3000);
        let sha = sha256_hex(&bytes);
        let http = HttpServer::start(vec![("/img".to_string(), Route::Body(bytes))]).unwrap();
        let config = test_config(&http.url("/img"), &sha, pool_size);
        Self {
            _http: http,
            fake: Arc::new(FakeOps::new(&["h1", "h2"], 1 << 40)),
            config,
        }
    }

    /// A provider with a fresh address book: what an operator that just started has.
    fn provider(&self) -> Kvm2Provider {
        fake_rig::provider(&self.config, self.fake.clone())
    }

    /// The mark of domain `name` on `host`, as the fake stores it.
    async fn mark(&self, host: &str, name: &str) -> MetadataMark {
        let xml = self.fake.domain_xml(host, name).await.unwrap().unwrap();
        mark_from_domain_xml(&xml).unwrap().unwrap()
    }

    /// The MAC of the domain's NIC in its XML.
    async fn xml_mac(&self, host: &str, name: &str) -> String {
        let xml = self.fake.domain_xml(host, name).await.unwrap().unwrap();
        nic_mac(&xml)
    }

    /// The files of the instance's seed volume, read back from the ISO.
    fn seed_files(&self, host: &str, uid: &str) -> std::collections::BTreeMap<String, Vec<u8>> {
        let name = InstanceIdentity::for_uid(uid).unwrap().seed_volume;
        seed::read_files(&self.fake.volume_data(host, &name).unwrap()).unwrap()
    }
}

/// The `address` of the first `<mac>` of a domain XML.
fn nic_mac(xml: &str) -> String {
    let at = xml.find("<mac address=").expect("a <mac> element") + "<mac address=".len();
    let quote = &xml[at..=at];
    let rest = &xml[at + 1..];
    rest[..rest.find(quote).unwrap()].to_string()
}

/// A valid UID numbered `n`.
fn uid(n: u16) -> String {
    format!("0b7c3c1e-9a43-4f5e-a1d2-3c4b5a69{n:04x}")
}

fn dom(uid: &str) -> String {
    InstanceIdentity::for_uid(uid).unwrap().domain_name
}

fn request(uid: &str, name: &str, host: &str) -> CreateRequest {
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
            host: Some(host.into()),
            user_data: None,
            template_settings: None,
            update_policy: None,
        },
        user_data: None,
        fence: egress_operator::provider::Fence::unfenced(),
    }
}

fn id(host: &str, uid: &str) -> InstanceId {
    InstanceId {
        host: host.into(),
        name: dom(uid),
    }
}

fn static_v4(inst: &Instance) -> Ipv4Addr {
    assert_eq!(inst.address_source, Some(AddressOrigin::Static), "{inst:?}");
    match inst.addresses.as_slice() {
        [IpAddr::V4(a)] => *a,
        other => panic!("one static IPv4 address expected, got {other:?}"),
    }
}

fn in_pool(a: Ipv4Addr, size: u32) -> bool {
    let first = u32::from(Ipv4Addr::new(10, 203, 0, 10));
    (first..first + size).contains(&u32::from(a))
}

/// 50 Creates racing in one process on one host get 50 distinct addresses of the pool,
/// each recorded in its domain's mark and written into its seed's network-config for
/// its NIC's MAC, and reported as `static` without any address source being asked.
#[test]
fn fifty_racing_creates_get_distinct_addresses() {
    let env = Env::new(64);
    let p = Arc::new(env.provider());
    let instances = run(async {
        let tasks: Vec<_> = (0..50u16)
            .map(|n| {
                let p = p.clone();
                tokio::spawn(async move {
                    p.create(&request(&uid(n), &format!("proxy-{n}"), "h1"))
                        .await
                        .unwrap()
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    });
    let addresses: BTreeSet<Ipv4Addr> = instances.iter().map(static_v4).collect();
    assert_eq!(addresses.len(), 50, "{addresses:?}");
    assert!(addresses.iter().all(|a| in_pool(*a, 64)), "{addresses:?}");
    assert_eq!(env.fake.calls("domain-addresses"), 0, "no source asked");
    run(async {
        let mut macs = BTreeSet::new();
        for (n, inst) in instances.iter().enumerate() {
            let u = uid(n as u16);
            let mark = env.mark("h1", &dom(&u)).await;
            assert_eq!(mark.address, Some(static_v4(inst)));
            let mac = mark.mac.clone().expect("the mark records the MAC");
            assert_eq!(env.xml_mac("h1", &dom(&u)).await, mac);
            macs.insert(mac.clone());
            let files = env.seed_files("h1", &u);
            let nc: serde_yaml_ng::Value =
                serde_yaml_ng::from_slice(&files["network-config"]).unwrap();
            let nic = &nc["ethernets"]["primary"];
            assert_eq!(nic["match"]["macaddress"].as_str(), Some(mac.as_str()));
            assert_eq!(
                nic["addresses"][0].as_str(),
                Some(format!("{}/24", static_v4(inst)).as_str())
            );
            assert_eq!(nic["routes"][0]["via"].as_str(), Some("10.203.0.1"));
            assert_eq!(
                nic["nameservers"]["addresses"][0].as_str(),
                Some("10.203.0.1")
            );
        }
        assert_eq!(macs.len(), 50);
        // A Get reports the same, still without asking a source.
        let got = p.get(&id("h1", &uid(7))).await.unwrap();
        assert_eq!(static_v4(&got), static_v4(&instances[7]));
        assert_eq!(env.fake.calls("domain-addresses"), 0);
    });
}

/// A new provider (an operator restart) recovers the used addresses from the marks on
/// the host: with a pool of three, it hands out the one left, then refuses with a quota
/// error naming the host and the range; a delete frees an address for the next Create.
#[test]
fn a_restart_recovers_allocations_and_delete_frees_one() {
    let env = Env::new(3);
    run(async {
        let first = env.provider();
        let a = static_v4(&first.create(&request(&uid(1), "a", "h1")).await.unwrap());
        let b = static_v4(&first.create(&request(&uid(2), "b", "h1")).await.unwrap());
        drop(first);
        let restarted = env.provider();
        let c = static_v4(
            &restarted
                .create(&request(&uid(3), "c", "h1"))
                .await
                .unwrap(),
        );
        let all: BTreeSet<_> = [a, b, c].into();
        assert_eq!(all.len(), 3, "{all:?}");

        // Another cluster's domain on the same bridge holds an address too: not ours to
        // count against maxDomains, but not free either.
        restarted.delete(&id("h1", &uid(2))).await.unwrap();
        let foreign = uid(0x99);
        let mark = MetadataMark {
            cluster_id: "other".into(),
            cluster_uid: None,
            namespace: "default".into(),
            name: "theirs".into(),
            uid: foreign.clone(),
            created_at: "2026-01-01T00:00:00Z".into(),
            mac: Some("02:00:00:00:00:99".into()),
            address: Some(b),
        };
        env.fake.put_domain(
            "h1",
            &dom(&foreign),
            &format!(
                "<domain><name>{}</name><metadata>{}</metadata></domain>",
                dom(&foreign),
                mark.to_xml()
            ),
            InstanceState::Running,
        );
        let err = restarted
            .create(&request(&uid(4), "d", "h1"))
            .await
            .unwrap_err();
        assert_eq!(err.class(), ErrorClass::Quota, "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("\"h1\"") && msg.contains("10.203.0.10-10.203.0.12"),
            "{msg}"
        );
        assert!(!env.fake.domains("h1").contains(&dom(&uid(4))));

        // The foreign domain goes: its address is free again.
        env.fake.undefine("h1", &dom(&foreign)).await.unwrap();
        let d = static_v4(
            &restarted
                .create(&request(&uid(4), "d", "h1"))
                .await
                .unwrap(),
        );
        assert_eq!(d, b, "the freed address");
    });
}

/// Adoption keeps what the mark recorded: a running domain and a shut-off one (checked
/// again before its start) report the same address and keep the same MAC; a new
/// incarnation after a delete gets a new MAC.
#[test]
fn adoption_keeps_the_address_and_a_new_incarnation_gets_a_new_mac() {
    let env = Env::new(8);
    run(async {
        let p = env.provider();
        let u = uid(1);
        let made = static_v4(&p.create(&request(&u, "a", "h1")).await.unwrap());
        let mac = env.mark("h1", &dom(&u)).await.mac.unwrap();
        let again = static_v4(
            &env.provider()
                .create(&request(&u, "a", "h1"))
                .await
                .unwrap(),
        );
        assert_eq!(again, made);
        env.fake.set_state("h1", &dom(&u), InstanceState::ShutOff);
        let started = env
            .provider()
            .create(&request(&u, "a", "h1"))
            .await
            .unwrap();
        assert_eq!(started.state, InstanceState::Running);
        assert_eq!(static_v4(&started), made);
        assert_eq!(env.mark("h1", &dom(&u)).await.mac.unwrap(), mac);

        p.delete(&id("h1", &u)).await.unwrap();
        let replaced = static_v4(&p.create(&request(&u, "a", "h1")).await.unwrap());
        assert_eq!(replaced, made, "the UID's preferred address, free again");
        let new_mac = env.mark("h1", &dom(&u)).await.mac.unwrap();
        assert_ne!(new_mac, mac, "a new incarnation, a new MAC");
        assert_eq!(check_mac(&new_mac), Ok(()));
        assert_eq!(
            u8::from_str_radix(&new_mac[..2], 16).unwrap() & 0b11,
            0b10,
            "locally administered unicast"
        );
    });
}

fn nic(mac: &str, addrs: &[&str]) -> NicAddrs {
    NicAddrs {
        hwaddr: mac.into(),
        addrs: addrs.iter().map(|a| a.to_string()).collect(),
    }
}

fn ips(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|a| a.parse().unwrap()).collect()
}

/// Without a pool (h2) the addresses are detected for the mark's MAC: the agent (the
/// guest's view) wins over a lease and ARP; an earlier VM's lease and ARP entry (another
/// MAC) are never ours; and when another domain on the host carries the same MAC,
/// nothing is published.
#[test]
fn detection_drops_stale_entries_and_a_shared_mac_publishes_nothing() {
    let env = Env::new(4);
    run(async {
        let p = env.provider();
        let u = uid(1);
        let name = dom(&u);
        let inst = p.create(&request(&u, "a", "h2")).await.unwrap();
        assert_eq!(inst.addresses, Vec::<IpAddr>::new(), "nothing reported yet");
        assert_eq!(inst.address_source, None);
        let mac = env.mark("h2", &name).await.mac.unwrap();
        assert_eq!(env.xml_mac("h2", &name).await, mac);

        // Left by an earlier VM of the same Proxy: its lease and ARP entry, other MAC.
        let old_mac = egress_operator::instance::legacy_mac(&u);
        env.fake.set_addresses(
            "h2",
            &name,
            AddressSource::Lease,
            vec![nic(&old_mac, &["10.1.0.5"])],
        );
        env.fake.set_addresses(
            "h2",
            &name,
            AddressSource::Arp,
            vec![nic(&old_mac, &["10.1.0.6"])],
        );
        let got = p.get(&id("h2", &u)).await.unwrap();
        assert_eq!(got.addresses, Vec::<IpAddr>::new(), "{got:?}");
        assert_eq!(got.address_source, None);

        // This VM in the ARP table, and its agent: the agent wins.
        env.fake.set_addresses(
            "h2",
            &name,
            AddressSource::Arp,
            vec![nic(&old_mac, &["10.1.0.6"]), nic(&mac, &["10.1.0.7"])],
        );
        let got = p.get(&id("h2", &u)).await.unwrap();
        assert_eq!(got.addresses, ips(&["10.1.0.7"]));
        assert_eq!(got.address_source, Some(AddressOrigin::Arp));
        env.fake.set_addresses(
            "h2",
            &name,
            AddressSource::Agent,
            vec![
                nic("00:00:00:00:00:00", &["127.0.0.1"]),
                nic(&mac.to_uppercase(), &["10.1.0.8"]),
            ],
        );
        let got = p.get(&id("h2", &u)).await.unwrap();
        assert_eq!(got.addresses, ips(&["10.1.0.8"]));
        assert_eq!(got.address_source, Some(AddressOrigin::Agent));

        // Another domain with the same MAC in its mark: whose address is it? Not published.
        let twin = uid(2);
        let mark = MetadataMark {
            cluster_id: "test".into(),
            cluster_uid: None,
            namespace: "default".into(),
            name: "twin".into(),
            uid: twin.clone(),
            created_at: "2026-01-01T00:00:00Z".into(),
            mac: Some(mac.clone()),
            address: None,
        };
        env.fake.put_domain(
            "h2",
            &dom(&twin),
            &format!(
                "<domain><name>{}</name><metadata>{}</metadata></domain>",
                dom(&twin),
                mark.to_xml()
            ),
            InstanceState::Running,
        );
        // A fresh provider (no census yet) lists the host and sees the twin.
        let fresh = env.provider();
        let got = fresh.get(&id("h2", &u)).await.unwrap();
        assert_eq!(got.addresses, Vec::<IpAddr>::new(), "{got:?}");
        assert_eq!(got.address_source, None);
        // The twin gone, the address is published again after a listing.
        env.fake.undefine("h2", &dom(&twin)).await.unwrap();
        let _ = env.provider().list().await;
        let got = env.provider().get(&id("h2", &u)).await.unwrap();
        assert_eq!(got.addresses, ips(&["10.1.0.8"]));
    });
}

/// DHCP mode (h2, no pool): when a libvirt network owns the host's bridge, its network
/// bounds what is published (issue 19, finding 8): an agent address from another segment
/// is dropped and the next source answers; a bridge no libvirt network owns keeps every
/// address, as before. The network is read once, not on every refresh.
#[test]
fn dhcp_mode_keeps_only_addresses_inside_the_bridges_libvirt_network() {
    let env = Env::new(4);
    run(async {
        env.fake
            .set_bridge_network("h2", Some("10.1.0.0/24".parse().unwrap()));
        let p = env.provider();
        let u = uid(1);
        let name = dom(&u);
        p.create(&request(&u, "a", "h2")).await.unwrap();
        let mac = env.mark("h2", &name).await.mac.unwrap();
        // The agent reports the bridge's address and one from another segment (a second
        // address the guest configured on the same NIC).
        env.fake.set_addresses(
            "h2",
            &name,
            AddressSource::Agent,
            vec![nic(&mac, &["192.0.2.50", "10.1.0.8"])],
        );
        let got = p.get(&id("h2", &u)).await.unwrap();
        assert_eq!(got.addresses, ips(&["10.1.0.8"]), "{got:?}");
        assert_eq!(got.address_source, Some(AddressOrigin::Agent));

        // Only another segment's from the agent: the lease (inside) answers instead.
        env.fake.set_addresses(
            "h2",
            &name,
            AddressSource::Agent,
            vec![nic(&mac, &["192.0.2.50"])],
        );
        env.fake.set_addresses(
            "h2",
            &name,
            AddressSource::Lease,
            vec![nic(&mac, &["10.1.0.9"])],
        );
        let got = p.get(&id("h2", &u)).await.unwrap();
        assert_eq!(got.addresses, ips(&["10.1.0.9"]), "{got:?}");
        assert_eq!(got.address_source, Some(AddressOrigin::Lease));
        assert_eq!(env.fake.calls("network-list"), 1, "read once, then kept");

        // A bridge no libvirt network owns: nothing to check against, all kept.
        env.fake.set_bridge_network("h2", None);
        let fresh = env.provider();
        env.fake
            .set_addresses("h2", &name, AddressSource::Lease, vec![]);
        let got = fresh.get(&id("h2", &u)).await.unwrap();
        assert_eq!(got.addresses, ips(&["192.0.2.50"]), "{got:?}");
    });
}

/// DHCP mode with a DHCP server outside libvirt: the host's configured `bridgeNetwork`
/// bounds what is published, ahead of any libvirt network (which is then not even asked
/// for).
#[test]
fn dhcp_mode_keeps_only_addresses_inside_the_configured_bridge_network() {
    let mut env = Env::new(4);
    env.config = FakeConfig::new(&env._http.url("/img"), &env.config.kvm2.images[0].sha256)
        .host("h1", "")
        .host("h2", "bridgeNetwork: 10.2.0.0/24")
        .name("bridge-network-config")
        .build();
    run(async {
        env.fake
            .set_bridge_network("h2", Some("10.1.0.0/24".parse().unwrap()));
        let p = env.provider();
        let u = uid(2);
        let name = dom(&u);
        p.create(&request(&u, "b", "h2")).await.unwrap();
        let mac = env.mark("h2", &name).await.mac.unwrap();
        env.fake.set_addresses(
            "h2",
            &name,
            AddressSource::Agent,
            vec![nic(&mac, &["10.1.0.8", "192.0.2.50", "10.2.0.8"])],
        );
        let got = p.get(&id("h2", &u)).await.unwrap();
        assert_eq!(got.addresses, ips(&["10.2.0.8"]), "{got:?}");
        assert_eq!(env.fake.calls("network-list"), 0, "the config says it all");
    });
}

/// `seed_applied` from the agent's host name against the seed's `local-hostname` (the
/// Proxy's name): true when equal, false when the guest calls itself something else,
/// unknown without an agent; and not asked at all when the agent already failed to
/// answer for the addresses.
#[test]
fn seed_applied_from_the_agent_host_name() {
    let env = Env::new(4);
    run(async {
        let p = env.provider();
        let u = uid(1);
        let name = dom(&u);
        let inst = p.create(&request(&u, "office-egress", "h1")).await.unwrap();
        assert_eq!(inst.seed_applied, None, "no agent");
        let files = env.seed_files("h1", &u);
        let meta: serde_yaml_ng::Value = serde_yaml_ng::from_slice(&files["meta-data"]).unwrap();
        assert_eq!(meta["local-hostname"].as_str(), Some("office-egress"));

        env.fake
            .set_agent_hostname("h1", &name, Some("office-egress"));
        assert_eq!(p.get(&id("h1", &u)).await.unwrap().seed_applied, Some(true));
        env.fake.set_agent_hostname("h1", &name, Some("debian"));
        assert_eq!(
            p.get(&id("h1", &u)).await.unwrap().seed_applied,
            Some(false)
        );
        env.fake.set_agent_hostname("h1", &name, None);
        assert_eq!(p.get(&id("h1", &u)).await.unwrap().seed_applied, None);

        // Detection path (h2): the agent answered nothing for the addresses, so its host
        // name is not asked for.
        let v = uid(2);
        env.provider()
            .create(&request(&v, "other", "h2"))
            .await
            .unwrap();
        env.fake.set_agent_hostname("h2", &dom(&v), Some("other"));
        let before = env.fake.calls("domain-hostname");
        let got = p.get(&id("h2", &v)).await.unwrap();
        assert_eq!(got.seed_applied, None);
        assert_eq!(env.fake.calls("domain-hostname"), before, "not asked");
        // Once the agent answers, it is.
        let mac = env.mark("h2", &dom(&v)).await.mac.unwrap();
        env.fake.set_addresses(
            "h2",
            &dom(&v),
            AddressSource::Agent,
            vec![nic(&mac, &["10.1.0.9"])],
        );
        let got = p.get(&id("h2", &v)).await.unwrap();
        assert_eq!(got.seed_applied, Some(true));
        assert_eq!(got.address_source, Some(AddressOrigin::Agent));
    });
}

mod real {
    //! The same rules on real libvirtd: what libvirt stores and serves back.

    use super::*;
    use integration_tests::provider_rig::{self, Rig};

    /// The rig's config with an address pool on h1.
    fn with_pool(rig: &Rig) -> Arc<ValidConfig> {
        let yaml = integration_tests::provider_config_yaml(
            &rig.sshd,
            &rig.libvirtd,
            "h1",
            &Rig::base_image(&rig.http, &rig.image_sha),
            &[],
        )
        .unwrap();
        let marker = "disableKvm: true}";
        assert!(yaml.contains(marker), "{yaml}");
        let yaml = yaml.replacen(
            marker,
            &format!("disableKvm: true, maxDomains: 3, {}}}", pool_yaml(3)),
            1,
        );
        Arc::new(config::parse(&yaml, "static-real", std::path::Path::new("/")).unwrap())
    }

    /// A Create on a host with a pool: libvirt's stored domain carries the mark with the
    /// MAC and address, its NIC has that MAC, the seed volume (read back through libvirt)
    /// holds the network-config for them, and a Get reports the address as static. A
    /// restarted provider allocates around it; a delete frees it.
    #[test]
    fn static_address_on_real_libvirt() {
        let Some(mut rig) = Rig::start(vec![], Rig::base_image) else {
            return;
        };
        rig.config = with_pool(&rig);
        provider_rig::run(async {
            let p = rig.provider(rig.ops.clone());
            let u = provider_rig::uid(0x31);
            let name = dom(&u);
            let inst = p
                .create(&provider_rig::request(&u, "static-a"))
                .await
                .unwrap();
            let a = static_v4(&inst);
            assert!(in_pool(a, 3), "{a}");
            let xml = rig.ops.domain_xml("h1", &name).await.unwrap().unwrap();
            let mark = mark_from_domain_xml(&xml).unwrap().unwrap();
            assert_eq!(mark.address, Some(a));
            let mac = mark.mac.clone().unwrap();
            assert_eq!(nic_mac(&xml), mac, "libvirt's NIC has the mark's MAC");
            let seed_volume = InstanceIdentity::for_uid(&u).unwrap().seed_volume;
            let iso = rig
                .ops
                .read_volume("h1", "default", &seed_volume, 1 << 20)
                .await
                .unwrap()
                .unwrap();
            let files = seed::read_files(&iso).unwrap();
            let nc: serde_yaml_ng::Value =
                serde_yaml_ng::from_slice(&files["network-config"]).unwrap();
            assert_eq!(
                nc["ethernets"]["primary"]["match"]["macaddress"].as_str(),
                Some(mac.as_str())
            );
            assert_eq!(
                nc["ethernets"]["primary"]["addresses"][0].as_str(),
                Some(format!("{a}/24").as_str())
            );
            let got = p.get(&id("h1", &u)).await.unwrap();
            assert_eq!(static_v4(&got), a);
            // The test image runs no agent: nobody can tell whether the seed applied.
            assert_eq!(got.seed_applied, None);

            // Restarted: the address is taken, read from libvirt's copy of the mark. The
            // second Proxy's UID prefers the same address, so only the mark keeps them
            // apart.
            let restarted = rig.provider(rig.ops.clone());
            let v = (0x32..=0xff)
                .map(provider_rig::uid)
                .find(|v| preferred_offset(v, 3) == preferred_offset(&u, 3))
                .unwrap();
            let b = static_v4(
                &restarted
                    .create(&provider_rig::request(&v, "static-b"))
                    .await
                    .unwrap(),
            );
            assert_ne!(a, b);
            restarted.delete(&id("h1", &u)).await.unwrap();
            restarted.delete(&id("h1", &v)).await.unwrap();
            assert_eq!(rig.domains(), Vec::<String>::new());
            rig.hosts.close().await;
        });
    }
}
