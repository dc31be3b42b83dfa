//! Saved credentials: what `roost up` writes to
//! `$XDG_CONFIG_HOME/roost/credentials.json` (or
//! `~/.config/roost/credentials.json`, mode 0600): the server URL, an org
//! token, and the path of the server's admin token file. The CLI uses them
//! when neither `--url`/`--token` nor `ROOST_URL`/`ROOST_TOKEN` say
//! otherwise: org commands the org token, admin commands the admin token
//! read from that file (never copied here).

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

/// What `roost up` saved: its URL and org token, and where its server
/// keeps the admin token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Saved {
    pub url: String,
    pub token: String,
    pub admin_token_file: Option<PathBuf>,
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
pub fn load() -> Result<Option<Saved>> {
    let Some(path) = path() else {
        return Ok(None);
    };
    let Some(value) = read_json(&path)? else {
        return Ok(None);
    };
    let [url, token] = string_fields(&path, &value, ["url", "token"])?;
    Ok(Some(Saved {
        url,
        token,
        admin_token_file: value["admin_token_file"].as_str().map(PathBuf::from),
    }))
}

/// The string fields `names` of the JSON file at `path`; `None` if there
/// is no such file. Shared with `roost up`'s own token file.
pub fn read_secret_fields<const N: usize>(
    path: &Path,
    names: [&str; N],
) -> Result<Option<[String; N]>> {
    match read_json(path)? {
        Some(value) => Ok(Some(string_fields(path, &value, names)?)),
        None => Ok(None),
    }
}

/// The JSON file at `path`; `None` if there is no such file.
fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    serde_json::from_str(&text)
        .map(Some)
        .with_context(|| format!("{} is not JSON", path.display()))
}

fn string_fields<const N: usize>(
    path: &Path,
    value: &serde_json::Value,
    names: [&str; N],
) -> Result<[String; N]> {
    let mut fields: [String; N] = std::array::from_fn(|_| String::new());
    for (field, name) in fields.iter_mut().zip(names) {
        value[name]
            .as_str()
            .with_context(|| format!("{} has no string {name:?}", path.display()))?
            .clone_into(field);
    }
    Ok(fields)
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

/// Writes `saved` (mode 0600, replaced atomically); returns the path.
pub fn save(saved: &Saved) -> Result<PathBuf> {
    let Some(path) = path() else {
        bail!("cannot save credentials: neither XDG_CONFIG_HOME nor HOME is set");
    };
    let dir = path.parent().context("credentials path has no directory")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut body = json!({ "url": saved.url, "token": saved.token });
    if let Some(file) = &saved.admin_token_file {
        body["admin_token_file"] = json!(file.display().to_string());
    }
    write_secret_json(&path, &body)?;
    Ok(path)
}

/// `url` if the client can call it: `http://` or `https://` and a host.
fn checked_url(url: &str) -> Result<String> {
    match reqwest::Url::parse(url) {
        Ok(parsed) if matches!(parsed.scheme(), "http" | "https") && parsed.has_host() => {
            Ok(url.to_owned())
        }
        _ => bail!("invalid server URL {url}: use http:// or https://, e.g. {DEFAULT_URL}"),
    }
}

/// The URL given (flag or `ROOST_URL`), else the saved one, else
/// [`DEFAULT_URL`]; checked.
fn pick_url(given: Option<&str>, saved: Option<&str>) -> Result<String> {
    checked_url(
        given
            .filter(|u| !u.is_empty())
            .or(saved)
            .unwrap_or(DEFAULT_URL),
    )
}

/// The URL and org token to use. A saved token is used only with the
/// saved URL, so it is never sent to another server.
pub fn resolve(url: Option<&str>, token: Option<&str>) -> Result<Credentials> {
    let saved = load()?.map(|saved| Credentials {
        url: saved.url,
        token: saved.token,
    });
    resolve_with(saved, url, token)
}

/// [`resolve`] with the saved credentials given. Empty values count as
/// not given (`ROOST_TOKEN= roost …`).
fn resolve_with(
    saved: Option<Credentials>,
    url: Option<&str>,
    token: Option<&str>,
) -> Result<Credentials> {
    let url = pick_url(url, saved.as_ref().map(|s| s.url.as_str()))?;
    let token = match (token.filter(|t| !t.is_empty()), &saved) {
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

/// The URL and admin token to use: the token given, else the one in the
/// admin token file `roost up` saved the path of (only for its URL).
pub fn resolve_admin(url: Option<&str>, token: Option<&str>) -> Result<Credentials> {
    resolve_admin_with(load()?, url, token)
}

fn resolve_admin_with(
    saved: Option<Saved>,
    url: Option<&str>,
    token: Option<&str>,
) -> Result<Credentials> {
    let url = pick_url(url, saved.as_ref().map(|s| s.url.as_str()))?;
    if let Some(token) = token.filter(|t| !t.is_empty()) {
        return Ok(Credentials {
            url,
            token: token.to_owned(),
        });
    }
    match saved {
        Some(Saved {
            url: saved_url,
            admin_token_file: Some(file),
            ..
        }) if saved_url == url => {
            let token = std::fs::read_to_string(&file).with_context(|| {
                format!(
                    "reading the admin token {} (saved by `roost up`)",
                    file.display()
                )
            })?;
            Ok(Credentials {
                url,
                token: token.trim().to_owned(),
            })
        }
        _ => bail!(
            "no admin token for {url}: pass --token or set ROOST_TOKEN (`roost server` prints it on its first start and keeps it in DATA_DIR/admin-token; after `roost up`, admin commands find it themselves)"
        ),
    }
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

    #[test]
    fn only_http_and_https_servers_are_called() {
        let err = resolve_with(None, Some("ftp://host/"), Some("t")).expect_err("ftp");
        assert!(
            err.to_string()
                .starts_with("invalid server URL ftp://host/: use http:// or https://"),
            "{err}"
        );
        assert!(resolve_with(None, Some("127.0.0.1:7070"), Some("t")).is_err());
        assert!(resolve_admin_with(None, Some("ftp://host/"), Some("t")).is_err());
        assert_eq!(
            resolve_with(None, Some("https://roost.example/"), Some("t"))
                .expect("https")
                .url,
            "https://roost.example/"
        );
    }

    #[test]
    fn admin_commands_read_the_admin_token_roost_up_saved_for_its_url() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("admin-token");
        std::fs::write(&file, "roost_admin_x\n").expect("write");
        let saved = Some(Saved {
            url: "http://127.0.0.1:7070".to_owned(),
            token: "org".to_owned(),
            admin_token_file: Some(file),
        });
        let resolve = |url, token| resolve_admin_with(saved.clone(), url, token);
        assert_eq!(
            resolve(None, None).expect("saved"),
            Credentials {
                url: "http://127.0.0.1:7070".to_owned(),
                token: "roost_admin_x".to_owned()
            }
        );
        assert_eq!(resolve(None, Some("t")).expect("flag").token, "t");
        // Another server never gets it.
        let elsewhere = resolve(Some("http://other:7070"), None).expect_err("no token");
        assert!(
            elsewhere
                .to_string()
                .starts_with("no admin token for http://other:7070: pass --token"),
            "{elsewhere}"
        );
        assert!(resolve_admin_with(None, None, None).is_err());
    }
}
