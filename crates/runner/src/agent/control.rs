//! The control plane as the agent speaks to it: [`ControlPlane`], one
//! method per runner-protocol call the agent makes, so that the agent
//! holds `Arc<dyn ControlPlane>` and its tests can answer from a script
//! (`testing::FakeControl`) instead of a live server.
//!
//! [`RunnerLink`] is the real implementation: each method is the
//! client's method of the same name, called with the runner token until
//! the runner has its own credential (from its first registration, or
//! its data dir) and with that credential from then on. Answers the agent never reads (the records a
//! report returns) are dropped here, so a fake need not build them.
//!
//! Block transfers (homes and images through the store) are not
//! abstracted: [`ControlPlane::blocks`] hands out the block service's
//! client, `RemoteBackend`, which speaks HTTP to the server. A fake gives
//! one whose every transfer fails as unreachable.

use api::blocks::RemoteBackend;
use api::client::{Client, ClientError, OutputStream};
use api::runners::{
    Assignments, CommandReport, HeartbeatRequest, KeptCopyAnswer, KeptCopyReport, PreemptRequest,
    RegisterRequest, RegisterResponse, RunnerRecord, SandboxReport, SaveReport, SecretValues,
    SecretsRequest, SnapshotReport,
};
use oci::seam::BoxFuture;
use std::sync::RwLock;

/// A call's answer.
pub(crate) type Answer<'a, T> = BoxFuture<'a, Result<T, ClientError>>;

/// Every call the agent makes to the control plane.
pub(crate) trait ControlPlane: Send + Sync {
    fn runner_register<'a>(&'a self, request: &'a RegisterRequest) -> Answer<'a, RegisterResponse>;
    fn runner_heartbeat<'a>(&'a self, request: &'a HeartbeatRequest) -> Answer<'a, ()>;
    fn runner_preempt<'a>(&'a self, request: &'a PreemptRequest) -> Answer<'a, RunnerRecord>;
    /// Long-polls the assignments: answers when they differ from `etag`
    /// or after `wait_s`.
    fn runner_assignments<'a>(
        &'a self,
        runner_id: &'a str,
        etag: &'a str,
        wait_s: u64,
    ) -> Answer<'a, Assignments>;
    fn runner_report_sandbox<'a>(
        &'a self,
        sandbox_id: &'a str,
        report: &'a SandboxReport,
    ) -> Answer<'a, ()>;
    fn runner_report_command<'a>(
        &'a self,
        command_id: &'a str,
        report: &'a CommandReport,
    ) -> Answer<'a, ()>;
    /// Appends `data` at `offset` of a command's output; the server's new
    /// length.
    fn runner_append_output<'a>(
        &'a self,
        command_id: &'a str,
        stream: OutputStream,
        placement: (&'a str, u64),
        offset: u64,
        data: Vec<u8>,
    ) -> Answer<'a, u64>;
    fn runner_report_save<'a>(
        &'a self,
        sandbox_id: &'a str,
        report: &'a SaveReport,
    ) -> Answer<'a, ()>;
    fn runner_report_snapshot<'a>(
        &'a self,
        snapshot_id: &'a str,
        report: &'a SnapshotReport,
    ) -> Answer<'a, ()>;
    /// Reports a home kept aside; the answer says whether to keep it.
    fn runner_report_kept<'a>(&'a self, report: &'a KeptCopyReport) -> Answer<'a, KeptCopyAnswer>;
    /// The values of the secrets a sandbox asked for (its current
    /// placement's runner only).
    fn runner_secrets<'a>(
        &'a self,
        sandbox_id: &'a str,
        request: &'a SecretsRequest,
    ) -> Answer<'a, SecretValues>;
    /// The block service's client, for moving homes and images.
    fn blocks(&self) -> RemoteBackend;
    /// Calls from now on with this runner's own credential; `None`: with
    /// the runner token again (to register as a new runner).
    fn use_credential(&self, credential: Option<&str>);
    /// Whether calls go with the runner's own credential.
    fn has_credential(&self) -> bool;
}

/// The server, through `Client`: the runner token registers a new runner;
/// every other call goes with the runner's own credential.
pub(crate) struct RunnerLink {
    enrolment: Client,
    own: RwLock<Option<Client>>,
}

impl RunnerLink {
    pub(crate) fn new(server_url: &str, runner_token: &str) -> RunnerLink {
        RunnerLink {
            enrolment: Client::new(server_url, runner_token),
            own: RwLock::new(None),
        }
    }

    fn client(&self) -> Client {
        let own = match self.own.read() {
            Ok(own) => own.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        own.unwrap_or_else(|| self.enrolment.clone())
    }
}

impl ControlPlane for RunnerLink {
    fn runner_register<'a>(&'a self, request: &'a RegisterRequest) -> Answer<'a, RegisterResponse> {
        let client = self.client();
        Box::pin(async move { client.runner_register(request).await })
    }

    fn runner_heartbeat<'a>(&'a self, request: &'a HeartbeatRequest) -> Answer<'a, ()> {
        let client = self.client();
        Box::pin(async move { client.runner_heartbeat(request).await.map(drop) })
    }

    fn runner_preempt<'a>(&'a self, request: &'a PreemptRequest) -> Answer<'a, RunnerRecord> {
        let client = self.client();
        Box::pin(async move { client.runner_preempt(request).await })
    }

    fn runner_assignments<'a>(
        &'a self,
        runner_id: &'a str,
        etag: &'a str,
        wait_s: u64,
    ) -> Answer<'a, Assignments> {
        let client = self.client();
        Box::pin(async move { client.runner_assignments(runner_id, etag, wait_s).await })
    }

    fn runner_report_sandbox<'a>(
        &'a self,
        sandbox_id: &'a str,
        report: &'a SandboxReport,
    ) -> Answer<'a, ()> {
        let client = self.client();
        Box::pin(async move {
            client
                .runner_report_sandbox(sandbox_id, report)
                .await
                .map(drop)
        })
    }

    fn runner_report_command<'a>(
        &'a self,
        command_id: &'a str,
        report: &'a CommandReport,
    ) -> Answer<'a, ()> {
        let client = self.client();
        Box::pin(async move {
            client
                .runner_report_command(command_id, report)
                .await
                .map(drop)
        })
    }

    fn runner_append_output<'a>(
        &'a self,
        command_id: &'a str,
        stream: OutputStream,
        placement: (&'a str, u64),
        offset: u64,
        data: Vec<u8>,
    ) -> Answer<'a, u64> {
        let client = self.client();
        Box::pin(async move {
            client
                .runner_append_output(command_id, stream, placement, offset, data)
                .await
        })
    }

    fn runner_report_save<'a>(
        &'a self,
        sandbox_id: &'a str,
        report: &'a SaveReport,
    ) -> Answer<'a, ()> {
        let client = self.client();
        Box::pin(async move {
            client
                .runner_report_save(sandbox_id, report)
                .await
                .map(drop)
        })
    }

    fn runner_report_snapshot<'a>(
        &'a self,
        snapshot_id: &'a str,
        report: &'a SnapshotReport,
    ) -> Answer<'a, ()> {
        let client = self.client();
        Box::pin(async move {
            client
                .runner_report_snapshot(snapshot_id, report)
                .await
                .map(drop)
        })
    }

    fn runner_report_kept<'a>(&'a self, report: &'a KeptCopyReport) -> Answer<'a, KeptCopyAnswer> {
        let client = self.client();
        Box::pin(async move { client.runner_report_kept(report).await })
    }

    fn runner_secrets<'a>(
        &'a self,
        sandbox_id: &'a str,
        request: &'a SecretsRequest,
    ) -> Answer<'a, SecretValues> {
        let client = self.client();
        Box::pin(async move { client.runner_secrets(sandbox_id, request).await })
    }

    fn blocks(&self) -> RemoteBackend {
        RemoteBackend::new(self.client(), tokio::runtime::Handle::current())
    }

    fn use_credential(&self, credential: Option<&str>) {
        let client = credential.map(|token| self.enrolment.with_token(token));
        match self.own.write() {
            Ok(mut own) => *own = client,
            Err(poisoned) => *poisoned.into_inner() = client,
        }
    }

    fn has_credential(&self) -> bool {
        match self.own.read() {
            Ok(own) => own.is_some(),
            Err(poisoned) => poisoned.into_inner().is_some(),
        }
    }
}
