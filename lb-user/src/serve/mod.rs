//! The HTTP servers beside the loop: health, metrics, and the services' health check ports.
pub mod health;
pub mod metrics;
pub mod service_health;
