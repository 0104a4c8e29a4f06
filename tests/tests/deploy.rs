//! Every manifest in deploy/ decodes as its k8s-openapi type with no field left over (so a typo
//! in a field name fails), the kustomization lists exactly those files, and the DaemonSet has
//! what the agent needs on a node (its node IP from the downward API included).
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail, ensure};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Decodes `value` as `T` and checks that encoding it again gives the same JSON: a field `T`
/// does not know would be dropped.
fn typed<T: DeserializeOwned + Serialize>(file: &str, value: &Value) -> Result<T> {
    let object: T = serde_path_to_error::deserialize(value.clone())
        .map_err(|e| anyhow::anyhow!("{file}: {}: {}", e.path(), e.inner()))?;
    let again = serde_json::to_value(&object)?;
    if let Some(path) = first_difference(value, &again, String::new()) {
        bail!(
            "{file}: {path}: not a field of {}",
            std::any::type_name::<T>()
        );
    }
    Ok(object)
}

fn first_difference(want: &Value, have: &Value, path: String) -> Option<String> {
    match (want, have) {
        (Value::Object(w), Value::Object(h)) => w.iter().find_map(|(k, v)| match h.get(k) {
            Some(hv) => first_difference(v, hv, format!("{path}.{k}")),
            None => Some(format!("{path}.{k}")),
        }),
        (Value::Array(w), Value::Array(h)) if w.len() == h.len() => w
            .iter()
            .zip(h)
            .enumerate()
            .find_map(|(i, (w, h))| first_difference(w, h, format!("{path}[{i}]"))),
        _ if want == have => None,
        _ => Some(path),
    }
}

#[test]
fn deploy_manifests_are_valid() -> Result<()> {
    let mut files = BTreeSet::new();
    let mut daemonsets = Vec::new();
    let mut roles = Vec::new();
    let mut kinds = BTreeSet::new();
    for entry in std::fs::read_dir(deploy_dir())? {
        let path = entry?.path();
        let file = path.file_name().unwrap().to_string_lossy().into_owned();
        if file == "kustomization.yaml" || !file.ends_with(".yaml") {
            continue;
        }
        files.insert(file.clone());
        let text = std::fs::read_to_string(&path)?;
        for doc in yaml_serde::Deserializer::from_str(&text) {
            let value: Value = serde::Deserialize::deserialize(doc).context(file.clone())?;
            let kind = format!(
                "{}/{}",
                value["apiVersion"].as_str().unwrap_or_default(),
                value["kind"].as_str().unwrap_or_default()
            );
            match kind.as_str() {
                "v1/Namespace" => drop(typed::<Namespace>(&file, &value)?),
                "v1/ServiceAccount" => drop(typed::<ServiceAccount>(&file, &value)?),
                "v1/ConfigMap" => drop(typed::<ConfigMap>(&file, &value)?),
                "rbac.authorization.k8s.io/v1/ClusterRole" => {
                    roles.push(typed::<ClusterRole>(&file, &value)?)
                }
                "rbac.authorization.k8s.io/v1/ClusterRoleBinding" => {
                    drop(typed::<ClusterRoleBinding>(&file, &value)?)
                }
                "apps/v1/DaemonSet" => daemonsets.push(typed::<DaemonSet>(&file, &value)?),
                other => bail!("{file}: unexpected {other}"),
            }
            kinds.insert(kind);
        }
    }
    ensure!(kinds.len() == 6, "{kinds:?}");

    let kustomization: Value = yaml_serde::from_str(&std::fs::read_to_string(
        deploy_dir().join("kustomization.yaml"),
    )?)?;
    let listed: BTreeSet<String> = kustomization["resources"]
        .as_array()
        .context("resources")?
        .iter()
        .map(|r| r.as_str().unwrap_or_default().to_owned())
        .collect();
    ensure!(
        listed == files,
        "kustomization lists {listed:?}, deploy/ has {files:?}"
    );

    // The agent's Recorder creates events.k8s.io Events and patches them into series.
    let events_allowed = roles
        .iter()
        .flat_map(|r| r.rules.iter().flatten())
        .any(|rule| {
            let has =
                |list: &Option<Vec<String>>, item: &str| list.iter().flatten().any(|i| i == item);
            has(&rule.api_groups, "events.k8s.io")
                && has(&rule.resources, "events")
                && ["create", "patch"]
                    .iter()
                    .all(|verb| rule.verbs.iter().any(|v| v == verb))
        });
    ensure!(
        events_allowed,
        "no ClusterRole rule lets the agent create and patch Events"
    );

    let [ds] = daemonsets.as_slice() else {
        bail!("one DaemonSet expected")
    };
    let pod = ds.spec.template.spec.as_ref().unwrap();
    ensure!(pod.host_network == Some(true));
    ensure!(pod.priority_class_name.as_deref() == Some("system-node-critical"));
    ensure!(
        pod.tolerations
            .iter()
            .flatten()
            .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none())
    );
    let c = &pod.containers[0];
    ensure!(c.security_context.as_ref().unwrap().privileged == Some(true));
    let mounts: Vec<&str> = c
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| m.mount_path.as_str())
        .collect();
    ensure!(
        mounts.contains(&"/sys/fs/bpf") && mounts.contains(&"/lib/modules"),
        "{mounts:?}"
    );
    let node_name = c
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "NODE_NAME")
        .context("NODE_NAME")?;
    ensure!(
        node_name
            .value_from
            .as_ref()
            .unwrap()
            .field_ref
            .as_ref()
            .unwrap()
            .field_path
            == "spec.nodeName"
    );
    // The node IP from the downward API: start-up does not wait for the apiserver.
    let host_ip = c
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "HOST_IP")
        .context("HOST_IP")?;
    ensure!(
        host_ip
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .is_some_and(|f| f.field_path == "status.hostIP"),
        "{host_ip:?}"
    );
    ensure!(
        c.args.iter().flatten().any(|a| a == "--node-ip=$(HOST_IP)"),
        "{:?}",
        c.args
    );
    for probe in [&c.readiness_probe, &c.liveness_probe] {
        let get = probe
            .as_ref()
            .context("probe")?
            .http_get
            .as_ref()
            .context("httpGet")?;
        ensure!(matches!(
            get.port,
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(10256)
        ));
    }
    ensure!(
        c.resources
            .as_ref()
            .and_then(|r| r.requests.as_ref())
            .is_some_and(|r| r.contains_key("memory"))
    );
    Ok(())
}

/// deploy/uninstall/: a DaemonSet that runs `lb cleanup` on every node's host bpffs, on the
/// same --bpffs the agent's DaemonSet pins in, listed by its kustomization.
#[test]
fn uninstall_runs_lb_cleanup_on_every_node() -> Result<()> {
    let dir = deploy_dir().join("uninstall");
    let text = std::fs::read_to_string(dir.join("daemonset.yaml"))?;
    let ds: DaemonSet = typed("uninstall/daemonset.yaml", &yaml_serde::from_str(&text)?)?;
    let pod = ds.spec.template.spec.context("pod spec")?;
    ensure!(
        pod.tolerations
            .iter()
            .flatten()
            .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()),
        "runs on every node, whatever its taints"
    );
    let cleanup = pod
        .init_containers
        .iter()
        .flatten()
        .find(|c| {
            c.args
                .as_ref()
                .is_some_and(|a| a.first().is_some_and(|a| a == "cleanup"))
        })
        .context("an init container runs `lb cleanup`")?;
    ensure!(
        cleanup
            .args
            .iter()
            .flatten()
            .any(|a| a == "--bpffs=/sys/fs/bpf/lb"),
        "cleanup's --bpffs is the agent's default"
    );
    let mounts_host_bpffs = cleanup
        .volume_mounts
        .iter()
        .flatten()
        .any(|m| m.mount_path == "/sys/fs/bpf")
        && pod.volumes.iter().flatten().any(|v| {
            v.host_path
                .as_ref()
                .is_some_and(|h| h.path == "/sys/fs/bpf")
        });
    ensure!(mounts_host_bpffs, "cleanup sees the host's /sys/fs/bpf");
    let kustomization: Value =
        yaml_serde::from_str(&std::fs::read_to_string(dir.join("kustomization.yaml"))?)?;
    ensure!(
        kustomization["resources"] == serde_json::json!(["daemonset.yaml"]),
        "{kustomization}"
    );
    Ok(())
}
