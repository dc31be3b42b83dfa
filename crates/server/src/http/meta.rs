//! `/v1/openapi.json`, `/v1/deployment`, `/metrics`, `/healthz`.

use axum::extract::State;
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};

use super::{AppState, Caller};
use crate::auth::Principal;
use crate::error::ControlError;

#[utoipa::path(get, path = "/v1/openapi.json", tag = "meta", responses((status = 200, description = "this document")))]
pub async fn openapi() -> Response {
    axum::Json(crate::openapi::document()).into_response()
}

/// The deployment's metrics, for the admin token or the metrics token
/// (`roost server --metrics-token-file`) alone.
#[utoipa::path(get, path = "/metrics", tag = "meta", responses((status = 200, description = "Prometheus text format", content_type = "text/plain"), (status = 401, description = "no token"), (status = 404, description = "a token that is neither the admin's nor the metrics token")))]
pub async fn metrics(
    State(state): State<AppState>,
    _caller: super::MetricsCaller,
) -> Result<Response, ControlError> {
    // Read from the records at most once a second, however often this is
    // asked (a scraper per server, say): each read scans the fleet.
    let fleet = state
        .metrics
        .fleet_gauges(|| async {
            let sandboxes = crate::records::sandboxes::count_by_state(&state.db.pool).await?;
            let now = crate::db::now_ms();
            let lags = crate::records::sandboxes::save_lags(&state.db.pool).await?;
            let lag = crate::metrics::SaveLag {
                max_seconds: lags
                    .iter()
                    .map(|(saved, _)| (now - saved).max(0) as f64 / 1000.0)
                    .fold(0.0, f64::max),
                delayed: lags
                    .iter()
                    .filter(|(saved, interval)| now - saved > 2 * interval * 1000)
                    .count() as i64,
            };
            let at_risk_ms = crate::records::observed::at_risk_ms_max(&state.db.pool, now).await?;
            Ok::<_, ControlError>(crate::metrics::FleetGauges {
                sandboxes,
                lag,
                at_risk_s: at_risk_ms as f64 / 1000.0,
            })
        })
        .await?;
    let mut text = state.metrics.render(
        &fleet.sandboxes,
        state.db.hub.waiters(),
        &fleet.lag,
        fleet.at_risk_s,
    );
    if let Some(reads) = &state.db.sqlite_reads {
        let (answered, declined) = reads.counts();
        text.push_str(&format!(
            "# HELP roost_sqlite_direct_reads_total Hot SQLite reads on the request's thread: answered, or declined to the connection pool (busy, or an error).\n\
             # TYPE roost_sqlite_direct_reads_total counter\n\
             roost_sqlite_direct_reads_total{{result=\"answered\"}} {answered}\n\
             roost_sqlite_direct_reads_total{{result=\"declined\"}} {declined}\n"
        ));
    }
    if let Some(reads) = &state.db.sandbox_reads {
        let (answered, queries) = reads.counts();
        text.push_str(&format!(
            "# HELP roost_postgres_gathered_reads_total Sandbox reads by id answered by a gathered query (the rest read alone).\n\
             # TYPE roost_postgres_gathered_reads_total counter\n\
             roost_postgres_gathered_reads_total {answered}\n\
             # HELP roost_postgres_gathered_queries_total Gathered queries sent (each answers every read waiting).\n\
             # TYPE roost_postgres_gathered_queries_total counter\n\
             roost_postgres_gathered_queries_total {queries}\n"
        ));
    }
    text.push_str(&format!(
        "# HELP roost_runner_view_reads_total Reads of every runner for placement (`scheduler::RunnerView`): in a placement's transaction, or ahead of it.\n\
         # TYPE roost_runner_view_reads_total counter\n\
         roost_runner_view_reads_total {}\n",
        state.db.runner_view.reads()
    ));
    let mut response = text.into_response();
    response.headers_mut().insert(
        axum::http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    Ok(response)
}

/// Liveness that includes the records: 200 only if the database answers.
#[utoipa::path(get, path = "/healthz", tag = "meta", responses((status = 200, description = "the server and its database answer")))]
pub async fn health(State(state): State<AppState>) -> Result<&'static str, ControlError> {
    state.db.ping().await?;
    Ok("ok\n")
}

/// Who the bearer token belongs to: clients learn their org id here.
#[utoipa::path(get, path = "/v1/whoami", tag = "meta", responses((status = 200, body = api::orgs::Whoami), (status = 401, description = "error envelope", body = api::ErrorBody)))]
pub async fn whoami(caller: Caller) -> axum::Json<api::orgs::Whoami> {
    let (kind, org_id, runner_id) = match caller.0 {
        Principal::Admin => ("admin", None, None),
        Principal::Org { org_id } => ("org", Some(org_id), None),
        Principal::RunnerEnrolment { .. } => ("runner", None, None),
        Principal::Runner { runner_id } => ("runner_credential", None, Some(runner_id)),
    };
    axum::Json(api::orgs::Whoami {
        kind: kind.to_owned(),
        org_id,
        runner_id,
    })
}

/// What the running deployment promises: its live configuration, the
/// bounds that follow (each with its formula), and what its records
/// observed. Any token.
#[utoipa::path(get, path = "/v1/deployment", tag = "meta", responses((status = 200, body = api::deployment::Deployment), (status = 401, description = "error envelope", body = api::ErrorBody)))]
pub async fn deployment(
    State(state): State<AppState>,
    _caller: Caller,
) -> Result<axum::Json<api::deployment::Deployment>, ControlError> {
    Ok(axum::Json(
        crate::control::deployment::deployment(&state).await?,
    ))
}
