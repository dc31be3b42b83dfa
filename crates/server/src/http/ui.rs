//! `/ui`: the web dashboard, its three files embedded in the binary (no
//! CDN, no build step; `crates/server/ui/`). The page talks only to the
//! public `/v1` API with the token the user signs in with. Served with a
//! strict Content-Security-Policy: scripts and styles from this origin only
//! (no inline script, no `eval`), requests to this origin only.

use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

pub const INDEX_HTML: &str = include_str!("../../ui/index.html");
pub const APP_JS: &str = include_str!("../../ui/app.js");
pub const STYLE_CSS: &str = include_str!("../../ui/style.css");

/// What the page may load and where it may connect: nothing but this
/// origin's files and API (record text is data, and even a mistake that
/// rendered it as HTML could run no script of its own).
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

pub async fn index() -> Response {
    asset(INDEX_HTML, "text/html; charset=utf-8")
}

pub async fn app_js() -> Response {
    asset(APP_JS, "text/javascript; charset=utf-8")
}

pub async fn style_css() -> Response {
    asset(STYLE_CSS, "text/css; charset=utf-8")
}

fn asset(body: &'static str, content_type: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    // The files change with the binary: revalidate rather than run an old
    // script against a new API.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}
