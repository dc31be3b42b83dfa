//! envd's process (`process.Process`) and filesystem
//! (`filesystem.Filesystem`) messages in protobuf's JSON mapping, as the
//! SDK's Connect client encodes them: lowerCamel field names (the proto
//! names are taken too), `bytes` as base64, `int64` as a string (a number
//! is taken too), enums by name (a number is taken too), `oneof`s as one
//! present field. Unknown fields are ignored, as protobuf's JSON parsers
//! ignore them for a newer peer.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// `bytes` fields: standard base64 (URL-safe taken too, as the mapping
/// says).
pub mod base64_bytes {
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&base64::engine::general_purpose::STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(deserializer)?;
        decode(&text).map_err(serde::de::Error::custom)
    }

    pub fn decode(text: &str) -> Result<Vec<u8>, String> {
        use base64::engine::general_purpose::{STANDARD, URL_SAFE, URL_SAFE_NO_PAD};
        let trimmed = text.trim_end_matches('=');
        STANDARD
            .decode(text)
            .or_else(|_| URL_SAFE.decode(text))
            .or_else(|_| URL_SAFE_NO_PAD.decode(trimmed))
            .or_else(|_| base64::engine::general_purpose::STANDARD_NO_PAD.decode(trimmed))
            .map_err(|err| format!("not base64: {err}"))
    }
}

/// Optional `bytes` fields of a `oneof`.
mod opt_base64 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(
        bytes: &Option<Vec<u8>>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match bytes {
            Some(bytes) => super::base64_bytes::serialize(bytes, serializer),
            None => serializer.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<Vec<u8>>, D::Error> {
        let text = Option::<String>::deserialize(deserializer)?;
        text.map(|t| super::base64_bytes::decode(&t).map_err(serde::de::Error::custom))
            .transpose()
    }
}

/// `int64` written as a string, as the mapping says.
fn int64_as_string<S: Serializer>(value: &i64, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&value.to_string())
}

/// A `uint32` given as a number or a string.
fn lenient_u32<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        Number(u32),
        Text(String),
    }
    match Either::deserialize(deserializer)? {
        Either::Number(n) => Ok(n),
        Either::Text(text) => text.parse().map_err(serde::de::Error::custom),
    }
}

fn lenient_opt_u32<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u32>, D::Error> {
    lenient_u32(deserializer).map(Some)
}

// ---- process.Process ----

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySize {
    #[serde(default, deserialize_with = "lenient_u32")]
    pub cols: u32,
    #[serde(default, deserialize_with = "lenient_u32")]
    pub rows: u32,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pty {
    #[serde(default)]
    pub size: Option<PtySize>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessConfig {
    #[serde(default)]
    pub cmd: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub envs: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

/// `process.StartRequest`
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartRequest {
    #[serde(default)]
    pub process: Option<ProcessConfig>,
    #[serde(default)]
    pub pty: Option<Pty>,
    #[serde(default)]
    pub tag: Option<String>,
    #[serde(default)]
    pub stdin: Option<bool>,
}

/// `process.ProcessSelector`: a `oneof` of a pid or a tag.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessSelector {
    #[serde(
        default,
        deserialize_with = "lenient_opt_u32",
        skip_serializing_if = "Option::is_none"
    )]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

/// `process.ConnectRequest`, `process.CloseStdinRequest`
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelectRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
}

/// `process.UpdateRequest`: a terminal's new size.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
    #[serde(default)]
    pub pty: Option<Pty>,
}

/// `process.ProcessInput`: a `oneof` of stdin or terminal bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessInput {
    #[serde(default, with = "opt_base64", skip_serializing_if = "Option::is_none")]
    pub stdin: Option<Vec<u8>>,
    #[serde(default, with = "opt_base64", skip_serializing_if = "Option::is_none")]
    pub pty: Option<Vec<u8>>,
}

impl ProcessInput {
    /// The bytes, whichever of the two carries them.
    pub fn bytes(&self) -> &[u8] {
        self.stdin
            .as_deref()
            .or(self.pty.as_deref())
            .unwrap_or_default()
    }
}

/// `process.SendInputRequest`
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendInputRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
    #[serde(default)]
    pub input: Option<ProcessInput>,
}

/// `process.StreamInputRequest`: a `oneof` of start, data, keepalive.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamInputRequest {
    #[serde(default)]
    pub start: Option<SelectRequest>,
    #[serde(default)]
    pub data: Option<StreamInputData>,
    #[serde(default)]
    pub keepalive: Option<serde_json::Value>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamInputData {
    #[serde(default)]
    pub input: Option<ProcessInput>,
}

/// `process.Signal`: by name or number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    Unspecified,
    Term,
    Kill,
    /// A number envd's enum does not have.
    Other(i64),
}

impl<'de> Deserialize<'de> for Signal {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Signal, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        Ok(match value {
            serde_json::Value::String(name) => match name.as_str() {
                "SIGNAL_SIGTERM" => Signal::Term,
                "SIGNAL_SIGKILL" => Signal::Kill,
                "SIGNAL_UNSPECIFIED" => Signal::Unspecified,
                other => {
                    return Err(serde::de::Error::custom(format!(
                        "unknown signal {other:?}"
                    )));
                }
            },
            serde_json::Value::Number(n) => match n.as_i64() {
                Some(15) => Signal::Term,
                Some(9) => Signal::Kill,
                Some(0) => Signal::Unspecified,
                Some(other) => Signal::Other(other),
                None => return Err(serde::de::Error::custom("a signal number")),
            },
            serde_json::Value::Null => Signal::Unspecified,
            _ => return Err(serde::de::Error::custom("a signal name or number")),
        })
    }
}

/// `process.SendSignalRequest`
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct SendSignalRequest {
    #[serde(default)]
    pub process: Option<ProcessSelector>,
    #[serde(default = "unspecified")]
    pub signal: Signal,
}

fn unspecified() -> Signal {
    Signal::Unspecified
}

/// `process.ProcessInfo`
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessInfo {
    pub config: ProcessConfig,
    pub pid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

/// `process.ListResponse`
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListResponse {
    pub processes: Vec<ProcessInfo>,
}

/// An empty message (`UpdateResponse`, `SendInputResponse`, …).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Empty {}

/// `process.ProcessEvent.EndEvent`. `exitCode` is the program's own only
/// when `exited`; otherwise it is -1 and `error` names roost's end state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndEvent {
    #[serde(rename = "exitCode")]
    pub exit_code: i32,
    pub exited: bool,
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `process.ProcessEvent.DataEvent`: a `oneof` of the three outputs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataEvent {
    #[serde(default, with = "opt_base64", skip_serializing_if = "Option::is_none")]
    pub stdout: Option<Vec<u8>>,
    #[serde(default, with = "opt_base64", skip_serializing_if = "Option::is_none")]
    pub stderr: Option<Vec<u8>>,
    #[serde(default, with = "opt_base64", skip_serializing_if = "Option::is_none")]
    pub pty: Option<Vec<u8>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartEvent {
    pub pid: u32,
}

/// `process.ProcessEvent`: a `oneof`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcessEvent {
    Start(StartEvent),
    Data(DataEvent),
    End(EndEvent),
    Keepalive(Empty),
}

/// `process.StartResponse` and `process.ConnectResponse`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventResponse {
    pub event: ProcessEvent,
}

// ---- filesystem.Filesystem ----

/// `filesystem.StatRequest`, `MakeDirRequest`, `RemoveRequest`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathRequest {
    #[serde(default)]
    pub path: String,
}

/// `filesystem.ListDirRequest`
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListDirRequest {
    #[serde(default)]
    pub path: String,
    #[serde(default, deserialize_with = "lenient_u32")]
    pub depth: u32,
}

/// `filesystem.MoveRequest`
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoveRequest {
    #[serde(default)]
    pub source: String,
    #[serde(default)]
    pub destination: String,
}

/// `filesystem.FileType`, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FileType {
    #[serde(rename = "FILE_TYPE_UNSPECIFIED")]
    Unspecified,
    #[serde(rename = "FILE_TYPE_FILE")]
    File,
    #[serde(rename = "FILE_TYPE_DIRECTORY")]
    Directory,
    #[serde(rename = "FILE_TYPE_SYMLINK")]
    Symlink,
}

/// `filesystem.EntryInfo`
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EntryInfo {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: FileType,
    pub path: String,
    #[serde(serialize_with = "int64_as_string")]
    pub size: i64,
    pub mode: u32,
    pub permissions: String,
    pub owner: String,
    pub group: String,
    /// RFC 3339, as `google.protobuf.Timestamp` maps.
    #[serde(rename = "modifiedTime", skip_serializing_if = "Option::is_none")]
    pub modified_time: Option<String>,
    #[serde(rename = "symlinkTarget", skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    #[serde(rename = "isSymlink")]
    pub is_symlink: bool,
}

/// `StatResponse`, `MakeDirResponse`, `MoveResponse`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EntryResponse {
    pub entry: EntryInfo,
}

/// `filesystem.ListDirResponse`
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ListDirResponse {
    pub entries: Vec<EntryInfo>,
}

/// `rwxr-xr-x` for permission bits, as envd shows them (`ls -l` without
/// the type letter).
pub fn permissions(mode: u32) -> String {
    let mut text = String::with_capacity(9);
    for shift in [6u32, 3, 0] {
        let bits = (mode >> shift) & 0o7;
        text.push(if bits & 4 != 0 { 'r' } else { '-' });
        text.push(if bits & 2 != 0 { 'w' } else { '-' });
        text.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_as_the_sdk_encodes_them() {
        let start: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"},"cwd":"/tmp"},"stdin":false,"unknownField":1}"#,
        )
        .expect("in a test");
        let process = start.process.expect("in a test");
        assert_eq!(process.args, ["-l", "-c", "echo hi"]);
        assert_eq!(process.cwd.as_deref(), Some("/tmp"));
        assert_eq!(start.stdin, Some(false));
        let input: SendInputRequest =
            serde_json::from_str(r#"{"process":{"pid":"42"},"input":{"stdin":"aGk="}}"#)
                .expect("in a test");
        assert_eq!(input.process.expect("in a test").pid, Some(42));
        assert_eq!(input.input.expect("in a test").bytes(), b"hi");
        let signal: SendSignalRequest =
            serde_json::from_str(r#"{"process":{"pid":7},"signal":"SIGNAL_SIGKILL"}"#)
                .expect("in a test");
        assert_eq!(signal.signal, Signal::Kill);
        let signal: SendSignalRequest =
            serde_json::from_str(r#"{"process":{"pid":7},"signal":15}"#).expect("in a test");
        assert_eq!(signal.signal, Signal::Term);
        let update: UpdateRequest =
            serde_json::from_str(r#"{"process":{"pid":7},"pty":{"size":{"cols":80,"rows":24}}}"#)
                .expect("in a test");
        assert_eq!(
            update.pty.expect("in a test").size.expect("in a test"),
            PtySize { cols: 80, rows: 24 }
        );
        let list: ListDirRequest = serde_json::from_str(r#"{"path":"/tmp"}"#).expect("in a test");
        assert_eq!(list.depth, 0);
    }

    #[test]
    fn events_are_oneofs_with_base64_bytes() {
        let data = EventResponse {
            event: ProcessEvent::Data(DataEvent {
                stdout: Some(b"hi\n".to_vec()),
                ..DataEvent::default()
            }),
        };
        assert_eq!(
            serde_json::to_value(&data).expect("in a test"),
            serde_json::json!({"event": {"data": {"stdout": "aGkK"}}})
        );
        let end = EventResponse {
            event: ProcessEvent::End(EndEvent {
                exit_code: -1,
                exited: false,
                status: "infrastructure_lost".into(),
                error: Some("host lost".into()),
            }),
        };
        assert_eq!(
            serde_json::to_value(&end).expect("in a test"),
            serde_json::json!({"event": {"end": {"exitCode": -1, "exited": false, "status": "infrastructure_lost", "error": "host lost"}}})
        );
        let start = EventResponse {
            event: ProcessEvent::Start(StartEvent { pid: 12 }),
        };
        assert_eq!(
            serde_json::to_value(&start).expect("in a test"),
            serde_json::json!({"event": {"start": {"pid": 12}}})
        );
    }

    #[test]
    fn entries_use_the_json_mapping() {
        let entry = EntryInfo {
            name: "a".into(),
            kind: FileType::File,
            path: "/a".into(),
            size: 5,
            mode: 0o644,
            permissions: permissions(0o644),
            owner: String::new(),
            group: String::new(),
            modified_time: Some("2024-01-01T00:00:00Z".into()),
            symlink_target: None,
            is_symlink: false,
        };
        let value = serde_json::to_value(&entry).expect("in a test");
        assert_eq!(value["type"], "FILE_TYPE_FILE");
        assert_eq!(value["size"], "5");
        assert_eq!(value["permissions"], "rw-r--r--");
        assert_eq!(value["modifiedTime"], "2024-01-01T00:00:00Z");
    }
}
