use super::*;
use crate::instance::MetadataMark;
use crate::provider::InstanceState;
use crate::provider::kvm2::domain::fake::FakeOps;

const H: &str = "h1";

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap()
}

fn name(n: usize) -> String {
    format!(
        "{}0b7c3c1e-9a43-4f5e-a1d2-{n:012x}",
        crate::instance::NAME_PREFIX
    )
}

fn xml(n: usize, mac: &str) -> String {
    let uid = name(n)
        .strip_prefix(crate::instance::NAME_PREFIX)
        .unwrap()
        .to_string();
    let m = MetadataMark {
        cluster_id: "test".into(),
        cluster_uid: None,
        namespace: "default".into(),
        name: "p".into(),
        uid,
        created_at: "2026-01-01T00:00:00Z".into(),
        mac: Some(mac.into()),
        address: None,
    };
    format!(
        "<domain><name>{}</name><metadata>{}</metadata></domain>",
        name(n),
        m.to_xml()
    )
}

fn put(fake: &FakeOps, n: usize, mac: &str) {
    fake.put_domain(H, &name(n), &xml(n, mac), InstanceState::Running);
}

fn macs(list: &[DomainRecord]) -> Vec<String> {
    let mut out: Vec<String> = list
        .iter()
        .filter_map(|d| d.mark.as_ref().map(|m| m.mac_or_legacy()))
        .collect();
    out.sort();
    out
}

/// What one check costs: (names listings, full listings, lookups).
fn cost(fake: &FakeOps, before: (usize, usize, usize)) -> (usize, usize, usize) {
    (
        fake.calls("domain-names") - before.0,
        fake.calls("domain-list") - before.1,
        fake.calls("domain-lookup") - before.2,
    )
}

fn calls(fake: &FakeOps) -> (usize, usize, usize) {
    cost(fake, (0, 0, 0))
}

#[test]
fn the_first_look_is_a_full_listing_then_only_names_are_listed() {
    rt().block_on(async {
        let fake = FakeOps::new(&[H], 1 << 30);
        put(&fake, 1, "52:54:00:00:00:01");
        put(&fake, 2, "52:54:00:00:00:02");
        let index = DomainIndex::default();
        let first = index.domains(&fake, H, Fresh::Now).await.unwrap();
        assert_eq!(first.len(), 2);
        assert_eq!(calls(&fake), (0, 1, 0));
        assert_eq!(index.metrics().read(H, "full"), 2);

        // Nothing changed: one names listing, nothing read.
        let before = calls(&fake);
        let again = index.domains(&fake, H, Fresh::Now).await.unwrap();
        assert_eq!(again, first);
        assert_eq!(cost(&fake, before), (1, 0, 0));
    });
}

#[test]
fn what_someone_else_defines_or_undefines_is_seen_by_the_next_check() {
    rt().block_on(async {
        let fake = FakeOps::new(&[H], 1 << 30);
        put(&fake, 1, "52:54:00:00:00:01");
        put(&fake, 2, "52:54:00:00:00:02");
        let index = DomainIndex::default();
        index.domains(&fake, H, Fresh::Now).await.unwrap();

        // Another cluster (or virsh) defines one and undefines one.
        put(&fake, 3, "52:54:00:00:00:03");
        fake.undefine(H, &name(1)).await.unwrap();
        let before = calls(&fake);
        let now = index.domains(&fake, H, Fresh::Now).await.unwrap();
        assert_eq!(macs(&now), ["52:54:00:00:00:02", "52:54:00:00:00:03"]);
        assert_eq!(cost(&fake, before), (1, 0, 1), "one lookup: the new domain");

        // Undefined and defined again under its name: a new UUID, so read again.
        fake.undefine(H, &name(2)).await.unwrap();
        put(&fake, 2, "52:54:00:00:00:22");
        let before = calls(&fake);
        let now = index.domains(&fake, H, Fresh::Now).await.unwrap();
        assert_eq!(macs(&now), ["52:54:00:00:00:03", "52:54:00:00:00:22"]);
        assert_eq!(cost(&fake, before), (1, 0, 1));
    });
}

#[test]
fn an_edit_in_place_is_seen_by_the_next_full_listing() {
    rt().block_on(async {
        let fake = FakeOps::new(&[H], 1 << 30);
        put(&fake, 1, "52:54:00:00:00:01");
        let index = DomainIndex::default();
        index.domains(&fake, H, Fresh::Now).await.unwrap();
        // `virsh edit`: the same UUID, another mark.
        put(&fake, 1, "52:54:00:00:00:99");
        let names_only = index.domains(&fake, H, Fresh::Now).await.unwrap();
        assert_eq!(
            macs(&names_only),
            ["52:54:00:00:00:01"],
            "a names check cannot see it"
        );
        let full = index.domains(&fake, H, Fresh::Full).await.unwrap();
        assert_eq!(macs(&full), ["52:54:00:00:00:99"]);
        let after = index.domains(&fake, H, Fresh::Now).await.unwrap();
        assert_eq!(
            macs(&after),
            ["52:54:00:00:00:99"],
            "the index keeps the full read"
        );
    });
}

#[test]
fn a_check_costs_the_same_on_a_host_of_ten_and_of_four_hundred() {
    rt().block_on(async {
        let mut per_check = Vec::new();
        for size in [10, 400] {
            let fake = FakeOps::new(&[H], 1 << 30);
            for n in 0..size {
                put(
                    &fake,
                    n,
                    &format!("52:54:00:00:{:02x}:{:02x}", n / 256, n % 256),
                );
            }
            let index = DomainIndex::default();
            index.domains(&fake, H, Fresh::Now).await.unwrap();
            // Steady Creates: each defines one domain (recorded), then checks.
            let before = calls(&fake);
            for n in size..size + 20 {
                put(
                    &fake,
                    n,
                    &format!("52:54:00:01:{:02x}:{:02x}", n / 256, n % 256),
                );
                let rec = fake.domain(H, &name(n)).await.unwrap().unwrap();
                index.defined(H, rec);
                let seen = index.domains(&fake, H, Fresh::Now).await.unwrap();
                assert_eq!(seen.len(), n + 1);
            }
            let c = cost(&fake, before);
            // The lookups above are the test's own (as the provider reads a domain back).
            per_check.push((c.0, c.1, c.2 - 20));
        }
        assert_eq!(
            per_check[0],
            (20, 0, 0),
            "one names listing per check, nothing read"
        );
        assert_eq!(per_check[0], per_check[1]);
    });
}

#[test]
fn a_recent_index_answers_without_a_call() {
    rt().block_on(async {
        let fake = FakeOps::new(&[H], 1 << 30);
        put(&fake, 1, "52:54:00:00:00:01");
        let index = DomainIndex::default();
        index.domains(&fake, H, Fresh::Now).await.unwrap();
        let before = calls(&fake);
        index
            .domains(&fake, H, Fresh::Within(RECENT))
            .await
            .unwrap();
        assert_eq!(cost(&fake, before), (0, 0, 0));
        assert_eq!(index.metrics().checks(H, "cached"), 1);
        tokio::time::advance(RECENT + Duration::from_secs(1)).await;
        index
            .domains(&fake, H, Fresh::Within(RECENT))
            .await
            .unwrap();
        assert_eq!(cost(&fake, before), (1, 0, 0), "too old: checked");
    });
}

#[test]
fn a_local_change_during_a_check_is_not_undone_by_it() {
    let rec = |n: usize, uuid: &str| DomainRecord {
        name: name(n),
        uuid: uuid.into(),
        state: InstanceState::Running,
        mark: None,
        damaged_mark: false,
    };
    let index = DomainIndex::default();
    index.defined(H, rec(1, "u1"));
    let host = index.host(H);
    let mut st = lock(&host.state);
    st.touched.clear();
    // A check begins (epoch noted), its listing shows domain 1 only...
    let epoch = st.epoch;
    let listed = [DomainName {
        name: name(1),
        uuid: "u1".into(),
    }];
    drop(st);
    // ...meanwhile this process defines 2 and undefines 1...
    index.defined(H, rec(2, "u2"));
    index.undefined(H, &name(1));
    // ...and the check's result arrives: neither change is undone.
    let mut st = lock(&host.state);
    let read = BTreeMap::from([(name(1), Some(rec(1, "u1")))]);
    apply_check(&mut st, &listed, read, epoch);
    let names: Vec<&String> = st.domains.keys().collect();
    assert_eq!(names, [&name(2)]);
    // The same for a full listing.
    install_full(&mut st, vec![rec(1, "u1")], epoch);
    let names: Vec<&String> = st.domains.keys().collect();
    assert_eq!(names, [&name(2)]);
}

#[test]
fn a_failed_check_changes_nothing() {
    rt().block_on(async {
        let fake = FakeOps::new(&[H], 1 << 30);
        put(&fake, 1, "52:54:00:00:00:01");
        let index = DomainIndex::default();
        index.domains(&fake, H, Fresh::Now).await.unwrap();
        fake.set_down(H, true);
        assert!(index.domains(&fake, H, Fresh::Now).await.is_err());
        fake.set_down(H, false);
        let before = calls(&fake);
        let now = index.domains(&fake, H, Fresh::Now).await.unwrap();
        assert_eq!(now.len(), 1);
        assert_eq!(cost(&fake, before), (1, 0, 0));
    });
}

#[test]
fn a_name_being_defined_here_is_left_to_its_create() {
    rt().block_on(async {
        let fake = FakeOps::new(&[H], 1 << 30);
        let index = DomainIndex::default();
        index.domains(&fake, H, Fresh::Now).await.unwrap();
        let defining = index.defining(H, &name(7));
        put(&fake, 7, "52:54:00:00:00:07");
        let before = calls(&fake);
        let seen = index.domains(&fake, H, Fresh::Now).await.unwrap();
        assert!(seen.is_empty(), "not read while its Create defines it");
        assert_eq!(cost(&fake, before), (1, 0, 0));
        // The Create records what it read back; nothing is read for it.
        let rec = fake.domain(H, &name(7)).await.unwrap().unwrap();
        index.defined(H, rec);
        drop(defining);
        let before = calls(&fake);
        let seen = index.domains(&fake, H, Fresh::Now).await.unwrap();
        assert_eq!(macs(&seen), ["52:54:00:00:00:07"]);
        assert_eq!(cost(&fake, before), (1, 0, 0));

        // A Create that failed before recording: the next check reads the domain.
        let defining = index.defining(H, &name(8));
        put(&fake, 8, "52:54:00:00:00:08");
        drop(defining);
        let before = calls(&fake);
        let seen = index.domains(&fake, H, Fresh::Now).await.unwrap();
        assert_eq!(seen.len(), 2);
        assert_eq!(cost(&fake, before), (1, 0, 1));
    });
}
