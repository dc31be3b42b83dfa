//! Saved credentials: the server URL and org token `roost up` writes to
//! `$XDG_CONFIG_HOME/roost/credentials.json` (or
//! `~/.config/roost/credentials.json`, mode 0600), which the CLI uses when
//! neither `--url`/`--token` nor `ROOST_URL`/`ROOST_TOKEN` say otherwise.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde_json::json;

/// Where the CLI reaches the server when nothing says otherwise.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7070";

/// A server and the token to use there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credentials {
    pub url: String,
    pub token: String,
}

/// The credentials file's path, or `None` when neither `XDG_CONFIG_HOME`
/// nor `HOME` is set (absolute).
pub fn path() -> Option<PathBuf> {
    let absolute = |name: &str| {
        std::env::var_os(name)
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    let config =
        absolute("XDG_CONFIG_HOME").or_else(|| absolute("HOME").map(|h| h.join(".config")))?;
    Some(config.join("roost").join("credentials.json"))
}

/// The saved credentials, `None` if there are none. A file that is there
/// but unreadable is an error naming it, never silently skipped.
pub fn load() -> Result<Option<Credentials>> {
    let Some(path) = path() else {
        return Ok(None);
    };
    Ok(read_secret_fields(&path, ["url", "token"])?.map(|[url, token]| Credentials { url, token }))
}

/// The string fields `names` of the JSON file at `path`; `None` if there
/// is no such file. Shared with `roost up`'s own token file.
pub fn read_secret_fields<const N: usize>(
    path: &Path,
    names: [&str; N],
) -> Result<Option<[String; N]>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let mut fields = Vec::with_capacity(N);
    for name in names {
        let field = value[name]
            .as_str()
            .with_context(|| format!("{} has no string {name:?}", path.display()))?;
        fields.push(field.to_owned());
    }
    Ok(fields.try_into().ok())
}

/// Writes `body` to `path` as JSON, mode 0600, replaced atomically (a
/// synced temporary renamed into place), so a reader never sees half.
pub fn write_secret_json(path: &Path, body: &serde_json::Value) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let temporary = path.with_extension("json.tmp");
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&temporary)
        .and_then(|mut file| {
            file.write_all(format!("{body:#}\n").as_bytes())?;
            file.sync_all()
        })
        .with_context(|| format!("writing {}", temporary.display()))?;
    std::fs::rename(&temporary, path).with_context(|| format!("writing {}", path.display()))
}

/// Writes `credentials` (mode 0600, replaced atomically); returns the path.
pub fn save(credentials: &Credentials) -> Result<PathBuf> {
    let Some(path) = path() else {
        bail!("cannot save credentials: neither XDG_CONFIG_HOME nor HOME is set");
    };
    let dir = path.parent().context("credentials path has no directory")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    write_secret_json(
        &path,
        &json!({ "url": credentials.url, "token": credentials.token }),
    )?;
    Ok(path)
}

/// The URL to use: the one given (flag or `ROOST_URL`), else the saved
/// one, else [`DEFAULT_URL`].
pub fn resolve_url(given: Option<&str>) -> Result<String> {
    if let Some(url) = given.filter(|u| !u.is_empty()) {
        return Ok(url.to_owned());
    }
    Ok(load()?.map_or_else(|| DEFAULT_URL.to_owned(), |saved| saved.url))
}

/// The URL and org token to use. A saved token is used only with the
/// saved URL, so it is never sent to another server.
pub fn resolve(url: Option<&str>, token: Option<&str>) -> Result<Credentials> {
    resolve_with(load()?, url, token)
}

/// [`resolve`] with the saved credentials given. Empty values count as
/// not given (`ROOST_TOKEN= roost …`).
fn resolve_with(
    saved: Option<Credentials>,
    url: Option<&str>,
    token: Option<&str>,
) -> Result<Credentials> {
    let url = url.filter(|u| !u.is_empty());
    let token = token.filter(|t| !t.is_empty());
    let url = match (url, &saved) {
        (Some(url), _) => url.to_owned(),
        (None, Some(saved)) => saved.url.clone(),
        (None, None) => DEFAULT_URL.to_owned(),
    };
    let token = match (token, &saved) {
        (Some(token), _) => token.to_owned(),
        (None, Some(saved)) if saved.url == url => saved.token.clone(),
        _ => {
            let hint = path().map_or_else(String::new, |p| {
                format!(" (or run `roost up`, which saves them in {})", p.display())
            });
            bail!("no token for {url}: pass --token or set ROOST_TOKEN{hint}");
        }
    };
    Ok(Credentials { url, token })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_win_and_a_saved_token_stays_with_its_server() {
        let saved = Some(Credentials {
            url: "http://127.0.0.1:7070".to_owned(),
            token: "saved".to_owned(),
        });
        let resolve = |url, token| resolve_with(saved.clone(), url, token);
        assert_eq!(
            resolve(None, None).expect("saved"),
            Credentials {
                url: "http://127.0.0.1:7070".to_owned(),
                token: "saved".to_owned()
            }
        );
        assert_eq!(resolve(None, Some("t")).expect("flag").token, "t");
        assert_eq!(resolve(Some(""), Some("")).expect("empty").token, "saved");
        // Another server never gets the saved token.
        let elsewhere = resolve(Some("http://other:7070"), None).expect_err("no token");
        assert!(
            elsewhere
                .to_string()
                .contains("no token for http://other:7070")
        );
        assert_eq!(
            resolve(Some("http://other:7070"), Some("t"))
                .expect("both given")
                .url,
            "http://other:7070"
        );
        let nothing = resolve_with(None, None, None).expect_err("nothing saved");
        assert!(nothing.to_string().contains("--token"), "{nothing}");
    }
}
