//! The manifest directory as a source: every `*.yaml`/`*.yml` file, several documents per file,
//! v1 Services and discovery.k8s.io/v1 EndpointSlices. The directory is read as a whole: one bad
//! document fails the whole read, so the caller keeps its last good state.
use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use serde::Deserialize as _;
use serde::de::DeserializeOwned;
use tracing::debug;

use crate::k8s::{self, InvalidField};
use crate::model::{ServiceSpec, SliceSpec};

/// Where in the directory: a file name and a 1-based document index.
#[derive(Clone, Debug, PartialEq, Eq)]
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
        source: serde_yaml::Error,
    },
    #[error("{at}: {field}")]
    MissingKind { at: Location, field: &'static str },
    #[error("{at}: {path}: {source}")]
    Decode {
        at: Location,
        path: String,
        source: serde_yaml::Error,
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

/// What the directory holds, in file and document order.
#[derive(Debug, Default)]
pub struct Manifests {
    pub services: Vec<ServiceSpec>,
    pub slices: Vec<SliceSpec>,
}

/// Reads and validates every manifest file in `dir`.
pub fn load_dir(dir: &Path) -> Result<Manifests, ManifestError> {
    let read_dir_err = |source| ManifestError::ReadDir {
        dir: dir.to_owned(),
        source,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(read_dir_err)? {
        let path = entry.map_err(read_dir_err)?.path();
        if is_manifest(&path) {
            files.push(path);
        }
    }
    files.sort();

    let mut loader = Loader::default();
    for path in files {
        let file = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            // Removed between listing and reading: the next event re-reads the directory.
            Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
            Err(source) => return Err(ManifestError::ReadFile { file, source }),
        };
        loader.add_file(&file, &text)?;
    }
    Ok(loader.manifests)
}

/// `*.yaml` and `*.yml`, but not hidden files (editors' and tools' temporaries).
fn is_manifest(path: &Path) -> bool {
    let hidden = path
        .file_name()
        .and_then(|n| n.to_str())
        .is_none_or(|n| n.starts_with('.'));
    let yaml = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e == "yaml" || e == "yml");
    path.is_file() && yaml && !hidden
}

#[derive(Default)]
struct Loader {
    manifests: Manifests,
    seen: BTreeMap<(&'static str, String), Location>,
}

impl Loader {
    fn add_file(&mut self, file: &str, text: &str) -> Result<(), ManifestError> {
        for (i, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
            let at = Location {
                file: file.to_owned(),
                document: i + 1,
            };
            let value =
                serde_yaml::Value::deserialize(document).map_err(|source| ManifestError::Yaml {
                    at: at.clone(),
                    source,
                })?;
            self.add_document(at, value)?;
        }
        Ok(())
    }

    fn add_document(
        &mut self,
        at: Location,
        value: serde_yaml::Value,
    ) -> Result<(), ManifestError> {
        if value.is_null() {
            return Ok(());
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
        match (api_version, kind) {
            ("v1", "Service") => {
                let svc: Service = decode(&at, value)?;
                let name = object_key(&svc.metadata);
                self.check_unique(&at, "Service", name)?;
                let spec = k8s::service(&svc).map_err(|source| ManifestError::Invalid {
                    at: at.clone(),
                    source,
                })?;
                self.manifests.services.extend(spec);
            }
            ("discovery.k8s.io/v1", "EndpointSlice") => {
                let slice: EndpointSlice = decode(&at, value)?;
                let name = object_key(&slice.metadata);
                self.check_unique(&at, "EndpointSlice", name)?;
                let spec =
                    k8s::endpoint_slice(&slice).map_err(|source| ManifestError::Invalid {
                        at: at.clone(),
                        source,
                    })?;
                self.manifests.slices.extend(spec);
            }
            (api_version, kind) => {
                debug!(%at, api_version, kind, "ignored: not a Service or EndpointSlice")
            }
        }
        Ok(())
    }

    fn check_unique(
        &mut self,
        at: &Location,
        kind: &'static str,
        name: String,
    ) -> Result<(), ManifestError> {
        if let Some(first) = self.seen.get(&(kind, name.clone())) {
            return Err(ManifestError::Duplicate {
                at: at.clone(),
                kind,
                name,
                first: first.clone(),
            });
        }
        self.seen.insert((kind, name), at.clone());
        Ok(())
    }
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
    value: serde_yaml::Value,
) -> Result<T, ManifestError> {
    serde_path_to_error::deserialize(value).map_err(|err| ManifestError::Decode {
        at: at.clone(),
        path: err.path().to_string(),
        source: err.into_inner(),
    })
}

#[cfg(test)]
mod tests {
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

    fn load(files: &[(&str, &str)]) -> Result<Manifests, ManifestError> {
        let mut loader = Loader::default();
        for (file, text) in files {
            loader.add_file(file, text)?;
        }
        Ok(loader.manifests)
    }

    #[test]
    fn several_documents_and_kinds() {
        let m = load(&[("services.yaml", SERVICES)]).unwrap();
        assert_eq!(m.services.len(), 1);
        assert_eq!(m.slices.len(), 1);
        assert_eq!(m.services[0].ports[0].node_port, Some(30080));
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

    #[test]
    fn directory_filters_manifest_files() {
        let dir = std::env::temp_dir().join(format!("lb-manifests-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("svc.yaml"), SERVICES).unwrap();
        std::fs::write(dir.join("notes.txt"), "not yaml: [").unwrap();
        std::fs::write(dir.join(".svc.yaml.swp"), "not yaml: [").unwrap();
        let loaded = load_dir(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        let m = loaded.unwrap();
        assert_eq!((m.services.len(), m.slices.len()), (1, 1));
    }
}
