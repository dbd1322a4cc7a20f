//! The guide (docs/guide, an mdBook) builds, and no link in it is broken: every relative
//! link of the built HTML reaches a page that exists, and every `#anchor` an element id on
//! that page. Checked on mdbook's output rather than on the Markdown, so the check reads
//! links exactly as a reader's browser will (mdbook rewrites `.md` to `.html`).
//!
//! mdbook comes from `scripts/mdbook.sh` (`make test` sets `EGRESS_MDBOOK`), or `PATH`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use integration_tests::harness::cannot_run;

fn guide_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/guide")
}

fn mdbook() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("EGRESS_MDBOOK") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("mdbook"))
        .find(|p| p.is_file())
}

/// Values of `attr="..."` in an HTML text.
fn attribute_values<'a>(html: &'a str, attr: &str) -> Vec<&'a str> {
    let needle = format!(" {attr}=\"");
    let mut out = Vec::new();
    let mut rest = html;
    while let Some(i) = rest.find(&needle) {
        rest = &rest[i + needle.len()..];
        if let Some(end) = rest.find('"') {
            out.push(&rest[..end]);
            rest = &rest[end..];
        }
    }
    out
}

fn html_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            html_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "html") {
            out.push(path);
        }
    }
}

/// Broken relative links of the built book at `root`: (page, link, why).
fn broken_links(root: &Path) -> Vec<String> {
    let mut pages = Vec::new();
    html_files(root, &mut pages);
    let mut ids: BTreeMap<PathBuf, BTreeSet<String>> = BTreeMap::new();
    let mut texts = BTreeMap::new();
    for p in &pages {
        let text = std::fs::read_to_string(p).unwrap();
        let canonical = p.canonicalize().unwrap();
        ids.insert(
            canonical.clone(),
            attribute_values(&text, "id")
                .into_iter()
                .map(String::from)
                .collect(),
        );
        texts.insert(canonical, text);
    }
    let mut broken = Vec::new();
    for (page, text) in &texts {
        for href in attribute_values(text, "href") {
            let external = ["http://", "https://", "mailto:", "javascript:", "data:"]
                .iter()
                .any(|s| href.starts_with(s));
            if external || href.is_empty() {
                continue;
            }
            let (target, anchor) = match href.split_once('#') {
                Some((t, a)) => (t, Some(a)),
                None => (href, None),
            };
            let target = target.split('?').next().unwrap_or("");
            let file = if target.is_empty() {
                page.clone()
            } else {
                // A root-relative link (the 404 page's `/`) is relative to where the book
                // is served: mdbook's default `site-url` is `/`.
                let joined = match target.strip_prefix('/') {
                    Some(rest) => root.join(rest),
                    None => page.parent().unwrap().join(target),
                };
                let joined = if joined.is_dir() {
                    joined.join("index.html")
                } else {
                    joined
                };
                match joined.canonicalize() {
                    Ok(f) => f,
                    Err(_) => {
                        broken.push(format!("{}: {href}: no such file", page.display()));
                        continue;
                    }
                }
            };
            if let Some(anchor) = anchor.filter(|a| !a.is_empty())
                && let Some(known) = ids.get(&file)
                && !known.contains(anchor)
            {
                broken.push(format!(
                    "{}: {href}: {} has no id {anchor:?}",
                    page.display(),
                    file.display()
                ));
            }
        }
    }
    broken
}

fn build(mdbook: &Path, src: &Path, out: &Path) {
    let result = Command::new(mdbook)
        .arg("build")
        .arg(src)
        .arg("--dest-dir")
        .arg(out)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", mdbook.display()));
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(result.status.success(), "mdbook build failed:\n{stderr}");
    // mdbook reports a missing chapter file or a bad SUMMARY as a warning and goes on.
    assert!(
        !stderr.contains("WARN") && !stderr.contains("ERROR"),
        "mdbook build warned:\n{stderr}"
    );
}

#[test]
fn the_guide_builds_with_no_broken_link() {
    let Some(mdbook) = mdbook() else {
        cannot_run("mdbook is not installed (scripts/mdbook.sh builds it; make test runs it)");
        return;
    };
    let out = tempfile::tempdir().unwrap();
    build(&mdbook, &guide_dir(), out.path());
    let chapters = [
        "getting-started",
        "deploying",
        "hosts",
        "plugins",
        "pools",
        "leases",
        "operations",
        "scale",
        "development",
    ];
    for c in chapters {
        assert!(
            out.path().join(format!("{c}.html")).is_file(),
            "no chapter {c}"
        );
    }
    let broken = broken_links(out.path());
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_link_check_finds_a_broken_link_and_anchor() {
    let Some(mdbook) = mdbook() else {
        cannot_run("mdbook is not installed (scripts/mdbook.sh builds it; make test runs it)");
        return;
    };
    let book = tempfile::tempdir().unwrap();
    let src = book.path().join("src");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(book.path().join("book.toml"), "[book]\ntitle = \"t\"\n").unwrap();
    std::fs::write(
        src.join("SUMMARY.md"),
        "# Summary\n\n- [A](a.md)\n- [B](b.md)\n",
    )
    .unwrap();
    std::fs::write(
        src.join("a.md"),
        "# A\n\n[ok](b.md#real-heading) [gone](missing.md) [bad anchor](b.md#nope)\n",
    )
    .unwrap();
    std::fs::write(src.join("b.md"), "# B\n\n## Real heading\n").unwrap();
    let out = book.path().join("book");
    build(&mdbook, book.path(), &out);
    let broken = broken_links(&out);
    assert!(
        broken.iter().any(|b| b.contains("missing.html")),
        "{broken:?}"
    );
    assert!(broken.iter().any(|b| b.contains("\"nope\"")), "{broken:?}");
    assert!(
        !broken.iter().any(|b| b.contains("real-heading")),
        "{broken:?}"
    );
}
