"""GET /docs's page: self-contained HTML (no CDN) that fetches the OpenAPI schema and renders
each operation with its request fields, response fields and error statuses."""

from __future__ import annotations

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>aioserve API</title>
<style>
body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}
code,pre{background:#f4f4f4;padding:.1rem .3rem}pre{padding:.5rem;overflow-x:auto}
h2{margin-top:2rem;font-size:1.1rem}.method{text-transform:uppercase;font-weight:bold}
</style></head>
<body><h1>aioserve API</h1>
<p>The machine-readable schema is at <a href="__SCHEMA__">__SCHEMA__</a>.</p>
<div id="operations">Loading...</div>
<script>
const schemas = {};
function resolve(schema) {
  if (schema && schema.$ref) return schemas[schema.$ref.split("/").pop()];
  return schema;
}
function fields(schema) {
  schema = resolve(schema);
  if (!schema || !schema.properties) return "";
  const rows = Object.entries(schema.properties).map(([name, s]) =>
    "<li><code>" + name + "</code> " + JSON.stringify(s.type || s.const || s.oneOf || s) + "</li>");
  return "<ul>" + rows.join("") + "</ul>";
}
fetch("__SCHEMA__").then(r => r.json()).then(doc => {
  Object.assign(schemas, doc.components.schemas);
  let html = "";
  for (const [path, operations] of Object.entries(doc.paths)) {
    for (const [method, op] of Object.entries(operations)) {
      html += "<h2><span class=method>" + method + "</span> <code>" + path + "</code></h2>";
      html += "<p>" + op.summary + "</p>";
      if (op.requestBody) {
        const body = op.requestBody.content["application/json"].schema;
        html += "<p>Request body:</p>" + fields(body);
      }
      const ok = op.responses["200"];
      if (ok && ok.content && ok.content["application/json"]) {
        html += "<p>Response:</p>" + fields(ok.content["application/json"].schema);
      }
      const errors = Object.keys(op.responses).filter(code => code !== "200");
      if (errors.length) html += "<p>Errors: " + errors.join(", ") + "</p>";
    }
  }
  document.getElementById("operations").innerHTML = html;
});
</script></body></html>
"""


def docs_page(schema_url: str) -> str:
    """The page, reading the schema from `schema_url`."""
    return _PAGE.replace("__SCHEMA__", schema_url)
