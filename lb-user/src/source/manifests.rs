//! The manifest directory as a source: every `*.yaml`/`*.yml` file, several documents per file,
//! v1 Services and discovery.k8s.io/v1 EndpointSlices. The directory is read as a whole: one bad
//! document fails the whole read, so the caller keeps its last good state. [`ManifestCache`]
//! keeps each file's parse, so a load parses only the files that changed.
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::hash::{DefaultHasher, Hash as _, Hasher as _};
use std::io;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use rayon::prelude::*;
use serde::Deserialize as _;
use serde::de::DeserializeOwned;
use tracing::{debug, warn};

use crate::model::{ServiceName, ServiceSpec, SliceSpec, Specs};
use crate::source::convert::{self, InvalidField};

/// Where in the directory: a file name and a 1-based document index.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Location {
    pub file: String,
    pub document: usize,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: document {}", self.file, self.document)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("reading directory {}: {source}", dir.display())]
    ReadDir { dir: PathBuf, source: io::Error },
    #[error("{file}: {source}")]
    ReadFile { file: String, source: io::Error },
    #[error("{at}: {source}")]
    Yaml {
        at: Location,
        source: yaml_serde::Error,
    },
    #[error("{at}: {field}")]
    MissingKind { at: Location, field: &'static str },
    #[error("{at}: {path}: {source}")]
    Decode {
        at: Location,
        path: String,
        source: yaml_serde::Error,
    },
    #[error("{at}: {source}")]
    Invalid { at: Location, source: InvalidField },
    #[error("{at}: duplicate {kind} {name} (first at {first})")]
    Duplicate {
        at: Location,
        kind: &'static str,
        name: String,
        first: Location,
    },
}

/// The manifest directory as last loaded, file by file: a load parses again only the files
/// that changed since, and tells which services changed with them.
#[derive(Debug, Default)]
pub struct ManifestCache {
    files: BTreeMap<PathBuf, CachedFile>,
    specs: Specs,
    /// Where each object is (kind, namespace/name): a name is unique across the directory.
    names: BTreeMap<(&'static str, String), Location>,
    /// Files parsed since the cache was made.
    parses: u64,
}

/// A file as last parsed, and how to tell it has not changed since.
#[derive(Debug)]
struct CachedFile {
    stamp: Stamp,
    /// The stamp was taken so soon after the file's last change that a change right after it
    /// may have left it as it is (timestamps are coarse): then the content hash decides.
    racy: bool,
    hash: u64,
    objects: Vec<ObjectKey>,
}

/// What changes whenever the file's content does, unless `racy`: a rename gives another inode,
/// a write a later mtime (and ctime).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

/// A change within this much of a stamp's mtime or ctime may not move them.
const RACY_MARGIN: Duration = Duration::from_secs(1);

impl Stamp {
    fn of(meta: &std::fs::Metadata) -> Stamp {
        Stamp {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }

    /// Whether a change made at `read_at` or later could leave this stamp as it is.
    fn racy(&self, read_at: SystemTime) -> bool {
        let newest = self.mtime.max(self.ctime);
        let since_epoch = read_at.duration_since(UNIX_EPOCH).unwrap_or_default();
        let margin = since_epoch.saturating_sub(RACY_MARGIN);
        (margin.as_secs() as i64, i64::from(margin.subsec_nanos())) <= newest
    }
}

/// A Service or EndpointSlice document of a file.
#[derive(Debug)]
struct ObjectKey {
    at: Location,
    kind: &'static str,
    name: String,
    /// The service its spec belongs to; None when it is not ours to use.
    service: Option<ServiceName>,
}

/// A document of a file, validated.
#[derive(Debug)]
struct Object {
    key: ObjectKey,
    spec: Option<Spec>,
}

#[derive(Debug)]
enum Spec {
    Service(ServiceSpec),
    Slice(SliceSpec),
}

/// What a load found of one file.
enum Refresh {
    Unchanged,
    /// The same content under a new stamp.
    Restamped {
        stamp: Stamp,
        racy: bool,
    },
    /// New content, to be parsed.
    Read {
        file: CachedFile,
        name: String,
        text: String,
    },
    /// Removed since it was listed.
    Vanished,
}

impl ManifestCache {
    /// What the directory held at the last load that succeeded.
    pub fn specs(&self) -> &Specs {
        &self.specs
    }

    /// Rebuilds the specs' maps with full nodes, after a bulk change ([`crate::compact`]).
    pub fn compact_specs(&mut self) {
        self.specs.compact();
    }

    /// Files parsed since the cache was made.
    pub fn parses(&self) -> u64 {
        self.parses
    }

    /// Reads and validates the manifest files of `dir` that changed since the last load;
    /// returns the services whose spec or slices changed. On an error the cache stays as it
    /// was (the next load reads the changed files again), so its specs are the last good state.
    pub fn load(&mut self, dir: &Path) -> Result<BTreeSet<ServiceName>, ManifestError> {
        let read_dir_err = |source| ManifestError::ReadDir {
            dir: dir.to_owned(),
            source,
        };
        let mut listed = BTreeMap::new();
        for entry in std::fs::read_dir(dir).map_err(read_dir_err)? {
            let path = entry.map_err(read_dir_err)?.path();
            if !is_manifest_name(&path) {
                continue;
            }
            match std::fs::metadata(&path) {
                Ok(meta) if meta.is_file() => {
                    listed.insert(path, Stamp::of(&meta));
                }
                // Removed since the listing, or not a file.
                _ => {}
            }
        }

        let mut replaced: BTreeSet<PathBuf> = self
            .files
            .keys()
            .filter(|path| !listed.contains_key(*path))
            .cloned()
            .collect();
        let mut read = Vec::new();
        let mut restamped = Vec::new();
        // A file that cannot be read fails the load, unless a file before it fails to parse.
        let mut read_error = None;
        for (path, stamp) in listed {
            match self.refresh(&path, stamp) {
                Err(err) => {
                    read_error = Some(err);
                    break;
                }
                Ok(Refresh::Unchanged) => {}
                Ok(Refresh::Restamped { stamp, racy }) => restamped.push((path, stamp, racy)),
                Ok(Refresh::Read { file, name, text }) => {
                    replaced.insert(path.clone());
                    read.push((path, file, name, text));
                }
                Ok(Refresh::Vanished) => {
                    replaced.insert(path);
                }
            }
        }
        let texts: Vec<(&str, &str)> = read
            .iter()
            .map(|(_, _, name, text)| (name.as_str(), text.as_str()))
            .collect();
        let objects = parse_files(&texts);
        self.parses += read.len() as u64;
        let mut parsed = Vec::with_capacity(read.len());
        for ((path, file, _, _), objects) in read.into_iter().zip(objects) {
            parsed.push((path, file, objects?));
        }
        if let Some(err) = read_error {
            return Err(err);
        }
        self.check_unique(&parsed, &replaced)?;

        let mut changed = BTreeSet::new();
        for path in &replaced {
            for key in self
                .files
                .remove(path)
                .map(|f| f.objects)
                .unwrap_or_default()
            {
                self.remove(&key);
                changed.extend(key.service);
            }
        }
        for (path, mut file, objects) in parsed {
            for object in objects {
                changed.extend(object.key.service.clone());
                file.objects.push(self.insert(object));
            }
            self.files.insert(path, file);
        }
        for (path, stamp, racy) in restamped {
            if let Some(file) = self.files.get_mut(&path) {
                file.stamp = stamp;
                file.racy = racy;
            }
        }
        Ok(changed)
    }

    /// Reads `path` unless its cached parse is of the same content.
    fn refresh(&mut self, path: &Path, stamp: Stamp) -> Result<Refresh, ManifestError> {
        let cached = self.files.get(path);
        if cached.is_some_and(|c| c.stamp == stamp && !c.racy) {
            return Ok(Refresh::Unchanged);
        }
        let file = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let read_at = SystemTime::now();
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            // Removed since it was listed: the event of its removal brings another load.
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Refresh::Vanished),
            Err(source) => return Err(ManifestError::ReadFile { file, source }),
        };
        let hash = content_hash(&text);
        let racy = stamp.racy(read_at);
        if cached.is_some_and(|c| c.hash == hash) {
            return Ok(Refresh::Restamped { stamp, racy });
        }
        debug!(file, "parsing");
        Ok(Refresh::Read {
            file: CachedFile {
                stamp,
                racy,
                hash,
                objects: Vec::new(),
            },
            name: file,
            text,
        })
    }

    /// Fails when a name of `parsed` (in file order) is given twice, among them or by a file
    /// that stays (not in `replaced`).
    fn check_unique(
        &self,
        parsed: &[(PathBuf, CachedFile, Vec<Object>)],
        replaced: &BTreeSet<PathBuf>,
    ) -> Result<(), ManifestError> {
        let mut seen: BTreeMap<(&'static str, &str), &Location> = BTreeMap::new();
        let stays = |at: &Location| {
            !replaced
                .iter()
                .any(|p| p.file_name() == Some(std::ffi::OsStr::new(&at.file)))
        };
        for (_, _, objects) in parsed {
            for ObjectKey { at, kind, name, .. } in objects.iter().map(|o| &o.key) {
                let held = self
                    .names
                    .get(&(*kind, name.clone()))
                    .filter(|held| stays(held));
                if let Some(other) = seen.get(&(*kind, name.as_str())).copied().or(held) {
                    let (first, at) = if other < at { (other, at) } else { (at, other) };
                    return Err(ManifestError::Duplicate {
                        at: at.clone(),
                        kind,
                        name: name.clone(),
                        first: first.clone(),
                    });
                }
                seen.insert((*kind, name), at);
            }
        }
        Ok(())
    }

    fn remove(&mut self, key: &ObjectKey) {
        self.names.remove(&(key.kind, key.name.clone()));
        let Some(service) = &key.service else {
            return;
        };
        if key.kind == SERVICE {
            self.specs.services.remove(service);
        } else if let Some(slices) = self.specs.slices.get_mut(service) {
            slices.remove(&(key.at.file.clone(), key.at.document));
            if slices.is_empty() {
                self.specs.slices.remove(service);
            }
        }
    }

    fn insert(&mut self, object: Object) -> ObjectKey {
        let key = object.key;
        self.names
            .insert((key.kind, key.name.clone()), key.at.clone());
        match object.spec {
            Some(Spec::Service(spec)) => {
                self.specs.services.insert(spec.name.clone(), spec);
            }
            Some(Spec::Slice(spec)) => {
                self.specs
                    .slices
                    .entry(spec.service.clone())
                    .or_default()
                    .insert((key.at.file.clone(), key.at.document), spec);
            }
            None => {}
        }
        key
    }
}

const SERVICE: &str = "Service";
const ENDPOINT_SLICE: &str = "EndpointSlice";

fn content_hash(text: &str) -> u64 {
    let mut hasher = DefaultHasher::new();
    text.hash(&mut hasher);
    hasher.finish()
}

/// `*.yaml` and `*.yml`, but not hidden files (editors' and tools' temporaries).
pub fn is_manifest_name(path: &Path) -> bool {
    let hidden = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_none_or(|n| n.starts_with('.'));
    let yaml = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e == "yaml" || e == "yml");
    yaml && !hidden
}

/// Files (or parts of one) at least this long are decoded on threads of their own.
const PART_MIN: usize = 256 * 1024;

/// Every Service and EndpointSlice document of each of `files` (name, text), validated, in the
/// order given. They are decoded in one pass, straight into the typed objects ([`decode_part`]),
/// a big file in parts, on every core; a file that this fails for anywhere is parsed again by
/// [`parse_exact`], which finds the error and names its document and field.
fn parse_files(files: &[(&str, &str)]) -> Vec<Result<Vec<Object>, ManifestError>> {
    let workers = rayon::current_num_threads();
    let total: usize = files.iter().map(|(_, text)| text.len()).sum();
    // A few parts per worker, so that one slow part does not leave the others idle.
    let part_len = (total / (workers * 4)).max(PART_MIN);
    let parts: Vec<(usize, &str)> = files
        .iter()
        .enumerate()
        .flat_map(|(i, (_, text))| split_documents(text, part_len).map(move |part| (i, part)))
        .collect();
    let decoded: Vec<_> = parts
        .par_iter()
        .map(|&(i, text)| decode_part(files[i].0, text))
        .collect();
    // Each file's parts in order: a part's documents are numbered after the previous parts'.
    let mut whole: Vec<Option<(usize, Vec<Object>)>> =
        files.iter().map(|_| Some((0, Vec::new()))).collect();
    for (&(i, _), part) in parts.iter().zip(decoded) {
        whole[i] = match (whole[i].take(), part) {
            (Some((before, mut objects)), Some((documents, part))) => {
                objects.extend(part.into_iter().map(|mut object| {
                    object.key.at.document += before;
                    object
                }));
                Some((before + documents, objects))
            }
            _ => None,
        };
    }
    files
        .iter()
        .zip(whole)
        .map(|((file, text), decoded)| match decoded {
            Some((_, objects)) => Ok(objects),
            None => parse_exact(file, text),
        })
        .collect()
}

/// `text` cut into parts of whole documents, each about `part_len` long or more: before a
/// document marker line (`---` at the start of a line, which YAML never allows inside a
/// document, not even in a block or quoted scalar). A part begins with a marker (or is the
/// file's start), so it holds the same documents as it does in the whole file. A file with
/// directives (`%YAML`, which belong to the document after them) stays whole.
fn split_documents(text: &str, part_len: usize) -> impl Iterator<Item = &str> {
    let whole = text.len() < 2 * part_len || text.starts_with('%') || text.contains("\n%");
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let cut = if whole {
            None
        } else {
            next_marker(rest, part_len).filter(|&at| rest.len() - at >= part_len)
        };
        let (part, after) = rest.split_at(cut.unwrap_or(rest.len()));
        rest = after;
        Some(part)
    })
}

/// Where the first document marker line at or after `from` begins.
fn next_marker(text: &str, from: usize) -> Option<usize> {
    let bytes = text.as_bytes();
    let mut at = from;
    while let Some(found) = text.get(at..)?.find("\n---") {
        let line = at + found + 1;
        match bytes.get(line + 3) {
            None | Some(b'\n' | b'\r' | b' ' | b'\t') => return Some(line),
            Some(_) => at = line,
        }
    }
    None
}

/// The objects of `text`, whole documents of `file` numbered from 1, and how many documents it
/// has; None when any document is not as [`Decoded`] expects it or is invalid.
fn decode_part(file: &str, text: &str) -> Option<(usize, Vec<Object>)> {
    let mut objects = Vec::new();
    let mut documents = 0;
    for (i, document) in yaml_serde::Deserializer::from_str(text).enumerate() {
        documents = i + 1;
        let at = Location {
            file: file.to_owned(),
            document: i + 1,
        };
        let typed = match Decoded::deserialize(document).ok()? {
            Decoded::Service(svc) => Typed::Service(svc),
            Decoded::Slice(slice) => Typed::Slice(slice),
            Decoded::Empty => continue,
            Decoded::Ignored { api_version, kind } => {
                debug!(%at, api_version, kind, "ignored: not a Service or EndpointSlice");
                continue;
            }
        };
        objects.push(typed_object(at, &typed).ok()?);
    }
    Some((documents, objects))
}

/// A document decoded in one pass: apiVersion and kind, the first two keys as tools write
/// them, choose the type the rest of the mapping decodes into. Anything else (other keys
/// first, not a mapping) is an error here, and left to the exact pass.
enum Decoded {
    Service(Box<Service>),
    Slice(Box<EndpointSlice>),
    Empty,
    /// Of a kind that is not ours.
    Ignored {
        api_version: String,
        kind: String,
    },
}

impl<'de> serde::Deserialize<'de> for Decoded {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(DecodedVisitor)
    }
}

struct DecodedVisitor;

impl<'de> serde::de::Visitor<'de> for DecodedVisitor {
    type Value = Decoded;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a mapping that starts with apiVersion and kind")
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Decoded, E> {
        Ok(Decoded::Empty)
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Decoded, A::Error> {
        let mut api_version = None;
        let mut kind = None;
        for _ in 0..2 {
            let key: Option<String> = map.next_key()?;
            let slot = match key.as_deref() {
                Some("apiVersion") => &mut api_version,
                Some("kind") => &mut kind,
                _ => return Err(serde::de::Error::custom("not apiVersion and kind first")),
            };
            if slot.replace(map.next_value::<String>()?).is_some() {
                return Err(serde::de::Error::custom("given twice"));
            }
        }
        let (Some(api_version), Some(kind)) = (api_version, kind) else {
            unreachable!("two keys read, each once");
        };
        // The rest of the mapping: the typed objects take apiVersion and kind as optional.
        let rest = serde::de::value::MapAccessDeserializer::new(map);
        match (api_version.as_str(), kind.as_str()) {
            ("v1", "Service") => Service::deserialize(rest).map(|s| Decoded::Service(Box::new(s))),
            ("discovery.k8s.io/v1", "EndpointSlice") => {
                EndpointSlice::deserialize(rest).map(|s| Decoded::Slice(Box::new(s)))
            }
            _ => {
                serde::de::IgnoredAny::deserialize(rest)?;
                Ok(Decoded::Ignored { api_version, kind })
            }
        }
    }
}

/// Every Service and EndpointSlice document of one file, validated, by way of a
/// [`yaml_serde::Value`] per document: the slow pass, whose errors name the document and the
/// failing field.
fn parse_exact(file: &str, text: &str) -> Result<Vec<Object>, ManifestError> {
    let mut objects = Vec::new();
    for (i, document) in yaml_serde::Deserializer::from_str(text).enumerate() {
        let at = Location {
            file: file.to_owned(),
            document: i + 1,
        };
        let value =
            yaml_serde::Value::deserialize(document).map_err(|source| ManifestError::Yaml {
                at: at.clone(),
                source,
            })?;
        objects.extend(parse_document(at, value)?);
    }
    Ok(objects)
}

/// A Service or an EndpointSlice as decoded.
enum Typed {
    Service(Box<Service>),
    Slice(Box<EndpointSlice>),
}

fn parse_document(at: Location, value: yaml_serde::Value) -> Result<Option<Object>, ManifestError> {
    if value.is_null() {
        return Ok(None);
    }
    let api_version = value.get("apiVersion").and_then(|v| v.as_str());
    let kind = value.get("kind").and_then(|v| v.as_str());
    let (Some(api_version), Some(kind)) = (api_version, kind) else {
        return Err(ManifestError::MissingKind {
            field: if api_version.is_none() {
                "apiVersion: missing"
            } else {
                "kind: missing"
            },
            at,
        });
    };
    let typed = match (api_version, kind) {
        ("v1", "Service") => Typed::Service(decode(&at, value)?),
        ("discovery.k8s.io/v1", "EndpointSlice") => Typed::Slice(decode(&at, value)?),
        (api_version, kind) => {
            debug!(%at, api_version, kind, "ignored: not a Service or EndpointSlice");
            return Ok(None);
        }
    };
    typed_object(at, &typed).map(Some)
}

/// The object of document `at`, validated.
fn typed_object(at: Location, typed: &Typed) -> Result<Object, ManifestError> {
    let invalid = |source| ManifestError::Invalid {
        at: at.clone(),
        source,
    };
    let mut skipped = Vec::new();
    let (kind, name, spec) = match typed {
        Typed::Service(svc) => {
            let spec = convert::service(svc, &mut skipped).map_err(invalid)?;
            (SERVICE, object_key(&svc.metadata), spec.map(Spec::Service))
        }
        Typed::Slice(slice) => {
            let spec = convert::endpoint_slice(slice, &mut skipped).map_err(invalid)?;
            (
                ENDPOINT_SLICE,
                object_key(&slice.metadata),
                spec.map(Spec::Slice),
            )
        }
    };
    // Parsed once per file change (the cache), so each is logged once.
    for field in &skipped {
        warn!(at = %at, object = %format!("{kind} {name}"), field = %field.field, error = %field.reason, "invalid field skipped; the rest is served");
    }
    let service = spec.as_ref().map(|spec| match spec {
        Spec::Service(s) => s.name.clone(),
        Spec::Slice(s) => s.service.clone(),
    });
    Ok(Object {
        key: ObjectKey {
            at,
            kind,
            name,
            service,
        },
        spec,
    })
}

fn object_key(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or("default"),
        meta.name.as_deref().unwrap_or_default()
    )
}

/// Decodes with the path of the failing field in the error (`spec.ports[0].port`).
fn decode<T: DeserializeOwned>(
    at: &Location,
    value: yaml_serde::Value,
) -> Result<T, ManifestError> {
    serde_path_to_error::deserialize(value).map_err(|err| ManifestError::Decode {
        at: at.clone(),
        path: err.path().to_string(),
        source: err.into_inner(),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    const SERVICES: &str = "\
apiVersion: v1
kind: ConfigMap
metadata: {name: ignored}
---
apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  type: NodePort
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80, targetPort: http, nodePort: 30080}]
---
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
ports: [{name: http, port: 8080}]
endpoints: [{addresses: [10.244.1.2]}]
";

    /// What a directory of `files` holds: its services, and its slices in order.
    fn load(files: &[(&str, &str)]) -> Result<(Vec<ServiceSpec>, Vec<SliceSpec>), ManifestError> {
        let dir = TempDir::new(&format!("load-{}", COUNTER.fetch_add(1, Ordering::Relaxed)));
        for (file, text) in files {
            std::fs::write(dir.0.join(file), text).unwrap();
        }
        let mut cache = ManifestCache::default();
        cache.load(&dir.0)?;
        let specs = cache.specs();
        Ok((
            specs.services.values().cloned().collect(),
            specs
                .slices
                .values()
                .flat_map(|s| s.values().cloned())
                .collect(),
        ))
    }

    static COUNTER: AtomicUsize = AtomicUsize::new(0);

    #[test]
    fn several_documents_and_kinds() {
        let (services, slices) = load(&[("services.yaml", SERVICES)]).unwrap();
        assert_eq!(services.len(), 1);
        assert_eq!(slices.len(), 1);
        assert_eq!(services[0].ports[0].node_port, Some(30080));
    }

    #[test]
    fn decode_errors_name_file_document_and_field() {
        let bad = SERVICES.replace("port: 80,", "port: eighty,");
        let err = load(&[("services.yaml", &bad)]).unwrap_err().to_string();
        assert!(
            err.starts_with("services.yaml: document 2: spec.ports[0].port: invalid type"),
            "{err}"
        );
    }

    #[test]
    fn validation_and_syntax_errors_name_file_and_document() {
        let bad = SERVICES.replace("10.96.0.10", "10.96.0.999");
        let err = load(&[("a.yaml", &bad)]).unwrap_err().to_string();
        assert!(
            err.starts_with("a.yaml: document 2: spec.clusterIP: "),
            "{err}"
        );

        let err = load(&[("b.yml", "apiVersion: v1\nkind: [\n")])
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("b.yml: document 1: "), "{err}");

        let err = load(&[("c.yaml", "metadata: {name: x}\n")])
            .unwrap_err()
            .to_string();
        assert_eq!(err, "c.yaml: document 1: apiVersion: missing");
    }

    #[test]
    fn duplicates_are_rejected() {
        let err = load(&[("a.yaml", SERVICES), ("b.yaml", SERVICES)])
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "b.yaml: document 2: duplicate Service default/web (first at a.yaml: document 2)"
        );
    }

    struct TempDir(PathBuf);

    impl TempDir {
        fn new(test: &str) -> TempDir {
            let dir = std::env::temp_dir().join(format!("lb-{test}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }

        /// As tools write: a whole file renamed into place.
        fn replace(&self, file: &str, text: &str) {
            let tmp = self.0.join(format!(".{file}.tmp"));
            std::fs::write(&tmp, text).unwrap();
            std::fs::rename(tmp, self.0.join(file)).unwrap();
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn service_yaml(name: &str, ip: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}}}\nspec:\n  clusterIP: {ip}\n  \
             ports: [{{port: 80}}]\n"
        )
    }

    fn names(cache: &ManifestCache) -> Vec<(String, std::net::Ipv4Addr)> {
        cache
            .specs()
            .services
            .values()
            .map(|s| {
                (
                    s.name.name.to_string(),
                    s.cluster_ip.expect("an IPv4 ClusterIP"),
                )
            })
            .collect()
    }

    fn service_name(name: &str) -> ServiceName {
        ServiceName {
            namespace: "default".into(),
            name: name.into(),
        }
    }

    #[test]
    fn cache_parses_only_changed_files() {
        let dir = TempDir::new("cache-changed");
        dir.replace("a.yaml", &service_yaml("a", "10.96.0.1"));
        dir.replace("b.yaml", &service_yaml("b", "10.96.0.2"));
        let mut cache = ManifestCache::default();
        let changed = cache.load(&dir.0).unwrap();
        assert_eq!(changed, [service_name("a"), service_name("b")].into());
        assert_eq!(cache.parses(), 2);

        let changed = cache.load(&dir.0).unwrap();
        assert!(changed.is_empty());
        assert_eq!(names(&cache).len(), 2);
        assert_eq!(cache.parses(), 2, "nothing changed, nothing parsed");

        dir.replace("b.yaml", &service_yaml("b", "10.96.0.22"));
        let changed = cache.load(&dir.0).unwrap();
        assert_eq!(changed, [service_name("b")].into());
        assert_eq!(cache.parses(), 3, "b only");
        assert_eq!(
            names(&cache),
            [
                ("a".to_string(), "10.96.0.1".parse().unwrap()),
                ("b".to_string(), "10.96.0.22".parse().unwrap())
            ]
        );
    }

    /// Timestamps are coarse: a file rewritten in place to the same length right after a load
    /// may keep its mtime, and is still seen to change.
    #[test]
    fn cache_sees_an_in_place_rewrite_of_the_same_length() {
        let dir = TempDir::new("cache-in-place");
        let path = dir.0.join("a.yaml");
        std::fs::write(&path, service_yaml("a", "10.96.0.1")).unwrap();
        let mut cache = ManifestCache::default();
        cache.load(&dir.0).unwrap();
        std::fs::write(&path, service_yaml("a", "10.96.0.2")).unwrap();
        assert_eq!(cache.load(&dir.0).unwrap(), [service_name("a")].into());
        assert_eq!(
            names(&cache),
            [("a".to_string(), "10.96.0.2".parse().unwrap())]
        );
    }

    /// A removed file's services go; a Service that moves to another file stays.
    #[test]
    fn cache_forgets_a_removed_file() {
        let dir = TempDir::new("cache-removed");
        dir.replace("a.yaml", &service_yaml("a", "10.96.0.1"));
        dir.replace("b.yaml", &service_yaml("b", "10.96.0.2"));
        let mut cache = ManifestCache::default();
        cache.load(&dir.0).unwrap();
        std::fs::remove_file(dir.0.join("a.yaml")).unwrap();
        assert_eq!(cache.load(&dir.0).unwrap(), [service_name("a")].into());
        assert_eq!(
            names(&cache),
            [("b".to_string(), "10.96.0.2".parse().unwrap())]
        );
        assert_eq!(cache.parses(), 2);

        dir.replace("c.yaml", &service_yaml("b", "10.96.0.2"));
        std::fs::remove_file(dir.0.join("b.yaml")).unwrap();
        cache.load(&dir.0).unwrap();
        assert_eq!(
            names(&cache),
            [("b".to_string(), "10.96.0.2".parse().unwrap())]
        );
    }

    /// A broken file fails the whole load, naming the file, and leaves the cache's specs as
    /// they were (the agent keeps the maps as they are); once it is fixed, the load succeeds.
    #[test]
    fn cache_keeps_the_last_good_state_while_a_file_is_broken() {
        let dir = TempDir::new("cache-broken");
        dir.replace("a.yaml", &service_yaml("a", "10.96.0.1"));
        dir.replace("b.yaml", &service_yaml("b", "10.96.0.2"));
        let mut cache = ManifestCache::default();
        cache.load(&dir.0).unwrap();
        let good = names(&cache);
        dir.replace("b.yaml", &service_yaml("b", "10.96.0.999"));
        let err = cache.load(&dir.0).unwrap_err().to_string();
        assert!(
            err.starts_with("b.yaml: document 1: spec.clusterIP: "),
            "{err}"
        );
        assert_eq!(names(&cache), good);
        let err = cache.load(&dir.0).unwrap_err().to_string();
        assert!(
            err.starts_with("b.yaml: document 1: "),
            "still broken: {err}"
        );
        dir.replace("b.yaml", &service_yaml("b", "10.96.0.3"));
        assert_eq!(cache.load(&dir.0).unwrap(), [service_name("b")].into());
        assert_eq!(
            names(&cache)[1],
            ("b".to_string(), "10.96.0.3".parse().unwrap())
        );
        assert_eq!(cache.parses(), 5, "a once, b four times");
    }

    /// A name given again by a changed file fails, whichever file comes first.
    #[test]
    fn cache_rejects_a_name_another_file_holds() {
        let dir = TempDir::new("cache-duplicate");
        dir.replace("b.yaml", &service_yaml("x", "10.96.0.1"));
        let mut cache = ManifestCache::default();
        cache.load(&dir.0).unwrap();
        dir.replace("a.yaml", &service_yaml("x", "10.96.0.2"));
        let err = cache.load(&dir.0).unwrap_err().to_string();
        assert_eq!(
            err,
            "b.yaml: document 1: duplicate Service default/x (first at a.yaml: document 1)"
        );
        assert_eq!(
            names(&cache),
            [("x".to_string(), "10.96.0.1".parse().unwrap())]
        );
    }

    /// A big file decoded in parts on several threads holds what the exact pass finds, each
    /// object at the same document; one invalid document anywhere gives the exact pass's error.
    #[test]
    fn a_big_file_in_parts_is_the_whole_file() {
        let mut text = String::from("# services\n");
        for i in 0..12_000 {
            text += "---\n";
            text += &service_yaml(
                &format!("s{i}"),
                &format!("10.96.{}.{}", i / 250, i % 250 + 1),
            );
            if i % 7 == 0 {
                text += "---\n--- # empty documents count\n";
            }
        }
        assert!(split_documents(&text, PART_MIN).count() > 2, "in parts");
        assert!(
            split_documents(&text, PART_MIN)
                .skip(1)
                .all(|p| p.starts_with("---\n"))
        );
        let keys = |objects: Vec<Object>| -> Vec<(Location, String)> {
            objects
                .into_iter()
                .map(|o| (o.key.at, o.key.name))
                .collect()
        };
        let exact = keys(parse_exact("big.yaml", &text).unwrap());
        let mut parsed = parse_files(&[("big.yaml", &text)]);
        assert_eq!(keys(parsed.remove(0).unwrap()), exact);
        assert_eq!(exact.len(), 12_000);
        assert_eq!(exact[11_999].0.document, 12_000 + 2 * 1715);

        let bad = text.replace("10.96.11.1\n", "10.96.11.999\n");
        let err = parse_files(&[("big.yaml", &bad)]).remove(0).unwrap_err();
        assert_eq!(
            err.to_string(),
            parse_exact("big.yaml", &bad).unwrap_err().to_string()
        );
    }

    #[test]
    fn directory_filters_manifest_files() {
        let (services, slices) = load(&[
            ("svc.yaml", SERVICES),
            ("notes.txt", "not yaml: ["),
            (".svc.yaml.swp", "not yaml: ["),
        ])
        .unwrap();
        assert_eq!((services.len(), slices.len()), (1, 1));
    }
}
