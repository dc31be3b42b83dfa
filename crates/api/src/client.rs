//! A small blocking-free HTTP client over the API, shared by the CLI (and,
//! later, the runner). It turns the error envelope into [`ClientError`].

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::orgs::{CreateOrgRequest, CreateOrgResponse, RunnerTokenResponse};
use crate::{ErrorBody, ErrorCode};

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("server unreachable at {url}: {message}")]
    Unreachable { url: String, message: String },
    #[error("{code} ({status}): {message} (request {request_id})")]
    Api {
        status: u16,
        code: ErrorCode,
        message: String,
        request_id: String,
    },
    #[error("unexpected response ({status}) from {url}: {body}")]
    Unexpected {
        url: String,
        status: u16,
        body: String,
    },
}

pub struct Client {
    base: String,
    token: String,
    http: reqwest::Client,
}

impl Client {
    pub fn new(base_url: &str, token: &str) -> Client {
        Client {
            base: base_url.trim_end_matches('/').to_owned(),
            token: token.to_owned(),
            http: reqwest::Client::new(),
        }
    }

    async fn post<B: Serialize, R: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<R, ClientError> {
        let url = format!("{}{path}", self.base);
        let response = self
            .http
            .post(&url)
            .bearer_auth(&self.token)
            .json(body)
            .send()
            .await
            .map_err(|e| ClientError::Unreachable {
                url: url.clone(),
                message: e.to_string(),
            })?;
        let status = response.status().as_u16();
        let bytes = response
            .bytes()
            .await
            .map_err(|e| ClientError::Unreachable {
                url: url.clone(),
                message: e.to_string(),
            })?;
        if (200..300).contains(&status) {
            return serde_json::from_slice(&bytes).map_err(|_| ClientError::Unexpected {
                url,
                status,
                body: String::from_utf8_lossy(&bytes).chars().take(200).collect(),
            });
        }
        match serde_json::from_slice::<ErrorBody>(&bytes) {
            Ok(body) => Err(ClientError::Api {
                status,
                code: body.error.code,
                message: body.error.message,
                request_id: body.error.request_id,
            }),
            Err(_) => Err(ClientError::Unexpected {
                url,
                status,
                body: String::from_utf8_lossy(&bytes).chars().take(200).collect(),
            }),
        }
    }

    pub async fn create_org(
        &self,
        request: &CreateOrgRequest,
    ) -> Result<CreateOrgResponse, ClientError> {
        self.post("/v1/admin/orgs", request).await
    }

    pub async fn create_runner_token(&self) -> Result<RunnerTokenResponse, ClientError> {
        self.post("/v1/admin/runner-tokens", &serde_json::json!({}))
            .await
    }
}
