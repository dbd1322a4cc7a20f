//! Events the collector raises: a host it refuses to collect is a fault someone must fix
//! (two clusters under one `clusterId`, say), and a skipped host in a log line is easy to
//! miss. Transient listing failures are not raised: the next sweep tries again.

use futures_util::future::BoxFuture;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};

use super::report::GcReport;
use crate::error::ErrorClass;

/// The reason of the event raised on a provider's ProviderHealth object when the
/// collector refuses hosts for good (until someone acts).
pub const COLLECTION_REFUSED: &str = "CollectionRefused";

/// Where the collector's events go.
pub trait GcEvents: Send + Sync {
    /// Hosts of `provider` the sweep refused to collect, with why (one line each).
    fn refused<'a>(&'a self, provider: &'a str, hosts: &'a [(String, String)])
    -> BoxFuture<'a, ()>;
}

/// The hosts of each provider a sweep refused for a permanent reason, domain and volume
/// listings together, each host once.
pub fn refused_hosts(report: &GcReport) -> Vec<(String, Vec<(String, String)>)> {
    let mut by_provider: std::collections::BTreeMap<String, Vec<(String, String)>> =
        Default::default();
    for s in report
        .skipped_targets
        .iter()
        .chain(&report.volume_targets_skipped)
        .filter(|s| s.class == ErrorClass::Permanent)
    {
        let hosts = by_provider.entry(s.provider.clone()).or_default();
        if !hosts.iter().any(|(h, _)| *h == s.target) {
            hosts.push((s.target.clone(), s.message.clone()));
        }
    }
    by_provider.into_iter().collect()
}

/// Events on the provider's cluster-scoped ProviderHealth object, where the health of its
/// hosts is already reported.
pub struct KubeGcEvents {
    recorder: Recorder,
}

impl std::fmt::Debug for KubeGcEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeGcEvents").finish_non_exhaustive()
    }
}

impl KubeGcEvents {
    /// Events reported as `egress-operator` (this replica: `instance`).
    pub fn new(client: kube::Client, instance: Option<String>) -> Self {
        Self {
            recorder: Recorder::new(
                client,
                Reporter {
                    controller: "egress-operator".into(),
                    instance,
                },
            ),
        }
    }
}

impl GcEvents for KubeGcEvents {
    fn refused<'a>(
        &'a self,
        provider: &'a str,
        hosts: &'a [(String, String)],
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let lines: Vec<String> = hosts.iter().map(|(h, m)| format!("{h}: {m}")).collect();
            let ev = Event {
                type_: EventType::Warning,
                reason: COLLECTION_REFUSED.into(),
                note: Some(crate::controller::event_note(format!(
                    "garbage collection refused on {} host(s): {}",
                    hosts.len(),
                    lines.join("; ")
                ))),
                action: "Collect".into(),
                secondary: None,
            };
            let regarding = ObjectReference {
                api_version: Some("egress-operator.dev/v1alpha1".into()),
                kind: Some("ProviderHealth".into()),
                name: Some(provider.to_string()),
                ..Default::default()
            };
            if let Err(e) = self.recorder.publish(&ev, &regarding).await {
                tracing::warn!(provider, error = %e, "gc: could not publish event");
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gc::report::SkippedTarget;

    fn skipped(target: &str, class: ErrorClass) -> SkippedTarget {
        SkippedTarget {
            provider: "kvm2".into(),
            target: target.into(),
            class,
            message: format!("{target} refused"),
        }
    }

    #[test]
    fn only_permanent_refusals_are_raised_each_host_once() {
        let report = GcReport {
            skipped_targets: vec![
                skipped("h1", ErrorClass::Permanent),
                skipped("h2", ErrorClass::Transient),
            ],
            volume_targets_skipped: vec![
                skipped("h1", ErrorClass::Permanent),
                skipped("h3", ErrorClass::Permanent),
            ],
            ..Default::default()
        };
        assert_eq!(
            refused_hosts(&report),
            vec![(
                "kvm2".to_string(),
                vec![
                    ("h1".to_string(), "h1 refused".to_string()),
                    ("h3".to_string(), "h3 refused".to_string())
                ]
            )]
        );
        assert!(refused_hosts(&GcReport::default()).is_empty());
    }
}
