//! A stand-in for a test binary that uses the node tier, for the harness's own test of
//! what a killed test process leaves behind (`tests/tests/node_teardown.rs`): it starts the
//! shared node, runs a pod on it (so there are containers, mounts, cgroups and a pod
//! network to clean up), prints `NODE <dir>`, then waits until its stdin closes. Killed
//! instead, it ends as a crashed test does, and only the node's watchdog cleans up.

use std::io::{Read, Write};
use std::process::ExitCode;

use integration_tests::harness::Node;
use integration_tests::harness::node::BUSYBOX_IMAGE;

fn main() -> ExitCode {
    let node = match Node::shared() {
        Ok(node) => node,
        Err(e) => {
            eprintln!("node-holder: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let pod = format!(
        "apiVersion: v1
kind: Pod
metadata: {{name: held, namespace: default}}
spec:
  terminationGracePeriodSeconds: 30
  containers:
  - name: sleeper
    image: {BUSYBOX_IMAGE}
    imagePullPolicy: Never
    command: [sh, -c, 'trap \"\" TERM; while :; do sleep 1; done']
"
    );
    let ready = node.apply(&pod).and_then(|_| {
        node.kubectl_run(&[
            "wait",
            "--for=condition=Ready",
            "pod/held",
            "--timeout=120s",
        ])
    });
    if let Err(e) = ready {
        eprintln!("node-holder: the pod did not run: {e:#}");
        return ExitCode::FAILURE;
    }
    let mut out = std::io::stdout();
    if writeln!(out, "NODE {}", node.dir().display())
        .and_then(|()| out.flush())
        .is_err()
    {
        return ExitCode::FAILURE;
    }
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    ExitCode::SUCCESS
}
