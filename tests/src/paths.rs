//! The four Service paths as checks on a running node, whatever feeds the agent (manifests or an
//! apiserver): who answered, which source the backend saw, which peer the client saw.
use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Result, ensure};

use crate::{
    echo::{Answer, Proto, request, requests},
    netns::Netns,
    topology::{NODE_IP, POD_GATEWAY, Topology},
};

/// How many answers each server gave.
pub fn servers(answers: &[Answer]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for answer in answers {
        *counts.entry(answer.server.clone()).or_default() += 1;
    }
    counts
}

/// Every answer came from one of `expected` and all of them answered.
pub fn assert_answered_by(answers: &[Answer], expected: &[&str]) -> Result<()> {
    let counts = servers(answers);
    let names: Vec<&str> = counts.keys().map(String::as_str).collect();
    ensure!(
        names == expected,
        "answered by {counts:?}, expected {expected:?}"
    );
    Ok(())
}

pub fn assert_all(answers: &[Answer], what: &str, ok: impl Fn(&Answer) -> bool) -> Result<()> {
    if let Some(bad) = answers.iter().find(|a| !ok(a)) {
        anyhow::bail!("{what}: {bad:?}");
    }
    Ok(())
}

/// Path 1: Pod-A → ClusterIP `vip` → pod-b / pod-c, not masqueraded.
pub fn check_pod_to_service(topology: &Topology, proto: Proto, vip: SocketAddr) -> Result<()> {
    let client = topology.pod("pod-a");
    let answers = requests(&client.ns, proto, vip, 30)?;
    assert_answered_by(&answers, &["pod-b", "pod-c"])?;
    assert_all(&answers, "backend saw Pod-A's own address", |a| {
        a.seen_source.ip() == client.ip
    })?;
    assert_all(&answers, "client saw the ClusterIP as peer", |a| {
        a.peer == vip
    })
}

/// Path 2: Pod-A → ClusterIP `vip` → Pod-A, masqueraded to the address routing picks towards
/// Pod-A, as MASQUERADE does: the node's address on the pod veths.
pub fn check_hairpin(topology: &Topology, proto: Proto, vip: SocketAddr) -> Result<()> {
    let answers = requests(&topology.pod("pod-a").ns, proto, vip, 10)?;
    assert_answered_by(&answers, &["pod-a"])?;
    assert_all(&answers, "backend saw the node's pod-side address", |a| {
        a.seen_source.ip() == POD_GATEWAY
    })?;
    assert_all(&answers, "client saw the ClusterIP as peer", |a| {
        a.peer == vip
    })
}

/// Path 3: a container on the docker bridge (outside the cluster CIDR) → ClusterIP `vip` →
/// pod-b / pod-c, masqueraded (as in path 2).
pub fn check_container_to_service(
    topology: &Topology,
    proto: Proto,
    vip: SocketAddr,
) -> Result<()> {
    let answers = requests(&topology.container, proto, vip, 30)?;
    assert_answered_by(&answers, &["pod-b", "pod-c"])?;
    assert_all(&answers, "backend saw the node's pod-side address", |a| {
        a.seen_source.ip() == POD_GATEWAY
    })?;
    assert_all(&answers, "client saw the ClusterIP as peer", |a| {
        a.peer == vip
    })
}

/// Path 4: an external client → node address:`node_port` → pod-b / pod-c, masqueraded
/// as in path 2 (externalTrafficPolicy Cluster); the same service stays reachable on its ClusterIP `vip` from
/// a pod, unmasqueraded.
pub fn check_external_to_node_port(
    topology: &Topology,
    proto: Proto,
    vip: SocketAddr,
    node_port: u16,
) -> Result<()> {
    let node_port: SocketAddr = (NODE_IP, node_port).into();
    let answers = requests(&topology.client, proto, node_port, 30)?;
    assert_answered_by(&answers, &["pod-b", "pod-c"])?;
    assert_all(&answers, "backend saw the node's pod-side address", |a| {
        a.seen_source.ip() == POD_GATEWAY
    })?;
    assert_all(&answers, "client saw node:nodePort as peer", |a| {
        a.peer == node_port
    })?;
    let pod_a = topology.pod("pod-a");
    let answer = request(&pod_a.ns, proto, vip)?;
    ensure!(answer.seen_source.ip() == pod_a.ip, "{answer:?}");
    Ok(())
}

/// Requests from `ns` to `to` on a thread until stopped, at most 5000 or `max`; the answers and
/// the errors it saw.
pub struct Traffic {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Result<(Vec<Answer>, Vec<String>)>>,
}

impl Traffic {
    pub fn start(ns: &Netns, proto: Proto, to: SocketAddr, max: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let path = format!("/run/netns/{}", ns.name());
        let thread = std::thread::spawn({
            let stop = stop.clone();
            move || {
                crate::netns::enter(&path)?;
                let deadline = Instant::now() + max;
                let (mut answers, mut errors) = (Vec::new(), Vec::new());
                while !stop.load(Ordering::Relaxed)
                    && answers.len() < 5000
                    && Instant::now() < deadline
                {
                    match proto.request(to) {
                        Ok(answer) => answers.push(answer),
                        Err(e) => errors.push(format!("{e:#}")),
                    }
                }
                Ok((answers, errors))
            }
        });
        Traffic { stop, thread }
    }

    pub fn finish(self) -> Result<(Vec<Answer>, Vec<String>)> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("traffic thread panicked"))?
    }
}
