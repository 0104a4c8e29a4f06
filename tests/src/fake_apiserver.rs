//! An in-test Kubernetes apiserver for Services, EndpointSlices and Nodes that speaks the real
//! list/watch protocol to the agent's kube-rs client: JSON objects, resourceVersion, paged lists
//! (limit/continue), label and field selectors, watch events (ADDED, MODIFIED, DELETED,
//! BOOKMARK), `410 Gone` for an expired resourceVersion. A test can drop every connection, make
//! the server go away and come back on the same port, and make lists of a resource fail. It also
//! takes the Events the agent creates and patches (events.k8s.io/v1), and keeps them.
//!
//! It listens on 127.0.0.1 inside a namespace (the node's), plain HTTP.
use std::collections::{BTreeMap, HashMap, HashSet};
use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context as _, Result};
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::manifests::ServiceManifest;
use crate::netns::Netns;

/// How often an idle watch gets a BOOKMARK.
const BOOKMARK_EVERY: Duration = Duration::from_millis(500);

type Body = BoxBody<Bytes, std::io::Error>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Service,
    EndpointSlice,
    Node,
}

impl Kind {
    fn of_path(path: &str) -> Option<Kind> {
        match path {
            "/api/v1/services" => Some(Kind::Service),
            "/apis/discovery.k8s.io/v1/endpointslices" => Some(Kind::EndpointSlice),
            "/api/v1/nodes" => Some(Kind::Node),
            _ => None,
        }
    }

    fn of_kind(kind: &str) -> Kind {
        match kind {
            "Service" => Kind::Service,
            "EndpointSlice" => Kind::EndpointSlice,
            "Node" => Kind::Node,
            other => panic!("the fake apiserver does not serve {other}"),
        }
    }

    fn names(self) -> (&'static str, &'static str) {
        match self {
            Kind::Service => ("v1", "Service"),
            Kind::EndpointSlice => ("discovery.k8s.io/v1", "EndpointSlice"),
            Kind::Node => ("v1", "Node"),
        }
    }
}

type Key = (Kind, String, String);

#[derive(Default)]
struct Inner {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    /// (resourceVersion, kind, event type, object), in order.
    history: Vec<(u64, Kind, &'static str, Value)>,
    /// Watches from a resourceVersion below this get 410 Gone.
    compacted: u64,
    failing: HashSet<Kind>,
    /// Pages of lists in progress: continue token → (resourceVersion, remaining items).
    pages: HashMap<String, (u64, Vec<Value>)>,
    next_page: u64,
    /// Every request, as `METHOD path?query`.
    requests: Vec<String>,
    /// The bodies of the Event creates and patches, in order.
    events: Vec<Value>,
}

struct Shared {
    inner: Mutex<Inner>,
    /// The newest resourceVersion: wakes the watches.
    rv: watch::Sender<u64>,
    /// Bumped to end every watch stream abruptly.
    drops: watch::Sender<u64>,
}

pub struct FakeApiserver {
    shared: Arc<Shared>,
    ns_path: String,
    addr: SocketAddr,
    runtime: Option<tokio::runtime::Runtime>,
}

impl FakeApiserver {
    /// Listens on 127.0.0.1 (a free port) inside `ns`.
    pub fn start(ns: &Netns) -> Result<Self> {
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner::default()),
            rv: watch::Sender::new(0),
            drops: watch::Sender::new(0),
        });
        let listener = ns.run(|| std::net::TcpListener::bind("127.0.0.1:0"))??;
        let addr = listener.local_addr()?;
        let mut server = FakeApiserver {
            shared,
            ns_path: format!("/run/netns/{}", ns.name()),
            addr,
            runtime: None,
        };
        server.serve(listener)?;
        Ok(server)
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes a kubeconfig for this server to `path`.
    pub fn write_kubeconfig(&self, path: &Path) -> Result<()> {
        let url = self.url();
        std::fs::write(
            path,
            format!(
                "apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster: {{server: \"{url}\"}}
users:
- name: test
  user: {{token: test-token}}
contexts:
- name: fake
  context: {{cluster: fake, user: test}}
current-context: fake
"
            ),
        )
        .with_context(|| format!("writing {}", path.display()))
    }

    /// Creates or replaces objects (k8s-openapi types), each an ADDED or MODIFIED event.
    pub fn apply<K: serde::Serialize + k8s_openapi::Resource>(&self, objects: &[K]) {
        let values = objects
            .iter()
            .map(|o| serde_json::to_value(o).expect("k8s-openapi objects serialize"))
            .collect::<Vec<_>>();
        self.apply_values(values);
    }

    /// Creates or replaces objects given as JSON (with apiVersion and kind).
    pub fn apply_values(&self, values: Vec<Value>) {
        let mut inner = self.shared.inner.lock().unwrap();
        for mut value in values {
            inner.rv += 1;
            let rv = inner.rv;
            let kind = Kind::of_kind(value["kind"].as_str().expect("kind"));
            value["metadata"]["resourceVersion"] = json!(rv.to_string());
            let key = key_of(kind, &value);
            let event = if inner.objects.contains_key(&key) {
                "MODIFIED"
            } else {
                value["metadata"]["uid"] = json!(format!("uid-{rv}"));
                "ADDED"
            };
            if event == "MODIFIED" {
                value["metadata"]["uid"] = inner.objects[&key]["metadata"]["uid"].clone();
            }
            inner.objects.insert(key, value.clone());
            inner.history.push((rv, kind, event, value));
        }
        let rv = inner.rv;
        drop(inner);
        self.shared.rv.send_replace(rv);
    }

    /// Creates or replaces the Services and EndpointSlices of test manifests.
    pub fn publish(&self, services: &[ServiceManifest]) -> Result<()> {
        let mut values = Vec::new();
        for service in services {
            for doc in service
                .yaml()
                .split("---\n")
                .filter(|d| !d.trim().is_empty())
            {
                values.push(yaml_serde::from_str(doc).context("a test manifest")?);
            }
        }
        self.apply_values(values);
        Ok(())
    }

    /// Creates Node `name` with the InternalIP `ip` (an agent without --node-ip takes it).
    pub fn add_node(&self, name: &str, ip: Ipv4Addr) {
        self.apply_values(vec![json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name},
            "status": {"addresses": [
                {"type": "Hostname", "address": name},
                {"type": "InternalIP", "address": ip.to_string()},
            ]},
        })]);
    }

    /// Deletes an object: a DELETED event.
    pub fn delete<K: k8s_openapi::Resource>(&self, namespace: Option<&str>, name: &str) {
        let kind = Kind::of_kind(K::KIND);
        let mut inner = self.shared.inner.lock().unwrap();
        let key = (
            kind,
            namespace.unwrap_or_default().to_owned(),
            name.to_owned(),
        );
        let Some(mut value) = inner.objects.remove(&key) else {
            panic!("delete: no {key:?}");
        };
        inner.rv += 1;
        let rv = inner.rv;
        value["metadata"]["resourceVersion"] = json!(rv.to_string());
        inner.history.push((rv, kind, "DELETED", value));
        drop(inner);
        self.shared.rv.send_replace(rv);
    }

    /// Compacts the history: every watch resuming from before now gets 410 Gone and must
    /// relist. Open watches are dropped so they resume at once.
    pub fn expire_watches(&self) {
        let mut inner = self.shared.inner.lock().unwrap();
        // A new resourceVersion that lists return: a relist's watch starts from it.
        inner.rv += 1;
        inner.compacted = inner.rv;
        inner.history.clear();
        inner.pages.clear();
        drop(inner);
        self.drop_connections();
    }

    /// Ends every open watch abruptly (the connection goes, no clean end of stream).
    pub fn drop_connections(&self) {
        self.shared.drops.send_modify(|n| *n += 1);
    }

    /// Lists of `kind` fail with 500 Internal Server Error while `failing`.
    pub fn fail_lists(&self, kind: Kind, failing: bool) {
        let mut inner = self.shared.inner.lock().unwrap();
        if failing {
            inner.failing.insert(kind);
        } else {
            inner.failing.remove(&kind);
        }
    }

    /// Every request so far, as `GET path?query`.
    pub fn requests(&self) -> Vec<String> {
        self.shared.inner.lock().unwrap().requests.clone()
    }

    /// The Events created and patched so far (each as its request body), in order.
    pub fn events(&self) -> Vec<Value> {
        self.shared.inner.lock().unwrap().events.clone()
    }

    /// Goes away: the listener closes and every connection with it.
    pub fn stop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }

    /// Comes back on the same address, with the same objects and history.
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        let addr = self.addr;
        let path = self.ns_path.clone();
        let listener = std::thread::spawn(move || -> Result<std::net::TcpListener> {
            crate::netns::enter(&path)?;
            // A few tries: the old socket may linger for a moment.
            let mut tries = 0;
            loop {
                match std::net::TcpListener::bind(addr) {
                    Ok(l) => return Ok(l),
                    Err(_) if tries < 50 => {
                        tries += 1;
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(e).context(format!("rebinding {addr}")),
                }
            }
        })
        .join()
        .map_err(|_| anyhow::anyhow!("bind thread panicked"))??;
        self.serve(listener)
    }

    fn serve(&mut self, listener: std::net::TcpListener) -> Result<()> {
        listener.set_nonblocking(true)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let shared = self.shared.clone();
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let shared = shared.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let shared = shared.clone();
                        async move { Ok::<_, Infallible>(handle(&shared, req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        self.runtime = Some(runtime);
        Ok(())
    }
}

impl Drop for FakeApiserver {
    fn drop(&mut self) {
        self.stop();
    }
}

fn key_of(kind: Kind, value: &Value) -> Key {
    let meta = &value["metadata"];
    (
        kind,
        meta["namespace"].as_str().unwrap_or_default().to_owned(),
        meta["name"].as_str().expect("metadata.name").to_owned(),
    )
}

fn full(status: StatusCode, body: Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("Content-Type", "application/json")
        .body(
            Full::new(Bytes::from(body.to_string()))
                .map_err(|never| match never {})
                .boxed(),
        )
        .expect("response")
}

fn status(code: StatusCode, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code.as_u16(),
    })
}

/// Label selector terms: `k`, `!k`, `k=v`, `k==v`, `k!=v`.
fn labels_match(selector: &str, labels: &Value) -> bool {
    selector.split(',').filter(|t| !t.is_empty()).all(|term| {
        let label = |k: &str| labels.get(k.trim()).and_then(Value::as_str);
        if let Some((k, v)) = term.split_once("!=") {
            label(k) != Some(v.trim())
        } else if let Some((k, v)) = term.split_once('=') {
            label(k) == Some(v.trim_start_matches('=').trim())
        } else if let Some(k) = term.strip_prefix('!') {
            label(k).is_none()
        } else {
            label(term).is_some()
        }
    })
}

/// Field selector terms: `metadata.name=x`, `metadata.namespace=x`.
fn fields_match(selector: &str, value: &Value) -> bool {
    selector.split(',').filter(|t| !t.is_empty()).all(|term| {
        let (field, want) = term.split_once('=').unwrap_or((term, ""));
        let want = want.trim_start_matches('=');
        let have = match field {
            "metadata.name" => value["metadata"]["name"].as_str(),
            "metadata.namespace" => value["metadata"]["namespace"].as_str(),
            other => panic!("the fake apiserver has no field selector {other}"),
        };
        have.unwrap_or_default() == want
    })
}

struct Query {
    watch: bool,
    resource_version: Option<u64>,
    bookmarks: bool,
    labels: String,
    fields: String,
    limit: Option<usize>,
    continue_token: Option<String>,
    timeout: Option<Duration>,
}

fn parse_query(query: &str) -> Query {
    let mut q = Query {
        watch: false,
        resource_version: None,
        bookmarks: false,
        labels: String::new(),
        fields: String::new(),
        limit: None,
        continue_token: None,
        timeout: None,
    };
    for (k, v) in query.split('&').filter_map(|p| p.split_once('=')) {
        let v = percent_decode(v);
        match k {
            "watch" => q.watch = v == "true" || v == "1",
            "resourceVersion" => q.resource_version = v.parse().ok(),
            "allowWatchBookmarks" => q.bookmarks = v == "true",
            "labelSelector" => q.labels = v,
            "fieldSelector" => q.fields = v,
            "limit" => q.limit = v.parse().ok(),
            "continue" => q.continue_token = Some(v),
            "timeoutSeconds" => q.timeout = v.parse().ok().map(Duration::from_secs),
            _ => {}
        }
    }
    q
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                    }
                    Err(_) => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn handle(shared: &Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_owned();
    let query = req.uri().query().unwrap_or_default().to_owned();
    shared
        .inner
        .lock()
        .unwrap()
        .requests
        .push(format!("{} {path}?{query}", req.method()));
    if path.starts_with("/apis/events.k8s.io/v1/namespaces/") {
        return event_response(shared, req).await;
    }
    let Some(kind) = Kind::of_path(&path) else {
        return full(
            StatusCode::NOT_FOUND,
            status(
                StatusCode::NOT_FOUND,
                "NotFound",
                "the server could not find the requested resource",
            ),
        );
    };
    let q = parse_query(&query);
    if q.watch {
        watch_response(shared, kind, q)
    } else {
        list_response(shared, kind, q)
    }
}

/// An Event create (POST .../events) or patch (PATCH .../events/NAME): kept, and answered with
/// the Event as sent, which is what the apiserver stores (the agent's Recorder sends whole
/// Events, also as merge patches).
async fn event_response(shared: &Shared, req: Request<Incoming>) -> Response<Body> {
    let created = req.method() == hyper::Method::POST;
    let body = match req.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(err) => {
            return full(
                StatusCode::BAD_REQUEST,
                status(StatusCode::BAD_REQUEST, "BadRequest", &err.to_string()),
            );
        }
    };
    let Ok(mut event) = serde_json::from_slice::<Value>(&body) else {
        return full(
            StatusCode::BAD_REQUEST,
            status(StatusCode::BAD_REQUEST, "BadRequest", "not JSON"),
        );
    };
    let mut inner = shared.inner.lock().unwrap();
    inner.rv += 1;
    event["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
    inner.events.push(event.clone());
    let code = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    full(code, event)
}

fn list_response(shared: &Shared, kind: Kind, q: Query) -> Response<Body> {
    let mut inner = shared.inner.lock().unwrap();
    if inner.failing.contains(&kind) {
        return full(
            StatusCode::INTERNAL_SERVER_ERROR,
            status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                "lists fail (test)",
            ),
        );
    }
    let (rv, mut items) = match q.continue_token {
        Some(token) => match inner.pages.remove(&token) {
            Some(page) => page,
            None => {
                return full(
                    StatusCode::GONE,
                    status(
                        StatusCode::GONE,
                        "Expired",
                        "the provided continue parameter is too old",
                    ),
                );
            }
        },
        None => {
            let items = inner
                .objects
                .iter()
                .filter(|((k, _, _), v)| {
                    *k == kind
                        && labels_match(&q.labels, &v["metadata"]["labels"])
                        && fields_match(&q.fields, v)
                })
                .map(|(_, v)| v.clone())
                .collect();
            (inner.rv, items)
        }
    };
    let mut continue_token = Value::Null;
    if let Some(limit) = q.limit.filter(|&l| l > 0 && l < items.len()) {
        let rest = items.split_off(limit);
        inner.next_page += 1;
        let token = format!("page-{}", inner.next_page);
        inner.pages.insert(token.clone(), (rv, rest));
        continue_token = json!(token);
    }
    let (api_version, kind_name) = kind.names();
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if !continue_token.is_null() {
        metadata["continue"] = continue_token;
    }
    full(
        StatusCode::OK,
        json!({
            "kind": format!("{kind_name}List"), "apiVersion": api_version,
            "metadata": metadata, "items": items,
        }),
    )
}

fn watch_response(shared: &Arc<Shared>, kind: Kind, q: Query) -> Response<Body> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(64);
    let shared = shared.clone();
    let mut rv_rx = shared.rv.subscribe();
    let mut drops = shared.drops.subscribe();
    let (api_version, kind_name) = kind.names();
    tokio::spawn(async move {
        let line = |event: &str, object: &Value| {
            Ok(Frame::data(Bytes::from(format!(
                "{}\n",
                json!({"type": event, "object": object})
            ))))
        };
        let mut cursor = q.resource_version.unwrap_or(0);
        let deadline = tokio::time::Instant::now() + q.timeout.unwrap_or(Duration::from_secs(300));
        loop {
            let events = {
                let inner = shared.inner.lock().unwrap();
                if cursor < inner.compacted {
                    Err(status(
                        StatusCode::GONE,
                        "Expired",
                        &format!("too old resource version: {cursor} ({})", inner.compacted),
                    ))
                } else {
                    let events: Vec<_> = inner
                        .history
                        .iter()
                        .filter(|(rv, k, _, v)| {
                            *rv > cursor
                                && *k == kind
                                && labels_match(&q.labels, &v["metadata"]["labels"])
                                && fields_match(&q.fields, v)
                        })
                        .map(|(_, _, t, v)| (*t, v.clone()))
                        .collect();
                    cursor = cursor.max(inner.rv);
                    Ok(events)
                }
            };
            let events = match events {
                Ok(events) => events,
                Err(gone) => {
                    let _ = tx.send(line("ERROR", &gone)).await;
                    return;
                }
            };
            for (event, object) in events {
                if tx.send(line(event, &object)).await.is_err() {
                    return;
                }
            }
            tokio::select! {
                changed = rv_rx.changed() => if changed.is_err() { return },
                _ = drops.changed() => {
                    let _ = tx.send(Err(std::io::Error::other("connection dropped (test)"))).await;
                    return;
                }
                () = tokio::time::sleep(BOOKMARK_EVERY) => if q.bookmarks {
                    let bookmark = json!({
                        "kind": kind_name, "apiVersion": api_version,
                        "metadata": {"resourceVersion": cursor.to_string()},
                    });
                    if tx.send(line("BOOKMARK", &bookmark)).await.is_err() {
                        return;
                    }
                },
                () = tokio::time::sleep_until(deadline) => return,
            }
        }
    });
    let body = StreamBody::new(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|frame| (frame, rx))
    }));
    Response::builder()
        .status(StatusCode::OK)
        .header("Content-Type", "application/json")
        .body(body.boxed())
        .expect("response")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors() {
        let labels = json!({"kubernetes.io/service-name": "web", "a": "b"});
        assert!(labels_match(
            "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless",
            &labels
        ));
        assert!(!labels_match("!a", &labels));
        assert!(labels_match("a=b,a", &labels));
        assert!(labels_match("a!=c", &labels));
        assert!(!labels_match("a==c", &labels));
        let node = json!({"metadata": {"name": "node"}});
        assert!(fields_match("metadata.name=node", &node));
        assert!(!fields_match("metadata.name=other", &node));
        assert_eq!(percent_decode("%21a%2Cb%3Dc"), "!a,b=c");
    }
}
