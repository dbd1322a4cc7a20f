//! An in-memory [`Provider`] for tests of code that uses providers (controller, GC,
//! health monitor): instances live in a map, targets can be taken down, the next call of
//! an operation (or every call) can be made to fail with a chosen class, and a Create can
//! be made slow. A Create checks its request's fence right before it "defines" and right
//! before it "starts" the instance, as kvm2 does, and removes what it made when the fence
//! is lost.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::Duration;

use super::{
    BoxFuture, CreateRequest, HealthCheck, Instance, InstanceId, InstanceState, Provider,
    ProviderError, TargetHealth, TargetListing,
};
use crate::error::ErrorClass;

#[derive(Debug, Default)]
struct State {
    instances: BTreeMap<InstanceId, Instance>,
    down: BTreeSet<String>,
    fail_next: BTreeMap<&'static str, ErrorClass>,
    fail_always: BTreeMap<&'static str, ErrorClass>,
    create_delay: Duration,
    calls: Vec<&'static str>,
    create_requests: Vec<CreateRequest>,
    /// The revision parts a Create would record now (`None`: keeps no revisions).
    inputs: Option<BTreeMap<String, String>>,
}

/// The in-memory provider.
#[derive(Debug)]
pub struct FakeProvider {
    name: String,
    targets: Vec<String>,
    state: Mutex<State>,
}

impl FakeProvider {
    /// Deletes `id`; with an `owner`, refuses (touching nothing) an instance whose Proxy
    /// is another.
    fn delete_as(&self, id: &InstanceId, owner: Option<&str>) -> Result<(), ProviderError> {
        self.enter("delete")?;
        let mut s = self.state();
        if s.down.contains(&id.host) {
            return Err(ProviderError::msg(
                ErrorClass::Transient,
                format!("target {} is down", id.host),
            ));
        }
        if let (Some(owner), Some(i)) = (owner, s.instances.get(id)) {
            super::NotOwned::check(id, owner, &i.proxy.uid)?;
        }
        s.instances.remove(id);
        Ok(())
    }
    /// A provider with these targets, all up and empty.
    pub fn new(targets: &[&str]) -> Self {
        Self::named("fake", targets)
    }

    /// Like [`FakeProvider::new`], registered under `name` (e.g. `kvm2`, which
    /// `spec.provider` must name for the controller to look the provider up).
    pub fn named(name: &str, targets: &[&str]) -> Self {
        Self {
            name: name.to_string(),
            targets: targets.iter().map(|t| t.to_string()).collect(),
            state: Mutex::new(State::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        }
    }

    /// Makes the next call of `op` (`create`, `get`, `delete`, `list`) fail with `class`.
    pub fn fail_next(&self, op: &'static str, class: ErrorClass) {
        self.state().fail_next.insert(op, class);
    }

    /// Makes every call of `op` fail with `class` (`None`: stop failing). Each failure's
    /// message differs (it counts the calls), as real errors with elapsed times or byte
    /// counts do, so a test sees whether anything keys on the text.
    pub fn fail_always(&self, op: &'static str, class: Option<ErrorClass>) {
        let mut s = self.state();
        match class {
            Some(c) => s.fail_always.insert(op, c),
            None => s.fail_always.remove(op),
        };
    }

    /// Makes every Create wait this long (tokio time) before it defines the instance, as a
    /// Create waits on an image download.
    pub fn set_create_delay(&self, delay: Duration) {
        self.state().create_delay = delay;
    }

    /// Takes a target down or brings it back.
    pub fn set_down(&self, target: &str, down: bool) {
        let mut s = self.state();
        if down {
            s.down.insert(target.into());
        } else {
            s.down.remove(target);
        }
    }

    /// From now on, Creates are made from `parts` (input name → digest): what
    /// [`Provider::revision`] answers, as a real provider's config would.
    pub fn set_inputs(&self, parts: &[(&str, &str)]) {
        self.state().inputs = Some(
            parts
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect(),
        );
    }

    /// Puts an instance in place (e.g. an orphan for GC tests).
    pub fn insert(&self, instance: Instance) {
        self.state().instances.insert(instance.id.clone(), instance);
    }

    /// Changes an instance's state (e.g. to simulate a crash).
    pub fn set_state(&self, id: &InstanceId, state: InstanceState) {
        if let Some(i) = self.state().instances.get_mut(id) {
            i.state = state;
        }
    }

    /// All instances.
    pub fn instances(&self) -> Vec<Instance> {
        self.state().instances.values().cloned().collect()
    }

    /// Operations called so far, in order.
    pub fn calls(&self) -> Vec<&'static str> {
        self.state().calls.clone()
    }

    /// Every request `create` was called with, in order (failed calls included), so a
    /// test can see what reached the provider (e.g. the user-data).
    pub fn create_requests(&self) -> Vec<CreateRequest> {
        self.state().create_requests.clone()
    }

    fn enter(&self, op: &'static str) -> Result<(), ProviderError> {
        let mut s = self.state();
        s.calls.push(op);
        if let Some(class) = s.fail_next.remove(op) {
            return Err(ProviderError::msg(class, format!("injected {op} failure")));
        }
        match s.fail_always.get(op) {
            Some(class) => {
                let n = s.calls.iter().filter(|c| **c == op).count();
                Err(ProviderError::msg(
                    *class,
                    format!("injected {op} failure (call {n}, after {} ms)", n * 1375),
                ))
            }
            None => Ok(()),
        }
    }
}

impl Provider for FakeProvider {
    fn name(&self) -> &str {
        &self.name
    }

    fn revision(
        &self,
        _spec: &crate::api::proxy::ProxySpec,
        host: Option<&str>,
        user_data: crate::revision::UserData<'_>,
    ) -> Option<Result<crate::revision::Revision, String>> {
        use crate::revision::{HOST_POLICY, USER_DATA, UserData};
        let mut parts = self.state().inputs.clone()?;
        if let Some(h) = host {
            parts.insert(HOST_POLICY.into(), format!("host-{h}"));
        }
        let ud = match user_data {
            UserData::Read(None) => Some("none".to_string()),
            UserData::Read(Some(b)) => Some(format!("{} bytes", b.len())),
            UserData::Recorded(p) => p.map(str::to_string),
        };
        if let Some(u) = ud {
            parts.insert(USER_DATA.into(), u);
        }
        Some(Ok(crate::revision::Revision { parts }))
    }

    fn create<'a>(
        &'a self,
        req: &'a CreateRequest,
    ) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(async move {
            self.state().create_requests.push(req.clone());
            self.enter("create")?;
            let delay = self.state().create_delay;
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let mut s = self.state();
            let name = format!("{}{}", crate::instance::NAME_PREFIX, req.proxy.uid);
            if let Some(existing) = s.instances.values().find(|i| i.id.name == name) {
                return Ok(existing.clone());
            }
            let host = match &req.spec.host {
                Some(h) => h.clone(),
                None => self
                    .targets
                    .iter()
                    .find(|t| !s.down.contains(*t))
                    .cloned()
                    .ok_or_else(|| {
                        ProviderError::msg(ErrorClass::Transient, "every target is down")
                    })?,
            };
            if s.down.contains(&host) {
                return Err(ProviderError::msg(
                    ErrorClass::Transient,
                    format!("target {host} is down"),
                ));
            }
            req.fence
                .check("domain define")
                .map_err(ProviderError::new)?;
            let mut instance = Instance {
                id: InstanceId { host, name },
                proxy: req.proxy.clone(),
                state: InstanceState::ShutOff,
                addresses: vec![std::net::IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 10))],
                address_source: Some(crate::provider::AddressOrigin::Lease),
                seed_applied: None,
                created_at: humantime::format_rfc3339_seconds(std::time::SystemTime::now())
                    .to_string(),
            };
            s.instances.insert(instance.id.clone(), instance.clone());
            if let Err(e) = req.fence.check("domain start") {
                // Removes what this Create made, as kvm2's failure cleanup does.
                s.instances.remove(&instance.id);
                return Err(ProviderError::new(e));
            }
            instance.state = InstanceState::Running;
            s.instances.insert(instance.id.clone(), instance.clone());
            Ok(instance)
        })
    }

    fn get<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<Instance, ProviderError>> {
        Box::pin(async move {
            self.enter("get")?;
            let s = self.state();
            if s.down.contains(&id.host) {
                return Err(ProviderError::msg(
                    ErrorClass::Transient,
                    format!("target {} is down", id.host),
                ));
            }
            s.instances.get(id).cloned().ok_or_else(|| {
                ProviderError::msg(ErrorClass::NotFound, format!("instance {id} not found"))
            })
        })
    }

    fn delete<'a>(&'a self, id: &'a InstanceId) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(async move { self.delete_as(id, None) })
    }

    /// One call (counted as a delete), as a real provider checks the mark while deleting.
    fn delete_owned<'a>(
        &'a self,
        id: &'a InstanceId,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<(), ProviderError>> {
        Box::pin(async move { self.delete_as(id, Some(owner)) })
    }

    fn list(&self) -> BoxFuture<'_, Vec<TargetListing>> {
        Box::pin(async move {
            let _ = self.enter("list");
            let s = self.state();
            self.targets
                .iter()
                .map(|t| TargetListing {
                    target: t.clone(),
                    result: if s.down.contains(t) {
                        Err(ProviderError::msg(
                            ErrorClass::Transient,
                            format!("target {t} is down"),
                        ))
                    } else {
                        Ok(s.instances
                            .values()
                            .filter(|i| &i.id.host == t)
                            .cloned()
                            .collect())
                    },
                })
                .collect()
        })
    }

    fn health(&self) -> Option<&dyn HealthCheck> {
        Some(self)
    }
}

impl HealthCheck for FakeProvider {
    fn check(&self, _timeout: Duration) -> BoxFuture<'_, Vec<TargetHealth>> {
        Box::pin(async move {
            let s = self.state();
            self.targets
                .iter()
                .map(|t| {
                    let down = s.down.contains(t);
                    TargetHealth {
                        target: t.clone(),
                        reachable: !down,
                        reason: down.then(|| "connect".to_string()),
                        stage: None,
                        message: if down { "down".into() } else { "ok".into() },
                        latency: Duration::from_millis(1),
                    }
                })
                .collect()
        })
    }
}
