//! The gateway's live configuration: [`ServeConfig`], built once from validated
//! [`ServeSettings`] when the gateway is constructed (each lane's tokenizer loaded, its
//! `x-headroom-lane` value built). Settings stay plain data; everything here is read-only after
//! [`ServeConfig::build`].

use std::ops::Deref;

use crate::config::{LaneSettings, ServeSettings};
use crate::start_error::ServeError;
use crate::tokens::TokenCounter;

/// One lane ready to serve: its settings (read through `Deref`) and what is built from them.
#[derive(Debug, Clone)]
pub struct LaneConfig {
    pub settings: LaneSettings,
    /// The loaded `tokenizer_path` (`None`: input tokens are estimated).
    pub tokenizer: Option<TokenCounter>,
    /// The lane's name as the `x-headroom-lane` response value.
    pub lane_header: axum::http::HeaderValue,
}

impl LaneConfig {
    /// Loads the lane's tokenizer and builds its header value.
    pub fn build(settings: LaneSettings) -> Result<LaneConfig, ServeError> {
        let tokenizer = match &settings.tokenizer_path {
            Some(path) => Some(TokenCounter::load(path).map_err(ServeError::Tokenizer)?),
            None => None,
        };
        let lane_header = axum::http::HeaderValue::from_str(&settings.spec.name)
            .unwrap_or(axum::http::HeaderValue::from_static("?"));
        Ok(LaneConfig {
            settings,
            tokenizer,
            lane_header,
        })
    }
}

impl Deref for LaneConfig {
    type Target = LaneSettings;

    fn deref(&self) -> &LaneSettings {
        &self.settings
    }
}

/// The whole gateway configuration, live: the settings it was built from (read through `Deref`)
/// and one [`LaneConfig`] per lane, in the settings' order.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    settings: ServeSettings,
    /// The live lanes (`settings.lanes[i]` is `lanes[i].settings`).
    pub lanes: Vec<LaneConfig>,
}

impl ServeConfig {
    /// Builds the live configuration: the one place tokenizers are loaded.
    pub fn build(settings: ServeSettings) -> Result<ServeConfig, ServeError> {
        let lanes = settings
            .lanes
            .iter()
            .cloned()
            .map(LaneConfig::build)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ServeConfig { settings, lanes })
    }

    /// The settings this configuration was built from.
    pub fn settings(&self) -> &ServeSettings {
        &self.settings
    }
}

impl Deref for ServeConfig {
    type Target = ServeSettings;

    fn deref(&self) -> &ServeSettings {
        &self.settings
    }
}
