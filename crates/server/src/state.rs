//! The surface's state: the request path's [`Core`] and what only the surface reads (the status
//! page's ring, the load balancer's signals, the pools' names, the upstreams' last health).

use std::sync::Arc;

use headroom_gate::Gate;

use crate::core_state::Core;
use crate::live_config::ServeConfig;
use crate::telemetry::Telemetry;

/// Shared state of one gateway.
pub(crate) struct AppState {
    /// What the request path reads.
    pub(crate) core: Arc<Core>,
    /// The status page's ring of samples (`/ui`).
    pub(crate) ui: Arc<crate::ui::UiState>,
    /// The last load figure and readiness for a load balancer (agent check, ORCA header).
    pub(crate) balancer: crate::balancer::Signals,
    /// What each memory pool is called (host RAM, GPU N with its name).
    pub(crate) pool_names: Arc<crate::pools::PoolNames>,
    /// Each upstream's last `GET /health` answer, refreshed in the background for `/readyz`.
    pub(crate) health: crate::health::HealthCache,
}

impl AppState {
    pub(crate) fn new(
        config: ServeConfig,
        gate: Gate,
        client: reqwest::Client,
        telemetry: Arc<Telemetry>,
    ) -> AppState {
        let health = crate::health::HealthCache::new(crate::health::upstream_list_of(&config));
        let pool_names = Arc::new(crate::pools::PoolNames::new(config.memory.probe));
        AppState {
            core: Arc::new(Core::new(config, gate, client, telemetry)),
            ui: Arc::new(crate::ui::UiState::default()),
            balancer: crate::balancer::Signals::default(),
            pool_names,
            health,
        }
    }
}

/// The surface's handle on its state.
pub(crate) type Shared = Arc<AppState>;
