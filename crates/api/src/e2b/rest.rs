//! E2B's control-plane REST bodies (`/sandboxes`, `/v2/sandboxes`), as the
//! `e2b` SDK 2.x sends and parses them (its generated `api.client.models`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The envd version roost's data plane answers as: recent enough that the
/// SDK uses every API it has (stdin, close stdin, octet-stream uploads,
/// no default user).
pub const ENVD_VERSION: &str = "0.6.4";

/// `POST /sandboxes` and `POST /v2/sandboxes` (`NewSandbox`, `NewSandboxV2`).
/// Unknown fields are kept aside (`rest`) so that one roost cannot honour
/// is refused by name, never silently dropped.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// Seconds the sandbox lives from now (E2B's default: 300).
    #[serde(default)]
    pub timeout: Option<u64>,
    #[serde(default, rename = "autoPause")]
    pub auto_pause: Option<bool>,
    #[serde(default, rename = "autoPauseMemory")]
    pub auto_pause_memory: Option<bool>,
    #[serde(default, rename = "autoResume")]
    pub auto_resume: Option<serde_json::Value>,
    #[serde(default)]
    pub allow_internet_access: Option<bool>,
    #[serde(default)]
    pub network: Option<serde_json::Value>,
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
    #[serde(default, rename = "envVars")]
    pub env_vars: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub mcp: Option<serde_json::Value>,
    #[serde(default)]
    pub iam: Option<serde_json::Value>,
    #[serde(default, rename = "volumeMounts")]
    pub volume_mounts: Option<Vec<serde_json::Value>>,
    #[serde(default)]
    pub secure: Option<bool>,
    /// Anything else the request carried.
    #[serde(flatten)]
    pub rest: BTreeMap<String, serde_json::Value>,
}

/// A created or connected sandbox (`Sandbox` in E2B's API).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CreatedSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    #[serde(rename = "envdVersion")]
    pub envd_version: String,
    /// The token the SDK sends to the data plane as `X-Access-Token`.
    #[serde(rename = "envdAccessToken")]
    pub envd_access_token: String,
    #[serde(rename = "trafficAccessToken")]
    pub traffic_access_token: Option<String>,
    pub domain: Option<String>,
}

/// E2B's two sandbox states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Running,
    Paused,
}

impl State {
    pub fn parse(text: &str) -> Option<State> {
        match text {
            "running" => Some(State::Running),
            "paused" => Some(State::Paused),
            _ => None,
        }
    }
}

/// `GET /sandboxes/{id}` (`SandboxDetail`) and an entry of a list
/// (`ListedSandbox`, the same without the access token).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SandboxDetail {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    #[serde(rename = "startedAt")]
    pub started_at: String,
    #[serde(rename = "endAt")]
    pub end_at: String,
    #[serde(rename = "envdVersion")]
    pub envd_version: String,
    #[serde(rename = "cpuCount")]
    pub cpu_count: u64,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    pub state: State,
    pub metadata: BTreeMap<String, String>,
    #[serde(
        rename = "envdAccessToken",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub envd_access_token: Option<String>,
    pub domain: Option<String>,
}

/// `POST /v2/sandboxes/{id}/connect` and `POST /sandboxes/{id}/resume`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ConnectSandbox {
    #[serde(default)]
    pub timeout: Option<u64>,
    /// Restore memory (roost keeps none: a resume is a fresh start).
    #[serde(default)]
    pub memory: Option<bool>,
    #[serde(flatten)]
    pub rest: BTreeMap<String, serde_json::Value>,
}

/// `POST /sandboxes/{id}/timeout`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SetTimeout {
    pub timeout: u64,
}

/// `POST /sandboxes/{id}/pause`
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Pause {
    #[serde(default)]
    pub memory: Option<bool>,
    #[serde(default, rename = "requireHealthyGuest")]
    pub require_healthy_guest: Option<bool>,
}

/// E2B's error body: the HTTP status again, and a message (the SDK shows
/// `"{code}: {message}"`). The `error_code` is roost's stable code.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Error {
    pub code: u16,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
}

/// A write made through the envd `/files` endpoint (`WriteInfo`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WriteInfo {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub path: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_sandbox_keeps_what_it_does_not_know_aside() {
        let body: NewSandbox = serde_json::from_str(
            r#"{"templateID":"base","timeout":60,"autoPause":false,"metadata":{"a":"b"},
                "envVars":{"X":"1"},"somethingNew":true}"#,
        )
        .expect("in a test");
        assert_eq!(body.template_id, "base");
        assert_eq!(body.timeout, Some(60));
        assert_eq!(body.auto_pause, Some(false));
        assert_eq!(body.env_vars.expect("in a test")["X"], "1");
        assert_eq!(
            body.rest.keys().collect::<Vec<_>>(),
            vec![&"somethingNew".to_owned()]
        );
    }

    #[test]
    fn a_created_sandbox_has_the_sdks_field_names() {
        let created = CreatedSandbox {
            template_id: "base".into(),
            sandbox_id: "sbx_1".into(),
            client_id: "roost".into(),
            envd_version: ENVD_VERSION.into(),
            envd_access_token: "t".into(),
            traffic_access_token: None,
            domain: None,
        };
        let value = serde_json::to_value(&created).expect("in a test");
        for field in [
            "templateID",
            "sandboxID",
            "clientID",
            "envdVersion",
            "envdAccessToken",
        ] {
            assert!(value.get(field).is_some(), "{field}");
        }
        assert_eq!(State::parse("paused"), Some(State::Paused));
        assert_eq!(
            serde_json::to_value(State::Running).expect("in a test"),
            "running"
        );
    }
}
