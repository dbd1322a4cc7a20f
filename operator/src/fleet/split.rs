//! How a pool's endpoints are spread over EndpointSlices, the way Kubernetes' own
//! endpointslice controller does it: at most [`MAX_ENDPOINTS_PER_SLICE`] per slice (the API
//! refuses more than 1000, and a pool with its surge can pass that), an endpoint stays in
//! the slice that lists it while that slice has room (a change rewrites one slice, not
//! all), new endpoints fill the slices with room before a new slice is made, and the
//! names are stable: `<pool>-<family>` first, then `<pool>-<family>-1`, `-2`, ...
//!
//! When the endpoints would fit in fewer slices than they occupy (after a scale-in), they
//! are packed again into as few as needed, and the slices left over are deleted.

use std::collections::{BTreeMap, HashMap};

/// Most endpoints in one slice: the endpointslice controller's default
/// (`--max-endpoints-per-slice`), a tenth of the API's hard limit, so one change rewrites a
/// small object.
pub const MAX_ENDPOINTS_PER_SLICE: usize = 100;

/// The name of `pool`'s slice number `index` of a family (`suffix`: `ipv4`, `ipv6`).
pub fn slice_name(pool: &str, suffix: &str, index: usize) -> String {
    match index {
        0 => format!("{pool}-{suffix}"),
        i => format!("{pool}-{suffix}-{i}"),
    }
}

/// The index of a slice named by [`slice_name`], if it is one of `pool`'s for `suffix`.
pub fn slice_index(pool: &str, suffix: &str, name: &str) -> Option<usize> {
    let rest = name
        .strip_prefix(pool)?
        .strip_prefix('-')?
        .strip_prefix(suffix)?;
    if rest.is_empty() {
        return Some(0);
    }
    let n = rest.strip_prefix('-')?;
    // Exactly as slice_name writes it: no sign, no leading zero, not 0.
    if n.starts_with('0') || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok().filter(|i| *i > 0)
}

/// Places `keys` (the endpoints to list, in a stable order) into slice indices, given
/// what each slice lists now (`current`: index to keys), at most `max` per slice. Index 0
/// is always in the result (a family's first slice always exists, possibly empty); any
/// other index only when it lists something.
pub fn place(
    keys: &[String],
    current: &BTreeMap<usize, Vec<String>>,
    max: usize,
) -> BTreeMap<usize, Vec<String>> {
    let max = max.max(1);
    let needed = keys.len().div_ceil(max).max(1);
    let mut out: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    let was: HashMap<&str, usize> = current
        .iter()
        .flat_map(|(i, ks)| ks.iter().map(move |k| (k.as_str(), *i)))
        .collect();
    let mut pending = Vec::new();
    for k in keys {
        match was.get(k.as_str()) {
            Some(i) if out.get(i).map_or(0, Vec::len) < max => {
                out.entry(*i).or_default().push(k.clone());
            }
            _ => pending.push(k.clone()),
        }
    }
    // New ones fill the slices with room, lowest index first, then new slices.
    let mut index = 0;
    for k in pending {
        while out.get(&index).map_or(0, Vec::len) >= max {
            index += 1;
        }
        out.entry(index).or_default().push(k);
    }
    // Spread over more slices than needed (a scale-in): pack again.
    if out.values().filter(|v| !v.is_empty()).count() > needed {
        out = keys
            .chunks(max)
            .enumerate()
            .map(|(i, c)| (i, c.to_vec()))
            .collect();
    }
    // Each slice in the order of `keys`, so an unchanged slice is written the same.
    let pos: HashMap<&str, usize> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (k.as_str(), i))
        .collect();
    for v in out.values_mut() {
        v.sort_by_key(|k| pos.get(k.as_str()).copied().unwrap_or(usize::MAX));
    }
    out.entry(0).or_default();
    out.retain(|i, v| *i == 0 || !v.is_empty());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(range: std::ops::Range<usize>) -> Vec<String> {
        range.map(|i| format!("k{i:04}")).collect()
    }

    #[test]
    fn names_are_stable_and_read_back() {
        assert_eq!(slice_name("office", "ipv4", 0), "office-ipv4");
        assert_eq!(slice_name("office", "ipv4", 3), "office-ipv4-3");
        for i in [0, 1, 12] {
            assert_eq!(
                slice_index("office", "ipv4", &slice_name("office", "ipv4", i)),
                Some(i)
            );
        }
        for other in [
            "office-ipv6",
            "office-ipv4-0",
            "office-ipv4-01",
            "office-ipv4-x",
            "office-b-ipv4",
            "officeipv4",
        ] {
            assert_eq!(slice_index("office", "ipv4", other), None, "{other}");
        }
    }

    #[test]
    fn over_a_thousand_endpoints_fill_slices_of_at_most_the_maximum() {
        let ks = keys(0..1050);
        let p = place(&ks, &BTreeMap::new(), MAX_ENDPOINTS_PER_SLICE);
        assert_eq!(p.len(), 11);
        assert!(p.values().all(|v| v.len() <= MAX_ENDPOINTS_PER_SLICE));
        let all: Vec<String> = p.values().flatten().cloned().collect();
        assert_eq!(all, ks);
        assert!(place(&[], &BTreeMap::new(), 100)[&0].is_empty());
    }

    #[test]
    fn an_endpoint_stays_where_it_is_and_new_ones_fill_the_room() {
        let ks = keys(0..250);
        let first = place(&ks, &BTreeMap::new(), 100);
        // One leaves slice 0, one arrives: only slice 0 changes.
        let mut next: Vec<String> = ks.iter().filter(|k| *k != "k0005").cloned().collect();
        next.push("k9999".into());
        let second = place(&next, &first, 100);
        assert_eq!(second[&1], first[&1]);
        assert_eq!(second[&2], first[&2]);
        assert!(second[&0].contains(&"k9999".to_string()));
        assert!(!second[&0].contains(&"k0005".to_string()));
    }

    #[test]
    fn a_scale_in_packs_the_rest_and_drops_the_surplus_slices() {
        let ks = keys(0..300);
        let first = place(&ks, &BTreeMap::new(), 100);
        assert_eq!(first.len(), 3);
        // One left in each slice: they fit in one.
        let few = vec!["k0000".to_string(), "k0150".into(), "k0299".into()];
        let p = place(&few, &first, 100);
        assert_eq!(p.len(), 1);
        assert_eq!(p[&0], few);
        // Nothing left: the first slice stays, empty.
        let p = place(&[], &first, 100);
        assert_eq!(p.len(), 1);
        assert!(p[&0].is_empty());
    }
}
