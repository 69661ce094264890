//! `/docs` and `/redoc`: the OpenAPI document as pages a browser reads, where the reference serves
//! FastAPI's. Like those, the interactive viewers (Swagger UI, ReDoc) load their scripts from a
//! CDN; below them each page carries an index of every route rendered here, so a server with no way
//! out to the internet still has readable docs. Both are public, as `/openapi.json` is: they hold
//! nothing the document does not.

use axum::response::Html;
use serde_json::Value;
use utoipa::OpenApi;

use crate::http::openapi::ApiDoc;

const SWAGGER_UI: &str = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5";
const REDOC: &str = "https://cdn.jsdelivr.net/npm/redoc@2/bundles/redoc.standalone.js";

pub async fn swagger() -> Html<String> {
    let viewer = format!(
        r##"<link rel="stylesheet" href="{SWAGGER_UI}/swagger-ui.css">
<div id="swagger-ui"></div>
<script src="{SWAGGER_UI}/swagger-ui-bundle.js"></script>
<script>
if (window.SwaggerUIBundle) {{
  SwaggerUIBundle({{ url: "/openapi.json", dom_id: "#swagger-ui" }});
  document.getElementById("index").hidden = true;
}}
</script>"##
    );
    Html(page("docs", &viewer))
}

pub async fn redoc() -> Html<String> {
    let viewer = format!(
        r#"<div id="redoc"></div>
<script src="{REDOC}"></script>
<script>
if (window.Redoc) {{
  Redoc.init("/openapi.json", {{}}, document.getElementById("redoc"));
  document.getElementById("index").hidden = true;
}}
</script>"#
    );
    Html(page("ReDoc", &viewer))
}

fn page(kind: &str, viewer: &str) -> String {
    let doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or_default();
    let title = escape(doc["info"]["title"].as_str().unwrap_or("Warren"));
    format!(
        r#"<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} - {kind}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 0; }}
#index {{ max-width: 60rem; margin: 2rem auto; padding: 0 1rem; }}
#index table {{ border-collapse: collapse; width: 100%; }}
#index td, #index th {{ text-align: left; padding: .3rem .6rem; border-bottom: 1px solid #ddd; vertical-align: top; }}
#index code {{ white-space: nowrap; }}
</style>
</head>
<body>
{viewer}
<div id="index">
{index}
</div>
</body>
</html>
"#,
        index = index(&doc),
    )
}

/// Every route of the document: method, path, summary, answers.
fn index(doc: &Value) -> String {
    let mut out = format!(
        "<h1>{}</h1>\n<p>{}</p>\n<p>The document itself: <a href=\"/openapi.json\">/openapi.json</a>.</p>\n\
         <table>\n<tr><th>method</th><th>path</th><th>what</th><th>answers</th></tr>\n",
        escape(doc["info"]["title"].as_str().unwrap_or_default()),
        escape(doc["info"]["description"].as_str().unwrap_or_default()),
    );
    let Some(paths) = doc["paths"].as_object() else {
        return out;
    };
    for (path, item) in paths {
        let Some(ops) = item.as_object() else {
            continue;
        };
        for method in ["get", "post", "put", "patch", "delete"] {
            let Some(op) = ops.get(method) else {
                continue;
            };
            let what = op["summary"]
                .as_str()
                .or_else(|| op["description"].as_str())
                .unwrap_or_default();
            let answers: Vec<&str> = op["responses"]
                .as_object()
                .map(|r| r.keys().map(String::as_str).collect())
                .unwrap_or_default();
            out.push_str(&format!(
                "<tr><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td></tr>\n",
                method.to_uppercase(),
                escape(path),
                escape(what),
                escape(&answers.join(", ")),
            ));
        }
    }
    out.push_str("</table>");
    out
}

fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn pages_index_every_route_of_the_document() {
        let doc = serde_json::to_value(ApiDoc::openapi()).expect("doc");
        for Html(page) in [swagger().await, redoc().await] {
            assert!(page.starts_with("<!doctype html>"));
            assert!(
                page.contains("\"/openapi.json\""),
                "the viewer loads the document"
            );
            for path in doc["paths"].as_object().expect("paths").keys() {
                assert!(
                    page.contains(&format!("<code>{}</code>", escape(path))),
                    "{path} not indexed"
                );
            }
        }
    }

    #[test]
    fn text_is_escaped() {
        assert_eq!(
            escape(r#"<a href="x">&'"#),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }
}
